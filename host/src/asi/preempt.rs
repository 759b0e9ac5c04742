//! The priority contract in replay: one workload run with high priority
//! alone, with low-priority fill and no preemption, and with preemption
//! under each ranking policy, side by side (ASI: allocation 68% with high
//! priority alone, 93% with fill; SpotGPU cut low-priority completion time
//! by 24% with no measurable harm to high priority).

use std::sync::Arc;

use berth_core::accounting::{quote, PendingShape, Quote};
use berth_core::compaction::{CompactionConfig, CompactionPolicy, Ledger};
use berth_core::harvest::Harvest;
use berth_core::job::PriorityContract;
use berth_core::sim::{simulate_with, Deciders, Job, SimConfig, SimOutcome};
use berth_core::{Fleet, Tier};
use serde::Serialize;

use super::report::percentile;
use super::workload::HIGH_PRIORITY;
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// One run of the comparison.
#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct PreemptRow {
    /// "high priority only", "fill, no preemption", or the ranking policy.
    pub run: String,
    /// Time-averaged allocated GPUs over installed, % (all work, and high
    /// priority only).
    pub allocation_pct: f64,
    pub high_priority_allocation_pct: f64,
    /// Queueing delay of high-priority jobs that started, s.
    pub high_wait_p50_s: u64,
    pub high_wait_p99_s: u64,
    /// Low-priority jobs, finished by the horizon, and their mean
    /// completion time (arrival to end) counting unfinished ones to the
    /// horizon, h.
    pub low_jobs: usize,
    pub low_finished: usize,
    pub low_completion_mean_h: f64,
    pub evictions: u64,
    pub forced_terminations: u64,
    /// GPU-hours of work lost to preemption (to be recomputed).
    pub lost_gpu_h: f64,
    /// GPU-hours owed to tenants for it (the engine's compensation rates:
    /// lost preemptible work once, broken promises three times, at least a
    /// GPU-hour per GPU), and the promises broken.
    pub credit_gpu_h: f64,
    pub broken_promises: u64,
    /// The outcome: work done per installed GPU-hour and per cost.
    pub outcome: super::report::ReplayOutcome,
    /// Jobs interrupted at least once, and the most any one job was.
    pub jobs_interrupted: usize,
    pub max_interruptions: u32,
    /// Seconds evictions took to vacate: mean and p95 (ASI: 13 s, 48 s).
    pub vacate_mean_s: f64,
    pub vacate_p95_s: u64,
    /// Harvesting: GPU-hours of sleeping replicas, the share low-priority
    /// work used, borrowers evicted to wake replicas, failed wakes.
    pub standby_gpu_h: f64,
    pub harvested_pct: f64,
    pub wake_evictions: u64,
    pub wake_failures: u64,
    /// With compaction: the run's ledger.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compaction: Option<Ledger>,
    /// With a quote request: the quote at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quote: Option<Quote>,
    /// Low-priority work by the tier it was sold as (tiers with jobs only).
    pub by_tier: Vec<TierRow>,
}

/// One tier's low-priority jobs in one run.
#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct TierRow {
    pub tier: String,
    pub jobs: usize,
    pub finished: usize,
    /// Arrival to end, unfinished ones counted to the horizon, h.
    pub completion_mean_h: f64,
    pub interruptions: u64,
    pub lost_gpu_h: f64,
    pub credit_gpu_h: f64,
    pub broken_promises: u64,
}

/// The tiers low-priority work is sold as in a replay, in percent of the
/// low-priority jobs (drawn per job id; high-priority work never is a
/// victim, whatever its tier).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierMix {
    pub guaranteed_pct: u32,
    pub preemptible_pct: u32,
    pub opportunistic_pct: u32,
}

impl Default for TierMix {
    /// Every low-priority job preemptible.
    fn default() -> Self {
        TierMix { guaranteed_pct: 0, preemptible_pct: 100, opportunistic_pct: 0 }
    }
}

impl TierMix {
    /// Parses "G,P,O" (percent, summing to 100), e.g. "10,60,30".
    pub fn parse(text: &str) -> anyhow::Result<TierMix> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        anyhow::ensure!(parts.len() == 3, "{:?}: want GUARANTEED,PREEMPTIBLE,OPPORTUNISTIC percentages, e.g. 10,60,30", crate::text::printable(text, 64));
        let pct = |s: &str| -> anyhow::Result<u32> { s.parse::<u32>().map_err(|_| anyhow::anyhow!("{:?} is not a whole percentage", crate::text::printable(s, 32))) };
        let mix = TierMix { guaranteed_pct: pct(parts[0])?, preemptible_pct: pct(parts[1])?, opportunistic_pct: pct(parts[2])? };
        let sum = u64::from(mix.guaranteed_pct) + u64::from(mix.preemptible_pct) + u64::from(mix.opportunistic_pct);
        anyhow::ensure!(sum == 100, "the shares sum to {sum}, not 100");
        Ok(mix)
    }

    /// The tier of the job whose draw is `draw` (any u64).
    fn tier(&self, draw: u64) -> Tier {
        let u = (draw % 100) as u32;
        if u < self.guaranteed_pct {
            Tier::Guaranteed
        } else if u < self.guaranteed_pct + self.preemptible_pct {
            Tier::Preemptible
        } else {
            Tier::Opportunistic
        }
    }
}

/// Mechanisms every run of the comparison composes with preemption.
#[derive(Default, Clone, Copy)]
pub struct Alongside<'a> {
    /// Periodic compaction by a wasm compaction policy.
    pub compaction: Option<&'a (Arc<LoadedPolicy>, CompactionConfig)>,
    /// A shape to quote at the end of each run, with its start deadline.
    pub quote: Option<&'a (PendingShape, Option<u64>)>,
    /// Prices of a GPU-hour by model (lower case), for the outcome.
    pub costs: Option<&'a std::collections::BTreeMap<String, f64>>,
    /// The tiers low-priority work is sold as.
    pub tiers: TierMix,
}

/// Gives each low-priority job a contract: checkpoints every 30, 60 or 120
/// minutes, one job in four checkpoints when given notice, and a tier drawn
/// from `tiers`. Drawn from the job id, so the workload generator's own
/// draws are untouched. The rest (notice, cap, outage bound) is `base`'s,
/// as the tier has it.
pub fn with_contracts(jobs: &[Job], base: PriorityContract, tiers: TierMix) -> Vec<Job> {
    jobs.iter()
        .map(|j| {
            let mut j = j.clone();
            if j.priority < HIGH_PRIORITY {
                let h = j.id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
                let tier = tiers.tier(j.id.wrapping_add(0x5851_F42D).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 29);
                let contract = PriorityContract {
                    checkpoint_every_s: [1800, 3600, 7200][(h % 3) as usize],
                    checkpoint_on_notice: h % 4 == 0,
                    ..base
                };
                j.contract = Some(contract.of_tier(tier));
            }
            j
        })
        .collect()
}

/// Runs the comparison: `placement` places everything; each of `rankers`
/// ranks victims in its own run.
/// `base` carries the horizon, guards, protected partitions and harvesting
/// (the runs with low-priority fill also put idle replicas to sleep in the
/// trough and lend their GPUs); the high-priority threshold is the
/// workload's.
pub fn compare(
    engine: &Arc<PolicyEngine>,
    placement: &Arc<LoadedPolicy>,
    rankers: &[Arc<LoadedPolicy>],
    fleet: &Fleet,
    jobs: &[Job],
    base: &SimConfig,
    alongside: Alongside<'_>,
    limits: Limits,
) -> anyhow::Result<Vec<PreemptRow>> {
    let jobs = with_contracts(jobs, base.contract, alongside.tiers);
    let horizon_s = base.horizon_s;
    let config = SimConfig { high_priority: HIGH_PRIORITY, ..base.clone() };
    let run = |name: &str, jobs: &[Job], ranker: Option<&Arc<LoadedPolicy>>| -> anyhow::Result<PreemptRow> {
        let mut policy = WasmPolicy::new(engine.clone(), placement.clone(), limits);
        let mut fleet = fleet.clone();
        let mut ranker = ranker.map(|r| WasmPolicy::new(engine.clone(), r.clone(), limits));
        let ranker = ranker.as_mut().map(|r| r as &mut dyn berth_core::preemption::PreemptionPolicy);
        let mut planner = alongside.compaction.map(|(p, _)| WasmPolicy::new(engine.clone(), p.clone(), limits));
        let compaction = planner.as_mut().zip(alongside.compaction).map(|(p, (_, c))| (p as &mut dyn CompactionPolicy, c.clone()));
        // High priority alone has nothing to lend to.
        let config = if jobs.iter().all(|j| j.priority >= HIGH_PRIORITY) { SimConfig { harvest: None, ..config.clone() } } else { config.clone() };
        let out = simulate_with(&mut fleet, jobs, Deciders { placement: &mut policy, preemption: ranker, compaction }, config)?;
        fleet.check_invariants().map_err(anyhow::Error::msg)?;
        let mut row = summarise(name, &fleet, jobs, &out, horizon_s);
        row.outcome = super::report::replay_outcome(&fleet, &out, alongside.costs.unwrap_or(&Default::default()));
        row.compaction = alongside.compaction.map(|_| out.compaction.clone());
        if let Some((request, deadline)) = alongside.quote {
            let running: Vec<(u64, Vec<berth_core::Allocation>)> = out.running_at_end.iter().map(|(e, _, a)| (*e, a.clone())).collect();
            row.quote = Some(quote(&fleet, request, &running, out.end_s, *deadline));
        }
        Ok(row)
    };
    let high_only: Vec<Job> = jobs.iter().filter(|j| j.priority >= HIGH_PRIORITY).cloned().collect();
    let mut rows = vec![run("high priority only", &high_only, None)?];
    rows.push(run("fill, no preemption", &jobs, None)?);
    for r in rankers {
        rows.push(run(&format!("fill + {}", r.info.name), &jobs, Some(r))?);
    }
    Ok(rows)
}

fn summarise(run: &str, fleet: &Fleet, jobs: &[Job], out: &SimOutcome, horizon_s: u64) -> PreemptRow {
    let total = fleet.gpu_total_milli() as f64;
    let secs = out.utilisation.seconds.max(1.0);
    // A job still waiting at the horizon has waited at least until then:
    // counted so, not dropped (dropping it makes a run that starves high
    // priority look faster).
    let end = out.end_s.max(1);
    let mut high_waits: Vec<u64> = jobs
        .iter()
        .zip(&out.jobs)
        .filter(|(j, _)| j.priority >= HIGH_PRIORITY && j.arrival_s < end)
        .map(|(j, o)| o.start_s.unwrap_or(end).saturating_sub(j.arrival_s))
        .collect();
    high_waits.sort_unstable();
    let low: Vec<(&Job, &berth_core::sim::JobOutcome)> = jobs.iter().zip(&out.jobs).filter(|(j, _)| j.priority < HIGH_PRIORITY).collect();
    let completion: f64 = low.iter().map(|(j, o)| (o.end_s.unwrap_or(horizon_s.max(j.arrival_s)) - j.arrival_s) as f64 / 3600.0).sum();
    PreemptRow {
        run: run.to_string(),
        allocation_pct: 100.0 * out.utilisation.all_milli_s / (total * secs),
        high_priority_allocation_pct: 100.0 * out.utilisation.high_milli_s / (total * secs),
        high_wait_p50_s: percentile(&high_waits, 50.0),
        high_wait_p99_s: percentile(&high_waits, 99.0),
        low_jobs: low.len(),
        low_finished: low.iter().filter(|(_, o)| o.end_s.is_some()).count(),
        low_completion_mean_h: if low.is_empty() { 0.0 } else { completion / low.len() as f64 },
        evictions: out.evictions,
        forced_terminations: out.forced_terminations,
        lost_gpu_h: out.lost_gpu_s / 3600.0,
        credit_gpu_h: out.credit_gpu_h,
        broken_promises: out.broken_promises,
        outcome: Default::default(),
        jobs_interrupted: out.jobs.iter().filter(|o| o.interruptions > 0).count(),
        max_interruptions: out.jobs.iter().map(|o| o.interruptions).max().unwrap_or(0),
        vacate_mean_s: if out.vacate_s.is_empty() { 0.0 } else { out.vacate_s.iter().sum::<u64>() as f64 / out.vacate_s.len() as f64 },
        vacate_p95_s: {
            let mut v = out.vacate_s.clone();
            v.sort_unstable();
            percentile(&v, 95.0)
        },
        standby_gpu_h: out.standby_gpu_s / 3600.0,
        harvested_pct: if out.standby_gpu_s > 0.0 { 100.0 * out.harvested_gpu_s / out.standby_gpu_s } else { 0.0 },
        wake_evictions: out.wake_evictions,
        wake_failures: out.wake_failures,
        compaction: None,
        quote: None,
        by_tier: Tier::ALL
            .iter()
            .filter_map(|&tier| {
                let of: Vec<_> = low.iter().filter(|(j, _)| j.contract.map_or(Tier::Preemptible, |c| c.tier) == tier).collect();
                (!of.is_empty()).then(|| TierRow {
                    tier: tier.name().to_string(),
                    jobs: of.len(),
                    finished: of.iter().filter(|(_, o)| o.end_s.is_some()).count(),
                    completion_mean_h: of.iter().map(|(j, o)| (o.end_s.unwrap_or(horizon_s.max(j.arrival_s)) - j.arrival_s) as f64 / 3600.0).sum::<f64>() / of.len() as f64,
                    interruptions: of.iter().map(|(_, o)| u64::from(o.interruptions)).sum(),
                    lost_gpu_h: of.iter().map(|(_, o)| o.lost_gpu_s).sum::<f64>() / 3600.0,
                    credit_gpu_h: of.iter().map(|(_, o)| o.credit_gpu_h).sum(),
                    broken_promises: of.iter().map(|(_, o)| u64::from(o.broken)).sum(),
                })
            })
            .collect(),
    }
}

/// The side-by-side table ("vacate s": mean / p95 seconds to vacate).
pub fn table(rows: &[PreemptRow]) -> String {
    let mut s = format!(
        "{:<26} {:>7} {:>7} {:>9} {:>9} {:>13} {:>10} {:>9} {:>7} {:>9} {:>11} {:>11} {:>9} {:>10}\n",
        "run", "alloc%", "high%", "hi p50", "hi p99", "low done", "low compl", "evicted", "forced", "lost GPUh", "credit GPUh", "vacate s", "standby", "harvested"
    );
    s += &rows_table(rows);
    for r in rows.iter().filter(|r| r.broken_promises > 0) {
        s += &format!("{}: {} promises broken (of {:.1} GPU-h owed)\n", r.run, r.broken_promises, r.credit_gpu_h);
    }
    // By tier, where more than one was sold.
    for r in rows.iter().filter(|r| r.by_tier.len() > 1) {
        for t in &r.by_tier {
            s += &format!(
                "{}: {:<13} {:>5}/{:<5} done, completion {:.1}h, {} interruptions, {:.1} GPU-h lost, {:.1} GPU-h owed, {} promises broken\n",
                r.run, t.tier, t.finished, t.jobs, t.completion_mean_h, t.interruptions, t.lost_gpu_h, t.credit_gpu_h, t.broken_promises
            );
        }
    }
    for r in rows.iter().filter(|r| r.compaction.is_some() || r.quote.is_some()) {
        s += &format!("{}:", r.run);
        if let Some(l) = &r.compaction {
            s += &format!(
                " compaction {} steps ({} active), {} chains run, {} moves run / {} rolled back, {} whole nodes gained;",
                l.steps,
                l.steps - l.steps_idle,
                l.chains_run,
                l.moves_run,
                l.moves_rolled_back,
                l.whole_nodes_gained
            );
        }
        if let Some(q) = &r.quote {
            s += &format!(" {}", super::report::quote_line(q));
        }
        s += "\n";
    }
    // The outcome: what the fleet finished, not how busy it was.
    for r in rows {
        let o = &r.outcome;
        s += &format!(
            "{:<26} outcome {:.4} per installed GPU-h, {} per cost (goodput {:.0} GPU-h, lost {:.1})\n",
            r.run,
            o.per_installed_gpu_hour,
            o.per_cost.map_or("-".into(), |c| format!("{c:.4}")),
            o.goodput_gpu_h,
            o.lost_gpu_h
        );
    }
    if rows.len() > 1 {
        s += &super::report::ranking(rows.iter().map(|r| (r.run.as_str(), r.allocation_pct, &r.outcome)));
    }
    s
}

/// One line per run under the header.
fn rows_table(rows: &[PreemptRow]) -> String {
    let mut s = String::new();
    for r in rows {
        s += &format!(
            "{:<26} {:>7.1} {:>7.1} {:>8.1}h {:>8.1}h {:>6}/{:<6} {:>9.1}h {:>9} {:>7} {:>9.1} {:>11.1} {:>5.0}/{:<5} {:>8.0}h {:>9.1}%\n",
            r.run,
            r.allocation_pct,
            r.high_priority_allocation_pct,
            r.high_wait_p50_s as f64 / 3600.0,
            r.high_wait_p99_s as f64 / 3600.0,
            r.low_finished,
            r.low_jobs,
            r.low_completion_mean_h,
            r.evictions,
            r.forced_terminations,
            r.lost_gpu_h,
            r.credit_gpu_h,
            r.vacate_mean_s,
            r.vacate_p95_s,
            r.standby_gpu_h,
            r.harvested_pct
        );
    }
    s
}

/// Parses "SLEEP_H-WAKE_H[:SHARE]" for the online-inference class.
pub fn parse_harvest(text: &str) -> anyhow::Result<Harvest> {
    let (hours, share) = text.split_once(':').map_or((text, None), |(h, s)| (h, Some(s)));
    let (sleep, wake) = hours.split_once('-').ok_or_else(|| anyhow::anyhow!("{text:?}: want SLEEP_H-WAKE_H[:SHARE], e.g. 15-21:0.5"))?;
    let hour = |h: &str| -> anyhow::Result<u64> {
        let v: f64 = h.trim().parse().map_err(|_| anyhow::anyhow!("{h:?} is not an hour of the day"))?;
        anyhow::ensure!((0.0..24.0).contains(&v), "{v} is not an hour of the day (0 to 24)");
        Ok((v * 3600.0) as u64)
    };
    let share: f64 = match share {
        Some(s) => s.trim().parse().map_err(|_| anyhow::anyhow!("share {s:?} is not a number"))?,
        None => 0.5,
    };
    anyhow::ensure!((0.0..=1.0).contains(&share), "share {share} must be in [0, 1]");
    let (sleep_at_s, wake_at_s) = (hour(sleep)?, hour(wake)?);
    anyhow::ensure!(sleep_at_s != wake_at_s, "sleep and wake at the same hour");
    Ok(Harvest { class: 0, sleep_at_s, wake_at_s, share })
}
