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
use crate::proto as pb;
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
    /// The capture's bound (0: off) and the bytes it wrote for this run:
    /// the start (the whole fleet) and the rest.
    pub capture_bytes_bound: u64,
    pub capture_bytes: u64,
    pub capture_start_bytes: u64,
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
        ..Default::default()
    }
}

pub fn live(policy: &str, rank: &str, nodes: u32, preemptions: usize, capture_bytes: u64) -> anyhow::Result<LiveBench> {
    anyhow::ensure!((1..=20_000).contains(&nodes), "--nodes must be in 1..=20000");
    anyhow::ensure!((1..=10_000).contains(&preemptions), "--preemptions must be in 1..=10000");
    let fleet = format!(
        "seed = 1\nnodes_per_switch = 32\nnodes_per_partition = {nodes}\n\n[[shapes]]\nmodel = \"H800\"\ncount = {nodes}\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n"
    );
    let state_dir = std::env::temp_dir().join(format!("berth-bench-live-{}", std::process::id()));
    let config = ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        inference_listen: None,
        state_dir: state_dir.clone(),
        fleet: crate::asi::fleet::FleetConfig::parse(&fleet, "bench")?,
        access: Access::parse(&format!("[[identities]]\nname = \"bench\"\ntoken = \"{TOKEN}\"\nroles = {{ \"*\" = \"operator\" }}\n"))?,
        tls: None,
        default_policy: std::fs::read(catalog::resolve(policy)?)?,
        limits: crate::wasm::Limits::default(),
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: StoreChoice::Memory,
        scheduling: Scheduling { retention: crate::serve::state::Retention { capture_bytes, ..Default::default() }, ..Default::default() },
    };
    let capture_dir = crate::capture::dir_of(&state_dir, "p0");
    let rank_component = std::fs::read(catalog::resolve(rank)?)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(async move {
        let host = crate::serve::start(config).await?;
        let mut api = crate::client::connect(&format!("http://{}", host.addr), Some(TOKEN), None, None).await?;
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
            // Often enough that the fill's time is not the poll's.
            tokio::time::sleep(Duration::from_millis(2)).await;
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
        let (start_bytes, rest_bytes) = crate::capture::sizes(&capture_dir)?;
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
            capture_bytes_bound: capture_bytes,
            capture_bytes: start_bytes + rest_bytes,
            capture_start_bytes: start_bytes,
        })
    });
    let _ = std::fs::remove_dir_all(&state_dir);
    result
}

/// What `berth bench compact-live` measured.
#[derive(Debug, Serialize)]
pub struct CompactBench {
    pub nodes: u32,
    pub compact: String,
    /// Running one-GPU tasks when the steps were planned, and partly used nodes.
    pub tasks: usize,
    pub partial_nodes: u32,
    /// Wall time of a dry-run step through the API (lock, snapshot, the
    /// wasm policy's call, validation, payback selection), ms.
    pub plan_runs: usize,
    pub plan_p50_ms: f64,
    pub plan_max_ms: f64,
    /// The chains and moves of the plan that ran.
    pub chains_run: usize,
    pub moves: usize,
    /// The live run: every move make-before-break through the agent protocol.
    pub run_s: f64,
    pub chains_done: usize,
    pub chains_rolled_back: usize,
    pub moves_done: usize,
    pub idle_nodes_before: u32,
    pub idle_nodes_after: u32,
    pub bytes_moved: u64,
    /// Whole-node jobs waiting before the step, and running after it.
    pub whole_node_jobs: u32,
    pub whole_node_jobs_started: usize,
}

/// A benchmark agent node's registration in partition p0: eight H800 GPUs,
/// 128 cores, 2 TiB, in access switch `switch_domain`.
pub(crate) fn bench_registration(node: &str, switch_domain: u32) -> pb::RegisterAgentRequest {
    let gpus = (0..8).map(|g| pb::GpuInfo { index: g, uuid: format!("GPU-bench-{node}-{g}"), model: "H800".into(), memory_total_mib: 81_920, ..Default::default() }).collect();
    pb::RegisterAgentRequest {
        node: node.to_string(),
        partition: "p0".into(),
        gpus,
        source: "bench".into(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
        cpu_milli: 128_000,
        memory_mib: 2 << 20,
        switch_domain: Some(switch_domain),
        aggregation: Some(0),
        ..Default::default()
    }
}

/// One agent node of the benchmark: registered through the hub's API, it
/// reports every start as running and every stop as exited at once (no
/// processes: the benchmark measures the host).
async fn fake_agent(url: String, node: String, index: u32) -> anyhow::Result<()> {
    let mut hub = crate::agent::connect_hub(&url, Some(TOKEN), None).await?;
    let reg = bench_registration(&node, index / 32);
    let session = hub.register(reg).await?.into_inner().session;
    let mut stream = hub.commands(pb::CommandsRequest { node: node.clone(), session }).await?.into_inner();
    hub.heartbeat(pb::HeartbeatRequest { node: node.clone(), session, ..Default::default() }).await?;
    while let Some(cmd) = stream.message().await? {
        let state = match cmd.action.as_str() {
            "start" => "running",
            "stop" => "exited",
            _ => continue,
        };
        hub.report_allocation(pb::AllocationReport { node: node.clone(), allocation_id: cmd.allocation_id, state: state.into(), ..Default::default() }).await?;
    }
    Ok(())
}

/// `berth bench compact-live`: a live host whose partition has `nodes`
/// eight-GPU agent nodes (in-process agents over the real agent API),
/// filled with movable one-GPU tasks of which every other one then ends,
/// and whole-node jobs waiting. Times `plan_runs` dry-run compaction steps
/// with the `compact` policy, then runs one step and waits for its ledger.
pub fn compact_live(compact: &str, nodes: u32, plan_runs: usize) -> anyhow::Result<CompactBench> {
    anyhow::ensure!((2..=5_000).contains(&nodes), "--nodes must be in 2..=5000");
    anyhow::ensure!((1..=1_000).contains(&plan_runs), "--plan-runs must be in 1..=1000");
    // One tiny simulated node makes partition p0; the agents join it.
    let fleet = "seed = 1\nnodes_per_switch = 32\nnodes_per_partition = 1\n\n[[shapes]]\nmodel = \"H800\"\ncount = 1\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n";
    let state_dir = std::env::temp_dir().join(format!("berth-bench-compact-{}", std::process::id()));
    let config = ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        inference_listen: None,
        state_dir: state_dir.clone(),
        fleet: crate::asi::fleet::FleetConfig::parse(fleet, "bench")?,
        access: Access::parse(&format!("[[identities]]\nname = \"bench\"\ntoken = \"{TOKEN}\"\nroles = {{ \"*\" = \"operator\" }}\n"))?,
        tls: None,
        default_policy: std::fs::read(catalog::resolve("binpack")?)?,
        limits: crate::wasm::Limits { deadline: Duration::from_secs(10), ..crate::wasm::Limits::default() },
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: StoreChoice::Memory,
        scheduling: Scheduling { auto_compaction: false, ..Scheduling::default() },
    };
    let compact_component = std::fs::read(catalog::resolve(compact)?)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let agents = crate::serve::hub::HubConfig { heartbeat_timeout: Duration::from_secs(3600), reschedule_after: None, ..Default::default() };
    let result = runtime.block_on(async move {
        let host = crate::serve::server::start_with_agents(config, agents).await?;
        let url = format!("http://{}", host.addr);
        let mut api = crate::client::connect(&url, Some(TOKEN), None, None).await?;
        let mut agents = Vec::with_capacity(nodes as usize);
        for i in 0..nodes {
            let (url, node) = (url.clone(), format!("bench-{i:05}"));
            agents.push(tokio::spawn(async move {
                if let Err(e) = fake_agent(url, node.clone(), i).await {
                    eprintln!("bench agent {node}: {e}");
                }
            }));
        }
        let waited = Instant::now();
        loop {
            let listed = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await?.into_inner().nodes;
            if listed.iter().filter(|n| n.name.starts_with("bench-") && n.schedulable).count() == nodes as usize {
                break;
            }
            anyhow::ensure!(waited.elapsed() < Duration::from_secs(120), "the agents did not register in 2 minutes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let up = api.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component: compact_component, hook: "compact".into(), ..Default::default() }).await?.into_inner();
        api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.policy.map_or(0, |p| p.version), hook: "compact".into() }).await?;

        // Fill every agent GPU with a movable one-GPU task.
        let task = |gpus: u32, movable: bool| pb::SubmitJobRequest {
            job: Some(pb::JobSpec { partition: "p0".into(), tasks: 1, gpus, cpu_milli: 1000, memory_mib: 8192, argv: vec!["true".into()], movable, ..Default::default() }),
            ..Default::default()
        };
        let total = nodes as usize * 8;
        for _ in 0..total {
            api.submit_job(task(1, true)).await?;
        }
        let running = |api: crate::client::Client| async move {
            let req = pb::ListJobsRequest { partition: "p0".into(), state: "running".into(), ..Default::default() };
            crate::client::list_all_jobs(api, req).await
        };
        let filled = loop {
            let jobs = running(api.clone()).await?;
            if jobs.len() == total && jobs.iter().all(|j| j.runs.iter().all(|r| r.state == "running")) {
                break jobs;
            }
            anyhow::ensure!(waited.elapsed() < Duration::from_secs(600), "the agent nodes did not fill in 10 minutes");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Every other task ends (its agent reports the exit): half-used nodes.
        let mut hub = crate::agent::connect_hub(&url, Some(TOKEN), None).await?;
        for j in filled.iter().filter(|j| j.id % 2 == 0) {
            let r = &j.runs[0];
            hub.report_allocation(pb::AllocationReport { node: r.node.clone(), allocation_id: r.allocation_id, state: "exited".into(), ..Default::default() }).await?;
        }
        let tasks = loop {
            let jobs = running(api.clone()).await?;
            if jobs.len() == total - filled.iter().filter(|j| j.id % 2 == 0).count() {
                break jobs.len();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let whole_node_jobs = nodes.div_ceil(10);
        for _ in 0..whole_node_jobs {
            api.submit_job(task(8, false)).await?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;

        let mut plan_ms = Vec::with_capacity(plan_runs);
        let mut last = None;
        for _ in 0..plan_runs {
            let started = Instant::now();
            let r = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: true }).await?.into_inner();
            plan_ms.push(started.elapsed().as_secs_f64() * 1e3);
            anyhow::ensure!(r.rejected.is_empty(), "the plan was rejected: {}", r.rejected);
            last = Some(r);
        }
        let plan = last.expect("at least one run");
        plan_ms.sort_by(f64::total_cmp);

        // One step for real, and its ledger once every chain has ended.
        let started = Instant::now();
        let step = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await?.into_inner();
        let chains = loop {
            let listed = api.list_compactions(pb::ListCompactionsRequest { partition: "p0".into(), limit: 1000 }).await?.into_inner().chains;
            let ours: Vec<pb::CompactionChain> = listed.into_iter().filter(|c| step.chain_ids.contains(&c.id)).collect();
            if ours.len() == step.chain_ids.len() && ours.iter().all(|c| c.state != "running") {
                break ours;
            }
            anyhow::ensure!(started.elapsed() < Duration::from_secs(600), "the compaction run did not end in 10 minutes");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let run_s = started.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let whole_node_jobs_started = running(api.clone()).await?.iter().filter(|j| j.spec.as_ref().is_some_and(|s| s.gpus == 8)).count();
        // The agents' command streams would hold the server's shutdown open.
        for a in agents {
            a.abort();
        }
        host.shutdown().await;
        let first = chains.iter().min_by_key(|c| c.id);
        let final_chain = chains.iter().max_by_key(|c| c.id);
        Ok::<_, anyhow::Error>(CompactBench {
            nodes,
            compact: compact.to_string(),
            tasks,
            partial_nodes: plan.partial_nodes,
            plan_runs,
            plan_p50_ms: plan_ms[plan_ms.len() / 2],
            plan_max_ms: *plan_ms.last().expect("at least one run"),
            chains_run: step.chain_ids.len(),
            moves: step.moves.len(),
            run_s,
            chains_done: chains.iter().filter(|c| c.state == "done").count(),
            chains_rolled_back: chains.iter().filter(|c| c.state != "done").count(),
            moves_done: chains.iter().flat_map(|c| &c.moves).filter(|m| m.state == "done").count(),
            idle_nodes_before: first.map_or(0, |c| c.idle_nodes_before),
            idle_nodes_after: final_chain.map_or(0, |c| c.idle_nodes_after),
            bytes_moved: chains.iter().map(|c| c.bytes_same_switch + c.bytes_same_aggregation + c.bytes_cross_aggregation).sum(),
            whole_node_jobs,
            whole_node_jobs_started,
        })
    });
    let _ = std::fs::remove_dir_all(&state_dir);
    result
}


/// What `berth bench live --capture-cost` measured: the engine's decisions
/// per second on one partition with capture off and on (inputs recorded and
/// written as JSON lines, as `berth serve` does).
#[derive(Debug, Serialize)]
pub struct CaptureCost {
    pub nodes: u32,
    pub jobs: usize,
    pub decisions_per_s_off: f64,
    pub decisions_per_s_on: f64,
    /// Throughput lost to capture, %.
    pub cost_pct: f64,
    /// Bytes written: the start (the whole fleet) and per 1,000 jobs after it.
    pub start_bytes: u64,
    pub bytes_per_1000_jobs: f64,
}

/// Drives one engine as the live host does (a job arrives, a pass places
/// it with the wasm `policy`; the oldest running jobs end to keep the fleet
/// about 90% full), `jobs` times, with capture off and on, alternating
/// three times each; the fastest run of each counts.
pub fn capture_cost(policy: &str, nodes: u32, jobs: usize) -> anyhow::Result<CaptureCost> {
    use berth_core::engine::{Deciders, Event, World};
    anyhow::ensure!((1..=20_000).contains(&nodes), "--nodes must be in 1..=20000");
    anyhow::ensure!((1..=1_000_000).contains(&jobs), "--jobs must be in 1..=1000000");
    let fleet_toml = format!(
        "seed = 1\nnodes_per_switch = 32\nnodes_per_partition = {nodes}\n\n[[shapes]]\nmodel = \"H800\"\ncount = {nodes}\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n"
    );
    let (fleet, _) = crate::asi::fleet::FleetConfig::parse(&fleet_toml, "bench")?.build()?;
    let engine = std::sync::Arc::new(crate::wasm::PolicyEngine::new(None)?);
    let loaded = crate::wasm::LoadedPolicy::from_file(&engine, &catalog::resolve(policy)?)?;
    let dir = std::env::temp_dir().join(format!("berth-bench-capture-{}", std::process::id()));
    let run = |capture: bool| -> anyhow::Result<(f64, u64, u64)> {
        let _ = std::fs::remove_dir_all(&dir);
        let mut fleet = fleet.clone();
        let mut placement = crate::wasm::WasmPolicy::new(engine.clone(), loaded.clone(), crate::wasm::Limits::default());
        let mut e = berth_core::Engine::new(berth_core::sim::SimConfig { high_priority: 5, ..Default::default() });
        let mut log = None;
        if capture {
            e.start_capture(&fleet);
            log = Some(crate::capture::CaptureLog::open(&dir, "p0", crate::capture::Bounds::of_total(1 << 30), 0)?);
        }
        let mut running = std::collections::VecDeque::new();
        let capacity = nodes as usize * 8 * 9 / 10;
        let mut held = 0;
        let started = Instant::now();
        for i in 0..jobs {
            let now = i as u64;
            let gpus = [1u32, 2, 4, 8][i % 4];
            while held + gpus as usize > capacity {
                let (slot, g) = running.pop_front().expect("something runs");
                e.apply(&mut fleet, now, Event::End(slot));
                e.forget(slot);
                held -= g;
            }
            let job = berth_core::Job {
                id: i as u64 + 1,
                arrival_s: now,
                duration_s: 86_400,
                tasks: 1,
                shape: berth_core::TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 8000 * gpus, memory_mib: 65_536, models: vec![] },
                ..Default::default()
            };
            let slot = e.register(job);
            e.apply(&mut fleet, now, Event::Arrive(slot));
            let mut deciders = Deciders { placement: &mut placement, preemption: None, compaction: None };
            let pass = e.handle(&mut fleet, now, [], &mut deciders, &mut World::default());
            if pass.decisions.iter().any(|d| matches!(d, berth_core::Decision::Place { .. })) {
                running.push_back((slot, gpus as usize));
                held += gpus as usize;
            }
            if let Some(log) = log.as_mut() {
                log.write(e.take_captured(), now * 1000);
            }
        }
        let took = started.elapsed().as_secs_f64();
        let sizes = match log.as_mut() {
            Some(log) => {
                log.sync();
                crate::capture::sizes(&dir)?
            }
            None => (0, 0),
        };
        Ok((jobs as f64 / took, sizes.0, sizes.1))
    };
    run(false)?; // warm the instance's code
    let (mut off, mut on) = (0f64, 0f64);
    let mut sizes = (0, 0);
    for _ in 0..3 {
        off = off.max(run(false)?.0);
        let (rate, start, rest) = run(true)?;
        on = on.max(rate);
        sizes = (start, rest);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(CaptureCost {
        nodes,
        jobs,
        decisions_per_s_off: off,
        decisions_per_s_on: on,
        cost_pct: 100.0 * (off - on) / off,
        start_bytes: sizes.0,
        bytes_per_1000_jobs: sizes.1 as f64 / jobs as f64 * 1000.0,
    })
}
