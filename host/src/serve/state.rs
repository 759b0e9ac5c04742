//! The live host's shared state, the ground floor of serve/: the partitions
//! (fleet, engine, job records, task runs, policy versions per hook), the
//! host-wide [`Live`], and the records of live compaction. Only state and
//! its helpers live here; what acts on it is above: the partition loop
//! (`scheduler`), decisions (`deciding`), admission, actuation, compaction,
//! harvesting, retention and the API. Nothing here imports those.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use berth_core::compaction::{CompactionConfig, Cursor, Wanted};
use berth_core::engine::{Event, SimConfig as EngineConfig, Slot};
use berth_core::fleet::{gpus_of, Node, NodeId};
use berth_core::{Allocation, Engine, Fleet, Job, PolicyError, MILLI_PER_GPU};
use serde::{Deserialize, Serialize};

use super::auth::Access;
use super::breaker::{Breaker, BreakerConfig};
use super::decisions::{DecisionLog, Placed};
use super::error::ServeError;
use super::lifecycle::{ChainState, MoveState};
use super::metrics::Metrics;
use super::registry::{Registry, VersionMeta};
use super::shadow::{self, Mode};
use crate::util::unix_ms;
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// One loaded policy version with its instance, ready to decide.
pub struct Arm {
    pub meta: VersionMeta,
    pub(crate) policy: Mutex<WasmPolicy>,
    /// This instance among all this host made (from 1): the capture names
    /// it, so a replay starts a policy's state over where the host did.
    pub instance: u64,
}

/// Instances made since the host started.
static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Arm {
    /// Loads a registry version (its precompiled artifact when cached),
    /// applies its configuration and instantiates it, so its first decision
    /// pays for nothing.
    pub fn load(engine: &Arc<PolicyEngine>, bytes: &[u8], meta: VersionMeta, limits: Limits) -> Result<Arm, PolicyError> {
        let loaded = LoadedPolicy::from_bytes(engine, bytes)?;
        let mut policy = WasmPolicy::new(engine.clone(), loaded, limits);
        if !meta.config.is_empty() {
            policy.configure(&meta.config)?;
        }
        policy.warm()?;
        let instance = INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        Ok(Arm { meta, policy: Mutex::new(policy), instance })
    }
}

/// A candidate version beside the active one.
pub struct Candidate {
    pub arm: Arc<Arm>,
    pub mode: Mode,
}

pub use super::lifecycle::{JobState, SleepState, TaskState};
/// One task of a job with argv: a process on an agent node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TaskRun {
    /// The agent allocation id (unique across the host's life, restarts included).
    pub alloc_id: u64,
    pub node: String,
    pub gpus: Vec<u32>,
    pub state: TaskState,
    pub exit_code: i32,
    pub signal: i32,
    /// Still holds its fleet allocation: its GPUs are given to nobody else
    /// until the agent reports the process gone (or the node is given up).
    pub holds: bool,
    /// A copy being migrated in (make-before-break): the allocation it
    /// replaces, until that one's exit is reported (0: none).
    #[serde(default)]
    pub replaces: u64,
    /// With `replaces`: send the old copy a checkpoint notice before its stop.
    #[serde(default)]
    pub checkpoint_old: bool,
    /// Asleep: the most GPU memory its agent found still used on one of its
    /// GPUs (MiB); its job's GPUs are lent only when every task's is at
    /// most the host's `--lend-max-memory-mib`.
    #[serde(default)]
    pub gpu_memory_held_mib: u64,
    /// The first and latest progress reports of this run that added work,
    /// as (host ms, units): its measured rate (not stored: a restarted
    /// host measures again).
    #[serde(skip)]
    pub progress_first: Option<(u64, u64)>,
    #[serde(skip)]
    pub progress_last: Option<(u64, u64)>,
    /// When the task last reported a checkpoint (`berth checkpointed`), in
    /// Unix ms; 0: never.
    #[serde(default)]
    pub checkpointed_unix_ms: u64,
    /// The task reported ready (`berth ready`).
    #[serde(default)]
    pub ready: bool,
    /// Preempted: when its notice runs out and it is stopped (Unix ms; 0:
    /// no stop scheduled). Stored, so a host restarted during the notice
    /// still stops it.
    #[serde(default)]
    pub stop_at_unix_ms: u64,
    /// Preempted and gone: milliseconds from its stop to its exit, and
    /// whether SIGKILL ended it after the stop grace (as its agent
    /// measured; 0 and false until then).
    #[serde(default)]
    pub stop_to_exit_ms: u64,
    #[serde(default)]
    pub killed: bool,
    /// Those two were measured (the task was preempted and its exit
    /// reported), and came from the agent (else the host timed the exit
    /// report from the scheduled stop).
    #[serde(default)]
    pub stop_measured: bool,
    #[serde(default)]
    pub stop_timed_by_agent: bool,
    /// Units of work this run reported (`berth progress`), and how many of
    /// them its last checkpoint saved: the rest is lost if the run is
    /// preempted, migrated, fails or is lost with its node.
    #[serde(default)]
    pub work_units: u64,
    #[serde(default)]
    pub work_checkpointed: u64,
}

/// An agent's report on one of its allocations, queued for the node's
/// partition: the scheduler takes reports in between passes (see
/// [`Live::queue_report`]).
#[derive(Debug)]
pub struct QueuedReport {
    pub alloc_id: u64,
    pub report: super::lifecycle::Report,
    pub exit_code: i32,
    pub signal: i32,
    pub detail: String,
    pub stopped: Option<Stopped>,
    /// Units of work the run reported so far (`berth progress`), and of
    /// those the units its latest checkpoint saved (0: not said).
    pub work_units: u64,
    pub work_checkpointed: u64,
    /// For an asleep report: the most GPU memory still used on one of the
    /// task's GPUs (MiB).
    pub gpu_memory_held_mib: u64,
    /// Told once the report is taken in (the agent's call waits for it).
    pub taken: Option<tokio::sync::oneshot::Sender<()>>,
}

/// How a stopped task went, as its agent measured: from the stop command
/// to the exit, and whether the stop grace ran out (SIGKILL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stopped {
    pub to_exit_ms: u64,
    pub killed: bool,
}

impl TaskRun {
    /// Whether this copy serves: it runs, and has reported ready when its
    /// job waits for that (a migrated copy then takes over).
    pub fn serves(&self, wait_ready: bool) -> bool {
        self.state == TaskState::Running && (!wait_ready || self.ready)
    }

    /// A task whose start is about to be sent.
    pub fn starting(alloc_id: u64, node: String, gpus: Vec<u32>) -> TaskRun {
        TaskRun {
            alloc_id,
            node,
            gpus,
            state: TaskState::Starting,
            exit_code: 0,
            signal: 0,
            holds: true,
            replaces: 0,
            checkpoint_old: false,
            gpu_memory_held_mib: 0,
            progress_first: None,
            progress_last: None,
            checkpointed_unix_ms: 0,
            ready: false,
            stop_at_unix_ms: 0,
            stop_to_exit_ms: 0,
            killed: false,
            stop_measured: false,
            stop_timed_by_agent: false,
            work_units: 0,
            work_checkpointed: 0,
        }
    }
}

/// What starts and stops processes on agent nodes (the agent hub), so the
/// scheduler does not know about gRPC.
pub trait Actuator: Send + Sync {
    /// Starts one task; an error means it was not delivered.
    fn start(&self, start: Start<'_>) -> Result<(), String>;
    /// Asks the node to stop an allocation (best effort: the exit report
    /// is what frees the GPUs). Whether the command reached the node's
    /// stream (a node not connected, after a restart say, has none).
    fn stop(&self, alloc_id: u64, node: &str) -> bool;
    /// Sends a checkpoint notice to an allocation (best effort).
    fn checkpoint(&self, alloc_id: u64, node: &str);
    /// Puts an allocation's processes to sleep, or wakes them (the agent's
    /// hooks; best effort: the agent reports "sleeping" or "running").
    fn sleep(&self, alloc_id: u64, node: &str, wake: bool);
    /// What reconciling a batch of heartbeats found: orphans to stop, and
    /// the allocations held where their nodes run them (the hub learns
    /// those it does not know, started before a restart).
    fn reconciled(&self, found: Vec<Reconciled>);
    /// What an allocation's cgroup said it used at its node's latest
    /// heartbeat (None: not known).
    fn usage(&self, _alloc_id: u64) -> Option<crate::proto::TaskUsage> {
        None
    }
    /// An allocation's average CPU use (thousandths of a core) between the
    /// first and the latest heartbeats that carried its usage (None: under
    /// a second of them).
    fn cpu_rate_milli(&self, _alloc_id: u64) -> Option<u32> {
        None
    }
    /// The thousandths of a core the running allocations on `node` but
    /// `except` used: at its latest heartbeat, or (`lifetime`) on average
    /// since their first.
    fn node_cpu_milli(&self, _node: &str, _except: u64, _lifetime: bool) -> u32 {
        0
    }
}

/// One heartbeat as the partition sees it, taken in by the partition's
/// scheduler thread between passes: an agent's heartbeat never waits for
/// a pass, which holds the state through its policy calls.
#[derive(Clone, Debug, Default)]
pub struct Beat {
    pub node: String,
    /// Allocations the node says it runs.
    pub running: Vec<u64>,
    /// GPUs measured busy (the productive denominator).
    pub active: Vec<u32>,
    /// The first heartbeat after a registration: allocations numbered
    /// below this, held on the node when the beat is taken in, must be in
    /// `running`, or they are lost. (Ids only grow, so one started after
    /// the registration is never judged by a list taken before it.)
    pub registered_below: Option<u64>,
    /// What the agent measured of its tasks' contention (policies of
    /// contract 0.4.0 see it); `None` when its heartbeat carried none.
    pub measured: Option<berth_core::fleet::Measured>,
}

/// Heartbeats queued for a partition, at most two per node: the first
/// after its latest registration (judged on its own) and the latest other.
#[derive(Debug, Default)]
pub struct Beats {
    queued: HashMap<String, (Option<Beat>, Option<Beat>)>,
}

impl Beats {
    /// Queues a beat; a later plain beat of a node replaces the one queued
    /// (it says everything the older one did), a registration's first beat
    /// replaces both (it judges everything held before it).
    /// Whether the queue was empty before (the scheduler is told then).
    pub fn push(&mut self, beat: Beat) -> bool {
        let was_empty = self.queued.is_empty();
        let slot = self.queued.entry(beat.node.clone()).or_default();
        if beat.registered_below.is_some() {
            *slot = (Some(beat), None);
        } else {
            slot.1 = Some(beat);
        }
        was_empty
    }

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Every queued beat, each node's in order.
    /// (Drained: the map keeps its memory for the next batch; a fresh one
    /// grew and was freed on every batch of a large fleet's beats.)
    pub fn take(&mut self) -> Vec<Beat> {
        let mut beats = Vec::with_capacity(self.queued.len() + 1);
        for (first, latest) in self.queued.drain().map(|(_, b)| b) {
            beats.extend(first);
            beats.extend(latest);
        }
        beats
    }
}

/// What reconciling one heartbeat found, for the hub.
#[derive(Debug, Default)]
pub struct Reconciled {
    pub node: String,
    /// Processes of no allocation held there: to stop.
    pub orphans: Vec<u64>,
    /// Allocations the node runs that the fleet holds there, with their
    /// GPUs: for a registration's first beat only (what a restarted hub
    /// adopts); a later beat only confirms, and copying every task's GPUs
    /// on every beat was a large fleet's heaviest per-beat cost.
    pub held: Vec<(u64, Vec<u32>)>,
}

pub struct Start<'a> {
    pub alloc_id: u64,
    pub job_id: u64,
    pub node: &'a str,
    pub gpus: &'a [u32],
    pub argv: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    /// What the task asked for, enforced on its node (0: no limit).
    pub cpu_milli: u32,
    pub memory_mib: u64,
}

/// A job as submitted, checked.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub partition: String,
    pub name: String,
    pub models: Vec<String>,
    pub duration: Duration,
    /// Run on agent nodes, once per task (empty: a simulated job).
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Live compaction may move its tasks.
    pub movable: bool,
    /// A migrated copy takes over once it reports ready, not once it runs.
    pub wait_ready: bool,
    /// The harvest schedule may put it to sleep in the trough.
    pub sleepable: bool,
    /// What one unit of its reported work is (empty: "units").
    pub work_unit: String,
    /// Opportunistic work: GPU-seconds of run bought (0: no bound).
    pub budget_gpu_s: u64,
    /// The core's view: id, priority, tasks, shape.
    pub job: Job,
}

/// Interruption times kept per job (a contract allows a few a day).
pub const KEPT_INTERRUPTIONS: usize = 32;

#[derive(Clone, Debug)]
pub struct JobRecord {
    pub spec: JobSpec,
    pub owner: String,
    pub state: JobState,
    pub submitted_at: Instant,
    pub submitted_unix_ms: u64,
    pub started_unix_ms: u64,
    pub ended_unix_ms: u64,
    pub ends_at: Option<Instant>,
    pub allocations: Vec<Allocation>,
    pub placements: Vec<Placed>,
    pub decision_id: u64,
    pub policy_version: u32,
    /// The latest decision about it, for `explain`.
    pub last_decision: String,
    /// Jobs with argv: one per task, parallel to `allocations`.
    pub runs: Vec<TaskRun>,
    /// Why it failed or was requeued.
    pub detail: String,
    /// Work its tasks reported, and the part of it lost (see [`super::outcome`]).
    pub work: super::work::WorkTally,
    /// Its time limit stopped its tasks: their ends are its owner's limit,
    /// not failures or moves that lose work.
    pub time_limit_stop: bool,
    /// That stop was its GPU-hour budget spent: an end it bought, not a
    /// failure.
    pub budget_stop: bool,
    /// Preempted: its processes are stopping under the priority contract;
    /// it runs again once they are gone.
    pub evicting: bool,
    /// Preempted jobs whose processes must be gone before this job's tasks
    /// start on their GPUs.
    pub waiting_on: Vec<u64>,
    /// GPU-milliseconds its ended runs were charged: GPUs x the time from
    /// a run's start to when the host ended it or took it back.
    pub charged_gpu_ms: u64,
    /// Times it was preempted.
    pub interruptions: u32,
    /// When (clock seconds) the latest of those were, at most
    /// [`KEPT_INTERRUPTIONS`]: the daily limit survives a restart.
    pub interrupted_s: Vec<u64>,
    /// The starvation guard's latest start for it (Unix seconds; 0: none).
    pub reserved_until_s: u64,
    /// Sleep-state harvesting.
    pub sleep: SleepState,
    /// The submission's idempotency key ("": none), and the digest of the
    /// spec it came with (a retry must match it).
    pub idempotency_key: String,
    pub spec_digest: String,
}

impl JobRecord {
    /// The running run ends now (`now_ms`, host clock): it is charged GPUs
    /// x its length. Nothing for a record that is not running.
    pub fn close_run(&mut self, now_ms: u64) {
        self.charged_gpu_ms = self.charged_gpu_ms_at(now_ms);
    }

    /// GPU-milliseconds charged so far, the running run's included.
    pub fn charged_gpu_ms_at(&self, now_ms: u64) -> u64 {
        let running = self.state == JobState::Running && self.started_unix_ms > 0;
        let run = if running { self.spec.job.gpus_held() * now_ms.saturating_sub(self.started_unix_ms) as f64 } else { 0.0 };
        self.charged_gpu_ms.saturating_add(run as u64)
    }

    /// Seconds of run its budget has left at its GPUs (`None`: no budget).
    pub fn budget_left_s(&self) -> Option<u64> {
        if self.spec.budget_gpu_s == 0 {
            return None;
        }
        let gpus = self.spec.job.gpus_held().max(1e-3);
        let left_ms = self.spec.budget_gpu_s.saturating_mul(1000).saturating_sub(self.charged_gpu_ms);
        Some((left_ms as f64 / 1000.0 / gpus).floor() as u64)
    }

    /// Whether a run of it that ends now, short of finishing, loses its
    /// work since its last checkpoint: not once its owner stopped it (a
    /// cancel, a time limit).
    pub fn loses_work(&self) -> bool {
        self.state == JobState::Running && !self.time_limit_stop
    }

    /// An agent job placed (running on record) with no task sent and no
    /// victim left to wait for: nothing will start it but a requeue.
    pub(crate) fn placed_unstarted(&self) -> bool {
        self.state == JobState::Running && !self.spec.argv.is_empty() && self.runs.is_empty() && self.waiting_on.is_empty()
    }

    /// The state callers see: an evicted job whose processes still run is
    /// "evicting" (its GPUs are not free yet), not "pending".
    pub fn shown_state(&self) -> &'static str {
        if self.evicting && self.state == JobState::Pending && self.runs.iter().any(|r| r.holds) {
            "evicting"
        } else {
            self.state.as_str()
        }
    }
}

/// What `ListJobs` may filter on: the job states and "evicting".
pub const SHOWN_STATES: [&str; 6] = ["pending", "evicting", "running", "finished", "failed", "cancelled"];

pub struct PartitionState {
    pub fleet: Fleet,
    /// Every node's name (simulated and agent), for a registration's
    /// uniqueness check without a scan of the fleet.
    pub(crate) node_names: HashMap<String, NodeId>,
    /// The partition's scheduling engine (the core's, shared with replay)
    /// and each live job's slot in it.
    pub engine: Engine,
    pub slots: HashMap<u64, Slot>,
    /// Stops due under the priority contract: (when, allocation, node).
    pub(crate) stops: Vec<(Instant, u64, String)>,
    pub jobs: BTreeMap<u64, JobRecord>,
    pub pending: Vec<u64>,
    pub(crate) running: BTreeSet<(Instant, u64)>,
    /// Something changed since the last pass: try the queue again.
    pub(crate) dirty: bool,
    /// A policy failed: try again then.
    pub(super) retry_at: Option<Instant>,
    /// The breaker found no version to fall back to.
    pub paused: bool,
    /// Nodes registered by agents (`berth agent`), by name.
    pub agent_ids: BTreeMap<String, NodeId>,
    /// Whether each node (by id) is an agent's: read by every pass.
    pub(super) is_agent: Vec<bool>,
    /// Unhealthy agent GPUs; true once held out of placement by an
    /// allocation of their own (made when the GPU is free).
    pub health: BTreeMap<(NodeId, u32), bool>,
    /// GPUs started by an operator (`StartAllocation`), and GPUs fenced
    /// off a lost node (tasks of requeued jobs), by allocation id.
    pub manual: BTreeMap<u64, Allocation>,
    /// Which of `manual` are fenced: their processes are orphans to stop
    /// when the node returns.
    pub lost: BTreeSet<u64>,
    /// Allocation id to the job holding it (0: manual).
    pub by_alloc: HashMap<u64, u64>,
    /// Agent nodes: GPUs whose last measured SM utilisation reached the
    /// productive threshold.
    pub activity: HashMap<NodeId, u64>,
    /// Agent nodes' declared places in the fat tree.
    pub topology: BTreeMap<NodeId, AgentTopology>,
    /// When ended jobs are next taken out of the engine.
    pub(super) forget_at: Option<Instant>,
    /// When ended jobs past retention are next removed.
    pub(super) prune_at: Option<Instant>,
    /// Live compaction: settings, the chain being run, the ledger.
    pub compaction: LiveCompaction,
    /// The host's clock (see [`super::clock`]).
    pub clock: Arc<dyn super::clock::Clock>,
    /// The harvest schedule, and when it last looked (seconds on the clock).
    pub(crate) harvest: Option<berth_core::harvest::Harvest>,
    pub(crate) harvest_seen_s: Option<u64>,
    /// Waking jobs whose GPUs are theirs again but whose wake the store
    /// refused: their tasks are told to wake once it is stored (a restart
    /// that found them asleep would lend GPUs their woken processes use).
    pub(crate) unstored_wakes: BTreeSet<u64>,
    /// Agent jobs a restart found placed but never started (no tasks, no
    /// victims left to wait for): queued again by the partition loop, since
    /// nothing else would start them.
    pub(crate) unstarted: BTreeSet<u64>,
    /// Held: no decisions are made (submissions and ends are taken in).
    pub(crate) held: bool,
    /// A pass is running outside the lock.
    pub(super) in_pass: bool,
    /// The clock's instant at which the loop last ran every timer (stops,
    /// ends, ticks) and found no pass wanted: a manual-clock driver knows
    /// a moment is done only once the loop has looked at it.
    pub(super) swept_at: Option<Instant>,
    /// When heartbeats were last taken in (real time: a batching rate, not
    /// a decision time).
    pub(super) beats_taken: Option<std::time::Instant>,
    /// Node join times, power states and retired work, for the outcome.
    pub outcome: super::work::PartitionOutcome,
    /// What each tenant is owed for lost work and broken promises.
    pub credits: super::credits::Credits,
    /// The engine's inputs written as they are taken (see [`crate::capture`]);
    /// `None` when capture is off. The last policy versions and agent
    /// nodes noted in it.
    pub(crate) capture: Option<crate::capture::CaptureLog>,
    pub(crate) captured_arms: Option<berth_core::capture::Input>,
    pub(crate) captured_agents: Vec<bool>,
}

/// The allocation that keeps an unhealthy GPU out of placement.
pub(crate) fn health_hold(node: NodeId, gpu: u32) -> Allocation {
    Allocation { node, gpus: 1 << gpu, gpu_milli: MILLI_PER_GPU, cpu_milli: 0, memory_mib: 0 }
}

/// Planning length of a job with a command and no time limit: it ends when
/// its processes do, which the engine cannot know.
pub(super) const UNLIMITED_PLAN_S: u64 = 365 * 86_400;

impl PartitionState {
    /// Takes ended jobs out of the engine's table (their records stay), so
    /// a long-lived host's engine holds only work that may still run.
    pub(super) fn forget_ended(&mut self) {
        let ended: Vec<(u64, Slot)> = self
            .slots
            .iter()
            .filter(|(id, _)| self.jobs.get(id).is_none_or(|j| j.state.is_ended()))
            .map(|(&id, &slot)| (id, slot))
            .collect();
        for (id, slot) in ended {
            if self.engine.forget(slot) {
                self.slots.remove(&id);
            }
        }
    }

    /// Seconds on the host's clock: the engine's `now`.
    pub fn now_s(&self) -> u64 {
        self.clock.unix_ms() / 1000
    }

    /// Writes the engine inputs captured since the last call.
    pub fn flush_capture(&mut self) {
        if let Some(log) = &mut self.capture {
            let inputs = self.engine.take_captured();
            log.write(inputs, self.clock.unix_ms());
        }
    }

    /// Notes for a replay what the next pass asks beside the engine: the
    /// policy versions and the agents' nodes, when they changed.
    pub(super) fn note_for_capture(&mut self, arms: berth_core::capture::Input) {
        if self.capture.is_none() {
            return;
        }
        if self.captured_arms.as_ref() != Some(&arms) {
            self.engine.capture_note(arms.clone());
            self.captured_arms = Some(arms);
        }
        if self.captured_agents != self.is_agent {
            let nodes = self.is_agent.iter().enumerate().filter(|(_, a)| **a).map(|(i, _)| i as NodeId).collect();
            self.engine.capture_note(berth_core::capture::Input::AgentNodes { nodes });
            self.captured_agents = self.is_agent.clone();
        }
    }

    /// Whether a pass is due at `now`: something changed or a failed pass
    /// is to be retried, jobs wait, and decisions are neither paused by the
    /// breaker nor held.
    pub(super) fn wants_pass(&self, now: Instant) -> bool {
        (self.dirty || self.retry_at.is_some_and(|t| t <= now)) && !self.pending.is_empty() && !self.paused && !self.held
    }

    /// An evicted simulated job's modelled vacate time, as an instant.
    pub(super) fn wakeup(&self, now: Instant) -> Option<Instant> {
        let now_ms = self.clock.unix_ms();
        self.engine.next_wakeup().map(|t| now + Duration::from_millis((t * 1000).saturating_sub(now_ms)))
    }

    /// When something is next due here on its own: a run's planned end, a
    /// retry of a failed pass, a stop after a notice, a modelled vacate time.
    pub(super) fn next_due(&self, now: Instant) -> Option<Instant> {
        let next_end = self.running.first().map(|(t, _)| *t);
        let next_stop = self.stops.iter().map(|s| s.0).min();
        [next_end, self.retry_at, next_stop, self.wakeup(now)].into_iter().flatten().min()
    }

    /// Takes in a newly accepted job: recorded, in the engine, queued.
    pub(super) fn admit(&mut self, id: u64, record: JobRecord) {
        self.jobs.insert(id, record);
        let slot = self.register(id);
        let now = self.now_s();
        self.engine.apply(&mut self.fleet, now, Event::Arrive(slot));
        self.pending.push(id);
        self.dirty = true;
    }

    /// Adds job `id` (recorded in `jobs`) to the engine's table.
    pub(crate) fn register(&mut self, id: u64) -> Slot {
        let r = &self.jobs[&id];
        let agent_job = !r.spec.argv.is_empty();
        let mut job = r.spec.job.clone();
        job.id = id;
        job.arrival_s = r.submitted_unix_ms / 1000;
        job.reports_exit = agent_job;
        if agent_job && r.spec.duration.is_zero() {
            job.duration_s = UNLIMITED_PLAN_S;
        }
        let slot = self.engine.register(job);
        self.slots.insert(id, slot);
        slot
    }

    /// Holds every unhealthy GPU of `node` that is free now.
    pub(crate) fn apply_holds(&mut self, node: NodeId) {
        for (&(n, g), applied) in self.health.range_mut((node, 0)..=(node, u32::MAX)) {
            if !*applied && self.fleet.nodes()[n as usize].gpus[g as usize] == MILLI_PER_GPU {
                self.fleet.allocate(&health_hold(n, g)).expect("a free GPU takes a hold");
                *applied = true;
            }
        }
    }

    /// Unhealthy GPUs held out, per model name: subtracted from the
    /// healthy and busy denominators (a hold is not work).
    pub fn held_unhealthy(&self) -> BTreeMap<String, (f64, f64)> {
        let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for (&(n, _), &applied) in &self.health {
            let node = &self.fleet.nodes()[n as usize];
            let model = node.model.map_or_else(|| "cpu-only".to_string(), |m| self.fleet.models[m as usize].clone());
            let e = out.entry(model).or_default();
            if node.schedulable {
                e.0 += 1.0;
            }
            if applied {
                e.1 += 1.0;
            }
        }
        out
    }

    /// Whether node `id` is an agent's.
    pub fn agent(&self, id: NodeId) -> bool {
        self.is_agent.get(id as usize).copied().unwrap_or(false)
    }

    /// Milli-GPU doing measured work on node `i`: simulated nodes always
    /// work; on agent nodes only GPUs whose SM utilisation reached the
    /// threshold (held unhealthy GPUs never).
    pub fn productive_milli(&self, i: usize, n: &Node) -> u64 {
        let id = i as NodeId;
        if !self.agent(id) {
            return n.gpu_total_milli() - n.gpu_free_milli();
        }
        let mask = self.activity.get(&id).copied().unwrap_or(0);
        gpus_of(mask)
            .filter(|&g| g < n.gpus.len() && !self.health.get(&(id, g as u32)).copied().unwrap_or(false))
            .map(|g| u64::from(MILLI_PER_GPU - n.gpus[g]))
            .sum()
    }

    /// Who holds GPU `gpu` of `node`, for error messages.
    pub(crate) fn holder(&self, node: NodeId, gpu: u32) -> String {
        if self.health.get(&(node, gpu)) == Some(&true) {
            return "an unhealthy-GPU hold".into();
        }
        if let Some((id, _)) = self.manual.iter().find(|(_, a)| a.node == node && a.gpus & (1 << gpu) != 0) {
            return format!("allocation {id}");
        }
        for (jid, j) in &self.jobs {
            for (a, r) in j.allocations.iter().zip(&j.runs) {
                if r.holds && a.node == node && a.gpus & (1 << gpu) != 0 {
                    return format!("allocation {} of job {jid}", r.alloc_id);
                }
            }
            if j.runs.is_empty() && j.state == JobState::Running && j.allocations.iter().any(|a| a.node == node && a.gpus & (1 << gpu) != 0) {
                return format!("job {jid}");
            }
        }
        "nobody".into()
    }
}

/// One policy hook's versions in a partition: the active one, a candidate
/// beside it, what the candidate would have done, and the breaker that
/// takes a failing version out of service. Each is locked on its own and
/// never across a policy call.
pub struct HookSlot<C, S> {
    pub active: Mutex<Option<Arc<Arm>>>,
    pub candidate: Mutex<Option<Arc<C>>>,
    pub stats: Mutex<S>,
    pub breaker: Mutex<Breaker>,
}

impl<C, S: Default> Default for HookSlot<C, S> {
    fn default() -> Self {
        HookSlot { active: Mutex::new(None), candidate: Mutex::new(None), stats: Mutex::new(S::default()), breaker: Mutex::new(Breaker::default()) }
    }
}


pub struct Partition {
    pub name: String,
    pub state: Mutex<PartitionState>,
    pub(crate) wake: Condvar,
    /// The placement hook: the active version (the swap point, read once
    /// per decision), a shadow or split candidate, and what it would have
    /// done.
    pub place: HookSlot<Candidate, shadow::Stats>,
    /// The rank hook (no active version: the documented default ranking),
    /// a version in shadow beside it and what it would have done.
    pub rank: HookSlot<Arm, shadow::RankStats>,
    /// The compact hook (no active version: no live compaction); a
    /// candidate in shadow plans on every step's snapshot too (never run).
    pub compact: HookSlot<Arm, shadow::CompactStats>,
    /// The pool hook of a pool partition (no active version: the default
    /// pool placement, and executors step by the default step).
    pub pool: HookSlot<Arm, shadow::PoolStats>,
    /// Jobs accepted and stored but not yet in `state`: a submission never
    /// waits for the state lock, which the deciding thread holds through its
    /// policy calls. Whoever takes the lock next moves them in.
    pub(super) inbox: Mutex<Vec<(u64, JobRecord)>>,
    /// Heartbeats not yet reconciled with the state (see [`Beat`]).
    pub(super) beats: Mutex<Beats>,
    /// Agents' reports not yet taken in (see [`Live::queue_report`]), in
    /// the order they came.
    pub(super) reports: Mutex<Vec<QueuedReport>>,
    /// A pass is running (read without the state's lock, which a pass holds
    /// through its policy calls).
    pub(super) deciding: AtomicBool,
    /// The fleet's GPU models (agents add theirs), for validating a
    /// submission without the state lock.
    pub(crate) models: Mutex<Vec<String>>,
    /// How long the latest passes took, whole (for benchmarks).
    pub pass_times: Mutex<PassTimes>,
}

/// The durations of the latest passes of a partition, in microseconds: a
/// ring of fixed size, so a host running for months keeps only the latest.
#[derive(Debug, Default)]
pub struct PassTimes {
    latest: std::collections::VecDeque<u32>,
    /// Passes since the host started (the ring keeps [`PassTimes::KEPT`]).
    pub count: u64,
}

impl PassTimes {
    pub const KEPT: usize = 65_536;

    pub fn push(&mut self, took: Duration) {
        if self.latest.len() == Self::KEPT {
            self.latest.pop_front();
        }
        self.latest.push_back(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
        self.count += 1;
    }

    /// The kept durations, oldest first.
    pub fn latest_us(&self) -> Vec<u32> {
        self.latest.iter().copied().collect()
    }
}

impl Partition {
    pub fn new(name: String, mut fleet: Fleet, engine: EngineConfig) -> Partition {
        // Every release on the live fleet must name an outstanding allocation.
        fleet.track_allocations();
        Partition {
            name,
            models: Mutex::new(fleet.models.clone()),
            pass_times: Mutex::new(PassTimes::default()),
            state: Mutex::new(PartitionState {
                node_names: fleet.nodes().iter().enumerate().map(|(i, n)| (n.name.clone(), i as NodeId)).collect(),
                fleet,
                engine: Engine::new(engine),
                slots: HashMap::new(),
                stops: Vec::new(),
                jobs: BTreeMap::new(),
                pending: Vec::new(),
                running: BTreeSet::new(),
                dirty: false,
                retry_at: None,
                paused: false,
                agent_ids: BTreeMap::new(),
                is_agent: Vec::new(),
                health: BTreeMap::new(),
                manual: BTreeMap::new(),
                lost: BTreeSet::new(),
                by_alloc: HashMap::new(),
                activity: HashMap::new(),
                topology: BTreeMap::new(),
                forget_at: None,
                prune_at: None,
                compaction: LiveCompaction::new(Default::default(), true),
                clock: Arc::new(super::clock::SystemClock),
                harvest: None,
                harvest_seen_s: None,
                unstored_wakes: BTreeSet::new(),
                unstarted: BTreeSet::new(),
                credits: Default::default(),
                held: false,
                in_pass: false,
                swept_at: None,
                beats_taken: None,
                outcome: Default::default(),
                capture: None,
                captured_arms: None,
                captured_agents: Vec::new(),
            }),
            wake: Condvar::new(),
            place: HookSlot::default(),
            rank: HookSlot::default(),
            compact: HookSlot::default(),
            pool: HookSlot::default(),
            inbox: Mutex::new(Vec::new()),
            beats: Mutex::new(Beats::default()),
            reports: Mutex::new(Vec::new()),
            deciding: AtomicBool::new(false),
        }
    }

    /// The partition's state with every accepted job in it. Lock order:
    /// state, then inbox.
    pub fn lock_state(&self) -> MutexGuard<'_, PartitionState> {
        let mut st = self.state.lock().unwrap();
        let arrived = std::mem::take(&mut *self.inbox.lock().unwrap());
        for (id, record) in arrived {
            st.admit(id, record);
        }
        st.flush_capture();
        st
    }

    /// Whether accepted jobs wait to be moved into the state, or
    /// heartbeats to be reconciled with it.
    pub(super) fn inbox_waiting(&self) -> bool {
        self.jobs_waiting() || !self.beats.lock().unwrap().is_empty() || self.reports_waiting()
    }

    /// Whether agents' reports wait to be taken in.
    pub(super) fn reports_waiting(&self) -> bool {
        !self.reports.lock().unwrap().is_empty()
    }

    /// Whether accepted jobs wait to be moved into the state.
    pub(super) fn jobs_waiting(&self) -> bool {
        !self.inbox.lock().unwrap().is_empty()
    }

    /// The active version of a hook other than placement.
    pub fn aux(&self, hook: PolicyHook) -> &Mutex<Option<Arc<Arm>>> {
        match hook {
            PolicyHook::Place => &self.place.active,
            PolicyHook::Rank => &self.rank.active,
            PolicyHook::Compact => &self.compact.active,
            PolicyHook::Pool => &self.pool.active,
        }
    }

    /// The candidate in shadow of the rank or compact hook.
    pub fn aux_candidate(&self, hook: PolicyHook) -> &Mutex<Option<Arc<Arm>>> {
        match hook {
            PolicyHook::Compact => &self.compact.candidate,
            PolicyHook::Pool => &self.pool.candidate,
            _ => &self.rank.candidate,
        }
    }

    pub fn ranker(&self) -> Option<Arc<Arm>> {
        self.rank.active.lock().unwrap().clone()
    }

    pub fn active(&self) -> Option<Arc<Arm>> {
        self.place.active.lock().unwrap().clone()
    }

    pub fn candidate(&self) -> Option<Arc<Candidate>> {
        self.place.candidate.lock().unwrap().clone()
    }

    /// Asks the scheduler to walk the queue again.
    pub fn poke(&self, unpause: bool) {
        let mut st = self.lock_state();
        st.dirty = true;
        if unpause {
            st.paused = false;
        }
        self.wake.notify_all();
    }
}

/// GPU memory (MiB) a sleeping task may still use on a GPU that is lent:
/// about what a CUDA context keeps after an inference engine's own sleep
/// released its weights and cache.
pub const DEFAULT_LEND_MAX_MEMORY_MIB: u64 = 1024;

/// Everything the live host shares between the API and the schedulers.
pub struct Live {
    /// What the host decides by (see [`super::clock`]).
    pub clock: Arc<dyn super::clock::Clock>,
    pub partitions: Vec<Partition>,
    pub models: Vec<String>,
    pub registry: Registry,
    pub decisions: DecisionLog,
    pub metrics: Metrics,
    pub engine: Arc<PolicyEngine>,
    pub access: Access,
    pub limits: Limits,
    pub breaker: BreakerConfig,
    pub max_upload_bytes: usize,
    pub(crate) next_job: AtomicU64,
    /// Agent allocation ids (tasks and operator allocations share them).
    pub(crate) next_alloc: AtomicU64,
    /// The stored end of the block of allocation ids in use (see
    /// [`Live::next_alloc_id`]).
    pub(crate) alloc_ceiling: Mutex<u64>,
    /// Starts and stops processes on agent nodes (set once the hub exists;
    /// weak, as the hub holds the host).
    pub actuator: std::sync::OnceLock<std::sync::Weak<dyn Actuator>>,
    /// Where state is written (none: in memory only, for tests of the core paths).
    pub store: std::sync::OnceLock<Arc<dyn crate::store::Store>>,
    /// Records of what happened whose writes failed, by key (the latest
    /// value): written ahead of the next write that succeeds.
    pub(crate) unwritten: Mutex<std::collections::BTreeMap<String, crate::store::Op>>,
    /// The store refused a write: another host leads; this one stopped.
    pub fenced: AtomicBool,
    pub shutdown: AtomicBool,
    /// How much ended work is kept (see [`super::retention`]).
    pub retention: Retention,
    /// A sleeping job's GPUs are lent only when none of its tasks still
    /// uses more GPU memory than this on one GPU (MiB).
    pub lend_max_memory_mib: u64,
    /// The preemptible contract every partition's engine has: a job's own
    /// is this as its tier has it (read at submission without a lock).
    pub contract: berth_core::job::PriorityContract,
    /// Cost of a GPU-hour by GPU model (lower-case), from the fleet
    /// config's `cost_per_gpu_hour`: prices the outcome.
    pub cost_per_gpu_hour: BTreeMap<String, f64>,
    /// The fleet config's work model (`[work]`): the expected rate of a
    /// quoted copy.
    pub work: Option<crate::asi::fleet::WorkConfig>,
    /// Partitions that are model pools: they take requests, not jobs.
    pub pool_partitions: std::collections::BTreeSet<String>,
    /// The largest job id pruned so far (stored: ids are never reused).
    pub(crate) pruned_job_floor: AtomicU64,
    /// Submissions' idempotency keys: (owner, key) to the job it made, for
    /// the jobs kept. A key is claimed before its job's store write and the
    /// lock is not held across it: retries racing with the same key make
    /// one job (they wait for the first), other submissions do not wait.
    pub(crate) idempotency: Mutex<HashMap<(String, String), KeyedJob>>,
    /// Signalled when a keyed submission's store write is done (or failed).
    pub(crate) idempotency_settled: Condvar,
}

/// The job a submission's idempotency key made, and its spec's digest.
pub(crate) struct KeyedJob {
    pub(crate) job: u64,
    pub(crate) digest: String,
    /// False while the job's store write is in flight: a retry with the key
    /// waits for it (only that key's retries wait; other submissions go on).
    pub(crate) stored: bool,
}

/// A submission's idempotency key and the digest of the spec it came with.
#[derive(Clone, Debug)]
pub struct IdempotencyKey {
    pub key: String,
    pub digest: String,
}

/// Longest idempotency key accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY: usize = 128;

impl Live {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        partitions: Vec<Partition>,
        models: Vec<String>,
        registry: Registry,
        decisions: DecisionLog,
        engine: Arc<PolicyEngine>,
        access: Access,
        limits: Limits,
        breaker: BreakerConfig,
        max_upload_bytes: usize,
        clock: Arc<dyn super::clock::Clock>,
    ) -> Live {
        Live {
            clock,
            next_job: AtomicU64::new(decisions.max_job_id() + 1),
            next_alloc: AtomicU64::new(1),
            alloc_ceiling: Mutex::new(0),
            unwritten: Mutex::new(Default::default()),
            actuator: std::sync::OnceLock::new(),
            store: std::sync::OnceLock::new(),
            fenced: AtomicBool::new(false),
            partitions,
            models,
            registry,
            decisions,
            metrics: Metrics::new(),
            engine,
            access,
            limits,
            breaker,
            max_upload_bytes,
            shutdown: AtomicBool::new(false),
            retention: Default::default(),
            lend_max_memory_mib: DEFAULT_LEND_MAX_MEMORY_MIB,
            contract: Default::default(),
            cost_per_gpu_hour: BTreeMap::new(),
            work: None,
            pool_partitions: Default::default(),
            pruned_job_floor: AtomicU64::new(0),
            idempotency: Mutex::new(HashMap::new()),
            idempotency_settled: Condvar::new(),
        }
    }
    /// Drops `owner`'s idempotency key when it still names job `id`.
    pub(crate) fn forget_idempotency_key(&self, owner: &str, key: &str, id: u64) {
        let mut keys = self.idempotency.lock().unwrap();
        let k = (owner.to_string(), key.to_string());
        if keys.get(&k).is_some_and(|e| e.job == id) {
            keys.remove(&k);
        }
    }
    /// Seconds on the host's clock: the engine's `now`.
    pub fn now_s(&self) -> u64 {
        self.clock.unix_ms() / 1000
    }
    /// Milliseconds on the host's clock (job times in records).
    pub fn now_ms(&self) -> u64 {
        self.clock.unix_ms()
    }
    pub fn actuator(&self) -> Option<Arc<dyn Actuator>> {
        self.actuator.get().and_then(|w| w.upgrade())
    }
    pub fn partition_index(&self, name: &str) -> Result<usize, ServeError> {
        self.partitions.iter().position(|p| p.name == name).ok_or_else(|| ServeError::UnknownPartition(name.into()))
    }
}

pub(super) const DECLARED_DOMAIN_BASE: u32 = 1 << 24;

/// Largest switch or aggregation id an agent may declare.
pub const MAX_DECLARED_SWITCH: u32 = (1 << 24) - 1;

/// The fat-tree position an agent declares for its node (`berth agent
/// --switch-domain --aggregation`): nodes declaring the same access switch
/// form one switch domain for gang placement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentTopology {
    pub switch_domain: Option<u32>,
    pub aggregation: Option<u32>,
}

impl AgentTopology {
    /// The node's (switch domain, aggregation) in the fleet, given the id
    /// it gets when it declares nothing.
    pub(super) fn place(&self, own: u32) -> (u32, u32) {
        let domain = self.switch_domain.map_or(own, |d| DECLARED_DOMAIN_BASE + d);
        (domain, self.aggregation.map_or(domain, |a| DECLARED_DOMAIN_BASE + a))
    }
}

/// The policy hooks a partition versions separately: placement scoring,
/// preemption ranking, compaction planning and, on a pool partition, the
/// model pool's placement and steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyHook {
    Place,
    Rank,
    Compact,
    Pool,
}

impl PolicyHook {
    /// `place` (or empty), `rank` and `compact`.
    pub fn parse(s: &str) -> Result<PolicyHook, ServeError> {
        match s {
            "" | "place" => Ok(PolicyHook::Place),
            "rank" => Ok(PolicyHook::Rank),
            "compact" => Ok(PolicyHook::Compact),
            "pool" => Ok(PolicyHook::Pool),
            other => Err(ServeError::Invalid(format!("unknown hook \"{}\": place, rank, compact or pool", crate::text::printable(other, 64)))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyHook::Place => "place",
            PolicyHook::Rank => "rank",
            PolicyHook::Compact => "compact",
            PolicyHook::Pool => "pool",
        }
    }

    /// What decides when the hook has no active version.
    pub(super) fn fallback(self) -> &'static str {
        match self {
            PolicyHook::Place => "the previous version",
            PolicyHook::Rank => "the default ranking",
            PolicyHook::Compact => "nothing (live compaction stops)",
            PolicyHook::Pool => "the default pool placement and step",
        }
    }
}

/// The registry key of a partition's hook: its name for placement, and
/// `<name>:rank` or `<name>:compact` for the others.
pub fn hook_key(partition: &str, hook: PolicyHook) -> String {
    match hook {
        PolicyHook::Place => partition.to_string(),
        other => format!("{partition}:{}", other.as_str()),
    }
}

/// Chains kept in memory per partition (the store keeps every one).
pub(super) const LEDGER_KEEP: usize = 1000;

/// One move of a chain, as planned and as it went.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MoveRecord {
    pub job_id: u64,
    pub from_allocation: u64,
    /// The new copy (0 until started).
    pub to_allocation: u64,
    pub from_node: String,
    pub to_node: String,
    pub to_gpus: Vec<u32>,
    pub tier: String,
    pub state_bytes: u64,
    pub state: MoveState,
    /// Both copies held GPUs: from the new copy's start to the old one's exit.
    pub overlap_ms: u64,
    /// From the new copy's start to its takeover (running, or ready).
    pub warmup_ms: u64,
    pub cause: String,
    /// Verification: the task's rate before the move and on the
    /// destination after it, in thousandths of `rate_measure`'s unit, and
    /// the other tasks' CPU use on the destination node before and after,
    /// in thousandths of a core (0: not measured).
    #[serde(default)]
    pub rate_measure: String,
    #[serde(default)]
    pub rate_before_milli: u32,
    #[serde(default)]
    pub rate_after_milli: u32,
    #[serde(default)]
    pub neighbours_before_milli: u32,
    #[serde(default)]
    pub neighbours_after_milli: u32,
}

/// One chain run live: the ledger entry.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChainRecord {
    pub id: u64,
    pub policy: String,
    pub state: ChainState,
    pub cause: String,
    pub started_unix_ms: u64,
    pub ended_unix_ms: u64,
    /// Planned by selection: nodes freed, benefit and cost in GPU-seconds.
    pub nodes_freed: i64,
    pub benefit_gpu_s: f64,
    pub cost_gpu_s: f64,
    pub moves: Vec<MoveRecord>,
    /// Bytes moved by completed moves: same switch, same aggregation, across.
    pub bytes_by_tier: [u64; 3],
    pub idle_nodes_before: u32,
    pub idle_nodes_after: u32,
    pub pending_startable_before: u32,
    pub pending_startable_after: u32,
}

/// Where a snapshot row came from: the job, its task and the allocation.
#[derive(Clone, Copy, Debug)]
pub(super) struct Origin {
    pub(super) job_id: u64,
    pub(super) task: usize,
    pub(super) alloc_id: u64,
}

/// The move in flight.
#[derive(Debug)]
pub(super) struct InFlight {
    /// The plan's chain number, and its ledger id.
    pub(super) chain: u32,
    pub(super) chain_id: u64,
    pub(super) index: usize,
    pub(super) job_id: u64,
    pub(super) old_alloc: u64,
    pub(super) new_alloc: u64,
    pub(super) started: Instant,
    pub(super) took_over: Option<Instant>,
    /// Why the host stopped the new copy (a start timeout), if it did.
    pub(super) stopped_for: Option<String>,
    /// The task's index in its job, where it came from (node, GPUs), and
    /// its CPU rate there when it started (its destination neighbours' is
    /// in the ledger).
    pub(super) task: usize,
    pub(super) source: Allocation,
    pub(super) rate_before_milli: Option<u32>,
    /// Its work rate before the move (thousandths of a unit per second),
    /// where it reports progress: preferred to CPU use.
    pub(super) progress_before_milli: Option<u32>,
    /// Took over and being verified.
    pub(super) verify: Option<Verify>,
}

/// A move being verified: since when, the new copy's CPU time then, and
/// the source's GPUs reserved in the fleet (None: taken meanwhile).
#[derive(Debug)]
pub(super) struct Verify {
    pub(super) since: Instant,
    pub(super) cpu_ms_at: u64,
    pub(super) reserved: Option<Allocation>,
    pub(super) warmup_ms: u64,
    pub(super) overlap_ms: u64,
}

/// A step's chosen moves being run.
#[derive(Debug)]
pub(super) struct RunState {
    pub(super) cursor: Cursor,
    pub(super) origins: Vec<Origin>,
    /// Plan chain number to ledger id, and each move's index in its record.
    pub(super) chain_ids: HashMap<u32, u64>,
    pub(super) next_in_chain: HashMap<u64, usize>,
    /// The plan chain whose moves are being handed out.
    pub(super) chain: Option<u32>,
    pub(super) current: Option<InFlight>,
    pub(super) nodes: Vec<NodeId>,
    pub(super) pending: Vec<Wanted>,
}

/// A partition's live compaction: settings, the run in progress, the ledger.
#[derive(Debug, Default)]
pub struct LiveCompaction {
    pub config: CompactionConfig,
    /// Steps on their own (periodic, blocked whole-node jobs); off: on demand only.
    pub auto: bool,
    /// Hysteresis of the periodic step.
    pub(super) active: bool,
    pub(super) run: Option<RunState>,
    /// Newest last.
    pub records: Vec<ChainRecord>,
    pub(super) next_id: u64,
    pub(super) next_periodic: Option<Instant>,
    pub(super) next_blocked: Option<Instant>,
    /// The fleet's state digest and the queue (length, a sum of its ids
    /// mixed) when no
    /// whole-node job was found blocked: unchanged, the answer is the same
    /// (the check scans the queue, and a wake-up comes with every batch of
    /// heartbeats).
    pub(super) not_blocked_at: Option<(u64, usize, u64)>,
    /// Allocation id of a moved-in copy -> Unix s of the move (minimum residence).
    pub(super) moved_at: HashMap<u64, u64>,
}

impl LiveCompaction {
    pub fn new(config: CompactionConfig, auto: bool) -> LiveCompaction {
        LiveCompaction { config, auto, next_id: 1, ..LiveCompaction::default() }
    }

    pub(super) fn record_mut(&mut self, id: u64) -> Option<&mut ChainRecord> {
        self.records.iter_mut().rev().find(|r| r.id == id)
    }

    /// Takes back the ledger from the store; a chain left running by a
    /// host that stopped is abandoned (its move in flight, if any, is an
    /// ordinary migration the recovered jobs finish or roll back).
    pub(crate) fn restore(&mut self, mut records: Vec<ChainRecord>) -> Vec<ChainRecord> {
        records.sort_by_key(|r| r.id);
        let mut changed = Vec::new();
        for r in records.iter_mut().filter(|r| r.state == ChainState::Running) {
            r.state = ChainState::Abandoned;
            r.cause = "the host restarted during the chain".into();
            r.ended_unix_ms = unix_ms();
            changed.push(r.clone());
        }
        self.next_id = records.last().map_or(1, |r| r.id + 1);
        let skip = records.len().saturating_sub(LEDGER_KEEP);
        self.records = records.into_iter().skip(skip).collect();
        changed
    }
}

/// How much ended work the host keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// An ended job is kept (listed, explained, its idempotency key
    /// honoured) this long after it ended.
    pub ended_for: Duration,
    /// At most this many ended jobs per partition; the oldest leave first.
    pub ended_max: usize,
    /// The decision log's file is rotated past this many bytes.
    pub decision_log_bytes: u64,
    /// Rotated decision-log files kept beside the current one.
    pub decision_log_files: usize,
    /// Ended agent allocations the hub lists (the oldest leave first).
    pub ended_allocations: usize,
    /// Each partition's capture of its engine inputs keeps at most this
    /// many bytes (the oldest files are deleted); 0: no capture.
    pub capture_bytes: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { ended_for: Duration::from_secs(7 * 86_400), ended_max: 50_000, decision_log_bytes: 64 << 20, decision_log_files: 2, ended_allocations: 10_000, capture_bytes: 256 << 20 }
    }
}
