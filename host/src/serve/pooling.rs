//! Model pools live (Aegaeon): a pool partition's GPUs on agent nodes
//! grouped into executors (`berth executor` processes the agents start and
//! relay), the pool hook's `pool-place` run here (at start, every replan
//! interval, and when a request comes for a model nobody serves), its
//! `pool-step` pushed to the executors, and requests routed by the
//! placement's weights. The rules are the simulator's (`berth_core::pool`):
//! one placement validator, one routing rule, one step validator (in the
//! executor).
//!
//! Executors are held like operators' manual allocations: the fleet holds
//! their GPUs before the agent's start command goes out, and releases them
//! only when the agent reports the process gone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_core::pool::{self, PoolConfig, PoolPolicy};
use berth_sdk::{PoolPlacement, PoolState};
use tokio::sync::{mpsc, Notify};

use super::breaker::Call;
use super::state::{Live, PolicyHook};
use crate::executor::protocol::{Down, PlaceRow, Up, MAX_LINE_BYTES};
use crate::proto as pb;

/// Requests one pool holds at once (waiting for a route or in executors).
pub const MAX_POOL_REQUESTS: usize = 65_536;
/// How long a request waits for an executor serving its model.
pub const ROUTE_WAIT: Duration = Duration::from_secs(30);
/// Pause before an ended executor is started again; it doubles with each
/// end in a row that never reached `ready`, up to [`RESTART_DELAY_MAX`].
pub const RESTART_DELAY: Duration = Duration::from_secs(2);
pub const RESTART_DELAY_MAX: Duration = Duration::from_secs(60);

/// The pause before the next start of an executor that ended `failed`
/// times in a row without becoming ready.
pub fn restart_delay(failed: u32) -> Duration {
    RESTART_DELAY.saturating_mul(1u32 << failed.saturating_sub(1).min(5)).min(RESTART_DELAY_MAX)
}
/// Who the hub records as having started an executor.
pub const POOL_STARTER: &str = "pool";

/// What the pools need of the agent hub (which implements it): free GPUs,
/// starting an executor, whether one still holds its GPUs.
pub trait ExecutorHost: Send + Sync {
    /// A partition's agent nodes that take commands, each with its healthy
    /// GPUs no allocation holds.
    fn free_agent_gpus(&self, partition: &str) -> Vec<(String, Vec<u32>)>;
    /// Holds `gpus` of `node` and tells its agent to start an executor.
    fn start_executor(&self, partition: &str, node: &str, gpus: &[u32]) -> Result<u64, tonic::Status>;
    /// Whether allocation `id` is listed and still holds its GPUs.
    fn allocation_holds(&self, id: u64) -> bool;
}

/// A pool partition as the fleet config declares it.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub partition: String,
    pub config: PoolConfig,
    /// `(tp, count)` executors.
    pub executors: Vec<(u32, u32)>,
}

/// What a request's caller hears.
#[derive(Debug)]
pub enum Event {
    Token { index: u32, text: String },
    Done { tokens: u32 },
    Failed(String),
}

/// Frames to one executor, through its agent's relay.
pub type DownTx = mpsc::UnboundedSender<Result<pb::ExecutorFrame, tonic::Status>>;

/// Every pool partition of the host.
#[derive(Default)]
pub struct Pools {
    pub pools: Vec<Arc<PoolRun>>,
}

impl Pools {
    pub fn of(&self, partition: &str) -> Option<&Arc<PoolRun>> {
        self.pools.iter().find(|p| p.partition == partition)
    }

    /// The pool whose executor allocation `alloc` is.
    pub fn by_executor(&self, alloc: u64) -> Option<&Arc<PoolRun>> {
        self.pools.iter().find(|p| p.slot_of(alloc).is_some())
    }
}

struct Slot {
    tp: u32,
    alloc: Option<u64>,
    node: String,
    down: Option<DownTx>,
    ready: bool,
    load: u32,
    /// The pool-step component last sent (its digest; empty: the default).
    policy_sent: Option<String>,
    /// Warned once that no node had room for it.
    warned: bool,
    /// Not started again before this (after one ended: no crash loop at
    /// the supervisor's pace).
    not_before: Option<Instant>,
    /// Ends in a row without becoming ready (a crash loop backs off);
    /// 0 once one is ready.
    failed_starts: u32,
    /// The candidate in shadow last sent (its digest; empty: none).
    shadow_sent: Option<String>,
    /// The pool-step component it reported in use (empty: the default).
    step_policy: String,
    tally: StepTally,
}

/// Latest steps kept per executor for `PoolStatus` (the decision log on
/// its node has them all).
pub const RECENT_STEPS: usize = 16;
/// Latency samples kept per pool for its percentiles.
pub const LATENCY_SAMPLES: usize = 4096;

/// What one executor's steps came to, as its `step` lines said.
#[derive(Default)]
struct StepTally {
    policy: u64,
    default: u64,
    fallback: u64,
    shadow_agreed: u64,
    shadow_differed: u64,
    shadow_refused: u64,
    loads: u64,
    recent: std::collections::VecDeque<pb::PoolStepRecord>,
}

/// Requests by outcome, and the latest latencies.
#[derive(Default)]
struct Outcomes {
    slo_met: u64,
    slo_missed: u64,
    failed: u64,
    rejected: u64,
    cancelled: u64,
    ttft: std::collections::VecDeque<f64>,
    tbt: std::collections::VecDeque<f64>,
}

fn keep_latest(ring: &mut std::collections::VecDeque<f64>, v: f64) {
    if ring.len() >= LATENCY_SAMPLES {
        ring.pop_front();
    }
    ring.push_back(v);
}

/// The `q` quantile (0..=1) of `samples`, nearest rank; 0 over none.
fn quantile(samples: &std::collections::VecDeque<f64>, q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v: Vec<f64> = samples.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

struct Req {
    model: usize,
    slot: usize,
    tx: mpsc::UnboundedSender<Event>,
    arrival: Instant,
    prompt: u32,
    output: u32,
    tokens: u32,
    last_token: Instant,
    late: bool,
    rerouted: bool,
}

struct Inner {
    slots: Vec<Slot>,
    /// The placement: each executor's models.
    rows: Vec<Vec<PlaceRow>>,
    requests: HashMap<u64, Req>,
    /// Requests waiting for an executor, per model.
    unrouted: Vec<u32>,
    arrived: Vec<u64>,
    window: Vec<u64>,
    window_start: Instant,
    rate: Vec<f64>,
    peak_rate: Vec<f64>,
    prompt_sum: Vec<f64>,
    output_sum: Vec<f64>,
    last_run: HashMap<(usize, usize), Instant>,
    last_place: Option<Instant>,
    want_place: bool,
    /// Who made the placement in force, and the pool version asked.
    placed_by: String,
    placed_version: Option<u32>,
    /// The pool candidate in shadow at the last placement.
    shadowed: Option<u32>,
    outcomes: Outcomes,
}

/// One pool partition, live.
pub struct PoolRun {
    pub partition: String,
    p: usize,
    pub cfg: PoolConfig,
    inner: Mutex<Inner>,
    placed: Notify,
    next_id: AtomicU64,
}

fn frame(down: &Down) -> pb::ExecutorFrame {
    pb::ExecutorFrame { line: serde_json::to_vec(down).expect("serializes"), ..Default::default() }
}

fn send(slot: &Slot, down: &Down) -> bool {
    slot.down.as_ref().is_some_and(|tx| tx.send(Ok(frame(down))).is_ok())
}

/// The state `pool-place` is shown for `executors` (`(tp, memory)`), no
/// traffic yet: for a component's smoke test.
pub fn smoke_state(cfg: &PoolConfig, executors: &[(u32, u64)]) -> PoolState {
    let mut s = PoolState::default();
    for (m, spec) in cfg.models.iter().enumerate() {
        pool::push_model(&mut s, spec, pool::ModelTraffic { service_s: cfg.service_s(m, 1020.0, 129.0), ..Default::default() });
    }
    for &(tp, memory) in executors {
        s.executor_tp.push(tp);
        s.executor_memory_bytes.push(memory);
        s.executor_load.push(0);
    }
    s
}

impl PoolRun {
    pub fn new(spec: &PoolSpec, p: usize) -> PoolRun {
        let n = spec.config.models.len();
        let slots: Vec<Slot> = spec
            .executors
            .iter()
            .flat_map(|&(tp, count)| (0..count).map(move |_| tp))
            .map(|tp| Slot { tp, alloc: None, node: String::new(), down: None, ready: false, load: 0, policy_sent: None, warned: false, not_before: None, failed_starts: 0, shadow_sent: None, step_policy: String::new(), tally: StepTally::default() })
            .collect();
        let rows = vec![Vec::new(); slots.len()];
        PoolRun {
            partition: spec.partition.clone(),
            p,
            cfg: spec.config.clone(),
            inner: Mutex::new(Inner {
                slots,
                rows,
                requests: HashMap::new(),
                unrouted: vec![0; n],
                arrived: vec![0; n],
                window: vec![0; n],
                window_start: Instant::now(),
                rate: vec![0.0; n],
                peak_rate: vec![0.0; n],
                prompt_sum: vec![0.0; n],
                output_sum: vec![0.0; n],
                last_run: HashMap::new(),
                last_place: None,
                want_place: true,
                placed_by: String::new(),
                placed_version: None,
                shadowed: None,
                outcomes: Outcomes::default(),
            }),
            placed: Notify::new(),
            next_id: AtomicU64::new(1),
        }
    }

    /// Counts a request's outcome (metrics and the pool's own tally).
    fn outcome(&self, g: &mut Inner, live: &Live, model: usize, outcome: &str) {
        live.metrics.pool_requests.with_label_values(&[&self.partition, &self.cfg.models[model].name, outcome]).inc();
        let o = &mut g.outcomes;
        *match outcome {
            "slo_met" => &mut o.slo_met,
            "slo_missed" => &mut o.slo_missed,
            "failed" => &mut o.failed,
            "cancelled" => &mut o.cancelled,
            _ => &mut o.rejected,
        } += 1;
    }

    /// A model's catalog index by name.
    pub fn model(&self, name: &str) -> Option<usize> {
        self.cfg.models.iter().position(|m| m.name == name)
    }

    fn slot_of(&self, alloc: u64) -> Option<usize> {
        self.inner.lock().unwrap().slots.iter().position(|s| s.alloc == Some(alloc))
    }

    /// Executors by state, and who placed last: for the console and tests.
    pub fn summary(&self) -> PoolSummary {
        let g = self.inner.lock().unwrap();
        PoolSummary {
            executors: g.slots.len(),
            ready: g.slots.iter().filter(|s| s.ready).count(),
            started: g.slots.iter().filter(|s| s.alloc.is_some()).count(),
            in_flight: g.requests.len(),
            placed_by: g.placed_by.clone(),
            rows: g.rows.iter().map(|r| r.len()).sum(),
        }
    }

    /// Takes a request: it waits (up to [`ROUTE_WAIT`]) for an executor
    /// serving its model, then is admitted there; the receiver hears its
    /// tokens. `Err` says why it was refused.
    pub async fn submit(&self, live: &Live, model: usize, prompt: u32, output: u32) -> Result<(u64, mpsc::UnboundedReceiver<Event>), String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut g = self.inner.lock().unwrap();
            if g.requests.len() + g.unrouted.iter().map(|&u| u as usize).sum::<usize>() >= MAX_POOL_REQUESTS {
                return Err(format!("the pool holds {MAX_POOL_REQUESTS} requests already"));
            }
            g.arrived[model] += 1;
            g.window[model] += 1;
            g.prompt_sum[model] += f64::from(prompt);
            g.output_sum[model] += f64::from(output);
        }
        let arrival = Instant::now();
        let deadline = tokio::time::Instant::now() + ROUTE_WAIT;
        let mut waiting = false;
        loop {
            let notified = self.placed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut g = self.inner.lock().unwrap();
                if let Some(slot) = route(&g, model) {
                    if waiting {
                        g.unrouted[model] -= 1;
                    }
                    let req = Req { model, slot, tx, arrival, prompt, output, tokens: 0, last_token: arrival, late: false, rerouted: false };
                    admit(&mut g, id, req);
                    return Ok((id, rx));
                }
                if !waiting {
                    waiting = true;
                    g.unrouted[model] += 1;
                }
                g.want_place = true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let mut g = self.inner.lock().unwrap();
                g.unrouted[model] -= 1;
                self.outcome(&mut g, live, model, "rejected");
                return Err(format!("no executor served model {} within {} s", self.cfg.models[model].name, ROUTE_WAIT.as_secs()));
            }
        }
    }

    /// The caller left: its executor forgets the request.
    pub fn cancel(&self, live: &Live, id: u64) {
        let mut g = self.inner.lock().unwrap();
        if let Some(req) = g.requests.remove(&id) {
            let slot = &mut g.slots[req.slot];
            slot.load = slot.load.saturating_sub(1);
            send(slot, &Down::Cancel { id });
            self.outcome(&mut g, live, req.model, "cancelled");
        }
    }

    /// An executor's relay opened: it is configured, then placed once ready.
    pub fn attach(&self, alloc: u64, down: DownTx) -> Result<(), String> {
        let mut g = self.inner.lock().unwrap();
        let i = g.slots.iter().position(|s| s.alloc == Some(alloc)).ok_or_else(|| format!("allocation {alloc} is no executor of pool {}", self.partition))?;
        let slot = &mut g.slots[i];
        if slot.down.is_some() {
            return Err(format!("executor {i} of pool {} is relayed already", self.partition));
        }
        slot.down = Some(down);
        slot.policy_sent = None;
        slot.shadow_sent = None;
        slot.step_policy.clear();
        send(slot, &Down::Configure { executor: i as u32, tp: slot.tp, pool: self.cfg.clone() });
        Ok(())
    }

    /// An executor's relay ended: its requests go elsewhere (those with no
    /// token yet) or fail (the rest); it is started again once its
    /// allocation ends.
    pub fn detach(&self, live: &Live, alloc: u64) {
        let mut g = self.inner.lock().unwrap();
        let Some(i) = g.slots.iter().position(|s| s.alloc == Some(alloc)) else { return };
        let slot = &mut g.slots[i];
        slot.down = None;
        slot.ready = false;
        slot.load = 0;
        self.orphan_requests(&mut g, live, i);
        g.want_place = true;
    }

    fn orphan_requests(&self, g: &mut Inner, live: &Live, slot: usize) {
        let ids: Vec<u64> = g.requests.iter().filter(|(_, r)| r.slot == slot).map(|(&id, _)| id).collect();
        for id in ids {
            let mut req = g.requests.remove(&id).expect("listed");
            if req.tokens == 0 && !req.rerouted
                && let Some(s) = route(g, req.model)
            {
                req.slot = s;
                req.rerouted = true;
                admit(g, id, req);
                continue;
            }
            self.outcome(g, live, req.model, "failed");
            let _ = req.tx.send(Event::Failed(format!("executor {slot} was lost after {} tokens", req.tokens)));
        }
    }

    /// One line from an executor. Returns the pool-step component (its
    /// digest) and why, when the executor gave up on the one it was sent.
    pub fn on_line(&self, live: &Live, alloc: u64, line: &[u8]) -> Option<(String, String)> {
        if line.len() > MAX_LINE_BYTES {
            tracing::warn!(target: "berth::pool", partition = %self.partition, allocation = alloc, "executor line of {} bytes ignored", line.len());
            return None;
        }
        let up: Up = match serde_json::from_slice(line) {
            Ok(up) => up,
            Err(e) => {
                tracing::warn!(target: "berth::pool", partition = %self.partition, allocation = alloc, "not an executor message: {}", crate::text::printable(&e.to_string(), 200));
                return None;
            }
        };
        let mut g = self.inner.lock().unwrap();
        let i = g.slots.iter().position(|s| s.alloc == Some(alloc))?;
        let now = Instant::now();
        let name = |m: usize| self.cfg.models.get(m).map_or("?", |s| s.name.as_str());
        match up {
            Up::Ready { .. } => {
                g.slots[i].ready = true;
                g.slots[i].failed_starts = 0;
                let rows = g.rows[i].clone();
                if rows.is_empty() {
                    g.want_place = true;
                } else {
                    send(&g.slots[i], &Down::Place { rows });
                }
                drop(g);
                self.placed.notify_waiters();
                tracing::info!(target: "berth::pool", partition = %self.partition, executor = i, allocation = alloc, "executor ready");
            }
            Up::Token { id, index, text, .. } => {
                let slo = self.cfg.slo;
                let g = &mut *g;
                if let Some(req) = g.requests.get_mut(&id) {
                    let since = now.duration_since(req.arrival).as_secs_f64();
                    if index == 0 {
                        live.metrics.pool_ttft_seconds.with_label_values(&[self.partition.as_str(), name(req.model)]).observe(since);
                        keep_latest(&mut g.outcomes.ttft, since);
                    } else {
                        let tbt = now.duration_since(req.last_token).as_secs_f64();
                        live.metrics.pool_tbt_seconds.with_label_values(&[self.partition.as_str(), name(req.model)]).observe(tbt);
                        keep_latest(&mut g.outcomes.tbt, tbt);
                    }
                    // Token i is due at arrival + TTFT + i x TBT (the simulator's rule).
                    if since > slo.ttft_s + f64::from(index) * slo.tbt_s {
                        req.late = true;
                    }
                    req.tokens = req.tokens.max(index + 1);
                    req.last_token = now;
                    let _ = req.tx.send(Event::Token { index, text });
                    let key = (i, req.model);
                    g.last_run.insert(key, now);
                }
            }
            Up::Done { id, tokens, .. } => {
                if let Some(req) = g.requests.remove(&id) {
                    g.slots[req.slot].load = g.slots[req.slot].load.saturating_sub(1);
                    let late = req.late || tokens < req.output;
                    self.outcome(&mut g, live, req.model, if late { "slo_missed" } else { "slo_met" });
                    let _ = req.tx.send(Event::Done { tokens });
                }
            }
            Up::Rejected { id, why } => {
                if let Some(mut req) = g.requests.remove(&id) {
                    g.slots[req.slot].load = g.slots[req.slot].load.saturating_sub(1);
                    // A placement that moved the model away as it came: once elsewhere.
                    if req.tokens == 0 && !req.rerouted
                        && let Some(s) = route(&g, req.model).filter(|&s| s != i)
                    {
                        req.slot = s;
                        req.rerouted = true;
                        admit(&mut g, id, req);
                    } else {
                        self.outcome(&mut g, live, req.model, "rejected");
                        let _ = req.tx.send(Event::Failed(format!("executor {i}: {}", crate::text::printable(&why, 300))));
                    }
                }
            }
            Up::Loaded { model, .. } => {
                g.slots[i].tally.loads += 1;
                live.metrics.pool_switches.with_label_values(&[self.partition.as_str(), name(model as usize)]).inc();
            }
            Up::Step { phase, model, batch, iterations, seconds, by, why, t, shadow } => {
                let by = match by.as_str() {
                    "policy" | "default" | "fallback" => by.as_str(),
                    _ => "other",
                };
                live.metrics.pool_steps.with_label_values(&[&self.partition, by]).inc();
                let tally = &mut g.slots[i].tally;
                match by {
                    "policy" => tally.policy += 1,
                    "default" => tally.default += 1,
                    "fallback" => tally.fallback += 1,
                    _ => {}
                }
                let shadow = shadow.map(|c| {
                    let mut stats = live.partitions[self.p].pool.stats.lock().unwrap();
                    stats.steps += 1;
                    if c.agreed {
                        stats.steps_agreed += 1;
                        tally.shadow_agreed += 1;
                        "agreed".to_string()
                    } else if let Some(why) = c.why {
                        stats.step_errors += 1;
                        tally.shadow_refused += 1;
                        format!("refused: {}", crate::text::printable(&why, 200))
                    } else {
                        tally.shadow_differed += 1;
                        format!("differed: {} {} x{}", crate::text::printable(&c.phase, 16), name(c.model as usize), c.iterations)
                    }
                });
                if tally.recent.len() >= RECENT_STEPS {
                    tally.recent.pop_front();
                }
                tally.recent.push_back(pb::PoolStepRecord {
                    t,
                    phase: crate::text::printable(&phase, 16).into_owned(),
                    model: name(model as usize).to_string(),
                    batch,
                    iterations,
                    seconds,
                    by: by.to_string(),
                    why: why.map(|w| crate::text::printable(&w, 200).into_owned()).unwrap_or_default(),
                    shadow: shadow.unwrap_or_default(),
                });
            }
            Up::Policy { digest, loaded, why, shadow: true } => {
                let digest = crate::text::printable(&digest, 80).into_owned();
                let why = why.map(|w| crate::text::printable(&w, 300).into_owned());
                if loaded {
                    tracing::info!(target: "berth::pool", partition = %self.partition, executor = i, %digest, "pool-step candidate in shadow");
                } else {
                    // Nothing acts on a candidate: it is no longer compared there.
                    tracing::warn!(target: "berth::pool", partition = %self.partition, executor = i, %digest, "pool-step candidate dropped: {}", why.as_deref().unwrap_or("?"));
                    live.partitions[self.p].pool.stats.lock().unwrap().step_errors += 1;
                }
            }
            Up::Policy { digest, loaded, why, shadow: false } => {
                let digest = crate::text::printable(&digest, 80).into_owned();
                let why = why.map(|w| crate::text::printable(&w, 300).into_owned());
                if loaded {
                    g.slots[i].step_policy = digest.clone();
                    tracing::info!(target: "berth::pool", partition = %self.partition, executor = i, %digest, "pool-step policy in use");
                } else {
                    tracing::warn!(target: "berth::pool", partition = %self.partition, executor = i, %digest, "pool-step policy dropped: {}", why.as_deref().unwrap_or("?"));
                    if g.slots[i].step_policy == digest {
                        g.slots[i].step_policy.clear();
                    }
                    if g.slots[i].policy_sent.as_deref() == Some(digest.as_str()) {
                        return Some((digest, format!("executor {i}: {}", why.unwrap_or_default())));
                    }
                }
            }
            Up::Error { what } => tracing::warn!(target: "berth::pool", partition = %self.partition, executor = i, "executor: {}", crate::text::printable(&what, 300)),
            Up::Evicted { .. } | Up::Memory { .. } => {}
        }
        None
    }

    /// The supervisor's round: executors whose allocations ended are
    /// forgotten, missing ones started on free agent GPUs, the placement
    /// renewed when due, the pool-step version pushed where it is not yet.
    pub fn tick(&self, live: &Live, hub: &dyn ExecutorHost) {
        // Executors gone (exited, failed, lost): their requests move.
        let allocs: Vec<(usize, u64)> = self.inner.lock().unwrap().slots.iter().enumerate().filter_map(|(i, s)| s.alloc.map(|a| (i, a))).collect();
        for (i, alloc) in allocs {
            if !hub.allocation_holds(alloc) {
                let mut g = self.inner.lock().unwrap();
                if g.slots[i].alloc == Some(alloc) {
                    tracing::info!(target: "berth::pool", partition = %self.partition, executor = i, allocation = alloc, "executor ended");
                    let slot = &mut g.slots[i];
                    slot.alloc = None;
                    slot.down = None;
                    slot.ready = false;
                    slot.load = 0;
                    // Reset to 0 when it became ready: a first end waits 2 s.
                    slot.failed_starts += 1;
                    slot.not_before = Some(Instant::now() + restart_delay(slot.failed_starts));
                    self.orphan_requests(&mut g, live, i);
                    g.want_place = true;
                }
            }
        }
        // Missing executors, largest first, on the first node with room.
        let mut missing: Vec<(usize, u32)> = self.inner.lock().unwrap().slots.iter().enumerate().filter(|(_, s)| s.alloc.is_none() && s.not_before.is_none_or(|t| t <= Instant::now())).map(|(i, s)| (i, s.tp)).collect();
        if !missing.is_empty() {
            missing.sort_by_key(|&(i, tp)| (std::cmp::Reverse(tp), i));
            let mut free = hub.free_agent_gpus(&self.partition);
            for (i, tp) in missing {
                let Some(k) = free.iter().position(|(_, gpus)| gpus.len() >= tp as usize) else {
                    let mut g = self.inner.lock().unwrap();
                    if !std::mem::replace(&mut g.slots[i].warned, true) {
                        tracing::warn!(target: "berth::pool", partition = %self.partition, executor = i, tp, "no agent node has {tp} free healthy GPUs for this executor yet");
                    }
                    continue;
                };
                let gpus: Vec<u32> = free[k].1.drain(..tp as usize).collect();
                let node = free[k].0.clone();
                match hub.start_executor(&self.partition, &node, &gpus) {
                    Ok(alloc) => {
                        let mut g = self.inner.lock().unwrap();
                        let slot = &mut g.slots[i];
                        slot.alloc = Some(alloc);
                        slot.node = node.clone();
                        slot.warned = false;
                        tracing::info!(target: "berth::pool", partition = %self.partition, executor = i, allocation = alloc, %node, ?gpus, "executor starting");
                    }
                    Err(e) => tracing::warn!(target: "berth::pool", partition = %self.partition, executor = i, %node, "starting an executor: {}", e.message()),
                }
            }
        }
        let version = live.partitions[self.p].pool.active.lock().unwrap().as_ref().map(|a| a.meta.version);
        let candidate = live.partitions[self.p].pool.candidate.lock().unwrap().as_ref().map(|a| a.meta.version);
        let due = {
            let g = self.inner.lock().unwrap();
            let interval = Duration::from_secs_f64(self.cfg.replan_interval_s);
            // A swapped pool version places at once; a new candidate is
            // compared at once.
            g.slots.iter().any(|s| s.ready)
                && (g.want_place || g.placed_version != version || g.shadowed != candidate || g.last_place.is_none_or(|t| t.elapsed() >= interval))
        };
        if due {
            self.replan(live);
            self.inner.lock().unwrap().shadowed = candidate;
        }
        self.push_step_policy(live);
        let g = self.inner.lock().unwrap();
        let mut by_state: std::collections::BTreeMap<(u32, &str), i64> = Default::default();
        for s in &g.slots {
            let state = if s.ready { "ready" } else if s.alloc.is_some() { "starting" } else { "missing" };
            *by_state.entry((s.tp, state)).or_default() += 1;
            for other in ["ready", "starting", "missing"] {
                by_state.entry((s.tp, other)).or_default();
            }
        }
        for ((tp, state), n) in by_state {
            live.metrics.pool_executors.with_label_values(&[&self.partition, &tp.to_string(), state]).set(n);
        }
    }

    fn state(&self, g: &Inner) -> PoolState {
        let now = Instant::now();
        let mut s = PoolState { now_ms: now.duration_since(g.window_start).as_millis() as u64, ..Default::default() };
        for (m, spec) in self.cfg.models.iter().enumerate() {
            let c = g.arrived[m] as f64;
            let (p, o) = if c > 0.0 { (g.prompt_sum[m] / c, g.output_sum[m] / c) } else { (1020.0, 129.0) };
            let t = pool::ModelTraffic { arrived: g.arrived[m], rate: g.rate[m], peak_rate: g.peak_rate[m], service_s: self.cfg.service_s(m, p, o), queued: g.unrouted[m] };
            pool::push_model(&mut s, spec, t);
        }
        for (e, slot) in g.slots.iter().enumerate() {
            s.executor_tp.push(slot.tp);
            s.executor_memory_bytes.push(self.cfg.executor_memory(slot.tp));
            s.executor_load.push(slot.load);
            for row in &g.rows[e] {
                let m = row.model as usize;
                s.assigned_executor.push(e as u32);
                s.assigned_model.push(row.model);
                s.assigned_pinned.push(u8::from(row.pinned));
                s.assigned_load.push(g.requests.values().filter(|r| r.slot == e && r.model == m).count() as u32);
                s.assigned_idle_ms.push(g.last_run.get(&(e, m)).map_or(u64::MAX, |t| now.duration_since(*t).as_millis() as u64));
            }
        }
        s
    }

    /// Runs `pool-place` (the active pool version, else the default),
    /// validates its answer whole and sends each executor its rows. A
    /// refused answer counts against the version's breaker and the default
    /// placement decides this time.
    pub fn replan(&self, live: &Live) {
        let part = &live.partitions[self.p];
        let (state, shape) = {
            let mut g = self.inner.lock().unwrap();
            // Arrival rates over the window since the last placement.
            let span = g.window_start.elapsed().as_secs_f64().max(1e-3);
            for m in 0..g.rate.len() {
                g.rate[m] = g.window[m] as f64 / span;
                g.peak_rate[m] = g.peak_rate[m].max(g.rate[m]);
                g.window[m] = 0;
            }
            g.window_start = Instant::now();
            let shape: Vec<(u32, u64)> = g.slots.iter().map(|s| (s.tp, self.cfg.executor_memory(s.tp))).collect();
            (self.state(&g), shape)
        };
        let arm = part.pool.active.lock().unwrap().clone().filter(|a| a.policy.lock().unwrap().loaded().info.hooks.contains(berth_sdk::Hooks::POOL_PLACE));
        let (placement, by) = match &arm {
            None => (berth_sdk::default_pool_place(&state), "the default placement".to_string()),
            Some(arm) => {
                let label = format!("{}@{} (pool version {})", arm.meta.name, arm.meta.semver, arm.meta.version);
                let started = Instant::now();
                let answer = arm.policy.lock().unwrap().pool_place(&state);
                let took = started.elapsed();
                let checked = answer.and_then(|a| a.map(|p| pool::check_placement(&self.cfg, &shape, &p).map(|_| p)).transpose());
                match checked {
                    Ok(Some(p)) => {
                        part.pool.breaker.lock().unwrap().record(arm.meta.version, Call::Answered(took), &live.breaker);
                        (p, label)
                    }
                    Ok(None) => {
                        part.pool.breaker.lock().unwrap().record(arm.meta.version, Call::Answered(took), &live.breaker);
                        (berth_sdk::default_pool_place(&state), format!("{label}, which left it to the default"))
                    }
                    Err(e) => {
                        live.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &arm.meta.version.to_string(), super::breaker::kind(&e)]).inc();
                        tracing::warn!(target: "berth::pool", partition = %self.partition, version = arm.meta.version, "pool placement refused: {e}; the default placement decides");
                        if super::breaker::counts(&e)
                            && let Some(why) = part.pool.breaker.lock().unwrap().record(arm.meta.version, Call::Failed(&e), &live.breaker)
                        {
                            live.trip_aux(self.p, PolicyHook::Pool, arm, &why);
                        }
                        (berth_sdk::default_pool_place(&state), format!("the default placement ({label} refused: {e})"))
                    }
                }
            }
        };
        self.shadow_place(live, &state, &shape, &placement);
        self.apply(&placement, by, arm.map(|a| a.meta.version));
    }

    /// A pool candidate in shadow places on the same state; both arms'
    /// placements are tallied, the candidate's never applied.
    fn shadow_place(&self, live: &Live, state: &PoolState, shape: &[(u32, u64)], placed: &PoolPlacement) {
        let part = &live.partitions[self.p];
        let Some(candidate) = part.pool.candidate.lock().unwrap().clone() else { return };
        if !candidate.policy.lock().unwrap().loaded().info.hooks.contains(berth_sdk::Hooks::POOL_PLACE) {
            return;
        }
        let answer = candidate.policy.lock().unwrap().pool_place(state);
        let checked = answer.map(|a| a.unwrap_or_else(|| berth_sdk::default_pool_place(state))).and_then(|p| pool::check_placement(&self.cfg, shape, &p).map(|_| p));
        let mut stats = part.pool.stats.lock().unwrap();
        stats.replans += 1;
        stats.active.add(state, placed);
        match checked {
            Ok(p) => {
                stats.agreed += u64::from(super::shadow::same_placement(&p, placed));
                stats.candidate.add(state, &p);
            }
            Err(e) => {
                stats.candidate_errors += 1;
                tracing::debug!(target: "berth::pool", partition = %self.partition, version = candidate.meta.version, "pool candidate's placement refused: {e}");
            }
        }
    }

    fn apply(&self, p: &PoolPlacement, by: String, version: Option<u32>) {
        let mut g = self.inner.lock().unwrap();
        g.placed_version = version;
        let mut rows = vec![Vec::new(); g.slots.len()];
        for i in 0..p.executor.len() {
            rows[p.executor[i] as usize].push(PlaceRow { model: p.model[i], weight: p.weight[i], pinned: p.pinned[i] == 1 });
        }
        for (e, r) in rows.iter().enumerate() {
            if *r != g.rows[e] && g.slots[e].ready {
                send(&g.slots[e], &Down::Place { rows: r.clone() });
            }
        }
        if g.placed_by != by {
            tracing::info!(target: "berth::pool", partition = %self.partition, pairs = p.executor.len(), "placed by {by}");
        }
        g.rows = rows;
        g.placed_by = by;
        g.want_place = false;
        g.last_place = Some(Instant::now());
        drop(g);
        self.placed.notify_waiters();
    }

    /// Sends the active pool version's component to every ready executor
    /// that runs another (or, with none active, tells it to step by the
    /// default), and the candidate in shadow likewise: each swap happens
    /// between two of its steps.
    fn push_step_policy(&self, live: &Live) {
        let part = &live.partitions[self.p];
        let with_step = |a: &Option<Arc<super::state::Arm>>| a.clone().filter(|a| a.policy.lock().unwrap().loaded().info.hooks.contains(berth_sdk::Hooks::POOL_STEP));
        let active = with_step(&part.pool.active.lock().unwrap());
        let candidate = with_step(&part.pool.candidate.lock().unwrap());
        for (shadow, arm) in [(false, active), (true, candidate)] {
            let digest = arm.as_ref().map_or(String::new(), |a| a.meta.sha256.clone());
            // Never sent and none wanted: no candidate to clear.
            let stale = |s: &Slot| {
                let sent = if shadow { &s.shadow_sent } else { &s.policy_sent };
                s.ready && sent.as_deref() != Some(digest.as_str()) && !(shadow && sent.is_none() && digest.is_empty())
            };
            if !self.inner.lock().unwrap().slots.iter().any(stale) {
                continue;
            }
            let component = match &arm {
                None => String::new(),
                Some(a) => match live.registry.component(&a.meta.sha256) {
                    Ok(bytes) => {
                        use base64::Engine as _;
                        base64::engine::general_purpose::STANDARD.encode(bytes)
                    }
                    Err(e) => {
                        tracing::warn!(target: "berth::pool", partition = %self.partition, "pool-step component {}: {e}", a.meta.sha256);
                        continue;
                    }
                },
            };
            if component.len() + 256 > MAX_LINE_BYTES {
                tracing::warn!(target: "berth::pool", partition = %self.partition, "pool-step component of {} base64 bytes exceeds an executor line", component.len());
                continue;
            }
            let down = Down::Policy { digest: digest.clone(), component, shadow };
            let mut g = self.inner.lock().unwrap();
            for slot in g.slots.iter_mut().filter(|s| stale(s)) {
                if send(slot, &down) {
                    *(if shadow { &mut slot.shadow_sent } else { &mut slot.policy_sent }) = Some(digest.clone());
                }
            }
        }
    }

    /// The pool as `PoolStatus` shows it.
    pub fn status(&self, live: &Live) -> pb::PoolStatusResponse {
        let part = &live.partitions[self.p];
        let reference = |a: &Option<Arc<super::state::Arm>>| {
            a.as_ref().map(|a| pb::PolicyRef { version: a.meta.version, name: a.meta.name.clone(), policy_version: a.meta.semver.clone(), sha256: a.meta.sha256.clone() })
        };
        let active = reference(&part.pool.active.lock().unwrap());
        let candidate = reference(&part.pool.candidate.lock().unwrap());
        let g = self.inner.lock().unwrap();
        let name = |m: u32| self.cfg.models.get(m as usize).map_or_else(|| format!("#{m}"), |s| s.name.clone());
        let executors = g
            .slots
            .iter()
            .enumerate()
            .map(|(e, s)| pb::PoolExecutorStatus {
                index: e as u32,
                tp: s.tp,
                state: if s.ready { "ready" } else if s.alloc.is_some() { "starting" } else { "missing" }.into(),
                node: s.node.clone(),
                allocation_id: s.alloc.unwrap_or(0),
                load: s.load,
                models: g.rows[e].iter().map(|r| pb::PoolModelRow { model: name(r.model), weight: r.weight, pinned: r.pinned }).collect(),
                steps_policy: s.tally.policy,
                steps_default: s.tally.default,
                steps_fallback: s.tally.fallback,
                shadow_agreed: s.tally.shadow_agreed,
                shadow_differed: s.tally.shadow_differed,
                shadow_refused: s.tally.shadow_refused,
                recent: s.tally.recent.iter().cloned().collect(),
                loads: s.tally.loads,
                step_policy: s.step_policy.clone(),
            })
            .collect();
        let o = &g.outcomes;
        pb::PoolStatusResponse {
            partition: self.partition.clone(),
            placed_by: g.placed_by.clone(),
            active,
            candidate,
            executors,
            slo_met: o.slo_met,
            slo_missed: o.slo_missed,
            failed: o.failed,
            rejected: o.rejected,
            cancelled: o.cancelled,
            in_flight: g.requests.len() as u64,
            waiting_for_route: g.unrouted.iter().map(|&u| u64::from(u)).sum(),
            ttft_p50_s: quantile(&o.ttft, 0.5),
            ttft_p99_s: quantile(&o.ttft, 0.99),
            tbt_p50_s: quantile(&o.tbt, 0.5),
            tbt_p99_s: quantile(&o.tbt, 0.99),
            slo_ttft_s: self.cfg.slo.ttft_s,
            slo_tbt_s: self.cfg.slo.tbt_s,
            models: self.cfg.models.len() as u32,
        }
    }
}

impl PoolRun {
    /// An executor gave up on pool-step component `digest`: if it is the
    /// active pool version's, the breaker takes that version out (the
    /// default placement and step decide until an operator activates one).
    pub fn trip_step(&self, live: &Live, digest: &str, why: &str) {
        let part = &live.partitions[self.p];
        let arm = part.pool.active.lock().unwrap().clone();
        if let Some(arm) = arm.filter(|a| a.meta.sha256 == digest) {
            live.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &arm.meta.version.to_string(), "invalid_output"]).inc();
            live.trip_aux(self.p, PolicyHook::Pool, &arm, &format!("its pool-step answers were refused: {why}"));
        }
    }
}

/// What a pool looks like now.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PoolSummary {
    pub executors: usize,
    pub started: usize,
    pub ready: usize,
    pub in_flight: usize,
    pub placed_by: String,
    /// Executor-model pairs placed.
    pub rows: usize,
}

fn route(g: &Inner, model: usize) -> Option<usize> {
    pool::route_least_loaded(g.slots.iter().enumerate().filter(|(_, s)| s.ready && s.down.is_some()).filter_map(|(e, s)| {
        g.rows[e].iter().find(|r| r.model as usize == model).map(|r| (e, s.load, r.weight))
    }))
}

fn admit(g: &mut Inner, id: u64, req: Req) {
    let slot = &mut g.slots[req.slot];
    slot.load += 1;
    send(slot, &Down::Admit { id, model: req.model as u32, prompt_tokens: req.prompt, output_tokens: req.output });
    g.requests.insert(id, req);
}

/// Runs every pool's supervisor round once a second, off the async workers
/// (starting an executor writes the store).
pub fn spawn_supervisor(pools: Arc<Pools>, live: Arc<Live>, hub: Arc<dyn ExecutorHost>, mut stopped: tokio::sync::watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(500));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stopped.wait_for(|s| *s) => return,
            }
            let (pools, live, hub) = (pools.clone(), live.clone(), hub.clone());
            let _ = tokio::task::spawn_blocking(move || {
                for pool in &pools.pools {
                    pool.tick(&live, &*hub);
                }
            })
            .await;
        }
    })
}

/// A pool's status as JSON (the CLI's --json and the console).
pub fn status_json(r: &pb::PoolStatusResponse) -> serde_json::Value {
    let reference = |p: &Option<pb::PolicyRef>| p.as_ref().map(|p| serde_json::json!({"version": p.version, "name": p.name, "policy_version": p.policy_version, "sha256": p.sha256}));
    serde_json::json!({
        "partition": r.partition,
        "placed_by": r.placed_by,
        "active": reference(&r.active),
        "candidate": reference(&r.candidate),
        "models": r.models,
        "requests": {
            "slo_met": r.slo_met, "slo_missed": r.slo_missed, "failed": r.failed, "rejected": r.rejected,
            "cancelled": r.cancelled, "in_flight": r.in_flight, "waiting_for_route": r.waiting_for_route,
        },
        "latency": {
            "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s, "tbt_p50_s": r.tbt_p50_s, "tbt_p99_s": r.tbt_p99_s,
            "slo_ttft_s": r.slo_ttft_s, "slo_tbt_s": r.slo_tbt_s,
        },
        "executors": r.executors.iter().map(|e| serde_json::json!({
            "index": e.index, "tp": e.tp, "state": e.state, "node": e.node, "allocation_id": e.allocation_id, "load": e.load,
            "models": e.models.iter().map(|m| serde_json::json!({"model": m.model, "weight": m.weight, "pinned": m.pinned})).collect::<Vec<_>>(),
            "step_policy": e.step_policy, "loads": e.loads,
            "steps": {"policy": e.steps_policy, "default": e.steps_default, "fallback": e.steps_fallback},
            "shadow": {"agreed": e.shadow_agreed, "differed": e.shadow_differed, "refused": e.shadow_refused},
            "recent": e.recent.iter().map(|s| serde_json::json!({
                "t": s.t, "phase": s.phase, "model": s.model, "batch": s.batch, "iterations": s.iterations,
                "seconds": s.seconds, "by": s.by, "why": s.why, "shadow": s.shadow,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_executor_that_keeps_failing_is_restarted_ever_more_slowly() {
        let delays: Vec<u64> = (1..=8).map(|n| restart_delay(n).as_secs()).collect();
        assert_eq!(delays, [2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(restart_delay(0), RESTART_DELAY);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let samples: std::collections::VecDeque<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&samples, 0.5), 50.0);
        assert_eq!(quantile(&samples, 0.99), 99.0);
        assert_eq!(quantile(&Default::default(), 0.99), 0.0);
    }
}
