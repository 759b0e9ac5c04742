//! One policy component: loaded once (compiled or from cache, pre-linked),
//! instantiated per [`WasmPolicy`], every call under limits.

use std::path::Path;
use std::sync::Arc;

use berth_core::PolicyError;
use berth_sdk::{Allocations, Domains, Hooks, Nodes, Plan, PolicyInfo, PoolExecutor, PoolPlacement, PoolState, PoolStep, Scores, Snapshot, Task};
use wasmtime::Store;

use super::bindings::{v0_1_0 as v1, v0_2_0 as v2, v0_3_0 as v3, v0_4_0 as v4};
use super::cache;
use super::engine::{thread_cpu_time, DeadlineClock, GuestState, Limits, PolicyEngine, MAX_CORE_INSTANCES, MAX_MEMORIES, MAX_TABLES, TABLE_ELEMENT_BYTES, TICK};

/// Longest policy name a component may report, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Longest policy version a component may report, in bytes.
pub const MAX_VERSION_BYTES: usize = 64;
/// Longest guest error text kept, in bytes; the rest is cut. Bounds what a
/// failing call puts into a decision record, a log line or a reply.
pub const MAX_ERROR_BYTES: usize = 1024;

/// What a component declares, read before it is compiled.
#[derive(Debug, Default)]
struct Declared {
    memories: usize,
    tables: usize,
    core_instances: usize,
    /// Sum of the memories' and tables' initial sizes, in bytes.
    initial_bytes: u64,
    /// The newest `berth:policy/policy@x.y.z` contract it exports, if any.
    contract: Option<String>,
}

/// Reads what `bytes` declares: counts memories, tables and core instances
/// over all its core modules, and finds the contract it exports.
fn declared(bytes: &[u8]) -> Result<Declared, String> {
    use wasmparser::{Parser, Payload};
    let mut d = Declared::default();
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(|e| format!("not a valid wasm component: {e}"))? {
            Payload::MemorySection(r) => {
                for m in r {
                    let m = m.map_err(|e| e.to_string())?;
                    d.memories += 1;
                    d.initial_bytes = d.initial_bytes.saturating_add(m.initial.saturating_mul(1 << m.page_size_log2()));
                }
            }
            Payload::TableSection(r) => {
                for t in r {
                    let t = t.map_err(|e| e.to_string())?;
                    d.tables += 1;
                    d.initial_bytes = d.initial_bytes.saturating_add(t.ty.initial.saturating_mul(TABLE_ELEMENT_BYTES));
                }
            }
            Payload::InstanceSection(r) => d.core_instances += r.count() as usize,
            Payload::ComponentExportSection(r) => {
                for e in r {
                    let name = e.map_err(|e| e.to_string())?.name.name;
                    if let Some(v) = name.strip_prefix("berth:policy/policy@")
                        && d.contract.as_deref().is_none_or(|c| c < v)
                    {
                        d.contract = Some(v.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(d)
}

/// Refuses, before compiling it, a component that declares more memories,
/// tables or core instances than an instance may create, or whose initial
/// sizes alone exceed the memory cap.
fn check_declared(d: &Declared, limits: &Limits) -> Result<(), PolicyError> {
    let too_many = |what: &str, n: usize, max: usize| {
        PolicyError::Load(format!("the component declares {n} {what}; a policy may have at most {max}"))
    };
    if d.memories > MAX_MEMORIES {
        return Err(too_many("linear memories", d.memories, MAX_MEMORIES));
    }
    if d.tables > MAX_TABLES {
        return Err(too_many("tables", d.tables, MAX_TABLES));
    }
    if d.core_instances > MAX_CORE_INSTANCES {
        return Err(too_many("core instances", d.core_instances, MAX_CORE_INSTANCES));
    }
    if d.initial_bytes > limits.memory_bytes {
        return Err(PolicyError::Load(format!(
            "the component's memories and tables start at {} bytes together; the memory cap per instance is {}",
            d.initial_bytes, limits.memory_bytes
        )));
    }
    Ok(())
}

/// A pre-linked component of one contract version.
enum Pre {
    V1(v1::PlacementPolicyPre<GuestState>),
    V2(v2::PlacementPolicyPre<GuestState>),
    V3(v3::PlacementPolicyPre<GuestState>),
    V4(v4::PlacementPolicyPre<GuestState>),
}

/// A live component's exports, of one contract version.
pub(crate) enum Bindings {
    V1(v1::PlacementPolicy),
    V2(v2::PlacementPolicy),
    V3(v3::PlacementPolicy),
    V4(v4::PlacementPolicy),
}

/// Runs `$body` with `$b` bound to the version's bindings and `$c` to that
/// version's column conversions: one body, every contract version.
macro_rules! each_version {
    ($bindings:expr, $b:ident, $c:ident => $body:expr) => {
        match $bindings {
            Bindings::V1($b) => {
                #[allow(unused_imports)]
                use conv_v1 as $c;
                $body
            }
            Bindings::V2($b) => {
                #[allow(unused_imports)]
                use conv_v2 as $c;
                $body
            }
            Bindings::V3($b) => {
                #[allow(unused_imports)]
                use conv_v3 as $c;
                $body
            }
            Bindings::V4($b) => {
                #[allow(unused_imports)]
                use conv_v4 as $c;
                $body
            }
        }
    };
}

/// A validated, pre-linked component: cheap to instantiate many times.
pub struct LoadedPolicy {
    pre: Pre,
    /// Contract version the component implements, e.g. `0.2.0`.
    pub contract: &'static str,
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
        let declared = declared(bytes).map_err(PolicyError::Load)?;
        check_declared(&declared, &Limits::default())?;
        let contract_named = declared.contract.as_deref().map_or_else(
            || "a component exporting no berth:policy/policy interface".to_string(),
            |v| format!("a berth:policy@{v} component"),
        );
        let hash = cache::content_hash(bytes);
        let component = cache::load_component(&engine.engine, engine.cache_dir.as_deref(), bytes, &hash)
            .map_err(|e| PolicyError::Load(format!("{e:#}")))?;
        let instance_pre = engine
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PolicyError::Load(format!("{contract_named} whose imports the host does not provide: {e:#}")))?;
        // Newest contract first; a component exports exactly one.
        let mut why: Vec<(&str, String)> = Vec::new();
        let pre = match v4::PlacementPolicyPre::new(instance_pre.clone()) {
            Ok(p) => Some((Pre::V4(p), "0.4.0")),
            Err(e) => {
                why.push(("0.4.0", format!("{e:#}")));
                None
            }
        }
        .or_else(|| match v3::PlacementPolicyPre::new(instance_pre.clone()) {
            Ok(p) => Some((Pre::V3(p), "0.3.0")),
            Err(e) => {
                why.push(("0.3.0", format!("{e:#}")));
                None
            }
        })
        .or_else(|| match v2::PlacementPolicyPre::new(instance_pre.clone()) {
            Ok(p) => Some((Pre::V2(p), "0.2.0")),
            Err(e) => {
                why.push(("0.2.0", format!("{e:#}")));
                None
            }
        })
        .or_else(|| match v1::PlacementPolicyPre::new(instance_pre) {
            Ok(p) => Some((Pre::V1(p), "0.1.0")),
            Err(e) => {
                why.push(("0.1.0", format!("{e:#}")));
                None
            }
        });
        let Some((pre, contract)) = pre else {
            // The declared version's mismatch says most; without one, all.
            let why = match why.iter().find(|(v, _)| declared.contract.as_deref() == Some(*v)) {
                Some((_, e)) => e.clone(),
                None => why.iter().map(|(v, e)| format!("@{v}: {e}")).collect::<Vec<_>>().join("; "),
            };
            return Err(PolicyError::Load(format!(
                "{contract_named}: its exports do not match a contract this host implements (0.1.0, 0.2.0, 0.3.0, 0.4.0): {why}"
            )));
        };
        let mut loaded =
            LoadedPolicy { pre, contract, hash, info: PolicyInfo { name: String::new(), version: String::new(), hooks: Hooks::NONE } };
        let mut probe = Instance::new(engine, &loaded, Limits::default(), "loading")?;
        let info = probe.call(engine, |b, s| each_version!(b, b, c => c::info(b.berth_policy_policy().call_info(s)?)))?;
        check_info(&info)?;
        loaded.info = info;
        Ok(Arc::new(loaded))
    }

    pub fn from_file(engine: &PolicyEngine, path: &Path) -> Result<Arc<LoadedPolicy>, PolicyError> {
        let bytes = std::fs::read(path).map_err(|e| PolicyError::Load(format!("{}: {e}", path.display())))?;
        Self::from_bytes(engine, &bytes)
    }
}

/// A policy's name and version reach every decision record, log line and
/// listing: bounded, and from a small alphabet, so none can carry escapes.
pub fn check_info(info: &PolicyInfo) -> Result<(), PolicyError> {
    let shown = |s: &str| crate::text::printable(s, 80).into_owned();
    if info.name.len() > MAX_NAME_BYTES {
        return Err(PolicyError::Load(format!(
            "policy name of {} bytes (\"{}\"): at most {MAX_NAME_BYTES}",
            info.name.len(),
            shown(&info.name)
        )));
    }
    if info.name.is_empty() || !info.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
        return Err(PolicyError::Load(format!("policy name \"{}\" is not lowercase-with-dashes", shown(&info.name))));
    }
    if info.version.len() > MAX_VERSION_BYTES {
        return Err(PolicyError::Load(format!(
            "policy version of {} bytes (\"{}\"): at most {MAX_VERSION_BYTES}",
            info.version.len(),
            shown(&info.version)
        )));
    }
    if !is_semver(&info.version) {
        return Err(PolicyError::Load(format!("policy version \"{}\" is not semver (x.y.z)", shown(&info.version))));
    }
    Ok(())
}

/// `x.y.z`, optionally with a pre-release and build of `[0-9A-Za-z.-]`.
fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
        && v[core.len()..].chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+'))
}

/// A guest's error text, bounded and printable before it goes anywhere.
fn guest_error(msg: String) -> PolicyError {
    PolicyError::Guest(crate::text::bounded(msg, MAX_ERROR_BYTES))
}

/// A live instance and its store. Dropped after any trap: a trapped instance
/// must not be re-entered.
struct Instance {
    store: Store<GuestState>,
    bindings: Bindings,
    limits: Limits,
}

impl Instance {
    fn new(engine: &PolicyEngine, loaded: &LoadedPolicy, limits: Limits, label: &str) -> Result<Instance, PolicyError> {
        let state = GuestState::new(label.to_string(), limits.memory_bytes, limits.log_lines_per_call);
        let mut store = Store::new(&engine.engine, state);
        store.limiter(|s| s);
        store.set_epoch_deadline(deadline_ticks(&limits));
        match limits.clock {
            DeadlineClock::Wall => store.epoch_deadline_trap(),
            DeadlineClock::ThreadCpu => {
                // At each wall-clock deadline, charge only the CPU time the
                // call used, and give it the rest of its budget.
                let budget = limits.deadline;
                store.epoch_deadline_callback(move |ctx| {
                    let used = thread_cpu_time().saturating_sub(ctx.data().call_cpu_start);
                    Ok(match budget.checked_sub(used) {
                        Some(left) if left >= TICK => wasmtime::UpdateDeadline::Continue((left.as_nanos() / TICK.as_nanos()) as u64),
                        _ => wasmtime::UpdateDeadline::Interrupt,
                    })
                });
            }
        }
        store.data_mut().call_cpu_start = thread_cpu_time();
        let bindings = match &loaded.pre {
            Pre::V1(pre) => pre.instantiate(&mut store).map(Bindings::V1),
            Pre::V2(pre) => pre.instantiate(&mut store).map(Bindings::V2),
            Pre::V3(pre) => pre.instantiate(&mut store).map(Bindings::V3),
            Pre::V4(pre) => pre.instantiate(&mut store).map(Bindings::V4),
        }
        .map_err(|e| classify(e, &store, &limits))?;
        Ok(Instance { store, bindings, limits })
    }

    /// Runs one export call under the deadline and log budget, mapping every
    /// wasmtime failure onto [`PolicyError`].
    fn call<R>(
        &mut self,
        _engine: &PolicyEngine,
        f: impl FnOnce(&Bindings, &mut Store<GuestState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyError> {
        self.store.set_epoch_deadline(deadline_ticks(&self.limits));
        self.store.data_mut().log_budget = self.limits.log_lines_per_call;
        self.store.data_mut().call_cpu_start = thread_cpu_time();
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
    // A trap's text can quote the guest (a custom error, a name section).
    PolicyError::Trap(crate::text::bounded(format!("{e:#}"), MAX_ERROR_BYTES))
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

    /// Bytes the live instance holds in all its memories and tables (0
    /// before the first call or after a trap).
    pub fn memory_bytes(&self) -> u64 {
        self.instance.as_ref().map_or(0, |i| i.store.data().memory_used)
    }

    /// Instantiates now (so the first decision does not pay for it).
    /// The component this instance runs (its name, version and hooks).
    pub fn loaded(&self) -> &Arc<LoadedPolicy> {
        &self.loaded
    }

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
                inst.call(&self.engine, |b, s| each_version!(b, b, _c => b.berth_policy_policy().call_configure(s, &config)))?
                    .map_err(guest_error)?;
            }
            self.instance = Some(inst);
        }
        Ok(self.instance.as_mut().expect("just set"))
    }

    /// Runs one call; any trap, timeout or OOM discards the instance so the
    /// next call starts clean.
    fn call<R>(
        &mut self,
        f: impl FnOnce(&Bindings, &mut Store<GuestState>) -> wasmtime::Result<R>,
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
        match self.call(|b, s| each_version!(b, b, _c => b.berth_policy_policy().call_configure(s, &owned)))? {
            Ok(()) => {
                self.config = owned;
                Ok(())
            }
            Err(msg) => {
                // The guest may have half-applied it; restart from the old one.
                self.instance = None;
                Err(guest_error(msg))
            }
        }
    }

    /// Placement scoring, unchecked: the core validates the answer.
    pub fn score_raw(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.require(Hooks::SCORE, "score")?;
        let result = self.call(|b, s| {
            each_version!(b, b, c => {
                let t = c::task(task);
                let mut n = c::take_nodes(nodes);
                let r = b.berth_policy_policy().call_score(s, &t, &n);
                c::restore_nodes(nodes, &mut n);
                r.map(|answer| answer.map(|x| Scores { scores: x.scores, gpus: x.gpus }))
            })
        });
        result?.map_err(guest_error)
    }

    /// Compaction planning, unchecked: the host validates every move.
    pub fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError> {
        self.require(Hooks::COMPACT, "compact")?;
        let result = self.call(|b, s| {
            each_version!(b, b, c => {
                let mut snap = c::take_snapshot(snapshot);
                let r = b.berth_policy_policy().call_compact(s, &snap);
                c::restore_snapshot(snapshot, &mut snap);
                r.map(|answer| {
                    answer.map(|p| Plan { chain: p.chain, allocation: p.allocation, dest_node: p.dest_node, dest_gpus: p.dest_gpus })
                })
            })
        });
        result?.map_err(guest_error)
    }

    /// Preemption ranking, checked: every index in range and at most once.
    pub fn rank(&mut self, demand: &Task, victims: &mut Allocations) -> Result<Vec<u32>, PolicyError> {
        self.require(Hooks::RANK, "rank")?;
        let result = self.call(|b, s| {
            each_version!(b, b, c => {
                let t = c::task(demand);
                let mut v = c::take_allocations(victims);
                let r = b.berth_policy_policy().call_rank(s, &t, &v);
                c::restore_allocations(victims, &mut v);
                r
            })
        });
        let order = result?.map_err(guest_error)?;
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

impl WasmPolicy {
    /// Switch-domain scores for a gang (contract 0.2.0), checked: one finite
    /// score per domain. `Ok(None)` when the policy does not claim the hook.
    pub fn score_domains_raw(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        if !self.loaded.info.hooks.contains(Hooks::DOMAINS) {
            return Ok(None);
        }
        let result = self.call(|b, s| match b {
            Bindings::V1(_) => Ok(Err("contract 0.1.0 has no score-domains".to_string())),
            Bindings::V2(b) => {
                let t = conv_v2::task(task);
                let mut d = conv_v2::take_domains(domains);
                let r = b.berth_policy_policy().call_score_domains(s, &t, &d);
                conv_v2::restore_domains(domains, &mut d);
                r
            }
            Bindings::V3(b) => {
                let t = conv_v3::task(task);
                let mut d = conv_v3::take_domains(domains);
                let r = b.berth_policy_policy().call_score_domains(s, &t, &d);
                conv_v3::restore_domains(domains, &mut d);
                r
            }
            Bindings::V4(b) => {
                let t = conv_v4::task(task);
                let mut d = conv_v4::take_domains(domains);
                let r = b.berth_policy_policy().call_score_domains(s, &t, &d);
                conv_v4::restore_domains(domains, &mut d);
                r
            }
        });
        let scores = result?.map_err(guest_error)?;
        if scores.len() != domains.len() {
            return Err(PolicyError::InvalidOutput(format!("{} domain scores for {} domains", scores.len(), domains.len())));
        }
        if let Some(i) = scores.iter().position(|x| !x.is_finite()) {
            return Err(PolicyError::InvalidOutput(format!("score of domain {} is {}", domains.ids[i], scores[i])));
        }
        Ok(Some(scores))
    }
}

impl berth_core::PlacementPolicy for WasmPolicy {
    fn describe(&self) -> String {
        format!("{}@{} (wasm)", self.loaded.info.name, self.loaded.info.version)
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.score_raw(task, nodes)
    }
    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        self.score_domains_raw(task, domains)
    }
}

impl berth_core::compaction::CompactionPolicy for WasmPolicy {
    fn describe(&self) -> String {
        format!("{}@{} (wasm)", self.loaded.info.name, self.loaded.info.version)
    }
    fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError> {
        WasmPolicy::compact(self, snapshot)
    }
}

// The columns move into the binding's records for a call and back after:
// lowering copies them into guest memory once, and nothing else copies them.
// One macro, expanded per contract version (their Rust types differ); the
// columns a later version added are named after its path.
macro_rules! columns {
    ($w:path $(, task: $task_class:ident, nodes: [$($nx:ident),*], allocations: [$($ax:ident),*])?) => {
        use berth_sdk::{Allocations, Hooks, Nodes, PolicyInfo, Snapshot, Task};
        use std::mem::take;
        use $w as w;

        pub fn info(i: w::PolicyInfo) -> wasmtime::Result<PolicyInfo> {
            let hooks = [(w::Hooks::SCORE, Hooks::SCORE), (w::Hooks::COMPACT, Hooks::COMPACT), (w::Hooks::RANK, Hooks::RANK)]
                .into_iter()
                .filter(|(wit, _)| i.hooks.contains(*wit))
                .fold(Hooks::NONE, |acc, (_, ours)| acc | ours);
            Ok(PolicyInfo { name: i.name, version: i.version, hooks: hooks | extra_hooks(&i.hooks) })
        }

        pub fn task(t: &Task) -> w::Task {
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
                $(class: $task_class(t.class),)?
            }
        }

        pub fn take_nodes(n: &mut Nodes) -> w::Nodes {
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
                $($($nx: take(&mut n.$nx),)*)?
            }
        }

        pub fn restore_nodes(n: &mut Nodes, w: &mut w::Nodes) {
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
            $($(n.$nx = take(&mut w.$nx);)*)?
        }

        pub fn take_allocations(a: &mut Allocations) -> w::Allocations {
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
                $($($ax: take(&mut a.$ax),)*)?
            }
        }

        pub fn restore_allocations(a: &mut Allocations, w: &mut w::Allocations) {
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
            $($(a.$ax = take(&mut w.$ax);)*)?
        }

        pub fn take_snapshot(s: &mut Snapshot) -> w::Snapshot {
            w::Snapshot {
                nodes: take_nodes(&mut s.nodes),
                allocations: take_allocations(&mut s.allocations),
                pending: w::Pending {
                    gpu_count: take(&mut s.pending.gpu_count),
                    gpu_milli: take(&mut s.pending.gpu_milli),
                    whole_nodes: take(&mut s.pending.whole_nodes),
                    model: take(&mut s.pending.model),
                },
            }
        }

        pub fn restore_snapshot(s: &mut Snapshot, w: &mut w::Snapshot) {
            restore_nodes(&mut s.nodes, &mut w.nodes);
            restore_allocations(&mut s.allocations, &mut w.allocations);
            s.pending.gpu_count = take(&mut w.pending.gpu_count);
            s.pending.gpu_milli = take(&mut w.pending.gpu_milli);
            s.pending.whole_nodes = take(&mut w.pending.whole_nodes);
            s.pending.model = take(&mut w.pending.model);
        }
    };
}

/// The pool records and the hook flags (contract 0.3.0 and later: domains
/// and the two pool hooks beside the first three), for a version module
/// that has already `use`d its types as `w`.
macro_rules! pool_columns {
    () => {
        fn extra_hooks(h: &w::Hooks) -> Hooks {
            [(w::Hooks::DOMAINS, Hooks::DOMAINS), (w::Hooks::POOL_PLACE, Hooks::POOL_PLACE), (w::Hooks::POOL_STEP, Hooks::POOL_STEP)]
                .into_iter()
                .filter(|(wit, _)| h.contains(*wit))
                .fold(Hooks::NONE, |acc, (_, ours)| acc | ours)
        }

        pub fn pool_state(s: &berth_sdk::PoolState) -> w::PoolState {
            let s = s.clone();
            w::PoolState {
                now_ms: s.now_ms,
                model_tp: s.model_tp,
                model_weight_bytes: s.model_weight_bytes,
                model_kv_bytes_per_token: s.model_kv_bytes_per_token,
                model_arrived: s.model_arrived,
                model_rate: s.model_rate,
                model_peak_rate: s.model_peak_rate,
                model_queued: s.model_queued,
                model_service_s: s.model_service_s,
                executor_tp: s.executor_tp,
                executor_memory_bytes: s.executor_memory_bytes,
                executor_load: s.executor_load,
                assigned_executor: s.assigned_executor,
                assigned_model: s.assigned_model,
                assigned_pinned: s.assigned_pinned,
                assigned_load: s.assigned_load,
                assigned_idle_ms: s.assigned_idle_ms,
            }
        }

        pub fn pool_executor(x: &berth_sdk::PoolExecutor) -> w::PoolExecutor {
            let x = x.clone();
            w::PoolExecutor {
                now_ms: x.now_ms,
                executor: x.executor,
                memory_bytes: x.memory_bytes,
                used_bytes: x.used_bytes,
                tbt_target_ms: x.tbt_target_ms,
                model: x.model,
                resident: x.resident,
                pinned: x.pinned,
                weight_bytes: x.weight_bytes,
                load_s: x.load_s,
                waiting: x.waiting,
                waiting_tokens: x.waiting_tokens,
                oldest_wait_ms: x.oldest_wait_ms,
                decoding: x.decoding,
                decode_slack_ms: x.decode_slack_ms,
                decode_iteration_s: x.decode_iteration_s,
                idle_ms: x.idle_ms,
            }
        }

        pub fn pool_step(st: w::PoolChoice) -> berth_sdk::PoolStep {
            let phase = match st.phase {
                w::PoolPhase::Idle => berth_sdk::PoolPhase::Idle,
                w::PoolPhase::Prefill => berth_sdk::PoolPhase::Prefill,
                w::PoolPhase::Decode => berth_sdk::PoolPhase::Decode,
            };
            berth_sdk::PoolStep { phase, row: st.row, iterations: st.iterations, evict: st.evict }
        }
    };
}

mod conv_v1 {
    columns!(super::v1::berth::policy::types);

    fn extra_hooks(_: &w::Hooks) -> Hooks {
        Hooks::NONE
    }
}

/// The `domains` columns (contract 0.2.0 and later), moved across without
/// copying, for a version module that has already `use`d its types as `w`.
macro_rules! domain_columns {
    () => {
        pub fn take_domains(d: &mut berth_sdk::Domains) -> w::Domains {
            w::Domains {
                ids: take(&mut d.ids),
                aggregation: take(&mut d.aggregation),
                nodes: take(&mut d.nodes),
                idle_nodes: take(&mut d.idle_nodes),
                gpus_total: take(&mut d.gpus_total),
                gpus_idle: take(&mut d.gpus_idle),
                fitting_tasks: take(&mut d.fitting_tasks),
            }
        }

        pub fn restore_domains(d: &mut berth_sdk::Domains, w: &mut w::Domains) {
            d.ids = take(&mut w.ids);
            d.aggregation = take(&mut w.aggregation);
            d.nodes = take(&mut w.nodes);
            d.idle_nodes = take(&mut w.idle_nodes);
            d.gpus_total = take(&mut w.gpus_total);
            d.gpus_idle = take(&mut w.gpus_idle);
            d.fitting_tasks = take(&mut w.fitting_tasks);
        }
    };
}

mod conv_v2 {
    columns!(super::v2::berth::policy::types);

    fn extra_hooks(h: &w::Hooks) -> Hooks {
        if h.contains(w::Hooks::DOMAINS) { Hooks::DOMAINS } else { Hooks::NONE }
    }

    domain_columns!();
}

mod conv_v3 {
    columns!(super::v3::berth::policy::types);

    domain_columns!();

    pool_columns!();
}

mod conv_v4 {
    columns!(super::v4::berth::policy::types,
        task: task_class,
        nodes: [gpu_tasks, cpu_only_milli, cpu_used_milli, cpu_pressure, memory_pressure, io_pressure],
        allocations: [class, tier, interruptions_left]);

    fn task_class(c: berth_sdk::TaskClass) -> w::TaskClass {
        match c {
            berth_sdk::TaskClass::Training => w::TaskClass::Training,
            berth_sdk::TaskClass::Inference => w::TaskClass::Inference,
            berth_sdk::TaskClass::CpuOnly => w::TaskClass::CpuOnly,
        }
    }

    domain_columns!();

    pool_columns!();
}


impl berth_core::preemption::PreemptionPolicy for WasmPolicy {
    fn describe(&self) -> String {
        format!("{}@{} (wasm)", self.loaded.info.name, self.loaded.info.version)
    }
    /// A policy without the `rank` hook has no opinion: the host's default
    /// order applies.
    fn rank(&mut self, demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        if !self.loaded.info.hooks.contains(Hooks::RANK) {
            return Ok(None);
        }
        WasmPolicy::rank(self, demand, victims).map(Some)
    }
}

/// Model pools (contract 0.3.0). Components of 0.1.0 and 0.2.0 have no pool
/// hooks and are refused with a clear error; a 0.3.0 component that does
/// not claim a hook gets the host's default for it. The core validates
/// every answer.
impl berth_core::pool::PoolPolicy for WasmPolicy {
    fn describe(&self) -> String {
        format!("{}@{} (wasm)", self.loaded.info.name, self.loaded.info.version)
    }

    fn pool_place(&mut self, state: &PoolState) -> Result<Option<PoolPlacement>, PolicyError> {
        self.require_pool_contract()?;
        if !self.loaded.info.hooks.contains(Hooks::POOL_PLACE) {
            return Ok(None);
        }
        let result = self.call(|b, s| match b {
            Bindings::V3(b) => b
                .berth_policy_policy()
                .call_pool_place(s, &conv_v3::pool_state(state))
                .map(|r| r.map(|p| PoolPlacement { executor: p.executor, model: p.model, weight: p.weight, pinned: p.pinned })),
            Bindings::V4(b) => b
                .berth_policy_policy()
                .call_pool_place(s, &conv_v4::pool_state(state))
                .map(|r| r.map(|p| PoolPlacement { executor: p.executor, model: p.model, weight: p.weight, pinned: p.pinned })),
            _ => Ok(Err("no pool hooks".to_string())),
        });
        result?.map(Some).map_err(guest_error)
    }

    fn pool_step(&mut self, executor: &PoolExecutor) -> Result<Option<PoolStep>, PolicyError> {
        self.require_pool_contract()?;
        if !self.loaded.info.hooks.contains(Hooks::POOL_STEP) {
            return Ok(None);
        }
        let result = self.call(|b, s| match b {
            Bindings::V3(b) => b.berth_policy_policy().call_pool_step(s, &conv_v3::pool_executor(executor)).map(|r| r.map(conv_v3::pool_step)),
            Bindings::V4(b) => b.berth_policy_policy().call_pool_step(s, &conv_v4::pool_executor(executor)).map(|r| r.map(conv_v4::pool_step)),
            _ => Ok(Err("no pool hooks".to_string())),
        });
        result?.map(Some).map_err(guest_error)
    }
}

impl WasmPolicy {
    /// Contract 0.3.0 or later: the only ones with pool hooks.
    fn require_pool_contract(&self) -> Result<(), PolicyError> {
        match self.loaded.contract {
            "0.1.0" => Err(PolicyError::Unsupported("pool (contract 0.3.0; this component is 0.1.0)")),
            "0.2.0" => Err(PolicyError::Unsupported("pool (contract 0.3.0; this component is 0.2.0)")),
            _ => Ok(()),
        }
    }

    /// Whether the component claims either pool hook.
    pub fn has_pool_hooks(&self) -> bool {
        self.loaded.info.hooks.contains(Hooks::POOL_PLACE) || self.loaded.info.hooks.contains(Hooks::POOL_STEP)
    }
}
