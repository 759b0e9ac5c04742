//! The event-driven replay and its report: allocation (all and high
//! priority only), queueing delay per class, unstarted jobs, and switch
//! domains per large gang against the lower bound.

use std::sync::Arc;

use berth_core::accounting::{account, quote, Accounting, NodeFacts, PendingShape, Quote};
use berth_core::compaction::{CompactionConfig, CompactionPolicy, Ledger};
use berth_core::sim::{simulate_with, Deciders, Guards, Job, SimConfig, SimOutcome};
use berth_core::Fleet;
use serde::Serialize;

use super::fleet::Topology;
use super::workload::{CLASSES, HIGH_PRIORITY};
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// Gangs of at least this many GPUs count as large.
pub const LARGE_GANG_GPUS: u64 = 64;
/// The largest gangs, whose waits the starvation guard protects.
pub const LARGEST_GANG_GPUS: u64 = 256;

#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct ClassReport {
    pub class: String,
    pub jobs: usize,
    pub started: usize,
    pub wait_p50_s: u64,
    pub wait_p90_s: u64,
    pub wait_p99_s: u64,
    pub wait_max_s: u64,
}

#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct EventReport {
    pub policy: String,
    pub nodes: usize,
    pub gpus: u64,
    pub jobs: usize,
    pub simulated_days: f64,
    /// Time-averaged allocated GPUs over installed, %.
    pub allocation_pct: f64,
    /// The same counting high-priority jobs only.
    pub high_priority_allocation_pct: f64,
    pub classes: Vec<ClassReport>,
    /// Large gangs (>= 64 GPUs) started, mean switch domains they used, and
    /// the mean lower bound ceil(GPUs / GPUs per domain).
    pub large_gangs_started: usize,
    pub large_gang_domains_mean: f64,
    pub large_gang_domains_lower_bound_mean: f64,
    /// Gangs of >= 256 GPUs: arrived, started, and the p99 and max wait of
    /// those started (s). Unstarted ones count as waiting to the horizon.
    pub largest_gangs: usize,
    pub largest_gangs_started: usize,
    pub largest_gang_wait_p99_s: u64,
    pub largest_gang_wait_max_s: u64,
    /// Jobs whose tasks each take a whole node (all its GPUs): started /
    /// arrived, and their wait p50 / p90 / p99 (unstarted count to the
    /// horizon) — what compaction is for.
    pub whole_node_jobs: usize,
    pub whole_node_started: usize,
    pub whole_node_wait_s: [u64; 3],
    /// Reservations made by the starvation guard.
    pub reservations: u64,
    /// The outcome: work done per installed GPU-hour and per cost.
    pub outcome: ReplayOutcome,
    /// The three denominators and stranded GPUs at the end of the run.
    pub accounting: Accounting,
    /// The quote for the requested shape at the end of the run, if any.
    pub quote: Option<Quote>,
    /// Compaction's ledger, when it ran.
    pub compaction: Option<Ledger>,
    pub placement_calls: u64,
    /// Wall time of the simulation, s (informational).
    pub wall_s: f64,
}

/// Completed work (at the reference rate, GPU-hours: a job's duration is
/// its work) against the installed GPU-hours and their cost over the run.
#[derive(Debug, Serialize, Clone, PartialEq, Default)]
pub struct ReplayOutcome {
    /// Work done and kept by the end, and work lost to preemption.
    pub goodput_gpu_h: f64,
    pub lost_gpu_h: f64,
    /// Training work the GPUs did not do beside CPU-only neighbours (the
    /// interference model; already taken out of the goodput).
    pub interference_lost_gpu_h: f64,
    pub installed_gpu_h: f64,
    /// Goodput per installed GPU-hour (a fraction of what the fleet could
    /// do at the reference rate).
    pub per_installed_gpu_hour: f64,
    /// The installed GPU-hours priced by the fleet's cost table, and
    /// goodput per unit of it; `None` without a price for every model.
    pub cost: Option<f64>,
    pub per_cost: Option<f64>,
}

/// The outcome of run `out` on `fleet`, priced by `costs` (GPU model in
/// lower case to the cost of a GPU-hour).
pub fn replay_outcome(fleet: &Fleet, out: &SimOutcome, costs: &std::collections::BTreeMap<String, f64>) -> ReplayOutcome {
    let hours = out.utilisation.seconds / 3600.0;
    let (installed_gpu_h, cost) = berth_core::accounting::installed_gpu_hours(fleet, costs, &|_| hours);
    let interference = out.interference_lost_gpu_s / 3600.0;
    let goodput = (out.jobs.iter().map(|o| o.work_gpu_s).sum::<f64>() / 3600.0 - interference).max(0.0);
    let lost = out.lost_gpu_s / 3600.0;
    let o = berth_core::accounting::outcome(berth_core::accounting::Work { done: goodput + lost, lost }, installed_gpu_h, cost);
    ReplayOutcome {
        goodput_gpu_h: goodput,
        lost_gpu_h: lost,
        interference_lost_gpu_h: interference,
        installed_gpu_h,
        per_installed_gpu_hour: o.per_installed_gpu_hour,
        cost,
        per_cost: o.per_cost,
    }
}

/// The `p`th percentile (0..=100, nearest rank) of sorted values; 0 if none.
pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises one simulation.
pub fn summarise(policy: &str, fleet: &Fleet, topo: &Topology, jobs: &[Job], out: &SimOutcome, wall_s: f64) -> EventReport {
    let total = fleet.gpu_total_milli() as f64;
    let secs = out.utilisation.seconds.max(1.0);
    let classes = CLASSES
        .iter()
        .enumerate()
        .map(|(c, name)| {
            let mut waits: Vec<u64> = jobs
                .iter()
                .zip(&out.jobs)
                .filter(|(j, _)| j.class as usize == c)
                .filter_map(|(j, o)| o.start_s.map(|s| s - j.arrival_s))
                .collect();
            waits.sort_unstable();
            ClassReport {
                class: name.to_string(),
                jobs: jobs.iter().filter(|j| j.class as usize == c).count(),
                started: waits.len(),
                wait_p50_s: percentile(&waits, 50.0),
                wait_p90_s: percentile(&waits, 90.0),
                wait_p99_s: percentile(&waits, 99.0),
                wait_max_s: waits.last().copied().unwrap_or(0),
            }
        })
        .collect();
    let gpus_per_node = fleet.nodes().iter().map(|n| n.gpus.len() as u64).max().unwrap_or(8).max(1);
    let per_domain = gpus_per_node * u64::from(topo.nodes_per_switch.max(1));
    let large: Vec<(u32, u64)> = jobs
        .iter()
        .zip(&out.jobs)
        .filter(|(j, o)| j.gpus() >= LARGE_GANG_GPUS && o.start_s.is_some())
        .map(|(j, o)| (o.domains, j.gpus().div_ceil(per_domain)))
        .collect();
    let horizon = out.utilisation.seconds as u64;
    let mut largest_waits: Vec<u64> = jobs
        .iter()
        .zip(&out.jobs)
        .filter(|(j, _)| j.gpus() >= LARGEST_GANG_GPUS)
        .map(|(j, o)| o.start_s.unwrap_or(horizon.max(j.arrival_s)) - j.arrival_s)
        .collect();
    largest_waits.sort_unstable();
    let whole: Vec<(&Job, &berth_core::sim::JobOutcome)> =
        jobs.iter().zip(&out.jobs).filter(|(j, _)| j.shape.gpu_count > 0 && u64::from(j.shape.gpu_count) == gpus_per_node).collect();
    let mut whole_waits: Vec<u64> = whole.iter().map(|(j, o)| o.start_s.unwrap_or(horizon.max(j.arrival_s)) - j.arrival_s).collect();
    whole_waits.sort_unstable();
    let largest_started = jobs.iter().zip(&out.jobs).filter(|(j, o)| j.gpus() >= LARGEST_GANG_GPUS && o.start_s.is_some()).count();
    let mean = |f: &dyn Fn(&(u32, u64)) -> f64| if large.is_empty() { 0.0 } else { large.iter().map(f).sum::<f64>() / large.len() as f64 };
    EventReport {
        policy: policy.to_string(),
        nodes: fleet.nodes().len(),
        gpus: fleet.gpu_total_milli() / 1000,
        jobs: jobs.len(),
        simulated_days: secs / 86_400.0,
        allocation_pct: 100.0 * out.utilisation.all_milli_s / (secs * total),
        high_priority_allocation_pct: 100.0 * out.utilisation.high_milli_s / (secs * total),
        classes,
        large_gangs_started: large.len(),
        large_gang_domains_mean: mean(&|x| f64::from(x.0)),
        large_gang_domains_lower_bound_mean: mean(&|x| x.1 as f64),
        largest_gangs: largest_waits.len(),
        largest_gangs_started: largest_started,
        largest_gang_wait_p99_s: percentile(&largest_waits, 99.0),
        largest_gang_wait_max_s: largest_waits.last().copied().unwrap_or(0),
        whole_node_jobs: whole.len(),
        whole_node_started: whole.iter().filter(|(_, o)| o.start_s.is_some()).count(),
        whole_node_wait_s: [percentile(&whole_waits, 50.0), percentile(&whole_waits, 90.0), percentile(&whole_waits, 99.0)],
        reservations: out.reservations,
        outcome: ReplayOutcome::default(),
        accounting: Accounting::default(),
        quote: None,
        compaction: None,
        placement_calls: out.placements,
        wall_s,
    }
}

/// Share of an allocation doing useful work, by class: online inference
/// follows its daily demand (half idle at the trough), the rest loses a
/// little to checkpoints and restarts. Synthetic: live hosts measure it.
fn productive_share(job: &Job, at_s: u64) -> f64 {
    match job.class {
        0 => 0.75 + 0.25 * (std::f64::consts::TAU * at_s as f64 / 86_400.0).sin(),
        _ => 0.95,
    }
}

/// Accounts the fleet as the simulation left it: pending shapes are the
/// distinct shapes still waiting (gangs want one switch domain).
pub fn account_at_end(fleet: &Fleet, topo: &Topology, jobs: &[Job], out: &SimOutcome) -> Accounting {
    let mut pending: Vec<PendingShape> = Vec::new();
    for &j in &out.pending_at_end {
        let p = PendingShape { shape: jobs[j].shape.clone(), tasks: jobs[j].tasks, same_domain: jobs[j].tasks > 1 };
        if !pending.contains(&p) {
            pending.push(p);
        }
    }
    let mut productive = vec![0u64; fleet.nodes().len()];
    let mut reclaimable = vec![0u64; fleet.nodes().len()];
    for (_, j, allocs) in &out.running_at_end {
        let share = productive_share(&jobs[*j], out.end_s);
        let preemptible = jobs[*j].priority < HIGH_PRIORITY;
        for a in allocs {
            productive[a.node as usize] += (a.gpu_milli_total() as f64 * share) as u64;
            if preemptible {
                reclaimable[a.node as usize] += a.gpu_milli_total();
            }
        }
    }
    // A simulated fleet is always powered.
    account(fleet, &pending, &topo.partition, &|i, _| NodeFacts { powered: true, productive_milli: productive[i], reclaimable_milli: reclaimable[i] })
}

/// What replay prices and how fast work advances (from the fleet config).
#[derive(Clone, Debug, Default)]
pub struct Economics {
    pub work: Option<berth_core::sim::WorkRates>,
    /// What CPU-only neighbours cost training (`--interference`).
    pub interference: Option<berth_core::sim::Interference>,
    /// GPU model (lower case) to the cost of a GPU-hour.
    pub cost_per_gpu_hour: std::collections::BTreeMap<String, f64>,
}

/// Simulates `jobs` on a fresh copy of `fleet` with one wasm policy placing,
/// and with periodic compaction by a wasm compaction policy when given.
#[allow(clippy::too_many_arguments)]
pub fn run_policy(
    engine: &Arc<PolicyEngine>,
    loaded: &Arc<LoadedPolicy>,
    fleet: &Fleet,
    topo: &Topology,
    jobs: &[Job],
    horizon_s: u64,
    guards: &Guards,
    request: Option<&(PendingShape, Option<u64>)>,
    compaction: Option<&(Arc<LoadedPolicy>, CompactionConfig)>,
    limits: Limits,
    economics: &Economics,
) -> anyhow::Result<EventReport> {
    let mut policy = WasmPolicy::new(engine.clone(), loaded.clone(), limits);
    let mut planner = compaction.map(|(p, _)| WasmPolicy::new(engine.clone(), p.clone(), limits));
    let mut fleet = fleet.clone();
    let started = std::time::Instant::now();
    let deciders = Deciders {
        placement: &mut policy,
        preemption: None,
        compaction: planner.as_mut().zip(compaction).map(|(p, (_, c))| (p as &mut dyn CompactionPolicy, c.clone())),
    };
    let config = SimConfig {
        horizon_s,
        high_priority: HIGH_PRIORITY,
        guards: guards.clone(),
        work: economics.work.clone(),
        interference: economics.interference,
        ..SimConfig::default()
    };
    let out = simulate_with(&mut fleet, jobs, deciders, config)?;
    fleet.check_invariants().map_err(anyhow::Error::msg)?;
    let mut report = summarise(&loaded.info.name, &fleet, topo, jobs, &out, started.elapsed().as_secs_f64());
    report.outcome = replay_outcome(&fleet, &out, &economics.cost_per_gpu_hour);
    report.accounting = account_at_end(&fleet, topo, jobs, &out);
    report.compaction = compaction.map(|_| out.compaction.clone());
    if let Some((request, deadline)) = request {
        let running: Vec<(u64, Vec<berth_core::Allocation>)> = out.running_at_end.iter().map(|(e, _, a)| (*e, a.clone())).collect();
        report.quote = Some(quote(&fleet, request, &running, out.end_s, *deadline));
    }
    Ok(report)
}

fn hours(s: u64) -> String {
    format!("{:.1}h", s as f64 / 3600.0)
}

/// The side-by-side table of several policies' reports.
pub fn table(reports: &[EventReport]) -> String {
    let mut out = String::new();
    if let Some(r) = reports.first() {
        out.push_str(&format!("{} nodes, {} GPUs, {} jobs, {:.1} simulated days\n", r.nodes, r.gpus, r.jobs, r.simulated_days));
    }
    let row = |label: &str, f: &dyn Fn(&EventReport) -> String| {
        let mut line = format!("{label:<34}");
        for r in reports {
            line.push_str(&format!("{:>22}", f(r)));
        }
        line.push('\n');
        line
    };
    out.push_str(&row("", &|r| r.policy.clone()));
    out.push_str(&row("allocation % (all)", &|r| format!("{:.2}", r.allocation_pct)));
    out.push_str(&row("allocation % (high priority only)", &|r| format!("{:.2}", r.high_priority_allocation_pct)));
    out.push_str(&row("outcome: goodput / installed GPU-h", &|r| format!("{:.4}", r.outcome.per_installed_gpu_hour)));
    out.push_str(&row("  goodput per cost", &|r| r.outcome.per_cost.map_or("-".into(), |c| format!("{c:.4}"))));
    if reports.iter().any(|r| r.outcome.interference_lost_gpu_h > 0.0) {
        out.push_str(&row("  training lost to neighbours, GPU-h", &|r| format!("{:.0}", r.outcome.interference_lost_gpu_h)));
    }
    for (c, name) in CLASSES.iter().enumerate() {
        out.push_str(&row(&format!("{name}: started/jobs"), &|r| format!("{}/{}", r.classes[c].started, r.classes[c].jobs)));
        out.push_str(&row(&format!("{name}: wait p50/p90/p99"), &|r| {
            let k = &r.classes[c];
            format!("{}/{}/{}", hours(k.wait_p50_s), hours(k.wait_p90_s), hours(k.wait_p99_s))
        }));
    }
    out.push_str(&row("large gangs (>=64 GPUs) started", &|r| r.large_gangs_started.to_string()));
    out.push_str(&row("  switch domains used (mean)", &|r| format!("{:.2}", r.large_gang_domains_mean)));
    out.push_str(&row("  lower bound (mean)", &|r| format!("{:.2}", r.large_gang_domains_lower_bound_mean)));
    out.push_str(&row("gangs >=256 GPUs: started/arrived", &|r| format!("{}/{}", r.largest_gangs_started, r.largest_gangs)));
    out.push_str(&row("  wait p99 / max", &|r| format!("{}/{}", hours(r.largest_gang_wait_p99_s), hours(r.largest_gang_wait_max_s))));
    out.push_str(&row("whole-node jobs: started/arrived", &|r| format!("{}/{}", r.whole_node_started, r.whole_node_jobs)));
    out.push_str(&row("  wait p50/p90/p99", &|r| {
        let w = r.whole_node_wait_s;
        format!("{}/{}/{}", hours(w[0]), hours(w[1]), hours(w[2]))
    }));
    out.push_str(&row("reservations", &|r| r.reservations.to_string()));
    if reports.iter().any(|r| r.compaction.is_some()) {
        out.push_str(&row("compaction: steps (active)", &|r| ledger_cell(r, |l| format!("{} ({})", l.steps, l.steps - l.steps_idle))));
        out.push_str(&row("  moves run / rolled back", &|r| ledger_cell(r, |l| format!("{} / {}", l.moves_run, l.moves_rolled_back))));
        out.push_str(&row("  chains run / skipped", &|r| ledger_cell(r, |l| format!("{} / {}", l.chains_run, l.chains_skipped))));
        out.push_str(&row("  whole nodes gained (sum)", &|r| ledger_cell(r, |l| l.whole_nodes_gained.to_string())));
        out.push_str(&row("  TB moved (switch/agg/cross)", &|r| {
            ledger_cell(r, |l| {
                let tb = |b: u64| b as f64 / 1e12;
                format!("{:.1}/{:.1}/{:.1}", tb(l.bytes_same_switch), tb(l.bytes_same_aggregation), tb(l.bytes_cross_aggregation))
            })
        }));
        out.push_str(&row("  pause s / overlap GPU-h", &|r| ledger_cell(r, |l| format!("{:.0} / {:.1}", l.pause_s, l.overlap_gpu_s / 3600.0))));
        out.push_str(&row("  plans rejected", &|r| ledger_cell(r, |l| l.plans_rejected.to_string())));
    }
    out.push_str(&row("placement calls", &|r| r.placement_calls.to_string()));
    out.push_str(&row("wall time", &|r| format!("{:.1} s", r.wall_s)));
    if reports.len() > 1 {
        out.push_str(&ranking(reports.iter().map(|r| (r.policy.as_str(), r.allocation_pct, &r.outcome))));
    }
    out
}

/// The runs ranked by outcome, beside their rank by allocation: where the
/// two orders differ, the busier fleet did less work.
pub fn ranking<'a>(runs: impl Iterator<Item = (&'a str, f64, &'a ReplayOutcome)>) -> String {
    let runs: Vec<(&str, f64, &ReplayOutcome)> = runs.collect();
    let order = |key: &dyn Fn(&(&str, f64, &ReplayOutcome)) -> f64| {
        let mut idx: Vec<usize> = (0..runs.len()).collect();
        idx.sort_by(|&a, &b| key(&runs[b]).total_cmp(&key(&runs[a])));
        idx
    };
    let by_outcome = order(&|r| r.2.per_installed_gpu_hour);
    let by_cost = order(&|r| r.2.per_cost.unwrap_or(0.0));
    let by_allocation = order(&|r| r.1);
    let names = |idx: &[usize]| idx.iter().map(|&i| runs[i].0).collect::<Vec<_>>().join(" > ");
    let mut out = format!("ranked by outcome per installed GPU-h: {}\n", names(&by_outcome));
    if runs.iter().all(|r| r.2.per_cost.is_some()) {
        out.push_str(&format!("ranked by outcome per cost:            {}\n", names(&by_cost)));
    }
    out.push_str(&format!("ranked by allocation:                  {}\n", names(&by_allocation)));
    if by_outcome != by_allocation {
        out.push_str("outcome and allocation disagree: the busier fleet is not the one that finished more work\n");
    }
    out
}

/// A ledger figure of a report, or "-" without compaction.
fn ledger_cell(r: &EventReport, f: impl Fn(&Ledger) -> String) -> String {
    r.compaction.as_ref().map_or("-".to_string(), f)
}

/// The accounting tables of one report: denominators per model and in
/// total, stranded GPUs by cause, and the quote.
pub fn accounting_table(r: &EventReport) -> String {
    let a = &r.accounting;
    let mut out = format!("{} at the end of the run\n", r.policy);
    out.push_str(&format!("{:<12}{:>12}{:>12}{:>12}{:>14}{:>12}{:>12}{:>13}\n", "GPUs", "installed", "powered", "healthy", "schedulable", "busy", "productive", "reclaimable"));
    let line = |name: &str, d: &berth_core::accounting::Denominators| {
        format!(
            "{name:<12}{:>12.0}{:>12.0}{:>12.0}{:>14.1}{:>12.1}{:>12.1}{:>13.1}\n",
            d.installed, d.powered, d.healthy, d.schedulable, d.busy, d.productive, d.reclaimable
        )
    };
    for (model, d) in &a.by_model {
        out.push_str(&line(model, d));
    }
    out.push_str(&line("total", &a.total));
    let pct = |x: f64, of: f64| if of > 0.0 { 100.0 * x / of } else { 0.0 };
    out.push_str(&format!(
        "busy: {:.1}% of installed, {:.1}% of healthy; productive: {:.1}% of busy\n",
        pct(a.total.busy, a.total.installed),
        pct(a.total.busy, a.total.healthy),
        pct(a.total.productive, a.total.busy)
    ));
    out.push_str("idle GPUs stranded (no pending shape can use them):");
    if a.stranded.is_empty() {
        out.push_str(" none");
    }
    for (cause, g) in &a.stranded {
        out.push_str(&format!(" {cause:?} {g:.1};"));
    }
    out.push('\n');
    if let Some(q) = &r.quote {
        out.push_str(&quote_line(q));
        out.push('\n');
    }
    out
}

/// A quote for people: how many could start now, when the next could.
pub fn quote_line(q: &Quote) -> String {
    format!(
        "quote: {} could start now; next {}{}",
        q.now,
        q.next_in_s.map_or("not within running work".to_string(), |s| format!("in {:.1} h", s as f64 / 3600.0)),
        match q.meets_deadline {
            Some(true) => "; meets the start deadline",
            Some(false) => "; misses the start deadline",
            None => "",
        }
    )
}
