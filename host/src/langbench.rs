//! `berth bench languages`: what the guest language costs. For each policy
//! (by default best-fit in Rust, Python, JavaScript and C): component size,
//! load time from a precompiled artifact, one scoring call, and one openb
//! replay, each beside the first policy's (the reference).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use berth_core::PlacementPolicy;
use serde::Serialize;

use crate::replay::{self, ReplayOptions};
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};
use crate::{bench, catalog};

#[derive(Debug, Serialize)]
pub struct LanguageRow {
    pub policy: String,
    pub component_bytes: u64,
    /// Median time to load the component from its cached precompiled
    /// artifact: read, deserialize, link, and the `info` probe.
    pub load_ms: f64,
    /// Median of one scoring call over `candidates` nodes.
    pub score_us: f64,
    pub score_ratio: f64,
    /// Wall time of the replay (one seed, one worker).
    pub replay_s: f64,
    pub replay_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct LanguageBench {
    pub candidates: usize,
    /// What was replayed.
    pub trace: String,
    pub seed: u64,
    pub rows: Vec<LanguageRow>,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Runs `f` at least `min` times and until `budget` is spent (after three
/// warm-up runs); the median.
fn time(budget: Duration, min: usize, mut f: impl FnMut()) -> Duration {
    for _ in 0..3 {
        f();
    }
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < min || (start.elapsed() < budget && samples.len() < 10_000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    median(samples)
}

/// The openb folder: `$BERTH_OPENB_DIR`, else `../shared/data/openb` from
/// the current directory; `None` when absent (a generated trace is used).
pub fn openb_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("BERTH_OPENB_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("../shared/data/openb"));
    dir.join("openb_node_list_gpu_node.csv").is_file().then_some(dir)
}

/// Measures each policy; `engine` should have an artifact cache (the CLI's
/// has), or "load" includes compiling.
pub fn run(engine: Arc<PolicyEngine>, specs: &[String], candidates: usize, seed: u64, openb: Option<&Path>) -> anyhow::Result<LanguageBench> {
    anyhow::ensure!(!specs.is_empty(), "no policies given");
    let (task, mut nodes) = bench::batch(candidates, 7);
    let trace = openb.map(|d| (d.join("openb_node_list_gpu_node.csv"), d.join("openb_pod_list_default.csv")));
    let mut rows: Vec<LanguageRow> = Vec::new();
    for spec in specs {
        let path = catalog::resolve(spec)?;
        let bytes = std::fs::read(&path).with_context(|| path.display().to_string())?;
        // The first load compiles and caches the artifact; later ones load it.
        let loaded = LoadedPolicy::from_bytes(&engine, &bytes)?;
        let load = time(Duration::from_millis(500), 5, || {
            std::hint::black_box(LoadedPolicy::from_bytes(&engine, &bytes).expect("loads"));
        });

        let mut policy = WasmPolicy::new(engine.clone(), loaded.clone(), Limits::default());
        policy.warm()?;
        policy.score(&task, &mut nodes)?;
        let score = time(Duration::from_millis(1500), 20, || {
            std::hint::black_box(policy.score(&task, &mut nodes).expect("scores"));
        });

        let opts = ReplayOptions {
            trace: trace.clone(),
            synthetic_nodes: 400,
            policies: vec![path.to_string_lossy().into_owned()],
            seeds: vec![seed],
            keep_order: false,
            native: false,
            workers: 1,
            progress: false,
            decisions_dir: None,
            typical_from: None,
            limits: crate::wasm::Limits::default(),
            extra_config: Default::default(),
        };
        let started = Instant::now();
        replay::run(engine.clone(), &opts)?;
        let replay_s = started.elapsed().as_secs_f64();

        let (score_ref, replay_ref) = rows.first().map_or((score.as_secs_f64() * 1e6, replay_s), |r| (r.score_us, r.replay_s));
        rows.push(LanguageRow {
            policy: loaded.info.name.clone(),
            component_bytes: bytes.len() as u64,
            load_ms: load.as_secs_f64() * 1e3,
            score_us: score.as_secs_f64() * 1e6,
            score_ratio: score.as_secs_f64() * 1e6 / score_ref,
            replay_s,
            replay_ratio: replay_s / replay_ref,
        });
    }
    Ok(LanguageBench {
        candidates,
        trace: trace.map_or_else(|| "generated trace (400 nodes)".into(), |(_, pods)| pods.display().to_string()),
        seed,
        rows,
    })
}

/// The README's table.
pub fn table(b: &LanguageBench) -> String {
    let mut out = String::from("| policy | component | load (cached artifact) | score call | vs Rust | openb replay | vs Rust |\n|---|---|---|---|---|---|---|\n");
    for r in &b.rows {
        out.push_str(&format!(
            "| {} | {} | {:.1} ms | {:.0} us | {:.2}x | {:.2} s | {:.1}x |\n",
            r.policy,
            human_bytes(r.component_bytes),
            r.load_ms,
            r.score_us,
            r.score_ratio,
            r.replay_s,
            r.replay_ratio
        ));
    }
    out
}

fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 { format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64) } else { format!("{} KiB", n.div_ceil(1024)) }
}

/// One policy's cost on a non-placement hook.
#[derive(Debug, Serialize)]
pub struct HookRow {
    pub policy: String,
    pub component_bytes: u64,
    pub calls: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    /// p50 as a ratio to the first policy's.
    pub ratio: f64,
    /// Bytes the instance holds (memories and tables) after the calls.
    pub instance_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct HookBench {
    pub hook: String,
    /// What each call got.
    pub input: String,
    pub seed: u64,
    pub rows: Vec<HookRow>,
}

/// The bundled policies `berth bench languages --hook` compares by
/// default: the Rust one first.
pub fn default_policies(hook: &str) -> Vec<String> {
    let names: &[&str] = match hook {
        "rank" => &["spot-gpu", "spot-gpu-py"],
        "compact" => &["drain", "drain-js"],
        "pool" => &["pool-demand", "pool-demand-c"],
        _ => &["best-fit", "best-fit-py", "best-fit-js", "best-fit-c"],
    };
    names.iter().map(|s| s.to_string()).collect()
}

/// Victim lists for `rank`: `n` allocations of about `n / 2` jobs, whole
/// and shared GPUs, three priorities, checkpoints up to half an hour old.
fn victims(n: usize, rng: &mut berth_core::pool::SplitMix) -> berth_sdk::Allocations {
    let mut v = berth_sdk::Allocations::default();
    for i in 0..n {
        let shared = rng.below(4) == 0;
        v.push(berth_sdk::AllocationRow {
            id: i as u32,
            job_id: rng.below(n.div_ceil(2)) as u64,
            node: rng.below(n.div_ceil(8)) as u32,
            gpus: if shared { 1 << rng.below(8) } else { (1u64 << (1 + rng.below(8))) - 1 },
            gpu_milli: if shared { 100 * (1 + rng.below(9)) as u32 } else { 1000 },
            cpu_milli: 4000,
            memory_mib: 8192,
            priority: rng.below(3) as u32,
            movable: true,
            running_s: 3600,
            since_checkpoint_s: 60 * rng.below(30) as u64,
            ..Default::default()
        });
    }
    v
}

/// A partition for `compact`: `nodes` 8-GPU nodes filled first fit with
/// 1-, 2- and 4-GPU and shared-GPU work to about 90%, then a third of
/// the work ended at random (the fragments compaction is for).
fn fragmented(nodes: usize, rng: &mut berth_core::pool::SplitMix) -> berth_sdk::Snapshot {
    let mut free = vec![[1000u32; 8]; nodes];
    let mut placed: Vec<(usize, u64, u32)> = Vec::new();
    for _ in 0..nodes * 6 {
        let (count, milli) = match rng.below(5) {
            0 => (1, 250 * (1 + rng.below(3)) as u32),
            1 => (1, 1000),
            2 => (2, 1000),
            3 => (4, 1000),
            _ => (1, 500),
        };
        let start = rng.below(nodes);
        for k in (0..nodes).map(|j| (start + j) % nodes) {
            let fits: Vec<usize> = (0..8).filter(|&g| free[k][g] >= milli).take(count).collect();
            if fits.len() == count {
                fits.iter().for_each(|&g| free[k][g] -= milli);
                placed.push((k, fits.iter().fold(0, |m, &g| m | 1 << g), milli));
                break;
            }
        }
        if free.iter().map(|f| f.iter().map(|&x| u64::from(x)).sum::<u64>()).sum::<u64>() < nodes as u64 * 800 {
            break;
        }
    }
    let mut s = berth_sdk::Snapshot::default();
    let mut cpu = vec![0u32; nodes];
    for (i, &(k, mask, milli)) in placed.iter().enumerate() {
        if rng.below(3) == 0 {
            (0..8).filter(|g| mask >> g & 1 == 1).for_each(|g| free[k][g] += milli);
            continue;
        }
        cpu[k] += 4000;
        s.allocations.push(berth_sdk::AllocationRow {
            id: i as u32,
            job_id: i as u64,
            node: k as u32,
            gpus: mask,
            gpu_milli: milli,
            cpu_milli: 4000,
            memory_mib: 16_384,
            movable: true,
            running_s: 3600,
            since_checkpoint_s: 600,
            state_bytes: 10 << 30,
            ..Default::default()
        });
    }
    s.nodes.models = vec!["H20".into()];
    for (k, f) in free.iter().enumerate() {
        let kinds = s.allocations.node.iter().zip(&s.allocations.gpus).zip(&s.allocations.gpu_milli).filter(|((n, _), _)| **n as usize == k);
        let kinds = kinds.fold(0u64, |b, ((_, g), m)| b | 1 << berth_sdk::alloc_kind_bit(g.count_ones(), *m).unwrap_or(0));
        s.nodes.push(k as u32, 0, (k / 32) as u32, 128_000 - cpu[k].min(128_000), 128_000, 1 << 20, 1 << 20, f, kinds);
    }
    s
}

/// Percentile `q` (0..=1) of `v`, sorted.
fn quantile(v: &[Duration], q: f64) -> Duration {
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Times every call of one policy on `hook`'s inputs.
fn hook_calls(policy: &mut WasmPolicy, hook: &str, seed: u64) -> anyhow::Result<(String, Vec<Duration>)> {
    use berth_core::pool::{self, PoolPolicy, RunOptions, SplitMix, Synthetic};
    let mut rng = SplitMix::new(seed);
    let mut times = Vec::new();
    let input = match hook {
        "rank" => {
            let demand = berth_sdk::Task { job_id: 1, gpu_count: 8, gpu_milli: 1000, priority: 9, gang_size: 1, ..Default::default() };
            let lists: Vec<_> = (0..50).map(|_| victims(64, &mut rng)).collect();
            for round in 0..5 {
                for v in &lists {
                    let mut v = v.clone();
                    let t = Instant::now();
                    policy.rank(&demand, &mut v)?;
                    if round > 0 {
                        times.push(t.elapsed());
                    }
                }
            }
            "victim lists of 64 allocations (about 32 jobs)".to_string()
        }
        "compact" => {
            let snapshots: Vec<_> = (0..10).map(|_| fragmented(256, &mut rng)).collect();
            for round in 0..4 {
                for s in &snapshots {
                    let mut s = s.clone();
                    let t = Instant::now();
                    policy.compact(&mut s)?;
                    if round > 0 {
                        times.push(t.elapsed());
                    }
                }
            }
            let mean = snapshots.iter().map(|s| s.allocations.len()).sum::<usize>() / snapshots.len();
            format!("snapshots of 256 partly used 8-GPU nodes ({mean} allocations)")
        }
        "pool" => {
            struct Timed<'a>(&'a mut WasmPolicy, &'a mut Vec<Duration>);
            impl PoolPolicy for Timed<'_> {
                fn describe(&self) -> String {
                    PoolPolicy::describe(&*self.0)
                }
                fn pool_place(&mut self, s: &berth_sdk::PoolState) -> Result<Option<berth_sdk::PoolPlacement>, berth_core::PolicyError> {
                    let t = Instant::now();
                    let r = self.0.pool_place(s);
                    self.1.push(t.elapsed());
                    r
                }
                fn pool_step(&mut self, x: &berth_sdk::PoolExecutor) -> Result<Option<berth_sdk::PoolStep>, berth_core::PolicyError> {
                    let t = Instant::now();
                    let r = self.0.pool_step(x);
                    self.1.push(t.elapsed());
                    r
                }
            }
            let file = crate::pool::PoolFile::load("default")?;
            let cfg = file.config();
            let requests = Synthetic { rate: 2.0, duration_s: 300.0, ..file.workload.synthetic.clone() }.generate(cfg.models.len(), seed);
            let opts = RunOptions { layout: vec![(1, 4), (4, 2)], record_steps: false };
            pool::run(&cfg, &requests, &opts, &mut Timed(policy, &mut times)).map_err(|e| anyhow::anyhow!("{e}"))?;
            format!("every pool-place and pool-step of a pool simulation (47 models on 4 + 2 executors, {} requests)", requests.len())
        }
        other => anyhow::bail!("unknown hook {other:?}; one of: rank, compact, pool (place: without --hook)"),
    };
    times.sort_unstable();
    Ok((input, times))
}

/// Measures each policy on `hook` (rank, compact or pool): call latency
/// p50/p99 and the instance's memory, beside the first policy's.
pub fn hooks(engine: Arc<PolicyEngine>, hook: &str, specs: &[String], seed: u64) -> anyhow::Result<HookBench> {
    anyhow::ensure!(!specs.is_empty(), "no policies given");
    let mut rows: Vec<HookRow> = Vec::new();
    let mut input = String::new();
    for spec in specs {
        let path = catalog::resolve(spec)?;
        let bytes = std::fs::read(&path).with_context(|| path.display().to_string())?;
        let loaded = LoadedPolicy::from_bytes(&engine, &bytes)?;
        let mut policy = WasmPolicy::new(engine.clone(), loaded.clone(), Limits::default());
        policy.warm()?;
        let (what, times) = hook_calls(&mut policy, hook, seed).with_context(|| format!("{spec} on {hook}"))?;
        anyhow::ensure!(!times.is_empty(), "{spec}: no {hook} calls");
        input = what;
        let p50 = quantile(&times, 0.5).as_secs_f64() * 1e6;
        let reference = rows.first().map_or(p50, |r| r.p50_us);
        rows.push(HookRow {
            policy: loaded.info.name.clone(),
            component_bytes: bytes.len() as u64,
            calls: times.len(),
            p50_us: p50,
            p99_us: quantile(&times, 0.99).as_secs_f64() * 1e6,
            ratio: p50 / reference,
            instance_bytes: policy.memory_bytes(),
        });
    }
    Ok(HookBench { hook: hook.to_string(), input, seed, rows })
}

/// The docs' table of one hook.
pub fn hook_table(b: &HookBench) -> String {
    let mut out = String::from("| hook | policy | component | calls | p50 | p99 | p50 vs first | instance memory |\n|---|---|---|---|---|---|---|---|\n");
    for r in &b.rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} us | {:.0} us | {:.2}x | {} |\n",
            b.hook,
            r.policy,
            human_bytes(r.component_bytes),
            r.calls,
            r.p50_us,
            r.p99_us,
            r.ratio,
            human_bytes(r.instance_bytes)
        ));
    }
    out
}
