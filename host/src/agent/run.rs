//! The agent process: discovery, `--once --json`, registration,
//! heartbeats, the command stream and the children it runs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::process::Command;

use super::devices::{DeviceSource, Gpu, Nvml, Sample, Synthetic};
use super::{connect_hub, HubClient};
use crate::serve::pb;

#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// Host URL (https:// with --ca).
    #[arg(long, env = "BERTH_SERVER", default_value = "http://127.0.0.1:7450")]
    server: String,
    /// Bearer token of an identity with the operator role on --partition.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) that signed the host's certificate.
    #[arg(long, env = "BERTH_CA")]
    ca: Option<PathBuf>,
    /// Node name (default: the hostname).
    #[arg(long)]
    node: Option<String>,
    #[arg(long, default_value = "p0")]
    partition: String,
    /// Synthetic GPUs instead of NVML, as NxMODEL (e.g. 8xH20).
    #[arg(long)]
    synthetic_gpus: Option<String>,
    /// Synthetic only: report an XID event on a GPU, INDEX:CODE (repeatable).
    #[arg(long, requires = "synthetic_gpus")]
    synthetic_xid: Vec<String>,
    #[arg(long, default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Print discovery and one telemetry sample, then exit.
    #[arg(long)]
    once: bool,
    #[arg(long, requires = "once")]
    json: bool,
    /// Hook commands (run with `sh -c`, with BERTH_ALLOCATION and BERTH_PID
    /// set); by default SIGSTOP, SIGCONT and SIGUSR1 to the child's group.
    #[arg(long)]
    sleep_hook: Option<String>,
    #[arg(long)]
    wake_hook: Option<String>,
    #[arg(long)]
    checkpoint_hook: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping an allocation.
    #[arg(long, default_value_t = 10)]
    stop_grace_s: u64,
    /// CPU cores and memory offered for placement (default: the machine's;
    /// with --synthetic-gpus, 16 cores and 128 GiB per GPU).
    #[arg(long)]
    cpu_cores: Option<u32>,
    #[arg(long)]
    memory_gib: Option<u64>,
}

/// The machine's memory (MiB), from /proc/meminfo.
fn memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())))
        .map_or(0, |kib| kib / 1024)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "localhost".into())
}

/// The device source the arguments ask for; without `--synthetic-gpus` and
/// without a driver, the error is the one line to print.
fn source(args: &AgentArgs, node: &str) -> anyhow::Result<Box<dyn DeviceSource>> {
    if let Some(shape) = &args.synthetic_gpus {
        let mut xids = Vec::new();
        for x in &args.synthetic_xid {
            let (i, c) = x.split_once(':').ok_or_else(|| anyhow::anyhow!("--synthetic-xid {x:?}: expected INDEX:CODE"))?;
            xids.push((i.parse()?, c.parse()?));
        }
        return Ok(Box::new(Synthetic::new(node, shape, xids)?));
    }
    match Nvml::open() {
        Ok(n) => Ok(Box::new(n)),
        Err(e) => anyhow::bail!("no NVIDIA driver: NVML could not be loaded ({e}); pass --synthetic-gpus 8xH20 to run with synthetic GPUs"),
    }
}

#[derive(Serialize)]
struct OnceReport<'a> {
    node: &'a str,
    source: &'static str,
    gpus: &'a [Gpu],
    telemetry: Vec<Sample>,
}

fn gpu_info(g: &Gpu) -> pb::GpuInfo {
    pb::GpuInfo {
        index: g.index,
        uuid: g.uuid.clone(),
        model: g.model.clone(),
        memory_total_mib: g.memory_total_mib,
        pci_bus_id: g.pci_bus_id.clone(),
        nvlink_peers: g.nvlink_peers.clone(),
    }
}

fn telemetry(s: Sample) -> pb::GpuTelemetry {
    pb::GpuTelemetry {
        index: s.index,
        sm_util_pct: s.sm_util_pct,
        memory_used_mib: s.memory_used_mib,
        temperature_c: s.temperature_c,
        power_mw: s.power_mw,
        events: s.events.into_iter().map(|e| pb::HealthEvent { kind: e.kind, code: e.code, detail: e.detail }).collect(),
    }
}

/// `berth agent`. Exits non-zero (with one line) when there is no driver
/// and no `--synthetic-gpus`.
pub fn main(args: AgentArgs) -> anyhow::Result<()> {
    let node = args.node.clone().unwrap_or_else(hostname);
    let mut src = match source(&args, &node) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("berth agent: {e:#}");
            std::process::exit(2);
        }
    };
    if args.once {
        let telemetry = src.sample(&[]);
        let report = OnceReport { node: &node, source: src.kind(), gpus: src.gpus(), telemetry };
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!("node {node}: {} GPUs ({})", report.gpus.len(), report.source);
            for (g, t) in report.gpus.iter().zip(&report.telemetry) {
                println!(
                    "  {} {} {} {} MiB, bus {}: SM {}%, {} MiB used, {} C, {:.1} W",
                    g.index,
                    g.uuid,
                    g.model,
                    g.memory_total_mib,
                    g.pci_bus_id,
                    t.sm_util_pct,
                    t.memory_used_mib,
                    t.temperature_c,
                    t.power_mw as f64 / 1000.0
                );
            }
        }
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(Agent::new(args, node, src).run())
}

/// A child the agent runs.
struct Child {
    pid: u32,
    gpus: Vec<u32>,
    /// Stopped by a sleep command: its GPUs do no work.
    sleeping: bool,
}

struct Agent {
    args: AgentArgs,
    node: String,
    src: Mutex<Box<dyn DeviceSource>>,
    children: Mutex<HashMap<u64, Child>>,
}

fn signal_group(pid: u32, sig: i32) -> std::io::Result<()> {
    // SAFETY: kill(2) with a negative pid signals the process group the
    // child leads (it was started with process_group(0)).
    if unsafe { libc::kill(-(pid as i32), sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Agent {
    fn new(args: AgentArgs, node: String, src: Box<dyn DeviceSource>) -> Arc<Agent> {
        Arc::new(Agent { args, node, src: Mutex::new(src), children: Mutex::new(HashMap::new()) })
    }

    async fn connect(&self) -> HubClient {
        let mut delay = Duration::from_millis(100);
        loop {
            match connect_hub(&self.args.server, self.args.token.as_deref(), self.args.ca.as_deref()).await {
                Ok(c) => return c,
                Err(e) => {
                    tracing::warn!(target: "berth::agent", "{e:#}; retrying in {delay:?}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn register(&self, c: &mut HubClient) -> anyhow::Result<u64> {
        let gpus = self.src.lock().unwrap().gpus().iter().map(gpu_info).collect();
        let source = self.src.lock().unwrap().kind().to_string();
        let synthetic = self.args.synthetic_gpus.is_some();
        let n = self.src.lock().unwrap().gpus().len() as u32;
        let cores = self.args.cpu_cores.unwrap_or(if synthetic { 16 * n.max(1) } else { std::thread::available_parallelism().map_or(1, |c| c.get() as u32) });
        let memory = self.args.memory_gib.map_or(if synthetic { 128 * 1024 * u64::from(n.max(1)) } else { memory_mib() }, |g| g * 1024);
        let req = pb::RegisterAgentRequest {
            cpu_milli: cores.saturating_mul(1000),
            memory_mib: memory,
            node: self.node.clone(),
            partition: self.args.partition.clone(),
            gpus,
            source,
            agent_version: env!("CARGO_PKG_VERSION").into(),
        };
        let r = c.register(req).await.map_err(|s| anyhow::anyhow!("register: {:?}: {}", s.code(), s.message()))?;
        Ok(r.into_inner().session)
    }

    async fn run(self: Arc<Self>) -> anyhow::Result<()> {
        let mut client = self.connect().await;
        // Registration failures other than the connection (a bad token, an
        // unknown partition) are fatal: retrying cannot fix them.
        let session = self.register(&mut client).await?;
        eprintln!("berth agent: node {} registered with {} ({} GPUs, session {session})", self.node, self.args.server, self.src.lock().unwrap().gpus().len());
        let session = Arc::new(std::sync::atomic::AtomicU64::new(session));
        let commands = tokio::spawn(self.clone().command_loop(client.clone(), session.clone()));
        let period = Duration::from_millis(self.args.heartbeat_ms.max(10));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            }
            let busy: Vec<u32> = self.children.lock().unwrap().values().filter(|c| !c.sleeping).flat_map(|c| c.gpus.clone()).collect();
            let running: Vec<u64> = self.children.lock().unwrap().keys().copied().collect();
            let gpus = self.src.lock().unwrap().sample(&busy).into_iter().map(telemetry).collect();
            let req = pb::HeartbeatRequest { node: self.node.clone(), session: session.load(std::sync::atomic::Ordering::SeqCst), gpus, running };
            if let Err(s) = client.heartbeat(req).await {
                tracing::warn!(target: "berth::agent", "heartbeat: {:?}: {}", s.code(), s.message());
                if s.code() == tonic::Code::NotFound {
                    // The host forgot us (restarted): register again.
                    if let Ok(new) = self.register(&mut client).await {
                        session.store(new, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            }
        }
        commands.abort();
        // Children leave with the agent: stop them.
        for c in self.children.lock().unwrap().values() {
            let _ = signal_group(c.pid, libc::SIGTERM);
        }
        Ok(())
    }

    async fn command_loop(self: Arc<Self>, mut client: HubClient, session: Arc<std::sync::atomic::AtomicU64>) {
        loop {
            let req = pb::CommandsRequest { node: self.node.clone(), session: session.load(std::sync::atomic::Ordering::SeqCst) };
            match client.commands(req).await {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(cmd)) => self.clone().handle(client.clone(), cmd).await,
                            Ok(None) => break,
                            Err(s) => {
                                tracing::warn!(target: "berth::agent", "command stream: {:?}: {}", s.code(), s.message());
                                break;
                            }
                        }
                    }
                }
                Err(s) => tracing::warn!(target: "berth::agent", "commands: {:?}: {}", s.code(), s.message()),
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn report(&self, client: &mut HubClient, r: pb::AllocationReport) {
        if let Err(s) = client.report_allocation(r).await {
            tracing::warn!(target: "berth::agent", "report: {:?}: {}", s.code(), s.message());
        }
    }

    async fn handle(self: Arc<Self>, mut client: HubClient, cmd: pb::AgentCommand) {
        let id = cmd.allocation_id;
        let base = pb::AllocationReport { node: self.node.clone(), allocation_id: id, ..Default::default() };
        match cmd.action.as_str() {
            "start" => {
                let known: Vec<String> = self.src.lock().unwrap().gpus().iter().map(|g| g.uuid.clone()).collect();
                let gpus: Vec<u32> = cmd.gpu_uuids.iter().filter_map(|u| known.iter().position(|k| k == u).map(|i| i as u32)).collect();
                if gpus.len() != cmd.gpu_uuids.len() || cmd.argv.is_empty() {
                    let detail = format!("refused: argv {:?}, GPUs {:?} (this node has {known:?})", cmd.argv, cmd.gpu_uuids);
                    self.report(&mut client, pb::AllocationReport { state: "failed".into(), detail, ..base }).await;
                    return;
                }
                let visible = cmd.gpu_uuids.join(",");
                let mut c = Command::new(&cmd.argv[0]);
                c.args(&cmd.argv[1..])
                    .envs(&cmd.env)
                    .env("CUDA_VISIBLE_DEVICES", &visible)
                    .env("NVIDIA_VISIBLE_DEVICES", &visible)
                    .env("BERTH_ALLOCATION", id.to_string())
                    .env("BERTH_NODE", &self.node)
                    .stdin(std::process::Stdio::null())
                    .process_group(0)
                    .kill_on_drop(false);
                let mut child = match c.spawn() {
                    Ok(ch) => ch,
                    Err(e) => {
                        self.report(&mut client, pb::AllocationReport { state: "failed".into(), detail: format!("spawn {:?}: {e}", cmd.argv[0]), ..base }).await;
                        return;
                    }
                };
                let pid = child.id().unwrap_or(0);
                self.children.lock().unwrap().insert(id, Child { pid, gpus, sleeping: false });
                tracing::info!(target: "berth::agent", allocation = id, pid, gpus = %visible, "started");
                self.report(&mut client, pb::AllocationReport { state: "running".into(), pid, ..base.clone() }).await;
                let agent = self.clone();
                tokio::spawn(async move {
                    let status = child.wait().await;
                    agent.children.lock().unwrap().remove(&id);
                    use std::os::unix::process::ExitStatusExt;
                    let r = match status {
                        Ok(s) => pb::AllocationReport {
                            state: "exited".into(),
                            pid,
                            exit_code: s.code().unwrap_or(-1),
                            signal: s.signal().unwrap_or(0),
                            detail: s.to_string(),
                            ..base
                        },
                        Err(e) => pb::AllocationReport { state: "failed".into(), pid, detail: format!("wait: {e}"), ..base },
                    };
                    tracing::info!(target: "berth::agent", allocation = id, "{}", r.detail);
                    agent.report(&mut client, r).await;
                });
            }
            action @ ("stop" | "sleep" | "wake" | "checkpoint") => {
                let Some(pid) = self.children.lock().unwrap().get(&id).map(|c| c.pid) else {
                    tracing::warn!(target: "berth::agent", allocation = id, "{action}: no such child here");
                    return;
                };
                let hook = match action {
                    "sleep" => self.args.sleep_hook.clone(),
                    "wake" => self.args.wake_hook.clone(),
                    "checkpoint" => self.args.checkpoint_hook.clone(),
                    _ => None,
                };
                let result = if let Some(hook) = hook {
                    Command::new("sh")
                        .arg("-c")
                        .arg(&hook)
                        .env("BERTH_ALLOCATION", id.to_string())
                        .env("BERTH_PID", pid.to_string())
                        .status()
                        .await
                        .and_then(|s| if s.success() { Ok(()) } else { Err(std::io::Error::other(format!("hook {hook:?}: {s}"))) })
                } else {
                    match action {
                        "sleep" => signal_group(pid, libc::SIGSTOP),
                        "wake" => signal_group(pid, libc::SIGCONT),
                        "checkpoint" => signal_group(pid, libc::SIGUSR1),
                        _ => {
                            let r = signal_group(pid, libc::SIGTERM);
                            // A stopped child cannot act on SIGTERM until continued.
                            let _ = signal_group(pid, libc::SIGCONT);
                            let grace = Duration::from_secs(self.args.stop_grace_s);
                            let agent = self.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(grace).await;
                                if agent.children.lock().unwrap().get(&id).is_some_and(|c| c.pid == pid) {
                                    let _ = signal_group(pid, libc::SIGKILL);
                                }
                            });
                            r
                        }
                    }
                };
                if result.is_ok() && matches!(action, "sleep" | "wake") {
                    if let Some(c) = self.children.lock().unwrap().get_mut(&id) {
                        c.sleeping = action == "sleep";
                    }
                }
                match (action, result) {
                    ("sleep", Ok(())) => self.report(&mut client, pb::AllocationReport { state: "sleeping".into(), pid, ..base }).await,
                    ("wake", Ok(())) => self.report(&mut client, pb::AllocationReport { state: "running".into(), pid, ..base }).await,
                    (_, Ok(())) => tracing::info!(target: "berth::agent", allocation = id, "{action} sent"),
                    (_, Err(e)) => tracing::warn!(target: "berth::agent", allocation = id, "{action}: {e}"),
                }
            }
            other => tracing::warn!(target: "berth::agent", "unknown command {other:?}"),
        }
    }
}

/// `berth alloc ...`: operator commands for agents and allocations.
#[derive(clap::Subcommand, Debug)]
pub enum AllocCommand {
    /// Agents (nodes, GPUs, health) and allocations.
    List {
        #[arg(long, default_value = "")]
        partition: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: HubConn,
    },
    /// Start a command on GPUs of an agent node: `berth alloc start --node n1 --gpus 0,1 -- cmd args`.
    Start {
        #[arg(long)]
        node: String,
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<u32>,
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
        #[command(flatten)]
        conn: HubConn,
    },
    /// stop, sleep, wake or checkpoint an allocation.
    Control {
        #[arg(value_parser = ["stop", "sleep", "wake", "checkpoint"])]
        action: String,
        allocation: u64,
        #[command(flatten)]
        conn: HubConn,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct HubConn {
    #[arg(long, env = "BERTH_SERVER", default_value = "http://127.0.0.1:7450")]
    server: String,
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[arg(long, env = "BERTH_CA")]
    ca: Option<PathBuf>,
}

pub fn alloc(cmd: AllocCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let status = |s: tonic::Status| anyhow::anyhow!("{:?}: {}", s.code(), s.message());
        let client = |c: &HubConn| {
            let c = c.clone();
            async move { connect_hub(&c.server, c.token.as_deref(), c.ca.as_deref()).await }
        };
        match cmd {
            AllocCommand::List { partition, json, conn } => {
                let r = client(&conn).await?.list_agents(pb::ListAgentsRequest { partition }).await.map_err(status)?.into_inner();
                if json {
                    let agents: Vec<serde_json::Value> = r
                        .agents
                        .iter()
                        .map(|a| {
                            serde_json::json!({
                                "node": a.node, "partition": a.partition, "state": a.state, "source": a.source,
                                "heartbeats": a.heartbeats,
                                "gpus": a.gpus.iter().map(|g| {
                                    let i = g.info.clone().unwrap_or_default();
                                    serde_json::json!({"index": i.index, "uuid": i.uuid, "model": i.model, "memory_total_mib": i.memory_total_mib,
                                        "healthy": g.healthy, "reason": g.unhealthy_reason, "allocation": g.allocation_id})
                                }).collect::<Vec<_>>(),
                            })
                        })
                        .collect();
                    let allocs: Vec<serde_json::Value> = r
                        .allocations
                        .iter()
                        .map(|a| serde_json::json!({"id": a.id, "node": a.node, "gpus": a.gpus, "gpu_uuids": a.gpu_uuids, "argv": a.argv,
                            "state": a.state, "pid": a.pid, "exit_code": a.exit_code, "signal": a.signal, "detail": a.detail}))
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&serde_json::json!({"agents": agents, "allocations": allocs}))?);
                } else {
                    for a in &r.agents {
                        let bad: Vec<String> = a.gpus.iter().filter(|g| !g.healthy).map(|g| format!("GPU {} ({})", g.info.as_ref().map_or(0, |i| i.index), g.unhealthy_reason)).collect();
                        let model = a.gpus.first().and_then(|g| g.info.as_ref()).map_or("-".into(), |i| i.model.clone());
                        println!("{:<16} {:<5} {:<11} {}x{} {:<9} {} heartbeats{}", a.node, a.partition, a.state, a.gpus.len(), model, a.source, a.heartbeats,
                            if bad.is_empty() { String::new() } else { format!(", unhealthy: {}", bad.join(", ")) });
                    }
                    for a in &r.allocations {
                        println!("allocation {} on {} GPUs {:?}: {} (exit {}, signal {}) {:?}", a.id, a.node, a.gpus, a.state, a.exit_code, a.signal, a.argv);
                    }
                }
            }
            AllocCommand::Start { node, gpus, argv, conn } => {
                let r = client(&conn).await?.start_allocation(pb::StartAllocationRequest { node, gpus, argv, env: Default::default() }).await.map_err(status)?.into_inner();
                println!("allocation {} on {}", r.allocation_id, r.gpu_uuids.join(","));
            }
            AllocCommand::Control { action, allocation, conn } => {
                client(&conn).await?.control_allocation(pb::ControlAllocationRequest { allocation_id: allocation, action: action.clone() }).await.map_err(status)?;
                println!("allocation {allocation}: {action} sent");
            }
        }
        anyhow::Ok(())
    })
}
