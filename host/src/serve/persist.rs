//! The live host's state in the [`Store`]: every change to a job, an agent
//! node or an operator allocation is written before it is acted on (a task
//! is recorded before its start command is sent), and a starting host
//! rebuilds its partitions from what is stored: agent nodes, jobs with the
//! GPUs they hold, operator and lost allocations. GPU ownership is rebuilt
//! through the fleet's checked allocate, so a restored state in which a GPU
//! had two owners is refused, never served.
//!
//! ```text
//! jobs/<partition>/<id, 20 digits>   a job (spec, state, placements, tasks)
//! nodes/<partition>/<name>           an agent node (model, GPUs, CPU, memory, unhealthy GPUs)
//! held/<partition>/<allocation id>   an operator allocation, or GPUs fenced off a lost node
//! outcome/<partition>                work of jobs removed by retention (see super::outcome)
//! credits/<partition>                what each tenant is owed (see super::credits)
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_core::sim::Job;
use berth_core::engine::Slot;
use berth_core::{Allocation, TaskShape};
use serde::{Deserialize, Serialize};

use super::clock::Clock;
use super::decisions::Placed;
use super::error::ServeError;
use super::state::{AgentTopology, JobRecord, JobSpec, JobState, Live, PartitionState, TaskRun};
use crate::store::{Op, Store, StoreError};

#[derive(Serialize, Deserialize)]
pub(crate) struct StoredAlloc {
    /// Fenced off a lost node (held/ only).
    #[serde(default)]
    lost: bool,
    node: String,
    gpus: u64,
    gpu_milli: u32,
    cpu_milli: u32,
    memory_mib: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredJob {
    id: u64,
    partition: String,
    name: String,
    owner: String,
    state: String,
    priority: u32,
    tasks: u32,
    gpus: u32,
    gpu_milli: u32,
    cpu_milli: u32,
    memory_mib: u64,
    models: Vec<String>,
    duration_ms: u64,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    #[serde(default)]
    movable: bool,
    #[serde(default)]
    wait_ready: bool,
    #[serde(default)]
    sleepable: bool,
    /// The class the job declared (empty: implied by its shape).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    class: String,
    /// The tier it was bought as (empty: preemptible, as before tiers).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    tier: String,
    submitted_unix_ms: u64,
    started_unix_ms: u64,
    ended_unix_ms: u64,
    /// When a running job's time is up (0: no timer).
    ends_unix_ms: u64,
    allocations: Vec<StoredAlloc>,
    placements: Vec<Placed>,
    runs: Vec<TaskRun>,
    decision_id: u64,
    policy_version: u32,
    last_decision: String,
    detail: String,
    /// Preempted, its processes still stopping.
    #[serde(default)]
    evicting: bool,
    /// Preempted jobs it waits for before its tasks start.
    #[serde(default)]
    waiting_on: Vec<u64>,
    #[serde(default)]
    interruptions: u32,
    /// When the latest interruptions were (clock seconds).
    #[serde(default)]
    interrupted_s: Vec<u64>,
    /// Sleep-state harvesting (absent: awake).
    #[serde(default)]
    sleep: super::state::SleepState,
    /// The submission's idempotency key and spec digest (absent: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    idempotency_key: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    spec_digest: String,
    /// What a unit of its work is, and its tally (see [`super::outcome`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    work_unit: String,
    #[serde(default)]
    work: super::work::WorkTally,
    #[serde(default)]
    time_limit_stop: bool,
    /// The time limit was its budget running out (it ends finished).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    budget_stop: bool,
    /// Opportunistic work: GPU-seconds bought, and GPU-ms its ended runs
    /// were charged (absent: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    budget_gpu_s: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    charged_gpu_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Serialize, Deserialize)]
pub(crate) struct StoredNode {
    pub model: String,
    pub gpus: usize,
    pub cpu_milli: u32,
    pub memory_mib: u64,
    pub unhealthy: Vec<u32>,
    /// What the agent declared of its place in the fat tree.
    #[serde(default)]
    pub topology: AgentTopology,
    /// When it first joined (Unix ms; 0: not recorded): its installed
    /// GPU-hours count from then.
    #[serde(default)]
    pub joined_unix_ms: u64,
    /// It reported itself powered down: a restarted host keeps work off it
    /// until it reports otherwise.
    #[serde(default)]
    pub powered_down: bool,
}

pub(crate) fn job_key(partition: &str, id: u64) -> String {
    format!("jobs/{partition}/{id:020}")
}

pub(crate) fn held_key(partition: &str, id: u64) -> String {
    format!("held/{partition}/{id:020}")
}

/// Allocation ids reserved by one stored write.
const ALLOC_ID_BLOCK: u64 = 1024;
/// Where the end of the reserved allocation ids is stored.
const ALLOC_CEILING_KEY: &str = "meta/alloc-id-ceiling";

fn instant_of(clock: &dyn Clock, unix: u64) -> Instant {
    let (now_ms, now) = (clock.unix_ms(), clock.now());
    if unix >= now_ms { now + Duration::from_millis(unix - now_ms) } else { now.checked_sub(Duration::from_millis(now_ms - unix)).unwrap_or(now) }
}

/// Where the host's identity is kept.
const IDENTITY_KEY: &str = "meta/host-identity";

/// The host's identity: made once per store and kept, so a restarted host
/// or a new leader on the same etcd is the same host to its agents, and a
/// host on a fresh state folder is another (agents then forget the ended
/// tasks of the earlier one instead of reporting allocations it never gave).
pub fn host_identity(store: &dyn Store) -> anyhow::Result<String> {
    if let Some(v) = store.get(IDENTITY_KEY)? {
        return Ok(crate::text::printable(&String::from_utf8_lossy(&v), 64).into_owned());
    }
    let identity = format!("{:032x}", rand::random::<u128>());
    store.put(IDENTITY_KEY.into(), identity.clone().into_bytes())?;
    Ok(identity)
}

/// The number stored at `key` (a high-water mark), if any.
fn stored_number(store: &dyn Store, key: &str) -> anyhow::Result<Option<u64>> {
    let Some(v) = store.get(key)? else { return Ok(None) };
    let n = std::str::from_utf8(&v).ok().and_then(|t| t.trim().parse().ok()).ok_or_else(|| anyhow::anyhow!("{key}: not a number"))?;
    Ok(Some(n))
}

/// Records kept from failed writes go back to the store this many at a time.
const UNWRITTEN_BATCH: usize = 64;

fn op_key(op: &Op) -> &str {
    match op {
        Op::Put(k, _) | Op::Delete(k) => k,
    }
}

fn store_err(e: StoreError) -> ServeError {
    match e {
        StoreError::Fenced(_) => ServeError::Unavailable(format!("this host is {e}; ask the current leader")),
        StoreError::Backend(_) => ServeError::Store(std::io::Error::other(e.to_string())),
    }
}

impl PartitionState {
    pub(crate) fn alloc_out(&self, a: &Allocation) -> StoredAlloc {
        StoredAlloc { lost: false, node: self.fleet.nodes()[a.node as usize].name.clone(), gpus: a.gpus, gpu_milli: a.gpu_milli, cpu_milli: a.cpu_milli, memory_mib: a.memory_mib }
    }

    fn alloc_in(&self, a: &StoredAlloc) -> Result<Allocation, String> {
        let &node = self.node_names.get(&a.node).ok_or_else(|| format!("unknown node {:?}", a.node))?;
        Ok(Allocation { node, gpus: a.gpus, gpu_milli: a.gpu_milli, cpu_milli: a.cpu_milli, memory_mib: a.memory_mib })
    }

    /// The op that records job `id` as it is now.
    pub(crate) fn job_op(&self, partition: &str, id: u64) -> Op {
        job_record_op(&*self.clock, partition, id, &self.jobs[&id], |a| self.alloc_out(a))
    }
}

/// The op that records job `id` as `j` says, with `alloc_out` naming its
/// allocations' nodes.
pub(crate) fn job_record_op(clock: &dyn Clock, partition: &str, id: u64, j: &JobRecord, alloc_out: impl Fn(&Allocation) -> StoredAlloc) -> Op {
    let s = &j.spec;
    let stored = StoredJob {
        id,
        partition: partition.to_string(),
        name: s.name.clone(),
        owner: j.owner.clone(),
        state: j.state.as_str().into(),
        priority: s.job.priority,
        tasks: s.job.tasks,
        gpus: s.job.shape.gpu_count,
        gpu_milli: s.job.shape.gpu_milli,
        cpu_milli: s.job.shape.cpu_milli,
        memory_mib: s.job.shape.memory_mib,
        models: s.models.clone(),
        duration_ms: s.duration.as_millis() as u64,
        argv: s.argv.clone(),
        env: s.env.clone(),
        movable: s.movable,
        wait_ready: s.wait_ready,
        sleepable: s.sleepable,
        class: s.job.declared_class.map_or_else(String::new, |c| c.name().to_string()),
        tier: s.job.contract.map_or_else(String::new, |c| c.tier.name().to_string()),
        submitted_unix_ms: j.submitted_unix_ms,
        started_unix_ms: j.started_unix_ms,
        ended_unix_ms: j.ended_unix_ms,
        // On the host's clock (a simulation's runs on a manual one).
        ends_unix_ms: j.ends_at.map_or(0, |t| clock.unix_ms() + t.saturating_duration_since(clock.now()).as_millis() as u64),
        allocations: j.allocations.iter().map(alloc_out).collect(),
        placements: j.placements.clone(),
        runs: j.runs.clone(),
        decision_id: j.decision_id,
        policy_version: j.policy_version,
        last_decision: j.last_decision.clone(),
        detail: j.detail.clone(),
        evicting: j.evicting,
        waiting_on: j.waiting_on.clone(),
        interruptions: j.interruptions,
        interrupted_s: j.interrupted_s.clone(),
        sleep: j.sleep,
        idempotency_key: j.idempotency_key.clone(),
        spec_digest: j.spec_digest.clone(),
        work_unit: s.work_unit.clone(),
        work: j.work,
        time_limit_stop: j.time_limit_stop,
        budget_stop: j.budget_stop,
        budget_gpu_s: s.budget_gpu_s,
        charged_gpu_ms: j.charged_gpu_ms,
    };
    Op::Put(job_key(partition, id), serde_json::to_vec(&stored).expect("jobs serialize"))
}

impl PartitionState {
    pub(crate) fn held_op(&self, partition: &str, id: u64) -> Op {
        match self.manual.get(&id) {
            Some(a) => {
                let stored = StoredAlloc { lost: self.lost.contains(&id), ..self.alloc_out(a) };
                Op::Put(held_key(partition, id), serde_json::to_vec(&stored).expect("allocations serialize"))
            }
            None => Op::Delete(held_key(partition, id)),
        }
    }

    pub(crate) fn node_op(&self, partition: &str, name: &str) -> Option<Op> {
        let &id = self.agent_ids.get(name)?;
        let n = &self.fleet.nodes()[id as usize];
        let stored = StoredNode {
            model: n.model.map_or_else(|| "cpu-only".into(), |m| self.fleet.models[m as usize].clone()),
            gpus: n.gpus.len(),
            cpu_milli: n.cpu_total_milli,
            memory_mib: n.memory_total_mib,
            unhealthy: self.health.keys().filter(|(n, _)| *n == id).map(|&(_, g)| g).collect(),
            topology: self.topology.get(&id).copied().unwrap_or_default(),
            joined_unix_ms: self.outcome.joined_unix_ms.get(&id).copied().unwrap_or(0),
            powered_down: self.outcome.powered_down.contains(&id),
        };
        Some(Op::Put(format!("nodes/{partition}/{name}"), serde_json::to_vec(&stored).expect("nodes serialize")))
    }
}

impl Live {
    /// Writes ops to the store, or none of them (the caller undoes what it
    /// did). A refusal because this host lost the leadership stops it
    /// deciding: the new leader owns the state now.
    pub(crate) fn persist(&self, ops: Vec<Op>) -> Result<(), ServeError> {
        self.write(ops, false)
    }

    /// Writes the record of something that has happened already (a
    /// process exited, a node came back without a task): the host goes on
    /// from it whether or not the write succeeds. A failed write is kept
    /// and written ahead of the next batch that succeeds, so a store that
    /// comes back catches up with what the host did while it was away,
    /// and a restart never finds a record older than a later one.
    pub(crate) fn persist_logged(&self, ops: Vec<Op>) {
        let _ = self.write(ops, true);
    }

    fn write(&self, ops: Vec<Op>, keep_on_failure: bool) -> Result<(), ServeError> {
        let Some(store) = self.store.get() else { return Ok(()) };
        // Held across the store call: records kept from failed writes
        // never overtake newer values of their keys.
        let mut unwritten = self.unwritten.lock().unwrap();
        let result = (|| {
            if !unwritten.is_empty() {
                let new: std::collections::HashSet<&str> = ops.iter().map(op_key).collect();
                let behind: Vec<Op> = unwritten.iter().filter(|(k, _)| !new.contains(k.as_str())).map(|(_, op)| op.clone()).collect();
                // In small batches (etcd bounds a transaction's operations).
                for chunk in behind.chunks(UNWRITTEN_BATCH) {
                    store.apply(chunk.to_vec())?;
                    for op in chunk {
                        unwritten.remove(op_key(op));
                    }
                }
            }
            store.apply(ops.clone())
        })();
        match result {
            Ok(()) => {
                for op in &ops {
                    unwritten.remove(op_key(op));
                }
                self.metrics.store_unwritten.set(unwritten.len() as i64);
                Ok(())
            }
            Err(e) => {
                if keep_on_failure {
                    unwritten.extend(ops.into_iter().map(|op| (op_key(&op).to_string(), op)));
                }
                self.metrics.store_unwritten.set(unwritten.len() as i64);
                if matches!(e, StoreError::Fenced(_)) && !self.fenced.swap(true, Ordering::SeqCst) {
                    tracing::error!(target: "berth::serve", "{e}: this host stops deciding");
                    // Callers hold a partition's lock: the schedulers see the
                    // flag within their next wait (at most a second), unpoked.
                    self.shutdown.store(true, Ordering::SeqCst);
                } else {
                    tracing::error!(target: "berth::serve", unwritten = unwritten.len(), "state not written: {e}");
                }
                Err(store_err(e))
            }
        }
    }

    /// A fresh allocation id. Ids are handed out in blocks whose end is
    /// stored before the first of them is used, so a restarted host starts
    /// past every id it may have sent to an agent, even one of a task whose
    /// record was never written. An error (the block's end not stored)
    /// means no id: nothing may start.
    pub(crate) fn next_alloc_id(&self) -> Result<u64, ServeError> {
        let mut ceiling = self.alloc_ceiling.lock().unwrap();
        let id = self.next_alloc.fetch_add(1, Ordering::SeqCst);
        if id >= *ceiling {
            let end = id + ALLOC_ID_BLOCK;
            self.persist(vec![Op::Put(ALLOC_CEILING_KEY.into(), end.to_string().into_bytes())])?;
            *ceiling = end;
        }
        Ok(id)
    }

    /// Rebuilds the partitions from the store: agent nodes (unschedulable
    /// until their agents return), jobs with what they hold, operator and
    /// lost allocations. Returns (jobs, running jobs, held allocations).
    pub fn recover(&self, store: &dyn Store) -> anyhow::Result<(usize, usize, usize)> {
        let (mut jobs, mut running, mut held) = (0, 0, 0);
        let mut max_alloc = 0;
        let mut max_job = 0;
        for part in &self.partitions {
            let name = &part.name;
            for (key, value) in store.list(&format!("nodes/{name}/"))? {
                let node = key.rsplit('/').next().unwrap_or_default().to_string();
                let n: StoredNode = serde_json::from_slice(&value).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                self.agent_node_up(name, &node, &n.model, n.gpus, n.cpu_milli, n.memory_mib, n.topology).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                // Holds go on after the jobs took back their GPUs.
                let mut st = part.lock_state();
                let id = st.agent_ids[&node];
                if n.joined_unix_ms != 0 {
                    st.outcome.joined_unix_ms.insert(id, n.joined_unix_ms);
                }
                if n.powered_down {
                    st.outcome.powered_down.insert(id);
                }
                for g in n.unhealthy.into_iter().filter(|&g| (g as usize) < n.gpus) {
                    st.health.insert((id, g), false);
                }
            }
            let mut guard = part.lock_state();
            let st = &mut *guard;
            // The partition's first start and its retired work; a first
            // start is stored now (installed hours count from it).
            let key = super::work::retired_key(name);
            match store.get(&key)? {
                Some(bytes) => st.outcome.restore(&bytes).map_err(|e| anyhow::anyhow!("{key}: {e}"))?,
                None => store.put(key, st.outcome.stored_with(std::iter::empty()))?,
            }
            let key = super::credits::key(name);
            if let Some(bytes) = store.get(&key)? {
                st.credits = super::credits::Credits::restore(&bytes).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
            }
            for (key, value) in store.list(&format!("held/{name}/"))? {
                let id: u64 = key.rsplit('/').next().and_then(|i| i.parse().ok()).ok_or_else(|| anyhow::anyhow!("{key}: not an allocation id"))?;
                let a: StoredAlloc = serde_json::from_slice(&value).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                if a.lost {
                    st.lost.insert(id);
                }
                let a = st.alloc_in(&a).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                st.fleet.allocate(&a).map_err(|e| anyhow::anyhow!("{key}: GPUs held twice in the stored state: {e}"))?;
                st.manual.insert(id, a);
                st.by_alloc.insert(id, 0);
                max_alloc = max_alloc.max(id);
                held += 1;
            }
            // Evicted jobs whose processes were not seen to end, and jobs
            // that waited for them: taken back after every running job has
            // its GPUs, so only what nobody holds drains.
            let mut evicting_runs: Vec<(u64, Vec<Allocation>)> = Vec::new();
            let mut ended_holding: Vec<(u64, Allocation)> = Vec::new();
            let mut awaiting: Vec<(u64, Vec<u64>)> = Vec::new();
            for (key, value) in store.list(&format!("jobs/{name}/"))? {
                let j: StoredJob = serde_json::from_slice(&value).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                let state = JobState::parse(&j.state).ok_or_else(|| anyhow::anyhow!("{key}: unknown state {:?}", j.state))?;
                let tier = match j.tier.as_str() {
                    "" => berth_core::Tier::Preemptible, // stored before tiers
                    t => berth_core::Tier::from_name(t).ok_or_else(|| anyhow::anyhow!("{key}: unknown tier {:?}", crate::text::printable(t, 32)))?,
                };
                let models = j
                    .models
                    .iter()
                    .map(|m| st.fleet.model_id(m).ok_or_else(|| anyhow::anyhow!("{key}: model {m:?} is in no node of partition {name}")))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let allocations = j.allocations.iter().map(|a| st.alloc_in(a)).collect::<Result<Vec<_>, _>>().map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                // What still holds GPUs: a running simulated job's
                // allocations; a job's tasks that were not seen to end.
                // A copy migrating in (make-before-break) was allocated by
                // the host, not given by the engine: it is held in the fleet
                // beside the engine's record, as before the restart, and the
                // engine learns it when the old copy's exit is reported.
                let holding: Vec<&Allocation> = if j.runs.is_empty() {
                    if state == JobState::Running { allocations.iter().collect() } else { Vec::new() }
                } else {
                    allocations.iter().zip(&j.runs).filter(|(_, r)| r.holds && r.replaces == 0).map(|(a, _)| a).collect()
                };
                // (An ended job's copies are fenced below with its other tasks.)
                let copies: Vec<Allocation> = allocations
                    .iter()
                    .zip(&j.runs)
                    .filter(|(_, r)| r.holds && r.replaces != 0 && !j.evicting && !state.is_ended())
                    .map(|(a, _)| a.clone())
                    .collect();
                for c in &copies {
                    st.fleet.allocate(c).map_err(|e| anyhow::anyhow!("{key}: GPUs held twice in the stored state (a migrating copy): {e}"))?;
                }
                let holding: Vec<Allocation> = if j.evicting { Vec::new() } else { holding.into_iter().cloned().collect() };
                if j.evicting {
                    let mut still = Vec::new();
                    // Sent back asleep (a failed wake): its frozen processes
                    // are stopped but hold nothing; their GPUs were lent.
                    let lent = j.sleep.frozen();
                    for r in j.runs.iter().filter(|r| r.holds) {
                        // Its stop, due when its notice runs out (at once
                        // when the deadline passed, or was not stored).
                        st.stops.push((instant_of(&*self.clock, r.stop_at_unix_ms), r.alloc_id, r.node.clone()));
                        if lent {
                            continue;
                        }
                        let gpus = r.gpus.iter().filter(|&&g| g < 64).fold(0u64, |m, &g| m | 1 << g);
                        let stored = StoredAlloc { lost: false, node: r.node.clone(), gpus, gpu_milli: j.gpu_milli, cpu_milli: j.cpu_milli, memory_mib: j.memory_mib };
                        still.push(st.alloc_in(&stored).map_err(|e| anyhow::anyhow!("{key}: {e}"))?);
                    }
                    evicting_runs.push((j.id, still));
                }
                if !j.waiting_on.is_empty() && state == JobState::Running {
                    awaiting.push((j.id, j.waiting_on.clone()));
                }
                // An ended job (cancelled, timed out, failed) whose processes
                // were not seen to exit: what they hold is fenced (owned by
                // no job) until their exit is reported, and they are stopped
                // as orphans when their node reports them. An asleep job's
                // GPUs were lent (borrowers may hold them): its frozen
                // processes hold nothing, and are killed, not woken.
                let mut runs = j.runs.clone();
                if state.is_ended() && !j.evicting {
                    let lent = j.sleep.frozen();
                    for (a, r) in allocations.iter().zip(runs.iter_mut()).filter(|(_, r)| r.holds) {
                        r.holds = false;
                        r.state = super::lifecycle::TaskState::Lost;
                        if !lent {
                            ended_holding.push((r.alloc_id, a.clone()));
                        }
                    }
                }
                for r in &j.runs {
                    st.by_alloc.insert(r.alloc_id, j.id);
                    max_alloc = max_alloc.max(r.alloc_id);
                }
                let ends_at = (state == JobState::Running && j.ends_unix_ms > 0).then(|| instant_of(&*self.clock, j.ends_unix_ms));
                if let Some(t) = ends_at {
                    st.running.insert((t, j.id));
                }
                if state == JobState::Pending {
                    st.pending.push(j.id);
                }
                // An ended job holds no task, asleep or not (see above),
                // unless its processes are still being stopped (evicting):
                // asleep, they keep holding nothing.
                let sleep = if j.evicting && j.sleep.frozen() {
                    super::state::SleepState::Asleep
                } else if state.is_ended() {
                    super::state::SleepState::Awake
                } else {
                    j.sleep
                };
                let (evicting, waiting_on, interruptions, started_unix_ms) = (j.evicting, j.waiting_on.clone(), j.interruptions, j.started_unix_ms);
                let mut interrupted_s = j.interrupted_s;
                let extra = interrupted_s.len().saturating_sub(super::state::KEPT_INTERRUPTIONS);
                interrupted_s.drain(..extra); // stored text is input too: the latest only
                running += usize::from(state == JobState::Running);
                jobs += 1;
                max_job = max_job.max(j.id);
                self.metrics.jobs.with_label_values(&[name, state.as_str()]).inc();
                let shape = TaskShape { gpu_count: j.gpus, gpu_milli: j.gpu_milli, cpu_milli: j.cpu_milli, memory_mib: j.memory_mib, models };
                st.jobs.insert(
                    j.id,
                    JobRecord {
                        spec: JobSpec {
                            partition: name.clone(),
                            name: j.name,
                            models: j.models,
                            duration: Duration::from_millis(j.duration_ms),
                            argv: j.argv,
                            env: j.env,
                            movable: j.movable,
                            wait_ready: j.wait_ready,
                            sleepable: j.sleepable,
                            work_unit: j.work_unit.clone(),
                            budget_gpu_s: j.budget_gpu_s,
                            job: Job {
                                id: j.id,
                                priority: j.priority,
                                duration_s: j.duration_ms.div_ceil(1000),
                                tasks: j.tasks,
                                shape,
                                declared_class: berth_core::TaskClass::from_name(&j.class),
                                // The partition's contract now, as its tier has it.
                                contract: Some(st.engine.config.contract.of_tier(tier)),
                                ..Job::default()
                            },
                        },
                        owner: j.owner,
                        state,
                        submitted_at: instant_of(&*self.clock, j.submitted_unix_ms),
                        submitted_unix_ms: j.submitted_unix_ms,
                        started_unix_ms: j.started_unix_ms,
                        ended_unix_ms: j.ended_unix_ms,
                        ends_at,
                        allocations,
                        placements: j.placements,
                        decision_id: j.decision_id,
                        policy_version: j.policy_version,
                        last_decision: j.last_decision,
                        runs,
                        detail: j.detail,
                        work: j.work,
                        time_limit_stop: j.time_limit_stop,
                        budget_stop: j.budget_stop,
                        charged_gpu_ms: j.charged_gpu_ms,
                        evicting,
                        waiting_on,
                        interruptions,
                        interrupted_s: interrupted_s.clone(),
                        reserved_until_s: 0,
                        sleep,
                        idempotency_key: j.idempotency_key.clone(),
                        spec_digest: j.spec_digest.clone(),
                    },
                );
                if !j.idempotency_key.is_empty() {
                    let owner = st.jobs[&j.id].owner.clone();
                    self.idempotency.lock().unwrap().insert((owner, j.idempotency_key), super::state::KeyedJob { job: j.id, digest: j.spec_digest, stored: true });
                }
                // Live jobs go back into the engine: waiting, stopping after
                // a preemption, or running on what they hold.
                if matches!(state, JobState::Pending | JobState::Running) || evicting {
                    let slot = st.register(j.id);
                    let now = self.now_s();
                    if evicting {
                        // Its drains are restored below, after the running jobs.
                    } else if state == JobState::Running && sleep == super::state::SleepState::Asleep {
                        // Its GPUs are lent (borrowers may hold them): a claim, not an allocation.
                        st.engine.restore_sleeping(slot, holding, started_unix_ms / 1000);
                    } else if state == JobState::Pending {
                        st.engine.apply(&mut st.fleet, now, berth_core::Event::Arrive(slot));
                    } else {
                        let (fleet, engine) = (&mut st.fleet, &mut st.engine);
                        engine.restore_running(fleet, slot, holding, started_unix_ms / 1000).map_err(|e| anyhow::anyhow!("{key}: GPUs held twice in the stored state: {e}"))?;
                    }
                    st.engine.restore_interruptions(slot, interrupted_s, now);
                }
            }
            // The fences are stored as such (and the jobs' records as not
            // holding), so the fence's end, stored when the process is seen
            // gone, is the last word on those GPUs at the next start too.
            let mut normalized: BTreeMap<String, Op> = BTreeMap::new();
            for (alloc_id, a) in ended_holding {
                let job = st.by_alloc.get(&alloc_id).copied().filter(|&j| j != 0);
                if let Some(j) = job {
                    let op = st.job_op(name, j);
                    normalized.insert(op_key(&op).to_string(), op);
                }
                if let Err(e) = st.fleet.allocate(&a) {
                    // Another restored holder has these GPUs: the stored state
                    // disagrees with itself. The process is still stopped.
                    self.metrics.invariant_breaks.with_label_values(&[name, "restore"]).inc();
                    tracing::error!(target: "berth::serve", allocation = alloc_id, "broken invariant: the GPUs of an ended job's task are held by another: {e}");
                    continue;
                }
                st.manual.insert(alloc_id, a);
                st.lost.insert(alloc_id);
                st.by_alloc.insert(alloc_id, 0);
                let op = st.held_op(name, alloc_id);
                normalized.insert(op_key(&op).to_string(), op);
            }
            let normalized: Vec<Op> = normalized.into_values().collect();
            for chunk in normalized.chunks(UNWRITTEN_BATCH) {
                store.apply(chunk.to_vec()).map_err(|e| anyhow::anyhow!("storing the fences of ended jobs' tasks: {e}"))?;
            }
            let evicting_ids: std::collections::HashSet<u64> = evicting_runs.iter().map(|(id, _)| *id).collect();
            for (id, still) in evicting_runs {
                let slot = st.slots[&id];
                st.engine.restore_evicting(&mut st.fleet, slot, &still);
                // Cancelled while its processes were stopping: its GPUs
                // drain until they are gone, and it never runs again.
                if st.jobs[&id].state.is_ended() {
                    st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::Cancel(slot));
                }
            }
            // Waited for the victims still stopping only: one whose end was
            // stored before this job's record caught up is gone already.
            for (id, victims) in awaiting {
                let victims: Vec<u64> = victims.into_iter().filter(|v| evicting_ids.contains(v)).collect();
                if let Some(j) = st.jobs.get_mut(&id) {
                    j.waiting_on.clone_from(&victims);
                }
                let slot = st.slots[&id];
                let victims: Vec<Slot> = victims.iter().filter_map(|v| st.slots.get(v).copied()).collect();
                st.engine.restore_awaiting(slot, victims);
            }
            // A wake whose borrowers are gone but whose end was not stored
            // (the store refused it, or the host stopped first): its tasks
            // are told once its record says awake.
            let waking = st.jobs.iter().filter(|(_, j)| j.state == JobState::Running && j.sleep == super::state::SleepState::Waking && j.waiting_on.is_empty()).map(|(&id, _)| id);
            st.unstored_wakes = waking.collect();
            // Placed, with nothing to wait for and no task sent: the host
            // stopped between the placement's record and its start, or the
            // victims it waited for ended before its record caught up.
            st.unstarted = st.jobs.iter().filter(|(_, j)| j.placed_unstarted()).map(|(&id, _)| id).collect();
            let ids: Vec<u32> = st.agent_ids.values().copied().collect();
            for id in ids {
                st.apply_holds(id);
            }
            st.fleet.check_invariants().map_err(|e| anyhow::anyhow!("partition {name}: restored state is inconsistent: {e}"))?;
            st.dirty = true;
        }
        self.next_job.fetch_max(max_job + 1, Ordering::SeqCst);
        for part in &self.partitions {
            if let Some(floor) = stored_number(store, &job_id_floor_key(&part.name))? {
                // Pruned jobs' ids are never handed out again.
                self.pruned_job_floor.fetch_max(floor, Ordering::SeqCst);
                self.next_job.fetch_max(floor + 1, Ordering::SeqCst);
            }
        }
        self.next_alloc.fetch_max(max_alloc + 1, Ordering::SeqCst);
        if let Some(ceiling) = stored_number(store, ALLOC_CEILING_KEY)? {
            // Ids below the stored block's end may have been sent: start past it.
            self.next_alloc.fetch_max(ceiling, Ordering::SeqCst);
        }
        Ok((jobs, running, held))
    }
}

/// Where the largest pruned job id of a partition is stored: a restarted
/// host numbers new jobs past it even when every stored job was pruned.
pub(crate) fn job_id_floor_key(partition: &str) -> String {
    format!("meta/job-id-floor/{partition}")
}
