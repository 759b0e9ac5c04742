//! What a job buys: its tier, the promises that come with it, and what the
//! host owes its tenant when work is lost or a promise is broken (ASI: "a
//! low-priority tenant should know whether it is buying a full GPU-hour, a
//! preemptible interval, or an opportunistic token budget").
//!
//! Credits are counted in GPU-hours, the unit a tenant buys.

/// The tier a job is bought as (the SDK's, so policies name it the same).
pub use berth_sdk::Tier;

/// A promise the host broke, found by the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Broken {
    /// A preemptible job was stopped again while at its daily cap (a host
    /// action: a lost node, an owner waking on GPUs it borrowed).
    PastCap,
    /// A preemptible job stayed out of service longer than its maximum
    /// outage before it ran again.
    Outage { out_s: u64 },
    /// A guaranteed job's run was stopped by the host.
    GuaranteedStopped,
}

impl Broken {
    pub fn name(self) -> &'static str {
        match self {
            Broken::PastCap => "past-cap",
            Broken::Outage { .. } => "outage",
            Broken::GuaranteedStopped => "guaranteed-stopped",
        }
    }
}

/// What the host owes for lost work and broken promises, in GPU-hours.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Compensation {
    /// Credit per GPU-hour of work a preemptible job lost to a preemption
    /// (the work since its last checkpoint).
    pub preemptible_per_lost_gpu_h: f64,
    /// The same for opportunistic work (it bought no protection).
    pub opportunistic_per_lost_gpu_h: f64,
    /// A broken promise pays its lost work this many times over...
    pub broken_multiplier: f64,
    /// ...and at least this many GPU-hours per GPU the job holds (an outage
    /// past its maximum loses no work, and still costs).
    pub broken_floor_gpu_h_per_gpu: f64,
}

impl Default for Compensation {
    /// Lost preemptible work paid back once; a broken promise three times,
    /// and at least one GPU-hour per GPU.
    fn default() -> Self {
        Compensation { preemptible_per_lost_gpu_h: 1.0, opportunistic_per_lost_gpu_h: 0.0, broken_multiplier: 3.0, broken_floor_gpu_h_per_gpu: 1.0 }
    }
}

impl Compensation {
    /// The credit for a kept promise: a preemption of a `tier` job that lost
    /// `lost_gpu_s`.
    pub fn for_preemption(&self, tier: Tier, lost_gpu_s: f64) -> f64 {
        let rate = match tier {
            Tier::Opportunistic => self.opportunistic_per_lost_gpu_h,
            Tier::Preemptible | Tier::Guaranteed => self.preemptible_per_lost_gpu_h,
        };
        rate * lost_gpu_s / 3600.0
    }

    /// The credit for a broken promise to a job of `gpus` GPUs that lost
    /// `lost_gpu_s`.
    pub fn for_broken(&self, lost_gpu_s: f64, gpus: f64) -> f64 {
        (self.broken_multiplier * lost_gpu_s / 3600.0).max(self.broken_floor_gpu_h_per_gpu * gpus)
    }

    /// Checks the rates: finite and not negative.
    pub fn check(&self) -> Result<(), String> {
        let all = [self.preemptible_per_lost_gpu_h, self.opportunistic_per_lost_gpu_h, self.broken_multiplier, self.broken_floor_gpu_h_per_gpu];
        if all.iter().any(|r| !r.is_finite() || *r < 0.0) {
            return Err(format!("compensation rates {all:?}: each finite and at least 0"));
        }
        Ok(())
    }
}
