//! Where the agent learns about its GPUs: NVML (the real driver, loaded at
//! run time) or a synthetic shape such as `8xH20`.

use serde::Serialize;

/// One GPU as discovered.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_total_mib: u64,
    pub pci_bus_id: String,
    /// PCI bus ids of NVLink peers over active links.
    pub nvlink_peers: Vec<String>,
}

/// A health event since the previous sample.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Event {
    /// "xid" or "ecc".
    pub kind: String,
    pub code: u64,
    pub detail: String,
}

/// One telemetry sample of one GPU.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Sample {
    pub index: u32,
    pub sm_util_pct: u32,
    pub memory_used_mib: u64,
    pub temperature_c: u32,
    pub power_mw: u32,
    pub events: Vec<Event>,
}

/// A source of GPUs and their telemetry.
pub trait DeviceSource: Send {
    /// "nvml" or "synthetic".
    fn kind(&self) -> &'static str;
    fn gpus(&self) -> &[Gpu];
    /// One sample per GPU; `busy` lists GPU indices running an allocation
    /// (used by the synthetic source to shape its numbers).
    fn sample(&mut self, busy: &[u32]) -> Vec<Sample>;
}

/// Memory (MiB) per synthetic model.
const MODELS: &[(&str, u64)] = &[
    ("H20", 96 * 1024),
    ("H100", 80 * 1024),
    ("H800", 80 * 1024),
    ("H200", 141 * 1024),
    ("A100", 80 * 1024),
    ("A800", 80 * 1024),
    ("L20", 48 * 1024),
    ("L40S", 48 * 1024),
    ("B200", 180 * 1024),
];

/// Deterministic synthetic GPUs: UUIDs `GPU-synthetic-<node>-<i>`, memory
/// from a small per-model table, telemetry that follows which GPUs are busy,
/// and optionally one injected XID event per listed GPU.
pub struct Synthetic {
    gpus: Vec<Gpu>,
    tick: u64,
    /// (GPU index, XID code) reported once, on the third sample (or the
    /// first after `trigger` exists).
    xids: Vec<(u32, u64)>,
    trigger: Option<std::path::PathBuf>,
    /// The sample the XIDs were reported on.
    fired_at: Option<u64>,
}

impl Synthetic {
    /// `shape` is `NxMODEL`, e.g. `8xH20`.
    pub fn new(node: &str, shape: &str, xids: Vec<(u32, u64)>) -> anyhow::Result<Synthetic> {
        let (n, model) = shape.split_once(['x', 'X']).ok_or_else(|| anyhow::anyhow!("--synthetic-gpus {shape:?}: expected NxMODEL, e.g. 8xH20"))?;
        let n: u32 = n.parse().map_err(|_| anyhow::anyhow!("--synthetic-gpus {shape:?}: {n:?} is not a GPU count"))?;
        anyhow::ensure!((1..=64).contains(&n), "--synthetic-gpus {shape:?}: between 1 and 64 GPUs");
        let (model, mem) = MODELS.iter().find(|(m, _)| m.eq_ignore_ascii_case(model)).copied().ok_or_else(|| {
            anyhow::anyhow!("--synthetic-gpus {shape:?}: unknown model {model:?} (known: {})", MODELS.iter().map(|m| m.0).collect::<Vec<_>>().join(", "))
        })?;
        for &(i, _) in &xids {
            anyhow::ensure!(i < n, "--synthetic-xid: GPU {i} does not exist (the node has {n})");
        }
        let gpus = (0..n)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-synthetic-{node}-{i}"),
                model: model.to_string(),
                memory_total_mib: mem,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10 % 0xe0),
                // A synthetic NVSwitch box: every GPU reaches every other.
                nvlink_peers: Vec::new(),
            })
            .collect();
        Ok(Synthetic { gpus, tick: 0, xids, trigger: None, fired_at: None })
    }

    /// The XIDs are reported on the first sample after `file` exists
    /// instead of the third: a test chooses the moment a GPU fails.
    pub fn xids_when(mut self, file: std::path::PathBuf) -> Synthetic {
        self.trigger = Some(file);
        self
    }
}

impl DeviceSource for Synthetic {
    fn kind(&self) -> &'static str {
        "synthetic"
    }

    fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    fn sample(&mut self, busy: &[u32]) -> Vec<Sample> {
        self.tick += 1;
        let tick = self.tick;
        if self.fired_at.is_none() && self.trigger.as_ref().map_or(tick == 3, |f| f.exists()) {
            self.fired_at = Some(tick);
        }
        let fire = self.fired_at == Some(tick);
        self.gpus
            .iter()
            .map(|g| {
                let on = busy.contains(&g.index);
                let util = if on { 85 + ((tick + g.index as u64) % 10) as u32 } else { 0 };
                let events = self
                    .xids
                    .iter()
                    .filter(|&&(i, _)| i == g.index && fire)
                    .map(|&(_, code)| Event { kind: "xid".into(), code, detail: format!("synthetic XID {code}") })
                    .collect();
                Sample {
                    index: g.index,
                    sm_util_pct: util,
                    memory_used_mib: if on { g.memory_total_mib * 3 / 4 } else { 0 },
                    temperature_c: 32 + util / 2,
                    power_mw: 60_000 + util * 4_000,
                    events,
                }
            })
            .collect()
    }
}

/// The real driver through NVML. The handle is leaked: it lives as long as
/// the agent, and the XID event set borrows it.
pub struct Nvml {
    nvml: &'static nvml_wrapper::Nvml,
    gpus: Vec<Gpu>,
    events: Option<nvml_wrapper::EventSet<'static>>,
    /// Volatile uncorrected ECC counts at the previous sample.
    ecc: Vec<Option<u64>>,
}

/// One line, whatever the error's own text holds.
fn line(e: impl std::fmt::Display) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

impl Nvml {
    /// Loads the driver's NVML and discovers the GPUs. The error is one line
    /// for people (no driver, no library, driver/library mismatch...).
    pub fn open() -> Result<Nvml, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(line)?;
        let nvml: &'static nvml_wrapper::Nvml = Box::leak(Box::new(nvml));
        let count = nvml.device_count().map_err(line)?;
        let mut gpus = Vec::new();
        let mut ecc = Vec::new();
        let mut events = nvml.create_event_set().ok();
        for i in 0..count {
            let d = nvml.device_by_index(i).map_err(|e| format!("GPU {i}: {}", line(e)))?;
            let mut peers = Vec::new();
            for link in 0..18 {
                let l = d.link_wrapper_for(link);
                if l.is_active().unwrap_or(false)
                    && let Ok(p) = l.remote_pci_info()
                    && !peers.contains(&p.bus_id)
                {
                    peers.push(p.bus_id);
                }
            }
            gpus.push(Gpu {
                index: i,
                uuid: d.uuid().map_err(line)?,
                model: d.name().map_err(line)?,
                memory_total_mib: d.memory_info().map_err(line)?.total >> 20,
                pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
                nvlink_peers: peers,
            });
            use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
            ecc.push(d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok());
            if let Some(set) = events.take() {
                use nvml_wrapper::bitmasks::event::EventTypes;
                // Not every GPU supports XID events; keep the set either way.
                events = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(set) => Some(set),
                    Err(e) => {
                        tracing::info!(target: "berth::agent", gpu = i, "no XID events: {}", line(e.error));
                        nvml.create_event_set().ok()
                    }
                };
            }
        }
        Ok(Nvml { nvml, gpus, events, ecc })
    }
}

impl DeviceSource for Nvml {
    fn kind(&self) -> &'static str {
        "nvml"
    }

    fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    fn sample(&mut self, _busy: &[u32]) -> Vec<Sample> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
        let mut out: Vec<Sample> = Vec::new();
        for g in &self.gpus {
            let Ok(d) = self.nvml.device_by_index(g.index) else {
                out.push(Sample { index: g.index, sm_util_pct: 0, memory_used_mib: 0, temperature_c: 0, power_mw: 0, events: Vec::new() });
                continue;
            };
            let mut events = Vec::new();
            if let Ok(now) = d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
                let before = self.ecc[g.index as usize].replace(now).unwrap_or(now);
                if now > before {
                    events.push(Event { kind: "ecc".into(), code: now - before, detail: format!("{} new uncorrected ECC errors", now - before) });
                }
            }
            out.push(Sample {
                index: g.index,
                sm_util_pct: d.utilization_rates().map_or(0, |u| u.gpu),
                memory_used_mib: d.memory_info().map_or(0, |m| m.used >> 20),
                temperature_c: d.temperature(TemperatureSensor::Gpu).unwrap_or(0),
                power_mw: d.power_usage().unwrap_or(0),
                events,
            });
        }
        // XID events pending in the set (no waiting).
        if let Some(set) = &self.events {
            while let Ok(e) = set.wait(0) {
                let uuid = e.device.uuid().unwrap_or_default();
                let code = match e.event_data {
                    Some(nvml_wrapper::enums::event::XidError::Value(v)) => v,
                    _ => 0,
                };
                if let Some(s) = self.gpus.iter().position(|g| g.uuid == uuid) {
                    out[s].events.push(Event { kind: "xid".into(), code, detail: format!("XID {code}") });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_shapes_are_deterministic_and_checked() {
        let mut s = Synthetic::new("n3", "4xh100", vec![(2, 48)]).unwrap();
        assert_eq!(s.gpus().len(), 4);
        assert_eq!(s.gpus()[1].uuid, "GPU-synthetic-n3-1");
        assert_eq!((s.gpus()[1].model.as_str(), s.gpus()[1].memory_total_mib), ("H100", 80 * 1024));
        let a = s.sample(&[1]);
        assert!(a[1].sm_util_pct > 0 && a[0].sm_util_pct == 0 && a[1].memory_used_mib > 0);
        assert!(a.iter().all(|x| x.events.is_empty()));
        s.sample(&[]);
        let third = s.sample(&[]);
        assert_eq!(third[2].events, vec![Event { kind: "xid".into(), code: 48, detail: "synthetic XID 48".into() }]);
        assert!(s.sample(&[]).iter().all(|x| x.events.is_empty()), "an injected XID is reported once");
        for bad in ["8", "0xH20", "8xQ1", "axH20", "65xH20"] {
            assert!(Synthetic::new("n", bad, Vec::new()).is_err(), "{bad}");
        }
        assert!(Synthetic::new("n", "2xH20", vec![(2, 79)]).is_err());
    }
}
