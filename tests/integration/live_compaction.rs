//! Live compaction on real agents: a real `berth serve`, synthetic agents
//! whose tasks are real child processes, and the `ipc` ejection-chain
//! policy (wasm) as the partition's compact version. A fragmented
//! partition is compacted make-before-break so that a whole-node job
//! starts; a move whose new copy never takes over, and a move whose
//! destination agent is SIGKILLed, roll back with the job still running
//! on its source; the ledger records all of it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth::proto as pb;

use crate::agent::{agent, assert_one_owner, dir, jobs, kill9, serve, until};
use crate::common::policy_path;

/// The agents here also signal a checkpoint notice (the task traps it).
const NOTICE_BY_SIGNAL: &[&str] = &["--notice-signal", "USR1"];

/// A movable task: writes `start-<allocation>` (ns) when it starts; a
/// migrated copy (BERTH_MIGRATED_FROM set) reports ready only once
/// `ready-ok` exists, an original at once; a checkpoint notice (SIGUSR1)
/// writes `ckpt-<allocation>`; on SIGTERM it lists the live
/// processes started as its migrated copy (`copies-at-term-<allocation>`)
/// and exits 0; it exits on `release` (99 after two minutes).
fn movable_argv(d: &Path) -> Vec<String> {
    let d = d.display();
    // The traps only mark what arrived and the loop acts on it, lingering
    // a moment after a stop, so a notice sent with the stop is recorded
    // whichever the agent delivers first. The notice's mark is written by
    // the shell itself: a `touch` it forked is in the group the stop's
    // SIGTERM reaches 50 us later, and died before writing (CI flake).
    let script = format!(
        "date +%s%N > {d}/start-$BERTH_ALLOCATION.tmp && mv {d}/start-$BERTH_ALLOCATION.tmp {d}/start-$BERTH_ALLOCATION; \
         trap ': > {d}/ckpt-$BERTH_ALLOCATION' USR1; \
         trap 'grep -lasz \"^BERTH_MIGRATED_FROM=$BERTH_ALLOCATION$\" /proc/[0-9]*/environ > {d}/copies-at-term-$BERTH_ALLOCATION; stop=1' TERM; \
         i=0; while [ -z \"$stop\" ] && [ ! -f {d}/release ] && [ $i -lt 2400 ]; do \
           if [ -z \"$BERTH_MIGRATED_FROM\" ] || [ -f {d}/ready-ok ]; then touch \"$BERTH_READY\"; fi; \
           sleep 0.05; i=$((i+1)); done; \
         [ -n \"$stop\" ] && {{ sleep 0.3; exit 0; }}; [ -f {d}/release ] || exit 99; exit 0"
    );
    vec!["sh".into(), "-c".into(), script]
}

pub(crate) fn spec(d: &Path, gpus: u32, movable: bool) -> pb::JobSpec {
    pb::JobSpec { partition: "p0".into(), tasks: 1, gpus, cpu_milli: 1000, memory_mib: 1024, argv: movable_argv(d), movable, wait_ready: movable, ..Default::default() }
}

pub(crate) async fn until_running(api: &berth::client::Client, id: u64) -> pb::Job {
    until(&format!("job {id} running"), Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == id && j.state == "running" && j.runs.len() == 1 && j.runs[0].state == "running") }
    })
    .await
}

pub(crate) async fn schedulable(api: &berth::client::Client, names: &[&str]) {
    until("agent nodes schedulable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
            names.iter().all(|n| nodes.iter().any(|x| x.name == *n && x.schedulable)).then_some(())
        }
    })
    .await;
}

/// Holds every GPU of `node` with an operator allocation; returns its id.
async fn hold(hub: &mut berth::agent::HubClient, node: &str, gpus: Vec<u32>) -> u64 {
    let r = hub.start_allocation(pb::StartAllocationRequest { node: node.into(), gpus, argv: vec!["sleep".into(), "600".into()], ..Default::default() }).await.unwrap();
    r.into_inner().allocation_id
}

async fn release(hub: &mut berth::agent::HubClient, api: &berth::client::Client, alloc: u64, node: &str, gpus: u32) {
    hub.control_allocation(pb::ControlAllocationRequest { allocation_id: alloc, action: "stop".into() }).await.unwrap();
    until(&format!("{node} has {gpus} idle GPUs"), Duration::from_secs(60), || {
        let api = api.clone();
        async move { crate::agent::node_info(&api, node).await.filter(|n| n.gpus_idle >= gpus).map(|_| ()) }
    })
    .await;
}

/// Two 4-GPU agent nodes, each half used by a movable 2-GPU job (operator
/// holds steer the placements); returns the jobs (on n1, on n2).
pub(crate) async fn fragment(d: &Path, api: &mut berth::client::Client, hub: &mut berth::agent::HubClient) -> (pb::Job, pb::Job) {
    let h2 = hold(hub, "n2", vec![0, 1, 2, 3]).await;
    let a = api.submit_job(pb::SubmitJobRequest { job: Some(spec(d, 2, true)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let a = until_running(api, a).await;
    assert_eq!(a.runs[0].node, "n1");
    let free: Vec<u32> = (0..4).filter(|g| !a.runs[0].gpus.contains(g)).collect();
    let h1 = hold(hub, "n1", free).await;
    release(hub, api, h2, "n2", 4).await;
    let b = api.submit_job(pb::SubmitJobRequest { job: Some(spec(d, 2, true)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let b = until_running(api, b).await;
    assert_eq!(b.runs[0].node, "n2");
    release(hub, api, h1, "n1", 2).await;
    (a, b)
}

async fn upload_ipc(api: &mut berth::client::Client) {
    upload_compact(api, "ipc").await;
}

/// Uploads and activates the bundled `name` as p0's compact policy.
pub(crate) async fn upload_compact(api: &mut berth::client::Client, name: &str) {
    let component = std::fs::read(policy_path(name)).unwrap();
    let up = api
        .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: "compact".into(), ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("upload {name} as compact: {e:?}"))
        .into_inner()
        .policy
        .unwrap();
    api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.version, hook: "compact".into() }).await.expect("activate compact");
}

pub(crate) async fn ledger(api: &berth::client::Client) -> Vec<pb::CompactionChain> {
    api.clone().list_compactions(pb::ListCompactionsRequest { partition: "p0".into(), limit: 0 }).await.unwrap().into_inner().chains
}

fn stamp(path: PathBuf) -> u128 {
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragmented_partition_is_compacted_make_before_break_and_a_whole_node_job_starts() {
    let d = dir("live-compaction");
    let extra = ["--agent-timeout-ms", "60000", "--no-auto-compaction", "--metrics-listen", "127.0.0.1:0"];
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &extra).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", NOTICE_BY_SIGNAL);
    let _n2 = agent(&d, &url, "n2", "4xH20", NOTICE_BY_SIGNAL);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    schedulable(&api, &["n1", "n2"]).await;

    // No compact policy yet: the step is refused, naming what is missing.
    let e = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: true }).await.unwrap_err();
    assert!(e.message().contains("--hook compact"), "{e:?}");
    upload_ipc(&mut api).await;
    std::fs::write(d.join("ready-ok"), "").unwrap();
    let (a, b) = fragment(&d, &mut api, &mut hub).await;
    let whole = api.submit_job(pb::SubmitJobRequest { job: Some(spec(&d, 4, false)), ..Default::default() }).await.unwrap().into_inner().job_id;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(jobs(&api).await.iter().find(|j| j.id == whole).unwrap().state, "pending");

    // A second compact version (one ejection round) in shadow, through the
    // CLI: it plans on the same snapshot; its plans are tallied, never run.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(crate::agent::BERTH).args(args).args(["--server", &url, "--token", "ops-test-token"]).output().unwrap();
        assert!(out.status.success(), "berth {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let ipc = policy_path("ipc");
    cli(&["policy", "upload", "--partition", "p0", "--hook", "compact", "--config", r#"{"rounds": 1}"#, ipc.to_str().unwrap()]);
    cli(&["policy", "shadow", "--partition", "p0", "--hook", "compact", "shadow", "2"]);

    // A dry run plans and moves nothing.
    let plan = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: true }).await.unwrap().into_inner();
    let report = api.shadow_report(pb::ShadowReportRequest { partition: "p0".into(), hook: "compact".into() }).await.unwrap().into_inner();
    let k = report.compact.clone().unwrap();
    let (active, candidate) = (k.active.unwrap(), k.candidate.unwrap());
    assert_eq!((k.steps, k.candidate_errors), (1, 0), "{report:?}");
    assert_eq!(active.moves, plan.moves.len() as u64, "{report:?}");
    assert!(active.nodes_freed >= 1 && candidate.nodes_freed >= 1 && candidate.moves >= 1, "{report:?}");
    let text = cli(&["policy", "report", "--partition", "p0", "--hook", "compact"]);
    assert!(text.contains("compaction steps planned by both: 1"), "{text}");
    assert!(plan.rejected.is_empty(), "{plan:?}");
    assert!(plan.chains.iter().any(|c| c.run && c.nodes_freed >= 1), "{plan:?}");
    assert_eq!(plan.moves.len(), 1, "one 2-GPU job moves onto the other half-used node: {plan:?}");
    assert!(plan.chain_ids.is_empty() && ledger(&api).await.is_empty(), "a dry run started something: {plan:?}");
    assert_eq!(plan.partial_nodes, 2);
    let moved = plan.moves[0].clone();
    let (mover, stayer) = if moved.job_id == a.id { (a, b) } else { (b, a) };
    assert_eq!(moved.allocation_id, mover.runs[0].allocation_id);
    assert_eq!(moved.to_node, stayer.runs[0].node);

    // Ownership is sampled through the API for the whole move.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (api, stop) = (api.clone(), stop.clone());
        async move {
            let (mut samples, mut both) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let js = jobs(&api).await;
                assert_one_owner(&js, &[]);
                if js.iter().any(|j| j.runs.iter().filter(|r| r.state == "running").count() == 2) {
                    both += 1;
                }
                samples += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (samples, both)
        }
    });
    let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
    assert_eq!(step.chain_ids.len(), 1, "{step:?}");
    let started = until("the whole-node job running", Duration::from_secs(90), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == whole && j.state == "running") }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (samples, both) = watcher.await.unwrap();
    // It starts on the node the move emptied.
    assert_eq!(started.runs[0].node, mover.runs[0].node, "{started:?}");
    assert_eq!(started.runs[0].gpus.len(), 4);
    let now = jobs(&api).await;
    let m = now.iter().find(|j| j.id == mover.id).unwrap();
    assert_eq!((m.state.as_str(), m.runs.len(), m.runs[0].node.as_str()), ("running", 1, stayer.runs[0].node.as_str()), "{m:?}");
    assert_one_owner(&now, &[]);

    // Make-before-break: the new copy started before the old one was
    // stopped, and was running when it was.
    let chain = until("the chain closed in the ledger", Duration::from_secs(30), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.state != "running") }
    })
    .await;
    assert_eq!((chain.id, chain.state.as_str(), chain.moves.len()), (step.chain_ids[0], "done", 1), "{chain:?}");
    let mv = &chain.moves[0];
    assert_eq!((mv.state.as_str(), mv.from_allocation, mv.to_allocation), ("done", mover.runs[0].allocation_id, m.runs[0].allocation_id), "{mv:?}");
    let new_start = stamp(d.join(format!("start-{}", mv.to_allocation)));
    let old_start = stamp(d.join(format!("start-{}", mv.from_allocation)));
    assert!(new_start > old_start);
    let copies = std::fs::read_to_string(d.join(format!("copies-at-term-{}", mv.from_allocation))).unwrap();
    assert!(!copies.trim().is_empty(), "no new copy was running when the old one got its stop");
    assert!(d.join(format!("ckpt-{}", mv.from_allocation)).exists(), "the old copy got no checkpoint notice");
    assert!(mv.overlap_ms > 0 && mv.warmup_ms <= mv.overlap_ms, "{mv:?}");
    assert_eq!((chain.idle_nodes_before, chain.idle_nodes_after), (0, 1), "{chain:?}");
    assert!(chain.pending_startable_after > chain.pending_startable_before, "{chain:?}");
    assert!(chain.bytes_cross_aggregation + chain.bytes_same_aggregation + chain.bytes_same_switch > 0, "{chain:?}");
    // The console's ledger view reads the same chain.
    let log = std::fs::read_to_string(d.join("serve.log")).unwrap();
    let console = log.lines().find_map(|l| l.split("console on ").nth(1)).expect("the console's address in the log").trim().to_string();
    let (status, body, _) = crate::console::http("GET", &format!("{console}/api/state"), Some("ops-test-token"), None);
    assert_eq!(status, 200, "{body}");
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    let shown = &state["compactions"][0];
    assert_eq!((shown["id"].as_u64(), shown["state"].as_str(), shown["moves"][0]["state"].as_str()), (Some(chain.id), Some("done"), Some("done")), "{shown}");
    println!(
        "live compaction: chain {} moved job {} {} -> {} (overlap {} ms, takeover {} ms); {both} of {samples} API samples saw both copies running",
        chain.id, mv.job_id, mv.from_node, mv.to_node, mv.overlap_ms, mv.warmup_ms
    );
    // The move reached the engine as inputs: the capture replays exactly.
    let (events, _) = crate::capture::replays_exactly(&d, &url, &d.join("state"), 3);
    assert!(std::fs::read_to_string(events).unwrap().contains("\"input\":\"replace_held\""), "the move is in the capture");
    std::fs::write(d.join("release"), "0").unwrap();
}

/// A compact policy written in JavaScript (drain-js) plans the live step:
/// one 2-GPU job moves make-before-break onto the other half-used node and
/// the whole-node job starts on the node it emptied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_compact_policy_plans_a_live_step_and_its_move_is_made() {
    let d = dir("live-compaction-js");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "60000", "--no-auto-compaction"]).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", NOTICE_BY_SIGNAL);
    let _n2 = agent(&d, &url, "n2", "4xH20", NOTICE_BY_SIGNAL);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    schedulable(&api, &["n1", "n2"]).await;
    upload_compact(&mut api, "drain-js").await;
    std::fs::write(d.join("ready-ok"), "").unwrap();
    let (a, b) = fragment(&d, &mut api, &mut hub).await;
    let whole = api.submit_job(pb::SubmitJobRequest { job: Some(spec(&d, 4, false)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
    assert!(step.policy.starts_with("drain-js@"), "{step:?}");
    assert!(step.rejected.is_empty(), "{step:?}");
    assert_eq!((step.moves.len(), step.chain_ids.len()), (1, 1), "{step:?}");
    let moved = step.moves[0].clone();
    let (mover, stayer) = if moved.job_id == a.id { (a, b) } else { (b, a) };
    assert_eq!((moved.allocation_id, moved.to_node.as_str()), (mover.runs[0].allocation_id, stayer.runs[0].node.as_str()), "{step:?}");
    let started = until("the whole-node job running", Duration::from_secs(90), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == whole && j.state == "running") }
    })
    .await;
    assert_eq!((started.runs[0].node.as_str(), started.runs[0].gpus.len()), (mover.runs[0].node.as_str(), 4), "{started:?}");
    let chain = until("the chain closed in the ledger", Duration::from_secs(30), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.state != "running") }
    })
    .await;
    assert_eq!((chain.state.as_str(), chain.moves.len()), ("done", 1), "{chain:?}");
    assert!(chain.policy.starts_with("drain-js"), "{chain:?}");
    // Make-before-break: the new copy started before the old one's stop.
    let mv = &chain.moves[0];
    assert!(stamp(d.join(format!("start-{}", mv.to_allocation))) > stamp(d.join(format!("start-{}", mv.from_allocation))));
    assert!(!std::fs::read_to_string(d.join(format!("copies-at-term-{}", mv.from_allocation))).unwrap().trim().is_empty());
    let now = jobs(&api).await;
    assert_one_owner(&now, &[]);
    let m = now.iter().find(|j| j.id == mover.id).unwrap();
    assert_eq!((m.state.as_str(), m.runs.len(), m.runs[0].node.as_str()), ("running", 1, stayer.runs[0].node.as_str()), "{m:?}");
    std::fs::write(d.join("release"), "0").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_that_never_takes_over_or_loses_its_destination_rolls_back_and_the_job_keeps_running() {
    let d = dir("live-compaction-rollback");
    let args = ["--agent-timeout-ms", "1500", "--reschedule-after-ms", "500", "--no-auto-compaction", "--compaction", r#"{"destination_deadline_s": 6}"#];
    let (mut host, url) = serve(&d, "serve", &d.join("state"), &args).await;
    let mut n1 = agent(&d, &url, "n1", "4xH20", NOTICE_BY_SIGNAL);
    let mut n2 = agent(&d, &url, "n2", "4xH20", NOTICE_BY_SIGNAL);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    schedulable(&api, &["n1", "n2"]).await;
    upload_ipc(&mut api).await;
    let (a, b) = fragment(&d, &mut api, &mut hub).await;

    // (1) The new copy never reports ready (no `ready-ok`): stopped after
    // the deadline, rolled back; the job runs on its source throughout.
    let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
    assert_eq!(step.chain_ids.len(), 1, "{step:?}");
    let first_id = step.chain_ids[0];
    let first = until("the first chain rolled back", Duration::from_secs(60), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.id == first_id && c.state != "running") }
    })
    .await;
    assert_eq!(first.state, "rolled-back", "{first:?}");
    assert!(first.cause.contains("did not take over within 6 s"), "{first:?}");
    assert_eq!(first.moves[0].state, "rolled-back");
    let js = jobs(&api).await;
    for j in [&a, &b] {
        let now = js.iter().find(|x| x.id == j.id).unwrap();
        assert_eq!((now.state.as_str(), now.runs.len(), now.runs[0].allocation_id), ("running", 1, j.runs[0].allocation_id), "{now:?}");
    }
    assert_one_owner(&js, &[]);
    assert!(!d.join(format!("copies-at-term-{}", first.moves[0].from_allocation)).exists(), "the source copy was stopped");

    // (2) Again, and the destination's agent is killed mid-move: the move
    // rolls back when the node is given up; the moving job keeps running
    // on its source.
    let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
    let chain_id = step.chain_ids[0];
    let moving = until("the move under way", Duration::from_secs(30), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.id == chain_id && c.moves[0].state == "moving") }
    })
    .await;
    let mv = moving.moves[0].clone();
    kill9(if mv.to_node == "n1" { &mut n1 } else { &mut n2 });
    let second = until("the second chain rolled back", Duration::from_secs(60), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.id == chain_id && c.state != "running") }
    })
    .await;
    assert_eq!(second.state, "rolled-back", "{second:?}");
    assert!(second.cause.contains("rolled back") && second.cause.contains(&mv.to_node), "{second:?}");
    let js = jobs(&api).await;
    let kept = js.iter().find(|j| j.id == mv.job_id).unwrap();
    assert_eq!((kept.state.as_str(), kept.runs.len(), kept.runs[0].allocation_id, kept.runs[0].node.as_str()), ("running", 1, mv.from_allocation, mv.from_node.as_str()), "{kept:?}");
    assert_one_owner(&js, &[]);
    assert!(!d.join(format!("copies-at-term-{}", mv.from_allocation)).exists(), "the source copy was stopped");
    println!("rollbacks: {:?} / {:?}", first.cause, second.cause);

    // The ledger is in the store: a host killed and started again on it
    // lists the same chains.
    let before = ledger(&api).await;
    kill9(&mut host);
    let (_host, url) = serve(&d, "serve-again", &d.join("state"), &args).await;
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    assert_eq!(ledger(&api).await, before);
    std::fs::write(d.join("release"), "0").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_compact_policy_trips_its_breaker_and_nothing_moves() {
    let d = dir("live-compaction-hostile");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--no-auto-compaction", "--breaker-failures", "2"]).await;
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    // A job with a command and no agent node: pending, so the policy sees a
    // pending shape and misbehaves.
    let job = api.submit_job(pb::SubmitJobRequest { job: Some(spec(&d, 2, true)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let component = std::fs::read(crate::common::guest_path("hostile")).unwrap();
    for mode in ["compact-invalid", "compact-loop"] {
        // The upload smoke plan (nothing pending) is honest: accepted.
        let up = api
            .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component: component.clone(), hook: "compact".into(), config: mode.into(), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .policy
            .unwrap();
        api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.version, hook: "compact".into() }).await.unwrap();
        for _ in 0..2 {
            let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
            let want = if mode == "compact-invalid" { "unknown allocation" } else { "deadline" };
            assert!(step.rejected.contains(want), "{mode}: {step:?}");
            assert!(step.moves.is_empty() && step.chain_ids.is_empty(), "{mode}: {step:?}");
        }
        // Two failures trip it: no compact version is active any more.
        let e = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: true }).await.unwrap_err();
        assert!(e.message().contains("no active compact policy"), "{mode}: {e:?}");
        let history = api.policy_history(pb::PolicyHistoryRequest { partition: "p0".into(), hook: "compact".into() }).await.unwrap().into_inner();
        assert_eq!(history.active_version, 0, "{history:?}");
        assert!(history.events.iter().any(|e| e.kind == "breaker" && e.version == up.version), "{history:?}");
    }
    assert!(ledger(&api).await.is_empty());
    assert_eq!(jobs(&api).await.iter().find(|j| j.id == job).unwrap().state, "pending");
}

/// A move is verified after it: two agents pinned to one CPU each (and
/// offering four cores, so placement may stack two one-core tasks), a
/// CPU-bound job on each; compaction moves one onto the other's node,
/// where the two share one CPU. Its rate (from its cgroup) drops by about
/// half against before the move, past the margin, so within the
/// verification window it is moved back to its source GPUs, which stayed
/// reserved; no GPU has two owners meanwhile, and the ledger shows both
/// rates and the neighbour's.
///
/// Then the same with tasks that report their work (`berth progress`): the
/// move is judged by the work rate they report, not their CPU use. One
/// after the other in one test: either's hog would slow the other's tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_onto_a_slower_destination_is_moved_back_within_its_window() {
    if let Some(mv) = verified_move(Slowed::Cpu).await {
        assert_eq!(mv.rate_measure, "cpu", "{mv:?}");
    }
    if let Some(mv) = verified_move(Slowed::Progress).await {
        assert_eq!(mv.rate_measure, "progress", "{mv:?}");
    }
}

/// The same move, its destination's GPUs failing (an XID on each) during
/// the window instead: moved back at once, the cause says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_destination_gpu_fails_in_its_window_is_moved_back() {
    if let Some(mv) = verified_move(Slowed::Health).await {
        assert!(mv.cause.contains("became unhealthy during its verify window"), "{mv:?}");
    }
}

/// What goes wrong on the destination once the move starts.
#[derive(Clone, Copy, PartialEq)]
enum Slowed {
    /// A hog on its CPU; the task's rate read from its CPU use.
    Cpu,
    /// The same, the task reporting its work (`berth progress`).
    Progress,
    /// Its GPUs report an XID.
    Health,
}

/// A busy process pinned to `cpu` (as the agent pins a task without
/// cgroups), killed when dropped.
fn hog(cpu: usize) -> crate::agent::Proc {
    use std::os::unix::process::CommandExt;
    let cpus = berth::agent::isolation::CpuList::parse(&cpu.to_string()).unwrap();
    let confine = berth::agent::isolation::Confine::new(&[], Some(&cpus)).unwrap();
    let mut c = std::process::Command::new("sh");
    c.args(["-c", "end=$(($(date +%s) + 120)); while [ $(date +%s) -lt $end ]; do i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; done"]);
    // SAFETY: Confine::apply makes only async-signal-safe calls.
    unsafe { c.pre_exec(move || confine.apply()) };
    crate::agent::Proc(c.spawn().unwrap())
}

/// The verified-move scenario; the move moved back (None: skipped here).
async fn verified_move(slowed: Slowed) -> Option<pb::CompactionMove> {
    let progress = slowed == Slowed::Progress;
    let _cpu = crate::common::cpu_measuring();
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        crate::common::skip("fewer than 2 CPUs: two agents cannot be given one each");
        return None;
    }
    let d = dir(match slowed {
        Slowed::Cpu => "verified-move",
        Slowed::Progress => "verified-move-progress",
        Slowed::Health => "verified-move-health",
    });
    let extra = ["--agent-timeout-ms", "60000", "--no-auto-compaction", "--compaction", r#"{"verify_s": 10, "min_residence_s": 0, "verify_min_cores": 0.1}"#];
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &extra).await;
    // With Health, every GPU of a node reports an XID once the test writes
    // its trigger file.
    let trigger = |node: &str| d.join(format!("xid-{node}")).display().to_string();
    let agent_args = |cpu: &'static str, node: &str| {
        let mut args: Vec<String> = ["--cpus", cpu, "--cpu-cores", "4", "--progress-every-ms", "200"].map(String::from).to_vec();
        if slowed == Slowed::Health {
            args.extend((0..4).flat_map(|g| ["--synthetic-xid".to_string(), format!("{g}:79")]));
            args.extend(["--synthetic-xid-when".to_string(), trigger(node)]);
        }
        args
    };
    let (a1, a2) = (agent_args("0", "n1"), agent_args("1", "n2"));
    let _n1 = agent(&d, &url, "n1", "4xH20", &a1.iter().map(String::as_str).collect::<Vec<_>>());
    let _n2 = agent(&d, &url, "n2", "4xH20", &a2.iter().map(String::as_str).collect::<Vec<_>>());
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    schedulable(&api, &["n1", "n2"]).await;
    let agents = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner().agents;
    if agents.iter().any(|a| !a.isolation.starts_with("cgroup")) {
        crate::common::skip("no cgroups here: a task's CPU rate is not measured");
        return None;
    }
    upload_ipc(&mut api).await;
    let busy = |d: &Path| pb::JobSpec {
        partition: "p0".into(),
        tasks: 1,
        gpus: 2,
        cpu_milli: 1000,
        memory_mib: 256,
        argv: vec![
            "sh".into(),
            "-c".into(),
            // Busy until `release`, or two minutes (a failed test leaves
            // nothing spinning); with progress, a fixed amount of work per
            // report.
            format!(
                "end=$(($(date +%s) + 120)); while [ ! -f {}/release ] && [ $(date +%s) -lt $end ]; do i=0; while [ $i -lt {} ]; do i=$((i+1)); done; {}; done",
                d.display(),
                20000,
                if progress { "berth progress 1" } else { ":" }
            ),
        ],
        movable: true,
        ..Default::default()
    };
    // One busy job per node (operator holds steer them).
    let h2 = hold(&mut hub, "n2", vec![0, 1, 2, 3]).await;
    let a = api.submit_job(pb::SubmitJobRequest { job: Some(busy(&d)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let a = until_running(&api, a).await;
    let free: Vec<u32> = (0..4).filter(|g| !a.runs[0].gpus.contains(g)).collect();
    let h1 = hold(&mut hub, "n1", free).await;
    release(&mut hub, &api, h2, "n2", 4).await;
    let b = api.submit_job(pb::SubmitJobRequest { job: Some(busy(&d)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let b = until_running(&api, b).await;
    release(&mut hub, &api, h1, "n1", 2).await;
    assert_ne!(a.runs[0].node, b.runs[0].node);
    // Both rates known to the host before the move.
    // (Busy, but not necessarily a whole core each: other tests share
    // the machine.)
    until("both tasks' CPU rates reported", Duration::from_secs(30), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().filter(|j| j.runs.first().and_then(|r| r.usage.as_ref()).is_some_and(|u| u.cpu_milli >= 150)).count().eq(&2).then_some(()) }
    })
    .await;
    // A few seconds of them: a steady rate before the move.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (api, stop) = (api.clone(), stop.clone());
        async move {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                assert_one_owner(&jobs(&api).await, &[]);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner();
    assert_eq!(step.chain_ids.len(), 1, "{step:?}");
    // As the move starts, a hog outside Berth starts on the destination's
    // CPU (sixteen busy processes): the destination is clearly slower, by more
    // than the noise of a machine shared with other tests.
    let to = step.moves.first().map(|m| m.to_node.clone()).expect("the step's move");
    let _hogs: Vec<crate::agent::Proc> = match slowed {
        Slowed::Health => {
            // Once the move is verifying: its GPUs fail inside the window.
            until("the move verifying", Duration::from_secs(60), || {
                let api = api.clone();
                async move { ledger(&api).await.into_iter().flat_map(|c| c.moves).any(|m| m.state == "verifying").then_some(()) }
            })
            .await;
            std::fs::write(trigger(&to), "").unwrap();
            Vec::new()
        }
        _ => (0..16).map(|_| hog(if to == "n1" { 0 } else { 1 })).collect(),
    };
    let mv = until("the move verified", Duration::from_secs(90), || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().flat_map(|c| c.moves).find(|m| !matches!(m.state.as_str(), "pending" | "moving" | "verifying")) }
    })
    .await;
    assert_eq!(mv.state, "moved-back", "{mv:?}");
    assert!(mv.rate_before_milli >= if progress { 1 } else { 150 }, "{mv:?}");
    if slowed != Slowed::Health {
        assert!(f64::from(mv.rate_after_milli) < 0.8 * f64::from(mv.rate_before_milli), "{mv:?}");
        assert!(mv.cause.contains("slower on"), "{mv:?}");
    }
    // The neighbour's use is recorded (after the move it is one beat's
    // sample, and the hog may starve it to nothing).
    assert!(mv.neighbours_before_milli > 0, "the neighbour's use before the move is not recorded: {mv:?}");
    assert!(mv.cause.contains("moved back"), "{mv:?}");
    let chain = ledger(&api).await.into_iter().find(|c| c.moves.iter().any(|m| m.state == "moved-back")).unwrap();
    assert_eq!(chain.state, "rolled-back", "{chain:?}");
    // Back where it was, on the GPUs it left.
    let back = until("the moved job running on its source again", Duration::from_secs(60), || {
        let api = api.clone();
        let from = mv.from_node.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == mv.job_id && j.runs.len() == 1 && j.runs[0].state == "running" && j.runs[0].node == from) }
    })
    .await;
    let before = if back.id == a.id { &a } else { &b };
    assert_eq!(back.runs[0].gpus, before.runs[0].gpus, "not back on the GPUs it left");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    watcher.await.unwrap();
    let text = std::process::Command::new(crate::agent::BERTH).args(["compactions", "--partition", "p0", "--server", &url, "--token", "ops-test-token"]).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("moved-back") && text.contains("neighbours"), "{text}");
    std::fs::write(d.join("release"), "").unwrap();
    Some(mv)
}
