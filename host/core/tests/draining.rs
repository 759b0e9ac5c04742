//! One owner per GPU in the engine: a GPU leaves a job that reports its
//! exit only when that exit is reported. Evicted work keeps what its
//! preemptor did not take, and a preemptor (or a waking replica) that ends
//! before its victims are gone leaves its GPUs draining, not free.

use berth_core::engine::{Deciders, SimConfig, World};
use berth_core::preemption::PreemptionPolicy;
use berth_core::{Decision, Engine, Event, Fleet, Job, Node, PolicyError, TaskShape};
use berth_sdk::{Allocations, Task};

mod common;

use common::FirstFit;

/// Takes victims in the order offered.
struct InOrder;

impl PreemptionPolicy for InOrder {
    fn describe(&self) -> String {
        "in-order".into()
    }
    fn rank(&mut self, _demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        Ok(Some((0..victims.len() as u32).collect()))
    }
}

const HIGH: u32 = 5;

/// A job of one task whose processes report their exit (a live job).
fn job(id: u64, gpus: u32, priority: u32) -> Job {
    let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![] };
    Job { id, priority, arrival_s: 0, duration_s: 1000, tasks: 1, shape, reports_exit: true, ..Job::default() }
}

fn setup(gpus: usize) -> (Fleet, Engine) {
    let fleet = Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), gpus, 64_000, 256_000)]).unwrap();
    (fleet, Engine::new(SimConfig { high_priority: HIGH, ..SimConfig::default() }))
}

fn pass(engine: &mut Engine, fleet: &mut Fleet, now: u64, events: Vec<Event>) -> Vec<Decision> {
    let (mut policy, mut ranker) = (FirstFit, InOrder);
    let mut deciders = Deciders { placement: &mut policy, preemption: Some(&mut ranker), compaction: None };
    let p = engine.handle(fleet, now, events, &mut deciders, &mut World { eligible: None, observer: None });
    assert!(p.error.is_none());
    fleet.check_invariants().unwrap();
    p.decisions
}

fn placed(d: &[Decision], job: u64) -> bool {
    d.iter().any(|d| matches!(d, Decision::Place { job: j, .. } if *j == job))
}

fn free_gpus(fleet: &Fleet) -> u64 {
    fleet.nodes()[0].gpu_free_milli() / 1000
}

/// Low job L holds all 8 GPUs; high job H, for 4, preempts it. L's
/// process runs until its exit is reported: the 4 GPUs H did not take are
/// not free meanwhile; cancelling H during L's notice frees nothing; a new
/// job starts only once L is gone.
#[test]
fn a_cancelled_preemptor_leaves_its_victims_gpus_draining_until_they_are_gone() {
    let (mut fleet, mut engine) = setup(8);
    let low = engine.register(job(1, 8, 0));
    assert!(placed(&pass(&mut engine, &mut fleet, 0, vec![Event::Arrive(low)]), 1));
    let high = engine.register(job(2, 4, HIGH));
    let d = pass(&mut engine, &mut fleet, 10, vec![Event::Arrive(high)]);
    assert!(d.iter().any(|d| matches!(d, Decision::Evict { job: 1, for_job: 2, .. })), "{d:?}");
    assert!(placed(&d, 2), "{d:?}");
    // L still runs on all 8: H's 4 and the 4 draining for L.
    assert_eq!(free_gpus(&fleet), 0);
    assert_eq!(engine.drains().iter().map(|d| d.alloc.gpus.count_ones()).sum::<u32>(), 4, "{:?}", engine.drains());

    // Another job for the 4 H did not take waits.
    let small = engine.register(job(3, 4, 0));
    assert!(!placed(&pass(&mut engine, &mut fleet, 11, vec![Event::Arrive(small)]), 3));

    // H is cancelled during L's notice: its GPUs drain for L too.
    let d = pass(&mut engine, &mut fleet, 12, vec![Event::Cancel(high)]);
    assert!(!placed(&d, 3), "{d:?}");
    assert_eq!(free_gpus(&fleet), 0);
    let big = engine.register(job(4, 8, 0));
    assert!(!placed(&pass(&mut engine, &mut fleet, 13, vec![Event::Arrive(big)]), 4));

    // L's exit is reported: all 8 are free, and they are given out again.
    let d = pass(&mut engine, &mut fleet, 14, vec![Event::Vacated(low)]);
    assert!(engine.drains().is_empty(), "{:?}", engine.drains());
    assert!(!d.is_empty(), "the freed GPUs are given out: {d:?}");
    fleet.check_invariants().unwrap();
}

/// A preemptor's time limit (its end) before its victims are gone: the
/// same draining.
#[test]
fn a_preemptor_that_ends_before_its_victims_are_gone_frees_nothing_yet() {
    let (mut fleet, mut engine) = setup(8);
    let low = engine.register(job(1, 8, 0));
    pass(&mut engine, &mut fleet, 0, vec![Event::Arrive(low)]);
    let high = engine.register(job(2, 8, HIGH));
    assert!(placed(&pass(&mut engine, &mut fleet, 10, vec![Event::Arrive(high)]), 2));
    pass(&mut engine, &mut fleet, 20, vec![Event::End(high)]);
    assert_eq!(free_gpus(&fleet), 0, "L still runs on them");
    pass(&mut engine, &mut fleet, 30, vec![Event::Vacated(low)]);
    assert!(engine.drains().is_empty());
    // L, queued again, takes them back.
    assert_eq!(engine.held(low).len(), 1);
}

/// A waking replica that ends (cancelled) before the borrowers evicted for
/// it are gone leaves their GPUs draining.
#[test]
fn a_cancelled_wake_leaves_the_borrowers_gpus_draining() {
    let (mut fleet, mut engine) = setup(4);
    let replica = engine.register(job(1, 4, HIGH));
    assert!(placed(&pass(&mut engine, &mut fleet, 0, vec![Event::Arrive(replica)]), 1));
    let borrower = engine.register(job(2, 4, 0));
    let d = pass(&mut engine, &mut fleet, 1, vec![Event::SleepJob(replica), Event::Arrive(borrower)]);
    assert!(placed(&d, 2), "the borrower runs on lent GPUs: {d:?}");
    engine.apply(&mut fleet, 2, Event::WakeJob(replica));
    let d = engine.take_announced();
    assert!(d.iter().any(|d| matches!(d, Decision::Evict { job: 2, wake: true, .. })), "{d:?}");
    // The replica is cancelled; its (sleeping) processes' exit ends it.
    pass(&mut engine, &mut fleet, 3, vec![Event::End(replica)]);
    assert_eq!(free_gpus(&fleet), 0, "the borrower still runs on them");
    let other = engine.register(job(3, 4, 0));
    assert!(!placed(&pass(&mut engine, &mut fleet, 4, vec![Event::Arrive(other)]), 3));
    let d = pass(&mut engine, &mut fleet, 5, vec![Event::Vacated(borrower)]);
    assert!(engine.drains().is_empty());
    assert!(placed(&d, 2) || placed(&d, 3), "{d:?}");
}

/// A host restarted while an evicted job's processes still run: what its
/// preemptor does not hold drains for it.
#[test]
fn a_restored_evicting_job_drains_what_nobody_holds() {
    let (mut fleet, mut engine) = setup(8);
    let high = engine.register(job(2, 4, HIGH));
    let held = berth_core::Allocation { node: 0, gpus: 0b1111, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
    engine.restore_running(&mut fleet, high, vec![held], 0).unwrap();
    let low = engine.register(job(1, 8, 0));
    let all = berth_core::Allocation { node: 0, gpus: 0xff, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
    engine.restore_evicting(&mut fleet, low, &[all]);
    engine.restore_awaiting(high, [low]);
    assert_eq!(free_gpus(&fleet), 0);
    pass(&mut engine, &mut fleet, 1, vec![Event::Cancel(high)]);
    assert_eq!(free_gpus(&fleet), 0, "H's GPUs drain for L after the restart too");
    pass(&mut engine, &mut fleet, 2, vec![Event::Vacated(low)]);
    assert!(engine.drains().is_empty());
    fleet.check_invariants().unwrap();
}
