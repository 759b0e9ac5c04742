//! The shared wasmtime engine: configuration, epoch ticker, linker.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine, ResourceLimiter};

use super::bindings::{v0_1_0 as v1, v0_2_0 as v2, v0_3_0 as v3, v0_4_0 as v4};

/// Epoch ticks are this long; deadlines are whole numbers of ticks.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// Longest log message a guest may send, in bytes; the rest is cut.
pub const MAX_LOG_BYTES: usize = 1024;

/// Per-call limits for a policy. Defaults suit a placement decision over a
/// ~10,000-node partition; operators override them per partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock budget of one call; the call is interrupted past it.
    pub deadline: Duration,
    /// Most memory one instance may hold, in bytes: the sum over all its
    /// linear memories and tables (a table element counts 8 bytes).
    pub memory_bytes: u64,
    /// Most log lines one call may send; the rest are counted and dropped.
    pub log_lines_per_call: u32,
    /// The clock the deadline is measured on.
    pub clock: DeadlineClock,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { deadline: Duration::from_millis(500), memory_bytes: 256 << 20, log_lines_per_call: 20, clock: DeadlineClock::Wall }
    }
}

/// Which clock a call's deadline is measured on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeadlineClock {
    /// Elapsed time: a live host's decisions must come in time, however
    /// busy the machine.
    #[default]
    Wall,
    /// CPU time of the calling thread: an offline replay on a busy machine
    /// is not aborted for time it spent waiting for a core. An endless loop
    /// still burns CPU and is stopped.
    ThreadCpu,
}

/// CPU time the calling thread has used.
pub(crate) fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out-pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Most linear memories one policy instance may create (all its core
/// instances together). Components built by the SDK, componentize-py,
/// componentize-js and wit-bindgen C use one or two.
pub const MAX_MEMORIES: usize = 4;
/// Most tables one policy instance may create.
pub const MAX_TABLES: usize = 16;
/// Most core instances one policy component may create (componentize-py
/// components declare about 110).
pub const MAX_CORE_INSTANCES: usize = 256;
/// Bytes a table element is counted as against the memory cap (wasmtime
/// stores one pointer per element).
pub const TABLE_ELEMENT_BYTES: u64 = 8;

/// Per-store host state: limits bookkeeping and the log budget.
pub(crate) struct GuestState {
    pub policy: String,
    pub memory_cap: u64,
    pub memory_cap_hit: bool,
    /// Bytes held now by all memories and tables of this instance.
    pub memory_used: u64,
    /// The last growth allowed, taken back if wasmtime then fails it.
    pending_growth: u64,
    pub log_budget: u32,
    pub logs_dropped: u64,
    /// The calling thread's CPU time when the current call began (for a
    /// [`DeadlineClock::ThreadCpu`] deadline).
    pub call_cpu_start: Duration,
}

impl GuestState {
    pub fn new(policy: String, memory_cap: u64, log_budget: u32) -> GuestState {
        GuestState {
            policy,
            memory_cap,
            memory_cap_hit: false,
            memory_used: 0,
            pending_growth: 0,
            log_budget,
            logs_dropped: 0,
            call_cpu_start: Duration::ZERO,
        }
    }

    /// Admits a growth of `grow` bytes against the instance-wide cap.
    fn grow(&mut self, grow: u64, what: &str) -> wasmtime::Result<bool> {
        let total = self.memory_used.saturating_add(grow);
        if total > self.memory_cap {
            // Trap rather than report failure: a guest allocator that sees a
            // failed grow aborts anyway, and a trap carries the reason.
            self.memory_cap_hit = true;
            wasmtime::bail!(
                "memory cap of {} bytes per instance exceeded: {what} would bring all memories and tables to {total}",
                self.memory_cap
            );
        }
        self.memory_used = total;
        self.pending_growth = grow;
        Ok(true)
    }
}

impl ResourceLimiter for GuestState {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.grow(desired.saturating_sub(current) as u64, "a memory growth")
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_used -= std::mem::take(&mut self.pending_growth);
        Ok(())
    }

    fn table_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.grow((desired.saturating_sub(current) as u64).saturating_mul(TABLE_ELEMENT_BYTES), "a table growth")
    }

    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_used -= std::mem::take(&mut self.pending_growth);
        Ok(())
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
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
host_imports!(v4);

impl GuestState {
    fn log_line(&mut self, level: LogLevel, message: String) {
        if self.log_budget == 0 {
            self.logs_dropped += 1;
            return;
        }
        self.log_budget -= 1;
        // One line per call, control characters escaped: a guest cannot
        // forge log lines or drive the terminal of whoever reads them.
        let message = crate::text::printable(&message, MAX_LOG_BYTES);
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
        v4::PlacementPolicy::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)?;
        v3::PlacementPolicy::add_to_linker::<GuestState, HasSelf<GuestState>>(&mut linker, |s| s)?;

        let stop = Arc::new(AtomicBool::new(false));
        let (weak_engine, stop_flag) = (engine.weak(), stop.clone());
        std::thread::Builder::new().name("berth-epoch".into()).spawn(move || {
            // One tick per TICK of elapsed time, not per wake-up: on a busy
            // machine this thread wakes late, and counting wake-ups would
            // stretch every deadline by the delay.
            let start = Instant::now();
            let mut ticks: u64 = 0;
            while !stop_flag.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                let Some(e) = weak_engine.upgrade() else { break };
                let due = (start.elapsed().as_nanos() / TICK.as_nanos()) as u64;
                while ticks < due {
                    e.increment_epoch();
                    ticks += 1;
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
