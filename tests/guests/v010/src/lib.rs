//! A policy built against contract 0.1.0: most free CPU wins, host picks GPUs.

wit_bindgen::generate!({
    path: "../../../wit/v0.1.0",
    world: "placement-policy",
});

use exports::berth::policy::policy::{Guest, PolicyInfo};
use berth::policy::types::{Allocations, Hooks, Nodes, Plan, Scores, Snapshot, Task};

struct V010;

impl Guest for V010 {
    fn info() -> PolicyInfo {
        PolicyInfo { name: "v010-most-free-cpu".into(), version: "0.1.0".into(), hooks: Hooks::SCORE }
    }
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }
    fn score(_task: Task, nodes: Nodes) -> Result<Scores, String> {
        Ok(Scores { scores: nodes.cpu_free_milli.iter().map(|&c| f64::from(c)).collect(), gpus: Vec::new() })
    }
    fn compact(_snapshot: Snapshot) -> Result<Plan, String> {
        Ok(Plan { chain: vec![], allocation: vec![], dest_node: vec![], dest_gpus: vec![] })
    }
    fn rank(_demand: Task, victims: Allocations) -> Result<Vec<u32>, String> {
        Ok((0..victims.ids.len() as u32).collect())
    }
}

export!(V010);
