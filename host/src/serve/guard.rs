//! A live partition's starvation guard: set from the fleet TOML at start,
//! changed by an operator at run time (`berth guard`), kept in the store so
//! a restart or a new leader keeps the operator's choice.

use berth_core::engine::{AdmissionWindow, Guards, StarvationGuard};
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
    /// The admission window (seconds, GPU-hours), if any (stored since
    /// windows exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    window: Option<(u64, f64)>,
}

fn guard_key(partition: &str) -> String {
    format!("guards/{partition}")
}

/// The guard an operator asks for, checked: off, or a reservation after
/// `reserve_after_s` (0: never, aging only), aging per hour, and an
/// admission window of `window_s` seconds admitting `window_gpu_h`
/// GPU-hours of smaller work ahead of a waiting job (0 s: none).
pub fn requested(off: bool, reserve_after_s: u64, aging_per_hour: f64, window_s: u64, window_gpu_h: f64) -> Result<Option<StarvationGuard>, ServeError> {
    if off {
        return Ok(None);
    }
    if reserve_after_s > MAX_RESERVE_AFTER_S {
        return Err(ServeError::Invalid(format!("reserve_after_s {reserve_after_s}: at most {MAX_RESERVE_AFTER_S} (30 days)")));
    }
    if !(aging_per_hour.is_finite() && (0.0..=MAX_AGING_PER_HOUR).contains(&aging_per_hour)) {
        return Err(ServeError::Invalid(format!("aging_per_hour {aging_per_hour}: must be in [0, {MAX_AGING_PER_HOUR}]")));
    }
    let window = (window_s > 0).then_some(AdmissionWindow { window_s, small_gpu_h: window_gpu_h });
    if let Some(w) = window {
        w.check().map_err(ServeError::Invalid)?;
    }
    if reserve_after_s == 0 && aging_per_hour == 0.0 && window.is_none() {
        return Err(ServeError::Invalid("a guard needs reserve_after_s, aging_per_hour or window_s (or off)".into()));
    }
    let reserve_after_s = if reserve_after_s == 0 { u64::MAX } else { reserve_after_s };
    Ok(Some(StarvationGuard { reserve_after_s, aging_per_hour, window }))
}

/// One line for people: "off", or what the guard does.
pub fn describe(guard: Option<StarvationGuard>) -> String {
    match guard {
        None => "off".into(),
        Some(g) => {
            let reserve = if g.reserve_after_s == u64::MAX { "no reservations".to_string() } else { format!("reserve after {} s", g.reserve_after_s) };
            let window = g.window.map_or(String::new(), |w| format!(", at most {} GPU-h of smaller work ahead of a waiting job per {} s window", w.small_gpu_h, w.window_s));
            format!("{reserve}, aging {} per hour{window}", g.aging_per_hour)
        }
    }
}

impl Live {
    /// Sets partition `p`'s guard now; stored first, so an answer means it
    /// holds across a restart.
    pub fn set_guard(&self, p: usize, guard: Option<StarvationGuard>) -> Result<(), ServeError> {
        let part = &self.partitions[p];
        let mut st = part.lock_state();
        let stored = StoredGuard { guard: guard.map(|g| (g.reserve_after_s, g.aging_per_hour)), window: guard.and_then(|g| g.window).map(|w| (w.window_s, w.small_gpu_h)) };
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
                let window = stored.window.map(|(window_s, small_gpu_h)| AdmissionWindow { window_s, small_gpu_h });
                let guard = stored.guard.map(|(reserve_after_s, aging_per_hour)| StarvationGuard { reserve_after_s, aging_per_hour, window });
                part.lock_state().engine.set_guards(Guards::everywhere(guard));
            }
        }
        Ok(())
    }
}
