//! newest-first: a baseline preemption order. Evict the most recently started
//! jobs first (least time invested), blind to checkpoints.

use berth_sdk::{victim_jobs, victim_order, Allocations, Hooks, Policy, Task};

#[derive(Default)]
pub struct NewestFirst;

impl Policy for NewestFirst {
    const NAME: &'static str = "newest-first";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::RANK;

    fn rank(&mut self, _demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String> {
        let mut jobs = victim_jobs(victims);
        // Lower priority always goes first; job id breaks ties so the
        // order never depends on how the host listed the victims.
        jobs.sort_by(|a, b| a.priority.cmp(&b.priority).then(a.running_s.cmp(&b.running_s)).then(a.job_id.cmp(&b.job_id)));
        Ok(victim_order(&jobs))
    }
}

berth_sdk::export!(NewestFirst);
