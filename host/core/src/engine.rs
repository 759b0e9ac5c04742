//! The scheduling engine: one deterministic state machine that trace replay
//! and the live host both drive. The world hands it events that happened at
//! a time it chooses (a job submitted, a run ended, an evicted run gone, a
//! checkpoint, capacity changed outside it, a harvest boundary, a compaction
//! tick) and gets back decisions (placements, evictions under the priority
//! contract, reservations of the starvation guard). Queue order, the
//! predicate, gang placement, preemption, the guard, harvesting and
//! compaction live here once; replay applies the decisions to a simulated
//! fleet, `berth serve` actuates them through node agents.
//!
//! No IO and no wall clock: `now` is seconds on the world's clock.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

use crate::capacity::{fitting_tasks_among, tasks_on_node};
use crate::compaction::{CompactionConfig, CompactionPolicy, CompactionState, Ledger};
use crate::fleet::{Allocation, Fleet, Node, NodeId};
use crate::harvest::Harvest;
use crate::job::{Job, PriorityContract};
use crate::placement::{place_fitting_gang, Placer};
use crate::policy::{PlacementPolicy, PolicyError};
use crate::preemption::{evict, select_victims, Candidate, EvictionLatency, PreemptionPolicy};
use crate::task::TaskShape;

/// What happened to one job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobOutcome {
    /// Start time; `None` if it never started before the horizon.
    pub start_s: Option<u64>,
    /// Distinct switch domains its tasks landed in (its last run).
    pub domains: u32,
    /// When it finished; `None` if it had not by the horizon.
    pub end_s: Option<u64>,
    /// Times it was preempted, of which forced terminations.
    pub interruptions: u32,
    pub forced: u32,
    /// GPU-seconds of work lost to preemption (recomputed after resuming).
    pub lost_gpu_s: f64,
    /// GPU-seconds of its work done and kept by the end (goodput, at the
    /// reference rate: a job's `duration_s` is its work; see [`WorkRates`]).
    pub work_gpu_s: f64,
    /// GPU-hours its tenant is owed for lost work and broken promises
    /// (priced by [`SimConfig::compensation`]), and the promises broken.
    pub credit_gpu_h: f64,
    pub broken: u32,
}

/// Allocation sampled over time, integrated exactly between events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Utilisation {
    /// Integral of allocated milli-GPU over time (milli-GPU x seconds).
    pub all_milli_s: f64,
    /// The same counting only jobs at or above the high-priority threshold.
    pub high_milli_s: f64,
    /// Seconds covered.
    pub seconds: f64,
}

/// What the engine counted over its life (replay reports read it).
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// Indexed like the engine's job slots (replay: like the input jobs).
    pub jobs: Vec<JobOutcome>,
    pub utilisation: Utilisation,
    /// Scheduling passes run and placement calls made.
    pub passes: u64,
    pub placements: u64,
    /// Reservations the starvation guard made.
    pub reservations: u64,
    /// Preemptions: jobs evicted, of which forced terminations, and the
    /// GPU-seconds of work they lost.
    pub evictions: u64,
    pub forced_terminations: u64,
    pub lost_gpu_s: f64,
    /// GPU-hours owed to tenants (see [`JobOutcome::credit_gpu_h`]), and
    /// the promises broken.
    pub credit_gpu_h: f64,
    pub broken_promises: u64,
    /// Seconds each eviction took to vacate (ASI: 13 s mean, 48 s p95).
    pub vacate_s: Vec<u64>,
    /// Harvesting: GPU-seconds of sleeping replicas (standby), the part of
    /// it low-priority work used, replicas put to sleep, borrowers evicted
    /// to wake them, and replicas that could not wake on their GPUs.
    pub standby_gpu_s: f64,
    pub harvested_gpu_s: f64,
    pub sleeps: u64,
    pub wake_evictions: u64,
    pub wake_failures: u64,
    /// Compaction's migration ledger, summed over its steps.
    pub compaction: Ledger,
    /// GPU-seconds of training work lost to CPU-only neighbours (the
    /// [`Interference`] model; 0 without it): held and busy, not productive.
    pub interference_lost_gpu_s: f64,
    /// Jobs still waiting at the end, and the work still running (planned
    /// end, allocations) — the state accounting and quotes look at.
    pub pending_at_end: Vec<usize>,
    pub running_at_end: Vec<(u64, usize, Vec<Allocation>)>,
    /// Simulated time at the end.
    pub end_s: u64,
}

/// Engine settings.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimConfig {
    /// Replay stops at this simulated time (the live host ignores it).
    pub horizon_s: u64,
    /// Jobs with priority >= this are high priority: they may preempt, and
    /// count in high-priority utilisation; below it jobs are low priority
    /// (fill), candidate victims and borrowers of lent GPUs.
    pub high_priority: u32,
    /// Keeps large gangs from waiting forever behind streams of small jobs.
    pub guards: Guards,
    /// Preemption: the contract of low-priority jobs that name none, how
    /// long evictions take, and partitions whose work is never taken back.
    pub contract: PriorityContract,
    pub eviction: EvictionLatency,
    pub protected_partitions: BTreeSet<u32>,
    /// Sleep-state harvesting of idle replicas in the daily trough.
    pub harvest: Option<Harvest>,
    /// How fast placed work advances (`None`: every run at the reference
    /// rate, a job running exactly its `duration_s`).
    pub work: Option<WorkRates>,
    /// What CPU-only neighbours cost training (`None`: nothing).
    pub interference: Option<Interference>,
    /// What lost work and broken promises are credited.
    pub compensation: crate::contract::Compensation,
}

/// Replay's interference model (ASI: CPU-only jobs lower the median
/// training job's SM utilisation by 10%, the 90th percentile's by 18%). A
/// training run sharing any node with CPU-only work loses a share of what
/// its GPUs produce for as long as it does: its own share, drawn once per
/// job from a lognormal with the given median and 90th percentile (capped
/// at 90%). The GPUs stay held for the run's time: the loss shows in the
/// outcome (completed work), not in allocation, as the paper says a busy
/// fleet can hide it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Interference {
    pub median_loss: f64,
    pub p90_loss: f64,
}

impl Interference {
    /// The seed's figures: 10% median, 18% at the 90th percentile.
    pub const ASI: Interference = Interference { median_loss: 0.10, p90_loss: 0.18 };
    /// How often the neighbours are looked at, in simulated seconds.
    pub const SAMPLE_S: f64 = 300.0;

    /// Job `job_id`'s share lost beside CPU-only work: a deterministic draw
    /// (the same job loses the same under every policy).
    pub fn loss_of(&self, job_id: u64) -> f64 {
        if self.median_loss <= 0.0 {
            return 0.0;
        }
        let sigma = (self.p90_loss / self.median_loss).max(1.0).ln() / 1.281_551_565_5;
        let mut s = crate::pool::SplitMix::new(job_id ^ 0x1f2e_3d4c_5b6a_7988);
        let u1 = (s.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let u2 = (s.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let z = (-2.0 * u1.max(1e-12).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.median_loss * (sigma * z).exp()).clamp(0.0, 0.9)
    }

    /// Checks the figures: losses in [0, 0.9], the 90th percentile at least
    /// the median.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=0.9).contains(&self.median_loss) || !(0.0..=0.9).contains(&self.p90_loss) || self.p90_loss < self.median_loss {
            return Err(format!("interference losses {} (median), {} (p90): each in [0, 0.9], the p90 at least the median", self.median_loss, self.p90_loss));
        }
        Ok(())
    }
}

/// Replay's work model: a job's `duration_s` is its work at the reference
/// rate; a run advances it at `model_speed[model]` (1 where unnamed),
/// divided by `cross_domain_slowdown` when its tasks span more than one
/// switch domain (ASI: all-reduce inside one access switch is up to 27%
/// faster). A slower run holds its GPUs longer for the same work.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkRates {
    /// Speed of each GPU model (indexed like the fleet's models) against
    /// the reference.
    pub model_speed: Vec<f64>,
    pub cross_domain_slowdown: f64,
}

impl WorkRates {
    /// The slowest rate any run can have.
    pub fn slowest(&self) -> f64 {
        let speed = self.model_speed.iter().copied().fold(1.0f64, f64::min);
        (speed / self.cross_domain_slowdown.max(1.0)).max(1e-3)
    }

    /// Work seconds per second of a run on `model` across `domains`.
    pub fn rate(&self, model: Option<crate::units::ModelId>, domains: u32) -> f64 {
        let speed = model.and_then(|m| self.model_speed.get(m as usize)).copied().unwrap_or(1.0);
        let slowdown = if domains > 1 { self.cross_domain_slowdown } else { 1.0 };
        (speed / slowdown).max(1e-3)
    }

    /// The rate of a run holding `allocations` on `fleet`: its first node's
    /// model, slowed when its nodes span more than one switch domain (as
    /// placement sets it). No allocation: the forecast calls it per
    /// placement of every run forward.
    pub fn of_run(&self, fleet: &Fleet, allocations: &[Allocation]) -> f64 {
        let node = |a: &Allocation| fleet.nodes().get(a.node as usize);
        let first = allocations.first().and_then(node);
        let spans = allocations.iter().filter_map(node).any(|n| first.is_some_and(|f| n.switch_domain != f.switch_domain));
        self.rate(first.and_then(|n| n.model), if spans { 2 } else { 1 })
    }
}

impl SimConfig {
    /// The priority contract `job` runs under: its own, else the default.
    pub fn contract_of(&self, job: &Job) -> PriorityContract {
        job.contract.unwrap_or(self.contract)
    }
}

/// Starvation-guard settings: fleet-wide, and per partition.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Guards {
    /// For jobs not submitted to a partition, or whose partition has no
    /// setting of its own.
    pub fleet: Option<StarvationGuard>,
    /// Per-partition settings; `None` turns the guard off in a partition.
    pub partitions: BTreeMap<u32, Option<StarvationGuard>>,
}

impl Guards {
    /// The same guard everywhere.
    pub fn everywhere(guard: Option<StarvationGuard>) -> Guards {
        Guards { fleet: guard, partitions: BTreeMap::new() }
    }

    /// The guard that applies to `job`.
    pub fn of(&self, job: &Job) -> Option<StarvationGuard> {
        job.partition.and_then(|p| self.partitions.get(&p).copied()).unwrap_or(self.fleet)
    }
}

/// The starvation guard: aging raises a waiting job's place in the queue,
/// and a job that has waited long enough and still cannot start gets a
/// reservation. While it holds one, other jobs start on its drained nodes
/// only if they will have ended by the reservation's time (the earliest time
/// enough running work will have ended for it), so the reserved job starts
/// then at the latest. Each partition (and the fleet-wide scope) holds at
/// most one reservation at a time.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StarvationGuard {
    /// A job waiting this long that cannot start gets the reservation.
    pub reserve_after_s: u64,
    /// Priority points added per hour of waiting.
    pub aging_per_hour: f64,
    /// Bounds the small work admitted ahead of a waiting gang.
    pub window: Option<AdmissionWindow>,
}

/// A bounded admission window: while a job that cannot start waits at the
/// head of its scope's queue, at most `small_gpu_h` GPU-hours of smaller
/// work (fewer GPUs; GPUs x its planned run) start ahead of it in each
/// window of `window_s` seconds (aligned on multiples of it). Once the
/// budget is spent, smaller work waits for the next window, so a stream of
/// short arrivals cannot keep the capacity the waiting job needs busy
/// forever: running work ends and the waiting job fits.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionWindow {
    pub window_s: u64,
    pub small_gpu_h: f64,
}

impl AdmissionWindow {
    /// Checks the settings: a window of 1 s to 7 days, a budget finite and
    /// not negative.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=7 * 86_400).contains(&self.window_s) || !self.small_gpu_h.is_finite() || self.small_gpu_h < 0.0 {
            return Err(format!("admission window {} s, {} GPU-h: a window of 1 s to 7 days, a budget of at least 0", self.window_s, self.small_gpu_h));
        }
        Ok(())
    }
}

/// The policies the engine asks: placement always; preemption ranking and
/// compaction planning when those mechanisms are on.
pub struct Deciders<'a> {
    pub placement: &'a mut dyn PlacementPolicy,
    pub preemption: Option<&'a mut dyn PreemptionPolicy>,
    /// Replay runs it every `config.period_s` over every partition.
    pub compaction: Option<(&'a mut dyn CompactionPolicy, CompactionConfig)>,
}

/// The world's own hard constraint on which nodes a job may use, beside the
/// engine's (partition, drained nodes, lent GPUs); the live host keeps jobs
/// with a command on agent nodes and simulated jobs off them.
pub type Eligible<'a> = &'a dyn Fn(&Job, NodeId, &Node) -> bool;

/// Watches each placement attempt (the live host logs decisions, runs a
/// shadow candidate on the same state, feeds its breaker).
pub trait Observer {
    /// The placement policy is about to be asked for `job` on `fleet`, on
    /// the nodes `keep` accepts.
    fn before_place(&mut self, _fleet: &Fleet, _job: &Job, _keep: &dyn Fn(NodeId, &Node) -> bool) {}
    /// What that attempt gave (the fleet is as it left it).
    fn after_place(&mut self, _fleet: &Fleet, _job: &Job, _result: &Result<Option<(Vec<Allocation>, u32)>, PolicyError>) {}
    /// The rank policy chose `chosen` (indexes into `candidates`) to make
    /// room for `demand` on the nodes `keep` accepts; the fleet is as before
    /// any eviction (the live host ranks the same input with a shadow rank
    /// candidate).
    fn after_rank(&mut self, _fleet: &Fleet, _demand: &Job, _candidates: &[Candidate], _keep: &dyn Fn(NodeId, &Node) -> bool, _chosen: Option<&[usize]>) {}
}

/// What the world adds to a pass: its own node constraint and an observer
/// of placement attempts (replay uses neither).
#[derive(Default)]
pub struct World<'a> {
    pub eligible: Option<Eligible<'a>>,
    pub observer: Option<&'a mut dyn Observer>,
}

/// The policy hook a call went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Place,
    Rank,
    Compact,
}

impl SimOutcome {
    /// Job `j`'s tenant is owed `credit_gpu_h`, for a broken promise or not.
    fn owe(&mut self, j: usize, credit_gpu_h: f64, broken: bool) {
        let o = &mut self.jobs[j];
        o.credit_gpu_h += credit_gpu_h;
        o.broken += u32::from(broken);
        self.credit_gpu_h += credit_gpu_h;
        self.broken_promises += u64::from(broken);
    }
}

/// A job slot: the engine's index of a job, stable for its life.
pub type Slot = usize;

/// Something that happened, at the `now` of [`Engine::handle`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Event {
    /// A registered job joins the queue.
    Arrive(Slot),
    /// A running job's run ended (finished, failed or stopped for good).
    End(Slot),
    /// A pending job is withdrawn, or a running one stopped and dropped.
    Cancel(Slot),
    /// A running job is leaving (cancelled; its processes are stopping):
    /// it holds its GPUs until its [`Event::End`], and meanwhile is
    /// nobody's victim, not moved and not put to sleep.
    Leaving(Slot),
    /// A running job goes back to the queue and gives up its allocations
    /// (its node was lost): an interruption of its run.
    Requeue(Slot),
    /// A placed job whose run never started (its start could not be
    /// stored, the host restarted first) goes back to the queue: no
    /// interruption, and an outage it was in goes on.
    Unstarted(Slot),
    /// An evicted job that reports its exit ([`Job::reports_exit`]) has
    /// stopped: it may run again.
    Vacated(Slot),
    /// A running job wrote a checkpoint: its work up to now is kept.
    Checkpoint(Slot),
    /// Capacity or constraints changed outside the engine (a node's health,
    /// an operator's hold, a setting): every waiting job is tried again.
    FleetChanged,
    /// Harvest boundaries: replicas sleep and lend their GPUs, or wake.
    Sleep,
    Wake,
    /// One running whole-GPU job sleeps now (an operator's or a schedule's
    /// choice, its processes confirmed asleep): its GPUs are lent to
    /// low-priority work until it wakes.
    SleepJob(Slot),
    /// One sleeping job wakes: borrowers on its GPUs are evicted under
    /// their contracts and it gets its GPUs back.
    WakeJob(Slot),
    /// Run a compaction step before this pass.
    Compact,
}

/// What the engine decided, in the order it decided it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Decision {
    /// The job runs on these allocations, starting at `start_s` (once the
    /// `victims` it evicted have vacated).
    Place { slot: Slot, job: u64, allocations: Vec<Allocation>, domains: u32, start_s: u64, victims: Vec<u64> },
    /// Take a running job back for `for_job` under its priority contract:
    /// notice now, stopped by `stop_by_s` at the latest.
    /// `wake`: taken back for a sleeping job waking on its GPUs, not ranked.
    /// `credit_gpu_h`: what its tenant is owed for it; `broken`: the
    /// promise this eviction breaks, if any.
    Evict { slot: Slot, job: u64, for_job: u64, ranker: String, stop_by_s: u64, lost_gpu_s: f64, forced: bool, wake: bool, credit_gpu_h: f64, broken: Option<crate::contract::Broken> },
    /// A promise broken outside an eviction (a run stopped by the host, an
    /// outage past its maximum), and what its tenant is owed for it.
    Broken { slot: Slot, job: u64, promise: crate::contract::Broken, lost_gpu_s: f64, credit_gpu_h: f64 },
    /// The starvation guard reserves capacity for a job: it starts by
    /// `until_s` at the latest; these nodes are drained for it.
    Reserve { slot: Slot, job: u64, until_s: u64, nodes: Vec<NodeId> },
    /// A running job sleeps: `gpus` of its GPUs are lent to low-priority work.
    Sleep { slot: Slot, job: u64, gpus: u32 },
    /// A sleeping job wakes on its GPUs once the borrowers evicted for it
    /// (`victims`) have vacated; `requeued`: it could not get them back (a
    /// hold or an operator took one) and waits in the queue again.
    Wake { slot: Slot, job: u64, victims: Vec<u64>, requeued: bool },
}

/// One call's result: what was decided, and the policy error that stopped
/// the pass, if one did. Decisions made before an error are real (applied
/// to the fleet and the engine): the caller actuates them either way.
#[derive(Debug, Default)]
pub struct Pass {
    pub decisions: Vec<Decision>,
    /// The failing call's hook, error and the job it was deciding; that
    /// job is tried again on the next call.
    pub error: Option<(Option<Slot>, Hook, PolicyError)>,
}

/// A reservation of the starvation guard: the job and the time it is
/// planned to start at the latest.
#[derive(Clone, Debug)]
struct Reservation {
    job: Slot,
    until: u64,
}

/// Waiting jobs as the engine tells them apart: reservation scopes the
/// job must avoid, and its (partition, tasks, shape) class.
type ShapeKey = (Vec<Option<u32>>, u32);

/// A waiting gang's [`ShapeKey`], and whether it may borrow lent GPUs (see
/// [`Engine::may_borrow`]).
type GangKey = (ShapeKey, bool);

/// The deterministic scheduler state.
pub struct Engine {
    pub config: SimConfig,
    jobs: Vec<Job>,
    /// Interned (partition, tasks, shape) of each slot.
    class_of: Vec<u32>,
    classes: Vec<(Option<u32>, u32, TaskShape)>,
    class_ids: HashMap<(Option<u32>, u32, TaskShape), u32>,
    /// Slots using each class; a class no slot uses is recycled, so the
    /// table grows with the distinct shapes of the jobs held, not of every
    /// job ever registered (tenants choose CPU and memory freely).
    class_refs: Vec<u32>,
    free_classes: Vec<u32>,
    pending: Vec<Slot>,
    /// Jobs that joined the queue (or must be retried) since the last pass.
    fresh: Vec<bool>,
    runs: Runs,
    outcome: SimOutcome,
    placer: Placer,
    /// Milli-GPU held by running high-priority jobs.
    high_milli: u64,
    /// One reservation per scope (a partition, or `None` for fleet-wide),
    /// and which reservation drained each node.
    reservations: BTreeMap<Option<u32>, Reservation>,
    drained_by: HashMap<NodeId, Option<u32>>,
    /// When the last pass ran.
    last_pass_s: u64,
    /// Admission windows, per scope: the window (its index, `now /
    /// window_s`) and the GPU-hours of smaller work admitted in it ahead of
    /// a waiting job; and the jobs the last pass held back for a spent
    /// budget, with the job they waited behind and when the window ends.
    admitted: HashMap<HeadKey, (u64, f64)>,
    window_held: HashMap<Slot, (u64, u64)>,
    /// Harvesting: sleeping replicas with the allocations they keep a claim
    /// on, the GPUs lent on each node.
    sleeping: BTreeMap<Slot, Vec<Allocation>>,
    lent: HashMap<NodeId, u64>,
    sleeping_milli: u64,
    gang_bounds: GangBounds,
    compaction_state: CompactionState,
    /// Set by events since the last pass: every job is tried again.
    freed: bool,
    /// Nodes where capacity was released since the last pass.
    touched: HashSet<NodeId>,
    /// Slots of forgotten jobs, reused by `register` (the live host forgets
    /// ended jobs so the table does not grow with every job ever seen).
    free_slots: Vec<Slot>,
    compact_due: bool,
    /// Decisions made while applying events (sleep, wake and the evictions
    /// a wake makes): the next pass reports them first.
    announced: Vec<Decision>,
    /// The fleet as high priority sees it, kept from the last pass that
    /// needed it (see [`HighView`]).
    high_view: Option<HighView>,
    /// Simulated seconds since the interference model last looked.
    interference_due_s: f64,
    /// Every input given, while capture is on (see [`crate::capture`]).
    capture: Option<Recorder>,
}

impl Engine {
    pub fn new(config: SimConfig) -> Engine {
        Engine {
            config,
            jobs: Vec::new(),
            class_of: Vec::new(),
            classes: Vec::new(),
            class_ids: HashMap::new(),
            class_refs: Vec::new(),
            free_classes: Vec::new(),
            pending: Vec::new(),
            fresh: Vec::new(),
            runs: Runs::default(),
            outcome: SimOutcome::default(),
            placer: Placer::new(),
            high_milli: 0,
            reservations: BTreeMap::new(),
            drained_by: HashMap::new(),
            last_pass_s: 0,
            admitted: HashMap::new(),
            window_held: HashMap::new(),
            sleeping: BTreeMap::new(),
            lent: HashMap::new(),
            sleeping_milli: 0,
            gang_bounds: GangBounds::default(),
            compaction_state: CompactionState::default(),
            freed: true,
            touched: HashSet::new(),
            free_slots: Vec::new(),
            compact_due: false,
            announced: Vec::new(),
            interference_due_s: 0.0,
            high_view: None,
            capture: None,
        }
    }

    /// Records every input from now on, starting with the settings and the
    /// whole of `fleet` (the world drains them with [`Engine::take_captured`]).
    pub fn start_capture(&mut self, fleet: &Fleet) {
        self.capture = Some(Recorder::start(&self.config, fleet));
    }

    pub fn capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// The inputs recorded since the last call.
    pub fn take_captured(&mut self) -> Vec<Input> {
        self.capture.as_mut().map(|c| std::mem::take(&mut c.inputs)).unwrap_or_default()
    }

    /// Records what the world notes for a replay (policy versions, agent
    /// nodes), in order with the engine's inputs; nothing when not capturing.
    pub fn capture_note(&mut self, note: Input) {
        if let Some(c) = &mut self.capture {
            c.inputs.push(note);
        }
    }

    fn record(&mut self, input: impl FnOnce(&Self) -> Input) {
        if self.capture.is_some() {
            let input = input(self);
            self.capture.as_mut().expect("checked").inputs.push(input);
        }
    }

    fn record_saw(&mut self, fleet: &Fleet) {
        if let Some(c) = &mut self.capture {
            c.saw(fleet);
        }
    }

    fn record_left(&mut self, fleet: &Fleet) {
        if let Some(c) = &mut self.capture {
            c.left(fleet);
        }
    }

    /// Adds a job to the engine's table (not yet to the queue: see
    /// [`Event::Arrive`]); returns its slot.
    pub fn register(&mut self, job: Job) -> Slot {
        let slot = self.register_job(job);
        self.record(|e| Input::Register { slot, job: e.jobs[slot].clone() });
        slot
    }

    fn register_job(&mut self, job: Job) -> Slot {
        let key = (job.partition, job.tasks, job.shape.clone());
        let class = match self.class_ids.get(&key) {
            Some(&c) => c,
            None => {
                let c = match self.free_classes.pop() {
                    Some(c) => {
                        self.classes[c as usize] = key.clone();
                        c
                    }
                    None => {
                        self.classes.push(key.clone());
                        self.class_refs.push(0);
                        self.classes.len() as u32 - 1
                    }
                };
                self.class_ids.insert(key, c);
                c
            }
        };
        self.class_refs[class as usize] += 1;
        if let Some(slot) = self.free_slots.pop() {
            // `forget` left every per-slot field as a new slot has it.
            self.class_of[slot] = class;
            self.jobs[slot] = job;
            return slot;
        }
        self.class_of.push(class);
        self.jobs.push(job);
        self.fresh.push(false);
        self.runs.push();
        self.outcome.jobs.push(JobOutcome::default());
        self.jobs.len() - 1
    }

    /// Forgets an ended job so its slot can be reused; false (and nothing
    /// changes) while the job still waits, holds, sleeps, is being taken
    /// back or holds a reservation.
    pub fn forget(&mut self, slot: Slot) -> bool {
        let forgot = self.forget_job(slot);
        if forgot {
            // Only when it changed something: the live host asks every
            // second for every ended job, busy slots included.
            self.record(|_| Input::Forget { slot });
        }
        forgot
    }

    /// The number of slots (used or free): a replay checks the slots it is given.
    pub fn slot_count(&self) -> usize {
        self.jobs.len()
    }

    fn forget_job(&mut self, slot: Slot) -> bool {
        let busy = self.pending.contains(&slot)
            || !self.runs.held[slot].is_empty()
            || self.runs.planned_end[slot].is_some()
            || self.runs.running_low.contains(&slot)
            || self.sleeping.contains_key(&slot)
            || self.reservations.values().any(|r| r.job == slot)
            || self.runs.ready_at[slot] == u64::MAX;
        if busy || self.free_slots.contains(&slot) {
            return false;
        }
        let class = self.class_of[slot];
        self.class_refs[class as usize] -= 1;
        if self.class_refs[class as usize] == 0 {
            self.class_ids.remove(&self.classes[class as usize]);
            self.gang_bounds.forget_class(class);
            self.free_classes.push(class);
        }
        self.jobs[slot] = Job::default();
        self.fresh[slot] = false;
        self.runs.reset(slot);
        self.outcome.jobs[slot] = JobOutcome::default();
        self.free_slots.push(slot);
        true
    }

    /// Slots in the table (reused ones included): what a live host holds.
    pub fn slots_in_use(&self) -> usize {
        self.jobs.len() - self.free_slots.len()
    }

    /// Shape classes in use (distinct partition, tasks and shape among the
    /// jobs held).
    pub fn classes_in_use(&self) -> usize {
        self.classes.len() - self.free_classes.len()
    }

    pub fn job(&self, slot: Slot) -> &Job {
        &self.jobs[slot]
    }

    pub fn outcome(&self) -> &SimOutcome {
        &self.outcome
    }

    /// Brings the kept view without low-priority work up to date with
    /// `fleet`, as a pass would, and compares it with one made anew; the
    /// first difference. (For tests: the view is kept from pass to pass by
    /// the nodes that changed, and must never drift from the fleet.)
    pub fn check_high_view(&mut self, fleet: &Fleet) -> Result<(), String> {
        let kept = self.runs.high_view(fleet, self.high_view.take());
        let anew = self.runs.without_low(fleet, Fleet::default());
        let view = &kept.fleet;
        kept.fleet.check_invariants().map_err(|e| format!("the kept view: {e}"))?;
        if let Some((id, (k, a))) = view.nodes().iter().zip(anew.nodes()).enumerate().find(|(_, (k, a))| k != a) {
            return Err(format!("node {id}: kept {k:?}, made anew {a:?}"));
        }
        if view.nodes().len() != anew.nodes().len() || view.gpu_allocated_milli() != anew.gpu_allocated_milli() || view.state_digest() != anew.state_digest() {
            return Err(format!(
                "kept: {} nodes, {} milli-GPU allocated, digest {:016x}; made anew: {}, {}, {:016x}",
                view.nodes().len(),
                view.gpu_allocated_milli(),
                view.state_digest(),
                anew.nodes().len(),
                anew.gpu_allocated_milli(),
                anew.state_digest()
            ));
        }
        self.high_view = Some(kept);
        Ok(())
    }

    /// The allocations a job holds now (empty when not running).
    pub fn held(&self, slot: Slot) -> &[Allocation] {
        &self.runs.held[slot]
    }

    /// When its current run is planned to end (`None` when not running).
    pub fn planned_end(&self, slot: Slot) -> Option<u64> {
        self.runs.planned_end[slot]
    }

    /// Whether the job waits in the queue.
    pub fn is_pending(&self, slot: Slot) -> bool {
        self.pending.contains(&slot)
    }

    /// Waiting jobs, in the order they joined the queue.
    pub fn pending(&self) -> &[Slot] {
        &self.pending
    }

    /// When the current run of a running job started (its work begins
    /// then, after any victims vacated).
    pub fn run_start(&self, slot: Slot) -> Option<u64> {
        self.runs.planned_end.get(slot).copied().flatten().map(|_| self.runs.run_start[slot])
    }

    /// Interruption times (engine seconds, oldest first) of a job recovered
    /// from durable state; a waiting job at its daily limit is held back
    /// again until the oldest is a day old.
    pub fn restore_interruptions(&mut self, slot: Slot, mut times: Vec<u64>, now: u64) {
        self.record(|_| Input::RestoreInterruptions { slot, times: times.clone(), now });
        if times.is_empty() {
            return;
        }
        times.sort_unstable();
        // A waiting job has been out of service since its last interruption
        // (what the store keeps; the vacate time is not kept).
        if self.pending.contains(&slot) {
            self.runs.out_since.insert(slot, *times.last().expect("not empty"));
        }
        self.runs.interrupted_at.insert(slot, times);
        if self.runs.ready_at[slot] != u64::MAX && self.pending.contains(&slot) {
            self.ready_from(slot, now);
        }
    }

    /// Waiting job `j` may run from `now` on, or, at its daily interruption
    /// limit, once the oldest of those interruptions is a day old.
    fn ready_from(&mut self, j: Slot, now: u64) {
        let at = self.runs.resume_at(j, now, &self.config.contract_of(&self.jobs[j]));
        self.runs.ready_at[j] = at;
        if at > now {
            self.runs.wakeups.push(Reverse(at));
        } else {
            self.fresh[j] = true;
        }
    }

    /// When an evicted job may run again, if later than `now`: after it
    /// vacates, or, taken back as often as its contract allows in 24 hours,
    /// once the oldest of those interruptions is a day old. With the number
    /// of interruptions in the 24 hours before `now`, and whether that is
    /// the contract's limit.
    pub fn held_back(&self, slot: Slot, now: u64) -> Option<(u64, usize, bool)> {
        let at = self.runs.ready_at[slot];
        let recent = self.runs.recent_interruptions(slot, now);
        let limit = self.config.contract_of(&self.jobs[slot]).max_interruptions_per_day as usize;
        (at != u64::MAX && at > now).then_some((at, recent, limit > 0 && recent >= limit))
    }

    /// Drops the wake-up times at or before `now` (a pass would); true if
    /// there were any. A job cancelled while it waited to be ready leaves
    /// its time behind: kept, it would stay due forever, and the live host
    /// would spin on it.
    pub fn take_due_wakeups(&mut self, now: u64) -> bool {
        // Recorded only when it changed something: the live host asks on
        // every turn of its loop.
        let any = self.due_wakeups(now);
        if any {
            self.record(|_| Input::DueWakeups { now });
        }
        any
    }

    fn due_wakeups(&mut self, now: u64) -> bool {
        let mut any = false;
        while self.runs.wakeups.peek().is_some_and(|&Reverse(t)| t <= now) {
            self.runs.wakeups.pop();
            any = true;
        }
        any
    }

    /// The earliest time an evicted job (vacating on the modelled latency)
    /// may run again, if any is due.
    pub fn next_wakeup(&self) -> Option<u64> {
        self.runs.wakeups.peek().map(|Reverse(t)| *t)
    }

    /// Changes the starvation guards (an operator at run time). A scope
    /// whose guard is now off gives up its reservation and drained nodes;
    /// every pending job is tried again.
    pub fn set_guards(&mut self, guards: Guards) {
        self.record(|_| Input::Guards { guards: guards.clone() });
        self.config.guards = guards;
        let config = &self.config;
        let jobs = &self.jobs;
        self.reservations.retain(|_, r| config.guards.of(&jobs[r.job]).is_some());
        let reservations = &self.reservations;
        self.drained_by.retain(|_, scope| reservations.contains_key(scope));
        self.freed = true;
    }

    /// Whether the last pass held waiting job `slot` back for its scope's
    /// spent admission budget: the job it waited behind (id) and when the
    /// window ends.
    pub fn held_by_window(&self, slot: Slot) -> Option<(u64, u64)> {
        self.window_held.get(&slot).copied()
    }

    /// The guard's reservation of the scope `partition`: job slot and
    /// latest start.
    pub fn reservation(&self, partition: Option<u32>) -> Option<(Slot, u64)> {
        self.reservations.get(&partition).map(|r| (r.job, r.until))
    }

    /// Running work (planned end, slot, allocations), sleeping replicas
    /// excluded: what quotes and compaction look at.
    pub fn running(&self) -> Vec<(u64, Slot, Vec<Allocation>)> {
        self.runs
            .planned_end
            .iter()
            .enumerate()
            .filter(|(j, _)| !self.sleeping.contains_key(j))
            .filter_map(|(j, e)| e.map(|e| (e, j, self.runs.held[j].clone())))
            .collect()
    }

    /// What would let pending job `slot` start now (see
    /// [`crate::whatif`]), on the nodes `keep` accepts, never acting: the
    /// running work's priority, contract (guaranteed work, protected
    /// partitions and jobs at their daily cap are never stopped) and work
    /// since its last checkpoint come from the engine; whether a job may be
    /// moved, and the bytes a task's move copies, from `movable`. Tasks are
    /// never moved onto GPUs lent by a sleeping job.
    pub fn what_if(&self, fleet: &Fleet, slot: Slot, now: u64, keep: &dyn Fn(NodeId, &Node) -> bool, movable: &dyn Fn(&Job) -> Option<u64>) -> Vec<crate::whatif::Change> {
        let priority = self.jobs[slot].priority;
        let outside_protected = |id: NodeId| !self.config.protected_partitions.contains(&fleet.nodes()[id as usize].partition);
        let running: Vec<crate::whatif::Running> = self
            .runs
            .planned_end
            .iter()
            .enumerate()
            .filter(|(v, e)| e.is_some() && !self.sleeping.contains_key(v) && !self.runs.held[*v].is_empty())
            .map(|(v, _)| {
                let job = &self.jobs[v];
                let contract = self.config.contract_of(job);
                let since = self.runs.since_checkpoint(v, now, job, &contract);
                let state_bytes = movable(job);
                crate::whatif::Running {
                    job_id: job.id,
                    priority: job.priority,
                    allocations: &self.runs.held[v],
                    // The preemption's own filter (below the job's
                    // priority, not guaranteed, under its cap), anywhere
                    // outside the protected partitions.
                    stoppable: self.may_take_back(v, priority, now, &outside_protected),
                    lost_gpu_s: job.gpus_held() * since as f64,
                    movable: state_bytes.is_some(),
                    state_bytes_per_task: state_bytes.unwrap_or(0),
                }
            })
            .collect();
        let destinations = |id: NodeId, n: &Node| keep(id, n) && !self.lent.contains_key(&id);
        crate::whatif::what_would_let_it_start(fleet, &self.jobs[slot], keep, &destinations, &running)
    }

    fn low(&self, j: Slot) -> bool {
        self.jobs[j].priority < self.config.high_priority
    }

    /// Integrates utilisation over the `dt` seconds before the next event
    /// (the fleet as it was since the last one).
    pub fn integrate(&mut self, fleet: &Fleet, dt: f64) {
        // A sleeping replica still owns its GPUs; a borrower on them is
        // harvest, not more allocation.
        let borrowed = lent_in_use(fleet, &self.lent);
        let u = &mut self.outcome;
        u.utilisation.all_milli_s += (fleet.gpu_allocated_milli() + self.sleeping_milli - borrowed) as f64 * dt;
        u.harvested_gpu_s += borrowed as f64 / 1000.0 * dt;
        u.standby_gpu_s += self.sleeping_milli as f64 / 1000.0 * dt;
        u.utilisation.high_milli_s += self.high_milli as f64 * dt;
        u.utilisation.seconds += dt;
        if let Some(model) = self.config.interference {
            // Sampled, not per event: a pass over the running jobs at every
            // event would cost more than the rest of the simulation.
            self.interference_due_s += dt;
            if self.interference_due_s >= Interference::SAMPLE_S {
                let span = std::mem::take(&mut self.interference_due_s);
                self.outcome.interference_lost_gpu_s += span * self.interference_loss_rate(fleet, &model);
            }
        }
    }

    /// GPUs' worth of training work lost per second now: each running
    /// training job sharing a node with CPU-only work, its GPUs times its
    /// loss.
    fn interference_loss_rate(&self, fleet: &Fleet, model: &Interference) -> f64 {
        let mut rate = 0.0;
        for (j, end) in self.runs.planned_end.iter().enumerate() {
            let Some(job) = self.jobs.get(j) else { continue };
            if end.is_none() || job.task_class() != crate::job::TaskClass::Training || self.sleeping.contains_key(&j) {
                continue;
            }
            let held = &self.runs.held[j];
            if held.iter().any(|a| fleet.nodes().get(a.node as usize).is_some_and(|n| n.cpu_only_milli() > 0)) {
                let gpus: f64 = held.iter().map(|a| a.gpu_milli_total() as f64 / 1000.0).sum();
                rate += gpus * model.loss_of(job.id);
            }
        }
        rate
    }

    /// The counters, with what still waits and runs, at `now`.
    pub fn finish(mut self, now: u64) -> SimOutcome {
        let mut outcome = std::mem::take(&mut self.outcome);
        outcome.end_s = now;
        // Work kept: all of it for a job that ended; what was kept across
        // evictions plus what the current run did so far otherwise.
        for (j, o) in outcome.jobs.iter_mut().enumerate() {
            let Some(job) = self.jobs.get(j) else { continue };
            let gpus = job.gpus() as f64 * f64::from(job.shape.gpu_milli) / f64::from(crate::units::MILLI_PER_GPU);
            let work_s = if o.end_s.is_some_and(|e| e <= now) {
                job.duration_s
            } else {
                let running = self.runs.planned_end[j].is_some() && !self.sleeping.contains_key(&j);
                let current = if running { self.runs.work_in(j, now.saturating_sub(self.runs.run_start[j])) } else { 0 };
                (self.runs.kept_s[j] + current).min(job.duration_s)
            };
            o.work_gpu_s = gpus * work_s as f64;
        }
        outcome.pending_at_end = std::mem::take(&mut self.pending);
        // Sleeping replicas are not on the fleet now: only what runs is.
        let sleeping = &self.sleeping;
        outcome.running_at_end = self
            .runs
            .planned_end
            .iter()
            .enumerate()
            .filter(|(j, _)| !sleeping.contains_key(j))
            .filter_map(|(j, e)| e.map(|e| (e, j, std::mem::take(&mut self.runs.held[j]))))
            .collect();
        outcome
    }

    /// Applies `events` (all at `now`), then walks the queue once.
    pub fn handle(
        &mut self,
        fleet: &mut Fleet,
        now: u64,
        events: impl IntoIterator<Item = Event>,
        deciders: &mut Deciders,
        world: &mut World,
    ) -> Pass {
        self.record_saw(fleet);
        let events: Vec<Event> = events.into_iter().collect();
        let pass = self.handle_events(fleet, now, events.iter().cloned(), deciders, world);
        self.record_left(fleet);
        self.record(|_| Input::Pass {
            now,
            events,
            decisions: pass.decisions.clone(),
            error: pass.error.as_ref().map(|(_, hook, e)| format!("{hook:?}: {e}")),
        });
        pass
    }

    fn handle_events(
        &mut self,
        fleet: &mut Fleet,
        now: u64,
        events: impl IntoIterator<Item = Event>,
        deciders: &mut Deciders,
        world: &mut World,
    ) -> Pass {
        self.due_wakeups(now);
        let mut pass = Pass::default();
        for event in events {
            self.apply_event(fleet, now, event);
        }
        pass.decisions.append(&mut self.announced);
        if let Err((slot, hook, e)) = self.pass(fleet, now, deciders, world, &mut pass.decisions) {
            if let Some(slot) = slot {
                self.fresh[slot] = true; // tried again next time
            }
            self.freed = true;
            pass.error = Some((slot, hook, e));
        }
        pass
    }

    /// Applies one event now, without a pass (the live host applies what
    /// happens as it happens, and walks the queue when it is ready to).
    pub fn apply(&mut self, fleet: &mut Fleet, now: u64, event: Event) {
        self.record_saw(fleet);
        self.record(|e| {
            let job = match event {
                Event::Arrive(j) | Event::End(j) | Event::Cancel(j) | Event::Leaving(j) | Event::Requeue(j) | Event::Unstarted(j) | Event::Vacated(j) | Event::Checkpoint(j) | Event::SleepJob(j) | Event::WakeJob(j) => {
                    e.jobs.get(j).map(|job| job.id)
                }
                Event::FleetChanged | Event::Sleep | Event::Wake | Event::Compact => None,
            };
            Input::Apply { now, job, event: event.clone() }
        });
        self.apply_event(fleet, now, event);
        self.record_left(fleet);
    }

    fn apply_event(&mut self, fleet: &mut Fleet, now: u64, event: Event) {
        match event {
            Event::Arrive(j) => {
                self.pending.push(j);
                self.fresh[j] = true;
            }
            Event::End(j) => {
                if self.runs.planned_end[j].take().is_none() {
                    return; // not running (a stale report)
                }
                self.outcome.jobs[j].end_s = Some(now);
                self.stop_run(fleet, j);
            }
            Event::Leaving(j) => {
                if self.runs.planned_end[j].is_some() {
                    self.runs.set_low(j, false);
                    self.runs.leaving.insert(j);
                }
            }
            Event::Cancel(j) => {
                self.pending.retain(|&p| p != j);
                if self.runs.planned_end[j].take().is_some() {
                    self.stop_run(fleet, j);
                }
                self.reservations.retain(|_, r| r.job != j);
            }
            Event::Requeue(j) => {
                if self.runs.planned_end[j].is_some() {
                    self.host_stopped(j, now);
                    self.runs.planned_end[j] = None;
                    self.stop_run(fleet, j);
                    self.pending.push(j);
                    self.fresh[j] = true;
                }
            }
            Event::Unstarted(j) => {
                if self.runs.planned_end[j].take().is_some() {
                    self.stop_run(fleet, j);
                    self.pending.push(j);
                    self.fresh[j] = true;
                    if let Some(since) = self.runs.resumed_from.remove(&j) {
                        self.runs.out_since.insert(j, since);
                    }
                }
            }
            Event::Vacated(j) => {
                // Out of service from now, not from the notice's end.
                if let Some(since) = self.runs.out_since.get_mut(&j) {
                    *since = now;
                }
                if self.runs.ready_at[j] == u64::MAX {
                    self.ready_from(j, now);
                }
                if self.runs.vacated(fleet, j, &mut self.touched) {
                    self.freed = true;
                }
            }
            Event::Checkpoint(j) => self.runs.checkpoint_at[j] = Some(now),
            Event::FleetChanged => self.freed = true,
            Event::Sleep => self.sleep(fleet, now),
            Event::Wake => self.wake(fleet, now),
            Event::SleepJob(j) => {
                self.sleep_job(fleet, j);
            }
            Event::WakeJob(j) => self.wake_job(fleet, now, j),
            Event::Compact => self.compact_due = true,
        }
    }

    /// Running job `j`'s run is stopped by the host (its node was lost, its
    /// start failed): an interruption its tenant sees, counted against its
    /// daily cap; a broken promise for guaranteed work or work at its cap,
    /// credited for the work since its last checkpoint. Its outage starts.
    fn host_stopped(&mut self, j: Slot, now: u64) {
        let job = &self.jobs[j];
        let contract = self.config.contract_of(job);
        let broken = self.runs.breaks_by_stopping(j, now, &contract);
        self.runs.interrupted_at.entry(j).or_default().push(now);
        self.runs.out_since.insert(j, now);
        self.runs.resumed_from.remove(&j);
        if let Some(promise) = broken {
            let since = self.runs.since_checkpoint_wall(j, now, job, &contract);
            let lost_gpu_s = job.gpus_held() * self.runs.work_in(j, since) as f64;
            let credit_gpu_h = self.config.compensation.for_broken(lost_gpu_s, job.gpus_held());
            self.outcome.owe(j, credit_gpu_h, true);
            self.announced.push(Decision::Broken { slot: j, job: job.id, promise, lost_gpu_s, credit_gpu_h });
        }
    }

    /// A running job recovered from durable state: it holds `allocations`
    /// (allocated here) since `started_s`.
    pub fn restore_running(&mut self, fleet: &mut Fleet, slot: Slot, allocations: Vec<Allocation>, started_s: u64) -> Result<(), crate::FleetError> {
        self.record_saw(fleet);
        self.record(|_| Input::RestoreRunning { slot, allocations: allocations.clone(), started_s });
        let restored = self.restore_running_job(fleet, slot, allocations, started_s);
        self.record_left(fleet);
        restored
    }

    fn restore_running_job(&mut self, fleet: &mut Fleet, slot: Slot, allocations: Vec<Allocation>, started_s: u64) -> Result<(), crate::FleetError> {
        for (k, a) in allocations.iter().enumerate() {
            if let Err(e) = fleet.allocate(a) {
                for done in &allocations[..k] {
                    fleet.release(done).expect("just allocated");
                }
                return Err(e);
            }
        }
        let job = &self.jobs[slot];
        self.runs.held[slot] = allocations;
        self.runs.run_start[slot] = started_s;
        self.runs.planned_end[slot] = Some(started_s.saturating_add(job.duration_s.max(1)));
        self.outcome.jobs[slot].start_s = Some(started_s);
        if job.priority < self.config.high_priority {
            self.runs.set_low(slot, true);
        } else {
            self.high_milli += job.gpus() * u64::from(job.shape.gpu_milli);
        }
        Ok(())
    }

    /// A sleeping job recovered from durable state: it keeps its claim on
    /// `allocations` (not allocated: lent, and borrowers may hold them).
    pub fn restore_sleeping(&mut self, slot: Slot, allocations: Vec<Allocation>, started_s: u64) {
        self.record(|_| Input::RestoreSleeping { slot, allocations: allocations.clone(), started_s });
        self.lend(&allocations);
        let job = &self.jobs[slot];
        self.sleeping.insert(slot, allocations.clone());
        self.runs.held[slot] = allocations;
        self.runs.run_start[slot] = started_s;
        self.runs.planned_end[slot] = Some(started_s.saturating_add(job.duration_s.max(1)));
        self.outcome.jobs[slot].start_s = Some(started_s);
        if job.priority >= self.config.high_priority {
            self.high_milli += job.gpus() * u64::from(job.shape.gpu_milli);
        }
    }

    /// Decisions made by events applied outside [`Engine::handle`] (a
    /// sleep, a wake and its evictions), in order; the caller actuates them.
    pub fn take_announced(&mut self) -> Vec<Decision> {
        let taken = std::mem::take(&mut self.announced);
        self.record(|_| Input::TakeAnnounced { decisions: taken.clone() });
        taken
    }

    /// Takes only the broken promises announced (a [`Event::Requeue`]
    /// makes them), so the world records each with the stop that broke it.
    pub fn take_broken(&mut self) -> Vec<Decision> {
        let (broken, rest) = std::mem::take(&mut self.announced).into_iter().partition(|d| matches!(d, Decision::Broken { .. }));
        self.announced = rest;
        self.record(|_| Input::TakeBroken { decisions: broken.clone() });
        broken
    }

    /// A job recovered while its evicted run was still stopping: it waits
    /// in the queue for [`Event::Vacated`].
    /// Of `still_running` (what its processes were placed on), what is not
    /// held by another job restored before it drains until it is gone.
    /// Restore running jobs first: they keep what they were given.
    pub fn restore_evicting(&mut self, fleet: &mut Fleet, slot: Slot, still_running: &[Allocation]) {
        self.record_saw(fleet);
        self.record(|_| Input::RestoreEvicting { slot, still_running: still_running.to_vec() });
        self.runs.ready_at[slot] = u64::MAX;
        self.pending.push(slot);
        self.runs.drain_victim(fleet, slot, still_running);
        self.record_left(fleet);
    }

    /// A job recovered while it waited for its victims (or borrowers) to
    /// go: if it ends before they do, its GPUs drain.
    pub fn restore_awaiting(&mut self, slot: Slot, victims: impl IntoIterator<Item = Slot>) {
        let victims: Vec<Slot> = victims.into_iter().collect();
        self.record(|_| Input::RestoreAwaiting { slot, victims: victims.clone() });
        let victims: BTreeSet<Slot> = victims.into_iter().filter(|&v| self.runs.ready_at[v] == u64::MAX).collect();
        if !victims.is_empty() {
            self.runs.awaiting.entry(slot).or_default().extend(victims);
        }
    }

    /// Capacity held for processes that may still run on it.
    pub fn drains(&self) -> &[Drain] {
        &self.runs.drains
    }

    /// A running job's task moved (make-before-break migration done): the
    /// engine's record follows; the caller made the fleet's changes.
    pub fn replace_held(&mut self, slot: Slot, old: &Allocation, new: Allocation) -> bool {
        self.record(|_| Input::ReplaceHeld { slot, old: old.clone(), new: new.clone() });
        let nodes = [old.node, new.node];
        match self.runs.held[slot].iter_mut().find(|a| *a == old) {
            Some(a) => {
                *a = new;
                // The new copy was allocated on the fleet when the move
                // began, as nobody's low work: the view is told its node now
                // counts it as this job's.
                self.runs.held_moved(slot, nodes);
                true
            }
            None => false,
        }
    }

    /// Releases a run's allocations (its planned end already cleared).
    fn stop_run(&mut self, fleet: &mut Fleet, j: Slot) {
        self.runs.set_low(j, false);
        self.runs.leaving.remove(&j);
        if let Some(allocs) = self.sleeping.remove(&j) {
            // Its GPUs were released when it fell asleep (borrowers may
            // hold them now): only the loan ends.
            self.unlend(&allocs);
            self.runs.held[j].clear();
            self.touched.extend(allocs.iter().map(|a| a.node));
        }
        // Ended before its victims were gone (cancelled, a time limit, a
        // lost node): their processes may still use its GPUs, which drain.
        let waits = self.runs.awaiting.remove(&j).filter(|w| !w.is_empty());
        for alloc in self.runs.held[j].drain(..) {
            match &waits {
                Some(until) => self.runs.drains.push(Drain { alloc, until: until.clone() }),
                None => {
                    fleet.release(&alloc).expect("a running job's allocations are held");
                    self.touched.insert(alloc.node);
                }
            }
        }
        if !self.low(j) {
            self.high_milli -= self.jobs[j].gpus() * u64::from(self.jobs[j].shape.gpu_milli);
        }
    }

    /// The trough begins: the idle share of whole-GPU replicas of the
    /// harvest class that will still run at the wake sleeps, lending its
    /// GPUs to low-priority work.
    fn sleep(&mut self, fleet: &mut Fleet, now: u64) {
        let Some(h) = self.config.harvest else { return };
        self.freed = true;
        let running_now: Vec<(usize, u64)> = self.runs.planned_end.iter().enumerate().filter(|(j, _)| !self.runs.leaving.contains(j)).filter_map(|(j, e)| e.map(|e| (j, e))).collect();
        for (j, end) in running_now {
            let job = &self.jobs[j];
            // Replicas that will still run when it wakes.
            if job.class != h.class || end <= now + h.trough_s() || !h.sleeps(job.id, now / 86_400) {
                continue;
            }
            self.sleep_job(fleet, j);
        }
    }

    /// Whether running job `j` can sleep and lend its GPUs: it runs, is
    /// not asleep, holds whole GPUs (a share of one cannot be lent) and
    /// none of them is lent to it (a borrower has nothing of its own to lend).
    pub fn can_sleep(&self, j: Slot) -> bool {
        let held = &self.runs.held[j];
        self.runs.planned_end[j].is_some()
            && !self.runs.leaving.contains(&j)
            && !self.sleeping.contains_key(&j)
            && self.jobs[j].shape.gpu_milli >= crate::units::MILLI_PER_GPU
            && !held.is_empty()
            && held.iter().all(|a| self.lent.get(&a.node).is_none_or(|m| m & a.gpus == 0))
    }

    /// Whether low-priority job `j`, whose run would take `run_s`, may run
    /// on lent GPUs: its contract lets it be taken back when their owners
    /// wake (it has interruptions left in the last 24 hours), or it ends,
    /// with a fifth of its run to spare against a forecast that is wrong,
    /// before the harvest schedule's next wake. A live host's schedule is
    /// the partition's, not the engine's: there only the first holds.
    fn may_borrow(&self, j: Slot, now: u64, run_s: u64) -> bool {
        let contract = self.config.contract_of(&self.jobs[j]);
        if contract.tier == crate::contract::Tier::Guaranteed {
            return false; // an owner waking would stop it
        }
        if self.runs.recent_interruptions(j, now) < contract.max_interruptions_per_day as usize {
            return true;
        }
        let Some(h) = &self.config.harvest else { return false };
        let (mut at, mut wake) = (now, None);
        for _ in 0..3 {
            let (t, is_wake) = h.next_boundary(Some(at));
            if is_wake {
                wake = Some(t);
                break;
            }
            at = t;
        }
        wake.is_some_and(|w| now.saturating_add(run_s).saturating_add(run_s / 5) <= w)
    }

    /// Whether job `j` is asleep, its GPUs lent.
    pub fn is_sleeping(&self, j: Slot) -> bool {
        self.sleeping.contains_key(&j)
    }

    /// GPUs lent by sleeping jobs, as a bitmask per node.
    pub fn lent(&self) -> &HashMap<NodeId, u64> {
        &self.lent
    }

    /// Per node of `fleet`: the milli-GPU a high-priority job could have
    /// without waiting for work to end — held by running low-priority work
    /// outside protected partitions (preemptible), or lent by a sleeping job
    /// and idle (a lent GPU a borrower uses is counted once, as the
    /// borrower's).
    pub fn reclaimable_milli(&self, fleet: &Fleet) -> Vec<u64> {
        let mut per = vec![0u64; fleet.nodes().len()];
        let nodes = fleet.nodes();
        for &j in &self.runs.running_low {
            if self.runs.leaving.contains(&j) {
                continue;
            }
            for a in &self.runs.held[j] {
                if let Some(n) = nodes.get(a.node as usize)
                    && !self.config.protected_partitions.contains(&n.partition)
                {
                    per[a.node as usize] += a.gpu_milli_total();
                }
            }
        }
        for (&node, &mask) in &self.lent {
            let Some(n) = nodes.get(node as usize) else { continue };
            let idle = (0..n.gpus.len()).filter(|&g| mask & (1 << g) != 0 && n.gpus[g] == crate::units::MILLI_PER_GPU).count();
            per[node as usize] += idle as u64 * u64::from(crate::units::MILLI_PER_GPU);
        }
        per
    }

    /// Puts running job `j` to sleep: its GPUs are released and lent to
    /// low-priority work; it keeps its claim on them. False (and nothing
    /// changes) when it cannot sleep.
    fn sleep_job(&mut self, fleet: &mut Fleet, j: Slot) -> bool {
        if !self.can_sleep(j) {
            return false;
        }
        let held = self.runs.held[j].clone();
        for a in &held {
            fleet.release(a).expect("a running job's allocations are held");
            self.touched.insert(a.node);
        }
        self.lend(&held);
        let gpus = held.iter().map(|a| a.gpus.count_ones()).sum();
        // Asleep, it is nobody's victim: it holds nothing to take back.
        self.runs.set_low(j, false);
        self.sleeping.insert(j, held);
        self.outcome.sleeps += 1;
        self.freed = true;
        self.announced.push(Decision::Sleep { slot: j, job: self.jobs[j].id, gpus });
        true
    }

    /// Lends a sleeping job's GPUs.
    fn lend(&mut self, allocs: &[Allocation]) {
        for a in allocs {
            *self.lent.entry(a.node).or_default() |= a.gpus;
            self.sleeping_milli += a.gpu_milli_total();
        }
    }

    /// Ends the loan of a sleeping job's GPUs.
    fn unlend(&mut self, allocs: &[Allocation]) {
        for a in allocs {
            if let Some(mask) = self.lent.get_mut(&a.node) {
                *mask &= !a.gpus;
                if *mask == 0 {
                    self.lent.remove(&a.node);
                }
            }
            self.sleeping_milli -= a.gpu_milli_total();
        }
    }

    /// Wakes every sleeping replica on its own GPUs (see [`Engine::wake_job`]).
    fn wake(&mut self, fleet: &mut Fleet, now: u64) {
        if self.config.harvest.is_none() {
            return;
        }
        let asleep: Vec<Slot> = self.sleeping.keys().copied().collect();
        for r in asleep {
            self.wake_job(fleet, now, r);
        }
    }

    /// Wakes sleeping job `r` on its own GPUs: low-priority borrowers in
    /// the way are evicted under their contracts (on a node, those holding
    /// its GPUs first). If it still cannot fit (a hold, or CPU or memory
    /// no borrower explains) it counts as a wake failure and queues again.
    fn wake_job(&mut self, fleet: &mut Fleet, now: u64, r: Slot) {
        let Some(allocs) = self.sleeping.remove(&r) else { return };
        self.freed = true;
        self.unlend(&allocs);
        let mut done = Vec::new();
        let mut victims = Vec::new();
        let mut borrowers = Vec::new();
        let mut ok = true;
        for a in &allocs {
            while fleet.allocate(a).is_err() {
                // The borrower to evict: one on this node holding these
                // GPUs, else any on this node.
                let held = &self.runs.held;
                let on_node = |v: &usize| held[*v].iter().any(|b| b.node == a.node);
                let overlaps = |v: &usize| held[*v].iter().any(|b| b.node == a.node && b.gpus & a.gpus != 0);
                // Any borrower on the node only once its GPUs are free (CPU
                // or memory is what is short): a GPU held by something that
                // cannot be taken back fails the wake at once.
                let gpus_free = || crate::fleet::gpus_of(a.gpus).all(|g| fleet.nodes()[a.node as usize].gpus[g] == crate::units::MILLI_PER_GPU);
                let Some(v) = self.runs.running_low.iter().copied().find(overlaps).or_else(|| if gpus_free() { self.runs.running_low.iter().copied().find(on_node) } else { None }) else {
                    ok = false;
                    break;
                };
                let released = std::mem::take(&mut self.runs.held[v]);
                for b in &released {
                    fleet.release(b).expect("a running job's allocations are held");
                }
                if self.jobs[v].reports_exit {
                    borrowers.push((v, released));
                }
                let (vacate, lost, forced, credit_gpu_h, broken) = self.runs.take_back(v, now, &self.jobs, &self.config, &mut self.outcome);
                self.outcome.wake_evictions += 1;
                if self.runs.ready_at[v] > now {
                    self.pending.push(v);
                }
                victims.push(self.jobs[v].id);
                let job = self.jobs[v].id;
                self.announced.push(Decision::Evict { slot: v, job, for_job: self.jobs[r].id, ranker: "wake".into(), stop_by_s: now + vacate, lost_gpu_s: lost, forced, wake: true, credit_gpu_h, broken });
            }
            if !ok {
                break;
            }
            done.push(a.clone());
        }
        if ok {
            if self.low(r) {
                self.runs.set_low(r, true);
            }
        } else {
            // Give back what it re-took and start it again from the queue
            // (a job that reports its exit once its processes are gone).
            for a in &done {
                fleet.release(a).expect("just allocated");
            }
            self.runs.held[r].clear();
            self.runs.planned_end[r] = None;
            self.outcome.wake_failures += 1;
            if !self.low(r) {
                self.high_milli -= self.jobs[r].gpus() * u64::from(self.jobs[r].shape.gpu_milli);
            }
            if self.jobs[r].reports_exit {
                self.runs.ready_at[r] = u64::MAX;
            }
            self.pending.push(r);
        }
        // Borrowers that report their exit keep what the replica did not
        // take back (all of it, when the wake failed) until they are gone;
        // the replica waits for them.
        for (v, released) in borrowers {
            let until = self.runs.drain_victim(fleet, v, &released);
            if ok {
                self.runs.awaiting.entry(r).or_default().extend(until);
            }
        }
        self.announced.push(Decision::Wake { slot: r, job: self.jobs[r].id, victims, requeued: !ok });
    }

    /// One walk of the queue in (effective priority desc, arrival, id)
    /// order, starting every job that fits (taking capacity back from
    /// low-priority work for a high-priority job that does not, when a
    /// ranker is given), reserving for a job that has waited too long.
    fn pass(&mut self, fleet: &mut Fleet, now: u64, deciders: &mut Deciders, world: &mut World, out: &mut Vec<Decision>) -> Result<(), (Option<Slot>, Hook, PolicyError)> {
        let Deciders { placement: policy, preemption, compaction } = deciders;
        let World { eligible, observer } = world;
        let eligible = *eligible;
        let high_priority = self.config.high_priority;
        let low = |jobs: &[Job], j: usize| jobs[j].priority < high_priority;
        // What changed since the last pass, so that jobs that did not fit
        // then are tried again only where they might fit now: `freed` when
        // constraints relaxed or capacity moved anywhere (every job is
        // tried), else the nodes where capacity was released (a waiting
        // single task can only fit on one of those); jobs new to the queue
        // are always tried.
        // Jobs whose ready time came since the last pass are new here (a
        // live pass need not land on that second).
        let since = std::mem::replace(&mut self.last_pass_s, now);
        let mut freed = std::mem::take(&mut self.freed);
        // Jobs held back for a spent admission budget are tried again once
        // their window has ended.
        if self.window_held.values().any(|&(_, ends)| ends <= now) {
            freed = true;
        }
        self.window_held.clear();
        // Per scope, the first job in queue order that could not start this
        // pass (what smaller work after it is admitted ahead of).
        let mut head_waiting: HashMap<HeadKey, Slot> = HashMap::new();
        let mut touched = std::mem::take(&mut self.touched);
        {
            let (jobs, guards, config, out_since) = (&self.jobs, &self.config.guards, &self.config, &self.runs.out_since);
            let effective = |i: usize| {
                let aging = guards.of(&jobs[i]).map_or(0.0, |g| g.aging_per_hour);
                let waited_h = now.saturating_sub(jobs[i].arrival_s) as f64 / 3600.0;
                u64::from(jobs[i].priority) + (aging * waited_h) as u64
            };
            // Work out of service under a bounded outage goes ahead of new
            // work of its priority (its contract says when it runs again).
            let new_work = |i: usize| !(out_since.contains_key(&i) && config.contract_of(&jobs[i]).max_outage_s > 0);
            self.pending.sort_by_cached_key(|&i| (Reverse(effective(i)), new_work(i), jobs[i].arrival_s, jobs[i].id));
        }
        self.outcome.passes += 1;
        if std::mem::take(&mut self.compact_due)
            && let Some((planner, cc)) = compaction.as_mut()
        {
            // Sleeping replicas are off the fleet, leaving jobs on their way
            // out: not movable.
            let running_now: Vec<(u64, usize)> = self
                .runs
                .planned_end
                .iter()
                .enumerate()
                .filter(|(j, _)| !self.sleeping.contains_key(j) && !self.runs.leaving.contains(j))
                .filter_map(|(j, e)| e.map(|e| (e, j)))
                .collect();
            match crate::compaction::step_jobs(fleet, &self.jobs, &mut self.runs.held, &running_now, &self.pending, *planner, cc, &mut self.compaction_state, now) {
                Ok(step) => {
                    freed |= !step.applied.is_empty();
                    self.outcome.compaction.add(&step.ledger);
                }
                Err(e) => return Err((None, Hook::Compact, PolicyError::InvalidOutput(e.to_string()))),
            }
        }
        // A reservation whose job started, or whose estimate passed, is
        // dropped and planned again.
        let before = self.reservations.len();
        let outcome_jobs = &self.outcome.jobs;
        self.reservations.retain(|_, r| outcome_jobs[r.job].start_s.is_none() && now < r.until);
        let reservations = &self.reservations;
        self.drained_by.retain(|_, scope| reservations.contains_key(scope));
        freed |= self.reservations.len() != before;
        if freed {
            self.gang_bounds.clear();
        } else {
            self.gang_bounds.raise(fleet, &touched, &self.classes);
        }
        // Shapes that did not fit this pass under the same constraints: not
        // retried until the next event.
        let mut failed: HashSet<(ShapeKey, bool)> = HashSet::new();
        // The fleet as high priority sees it (no low-priority work), made
        // when the first job that may preempt is tried.
        let mut view: Option<HighView> = None;
        let mut kept_view = self.high_view.take();
        let pending = std::mem::take(&mut self.pending);
        let mut still_pending = Vec::with_capacity(pending.len());
        let mut evicted = Vec::new();
        let mut error = None;
        for (at, &j) in pending.iter().enumerate() {
            let jobs = &self.jobs;
            let job = &jobs[j];
            let ready = self.runs.ready_at[j];
            let new_here = std::mem::take(&mut self.fresh[j]) || (ready > since && ready <= now);
            if self.runs.ready_at[j] > now || !(freed || new_here || !touched.is_empty()) {
                still_pending.push(j); // evicted and still vacating, or nothing changed
                if self.runs.ready_at[j] <= now {
                    waits_at_head(&mut head_waiting, jobs, j);
                }
                continue;
            }
            let remaining = job.duration_s.saturating_sub(self.runs.kept_s[j]).max(1);
            // Smaller work behind a waiting job of its scope: its window
            // (index), the waiting job's key, and what this job would cost
            // its budget. With the budget spent it waits for the next window.
            let admission = self.config.guards.of(job).and_then(|g| g.window).and_then(|w| {
                let (head_key, h) = waiting_ahead_of(&head_waiting, jobs, j)?;
                Some((w, now / w.window_s, head_key, h, job.gpus_held() * remaining as f64 / 3600.0))
            });
            if let Some((w, index, head_key, h, cost)) = admission {
                let used = self.admitted.get(&head_key).filter(|(i, _)| *i == index).map_or(0.0, |(_, u)| *u);
                if used + cost > w.small_gpu_h {
                    let ends = (index + 1).saturating_mul(w.window_s);
                    if !self.window_held.values().any(|&(_, e)| e == ends) {
                        self.runs.wakeups.push(Reverse(ends)); // once per window end
                    }
                    self.window_held.insert(j, (jobs[h].id, ends));
                    still_pending.push(j);
                    continue;
                }
            }
            // Its run's length at the slowest rate it could get (placement
            // sets the rate): what a reservation must not be overrun by.
            let longest = self.config.work.as_ref().map_or(remaining, |w| (remaining as f64 / w.slowest()).ceil() as u64);
            // Work that would still run at a reservation's time keeps off
            // the nodes drained for it; shorter work may use them.
            let avoided: Vec<Option<u32>> = self
                .reservations
                .iter()
                .filter(|(_, r)| r.job != j && now.saturating_add(longest) > r.until)
                .map(|(scope, _)| *scope)
                .collect();
            let key: ShapeKey = (avoided, self.class_of[j]);
            let is_low = low(jobs, j);
            let may_borrow = is_low && self.may_borrow(j, now, longest);
            if failed.contains(&(key.clone(), may_borrow)) {
                still_pending.push(j);
                waits_at_head(&mut head_waiting, jobs, j);
                continue;
            }
            let (drained_by, lent) = (&self.drained_by, &self.lent);
            let avoided = &key.0;
            // Lent GPUs are for low-priority work only (their owners wake),
            // and of that for work that may be evicted or ends in time.
            let keep = |id: NodeId, n: &Node| {
                job.partition.is_none_or(|p| n.partition == p)
                    && drained_by.get(&id).is_none_or(|scope| !avoided.contains(scope))
                    && (may_borrow || !lent.contains_key(&id))
                    && eligible.is_none_or(|e| e(job, id, n))
            };
            let fits_where_freed = || {
                touched.iter().any(|&id| {
                    let node = &fleet.nodes()[id as usize];
                    keep(id, node) && crate::predicate::check(node, &job.shape).is_ok()
                })
            };
            // (A job that may preempt is tried anyway: victims may have
            // become available anywhere.)
            let may_preempt = preemption.is_some() && !is_low;
            if !(freed || new_here || may_preempt) && job.tasks == 1 && !fits_where_freed() {
                still_pending.push(j);
                waits_at_head(&mut head_waiting, jobs, j);
                continue;
            }
            // A gang whose tasks cannot all fit, even ignoring placement, is
            // not offered to the policy (place_gang would decline it too);
            // its bound spares the scan of the fleet until enough capacity
            // came back.
            let bound_key: Option<GangKey> = (job.tasks > 1).then(|| (key.clone(), may_borrow));
            let mut hopeless = bound_key.as_ref().is_some_and(|k| self.gang_bounds.rules_out(k, &self.classes));
            if let Some(k) = bound_key
                && !hopeless
            {
                let fit = fitting_tasks_among(fleet, &job.shape, job.tasks, &keep);
                if fit < job.tasks {
                    self.gang_bounds.record(k, fit);
                    hopeless = true;
                }
            }
            // With preemption, a high-priority job goes where it would go
            // if no low-priority work ran (low work is invisible to it, so
            // it cannot scatter high work and starve gangs), and takes back
            // the low work in the way there, chosen by the ranker.
            let mut placed = None;
            let mut settled = false;
            if may_preempt {
                let view = &mut view.get_or_insert_with(|| self.runs.high_view(fleet, kept_view.take())).fleet;
                if job.tasks > 1 && fitting_tasks_among(view, &job.shape, job.tasks, &keep) < job.tasks {
                    settled = true; // does not fit even with no low work
                } else {
                    // Equal scores go to the node with the least low-priority
                    // work in the way: fewer evictions, the same layout.
                    // (From the free summaries: read side by side, not node by node.)
                    let in_the_way: Vec<u32> = view.free_summaries().iter().zip(fleet.free_summaries()).map(|(v, f)| v.gpu_free_milli - f.gpu_free_milli).collect();
                    let mut planned = 0;
                    match attempt(view, &mut self.placer, &mut **policy, job, &mut planned, &keep, &mut None, Some(&in_the_way)) {
                        Ok(None) => settled = true,
                        Ok(Some((plan, _))) => {
                            // The plan fixes the kind of node the job takes:
                            // any node in the same state in the view (same
                            // switch domain, model and free resources) is as
                            // good for high priority, so the ranker chooses
                            // among all of them whose low work makes room.
                            for a in &plan {
                                view.release(a).expect("just planned");
                            }
                            let coarse = |n: &Node| (n.switch_domain, n.model, n.partition, n.cpu_free_milli, n.memory_free_mib, n.gpu_free_milli());
                            let state = |n: &Node| {
                                let mut gpus = n.gpus.clone();
                                gpus.sort_unstable();
                                (coarse(n), gpus)
                            };
                            let kinds: HashSet<_> = plan.iter().map(|a| state(&view.nodes()[a.node as usize])).collect();
                            let coarse_kinds: HashSet<_> = kinds.iter().map(|k| k.0).collect();
                            // Nodes are read only where their free summary
                            // matches one of the kinds (most of a fleet does not).
                            let brief: HashSet<(u32, u64, u32)> = coarse_kinds.iter().map(|c| (c.3, c.4, c.5 as u32)).collect();
                            let summaries = view.free_summaries();
                            let mut like: HashSet<NodeId> = (0..view.nodes().len() as NodeId)
                                .filter(|&id| {
                                    let f = &summaries[id as usize];
                                    if !brief.contains(&(f.cpu_free_milli, f.memory_free_mib, f.gpu_free_milli)) {
                                        return false;
                                    }
                                    let n = &view.nodes()[id as usize];
                                    coarse_kinds.contains(&coarse(n)) && keep(id, n) && kinds.contains(&state(n))
                                })
                                .collect();
                            // A single task may go to any node the policy
                            // scores as high as the plan's, in any switch
                            // domain: the ranker chooses among all of them
                            // (one more scoring call, only when low work is
                            // in the way of every node of the plan's kind).
                            // (A failing policy here only loses the wider
                            // choice: its failure counts where the attempt on
                            // the fleet is observed.)
                            if job.tasks == 1
                                && fitting_tasks_among(fleet, &job.shape, 1, &|id, n| like.contains(&id) && keep(id, n)) == 0
                                && let Ok(tied) = self.placer.tied_best(view, &job.shape, job.meta(), &mut **policy, &keep)
                            {
                                like.extend(tied);
                            }
                            let there = |id: NodeId, n: &Node| like.contains(&id) && keep(id, n);
                            let picked = if fitting_tasks_among(fleet, &job.shape, job.tasks, &there) >= job.tasks {
                                Some(Vec::new())
                            } else {
                                let ranker = preemption.as_deref_mut().expect("may preempt");
                                match self.choose_victims(fleet, ranker, j, now, &there, observer) {
                                    Ok(p) => p,
                                    Err(e) => {
                                        error = Some((at, j, Hook::Rank, e));
                                        break;
                                    }
                                }
                            };
                            let ranker = preemption.as_deref_mut().expect("may preempt");
                            if let Some(chosen) = picked {
                                self.runs.release_victims(fleet, &chosen, &mut touched);
                                match attempt(fleet, &mut self.placer, &mut **policy, job, &mut self.outcome.placements, &there, observer, None) {
                                    Ok(Some((allocs, domains))) => {
                                        if !chosen.is_empty() {
                                            self.gang_bounds.clear();
                                        }
                                        let ranker_name = ranker.describe();
                                        let (delay, victims) = self.runs.take_victims(fleet, &chosen, j, now, &self.jobs, &self.config, &mut self.outcome, &ranker_name, out, &mut evicted);
                                        for a in &allocs {
                                            view.allocate(a).expect("the view holds less than the fleet");
                                        }
                                        placed = Some((allocs, domains, delay, victims));
                                        settled = true;
                                    }
                                    other => {
                                        // Room was counted, so this cannot
                                        // happen; never lose the victims'
                                        // places if it does.
                                        self.runs.hold_again(fleet, &chosen);
                                        if let Err(e) = other {
                                            error = Some((at, j, Hook::Place, e));
                                            break;
                                        }
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            // The plan is not observed (its allocations are
                            // not the decision); a failing policy must still
                            // reach the observer (the live breaker): one
                            // observed attempt on the fleet decides.
                            match attempt(fleet, &mut self.placer, &mut **policy, job, &mut self.outcome.placements, &keep, observer, None) {
                                Ok(Some((allocs, domains))) => {
                                    for a in &allocs {
                                        view.allocate(a).expect("the view holds less than the fleet");
                                    }
                                    placed = Some((allocs, domains, 0, Vec::new()));
                                    settled = true;
                                }
                                Ok(None) => {
                                    error = Some((at, j, Hook::Place, e));
                                    break;
                                }
                                Err(again) => {
                                    error = Some((at, j, Hook::Place, again));
                                    break;
                                }
                            }
                        }
                    }
                }
            }
            // Low-priority work goes first where high priority holds
            // nothing (it is least in the way there), then anywhere.
            // (Counted first, so that one attempt is made and observed.)
            if is_low && !hopeless && preemption.is_some() {
                let view = &view.get_or_insert_with(|| self.runs.high_view(fleet, kept_view.take())).fleet;
                let away = |id: NodeId, n: &Node| keep(id, n) && view.nodes()[id as usize].is_idle();
                let room_away = fitting_tasks_among(fleet, &job.shape, job.tasks, &away) >= job.tasks;
                let among: &dyn Fn(NodeId, &Node) -> bool = if room_away { &away } else { &keep };
                match attempt(fleet, &mut self.placer, &mut **policy, job, &mut self.outcome.placements, among, observer, None) {
                    Ok(p) => {
                        settled = true;
                        placed = p.map(|(a, d)| (a, d, 0, Vec::new()));
                    }
                    Err(e) => {
                        error = Some((at, j, Hook::Place, e));
                        break;
                    }
                }
            }
            // (A single task, or a gang counted above: no second count.)
            let mut placed = if hopeless || settled {
                placed
            } else {
                match attempt(fleet, &mut self.placer, &mut **policy, job, &mut self.outcome.placements, &keep, observer, None) {
                    Ok(p) => p.map(|(a, d)| (a, d, 0, Vec::new())),
                    Err(e) => {
                        error = Some((at, j, Hook::Place, e));
                        break;
                    }
                }
            };
            if placed.is_none()
                && !is_low
                && !settled
                && let Some(ranker) = preemption.as_deref_mut()
            {
                let chosen = match self.choose_victims(fleet, ranker, j, now, &keep, observer) {
                    Ok(c) => c,
                    Err(e) => {
                        error = Some((at, j, Hook::Rank, e));
                        break;
                    }
                };
                if let Some(chosen) = chosen {
                    self.gang_bounds.clear(); // capacity comes back outside the departures
                    self.runs.release_victims(fleet, &chosen, &mut touched);
                    match attempt(fleet, &mut self.placer, &mut **policy, job, &mut self.outcome.placements, &keep, observer, None) {
                        Ok(Some((allocs, domains))) => {
                            let ranker_name = ranker.describe();
                            let (delay, victims) = self.runs.take_victims(fleet, &chosen, j, now, &self.jobs, &self.config, &mut self.outcome, &ranker_name, out, &mut evicted);
                            placed = Some((allocs, domains, delay, victims));
                        }
                        other => {
                            // Cannot happen when enough tasks fit, but never
                            // lose the victims' places if it does.
                            self.runs.hold_again(fleet, &chosen);
                            if let Err(e) = other {
                                error = Some((at, j, Hook::Place, e));
                                break;
                            }
                        }
                    }
                }
            }
            let job = &self.jobs[j];
            match placed {
                Some((allocs, domains, delay, victims)) => {
                    if !settled
                        && !is_low
                        && let Some(view) = view.as_mut()
                    {
                        for a in &allocs {
                            view.fleet.allocate(a).expect("the view holds less than the fleet");
                        }
                    }
                    let start = now + delay;
                    out.push(Decision::Place { slot: j, job: job.id, allocations: allocs.clone(), domains, start_s: start, victims });
                    // Admitted ahead of a waiting job: counted in its window.
                    if let Some((_, index, head_key, _, cost)) = admission {
                        let entry = self.admitted.entry(head_key).or_insert((index, 0.0));
                        if entry.0 != index {
                            *entry = (index, 0.0);
                        }
                        entry.1 += cost;
                    }
                    self.runs.resumed_from.remove(&j);
                    if let Some(since) = self.runs.out_since.remove(&j) {
                        let out_s = start.saturating_sub(since);
                        let contract = self.config.contract_of(job);
                        if !(contract.max_outage_s > 0 && out_s > contract.max_outage_s) {
                            // Kept in case this start never happens.
                            self.runs.resumed_from.insert(j, since);
                        } else {
                            let promise = crate::contract::Broken::Outage { out_s };
                            let credit_gpu_h = self.config.compensation.for_broken(0.0, job.gpus_held());
                            self.outcome.owe(j, credit_gpu_h, true);
                            out.push(Decision::Broken { slot: j, job: job.id, promise, lost_gpu_s: 0.0, credit_gpu_h });
                        }
                    }
                    self.runs.held[j] = allocs;
                    let o = &mut self.outcome.jobs[j];
                    o.start_s.get_or_insert(start);
                    o.domains = domains;
                    self.runs.run_start[j] = start;
                    self.runs.checkpoint_at[j] = None;
                    // Placement sets how fast the run advances its work.
                    let rate = self.config.work.as_ref().map_or(1.0, |w| w.rate(self.runs.held[j].first().and_then(|a| fleet.nodes()[a.node as usize].model), domains));
                    self.runs.rate[j] = rate;
                    let end = start.saturating_add(if rate == 1.0 { remaining } else { (remaining as f64 / rate).ceil() as u64 });
                    self.runs.planned_end[j] = Some(end);
                    if low(&self.jobs, j) {
                        self.runs.set_low(j, true);
                    } else {
                        self.high_milli += job.gpus() * u64::from(job.shape.gpu_milli);
                    }
                }
                None => {
                    failed.insert((key, may_borrow));
                    still_pending.push(j);
                    waits_at_head(&mut head_waiting, &self.jobs, j);
                    if let Some(g) = self.config.guards.of(job)
                        && !self.reservations.contains_key(&job.partition)
                        && now.saturating_sub(job.arrival_s) >= g.reserve_after_s
                    {
                        let in_scope = |n: &Node| job.partition.is_none_or(|p| n.partition == p);
                        let ends: Vec<(u64, usize)> = self.runs.planned_end.iter().enumerate().filter_map(|(j, e)| e.map(|e| (e, j))).collect();
                        let (until, nodes) = shadow_time(fleet, ends, &self.runs.held, job, &in_scope);
                        self.outcome.reservations += 1;
                        for &id in &nodes {
                            self.drained_by.entry(id).or_insert(job.partition);
                        }
                        let mut listed: Vec<NodeId> = nodes.into_iter().collect();
                        listed.sort_unstable();
                        out.push(Decision::Reserve { slot: j, job: job.id, until_s: until, nodes: listed });
                        self.reservations.insert(job.partition, Reservation { job: j, until });
                    }
                }
            }
        }
        if let Some((at, j, hook, e)) = error {
            // The rest of the queue keeps its place, untried.
            still_pending.push(j);
            still_pending.extend_from_slice(&pending[at + 1..]);
            still_pending.extend(evicted);
            self.pending = still_pending;
            // (The view may be midway through this job: made anew next time.)
            self.high_view = None;
            return Err((Some(j), hook, e));
        }
        still_pending.extend(evicted);
        self.pending = still_pending;
        self.high_view = view.or(kept_view);
        Ok(())
    }

    /// The victims to evict so that job `j` fits, or `None`: candidates are
    /// running low-priority jobs below `j`'s priority, under their daily
    /// interruption limit, holding something on a node `j` could use; the
    /// ranker orders them and [`select_victims`] takes the shortest
    /// sufficient prefix.
    fn choose_victims(
        &self,
        fleet: &Fleet,
        ranker: &mut dyn PreemptionPolicy,
        j: Slot,
        now: u64,
        keep: &dyn Fn(NodeId, &Node) -> bool,
        observer: &mut Option<&mut dyn Observer>,
    ) -> Result<Option<Vec<Slot>>, PolicyError> {
        let job = &self.jobs[j];
        let usable = |id: NodeId| {
            let node = &fleet.nodes()[id as usize];
            keep(id, node) && (job.shape.gpu_count == 0 || job.shape.accepts(node.model))
        };
        let (slots, candidates) = self.victim_candidates(fleet, j, now, &usable);
        let picked = select_victims(fleet, ranker, job, &candidates, keep)?;
        if let Some(o) = observer.as_deref_mut()
            && !candidates.is_empty()
        {
            o.after_rank(fleet, job, &candidates, keep, picked.as_deref());
        }
        Ok(picked.map(|picked| picked.into_iter().map(|k| slots[k]).collect()))
    }

    /// Whether running low-priority job `v` may be taken back by work of
    /// `priority` now: below it, not guaranteed (no ranker can name
    /// guaranteed work), under its daily interruption limit, holding
    /// something on a node `usable` accepts.
    fn may_take_back(&self, v: Slot, priority: u32, now: u64, usable: &dyn Fn(NodeId) -> bool) -> bool {
        let vj = &self.jobs[v];
        let contract = self.config.contract_of(vj);
        vj.priority < priority
            && contract.tier != crate::contract::Tier::Guaranteed
            && self.runs.recent_interruptions(v, now) < contract.max_interruptions_per_day as usize
            && self.runs.held[v].iter().any(|a| usable(a.node))
    }

    /// The running work a new job of `priority` could take back now, by
    /// slot, before any ranking (a quote's "by preemption" answer): empty
    /// where `priority` is below the high-priority threshold.
    pub fn may_take_back_for(&self, fleet: &Fleet, priority: u32, now: u64) -> Vec<Slot> {
        if priority < self.config.high_priority {
            return Vec::new();
        }
        let usable = |id: NodeId| {
            let node = &fleet.nodes()[id as usize];
            node.schedulable && !self.config.protected_partitions.contains(&node.partition)
        };
        self.runs.running_low.iter().copied().filter(|&v| self.may_take_back(v, priority, now, &usable)).collect()
    }

    /// The running low-priority jobs job `j` may take back, with what the
    /// ranker sees of them: below `j`'s priority, under their daily
    /// interruption limit, holding something on a schedulable node outside
    /// the protected partitions that `usable` accepts.
    fn victim_candidates<'a>(&'a self, fleet: &Fleet, j: Slot, now: u64, usable: &dyn Fn(NodeId) -> bool) -> (Vec<Slot>, Vec<Candidate<'a>>) {
        let job = &self.jobs[j];
        let config = &self.config;
        let usable = |id: NodeId| {
            let node = &fleet.nodes()[id as usize];
            node.schedulable && !config.protected_partitions.contains(&node.partition) && usable(id)
        };
        let mut slots = Vec::new();
        let mut candidates = Vec::new();
        for &v in &self.runs.running_low {
            if !self.may_take_back(v, job.priority, now, &usable) {
                continue;
            }
            let vj = &self.jobs[v];
            let contract = config.contract_of(vj);
            let recent = self.runs.recent_interruptions(v, now);
            let ran = now.saturating_sub(self.runs.run_start[v]);
            candidates.push(Candidate {
                job: vj,
                held: &self.runs.held[v],
                running_s: ran,
                remaining_s: vj.duration_s.saturating_sub(self.runs.kept_s[v] + self.runs.work_in(v, ran)),
                since_checkpoint_s: self.runs.since_checkpoint(v, now, vj, &contract),
                tier: contract.tier,
                interruptions_left: if contract.max_interruptions_per_day == u32::MAX {
                    u32::MAX
                } else {
                    contract.max_interruptions_per_day.saturating_sub(recent as u32)
                },
            });
            slots.push(v);
        }
        (slots, candidates)
    }
}

/// Who smaller work is admitted ahead of (see [`AdmissionWindow`]): per
/// scope and GPU model (`None`: a job that accepts several models or any),
/// the waiting job with the most GPUs so far in queue order. Jobs pin one
/// model (ASI: over 99%): work on other models does not take its capacity.
type HeadKey = (Option<u32>, Option<crate::units::ModelId>);

fn head_key(job: &Job) -> HeadKey {
    (job.partition, if job.shape.models.len() == 1 { Some(job.shape.models[0]) } else { None })
}

/// Waiting job `j` could not start this pass: it may be the one smaller
/// work of its scope and model is admitted ahead of.
fn waits_at_head(head: &mut HashMap<HeadKey, Slot>, jobs: &[Job], j: Slot) {
    if jobs[j].gpus() == 0 {
        return;
    }
    let at = head.entry(head_key(&jobs[j])).or_insert(j);
    if jobs[j].gpus() > jobs[*at].gpus() {
        *at = j;
    }
}

/// The waiting job job `j` would start ahead of, if any: one with more
/// GPUs, in its scope, that could use the same model (the largest such).
fn waiting_ahead_of(head: &HashMap<HeadKey, Slot>, jobs: &[Job], j: Slot) -> Option<(HeadKey, Slot)> {
    let job = &jobs[j];
    if job.gpus() == 0 {
        return None; // CPU-only work takes no GPU from a gang
    }
    let (scope, model) = head_key(job);
    head.iter()
        .filter(|((p, m), _)| *p == scope && (m.is_none() || model.is_none() || *m == model))
        .filter(|&(_, &h)| jobs[h].gpus() > job.gpus() && (model.is_some() || jobs[h].shape.models.is_empty() || job.shape.models.iter().any(|x| jobs[h].shape.models.contains(x))))
        .max_by_key(|&(_, &h)| (jobs[h].gpus(), std::cmp::Reverse(h)))
        .map(|(k, &h)| (*k, h))
}

/// One placement attempt, shown to the world's observer.
fn attempt(
    fleet: &mut Fleet,
    placer: &mut Placer,
    policy: &mut dyn PlacementPolicy,
    job: &Job,
    placements: &mut u64,
    keep: &dyn Fn(NodeId, &Node) -> bool,
    observer: &mut Option<&mut dyn Observer>,
    tie_rank: Option<&[u32]>,
) -> Result<Option<(Vec<Allocation>, u32)>, PolicyError> {
    if let Some(o) = observer.as_deref_mut() {
        o.before_place(fleet, job, keep);
    }
    let result = place_fitting_gang(fleet, placer, policy, job, placements, keep, tie_rank);
    if let Some(o) = observer.as_deref_mut() {
        o.after_place(fleet, job, &result);
    }
    result
}

/// For gangs that did not fit: an upper bound on how many of their tasks
/// could fit now. Set to the exact count when a scan fails, then raised by
/// what each node that released capacity could hold, so that on a large
/// fleet a waiting gang is not re-scanned after every departure, only when
/// enough capacity may have come back. Valid only while capacity returns
/// through departures alone: anything else (constraints relaxed, moves,
/// evictions) clears it.
#[derive(Default)]
struct GangBounds {
    bounds: HashMap<GangKey, u32>,
}

impl GangBounds {
    fn clear(&mut self) {
        self.bounds.clear();
    }

    fn record(&mut self, key: GangKey, fitting: u32) {
        self.bounds.insert(key, fitting);
    }

    /// A class id is recycled: what was known of its old shape goes.
    fn forget_class(&mut self, class: u32) {
        self.bounds.retain(|((_, c), _), _| *c != class);
    }

    /// True when the gang surely cannot fit: its bound is below its size.
    fn rules_out(&self, key: &GangKey, classes: &[(Option<u32>, u32, TaskShape)]) -> bool {
        self.bounds.get(key).is_some_and(|&b| b < classes[key.0.1 as usize].1)
    }

    /// Capacity came back on `released`: a gang's bound grows by what those
    /// nodes could hold of it now (counted whether or not drained or lent,
    /// which only makes the bound looser, never wrong).
    fn raise(&mut self, fleet: &Fleet, released: &HashSet<NodeId>, classes: &[(Option<u32>, u32, TaskShape)]) {
        if released.is_empty() {
            return;
        }
        for (((_, class), _), bound) in self.bounds.iter_mut() {
            let (partition, tasks, shape) = &classes[*class as usize];
            for &id in released {
                let node = &fleet.nodes()[id as usize];
                if partition.is_none_or(|p| node.partition == p) {
                    *bound = bound.saturating_add(tasks_on_node(node, shape).min(*tasks));
                }
            }
        }
        self.bounds.retain(|((_, class), _), bound| *bound < classes[*class as usize].1);
    }
}

/// Milli-GPUs in use on lent GPUs (borrowed from sleeping replicas).
fn lent_in_use(fleet: &Fleet, lent: &HashMap<NodeId, u64>) -> u64 {
    lent.iter()
        .map(|(&id, &mask)| crate::fleet::gpus_of(mask).map(|g| u64::from(crate::units::MILLI_PER_GPU - fleet.nodes()[id as usize].gpus[g])).sum::<u64>())
        .sum()
}

/// The fleet as high priority sees it: without the running low-priority
/// work (which it may take back). Kept from pass to pass and brought up to
/// date by the nodes that changed since: made anew, it cost a copy of every
/// node and the release of every low-priority allocation per pass (at
/// 20,000 nodes and 150,000 tasks, most of a pass).
struct HighView {
    fleet: Fleet,
    /// The [`Fleet::lineage`] it shows, as of its [`Fleet::changes`] mark.
    of: u64,
    synced: u64,
}

/// Nodes listed for the view without low-priority work between two of its
/// updates, at most: past this, it is made anew.
const MAX_LOW_MOVED: usize = 1 << 16;

/// Notes `nodes` for the view (see [`Runs::low_moved`]); past
/// [`MAX_LOW_MOVED`], the view is made anew instead.
fn note_low_moved(moved: &mut Option<Vec<NodeId>>, nodes: impl IntoIterator<Item = NodeId>) {
    if let Some(list) = moved {
        list.extend(nodes);
        if list.len() > MAX_LOW_MOVED {
            *moved = None;
        }
    }
}

/// Per-job state of runs.
#[derive(Default)]
struct Runs {
    /// Planned end of the current run; `None` when not running.
    planned_end: Vec<Option<u64>>,
    held: Vec<Vec<Allocation>>,
    /// When the current run's work started (after any victims vacated).
    run_start: Vec<u64>,
    /// Work seconds the current run does per second (see [`WorkRates`]).
    rate: Vec<f64>,
    /// The last checkpoint the job reported in its current run.
    checkpoint_at: Vec<Option<u64>>,
    /// Work kept across evictions (checkpointed).
    kept_s: Vec<u64>,
    /// When an evicted job, vacating, may run again (`u64::MAX`: when its
    /// exit is reported); and the modelled times as events.
    ready_at: Vec<u64>,
    wakeups: BinaryHeap<Reverse<u64>>,
    /// Times each job was taken back.
    interrupted_at: HashMap<usize, Vec<u64>>,
    /// When each stopped job went out of service (vacated), until it runs
    /// again: its outage is measured from then.
    out_since: HashMap<usize, u64>,
    /// The outage start of a job placed again within its bound, until its
    /// next stop: an [`Event::Unstarted`] puts it back.
    resumed_from: HashMap<usize, u64>,
    /// Running low-priority jobs: the candidate victims. Changed through
    /// [`Runs::set_low`] only.
    running_low: BTreeSet<usize>,
    /// The nodes of jobs that started or stopped counting as running
    /// low-priority work since the [`HighView`] was last brought up to
    /// date (where the fleet itself may not have changed: a job leaving,
    /// put to sleep, evicted); `None`: too many, or no view yet.
    low_moved: Option<Vec<NodeId>>,
    /// Running jobs on their way out ([`Event::Leaving`]): held, untouched.
    leaving: BTreeSet<usize>,
    /// Capacity held for processes that may still run on it (see [`Drain`]).
    drains: Vec<Drain>,
    /// A placed or waking job's victims (and what they waited for) whose
    /// exit is not reported yet: its GPUs drain if it ends before they go.
    awaiting: HashMap<Slot, BTreeSet<Slot>>,
}

/// Capacity held, in the fleet, for processes that may still use it: the
/// GPUs of an evicted job its preemptor did not take, or what a job that
/// ended before its victims were gone held. A GPU leaves a job only when
/// the processes that used it are gone: this is how the engine keeps that
/// promise for jobs that report their exit. Released once every job in
/// `until` has vacated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drain {
    pub alloc: Allocation,
    pub until: BTreeSet<Slot>,
}

/// Allocates, of `a`, what is free on its node now (whole, else GPU by GPU
/// and the CPU and memory left), and returns what it took.
fn hold_what_is_free(fleet: &mut Fleet, a: &Allocation) -> Vec<Allocation> {
    if fleet.allocate(a).is_ok() {
        return vec![a.clone()];
    }
    let mut held = Vec::new();
    for g in crate::fleet::gpus_of(a.gpus) {
        let milli = a.gpu_milli.min(fleet.nodes()[a.node as usize].gpus[g]);
        let one = Allocation { node: a.node, gpus: 1 << g, gpu_milli: milli, cpu_milli: 0, memory_mib: 0 };
        if milli > 0 && fleet.allocate(&one).is_ok() {
            held.push(one);
        }
    }
    let n = &fleet.nodes()[a.node as usize];
    let rest = Allocation { node: a.node, gpus: 0, gpu_milli: 0, cpu_milli: a.cpu_milli.min(n.cpu_free_milli), memory_mib: a.memory_mib.min(n.memory_free_mib) };
    if (rest.cpu_milli > 0 || rest.memory_mib > 0) && fleet.allocate(&rest).is_ok() {
        held.push(rest);
    }
    held
}

impl Runs {
    /// A slot as `push` makes it.
    fn reset(&mut self, v: usize) {
        self.planned_end[v] = None;
        self.held[v].clear();
        self.run_start[v] = 0;
        self.rate[v] = 1.0;
        self.checkpoint_at[v] = None;
        self.kept_s[v] = 0;
        self.ready_at[v] = 0;
        self.interrupted_at.remove(&v);
        self.out_since.remove(&v);
        self.resumed_from.remove(&v);
        self.awaiting.remove(&v);
        self.leaving.remove(&v);
    }

    fn push(&mut self) {
        self.planned_end.push(None);
        self.held.push(Vec::new());
        self.run_start.push(0);
        self.rate.push(1.0);
        self.checkpoint_at.push(None);
        self.kept_s.push(0);
        self.ready_at.push(0);
    }

    /// Seconds of work since the job's last checkpoint: reported ones for a
    /// job that reports its exit, else its contract's periodic interval.
    fn since_checkpoint(&self, v: usize, now: u64, job: &Job, contract: &PriorityContract) -> u64 {
        self.work_in(v, self.since_checkpoint_wall(v, now, job, contract))
    }

    /// The same in wall seconds of the run.
    fn since_checkpoint_wall(&self, v: usize, now: u64, job: &Job, contract: &PriorityContract) -> u64 {
        let ran = now.saturating_sub(self.run_start[v]);
        match self.checkpoint_at[v] {
            Some(at) => now.saturating_sub(at.max(self.run_start[v])),
            None if job.reports_exit => ran,
            None => ran % contract.checkpoint_every_s.max(1),
        }
    }

    /// Seconds of work job `v`'s current run does in `wall` seconds.
    fn work_in(&self, v: usize, wall: u64) -> u64 {
        let rate = self.rate[v];
        if rate == 1.0 { wall } else { (wall as f64 * rate) as u64 }
    }

    /// How often job `v` was taken back in the 24 hours before `now`.
    fn recent_interruptions(&self, v: usize, now: u64) -> usize {
        self.interrupted_at.get(&v).map_or(0, |t| t.iter().filter(|&&t| t + 86_400 > now).count())
    }

    /// Releases what `chosen`, about to be taken back, hold, noting the
    /// nodes in `touched`.
    fn release_victims(&self, fleet: &mut Fleet, chosen: &[Slot], touched: &mut HashSet<NodeId>) {
        for &v in chosen {
            for alloc in &self.held[v] {
                fleet.release(alloc).expect("a running job's allocations are held");
                touched.insert(alloc.node);
            }
        }
    }

    /// Victim `v` (its allocations `released` a moment ago) reports its
    /// exit: what of them is free now drains until it, and what it waited
    /// for, are gone. Returns what it waited for, for its preemptor.
    fn drain_victim(&mut self, fleet: &mut Fleet, v: Slot, released: &[Allocation]) -> BTreeSet<Slot> {
        let mut until = self.awaiting.remove(&v).unwrap_or_default();
        until.insert(v);
        for a in released {
            for alloc in hold_what_is_free(fleet, a) {
                self.drains.push(Drain { alloc, until: until.clone() });
            }
        }
        until
    }

    /// Job `v` vacated: drains waiting only for it are released (noting
    /// their nodes in `touched`); nobody waits for it any more.
    fn vacated(&mut self, fleet: &mut Fleet, v: Slot, touched: &mut HashSet<NodeId>) -> bool {
        for waits in self.awaiting.values_mut() {
            waits.remove(&v);
        }
        self.awaiting.retain(|_, waits| !waits.is_empty());
        let mut freed = false;
        let mut k = 0;
        while k < self.drains.len() {
            self.drains[k].until.remove(&v);
            if self.drains[k].until.is_empty() {
                let d = self.drains.swap_remove(k);
                // Allocated by this engine when the drain began.
                let released = fleet.release(&d.alloc);
                debug_assert!(released.is_ok(), "a drain's allocation is held: {released:?}");
                touched.insert(d.alloc.node);
                freed = true;
            } else {
                k += 1;
            }
        }
        freed
    }

    /// Allocates again what `chosen`, released as victims a moment ago,
    /// still hold (a placement that then failed).
    fn hold_again(&self, fleet: &mut Fleet, chosen: &[Slot]) {
        for &v in chosen {
            for alloc in &self.held[v] {
                fleet.allocate(alloc).expect("was runs.held a moment ago");
            }
        }
    }

    /// Job `j` starts (`true`) or stops counting as running low-priority
    /// work; its nodes are noted for the view without it.
    fn set_low(&mut self, j: Slot, low: bool) {
        let changed = if low { self.running_low.insert(j) } else { self.running_low.remove(&j) };
        if changed {
            note_low_moved(&mut self.low_moved, self.held[j].iter().map(|a| a.node));
        }
    }

    /// Job `j`'s allocations moved between `nodes` without the fleet
    /// changing there now (a migration recorded after the fact): noted for
    /// the view when `j` counts as low-priority work.
    fn held_moved(&mut self, j: Slot, nodes: [NodeId; 2]) {
        if self.running_low.contains(&j) {
            note_low_moved(&mut self.low_moved, nodes);
        }
    }

    /// The fleet without the running low-priority work, made anew in
    /// `memory`'s allocations.
    fn without_low(&self, fleet: &Fleet, mut memory: Fleet) -> Fleet {
        memory.clone_from(fleet);
        memory.release_all(self.running_low.iter().flat_map(|&v| &self.held[v])).expect("a running job's allocations are held");
        memory
    }

    /// The fleet without the running low-priority work: `kept` (the last
    /// one) brought up to date by the nodes that changed since, else made
    /// anew (in `kept`'s memory).
    fn high_view(&mut self, fleet: &Fleet, mut kept: Option<HighView>) -> HighView {
        let current = |v: &HighView| v.of == fleet.lineage() && v.fleet.nodes().len() == fleet.nodes().len() && v.fleet.models == fleet.models;
        if kept.as_ref().is_some_and(current)
            && self.low_moved.is_some()
            && let (Some(mut view), Some(moved)) = (kept.take(), self.low_moved.as_mut())
        {
            let mut dirty: Vec<NodeId> = fleet.changed_since(view.synced).collect();
            dirty.append(moved);
            if !dirty.is_empty() {
                let mut is_dirty = vec![false; fleet.nodes().len()];
                dirty.retain(|&id| !std::mem::replace(&mut is_dirty[id as usize], true));
                for &id in &dirty {
                    view.fleet.copy_node_from(fleet, id).expect("the view has the fleet's nodes");
                }
                let low_there = self.running_low.iter().flat_map(|&v| &self.held[v]).filter(|a| is_dirty[a.node as usize]);
                view.fleet.release_all(low_there).expect("a running job's allocations are held");
            }
            view.synced = fleet.changes();
            return view;
        }
        let view = self.without_low(fleet, kept.map(|v| v.fleet).unwrap_or_default());
        self.low_moved = Some(Vec::new());
        HighView { fleet: view, of: fleet.lineage(), synced: fleet.changes() }
    }

    /// Takes back `chosen` (their allocations already released) for job
    /// `j` and announces each eviction. Returns how long the slowest takes
    /// to vacate, and the victims' job ids.
    #[allow(clippy::too_many_arguments)]
    fn take_victims(
        &mut self,
        fleet: &mut Fleet,
        chosen: &[Slot],
        j: Slot,
        now: u64,
        jobs: &[Job],
        config: &SimConfig,
        outcome: &mut SimOutcome,
        ranker: &str,
        out: &mut Vec<Decision>,
        vacating: &mut Vec<Slot>,
    ) -> (u64, Vec<u64>) {
        let mut delay = 0;
        let mut victims = Vec::new();
        let mut awaiting = BTreeSet::new();
        for &v in chosen {
            // Released by the caller; the preemptor (allocated since) took
            // what it needs, and what a victim that reports its exit still
            // runs on drains until it is gone.
            let released = std::mem::take(&mut self.held[v]);
            if jobs[v].reports_exit {
                awaiting.extend(self.drain_victim(fleet, v, &released));
            }
            let (vacate, lost, forced, credit_gpu_h, broken) = self.take_back(v, now, jobs, config, outcome);
            delay = delay.max(vacate);
            if self.ready_at[v] > now {
                vacating.push(v);
            }
            victims.push(jobs[v].id);
            out.push(Decision::Evict {
                slot: v,
                job: jobs[v].id,
                for_job: jobs[j].id,
                ranker: ranker.to_string(),
                stop_by_s: now + vacate,
                lost_gpu_s: lost,
                forced,
                wake: false,
                credit_gpu_h,
                broken,
            });
        }
        if !awaiting.is_empty() {
            self.awaiting.entry(j).or_default().extend(awaiting);
        }
        (delay, victims)
    }

    /// When job `v`, vacated at `vacated_s`, may run again: at once, unless
    /// it has used its interruptions for the day; then once the oldest of
    /// them leaves the 24-hour window. Running only work that may still be
    /// taken back keeps every low-priority allocation preemptible, so low
    /// work never blocks high priority for a whole run.
    fn resume_at(&self, v: usize, vacated_s: u64, contract: &PriorityContract) -> u64 {
        let times = self.interrupted_at.get(&v).map_or(&[][..], |t| t.as_slice());
        let max = contract.max_interruptions_per_day as usize;
        // A bounded outage is the promise that counts: at its cap the job
        // runs again, and is no victim until an interruption ages out.
        if max == 0 || times.len() < max || contract.max_outage_s > 0 {
            return vacated_s;
        }
        vacated_s.max(times[times.len() - max] + 86_400)
    }

    /// Takes running job `v` back under its contract (its allocations are
    /// the caller's to release): records the interruption and lost work,
    /// and queues it to resume once vacated. Returns the seconds until it
    /// has vacated at the latest, the GPU-seconds lost and whether it is a
    /// forced termination, with the credit owed for it and the promise it
    /// breaks, if any.
    fn take_back(&mut self, v: usize, now: u64, jobs: &[Job], config: &SimConfig, outcome: &mut SimOutcome) -> (u64, f64, bool, f64, Option<crate::contract::Broken>) {
        let job = &jobs[v];
        let contract = config.contract_of(job);
        let broken = self.breaks_by_stopping(v, now, &contract);
        // In wall seconds, as the contract counts them (notice, grace,
        // checkpoint interval); the kept and lost parts become work below.
        let since = self.since_checkpoint_wall(v, now, job, &contract);
        let ran = now.saturating_sub(self.run_start[v]);
        let times = self.interrupted_at.entry(v).or_default();
        let ev = if job.reports_exit {
            // The world tells when it is gone; until then it is not ready.
            // Work since its last reported checkpoint is lost unless it
            // checkpoints on notice.
            let limit = contract.notice_s + contract.grace_s;
            let lost_s = if contract.checkpoint_on_notice { 0 } else { since };
            crate::preemption::Eviction { vacate_s: limit, forced: false, kept_s: ran - lost_s.min(ran), lost_s }
        } else {
            let latency = config.eviction.sample_s(job.id.wrapping_mul(31).wrapping_add(times.len() as u64));
            evict(&contract, ran, latency)
        };
        times.push(now);
        // Work kept and lost: the run's wall seconds at its rate.
        let ev = crate::preemption::Eviction { kept_s: self.work_in(v, ev.kept_s), lost_s: self.work_in(v, ev.lost_s), ..ev };
        self.planned_end[v] = None;
        self.set_low(v, false);
        self.kept_s[v] = (self.kept_s[v] + ev.kept_s).min(job.duration_s);
        let gpus = job.gpus_held();
        let lost = gpus * ev.lost_s as f64;
        let o = &mut outcome.jobs[v];
        o.interruptions += 1;
        o.forced += u32::from(ev.forced);
        o.lost_gpu_s += lost;
        outcome.evictions += 1;
        outcome.forced_terminations += u64::from(ev.forced);
        outcome.lost_gpu_s += lost;
        outcome.vacate_s.push(ev.vacate_s);
        let credit = match broken {
            Some(_) => config.compensation.for_broken(lost, gpus),
            None => config.compensation.for_preemption(contract.tier, lost),
        };
        outcome.owe(v, credit, broken.is_some());
        let o = &mut outcome.jobs[v];
        self.out_since.insert(v, now + ev.vacate_s);
        self.resumed_from.remove(&v);
        if job.reports_exit {
            self.ready_at[v] = u64::MAX;
        } else if self.kept_s[v] >= job.duration_s {
            o.end_s = Some(now + ev.vacate_s); // it finished while leaving
        } else {
            self.ready_at[v] = self.resume_at(v, now + ev.vacate_s, &contract);
            self.wakeups.push(Reverse(self.ready_at[v]));
        }
        (ev.vacate_s, lost, ev.forced, credit, broken)
    }

    /// The promise stopping job `v`'s run now breaks (before the stop is
    /// counted): any stop of guaranteed work; one more stop of preemptible
    /// work already at its daily cap.
    fn breaks_by_stopping(&self, v: usize, now: u64, contract: &PriorityContract) -> Option<crate::contract::Broken> {
        use crate::contract::{Broken, Tier};
        match contract.tier {
            Tier::Guaranteed => Some(Broken::GuaranteedStopped),
            Tier::Preemptible if self.recent_interruptions(v, now) >= contract.max_interruptions_per_day as usize => Some(Broken::PastCap),
            _ => None,
        }
    }
}

/// The earliest time enough running work will have ended for `job` to fit
/// on the nodes `in_scope` accepts, given the running jobs' planned `ends`
/// (`u64::MAX` if it never would), and the nodes to drain for it: those that
/// will hold it then, most capacity first. Keeps a running count of the
/// tasks that fit, updated only on the nodes each departure touches, so a
/// reservation on 20,000 nodes costs one pass over them, not one per job.
fn shadow_time(fleet: &Fleet, mut ends: Vec<(u64, usize)>, held: &[Vec<Allocation>], job: &Job, in_scope: &dyn Fn(&Node) -> bool) -> (u64, HashSet<NodeId>) {
    let need = job.tasks;
    let room = |n: &Node| if in_scope(n) { u64::from(tasks_on_node(n, &job.shape).min(need)) } else { 0 };
    ends.sort_unstable();
    let mut scratch = fleet.clone();
    let mut fitting: u64 = scratch.nodes().iter().map(room).sum();
    for (end, j) in ends {
        for alloc in &held[j] {
            let before = room(&scratch.nodes()[alloc.node as usize]);
            scratch.release(alloc).expect("held by a running job");
            fitting += room(&scratch.nodes()[alloc.node as usize]) - before;
        }
        if fitting >= u64::from(need) {
            let mut by_room: Vec<(u64, NodeId)> = scratch.nodes().iter().enumerate().map(|(i, n)| (room(n), i as NodeId)).filter(|&(t, _)| t > 0).collect();
            by_room.sort_by_key(|&(t, i)| (Reverse(t), i));
            let mut nodes = HashSet::new();
            let mut room = 0;
            for (t, i) in by_room {
                if room >= u64::from(need) {
                    break;
                }
                room += t;
                nodes.insert(i);
            }
            return (end, nodes);
        }
    }
    (u64::MAX, HashSet::new())
}

// Capture (see [`crate::capture`]): the engine's inputs as recorded. They
// live here, beside the engine that records them, so that the capture
// module (the replay) depends on the engine and not the other way round.

/// One input of the engine (or an output a replay compares), as recorded.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "input", rename_all = "snake_case")]
pub enum Input {
    /// Capture starts: the engine's settings and the whole fleet.
    Start { config: SimConfig, models: Vec<String>, nodes: Vec<Node> },
    /// Nodes the world changed (or added) since the engine last saw the
    /// fleet, as they are now; `models` when the model list grew.
    Nodes {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        models: Option<Vec<String>>,
        nodes: Vec<(NodeId, Node)>,
    },
    Register { slot: Slot, job: Job },
    Forget { slot: Slot },
    /// An event applied without a pass; `job` is the id of the slot's job
    /// (slots are reused), for readers.
    Apply {
        now: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<u64>,
        event: Event,
    },
    /// A pass ([`crate::Engine::handle`]) with its events, and what it
    /// decided (compared by a replay, not replayed).
    Pass {
        now: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        events: Vec<Event>,
        decisions: Vec<Decision>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    DueWakeups { now: u64 },
    Guards { guards: Guards },
    RestoreRunning { slot: Slot, allocations: Vec<Allocation>, started_s: u64 },
    RestoreSleeping { slot: Slot, allocations: Vec<Allocation>, started_s: u64 },
    RestoreInterruptions { slot: Slot, times: Vec<u64>, now: u64 },
    RestoreEvicting { slot: Slot, still_running: Vec<Allocation> },
    RestoreAwaiting { slot: Slot, victims: Vec<Slot> },
    /// A task moved (live compaction, `berth migrate`).
    ReplaceHeld { slot: Slot, old: Allocation, new: Allocation },
    /// Decisions the world took out of the engine between passes.
    TakeAnnounced { decisions: Vec<Decision> },
    TakeBroken { decisions: Vec<Decision> },
    /// The policy versions the next passes ask: placement, a split
    /// candidate with the share of jobs it decides, preemption ranking.
    Arms {
        place: PolicyRef,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        split: Option<(PolicyRef, f64)>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rank: Option<PolicyRef>,
    },
    /// The nodes run by agents (jobs with a command run only there;
    /// simulated jobs never do).
    AgentNodes { nodes: Vec<NodeId> },
}

impl Input {
    /// The engine time the input carries, if it carries one.
    pub fn now(&self) -> Option<u64> {
        match self {
            Input::Apply { now, .. } | Input::Pass { now, .. } | Input::DueWakeups { now } | Input::RestoreInterruptions { now, .. } => Some(*now),
            _ => None,
        }
    }
}

/// A policy version as a replay finds it again: the component's content
/// hash and the configuration it was given, and which instance of it
/// answered (a policy may keep state between calls: the live host makes a
/// fresh instance at each activation, so a version activated again, as in
/// a rollback A-B-A, starts over).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PolicyRef {
    pub sha256: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config: String,
    /// The instance, numbered per host start; 0 (older captures, converted
    /// traces): one instance per role and version.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub instance: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The engine's record of its inputs while capture is on.
#[derive(Debug)]
pub(crate) struct Recorder {
    pub inputs: Vec<Input>,
    /// The fleet's change count and identity when the engine last saw it.
    mark: u64,
    lineage: u64,
    models: usize,
}

impl Recorder {
    pub fn start(config: &SimConfig, fleet: &Fleet) -> Recorder {
        let start = Input::Start { config: config.clone(), models: fleet.models.clone(), nodes: fleet.nodes().to_vec() };
        Recorder { inputs: vec![start], mark: fleet.changes(), lineage: fleet.lineage(), models: fleet.models.len() }
    }

    /// Records the nodes changed since the engine last saw `fleet`.
    pub fn saw(&mut self, fleet: &Fleet) {
        let all = fleet.lineage() != self.lineage;
        if !all && fleet.changes() == self.mark && fleet.models.len() == self.models {
            return; // nothing changed since (the common case: no scan)
        }
        let nodes: Vec<(NodeId, Node)> =
            if all { fleet.nodes().iter().enumerate().map(|(i, n)| (i as NodeId, n.clone())).collect() } else { fleet.changed_since(self.mark).map(|id| (id, fleet.nodes()[id as usize].clone())).collect() };
        let models = (fleet.models.len() != self.models || all).then(|| fleet.models.clone());
        if !nodes.is_empty() || models.is_some() {
            self.inputs.push(Input::Nodes { models, nodes });
        }
        self.left(fleet);
    }

    /// The engine is done with `fleet` for this call.
    pub fn left(&mut self, fleet: &Fleet) {
        self.mark = fleet.changes();
        self.lineage = fleet.lineage();
        self.models = fleet.models.len();
    }
}
