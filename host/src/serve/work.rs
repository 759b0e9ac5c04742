//! The vocabulary of work and the outcome (see [`super::outcome`]): a
//! job's tally, a partition's outcome state and how it is stored, and work
//! units. Kept apart from the partition state that holds it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use berth_core::NodeId;
use serde::{Deserialize, Serialize};

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

/// The name of a job's unit (its own, else the default).
pub fn unit_name(unit: &str) -> &str {
    if unit.is_empty() { DEFAULT_UNIT } else { unit }
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
