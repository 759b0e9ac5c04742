//! `berth bench live`: decision latency of a live host with preemption. An
//! in-process `berth serve` (real gRPC, real wasm placement and rank
//! policies, memory store) on one partition of N eight-GPU nodes is filled
//! with low-priority whole-node jobs; then high-priority jobs arrive one at
//! a time, each needing the rank policy to pick a victim. Each eviction's
//! decision record carries the time of the pass that decided it.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::asi::report::percentile;
use crate::catalog;
use crate::serve::auth::Access;
use crate::serve::pb;
use crate::serve::server::{Scheduling, ServeConfig, StoreChoice};

#[derive(Debug, Serialize)]
pub struct LiveBench {
    pub nodes: u32,
    pub policy: String,
    pub rank: String,
    /// Low-priority jobs that filled the fleet, and how long that took.
    pub fill_jobs: u32,
    pub fill_s: f64,
    pub preemptions: usize,
    /// The deciding pass (queue walk, placement and rank calls, validation).
    pub pass_p50_us: u64,
    pub pass_p99_us: u64,
    pub pass_max_us: u64,
    /// From the submission's acceptance to the recorded eviction, ms.
    pub submit_to_decision_p50_ms: u64,
    pub submit_to_decision_p99_ms: u64,
}

const TOKEN: &str = "bench-operator-token";

fn job(gpus: u32, priority: u32) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        job: Some(pb::JobSpec {
            partition: "p0".into(),
            tasks: 1,
            gpus,
            gpu_milli: 1000,
            cpu_milli: 8000,
            memory_mib: 65_536,
            duration_s: 86_400.0,
            priority,
            ..Default::default()
        }),
    }
}

pub fn live(policy: &str, rank: &str, nodes: u32, preemptions: usize) -> anyhow::Result<LiveBench> {
    anyhow::ensure!((1..=20_000).contains(&nodes), "--nodes must be in 1..=20000");
    anyhow::ensure!((1..=10_000).contains(&preemptions), "--preemptions must be in 1..=10000");
    let fleet = format!(
        "seed = 1\nnodes_per_switch = 32\nnodes_per_partition = {nodes}\n\n[[shapes]]\nmodel = \"H800\"\ncount = {nodes}\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n"
    );
    let state_dir = std::env::temp_dir().join(format!("berth-bench-live-{}", std::process::id()));
    let config = ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        state_dir: state_dir.clone(),
        fleet: crate::asi::fleet::FleetConfig::parse(&fleet, "bench")?,
        access: Access::parse(&format!("[[identities]]\nname = \"bench\"\ntoken = \"{TOKEN}\"\nroles = {{ \"*\" = \"operator\" }}\n"))?,
        tls: None,
        default_policy: std::fs::read(catalog::resolve(policy)?)?,
        limits: crate::wasm::Limits::default(),
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: StoreChoice::Memory,
        scheduling: Scheduling::default(),
    };
    let rank_component = std::fs::read(catalog::resolve(rank)?)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(async move {
        let host = crate::serve::start(config).await?;
        let mut api = crate::serve::cli::connect(&format!("http://{}", host.addr), Some(TOKEN), None, None).await?;
        let up = api
            .upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component: rank_component, hook: "rank".into(), ..Default::default() })
            .await?
            .into_inner();
        let version = up.policy.map_or(0, |p| p.version);
        api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version, hook: "rank".into() }).await?;

        // Fill every node with one low-priority whole-node job.
        let fill_started = Instant::now();
        for _ in 0..nodes {
            api.submit_job(job(8, 0)).await?;
        }
        let full = f64::from(nodes * 8);
        loop {
            let parts = api.list_partitions(pb::ListPartitionsRequest {}).await?.into_inner().partitions;
            if parts.first().is_some_and(|p| p.gpus_busy >= full) {
                break;
            }
            anyhow::ensure!(fill_started.elapsed() < Duration::from_secs(600), "the fleet did not fill in 10 minutes");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let fill_s = fill_started.elapsed().as_secs_f64();

        let (mut pass_us, mut to_decision_ms) = (Vec::new(), Vec::new());
        for _ in 0..preemptions {
            let high = api.submit_job(job(8, 5)).await?.into_inner().job_id;
            let marker = format!("for job {high};");
            let waited = Instant::now();
            let record = loop {
                let req = pb::QueryDecisionsRequest { partition: "p0".into(), limit: 20, ..Default::default() };
                let found = api.query_decisions(req).await?.into_inner().decisions.into_iter().find(|d| d.outcome == "evicted" && d.detail.starts_with(&marker));
                if let Some(d) = found {
                    break d;
                }
                anyhow::ensure!(waited.elapsed() < Duration::from_secs(60), "no eviction for job {high} in 60 s");
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            let submitted = api.list_jobs(pb::ListJobsRequest { partition: "p0".into(), limit: 1, ..Default::default() }).await?.into_inner().jobs;
            let submitted_ms = submitted.iter().find(|j| j.id == high).map_or(record.unix_ms, |j| j.submitted_unix_ms);
            pass_us.push(record.latency_us);
            to_decision_ms.push(record.unix_ms.saturating_sub(submitted_ms));
        }
        host.shutdown().await;
        pass_us.sort_unstable();
        to_decision_ms.sort_unstable();
        Ok::<_, anyhow::Error>(LiveBench {
            nodes,
            policy: policy.to_string(),
            rank: rank.to_string(),
            fill_jobs: nodes,
            fill_s,
            preemptions,
            pass_p50_us: percentile(&pass_us, 50.0),
            pass_p99_us: percentile(&pass_us, 99.0),
            pass_max_us: pass_us.last().copied().unwrap_or(0),
            submit_to_decision_p50_ms: percentile(&to_decision_ms, 50.0),
            submit_to_decision_p99_ms: percentile(&to_decision_ms, 99.0),
        })
    });
    let _ = std::fs::remove_dir_all(&state_dir);
    result
}
