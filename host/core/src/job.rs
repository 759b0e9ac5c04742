//! A job as the scheduler sees it: the shared vocabulary of the engine,
//! replay, compaction, preemption and the live host.

use crate::contract::Tier;
use crate::task::TaskShape;
pub use berth_sdk::TaskClass;

/// One job: `tasks` identical tasks (a gang when more than one), each of
/// `shape`, on distinct or shared nodes as the policy decides.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Job {
    pub id: u64,
    /// Workload class index (the caller's naming, e.g. online inference).
    pub class: u8,
    /// Larger is more important; only the order matters here.
    pub priority: u32,
    pub arrival_s: u64,
    pub duration_s: u64,
    pub tasks: u32,
    pub shape: TaskShape,
    /// The partition the job was submitted to: it runs on that partition's
    /// nodes under that partition's starvation guard. `None`: anywhere,
    /// under the fleet-wide guard.
    pub partition: Option<u32>,
    /// What a low-priority job is promised when preempted; `None`: the
    /// simulation's default contract.
    pub contract: Option<PriorityContract>,
    /// The world reports when an evicted run has really stopped (live
    /// processes on agents): the engine then waits for that report
    /// ([`crate::engine::Event::Vacated`]) instead of modelling the
    /// eviction's latency, and counts the work lost from the last
    /// checkpoint the job reported.
    pub reports_exit: bool,
    /// What kind of work the job said it is; `None`: implied by its shape
    /// (see [`Job::task_class`]).
    #[serde(with = "crate::serde_sdk::opt_task_class")]
    pub declared_class: Option<TaskClass>,
}

impl Job {
    pub fn gpus(&self) -> u64 {
        u64::from(self.tasks) * u64::from(self.shape.gpu_count)
    }

    /// GPUs it holds when running, a shared GPU counted as its share.
    pub fn gpus_held(&self) -> f64 {
        self.gpus() as f64 * f64::from(self.shape.gpu_milli) / 1000.0
    }

    /// The job's class as policies see it: declared, or CPU-only without
    /// GPUs and training with them.
    pub fn task_class(&self) -> TaskClass {
        self.declared_class.unwrap_or_else(|| TaskClass::implied(self.shape.gpu_count))
    }

    /// Its identity and class for the contract's task record (task 0).
    pub fn meta(&self) -> crate::task::TaskMeta {
        crate::task::TaskMeta { job_id: self.id, priority: self.priority, gang_size: self.tasks, gang_index: 0, class: self.task_class() }
    }
}

/// What a low-priority job is promised when it is preempted.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PriorityContract {
    /// Warning given before the capacity is taken back.
    pub notice_s: u64,
    /// Whether the job writes a checkpoint when given notice (then it loses
    /// nothing if it vacates in time).
    pub checkpoint_on_notice: bool,
    /// Extra time after the notice before a forced termination.
    pub grace_s: u64,
    /// The job is not taken more often than this in any 24 hours.
    pub max_interruptions_per_day: u32,
    /// Periodic checkpoint interval: a forced or unwarned eviction loses the
    /// work since the last one.
    pub checkpoint_every_s: u64,
    /// What the job bought (see [`crate::contract::Tier`]).
    #[serde(with = "crate::serde_sdk::tier")]
    pub tier: Tier,
    /// Longest time out of service after an interruption (0: no bound).
    /// With a bound, an interrupted job waits in the queue ahead of new work
    /// of its priority and is never held back for its daily cap; running
    /// again later breaks the promise.
    pub max_outage_s: u64,
}

impl Default for PriorityContract {
    /// 30 s notice and 30 s grace (ASI's eviction takes 13 s on average,
    /// 48 s at p95), no checkpoint on notice, at most 3 interruptions a day,
    /// hourly checkpoints, preemptible, no bound on the outage.
    fn default() -> Self {
        PriorityContract {
            notice_s: 30,
            checkpoint_on_notice: false,
            grace_s: 30,
            max_interruptions_per_day: 3,
            checkpoint_every_s: 3600,
            tier: Tier::Preemptible,
            max_outage_s: 0,
        }
    }
}

impl PriorityContract {
    /// The contract a job of `tier` runs under, from the partition's
    /// contract for preemptible work: guaranteed work is never taken;
    /// opportunistic work gets no notice, no grace and no daily cap.
    pub fn of_tier(self, tier: Tier) -> PriorityContract {
        match tier {
            Tier::Preemptible => PriorityContract { tier, ..self },
            Tier::Guaranteed => PriorityContract { tier, max_interruptions_per_day: 0, max_outage_s: 0, ..self },
            Tier::Opportunistic => PriorityContract {
                tier,
                notice_s: 0,
                grace_s: 0,
                checkpoint_on_notice: false,
                max_interruptions_per_day: u32::MAX,
                max_outage_s: 0,
                ..self
            },
        }
    }
}
