//! Compaction in the core: the IPC heuristic frees whole nodes, hostile
//! plans are rejected whole with their reason, make-before-break never
//! gives a GPU two owners or loses a job (also under injected failures),
//! hysteresis, residence and payback hold.

use berth_core::compaction::{
    self, Actuator, CompactionConfig, CompactionPolicy, CompactionState, Ledger, MigrationResult, PlannedMove, Running, SimulatedActuator,
    Wanted,
};
use berth_core::fleet::{Allocation, Fleet, Node, NodeId};
use berth_core::placement::default_gpus;
use berth_core::sim::Job;
use berth_core::{PolicyError, TaskShape};
use berth_sdk::{Plan, Policy, Snapshot};
use proptest::prelude::*;

/// The IPC policy compiled natively.
struct Ipc(berth_policy_ipc::Ipc);

impl CompactionPolicy for Ipc {
    fn describe(&self) -> String {
        "ipc (native)".into()
    }
    fn compact(&mut self, s: &mut Snapshot) -> Result<Plan, PolicyError> {
        self.0.compact(s).map_err(PolicyError::Guest)
    }
}

fn ipc() -> Ipc {
    Ipc(berth_policy_ipc::Ipc::default())
}

/// A policy that answers a fixed plan.
struct Fixed(Plan);

impl CompactionPolicy for Fixed {
    fn describe(&self) -> String {
        "fixed".into()
    }
    fn compact(&mut self, _s: &mut Snapshot) -> Result<Plan, PolicyError> {
        Ok(self.0.clone())
    }
}

/// `nodes` 8-GPU nodes, model 0 except every fifth (model 1), 4 nodes per
/// switch domain, 2 domains per aggregation.
fn fleet(nodes: usize) -> Fleet {
    let list = (0..nodes)
        .map(|i| {
            let mut n = Node::new(format!("n{i}"), Some(u32::from(i % 5 == 4)), 8, 128_000, 1 << 20);
            n.switch_domain = (i / 4) as u32;
            n.aggregation = (i / 8) as u32;
            n
        })
        .collect();
    Fleet::new(vec!["H800".into(), "A100".into()], list).unwrap()
}

fn shape(gpus: u32, milli: u32) -> TaskShape {
    TaskShape { gpu_count: gpus, gpu_milli: milli, cpu_milli: 4_000 * gpus.max(1), memory_mib: 16_384, models: vec![] }
}

/// Places `r` (allocation on `node` with the host's GPU choice) and returns it.
fn place(fleet: &mut Fleet, running: &mut Vec<Running>, node: NodeId, gpus: u32, milli: u32, gang: u64) -> bool {
    let s = shape(gpus, milli);
    let n = fleet.node(node).unwrap();
    if berth_core::predicate::check(n, &s).is_err() {
        return false;
    }
    let mask = default_gpus(n, &s);
    let a = Fleet::allocation(node, &s, mask);
    fleet.allocate(&a).unwrap();
    let id = running.len() as u32;
    running.push(Running {
        id,
        job_id: 1000 + u64::from(id),
        node,
        gpus: mask,
        gpu_milli: milli,
        cpu_milli: s.cpu_milli,
        memory_mib: s.memory_mib,
        priority: 1,
        movable: true,
        gang_id: gang,
        state_bytes: 20 << 30,
        remaining_s: 8 * 3600,
        running_s: 3600,
        since_checkpoint_s: 600,
        last_moved_s: None,
        class: Default::default(),
    });
    true
}

/// A fragmented fleet: every node of model 0 holds 1-3 small allocations.
fn fragmented(nodes: usize) -> (Fleet, Vec<Running>) {
    let mut f = fleet(nodes);
    let mut running = Vec::new();
    for k in 0..nodes as NodeId {
        let count = 1 + (k % 3);
        for j in 0..count {
            let gpus = [1, 2, 1][(j as usize + k as usize) % 3];
            place(&mut f, &mut running, k, gpus, 1000, 0);
        }
    }
    (f, running)
}

/// Every GPU-milli, CPU and memory the fleet holds is owned by exactly the
/// running allocations: recomputed from scratch and compared node by node.
fn assert_exact_ownership(fleet: &Fleet, running: &[Running]) {
    fleet.check_invariants().unwrap();
    let mut rebuilt = Fleet::new(
        fleet.models.clone(),
        fleet
            .nodes()
            .iter()
            .map(|n| {
                let mut m = Node::new(n.name.clone(), n.model, n.gpus.len(), n.cpu_total_milli, n.memory_total_mib);
                m.switch_domain = n.switch_domain;
                m.aggregation = n.aggregation;
                m.partition = n.partition;
                m.schedulable = n.schedulable;
                m
            })
            .collect(),
    )
    .unwrap();
    for r in running {
        rebuilt.allocate(&r.allocation()).unwrap_or_else(|e| panic!("allocation {} has a GPU with two owners: {e}", r.id));
    }
    assert_eq!(rebuilt.nodes(), fleet.nodes(), "fleet capacity differs from what the running allocations hold");
}

fn all(fleet: &Fleet) -> Vec<NodeId> {
    compaction::partition_nodes(fleet, None)
}

fn free_config() -> CompactionConfig {
    CompactionConfig { start_partial_pct: 0.0, stop_partial_pct: 0.0, ..CompactionConfig::default() }
}

fn run_step(fleet: &mut Fleet, running: &mut [Running], pending: &[Wanted], policy: &mut dyn CompactionPolicy, config: &CompactionConfig) -> compaction::StepOutcome {
    let nodes = all(fleet);
    let mut active = false;
    compaction::step(fleet, &nodes, running, pending, policy, config, &mut active, &mut SimulatedActuator, 100_000).unwrap()
}

#[test]
fn ipc_frees_whole_nodes_on_a_fragmented_fleet() {
    let (mut f, mut running) = fragmented(40);
    let jobs_before: Vec<u64> = running.iter().map(|r| r.job_id).collect();
    let pending = vec![Wanted { gpu_count: 8, gpu_milli: 1000, cpu_milli: 64_000, memory_mib: 65_536, model: Some(0), tasks: 4, whole_nodes: 4 }];
    let out = run_step(&mut f, &mut running, &pending, &mut ipc(), &free_config());
    let l = &out.ledger;
    assert!(out.rejected.is_none(), "{:?}", out.rejected);
    assert_eq!(l.idle_nodes_before, 0);
    assert!(l.idle_nodes_after >= 8, "only {} nodes freed", l.idle_nodes_after);
    assert!(l.partial_nodes_after < l.partial_nodes_before, "{} -> {}", l.partial_nodes_before, l.partial_nodes_after);
    assert_eq!(l.moves_run as usize, out.applied.len());
    assert!(l.bytes_moved() > 0);
    assert_eq!(l.bytes_moved(), out.applied.len() as u64 * (20 << 30));
    assert!(l.overlap_s > 0.0 && l.pause_s > 0.0 && l.warmup_s > 0.0);
    assert_eq!(l.pending_startable_before, 0);
    assert_eq!(l.pending_startable_after, 1);
    assert!(l.gang_unblocked);
    // Same model always; no job lost; ownership exact.
    for a in &out.applied {
        assert_eq!(f.node(a.from_node).unwrap().model, f.node(a.to_node).unwrap().model);
    }
    assert_eq!(running.iter().map(|r| r.job_id).collect::<Vec<_>>(), jobs_before);
    assert_exact_ownership(&f, &running);
}

#[test]
fn depth_one_frees_no_more_than_depth_three() {
    let (f, running) = fragmented(40);
    let mut results = Vec::new();
    for depth in [1, 3] {
        let (mut f, mut running) = (f.clone(), running.clone());
        let mut p = ipc();
        p.0.configure(&format!("{{\"depth\": {depth}}}")).unwrap();
        let out = run_step(&mut f, &mut running, &[], &mut p, &CompactionConfig { speculative_value: 1.0, ..free_config() });
        results.push(out.ledger.idle_nodes_after);
    }
    assert!(results[0] <= results[1], "{results:?}");
}

/// A small fleet for hostile plans: node 0 and 1 (domain 0), node 4
/// (domain 1), node 3 model 1 with work, one gang member on node 0.
fn hostile_setup() -> (Fleet, Vec<Running>) {
    let mut f = fleet(10);
    let mut running = Vec::new();
    place(&mut f, &mut running, 0, 2, 1000, 0); // 0
    place(&mut f, &mut running, 0, 1, 1000, 77); // 1: gang member
    place(&mut f, &mut running, 1, 7, 1000, 0); // 2: node 1 nearly full
    place(&mut f, &mut running, 2, 1, 1000, 0); // 3
    place(&mut f, &mut running, 5, 1, 1000, 0); // 4 (domain 1)
    running[3].movable = false;
    (f, running)
}

fn plan(moves: &[(u32, u32, u32, u64)]) -> Plan {
    let mut p = Plan::default();
    for &(c, a, d, g) in moves {
        p.chain.push(c);
        p.allocation.push(a);
        p.dest_node.push(d);
        p.dest_gpus.push(g);
    }
    p
}

#[test]
fn hostile_plans_are_rejected_whole_with_their_reason() {
    let cases: Vec<(&str, Plan)> = vec![
        // A valid first move, then a move to an over-full node: nothing runs.
        ("not enough free GPU", plan(&[(0, 4, 0, 0), (0, 0, 1, 0)])),
        ("unknown allocation 99", plan(&[(0, 99, 2, 0)])),
        ("gang 77", plan(&[(0, 1, 5, 0)])),
        ("not movable", plan(&[(0, 3, 0, 0)])),
        ("moved twice", plan(&[(0, 0, 2, 0), (1, 0, 5, 0)])),
        ("GPU model", plan(&[(0, 0, 4, 0)])),
        ("out of order", plan(&[(1, 0, 2, 0)])),
        ("already runs", plan(&[(0, 0, 0, 0)])),
        ("not in the partition", plan(&[(0, 0, 999, 0)])),
        ("names 1 GPUs", plan(&[(0, 0, 2, 0b1)])),
        ("has 0 milli free", plan(&[(0, 4, 1, 0b1)])),
        ("columns differ", Plan { chain: vec![0], allocation: vec![0, 1], dest_node: vec![2], dest_gpus: vec![0] }),
    ];
    for (want, p) in cases {
        let (mut f, mut running) = hostile_setup();
        let (before_nodes, before_running) = (f.nodes().to_vec(), running.clone());
        let out = run_step(&mut f, &mut running, &[], &mut Fixed(p), &free_config());
        let reason = out.rejected.unwrap_or_else(|| panic!("plan for {want:?} was not rejected"));
        assert!(reason.contains(want), "expected {want:?} in {reason:?}");
        assert_eq!(out.ledger.plans_rejected, 1);
        assert_eq!(out.ledger.moves_run, 0);
        assert_eq!(f.nodes(), &before_nodes[..], "{want}: the fleet changed");
        assert_eq!(running, before_running, "{want}: running changed");
    }
}

#[test]
fn a_gang_member_may_move_inside_its_switch_domain() {
    let (mut f, mut running) = hostile_setup();
    let nodes = all(&f);
    let moves = compaction::validate(&f, &nodes, &running, &plan(&[(0, 1, 2, 0)]), &free_config(), 0).unwrap();
    assert_eq!(moves.len(), 1);
    let mut ledger = Ledger::default();
    compaction::execute(&mut f, &mut running, &moves, &mut SimulatedActuator, &free_config(), 0, &mut ledger).unwrap();
    assert_eq!(running[1].node, 2);
    assert_eq!(ledger.bytes_same_switch, 20 << 30);
    assert_exact_ownership(&f, &running);
}

#[test]
fn residence_time_and_hysteresis_stop_ping_pong() {
    let (mut f, mut running) = hostile_setup();
    let config = free_config();
    let nodes = all(&f);
    // Move allocation 0 from node 0 to node 2 at t=0 ...
    let moves = compaction::validate(&f, &nodes, &running, &plan(&[(0, 0, 2, 0)]), &config, 0).unwrap();
    compaction::execute(&mut f, &mut running, &moves, &mut SimulatedActuator, &config, 0, &mut Ledger::default()).unwrap();
    // ... then back within the residence time: rejected; the snapshot marks it immovable.
    let err = compaction::validate(&f, &nodes, &running, &plan(&[(0, 0, 0, 0)]), &config, 60).unwrap_err();
    assert!(err.reason.contains("not movable"), "{err}");
    let snap = compaction::snapshot(&f, &nodes, &running, &[], &config, 60);
    let i = snap.allocations.ids.iter().position(|&id| id == 0).unwrap();
    assert_eq!(snap.allocations.movable[i], 0);
    assert!(compaction::validate(&f, &nodes, &running, &plan(&[(0, 0, 0, 0)]), &config, config.min_residence_s).is_ok());

    // Hysteresis: on at >= start, stays on until < stop.
    let config = CompactionConfig { start_partial_pct: 50.0, stop_partial_pct: 20.0, ..CompactionConfig::default() };
    let (mut f, mut running) = hostile_setup(); // 4 partial of 10 nodes = 40%
    let mut active = false;
    let mut never = Fixed(plan(&[(0, 99, 0, 0)])); // would be rejected if asked
    let out = compaction::step(&mut f, &nodes, &mut running, &[], &mut never, &config, &mut active, &mut SimulatedActuator, 0).unwrap();
    assert!(!active && out.ledger.steps_idle == 1 && out.ledger.plans == 0);
    active = true;
    let out = compaction::step(&mut f, &nodes, &mut running, &[], &mut never, &config, &mut active, &mut SimulatedActuator, 0).unwrap();
    assert!(active && out.ledger.plans == 1 && out.rejected.is_some());
}

#[test]
fn a_move_runs_only_when_it_pays_back() {
    // Node 6 holds one allocation; moving it to node 0 frees node 6.
    let (mut f, mut running) = hostile_setup();
    place(&mut f, &mut running, 6, 1, 1000, 0); // 5
    let p = plan(&[(0, 5, 0, 0)]);
    // Nearly done and huge: does not pay back.
    running[5].remaining_s = 60;
    running[5].state_bytes = 4 << 40;
    let out = run_step(&mut f.clone(), &mut running.clone(), &[], &mut Fixed(p.clone()), &free_config());
    assert!(out.rejected.is_none());
    assert_eq!(out.ledger.moves_run, 0);
    assert_eq!(out.ledger.chains_skipped, 1);
    assert!(out.chains[0].skipped.as_deref().unwrap().contains("does not pay back"));
    // Long-running and small: pays back.
    running[5].remaining_s = 20 * 3600;
    running[5].state_bytes = 10 << 30;
    let out = run_step(&mut f, &mut running, &[], &mut Fixed(p), &free_config());
    assert_eq!(out.ledger.moves_run, 1);
    assert_eq!(out.ledger.whole_nodes_gained, 1);
    assert_eq!(out.ledger.bytes_same_aggregation, 10 << 30); // domain 1 -> 0, aggregation 0
}

/// Fails or delays destinations by a seeded pattern.
struct Flaky {
    pattern: Vec<u8>,
    calls: usize,
}

impl Actuator for Flaky {
    fn migrate(&mut self, mv: &PlannedMove) -> MigrationResult {
        let k = self.pattern[self.calls % self.pattern.len()];
        self.calls += 1;
        match k % 3 {
            0 => MigrationResult::Ready { after_s: mv.transfer_s + mv.warmup_s },
            1 => MigrationResult::Failed("injected".into()),
            _ => MigrationResult::Ready { after_s: 1e9 }, // slow: past the deadline
        }
    }
}

#[test]
fn a_failed_destination_leaves_the_fleet_exactly_as_before() {
    let (mut f, mut running) = fragmented(20);
    let nodes = all(&f);
    let config = free_config();
    let mut snap = compaction::snapshot(&f, &nodes, &running, &[], &config, 0);
    let p = ipc().compact(&mut snap).unwrap();
    assert!(!p.allocation.is_empty());
    let moves = compaction::validate(&f, &nodes, &running, &p, &config, 0).unwrap();
    let (before_nodes, before_running) = (f.nodes().to_vec(), running.clone());
    let mut ledger = Ledger::default();
    let applied = compaction::execute(&mut f, &mut running, &moves, &mut Flaky { pattern: vec![1, 2], calls: 0 }, &config, 0, &mut ledger).unwrap();
    assert!(applied.is_empty());
    assert!(ledger.moves_rolled_back > 0);
    assert_eq!(f.nodes(), &before_nodes[..]);
    assert_eq!(running, before_running);
}

fn arb_fleet_and_work() -> impl Strategy<Value = (Fleet, Vec<Running>)> {
    (4usize..24, prop::collection::vec((0u32..24, 0u32..4, 1u32..=1000, any::<bool>(), any::<bool>()), 0..80)).prop_map(|(n, work)| {
        let mut f = fleet(n);
        let mut running = Vec::new();
        for (node, kind, milli, gang, pinned) in work {
            let node = node % n as u32;
            let (gpus, milli) = match kind {
                0 => (1, milli),
                1 => (1, 1000),
                2 => (2, 1000),
                _ => (0, 0),
            };
            if place(&mut f, &mut running, node, gpus, milli, if gang { 5 } else { 0 }) {
                let last = running.last_mut().unwrap();
                last.movable = !pinned;
            }
        }
        (f, running)
    })
}

fn arb_plan() -> impl Strategy<Value = Plan> {
    prop::collection::vec((0u32..2, 0u32..90, 0u32..26, prop_oneof![Just(0u64), 0u64..256]), 0..12).prop_map(|moves| {
        let mut p = Plan::default();
        let mut chain = 0;
        for (i, (next, a, d, g)) in moves.into_iter().enumerate() {
            if i > 0 {
                chain += next;
            }
            p.chain.push(chain);
            p.allocation.push(a);
            p.dest_node.push(d);
            p.dest_gpus.push(g);
        }
        p
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Whatever the plan: rejected leaves everything as it was; a validated
    /// plan executes every move without over-committing (validation sees
    /// the same state execution will).
    #[test]
    fn no_validated_plan_over_commits((f, running) in arb_fleet_and_work(), p in arb_plan()) {
        let (mut f, mut running) = (f, running);
        let nodes = all(&f);
        let config = free_config();
        let before = f.nodes().to_vec();
        match compaction::validate(&f, &nodes, &running, &p, &config, 0) {
            Err(e) => {
                prop_assert!(!e.reason.is_empty());
                prop_assert_eq!(f.nodes(), &before[..]);
            }
            Ok(moves) => {
                let mut ledger = Ledger::default();
                let applied = compaction::execute(&mut f, &mut running, &moves, &mut SimulatedActuator, &config, 0, &mut ledger).unwrap();
                prop_assert_eq!(applied.len(), moves.len());
                prop_assert_eq!(ledger.chains_abandoned, 0);
                assert_exact_ownership(&f, &running);
            }
        }
    }

    /// The IPC plan under injected failures and slow destinations: no GPU
    /// with two owners, no job lost, moved jobs only where planned, and the
    /// ledger counts every rolled-back move.
    #[test]
    fn rollback_never_double_allocates((f, running) in arb_fleet_and_work(), pattern in prop::collection::vec(0u8..3, 1..8)) {
        let (mut f, mut running) = (f, running);
        let nodes = all(&f);
        let config = CompactionConfig { speculative_value: 1.0, payback_margin: 0.0, ..free_config() };
        let ids: Vec<(u32, u64)> = running.iter().map(|r| (r.id, r.job_id)).collect();
        let mut snap = compaction::snapshot(&f, &nodes, &running, &[], &config, 0);
        let p = ipc().compact(&mut snap).unwrap();
        let moves = compaction::validate(&f, &nodes, &running, &p, &config, 0).expect("IPC plans validate");
        let (chosen, _) = compaction::select(&f, &nodes, &running, &[], &moves, &config);
        let mut ledger = Ledger::default();
        let mut flaky = Flaky { pattern, calls: 0 };
        let applied = compaction::execute(&mut f, &mut running, &chosen, &mut flaky, &config, 0, &mut ledger).unwrap();
        prop_assert_eq!(running.iter().map(|r| (r.id, r.job_id)).collect::<Vec<_>>(), ids);
        prop_assert_eq!(ledger.moves_run as usize, applied.len());
        prop_assert_eq!(ledger.moves_run + ledger.moves_rolled_back, flaky.calls as u64);
        for a in &applied {
            prop_assert_eq!(running[a.index].node, a.to_node);
        }
        assert_exact_ownership(&f, &running);
    }
}

#[test]
fn step_jobs_rewrites_the_event_loops_allocations() {
    let mut f = fleet(12);
    let mut jobs = Vec::new();
    let mut held: Vec<Vec<Allocation>> = Vec::new();
    let mut running = Vec::new();
    // One 1-GPU job per node 0..11 of model 0: 12 partial nodes.
    for k in 0..12u32 {
        if f.node(k).unwrap().model != Some(0) {
            continue;
        }
        let s = shape(1, 1000);
        let a = Fleet::allocation(k, &s, default_gpus(f.node(k).unwrap(), &s));
        f.allocate(&a).unwrap();
        jobs.push(Job { id: u64::from(k), priority: 1, arrival_s: 0, duration_s: 86_400, tasks: 1, shape: s, ..Job::default() });
        held.push(vec![a]);
        running.push((86_400u64, jobs.len() - 1));
    }
    let mut state = CompactionState::default();
    let config = CompactionConfig { speculative_value: 1.0, ..CompactionConfig::default() };
    let out = compaction::step_jobs(&mut f, &jobs, &mut held, &running, &[], &mut ipc(), &config, &mut state, 3600).unwrap();
    assert!(out.ledger.moves_run > 0);
    assert!(out.ledger.whole_nodes_gained > 0);
    // held matches the fleet exactly.
    let as_running: Vec<Running> = held
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, a)| Running {
            id: i as u32,
            job_id: 0,
            node: a.node,
            gpus: a.gpus,
            gpu_milli: a.gpu_milli,
            cpu_milli: a.cpu_milli,
            memory_mib: a.memory_mib,
            priority: 0,
            movable: true,
            gang_id: 0,
            state_bytes: 0,
            remaining_s: 0,
            running_s: 0,
            since_checkpoint_s: 0,
            last_moved_s: None,
            class: Default::default(),
        })
        .collect();
    assert_exact_ownership(&f, &as_running);
    // The moved tasks are resident now: an immediate second step moves none of them.
    let moved: Vec<u64> = out.applied.iter().map(|a| a.job_id).collect();
    let again = compaction::step_jobs(&mut f, &jobs, &mut held, &running, &[], &mut ipc(), &config, &mut state, 3700).unwrap();
    assert!(again.applied.iter().all(|a| !moved.contains(&a.job_id)));
}
