//! Hard constraints, checked natively before any policy is asked.

use crate::fleet::Node;
use crate::task::TaskShape;

/// Why a node cannot take a task. Ordered as the checks run, so the first
/// reason is the one reported (and aggregated in "why pending" answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unfit {
    /// The node is cordoned or unhealthy.
    Unschedulable,
    /// The node's GPU model is not one the task accepts.
    ModelMismatch,
    /// Not enough free CPU.
    Cpu,
    /// Not enough free memory.
    Memory,
    /// The node has fewer GPUs than the task wants.
    GpuCount,
    /// Not enough GPUs with the wanted free share.
    GpuFree,
}

impl std::fmt::Display for Unfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unfit::Unschedulable => "node unschedulable",
            Unfit::ModelMismatch => "GPU model mismatch",
            Unfit::Cpu => "not enough CPU",
            Unfit::Memory => "not enough memory",
            Unfit::GpuCount => "too few GPUs",
            Unfit::GpuFree => "not enough free GPU",
        })
    }
}

/// Checks whether `node` can take `task` now.
pub fn check(node: &Node, task: &TaskShape) -> Result<(), Unfit> {
    if !node.schedulable {
        return Err(Unfit::Unschedulable);
    }
    if task.gpu_count > 0 && !task.accepts(node.model) {
        return Err(Unfit::ModelMismatch);
    }
    if node.cpu_free_milli < task.cpu_milli {
        return Err(Unfit::Cpu);
    }
    if node.memory_free_mib < task.memory_mib {
        return Err(Unfit::Memory);
    }
    if task.gpu_count == 0 {
        return Ok(());
    }
    if (node.gpus.len() as u32) < task.gpu_count {
        return Err(Unfit::GpuCount);
    }
    let fitting = node.gpus.iter().filter(|&&free| free >= task.gpu_milli).count() as u32;
    if fitting < task.gpu_count {
        return Err(Unfit::GpuFree);
    }
    Ok(())
}
