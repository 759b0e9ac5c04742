//! Quotes with a probability: runs forward over sampled run times and
//! replayed arrivals, against cases whose answer is known.

use berth_core::accounting::PendingShape;
use berth_core::forecast::{chance, Arrival, History, Now, Running};
use berth_core::{Allocation, Fleet, Node, TaskShape};

fn whole_node() -> TaskShape {
    TaskShape { gpu_count: 8, gpu_milli: 1000, cpu_milli: 8_000, memory_mib: 1024, models: vec![] }
}

/// Two 8-GPU nodes, each held whole by one running job.
fn full() -> (Fleet, Vec<Allocation>) {
    let mut fleet = Fleet::new(vec!["A".into()], (0..2).map(|i| Node::new(format!("n{i}"), Some(0), 8, 64_000, 512_000)).collect()).unwrap();
    let allocs: Vec<Allocation> = (0..2).map(|n| Fleet::allocation(n, &whole_node(), 0xff)).collect();
    for a in &allocs {
        fleet.allocate(a).unwrap();
    }
    (fleet, allocs)
}

fn one_node() -> PendingShape {
    PendingShape { shape: whole_node(), tasks: 1, same_domain: false }
}

#[test]
fn the_chance_follows_the_remaining_run_times_of_the_class() {
    let (fleet, allocs) = full();
    // Class 0 ran 60 s half the time and 1,000 s the other half; both jobs
    // have run 50 s: each ends within the next 10 s or after 950 s.
    let history = History { finished_s: vec![[vec![60; 50], vec![1000; 50]].concat()], ..Default::default() };
    let running: Vec<Running> = allocs.iter().map(|a| Running { allocations: vec![a.clone()], class: 0, elapsed_s: 50, planned_remaining_s: None }).collect();
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[] }, &one_node(), &history, 100, 2_000, 7);
    // A node frees unless both jobs are long: 1 - 1/4.
    assert!((c.probability - 0.75).abs() < 0.04, "{c:?}");
    assert!(c.low < 0.75 && 0.75 < c.high && c.high - c.low < 0.06, "{c:?}");
    assert_eq!(c.median_start_s, Some(10));
    // Seeded: the same answer again.
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &[] }, &one_node(), &history, 100, 2_000, 7), c);
    // Past 950 s every job has ended.
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &[] }, &one_node(), &history, 950, 500, 7).probability, 1.0);
    // Jobs that have run past every finished one fall back on their
    // planned end (none: never within the deadline).
    let old: Vec<Running> = running.iter().map(|r| Running { elapsed_s: 5_000, ..r.clone() }).collect();
    assert_eq!(chance(Now { fleet: &fleet, running: &old, queued: &[] }, &one_node(), &history, 100_000, 200, 7).started, 0);
    let planned: Vec<Running> = old.iter().map(|r| Running { planned_remaining_s: Some(30), ..r.clone() }).collect();
    assert_eq!(chance(Now { fleet: &fleet, running: &planned, queued: &[] }, &one_node(), &history, 30, 200, 7).probability, 1.0);
}

#[test]
fn competing_work_takes_the_room_first() {
    let (fleet, allocs) = full();
    // Node 0's job ends at 10 s for sure; node 1's never within the
    // deadline. In the recent window a whole-node job arrived every 20 s
    // and ran 1,000 s.
    let history = History {
        finished_s: vec![vec![60], vec![]],
        arrivals: (0..5).map(|k| Arrival { at_s: 20 * k, shape: whole_node(), tasks: 1, duration_s: 1000 }).collect(),
        window_s: 100,
    };
    let running = vec![
        Running { allocations: vec![allocs[0].clone()], class: 0, elapsed_s: 50, planned_remaining_s: None },
        Running { allocations: vec![allocs[1].clone()], class: 1, elapsed_s: 50, planned_remaining_s: None },
    ];
    let quiet = History { arrivals: Vec::new(), ..history.clone() };
    let alone = chance(Now { fleet: &fleet, running: &running, queued: &[] }, &one_node(), &quiet, 15, 300, 3);
    assert_eq!((alone.probability, alone.median_start_s), (1.0, Some(10)));
    // The first arrival comes at a uniform 0-19 s: at or before 10 s (11
    // in 20) it waits ahead of the request and takes node 0 when it frees.
    let crowded = chance(Now { fleet: &fleet, running: &running, queued: &[] }, &one_node(), &history, 15, 4_000, 3);
    assert!((crowded.probability - 0.45).abs() < 0.03, "{crowded:?}");
    // Work already queued ahead takes it for sure.
    let ahead = [Arrival { at_s: 0, shape: whole_node(), tasks: 1, duration_s: 1000 }];
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &ahead }, &one_node(), &quiet, 15, 300, 3).started, 0);
    // Work that cannot fit does not block the request (it waits on).
    let too_big = [Arrival { at_s: 0, shape: whole_node(), tasks: 3, duration_s: 1000 }];
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &too_big }, &one_node(), &quiet, 15, 300, 3).probability, 1.0);
    // A copy that fits now starts now, unless queued work takes the room.
    let mut free = fleet.clone();
    free.release(&allocs[0]).unwrap();
    let now = chance(Now { fleet: &free, running: &running, queued: &[] }, &one_node(), &history, 0, 100, 3);
    assert_eq!((now.probability, now.median_start_s), (1.0, Some(0)));
    assert_eq!(chance(Now { fleet: &free, running: &running, queued: &ahead }, &one_node(), &quiet, 5, 100, 3).started, 0);
}
