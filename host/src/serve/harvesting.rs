//! Sleep-state harvesting, live. An operator puts a running job (an
//! inference replica in a demand trough, say) to sleep; its agents run the
//! sleep hook (SIGSTOP by default; e.g. an inference server's own sleep
//! endpoint) and report its tasks asleep, and only then does the engine
//! lend its GPUs to low-priority work. On wake the engine takes the
//! borrowers back under their priority contracts; the job's tasks are
//! woken once the borrowers' processes are gone, so a GPU never has two
//! users. The engine's sleep and wake are replay's (`Event::SleepJob`,
//! `Event::WakeJob`); this module turns them into agent commands.

use std::collections::HashMap;

use berth_core::engine::Event;

use super::decisions::DecisionRecord;
use super::state::{JobState, Live, Partition, PartitionState, SleepState};
use super::error::ServeError;

impl Live {
    /// Asks running job `id` of partition `p` to sleep; returns where it is
    /// now (a job without processes sleeps at once).
    pub fn sleep_job(&self, p: usize, id: u64) -> Result<SleepState, ServeError> {
        let part = &self.partitions[p];
        self.sleep_locked(part, &mut part.lock_state(), id)
    }

    fn sleep_locked(&self, part: &Partition, st: &mut PartitionState, id: u64) -> Result<SleepState, ServeError> {
        let job = st.jobs.get(&id).ok_or(ServeError::UnknownJob(id))?;
        let refuse = |why: String| Err(ServeError::FailedPrecondition(format!("job {id} cannot sleep: {why}")));
        if job.state != JobState::Running {
            return refuse(format!("it is {}", job.state.as_str()));
        }
        if job.sleep != SleepState::Awake {
            return refuse(format!("it is {} already", job.sleep.as_str()));
        }
        if job.evicting || !job.waiting_on.is_empty() {
            return refuse("it waits for preempted work to stop".into());
        }
        if job.runs.iter().any(|r| r.replaces != 0) {
            return refuse("a task of it is being migrated".into());
        }
        if let Some(r) = job.runs.iter().find(|r| r.holds && r.state != super::lifecycle::TaskState::Running) {
            return refuse(format!("its task on {} is {}", r.node, r.state));
        }
        let Some(&slot) = st.slots.get(&id) else { return refuse("it is not in the engine".into()) };
        if !st.engine.can_sleep(slot) {
            return refuse("it holds a share of a GPU; only whole GPUs are lent".into());
        }
        if job.runs.is_empty() {
            // No processes to tell: it sleeps now.
            self.fall_asleep(part, st, id);
            return Ok(st.jobs[&id].sleep);
        }
        if self.actuator().is_none() {
            return Err(ServeError::FailedPrecondition("no agent hub".into()));
        }
        let job = st.jobs.get_mut(&id).expect("found above");
        self.tell_tasks(job, false);
        job.sleep = SleepState::Asked;
        job.last_decision = "asked to sleep: its GPUs are lent once every task reports asleep".into();
        tracing::info!(target: "berth::serve", job = id, "asked to sleep");
        self.persist_logged(vec![st.job_op(&part.name, id)]);
        Ok(SleepState::Asked)
    }

    /// Wakes job `id`: a sleep not yet confirmed is called off; an asleep
    /// job gets its GPUs back (borrowers evicted under their contracts)
    /// and its tasks are woken once the borrowers are gone.
    /// A wake the store refused to record is an error to the caller (the
    /// job stays waking, and wakes once the record is stored; a host
    /// restarted before then finds it asleep, as the store says).
    pub fn wake_job(&self, p: usize, id: u64) -> Result<SleepState, ServeError> {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        let now = self.wake_locked(part, &mut st, id)?;
        if st.unstored_wakes.contains(&id) {
            let why = st.jobs.get(&id).map(|j| j.last_decision.clone()).unwrap_or_default();
            return Err(ServeError::Store(std::io::Error::other(format!("job {id}: {why}; a host restarted before then finds it asleep"))));
        }
        Ok(now)
    }

    fn wake_locked(&self, part: &Partition, st: &mut PartitionState, id: u64) -> Result<SleepState, ServeError> {
        let job = st.jobs.get_mut(&id).ok_or(ServeError::UnknownJob(id))?;
        if job.state != JobState::Running {
            return Err(ServeError::FailedPrecondition(format!("job {id} is {}", job.state.as_str())));
        }
        match job.sleep {
            SleepState::Awake => Err(ServeError::FailedPrecondition(format!("job {id} is not asleep"))),
            SleepState::Waking => Ok(SleepState::Waking),
            SleepState::Asked => {
                // Its GPUs were never lent: wake what fell asleep.
                job.sleep = SleepState::Awake;
                job.last_decision = "sleep called off".into();
                self.tell_tasks(job, true);
                self.persist_logged(vec![st.job_op(&part.name, id)]);
                Ok(SleepState::Awake)
            }
            SleepState::Asleep => {
                let Some(&slot) = st.slots.get(&id) else { return Err(ServeError::FailedPrecondition(format!("job {id} is not in the engine"))) };
                st.engine.apply(&mut st.fleet, self.now_s(), Event::WakeJob(slot));
                self.apply_announced(part, st);
                st.dirty = true;
                part.wake.notify_all();
                Ok(st.jobs.get(&id).map_or(SleepState::Awake, |j| j.sleep))
            }
        }
    }

    /// The partition's harvest schedule: at the trough's start its share of
    /// the running `sleepable` jobs (a stable draw per job and day, as in
    /// replay) is asked to sleep; at its end every sleeping `sleepable` job
    /// wakes. Boundaries are seen once, when the clock passes them.
    pub(super) fn harvest_tick(&self, part: &Partition, st: &mut PartitionState) {
        let Some(h) = st.harvest else { return };
        let now = st.now_s();
        let Some(last) = st.harvest_seen_s.replace(now) else { return };
        let (at, wake) = h.next_boundary(Some(last));
        if at > now {
            return;
        }
        let ids: Vec<u64> = st
            .jobs
            .iter()
            .filter(|(_, j)| j.state == JobState::Running && j.spec.sleepable)
            .filter(|(id, j)| if wake { matches!(j.sleep, SleepState::Asleep | SleepState::Asked) } else { j.sleep == SleepState::Awake && h.sleeps(**id, at / 86_400) })
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let r = if wake { self.wake_locked(part, st, id) } else { self.sleep_locked(part, st, id) };
            match r {
                Ok(now) => tracing::info!(target: "berth::serve", partition = %part.name, job = id, "harvest schedule: {}", now.as_str()),
                Err(e) => tracing::info!(target: "berth::serve", partition = %part.name, job = id, "harvest schedule: {e}"),
            }
        }
    }

    /// An agent reported a task asleep: once all of them are, and their
    /// GPU memory is released, the job's GPUs are lent. A job asleep whose
    /// memory is still held lends nothing (a borrower would not fit beside
    /// it); it stays asked to sleep until woken or cancelled.
    pub(crate) fn task_slept(&self, part: &Partition, st: &mut PartitionState, id: u64) {
        let Some(job) = st.jobs.get_mut(&id) else { return };
        if job.state != JobState::Running || job.sleep != SleepState::Asked || !job.runs.iter().filter(|r| r.holds).all(|r| r.state == super::lifecycle::TaskState::Sleeping) {
            return;
        }
        let limit = self.lend_max_memory_mib;
        if let Some(r) = job.runs.iter().filter(|r| r.holds).max_by_key(|r| r.gpu_memory_held_mib).filter(|r| r.gpu_memory_held_mib > limit) {
            job.last_decision = format!(
                "asleep, GPUs not lent: task {} on {} still uses {} MiB of GPU memory on one GPU (at most {limit} MiB may stay for its GPUs to be lent); a sleep that releases GPU memory (the agent's --sleep-hook) lets them be lent",
                r.alloc_id, r.node, r.gpu_memory_held_mib
            );
            let detail = job.last_decision.clone();
            self.metrics.harvest.with_label_values(&[&part.name, "lend_refused"]).inc();
            tracing::warn!(target: "berth::serve", job = id, "{detail}");
            self.log_harvest(part, id, "not-lent", detail);
            return;
        }
        self.fall_asleep(part, st, id);
    }

    fn fall_asleep(&self, part: &Partition, st: &mut PartitionState, id: u64) {
        let Some(&slot) = st.slots.get(&id) else { return };
        st.engine.apply(&mut st.fleet, self.now_s(), Event::SleepJob(slot));
        self.apply_announced(part, st);
        st.dirty = true;
        part.wake.notify_all();
    }

    /// Actuates what the engine decided while applying an event outside a
    /// pass (a sleep, a wake and the evictions it made).
    fn apply_announced(&self, part: &Partition, st: &mut PartitionState) {
        for d in st.engine.take_announced() {
            self.apply_decision(part, st, d, &HashMap::new(), None, 0);
        }
    }

    /// The engine lent a job's GPUs.
    pub(super) fn fell_asleep(&self, part: &Partition, st: &mut PartitionState, id: u64, gpus: u32) {
        let Some(job) = st.jobs.get_mut(&id) else { return };
        job.sleep = SleepState::Asleep;
        job.last_decision = format!("asleep: {gpus} GPU(s) lent to low-priority work until it wakes");
        self.metrics.harvest.with_label_values(&[&part.name, "sleep"]).inc();
        self.log_harvest(part, id, "asleep", job.last_decision.clone());
        tracing::info!(target: "berth::serve", job = id, gpus, "asleep: GPUs lent");
        self.persist_logged(vec![st.job_op(&part.name, id)]);
    }

    /// The engine gave a waking job its GPUs back (or could not).
    pub(super) fn woke(&self, part: &Partition, st: &mut PartitionState, id: u64, victims: Vec<u64>, requeued: bool) {
        self.metrics.harvest.with_label_values(&[part.name.as_str(), if requeued { "wake_failure" } else { "wake" }]).inc();
        let waiting_on: Vec<u64> = victims.iter().copied().filter(|v| st.jobs.get(v).is_some_and(|j| j.evicting)).collect();
        if !st.jobs.contains_key(&id) {
            return;
        }
        if requeued {
            // A hold or an operator's allocation took one of its GPUs: its
            // processes stop and it runs again from the queue, like a
            // preempted job (once they are gone).
            self.send_back(part, st, id, "woke without its GPUs (held or taken while lent): requeued".into(), None, Vec::new());
            self.log_harvest(part, id, "wake-failed", st.jobs[&id].detail.clone());
            tracing::warn!(target: "berth::serve", job = id, "{}", st.jobs[&id].detail);
            self.persist_logged(vec![st.job_op(&part.name, id)]);
            return;
        }
        let Some(job) = st.jobs.get_mut(&id) else { return };
        job.sleep = SleepState::Waking;
        job.last_decision = format!("waking: its GPUs back once {} borrower(s) are gone", waiting_on.len());
        job.waiting_on.extend(waiting_on);
        job.waiting_on.sort_unstable();
        job.waiting_on.dedup();
        self.log_harvest(part, id, "waking", format!("borrowers evicted: {victims:?}"));
        if job.waiting_on.is_empty() {
            self.finish_wake(part, st, id);
        } else {
            self.persist_logged(vec![st.job_op(&part.name, id)]);
        }
    }

    /// Nothing else runs on a waking job's GPUs any more: its tasks wake.
    /// Stored before the tasks are told: a host restarted from a record
    /// that still says asleep lends the job's GPUs, and its woken processes
    /// would share them with the borrowers. A refused write leaves the job
    /// waking, tried again by [`Live::retry_unstored_wakes`].
    pub(super) fn finish_wake(&self, part: &Partition, st: &mut PartitionState, id: u64) {
        let Some(job) = st.jobs.get_mut(&id) else { return };
        job.sleep = SleepState::Awake;
        let stored = self.persist(vec![st.job_op(&part.name, id)]);
        let Some(job) = st.jobs.get_mut(&id) else { return };
        match stored {
            Ok(()) => {
                job.last_decision = "awake on its own GPUs".into();
                self.tell_tasks(job, true);
                tracing::info!(target: "berth::serve", job = id, "woken on its GPUs");
                st.unstored_wakes.remove(&id);
            }
            Err(e) => {
                job.sleep = SleepState::Waking;
                job.last_decision = format!("waking: its GPUs are its own again; its tasks wake once that is stored ({e})");
                tracing::warn!(target: "berth::serve", job = id, "{}", job.last_decision);
                st.unstored_wakes.insert(id);
            }
        }
    }

    /// Finishes the wakes whose record the store refused (see
    /// [`Live::finish_wake`]); a job ended or sent back since is dropped.
    pub(super) fn retry_unstored_wakes(&self, part: &Partition, st: &mut PartitionState) {
        if st.unstored_wakes.is_empty() {
            return;
        }
        for id in std::mem::take(&mut st.unstored_wakes) {
            let ready = st.jobs.get(&id).is_some_and(|j| j.state == JobState::Running && j.sleep == SleepState::Waking && j.waiting_on.is_empty() && !j.runs.is_empty());
            if ready {
                self.finish_wake(part, st, id);
            }
        }
    }

    /// Sends each task of `job` that holds its GPUs the agent's sleep or
    /// wake command.
    fn tell_tasks(&self, job: &super::state::JobRecord, wake: bool) {
        if let Some(act) = self.actuator() {
            for r in job.runs.iter().filter(|r| r.holds) {
                act.sleep(r.alloc_id, &r.node, wake);
            }
        }
    }

    fn log_harvest(&self, part: &Partition, job_id: u64, outcome: &str, detail: String) {
        self.decisions.append(DecisionRecord {
            id: 0,
            unix_ms: self.now_ms(),
            partition: part.name.clone(),
            job_id,
            actor: "harvest".into(),
            arm: "harvest".into(),
            actuated: true,
            policy: "harvest".into(),
            policy_semver: String::new(),
            policy_version: 0,
            sha256: String::new(),
            input_digest: String::new(),
            outcome: outcome.into(),
            detail,
            placements: Vec::new(),
            latency_us: 0,
        });
    }
}
