//! What a long-lived host keeps of work that ended. Ended jobs leave memory
//! and the store after a retention (a time and a count per partition), so a
//! host that ran millions of jobs holds about as much as one that ran the
//! retained number; their idempotency keys leave with them. The decision
//! log rotates by size ([`super::decisions`]); the agent hub keeps a bounded
//! number of ended allocations ([`super::hub`]).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::outcome;
use super::work::{self, OutcomeKey, WorkTally};
use super::persist::{job_id_floor_key, job_key};
use super::state::{Live, Partition, PartitionState, Retention};
use crate::store::Op;

/// How often partitions look for ended jobs past retention.
pub(crate) const PRUNE_EVERY: Duration = Duration::from_secs(2);

/// Deletes per store write (etcd refuses transactions of more than 128 ops).
const DELETES_PER_WRITE: usize = 64;

impl PartitionState {
    /// Ended jobs past `retention` at `now_ms`, oldest end first. A job
    /// whose processes may still run (a task holding its GPUs, an evicted
    /// job stopping), one still in the engine, or one a live job waits for
    /// is kept whatever its age.
    pub(crate) fn expired_jobs(&self, now_ms: u64, retention: &Retention) -> Vec<u64> {
        let awaited: HashSet<u64> = self.jobs.values().filter(|j| !j.state.is_ended()).flat_map(|j| j.waiting_on.iter().copied()).collect();
        let mut candidates: Vec<(u64, u64)> = self
            .jobs
            .iter()
            .filter(|(id, j)| j.state.is_ended() && !j.evicting && j.runs.iter().all(|r| !r.holds) && !self.slots.contains_key(id) && !awaited.contains(id))
            .map(|(&id, j)| (j.ended_unix_ms, id))
            .collect();
        let cutoff = now_ms.saturating_sub(retention.ended_for.as_millis() as u64);
        let over = candidates.len().saturating_sub(retention.ended_max);
        if over == 0 && candidates.iter().all(|&(at, _)| at > cutoff) {
            return Vec::new();
        }
        candidates.sort_unstable();
        candidates.iter().enumerate().take_while(|&(i, &(at, _))| i < over || at <= cutoff).map(|(_, &(_, id))| id).collect()
    }

    /// Takes job `id` out of memory: its record and its allocation ids (a
    /// late report about one is then an orphan's, stopped on sight).
    fn drop_job(&mut self, id: u64) -> Option<super::state::JobRecord> {
        let record = self.jobs.remove(&id)?;
        for r in &record.runs {
            if self.by_alloc.get(&r.alloc_id) == Some(&id) {
                self.by_alloc.remove(&r.alloc_id);
            }
        }
        Some(record)
    }
}

impl Live {
    /// Removes partition `part`'s ended jobs past retention, from the store
    /// first: a job still in memory whose record could not be deleted is
    /// tried again at the next round, never lost from one and kept in the
    /// other. Returns how many left.
    pub(crate) fn prune_ended(&self, part: &Partition, st: &mut PartitionState) -> usize {
        let expired = st.expired_jobs(self.now_ms(), &self.retention);
        let mut pruned = 0;
        for chunk in expired.chunks(DELETES_PER_WRITE) {
            let highest = chunk.iter().copied().max().unwrap_or(0);
            let floor = self.pruned_job_floor.fetch_max(highest, Ordering::SeqCst).max(highest);
            let mut ops: Vec<Op> = chunk.iter().map(|&id| Op::Delete(job_key(&part.name, id))).collect();
            ops.push(Op::Put(job_id_floor_key(&part.name), floor.to_string().into_bytes()));
            // Their work stays counted in the outcome, written with their
            // removal (never both or neither).
            let high = st.engine.config.high_priority;
            let worked: Vec<(OutcomeKey, WorkTally)> =
                chunk.iter().filter_map(|id| st.jobs.get(id)).filter(|j| j.work != WorkTally::default()).map(|j| (outcome::key_of(j, high), j.work)).collect();
            if !worked.is_empty() {
                ops.push(Op::Put(work::retired_key(&part.name), st.outcome.stored_with(worked.iter().map(|(k, w)| (k.clone(), w)))));
            }
            if self.persist(ops).is_err() {
                break;
            }
            for (k, w) in worked {
                st.outcome.retired.entry(k).or_default().add(&w);
            }
            for &id in chunk {
                if let Some(record) = st.drop_job(id) {
                    self.metrics.jobs.with_label_values(&[&part.name, record.state.as_str()]).dec();
                    if !record.idempotency_key.is_empty() {
                        self.forget_idempotency_key(&record.owner, &record.idempotency_key, id);
                    }
                    pruned += 1;
                }
            }
        }
        if pruned > 0 {
            self.metrics.jobs_pruned.with_label_values(&[&part.name]).inc_by(pruned as u64);
            tracing::debug!(target: "berth::serve", partition = %part.name, pruned, "ended jobs past retention removed");
        }
        pruned
    }
}
