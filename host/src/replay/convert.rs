//! `berth capture convert`: a trace turned into the capture format, so
//! that every replay of jobs reads one kind of input (`berth replay
//! --events`).
//!
//! A trace says what arrived and how long it ran; a capture says what a
//! host was given and what it decided. The conversion runs the trace
//! through the engine (the simulated world of `berth replay --fleet`) under
//! one placement policy, with the engine capturing its inputs as a live
//! host's does: the file is what a host given that trace would have
//! recorded. Its exact replay must then decide the same again (a check
//! that simulation and capture agree), and its counterfactual puts other
//! policies beside the converting one on the same arrivals and durations.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use berth_core::capture::{Input, PolicyRef, FORMAT, VERSION};
use berth_core::engine::{Deciders, Guards, SimConfig};
use berth_core::{Fleet, Job};

use crate::capture::{Header, Line};
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// `berth capture convert ...`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// An openb trace: its node list and pod list (eleven columns: each
    /// pod's creation and deletion times are its arrival and duration;
    /// pods without both are left out, and counted).
    #[arg(long, num_args = 2, value_names = ["NODES_CSV", "PODS_CSV"], conflicts_with = "fleet")]
    openb: Option<Vec<PathBuf>>,
    /// An ASI-like fleet: `asi` (embedded) or a fleet config TOML, with the
    /// jobs of --workload (or the default generated workload).
    #[arg(long, required_unless_present = "openb")]
    fleet: Option<String>,
    #[command(flatten)]
    trace: FleetTraceArgs,
    /// Seed of a generated --fleet workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The placement policy the converted run decides with (its component's
    /// sha256 is in the file, as a live host's would be).
    #[arg(long, default_value = "binpack")]
    policy: String,
    /// A preemption ranking policy (as a partition's rank version): the
    /// order in which high-priority work takes GPUs back from low-priority
    /// work. Without it, the engine's own order, as on a live partition.
    #[arg(long)]
    rank: Option<String>,
    /// The partition name written in the file's header.
    #[arg(long, default_value = "converted")]
    partition: String,
    /// Write here instead of standard output.
    #[arg(long, short)]
    out: Option<PathBuf>,
    /// Per-call deadline of the policies in milliseconds of CPU time.
    #[arg(long, default_value_t = 100)]
    deadline_ms: u64,
}

/// What a `--fleet` trace is made of, beside the fleet config (shared by
/// `berth replay --fleet` and `berth capture convert --fleet`).
#[derive(clap::Args, Clone, Debug)]
pub struct FleetTraceArgs {
    /// Scale every node count of the fleet config (e.g. 0.05 for 1,000 nodes).
    #[arg(long, default_value_t = 1.0, requires = "fleet")]
    pub fleet_scale: f64,
    /// Workload for --fleet: `asi` (ASI's job mix, the default), `backlog`
    /// (that mix plus a large low-priority backlog), `colocated` (that mix
    /// plus a CPU-only job per GPU job), a TOML config of the
    /// generator, or a CSV of jobs (id,class,arrival_s,duration_s,tasks,
    /// gpus,gpu_milli,cpu_milli,memory_mib,model).
    #[arg(long, requires = "fleet")]
    pub workload: Option<PathBuf>,
    /// Simulated days of arrivals for --fleet (overrides the workload's).
    #[arg(long, requires = "fleet")]
    pub days: Option<f64>,
}

/// A fleet and the jobs of a trace, ready to simulate.
pub struct Trace {
    pub fleet: Fleet,
    pub jobs: Vec<Job>,
    pub horizon_s: u64,
    pub guards: Guards,
    /// What the trace was, for the report.
    pub setting: String,
}

/// An ASI-like fleet and its jobs, as `berth replay --fleet` builds them.
pub struct FleetTrace {
    pub config: crate::asi::fleet::FleetConfig,
    pub fleet: Fleet,
    pub topology: crate::asi::fleet::Topology,
    pub jobs: Vec<Job>,
    pub days: f64,
}

/// Builds `--fleet SPEC` (scaled) and its jobs: a job CSV, or a workload
/// config generated with `seed` over `days` (the config's when `None`; a
/// CSV runs until its last job could have ended).
pub fn fleet_trace(spec: &str, args: &FleetTraceArgs, seed: u64) -> anyhow::Result<FleetTrace> {
    let (scale, workload, days) = (args.fleet_scale, args.workload.as_deref(), args.days);
    use crate::asi::{fleet::FleetConfig, workload::WorkloadConfig};
    anyhow::ensure!(scale > 0.0 && scale <= 10.0, "--fleet-scale must be in (0, 10]");
    let config = FleetConfig::load(spec)?.scaled(scale);
    let (fleet, topology) = config.build()?;
    let csv_jobs = match workload {
        Some(path) if path.extension().is_some_and(|e| e == "csv") => Some(crate::asi::workload::read_csv(path, &fleet)?),
        _ => None,
    };
    let mut generated = match workload {
        Some(path) if csv_jobs.is_none() => WorkloadConfig::load(&path.to_string_lossy())?,
        _ => WorkloadConfig::default(),
    };
    if let Some(days) = days {
        generated.days = days;
    }
    generated.check().context("workload")?;
    generated.seed = seed;
    let jobs = match csv_jobs {
        Some(jobs) => {
            if days.is_none() {
                // Run until the last job could have ended.
                generated.days = jobs.iter().map(|j| j.arrival_s + j.duration_s).max().unwrap_or(0) as f64 / 86_400.0 + 1e-6;
            }
            jobs
        }
        None => generated.generate(&fleet),
    };
    Ok(FleetTrace { config, fleet, topology, jobs, days: generated.days })
}

/// An openb trace as jobs: each pod one single-task job arriving at its
/// creation time and running until its deletion; best-effort pods are low
/// priority. Returns the pods left out for lack of times.
pub fn openb_trace(nodes: &Path, pods: &Path) -> anyhow::Result<(Trace, usize)> {
    use crate::asi::workload::{HIGH_PRIORITY, LOW_PRIORITY};
    let node_rows = super::openb::read_nodes(nodes)?;
    let pod_rows = super::openb::read_pods(pods)?;
    let exp = super::fgd::Experiment::new(&node_rows, &pod_rows).map_err(|e| anyhow::anyhow!("{}: {e}", pods.display()))?;
    let mut jobs = Vec::new();
    let mut untimed = 0;
    for (id, (pod, shape)) in exp.pods().iter().enumerate() {
        let (Some(created), Some(deleted)) = (pod.creation_time, pod.deletion_time) else {
            untimed += 1;
            continue;
        };
        let low = pod.qos.eq_ignore_ascii_case("BE");
        jobs.push(Job {
            id: id as u64 + 1,
            class: if shape.gpu_count == 0 { crate::asi::workload::CPU_ONLY as u8 } else if low { 1 } else { 0 },
            priority: if low { LOW_PRIORITY } else { HIGH_PRIORITY },
            arrival_s: created,
            duration_s: deleted.saturating_sub(created).max(1),
            tasks: 1,
            shape: shape.clone(),
            partition: None,
            contract: None,
            reports_exit: false,
            declared_class: None,
        });
    }
    anyhow::ensure!(!jobs.is_empty(), "{}: no pod has both a creation and a deletion time (a five-column pod list has neither)", pods.display());
    let horizon_s = jobs.iter().map(|j| j.arrival_s + j.duration_s).max().unwrap_or(0) + 1;
    let setting = format!("openb {} ({} nodes) with {} ({} pods timed)", nodes.display(), exp.fleet().nodes().len(), pods.display(), jobs.len());
    Ok((Trace { fleet: exp.fleet().clone(), jobs, horizon_s, guards: Guards::default(), setting }, untimed))
}

/// Runs `trace` under `placement` (and `rank`) with the engine capturing,
/// and writes the capture (one segment) to `out`. Returns the inputs
/// written.
pub fn write_capture(
    engine: &Arc<PolicyEngine>,
    trace: &Trace,
    placement: &Arc<LoadedPolicy>,
    rank: Option<&Arc<LoadedPolicy>>,
    limits: Limits,
    partition: &str,
    out: &mut dyn Write,
) -> anyhow::Result<usize> {
    let mut policy = WasmPolicy::new(engine.clone(), placement.clone(), limits);
    let mut ranker = rank.map(|r| WasmPolicy::new(engine.clone(), r.clone(), limits));
    // As on a live partition: high priority takes GPUs back, in the rank
    // version's order or the engine's own.
    let mut default = super::events::DefaultRanking;
    let preemption: &mut dyn berth_core::preemption::PreemptionPolicy = match ranker.as_mut() {
        Some(r) => r,
        None => &mut default,
    };
    let deciders = Deciders { placement: &mut policy, preemption: Some(preemption), compaction: None };
    let config = SimConfig { horizon_s: trace.horizon_s, high_priority: crate::asi::workload::HIGH_PRIORITY, guards: trace.guards.clone(), ..SimConfig::default() };
    let arms = Input::Arms {
        place: PolicyRef { sha256: placement.hash.clone(), config: String::new(), instance: 0 },
        split: None,
        rank: rank.map(|r| PolicyRef { sha256: r.hash.clone(), config: String::new(), instance: 0 }),
    };
    let mut fleet = trace.fleet.clone();
    let (_, inputs) = berth_core::sim::simulate_captured(&mut fleet, &trace.jobs, deciders, config, vec![arms]).map_err(|e| anyhow::anyhow!("{}: {e}", placement.info.name))?;
    fleet.check_invariants().map_err(anyhow::Error::msg)?;
    let header = Header { format: FORMAT.into(), version: VERSION, partition: partition.into(), segment: 1, part: 0, started_unix_ms: 0, window: None };
    serde_json::to_writer(&mut *out, &header)?;
    out.write_all(b"\n")?;
    // Simulated time stands for the wall clock: second 0 is the epoch.
    let mut now_s = 0;
    for input in &inputs {
        now_s = input.now().unwrap_or(now_s);
        serde_json::to_writer(&mut *out, &Line { unix_ms: now_s.saturating_mul(1000), input: input.clone() })?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(inputs.len())
}

/// `berth capture convert`.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let engine = Arc::new(PolicyEngine::new(PolicyEngine::default_cache_dir())?);
    let trace = match (&args.openb, &args.fleet) {
        (Some(files), _) => {
            let (trace, untimed) = openb_trace(&files[0], &files[1])?;
            if untimed > 0 {
                eprintln!("{untimed} pods without a creation or deletion time left out");
            }
            trace
        }
        (None, Some(spec)) => {
            let t = fleet_trace(spec, &args.trace, args.seed)?;
            let guards = t.config.guards().with_context(|| format!("fleet config {spec}"))?;
            let setting = format!("{spec} fleet: {} nodes, {} jobs over {:.1} days, seed {}", t.fleet.nodes().len(), t.jobs.len(), t.days, args.seed);
            Trace { fleet: t.fleet, jobs: t.jobs, horizon_s: (t.days * 86_400.0) as u64, guards, setting }
        }
        (None, None) => anyhow::bail!("give --openb NODES PODS or --fleet SPEC"),
    };
    let load = |spec: &str| -> anyhow::Result<Arc<LoadedPolicy>> {
        let path = crate::catalog::resolve(spec)?;
        LoadedPolicy::from_file(&engine, &path).with_context(|| format!("loading {}", path.display()))
    };
    let placement = load(&args.policy)?;
    let rank = args.rank.as_deref().map(load).transpose()?;
    let limits = Limits { deadline: std::time::Duration::from_millis(args.deadline_ms.max(1)), clock: crate::wasm::DeadlineClock::ThreadCpu, ..Default::default() };
    eprintln!("{}: simulating {} jobs with {} ...", trace.setting, trace.jobs.len(), placement.info.name);
    let inputs = match &args.out {
        Some(path) => {
            let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            write_capture(&engine, &trace, &placement, rank.as_ref(), limits, &args.partition, &mut w).with_context(|| format!("writing {}", path.display()))?
        }
        None => write_capture(&engine, &trace, &placement, rank.as_ref(), limits, &args.partition, &mut std::io::BufWriter::new(std::io::stdout().lock()))?,
    };
    eprintln!("{inputs} inputs written (replay them with `berth replay --events`)");
    Ok(())
}
