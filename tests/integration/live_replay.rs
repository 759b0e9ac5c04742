//! One engine: the same event sequence fed to the live host and to replay
//! gives the same decisions, decision for decision. The live host is a real
//! `berth serve` (gRPC submissions, its partition thread, binpack and
//! spot-gpu as wasm from the registry) whose clock is moved by hand; replay
//! is `simulate_recorded` over the same fleet, engine settings and jobs.
//! The workload overloads the partition so that low-priority fill is
//! preempted by high-priority jobs and evicted jobs resume.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth::serve::clock::ManualClock;
use berth::serve::decisions::Filter;
use berth::proto as pb;
use berth::wasm::Limits;
use berth_core::engine::Deciders;
use berth_core::fleet::gpus_of;
use berth_core::{Decision, Job};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common::{policy_path, wasm_policy};
use crate::serve::{client, config, state_dir};

const ACCESS: &str = r#"
[[identities]]
name = "ops"
token = "ops-equivalence-token"
roles = { "*" = "operator" }
"#;

/// Seconds on both clocks where the trace starts.
const T0: u64 = 1_000_000;

/// One decision as both worlds report it: (time, job, what), where what is
/// the placement (node and GPUs per task) or the job it was evicted for.
type Seen = (u64, u64, String);

/// The workload: arrival offset, priority, tasks, GPUs per task, CPU, memory, duration.
fn workload(seed: u64, n: usize) -> Vec<(u64, u32, u32, u32, u32, u64, u64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0;
    (0..n)
        .map(|_| {
            t += rng.random_range(0..5u64);
            let priority = if rng.random_bool(0.35) { 5 } else { 0 };
            let gpus = [1, 1, 2, 4, 8][rng.random_range(0..5usize)];
            let tasks = if gpus == 8 && rng.random_bool(0.3) { 2 } else { 1 };
            (t, priority, tasks, gpus, rng.random_range(1..16u32) * 1000, rng.random_range(1..64u64) * 1024, rng.random_range(60..1200u64))
        })
        .collect()
}

pub(crate) fn settle(live: &berth::serve::state::Live) {
    assert!(live.wait_settled(0, Duration::from_secs(60)), "partition p0 did not settle");
}

/// A live run of the workload: the jobs as the engine saw them, its
/// decisions (time, job, what), and what replay needs to run it again.
pub(crate) struct LiveRun {
    jobs: BTreeMap<u64, Job>,
    seen: Vec<Seen>,
    fleet: berth_core::Fleet,
    engine_config: berth_core::sim::SimConfig,
    horizon: u64,
}

/// Runs `n` jobs of the workload of `seed` through a live host on a manual
/// clock (simulated nodes; binpack places, spot-gpu ranks); with `export`,
/// writes the partition's capture there through the API before it stops.
pub(crate) fn run_live(name: &str, seed: u64, n: usize, export: Option<&Path>) -> LiveRun {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = state_dir(name);
    let clock = Arc::new(ManualClock::at(T0 * 1000));
    let mut cfg = config(&dir, ACCESS);
    cfg.scheduling.clock = clock.clone();
    cfg.scheduling.auto_compaction = false;
    let h = rt.block_on(berth::serve::start(cfg)).unwrap();
    let live = h.live.clone();
    let mut api = rt.block_on(client(&h, "ops-equivalence-token"));
    // spot-gpu ranks victims in both worlds.
    let component = std::fs::read(policy_path("spot-gpu")).unwrap();
    let up = rt.block_on(api.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: "rank".into(), ..Default::default() })).unwrap();
    let version = up.into_inner().policy.unwrap().version;
    rt.block_on(api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version, hook: "rank".into() })).unwrap();
    let (fleet, engine_config) = {
        let st = live.partitions[0].lock_state();
        (st.fleet.clone(), st.engine.config.clone())
    };

    // Live: at each moment something happens, hold the partition, move the
    // clock, submit what arrives then, and let it decide once.
    let trace = workload(seed, n);
    let horizon = T0 + trace.last().unwrap().0 + 1800;
    let mut jobs: BTreeMap<u64, Job> = BTreeMap::new();
    let mut next = 0;
    loop {
        let arrival = trace.get(next).map(|a| T0 + a.0);
        let Some(t) = [arrival, live.next_due_s(0)].into_iter().flatten().min().filter(|&t| t < horizon) else { break };
        live.hold(0, true);
        clock.set(t * 1000);
        let mut ids = Vec::new();
        while trace.get(next).is_some_and(|a| T0 + a.0 == t) {
            let (_, priority, tasks, gpus, cpu_milli, memory_mib, duration_s) = trace[next];
            let spec = pb::JobSpec { partition: "p0".into(), priority, tasks, gpus, gpu_milli: 1000, cpu_milli, memory_mib, duration_s: duration_s as f64, ..Default::default() };
            ids.push(rt.block_on(api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() })).unwrap().into_inner().job_id);
            next += 1;
        }
        live.hold(0, false);
        settle(&live);
        // The engine's view of each new job is what replay gets.
        let st = live.partitions[0].lock_state();
        for id in ids {
            let job = st.engine.job(st.slots[&id]).clone();
            assert_eq!(job.arrival_s, t);
            jobs.insert(id, job);
        }
    }
    assert_eq!(next, trace.len(), "every job was submitted before the horizon");
    let filter = Filter { partition: Some("p0".into()), job_id: None, policy_version: None, include_shadow: false, limit: usize::MAX };
    let mut seen: Vec<Seen> = live
        .decisions
        .query(&filter)
        .into_iter()
        .filter_map(|d| {
            let what = match d.outcome.as_str() {
                "placed" => d.placements.iter().map(|p| format!("{}{:?}", p.node, p.gpus)).collect::<Vec<_>>().join(" "),
                "evicted" => format!("evicted {}", d.detail.split(';').next().unwrap_or_default()),
                _ => return None,
            };
            Some((d.unix_ms / 1000, d.job_id, what))
        })
        .collect();
    seen.sort();
    if let Some(path) = export {
        let mut out = Vec::new();
        rt.block_on(async {
            let mut stream = api.export_capture(pb::ExportCaptureRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner();
            while let Some(chunk) = stream.message().await.unwrap() {
                out.extend_from_slice(&chunk.text);
            }
        });
        std::fs::write(path, out).unwrap();
    }
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
    LiveRun { jobs, seen, fleet, engine_config, horizon }
}

/// A live run's capture (a smaller workload than the equivalence test's),
/// written in `d`.
pub(crate) fn captured_run(d: &Path) -> PathBuf {
    let path = d.join("p0.events");
    run_live(&format!("capture-{}", d.file_name().unwrap().to_string_lossy()), 11, 120, Some(&path));
    path
}

#[test]
fn the_live_host_and_replay_make_the_same_decisions_for_one_event_sequence() {
    let LiveRun { jobs, seen: live_seen, fleet, engine_config, horizon } = run_live("live-replay", 7, 260, None);

    // Replay: the same fleet, engine settings, jobs and policies.
    let jobs: Vec<Job> = jobs.into_values().collect();
    let mut fleet = fleet;
    let mut binpack = wasm_policy(&policy_path("binpack"), Limits::default());
    let mut spot = wasm_policy(&policy_path("spot-gpu"), Limits::default());
    let config = berth_core::sim::SimConfig { horizon_s: horizon, ..engine_config };
    let mut log = Vec::new();
    let deciders = Deciders { placement: &mut binpack, preemption: Some(&mut spot), compaction: None };
    berth_core::sim::simulate_recorded(&mut fleet, &jobs, deciders, config, Some(&mut log)).unwrap();
    let mut replay_seen: Vec<Seen> = log
        .iter()
        .filter_map(|(t, d)| match d {
            Decision::Place { job, allocations, .. } => {
                let what = allocations.iter().map(|a| format!("{}{:?}", fleet.nodes()[a.node as usize].name, gpus_of(a.gpus).map(|g| g as u32).collect::<Vec<_>>())).collect::<Vec<_>>().join(" ");
                Some((*t, *job, what))
            }
            Decision::Evict { job, for_job, .. } => Some((*t, *job, format!("evicted for job {for_job}"))),
            _ => None,
        })
        .collect();
    replay_seen.sort();

    let placed = replay_seen.iter().filter(|s| !s.2.starts_with("evicted")).count();
    let evicted = replay_seen.len() - placed;
    assert!(placed >= jobs.len() / 2 && evicted >= 10, "the workload exercises placement and preemption: {placed} placements, {evicted} evictions");
    if let Some(k) = (0..live_seen.len().min(replay_seen.len())).find(|&k| live_seen[k] != replay_seen[k]) {
        panic!("decision {k} differs: live {:?}, replay {:?}", live_seen[k], replay_seen[k]);
    }
    assert_eq!(live_seen.len(), replay_seen.len(), "live made {} decisions, replay {}", live_seen.len(), replay_seen.len());
    println!("live and replay: the same {placed} placements and {evicted} evictions of {} jobs", jobs.len());
}
