//! "What would let it start": for a job that cannot start now, the
//! smallest change of each kind that would let it, with what the change
//! costs, computed on copies of the fleet and never acted on. Three kinds:
//! stop lower-priority work (the work it would lose), move movable tasks
//! off nodes to other nodes of their GPU model (the state it would copy),
//! bring unschedulable nodes back (the nodes to repair).

use crate::capacity::{fitting_tasks_among, tasks_on_node};
use crate::fleet::{gpus_of, Allocation, Fleet, Node, NodeId};
use crate::job::Job;
use crate::task::TaskShape;

/// A running job as the what-if sees it.
pub struct Running<'a> {
    pub job_id: u64,
    pub priority: u32,
    /// Its allocations now.
    pub allocations: &'a [Allocation],
    /// The host may stop it for higher-priority work (not guaranteed, not
    /// in a non-preemptible partition, under its daily interruption cap).
    pub stoppable: bool,
    /// GPU-seconds of work a stop now would lose (since its last
    /// checkpoint).
    pub lost_gpu_s: f64,
    /// Live compaction may move its tasks, and the bytes of state one
    /// task's move copies.
    pub movable: bool,
    pub state_bytes_per_task: u64,
}

/// One change that would let the job start now.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Stop these jobs: the fewest lost GPU-seconds among the walks
    /// (cheapest first, the shortest prefix that makes room, then every one
    /// the room does not need given back) over all stoppable work and over
    /// each node's alone.
    Preempt { jobs: Vec<u64>, lost_gpu_s: f64 },
    /// Move these tasks (job, allocation's node, to node), copying `bytes`.
    Move { moves: Vec<(u64, NodeId, NodeId)>, bytes: u64 },
    /// Make these unschedulable nodes schedulable again.
    Repair { nodes: Vec<NodeId> },
}

/// The changes, one per kind that works (in the order preempt, move,
/// repair), for `job` on the nodes `keep` accepts (its scope; schedulable
/// or not); moved tasks go only to nodes `destinations` accepts. Empty
/// when the job fits now or nothing of the three helps.
pub fn what_would_let_it_start(fleet: &Fleet, job: &Job, keep: &dyn Fn(NodeId, &Node) -> bool, destinations: &dyn Fn(NodeId, &Node) -> bool, running: &[Running]) -> Vec<Change> {
    let shape = &job.shape;
    let tasks = job.tasks.max(1);
    let usable = |id: NodeId, n: &Node| keep(id, n) && (shape.gpu_count == 0 || shape.accepts(n.model));
    if fitting_tasks_among(fleet, shape, tasks, &usable) >= tasks {
        return Vec::new();
    }
    let mut changes = Vec::new();
    if let Some(c) = preempt(fleet, job, &usable, running) {
        changes.push(c);
    }
    if let Some(c) = moves(fleet, job, destinations, &usable, running) {
        changes.push(c);
    }
    if let Some(c) = repair(fleet, shape, tasks, &usable) {
        changes.push(c);
    }
    changes
}

fn preempt(fleet: &Fleet, job: &Job, usable: &dyn Fn(NodeId, &Node) -> bool, running: &[Running]) -> Option<Change> {
    let mut candidates: Vec<&Running> = running.iter().filter(|r| r.stoppable && r.priority < job.priority && r.allocations.iter().any(|a| usable(a.node, &fleet.nodes()[a.node as usize]))).collect();
    candidates.sort_by(|a, b| a.lost_gpu_s.total_cmp(&b.lost_gpu_s).then(a.job_id.cmp(&b.job_id)));
    // The walk over every candidate, cheapest first, and the same walk
    // confined to the work of each node: the cheapest answer wins. The
    // first alone can stop two young jobs that fill one node where one
    // older job beside a hole would do, and which it names then turns on
    // seconds of run time.
    let mut nodes: Vec<NodeId> = candidates.iter().flat_map(|r| r.allocations.iter().map(|a| a.node)).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let subsets = std::iter::once(None).chain(nodes.into_iter().map(Some));
    let mut best: Option<(f64, Vec<u64>)> = None;
    for node in subsets {
        let subset: Vec<&Running> = candidates.iter().copied().filter(|r| node.is_none_or(|n| r.allocations.iter().any(|a| a.node == n))).collect();
        // Any stop it names loses at least its cheapest job: a subset that
        // cannot beat the best so far is not walked (each walk copies the
        // fleet).
        if let (Some((l, _)), Some(first)) = (&best, subset.first())
            && first.lost_gpu_s > *l
        {
            continue;
        }
        let ranked: Vec<&[Allocation]> = subset.iter().map(|r| r.allocations).collect();
        let Some(picked) = crate::preemption::choose_victims(fleet, &job.shape, job.tasks.max(1), usable, &ranked) else { continue };
        let lost: f64 = picked.iter().map(|&k| subset[k].lost_gpu_s).sum();
        let mut jobs: Vec<u64> = picked.iter().map(|&k| subset[k].job_id).collect();
        jobs.sort_unstable();
        // Least work lost, then fewest jobs, then the lowest ids.
        let better = best.as_ref().is_none_or(|(l, j)| lost.total_cmp(l).then(jobs.len().cmp(&j.len())).then_with(|| jobs.cmp(j)).is_lt());
        if better {
            best = Some((lost, jobs));
        }
    }
    best.map(|(lost_gpu_s, jobs)| Change::Preempt { jobs, lost_gpu_s })
}

/// The shape of one task from its allocation (what a move must find room
/// for elsewhere).
fn shape_of(fleet: &Fleet, a: &Allocation) -> TaskShape {
    let node = &fleet.nodes()[a.node as usize];
    TaskShape {
        gpu_count: gpus_of(a.gpus).count() as u32,
        gpu_milli: a.gpu_milli,
        cpu_milli: a.cpu_milli,
        memory_mib: a.memory_mib,
        models: node.model.into_iter().collect(),
    }
}

/// Empties nodes of their movable tasks, cheapest node first, each task to
/// another node of its GPU model that fits it, until the job fits.
fn moves(fleet: &Fleet, job: &Job, destinations: &dyn Fn(NodeId, &Node) -> bool, usable: &dyn Fn(NodeId, &Node) -> bool, running: &[Running]) -> Option<Change> {
    let shape = &job.shape;
    let tasks = job.tasks.max(1);
    // Movable tasks by node, with their job and bytes.
    let mut on: std::collections::BTreeMap<NodeId, Vec<(u64, &Allocation, u64)>> = Default::default();
    for r in running.iter().filter(|r| r.movable) {
        for a in r.allocations {
            on.entry(a.node).or_default().push((r.job_id, a, r.state_bytes_per_task));
        }
    }
    let mut order: Vec<(u64, NodeId)> = on.iter().filter(|(id, _)| usable(**id, &fleet.nodes()[**id as usize])).map(|(id, t)| (t.iter().map(|x| x.2).sum::<u64>(), *id)).collect();
    order.sort_unstable();
    // One copy of the fleet: a node whose tasks cannot all move (or whose
    // emptying does not make room) is put back as it was.
    let mut scratch = fleet.clone();
    let mut planned = Vec::new();
    let mut bytes = 0u64;
    let mut emptied: Vec<NodeId> = Vec::new();
    for (_, id) in order {
        let mut released: Vec<&Allocation> = Vec::new();
        let mut placed: Vec<(Allocation, u64, u64)> = Vec::new();
        let mut ok = true;
        for &(job_id, a, b) in &on[&id] {
            if scratch.release(a).is_err() {
                ok = false;
                break;
            }
            released.push(a);
            let task = shape_of(fleet, a);
            // Elsewhere on its own GPU model, never onto a node being
            // emptied for the job.
            let to = (0..scratch.nodes().len() as NodeId).find(|&t| t != id && !emptied.contains(&t) && destinations(t, &scratch.nodes()[t as usize]) && tasks_on_node(&scratch.nodes()[t as usize], &task) > 0);
            let Some(to) = to else {
                ok = false;
                break;
            };
            let moved = Fleet::allocation(to, &task, crate::placement::default_gpus(&scratch.nodes()[to as usize], &task));
            if scratch.allocate(&moved).is_err() {
                ok = false;
                break;
            }
            placed.push((moved, job_id, b));
        }
        if !ok || tasks_on_node(&scratch.nodes()[id as usize], shape) == 0 {
            for (moved, _, _) in placed.iter().rev() {
                scratch.release(moved).expect("just allocated");
            }
            for a in released.iter().rev() {
                scratch.allocate(a).expect("just released");
            }
            continue;
        }
        planned.extend(placed.iter().map(|(moved, job_id, _)| (*job_id, id, moved.node)));
        bytes += placed.iter().map(|p| p.2).sum::<u64>();
        emptied.push(id);
        if fitting_tasks_among(&scratch, shape, tasks, usable) >= tasks {
            return Some(Change::Move { moves: planned, bytes });
        }
    }
    None
}

/// The fewest unschedulable nodes (most room for the job first) whose
/// return lets the job fit.
fn repair(fleet: &Fleet, shape: &TaskShape, tasks: u32, usable: &dyn Fn(NodeId, &Node) -> bool) -> Option<Change> {
    let mut down: Vec<(u32, NodeId)> = fleet
        .nodes()
        .iter()
        .enumerate()
        .filter(|(id, n)| !n.schedulable && usable(*id as NodeId, n))
        .map(|(id, n)| {
            let mut up = n.clone();
            up.schedulable = true;
            (tasks_on_node(&up, shape), id as NodeId)
        })
        .filter(|&(t, _)| t > 0)
        .collect();
    down.sort_by_key(|&(t, id)| (std::cmp::Reverse(t), id));
    let mut scratch = fleet.clone();
    let mut nodes = Vec::new();
    for (_, id) in down {
        scratch.set_schedulable(id, true).ok()?;
        nodes.push(id);
        if fitting_tasks_among(&scratch, shape, tasks, usable) >= tasks {
            nodes.sort_unstable();
            return Some(Change::Repair { nodes });
        }
    }
    None
}
