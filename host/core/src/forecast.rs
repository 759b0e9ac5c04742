//! Quotes with a probability: the chance that one copy of a shape starts by
//! a deadline, found by running the fleet forward many times. In each
//! sample, every running job ends after a remaining time drawn from the
//! finished jobs of its class that did more work than it has (capped by its
//! planned end; the planned end when none did), and competing work arrives
//! as it did in a recent window, replayed from a random phase (and again
//! each window until the deadline). Work ahead of the request (queued now,
//! or arriving at a higher priority) takes freed room before it; work
//! behind it takes room that is free when it comes (the request did not fit
//! then) and, waiting, room freed that the request could not use.
//! Competing work is placed best-fit (the node with the fewest GPUs free)
//! and holds its room for its run time. With work rates, run times are
//! compared as work (seconds at the reference rate): a job on a GPU model
//! at half speed, or a gang across switch domains, runs longer for the same
//! work, and a class's history mixes placements of every speed (left as
//! seconds, jobs on slow models were quoted to end as soon as fast ones,
//! and quotes for them came out optimistic). Pure: the caller brings
//! the history and the seed, so a quote can be repeated, and runs the
//! samples where and for as long as it likes ([`Forecast::run`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

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
    /// Its run time in seconds; with `class`, its work instead.
    pub duration_s: u64,
    /// When its run time is not known (it waits, or still runs): each run
    /// draws its work from this class's and runs it at the rate of where it
    /// was placed (`duration_s` where the draw lies past every finished run).
    pub class: Option<usize>,
    /// Decided before the request when both wait (a higher priority):
    /// it takes freed room first. Otherwise it takes room that is free when
    /// it arrives, or freed room the request could not use. Work queued now
    /// is always ahead.
    pub ahead: bool,
}

/// What the forecast samples from.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// The work finished jobs did, by class (any order): seconds at the
    /// reference rate (run seconds x the run's rate; plain run seconds
    /// without rates). A class's draws for waiting work are work too.
    pub finished_s: Vec<Vec<u64>>,
    /// Competing arrivals of the recent window.
    pub arrivals: Vec<Arrival>,
    pub window_s: u64,
}

impl History {
    /// Counts a finished run of `work_s` (seconds at the reference rate)
    /// in `class`.
    pub fn add_finished(&mut self, class: usize, work_s: u64) {
        if self.finished_s.len() <= class {
            self.finished_s.resize(class + 1, Vec::new());
        }
        self.finished_s[class].push(work_s);
    }
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
    /// [`WorkRates`]; 1 without rates); `None` when none started.
    pub rate: Option<f64>,
}

/// When one sample's copy started, and the best work rate a placement had
/// then.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Start {
    pub at_s: u64,
    pub rate: f64,
}

/// How long jobs of one class run, from the finished ones and, as runs
/// known to last at least as long as they have so far, the running ones
/// (Kaplan-Meier): finished jobs alone would say jobs are short, since
/// the long ones of a recent history are still running.
#[derive(Clone, Debug, Default)]
pub struct Survival {
    /// Distinct run times at which jobs finished, ascending, and the
    /// share of jobs still running just after each.
    times: Vec<u64>,
    alive: Vec<f64>,
}

impl Survival {
    pub fn new(finished: &[u64], running: &[u64]) -> Survival {
        let mut finished = finished.to_vec();
        let mut running = running.to_vec();
        finished.sort_unstable();
        running.sort_unstable();
        let mut at_risk = finished.len() + running.len();
        let (mut i, mut r) = (0, 0);
        let mut s = Survival::default();
        let mut alive = 1.0;
        while i < finished.len() {
            let t = finished[i];
            // Runs still going that stopped being watched before t are no
            // longer at risk.
            while r < running.len() && running[r] < t {
                at_risk -= 1;
                r += 1;
            }
            let ended = finished[i..].partition_point(|&d| d == t);
            alive *= 1.0 - ended as f64 / at_risk as f64;
            s.times.push(t);
            s.alive.push(alive);
            at_risk -= ended;
            i += ended;
        }
        s
    }

    /// The share of runs that last longer than `t`.
    pub fn beyond(&self, t: u64) -> f64 {
        match self.times.partition_point(|&d| d <= t) {
            0 => 1.0,
            k => self.alive[k - 1],
        }
    }

    /// A run time drawn among those longer than `elapsed` (`u` uniform in
    /// (0, 1]); `None` when it lies past every finished run.
    fn draw_beyond(&self, elapsed: u64, u: f64) -> Option<u64> {
        let target = self.beyond(elapsed) * u;
        let from = self.times.partition_point(|&d| d <= elapsed);
        let k = from + self.alive[from..].partition_point(|&a| a > target);
        self.times.get(k).copied()
    }

    /// The median run time, if half of the runs finished.
    pub fn median(&self) -> Option<u64> {
        self.alive.iter().position(|&a| a <= 0.5).map(|k| self.times[k])
    }
}

/// Seconds left of a job of a class that has run `elapsed` seconds at
/// `rate`, drawn from the class's runs that did more work than that; no
/// job runs past its planned end (a duration, a time limit), which also
/// stands in when no run did more.
fn remaining(rng: &mut ChaCha8Rng, class: &Survival, elapsed: u64, rate: f64, planned: Option<u64>) -> Option<u64> {
    let u = 1.0 - rng.random::<f64>();
    let done = work_of(elapsed, rate);
    match class.draw_beyond(done, u) {
        Some(d) => {
            let left = seconds_of(d - done, rate);
            Some(planned.map_or(left, |p| p.min(left)))
        }
        None => planned,
    }
}

/// Work (seconds at the reference rate) done in `seconds` at `rate`.
pub fn work_of(seconds: u64, rate: f64) -> u64 {
    if rate == 1.0 { seconds } else { (seconds as f64 * rate).round() as u64 }
}

/// Seconds `work` takes at `rate`.
fn seconds_of(work: u64, rate: f64) -> u64 {
    if rate == 1.0 { work } else { (work as f64 / rate).ceil() as u64 }
}

/// The work rate of each running job's run (1 without rates).
pub fn run_rates(fleet: &Fleet, running: &[Running], rates: Option<&WorkRates>) -> Vec<f64> {
    running.iter().map(|r| rates.map_or(1.0, |w| w.of_run(fleet, &r.allocations))).collect()
}

/// Takes room for `tasks` tasks of `shape` (all or none), each on the
/// node it fits with the fewest GPUs free (ties: the first): the packing
/// the bundled placement policies do, which keeps whole nodes whole.
fn take(fleet: &mut Fleet, shape: &TaskShape, tasks: u32) -> Option<Vec<Allocation>> {
    let mut taken: Vec<Allocation> = Vec::new();
    for _ in 0..tasks {
        // From the free summaries; a node itself is read only when it
        // would be the best so far.
        let mut best: Option<(u32, usize)> = None;
        for (id, free) in fleet.free_summaries().iter().enumerate() {
            if free.may_fit(shape) && best.is_none_or(|(b, _)| free.gpu_free_milli < b) && tasks_on_node(&fleet.nodes()[id], shape) > 0 {
                best = Some((free.gpu_free_milli, id));
            }
        }
        let best = best.map(|(_, id)| id);
        let allocated = best.and_then(|id| {
            let node = &fleet.nodes()[id];
            let mask = if shape.gpu_count == 0 {
                0
            } else if shape.gpu_milli < MILLI_PER_GPU {
                // The fullest GPU that still has room.
                let g = (0..node.gpus.len()).filter(|&g| node.gpus[g] >= shape.gpu_milli).min_by_key(|&g| node.gpus[g])?;
                1u64 << g
            } else {
                let idle: Vec<usize> = (0..node.gpus.len()).filter(|&g| node.gpus[g] == MILLI_PER_GPU).take(shape.gpu_count as usize).collect();
                if idle.len() < shape.gpu_count as usize {
                    return None;
                }
                idle.iter().fold(0u64, |m, &g| m | 1 << g)
            };
            let a = Fleet::allocation(id as u32, shape, mask);
            fleet.allocate(&a).ok().map(|_| a)
        });
        match allocated {
            Some(a) => taken.push(a),
            None => {
                for a in &taken {
                    fleet.release(a).expect("just allocated");
                }
                return None;
            }
        }
    }
    Some(taken)
}

/// Competing work waiting, by shape (first come first within each), tried
/// in the order it joined this queue.
struct Queue<'w> {
    by_shape: Vec<VecDeque<(u64, &'w Arrival)>>,
    /// Shapes given work since they last tried: tried against the whole
    /// fleet, not only the freed nodes.
    fresh: Vec<bool>,
    /// Shapes with work waiting (and some emptied since), each once.
    active: Vec<u32>,
    listed: Vec<bool>,
    seq: u64,
}

impl<'w> Queue<'w> {
    fn new(shapes: usize) -> Queue<'w> {
        Queue { by_shape: vec![VecDeque::new(); shapes], fresh: vec![false; shapes], active: Vec::new(), listed: vec![false; shapes], seq: 0 }
    }

    fn push(&mut self, work: &'w Arrival, shape: u32) {
        if !std::mem::replace(&mut self.listed[shape as usize], true) {
            self.active.push(shape);
        }
        self.by_shape[shape as usize].push_back((self.seq, work));
        self.seq += 1;
        self.fresh[shape as usize] = true;
    }

    /// Starts the waiting work that fits, in the order it came, on `fleet`
    /// after the nodes `freed` gained room; `no_room` remembers shapes
    /// that found none in this `step` (room only shrinks within one).
    fn place(&mut self, fleet: &mut Fleet, freed: &[u32], no_room: &mut [u32], step: u32, start: &mut dyn FnMut(&mut Fleet, &'w Arrival) -> bool) {
        let (by_shape, listed) = (&self.by_shape, &mut self.listed);
        self.active.retain(|&s| {
            let keep = !by_shape[s as usize].is_empty();
            listed[s as usize] = keep;
            keep
        });
        let mut heads: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        for &s in &self.active {
            let id = s as usize;
            let (seq, first) = self.by_shape[id][0];
            // Work that did not fit before can only fit where room came.
            let may = no_room[id] != step && (self.fresh[id] || freed.iter().any(|&n| tasks_on_node(&fleet.nodes()[n as usize], &first.shape) > 0));
            self.fresh[id] = false;
            if may {
                heads.push(Reverse((seq, s)));
            }
        }
        while let Some(Reverse((_, s))) = heads.pop() {
            let id = s as usize;
            let (_, work) = self.by_shape[id][0];
            if start(fleet, work) {
                self.by_shape[id].pop_front();
                if let Some(&(seq, _)) = self.by_shape[id].front() {
                    heads.push(Reverse((seq, s)));
                }
            } else {
                no_room[id] = step;
            }
        }
    }
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
    best.unwrap_or_else(|| (0..fleet.models.len() as u32).filter(|&m| request.shape.accepts(Some(m))).map(|m| rates.rate(Some(m), 2)).reduce(f64::min).unwrap_or(1.0))
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
    /// Work by class: the finished jobs', and the running ones' as at
    /// least what they have done.
    survival: Vec<Survival>,
    /// Each running job's work rate.
    run_rates: Vec<f64>,
    /// Competing work's (shape, tasks), interned: queues hold many jobs of
    /// few shapes, and a run remembers per shape what found no room.
    shapes: Shapes,
}

/// Shape ids of the queued work and of the window's arrivals, and the
/// number of distinct (shape, tasks).
struct Shapes {
    queued: Vec<u32>,
    arrivals: Vec<u32>,
    count: usize,
}

impl Shapes {
    fn new<'x>(queued: &'x [Arrival], arrivals: &'x [Arrival]) -> Shapes {
        let mut ids: std::collections::HashMap<(&'x TaskShape, u32), u32> = Default::default();
        let mut id = |a: &'x Arrival| -> u32 {
            let next = ids.len() as u32;
            *ids.entry((&a.shape, a.tasks.max(1))).or_insert(next)
        };
        let queued = queued.iter().map(&mut id).collect();
        let arrivals = arrivals.iter().map(&mut id).collect();
        Shapes { queued, arrivals, count: ids.len() }
    }
}

impl<'a> Forecast<'a> {
    pub fn new(now: Now<'a>, request: &'a PendingShape, history: &'a History, deadline_s: u64, seed: u64) -> Forecast<'a> {
        let now_start = (now.queued.is_empty() && copies(now.fleet, request, 1) > 0).then(|| Start { at_s: 0, rate: start_rate(now.fleet, request, now.rates) });
        let shapes = Shapes::new(now.queued, &history.arrivals);
        let run_rates = run_rates(now.fleet, now.running, now.rates);
        Forecast { now, request, history, deadline_s, seed, now_start, survival: survival(history, now.running, &run_rates), run_rates, shapes }
    }

    /// Sample `i`: when a copy first fits, if by the deadline.
    pub fn run(&self, i: u32) -> Option<Start> {
        if let Some(s) = self.now_start {
            return Some(s);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        one_run(self, &mut rng)
    }
}

/// Each class's [`Survival`] (of work) from `history` and the jobs
/// `running` now at their `run_rates` ([`run_rates`]).
pub fn survival(history: &History, running: &[Running], run_rates: &[f64]) -> Vec<Survival> {
    let classes = running.iter().map(|r| r.class + 1).max().unwrap_or(0).max(history.finished_s.len());
    let mut elapsed: Vec<Vec<u64>> = vec![Vec::new(); classes];
    for (k, r) in running.iter().enumerate() {
        elapsed[r.class].push(work_of(r.elapsed_s, run_rates.get(k).copied().unwrap_or(1.0)));
    }
    (0..classes).map(|c| Survival::new(history.finished_s.get(c).map_or(&[], |f| f.as_slice()), &elapsed[c])).collect()
}

/// The answer from the runs that were made (`samples` of them, `starts`
/// those that started, in any order).
pub fn summarize(samples: u32, starts: Vec<Start>) -> Chance {
    Runs::new(samples, starts).chance()
}

/// The runs forward of one quote: how many were made and when the copy
/// started in those where it did. One set of runs to a deadline answers
/// for every earlier deadline too ([`Runs::within`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Runs {
    pub samples: u32,
    /// Earliest first (the same runs give the same answer in any order).
    pub starts: Vec<Start>,
}

impl Runs {
    pub fn new(samples: u32, mut starts: Vec<Start>) -> Runs {
        starts.sort_by(|a, b| a.at_s.cmp(&b.at_s).then(a.rate.total_cmp(&b.rate)));
        Runs { samples: samples.max(1), starts }
    }

    /// The answer over every start the runs found.
    pub fn chance(&self) -> Chance {
        let started = self.starts.len() as u32;
        let (low, high) = wilson(started, self.samples);
        let rate = (started > 0).then(|| self.starts.iter().map(|s| s.rate).sum::<f64>() / f64::from(started));
        Chance {
            samples: self.samples,
            started,
            probability: f64::from(started) / f64::from(self.samples),
            low,
            high,
            median_start_s: self.starts.get(self.starts.len() / 2).map(|s| s.at_s),
            rate,
        }
    }

    /// The answer for an earlier deadline: the runs whose copy started by
    /// `deadline_s` (a deadline past the one the runs were made to answers
    /// as that one).
    pub fn within(&self, deadline_s: u64) -> Chance {
        let by = self.starts.partition_point(|s| s.at_s <= deadline_s);
        Runs { samples: self.samples, starts: self.starts[..by].to_vec() }.chance()
    }

    /// The deadline at which the runs say `quantile` (in (0, 1]): the start
    /// of the run at that rank, or `longest` when fewer runs started. Used
    /// to check a quote across its whole spread of start times, not only at
    /// the deadline asked.
    pub fn deadline_at(&self, quantile: f64, longest: u64) -> u64 {
        let rank = (quantile.clamp(0.0, 1.0) * f64::from(self.samples)).ceil().max(1.0) as usize;
        self.starts.get(rank - 1).map_or(longest, |s| s.at_s.min(longest))
    }
}

/// The runs forward of a quote: `samples` of them (at most
/// [`MAX_SAMPLES`]) to `deadline_s`, seeded by `seed`.
pub fn runs(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64) -> Runs {
    let samples = samples.clamp(1, MAX_SAMPLES);
    let forecast = Forecast::new(now, request, history, deadline_s, seed);
    Runs::new(samples, (0..samples).filter_map(|i| forecast.run(i)).collect())
}

/// The chance that one copy of `request` starts within `deadline_s` from
/// `now`, over `samples` runs forward (at most [`MAX_SAMPLES`]) seeded by
/// `seed`.
pub fn chance(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64) -> Chance {
    runs(now, request, history, deadline_s, samples, seed).chance()
}

/// One run forward: when a copy first fits, if by the deadline.
fn one_run(f: &Forecast<'_>, rng: &mut ChaCha8Rng) -> Option<Start> {
    let Now { fleet, running, queued, rates } = f.now;
    let (request, history, survival, deadline_s) = (f.request, f.history, &f.survival, f.deadline_s);
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
    let none = Survival::default();
    for (k, r) in running.iter().enumerate() {
        let class = survival.get(r.class).unwrap_or(&none);
        if let Some(left) = remaining(rng, class, r.elapsed_s, f.run_rates[k], r.planned_remaining_s)
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
    // Seconds of run for work placed at `allocs`: a class's draw is work
    // (its `duration_s` stands in as work where the draw lies past every
    // finished run); a known run time is seconds already.
    let run_time = |a: &Arrival, rng: &mut ChaCha8Rng, scratch: &Fleet, allocs: &[Allocation]| match a.class {
        Some(c) => {
            let work = survival.get(c).and_then(|s| s.draw_beyond(0, 1.0 - rng.random::<f64>())).unwrap_or(a.duration_s);
            seconds_of(work, rates.map_or(1.0, |w| w.of_run(scratch, allocs)))
        }
        None => a.duration_s,
    };
    let mut scratch = fleet.clone();
    let mut fits = Fits::new(&scratch, request);
    let mut held: Vec<Vec<Allocation>> = Vec::new();
    // Waiting competing work: ahead of the request (what was queued now,
    // then higher-priority arrivals), and behind it.
    let mut ahead = Queue::new(f.shapes.count);
    let mut behind = Queue::new(f.shapes.count);
    for (work, &shape) in queued.iter().zip(&f.shapes.queued) {
        ahead.push(work, shape);
    }
    let mut arrived: Vec<(&Arrival, u32)> = Vec::new();
    let mut at: u64 = 0;
    // Nodes freed since the waiting work last tried (all at the start):
    // work that did not fit before can only fit now on one of them.
    let mut freed: Vec<u32> = (0..fleet.nodes().len() as u32).collect();
    // Per shape, stamped with the step it holds for (room only shrinks
    // within a step): found no room.
    let mut step: u32 = 1;
    let mut no_room: Vec<u32> = vec![0; f.shapes.count];
    // Takes room for `work` if it fits, and plans its leaving.
    let start = |scratch: &mut Fleet, fits: &mut Fits, held: &mut Vec<Vec<Allocation>>, events: &mut BinaryHeap<Reverse<(u64, u64, usize)>>, whats: &mut Vec<What>, work: &Arrival, at: u64, rng: &mut ChaCha8Rng| -> bool {
        let Some(allocs) = take(scratch, &work.shape, work.tasks.max(1)) else { return false };
        for x in &allocs {
            fits.update(scratch, x.node as usize);
        }
        let leave = at.saturating_add(run_time(work, rng, scratch, &allocs).max(1));
        held.push(allocs);
        if leave <= deadline_s {
            push(events, whats, leave, What::Leave(held.len() - 1));
        }
        true
    };
    loop {
        if !freed.is_empty() {
            // Work that came now waits in its place, behind what waited.
            for (w, shape) in arrived.drain(..) {
                if w.ahead { ahead.push(w, shape) } else { behind.push(w, shape) }
            }
            ahead.place(&mut scratch, &freed, &mut no_room, step, &mut |sc, work| start(sc, &mut fits, &mut held, &mut events, &mut whats, work, at, rng));
            debug_assert_eq!(fits.any(), copies(&scratch, request, 1) > 0);
            if fits.any() {
                return Some(Start { at_s: at, rate: start_rate(&scratch, request, rates) });
            }
            behind.place(&mut scratch, &freed, &mut no_room, step, &mut |sc, work| start(sc, &mut fits, &mut held, &mut events, &mut whats, work, at, rng));
            freed.clear();
        } else {
            // Nothing freed: the request still does not fit; what came now
            // takes free room if it fits, else waits.
            for (w, shape) in arrived.drain(..) {
                let id = shape as usize;
                if no_room[id] == step || !start(&mut scratch, &mut fits, &mut held, &mut events, &mut whats, w, at, rng) {
                    no_room[id] = step;
                    if w.ahead { ahead.push(w, shape) } else { behind.push(w, shape) }
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
                    arrived.push((&history.arrivals[k], f.shapes.arrivals[k]));
                    // The window comes again until the deadline.
                    let again = at.saturating_add(history.window_s);
                    if again <= deadline_s {
                        push(&mut events, &mut whats, again, What::Arrive(k));
                    }
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
        // Room freed: what found none may find some now.
        if !freed.is_empty() {
            step += 1;
        }
    }
}
