//! The simulation test of the live host (`berth::chaos`), on a bounded
//! budget: many seeds of seeded operations against an in-process `berth
//! serve` with simulated agents, the invariants checked against the
//! agents' processes after every operation. `berth bench chaos --seconds N`
//! is the long soak; `BERTH_CHAOS_SECONDS` stretches this one.

use std::time::Duration;

use crate::common::{policy_path, repo_root};

fn config(operations: usize) -> berth::chaos::ChaosConfig {
    berth::chaos::ChaosConfig {
        nodes: 3,
        operations,
        state_dir: repo_root().join("target").join("tmp").join(format!("chaos-{}", std::process::id())),
        placement: std::fs::read(policy_path("binpack")).unwrap(),
        rank: Some(std::fs::read(policy_path("spot-gpu")).unwrap()),
        // Swapped to mid-run: another honest policy, and one whose every
        // odd job's call fails until its breaker trips and rolls it back.
        alternates: vec![(std::fs::read(policy_path("spread")).unwrap(), String::new()), (std::fs::read(crate::common::guest_path("hostile")).unwrap(), "flaky".into())],
        notice_s: 5,
    }
}

#[test]
fn the_live_host_keeps_its_invariants_under_seeded_operations_and_faults() {
    let seconds: u64 = std::env::var("BERTH_CHAOS_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(45);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cfg = config(150);
    let s = rt.block_on(berth::chaos::soak(&cfg, 1, u64::MAX, Duration::from_secs(seconds), 1));
    // A host left hung by a failed run must not keep the test from reporting.
    rt.shutdown_timeout(Duration::from_secs(10));
    let s = s.unwrap();
    if let Some(report) = s.failure_report() {
        panic!("{report}");
    }
    eprintln!("chaos: {} seeds in {:.1} s, {}", s.seeds, s.elapsed.as_secs_f64(), s.total);
    // The budget drove the host through every kind of operation.
    let t = &s.total;
    assert!(s.seeds >= 2 && t.operations >= 300, "{s:?}");
    assert!(t.processes_started > 0 && t.evictions_seen > 0 && t.host_restarts > 0 && t.agent_restarts > 0, "{s:?}");
    assert!(t.migrations > 0 && t.links_cut > 0 && t.nodes_given_up > 0, "migrations and node losses were driven: {s:?}");
    assert!(t.policy_swaps > 0, "placement versions were swapped: {s:?}");
    assert!(t.store_outages > 0 && t.writes_refused > 0, "the store refused writes: {s:?}");
}

/// The generator is a function of the seed: a failure's seed reproduces it.
#[test]
fn a_seed_gives_one_operation_list() {
    let a = berth::chaos::operations(7, 500, 3);
    assert_eq!(a, berth::chaos::operations(7, 500, 3));
    assert_ne!(a, berth::chaos::operations(8, 500, 3));
    for kind in ["Submit", "Cancel", "Exit", "Advance", "Migrate", "SwapPolicy", "CutAgent", "RestartAgent", "StoreOutage", "RestartHost"] {
        assert!(a.iter().any(|o| format!("{o:?}").starts_with(kind)), "no {kind} in 500 operations");
    }
}

/// A host of the simulation's shape with agent node `sim-0` registered
/// (8 GPUs); its store under `name`.
fn sim_host(rt: &tokio::runtime::Runtime, name: &str) -> (berth::serve::ServeHandle, berth::agent::HubClient, u64, std::path::PathBuf) {
    use berth::proto as pb;
    let cfg = config(0);
    let dir = cfg.state_dir.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let clock = std::sync::Arc::new(berth::serve::clock::ManualClock::at(1_800_000_000_000));
    let host = rt
        .block_on(berth::serve::server::start_with_agents(berth::chaos::serve_config(&dir, &cfg, clock).unwrap(), Default::default()))
        .unwrap();
    let url = format!("http://{}", host.addr);
    let mut agent = rt.block_on(berth::agent::connect_hub(&url, Some(berth::chaos::AGENT), None)).unwrap();
    let gpus = (0..8u32).map(|g| pb::GpuInfo { index: g, uuid: format!("GPU-{name}-{g}"), model: "H20".into(), memory_total_mib: 1024, ..Default::default() }).collect();
    let reg = pb::RegisterAgentRequest { node: "sim-0".into(), partition: berth::chaos::PARTITION.into(), gpus, source: "simulated".into(), cpu_milli: 64_000, memory_mib: 1 << 19, ..Default::default() };
    let session = rt.block_on(agent.register(reg)).unwrap().into_inner().session;
    (host, agent, session, dir)
}

/// Found by the simulation test in CI (it hung): an agent's report about an
/// allocation the hub did not know took the hub's lock, then a partition's,
/// while the partition's scheduler, holding its state, stopped a task
/// through the hub. Here the partition's lock is held, a report of an
/// unknown allocation is in flight, and the scheduler's path (a stop sent
/// through the hub under the partition's lock) must still get through.
#[test]
fn a_report_and_a_stop_under_the_partitions_lock_do_not_deadlock() {
    use berth::proto as pb;
    use berth::serve::state::Actuator;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (host, mut agent, _, dir) = sim_host(&rt, "lock-order");
    let (hub, live) = (host.hub.clone(), host.live.clone());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The scheduler's side: the partition's state is held throughout.
        let _state = live.partitions[0].lock_state();
        held_tx.send(()).unwrap();
        // Long enough for the report below to be waiting on this lock.
        std::thread::sleep(Duration::from_millis(500));
        hub.stop(424_242, "sim-0");
        done_tx.send(()).unwrap();
    });
    held_rx.recv().unwrap();
    let report = rt.spawn(async move {
        agent.report_allocation(pb::AllocationReport { node: "sim-0".into(), allocation_id: 424_242, state: "exited".into(), ..Default::default() }).await
    });
    if done_rx.recv_timeout(Duration::from_secs(20)).is_err() {
        // Deadlocked threads cannot be joined: leave them to the process.
        rt.shutdown_background();
        panic!("a stop sent through the hub under the partition's lock waited 20 s for a report waiting on that lock (lock-order inversion)");
    }
    let reply = rt.block_on(report).unwrap();
    assert_eq!(reply.unwrap_err().code(), tonic::Code::NotFound, "an allocation that never existed is not adopted");
    rt.block_on(host.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A graceful stop waits for open streams: a host whose agents hold their
/// command streams (as every connected agent does) still stops.
#[test]
fn a_host_with_a_connected_agent_stops() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (host, mut agent, session, dir) = sim_host(&rt, "stop-with-agent");
    let mut stream = rt.block_on(agent.commands(berth::proto::CommandsRequest { node: "sim-0".into(), session })).unwrap().into_inner();
    let stopped = rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), host.shutdown()).await });
    if stopped.is_err() {
        rt.shutdown_background();
        panic!("the host did not stop within 20 s while an agent held its command stream");
    }
    // The agent sees its stream end (and would reconnect).
    let end = rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), stream.message()).await });
    assert!(matches!(end, Ok(Ok(None)) | Ok(Err(_))), "the command stream ended: {end:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The host stores only task states it knows: an agent's report of any
/// other word is refused, naming the accepted ones, and its text is not
/// echoed raw.
#[test]
fn an_agent_report_of_an_unknown_state_is_refused() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (host, mut agent, _, dir) = sim_host(&rt, "report-state");
    for state in ["done", "Running", "running\u{1b}[31m", &"x".repeat(100_000)] {
        let r = berth::proto::AllocationReport { node: "sim-0".into(), allocation_id: 1, state: state.to_string(), ..Default::default() };
        let e = rt.block_on(agent.report_allocation(r)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{state:.40?}: {e:?}");
        assert!(e.message().contains("exited") && e.message().len() < 300 && !e.message().contains('\u{1b}'), "{:?}", e.message());
    }
    rt.block_on(host.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}
