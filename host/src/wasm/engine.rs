//! The shared wasmtime engine: configuration, epoch ticker, linker.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, ResourceLimiter};

use super::bindings::{v0_1_0 as v1, v0_2_0 as v2, v0_3_0 as v3};

/// Epoch ticks are this long; deadlines are whole numbers of ticks.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// Per-call limits for a policy. Defaults suit a placement decision over a
/// ~10,000-node partition; operators override them per partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock budget of one call; the call is interrupted past it.
    pub deadline: Duration,
    /// Most linear memory one instance may hold, in bytes.
    pub memory_bytes: u64,
    /// Most log lines one call may send; the rest are counted and dropped.
    pub log_lines_per_call: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { deadline: Duration::from_millis(500), memory_bytes: 256 << 20, log_lines_per_call: 20 }
    }
}

/// Per-store host state: limits bookkeeping and the log budget.
pub(crate) struct GuestState {
    pub policy: String,
    pub memory_cap: u64,
    pub memory_cap_hit: bool,
    pub log_budget: u32,
    pub logs_dropped: u64,
}

impl ResourceLimiter for GuestState {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired as u64 > self.memory_cap {
            // Trap rather than report failure: a guest allocator that sees a
            // failed grow aborts anyway, and a trap carries the reason.
            self.memory_cap_hit = true;
            wasmtime::bail!("memory cap of {} bytes exceeded (wanted {desired})", self.memory_cap);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// Log severities of every contract version, as one type.
#[derive(Clone, Copy)]
enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// The host imports of one contract version: the same log sink for all.
macro_rules! host_imports {
    ($v:ident) => {
        impl $v::berth::policy::types::Host for GuestState {}

        impl $v::berth::policy::host::Host for GuestState {
            fn log(&mut self, level: $v::berth::policy::types::Level, message: String) {
                use $v::berth::policy::types::Level as L;
                let level = match level {
                    L::Trace => LogLevel::Trace,
                    L::Debug => LogLevel::Debug,
                    L::Info => LogLevel::Info,
                    L::Warn => LogLevel::Warn,
                    L::Error => LogLevel::Error,
                };
                self.log_line(level, message);
            }
        }
    };
}

host_imports!(v1);
host_imports!(v2);
host_imports!(v3);

impl GuestState {
    fn log_line(&mut self, level: LogLevel, message: String) {
        if self.log_budget == 0 {
            self.logs_dropped += 1;
            return;
        }
        self.log_budget -= 1;
        let message: String = message.chars().take(1024).collect();
        use LogLevel as L;
        let policy = self.policy.as_str();
        match level {
            L::Trace => tracing::trace!(target: "berth::policy", policy, "{message}"),
            L::Debug => tracing::debug!(target: "berth::policy", policy, "{message}"),
            L::Info => tracing::info!(target: "berth::policy", policy, "{message}"),
            L::Warn => tracing::warn!(target: "berth::policy", policy, "{message}"),
            L::Error => tracing::error!(target: "berth::policy", policy, "{message}"),
        }
    }
}

struct Ticker {
    stop: Arc<AtomicBool>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The engine every policy of a process shares.
pub struct PolicyEngine {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<GuestState>,
    pub(crate) cache_dir: Option<PathBuf>,
    _ticker: Ticker,
}

impl PolicyEngine {
    /// An engine with epoch interruption and a ticker thread; `cache_dir`
    /// (if any) keeps precompiled artifacts across runs.
    pub fn new(cache_dir: Option<PathBuf>) -> anyhow::Result<PolicyEngine> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.wasm_component_model(true);
        // Keep wasmtime's default 4 GiB reservation + guard region: it lets
        // compiled code skip explicit bounds checks on every memory access
        // (a 1 GiB reservation made a trivial policy 2-3x slower). Address
        // space, not memory: the cap below is what the guest may touch.
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        v1::PlacementPolicy::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)?;
        v2::PlacementPolicy::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)?;
        v3::PlacementPolicy::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)?;

        let stop = Arc::new(AtomicBool::new(false));
        let (weak_engine, stop_flag) = (engine.weak(), stop.clone());
        std::thread::Builder::new().name("berth-epoch".into()).spawn(move || {
            while !stop_flag.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                match weak_engine.upgrade() {
                    Some(e) => e.increment_epoch(),
                    None => break,
                }
            }
        })?;
        Ok(PolicyEngine { engine, linker, cache_dir, _ticker: Ticker { stop } })
    }

    /// The default artifact cache: `$BERTH_CACHE_DIR`, else `target/berth-cache`
    /// next to the binary, else none.
    pub fn default_cache_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("BERTH_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        let exe = std::env::current_exe().ok()?;
        Some(exe.parent()?.parent()?.join("berth-cache"))
    }
}
