//! The circuit breaker of one partition, per policy version. A version
//! trips on any of three rules:
//! - `failures` consecutive failed calls (traps, timeouts, memory caps,
//!   invalid outputs, guest errors);
//! - a failure *rate*: at least `rate` of its last `window` calls failed,
//!   once it has made `min_calls` calls (a version failing every other call
//!   never makes three in a row);
//! - slow calls: a call that answers but takes longer than `slow` counts as
//!   a failure for both rules above (a slow policy stalls its partition).
//!
//! On a trip the caller rolls the partition back and blocks the version for
//! a backoff that doubles with each trip.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use berth_core::PolicyError;

#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Consecutive failures that trip a version.
    pub failures: u32,
    /// Calls the failure rate is measured over (the most recent ones).
    pub window: u32,
    /// Failure rate over the window that trips a version, in (0, 1].
    pub rate: f64,
    /// Calls a version must have made before the rate rule applies.
    pub min_calls: u32,
    /// Latency budget: an answer slower than this counts as a failure.
    /// `None`: only the deadline bounds a call.
    pub slow: Option<Duration>,
    /// Backoff after the first trip; doubled after each later one.
    pub backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 3,
            window: 20,
            rate: 0.5,
            min_calls: 10,
            slow: Some(Duration::from_millis(250)),
            backoff: Duration::from_secs(60),
        }
    }
}

impl BreakerConfig {
    /// The backoff for a version's `trips`-th trip (1-based), capped at a day.
    pub fn backoff_for(&self, trips: u32) -> Duration {
        let factor = 1u32 << trips.saturating_sub(1).min(10);
        (self.backoff * factor).min(Duration::from_secs(86_400))
    }

    /// Checks the settings are usable.
    pub fn check(&self) -> Result<(), String> {
        if self.failures == 0 {
            return Err("breaker failures must be at least 1".into());
        }
        if !(self.rate > 0.0 && self.rate <= 1.0) {
            return Err(format!("breaker rate {} must be in (0, 1]", self.rate));
        }
        if self.window == 0 || self.min_calls == 0 || self.min_calls > self.window {
            return Err(format!("breaker min calls {} must be in [1, window {}]", self.min_calls, self.window));
        }
        Ok(())
    }
}

/// Whether an error counts against the version: everything the policy did
/// wrong. `Unsupported` is the host asking for a hook the policy never
/// claimed, and `Load` happens before any decision.
pub fn counts(e: &PolicyError) -> bool {
    !matches!(e, PolicyError::Unsupported(_) | PolicyError::Load(_))
}

/// A short name of the failure, for metrics labels.
pub fn kind(e: &PolicyError) -> &'static str {
    match e {
        PolicyError::Trap(_) => "trap",
        PolicyError::Timeout { .. } => "timeout",
        PolicyError::OutOfMemory { .. } => "out_of_memory",
        PolicyError::InvalidOutput(_) => "invalid_output",
        PolicyError::Guest(_) => "guest_error",
        PolicyError::Unsupported(_) => "unsupported",
        PolicyError::Load(_) => "load",
    }
}

/// What one call did, as the breaker sees it.
#[derive(Clone, Copy, Debug)]
pub enum Call<'a> {
    /// Answered (any answer the host accepted) in this long.
    Answered(Duration),
    /// Failed with an error that counts against the version.
    Failed(&'a PolicyError),
}

#[derive(Debug, Default)]
struct History {
    consecutive: u32,
    /// Whether each recent call failed, oldest first; at most `window`.
    recent: VecDeque<bool>,
}

#[derive(Debug, Default)]
pub struct Breaker {
    versions: HashMap<u32, History>,
    /// Versions that have made at least one good decision here: preferred
    /// targets of a rollback.
    proven: HashSet<u32>,
}

impl Breaker {
    /// Records one call of `version`. `Some(reason)` when it trips the
    /// version: its history restarts, so a version let back in gets the
    /// full thresholds again.
    pub fn record(&mut self, version: u32, call: Call<'_>, config: &BreakerConfig) -> Option<String> {
        let slow = match call {
            Call::Answered(took) => config.slow.filter(|&budget| took > budget).map(|budget| (took, budget)),
            Call::Failed(_) => None,
        };
        let failed = matches!(call, Call::Failed(_)) || slow.is_some();
        let h = self.versions.entry(version).or_default();
        h.recent.push_back(failed);
        while h.recent.len() > config.window as usize {
            h.recent.pop_front();
        }
        if !failed {
            h.consecutive = 0;
            self.proven.insert(version);
            return None;
        }
        h.consecutive += 1;
        let last = match (call, slow) {
            (Call::Failed(e), _) => format!("{} ({e})", kind(e)),
            (_, Some((took, budget))) => format!("slow ({} ms, budget {} ms)", took.as_millis(), budget.as_millis()),
            _ => unreachable!("a failure is an error or a slow answer"),
        };
        let failures = h.recent.iter().filter(|&&f| f).count();
        let calls = h.recent.len();
        let reason = if h.consecutive >= config.failures {
            format!("{} consecutive failures, last: {last}", h.consecutive)
        } else if calls >= config.min_calls as usize && failures as f64 >= config.rate * calls as f64 {
            format!("{failures} of the last {calls} calls failed (trips at {:.0}%), last: {last}", config.rate * 100.0)
        } else {
            return None;
        };
        self.versions.remove(&version);
        self.proven.remove(&version);
        Some(reason)
    }

    /// Records a good call of `version` (latency unknown: never slow).
    pub fn success(&mut self, version: u32) {
        let _ = self.record(version, Call::Answered(Duration::ZERO), &BreakerConfig { slow: None, ..BreakerConfig::default() });
    }

    /// Records a failed call; true when it trips the version.
    pub fn failure(&mut self, version: u32, config: &BreakerConfig) -> bool {
        self.record(version, Call::Failed(&PolicyError::Guest(String::new())), config).is_some()
    }

    pub fn is_proven(&self, version: u32) -> bool {
        self.proven.contains(&version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_at_the_threshold_and_success_resets() {
        let c = BreakerConfig { failures: 3, backoff: Duration::from_secs(10), ..BreakerConfig::default() };
        let mut b = Breaker::default();
        assert!(!b.failure(2, &c));
        assert!(!b.failure(2, &c));
        b.success(2);
        assert!(!b.failure(2, &c));
        assert!(!b.failure(2, &c));
        assert!(b.failure(2, &c));
        assert!(!b.is_proven(2));
        assert_eq!(c.backoff_for(1), Duration::from_secs(10));
        assert_eq!(c.backoff_for(3), Duration::from_secs(40));
    }

    #[test]
    fn failing_every_other_call_trips_on_the_rate() {
        let c = BreakerConfig { failures: 3, window: 10, rate: 0.5, min_calls: 10, slow: None, backoff: Duration::from_secs(10) };
        let mut b = Breaker::default();
        let e = PolicyError::OutOfMemory { cap_bytes: 1 };
        let mut tripped = None;
        for i in 0..40 {
            let call = if i % 2 == 0 { Call::Failed(&e) } else { Call::Answered(Duration::from_millis(1)) };
            if let Some(reason) = b.record(7, call, &c) {
                tripped = Some((i, reason));
                break;
            }
        }
        let (at, reason) = tripped.expect("a version failing every other call must trip");
        // Call 8 is the fifth failure of nine calls (under the minimum
        // count); call 10 is the sixth failure: 5 of the last 10 failed.
        assert_eq!(at, 10, "{reason}");
        assert!(reason.contains("5 of the last 10 calls failed"), "{reason}");
        // Mostly good: one failure in three never trips.
        let mut b = Breaker::default();
        for i in 0..60 {
            let call = if i % 3 == 0 { Call::Failed(&e) } else { Call::Answered(Duration::from_millis(1)) };
            assert!(b.record(7, call, &c).is_none(), "call {i}");
        }
    }

    #[test]
    fn slow_answers_count_as_failures() {
        let c = BreakerConfig { slow: Some(Duration::from_millis(100)), ..BreakerConfig::default() };
        let mut b = Breaker::default();
        assert!(b.record(1, Call::Answered(Duration::from_millis(99)), &c).is_none());
        assert!(b.record(1, Call::Answered(Duration::from_millis(350)), &c).is_none());
        assert!(b.record(1, Call::Answered(Duration::from_millis(350)), &c).is_none());
        let reason = b.record(1, Call::Answered(Duration::from_millis(350)), &c).expect("three slow calls in a row trip");
        assert!(reason.contains("3 consecutive failures") && reason.contains("slow (350 ms, budget 100 ms)"), "{reason}");
        assert!(BreakerConfig { rate: 0.0, ..c }.check().is_err());
        assert!(BreakerConfig { min_calls: 30, ..c }.check().is_err());
        assert!(c.check().is_ok());
    }
}
