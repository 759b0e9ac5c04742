//! "What would let it start": the smallest stop, move and repair that let
//! a pending job start now, each with its cost, on copies of the fleet.

use berth_core::whatif::{what_would_let_it_start, Change, Running};
use berth_core::{Allocation, Fleet, Job, Node, TaskShape};

fn shape(gpus: u32) -> TaskShape {
    TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![] }
}

/// Node 0: job 1 (8 GPUs). Node 1: job 2 (4 GPUs), 4 free. Node 2: down,
/// empty. Node 3: job 3 (4 GPUs), 4 free.
fn fleet() -> (Fleet, Vec<Allocation>) {
    let nodes = (0..4).map(|i| Node::new(&format!("n{i}"), Some(0), 8, 64_000, 256_000)).collect();
    let mut fleet = Fleet::new(vec!["H800".into()], nodes).unwrap();
    fleet.set_schedulable(2, false).unwrap();
    let mut allocs = Vec::new();
    for (node, gpus) in [(0, 8), (1, 4), (3, 4)] {
        let a = Fleet::allocation(node, &shape(gpus), (1u64 << gpus) - 1);
        fleet.allocate(&a).unwrap();
        allocs.push(a);
    }
    (fleet, allocs)
}

fn running<'a>(allocs: &'a [Allocation], stoppable: [bool; 3], lost: [f64; 3], movable: [bool; 3]) -> Vec<Running<'a>> {
    (0..3)
        .map(|k| Running {
            job_id: k as u64 + 1,
            priority: 0,
            allocations: std::slice::from_ref(&allocs[k]),
            stoppable: stoppable[k],
            lost_gpu_s: lost[k],
            movable: movable[k],
            state_bytes_per_task: 1 << 30,
        })
        .collect()
}

#[test]
fn each_kind_of_change_is_the_smallest_that_works() {
    let (fleet, allocs) = fleet();
    let demand = Job { id: 9, priority: 5, tasks: 1, shape: shape(8), ..Job::default() };
    let all = |_: u32, _: &Node| true;
    // Stop the job that loses least and makes room: jobs 2 and 3 each
    // free a node's other half; job 2 loses 10 GPU-s, job 3 20.
    let changes = what_would_let_it_start(&fleet, &demand, &all, &all, &running(&allocs, [true; 3], [100.0, 10.0, 20.0], [false, true, false]));
    assert_eq!(changes[0], Change::Preempt { jobs: vec![2], lost_gpu_s: 10.0 }, "{changes:?}");
    // Move job 2's task to node 3 (its only room on its model): node 1 empties.
    assert_eq!(changes[1], Change::Move { moves: vec![(2, 1, 3)], bytes: 1 << 30 }, "{changes:?}");
    // Bring node 2 back.
    assert_eq!(changes[2], Change::Repair { nodes: vec![2] }, "{changes:?}");
    assert_eq!(changes.len(), 3);

    // Guaranteed work (not stoppable) is never named, however cheap.
    let changes = what_would_let_it_start(&fleet, &demand, &all, &all, &running(&allocs, [true, false, false], [100.0, 0.0, 0.0], [false; 3]));
    assert_eq!(changes[0], Change::Preempt { jobs: vec![1], lost_gpu_s: 100.0 }, "{changes:?}");
    assert!(!changes.iter().any(|c| matches!(c, Change::Move { .. })), "nothing movable: {changes:?}");

    // Work of the job's own priority or above is never stopped.
    let equal = Job { priority: 0, ..demand.clone() };
    let changes = what_would_let_it_start(&fleet, &equal, &all, &all, &running(&allocs, [true; 3], [1.0; 3], [false; 3]));
    assert_eq!(changes, vec![Change::Repair { nodes: vec![2] }]);

    // A job that fits now needs no change.
    let small = Job { shape: shape(4), ..demand };
    assert!(what_would_let_it_start(&fleet, &small, &all, &all, &running(&allocs, [true; 3], [1.0; 3], [true; 3])).is_empty());
}

#[test]
fn a_stop_of_one_older_job_beats_two_younger_ones_that_fill_a_node() {
    // Node 0: job 1 (4 GPUs, 5 GPU-s lost), 4 free. Node 1: jobs 2 and 3
    // (4 GPUs each, 3 GPU-s lost each), none free. For 8 GPUs the walk
    // cheapest first stops 2 and 3 (6 GPU-s); stopping job 1 loses 5.
    let nodes = (0..2).map(|i| Node::new(&format!("n{i}"), Some(0), 8, 64_000, 256_000)).collect();
    let mut fleet = Fleet::new(vec!["H800".into()], nodes).unwrap();
    let allocs: Vec<Allocation> = [(0, 0x0f), (1, 0x0f), (1, 0xf0)].into_iter().map(|(node, mask)| Fleet::allocation(node, &shape(4), mask)).collect();
    for a in &allocs {
        fleet.allocate(a).unwrap();
    }
    let mut running = running(&allocs, [true; 3], [5.0, 3.0, 3.0], [false; 3]);
    let demand = Job { id: 9, priority: 5, tasks: 1, shape: shape(8), ..Job::default() };
    let all = |_: u32, _: &Node| true;
    let changes = what_would_let_it_start(&fleet, &demand, &all, &all, &running);
    assert_eq!(changes, vec![Change::Preempt { jobs: vec![1], lost_gpu_s: 5.0 }]);
    // Once job 1 has more to lose than the two together, they are named.
    running[0].lost_gpu_s = 7.0;
    let changes = what_would_let_it_start(&fleet, &demand, &all, &all, &running);
    assert_eq!(changes, vec![Change::Preempt { jobs: vec![2, 3], lost_gpu_s: 6.0 }]);
}
