//! The ASI replay's calibration of quotes: probe quotes at random moments
//! of the week, each checked against its copy's start (see
//! [`berth_core::calibration`]), printed as a reliability table.

use std::sync::Arc;

use berth_core::calibration::{calibrate, draw_probes, Calibration, Settings};
use berth_core::compaction::{CompactionConfig, CompactionPolicy};
use berth_core::sim::{Deciders, Guards, Job, SimConfig};
use berth_core::Fleet;

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
pub fn run(run: Run<'_>, fleet: &Fleet, jobs: &[Job], horizon_s: u64, quotes: u32, samples: u32, seed: u64) -> anyhow::Result<Calibration> {
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
    anyhow::ensure!(!probes.is_empty(), "the replay is too short to ask quotes in (after its first quarter, before its longest deadline)");
    let mut policy = WasmPolicy::new(run.engine.clone(), run.placement.clone(), run.limits);
    let mut planner = run.compaction.map(|(p, _)| WasmPolicy::new(run.engine.clone(), p.clone(), run.limits));
    let deciders = Deciders {
        placement: &mut policy,
        preemption: None,
        compaction: planner.as_mut().zip(run.compaction).map(|(p, (_, c))| (p as &mut dyn CompactionPolicy, c.clone())),
    };
    let config = SimConfig { horizon_s, high_priority: HIGH_PRIORITY, guards: run.guards.clone(), work: run.work, ..SimConfig::default() };
    let mut fleet = fleet.clone();
    Ok(calibrate(&mut fleet, jobs, deciders, config, &probes, &settings)?)
}

/// The reliability table for people.
pub fn table(c: &Calibration) -> String {
    let mut out = format!("calibration: {} quotes of {} samples each, checked against their copies' starts\n", c.quotes.len(), c.samples);
    out.push_str(&format!("{:<12} {:>7} {:>10} {:>9} {:>6}\n", "predicted", "quotes", "mean said", "happened", "gap"));
    for b in &c.buckets {
        let cells = if b.quotes == 0 {
            format!("{:>10} {:>9} {:>6}", "-", "-", "-")
        } else {
            format!("{:>10.3} {:>9.3} {:>6.1}", b.predicted, b.observed, 100.0 * (b.observed - b.predicted))
        };
        out.push_str(&format!("{:<12} {:>7} {cells}\n", format!("{:.1}-{:.1}", b.from, b.to), b.quotes));
    }
    let on_time = c.quotes.iter().filter(|q| q.on_time).count();
    out.push_str(&format!(
        "Brier score {:.4} (always saying the base rate {:.1}%: {:.4}); worst gap over deciles with 20+ quotes: {}\n",
        c.brier,
        100.0 * on_time as f64 / c.quotes.len().max(1) as f64,
        c.brier_base_rate,
        c.worst_gap(20).map_or("-".into(), |g| format!("{:.1} points", 100.0 * g))
    ));
    out
}
