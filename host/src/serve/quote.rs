//! Availability quotes on the live fleet: the core's quote (the same one
//! replay reports use) over a partition's nodes of one kind (simulated, or
//! agent nodes for jobs with a command), with running work ending on its
//! planned time (a job's duration or time limit; work without one is never
//! counted as ending).


use berth_core::accounting::{self, PendingShape, Quote};
use berth_core::Allocation;

use super::state::{JobState, PartitionState};

impl PartitionState {
    /// Quotes `request` on the nodes of this partition that such a job may
    /// use, with an optional start deadline in seconds from now.
    pub fn quote(&self, request: &PendingShape, agent_nodes: bool, deadline_s: Option<u64>) -> Quote {
        // Nodes of the other kind take no part: a scratch fleet where they
        // are not schedulable (the predicate then skips them).
        let mut fleet = self.fleet.clone();
        for (i, node) in self.fleet.nodes().iter().enumerate() {
            if self.agent(i as u32) != agent_nodes && node.schedulable {
                fleet.set_schedulable(i as u32, false).expect("a node of this fleet");
            }
        }
        let now = self.clock.now();
        let running: Vec<(u64, Vec<Allocation>)> = self
            .jobs
            .values()
            // An asleep job holds nothing: its GPUs are lent.
            .filter(|j| j.state == JobState::Running && j.sleep != super::state::SleepState::Asleep)
            .filter_map(|j| {
                let end = j.ends_at?;
                // What the job still holds (tasks seen to end hold nothing).
                let held: Vec<Allocation> = if j.runs.is_empty() {
                    j.allocations.clone()
                } else {
                    j.allocations.iter().zip(&j.runs).filter(|(_, r)| r.holds).map(|(a, _)| a.clone()).collect()
                };
                Some((end.saturating_duration_since(now).as_secs_f64().ceil() as u64, held))
            })
            .collect();
        accounting::quote(&fleet, request, &running, 0, deadline_s)
    }

    /// Pending jobs of at least `priority`: decided before a new one.
    pub fn queued_at_or_above(&self, priority: u32) -> u32 {
        self.pending.iter().filter(|id| self.jobs.get(id).is_some_and(|j| j.spec.job.priority >= priority)).count() as u32
    }
}
