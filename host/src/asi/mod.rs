//! ASI-scale fleets and workloads (Alibaba's ASI: 155,410 GPUs): topology
//! and fleet configuration in TOML, seeded generators for a synthetic fleet
//! and workload, and the event-driven replay report.

pub mod calibration;
pub mod fleet;
pub mod html;
pub mod preempt;
pub mod report;
pub mod workload;
