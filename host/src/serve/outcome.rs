//! The outcome: completed work, not busy GPUs (ASI's accounting rule).
//!
//! A task reports its work with `berth progress UNITS` (relayed by its
//! agent as a running count for the run); a job's spec names the unit. Each
//! job keeps a tally of work done and of work lost — done after a run's
//! last checkpoint by a run that was preempted, migrated, failed or lost
//! with its node, so done again after. The outcome divides goodput (done
//! minus lost) by the installed GPU-hours, and by their cost where the
//! fleet config prices GPU models (`cost_per_gpu_hour`).
//!
//! The tallies are stored with their job (the run's count and the job's
//! tally in one record, so a restarted host neither loses nor doubles a
//! report: the agent's next running count is compared with the stored
//! one); work of jobs removed by retention is kept per tenant, class and
//! unit under `outcome/<partition>`, written with the removal, beside when
//! the partition was first started.

use std::collections::BTreeMap;

use berth_core::accounting::{self, Work};
use berth_core::NodeId;

use super::state::{JobRecord, Live, PartitionState, TaskRun};
use super::work::{unit_name, OutcomeKey, WorkTally};

/// Takes run `run`'s running count `units` in: what is new is done. A
/// count below the known one (a task that reset its counter) adds nothing
/// until it passes it. Returns the units new.
pub fn take_progress(run: &mut TaskRun, work: &mut WorkTally, units: u64) -> u64 {
    // A task's count is its own to write: capped, so one task cannot
    // saturate the tallies it shares with others.
    let units = units.min(MAX_RUN_UNITS);
    let new = units.saturating_sub(run.work_units);
    if new > 0 {
        work.done = work.done.saturating_add(new);
        run.work_units = units;
    }
    new
}

/// A run's work rate from its progress reports, in thousandths of a unit
/// per second: None until two reports at least a second apart.
pub fn progress_rate_milli(run: &TaskRun) -> Option<u32> {
    let ((t0, u0), (t1, u1)) = (run.progress_first?, run.progress_last?);
    (t1 >= t0 + 1000).then(|| (u1.saturating_sub(u0).saturating_mul(1_000_000) / (t1 - t0)).min(u64::from(u32::MAX)) as u32)
}

/// Most units one run may count (2^53: exact in a float, and a bound on
/// what one task adds to shared tallies and counters).
pub const MAX_RUN_UNITS: u64 = 1 << 53;

/// The task says its last checkpoint saved `units` of its count (0: it
/// does not say): kept, never beyond what it reported done.
pub fn saved(run: &mut TaskRun, units: u64) {
    let units = units.min(run.work_units);
    if units > run.work_checkpointed {
        run.work_checkpointed = units;
    }
}

/// The run saved its work (a checkpoint): what it did so far is kept.
pub fn checkpoint(run: &mut TaskRun) {
    run.work_checkpointed = run.work_units;
}

/// The run's work since its last checkpoint is lost: it will be done
/// again. Returns the units lost.
pub fn lose_unsaved(run: &mut TaskRun, work: &mut WorkTally) -> u64 {
    let lost = run.work_units.saturating_sub(run.work_checkpointed);
    work.lost = work.lost.saturating_add(lost);
    run.work_checkpointed = run.work_units;
    lost
}

impl Live {
    /// Counts `run`'s work since its last checkpoint as lost, in its job's
    /// tally `work` and in the metrics (`unit`: the job's, as submitted).
    pub(super) fn count_lost(&self, partition: &str, unit: &str, run: &mut TaskRun, work: &mut WorkTally) {
        let lost = lose_unsaved(run, work);
        self.metrics.work(partition, unit_name(unit), 0, lost);
    }
}

/// A job's group: its owner, its class ("high" at or above the partition's
/// high priority, else "low") and its unit.
pub fn key_of(job: &JobRecord, high_priority: u32) -> OutcomeKey {
    let class = if job.spec.job.priority >= high_priority { "high" } else { "low" };
    (job.owner.clone(), class.to_string(), unit_name(&job.spec.work_unit).to_string())
}

/// Installed GPU-hours of a partition at `now_ms`, and their cost when
/// `cost_per_gpu_hour` prices every model present (keys lower-case).
pub fn installed(st: &PartitionState, now_ms: u64, cost_per_gpu_hour: &BTreeMap<String, f64>) -> (f64, Option<f64>) {
    // Each node since it joined (simulated nodes: since the partition's
    // first start).
    accounting::installed_gpu_hours(&st.fleet, cost_per_gpu_hour, &|i| {
        let since = st.outcome.joined_unix_ms.get(&(i as NodeId)).copied().unwrap_or(st.outcome.started_unix_ms);
        now_ms.saturating_sub(since) as f64 / 3_600_000.0
    })
}

/// Work per group of partition `st`: its jobs' and the retired.
pub fn work_by_key(st: &PartitionState) -> BTreeMap<OutcomeKey, WorkTally> {
    let mut by = st.outcome.retired.clone();
    let high = st.engine.config.high_priority;
    for j in st.jobs.values().filter(|j| j.work != WorkTally::default()) {
        by.entry(key_of(j, high)).or_default().add(&j.work);
    }
    by
}

/// One outcome row: work of `group` in `unit` against the installed hours.
pub fn row(group: String, unit: &str, work: &WorkTally, hours: f64, cost: Option<f64>) -> crate::proto::OutcomeRow {
    let o = accounting::outcome(Work { done: work.done as f64, lost: work.lost as f64 }, hours, cost);
    crate::proto::OutcomeRow {
        group,
        unit: unit.to_string(),
        done: work.done,
        lost: work.lost,
        goodput: work.done.saturating_sub(work.lost),
        installed_gpu_hours: hours,
        per_installed_gpu_hour: o.per_installed_gpu_hour,
        has_cost: o.cost.is_some(),
        cost: o.cost.unwrap_or(0.0),
        per_cost: o.per_cost.unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_counts_what_is_new_and_loss_what_no_checkpoint_saved() {
        let mut run = TaskRun::starting(1, "n".into(), vec![0]);
        let mut work = WorkTally::default();
        take_progress(&mut run, &mut work, 40);
        checkpoint(&mut run);
        take_progress(&mut run, &mut work, 65);
        // A repeated or smaller count adds nothing.
        take_progress(&mut run, &mut work, 65);
        take_progress(&mut run, &mut work, 10);
        assert_eq!(work, WorkTally { done: 65, lost: 0 });
        lose_unsaved(&mut run, &mut work);
        assert_eq!(work, WorkTally { done: 65, lost: 25 });
        // Lost once: a second call finds nothing unsaved.
        lose_unsaved(&mut run, &mut work);
        assert_eq!(work.lost, 25);
    }

    #[test]
    fn a_task_says_what_its_checkpoint_saved_and_its_count_is_capped() {
        let mut run = TaskRun::starting(1, "n".into(), vec![0]);
        let mut work = WorkTally::default();
        take_progress(&mut run, &mut work, 100);
        // Saved 60 of them (work after the checkpoint stays unsaved); never
        // more than it reported, never backwards.
        saved(&mut run, 60);
        saved(&mut run, 500);
        assert_eq!(run.work_checkpointed, 100);
        saved(&mut run, 10);
        assert_eq!(run.work_checkpointed, 100);
        let mut run = TaskRun::starting(2, "n".into(), vec![0]);
        take_progress(&mut run, &mut work, 100);
        saved(&mut run, 60);
        assert_eq!(lose_unsaved(&mut run, &mut work), 40);
        assert_eq!(take_progress(&mut run, &mut work, u64::MAX), MAX_RUN_UNITS - 100);
    }
}
