//! Preemption: a high-priority job that cannot be placed takes capacity back
//! from low-priority work. A policy ranks the candidate victims (the WIT
//! `rank` hook); the core takes the shortest prefix of that ranking that
//! really frees a feasible placement, then gives back any victim the
//! placement turns out not to need. Victims leave under their priority
//! contract: notice, checkpoint on notice, grace, interruptions per day.

use berth_sdk::{AllocationRow, Allocations, Task};
use std::collections::HashSet;

use crate::fleet::{Allocation, Fleet, Node, NodeId};
use crate::job::Job;
pub use crate::job::PriorityContract;
use crate::policy::PolicyError;
use crate::task::TaskShape;

/// Ranks candidate victims for a demand (the contract's `rank` hook).
pub trait PreemptionPolicy {
    /// Name and version, for logs and reports.
    fn describe(&self) -> String;

    /// Indexes into `victims`, best victim first, each at most once; a
    /// victim left out is never taken. `Ok(None)`: no opinion, the host's
    /// default order applies ([`berth_sdk::default_rank`]). Same column
    /// contract as placement scoring: columns may be moved out while the
    /// call runs but must be put back.
    fn rank(&mut self, demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError>;
}

/// How long an evicted job takes to vacate its GPUs: lognormal.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvictionLatency {
    /// Mean and standard deviation of the natural log of seconds.
    pub mu: f64,
    pub sigma: f64,
}

impl Default for EvictionLatency {
    /// Fitted to ASI's figures: mean 13 s, p95 48 s (exp(mu + sigma^2 / 2)
    /// = 13 and exp(mu + 1.645 sigma) = 48 give mu 1.666, sigma 1.341).
    fn default() -> Self {
        EvictionLatency { mu: 1.666, sigma: 1.341 }
    }
}

impl EvictionLatency {
    /// A deterministic draw for `key` (job id and interruption count), so
    /// replays repeat without threading an RNG through the event loop.
    pub fn sample_s(&self, key: u64) -> f64 {
        let u1 = unit(splitmix(key));
        let u2 = unit(splitmix(key ^ 0x5851_F42D_4C95_7F2D));
        let normal = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.mu + self.sigma * normal).exp()
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in (0, 1].
fn unit(x: u64) -> f64 {
    ((x >> 11) + 1) as f64 / (1u64 << 53) as f64
}

/// The victims to take for a demand of `tasks` x `shape` on the nodes
/// `keep` accepts: walks `ranked` (victim jobs, best first, with their
/// allocations) releasing one job at a time on a scratch copy until enough
/// tasks fit, then puts back, last first, every victim the placement does
/// not need. `None` when even all of them would not make room. Returns
/// indexes into `ranked`.
pub fn choose_victims(
    fleet: &Fleet,
    shape: &TaskShape,
    tasks: u32,
    keep: &dyn Fn(NodeId, &Node) -> bool,
    ranked: &[&[Allocation]],
) -> Option<Vec<usize>> {
    let fits = |f: &Fleet| crate::capacity::fitting_tasks_among(f, shape, tasks, keep) >= tasks;
    let mut scratch = fleet.clone();
    let mut taken = Vec::new();
    for (k, allocs) in ranked.iter().enumerate() {
        for a in allocs.iter() {
            scratch.release(a).expect("a running job's allocation");
        }
        taken.push(k);
        if fits(&scratch) {
            // Never more than needed: try giving each back, last first.
            for i in (0..taken.len()).rev() {
                let allocs = ranked[taken[i]];
                for a in allocs.iter() {
                    scratch.allocate(a).expect("was held before");
                }
                if fits(&scratch) {
                    taken.remove(i);
                } else {
                    for a in allocs.iter() {
                        scratch.release(a).expect("just allocated");
                    }
                }
            }
            return Some(taken);
        }
    }
    None
}

/// A running job the engine offers as a victim, with what the ranker sees
/// of it.
pub struct Candidate<'a> {
    pub job: &'a Job,
    pub held: &'a [Allocation],
    /// Seconds its current run has lasted, work left, and work since its
    /// last checkpoint (what an eviction would lose).
    pub running_s: u64,
    pub remaining_s: u64,
    pub since_checkpoint_s: u64,
    /// What it was bought as, and the interruptions its contract still
    /// allows in the last 24 hours (`u32::MAX`: no cap).
    pub tier: crate::contract::Tier,
    pub interruptions_left: u32,
}

/// Asks `ranker` to order `candidates` for `demand`, checks the answer
/// (every index in range, none twice), then takes the shortest prefix that
/// frees room ([`choose_victims`]). Returns indexes into `candidates`;
/// `None` when even all of them would not make room. The one place a rank
/// answer is validated, for replay and the live host alike.
pub fn select_victims(
    fleet: &Fleet,
    ranker: &mut dyn PreemptionPolicy,
    demand: &Job,
    candidates: &[Candidate],
    keep: &dyn Fn(NodeId, &Node) -> bool,
) -> Result<Option<Vec<usize>>, PolicyError> {
    let Some(ranked) = ranked_candidates(ranker, demand, candidates)? else { return Ok(None) };
    let slices: Vec<&[Allocation]> = ranked.iter().map(|&k| candidates[k].held).collect();
    Ok(choose_victims(fleet, &demand.shape, demand.tasks, keep, &slices).map(|picked| picked.into_iter().map(|k| ranked[k]).collect()))
}

/// Asks `ranker` to order the allocations of `candidates` for `demand` and
/// checks the answer (every index in range, none twice): the candidate jobs
/// in that order, each once. `None` when there is nothing to rank.
fn ranked_candidates(ranker: &mut dyn PreemptionPolicy, demand: &Job, candidates: &[Candidate]) -> Result<Option<Vec<usize>>, PolicyError> {
    let mut victims = Allocations::default();
    let mut owner = Vec::new();
    for (k, c) in candidates.iter().enumerate() {
        let vj = c.job;
        for a in c.held {
            victims.push(AllocationRow {
                id: owner.len() as u32,
                job_id: vj.id,
                node: a.node,
                gpus: a.gpus,
                gpu_milli: a.gpu_milli,
                cpu_milli: a.cpu_milli,
                memory_mib: a.memory_mib,
                priority: vj.priority,
                movable: true,
                gang_id: if vj.tasks > 1 { vj.id } else { 0 },
                state_bytes: 0,
                remaining_s: c.remaining_s,
                running_s: c.running_s,
                since_checkpoint_s: c.since_checkpoint_s,
                class: vj.task_class(),
                tier: c.tier,
                interruptions_left: c.interruptions_left,
            });
            owner.push(k);
        }
    }
    if owner.is_empty() {
        return Ok(None);
    }
    let mut task = Task::default();
    crate::task::fill_task(&mut task, &demand.shape, demand.meta());
    let order = match ranker.rank(&task, &mut victims)? {
        Some(order) => order,
        None => berth_sdk::default_rank(&victims),
    };
    let mut seen = vec![false; owner.len()];
    let mut ranked = Vec::new();
    let mut taken: HashSet<usize> = HashSet::new();
    for &i in &order {
        let i = i as usize;
        if i >= owner.len() || std::mem::replace(&mut seen[i], true) {
            return Err(PolicyError::InvalidOutput(format!("rank index {i} is out of range or repeated ({} victims)", owner.len())));
        }
        if taken.insert(owner[i]) {
            ranked.push(owner[i]);
        }
    }
    Ok(Some(ranked))
}

/// What taking one job back costs it, under its contract.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Eviction {
    /// Seconds from the decision until its GPUs are free.
    pub vacate_s: u64,
    /// True when it did not vacate within notice + grace and was killed.
    pub forced: bool,
    /// Work seconds kept (checkpointed) of the run that is cut short.
    pub kept_s: u64,
    /// Work seconds of that run lost.
    pub lost_s: u64,
}

/// The eviction of a job that has run `ran_s` seconds since it last started
/// (from a checkpoint), vacating after `latency_s`.
pub fn evict(contract: &PriorityContract, ran_s: u64, latency_s: f64) -> Eviction {
    let limit = contract.notice_s + contract.grace_s;
    let forced = latency_s > limit as f64;
    let vacate_s = if forced { limit } else { latency_s.ceil() as u64 };
    let worked = ran_s + vacate_s;
    let kept_s = if !forced && contract.checkpoint_on_notice {
        worked
    } else {
        let every = contract.checkpoint_every_s.max(1);
        worked / every * every
    };
    Eviction { vacate_s, forced, kept_s, lost_s: worked - kept_s }
}
