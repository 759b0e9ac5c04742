//! Tiers a job is bought as, in the engine: guaranteed work is never a
//! victim, opportunistic work is stopped without notice and owed nothing,
//! preemptible work under a bounded outage runs again ahead of new work,
//! and every broken promise is credited; an admission window (the third
//! promise to a waiting gang) holds back only work on its GPU model.

use berth_core::engine::{Deciders, SimConfig, World};
use berth_core::job::PriorityContract;
use berth_core::preemption::PreemptionPolicy;
use berth_core::{Broken, Decision, Engine, Event, Fleet, Job, Node, PolicyError, TaskShape, Tier};
use berth_sdk::{Allocations, Task};

mod common;

use common::FirstFit;

/// A hostile ranker: names every candidate it is shown, and counts them.
#[derive(Default)]
struct Everyone {
    shown: usize,
}

impl PreemptionPolicy for Everyone {
    fn describe(&self) -> String {
        "everyone".into()
    }
    fn rank(&mut self, _demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        self.shown += victims.len();
        Ok(Some((0..victims.len() as u32).collect()))
    }
}

const HIGH: u32 = 10;

fn job(id: u64, priority: u32, arrival_s: u64, duration_s: u64, contract: Option<PriorityContract>) -> Job {
    sized(id, 8, priority, arrival_s, duration_s, contract)
}

fn sized(id: u64, gpus: u32, priority: u32, arrival_s: u64, duration_s: u64, contract: Option<PriorityContract>) -> Job {
    let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000 * gpus, memory_mib: 1024, models: vec![] };
    Job { id, priority, arrival_s, duration_s, tasks: 1, shape, contract, reports_exit: true, ..Job::default() }
}

fn one_node() -> Fleet {
    Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 8, 64_000, 256_000)]).unwrap()
}

fn config() -> SimConfig {
    SimConfig { high_priority: HIGH, ..SimConfig::default() }
}

fn pass(engine: &mut Engine, fleet: &mut Fleet, ranker: &mut Everyone, now: u64, events: Vec<Event>) -> Vec<Decision> {
    let mut policy = FirstFit;
    let mut deciders = Deciders { placement: &mut policy, preemption: Some(ranker), compaction: None };
    let p = engine.handle(fleet, now, events, &mut deciders, &mut World { eligible: None, observer: None });
    assert!(p.error.is_none(), "{:?}", p.error);
    fleet.check_invariants().unwrap();
    p.decisions
}

fn placed(d: &[Decision], id: u64) -> bool {
    d.iter().any(|d| matches!(d, Decision::Place { job, .. } if *job == id))
}

#[test]
fn guaranteed_work_is_never_shown_to_a_ranker_nor_taken() {
    for tier in [Tier::Preemptible, Tier::Guaranteed] {
        let mut fleet = one_node();
        let mut engine = Engine::new(config());
        let mut ranker = Everyone::default();
        let low = engine.register(job(1, 0, 0, 86_400, Some(PriorityContract::default().of_tier(tier))));
        let high = engine.register(job(2, HIGH, 100, 3600, None));
        assert!(placed(&pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(low)]), 1));
        let d = pass(&mut engine, &mut fleet, &mut ranker, 100, vec![Event::Arrive(high)]);
        let evicted = d.iter().any(|d| matches!(d, Decision::Evict { job: 1, .. }));
        match tier {
            Tier::Guaranteed => {
                assert_eq!(ranker.shown, 0, "a guaranteed job is no candidate");
                assert!(!evicted && !placed(&d, 2), "{d:?}");
                assert!(engine.is_pending(high));
            }
            _ => assert!(evicted && placed(&d, 2), "{tier:?}: {d:?}"),
        }
    }
}

#[test]
fn opportunistic_work_is_stopped_at_once_and_owed_nothing_while_preemptible_work_is_credited() {
    let mut credits = Vec::new();
    for tier in [Tier::Opportunistic, Tier::Preemptible] {
        let mut fleet = one_node();
        let mut engine = Engine::new(config());
        let mut ranker = Everyone::default();
        let low = engine.register(job(1, 0, 0, 86_400, Some(PriorityContract::default().of_tier(tier))));
        let high = engine.register(job(2, HIGH, 7200, 3600, None));
        pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(low)]);
        let d = pass(&mut engine, &mut fleet, &mut ranker, 7200, vec![Event::Arrive(high)]);
        let Some(Decision::Evict { stop_by_s, lost_gpu_s, credit_gpu_h, broken, .. }) = d.iter().find(|d| matches!(d, Decision::Evict { .. })) else {
            panic!("{tier:?}: no eviction in {d:?}");
        };
        // Two hours since it started, no checkpoint: 16 GPU-h lost either way.
        assert_eq!(*lost_gpu_s, 8.0 * 7200.0, "{tier:?}");
        assert_eq!(*broken, None);
        match tier {
            Tier::Opportunistic => assert_eq!(*stop_by_s, 7200, "no notice, no grace"),
            _ => assert_eq!(*stop_by_s, 7200 + 60, "the default notice and grace"),
        }
        credits.push(*credit_gpu_h);
    }
    assert_eq!(credits, vec![0.0, 16.0], "opportunistic owed nothing; preemptible its lost GPU-hours");
}

/// Interrupted once a day at most, out of service 10 minutes at most: once
/// interrupted, it waits ahead of work that never ran (even work that came
/// first), runs again at its cap (no longer a victim), and a later stop by
/// the host or an outage past its bound is a broken promise, credited.
#[test]
fn a_bounded_outage_puts_interrupted_work_ahead_of_new_work_and_prices_broken_promises() {
    let bounded = PriorityContract { max_interruptions_per_day: 1, max_outage_s: 600, ..PriorityContract::default() };
    let mut fleet = one_node();
    let mut engine = Engine::new(config());
    let mut ranker = Everyone::default();
    let x = engine.register(sized(5, 4, 0, 0, 900, None));
    let first = engine.register(sized(3, 8, 0, 50, 86_400, Some(bounded)));
    let a = engine.register(sized(1, 4, 0, 100, 86_400, Some(bounded)));
    let h1 = engine.register(job(2, HIGH, 1000, 3600, None));
    // Job 3 (8 GPUs) waits behind job 5; job 1 (4 GPUs) fits beside it.
    pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(x)]);
    pass(&mut engine, &mut fleet, &mut ranker, 50, vec![Event::Arrive(first)]);
    assert!(placed(&pass(&mut engine, &mut fleet, &mut ranker, 100, vec![Event::Arrive(a)]), 1));
    assert!(!placed(&pass(&mut engine, &mut fleet, &mut ranker, 900, vec![Event::End(x)]), 3));
    let d = pass(&mut engine, &mut fleet, &mut ranker, 1000, vec![Event::Arrive(h1)]);
    assert!(d.iter().any(|d| matches!(d, Decision::Evict { job: 1, broken: None, .. })), "{d:?}");
    pass(&mut engine, &mut fleet, &mut ranker, 1010, vec![Event::Vacated(a)]);
    // The high job ends an hour later: job 1 runs again before job 3, which
    // came first but never ran (and at its cap, without a bound on the
    // outage, job 1 would sit out a day).
    let d = pass(&mut engine, &mut fleet, &mut ranker, 4610, vec![Event::End(h1)]);
    assert!(placed(&d, 1) && !placed(&d, 3), "{d:?}");
    // Out of service from 1010 to 4610: an hour against ten minutes.
    let outage = d.iter().find_map(|d| match d {
        Decision::Broken { job: 1, promise: Broken::Outage { out_s }, credit_gpu_h, .. } => Some((*out_s, *credit_gpu_h)),
        _ => None,
    });
    assert_eq!(outage, Some((3600, 4.0)), "the floor: one GPU-hour per GPU; {d:?}");
    // At its cap it is no victim: a second high job waits.
    let h2 = engine.register(job(4, HIGH, 5000, 3600, None));
    let d = pass(&mut engine, &mut fleet, &mut ranker, 5000, vec![Event::Arrive(h2)]);
    assert!(!d.iter().any(|d| matches!(d, Decision::Evict { .. })), "{d:?}");
    // Its node is lost: stopped past its cap, a broken promise priced at
    // three times the work lost (400 s x 4 GPUs) or the floor, the larger.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 5010, vec![Event::Requeue(a)]);
    let past_cap = d.iter().find_map(|d| match d {
        Decision::Broken { job: 1, promise: Broken::PastCap, lost_gpu_s, credit_gpu_h, .. } => Some((*lost_gpu_s, *credit_gpu_h)),
        _ => None,
    });
    assert_eq!(past_cap, Some((4.0 * 400.0, 4.0)), "{d:?}");
}

#[test]
fn a_guaranteed_job_stopped_by_the_host_is_a_broken_promise() {
    let mut fleet = one_node();
    let mut engine = Engine::new(config());
    let mut ranker = Everyone::default();
    let g = engine.register(job(1, 0, 0, 86_400, Some(PriorityContract::default().of_tier(Tier::Guaranteed))));
    pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(g)]);
    // Ten hours in, no checkpoint: 80 GPU-h lost, paid three times over.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 36_000, vec![Event::Requeue(g)]);
    let broken = d.iter().find_map(|d| match d {
        Decision::Broken { job: 1, promise, credit_gpu_h, .. } => Some((*promise, *credit_gpu_h)),
        _ => None,
    });
    assert_eq!(broken, Some((Broken::GuaranteedStopped, 240.0)), "{d:?}");
}

/// A placed job whose start never happened (its start not stored, a host
/// restart first) is no interruption: nothing is broken by it, and an
/// outage it was in goes on from where it started.
#[test]
fn a_start_that_never_happened_is_no_interruption_and_its_outage_goes_on() {
    let bounded = PriorityContract { max_outage_s: 600, ..PriorityContract::default() };
    let mut fleet = one_node();
    let mut engine = Engine::new(config());
    let mut ranker = Everyone::default();
    let a = engine.register(job(1, 0, 0, 86_400, Some(bounded)));
    let g = engine.register(job(5, 0, 0, 86_400, Some(PriorityContract::default().of_tier(Tier::Guaranteed))));
    let h1 = engine.register(job(2, HIGH, 1000, 300, None));
    let h2 = engine.register(job(3, HIGH, 1300, 1000, None));
    pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(a)]);
    pass(&mut engine, &mut fleet, &mut ranker, 1000, vec![Event::Arrive(h1)]);
    pass(&mut engine, &mut fleet, &mut ranker, 1010, vec![Event::Vacated(a)]);
    // Placed again 290 s after it vacated: within its bound.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 1300, vec![Event::End(h1)]);
    assert!(placed(&d, 1) && !d.iter().any(|d| matches!(d, Decision::Broken { .. })), "{d:?}");
    // Its start never happens; a high job takes the node first.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 1300, vec![Event::Unstarted(a), Event::Arrive(h2)]);
    assert!(placed(&d, 3) && !d.iter().any(|d| matches!(d, Decision::Broken { .. } | Decision::Evict { .. })), "{d:?}");
    // Running again 1,290 s after it vacated, not 1,000 s after the start
    // that never happened: a broken outage promise.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 2300, vec![Event::End(h2)]);
    let out = d.iter().find_map(|d| match d {
        Decision::Broken { job: 1, promise: Broken::Outage { out_s }, .. } => Some(*out_s),
        _ => None,
    });
    assert_eq!(out, Some(1290), "{d:?}");
    // A guaranteed job's start that never happened breaks nothing.
    let d = pass(&mut engine, &mut fleet, &mut ranker, 90_000, vec![Event::End(a), Event::Arrive(g)]);
    assert!(placed(&d, 5), "{d:?}");
    let d = pass(&mut engine, &mut fleet, &mut ranker, 90_000, vec![Event::Unstarted(g)]);
    assert!(!d.iter().any(|d| matches!(d, Decision::Broken { .. })), "{d:?}");
}

/// An admission window holds back smaller work that would take the waiting
/// job's capacity (its GPU model), not work on other models; `explain`'s
/// source names the job it waits behind.
#[test]
fn an_admission_window_holds_back_only_work_on_the_waiting_jobs_model() {
    use berth_core::engine::{AdmissionWindow, Guards, StarvationGuard};
    let nodes = vec![Node::new("a0", Some(0), 8, 64_000, 256_000), Node::new("b0", Some(1), 8, 64_000, 256_000)];
    let mut fleet = Fleet::new(vec!["A".into(), "B".into()], nodes).unwrap();
    let guard = StarvationGuard { reserve_after_s: u64::MAX, aging_per_hour: 0.0, window: Some(AdmissionWindow { window_s: 3600, small_gpu_h: 0.0 }) };
    let mut engine = Engine::new(SimConfig { guards: Guards::everywhere(Some(guard)), ..config() });
    let mut ranker = Everyone::default();
    let on = |id: u64, gpus: u32, model: u32| {
        let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![model] };
        Job { id, arrival_s: 0, duration_s: 86_400, tasks: 1, shape, ..Job::default() }
    };
    let x = engine.register(on(1, 1, 0));
    let gang = engine.register(on(2, 8, 0));
    let same = engine.register(on(3, 1, 0));
    let other = engine.register(on(4, 1, 1));
    pass(&mut engine, &mut fleet, &mut ranker, 0, vec![Event::Arrive(x)]);
    let d = pass(&mut engine, &mut fleet, &mut ranker, 10, vec![Event::Arrive(gang), Event::Arrive(same), Event::Arrive(other)]);
    assert!(!placed(&d, 2) && !placed(&d, 3) && placed(&d, 4), "{d:?}");
    assert_eq!(engine.held_by_window(same), Some((2, 3600)), "held behind job 2 until the window ends");
    assert_eq!(engine.held_by_window(other), None);
}
