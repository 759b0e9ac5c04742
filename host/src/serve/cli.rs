//! The command line of the live host: `berth serve`, and the client
//! commands that talk to it (`berth submit`, `jobs`, `nodes`, `partitions`,
//! `explain`, `accounting`, `decisions`, `cancel`, `migrate`, and `berth policy
//! upload|activate|rollback|history|shadow|report`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use super::auth::Access;
use super::breaker::BreakerConfig;
use crate::client::{connect, status, Client};
use crate::proto as pb;
use super::server::{Scheduling, ServeConfig, StoreChoice, TlsFiles, DEFAULT_FLEET};
use crate::store::etcd::EtcdConfig;
use crate::asi::fleet::FleetConfig;
use crate::wasm::Limits;

/// The access file of `berth serve --trial` (the repository's example).
pub const TRIAL_ACCESS: &str = include_str!("../../../examples/serve/access.toml");

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address of the gRPC API (Berth and the agents' AgentHub); plaintext
    /// only on loopback, TLS (--tls-cert/--tls-key) elsewhere.
    #[arg(long, default_value = "127.0.0.1:7450")]
    listen: SocketAddr,
    /// Prometheus text endpoint (`/metrics`) and the web console
    /// (`/console`, answered on loopback only); `off` to disable both.
    #[arg(long, default_value = "127.0.0.1:7451")]
    metrics_listen: String,
    /// The model pools' OpenAI-compatible endpoint (`/v1/completions`,
    /// `/v1/chat/completions`, `/v1/models`; tenants' bearer tokens), for
    /// the fleet config's `[[pool]]` partitions; loopback only (plaintext);
    /// `off` to disable.
    #[arg(long, default_value = "off")]
    inference_listen: String,
    /// Registry, artifacts and decision log live here; survives restarts.
    #[arg(long, default_value = "berth-state")]
    state_dir: PathBuf,
    /// Fleet config (TOML as for `replay --fleet`), `default` (3 partitions
    /// of 32 eight-GPU nodes) or `asi`.
    #[arg(long, default_value = "default")]
    fleet: String,
    /// Scale every node count of the fleet config (e.g. 0.05), in (0, 10].
    #[arg(long, default_value_t = 1.0)]
    fleet_scale: f64,
    /// Access file (TOML): identities, tokens or client-certificate digests,
    /// roles per partition, an optional component allow-list. Required (or
    /// --trial): the API is never open.
    #[arg(long, required_unless_present = "trial", conflicts_with = "trial")]
    access: Option<PathBuf>,
    /// A local trial from any folder: the example access file built into
    /// the binary (examples/serve/access.toml: public tokens such as
    /// ops-example-token, and agent-example-token for `berth agent
    /// --trial`) instead of --access. Loopback addresses only.
    #[arg(long)]
    trial: bool,
    /// The server's TLS certificate chain (PEM); with --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The server's TLS private key (PEM); with --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA of client certificates (mTLS, optional for clients).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// The policy every partition starts with when its registry is empty.
    #[arg(long, default_value = "binpack")]
    default_policy: String,
    /// Per-call deadline of a policy.
    #[arg(long, default_value_t = 500)]
    deadline_ms: u64,
    /// Memory cap of one policy instance, in MiB: the sum of all its linear
    /// memories and tables.
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    /// Consecutive failed calls that trip a version's circuit breaker.
    #[arg(long, default_value_t = 3)]
    breaker_failures: u32,
    /// The breaker's window: a version also trips when at least
    /// --breaker-rate of its last this-many calls failed.
    #[arg(long, default_value_t = 20)]
    breaker_window: u32,
    /// Failure rate over the window that trips a version, in (0, 1].
    #[arg(long, default_value_t = 0.5)]
    breaker_rate: f64,
    /// Calls a version must have made before the rate rule applies (at most
    /// --breaker-window).
    #[arg(long, default_value_t = 10)]
    breaker_min_calls: u32,
    /// Latency budget of a policy call in ms: a slower answer counts as a
    /// failure (a slow policy stalls its partition); 0: none.
    #[arg(long, default_value_t = 250)]
    breaker_slow_ms: u64,
    /// Backoff after a trip before the version may run again (doubles per trip).
    #[arg(long, default_value_t = 60)]
    breaker_backoff_s: u64,
    /// Largest policy component an upload may carry, in bytes (Python
    /// components carry their interpreter: about 18 MB).
    #[arg(long, default_value_t = 32 << 20)]
    max_upload_bytes: usize,
    /// A node agent silent for this long is marked unreachable.
    #[arg(long, default_value_t = 10_000)]
    agent_timeout_ms: u64,
    /// An allocated agent GPU is productive when its measured SM
    /// utilisation is at least this percent.
    #[arg(long, default_value_t = 10)]
    productive_sm_pct: u32,
    /// How long an unreachable node's jobs wait for it (after
    /// --agent-timeout-ms) before they are requeued elsewhere; `off`: forever.
    #[arg(long, default_value = "60000")]
    reschedule_after_ms: String,
    /// Keep state in etcd (client URLs, comma-separated) instead of the
    /// embedded store, with leader election: a second host on the same etcd
    /// waits as a standby and takes over when the leader's lease ends.
    #[arg(long)]
    etcd: Option<String>,
    /// Key prefix of this host's state in etcd (hosts sharing a prefix
    /// share the state and the leader election).
    #[arg(long, default_value = "/berth/", requires = "etcd")]
    etcd_prefix: String,
    /// The leader lease's TTL: a dead leader is replaced after about this long.
    #[arg(long, default_value_t = 5, requires = "etcd")]
    lease_ttl_s: u64,
    /// Jobs at or above this priority may preempt running jobs below it
    /// (and below their own priority); below it jobs are low-priority fill.
    #[arg(long, default_value_t = 1)]
    high_priority: u32,
    /// Priority contract of preempted jobs: seconds between the checkpoint
    /// notice and the stop (the agent kills what is left after its
    /// --stop-grace-s).
    #[arg(long, default_value_t = 30)]
    notice_s: u64,
    /// Priority contract: a job is preempted at most this often in any 24 h.
    #[arg(long, default_value_t = 3)]
    max_interruptions_per_day: u32,
    /// Priority contract: the longest a preempted job stays out of service
    /// (0: no bound). With a bound, preempted work waits ahead of new work
    /// and runs again even at its daily cap; running later is a broken
    /// promise, credited (`berth credits`).
    #[arg(long, default_value_t = 0)]
    max_outage_s: u64,
    /// Live compaction settings: a JSON object of `CompactionConfig` fields
    /// (e.g. '{"period_s": 600, "destination_deadline_s": 120}'); unknown
    /// fields are errors. Compaction runs in partitions with an active
    /// compact policy (`berth policy upload --hook compact`).
    #[arg(long)]
    compaction: Option<String>,
    /// Run compaction only on demand (`berth compact --live`), not every
    /// period_s nor when a whole-node job is blocked.
    #[arg(long)]
    no_auto_compaction: bool,
    /// Sleep-state harvesting on a schedule, "SLEEP_H-WAKE_H[:SHARE]" in
    /// hours of the UTC day (e.g. 1-7:0.5): at SLEEP_H that share of the
    /// running `--sleepable` jobs sleeps and lends its GPUs to low-priority
    /// work; at WAKE_H every sleeping `--sleepable` job wakes.
    #[arg(long)]
    harvest: Option<String>,
    /// A sleeping job's GPUs are lent only when none of its tasks still
    /// uses more GPU memory than this on one of them (MiB), as its agent
    /// measured once the task was asleep (NVML; a synthetic task declares
    /// its own in $BERTH_GPU_MEMORY). A sleep that keeps the weights and
    /// cache resident (the default freeze, on real GPUs) lends nothing.
    #[arg(long, default_value_t = crate::serve::state::DEFAULT_LEND_MAX_MEMORY_MIB)]
    lend_max_memory_mib: u64,
    /// Ended jobs (finished, failed, cancelled) stay listed, explainable and
    /// stored this many hours after they end; then they leave memory and
    /// the store (with their idempotency keys).
    #[arg(long, default_value_t = 168.0)]
    retain_ended_h: f64,
    /// At most this many ended jobs are kept per partition (the oldest
    /// leave first, whatever --retain-ended-h says).
    #[arg(long, default_value_t = 50_000)]
    retain_ended_jobs: usize,
    /// The decision log (decisions.jsonl in --state-dir) is rotated past
    /// this many MiB; two rotated files are kept, older ones deleted.
    #[arg(long, default_value_t = 64)]
    decision_log_mib: u64,
    /// Each partition's capture of what its engine was given (capture/ in
    /// --state-dir, for `berth capture export` and `berth replay --events`)
    /// keeps at most this many MiB, the oldest files deleted; 0 turns
    /// capture off.
    #[arg(long, default_value_t = 256)]
    capture_mib: u64,
}

impl ServeArgs {
    pub fn config(&self) -> anyhow::Result<ServeConfig> {
        let breaker = BreakerConfig {
            failures: self.breaker_failures,
            window: self.breaker_window,
            rate: self.breaker_rate,
            min_calls: self.breaker_min_calls,
            slow: (self.breaker_slow_ms > 0).then(|| Duration::from_millis(self.breaker_slow_ms)),
            backoff: Duration::from_secs(self.breaker_backoff_s),
        };
        breaker.check().map_err(|e| anyhow::anyhow!("--breaker-*: {e}"))?;
        anyhow::ensure!(self.deadline_ms > 0, "--deadline-ms must be positive");
        let fleet = match self.fleet.as_str() {
            "default" => FleetConfig::parse(DEFAULT_FLEET, "(embedded default)")?,
            spec => FleetConfig::load(spec)?,
        };
        anyhow::ensure!(self.fleet_scale > 0.0 && self.fleet_scale <= 10.0, "--fleet-scale must be in (0, 10]");
        let policy = crate::catalog::resolve(&self.default_policy)?;
        Ok(ServeConfig {
            listen: self.listen,
            metrics_listen: match self.metrics_listen.as_str() {
                "off" => None,
                a => Some(a.parse().with_context(|| format!("--metrics-listen {a:?}"))?),
            },
            inference_listen: match self.inference_listen.as_str() {
                "off" => None,
                a => Some(a.parse().with_context(|| format!("--inference-listen {a:?}"))?),
            },
            state_dir: self.state_dir.clone(),
            fleet: fleet.scaled(self.fleet_scale),
            access: match &self.access {
                Some(path) => Access::load(path)?,
                None => {
                    // Public tokens: never beyond this machine.
                    let metrics_loopback = self.metrics_listen == "off" || self.metrics_listen.parse::<SocketAddr>().is_ok_and(|a| a.ip().is_loopback());
                    anyhow::ensure!(self.listen.ip().is_loopback() && metrics_loopback, "--trial uses public example tokens: --listen and --metrics-listen must be loopback addresses");
                    Access::parse(TRIAL_ACCESS).context("the built-in trial access file")?
                }
            },
            tls: self.tls_cert.clone().zip(self.tls_key.clone()).map(|(cert, key)| TlsFiles { cert, key, client_ca: self.client_ca.clone() }),
            default_policy: std::fs::read(&policy).with_context(|| format!("reading {}", policy.display()))?,
            limits: Limits { deadline: Duration::from_millis(self.deadline_ms), memory_bytes: self.memory_mib << 20, ..Limits::default() },
            breaker,
            max_upload_bytes: self.max_upload_bytes,
            scheduling: Scheduling {
                high_priority: self.high_priority,
                contract: berth_core::job::PriorityContract {
                    notice_s: self.notice_s,
                    max_interruptions_per_day: self.max_interruptions_per_day,
                    max_outage_s: self.max_outage_s,
                    ..Default::default()
                },
                compaction: {
                    let c: berth_core::compaction::CompactionConfig = match &self.compaction {
                        Some(text) => serde_json::from_str(text).context("--compaction")?,
                        None => Default::default(),
                    };
                    c.check().map_err(anyhow::Error::msg).context("--compaction")?;
                    c
                },
                auto_compaction: !self.no_auto_compaction,
                harvest: self.harvest.as_deref().map(crate::asi::preempt::parse_harvest).transpose().context("--harvest")?,
                lend_max_memory_mib: self.lend_max_memory_mib,
                retention: {
                    anyhow::ensure!(self.retain_ended_h.is_finite() && self.retain_ended_h >= 0.0, "--retain-ended-h must be a number of hours, 0 or more");
                    anyhow::ensure!(self.decision_log_mib >= 1, "--decision-log-mib must be at least 1");
                    crate::serve::state::Retention {
                        ended_for: Duration::from_secs_f64(self.retain_ended_h.min(100.0 * 365.0 * 24.0) * 3600.0),
                        ended_max: self.retain_ended_jobs,
                        decision_log_bytes: self.decision_log_mib << 20,
                        capture_bytes: self.capture_mib.min(1 << 30) << 20,
                        ..Default::default()
                    }
                },
                ..Default::default()
            },
            store: match &self.etcd {
                None => StoreChoice::Embedded,
                Some(urls) => {
                    anyhow::ensure!(self.lease_ttl_s >= 1, "--lease-ttl-s must be at least 1");
                    anyhow::ensure!(self.etcd_prefix.ends_with('/'), "--etcd-prefix {:?} must end with '/'", self.etcd_prefix);
                    StoreChoice::Etcd(EtcdConfig {
                        endpoints: urls.split(',').map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect(),
                        prefix: self.etcd_prefix.clone(),
                        lease_ttl: Duration::from_secs(self.lease_ttl_s),
                        id: format!("{}:{}@{}", std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim(), std::process::id(), self.listen),
                    })
                }
            },
        })
    }
}

/// Runs the server until Ctrl-C or SIGTERM.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        anyhow::ensure!(args.productive_sm_pct <= 100, "--productive-sm-pct must be at most 100");
        let reschedule_after = match args.reschedule_after_ms.as_str() {
            "off" => None,
            ms => Some(Duration::from_millis(ms.parse().with_context(|| format!("--reschedule-after-ms {ms:?}: milliseconds or off"))?)),
        };
        let agents = crate::serve::hub::HubConfig {
            heartbeat_timeout: Duration::from_millis(args.agent_timeout_ms.max(1)),
            productive_sm_pct: args.productive_sm_pct,
            reschedule_after,
            host_identity: String::new(),
        };
        if let StoreChoice::Etcd(e) = &config.store {
            eprintln!("berth serve: campaigning for the leader lease on {} as {} (a standby serves nothing until it leads)", e.endpoints.join(","), e.id);
        }
        let handle = super::server::start_with_agents(config, agents).await?;
        let scheme = if args.tls_cert.is_some() { "https" } else { "http" };
        eprintln!(
            "berth serve: API on {scheme}://{}{}{}",
            handle.addr,
            handle.metrics_addr.map_or(String::new(), |m| format!(", metrics on http://{m}/metrics, console on http://{m}/console")),
            handle.inference_addr.map_or(String::new(), |a| format!(", completions on http://{a}/v1/completions"))
        );
        for p in &handle.live.partitions {
            let st = p.lock_state();
            let active = p.active().map_or("none".into(), |a| format!("{}@{} (version {})", a.meta.name, a.meta.semver, a.meta.version));
            eprintln!("  partition {}: {} nodes, policy {active}", p.name, st.fleet.nodes().len());
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("berth serve: stopping");
        handle.shutdown().await;
        anyhow::Ok(())
    })
}

/// `berth compact --live`: one step on a running host, its plan and what
/// started.
pub fn compact_live(partition: String, dry_run: bool, json: bool, conn: Conn) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let r = client(&conn).await?.compact_live(pb::CompactLiveRequest { partition: partition.clone(), dry_run }).await.map_err(status)?.into_inner();
        if json {
            let chains: Vec<serde_json::Value> = r
                .chains
                .iter()
                .map(|c| serde_json::json!({"chain": c.chain, "moves": c.moves, "nodes_freed": c.nodes_freed, "benefit_gpu_s": c.benefit_gpu_s, "cost_gpu_s": c.cost_gpu_s, "run": c.run, "skipped": c.skipped}))
                .collect();
            let moves: Vec<serde_json::Value> = r
                .moves
                .iter()
                .map(|m| serde_json::json!({"chain": m.chain, "job": m.job_id, "allocation": m.allocation_id, "from": m.from_node, "to": m.to_node, "gpus": m.to_gpus, "tier": m.tier, "state_bytes": m.state_bytes}))
                .collect();
            let out = serde_json::json!({"partition": partition, "policy": r.policy, "rejected": r.rejected, "dry_run": dry_run, "idle_nodes": r.idle_nodes, "partial_nodes": r.partial_nodes, "chains": chains, "moves": moves, "chain_ids": r.chain_ids});
            println!("{}", serde_json::to_string_pretty(&out)?);
            return Ok(());
        }
        println!("{partition}: {} idle and {} partly used GPU nodes; plan by {}", r.idle_nodes, r.partial_nodes, esc(&r.policy));
        if !r.rejected.is_empty() {
            println!("  plan not used: {}", esc(&r.rejected));
            return Ok(());
        }
        for c in &r.chains {
            let verdict = if c.run { "runs".to_string() } else { format!("skipped: {}", esc(&c.skipped)) };
            println!("  chain {}: {} move(s), frees {} node(s), benefit {:.0} / cost {:.0} GPU-s: {verdict}", c.chain, c.moves, c.nodes_freed, c.benefit_gpu_s, c.cost_gpu_s);
        }
        for m in &r.moves {
            println!("    job {} allocation {}: {} -> {} GPUs {:?} ({}, {:.1} GiB)", m.job_id, m.allocation_id, m.from_node, m.to_node, m.to_gpus, m.tier, m.state_bytes as f64 / f64::from(1u32 << 30));
        }
        if r.chains.is_empty() {
            println!("  nothing to do: the policy planned no chain");
        } else if dry_run {
            println!("  dry run: nothing moved");
        } else if r.chain_ids.is_empty() {
            println!("  no chain pays back: nothing moved");
        } else {
            println!("  started: ledger chain(s) {:?} (berth compactions)", r.chain_ids);
        }
        Ok(())
    })
}

fn chains_json(chains: &[pb::CompactionChain]) -> Vec<serde_json::Value> {
    chains
        .iter()
        .map(|c| {
            let moves: Vec<serde_json::Value> = c
                .moves
                .iter()
                .map(|m| serde_json::json!({"job": m.job_id, "from_allocation": m.from_allocation, "to_allocation": m.to_allocation, "from": m.from_node, "to": m.to_node, "gpus": m.to_gpus, "tier": m.tier, "state_bytes": m.state_bytes, "state": m.state, "overlap_ms": m.overlap_ms, "takeover_ms": m.warmup_ms, "cause": m.cause,
                    "rate_measure": m.rate_measure, "rate_before_milli": m.rate_before_milli, "rate_after_milli": m.rate_after_milli,
                    "neighbours_before_milli": m.neighbours_before_milli, "neighbours_after_milli": m.neighbours_after_milli}))
                .collect();
            serde_json::json!({
                "id": c.id, "partition": c.partition, "policy": c.policy, "state": c.state, "cause": c.cause,
                "started_unix_ms": c.started_unix_ms, "ended_unix_ms": c.ended_unix_ms,
                "nodes_freed": c.nodes_freed, "benefit_gpu_s": c.benefit_gpu_s, "cost_gpu_s": c.cost_gpu_s,
                "bytes": {"same_switch": c.bytes_same_switch, "same_aggregation": c.bytes_same_aggregation, "cross_aggregation": c.bytes_cross_aggregation},
                "idle_nodes": [c.idle_nodes_before, c.idle_nodes_after],
                "pending_startable": [c.pending_startable_before, c.pending_startable_after],
                "moves": moves,
            })
        })
        .collect()
}

/// How a client reaches the server.
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// Server URL (https:// for TLS).
    #[arg(long, env = "BERTH_SERVER", default_value = "http://127.0.0.1:7450")]
    server: String,
    /// Bearer token.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) that signed the server's certificate.
    #[arg(long, env = "BERTH_CA")]
    ca: Option<PathBuf>,
    /// Client certificate and key (PEM) for mTLS.
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Private key (PEM) of the client certificate (--cert).
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
}

/// `berth capture ...`.
#[derive(clap::Subcommand, Debug)]
pub enum CaptureCommand {
    /// Print a partition's captured engine inputs as JSON lines (the format
    /// `berth replay --events` reads), oldest first.
    Export {
        /// Partition to export.
        #[arg(long)]
        partition: String,
        /// Only inputs from this time: unix seconds, or a duration ago
        /// (`90m`, `2h`, `1d`). Exact re-decision needs a segment from its
        /// start; a window serves counterfactuals.
        #[arg(long)]
        since: Option<String>,
        /// Only inputs up to this time (same forms as --since).
        #[arg(long)]
        until: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Turn a trace (openb, or an ASI-like fleet and its jobs) into the
    /// capture format: the trace run under one policy with the engine
    /// capturing, as a live host would have recorded it (offline: no host).
    Convert(crate::replay::convert::ConvertArgs),
}

/// A time for `--since` / `--until`: unix seconds, or a duration before now.
fn parse_time(text: &str, flag: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    if let Ok(s) = text.parse::<u64>() {
        return Ok(s);
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len()));
    let scale = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => anyhow::bail!("{flag} {text:?}: unix seconds, or a duration ago such as 90m, 2h, 1d"),
    };
    let ago: f64 = number.parse().map_err(|_| anyhow::anyhow!("{flag} {text:?}: {number:?} is not a number"))?;
    anyhow::ensure!(ago.is_finite() && ago >= 0.0 && ago * scale < 1e10, "{flag} {text:?}: out of range");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    Ok(now.saturating_sub((ago * scale) as u64))
}

/// Client commands at the top level of `berth`.
#[derive(clap::Subcommand, Debug)]
pub enum ApiCommand {
    /// Submit a job to a running `berth serve`.
    Submit {
        /// Partition to submit to (e.g. p0).
        #[arg(long)]
        partition: String,
        /// Tasks of the job (more than one: a gang, started all or nothing).
        #[arg(long, default_value_t = 1)]
        tasks: u32,
        /// GPUs per task.
        #[arg(long, default_value_t = 1)]
        gpus: u32,
        /// Thousandths of each GPU (1000 = whole).
        #[arg(long, default_value_t = 1000)]
        gpu_milli: u32,
        /// CPU cores per task.
        #[arg(long, default_value_t = 4)]
        cores: u32,
        /// Host memory per task, GiB.
        #[arg(long, default_value_t = 16)]
        memory_gib: u64,
        /// Accepted GPU models (repeatable; none = any).
        #[arg(long = "model")]
        models: Vec<String>,
        /// Priority (higher is placed first; below the high-priority threshold
        /// the job is low priority and may be preempted).
        #[arg(long, default_value_t = 0)]
        priority: u32,
        /// Seconds the job runs once started (default 600); with a command,
        /// a time limit (default none: it runs until the processes exit).
        #[arg(long)]
        duration_s: Option<f64>,
        /// A name for the job, shown in listings.
        #[arg(long, default_value = "")]
        name: String,
        /// Environment for the command, NAME=VALUE (repeatable).
        #[arg(long = "env")]
        env: Vec<String>,
        /// Live compaction may move its tasks to other agent nodes
        /// (make-before-break) to free whole nodes.
        #[arg(long)]
        movable: bool,
        /// A migrated copy takes over only once it reports ready (`berth
        /// ready` inside the task), not as soon as its process runs.
        #[arg(long)]
        wait_ready: bool,
        /// The partition's harvest schedule (`berth serve --harvest`) may put
        /// it to sleep in the daily trough, lending its GPUs.
        #[arg(long)]
        sleepable: bool,
        /// What one unit of the work its tasks report (`berth progress`)
        /// is, e.g. steps, tokens, "requests within SLO" (default: units).
        #[arg(long, default_value = "")]
        work_unit: String,
        /// What kind of work it is, for placement and compaction policies
        /// that keep CPU-only work away from training (default: cpu-only
        /// without GPUs, training with them).
        #[arg(long, value_parser = ["training", "inference", "cpu-only"])]
        class: Option<String>,
        /// What the job is bought as: guaranteed (never preempted),
        /// preemptible (notice, a daily cap, a maximum outage) or
        /// opportunistic (stopped without notice, lost work not credited).
        /// Default: the partition's (the access file's default_tier).
        #[arg(long, value_parser = ["guaranteed", "preemptible", "opportunistic"])]
        tier: Option<String>,
        /// With --tier opportunistic: GPU-hours of run bought. Each run is
        /// charged its GPUs x the time it held them; once the budget is
        /// spent the job is stopped and ends (default: no bound).
        #[arg(long, value_name = "GPU_H")]
        budget_gpu_h: Option<f64>,
        /// Makes a retried submission safe: the host answers a second
        /// submission with the same key (yours, for a job it still keeps)
        /// with the first one's job instead of a new one. Default: a fresh
        /// random key, reused by this command's own retries.
        #[arg(long)]
        idempotency_key: Option<String>,
        #[command(flatten)]
        conn: Conn,
        /// After `--`: a command to run per task on agent nodes, with exactly
        /// the task's GPUs visible.
        #[arg(last = true)]
        argv: Vec<String>,
    },
    /// Move a job's running task to another agent node, make-before-break:
    /// the new copy (env BERTH_MIGRATED_FROM=<old allocation>) starts, then
    /// the old one stops.
    Migrate {
        /// The task's allocation id (see `berth jobs`).
        allocation: u64,
        /// Destination agent node (default: the one the partition's
        /// placement policy chooses).
        #[arg(long, default_value = "")]
        to: String,
        /// Send the old copy a checkpoint notice before its stop.
        #[arg(long)]
        checkpoint: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Put a running job to sleep (operator): once its tasks report asleep
    /// (the agents' sleep hook), its GPUs are lent to low-priority work.
    Sleep {
        /// The job id (see `berth jobs`).
        job: u64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Wake a sleeping job (operator): borrowers of its GPUs are evicted
    /// under their contracts, then its tasks are woken.
    Wake {
        /// The job id (see `berth jobs`).
        job: u64,
        #[command(flatten)]
        conn: Conn,
    },
    /// Cancel a job.
    Cancel {
        /// The job id (see `berth jobs`).
        job: u64,
        #[command(flatten)]
        conn: Conn,
    },
    /// List jobs (newest first).
    Jobs {
        /// Only this partition (default: every partition you may see).
        #[arg(long, default_value = "")]
        partition: String,
        /// Only jobs in this state (pending, evicting: preempted with its
        /// processes still stopping, running, finished, failed, cancelled;
        /// default: all).
        #[arg(long, default_value = "")]
        state: String,
        /// At most this many jobs.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Only jobs with ids below this one: the next page (the listing
        /// names the value to pass).
        #[arg(long, default_value_t = 0)]
        before: u64,
        #[command(flatten)]
        conn: Conn,
    },
    /// List nodes.
    Nodes {
        /// Only this partition (default: every partition you may see).
        #[arg(long, default_value = "")]
        partition: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// List partitions with their active policy and candidate.
    Partitions {
        #[command(flatten)]
        conn: Conn,
    },
    /// Set a partition's starvation guard (operator; kept across restarts):
    /// a job that has waited `--reserve-after-s` and still cannot start gets
    /// a reservation and nodes drained for it.
    Guard {
        /// Partition to change.
        #[arg(long)]
        partition: String,
        /// Turn the guard off (drops its reservation).
        #[arg(long, conflicts_with_all = ["reserve_after_s", "aging_per_hour", "window_s"])]
        off: bool,
        /// Seconds a job waits, unable to start, before it gets a reservation (0: never, aging only).
        #[arg(long, default_value_t = 0)]
        reserve_after_s: u64,
        /// Priority points a waiting job gains per hour.
        #[arg(long, default_value_t = 0.0)]
        aging_per_hour: f64,
        /// An admission window of this many seconds: while a job that
        /// cannot start waits, smaller work starts ahead of it only within
        /// --window-gpu-h per window (0: no window).
        #[arg(long, default_value_t = 0)]
        window_s: u64,
        /// GPU-hours of smaller work (GPUs x planned run) admitted ahead of
        /// a waiting job per window.
        #[arg(long, default_value_t = 0.0, requires = "window_s")]
        window_gpu_h: f64,
        #[command(flatten)]
        conn: Conn,
    },
    /// A partition's capture of what its engine was given (operator), for
    /// `berth replay --events`.
    Capture {
        #[command(subcommand)]
        what: CaptureCommand,
    },
    /// A pool partition live: its executors (node, models and weights,
    /// load, who chose their steps, their latest steps) and its requests
    /// (outcomes, TTFT and TBT against the SLO).
    Pool {
        /// The pool partition (e.g. p1).
        #[arg(long)]
        partition: String,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
        /// Also print each executor's latest steps.
        #[arg(long)]
        steps: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// The live compaction ledger: chains with their moves, newest first
    /// (`berth compact --live` runs a step).
    Compactions {
        /// Partition (empty: every partition you may view).
        #[arg(long, default_value = "")]
        partition: String,
        /// At most this many chains.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print the chains as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Why a job is pending.
    Explain {
        /// The job id (see `berth jobs`).
        job: u64,
        /// For a pending job, also the smallest change of each kind that
        /// would let it start now (work to preempt, tasks to move, nodes
        /// to repair) with its cost; nothing is done.
        #[arg(long)]
        what_if: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Availability quote: how many copies of a shape could start now, when
    /// the next could (as running work ends on plan), and whether one can
    /// start by a deadline.
    Quote {
        /// Partition to quote.
        #[arg(long)]
        partition: String,
        /// GPUs per task.
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// Tasks of one copy (a gang when > 1).
        #[arg(long, default_value_t = 1)]
        tasks: u32,
        /// Thousandths of each GPU (1000 = whole).
        #[arg(long, default_value_t = 1000)]
        gpu_milli: u32,
        /// CPU cores per task.
        #[arg(long, default_value_t = 4)]
        cores: u32,
        /// Memory per task, GiB.
        #[arg(long, default_value_t = 16)]
        memory_gib: u64,
        /// Accepted GPU models (repeatable; none = any).
        #[arg(long = "model")]
        models: Vec<String>,
        /// Every task of a copy in one switch domain.
        #[arg(long)]
        same_domain: bool,
        /// Latest start wanted, hours from now: also answers the chance that
        /// one copy starts by then, from many runs of the partition forward.
        #[arg(long)]
        deadline_h: Option<f64>,
        /// How long the copy would run, hours: its expected goodput after
        /// placement (with --deadline-h).
        #[arg(long, requires = "deadline_h")]
        duration_h: Option<f64>,
        /// Runs forward to sample (with --deadline-h; at most 10,000).
        #[arg(long, default_value_t = 1000, requires = "deadline_h")]
        samples: u32,
        /// Time the runs may take, milliseconds (with --deadline-h; at most
        /// 10,000): fewer runs are made if it runs out, and the answer says so.
        #[arg(long, default_value_t = 1000, requires = "deadline_h")]
        budget_ms: u32,
        /// Quote agent nodes (jobs with a command) instead of simulated nodes.
        #[arg(long)]
        agents: bool,
        /// The job's priority: pending jobs at or above it are counted as ahead.
        #[arg(long, default_value_t = 0)]
        priority: u32,
        #[command(flatten)]
        conn: Conn,
    },
    /// GPU accounting: installed, powered, healthy, schedulable, busy,
    /// productive, reclaimable; stranded by cause; the outcome (work done,
    /// lost, per installed GPU-hour and per cost) by partition, tenant, class.
    Accounting {
        /// Only this partition (default: every partition you may see).
        #[arg(long, default_value = "")]
        partition: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// What tenants are owed: work lost to preemption and broken promises
    /// (a stop past the daily cap, an outage past its maximum, a guaranteed
    /// job stopped by the host), in GPU-hours. A tenant sees its own.
    Credits {
        /// Only this partition (default: every partition you may see).
        #[arg(long, default_value = "")]
        partition: String,
        /// Only this tenant (default: every tenant you may see).
        #[arg(long, default_value = "")]
        tenant: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Query the decision log (newest first).
    Decisions {
        /// Only this partition (default: every partition you may see).
        #[arg(long, default_value = "")]
        partition: String,
        /// Only decisions about this job (0: every job).
        #[arg(long, default_value_t = 0)]
        job: u64,
        /// Registry version of the deciding policy.
        #[arg(long, default_value_t = 0)]
        version: u32,
        /// At most this many decisions.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Include shadow decisions (recorded, not actuated).
        #[arg(long)]
        shadow: bool,
        #[command(flatten)]
        conn: Conn,
    },
}

/// `berth policy ...` commands that talk to a server.
#[derive(clap::Subcommand, Debug)]
pub enum PolicyApiCommand {
    /// Upload a component as a partition's next version (validated first).
    Upload {
        /// The partition whose policy this acts on (e.g. p0).
        #[arg(long)]
        partition: String,
        /// A .wasm path or the name of a bundled component.
        policy: String,
        /// Text for the policy's `configure` hook.
        #[arg(long, default_value = "")]
        config: String,
        /// A note kept with the version in the registry history.
        #[arg(long, default_value = "")]
        note: String,
        /// The hook: `place` (placement scoring), `rank` (preemption
        /// ranking), `compact` (compaction planning) or `pool` (a model
        /// pool's placement and steps).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Make a version the partition's active policy (hot swap).
    Activate {
        /// The partition whose policy this acts on (e.g. p0).
        #[arg(long)]
        partition: String,
        /// The registry version (see `berth policy history`).
        version: u32,
        /// The hook: `place` (placement scoring), `rank` (preemption
        /// ranking), `compact` (compaction planning) or `pool` (a model
        /// pool's placement and steps).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Activate an earlier version (default: the one before the current).
    Rollback {
        /// The partition whose policy this acts on (e.g. p0).
        #[arg(long)]
        partition: String,
        /// The version to go back to (default: the one before the current).
        version: Option<u32>,
        /// The hook: `place` (placement scoring), `rank` (preemption
        /// ranking), `compact` (compaction planning) or `pool` (a model
        /// pool's placement and steps).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Versions and events of a partition's policy registry.
    History {
        /// The partition (e.g. p0).
        #[arg(long)]
        partition: String,
        /// The hook: `place` (placement scoring), `rank` (preemption
        /// ranking), `compact` (compaction planning) or `pool` (a model
        /// pool's placement and steps).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Run a candidate version beside the active one: `shadow` (recorded
    /// only), `split` (a fraction of jobs decided by it) or `off`.
    Shadow {
        /// The partition whose policy this acts on (e.g. p0).
        #[arg(long)]
        partition: String,
        /// `shadow`: the candidate decides on a copy, never actuated; `split`:
        /// it decides --fraction of jobs for real; `off`: no candidate.
        #[arg(value_parser = ["shadow", "split", "off"])]
        mode: String,
        /// The candidate version (not needed for `off`).
        version: Option<u32>,
        /// With `split`: the share of jobs (by a stable hash of the job id) the
        /// candidate decides.
        #[arg(long, default_value_t = 0.5)]
        fraction: f64,
        /// The hook: `place`, `rank`, `compact` or `pool` (rank, compact
        /// and pool candidates run in shadow only; a pool candidate places
        /// on every replan and steps inside every executor, never acted on).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// The A/B report of a partition's candidate.
    Report {
        /// The partition (e.g. p0).
        #[arg(long)]
        partition: String,
        /// The hook: `place`, `rank` (victims and work lost per ranking),
        /// `compact` (chains, moves, nodes freed and payback per plan) or
        /// `pool` (placements per replan and steps per executor).
        #[arg(long, default_value = "place", value_parser = ["place", "rank", "compact", "pool"])]
        hook: String,
        /// Also write the report as one self-contained HTML page (tables, and
        /// SVG plots of agreement over time and latency per arm; opens offline).
        #[arg(long)]
        html: Option<PathBuf>,
        #[command(flatten)]
        conn: Conn,
    },
}

fn ms_to_time(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let s = ms / 1000;
    format!("{:02}:{:02}:{:02}.{:03}Z", (s / 3600) % 24, (s / 60) % 60, s % 60, ms % 1000)
}

fn placements(p: &[pb::TaskPlacement]) -> String {
    p.iter().map(|t| format!("{}{:?}", t.node, t.gpus)).collect::<Vec<_>>().join(" ")
}

/// Text from the server (which may quote a policy or a caller), printable
/// and at most `PRINT_BYTES`.
fn esc(s: &str) -> std::borrow::Cow<'_, str> {
    crate::text::printable(s, PRINT_BYTES)
}

/// Longest server-supplied field the CLI prints, in bytes.
const PRINT_BYTES: usize = 1024;

fn policy(p: &Option<pb::PolicyRef>) -> String {
    p.as_ref().map_or("-".into(), |p| {
        format!("v{} {}@{} ({})", p.version, esc(&p.name), esc(&p.policy_version), esc(p.sha256.get(..12).unwrap_or(&p.sha256)))
    })
}

async fn client(conn: &Conn) -> anyhow::Result<Client> {
    let identity = conn.cert.as_deref().zip(conn.key.as_deref());
    connect(&conn.server, conn.token.as_deref(), conn.ca.as_deref(), identity).await
}

/// Submits, retrying (with the same idempotency key) when the reply was
/// lost: the host unreachable, or gone mid-call. A retry of a submission
/// that was stored answers with the stored job, so none is made twice.
async fn submit_with_retries(conn: &Conn, req: pb::SubmitJobRequest) -> anyhow::Result<pb::SubmitJobResponse> {
    const TRIES: u32 = 4;
    let mut last = None;
    for attempt in 0..TRIES {
        if attempt > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(250 << attempt)).await;
        }
        let mut c = match client(conn).await {
            Ok(c) => c,
            Err(e) => {
                last = Some(e);
                continue;
            }
        };
        match c.submit_job(req.clone()).await {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled) => last = Some(status(s)),
            Err(s) => return Err(status(s)),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")).context(format!("submitting ({TRIES} tries with idempotency key {})", req.idempotency_key)))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

pub fn run(cmd: ApiCommand) -> anyhow::Result<()> {
    runtime()?.block_on(run_api(cmd))
}

async fn run_api(cmd: ApiCommand) -> anyhow::Result<()> {
    match cmd {
        ApiCommand::Submit { partition, tasks, gpus, gpu_milli, cores, memory_gib, models, priority, duration_s, name, env, movable, wait_ready, sleepable, work_unit, class, tier, budget_gpu_h, idempotency_key, conn, argv } => {
            let duration_s = duration_s.unwrap_or(if argv.is_empty() { 600.0 } else { 0.0 });
            let env = env
                .iter()
                .map(|e| e.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| anyhow::anyhow!("--env {e:?}: expected NAME=VALUE")))
                .collect::<anyhow::Result<_>>()?;
            let job = pb::JobSpec {
                argv,
                env,
                partition,
                name,
                tasks,
                gpus,
                gpu_milli: if gpus == 0 { 0 } else { gpu_milli },
                cpu_milli: cores * 1000,
                memory_mib: memory_gib * 1024,
                models,
                priority,
                duration_s,
                movable,
                wait_ready,
                sleepable,
                work_unit,
                class: class.unwrap_or_default(),
                tier: tier.unwrap_or_default(),
                budget_gpu_h: budget_gpu_h.unwrap_or(0.0),
            };
            let idempotency_key = idempotency_key.unwrap_or_else(|| {
                use rand::Rng;
                format!("cli-{:032x}", rand::rng().random::<u128>())
            });
            let r = submit_with_retries(&conn, pb::SubmitJobRequest { job: Some(job), idempotency_key }).await?;
            if r.duplicate {
                println!("job {} (submitted before under this idempotency key)", r.job_id);
            } else {
                println!("job {}", r.job_id);
            }
        }
        ApiCommand::Migrate { allocation, to, checkpoint, conn } => {
            let r = client(&conn).await?.migrate_task(pb::MigrateTaskRequest { allocation_id: allocation, node: to, checkpoint }).await.map_err(status)?.into_inner();
            println!("job {}: allocation {allocation} migrating to allocation {} on {} GPUs {:?}; the old copy stops once the new one runs", r.job_id, r.allocation_id, r.node, r.gpus);
        }
        ApiCommand::Sleep { job, conn } => {
            let r = client(&conn).await?.sleep_job(pb::SleepJobRequest { job_id: job }).await.map_err(status)?.into_inner();
            println!("job {job}: {} ({})", r.sleep, crate::text::printable(&r.detail, 500));
        }
        ApiCommand::Wake { job, conn } => {
            let r = client(&conn).await?.wake_job(pb::SleepJobRequest { job_id: job }).await.map_err(status)?.into_inner();
            println!("job {job}: {} ({})", r.sleep, crate::text::printable(&r.detail, 500));
        }
        ApiCommand::Cancel { job, conn } => {
            let r = client(&conn).await?.cancel_job(pb::CancelJobRequest { job_id: job }).await.map_err(status)?;
            println!("job {job} cancelled (was {})", r.into_inner().previous_state);
        }
        ApiCommand::Jobs { partition, state, limit, before, conn } => {
            let r = client(&conn).await?.list_jobs(pb::ListJobsRequest { partition, state, limit, before_id: before }).await.map_err(status)?.into_inner();
            let next = r.next_before_id;
            println!("{:>6} {:<5} {:<10} {:<9} {:>5} {:>5} {:>7} {:>4}  placement", "job", "part", "owner", "state", "tasks", "gpus", "decided", "ver");
            for j in r.jobs {
                let s = j.spec.unwrap_or_default();
                let decided = if j.decision_id == 0 { "-".to_string() } else { format!("#{}", j.decision_id) };
                let ver = if j.policy_version == 0 { "-".to_string() } else { format!("v{}", j.policy_version) };
                let state = if j.sleep.is_empty() || j.sleep == "awake" { j.state } else { j.sleep };
                // Tasks the kernel killed over their memory limit, named.
                let oom: Vec<String> = j.runs.iter().filter(|r| r.limit == "oom").map(|r| r.allocation_id.to_string()).collect();
                let oom = if oom.is_empty() { String::new() } else { format!("  (over its memory limit: task {})", oom.join(", ")) };
                // Tiers other than the default, named.
                let tier = if s.tier.is_empty() || s.tier == "preemptible" {
                    String::new()
                } else if s.budget_gpu_h > 0.0 {
                    format!("  [{}, {:.2} of {:.2} GPU-h used]", esc(&s.tier), j.charged_gpu_h, s.budget_gpu_h)
                } else {
                    format!("  [{}]", esc(&s.tier))
                };
                println!("{:>6} {:<5} {:<10} {:<9} {:>5} {:>5} {:>7} {:>4}  {}{tier}{oom}", j.id, s.partition, esc(&j.owner), state, s.tasks, s.gpus, decided, ver, placements(&j.placements));
            }
            if next != 0 {
                // On stderr: the table stays a table for scripts.
                eprintln!("more jobs: --before {next}");
            }
        }
        ApiCommand::Nodes { partition, conn } => {
            let r = client(&conn).await?.list_nodes(pb::ListNodesRequest { partition }).await.map_err(status)?;
            println!("{:<12} {:<5} {:<6} {:>6} {:>9} {:>10} {:>12}", "node", "part", "model", "switch", "idle GPUs", "free CPU", "free mem GiB");
            for n in r.into_inner().nodes {
                println!(
                    "{:<12} {:<5} {:<6} {:>6} {:>6}/{:<2} {:>10} {:>12}{}",
                    n.name,
                    n.partition,
                    n.model,
                    n.switch_domain,
                    n.gpus_idle,
                    n.gpus,
                    format!("{}/{}", n.cpu_free_milli / 1000, n.cpu_total_milli / 1000),
                    format!("{}/{}", n.memory_free_mib / 1024, n.memory_total_mib / 1024),
                    match (n.source.as_str(), n.schedulable) {
                        ("agent", _) if n.gpus_unhealthy > 0 => format!("  agent, {}, {} GPUs unhealthy", n.state, n.gpus_unhealthy),
                        ("agent", _) => format!("  agent, {}", n.state),
                        (_, true) => String::new(),
                        (_, false) => "  unschedulable".into(),
                    }
                );
            }
        }
        ApiCommand::Partitions { conn } => {
            let r = client(&conn).await?.list_partitions(pb::ListPartitionsRequest {}).await.map_err(status)?;
            for p in r.into_inner().partitions {
                println!(
                    "{}: {} nodes, {:.1}/{} GPUs busy, {} pending, {} running; active {}{}{}; guard: {}",
                    p.name,
                    p.nodes,
                    p.gpus_busy,
                    p.gpus,
                    p.pending_jobs,
                    p.running_jobs,
                    policy(&p.active),
                    if p.shadow_mode == "off" { String::new() } else { format!("; {} {}", p.shadow_mode, policy(&p.candidate)) },
                    if p.paused { "; PAUSED (no good policy version)" } else { "" },
                    p.guard
                );
            }
        }
        ApiCommand::Guard { partition, off, reserve_after_s, aging_per_hour, window_s, window_gpu_h, conn } => {
            let req = pb::SetGuardRequest { partition: partition.clone(), off, reserve_after_s, aging_per_hour, window_s, window_gpu_hours: window_gpu_h };
            let r = client(&conn).await?.set_guard(req).await.map_err(status)?.into_inner();
            println!("{partition}: starvation guard {}", r.guard);
        }
        // Offline: a simulation on this thread, no host to ask.
        ApiCommand::Capture { what: CaptureCommand::Convert(args) } => crate::replay::convert::run(args)?,
        ApiCommand::Capture { what: CaptureCommand::Export { partition, since, until, conn } } => {
            use std::io::Write;
            let req = pb::ExportCaptureRequest {
                partition,
                since_s: since.as_deref().map(|t| parse_time(t, "--since")).transpose()?,
                until_s: until.as_deref().map(|t| parse_time(t, "--until")).transpose()?,
            };
            // A start line holds the whole fleet: larger than the default 4 MiB at scale.
            let mut stream = client(&conn).await?.max_decoding_message_size(256 << 20).export_capture(req).await.map_err(status)?.into_inner();
            let mut out = std::io::stdout().lock();
            while let Some(chunk) = stream.message().await.map_err(status)? {
                out.write_all(&chunk.text)?;
            }
            out.flush()?;
        }
        ApiCommand::Pool { partition, json, steps, conn } => {
            let r = client(&conn).await?.pool_status(pb::PoolStatusRequest { partition }).await.map_err(status)?.into_inner();
            if json {
                println!("{}", serde_json::to_string_pretty(&super::pooling::status_json(&r))?);
                return Ok(());
            }
            print!("{}", pool_text(&r, steps));
        }
        ApiCommand::Compactions { partition, limit, json, conn } => {
            let r = client(&conn).await?.list_compactions(pb::ListCompactionsRequest { partition, limit }).await.map_err(status)?.into_inner();
            if json {
                println!("{}", serde_json::to_string_pretty(&chains_json(&r.chains))?);
                return Ok(());
            }
            if r.chains.is_empty() {
                println!("no compaction chains yet");
            }
            for c in &r.chains {
                let bytes = c.bytes_same_switch + c.bytes_same_aggregation + c.bytes_cross_aggregation;
                println!(
                    "chain {} ({}): {}{} by {}; idle nodes {} -> {}, startable pending shapes {} -> {}; {:.1} GiB moved; planned {} node(s) freed, benefit {:.0} / cost {:.0} GPU-s",
                    c.id,
                    c.partition,
                    c.state,
                    if c.cause.is_empty() { String::new() } else { format!(" ({})", esc(&c.cause)) },
                    esc(&c.policy),
                    c.idle_nodes_before,
                    c.idle_nodes_after,
                    c.pending_startable_before,
                    c.pending_startable_after,
                    bytes as f64 / f64::from(1u32 << 30),
                    c.nodes_freed,
                    c.benefit_gpu_s,
                    c.cost_gpu_s
                );
                for m in &c.moves {
                    println!(
                        "  job {} allocation {} {} -> {} GPUs {:?} -> allocation {}: {} ({}, {:.1} GiB; overlap {} ms, takeover {} ms{}){}",
                        m.job_id,
                        m.from_allocation,
                        m.from_node,
                        m.to_node,
                        m.to_gpus,
                        m.to_allocation,
                        m.state,
                        m.tier,
                        m.state_bytes as f64 / f64::from(1u32 << 30),
                        m.overlap_ms,
                        m.warmup_ms,
                        if m.rate_before_milli == 0 && m.rate_after_milli == 0 {
                            String::new()
                        } else {
                            format!(
                                "; {} {:.2} -> {:.2} {}, neighbours {:.2} -> {:.2} cores",
                                if m.rate_measure == "progress" { "work" } else { "CPU" },
                                f64::from(m.rate_before_milli) / 1000.0,
                                f64::from(m.rate_after_milli) / 1000.0,
                                if m.rate_measure == "progress" { "units/s" } else { "cores" },
                                f64::from(m.neighbours_before_milli) / 1000.0,
                                f64::from(m.neighbours_after_milli) / 1000.0
                            )
                        },
                        if m.cause.is_empty() { String::new() } else { format!(": {}", esc(&m.cause)) }
                    );
                }
            }
        }
        ApiCommand::Explain { job, what_if, conn } => {
            let r = client(&conn).await?.explain_job(pb::ExplainJobRequest { job_id: job, what_if }).await.map_err(status)?.into_inner();
            println!("job {job}: {}", r.state);
            println!("  {}", esc(&r.summary));
            if !r.last_decision.is_empty() {
                println!("  last: {}", esc(&r.last_decision));
            }
            for t in &r.tasks {
                println!("  {}", esc(t));
            }
            if what_if && r.state == "pending" {
                if r.what_if.is_empty() {
                    println!("  what would let it start now: no stop, move or repair (it fits, or it must wait for running work to end)");
                } else {
                    println!("  what would let it start now (nothing is done):");
                }
                for w in &r.what_if {
                    match w.kind.as_str() {
                        "preempt" => println!("    preempt job(s) {:?}: {:.0} GPU-s of work lost", w.jobs, w.lost_gpu_seconds),
                        "move" => println!("    move {} task(s) of job(s) {:?} ({}): {:.1} GiB copied", w.moves.len(), w.jobs, w.moves.iter().map(|m| esc(m)).collect::<Vec<_>>().join(", "), w.bytes_moved as f64 / f64::from(1u32 << 30)),
                        "repair" => println!("    repair node(s) {}", w.nodes.iter().map(|n| esc(n)).collect::<Vec<_>>().join(", ")),
                        other => println!("    {}", esc(other)),
                    }
                }
            }
        }
        ApiCommand::Quote { partition, gpus, tasks, gpu_milli, cores, memory_gib, models, same_domain, deadline_h, duration_h, samples, budget_ms, agents, priority, conn } => {
            let req = pb::QuoteRequest {
                partition: partition.clone(),
                tasks,
                gpus,
                gpu_milli,
                cpu_milli: cores * 1000,
                memory_mib: memory_gib * 1024,
                models,
                same_domain,
                deadline_h: deadline_h.unwrap_or(0.0),
                agent_nodes: agents,
                priority,
                duration_h: duration_h.unwrap_or(0.0),
                samples,
                budget_ms,
            };
            let r = client(&conn).await?.quote(req).await.map_err(status)?.into_inner();
            println!("{partition}: {} cop{} of {tasks} x {gpus} GPU(s) could start now", r.now, if r.now == 1 { "y" } else { "ies" });
            if r.has_next {
                println!("  the next could start in {} s, as running work ends on plan", r.next_in_s);
            } else {
                println!("  no more as running work ends on plan (work without a planned end is not counted)");
            }
            if r.has_deadline {
                println!("  by the deadline, if running work ends on plan: {}", if r.meets_deadline { "yes" } else { "no" });
            }
            if r.has_chance {
                println!(
                    "  chance one copy starts by the deadline: {:.1}% (95% interval {:.1}-{:.1}%; {} of {} runs forward, {} ms)",
                    100.0 * r.probability,
                    100.0 * r.low,
                    100.0 * r.high,
                    r.started,
                    r.samples,
                    r.elapsed_ms
                );
                if r.has_start {
                    let goodput = if duration_h.is_some() { format!("; expected goodput {:.1} GPU-h over {} h", r.goodput_gpu_h, duration_h.unwrap_or(0.0)) } else { String::new() };
                    println!("  when it starts: median in {} s, work rate {:.2} of the reference{goodput}", r.median_start_s, r.rate);
                }
            }
            if r.queued_ahead > 0 {
                println!("  {} pending job(s) at or above priority {priority} are decided first", r.queued_ahead);
            }
            for o in &r.offers {
                println!("  {:<14} {:<40} {}", format!("{}:", esc(&o.tier)), offer_start(o), offer_contract(o));
            }
        }
        ApiCommand::Credits { partition, tenant, conn } => {
            let r = client(&conn).await?.credits(pb::CreditsRequest { partition, tenant }).await.map_err(status)?.into_inner();
            println!("{:<16} {:<20} {:>11} {:>12} {:>7} {:>12}", "partition", "tenant", "preemptions", "lost GPU-h", "broken", "credit GPU-h");
            for c in &r.rows {
                println!(
                    "{:<16} {:<20} {:>11} {:>12.2} {:>7} {:>12.2}",
                    esc(&c.partition),
                    esc(&c.tenant),
                    c.preemptions,
                    c.lost_gpu_seconds / 3600.0,
                    c.broken_promises,
                    c.credit_gpu_hours
                );
            }
            if r.rows.is_empty() {
                println!("nothing owed: no preemption or broken promise recorded");
            }
        }
        ApiCommand::Accounting { partition, conn } => {
            let r = client(&conn).await?.accounting(pb::AccountingRequest { partition }).await.map_err(status)?.into_inner();
            println!("{:<16} {:>9} {:>9} {:>9} {:>11} {:>9} {:>10} {:>11}", "GPUs", "installed", "powered", "healthy", "schedulable", "busy", "productive", "reclaimable");
            for row in r.rows {
                let d = row.gpus.unwrap_or_default();
                println!(
                    "{:<16} {:>9.1} {:>9.1} {:>9.1} {:>11.1} {:>9.1} {:>10.1} {:>11.1}",
                    esc(&row.group),
                    d.installed,
                    d.powered,
                    d.healthy,
                    d.schedulable,
                    d.busy,
                    d.productive,
                    d.reclaimable
                );
            }
            for s in r.stranded {
                println!("stranded {:<14} {:.1} GPUs", s.cause, s.gpus);
            }
            if r.outcome.is_empty() {
                println!("outcome: no work reported yet (tasks report it with `berth progress UNITS`)");
            } else {
                println!();
                println!("{:<24} {:<16} {:>12} {:>12} {:>12} {:>12} {:>14}", "outcome", "unit", "done", "lost", "goodput", "per GPU-h", "per cost");
                for o in r.outcome {
                    let per_cost = if o.has_cost { format!("{:.4}", o.per_cost) } else { "-".into() };
                    println!(
                        "{:<24} {:<16} {:>12} {:>12} {:>12} {:>12.4} {:>14}",
                        esc(&o.group),
                        esc(&o.unit),
                        o.done,
                        o.lost,
                        o.goodput,
                        o.per_installed_gpu_hour,
                        per_cost
                    );
                }
            }
        }
        ApiCommand::Decisions { partition, job, version, limit, shadow, conn } => {
            let req = pb::QueryDecisionsRequest { partition, job_id: job, policy_version: version, limit, include_shadow: shadow };
            let r = client(&conn).await?.query_decisions(req).await.map_err(status)?.into_inner();
            println!("{:>5} {:<13} {:<4} {:>5} {:<7} {:<9} {:<20} {:<16} {:<8} {:>8}  result", "id", "time", "part", "job", "actor", "arm", "policy", "input", "outcome", "latency");
            for d in r.decisions {
                let result = if d.outcome == "placed" { placements(&d.placements) } else { esc(&d.detail).into_owned() };
                println!(
                    "{:>5} {:<13} {:<4} {:>5} {:<7} {:<9} {:<20} {:<16} {:<8} {:>6}us  {}",
                    d.id,
                    ms_to_time(d.unix_ms),
                    d.partition,
                    d.job_id,
                    d.actor,
                    d.arm,
                    // Version 0: no registry version (the default ranking, harvesting).
                    if d.policy_version == 0 { esc(&d.policy).into_owned() } else { format!("v{} {}@{}", d.policy_version, esc(&d.policy), esc(&d.policy_semver)) },
                    d.input_digest,
                    d.outcome,
                    d.latency_us,
                    result
                );
            }
        }
    }
    Ok(())
}

pub fn run_policy(cmd: PolicyApiCommand) -> anyhow::Result<()> {
    runtime()?.block_on(run_policy_api(cmd))
}

async fn run_policy_api(cmd: PolicyApiCommand) -> anyhow::Result<()> {
    match cmd {
        PolicyApiCommand::Upload { partition, policy: spec, config, note, hook, conn } => {
            let path = crate::catalog::resolve(&spec)?;
            let component = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let r = client(&conn).await?.upload_policy(pb::UploadPolicyRequest { partition: partition.clone(), component, config, note, hook }).await.map_err(status)?;
            let r = r.into_inner();
            println!("{} {partition}: {}", if r.created { "uploaded to" } else { "already in" }, policy(&r.policy));
        }
        PolicyApiCommand::Activate { partition, version, hook, conn } => {
            let r = client(&conn).await?.activate_policy(pb::ActivatePolicyRequest { partition: partition.clone(), version, hook }).await.map_err(status)?;
            let r = r.into_inner();
            println!("{partition}: active {} (was {}); swapped in {:.2} ms", policy(&r.active), policy(&r.previous), r.swap_us as f64 / 1e3);
        }
        PolicyApiCommand::Rollback { partition, version, hook, conn } => {
            let req = pb::RollbackPolicyRequest { partition: partition.clone(), version: version.unwrap_or(0), hook };
            let r = client(&conn).await?.rollback_policy(req).await.map_err(status)?.into_inner();
            println!("{partition}: rolled back to {} (was {}); swapped in {:.2} ms", policy(&r.active), policy(&r.previous), r.swap_us as f64 / 1e3);
        }
        PolicyApiCommand::History { partition, hook, conn } => {
            let r = client(&conn).await?.policy_history(pb::PolicyHistoryRequest { partition: partition.clone(), hook }).await.map_err(status)?.into_inner();
            println!("{partition}: active version {}", r.active_version);
            for v in &r.versions {
                let blocked = if v.blocked_until_unix_ms > crate::util::unix_ms() { "  [breaker backoff]" } else { "" };
                println!("  {}  by {} at {}  contract {}{}", policy(&v.policy), esc(&v.uploaded_by), ms_to_time(v.uploaded_unix_ms), esc(&v.contract), blocked);
            }
            println!("events:");
            for e in &r.events {
                println!("  {}  {:<10} v{:<3} by {:<8} {}", ms_to_time(e.unix_ms), esc(&e.kind), e.version, esc(&e.by), esc(&e.detail));
            }
        }
        PolicyApiCommand::Shadow { partition, mode, version, fraction, hook, conn } => {
            anyhow::ensure!(mode == "off" || version.is_some(), "berth policy shadow {mode} needs a version");
            let m = match mode.as_str() {
                "shadow" => pb::ShadowMode::Shadow,
                "split" => pb::ShadowMode::Split,
                _ => pb::ShadowMode::Off,
            };
            let req = pb::SetShadowRequest { partition: partition.clone(), version: version.unwrap_or(0), mode: m as i32, fraction, hook };
            client(&conn).await?.set_shadow(req).await.map_err(status)?;
            println!("{partition}: candidate {mode}{}", version.map_or(String::new(), |v| format!(" version {v}")));
        }
        PolicyApiCommand::Report { partition, hook, html, conn } => {
            let mut c = client(&conn).await?;
            let r = c.shadow_report(pb::ShadowReportRequest { partition: partition.clone(), hook }).await.map_err(status)?.into_inner();
            if let Some(path) = &html {
                anyhow::ensure!(r.rank.is_none() && r.compact.is_none() && r.pool.is_none(), "--html reports placement A/B; the rank, compact and pool reports are text");
                let req = pb::QueryDecisionsRequest { partition: partition.clone(), limit: 20_000, include_shadow: true, ..Default::default() };
                let log = c.query_decisions(req).await.map_err(status)?.into_inner().decisions;
                std::fs::write(path, super::console::report_html(&partition, &r, &log)).with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            println!("{partition}: mode {}; active {}; candidate {}", r.mode, policy(&r.active), policy(&r.candidate));
            if let Some(k) = &r.compact {
                println!("  compaction steps planned by both: {}, candidate errors {}", k.steps, k.candidate_errors);
                for (arm, t) in [("active", &k.active), ("candidate", &k.candidate)] {
                    let t = t.clone().unwrap_or_default();
                    println!(
                        "  {arm:<9}: {} chains, {} moves, {} nodes freed, {:.1} GiB of state, benefit {:.0} / cost {:.0} GPU-s",
                        t.chains,
                        t.moves,
                        t.nodes_freed,
                        t.state_bytes as f64 / f64::from(1u32 << 30),
                        t.benefit_gpu_s,
                        t.cost_gpu_s
                    );
                }
                return Ok(());
            }
            if let Some(k) = &r.pool {
                println!("  replans placed by both: {}, identical placements: {}, candidate errors {}", k.replans, k.agreed, k.candidate_errors);
                for (arm, t) in [("active", &k.active), ("candidate", &k.candidate)] {
                    let t = t.clone().unwrap_or_default();
                    println!(
                        "  {arm:<9}: {:.1} pairs, {:.1} models on {:.1} executors; unplaced traffic {:.2} req/s; busiest executor offered {:.2} request-s/s",
                        t.mean_pairs, t.mean_models_placed, t.mean_executors_used, t.mean_unplaced_rate, t.mean_busiest_offered
                    );
                }
                let share = if k.steps == 0 { 0.0 } else { k.steps_agreed as f64 * 100.0 / k.steps as f64 };
                println!("  executor steps asked of both: {}, same step {:.1}%, candidate refused {}", k.steps, share, k.step_errors);
                return Ok(());
            }
            if let Some(k) = &r.rank {
                println!("  preemptions ranked by both: {}, same victims: {}, candidate errors {}", k.samples, k.agreed, k.candidate_errors);
                println!("  jobs interrupted: active {}, candidate {}", k.active_victims, k.candidate_victims);
                println!("  GPU-s of work lost: active {:.0}, candidate {:.0}", k.active_lost_gpu_s, k.candidate_lost_gpu_s);
                return Ok(());
            }
            if r.arms.is_empty() {
                println!("  samples {}, agreement {:.1}%, candidate errors {}", r.samples, r.agreement_rate * 100.0, r.candidate_errors);
                println!("  score gap, candidate's view (own pick - active's pick): {:.3}", r.mean_candidate_score_gap);
                println!("  score gap, active's view    (own pick - candidate's pick): {:.3}", r.mean_active_score_gap);
                println!("  partly used nodes after: active {:.2}, candidate {:.2}", r.mean_partial_nodes_active, r.mean_partial_nodes_candidate);
                if r.mean_domains_active > 0.0 || r.mean_domains_candidate > 0.0 {
                    println!("  switch domains per gang: active {:.2}, candidate {:.2}", r.mean_domains_active, r.mean_domains_candidate);
                }
                for d in r.recent_diffs.iter().take(5) {
                    println!("  job {} (decision {}): active {} | candidate {} ({})", d.job_id, d.decision_id, placements(&d.active), placements(&d.candidate), esc(&d.note));
                }
            }
            for a in r.arms {
                println!(
                    "  arm {:<9} {}: {} decisions, {} placed, {} errors, latency {:.0} us, wait {:.2} s, partly used nodes after {:.2}, domains/gang {:.2}",
                    a.arm,
                    policy(&a.policy),
                    a.decisions,
                    a.placed,
                    a.errors,
                    a.mean_latency_us,
                    a.mean_wait_s,
                    a.mean_partial_nodes_after,
                    a.mean_domains_per_gang
                );
            }
        }
    }
    Ok(())
}

/// When a copy could start under one tier of a quote.
fn offer_start(o: &pb::TierOffer) -> String {
    let mut when = if o.now > 0 {
        format!("now ({} cop{})", o.now, if o.now == 1 { "y" } else { "ies" })
    } else if o.has_next {
        format!("in {} s", o.next_in_s)
    } else {
        "not as running work ends on plan".to_string()
    };
    if o.now == 0 && o.by_preemption > 0 {
        when = format!("now by preemption ({}), else {when}", o.by_preemption);
    }
    when
}

/// The contract one tier of a quote runs under, in words.
fn offer_contract(o: &pb::TierOffer) -> String {
    if o.max_interruptions_per_day == 0 {
        return "never stopped by the host".to_string();
    }
    let stop = if o.notice_s == 0 && o.grace_s == 0 { "stopped without notice".to_string() } else { format!("{} s notice + {} s grace", o.notice_s, o.grace_s) };
    let cap = if o.max_interruptions_per_day == u32::MAX { "no daily cap".to_string() } else { format!("at most {} interruption(s) a day", o.max_interruptions_per_day) };
    let outage = if o.max_outage_s > 0 { format!(", back within {} s", o.max_outage_s) } else { String::new() };
    let credit = if o.credit_per_lost_gpu_h > 0.0 {
        format!("; lost work credited {} GPU-h per GPU-h, a broken promise {}x (at least {} GPU-h per GPU)", o.credit_per_lost_gpu_h, o.broken_multiplier, o.broken_floor_gpu_h_per_gpu)
    } else {
        "; lost work not credited".to_string()
    };
    format!("{stop}, {cap}{outage}{credit}")
}

/// A pool's status for people.
pub fn pool_text(r: &pb::PoolStatusResponse, steps: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let judged = r.slo_met + r.slo_missed;
    let attained = if judged == 0 { 0.0 } else { r.slo_met as f64 * 100.0 / judged as f64 };
    let name = |p: &Option<pb::PolicyRef>| p.as_ref().map_or("none".to_string(), |p| format!("{}@{} (pool version {})", esc(&p.name), esc(&p.policy_version), p.version));
    let _ = writeln!(out, "{}: {} models; placed by {}; candidate in shadow {}", r.partition, r.models, if r.placed_by.is_empty() { "nobody yet".into() } else { esc(&r.placed_by) }, name(&r.candidate));
    let _ = writeln!(
        out,
        "requests: {} met the SLO, {} missed ({attained:.1}% attained), {} failed, {} rejected, {} cancelled; {} in flight, {} waiting for an executor",
        r.slo_met, r.slo_missed, r.failed, r.rejected, r.cancelled, r.in_flight, r.waiting_for_route
    );
    let _ = writeln!(
        out,
        "TTFT p50 {:.3} s, p99 {:.3} s (SLO {:.2} s); TBT p50 {:.3} s, p99 {:.3} s (SLO {:.2} s)",
        r.ttft_p50_s, r.ttft_p99_s, r.slo_ttft_s, r.tbt_p50_s, r.tbt_p99_s, r.slo_tbt_s
    );
    for e in &r.executors {
        let models: Vec<String> = e.models.iter().map(|m| format!("{}x{}{}", esc(&m.model), m.weight, if m.pinned { " pinned" } else { "" })).collect();
        let step = if e.step_policy.is_empty() { "default step".to_string() } else { format!("step {}", esc(&e.step_policy.chars().take(12).collect::<String>())) };
        let _ = writeln!(
            out,
            "executor {} (tp {}, {}) on {} allocation {}: load {}, {} loads, {step}; steps by policy {}, default {}, fallback {}{}",
            e.index,
            e.tp,
            e.state,
            if e.node.is_empty() { "-".into() } else { esc(&e.node) },
            e.allocation_id,
            e.load,
            e.loads,
            e.steps_policy,
            e.steps_default,
            e.steps_fallback,
            if e.shadow_agreed + e.shadow_differed + e.shadow_refused > 0 {
                format!("; candidate agreed {}, differed {}, refused {}", e.shadow_agreed, e.shadow_differed, e.shadow_refused)
            } else {
                String::new()
            }
        );
        let _ = writeln!(out, "  models: {}", if models.is_empty() { "none".into() } else { models.join(", ") });
        if steps {
            for s in &e.recent {
                let _ = writeln!(
                    out,
                    "  t={:.3} {} {} batch {} x{} {:.1} ms by {}{}{}",
                    s.t,
                    esc(&s.phase),
                    esc(&s.model),
                    s.batch,
                    s.iterations,
                    s.seconds * 1000.0,
                    esc(&s.by),
                    if s.why.is_empty() { String::new() } else { format!(" ({})", esc(&s.why)) },
                    if s.shadow.is_empty() { String::new() } else { format!("; candidate {}", esc(&s.shadow)) }
                );
            }
        }
    }
    out
}
