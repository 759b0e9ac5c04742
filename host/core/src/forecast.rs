//! Quotes with a probability: the chance that one copy of a shape starts by
//! a deadline, found by running the fleet forward many times. In each
//! sample, every running job ends after a remaining time drawn from the
//! finished jobs of its class that ran longer than it has (capped by its
//! planned end; the planned end when none did), and competing work arrives
//! as it did in a recent window, replayed from a random phase. Work ahead
//! of the request (queued now, or arriving at a higher priority) takes
//! freed room before it; any arrival takes room that is free when it
//! comes (the request did not fit then). Competing work is placed
//! first-fit and holds its room for its duration. Pure: the caller brings
//! the history and the seed, so a quote can be repeated, and runs the
//! samples where and for as long as it likes ([`Forecast::run`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::accounting::{copies, PendingShape};
use crate::capacity::tasks_on_node;
use crate::engine::WorkRates;
use crate::fleet::{Allocation, Fleet};
use crate::task::TaskShape;
use crate::units::MILLI_PER_GPU;

/// Most samples one forecast runs (a bound on a caller's request).
pub const MAX_SAMPLES: u32 = 10_000;

/// A running job, as the forecast sees it.
#[derive(Clone, Debug)]
pub struct Running {
    pub allocations: Vec<Allocation>,
    /// Index into [`History::finished_s`].
    pub class: usize,
    pub elapsed_s: u64,
    /// Seconds to its planned end, if it has one: used when no finished
    /// job of its class ran longer than it has.
    pub planned_remaining_s: Option<u64>,
}

/// A job that arrived in the recent window (competing work).
#[derive(Clone, Debug)]
pub struct Arrival {
    /// Seconds from the window's start.
    pub at_s: u64,
    pub shape: TaskShape,
    pub tasks: u32,
    pub duration_s: u64,
    /// Decided before the request when both wait (a higher priority):
    /// it takes freed room first. Otherwise it only takes room that is
    /// free when it arrives. Work queued now is always ahead.
    pub ahead: bool,
}

/// What the forecast samples from.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Run times of finished jobs, by class, each sorted ascending.
    pub finished_s: Vec<Vec<u64>>,
    /// Competing arrivals of the recent window.
    pub arrivals: Vec<Arrival>,
    pub window_s: u64,
}

/// The forecast's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Chance {
    pub samples: u32,
    /// Samples in which a copy started by the deadline.
    pub started: u32,
    pub probability: f64,
    /// The 95% Wilson interval of the probability (the spread the sample
    /// count leaves).
    pub low: f64,
    pub high: f64,
    /// The median start over the samples that started, seconds from now.
    pub median_start_s: Option<u64>,
    /// The mean work rate of the copy at its start, over the samples that
    /// started (1: the reference model inside one switch domain; see
    /// [`WorkRates`]); `None` when none started or no rates were given.
    pub rate: Option<f64>,
}

/// When one sample's copy started, and the best work rate a placement had
/// then.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Start {
    pub at_s: u64,
    pub rate: f64,
}

/// Seconds left of a job of a class with `finished` run times (sorted) that
/// has run `elapsed` s: a finished run time above it, drawn uniformly.
/// No job runs past its planned end (a duration, a time limit).
fn remaining(rng: &mut ChaCha8Rng, finished: &[u64], elapsed: u64, planned: Option<u64>) -> Option<u64> {
    let longer = finished.partition_point(|&d| d <= elapsed);
    if longer < finished.len() {
        let drawn = finished[rng.random_range(longer..finished.len())] - elapsed;
        Some(planned.map_or(drawn, |p| p.min(drawn)))
    } else {
        planned
    }
}

/// Takes room for `tasks` tasks of `shape` first-fit (all or none).
fn take(fleet: &mut Fleet, shape: &TaskShape, tasks: u32) -> Option<Vec<Allocation>> {
    let mut taken: Vec<Allocation> = Vec::new();
    'task: for _ in 0..tasks {
        for id in 0..fleet.nodes().len() {
            let node = &fleet.nodes()[id];
            if tasks_on_node(node, shape) == 0 {
                continue;
            }
            let mask = if shape.gpu_count == 0 {
                0
            } else if shape.gpu_milli < MILLI_PER_GPU {
                match node.gpus.iter().position(|&free| free >= shape.gpu_milli) {
                    Some(g) => 1u64 << g,
                    None => continue,
                }
            } else {
                let idle: Vec<usize> = (0..node.gpus.len()).filter(|&g| node.gpus[g] == MILLI_PER_GPU).take(shape.gpu_count as usize).collect();
                if idle.len() < shape.gpu_count as usize {
                    continue;
                }
                idle.iter().fold(0u64, |m, &g| m | 1 << g)
            };
            let a = Fleet::allocation(id as u32, shape, mask);
            if fleet.allocate(&a).is_ok() {
                taken.push(a);
                continue 'task;
            }
        }
        for a in &taken {
            fleet.release(a).expect("just allocated");
        }
        return None;
    }
    Some(taken)
}

/// Whether a copy of the request fits, kept up to date node by node as
/// room is taken and freed (a run checks it after every free).
struct Fits<'r> {
    request: &'r PendingShape,
    per_node: Vec<u32>,
    /// Tasks that fit, by switch domain (only for a same-domain gang).
    per_domain: std::collections::HashMap<u32, u64>,
    total: u64,
}

impl<'r> Fits<'r> {
    fn new(fleet: &Fleet, request: &'r PendingShape) -> Fits<'r> {
        let mut f = Fits { request, per_node: vec![0; fleet.nodes().len()], per_domain: Default::default(), total: 0 };
        for n in 0..fleet.nodes().len() {
            f.update(fleet, n);
        }
        f
    }

    fn update(&mut self, fleet: &Fleet, n: usize) {
        let node = &fleet.nodes()[n];
        let now = tasks_on_node(node, &self.request.shape);
        let was = std::mem::replace(&mut self.per_node[n], now);
        self.total = self.total + u64::from(now) - u64::from(was);
        if self.by_domain() {
            let d = self.per_domain.entry(node.switch_domain).or_insert(0);
            *d = *d + u64::from(now) - u64::from(was);
        }
    }

    fn by_domain(&self) -> bool {
        self.request.same_domain && self.request.tasks > 1
    }

    fn any(&self) -> bool {
        let tasks = u64::from(self.request.tasks.max(1));
        if self.by_domain() { self.per_domain.values().any(|&t| t >= tasks) } else { self.total >= tasks }
    }
}

/// The 95% Wilson interval of `k` successes in `n` trials.
fn wilson(k: u32, n: u32) -> (f64, f64) {
    let (n, p, z) = (f64::from(n), f64::from(k) / f64::from(n.max(1)), 1.96f64);
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / (1.0 + z * z / n);
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// Where the fleet stands when the quote is asked for.
#[derive(Clone, Copy, Debug)]
pub struct Now<'a> {
    pub fleet: &'a Fleet,
    pub running: &'a [Running],
    /// Work already waiting ahead of the request (`at_s` and `ahead`
    /// ignored): it takes room first.
    pub queued: &'a [Arrival],
    /// How fast a placement works (the expected rate of the copy); `None`:
    /// no rates.
    pub rates: Option<&'a WorkRates>,
}

/// The best work rate a copy of `request` placed on `fleet` now can have:
/// on the fastest accepted model with room for it, inside one switch
/// domain when one holds it (1.0 without rates).
pub fn start_rate(fleet: &Fleet, request: &PendingShape, rates: Option<&WorkRates>) -> f64 {
    let Some(rates) = rates else { return 1.0 };
    if request.shape.gpu_count == 0 {
        return rates.rate(None, 1);
    }
    let mut best: Option<f64> = None;
    for m in 0..fleet.models.len() as u32 {
        if !request.shape.accepts(Some(m)) {
            continue;
        }
        let on = |same_domain: bool| PendingShape { shape: TaskShape { models: vec![m], ..request.shape.clone() }, tasks: request.tasks, same_domain };
        let domains = if copies(fleet, &on(true), 1) > 0 {
            1
        } else if copies(fleet, &on(false), 1) > 0 {
            2
        } else {
            continue;
        };
        let r = rates.rate(Some(m), domains);
        best = Some(best.map_or(r, |b: f64| b.max(r)));
    }
    // Only a copy across models fits: as slow as the slowest of them.
    best.unwrap_or_else(|| (0..fleet.models.len() as u32).filter(|&m| request.shape.accepts(Some(m))).map(|m| rates.rate(Some(m), 2)).fold(1.0f64, f64::min))
}

/// One quote's samples: each [`Forecast::run`] is one run forward, seeded
/// by the quote's seed and the sample's index, so the caller may run them
/// in any order, on any threads, and stop when its time is up.
pub struct Forecast<'a> {
    now: Now<'a>,
    request: &'a PendingShape,
    history: &'a History,
    deadline_s: u64,
    seed: u64,
    /// Nothing ahead and a copy fits: every run starts now, at this rate.
    now_start: Option<Start>,
}

impl<'a> Forecast<'a> {
    pub fn new(now: Now<'a>, request: &'a PendingShape, history: &'a History, deadline_s: u64, seed: u64) -> Forecast<'a> {
        let now_start = (now.queued.is_empty() && copies(now.fleet, request, 1) > 0).then(|| Start { at_s: 0, rate: start_rate(now.fleet, request, now.rates) });
        Forecast { now, request, history, deadline_s, seed, now_start }
    }

    /// Sample `i`: when a copy first fits, if by the deadline.
    pub fn run(&self, i: u32) -> Option<Start> {
        if let Some(s) = self.now_start {
            return Some(s);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        one_run(self.now, self.request, self.history, self.deadline_s, &mut rng)
    }
}

/// The answer from the runs that were made (`samples` of them, `starts`
/// those that started, in any order).
pub fn summarize(samples: u32, mut starts: Vec<Start>) -> Chance {
    let samples = samples.max(1);
    let started = starts.len() as u32;
    // Sorted first: the same runs give the same answer in any order.
    starts.sort_by(|a, b| a.at_s.cmp(&b.at_s).then(a.rate.total_cmp(&b.rate)));
    let (low, high) = wilson(started, samples);
    let rate = (started > 0).then(|| starts.iter().map(|s| s.rate).sum::<f64>() / f64::from(started));
    Chance { samples, started, probability: f64::from(started) / f64::from(samples), low, high, median_start_s: starts.get(starts.len() / 2).map(|s| s.at_s), rate }
}

/// The chance that one copy of `request` starts within `deadline_s` from
/// `now`, over `samples` runs forward (at most [`MAX_SAMPLES`]) seeded by
/// `seed`.
pub fn chance(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64) -> Chance {
    let samples = samples.clamp(1, MAX_SAMPLES);
    let forecast = Forecast::new(now, request, history, deadline_s, seed);
    summarize(samples, (0..samples).filter_map(|i| forecast.run(i)).collect())
}

/// One run forward: when a copy first fits, if by the deadline.
fn one_run(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, rng: &mut ChaCha8Rng) -> Option<Start> {
    let Now { fleet, running, queued, rates } = now;
    #[derive(Clone, Copy)]
    enum What {
        /// Running job k ends.
        Free(usize),
        /// Arrival k of the window comes.
        Arrive(usize),
        /// Competing work placed in this run (held[k]) ends.
        Leave(usize),
    }
    // (time, order, index into `whats`), earliest first.
    let mut events: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut whats: Vec<What> = Vec::new();
    let push = |events: &mut BinaryHeap<Reverse<(u64, u64, usize)>>, whats: &mut Vec<What>, at: u64, what: What| {
        whats.push(what);
        events.push(Reverse((at, whats.len() as u64, whats.len() - 1)));
    };
    for (k, r) in running.iter().enumerate() {
        let finished = history.finished_s.get(r.class).map_or(&[][..], |f| f.as_slice());
        if let Some(left) = remaining(rng, finished, r.elapsed_s, r.planned_remaining_s)
            && left <= deadline_s
        {
            push(&mut events, &mut whats, left, What::Free(k));
        }
    }
    if history.window_s > 0 && !history.arrivals.is_empty() {
        let phase = rng.random_range(0..history.window_s);
        for (k, a) in history.arrivals.iter().enumerate() {
            let at = (a.at_s % history.window_s + history.window_s - phase) % history.window_s;
            if at <= deadline_s {
                push(&mut events, &mut whats, at, What::Arrive(k));
            }
        }
    }
    let mut scratch = fleet.clone();
    let mut fits = Fits::new(&scratch, request);
    let mut held: Vec<Vec<Allocation>> = Vec::new();
    // Waiting competing work, in arrival order: ahead of the request (what
    // was queued now, then higher-priority arrivals), and behind it.
    // Each with whether it is new (not yet tried against the whole fleet).
    let mut ahead: Vec<(&Arrival, bool)> = queued.iter().map(|a| (a, true)).collect();
    let mut behind: Vec<(&Arrival, bool)> = Vec::new();
    let mut at: u64 = 0;
    // Nodes freed since the waiting work last tried (all at the start):
    // work that did not fit before can only fit now on one of them.
    let mut freed: Vec<u32> = (0..fleet.nodes().len() as u32).collect();
    // Shapes that found no room since the last free: the next arrival of
    // the same shape need not look.
    let mut no_room: Vec<(&TaskShape, u32)> = Vec::new();
    // Takes room for the waiting work that fits (each in order).
    let place = |scratch: &mut Fleet, fits: &mut Fits, waiting: &mut Vec<(&Arrival, bool)>, held: &mut Vec<Vec<Allocation>>, events: &mut BinaryHeap<Reverse<(u64, u64, usize)>>, whats: &mut Vec<What>, freed: &[u32], at: u64| {
        let mut k = 0;
        while k < waiting.len() {
            let (a, new) = waiting[k];
            let may = new || freed.iter().any(|&n| tasks_on_node(&scratch.nodes()[n as usize], &a.shape) > 0);
            match may.then(|| take(scratch, &a.shape, a.tasks.max(1))).flatten() {
                Some(allocs) => {
                    for x in &allocs {
                        fits.update(scratch, x.node as usize);
                    }
                    held.push(allocs);
                    let leave = at.saturating_add(a.duration_s.max(1));
                    if leave <= deadline_s {
                        push(events, whats, leave, What::Leave(held.len() - 1));
                    }
                    waiting.remove(k);
                }
                None => {
                    waiting[k].1 = false;
                    k += 1
                }
            }
        }
    };
    let mut arrived: Vec<&Arrival> = Vec::new();
    loop {
        if !freed.is_empty() {
            // Work that came now waits in its place, behind what waited.
            for a in arrived.drain(..) {
                if a.ahead { ahead.push((a, true)) } else { behind.push((a, true)) }
            }
            no_room.clear();
            place(&mut scratch, &mut fits, &mut ahead, &mut held, &mut events, &mut whats, &freed, at);
            debug_assert_eq!(fits.any(), copies(&scratch, request, 1) > 0);
            if fits.any() {
                return Some(Start { at_s: at, rate: start_rate(&scratch, request, rates) });
            }
            place(&mut scratch, &mut fits, &mut behind, &mut held, &mut events, &mut whats, &freed, at);
            freed.clear();
        } else {
            // Nothing freed: the request still does not fit; what came now
            // takes free room if it fits, else waits.
            for a in arrived.drain(..) {
                let key = (&a.shape, a.tasks);
                let taken = if no_room.contains(&key) { None } else { take(&mut scratch, &a.shape, a.tasks.max(1)) };
                match taken {
                    Some(allocs) => {
                        for x in &allocs {
                            fits.update(&scratch, x.node as usize);
                        }
                        held.push(allocs);
                        let leave = at.saturating_add(a.duration_s.max(1));
                        if leave <= deadline_s {
                            push(&mut events, &mut whats, leave, What::Leave(held.len() - 1));
                        }
                    }
                    None => {
                        if !no_room.contains(&key) {
                            no_room.push(key);
                        }
                        if a.ahead { ahead.push((a, false)) } else { behind.push((a, false)) }
                    }
                }
            }
        }
        let &Reverse((next, _, _)) = events.peek()?;
        at = next;
        // Everything at this moment.
        while let Some(&Reverse((t, _, w))) = events.peek() {
            if t != at {
                break;
            }
            events.pop();
            let gone = match whats[w] {
                What::Free(k) => &running[k].allocations,
                What::Arrive(k) => {
                    arrived.push(&history.arrivals[k]);
                    continue;
                }
                What::Leave(h) => &held[h],
            };
            for a in gone {
                if scratch.release(a).is_ok() {
                    fits.update(&scratch, a.node as usize);
                    freed.push(a.node);
                }
            }
        }
    }
}
