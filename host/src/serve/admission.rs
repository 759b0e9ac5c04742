//! What enters and leaves a partition's queue by request: a submission
//! (with its idempotency key) and a cancel.

use std::sync::atomic::Ordering;
use std::time::Duration;

use berth_core::engine::Event;

use super::error::ServeError;
use super::persist::job_record_op;
use super::state::{IdempotencyKey, JobRecord, JobSpec, JobState, KeyedJob, Live, SleepState, MAX_IDEMPOTENCY_KEY};

/// Longest a retry waits for the first submission with its key.
const KEYED_WAIT: Duration = Duration::from_secs(30);

impl Live {
    /// Accepts a job into its partition's queue; the id is the caller's
    /// receipt: from here on the job is never dropped. With an idempotency
    /// key that `owner` used before for a job still kept, nothing new is
    /// made: the answer is that job's id and `true`.
    pub fn submit(&self, mut spec: JobSpec, owner: &str, idempotency: Option<IdempotencyKey>) -> Result<(u64, bool), ServeError> {
        let p = self.partition_index(&spec.partition)?;
        if self.pool_partitions.contains(&spec.partition) {
            return Err(ServeError::FailedPrecondition(format!("partition {} is a model pool: it serves requests (/v1/completions), not jobs", spec.partition)));
        }
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
            work: Default::default(),
            time_limit_stop: false,
            budget_stop: false,
            evicting: false,
            waiting_on: Vec::new(),
            charged_gpu_ms: 0,
            interruptions: 0,
            interrupted_s: Vec::new(),
            reserved_until_s: 0,
            sleep: SleepState::Awake,
            idempotency_key: idempotency.as_ref().map(|k| k.key.clone()).unwrap_or_default(),
            spec_digest: idempotency.as_ref().map(|k| k.digest.clone()).unwrap_or_default(),
        };
        // The id is a receipt only once the job is stored. A pending job
        // holds no allocations, so its record names no node.
        let stored = self.persist(vec![job_record_op(&*self.clock, &part.name, id, &record, |_| unreachable!("a new job holds nothing"))]);
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
        let job = st.jobs.get(&id).ok_or(ServeError::UnknownJob(id))?;
        let before = job.state;
        if before.is_ended() {
            return Err(ServeError::FailedPrecondition(format!("job {id} is already {}", before.as_str())));
        }
        // Stored before anything is done, or not done at all: a cancel that
        // was acknowledged survives a restart (a running job's stops would
        // otherwise be forgotten, and the job taken back as running).
        let mut after = job.clone();
        after.close_run(self.now_ms());
        after.state = JobState::Cancelled;
        // An asleep (or still waking) job's GPUs stay lent until its frozen
        // processes are gone (they are killed, never woken onto them): the
        // stored record says asleep, and a restart does not fence GPUs its
        // borrowers hold.
        after.sleep = if after.sleep.frozen() { SleepState::Asleep } else { SleepState::Awake };
        after.ended_unix_ms = self.now_ms();
        after.ends_at = None;
        if before == JobState::Running && after.runs.is_empty() {
            after.waiting_on.clear();
            if job.waiting_on.is_empty() {
                after.allocations.clear();
            }
        }
        self.persist(vec![job_record_op(&*self.clock, &part.name, id, &after, |a| st.alloc_out(a))])?;
        let job = st.jobs.get_mut(&id).expect("found above");
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
                } else {
                    if let Some(act) = self.actuator() {
                        for r in job.runs.iter().filter(|r| r.holds) {
                            act.stop(r.alloc_id, &r.node);
                        }
                    }
                    // Until its processes are gone it holds their GPUs, and
                    // is nobody's victim (a preemption would queue it again).
                    if let Some(slot) = slot {
                        st.engine.apply(&mut st.fleet, self.now_s(), Event::Leaving(slot));
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
            JobState::Finished | JobState::Failed | JobState::Cancelled => {} // refused above
        }
        // The record is the one stored above (the branches changed the
        // engine and the timers, and the same fields of the record).
        st.jobs.insert(id, after);
        self.metrics.jobs.with_label_values(&[&part.name, before.as_str()]).dec();
        self.metrics.jobs.with_label_values(&[&part.name, "cancelled"]).inc();
        st.dirty = true;
        part.wake.notify_all();
        Ok(before)
    }
}
