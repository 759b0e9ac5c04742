//! Live compaction: ejection chains that free whole agent nodes, run
//! make-before-break on real processes.
//!
//! The partition's compact policy (a wasm version in the registry, hook
//! `compact`) plans over a snapshot of its agent nodes; the core checks the
//! plan and keeps the chains that pay back ([`compaction::plan`], the same
//! code replay runs). This module then runs the chosen moves one at a time
//! through the migration machinery of [`super::actuation`]: the destination
//! GPUs are allocated and stored, the new copy starts, the old copy gets
//! its checkpoint notice and stop only once the new one runs (or reports
//! ready, for jobs submitted with --wait-ready), and its exit frees the
//! source. A move that fails (start failure, no takeover within
//! `destination_deadline_s`, destination node lost) is rolled back: the new
//! copy is stopped and freed, the job keeps running on its source, and the
//! rest of its chain is skipped. Moves of the chain that already completed
//! stay where they are (each left a valid placement; undoing them would be
//! more moves).
//!
//! Steps run on demand (`berth compact --live`), every `period_s` under the
//! hysteresis of replay, and when a pending job that needs whole nodes
//! cannot start (at most every 30 s). Every chain is a [`ChainRecord`] in
//! the store (`compactions/<partition>/<id>`): `berth compactions`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use berth_core::compaction::{self, ChainDecision, CompactionConfig, Cursor, PlannedMove, Running, Tier, Wanted};
use berth_core::units::NodeId;
use berth_core::PolicyError;

use super::breaker::Call;
use super::state::{ChainRecord, InFlight, JobState, Live, MoveRecord, Origin, Partition, PartitionState, PolicyHook, RunState, SleepState, Verify, LEDGER_KEEP};
use berth_core::Allocation;
use super::lifecycle::{ChainState, MoveState};
use super::error::ServeError;
use crate::util::unix_ms;
use crate::store::Op;

/// How often a blocked whole-node job may trigger a step.
const BLOCKED_RETRY: Duration = Duration::from_secs(30);
pub(crate) fn chain_key(partition: &str, id: u64) -> String {
    format!("compactions/{partition}/{id:020}")
}

pub(crate) fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::SameSwitch => "same-switch",
        Tier::SameAggregation => "same-aggregation",
        Tier::CrossAggregation => "cross-aggregation",
    }
}

/// What a step planned (and, unless a dry run, started).
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    pub policy: String,
    pub rejected: Option<String>,
    pub chains: Vec<ChainDecision>,
    /// (move, job, allocation, from node, to node, to GPUs)
    pub moves: Vec<(PlannedMove, u64, u64, String, String, Vec<u32>)>,
    pub chain_ids: Vec<u64>,
    pub idle_nodes: u64,
    pub partial_nodes: u64,
}

impl PartitionState {
    fn agent_node_ids(&self) -> Vec<NodeId> {
        (0..self.fleet.nodes().len() as NodeId).filter(|&id| self.agent(id)).collect()
    }

    /// The running tasks on agent nodes as compaction sees them, and where
    /// each row came from. A task moves only when its job was submitted
    /// movable, every task of it runs and none is migrating.
    fn compaction_rows(&self, config: &CompactionConfig, now_s: u64) -> (Vec<Running>, Vec<Origin>) {
        let (mut rows, mut origins) = (Vec::new(), Vec::new());
        for (&job_id, j) in &self.jobs {
            // An asleep job's GPUs are lent: it holds nothing to plan with.
            if j.state != JobState::Running || j.evicting || j.runs.is_empty() || j.sleep == SleepState::Asleep {
                continue;
            }
            let movable = j.spec.movable && j.sleep == SleepState::Awake && j.runs.iter().all(|r| r.holds && r.state == super::lifecycle::TaskState::Running && r.replaces == 0);
            let started_s = j.started_unix_ms / 1000;
            let remaining_s = j.ends_at.map_or(0, |t| t.saturating_duration_since(self.clock.now()).as_secs());
            for (task, (a, r)) in j.allocations.iter().zip(&j.runs).enumerate().filter(|(_, (_, r))| r.holds) {
                let checkpoint_s = (r.checkpointed_unix_ms / 1000).max(started_s);
                rows.push(Running {
                    id: rows.len() as u32,
                    job_id,
                    node: a.node,
                    gpus: a.gpus,
                    gpu_milli: a.gpu_milli,
                    cpu_milli: a.cpu_milli,
                    memory_mib: a.memory_mib,
                    priority: j.spec.job.priority,
                    movable,
                    gang_id: if j.spec.job.tasks > 1 { job_id } else { 0 },
                    state_bytes: compaction::estimate_state_bytes(config, a.gpus.count_ones(), a.gpu_milli, a.memory_mib),
                    remaining_s,
                    running_s: now_s.saturating_sub(started_s),
                    since_checkpoint_s: now_s.saturating_sub(checkpoint_s),
                    last_moved_s: self.compaction.moved_at.get(&r.alloc_id).copied(),
                    class: j.spec.job.task_class(),
                });
                origins.push(Origin { job_id, task, alloc_id: r.alloc_id });
            }
        }
        (rows, origins)
    }

    /// Pending jobs with a command (they run on agent nodes), as shapes.
    fn compaction_pending(&self, nodes: &[NodeId]) -> Vec<Wanted> {
        let largest = compaction::LargestNodes::of(&self.fleet, nodes);
        let mut wanted: Vec<Wanted> = self
            .pending
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|j| !j.spec.argv.is_empty())
            .map(|j| Wanted::of(&largest, &j.spec.job))
            .collect();
        wanted.sort_by_key(|w| std::cmp::Reverse((w.whole_nodes, u64::from(w.gpu_count) * u64::from(w.tasks))));
        wanted.truncate(self.compaction.config.max_pending);
        wanted
    }

    /// Whether a pending whole-node job cannot start now.
    fn whole_node_job_blocked(&self) -> bool {
        let nodes = self.agent_node_ids();
        let pending = self.compaction_pending(&nodes);
        let blocked: Vec<Wanted> = pending.into_iter().filter(|w| w.whole_nodes > 0).collect();
        !blocked.is_empty() && compaction::startable_count(&self.fleet, &nodes, &blocked) < blocked.len() as u64
    }

    fn chain_op(&self, partition: &str, id: u64) -> Option<Op> {
        let r = self.compaction.records.iter().rev().find(|r| r.id == id)?;
        Some(Op::Put(chain_key(partition, id), serde_json::to_vec(r).expect("a chain record serializes")))
    }
}

impl Live {
    /// Reads every partition's compaction ledger back from the store.
    pub(crate) fn recover_compactions(&self, store: &dyn crate::store::Store) -> anyhow::Result<usize> {
        let mut total = 0;
        for part in &self.partitions {
            let prefix = format!("compactions/{}/", part.name);
            let mut records = Vec::new();
            for (key, value) in store.list(&prefix)? {
                records.push(serde_json::from_slice::<ChainRecord>(&value).map_err(|e| anyhow::anyhow!("{key}: {e}"))?);
            }
            total += records.len();
            let mut st = part.lock_state();
            let changed = st.compaction.restore(records);
            let ops: Vec<Op> = changed.iter().map(|r| Op::Put(chain_key(&part.name, r.id), serde_json::to_vec(r).expect("a chain record serializes"))).collect();
            if !ops.is_empty() {
                store.apply(ops)?;
            }
        }
        Ok(total)
    }

    /// One compaction step on partition `partition` now (hysteresis
    /// bypassed): plan, check, and unless `dry_run` start the chosen chains.
    pub fn compact_live(&self, by: &str, partition: &str, dry_run: bool) -> Result<StepReport, ServeError> {
        let p = self.partition_index(partition)?;
        let part = &self.partitions[p];
        if part.aux(PolicyHook::Compact).lock().unwrap().is_none() {
            return Err(ServeError::FailedPrecondition(format!(
                "partition {partition} has no active compact policy: upload and activate one with --hook compact (e.g. ipc)"
            )));
        }
        let mut guard = part.lock_state();
        let st = &mut *guard;
        if let Some(run) = &st.compaction.run {
            let chain = run.current.as_ref().map_or(String::new(), |c| format!(" (chain {})", c.chain_id));
            return Err(ServeError::FailedPrecondition(format!("a compaction step is running in {partition}{chain}: see berth compactions")));
        }
        tracing::info!(target: "berth::serve", partition, by, dry_run, "compaction step on demand");
        self.compaction_step(p, part, st, dry_run)
    }

    /// The ledger of a partition, newest first.
    pub fn compactions(&self, partition: &str, limit: usize) -> Result<Vec<ChainRecord>, ServeError> {
        let p = self.partition_index(partition)?;
        let st = self.partitions[p].lock_state();
        Ok(st.compaction.records.iter().rev().take(limit).cloned().collect())
    }

    /// Plans over the partition's agent nodes and, unless `dry_run`,
    /// starts the chosen chains.
    fn compaction_step(&self, p: usize, part: &Partition, st: &mut PartitionState, dry_run: bool) -> Result<StepReport, ServeError> {
        let Some(arm) = part.aux(PolicyHook::Compact).lock().unwrap().clone() else {
            return Err(ServeError::FailedPrecondition(format!("partition {} has no active compact policy", part.name)));
        };
        let now_s = self.now_s();
        let config = st.compaction.config.clone();
        let nodes = st.agent_node_ids();
        let (rows, origins) = st.compaction_rows(&config, now_s);
        let pending = st.compaction_pending(&nodes);
        let started = Instant::now();
        let planned = {
            let mut policy = arm.policy.lock().unwrap();
            compaction::plan(&st.fleet, &nodes, &rows, &pending, &mut *policy, &config, now_s)
        };
        let took = started.elapsed();
        // A candidate in shadow plans on the same snapshot; never run.
        if let Some(cand) = part.compact.candidate.lock().unwrap().clone() {
            let shadow = {
                let mut policy = cand.policy.lock().unwrap();
                compaction::plan(&st.fleet, &nodes, &rows, &pending, &mut *policy, &config, now_s)
            };
            let mut stats = part.compact.stats.lock().unwrap();
            stats.steps += 1;
            stats.active.add(&planned);
            match &shadow.rejected {
                Some(reason) => {
                    stats.candidate_errors += 1;
                    tracing::warn!(target: "berth::serve", partition = %part.name, version = cand.meta.version, "compact candidate's plan not used: {reason}");
                }
                None => stats.candidate.add(&shadow),
            }
        }
        let policy = format!("{}@{} (compact version {})", arm.meta.name, arm.meta.semver, arm.meta.version);
        let (partial, idle, _) = compaction::occupancy(&st.fleet, &nodes);
        let mut report = StepReport { policy: policy.clone(), rejected: planned.rejected.clone(), chains: planned.chains.clone(), idle_nodes: idle, partial_nodes: partial, ..StepReport::default() };
        // The breaker sees every call: a failed call or an invalid plan
        // counts against the version; nothing moves on either.
        let version = arm.meta.version;
        if let Some(reason) = &planned.rejected {
            let error = planned.failure.clone().unwrap_or_else(|| PolicyError::InvalidOutput(reason.clone()));
            self.metrics.policy_failures.with_label_values(&[&part.name, &arm.meta.name, &version.to_string(), super::breaker::kind(&error)]).inc();
            tracing::warn!(target: "berth::serve", partition = %part.name, version, "compaction plan not used: {reason}");
            if super::breaker::counts(&error) {
                let tripped = part.compact.breaker.lock().unwrap().record(version, Call::Failed(&error), &self.breaker);
                if let Some(why) = tripped {
                    self.trip_aux(p, PolicyHook::Compact, &arm, &why);
                }
            }
            return Ok(report);
        }
        part.compact.breaker.lock().unwrap().record(version, Call::Answered(took), &self.breaker);
        for m in &planned.moves {
            let o = origins[m.index];
            let node = |id: NodeId| st.fleet.nodes()[id as usize].name.clone();
            let gpus = berth_core::fleet::gpus_of(m.to.gpus).map(|g| g as u32).collect();
            report.moves.push((m.clone(), o.job_id, o.alloc_id, node(m.from_node), node(m.to_node), gpus));
        }
        if dry_run || planned.moves.is_empty() {
            return Ok(report);
        }
        // A ledger entry per chain that runs, stored before anything moves.
        let startable = compaction::startable_count(&st.fleet, &nodes, &pending) as u32;
        let mut chain_ids = HashMap::new();
        let mut ops = Vec::new();
        for d in planned.chains.iter().filter(|d| d.run) {
            let id = st.compaction.next_id;
            st.compaction.next_id += 1;
            chain_ids.insert(d.chain, id);
            let moves = report
                .moves
                .iter()
                .filter(|(m, ..)| m.chain == d.chain)
                .map(|(m, job, alloc, from, to, gpus)| MoveRecord {
                    job_id: *job,
                    from_allocation: *alloc,
                    from_node: from.clone(),
                    to_node: to.clone(),
                    to_gpus: gpus.clone(),
                    tier: tier_name(m.tier).into(),
                    state_bytes: m.state_bytes,
                    state: MoveState::Pending,
                    ..MoveRecord::default()
                })
                .collect();
            st.compaction.records.push(ChainRecord {
                id,
                policy: policy.clone(),
                state: ChainState::Running,
                started_unix_ms: unix_ms(),
                nodes_freed: d.nodes_freed,
                benefit_gpu_s: d.benefit_gpu_s,
                cost_gpu_s: d.cost_gpu_s,
                moves,
                idle_nodes_before: idle as u32,
                pending_startable_before: startable,
                ..ChainRecord::default()
            });
            report.chain_ids.push(id);
            ops.extend(st.chain_op(&part.name, id));
        }
        let keep = st.compaction.records.len().saturating_sub(LEDGER_KEEP);
        st.compaction.records.drain(..keep);
        self.persist(ops)?;
        tracing::info!(target: "berth::serve", partition = %part.name, chains = ?report.chain_ids, moves = planned.moves.len(), "compaction: chains start");
        st.compaction.run = Some(RunState {
            cursor: Cursor::new(planned.moves),
            origins,
            chain_ids,
            next_in_chain: HashMap::new(),
            chain: None,
            current: None,
            nodes,
            pending,
        });
        self.advance_compaction(part, st);
        Ok(report)
    }

    /// Starts the next move of the run (skipping what cannot start, which
    /// rolls its chain back), or ends the run when none is left.
    fn advance_compaction(&self, part: &Partition, st: &mut PartitionState) {
        loop {
            let Some(run) = st.compaction.run.as_mut() else { return };
            if run.current.is_some() {
                return;
            }
            let Some(m) = run.cursor.next_move().cloned() else {
                let run = st.compaction.run.take().expect("checked above");
                let ids: Vec<u64> = run.chain_ids.values().copied().collect();
                for id in ids {
                    self.end_chain(part, st, id, None, &run.nodes, &run.pending);
                }
                return;
            };
            let chain_id = run.chain_ids[&m.chain];
            let index = *run.next_in_chain.entry(chain_id).and_modify(|i| *i += 1).or_insert(0);
            let origin = run.origins[m.index];
            // The previous chain is over once the next one starts.
            if let Some(previous) = run.chain.replace(m.chain).filter(|&c| c != m.chain) {
                let previous_id = run.chain_ids[&previous];
                let (nodes, pending) = (run.nodes.clone(), run.pending.clone());
                self.end_chain(part, st, previous_id, None, &nodes, &pending);
            }
            match self.start_move(part, st, &m, origin) {
                Ok(new_alloc) => {
                    // What verification compares with: the task's rate where
                    // it ran, and its destination neighbours' (the agents'
                    // latest heartbeats).
                    let source = st.jobs.get(&origin.job_id).and_then(|j| j.allocations.get(origin.task)).cloned().unwrap_or_else(|| m.from.clone());
                    let dest = st.fleet.nodes()[m.to_node as usize].name.clone();
                    let progress_before_milli = st.jobs.get(&origin.job_id).and_then(|j| j.runs.get(origin.task)).and_then(super::outcome::progress_rate_milli);
                    let (rate_before_milli, neighbours_before_milli) = match self.actuator() {
                        Some(a) => (a.cpu_rate_milli(origin.alloc_id).or_else(|| a.usage(origin.alloc_id).map(|u| u.cpu_milli)), a.node_cpu_milli(&dest, new_alloc, true)),
                        None => (None, 0),
                    };
                    if let Some(r) = st.compaction.record_mut(chain_id) {
                        r.moves[index].state = MoveState::Moving;
                        r.moves[index].to_allocation = new_alloc;
                        r.moves[index].rate_before_milli = rate_before_milli.unwrap_or(0);
                        r.moves[index].neighbours_before_milli = neighbours_before_milli;
                    }
                    self.persist_logged(st.chain_op(&part.name, chain_id).into_iter().collect());
                    let run = st.compaction.run.as_mut().expect("checked above");
                    run.current = Some(InFlight {
                        chain: m.chain,
                        chain_id,
                        index,
                        job_id: origin.job_id,
                        old_alloc: origin.alloc_id,
                        new_alloc,
                        started: self.clock.now(),
                        took_over: None,
                        stopped_for: None,
                        task: origin.task,
                        source,
                        rate_before_milli,
                        progress_before_milli,
                        verify: None,
                    });
                    return;
                }
                Err(cause) => {
                    let run = st.compaction.run.as_mut().expect("checked above");
                    run.cursor.abandon(m.chain);
                    self.move_failed(part, st, chain_id, index, &cause, 0);
                }
            }
        }
    }

    /// Starts one planned move on the agents; its new copy's allocation.
    fn start_move(&self, part: &Partition, st: &mut PartitionState, m: &PlannedMove, o: Origin) -> Result<u64, String> {
        let job = st.jobs.get(&o.job_id).ok_or_else(|| format!("job {} is gone", o.job_id))?;
        let run = job.runs.get(o.task).filter(|r| r.alloc_id == o.alloc_id && r.holds).ok_or_else(|| format!("allocation {} of job {} has ended or moved", o.alloc_id, o.job_id))?;
        if job.state != JobState::Running || job.evicting || job.sleep != SleepState::Awake || run.state != super::lifecycle::TaskState::Running || job.runs.iter().any(|r| r.replaces != 0) {
            return Err(format!("job {} changed since the plan ({}, task {})", o.job_id, job.state.as_str(), run.state));
        }
        if job.allocations[o.task] != m.from {
            return Err(format!("allocation {} no longer holds what the plan moved", o.alloc_id));
        }
        let dest = st.fleet.nodes()[m.to_node as usize].name.clone();
        let moved = self.start_copy(part, st, o.job_id, o.task, &dest, m.to_node, m.to.gpus, true).map_err(|e| e.to_string())?;
        Ok(moved.alloc_id)
    }

    /// A move ended without taking over: the chain rolls back (the rest of
    /// it is skipped).
    fn move_failed(&self, part: &Partition, st: &mut PartitionState, chain_id: u64, index: usize, cause: &str, overlap_ms: u64) {
        tracing::warn!(target: "berth::serve", partition = %part.name, chain = chain_id, "compaction move rolled back: {cause}");
        self.end_move(part, st, chain_id, index, MoveState::RolledBack, cause, |mv| {
            mv.cause = cause.to_string();
            mv.overlap_ms = overlap_ms;
        });
    }

    /// Move `index` of chain `chain_id` did not stay where it went (rolled
    /// or moved back): recorded as `state` with what `fill` adds, the rest
    /// of its chain skipped, the chain ended rolled back for `chain_cause`.
    #[allow(clippy::too_many_arguments)]
    fn end_move(&self, part: &Partition, st: &mut PartitionState, chain_id: u64, index: usize, state: MoveState, chain_cause: &str, fill: impl FnOnce(&mut MoveRecord)) {
        self.metrics.compaction_moves.with_label_values(&[&part.name, state.as_str()]).inc();
        if let Some(r) = st.compaction.record_mut(chain_id) {
            let mv = &mut r.moves[index];
            mv.state = state;
            fill(mv);
            for later in r.moves.iter_mut().skip(index + 1) {
                later.state = MoveState::Skipped;
            }
        }
        let (nodes, pending) = st.compaction.run.as_ref().map(|r| (r.nodes.clone(), r.pending.clone())).unwrap_or_default();
        self.end_chain(part, st, chain_id, Some(chain_cause), &nodes, &pending);
    }

    /// Closes a chain's ledger entry (once): done, or rolled back with its cause.
    fn end_chain(&self, part: &Partition, st: &mut PartitionState, chain_id: u64, cause: Option<&str>, nodes: &[NodeId], pending: &[Wanted]) {
        if st.compaction.record_mut(chain_id).is_none_or(|r| r.state != ChainState::Running) {
            return;
        }
        let (_, idle, _) = compaction::occupancy(&st.fleet, nodes);
        let startable = compaction::startable_count(&st.fleet, nodes, pending) as u32;
        let Some(r) = st.compaction.record_mut(chain_id).filter(|r| r.state == ChainState::Running) else { return };
        r.state = if cause.is_some() { ChainState::RolledBack } else { ChainState::Done };
        r.cause = cause.unwrap_or_default().to_string();
        r.ended_unix_ms = unix_ms();
        r.idle_nodes_after = idle as u32;
        r.pending_startable_after = startable;
        let gained = i64::from(r.idle_nodes_after) - i64::from(r.idle_nodes_before);
        let state = r.state.as_str();
        self.metrics.compaction_chains.with_label_values(&[&part.name, state]).inc();
        if cause.is_none() && gained > 0 {
            self.metrics.compaction_nodes_freed.with_label_values(&[&part.name]).inc_by(gained as u64);
        }
        tracing::info!(target: "berth::serve", partition = %part.name, chain = chain_id, state, idle_nodes_gained = gained, "compaction chain ended");
        self.persist_logged(st.chain_op(&part.name, chain_id).into_iter().collect());
    }

    /// Follows the move in flight (called by the partition's scheduler on
    /// every wake-up): done once the old copy is gone and the new one took
    /// its place; rolled back once the new copy is gone; the new copy is
    /// stopped when it has not taken over within the deadline. Then the
    /// next move; with no run, the automatic triggers.
    pub(super) fn compaction_tick(&self, p: usize, st: &mut PartitionState, now: Instant) {
        let part = &self.partitions[p];
        if let Some(run) = st.compaction.run.as_mut()
            && let Some(c) = run.current.as_mut()
        {
            let job = st.jobs.get(&c.job_id);
            let wait_ready = job.is_some_and(|j| j.spec.wait_ready);
            let copy = job.and_then(|j| j.runs.iter().find(|r| r.alloc_id == c.new_alloc && r.holds));
            let elapsed_ms = now.saturating_duration_since(c.started).as_millis() as u64;
            let (verify_s, verify_margin, verify_min_cores) = (st.compaction.config.verify_s, st.compaction.config.verify_margin, st.compaction.config.verify_min_cores);
            // Verified: a task that reported progress before the move, or
            // used CPU enough for its rate to say something.
            let verifiable = verify_s > 0.0 && (c.progress_before_milli.is_some_and(|p| p > 0) || c.rate_before_milli.is_some_and(|r| f64::from(r) >= verify_min_cores * 1000.0));
            // A health signal in the window: a GPU of the new copy's taken
            // out (an XID, a driver error) sends it back at once.
            let unhealthy = copy.filter(|_| c.verify.is_some()).and_then(|r| {
                let id = *st.agent_ids.get(&r.node)?;
                let g = r.gpus.iter().find(|&&g| st.health.get(&(id, g)) == Some(&false))?;
                Some(format!("GPU {g} of {} became unhealthy during its verify window", r.node))
            });
            match copy {
                Some(r) if r.replaces == 0 && unhealthy.is_some() => {
                    let mut c = run.current.take().expect("matched above");
                    if let Some(reserved) = c.verify.take().and_then(|v| v.reserved) {
                        self.release_checked(&part.name, &mut st.fleet, &reserved, c.new_alloc);
                    }
                    let (measure, before) = match c.progress_before_milli.filter(|&p| p > 0) {
                        Some(p) => (RateMeasure::Progress, p),
                        None => (RateMeasure::Cpu, c.rate_before_milli.unwrap_or(0)),
                    };
                    let after = match measure {
                        RateMeasure::Progress => super::outcome::progress_rate_milli(r).unwrap_or(0),
                        RateMeasure::Cpu => 0,
                    };
                    let cause = unhealthy.expect("matched above");
                    self.move_back(part, st, &c, cause, (measure, before, after, 0));
                    return self.after_tick(p, st, now);
                }
                Some(r) if r.replaces == 0 && c.verify.is_none() && verifiable => {
                    // Took over: watched for verify_s with the source's GPUs
                    // kept (reserved before any pass can give them away).
                    let reserved = Allocation { cpu_milli: 0, memory_mib: 0, ..c.source.clone() };
                    let reserved = st.fleet.allocate(&reserved).ok().map(|()| reserved);
                    let cpu_ms_at = self.actuator().and_then(|a| a.usage(c.new_alloc)).map_or(0, |u| u.cpu_ms);
                    let warmup_ms = c.took_over.map_or(elapsed_ms, |t| t.saturating_duration_since(c.started).as_millis() as u64);
                    tracing::info!(target: "berth::serve", partition = %part.name, chain = c.chain_id, job = c.job_id, to = c.new_alloc, reserved = reserved.is_some(), "compaction move took over: verifying its rate");
                    c.verify = Some(Verify { since: now, cpu_ms_at, reserved, warmup_ms, overlap_ms: elapsed_ms });
                    let (chain_id, index) = (c.chain_id, c.index);
                    if let Some(rec) = st.compaction.record_mut(chain_id) {
                        rec.moves[index].state = MoveState::Verifying;
                        rec.moves[index].overlap_ms = elapsed_ms;
                        rec.moves[index].warmup_ms = warmup_ms;
                    }
                    self.persist_logged(st.chain_op(&part.name, chain_id).into_iter().collect());
                }
                // Still within its window.
                Some(r) if r.replaces == 0 && c.verify.as_ref().is_some_and(|v| now.saturating_duration_since(v.since).as_secs_f64() < verify_s) => {}
                Some(r) if r.replaces == 0 => {
                    // The old copy is gone and the new one is the task (and,
                    // when verified, kept its rate).
                    let mut c = run.current.take().expect("matched above");
                    let node = r.node.clone();
                    let progress_after = super::outcome::progress_rate_milli(r);
                    let (mut warmup_ms, mut overlap_ms) = (c.took_over.map_or(elapsed_ms, |t| t.saturating_duration_since(c.started).as_millis() as u64), elapsed_ms);
                    let mut measured = None;
                    if let Some(v) = c.verify.take() {
                        (warmup_ms, overlap_ms) = (v.warmup_ms, v.overlap_ms);
                        if let Some(reserved) = &v.reserved {
                            self.release_checked(&part.name, &mut st.fleet, reserved, c.new_alloc);
                        }
                        let window_ms = now.saturating_duration_since(v.since).as_millis().max(1) as u64;
                        let (cpu_ms, neighbours) = match self.actuator() {
                            Some(a) => (a.usage(c.new_alloc).map_or(v.cpu_ms_at, |u| u.cpu_ms), a.node_cpu_milli(&node, c.new_alloc, false)),
                            None => (v.cpu_ms_at, 0),
                        };
                        let cpu_after = (cpu_ms.saturating_sub(v.cpu_ms_at).saturating_mul(1000) / window_ms).min(u64::from(u32::MAX)) as u32;
                        // Its own work rate where it reports progress both
                        // before and after; its CPU use otherwise.
                        let (measure, before, after) = match (c.progress_before_milli.filter(|&p| p > 0), progress_after) {
                            (Some(before), Some(after)) => (RateMeasure::Progress, before, after),
                            _ => (RateMeasure::Cpu, c.rate_before_milli.unwrap_or(0), cpu_after),
                        };
                        measured = Some((measure, before, after, neighbours));
                        if f64::from(after) < f64::from(before) * (1.0 - verify_margin) {
                            let cause = format!(
                                "slower on {node}: {:.2} {unit} after the move against {:.2} before (margin {:.0}%; a {:.0} s window)",
                                f64::from(after) / 1000.0,
                                f64::from(before) / 1000.0,
                                verify_margin * 100.0,
                                window_ms as f64 / 1000.0,
                                unit = measure.unit(),
                            );
                            self.move_back(part, st, &c, cause, (measure, before, after, neighbours));
                            return self.after_tick(p, st, now);
                        }
                    }
                    st.compaction.moved_at.insert(c.new_alloc, self.now_s());
                    self.metrics.compaction_moves.with_label_values(&[&part.name, MoveState::Done.as_str()]).inc();
                    if let Some(rec) = st.compaction.record_mut(c.chain_id) {
                        let mv = &mut rec.moves[c.index];
                        mv.state = MoveState::Done;
                        mv.overlap_ms = overlap_ms;
                        mv.warmup_ms = warmup_ms;
                        if let Some((measure, before, after, neighbours)) = measured {
                            mv.rate_measure = measure.name().into();
                            mv.rate_before_milli = before;
                            mv.rate_after_milli = after;
                            mv.neighbours_after_milli = neighbours;
                        }
                        let tier = match mv.tier.as_str() {
                            "same-switch" => 0,
                            "same-aggregation" => 1,
                            _ => 2,
                        };
                        rec.bytes_by_tier[tier] += mv.state_bytes;
                    }
                    tracing::info!(target: "berth::serve", partition = %part.name, chain = c.chain_id, job = c.job_id, from = c.old_alloc, to = c.new_alloc, overlap_ms = elapsed_ms, "compaction move done");
                    self.persist_logged(st.chain_op(&part.name, c.chain_id).into_iter().collect());
                }
                Some(r) => {
                    if c.took_over.is_none() && r.serves(wait_ready) {
                        c.took_over = Some(now);
                    }
                    let deadline = Duration::from_secs_f64(st.compaction.config.destination_deadline_s);
                    if c.took_over.is_none() && c.stopped_for.is_none() && now.saturating_duration_since(c.started) > deadline {
                        let why = format!("the new copy did not take over within {} s", deadline.as_secs_f64());
                        tracing::warn!(target: "berth::serve", partition = %part.name, allocation = c.new_alloc, "compaction: {why}: stopping it");
                        c.stopped_for = Some(why);
                        if let Some(act) = self.actuator() {
                            act.stop(c.new_alloc, &r.node);
                        }
                    }
                }
                None => {
                    // The new copy is gone: rolled back (its start failed, it
                    // exited, its node was lost, or the job ended).
                    let mut c = run.current.take().expect("matched above");
                    if let Some(reserved) = c.verify.take().and_then(|v| v.reserved) {
                        self.release_checked(&part.name, &mut st.fleet, &reserved, c.new_alloc);
                        st.dirty = true;
                    }
                    run.cursor.abandon(c.chain);
                    let cause = c.stopped_for.clone().unwrap_or_else(|| match st.jobs.get(&c.job_id) {
                        Some(j) if !j.detail.is_empty() => j.detail.clone(),
                        Some(j) => format!("the new copy ended; job {} is {}", c.job_id, j.state.as_str()),
                        None => format!("job {} is gone", c.job_id),
                    });
                    self.move_failed(part, st, c.chain_id, c.index, &cause, elapsed_ms);
                }
            }
        }
        self.after_tick(p, st, now);
    }

    /// A verified move that ran slower on its destination (or whose GPU
    /// failed there): the source's GPUs are given back to the task (make-before-break again, the same
    /// migration path), the move is recorded moved back and its chain ends
    /// rolled back.
    fn move_back(&self, part: &Partition, st: &mut PartitionState, c: &InFlight, cause: String, (measure, before, after, neighbours): (RateMeasure, u32, u32, u32)) {
        tracing::warn!(target: "berth::serve", partition = %part.name, chain = c.chain_id, job = c.job_id, allocation = c.new_alloc, "compaction move failed its verification: {cause}; moving back");
        let src_name = st.fleet.nodes()[c.source.node as usize].name.clone();
        let back = self.start_copy(part, st, c.job_id, c.task, &src_name, c.source.node, c.source.gpus, true);
        let state = if back.is_ok() { MoveState::MovedBack } else { MoveState::RolledBack };
        let chain_cause = format!("move of job {} back: {cause}", c.job_id);
        let cause = match &back {
            Ok(m) => format!("{cause}; moved back to {src_name} (allocation {})", m.alloc_id),
            Err(e) => format!("{cause}; moving back failed: {e}"),
        };
        if let Some(run) = st.compaction.run.as_mut() {
            run.cursor.abandon(c.chain);
        }
        self.end_move(part, st, c.chain_id, c.index, state, &chain_cause, |mv| {
            mv.rate_measure = measure.name().into();
            mv.rate_before_milli = before;
            mv.rate_after_milli = after;
            mv.neighbours_after_milli = neighbours;
            mv.cause = cause;
        });
        st.dirty = true;
    }

    /// The end of a compaction tick: the next move, or the automatic
    /// triggers when no run is on.
    fn after_tick(&self, p: usize, st: &mut PartitionState, now: Instant) {
        let part = &self.partitions[p];
        if st.compaction.run.as_ref().is_some_and(|r| r.current.is_none()) {
            self.advance_compaction(part, st);
        }
        if st.compaction.run.is_some() || !st.compaction.auto || part.aux(PolicyHook::Compact).lock().unwrap().is_none() {
            return;
        }
        // Automatic steps: every period_s under hysteresis, and when a job
        // that needs whole nodes is blocked.
        let period = Duration::from_secs(st.compaction.config.period_s);
        let periodic_due = *st.compaction.next_periodic.get_or_insert(now + period) <= now;
        let blocked_due = st.compaction.next_blocked.is_none_or(|t| t <= now) && {
            // Which jobs wait, order aside (a requeue may put back the same count).
            let queued = st.pending.iter().fold(0u64, |h, &id| h.wrapping_add(id.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)));
            let seen = (st.fleet.state_digest(), st.pending.len(), queued);
            st.compaction.not_blocked_at != Some(seen) && {
                let blocked = st.whole_node_job_blocked();
                st.compaction.not_blocked_at = (!blocked).then_some(seen);
                blocked
            }
        };
        if periodic_due {
            st.compaction.next_periodic = Some(now + period);
            let nodes = st.agent_node_ids();
            let config = st.compaction.config.clone();
            let mut active = st.compaction.active;
            let on = compaction::hysteresis(&st.fleet, &nodes, &config, &mut active);
            st.compaction.active = active;
            if !on && !blocked_due {
                return;
            }
        } else if !blocked_due {
            return;
        }
        if blocked_due {
            st.compaction.next_blocked = Some(now + BLOCKED_RETRY);
        }
        if let Err(e) = self.compaction_step(p, part, st, false) {
            tracing::warn!(target: "berth::serve", partition = %part.name, "compaction step: {e}");
        }
    }
}

/// What a verified move's rates count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RateMeasure {
    /// The task's own progress reports (`berth progress`).
    Progress,
    /// CPU use, from the task's cgroup.
    Cpu,
}

impl RateMeasure {
    fn name(self) -> &'static str {
        match self {
            RateMeasure::Progress => "progress",
            RateMeasure::Cpu => "cpu",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            RateMeasure::Progress => "work units/s",
            RateMeasure::Cpu => "cores",
        }
    }
}
