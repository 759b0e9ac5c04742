//! spread: place on the emptiest node, to keep load and failure blast radius
//! even. A shared task goes to the GPU with the most free.

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct Spread;

impl Policy for Spread {
    const NAME: &'static str = "spread";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let mut scores = Vec::with_capacity(nodes.len());
        let mut gpus = Vec::with_capacity(nodes.len());
        for node in nodes.iter() {
            let gpu_total = 1000.0 * node.gpu_count() as f64;
            let gpu_free = if gpu_total > 0.0 { node.gpu_free_total() as f64 / gpu_total } else { 1.0 };
            let cpu_free = node.cpu_free_milli as f64 / node.cpu_total_milli.max(1) as f64;
            scores.push(100.0 * gpu_free + 10.0 * cpu_free);
            // Shared tasks go to the emptiest fitting GPU; whole GPUs: host default.
            let mask = if task.gpu_count == 1 && task.gpu_milli < 1000 {
                node.gpu_free_milli
                    .iter()
                    .enumerate()
                    .filter(|&(_, &f)| f >= task.gpu_milli)
                    .max_by_key(|&(g, &f)| (f, std::cmp::Reverse(g)))
                    .map_or(0, |(g, _)| 1u64 << g)
            } else {
                0
            };
            gpus.push(mask);
        }
        Ok(Scores { scores, gpus })
    }
}

berth_sdk::export!(Spread);
