//! smallest-first: a baseline preemption order. Evict the jobs holding the
//! fewest GPUs first (a gang counts all its members), blind to how much work
//! each would lose.

use berth_sdk::{victim_jobs, victim_order, Allocations, Hooks, Policy, Task};

#[derive(Default)]
pub struct SmallestFirst;

impl Policy for SmallestFirst {
    const NAME: &'static str = "smallest-first";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::RANK;

    fn rank(&mut self, _demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String> {
        let mut jobs = victim_jobs(victims);
        // Lower priority always goes first; job id breaks ties so the
        // order never depends on how the host listed the victims.
        jobs.sort_by(|a, b| a.priority.cmp(&b.priority).then(a.gpus.total_cmp(&b.gpus)).then(a.job_id.cmp(&b.job_id)));
        Ok(victim_order(&jobs))
    }
}

berth_sdk::export!(SmallestFirst);
