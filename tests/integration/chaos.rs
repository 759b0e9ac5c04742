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
        notice_s: 5,
    }
}

#[test]
fn the_live_host_keeps_its_invariants_under_seeded_operations_and_faults() {
    let seconds: u64 = std::env::var("BERTH_CHAOS_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(45);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cfg = config(150);
    let s = rt.block_on(berth::chaos::soak(&cfg, 1, u64::MAX, Duration::from_secs(seconds))).unwrap();
    if let Some(report) = s.failure_report() {
        panic!("{report}");
    }
    eprintln!("chaos: {} seeds in {:.1} s, {}", s.seeds, s.elapsed.as_secs_f64(), s.total);
    // The budget drove the host through every kind of operation.
    let t = &s.total;
    assert!(s.seeds >= 2 && t.operations >= 300, "{s:?}");
    assert!(t.processes_started > 0 && t.evictions_seen > 0 && t.host_restarts > 0 && t.agent_restarts > 0, "{s:?}");
    assert!(t.migrations > 0 && t.links_cut > 0 && t.nodes_given_up > 0, "migrations and node losses were driven: {s:?}");
}

/// The generator is a function of the seed: a failure's seed reproduces it.
#[test]
fn a_seed_gives_one_operation_list() {
    let a = berth::chaos::operations(7, 500, 3);
    assert_eq!(a, berth::chaos::operations(7, 500, 3));
    assert_ne!(a, berth::chaos::operations(8, 500, 3));
    for kind in ["Submit", "Cancel", "Exit", "Advance", "RestartAgent", "RestartHost"] {
        assert!(a.iter().any(|o| format!("{o:?}").starts_with(kind)), "no {kind} in 500 operations");
    }
}
