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
pub mod admission;
pub mod auth;
pub mod bounds;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod codec;
pub mod compacting;
pub mod completions;
pub mod console;
pub mod control;
pub mod credits;
pub mod deciding;
pub mod decisions;
pub mod error;
pub mod guard;
pub mod harvesting;
pub mod hub;
pub mod lifecycle;
pub mod metrics;
pub mod outcome;
pub mod persist;
pub mod pooling;
pub mod quote;
pub mod registry;
pub mod retention;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod shadow;
pub mod state;
pub mod work;

/// The generated protobuf types and gRPC stubs (host/proto/berth/v1).
pub use crate::proto as pb;
pub use crate::util::unix_ms;

pub use error::ServeError;
pub use server::{start, ServeConfig, ServeHandle};
