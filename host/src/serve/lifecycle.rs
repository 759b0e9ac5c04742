//! The states of the live host's work, typed, in one place: a job's
//! (pending to an end), a task's (one process on an agent node, from its
//! start to its exit), what an agent may report about a task, and a job's
//! place in sleep-state harvesting. The scheduler, actuation and
//! harvesting match on these, never on text; text exists only at the edges
//! (the API, the store, agents' reports), through `as_str` and `parse`.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Pending,
    Running,
    Finished,
    /// A task of a job with argv exited non-zero, failed to start or was lost.
    Failed,
    Cancelled,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Finished, failed or cancelled: it runs no more (its processes may
    /// still be stopping).
    pub fn is_ended(self) -> bool {
        matches!(self, JobState::Finished | JobState::Failed | JobState::Cancelled)
    }

    pub fn parse(s: &str) -> Option<JobState> {
        [JobState::Pending, JobState::Running, JobState::Finished, JobState::Failed, JobState::Cancelled].into_iter().find(|j| j.as_str() == s)
    }
}

/// Where a running job is in sleep-state harvesting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SleepState {
    #[default]
    Awake,
    /// Told to sleep; its GPUs are lent once every task reports asleep.
    Asked,
    /// Asleep: its GPUs are lent to low-priority work.
    Asleep,
    /// Waking: its tasks are woken once the borrowers evicted for it are gone.
    Waking,
}

impl SleepState {
    pub fn as_str(self) -> &'static str {
        match self {
            SleepState::Awake => "awake",
            SleepState::Asked => "asked to sleep",
            SleepState::Asleep => "asleep",
            SleepState::Waking => "waking",
        }
    }

    /// Its processes are frozen and hold nothing: their GPUs were lent and
    /// borrowers may still use them (a waking job's tasks are told to wake
    /// only once the borrowers are gone). Ended or sent back in this
    /// state, its processes are killed, never woken, and get no fence.
    pub fn frozen(self) -> bool {
        matches!(self, SleepState::Asleep | SleepState::Waking)
    }
}

/// One task's process, as the host knows it. Stored by name (`"running"`),
/// as the text the host stored before the type existed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// Its start was sent; the agent has not said it runs.
    Starting,
    Running,
    /// Put to sleep (harvesting): its process lives, its GPUs may be lent.
    Sleeping,
    /// Gone: exited on its own or stopped (the code and signal say which).
    Exited,
    /// Gone: it could not start, or its agent said it failed.
    Failed,
    /// Gone with its node (given up), or its node came back without it.
    Lost,
}

impl TaskState {
    pub const ALL: [TaskState; 6] = [TaskState::Starting, TaskState::Running, TaskState::Sleeping, TaskState::Exited, TaskState::Failed, TaskState::Lost];

    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Starting => "starting",
            TaskState::Running => "running",
            TaskState::Sleeping => "sleeping",
            TaskState::Exited => "exited",
            TaskState::Failed => "failed",
            TaskState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// Its process is gone: whatever it held can be given back.
    pub fn is_gone(self) -> bool {
        matches!(self, TaskState::Exited | TaskState::Failed | TaskState::Lost)
    }

    /// The state after its agent reports `reported`, a state of a live
    /// process (ends go through the task's end): a late `starting` never
    /// takes a task back.
    pub fn after_report(self, reported: TaskState) -> TaskState {
        if reported == TaskState::Starting { self } else { reported }
    }

    /// Whether a task that ended so counts as a failure of its job.
    pub fn failed(self, exit_code: i32, signal: i32) -> bool {
        self != TaskState::Exited || exit_code != 0 || signal != 0
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A live compaction chain (stored by these names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChainState {
    #[default]
    Running,
    Done,
    /// A move failed: moves done stay, the rest were skipped.
    RolledBack,
    /// The host restarted while it ran.
    Abandoned,
}

impl ChainState {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainState::Running => "running",
            ChainState::Done => "done",
            ChainState::RolledBack => "rolled-back",
            ChainState::Abandoned => "abandoned",
        }
    }
}

/// One move of a compaction chain (stored by these names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MoveState {
    #[default]
    Pending,
    /// Its new copy was started (make-before-break).
    Moving,
    Done,
    RolledBack,
    /// Not tried: an earlier move of its chain rolled back.
    Skipped,
    /// Took over; its rate on the destination is being watched while the
    /// source's GPUs stay reserved.
    Verifying,
    /// Ran slower on the destination than before: moved back to the source.
    MovedBack,
}

impl MoveState {
    pub fn as_str(self) -> &'static str {
        match self {
            MoveState::Pending => "pending",
            MoveState::Moving => "moving",
            MoveState::Done => "done",
            MoveState::RolledBack => "rolled-back",
            MoveState::Skipped => "skipped",
            MoveState::Verifying => "verifying",
            MoveState::MovedBack => "moved-back",
        }
    }
}

/// What an agent may report about one of its allocations. Anything else is
/// refused at the hub: the host never stores a state it does not know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// The process is now in this state.
    State(TaskState),
    /// It saved its work (`berth checkpointed`): preemption counts lost
    /// work from now. Its state is unchanged.
    Checkpointed,
    /// It serves (`berth ready`); a starting task runs from now.
    Ready,
    /// It reported work (`berth progress`): only the report's work count
    /// is news. Its state is unchanged.
    Progress,
}

impl Report {
    pub fn parse(s: &str) -> Option<Report> {
        match s {
            "checkpointed" => Some(Report::Checkpointed),
            "ready" => Some(Report::Ready),
            "progress" => Some(Report::Progress),
            _ => TaskState::parse(s).map(Report::State),
        }
    }

    /// The accepted words, for a refusal.
    pub fn names() -> String {
        let mut names: Vec<&str> = TaskState::ALL.iter().map(|t| t.as_str()).collect();
        names.extend(["checkpointed", "ready", "progress"]);
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_back_what_they_write_and_refuse_the_rest() {
        for t in TaskState::ALL {
            assert_eq!(TaskState::parse(t.as_str()), Some(t));
            assert_eq!(Report::parse(t.as_str()), Some(Report::State(t)));
            // The store keeps the same words.
            assert_eq!(serde_json::to_string(&t).unwrap(), format!("\"{}\"", t.as_str()));
        }
        assert_eq!(Report::parse("ready"), Some(Report::Ready));
        assert_eq!(Report::parse("checkpointed"), Some(Report::Checkpointed));
        assert_eq!(Report::parse("progress"), Some(Report::Progress));
        for bad in ["", "Running", "running\n", "done", "ready "] {
            assert_eq!(Report::parse(bad), None, "{bad:?}");
        }
        assert_eq!(TaskState::Running.after_report(TaskState::Starting), TaskState::Running);
        assert_eq!(TaskState::Starting.after_report(TaskState::Running), TaskState::Running);
        assert_eq!(TaskState::Running.after_report(TaskState::Sleeping), TaskState::Sleeping);
        assert!(TaskState::Exited.failed(0, 15) && TaskState::Lost.failed(0, 0) && !TaskState::Exited.failed(0, 0));
        for c in [ChainState::Running, ChainState::Done, ChainState::RolledBack, ChainState::Abandoned] {
            assert_eq!(serde_json::to_string(&c).unwrap(), format!("\"{}\"", c.as_str()));
        }
        for m in [MoveState::Pending, MoveState::Moving, MoveState::Done, MoveState::RolledBack, MoveState::Skipped] {
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{}\"", m.as_str()));
        }
    }
}
