//! Model pools (Aegaeon, SOSP'25): many rarely used LLMs served by few GPUs.
//!
//! A pool is a set of *executors*: groups of `tp` GPUs that run one model's
//! batch at a time (a model is served only by executors of its own
//! tensor-parallel degree). Two policy hooks decide ([`PoolPolicy`]):
//! which models each executor serves or keeps resident (`pool-place`), and at
//! each scheduling step of an executor which model's work runs next and how
//! (`pool-step`). This module is the deterministic simulator around them:
//! per-executor memory accounting (resident weights + reserved KV cache,
//! never over-committed, checked by the host on every step), a host-memory
//! weight cache, a cost model for prefill, decode and weight loads, an event
//! loop in simulated time, SLO accounting, and the searches for "GPUs needed
//! for 99% SLO attainment" and "highest sustained arrival rate".
//!
//! Simplifications, stated: the engine is a cost model, not a GPU; a step
//! runs one model's batch on its whole executor; KV cache is reserved for a
//! request's full length at admission (so memory can be checked exactly);
//! prefill cost is linear in tokens (no attention-quadratic term); one
//! decode step's iteration time is fixed at its start.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use berth_sdk::{PoolExecutor, PoolPhase, PoolPlacement, PoolState, PoolStep};
use serde::{Deserialize, Serialize};

use crate::policy::PolicyError;

const GB: f64 = 1e9;

/// One GPU kind. Defaults: NVIDIA H20 (96 GB HBM3, 4.0 TB/s, 148 TFLOPS
/// dense BF16, from NVIDIA's H20 datasheet), the GPU of Aegaeon's beta.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuSpec {
    pub name: String,
    pub memory_gb: f64,
    pub hbm_tb_per_s: f64,
    pub bf16_tflops: f64,
}

impl Default for GpuSpec {
    fn default() -> Self {
        GpuSpec { name: "H20".into(), memory_gb: 96.0, hbm_tb_per_s: 4.0, bf16_tflops: 148.0 }
    }
}

/// One model of the catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// Parameters, billions.
    pub params_b: f64,
    /// Bytes per parameter (2 for BF16/FP16, 1 for FP8/INT8).
    #[serde(default = "two")]
    pub bytes_per_param: f64,
    /// Tensor-parallel degree: GPUs per executor.
    #[serde(default = "one")]
    pub tp: u32,
    /// KV-cache bytes per token, all GPUs together
    /// (2 x layers x KV heads x head dim x bytes).
    pub kv_bytes_per_token: u64,
}

fn two() -> f64 {
    2.0
}
fn one() -> u32 {
    1
}

impl ModelSpec {
    pub fn weight_bytes(&self) -> u64 {
        (self.params_b * 1e9 * self.bytes_per_param) as u64
    }
}

/// The serving cost model. Every default is written down with its source in
/// `examples/pool/market.toml` and the README; in short:
/// - prefill is compute-bound: 2 x parameters FLOPs per token at `prefill_mfu`
///   of the GPUs' dense BF16 peak (0.5 is typical of vLLM prefill);
/// - a decode iteration is memory-bound: it reads the weights and the batch's
///   KV cache from HBM at `hbm_efficiency` of peak bandwidth, plus a fixed
///   per-iteration overhead (kernel launches, sampling, TP all-reduce);
/// - a weight load moves the model's shard to each GPU over its own PCIe
///   link (`host_to_gpu_gb_per_s`, PCIe 5.0 x16 is 64 GB/s peak, ~25-50 GB/s
///   achieved), after a disk read into host memory when the weights are not
///   cached there (`disk_to_host_gb_per_s`), plus `switch_overhead_s` of engine
///   work per switch (Aegaeon's component reuse cut this to well under a
///   second; a cold engine start is tens of seconds).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    pub prefill_mfu: f64,
    pub prefill_overhead_s: f64,
    pub hbm_efficiency: f64,
    pub iteration_overhead_s: f64,
    pub host_to_gpu_gb_per_s: f64,
    pub disk_to_host_gb_per_s: f64,
    pub switch_overhead_s: f64,
    /// Host memory that caches weights (the whole pool), GB.
    pub host_cache_gb: f64,
    /// Most prompt tokens in one prefill batch.
    pub max_prefill_tokens: u64,
    /// Most requests in one decode batch.
    pub max_decode_batch: usize,
    /// Most decode iterations in one step.
    pub max_iterations: u32,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            prefill_mfu: 0.5,
            prefill_overhead_s: 0.02,
            hbm_efficiency: 0.8,
            iteration_overhead_s: 0.002,
            host_to_gpu_gb_per_s: 32.0,
            disk_to_host_gb_per_s: 2.0,
            switch_overhead_s: 0.3,
            host_cache_gb: 4096.0,
            max_prefill_tokens: 16_384,
            max_decode_batch: 256,
            max_iterations: 64,
        }
    }
}

/// Latency targets. A request meets its SLO when its first token comes
/// within `ttft_s` of arrival and its i-th token (0-based) within
/// `ttft_s + i x tbt_s` (a per-token deadline, so a short pause after a
/// fast stretch is allowed, as in Aegaeon's token-level SLO).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slo {
    pub ttft_s: f64,
    pub tbt_s: f64,
    /// Fraction of requests that must meet their SLO ("99% attainment").
    pub target: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Slo { ttft_s: 10.0, tbt_s: 0.1, target: 0.99 }
    }
}

/// A pool partition: its GPU kind, cost model, targets and catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    #[serde(default)]
    pub gpu: GpuSpec,
    #[serde(default)]
    pub cost: CostModel,
    #[serde(default)]
    pub slo: Slo,
    /// Seconds between periodic `pool-place` calls.
    #[serde(default = "replan")]
    pub replan_interval_s: f64,
    pub models: Vec<ModelSpec>,
}

fn replan() -> f64 {
    10.0
}

impl PoolConfig {
    /// Checks what the simulator relies on.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |x: f64, what: &str| if x.is_finite() && x > 0.0 { Ok(()) } else { Err(format!("{what} must be positive, got {x}")) };
        pos(self.gpu.memory_gb, "gpu.memory_gb")?;
        pos(self.gpu.hbm_tb_per_s, "gpu.hbm_tb_per_s")?;
        pos(self.gpu.bf16_tflops, "gpu.bf16_tflops")?;
        pos(self.cost.prefill_mfu, "cost.prefill_mfu")?;
        pos(self.cost.hbm_efficiency, "cost.hbm_efficiency")?;
        pos(self.cost.host_to_gpu_gb_per_s, "cost.host_to_gpu_gb_per_s")?;
        pos(self.cost.disk_to_host_gb_per_s, "cost.disk_to_host_gb_per_s")?;
        pos(self.slo.ttft_s, "slo.ttft_s")?;
        pos(self.slo.tbt_s, "slo.tbt_s")?;
        pos(self.replan_interval_s, "replan_interval_s")?;
        if !(self.slo.target > 0.0 && self.slo.target <= 1.0) {
            return Err(format!("slo.target must be in (0, 1], got {}", self.slo.target));
        }
        if self.cost.max_iterations == 0 || self.cost.max_decode_batch == 0 || self.cost.max_prefill_tokens == 0 {
            return Err("cost.max_iterations, max_decode_batch and max_prefill_tokens must be at least 1".into());
        }
        if self.models.is_empty() {
            return Err("the catalog has no models".into());
        }
        for m in &self.models {
            pos(m.params_b, &format!("model {} params_b", m.name))?;
            pos(m.bytes_per_param, &format!("model {} bytes_per_param", m.name))?;
            if m.tp == 0 || m.tp > 64 {
                return Err(format!("model {}: tp must be 1..=64, got {}", m.name, m.tp));
            }
            if m.weight_bytes() as f64 >= self.executor_memory(m.tp) as f64 {
                return Err(format!("model {}: {:.0} GB of weights do not fit {} x {} GB", m.name, m.weight_bytes() as f64 / GB, m.tp, self.gpu.memory_gb));
            }
        }
        Ok(())
    }

    /// Distinct tensor-parallel degrees of the catalog, ascending.
    pub fn classes(&self) -> Vec<u32> {
        let mut tps: Vec<u32> = self.models.iter().map(|m| m.tp).collect();
        tps.sort_unstable();
        tps.dedup();
        tps
    }

    pub fn executor_memory(&self, tp: u32) -> u64 {
        (self.gpu.memory_gb * GB) as u64 * u64::from(tp)
    }

    /// Seconds to prefill `tokens` prompt tokens of `model` in one batch.
    pub fn prefill_s(&self, model: usize, tokens: u64) -> f64 {
        let m = &self.models[model];
        let flops = 2.0 * m.params_b * 1e9 * tokens as f64;
        self.cost.prefill_overhead_s + flops / (f64::from(m.tp) * self.gpu.bf16_tflops * 1e12 * self.cost.prefill_mfu)
    }

    /// Seconds of one decode iteration of `model` over a batch holding
    /// `kv_tokens` tokens of context in all.
    pub fn decode_iteration_s(&self, model: usize, kv_tokens: u64) -> f64 {
        let m = &self.models[model];
        let bytes = m.weight_bytes() as f64 + kv_tokens as f64 * m.kv_bytes_per_token as f64;
        self.cost.iteration_overhead_s + bytes / (f64::from(m.tp) * self.gpu.hbm_tb_per_s * 1e12 * self.cost.hbm_efficiency)
    }

    /// Seconds to load `model`'s weights onto its executor.
    pub fn load_s(&self, model: usize, cached_in_host: bool) -> f64 {
        let m = &self.models[model];
        let w = m.weight_bytes() as f64;
        let disk = if cached_in_host { 0.0 } else { w / (self.cost.disk_to_host_gb_per_s * GB) };
        self.cost.switch_overhead_s + disk + w / f64::from(m.tp) / (self.cost.host_to_gpu_gb_per_s * GB)
    }

    /// The models whose weights are in host memory before any traffic: as
    /// much of the catalog as fits the host cache, in catalog order (the
    /// deployment as it stood; the simulator and live executors start so).
    pub fn warm_host_cache(&self) -> Vec<usize> {
        let cap = (self.cost.host_cache_gb * GB) as u64;
        let mut cached = 0;
        let mut out = Vec::new();
        for (m, spec) in self.models.iter().enumerate() {
            if cached + spec.weight_bytes() <= cap {
                cached += spec.weight_bytes();
                out.push(m);
            }
        }
        out
    }

    /// Seconds one request of `model` takes to serve alone, with `prompt`
    /// and `output` tokens: the service time `pool-place` is told per model.
    pub fn service_s(&self, model: usize, prompt: f64, output: f64) -> f64 {
        self.prefill_s(model, prompt as u64) + output * self.decode_iteration_s(model, (prompt + output / 2.0) as u64)
    }
}

/// A `pool-place` answer's static checks against the pool's executors
/// (`(tp, memory bytes)` each), the one place both the simulator and the
/// live host validate it: columns of one length, executors and models that
/// exist, matching tensor-parallel degrees, weights of at least 1, `pinned`
/// 0 or 1, no pair twice, and every model fitting beside its executor's
/// pinned weights. Returns each executor's pinned bytes.
pub fn check_placement(cfg: &PoolConfig, executors: &[(u32, u64)], p: &PoolPlacement) -> Result<Vec<u64>, PolicyError> {
    let n = p.executor.len();
    if p.model.len() != n || p.weight.len() != n || p.pinned.len() != n {
        return Err(PolicyError::InvalidOutput(format!(
            "placement columns differ in length ({n} executors, {} models, {} weights, {} pinned)",
            p.model.len(),
            p.weight.len(),
            p.pinned.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    let mut pinned_bytes = vec![0u64; executors.len()];
    for i in 0..n {
        let (e, m) = (p.executor[i] as usize, p.model[i] as usize);
        let &(tp, _) = executors.get(e).ok_or_else(|| PolicyError::InvalidOutput(format!("executor {e} of {}", executors.len())))?;
        let spec = cfg.models.get(m).ok_or_else(|| PolicyError::InvalidOutput(format!("model {m} of {}", cfg.models.len())))?;
        if spec.tp != tp {
            return Err(PolicyError::InvalidOutput(format!("model {m} needs tp {} but executor {e} has {tp}", spec.tp)));
        }
        if p.weight[i] == 0 {
            return Err(PolicyError::InvalidOutput(format!("pair {i} (executor {e}, model {m}) has weight 0")));
        }
        if p.pinned[i] > 1 {
            return Err(PolicyError::InvalidOutput(format!("pair {i}: pinned must be 0 or 1")));
        }
        if !seen.insert((e, m)) {
            return Err(PolicyError::InvalidOutput(format!("executor {e}, model {m} assigned twice")));
        }
        if p.pinned[i] == 1 {
            pinned_bytes[e] += spec.weight_bytes();
        }
    }
    // An unpinned model must fit beside the executor's pinned ones.
    for i in 0..n {
        let (e, m) = (p.executor[i] as usize, p.model[i] as usize);
        let w = cfg.models[m].weight_bytes();
        let others = if p.pinned[i] == 1 { pinned_bytes[e] - w } else { pinned_bytes[e] };
        if others + w > executors[e].1 {
            return Err(PolicyError::InvalidOutput(format!("executor {e}: model {m} does not fit beside {:.1} GB of pinned weights", others as f64 / GB)));
        }
    }
    Ok(pinned_bytes)
}

/// One model's traffic as `pool-place` is shown it.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelTraffic {
    pub arrived: u64,
    pub rate: f64,
    pub peak_rate: f64,
    pub service_s: f64,
    pub queued: u32,
}

/// Appends a model's columns (its shape, then its traffic) to a
/// `pool-place` state: the simulator's and the live host's states are
/// built alike.
pub fn push_model(s: &mut PoolState, spec: &ModelSpec, t: ModelTraffic) {
    s.model_tp.push(spec.tp);
    s.model_weight_bytes.push(spec.weight_bytes());
    s.model_kv_bytes_per_token.push(spec.kv_bytes_per_token);
    s.model_arrived.push(t.arrived);
    s.model_rate.push(t.rate);
    s.model_peak_rate.push(t.peak_rate);
    s.model_service_s.push(t.service_s);
    s.model_queued.push(t.queued);
}

/// Where a request goes (the simulator's rule and the live host's): of
/// the candidates `(executor, load, weight)` serving its model, the one
/// with the least load per unit of weight; ties: the first.
pub fn route_least_loaded(candidates: impl IntoIterator<Item = (usize, u32, u32)>) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for (e, load, weight) in candidates {
        if weight > 0 {
            let score = f64::from(load + 1) / f64::from(weight);
            if best.is_none_or(|(s, _)| score < s) {
                best = Some((score, e));
            }
        }
    }
    best.map(|(_, e)| e)
}

/// Checks a `pool-step` answer against the executor it was asked about
/// (the one place a step is validated: the simulator and live executors
/// call it): the row exists, a prefill has work waiting, a decode has a
/// batch and 1..=`max_iterations` iterations, and every row to evict is
/// resident, unpinned, not decoding and not the row to run.
pub fn check_step(view: &PoolExecutor, step: &PoolStep, max_iterations: u32) -> Result<(), PolicyError> {
    if step.phase == PoolPhase::Idle {
        return Ok(());
    }
    let rows = view.len();
    let r = step.row as usize;
    if r >= rows {
        return Err(PolicyError::InvalidOutput(format!("step row {r} of {rows}")));
    }
    match step.phase {
        PoolPhase::Prefill if view.waiting[r] == 0 => {
            return Err(PolicyError::InvalidOutput(format!("prefill of row {r} (model {}) with nothing waiting", view.model[r])));
        }
        PoolPhase::Decode if view.decoding[r] == 0 => {
            return Err(PolicyError::InvalidOutput(format!("decode of row {r} (model {}) with nothing decoding", view.model[r])));
        }
        PoolPhase::Decode if step.iterations == 0 || step.iterations > max_iterations => {
            return Err(PolicyError::InvalidOutput(format!("{} decode iterations (1..={max_iterations})", step.iterations)));
        }
        _ => {}
    }
    for &v in &step.evict {
        let v = v as usize;
        if v >= rows {
            return Err(PolicyError::InvalidOutput(format!("evict row {v} of {rows}")));
        }
        if v == r || view.resident[v] == 0 || view.pinned[v] != 0 || view.decoding[v] != 0 {
            return Err(PolicyError::InvalidOutput(format!(
                "evict row {v} (model {}): must be resident, unpinned, not decoding and not the row to run",
                view.model[v]
            )));
        }
    }
    Ok(())
}

/// One inference request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub arrival_s: f64,
    pub model: u32,
    pub prompt_tokens: u32,
    /// Output tokens, at least 1 (the first comes from prefill).
    pub output_tokens: u32,
}

/// A small seeded generator (SplitMix64): the core has no IO and no
/// dependency on `rand`, and a workload must be identical everywhere.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
    pub fn exp(&mut self, rate: f64) -> f64 {
        -self.unit().ln() / rate
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Index drawn with probability proportional to `cumulative` increments.
    pub fn pick(&mut self, cumulative: &[f64]) -> usize {
        let x = self.unit() * cumulative.last().copied().unwrap_or(0.0);
        cumulative.partition_point(|&c| c < x).min(cumulative.len() - 1)
    }
}

/// Long-tail popularity over `n` models: Zipf with exponent `skew` over a
/// seeded random order of the models (so popularity is independent of size).
pub fn popularity(n: usize, skew: f64, seed: u64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix::new(seed ^ 0x0000_7071_6f70_756c);
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut p = vec![0.0; n];
    for (rank, &m) in order.iter().enumerate() {
        p[m] = 1.0 / ((rank + 1) as f64).powf(skew);
    }
    let total: f64 = p.iter().sum();
    p.iter().map(|x| x / total).collect()
}

/// Spreads requests (arrival times and token counts, e.g. from the Azure
/// traces) over the catalog with probability `popularity`, seeded.
pub fn spread(requests: &mut [Request], popularity: &[f64], seed: u64) {
    let mut rng = SplitMix::new(seed ^ 0x0000_7370_7265_6164);
    let cumulative: Vec<f64> = popularity.iter().scan(0.0, |s, &p| {
        *s += p;
        Some(*s)
    }).collect();
    for r in requests {
        r.model = rng.pick(&cumulative) as u32;
    }
}

/// The seeded synthetic workload: Poisson arrivals at `rate` requests per
/// second for `duration_s`, each model's share by `popularity`, prompt and
/// output lengths log-normal around the medians of Azure's 2023 conversation
/// trace (about 1,020 prompt and 129 output tokens; sigma 1.0 and 0.9,
/// clamped to 4..=8,192 prompt and 1..=2,048 output tokens).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Synthetic {
    pub rate: f64,
    pub duration_s: f64,
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub output_median: f64,
    pub output_sigma: f64,
    /// Zipf exponent of model popularity.
    pub skew: f64,
}

impl Default for Synthetic {
    fn default() -> Self {
        Synthetic { rate: 1.0, duration_s: 600.0, prompt_median: 1020.0, prompt_sigma: 1.0, output_median: 129.0, output_sigma: 0.9, skew: 1.0 }
    }
}

impl Synthetic {
    pub fn generate(&self, models: usize, seed: u64) -> Vec<Request> {
        let pop = popularity(models, self.skew, seed);
        let mut rng = SplitMix::new(seed);
        let mut out = Vec::new();
        let mut t = 0.0;
        loop {
            t += rng.exp(self.rate);
            if t >= self.duration_s {
                break;
            }
            // Box-Muller: two uniforms, one normal each for prompt and output.
            let (u1, u2) = (rng.unit(), rng.unit());
            let r = (-2.0 * u1.ln()).sqrt();
            let (z1, z2) = (r * (std::f64::consts::TAU * u2).cos(), r * (std::f64::consts::TAU * u2).sin());
            let prompt = (self.prompt_median * (self.prompt_sigma * z1).exp()).clamp(4.0, 8192.0) as u32;
            let output = (self.output_median * (self.output_sigma * z2).exp()).clamp(1.0, 2048.0) as u32;
            out.push(Request { arrival_s: t, model: 0, prompt_tokens: prompt, output_tokens: output });
        }
        spread(&mut out, &pop, seed);
        out
    }
}

/// The two pool decisions. Implemented by wasm components in the policy
/// host, by native builds of the same policies, and by test doubles.
/// `Ok(None)`: the policy does not claim the hook, and the host's documented
/// default (`berth_sdk::default_pool_place` / `default_pool_step`) applies.
pub trait PoolPolicy {
    fn describe(&self) -> String;
    fn pool_place(&mut self, state: &PoolState) -> Result<Option<PoolPlacement>, PolicyError>;
    fn pool_step(&mut self, executor: &PoolExecutor) -> Result<Option<PoolStep>, PolicyError>;
}

impl<P: PoolPolicy + ?Sized> PoolPolicy for Box<P> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn pool_place(&mut self, state: &PoolState) -> Result<Option<PoolPlacement>, PolicyError> {
        (**self).pool_place(state)
    }
    fn pool_step(&mut self, executor: &PoolExecutor) -> Result<Option<PoolStep>, PolicyError> {
        (**self).pool_step(executor)
    }
}

/// A guest policy compiled natively (same source as its wasm component),
/// honouring the hooks it claims.
pub struct NativePool<P: berth_sdk::Policy>(pub P);

impl<P: berth_sdk::Policy> PoolPolicy for NativePool<P> {
    fn describe(&self) -> String {
        format!("{}@{} (native)", P::NAME, P::VERSION)
    }
    fn pool_place(&mut self, state: &PoolState) -> Result<Option<PoolPlacement>, PolicyError> {
        if !P::HOOKS.contains(berth_sdk::Hooks::POOL_PLACE) {
            return Ok(None);
        }
        self.0.pool_place(state).map(Some).map_err(PolicyError::Guest)
    }
    fn pool_step(&mut self, executor: &PoolExecutor) -> Result<Option<PoolStep>, PolicyError> {
        if !P::HOOKS.contains(berth_sdk::Hooks::POOL_STEP) {
            return Ok(None);
        }
        self.0.pool_step(executor).map(Some).map_err(PolicyError::Guest)
    }
}

/// One executor step as the simulator ran it: the host's record, from which
/// the tests check memory without trusting the policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepRecord {
    pub start_s: f64,
    pub end_s: f64,
    pub executor: u32,
    pub model: u32,
    pub phase: &'static str,
    /// Requests in the batch.
    pub batch: u32,
    pub loaded: bool,
    /// Highest bytes in use on the executor during the step.
    pub used_bytes: u64,
    pub memory_bytes: u64,
    pub tp: u32,
}

/// What one replay measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PoolOutcome {
    pub requests: u64,
    pub met_slo: u64,
    /// Requests that finished (late or not).
    pub finished: u64,
    /// Requests never finished (never routed, or left waiting): SLO misses.
    pub unfinished: u64,
    /// Requests refused because their KV cache could never fit: SLO misses.
    pub rejected: u64,
    pub ttft_missed: u64,
    pub tbt_missed: u64,
    pub attainment: f64,
    /// Per tensor-parallel class: (tp, requests, met).
    pub classes: Vec<(u32, u64, u64)>,
    /// Requests meeting their SLO per second of the trace.
    pub goodput_rps: f64,
    pub tokens: u64,
    pub gpus: u32,
    pub executors: u32,
    /// Weight loads onto an executor (model switches).
    pub switches: u64,
    pub bytes_moved: u64,
    /// Loads that first had to read weights from disk into host memory.
    pub disk_loads: u64,
    pub switch_s: f64,
    /// Busy executor-seconds (prefill + decode + loads).
    pub busy_s: f64,
    /// Distinct models an executor ran, most over executors and mean over
    /// executors that ran any.
    pub models_per_executor_max: u32,
    pub models_per_executor_mean: f64,
    /// Most models resident on one executor at once.
    pub resident_max: u32,
    pub steps: u64,
    pub place_calls: u64,
    pub step_calls: u64,
    /// Steps where the host ran something else than the policy asked
    /// because the choice could not run (nothing fit): a decode of the
    /// least-slack batch instead.
    pub fallbacks: u64,
    /// Highest used/memory ratio of any executor in any step.
    pub peak_memory_fraction: f64,
    pub duration_s: f64,
}

/// How to run: which executors, and whether to keep the step log.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Executors per tensor-parallel degree: (tp, count).
    pub layout: Vec<(u32, u32)>,
    pub record_steps: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Place,
    Arrival(usize),
    Free(usize),
}

struct Event {
    t: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    // Min-heap on (time, sequence).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

/// One model on one executor.
struct Row {
    model: usize,
    /// In the current assignment (receives new requests) with this weight;
    /// 0: draining or only resident.
    weight: u32,
    pinned: bool,
    resident: bool,
    waiting: VecDeque<usize>,
    decoding: Vec<usize>,
    kv_bytes: u64,
    last_run_s: f64,
    ran: bool,
}

struct Exec {
    tp: u32,
    memory: u64,
    busy: bool,
    rows: Vec<Row>,
    weights: u64,
    kv: u64,
    load: u32,
    models_ran: Vec<bool>,
    /// End of the running step.
    free_at: f64,
    /// Not before this time (weight loads a placement started).
    ready_at: f64,
}

impl Exec {
    fn used(&self) -> u64 {
        self.weights + self.kv
    }
    fn row(&self, model: usize) -> Option<usize> {
        self.rows.iter().position(|r| r.model == model)
    }
}

#[derive(Clone, Copy, Default)]
struct ReqState {
    tokens: u32,
    late_ttft: bool,
    late_tbt: bool,
    done: bool,
    rejected: bool,
}

/// One deterministic replay of `requests` (sorted by arrival) on the pool.
pub struct PoolSim<'a> {
    cfg: &'a PoolConfig,
    reqs: &'a [Request],
    state: Vec<ReqState>,
    execs: Vec<Exec>,
    unrouted: Vec<VecDeque<usize>>,
    events: BinaryHeap<Event>,
    seq: u64,
    now: f64,
    place_pending: bool,
    host_cache: Vec<(usize, f64)>,
    // per-model rate bookkeeping
    arrived: Vec<u64>,
    window_start: f64,
    window_count: Vec<u64>,
    rate: Vec<f64>,
    peak_rate: Vec<f64>,
    service_s: Vec<f64>,
    out: PoolOutcome,
    pub steps: Vec<StepRecord>,
    record: bool,
    view: PoolExecutor,
    step_peak: u64,
    /// The first placement is the deployment as it stood before the trace
    /// began: its loads take no time and are not counted as switches.
    warm_start: bool,
}

impl<'a> PoolSim<'a> {
    pub fn new(cfg: &'a PoolConfig, reqs: &'a [Request], opts: &RunOptions) -> PoolSim<'a> {
        let n = cfg.models.len();
        let mut execs = Vec::new();
        for &(tp, count) in &opts.layout {
            for _ in 0..count {
                execs.push(Exec { tp, memory: cfg.executor_memory(tp), busy: false, rows: Vec::new(), weights: 0, kv: 0, load: 0, models_ran: vec![false; n], free_at: 0.0, ready_at: 0.0 });
            }
        }
        // The provisioning history a deployment is sized from: the trace's
        // mean and peak rates per model (peak over replan windows).
        let duration = reqs.last().map(|r| r.arrival_s).unwrap_or(0.0).max(cfg.replan_interval_s);
        let windows = (duration / cfg.replan_interval_s).ceil() as usize + 1;
        let mut per_window = vec![vec![0u64; windows]; n];
        let (mut prompt, mut output, mut count) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for r in reqs {
            let m = r.model as usize;
            per_window[m][(r.arrival_s / cfg.replan_interval_s) as usize] += 1;
            prompt[m] += f64::from(r.prompt_tokens);
            output[m] += f64::from(r.output_tokens);
            count[m] += 1.0;
        }
        let rate: Vec<f64> = count.iter().map(|c| c / duration).collect();
        let peak_rate: Vec<f64> = per_window.iter().map(|w| *w.iter().max().unwrap_or(&0) as f64 / cfg.replan_interval_s).collect();
        let service_s = (0..n)
            .map(|m| {
                let c = f64::max(count[m], 1.0);
                let (p, o) = if count[m] > 0.0 { (prompt[m] / c, output[m] / c) } else { (1020.0, 129.0) };
                cfg.service_s(m, p, o)
            })
            .collect();
        let gpus = opts.layout.iter().map(|&(tp, c)| tp * c).sum();
        PoolSim {
            cfg,
            reqs,
            state: vec![ReqState::default(); reqs.len()],
            unrouted: vec![VecDeque::new(); n],
            events: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            place_pending: false,
            host_cache: Vec::new(),
            arrived: vec![0; n],
            window_start: 0.0,
            window_count: vec![0; n],
            rate,
            peak_rate,
            service_s,
            out: PoolOutcome { requests: reqs.len() as u64, gpus, executors: execs.len() as u32, ..Default::default() },
            execs,
            steps: Vec::new(),
            record: opts.record_steps,
            view: PoolExecutor::default(),
            step_peak: 0,
            warm_start: true,
        }
    }

    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Event { t, seq: self.seq, kind });
    }

    /// Runs to the end: every request is finished, rejected or left
    /// unfinished (an SLO miss).
    pub fn run(mut self, policy: &mut dyn PoolPolicy) -> Result<(PoolOutcome, Vec<StepRecord>), PolicyError> {
        for (i, r) in self.reqs.iter().enumerate() {
            if i > 0 && r.arrival_s < self.reqs[i - 1].arrival_s {
                return Err(PolicyError::InvalidOutput("requests must be sorted by arrival".into()));
            }
            if r.model as usize >= self.cfg.models.len() {
                return Err(PolicyError::InvalidOutput(format!("request {i} names model {} of {}", r.model, self.cfg.models.len())));
            }
        }
        self.host_cache = self.cfg.warm_host_cache().into_iter().map(|m| (m, 0.0)).collect();
        self.place(policy)?;
        self.warm_start = false;
        let arrivals: Vec<(f64, usize)> = self.reqs.iter().enumerate().map(|(i, r)| (r.arrival_s, i)).collect();
        for (t, i) in arrivals {
            self.push(t, Kind::Arrival(i));
        }
        let end = self.reqs.last().map(|r| r.arrival_s).unwrap_or(0.0);
        let mut next_replan = self.cfg.replan_interval_s;
        while let Some(ev) = self.events.pop() {
            // Periodic re-planning while arrivals last.
            while next_replan <= ev.t && next_replan <= end {
                self.now = next_replan;
                self.roll_window();
                self.place(policy)?;
                next_replan += self.cfg.replan_interval_s;
            }
            self.now = ev.t;
            match ev.kind {
                Kind::Place => {
                    self.place_pending = false;
                    self.place(policy)?;
                }
                Kind::Arrival(i) => self.arrive(i),
                Kind::Free(e) => {
                    self.execs[e].busy = false;
                    self.kick(e, policy)?;
                }
            }
        }
        self.finish();
        Ok((self.out, self.steps))
    }

    fn roll_window(&mut self) {
        let span = (self.now - self.window_start).max(1e-9);
        for m in 0..self.rate.len() {
            self.rate[m] = self.window_count[m] as f64 / span;
            self.window_count[m] = 0;
        }
        self.window_start = self.now;
    }

    fn arrive(&mut self, i: usize) {
        let m = self.reqs[i].model as usize;
        self.arrived[m] += 1;
        self.window_count[m] += 1;
        match self.route(m) {
            Some(e) => self.enqueue(e, i),
            None => {
                self.unrouted[m].push_back(i);
                self.want_place();
            }
        }
    }

    fn want_place(&mut self) {
        if !self.place_pending {
            self.place_pending = true;
            self.push(self.now, Kind::Place);
        }
    }

    /// The executor serving `model` with the least load per unit of weight
    /// (ties: lowest id), among those its assignment names.
    fn route(&self, model: usize) -> Option<usize> {
        route_least_loaded(self.execs.iter().enumerate().filter_map(|(e, x)| x.row(model).map(|r| (e, x.load, x.rows[r].weight))))
    }

    fn enqueue(&mut self, e: usize, i: usize) {
        let m = self.reqs[i].model as usize;
        let x = &mut self.execs[e];
        let r = x.row(m).expect("routed to a serving executor");
        x.rows[r].waiting.push_back(i);
        x.load += 1;
        if !x.busy {
            x.busy = true;
            self.push(self.now, Kind::Free(e));
        }
    }

    fn pool_state(&self) -> PoolState {
        let mut s = PoolState { now_ms: (self.now * 1000.0) as u64, ..Default::default() };
        for (m, spec) in self.cfg.models.iter().enumerate() {
            let t = ModelTraffic { arrived: self.arrived[m], rate: self.rate[m], peak_rate: self.peak_rate[m], service_s: self.service_s[m], queued: self.unrouted[m].len() as u32 };
            push_model(&mut s, spec, t);
        }
        for (e, x) in self.execs.iter().enumerate() {
            s.executor_tp.push(x.tp);
            s.executor_memory_bytes.push(x.memory);
            s.executor_load.push(x.load);
            for row in &x.rows {
                if row.weight == 0 && row.waiting.is_empty() && row.decoding.is_empty() {
                    continue;
                }
                s.assigned_executor.push(e as u32);
                s.assigned_model.push(row.model as u32);
                s.assigned_pinned.push(u8::from(row.pinned));
                s.assigned_load.push((row.waiting.len() + row.decoding.len()) as u32);
                s.assigned_idle_ms.push(if row.ran { ((self.now - row.last_run_s) * 1000.0) as u64 } else { u64::MAX });
            }
        }
        s
    }

    /// Asks for a new assignment, validates it whole, then applies it:
    /// pinned models load now (counted as switches), rows that lose their
    /// assignment but still hold work drain first.
    fn place(&mut self, policy: &mut dyn PoolPolicy) -> Result<(), PolicyError> {
        let state = self.pool_state();
        self.out.place_calls += 1;
        let p = match policy.pool_place(&state)? {
            Some(p) => p,
            None => berth_sdk::default_pool_place(&state),
        };
        let n = p.executor.len();
        let shape: Vec<(u32, u64)> = self.execs.iter().map(|x| (x.tp, x.memory)).collect();
        let pinned_bytes = check_placement(self.cfg, &shape, &p)?;
        // Pinned weights must fit beside the KV cache reserved now and the
        // weights of rows still running decode batches.
        for (e, x) in self.execs.iter().enumerate() {
            let mut need = pinned_bytes[e] + x.kv;
            for row in &x.rows {
                let stays_pinned = (0..n).any(|i| p.executor[i] as usize == e && p.model[i] as usize == row.model && p.pinned[i] == 1);
                if row.resident && !stays_pinned && !row.decoding.is_empty() {
                    need += self.cfg.models[row.model].weight_bytes();
                }
            }
            if need > x.memory {
                return Err(PolicyError::InvalidOutput(format!(
                    "executor {e}: pinned weights need {:.1} GB with {:.1} GB in use by running work, of {:.1} GB",
                    pinned_bytes[e] as f64 / GB,
                    (need - pinned_bytes[e]) as f64 / GB,
                    x.memory as f64 / GB
                )));
            }
        }
        // Apply: every row loses its assignment, then the answer restores it.
        for x in &mut self.execs {
            for row in &mut x.rows {
                row.weight = 0;
                row.pinned = false;
            }
        }
        for i in 0..n {
            let (e, m) = (p.executor[i] as usize, p.model[i] as usize);
            let x = &mut self.execs[e];
            let r = match x.row(m) {
                Some(r) => r,
                None => {
                    x.rows.push(Row { model: m, weight: 0, pinned: false, resident: false, waiting: VecDeque::new(), decoding: Vec::new(), kv_bytes: 0, last_run_s: 0.0, ran: false });
                    x.rows.len() - 1
                }
            };
            x.rows[r].weight = p.weight[i];
            x.rows[r].pinned = p.pinned[i] == 1;
        }
        // Unassigned models without work are unloaded; then pinned models
        // load now, evicting unpinned idle residents to make room.
        let now = self.now;
        for e in 0..self.execs.len() {
            self.prune(e);
            let mut load_time = 0.0;
            for r in 0..self.execs[e].rows.len() {
                let row = &self.execs[e].rows[r];
                if row.pinned && !row.resident {
                    let m = row.model;
                    let w = self.cfg.models[m].weight_bytes();
                    self.make_room(e, w, r);
                    load_time += self.load(e, r);
                }
            }
            if load_time > 0.0 {
                // The loads run after the current step; nothing else runs
                // on the executor meanwhile.
                let x = &mut self.execs[e];
                x.ready_at = x.ready_at.max(x.free_at).max(now) + load_time;
                self.out.busy_s += load_time;
                if !x.busy {
                    x.busy = true;
                    let at = x.ready_at;
                    self.push(at, Kind::Free(e));
                }
            }
        }
        // Requests that waited for an executor: route them now.
        for m in 0..self.unrouted.len() {
            while let Some(&i) = self.unrouted[m].front() {
                match self.route(m) {
                    Some(e) => {
                        self.unrouted[m].pop_front();
                        self.enqueue(e, i);
                    }
                    None => break,
                }
            }
        }
        Ok(())
    }

    /// Drops least recently run, unpinned, idle (no decoding) resident rows
    /// of executor `e` other than `keep` until `bytes` more fit. Returns
    /// whether they fit.
    fn make_room(&mut self, e: usize, bytes: u64, keep: usize) -> bool {
        loop {
            let x = &self.execs[e];
            if x.used() + bytes <= x.memory {
                return true;
            }
            let victim = (0..x.rows.len())
                .filter(|&r| r != keep && x.rows[r].resident && !x.rows[r].pinned && x.rows[r].decoding.is_empty())
                .min_by(|&a, &b| x.rows[a].last_run_s.total_cmp(&x.rows[b].last_run_s).then(x.rows[a].model.cmp(&x.rows[b].model)));
            match victim {
                Some(r) => self.evict(e, r),
                None => return false,
            }
        }
    }

    fn evict(&mut self, e: usize, r: usize) {
        let w = self.cfg.models[self.execs[e].rows[r].model].weight_bytes();
        let x = &mut self.execs[e];
        debug_assert!(x.rows[r].resident && x.rows[r].decoding.is_empty());
        x.rows[r].resident = false;
        x.weights -= w;
    }

    /// Loads row `r`'s weights (room must have been made); returns seconds.
    fn load(&mut self, e: usize, r: usize) -> f64 {
        let m = self.execs[e].rows[r].model;
        let w = self.cfg.models[m].weight_bytes();
        let cached = self.touch_host_cache(m);
        let s = self.cfg.load_s(m, cached);
        let x = &mut self.execs[e];
        x.rows[r].resident = true;
        x.weights += w;
        assert!(x.used() <= x.memory, "load over-commits executor {e}");
        let resident = x.rows.iter().filter(|r| r.resident).count() as u32;
        self.out.resident_max = self.out.resident_max.max(resident);
        if self.warm_start {
            return 0.0;
        }
        self.out.switches += 1;
        self.out.bytes_moved += w;
        self.out.switch_s += s;
        if !cached {
            self.out.disk_loads += 1;
        }
        s
    }

    /// LRU cache of weights in host memory; returns whether `m` was cached.
    fn touch_host_cache(&mut self, m: usize) -> bool {
        let now = self.now;
        if let Some(entry) = self.host_cache.iter_mut().find(|(x, _)| *x == m) {
            entry.1 = now;
            return true;
        }
        let cap = (self.cfg.cost.host_cache_gb * GB) as u64;
        let w = |m: usize| self.cfg.models[m].weight_bytes();
        let mut used: u64 = self.host_cache.iter().map(|&(x, _)| w(x)).sum();
        while used + w(m) > cap && !self.host_cache.is_empty() {
            let oldest = (0..self.host_cache.len()).min_by(|&a, &b| self.host_cache[a].1.total_cmp(&self.host_cache[b].1)).expect("non-empty");
            used -= w(self.host_cache[oldest].0);
            self.host_cache.remove(oldest);
        }
        if w(m) <= cap {
            self.host_cache.push((m, now));
        }
        false
    }

    fn build_view(&mut self, e: usize) {
        let now = self.now;
        let cfg = self.cfg;
        let mut v = std::mem::take(&mut self.view);
        v.clear();
        let x = &self.execs[e];
        v.now_ms = (now * 1000.0) as u64;
        v.executor = e as u32;
        v.memory_bytes = x.memory;
        v.used_bytes = x.used();
        v.tbt_target_ms = (cfg.slo.tbt_s * 1000.0) as u64;
        for row in &x.rows {
            let m = row.model;
            v.model.push(m as u32);
            v.resident.push(u8::from(row.resident));
            v.pinned.push(u8::from(row.pinned));
            v.weight_bytes.push(cfg.models[m].weight_bytes());
            let cached = self.host_cache.iter().any(|&(c, _)| c == m);
            v.load_s.push(if row.resident { 0.0 } else { cfg.load_s(m, cached) });
            v.waiting.push(row.waiting.len() as u32);
            v.waiting_tokens.push(row.waiting.iter().map(|&i| u64::from(self.reqs[i].prompt_tokens)).sum());
            v.oldest_wait_ms.push(row.waiting.front().map(|&i| ((now - self.reqs[i].arrival_s).max(0.0) * 1000.0) as u64).unwrap_or(0));
            v.decoding.push(row.decoding.len() as u32);
            let slack = row.decoding.iter().map(|&i| self.next_deadline(i) - now).fold(f64::INFINITY, f64::min);
            v.decode_slack_ms.push(if slack.is_finite() { (slack * 1000.0) as i64 } else { 0 });
            v.decode_iteration_s.push(self.iteration_s(m, &row.decoding));
            v.idle_ms.push(if row.ran { ((now - row.last_run_s) * 1000.0) as u64 } else { u64::MAX });
        }
        self.view = v;
    }

    fn next_deadline(&self, i: usize) -> f64 {
        let r = &self.reqs[i];
        r.arrival_s + self.cfg.slo.ttft_s + f64::from(self.state[i].tokens) * self.cfg.slo.tbt_s
    }

    fn iteration_s(&self, m: usize, batch: &[usize]) -> f64 {
        let n = batch.len().min(self.cfg.cost.max_decode_batch);
        let kv: u64 = batch[..n].iter().map(|&i| u64::from(self.reqs[i].prompt_tokens + self.state[i].tokens)).sum();
        self.cfg.decode_iteration_s(m, kv)
    }

    fn kv_bytes(&self, i: usize) -> u64 {
        let r = &self.reqs[i];
        u64::from(r.prompt_tokens + r.output_tokens) * self.cfg.models[r.model as usize].kv_bytes_per_token
    }

    /// Unloads and forgets rows of executor `e` that lost their assignment
    /// and have no work left.
    fn prune(&mut self, e: usize) {
        let cfg = self.cfg;
        let x = &mut self.execs[e];
        let mut freed = 0;
        x.rows.retain(|r| {
            let keep = r.weight > 0 || !r.waiting.is_empty() || !r.decoding.is_empty();
            if !keep && r.resident {
                freed += cfg.models[r.model].weight_bytes();
            }
            keep
        });
        x.weights -= freed;
    }

    /// Executor `e` is free: ask for its next step and run it.
    fn kick(&mut self, e: usize, policy: &mut dyn PoolPolicy) -> Result<(), PolicyError> {
        if self.execs[e].busy {
            return Ok(());
        }
        if self.execs[e].ready_at > self.now {
            self.execs[e].busy = true;
            let at = self.execs[e].ready_at;
            self.push(at, Kind::Free(e));
            return Ok(());
        }
        self.prune(e);
        if self.execs[e].rows.iter().all(|r| r.waiting.is_empty() && r.decoding.is_empty()) {
            self.after_idle();
            return Ok(());
        }
        self.build_view(e);
        self.out.step_calls += 1;
        let step = match policy.pool_step(&self.view)? {
            Some(s) => s,
            None => berth_sdk::default_pool_step(&self.view, self.cfg.cost.max_iterations),
        };
        if step.phase == PoolPhase::Idle {
            // The policy leaves work waiting; the next arrival wakes it.
            self.after_idle();
            return Ok(());
        }
        check_step(&self.view, &step, self.cfg.cost.max_iterations)?;
        let r = step.row as usize;
        let mut evict = step.evict.clone();
        evict.sort_unstable();
        evict.dedup();
        for &v in &evict {
            self.evict(e, v as usize);
        }
        let start = self.now;
        let mut t = start;
        let mut loaded = false;
        if !self.execs[e].rows[r].resident {
            let m = self.execs[e].rows[r].model;
            if !self.make_room(e, self.cfg.models[m].weight_bytes(), r) {
                return self.fallback(e, policy);
            }
            t += self.load(e, r);
            loaded = true;
        }
        let (batch, model) = match step.phase {
            PoolPhase::Prefill => match self.prefill(e, r, t) {
                Some((end, n)) => {
                    t = end;
                    (n, self.execs[e].rows[r].model)
                }
                None if loaded => {
                    // The load happened; nothing fit beside it yet.
                    self.note_memory(e);
                    (0, self.execs[e].rows[r].model)
                }
                None => return self.fallback(e, policy),
            },
            PoolPhase::Decode => {
                let (end, n) = self.decode(e, r, t, step.iterations);
                t = end;
                (n, self.execs[e].rows[r].model)
            }
            PoolPhase::Idle => unreachable!(),
        };
        self.finish_step(e, r, start, t, model, if step.phase == PoolPhase::Prefill { "prefill" } else { "decode" }, batch, loaded);
        Ok(())
    }

    /// The policy's choice could not run (no room): decode the least-slack
    /// batch, or, with nothing decoding, refuse the oldest waiting request
    /// whose KV cache can never fit and try again.
    fn fallback(&mut self, e: usize, policy: &mut dyn PoolPolicy) -> Result<(), PolicyError> {
        self.out.fallbacks += 1;
        let x = &self.execs[e];
        let urgent = (0..x.rows.len())
            .filter(|&r| !x.rows[r].decoding.is_empty())
            .min_by(|&a, &b| {
                let sa = x.rows[a].decoding.iter().map(|&i| self.next_deadline(i)).fold(f64::INFINITY, f64::min);
                let sb = x.rows[b].decoding.iter().map(|&i| self.next_deadline(i)).fold(f64::INFINITY, f64::min);
                sa.total_cmp(&sb)
            });
        if let Some(r) = urgent {
            let start = self.now;
            let (end, n) = self.decode(e, r, start, self.cfg.cost.max_iterations.min(8));
            let model = self.execs[e].rows[r].model;
            self.finish_step(e, r, start, end, model, "decode", n, false);
            return Ok(());
        }
        // Nothing decodes, so only pinned weights and the waiting requests'
        // own needs are left: a request that cannot fit now never will.
        let pinned: u64 = x.rows.iter().filter(|r| r.pinned && r.resident).map(|r| self.cfg.models[r.model].weight_bytes()).sum();
        let mut refused = false;
        for r in 0..self.execs[e].rows.len() {
            let m = self.execs[e].rows[r].model;
            let own = if self.execs[e].rows[r].pinned { 0 } else { self.cfg.models[m].weight_bytes() };
            let memory = self.execs[e].memory;
            let waiting: Vec<usize> = self.execs[e].rows[r].waiting.iter().copied().collect();
            for i in waiting {
                if pinned + own + self.kv_bytes(i) > memory {
                    let row = &mut self.execs[e].rows[r];
                    row.waiting.retain(|&j| j != i);
                    self.execs[e].load -= 1;
                    self.state[i].rejected = true;
                    self.out.rejected += 1;
                    refused = true;
                }
            }
        }
        if refused {
            return self.kick(e, policy);
        }
        Err(PolicyError::InvalidOutput(format!("executor {e}: the chosen step cannot run and nothing else can (memory)")))
    }

    /// Prefills row `r` from `t`: waiting requests oldest first while their
    /// prompts fit the batch and their KV reservations fit memory (making
    /// room by evicting idle unpinned models). Returns the end and batch.
    fn prefill(&mut self, e: usize, r: usize, t: f64) -> Option<(f64, u32)> {
        let m = self.execs[e].rows[r].model;
        let mut batch = Vec::new();
        let mut tokens = 0u64;
        while let Some(&i) = self.execs[e].rows[r].waiting.front() {
            let p = u64::from(self.reqs[i].prompt_tokens);
            if !batch.is_empty() && tokens + p > self.cfg.cost.max_prefill_tokens {
                break;
            }
            let kv = self.kv_bytes(i);
            if !self.make_room(e, kv, r) {
                break;
            }
            let x = &mut self.execs[e];
            x.rows[r].waiting.pop_front();
            x.kv += kv;
            x.rows[r].kv_bytes += kv;
            tokens += p;
            batch.push(i);
        }
        if batch.is_empty() {
            return None;
        }
        let end = t + self.cfg.prefill_s(m, tokens);
        self.note_memory(e);
        for &i in &batch {
            let req = self.reqs[i];
            let st = &mut self.state[i];
            st.tokens = 1;
            self.out.tokens += 1;
            if end > req.arrival_s + self.cfg.slo.ttft_s + 1e-9 {
                st.late_ttft = true;
            }
            if req.output_tokens <= 1 {
                self.complete(e, r, i);
            } else {
                self.execs[e].rows[r].decoding.push(i);
            }
        }
        Some((end, batch.len() as u32))
    }

    /// Runs up to `iterations` decode iterations of row `r`'s batch from `t`.
    fn decode(&mut self, e: usize, r: usize, t: f64, iterations: u32) -> (f64, u32) {
        let m = self.execs[e].rows[r].model;
        let cap = self.cfg.cost.max_decode_batch.min(self.execs[e].rows[r].decoding.len());
        let batch: Vec<usize> = self.execs[e].rows[r].decoding[..cap].to_vec();
        let d = self.iteration_s(m, &batch);
        let most_left = batch.iter().map(|&i| self.reqs[i].output_tokens - self.state[i].tokens).max().unwrap_or(0);
        let n = iterations.min(most_left);
        let (ttft, tbt) = (self.cfg.slo.ttft_s, self.cfg.slo.tbt_s);
        self.note_memory(e);
        for &i in &batch {
            let req = self.reqs[i];
            let st = &mut self.state[i];
            let k = n.min(req.output_tokens - st.tokens);
            // Token j (0-based) is due at arrival + ttft + j x tbt; the
            // step's k tokens come at t + d, ..., t + k d. Lateness is linear
            // in the token, so the first and the last decide.
            let due = |j: u32| req.arrival_s + ttft + f64::from(j) * tbt;
            let (j0, j1) = (st.tokens, st.tokens + k - 1);
            if t + d > due(j0) + 1e-9 || t + f64::from(k) * d > due(j1) + 1e-9 {
                st.late_tbt = true;
            }
            st.tokens += k;
            self.out.tokens += u64::from(k);
            if st.tokens >= req.output_tokens {
                self.complete(e, r, i);
            }
        }
        (t + f64::from(n) * d, batch.len() as u32)
    }

    fn complete(&mut self, e: usize, r: usize, i: usize) {
        let kv = self.kv_bytes(i);
        let x = &mut self.execs[e];
        x.rows[r].decoding.retain(|&j| j != i);
        x.kv -= kv;
        x.rows[r].kv_bytes -= kv;
        x.load -= 1;
        self.state[i].done = true;
    }

    fn note_memory(&mut self, e: usize) {
        let x = &self.execs[e];
        self.step_peak = x.used();
        assert!(x.used() <= x.memory, "executor {e} over-committed: {} of {} bytes", x.used(), x.memory);
        self.out.peak_memory_fraction = self.out.peak_memory_fraction.max(x.used() as f64 / x.memory as f64);
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_step(&mut self, e: usize, r: usize, start: f64, end: f64, model: usize, phase: &'static str, batch: u32, loaded: bool) {
        self.out.steps += 1;
        self.out.busy_s += end - start;
        let x = &mut self.execs[e];
        x.rows[r].last_run_s = end;
        x.rows[r].ran = true;
        x.models_ran[model] = true;
        x.busy = true;
        x.free_at = end;
        if self.record {
            // KV is reserved at admission and released at completion, so the
            // step's highest use is the one noted after admission.
            let peak = self.step_peak.max(x.used());
            self.steps.push(StepRecord { start_s: start, end_s: end, executor: e as u32, model: model as u32, phase, batch, loaded, used_bytes: peak, memory_bytes: x.memory, tp: x.tp });
        }
        self.push(end.max(start), Kind::Free(e));
    }

    /// An executor went idle: requests waiting for any executor get a new
    /// assignment.
    fn after_idle(&mut self) {
        if self.unrouted.iter().any(|q| !q.is_empty()) {
            self.want_place();
        }
    }

    fn finish(&mut self) {
        let mut per_class: Vec<(u32, u64, u64)> = self.cfg.classes().into_iter().map(|tp| (tp, 0, 0)).collect();
        for (i, r) in self.reqs.iter().enumerate() {
            let st = self.state[i];
            let class = per_class.iter_mut().find(|c| c.0 == self.cfg.models[r.model as usize].tp).expect("class of every model");
            class.1 += 1;
            if st.rejected {
                continue;
            }
            if !st.done {
                self.out.unfinished += 1;
                continue;
            }
            self.out.finished += 1;
            self.out.ttft_missed += u64::from(st.late_ttft);
            self.out.tbt_missed += u64::from(st.late_tbt && !st.late_ttft);
            if !st.late_ttft && !st.late_tbt {
                self.out.met_slo += 1;
                class.2 += 1;
            }
        }
        self.out.classes = per_class;
        self.out.attainment = if self.reqs.is_empty() { 1.0 } else { self.out.met_slo as f64 / self.reqs.len() as f64 };
        let span = self.reqs.last().map(|r| r.arrival_s).unwrap_or(0.0).max(1e-9);
        self.out.duration_s = span;
        self.out.goodput_rps = self.out.met_slo as f64 / span;
        let ran: Vec<u32> = self.execs.iter().map(|x| x.models_ran.iter().filter(|&&b| b).count() as u32).filter(|&c| c > 0).collect();
        self.out.models_per_executor_max = ran.iter().copied().max().unwrap_or(0);
        self.out.models_per_executor_mean = if ran.is_empty() { 0.0 } else { ran.iter().sum::<u32>() as f64 / ran.len() as f64 };
    }
}

/// One replay: `requests` must be sorted by arrival.
pub fn run(cfg: &PoolConfig, requests: &[Request], opts: &RunOptions, policy: &mut dyn PoolPolicy) -> Result<(PoolOutcome, Vec<StepRecord>), PolicyError> {
    PoolSim::new(cfg, requests, opts).run(policy)
}

/// Attainment of one class in an outcome (1.0 for a class with no requests).
pub fn class_attainment(out: &PoolOutcome, tp: u32) -> f64 {
    out.classes.iter().find(|c| c.0 == tp).map(|&(_, n, met)| if n == 0 { 1.0 } else { met as f64 / n as f64 }).unwrap_or(1.0)
}

/// The result of a GPU-count search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpusNeeded {
    /// Executors per class at the smallest passing count, (tp, executors);
    /// `None` when even `max_executors` per class does not reach the target.
    pub layout: Option<Vec<(u32, u32)>>,
    pub gpus: Option<u32>,
    /// The outcome at the layout found (or at the largest tried).
    pub outcome: PoolOutcome,
    pub runs: u32,
}

/// Smallest executor count per tensor-parallel class at which each class
/// reaches `cfg.slo.target` attainment, by binary search (each run is
/// deterministic; classes never share executors, so they are searched
/// together, one run per probe). Attainment is assumed to grow with the
/// count, which holds for these policies up to noise; the final layout is
/// re-run and reported as measured.
pub fn gpus_needed(
    cfg: &PoolConfig,
    requests: &[Request],
    max_executors: u32,
    make: &mut dyn FnMut() -> Result<Box<dyn PoolPolicy>, PolicyError>,
) -> Result<GpusNeeded, PolicyError> {
    let classes = cfg.classes();
    let target = cfg.slo.target;
    let mut lo: Vec<u32> = vec![0; classes.len()]; // fails (or untested 0)
    let mut hi: Vec<Option<u32>> = vec![None; classes.len()]; // passes
    let runs = std::cell::Cell::new(0u32);
    let mut probe = |layout: &[u32]| -> Result<PoolOutcome, PolicyError> {
        let opts = RunOptions { layout: classes.iter().copied().zip(layout.iter().copied()).collect(), record_steps: false };
        let mut p = make()?;
        runs.set(runs.get() + 1);
        Ok(run(cfg, requests, &opts, &mut *p)?.0)
    };
    // Grow until every class passes (or hits the cap).
    let mut cur: Vec<u32> = classes.iter().map(|_| 1).collect();
    loop {
        let out = probe(&cur)?;
        let mut all = true;
        for (k, &tp) in classes.iter().enumerate() {
            if hi[k].is_some() {
                continue;
            }
            if class_attainment(&out, tp) >= target {
                hi[k] = Some(cur[k]);
            } else {
                lo[k] = cur[k];
                if cur[k] >= max_executors {
                    continue;
                }
                cur[k] = (cur[k] * 2).min(max_executors);
                all = false;
            }
        }
        if all {
            break;
        }
    }
    if hi.iter().any(|h| h.is_none()) {
        let out = probe(&cur)?;
        return Ok(GpusNeeded { layout: None, gpus: None, outcome: out, runs: runs.get() });
    }
    let mut hi: Vec<u32> = hi.into_iter().map(|h| h.expect("checked")).collect();
    while lo.iter().zip(&hi).any(|(l, h)| h - l > 1) {
        let mid: Vec<u32> = lo.iter().zip(&hi).map(|(l, h)| if h - l > 1 { (l + h) / 2 } else { *h }).collect();
        let out = probe(&mid)?;
        for (k, &tp) in classes.iter().enumerate() {
            if hi[k] - lo[k] <= 1 {
                continue;
            }
            if class_attainment(&out, tp) >= target {
                hi[k] = mid[k];
            } else {
                lo[k] = mid[k];
            }
        }
    }
    let out = probe(&hi)?;
    let layout: Vec<(u32, u32)> = classes.iter().copied().zip(hi.iter().copied()).collect();
    let gpus = layout.iter().map(|&(tp, c)| tp * c).sum();
    Ok(GpusNeeded { layout: Some(layout), gpus: Some(gpus), outcome: out, runs: runs.get() })
}

/// The highest arrival-rate multiplier (of the workload `generate` builds
/// for a multiplier) at which the pool of `layout` keeps `cfg.slo.target`
/// attainment, by geometric bisection between `lo` and `hi` to `precision`
/// (e.g. 0.02 = 2%). Returns 0 when even `lo` fails.
pub fn max_rate(
    cfg: &PoolConfig,
    layout: &[(u32, u32)],
    lo: f64,
    hi: f64,
    precision: f64,
    generate: &mut dyn FnMut(f64) -> Vec<Request>,
    make: &mut dyn FnMut() -> Result<Box<dyn PoolPolicy>, PolicyError>,
) -> Result<f64, PolicyError> {
    let opts = RunOptions { layout: layout.to_vec(), record_steps: false };
    let mut passes = |k: f64| -> Result<bool, PolicyError> {
        let reqs = generate(k);
        let mut p = make()?;
        Ok(run(cfg, &reqs, &opts, &mut *p)?.0.attainment >= cfg.slo.target)
    };
    if !passes(lo)? {
        return Ok(0.0);
    }
    if passes(hi)? {
        return Ok(hi);
    }
    let (mut lo, mut hi) = (lo, hi);
    while hi / lo > 1.0 + precision {
        let mid = (lo * hi).sqrt();
        if passes(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}
