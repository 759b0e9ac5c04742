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

use std::collections::{BTreeMap, BTreeSet, HashMap};

use berth_core::accounting::{self, Work};
use berth_core::NodeId;
use serde::{Deserialize, Serialize};

use super::state::{JobRecord, PartitionState, TaskRun};

/// Longest work-unit name accepted (characters).
pub const MAX_WORK_UNIT: usize = 64;

/// The unit of jobs that name none.
pub const DEFAULT_UNIT: &str = "units";

/// Work a job's tasks reported, in the job's unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkTally {
    pub done: u64,
    pub lost: u64,
}

impl WorkTally {
    pub fn add(&mut self, other: &WorkTally) {
        self.done = self.done.saturating_add(other.done);
        self.lost = self.lost.saturating_add(other.lost);
    }
}

/// Takes run `run`'s running count `units` in: what is new is done. A
/// count below the known one (a task that reset its counter) adds nothing
/// until it passes it. Returns the units new.
pub fn take_progress(run: &mut TaskRun, work: &mut WorkTally, units: u64) -> u64 {
    let new = units.saturating_sub(run.work_units);
    if new > 0 {
        work.done = work.done.saturating_add(new);
        run.work_units = units;
    }
    new
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

/// A group of work: (tenant, class, unit).
pub type OutcomeKey = (String, String, String);

/// What a partition stores for its outcome: when its simulated nodes came
/// to be (the first start of a host with this store: installed hours do
/// not restart with the host) and the work of jobs retention removed.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct StoredOutcome {
    #[serde(default)]
    pub started_unix_ms: u64,
    #[serde(default)]
    pub work: Vec<(String, String, String, WorkTally)>,
}

/// What a partition knows for its outcome beyond its jobs.
#[derive(Debug, Default)]
pub struct PartitionOutcome {
    /// When the partition's simulated nodes came to be (the host's start).
    pub started_unix_ms: u64,
    /// When each agent node first joined (stored with the node).
    pub joined_unix_ms: HashMap<NodeId, u64>,
    /// Agent nodes that reported themselves powered down.
    pub powered_down: BTreeSet<NodeId>,
    /// Work of jobs removed by retention.
    pub retired: BTreeMap<OutcomeKey, WorkTally>,
}

pub(crate) fn retired_key(partition: &str) -> String {
    format!("outcome/{partition}")
}

impl PartitionOutcome {
    /// The stored form, with `jobs`' work added to the retired.
    pub(crate) fn stored_with<'a>(&self, jobs: impl Iterator<Item = (OutcomeKey, &'a WorkTally)>) -> Vec<u8> {
        let mut all = self.retired.clone();
        for (k, w) in jobs {
            all.entry(k).or_default().add(w);
        }
        let stored = StoredOutcome { started_unix_ms: self.started_unix_ms, work: all.into_iter().map(|((t, c, u), w)| (t, c, u, w)).collect() };
        serde_json::to_vec(&stored).expect("tallies serialize")
    }

    /// Takes the stored form back (a start time of 0 leaves this one).
    pub(crate) fn restore(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        let stored: StoredOutcome = serde_json::from_slice(bytes)?;
        self.retired = stored.work.into_iter().map(|(t, c, u, w)| ((t, c, u), w)).collect();
        if stored.started_unix_ms != 0 {
            self.started_unix_ms = stored.started_unix_ms;
        }
        Ok(())
    }
}

/// A job's group: its owner, its class ("high" at or above the partition's
/// high priority, else "low") and its unit.
pub fn key_of(job: &JobRecord, high_priority: u32) -> OutcomeKey {
    let class = if job.spec.job.priority >= high_priority { "high" } else { "low" };
    let unit = if job.spec.work_unit.is_empty() { DEFAULT_UNIT } else { &job.spec.work_unit };
    (job.owner.clone(), class.to_string(), unit.to_string())
}

/// Installed GPU-hours of a partition at `now_ms`, and their cost when
/// `cost_per_gpu_hour` prices every model present (keys lower-case).
pub fn installed(st: &PartitionState, now_ms: u64, cost_per_gpu_hour: &BTreeMap<String, f64>) -> (f64, Option<f64>) {
    let (mut hours, mut cost, mut priced) = (0.0, 0.0, true);
    for (i, n) in st.fleet.nodes().iter().enumerate() {
        let since = st.outcome.joined_unix_ms.get(&(i as NodeId)).copied().unwrap_or(st.outcome.started_unix_ms);
        let h = n.gpus.len() as f64 * now_ms.saturating_sub(since) as f64 / 3_600_000.0;
        hours += h;
        if n.gpus.is_empty() {
            continue;
        }
        let model = n.model.map(|m| st.fleet.models[m as usize].to_ascii_lowercase()).unwrap_or_default();
        match cost_per_gpu_hour.get(&model) {
            Some(c) => cost += c * h,
            None => priced = false,
        }
    }
    (hours, (priced && !cost_per_gpu_hour.is_empty()).then_some(cost))
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

/// Checks a submitted work-unit name: printable, bounded.
pub fn check_unit(unit: &str) -> Result<(), String> {
    if unit.chars().count() > MAX_WORK_UNIT {
        return Err(format!("work_unit: at most {MAX_WORK_UNIT} characters"));
    }
    if unit.chars().any(|c| c.is_control()) {
        return Err("work_unit: printable characters only".into());
    }
    Ok(())
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
    fn unit_names_are_bounded_and_printable() {
        assert!(check_unit("requests within SLO").is_ok());
        assert!(check_unit(&"x".repeat(MAX_WORK_UNIT + 1)).is_err());
        assert!(check_unit("steps\n").is_err());
    }

    #[test]
    fn retired_work_reads_back_what_it_writes() {
        let o = PartitionOutcome { started_unix_ms: 7, ..Default::default() };
        let k = ("alice".to_string(), "low".to_string(), "steps".to_string());
        let bytes = o.stored_with([(k.clone(), &WorkTally { done: 9, lost: 2 })].into_iter());
        let mut back = PartitionOutcome { started_unix_ms: 99, ..Default::default() };
        back.restore(&bytes).unwrap();
        assert_eq!(back.retired[&k], WorkTally { done: 9, lost: 2 });
        assert_eq!(back.started_unix_ms, 7, "installed hours count from the first start");
    }
}
