//! Capacity counters: how many tasks of a shape a node, a switch domain or
//! the fleet could hold right now. Shared by the engine, preemption,
//! compaction, accounting and the live host.

use std::collections::BTreeMap;

use crate::fleet::{Fleet, NodeId};
use crate::task::TaskShape;

/// How many tasks of `shape` one node could hold right now.
pub fn tasks_on_node(node: &crate::fleet::Node, shape: &TaskShape) -> u32 {
    if crate::predicate::check(node, shape).is_err() {
        return 0;
    }
    let by = |free: u64, want: u64| free.checked_div(want).unwrap_or(u64::MAX);
    let gpu = if shape.gpu_count == 0 {
        u64::MAX
    } else {
        let per_gpu = node.gpus.iter().map(|&f| u64::from(f / shape.gpu_milli.max(1))).sum::<u64>();
        per_gpu / u64::from(shape.gpu_count)
    };
    let n = gpu.min(by(u64::from(node.cpu_free_milli), u64::from(shape.cpu_milli))).min(by(node.memory_free_mib, shape.memory_mib));
    n.min(u64::from(u32::MAX)) as u32
}

/// The switch domains as a gang of `shape` sees them (see the WIT
/// `domains`), sorted by domain id, and the total tasks that fit.
pub fn domain_table(fleet: &Fleet, shape: &TaskShape) -> (berth_sdk::Domains, u64) {
    domain_table_among(fleet, shape, &|_, _| true)
}

/// [`domain_table`] counting only the nodes `keep` accepts.
pub fn domain_table_among(fleet: &Fleet, shape: &TaskShape, keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool) -> (berth_sdk::Domains, u64) {
    let mut by_domain: BTreeMap<u32, [u64; 6]> = Default::default();
    for (id, node) in fleet.nodes().iter().enumerate() {
        if !node.schedulable || (shape.gpu_count > 0 && !shape.accepts(node.model)) || !keep(id as NodeId, node) {
            continue;
        }
        let e = by_domain.entry(node.switch_domain).or_insert([u64::from(node.aggregation), 0, 0, 0, 0, 0]);
        e[1] += 1;
        e[2] += u64::from(node.is_idle());
        e[3] += node.gpus.len() as u64;
        e[4] += node.gpus.iter().filter(|&&g| g == crate::units::MILLI_PER_GPU).count() as u64;
        e[5] += u64::from(tasks_on_node(node, shape));
    }
    let mut d = berth_sdk::Domains::default();
    let mut total = 0;
    for (id, v) in by_domain {
        let c = |x: u64| x.min(u64::from(u32::MAX)) as u32;
        d.ids.push(id);
        d.aggregation.push(c(v[0]));
        d.nodes.push(c(v[1]));
        d.idle_nodes.push(c(v[2]));
        d.gpus_total.push(c(v[3]));
        d.gpus_idle.push(c(v[4]));
        d.fitting_tasks.push(c(v[5]));
        total += v[5];
    }
    (d, total)
}

/// How many tasks of `shape` the fleet could hold at most right now
/// (counting each node's capacity for several; stops counting at `enough`).
pub fn fitting_tasks(fleet: &Fleet, shape: &TaskShape, enough: u32) -> u32 {
    fitting_tasks_among(fleet, shape, enough, &|_, _| true)
}

/// [`fitting_tasks`] counting only the nodes `keep` accepts.
pub fn fitting_tasks_among(fleet: &Fleet, shape: &TaskShape, enough: u32, keep: &dyn Fn(NodeId, &crate::fleet::Node) -> bool) -> u32 {
    let mut total = 0u32;
    // A node its free summary rules out takes no task (tasks_on_node is 0).
    for (id, (node, free)) in fleet.nodes().iter().zip(fleet.free_summaries()).enumerate() {
        if !free.may_fit(shape) || !keep(id as NodeId, node) {
            continue;
        }
        let n = tasks_on_node(node, shape);
        total = total.saturating_add(n.min(enough));
        if total >= enough {
            return enough;
        }
    }
    total
}
