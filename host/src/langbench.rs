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
