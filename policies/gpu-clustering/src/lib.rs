//! gpu-clustering: put alike GPU work together (shared GPUs with shared
//! GPUs, 8-GPU jobs with 8-GPU jobs), fuller nodes first (the FGD paper's
//! GpuClustering baseline). Uses the nodes' `alloc-kinds` column.

use berth_sdk::{alloc_kind_bit, Hooks, NodeView, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct GpuClustering;

/// The clustering score of one node, 0..=100 (integer points).
pub fn clustering_score(task: &Task, node: &NodeView) -> u32 {
    let Some(kind) = alloc_kind_bit(task.gpu_count, task.gpu_milli) else {
        return 0; // CPU-only work has no GPU kind to cluster with.
    };
    // Fuller nodes score higher; the 8-GPU scale follows the paper's fleet.
    let used = 8000i64 - i64::from(node.gpu_free_total());
    let base = (25 * used / 8000).clamp(0, 25) as u32;
    let kinds = node.alloc_kinds;
    let mine = kinds & (1u64 << kind) != 0;
    base + match (mine, kinds.count_ones()) {
        (true, 1) => 75,
        (true, _) => 50,
        (false, 0) => 25,
        (false, _) => 0,
    }
}

impl Policy for GpuClustering {
    const NAME: &'static str = "gpu-clustering";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        Ok(Scores::from_scores(nodes.iter().map(|n| f64::from(clustering_score(task, &n))).collect()))
    }
}

berth_sdk::export!(GpuClustering);
