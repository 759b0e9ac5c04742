//! Shared by the core's integration tests.

use berth_core::{PlacementPolicy, PolicyError};
use berth_sdk::{Nodes, Scores, Task};

/// Scores every node alike: the engine's tie order decides (first fit).
pub struct FirstFit;

impl PlacementPolicy for FirstFit {
    fn describe(&self) -> String {
        "first-fit".into()
    }
    fn score(&mut self, _task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Ok(Scores::from_scores(nodes.iter().map(|_| 1.0).collect()))
    }
}
