//! spot-gpu: SpotGPU's preemption order. Evict the work with the least
//! to recompute first: GPUs held x seconds since its last checkpoint, summed
//! over a gang's members. ASI reports it cut low-priority completion time
//! by 24% against naive orders. Among equal priorities opportunistic work
//! goes first (contract 0.4.0): its tenant is owed nothing for what it loses.

use berth_sdk::{victim_jobs, victim_order, Allocations, Hooks, Policy, Task, Tier};

#[derive(Default)]
pub struct SpotGpu;

impl Policy for SpotGpu {
    const NAME: &'static str = "spot-gpu";
    const VERSION: &'static str = "1.1.0";
    const HOOKS: Hooks = Hooks::RANK;

    fn rank(&mut self, _demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String> {
        let mut jobs = victim_jobs(victims);
        // Lower priority always goes first, then work nobody is owed for;
        // job id breaks ties so the order never depends on how the host
        // listed the victims.
        let owed = |t: Tier| t != Tier::Opportunistic;
        jobs.sort_by(|a, b| {
            a.priority.cmp(&b.priority).then(owed(a.tier).cmp(&owed(b.tier))).then(a.lost_gpu_s.total_cmp(&b.lost_gpu_s)).then(a.job_id.cmp(&b.job_id))
        });
        Ok(victim_order(&jobs))
    }
}

berth_sdk::export!(SpotGpu);
