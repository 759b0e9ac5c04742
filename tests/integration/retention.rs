//! A long-lived host stays bounded: ended jobs leave memory and the store
//! after their retention, listings page, pruned ids are never handed out
//! again, and a retried submission with its idempotency key makes one job
//! (across a restart too).

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth::serve::clock::{Clock, ManualClock};
use berth::proto as pb;
use berth::serve::state::Retention;
use berth::serve::state::Live;
use tonic::Code;

use crate::live_replay::settle;
use crate::serve::{client, config, state_dir, ACCESS};

const T0_MS: u64 = 1_000_000_000;

fn short_job(seconds: f64) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        job: Some(pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s: seconds, ..Default::default() }),
        ..Default::default()
    }
}

/// (ended jobs kept, live jobs kept, job records in the store) of p0.
fn kept(live: &Live) -> (usize, usize, usize) {
    let st = live.partitions[0].lock_state();
    let ended = st.jobs.values().filter(|j| j.state.is_ended()).count();
    let stored = live.store.get().expect("an embedded store").list("jobs/p0/").unwrap().len();
    (ended, st.jobs.len() - ended, stored)
}

/// `kept(live)` once it equals `want` (the retention round runs in the
/// partition's loop, after the decisions `settle` waits for), or as it is
/// after 10 s.
fn kept_once(live: &Live, want: (usize, usize, usize)) -> (usize, usize, usize) {
    let started = Instant::now();
    loop {
        let now = kept(live);
        if now == want || started.elapsed() > Duration::from_secs(10) {
            return now;
        }
        live.hold(0, false);
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Moves the clock by `ms` and lets the partition take in what is due
/// (ends, then the retention round that runs every 2 s of its clock).
fn advance(live: &Live, clock: &ManualClock, ms: u64) {
    clock.set(clock.unix_ms() + ms);
    live.hold(0, false);
    settle(live);
}

#[test]
fn ended_jobs_leave_memory_and_the_store_after_their_retention_and_pruned_ids_are_never_reused() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = state_dir("retention");
    let clock = Arc::new(ManualClock::at(T0_MS));
    let retention = Retention { ended_for: Duration::from_secs(3600), ended_max: 100, ..Default::default() };
    let mut cfg = config(&dir, ACCESS);
    cfg.scheduling.clock = clock.clone();
    cfg.scheduling.auto_compaction = false;
    cfg.scheduling.retention = retention;
    let h = rt.block_on(berth::serve::start(cfg.clone())).unwrap();
    let live = h.live.clone();
    let mut api = rt.block_on(client(&h, "ops-test-token"));

    // Six rounds of 100 ten-second jobs: each round runs and ends.
    let mut submitted = Vec::new();
    for _ in 0..6 {
        live.hold(0, true);
        for _ in 0..100 {
            submitted.push(rt.block_on(api.submit_job(short_job(10.0))).unwrap().into_inner().job_id);
        }
        advance(&live, &clock, 0);
        advance(&live, &clock, 11_000);
        advance(&live, &clock, 3_000);
    }
    // Three jobs cancelled while pending: never decided, so no decision
    // names them; they are the newest ids when everything is pruned.
    live.hold(0, true);
    let cancelled: Vec<u64> = (0..3).map(|_| rt.block_on(api.submit_job(short_job(10.0))).unwrap().into_inner().job_id).collect();
    for &id in &cancelled {
        rt.block_on(api.cancel_job(pb::CancelJobRequest { job_id: id })).unwrap();
    }
    advance(&live, &clock, 3_000);
    advance(&live, &clock, 3_000);

    let (ended, running, stored) = kept_once(&live, (100, 0, 100));
    assert_eq!(running, 0, "every job ended");
    assert_eq!(ended, 100, "the count bound keeps the newest 100 of {} ended jobs", submitted.len() + cancelled.len());
    assert_eq!(stored, ended, "the store holds what memory holds");
    let pruned = live.metrics.render().lines().find(|l| l.starts_with("berth_jobs_pruned_total{partition=\"p0\"}")).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap());
    assert_eq!(pruned, Some(503), "the metric counts every job removed");

    // Pages of 30 walk exactly the kept jobs, newest first.
    let mut paged = Vec::new();
    let mut before_id = 0;
    loop {
        let page = rt.block_on(api.list_jobs(pb::ListJobsRequest { partition: "p0".into(), limit: 30, before_id, ..Default::default() })).unwrap().into_inner();
        assert!(page.jobs.len() <= 30);
        paged.extend(page.jobs.iter().map(|j| j.id));
        if page.next_before_id == 0 {
            break;
        }
        before_id = page.next_before_id;
    }
    let mut newest: Vec<u64> = submitted.iter().chain(&cancelled).copied().collect();
    newest.sort_unstable_by(|a, b| b.cmp(a));
    newest.truncate(100);
    assert_eq!(paged, newest, "the pages list the newest 100, each once");
    let gone = rt.block_on(api.explain_job(pb::ExplainJobRequest { job_id: submitted[0], ..Default::default() })).unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "a pruned job is gone: {gone:?}");

    // Past the time bound everything ended leaves, the newest ids too.
    advance(&live, &clock, 3_700_000);
    advance(&live, &clock, 3_000);
    assert_eq!(kept_once(&live, (0, 0, 0)), (0, 0, 0), "nothing ended is kept past its hour");
    drop((api, live)); // the store closes with the last holder
    rt.block_on(h.shutdown());

    // A restart numbers new jobs past every pruned id.
    let highest = *cancelled.iter().max().unwrap();
    let h = rt.block_on(berth::serve::start(cfg)).unwrap();
    let mut api = rt.block_on(client(&h, "ops-test-token"));
    let next = rt.block_on(api.submit_job(short_job(10.0))).unwrap().into_inner().job_id;
    assert!(next > highest, "job {next} after a restart reuses no pruned id (highest was {highest})");
    drop(api);
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_retried_submission_with_its_idempotency_key_makes_one_job_across_a_restart() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = state_dir("idempotency");
    let cfg = config(&dir, ACCESS);
    let h = rt.block_on(berth::serve::start(cfg.clone())).unwrap();
    let alice = rt.block_on(client(&h, "alice-test-token"));
    let keyed = |key: &str, seconds: f64| pb::SubmitJobRequest { idempotency_key: key.into(), ..short_job(seconds) };

    // Eight racing retries of one submission: one job.
    let answers: Vec<pb::SubmitJobResponse> = rt.block_on(async {
        let calls = (0..8).map(|_| {
            let mut c = alice.clone();
            let req = keyed("retry-1", 600.0);
            async move { c.submit_job(req).await.unwrap().into_inner() }
        });
        let mut set = tokio::task::JoinSet::new();
        for call in calls {
            set.spawn(call);
        }
        set.join_all().await
    });
    let first = answers[0].job_id;
    assert!(answers.iter().all(|a| a.job_id == first), "every retry names one job: {answers:?}");
    assert_eq!(answers.iter().filter(|a| !a.duplicate).count(), 1, "exactly one call made it: {answers:?}");

    // The same key with another spec is refused; another caller's key is its own.
    let mut a = alice.clone();
    let e = rt.block_on(a.submit_job(keyed("retry-1", 601.0))).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&format!("job {first}")), "the error names the job: {}", e.message());
    let mut bob = rt.block_on(client(&h, "bob-test-token"));
    let bobs = rt.block_on(bob.submit_job(keyed("retry-1", 600.0))).unwrap().into_inner();
    assert!(bobs.job_id != first && !bobs.duplicate, "bob's key is not alice's");
    for bad in ["has space", &"k".repeat(129), "tab\there"] {
        let e = rt.block_on(a.submit_job(keyed(bad, 600.0))).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "key {bad:?}: {e:?}");
        assert!(e.message().len() < 300, "the error quotes a bounded key: {}", e.message());
    }
    let listed = rt.block_on(a.list_jobs(pb::ListJobsRequest { partition: "p0".into(), ..Default::default() })).unwrap().into_inner().jobs;
    assert_eq!(listed.iter().filter(|j| j.owner == "alice").count(), 1, "alice has one job: {listed:?}");
    drop((a, alice, bob));
    rt.block_on(h.shutdown());

    // After a restart the key still answers with the stored job.
    let h = rt.block_on(berth::serve::start(cfg)).unwrap();
    let mut alice = rt.block_on(client(&h, "alice-test-token"));
    let again = rt.block_on(alice.submit_job(keyed("retry-1", 600.0))).unwrap().into_inner();
    assert_eq!((again.job_id, again.duplicate), (first, true), "a retry after a restart finds the stored job");
    drop(alice);
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}
