//! Hostile policies and tenants (issue 19): everything a guest or a caller
//! can make the host hold is bounded, refused at load or answered with a
//! clear error naming the bound.

use std::time::{Duration, Instant};

use berth::wasm::{Limits, LoadedPolicy, WasmPolicy};
use berth_core::{PlacementPolicy, PolicyError};
use berth_sdk::{Hooks, PolicyInfo};
use tonic::Code;

use crate::common::{engine, guest_path, repo_root, wasm_policy};
use crate::serve::{client, config, job, jobs, state_dir};

/// The hostile guest's core module, as scripts/build-policies.sh built it.
fn hostile_module() -> Vec<u8> {
    let path = repo_root().join("target/guest/wasm32-unknown-unknown/release/berth_guest_hostile.wasm");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run scripts/build-policies.sh)", path.display()))
}

/// The hostile guest as a component whose core module declares `extra`
/// more linear memories of `pages` 64 KiB pages each (multi-memory): what
/// a hand-written component can do that the SDK never does.
fn with_extra_memories(extra: u32, pages: u64) -> Vec<u8> {
    use wasm_encoder::{MemorySection, MemoryType, Module, RawSection};
    let module = hostile_module();
    let mut out = Module::new();
    for payload in wasmparser::Parser::new(0).parse_all(&module) {
        match payload.expect("valid module") {
            wasmparser::Payload::MemorySection(r) => {
                let mut memories = MemorySection::new();
                for m in r {
                    let m = m.unwrap();
                    memories.memory(MemoryType {
                        minimum: m.initial,
                        maximum: m.maximum,
                        memory64: m.memory64,
                        shared: m.shared,
                        page_size_log2: m.page_size_log2,
                    });
                }
                for _ in 0..extra {
                    memories.memory(MemoryType { minimum: pages, maximum: None, memory64: false, shared: false, page_size_log2: None });
                }
                out.section(&memories);
            }
            other => {
                if let Some((id, range)) = other.as_section() {
                    out.section(&RawSection { id, data: &module[range] });
                }
            }
        }
    }
    berth::componentize::componentize(&out.finish()).expect("componentize")
}

fn small_limits() -> Limits {
    Limits { deadline: Duration::from_secs(5), memory_bytes: 64 << 20, log_lines_per_call: 5, ..Limits::default() }
}

#[test]
fn sixteen_memories_of_128_mib_are_refused_at_load() {
    let bytes = with_extra_memories(15, 2048);
    let err = match LoadedPolicy::from_bytes(&engine(), &bytes) {
        Err(e) => e,
        Ok(_) => panic!("a component declaring 16 memories of 128 MiB must not load"),
    };
    let text = err.to_string();
    assert!(matches!(err, PolicyError::Load(_)), "{err:?}");
    assert!(text.contains("16 linear memories") && text.contains("at most 4"), "{text}");
}

#[test]
fn memories_together_are_held_to_one_cap_per_instance() {
    // Four memories (the most a policy may declare): the guest's own and
    // three of 24 MiB. Each is under a 64 MiB cap; together they are over it.
    let bytes = with_extra_memories(3, 384);
    let loaded = LoadedPolicy::from_bytes(&engine(), &bytes).expect("loads under the default 256 MiB cap");
    let mut policy = WasmPolicy::new(engine(), loaded.clone(), small_limits());
    assert_eq!(policy.warm(), Err(PolicyError::OutOfMemory { cap_bytes: 64 << 20 }));
    // Under a cap that fits them all, the same component decides.
    let mut roomy = WasmPolicy::new(engine(), loaded, Limits { memory_bytes: 128 << 20, ..small_limits() });
    let (task, mut nodes) = berth::bench::batch(20, 1);
    assert_eq!(roomy.score(&task, &mut nodes).expect("honest call").scores.len(), 20);
}

#[test]
fn memory_growth_across_calls_hits_the_cap_and_the_instance_is_replaced() {
    // Job 14 keeps 16 MiB per call: the 64 MiB cap ends it within four.
    let mut policy = wasm_policy(&guest_path("hostile"), small_limits());
    let (task, mut nodes) = berth::bench::batch(20, 1);
    let leak = berth_sdk::Task { job_id: 14, ..task.clone() };
    let mut calls = 0;
    let err = loop {
        calls += 1;
        assert!(calls <= 4, "16 MiB a call past a 64 MiB cap for {calls} calls");
        if let Err(e) = policy.score(&leak, &mut nodes) {
            break e;
        }
    };
    assert_eq!(err, PolicyError::OutOfMemory { cap_bytes: 64 << 20 });
    assert!(calls >= 2, "the first calls fit");
    // A fresh instance, honest again.
    let honest = berth_sdk::Task { job_id: 0, ..task };
    assert_eq!(policy.score(&honest, &mut nodes).unwrap().scores.len(), 20);
}

#[test]
fn a_megabyte_name_is_refused_with_a_short_error() {
    let err = match LoadedPolicy::from_file(&engine(), &guest_path("loud")) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a 1 MiB policy name must not load"),
    };
    assert!(err.contains("policy name of 1048576 bytes") && err.contains("at most 64"), "{}", &err[..err.len().min(300)]);
    assert!(err.len() < 400, "the error itself is bounded: {} bytes", err.len());
}

#[test]
fn escapes_in_a_policy_version_are_refused() {
    let info = |version: &str| PolicyInfo { name: "p".into(), version: version.into(), hooks: Hooks::SCORE };
    assert!(berth::wasm::check_info(&info("1.2.3-rc.1+build.5")).is_ok());
    for bad in ["1.2.3-\x1b[31mred", "1.2.3+\u{202e}x", "1.2.3-a\nINFO forged", &format!("1.2.3-{}", "a".repeat(100))] {
        let err = berth::wasm::check_info(&info(bad)).expect_err(bad).to_string();
        assert!(!err.contains('\x1b') && !err.contains('\n') && !err.contains('\u{202e}'), "{err:?}");
    }
}

#[test]
fn an_eight_mib_guest_error_is_cut_to_the_bound() {
    let mut policy = wasm_policy(&guest_path("hostile"), small_limits());
    let (task, mut nodes) = berth::bench::batch(20, 1);
    let err = policy.score(&berth_sdk::Task { job_id: 12, ..task }, &mut nodes).unwrap_err();
    let PolicyError::Guest(text) = &err else { panic!("{err:?}") };
    assert!(text.len() <= berth::wasm::MAX_ERROR_BYTES + 40, "{} bytes", text.len());
    assert!(text.ends_with(&format!("({} more bytes)", (8 << 20) - berth::wasm::MAX_ERROR_BYTES)), "{}", &text[text.len() - 40..]);
}

#[test]
fn guest_text_is_printed_escaped_and_bounded() {
    let forged = format!("ok\nINFO berth: forged \x1b[2J\u{202e}{}", "x".repeat(10_000));
    let shown = berth::text::printable(&forged, 100);
    assert!(!shown.contains('\n') && !shown.contains('\x1b') && !shown.contains('\u{202e}'), "{shown}");
    assert!(shown.starts_with("ok\\nINFO berth: forged \\u{1b}[2J\\u{202e}"), "{shown}");
    assert!(shown.len() < 160, "{}", shown.len());
    // The log flood guest's lines, and job 13's forged line, still let the
    // call answer.
    let mut policy = wasm_policy(&guest_path("hostile"), small_limits());
    let (task, mut nodes) = berth::bench::batch(20, 1);
    assert!(policy.score(&berth_sdk::Task { job_id: 13, ..task }, &mut nodes).is_ok());
}

#[test]
fn a_cpu_time_deadline_still_stops_an_endless_loop() {
    // Replays measure the deadline in the thread's CPU time; a guest that
    // spins burns CPU and is stopped all the same.
    let limits = Limits { deadline: Duration::from_millis(100), clock: berth::wasm::DeadlineClock::ThreadCpu, ..small_limits() };
    let mut policy = wasm_policy(&guest_path("hostile"), limits);
    let (task, mut nodes) = berth::bench::batch(20, 1);
    let started = Instant::now();
    let err = policy.score(&berth_sdk::Task { job_id: 1, ..task.clone() }, &mut nodes).unwrap_err();
    assert_eq!(err, PolicyError::Timeout { deadline_ms: 100 });
    // A liveness bound for a loaded machine, not a timing measurement.
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    assert!(policy.score(&berth_sdk::Task { job_id: 0, ..task }, &mut nodes).is_ok());
}

const ACCESS: &str = r#"
tenant_max_priority = { "*" = 10 }
tenant_tiers = { "*" = ["preemptible", "opportunistic"] }

[[identities]]
name = "ops"
token = "ops-test-token"
roles = { "*" = "operator" }

[[identities]]
name = "alice"
token = "alice-test-token"
roles = { "*" = "viewer", "p0" = "tenant", "p2" = "tenant" }

[[identities]]
name = "carol"
token = "carol-test-token"
roles = { "p0" = "tenant" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_fields_are_bounded_and_roles_hide_what_they_should() {
    let dir = state_dir("security-api");
    let h = berth::serve::start(config(&dir, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let mut alice = client(&h, "alice-test-token").await;
    let mut carol = client(&h, "carol-test-token").await;

    // A body that is not a SubmitJobRequest (field 1 sent as a number, not
    // a message) is the caller's mistake.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", h.addr)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<berth::proto::CancelJobRequest, berth::proto::SubmitJobResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/berth.v1.Berth/SubmitJob");
    let e = grpc.unary(tonic::Request::new(berth::proto::CancelJobRequest { job_id: 5 }), path, codec).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("not a valid protobuf message"), "{e:?}");

    let with = |f: &dyn Fn(&mut berth::proto::JobSpec)| {
        let mut j = job("p0", 1);
        f(j.job.as_mut().unwrap());
        j
    };
    let refused = |e: tonic::Status, field: &str| {
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
    };
    refused(alice.submit_job(with(&|j| j.argv = vec!["x".into(); 2000])).await.unwrap_err(), "job.argv");
    refused(alice.submit_job(with(&|j| j.argv = vec!["a".repeat(20_000); 5])).await.unwrap_err(), "job spec");
    refused(alice.submit_job(with(&|j| j.env = [("K".to_string(), "v".repeat(100_000))].into())).await.unwrap_err(), "job spec");
    refused(alice.submit_job(with(&|j| j.name = "n".repeat(300))).await.unwrap_err(), "job.name");
    refused(alice.submit_job(with(&|j| j.priority = u32::MAX)).await.unwrap_err(), "priority");
    let note = berth::proto::UploadPolicyRequest {
        partition: "p0".into(),
        component: std::fs::read(crate::common::policy_path("spread")).unwrap(),
        note: "n".repeat(2000),
        ..Default::default()
    };
    refused(ops.upload_policy(note).await.unwrap_err(), "note");
    // Within the ceiling a tenant is accepted; an operator is not capped.
    alice.submit_job(with(&|j| j.priority = 10)).await.expect("at the ceiling");
    ops.submit_job(with(&|j| j.priority = 1000)).await.expect("operators are not capped");
    // Tiers: a tenant buys only what the access file lets it; a name that
    // is no tier is the caller's mistake; operators buy any.
    let e = alice.submit_job(with(&|j| j.tier = "guaranteed".into())).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("tier guaranteed") && e.message().contains("opportunistic"), "{e:?}");
    refused(alice.submit_job(with(&|j| j.tier = "gold\u{1b}[31m".into())).await.unwrap_err(), "tier \"gold\\u{1b}");
    alice.submit_job(with(&|j| j.tier = "opportunistic".into())).await.expect("a tier alice may buy");
    let g = ops.submit_job(with(&|j| j.tier = "guaranteed".into())).await.expect("operators buy any tier").into_inner().job_id;
    let listed = ops.list_jobs(berth::proto::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner().jobs;
    assert_eq!(listed.iter().find(|j| j.id == g).unwrap().spec.as_ref().unwrap().tier, "guaranteed");

    // A job's environment: its owner and operators see it, others do not.
    let secret = alice
        .submit_job(with(&|j| {
            j.env = [("PASSWORD".to_string(), "hunter2".to_string())].into();
            j.partition = "p2".into();
        }))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let env_of = |all: Vec<berth::proto::Job>| all.into_iter().find(|j| j.id == secret).expect("listed").spec.unwrap().env;
    assert_eq!(env_of(jobs(&mut alice, "p2").await).get("PASSWORD").map(String::as_str), Some("hunter2"));
    assert_eq!(env_of(jobs(&mut ops, "p2").await).get("PASSWORD").map(String::as_str), Some("hunter2"));
    // Another tenant's job: a viewer of its partition sees it, not its env.
    let e = carol.list_jobs(berth::proto::ListJobsRequest { partition: "p2".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "carol has no role in p2: {e:?}");
    let mut other = job("p0", 1);
    other.job.as_mut().unwrap().env = [("TOKEN".to_string(), "s3cret".to_string())].into();
    let carols = carol.submit_job(other).await.unwrap().into_inner().job_id;
    let seen = jobs(&mut alice, "p0").await.into_iter().find(|j| j.id == carols).expect("alice views p0");
    assert!(seen.spec.unwrap().env.is_empty(), "a tenant of p0 reads another tenant's env");

    // Permission before existence: carol cannot tell alice's p2 job from a
    // job that does not exist, nor p2 from a partition that does not.
    let hidden = carol.cancel_job(berth::proto::CancelJobRequest { job_id: secret }).await.unwrap_err();
    let absent = carol.cancel_job(berth::proto::CancelJobRequest { job_id: 987_654 }).await.unwrap_err();
    assert_eq!((hidden.code(), absent.code()), (Code::NotFound, Code::NotFound));
    assert_eq!(hidden.message().replace(&secret.to_string(), "N"), absent.message().replace("987654", "N"));
    let e = carol.explain_job(berth::proto::ExplainJobRequest { job_id: secret, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let real = carol.submit_job(job("p2", 1)).await.unwrap_err();
    let fake = carol.submit_job(job("nowhere", 1)).await.unwrap_err();
    assert_eq!((real.code(), fake.code()), (Code::PermissionDenied, Code::PermissionDenied), "{real:?} {fake:?}");
    assert_eq!(ops.submit_job(job("nowhere", 1)).await.unwrap_err().code(), Code::NotFound);

    // Node names are unique across the fleet: an operator of p0 cannot
    // register an agent named like a node of p1.
    let p1_node = ops
        .list_nodes(berth::proto::ListNodesRequest { partition: "p1".into() })
        .await
        .unwrap()
        .into_inner()
        .nodes
        .remove(0)
        .name;
    let mut hub = berth::agent::connect_hub(&format!("http://{}", h.addr), Some("ops-test-token"), None).await.unwrap();
    let e = hub
        .register(berth::proto::RegisterAgentRequest {
            node: p1_node.clone(),
            partition: "p0".into(),
            source: "synthetic".into(),
            cpu_milli: 1000,
            memory_mib: 1024,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("already taken"), "{e:?}");
    h.shutdown().await;
}

/// Polls the partition's history until the breaker has acted (a liveness
/// bound only).
async fn breaker_event(c: &mut berth::client::Client, partition: &str) -> String {
    let limit = Instant::now() + Duration::from_secs(90);
    loop {
        let h = c.policy_history(berth::proto::PolicyHistoryRequest { partition: partition.into(), ..Default::default() }).await.unwrap().into_inner();
        if let Some(e) = h.events.iter().find(|e| e.kind == "breaker") {
            return e.detail.clone();
        }
        assert!(Instant::now() < limit, "the breaker never tripped: {:?}", h.events);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn hostile_with(h: &berth::serve::ServeHandle, partition: &str, config: &str) -> u32 {
    let mut ops = client(h, "ops-test-token").await;
    let component = std::fs::read(guest_path("hostile")).unwrap();
    let req = berth::proto::UploadPolicyRequest { partition: partition.into(), component, config: config.into(), ..Default::default() };
    let v = ops.upload_policy(req).await.expect("upload").into_inner().policy.unwrap().version;
    ops.activate_policy(berth::proto::ActivatePolicyRequest { partition: partition.into(), version: v, ..Default::default() }).await.expect("activate");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_failing_every_other_call_trips_on_its_failure_rate() {
    let dir = state_dir("security-rate");
    let mut cfg = config(&dir, ACCESS);
    // Consecutive failures alone would never trip it here.
    cfg.breaker.failures = 1000;
    cfg.breaker.window = 10;
    cfg.breaker.min_calls = 10;
    cfg.breaker.rate = 0.5;
    cfg.breaker.slow = None;
    let h = berth::serve::start(cfg).await.unwrap();
    let v = hostile_with(&h, "p2", "flaky").await;
    let mut alice = client(&h, "alice-test-token").await;
    for _ in 0..24 {
        alice.submit_job(job("p2", 1)).await.unwrap();
    }
    let mut ops = client(&h, "ops-test-token").await;
    let detail = breaker_event(&mut ops, "p2").await;
    assert!(detail.contains(&format!("rolled back from version {v}")) && detail.contains("of the last 10 calls failed"), "{detail}");
    // Every job is then placed by the version rolled back to.
    let all = crate::serve::settle(&mut ops, "p2").await;
    assert_eq!(all.len(), 24);
    assert!(all.iter().all(|j| j.state == "running"), "{all:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_version_trips_its_latency_budget() {
    let dir = state_dir("security-slow");
    let mut cfg = config(&dir, ACCESS);
    cfg.breaker.slow = Some(Duration::from_millis(2));
    let h = berth::serve::start(cfg).await.unwrap();
    let v = hostile_with(&h, "p2", "slow").await;
    let mut alice = client(&h, "alice-test-token").await;
    for _ in 0..4 {
        alice.submit_job(job("p2", 1)).await.unwrap();
    }
    let mut ops = client(&h, "ops-test-token").await;
    let detail = breaker_event(&mut ops, "p2").await;
    assert!(detail.contains(&format!("rolled back from version {v}")) && detail.contains("slow ("), "{detail}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_do_not_wait_for_a_stalled_policy_call() {
    let dir = state_dir("security-stall");
    let mut cfg = config(&dir, ACCESS);
    // Every call on job 1 spins to this deadline, again at each retry.
    cfg.limits.deadline = Duration::from_secs(4);
    // Kept from tripping, so the partition stays stalled for the test.
    cfg.breaker.failures = 1000;
    cfg.breaker.window = 1000;
    cfg.breaker.min_calls = 1000;
    cfg.breaker.slow = None;
    let h = berth::serve::start(cfg).await.unwrap();
    hostile_with(&h, "p2", "").await;
    let mut alice = client(&h, "alice-test-token").await;
    let first = alice.submit_job(job("p2", 1)).await.unwrap().into_inner().job_id;
    assert_eq!(first, 1, "the hostile guest spins on job 1");
    // Wait until the deciding thread is in its pass (the call on job 1,
    // the only job; the pass holds the partition's state through it), so
    // the submissions below meet a stalled call.
    let entered = Instant::now();
    while !h.live.deciding(2) {
        assert!(entered.elapsed() < Duration::from_secs(30), "p2 never started deciding");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        alice.submit_job(job("p2", 1)).await.expect("accepted while the policy spins");
        slowest = slowest.max(t.elapsed());
    }
    // A submission that waited for the call would take up to its 4 s.
    assert!(slowest < Duration::from_secs(1), "a submission waited {slowest:?} for a policy call");
    // Readers of p2 wait for its pass, each on a thread of its own: with
    // more of them waiting than the runtime has workers, other partitions
    // and the agents' heartbeats are still answered.
    let mut readers = Vec::new();
    for _ in 0..4 {
        let mut c = client(&h, "ops-test-token").await;
        readers.push(tokio::spawn(async move { jobs(&mut c, "p2").await.len() }));
    }
    let mut ops = client(&h, "ops-test-token").await;
    let t = Instant::now();
    jobs(&mut ops, "p0").await;
    assert!(t.elapsed() < Duration::from_secs(1), "a listing of p0 waited {:?} behind four readers of the stalled p2", t.elapsed());
    // Another partition decides meanwhile.
    alice.submit_job(job("p0", 1)).await.expect("p0 accepts");
    let deadline = Instant::now() + Duration::from_secs(3);
    while !jobs(&mut ops, "p0").await.iter().any(|j| j.state == "running") {
        assert!(Instant::now() < deadline, "p0 did not place while p2's policy spun");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing accepted is lost: all six are listed once the lock is free.
    assert_eq!(jobs(&mut ops, "p2").await.len(), 6);
    for r in readers {
        assert_eq!(r.await.unwrap(), 6, "a reader that waited for the pass sees every job");
    }
    h.shutdown().await;
}

/// Resident memory of this process (the host runs in it), bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_mib_errors_on_every_call_keep_the_host_under_100_mb() {
    let dir = state_dir("security-loud");
    let mut cfg = config(&dir, ACCESS);
    // Never trips: every failed call is retried, 20 a second.
    cfg.breaker.failures = 100_000;
    cfg.breaker.window = 100_000;
    cfg.breaker.min_calls = 100_000;
    cfg.breaker.slow = None;
    let h = berth::serve::start(cfg).await.unwrap();
    hostile_with(&h, "p2", "loud-errors").await;
    let mut alice = client(&h, "alice-test-token").await;
    let mut ops = client(&h, "ops-test-token").await;
    let log = dir.join("decisions.jsonl");
    let log_size = || std::fs::metadata(&log).map_or(0, |m| m.len());
    let (rss_before, log_before) = (resident_bytes(), log_size());
    for _ in 0..4 {
        alice.submit_job(job("p2", 1)).await.unwrap();
    }
    // Until at least 100 calls of 8 MiB each failed (800 MiB of guest text).
    let started = Instant::now();
    let failed = loop {
        let req = berth::proto::QueryDecisionsRequest { partition: "p2".into(), limit: 100_000, ..Default::default() };
        let decisions = ops.query_decisions(req).await.expect("the decision log stays readable").into_inner().decisions;
        let failed: Vec<_> = decisions.into_iter().filter(|d| d.job_id != 0 && d.placements.is_empty()).collect();
        if failed.len() >= 100 {
            break failed;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "only {} failed calls in 120 s", failed.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(failed.iter().all(|d| d.detail.len() <= berth::wasm::MAX_ERROR_BYTES + 200), "a decision holds the guest's whole error");
    let (grew, logged) = (resident_bytes().saturating_sub(rss_before), log_size().saturating_sub(log_before));
    eprintln!("{} failed calls of 8 MiB: resident +{} MiB, decision log +{} KiB", failed.len(), grew >> 20, logged >> 10);
    assert!(grew < 100 << 20, "the host grew by {} MiB for {} failed calls", grew >> 20, failed.len());
    assert!(logged < (failed.len() as u64 + 50) * 16 * 1024, "{logged} bytes of log for {} failed calls", failed.len());
    // Other partitions and users are unaffected.
    alice.submit_job(job("p0", 1)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !jobs(&mut ops, "p0").await.iter().any(|j| j.state == "running") {
        assert!(Instant::now() < deadline, "p0 did not place while p2's policy failed loudly");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.shutdown().await;
}
