//! best-fit: the node left with the least free CPU and GPU after placing
//! the task, both normalised by the largest node spec (as the FGD paper's
//! BestFit baseline). Scores are truncated to whole points; ties fall to the
//! host's seeded order.

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default)]
pub struct BestFit {
    pub max_cpu_milli: f64,
    pub max_gpu_milli: f64,
}

impl Default for BestFit {
    fn default() -> Self {
        BestFit { max_cpu_milli: 128_000.0, max_gpu_milli: 8_000.0 }
    }
}

impl Policy for BestFit {
    const NAME: &'static str = "best-fit";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        if !config.trim().is_empty() {
            *self = serde_json::from_str(config).map_err(|e| format!("best-fit: bad configuration: {e}"))?;
        }
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let req_gpu = task.total_gpu_milli() as f64;
        let scores = nodes
            .iter()
            .map(|n| {
                let left = (f64::from(n.cpu_free_milli) - f64::from(task.cpu_milli)) / self.max_cpu_milli * 0.5
                    + (f64::from(n.gpu_free_total()) - req_gpu) / self.max_gpu_milli * 0.5;
                ((1.0 - left) * 100.0).trunc()
            })
            .collect();
        Ok(Scores::from_scores(scores))
    }
}

berth_sdk::export!(BestFit);
