//! `berth bench fleet`: one live host for a fleet of agent nodes. An
//! in-process `berth serve` (real gRPC, wasm placement, rank and compact
//! policies, the embedded store on disk) takes N eight-GPU agent nodes in
//! switch domains, each registered over the agent API with an agent
//! identity and beating with per-GPU telemetry at its period. The ASI
//! workload (classes, gangs, priorities, durations) arrives at a speed-up of
//! the wall clock; an operator polls `berth jobs` and the partitions.
//!
//! The agents run no processes: a start is reported running at once and
//! its exit after the job's (sped-up) duration, a stop is reported exited.
//! They share a few connections (as many nodes as HTTP/2 streams allow on
//! one) and run on their own runtime, so the host's CPU can be told apart.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::agent::HubClient;
use crate::asi::report::percentile;
use crate::asi::workload::HIGH_PRIORITY;
use crate::catalog;
use crate::proto as pb;
use crate::serve::auth::Access;
use crate::serve::server::{Scheduling, ServeConfig, StoreChoice};

const OPERATOR: &str = "fleet-bench-operator-token";
const AGENT: &str = "fleet-bench-agent-token";
/// Nodes per connection: well under the server's concurrent-stream limit
/// (each node holds one command stream open).
const NODES_PER_CONNECTION: u32 = 64;
const THREAD_AGENTS: &str = "bench-agents";

/// What to run.
#[derive(Clone, Debug)]
pub struct FleetArgs {
    pub nodes: u32,
    pub nodes_per_switch: u32,
    pub heartbeat_ms: u64,
    /// Wall-clock seconds of arrivals.
    pub seconds: u64,
    /// Simulated seconds per wall-clock second (arrivals and durations).
    pub speedup: f64,
    /// The run starts this far into the workload: the jobs alive then are
    /// submitted at once (the fleet in its steady state), with what is
    /// left of their durations.
    pub warm_hours: f64,
    pub workload: String,
    pub policy: String,
    pub rank: String,
    /// A compact policy (live compaction steps run on their own), or none.
    pub compact: Option<String>,
    /// Low-priority half-GPU tasks (inference replicas sharing GPUs, in
    /// jobs of [`FILL_TASKS_PER_JOB`]) placed after the warm start and
    /// running through the run: the fleet's task count at ASI's scale.
    pub fill_tasks: u32,
}

/// Tasks per fill job (a batch-inference job array, placed as one gang).
pub const FILL_TASKS_PER_JOB: u32 = 8;

/// What `berth bench fleet` measured (one run).
#[derive(Debug, Serialize)]
pub struct FleetBench {
    pub nodes: u32,
    pub gpus: u32,
    pub heartbeat_ms: u64,
    pub seconds: u64,
    pub speedup: f64,
    pub workload: String,
    pub register_s: f64,
    /// The warm start: jobs submitted at once, and until the host had
    /// decided them all.
    pub warm_jobs: usize,
    pub warm_s: f64,
    /// Until every warm job was accepted (eight clients at once).
    pub warm_submit_s: f64,
    pub warm_tasks_running: u32,
    /// The fill: tasks asked, and until every fill job was decided.
    pub fill_tasks: u32,
    pub fill_s: f64,
    /// Tasks running when the measured phase began.
    pub tasks_running_at_start: usize,
    /// From here on, the measured phase only.
    pub jobs_submitted: usize,
    pub jobs_started: usize,
    pub jobs_ended: usize,
    pub tasks_running_at_end: usize,
    pub gpus_busy_at_end: f64,
    pub preemptions: u64,
    /// One placement decision (all tasks of a job, the policy's calls).
    pub decisions: usize,
    pub decision_p50_us: u64,
    pub decision_p99_us: u64,
    pub decision_max_us: u64,
    /// One whole pass (queue walk, decisions, actuation, store writes).
    pub passes: u64,
    pub pass_p50_us: u64,
    pub pass_p99_us: u64,
    pub pass_max_us: u64,
    /// From acceptance to the start, for high-priority jobs (they fit: on
    /// free GPUs, or by preempting low-priority work), those of them that
    /// waited for no victim, and every started job (low-priority work
    /// waits for room).
    pub submit_to_start_high_p50_ms: u64,
    pub submit_to_start_high_p99_ms: u64,
    pub submit_to_start_free_p99_ms: u64,
    pub submit_to_start_all_p99_ms: u64,
    /// Heartbeats sent, their round trips, and the ones that went out
    /// more than half a period late (the sender was starved).
    pub heartbeats: u64,
    pub heartbeat_p50_us: u64,
    pub heartbeat_p99_us: u64,
    pub heartbeats_late: u64,
    /// Nodes the host showed unreachable when the arrivals ended, and the
    /// most any poll saw (every node beats: any is a false alarm).
    pub nodes_unreachable: usize,
    pub nodes_unreachable_most: usize,
    /// The most any poll saw over the whole run (registration, warm start,
    /// fill, measured phase): a stalled host shows here first.
    pub nodes_unreachable_most_run: usize,
    /// An operator's `berth jobs` (first page), partition and node listings.
    pub list_jobs_p99_ms: f64,
    pub list_partitions_p99_ms: f64,
    pub list_nodes_p99_ms: f64,
    /// CPU seconds of the host's threads, and of the benchmark's agents.
    pub host_cpu_s: f64,
    pub agents_cpu_s: f64,
    /// The process's resident memory at the end and at its peak (the
    /// agents' share included).
    pub rss_mib: u64,
    pub rss_peak_mib: u64,
    /// The restart with everything running.
    pub recovery: Recovery,
    pub store_bytes: u64,
}

pub fn fleet(args: &FleetArgs) -> anyhow::Result<FleetBench> {
    anyhow::ensure!((2..=20_000).contains(&args.nodes), "--nodes must be in 2..=20000");
    anyhow::ensure!((1..=64).contains(&args.nodes_per_switch), "--nodes-per-switch must be in 1..=64");
    anyhow::ensure!((100..=60_000).contains(&args.heartbeat_ms), "--heartbeat-ms must be in 100..=60000");
    anyhow::ensure!((1..=3_600).contains(&args.seconds), "--seconds must be in 1..=3600");
    anyhow::ensure!(args.speedup.is_finite() && (1.0..=100_000.0).contains(&args.speedup), "--speedup must be in 1..=100000");
    anyhow::ensure!(args.warm_hours.is_finite() && (0.0..=168.0).contains(&args.warm_hours), "--warm-hours must be in 0..=168");
    let workload = crate::asi::workload::WorkloadConfig::load(&args.workload)?;
    // The arrivals: the workload on a fleet of the agents' shape.
    let shape = format!(
        "seed = 1\nnodes_per_switch = {}\nnodes_per_partition = {}\n\n[[shapes]]\nmodel = \"H800\"\ncount = {}\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n",
        args.nodes_per_switch, args.nodes, args.nodes
    );
    let (model_fleet, _) = crate::asi::fleet::FleetConfig::parse(&shape, "bench")?.build()?;
    let warm_s = args.warm_hours * 3600.0;
    let horizon_s = warm_s + args.seconds as f64 * args.speedup;
    let (warm, arrivals): (Vec<berth_core::job::Job>, Vec<berth_core::job::Job>) =
        workload.generate(&model_fleet).into_iter().take_while(|j| (j.arrival_s as f64) < horizon_s).partition(|j| (j.arrival_s as f64) < warm_s);
    // Alive at the warm start, with what is left of their run.
    let warm: Vec<(berth_core::job::Job, f64)> =
        warm.into_iter().filter_map(|j| ((j.arrival_s + j.duration_s) as f64 > warm_s).then(|| (j.clone(), (j.arrival_s + j.duration_s) as f64 - warm_s))).collect();
    drop(model_fleet);

    // One tiny simulated node makes partition p0; the agents join it.
    let fleet = "seed = 1\nnodes_per_switch = 32\nnodes_per_partition = 1\n\n[[shapes]]\nmodel = \"H800\"\ncount = 1\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n";
    let state_dir = std::env::temp_dir().join(format!("berth-bench-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state_dir);
    let access = format!(
        "[[identities]]\nname = \"operator\"\ntoken = \"{OPERATOR}\"\nroles = {{ \"*\" = \"operator\" }}\n\n\
         [[identities]]\nname = \"fleet-agents\"\ntoken = \"{AGENT}\"\nroles = {{ \"p0\" = \"agent\" }}\nnodes = [\"fleet-*\"]\n"
    );
    let config = ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        inference_listen: None,
        state_dir: state_dir.clone(),
        fleet: crate::asi::fleet::FleetConfig::parse(fleet, "bench")?,
        access: Access::parse(&access)?,
        tls: None,
        default_policy: std::fs::read(catalog::resolve(&args.policy)?)?,
        limits: crate::wasm::Limits::default(),
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: StoreChoice::Embedded,
        // The workload's high-priority classes may preempt its low-priority work.
        scheduling: Scheduling { auto_compaction: args.compact.is_some(), high_priority: HIGH_PRIORITY, ..Scheduling::default() },
    };
    let rank = std::fs::read(catalog::resolve(&args.rank)?)?;
    let compact = args.compact.as_deref().map(|c| catalog::resolve(c).and_then(|p| Ok(std::fs::read(p)?))).transpose()?;
    // The heartbeat timeout of a real host; lost nodes would be requeued.
    let hub_config = crate::serve::hub::HubConfig::default();

    let host_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let agent_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name(THREAD_AGENTS).enable_all().build()?;
    let host = host_rt.block_on(crate::serve::server::start_with_agents(config.clone(), hub_config.clone()))?;
    let url = format!("http://{}", host.addr);
    let (driver_args, recovery_args) = (args.clone(), args.clone());
    let live = host.live.clone();
    // On the agents' runtime: the operator's and the submitter's calls
    // count with the agents, not the host.
    // What each node runs, kept across the host's restart.
    let tasks: Vec<Tasks> = (0..args.nodes).map(|_| Tasks::default()).collect();
    let stats = Arc::new(AgentStats::default());
    let (driver_tasks, driver_stats) = (tasks.clone(), stats.clone());
    let driver = agent_rt.spawn(async move {
        let (tasks, stats, args) = (driver_tasks, driver_stats, driver_args);
        let mut api = crate::client::connect(&url, Some(OPERATOR), None, None).await?;
        for (hook, component) in [("rank", Some(rank)), ("compact", compact)] {
            let Some(component) = component else { continue };
            let up = api.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: hook.into(), ..Default::default() }).await?.into_inner();
            api.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.policy.map_or(0, |p| p.version), hook: hook.into() }).await?;
        }

        // The agents: registered, each with its command stream and heartbeats.
        let registered = Instant::now();
        let agents = spawn_agents(&url, &args, &stats, &tasks).await?;
        all_schedulable(&mut api, args.nodes).await?;
        let register_s = registered.elapsed().as_secs_f64();
        eprintln!("bench fleet: {} nodes registered in {register_s:.1} s; submitting {} warm jobs", args.nodes, warm.len());

        // The operator: `berth jobs` and the partitions every 2 s.
        let polling = Arc::new(Mutex::new(Polls::default()));
        let poller = {
            let (mut api, polling) = (api.clone(), polling.clone());
            tokio::spawn(async move {
                loop {
                    let phase = polling.lock().unwrap().phase;
                    let t = Instant::now();
                    let jobs = api.list_jobs(pb::ListJobsRequest { partition: "p0".into(), limit: 50, ..Default::default() }).await;
                    let jobs_ms = t.elapsed().as_secs_f64() * 1e3;
                    let t = Instant::now();
                    let parts = api.list_partitions(pb::ListPartitionsRequest {}).await;
                    let parts_ms = t.elapsed().as_secs_f64() * 1e3;
                    let t = Instant::now();
                    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await;
                    let nodes_ms = t.elapsed().as_secs_f64() * 1e3;
                    if let (Ok(_), Ok(_), Ok(nodes)) = (jobs, parts, nodes) {
                        let unreachable = nodes.into_inner().nodes.iter().filter(|n| n.state == "unreachable").count();
                        let mut p = polling.lock().unwrap();
                        p.most_unreachable_run = p.most_unreachable_run.max(unreachable);
                        if p.phase != phase {
                            continue;
                        }
                        p.jobs_ms.push(jobs_ms);
                        p.partitions_ms.push(parts_ms);
                        p.nodes_ms.push(nodes_ms);
                        p.most_unreachable = p.most_unreachable.max(unreachable);
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            })
        };

        // The warm start: the jobs alive at that moment, from a few
        // clients at once, until the host has decided every one.
        let warm_jobs = warm.len();
        let (warm_submit_s, warm_tasks_running, warm_s) = submit_and_decide(&api, warm.iter().map(|(j, left_s)| spec_of(j, *left_s / args.speedup)).collect()).await?;
        eprintln!("bench fleet: warm start: accepted in {warm_submit_s:.1} s, decided in {warm_s:.1} s");
        // The fill: low-priority replicas on half a GPU each, running
        // through the run (and the restart).
        let fill_s = if args.fill_tasks > 0 {
            let fill = pb::JobSpec {
                partition: "p0".into(),
                tasks: FILL_TASKS_PER_JOB,
                gpus: 1,
                gpu_milli: 500,
                cpu_milli: 2000,
                memory_mib: 8 << 10,
                priority: crate::asi::workload::LOW_PRIORITY,
                argv: vec!["bench-run".into(), (24 * 3_600_000u64).to_string()],
                movable: true,
                ..Default::default()
            };
            let jobs = args.fill_tasks.div_ceil(FILL_TASKS_PER_JOB) as usize;
            let (accepted, _, s) = submit_and_decide(&api, vec![fill; jobs]).await?;
            eprintln!("bench fleet: {jobs} fill jobs accepted in {accepted:.1} s, decided in {s:.1} s");
            s
        } else {
            0.0
        };
        let tasks_running_at_start = tasks_running(&api).await?;
        eprintln!("bench fleet: {} arrivals over {} s", arrivals.len(), args.seconds);
        // The measured phase: the arrivals, at the speed-up.
        let measured_from_ms = crate::util::unix_ms();
        let passes_before = live.partitions[0].pass_times.lock().unwrap().count;
        {
            let mut trips = stats.round_trip_us.lock().unwrap();
            stats.phase.fetch_add(1, Ordering::SeqCst);
            trips.clear();
        }
        stats.late.store(0, Ordering::Relaxed);
        {
            let mut p = polling.lock().unwrap();
            *p = Polls { phase: p.phase + 1, most_unreachable_run: p.most_unreachable_run, ..Polls::default() };
        }
        let started = Instant::now();
        let mut submitted = 0;
        for j in &arrivals {
            let at = Duration::from_secs_f64((j.arrival_s as f64 - args.warm_hours * 3600.0) / args.speedup);
            if let Some(wait) = at.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            if submit(&mut api, spec_of(j, j.duration_s as f64 / args.speedup)).await? {
                submitted += 1;
            }
        }
        let remaining = Duration::from_secs(args.seconds).saturating_sub(started.elapsed());
        tokio::time::sleep(remaining).await;
        poller.abort();
        eprintln!("bench fleet: arrivals done ({submitted} accepted); reading the host's state");

        // What the host shows, and what the run cost.
        let nodes_unreachable = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await?.into_inner().nodes.iter().filter(|n| n.name.starts_with("fleet-") && n.state == "unreachable").count();
        let partition = api.list_partitions(pb::ListPartitionsRequest {}).await?.into_inner().partitions.into_iter().find(|p| p.name == "p0");
        let jobs = crate::client::list_all_jobs(api.clone(), pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await?;
        let (host_cpu_s, agents_cpu_s) = thread_cpu_seconds();
        let (rss_mib, rss_peak_mib) = rss_mib();
        for a in agents {
            a.abort();
        }
        // Submitted in the measured phase and started: (id, high priority, ms from acceptance to start).
        let started: Vec<(u64, bool, u64)> = jobs
            .iter()
            .filter(|j| j.started_unix_ms > 0 && j.submitted_unix_ms >= measured_from_ms)
            .map(|j| (j.id, j.spec.as_ref().is_some_and(|s| s.priority >= HIGH_PRIORITY), j.started_unix_ms.saturating_sub(j.submitted_unix_ms)))
            .collect();
        let running = running_tasks(&jobs);
        let ended = jobs.iter().filter(|j| matches!(j.state.as_str(), "finished" | "failed" | "cancelled")).count();
        let mut polls = std::mem::take(&mut *polling.lock().unwrap());
        for v in [&mut polls.jobs_ms, &mut polls.partitions_ms, &mut polls.nodes_ms] {
            v.sort_by(f64::total_cmp);
        }
        let mut beats = std::mem::take(&mut *stats.round_trip_us.lock().unwrap());
        beats.sort_unstable();
        Ok::<_, anyhow::Error>(Measured {
            register_s,
            warm_jobs,
            warm_s,
            warm_submit_s,
            warm_tasks_running,
            fill_s,
            tasks_running_at_start,
            measured_from_ms,
            passes_before,
            submitted,
            started,
            ended,
            running,
            gpus_busy: partition.map_or(0.0, |p| p.gpus_busy),
            polls,
            beats,
            beats_late: stats.late.load(Ordering::Relaxed),
            nodes_unreachable,
            host_cpu_s,
            agents_cpu_s,
            rss_mib,
            rss_peak_mib,
        })
    });
    let result = agent_rt.block_on(driver).map_err(anyhow::Error::from).and_then(|r| r);
    let live = host.live.clone(); // the driver's clone went with it
    let m = match result {
        Ok(m) => m,
        Err(e) => {
            host_rt.block_on(host.shutdown());
            return Err(e);
        }
    };
    // The measured phase's passes (the latest the ring kept).
    let (mut passes, pass_count) = {
        let times = live.partitions[0].pass_times.lock().unwrap();
        let latest = times.latest_us();
        let measured = usize::try_from(times.count - m.passes_before).unwrap_or(usize::MAX).min(latest.len());
        (latest[latest.len() - measured..].iter().map(|&us| u64::from(us)).collect::<Vec<u64>>(), times.count - m.passes_before)
    };
    passes.sort_unstable();
    // One read of the decision log: placement latencies, and the jobs that
    // waited for a victim.
    let log = decision_log(&state_dir);
    let decisions = decision_latencies(&log, m.measured_from_ms);
    let waited_for_victims: BTreeSet<u64> = log
        .iter()
        .filter(|d| d["outcome"] == "evicted")
        .filter_map(|d| d["detail"].as_str().and_then(|s| s.strip_prefix("for job ").or_else(|| s.strip_prefix("preempted for job "))).and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()).and_then(|s| s.parse().ok()))
        .collect();
    drop(log);
    let preemptions = live.metrics.evictions.with_label_values(&["p0", "preempt"]).get();
    let store_bytes = dir_bytes(&state_dir);
    drop(live);

    // The restart with everything running: the host goes (every change is
    // stored as it happens, so its stop writes nothing a kill -9 would
    // lose) and a new one recovers from the store; the nodes' agents, their
    // tasks still running, register again and are reconciled.
    drop(agent_rt);
    let stopped = Instant::now();
    host_rt.block_on(host.shutdown());
    let restarted = host_rt.block_on(crate::serve::server::start_with_agents(config, hub_config));
    let host = match restarted {
        Ok(h) => h,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&state_dir);
            return Err(e.context("the host did not start again on its store"));
        }
    };
    let back_s = stopped.elapsed().as_secs_f64();
    let url = format!("http://{}", host.addr);
    let agent_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name(THREAD_AGENTS).enable_all().build()?;
    let nodes = recovery_args.nodes;
    let recovery = agent_rt.block_on(async move {
        let mut api = crate::client::connect(&url, Some(OPERATOR), None, None).await?;
        let recovered_jobs = running_jobs(&mut api).await?;
        let agents = spawn_agents(&url, &recovery_args, &stats, &tasks).await?;
        all_schedulable(&mut api, nodes).await?;
        let rejoined_s = stopped.elapsed().as_secs_f64();
        // Deciding again: one high-priority one-GPU job, submitted now.
        let probe = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, gpu_milli: 1000, priority: HIGH_PRIORITY, argv: vec!["bench-run".into(), "60000".into()], ..Default::default() };
        let id = api.submit_job(pb::SubmitJobRequest { job: Some(probe), ..Default::default() }).await?.into_inner().job_id;
        loop {
            let page = api.list_jobs(pb::ListJobsRequest { partition: "p0".into(), limit: 1, ..Default::default() }).await?.into_inner().jobs;
            if page.first().is_some_and(|j| j.id == id && (j.decision_id != 0 || j.state == "running")) {
                break;
            }
            anyhow::ensure!(stopped.elapsed() < Duration::from_secs(600), "the restarted host decided nothing in 10 minutes");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let decided_s = stopped.elapsed().as_secs_f64();
        let running_after = running_jobs(&mut api).await?;
        for a in agents {
            a.abort();
        }
        anyhow::Ok(Recovery { back_s, rejoined_s, decided_s, recovered_jobs, running_after })
    });
    host_rt.block_on(host.shutdown());
    drop(agent_rt);
    let _ = std::fs::remove_dir_all(&state_dir);
    let recovery = recovery?;
    eprintln!("bench fleet: restarted: back in {:.1} s, every node in {:.1} s, deciding in {:.1} s", recovery.back_s, recovery.rejoined_s, recovery.decided_s);
    let sorted = |v: Vec<u64>| {
        let mut v = v;
        v.sort_unstable();
        v
    };
    let high = sorted(m.started.iter().filter(|s| s.1).map(|s| s.2).collect());
    let free = sorted(m.started.iter().filter(|s| s.1 && !waited_for_victims.contains(&s.0)).map(|s| s.2).collect());
    let all = sorted(m.started.iter().map(|s| s.2).collect());
    let ms = |v: &[f64], p: f64| if v.is_empty() { 0.0 } else { v[((v.len() - 1) as f64 * p / 100.0).round() as usize] };
    Ok(FleetBench {
        nodes: args.nodes,
        gpus: args.nodes * 8,
        heartbeat_ms: args.heartbeat_ms,
        seconds: args.seconds,
        speedup: args.speedup,
        workload: args.workload.clone(),
        register_s: m.register_s,
        warm_jobs: m.warm_jobs,
        warm_s: m.warm_s,
        warm_submit_s: m.warm_submit_s,
        warm_tasks_running: m.warm_tasks_running,
        fill_tasks: args.fill_tasks.div_ceil(FILL_TASKS_PER_JOB) * FILL_TASKS_PER_JOB,
        fill_s: m.fill_s,
        tasks_running_at_start: m.tasks_running_at_start,
        jobs_submitted: m.submitted,
        jobs_started: m.started.len(),
        jobs_ended: m.ended,
        tasks_running_at_end: m.running,
        gpus_busy_at_end: m.gpus_busy,
        preemptions,
        decisions: decisions.len(),
        decision_p50_us: percentile(&decisions, 50.0),
        decision_p99_us: percentile(&decisions, 99.0),
        decision_max_us: decisions.last().copied().unwrap_or(0),
        passes: pass_count,
        pass_p50_us: percentile(&passes, 50.0),
        pass_p99_us: percentile(&passes, 99.0),
        pass_max_us: passes.last().copied().unwrap_or(0),
        submit_to_start_high_p50_ms: percentile(&high, 50.0),
        submit_to_start_high_p99_ms: percentile(&high, 99.0),
        submit_to_start_free_p99_ms: percentile(&free, 99.0),
        submit_to_start_all_p99_ms: percentile(&all, 99.0),
        heartbeats: m.beats.len() as u64,
        heartbeat_p50_us: percentile(&m.beats, 50.0),
        heartbeat_p99_us: percentile(&m.beats, 99.0),
        heartbeats_late: m.beats_late,
        nodes_unreachable: m.nodes_unreachable,
        nodes_unreachable_most: m.polls.most_unreachable,
        nodes_unreachable_most_run: m.polls.most_unreachable_run,
        list_jobs_p99_ms: ms(&m.polls.jobs_ms, 99.0),
        list_partitions_p99_ms: ms(&m.polls.partitions_ms, 99.0),
        list_nodes_p99_ms: ms(&m.polls.nodes_ms, 99.0),
        host_cpu_s: m.host_cpu_s,
        agents_cpu_s: m.agents_cpu_s,
        rss_mib: m.rss_mib,
        rss_peak_mib: m.rss_peak_mib,
        store_bytes,
        recovery,
    })
}

/// The restart: seconds from the stop until the host answered again (its
/// store read), until every node was back and schedulable, and until it
/// decided a new job; running jobs it recovered, and running after.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Recovery {
    pub back_s: f64,
    pub rejoined_s: f64,
    pub decided_s: f64,
    pub recovered_jobs: u32,
    pub running_after: u32,
}

async fn running_jobs(api: &mut crate::client::Client) -> anyhow::Result<u32> {
    let parts = api.list_partitions(pb::ListPartitionsRequest {}).await?.into_inner().partitions;
    Ok(parts.into_iter().find(|p| p.name == "p0").map_or(0, |p| p.running_jobs))
}

/// What the run saw, before it is summed up.
struct Measured {
    register_s: f64,
    warm_jobs: usize,
    warm_s: f64,
    warm_submit_s: f64,
    warm_tasks_running: u32,
    fill_s: f64,
    tasks_running_at_start: usize,
    measured_from_ms: u64,
    passes_before: u64,
    submitted: usize,
    started: Vec<(u64, bool, u64)>,
    ended: usize,
    running: usize,
    gpus_busy: f64,
    polls: Polls,
    beats: Vec<u64>,
    beats_late: u64,
    nodes_unreachable: usize,
    host_cpu_s: f64,
    agents_cpu_s: f64,
    rss_mib: u64,
    rss_peak_mib: u64,
}

/// The operator's polls: how long each listing took, and the most nodes
/// any showed unreachable.
#[derive(Default)]
struct Polls {
    /// Bumped when the measured phase starts: a poll begun before is not
    /// counted in it.
    phase: u64,
    jobs_ms: Vec<f64>,
    partitions_ms: Vec<f64>,
    nodes_ms: Vec<f64>,
    most_unreachable: usize,
    /// Kept across phases.
    most_unreachable_run: usize,
}

#[derive(Default)]
struct AgentStats {
    round_trip_us: Mutex<Vec<u64>>,
    late: AtomicU64,
    /// Bumped when the measured phase starts: a round trip begun before
    /// is not counted in it.
    phase: AtomicU64,
}

/// One agent node of the benchmark.
struct BenchNode {
    name: String,
    index: u32,
    per_switch: u32,
    period: Duration,
}

impl BenchNode {
    /// Registers and serves the node's commands until the host goes.
    /// `running` (allocation, when it exits) outlives a host: a node whose
    /// host restarts still runs its tasks and reports them when it is back.
    async fn run(self, mut hub: HubClient, stats: Arc<AgentStats>, running: Tasks) -> anyhow::Result<()> {
        let reg = crate::bench_live::bench_registration(&self.name, self.index / self.per_switch);
        let report = |mut hub: HubClient, node: String, allocation_id: u64, state: &'static str| async move {
            let _ = hub.report_allocation(pb::AllocationReport { node, allocation_id, state: state.into(), ..Default::default() }).await;
        };
        // Each task exits at its time (those that ran past it while the
        // host was away, now).
        let exit_at = |hub: HubClient, node: String, running: Tasks, a: u64, at: Instant| {
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                if running.lock().unwrap().remove(&a).is_some() {
                    report(hub, node, a, "exited").await;
                }
            })
        };
        for (&a, &at) in running.lock().unwrap().iter() {
            exit_at(hub.clone(), self.name.clone(), running.clone(), a, at);
        }
        // A node whose command stream ends (taken for lost on a starved
        // machine, say) registers again, as `berth agent` does; the first
        // registration's failure is the benchmark's. Ends with the runtime.
        let mut first = true;
        loop {
            let session = match hub.register(reg.clone()).await {
                Ok(r) => r.into_inner().session,
                Err(e) if first => return Err(e.into()),
                Err(_) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let mut stream = match hub.commands(pb::CommandsRequest { node: self.name.clone(), session }).await {
                Ok(s) => s.into_inner(),
                Err(e) if first => return Err(e.into()),
                Err(_) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            first = false;
            let beating = {
                let (mut hub, node, running, period, stats) = (hub.clone(), self.name.clone(), running.clone(), self.period, stats.clone());
                // Spread over the period, as nodes started at different times.
                let phase = period.mul_f64(f64::from(self.index % 997) / 997.0);
                tokio::spawn(async move {
                    tokio::time::sleep(phase).await;
                    let mut tick = tokio::time::interval(period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let mut last = Instant::now();
                    loop {
                        tick.tick().await;
                        if last.elapsed() > period + period / 2 {
                            stats.late.fetch_add(1, Ordering::Relaxed);
                        }
                        last = Instant::now();
                        let running: Vec<u64> = running.lock().unwrap().keys().copied().collect();
                        let busy = !running.is_empty();
                        let telemetry = (0..8)
                            .map(|g| pb::GpuTelemetry { index: g, sm_util_pct: if busy { 60 } else { 0 }, memory_used_mib: if busy { 40_000 } else { 0 }, temperature_c: 50, power_mw: 300_000, ..Default::default() })
                            .collect();
                        let (t, phase) = (Instant::now(), stats.phase.load(Ordering::SeqCst));
                        if hub.heartbeat(pb::HeartbeatRequest { node: node.clone(), session, gpus: telemetry, running, powered_down: false, ..Default::default() }).await.is_ok() {
                            let mut trips = stats.round_trip_us.lock().unwrap();
                            if stats.phase.load(Ordering::SeqCst) == phase {
                                trips.push(t.elapsed().as_micros() as u64);
                            }
                        }
                    }
                })
            };
            // The host gone or the node given up, the stream ends.
            while let Ok(Some(cmd)) = stream.message().await {
                let a = cmd.allocation_id;
                match cmd.action.as_str() {
                    "start" => {
                        // Its exit after the job's duration (argv: bench-run MS).
                        let run_ms: u64 = cmd.argv.get(1).and_then(|s| s.parse().ok()).unwrap_or(1000);
                        let at = Instant::now() + Duration::from_millis(run_ms);
                        running.lock().unwrap().insert(a, at);
                        report(hub.clone(), self.name.clone(), a, "running").await;
                        exit_at(hub.clone(), self.name.clone(), running.clone(), a, at);
                    }
                    "stop" => {
                        if running.lock().unwrap().remove(&a).is_some() {
                            report(hub.clone(), self.name.clone(), a, "exited").await;
                        }
                    }
                    "sleep" => report(hub.clone(), self.name.clone(), a, "sleeping").await,
                    "wake" => report(hub.clone(), self.name.clone(), a, "running").await,
                    _ => {}
                }
            }
            beating.abort();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// A bench node's tasks: allocation, and when it exits.
type Tasks = Arc<Mutex<std::collections::BTreeMap<u64, Instant>>>;

/// Starts every bench agent (a few nodes per connection), each with its
/// node's tasks.
async fn spawn_agents(url: &str, args: &FleetArgs, stats: &Arc<AgentStats>, tasks: &[Tasks]) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut clients = Vec::new();
    for _ in 0..args.nodes.div_ceil(NODES_PER_CONNECTION) {
        clients.push(crate::agent::connect_hub(url, Some(AGENT), None).await?);
    }
    let mut agents = Vec::with_capacity(args.nodes as usize);
    for i in 0..args.nodes {
        let hub = clients[(i / NODES_PER_CONNECTION) as usize].clone();
        let node = BenchNode { name: format!("fleet-{i:05}"), index: i, per_switch: args.nodes_per_switch, period: Duration::from_millis(args.heartbeat_ms) };
        let (stats, running) = (stats.clone(), tasks[i as usize].clone());
        agents.push(tokio::spawn(async move {
            if let Err(e) = node.run(hub, stats, running).await {
                eprintln!("bench agent: {e:#}");
            }
        }));
    }
    Ok(agents)
}

/// Waits until all `nodes` bench nodes are listed schedulable.
async fn all_schedulable(api: &mut crate::client::Client, nodes: u32) -> anyhow::Result<()> {
    let since = Instant::now();
    loop {
        let listed = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await?.into_inner().nodes;
        if listed.iter().filter(|n| n.name.starts_with("fleet-") && n.schedulable).count() == nodes as usize {
            return Ok(());
        }
        anyhow::ensure!(since.elapsed() < Duration::from_secs(600), "the agents did not register in 10 minutes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The request for one job of the workload, running `run_s` seconds.
fn spec_of(j: &berth_core::job::Job, run_s: f64) -> pb::JobSpec {
    let run_ms = (run_s * 1000.0).max(1.0) as u64;
    pb::JobSpec {
        partition: "p0".into(),
        tasks: j.tasks,
        gpus: j.shape.gpu_count,
        gpu_milli: j.shape.gpu_milli,
        cpu_milli: j.shape.cpu_milli,
        memory_mib: j.shape.memory_mib,
        priority: j.priority,
        argv: vec!["bench-run".into(), run_ms.to_string()],
        // Low-priority work may be moved by live compaction.
        movable: j.priority < HIGH_PRIORITY,
        class: j.task_class().name().to_string(),
        ..Default::default()
    }
}

/// Submits `specs` from eight clients at once, then waits until the host
/// has decided them. Seconds until every job was
/// accepted, running jobs then, and seconds until decided.
async fn submit_and_decide(api: &crate::client::Client, specs: Vec<pb::JobSpec>) -> anyhow::Result<(f64, u32, f64)> {
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    let mut shares: Vec<Vec<pb::JobSpec>> = (0..8).map(|_| Vec::new()).collect();
    for (i, spec) in specs.into_iter().enumerate() {
        shares[i % 8].push(spec);
    }
    for share in shares {
        let mut api = api.clone();
        clients.spawn(async move {
            for spec in share {
                submit(&mut api, spec).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = clients.join_next().await {
        done??;
    }
    let submit_s = started.elapsed().as_secs_f64();
    let mut api = api.clone();
    // Work left waiting for room moves as running work ends (at a speed-up,
    // all the time): decided once the waiting count made no new low for a
    // second.
    let (mut fewest, mut stale) = (u32::MAX, 0);
    let running = loop {
        let p = api.list_partitions(pb::ListPartitionsRequest {}).await?.into_inner().partitions.into_iter().find(|p| p.name == "p0");
        let (running, pending) = p.map_or((0, 0), |p| (p.running_jobs, p.pending_jobs));
        stale = if pending < fewest { 0 } else { stale + 1 };
        fewest = fewest.min(pending);
        if pending == 0 || stale >= 4 {
            break running;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(3600), "{pending} jobs were not decided in an hour");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    Ok((submit_s, running, started.elapsed().as_secs_f64()))
}

/// Tasks running, from an operator's listing of every job.
async fn tasks_running(api: &crate::client::Client) -> anyhow::Result<usize> {
    let jobs = crate::client::list_all_jobs(api.clone(), pb::ListJobsRequest { partition: "p0".into(), state: "running".into(), ..Default::default() }).await?;
    Ok(running_tasks(&jobs))
}

/// Tasks placed and not gone: running, or started and not yet reported
/// running by their agents.
fn running_tasks(jobs: &[pb::Job]) -> usize {
    jobs.iter().filter(|j| j.state == "running").flat_map(|j| &j.runs).filter(|r| matches!(r.state.as_str(), "running" | "starting")).count()
}

/// Submits one job; whether it was accepted (a shape no node has is not).
async fn submit(api: &mut crate::client::Client, spec: pb::JobSpec) -> anyhow::Result<bool> {
    match api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await {
        Ok(_) => Ok(true),
        Err(s) if s.code() == tonic::Code::InvalidArgument => Ok(false),
        Err(s) => Err(anyhow::anyhow!("submit: {s}")),
    }
}

/// Every record of the decision log, its rotated files included.
fn decision_log(dir: &std::path::Path) -> Vec<serde_json::Value> {
    let files = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>()).unwrap_or_default();
    files
        .iter()
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("decisions") && n.ends_with(".jsonl")))
        .flat_map(|p| std::fs::read_to_string(p).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect::<Vec<_>>())
        .collect()
}

/// Placement decisions' latencies (µs) from the decision log, sorted.
fn decision_latencies(log: &[serde_json::Value], from_ms: u64) -> Vec<u64> {
    let mut all: Vec<u64> = log
        .iter()
        .filter(|d| d["arm"] == "active" && d["outcome"] != "evicted" && d["unix_ms"].as_u64().is_some_and(|t| t >= from_ms))
        .filter_map(|d| d["latency_us"].as_u64())
        .collect();
    all.sort_unstable();
    all
}

/// CPU seconds of the host (the process, less the benchmark's agents) and
/// of the agents (their runtime's threads, all alive till the end).
fn thread_cpu_seconds() -> (f64, f64) {
    // utime and stime (fields 14 and 15) of a /proc stat line, in seconds;
    // a process's include its threads that have ended.
    let cpu = |path: &std::path::Path| -> Option<(String, f64)> {
        let stat = std::fs::read_to_string(path).ok()?;
        let (open, close) = (stat.find('(')?, stat.rfind(')')?);
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        Some((stat[open + 1..close].to_string(), ticks / 100.0)) // USER_HZ
    };
    let total = cpu(std::path::Path::new("/proc/self/stat")).map_or(0.0, |c| c.1);
    let agents: f64 = std::fs::read_dir("/proc/self/task")
        .map(|tasks| tasks.flatten().filter_map(|t| cpu(&t.path().join("stat"))).filter(|(comm, _)| comm.starts_with(THREAD_AGENTS)).map(|c| c.1).sum())
        .unwrap_or(0.0);
    ((total - agents).max(0.0), agents)
}

/// The process's resident memory now and at its peak, MiB.
fn rss_mib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|k| k.parse::<u64>().ok()).map_or(0, |kb| kb / 1024);
    (field("VmRSS:"), field("VmHWM:"))
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir).map(|d| d.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()).unwrap_or(0)
}

impl FleetBench {
    /// The figures, one per line, for people.
    pub fn table(&self) -> String {
        let ms = |us: u64| us as f64 / 1e3;
        format!(
            "live host, {} agent nodes ({} GPUs), heartbeats every {} ms; {} workload for {} s at {}x\n\
             registered in {:.1} s; warm start: {} jobs alive, accepted in {:.1} s and decided in {:.1} s, {} running; fill: {} half-GPU tasks decided in {:.1} s; {} tasks running\n\
             measured phase: {} jobs submitted, {} started, {} ended, {} preemptions; at the end {} tasks running, {:.0} GPUs busy\n\
             placement decision p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} decisions)\n\
             whole pass p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} passes)\n\
             submit to start, high priority: p50 {} ms, p99 {} ms (on free GPUs p99 {} ms; every started job p99 {} ms)\n\
             heartbeats: {} sent, round trip p50 {:.2} ms, p99 {:.2} ms, {} late by over half a period; nodes unreachable: {} at the end, {} at most ({} at most over the whole run)\n\
             operator: berth jobs p99 {:.1} ms, partitions p99 {:.1} ms, nodes p99 {:.1} ms\n\
             CPU: host {:.1} s, bench agents {:.1} s; RSS {} MiB (peak {} MiB, agents included); store {:.1} MiB\n\
             restart with everything running: host back in {:.1} s ({} running jobs recovered from the store), every node back in {:.1} s, a new job decided {:.1} s after the stop; {} jobs running then\n",
            self.nodes,
            self.gpus,
            self.heartbeat_ms,
            self.workload,
            self.seconds,
            self.speedup,
            self.register_s,
            self.warm_jobs,
            self.warm_submit_s,
            self.warm_s,
            self.warm_tasks_running,
            self.fill_tasks,
            self.fill_s,
            self.tasks_running_at_start,
            self.jobs_submitted,
            self.jobs_started,
            self.jobs_ended,
            self.preemptions,
            self.tasks_running_at_end,
            self.gpus_busy_at_end,
            ms(self.decision_p50_us),
            ms(self.decision_p99_us),
            ms(self.decision_max_us),
            self.decisions,
            ms(self.pass_p50_us),
            ms(self.pass_p99_us),
            ms(self.pass_max_us),
            self.passes,
            self.submit_to_start_high_p50_ms,
            self.submit_to_start_high_p99_ms,
            self.submit_to_start_free_p99_ms,
            self.submit_to_start_all_p99_ms,
            self.heartbeats,
            ms(self.heartbeat_p50_us),
            ms(self.heartbeat_p99_us),
            self.heartbeats_late,
            self.nodes_unreachable,
            self.nodes_unreachable_most,
            self.nodes_unreachable_most_run,
            self.list_jobs_p99_ms,
            self.list_partitions_p99_ms,
            self.list_nodes_p99_ms,
            self.host_cpu_s,
            self.agents_cpu_s,
            self.rss_mib,
            self.rss_peak_mib,
            self.store_bytes as f64 / (1 << 20) as f64,
            self.recovery.back_s,
            self.recovery.recovered_jobs,
            self.recovery.rejoined_s,
            self.recovery.decided_s,
            self.recovery.running_after
        )
    }
}
