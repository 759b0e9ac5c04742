//! The three denominators, stranded causes and quotes on a fleet whose
//! every node is in a known state.

use berth_core::accounting::{account, outcome, quote, NodeFacts, PendingShape, StrandedCause, Work};
use berth_core::{Fleet, Node, TaskShape};

/// Node 0: model A, idle. Node 1: model A, unhealthy. Node 2: model A,
/// 6 of 8 GPUs busy. Node 3: model A, GPUs idle but CPU all taken.
/// Node 4: model B, idle. Node 5: model A, idle, in another domain.
fn fleet() -> (Fleet, Vec<berth_core::Allocation>) {
    let mut nodes: Vec<Node> = (0..6).map(|i| Node::new(format!("n{i}"), Some(if i == 4 { 1 } else { 0 }), 8, 64_000, 512_000)).collect();
    nodes[1].schedulable = false;
    nodes[5].switch_domain = 1;
    let mut fleet = Fleet::new(vec!["A".into(), "B".into()], nodes).unwrap();
    let six = TaskShape { gpu_count: 6, gpu_milli: 1000, cpu_milli: 8_000, memory_mib: 1024, models: vec![] };
    let cpu_hog = TaskShape { gpu_count: 0, gpu_milli: 0, cpu_milli: 64_000, memory_mib: 1024, models: vec![] };
    let a = Fleet::allocation(2, &six, 0b0011_1111);
    let b = Fleet::allocation(3, &cpu_hog, 0);
    fleet.allocate(&a).unwrap();
    fleet.allocate(&b).unwrap();
    (fleet, vec![a, b])
}

fn whole_node_a(tasks: u32, same_domain: bool) -> PendingShape {
    PendingShape { shape: TaskShape { gpu_count: 8, gpu_milli: 1000, cpu_milli: 32_000, memory_mib: 1024, models: vec![0] }, tasks, same_domain }
}

/// Every node powered; productive as given; nothing reclaimable.
fn facts(productive: impl Fn(&Node) -> u64) -> impl Fn(usize, &Node) -> NodeFacts {
    move |_, n| NodeFacts { powered: true, productive_milli: productive(n), reclaimable_milli: 0 }
}

#[test]
fn denominators_and_stranded_causes() {
    let (fleet, _) = fleet();
    let acc = account(&fleet, &[whole_node_a(1, false)], &[0, 0, 0, 1, 1, 1], &facts(|n| n.gpu_total_milli() - n.gpu_free_milli()));
    assert_eq!(acc.total.installed, 48.0);
    assert_eq!(acc.total.powered, 48.0);
    assert_eq!(acc.total.healthy, 40.0);
    assert_eq!(acc.total.busy, 6.0);
    assert_eq!(acc.total.productive, 6.0);
    // Nodes 0 and 5 can take the pending 8-GPU task.
    assert_eq!(acc.total.schedulable, 16.0);
    assert_eq!(acc.stranded.get(&StrandedCause::PartiallyUsed), Some(&2.0));
    assert_eq!(acc.stranded.get(&StrandedCause::CpuStarved), Some(&8.0));
    assert_eq!(acc.stranded.get(&StrandedCause::ModelMismatch), Some(&8.0));
    assert_eq!(acc.by_model["B"].installed, 8.0);
    assert_eq!(acc.by_partition[&1].installed, 24.0);
    // Every idle healthy GPU is either schedulable or stranded.
    let idle_healthy = acc.total.healthy - 6.0;
    assert_eq!(acc.total.schedulable + acc.stranded.values().sum::<f64>(), idle_healthy);
}

#[test]
fn gangs_that_want_one_domain_strand_split_capacity() {
    let (fleet, _) = fleet();
    // Two whole nodes in one domain: domains 0 and 1 have one fitting node each.
    let acc = account(&fleet, &[whole_node_a(2, true)], &[0; 6], &facts(|_| 0));
    assert_eq!(acc.total.schedulable, 0.0);
    assert_eq!(acc.stranded.get(&StrandedCause::Topology), Some(&16.0));
    let loose = account(&fleet, &[whole_node_a(2, false)], &[0; 6], &facts(|_| 0));
    assert_eq!(loose.total.schedulable, 16.0);
}

#[test]
fn a_powered_down_node_is_installed_not_powered_and_reclaimable_is_bounded_by_installed() {
    let (fleet, _) = fleet();
    // Node 0 (idle) powered down; node 2 holds 6 busy GPUs of preemptible
    // work, and a caller claiming more than a node has is held to it.
    let acc = account(&fleet, &[whole_node_a(1, false)], &[0; 6], &|i, _| NodeFacts {
        powered: i != 0,
        productive_milli: 0,
        reclaimable_milli: match i {
            2 => 6_000,
            4 => 99_000,
            _ => 0,
        },
    });
    assert_eq!(acc.total.installed, 48.0);
    assert_eq!(acc.total.powered, 40.0);
    // Node 1 is unhealthy, node 0 off: neither is healthy nor schedulable.
    assert_eq!(acc.total.healthy, 32.0);
    assert_eq!(acc.total.schedulable, 8.0, "only node 5 can take the whole-node task now");
    assert_eq!(acc.total.reclaimable, 14.0);
}

#[test]
fn the_outcome_counts_goodput_per_installed_hour_and_per_cost() {
    let work = Work { done: 1_000.0, lost: 200.0 };
    let o = outcome(work, 400.0, Some(800.0));
    assert_eq!(o.work.goodput(), 800.0);
    assert_eq!(o.per_installed_gpu_hour, 2.0);
    assert_eq!(o.per_cost, Some(1.0));
    let none = outcome(Work::default(), 0.0, None);
    assert_eq!((none.per_installed_gpu_hour, none.per_cost), (0.0, None));
    // Lost work never makes goodput negative.
    assert_eq!(Work { done: 5.0, lost: 9.0 }.goodput(), 0.0);
}

#[test]
fn quotes_count_now_and_the_next_start() {
    let (fleet, allocs) = fleet();
    let q = quote(&fleet, &whole_node_a(1, false), &[(5_000, vec![allocs[0].clone()]), (9_000, vec![allocs[1].clone()])], 1_000, Some(0));
    assert_eq!(q.now, 2);
    // Node 2 frees at t=5000, i.e. 4000 s from now.
    assert_eq!(q.next_in_s, Some(4_000));
    assert_eq!(q.meets_deadline, Some(true), "two could start now");
    let running = [(5_000, vec![allocs[0].clone()]), (9_000, vec![allocs[1].clone()])];
    let gang = quote(&fleet, &whole_node_a(3, true), &running, 1_000, Some(7_999));
    assert_eq!(gang.now, 0);
    // Domain 0 holds three free nodes once node 3's CPU is back too.
    assert_eq!(gang.next_in_s, Some(8_000));
    assert_eq!(gang.meets_deadline, Some(false));
    assert_eq!(quote(&fleet, &whole_node_a(3, true), &running, 1_000, Some(8_000)).meets_deadline, Some(true));
    assert_eq!(quote(&fleet, &whole_node_a(3, true), &running, 1_000, None).meets_deadline, None);
}
