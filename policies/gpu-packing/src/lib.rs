//! gpu-packing: prefer GPUs already shared, then partly used nodes, and
//! touch idle nodes last, smaller idle nodes first (the FGD paper's
//! GpuPacking baseline).

use berth_sdk::{Hooks, NodeView, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct GpuPacking;

/// The packing score of one node, 0..=100 (integer points).
pub fn packing_score(task: &Task, node: &NodeView) -> u32 {
    if task.gpu_count == 0 {
        return 0;
    }
    let gpus = node.gpu_free_milli;
    let idle = gpus.iter().filter(|&&f| f == 1000).count() as u32;
    if idle == gpus.len() as u32 {
        // A wholly idle node: the fewer GPUs it has, the better.
        return (33u32.saturating_sub(idle)).max(idle);
    }
    let mut order: Vec<usize> = (0..gpus.len()).collect();
    order.sort_by_key(|&g| gpus[g]); // stable: equal free keeps index order
    let mut taken = 0;
    let mut idle_used = 0;
    let mut shared_points = 0u32;
    for g in order {
        if taken == task.gpu_count {
            break;
        }
        if task.gpu_milli <= gpus[g] {
            taken += 1;
            if gpus[g] == 1000 {
                idle_used += 1;
            } else {
                shared_points += gpus[g] * 100 / 1000;
            }
        }
    }
    if idle_used > 0 { 50u32.saturating_sub(idle_used).max(33) } else { (100u32.saturating_sub(shared_points / 10)).max(50) }
}

impl Policy for GpuPacking {
    const NAME: &'static str = "gpu-packing";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        Ok(Scores::from_scores(nodes.iter().map(|n| f64::from(packing_score(task, &n))).collect()))
    }
}

berth_sdk::export!(GpuPacking);
