//! `berth replay --pool <toml>`: model pools (Aegaeon) compared under pool
//! policies. The pool file (the embedded `default` is
//! `examples/pool/market.toml`) gives the GPU, the cost model, the SLO
//! targets and the catalog; `[workload]` the seeded synthetic generator
//! (or `--azure <csv>` the Azure LLM inference trace spread over the
//! catalog); `[search]` the search bounds. For each policy: GPUs needed for
//! the SLO target, attainment and goodput at one fixed pool, and the
//! highest arrival rate that pool sustains.

pub mod load;
pub mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use berth_core::PolicyError;
use berth_core::pool::{self, CostModel, GpuSpec, ModelSpec, PoolConfig, PoolOutcome, PoolPolicy, Request, RunOptions, Slo, Synthetic};
use serde::{Deserialize, Serialize};

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// The embedded default market: 47 models on H20 (see the file).
pub const MARKET_TOML: &str = include_str!("../../../examples/pool/market.toml");

/// The four bundled pool policies, in report order.
pub const DEFAULT_POLICIES: [&str; 4] = ["pool-dedicated", "pool-scale-to-zero", "pool-muxserve", "pool-token"];

/// The pool file: a `PoolConfig` plus the workload and search settings.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFile {
    #[serde(default)]
    pub gpu: GpuSpec,
    #[serde(default)]
    pub cost: CostModel,
    #[serde(default)]
    pub slo: Slo,
    #[serde(default = "replan")]
    pub replan_interval_s: f64,
    #[serde(default)]
    pub workload: Workload,
    #[serde(default)]
    pub search: Search,
    pub models: Vec<ModelSpec>,
}

fn replan() -> f64 {
    10.0
}

/// The workload: the synthetic generator's settings; with an Azure trace,
/// its arrivals and token counts replace the generator's, the first
/// `synthetic.duration_s` seconds of it, time compressed by `rate_scale`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Workload {
    #[serde(flatten)]
    pub synthetic: Synthetic,
}

/// Search bounds.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Search {
    /// Most executors per tensor-parallel class the GPU search tries.
    pub max_executors: u32,
    /// The pool at which attainment, goodput and the sustained rate are
    /// measured, as GPUs per class `[[tp, gpus], ...]`; empty: the GPUs
    /// token-level pooling (the last policy) needs.
    pub fixed: Vec<(u32, u32)>,
    /// Rate multipliers the sustained-rate search spans, and its precision.
    pub rate_min: f64,
    pub rate_max: f64,
    pub rate_precision: f64,
}

impl Default for Search {
    fn default() -> Self {
        Search { max_executors: 256, fixed: Vec::new(), rate_min: 0.05, rate_max: 16.0, rate_precision: 0.03 }
    }
}

impl PoolFile {
    /// `default` for the embedded market, else a path.
    pub fn load(spec: &str) -> anyhow::Result<PoolFile> {
        let (text, name) = if spec == "default" {
            (MARKET_TOML.to_string(), "the embedded default market".to_string())
        } else {
            (std::fs::read_to_string(spec).with_context(|| format!("reading {spec}"))?, spec.to_string())
        };
        let file: PoolFile = crate::text::parse_toml(&text).with_context(|| format!("parsing {name}"))?;
        file.config().validate().map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        Ok(file)
    }

    pub fn config(&self) -> PoolConfig {
        PoolConfig { gpu: self.gpu.clone(), cost: self.cost.clone(), slo: self.slo, replan_interval_s: self.replan_interval_s, models: self.models.clone() }
    }
}

/// One Azure trace row, as read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceRow {
    pub t_s: f64,
    pub prompt: u32,
    pub output: u32,
}

/// Reads an Azure LLM inference trace (`TIMESTAMP,ContextTokens,
/// GeneratedTokens`, timestamps `YYYY-MM-DD HH:MM:SS[.fraction]`), with
/// times relative to the first row. A bad row is an error naming the file,
/// the line and the field.
pub fn read_azure(path: &Path) -> anyhow::Result<Vec<TraceRow>> {
    let mut reader = csv::ReaderBuilder::new().has_headers(true).from_path(path).with_context(|| format!("opening {}", path.display()))?;
    let headers = reader.headers().with_context(|| format!("{}: reading the header", path.display()))?.clone();
    let col = |name: &str| -> anyhow::Result<usize> {
        headers.iter().position(|h| h.trim() == name).ok_or_else(|| anyhow::anyhow!("{}: no {name} column in the header", path.display()))
    };
    let (ct, cp, co) = (col("TIMESTAMP")?, col("ContextTokens")?, col("GeneratedTokens")?);
    let mut rows = Vec::new();
    let mut first: Option<f64> = None;
    for record in reader.records() {
        let record = record.with_context(|| format!("{}: malformed CSV", path.display()))?;
        let line = record.position().map(|p| p.line()).unwrap_or(0);
        let field = |i: usize, name: &str| -> anyhow::Result<&str> {
            record.get(i).map(str::trim).ok_or_else(|| anyhow::anyhow!("{}:{line}: missing field {name}", path.display()))
        };
        let ts = field(ct, "TIMESTAMP")?;
        let t = parse_timestamp(ts).ok_or_else(|| anyhow::anyhow!("{}:{line}: TIMESTAMP {ts:?} is not YYYY-MM-DD HH:MM:SS[.f]", path.display()))?;
        let num = |i: usize, name: &str| -> anyhow::Result<u32> {
            let v = field(i, name)?;
            v.parse::<u32>().map_err(|e| anyhow::anyhow!("{}:{line}: {name} {v:?}: {e}", path.display()))
        };
        let prompt = num(cp, "ContextTokens")?;
        let output = num(co, "GeneratedTokens")?;
        let base = *first.get_or_insert(t);
        if t < base {
            bail!("{}:{line}: TIMESTAMP {ts} is before the first row's", path.display());
        }
        rows.push(TraceRow { t_s: t - base, prompt: prompt.max(1), output: output.max(1) });
    }
    if rows.is_empty() {
        bail!("{}: no rows", path.display());
    }
    rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
    Ok(rows)
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, proleptic
/// Gregorian), or `None` if malformed.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let (y, m, day): (i64, i64, i64) = (d.next()?.parse().ok()?, d.next()?.parse().ok()?, d.next()?.parse().ok()?);
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let (hh, mm): (i64, i64) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    let ss: f64 = t.next()?.parse().ok()?;
    if t.next().is_some() || !(0..24).contains(&hh) || !(0..60).contains(&mm) || !(0.0..61.0).contains(&ss) {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

/// Where the requests come from.
#[derive(Clone, Debug)]
pub enum Source {
    Synthetic,
    Azure(Arc<Vec<TraceRow>>, PathBuf),
}

/// Builds the workload at `multiplier` x the base arrival rate: the same
/// number of requests arriving `multiplier` times faster (the generator's
/// rate scaled and its duration divided; the trace's first `duration_s`
/// seconds with times divided), so every probe of a rate search weighs the
/// same sample.
pub fn requests(file: &PoolFile, source: &Source, seed: u64, multiplier: f64) -> Vec<Request> {
    let syn = &file.workload.synthetic;
    let n = file.models.len();
    match source {
        Source::Synthetic => Synthetic { rate: syn.rate * multiplier, duration_s: syn.duration_s / multiplier, ..syn.clone() }.generate(n, seed),
        Source::Azure(rows, _) => {
            let mut out: Vec<Request> = rows
                .iter()
                .filter(|r| r.t_s < syn.duration_s)
                .map(|r| Request { arrival_s: r.t_s / multiplier, model: 0, prompt_tokens: r.prompt.min(32_768), output_tokens: r.output.min(8_192) })
                .collect();
            pool::spread(&mut out, &pool::popularity(n, syn.skew, seed), seed);
            out
        }
    }
}

/// What one policy measured.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    pub contract: String,
    /// GPUs needed for the SLO target (`None`: not reached within the search).
    pub gpus_needed: Option<u32>,
    pub layout_needed: Option<Vec<(u32, u32)>>,
    /// The run at the GPUs needed (or the largest tried).
    pub at_needed: PoolOutcome,
    pub search_runs: u32,
    /// The run at the fixed pool.
    pub at_fixed: PoolOutcome,
    /// Highest arrival-rate multiplier the fixed pool sustains at the target.
    pub max_rate_multiplier: f64,
    pub max_rate_rps: f64,
    pub seconds: f64,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub source: String,
    pub seed: u64,
    /// Models in the catalog.
    pub models: usize,
    pub requests: usize,
    pub base_rate_rps: f64,
    pub slo: Slo,
    pub fixed_layout: Vec<(u32, u32)>,
    pub fixed_gpus: u32,
    pub policies: Vec<PolicyReport>,
    pub seconds: f64,
}

/// Options of one comparison.
pub struct Options {
    pub policies: Vec<String>,
    pub seed: u64,
    pub limits: Limits,
    pub progress: bool,
}

/// Runs every policy: GPUs needed, then the fixed pool (given, or the last
/// policy's GPUs needed), then the sustained rate on it.
pub fn compare(engine: Arc<PolicyEngine>, file: &PoolFile, source: &Source, opts: &Options) -> anyhow::Result<Comparison> {
    let started = Instant::now();
    let cfg = file.config();
    let base = requests(file, source, opts.seed, 1.0);
    anyhow::ensure!(!base.is_empty(), "the workload has no requests");
    let span = base.last().map(|r| r.arrival_s).unwrap_or(1.0).max(1e-9);
    let mut loaded = Vec::new();
    for name in &opts.policies {
        let path = crate::catalog::resolve(name)?;
        let l = LoadedPolicy::from_file(&engine, &path).map_err(|e| anyhow::anyhow!("policy {name}: {e}"))?;
        let probe = WasmPolicy::new(engine.clone(), l.clone(), opts.limits);
        if matches!(l.contract, "0.1.0" | "0.2.0") {
            bail!("policy {name} is a berth:policy@{} component: it does not implement the pool hooks (contract 0.3.0 or later)", l.contract);
        }
        if !probe.has_pool_hooks() {
            bail!("policy {name} claims neither pool-place nor pool-step: it is not a pool policy");
        }
        loaded.push((name.clone(), l));
    }
    let factory = |l: &Arc<LoadedPolicy>| {
        let (engine, l, limits) = (engine.clone(), l.clone(), opts.limits);
        move || -> Result<Box<dyn PoolPolicy>, PolicyError> {
            let mut p = WasmPolicy::new(engine.clone(), l.clone(), limits);
            p.warm()?;
            Ok(Box::new(p))
        }
    };
    let mut reports = Vec::new();
    for (name, l) in &loaded {
        let t = Instant::now();
        let needed = pool::gpus_needed(&cfg, &base, file.search.max_executors, &mut factory(l)).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        if opts.progress {
            eprintln!("pool: {name}: {} GPUs needed ({} runs, {:.1} s)", needed.gpus.map_or("not reached".into(), |g| g.to_string()), needed.runs, t.elapsed().as_secs_f64());
        }
        reports.push(PolicyReport {
            policy: name.clone(),
            contract: l.contract.to_string(),
            gpus_needed: needed.gpus,
            layout_needed: needed.layout.clone(),
            at_needed: needed.outcome,
            search_runs: needed.runs,
            at_fixed: PoolOutcome::default(),
            max_rate_multiplier: 0.0,
            max_rate_rps: 0.0,
            seconds: t.elapsed().as_secs_f64(),
        });
    }
    // The fixed pool: as configured (GPUs per class), else what the last
    // policy (token-level pooling by default) needs.
    let fixed: Vec<(u32, u32)> = if !file.search.fixed.is_empty() {
        let mut layout = Vec::new();
        for &(tp, gpus) in &file.search.fixed {
            anyhow::ensure!(tp > 0 && gpus % tp == 0, "search.fixed: {gpus} GPUs is not a multiple of tp {tp}");
            layout.push((tp, gpus / tp));
        }
        for tp in cfg.classes() {
            anyhow::ensure!(layout.iter().any(|l| l.0 == tp), "search.fixed names no GPUs for tp {tp}");
        }
        layout
    } else {
        match reports.last().and_then(|r| r.layout_needed.clone()) {
            Some(l) => l,
            None => bail!("the last policy reached no GPU count; give search.fixed in the pool file"),
        }
    };
    let fixed_gpus = fixed.iter().map(|&(tp, c)| tp * c).sum();
    for (k, (name, l)) in loaded.iter().enumerate() {
        let t = Instant::now();
        let opts_run = RunOptions { layout: fixed.clone(), record_steps: false };
        let mut p = factory(l)()?;
        reports[k].at_fixed = pool::run(&cfg, &base, &opts_run, &mut *p).map_err(|e| anyhow::anyhow!("{name}: {e}"))?.0;
        let k_max = pool::max_rate(
            &cfg,
            &fixed,
            file.search.rate_min,
            file.search.rate_max,
            file.search.rate_precision,
            &mut |m| requests(file, source, opts.seed, m),
            &mut factory(l),
        )
        .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        reports[k].max_rate_multiplier = k_max;
        reports[k].max_rate_rps = k_max * base.len() as f64 / span;
        reports[k].seconds += t.elapsed().as_secs_f64();
        if opts.progress {
            eprintln!("pool: {name}: sustains x{k_max:.2} of the base rate on {fixed_gpus} GPUs ({:.1} s)", t.elapsed().as_secs_f64());
        }
    }
    let source_name = match source {
        Source::Synthetic => format!("synthetic ({:.2} req/s, {:.0} s, Zipf {:.2})", file.workload.synthetic.rate, file.workload.synthetic.duration_s, file.workload.synthetic.skew),
        Source::Azure(_, path) => format!("{} (first {:.0} s, Zipf {:.2})", path.display(), file.workload.synthetic.duration_s, file.workload.synthetic.skew),
    };
    Ok(Comparison {
        source: source_name,
        seed: opts.seed,
        models: file.models.len(),
        requests: base.len(),
        base_rate_rps: base.len() as f64 / span,
        slo: cfg.slo,
        fixed_layout: fixed,
        fixed_gpus,
        policies: reports,
        seconds: started.elapsed().as_secs_f64(),
    })
}
