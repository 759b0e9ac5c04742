//! The live fleet and its schedulers: one thread per partition walks the
//! partition's queue (priority, then arrival) whenever something changed,
//! and decides each job through the core's `place_gang`, the same path as
//! replay. Jobs end after their duration in real time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use berth_core::engine::{Event, SimConfig as EngineConfig, Slot};
use berth_core::fleet::{gpus_of, Node, NodeId};
use berth_core::{Allocation, Engine, Fleet, Job, Placer, PolicyError, MILLI_PER_GPU};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::auth::Access;
use super::breaker::{self, Breaker, BreakerConfig};
use super::decisions::{DecisionLog, DecisionRecord, Placed};
use super::metrics::Metrics;
use super::persist::job_record_op;
use super::registry::{Registry, VersionMeta};
use super::shadow::{self, Mode, Recording};
use super::ServeError;
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// One loaded policy version with its instance, ready to decide.
pub struct Arm {
    pub meta: VersionMeta,
    pub(crate) policy: Mutex<WasmPolicy>,
}

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
        Ok(Arm { meta, policy: Mutex::new(policy) })
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
            checkpointed_unix_ms: 0,
            ready: false,
            stop_at_unix_ms: 0,
        }
    }
}

/// What starts and stops processes on agent nodes (the agent hub), so the
/// scheduler does not know about gRPC.
pub trait Actuator: Send + Sync {
    /// Starts one task; an error means it was not delivered.
    fn start(&self, start: Start<'_>) -> Result<(), String>;
    /// Asks the node to stop an allocation (best effort: the exit report
    /// is what frees the GPUs).
    fn stop(&self, alloc_id: u64, node: &str);
    /// Sends a checkpoint notice to an allocation (best effort).
    fn checkpoint(&self, alloc_id: u64, node: &str);
    /// Puts an allocation's processes to sleep, or wakes them (the agent's
    /// hooks; best effort: the agent reports "sleeping" or "running").
    fn sleep(&self, alloc_id: u64, node: &str, wake: bool);
}

pub struct Start<'a> {
    pub alloc_id: u64,
    pub job_id: u64,
    pub node: &'a str,
    pub gpus: &'a [u32],
    pub argv: &'a [String],
    pub env: &'a BTreeMap<String, String>,
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
    /// Preempted: its processes are stopping under the priority contract;
    /// it runs again once they are gone.
    pub evicting: bool,
    /// Preempted jobs whose processes must be gone before this job's tasks
    /// start on their GPUs.
    pub waiting_on: Vec<u64>,
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
    pub topology: BTreeMap<NodeId, super::actuation::AgentTopology>,
    /// When ended jobs are next taken out of the engine.
    forget_at: Option<Instant>,
    /// When ended jobs past retention are next removed.
    prune_at: Option<Instant>,
    /// Live compaction: settings, the chain being run, the ledger.
    pub compaction: super::compacting::LiveCompaction,
    /// The host's clock (see [`super::clock`]).
    pub clock: Arc<dyn super::clock::Clock>,
    /// The harvest schedule, and when it last looked (seconds on the clock).
    pub(crate) harvest: Option<berth_core::harvest::Harvest>,
    pub(crate) harvest_seen_s: Option<u64>,
    /// Held: no decisions are made (submissions and ends are taken in).
    pub(crate) held: bool,
    /// A pass is running outside the lock.
    in_pass: bool,
}

/// The allocation that keeps an unhealthy GPU out of placement.
pub(crate) fn health_hold(node: NodeId, gpu: u32) -> Allocation {
    Allocation { node, gpus: 1 << gpu, gpu_milli: MILLI_PER_GPU, cpu_milli: 0, memory_mib: 0 }
}

/// How often ended jobs are taken out of a partition's engine.
const FORGET_EVERY: Duration = Duration::from_secs(1);

/// Planning length of a job with a command and no time limit: it ends when
/// its processes do, which the engine cannot know.
const UNLIMITED_PLAN_S: u64 = 365 * 86_400;

impl PartitionState {
    /// Takes ended jobs out of the engine's table (their records stay), so
    /// a long-lived host's engine holds only work that may still run.
    fn forget_ended(&mut self) {
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

    /// Whether a pass is due at `now`: something changed or a failed pass
    /// is to be retried, jobs wait, and decisions are neither paused by the
    /// breaker nor held.
    fn wants_pass(&self, now: Instant) -> bool {
        (self.dirty || self.retry_at.is_some_and(|t| t <= now)) && !self.pending.is_empty() && !self.paused && !self.held
    }

    /// An evicted simulated job's modelled vacate time, as an instant.
    fn wakeup(&self, now: Instant) -> Option<Instant> {
        let now_ms = self.clock.unix_ms();
        self.engine.next_wakeup().map(|t| now + Duration::from_millis((t * 1000).saturating_sub(now_ms)))
    }

    /// When something is next due here on its own: a run's planned end, a
    /// retry of a failed pass, a stop after a notice, a modelled vacate time.
    fn next_due(&self, now: Instant) -> Option<Instant> {
        let next_end = self.running.first().map(|(t, _)| *t);
        let next_stop = self.stops.iter().map(|s| s.0).min();
        [next_end, self.retry_at, next_stop, self.wakeup(now)].into_iter().flatten().min()
    }

    /// Takes in a newly accepted job: recorded, in the engine, queued.
    fn admit(&mut self, id: u64, record: JobRecord) {
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

    /// Milli-GPU doing measured work on node `i`: simulated nodes always
    /// work; on agent nodes only GPUs whose SM utilisation reached the
    /// threshold (held unhealthy GPUs never).
    pub fn productive_milli(&self, i: usize, n: &Node) -> u64 {
        let id = i as NodeId;
        if !self.agent_ids.values().any(|&a| a == id) {
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

pub struct Partition {
    pub name: String,
    pub state: Mutex<PartitionState>,
    pub(crate) wake: Condvar,
    /// The swap point: read once per decision.
    pub active: Mutex<Option<Arc<Arm>>>,
    pub candidate: Mutex<Option<Arc<Candidate>>>,
    pub stats: Mutex<shadow::Stats>,
    pub breaker: Mutex<Breaker>,
    /// The rank hook's active version (none: the documented default
    /// ranking), and its breaker.
    pub ranker: Mutex<Option<Arc<Arm>>>,
    pub rank_breaker: Mutex<Breaker>,
    /// A rank version in shadow beside `ranker`, and what it would have done.
    pub rank_candidate: Mutex<Option<Arc<Arm>>>,
    pub rank_stats: Mutex<shadow::RankStats>,
    /// The compact hook's active version (none: no live compaction), and
    /// its breaker.
    pub compactor: Mutex<Option<Arc<Arm>>>,
    pub compact_breaker: Mutex<Breaker>,
    /// A compact version in shadow: it plans on every step's snapshot too
    /// (never run), and the plans are tallied.
    pub compact_candidate: Mutex<Option<Arc<Arm>>>,
    pub compact_stats: Mutex<shadow::CompactStats>,
    /// Jobs accepted and stored but not yet in `state`: a submission never
    /// waits for the state lock, which the deciding thread holds through its
    /// policy calls. Whoever takes the lock next moves them in.
    inbox: Mutex<Vec<(u64, JobRecord)>>,
    /// A pass is running (read without the state's lock, which a pass holds
    /// through its policy calls).
    deciding: AtomicBool,
    /// The fleet's GPU models (agents add theirs), for validating a
    /// submission without the state lock.
    pub(crate) models: Mutex<Vec<String>>,
}

impl Partition {
    pub fn new(name: String, fleet: Fleet, engine: EngineConfig) -> Partition {
        Partition {
            name,
            models: Mutex::new(fleet.models.clone()),
            state: Mutex::new(PartitionState {
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
                health: BTreeMap::new(),
                manual: BTreeMap::new(),
                lost: BTreeSet::new(),
                by_alloc: HashMap::new(),
                activity: HashMap::new(),
                topology: BTreeMap::new(),
                forget_at: None,
                prune_at: None,
                compaction: super::compacting::LiveCompaction::new(Default::default(), true),
                clock: Arc::new(super::clock::SystemClock),
                harvest: None,
                harvest_seen_s: None,
                held: false,
                in_pass: false,
            }),
            wake: Condvar::new(),
            active: Mutex::new(None),
            candidate: Mutex::new(None),
            stats: Mutex::new(shadow::Stats::default()),
            breaker: Mutex::new(Breaker::default()),
            ranker: Mutex::new(None),
            rank_breaker: Mutex::new(Breaker::default()),
            rank_candidate: Mutex::new(None),
            rank_stats: Mutex::new(shadow::RankStats::default()),
            compactor: Mutex::new(None),
            compact_breaker: Mutex::new(Breaker::default()),
            compact_candidate: Mutex::new(None),
            compact_stats: Mutex::new(shadow::CompactStats::default()),
            inbox: Mutex::new(Vec::new()),
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
        st
    }

    /// Whether accepted jobs wait to be moved into the state.
    fn inbox_waiting(&self) -> bool {
        !self.inbox.lock().unwrap().is_empty()
    }

    /// The active version of a hook other than placement.
    pub fn aux(&self, hook: super::control::PolicyHook) -> &Mutex<Option<Arc<Arm>>> {
        match hook {
            super::control::PolicyHook::Place => &self.active,
            super::control::PolicyHook::Rank => &self.ranker,
            super::control::PolicyHook::Compact => &self.compactor,
        }
    }

    /// The candidate in shadow of the rank or compact hook.
    pub fn aux_candidate(&self, hook: super::control::PolicyHook) -> &Mutex<Option<Arc<Arm>>> {
        match hook {
            super::control::PolicyHook::Compact => &self.compact_candidate,
            _ => &self.rank_candidate,
        }
    }

    pub fn ranker(&self) -> Option<Arc<Arm>> {
        self.ranker.lock().unwrap().clone()
    }

    pub fn active(&self) -> Option<Arc<Arm>> {
        self.active.lock().unwrap().clone()
    }

    pub fn candidate(&self) -> Option<Arc<Candidate>> {
        self.candidate.lock().unwrap().clone()
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
    /// The store refused a write: another host leads; this one stopped.
    pub fenced: AtomicBool,
    pub shutdown: AtomicBool,
    /// How much ended work is kept (see [`super::retention`]).
    pub retention: super::retention::Retention,
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

/// Longest a retry waits for the first submission with its key.
const KEYED_WAIT: Duration = Duration::from_secs(30);

/// A submission's idempotency key and the digest of the spec it came with.
#[derive(Clone, Debug)]
pub struct IdempotencyKey {
    pub key: String,
    pub digest: String,
}

/// Longest idempotency key accepted, in bytes.
pub const MAX_IDEMPOTENCY_KEY: usize = 128;

/// What a breaker trip did to the partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trip {
    None,
    /// The version is out of service; another decides (or the candidate is gone).
    Replaced,
    /// No good version to fall back to: decisions wait for an operator.
    Paused,
}

/// One arm's run on one job.
pub(super) struct ArmRun {
    pub result: Result<Option<(Vec<Allocation>, u32)>, PolicyError>,
    pub first: Option<(Vec<u32>, Vec<f64>)>,
    pub latency: Duration,
}

type Keep<'a> = &'a dyn Fn(NodeId, &Node) -> bool;

pub(super) fn run_arm(arm: &Arm, fleet: &mut Fleet, placer: &mut Placer, job: &Job, keep: Keep<'_>) -> ArmRun {
    let mut policy = arm.policy.lock().unwrap();
    let mut recording = Recording { inner: &mut *policy, first: None };
    let started = Instant::now();
    let mut placements = 0;
    let result = berth_core::sim::place_gang(fleet, placer, &mut recording, job, &mut placements, keep);
    ArmRun { latency: started.elapsed(), first: recording.first, result }
}

/// Nodes neither idle nor full: a measure of fragmentation.
pub(super) fn partly_used(fleet: &Fleet) -> u64 {
    fleet.nodes().iter().filter(|n| !n.gpus.is_empty() && n.gpu_free_milli() > 0 && n.gpu_free_milli() < n.gpu_total_milli()).count() as u64
}

/// SHA-256 (16 hex) of the job and the free capacity the policy sees.
pub(super) fn input_digest(fleet: &Fleet, job: &Job) -> String {
    let mut h = Sha256::new();
    let s = &job.shape;
    h.update(format!("{}|{}|{}|{}|{}|{}|{}|{:?}", job.id, job.priority, job.tasks, s.gpu_count, s.gpu_milli, s.cpu_milli, s.memory_mib, s.models));
    for n in fleet.nodes() {
        h.update([u8::from(n.schedulable)]);
        h.update(n.cpu_free_milli.to_le_bytes());
        h.update(n.memory_free_mib.to_le_bytes());
        for g in &n.gpus {
            h.update(g.to_le_bytes());
        }
    }
    hex::encode(&h.finalize()[..8])
}

pub(super) fn placed(fleet: &Fleet, allocs: &[Allocation]) -> Vec<Placed> {
    allocs
        .iter()
        .map(|a| Placed {
            node: fleet.nodes()[a.node as usize].name.clone(),
            gpus: berth_core::fleet::gpus_of(a.gpus).map(|g| g as u32).collect(),
        })
        .collect()
}

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

    /// Stops the scheduler threads (they finish the decision in hand).
    pub fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        for p in &self.partitions {
            p.poke(false);
        }
    }

    /// Accepts a job into its partition's queue; the id is the caller's
    /// receipt: from here on the job is never dropped. With an idempotency
    /// key that `owner` used before for a job still kept, nothing new is
    /// made: the answer is that job's id and `true`.
    pub fn submit(&self, mut spec: JobSpec, owner: &str, idempotency: Option<IdempotencyKey>) -> Result<(u64, bool), ServeError> {
        let p = self.partition_index(&spec.partition)?;
        let keyed = idempotency.as_ref().map(|k| (owner.to_string(), k.key.clone()));
        let id = match (&keyed, &idempotency) {
            (Some(slot), Some(k)) => {
                let mut keys = self.idempotency.lock().unwrap();
                let since = std::time::Instant::now();
                loop {
                    match keys.get(slot) {
                        None => break,
                        // The first submission with this key is being stored.
                        Some(e) if !e.stored => {
                            let left = KEYED_WAIT.checked_sub(since.elapsed()).ok_or_else(|| {
                                ServeError::Unavailable(format!("a submission with idempotency key \"{}\" is still being stored: retry", crate::text::printable(&k.key, MAX_IDEMPOTENCY_KEY)))
                            })?;
                            keys = self.idempotency_settled.wait_timeout(keys, left).unwrap().0;
                        }
                        Some(e) if e.digest == k.digest => return Ok((e.job, true)),
                        Some(e) => {
                            return Err(ServeError::FailedPrecondition(format!(
                                "idempotency key \"{}\" was used for job {} with a different job spec",
                                crate::text::printable(&k.key, MAX_IDEMPOTENCY_KEY),
                                e.job
                            )));
                        }
                    }
                }
                let id = self.next_job.fetch_add(1, Ordering::SeqCst);
                keys.insert(slot.clone(), KeyedJob { job: id, digest: k.digest.clone(), stored: false });
                id
            }
            _ => self.next_job.fetch_add(1, Ordering::SeqCst),
        };
        spec.job.id = id;
        let part = &self.partitions[p];
        let record = JobRecord {
            spec,
            owner: owner.to_string(),
            state: JobState::Pending,
            submitted_at: self.clock.now(),
            submitted_unix_ms: self.now_ms(),
            started_unix_ms: 0,
            ended_unix_ms: 0,
            ends_at: None,
            allocations: Vec::new(),
            placements: Vec::new(),
            decision_id: 0,
            policy_version: 0,
            last_decision: String::new(),
            runs: Vec::new(),
            detail: String::new(),
            evicting: false,
            waiting_on: Vec::new(),
            interruptions: 0,
            interrupted_s: Vec::new(),
            reserved_until_s: 0,
            sleep: SleepState::Awake,
            idempotency_key: idempotency.as_ref().map(|k| k.key.clone()).unwrap_or_default(),
            spec_digest: idempotency.as_ref().map(|k| k.digest.clone()).unwrap_or_default(),
        };
        // The id is a receipt only once the job is stored. A pending job
        // holds no allocations, so its record names no node.
        let stored = self.persist(vec![job_record_op(&part.name, id, &record, |_| unreachable!("a new job holds nothing"))]);
        // Queued before a retry with its key can be answered with it.
        if stored.is_ok() {
            part.inbox.lock().unwrap().push((id, record));
            self.metrics.jobs.with_label_values(&[&part.name, "pending"]).inc();
        }
        if let Some(slot) = &keyed {
            let mut keys = self.idempotency.lock().unwrap();
            if stored.is_ok() {
                if let Some(e) = keys.get_mut(slot).filter(|e| e.job == id) {
                    e.stored = true;
                }
            } else if keys.get(slot).is_some_and(|e| e.job == id) {
                // Not a receipt: a retry with the key makes the job anew.
                keys.remove(slot);
            }
            self.idempotency_settled.notify_all();
        }
        stored?;
        // Not under the state lock, so the deciding thread may miss this
        // between its inbox check and its wait: it then sees the job within
        // its longest wait (1 s).
        part.wake.notify_all();
        Ok((id, false))
    }

    /// The job of allocation `alloc` in `partition`, if harvesting manages
    /// it (sleepable, or put to sleep and not yet awake): its tasks sleep
    /// and wake only through the engine.
    pub fn harvested_job_of(&self, partition: &str, alloc: u64) -> Option<u64> {
        let p = self.partition_index(partition).ok()?;
        let st = self.partitions[p].lock_state();
        let job = *st.by_alloc.get(&alloc).filter(|&&j| j != 0)?;
        st.jobs.get(&job).filter(|j| j.spec.sleepable || j.sleep != SleepState::Awake).map(|_| job)
    }

    /// Finds the partition holding a job.
    pub fn job_partition(&self, id: u64) -> Result<usize, ServeError> {
        self.partitions.iter().position(|p| p.lock_state().jobs.contains_key(&id)).ok_or(ServeError::UnknownJob(id))
    }

    /// Cancels a pending or running job (releasing what it holds); returns
    /// its state before.
    pub fn cancel(&self, p: usize, id: u64) -> Result<JobState, ServeError> {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        let st = &mut *st;
        let job = st.jobs.get_mut(&id).ok_or(ServeError::UnknownJob(id))?;
        let before = job.state;
        let slot = st.slots.get(&id).copied();
        match before {
            JobState::Pending => {
                st.pending.retain(|&j| j != id);
                if let Some(slot) = slot {
                    st.engine.apply(&mut st.fleet, self.now_s(), Event::Cancel(slot));
                }
                // A preempted job's processes may still be in their notice:
                // cancelled, they have nothing to checkpoint for, and stop
                // now. Their exits free the GPUs (draining till then).
                if job.evicting
                    && let Some(act) = self.actuator()
                {
                    for r in job.runs.iter().filter(|r| r.holds) {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
            }
            JobState::Running if !job.runs.is_empty() || !job.waiting_on.is_empty() => {
                // Processes hold their GPUs until their exit is reported.
                if let Some(t) = job.ends_at.take() {
                    st.running.remove(&(t, id));
                }
                if job.runs.is_empty() {
                    // Waiting for preempted work to stop: nothing started.
                    // Its GPUs drain in the engine until that work is gone.
                    job.waiting_on.clear();
                    if let Some(slot) = slot {
                        st.engine.apply(&mut st.fleet, self.now_s(), Event::Cancel(slot));
                    }
                } else if let Some(act) = self.actuator() {
                    for r in job.runs.iter().filter(|r| r.holds) {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
            }
            JobState::Running => {
                job.allocations.clear();
                if let Some(t) = job.ends_at.take() {
                    st.running.remove(&(t, id));
                }
                if let Some(slot) = slot {
                    st.engine.apply(&mut st.fleet, self.now_s(), Event::Cancel(slot));
                }
            }
            JobState::Finished | JobState::Failed | JobState::Cancelled => {
                return Err(ServeError::FailedPrecondition(format!("job {id} is already {}", before.as_str())));
            }
        }
        let job = st.jobs.get_mut(&id).expect("found above");
        job.state = JobState::Cancelled;
        job.sleep = SleepState::Awake;
        job.ended_unix_ms = self.now_ms();
        self.persist_logged(vec![st.job_op(&part.name, id)]);
        self.metrics.jobs.with_label_values(&[&part.name, before.as_str()]).dec();
        self.metrics.jobs.with_label_values(&[&part.name, "cancelled"]).inc();
        st.dirty = true;
        part.wake.notify_all();
        Ok(before)
    }

    /// The scheduler of partition `p`; returns at shutdown.
    pub fn run_partition(&self, p: usize) {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        while !self.shutdown.load(Ordering::SeqCst) {
            let now = self.clock.now();
            self.release_ended(&part.name, &mut st, now);
            self.due_stops(&mut st, now);
            if st.forget_at.is_none_or(|t| t <= now) {
                st.forget_ended();
                st.forget_at = Some(now + FORGET_EVERY);
            }
            if st.prune_at.is_none_or(|t| t <= now) {
                self.prune_ended(part, &mut st);
                st.prune_at = Some(now + super::retention::PRUNE_EVERY);
            }
            // An evicted simulated job is ready again at its modelled time.
            if st.engine.take_due_wakeups(self.now_s()) {
                st.dirty = true;
            }
            self.compaction_tick(p, &mut st, now);
            self.harvest_tick(part, &mut st);
            if part.inbox_waiting() {
                // Taken in by lock_state.
                drop(st);
                st = part.lock_state();
                continue;
            }
            if st.wants_pass(now) {
                st.dirty = false;
                st.retry_at = None;
                st.in_pass = true;
                drop(st);
                part.deciding.store(true, Ordering::SeqCst);
                self.pass(p);
                part.deciding.store(false, Ordering::SeqCst);
                st = part.lock_state();
                st.in_pass = false;
                continue;
            }
            let until = st.next_due(now).unwrap_or(now + Duration::from_secs(1));
            let wait = until.saturating_duration_since(now).clamp(Duration::from_millis(1), Duration::from_secs(1));
            st = part.wake.wait_timeout(st, wait).unwrap().0;
        }
    }

    /// Holds partition `p`'s decisions (or lets them go on): while held,
    /// submissions, ends and reports are taken in and nothing is decided.
    /// A host driven by a [`super::clock::ManualClock`] holds while it
    /// feeds the events of one moment, so they meet one pass, as in replay.
    pub fn hold(&self, p: usize, held: bool) {
        let part = &self.partitions[p];
        part.lock_state().held = held;
        part.wake.notify_all();
    }

    /// Whether partition `p` is in a pass; never waits for one.
    pub fn deciding(&self, p: usize) -> bool {
        self.partitions[p].deciding.load(Ordering::SeqCst)
    }

    /// Waits (blocking, polling every millisecond) until partition `p` is
    /// [`Live::settled`], at most `within`; whether it did. For drivers of
    /// a host on a [`super::clock::ManualClock`].
    pub fn wait_settled(&self, p: usize, within: Duration) -> bool {
        let started = Instant::now();
        while !self.settled(p) {
            if started.elapsed() > within {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Whether partition `p` has taken in and decided everything due at
    /// its clock's now (nothing waits in the inbox, no pass is running or
    /// wanted, no end or modelled vacate time is due).
    pub fn settled(&self, p: usize) -> bool {
        let part = &self.partitions[p];
        if part.inbox_waiting() {
            return false;
        }
        let st = part.lock_state();
        let now = self.clock.now();
        !st.in_pass && !st.wants_pass(now) && st.running.first().is_none_or(|(t, _)| *t > now) && st.engine.next_wakeup().is_none_or(|t| t > self.now_s())
    }

    /// The next moment something is due in partition `p` on its own (a
    /// run's planned end, an evicted job's modelled vacate time), in
    /// seconds on the host's clock.
    pub fn next_due_s(&self, p: usize) -> Option<u64> {
        let st = self.partitions[p].lock_state();
        let now = self.clock.now();
        st.next_due(now).map(|t| self.now_s() + t.saturating_duration_since(now).as_millis().div_ceil(1000) as u64)
    }

    /// Stops preempted processes whose notice ran out.
    fn due_stops(&self, st: &mut PartitionState, now: Instant) {
        if st.stops.iter().all(|s| s.0 > now) {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut st.stops).into_iter().partition(|s| s.0 <= now);
        st.stops = later;
        if let Some(act) = self.actuator() {
            for (_, alloc, node) in due {
                act.stop(alloc, &node);
            }
        }
    }

    fn release_ended(&self, partition: &str, st: &mut PartitionState, now: Instant) {
        while let Some(&(t, id)) = st.running.first() {
            if t > now {
                break;
            }
            st.running.pop_first();
            let job = st.jobs.get_mut(&id).expect("running jobs are recorded");
            if !job.runs.is_empty() {
                // A time limit: stop the processes; their exits free the GPUs.
                job.ends_at = None;
                job.detail = "time limit reached: stopped".into();
                if let Some(act) = self.actuator() {
                    for r in job.runs.iter().filter(|r| r.holds) {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
                self.persist_logged(vec![st.job_op(partition, id)]);
                continue;
            }
            if !job.waiting_on.is_empty() {
                // Its GPUs drain in the engine until the victims are gone.
                job.detail = format!("time limit reached while preempted job(s) {:?} were still stopping: nothing ran", job.waiting_on);
                job.waiting_on.clear();
            }
            job.allocations.clear();
            job.state = JobState::Finished;
            job.sleep = SleepState::Awake;
            job.ends_at = None;
            job.ended_unix_ms = self.now_ms();
            if let Some(&slot) = st.slots.get(&id) {
                st.engine.apply(&mut st.fleet, self.now_s(), Event::End(slot));
            }
            self.persist_logged(vec![st.job_op(partition, id)]);
            self.metrics.jobs.with_label_values(&[partition, "running"]).dec();
            self.metrics.jobs.with_label_values(&[partition, "finished"]).inc();
            st.dirty = true;
        }
    }

    /// Records a shadow comparison of the two arms' decisions on one job.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compare(&self, part: &Partition, job: &Job, active: &ArmRun, fleet: &Fleet, cand: &ArmRun, scratch: &Fleet, shadow_decision: u64) {
        let mut stats = part.stats.lock().unwrap();
        let (Ok(a), Ok(c)) = (&active.result, &cand.result) else {
            if cand.result.is_err() {
                stats.candidate_errors += 1;
            }
            return;
        };
        let agree = match (a, c) {
            (Some((x, _)), Some((y, _))) => x == y,
            (None, None) => true,
            _ => false,
        };
        let picks = a.as_ref().zip(c.as_ref()).map(|((x, _), (y, _))| (x[0].node, y[0].node));
        let sample = shadow::Sample {
            job_id: job.id,
            agree,
            candidate_gap: picks.and_then(|(ap, cp)| shadow::score_gap(&cand.first, cp, ap)),
            active_gap: picks.and_then(|(ap, cp)| shadow::score_gap(&active.first, ap, cp)),
            domains: a.as_ref().zip(c.as_ref()).filter(|_| job.tasks > 1).map(|((_, da), (_, dc))| (*da, *dc)),
            partial_after: (partly_used(fleet), partly_used(scratch)),
        };
        let diff = (!agree).then(|| shadow::Diff {
            decision_id: shadow_decision,
            job_id: job.id,
            active: a.as_ref().map(|(x, _)| placed(fleet, x)).unwrap_or_default(),
            candidate: c.as_ref().map(|(y, _)| placed(scratch, y)).unwrap_or_default(),
            note: match (a, c) {
                (Some(_), None) => "candidate found no room".into(),
                (None, Some(_)) => "active found no room".into(),
                _ => "different nodes or GPUs".into(),
            },
        });
        self.metrics.shadow_samples.with_label_values(&[part.name.as_str(), if agree { "true" } else { "false" }]).inc();
        stats.add_sample(sample, diff);
    }

    /// Logs one arm's decision and counts it; returns the decision id.
    pub(super) fn log(&self, base: &DecisionRecord, arm_name: &str, actuated: bool, arm: &Arm, run: &ArmRun, fleet: &Fleet) -> u64 {
        let (outcome, detail, placements) = match &run.result {
            Ok(Some((allocs, domains))) => ("placed", format!("{} task(s) in {domains} switch domain(s)", allocs.len()), placed(fleet, allocs)),
            Ok(None) => ("unplaced", "no room for every task now".to_string(), Vec::new()),
            Err(e) => ("error", e.to_string(), Vec::new()),
        };
        let m = &arm.meta;
        let version = m.version.to_string();
        self.metrics.decisions.with_label_values(&[&base.partition, &m.name, &version, arm_name, outcome]).inc();
        self.metrics.decision_seconds.with_label_values(&[&base.partition, &m.name, &version, arm_name]).observe(run.latency.as_secs_f64());
        self.decisions.append(DecisionRecord {
            arm: arm_name.into(),
            actuated,
            policy: m.name.clone(),
            policy_semver: m.semver.clone(),
            policy_version: m.version,
            sha256: m.sha256.clone(),
            outcome: outcome.into(),
            detail,
            placements,
            latency_us: run.latency.as_micros() as u64,
            ..base.clone()
        })
    }

    /// Feeds the breaker; on a trip, takes the version out of service.
    pub(super) fn after_call(&self, p: usize, arm: &Arc<Arm>, run: &ArmRun, is_active: bool) -> Trip {
        let part = &self.partitions[p];
        let v = arm.meta.version;
        let call = match &run.result {
            Ok(_) => breaker::Call::Answered(run.latency),
            Err(e) if breaker::counts(e) => {
                self.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &v.to_string(), breaker::kind(e)]).inc();
                tracing::warn!(target: "berth::serve", partition = %part.name, version = v, "policy call failed: {e}");
                breaker::Call::Failed(e)
            }
            Err(_) => return Trip::None,
        };
        // Bound first: trip() takes the breaker's lock again.
        let tripped = part.breaker.lock().unwrap().record(v, call, &self.breaker);
        match tripped {
            None => Trip::None,
            Some(reason) => self.trip(p, arm, &reason, is_active),
        }
    }
}
