//! A live partition's starvation guard: set from the fleet TOML at start,
//! changed by an operator at run time (`berth guard`), kept in the store so
//! a restart or a new leader keeps the operator's choice.

use berth_core::engine::{Guards, StarvationGuard};
use serde::{Deserialize, Serialize};

use super::state::Live;
use super::error::ServeError;
use crate::store::{Op, Store};

/// Longest wait an operator may set before a reservation (30 days).
pub const MAX_RESERVE_AFTER_S: u64 = 30 * 86_400;
/// Largest aging rate an operator may set (priority points per hour).
pub const MAX_AGING_PER_HOUR: f64 = 1_000.0;

#[derive(Serialize, Deserialize)]
struct StoredGuard {
    /// `None`: the guard is off.
    guard: Option<(u64, f64)>,
}

fn guard_key(partition: &str) -> String {
    format!("guards/{partition}")
}

/// The guard an operator asks for, checked: off, or a reservation after
/// `reserve_after_s` (0: never, aging only) and aging per hour.
pub fn requested(off: bool, reserve_after_s: u64, aging_per_hour: f64) -> Result<Option<StarvationGuard>, ServeError> {
    if off {
        return Ok(None);
    }
    if reserve_after_s > MAX_RESERVE_AFTER_S {
        return Err(ServeError::Invalid(format!("reserve_after_s {reserve_after_s}: at most {MAX_RESERVE_AFTER_S} (30 days)")));
    }
    if !(aging_per_hour.is_finite() && (0.0..=MAX_AGING_PER_HOUR).contains(&aging_per_hour)) {
        return Err(ServeError::Invalid(format!("aging_per_hour {aging_per_hour}: must be in [0, {MAX_AGING_PER_HOUR}]")));
    }
    if reserve_after_s == 0 && aging_per_hour == 0.0 {
        return Err(ServeError::Invalid("a guard needs reserve_after_s or aging_per_hour (or off)".into()));
    }
    let reserve_after_s = if reserve_after_s == 0 { u64::MAX } else { reserve_after_s };
    Ok(Some(StarvationGuard { reserve_after_s, aging_per_hour }))
}

/// One line for people: "off", or what the guard does.
pub fn describe(guard: Option<StarvationGuard>) -> String {
    match guard {
        None => "off".into(),
        Some(g) => {
            let reserve = if g.reserve_after_s == u64::MAX { "no reservations".to_string() } else { format!("reserve after {} s", g.reserve_after_s) };
            format!("{reserve}, aging {} per hour", g.aging_per_hour)
        }
    }
}

impl Live {
    /// Sets partition `p`'s guard now; stored first, so an answer means it
    /// holds across a restart.
    pub fn set_guard(&self, p: usize, guard: Option<StarvationGuard>) -> Result<(), ServeError> {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        let stored = StoredGuard { guard: guard.map(|g| (g.reserve_after_s, g.aging_per_hour)) };
        self.persist(vec![Op::Put(guard_key(&part.name), serde_json::to_vec(&stored).expect("guards serialize"))])?;
        st.engine.set_guards(Guards::everywhere(guard));
        st.dirty = true;
        part.wake.notify_all();
        Ok(())
    }

    /// Takes back the guards operators set before a restart.
    pub(crate) fn recover_guards(&self, store: &dyn Store) -> anyhow::Result<()> {
        for part in &self.partitions {
            let key = guard_key(&part.name);
            if let Some(value) = store.get(&key)? {
                let stored: StoredGuard = serde_json::from_slice(&value).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                let guard = stored.guard.map(|(reserve_after_s, aging_per_hour)| StarvationGuard { reserve_after_s, aging_per_hour });
                part.lock_state().engine.set_guards(Guards::everywhere(guard));
            }
        }
        Ok(())
    }
}
