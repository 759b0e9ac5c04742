//! dotprod: Tetris-style alignment (Grandl et al., SIGCOMM'14) as the FGD
//! paper runs it. Node free vector and task demand vector over (CPU, GPU),
//! each normalised by the largest node spec in the fleet; the node with the
//! smallest dot product wins (score = 100 x (1 - dot / 2), truncated).

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default)]
pub struct DotProd {
    /// CPU normaliser: the largest node's CPU, milli-cores.
    pub max_cpu_milli: f64,
    /// GPU normaliser: the largest node's GPU, milli-GPU.
    pub max_gpu_milli: f64,
}

impl Default for DotProd {
    fn default() -> Self {
        DotProd { max_cpu_milli: 128_000.0, max_gpu_milli: 8_000.0 }
    }
}

impl Policy for DotProd {
    const NAME: &'static str = "dotprod";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        if !config.trim().is_empty() {
            *self = serde_json::from_str(config).map_err(|e| format!("dotprod: bad configuration: {e}"))?;
        }
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let pod_cpu = f64::from(task.cpu_milli) / self.max_cpu_milli;
        let pod_gpu = task.total_gpu_milli() as f64 / self.max_gpu_milli;
        let scores = nodes
            .iter()
            .map(|n| {
                let dot = f64::from(n.cpu_free_milli) / self.max_cpu_milli * pod_cpu
                    + f64::from(n.gpu_free_total()) / self.max_gpu_milli * pod_gpu;
                (100.0 * (1.0 - dot / 2.0)).trunc()
            })
            .collect();
        Ok(Scores::from_scores(scores))
    }
}

berth_sdk::export!(DotProd);
