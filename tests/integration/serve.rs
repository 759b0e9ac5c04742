//! `berth serve` on loopback, driven through the generated gRPC client:
//! hot swap under concurrent submissions, shadow and split A/B, the circuit
//! breaker on a hostile version, access control, bad input, restart.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth::serve::breaker::BreakerConfig;
use berth::client::{connect, Client};
use berth::proto as pb;
use berth::serve::server::{ServeConfig, TlsFiles, DEFAULT_FLEET};
use berth::serve::{auth::Access, ServeHandle};
use berth::wasm::Limits;
use tonic::Code;

use crate::common::{guest_path, policy_path, repo_root};

pub(crate) const ACCESS: &str = r#"
[[identities]]
name = "ops"
token = "ops-test-token"
cert_sha256 = "bfc8317fb21abdda4898302a4456eadb629da1fda334a0a1fc79919266474330"
roles = { "*" = "operator" }

[[identities]]
name = "alice"
token = "alice-test-token"
roles = { "*" = "viewer", "p0" = "tenant", "p1" = "tenant", "p2" = "tenant" }

[[identities]]
name = "bob"
token = "bob-test-token"
roles = { "*" = "viewer", "p0" = "tenant" }
"#;

/// A fresh state directory for one test.
pub(crate) fn state_dir(name: &str) -> PathBuf {
    let dir = repo_root().join("target").join("tmp").join(format!("serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub(crate) fn config(dir: &Path, access: &str) -> ServeConfig {
    ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        inference_listen: None,
        state_dir: dir.to_path_buf(),
        fleet: berth::asi::fleet::FleetConfig::parse(DEFAULT_FLEET, "default").unwrap(),
        access: Access::parse(access).unwrap(),
        tls: None,
        default_policy: std::fs::read(policy_path("binpack")).unwrap(),
        // Generous: a loaded CI machine must not turn a slow honest call
        // into a failure.
        limits: Limits { deadline: Duration::from_secs(2), memory_bytes: 64 << 20, ..Limits::default() },
        breaker: BreakerConfig { failures: 3, backoff: Duration::from_secs(600), ..BreakerConfig::default() },
        max_upload_bytes: 1 << 20,
        store: Default::default(),
        scheduling: Default::default(),
    }
}

pub(crate) async fn client(h: &ServeHandle, token: &str) -> Client {
    connect(&format!("http://{}", h.addr), Some(token), None, None).await.expect("connect")
}

pub(crate) fn job(partition: &str, gpus: u32) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        job: Some(pb::JobSpec {
            partition: partition.into(),
            tasks: 1,
            gpus,
            gpu_milli: 1000,
            cpu_milli: 1000,
            memory_mib: 1024,
            duration_s: 3600.0,
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) async fn upload(c: &mut Client, partition: &str, path: PathBuf) -> u32 {
    let component = std::fs::read(path).unwrap();
    let r = c.upload_policy(pb::UploadPolicyRequest { partition: partition.into(), component, ..Default::default() }).await.expect("upload");
    r.into_inner().policy.unwrap().version
}

pub(crate) async fn jobs(c: &mut Client, partition: &str) -> Vec<pb::Job> {
    c.list_jobs(pb::ListJobsRequest { partition: partition.into(), limit: 100_000, ..Default::default() }).await.unwrap().into_inner().jobs
}

/// Waits until no job of the partition is pending (a liveness bound, not
/// a timing assertion: it only fails a test that would otherwise hang).
pub(crate) async fn settle(c: &mut Client, partition: &str) -> Vec<pb::Job> {
    let limit = Instant::now() + Duration::from_secs(120);
    loop {
        let all = jobs(c, partition).await;
        if all.iter().all(|j| j.state != "pending") {
            return all;
        }
        assert!(Instant::now() < limit, "jobs still pending: {:?}", all.iter().filter(|j| j.state == "pending").map(|j| j.id).collect::<Vec<_>>());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn decisions(c: &mut Client, partition: &str, shadow: bool) -> Vec<pb::Decision> {
    let req = pb::QueryDecisionsRequest { partition: partition.into(), limit: 100_000, include_shadow: shadow, ..Default::default() };
    c.query_decisions(req).await.unwrap().into_inner().decisions
}

/// Each job placed by exactly one actuated decision, and that decision is
/// the one the job records.
fn placed_once(all: &[pb::Job], log: &[pb::Decision]) {
    let mut placing: BTreeMap<u64, Vec<&pb::Decision>> = BTreeMap::new();
    for d in log.iter().filter(|d| d.actuated && d.outcome == "placed") {
        placing.entry(d.job_id).or_default().push(d);
    }
    for j in all {
        let ds = placing.remove(&j.id).unwrap_or_default();
        assert_eq!(ds.len(), 1, "job {} was placed by {} decisions", j.id, ds.len());
        assert_eq!(ds[0].id, j.decision_id, "job {} records another decision", j.id);
        assert_eq!(ds[0].policy_version, j.policy_version);
        assert_eq!(j.state, "running");
    }
    assert!(placing.is_empty(), "placements of unknown jobs: {:?}", placing.keys());
}

pub(crate) async fn metrics(h: &ServeHandle) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(h.metrics_addr.unwrap()).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn swap_under_concurrent_submissions_loses_and_duplicates_nothing() {
    let dir = state_dir("swap");
    let h = berth::serve::start(config(&dir, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let spread = upload(&mut ops, "p0", policy_path("spread")).await;
    assert_eq!(spread, 2, "binpack is version 1");

    let submitters: Vec<_> = (0..4)
        .map(|_| {
            let addr = h.addr;
            tokio::spawn(async move {
                let mut c = connect(&format!("http://{addr}"), Some("alice-test-token"), None, None).await.unwrap();
                let mut ids = Vec::new();
                for _ in 0..40 {
                    ids.push(c.submit_job(job("p0", 1)).await.expect("submit").into_inner().job_id);
                }
                ids
            })
        })
        .collect();
    let mut swaps = Vec::new();
    for i in 0..16 {
        let r = ops.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: [spread, 1][i % 2], ..Default::default() }).await.expect("activate");
        swaps.push(r.into_inner().swap_us);
    }
    let mut submitted = BTreeSet::new();
    for s in submitters {
        for id in s.await.unwrap() {
            assert!(submitted.insert(id), "job id {id} handed out twice");
        }
    }
    assert_eq!(submitted.len(), 160);
    // The last swap is the one in force.
    let parts = ops.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    let p0 = parts.iter().find(|p| p.name == "p0").unwrap();
    assert_eq!(p0.active.as_ref().map(|a| a.version), Some([spread, 1][15 % 2]), "{p0:?}");
    assert_eq!(swaps.len(), 16);

    let all = settle(&mut ops, "p0").await;
    assert_eq!(all.iter().map(|j| j.id).collect::<BTreeSet<_>>(), submitted, "every accepted job is there, no other");
    placed_once(&all, &decisions(&mut ops, "p0", false).await);

    // The last activation (binpack, version 1) decides the next job.
    let mut alice = client(&h, "alice-test-token").await;
    let next = alice.submit_job(job("p0", 1)).await.unwrap().into_inner().job_id;
    let all = settle(&mut ops, "p0").await;
    assert_eq!(all.iter().find(|j| j.id == next).unwrap().policy_version, 1);

    let text = metrics(&h).await;
    assert!(text.contains("berth_policy_swap_seconds_count{partition=\"p0\"} 17"), "{text}");
    assert!(text.contains("berth_decision_seconds_bucket{arm=\"active\""), "{text}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_records_without_actuating_and_split_divides_by_job() {
    let dir = state_dir("shadow");
    let h = berth::serve::start(config(&dir, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let mut alice = client(&h, "alice-test-token").await;
    let spread = upload(&mut ops, "p1", policy_path("spread")).await;
    ops.set_shadow(pb::SetShadowRequest { partition: "p1".into(), version: spread, mode: pb::ShadowMode::Shadow as i32, fraction: 0.0, ..Default::default() }).await.unwrap();
    for _ in 0..20 {
        alice.submit_job(job("p1", 1)).await.unwrap();
    }
    let all = settle(&mut ops, "p1").await;
    assert!(all.iter().all(|j| j.policy_version == 1), "the shadow candidate never actuates");
    let log = decisions(&mut ops, "p1", true).await;
    placed_once(&all, &log);
    let shadow: Vec<_> = log.iter().filter(|d| d.arm == "shadow").collect();
    assert_eq!(shadow.len(), 20);
    assert!(shadow.iter().all(|d| !d.actuated && d.policy == "spread" && d.policy_version == spread));
    // Same inputs: each shadow decision saw exactly what the active one saw.
    for d in &shadow {
        let active = log.iter().find(|a| a.job_id == d.job_id && a.arm == "active").unwrap();
        assert_eq!(active.input_digest, d.input_digest);
    }

    let r = ops.shadow_report(pb::ShadowReportRequest { partition: "p1".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(r.mode, "shadow");
    assert_eq!(r.samples, 20);
    // Binpack stacks jobs on one node; spread puts each on an idle one.
    assert!(r.agreement_rate < 0.5, "agreement {}", r.agreement_rate);
    assert!(!r.recent_diffs.is_empty());
    assert!(r.mean_candidate_score_gap > 0.0, "spread prefers its own picks");
    assert!(r.mean_partial_nodes_candidate > r.mean_partial_nodes_active, "spread leaves more nodes partly used");

    // Split: the candidate decides exactly the jobs its hash selects.
    ops.set_shadow(pb::SetShadowRequest { partition: "p1".into(), version: spread, mode: pb::ShadowMode::Split as i32, fraction: 0.5, ..Default::default() }).await.unwrap();
    let mut split_ids = Vec::new();
    for _ in 0..40 {
        split_ids.push(alice.submit_job(job("p1", 1)).await.unwrap().into_inner().job_id);
    }
    let all = settle(&mut ops, "p1").await;
    let mut by_candidate = 0;
    for j in all.iter().filter(|j| split_ids.contains(&j.id)) {
        let expect = if berth::serve::shadow::in_split(j.id, 0.5) { spread } else { 1 };
        assert_eq!(j.policy_version, expect, "job {}", j.id);
        by_candidate += u64::from(expect == spread);
    }
    let r = ops.shadow_report(pb::ShadowReportRequest { partition: "p1".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(r.arms.len(), 2);
    assert_eq!(r.arms[1].placed, by_candidate);
    assert_eq!(r.arms[0].placed + r.arms[1].placed, 40);
    h.shutdown().await;
}

/// A server whose partition p2 runs the hostile guest (it answers honestly
/// for job 0, the smoke call, so it is accepted; jobs 1, 2, 3 make it loop,
/// exhaust memory, panic) and four jobs of `priority` submitted to it: the
/// breaker trips at the third failure and the good version places every
/// job. Returns the server, the operator's and alice's clients, the hostile
/// version and the job ids.
async fn hostile_on_p2(name: &str, priority: u32) -> (ServeHandle, Client, Client, u32, Vec<u64>) {
    let dir = state_dir(name);
    let mut cfg = config(&dir, ACCESS);
    cfg.limits.deadline = Duration::from_millis(200);
    let h = berth::serve::start(cfg).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let mut alice = client(&h, "alice-test-token").await;
    let hostile = upload(&mut ops, "p2", guest_path("hostile")).await;
    ops.activate_policy(pb::ActivatePolicyRequest { partition: "p2".into(), version: hostile, ..Default::default() }).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let mut j = job("p2", 1);
        j.job.as_mut().unwrap().priority = priority;
        ids.push(alice.submit_job(j).await.unwrap().into_inner().job_id);
    }
    let all = settle(&mut ops, "p2").await;
    let log = decisions(&mut ops, "p2", false).await;
    placed_once(&all, &log);
    assert!(all.iter().all(|j| j.policy_version == 1), "the good version placed every job");
    let errors = log.iter().filter(|d| d.outcome == "error" && d.policy_version == hostile).count();
    assert_eq!(errors, 3, "the breaker trips at the third failure");
    (h, ops, alice, hostile, ids)
}

/// High-priority jobs are planned on the fleet as if no low-priority work
/// ran before they are placed: a failing policy there must still reach the
/// breaker, not stall the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_version_trips_the_breaker_for_high_priority_jobs_too() {
    let (h, mut ops, _, _, _) = hostile_on_p2("breaker-high", 5).await;
    let hist = ops.policy_history(pb::PolicyHistoryRequest { partition: "p2".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(hist.active_version, 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_version_trips_the_breaker_and_the_partition_rolls_back() {
    let (h, mut ops, mut alice, hostile, ids) = hostile_on_p2("breaker", 0).await;
    assert_eq!(ids, [1, 2, 3, 4], "a fresh server numbers jobs from 1");

    let hist = ops.policy_history(pb::PolicyHistoryRequest { partition: "p2".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(hist.active_version, 1);
    let trip = hist.events.iter().find(|e| e.kind == "breaker").expect("a breaker event");
    assert_eq!(trip.version, 1);
    assert!(trip.detail.contains("rolled back from version 2"), "{}", trip.detail);
    let v = hist.versions.iter().find(|v| v.policy.as_ref().unwrap().version == hostile).unwrap();
    assert!(v.blocked_until_unix_ms > berth::util::unix_ms());
    assert_eq!(v.uploaded_by, "ops");

    let again = ops.activate_policy(pb::ActivatePolicyRequest { partition: "p2".into(), version: hostile, ..Default::default() }).await.unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition, "{again:?}");
    let text = metrics(&h).await;
    assert!(text.contains("berth_breaker_trips_total{partition=\"p2\",version=\"2\"} 1"), "{text}");
    assert!(text.contains("berth_policy_failures_total{kind=\"timeout\",partition=\"p2\",policy=\"hostile\",version=\"2\"}"), "{text}");

    // Bad input gets a clear status and loses nothing already accepted.
    let bad = ops.upload_policy(pb::UploadPolicyRequest { partition: "p2".into(), component: b"not wasm".to_vec(), ..Default::default() }).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let big = ops.upload_policy(pb::UploadPolicyRequest { partition: "p2".into(), component: vec![0; (1 << 20) + 1], ..Default::default() }).await.unwrap_err();
    assert_eq!(big.code(), Code::ResourceExhausted, "{big:?}");
    assert!(big.message().contains("limit is 1048576"), "{big:?}");
    let mut bad_job = job("p2", 3);
    bad_job.job.as_mut().unwrap().gpu_milli = 500;
    let e = alice.submit_job(bad_job).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().contains("shared GPU"), "{e:?}");
    // A class must be one of three and agree with the shape; the one given
    // (or implied) is what the job shows.
    for (class, gpus, why) in [("gpu-heavy", 1, "one of training"), ("cpu-only", 1, "asks for no GPU"), ("inference", 0, "is cpu-only")] {
        let mut classed = job("p2", gpus);
        let spec = classed.job.as_mut().unwrap();
        spec.class = class.into();
        spec.gpu_milli = if gpus == 0 { 0 } else { 1000 };
        let e = alice.submit_job(classed).await.unwrap_err();
        assert!(e.code() == Code::InvalidArgument && e.message().contains(why), "{class}: {e:?}");
    }
    // Permission before existence: a tenant learns nothing about partitions
    // it holds no grant on, not even whether they exist.
    let e = alice.submit_job(job("nowhere", 1)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(jobs(&mut ops, "p2").await.len(), 4);

    // Why pending: per-node reasons, aggregated (p2 is all L20).
    let mut a100 = job("p2", 1);
    a100.job.as_mut().unwrap().models = vec!["A100".into()];
    let waiting = alice.submit_job(a100).await.unwrap().into_inner().job_id;
    let why = alice.explain_job(pb::ExplainJobRequest { job_id: waiting, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!((why.state.as_str(), why.summary.as_str()), ("pending", "32 nodes: GPU model mismatch"));
    let acc = ops.accounting(pb::AccountingRequest { partition: "p2".into() }).await.unwrap().into_inner();
    let p2 = acc.rows.iter().find(|r| r.group == "partition p2").unwrap().gpus.unwrap();
    assert_eq!((p2.installed, p2.busy), (256.0, 4.0));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_control_over_tls_refuses_what_roles_do_not_allow() {
    let dir = state_dir("access");
    let tls = repo_root().join("examples/serve/tls");
    let binpack = std::fs::read(policy_path("binpack")).unwrap();
    let allow = format!("allowed_components = [\"{}\", \"{}\"]\n{ACCESS}", berth::serve::registry::sha256_hex(&binpack), berth::serve::registry::sha256_hex(&std::fs::read(policy_path("spread")).unwrap()));
    let mut cfg = config(&dir, &allow);
    cfg.tls = Some(TlsFiles { cert: tls.join("server.pem"), key: tls.join("server.key"), client_ca: Some(tls.join("ca.pem")) });
    let h = berth::serve::start(cfg).await.unwrap();
    let url = format!("https://localhost:{}", h.addr.port());
    let ca = tls.join("ca.pem");
    let as_ = |token: Option<&'static str>| {
        let (url, ca) = (url.clone(), ca.clone());
        async move { connect(&url, token, Some(&ca), None).await.unwrap() }
    };

    let e = as_(None).await.list_partitions(pb::ListPartitionsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = as_(Some("no-such-token")).await.list_partitions(pb::ListPartitionsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    let mut alice = as_(Some("alice-test-token")).await;
    let mut bob = as_(Some("bob-test-token")).await;
    let e = alice
        .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component: std::fs::read(policy_path("spread")).unwrap(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = bob.submit_job(job("p1", 1)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "bob is only a viewer in p1");

    let mine = alice.submit_job(job("p0", 1)).await.unwrap().into_inner().job_id;
    let e = bob.cancel_job(pb::CancelJobRequest { job_id: mine }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("belongs to alice"));
    let r = alice.cancel_job(pb::CancelJobRequest { job_id: mine }).await.unwrap().into_inner();
    assert!(["pending", "running"].contains(&r.previous_state.as_str()));

    // The client certificate alone identifies ops, an operator.
    let mut ops = connect(&url, None, Some(&ca), Some((&tls.join("client.pem"), &tls.join("client.key")))).await.unwrap();
    let v = upload(&mut ops, "p0", policy_path("spread")).await;
    let hist = ops.policy_history(pb::PolicyHistoryRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(hist.versions.iter().find(|x| x.policy.as_ref().unwrap().version == v).unwrap().uploaded_by, "ops");
    // Off the allow-list: refused before it is compiled.
    let e = ops
        .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component: std::fs::read(guest_path("hostile")).unwrap(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("allow-list"));
    let text = metrics(&h).await;
    assert!(text.contains("berth_api_denials_total{code=\"permission_denied\"}"), "{text}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_survives_a_restart() {
    let dir = state_dir("restart");
    let h = berth::serve::start(config(&dir, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let spread = upload(&mut ops, "p0", policy_path("spread")).await;
    ops.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: spread, ..Default::default() }).await.unwrap();
    ops.set_shadow(pb::SetShadowRequest { partition: "p0".into(), version: 1, mode: pb::ShadowMode::Shadow as i32, fraction: 0.0, ..Default::default() }).await.unwrap();
    client(&h, "alice-test-token").await.submit_job(job("p0", 1)).await.unwrap();
    settle(&mut ops, "p0").await;
    let before = decisions(&mut ops, "p0", true).await;
    h.shutdown().await;

    let h = berth::serve::start(config(&dir, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let parts = ops.list_partitions(pb::ListPartitionsRequest {}).await.unwrap().into_inner().partitions;
    let p0 = parts.iter().find(|p| p.name == "p0").unwrap();
    assert_eq!(p0.active.as_ref().unwrap().version, spread);
    assert_eq!(p0.shadow_mode, "shadow");
    assert_eq!(decisions(&mut ops, "p0", true).await, before, "the decision log is kept");
    let hist = ops.policy_history(pb::PolicyHistoryRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(hist.versions.len(), 2);
    // Roll back to binpack: the version active before.
    let r = ops.rollback_policy(pb::RollbackPolicyRequest { partition: "p0".into(), version: 0, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(r.active.unwrap().version, 1);
    h.shutdown().await;
}
