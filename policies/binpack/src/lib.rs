//! binpack: fill the fullest node that fits, so whole nodes stay free for
//! large jobs. On the chosen node, a shared task goes to the fitting GPU with
//! the least free (best fit) and whole-GPU tasks take idle GPUs lowest first.

use berth_sdk::{Hooks, NodeView, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct Binpack;

/// GPUs the task would use on `node`, as a mask, or 0 when it does not fit.
pub fn best_fit_gpus(task: &Task, node: &NodeView) -> u64 {
    if task.gpu_count == 0 {
        return 0;
    }
    if task.gpu_milli < 1000 {
        let mut best: Option<(u32, usize)> = None;
        for (g, &free) in node.gpu_free_milli.iter().enumerate() {
            if free >= task.gpu_milli && best.is_none_or(|(f, _)| free < f) {
                best = Some((free, g));
            }
        }
        return best.map_or(0, |(_, g)| 1u64 << g);
    }
    let mut mask = 0u64;
    let mut taken = 0;
    for (g, &free) in node.gpu_free_milli.iter().enumerate() {
        if taken == task.gpu_count {
            break;
        }
        if free == 1000 {
            mask |= 1u64 << g;
            taken += 1;
        }
    }
    if taken == task.gpu_count { mask } else { 0 }
}

/// Share of a node's GPU, CPU and memory that would be in use after placing
/// `task`, weighted so GPUs dominate: higher means fuller.
pub fn fullness_after(task: &Task, node: &NodeView) -> f64 {
    let gpu_total = 1000.0 * node.gpu_count() as f64;
    let gpu = if gpu_total > 0.0 {
        (gpu_total - node.gpu_free_total() as f64 + task.total_gpu_milli() as f64) / gpu_total
    } else {
        0.0
    };
    let cpu = 1.0 - (node.cpu_free_milli as f64 - task.cpu_milli as f64) / node.cpu_total_milli.max(1) as f64;
    let mem = 1.0 - (node.memory_free_mib as f64 - task.memory_mib as f64) / node.memory_total_mib.max(1) as f64;
    100.0 * gpu + 10.0 * cpu + mem
}

// ANCHOR: policy
impl Policy for Binpack {
    const NAME: &'static str = "binpack";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let mut scores = Vec::with_capacity(nodes.len());
        let mut gpus = Vec::with_capacity(nodes.len());
        for node in nodes.iter() {
            scores.push(fullness_after(task, &node));
            gpus.push(best_fit_gpus(task, &node));
        }
        Ok(Scores { scores, gpus })
    }
}

berth_sdk::export!(Binpack);
// ANCHOR_END: policy
