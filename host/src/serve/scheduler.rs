//! The live fleet and its schedulers: one thread per partition walks the
//! partition's queue (priority, then arrival) whenever something changed,
//! and decides each job through the core's `place_gang`, the same path as
//! replay. Jobs end after their duration in real time.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_core::engine::Event;

use super::state::{JobState, Live, PartitionState, SleepState};

/// How often ended jobs are taken out of a partition's engine.
const FORGET_EVERY: Duration = Duration::from_secs(1);
/// How soon a stop that did not reach its node is sent again.
const STOP_RETRY: Duration = Duration::from_secs(5);
/// How often queued heartbeats are taken in, at most (real time).
const BEAT_BATCH: Duration = Duration::from_millis(10);

/// A job's detail once its time limit stopped it.
pub(crate) const TIME_LIMIT_STOPPED: &str = "time limit reached: stopped";
/// A job's detail once its opportunistic budget ran out.
pub(crate) const BUDGET_SPENT: &str = "budget spent: stopped";

impl Live {
    /// Stops the scheduler threads (they finish the decision in hand).
    pub fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        for p in &self.partitions {
            p.poke(false);
        }
    }

    /// The scheduler of partition `p`; returns at shutdown.
    pub fn run_partition(&self, p: usize) {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        while !self.shutdown.load(Ordering::SeqCst) {
            st.flush_capture();
            let now = self.clock.now();
            // Agents' reports every turn; heartbeats in batches. The beats
            // are taken first and the reports after, and the reports go in
            // first: a report that came before a beat is never judged by it
            // (an exit is not taken for a lost task).
            let beats_due = st.beats_taken.is_none_or(|t| t.elapsed() >= BEAT_BATCH) && !part.beats.lock().unwrap().is_empty();
            let beats = if beats_due { part.beats.lock().unwrap().take() } else { Vec::new() };
            self.take_reports(part, &mut st);
            if beats_due {
                self.reconcile_beats(part, &mut st, beats);
                st.beats_taken = Some(Instant::now());
            }
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
            self.retry_unstored_wakes(part, &mut st);
            self.requeue_unstarted(part, &mut st);
            // Heartbeats are taken in at the top, once per turn: a fleet's
            // steady stream of them must not keep the pass from running.
            if part.jobs_waiting() {
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
                let started = std::time::Instant::now();
                self.pass(p);
                let took = started.elapsed();
                part.pass_times.lock().unwrap().push(took);
                self.metrics.pass_seconds.with_label_values(&[&part.name]).observe(took.as_secs_f64());
                part.deciding.store(false, Ordering::SeqCst);
                st = part.lock_state();
                st.in_pass = false;
                continue;
            }
            st.swept_at = Some(now);
            let until = st.next_due(now).unwrap_or(now + Duration::from_secs(1));
            let mut wait = until.saturating_duration_since(now).clamp(Duration::from_millis(1), Duration::from_secs(1));
            if part.reports_waiting() {
                // Came in this turn: taken in after the shortest wait (which
                // lets go of the state for the callers waiting on it).
                wait = Duration::from_millis(1);
            }
            if !part.beats.lock().unwrap().is_empty() {
                // Heartbeats wait for the next batch.
                let next = st.beats_taken.map_or(Duration::ZERO, |t| BEAT_BATCH.saturating_sub(t.elapsed()));
                wait = wait.min(next.max(Duration::from_millis(1)));
            }
            st = part.wake.wait_timeout(st, wait).unwrap().0;
        }
        st.flush_capture();
        if let Some(c) = st.capture.as_mut() {
            c.sync();
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
    /// its clock's now (nothing waits in the inbox, the loop has run its
    /// timers (stops, ends, ticks) at this instant, no pass is running or
    /// wanted, no end or modelled vacate time is due).
    pub fn settled(&self, p: usize) -> bool {
        let part = &self.partitions[p];
        if part.inbox_waiting() {
            return false;
        }
        let st = part.lock_state();
        let now = self.clock.now();
        st.swept_at.is_some_and(|t| t >= now) && !st.in_pass && !st.wants_pass(now) && st.running.first().is_none_or(|(t, _)| *t > now) && st.engine.next_wakeup().is_none_or(|t| t > self.now_s())
    }

    /// The next moment something is due in partition `p` on its own (a
    /// run's planned end, an evicted job's modelled vacate time), in
    /// seconds on the host's clock.
    pub fn next_due_s(&self, p: usize) -> Option<u64> {
        let st = self.partitions[p].lock_state();
        let now = self.clock.now();
        st.next_due(now).map(|t| self.now_s() + t.saturating_duration_since(now).as_millis().div_ceil(1000) as u64)
    }

    /// Stops preempted processes whose notice ran out. A stop that does
    /// not reach its node (not connected yet after a restart, or away) is
    /// tried again while the process still holds its GPUs: dropped, the
    /// victim would run on and its preemptor wait for it forever.
    fn due_stops(&self, st: &mut PartitionState, now: Instant) {
        if st.stops.iter().all(|s| s.0 > now) {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut st.stops).into_iter().partition(|s| s.0 <= now);
        st.stops = later;
        let Some(act) = self.actuator() else { return };
        for (_, alloc, node) in due {
            if !act.stop(alloc, &node) && st.by_alloc.contains_key(&alloc) {
                st.stops.push((now + STOP_RETRY, alloc, node));
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
            // (Within the second its end was rounded to, at its GPUs.)
            let slack_ms = (job.spec.job.gpus_held() * 1000.0) as u64 + 1000;
            let budget_spent = job.spec.budget_gpu_s > 0 && job.charged_gpu_ms_at(self.now_ms()).saturating_add(slack_ms) >= job.spec.budget_gpu_s.saturating_mul(1000);
            if !job.runs.is_empty() {
                // A time limit: stop the processes; their exits free the GPUs.
                // The job keeps its stored end: a host restarted before they
                // are gone finds it past and stops them again.
                job.detail = if budget_spent { BUDGET_SPENT } else { TIME_LIMIT_STOPPED }.into();
                job.time_limit_stop = true;
                job.budget_stop = budget_spent;
                if let Some(act) = self.actuator() {
                    for r in job.runs.iter().filter(|r| r.holds) {
                        act.stop(r.alloc_id, &r.node);
                    }
                }
                // On its way out: nobody's victim (a preemption would
                // queue it to run again), not moved, not put to sleep.
                if let Some(&slot) = st.slots.get(&id) {
                    st.engine.apply(&mut st.fleet, self.now_s(), Event::Leaving(slot));
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
            job.close_run(self.now_ms());
            if budget_spent {
                job.detail = BUDGET_SPENT.into();
            }
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

}
