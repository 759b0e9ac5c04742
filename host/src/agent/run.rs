//! The agent process: discovery, `--once --json`, registration,
//! heartbeats, the command stream and the children it runs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio::process::Command;

use super::devices::{DeviceSource, Gpu, Nvml, Sample, Synthetic};
use super::isolation::{self, CpuList, Isolation};
use super::{connect_hub, HubClient};
use crate::proto as pb;

/// The agent token of `berth agent --trial` (the repository's example,
/// accepted by `berth serve --trial`).
const TRIAL_AGENT_TOKEN: &str = include_str!("../../../examples/serve/agent-token");

/// Set in a task's environment: the file `berth checkpointed` writes.
pub const CHECKPOINT_ENV: &str = "BERTH_CHECKPOINTED";
/// Set in a task's environment: the file `berth ready` writes.
pub const READY_ENV: &str = "BERTH_READY";
/// Set in a task's environment: the file holding the task's count of work
/// done (`berth progress`, or written by the task itself as a decimal).
pub const PROGRESS_ENV: &str = "BERTH_PROGRESS";
/// Set in a task's environment: the file the agent writes when the task is
/// told to checkpoint (a preemption's or a migration's notice).
pub const NOTICE_ENV: &str = "BERTH_NOTICE";
/// Set in a task's environment: on synthetic GPUs, the file in which the
/// task declares the GPU memory it holds on each of its GPUs (MiB, decimal;
/// absent: none). Stands in for NVML's count when the agent checks that a
/// sleeping task released its GPUs' memory.
pub const GPU_MEMORY_ENV: &str = "BERTH_GPU_MEMORY";
/// How often the agent looks for a task's checkpoint report.
const CHECKPOINT_POLL: Duration = Duration::from_millis(250);

/// How long one exit report waits for the host's answer before it is kept
/// for the next try.
const REPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pool executors whose decision logs an agent keeps (the newest).
pub const EXECUTOR_LOGS_KEPT: usize = 32;

/// `berth checkpointed`, run inside a task: tells the agent (and through it
/// the host) that the task just saved its work, so preemption counts work
/// lost from now.
pub fn report_checkpoint() -> anyhow::Result<()> {
    // The count it saved goes with it: the agent relays both, so work
    // reported after the checkpoint is never taken as saved.
    let units = std::env::var_os(PROGRESS_ENV).map_or(0, |p| read_count(std::path::Path::new(&p)));
    touch_marker(CHECKPOINT_ENV, "checkpointed", &format!(" {units}"))
}

/// `berth progress UNITS [--total]`, run inside a task: adds UNITS to the
/// task's count of work done (or sets it, with `total`). The count is
/// relayed by the agent and counted by the host in the outcome. Concurrent
/// calls in one task are serialised by a lock on the count's file.
pub fn report_progress(units: u64, total: bool) -> anyhow::Result<()> {
    let path = std::env::var_os(PROGRESS_ENV).ok_or_else(|| anyhow::anyhow!("{PROGRESS_ENV} is not set: run `berth progress` inside a task started by `berth agent`"))?;
    let path = std::path::Path::new(&path);
    let lock_path = count_lock(path);
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).with_context(|| format!("opening {}", lock_path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function owns; released on close.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        anyhow::bail!("locking {}: {}", lock_path.display(), std::io::Error::last_os_error());
    }
    let count = if total { units } else { read_count(path).checked_add(units).ok_or_else(|| anyhow::anyhow!("the work count would pass {}", u64::MAX))? };
    crate::util::write_atomic(path, count.to_string().as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The lock file beside a task's count file (`berth progress` holds it).
fn count_lock(count: &std::path::Path) -> PathBuf {
    let mut lock = count.as_os_str().to_owned();
    lock.push(".lock");
    PathBuf::from(lock)
}

/// The count a task's latest checkpoint saved (`berth checkpointed`
/// writes "<unix ms> <units>"; 0 when absent or unreadable).
fn checkpoint_units(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path).ok().and_then(|t| t.split_whitespace().nth(1).and_then(|u| u.parse().ok())).unwrap_or(0)
}

/// Whether the power file says the node is off (its first word "off").
fn powered_off(path: &std::path::Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|t| t.split_whitespace().next().is_some_and(|w| w.eq_ignore_ascii_case("off")))
}

/// A task's count of work done (0 when absent or unreadable: the host
/// never takes a count back, so a bad read only delays one).
fn read_count(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0)
}

/// `berth ready`, run inside a task: tells the agent (and through it the
/// host) that the task serves, so a migrated copy may take over from the
/// old one (jobs submitted with --wait-ready).
pub fn report_ready() -> anyhow::Result<()> {
    touch_marker(READY_ENV, "ready", "")
}

/// Writes the marker file named by the task's environment variable `var`:
/// the time (Unix ms), then `rest`.
fn touch_marker(var: &str, command: &str, rest: &str) -> anyhow::Result<()> {
    let marker = std::env::var_os(var).ok_or_else(|| anyhow::anyhow!("{var} is not set: run `berth {command}` inside a task started by `berth agent`"))?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
    crate::util::write_atomic(std::path::Path::new(&marker), format!("{now}{rest}").as_bytes())
        .with_context(|| format!("writing {}", std::path::Path::new(&marker).display()))?;
    Ok(())
}

#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// Host URL (https:// with --ca); several, comma-separated, for hosts
    /// in high availability (the agent moves to the next when one fails).
    #[arg(long, env = "BERTH_SERVER", default_value = "http://127.0.0.1:7450")]
    server: String,
    /// Where the agent records the processes it runs, so that an agent
    /// restarted after a crash adopts those still running and reports those
    /// that ended (default: <tmp>/berth-agent-<node>).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Internal: run a task under a supervisor that records how it ended.
    #[arg(long, hide = true)]
    supervise: Option<PathBuf>,
    #[arg(last = true, hide = true)]
    command: Vec<String>,
    /// Internal (with --supervise): a cgroup's cgroup.procs the task joins
    /// before it runs (repeatable).
    #[arg(long, hide = true)]
    cgroup_procs: Vec<PathBuf>,
    /// Internal (with --supervise): the CPUs the task is pinned to.
    #[arg(long, hide = true, value_parser = CpuList::parse)]
    pin: Option<CpuList>,
    /// File holding the bearer token of an identity with the agent role on
    /// --partition for this node (`roles = { "p0" = "agent" }` and `nodes`
    /// in the access file). Read from a file, never from argv or the
    /// environment, so no task can find it in either.
    #[arg(long, env = "BERTH_TOKEN_FILE", conflicts_with = "trial")]
    token_file: Option<PathBuf>,
    /// For a host started with `berth serve --trial`: the example agent
    /// token built into the binary (examples/serve/agent-token, public)
    /// instead of --token-file; loopback servers only.
    #[arg(long)]
    trial: bool,
    /// CA certificate (PEM) that signed the host's certificate.
    #[arg(long, env = "BERTH_CA")]
    ca: Option<PathBuf>,
    /// Node name (default: the hostname).
    #[arg(long)]
    node: Option<String>,
    /// Partition the node joins.
    #[arg(long, default_value = "p0")]
    partition: String,
    /// Synthetic GPUs instead of NVML, as NxMODEL (e.g. 8xH20).
    #[arg(long)]
    synthetic_gpus: Option<String>,
    /// Synthetic only: report an XID event on a GPU, INDEX:CODE (repeatable).
    #[arg(long, requires = "synthetic_gpus")]
    synthetic_xid: Vec<String>,
    /// Synthetic only: report the --synthetic-xid events once FILE exists
    /// (on the first sample after), instead of on the third sample.
    #[arg(long, requires = "synthetic_xid", value_name = "FILE")]
    synthetic_xid_when: Option<PathBuf>,
    /// Milliseconds between heartbeats (each carries per-GPU telemetry).
    #[arg(long, default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Print discovery and one telemetry sample, then exit.
    #[arg(long)]
    once: bool,
    /// With --once: print as JSON.
    #[arg(long, requires = "once")]
    json: bool,
    /// Hook commands (run with `sh -c`, with BERTH_ALLOCATION and BERTH_PID
    /// set); by default SIGSTOP and SIGCONT to the child's group, and a
    /// checkpoint notice in the file $BERTH_NOTICE (see --notice-signal).
    /// A child frozen by the default sleep is stopped with SIGKILL (its GPUs
    /// are lent: continuing it to act on SIGTERM would put it back on them).
    #[arg(long)]
    sleep_hook: Option<String>,
    /// Command run to wake an allocation (default: SIGCONT to its group).
    #[arg(long)]
    wake_hook: Option<String>,
    /// Command run to checkpoint an allocation (default: the notice file,
    /// and --notice-signal if set).
    #[arg(long)]
    checkpoint_hook: Option<String>,
    /// Also signal a task's group at a checkpoint notice (USR1, USR2, URG,
    /// HUP, INT, TERM, WINCH). Unset by default: a task that does not trap
    /// the signal would die of it (USR1's default action) instead of
    /// getting its notice and grace; the notice file is always written.
    #[arg(long, value_parser = parse_notice_signal)]
    notice_signal: Option<NoticeSignal>,
    /// The node's access switch (nodes declaring the same one form a switch
    /// domain for gang placement); unset: a domain of its own.
    #[arg(long)]
    switch_domain: Option<u32>,
    /// The node's aggregation switch (above its access switch).
    #[arg(long, requires = "switch_domain")]
    aggregation: Option<u32>,
    /// Relay a task's work count (`berth progress`) at most this often,
    /// in milliseconds (each relay is a store write on the host); a
    /// checkpoint and the task's end carry it at once.
    #[arg(long, default_value_t = 5000)]
    progress_every_ms: u64,
    /// A file holding "off" while the node is powered down (parked): the
    /// agent then reports it so, and the host keeps work off it and counts
    /// its GPUs installed but not powered. For synthetic agents, the way to
    /// power one down; on a real node, written by the power manager.
    #[arg(long)]
    power_file: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping an allocation.
    #[arg(long, default_value_t = 10)]
    stop_grace_s: u64,
    /// CPU cores and memory offered for placement (default: the machine's;
    /// with --synthetic-gpus, 16 cores and 128 GiB per GPU).
    #[arg(long)]
    cpu_cores: Option<u32>,
    /// Host memory offered for placement, GiB (see --cpu-cores).
    #[arg(long)]
    memory_gib: Option<u64>,
    /// The node's CPUs, as a kernel CPU list (e.g. 0-3 or 0,2,4-7): every
    /// task runs on these only, and they are the cores offered unless
    /// --cpu-cores says otherwise. Two agents given disjoint lists are two
    /// nodes for CPU purposes on one machine. Default: the CPUs the agent
    /// may run on.
    #[arg(long, value_parser = CpuList::parse)]
    cpus: Option<CpuList>,
    /// How tasks' CPU and memory requests are enforced: auto (a cgroup per
    /// task with a CPU quota, a memory limit and the freezer, v2 or v1,
    /// where the agent may write them; else CPU affinity, said once at
    /// start), cgroup (or refuse to start), affinity (the CPU list only) or
    /// none.
    #[arg(long, value_enum, default_value = "auto")]
    isolation: isolation::Mode,
    /// Another of the agent's environment variables every task inherits
    /// (repeatable), beside the fixed allowlist: e.g. LD_LIBRARY_PATH or
    /// CUDA_HOME on a node whose CUDA libraries need them. Never a
    /// credential: a task is the tenant's code.
    #[arg(long = "task-env", value_name = "NAME")]
    task_env: Vec<String>,
}

/// The agent's variables a task inherits: where programs are, the locale,
/// the time zone, the temporary directory and the user's home and name.
/// Everything else reaches a task only through its job's declared env.
pub const TASK_ENV_ALLOWLIST: [&str; 9] = ["PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "HOME", "USER", "LOGNAME"];

/// The agent's variables a task inherits: the allowlist and `extra`
/// (`--task-env`), those that are set.
fn allowed_env(extra: &[String]) -> Vec<(String, std::ffi::OsString)> {
    TASK_ENV_ALLOWLIST.iter().map(|k| k.to_string()).chain(extra.iter().cloned()).filter_map(|k| std::env::var_os(&k).map(|v| (k, v))).collect()
}

/// Puts the agent's own folder at the end of the task's PATH, so `berth
/// checkpointed` and `berth ready` work inside a task wherever `berth` is
/// installed (last: nothing the PATH had is shadowed).
fn with_own_dir_on_path(env: &mut Vec<(String, std::ffi::OsString)>, exe: &std::path::Path) {
    let Some(dir) = exe.parent() else { return };
    match env.iter_mut().find(|(k, _)| k == "PATH") {
        Some((_, path)) => {
            let mut dirs: Vec<PathBuf> = std::env::split_paths(path).collect();
            if !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
                if let Ok(joined) = std::env::join_paths(dirs) {
                    *path = joined;
                }
            }
        }
        // No PATH of its own: the usual system folders, then its own.
        None => {
            let dirs = ["/usr/local/bin", "/usr/bin", "/bin"].into_iter().map(PathBuf::from).chain([dir.to_path_buf()]);
            if let Ok(joined) = std::env::join_paths(dirs) {
                env.push(("PATH".into(), joined));
            }
        }
    }
}

/// Reads the agent's bearer token from `path`: one line, surrounding
/// whitespace ignored.
fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --token-file {}", path.display()))?;
    let token = text.trim().to_string();
    anyhow::ensure!(!token.is_empty() && !token.contains(['\n', '\r']), "--token-file {}: expected one line holding the token", path.display());
    Ok(token)
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
        let synthetic = Synthetic::new(node, shape, xids)?;
        return Ok(Box::new(match &args.synthetic_xid_when {
            Some(file) => synthetic.xids_when(file.clone()),
            None => synthetic,
        }));
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
    if let Some(status) = &args.supervise {
        supervise(status, &args.command, &args.cgroup_procs, args.pin.as_ref());
    }
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
    // The host's and the agent's own variables never pass: they are the
    // task's (set by the agent) or credentials.
    if let Some(name) = args.task_env.iter().find(|n| n.starts_with("BERTH_") || n.is_empty() || n.contains(['=', '\0'])) {
        anyhow::bail!("--task-env {name:?}: not a variable a task may inherit (empty, '=' or NUL, or BERTH_*)");
    }
    let token = if args.trial {
        anyhow::ensure!(
            args.server.split(',').all(|s| ["http://127.0.0.1:", "http://localhost:", "http://[::1]:"].iter().any(|p| s.trim().starts_with(p))),
            "--trial sends a public example token: --server must be a loopback address"
        );
        Some(TRIAL_AGENT_TOKEN.trim().to_string())
    } else {
        args.token_file.as_deref().map(read_token_file).transpose()?
    };
    let state_dir = args.state_dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("berth-agent-{node}")));
    std::fs::create_dir_all(&state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let isolation = Isolation::detect(args.isolation, &group_tag(&node, &state_dir), args.cpus.clone()).map_err(|e| anyhow::anyhow!(e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(Agent::new(args, token, node, state_dir, isolation, src).run())
}

/// The name of this agent instance's cgroups: the node, and a digest of its
/// state folder (two agents of one name in different folders, as tests
/// run them, never share groups; a restarted agent finds its own).
fn group_tag(node: &str, state_dir: &std::path::Path) -> String {
    use sha2::Digest;
    let dir = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let digest = sha2::Sha256::digest(dir.as_os_str().as_encoded_bytes());
    let safe: String = node.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).take(40).collect();
    format!("{safe}-{}", hex::encode(&digest[..4]))
}

/// How a task ended, written by its supervisor.
#[derive(Serialize, serde::Deserialize)]
struct Ended {
    exit_code: i32,
    signal: i32,
    /// Why the task never ran (it could not be spawned or confined).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    error: String,
}

/// What the agent records per task it starts.
#[derive(Serialize, serde::Deserialize)]
struct Record {
    alloc_id: u64,
    pid: u32,
    gpus: Vec<u32>,
    /// The identity of the host that started it (empty: unknown, from an
    /// agent before identities): a report of it means nothing to another.
    #[serde(default)]
    host: String,
}

extern "C" fn ignore(_: libc::c_int) {}

/// A signal a task may be sent with its checkpoint notice.
#[derive(Clone, Copy, Debug)]
pub struct NoticeSignal(libc::c_int);

fn parse_notice_signal(name: &str) -> Result<NoticeSignal, String> {
    let bare = name.trim_start_matches("SIG");
    let sig = match bare {
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "URG" => libc::SIGURG,
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "TERM" => libc::SIGTERM,
        "WINCH" => libc::SIGWINCH,
        _ => return Err(format!("\"{name}\": one of USR1, USR2, URG, HUP, INT, TERM, WINCH")),
    };
    Ok(NoticeSignal(sig))
}

/// The supervisor: runs the task in its own process group (the group the
/// agent signals), outlives the agent if it dies, and writes how the task
/// ended to `status` for whichever agent adopts it.
fn supervise(status: &std::path::Path, argv: &[String], cgroups: &[PathBuf], pin: Option<&CpuList>) -> ! {
    // A handler, not SIG_IGN (which the task would inherit): signals sent to
    // the group reach the task, and the supervisor stays to record the end.
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGUSR1] {
        // SAFETY: installing an async-signal-safe no-op handler.
        unsafe { libc::signal(sig, ignore as *const () as libc::sighandler_t) };
    }
    let Some((prog, rest)) = argv.split_first() else {
        eprintln!("berth agent --supervise: no command");
        std::process::exit(2);
    };
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    // The task (not the supervisor) joins its cgroups and CPU list before
    // it runs: a task over its memory is the one the kernel kills, and the
    // supervisor stays to record it.
    let confine = match isolation::Confine::new(cgroups, pin) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("berth agent --supervise: {e}");
            std::process::exit(2);
        }
    };
    let mut command = std::process::Command::new(prog);
    command.args(rest);
    // SAFETY: Confine::apply makes only async-signal-safe calls.
    unsafe { command.pre_exec(move || confine.apply()) };
    let ended = match command.status() {
        Ok(s) => Ended { exit_code: s.code().unwrap_or(-1), signal: s.signal().unwrap_or(0), error: String::new() },
        Err(e) => {
            let error = format!("spawn {prog:?}: {e}{}", if cgroups.is_empty() && pin.is_none() { "" } else { " (or joining its cgroup and CPU list)" });
            eprintln!("berth agent --supervise: {error}");
            Ended { exit_code: 127, signal: 0, error }
        }
    };
    let _ = crate::util::write_atomic(status, &serde_json::to_vec(&ended).expect("serializes"));
    std::process::exit(if ended.signal != 0 { 128 + ended.signal } else { ended.exit_code });
}

fn task_usage(id: u64, u: &isolation::Usage, cpu_milli: u32) -> pb::TaskUsage {
    pb::TaskUsage {
        allocation_id: id,
        cpu_ms: u.cpu_us / 1000,
        throttled_ms: u.throttled_us / 1000,
        nr_throttled: u.nr_throttled,
        cpu_milli,
        memory_mib: u.memory_bytes >> 20,
        memory_peak_mib: u.memory_peak_bytes >> 20,
        oom_kills: u.oom_kills,
    }
}

/// Whether `pid` is a live supervisor (not a zombie, not a reused pid).
fn supervisor_alive(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("");
    cmdline.split(|&b| b == 0).any(|a| a == b"--supervise") && !matches!(state, "Z" | "X" | "")
}

/// A child the agent runs.
struct Child {
    pid: u32,
    gpus: Vec<u32>,
    /// Stopped by a sleep command: its GPUs do no work.
    sleeping: bool,
    /// The host's stop: when it came, and whether SIGKILL was needed.
    stop: Option<Stop>,
}

#[derive(Clone, Copy)]
struct Stop {
    at: std::time::Instant,
    killed: bool,
}


struct Agent {
    args: AgentArgs,
    /// Read from --token-file at start.
    token: Option<String>,
    node: String,
    src: Mutex<Box<dyn DeviceSource>>,
    children: Mutex<HashMap<u64, Child>>,
    servers: Vec<String>,
    next_server: std::sync::atomic::AtomicUsize,
    client: Mutex<Option<HubClient>>,
    state_dir: PathBuf,
    /// Exit reports the host has not acknowledged yet (it was away); their
    /// records stay on disk until it does.
    unsent: Mutex<Vec<pb::AllocationReport>>,
    /// Exit reports on their way to the host, not yet acknowledged: still
    /// named in heartbeats, so a beat that overtakes its report never
    /// makes the host take the task for lost.
    sending: Mutex<std::collections::HashSet<u64>>,
    /// The identity of the host this agent registered with last (empty
    /// before, or from a host that has none).
    host: Mutex<String>,
    /// The host named in each recovered record of a task that ended, by
    /// allocation: its exit report goes only to that host.
    ended_under: Mutex<HashMap<u64, String>>,
    /// The host named in each recovered record of a task still running:
    /// one another host started is stopped when this agent registers.
    adopted_under: Mutex<HashMap<u64, String>>,
    /// How tasks are confined (cgroups, affinity or nothing).
    isolation: Isolation,
    /// Each task's CPU time at the previous heartbeat, for its rate.
    cpu_seen: Mutex<HashMap<u64, (std::time::Instant, u64)>>,
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
    fn new(args: AgentArgs, token: Option<String>, node: String, state_dir: PathBuf, isolation: Isolation, src: Box<dyn DeviceSource>) -> Arc<Agent> {
        let servers = args.server.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        Arc::new(Agent {
            args,
            token,
            node,
            src: Mutex::new(src),
            children: Mutex::new(HashMap::new()),
            servers,
            next_server: Default::default(),
            client: Mutex::new(None),
            state_dir,
            unsent: Mutex::new(Vec::new()),
            sending: Mutex::new(Default::default()),
            host: Mutex::new(String::new()),
            ended_under: Mutex::new(HashMap::new()),
            adopted_under: Mutex::new(HashMap::new()),
            isolation,
            cpu_seen: Mutex::new(HashMap::new()),
        })
    }

    fn client(&self) -> HubClient {
        self.client.lock().unwrap().clone().expect("connected before use")
    }

    /// Connects to the next host that answers (round robin over --server).
    async fn connect(&self) {
        let mut delay = Duration::from_millis(100);
        loop {
            for _ in 0..self.servers.len() {
                let i = self.next_server.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % self.servers.len();
                let server = &self.servers[i];
                match connect_hub(server, self.token.as_deref(), self.args.ca.as_deref()).await {
                    Ok(c) => {
                        *self.client.lock().unwrap() = Some(c);
                        return;
                    }
                    Err(e) => tracing::warn!(target: "berth::agent", "{e:#}"),
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    fn record_path(&self, id: u64) -> (PathBuf, PathBuf) {
        (self.state_dir.join(format!("alloc-{id}.json")), self.state_dir.join(format!("alloc-{id}.status")))
    }

    /// Before registering: the tasks a previous agent started. Those still
    /// running are adopted (and listed in heartbeats, so the host keeps
    /// them or stops them); those that ended are reported.
    fn recover_children(&self) -> anyhow::Result<Vec<(u64, u32)>> {
        // (The state folder was made at start, before the cgroups.)
        let mut adopted = Vec::new();
        let mut recorded = Vec::new();
        for entry in std::fs::read_dir(&self.state_dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let Ok(rec) = serde_json::from_slice::<Record>(&std::fs::read(&path)?) else {
                tracing::warn!(target: "berth::agent", "{}: unreadable record, skipped", path.display());
                continue;
            };
            recorded.push(rec.alloc_id);
            let base = pb::AllocationReport { node: self.node.clone(), allocation_id: rec.alloc_id, pid: rec.pid, ..Default::default() };
            if supervisor_alive(rec.pid) {
                let stat = std::fs::read_to_string(format!("/proc/{}/stat", rec.pid)).unwrap_or_default();
                let sleeping = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()) == Some("T") || self.isolation.group(rec.alloc_id).frozen();
                self.children.lock().unwrap().insert(rec.alloc_id, Child { pid: rec.pid, gpus: rec.gpus, sleeping, stop: None });
                self.adopted_under.lock().unwrap().insert(rec.alloc_id, rec.host);
                adopted.push((rec.alloc_id, rec.pid));
                tracing::info!(target: "berth::agent", allocation = rec.alloc_id, pid = rec.pid, "adopted a running task");
            } else {
                let r = self.ended_report(base, None);
                self.ended_under.lock().unwrap().insert(rec.alloc_id, rec.host);
                self.unsent.lock().unwrap().push(r);
            }
        }
        // Groups of tasks with no record left (their end was acknowledged
        // just before an agent was killed) go.
        self.isolation.remove_stale(&recorded);
        Ok(adopted)
    }

    /// The exit report of a task: from its supervisor's record, else from
    /// the supervisor's own wait status, else unknown.
    fn ended_report(&self, mut base: pb::AllocationReport, waited: Option<std::io::Result<std::process::ExitStatus>>) -> pb::AllocationReport {
        use std::os::unix::process::ExitStatusExt;
        // The task's last count goes with its end, and what its latest
        // checkpoint saved (a checkpoint just before the exit may not have
        // been relayed yet).
        base.work_units = read_count(&self.progress_marker(base.allocation_id));
        base.work_checkpointed = checkpoint_units(&self.checkpoint_marker(base.allocation_id));
        // What its cgroup saw, an OOM kill included (the group stays until
        // the host has this report).
        let usage = self.isolation.group(base.allocation_id).usage();
        base.usage = Some(task_usage(base.allocation_id, &usage, 0));
        if usage.oom_kills > 0 {
            base.limit = "oom".into();
        }
        let oom = (usage.oom_kills > 0).then(|| format!("killed by the kernel over its memory limit ({} OOM kill(s), peak {} MiB); ", usage.oom_kills, usage.memory_peak_bytes >> 20));
        let status = std::fs::read(self.record_path(base.allocation_id).1).ok().and_then(|b| serde_json::from_slice::<Ended>(&b).ok());
        match (status, waited) {
            (Some(e), _) => {
                let detail = if !e.error.is_empty() {
                    e.error
                } else if e.signal != 0 {
                    format!("signal {}", e.signal)
                } else {
                    format!("exit status: {}", e.exit_code)
                };
                pb::AllocationReport { state: "exited".into(), exit_code: e.exit_code, signal: e.signal, detail: format!("{}{detail}", oom.unwrap_or_default()), ..base }
            }
            (None, Some(Ok(s))) => pb::AllocationReport { state: "exited".into(), exit_code: s.code().unwrap_or(-1), signal: s.signal().unwrap_or(0), detail: s.to_string(), ..base },
            (None, Some(Err(e))) => pb::AllocationReport { state: "failed".into(), detail: format!("wait: {e}"), ..base },
            (None, None) => pb::AllocationReport { state: "failed".into(), detail: "ended while no agent watched it; no status recorded".into(), ..base },
        }
    }

    /// Child `id`'s exit report `r`, with what it says of a stop the host
    /// asked for (when it came, whether SIGKILL was needed).
    fn with_stop(&self, id: u64, r: pb::AllocationReport) -> pb::AllocationReport {
        match self.children.lock().unwrap().get(&id).and_then(|c| c.stop) {
            Some(s) => pb::AllocationReport { stopped: true, stop_to_exit_ms: s.at.elapsed().as_millis() as u64, killed: s.killed, ..r },
            None => r,
        }
    }

    /// Notes the host's stop of child `id` (the first one counts: a repeated
    /// stop does not restart the clock).
    fn stop_sent(&self, id: u64, killed: bool) {
        if let Some(c) = self.children.lock().unwrap().get_mut(&id) {
            let stop = c.stop.get_or_insert(Stop { at: std::time::Instant::now(), killed });
            stop.killed |= killed;
        }
    }

    /// Delivers the exit report of child `id`, or keeps it (and its record)
    /// for later. Queued before the child leaves the running set, so every
    /// heartbeat names it (running, or ended with its report on the way) and
    /// the host never takes it for lost.
    async fn report_end(&self, id: u64, r: pb::AllocationReport) {
        self.unsent.lock().unwrap().push(r);
        self.children.lock().unwrap().remove(&id);
        self.flush().await;
    }

    /// Sends the exit reports the host has not had; forgets the records of
    /// those it acknowledged. Each send waits at most [`REPORT_TIMEOUT`].
    async fn flush(&self) {
        let pending: Vec<pb::AllocationReport> = {
            // (Named as sending before they leave the unsent list: a
            // heartbeat reads one or the other.)
            let mut unsent = self.unsent.lock().unwrap();
            self.sending.lock().unwrap().extend(unsent.iter().map(|r| r.allocation_id));
            std::mem::take(&mut *unsent)
        };
        let mut client = self.client();
        for r in pending {
            let id = r.allocation_id;
            // Bounded: a stalled connection must not keep the report named
            // as running (see `sending`) until TCP gives up.
            let sent = match tokio::time::timeout(REPORT_TIMEOUT, client.report_allocation(r.clone())).await {
                Ok(sent) => sent,
                Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer in {} s", REPORT_TIMEOUT.as_secs()))),
            };
            {
                // Kept for later unless the host took it or never will; put
                // back and no longer sending in one step (under the unsent
                // lock, as a concurrent flush takes it), so no heartbeat
                // misses it and another flush's send of it stays named.
                let mut unsent = self.unsent.lock().unwrap();
                if sent.as_ref().is_err_and(|s| s.code() != tonic::Code::NotFound) {
                    unsent.push(r.clone());
                }
                if !unsent.iter().any(|u| u.allocation_id == id) {
                    self.sending.lock().unwrap().remove(&id);
                }
            }
            match sent {
                Ok(_) => self.forget_task_files(id),
                Err(s) if s.code() == tonic::Code::NotFound => {
                    tracing::warn!(target: "berth::agent", allocation = id, "the host does not know this allocation: {}", s.message());
                    self.forget_task_files(id);
                }
                Err(s) => {
                    tracing::warn!(target: "berth::agent", allocation = id, "report kept for later: {:?}: {}", s.code(), s.message());
                }
            }
        }
    }

    /// Removes what the agent kept of an ended task whose end the host has.
    fn forget_task_files(&self, id: u64) {
        let (rec, status) = self.record_path(id);
        let progress = self.progress_marker(id);
        for f in [rec, status, count_lock(&progress), progress, self.checkpoint_marker(id), self.gpu_memory_marker(id)] {
            let _ = std::fs::remove_file(f);
        }
        self.isolation.remove(id);
        self.cpu_seen.lock().unwrap().remove(&id);
    }

    /// Watches an adopted task (not our child: polled) until it ends.
    fn watch_adopted(self: &Arc<Self>, id: u64, pid: u32) {
        let agent = self.clone();
        tokio::spawn(async move {
            while supervisor_alive(pid) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let base = pb::AllocationReport { node: agent.node.clone(), allocation_id: id, pid, ..Default::default() };
            let r = agent.with_stop(id, agent.ended_report(base, None));
            tracing::info!(target: "berth::agent", allocation = id, "adopted task ended: {}", r.detail);
            agent.report_end(id, r).await;
        });
    }

    async fn register(&self) -> anyhow::Result<u64> {
        let mut c = self.client();
        let gpus = self.src.lock().unwrap().gpus().iter().map(gpu_info).collect();
        let source = self.src.lock().unwrap().kind().to_string();
        let synthetic = self.args.synthetic_gpus.is_some();
        let n = self.src.lock().unwrap().gpus().len() as u32;
        // Cores offered: as told, else the agent's CPU list when it was
        // given one, else (synthetic) 16 per GPU or the machine's.
        let listed = self.args.cpus.as_ref().map(|c| c.len() as u32);
        let cores = self.args.cpu_cores.or(listed).unwrap_or(if synthetic { 16 * n.max(1) } else { self.isolation.cpus().map_or(1, |c| c.len() as u32) });
        let memory = self.args.memory_gib.map_or(if synthetic { 128 * 1024 * u64::from(n.max(1)) } else { memory_mib() }, |g| g * 1024);
        let req = pb::RegisterAgentRequest {
            cpu_milli: cores.saturating_mul(1000),
            memory_mib: memory,
            node: self.node.clone(),
            partition: self.args.partition.clone(),
            gpus,
            source,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            switch_domain: self.args.switch_domain,
            aggregation: self.args.aggregation,
            isolation: self.isolation.name().into(),
            cpus: self.isolation.cpus().map(|c| c.to_string()).unwrap_or_default(),
        };
        let r = c.register(req).await.map_err(|s| anyhow::anyhow!("register: {:?}: {}", s.code(), s.message()))?.into_inner();
        self.forget_other_hosts_ends(&r.host_identity);
        self.stop_other_hosts_tasks(&r.host_identity).await;
        *self.host.lock().unwrap() = r.host_identity;
        Ok(r.session)
    }

    /// Stops the tasks an earlier, unrelated host started that still run
    /// (their records in this node's state folder name another host
    /// identity): this host never gave those allocation ids and will give
    /// them again, so they are gone before it can send a start with one of
    /// them (which the agent would take for a task it already runs, while
    /// the old process held the GPUs). SIGTERM (a frozen task thawed to act
    /// on it), SIGKILL after the stop grace.
    async fn stop_other_hosts_tasks(&self, identity: &str) {
        if identity.is_empty() {
            return;
        }
        let foreign: Vec<(u64, u32)> = {
            let under = self.adopted_under.lock().unwrap();
            let children = self.children.lock().unwrap();
            under.iter().filter(|(_, host)| !host.is_empty() && *host != identity).filter_map(|(&id, _)| children.get(&id).map(|c| (id, c.pid))).collect()
        };
        if foreign.is_empty() {
            return;
        }
        let alive = |foreign: &[(u64, u32)]| foreign.iter().any(|&(_, pid)| supervisor_alive(pid));
        for &(id, pid) in &foreign {
            let _ = signal_group(pid, libc::SIGTERM);
            let _ = self.isolation.group(id).freeze(false);
            let _ = signal_group(pid, libc::SIGCONT);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(self.args.stop_grace_s);
        while alive(&foreign) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for &(id, pid) in &foreign {
            if supervisor_alive(pid) {
                let _ = signal_group(pid, libc::SIGKILL);
                self.isolation.group(id).kill_all();
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while alive(&foreign) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for &(id, _) in &foreign {
            self.children.lock().unwrap().remove(&id);
            self.adopted_under.lock().unwrap().remove(&id);
            self.unsent.lock().unwrap().retain(|r| r.allocation_id != id);
            self.forget_task_files(id);
        }
        tracing::warn!(target: "berth::agent", stopped = foreign.len(), "tasks an earlier, unrelated host started (this node's state folder) stopped");
    }

    /// Drops the recorded ends of tasks another host started (an earlier,
    /// unrelated run on this node's state folder): that host is gone, and
    /// this one never gave those allocation ids. Tasks still running are
    /// kept and listed: the host decides what runs on its GPUs.
    fn forget_other_hosts_ends(&self, identity: &str) {
        if identity.is_empty() {
            return;
        }
        let foreign: Vec<u64> = {
            let mut under = self.ended_under.lock().unwrap();
            let foreign = under.iter().filter(|(_, host)| !host.is_empty() && *host != identity).map(|(&id, _)| id).collect::<Vec<_>>();
            under.retain(|_, host| host.is_empty() || host == identity);
            foreign
        };
        if foreign.is_empty() {
            return;
        }
        self.unsent.lock().unwrap().retain(|r| !foreign.contains(&r.allocation_id));
        for &id in &foreign {
            self.forget_task_files(id);
        }
        tracing::info!(target: "berth::agent", dropped = foreign.len(), "ended tasks recorded under another host forgotten (an earlier run's state folder)");
    }

    async fn run(self: Arc<Self>) -> anyhow::Result<()> {
        anyhow::ensure!(!self.servers.is_empty(), "--server is empty");
        let adopted = self.recover_children()?;
        self.connect().await;
        // Registration failures other than the connection (a bad token, an
        // unknown partition) are fatal: retrying cannot fix them.
        let session = self.register().await?;
        eprintln!(
            "berth agent: node {} registered with {} ({} GPUs, session {session}); tasks confined by {}",
            self.node,
            self.args.server,
            self.src.lock().unwrap().gpus().len(),
            self.isolation.describe()
        );
        // Ends the host has not heard of go before the first heartbeat, which
        // lists what still runs.
        self.flush().await;
        // (Those another host started are gone already.)
        for (id, pid) in adopted {
            if self.children.lock().unwrap().get(&id).is_some_and(|c| c.pid == pid) {
                self.watch_adopted(id, pid);
            }
        }
        let session = Arc::new(std::sync::atomic::AtomicU64::new(session));
        let commands = tokio::spawn(self.clone().command_loop(session.clone()));
        let period = Duration::from_millis(self.args.heartbeat_ms.max(10));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            }
            let busy: Vec<u32> = self.children.lock().unwrap().values().filter(|c| !c.sleeping).flat_map(|c| c.gpus.clone()).collect();
            // Running, or ended with an exit report the host has not had yet:
            // that report (sent right after) tells how it ended.
            // (Children first: a child leaves them only after its report is
            // queued, so one read or the other finds it.)
            let mut running: Vec<u64> = self.children.lock().unwrap().keys().copied().collect();
            {
                let unsent = self.unsent.lock().unwrap();
                running.extend(unsent.iter().map(|r| r.allocation_id));
                running.extend(self.sending.lock().unwrap().iter().copied());
            }
            running.sort_unstable();
            running.dedup();
            let gpus = self.src.lock().unwrap().sample(&busy).into_iter().map(telemetry).collect();
            let powered_down = self.args.power_file.as_deref().is_some_and(powered_off);
            let (contention, tasks) = self.sample_usage();
            let req = pb::HeartbeatRequest {
                node: self.node.clone(),
                session: session.load(std::sync::atomic::Ordering::SeqCst),
                gpus,
                running,
                powered_down,
                contention: Some(contention),
                tasks,
            };
            match self.client().heartbeat(req).await {
                Ok(_) => {
                    if !self.unsent.lock().unwrap().is_empty() {
                        self.flush().await;
                    }
                }
                Err(s) => {
                    tracing::warn!(target: "berth::agent", "heartbeat: {:?}: {}", s.code(), s.message());
                    if s.code() != tonic::Code::NotFound {
                        // The host is gone or not leading: the next one.
                        self.connect().await;
                    }
                    // A new or restarted host does not know this session.
                    match self.register().await {
                        Ok(new) => {
                            session.store(new, std::sync::atomic::Ordering::SeqCst);
                            self.flush().await;
                        }
                        Err(e) => tracing::warn!(target: "berth::agent", "{e:#}"),
                    }
                }
            }
        }
        commands.abort();
        // Children leave with the agent: stop them. An asleep one is killed
        // where it stands (its GPUs may be lent; a frozen task would never
        // act on SIGTERM and outlive the agent).
        for (&id, c) in self.children.lock().unwrap().iter() {
            if c.sleeping {
                let _ = signal_group(c.pid, libc::SIGKILL);
                self.isolation.group(id).kill_all();
            } else {
                let _ = signal_group(c.pid, libc::SIGTERM);
            }
        }
        Ok(())
    }

    /// The node's pressure and each running task's use (from its cgroup),
    /// with CPU rates since the previous sample.
    fn sample_usage(&self) -> (pb::NodeContention, Vec<pb::TaskUsage>) {
        let pressure = |r: &str| isolation::pressure(r).map(|p| pb::Pressure { some_avg10: p.some_avg10, some_avg60: p.some_avg60, full_avg10: p.full_avg10, some_total_us: p.some_total_us });
        let mut contention = pb::NodeContention { cpu: pressure("cpu"), memory: pressure("memory"), io: pressure("io"), ..Default::default() };
        let children: Vec<(u64, bool)> = self.children.lock().unwrap().iter().map(|(&id, c)| (id, c.gpus.is_empty())).collect();
        let mut tasks = Vec::with_capacity(children.len());
        if self.isolation.has_cgroups() {
            let now = std::time::Instant::now();
            let mut seen = self.cpu_seen.lock().unwrap();
            for (id, cpu_only) in children {
                let usage = self.isolation.group(id).usage();
                let milli = match seen.insert(id, (now, usage.cpu_us)) {
                    Some((at, before)) if now > at => {
                        let secs = now.duration_since(at).as_secs_f64();
                        (usage.cpu_us.saturating_sub(before) as f64 / 1000.0 / secs).round().min(f64::from(u32::MAX)) as u32
                    }
                    _ => 0,
                };
                contention.tasks_cpu_milli = contention.tasks_cpu_milli.saturating_add(milli);
                if cpu_only {
                    contention.cpu_only_cpu_milli = contention.cpu_only_cpu_milli.saturating_add(milli);
                }
                tasks.push(task_usage(id, &usage, milli));
            }
        }
        (contention, tasks)
    }

    async fn command_loop(self: Arc<Self>, session: Arc<std::sync::atomic::AtomicU64>) {
        loop {
            let req = pb::CommandsRequest { node: self.node.clone(), session: session.load(std::sync::atomic::Ordering::SeqCst) };
            let mut client = self.client();
            match client.commands(req).await {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(cmd)) => self.clone().handle(cmd).await,
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

    /// The socket pool executor `id` connects to (the agent relays it).
    fn executor_socket(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("exec-{id}.sock"))
    }

    /// Where pool executor `id` logs its decisions. The newest
    /// [`EXECUTOR_LOGS_KEPT`] executors' logs stay (an executor started
    /// again is a new allocation, so a crash-looping one cannot fill the
    /// disk); older ones are removed as a new one starts.
    fn executor_decision_log(&self, id: u64) -> PathBuf {
        let mut logs: Vec<(u64, PathBuf)> = std::fs::read_dir(&self.state_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let alloc: u64 = name.strip_prefix("exec-")?.split('.').next()?.parse().ok()?;
                name.contains(".decisions.jsonl").then_some((alloc, e.path()))
            })
            .collect();
        let mut allocs: Vec<u64> = logs.iter().map(|(a, _)| *a).collect();
        allocs.sort_unstable();
        allocs.dedup();
        if allocs.len() >= EXECUTOR_LOGS_KEPT {
            let cut = allocs[allocs.len() + 1 - EXECUTOR_LOGS_KEPT];
            logs.retain(|(a, _)| *a < cut);
            for (_, path) in logs {
                let _ = std::fs::remove_file(path);
            }
        }
        self.state_dir.join(format!("exec-{id}.decisions.jsonl"))
    }

    /// Relays pool executor `id`'s lines to the host and back, until
    /// either side ends; then closes the socket, which ends the executor
    /// (the host starts another: an executor never runs unrelayed).
    async fn relay_executor(self: Arc<Self>, id: u64, listener: tokio::net::UnixListener, path: PathBuf) {
        use tokio::io::AsyncWriteExt;
        let accepted = tokio::time::timeout(Duration::from_secs(60), listener.accept()).await;
        drop(listener);
        let _ = std::fs::remove_file(&path);
        let stream = match accepted {
            Ok(Ok((s, _))) => s,
            Ok(Err(e)) => return tracing::warn!(target: "berth::agent", allocation = id, "executor socket: {e}"),
            Err(_) => return tracing::warn!(target: "berth::agent", allocation = id, "the executor never connected to its socket"),
        };
        let (rd, mut wr) = stream.into_split();
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::ExecutorFrame>(1024);
        let _ = tx.send(pb::ExecutorFrame { allocation_id: id, node: self.node.clone(), line: Vec::new() }).await;
        let up = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(rd);
            let mut buf = Vec::new();
            while let Some(read) = crate::executor::protocol::next_line(&mut lines, &mut buf).await {
                let line = match read {
                    Ok(()) => std::mem::take(&mut buf),
                    // Said to the host as the executor's error, never relayed whole.
                    Err(why) => serde_json::to_vec(&crate::executor::protocol::Up::Error { what: format!("relay: {why}") }).expect("serializes"),
                };
                if tx.send(pb::ExecutorFrame { line, ..Default::default() }).await.is_err() {
                    return;
                }
            }
        });
        let mut client = self.client();
        match client.executor(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
            Ok(resp) => {
                let mut down = resp.into_inner();
                loop {
                    match down.message().await {
                        Ok(Some(f)) => {
                            if wr.write_all(&f.line).await.is_err() || wr.write_all(b"\n").await.is_err() {
                                break;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(target: "berth::agent", allocation = id, "executor relay: {}", e.message());
                            break;
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(target: "berth::agent", allocation = id, "executor relay refused: {}", e.message()),
        }
        up.abort();
        let _ = wr.shutdown().await;
        tracing::info!(target: "berth::agent", allocation = id, "executor relay ended");
    }

    fn checkpoint_marker(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("alloc-{id}.checkpointed"))
    }

    /// Relays a task's checkpoint reports while it runs (polled: a report
    /// reaches the host within a poll).
    /// The file holding a task's count of work done (`berth progress`).
    /// Kept until the task's exit report is acknowledged (the report
    /// carries the last count).
    fn progress_marker(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("alloc-{id}.progress"))
    }

    /// The file a task touches (through `berth ready`) to report that it
    /// serves.
    fn ready_marker(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("alloc-{id}.ready"))
    }

    /// The file a task on synthetic GPUs declares its GPU memory in.
    fn gpu_memory_marker(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("alloc-{id}.gpu-memory"))
    }

    /// GPU memory still used on each of task `id`'s GPUs: NVML's count, or
    /// on synthetic GPUs what the task declared ($BERTH_GPU_MEMORY; none
    /// declared: none held).
    fn gpu_memory_held(&self, id: u64) -> Vec<u64> {
        let Some(gpus) = self.children.lock().unwrap().get(&id).map(|c| c.gpus.clone()) else { return Vec::new() };
        if self.args.synthetic_gpus.is_some() {
            let declared = read_count(&self.gpu_memory_marker(id));
            return vec![declared; gpus.len()];
        }
        let sample = self.src.lock().unwrap().sample(&[]);
        gpus.iter().map(|g| sample.iter().find(|s| s.index == *g).map_or(0, |s| s.memory_used_mib)).collect()
    }

    /// The file the agent writes at a checkpoint notice (the task polls it,
    /// or traps --notice-signal).
    fn notice_marker(&self, id: u64) -> PathBuf {
        self.state_dir.join(format!("alloc-{id}.notice"))
    }

    /// A checkpoint notice without a hook: the notice file (its time, in
    /// Unix milliseconds), then the signal if one was asked for.
    fn notify_checkpoint(&self, id: u64, pid: u32) -> std::io::Result<()> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
        crate::util::write_atomic(&self.notice_marker(id), format!("checkpoint {now}\n").as_bytes())?;
        match self.args.notice_signal {
            Some(NoticeSignal(sig)) => signal_group(pid, sig),
            None => Ok(()),
        }
    }

    /// Relays a task's checkpoint and readiness reports while it runs
    /// (polled: a report reaches the host within a poll). Readiness is
    /// reported once.
    async fn watch_checkpoints(self: Arc<Self>, id: u64, base: pb::AllocationReport) {
        let (marker, ready) = (self.checkpoint_marker(id), self.ready_marker(id));
        let _ = std::fs::remove_file(&marker);
        let _ = std::fs::remove_file(&ready);
        let _ = std::fs::remove_file(self.notice_marker(id));
        let mut seen = None;
        let mut told_ready = false;
        let progress = self.progress_marker(id);
        let (mut relayed, mut relayed_at) = (0u64, std::time::Instant::now());
        let every = Duration::from_millis(self.args.progress_every_ms);
        while self.children.lock().unwrap().contains_key(&id) {
            tokio::time::sleep(CHECKPOINT_POLL).await;
            let modified = std::fs::metadata(&marker).and_then(|m| m.modified()).ok();
            // Every report carries the count; a checkpoint report also what
            // the checkpoint saved (written by `berth checkpointed`).
            let units = read_count(&progress);
            if modified.is_some() && modified != seen {
                seen = modified;
                let saved = checkpoint_units(&marker);
                self.report(pb::AllocationReport { state: "checkpointed".into(), work_units: units.max(saved), work_checkpointed: saved, ..base.clone() }).await;
                (relayed, relayed_at) = (units, std::time::Instant::now());
            } else if units > relayed && relayed_at.elapsed() >= every {
                // At most one progress report per --progress-every-ms: each
                // is a store write on the host.
                self.report(pb::AllocationReport { state: "progress".into(), work_units: units, ..base.clone() }).await;
                (relayed, relayed_at) = (units, std::time::Instant::now());
            }
            if !told_ready && ready.exists() {
                told_ready = true;
                self.report(pb::AllocationReport { state: "ready".into(), ..base.clone() }).await;
            }
        }
        let _ = std::fs::remove_file(&marker);
        let _ = std::fs::remove_file(&ready);
        let _ = std::fs::remove_file(self.notice_marker(id));
    }

    async fn report(&self, r: pb::AllocationReport) {
        if let Err(s) = self.client().report_allocation(r).await {
            tracing::warn!(target: "berth::agent", "report: {:?}: {}", s.code(), s.message());
        }
    }

    async fn handle(self: Arc<Self>, cmd: pb::AgentCommand) {
        let id = cmd.allocation_id;
        let base = pb::AllocationReport { node: self.node.clone(), allocation_id: id, ..Default::default() };
        match cmd.action.as_str() {
            "start" => {
                let known: Vec<String> = self.src.lock().unwrap().gpus().iter().map(|g| g.uuid.clone()).collect();
                let gpus: Vec<u32> = cmd.gpu_uuids.iter().filter_map(|u| known.iter().position(|k| k == u).map(|i| i as u32)).collect();
                if gpus.len() != cmd.gpu_uuids.len() || (cmd.argv.is_empty() && !cmd.executor) {
                    let detail = format!("refused: argv {:?}, GPUs {:?} (this node has {known:?})", cmd.argv, cmd.gpu_uuids);
                    self.report(pb::AllocationReport { state: "failed".into(), detail, ..base }).await;
                    return;
                }
                let visible = cmd.gpu_uuids.join(",");
                if self.children.lock().unwrap().contains_key(&id) {
                    tracing::warn!(target: "berth::agent", allocation = id, "start of a task already running here: ignored");
                    return;
                }
                // Under a supervisor (this binary) that records how it ends,
                // so an agent restarted after a crash can still tell.
                let (record, status) = self.record_path(id);
                let _ = std::fs::remove_file(&status);
                let _ = std::fs::remove_file(self.progress_marker(id));
                let exe = match std::env::current_exe() {
                    Ok(e) => e,
                    Err(e) => {
                        self.report(pb::AllocationReport { state: "failed".into(), detail: format!("locating the berth binary: {e}"), ..base }).await;
                        return;
                    }
                };
                // Its own cgroup with what it asked for, or no start: a task
                // must not run past what it was given.
                let group = match self.isolation.create(id, cmd.cpu_milli, cmd.memory_mib) {
                    Ok(g) => g,
                    Err(e) => {
                        self.isolation.remove(id);
                        self.report(pb::AllocationReport { state: "failed".into(), detail: format!("confining the task: {e}"), ..base }).await;
                        return;
                    }
                };
                let mut task_env = allowed_env(&self.args.task_env);
                with_own_dir_on_path(&mut task_env, &exe);
                // A pool executor is this binary's `executor`, on a socket
                // the agent listens on and relays to the host: it holds no
                // credential and never dials the host itself.
                let mut argv = cmd.argv.clone();
                let mut relay = None;
                if cmd.executor {
                    argv = vec![exe.display().to_string(), "executor".into()];
                    let path = self.executor_socket(id);
                    let _ = std::fs::remove_file(&path);
                    match tokio::net::UnixListener::bind(&path) {
                        Ok(l) => {
                            task_env.push((crate::executor::SOCKET_ENV.into(), path.clone().into_os_string()));
                            task_env.push((crate::executor::DECISION_LOG_ENV.into(), self.executor_decision_log(id).into_os_string()));
                            relay = Some((l, path));
                        }
                        Err(e) => {
                            self.isolation.remove(id);
                            self.report(pb::AllocationReport { state: "failed".into(), detail: format!("listening on {}: {e}", path.display()), ..base }).await;
                            return;
                        }
                    }
                }
                let mut c = Command::new(exe);
                c.arg("agent").arg("--supervise").arg(&status);
                for procs in group.procs_files() {
                    c.arg("--cgroup-procs").arg(procs);
                }
                if let Some(pin) = self.isolation.affinity() {
                    c.arg("--pin").arg(pin.to_string());
                }
                c.arg("--")
                    .args(&argv)
                    // Built, never inherited: the agent's own environment
                    // (its credentials, the operator's shell) is not the
                    // tenant's. The allowlist, then the job's env, then the
                    // task variables, which the job cannot override.
                    .env_clear()
                    .envs(task_env)
                    .envs(&cmd.env)
                    .env("CUDA_VISIBLE_DEVICES", &visible)
                    .env("NVIDIA_VISIBLE_DEVICES", &visible)
                    .env("BERTH_ALLOCATION", id.to_string())
                    .env("BERTH_NODE", &self.node)
                    .env(CHECKPOINT_ENV, self.checkpoint_marker(id))
                    .env(READY_ENV, self.ready_marker(id))
                    .env(NOTICE_ENV, self.notice_marker(id))
                    .env(PROGRESS_ENV, self.progress_marker(id))
                    .env(GPU_MEMORY_ENV, self.gpu_memory_marker(id))
                    .stdin(std::process::Stdio::null())
                    .process_group(0)
                    .kill_on_drop(false);
                let mut child = match c.spawn() {
                    Ok(ch) => ch,
                    Err(e) => {
                        self.report(pb::AllocationReport { state: "failed".into(), detail: format!("spawn {:?}: {e}", argv[0]), ..base }).await;
                        return;
                    }
                };
                let pid = child.id().unwrap_or(0);
                let rec = Record { alloc_id: id, pid, gpus: gpus.clone(), host: self.host.lock().unwrap().clone() };
                if let Err(e) = crate::util::write_atomic(&record, &serde_json::to_vec(&rec).expect("serializes")) {
                    tracing::warn!(target: "berth::agent", allocation = id, "{}: {e}; a restarted agent will not adopt this task", record.display());
                }
                self.children.lock().unwrap().insert(id, Child { pid, gpus, sleeping: false, stop: None });
                tracing::info!(target: "berth::agent", allocation = id, pid, gpus = %visible, "started");
                self.report(pb::AllocationReport { state: "running".into(), pid, ..base.clone() }).await;
                tokio::spawn(self.clone().watch_checkpoints(id, base.clone()));
                if let Some((listener, path)) = relay {
                    tokio::spawn(self.clone().relay_executor(id, listener, path));
                }
                let agent = self.clone();
                tokio::spawn(async move {
                    let status = child.wait().await;
                    let r = agent.with_stop(id, agent.ended_report(pb::AllocationReport { pid, ..base }, Some(status)));
                    tracing::info!(target: "berth::agent", allocation = id, "{}", r.detail);
                    agent.report_end(id, r).await;
                });
            }
            action @ ("stop" | "sleep" | "wake" | "checkpoint") => {
                let Some((pid, frozen)) = self.children.lock().unwrap().get(&id).map(|c| (c.pid, c.sleeping && self.args.sleep_hook.is_none())) else {
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
                    // The cgroup freezer where the task has one (every
                    // process of the task, those that left its process
                    // group too), else SIGSTOP and SIGCONT to its group.
                    let group = self.isolation.group(id);
                    let freezer = group.has_freezer();
                    match action {
                        "sleep" if freezer => match group.freeze(true) {
                            // Asleep once every task is: reported only then.
                            Ok(()) => {
                                let mut waited = Duration::ZERO;
                                while !group.frozen_through() && waited < Duration::from_secs(2) {
                                    tokio::time::sleep(Duration::from_millis(5)).await;
                                    waited += Duration::from_millis(5);
                                }
                                if !group.frozen_through() {
                                    tracing::warn!(target: "berth::agent", allocation = id, "still freezing after 2 s");
                                }
                                Ok(())
                            }
                            Err(e) => Err(std::io::Error::other(e)),
                        },
                        "wake" if freezer => group.freeze(false).map_err(std::io::Error::other),
                        "sleep" => signal_group(pid, libc::SIGSTOP),
                        "wake" => signal_group(pid, libc::SIGCONT),
                        "checkpoint" => self.notify_checkpoint(id, pid),
                        // Frozen by the default sleep (SIGSTOP): its GPUs are
                        // lent, so it is killed where it stands rather than
                        // continued onto them to act on SIGTERM.
                        _ if frozen => {
                            self.stop_sent(id, true);
                            let r = signal_group(pid, libc::SIGKILL);
                            // Killed, then thawed: the kill lands before
                            // any of its code runs again.
                            group.kill_all();
                            r
                        }
                        _ => {
                            self.stop_sent(id, false);
                            let r = signal_group(pid, libc::SIGTERM);
                            // A stopped child cannot act on SIGTERM until continued.
                            let _ = signal_group(pid, libc::SIGCONT);
                            let grace = Duration::from_secs(self.args.stop_grace_s);
                            let agent = self.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(grace).await;
                                if let Some(c) = agent.children.lock().unwrap().get_mut(&id).filter(|c| c.pid == pid) {
                                    // Killed only if something was left to
                                    // kill (an exit just before the grace ran
                                    // out leaves no process group).
                                    if signal_group(pid, libc::SIGKILL).is_ok()
                                        && let Some(stop) = &mut c.stop
                                    {
                                        stop.killed = true;
                                    }
                                    // And whatever of it left its process group.
                                    agent.isolation.group(id).kill_all();
                                }
                            });
                            r
                        }
                    }
                };
                if result.is_ok()
                    && matches!(action, "sleep" | "wake")
                    && let Some(c) = self.children.lock().unwrap().get_mut(&id)
                {
                    c.sleeping = action == "sleep";
                }
                match (action, result) {
                    ("sleep", Ok(())) => {
                        let gpu_memory_used_mib = self.gpu_memory_held(id);
                        self.report(pb::AllocationReport { state: "sleeping".into(), pid, gpu_memory_used_mib, ..base }).await
                    }
                    ("wake", Ok(())) => self.report(pb::AllocationReport { state: "running".into(), pid, ..base }).await,
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
        /// Only this partition (default: all).
        #[arg(long, default_value = "")]
        partition: String,
        /// Print as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: HubConn,
    },
    /// Start a command on GPUs of an agent node: `berth alloc start --node n1 --gpus 0,1 -- cmd args`.
    Start {
        /// The agent node to run on.
        #[arg(long)]
        node: String,
        /// GPU indexes on that node, comma-separated (e.g. 0,1).
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<u32>,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
        #[command(flatten)]
        conn: HubConn,
    },
    /// stop, sleep, wake or checkpoint an allocation.
    Control {
        /// What to do: stop (SIGTERM, then SIGKILL after the grace), sleep,
        /// wake or checkpoint (the agent's hooks, or signals by default).
        #[arg(value_parser = ["stop", "sleep", "wake", "checkpoint"])]
        action: String,
        /// The allocation id (see `berth alloc list`).
        allocation: u64,
        #[command(flatten)]
        conn: HubConn,
    },
}

#[derive(clap::Args, Debug, Clone)]
pub struct HubConn {
    /// Server URL (https:// for TLS).
    #[arg(long, env = "BERTH_SERVER", default_value = "http://127.0.0.1:7450")]
    server: String,
    /// Bearer token (an identity with the operator role to act).
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) that signed the server's certificate.
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
                                "heartbeats": a.heartbeats, "isolation": a.isolation, "cpus": a.cpus, "contention": a.contention,
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
                            "state": a.state, "pid": a.pid, "exit_code": a.exit_code, "signal": a.signal, "detail": a.detail,
                            "usage": a.usage, "limit": a.limit}))
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&serde_json::json!({"agents": agents, "allocations": allocs}))?);
                } else {
                    for a in &r.agents {
                        let bad: Vec<String> = a.gpus.iter().filter(|g| !g.healthy).map(|g| format!("GPU {} ({})", g.info.as_ref().map_or(0, |i| i.index), g.unhealthy_reason)).collect();
                        let model = a.gpus.first().and_then(|g| g.info.as_ref()).map_or("-".into(), |i| i.model.clone());
                        println!("{:<16} {:<5} {:<11} {}x{} {:<9} {} heartbeats{}", a.node, a.partition, a.state, a.gpus.len(), model, a.source, a.heartbeats,
                            if bad.is_empty() { String::new() } else { format!(", unhealthy: {}", bad.join(", ")) });
                        if let Some(c) = &a.contention {
                            let some = |p: &Option<pb::Pressure>| p.as_ref().map_or("-".into(), |p| format!("{:.1}%", p.some_avg10));
                            println!(
                                "  CPUs {} ({}); pressure (some, 10 s): CPU {}, memory {}, IO {}; tasks use {:.2} cores, CPU-only ones {:.2}",
                                if a.cpus.is_empty() { "-" } else { &a.cpus },
                                a.isolation,
                                some(&c.cpu),
                                some(&c.memory),
                                some(&c.io),
                                f64::from(c.tasks_cpu_milli) / 1000.0,
                                f64::from(c.cpu_only_cpu_milli) / 1000.0
                            );
                        }
                    }
                    for a in &r.allocations {
                        let usage = a.usage.as_ref().map_or(String::new(), |u| {
                            format!(", CPU {:.2} cores, throttled {:.1} s, memory {} MiB (peak {})", f64::from(u.cpu_milli) / 1000.0, u.throttled_ms as f64 / 1000.0, u.memory_mib, u.memory_peak_mib)
                        });
                        let oom = if a.limit == "oom" { ", killed over its memory limit" } else { "" };
                        println!("allocation {} on {} GPUs {:?}: {} (exit {}, signal {}{usage}{oom}) {:?}", a.id, a.node, a.gpus, a.state, a.exit_code, a.signal, a.argv);
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
