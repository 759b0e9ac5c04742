//! `berth bench score`: one placement-scoring call timed in wasm and in the
//! same policy compiled natively.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::PlacementPolicy;
use berth_sdk::{Nodes, Task};
use serde::Serialize;

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};
use crate::{catalog, native, synth};

#[derive(Debug, Serialize)]
pub struct ScoreBench {
    pub policy: String,
    pub candidates: usize,
    /// Median wall time of one scoring call through wasm, in ns.
    pub wasm_ns: u64,
    /// Median of the same call compiled natively (null: no native build).
    pub native_ns: Option<u64>,
    /// wasm_ns / native_ns.
    pub ratio: Option<f64>,
    /// Median time to instantiate the pre-linked component, in ns.
    pub instantiate_ns: u64,
    pub samples: usize,
}

/// A batch of `n` partly occupied nodes and a half-GPU task.
pub fn batch(n: usize, seed: u64) -> (Task, Nodes) {
    let fleet = synth::fleet(n, seed, true);
    let mut nodes = Nodes { models: fleet.models.clone(), ..Nodes::default() };
    for (i, node) in fleet.nodes().iter().enumerate() {
        nodes.push(
            i as u32,
            node.model.unwrap_or(0),
            node.switch_domain,
            node.cpu_free_milli,
            node.cpu_total_milli,
            node.memory_free_mib,
            node.memory_total_mib,
            &node.gpus,
            node.alloc_kinds(),
        );
    }
    let task = Task { job_id: 0, gpu_count: 1, gpu_milli: 500, cpu_milli: 4000, memory_mib: 16 << 10, gang_size: 1, ..Task::default() };
    (task, nodes)
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Times `f` until `budget` is spent (at least `min` runs) and returns the
/// median sample in ns.
fn time_calls(budget: Duration, min: usize, mut f: impl FnMut()) -> (u64, usize) {
    for _ in 0..3 {
        f();
    }
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < min || (start.elapsed() < budget && samples.len() < 100_000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_nanos() as u64);
    }
    let n = samples.len();
    (median(samples), n)
}

pub fn score(engine: Arc<PolicyEngine>, spec: &str, candidates: usize) -> anyhow::Result<ScoreBench> {
    let path = catalog::resolve(spec)?;
    let loaded = LoadedPolicy::from_file(&engine, &path)?;
    let name = loaded.info.name.clone();
    let (task, mut nodes) = batch(candidates, 7);
    let budget = Duration::from_millis(1500);

    let (instantiate_ns, _) = time_calls(Duration::from_millis(300), 10, || {
        let mut p = WasmPolicy::new(engine.clone(), loaded.clone(), Limits::default());
        p.warm().expect("instantiate");
    });

    let mut wasm = WasmPolicy::new(engine.clone(), loaded.clone(), Limits::default());
    let wasm_answer = wasm.score(&task, &mut nodes)?;
    let (wasm_ns, samples) = time_calls(budget, 20, || {
        std::hint::black_box(wasm.score(&task, &mut nodes).expect("wasm score"));
    });

    let native_ns = match native::by_name(&name) {
        Some(mut p) => {
            let native_answer = p.score(&task, &mut nodes)?;
            anyhow::ensure!(native_answer == wasm_answer, "native and wasm builds of {name} disagree");
            Some(
                time_calls(budget, 20, || {
                    std::hint::black_box(p.score(&task, &mut nodes).expect("native score"));
                })
                .0,
            )
        }
        None => None,
    };
    Ok(ScoreBench {
        policy: name,
        candidates,
        wasm_ns,
        native_ns,
        ratio: native_ns.map(|n| wasm_ns as f64 / n.max(1) as f64),
        instantiate_ns,
        samples,
    })
}

#[derive(Debug, Serialize)]
pub struct PlaceBench {
    pub policy: String,
    pub nodes: usize,
    pub jobs: usize,
    pub tasks_placed: u64,
    /// Wall time to place one job (all its tasks, or find it does not fit).
    pub job_p50_us: f64,
    pub job_p99_us: f64,
    pub job_max_us: f64,
    /// Same, for single-task jobs only.
    pub single_p99_us: f64,
    /// Tasks placed per second on one core.
    pub placements_per_s: f64,
}

/// Places the first `jobs` jobs of the default ASI workload on a fleet
/// config, one after another with no departures, timing each job.
pub fn place(engine: Arc<PolicyEngine>, spec: &str, fleet_spec: &str, scale: f64, jobs: usize) -> anyhow::Result<PlaceBench> {
    use crate::asi::{fleet::FleetConfig, workload::WorkloadConfig};
    let (mut fleet, _) = FleetConfig::load(fleet_spec)?.scaled(scale).build()?;
    let workload = WorkloadConfig { days: 2.0, ..WorkloadConfig::default() }.generate(&fleet);
    let loaded = LoadedPolicy::from_file(&engine, &catalog::resolve(spec)?)?;
    let mut policy = WasmPolicy::new(engine, loaded.clone(), Limits::default());
    policy.warm()?;
    let mut placer = berth_core::Placer::new();
    let mut per_job = Vec::new();
    let mut single = Vec::new();
    let mut tasks = 0u64;
    let mut calls = 0u64;
    let started = Instant::now();
    for job in workload.iter().take(jobs) {
        let t = Instant::now();
        let placed = berth_core::sim::place_gang(&mut fleet, &mut placer, &mut policy, job, &mut calls, &|_, _| true)?;
        let ns = t.elapsed().as_nanos() as u64;
        per_job.push(ns);
        if job.tasks == 1 {
            single.push(ns);
        }
        if placed.is_some() {
            tasks += u64::from(job.tasks);
        }
    }
    let total = started.elapsed().as_secs_f64();
    per_job.sort_unstable();
    single.sort_unstable();
    let pct = |v: &[u64], p: f64| crate::asi::report::percentile(v, p * 100.0) as f64 / 1e3;
    Ok(PlaceBench {
        policy: loaded.info.name.clone(),
        nodes: fleet.nodes().len(),
        jobs: per_job.len(),
        tasks_placed: tasks,
        job_p50_us: pct(&per_job, 0.5),
        job_p99_us: pct(&per_job, 0.99),
        job_max_us: per_job.last().map_or(0.0, |&n| n as f64 / 1e3),
        single_p99_us: pct(&single, 0.99),
        placements_per_s: tasks as f64 / total,
    })
}

/// Score-call latency of one policy through an openb replay.
#[derive(Debug, Serialize)]
pub struct ReplayScoreBench {
    pub policy: String,
    /// Nodes of the cluster (the most candidates one call can carry).
    pub nodes: usize,
    pub calls: usize,
    /// Mean candidates per call (nodes that fit the task).
    pub mean_candidates: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// Times every scoring call of the policy while it replays one seed of an
/// openb pod list under the FGD protocol (wasm, one thread): the decision
/// cost as the cluster fills, not one fixed batch.
pub fn score_replay(engine: Arc<PolicyEngine>, spec: &str, nodes: &std::path::Path, pods: &std::path::Path, seed: u64) -> anyhow::Result<ReplayScoreBench> {
    let (exp, config) = crate::replay::openb_trace_config(nodes, pods, seed)?;
    let loaded = LoadedPolicy::from_file(&engine, &catalog::resolve(spec)?)?;
    let mut inner = WasmPolicy::new(engine, loaded.clone(), Limits::default());
    inner.configure(&config)?;
    inner.warm()?;
    let mut timed = Timed { inner, samples: Vec::new(), candidates: 0 };
    exp.run(seed, &mut timed, false, |_| {})?;
    let mut samples = timed.samples;
    anyhow::ensure!(!samples.is_empty(), "the replay made no scoring call");
    samples.sort_unstable();
    let pct = |p: f64| crate::asi::report::percentile(&samples, p) as f64 / 1e3;
    Ok(ReplayScoreBench {
        policy: loaded.info.name.clone(),
        nodes: exp.fleet().nodes().len(),
        calls: samples.len(),
        mean_candidates: timed.candidates as f64 / samples.len() as f64,
        p50_us: pct(50.0),
        p99_us: pct(99.0),
        max_us: samples.last().map_or(0.0, |&n| n as f64 / 1e3),
    })
}

/// A policy whose scoring calls are timed one by one.
struct Timed {
    inner: WasmPolicy,
    samples: Vec<u64>,
    candidates: u64,
}

impl PlacementPolicy for Timed {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<berth_sdk::Scores, berth_core::PolicyError> {
        self.candidates += nodes.len() as u64;
        let t = Instant::now();
        let answer = self.inner.score(task, nodes);
        self.samples.push(t.elapsed().as_nanos() as u64);
        answer
    }
}
