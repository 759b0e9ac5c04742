//! Fleet scale in CI-sized form: `berth bench fleet` (one live host, agent
//! nodes over the real agent API, the ASI workload with preemption and live
//! compaction) at 2,000 nodes against the same benchmark at 250 in the same
//! run. A cost that grows with the fleet per pass, per decision or per
//! heartbeat shows as a ratio far beyond the eight times as many nodes;
//! machine speed and load cancel out of it, and no absolute time is
//! asserted. The figures at 2,000, 5,000 and 20,000 nodes are in the docs.

use berth::bench_fleet::{fleet, FleetArgs, FleetBench};

fn run(nodes: u32) -> FleetBench {
    let args = FleetArgs {
        nodes,
        nodes_per_switch: 48,
        heartbeat_ms: 1000,
        seconds: 15,
        speedup: 600.0,
        warm_hours: 24.0,
        workload: "asi".into(),
        policy: "binpack".into(),
        rank: "spot-gpu".into(),
        compact: Some("ipc".into()),
        // Low-priority fill, two half-GPU tasks a node (what fits beside
        // the warm start; the docs' 20,000-node run fills 150,000).
        fill_tasks: nodes * 2,
    };
    fleet(&args).unwrap_or_else(|e| panic!("bench fleet at {nodes} nodes: {e:#}"))
}

/// `big / small`, the baseline floored where it is below what this machine
/// can tell apart from scheduling noise.
fn ratio(big: u64, small: u64, floor: u64) -> f64 {
    big as f64 / small.max(floor) as f64
}

#[test]
fn two_thousand_agent_nodes_keep_their_heartbeats_and_cost_no_worse_than_linearly_more() {
    let small = run(250);
    let big = run(2000);
    let both = format!("250 nodes: {small:?}\n2000 nodes: {big:?}");
    for b in [&small, &big] {
        // The fleet was used: work was decided, started and ended.
        assert!(b.warm_tasks_running > 0 && b.jobs_started > 0 && b.jobs_ended > 0 && b.decisions > 0, "nothing ran at {} nodes\n{both}", b.nodes);
        // Every node beat through it: none was taken for lost.
        assert_eq!(b.nodes_unreachable_most_run, 0, "nodes falsely unreachable at {} nodes (registration, warm start, fill or the measured phase)\n{both}", b.nodes);
        assert!(b.heartbeats >= u64::from(b.nodes) * (b.seconds - 2), "heartbeats missing at {} nodes\n{both}", b.nodes);
        // Restarted with everything running, the host found its running
        // jobs in the store and kept them as their nodes came back.
        let r = &b.recovery;
        assert!(r.recovered_jobs > 0 && r.running_after * 2 >= r.recovered_jobs, "running jobs lost across the restart at {} nodes\n{both}", b.nodes);
        assert!(r.back_s <= r.rejoined_s && r.rejoined_s <= r.decided_s, "the restart's phases out of order at {} nodes\n{both}", b.nodes);
    }
    // Eight times the nodes: a pass and a decision may cost about eight
    // times as much (every fitting node is scored; measured: 4.5x and under
    // 1x); one that grows with the square of the fleet costs sixty-four.
    let pass = ratio(big.pass_p99_us, small.pass_p99_us, 1_000);
    assert!(pass <= 24.0, "pass p99 grew {pass:.1}x for 8x the nodes\n{both}");
    let decision = ratio(big.decision_p99_us, small.decision_p99_us, 500);
    assert!(decision <= 24.0, "decision p99 grew {decision:.1}x for 8x the nodes\n{both}");
    // A heartbeat's cost does not depend on the fleet (it never waits for a
    // pass): its typical round trip may grow with the load, not with the
    // fleet. The median says so; a p99 on two cores is the machine's
    // scheduling (clean-clone CI runs, other tests beside this one, saw 12
    // and 30 ms at 2,000 nodes where runs alone see 0.9-1.4x), so it is held
    // only far below the heartbeat timeout.
    let beat = ratio(big.heartbeat_p50_us, small.heartbeat_p50_us, 500);
    assert!(beat <= 8.0, "heartbeat p50 grew {beat:.1}x for 8x the nodes\n{both}");
    let beat_p99 = ratio(big.heartbeat_p99_us, small.heartbeat_p99_us, 50_000);
    assert!(beat_p99 <= 8.0, "heartbeat p99 grew {beat_p99:.1}x (over 50 ms) for 8x the nodes\n{both}");
    // Recovery: the store read and every node registering again.
    let recovery = ratio((big.recovery.decided_s * 1e3) as u64, (small.recovery.decided_s * 1e3) as u64, 500);
    assert!(recovery <= 24.0, "recovery after a restart took {recovery:.1}x as long for 8x the nodes\n{both}");
    let memory = ratio(big.rss_peak_mib, small.rss_peak_mib, 64);
    eprintln!("scale: 8x the nodes: pass p99 {pass:.1}x, decision p99 {decision:.1}x, heartbeat p50 {beat:.1}x, recovery {recovery:.1}x, peak RSS {memory:.1}x");
    assert!(memory <= 8.0, "peak RSS grew {memory:.1}x for 8x the nodes\n{both}");
}
