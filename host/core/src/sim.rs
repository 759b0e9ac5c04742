//! Event-driven scheduling in simulated time: jobs arrive, wait in a
//! priority queue, start all-or-nothing (every task of a gang or none), run
//! for their duration and leave. No IO and no wall clock: the caller hands in
//! the jobs and the policy, and gets back what happened, deterministically.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

use berth_sdk::{AllocationRow, Allocations, Task};

use crate::fleet::{Allocation, Fleet, NodeId};
use crate::placement::{Placer, TaskMeta};
use crate::policy::{PlacementPolicy, PolicyError};
use crate::compaction::{CompactionConfig, CompactionPolicy, CompactionState, Ledger};
use crate::harvest::Harvest;
use crate::preemption::{choose_victims, evict, EvictionLatency, PreemptionPolicy, PriorityContract};
use crate::task::TaskShape;

/// One job: `tasks` identical tasks (a gang when more than one), each of
/// `shape`, on distinct or shared nodes as the policy decides.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Job {
    pub id: u64,
    /// Workload class index (the caller's naming, e.g. online inference).
    pub class: u8,
    /// Larger is more important; only the order matters here.
    pub priority: u32,
    pub arrival_s: u64,
    pub duration_s: u64,
    pub tasks: u32,
    pub shape: TaskShape,
    /// The partition the job was submitted to: it runs on that partition's
    /// nodes under that partition's starvation guard. `None`: anywhere,
    /// under the fleet-wide guard.
    pub partition: Option<u32>,
    /// What a low-priority job is promised when preempted; `None`: the
    /// simulation's default contract.
    pub contract: Option<PriorityContract>,
}

impl Job {
    pub fn gpus(&self) -> u64 {
        u64::from(self.tasks) * u64::from(self.shape.gpu_count)
    }
}

/// What happened to one job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobOutcome {
    /// Start time; `None` if it never started before the horizon.
    pub start_s: Option<u64>,
    /// Distinct switch domains its tasks landed in (its last run).
    pub domains: u32,
    /// When it finished; `None` if it had not by the horizon.
    pub end_s: Option<u64>,
    /// Times it was preempted, of which forced terminations.
    pub interruptions: u32,
    pub forced: u32,
    /// GPU-seconds of work lost to preemption (recomputed after resuming).
    pub lost_gpu_s: f64,
}

/// Allocation sampled over time, integrated exactly between events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Utilisation {
    /// Integral of allocated milli-GPU over time (milli-GPU x seconds).
    pub all_milli_s: f64,
    /// The same counting only jobs at or above the high-priority threshold.
    pub high_milli_s: f64,
    /// Seconds covered.
    pub seconds: f64,
}

/// The result of a simulation.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// Indexed like the input jobs.
    pub jobs: Vec<JobOutcome>,
    pub utilisation: Utilisation,
    /// Scheduling passes run and placement calls made.
    pub passes: u64,
    pub placements: u64,
    /// Reservations the starvation guard made.
    pub reservations: u64,
    /// Preemptions: jobs evicted, of which forced terminations, and the
    /// GPU-seconds of work they lost.
    pub evictions: u64,
    pub forced_terminations: u64,
    pub lost_gpu_s: f64,
    /// Seconds each eviction took to vacate (ASI: 13 s mean, 48 s p95).
    pub vacate_s: Vec<u64>,
    /// Harvesting: GPU-seconds of sleeping replicas (standby), the part of
    /// it low-priority work used, replicas put to sleep, borrowers evicted
    /// to wake them, and replicas that could not wake on their GPUs.
    pub standby_gpu_s: f64,
    pub harvested_gpu_s: f64,
    pub sleeps: u64,
    pub wake_evictions: u64,
    pub wake_failures: u64,
    /// Compaction's migration ledger, summed over its steps.
    pub compaction: Ledger,
    /// Jobs still waiting at the end, and the work still running (planned
    /// end, allocations) — the state accounting and quotes look at.
    pub pending_at_end: Vec<usize>,
    pub running_at_end: Vec<(u64, usize, Vec<Allocation>)>,
    /// Simulated time at the end.
    pub end_s: u64,
}

/// Simulation settings.
#[derive(Clone, Debug, Default)]
pub struct SimConfig {
    /// Stop at this simulated time.
    pub horizon_s: u64,
    /// Jobs with priority >= this count as high priority in utilisation.
    pub high_priority: u32,
    /// Keeps large gangs from waiting forever behind streams of small jobs.
    pub guards: Guards,
    /// Preemption: the contract of low-priority jobs that name none, how
    /// long evictions take, and partitions whose work is never taken back.
    pub contract: PriorityContract,
    pub eviction: EvictionLatency,
    pub protected_partitions: BTreeSet<u32>,
    /// Sleep-state harvesting of idle replicas in the daily trough.
    pub harvest: Option<Harvest>,
}

/// Starvation-guard settings: fleet-wide, and per partition.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Guards {
    /// For jobs not submitted to a partition, or whose partition has no
    /// setting of its own.
    pub fleet: Option<StarvationGuard>,
    /// Per-partition settings; `None` turns the guard off in a partition.
    pub partitions: BTreeMap<u32, Option<StarvationGuard>>,
}

impl Guards {
    /// The same guard everywhere.
    pub fn everywhere(guard: Option<StarvationGuard>) -> Guards {
        Guards { fleet: guard, partitions: BTreeMap::new() }
    }

    /// The guard that applies to `job`.
    pub fn of(&self, job: &Job) -> Option<StarvationGuard> {
        job.partition.and_then(|p| self.partitions.get(&p).copied()).unwrap_or(self.fleet)
    }
}

/// A reservation of the starvation guard: the job and the time it is
/// planned to start at the latest.
struct Reservation {
    job: usize,
    until: u64,
}

/// The starvation guard: aging raises a waiting job's place in the queue,
/// and a job that has waited long enough and still cannot start gets a
/// reservation. While it holds one, other jobs start on its drained nodes
/// only if they will have ended by the reservation's time (the earliest time
/// enough running work will have ended for it), so the reserved job starts
/// then at the latest. Each partition (and the fleet-wide scope) holds at
/// most one reservation at a time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StarvationGuard {
    /// A job waiting this long that cannot start gets the reservation.
    pub reserve_after_s: u64,
    /// Priority points added per hour of waiting.
    pub aging_per_hour: f64,
}

/// Runs `jobs` (any order) on `fleet` with `policy` until the horizon.
/// Each scheduling pass walks the queue in (priority desc, arrival) order and
/// starts every job that fits; a shape that did not fit is not retried in the
/// same pass. No preemption: see [`simulate_with`].
pub fn simulate(fleet: &mut Fleet, jobs: &[Job], policy: &mut dyn PlacementPolicy, config: SimConfig) -> Result<SimOutcome, PolicyError> {
    simulate_with(fleet, jobs, Deciders { placement: policy, preemption: None, compaction: None }, config)
}

/// The policies a simulation asks: placement always; preemption ranking
/// and compaction planning when those mechanisms are on.
pub struct Deciders<'a> {
    pub placement: &'a mut dyn PlacementPolicy,
    pub preemption: Option<&'a mut dyn PreemptionPolicy>,
    /// Runs every `config.period_s` over every partition.
    pub compaction: Option<(&'a mut dyn CompactionPolicy, CompactionConfig)>,
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
    let Deciders { placement: policy, mut preemption, mut compaction } = deciders;
    let mut compaction_state = CompactionState::default();
    let mut next_compaction = compaction.as_ref().map(|(_, c)| c.period_s.max(1));
    let n = jobs.len();
    let mut arrivals: Vec<usize> = (0..n).collect();
    arrivals.sort_by_key(|&i| (jobs[i].arrival_s, jobs[i].id));
    let mut next_arrival = 0;
    let mut pending: Vec<usize> = Vec::new();
    // (planned end, job); an entry whose end is not the job's planned end is
    // stale (the job was evicted) and skipped.
    let mut running: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut runs = Runs::new(n);
    let mut outcome = SimOutcome { jobs: vec![JobOutcome::default(); n], ..SimOutcome::default() };
    let mut placer = Placer::new();
    let mut now = 0u64;
    let mut high_milli = 0u64;
    // One reservation per scope (a partition, or `None` for fleet-wide),
    // and which reservation drained each node.
    let mut reservations: BTreeMap<Option<u32>, Reservation> = BTreeMap::new();
    let mut drained_by: HashMap<NodeId, Option<u32>> = HashMap::new();
    let low = |j: usize| jobs[j].priority < config.high_priority;
    // Harvesting: sleeping replicas with the allocations they keep a claim
    // on, the GPUs lent on each node, and the next sleep or wake.
    let mut sleeping: BTreeMap<usize, Vec<Allocation>> = BTreeMap::new();
    let mut lent: HashMap<NodeId, u64> = HashMap::new();
    let mut sleeping_milli = 0u64;
    let mut next_harvest = config.harvest.map(|h| h.next_boundary(None));
    // Jobs that joined the queue since the last pass, and nodes where
    // capacity was released since then.
    let mut fresh = vec![false; n];
    let mut touched: HashSet<NodeId> = HashSet::new();
    let mut gang_bounds = GangBounds::default();

    loop {
        // The next event: an arrival, a departure or an evicted job ready
        // again, whichever is first.
        while running.peek().is_some_and(|&Reverse((end, j))| runs.planned_end[j] != Some(end)) {
            running.pop();
        }
        let t_arrival = arrivals.get(next_arrival).map(|&i| jobs[i].arrival_s);
        let t_departure = running.peek().map(|Reverse((t, _))| *t);
        let t_wakeup = runs.wakeups.peek().map(|Reverse(t)| *t);
        let t_harvest = next_harvest.map(|(t, _)| t);
        // Compaction ticks only while something runs or waits.
        let busy = t_arrival.is_some() || t_departure.is_some() || t_wakeup.is_some();
        let t_compaction = next_compaction.filter(|_| busy);
        let Some(t) = [t_arrival, t_departure, t_wakeup, t_harvest, t_compaction].into_iter().flatten().min() else { break };
        let t = t.min(config.horizon_s);
        let dt = (t - now) as f64;
        // A sleeping replica still owns its GPUs; a borrower on them is
        // harvest, not more allocation.
        let borrowed = lent_in_use(fleet, &lent);
        outcome.utilisation.all_milli_s += (fleet.gpu_allocated_milli() + sleeping_milli - borrowed) as f64 * dt;
        outcome.harvested_gpu_s += borrowed as f64 / 1000.0 * dt;
        outcome.standby_gpu_s += sleeping_milli as f64 / 1000.0 * dt;
        outcome.utilisation.high_milli_s += high_milli as f64 * dt;
        outcome.utilisation.seconds += dt;
        now = t;
        if now >= config.horizon_s {
            break;
        }
        // What changed since the last pass, so that jobs that did not fit
        // then are tried again only where they might fit now: `freed` when
        // constraints relaxed or capacity moved anywhere (every job is
        // tried), else the nodes where capacity was released (a waiting
        // single task can only fit on one of those); jobs new to the queue
        // are always tried.
        let mut freed = outcome.passes == 0;
        touched.clear();
        while let Some(&Reverse((end, j))) = running.peek() {
            if end > now {
                break;
            }
            running.pop();
            if runs.planned_end[j] != Some(end) {
                continue;
            }
            runs.planned_end[j] = None;
            outcome.jobs[j].end_s = Some(end);
            runs.running_low.remove(&j);
            for alloc in runs.held[j].drain(..) {
                fleet.release(&alloc).expect("a running job's allocations are held");
                touched.insert(alloc.node);
            }
            if !low(j) {
                high_milli -= jobs[j].gpus() * u64::from(jobs[j].shape.gpu_milli);
            }
        }
        while runs.wakeups.peek().is_some_and(|&Reverse(t)| t <= now) {
            runs.wakeups.pop();
        }
        if let (Some(h), Some((t, wake))) = (config.harvest, next_harvest)
            && t == now
        {
            freed = true;
            if wake {
                let (queue, failed) = wake_replicas(fleet, &mut sleeping, jobs, &mut runs, now, &config, &mut outcome);
                for &r in &failed {
                    high_milli -= jobs[r].gpus() * u64::from(jobs[r].shape.gpu_milli);
                }
                pending.extend(queue.into_iter().chain(failed));
                lent.clear();
                sleeping_milli = 0;
            } else {
                let running_now: Vec<(usize, u64)> = runs.planned_end.iter().enumerate().filter_map(|(j, e)| e.map(|e| (j, e))).collect();
                for (j, end) in running_now {
                    let job = &jobs[j];
                    // Whole-GPU replicas that will still run when it wakes.
                    if job.class != h.class || job.shape.gpu_milli < crate::MILLI_PER_GPU || end <= now + h.trough_s() || !h.sleeps(job.id, now / 86_400) {
                        continue;
                    }
                    for a in &runs.held[j] {
                        fleet.release(a).expect("a running job's allocations are held");
                        *lent.entry(a.node).or_default() |= a.gpus;
                        sleeping_milli += a.gpu_milli_total();
                    }
                    sleeping.insert(j, runs.held[j].clone());
                    outcome.sleeps += 1;
                }
            }
            next_harvest = Some(h.next_boundary(Some(now)));
        }
        while let Some(&i) = arrivals.get(next_arrival) {
            if jobs[i].arrival_s > now {
                break;
            }
            pending.push(i);
            fresh[i] = true;
            next_arrival += 1;
        }
        let effective = |i: usize| {
            let aging = config.guards.of(&jobs[i]).map_or(0.0, |g| g.aging_per_hour);
            let waited_h = (now - jobs[i].arrival_s) as f64 / 3600.0;
            u64::from(jobs[i].priority) + (aging * waited_h) as u64
        };
        pending.sort_by_cached_key(|&i| (Reverse(effective(i)), jobs[i].arrival_s, jobs[i].id));
        outcome.passes += 1;
        // A reservation whose job started, or whose estimate passed, is
        // dropped and planned again.
        if let (Some((planner, cc)), Some(t)) = (compaction.as_mut(), next_compaction)
            && t == now
        {
            // Sleeping replicas are off the fleet: not movable.
            let running_now: Vec<(u64, usize)> =
                runs.planned_end.iter().enumerate().filter(|(j, _)| !sleeping.contains_key(j)).filter_map(|(j, e)| e.map(|e| (e, j))).collect();
            let step = crate::compaction::step_jobs(fleet, jobs, &mut runs.held, &running_now, &pending, *planner, cc, &mut compaction_state, now)
                .map_err(|e| PolicyError::InvalidOutput(e.to_string()))?;
            freed |= !step.applied.is_empty();
            outcome.compaction.add(&step.ledger);
            next_compaction = Some(now + cc.period_s.max(1));
        }
        let before = reservations.len();
        reservations.retain(|_, r| outcome.jobs[r.job].start_s.is_none() && now < r.until);
        drained_by.retain(|_, scope| reservations.contains_key(scope));
        freed |= reservations.len() != before;
        if freed {
            gang_bounds.clear();
        } else {
            gang_bounds.raise(fleet, &touched);
        }
        // Shapes that did not fit this pass under the same constraints: not
        // retried until the next event.
        let mut failed: HashSet<ShapeKey> = HashSet::new();
        let mut still_pending = Vec::with_capacity(pending.len());
        let mut evicted = Vec::new();
        for &j in &pending {
            let job = &jobs[j];
            let new_here = std::mem::take(&mut fresh[j]) || (runs.ready_at[j] == now && now > 0);
            if runs.ready_at[j] > now || !(freed || new_here || !touched.is_empty()) {
                still_pending.push(j); // evicted and still vacating, or nothing changed
                continue;
            }
            let remaining = job.duration_s.saturating_sub(runs.kept_s[j]).max(1);
            // Work that would still run at a reservation's time keeps off
            // the nodes drained for it; shorter work may use them.
            let avoided: Vec<Option<u32>> = reservations
                .iter()
                .filter(|(_, r)| r.job != j && now.saturating_add(remaining) > r.until)
                .map(|(scope, _)| *scope)
                .collect();
            let key = (avoided, job.partition, job.tasks, &job.shape);
            if failed.contains(&key) {
                still_pending.push(j);
                continue;
            }
            let avoided = &key.0;
            // Lent GPUs are for low-priority work only: their owners wake.
            let keep = |id: NodeId, n: &crate::fleet::Node| {
                job.partition.is_none_or(|p| n.partition == p)
                    && drained_by.get(&id).is_none_or(|scope| !avoided.contains(scope))
                    && (low(j) || !lent.contains_key(&id))
            };
            let fits_where_freed = || {
                touched.iter().any(|&id| {
                    let node = &fleet.nodes()[id as usize];
                    keep(id, node) && crate::predicate::check(node, &job.shape).is_ok()
                })
            };
            // (A job that may preempt is tried anyway: victims may have
            // become available anywhere.)
            let may_preempt = preemption.is_some() && !low(j);
            if !(freed || new_here || may_preempt) && job.tasks == 1 && !fits_where_freed() {
                still_pending.push(j);
                continue;
            }
            // A gang whose tasks cannot all fit, even ignoring placement, is
            // not offered to the policy (place_gang would decline it too);
            // its bound spares the scan of the fleet until enough capacity
            // came back.
            let bound_key = (job.tasks > 1).then(|| (key.clone(), low(j)));
            let mut hopeless = bound_key.as_ref().is_some_and(|k| gang_bounds.rules_out(k));
            if let Some(k) = bound_key
                && !hopeless
            {
                let fit = fitting_tasks_among(fleet, &job.shape, job.tasks, &keep);
                if fit < job.tasks {
                    gang_bounds.record(k, fit);
                    hopeless = true;
                }
            }
            // (A single task, or a gang counted above: no second count.)
            let mut placed =
                if hopeless { None } else { place_fitting_gang(fleet, &mut placer, policy, job, &mut outcome.placements, &keep)?.map(|(a, d)| (a, d, 0)) };
            if placed.is_none()
                && !low(j)
                && let Some(ranker) = preemption.as_deref_mut()
            {
                let victims = Victims { jobs, runs: &runs };
                if let Some(chosen) = victims.choose(fleet, ranker, j, now, &keep, &config)? {
                    gang_bounds.clear(); // capacity comes back outside the departures
                    for &v in &chosen {
                        for alloc in &runs.held[v] {
                            fleet.release(alloc).expect("a running job's allocations are held");
                            touched.insert(alloc.node);
                        }
                    }
                    match place_gang(fleet, &mut placer, policy, job, &mut outcome.placements, &keep)? {
                        Some((allocs, domains)) => {
                            let mut delay = 0;
                            for v in chosen {
                                runs.held[v].clear(); // released above
                                let vacate = runs.take_back(v, now, jobs, &config, &mut outcome);
                                delay = delay.max(vacate);
                                if runs.ready_at[v] > now {
                                    evicted.push(v);
                                }
                            }
                            placed = Some((allocs, domains, delay));
                        }
                        None => {
                            // Cannot happen when enough tasks fit, but never
                            // lose the victims' places if it does.
                            for &v in &chosen {
                                for alloc in &runs.held[v] {
                                    fleet.allocate(alloc).expect("was runs.held a moment ago");
                                }
                            }
                        }
                    }
                }
            }
            match placed {
                Some((allocs, domains, delay)) => {
                    let start = now + delay;
                    runs.held[j] = allocs;
                    let o = &mut outcome.jobs[j];
                    o.start_s.get_or_insert(start);
                    o.domains = domains;
                    runs.run_start[j] = start;
                    let end = start.saturating_add(remaining);
                    runs.planned_end[j] = Some(end);
                    running.push(Reverse((end, j)));
                    if low(j) {
                        runs.running_low.insert(j);
                    } else {
                        high_milli += job.gpus() * u64::from(job.shape.gpu_milli);
                    }
                }
                None => {
                    failed.insert(key);
                    still_pending.push(j);
                    if let Some(g) = config.guards.of(job)
                        && !reservations.contains_key(&job.partition)
                        && now - job.arrival_s >= g.reserve_after_s
                    {
                        let in_scope = |n: &crate::fleet::Node| job.partition.is_none_or(|p| n.partition == p);
                        let ends: Vec<(u64, usize)> = runs.planned_end.iter().enumerate().filter_map(|(j, e)| e.map(|e| (e, j))).collect();
                        let (until, nodes) = shadow_time(fleet, ends, &runs.held, job, &in_scope);
                        outcome.reservations += 1;
                        for &id in &nodes {
                            drained_by.entry(id).or_insert(job.partition);
                        }
                        reservations.insert(job.partition, Reservation { job: j, until });
                    }
                }
            }
        }
        still_pending.extend(evicted);
        pending = still_pending;
    }
    outcome.end_s = now;
    outcome.pending_at_end = pending;
    // Sleeping replicas are not on the fleet now: only what runs is.
    outcome.running_at_end = runs
        .planned_end
        .iter()
        .enumerate()
        .filter(|(j, _)| !sleeping.contains_key(j))
        .filter_map(|(j, e)| e.map(|e| (e, j, std::mem::take(&mut runs.held[j]))))
        .collect();
    Ok(outcome)
}

/// Waiting jobs as the event loop tells them apart: reservation scopes the
/// job must avoid, partition, tasks, shape.
type ShapeKey<'a> = (Vec<Option<u32>>, Option<u32>, u32, &'a TaskShape);

/// A waiting gang's [`ShapeKey`], and whether it is low priority (lent GPUs
/// are open to low priority only).
type GangKey<'a> = (ShapeKey<'a>, bool);

/// For gangs that did not fit: an upper bound on how many of their tasks
/// could fit now. Set to the exact count when a scan fails, then raised by
/// what each node that released capacity could hold, so that on a large
/// fleet a waiting gang is not re-scanned after every departure, only when
/// enough capacity may have come back. Valid only while capacity returns
/// through departures alone: anything else (constraints relaxed, moves,
/// evictions) clears it.
#[derive(Default)]
struct GangBounds<'a> {
    bounds: HashMap<GangKey<'a>, u32>,
}

impl<'a> GangBounds<'a> {
    fn clear(&mut self) {
        self.bounds.clear();
    }

    fn record(&mut self, key: GangKey<'a>, fitting: u32) {
        self.bounds.insert(key, fitting);
    }

    /// True when the gang surely cannot fit: its bound is below its size.
    fn rules_out(&self, key: &GangKey<'a>) -> bool {
        self.bounds.get(key).is_some_and(|&b| b < key.0.2)
    }

    /// Capacity came back on `released`: a gang's bound grows by what those
    /// nodes could hold of it now (counted whether or not drained or lent,
    /// which only makes the bound looser, never wrong).
    fn raise(&mut self, fleet: &Fleet, released: &HashSet<NodeId>) {
        if released.is_empty() {
            return;
        }
        for (((_, partition, tasks, shape), _), bound) in self.bounds.iter_mut() {
            for &id in released {
                let node = &fleet.nodes()[id as usize];
                if partition.is_none_or(|p| node.partition == p) {
                    *bound = bound.saturating_add(tasks_on_node(node, shape).min(*tasks));
                }
            }
        }
        self.bounds.retain(|((_, _, tasks, _), _), bound| *bound < *tasks);
    }
}

/// Milli-GPUs in use on lent GPUs (borrowed from sleeping replicas).
fn lent_in_use(fleet: &Fleet, lent: &HashMap<NodeId, u64>) -> u64 {
    lent.iter()
        .map(|(&id, &mask)| crate::fleet::gpus_of(mask).map(|g| u64::from(crate::MILLI_PER_GPU - fleet.nodes()[id as usize].gpus[g])).sum::<u64>())
        .sum()
}

/// Wakes every sleeping replica on its own GPUs: low-priority borrowers in
/// the way are evicted under their contracts (on a node, those holding the
/// replica's GPUs first). A replica that still cannot fit (a borrower's CPU
/// or memory is not enough to explain it) counts as a wake failure and
/// queues again. Returns the evicted borrowers to queue, and the failures.
fn wake_replicas(
    fleet: &mut Fleet,
    sleeping: &mut BTreeMap<usize, Vec<Allocation>>,
    jobs: &[Job],
    runs: &mut Runs,
    now: u64,
    config: &SimConfig,
    outcome: &mut SimOutcome,
) -> (Vec<usize>, Vec<usize>) {
    let mut queue = Vec::new();
    let mut failed = Vec::new();
    for (r, allocs) in std::mem::take(sleeping) {
        let mut done = Vec::new();
        let mut ok = true;
        for a in &allocs {
            while fleet.allocate(a).is_err() {
                // The borrower to evict: one on this node holding these
                // GPUs, else any on this node.
                let on_node = |v: &usize| runs.held[*v].iter().any(|b| b.node == a.node);
                let overlaps = |v: &usize| runs.held[*v].iter().any(|b| b.node == a.node && b.gpus & a.gpus != 0);
                let Some(v) = runs.running_low.iter().copied().find(overlaps).or_else(|| runs.running_low.iter().copied().find(on_node)) else {
                    ok = false;
                    break;
                };
                for b in runs.held[v].drain(..) {
                    fleet.release(&b).expect("a running job's allocations are held");
                }
                runs.take_back(v, now, jobs, config, outcome);
                outcome.wake_evictions += 1;
                if runs.ready_at[v] > now {
                    queue.push(v);
                }
            }
            if !ok {
                break;
            }
            done.push(a.clone());
        }
        if !ok {
            // Give back what it re-took and start it again from the queue.
            for a in &done {
                fleet.release(a).expect("just allocated");
            }
            runs.held[r].clear();
            runs.planned_end[r] = None;
            outcome.wake_failures += 1;
            failed.push(r);
        }
    }
    (queue, failed)
}

/// Per-job state of the event loop's runs.
struct Runs {
    /// Planned end of the current run; `None` when not running.
    planned_end: Vec<Option<u64>>,
    held: Vec<Vec<Allocation>>,
    /// When the current run's work started (after any victims vacated).
    run_start: Vec<u64>,
    /// Work kept across evictions (checkpointed).
    kept_s: Vec<u64>,
    /// When an evicted job, vacating, may run again; and those times as
    /// events.
    ready_at: Vec<u64>,
    wakeups: BinaryHeap<Reverse<u64>>,
    /// Times each job was taken back.
    interrupted_at: HashMap<usize, Vec<u64>>,
    /// Running low-priority jobs: the candidate victims.
    running_low: BTreeSet<usize>,
}

impl Runs {
    fn new(n: usize) -> Runs {
        Runs {
            planned_end: vec![None; n],
            held: vec![Vec::new(); n],
            run_start: vec![0; n],
            kept_s: vec![0; n],
            ready_at: vec![0; n],
            wakeups: BinaryHeap::new(),
            interrupted_at: HashMap::new(),
            running_low: BTreeSet::new(),
        }
    }

    /// Takes running job `v` back under its contract (its allocations are
    /// the caller's to release): records the interruption and lost work,
    /// and queues it to resume once vacated. Returns seconds until vacated.
    fn take_back(&mut self, v: usize, now: u64, jobs: &[Job], config: &SimConfig, outcome: &mut SimOutcome) -> u64 {
        let job = &jobs[v];
        let contract = job.contract.unwrap_or(config.contract);
        let times = self.interrupted_at.entry(v).or_default();
        let latency = config.eviction.sample_s(job.id.wrapping_mul(31).wrapping_add(times.len() as u64));
        let ev = evict(&contract, now.saturating_sub(self.run_start[v]), latency);
        times.push(now);
        self.planned_end[v] = None;
        self.running_low.remove(&v);
        self.kept_s[v] = (self.kept_s[v] + ev.kept_s).min(job.duration_s);
        let gpus = job.gpus() as f64 * f64::from(job.shape.gpu_milli) / 1000.0;
        let o = &mut outcome.jobs[v];
        o.interruptions += 1;
        o.forced += u32::from(ev.forced);
        o.lost_gpu_s += gpus * ev.lost_s as f64;
        outcome.evictions += 1;
        outcome.forced_terminations += u64::from(ev.forced);
        outcome.lost_gpu_s += gpus * ev.lost_s as f64;
        outcome.vacate_s.push(ev.vacate_s);
        if self.kept_s[v] >= job.duration_s {
            o.end_s = Some(now + ev.vacate_s); // it finished while leaving
        } else {
            self.ready_at[v] = now + ev.vacate_s;
            self.wakeups.push(Reverse(self.ready_at[v]));
        }
        ev.vacate_s
    }
}

/// What the preemption driver reads of the event loop's state.
struct Victims<'a> {
    jobs: &'a [Job],
    runs: &'a Runs,
}

impl Victims<'_> {
    /// The victims to evict so that job `j` fits, or `None`: candidates are
    /// running low-priority jobs below `j`'s priority, under their daily
    /// interruption limit, holding something on a node `j` could use; the
    /// policy ranks their allocations; [`choose_victims`] takes the
    /// shortest sufficient prefix and gives back what is not needed.
    fn choose(
        &self,
        fleet: &Fleet,
        ranker: &mut dyn PreemptionPolicy,
        j: usize,
        now: u64,
        keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool,
        config: &SimConfig,
    ) -> Result<Option<Vec<usize>>, PolicyError> {
        let job = &self.jobs[j];
        let usable = |id: NodeId| {
            let node = &fleet.nodes()[id as usize];
            node.schedulable && !config.protected_partitions.contains(&node.partition) && keep(id, node) && (job.shape.gpu_count == 0 || job.shape.accepts(node.model))
        };
        let mut victims = Allocations::default();
        let mut owner = Vec::new();
        for &v in &self.runs.running_low {
            let vj = &self.jobs[v];
            let contract = vj.contract.unwrap_or(config.contract);
            let recent = self.runs.interrupted_at.get(&v).map_or(0, |t| t.iter().filter(|&&t| t + 86_400 > now).count());
            if vj.priority >= job.priority || recent >= contract.max_interruptions_per_day as usize || !self.runs.held[v].iter().any(|a| usable(a.node)) {
                continue;
            }
            let ran = now.saturating_sub(self.runs.run_start[v]);
            for a in &self.runs.held[v] {
                victims.push(AllocationRow {
                    id: owner.len() as u32,
                    job_id: vj.id,
                    node: a.node,
                    gpus: a.gpus,
                    gpu_milli: a.gpu_milli,
                    cpu_milli: a.cpu_milli,
                    memory_mib: a.memory_mib,
                    priority: vj.priority,
                    movable: true,
                    gang_id: if vj.tasks > 1 { vj.id } else { 0 },
                    state_bytes: 0,
                    remaining_s: vj.duration_s.saturating_sub(self.runs.kept_s[v] + ran),
                    running_s: ran,
                    since_checkpoint_s: ran % contract.checkpoint_every_s.max(1),
                });
                owner.push(v);
            }
        }
        if owner.is_empty() {
            return Ok(None);
        }
        let mut task = Task::default();
        crate::placement::fill_task(&mut task, &job.shape, TaskMeta { job_id: job.id, priority: job.priority, gang_size: job.tasks, gang_index: 0 });
        let order = match ranker.rank(&task, &mut victims)? {
            Some(order) => order,
            None => berth_sdk::default_rank(&victims),
        };
        let mut seen = vec![false; owner.len()];
        let mut ranked_jobs = Vec::new();
        let mut taken: HashSet<usize> = HashSet::new();
        for &i in &order {
            let i = i as usize;
            if i >= owner.len() || std::mem::replace(&mut seen[i], true) {
                return Err(PolicyError::InvalidOutput(format!("rank index {i} is out of range or repeated ({} victims)", owner.len())));
            }
            if taken.insert(owner[i]) {
                ranked_jobs.push(owner[i]);
            }
        }
        let slices: Vec<&[Allocation]> = ranked_jobs.iter().map(|&v| &self.runs.held[v][..]).collect();
        Ok(choose_victims(fleet, &job.shape, job.tasks, keep, &slices).map(|picked| picked.into_iter().map(|k| ranked_jobs[k]).collect()))
    }
}

/// Places every task of `job` or none (see [`Placer::place_tasks`]), a gang
/// first choosing switch domains when the policy scores them. Returns the
/// allocations and the number of distinct switch domains used.
pub fn place_gang(
    fleet: &mut Fleet,
    placer: &mut Placer,
    policy: &mut dyn PlacementPolicy,
    job: &Job,
    placements: &mut u64,
    keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool,
) -> Result<Option<(Vec<Allocation>, u32)>, PolicyError> {
    if job.tasks > 1 && fitting_tasks_among(fleet, &job.shape, job.tasks, keep) < job.tasks {
        return Ok(None); // cannot fit even ignoring placement: skip the policy
    }
    place_fitting_gang(fleet, placer, policy, job, placements, keep)
}

/// [`place_gang`] for a caller that has already counted that all the gang's
/// tasks fit among the nodes `keep` accepts.
fn place_fitting_gang(
    fleet: &mut Fleet,
    placer: &mut Placer,
    policy: &mut dyn PlacementPolicy,
    job: &Job,
    placements: &mut u64,
    keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool,
) -> Result<Option<(Vec<Allocation>, u32)>, PolicyError> {
    // A gang asks the policy for switch domains first; with an answer, its
    // tasks go only to the best domains that together hold it.
    let mut allowed: Option<HashSet<u32>> = None;
    if job.tasks > 1 {
        let (mut domains, _) = domain_table_among(fleet, &job.shape, keep);
        let mut task = berth_sdk::Task::default();
        crate::placement::fill_task(&mut task, &job.shape, TaskMeta { job_id: job.id, priority: job.priority, gang_size: job.tasks, gang_index: 0 });
        if let Some(scores) = policy.score_domains(&task, &mut domains)? {
            if scores.len() != domains.len() || scores.iter().any(|s| !s.is_finite()) {
                return Err(PolicyError::InvalidOutput(format!("{} domain scores for {} domains, or one not finite", scores.len(), domains.len())));
            }
            let mut order: Vec<usize> = (0..domains.len()).collect();
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(domains.ids[a].cmp(&domains.ids[b])));
            let mut chosen = HashSet::new();
            let mut fits = 0u32;
            for i in order {
                if fits >= job.tasks {
                    break;
                }
                if domains.fitting_tasks[i] > 0 {
                    chosen.insert(domains.ids[i]);
                    fits += domains.fitting_tasks[i];
                }
            }
            allowed = Some(chosen);
        }
    }
    let keep = |id: NodeId, n: &crate::fleet::Node| keep(id, n) && allowed.as_ref().is_none_or(|a| a.contains(&n.switch_domain));
    let meta = TaskMeta { job_id: job.id, priority: job.priority, gang_size: job.tasks, gang_index: 0 };
    let Some(allocs) = placer.place_tasks(fleet, &job.shape, meta, job.tasks, policy, None, &keep)? else { return Ok(None) };
    *placements += u64::from(job.tasks);
    let domains: HashSet<u32> = allocs.iter().map(|a| fleet.nodes()[a.node as usize].switch_domain).collect();
    Ok(Some((allocs, domains.len() as u32)))
}

/// The earliest time enough running work will have ended for `job` to fit
/// on the nodes `in_scope` accepts, given the running jobs' planned `ends`
/// (`u64::MAX` if it never would), and the nodes to drain for it: those that
/// will hold it then, most capacity first. Keeps a running count of the
/// tasks that fit, updated only on the nodes each departure touches, so a
/// reservation on 20,000 nodes costs one pass over them, not one per job.
fn shadow_time(
    fleet: &Fleet,
    mut ends: Vec<(u64, usize)>,
    held: &[Vec<Allocation>],
    job: &Job,
    in_scope: &dyn Fn(&crate::fleet::Node) -> bool,
) -> (u64, HashSet<NodeId>) {
    let need = job.tasks;
    let room = |n: &crate::fleet::Node| if in_scope(n) { u64::from(tasks_on_node(n, &job.shape).min(need)) } else { 0 };
    ends.sort_unstable();
    let mut scratch = fleet.clone();
    let mut fitting: u64 = scratch.nodes().iter().map(room).sum();
    for (end, j) in ends {
        for alloc in &held[j] {
            let before = room(&scratch.nodes()[alloc.node as usize]);
            scratch.release(alloc).expect("held by a running job");
            fitting += room(&scratch.nodes()[alloc.node as usize]) - before;
        }
        if fitting >= u64::from(need) {
            let mut by_room: Vec<(u64, NodeId)> =
                scratch.nodes().iter().enumerate().map(|(i, n)| (room(n), i as NodeId)).filter(|&(t, _)| t > 0).collect();
            by_room.sort_by_key(|&(t, i)| (Reverse(t), i));
            let mut nodes = HashSet::new();
            let mut room = 0;
            for (t, i) in by_room {
                if room >= u64::from(need) {
                    break;
                }
                room += t;
                nodes.insert(i);
            }
            return (end, nodes);
        }
    }
    (u64::MAX, HashSet::new())
}

/// How many tasks of `shape` one node could hold right now.
pub fn tasks_on_node(node: &crate::fleet::Node, shape: &TaskShape) -> u32 {
    if crate::predicate::check(node, shape).is_err() {
        return 0;
    }
    let by = |free: u64, want: u64| free.checked_div(want).unwrap_or(u64::MAX);
    let gpu = if shape.gpu_count == 0 {
        u64::MAX
    } else {
        let per_gpu = node.gpus.iter().map(|&f| u64::from(f / shape.gpu_milli.max(1))).sum::<u64>();
        per_gpu / u64::from(shape.gpu_count)
    };
    let n = gpu.min(by(u64::from(node.cpu_free_milli), u64::from(shape.cpu_milli))).min(by(node.memory_free_mib, shape.memory_mib));
    n.min(u64::from(u32::MAX)) as u32
}

/// The switch domains as a gang of `shape` sees them (see the WIT
/// `domains`), sorted by domain id, and the total tasks that fit.
pub fn domain_table(fleet: &Fleet, shape: &TaskShape) -> (berth_sdk::Domains, u64) {
    domain_table_among(fleet, shape, &|_, _| true)
}

/// [`domain_table`] counting only the nodes `keep` accepts.
pub fn domain_table_among(fleet: &Fleet, shape: &TaskShape, keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool) -> (berth_sdk::Domains, u64) {
    let mut by_domain: BTreeMap<u32, [u64; 6]> = Default::default();
    for (id, node) in fleet.nodes().iter().enumerate() {
        if !node.schedulable || (shape.gpu_count > 0 && !shape.accepts(node.model)) || !keep(id as NodeId, node) {
            continue;
        }
        let e = by_domain.entry(node.switch_domain).or_insert([u64::from(node.aggregation), 0, 0, 0, 0, 0]);
        e[1] += 1;
        e[2] += u64::from(node.is_idle());
        e[3] += node.gpus.len() as u64;
        e[4] += node.gpus.iter().filter(|&&g| g == crate::MILLI_PER_GPU).count() as u64;
        e[5] += u64::from(tasks_on_node(node, shape));
    }
    let mut d = berth_sdk::Domains::default();
    let mut total = 0;
    for (id, v) in by_domain {
        let c = |x: u64| x.min(u64::from(u32::MAX)) as u32;
        d.ids.push(id);
        d.aggregation.push(c(v[0]));
        d.nodes.push(c(v[1]));
        d.idle_nodes.push(c(v[2]));
        d.gpus_total.push(c(v[3]));
        d.gpus_idle.push(c(v[4]));
        d.fitting_tasks.push(c(v[5]));
        total += v[5];
    }
    (d, total)
}

/// How many tasks of `shape` the fleet could hold at most right now
/// (counting each node's capacity for several; stops counting at `enough`).
pub fn fitting_tasks(fleet: &Fleet, shape: &TaskShape, enough: u32) -> u32 {
    fitting_tasks_among(fleet, shape, enough, &|_, _| true)
}

/// [`fitting_tasks`] counting only the nodes `keep` accepts.
pub fn fitting_tasks_among(fleet: &Fleet, shape: &TaskShape, enough: u32, keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool) -> u32 {
    let mut total = 0u32;
    for (id, node) in fleet.nodes().iter().enumerate() {
        if !keep(id as NodeId, node) {
            continue;
        }
        let n = tasks_on_node(node, shape);
        total = total.saturating_add(n.min(enough));
        if total >= enough {
            return enough;
        }
    }
    total
}
