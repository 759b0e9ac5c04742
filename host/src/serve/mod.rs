//! `berth serve`: the live host. A tonic gRPC API over a simulated fleet
//! that advances in real time, decided by the same core as replay
//! (`berth_core::sim::place_gang`), with per-partition versioned policies:
//! a content-addressed registry, hot swap, shadow and split A/B runs, a
//! circuit breaker, a decision log, Prometheus metrics and access control.
//!
//! Jobs with argv run on nodes registered by `berth agent` ([`actuation`]);
//! jobs, tasks, agent nodes and the registry persist in a
//! [`crate::store::Store`] ([`persist`]): redb by default, etcd with leader
//! election for high availability.
//!
//! Threads: tokio serves the API; each partition has one scheduler thread
//! that makes its decisions one at a time (so none is made twice), reading
//! the partition's active policy once per decision (so a swap applies to
//! the next one and a call in flight finishes on the old version).

pub mod actuation;
pub mod auth;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod codec;
pub mod compacting;
pub mod console;
pub mod control;
pub mod deciding;
pub mod decisions;
pub mod guard;
pub mod harvesting;
pub mod hub;
pub mod lifecycle;
pub mod metrics;
pub mod persist;
pub mod quote;
pub mod registry;
pub mod retention;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod shadow;

/// The generated protobuf types and gRPC stubs (host/proto/berth/v1).
pub use crate::proto as pb;
pub use crate::util::unix_ms;

pub use server::{start, ServeConfig, ServeHandle};

/// Everything an API call or a policy operation can fail with. Each maps
/// onto one gRPC status code, with the message as the status message.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    // Bounded and escaped: the name is the caller's.
    #[error("unknown partition \"{}\"", crate::text::printable(.0, 64))]
    UnknownPartition(String),
    #[error("no job {0}")]
    UnknownJob(u64),
    #[error("partition {partition} has no policy version {version}")]
    UnknownVersion { partition: String, version: u32 },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("component rejected: {0}")]
    Rejected(String),
    #[error("component is {size} bytes; the upload limit is {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("{0}")]
    FailedPrecondition(String),
    /// This host does not lead (HA on etcd): another one owns the state.
    #[error("{0}")]
    Unavailable(String),
    #[error("state directory: {0}")]
    Store(#[from] std::io::Error),
}

impl From<ServeError> for tonic::Status {
    fn from(e: ServeError) -> tonic::Status {
        use tonic::Code;
        let code = match &e {
            ServeError::Unauthenticated(_) => Code::Unauthenticated,
            ServeError::PermissionDenied(_) => Code::PermissionDenied,
            ServeError::UnknownPartition(_) | ServeError::UnknownJob(_) | ServeError::UnknownVersion { .. } => Code::NotFound,
            ServeError::Invalid(_) | ServeError::Rejected(_) => Code::InvalidArgument,
            ServeError::TooLarge { .. } => Code::ResourceExhausted,
            ServeError::FailedPrecondition(_) => Code::FailedPrecondition,
            ServeError::Unavailable(_) => Code::Unavailable,
            ServeError::Store(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

