//! Berth guest SDK: write a scheduling policy in plain Rust.
//!
//! The contract (`wit/v0.4.0/policy.wit`; hosts still load 0.1.0, 0.2.0 and 0.3.0 components) passes data as columns, which is what
//! makes a call across the wasm boundary cheap. This crate gives policy authors
//! typed views over those columns ([`Nodes::iter`] yields one [`NodeView`] per
//! node) and a trait, [`Policy`], whose hooks all have documented defaults, so
//! a policy implements only what it needs and exports with one macro:
//!
//! ```
//! use berth_sdk::{Hooks, Nodes, Policy, Scores, Task};
//!
//! #[derive(Default)]
//! struct MostFreeCpu;
//!
//! impl Policy for MostFreeCpu {
//!     const NAME: &'static str = "most-free-cpu";
//!     const VERSION: &'static str = "0.1.0";
//!     const HOOKS: Hooks = Hooks::SCORE;
//!
//!     fn score(&mut self, _task: &Task, nodes: &Nodes) -> Result<Scores, String> {
//!         Ok(Scores::from_scores(nodes.iter().map(|n| n.cpu_free_milli as f64).collect()))
//!     }
//! }
//!
//! berth_sdk::export!(MostFreeCpu);
//! ```
//!
//! The same source compiles natively (the macro then expands to nothing), so
//! the host can benchmark wasm against native on identical logic.

mod types;
pub use types::*;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod glue;

/// A scheduling policy. Every hook has a default, so implement only those you
/// claim in [`Policy::HOOKS`]; the host never calls a hook you do not claim.
pub trait Policy: Default + 'static {
    /// Short stable name, lowercase with dashes.
    const NAME: &'static str;
    /// The policy's own semantic version.
    const VERSION: &'static str;
    /// Hooks this policy really implements.
    const HOOKS: Hooks;

    /// Per-partition configuration (TOML or JSON text; empty for defaults).
    /// Default: ignores it (hosts may send context, such as a replay's seed,
    /// that only some policies use).
    fn configure(&mut self, _config: &str) -> Result<(), String> {
        Ok(())
    }

    /// Placement scoring. Default: every node scores 0 and the host chooses
    /// GPUs.
    fn score(&mut self, _task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        Ok(Scores::from_scores(vec![0.0; nodes.len()]))
    }

    /// Gang placement by switch domain: one score per domain, higher
    /// better. Default: all 0 (claim [`Hooks::DOMAINS`] to be asked at all;
    /// otherwise gangs are placed topology-blind).
    fn score_domains(&mut self, _task: &Task, domains: &Domains) -> Result<Vec<f64>, String> {
        Ok(vec![0.0; domains.len()])
    }

    /// Compaction planning. Default: an empty plan (move nothing).
    fn compact(&mut self, _snapshot: &Snapshot) -> Result<Plan, String> {
        Ok(Plan::default())
    }

    /// Preemption ranking: indexes into `victims`, best victim first.
    /// Default: [`default_rank`].
    fn rank(&mut self, _demand: &Task, victims: &Allocations) -> Result<Vec<u32>, String> {
        Ok(default_rank(victims))
    }

    /// Model pools: the complete assignment of models to executors.
    /// Default: [`default_pool_place`].
    fn pool_place(&mut self, state: &PoolState) -> Result<PoolPlacement, String> {
        Ok(default_pool_place(state))
    }

    /// Model pools: the next step of one executor. Default:
    /// [`default_pool_step`].
    fn pool_step(&mut self, executor: &PoolExecutor) -> Result<PoolStep, String> {
        Ok(default_pool_step(executor, DEFAULT_MAX_ITERATIONS))
    }
}

/// The documented default assignment: every model on every executor of its
/// tensor-parallel degree, unpinned, weight 1 (the host loads on demand).
pub fn default_pool_place(state: &PoolState) -> PoolPlacement {
    let mut out = PoolPlacement::default();
    for e in 0..state.executors() {
        for m in 0..state.models() {
            if state.model_tp[m] == state.executor_tp[e] {
                out.push(e as u32, m as u32, 1, false);
            }
        }
    }
    out
}

/// Decode iterations the default step runs at most in one step.
pub const DEFAULT_MAX_ITERATIONS: u32 = 64;

/// The documented default step, first come first served between models:
/// a row whose decoding batch is about to be late (slack under two TBT
/// targets) decodes first; otherwise the row whose oldest waiting request
/// waited longest is prefilled; otherwise the row with the least slack
/// decodes, for as many iterations (1..=`max_iterations`) as fit before the
/// next-least-slack row's tokens fall due.
pub fn default_pool_step(x: &PoolExecutor, max_iterations: u32) -> PoolStep {
    let tbt = x.tbt_target_ms as i64;
    let decoding: Vec<usize> = (0..x.len()).filter(|&r| x.decoding[r] > 0).collect();
    let urgent = decoding.iter().copied().min_by_key(|&r| (x.decode_slack_ms[r], x.model[r]));
    if let Some(r) = urgent
        && x.decode_slack_ms[r] < 2 * tbt
    {
        return PoolStep::decode(r, decode_quantum(x, r, max_iterations));
    }
    let oldest = (0..x.len()).filter(|&r| x.waiting[r] > 0).max_by_key(|&r| (x.oldest_wait_ms[r], std::cmp::Reverse(x.model[r])));
    if let Some(r) = oldest {
        return PoolStep::prefill(r);
    }
    match urgent {
        Some(r) => PoolStep::decode(r, decode_quantum(x, r, max_iterations)),
        None => PoolStep::idle(),
    }
}

/// Decode iterations for row `r` that leave every other decoding row its
/// slack (minus one TBT target of margin), at least 1, at most `max`.
pub fn decode_quantum(x: &PoolExecutor, r: usize, max: u32) -> u32 {
    let others = (0..x.len()).filter(|&o| o != r && x.decoding[o] > 0).map(|o| x.decode_slack_ms[o]).min();
    let Some(slack) = others else { return max };
    let iteration_ms = (x.decode_iteration_s[r] * 1000.0).max(0.001);
    let budget = (slack - x.tbt_target_ms as i64).max(0) as f64;
    ((budget / iteration_ms) as u32).clamp(1, max)
}

/// The documented default preemption order: lowest priority first, then the
/// least work lost (`since-checkpoint-s` x GPUs held), then allocation id.
pub fn default_rank(victims: &Allocations) -> Vec<u32> {
    let mut order: Vec<u32> = (0..victims.ids.len() as u32).collect();
    order.sort_by_key(|&i| {
        let i = i as usize;
        let gpus = u64::from(victims.gpus[i].count_ones()).max(1);
        (victims.priority[i], victims.since_checkpoint_s[i].saturating_mul(gpus), victims.ids[i])
    });
    order
}

/// One candidate victim job of a preemption: its allocations (a gang's
/// members together, since evicting one member evicts the gang) and totals.
#[derive(Clone, Debug, PartialEq)]
pub struct VictimJob {
    pub job_id: u64,
    /// Indexes into the `victims` columns.
    pub members: Vec<u32>,
    pub priority: u32,
    /// GPUs held, counting a shared GPU as its fraction.
    pub gpus: f64,
    /// Work lost if evicted now: GPUs x seconds since the last checkpoint.
    pub lost_gpu_s: f64,
    /// Seconds the job has been running (its youngest member's).
    pub running_s: u64,
    /// What it was bought as, and the interruptions its contract still
    /// allows today (contract 0.4.0; older contracts: preemptible, no cap).
    pub tier: Tier,
    pub interruptions_left: u32,
}

/// Groups the victims by job, in order of first appearance.
pub fn victim_jobs(victims: &Allocations) -> Vec<VictimJob> {
    let mut jobs: Vec<VictimJob> = Vec::new();
    let mut index: std::collections::HashMap<u64, usize> = Default::default();
    for i in 0..victims.len() {
        let gpus = f64::from(victims.gpus[i].count_ones()) * f64::from(victims.gpu_milli[i]) / 1000.0;
        let k = *index.entry(victims.job_ids[i]).or_insert_with(|| {
            jobs.push(VictimJob {
                job_id: victims.job_ids[i],
                members: Vec::new(),
                priority: victims.priority[i],
                gpus: 0.0,
                lost_gpu_s: 0.0,
                running_s: u64::MAX,
                tier: victims.tier.get(i).and_then(|&t| Tier::from_number(t)).unwrap_or_default(),
                interruptions_left: victims.interruptions_left.get(i).copied().unwrap_or(u32::MAX),
            });
            jobs.len() - 1
        });
        let job = &mut jobs[k];
        job.members.push(i as u32);
        job.gpus += gpus;
        job.lost_gpu_s += gpus * victims.since_checkpoint_s[i] as f64;
        job.running_s = job.running_s.min(victims.running_s[i]);
    }
    jobs
}

/// The answer to `rank` for victim jobs in the order wanted: every member of
/// each job, job after job.
pub fn victim_order(jobs: &[VictimJob]) -> Vec<u32> {
    jobs.iter().flat_map(|j| j.members.iter().copied()).collect()
}

/// Severity of a [`log`] line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// Sends a log line to the host, which tags it with the policy and partition
/// and rate-limits it. In a native build this does nothing.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    glue::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (level, message);
}

/// Exports a [`Policy`] implementation as the component's `policy` interface.
/// Expands to nothing outside wasm32, so the crate also builds natively.
#[macro_export]
macro_rules! export {
    ($policy:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            use $crate::glue::wit;
            struct BerthGuest;
            ::std::thread_local! {
                static STATE: ::std::cell::RefCell<$policy> =
                    ::std::cell::RefCell::new(<$policy as ::std::default::Default>::default());
            }
            impl wit::exports::berth::policy::policy::Guest for BerthGuest {
                fn info() -> wit::exports::berth::policy::policy::PolicyInfo {
                    $crate::glue::info::<$policy>()
                }
                fn configure(config: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    STATE.with(|s| $crate::Policy::configure(&mut *s.borrow_mut(), &config))
                }
                fn score(
                    task: wit::berth::policy::types::Task,
                    nodes: wit::berth::policy::types::Nodes,
                ) -> ::std::result::Result<wit::berth::policy::types::Scores, ::std::string::String> {
                    STATE.with(|s| $crate::glue::score(&mut *s.borrow_mut(), task, nodes))
                }
                fn score_domains(
                    task: wit::berth::policy::types::Task,
                    domains: wit::berth::policy::types::Domains,
                ) -> ::std::result::Result<::std::vec::Vec<f64>, ::std::string::String> {
                    STATE.with(|s| $crate::glue::score_domains(&mut *s.borrow_mut(), task, domains))
                }
                fn compact(
                    snapshot: wit::berth::policy::types::Snapshot,
                ) -> ::std::result::Result<wit::berth::policy::types::Plan, ::std::string::String> {
                    STATE.with(|s| $crate::glue::compact(&mut *s.borrow_mut(), snapshot))
                }
                fn rank(
                    demand: wit::berth::policy::types::Task,
                    victims: wit::berth::policy::types::Allocations,
                ) -> ::std::result::Result<::std::vec::Vec<u32>, ::std::string::String> {
                    STATE.with(|s| $crate::glue::rank(&mut *s.borrow_mut(), demand, victims))
                }
                fn pool_place(
                    state: wit::berth::policy::types::PoolState,
                ) -> ::std::result::Result<wit::berth::policy::types::PoolPlacement, ::std::string::String> {
                    STATE.with(|s| $crate::glue::pool_place(&mut *s.borrow_mut(), state))
                }
                fn pool_step(
                    executor: wit::berth::policy::types::PoolExecutor,
                ) -> ::std::result::Result<wit::berth::policy::types::PoolChoice, ::std::string::String> {
                    STATE.with(|s| $crate::glue::pool_step(&mut *s.borrow_mut(), executor))
                }
            }
            $crate::glue::wit::export!(BerthGuest with_types_in $crate::glue::wit);
        };
    };
}
