//! Berth guest SDK: write a scheduling policy in plain Rust.
//!
//! The contract (`wit/v0.2.0/policy.wit`; hosts still load 0.1.0 components) passes data as columns, which is what
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
            }
            $crate::glue::wit::export!(BerthGuest with_types_in $crate::glue::wit);
        };
    };
}
