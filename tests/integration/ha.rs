//! High availability on a real etcd: two `berth serve` processes, one the
//! leader and one a standby that serves nothing; kill -9 of the leader; the
//! standby takes over from etcd with every job and allocation, and no GPU
//! has two owners. The test starts its own etcd (scripts/install-etcd.sh
//! installs it) on free loopback ports with a temporary data directory.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use berth::proto as pb;

use crate::agent::{agent, agent_job, assert_one_owner, dir, free_port, held_gpus, jobs, kill9, node_info, plain, serve, spawn, until, until_logged, Proc};

/// A single-member etcd on free loopback ports, or None (with a message)
/// where etcd is not installed and this is not CI.
async fn etcd(d: &Path) -> Option<(Proc, String)> {
    if Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
        crate::common::skip("etcd is not installed (scripts/install-etcd.sh)");
        return None;
    }
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(d.join("etcd.log")).unwrap();
    let child = Command::new("etcd")
        .args(["--name", "t", "--data-dir"])
        .arg(d.join("etcd-data"))
        .args(["--listen-client-urls", &url, "--advertise-client-urls", &url, "--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("t={peer_url}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawning etcd");
    let etcd = Proc(child);
    let health = format!("127.0.0.1:{client}");
    until("etcd to accept connections", Duration::from_secs(60), || {
        let ok = std::net::TcpStream::connect(&health).is_ok();
        async move { ok.then_some(()) }
    })
    .await;
    Some((etcd, url))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_cannot_write() {
    let d = dir("fence");
    let Some((_etcd, etcd_url)) = etcd(&d).await else { return };
    let common = ["--etcd", etcd_url.as_str(), "--lease-ttl-s", "1"];
    let (a, url_a) = serve(&d, "a", &d.join("a"), &common).await;
    let lb = format!("127.0.0.1:{}", free_port());
    let mut b_args: Vec<String> = vec!["--listen".into(), lb.clone()];
    b_args.extend(common.iter().map(|s| s.to_string()));
    // B campaigns while A leads; A is frozen (SIGSTOP) past its lease, so B
    // takes over; then A wakes up believing it leads.
    let b_task = {
        let d = d.clone();
        tokio::spawn(async move {
            let args: Vec<&str> = b_args.iter().map(String::as_str).collect();
            serve(&d, "b", &d.join("b"), &args).await
        })
    };
    until("B campaigning", Duration::from_secs(120), || {
        let t = plain(&std::fs::read_to_string(d.join("b.log")).unwrap_or_default());
        async move { t.contains("campaigning").then_some(()) }
    })
    .await;
    let pid = a.0.id() as i32;
    // SAFETY: signalling the child this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let (_b, url_b) = b_task.await.unwrap();
    let mut b = berth::client::connect(&url_b, Some("ops-test-token"), None, None).await.unwrap();
    let job = pb::JobSpec { partition: "p0".into(), gpus: 1, duration_s: 600.0, ..Default::default() };
    let on_b = b.submit_job(pb::SubmitJobRequest { job: Some(job.clone()), ..Default::default() }).await.unwrap().into_inner().job_id;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let mut a_api = berth::client::connect(&url_a, Some("ops-test-token"), None, None).await.unwrap();
    let refused = a_api.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("not the leader"), "{}", refused.message());
    let on_b_now: Vec<u64> = jobs(&b).await.iter().map(|j| j.id).collect();
    assert_eq!(on_b_now, vec![on_b], "only the leader's job exists");
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_from_etcd_when_the_leader_is_killed() {
    let d = dir("ha");
    let Some((_etcd, etcd_url)) = etcd(&d).await else { return };
    let (pa, pb_) = (free_port(), free_port());
    let (la, lb) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb_}"));
    let common = ["--etcd", etcd_url.as_str(), "--lease-ttl-s", "2", "--agent-timeout-ms", "1500"];
    let mut a_args = vec!["--listen", la.as_str()];
    a_args.extend(common);
    let (mut leader, url_a) = serve(&d, "a", &d.join("a"), &a_args).await;

    // The standby campaigns, sees the leader, and serves nothing.
    let access = d.join("access.toml");
    let b_state = d.join("b");
    let mut b_args = vec!["serve", "--metrics-listen", "off", "--access", access.to_str().unwrap(), "--state-dir", b_state.to_str().unwrap(), "--listen", lb.as_str()];
    b_args.extend(common);
    let _standby = spawn(&b_args, &d.join("b.log"));
    let b_log = d.join("b.log");
    until("the standby waiting", Duration::from_secs(120), || {
        let t = plain(&std::fs::read_to_string(&b_log).unwrap_or_default());
        async move { t.contains("standby:").then_some(()) }
    })
    .await;
    assert!(std::net::TcpStream::connect(&lb).is_err(), "a standby must not serve");

    // Work on the leader: an agent task holding 2 of n1's 4 GPUs, simulated
    // jobs running and one that cannot fit.
    let url_b = format!("http://{lb}");
    let servers = format!("{url_a},{url_b}");
    let _n1 = agent(&d, &servers, "n1", "4xH20", &[]);
    let mut api = berth::client::connect(&url_a, Some("ops-test-token"), None, None).await.unwrap();
    until("n1 schedulable on the leader", Duration::from_secs(60), || {
        let api = api.clone();
        async move { node_info(&api, "n1").await.filter(|n| n.schedulable) }
    })
    .await;
    // A policy version uploaded to the leader and activated on p1: the
    // registry lives in etcd too.
    let component = std::fs::read(crate::common::policy_path("spread")).unwrap();
    let up = api
        .upload_policy(pb::UploadPolicyRequest { partition: "p1".into(), component, note: "before the failover".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .policy
        .unwrap();
    api.activate_policy(pb::ActivatePolicyRequest { partition: "p1".into(), version: up.version, ..Default::default() }).await.unwrap();
    let held = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let sim = |gpus, tasks| pb::JobSpec { partition: "p0".into(), gpus, tasks, duration_s: 3600.0, ..Default::default() };
    for spec in [sim(1, 1), sim(8, 3), sim(8, 1000)] {
        api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap();
    }
    let before = until("the leader's jobs running", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let js = jobs(&api).await;
            let up = js.iter().any(|j| j.id == held && j.runs.iter().all(|r| r.state == "running"));
            (up && js.iter().filter(|j| j.state == "running").count() == 3).then_some(js)
        }
    })
    .await;

    // kill -9 the leader: the standby takes over once the lease ends.
    kill9(&mut leader);
    let killed = Instant::now();
    let text = until("the standby serving", Duration::from_secs(60), || {
        let t = plain(&std::fs::read_to_string(&b_log).unwrap_or_default());
        async move { t.contains("API on").then_some(t) }
    })
    .await;
    let took = killed.elapsed();
    let recovered = text.lines().find(|l| l.contains("state recovered")).unwrap_or_default().to_string();
    eprintln!("failover: the standby served {took:?} after the leader's kill -9 (lease TTL 2 s); {recovered}");
    assert!(recovered.contains("jobs=4") && recovered.contains("running=3"), "{recovered}");

    let mut api = berth::client::connect(&url_b, Some("ops-test-token"), None, None).await.unwrap();
    let after = jobs(&api).await;
    let key = |js: &[pb::Job]| js.iter().map(|j| (j.id, j.state.clone(), j.placements.clone(), j.runs.iter().map(|r| r.allocation_id).collect::<Vec<_>>())).collect::<Vec<_>>();
    assert_eq!(key(&after), key(&before), "no job lost or changed in the failover");
    assert_eq!(held_gpus(&after), held_gpus(&before));
    let parts = api.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    let p1 = parts.iter().find(|p| p.name == "p1").unwrap().active.clone().unwrap();
    assert_eq!((p1.version, p1.name.as_str(), p1.sha256.as_str()), (up.version, "spread", up.sha256.as_str()), "the new leader runs the policy version activated before");

    // The agent moves to the new leader; its task is adopted and keeps its
    // GPUs: 2 free on n1.
    until_logged(&d, "n1 back on the new leader with its task", Duration::from_secs(60), || {
        let api = api.clone();
        async move { node_info(&api, "n1").await.filter(|n| n.schedulable && n.gpus_idle == 2) }
    })
    .await;
    let three = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 3, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    assert!(three > before.iter().map(|j| j.id).max().unwrap(), "job ids continue on the new leader");
    let two = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    until_logged(&d, "a new 2-GPU task beside the adopted one", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == two && j.state == "running" && j.runs.iter().all(|r| r.state == "running")) }
    })
    .await;
    let now = jobs(&api).await;
    assert_one_owner(&now, &[]);
    assert_eq!(now.iter().find(|j| j.id == three).unwrap().state, "pending", "3 GPUs cannot fit beside 2 + 2");
    // The adopted task's exit reaches the new leader.
    std::fs::write(d.join(format!("release-{held}")), "0").unwrap();
    until_logged(&d, "the task started by the old leader finished", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == held && j.state == "finished") }
    })
    .await;
    for id in [two, three] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}
