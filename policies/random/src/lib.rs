//! random: a uniformly random feasible node and, for a shared GPU, a
//! uniformly random fitting GPU on it (the FGD paper's Random baseline).
//! Seeded by the `seed` key of the configuration, so replays repeat.

use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};
use serde::Deserialize;

pub struct Random {
    state: u64,
}

impl Default for Random {
    fn default() -> Self {
        Random { state: 0x9E37_79B9_7F4A_7C15 }
    }
}

#[derive(Deserialize)]
struct Config {
    #[serde(default)]
    seed: u64,
}

impl Random {
    /// splitmix64: tiny, fast, and good enough for picking among nodes.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

impl Policy for Random {
    const NAME: &'static str = "random";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        if config.trim().is_empty() {
            return Ok(());
        }
        let c: Config = serde_json::from_str(config).map_err(|e| format!("random: bad configuration: {e}"))?;
        *self = Random::default();
        self.state ^= c.seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let n = nodes.len();
        let mut scores = vec![0.0; n];
        let mut gpus = vec![0u64; n];
        if n == 0 {
            return Ok(Scores { scores, gpus });
        }
        let chosen = self.below(n);
        scores[chosen] = 100.0;
        if task.gpu_count == 1 && task.gpu_milli < 1000 {
            let node = nodes.get(chosen);
            let fitting: Vec<usize> =
                node.gpu_free_milli.iter().enumerate().filter(|&(_, &f)| f >= task.gpu_milli).map(|(g, _)| g).collect();
            if !fitting.is_empty() {
                gpus[chosen] = 1u64 << fitting[self.below(fitting.len())];
            }
        }
        Ok(Scores { scores, gpus })
    }
}

berth_sdk::export!(Random);
