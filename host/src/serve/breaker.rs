//! The circuit breaker of one partition: counts consecutive failed calls
//! (traps, timeouts, memory caps, invalid outputs, guest errors) per policy
//! version; at the threshold the version trips, and the caller rolls the
//! partition back and blocks the version for a backoff that doubles with
//! each trip.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use berth_core::PolicyError;

#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Consecutive failures that trip a version.
    pub failures: u32,
    /// Backoff after the first trip; doubled after each later one.
    pub backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { failures: 3, backoff: Duration::from_secs(60) }
    }
}

impl BreakerConfig {
    /// The backoff for a version's `trips`-th trip (1-based), capped at a day.
    pub fn backoff_for(&self, trips: u32) -> Duration {
        let factor = 1u32 << trips.saturating_sub(1).min(10);
        (self.backoff * factor).min(Duration::from_secs(86_400))
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

#[derive(Debug, Default)]
pub struct Breaker {
    consecutive: HashMap<u32, u32>,
    /// Versions that have made at least one good decision here: preferred
    /// targets of a rollback.
    proven: HashSet<u32>,
}

impl Breaker {
    /// Records a good call of `version`.
    pub fn success(&mut self, version: u32) {
        self.consecutive.remove(&version);
        self.proven.insert(version);
    }

    /// Records a failed call; true when it trips the version (the count
    /// restarts, so a version let back in gets the full threshold again).
    pub fn failure(&mut self, version: u32, config: &BreakerConfig) -> bool {
        let n = self.consecutive.entry(version).or_insert(0);
        *n += 1;
        if *n >= config.failures {
            self.consecutive.remove(&version);
            self.proven.remove(&version);
            return true;
        }
        false
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
        let c = BreakerConfig { failures: 3, backoff: Duration::from_secs(10) };
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
}
