//! Quotes with a probability: runs forward over sampled run times and
//! replayed arrivals, against cases whose answer is known.

use berth_core::accounting::PendingShape;
use berth_core::forecast::{chance, Arrival, History, Now, Running};
use berth_core::sim::WorkRates;
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
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 100, 2_000, 7);
    // A node frees unless both jobs are long: 1 - 1/4.
    assert!((c.probability - 0.75).abs() < 0.04, "{c:?}");
    assert!(c.low < 0.75 && 0.75 < c.high && c.high - c.low < 0.06, "{c:?}");
    assert_eq!(c.median_start_s, Some(10));
    // Seeded: the same answer again.
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 100, 2_000, 7), c);
    // Past 950 s every job has ended.
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 950, 500, 7).probability, 1.0);
    // Jobs that have run past every finished one fall back on their
    // planned end (none: never within the deadline).
    let old: Vec<Running> = running.iter().map(|r| Running { elapsed_s: 5_000, ..r.clone() }).collect();
    assert_eq!(chance(Now { fleet: &fleet, running: &old, queued: &[], rates: None }, &one_node(), &history, 100_000, 200, 7).started, 0);
    let planned: Vec<Running> = old.iter().map(|r| Running { planned_remaining_s: Some(30), ..r.clone() }).collect();
    assert_eq!(chance(Now { fleet: &fleet, running: &planned, queued: &[], rates: None }, &one_node(), &history, 30, 200, 7).probability, 1.0);
}

#[test]
fn competing_work_takes_the_room_first() {
    let (fleet, allocs) = full();
    // Node 0's job ends at 10 s for sure; node 1's never within the
    // deadline. In the recent window a whole-node job arrived every 20 s
    // and ran 1,000 s.
    let history = History {
        finished_s: vec![vec![60], vec![]],
        arrivals: (0..5).map(|k| Arrival { at_s: 20 * k, shape: whole_node(), tasks: 1, duration_s: 1000, ahead: true, class: None }).collect(),
        window_s: 100,
    };
    let running = vec![
        Running { allocations: vec![allocs[0].clone()], class: 0, elapsed_s: 50, planned_remaining_s: None },
        Running { allocations: vec![allocs[1].clone()], class: 1, elapsed_s: 50, planned_remaining_s: None },
    ];
    let quiet = History { arrivals: Vec::new(), ..history.clone() };
    let alone = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &quiet, 15, 300, 3);
    assert_eq!((alone.probability, alone.median_start_s), (1.0, Some(10)));
    // The first arrival comes at a uniform 0-19 s: at or before 10 s (11
    // in 20) it waits ahead of the request and takes node 0 when it frees.
    let crowded = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 15, 4_000, 3);
    assert!((crowded.probability - 0.45).abs() < 0.03, "{crowded:?}");
    // Work already queued ahead takes it for sure.
    let ahead = [Arrival { at_s: 0, shape: whole_node(), tasks: 1, duration_s: 1000, ahead: true, class: None }];
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &ahead, rates: None }, &one_node(), &quiet, 15, 300, 3).started, 0);
    // Work that cannot fit does not block the request (it waits on).
    let too_big = [Arrival { at_s: 0, shape: whole_node(), tasks: 3, duration_s: 1000, ahead: true, class: None }];
    assert_eq!(chance(Now { fleet: &fleet, running: &running, queued: &too_big, rates: None }, &one_node(), &quiet, 15, 300, 3).probability, 1.0);
    // A copy that fits now starts now, unless queued work takes the room.
    let mut free = fleet.clone();
    free.release(&allocs[0]).unwrap();
    let now = chance(Now { fleet: &free, running: &running, queued: &[], rates: None }, &one_node(), &history, 0, 100, 3);
    assert_eq!((now.probability, now.median_start_s), (1.0, Some(0)));
    assert_eq!(chance(Now { fleet: &free, running: &running, queued: &ahead, rates: None }, &one_node(), &quiet, 5, 100, 3).started, 0);
}

#[test]
fn work_behind_the_request_only_takes_room_that_is_free_when_it_comes() {
    let (fleet, allocs) = full();
    // Node 0 frees at 10 s; node 1 never within the deadline. Lower-priority
    // whole-node work arrives every 20 s: it waits behind the request, so
    // the request gets node 0 in every run.
    let history = History {
        finished_s: vec![vec![60], vec![]],
        arrivals: (0..5).map(|k| Arrival { at_s: 20 * k, shape: whole_node(), tasks: 1, duration_s: 1000, ahead: false, class: None }).collect(),
        window_s: 100,
    };
    let running = vec![
        Running { allocations: vec![allocs[0].clone()], class: 0, elapsed_s: 50, planned_remaining_s: None },
        Running { allocations: vec![allocs[1].clone()], class: 1, elapsed_s: 50, planned_remaining_s: None },
    ];
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 15, 500, 9);
    assert_eq!((c.probability, c.median_start_s), (1.0, Some(10)));
    // But room free when it comes is taken: a one-GPU request behind a
    // stream of one-GPU fill on a node with one GPU free.
    let mut fleet1 = fleet.clone();
    fleet1.release(&allocs[0]).unwrap();
    let seven = TaskShape { gpu_count: 7, ..whole_node() };
    fleet1.allocate(&Fleet::allocation(0, &TaskShape { cpu_milli: 7_000, ..seven.clone() }, 0x7f)).unwrap();
    let one_gpu = TaskShape { gpu_count: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 128, models: vec![] };
    let fill = History { arrivals: vec![Arrival { at_s: 0, shape: one_gpu.clone(), tasks: 1, duration_s: 10_000, ahead: false, class: None }], window_s: 1, ..Default::default() };
    let two = PendingShape { shape: TaskShape { gpu_count: 2, ..one_gpu }, tasks: 1, same_domain: false };
    assert_eq!(chance(Now { fleet: &fleet1, running: &[], queued: &[], rates: None }, &two, &fill, 100, 50, 1).started, 0);
}

#[test]
fn a_running_job_never_outlives_its_planned_end() {
    let (fleet, allocs) = full();
    // Every finished job of the class ran 10,000 s, but these two must stop
    // 20 s from now (a time limit).
    let history = History { finished_s: vec![vec![10_000; 10]], ..Default::default() };
    let running: Vec<Running> = allocs.iter().map(|a| Running { allocations: vec![a.clone()], class: 0, elapsed_s: 50, planned_remaining_s: Some(20) }).collect();
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 30, 100, 1);
    assert_eq!((c.probability, c.median_start_s), (1.0, Some(20)));
}

#[test]
fn samples_run_in_any_order_give_the_same_answer_and_the_rate_of_the_start() {
    use berth_core::forecast::{start_rate, summarize, Forecast};
    // Two models, two switch domains: model F (speed 1) on domain 0, model
    // S (speed 0.5) on domain 1, two 8-GPU nodes each.
    let node = |i: u32, model: u32, domain: u32| {
        let mut n = Node::new(format!("n{i}"), Some(model), 8, 64_000, 512_000);
        n.switch_domain = domain;
        n
    };
    let mut fleet = Fleet::new(vec!["F".into(), "S".into()], vec![node(0, 0, 0), node(1, 0, 0), node(2, 1, 1), node(3, 1, 1)]).unwrap();
    let rates = WorkRates { model_speed: vec![1.0, 0.5], cross_domain_slowdown: 1.25 };
    let gang = |tasks| PendingShape { shape: whole_node(), tasks, same_domain: false };
    // Room everywhere: two nodes fit in domain 0 at full speed.
    assert_eq!(start_rate(&fleet, &gang(2), Some(&rates)), 1.0);
    // One fast node left: the gang fits only on the slow model.
    fleet.allocate(&Fleet::allocation(0, &whole_node(), 0xff)).unwrap();
    assert_eq!(start_rate(&fleet, &gang(2), Some(&rates)), 0.5);
    // Only a gang across both models fits: as slow as the slower, across.
    fleet.allocate(&Fleet::allocation(2, &whole_node(), 0xff)).unwrap();
    assert_eq!(start_rate(&fleet, &gang(2), Some(&rates)), 0.5 / 1.25);
    assert_eq!(start_rate(&fleet, &gang(2), None), 1.0);

    // Runs in any order: the same summary as `chance`.
    let running = vec![
        Running { allocations: vec![Fleet::allocation(0, &whole_node(), 0xff)], class: 0, elapsed_s: 0, planned_remaining_s: None },
        Running { allocations: vec![Fleet::allocation(2, &whole_node(), 0xff)], class: 0, elapsed_s: 0, planned_remaining_s: None },
    ];
    let history = History { finished_s: vec![(1..=100).map(|k| k * 10).collect()], ..Default::default() };
    let now = Now { fleet: &fleet, running: &running, queued: &[Arrival { at_s: 0, shape: whole_node(), tasks: 1, duration_s: 5, ahead: true, class: None }], rates: Some(&rates) };
    let want = chance(now, &gang(2), &history, 400, 300, 5);
    let request = gang(2);
    let f = Forecast::new(now, &request, &history, 400, 5);
    let reversed: Vec<_> = (0..300).rev().filter_map(|i| f.run(i)).collect();
    assert_eq!(summarize(300, reversed), want);
    // Some runs start on the fast domain (its job ended first), some across.
    let rate = want.rate.expect("some started");
    assert!(want.started > 0 && rate > 0.5 / 1.25 && rate < 1.0, "{want:?}");
}

#[test]
fn the_window_of_arrivals_comes_again_until_the_deadline() {
    let (fleet, allocs) = full();
    // Both nodes free at 500 s (a planned end); the window is 100 s long
    // and held one higher-priority whole-node job. Replayed once, one such
    // job waits at 500 s and the request gets the other node; replayed
    // every window, five wait ahead and take both.
    let running: Vec<Running> = allocs.iter().map(|a| Running { allocations: vec![a.clone()], class: 0, elapsed_s: 0, planned_remaining_s: Some(500) }).collect();
    let history = History { arrivals: vec![Arrival { at_s: 0, shape: whole_node(), tasks: 1, duration_s: 100_000, ahead: true, class: None }], window_s: 100, ..Default::default() };
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &history, 1_000, 100, 2);
    assert_eq!(c.started, 0, "{c:?}");
    // With the deadline inside the first window, one came and one node is left.
    let short = History { window_s: 1_000, ..history.clone() };
    let c = chance(Now { fleet: &fleet, running: &running, queued: &[], rates: None }, &one_node(), &short, 600, 100, 2);
    assert_eq!((c.probability, c.median_start_s), (1.0, Some(500)), "{c:?}");
}

#[test]
fn runs_on_slower_placements_last_longer_for_the_same_work() {
    // Node 0 is of model A (full speed), node 1 of model B (half speed);
    // each is held whole by a job that has run 50 s. Finished jobs all did
    // 100 s of work: at full speed the job on A ends at 50 s; the one on B
    // has done 25 s of work and ends after 75 s of work more, 150 s.
    let mut fleet = Fleet::new(vec!["A".into(), "B".into()], (0..2).map(|i| Node::new(format!("n{i}"), Some(i), 8, 64_000, 512_000)).collect()).unwrap();
    let allocs: Vec<Allocation> = (0..2).map(|n| Fleet::allocation(n, &whole_node(), 0xff)).collect();
    for a in &allocs {
        fleet.allocate(a).unwrap();
    }
    let running: Vec<Running> = allocs.iter().map(|a| Running { allocations: vec![a.clone()], class: 0, elapsed_s: 50, planned_remaining_s: None }).collect();
    let history = History { finished_s: vec![vec![100; 40]], ..Default::default() };
    let rates = WorkRates { model_speed: vec![1.0, 0.5], cross_domain_slowdown: 1.27 };
    let on = |model: u32| PendingShape { shape: TaskShape { models: vec![model], ..whole_node() }, tasks: 1, same_domain: false };
    let quote = |model: u32, deadline_s: u64, rates: Option<&WorkRates>| chance(Now { fleet: &fleet, running: &running, queued: &[], rates }, &on(model), &history, deadline_s, 200, 5);
    assert_eq!(quote(0, 60, Some(&rates)).median_start_s, Some(50));
    assert_eq!(quote(1, 140, Some(&rates)).started, 0);
    assert_eq!(quote(1, 150, Some(&rates)).median_start_s, Some(150));
    // Without rates, seconds are work: both end at 50 s.
    assert_eq!(quote(1, 60, None).median_start_s, Some(50));
    // Waiting work drawn from the class runs at the rate of where it lands:
    // queued ahead for model B, it takes node 1 at 150 s for 200 s.
    let queued = [Arrival { at_s: 0, shape: TaskShape { models: vec![1], ..whole_node() }, tasks: 1, duration_s: 100, ahead: true, class: Some(0) }];
    let behind = chance(Now { fleet: &fleet, running: &running, queued: &queued, rates: Some(&rates) }, &on(1), &history, 400, 200, 5);
    assert_eq!(behind.median_start_s, Some(350));
}
