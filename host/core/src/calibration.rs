//! Checking quotes against what happened: a replay where, at random
//! moments, a caller asks the chance that one copy of a shape starts by a
//! deadline ([`crate::forecast`]) from what the host would know then (the
//! running work, the queue, finished jobs and the last window's arrivals,
//! never the replay's future), and then submits that copy as a short job.
//! The quote is right as often as it says when, among quotes that said p,
//! a fraction p of the copies started in time: the reliability table and
//! the Brier score measure that.
//!
//! Quotes at deadlines drawn from a list are mostly sure (a copy that fits
//! now, or a shape that waits for hours), so few land between 0.1 and 0.9.
//! Each quote is therefore also checked at a second deadline, read off its
//! own runs: the start time at a random rank among them (the deadline at
//! which the quote says a uniformly drawn probability). A forecast whose
//! spread of start times is right is right there too, and the quotes whose
//! start is uncertain fill every decile.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::accounting::PendingShape;
use crate::engine::{Deciders, Engine, SimConfig};
use crate::fleet::Fleet;
use crate::forecast::{run_rates, runs, survival, Arrival, History, Now, Running, Runs};
use crate::job::Job;
use crate::policy::PolicyError;
use crate::sim::simulate_watched;

/// One quote asked during the replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    pub at_s: u64,
    pub request: PendingShape,
    pub priority: u32,
    pub deadline_s: u64,
    /// The rank, in (0, 1], of the run whose start sets the quote's second
    /// deadline ([`Runs::deadline_at`]).
    pub spread: f64,
}

/// How the probes are drawn and quoted.
#[derive(Clone, Debug)]
pub struct Settings {
    pub quotes: u32,
    /// Quotes are asked in [from_s, to_s - the longest deadline).
    pub from_s: u64,
    pub to_s: u64,
    /// Deadlines to draw from, seconds.
    pub deadlines_s: Vec<u64>,
    /// Samples per quote, and the arrival window the quotes replay.
    pub samples: u32,
    pub window_s: u64,
    /// How long each probe's copy runs once started (short: it takes
    /// little room from the work being replayed).
    pub probe_run_s: u64,
    pub seed: u64,
}

/// A quote and what then happened.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Checked {
    pub at_s: u64,
    pub tasks: u32,
    pub gpus_per_task: u32,
    pub priority: u32,
    pub deadline_s: u64,
    pub probability: f64,
    /// Runs forward the quote made.
    pub samples: u32,
    pub low: f64,
    pub high: f64,
    /// When the copy started (seconds after the quote), if it did.
    pub started_after_s: Option<u64>,
    pub on_time: bool,
    /// The second check: the deadline read off the quote's runs, what the
    /// runs said for it, and whether the copy started by then.
    pub spread_deadline_s: u64,
    pub spread_probability: f64,
    pub spread_on_time: bool,
}

/// Quotes whose probability fell in [from, to): their mean prediction
/// and the fraction that started in time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bucket {
    pub from: f64,
    pub to: f64,
    pub quotes: u32,
    pub predicted: f64,
    pub observed: f64,
}

/// The reliability of a replay's quotes: at the deadlines asked (the
/// top-level table) and at the deadlines read off each quote's runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    pub quotes: Vec<Checked>,
    #[serde(flatten)]
    pub asked: Reliability,
    pub at_spread: Reliability,
    pub samples: u32,
}

/// Predicted probabilities against what happened.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Reliability {
    /// Ten deciles of predicted probability (the last includes 1.0).
    pub buckets: Vec<Bucket>,
    /// Mean squared error of the probabilities against the 0/1 outcomes
    /// (0 is perfect; always saying 0.5 scores 0.25).
    pub brier: f64,
    /// The Brier score of always saying the base rate (the fraction on
    /// time): what a quote that knows nothing of the moment scores.
    pub brier_base_rate: f64,
    /// The fraction on time.
    pub base_rate: f64,
}

impl Reliability {
    /// Of (predicted probability, came true) pairs.
    pub fn of(said: &[(f64, bool)]) -> Reliability {
        let n = said.len().max(1) as f64;
        let outcome = |t: bool| if t { 1.0 } else { 0.0 };
        let brier = said.iter().map(|&(p, t)| (p - outcome(t)).powi(2)).sum::<f64>() / n;
        let base_rate = said.iter().map(|&(_, t)| outcome(t)).sum::<f64>() / n;
        let brier_base_rate = said.iter().map(|&(_, t)| (base_rate - outcome(t)).powi(2)).sum::<f64>() / n;
        let buckets = (0..10)
            .map(|d| {
                let (from, to) = (f64::from(d) / 10.0, f64::from(d + 1) / 10.0);
                let inside: Vec<(f64, bool)> = said.iter().copied().filter(|&(p, _)| p >= from && (p < to || (d == 9 && p <= 1.0))).collect();
                let k = inside.len().max(1) as f64;
                Bucket {
                    from,
                    to,
                    quotes: inside.len() as u32,
                    predicted: inside.iter().map(|&(p, _)| p).sum::<f64>() / k,
                    observed: inside.iter().map(|&(_, t)| outcome(t)).sum::<f64>() / k,
                }
            })
            .collect();
        Reliability { buckets, brier, brier_base_rate, base_rate }
    }

    /// The largest gap between predicted and observed over the deciles
    /// with at least `min_quotes` quotes (`None`: no such decile).
    pub fn worst_gap(&self, min_quotes: u32) -> Option<f64> {
        self.buckets.iter().filter(|b| b.quotes >= min_quotes).map(|b| (b.predicted - b.observed).abs()).reduce(f64::max)
    }
}

impl Calibration {
    pub fn of(quotes: Vec<Checked>, samples: u32) -> Calibration {
        let asked: Vec<(f64, bool)> = quotes.iter().map(|c| (c.probability, c.on_time)).collect();
        let at_spread: Vec<(f64, bool)> = quotes.iter().map(|c| (c.spread_probability, c.spread_on_time)).collect();
        Calibration { asked: Reliability::of(&asked), at_spread: Reliability::of(&at_spread), quotes, samples }
    }
}

/// Draws `settings.quotes` probes: uniform times, the shape, gang size and
/// priority of a random job of the trace, a deadline from the list.
pub fn draw_probes(jobs: &[Job], settings: &Settings) -> Vec<Probe> {
    let longest = settings.deadlines_s.iter().copied().max().unwrap_or(0);
    let to = settings.to_s.saturating_sub(longest);
    if jobs.is_empty() || settings.deadlines_s.is_empty() || to <= settings.from_s {
        return Vec::new();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed);
    let mut probes: Vec<Probe> = (0..settings.quotes)
        .map(|_| {
            let like = &jobs[rng.random_range(0..jobs.len())];
            Probe {
                at_s: rng.random_range(settings.from_s..to),
                request: PendingShape { shape: like.shape.clone(), tasks: like.tasks.max(1), same_domain: false },
                priority: like.priority,
                deadline_s: settings.deadlines_s[rng.random_range(0..settings.deadlines_s.len())],
                spread: 1.0,
            }
        })
        .collect();
    // Ranks from a stream of their own: the probes asked stay those of the
    // seed without the second check. (0, 1]: never before the first run.
    let mut ranks = ChaCha8Rng::seed_from_u64(settings.seed ^ 0x5EED_5B2E_AD00_0001);
    for p in &mut probes {
        p.spread = 1.0 - ranks.random::<f64>();
    }
    probes.sort_by_key(|p| p.at_s);
    probes
}

/// Class index of the probes' own copies (no history: they end on plan).
const PROBE_CLASS: usize = 256;

/// How a quote is computed: (state, request, history, deadline, samples,
/// seed) to its runs ([`runs`] by default; the host spreads them over its
/// cores and times them).
pub type QuoteFn<'q> = dyn FnMut(Now<'_>, &PendingShape, &History, u64, u32, u64) -> Runs + 'q;

/// Replays `jobs` with the probes' copies added as short jobs, quoting
/// each probe when it is asked (by `quote`, or [`chance`]), and checks
/// every quote against its copy's start.
pub fn calibrate(fleet: &mut Fleet, jobs: &[Job], deciders: Deciders, config: SimConfig, probes: &[Probe], settings: &Settings, quote: Option<&mut QuoteFn<'_>>) -> Result<Calibration, PolicyError> {
    let mut plain = |now: Now<'_>, r: &PendingShape, h: &History, d: u64, n: u32, seed: u64| runs(now, r, h, d, n, seed);
    let quote: &mut QuoteFn<'_> = match quote {
        Some(q) => q,
        None => &mut plain,
    };
    let first_probe = jobs.len();
    let next_id = jobs.iter().map(|j| j.id).max().map_or(0, |m| m + 1);
    let mut all: Vec<Job> = jobs.to_vec();
    all.extend(probes.iter().enumerate().map(|(k, p)| Job {
        id: next_id + k as u64,
        class: 0,
        priority: p.priority,
        arrival_s: p.at_s,
        duration_s: settings.probe_run_s.max(1),
        tasks: p.request.tasks,
        shape: p.request.shape.clone(),
        partition: None,
        contract: None,
        reports_exit: false,
        declared_class: None,
    }));
    let class_of = |slot: usize| if slot >= first_probe { PROBE_CLASS } else { usize::from(all[slot].class) };
    // Every job by arrival, for the window's arrivals: the probes' copies
    // too, which compete with later copies as any work does (left out, a
    // run with many probes quotes against less work than the replay has).
    let mut by_arrival: Vec<usize> = (0..all.len()).collect();
    by_arrival.sort_by_key(|&j| all[j].arrival_s);
    // The host knows how fast each placement works (`[work]`), as live.
    let rates = config.work.clone();
    let mut quoted: Vec<Option<Runs>> = vec![None; probes.len()];
    let mut next_probe = 0;
    let mut watch = |now: u64, engine: &Engine, fleet: &Fleet| {
        if probes.get(next_probe).is_none_or(|p| p.at_s > now) {
            return;
        }
        let history = finished_by_class(engine, &all[..first_probe], now, &class_of);
        let running: Vec<Running> = engine
            .running()
            .into_iter()
            .map(|(end, slot, allocations)| Running {
                allocations,
                class: class_of(slot),
                elapsed_s: now.saturating_sub(engine.run_start(slot).unwrap_or(now)),
                // Only the probes' own copies end on a known plan: the trace's
                // jobs are quoted as a live host sees work without a limit.
                planned_remaining_s: (slot >= first_probe).then(|| end.saturating_sub(now)),
            })
            .collect();
        // Waiting and recent work runs its class's median (a day where
        // fewer than half of the class's runs have finished).
        let medians: Vec<Option<u64>> = survival(&history, &running, &run_rates(fleet, &running, rates.as_ref())).iter().map(|s| s.median()).collect();
        let expected = |slot: usize| medians.get(class_of(slot)).copied().flatten().unwrap_or(86_400);
        let window_from = now.saturating_sub(settings.window_s);
        let lo = by_arrival.partition_point(|&j| all[j].arrival_s < window_from);
        let hi = by_arrival.partition_point(|&j| all[j].arrival_s < now);
        while let Some(p) = probes.get(next_probe).filter(|p| p.at_s <= now) {
            let mut queue: Vec<usize> = engine.pending().iter().copied().filter(|&j| all[j].priority >= p.priority).collect();
            queue.sort_by_key(|&j| (std::cmp::Reverse(all[j].priority), all[j].arrival_s));
            let queued: Vec<Arrival> =
                queue.iter().map(|&j| {
                    // Earlier probes' copies run as long as they were made to.
                    let probe = j >= first_probe;
                    let duration_s = if probe { settings.probe_run_s.max(1) } else { expected(j) };
                    Arrival { at_s: 0, shape: all[j].shape.clone(), tasks: all[j].tasks, duration_s, ahead: true, class: (!probe).then(|| class_of(j)) }
                }).collect();
            let arrivals: Vec<Arrival> = by_arrival[lo..hi]
                .iter()
                .map(|&j| {
                    // A probe's copy runs as long as it was made to; the
                    // trace's work stands for work like it to come, so its
                    // length is drawn from its class (the window's jobs
                    // that already finished are its short ones).
                    let planned = (j >= first_probe).then(|| settings.probe_run_s.max(1));
                    Arrival {
                        at_s: all[j].arrival_s - window_from,
                        shape: all[j].shape.clone(),
                        tasks: all[j].tasks,
                        duration_s: planned.unwrap_or_else(|| expected(j)),
                        ahead: all[j].priority > p.priority,
                        class: planned.is_none().then(|| class_of(j)),
                    }
                })
                .collect();
            let history = History { arrivals, window_s: settings.window_s, ..history.clone() };
            let now_state = Now { fleet, running: &running, queued: &queued, rates: rates.as_ref() };
            quoted[next_probe] = Some(quote(now_state, &p.request, &history, p.deadline_s, settings.samples, settings.seed ^ next_probe as u64));
            next_probe += 1;
        }
    };
    let out = simulate_watched(fleet, &all, deciders, config, None, &mut watch)?;
    let checked = probes
        .iter()
        .zip(quoted)
        .enumerate()
        .filter_map(|(k, (p, q))| {
            let runs = q?;
            let q = runs.within(p.deadline_s);
            let spread_deadline_s = runs.deadline_at(p.spread, p.deadline_s);
            let started_after_s = out.jobs[first_probe + k].start_s.map(|s| s.saturating_sub(p.at_s));
            Some(Checked {
                at_s: p.at_s,
                tasks: p.request.tasks,
                gpus_per_task: p.request.shape.gpu_count,
                priority: p.priority,
                deadline_s: p.deadline_s,
                probability: q.probability,
                samples: q.samples,
                low: q.low,
                high: q.high,
                started_after_s,
                on_time: started_after_s.is_some_and(|s| s <= p.deadline_s),
                spread_deadline_s,
                spread_probability: runs.within(spread_deadline_s).probability,
                spread_on_time: started_after_s.is_some_and(|s| s <= spread_deadline_s),
            })
        })
        .collect();
    Ok(Calibration::of(checked, settings.samples))
}

/// The work of the trace's jobs that ended by `now`, by class: a job
/// ends when its work is done, so its work is its duration (what a live
/// host reads as run time x the run's rate).
fn finished_by_class(engine: &Engine, trace: &[Job], now: u64, class_of: &dyn Fn(usize) -> usize) -> History {
    let mut history = History::default();
    for (j, o) in engine.outcome().jobs.iter().enumerate().take(trace.len()) {
        if o.start_s.is_some() && o.end_s.is_some_and(|e| e <= now) {
            history.add_finished(class_of(j), trace[j].duration_s);
        }
    }
    history
}
