//! Trace replay's world around the engine: jobs arrive at their times, run
//! for their durations and leave, evicted jobs vacate on the modelled
//! latency, harvest and compaction tick on their schedules, all in
//! simulated time. Every decision is the [`crate::engine::Engine`]'s; this
//! module only turns the trace into events and the clock into a sequence of
//! event times, deterministically.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub use crate::capacity::{domain_table, domain_table_among, fitting_tasks, fitting_tasks_among, tasks_on_node};
use crate::engine::{Decision, Engine, Event, Input, World};
pub use crate::engine::{Deciders, Guards, JobOutcome, SimConfig, SimOutcome, Interference, StarvationGuard, Utilisation, WorkRates};
use crate::fleet::Fleet;
pub use crate::job::Job;
pub use crate::placement::place_gang;
use crate::policy::{PlacementPolicy, PolicyError};

/// Runs `jobs` (any order) on `fleet` with `policy` until the horizon.
/// Each scheduling pass walks the queue in (priority desc, arrival) order and
/// starts every job that fits; a shape that did not fit is not retried in the
/// same pass. No preemption: see [`simulate_with`].
pub fn simulate(fleet: &mut Fleet, jobs: &[Job], policy: &mut dyn PlacementPolicy, config: SimConfig) -> Result<SimOutcome, PolicyError> {
    simulate_with(fleet, jobs, Deciders { placement: policy, preemption: None, compaction: None }, config)
}

/// [`simulate`] where a high-priority job that cannot be placed may take
/// capacity back from low-priority work, victims ranked by the preemption
/// policy (see [`crate::preemption`]), and where compaction runs
/// periodically (see [`crate::compaction`]). An evicted job goes back to
/// the queue once it has vacated and resumes from what it kept.
///
/// Timing model: the capacity changes hands at the decision; the demand's
/// work starts when its slowest victim has vacated (notice, then the
/// eviction latency, capped by notice + grace).
pub fn simulate_with(fleet: &mut Fleet, jobs: &[Job], deciders: Deciders, config: SimConfig) -> Result<SimOutcome, PolicyError> {
    simulate_recorded(fleet, jobs, deciders, config, None)
}

/// [`simulate_with`], also recording every decision with its time (job
/// slots are the indexes of `jobs`).
pub fn simulate_recorded(fleet: &mut Fleet, jobs: &[Job], deciders: Deciders, config: SimConfig, log: Option<&mut Vec<(u64, Decision)>>) -> Result<SimOutcome, PolicyError> {
    simulate_watched(fleet, jobs, deciders, config, log, &mut |_, _, _| {})
}

/// [`simulate_recorded`], showing `watch` the engine and the fleet at every
/// event time before the engine handles that time's events: quotes issued
/// then see what a caller would have seen.
pub fn simulate_watched(
    fleet: &mut Fleet,
    jobs: &[Job],
    deciders: Deciders,
    config: SimConfig,
    log: Option<&mut Vec<(u64, Decision)>>,
    watch: &mut dyn FnMut(u64, &Engine, &Fleet),
) -> Result<SimOutcome, PolicyError> {
    run(fleet, jobs, deciders, config, log, watch, None).map(|(out, _)| out)
}

/// [`simulate_with`] with the engine capturing its inputs (see
/// [`crate::capture`]): what a live host given this trace would have
/// recorded. `notes` (the policy versions asked, as
/// [`crate::capture::Input::Arms`]) follow the registrations, before the
/// first pass.
pub fn simulate_captured(fleet: &mut Fleet, jobs: &[Job], deciders: Deciders, config: SimConfig, notes: Vec<Input>) -> Result<(SimOutcome, Vec<Input>), PolicyError> {
    run(fleet, jobs, deciders, config, None, &mut |_, _, _| {}, Some(notes))
}

fn run(
    fleet: &mut Fleet,
    jobs: &[Job],
    mut deciders: Deciders,
    config: SimConfig,
    mut log: Option<&mut Vec<(u64, Decision)>>,
    watch: &mut dyn FnMut(u64, &Engine, &Fleet),
    capture_notes: Option<Vec<Input>>,
) -> Result<(SimOutcome, Vec<Input>), PolicyError> {
    let horizon_s = config.horizon_s;
    let harvest = config.harvest;
    let mut engine = Engine::new(config);
    let capturing = capture_notes.is_some();
    if capturing {
        engine.start_capture(fleet);
    }
    for job in jobs {
        engine.register(job.clone());
    }
    for note in capture_notes.into_iter().flatten() {
        engine.capture_note(note);
    }
    let period_s = deciders.compaction.as_ref().map(|(_, c)| c.period_s.max(1));
    let mut next_compaction = period_s;
    let mut arrivals: Vec<usize> = (0..jobs.len()).collect();
    arrivals.sort_by_key(|&i| (jobs[i].arrival_s, jobs[i].id));
    let mut next_arrival = 0;
    // (planned end, job); an entry whose end is not the job's planned end is
    // stale (the job was evicted) and skipped.
    let mut running: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut next_harvest = harvest.map(|h| h.next_boundary(None));
    let mut now = 0u64;
    loop {
        // The next event: an arrival, a departure or an evicted job ready
        // again, whichever is first.
        while running.peek().is_some_and(|&Reverse((end, j))| engine.planned_end(j) != Some(end)) {
            running.pop();
        }
        let t_arrival = arrivals.get(next_arrival).map(|&i| jobs[i].arrival_s);
        let t_departure = running.peek().map(|Reverse((t, _))| *t);
        let t_wakeup = engine.next_wakeup();
        let t_harvest = next_harvest.map(|(t, _)| t);
        // Compaction ticks only while something runs or waits.
        let busy = t_arrival.is_some() || t_departure.is_some() || t_wakeup.is_some();
        let t_compaction = next_compaction.filter(|_| busy);
        let Some(t) = [t_arrival, t_departure, t_wakeup, t_harvest, t_compaction].into_iter().flatten().min() else { break };
        let t = t.min(horizon_s);
        engine.integrate(fleet, (t - now) as f64);
        now = t;
        if now >= horizon_s {
            break;
        }
        let mut events = Vec::new();
        while let Some(&Reverse((end, j))) = running.peek() {
            if end > now {
                break;
            }
            running.pop();
            if engine.planned_end(j) == Some(end) {
                events.push(Event::End(j));
            }
        }
        if let (Some(h), Some((t, wake))) = (harvest, next_harvest)
            && t == now
        {
            events.push(if wake { Event::Wake } else { Event::Sleep });
            next_harvest = Some(h.next_boundary(Some(now)));
        }
        while let Some(&i) = arrivals.get(next_arrival) {
            if jobs[i].arrival_s > now {
                break;
            }
            events.push(Event::Arrive(i));
            next_arrival += 1;
        }
        if let (Some(period), Some(t)) = (period_s, next_compaction)
            && t == now
        {
            events.push(Event::Compact);
            next_compaction = Some(now + period);
        }
        watch(now, &engine, fleet);
        let pass = engine.handle(fleet, now, events, &mut deciders, &mut World::default());
        for d in &pass.decisions {
            if let Decision::Place { slot, .. } = d {
                let end = engine.planned_end(*slot).expect("a job just placed runs");
                running.push(Reverse((end, *slot)));
            }
        }
        if let Some(log) = log.as_deref_mut() {
            log.extend(pass.decisions.into_iter().map(|d| (now, d)));
        }
        if let Some((_, _, e)) = pass.error {
            return Err(e);
        }
    }
    let captured = if capturing { engine.take_captured() } else { Vec::new() };
    Ok((engine.finish(now), captured))
}
