//! One policy component: loaded once (compiled or from cache, pre-linked),
//! instantiated per [`WasmPolicy`], every call under limits.

use std::path::Path;
use std::sync::Arc;

use berth_core::PolicyError;
use berth_sdk::{Allocations, Hooks, Nodes, Plan, PolicyInfo, Scores, Snapshot, Task};
use wasmtime::Store;

use super::bindings::v0_1_0 as v1;
use super::cache;
use super::engine::{GuestState, Limits, PolicyEngine, TICK};

use v1::berth::policy::types as w;

/// A validated, pre-linked component: cheap to instantiate many times.
pub struct LoadedPolicy {
    pre: v1::PlacementPolicyPre<GuestState>,
    /// SHA-256 of the component bytes.
    pub hash: String,
    /// What the component said about itself at load.
    pub info: PolicyInfo,
}

impl LoadedPolicy {
    /// Compiles (or loads from cache) and links a component, then runs
    /// `info` in a fresh instance under default limits to check it really
    /// is a Berth policy.
    pub fn from_bytes(engine: &PolicyEngine, bytes: &[u8]) -> Result<Arc<LoadedPolicy>, PolicyError> {
        let hash = cache::content_hash(bytes);
        let component = cache::load_component(&engine.engine, engine.cache_dir.as_deref(), bytes, &hash)
            .map_err(|e| PolicyError::Load(format!("{e:#}")))?;
        let instance_pre = engine
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PolicyError::Load(format!("not a berth:policy@0.1.0 component: {e:#}")))?;
        let pre = v1::PlacementPolicyPre::new(instance_pre)
            .map_err(|e| PolicyError::Load(format!("not a berth:policy@0.1.0 component: {e:#}")))?;
        let mut loaded = LoadedPolicy { pre, hash, info: PolicyInfo { name: String::new(), version: String::new(), hooks: Hooks::NONE } };
        let mut probe = Instance::new(engine, &loaded, Limits::default(), "loading")?;
        let info = probe.call(engine, |b, s| b.berth_policy_policy().call_info(s))?;
        if info.name.is_empty() || !info.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
            return Err(PolicyError::Load(format!("policy name {:?} is not lowercase-with-dashes", info.name)));
        }
        if !is_semver(&info.version) {
            return Err(PolicyError::Load(format!("policy version {:?} is not semver (x.y.z)", info.version)));
        }
        loaded.info = PolicyInfo { name: info.name, version: info.version, hooks: hooks_of(info.hooks) };
        Ok(Arc::new(loaded))
    }

    pub fn from_file(engine: &PolicyEngine, path: &Path) -> Result<Arc<LoadedPolicy>, PolicyError> {
        let bytes = std::fs::read(path).map_err(|e| PolicyError::Load(format!("{}: {e}", path.display())))?;
        Self::from_bytes(engine, &bytes)
    }
}

fn hooks_of(h: w::Hooks) -> Hooks {
    [(w::Hooks::SCORE, Hooks::SCORE), (w::Hooks::COMPACT, Hooks::COMPACT), (w::Hooks::RANK, Hooks::RANK)]
        .into_iter()
        .filter(|(wit, _)| h.contains(*wit))
        .fold(Hooks::NONE, |acc, (_, ours)| acc | ours)
}

fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

/// A live instance and its store. Dropped after any trap: a trapped instance
/// must not be re-entered.
struct Instance {
    store: Store<GuestState>,
    bindings: v1::PlacementPolicy,
    limits: Limits,
}

impl Instance {
    fn new(engine: &PolicyEngine, loaded: &LoadedPolicy, limits: Limits, label: &str) -> Result<Instance, PolicyError> {
        let state = GuestState {
            policy: label.to_string(),
            memory_cap: limits.memory_bytes,
            memory_cap_hit: false,
            log_budget: limits.log_lines_per_call,
            logs_dropped: 0,
        };
        let mut store = Store::new(&engine.engine, state);
        store.limiter(|s| s);
        store.set_epoch_deadline(deadline_ticks(&limits));
        store.epoch_deadline_trap();
        let bindings = loaded.pre.instantiate(&mut store).map_err(|e| classify(e, &store, &limits))?;
        Ok(Instance { store, bindings, limits })
    }

    /// Runs one export call under the deadline and log budget, mapping every
    /// wasmtime failure onto [`PolicyError`].
    fn call<R>(
        &mut self,
        _engine: &PolicyEngine,
        f: impl FnOnce(&v1::PlacementPolicy, &mut Store<GuestState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyError> {
        self.store.set_epoch_deadline(deadline_ticks(&self.limits));
        self.store.data_mut().log_budget = self.limits.log_lines_per_call;
        f(&self.bindings, &mut self.store).map_err(|e| classify(e, &self.store, &self.limits))
    }
}

fn deadline_ticks(limits: &Limits) -> u64 {
    // +1: the current tick may be about to end.
    (limits.deadline.as_nanos() / TICK.as_nanos()).max(1) as u64 + 1
}

fn classify(e: wasmtime::Error, store: &Store<GuestState>, limits: &Limits) -> PolicyError {
    if store.data().memory_cap_hit {
        return PolicyError::OutOfMemory { cap_bytes: limits.memory_bytes };
    }
    if let Some(wasmtime::Trap::Interrupt) = e.downcast_ref::<wasmtime::Trap>() {
        return PolicyError::Timeout { deadline_ms: limits.deadline.as_millis() as u64 };
    }
    PolicyError::Trap(format!("{e:#}"))
}

/// A policy component ready to decide: one instance, its configuration, its
/// limits. Not shared between threads; make one per worker.
pub struct WasmPolicy {
    engine: Arc<PolicyEngine>,
    loaded: Arc<LoadedPolicy>,
    limits: Limits,
    config: String,
    instance: Option<Instance>,
    /// Instances started (1 + re-instantiations after traps).
    pub instantiations: u64,
}

impl WasmPolicy {
    pub fn new(engine: Arc<PolicyEngine>, loaded: Arc<LoadedPolicy>, limits: Limits) -> WasmPolicy {
        WasmPolicy { engine, loaded, limits, config: String::new(), instance: None, instantiations: 0 }
    }

    pub fn info(&self) -> &PolicyInfo {
        &self.loaded.info
    }

    pub fn hash(&self) -> &str {
        &self.loaded.hash
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Instantiates now (so the first decision does not pay for it).
    pub fn warm(&mut self) -> Result<(), PolicyError> {
        self.instance().map(|_| ())
    }

    fn instance(&mut self) -> Result<&mut Instance, PolicyError> {
        if self.instance.is_none() {
            let label = format!("{}@{}", self.loaded.info.name, self.loaded.info.version);
            let mut inst = Instance::new(&self.engine, &self.loaded, self.limits, &label)?;
            self.instantiations += 1;
            if !self.config.is_empty() {
                let config = self.config.clone();
                inst.call(&self.engine, |b, s| b.berth_policy_policy().call_configure(s, &config))?
                    .map_err(PolicyError::Guest)?;
            }
            self.instance = Some(inst);
        }
        Ok(self.instance.as_mut().expect("just set"))
    }

    /// Runs one call; any trap, timeout or OOM discards the instance so the
    /// next call starts clean.
    fn call<R>(
        &mut self,
        f: impl FnOnce(&v1::PlacementPolicy, &mut Store<GuestState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyError> {
        let engine = self.engine.clone();
        let result = self.instance()?.call(&engine, f);
        if result.is_err() {
            self.instance = None;
        }
        result
    }

    fn require(&self, hook: Hooks, name: &'static str) -> Result<(), PolicyError> {
        if self.loaded.info.hooks.contains(hook) { Ok(()) } else { Err(PolicyError::Unsupported(name)) }
    }

    /// Applies a configuration. On error the previous one stays in force.
    pub fn configure(&mut self, config: &str) -> Result<(), PolicyError> {
        let owned = config.to_string();
        match self.call(|b, s| b.berth_policy_policy().call_configure(s, &owned))? {
            Ok(()) => {
                self.config = owned;
                Ok(())
            }
            Err(msg) => {
                // The guest may have half-applied it; restart from the old one.
                self.instance = None;
                Err(PolicyError::Guest(msg))
            }
        }
    }

    /// Placement scoring, unchecked: the core validates the answer.
    pub fn score_raw(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.require(Hooks::SCORE, "score")?;
        let t = to_wit_task(task);
        let mut n = take_nodes(nodes);
        let result = self.call(|b, s| b.berth_policy_policy().call_score(s, &t, &n));
        restore_nodes(nodes, &mut n);
        let scores = result?.map_err(PolicyError::Guest)?;
        Ok(Scores { scores: scores.scores, gpus: scores.gpus })
    }

    /// Compaction planning, unchecked: the host validates every move.
    pub fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError> {
        self.require(Hooks::COMPACT, "compact")?;
        let mut snap = w::Snapshot {
            nodes: take_nodes(&mut snapshot.nodes),
            allocations: take_allocations(&mut snapshot.allocations),
            pending: w::Pending {
                gpu_count: std::mem::take(&mut snapshot.pending.gpu_count),
                gpu_milli: std::mem::take(&mut snapshot.pending.gpu_milli),
                whole_nodes: std::mem::take(&mut snapshot.pending.whole_nodes),
                model: std::mem::take(&mut snapshot.pending.model),
            },
        };
        let result = self.call(|b, s| b.berth_policy_policy().call_compact(s, &snap));
        restore_nodes(&mut snapshot.nodes, &mut snap.nodes);
        restore_allocations(&mut snapshot.allocations, &mut snap.allocations);
        let p = &mut snapshot.pending;
        p.gpu_count = snap.pending.gpu_count;
        p.gpu_milli = snap.pending.gpu_milli;
        p.whole_nodes = snap.pending.whole_nodes;
        p.model = snap.pending.model;
        let plan = result?.map_err(PolicyError::Guest)?;
        Ok(Plan { chain: plan.chain, allocation: plan.allocation, dest_node: plan.dest_node, dest_gpus: plan.dest_gpus })
    }

    /// Preemption ranking, checked: every index in range and at most once.
    pub fn rank(&mut self, demand: &Task, victims: &mut Allocations) -> Result<Vec<u32>, PolicyError> {
        self.require(Hooks::RANK, "rank")?;
        let t = to_wit_task(demand);
        let mut v = take_allocations(victims);
        let result = self.call(|b, s| b.berth_policy_policy().call_rank(s, &t, &v));
        restore_allocations(victims, &mut v);
        let order = result?.map_err(PolicyError::Guest)?;
        let mut seen = vec![false; victims.len()];
        for &i in &order {
            let slot = seen
                .get_mut(i as usize)
                .ok_or_else(|| PolicyError::InvalidOutput(format!("victim index {i} out of {} victims", victims.len())))?;
            if std::mem::replace(slot, true) {
                return Err(PolicyError::InvalidOutput(format!("victim index {i} ranked twice")));
            }
        }
        Ok(order)
    }
}

impl berth_core::PlacementPolicy for WasmPolicy {
    fn describe(&self) -> String {
        format!("{}@{} (wasm)", self.loaded.info.name, self.loaded.info.version)
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.score_raw(task, nodes)
    }
}

fn to_wit_task(t: &Task) -> w::Task {
    w::Task {
        job_id: t.job_id,
        gpu_count: t.gpu_count,
        gpu_milli: t.gpu_milli,
        cpu_milli: t.cpu_milli,
        memory_mib: t.memory_mib,
        models: t.models.clone(),
        priority: t.priority,
        gang_size: t.gang_size,
        gang_index: t.gang_index,
    }
}

// The columns move into the binding's record for the call and back after:
// lowering copies them into guest memory once, and nothing else copies them.
fn take_nodes(n: &mut Nodes) -> w::Nodes {
    use std::mem::take;
    w::Nodes {
        ids: take(&mut n.ids),
        model: take(&mut n.model),
        models: take(&mut n.models),
        switch_domain: take(&mut n.switch_domain),
        cpu_free_milli: take(&mut n.cpu_free_milli),
        cpu_total_milli: take(&mut n.cpu_total_milli),
        memory_free_mib: take(&mut n.memory_free_mib),
        memory_total_mib: take(&mut n.memory_total_mib),
        gpu_count: take(&mut n.gpu_count),
        gpu_start: take(&mut n.gpu_start),
        gpu_free_milli: take(&mut n.gpu_free_milli),
        alloc_kinds: take(&mut n.alloc_kinds),
    }
}

fn restore_nodes(n: &mut Nodes, w: &mut w::Nodes) {
    use std::mem::take;
    n.ids = take(&mut w.ids);
    n.model = take(&mut w.model);
    n.models = take(&mut w.models);
    n.switch_domain = take(&mut w.switch_domain);
    n.cpu_free_milli = take(&mut w.cpu_free_milli);
    n.cpu_total_milli = take(&mut w.cpu_total_milli);
    n.memory_free_mib = take(&mut w.memory_free_mib);
    n.memory_total_mib = take(&mut w.memory_total_mib);
    n.gpu_count = take(&mut w.gpu_count);
    n.gpu_start = take(&mut w.gpu_start);
    n.gpu_free_milli = take(&mut w.gpu_free_milli);
    n.alloc_kinds = take(&mut w.alloc_kinds);
}

fn take_allocations(a: &mut Allocations) -> w::Allocations {
    use std::mem::take;
    w::Allocations {
        ids: take(&mut a.ids),
        job_ids: take(&mut a.job_ids),
        node: take(&mut a.node),
        gpus: take(&mut a.gpus),
        gpu_milli: take(&mut a.gpu_milli),
        cpu_milli: take(&mut a.cpu_milli),
        memory_mib: take(&mut a.memory_mib),
        priority: take(&mut a.priority),
        movable: take(&mut a.movable),
        gang_id: take(&mut a.gang_id),
        state_bytes: take(&mut a.state_bytes),
        remaining_s: take(&mut a.remaining_s),
        running_s: take(&mut a.running_s),
        since_checkpoint_s: take(&mut a.since_checkpoint_s),
    }
}

fn restore_allocations(a: &mut Allocations, w: &mut w::Allocations) {
    use std::mem::take;
    a.ids = take(&mut w.ids);
    a.job_ids = take(&mut w.job_ids);
    a.node = take(&mut w.node);
    a.gpus = take(&mut w.gpus);
    a.gpu_milli = take(&mut w.gpu_milli);
    a.cpu_milli = take(&mut w.cpu_milli);
    a.memory_mib = take(&mut w.memory_mib);
    a.priority = take(&mut w.priority);
    a.movable = take(&mut w.movable);
    a.gang_id = take(&mut w.gang_id);
    a.state_bytes = take(&mut w.state_bytes);
    a.remaining_s = take(&mut w.remaining_s);
    a.running_s = take(&mut w.running_s);
    a.since_checkpoint_s = take(&mut w.since_checkpoint_s);
}
