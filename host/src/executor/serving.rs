//! One executor's models, requests and memory, without a clock: the
//! caller says what time it is and sleeps what a step returns. The rules
//! are the pool simulator's (`berth_core::pool`), applied to one executor:
//! weights load on demand at the modelled bandwidth (from the host's
//! memory cache or from disk), evicting the least recently run unpinned
//! idle model; a prefill takes the oldest waiting requests of one model
//! while their prompts fit one batch and their KV caches fit memory
//! (reserved for prompt and output at once); a decode runs up to N
//! iterations of one model's batch; a request whose KV cache can never fit
//! is refused. The step is asked of the pool-step policy and checked by
//! `berth_core::pool::check_step`, the simulator's own check.

use std::collections::{HashMap, VecDeque};

use berth_core::pool::{check_step, PoolConfig, PoolPolicy};
use berth_sdk::{PoolExecutor, PoolPhase, PoolStep};

use super::protocol::{PlaceRow, ShadowChoice, Up, MAX_IN_FLIGHT, MAX_MODELS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS};

/// One model on the executor.
struct Row {
    model: usize,
    /// Routing weight now; 0: no longer placed here (drains, then goes).
    weight: u32,
    pinned: bool,
    resident: bool,
    waiting: VecDeque<u64>,
    decoding: Vec<u64>,
    last_run_s: f64,
    ran: bool,
}

struct Request {
    row_model: usize,
    prompt: u32,
    output: u32,
    arrival_s: f64,
    /// Tokens produced so far.
    tokens: u32,
    /// KV cache reserved (from its prefill on).
    kv: u64,
}

/// What one step does: messages at their offsets (seconds from the step's
/// start, ascending), and how long the step takes in all.
#[derive(Debug, Default)]
pub struct Plan {
    pub seconds: f64,
    pub out: Vec<(f64, Up)>,
}

/// Who chose a step.
enum By {
    Policy,
    Default,
    Fallback(String),
}

pub struct Serving {
    cfg: PoolConfig,
    executor: u32,
    tp: u32,
    memory: u64,
    rows: Vec<Row>,
    requests: HashMap<u64, Request>,
    weights: u64,
    kv: u64,
    /// Models whose weights are in the host's memory, with their last use.
    host_cache: Vec<(usize, f64)>,
    /// Consecutive steps the policy's answer was refused.
    pub policy_failures: u32,
    /// Consecutive steps the candidate in shadow's answer was refused.
    pub shadow_failures: u32,
}

impl Serving {
    pub fn new(executor: u32, tp: u32, cfg: PoolConfig) -> Result<Serving, String> {
        cfg.validate()?;
        if cfg.models.len() > MAX_MODELS {
            return Err(format!("{} models in the catalog (at most {MAX_MODELS})", cfg.models.len()));
        }
        if !cfg.models.iter().any(|m| m.tp == tp) {
            return Err(format!("tp {tp}: no model of the catalog runs on {tp} GPU(s)"));
        }
        let memory = cfg.executor_memory(tp);
        let host_cache = cfg.warm_host_cache().into_iter().map(|m| (m, 0.0)).collect();
        Ok(Serving { cfg, executor, tp, memory, rows: Vec::new(), requests: HashMap::new(), weights: 0, kv: 0, host_cache, policy_failures: 0, shadow_failures: 0 })
    }

    pub fn memory(&self) -> u64 {
        self.memory
    }

    fn used(&self) -> u64 {
        self.weights + self.kv
    }

    fn weight_bytes(&self, m: usize) -> u64 {
        self.cfg.models[m].weight_bytes()
    }

    pub fn memory_report(&self) -> Up {
        Up::Memory { weights_bytes: self.weights, kv_bytes: self.kv, memory_bytes: self.memory }
    }

    /// Whether any request waits or decodes.
    pub fn busy(&self) -> bool {
        self.rows.iter().any(|r| !r.waiting.is_empty() || !r.decoding.is_empty())
    }

    /// The models served from now on; refused whole (nothing changes) if
    /// any row is wrong.
    pub fn place(&mut self, rows: &[PlaceRow]) -> Result<(), String> {
        let mut seen = vec![false; self.cfg.models.len()];
        let mut pinned = 0u64;
        for p in rows {
            let m = p.model as usize;
            let spec = self.cfg.models.get(m).ok_or_else(|| format!("model {m} of {}", self.cfg.models.len()))?;
            if spec.tp != self.tp {
                return Err(format!("model {m} ({}) needs tp {}, this executor has {}", spec.name, spec.tp, self.tp));
            }
            if p.weight == 0 {
                return Err(format!("model {m}: weight 0 (at least 1)"));
            }
            if std::mem::replace(&mut seen[m], true) {
                return Err(format!("model {m} placed twice"));
            }
            if p.pinned {
                pinned += spec.weight_bytes();
            }
        }
        if pinned > self.memory {
            return Err(format!("pinned weights of {pinned} bytes exceed the executor's {} bytes", self.memory));
        }
        for row in &mut self.rows {
            row.weight = 0;
            row.pinned = false;
        }
        for p in rows {
            let m = p.model as usize;
            match self.rows.iter_mut().find(|r| r.model == m) {
                Some(row) => {
                    row.weight = p.weight;
                    row.pinned = p.pinned;
                }
                None => self.rows.push(Row { model: m, weight: p.weight, pinned: p.pinned, resident: false, waiting: VecDeque::new(), decoding: Vec::new(), last_run_s: 0.0, ran: false }),
            }
        }
        Ok(())
    }

    /// Queues a request; `Err` names why it is refused (the caller answers
    /// `rejected`).
    pub fn admit(&mut self, id: u64, model: u32, prompt: u32, output: u32, now: f64) -> Result<(), String> {
        if self.requests.contains_key(&id) {
            return Err(format!("request {id} is already here"));
        }
        if self.requests.len() >= MAX_IN_FLIGHT {
            return Err(format!("{MAX_IN_FLIGHT} requests in flight already"));
        }
        if prompt == 0 || prompt > MAX_PROMPT_TOKENS || output == 0 || output > MAX_OUTPUT_TOKENS {
            return Err(format!("{prompt} prompt and {output} output tokens (1..={MAX_PROMPT_TOKENS} and 1..={MAX_OUTPUT_TOKENS})"));
        }
        let m = model as usize;
        let Some(r) = self.rows.iter().position(|r| r.model == m && r.weight > 0) else {
            return Err(format!("model {m} is not placed on executor {}", self.executor));
        };
        // With nothing else here, only pinned weights stay: a request that
        // cannot fit beside them never will.
        let kv = self.kv_bytes(m, prompt, output);
        let pinned: u64 = self.rows.iter().filter(|r| r.pinned).map(|r| self.weight_bytes(r.model)).sum();
        let own = if self.rows[r].pinned { 0 } else { self.weight_bytes(m) };
        if pinned + own + kv > self.memory {
            return Err(format!("its KV cache ({kv} bytes) never fits beside the weights in {} bytes", self.memory));
        }
        self.rows[r].waiting.push_back(id);
        self.requests.insert(id, Request { row_model: m, prompt, output, arrival_s: now, tokens: 0, kv: 0 });
        Ok(())
    }

    /// Forgets a request; whether it was here.
    pub fn cancel(&mut self, id: u64) -> bool {
        let Some(req) = self.requests.remove(&id) else { return false };
        if let Some(row) = self.rows.iter_mut().find(|r| r.model == req.row_model) {
            row.waiting.retain(|&j| j != id);
            row.decoding.retain(|&j| j != id);
        }
        self.kv -= req.kv;
        true
    }

    fn kv_bytes(&self, m: usize, prompt: u32, output: u32) -> u64 {
        u64::from(prompt + output) * self.cfg.models[m].kv_bytes_per_token
    }

    fn deadline(&self, req: &Request) -> f64 {
        req.arrival_s + self.cfg.slo.ttft_s + f64::from(req.tokens) * self.cfg.slo.tbt_s
    }

    fn iteration_s(&self, m: usize, batch: &[u64]) -> f64 {
        let kv: u64 = batch.iter().map(|id| &self.requests[id]).map(|q| u64::from(q.prompt + q.tokens)).sum();
        self.cfg.decode_iteration_s(m, kv)
    }

    /// What the pool-step policy sees (the WIT `pool-executor`).
    pub fn view(&self, now: f64) -> PoolExecutor {
        let mut v = PoolExecutor { now_ms: (now * 1000.0) as u64, executor: self.executor, memory_bytes: self.memory, used_bytes: self.used(), tbt_target_ms: (self.cfg.slo.tbt_s * 1000.0) as u64, ..Default::default() };
        for row in &self.rows {
            let m = row.model;
            v.model.push(m as u32);
            v.resident.push(u8::from(row.resident));
            v.pinned.push(u8::from(row.pinned));
            v.weight_bytes.push(self.weight_bytes(m));
            let cached = self.host_cache.iter().any(|&(c, _)| c == m);
            v.load_s.push(if row.resident { 0.0 } else { self.cfg.load_s(m, cached) });
            v.waiting.push(row.waiting.len() as u32);
            v.waiting_tokens.push(row.waiting.iter().map(|id| u64::from(self.requests[id].prompt)).sum());
            v.oldest_wait_ms.push(row.waiting.front().map(|id| ((now - self.requests[id].arrival_s).max(0.0) * 1000.0) as u64).unwrap_or(0));
            v.decoding.push(row.decoding.len() as u32);
            let slack = row.decoding.iter().map(|id| self.deadline(&self.requests[id]) - now).fold(f64::INFINITY, f64::min);
            v.decode_slack_ms.push(if slack.is_finite() { (slack * 1000.0) as i64 } else { 0 });
            v.decode_iteration_s.push(self.iteration_s(m, &row.decoding[..row.decoding.len().min(self.cfg.cost.max_decode_batch)]));
            v.idle_ms.push(if row.ran { ((now - row.last_run_s) * 1000.0) as u64 } else { u64::MAX });
        }
        v
    }

    /// The next step at `now`, run on the state (the caller sends its
    /// messages at their offsets and sleeps its length); `None` when there
    /// is nothing to do until a message comes.
    /// `shadow`, a candidate, is asked on the same view once the step is
    /// chosen; its choice rides on the step's record, never run.
    pub fn step(&mut self, now: f64, policy: Option<&mut dyn PoolPolicy>, shadow: Option<&mut dyn PoolPolicy>) -> Option<Plan> {
        let mut plan = Plan::default();
        self.prune(&mut plan);
        // A pinned model is loaded before anything else runs.
        if let Some(r) = self.rows.iter().position(|r| r.pinned && !r.resident) {
            let w = self.weight_bytes(self.rows[r].model);
            if self.make_room(w, r, &mut plan) {
                plan.seconds = self.load(r, now, &mut plan, 0.0);
                plan.out.push((plan.seconds, self.memory_report()));
                return Some(plan);
            }
        }
        if !self.busy() {
            return if plan.out.is_empty() { None } else { Some(plan) };
        }
        let view = self.view(now);
        let max = self.cfg.cost.max_iterations;
        let (step, by) = match policy {
            None => (berth_sdk::default_pool_step(&view, max), By::Default),
            Some(p) => match p.pool_step(&view).map_err(|e| e.to_string()).and_then(|s| {
                let s = s.unwrap_or_else(|| berth_sdk::default_pool_step(&view, max));
                check_step(&view, &s, max).map(|()| s).map_err(|e| e.to_string())
            }) {
                Ok(s) => {
                    self.policy_failures = 0;
                    (s, By::Policy)
                }
                Err(why) => {
                    self.policy_failures += 1;
                    (berth_sdk::default_pool_step(&view, max), By::Fallback(why))
                }
            },
        };
        if step.phase == PoolPhase::Idle {
            return if plan.out.is_empty() { None } else { Some(plan) };
        }
        let shadow = shadow.map(|p| {
            let answer = p.pool_step(&view).map_err(|e| e.to_string()).and_then(|s| {
                let s = s.unwrap_or_else(|| berth_sdk::default_pool_step(&view, max));
                check_step(&view, &s, max).map(|()| s).map_err(|e| e.to_string())
            });
            self.shadow_failures = if answer.is_ok() { 0 } else { self.shadow_failures + 1 };
            match answer {
                Ok(s) => ShadowChoice {
                    agreed: same_step(&s, &step),
                    phase: phase_name(s.phase).into(),
                    model: view.model.get(s.row as usize).copied().unwrap_or(0),
                    iterations: s.iterations,
                    why: None,
                },
                Err(why) => ShadowChoice { agreed: false, phase: "refused".into(), model: 0, iterations: 0, why: Some(why) },
            }
        });
        let ran = self.run(&step, now, &mut plan) || self.fallback(now, &mut plan);
        if !ran {
            return if plan.out.is_empty() { None } else { Some(plan) };
        }
        let (phase, model, batch, iterations) = match plan.out.iter().rev().find_map(|(_, u)| match u {
            Up::Step { phase, model, batch, iterations, .. } => Some((phase.clone(), *model, *batch, *iterations)),
            _ => None,
        }) {
            Some(x) => x,
            None => return Some(plan),
        };
        // The step's own record carries who chose it.
        plan.out.retain(|(_, u)| !matches!(u, Up::Step { .. }));
        let (by, why) = match by {
            By::Policy => ("policy", None),
            By::Default => ("default", None),
            By::Fallback(why) => ("fallback", Some(why)),
        };
        plan.out.push((plan.seconds, Up::Step { phase, model, batch, iterations, seconds: plan.seconds, by: by.into(), why, t: now + plan.seconds, shadow }));
        plan.out.push((plan.seconds, self.memory_report()));
        plan.out.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(plan)
    }

    /// Runs a checked step; false if it cannot run (no room).
    fn run(&mut self, step: &PoolStep, now: f64, plan: &mut Plan) -> bool {
        let r = step.row as usize;
        let mut evict = step.evict.clone();
        evict.sort_unstable();
        evict.dedup();
        for &v in &evict {
            self.evict(v as usize, plan, 0.0);
        }
        let mut t = 0.0;
        let mut loaded = false;
        if !self.rows[r].resident {
            if !self.make_room(self.weight_bytes(self.rows[r].model), r, plan) {
                return false;
            }
            t = self.load(r, now, plan, 0.0);
            loaded = true;
        }
        match step.phase {
            PoolPhase::Prefill => match self.prefill(r, now, t, plan) {
                Some(end) => t = end,
                None if loaded => self.record(r, "load", 0, 0, now, t, plan),
                None => return false,
            },
            PoolPhase::Decode => t = self.decode(r, step.iterations, now, t, plan),
            PoolPhase::Idle => return false,
        }
        plan.seconds = t;
        true
    }

    /// The chosen step could not run: decode the batch closest to its
    /// deadline, or, with nothing decoding, refuse the waiting requests
    /// that cannot fit now (nothing else holds memory) and say whether
    /// anything ran.
    fn fallback(&mut self, now: f64, plan: &mut Plan) -> bool {
        let urgent = (0..self.rows.len()).filter(|&r| !self.rows[r].decoding.is_empty()).min_by(|&a, &b| {
            let slack = |r: usize| self.rows[r].decoding.iter().map(|id| self.deadline(&self.requests[id])).fold(f64::INFINITY, f64::min);
            slack(a).total_cmp(&slack(b))
        });
        if let Some(r) = urgent {
            plan.seconds = self.decode(r, self.cfg.cost.max_iterations.min(8), now, 0.0, plan);
            return true;
        }
        let pinned: u64 = self.rows.iter().filter(|r| r.pinned && r.resident).map(|r| self.weight_bytes(r.model)).sum();
        for r in 0..self.rows.len() {
            let m = self.rows[r].model;
            let own = if self.rows[r].pinned { 0 } else { self.weight_bytes(m) };
            let waiting: Vec<u64> = self.rows[r].waiting.iter().copied().collect();
            for id in waiting {
                let q = &self.requests[&id];
                if pinned + own + self.kv_bytes(m, q.prompt, q.output) > self.memory {
                    self.rows[r].waiting.retain(|&j| j != id);
                    self.requests.remove(&id);
                    plan.out.push((0.0, Up::Rejected { id, why: "its KV cache does not fit beside the pinned weights".into() }));
                }
            }
        }
        false
    }

    /// Unloads and forgets rows no longer placed here with no work left.
    fn prune(&mut self, plan: &mut Plan) {
        let mut r = 0;
        while r < self.rows.len() {
            let row = &self.rows[r];
            if row.weight == 0 && row.waiting.is_empty() && row.decoding.is_empty() {
                if row.resident {
                    self.evict(r, plan, 0.0);
                }
                self.rows.remove(r);
            } else {
                r += 1;
            }
        }
    }

    /// Evicts the least recently run unpinned idle models other than `keep`
    /// until `bytes` more fit; whether they fit.
    fn make_room(&mut self, bytes: u64, keep: usize, plan: &mut Plan) -> bool {
        loop {
            if self.used() + bytes <= self.memory {
                return true;
            }
            let victim = (0..self.rows.len())
                .filter(|&r| r != keep && self.rows[r].resident && !self.rows[r].pinned && self.rows[r].decoding.is_empty())
                .min_by(|&a, &b| self.rows[a].last_run_s.total_cmp(&self.rows[b].last_run_s).then(self.rows[a].model.cmp(&self.rows[b].model)));
            match victim {
                Some(r) => self.evict(r, plan, 0.0),
                None => return false,
            }
        }
    }

    fn evict(&mut self, r: usize, plan: &mut Plan, at: f64) {
        let m = self.rows[r].model;
        self.rows[r].resident = false;
        self.weights -= self.weight_bytes(m);
        plan.out.push((at, Up::Evicted { model: m as u32 }));
    }

    /// Loads row `r` (room made); returns when the load ends.
    fn load(&mut self, r: usize, now: f64, plan: &mut Plan, at: f64) -> f64 {
        let m = self.rows[r].model;
        let cached = self.touch_host_cache(m, now);
        let s = self.cfg.load_s(m, cached);
        self.rows[r].resident = true;
        self.weights += self.weight_bytes(m);
        plan.out.push((at + s, Up::Loaded { model: m as u32, seconds: s, from_disk: !cached }));
        at + s
    }

    /// The host's LRU memory cache of weights; whether `m` was in it.
    fn touch_host_cache(&mut self, m: usize, now: f64) -> bool {
        if let Some(entry) = self.host_cache.iter_mut().find(|(x, _)| *x == m) {
            entry.1 = now;
            return true;
        }
        let cap = (self.cfg.cost.host_cache_gb * 1e9) as u64;
        let mut used: u64 = self.host_cache.iter().map(|&(x, _)| self.weight_bytes(x)).sum();
        while used + self.weight_bytes(m) > cap && !self.host_cache.is_empty() {
            let oldest = (0..self.host_cache.len()).min_by(|&a, &b| self.host_cache[a].1.total_cmp(&self.host_cache[b].1)).expect("non-empty");
            used -= self.weight_bytes(self.host_cache[oldest].0);
            self.host_cache.remove(oldest);
        }
        if self.weight_bytes(m) <= cap {
            self.host_cache.push((m, now));
        }
        false
    }

    /// Prefills row `r` from offset `t`: oldest first while prompts fit one
    /// batch and KV caches fit memory. Returns the end, or `None` if none
    /// fit.
    fn prefill(&mut self, r: usize, now: f64, t: f64, plan: &mut Plan) -> Option<f64> {
        let m = self.rows[r].model;
        let mut batch = Vec::new();
        let mut tokens = 0u64;
        while let Some(&id) = self.rows[r].waiting.front() {
            let q = &self.requests[&id];
            let p = u64::from(q.prompt);
            if !batch.is_empty() && tokens + p > self.cfg.cost.max_prefill_tokens {
                break;
            }
            let kv = self.kv_bytes(m, q.prompt, q.output);
            if !self.make_room(kv, r, plan) {
                break;
            }
            self.rows[r].waiting.pop_front();
            self.kv += kv;
            self.requests.get_mut(&id).expect("waiting").kv = kv;
            tokens += p;
            batch.push(id);
        }
        if batch.is_empty() {
            return None;
        }
        let end = t + self.cfg.prefill_s(m, tokens);
        for &id in &batch {
            self.emit(id, now, end, plan);
            if self.requests.get(&id).is_some_and(|q| q.tokens < q.output) {
                self.rows[r].decoding.push(id);
            }
        }
        self.record(r, "prefill", batch.len() as u32, 0, now, end, plan);
        Some(end)
    }

    /// Up to `iterations` decode iterations of row `r`'s batch from offset
    /// `t`; returns the end.
    fn decode(&mut self, r: usize, iterations: u32, now: f64, t: f64, plan: &mut Plan) -> f64 {
        let m = self.rows[r].model;
        let cap = self.cfg.cost.max_decode_batch.min(self.rows[r].decoding.len());
        let batch: Vec<u64> = self.rows[r].decoding[..cap].to_vec();
        let d = self.iteration_s(m, &batch);
        let most_left = batch.iter().map(|id| self.requests[id].output - self.requests[id].tokens).max().unwrap_or(0);
        let n = iterations.min(most_left);
        for k in 1..=n {
            for &id in &batch {
                if self.requests.get(&id).is_some_and(|q| q.tokens < q.output) {
                    self.emit(id, now, t + f64::from(k) * d, plan);
                }
            }
        }
        self.rows[r].decoding.retain(|id| self.requests.contains_key(id));
        let end = t + f64::from(n) * d;
        self.record(r, "decode", batch.len() as u32, n, now, end, plan);
        end
    }

    /// Request `id`'s next token at offset `at`; a request whose last
    /// token this is is done and gives its KV cache back.
    fn emit(&mut self, id: u64, now: f64, at: f64, plan: &mut Plan) {
        let q = self.requests.get_mut(&id).expect("in flight");
        let index = q.tokens;
        q.tokens += 1;
        plan.out.push((at, Up::Token { id, index, text: format!(" t{index}"), t: now + at }));
        if q.tokens >= q.output {
            let (tokens, kv) = (q.tokens, q.kv);
            self.requests.remove(&id);
            self.kv -= kv;
            plan.out.push((at, Up::Done { id, tokens, t: now + at }));
        }
    }

    fn record(&mut self, r: usize, phase: &str, batch: u32, iterations: u32, now: f64, end: f64, plan: &mut Plan) {
        self.rows[r].last_run_s = now + end;
        self.rows[r].ran = true;
        plan.out.push((end, Up::Step { phase: phase.into(), model: self.rows[r].model as u32, batch, iterations, seconds: end, by: String::new(), why: None, t: now + end, shadow: None }));
    }
}

fn phase_name(p: PoolPhase) -> &'static str {
    match p {
        PoolPhase::Idle => "idle",
        PoolPhase::Prefill => "prefill",
        PoolPhase::Decode => "decode",
    }
}

/// Two answers are the same step: same phase and row, the same iterations
/// where they count (a decode), the same evictions in any order.
fn same_step(a: &PoolStep, b: &PoolStep) -> bool {
    let sorted = |v: &[u32]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.dedup();
        v
    };
    a.phase == b.phase
        && (a.phase == PoolPhase::Idle || a.row == b.row)
        && (a.phase != PoolPhase::Decode || a.iterations == b.iterations)
        && sorted(&a.evict) == sorted(&b.evict)
}
