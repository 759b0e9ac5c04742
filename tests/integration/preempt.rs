//! Live preemption through the engine: a real `berth serve` with a real
//! synthetic agent; low-priority tasks are real child processes. A
//! high-priority job that does not fit takes GPUs back through the
//! partition's rank policy (wasm), the victims get the priority contract
//! (checkpoint notice, stop after the notice) and go back to the queue; a
//! hostile rank version trips its breaker and the default ranking decides.

use std::path::Path;
use std::time::Duration;

use berth::proto as pb;

use crate::agent::{agent, agent_job, assert_one_owner, dir, free_port, jobs, kill9, serve, until, BERTH};
use crate::common::{guest_path, policy_path};

/// A task that records its checkpoint notices (the agent's checkpoint hook
/// writes `ckpt-<allocation>`), writes the GPUs it sees, and runs until
/// `release-<job>` exists (or two minutes).
fn low_job(d: &Path, gpus: u32) -> pb::JobSpec {
    agent_job(d, gpus, 1)
}

pub(crate) async fn upload_rank(api: &mut berth::client::Client, path: &Path) -> u32 {
    let component = std::fs::read(path).unwrap();
    let up = api
        .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: "rank".into(), ..Default::default() })
        .await
        .expect("upload rank")
        .into_inner()
        .policy
        .unwrap();
    api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.version, hook: "rank".into() }).await.expect("activate rank");
    up.version
}

pub(crate) async fn running(api: &berth::client::Client, ids: &[u64]) -> Vec<pb::Job> {
    let ids = ids.to_vec();
    until("jobs running with their processes", Duration::from_secs(60), || {
        let api = api.clone();
        let ids = ids.clone();
        async move {
            let js = jobs(&api).await;
            let run: Vec<pb::Job> =
                js.into_iter().filter(|j| ids.contains(&j.id) && j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|r| r.state == "running")).collect();
            (run.len() == ids.len()).then_some(run)
        }
    })
    .await
}

/// Waits until agent node `node` of p0 takes work.
pub(crate) async fn schedulable(api: &berth::client::Client, node: &str) {
    until("the agent node schedulable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
            nodes.iter().any(|n| n.name == node && n.schedulable).then_some(())
        }
    })
    .await;
}

/// Waits until every job of p0 has finished.
async fn all_finished(api: &berth::client::Client) {
    until("all done", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().all(|j| j.state == "finished").then_some(()) }
    })
    .await;
}

async fn evictions(api: &mut berth::client::Client) -> Vec<pb::Decision> {
    let req = pb::QueryDecisionsRequest { partition: "p0".into(), limit: 1000, ..Default::default() };
    api.query_decisions(req).await.unwrap().into_inner().decisions.into_iter().filter(|d| d.outcome == "evicted").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_job_preempts_the_rank_policys_victims_under_the_contract() {
    preempts_the_victims_of("spot-gpu").await;
}

/// The same with spot-gpu written in Python, uploaded with `--hook rank`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_rank_policy_chooses_the_victims_preempted_on_the_agents() {
    preempts_the_victims_of("spot-gpu-py").await;
}

/// A high-priority job preempts the victims the bundled rank policy `rank`
/// (spot-gpu's rule) chooses, under the contract, on a real agent.
async fn preempts_the_victims_of(rank: &str) {
    let d = dir(&format!("preempt-{rank}"));
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "1"]).await;
    let hook = format!("echo $BERTH_ALLOCATION > {}/ckpt-$BERTH_ALLOCATION", d.display());
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--checkpoint-hook", &hook]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    let spot = upload_rank(&mut api, &policy_path(rank)).await;

    // Low-priority fill: A (2 GPUs, oldest), then B and C (1 GPU each).
    let mut low = Vec::new();
    for gpus in [2, 1, 1] {
        let id = api.submit_job(pb::SubmitJobRequest { job: Some(low_job(&d, gpus)), ..Default::default() }).await.unwrap().into_inner().job_id;
        low.push(id);
        running(&api, &low).await; // started one after the other: A ran longest
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let (a, b, c) = (low[0], low[1], low[2]);
    let before = jobs(&api).await;
    let held: std::collections::BTreeMap<u64, Vec<u32>> = before.iter().filter(|j| low.contains(&j.id)).map(|j| (j.id, j.runs[0].gpus.clone())).collect();

    // A priority-5 job for 2 GPUs: nothing is free. spot-gpu takes the work
    // with the least to recompute (GPUs x time since the last checkpoint):
    // C then B, which is enough; A keeps running.
    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    let hj = running(&api, &[h]).await.remove(0);
    let mut got = hj.runs[0].gpus.clone();
    got.sort_unstable();
    let mut freed: Vec<u32> = held[&b].iter().chain(&held[&c]).copied().collect();
    freed.sort_unstable();
    assert_eq!(got, freed, "the high-priority job runs on its victims' GPUs");

    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    let state = |id: u64| all.iter().find(|j| j.id == id).unwrap().clone();
    assert_eq!(state(a).state, "running", "A is not a victim: {:?}", state(a));
    for v in [b, c] {
        let j = state(v);
        // Back in the queue (no GPU free for it now), its old process gone.
        assert_eq!(j.state, "pending", "{j:?}");
        assert!(j.detail.contains(&format!("preempted for job {h}")), "{j:?}");
        // The contract: a checkpoint notice reached each victim's process
        // before its stop.
        let alloc = before.iter().find(|x| x.id == v).unwrap().runs[0].allocation_id;
        let noted = std::fs::read_to_string(d.join(format!("ckpt-{alloc}"))).unwrap_or_default();
        assert_eq!(noted.trim(), alloc.to_string(), "no checkpoint notice for job {v}");
    }
    // Logged with the rank policy's name and version.
    let ev = evictions(&mut api).await;
    let mut victims: Vec<u64> = ev.iter().map(|d| d.job_id).collect();
    victims.sort_unstable();
    assert_eq!(victims, vec![b, c], "{ev:?}");
    assert!(ev.iter().all(|d| d.policy == rank && d.policy_version == spot && d.detail.contains(&format!("for job {h}"))), "{ev:?}");

    // Releasing the high job gives the victims their turn again.
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
    running(&api, &[b, c]).await;
    assert_one_owner(&jobs(&api).await, &[]);
    for id in low {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    all_finished(&api).await;
    // What the host was given replays to the same decisions, evictions included.
    let (_, report) = crate::capture::replays_exactly(&d, &url, &d.join("state"), 6);
    assert!(report.contains(rank), "{report}");
}

/// A low-priority one-GPU task running `script` in sh.
fn one_gpu_shell_job(script: String) -> pb::JobSpec {
    pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, cpu_milli: 1000, memory_mib: 1024, argv: vec!["sh".into(), "-c".into(), script], ..Default::default() }
}

/// A low-priority task that runs `berth checkpointed` once `ckpt-now-<job>`
/// exists (then writes `ckpt-done-<job>`), and ends on `release-<job>`.
/// (`berth` by name: the agent puts its own folder on a task's PATH.)
fn checkpointing_job(d: &Path) -> pb::JobSpec {
    let d = d.display();
    let script = format!(
        "i=0; while [ ! -f {d}/release-$BERTH_JOB ] && [ $i -lt 2400 ]; do \
           if [ -f {d}/ckpt-now-$BERTH_JOB ] && [ ! -f {d}/ckpt-done-$BERTH_JOB ]; then berth checkpointed && touch {d}/ckpt-done-$BERTH_JOB; fi; \
           sleep 0.05; i=$((i+1)); done; exit 0"
    );
    one_gpu_shell_job(script)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_checkpoint_report_changes_who_is_preempted() {
    let d = dir("preempt-ckpt");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "0"]).await;
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    upload_rank(&mut api, &policy_path("spot-gpu")).await;
    // A starts first: by time since start it has the most to recompute.
    let a = api.submit_job(pb::SubmitJobRequest { job: Some(checkpointing_job(&d)), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[a]).await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let b = api.submit_job(pb::SubmitJobRequest { job: Some(checkpointing_job(&d)), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[b]).await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    // Then A saves its work: now it has the least to recompute.
    let asked = berth::util::unix_ms();
    std::fs::write(d.join(format!("ckpt-now-{a}")), "").unwrap();
    let reported = until("A's checkpoint report reaches the host", Duration::from_secs(30), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == a).map(|j| j.runs[0].checkpointed_unix_ms).filter(|&t| t > 0) }
    })
    .await;
    assert!(d.join(format!("ckpt-done-{a}")).exists(), "`berth checkpointed` ran in the task");
    // Stamped when the task reported it: after it was asked to, not before.
    assert!(reported >= asked && reported <= berth::util::unix_ms(), "reported {reported}, asked {asked}");
    let b_run = jobs(&api).await.into_iter().find(|j| j.id == b).unwrap().runs[0].clone();
    assert_eq!(b_run.checkpointed_unix_ms, 0, "B never reported one");

    // newest-first in shadow beside spot-gpu: it ranks the same victims,
    // never actuated.
    let component = std::fs::read(policy_path("newest-first")).unwrap();
    let up = api.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: "rank".into(), ..Default::default() }).await.unwrap();
    let shadow = up.into_inner().policy.unwrap().version;
    let split = pb::SetShadowRequest { partition: "p0".into(), version: shadow, mode: pb::ShadowMode::Split as i32, fraction: 0.5, hook: "rank".into() };
    assert_eq!(api.set_shadow(split).await.unwrap_err().code(), tonic::Code::InvalidArgument, "a rank candidate runs in shadow only");
    api.set_shadow(pb::SetShadowRequest { partition: "p0".into(), version: shadow, mode: pb::ShadowMode::Shadow as i32, hook: "rank".into(), ..Default::default() })
        .await
        .unwrap();

    // One GPU for a high-priority job: spot-gpu takes A, the checkpointed one.
    let mut high = agent_job(&d, 1, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    let ev = evictions(&mut api).await;
    assert_eq!(ev.iter().map(|e| e.job_id).collect::<Vec<_>>(), vec![a], "{ev:?}");
    assert!(ev[0].policy == "spot-gpu", "{ev:?}");
    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    assert_eq!(all.iter().find(|j| j.id == b).unwrap().state, "running");
    // The shadow ranking would have taken B, the newest, losing more work.
    let report = api.shadow_report(pb::ShadowReportRequest { partition: "p0".into(), hook: "rank".into(), ..Default::default() }).await.unwrap().into_inner();
    let rank = report.rank.expect("a rank report");
    assert_eq!((report.mode.as_str(), rank.samples, rank.agreed, rank.candidate_errors), ("shadow", 1, 0, 0), "{report:?}");
    assert_eq!((rank.active_victims, rank.candidate_victims), (1, 1), "{rank:?}");
    assert!(rank.candidate_lost_gpu_s > rank.active_lost_gpu_s, "{rank:?}");
    assert_eq!(report.candidate.map(|c| c.name), Some("newest-first".to_string()));
    for id in [a, b, h] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    all_finished(&api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_rank_policy_trips_its_breaker_and_the_default_ranking_takes_over() {
    let d = dir("preempt-hostile");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "0"]).await;
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    let hostile = upload_rank(&mut api, &guest_path("hostile")).await;
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(low_job(&d, 2)), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[low]).await;
    // The hostile version answers an out-of-range index for priority 77.
    let mut high = agent_job(&d, 2, 1);
    high.priority = 77;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    assert_eq!(all.iter().find(|j| j.id == low).unwrap().state, "pending");
    let hist = api
        .policy_history(pb::PolicyHistoryRequest { partition: "p0".into(), hook: "rank".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hist.active_version, 0, "the hostile rank version is out of service");
    assert!(hist.events.iter().any(|e| e.kind == "breaker" && e.version == hostile && e.detail.contains("default ranking")), "{:?}", hist.events);
    let ev = evictions(&mut api).await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!((ev[0].job_id, ev[0].policy.as_str()), (low, "default-rank"));
    for id in [low, h] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    all_finished(&api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quote_matches_what_then_happens() {
    let d = dir("quote");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000"]).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--switch-domain", "7"]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    let quote = |api: &berth::client::Client, gpus: u32| {
        let mut api = api.clone();
        async move {
            let req = pb::QuoteRequest { partition: "p0".into(), gpus, cpu_milli: 1000, memory_mib: 1024, agent_nodes: true, deadline_h: 1.0, ..Default::default() };
            api.quote(req).await.unwrap().into_inner()
        }
    };
    let q = quote(&api, 4).await;
    assert_eq!((q.now, q.has_deadline, q.meets_deadline), (1, true, true), "{q:?}");
    // A copy that fits now starts now in every run forward.
    assert!(q.has_chance && q.probability == 1.0 && q.samples == 1000 && q.has_start && q.median_start_s == 0, "{q:?}");
    let q = quote(&api, 5).await;
    assert_eq!(q.now, 0, "five GPUs never fit a four-GPU node");
    assert!(q.has_chance && q.probability == 0.0 && q.started == 0 && !q.has_start && q.samples > 0, "{q:?}");
    assert!(q.low == 0.0 && q.high > 0.0 && q.high < 0.01, "the interval of 0 in {} runs: {q:?}", q.samples);
    // A 4-GPU job with a 4 s limit fills the node.
    let mut fill = agent_job(&d, 4, 1);
    fill.duration_s = 4.0;
    let first = api.submit_job(pb::SubmitJobRequest { job: Some(fill), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[first]).await;
    let q = quote(&api, 2).await;
    assert_eq!(q.now, 0, "{q:?}");
    assert!(q.has_next && q.next_in_s <= 4, "{q:?}");
    // No finished job to learn from: the running one ends at its limit in
    // every run, and the copy starts then (at the reference rate: this
    // fleet has no work model).
    assert!(q.has_chance && q.probability == 1.0 && q.has_start && q.median_start_s <= 4 && q.rate == 1.0, "{q:?}");
    let quoted = std::time::Instant::now() + Duration::from_secs(q.next_in_s);
    let next = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[next]).await;
    let now = std::time::Instant::now();
    // It started when the quote said, give or take the stop of the first
    // job's process (SIGTERM, then its exit report).
    assert!(now + Duration::from_secs(1) >= quoted, "started {:?} before the quote", quoted - now);
    assert!(now <= quoted + Duration::from_secs(10), "started {:?} after the quote", now - quoted);
    // The declared switch is the node's domain (shared by nodes declaring it).
    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    let n1 = nodes.iter().find(|n| n.name == "n1").unwrap();
    assert_eq!(n1.switch_domain, (1 << 24) + 7);
    std::fs::write(d.join(format!("release-{next}")), "0").unwrap();
}

/// `berth bench live` runs end to end and reports a decision per
/// preemption (the figures themselves are the benchmark's, not a test's).
#[test]
fn the_live_decision_benchmark_reports_every_preemption() {
    let out = std::process::Command::new(BERTH)
        .args(["bench", "live", "--nodes", "16", "--preemptions", "3", "--json"])
        .env("BERTH_POLICY_DIR", crate::common::repo_root().join("target/policies"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["nodes"].as_u64(), r["preemptions"].as_u64()), (Some(16), Some(3)), "{r}");
    let (p50, p99, max) = (r["pass_p50_us"].as_u64().unwrap(), r["pass_p99_us"].as_u64().unwrap(), r["pass_max_us"].as_u64().unwrap());
    assert!(0 < p50 && p50 <= p99 && p99 <= max, "{r}");
    // Capture is on by default, as in `berth serve`: the run wrote one.
    assert!(r["capture_bytes_bound"].as_u64().unwrap() > 0 && r["capture_bytes"].as_u64().unwrap() > 1000, "{r}");
}

/// A job taken back as often as its contract allows waits out the 24 hours
/// in the queue, even with its GPUs free again, so that all running
/// low-priority work stays preemptible; `berth explain` says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_at_its_interruption_limit_waits_out_the_day() {
    let d = dir("preempt-limit");
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--listen", listen.as_str(), "--agent-timeout-ms", "3000", "--notice-s", "0", "--max-interruptions-per-day", "1"];
    let (mut host, url) = serve(&d, "serve1", &d.join("state"), &args).await;
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    upload_rank(&mut api, &policy_path("spot-gpu")).await;
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(low_job(&d, 2)), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[low]).await;
    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    assert_eq!(evictions(&mut api).await.iter().map(|e| e.job_id).collect::<Vec<_>>(), vec![low]);
    // The high-priority job ends: its GPUs are free, the victim stays queued.
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
    until("the high-priority job finished", Duration::from_secs(30), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().any(|j| j.id == h && j.state == "finished").then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let j = jobs(&api).await.into_iter().find(|j| j.id == low).unwrap();
    assert_eq!(j.state, "pending", "{j:?}");
    let why = api.explain_job(pb::ExplainJobRequest { job_id: low, ..Default::default() }).await.unwrap().into_inner();
    assert!(why.summary.contains("preempted 1 times in 24 h, its contract's limit"), "{why:?}");
    let wait = |summary: &str| -> u64 { summary.split("starts again in ").nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse().ok()).expect("a wait in seconds") };
    assert!(wait(&why.summary) > 86_000 && wait(&why.summary) <= 86_400, "{}", why.summary);
    // The limit is durable: a host killed with SIGKILL still holds it back.
    kill9(&mut host);
    let (_host, url2) = serve(&d, "serve2", &d.join("state"), &args).await;
    assert_eq!(url2, url);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let j = jobs(&api).await.into_iter().find(|j| j.id == low).unwrap();
    assert_eq!(j.state, "pending", "{j:?}");
    let again = api.explain_job(pb::ExplainJobRequest { job_id: low, ..Default::default() }).await.unwrap().into_inner();
    assert!(again.summary.contains("its contract's limit") && wait(&again.summary) <= wait(&why.summary), "{again:?}");
    api.cancel_job(pb::CancelJobRequest { job_id: low }).await.unwrap();
}

/// A low-priority task that writes its pid to `pid-<job>` and runs until
/// `release-<job>`, ignoring checkpoint notices (SIGUSR1); with `deaf`,
/// it (and its children) ignore SIGTERM too.
fn stoppable_job(d: &Path, deaf: bool) -> pb::JobSpec {
    let d = d.display();
    let trap = if deaf { "trap '' TERM USR1; " } else { "trap '' USR1; " };
    let script = format!("{trap}echo $$ > {d}/pid-$BERTH_JOB; i=0; while [ ! -f {d}/release-$BERTH_JOB ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done; exit 0");
    one_gpu_shell_job(script)
}

/// An eviction's cost is measured, not modelled: the agent times each
/// preempted task from its stop to its exit and says whether the stop
/// grace ran out; the ledger (the decision log) records it per victim. A
/// task deaf to SIGTERM is killed after the grace (its process is gone);
/// one that heeds it exits at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_tasks_stop_is_measured_and_a_kill_after_the_grace_is_counted() {
    let d = dir("preempt-measured");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "0"]).await;
    // The agent's stop grace is 2 s (see `agent`).
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    let mut low = Vec::new();
    for deaf in [true, false] {
        low.push(api.submit_job(pb::SubmitJobRequest { job: Some(stoppable_job(&d, deaf)), ..Default::default() }).await.unwrap().into_inner().job_id);
    }
    running(&api, &low).await;
    let (deaf, heeds) = (low[0], low[1]);
    let pid_of = |job: u64| -> i32 {
        let text = std::fs::read_to_string(d.join(format!("pid-{job}"))).unwrap_or_default();
        text.trim().parse().unwrap_or_else(|_| panic!("job {job} wrote no pid: {text:?}"))
    };
    let deaf_pid = pid_of(deaf);

    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    assert_one_owner(&jobs(&api).await, &[]);
    // The physical truth: the deaf task's shell is gone (killed; at most a
    // zombie its new parent has not reaped yet).
    let stat = std::fs::read_to_string(format!("/proc/{deaf_pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("gone");
    assert!(matches!(state, "gone" | "Z" | "X"), "the task deaf to SIGTERM still runs (pid {deaf_pid}, state {state})");

    let vacated = until("both evictions in the ledger", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            let req = pb::QueryDecisionsRequest { partition: "p0".into(), limit: 1000, ..Default::default() };
            let v: Vec<pb::Decision> = api.query_decisions(req).await.unwrap().into_inner().decisions.into_iter().filter(|d| d.outcome == "vacated").collect();
            (v.len() == 2).then_some(v)
        }
    })
    .await;
    let entry = |job: u64| vacated.iter().find(|v| v.job_id == job).unwrap_or_else(|| panic!("no ledger entry for job {job}: {vacated:?}")).detail.clone();
    let seconds = |detail: &str| -> f64 { detail.rsplit("stop to exit ").next().and_then(|s| s.trim_end_matches(" s").parse().ok()).unwrap_or_else(|| panic!("{detail}")) };
    let (deaf_entry, heeds_entry) = (entry(deaf), entry(heeds));
    assert!(deaf_entry.starts_with("1 task(s) gone, 1 killed after the stop grace; timed by the agent"), "{deaf_entry}");
    assert!(seconds(&deaf_entry) >= 2.0, "killed before the 2 s grace ran out: {deaf_entry}");
    assert!(heeds_entry.starts_with("1 task(s) gone, 0 killed after the stop grace; timed by the agent"), "{heeds_entry}");
    assert!(seconds(&heeds_entry) < 2.0, "a task that heeds SIGTERM took the whole grace: {heeds_entry}");
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
    for id in low {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}

/// A preempted task that does nothing about notices (a plain `sleep`
/// under `sh`) keeps running through its notice: the notice is a file
/// ($BERTH_NOTICE) unless the agent is told to signal it too, and no
/// signal that would end it (SIGUSR1's default action) is sent. Its stop
/// comes when the notice is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_task_lives_through_its_preemption_notice() {
    let d = dir("preempt-plain");
    let notice_s = 3;
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", &notice_s.to_string()]).await;
    let _n1 = agent(&d, &url, "n1", "1xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    let dd = d.display();
    let plain = one_gpu_shell_job(format!("echo $$ > {dd}/pid-$BERTH_JOB; echo \"$BERTH_NOTICE\" > {dd}/notice-$BERTH_JOB; sleep 600"));
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(plain), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[low]).await;
    let read = |name: String| until("the task's files", Duration::from_secs(30), move || {
        let text = std::fs::read_to_string(&name).unwrap_or_default();
        async move { text.ends_with('\n').then(|| text.trim().to_string()) }
    });
    let pid = read(format!("{dd}/pid-{low}")).await;
    let notice = std::path::PathBuf::from(read(format!("{dd}/notice-{low}")).await);
    let alive = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("gone").to_string();
        !matches!(state.as_str(), "gone" | "Z" | "X")
    };
    assert!(alive() && !notice.exists(), "before any notice");

    let mut high = agent_job(&d, 1, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    // The notice arrives as a file; the task lives on.
    let notice_path = notice.clone();
    until("the notice file", Duration::from_secs(30), move || {
        let there = notice_path.exists();
        async move { there.then_some(()) }
    })
    .await;
    let noticed = std::time::Instant::now();
    let text = std::fs::read_to_string(&notice).unwrap();
    assert!(text.starts_with("checkpoint "), "notice file: {text:?}");
    // Gone only when the notice is over (the stop): not at the notice.
    while alive() {
        assert!(noticed.elapsed() < Duration::from_secs(30), "the task outlived its stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lived = noticed.elapsed();
    assert!(lived >= Duration::from_millis(notice_s * 1000 - 500), "the task died {lived:?} after its notice, before the {notice_s} s notice was over");
    running(&api, &[h]).await;
    assert_one_owner(&jobs(&api).await, &[]);
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
}

/// `berth explain JOB --what-if` on a live host with real agents: for a
/// pending two-GPU job it names the cheapest work to stop (all of one
/// node's jobs), the movable task to move into a hole elsewhere, and the
/// unreachable node to repair, each with its cost, and acts on none; the
/// move, then run with `berth migrate`, lets the job start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_what_if_names_a_stop_a_move_and_a_repair_and_does_none() {
    let d = dir("whatif");
    let listen = format!("127.0.0.1:{}", free_port());
    let (_host, url) = serve(&d, "serve", &d.join("state"), &["--listen", listen.as_str(), "--agent-timeout-ms", "1000", "--no-auto-compaction", "--high-priority", "10"]).await;
    let mut agents = Vec::new();
    for n in ["n1", "n2", "n3"] {
        agents.push(agent(&d, &url, n, "2xH20", &[]));
    }
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    for n in ["n1", "n2", "n3"] {
        schedulable(&api, n).await;
    }
    // Five one-GPU low jobs (the fifth movable), then one cancelled: every
    // node holds work, one has a hole.
    let mut low = Vec::new();
    for k in 0..5 {
        let job = pb::JobSpec { movable: k == 4, ..low_job(&d, 1) };
        low.push(api.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap().into_inner().job_id);
        running(&api, &low).await;
    }
    let node_of = |all: &[pb::Job], id: u64| all.iter().find(|j| j.id == id).unwrap().runs[0].node.clone();
    let all = jobs(&api).await;
    let movable_node = node_of(&all, low[4]);
    // Cancel a job on another node than the movable one: a hole there.
    let hole_job = *low[..4].iter().find(|&&id| node_of(&all, id) != movable_node).unwrap();
    let hole = node_of(&all, hole_job);
    api.cancel_job(pb::CancelJobRequest { job_id: hole_job }).await.unwrap();
    std::fs::write(d.join(format!("release-{hole_job}")), "0").unwrap();
    // A fourth node joins and becomes unreachable: down, empty.
    let mut n4 = agent(&d, &url, "n4", "2xH20", &[]);
    schedulable(&api, "n4").await;
    kill9(&mut n4);
    until("n4 unschedulable", Duration::from_secs(30), || {
        let api = api.clone();
        async move { crate::agent::node_info(&api, "n4").await.filter(|n| !n.schedulable) }
    })
    .await;
    // Priority 5, below the host's high-priority threshold (10): it waits
    // rather than preempt (the what-if still names the lower work).
    let high = pb::JobSpec { priority: 5, ..low_job(&d, 2) };
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = jobs(&api).await;
    let why = api.explain_job(pb::ExplainJobRequest { job_id: h, what_if: true }).await.unwrap().into_inner();
    assert_eq!(why.state, "pending", "{why:?}");
    let kind = |k: &str| why.what_if.iter().find(|w| w.kind == k).unwrap_or_else(|| panic!("no {k}: {why:?}")).clone();
    // Stop: every job of one node, and nothing else.
    let stop = kind("preempt");
    let stopped_node = node_of(&before, stop.jobs[0]);
    let on_it: Vec<u64> = before.iter().filter(|j| j.state == "running" && j.runs[0].node == stopped_node).map(|j| j.id).collect();
    let mut named = stop.jobs.clone();
    named.sort_unstable();
    assert_eq!(named, on_it, "{stop:?}");
    // Move: the movable task into the hole, its memory copied.
    let mv = kind("move");
    assert_eq!((mv.jobs.clone(), mv.moves.clone()), (vec![low[4]], vec![format!("{}: {movable_node} -> {hole}", low[4])]), "{mv:?}");
    // What live compaction estimates for the task: its GPU's state and its
    // memory.
    let copied = berth_core::compaction::estimate_state_bytes(&Default::default(), 1, 1000, 1024);
    assert_eq!(mv.bytes_moved, copied);
    // Repair: the unreachable node.
    assert_eq!(kind("repair").nodes, vec!["n4".to_string()]);
    // Nothing was done: every job where it was.
    let after = jobs(&api).await;
    for j in before.iter().filter(|j| j.state == "running") {
        let now = after.iter().find(|a| a.id == j.id).unwrap();
        assert_eq!((now.state.as_str(), now.runs[0].allocation_id), ("running", j.runs[0].allocation_id), "job {} touched", j.id);
    }
    assert_one_owner(&after, &[]);
    // The CLI prints the three lines.
    let out = std::process::Command::new(BERTH).args(["explain", &h.to_string(), "--what-if", "--server", &url, "--token", "ops-test-token"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for line in ["preempt job(s)", "GPU-s of work lost", &format!("move 1 task(s) of job(s) [{}]", low[4]), &format!("{:.1} GiB copied", copied as f64 / (1u64 << 30) as f64), "repair node(s) n4"] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
    // The move named, run with `berth migrate`, lets the job start: on the
    // node the task left, with one owner per GPU throughout.
    let alloc = before.iter().find(|j| j.id == low[4]).unwrap().runs[0].allocation_id;
    let out = std::process::Command::new(BERTH)
        .args(["migrate", &alloc.to_string(), "--to", &hole, "--server", &url, "--token", "ops-test-token"])
        .output()
        .unwrap();
    assert!(out.status.success(), "berth migrate: {}", String::from_utf8_lossy(&out.stderr));
    running(&api, &[h]).await;
    let started = jobs(&api).await;
    assert_eq!(node_of(&started, h), movable_node, "{started:?}");
    let moved = started.iter().find(|j| j.id == low[4]).unwrap();
    assert!(moved.runs.iter().any(|r| r.node == hole && r.state == "running"), "{moved:?}");
    assert_one_owner(&started, &[]);
    for id in low.iter().chain([&h]) {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}
