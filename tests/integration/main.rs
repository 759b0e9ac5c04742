//! Berth's integration tests: one binary, one module per area (as wasmtime
//! does). They use the real components built by scripts/build-policies.sh.

mod agent;
mod asi;
mod capture;
mod common;
mod compaction;
mod chaos;
mod cli;
mod confinement;
mod console;
mod containment;
mod book;
mod docs;
mod equivalence;
mod executor;
mod guard;
mod harvest;
mod isolation;
mod ha;
mod html_report;
mod languages;
mod layout;
mod live_compaction;
mod live_replay;
mod live_shadow;
mod loading;
mod outcome;
mod partition;
mod pool;
mod preempt;
mod replay;
mod retention;
mod security;
mod scale;
mod serve;
mod tiers;
