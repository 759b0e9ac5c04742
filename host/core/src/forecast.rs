//! Quotes with a probability: the chance that one copy of a shape starts by
//! a deadline, found by running the fleet forward many times. In each
//! sample, every running job ends after a remaining time drawn from the
//! finished jobs of its class that ran longer than it has so far (its
//! planned end when none did), and competing work arrives as it did in a
//! recent window, replayed from a random phase; competing work takes room
//! first-fit when it arrives, and holds it for its duration. Pure: the
//! caller brings the history and the seed, so a quote can be repeated.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::accounting::{copies, PendingShape};
use crate::capacity::tasks_on_node;
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
}

/// Seconds left of a job of a class with `finished` run times (sorted) that
/// has run `elapsed` s: a finished run time above it, drawn uniformly.
fn remaining(rng: &mut ChaCha8Rng, finished: &[u64], elapsed: u64, planned: Option<u64>) -> Option<u64> {
    let longer = finished.partition_point(|&d| d <= elapsed);
    if longer < finished.len() {
        Some(finished[rng.random_range(longer..finished.len())] - elapsed)
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
    /// Work already waiting ahead of the request (`at_s` ignored): it takes
    /// room first, as do arrivals.
    pub queued: &'a [Arrival],
}

/// The chance that one copy of `request` starts within `deadline_s` from
/// `now`, over `samples` runs forward (at most [`MAX_SAMPLES`]) seeded by
/// `seed`.
pub fn chance(now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64) -> Chance {
    let Now { fleet, running, queued } = now;
    let samples = samples.clamp(1, MAX_SAMPLES);
    let mut starts: Vec<u64> = Vec::new();
    if queued.is_empty() && copies(fleet, request, 1) > 0 {
        // Nothing ahead of it, and it fits: it starts now in every run.
        starts = vec![0; samples as usize];
    } else {
        for i in 0..samples {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            if let Some(t) = one_run(fleet, request, running, queued, history, deadline_s, &mut rng) {
                starts.push(t);
            }
        }
    }
    let started = starts.len() as u32;
    starts.sort_unstable();
    let (low, high) = wilson(started, samples);
    Chance { samples, started, probability: f64::from(started) / f64::from(samples), low, high, median_start_s: starts.get(starts.len() / 2).copied() }
}

/// One run forward: when a copy first fits, if by the deadline.
fn one_run(fleet: &Fleet, request: &PendingShape, running: &[Running], queued: &[Arrival], history: &History, deadline_s: u64, rng: &mut ChaCha8Rng) -> Option<u64> {
    #[derive(Clone, Copy)]
    enum What {
        /// Running job k ends.
        Free(usize),
        /// Arrival k of the window joins the queue.
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
    let mut held: Vec<Vec<Allocation>> = Vec::new();
    // Competing work waiting for room, in arrival order: what was queued
    // now, then the window's arrivals.
    let mut waiting: Vec<&Arrival> = queued.iter().collect();
    let mut at: u64 = 0;
    loop {
        // Waiting work takes room first (each that fits, in order), then
        // the request's turn.
        let mut k = 0;
        while k < waiting.len() {
            let a = waiting[k];
            match take(&mut scratch, &a.shape, a.tasks.max(1)) {
                Some(allocs) => {
                    held.push(allocs);
                    let leave = at.saturating_add(a.duration_s.max(1));
                    if leave <= deadline_s {
                        push(&mut events, &mut whats, leave, What::Leave(held.len() - 1));
                    }
                    waiting.remove(k);
                }
                None => k += 1,
            }
        }
        if copies(&scratch, request, 1) > 0 {
            return Some(at);
        }
        let &Reverse((next, _, _)) = events.peek()?;
        at = next;
        // Everything at this moment.
        while let Some(&Reverse((t, _, w))) = events.peek() {
            if t != at {
                break;
            }
            events.pop();
            match whats[w] {
                What::Free(k) => {
                    for a in &running[k].allocations {
                        let _ = scratch.release(a);
                    }
                }
                What::Arrive(k) => waiting.push(&history.arrivals[k]),
                What::Leave(h) => {
                    for a in &held[h] {
                        let _ = scratch.release(a);
                    }
                }
            }
        }
    }
}
