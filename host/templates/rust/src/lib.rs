//! {{name}}: a Berth placement policy. Scores each candidate node for one
//! task; the host places on the highest score. This one packs: the node
//! left with the least free GPU after placing the task wins.

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct ThisPolicy;

impl Policy for ThisPolicy {
    const NAME: &'static str = "{{name}}";
    const VERSION: &'static str = "0.1.0";
    // The host calls only the hooks claimed here.
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let wanted = task.total_gpu_milli() as f64;
        // One finite score per node, in batch order; no GPU masks: the host
        // chooses the GPUs on the winning node.
        Ok(Scores::from_scores(nodes.iter().map(|n| -(f64::from(n.gpu_free_total()) - wanted)).collect()))
    }
}

berth_sdk::export!(ThisPolicy);
