//! Agent nodes in the live fleet: nodes registered by `berth agent` join
//! their partition's fleet (so the same policies place onto them), jobs with
//! argv placed there are started through the [`Actuator`] (the agent hub),
//! and a task's exit report is what frees its GPUs. Unhealthy GPUs are held
//! out of placement; measured SM activity is the productive denominator.
//!
//! Ownership of every GPU is the partition fleet's checked allocate /
//! release: a GPU held by a job task, an operator allocation or an
//! unhealthy-GPU hold cannot be allocated again, so no GPU has two owners.

use std::collections::HashMap;
use std::time::Duration;

use berth_core::fleet::{gpus_of, intern_model, Node, NodeId};
use berth_core::{Allocation, Fleet, MAX_GPUS_PER_NODE, MILLI_PER_GPU};

use super::decisions::Placed;
use super::lifecycle::{Report, TaskState};
use super::state::{AgentTopology, Beat, JobState, Live, Partition, PartitionState, QueuedReport, Reconciled, Start, Stopped, TaskRun, MAX_DECLARED_SWITCH};
use super::error::ServeError;

/// Agent nodes get switch domains of their own, apart from simulated ones:
/// one per node unless the agent declares its access switch (and
/// aggregation switch), in a space apart again.
const AGENT_DOMAIN_BASE: u32 = 1 << 20;
/// A migration under way: the job, and the new copy's allocation.
#[derive(Clone, Debug)]
pub struct Migration {
    pub job_id: u64,
    pub alloc_id: u64,
    pub node: String,
    pub gpus: Vec<u32>,
}

impl Live {
    /// The partition and node id of an agent node.
    fn agent_node(&self, partition: &str, node: &str) -> Result<(usize, NodeId), ServeError> {
        let p = self.partition_index(partition)?;
        let id = self.partitions[p].lock_state().agent_ids.get(node).copied();
        id.map(|id| (p, id)).ok_or_else(|| ServeError::FailedPrecondition(format!("no agent node {node:?} in partition {partition}")))
    }

    /// Adds a registering agent's node to its partition's fleet (not
    /// schedulable until its command stream is held), or finds it there.
    /// A node that comes back with other GPUs is replaced if nothing runs
    /// on it, refused otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn agent_node_up(
        &self,
        partition: &str,
        node: &str,
        model: &str,
        gpus: usize,
        cpu_milli: u32,
        memory_mib: u64,
        topology: AgentTopology,
    ) -> Result<(), ServeError> {
        let p = self.partition_index(partition)?;
        if gpus > MAX_GPUS_PER_NODE {
            return Err(ServeError::Invalid(format!("node {node}: {gpus} GPUs, at most {MAX_GPUS_PER_NODE}")));
        }
        if let Some(x) = topology.switch_domain.into_iter().chain(topology.aggregation).find(|&x| x > MAX_DECLARED_SWITCH) {
            return Err(ServeError::Invalid(format!("node {node}: switch id {x} is above {MAX_DECLARED_SWITCH}")));
        }
        // Node names are unique across the fleet: an operator of one
        // partition cannot register a node named like another's (agent or
        // simulated), nor shadow a simulated node of its own.
        for (q, other) in self.partitions.iter().enumerate() {
            let st = other.lock_state();
            let agent_here = q == p && st.agent_ids.contains_key(node);
            if !agent_here && st.node_names.contains_key(node) {
                return Err(ServeError::FailedPrecondition(format!("node name {node:?} is already taken in the fleet")));
            }
        }
        let part = &self.partitions[p];
        let mut guard = part.lock_state();
        let st = &mut *guard;
        let mut models = st.fleet.models.clone();
        let model_id = (gpus > 0).then(|| intern_model(&mut models, model));
        let mut fresh = Node::new(node, model_id, gpus, cpu_milli, memory_mib);
        fresh.schedulable = false;
        fresh.partition = st.fleet.nodes().first().map_or(0, |n| n.partition);
        let put = match st.agent_ids.get(node).copied() {
            Some(id) => {
                let old = &st.fleet.nodes()[id as usize];
                let (domain, aggregation) = topology.place(AGENT_DOMAIN_BASE + id);
                if old.gpus.len() == gpus && old.model == model_id && old.switch_domain == domain && old.aggregation == aggregation {
                    return Ok(());
                }
                let holds = st.health.iter().filter(|&(&(n, _), &applied)| n == id && applied).count() as u64;
                let idle = old.gpu_free_milli() + holds * u64::from(MILLI_PER_GPU) == old.gpu_total_milli()
                    && old.cpu_free_milli == old.cpu_total_milli
                    && old.memory_free_mib == old.memory_total_mib;
                if !idle {
                    return Err(ServeError::FailedPrecondition(format!(
                        "node {node} registers {gpus} GPUs of {model} but work still holds its previous {} GPUs: stop it first",
                        old.gpus.len()
                    )));
                }
                (fresh.switch_domain, fresh.aggregation) = (domain, aggregation);
                // Its health holds go with the old definition (released, so
                // the fleet's ledger no longer counts them).
                let applied: Vec<_> = st.health.iter().filter(|&(&(n, _), &applied)| n == id && applied).map(|(&k, _)| k).collect();
                for (n, g) in applied {
                    self.release_checked(&part.name, &mut st.fleet, &super::state::health_hold(n, g), 0);
                }
                st.health.retain(|&(n, _), _| n != id);
                st.activity.remove(&id);
                Some(id)
            }
            None => {
                // (A simulated node of this name was refused above.)
                (fresh.switch_domain, fresh.aggregation) = topology.place(AGENT_DOMAIN_BASE + st.fleet.nodes().len() as u32);
                None
            }
        };
        let id = st.fleet.put_node(models, put, fresh).map_err(|e| ServeError::Invalid(e.to_string()))?;
        // Its installed GPU-hours count from its first registration.
        let now_ms = self.now_ms();
        st.outcome.joined_unix_ms.entry(id).or_insert(now_ms);
        st.agent_ids.insert(node.to_string(), id);
        if st.is_agent.len() <= id as usize {
            st.is_agent.resize(id as usize + 1, false);
        }
        st.is_agent[id as usize] = true;
        st.node_names.insert(node.to_string(), id);
        part.models.lock().unwrap().clone_from(&st.fleet.models);
        st.topology.insert(id, topology);
        let op = st.node_op(partition, node).expect("just added");
        self.persist_logged(vec![op]);
        Ok(())
    }

    /// An agent node can (reachable, command stream held) or cannot take
    /// work; a node powered down never can.
    pub fn agent_node_schedulable(&self, partition: &str, node: &str, on: bool) {
        let Ok((p, id)) = self.agent_node(partition, node) else { return };
        let part = &self.partitions[p];
        let mut guard = part.lock_state();
        let st = &mut *guard;
        let on = on && !st.outcome.powered_down.contains(&id);
        if st.fleet.nodes()[id as usize].schedulable != on {
            st.fleet.set_schedulable(id, on).expect("agent node ids are in the fleet");
            // Outside the engine: jobs that did not fit are tried again.
            st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::FleetChanged);
            st.dirty = true;
            part.wake.notify_all();
        }
    }

    /// An agent node reported itself powered down (parked) or up again:
    /// installed either way, but no work is placed on a node powered down.
    /// `reachable` says whether it could take work were it up.
    pub fn agent_node_power(&self, partition: &str, node: &str, powered_down: bool, reachable: bool) {
        let Ok((p, id)) = self.agent_node(partition, node) else { return };
        {
            let mut st = self.partitions[p].lock_state();
            let changed = if powered_down { st.outcome.powered_down.insert(id) } else { st.outcome.powered_down.remove(&id) };
            if !changed {
                return;
            }
            // Stored: a restarted host keeps work off a node powered down.
            if let Some(op) = st.node_op(partition, node) {
                self.persist_logged(vec![op]);
            }
        }
        tracing::info!(target: "berth::agent", node, partition, "node powered {}", if powered_down { "down" } else { "up" });
        self.agent_node_schedulable(partition, node, reachable && !powered_down);
    }

    /// Takes an unhealthy GPU out of placement (now if free, else when its
    /// holder lets go).
    pub fn agent_gpu_unhealthy(&self, partition: &str, node: &str, gpu: u32) {
        let Ok((p, id)) = self.agent_node(partition, node) else { return };
        let mut st = self.partitions[p].lock_state();
        if (gpu as usize) < st.fleet.nodes()[id as usize].gpus.len() && !st.health.contains_key(&(id, gpu)) {
            st.health.insert((id, gpu), false);
            st.apply_holds(id);
            let op = st.node_op(partition, node).expect("an agent node");
            self.persist_logged(vec![op]);
        }
    }

    /// An operator's allocation of whole GPUs on an agent node: checked
    /// against everything else that holds GPUs there. Returns its id.
    pub fn hold_manual(&self, partition: &str, node: &str, gpus: &[u32]) -> Result<u64, ServeError> {
        let (p, id) = self.agent_node(partition, node)?;
        let mut guard = self.partitions[p].lock_state();
        let st = &mut *guard;
        let n = &st.fleet.nodes()[id as usize];
        let mut mask = 0u64;
        for &g in gpus {
            if g as usize >= n.gpus.len() {
                return Err(ServeError::Invalid(format!("node {node} has no GPU {g}")));
            }
            if mask & (1 << g) != 0 {
                return Err(ServeError::Invalid(format!("GPU {g} listed twice")));
            }
            mask |= 1 << g;
            if n.gpus[g as usize] != MILLI_PER_GPU {
                return Err(ServeError::FailedPrecondition(format!("GPU {g} of node {node} is held by {}", st.holder(id, g))));
            }
        }
        let alloc = Allocation { node: id, gpus: mask, gpu_milli: MILLI_PER_GPU, cpu_milli: 0, memory_mib: 0 };
        st.fleet.allocate(&alloc).map_err(|e| ServeError::FailedPrecondition(e.to_string()))?;
        let alloc_id = self.next_alloc_id().inspect_err(|_| st.fleet.release(&alloc).expect("just allocated"))?;
        st.manual.insert(alloc_id, alloc.clone());
        // Stored before the start command goes out, or not made at all.
        if let Err(e) = self.persist(vec![st.held_op(partition, alloc_id)]) {
            st.manual.remove(&alloc_id);
            st.fleet.release(&alloc).expect("just allocated");
            return Err(e);
        }
        st.by_alloc.insert(alloc_id, 0);
        st.dirty = true;
        Ok(alloc_id)
    }

    /// Starts the tasks of a job just placed on agent nodes.
    pub(crate) fn actuate(&self, part: &Partition, st: &mut PartitionState, id: u64) {
        let Some(job) = st.jobs.get_mut(&id) else { return };
        let mut runs: Vec<TaskRun> = Vec::with_capacity(job.allocations.len());
        let asked: Vec<(u32, u64)> = job.allocations.iter().map(|a| (a.cpu_milli, a.memory_mib)).collect();
        for a in &job.allocations {
            let node = st.fleet.nodes()[a.node as usize].name.clone();
            match self.next_alloc_id() {
                Ok(alloc_id) => runs.push(TaskRun::starting(alloc_id, node, gpus_of(a.gpus).map(|g| g as u32).collect())),
                Err(e) => return self.not_started(part, st, id, &e),
            }
        }
        job.runs = runs.clone();
        let (argv, env) = (job.spec.argv.clone(), job.spec.env.clone());
        for r in &runs {
            st.by_alloc.insert(r.alloc_id, id);
        }
        // Recorded before any start is sent: a host that dies in between
        // finds the tasks and reconciles them with the agents. Not recorded,
        // nothing is started.
        if let Err(e) = self.persist(vec![st.job_op(&part.name, id)]) {
            return self.not_started(part, st, id, &e);
        }
        let mut undelivered = Vec::new();
        for (r, &(cpu_milli, memory_mib)) in runs.iter().zip(&asked) {
            let start = Start { alloc_id: r.alloc_id, job_id: id, node: &r.node, gpus: &r.gpus, argv: &argv, env: &env, cpu_milli, memory_mib };
            let sent = match self.actuator() {
                Some(a) => a.start(start),
                None => Err("no agent hub".into()),
            };
            if let Err(e) = sent {
                undelivered.push((r.alloc_id, e));
            }
        }
        for (alloc_id, e) in undelivered {
            self.end_task(part, st, alloc_id, TaskState::Failed, -1, 0, &format!("start not delivered: {e}"));
        }
    }

    /// A job just placed whose start could not be stored: nothing of it was
    /// sent; it goes back to the queue, tried again after a pause.
    fn not_started(&self, part: &Partition, st: &mut PartitionState, id: u64, e: &ServeError) {
        self.queue_again(part, st, id, format!("not started: {e}; tried again"));
        st.retry_at = Some(self.clock.now() + Duration::from_secs(1));
    }

    /// Queues again the placed agent jobs a restart found never started
    /// (see [`PartitionState::unstarted`]); one changed since is left as it is.
    pub(super) fn requeue_unstarted(&self, part: &Partition, st: &mut PartitionState) {
        for id in std::mem::take(&mut st.unstarted) {
            if st.jobs.get(&id).is_some_and(|j| j.placed_unstarted()) {
                self.queue_again(part, st, id, "placed but never started before a restart: queued again".into());
            }
        }
    }

    /// A placed job none of whose tasks was sent goes back to the queue:
    /// the engine takes its GPUs back, and its record says why.
    fn queue_again(&self, part: &Partition, st: &mut PartitionState, id: u64, why: String) {
        let Some(job) = st.jobs.get_mut(&id) else { return };
        for r in job.runs.drain(..) {
            st.by_alloc.remove(&r.alloc_id);
        }
        job.allocations.clear();
        job.placements.clear();
        job.state = JobState::Pending;
        job.detail = why;
        tracing::warn!(target: "berth::serve", job = id, "{}", job.detail);
        if let Some(t) = job.ends_at.take() {
            st.running.remove(&(t, id));
        }
        st.pending.push(id);
        if let Some(&slot) = st.slots.get(&id) {
            st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::Unstarted(slot));
        }
        self.metrics.jobs.with_label_values(&[&part.name, JobState::Running.as_str()]).dec();
        self.metrics.jobs.with_label_values(&[&part.name, JobState::Pending.as_str()]).inc();
        // Queued again: stored so (kept and written with the next write
        // that succeeds when this one fails), or a restart would find it
        // holding GPUs given to others since.
        self.persist_logged(vec![st.job_op(&part.name, id)]);
    }

    /// Make-before-break migration of a job's running task to another
    /// agent node (`to`, or when empty the one the partition's placement
    /// policy chooses among the other schedulable agent nodes). The destination GPUs are allocated
    /// (checked: no GPU has two owners) and stored before the new copy is
    /// started, with the job's argv and env plus BERTH_MIGRATED_FROM (the
    /// old allocation id); the job holds both until the old copy's exit.
    /// When the new copy reports running (ready, for jobs submitted with
    /// --wait-ready), the old one gets its stop (after
    /// a checkpoint notice with `checkpoint`); its exit frees its GPUs and
    /// the new copy takes its place. A new copy that fails to start is
    /// rolled back: its GPUs are freed, the old copy keeps running.
    pub fn migrate(&self, alloc_id: u64, to: &str, checkpoint: bool) -> Result<Migration, ServeError> {
        for part in &self.partitions {
            let mut guard = part.lock_state();
            let st = &mut *guard;
            let Some(&job_id) = st.by_alloc.get(&alloc_id) else { continue };
            if job_id == 0 {
                return Err(ServeError::FailedPrecondition(format!("allocation {alloc_id} is an operator allocation, not a job's task")));
            }
            let job = st.jobs.get(&job_id).ok_or(ServeError::UnknownJob(job_id))?;
            if job.state != JobState::Running {
                return Err(ServeError::FailedPrecondition(format!("job {job_id} is {}", job.state.as_str())));
            }
            if job.sleep != super::state::SleepState::Awake {
                return Err(ServeError::FailedPrecondition(format!("job {job_id} is {}: only an awake job migrates", job.sleep.as_str())));
            }
            if let Some(m) = job.runs.iter().find(|r| r.replaces != 0) {
                return Err(ServeError::FailedPrecondition(format!("job {job_id} is migrating allocation {} already", m.replaces)));
            }
            let Some(i) = job.runs.iter().position(|r| r.alloc_id == alloc_id && r.holds) else {
                return Err(ServeError::FailedPrecondition(format!("allocation {alloc_id} of job {job_id} has ended")));
            };
            if job.runs[i].state != TaskState::Running {
                return Err(ServeError::FailedPrecondition(format!("allocation {alloc_id} is {}: only a running task migrates", job.runs[i].state.as_str())));
            }
            let old = job.allocations[i].clone();
            let src = job.runs[i].node.clone();
            let want = old.gpus.count_ones() as usize;
            let models: Vec<_> = job.spec.models.iter().filter_map(|m| st.fleet.model_id(m)).collect();
            let any_model = job.spec.models.is_empty();
            // The GPUs a node would give it, or why not.
            let fit = |name: &str, id: NodeId| -> Result<(u64, usize), String> {
                let n = &st.fleet.nodes()[id as usize];
                if !n.schedulable {
                    return Err("not schedulable".into());
                }
                if !any_model && !n.model.is_some_and(|m| models.contains(&m)) {
                    return Err(format!("its GPUs are not of the job's models {:?}", job.spec.models));
                }
                let free: Vec<usize> = (0..n.gpus.len()).filter(|&g| n.gpus[g] >= old.gpu_milli).collect();
                if free.len() < want || n.cpu_free_milli < old.cpu_milli || n.memory_free_mib < old.memory_mib {
                    return Err(format!("node {name} has {} free GPUs, {} mCPU, {} MiB; the task needs {want}, {}, {}", free.len(), n.cpu_free_milli, n.memory_free_mib, old.cpu_milli, old.memory_mib));
                }
                Ok((free[..want].iter().fold(0u64, |m, &g| m | 1 << g), free.len()))
            };
            let (dest, dest_id, mask) = if to.is_empty() {
                // The partition's placement policy chooses, among the other
                // schedulable agent nodes, on a scratch copy of the fleet.
                let arm = part.active().ok_or_else(|| ServeError::FailedPrecondition(format!("partition {} has no active placement policy to choose a destination", part.name)))?;
                let src_id = old.node;
                let keep = |id: NodeId, n: &Node| id != src_id && n.schedulable && st.agent(id);
                let task = berth_core::Job { id: job_id, tasks: 1, shape: job.spec.job.shape.clone(), priority: job.spec.job.priority, ..berth_core::Job::default() };
                let mut scratch = st.fleet.clone();
                let run = super::deciding::run_arm(&arm, &mut scratch, &mut berth_core::Placer::new(), &task, &keep);
                let chosen = match run.result {
                    Ok(Some((allocations, _))) => allocations.into_iter().next(),
                    Ok(None) => None,
                    Err(e) => return Err(ServeError::FailedPrecondition(format!("the placement policy (version {}) failed to choose a destination: {e}", arm.meta.version))),
                };
                let a = chosen.ok_or_else(|| ServeError::FailedPrecondition(format!("no other agent node has room for allocation {alloc_id}")))?;
                (st.fleet.nodes()[a.node as usize].name.clone(), a.node, a.gpus)
            } else {
                if to == src {
                    return Err(ServeError::Invalid(format!("allocation {alloc_id} already runs on {to}")));
                }
                let id = *st.agent_ids.get(to).ok_or_else(|| ServeError::FailedPrecondition(format!("no agent node {to:?} in partition {}", part.name)))?;
                let (mask, _) = fit(to, id).map_err(|e| ServeError::FailedPrecondition(format!("node {to} cannot take allocation {alloc_id}: {e}")))?;
                (to.to_string(), id, mask)
            };
            return self.start_copy(part, st, job_id, i, &dest, dest_id, mask, checkpoint);
        }
        Err(ServeError::FailedPrecondition(format!("no allocation {alloc_id}")))
    }

    /// Starts the new copy of task `i` of running job `job_id` on agent node
    /// `dest` (fleet id `dest_id`), GPUs `mask`: allocated (checked: no GPU
    /// has two owners) and stored before the start goes out. The old copy
    /// stops once the new one runs (or reports ready, for --wait-ready
    /// jobs); a new copy that fails is rolled back (see [`Live::end_task`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_copy(&self, part: &Partition, st: &mut PartitionState, job_id: u64, i: usize, dest: &str, dest_id: NodeId, mask: u64, checkpoint: bool) -> Result<Migration, ServeError> {
        let job = st.jobs.get(&job_id).ok_or(ServeError::UnknownJob(job_id))?;
        let (alloc_id, old) = (job.runs[i].alloc_id, job.allocations[i].clone());
        let (argv, mut env) = (job.spec.argv.clone(), job.spec.env.clone());
        let new = Allocation { node: dest_id, gpus: mask, ..old };
        if st.engine.lent().get(&dest_id).is_some_and(|m| m & mask != 0) {
            return Err(ServeError::FailedPrecondition(format!("node {dest}: GPUs lent by a sleeping job (its wake needs them back)")));
        }
        st.fleet.allocate(&new).map_err(|e| ServeError::FailedPrecondition(format!("node {dest}: {e}")))?;
        let new_id = self.next_alloc_id().inspect_err(|_| st.fleet.release(&new).expect("just allocated"))?;
        let gpus: Vec<u32> = gpus_of(mask).map(|g| g as u32).collect();
        let dest = dest.to_string();
        let job = st.jobs.get_mut(&job_id).expect("found above");
        job.allocations.push(new.clone());
        job.runs.push(TaskRun { replaces: alloc_id, checkpoint_old: checkpoint, ..TaskRun::starting(new_id, dest.clone(), gpus.clone()) });
        st.by_alloc.insert(new_id, job_id);
        // Stored before the start goes out, or not made at all.
        if let Err(e) = self.persist(vec![st.job_op(&part.name, job_id)]) {
            let job = st.jobs.get_mut(&job_id).expect("found above");
            job.runs.pop();
            job.allocations.pop();
            st.by_alloc.remove(&new_id);
            st.fleet.release(&new).expect("just allocated");
            return Err(e);
        }
        env.insert("BERTH_MIGRATED_FROM".into(), alloc_id.to_string());
        tracing::info!(target: "berth::serve", job = job_id, from = alloc_id, to = new_id, node = %dest, gpus = ?gpus, "migration: starting the new copy");
        let start = Start { alloc_id: new_id, job_id, node: &dest, gpus: &gpus, argv: &argv, env: &env, cpu_milli: new.cpu_milli, memory_mib: new.memory_mib };
        let sent = match self.actuator() {
            Some(a) => a.start(start),
            None => Err("no agent hub".into()),
        };
        if let Err(e) = sent {
            self.end_task(part, st, new_id, TaskState::Failed, -1, 0, &format!("start not delivered: {e}"));
            return Err(ServeError::FailedPrecondition(format!("migration of allocation {alloc_id} to {dest} rolled back: start not delivered: {e}")));
        }
        st.dirty = true;
        Ok(Migration { job_id, alloc_id: new_id, node: dest, gpus })
    }

    /// The first allocation id not issued yet: a registration's first
    /// heartbeat judges the allocations numbered below it (see [`Beat`]).
    pub fn registration_mark(&self) -> u64 {
        self.next_alloc.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Queues a heartbeat for its partition's scheduler thread, which
    /// reconciles it between passes; never waits for a pass.
    pub fn beat(&self, partition: &str, beat: Beat) {
        let Ok(p) = self.partition_index(partition) else { return };
        let part = &self.partitions[p];
        // The scheduler takes them in batches: told once per batch, a
        // fleet's heartbeats do not wake it thousands of times a second.
        if part.beats.lock().unwrap().push(beat) {
            part.wake.notify_all();
        }
    }

    /// Reconciles the queued heartbeats with the state: what each node runs
    /// against what the fleet holds there. Orphans (processes of no
    /// allocation, or of allocations fenced when the node was given up) are
    /// stopped; on a registration's first beat, allocations the node no
    /// longer runs are ended as lost, and preempted tasks past their notice
    /// are stopped again. One walk of the jobs serves every first beat of
    /// the batch (a restarted host takes in thousands at once).
    pub(super) fn reconcile_beats(&self, part: &Partition, st: &mut PartitionState, beats: Vec<Beat>) {
        if beats.is_empty() {
            return;
        }
        let firsts: HashMap<&str, u64> = beats.iter().filter_map(|b| Some((b.node.as_str(), b.registered_below?))).collect();
        // Per node of a first beat: allocations held there below its mark,
        // and preempted tasks there past their notice.
        let mut held_before: HashMap<String, Vec<u64>> = HashMap::new();
        let mut overdue: HashMap<String, Vec<u64>> = HashMap::new();
        if !firsts.is_empty() {
            let now_ms = self.now_ms();
            for (&a, m) in &st.manual {
                let node = &st.fleet.nodes()[m.node as usize].name;
                if firsts.get(node.as_str()).is_some_and(|&below| a < below) {
                    held_before.entry(node.clone()).or_default().push(a);
                }
            }
            for j in st.jobs.values() {
                for r in j.runs.iter().filter(|r| r.holds) {
                    let Some(&below) = firsts.get(r.node.as_str()) else { continue };
                    if r.alloc_id < below {
                        held_before.entry(r.node.clone()).or_default().push(r.alloc_id);
                    }
                    if j.evicting && r.stop_at_unix_ms <= now_ms {
                        overdue.entry(r.node.clone()).or_default().push(r.alloc_id);
                    }
                }
            }
        }
        let mut found = Vec::new();
        for beat in beats {
            let Some(&nid) = st.agent_ids.get(&beat.node) else {
                found.push(Reconciled { orphans: beat.running, node: beat.node, held: Vec::new() });
                continue;
            };
            let mask = beat.active.iter().filter(|&&g| g < 64).fold(0u64, |m, &g| m | 1 << g);
            st.activity.insert(nid, mask);
            st.fleet.set_measured(nid, beat.measured).expect("agent node ids are in the fleet");
            let first = beat.registered_below.is_some();
            let expected = if first { held_before.remove(&beat.node).unwrap_or_default() } else { Vec::new() };
            let overdue = if first { overdue.remove(&beat.node).unwrap_or_default() } else { Vec::new() };
            let r = self.reconcile(part, st, nid, beat, &expected, &overdue);
            // (Most beats only confirm: nothing for the hub.)
            if !r.held.is_empty() || !r.orphans.is_empty() {
                found.push(r);
            }
        }
        if let Some(act) = self.actuator().filter(|_| !found.is_empty()) {
            act.reconciled(found);
        }
    }

    /// Reconciles one heartbeat of node `nid` (see [`Live::reconcile_beats`]).
    fn reconcile(&self, part: &Partition, st: &mut PartitionState, nid: NodeId, beat: Beat, expected: &[u64], overdue: &[u64]) -> Reconciled {
        let node = beat.node.as_str();
        let mut out = Reconciled { node: node.to_string(), ..Default::default() };
        let first = beat.registered_below.is_some();
        for &a in &beat.running {
            let held = match st.by_alloc.get(&a) {
                Some(0) => st.manual.get(&a).filter(|m| m.node == nid && !st.lost.contains(&a)).map(|m| first.then(|| gpus_of(m.gpus).map(|g| g as u32).collect())),
                // A task of an ended job (cancelled, timed out) is stopped
                // again: the stop may not have reached it. Its GPUs stay the
                // job's until its exit is reported.
                Some(j) => st
                    .jobs
                    .get(j)
                    .filter(|j| !j.state.is_ended())
                    .and_then(|j| j.runs.iter().find(|r| r.alloc_id == a && r.holds && r.node == node))
                    .map(|r| first.then(|| r.gpus.clone())),
                None => None,
            };
            match held {
                Some(Some(gpus)) => out.held.push((a, gpus)),
                Some(None) => {}
                None => out.orphans.push(a),
            }
        }
        for &a in expected {
            if !beat.running.contains(&a) {
                tracing::warn!(target: "berth::serve", allocation = a, node, "the node came back without this allocation: lost");
                self.end_task(part, st, a, TaskState::Lost, -1, 0, &format!("node {node} came back without it"));
            }
        }
        // Back (after a restart of either side, or a link that was down): a
        // preempted task's stop may have been lost on the way or sent while
        // it was away. One whose notice ran out is stopped again; its
        // preemptor waits for it.
        let overdue: Vec<u64> = overdue.iter().copied().filter(|a| beat.running.contains(a) && !st.stops.iter().any(|s| s.1 == *a)).collect();
        if !overdue.is_empty() {
            tracing::info!(target: "berth::serve", node, allocations = ?overdue, "preempted tasks past their notice on a node back: stopped again");
            let now = self.clock.now();
            st.stops.extend(overdue.into_iter().map(|a| (now, a, node.to_string())));
            st.dirty = true;
        }
        out
    }

    /// A node unreachable past the grace: its jobs are requeued to run
    /// elsewhere. What their tasks held stays fenced (allocated, owned by
    /// no job) until the node returns and stops them, so a process that is
    /// still running there never shares its GPUs. Returns the jobs requeued.
    pub fn give_up_node(&self, partition: &str, node: &str, why: &str) -> Vec<u64> {
        let Ok((p, _)) = self.agent_node(partition, node) else { return Vec::new() };
        let part = &self.partitions[p];
        let mut guard = part.lock_state();
        let st = &mut *guard;
        let mut ops = Vec::new();
        // A migration into the lost node is rolled back: the job keeps its
        // old copy elsewhere; the new copy's GPUs stay fenced until the node
        // returns and stops it.
        let moving_in: Vec<(u64, usize)> = st
            .jobs
            .iter()
            .filter(|(_, j)| j.state == JobState::Running)
            .flat_map(|(&id, j)| {
                j.runs
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.holds && r.node == node && r.replaces != 0 && j.runs.iter().any(|o| o.alloc_id == r.replaces && o.holds && o.node != node))
                    .map(move |(i, _)| (id, i))
            })
            .collect();
        for (id, i) in moving_in.into_iter().rev() {
            let job = st.jobs.get_mut(&id).expect("listed above");
            let (mut r, a) = (job.runs.remove(i), job.allocations.remove(i));
            if job.loses_work() {
                self.count_lost(&part.name, &job.spec.work_unit, &mut r, &mut job.work);
            }
            job.detail = format!("migration of allocation {} to {node} rolled back: {why}", r.replaces);
            tracing::warn!(target: "berth::serve", job = id, allocation = r.alloc_id, "{}", job.detail);
            st.manual.insert(r.alloc_id, a);
            st.lost.insert(r.alloc_id);
            st.by_alloc.insert(r.alloc_id, 0);
            ops.push(st.held_op(&part.name, r.alloc_id));
            ops.push(st.job_op(&part.name, id));
        }
        let hit: Vec<u64> = st.jobs.iter().filter(|(_, j)| j.state == JobState::Running && j.runs.iter().any(|r| r.holds && r.node == node)).map(|(&id, _)| id).collect();
        let mut credited = false;
        for &id in &hit {
            // The engine gives the job's GPUs back and queues it again; the
            // same GPUs are taken at once by the fenced allocations below.
            // An asleep job's GPUs are lent, not its: its sleeping processes
            // are orphans to stop when the node returns, holding nothing.
            let asleep = st.jobs[&id].sleep.frozen();
            if let Some(&slot) = st.slots.get(&id) {
                st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::Requeue(slot));
                // A promise this stop breaks is credited in the job's write.
                for d in st.engine.take_broken() {
                    if let berth_core::Decision::Broken { job, promise, lost_gpu_s, credit_gpu_h, .. } = d
                        && self.note_broken(&part.name, st, job, promise, lost_gpu_s, credit_gpu_h)
                    {
                        credited = true;
                    }
                }
            }
            let now_s = self.now_s();
            let job = st.jobs.get_mut(&id).expect("listed above");
            // An interruption, as the engine counts it (its daily cap).
            job.interruptions += 1;
            job.interrupted_s.push(now_s);
            if job.interrupted_s.len() > super::state::KEPT_INTERRUPTIONS {
                job.interrupted_s.remove(0);
            }
            job.sleep = super::state::SleepState::Awake;
            if asleep {
                let loses = job.loses_work();
                for r in job.runs.iter_mut().filter(|r| r.holds) {
                    if loses {
                        self.count_lost(&part.name, &job.spec.work_unit, r, &mut job.work);
                    }
                    st.by_alloc.remove(&r.alloc_id);
                    r.holds = false;
                    r.state = TaskState::Lost;
                    if r.node != node
                        && let Some(act) = self.actuator()
                    {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
            }
            let loses = job.loses_work();
            for (a, r) in job.allocations.iter().zip(job.runs.iter_mut()).filter(|(_, r)| r.holds) {
                // Requeued: it runs again from its last checkpoint.
                if loses {
                    self.count_lost(&part.name, &job.spec.work_unit, r, &mut job.work);
                }
                // Same GPUs, now held by a fenced allocation instead of the
                // job. A copy migrating in was allocated here, not by the
                // engine: it keeps its GPUs. GPUs the engine did not give
                // back (they drain for work still leaving them) stay held
                // by their drain.
                let fenced = r.replaces != 0 || st.fleet.allocate(a).is_ok();
                if fenced {
                    st.manual.insert(r.alloc_id, a.clone());
                    st.lost.insert(r.alloc_id);
                    st.by_alloc.insert(r.alloc_id, 0);
                } else {
                    tracing::warn!(target: "berth::serve", job = id, allocation = r.alloc_id, node = %r.node, "lost task's GPUs stay held by the drain they are in");
                    st.by_alloc.remove(&r.alloc_id);
                }
                r.holds = false;
                r.state = TaskState::Lost;
                if r.node != node
                    && let Some(act) = self.actuator()
                {
                    act.stop(r.alloc_id, &r.node);
                }
            }
            let fenced: Vec<u64> = job.runs.iter().map(|r| r.alloc_id).collect();
            job.close_run(self.now_ms());
            job.state = JobState::Pending;
            job.allocations.clear();
            job.placements.clear();
            job.runs.clear();
            job.detail = format!("requeued: {why}");
            if let Some(t) = job.ends_at.take() {
                st.running.remove(&(t, id));
            }
            st.pending.push(id);
            self.metrics.jobs.with_label_values(&[&part.name, JobState::Running.as_str()]).dec();
            self.metrics.jobs.with_label_values(&[&part.name, JobState::Pending.as_str()]).inc();
            tracing::warn!(target: "berth::serve", job = id, node, "job requeued: {why}");
            ops.extend(fenced.into_iter().map(|a| st.held_op(&part.name, a)));
            ops.push(st.job_op(&part.name, id));
        }
        if credited {
            ops.push(crate::store::Op::Put(super::credits::key(&part.name), st.credits.stored()));
        }
        if !ops.is_empty() {
            self.persist_logged(ops);
            st.dirty = true;
            part.wake.notify_all();
        }
        hit
    }

    /// The partition of a job task's allocation.
    pub fn allocation_partition(&self, alloc_id: u64) -> Option<String> {
        self.partitions.iter().find(|p| p.lock_state().by_alloc.get(&alloc_id).is_some_and(|&j| j != 0)).map(|p| p.name.clone())
    }

    /// The node and GPUs of an allocation the fleet knows.
    pub fn allocation_node(&self, alloc_id: u64) -> Option<(String, Vec<u32>)> {
        for part in &self.partitions {
            let st = part.lock_state();
            let Some(&job_id) = st.by_alloc.get(&alloc_id) else { continue };
            if job_id == 0 {
                let a = st.manual.get(&alloc_id)?;
                return Some((st.fleet.nodes()[a.node as usize].name.clone(), gpus_of(a.gpus).map(|g| g as u32).collect()));
            }
            let r = st.jobs.get(&job_id)?.runs.iter().find(|r| r.alloc_id == alloc_id)?;
            return Some((r.node.clone(), r.gpus.clone()));
        }
        None
    }

    /// What an agent reported about an allocation: its state, and when it
    /// is gone (exited, failed), its GPUs go back to the fleet. Taken in at
    /// once (the partitions' locks are waited for); the agents' reports
    /// through the hub are queued instead ([`Live::queue_report`]).
    pub fn task_report(&self, alloc_id: u64, report: Report, exit_code: i32, signal: i32, detail: &str, stopped: Option<Stopped>) {
        self.report_anywhere(&QueuedReport { alloc_id, report, exit_code, signal, detail: detail.to_string(), stopped, work_units: 0, work_checkpointed: 0, gpu_memory_held_mib: 0, taken: None });
    }

    /// Takes report `r` in at the partition holding its allocation.
    fn report_anywhere(&self, r: &QueuedReport) {
        for part in &self.partitions {
            if self.report_in(part, &mut part.lock_state(), r) {
                return;
            }
        }
    }

    /// Queues an agent's report for `partition` (its node's): the
    /// scheduler takes it in between passes, before the heartbeats queued
    /// with it (`r.taken` is told then). The agent's call waits for that
    /// without a thread: thousands of reports waiting on a pass's lock, a
    /// thread each, starved a 20,000-node host's heartbeats and scheduler.
    pub fn queue_report(&self, partition: &str, r: QueuedReport) {
        let Ok(p) = self.partition_index(partition) else {
            self.report_anywhere(&r);
            if let Some(taken) = r.taken {
                let _ = taken.send(());
            }
            return;
        };
        let part = &self.partitions[p];
        part.reports.lock().unwrap().push(r);
        // Every report (not only the first of a batch): a wake-up that
        // came while the scheduler was between its check and its wait is
        // lost, and the next one must not be the only other chance.
        part.wake.notify_all();
    }

    /// Takes in the queued reports of partition `part` (its state locked).
    pub(super) fn take_reports(&self, part: &Partition, st: &mut PartitionState) {
        let reports = std::mem::take(&mut *part.reports.lock().unwrap());
        for mut r in reports {
            if !self.report_in(part, st, &r) {
                tracing::debug!(target: "berth::serve", allocation = r.alloc_id, partition = %part.name, "report on an allocation the partition does not hold: ignored");
            }
            if let Some(taken) = r.taken.take() {
                let _ = taken.send(());
            }
        }
    }

    /// Applies report `r` to partition `part`; false when the partition
    /// holds no such allocation.
    fn report_in(&self, part: &Partition, st: &mut PartitionState, r: &QueuedReport) -> bool {
        let (alloc_id, report, exit_code, signal, detail, stopped) = (r.alloc_id, r.report, r.exit_code, r.signal, r.detail.as_str(), r.stopped);
        let held_memory = r.gpu_memory_held_mib;
        let report_saved = r.work_checkpointed;
        let Some(&job_id) = st.by_alloc.get(&alloc_id) else { return false };
        // Every report carries the run's work count: taken in first, so an
        // exit's last units count before the run's end is judged.
        let mut progressed = false;
        if let Some(job) = st.jobs.get_mut(&job_id)
            && let Some(run) = job.runs.iter_mut().find(|run| run.alloc_id == alloc_id && run.holds)
        {
            let new = super::outcome::take_progress(run, &mut job.work, r.work_units);
            if new > 0 {
                let sample = (self.now_ms(), run.work_units);
                run.progress_first.get_or_insert(sample);
                run.progress_last = Some(sample);
            }
            // A task's own checkpoint count (`berth checkpointed` records
            // the count it saved): carried by every report, so a checkpoint
            // just before an exit is not lost to the exit's race with it.
            super::outcome::saved(run, report_saved);
            self.metrics.work(&part.name, super::work::unit_name(&job.spec.work_unit), new, 0);
            progressed = new > 0;
        }
        match report {
            Report::Progress => {
                // Stored with the run's count (the agent relays progress at
                // most every few seconds): a restarted host compares the
                // next count with this one, so nothing is counted twice (and
                // a report that changed nothing writes nothing).
                if progressed && st.jobs.contains_key(&job_id) {
                    self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                }
            }
            Report::State(state) if state.is_gone() => {
                self.measure_eviction_exit(part, st, job_id, alloc_id, signal, stopped);
                self.end_task(part, st, alloc_id, state, exit_code, signal, detail);
            }
            Report::Checkpointed => {
                // The task saved its work: preemption ranks it, and
                // counts work lost, from now.
                let Some(r) = st.jobs.get_mut(&job_id).and_then(|j| j.runs.iter_mut().find(|r| r.alloc_id == alloc_id && r.holds)) else { return true };
                r.checkpointed_unix_ms = self.now_ms();
                // An agent that does not say what the checkpoint saved: all
                // counted so far.
                if report_saved == 0 {
                    super::outcome::checkpoint(r);
                }
                if let Some(&slot) = st.slots.get(&job_id) {
                    st.engine.apply(&mut st.fleet, self.now_s(), berth_core::engine::Event::Checkpoint(slot));
                }
                tracing::info!(target: "berth::serve", job = job_id, allocation = alloc_id, "task reported a checkpoint");
                self.persist_logged(vec![st.job_op(&part.name, job_id)]);
            }
            Report::State(_) | Report::Ready => {
                let Some(job) = st.jobs.get_mut(&job_id) else { return true };
                let wait_ready = job.spec.wait_ready;
                let Some(r) = job.runs.iter_mut().find(|r| r.alloc_id == alloc_id && r.holds) else { return true };
                // Readiness is a flag beside the state, which stays "running".
                let mut woke = false;
                let mut slept = false;
                let took_over = match report {
                    Report::State(state) => {
                        let was = r.state;
                        r.state = was.after_report(state);
                        woke = was == TaskState::Sleeping && r.state == TaskState::Running;
                        slept = r.state == TaskState::Sleeping;
                        if slept {
                            r.gpu_memory_held_mib = held_memory;
                        }
                        was == TaskState::Starting && r.serves(wait_ready)
                    }
                    _ => {
                        let first = !r.ready;
                        r.ready = true;
                        if r.state == TaskState::Starting {
                            r.state = TaskState::Running;
                        }
                        first && wait_ready
                    }
                };
                if slept || woke {
                    // Asleep and awake again are kept: a restarted host
                    // knows where its tasks are.
                    self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                    if slept {
                        self.task_slept(part, st, job_id);
                    }
                    return true;
                }
                if r.replaces != 0 && took_over {
                    // Make-before-break: the new copy runs, now the old one stops.
                    let (old, checkpoint) = (r.replaces, r.checkpoint_old);
                    if let Some(o) = job.runs.iter().find(|o| o.alloc_id == old && o.holds)
                        && let Some(act) = self.actuator()
                    {
                        tracing::info!(target: "berth::serve", job = job_id, from = old, to = alloc_id, "migration: new copy running, stopping the old one");
                        if checkpoint {
                            act.checkpoint(old, &o.node);
                        }
                        act.stop(old, &o.node);
                    }
                    self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                }
            }
        }
        true
    }

    /// A preempted task's exit, measured: from its stop to its exit (the
    /// agent's clock; without it, the host's from the scheduled stop), and
    /// whether SIGKILL was needed. Kept on the task for the job's ledger
    /// entry, and counted in the metrics.
    fn measure_eviction_exit(&self, part: &Partition, st: &mut PartitionState, job_id: u64, alloc_id: u64, signal: i32, stopped: Option<Stopped>) {
        let now_ms = self.now_ms();
        let Some(job) = st.jobs.get_mut(&job_id).filter(|j| j.evicting) else { return };
        let Some(r) = job.runs.iter_mut().find(|r| r.alloc_id == alloc_id && r.holds) else { return };
        let (to_exit_ms, killed) = match stopped {
            Some(s) => (s.to_exit_ms, s.killed),
            None => (now_ms.saturating_sub(r.stop_at_unix_ms), signal == libc::SIGKILL),
        };
        r.stop_to_exit_ms = to_exit_ms;
        r.killed = killed;
        r.stop_measured = true;
        r.stop_timed_by_agent = stopped.is_some();
        self.metrics.eviction_exits.with_label_values(&[part.name.as_str(), if killed { "killed" } else { "exited" }]).inc();
        self.metrics.eviction_stop_to_exit.with_label_values(&[part.name.as_str()]).observe(to_exit_ms as f64 / 1e3);
    }

    /// Gives a gone allocation's capacity back to the fleet. A fleet that
    /// does not hold it is a broken invariant of the host's records: it is
    /// logged and counted (`berth_invariant_breaks_total`; the simulation
    /// test fails on any), and the partition goes on deciding. A panic here
    /// would poison the state lock on a path an agent's report reaches.
    pub(super) fn release_checked(&self, partition: &str, fleet: &mut Fleet, alloc: &Allocation, alloc_id: u64) {
        if let Err(e) = fleet.release(alloc) {
            self.metrics.invariant_breaks.with_label_values(&[partition, "release"]).inc();
            tracing::error!(target: "berth::serve", partition, allocation = alloc_id, "broken invariant: the fleet did not hold allocation {alloc_id}'s capacity ({e}); nothing released");
        }
    }

    /// One task (or operator allocation) is gone: release what it held; a
    /// failed task stops the rest of its gang; the job ends with its last.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn end_task(&self, part: &Partition, st: &mut PartitionState, alloc_id: u64, state: TaskState, exit_code: i32, signal: i32, detail: &str) {
        let Some(&job_id) = st.by_alloc.get(&alloc_id) else { return };
        if job_id == 0 {
            if let Some(a) = st.manual.remove(&alloc_id) {
                self.release_checked(&part.name, &mut st.fleet, &a, alloc_id);
                st.apply_holds(a.node);
                // GPUs freed outside the engine (a fenced or operator
                // allocation): jobs that did not fit are tried again.
                st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::FleetChanged);
                if st.lost.remove(&alloc_id) {
                    tracing::info!(target: "berth::serve", allocation = alloc_id, "fenced GPUs of a lost node released: {state}");
                }
            }
            st.by_alloc.remove(&alloc_id);
            self.persist_logged(vec![st.held_op(&part.name, alloc_id)]);
        } else {
            let Some(job) = st.jobs.get_mut(&job_id) else { return };
            let Some(i) = job.runs.iter().position(|r| r.alloc_id == alloc_id) else { return };
            if !job.runs[i].holds {
                return; // a repeated report
            }
            if job.evicting {
                // A preempted job's process is gone: its GPUs are the
                // preemptor's already (the engine gave them at the decision).
                // What it did since its last checkpoint is done again.
                self.count_lost(&part.name, &job.spec.work_unit, &mut job.runs[i], &mut job.work);
                let r = &mut job.runs[i];
                r.holds = false;
                r.state = state;
                r.exit_code = exit_code;
                r.signal = signal;
                let node = st.agent_ids.get(&r.node).copied();
                if job.runs.iter().all(|r| !r.holds) {
                    self.log_vacated(part, st, job_id);
                    self.vacated(part, st, job_id);
                } else {
                    self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                }
                if let Some(node) = node {
                    st.apply_holds(node);
                }
                st.dirty = true;
                part.wake.notify_all();
                return;
            }
            if job.runs[i].replaces != 0 {
                // A migrating copy ended before its old copy did: rolled
                // back; the old copy keeps the task (the copy's unsaved work
                // is lost).
                let (mut r, a) = (job.runs.remove(i), job.allocations.remove(i));
                if job.loses_work() {
                    self.count_lost(&part.name, &job.spec.work_unit, &mut r, &mut job.work);
                }
                self.release_checked(&part.name, &mut st.fleet, &a, alloc_id);
                job.detail = format!("migration of allocation {} to {} rolled back: {state} (exit {exit_code}, signal {signal}) {detail}", r.replaces, r.node).trim_end().to_string();
                tracing::warn!(target: "berth::serve", job = job_id, allocation = alloc_id, "{}", job.detail);
                st.by_alloc.remove(&alloc_id);
                st.apply_holds(a.node);
                // GPUs freed outside the engine: waiting jobs are tried again.
                st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::FleetChanged);
                self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                st.dirty = true;
                part.wake.notify_all();
                return;
            }
            if let Some(k) = job.runs.iter().position(|n| n.replaces == alloc_id) {
                // The old copy of a migrated task is gone: its GPUs are
                // freed and the new copy takes its place; not the job's end.
                let node = job.allocations[i].node;
                self.release_checked(&part.name, &mut st.fleet, &job.allocations[i], alloc_id);
                let (new_run, new_alloc) = (job.runs.remove(k), job.allocations.remove(k));
                if let Some(&slot) = st.slots.get(&job_id) {
                    st.engine.replace_held(slot, &job.allocations[i], new_alloc.clone());
                }
                if let Some(p) = job.placements.get_mut(i) {
                    *p = Placed { node: new_run.node.clone(), gpus: new_run.gpus.clone() };
                }
                tracing::info!(target: "berth::serve", job = job_id, from = alloc_id, to = new_run.alloc_id, node = %new_run.node, "migration done: old copy {state}");
                // The new copy resumes from the old one's last checkpoint.
                if job.loses_work() {
                    self.count_lost(&part.name, &job.spec.work_unit, &mut job.runs[i], &mut job.work);
                }
                job.runs[i] = TaskRun { replaces: 0, checkpoint_old: false, ..new_run };
                job.allocations[i] = new_alloc;
                st.by_alloc.remove(&alloc_id);
                st.apply_holds(node);
                // The source's GPUs are free outside the engine (it holds
                // the new allocation now): waiting jobs are tried again.
                st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::FleetChanged);
                self.persist_logged(vec![st.job_op(&part.name, job_id)]);
                st.dirty = true;
                part.wake.notify_all();
                return;
            }
            // A failure loses what the run did since its last checkpoint (a
            // time limit or a cancel is the owner's stop, not a loss).
            if state.failed(exit_code, signal) && job.loses_work() {
                self.count_lost(&part.name, &job.spec.work_unit, &mut job.runs[i], &mut job.work);
            }
            let r = &mut job.runs[i];
            r.holds = false;
            r.state = state;
            r.exit_code = exit_code;
            r.signal = signal;
            // The engine holds the job's GPUs until its last task is gone
            // (a preempted job's are the preemptor's already).
            let node = st.agent_ids.get(&job.runs[i].node).copied();
            if state.failed(exit_code, signal) && job.state == JobState::Running {
                if job.detail.is_empty() {
                    job.detail = format!("task {i} on {}: {state} (exit {exit_code}, signal {signal}) {detail}", job.runs[i].node).trim_end().to_string();
                }
                if let Some(act) = self.actuator() {
                    for other in job.runs.iter().filter(|o| o.holds) {
                        act.stop(other.alloc_id, &other.node);
                    }
                }
            }
            if job.runs.iter().all(|r| !r.holds) {
                // Its processes are gone: none is asleep.
                job.sleep = super::state::SleepState::Awake;
                if job.state == JobState::Running {
                    // Stopped because its budget was spent: the end it bought.
                    let spent = job.time_limit_stop && job.budget_stop;
                    let ok = spent || job.runs.iter().all(|r| !r.state.failed(r.exit_code, r.signal));
                    job.close_run(self.now_ms());
                    job.state = if ok { JobState::Finished } else { JobState::Failed };
                    job.ended_unix_ms = self.now_ms();
                    self.metrics.jobs.with_label_values(&[&part.name, JobState::Running.as_str()]).dec();
                    self.metrics.jobs.with_label_values(&[&part.name, job.state.as_str()]).inc();
                    tracing::info!(target: "berth::serve", job = job_id, state = job.state.as_str(), "job ended");
                }
                if let Some(t) = job.ends_at.take() {
                    st.running.remove(&(t, job_id));
                }
                if let Some(&slot) = st.slots.get(&job_id) {
                    st.engine.apply(&mut st.fleet, self.now_s(), berth_core::Event::End(slot));
                }
            }
            if let Some(node) = node {
                st.apply_holds(node);
            }
            self.persist_logged(vec![st.job_op(&part.name, job_id)]);
        }
        st.dirty = true;
        part.wake.notify_all();
    }
}
