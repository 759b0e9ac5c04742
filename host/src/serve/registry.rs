//! The policy registry: per partition, numbered versions of content-addressed
//! components, and an append-only history of who did what. With a [`Store`]
//! (the host's redb or etcd), records and component bytes live there, so a
//! standby taking over from etcd has every version; the state directory
//! keeps a cache of the bytes and the engine's artifacts. Without one, on
//! disk under the state directory, every write atomic (temporary file, then
//! rename):
//!
//! ```text
//! components/<sha256>.wasm     the bytes, shared by every partition
//! artifacts/                   precompiled artifacts (the engine's cache)
//! partitions/<name>.json       versions, events, active version, shadow
//! ```
//!
//! In the store: `registry/<partition>` (the record, JSON) and
//! `components/<sha256>` (the bytes). A record found only on disk (a state
//! directory from before the store) is moved into the store on open.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::error::ServeError;
use crate::util::unix_ms;
use crate::store::Store;

/// One uploaded version of a partition's policy.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct VersionMeta {
    /// 1, 2, ... per partition.
    pub version: u32,
    pub sha256: String,
    /// What the component says about itself.
    pub name: String,
    pub semver: String,
    pub contract: String,
    /// Passed to `configure` on every instance.
    #[serde(default)]
    pub config: String,
    pub uploaded_by: String,
    pub uploaded_unix_ms: u64,
    #[serde(default)]
    pub note: String,
    /// Breaker backoff: not activatable before this time.
    #[serde(default)]
    pub blocked_until_unix_ms: u64,
    /// Times the breaker tripped on this version (the backoff doubles).
    #[serde(default)]
    pub trips: u32,
}

/// Something that happened to a partition's policies.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Event {
    pub unix_ms: u64,
    /// upload, activate, rollback, breaker, shadow, split, shadow-off
    pub kind: String,
    pub version: u32,
    pub by: String,
    #[serde(default)]
    pub detail: String,
}

/// A candidate running beside the active version.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShadowSetting {
    pub version: u32,
    /// None: shadow (recorded only); Some(f): split, a fraction f of jobs.
    pub split: Option<f64>,
}

/// Everything the registry keeps for one partition.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PartitionRecord {
    pub versions: Vec<VersionMeta>,
    pub events: Vec<Event>,
    pub active: Option<u32>,
    #[serde(default)]
    pub shadow: Option<ShadowSetting>,
}

impl PartitionRecord {
    pub fn version(&self, v: u32) -> Option<&VersionMeta> {
        self.versions.iter().find(|m| m.version == v)
    }
}

pub struct Registry {
    dir: PathBuf,
    partitions: Mutex<BTreeMap<String, PartitionRecord>>,
    store: Option<std::sync::Arc<dyn Store>>,
}

fn store_err(e: crate::store::StoreError) -> ServeError {
    ServeError::Store(std::io::Error::other(e.to_string()))
}

/// Hex SHA-256: a component's identity.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(bytes))
}

pub use crate::util::write_atomic;

impl Registry {
    /// Opens (or creates) the registry under `dir` for these partitions.
    pub fn open(dir: &Path, partitions: &[String]) -> Result<Registry, ServeError> {
        Registry::open_in(dir, partitions, None)
    }

    /// Opens the registry with its records and components in `store`.
    pub fn open_in(dir: &Path, partitions: &[String], store: Option<std::sync::Arc<dyn Store>>) -> Result<Registry, ServeError> {
        for sub in ["components", "artifacts", "partitions"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let mut records = BTreeMap::new();
        for name in partitions {
            let path = dir.join("partitions").join(format!("{name}.json"));
            let key = format!("registry/{name}");
            let stored = match &store {
                Some(s) => s.get(&key).map_err(store_err)?,
                None => None,
            };
            let (bytes, from) = match stored {
                Some(b) => (Some(b), key.clone()),
                None => match std::fs::read(&path) {
                    Ok(b) => (Some(b), path.display().to_string()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, String::new()),
                    Err(e) => return Err(e.into()),
                },
            };
            let record: PartitionRecord = match bytes {
                Some(b) => serde_json::from_slice(&b).map_err(|e| ServeError::Store(std::io::Error::other(format!("{from}: {e}"))))?,
                None => PartitionRecord::default(),
            };
            if let Some(s) = &store
                && from != key
                && record != PartitionRecord::default()
            {
                // A record from before the store: moved in, components too.
                for v in &record.versions {
                    if let Ok(bytes) = std::fs::read(dir.join("components").join(format!("{}.wasm", v.sha256))) {
                        s.put(format!("components/{}", v.sha256), bytes).map_err(store_err)?;
                    }
                }
                s.put(key, serde_json::to_vec_pretty(&record).expect("records serialize")).map_err(store_err)?;
            }
            records.insert(name.clone(), record);
        }
        Ok(Registry { dir: dir.to_path_buf(), partitions: Mutex::new(records), store })
    }

    /// Where the engine keeps precompiled artifacts.
    pub fn artifact_dir(&self) -> PathBuf {
        self.dir.join("artifacts")
    }

    fn component_path(&self, sha256: &str) -> PathBuf {
        self.dir.join("components").join(format!("{sha256}.wasm"))
    }

    /// Stores component bytes under their digest (once).
    pub fn put_component(&self, sha256: &str, bytes: &[u8]) -> Result<(), ServeError> {
        if let Some(s) = &self.store {
            let key = format!("components/{sha256}");
            if s.get(&key).map_err(store_err)?.is_none() {
                s.put(key, bytes.to_vec()).map_err(store_err)?;
            }
        }
        let path = self.component_path(sha256);
        if !path.exists() {
            write_atomic(&path, bytes)?;
        }
        Ok(())
    }

    /// A component's bytes: the local copy, else the store's (cached).
    pub fn component(&self, sha256: &str) -> Result<Vec<u8>, ServeError> {
        let path = self.component_path(sha256);
        match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.store.is_some() => {
                let s = self.store.as_ref().expect("checked");
                let bytes = s.get(&format!("components/{sha256}")).map_err(store_err)?.ok_or(e)?;
                write_atomic(&path, &bytes)?;
                Ok(bytes)
            }
            r => Ok(r?),
        }
    }

    /// A copy of one partition's record.
    pub fn record(&self, partition: &str) -> Result<PartitionRecord, ServeError> {
        self.partitions.lock().unwrap().get(partition).cloned().ok_or_else(|| ServeError::UnknownPartition(partition.into()))
    }

    /// Changes one partition's record and persists it before anyone else
    /// sees the change; on a failed write the change is undone.
    pub fn update<R>(&self, partition: &str, f: impl FnOnce(&mut PartitionRecord) -> Result<R, ServeError>) -> Result<R, ServeError> {
        let mut all = self.partitions.lock().unwrap();
        let record = all.get_mut(partition).ok_or_else(|| ServeError::UnknownPartition(partition.into()))?;
        let before = record.clone();
        let out = f(record)?;
        let json = serde_json::to_vec_pretty(record).expect("records serialize");
        let written = match &self.store {
            Some(s) => s.put(format!("registry/{partition}"), json).map_err(store_err),
            None => write_atomic(&self.dir.join("partitions").join(format!("{partition}.json")), &json).map_err(ServeError::from),
        };
        if let Err(e) = written {
            *record = before;
            return Err(e);
        }
        Ok(out)
    }

    /// Adds a version (or finds the same bytes and config already there).
    /// Returns it and whether it is new.
    pub fn add_version(&self, partition: &str, mut meta: VersionMeta) -> Result<(VersionMeta, bool), ServeError> {
        self.update(partition, |r| {
            if let Some(existing) = r.versions.iter().find(|v| v.sha256 == meta.sha256 && v.config == meta.config) {
                return Ok((existing.clone(), false));
            }
            meta.version = r.versions.iter().map(|v| v.version).max().unwrap_or(0) + 1;
            r.events.push(Event {
                unix_ms: unix_ms(),
                kind: "upload".into(),
                version: meta.version,
                by: meta.uploaded_by.clone(),
                detail: format!("{}@{} sha256 {}", meta.name, meta.semver, meta.sha256),
            });
            r.versions.push(meta.clone());
            Ok((meta, true))
        })
    }
}
