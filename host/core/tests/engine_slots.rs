//! The live host's engine forgets ended jobs: the table holds only work that
//! may still run, a reused slot starts clean, and nothing busy is forgotten.

use berth_core::engine::{Deciders, SimConfig, World};
use berth_core::{Decision, Engine, Event, Fleet, Job, Node, TaskShape};

mod common;

use common::FirstFit;

fn job(id: u64, gpus: u32) -> Job {
    let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![] };
    Job { id, arrival_s: 0, duration_s: 100, tasks: 1, shape, ..Job::default() }
}

fn pass(engine: &mut Engine, fleet: &mut Fleet, now: u64, events: Vec<Event>) -> Vec<Decision> {
    let mut policy = FirstFit;
    let mut deciders = Deciders { placement: &mut policy, preemption: None, compaction: None };
    let p = engine.handle(fleet, now, events, &mut deciders, &mut World { eligible: None, observer: None });
    assert!(p.error.is_none());
    p.decisions
}

#[test]
fn ended_jobs_are_forgotten_and_their_slots_reused_clean() {
    let mut fleet = Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 8, 64_000, 256_000)]).unwrap();
    let mut engine = Engine::new(SimConfig::default());
    // Three jobs of 4 GPUs on one 8-GPU node: two run, one waits.
    let slots: Vec<usize> = (1..=3).map(|id| engine.register(job(id, 4))).collect();
    let placed = pass(&mut engine, &mut fleet, 10, slots.iter().map(|&s| Event::Arrive(s)).collect());
    assert_eq!(placed.iter().filter(|d| matches!(d, Decision::Place { .. })).count(), 2);
    // Running and pending jobs are never forgotten.
    for &s in &slots {
        assert!(!engine.forget(s), "slot {s} is busy");
    }
    // Job 1 ends: forgotten once, the waiting job 3 starts.
    let placed = pass(&mut engine, &mut fleet, 20, vec![Event::End(slots[0])]);
    assert!(placed.iter().any(|d| matches!(d, Decision::Place { job: 3, .. })), "{placed:?}");
    assert!(engine.forget(slots[0]));
    assert!(!engine.forget(slots[0]), "forgotten twice");
    assert_eq!(engine.slots_in_use(), 2);
    // A new job takes the slot, clean: nothing held, not running, and it
    // is placed like a fresh job once there is room.
    let reused = engine.register(job(4, 8));
    assert_eq!(reused, slots[0]);
    assert_eq!(engine.job(reused).id, 4);
    assert!(engine.held(reused).is_empty() && engine.planned_end(reused).is_none());
    let none = pass(&mut engine, &mut fleet, 30, vec![Event::Arrive(reused)]);
    assert!(none.iter().all(|d| !matches!(d, Decision::Place { job: 4, .. })), "no room yet: {none:?}");
    let placed = pass(&mut engine, &mut fleet, 40, vec![Event::End(slots[1]), Event::End(slots[2])]);
    assert!(placed.iter().any(|d| matches!(d, Decision::Place { job: 4, .. })), "{placed:?}");
    // 1,000 more short jobs through the same engine: the table stays small.
    let mut now = 200;
    let _ = pass(&mut engine, &mut fleet, now, vec![Event::End(reused)]);
    assert!(engine.forget(reused) && engine.forget(slots[1]) && engine.forget(slots[2]));
    for id in 100..1100 {
        let s = engine.register(job(id, 8));
        now += 1;
        let placed = pass(&mut engine, &mut fleet, now, vec![Event::Arrive(s)]);
        assert!(placed.iter().any(|d| matches!(d, Decision::Place { .. })));
        now += 1;
        let _ = pass(&mut engine, &mut fleet, now, vec![Event::End(s)]);
        assert!(engine.forget(s));
    }
    assert!(engine.slots_in_use() == 0, "{}", engine.slots_in_use());
    fleet.check_invariants().unwrap();
}

/// Per-job harvesting, as the live host drives it: a sleeping job lends its
/// GPUs to low-priority work only; its wake evicts the borrower (announced
/// as decisions) and gives it its GPUs back; a sleeping job that ends
/// leaves the borrower where it is.
#[test]
fn a_sleeping_job_lends_its_gpus_to_low_priority_work_until_it_wakes() {
    let mut fleet = Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 4, 64_000, 256_000)]).unwrap();
    let mut engine = Engine::new(SimConfig { high_priority: 5, ..SimConfig::default() });
    let high = |id, gpus| Job { priority: 5, ..job(id, gpus) };
    let replica = engine.register(high(1, 4));
    let placed = pass(&mut engine, &mut fleet, 0, vec![Event::Arrive(replica)]);
    assert!(matches!(placed[..], [Decision::Place { job: 1, .. }]), "{placed:?}");
    assert_eq!(engine.reclaimable_milli(&fleet), vec![0], "high-priority work is not reclaimable");
    let (borrower, other_high) = (engine.register(job(2, 2)), engine.register(high(3, 1)));
    assert!(pass(&mut engine, &mut fleet, 1, vec![Event::Arrive(borrower), Event::Arrive(other_high)]).is_empty());

    // Asleep: its 4 GPUs are lent; the low-priority job runs on them, the
    // high-priority one may not.
    let d = pass(&mut engine, &mut fleet, 2, vec![Event::SleepJob(replica)]);
    assert!(matches!(d[0], Decision::Sleep { job: 1, gpus: 4, .. }), "{d:?}");
    assert!(d.iter().any(|d| matches!(d, Decision::Place { job: 2, .. })), "{d:?}");
    assert!(!d.iter().any(|d| matches!(d, Decision::Place { job: 3, .. })), "{d:?}");
    assert!(engine.is_sleeping(replica) && !engine.can_sleep(replica));
    assert_eq!(engine.lent().get(&0), Some(&0b1111));
    // Reclaimable: the borrower's 2 GPUs (preemptible) and the 2 lent idle,
    // each counted once.
    assert_eq!(engine.reclaimable_milli(&fleet), vec![4_000]);
    // A borrower has nothing of its own to lend.
    assert!(!engine.can_sleep(borrower));
    fleet.check_invariants().unwrap();

    // Awake: the borrower is evicted for it, not ranked; the replica holds
    // its GPUs again and nothing is lent.
    engine.apply(&mut fleet, 3, Event::WakeJob(replica));
    let d = engine.take_announced();
    assert!(matches!(&d[..], [Decision::Evict { job: 2, for_job: 1, wake: true, .. }, Decision::Wake { job: 1, victims, requeued: false, .. }] if victims == &vec![2]), "{d:?}");
    assert!(!engine.is_sleeping(replica) && engine.lent().is_empty());
    assert_eq!(fleet.nodes()[0].gpu_free_milli(), 0);
    assert_eq!(engine.reclaimable_milli(&fleet), vec![0]);
    assert!(engine.is_pending(borrower));
    fleet.check_invariants().unwrap();

    // Asleep again with the borrower back on its GPUs, then it ends: the
    // borrower keeps running, and nothing is lent any more.
    let d = pass(&mut engine, &mut fleet, 4, vec![Event::SleepJob(replica)]);
    assert!(d.iter().any(|d| matches!(d, Decision::Place { job: 2, .. })), "{d:?}");
    let _ = pass(&mut engine, &mut fleet, 5, vec![Event::End(replica)]);
    assert!(engine.lent().is_empty() && engine.planned_end(borrower).is_some());
    assert!(engine.forget(replica));
    fleet.check_invariants().unwrap();
}

/// Shape classes are interned per distinct (partition, tasks, shape); a
/// tenant choosing a new CPU figure for every job must not grow the table
/// past the jobs held. A recycled class forgets what was known of its old
/// shape (a gang that did not fit before may fit as the new shape).
#[test]
fn shape_classes_of_forgotten_jobs_are_recycled() {
    let mut fleet = Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 8, 64_000, 256_000)]).unwrap();
    let mut engine = Engine::new(SimConfig::default());
    let mut now = 0;
    for id in 1..=2000u64 {
        let mut j = job(id, 1);
        j.shape.cpu_milli = 100 + id as u32; // a new shape every time
        let s = engine.register(j);
        now += 1;
        let placed = pass(&mut engine, &mut fleet, now, vec![Event::Arrive(s)]);
        assert!(placed.iter().any(|d| matches!(d, Decision::Place { .. })), "job {id}: {placed:?}");
        now += 1;
        let _ = pass(&mut engine, &mut fleet, now, vec![Event::End(s)]);
        assert!(engine.forget(s));
        assert!(engine.classes_in_use() <= 1, "job {id}: {} classes in use", engine.classes_in_use());
    }
    // Two jobs of one shape share a class; it stays while either is held.
    let a = engine.register(job(5000, 2));
    let b = engine.register(job(5001, 2));
    assert_eq!(engine.classes_in_use(), 1);
    let _ = pass(&mut engine, &mut fleet, now + 1, vec![Event::Arrive(a), Event::Arrive(b)]);
    let _ = pass(&mut engine, &mut fleet, now + 2, vec![Event::End(a)]);
    assert!(engine.forget(a));
    assert_eq!(engine.classes_in_use(), 1, "job 5001 still holds the class");
    // A two-task gang that cannot fit (the node has 8 GPUs, each task wants
    // 8, one GPU pair is held): its class learns a bound; once forgotten and
    // recycled for a shape that fits, the new job is placed.
    let mut big = job(6000, 8);
    big.tasks = 2;
    let g = engine.register(big);
    let none = pass(&mut engine, &mut fleet, now + 3, vec![Event::Arrive(g)]);
    assert!(none.iter().all(|d| !matches!(d, Decision::Place { job: 6000, .. })));
    let _ = pass(&mut engine, &mut fleet, now + 4, vec![Event::Cancel(g)]);
    assert!(engine.forget(g));
    let small = engine.register(job(6001, 1));
    let placed = pass(&mut engine, &mut fleet, now + 5, vec![Event::Arrive(small)]);
    assert!(placed.iter().any(|d| matches!(d, Decision::Place { job: 6001, .. })), "{placed:?}");
    fleet.check_invariants().unwrap();
}

/// Replay's work model: a run on a slower model, or a gang across switch
/// domains, holds its GPUs longer for the same work; the outcome counts the
/// work done and kept, also of work still running at the end.
#[test]
fn placement_sets_how_fast_work_advances_and_the_outcome_counts_it() {
    use berth_core::sim::{simulate, WorkRates};
    // Model A (speed 1) on node 0, model B (speed 0.5) on node 1; nodes 2
    // and 3 (model A) in different switch domains.
    let mut nodes: Vec<Node> = (0..4).map(|i| Node::new(format!("n{i}"), Some(if i == 1 { 1 } else { 0 }), 4, 64_000, 256_000)).collect();
    nodes[2].switch_domain = 1;
    nodes[3].switch_domain = 2;
    let mut fleet = Fleet::new(vec!["A".into(), "B".into()], nodes).unwrap();
    let on = |id, model, tasks, gpus| {
        let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![model] };
        Job { id, arrival_s: 0, duration_s: 1000, tasks, shape, ..Job::default() }
    };
    // A whole-node job on A (node 0), one on B (node 1), a gang of two
    // whole nodes of A: only nodes 2 and 3 are left, in two domains. A
    // fourth job arrives late and is still running at the horizon.
    let late = Job { arrival_s: 4_500, ..on(4, 0, 1, 4) };
    let jobs = vec![on(1, 0, 1, 4), on(2, 1, 1, 4), on(3, 0, 2, 4), late];
    let work = WorkRates { model_speed: vec![1.0, 0.5], cross_domain_slowdown: 1.25 };
    let config = SimConfig { horizon_s: 5_000, work: Some(work), ..SimConfig::default() };
    let out = simulate(&mut fleet, &jobs, &mut FirstFit, config).unwrap();
    let ran = |j: usize| out.jobs[j].end_s.unwrap() - out.jobs[j].start_s.unwrap();
    assert_eq!(ran(0), 1000, "reference speed, one domain");
    assert_eq!(ran(1), 2000, "half speed: twice as long");
    assert_eq!(out.jobs[2].domains, 2);
    assert_eq!(ran(2), 1250, "across two domains: 1.25 times as long");
    // Ended jobs did all their work; the late one 500 of its 1000 s.
    let gpu_s: Vec<f64> = out.jobs.iter().map(|o| o.work_gpu_s).collect();
    assert_eq!(gpu_s, vec![4_000.0, 4_000.0, 8_000.0, 2_000.0]);
    // Without the model every run takes its duration.
    let mut fleet2 = fleet.clone();
    for a in out.running_at_end.iter().flat_map(|(_, _, a)| a) {
        fleet2.release(a).unwrap();
    }
    let plain = simulate(&mut fleet2, &jobs, &mut FirstFit, SimConfig { horizon_s: 5_000, ..SimConfig::default() }).unwrap();
    assert!(plain.jobs[..3].iter().all(|o| o.end_s.unwrap() - o.start_s.unwrap() == 1000));
}
