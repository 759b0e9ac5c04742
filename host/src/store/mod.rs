//! Durable state of the live host: jobs, allocations, agent nodes and the
//! policy registry's metadata, as keys and values behind one small trait,
//! so `berth serve` does not know where they live. Embedded by default
//! ([`redb`], a file in the state directory); etcd for high availability
//! ([`etcd`], with leader election through a lease: only the leader's
//! writes are accepted).
//!
//! Keys are `/`-separated text; values are JSON (component bytes raw).

pub mod etcd;
pub mod redb;

/// One change of an atomic batch.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Put(String, Vec<u8>),
    Delete(String),
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Backend(String),
    /// This host no longer holds the leader lease: its writes are refused.
    #[error("not the leader: {0}")]
    Fenced(String),
}

/// A store the caller built, shared (the simulation test wraps the embedded
/// one to inject write failures).
#[derive(Clone)]
pub struct SharedStore(pub std::sync::Arc<dyn Store>);

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

pub trait Store: Send + Sync {
    /// Every key under `prefix` with its value, in key order.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// Applies every op or none (and, on etcd, only while leader).
    fn apply(&self, ops: Vec<Op>) -> Result<(), StoreError>;
    /// Where the state lives, for logs.
    fn describe(&self) -> String;

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.list(key)?.into_iter().find(|(k, _)| k == key).map(|(_, v)| v))
    }

    fn put(&self, key: String, value: Vec<u8>) -> Result<(), StoreError> {
        self.apply(vec![Op::Put(key, value)])
    }
}
