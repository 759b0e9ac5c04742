//! Berth's host: the policy host (wasmtime), benchmarks, demo and the parts
//! the `berth` binary drives. The scheduling core lives in `berth-core`.

pub mod agent;
pub mod asi;
pub mod bench;
pub mod bench_fleet;
pub mod bench_live;
pub mod bench_retention;
pub mod capture;
pub mod catalog;
pub mod chaos;
pub mod client;
pub mod compact;
pub mod componentize;
pub mod conformance;
pub mod demo;
pub mod executor;
pub mod forecast;
pub mod langbench;
pub mod native;
pub mod pool;
pub mod proto;
pub mod replay;
pub mod scaffold;
pub mod serve;
pub mod store;
pub mod synth;
pub mod text;
pub mod util;
pub mod wasm;

pub use berth_core as core;
