//! The wasm boundary: the only module of Berth that knows wasmtime.
//!
//! [`PolicyEngine`] owns the wasmtime engine (epoch interruption on), the
//! linker with the host imports, and a content-addressed cache of precompiled
//! artifacts. [`WasmPolicy`] is one instance of one component, called under a
//! deadline and a memory cap, re-instantiated after any trap, and adapted to
//! the core's [`berth_core::PlacementPolicy`].

mod bindings;
mod cache;
mod engine;
mod policy;

pub use engine::{DeadlineClock, Limits, PolicyEngine};
pub use policy::{check_info, LoadedPolicy, WasmPolicy, MAX_ERROR_BYTES, MAX_NAME_BYTES, MAX_VERSION_BYTES};
pub use engine::{MAX_CORE_INSTANCES, MAX_LOG_BYTES, MAX_MEMORIES, MAX_TABLES};
