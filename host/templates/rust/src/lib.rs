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

    // Optional hooks, each with a default in berth_sdk::Policy: claim one in
    // HOOKS (e.g. `Hooks::SCORE.union(Hooks::POOL_PLACE)`) and override it;
    // `berth policy test` then checks it too.
    //   fn score_domains(&mut self, task: &Task, domains: &Domains) -> Result<Vec<f64>, String>
    //   fn compact(&mut self, snapshot: &Snapshot) -> Result<Plan, String>
    //   fn rank(&mut self, demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String>
    // Contract 0.3.0, model pools (`berth replay --pool`):
    //   fn pool_place(&mut self, state: &PoolState) -> Result<PoolPlacement, String>
    //   fn pool_step(&mut self, executor: &PoolExecutor) -> Result<PoolStep, String>
}

berth_sdk::export!(ThisPolicy);
