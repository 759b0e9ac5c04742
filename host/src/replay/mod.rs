//! Trace replay: readers, the FGD protocol, reports. Runs every (policy,
//! seed) pair, seeds in parallel, each pair on its own policy instance.

pub mod convert;
pub mod events;
pub mod fgd;
pub mod openb;
pub mod report;
pub mod synthetic;
pub mod variants;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use berth_core::PlacementPolicy;

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};
use crate::{catalog, native};
use fgd::Experiment;
pub use report::{ReplayOutcome, RunSummary};
use report::Curve;

/// What to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Trace files; `None`: a generated trace of `synthetic_nodes` nodes.
    pub trace: Option<(PathBuf, PathBuf)>,
    pub synthetic_nodes: usize,
    /// Policy names or component paths.
    pub policies: Vec<String>,
    pub seeds: Vec<u64>,
    pub keep_order: bool,
    /// Run the policies' native builds instead of wasm (benchmarks only).
    pub native: bool,
    /// Worker threads; 0 = one per core.
    pub workers: usize,
    pub progress: bool,
    /// Take the typical pods from this pod list instead of the replayed one
    /// (when the replayed list is another simulator's tuned order).
    pub typical_from: Option<PathBuf>,
    /// Write each run's decisions as `<dir>/<policy>-seed<seed>.csv`.
    pub decisions_dir: Option<PathBuf>,
    /// Per-call limits of the wasm policies (tests on a loaded machine
    /// give a longer deadline).
    pub limits: Limits,
    /// Keys added to every policy's configuration (a policy's own settings,
    /// e.g. berth-frag's `weights`, for parameter sweeps on real traces).
    pub extra_config: serde_json::Map<String, serde_json::Value>,
}

/// The most bytes of `--policy-config` text accepted (a settings object, not
/// a data file).
pub const EXTRA_CONFIG_LIMIT: usize = 64 * 1024;

/// Parses `--policy-config`: a JSON object of at most [`EXTRA_CONFIG_LIMIT`]
/// bytes whose keys are not the ones replay sets itself.
pub fn parse_extra_config(text: &str) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    anyhow::ensure!(text.len() <= EXTRA_CONFIG_LIMIT, "{} bytes, more than the {EXTRA_CONFIG_LIMIT} accepted", text.len());
    let value: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
    let serde_json::Value::Object(map) = value else { anyhow::bail!("not a JSON object (e.g. {{\"weights\": {{\"cpu\": 1}}}})") };
    for key in ["seed", "typical_pods"] {
        anyhow::ensure!(!map.contains_key(key), "key {key:?} is set by replay itself");
    }
    Ok(map)
}

/// The configuration every replayed policy receives: the seed (for
/// policies that draw random numbers) and the workload's typical pods (for
/// fragmentation-aware policies). Policies ignore what they do not use.
pub fn policy_config(typical: &[fgd::TypicalPod], seed: u64) -> String {
    policy_config_with(typical, seed, &serde_json::Map::new())
}

/// [`policy_config`] plus the keys of `extra` (`--policy-config`).
pub fn policy_config_with(typical: &[fgd::TypicalPod], seed: u64, extra: &serde_json::Map<String, serde_json::Value>) -> String {
    let mut config = serde_json::json!({ "seed": seed, "typical_pods": typical });
    if let serde_json::Value::Object(map) = &mut config {
        map.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    config.to_string()
}

/// An openb trace read from its node and pod lists, and the configuration
/// replay gives each policy on it with `seed` ([`policy_config`]).
pub fn openb_trace_config(nodes: &std::path::Path, pods: &std::path::Path, seed: u64) -> anyhow::Result<(Experiment, String)> {
    let exp = Experiment::new(&openb::read_nodes(nodes)?, &openb::read_pods(pods)?).map_err(anyhow::Error::msg).with_context(|| pods.display().to_string())?;
    let config = policy_config(&fgd::typical_pods(&exp), seed);
    Ok((exp, config))
}

enum Source {
    Wasm(Arc<LoadedPolicy>),
    Native(String),
}

pub fn run(engine: Arc<PolicyEngine>, opts: &ReplayOptions) -> anyhow::Result<ReplayOutcome> {
    anyhow::ensure!(!opts.policies.is_empty(), "no policy given (--policy NAME|PATH, repeatable)");
    anyhow::ensure!(!opts.seeds.is_empty(), "no seeds given");
    let (nodes, pods, label) = match &opts.trace {
        Some((nodes, pods)) => (openb::read_nodes(nodes)?, openb::read_pods(pods)?, pods.display().to_string()),
        None => {
            let (n, p) = synthetic::trace(opts.synthetic_nodes, 1);
            (n, p, "generated trace".to_string())
        }
    };
    let exp = Experiment::new(&nodes, &pods).map_err(anyhow::Error::msg).with_context(|| label)?;
    let typical = match &opts.typical_from {
        Some(path) => {
            let source = Experiment::new(&nodes, &openb::read_pods(path)?).map_err(anyhow::Error::msg)?;
            fgd::typical_pods(&source)
        }
        None => fgd::typical_pods(&exp),
    };

    let mut sources = Vec::new();
    let mut names = Vec::new();
    for spec in &opts.policies {
        if opts.native {
            let name = spec.clone();
            anyhow::ensure!(native::by_name(&name).is_some(), "no native build of policy {name:?} (native: {:?})", native::NATIVE_POLICIES);
            names.push(name.clone());
            sources.push(Source::Native(name));
        } else {
            let path = catalog::resolve(spec)?;
            let loaded = LoadedPolicy::from_file(&engine, &path).with_context(|| format!("loading {}", path.display()))?;
            names.push(loaded.info.name.clone());
            sources.push(Source::Wasm(loaded));
        }
    }

    let jobs: Vec<(usize, u64)> = (0..sources.len()).flat_map(|p| opts.seeds.iter().map(move |&s| (p, s))).collect();
    let pods_per_run = exp.arrival_order(opts.seeds[0]).0.len() as u64;
    let bar = if opts.progress {
        let bar = indicatif::ProgressBar::new(pods_per_run * jobs.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {percent}% {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<fgd::RunResult, String>>>> = Mutex::new(vec![None; jobs.len()]);
    let workers = if opts.workers == 0 { std::thread::available_parallelism().map_or(2, |n| n.get()) } else { opts.workers };
    std::thread::scope(|scope| {
        for _ in 0..workers.min(jobs.len()) {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(p, seed)) = jobs.get(k) else { break };
                    let config = policy_config_with(&typical, seed, &opts.extra_config);
                    let outcome = (|| -> anyhow::Result<fgd::RunResult> {
                        let mut policy: Box<dyn PlacementPolicy> = match &sources[p] {
                            Source::Wasm(loaded) => {
                                let mut w = WasmPolicy::new(engine.clone(), loaded.clone(), opts.limits);
                                w.configure(&config)?;
                                Box::new(w)
                            }
                            Source::Native(name) => {
                                let mut n = native::by_name(name).expect("checked above");
                                n.configure(&config)?;
                                n
                            }
                        };
                        Ok(exp.run(seed, &mut *policy, opts.keep_order, |n| bar.inc(n as u64))?)
                    })();
                    bar.set_message(format!("{} seed {seed}", names[p]));
                    results.lock().expect("no worker panics")[k] = Some(outcome.map_err(|e| format!("{} seed {seed}: {e:#}", names[p])));
                }
            });
        }
    });
    bar.finish_and_clear();

    let results = results.into_inner().expect("no worker panics");
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for (p, name) in names.iter().enumerate() {
        let mut curves: Vec<Curve> = Vec::new();
        for (k, &(jp, seed)) in jobs.iter().enumerate() {
            if jp != p {
                continue;
            }
            let r = results[k].clone().expect("every job ran").map_err(anyhow::Error::msg)?;
            if let Some(dir) = &opts.decisions_dir {
                std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
                let path = dir.join(format!("{name}-seed{seed}.csv"));
                std::fs::write(&path, exp.decisions_csv(&r)).with_context(|| path.display().to_string())?;
            }
            runs.push(RunSummary {
                policy: name.clone(),
                seed,
                pods_offered: r.pods_offered,
                pods_placed: r.pods_placed,
                final_unallocated_pct: r.final_unallocated_pct,
            });
            curves.push(r.curve);
        }
        rows.extend(report::aggregate(name, &curves));
    }
    Ok(ReplayOutcome { policies: names, rows, runs })
}

/// Parses `42-51` or `42,45,50` or `7`.
pub fn parse_seeds(text: &str) -> anyhow::Result<Vec<u64>> {
    let mut seeds = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if let Some((a, b)) = part.split_once('-') {
            let (a, b): (u64, u64) = (a.trim().parse().context("seed range start")?, b.trim().parse().context("seed range end")?);
            anyhow::ensure!(a <= b, "seed range {part:?} is empty");
            anyhow::ensure!(b - a < 10_000, "seed range {part:?} is too long");
            seeds.extend(a..=b);
        } else {
            seeds.push(part.parse().with_context(|| format!("seed {part:?} is not a number"))?);
        }
    }
    Ok(seeds)
}
