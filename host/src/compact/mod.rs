//! `berth compact` and `berth replay ... --save-snapshot`: compaction over a
//! saved fleet snapshot, with the core's validation, payback rule,
//! make-before-break execution and ledger (`berth_core::compaction`), and
//! the exact solver ([`milp`]) for small partitions.
//!
//! Snapshot file: JSON, `{"format": "berth-compaction-snapshot",
//! "version": 1, ...}`: the nodes (shape, topology, partition, health),
//! the running allocations (with job, movability, state bytes, remaining
//! time) and the pending shapes. Free capacity is not stored: loading
//! rebuilds it by allocating every running allocation on an empty fleet,
//! so an inconsistent file (an over-committed node) is an error naming the
//! allocation.

pub mod cli;
pub mod milp;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use berth_core::compaction::{self, CompactionConfig, CompactionPolicy, Ledger, Running, SimulatedActuator, Wanted};
use berth_core::fleet::{Fleet, Node, NodeId};
use berth_core::placement::Placer;
use berth_core::task::TaskMeta;
use berth_core::sim::{simulate, SimConfig};
use berth_core::PolicyError;
use berth_sdk::{Plan, Snapshot};
use serde::{Deserialize, Serialize};

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// The format tag and version of snapshot files.
pub const FORMAT: &str = "berth-compaction-snapshot";
pub const VERSION: u32 = 1;

/// One node of a snapshot file (capacity, not what is free).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRecord {
    pub name: String,
    /// Index into `models`; absent for a CPU-only node.
    pub model: Option<u32>,
    pub gpus: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub switch_domain: u32,
    pub aggregation: u32,
    pub partition: u32,
    pub schedulable: bool,
}

/// A saved snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotFile {
    pub format: String,
    pub version: u32,
    /// Where it came from (trace, fleet, policy, seed).
    pub source: String,
    /// The `--at` it was taken at, as given.
    pub at: String,
    /// Simulated time of the snapshot, s.
    pub now_s: u64,
    pub models: Vec<String>,
    pub nodes: Vec<NodeRecord>,
    pub running: Vec<Running>,
    pub pending: Vec<Wanted>,
}

impl SnapshotFile {
    /// Captures a fleet, its running allocations and pending shapes.
    pub fn capture(fleet: &Fleet, running: Vec<Running>, pending: Vec<Wanted>, source: String, at: String, now_s: u64) -> SnapshotFile {
        let nodes = fleet
            .nodes()
            .iter()
            .map(|n| NodeRecord {
                name: n.name.clone(),
                model: n.model,
                gpus: n.gpus.len() as u32,
                cpu_milli: n.cpu_total_milli,
                memory_mib: n.memory_total_mib,
                switch_domain: n.switch_domain,
                aggregation: n.aggregation,
                partition: n.partition,
                schedulable: n.schedulable,
            })
            .collect();
        SnapshotFile { format: FORMAT.into(), version: VERSION, source, at, now_s, models: fleet.models.clone(), nodes, running, pending }
    }

    /// Reads and checks a snapshot file; errors name the file and say what
    /// is wrong.
    pub fn load(path: &Path) -> anyhow::Result<SnapshotFile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading snapshot {}", path.display()))?;
        let head: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("snapshot {}: not JSON", path.display()))?;
        let format = head.get("format").and_then(|f| f.as_str());
        anyhow::ensure!(
            format == Some(FORMAT),
            "snapshot {}: not a Berth compaction snapshot (format {:?}, expected {FORMAT:?}); save one with berth replay ... --save-snapshot FILE --at ...",
            path.display(),
            format
        );
        let version = head.get("version").and_then(|v| v.as_u64());
        anyhow::ensure!(version == Some(u64::from(VERSION)), "snapshot {}: version {:?}, this berth reads version {VERSION}", path.display(), version);
        let file: SnapshotFile = serde_json::from_value(head).with_context(|| format!("snapshot {}: invalid", path.display()))?;
        file.fleet().with_context(|| format!("snapshot {}", path.display()))?;
        Ok(file)
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, serde_json::to_string(self)?).with_context(|| format!("writing snapshot {}", path.display()))
    }

    /// The fleet with every running allocation in place.
    pub fn fleet(&self) -> anyhow::Result<Fleet> {
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for r in &self.nodes {
            let mut n = Node::new(&r.name, r.model, r.gpus as usize, r.cpu_milli, r.memory_mib);
            n.switch_domain = r.switch_domain;
            n.aggregation = r.aggregation;
            n.partition = r.partition;
            n.schedulable = r.schedulable;
            nodes.push(n);
        }
        let mut fleet = Fleet::new(self.models.clone(), nodes)?;
        let mut ids = std::collections::HashSet::new();
        for r in &self.running {
            anyhow::ensure!(ids.insert(r.id), "allocation id {} appears twice", r.id);
            fleet.allocate(&r.allocation()).with_context(|| format!("allocation {} (job {})", r.id, r.job_id))?;
        }
        Ok(fleet)
    }

    pub fn partitions(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self.nodes.iter().map(|n| n.partition).collect();
        p.sort_unstable();
        p.dedup();
        p
    }
}

/// Where `--at` falls: a share of arrivals, or a simulated time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum At {
    /// Percent: of GPU capacity arrived (openb), or of jobs arrived (--fleet).
    Percent(f64),
    Seconds(u64),
}

/// Parses `95%`, `36h`, `90m`, `1.5d`, `7200s` or `7200`.
pub fn parse_at(text: &str) -> anyhow::Result<At> {
    let t = text.trim();
    let num = |s: &str| -> anyhow::Result<f64> {
        let v: f64 = s.trim().parse().with_context(|| format!("--at {text:?}: expected e.g. 95%, 36h, 90m, 1.5d or 7200s"))?;
        anyhow::ensure!(v.is_finite() && v >= 0.0, "--at {text:?} must be a non-negative number");
        Ok(v)
    };
    if let Some(p) = t.strip_suffix('%') {
        let v = num(p)?;
        anyhow::ensure!(v <= 1000.0, "--at {text:?}: percent out of range");
        return Ok(At::Percent(v));
    }
    let (v, unit) = match t.char_indices().last() {
        Some((i, 'd')) => (&t[..i], 86_400.0),
        Some((i, 'h')) => (&t[..i], 3600.0),
        Some((i, 'm')) => (&t[..i], 60.0),
        Some((i, 's')) => (&t[..i], 1.0),
        _ => (t, 1.0),
    };
    Ok(At::Seconds((num(v)? * unit) as u64))
}

/// Saves a snapshot of an openb replay (FGD protocol, one seed) when the
/// arrived GPU demand reaches `at` percent of capacity. Pods placed so far
/// run (their remaining time unknown); pods that fitted nowhere are pending.
pub fn save_openb(
    engine: &Arc<PolicyEngine>,
    nodes: &Path,
    pods: &Path,
    policy_spec: &str,
    seed: u64,
    at: &str,
    out: &Path,
) -> anyhow::Result<SnapshotFile> {
    use crate::replay::{fgd, openb, policy_config};
    let At::Percent(pct) = parse_at(at)? else { anyhow::bail!("--at for an openb replay is a percentage of arrived GPU demand, e.g. 95%") };
    let node_rows = openb::read_nodes(nodes)?;
    let pod_rows = openb::read_pods(pods)?;
    let exp = fgd::Experiment::new(&node_rows, &pod_rows).map_err(anyhow::Error::msg)?;
    let typical = fgd::typical_pods(&exp);
    let mut policy = load_scorer(engine, policy_spec)?;
    policy.configure(&policy_config(&typical, seed))?;
    let (order, tie_rank) = exp.arrival_order(seed);
    let mut fleet = exp.fleet().clone();
    let capacity = fleet.gpu_total_milli() as f64;
    let config = CompactionConfig::default();
    let mut requested = 0f64;
    let mut placer = Placer::new();
    let mut running = Vec::new();
    let mut pending = Vec::new();
    for &i in &order {
        if requested / capacity * 100.0 >= pct {
            break;
        }
        let (pod, shape) = &exp.pods()[i];
        requested += shape.total_gpu_milli() as f64;
        let meta = TaskMeta { job_id: i as u64, class: berth_core::TaskClass::implied(shape.gpu_count), ..TaskMeta::default() };
        match placer.place(&fleet, shape, meta, &mut policy, Some(&tie_rank))? {
            Some(p) => {
                let alloc = Fleet::allocation(p.node, shape, p.gpus);
                fleet.allocate(&alloc)?;
                running.push(Running {
                    id: running.len() as u32,
                    job_id: i as u64,
                    node: alloc.node,
                    gpus: alloc.gpus,
                    gpu_milli: alloc.gpu_milli,
                    cpu_milli: alloc.cpu_milli,
                    memory_mib: alloc.memory_mib,
                    priority: 0,
                    movable: true,
                    gang_id: 0,
                    state_bytes: compaction::estimate_state_bytes(&config, alloc.gpus.count_ones(), alloc.gpu_milli, alloc.memory_mib),
                    remaining_s: 0,
                    running_s: 0,
                    since_checkpoint_s: 0,
                    last_moved_s: None,
                    class: meta.class,
                });
            }
            None => {
                let _ = pod;
                let largest = fleet.nodes().iter().filter(|n| shape.accepts(n.model)).map(|n| n.gpus.len() as u32).max().unwrap_or(u32::MAX);
                pending.push(Wanted {
                    gpu_count: shape.gpu_count,
                    gpu_milli: shape.gpu_milli,
                    cpu_milli: shape.cpu_milli,
                    memory_mib: shape.memory_mib,
                    model: (shape.models.len() == 1).then(|| shape.models[0]),
                    tasks: 1,
                    whole_nodes: u32::from(shape.gpu_milli == 1000 && shape.gpu_count >= largest),
                });
            }
        }
    }
    let file = SnapshotFile::capture(
        &fleet,
        running,
        pending,
        format!("openb {} with {policy_spec}, seed {seed}", pods.display()),
        at.to_string(),
        0,
    );
    file.save(out)?;
    Ok(file)
}

/// Saves a snapshot of an event-driven replay (`--fleet`) at `at`: the core
/// simulation runs with its horizon at the snapshot time.
pub fn save_event(
    engine: &Arc<PolicyEngine>,
    fleet: &Fleet,
    jobs: &[berth_core::sim::Job],
    guards: &berth_core::sim::Guards,
    policy_spec: &str,
    source: String,
    at: &str,
    out: &Path,
) -> anyhow::Result<SnapshotFile> {
    let now = match parse_at(at)? {
        At::Seconds(s) => s,
        At::Percent(p) => {
            let mut arrivals: Vec<u64> = jobs.iter().map(|j| j.arrival_s).collect();
            arrivals.sort_unstable();
            anyhow::ensure!(!arrivals.is_empty(), "no jobs");
            let k = ((p / 100.0) * arrivals.len() as f64).ceil() as usize;
            arrivals[k.clamp(1, arrivals.len()) - 1] + 1
        }
    };
    let path = crate::catalog::resolve(policy_spec)?;
    let loaded = LoadedPolicy::from_file(engine, &path).with_context(|| format!("loading {}", path.display()))?;
    let mut policy = WasmPolicy::new(engine.clone(), loaded, Limits::default());
    let mut fleet = fleet.clone();
    let outcome = simulate(&mut fleet, jobs, &mut policy, SimConfig { horizon_s: now, high_priority: 0, guards: guards.clone(), ..SimConfig::default() })?;
    let config = CompactionConfig::default();
    let mut running = Vec::new();
    for (end, j, allocs) in &outcome.running_at_end {
        let job = &jobs[*j];
        let start = outcome.jobs[*j].start_s.unwrap_or(now);
        for a in allocs {
            running.push(Running {
                id: running.len() as u32,
                job_id: job.id,
                node: a.node,
                gpus: a.gpus,
                gpu_milli: a.gpu_milli,
                cpu_milli: a.cpu_milli,
                memory_mib: a.memory_mib,
                priority: job.priority,
                movable: true,
                gang_id: if job.tasks > 1 { job.id + 1 } else { 0 },
                state_bytes: compaction::estimate_state_bytes(&config, a.gpus.count_ones(), a.gpu_milli, a.memory_mib),
                remaining_s: end.saturating_sub(now),
                running_s: now.saturating_sub(start),
                since_checkpoint_s: now.saturating_sub(start),
                last_moved_s: None,
                class: job.task_class(),
            });
        }
    }
    let pending = outcome
        .pending_at_end
        .iter()
        .map(|&j| {
            let nodes = compaction::partition_nodes(&fleet, jobs[j].partition);
            Wanted::from_job(&fleet, &nodes, &jobs[j])
        })
        .collect();
    let file = SnapshotFile::capture(&fleet, running, pending, source, at.to_string(), now);
    file.fleet().context("captured snapshot")?;
    file.save(out)?;
    Ok(file)
}

/// A placement scorer for the openb snapshot: wasm.
fn load_scorer(engine: &Arc<PolicyEngine>, spec: &str) -> anyhow::Result<WasmPolicy> {
    let path = crate::catalog::resolve(spec)?;
    let loaded = LoadedPolicy::from_file(engine, &path).with_context(|| format!("loading {}", path.display()))?;
    Ok(WasmPolicy::new(engine.clone(), loaded, Limits::default()))
}

/// Times the policy's `compact` calls (decision time).
pub struct Timed<'a> {
    pub inner: &'a mut dyn CompactionPolicy,
    pub elapsed: Duration,
    pub calls: u32,
}

impl CompactionPolicy for Timed<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError> {
        let t = Instant::now();
        let r = self.inner.compact(snapshot);
        self.elapsed += t.elapsed();
        self.calls += 1;
        r
    }
}

/// A compaction policy by name or path: `ipc-native` is the IPC policy
/// compiled into this binary; anything else is a wasm component.
pub fn load_policy(engine: &Arc<PolicyEngine>, spec: &str, config: &str, deadline: Duration) -> anyhow::Result<Box<dyn CompactionPolicy>> {
    if spec == "ipc-native" {
        let mut p = crate::native::NativePolicy::<berth_policy_ipc::Ipc>::default();
        p.configure(config)?;
        return Ok(Box::new(p));
    }
    let path = crate::catalog::resolve(spec)?;
    let loaded = LoadedPolicy::from_file(engine, &path).with_context(|| format!("loading {}", path.display()))?;
    anyhow::ensure!(
        loaded.info.hooks.contains(berth_sdk::Hooks::COMPACT),
        "policy {} does not implement the compact hook (hooks: {})",
        loaded.info.name,
        loaded.info.hooks
    );
    let mut p = WasmPolicy::new(engine.clone(), loaded, Limits { deadline, ..Limits::default() });
    p.configure(config)?;
    Ok(Box::new(p))
}

/// Per-partition result of `berth compact`.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionResult {
    pub partition: u32,
    pub nodes: usize,
    pub gpu_nodes: u64,
    pub partial_before: u64,
    pub partial_after: u64,
    /// Change in partially occupied nodes, %.
    pub partial_change_pct: f64,
    pub idle_before: u64,
    pub idle_after: u64,
    pub moves: u64,
    pub chains_run: u64,
    pub decision_ms: f64,
    pub rejected: Option<String>,
    pub ledger: Ledger,
    /// Exact optimum for partitions of at most `milp::MAX_NODES` nodes.
    pub exact: Option<milp::Gap>,
}

/// The whole `berth compact` answer.
#[derive(Clone, Debug, Serialize)]
pub struct CompactReport {
    pub snapshot: String,
    pub source: String,
    pub at: String,
    pub policy: String,
    pub config: CompactionConfig,
    pub partitions: Vec<PartitionResult>,
    pub total: Ledger,
    pub decision_ms: f64,
    pub max_partition_decision_ms: f64,
}

/// Options of `berth compact`.
pub struct CompactOptions<'a> {
    pub policy: &'a str,
    pub policy_config: &'a str,
    pub partition: Option<u32>,
    pub deadline: Duration,
    /// Also solve partitions of at most `milp::MAX_NODES` nodes exactly.
    pub exact: bool,
    pub exact_time_limit: Duration,
    /// Compaction settings (hysteresis is bypassed: `berth compact` always
    /// asks the policy).
    pub config: CompactionConfig,
}

/// Runs one compaction step per partition of a snapshot.
pub fn run(engine: &Arc<PolicyEngine>, path: &Path, opts: &CompactOptions) -> anyhow::Result<CompactReport> {
    let file = SnapshotFile::load(path)?;
    let mut fleet = file.fleet()?;
    let mut policy = load_policy(engine, opts.policy, opts.policy_config, opts.deadline)?;
    let name = policy.describe();
    let mut config = opts.config.clone();
    config.start_partial_pct = 0.0;
    config.stop_partial_pct = 0.0;
    config.check().map_err(anyhow::Error::msg)?;
    let partitions = match opts.partition {
        Some(p) => {
            anyhow::ensure!(file.partitions().contains(&p), "partition {p} is not in the snapshot (it has {:?})", file.partitions());
            vec![p]
        }
        None => file.partitions(),
    };
    let mut running = file.running.clone();
    let mut results = Vec::new();
    let mut total = Ledger::default();
    for p in partitions {
        let nodes = compaction::partition_nodes(&fleet, Some(p));
        let pending: Vec<Wanted> = file.pending.clone();
        let before = (opts.exact && nodes.len() <= milp::MAX_NODES).then(|| (fleet.clone(), running.clone()));
        let mut timed = Timed { inner: policy.as_mut(), elapsed: Duration::ZERO, calls: 0 };
        let mut active = true;
        let out = compaction::step(&mut fleet, &nodes, &mut running, &pending, &mut timed, &config, &mut active, &mut SimulatedActuator, file.now_s)?;
        let l = &out.ledger;
        let (_, _, gpu_nodes) = compaction::occupancy(&fleet, &nodes);
        // The exact solve starts from the heuristic's end state (so a time
        // limit never reports worse than the heuristic).
        let exact = match before {
            Some((f0, r0)) => {
                let mut e = milp::solve(&f0, &nodes, &r0, Some(&running), &config, file.now_s, opts.exact_time_limit)?;
                e.heuristic_idle = l.idle_nodes_after;
                e.heuristic_moves = l.moves_run;
                Some(e)
            }
            None => None,
        };
        results.push(PartitionResult {
            partition: p,
            nodes: nodes.len(),
            gpu_nodes,
            partial_before: l.partial_nodes_before,
            partial_after: l.partial_nodes_after,
            partial_change_pct: pct_change(l.partial_nodes_before, l.partial_nodes_after),
            idle_before: l.idle_nodes_before,
            idle_after: l.idle_nodes_after,
            moves: l.moves_run,
            chains_run: l.chains_run,
            decision_ms: timed.elapsed.as_secs_f64() * 1e3,
            rejected: out.rejected.clone(),
            ledger: l.clone(),
            exact,
        });
        total.add(l);
    }
    fleet.check_invariants().map_err(anyhow::Error::msg)?;
    let decision_ms = results.iter().map(|r| r.decision_ms).sum();
    let max_partition_decision_ms = results.iter().map(|r| r.decision_ms).fold(0.0, f64::max);
    Ok(CompactReport {
        snapshot: path.display().to_string(),
        source: file.source,
        at: file.at,
        policy: name,
        config,
        partitions: results,
        total,
        decision_ms,
        max_partition_decision_ms,
    })
}

fn pct_change(before: u64, after: u64) -> f64 {
    if before == 0 { 0.0 } else { 100.0 * (after as f64 - before as f64) / before as f64 }
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// The text report: per partition before/after, then the ledger totals.
pub fn table(r: &CompactReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "snapshot {} ({}, at {}), policy {}", r.snapshot, r.source, r.at, r.policy);
    let _ = writeln!(
        s,
        "{:>9} {:>6} {:>15} {:>12} {:>8} {:>6} {:>11} {:>10}",
        "partition", "nodes", "partial b->a", "change", "idle b->a", "moves", "decision", "exact"
    );
    for p in &r.partitions {
        let exact = match &p.exact {
            Some(e) => format!("{} idle{}", e.optimum_idle, if e.proven_optimal { "" } else { "?" }),
            None => "-".into(),
        };
        let _ = writeln!(
            s,
            "{:>9} {:>6} {:>15} {:>11.1}% {:>8} {:>6} {:>9.1}ms {:>10}",
            p.partition,
            p.nodes,
            format!("{} -> {}", p.partial_before, p.partial_after),
            p.partial_change_pct,
            format!("{}->{}", p.idle_before, p.idle_after),
            p.moves,
            p.decision_ms,
            exact
        );
        if let Some(why) = &p.rejected {
            let _ = writeln!(s, "          rejected: {why}");
        }
    }
    let t = &r.total;
    let _ = writeln!(s, "\ntotal: partially occupied nodes {} -> {} ({:+.1}%), idle nodes {} -> {} ({:+} whole nodes)",
        t.partial_nodes_before, t.partial_nodes_after, pct_change(t.partial_nodes_before, t.partial_nodes_after),
        t.idle_nodes_before, t.idle_nodes_after, t.whole_nodes_gained);
    let _ = writeln!(s, "decision time: {:.1} ms in all, {:.1} ms for the slowest partition", r.decision_ms, r.max_partition_decision_ms);
    let _ = writeln!(s, "ledger:");
    let _ = writeln!(s, "  plans {} (rejected {}), chains planned {} / run {} / skipped (payback) {} / abandoned {}",
        t.plans, t.plans_rejected, t.chains_planned, t.chains_run, t.chains_skipped, t.chains_abandoned);
    let _ = writeln!(s, "  moves planned {} / run {} / rolled back {}", t.moves_planned, t.moves_run, t.moves_rolled_back);
    let _ = writeln!(s, "  bytes moved {}: same switch {}, same aggregation {}, cross aggregation {}",
        gb(t.bytes_moved()), gb(t.bytes_same_switch), gb(t.bytes_same_aggregation), gb(t.bytes_cross_aggregation));
    let _ = writeln!(s, "  overlap {:.0} s ({:.0} GPU-s held twice), pause {:.0} s, warm-up {:.0} s",
        t.overlap_s, t.overlap_gpu_s, t.pause_s, t.warmup_s);
    let _ = writeln!(s, "  pending shapes startable {} -> {}{}", t.pending_startable_before, t.pending_startable_after,
        if t.gang_unblocked { " (a waiting gang can now start)" } else { "" });
    for p in r.partitions.iter().filter_map(|p| p.exact.as_ref().map(|e| (p.partition, e))) {
        let (part, e) = p;
        let _ = writeln!(s, "exact (partition {part}): optimum {} idle nodes with {} moves{} in {:.0} ms; heuristic {} idle with {} moves: gap {} nodes",
            e.optimum_idle, e.optimum_moves, if e.proven_optimal { "" } else { " (time limit: best found)" }, e.solve_ms,
            e.heuristic_idle, e.heuristic_moves, e.optimum_idle as i64 - e.heuristic_idle as i64);
    }
    s
}

/// Nodes with model ids for tests that build small fleets.
pub fn node_ids(fleet: &Fleet) -> Vec<NodeId> {
    (0..fleet.nodes().len() as NodeId).collect()
}
