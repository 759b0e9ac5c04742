//! Fleet state: nodes with per-GPU milli-GPU accounting, CPU and memory, and
//! checked allocate / release that never over-commit.

use std::collections::HashMap;

use crate::task::TaskShape;
use crate::units::{MAX_GPUS_PER_NODE, MILLI_PER_GPU};
pub use crate::units::{ModelId, NodeId};

/// Errors from changing fleet state. Nothing changes when one is returned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FleetError {
    /// The node id is not in the fleet.
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
    /// The GPU mask names a GPU the node does not have.
    #[error("node {node} has {gpus} GPUs; mask {mask:#x} names others")]
    UnknownGpu { node: NodeId, gpus: usize, mask: u64 },
    /// The allocation asks more than is free: it would over-commit.
    #[error("node {node}: {what} would be over-committed")]
    OverCommit { node: NodeId, what: &'static str },
    /// Releasing more than is allocated: the allocation was not held.
    #[error("node {node}: releasing {what} that is not allocated")]
    NotAllocated { node: NodeId, what: &'static str },
    /// A tracked fleet holds no allocation equal to the one released (a
    /// second release of it, or one never made): capacity alone would
    /// hide it when another holder's share is on the same GPUs.
    #[error("node {node}: releasing GPUs {gpus:#x} ({gpu_milli} milli each), an allocation that is not outstanding")]
    NotOutstanding { node: NodeId, gpus: u64, gpu_milli: u32 },
    /// The GPU mask does not name exactly the shape's GPU count.
    #[error("mask {mask:#x} names {named} GPUs, shape wants {wanted}")]
    GpuCountMismatch { mask: u64, named: u32, wanted: u32 },
    /// A node definition is invalid.
    #[error("node {name:?}: {reason}")]
    InvalidNode { name: String, reason: String },
}

/// One node and what is free on it.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Node {
    pub name: String,
    /// GPU model; `None` for a CPU-only node.
    pub model: Option<ModelId>,
    /// Access-switch domain.
    pub switch_domain: u32,
    /// Aggregation switch above the access switch.
    pub aggregation: u32,
    /// Partition: the unit of per-partition settings (starvation guard,
    /// compaction) and of jobs submitted to a partition.
    pub partition: u32,
    pub cpu_total_milli: u32,
    pub cpu_free_milli: u32,
    pub memory_total_mib: u64,
    pub memory_free_mib: u64,
    /// Free thousandths of each GPU (1000 = idle).
    pub gpus: Vec<u32>,
    /// False when cordoned or unhealthy: the predicate skips it.
    pub schedulable: bool,
    /// Running GPU allocations per kind (see [`berth_sdk::alloc_kind_bit`]).
    #[serde(with = "crate::serde_sdk::sparse_counts")]
    kind_counts: [u32; 64],
    /// CPU held by allocations without a GPU.
    cpu_only_milli: u32,
    /// What the node's agent measured last; `None` where nothing measures
    /// (replay, simulated nodes).
    pub measured: Option<Measured>,
}

/// What a node's agent measured over its last report (contract 0.4.0's
/// contention columns): CPU its tasks used, and the share of time some
/// task waited for CPU, memory or IO (PSI `some avg10`), in thousandths.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Measured {
    pub cpu_used_milli: u32,
    pub cpu_pressure: u32,
    pub memory_pressure: u32,
    pub io_pressure: u32,
}

impl Measured {
    /// Whether `other` differs enough to be worth a placement's attention:
    /// a tenth of a core or 2% pressure. Heartbeats move these a little all
    /// the time; marking a node changed for each would defeat the caches
    /// that skip unchanged nodes.
    pub fn differs(&self, other: &Measured) -> bool {
        self.cpu_used_milli.abs_diff(other.cpu_used_milli) >= 100
            || self.cpu_pressure.abs_diff(other.cpu_pressure) >= 20
            || self.memory_pressure.abs_diff(other.memory_pressure) >= 20
            || self.io_pressure.abs_diff(other.io_pressure) >= 20
    }
}

impl Clone for Node {
    fn clone(&self) -> Node {
        let mut node = Node::new(String::new(), None, 0, 0, 0);
        node.clone_from(self);
        node
    }

    /// Reuses this node's name and GPU list (a view of the fleet rebuilt
    /// every pass allocates nothing once warm). Every field is named: a new
    /// one cannot be forgotten here.
    fn clone_from(&mut self, source: &Node) {
        let Node {
            name,
            model,
            switch_domain,
            aggregation,
            partition,
            cpu_total_milli,
            cpu_free_milli,
            memory_total_mib,
            memory_free_mib,
            gpus,
            schedulable,
            kind_counts,
            cpu_only_milli,
            measured,
        } = source;
        self.name.clone_from(name);
        self.model = *model;
        self.switch_domain = *switch_domain;
        self.aggregation = *aggregation;
        self.partition = *partition;
        self.cpu_total_milli = *cpu_total_milli;
        self.cpu_free_milli = *cpu_free_milli;
        self.memory_total_mib = *memory_total_mib;
        self.memory_free_mib = *memory_free_mib;
        self.gpus.clone_from(gpus);
        self.schedulable = *schedulable;
        self.kind_counts = *kind_counts;
        self.cpu_only_milli = *cpu_only_milli;
        self.measured = *measured;
    }
}

impl Node {
    /// A node with everything free.
    pub fn new(name: impl Into<String>, model: Option<ModelId>, gpu_count: usize, cpu_milli: u32, memory_mib: u64) -> Node {
        Node {
            name: name.into(),
            model,
            switch_domain: 0,
            aggregation: 0,
            partition: 0,
            cpu_total_milli: cpu_milli,
            cpu_free_milli: cpu_milli,
            memory_total_mib: memory_mib,
            memory_free_mib: memory_mib,
            gpus: vec![MILLI_PER_GPU; gpu_count],
            schedulable: true,
            kind_counts: [0; 64],
            cpu_only_milli: 0,
            measured: None,
        }
    }

    /// GPU allocations running on the node, of any kind.
    pub fn gpu_tasks(&self) -> u32 {
        self.kind_counts.iter().sum()
    }

    /// CPU held by allocations without a GPU, in thousandths of a core.
    pub fn cpu_only_milli(&self) -> u32 {
        self.cpu_only_milli
    }

    /// The node's entries of the contract's contention columns: what its
    /// agent measured, or the CPU allocated where nothing measures.
    pub fn contention(&self) -> berth_sdk::Contention {
        let m = self.measured.unwrap_or(Measured { cpu_used_milli: self.cpu_total_milli - self.cpu_free_milli, ..Measured::default() });
        berth_sdk::Contention {
            gpu_tasks: self.gpu_tasks(),
            cpu_only_milli: self.cpu_only_milli,
            cpu_used_milli: m.cpu_used_milli,
            cpu_pressure: m.cpu_pressure,
            memory_pressure: m.memory_pressure,
            io_pressure: m.io_pressure,
        }
    }

    /// Kinds of GPU allocation running here, as the contract's bit set.
    pub fn alloc_kinds(&self) -> u64 {
        self.kind_counts.iter().enumerate().filter(|&(_, &c)| c > 0).fold(0, |acc, (k, _)| acc | 1u64 << k)
    }

    pub fn gpu_free_milli(&self) -> u64 {
        self.gpus.iter().map(|&g| u64::from(g)).sum()
    }

    pub fn gpu_total_milli(&self) -> u64 {
        self.gpus.len() as u64 * u64::from(MILLI_PER_GPU)
    }

    /// Whether anything at all is allocated on the node.
    pub fn is_idle(&self) -> bool {
        self.cpu_free_milli == self.cpu_total_milli
            && self.memory_free_mib == self.memory_total_mib
            && self.gpus.iter().all(|&g| g == MILLI_PER_GPU)
    }

    fn check(&self) -> Result<(), String> {
        if self.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(format!("{} GPUs exceeds {}", self.gpus.len(), MAX_GPUS_PER_NODE));
        }
        if !self.gpus.is_empty() && self.model.is_none() {
            return Err("GPUs without a model".into());
        }
        if self.cpu_free_milli > self.cpu_total_milli || self.memory_free_mib > self.memory_total_mib {
            return Err("more free than installed".into());
        }
        if self.gpus.iter().any(|&g| g > MILLI_PER_GPU) {
            return Err("a GPU with more than 1000 milli free".into());
        }
        Ok(())
    }
}

/// What one placed task holds on one node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    pub node: NodeId,
    /// GPUs held (bit g = GPU g of the node).
    pub gpus: u64,
    /// Thousandths held on each of those GPUs.
    pub gpu_milli: u32,
    pub cpu_milli: u32,
    pub memory_mib: u64,
}

impl Allocation {
    /// The allocation's kind bit (shared GPU, k whole GPUs), if it holds GPUs.
    pub fn kind(&self) -> Option<u32> {
        berth_sdk::alloc_kind_bit(self.gpus.count_ones(), self.gpu_milli)
    }

    pub fn gpu_milli_total(&self) -> u64 {
        u64::from(self.gpus.count_ones()) * u64::from(self.gpu_milli)
    }
}

/// The fleet: GPU model names and nodes. Totals are kept incrementally so
/// accounting is O(1) per event.
#[derive(Debug)]
pub struct Fleet {
    pub models: Vec<String>,
    nodes: Vec<Node>,
    gpu_total_milli: u64,
    gpu_allocated_milli: u64,
    /// The outstanding allocations (how many of each), on a tracked fleet
    /// (the live host's): a release must name one of them.
    ledger: Option<HashMap<Allocation, u32>>,
    /// The sum of every node's [`node_digest`], kept as nodes change: a
    /// digest of the whole fleet's state in O(1) (a decision log records
    /// one per decision; hashing 20,000 nodes each time cost milliseconds).
    digest: u64,
    /// Each node's free capacity in a few bytes, side by side, kept as the
    /// node changes: a scan for the nodes a shape may fit reads 24 bytes a
    /// node instead of the node (and its GPU list elsewhere in memory).
    free: Vec<FreeSummary>,
    /// How many node changes this fleet has seen, and when (by that count)
    /// each node last changed: a view derived from the fleet catches up by
    /// the nodes changed since it was made ([`Fleet::changed_since`]).
    changes: u64,
    changed_at: Vec<u64>,
    /// This fleet's identity for such views: a clone is a new fleet (it
    /// goes its own way from here), so a view never mistakes it for the
    /// fleet it was made from.
    lineage: u64,
}

/// A new fleet identity ([`Fleet::lineage`]).
fn next_lineage() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Default for Fleet {
    fn default() -> Fleet {
        Fleet::new(Vec::new(), Vec::new()).expect("an empty fleet is valid")
    }
}

/// What is free on one node, in brief: enough to rule a node out for a
/// shape without reading the node ([`FreeSummary::may_fit`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeSummary {
    pub memory_free_mib: u64,
    pub cpu_free_milli: u32,
    /// The largest free share of any one GPU (thousandths).
    pub max_gpu_free: u32,
    /// GPUs with nothing allocated.
    pub idle_gpus: u16,
    /// Free thousandths of all its GPUs together ([`Node::gpu_free_milli`]).
    pub gpu_free_milli: u32,
    pub gpus: u16,
    pub schedulable: bool,
}

impl FreeSummary {
    fn of(n: &Node) -> FreeSummary {
        FreeSummary {
            memory_free_mib: n.memory_free_mib,
            cpu_free_milli: n.cpu_free_milli,
            max_gpu_free: n.gpus.iter().copied().max().unwrap_or(0),
            idle_gpus: n.gpus.iter().filter(|&&g| g == MILLI_PER_GPU).count() as u16,
            gpu_free_milli: n.gpus.iter().sum(),
            gpus: n.gpus.len() as u16,
            schedulable: n.schedulable,
        }
    }

    /// False only where the predicate would refuse `shape` on this node
    /// (schedulable, CPU, memory, GPU count and free shares): a necessary
    /// condition, so filtering by it first changes no decision.
    pub fn may_fit(&self, shape: &crate::task::TaskShape) -> bool {
        if !self.schedulable || self.cpu_free_milli < shape.cpu_milli || self.memory_free_mib < shape.memory_mib {
            return false;
        }
        if shape.gpu_count == 0 {
            return true;
        }
        if u32::from(self.gpus) < shape.gpu_count || self.max_gpu_free < shape.gpu_milli {
            return false;
        }
        // Whole GPUs: that many idle ones.
        shape.gpu_milli < MILLI_PER_GPU || u32::from(self.idle_gpus) >= shape.gpu_count
    }
}

/// A node's state (schedulable, free CPU, memory and GPU capacity) and id,
/// mixed into 64 bits: deterministic across runs and machines.
fn node_digest(id: usize, n: &Node) -> u64 {
    // splitmix64's finaliser over each field, chained.
    fn mix(h: u64, v: u64) -> u64 {
        let mut z = (h ^ v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let mut h = mix(id as u64, u64::from(n.schedulable));
    h = mix(h, u64::from(n.cpu_free_milli));
    h = mix(h, n.memory_free_mib);
    for &g in &n.gpus {
        h = mix(h, u64::from(g));
    }
    h
}

/// A clone is a scratch view (a trial placement, a quote): it checks
/// capacity only, and does not copy the ledger.
impl Clone for Fleet {
    fn clone(&self) -> Fleet {
        Fleet {
            models: self.models.clone(),
            nodes: self.nodes.clone(),
            gpu_total_milli: self.gpu_total_milli,
            gpu_allocated_milli: self.gpu_allocated_milli,
            ledger: None,
            digest: self.digest,
            free: self.free.clone(),
            changes: self.changes,
            changed_at: self.changed_at.clone(),
            lineage: next_lineage(),
        }
    }

    /// The same scratch view, in this fleet's memory.
    fn clone_from(&mut self, source: &Fleet) {
        self.models.clone_from(&source.models);
        self.nodes.clone_from(&source.nodes);
        self.gpu_total_milli = source.gpu_total_milli;
        self.gpu_allocated_milli = source.gpu_allocated_milli;
        self.ledger = None;
        self.digest = source.digest;
        self.free.clone_from(&source.free);
        self.changes = source.changes;
        self.changed_at.clone_from(&source.changed_at);
        self.lineage = next_lineage();
    }
}

impl Fleet {
    /// Builds a fleet, checking every node.
    pub fn new(models: Vec<String>, nodes: Vec<Node>) -> Result<Fleet, FleetError> {
        let mut gpu_total_milli = 0;
        let mut gpu_allocated_milli = 0;
        for node in &nodes {
            node.check().map_err(|reason| FleetError::InvalidNode { name: node.name.clone(), reason })?;
            if let Some(m) = node.model
                && m as usize >= models.len()
            {
                return Err(FleetError::InvalidNode { name: node.name.clone(), reason: format!("model index {m} unknown") });
            }
            gpu_total_milli += node.gpu_total_milli();
            gpu_allocated_milli += node.gpu_total_milli() - node.gpu_free_milli();
        }
        let digest = nodes.iter().enumerate().fold(0u64, |d, (i, n)| d.wrapping_add(node_digest(i, n)));
        let free = nodes.iter().map(FreeSummary::of).collect();
        let changed_at = vec![0; nodes.len()];
        Ok(Fleet { models, nodes, gpu_total_milli, gpu_allocated_milli, ledger: None, digest, free, changes: 0, changed_at, lineage: next_lineage() })
    }

    /// From now on every allocation is recorded and a release must match
    /// an outstanding one (a double release fails even where capacity
    /// would allow it). For a fleet with nothing allocated yet.
    pub fn track_allocations(&mut self) {
        debug_assert_eq!(self.gpu_allocated_milli, 0, "tracking starts on an empty fleet");
        self.ledger = Some(HashMap::new());
    }

    /// A node added (`id` None: it gets the next id) or an idle one
    /// redefined, checking only it: the other nodes and the outstanding
    /// allocations carry over, and the totals follow. A live host adds
    /// agent nodes one at a time; rebuilding the fleet for each would cost
    /// the whole fleet per registration. `models` must extend the current
    /// list (an added model at its end).
    pub fn put_node(&mut self, models: Vec<String>, id: Option<NodeId>, node: Node) -> Result<NodeId, FleetError> {
        node.check().map_err(|reason| FleetError::InvalidNode { name: node.name.clone(), reason })?;
        if let Some(m) = node.model
            && m as usize >= models.len()
        {
            return Err(FleetError::InvalidNode { name: node.name.clone(), reason: format!("model index {m} unknown") });
        }
        if models.len() < self.models.len() || models[..self.models.len()] != self.models[..] {
            return Err(FleetError::InvalidNode { name: node.name.clone(), reason: "the model list may only grow at its end".into() });
        }
        let (total, allocated) = (node.gpu_total_milli(), node.gpu_total_milli() - node.gpu_free_milli());
        let (id, before) = match id {
            Some(id) => {
                let old = self.nodes.get_mut(id as usize).ok_or(FleetError::UnknownNode(id))?;
                self.gpu_total_milli -= old.gpu_total_milli();
                self.gpu_allocated_milli -= old.gpu_total_milli() - old.gpu_free_milli();
                let before = node_digest(id as usize, old);
                *old = node;
                (id, before)
            }
            None => {
                self.nodes.push(node);
                self.free.push(FreeSummary::default());
                self.changed_at.push(0);
                ((self.nodes.len() - 1) as NodeId, 0)
            }
        };
        self.node_changed(id as usize, before);
        self.gpu_total_milli += total;
        self.gpu_allocated_milli += allocated;
        self.models = models;
        Ok(id)
    }

    /// How many allocations are outstanding, on a tracked fleet.
    pub fn outstanding(&self) -> Option<usize> {
        self.ledger.as_ref().map(|l| l.values().map(|&n| n as usize).sum())
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `id` changed (it had digest `before`; 0 for a node just added):
    /// the fleet's digest and the node's free summary follow.
    fn node_changed(&mut self, id: usize, before: u64) {
        let node = &self.nodes[id];
        self.digest = self.digest.wrapping_sub(before).wrapping_add(node_digest(id, node));
        self.free[id] = FreeSummary::of(node);
        self.changes += 1;
        self.changed_at[id] = self.changes;
    }

    /// This fleet's identity: unique to it among the fleets of the
    /// process (a clone gets its own).
    pub fn lineage(&self) -> u64 {
        self.lineage
    }

    /// How many node changes (allocations, releases, cordons, nodes put)
    /// this fleet has seen: a mark for [`Fleet::changed_since`].
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// The nodes changed after mark `since` (a [`Fleet::changes`] value).
    pub fn changed_since(&self, since: u64) -> impl Iterator<Item = NodeId> + '_ {
        self.changed_at.iter().enumerate().filter(move |&(_, &at)| at > since).map(|(id, _)| id as NodeId)
    }

    /// Makes node `id` what it is in `source` (a fleet with the same node
    /// ids and models), keeping the totals, digest and free summary.
    pub fn copy_node_from(&mut self, source: &Fleet, id: NodeId) -> Result<(), FleetError> {
        let (Some(node), Some(from)) = (self.nodes.get_mut(id as usize), source.nodes.get(id as usize)) else {
            return Err(FleetError::UnknownNode(id));
        };
        let before = node_digest(id as usize, node);
        self.gpu_total_milli -= node.gpu_total_milli();
        self.gpu_allocated_milli -= node.gpu_total_milli() - node.gpu_free_milli();
        node.clone_from(from);
        self.gpu_total_milli += node.gpu_total_milli();
        self.gpu_allocated_milli += node.gpu_total_milli() - node.gpu_free_milli();
        self.node_changed(id as usize, before);
        Ok(())
    }

    /// Each node's free capacity in brief, by node id (see
    /// [`FreeSummary::may_fit`]).
    pub fn free_summaries(&self) -> &[FreeSummary] {
        &self.free
    }

    /// A digest of every node's state (schedulable, free capacity), kept
    /// as the fleet changes: equal fleets have equal digests. Not a
    /// cryptographic hash: it names an input in a decision log.
    pub fn state_digest(&self) -> u64 {
        self.digest
    }

    /// Records what node `id`'s agent measured (`None`: nothing measures
    /// it now). The node counts as changed only when the measurement moved
    /// enough to matter ([`Measured::differs`]) or appeared or went away.
    pub fn set_measured(&mut self, id: NodeId, measured: Option<Measured>) -> Result<(), FleetError> {
        let node = self.nodes.get_mut(id as usize).ok_or(FleetError::UnknownNode(id))?;
        let moved = match (&node.measured, &measured) {
            (Some(a), Some(b)) => a.differs(b),
            (None, None) => false,
            _ => true,
        };
        if moved {
            let before = node_digest(id as usize, node);
            node.measured = measured;
            self.node_changed(id as usize, before);
        }
        Ok(())
    }

    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id as usize)
    }

    /// Model id by name.
    pub fn model_id(&self, name: &str) -> Option<ModelId> {
        self.models.iter().position(|m| m == name).map(|i| i as ModelId)
    }

    /// Cordons or uncordons a node (unhealthy or drained nodes take no work).
    pub fn set_schedulable(&mut self, id: NodeId, schedulable: bool) -> Result<(), FleetError> {
        let node = self.nodes.get_mut(id as usize).ok_or(FleetError::UnknownNode(id))?;
        let before = node_digest(id as usize, node);
        node.schedulable = schedulable;
        self.node_changed(id as usize, before);
        Ok(())
    }

    /// Milli-GPU installed on the whole fleet.
    pub fn gpu_total_milli(&self) -> u64 {
        self.gpu_total_milli
    }

    /// Milli-GPU currently allocated.
    pub fn gpu_allocated_milli(&self) -> u64 {
        self.gpu_allocated_milli
    }

    /// Takes `alloc` out of its node's free capacity. Checks everything
    /// first; on error nothing has changed.
    pub fn allocate(&mut self, alloc: &Allocation) -> Result<(), FleetError> {
        let node = self.nodes.get_mut(alloc.node as usize).ok_or(FleetError::UnknownNode(alloc.node))?;
        check_mask(alloc.node, node, alloc.gpus)?;
        if node.cpu_free_milli < alloc.cpu_milli {
            return Err(FleetError::OverCommit { node: alloc.node, what: "CPU" });
        }
        if node.memory_free_mib < alloc.memory_mib {
            return Err(FleetError::OverCommit { node: alloc.node, what: "memory" });
        }
        if gpus_of(alloc.gpus).any(|g| node.gpus[g] < alloc.gpu_milli) {
            return Err(FleetError::OverCommit { node: alloc.node, what: "GPU" });
        }
        let before = node_digest(alloc.node as usize, node);
        node.cpu_free_milli -= alloc.cpu_milli;
        node.memory_free_mib -= alloc.memory_mib;
        for g in gpus_of(alloc.gpus) {
            node.gpus[g] -= alloc.gpu_milli;
        }
        match alloc.kind() {
            Some(k) => node.kind_counts[k as usize] += 1,
            None => node.cpu_only_milli += alloc.cpu_milli,
        }
        self.gpu_allocated_milli += alloc.gpu_milli_total();
        debug_assert!(node.check().is_ok(), "{:?}", node.check());
        self.node_changed(alloc.node as usize, before);
        if let Some(ledger) = &mut self.ledger {
            *ledger.entry(alloc.clone()).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Returns many allocations, each checked as [`Fleet::release`] does,
    /// with each node's digest and free summary brought up to date once at
    /// the end rather than per allocation (a view without low-priority work
    /// returns tens of thousands per pass). On error, those before it are
    /// returned and the fleet is consistent.
    pub fn release_all<'a>(&mut self, allocs: impl IntoIterator<Item = &'a Allocation>) -> Result<(), FleetError> {
        let mut before: Vec<(usize, u64)> = Vec::new();
        let mut touched = vec![false; self.nodes.len()];
        let mut result = Ok(());
        for alloc in allocs {
            let id = alloc.node as usize;
            if let Some(node) = self.nodes.get(id)
                && !touched[id]
            {
                touched[id] = true;
                before.push((id, node_digest(id, node)));
            }
            if let Err(e) = self.release_unsummarized(alloc) {
                result = Err(e);
                break;
            }
        }
        for (id, digest) in before {
            self.node_changed(id, digest);
        }
        result
    }

    /// Returns `alloc` to its node. Checks first; on error nothing changed.
    pub fn release(&mut self, alloc: &Allocation) -> Result<(), FleetError> {
        let id = alloc.node as usize;
        let before = self.nodes.get(id).map(|n| node_digest(id, n)).unwrap_or(0);
        self.release_unsummarized(alloc)?;
        self.node_changed(id, before);
        Ok(())
    }

    /// [`Fleet::release`] but for the node's digest and free summary.
    fn release_unsummarized(&mut self, alloc: &Allocation) -> Result<(), FleetError> {
        if let Some(ledger) = &self.ledger
            && !ledger.contains_key(alloc)
        {
            return Err(FleetError::NotOutstanding { node: alloc.node, gpus: alloc.gpus, gpu_milli: alloc.gpu_milli });
        }
        let node = self.nodes.get_mut(alloc.node as usize).ok_or(FleetError::UnknownNode(alloc.node))?;
        check_mask(alloc.node, node, alloc.gpus)?;
        if node.cpu_total_milli - node.cpu_free_milli < alloc.cpu_milli {
            return Err(FleetError::NotAllocated { node: alloc.node, what: "CPU" });
        }
        if node.memory_total_mib - node.memory_free_mib < alloc.memory_mib {
            return Err(FleetError::NotAllocated { node: alloc.node, what: "memory" });
        }
        if gpus_of(alloc.gpus).any(|g| MILLI_PER_GPU - node.gpus[g] < alloc.gpu_milli) {
            return Err(FleetError::NotAllocated { node: alloc.node, what: "GPU" });
        }
        if let Some(k) = alloc.kind() {
            if node.kind_counts[k as usize] == 0 {
                return Err(FleetError::NotAllocated { node: alloc.node, what: "allocation of this kind" });
            }
            node.kind_counts[k as usize] -= 1;
        } else {
            if node.cpu_only_milli < alloc.cpu_milli {
                return Err(FleetError::NotAllocated { node: alloc.node, what: "CPU of CPU-only work" });
            }
            node.cpu_only_milli -= alloc.cpu_milli;
        }
        node.cpu_free_milli += alloc.cpu_milli;
        node.memory_free_mib += alloc.memory_mib;
        for g in gpus_of(alloc.gpus) {
            node.gpus[g] += alloc.gpu_milli;
        }
        self.gpu_allocated_milli -= alloc.gpu_milli_total();
        debug_assert!(node.check().is_ok(), "{:?}", node.check());
        if let Some(ledger) = &mut self.ledger
            && let Some(n) = ledger.get_mut(alloc)
        {
            *n -= 1;
            if *n == 0 {
                ledger.remove(alloc);
            }
        }
        Ok(())
    }

    /// Recomputes every invariant from scratch (for tests and debug checks):
    /// nothing over-committed, totals consistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut allocated = 0;
        for node in &self.nodes {
            node.check().map_err(|e| format!("node {}: {e}", node.name))?;
            allocated += node.gpu_total_milli() - node.gpu_free_milli();
        }
        if allocated != self.gpu_allocated_milli {
            return Err(format!("allocated total {} != sum over nodes {allocated}", self.gpu_allocated_milli));
        }
        let digest = self.nodes.iter().enumerate().fold(0u64, |d, (i, n)| d.wrapping_add(node_digest(i, n)));
        if digest != self.digest {
            return Err(format!("state digest {:016x} != sum over nodes {digest:016x}", self.digest));
        }
        if let Some((n, _)) = self.nodes.iter().zip(&self.free).find(|(n, f)| FreeSummary::of(n) != **f) {
            return Err(format!("node {}: its free summary is out of date", n.name));
        }
        if self.free.len() != self.nodes.len() || self.changed_at.len() != self.nodes.len() {
            return Err(format!("{} free summaries and {} change marks for {} nodes", self.free.len(), self.changed_at.len(), self.nodes.len()));
        }
        if let Some(ledger) = &self.ledger {
            // What each node has in use is exactly its outstanding allocations.
            let mut used: Vec<(u64, u64, Vec<u32>)> = self.nodes.iter().map(|n| (0, 0, vec![0; n.gpus.len()])).collect();
            for (a, &count) in ledger {
                let u = used.get_mut(a.node as usize).ok_or_else(|| format!("an outstanding allocation on unknown node {}", a.node))?;
                u.0 += u64::from(a.cpu_milli) * u64::from(count);
                u.1 += a.memory_mib * u64::from(count);
                for g in gpus_of(a.gpus) {
                    *u.2.get_mut(g).ok_or_else(|| format!("an outstanding allocation on GPU {g} of node {}, which it lacks", a.node))? += a.gpu_milli * count;
                }
            }
            for (n, (cpu, memory, gpus)) in self.nodes.iter().zip(used) {
                let in_use: Vec<u32> = n.gpus.iter().map(|&free| MILLI_PER_GPU - free).collect();
                if cpu != u64::from(n.cpu_total_milli - n.cpu_free_milli) || memory != n.memory_total_mib - n.memory_free_mib || gpus != in_use {
                    return Err(format!(
                        "node {}: in use (CPU {}, memory {}, GPUs {in_use:?}) is not its outstanding allocations (CPU {cpu}, memory {memory}, GPUs {gpus:?})",
                        n.name,
                        n.cpu_total_milli - n.cpu_free_milli,
                        n.memory_total_mib - n.memory_free_mib
                    ));
                }
            }
        }
        Ok(())
    }

    /// An allocation of `shape` on `node` using the GPUs in `mask`.
    pub fn allocation(node: NodeId, shape: &TaskShape, mask: u64) -> Allocation {
        Allocation { node, gpus: mask, gpu_milli: shape.gpu_milli, cpu_milli: shape.cpu_milli, memory_mib: shape.memory_mib }
    }
}

fn check_mask(id: NodeId, node: &Node, mask: u64) -> Result<(), FleetError> {
    let gpus = node.gpus.len();
    if gpus < 64 && mask >> gpus != 0 {
        return Err(FleetError::UnknownGpu { node: id, gpus, mask });
    }
    Ok(())
}

/// The id of model `name` in a model table being built, adding it if new.
pub fn intern_model(models: &mut Vec<String>, name: &str) -> ModelId {
    match models.iter().position(|m| m == name) {
        Some(i) => i as ModelId,
        None => {
            models.push(name.to_string());
            (models.len() - 1) as ModelId
        }
    }
}

/// GPU indexes named by a mask, lowest first.
pub fn gpus_of(mask: u64) -> impl Iterator<Item = usize> {
    (0..64usize).filter(move |g| mask & (1u64 << g) != 0)
}
