//! The live host's clock. Every time the host decides by (the engine's
//! `now`, job submission and start times, run timers, eviction notices,
//! modelled vacate times) comes from one [`Clock`]: the system's, or a
//! [`ManualClock`] a caller moves by hand, so one event sequence can be fed
//! to the live host and to replay at the same times (the equivalence test).
//! Latency measurements stay on the real monotonic clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn unix_ms(&self) -> u64;
    /// The monotonic instant of the same moment (timers compare these).
    fn now(&self) -> Instant;
}

/// The system's clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn unix_ms(&self) -> u64 {
        crate::util::unix_ms()
    }
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until moved: it reads `unix_ms` as set, and
/// the instant as the one it was created at plus the time moved since.
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    start_ms: u64,
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A clock reading `unix_ms`.
    pub fn at(unix_ms: u64) -> ManualClock {
        ManualClock { base: Instant::now(), start_ms: unix_ms, now_ms: AtomicU64::new(unix_ms) }
    }

    /// Moves the clock to `unix_ms` (never back).
    pub fn set(&self, unix_ms: u64) {
        self.now_ms.fetch_max(unix_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn unix_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.unix_ms() - self.start_ms)
    }
}
