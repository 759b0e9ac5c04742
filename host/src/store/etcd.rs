//! The etcd store, for hosts in high availability: state under a key
//! prefix, and leader election through a lease. A host grants itself a
//! lease, keeps it alive, and becomes leader by creating the leader key
//! bound to that lease (a transaction that succeeds only if the key is
//! absent); a standby polls until the key is gone (the leader's lease
//! expired: it died or was cut off) and takes it. Every write of the
//! leader is a transaction conditioned on the leader key still holding its
//! id, so a deposed leader's writes are refused ([`StoreError::Fenced`]),
//! never applied.
//!
//! The client is etcd's v3 gRPC API over the workspace's tonic (a subset of
//! etcd's protobuf, host/proto/etcd). It runs on a runtime of its own, so
//! the synchronous [`Store`] calls work from any thread.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::{Op, Store, StoreError};

/// etcd's protobuf (the subset in host/proto/etcd/rpc.proto).
pub mod pb {
    tonic::include_proto!("etcdserverpb");
}

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::request_op::Request;

#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs (http://host:port); the first that answers is used.
    pub endpoints: Vec<String>,
    /// Every key lives under this prefix (e.g. `/berth/`).
    pub prefix: String,
    /// The leader lease's time to live: a dead leader is replaced after
    /// about this long.
    pub lease_ttl: Duration,
    /// This host's identity in the election (unique per process).
    pub id: String,
}

pub struct EtcdStore {
    rt: Option<tokio::runtime::Runtime>,
    kv: KvClient<Channel>,
    lease_client: LeaseClient<Channel>,
    config: EtcdConfig,
    endpoint: String,
    leader_key: String,
    lease: i64,
    /// The lease could not be kept alive: this host may no longer lead.
    lost: Arc<AtomicBool>,
}

fn backend(what: &str) -> impl Fn(tonic::Status) -> StoreError + '_ {
    move |s| StoreError::Backend(format!("etcd {what}: {:?}: {}", s.code(), s.message()))
}

/// The end of the key range holding every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // the whole keyspace
}

/// Runs `f` on `rt` and waits for it from this (any) thread.
fn run_on<T: Send + 'static>(rt: &tokio::runtime::Runtime, f: impl Future<Output = T> + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv().expect("the etcd runtime runs")
}

/// How long a starting host tries its etcd endpoints before it gives up.
const ETCD_CONNECT_WAIT: Duration = Duration::from_secs(30);

impl EtcdStore {
    /// Connects, takes a lease, keeps it alive and campaigns: returns once
    /// this host leads (a standby waits here, logging who leads). Blocks:
    /// call from a thread that may block.
    pub fn lead(config: EtcdConfig) -> Result<EtcdStore, StoreError> {
        if config.endpoints.is_empty() {
            return Err(StoreError::Backend("no etcd endpoint given".into()));
        }
        let ttl = config.lease_ttl.as_secs().max(1) as i64;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("berth-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend(format!("etcd runtime: {e}")))?;
        let leader_key = format!("{}leader", config.prefix);
        let lost = Arc::new(AtomicBool::new(false));
        let (cfg, key, lost2) = (config.clone(), leader_key.clone(), lost.clone());
        let (kv, lease_client, endpoint, lease) = run_on(&rt, async move {
            let mut last = String::new();
            let mut channel = None;
            // etcd started beside the host (by hand, or by a service
            // manager at boot) may take a moment to answer.
            let give_up = tokio::time::Instant::now() + ETCD_CONNECT_WAIT;
            while channel.is_none() {
                for e in &cfg.endpoints {
                    match Channel::from_shared(e.clone()).map_err(|x| x.to_string())?.connect_timeout(Duration::from_secs(3)).connect().await {
                        Ok(c) => {
                            channel = Some((c, e.clone()));
                            break;
                        }
                        Err(x) => last = format!("{e}: {x}"),
                    }
                }
                if channel.is_none() {
                    if tokio::time::Instant::now() >= give_up {
                        return Err(format!("no etcd endpoint answered within {} s ({last})", ETCD_CONNECT_WAIT.as_secs()));
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            let (channel, endpoint) = channel.expect("connected");
            let mut kv = KvClient::new(channel.clone());
            let mut leases = LeaseClient::new(channel);
            let lease = leases.lease_grant(pb::LeaseGrantRequest { ttl, id: 0 }).await.map_err(|s| format!("lease grant: {}", s.message()))?.into_inner();
            if !lease.error.is_empty() {
                return Err(format!("lease grant: {}", lease.error));
            }
            let lease = lease.id;
            keep_alive(leases.clone(), lease, Duration::from_secs(ttl as u64), lost2).await.map_err(|s| format!("lease keep-alive: {}", s.message()))?;
            let mut announced = String::new();
            loop {
                let create = pb::TxnRequest {
                    compare: vec![pb::Compare {
                        result: CompareResult::Equal as i32,
                        target: CompareTarget::Create as i32,
                        key: key.clone().into_bytes(),
                        target_union: Some(TargetUnion::CreateRevision(0)),
                    }],
                    success: vec![pb::RequestOp { request: Some(Request::RequestPut(pb::PutRequest { key: key.clone().into_bytes(), value: cfg.id.clone().into_bytes(), lease })) }],
                    failure: vec![pb::RequestOp { request: Some(Request::RequestRange(pb::RangeRequest { key: key.clone().into_bytes(), ..Default::default() })) }],
                };
                let r = kv.txn(create).await.map_err(|s| format!("campaign: {}", s.message()))?.into_inner();
                if r.succeeded {
                    tracing::info!(target: "berth::store", id = %cfg.id, %endpoint, "leader: holding {key} with lease {lease:x}");
                    return Ok((kv, leases, endpoint, lease));
                }
                let holder = r
                    .responses
                    .first()
                    .and_then(|o| match &o.response {
                        Some(pb::response_op::Response::ResponseRange(rr)) => rr.kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned()),
                        _ => None,
                    })
                    .unwrap_or_default();
                if holder != announced {
                    tracing::info!(target: "berth::store", id = %cfg.id, "standby: {holder} leads; waiting for its lease to end");
                    announced = holder;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .map_err(StoreError::Backend)?;
        Ok(EtcdStore { rt: Some(rt), kv, lease_client, config, endpoint, leader_key, lease, lost })
    }

    /// One etcd call, bounded by the lease's time to live (5 s at least): the caller
    /// holds a partition's lock, and an etcd that stopped answering must
    /// not hold it (and every API call behind it) until TCP gives up. A
    /// write that timed out may or may not have applied, so the lease
    /// counts as lost: this host fences itself and a standby, reading the
    /// store, takes over.
    fn run<T: Send + 'static>(&self, what: &str, write: bool, f: impl Future<Output = Result<T, tonic::Status>> + Send + 'static) -> Result<T, StoreError> {
        let limit = self.config.lease_ttl.max(Duration::from_secs(5));
        // The timer is made on the etcd runtime (the caller has none).
        match run_on(self.rt.as_ref().expect("runtime until drop"), async move { tokio::time::timeout(limit, f).await }) {
            Ok(r) => r.map_err(backend(what)),
            Err(_) if write => {
                self.lost.store(true, Ordering::SeqCst);
                Err(StoreError::Fenced(format!("etcd {what}: no answer within {} s; {} stops writing", limit.as_secs(), self.config.id)))
            }
            Err(_) => Err(StoreError::Backend(format!("etcd {what}: no answer within {} s", limit.as_secs()))),
        }
    }

    fn full(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.config.prefix).into_bytes()
    }
}

/// Keeps the lease alive (a request every third of its TTL); marks it lost
/// when etcd stops confirming it.
async fn keep_alive(mut leases: LeaseClient<Channel>, lease: i64, ttl: Duration, lost: Arc<AtomicBool>) -> Result<(), tonic::Status> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::LeaseKeepAliveRequest { id: lease }).await.map_err(|_| tonic::Status::internal("keep-alive channel"))?;
    let mut answers = leases.lease_keep_alive(ReceiverStream::new(rx)).await?.into_inner();
    tokio::spawn(async move {
        let mut confirmed = Instant::now();
        loop {
            match tokio::time::timeout(ttl / 3, answers.message()).await {
                Ok(Ok(Some(r))) if r.ttl > 0 => confirmed = Instant::now(),
                Ok(Ok(Some(_))) | Ok(Ok(None)) | Ok(Err(_)) => {
                    lost.store(true, Ordering::SeqCst);
                    tracing::error!(target: "berth::store", "the etcd lease {lease:x} is gone: this host no longer leads");
                    return;
                }
                Err(_) if confirmed.elapsed() > ttl => {
                    lost.store(true, Ordering::SeqCst);
                    tracing::error!(target: "berth::store", "the etcd lease {lease:x} was not confirmed for {ttl:?}: this host no longer leads");
                    return;
                }
                Err(_) => {}
            }
            tokio::time::sleep(ttl / 3).await;
            if tx.send(pb::LeaseKeepAliveRequest { id: lease }).await.is_err() {
                return;
            }
        }
    });
    Ok(())
}

impl Store for EtcdStore {
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let key = self.full(prefix);
        let range_end = prefix_end(&key);
        let mut kv = self.kv.clone();
        let r = self.run("range", false, async move { kv.range(pb::RangeRequest { key, range_end, ..Default::default() }).await })?.into_inner();
        let strip = self.config.prefix.len();
        Ok(r.kvs.into_iter().map(|kv| (String::from_utf8_lossy(&kv.key[strip..]).into_owned(), kv.value)).collect())
    }

    fn apply(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(StoreError::Fenced(format!("the lease of {} is gone", self.config.id)));
        }
        let success = ops
            .into_iter()
            .map(|op| pb::RequestOp {
                request: Some(match op {
                    Op::Put(k, v) => Request::RequestPut(pb::PutRequest { key: self.full(&k), value: v, lease: 0 }),
                    Op::Delete(k) => Request::RequestDeleteRange(pb::DeleteRangeRequest { key: self.full(&k), range_end: Vec::new() }),
                }),
            })
            .collect();
        // Applied only while the leader key still names this host.
        let txn = pb::TxnRequest {
            compare: vec![pb::Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Value as i32,
                key: self.leader_key.clone().into_bytes(),
                target_union: Some(TargetUnion::Value(self.config.id.clone().into_bytes())),
            }],
            success,
            failure: Vec::new(),
        };
        let mut kv = self.kv.clone();
        let r = self.run("txn", true, async move { kv.txn(txn).await })?.into_inner();
        if r.succeeded {
            Ok(())
        } else {
            self.lost.store(true, Ordering::SeqCst);
            Err(StoreError::Fenced(format!("{} no longer holds {}", self.config.id, self.leader_key)))
        }
    }

    fn describe(&self) -> String {
        format!("etcd {}{} (leader {})", self.endpoint, self.config.prefix, self.config.id)
    }
}

impl Drop for EtcdStore {
    /// Resigns (revokes the lease, so a standby takes over at once), then
    /// stops the runtime without blocking the caller's.
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            let (mut leases, lease) = (self.lease_client.clone(), self.lease);
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            rt.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), leases.lease_revoke(pb::LeaseRevokeRequest { id: lease })).await;
                let _ = tx.send(());
            });
            let _ = rx.recv_timeout(Duration::from_secs(2));
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_next_key_after_every_key_with_the_prefix() {
        assert_eq!(prefix_end(b"/berth/jobs/"), b"/berth/jobs0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
