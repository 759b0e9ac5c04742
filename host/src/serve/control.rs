//! Policy operations on the live host: upload (validated by a smoke call),
//! activate (hot swap), roll back, shadow / split candidates, and the
//! breaker's trip. Callers check access; these record who.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::sim::Job;
use berth_core::{Placer, TaskShape};
use berth_sdk::Hooks;

use super::registry::{Event, ShadowSetting, VersionMeta};
use super::deciding::Trip;
use super::state::{hook_key, Arm, Candidate, Live, PolicyHook};
use super::shadow::{self, Mode};
use super::error::ServeError;
use crate::util::unix_ms;
use crate::wasm::{LoadedPolicy, WasmPolicy};

/// Longest policy configuration an upload may carry, in bytes.
pub const MAX_CONFIG_BYTES: usize = 64 << 10;
/// Longest note an upload may carry, in bytes.
pub const MAX_NOTE_BYTES: usize = 1024;

/// The result of an activation.
pub struct Swap {
    pub active: VersionMeta,
    pub previous: Option<VersionMeta>,
    /// From the request to the new version being the one that decides.
    pub took: Duration,
}

/// Activation-like events, newest last: the versions a partition ran.
fn activations(events: &[Event]) -> impl DoubleEndedIterator<Item = &Event> {
    events.iter().filter(|e| matches!(e.kind.as_str(), "activate" | "rollback" | "breaker"))
}

impl Live {
    /// Loads an uploaded component for its smoke call: it must implement
    /// `hook` (named `name` in the error) and accept `config`.
    fn smoke_policy(&self, bytes: &[u8], config: &str, hook: Hooks, name: &str) -> Result<(Arc<LoadedPolicy>, WasmPolicy), ServeError> {
        let loaded = LoadedPolicy::from_bytes(&self.engine, bytes).map_err(|e| ServeError::Rejected(e.to_string()))?;
        if !loaded.info.hooks.contains(hook) {
            return Err(ServeError::Rejected(format!("{} does not implement the {name} hook", loaded.info.name)));
        }
        let mut policy = WasmPolicy::new(self.engine.clone(), loaded.clone(), self.limits);
        if !config.is_empty() {
            policy.configure(config).map_err(|e| ServeError::Rejected(format!("configure: {e}")))?;
        }
        Ok((loaded, policy))
    }

    /// Checks a component the way a decision would use it: loads it, then
    /// places one task and one two-task gang on a small synthetic fleet.
    fn smoke(&self, bytes: &[u8], config: &str) -> Result<Arc<LoadedPolicy>, ServeError> {
        let (loaded, mut policy) = self.smoke_policy(bytes, config, Hooks::SCORE, "score")?;
        let mut fleet = crate::synth::fleet(40, 3, true);
        let shape = TaskShape { gpu_count: 1, gpu_milli: 500, cpu_milli: 1000, memory_mib: 1024, models: vec![] };
        for tasks in [1, 2] {
            let job = Job { id: 0, duration_s: 1, tasks, shape: shape.clone(), ..Job::default() };
            let mut placements = 0;
            berth_core::sim::place_gang(&mut fleet, &mut Placer::new(), &mut policy, &job, &mut placements, &|_, _| true)
                .map_err(|e| ServeError::Rejected(format!("smoke call ({tasks} task(s) on a 40-node test fleet) failed: {e}")))?;
        }
        Ok(loaded)
    }

    /// Checks a rank component: loads it, then ranks three victims for a
    /// demand (the core validates the answer as it would live).
    fn smoke_rank(&self, bytes: &[u8], config: &str) -> Result<Arc<LoadedPolicy>, ServeError> {
        let (loaded, mut policy) = self.smoke_policy(bytes, config, Hooks::RANK, "rank")?;
        let mut fleet = crate::synth::fleet(3, 1, false);
        let gpus = fleet.nodes().iter().map(|n| n.gpus.len()).min().unwrap_or(0) as u32;
        let shape = TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![] };
        let mut held = Vec::new();
        for node in 0..3u32 {
            let n = &fleet.nodes()[node as usize];
            let a = berth_core::Allocation { node, gpus: (1u64 << n.gpus.len()) - 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
            fleet.allocate(&a).map_err(|e| ServeError::Rejected(format!("rank smoke fleet: {e}")))?;
            held.push(a);
        }
        let jobs: Vec<Job> = (0..held.len() as u64).map(|k| Job { id: k + 1, duration_s: 3600, tasks: 1, shape: shape.clone(), ..Job::default() }).collect();
        let candidates: Vec<berth_core::preemption::Candidate> = jobs
            .iter()
            .zip(&held)
            .enumerate()
            .map(|(k, (job, a))| berth_core::preemption::Candidate {
                job,
                held: std::slice::from_ref(a),
                running_s: 600 * (k as u64 + 1),
                remaining_s: 3000,
                since_checkpoint_s: 300 * k as u64,
                // One of each tier a ranker may be shown.
                tier: if k % 2 == 0 { berth_core::Tier::Preemptible } else { berth_core::Tier::Opportunistic },
                interruptions_left: if k % 2 == 0 { 2 } else { u32::MAX },
            })
            .collect();
        let demand = Job { id: 99, priority: 9, duration_s: 60, tasks: 1, shape, ..Job::default() };
        berth_core::preemption::select_victims(&fleet, &mut policy, &demand, &candidates, &|_, _| true)
            .map_err(|e| ServeError::Rejected(format!("smoke call (rank 3 victims) failed: {e}")))?;
        Ok(loaded)
    }

    /// Checks a compact component: loads it, then plans once over a small
    /// fragmented fleet (the core validates the plan as it would live).
    fn smoke_compact(&self, bytes: &[u8], config: &str) -> Result<Arc<LoadedPolicy>, ServeError> {
        let (loaded, mut policy) = self.smoke_policy(bytes, config, Hooks::COMPACT, "compact")?;
        let mut fleet = crate::synth::fleet(4, 1, false);
        let nodes: Vec<u32> = (0..fleet.nodes().len() as u32).collect();
        let cc = berth_core::compaction::CompactionConfig::default();
        let mut running = Vec::new();
        for &node in &nodes {
            // One GPU busy on every node: fragmented.
            let a = berth_core::Allocation { node, gpus: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
            fleet.allocate(&a).map_err(|e| ServeError::Rejected(format!("compact smoke fleet: {e}")))?;
            running.push(berth_core::compaction::Running {
                id: node,
                job_id: u64::from(node) + 1,
                node,
                gpus: 1,
                gpu_milli: 1000,
                cpu_milli: 1000,
                memory_mib: 1024,
                priority: 0,
                movable: true,
                gang_id: 0,
                state_bytes: berth_core::compaction::estimate_state_bytes(&cc, 1, 1000, 1024),
                remaining_s: 3600,
                running_s: 600,
                since_checkpoint_s: 60,
                last_moved_s: None,
                class: berth_core::TaskClass::Training,
            });
        }
        let planned = berth_core::compaction::plan(&fleet, &nodes, &running, &[], &mut policy, &cc, 0);
        if let Some(e) = planned.rejected {
            return Err(ServeError::Rejected(format!("smoke call (plan over 4 fragmented nodes) failed: {e}")));
        }
        Ok(loaded)
    }

    /// Checks a pool component: loads it and, where it places, places two
    /// executors' models of a small catalog (validated as live).
    fn smoke_pool(&self, bytes: &[u8], config: &str) -> Result<Arc<LoadedPolicy>, ServeError> {
        use berth_core::pool::PoolPolicy;
        let loaded = LoadedPolicy::from_bytes(&self.engine, bytes).map_err(|e| ServeError::Rejected(e.to_string()))?;
        if !loaded.info.hooks.contains(Hooks::POOL_PLACE) && !loaded.info.hooks.contains(Hooks::POOL_STEP) {
            return Err(ServeError::Rejected(format!("{} implements neither pool-place nor pool-step", loaded.info.name)));
        }
        let mut policy = WasmPolicy::new(self.engine.clone(), loaded.clone(), self.limits);
        if !config.is_empty() {
            policy.configure(config).map_err(|e| ServeError::Rejected(format!("configure: {e}")))?;
        }
        if loaded.info.hooks.contains(Hooks::POOL_PLACE) {
            let cfg = crate::pool::PoolFile::load("default").map_err(|e| ServeError::FailedPrecondition(format!("{e:#}")))?.config();
            let executors = [(1, cfg.executor_memory(1)), (4, cfg.executor_memory(4))];
            let state = crate::serve::pooling::smoke_state(&cfg, &executors);
            let placed = policy.pool_place(&state).map_err(|e| ServeError::Rejected(format!("smoke call (pool-place, 2 executors) failed: {e}")))?;
            if let Some(p) = placed {
                berth_core::pool::check_placement(&cfg, &executors, &p).map_err(|e| ServeError::Rejected(format!("smoke call (pool-place, 2 executors): {e}")))?;
            }
        }
        Ok(loaded)
    }

    /// Registers a component as the partition's next placement version (or
    /// returns the version that already has these bytes and config).
    pub fn upload(&self, by: &str, partition: &str, bytes: &[u8], config: &str, note: &str) -> Result<(VersionMeta, bool), ServeError> {
        self.upload_hook(by, partition, PolicyHook::Place, bytes, config, note)
    }

    /// [`Live::upload`] for any hook.
    pub fn upload_hook(&self, by: &str, partition: &str, hook: PolicyHook, bytes: &[u8], config: &str, note: &str) -> Result<(VersionMeta, bool), ServeError> {
        self.partition_index(partition)?;
        if bytes.len() > self.max_upload_bytes {
            return Err(ServeError::TooLarge { size: bytes.len(), limit: self.max_upload_bytes });
        }
        if bytes.is_empty() {
            return Err(ServeError::Invalid("empty component".into()));
        }
        if config.len() > MAX_CONFIG_BYTES {
            return Err(ServeError::Invalid(format!("config is {} bytes: at most {MAX_CONFIG_BYTES}", config.len())));
        }
        if note.len() > MAX_NOTE_BYTES {
            return Err(ServeError::Invalid(format!("note is {} bytes: at most {MAX_NOTE_BYTES}", note.len())));
        }
        let sha256 = super::registry::sha256_hex(bytes);
        self.access.allow_component(&sha256)?;
        let loaded = match hook {
            PolicyHook::Place => self.smoke(bytes, config)?,
            PolicyHook::Rank => self.smoke_rank(bytes, config)?,
            PolicyHook::Compact => self.smoke_compact(bytes, config)?,
            PolicyHook::Pool => self.smoke_pool(bytes, config)?,
        };
        self.registry.put_component(&sha256, bytes)?;
        let meta = VersionMeta {
            version: 0,
            sha256,
            name: loaded.info.name.clone(),
            semver: loaded.info.version.clone(),
            contract: loaded.contract.to_string(),
            config: config.to_string(),
            uploaded_by: by.to_string(),
            uploaded_unix_ms: unix_ms(),
            note: note.to_string(),
            blocked_until_unix_ms: 0,
            trips: 0,
        };
        let (meta, created) = self.registry.add_version(&hook_key(partition, hook), meta)?;
        tracing::info!(target: "berth::serve", partition, version = meta.version, by, created, "policy {}@{} uploaded", meta.name, meta.semver);
        Ok((meta, created))
    }

    fn load_arm(&self, meta: &VersionMeta) -> Result<Arm, ServeError> {
        let bytes = self.registry.component(&meta.sha256)?;
        Arm::load(&self.engine, &bytes, meta.clone(), self.limits)
            .map_err(|e| ServeError::FailedPrecondition(format!("version {} no longer loads: {e}", meta.version)))
    }

    /// Makes `version` the partition's active policy: the next decision is
    /// made by it; a decision in flight finishes on the old one.
    pub fn activate(&self, by: &str, partition: &str, version: u32, kind: &str) -> Result<Swap, ServeError> {
        self.activate_hook(by, partition, PolicyHook::Place, version, kind)
    }

    /// [`Live::activate`] for any hook. A rank version decides the next
    /// preemption; it has no candidate.
    pub fn activate_hook(&self, by: &str, partition: &str, hook: PolicyHook, version: u32, kind: &str) -> Result<Swap, ServeError> {
        if hook != PolicyHook::Place {
            return self.activate_aux(by, partition, hook, version, kind);
        }
        let started = Instant::now();
        let p = self.partition_index(partition)?;
        let part = &self.partitions[p];
        let record = self.registry.record(partition)?;
        let meta = record.version(version).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: partition.into(), version })?;
        let now = unix_ms();
        if meta.blocked_until_unix_ms > now {
            return Err(ServeError::FailedPrecondition(format!(
                "version {version} tripped the circuit breaker; it may be activated again in {} s",
                (meta.blocked_until_unix_ms - now).div_ceil(1000)
            )));
        }
        let arm = Arc::new(self.load_arm(&meta)?);
        let promoted = part.candidate().is_some_and(|c| c.arm.meta.version == version);
        self.registry.update(partition, |r| {
            r.active = Some(version);
            r.events.push(Event { unix_ms: now, kind: kind.into(), version, by: by.into(), detail: format!("{}@{}", meta.name, meta.semver) });
            if promoted {
                r.shadow = None;
                r.events.push(Event { unix_ms: now, kind: "shadow-off".into(), version, by: by.into(), detail: "candidate promoted".into() });
            }
            Ok(())
        })?;
        let previous = part.place.active.lock().unwrap().replace(arm);
        let took = started.elapsed();
        if promoted {
            *part.place.candidate.lock().unwrap() = None;
        }
        part.poke(true);
        self.metrics.swaps.with_label_values(&[partition, kind]).inc();
        self.metrics.swap_seconds.with_label_values(&[partition]).observe(took.as_secs_f64());
        tracing::info!(target: "berth::serve", partition, version, by, swap_us = took.as_micros() as u64, "policy {kind}: {}@{}", meta.name, meta.semver);
        Ok(Swap { active: meta, previous: previous.map(|a| a.meta.clone()), took })
    }

    /// Activation of a rank or compact version: it decides the next
    /// preemption or compaction step; it has no split candidate.
    fn activate_aux(&self, by: &str, partition: &str, hook: PolicyHook, version: u32, kind: &str) -> Result<Swap, ServeError> {
        let started = Instant::now();
        let p = self.partition_index(partition)?;
        let key = hook_key(partition, hook);
        let record = self.registry.record(&key)?;
        let meta = record.version(version).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: key.clone(), version })?;
        let now = unix_ms();
        if meta.blocked_until_unix_ms > now {
            return Err(ServeError::FailedPrecondition(format!(
                "{} version {version} tripped the circuit breaker; it may be activated again in {} s",
                hook.as_str(),
                (meta.blocked_until_unix_ms - now).div_ceil(1000)
            )));
        }
        let arm = Arc::new(self.load_arm(&meta)?);
        self.registry.update(&key, |r| {
            r.active = Some(version);
            r.events.push(Event { unix_ms: now, kind: kind.into(), version, by: by.into(), detail: format!("{}@{}", meta.name, meta.semver) });
            Ok(())
        })?;
        let part = &self.partitions[p];
        let previous = part.aux(hook).lock().unwrap().replace(arm);
        part.poke(false);
        self.metrics.swaps.with_label_values(&[&key, kind]).inc();
        tracing::info!(target: "berth::serve", partition, version, by, "{} policy {kind}: {}@{}", hook.as_str(), meta.name, meta.semver);
        Ok(Swap { active: meta, previous: previous.map(|a| a.meta.clone()), took: started.elapsed() })
    }

    /// Loads the partition's active rank or compact version at startup, if
    /// it has one (none: the hook's fallback).
    pub fn restore_aux(&self, partition: &str, hook: PolicyHook) -> Result<(), ServeError> {
        let p = self.partition_index(partition)?;
        let key = hook_key(partition, hook);
        if let Some(v) = self.registry.record(&key)?.active {
            let record = self.registry.record(&key)?;
            let meta = record.version(v).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: key.clone(), version: v })?;
            *self.partitions[p].aux(hook).lock().unwrap() = Some(Arc::new(self.load_arm(&meta)?));
        }
        // A candidate in shadow comes back too.
        let record = self.registry.record(&key)?;
        if let Some(shadow) = &record.shadow
            && let Some(meta) = record.version(shadow.version).cloned()
        {
            *self.partitions[p].aux_candidate(hook).lock().unwrap() = Some(Arc::new(self.load_arm(&meta)?));
        }
        Ok(())
    }

    /// Puts a rank, compact or pool version in shadow beside the
    /// partition's active one (or takes it out with `None`): it ranks every
    /// preemption's victims, plans on every compaction step's snapshot, or
    /// places on every pool replan and steps inside every executor, too,
    /// never actuated, and its choices are tallied.
    pub fn set_aux_shadow(&self, by: &str, partition: &str, hook: PolicyHook, version: Option<u32>) -> Result<(), ServeError> {
        let p = self.partition_index(partition)?;
        let part = &self.partitions[p];
        let key = hook_key(partition, hook);
        let now = unix_ms();
        let arm = match version {
            None => None,
            Some(v) => {
                let record = self.registry.record(&key)?;
                let meta = record.version(v).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: key.clone(), version: v })?;
                if record.active == Some(v) {
                    return Err(ServeError::FailedPrecondition(format!("{} version {v} is already active in {partition}", hook.as_str())));
                }
                Some(Arc::new(self.load_arm(&meta)?))
            }
        };
        self.registry.update(&key, |r| {
            r.shadow = version.map(|v| ShadowSetting { version: v, split: None });
            let kind = if version.is_some() { "shadow" } else { "shadow-off" };
            r.events.push(Event { unix_ms: now, kind: kind.into(), version: version.unwrap_or(0), by: by.into(), detail: String::new() });
            Ok(())
        })?;
        *part.rank.stats.lock().unwrap() = shadow::RankStats::default();
        *part.compact.stats.lock().unwrap() = shadow::CompactStats::default();
        *part.pool.stats.lock().unwrap() = shadow::PoolStats::default();
        *part.aux_candidate(hook).lock().unwrap() = arm;
        Ok(())
    }

    /// A rank or compact breaker tripped: the version is blocked for the
    /// backoff and the hook's fallback takes over.
    pub(super) fn trip_aux(&self, p: usize, hook: PolicyHook, arm: &Arc<Arm>, reason: &str) {
        let part = &self.partitions[p];
        let key = hook_key(&part.name, hook);
        let version = arm.meta.version;
        let now = unix_ms();
        self.metrics.breaker_trips.with_label_values(&[&key, &version.to_string()]).inc();
        let _ = self.registry.update(&key, |r| {
            if let Some(meta) = r.versions.iter_mut().find(|m| m.version == version) {
                meta.trips += 1;
                meta.blocked_until_unix_ms = now + self.breaker.backoff_for(meta.trips).as_millis() as u64;
            }
            r.active = None;
            r.events.push(Event { unix_ms: now, kind: "breaker".into(), version, by: "breaker".into(), detail: format!("{} takes over: {reason}", hook.fallback()) });
            Ok(())
        });
        *part.aux(hook).lock().unwrap() = None;
        tracing::warn!(target: "berth::serve", partition = %part.name, version, "{} circuit breaker tripped: {reason}; {} decides", hook.as_str(), hook.fallback());
    }

    /// Activates an earlier version: `version`, or the one active before
    /// the current one.
    pub fn rollback(&self, by: &str, partition: &str, version: Option<u32>) -> Result<Swap, ServeError> {
        self.rollback_hook(by, partition, PolicyHook::Place, version)
    }

    /// [`Live::rollback`] for any hook.
    pub fn rollback_hook(&self, by: &str, partition: &str, hook: PolicyHook, version: Option<u32>) -> Result<Swap, ServeError> {
        let record = self.registry.record(&hook_key(partition, hook))?;
        let target = match version {
            Some(v) => v,
            None => activations(&record.events)
                .rev()
                .map(|e| e.version)
                .find(|&v| Some(v) != record.active)
                .ok_or_else(|| ServeError::FailedPrecondition(format!("partition {partition} has no earlier version to roll back to")))?,
        };
        self.activate_hook(by, partition, hook, target, "rollback")
    }

    /// Sets (or with `None` clears) the partition's candidate.
    pub fn set_shadow(&self, by: &str, partition: &str, setting: Option<(u32, Mode)>) -> Result<(), ServeError> {
        let p = self.partition_index(partition)?;
        let part = &self.partitions[p];
        let now = unix_ms();
        let Some((version, mode)) = setting else {
            self.registry.update(partition, |r| {
                r.shadow = None;
                r.events.push(Event { unix_ms: now, kind: "shadow-off".into(), version: 0, by: by.into(), detail: String::new() });
                Ok(())
            })?;
            *part.place.candidate.lock().unwrap() = None;
            return Ok(());
        };
        if let Mode::Split(f) = mode
            && !(f > 0.0 && f <= 1.0)
        {
            return Err(ServeError::Invalid(format!("split fraction {f} is not in (0, 1]")));
        }
        let record = self.registry.record(partition)?;
        let meta = record.version(version).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: partition.into(), version })?;
        if record.active == Some(version) {
            return Err(ServeError::FailedPrecondition(format!("version {version} is already active in {partition}")));
        }
        if meta.blocked_until_unix_ms > now {
            return Err(ServeError::FailedPrecondition(format!("version {version} is in circuit-breaker backoff")));
        }
        let arm = Arc::new(self.load_arm(&meta)?);
        let (kind, detail) = match mode {
            Mode::Shadow => ("shadow", String::new()),
            Mode::Split(f) => ("split", format!("fraction {f}")),
        };
        self.registry.update(partition, |r| {
            r.shadow = Some(ShadowSetting { version, split: match mode { Mode::Split(f) => Some(f), Mode::Shadow => None } });
            r.events.push(Event { unix_ms: now, kind: kind.into(), version, by: by.into(), detail });
            Ok(())
        })?;
        *part.place.stats.lock().unwrap() = shadow::Stats::default();
        *part.place.candidate.lock().unwrap() = Some(Arc::new(Candidate { arm, mode }));
        part.poke(false);
        Ok(())
    }

    /// Restores a partition at startup: its active version and candidate
    /// from the registry, or `default` (component bytes) as version 1.
    pub fn restore(&self, partition: &str, default: &[u8]) -> Result<(), ServeError> {
        let p = self.partition_index(partition)?;
        let record = self.registry.record(partition)?;
        match record.active {
            Some(v) => {
                let meta = record.version(v).cloned().ok_or_else(|| ServeError::UnknownVersion { partition: partition.into(), version: v })?;
                *self.partitions[p].place.active.lock().unwrap() = Some(Arc::new(self.load_arm(&meta)?));
            }
            None => {
                let (meta, _) = self.upload("system", partition, default, "", "default policy")?;
                self.activate("system", partition, meta.version, "activate")?;
            }
        }
        if let Some(s) = record.shadow {
            let mode = s.split.map_or(Mode::Shadow, Mode::Split);
            if let Err(e) = self.set_shadow("system", partition, Some((s.version, mode))) {
                tracing::warn!(target: "berth::serve", partition, "candidate not restored: {e}");
            }
        }
        Ok(())
    }

    /// The breaker tripped on `arm`: block it for the backoff, and roll the
    /// partition back to the last good version (or drop the candidate).
    pub(super) fn trip(&self, p: usize, arm: &Arc<Arm>, reason: &str, is_active: bool) -> Trip {
        let part = &self.partitions[p];
        let version = arm.meta.version;
        let now = unix_ms();
        self.metrics.breaker_trips.with_label_values(&[&part.name, &version.to_string()]).inc();
        let blocked = self.registry.update(&part.name, |r| {
            let meta = r.versions.iter_mut().find(|m| m.version == version).expect("running versions are registered");
            meta.trips += 1;
            let backoff = self.breaker.backoff_for(meta.trips);
            meta.blocked_until_unix_ms = now + backoff.as_millis() as u64;
            Ok(backoff)
        });
        let backoff = blocked.map_or_else(|e| format!("(backoff not persisted: {e})"), |b| format!("blocked for {} s", b.as_secs()));
        tracing::warn!(target: "berth::serve", partition = %part.name, version, "circuit breaker tripped: {reason}; {backoff}");

        if !is_active {
            *part.place.candidate.lock().unwrap() = None;
            let _ = self.registry.update(&part.name, |r| {
                r.shadow = None;
                r.events.push(Event { unix_ms: now, kind: "breaker".into(), version, by: "breaker".into(), detail: format!("candidate dropped: {reason}") });
                Ok(())
            });
            return Trip::Replaced;
        }

        // The last good version: the newest earlier activation that is not
        // blocked, preferring one that has decided well here.
        let record = self.registry.record(&part.name).unwrap_or_default();
        let usable: Vec<u32> = activations(&record.events)
            .rev()
            .map(|e| e.version)
            .filter(|&v| v != version)
            .filter(|&v| record.version(v).is_some_and(|m| m.blocked_until_unix_ms <= now))
            .collect();
        let proven = usable.iter().copied().find(|&v| part.place.breaker.lock().unwrap().is_proven(v));
        for target in proven.into_iter().chain(usable.iter().copied()) {
            let meta = record.version(target).cloned().expect("filtered above");
            let Ok(good) = self.load_arm(&meta) else { continue };
            let _ = self.registry.update(&part.name, |r| {
                r.active = Some(target);
                r.events.push(Event {
                    unix_ms: now,
                    kind: "breaker".into(),
                    version: target,
                    by: "breaker".into(),
                    detail: format!("rolled back from version {version}: {reason}; {backoff}"),
                });
                Ok(())
            });
            *part.place.active.lock().unwrap() = Some(Arc::new(good));
            self.metrics.swaps.with_label_values(&[&part.name, "breaker"]).inc();
            tracing::warn!(target: "berth::serve", partition = %part.name, "rolled back from version {version} to version {target}");
            return Trip::Replaced;
        }
        *part.place.active.lock().unwrap() = None;
        let _ = self.registry.update(&part.name, |r| {
            r.active = None;
            r.events.push(Event {
                unix_ms: now,
                kind: "breaker".into(),
                version,
                by: "breaker".into(),
                detail: format!("no good version to roll back to; decisions paused: {reason}"),
            });
            Ok(())
        });
        Trip::Paused
    }
}
