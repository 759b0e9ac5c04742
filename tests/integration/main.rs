//! Berth's integration tests: one binary, one module per area (as wasmtime
//! does). They use the real components built by scripts/build-policies.sh.

mod agent;
mod asi;
mod common;
mod compaction;
mod containment;
mod docs;
mod equivalence;
mod ha;
mod html_report;
mod languages;
mod loading;
mod pool;
mod preempt;
mod replay;
mod security;
mod serve;
