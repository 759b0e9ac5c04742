//! Availability quotes on the live fleet: the core's quote (the same one
//! replay reports use) over a partition's nodes of one kind (simulated, or
//! agent nodes for jobs with a command), with running work ending on its
//! planned time (a job's duration or time limit; work without one is never
//! counted as ending). With a deadline, also the chance that one copy
//! starts by then ([`berth_core::forecast`]): the fleet run forward many
//! times from the partition's state and history, on every core, within a
//! time budget.


use std::collections::BTreeMap;

use berth_core::accounting::{self, PendingShape, Quote};
use berth_core::forecast::{work_of, Arrival, History, Running};
use berth_core::job::PriorityContract;
use berth_core::sim::WorkRates;
use berth_core::{Allocation, Tier};

use crate::proto as pb;

use super::state::{JobRecord, JobState, PartitionState};

/// What a running job holds now: nothing asleep (its GPUs are lent), and
/// none of the tasks seen to end; `None` when it is not running.
fn held_now(j: &JobRecord) -> Option<Vec<Allocation>> {
    if j.state != JobState::Running || j.sleep == super::state::SleepState::Asleep {
        return None;
    }
    Some(if j.runs.is_empty() {
        j.allocations.clone()
    } else {
        j.allocations.iter().zip(&j.runs).filter(|(_, r)| r.holds).map(|(a, _)| a.clone()).collect()
    })
}

impl PartitionState {
    /// This partition's nodes as a job of one kind sees them (agent nodes
    /// for jobs with a command): those of the other kind are not
    /// schedulable in this copy (the predicate then skips them).
    pub fn fleet_of_kind(&self, agent_nodes: bool) -> berth_core::Fleet {
        let mut fleet = self.fleet.clone();
        for (i, node) in self.fleet.nodes().iter().enumerate() {
            if self.agent(i as u32) != agent_nodes && node.schedulable {
                fleet.set_schedulable(i as u32, false).expect("a node of this fleet");
            }
        }
        fleet
    }

    /// Quotes `request` on `fleet` (from [`Self::fleet_of_kind`]), with an
    /// optional start deadline in seconds from now.
    pub fn quote(&self, fleet: &berth_core::Fleet, request: &PendingShape, deadline_s: Option<u64>) -> Quote {
        let now = self.clock.now();
        let running: Vec<(u64, Vec<Allocation>)> = self
            .jobs
            .values()
            .filter_map(|j| Some((j.ends_at?.saturating_duration_since(now).as_secs_f64().ceil() as u64, held_now(j)?)))
            .collect();
        accounting::quote(fleet, request, &running, 0, deadline_s)
    }

    /// One offer per tier of `tiers` for `request` at `priority` on `fleet`
    /// (from [`Self::fleet_of_kind`]): when a copy could start under it and
    /// the contract it would run under, from the partition's `contract` for
    /// preemptible work. Guaranteed and high-priority work never use GPUs
    /// lent by sleeping replicas (the engine keeps them off); a high
    /// priority may also start by taking back the work the engine would
    /// offer its ranker (the partition's rank policy, or the default
    /// ranking without one).
    pub fn offers(&self, fleet: &berth_core::Fleet, request: &PendingShape, priority: u32, tiers: &[Tier], contract: &PriorityContract) -> Vec<pb::TierOffer> {
        let high = priority >= self.engine.config.high_priority;
        let mut tiers = tiers.to_vec();
        tiers.sort();
        tiers.dedup();
        // Two views at most, each quoted once where a tier uses it: all
        // free capacity, and the same without lent GPUs (guaranteed or
        // high-priority work).
        let lent_free = |tier: Tier| high || tier == Tier::Guaranteed;
        let everything = tiers.iter().any(|&t| !lent_free(t)).then(|| self.quote(fleet, request, None));
        let no_lent = tiers.iter().any(|&t| lent_free(t)).then(|| {
            let mut f = fleet.clone();
            for &id in self.engine.lent().keys() {
                f.set_schedulable(id, false).expect("a node of this fleet");
            }
            let q = self.quote(&f, request, None);
            (f, q)
        });
        // High priority: what it could take back, on the view it uses.
        let by_preemption = match &no_lent {
            Some((f, _)) if high => {
                let mut f = f.clone();
                for slot in self.engine.may_take_back_for(&self.fleet, priority, self.now_s()) {
                    for a in self.engine.held(slot) {
                        f.release(a).expect("a running job's allocation");
                    }
                }
                accounting::quote(&f, request, &[], 0, None).now
            }
            _ => 0,
        };
        let compensation = &self.engine.config.compensation;
        tiers
            .into_iter()
            .map(|tier| {
                let q = if lent_free(tier) { &no_lent.as_ref().expect("quoted for this tier").1 } else { everything.as_ref().expect("quoted for this tier") };
                let c = contract.of_tier(tier);
                pb::TierOffer {
                    tier: tier.name().into(),
                    now: q.now,
                    has_next: q.next_in_s.is_some(),
                    next_in_s: q.next_in_s.unwrap_or(0),
                    by_preemption,
                    notice_s: if tier == Tier::Guaranteed { 0 } else { c.notice_s },
                    grace_s: if tier == Tier::Guaranteed { 0 } else { c.grace_s },
                    max_interruptions_per_day: c.max_interruptions_per_day,
                    max_outage_s: c.max_outage_s,
                    credit_per_lost_gpu_h: match tier {
                        Tier::Guaranteed => 0.0,
                        Tier::Preemptible => compensation.preemptible_per_lost_gpu_h,
                        Tier::Opportunistic => compensation.opportunistic_per_lost_gpu_h,
                    },
                    broken_multiplier: if tier == Tier::Opportunistic { 0.0 } else { compensation.broken_multiplier },
                    broken_floor_gpu_h_per_gpu: if tier == Tier::Opportunistic { 0.0 } else { compensation.broken_floor_gpu_h_per_gpu },
                }
            })
            .collect()
    }

    /// Pending jobs of at least `priority`: decided before a new one.
    pub fn queued_at_or_above(&self, priority: u32) -> u32 {
        self.pending.iter().filter(|id| self.jobs.get(id).is_some_and(|j| j.spec.job.priority >= priority)).count() as u32
    }
}

/// What a quote with a probability runs forward from: the partition's
/// nodes of one kind, its running work, the queue ahead, and its history
/// (finished jobs' run times and the last window's arrivals). Jobs are told
/// apart by priority (their class in the forecast).
pub struct ForecastInputs {
    pub fleet: berth_core::Fleet,
    pub running: Vec<Running>,
    pub queued: Vec<Arrival>,
    pub history: History,
}

/// The arrivals a quote replays: the last day's.
pub const QUOTE_WINDOW_S: u64 = 86_400;

impl PartitionState {
    /// The forecast's inputs for a job of `priority` on `fleet` (from
    /// [`Self::fleet_of_kind`]: agent or simulated nodes), at `now_ms`;
    /// with work `rates`, finished runs count as work (run time x the
    /// run's rate), as the forecast compares them.
    pub fn forecast_inputs(&self, fleet: berth_core::Fleet, agent_nodes: bool, priority: u32, now_ms: u64, rates: Option<&WorkRates>) -> ForecastInputs {
        let now = self.clock.now();
        let mut classes: BTreeMap<u32, usize> = BTreeMap::new();
        let mut class = |p: u32| {
            let next = classes.len();
            *classes.entry(p).or_insert(next)
        };
        let kind = |j: &JobRecord| j.spec.argv.is_empty() != agent_nodes;
        let planned = |j: &JobRecord| (!j.spec.duration.is_zero()).then(|| j.spec.duration.as_secs().max(1));
        let mut running = Vec::new();
        let mut history = History { window_s: QUOTE_WINDOW_S, ..Default::default() };
        let mut queued: Vec<(&JobRecord, Arrival)> = Vec::new();
        let window_from_ms = now_ms.saturating_sub(QUOTE_WINDOW_S * 1000);
        for j in self.jobs.values().filter(|j| kind(j)) {
            let c = class(j.spec.job.priority);
            let started = j.started_unix_ms > 0;
            let ran_s = (started && j.state.is_ended()).then(|| j.ended_unix_ms.saturating_sub(j.started_unix_ms) / 1000);
            if let Some(ran) = ran_s {
                let rate = rates.map_or(1.0, |w| w.of_run(&fleet, &j.allocations));
                history.add_finished(c, work_of(ran, rate));
            }
            let unknown_run = |j: &JobRecord| match planned(j) {
                Some(d) => (d, None),
                None => (3_600, Some(c)),
            };
            if let Some(held) = held_now(j) {
                let planned_remaining_s = j.ends_at.map(|end| end.saturating_duration_since(now).as_secs_f64().ceil() as u64);
                let elapsed_s = now_ms.saturating_sub(j.started_unix_ms) / 1000;
                running.push(Running { allocations: held, class: c, elapsed_s, planned_remaining_s });
            }
            if j.state == JobState::Pending && j.spec.job.priority >= priority {
                let (duration_s, class) = unknown_run(j);
                queued.push((j, Arrival { at_s: 0, shape: j.spec.job.shape.clone(), tasks: j.spec.job.tasks, duration_s, ahead: true, class }));
            }
            // Work that came in the window and ran or waits: what may come
            // next. (Cancelled before it ran, it took no room.) It stands
            // for work like it, so its length is drawn from its class even
            // where it finished (the window's finished jobs are its short
            // ones).
            if j.submitted_unix_ms >= window_from_ms && j.submitted_unix_ms < now_ms && (started || j.state == JobState::Pending) {
                let (duration_s, class) = unknown_run(j);
                history.arrivals.push(Arrival {
                    at_s: (j.submitted_unix_ms - window_from_ms) / 1000,
                    shape: j.spec.job.shape.clone(),
                    tasks: j.spec.job.tasks,
                    duration_s,
                    ahead: j.spec.job.priority > priority,
                    class,
                });
            }
        }
        // The queue's order: priority, then first come.
        queued.sort_by_key(|(j, _)| (std::cmp::Reverse(j.spec.job.priority), j.submitted_unix_ms));
        ForecastInputs { fleet, running, queued: queued.into_iter().map(|(_, a)| a).collect(), history }
    }
}
