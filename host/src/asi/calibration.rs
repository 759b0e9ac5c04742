//! The ASI replay's calibration of quotes: probe quotes at random moments
//! of the week, each checked against its copy's start (see
//! [`berth_core::calibration`]), printed as a reliability table.

use std::sync::Arc;
use std::time::Duration;

use berth_core::accounting::PendingShape;
use berth_core::calibration::{calibrate, draw_probes, Calibration, Reliability, Settings};
use berth_core::compaction::{CompactionConfig, CompactionPolicy};
use berth_core::forecast::{History, Now};
use berth_core::sim::{Deciders, Guards, Job, SimConfig};
use berth_core::Fleet;
use serde::Serialize;

use super::workload::HIGH_PRIORITY;
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// Deadlines the probes draw from: ten minutes to eight hours.
pub const DEADLINES_S: [u64; 6] = [600, 1_800, 3_600, 2 * 3_600, 4 * 3_600, 8 * 3_600];

/// What a calibration run is given beside the trace.
pub struct Run<'a> {
    pub engine: &'a Arc<PolicyEngine>,
    pub placement: &'a Arc<LoadedPolicy>,
    pub compaction: Option<&'a (Arc<LoadedPolicy>, CompactionConfig)>,
    pub limits: Limits,
    pub guards: &'a Guards,
    pub work: Option<berth_core::sim::WorkRates>,
}

/// Replays `jobs` on `fleet` until `horizon_s` with `quotes` probe quotes
/// of `samples` samples each, asked after the first day (the history a
/// quote needs), seeded by `seed`.
pub fn run(run: Run<'_>, fleet: &Fleet, jobs: &[Job], horizon_s: u64, quotes: u32, samples: u32, seed: u64) -> anyhow::Result<Calibrated> {
    let settings = Settings {
        quotes,
        from_s: 86_400.min(horizon_s / 4),
        to_s: horizon_s,
        deadlines_s: DEADLINES_S.iter().copied().filter(|&d| d < horizon_s / 2).collect(),
        samples,
        window_s: 86_400,
        probe_run_s: 60,
        seed,
    };
    let probes = draw_probes(jobs, &settings);
    anyhow::ensure!(!probes.is_empty(), "the replay is too short to ask quotes in (after its first day or quarter, before its longest deadline)");
    let mut policy = WasmPolicy::new(run.engine.clone(), run.placement.clone(), run.limits);
    let mut planner = run.compaction.map(|(p, _)| WasmPolicy::new(run.engine.clone(), p.clone(), run.limits));
    let deciders = Deciders {
        placement: &mut policy,
        preemption: None,
        compaction: planner.as_mut().zip(run.compaction).map(|(p, (_, c))| (p as &mut dyn CompactionPolicy, c.clone())),
    };
    let config = SimConfig { horizon_s, high_priority: HIGH_PRIORITY, guards: run.guards.clone(), work: run.work, ..SimConfig::default() };
    let mut fleet = fleet.clone();
    // Each quote as `berth quote` runs it (on every core), timed.
    let mut took: Vec<f64> = Vec::new();
    let mut quote = |now: Now<'_>, request: &PendingShape, history: &History, deadline_s: u64, samples: u32, seed: u64| {
        let started = std::time::Instant::now();
        let c = crate::forecast::runs_within(now, request, history, deadline_s, samples, seed, Duration::from_secs(3_600));
        took.push(started.elapsed().as_secs_f64() * 1000.0);
        c
    };
    let calibration = calibrate(&mut fleet, jobs, deciders, config, &probes, &settings, Some(&mut quote))?;
    took.sort_by(f64::total_cmp);
    let at = |q: f64| took.get(((took.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    Ok(Calibrated { calibration, nodes: fleet.nodes().len(), quote_ms_p50: at(0.5), quote_ms_p99: at(0.99), quote_ms_max: at(1.0) })
}

/// A calibration and how long its quotes took.
#[derive(Clone, Debug, Serialize)]
pub struct Calibrated {
    #[serde(flatten)]
    pub calibration: Calibration,
    pub nodes: usize,
    pub quote_ms_p50: f64,
    pub quote_ms_p99: f64,
    pub quote_ms_max: f64,
}

/// The reliability tables for people: at the deadlines asked, and at the
/// deadlines read off each quote's runs.
pub fn table(run: &Calibrated) -> String {
    let c = &run.calibration;
    let mut out = format!("calibration: {} quotes of {} samples each, checked against their copies' starts\n", c.quotes.len(), c.samples);
    out.push_str("at the deadlines asked (10 min to 8 h):\n");
    out.push_str(&reliability_table(&c.asked));
    out.push_str("at a deadline read off each quote's runs (the start at a random rank):\n");
    out.push_str(&reliability_table(&c.at_spread));
    out.push_str(&format!(
        "time per quote on {} nodes: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms\n",
        run.nodes, run.quote_ms_p50, run.quote_ms_p99, run.quote_ms_max
    ));
    out
}

/// Deciles of predicted probability against what happened, with the Brier
/// scores and the worst gap.
fn reliability_table(r: &Reliability) -> String {
    let mut out = format!("{:<12} {:>7} {:>10} {:>9} {:>6}\n", "predicted", "quotes", "mean said", "happened", "gap");
    for b in &r.buckets {
        let cells = if b.quotes == 0 {
            format!("{:>10} {:>9} {:>6}", "-", "-", "-")
        } else {
            format!("{:>10.3} {:>9.3} {:>6.1}", b.predicted, b.observed, 100.0 * (b.observed - b.predicted))
        };
        out.push_str(&format!("{:<12} {:>7} {cells}\n", format!("{:.1}-{:.1}", b.from, b.to), b.quotes));
    }
    out.push_str(&format!(
        "Brier score {:.4} (always saying the base rate {:.1}%: {:.4}); worst gap over deciles with {}+ quotes: {}\n",
        r.brier,
        100.0 * r.base_rate,
        r.brier_base_rate,
        MIN_DECILE_QUOTES,
        r.worst_gap(MIN_DECILE_QUOTES).map_or("-".into(), |g| format!("{:.1} points", 100.0 * g))
    ));
    out
}

/// Deciles with fewer quotes are too uncertain to judge (20 quotes leave
/// about 11 points of spread at 0.5).
pub const MIN_DECILE_QUOTES: u32 = 20;
