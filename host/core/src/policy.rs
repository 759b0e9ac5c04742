//! The seam between the core and whatever decides: wasm components in the
//! policy host, native builds of the same policies in benchmarks, or test
//! doubles. The types that cross are the contract's columns (`berth_sdk`).

pub use berth_sdk::{Domains, Nodes, Scores, Task};

/// Everything that can go wrong in one policy call. The policy host maps
/// traps, deadlines and memory caps onto these; the core adds the checks of
/// what a policy returned.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum PolicyError {
    /// The guest trapped (panic, unreachable, out-of-bounds access...).
    #[error("policy trapped: {0}")]
    Trap(String),
    /// The call ran past its deadline and was interrupted.
    #[error("policy ran past its deadline of {deadline_ms} ms")]
    Timeout { deadline_ms: u64 },
    /// The guest tried to grow its memory past the cap.
    #[error("policy exceeded its memory cap of {cap_bytes} bytes")]
    OutOfMemory { cap_bytes: u64 },
    /// The answer broke the contract (wrong length, NaN, unknown ids...).
    #[error("policy returned an invalid answer: {0}")]
    InvalidOutput(String),
    /// The guest returned an error of its own.
    #[error("policy reported an error: {0}")]
    Guest(String),
    /// The policy does not implement the hook that was called.
    #[error("policy does not implement the {0} hook")]
    Unsupported(&'static str),
    /// The component could not be loaded, compiled or instantiated.
    #[error("policy could not be loaded: {0}")]
    Load(String),
}

/// Scores a task against a batch of candidate nodes.
pub trait PlacementPolicy {
    /// Name and version, for logs and reports.
    fn describe(&self) -> String;

    /// Scores `task` on every node of `nodes`. An implementation may move
    /// the columns out of `nodes` while it works (to avoid copying them) but
    /// must put them back before returning, error or not.
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError>;

    /// Scores switch domains for a gang (`task.gang_size` tasks), one finite
    /// score per domain; `Ok(None)` when the policy has no opinion, and the
    /// gang is then placed topology-blind. Same column contract as `score`.
    fn score_domains(&mut self, _task: &Task, _domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        Ok(None)
    }
}

impl<P: PlacementPolicy + ?Sized> PlacementPolicy for Box<P> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        (**self).score(task, nodes)
    }
    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        (**self).score_domains(task, domains)
    }
}
