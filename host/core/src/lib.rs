//! Berth's scheduling core.
//!
//! Fleet state, the hard-constraint predicate, placement from a policy's
//! scores, and accounting. No IO, no wall clock and no wasmtime: the core is
//! handed a policy through [`policy::PlacementPolicy`] and the caller decides
//! time, so the same code runs in the live host and in deterministic replay.

pub mod accounting;
pub mod calibration;
pub mod capacity;
pub mod capture;
pub mod compaction;
pub mod contract;
pub mod engine;
pub mod fleet;
pub mod forecast;
pub mod harvest;
pub mod job;
pub mod placement;
pub mod policy;
pub mod pool;
pub mod preemption;
pub mod predicate;
mod serde_sdk;
pub mod sim;
pub mod task;
pub mod units;
pub mod whatif;

pub use contract::{Broken, Compensation, Tier};
pub use engine::{Decision, Engine, Event, Hook, World};
pub use fleet::{Allocation, Fleet, FleetError, Node};
pub use job::{Job, TaskClass};
pub use placement::{Placement, Placer};
pub use policy::{PlacementPolicy, PolicyError};
pub use predicate::Unfit;
pub use task::{TaskMeta, TaskShape};
pub use units::{ModelId, NodeId, MAX_GPUS_PER_NODE, MILLI_PER_GPU};
