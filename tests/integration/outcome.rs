//! The outcome live: a real `berth serve` with real synthetic agents; a
//! task reports its work with `berth progress` and `berth checkpointed`, a
//! preemption loses what no checkpoint saved, and a node whose power file
//! says "off" stays installed but not powered, with no work placed on it.
//! Checked against the processes on the node (/proc), not only the host's
//! records.

use std::path::Path;
use std::time::Duration;

use berth::proto as pb;

use crate::agent::{agent, agent_job, assert_one_owner, dir, free_port, jobs, kill9, serve, until};
use crate::preempt::schedulable;

/// A task that, in its job's first run only, reports 40 steps, a
/// checkpoint, then 25 more steps; it writes its pid to
/// `pid-<job>-<allocation>` and runs until `release-<job>` (or two minutes).
fn working_job(d: &Path) -> pb::JobSpec {
    let d = d.display();
    let script = format!(
        "echo $$ > {d}/pid-$BERTH_JOB-$BERTH_ALLOCATION; \
         if [ ! -f {d}/ran-$BERTH_JOB ]; then touch {d}/ran-$BERTH_JOB; \
           berth progress 40 && berth checkpointed && sleep 1 && berth progress 25 && touch {d}/did-$BERTH_JOB; fi; \
         i=0; while [ ! -f {d}/release-$BERTH_JOB ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done; exit 0"
    );
    pb::JobSpec {
        partition: "p0".into(),
        tasks: 1,
        gpus: 1,
        cpu_milli: 1000,
        memory_mib: 1024,
        work_unit: "steps".into(),
        argv: vec!["sh".into(), "-c".into(), script],
        ..Default::default()
    }
}

/// The host's Prometheus text (plain HTTP/1.0 over a socket).
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

fn alive(pid: &str) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("gone").to_string();
    !matches!(state.as_str(), "gone" | "Z" | "X")
}

async fn accounting(api: &berth::client::Client) -> pb::AccountingResponse {
    api.clone().accounting(pb::AccountingRequest { partition: "p0".into() }).await.unwrap().into_inner()
}

fn h20(a: &pb::AccountingResponse) -> pb::Denominators {
    a.rows.iter().find(|r| r.group == "model H20").and_then(|r| r.gpus).expect("an H20 row")
}

fn outcome<'a>(a: &'a pb::AccountingResponse, group: &str) -> Option<&'a pb::OutcomeRow> {
    a.outcome.iter().find(|o| o.group == group && o.unit == "steps")
}

/// Waits until the accounting satisfies `ok`.
async fn accounting_until(api: &berth::client::Client, what: &str, ok: impl Fn(&pb::AccountingResponse) -> bool) -> pb::AccountingResponse {
    let ok = &ok;
    until(what, Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let a = accounting(&api).await;
            ok(&a).then_some(a)
        }
    })
    .await
}

/// The pid a task of job `job` wrote on its allocation `alloc`.
async fn pid_of(d: &Path, job: u64, alloc: u64) -> String {
    let path = d.join(format!("pid-{job}-{alloc}"));
    until("the task's pid file", Duration::from_secs(30), move || {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        async move { text.ends_with('\n').then(|| text.trim().to_string()) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_moves_the_outcome_a_preemption_loses_unsaved_work_and_a_powered_down_node_takes_none() {
    let d = dir("outcome");
    // A fixed port: the host is restarted at the end, its agents stay.
    let listen = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let args = ["--agent-timeout-ms", "3000", "--notice-s", "1", "--listen", &listen, "--metrics-listen", &metrics];
    let (mut host, url) = serve(&d, "serve", &d.join("state"), &args).await;
    let power = d.join("power-n2");
    std::fs::write(&power, "off\n").unwrap();
    let _n1 = agent(&d, &url, "n1", "1xH20", &["--progress-every-ms", "200"]);
    let _n2 = agent(&d, &url, "n2", "1xH20", &["--progress-every-ms", "200", "--power-file", power.to_str().unwrap()]);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    // n2 registered and beats, but is powered down: installed, not powered.
    let a = accounting_until(&api, "n2 installed and powered down", |a| h20(a).installed == 2.0 && h20(a).powered == 1.0).await;
    assert_eq!(h20(&a).healthy, 1.0, "a node powered down is not healthy");
    assert!(a.outcome.is_empty(), "no work reported yet: {:?}", a.outcome);

    // Low-priority work on n1 reports 40 steps, a checkpoint, 25 more.
    let low = api.clone().submit_job(pb::SubmitJobRequest { job: Some(working_job(&d)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let a = accounting_until(&api, "65 steps counted", |a| outcome(a, "total").is_some_and(|o| o.done == 65)).await;
    let total = outcome(&a, "total").unwrap();
    assert_eq!((total.lost, total.goodput), (0, 65));
    assert!(total.installed_gpu_hours > 0.0 && total.per_installed_gpu_hour > 0.0, "{total:?}");
    // The default fleet prices every model it has (and H20).
    assert!(total.has_cost && total.cost > 0.0 && total.per_cost > 0.0, "{total:?}");
    assert!(outcome(&a, "class low").is_some_and(|o| o.done == 65), "{:?}", a.outcome);
    assert!(a.outcome.iter().any(|o| o.group.starts_with("tenant ") && o.done == 65), "{:?}", a.outcome);
    assert_eq!(h20(&a).reclaimable, 1.0, "preemptible work holds n1's GPU");
    let job = jobs(&api).await.into_iter().find(|j| j.id == low).unwrap();
    assert_eq!((job.work_done, job.work_lost), (65, 0));
    let first = job.runs[0].clone();
    assert_eq!((first.node.as_str(), first.work_units, first.work_checkpointed), ("n1", 65, 40));
    let first_pid = pid_of(&d, low, first.allocation_id).await;
    assert!(alive(&first_pid), "the task runs on n1");
    assert!(d.join(format!("did-{low}")).exists());

    // A high-priority job takes n1 back: the task is stopped after its
    // notice, and its 25 steps after the checkpoint are lost.
    let mut high = agent_job(&d, 1, 1);
    high.priority = 5;
    let h = api.clone().submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    let a = accounting_until(&api, "the preemption's lost steps", |a| outcome(a, "total").is_some_and(|o| o.lost == 25)).await;
    let total = outcome(&a, "total").unwrap();
    assert_eq!((total.done, total.goodput), (65, 40));
    assert!(outcome(&a, "class low").is_some_and(|o| o.lost == 25));
    until("the preempted task gone from the node", Duration::from_secs(30), || {
        let gone = !alive(&first_pid);
        async move { gone.then_some(()) }
    })
    .await;
    let js = until("the high-priority job on n1, the low one waiting", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let js = jobs(&api).await;
            let high_on_n1 = js.iter().any(|j| j.id == h && j.state == "running" && j.runs.iter().any(|r| r.node == "n1" && r.state == "running"));
            let low_waits = js.iter().any(|j| j.id == low && j.state == "pending");
            (high_on_n1 && low_waits).then_some(js)
        }
    })
    .await;
    assert_one_owner(&js, &[]);
    let text = scrape(&metrics);
    for line in ["berth_work_done_total{partition=\"p0\",unit=\"steps\"} 65", "berth_work_lost_total{partition=\"p0\",unit=\"steps\"} 25"] {
        assert!(text.lines().any(|l| l == line), "{line} not in the metrics:\n{text}");
    }
    // Nothing was ever started on the powered-down node.
    assert!(js.iter().all(|j| j.runs.iter().all(|r| r.node != "n2")), "work placed on a powered-down node");
    // On the node: the only task process the low job ever had is its
    // first (no task wrote a pid file from anywhere else).
    let pid_files: Vec<String> =
        std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("pid-")).collect();
    assert_eq!(pid_files, vec![format!("pid-{low}-{}", first.allocation_id)]);

    // Powered up: n2 is powered and schedulable, and the waiting job runs
    // there (a real process), from its checkpoint.
    std::fs::write(&power, "on\n").unwrap();
    let js = until("the low job running again on n2", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let js = jobs(&api).await;
            js.iter().any(|j| j.id == low && j.state == "running" && j.runs.iter().any(|r| r.node == "n2" && r.state == "running")).then_some(js)
        }
    })
    .await;
    let again = js.iter().find(|j| j.id == low).unwrap().runs[0].clone();
    assert!(alive(&pid_of(&d, low, again.allocation_id).await), "the requeued task runs on n2");
    let a = accounting(&api).await;
    assert_eq!((h20(&a).installed, h20(&a).powered), (2.0, 2.0));
    // Its tally survived the requeue.
    let before = outcome(&a, "total").unwrap().clone();
    assert_eq!((before.done, before.lost), (65, 25));
    assert_one_owner(&js, &[]);

    // A host restarted (killed) keeps the tally, stored with the job, and
    // the installed hours go on from the nodes' stored join times.
    kill9(&mut host);
    let (_host, _) = serve(&d, "serve-2", &d.join("state"), &args).await;
    let a = accounting_until(&api, "the tally after a restart", |a| h20(a).installed == 2.0).await;
    let after = outcome(&a, "total").expect("the outcome after a restart").clone();
    assert_eq!((after.done, after.lost), (65, 25));
    assert!(after.installed_gpu_hours >= before.installed_gpu_hours, "{before:?} then {after:?}");
    assert!(alive(&pid_of(&d, low, again.allocation_id).await), "the task runs on through the host's restart");
    for id in [low, h] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}
