//! Plain Rust mirrors of the contract's records. Field meanings are those of
//! `wit/v0.1.0/policy.wit`; the columns move in and out of the bindings
//! without copying.

/// Hooks a policy implements (a bit set, as the WIT `flags hooks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hooks(u8);

impl Hooks {
    pub const NONE: Hooks = Hooks(0);
    pub const SCORE: Hooks = Hooks(1);
    pub const COMPACT: Hooks = Hooks(2);
    pub const RANK: Hooks = Hooks(4);
    /// Switch-domain scoring for gangs (contract 0.2.0).
    pub const DOMAINS: Hooks = Hooks(8);
    /// Model pools: assignment of models to executors (contract 0.3.0).
    pub const POOL_PLACE: Hooks = Hooks(16);
    /// Model pools: the next step of one executor (contract 0.3.0).
    pub const POOL_STEP: Hooks = Hooks(32);

    pub const fn union(self, other: Hooks) -> Hooks {
        Hooks(self.0 | other.0)
    }
    pub const fn contains(self, other: Hooks) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn bits(self) -> u8 {
        self.0
    }
    pub const fn from_bits_truncate(bits: u8) -> Hooks {
        Hooks(bits & 63)
    }
}

impl std::ops::BitOr for Hooks {
    type Output = Hooks;
    fn bitor(self, rhs: Hooks) -> Hooks {
        self.union(rhs)
    }
}

impl std::fmt::Display for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = [(Hooks::SCORE, "score"), (Hooks::COMPACT, "compact"), (Hooks::RANK, "rank"), (Hooks::DOMAINS, "domains"), (Hooks::POOL_PLACE, "pool-place"), (Hooks::POOL_STEP, "pool-step")]
            .into_iter()
            .filter(|(h, _)| self.contains(*h))
            .map(|(_, n)| n)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// What a policy says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: String,
    pub version: String,
    pub hooks: Hooks,
}

/// What kind of work a task is (see the WIT `task-class`, contract 0.4.0).
/// The discriminants are the numbers of `Allocations::class`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TaskClass {
    /// GPU work whose throughput is the point.
    #[default]
    Training = 0,
    /// GPU work serving requests.
    Inference = 1,
    /// No GPU.
    CpuOnly = 2,
}

impl TaskClass {
    /// Every class, in number order.
    pub const ALL: [TaskClass; 3] = [TaskClass::Training, TaskClass::Inference, TaskClass::CpuOnly];

    /// The class a job gets when it declares none: CPU-only without GPUs,
    /// training with them.
    pub fn implied(gpu_count: u32) -> TaskClass {
        if gpu_count == 0 { TaskClass::CpuOnly } else { TaskClass::Training }
    }
    /// The class of number `n` (an `Allocations::class` entry), if any.
    pub fn from_number(n: u8) -> Option<TaskClass> {
        TaskClass::ALL.get(usize::from(n)).copied()
    }
    /// The name used on the command line and in the API.
    pub fn name(self) -> &'static str {
        match self {
            TaskClass::Training => "training",
            TaskClass::Inference => "inference",
            TaskClass::CpuOnly => "cpu-only",
        }
    }
    /// The class named `name` (see [`TaskClass::name`]).
    pub fn from_name(name: &str) -> Option<TaskClass> {
        TaskClass::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// What a job was bought as (see the WIT `allocations.tier`, contract
/// 0.4.0). The discriminants are the numbers of `Allocations::tier`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// Never preempted by the scheduler, never placed on lent GPUs.
    Guaranteed = 0,
    /// Taken back with notice, at most a contract's interruptions a day.
    #[default]
    Preemptible = 1,
    /// Stopped without notice and without a daily cap; owed nothing.
    Opportunistic = 2,
}

impl Tier {
    /// Every tier, in number order.
    pub const ALL: [Tier; 3] = [Tier::Guaranteed, Tier::Preemptible, Tier::Opportunistic];

    /// The name used on the command line, in the API and the access file.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Guaranteed => "guaranteed",
            Tier::Preemptible => "preemptible",
            Tier::Opportunistic => "opportunistic",
        }
    }
    /// The tier named `name` (see [`Tier::name`]).
    pub fn from_name(name: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == name)
    }
    /// The tier of number `n` (an `Allocations::tier` entry), if any.
    pub fn from_number(n: u8) -> Option<Tier> {
        Tier::ALL.get(usize::from(n)).copied()
    }
}

/// One task to place (see the WIT `task`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Task {
    pub job_id: u64,
    pub gpu_count: u32,
    pub gpu_milli: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub models: Vec<u32>,
    pub priority: u32,
    pub gang_size: u32,
    pub gang_index: u32,
    /// Contract 0.4.0; older contracts do not send it.
    pub class: TaskClass,
}

impl Task {
    /// Whether the task accepts GPU model `model` (an index into `Nodes::models`).
    pub fn accepts_model(&self, model: u32) -> bool {
        self.models.is_empty() || self.models.contains(&model)
    }
    /// Total milli-GPU the task asks for.
    pub fn total_gpu_milli(&self) -> u64 {
        u64::from(self.gpu_count) * u64::from(self.gpu_milli)
    }
}

/// A batch of nodes, as columns (see the WIT `nodes`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Nodes {
    pub ids: Vec<u32>,
    pub model: Vec<u32>,
    pub models: Vec<String>,
    pub switch_domain: Vec<u32>,
    pub cpu_free_milli: Vec<u32>,
    pub cpu_total_milli: Vec<u32>,
    pub memory_free_mib: Vec<u64>,
    pub memory_total_mib: Vec<u64>,
    pub gpu_count: Vec<u32>,
    pub gpu_start: Vec<u32>,
    pub gpu_free_milli: Vec<u32>,
    pub alloc_kinds: Vec<u64>,
    /// Contention columns (contract 0.4.0; see [`Contention`]).
    pub gpu_tasks: Vec<u32>,
    pub cpu_only_milli: Vec<u32>,
    pub cpu_used_milli: Vec<u32>,
    pub cpu_pressure: Vec<u32>,
    pub memory_pressure: Vec<u32>,
    pub io_pressure: Vec<u32>,
}

/// What a node's neighbours do to each other (see the WIT `nodes`,
/// contract 0.4.0): one node's entries of the contention columns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Contention {
    /// GPU tasks running on the node.
    pub gpu_tasks: u32,
    /// CPU held by CPU-only tasks, in thousandths of a core.
    pub cpu_only_milli: u32,
    /// CPU the tasks used (measured), or allocated where unmeasured.
    pub cpu_used_milli: u32,
    /// PSI `some avg10` of CPU, memory and IO, in thousandths.
    pub cpu_pressure: u32,
    pub memory_pressure: u32,
    pub io_pressure: u32,
}

/// One node of a [`Nodes`] batch, read through the columns.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    /// Position in the batch (the index of its score).
    pub index: usize,
    pub id: u32,
    pub model: u32,
    pub switch_domain: u32,
    pub cpu_free_milli: u32,
    pub cpu_total_milli: u32,
    pub memory_free_mib: u64,
    pub memory_total_mib: u64,
    /// Free thousandths of each GPU of the node.
    pub gpu_free_milli: &'a [u32],
    /// Kinds of GPU allocation on the node (see the WIT `alloc-kinds`).
    pub alloc_kinds: u64,
    /// What its neighbours do to each other (contract 0.4.0; zero from a
    /// host of an older contract).
    pub contention: Contention,
}

/// The allocation-kind bit of a GPU allocation: 0 for a shared GPU, `k` for
/// `k` whole GPUs; `None` for CPU-only work.
pub fn alloc_kind_bit(gpu_count: u32, gpu_milli: u32) -> Option<u32> {
    match (gpu_count, gpu_milli) {
        (0, _) => None,
        (_, m) if m < 1000 => Some(0),
        (k, _) => Some(k.min(63)),
    }
}

impl NodeView<'_> {
    pub fn gpu_count(&self) -> u32 {
        self.gpu_free_milli.len() as u32
    }
    /// Free milli-GPU summed over the node's GPUs.
    pub fn gpu_free_total(&self) -> u32 {
        self.gpu_free_milli.iter().sum()
    }
    /// Idle (fully free) GPUs.
    pub fn idle_gpus(&self) -> u32 {
        self.gpu_free_milli.iter().filter(|&&f| f == 1000).count() as u32
    }
}

impl Nodes {
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    /// The node at position `index`.
    pub fn get(&self, index: usize) -> NodeView<'_> {
        let start = self.gpu_start[index] as usize;
        let count = self.gpu_count[index] as usize;
        NodeView {
            index,
            id: self.ids[index],
            model: self.model[index],
            switch_domain: self.switch_domain[index],
            cpu_free_milli: self.cpu_free_milli[index],
            cpu_total_milli: self.cpu_total_milli[index],
            memory_free_mib: self.memory_free_mib[index],
            memory_total_mib: self.memory_total_mib[index],
            gpu_free_milli: &self.gpu_free_milli[start..start + count],
            alloc_kinds: self.alloc_kinds[index],
            contention: Contention {
                gpu_tasks: self.gpu_tasks.get(index).copied().unwrap_or(0),
                cpu_only_milli: self.cpu_only_milli.get(index).copied().unwrap_or(0),
                cpu_used_milli: self.cpu_used_milli.get(index).copied().unwrap_or(0),
                cpu_pressure: self.cpu_pressure.get(index).copied().unwrap_or(0),
                memory_pressure: self.memory_pressure.get(index).copied().unwrap_or(0),
                io_pressure: self.io_pressure.get(index).copied().unwrap_or(0),
            },
        }
    }
    /// Iterates the nodes as typed views, in batch order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = NodeView<'_>> + '_ {
        (0..self.len()).map(move |i| self.get(i))
    }
    /// Empties every column, keeping capacity (hosts reuse one batch).
    pub fn clear(&mut self) {
        self.ids.clear();
        self.model.clear();
        self.switch_domain.clear();
        self.cpu_free_milli.clear();
        self.cpu_total_milli.clear();
        self.memory_free_mib.clear();
        self.memory_total_mib.clear();
        self.gpu_count.clear();
        self.gpu_start.clear();
        self.gpu_free_milli.clear();
        self.alloc_kinds.clear();
        self.gpu_tasks.clear();
        self.cpu_only_milli.clear();
        self.cpu_used_milli.clear();
        self.cpu_pressure.clear();
        self.memory_pressure.clear();
        self.io_pressure.clear();
    }
    /// Appends one node (a convenience for hosts and tests) with no
    /// contention; [`Nodes::set_contention`] gives it some.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        id: u32,
        model: u32,
        switch_domain: u32,
        cpu_free_milli: u32,
        cpu_total_milli: u32,
        memory_free_mib: u64,
        memory_total_mib: u64,
        gpu_free_milli: &[u32],
        alloc_kinds: u64,
    ) {
        self.ids.push(id);
        self.model.push(model);
        self.switch_domain.push(switch_domain);
        self.cpu_free_milli.push(cpu_free_milli);
        self.cpu_total_milli.push(cpu_total_milli);
        self.memory_free_mib.push(memory_free_mib);
        self.memory_total_mib.push(memory_total_mib);
        self.gpu_count.push(gpu_free_milli.len() as u32);
        self.gpu_start.push(self.gpu_free_milli.len() as u32);
        self.gpu_free_milli.extend_from_slice(gpu_free_milli);
        self.alloc_kinds.push(alloc_kinds);
        self.gpu_tasks.push(0);
        self.cpu_only_milli.push(0);
        self.cpu_used_milli.push(0);
        self.cpu_pressure.push(0);
        self.memory_pressure.push(0);
        self.io_pressure.push(0);
    }

    /// Sets the contention columns of the node at position `index`.
    pub fn set_contention(&mut self, index: usize, c: Contention) {
        self.gpu_tasks[index] = c.gpu_tasks;
        self.cpu_only_milli[index] = c.cpu_only_milli;
        self.cpu_used_milli[index] = c.cpu_used_milli;
        self.cpu_pressure[index] = c.cpu_pressure;
        self.memory_pressure[index] = c.memory_pressure;
        self.io_pressure[index] = c.io_pressure;
    }
}

/// What `score` returns (see the WIT `scores`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scores {
    pub scores: Vec<f64>,
    pub gpus: Vec<u64>,
}

impl Scores {
    /// Scores only; the host chooses GPUs on every node.
    pub fn from_scores(scores: Vec<f64>) -> Scores {
        Scores { scores, gpus: Vec::new() }
    }
}

/// Running allocations, as columns (see the WIT `allocations`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocations {
    pub ids: Vec<u32>,
    pub job_ids: Vec<u64>,
    pub node: Vec<u32>,
    pub gpus: Vec<u64>,
    pub gpu_milli: Vec<u32>,
    pub cpu_milli: Vec<u32>,
    pub memory_mib: Vec<u64>,
    pub priority: Vec<u32>,
    pub movable: Vec<u8>,
    pub gang_id: Vec<u64>,
    pub state_bytes: Vec<u64>,
    pub remaining_s: Vec<u64>,
    pub running_s: Vec<u64>,
    pub since_checkpoint_s: Vec<u64>,
    /// [`TaskClass`] numbers (contract 0.4.0).
    pub class: Vec<u8>,
    /// [`Tier`] numbers of each allocation's job (contract 0.4.0).
    pub tier: Vec<u8>,
    /// Interruptions its job's contract still allows in the last 24 hours
    /// (`u32::MAX`: no cap, or not known; contract 0.4.0).
    pub interruptions_left: Vec<u32>,
}

/// One allocation's entries of [`Allocations`] (see the WIT `allocations`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocationRow {
    pub id: u32,
    pub job_id: u64,
    pub node: u32,
    pub gpus: u64,
    pub gpu_milli: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub priority: u32,
    pub movable: bool,
    pub gang_id: u64,
    pub state_bytes: u64,
    pub remaining_s: u64,
    pub running_s: u64,
    pub since_checkpoint_s: u64,
    pub class: TaskClass,
    pub tier: Tier,
    pub interruptions_left: u32,
}

impl Allocations {
    /// Appends one allocation to every column.
    pub fn push(&mut self, r: AllocationRow) {
        self.ids.push(r.id);
        self.job_ids.push(r.job_id);
        self.node.push(r.node);
        self.gpus.push(r.gpus);
        self.gpu_milli.push(r.gpu_milli);
        self.cpu_milli.push(r.cpu_milli);
        self.memory_mib.push(r.memory_mib);
        self.priority.push(r.priority);
        self.movable.push(u8::from(r.movable));
        self.gang_id.push(r.gang_id);
        self.state_bytes.push(r.state_bytes);
        self.remaining_s.push(r.remaining_s);
        self.running_s.push(r.running_s);
        self.since_checkpoint_s.push(r.since_checkpoint_s);
        self.class.push(r.class as u8);
        self.tier.push(r.tier as u8);
        self.interruptions_left.push(r.interruptions_left);
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Switch domains a gang could use, as columns (see the WIT `domains`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Domains {
    pub ids: Vec<u32>,
    pub aggregation: Vec<u32>,
    pub nodes: Vec<u32>,
    pub idle_nodes: Vec<u32>,
    pub gpus_total: Vec<u32>,
    pub gpus_idle: Vec<u32>,
    pub fitting_tasks: Vec<u32>,
}

impl Domains {
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Pending shapes compaction should make room for (see the WIT `pending`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    pub gpu_count: Vec<u32>,
    pub gpu_milli: Vec<u32>,
    pub whole_nodes: Vec<u32>,
    pub model: Vec<u32>,
}

/// A partition as compaction sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub nodes: Nodes,
    pub allocations: Allocations,
    pub pending: Pending,
}

/// A compaction plan, as columns (see the WIT `plan`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub chain: Vec<u32>,
    pub allocation: Vec<u32>,
    pub dest_node: Vec<u32>,
    pub dest_gpus: Vec<u64>,
}

/// A model pool as `pool-place` sees it (see the WIT `pool-state`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolState {
    pub now_ms: u64,
    pub model_tp: Vec<u32>,
    pub model_weight_bytes: Vec<u64>,
    pub model_kv_bytes_per_token: Vec<u64>,
    pub model_arrived: Vec<u64>,
    pub model_rate: Vec<f64>,
    pub model_peak_rate: Vec<f64>,
    pub model_queued: Vec<u32>,
    pub model_service_s: Vec<f64>,
    pub executor_tp: Vec<u32>,
    pub executor_memory_bytes: Vec<u64>,
    pub executor_load: Vec<u32>,
    pub assigned_executor: Vec<u32>,
    pub assigned_model: Vec<u32>,
    pub assigned_pinned: Vec<u8>,
    pub assigned_load: Vec<u32>,
    pub assigned_idle_ms: Vec<u64>,
}

impl PoolState {
    pub fn models(&self) -> usize {
        self.model_tp.len()
    }
    pub fn executors(&self) -> usize {
        self.executor_tp.len()
    }
}

/// What `pool-place` returns: the complete assignment, as pairs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolPlacement {
    pub executor: Vec<u32>,
    pub model: Vec<u32>,
    pub weight: Vec<u32>,
    pub pinned: Vec<u8>,
}

impl PoolPlacement {
    pub fn push(&mut self, executor: u32, model: u32, weight: u32, pinned: bool) {
        self.executor.push(executor);
        self.model.push(model);
        self.weight.push(weight);
        self.pinned.push(u8::from(pinned));
    }
    pub fn len(&self) -> usize {
        self.executor.len()
    }
    pub fn is_empty(&self) -> bool {
        self.executor.is_empty()
    }
}

/// One scheduling step of one executor (see the WIT `pool-executor`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolExecutor {
    pub now_ms: u64,
    pub executor: u32,
    pub memory_bytes: u64,
    pub used_bytes: u64,
    pub tbt_target_ms: u64,
    pub model: Vec<u32>,
    pub resident: Vec<u8>,
    pub pinned: Vec<u8>,
    pub weight_bytes: Vec<u64>,
    pub load_s: Vec<f64>,
    pub waiting: Vec<u32>,
    pub waiting_tokens: Vec<u64>,
    pub oldest_wait_ms: Vec<u64>,
    pub decoding: Vec<u32>,
    pub decode_slack_ms: Vec<i64>,
    pub decode_iteration_s: Vec<f64>,
    pub idle_ms: Vec<u64>,
}

impl PoolExecutor {
    pub fn len(&self) -> usize {
        self.model.len()
    }
    pub fn is_empty(&self) -> bool {
        self.model.is_empty()
    }
    pub fn clear(&mut self) {
        let now_ms = self.now_ms;
        *self = PoolExecutor { now_ms, ..Default::default() };
    }
}

/// The phase of a pool step (see the WIT `pool-phase`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolPhase {
    #[default]
    Idle,
    Prefill,
    Decode,
}

/// What `pool-step` returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStep {
    pub phase: PoolPhase,
    pub row: u32,
    pub iterations: u32,
    pub evict: Vec<u32>,
}

impl PoolStep {
    pub fn idle() -> PoolStep {
        PoolStep::default()
    }
    pub fn prefill(row: usize) -> PoolStep {
        PoolStep { phase: PoolPhase::Prefill, row: row as u32, iterations: 0, evict: Vec::new() }
    }
    pub fn decode(row: usize, iterations: u32) -> PoolStep {
        PoolStep { phase: PoolPhase::Decode, row: row as u32, iterations, evict: Vec::new() }
    }
}
