//! The starvation guard on a live host: a stream of 1-GPU jobs starves a
//! 4-node gang while the guard is off; an operator turns it on at run time,
//! `explain` shows the reservation and its latest start, the gang starts
//! while the stream goes on, and the setting survives a restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth::proto as pb;
use tonic::Code;

use crate::serve::{client, config, jobs, state_dir, ACCESS};

/// One partition of four 8-GPU nodes, no guard.
const FLEET: &str = r#"
seed = 1
nodes_per_switch = 4
nodes_per_partition = 4

[[shapes]]
model = "H800"
count = 4
gpus = 8
cpu_cores = 128
memory_gib = 1024
"#;

fn small_job(gpus: u32, tasks: u32, duration_s: f64) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        job: Some(pb::JobSpec { partition: "p0".into(), tasks, gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s, ..Default::default() }),
        ..Default::default()
    }
}

async fn state_of(c: &mut berth::client::Client, id: u64) -> String {
    jobs(c, "p0").await.into_iter().find(|j| j.id == id).expect("listed").state
}

/// A backlog of 2-second 1-GPU jobs, a 4-node gang (its id), then ten more
/// small jobs a second until `stop`: some GPUs are always busy, so the whole
/// fleet is never free at once.
async fn gang_behind_a_stream(alice: &mut berth::client::Client) -> (u64, Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    for _ in 0..40 {
        alice.submit_job(small_job(1, 1, 2.0)).await.unwrap();
    }
    let gang = alice.submit_job(small_job(8, 4, 60.0)).await.unwrap().into_inner().job_id;
    let stop = Arc::new(AtomicBool::new(false));
    let stream = {
        let (stop, mut alice) = (stop.clone(), alice.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                alice.submit_job(small_job(1, 1, 2.0)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    (gang, stop, stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_is_starved_by_small_jobs_until_an_operator_turns_the_guard_on() {
    let dir = state_dir("guard");
    let mut cfg = config(&dir, ACCESS);
    cfg.fleet = berth::asi::fleet::FleetConfig::parse(FLEET, "guard-test").unwrap();
    let h = berth::serve::start(cfg.clone()).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let mut alice = client(&h, "alice-test-token").await;
    let parts = ops.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    assert_eq!(parts[0].guard, "off");

    let (gang, stop, stream) = gang_behind_a_stream(&mut alice).await;

    // Guard off: eight seconds, many passes, and the gang never starts.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(state_of(&mut ops, gang).await, "pending", "the gang started with the guard off");
    let why = ops.explain_job(pb::ExplainJobRequest { job_id: gang, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(why.reserved_until_unix_s, 0, "{}", why.summary);
    let started_small = jobs(&mut ops, "p0").await.iter().filter(|j| j.id > gang && j.state != "pending").count();
    assert!(started_small >= 20, "later 1-GPU jobs went past the gang: {started_small}");

    // Tenants may not change it; operators may, at run time.
    let denied = alice
        .set_guard(pb::SetGuardRequest { partition: "p0".into(), reserve_after_s: 2, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let bad = ops.set_guard(pb::SetGuardRequest { partition: "p0".into(), aging_per_hour: f64::NAN, reserve_after_s: 2, ..Default::default() }).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let set = ops.set_guard(pb::SetGuardRequest { partition: "p0".into(), reserve_after_s: 2, ..Default::default() }).await.unwrap().into_inner();
    assert!(set.guard.contains("reserve after 2 s"), "{}", set.guard);

    // The gang waited past 2 s already: it gets the reservation, shown by
    // explain with its latest start, and starts while the stream goes on.
    let t0 = Instant::now();
    let mut reserved_until = 0;
    let mut summary = String::new();
    while state_of(&mut ops, gang).await == "pending" {
        let why = ops.explain_job(pb::ExplainJobRequest { job_id: gang, ..Default::default() }).await.unwrap().into_inner();
        if why.reserved_until_unix_s != 0 {
            reserved_until = why.reserved_until_unix_s;
            summary = why.summary;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the gang did not start with the guard on");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started_at = berth::util::unix_ms() / 1000;
    assert!(reserved_until != 0, "explain never showed the reservation");
    assert!(summary.contains("reserved by the starvation guard"), "{summary}");
    // It started by the reservation's time (the clock counts whole seconds).
    assert!(started_at <= reserved_until + 1, "started at {started_at}, reserved until {reserved_until}");
    assert!(!stream.is_finished(), "the stream went on");
    stop.store(true, Ordering::SeqCst);
    stream.await.unwrap();

    // The operator's choice outlives the host.
    h.shutdown().await;
    let h = berth::serve::start(cfg).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let parts = ops.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    assert!(parts[0].guard.contains("reserve after 2 s"), "{}", parts[0].guard);
    h.shutdown().await;
}

/// A bounded admission window, set live: the stream of 1-GPU jobs that
/// starves the gang may put only its budget ahead of it per window; the gang
/// starts within a window while the stream goes on, `explain` says when a
/// small job waits for the window, and the setting survives a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_window_lets_a_gang_start_within_a_window_of_a_stream() {
    let dir = state_dir("guard-window");
    let mut cfg = config(&dir, ACCESS);
    cfg.fleet = berth::asi::fleet::FleetConfig::parse(FLEET, "guard-window-test").unwrap();
    let h = berth::serve::start(cfg.clone()).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let mut alice = client(&h, "alice-test-token").await;
    let (gang, stop, stream) = gang_behind_a_stream(&mut alice).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(state_of(&mut ops, gang).await, "pending", "the gang started with no window");
    let bad = ops.set_guard(pb::SetGuardRequest { partition: "p0".into(), window_s: 0, ..Default::default() }).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let bad = ops.set_guard(pb::SetGuardRequest { partition: "p0".into(), window_s: 10, window_gpu_hours: f64::INFINITY, ..Default::default() }).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    // Ten-second windows; in each at most 0.002 GPU-h (7.2 GPU-s: three of
    // the 2-second jobs) of smaller work starts ahead of a waiting job.
    let set = ops.set_guard(pb::SetGuardRequest { partition: "p0".into(), window_s: 10, window_gpu_hours: 0.002, ..Default::default() }).await.unwrap().into_inner();
    assert!(set.guard.contains("per 10 s window"), "{}", set.guard);
    let t0 = Instant::now();
    let mut held = String::new();
    while state_of(&mut ops, gang).await == "pending" {
        // A small job waiting now: explain names the window.
        if held.is_empty()
            && let Some(small) = jobs(&mut ops, "p0").await.into_iter().find(|j| j.id > gang && j.state == "pending")
        {
            let why = ops.explain_job(pb::ExplainJobRequest { job_id: small.id, ..Default::default() }).await.unwrap().into_inner();
            if why.summary.contains("admission window") {
                held = why.summary;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(25), "the gang did not start within two windows and its running work");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(held.contains(&format!("waiting job {gang}")), "explain never named the window: {held:?}");
    assert!(!stream.is_finished(), "the stream went on");
    stop.store(true, Ordering::SeqCst);
    stream.await.unwrap();
    h.shutdown().await;
    let h = berth::serve::start(cfg).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let parts = ops.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    assert!(parts[0].guard.contains("per 10 s window"), "{}", parts[0].guard);
    h.shutdown().await;
}
