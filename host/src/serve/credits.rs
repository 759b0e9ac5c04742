//! The compensation ledger: what each tenant of a partition is owed for
//! work lost to preemption and for promises the host broke, in GPU-hours
//! (priced by the engine, see [`berth_core::Compensation`]). Stored under
//! `credits/<partition>` in the same write as the job record of the
//! eviction or broken promise, so a host killed at any moment neither
//! loses a credit nor counts one twice.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One tenant's account in one partition.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantCredits {
    pub preemptions: u64,
    pub lost_gpu_s: f64,
    pub broken_promises: u64,
    pub credit_gpu_h: f64,
}

/// A partition's ledger, by tenant (identity name).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Credits {
    pub tenants: BTreeMap<String, TenantCredits>,
}

pub(crate) fn key(partition: &str) -> String {
    format!("credits/{partition}")
}

impl Credits {
    /// A preemption of `tenant`'s job that lost `lost_gpu_s` and is owed
    /// `credit_gpu_h`, breaking a promise or not.
    pub fn preempted(&mut self, tenant: &str, lost_gpu_s: f64, credit_gpu_h: f64, broken: bool) {
        let t = self.tenants.entry(tenant.to_string()).or_default();
        t.preemptions += 1;
        t.lost_gpu_s += lost_gpu_s;
        t.credit_gpu_h += credit_gpu_h;
        t.broken_promises += u64::from(broken);
    }

    /// A promise broken outside a preemption (a run stopped by the host,
    /// an outage past its bound).
    pub fn broken(&mut self, tenant: &str, lost_gpu_s: f64, credit_gpu_h: f64) {
        let t = self.tenants.entry(tenant.to_string()).or_default();
        t.lost_gpu_s += lost_gpu_s;
        t.credit_gpu_h += credit_gpu_h;
        t.broken_promises += 1;
    }

    pub(crate) fn stored(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("credits serialize")
    }

    pub(crate) fn restore(bytes: &[u8]) -> anyhow::Result<Credits> {
        Ok(serde_json::from_slice(bytes)?)
    }
}
