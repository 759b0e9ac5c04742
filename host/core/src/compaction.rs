//! In-place compaction: the host side of the `compact` hook.
//!
//! A compaction policy (wasm, untrusted) sees one partition as a
//! [`berth_sdk::Snapshot`] and answers a [`berth_sdk::Plan`]: moves of running
//! allocations, grouped into chains, that free whole nodes. This module
//!
//! 1. builds the snapshot ([`snapshot`]): the partition's nodes, the running
//!    allocations on them with movability (pinned work and work moved less
//!    than `min_residence_s` ago is immovable), state bytes, remaining and
//!    running time, and the pending shapes that want whole nodes;
//! 2. validates the plan ([`validate`]): every move against capacity and
//!    constraints on the state as it will be after the earlier moves; one
//!    invalid move rejects the whole plan, with its reason;
//! 3. keeps only chains that pay back ([`select`]): the whole-node capacity
//!    a chain frees over the moved jobs' expected remaining lifetime must
//!    outweigh its migration cost by the configured margin;
//! 4. executes the rest make-before-break on the fleet ([`execute`]): the
//!    destination is allocated and started before the source is released; a
//!    destination that fails or is slower than the deadline is released
//!    again and the job stays where it was, so no GPU ever has two owners
//!    and no job is lost;
//! 5. records a migration [`Ledger`]: bytes moved per network tier, overlap,
//!    pause and warm-up time, whole nodes gained, pending gangs unblocked.
//!
//! [`step`] runs all of it for one partition, with hysteresis (compaction
//! turns on above `start_partial_pct` partially occupied nodes and off below
//! `stop_partial_pct`); [`step_jobs`] is the same for an event loop that
//! keeps jobs and their allocations as `sim.rs` does.
//!
//! # Cost model defaults (see [`CompactionConfig`])
//!
//! The defaults are engineering assumptions for a modern GPU fleet, not
//! measurements; every one is a config field:
//! - bandwidth per tier: 50 GB/s under one access switch (one 400 Gb/s RDMA
//!   NIC's line rate), 25 GB/s under one aggregation switch (2:1
//!   oversubscription, common in leaf-spine fabrics), 12.5 GB/s across
//!   aggregation switches (4:1);
//! - pre-copy migration: weights and state stream while the job keeps
//!   running on the source (the overlap, during which the destination's GPUs
//!   are held twice), then a pause of `switchover_s` (2 s: stop, final sync,
//!   redirect) plus re-copying the `dirty_fraction` (5%) of state written
//!   during the copy;
//! - warm-up of 30 s on the destination (CUDA context, NCCL communicators,
//!   graph capture) before it takes over;
//! - state bytes, when the workload does not say: 40 GiB per whole GPU held
//!   (half of an 80 GiB HBM: weights + KV cache or optimizer state), scaled
//!   by the share for a fractional GPU, plus the allocation's host memory;
//! - payback: freed whole-node GPU-seconds (over the shorter of the moved
//!   jobs' expected remaining time and 24 h), counted in full when a pending
//!   shape wants whole nodes of that model and at 25% otherwise, must exceed
//!   1.5x the migration cost (overlap GPU-seconds + paused GPU-seconds).
//!   Unknown remaining time counts as 1 h.

use std::collections::{BTreeMap, HashMap, HashSet};

use berth_sdk::{AllocationRow, Allocations, Nodes, Pending, Plan, Snapshot};
use serde::{Deserialize, Serialize};

use crate::fleet::{Allocation, Fleet, ModelId, Node, NodeId};
use crate::placement::{default_gpus, validate_mask};
use crate::policy::PolicyError;
use crate::capacity::tasks_on_node;
use crate::job::Job;
use crate::task::TaskShape;
use crate::units::MILLI_PER_GPU;

/// A policy that plans compaction (the WIT `compact` hook). The wasm host
/// and native builds implement it; tests use doubles.
pub trait CompactionPolicy {
    /// Name and version, for logs and the ledger.
    fn describe(&self) -> String;
    /// Plans moves over `snapshot`, unchecked (this module validates). The
    /// implementation may move the columns out while it works but must put
    /// them back before returning.
    fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError>;
}

impl<P: CompactionPolicy + ?Sized> CompactionPolicy for Box<P> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn compact(&mut self, snapshot: &mut Snapshot) -> Result<Plan, PolicyError> {
        (**self).compact(snapshot)
    }
}

/// Compaction settings. Every cost-model default is explained in the
/// module documentation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompactionConfig {
    /// How often the event loop runs a step, seconds.
    pub period_s: u64,
    /// An allocation moved less than this long ago is immovable.
    pub min_residence_s: u64,
    /// Hysteresis: compaction turns on when at least this % of the
    /// partition's GPU nodes are partially occupied...
    pub start_partial_pct: f64,
    /// ...and stays on until fewer than this % are.
    pub stop_partial_pct: f64,
    /// A chain runs only when its benefit exceeds its cost times this.
    pub payback_margin: f64,
    /// Weight of freed capacity no pending shape is waiting for.
    pub speculative_value: f64,
    /// Freed capacity counts for at most this long, seconds.
    pub benefit_horizon_s: u64,
    /// Remaining time assumed when the workload gives none, seconds.
    pub unknown_remaining_s: u64,
    /// Bytes per second: same access switch, same aggregation, across.
    pub bandwidth_bytes_per_s: [f64; 3],
    /// Share of state written again during the copy (copied in the pause).
    pub dirty_fraction: f64,
    /// Fixed pause to stop, sync and redirect, seconds.
    pub switchover_s: f64,
    /// Destination warm-up before it takes over, seconds.
    pub warmup_s: f64,
    /// A destination not ready this long after the start is rolled back.
    pub destination_deadline_s: f64,
    /// State bytes per whole GPU held when the workload does not say.
    pub default_state_bytes_per_gpu: u64,
    /// At most this many moves per step (the rest of a plan is dropped by
    /// whole chains).
    pub max_moves: usize,
    /// Pending shapes offered to the policy per partition, largest first.
    pub max_pending: usize,
    /// Live: after a move takes over, its task's rate (CPU used, from its
    /// cgroup) is watched this long, seconds, while the source's GPUs stay
    /// reserved; 0 turns verification off.
    pub verify_s: f64,
    /// A task running slower than its rate before the move by more than
    /// this share is moved back.
    pub verify_margin: f64,
    /// Tasks using less than this many cores before the move are not
    /// verified by CPU use (a mostly idle or GPU-bound task's CPU rate says
    /// little; one that reports progress is verified by that instead).
    pub verify_min_cores: f64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            period_s: 3600,
            min_residence_s: 4 * 3600,
            start_partial_pct: 5.0,
            stop_partial_pct: 2.5,
            payback_margin: 1.5,
            speculative_value: 0.25,
            benefit_horizon_s: 24 * 3600,
            unknown_remaining_s: 3600,
            bandwidth_bytes_per_s: [50e9, 25e9, 12.5e9],
            dirty_fraction: 0.05,
            switchover_s: 2.0,
            warmup_s: 30.0,
            destination_deadline_s: 600.0,
            default_state_bytes_per_gpu: 40 << 30,
            max_moves: 10_000,
            max_pending: 64,
            verify_s: 30.0,
            verify_margin: 0.2,
            verify_min_cores: 0.5,
        }
    }
}

impl CompactionConfig {
    /// Checks ranges; the error names the field.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=100.0).contains(&self.start_partial_pct) || !(0.0..=100.0).contains(&self.stop_partial_pct) {
            return Err("start_partial_pct and stop_partial_pct must lie in 0..=100".into());
        }
        if self.stop_partial_pct > self.start_partial_pct {
            return Err("stop_partial_pct must not exceed start_partial_pct (hysteresis)".into());
        }
        if !(self.payback_margin.is_finite() && self.payback_margin >= 0.0) {
            return Err("payback_margin must be finite and >= 0".into());
        }
        if self.bandwidth_bytes_per_s.iter().any(|b| !(b.is_finite() && *b > 0.0)) {
            return Err("bandwidth_bytes_per_s must be positive".into());
        }
        for (name, v) in [
            ("speculative_value", self.speculative_value),
            ("dirty_fraction", self.dirty_fraction),
            ("switchover_s", self.switchover_s),
            ("warmup_s", self.warmup_s),
            ("destination_deadline_s", self.destination_deadline_s),
            ("verify_s", self.verify_s),
            ("verify_min_cores", self.verify_min_cores),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be finite and >= 0"));
            }
        }
        if self.period_s == 0 {
            return Err("period_s must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.verify_margin) {
            return Err("verify_margin must lie in 0..1".into());
        }
        Ok(())
    }
}

/// One running allocation as compaction sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Running {
    /// Allocation id, unique among those handed to one step.
    pub id: u32,
    pub job_id: u64,
    pub node: NodeId,
    pub gpus: u64,
    pub gpu_milli: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub priority: u32,
    /// False for pinned work (never moved).
    pub movable: bool,
    /// Gang of the job (0: none). A gang member moves only within its
    /// switch domain, so the gang's topology never changes.
    pub gang_id: u64,
    /// Bytes of weights and state a migration copies.
    pub state_bytes: u64,
    /// Expected remaining run time, s (0: unknown).
    pub remaining_s: u64,
    pub running_s: u64,
    pub since_checkpoint_s: u64,
    /// Simulated time of the last move, if it was ever moved.
    #[serde(default)]
    pub last_moved_s: Option<u64>,
    /// The job's class (contract 0.4.0), by name in a saved snapshot; one
    /// saved before it is training.
    #[serde(default, with = "class_by_name")]
    pub class: berth_sdk::TaskClass,
}

/// [`Running::class`] in a snapshot file: its name (`training`,
/// `inference`, `cpu-only`).
mod class_by_name {
    use berth_sdk::TaskClass;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(class: &TaskClass, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(class.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TaskClass, D::Error> {
        let name = String::deserialize(d)?;
        TaskClass::from_name(&name).ok_or_else(|| serde::de::Error::custom(format!("class {name:?}: one of training, inference, cpu-only")))
    }
}

impl Running {
    pub fn allocation(&self) -> Allocation {
        Allocation { node: self.node, gpus: self.gpus, gpu_milli: self.gpu_milli, cpu_milli: self.cpu_milli, memory_mib: self.memory_mib }
    }
    fn set_allocation(&mut self, a: &Allocation) {
        self.node = a.node;
        self.gpus = a.gpus;
    }
    fn shape(&self) -> TaskShape {
        TaskShape { gpu_count: self.gpus.count_ones(), gpu_milli: self.gpu_milli, cpu_milli: self.cpu_milli, memory_mib: self.memory_mib, models: vec![] }
    }
    /// Whole-GPU equivalents held.
    fn gpu_equiv(&self) -> f64 {
        f64::from(self.gpus.count_ones()) * f64::from(self.gpu_milli) / f64::from(MILLI_PER_GPU)
    }
    /// Whether it may move at `now` under `config` (movable and resident
    /// long enough).
    pub fn may_move(&self, config: &CompactionConfig, now: u64) -> bool {
        self.movable && self.last_moved_s.is_none_or(|t| now.saturating_sub(t) >= config.min_residence_s)
    }
}

/// The default state-size estimate (see the module documentation).
pub fn estimate_state_bytes(config: &CompactionConfig, gpus: u32, gpu_milli: u32, memory_mib: u64) -> u64 {
    let gpu = u64::from(gpus) * config.default_state_bytes_per_gpu * u64::from(gpu_milli) / u64::from(MILLI_PER_GPU);
    gpu + memory_mib * (1 << 20)
}

/// Work waiting for capacity: `tasks` tasks of one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Wanted {
    pub gpu_count: u32,
    pub gpu_milli: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    /// Accepted model; `None` for any.
    pub model: Option<ModelId>,
    pub tasks: u32,
    /// Whole nodes the shape needs (tasks that fill a node); 0 if none.
    pub whole_nodes: u32,
}

impl Wanted {
    pub fn shape(&self) -> TaskShape {
        TaskShape {
            gpu_count: self.gpu_count,
            gpu_milli: self.gpu_milli,
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            models: self.model.into_iter().collect(),
        }
    }
    /// A pending shape from a job; it wants whole nodes when one task takes
    /// every GPU of the largest node of its model in `nodes`.
    pub fn from_job(fleet: &Fleet, nodes: &[NodeId], job: &Job) -> Wanted {
        Wanted::of(&LargestNodes::of(fleet, nodes), job)
    }

    /// [`Wanted::from_job`] with the nodes read once for many jobs.
    pub fn of(largest: &LargestNodes, job: &Job) -> Wanted {
        let s = &job.shape;
        let model = if s.models.len() == 1 { Some(s.models[0]) } else { None };
        let whole = s.gpu_count > 0 && s.gpu_milli == MILLI_PER_GPU && s.gpu_count >= largest.for_shape(s);
        Wanted {
            gpu_count: s.gpu_count,
            gpu_milli: s.gpu_milli,
            cpu_milli: s.cpu_milli,
            memory_mib: s.memory_mib,
            model,
            tasks: job.tasks,
            whole_nodes: if whole { job.tasks } else { 0 },
        }
    }
}

/// The most GPUs one node has, per GPU model, among some nodes: what tells
/// a whole-node shape, read once for every pending job (not a scan of the
/// nodes per job).
pub struct LargestNodes(Vec<(Option<ModelId>, u32)>);

impl LargestNodes {
    pub fn of(fleet: &Fleet, nodes: &[NodeId]) -> LargestNodes {
        let mut by_model: BTreeMap<Option<ModelId>, u32> = BTreeMap::new();
        for n in nodes.iter().filter_map(|&id| fleet.node(id)) {
            let most = by_model.entry(n.model).or_insert(0);
            *most = (*most).max(n.gpus.len() as u32);
        }
        LargestNodes(by_model.into_iter().collect())
    }

    /// GPUs of the largest node `shape` may run on (`u32::MAX`: none).
    pub fn for_shape(&self, shape: &TaskShape) -> u32 {
        self.0.iter().filter(|&&(m, _)| shape.gpu_count > 0 && shape.accepts(m)).map(|&(_, g)| g).max().unwrap_or(u32::MAX)
    }
}

/// Network tier a move crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Tier {
    SameSwitch,
    SameAggregation,
    CrossAggregation,
}

impl Tier {
    pub fn between(a: &Node, b: &Node) -> Tier {
        if a.switch_domain == b.switch_domain {
            Tier::SameSwitch
        } else if a.aggregation == b.aggregation {
            Tier::SameAggregation
        } else {
            Tier::CrossAggregation
        }
    }
}

/// One validated move, with its modelled cost.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannedMove {
    pub chain: u32,
    /// Index into the `running` slice handed to the step.
    pub index: usize,
    pub allocation_id: u32,
    pub job_id: u64,
    #[serde(skip)]
    pub from: Allocation,
    #[serde(skip)]
    pub to: Allocation,
    pub from_node: NodeId,
    pub to_node: NodeId,
    pub tier: Tier,
    pub state_bytes: u64,
    /// Copy while the job runs on the source (destination held twice).
    pub transfer_s: f64,
    /// Job stopped.
    pub pause_s: f64,
    pub warmup_s: f64,
    /// Overlap GPU-seconds + paused GPU-seconds.
    pub cost_gpu_s: f64,
}

/// Why a plan was rejected whole: the first invalid move and the reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("plan rejected: {}{reason}", move_index.map(|i| format!("move {i}: ")).unwrap_or_default())]
pub struct PlanRejected {
    pub move_index: Option<usize>,
    pub reason: String,
}

fn reject(i: usize, reason: String) -> PlanRejected {
    PlanRejected { move_index: Some(i), reason }
}

/// The partition's nodes (ids in fleet order). `None`: the whole fleet.
pub fn partition_nodes(fleet: &Fleet, partition: Option<u32>) -> Vec<NodeId> {
    fleet.nodes().iter().enumerate().filter(|(_, n)| partition.is_none_or(|p| n.partition == p)).map(|(i, _)| i as NodeId).collect()
}

/// Builds the snapshot the policy sees: `nodes` (fleet ids), the running
/// allocations on them (others are left out), and the pending shapes.
/// Allocation ids are the [`Running::id`]s; node ids are fleet node ids.
pub fn snapshot(fleet: &Fleet, nodes: &[NodeId], running: &[Running], pending: &[Wanted], config: &CompactionConfig, now: u64) -> Snapshot {
    let mut n = Nodes { models: fleet.models.clone(), ..Nodes::default() };
    let mut inside: HashSet<NodeId> = HashSet::with_capacity(nodes.len());
    for &id in nodes {
        // Unschedulable nodes take nothing, so the policy does not see them
        // (nor the work on them, which compaction leaves alone).
        let Some(node) = fleet.node(id).filter(|n| n.schedulable) else { continue };
        inside.insert(id);
        n.push(
            id,
            node.model.unwrap_or(u32::MAX),
            node.switch_domain,
            node.cpu_free_milli,
            node.cpu_total_milli,
            node.memory_free_mib,
            node.memory_total_mib,
            &node.gpus,
            node.alloc_kinds(),
        );
        n.set_contention(n.len() - 1, node.contention());
    }
    let mut a = Allocations::default();
    for r in running.iter().filter(|r| inside.contains(&r.node)) {
        a.push(AllocationRow {
            id: r.id,
            job_id: r.job_id,
            node: r.node,
            gpus: r.gpus,
            gpu_milli: r.gpu_milli,
            cpu_milli: r.cpu_milli,
            memory_mib: r.memory_mib,
            priority: r.priority,
            movable: r.may_move(config, now),
            gang_id: r.gang_id,
            state_bytes: r.state_bytes,
            remaining_s: r.remaining_s,
            running_s: r.running_s,
            since_checkpoint_s: r.since_checkpoint_s,
            class: r.class,
            // Not what compaction decides on: sent as not known.
            tier: berth_sdk::Tier::Preemptible,
            interruptions_left: u32::MAX,
        });
    }
    let mut p = Pending::default();
    let mut wanted: Vec<&Wanted> = pending.iter().collect();
    wanted.sort_by_key(|w| std::cmp::Reverse((w.whole_nodes, u64::from(w.tasks) * u64::from(w.gpu_count) * u64::from(w.gpu_milli))));
    for w in wanted.into_iter().take(config.max_pending) {
        p.gpu_count.push(w.gpu_count);
        p.gpu_milli.push(w.gpu_milli);
        p.whole_nodes.push(w.whole_nodes);
        p.model.push(w.model.unwrap_or(u32::MAX));
    }
    Snapshot { nodes: n, allocations: a, pending: p }
}

/// A scratch copy of the partition's nodes, as a small fleet indexed
/// locally, to apply moves to without touching the real fleet.
struct Scratch {
    fleet: Fleet,
    local: HashMap<NodeId, NodeId>,
}

impl Scratch {
    fn new(fleet: &Fleet, nodes: &[NodeId]) -> Scratch {
        let mut list = Vec::with_capacity(nodes.len());
        let mut local = HashMap::with_capacity(nodes.len());
        for &id in nodes {
            if let Some(n) = fleet.node(id)
                && !local.contains_key(&id)
            {
                local.insert(id, list.len() as NodeId);
                list.push(n.clone());
            }
        }
        Scratch { fleet: Fleet::new(fleet.models.clone(), list).expect("nodes of a valid fleet"), local }
    }
    fn node(&self, id: NodeId) -> Option<&Node> {
        self.local.get(&id).and_then(|&l| self.fleet.node(l))
    }
    fn localise(&self, a: &Allocation) -> Allocation {
        Allocation { node: self.local[&a.node], ..a.clone() }
    }
    fn apply(&mut self, from: &Allocation, to: &Allocation) -> Result<(), String> {
        let (f, t) = (self.localise(from), self.localise(to));
        self.fleet.allocate(&t).map_err(|e| e.to_string())?;
        if let Err(e) = self.fleet.release(&f) {
            self.fleet.release(&t).expect("just allocated");
            return Err(e.to_string());
        }
        Ok(())
    }
    fn undo(&mut self, from: &Allocation, to: &Allocation) {
        let (f, t) = (self.localise(from), self.localise(to));
        self.fleet.allocate(&f).expect("undo: the source was just released");
        self.fleet.release(&t).expect("undo: the destination was just allocated");
    }
}

/// Modelled cost of moving `r` from `a` to `b`.
fn cost(config: &CompactionConfig, r: &Running, a: &Node, b: &Node) -> (Tier, f64, f64, f64, f64) {
    let tier = Tier::between(a, b);
    let bw = config.bandwidth_bytes_per_s[tier as usize];
    let transfer = r.state_bytes as f64 / bw;
    let pause = config.switchover_s + config.dirty_fraction * transfer;
    let gpus = r.gpu_equiv().max(if r.gpus == 0 { 0.0 } else { 0.001 });
    let cost_gpu_s = gpus * (transfer + config.warmup_s) + gpus * pause;
    (tier, transfer, pause, config.warmup_s, cost_gpu_s)
}

/// Validates a whole plan against the fleet: the columns, chain numbering,
/// and every move on the state left by the moves before it (capacity, GPU
/// mask, same GPU model, schedulable destination inside the partition,
/// movable allocation moved at most once, gang members kept in their switch
/// domain). Any invalid move rejects the whole plan.
pub fn validate(
    fleet: &Fleet,
    nodes: &[NodeId],
    running: &[Running],
    plan: &Plan,
    config: &CompactionConfig,
    now: u64,
) -> Result<Vec<PlannedMove>, PlanRejected> {
    let len = plan.allocation.len();
    if plan.chain.len() != len || plan.dest_node.len() != len || plan.dest_gpus.len() != len {
        return Err(PlanRejected {
            move_index: None,
            reason: format!(
                "columns differ in length: chain {}, allocation {}, dest-node {}, dest-gpus {}",
                plan.chain.len(),
                len,
                plan.dest_node.len(),
                plan.dest_gpus.len()
            ),
        });
    }
    let by_id: HashMap<u32, usize> = running.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    if by_id.len() != running.len() {
        return Err(PlanRejected { move_index: None, reason: "host error: duplicate allocation ids".into() });
    }
    let mut scratch = Scratch::new(fleet, nodes);
    let mut moved: HashSet<u32> = HashSet::new();
    let mut out = Vec::with_capacity(len);
    for i in 0..len {
        let chain = plan.chain[i];
        let expected_ok = if i == 0 { chain == 0 } else { chain == plan.chain[i - 1] || chain == plan.chain[i - 1] + 1 };
        if !expected_ok {
            return Err(reject(i, format!("chain {chain} out of order (chains are numbered from 0 and contiguous)")));
        }
        let id = plan.allocation[i];
        let &index = by_id.get(&id).ok_or_else(|| reject(i, format!("unknown allocation {id}")))?;
        let r = &running[index];
        if !moved.insert(id) {
            return Err(reject(i, format!("allocation {id} moved twice")));
        }
        let Some(src) = scratch.node(r.node).cloned() else {
            return Err(reject(i, format!("allocation {id} is not in the partition")));
        };
        if !r.may_move(config, now) {
            return Err(reject(i, format!("allocation {id} is not movable (pinned, or moved less than {} s ago)", config.min_residence_s)));
        }
        let dest_id = plan.dest_node[i];
        let Some(dest) = scratch.node(dest_id).cloned() else {
            return Err(reject(i, format!("destination node {dest_id} is not in the partition")));
        };
        if dest_id == r.node {
            return Err(reject(i, format!("allocation {id} already runs on node {dest_id}")));
        }
        if !dest.schedulable {
            return Err(reject(i, format!("destination node {dest_id} is not schedulable")));
        }
        if r.gpus != 0 && dest.model != src.model {
            return Err(reject(i, format!("allocation {id} runs on GPU model {:?}; node {dest_id} has {:?}", src.model, dest.model)));
        }
        if r.gang_id != 0 && dest.switch_domain != src.switch_domain {
            return Err(reject(
                i,
                format!("allocation {id} is a member of gang {} and would leave switch domain {} for {}", r.gang_id, src.switch_domain, dest.switch_domain),
            ));
        }
        let shape = r.shape();
        crate::predicate::check(&dest, &shape).map_err(|u| reject(i, format!("node {dest_id} cannot take allocation {id}: {u}")))?;
        let mask = plan.dest_gpus[i];
        validate_mask(&dest, dest_id, &shape, mask).map_err(|e| reject(i, e.to_string()))?;
        let mask = if mask == 0 { default_gpus(&dest, &shape) } else { mask };
        let from = r.allocation();
        let to = Allocation { node: dest_id, gpus: mask, ..from.clone() };
        scratch.apply(&from, &to).map_err(|e| reject(i, format!("node {dest_id}: {e}")))?;
        let (tier, transfer_s, pause_s, warmup_s, cost_gpu_s) = cost(config, r, &src, &dest);
        out.push(PlannedMove {
            chain,
            index,
            allocation_id: id,
            job_id: r.job_id,
            from_node: from.node,
            to_node: to.node,
            from,
            to,
            tier,
            state_bytes: r.state_bytes,
            transfer_s,
            pause_s,
            warmup_s,
            cost_gpu_s,
        });
    }
    Ok(out)
}

/// What payback selection decided about one chain.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChainDecision {
    pub chain: u32,
    pub moves: usize,
    /// Nodes the chain leaves idle that were not, net of idle nodes it
    /// starts using.
    pub nodes_freed: i64,
    pub benefit_gpu_s: f64,
    pub cost_gpu_s: f64,
    pub run: bool,
    /// Why it does not run, if it does not.
    pub skipped: Option<String>,
}

/// Keeps the chains that pay back, in order. Each chain is evaluated on the
/// state left by the chains kept before it; a chain that no longer fits
/// there (it relied on a dropped chain) is dropped too. Returns the moves
/// to run and a decision per chain.
pub fn select(
    fleet: &Fleet,
    nodes: &[NodeId],
    running: &[Running],
    pending: &[Wanted],
    moves: &[PlannedMove],
    config: &CompactionConfig,
) -> (Vec<PlannedMove>, Vec<ChainDecision>) {
    let mut scratch = Scratch::new(fleet, nodes);
    let mut keep = Vec::new();
    let mut decisions = Vec::new();
    let wants_whole = |model: Option<ModelId>| {
        pending.iter().any(|w| w.whole_nodes > 0 && (w.model.is_none() || w.model == model))
    };
    let mut start = 0;
    while start < moves.len() {
        let chain = moves[start].chain;
        let end = start + moves[start..].iter().take_while(|m| m.chain == chain).count();
        let group = &moves[start..end];
        start = end;
        let touched: Vec<NodeId> = {
            let mut t: Vec<NodeId> = group.iter().flat_map(|m| [m.from_node, m.to_node]).collect();
            t.sort_unstable();
            t.dedup();
            t
        };
        let idle_before: HashMap<NodeId, bool> = touched.iter().map(|&n| (n, scratch.node(n).is_some_and(Node::is_idle))).collect();
        let mut applied = Vec::new();
        let mut failure = None;
        for m in group {
            // Re-home on the current scratch state (masks may differ when an
            // earlier chain was dropped).
            let dest = scratch.node(m.to_node).expect("validated").clone();
            let shape = running[m.index].shape();
            let mask = if validate_mask(&dest, m.to_node, &shape, m.to.gpus).is_ok() && crate::predicate::check(&dest, &shape).is_ok() {
                m.to.gpus
            } else {
                default_gpus(&dest, &shape)
            };
            let to = Allocation { gpus: mask, ..m.to.clone() };
            if crate::predicate::check(&dest, &shape).is_err() || scratch.apply(&m.from, &to).is_err() {
                failure = Some(format!("move of allocation {} no longer fits after a dropped chain", m.allocation_id));
                break;
            }
            applied.push(PlannedMove { to, ..m.clone() });
        }
        let cost: f64 = applied.iter().map(|m| m.cost_gpu_s).sum();
        let mut benefit = 0.0;
        let mut freed = 0i64;
        if failure.is_none() {
            for &n in &touched {
                let node = scratch.node(n).expect("in partition");
                let was = idle_before[&n];
                let now_idle = node.is_idle();
                if was == now_idle {
                    continue;
                }
                let value = if wants_whole(node.model) { 1.0 } else { config.speculative_value };
                let lifetime = applied
                    .iter()
                    .filter(|m| m.from_node == n || m.to_node == n)
                    .map(|m| {
                        let r = &running[m.index];
                        if r.remaining_s == 0 { config.unknown_remaining_s } else { r.remaining_s }
                    })
                    .max()
                    .unwrap_or(0)
                    .min(config.benefit_horizon_s) as f64;
                let gain = node.gpus.len() as f64 * lifetime * value;
                if now_idle {
                    freed += 1;
                    benefit += gain;
                } else {
                    freed -= 1;
                    benefit -= gain;
                }
            }
        }
        let pays = failure.is_none() && freed > 0 && benefit > cost * config.payback_margin;
        let skipped = match (&failure, pays) {
            (Some(f), _) => Some(f.clone()),
            (None, false) => Some(format!("does not pay back: benefit {benefit:.0} GPU-s, cost {cost:.0} GPU-s x margin {}", config.payback_margin)),
            _ => None,
        };
        let over_budget = pays && keep.len() + applied.len() > config.max_moves;
        let run = pays && !over_budget;
        if run {
            keep.extend(applied.iter().cloned());
        } else {
            for m in applied.iter().rev() {
                scratch.undo(&m.from, &m.to);
            }
        }
        decisions.push(ChainDecision {
            chain,
            moves: group.len(),
            nodes_freed: freed,
            benefit_gpu_s: benefit,
            cost_gpu_s: cost,
            run,
            skipped: if over_budget { Some(format!("over the budget of {} moves per step", config.max_moves)) } else { skipped },
        });
    }
    (keep, decisions)
}

/// What actually happened when a destination was started.
#[derive(Clone, Debug, PartialEq)]
pub enum MigrationResult {
    /// The destination took over this many seconds after its start.
    Ready { after_s: f64 },
    /// The destination failed to start.
    Failed(String),
}

/// Starts destinations: the simulated fleet in replay, node agents live,
/// failure injection in tests.
pub trait Actuator {
    fn migrate(&mut self, mv: &PlannedMove) -> MigrationResult;
}

/// Replay's actuator: every destination is ready after the modelled copy
/// and warm-up.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimulatedActuator;

impl Actuator for SimulatedActuator {
    fn migrate(&mut self, mv: &PlannedMove) -> MigrationResult {
        MigrationResult::Ready { after_s: mv.transfer_s + mv.warmup_s }
    }
}

/// One move that ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AppliedMove {
    pub chain: u32,
    /// Index into the `running` slice handed to the step.
    pub index: usize,
    pub allocation_id: u32,
    pub job_id: u64,
    #[serde(skip)]
    pub from: Allocation,
    #[serde(skip)]
    pub to: Allocation,
    pub from_node: NodeId,
    pub to_node: NodeId,
    pub tier: Tier,
}

/// The migration ledger of one step; [`Ledger::add`] sums steps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    pub steps: u64,
    /// Steps the hysteresis kept compaction off.
    pub steps_idle: u64,
    pub plans: u64,
    pub plans_rejected: u64,
    pub chains_planned: u64,
    pub chains_run: u64,
    pub chains_skipped: u64,
    /// Chains stopped part-way by a failed or slow destination, or a
    /// destination that no longer fitted.
    pub chains_abandoned: u64,
    pub moves_planned: u64,
    pub moves_run: u64,
    pub moves_rolled_back: u64,
    /// Bytes of weights and state moved: same access switch, same
    /// aggregation switch, across aggregation switches.
    pub bytes_same_switch: u64,
    pub bytes_same_aggregation: u64,
    pub bytes_cross_aggregation: u64,
    /// Seconds the source and destination both ran (copy + warm-up).
    pub overlap_s: f64,
    /// GPU-seconds held twice during the overlap.
    pub overlap_gpu_s: f64,
    /// Seconds jobs were paused.
    pub pause_s: f64,
    pub warmup_s: f64,
    pub partial_nodes_before: u64,
    pub partial_nodes_after: u64,
    pub idle_nodes_before: u64,
    pub idle_nodes_after: u64,
    /// Idle (whole free) nodes after minus before.
    pub whole_nodes_gained: i64,
    /// Pending shapes whose every task fits the partition, before and after.
    pub pending_startable_before: u64,
    pub pending_startable_after: u64,
    /// Whether some pending gang (several tasks) that could not start
    /// before can start now.
    pub gang_unblocked: bool,
    /// Reasons of rejected plans and policy errors (most recent last).
    pub rejections: Vec<String>,
}

impl Ledger {
    pub fn bytes_moved(&self) -> u64 {
        self.bytes_same_switch + self.bytes_same_aggregation + self.bytes_cross_aggregation
    }
    /// Adds another step's figures (counts and bytes sum; before/after
    /// figures sum too, so totals over steps are sums over partitions).
    pub fn add(&mut self, o: &Ledger) {
        self.steps += o.steps;
        self.steps_idle += o.steps_idle;
        self.plans += o.plans;
        self.plans_rejected += o.plans_rejected;
        self.chains_planned += o.chains_planned;
        self.chains_run += o.chains_run;
        self.chains_skipped += o.chains_skipped;
        self.chains_abandoned += o.chains_abandoned;
        self.moves_planned += o.moves_planned;
        self.moves_run += o.moves_run;
        self.moves_rolled_back += o.moves_rolled_back;
        self.bytes_same_switch += o.bytes_same_switch;
        self.bytes_same_aggregation += o.bytes_same_aggregation;
        self.bytes_cross_aggregation += o.bytes_cross_aggregation;
        self.overlap_s += o.overlap_s;
        self.overlap_gpu_s += o.overlap_gpu_s;
        self.pause_s += o.pause_s;
        self.warmup_s += o.warmup_s;
        self.partial_nodes_before += o.partial_nodes_before;
        self.partial_nodes_after += o.partial_nodes_after;
        self.idle_nodes_before += o.idle_nodes_before;
        self.idle_nodes_after += o.idle_nodes_after;
        self.whole_nodes_gained += o.whole_nodes_gained;
        self.pending_startable_before += o.pending_startable_before;
        self.pending_startable_after += o.pending_startable_after;
        self.gang_unblocked |= o.gang_unblocked;
        self.rejections.extend(o.rejections.iter().cloned());
        let keep = 100;
        if self.rejections.len() > keep {
            self.rejections.drain(..self.rejections.len() - keep);
        }
    }
}

/// Partially occupied and idle GPU nodes among `nodes`: a node is partial
/// when some GPU capacity is allocated and some is free (CPU-only nodes
/// and unschedulable nodes are not counted).
pub fn occupancy(fleet: &Fleet, nodes: &[NodeId]) -> (u64, u64, u64) {
    let (mut partial, mut idle, mut gpu_nodes) = (0, 0, 0);
    for n in nodes.iter().filter_map(|&id| fleet.node(id)) {
        if n.gpus.is_empty() || !n.schedulable {
            continue;
        }
        gpu_nodes += 1;
        let free = n.gpu_free_milli();
        if n.is_idle() {
            idle += 1;
        } else if free > 0 {
            partial += 1;
        }
    }
    (partial, idle, gpu_nodes)
}

fn startable(fleet: &Fleet, nodes: &[NodeId], pending: &[Wanted]) -> Vec<bool> {
    pending
        .iter()
        .map(|w| {
            let shape = w.shape();
            let mut fit = 0u64;
            for n in nodes.iter().filter_map(|&id| fleet.node(id)) {
                let t = if w.whole_nodes > 0 { u64::from(n.is_idle() && crate::predicate::check(n, &shape).is_ok()) } else { u64::from(tasks_on_node(n, &shape)) };
                fit += t;
                if fit >= u64::from(w.tasks) {
                    return true;
                }
            }
            false
        })
        .collect()
}

/// Walks selected moves chain by chain for an executor that learns each
/// move's result at once (replay) or later (live agents): once a move of a
/// chain fails, the rest of that chain is skipped, because later moves of an
/// ejection chain rely on the room the earlier ones made.
#[derive(Clone, Debug, Default)]
pub struct Cursor {
    moves: Vec<PlannedMove>,
    next: usize,
    abandoned: Option<u32>,
}

impl Cursor {
    pub fn new(moves: Vec<PlannedMove>) -> Cursor {
        Cursor { moves, next: 0, abandoned: None }
    }
    /// The next move to run, skipping what is left of an abandoned chain.
    pub fn next_move(&mut self) -> Option<&PlannedMove> {
        while self.next < self.moves.len() {
            let i = self.next;
            self.next += 1;
            if self.abandoned != Some(self.moves[i].chain) {
                return Some(&self.moves[i]);
            }
        }
        None
    }
    /// The rest of `chain` does not run.
    pub fn abandon(&mut self, chain: u32) {
        self.abandoned = Some(chain);
    }
}

/// Runs `moves` (validated, selected) make-before-break on `fleet`: per
/// move, allocate the destination, start it, and only when it is ready
/// within the deadline release the source and update `running`. A failed or
/// slow destination is released again (the job keeps its source) and the
/// rest of its chain is abandoned; a destination that no longer fits (an
/// earlier failure changed the state) abandons its chain too. Never
/// over-commits (the fleet's checked allocate) and never leaves a GPU with
/// two owners.
pub fn execute(
    fleet: &mut Fleet,
    running: &mut [Running],
    moves: &[PlannedMove],
    actuator: &mut dyn Actuator,
    config: &CompactionConfig,
    now: u64,
    ledger: &mut Ledger,
) -> Result<Vec<AppliedMove>, CompactionError> {
    let mut applied = Vec::new();
    let mut cursor = Cursor::new(moves.to_vec());
    while let Some(m) = cursor.next_move().cloned() {
        let m = &m;
        let r = &running[m.index];
        let from = r.allocation();
        if from != m.from {
            cursor.abandon(m.chain);
            ledger.chains_abandoned += 1;
            continue;
        }
        // Make: reserve the destination (checked; refuses over-commit).
        if fleet.allocate(&m.to).is_err() {
            cursor.abandon(m.chain);
            ledger.chains_abandoned += 1;
            continue;
        }
        let gpus = r.gpu_equiv();
        match actuator.migrate(m) {
            MigrationResult::Ready { after_s } if after_s.is_finite() && after_s <= config.destination_deadline_s => {
                // Break: release the source only now.
                if fleet.release(&from).is_err() {
                    fleet.release(&m.to).expect("the destination was just allocated");
                    return Err(CompactionError::NotHeld(m.allocation_id));
                }
                running[m.index].set_allocation(&m.to);
                running[m.index].last_moved_s = Some(now);
                ledger.moves_run += 1;
                let bytes = m.state_bytes;
                match m.tier {
                    Tier::SameSwitch => ledger.bytes_same_switch += bytes,
                    Tier::SameAggregation => ledger.bytes_same_aggregation += bytes,
                    Tier::CrossAggregation => ledger.bytes_cross_aggregation += bytes,
                }
                let overlap = after_s.max(m.transfer_s + m.warmup_s);
                ledger.overlap_s += overlap;
                ledger.overlap_gpu_s += overlap * gpus;
                ledger.pause_s += m.pause_s;
                ledger.warmup_s += m.warmup_s;
                applied.push(AppliedMove {
                    chain: m.chain,
                    index: m.index,
                    allocation_id: m.allocation_id,
                    job_id: m.job_id,
                    from,
                    to: m.to.clone(),
                    from_node: m.from_node,
                    to_node: m.to_node,
                    tier: m.tier,
                });
            }
            _ => {
                // Roll back: the destination goes, the job keeps running on
                // its source.
                fleet.release(&m.to).expect("the destination was just allocated");
                ledger.moves_rolled_back += 1;
                ledger.chains_abandoned += 1;
                cursor.abandon(m.chain);
            }
        }
    }
    Ok(applied)
}

/// Hysteresis state of the compaction driver, per partition (`None`: the
/// whole fleet), and when each task last moved (for `step_jobs`).
#[derive(Clone, Debug, Default)]
pub struct CompactionState {
    pub active: BTreeMap<Option<u32>, bool>,
    /// (job id, task index) -> simulated time of its last move.
    pub last_moved: HashMap<(u64, u32), u64>,
}

/// The result of one step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepOutcome {
    pub applied: Vec<AppliedMove>,
    pub chains: Vec<ChainDecision>,
    pub ledger: Ledger,
    /// Why the policy's answer was not used, if it was not.
    pub rejected: Option<String>,
}

/// Errors that stop a step (the fleet and `running` disagree). A policy
/// error or an invalid plan is not one: it is recorded in the outcome and
/// nothing moves.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CompactionError {
    #[error("running allocation {0} is not held on the fleet")]
    NotHeld(u32),
    #[error("invalid compaction config: {0}")]
    Config(String),
}

/// A plan the core has validated and cut to the chains that pay back.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Planned {
    /// The moves to run, chain by chain, in order.
    pub moves: Vec<PlannedMove>,
    /// What payback selection decided about every chain of the plan.
    pub chains: Vec<ChainDecision>,
    /// Moves in the policy's plan, before selection.
    pub moves_planned: usize,
    /// Why the policy's answer was not used (a failed call or an invalid
    /// plan, naming the policy), if it was not.
    pub rejected: Option<String>,
    /// The failed call's error, when the call itself failed (an invalid
    /// plan has `rejected` only).
    #[serde(skip)]
    pub failure: Option<PolicyError>,
}

/// Asks `policy` for a plan over the partition's `nodes` and checks it:
/// snapshot, the policy's call, [`validate`] (one invalid move rejects the
/// plan whole) and [`select`]. Nothing changes on `fleet`: replay runs the
/// moves at once ([`execute`]), the live host one by one on its agents.
/// `running` holds the allocations on `nodes`.
pub fn plan(
    fleet: &Fleet,
    nodes: &[NodeId],
    running: &[Running],
    pending: &[Wanted],
    policy: &mut dyn CompactionPolicy,
    config: &CompactionConfig,
    now: u64,
) -> Planned {
    let mut snap = snapshot(fleet, nodes, running, pending, config, now);
    let answer = match policy.compact(&mut snap) {
        Ok(p) => p,
        Err(e) => return Planned { rejected: Some(format!("{}: {e}", policy.describe())), failure: Some(e), ..Planned::default() },
    };
    let moves = match validate(fleet, nodes, running, &answer, config, now) {
        Ok(m) => m,
        Err(e) => return Planned { rejected: Some(format!("{}: {e}", policy.describe())), ..Planned::default() },
    };
    let (chosen, chains) = select(fleet, nodes, running, pending, &moves, config);
    Planned { moves: chosen, chains, moves_planned: moves.len(), rejected: None, failure: None }
}

/// Hysteresis: compaction turns on when at least `start_partial_pct` of the
/// GPU nodes among `nodes` are partially occupied and stays on until fewer
/// than `stop_partial_pct` are. Updates `active` and returns it.
pub fn hysteresis(fleet: &Fleet, nodes: &[NodeId], config: &CompactionConfig, active: &mut bool) -> bool {
    let (partial, _, gpu_nodes) = occupancy(fleet, nodes);
    let pct = if gpu_nodes == 0 { 0.0 } else { 100.0 * partial as f64 / gpu_nodes as f64 };
    if *active && pct < config.stop_partial_pct {
        *active = false;
    } else if !*active && pct >= config.start_partial_pct {
        *active = true;
    }
    *active
}

/// How many of the `pending` shapes could start on `nodes` now (every task
/// placed; whole-node shapes on idle nodes only).
pub fn startable_count(fleet: &Fleet, nodes: &[NodeId], pending: &[Wanted]) -> u64 {
    startable(fleet, nodes, pending).iter().filter(|&&b| b).count() as u64
}

/// One compaction step over one partition (`nodes`): hysteresis, snapshot,
/// the policy's plan, validation (an invalid plan is rejected whole and
/// recorded), payback selection, make-before-break execution and the
/// ledger. `running` must hold every allocation on `nodes` (others may be
/// present and are ignored); moved entries are updated in place (node,
/// GPUs, `last_moved_s`). `active` is the partition's hysteresis flag.
#[allow(clippy::too_many_arguments)]
pub fn step(
    fleet: &mut Fleet,
    nodes: &[NodeId],
    running: &mut [Running],
    pending: &[Wanted],
    policy: &mut dyn CompactionPolicy,
    config: &CompactionConfig,
    active: &mut bool,
    actuator: &mut dyn Actuator,
    now: u64,
) -> Result<StepOutcome, CompactionError> {
    config.check().map_err(CompactionError::Config)?;
    let mut out = StepOutcome::default();
    let ledger = &mut out.ledger;
    ledger.steps = 1;
    let (partial, idle, _) = occupancy(fleet, nodes);
    ledger.partial_nodes_before = partial;
    ledger.idle_nodes_before = idle;
    ledger.partial_nodes_after = partial;
    ledger.idle_nodes_after = idle;
    let before = startable(fleet, nodes, pending);
    ledger.pending_startable_before = before.iter().filter(|&&b| b).count() as u64;
    ledger.pending_startable_after = ledger.pending_startable_before;
    if !hysteresis(fleet, nodes, config, active) {
        ledger.steps_idle = 1;
        return Ok(out);
    }
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    // Only the partition's allocations may be named.
    let local: Vec<Running> = running.iter().filter(|r| inside.contains(&r.node)).cloned().collect();
    let positions: Vec<usize> = running.iter().enumerate().filter(|(_, r)| inside.contains(&r.node)).map(|(i, _)| i).collect();
    ledger.plans = 1;
    let planned = plan(fleet, nodes, &local, pending, policy, config, now);
    if let Some(reason) = planned.rejected {
        ledger.plans_rejected = 1;
        ledger.rejections.push(reason.clone());
        out.rejected = Some(reason);
        return Ok(out);
    }
    let (chosen, decisions) = (planned.moves, planned.chains);
    ledger.moves_planned = planned.moves_planned as u64;
    ledger.chains_planned = decisions.len() as u64;
    ledger.chains_run = decisions.iter().filter(|d| d.run).count() as u64;
    ledger.chains_skipped = ledger.chains_planned - ledger.chains_run;
    out.chains = decisions;
    let mut local = local;
    let applied = execute(fleet, &mut local, &chosen, actuator, config, now, ledger)?;
    for a in &applied {
        running[positions[a.index]] = local[a.index].clone();
    }
    out.applied = applied
        .into_iter()
        .map(|a| AppliedMove { index: positions[a.index], ..a })
        .collect();
    let (partial, idle, _) = occupancy(fleet, nodes);
    ledger.partial_nodes_after = partial;
    ledger.idle_nodes_after = idle;
    ledger.whole_nodes_gained = idle as i64 - ledger.idle_nodes_before as i64;
    let after = startable(fleet, nodes, pending);
    ledger.pending_startable_after = after.iter().filter(|&&b| b).count() as u64;
    ledger.gang_unblocked = pending.iter().zip(before.iter().zip(&after)).any(|(w, (&b, &a))| w.tasks > 1 && !b && a);
    Ok(out)
}

/// [`step`] over every partition, for an event loop that keeps jobs and
/// allocations as `sim.rs` does:
///
/// - `jobs`: all jobs; `held[j]`: the allocations job `j` holds (one per
///   task, in task order); moved allocations are rewritten in place;
/// - `running`: `(planned end, job index)` of every running job;
/// - `pending`: indexes of waiting jobs;
/// - `now`: simulated time.
///
/// Every task is movable; a gang's tasks (jobs with more than one task)
/// move only within their switch domain; state bytes follow
/// [`estimate_state_bytes`]; remaining time is the planned end minus `now`.
/// Returns the summed ledger and the moves that ran (`index` meaningless
/// here; `job_id` names the job).
#[allow(clippy::too_many_arguments)]
pub fn step_jobs(
    fleet: &mut Fleet,
    jobs: &[Job],
    held: &mut [Vec<Allocation>],
    running: &[(u64, usize)],
    pending: &[usize],
    policy: &mut dyn CompactionPolicy,
    config: &CompactionConfig,
    state: &mut CompactionState,
    now: u64,
) -> Result<StepOutcome, CompactionError> {
    let mut by_partition: BTreeMap<u32, Vec<NodeId>> = BTreeMap::new();
    for (i, n) in fleet.nodes().iter().enumerate() {
        by_partition.entry(n.partition).or_default().push(i as NodeId);
    }
    // Every running task once, with the (job, task) it came from.
    let mut all: Vec<Running> = Vec::new();
    let mut origin: Vec<(usize, usize)> = Vec::new();
    for &(end, j) in running {
        let job = &jobs[j];
        for (t, a) in held[j].iter().enumerate() {
            let id = all.len() as u32;
            all.push(Running {
                id,
                job_id: job.id,
                node: a.node,
                gpus: a.gpus,
                gpu_milli: a.gpu_milli,
                cpu_milli: a.cpu_milli,
                memory_mib: a.memory_mib,
                priority: job.priority,
                movable: true,
                gang_id: if job.tasks > 1 { job.id.wrapping_add(1) } else { 0 },
                state_bytes: estimate_state_bytes(config, a.gpus.count_ones(), a.gpu_milli, a.memory_mib),
                remaining_s: end.saturating_sub(now),
                running_s: now.saturating_sub(end.saturating_sub(job.duration_s)),
                since_checkpoint_s: now.saturating_sub(end.saturating_sub(job.duration_s)),
                last_moved_s: state.last_moved.get(&(job.id, t as u32)).copied(),
                class: job.task_class(),
            });
            origin.push((j, t));
        }
    }
    let mut total = StepOutcome::default();
    for (&p, nodes) in &by_partition {
        let largest = LargestNodes::of(fleet, nodes);
        let wanted: Vec<Wanted> = pending
            .iter()
            .map(|&j| &jobs[j])
            .filter(|job| job.partition.is_none_or(|q| q == p))
            .map(|job| Wanted::of(&largest, job))
            .collect();
        let active = state.active.entry(Some(p)).or_insert(false);
        let out = step(fleet, nodes, &mut all, &wanted, policy, config, active, &mut SimulatedActuator, now)?;
        for a in &out.applied {
            let (j, t) = origin[a.index];
            held[j][t] = a.to.clone();
            state.last_moved.insert((jobs[j].id, t as u32), now);
        }
        total.ledger.add(&out.ledger);
        if out.rejected.is_some() {
            total.rejected = out.rejected.clone();
        }
        total.applied.extend(out.applied);
        total.chains.extend(out.chains);
    }
    // Forget tasks that no longer run.
    let live: HashSet<u64> = running.iter().map(|&(_, j)| jobs[j].id).collect();
    state.last_moved.retain(|(job, _), _| live.contains(job));
    Ok(total)
}
