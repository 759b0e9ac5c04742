//! Starting and stopping the live host: the fleet from config, the registry
//! and decision log from the state directory, scheduler threads, the gRPC
//! server (TLS when configured) and the metrics endpoint.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tonic::transport::{Certificate, Identity as TlsIdentity, Server, ServerTlsConfig};

use super::auth::Access;
use super::breaker::BreakerConfig;
use super::decisions::DecisionLog;
use crate::proto::berth_server::BerthServer;
use super::registry::Registry;
use super::state::{Live, Partition};
use super::service::Service;
use crate::asi::fleet::FleetConfig;
use crate::wasm::{Limits, PolicyEngine};

/// The embedded default fleet: three partitions of 32 eight-GPU nodes, one
/// GPU model each, 16 nodes per access switch.
pub const DEFAULT_FLEET: &str = r#"
seed = 1
nodes_per_switch = 16
switches_per_aggregation = 4
nodes_per_partition = 32
unhealthy_fraction = 0.0

[[shapes]]
model = "H800"
count = 32
gpus = 8
cpu_cores = 128
memory_gib = 2048

[[shapes]]
model = "A100"
count = 32
gpus = 8
cpu_cores = 96
memory_gib = 1024

[[shapes]]
model = "L20"
count = 32
gpus = 8
cpu_cores = 64
memory_gib = 1024

# Illustrative prices of a GPU-hour (any currency), for the outcome per
# cost; agent nodes' models are priced by name too.
[cost_per_gpu_hour]
H800 = 2.0
A100 = 1.3
L20 = 0.6
H20 = 1.1
H100 = 2.2
H200 = 3.0
A800 = 1.3
L40S = 0.9
B200 = 4.5
"#;

/// TLS material (PEM files). With `client_ca`, client certificates signed
/// by it are accepted (and may identify callers); tokens still work.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    /// The model pools' OpenAI-compatible endpoint (loopback only).
    pub inference_listen: Option<SocketAddr>,
    pub state_dir: PathBuf,
    pub fleet: FleetConfig,
    pub access: Access,
    pub tls: Option<TlsFiles>,
    /// Component bytes every partition starts with when its registry is empty.
    pub default_policy: Vec<u8>,
    pub limits: Limits,
    pub breaker: BreakerConfig,
    pub max_upload_bytes: usize,
    /// Where jobs, allocations and agent nodes persist.
    pub store: StoreChoice,
    /// Priority and preemption settings of every partition's engine.
    pub scheduling: Scheduling,
}

/// What the live engines are told about priority: jobs at or above
/// `high_priority` may take capacity back from lower-priority jobs below
/// it (fill), which leave under `contract`.
#[derive(Clone, Debug)]
pub struct Scheduling {
    pub high_priority: u32,
    pub contract: berth_core::job::PriorityContract,
    /// Live compaction's settings (the cost model, payback, hysteresis,
    /// period, start deadline), and whether steps run on their own.
    pub compaction: berth_core::compaction::CompactionConfig,
    pub auto_compaction: bool,
    /// Sleep-state harvesting on a daily schedule (hours of the UTC day):
    /// `sleepable` jobs sleep in the trough and wake after.
    pub harvest: Option<berth_core::harvest::Harvest>,
    /// What the host decides by: the system's clock, or a test's.
    pub clock: std::sync::Arc<dyn super::clock::Clock>,
    /// How much ended work is kept (jobs, decisions, agent allocations).
    pub retention: super::state::Retention,
    /// GPU memory (MiB) a sleeping task may still use on one GPU for its
    /// job's GPUs to be lent.
    pub lend_max_memory_mib: u64,
}

impl Default for Scheduling {
    /// Priority 1 and above preempts priority 0; the core's default
    /// contract (30 s notice, at most 3 interruptions a day).
    fn default() -> Self {
        Scheduling {
            high_priority: 1,
            contract: berth_core::job::PriorityContract::default(),
            compaction: Default::default(),
            auto_compaction: true,
            harvest: None,
            clock: std::sync::Arc::new(super::clock::SystemClock),
            retention: Default::default(),
            lend_max_memory_mib: super::state::DEFAULT_LEND_MAX_MEMORY_MIB,
        }
    }
}

impl Scheduling {
    /// A partition's engine settings, with its starvation guard.
    fn engine(&self, guard: Option<berth_core::engine::StarvationGuard>) -> berth_core::engine::SimConfig {
        let guards = berth_core::engine::Guards::everywhere(guard);
        berth_core::engine::SimConfig { high_priority: self.high_priority, contract: self.contract, guards, ..Default::default() }
    }
}

/// The durable store of a host.
#[derive(Clone, Debug, Default)]
pub enum StoreChoice {
    /// `state.redb` in the state directory.
    #[default]
    Embedded,
    /// No persistence (jobs live in memory only).
    Memory,
    /// etcd, with leader election: the host waits as a standby (serving
    /// nothing) until it leads, then loads the state from etcd.
    Etcd(crate::store::etcd::EtcdConfig),
    /// A store the caller built.
    Given(crate::store::SharedStore),
}

/// A running server.
pub struct ServeHandle {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// The model pools' endpoint, when --inference-listen is on.
    pub inference_addr: Option<SocketAddr>,
    pub live: Arc<Live>,
    /// The agent hub (nodes, heartbeats, command streams).
    pub hub: Arc<crate::serve::hub::Hub>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    schedulers: Vec<std::thread::JoinHandle<()>>,
}

impl ServeHandle {
    /// Resolves when the server stops on its own (it does not, short of an
    /// error); use with a shutdown signal.
    pub async fn stopped(&mut self) {
        for t in self.tasks.iter_mut() {
            let _ = t.await;
        }
    }

    /// Stops serving, then the schedulers (each finishes its decision).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        // A graceful stop waits for open streams: end the agents' command
        // streams, or a host with connected agents never stops.
        self.hub.close_command_streams();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        self.live.stop();
        let threads = std::mem::take(&mut self.schedulers);
        let _ = tokio::task::spawn_blocking(move || threads.into_iter().for_each(|t| drop(t.join()))).await;
    }
}

/// Builds the live host and starts serving. Refuses to serve plaintext on
/// anything but loopback.
pub async fn start(config: ServeConfig) -> anyhow::Result<ServeHandle> {
    start_with_agents(config, crate::serve::hub::HubConfig::default()).await
}

/// [`start`], with the node-agent service configured (`berth agent`).
pub async fn start_with_agents(config: ServeConfig, agents: crate::serve::hub::HubConfig) -> anyhow::Result<ServeHandle> {
    anyhow::ensure!(
        config.tls.is_some() || config.listen.ip().is_loopback(),
        "refusing to serve without TLS on {} (not loopback): pass --tls-cert and --tls-key",
        config.listen
    );
    std::fs::create_dir_all(&config.state_dir).with_context(|| format!("creating {}", config.state_dir.display()))?;
    let (fleet, topo) = config.fleet.build()?;
    let models = fleet.models.clone();
    let count = topo.partition.iter().copied().max().map_or(0, |m| m + 1);
    let names: Vec<String> = (0..count).map(|p| format!("p{p}")).collect();
    // The fleet TOML's [guard] and [[partition_guard]]; operators change
    // them at run time (`berth guard`).
    let guards = config.fleet.guards()?;
    let partitions = names
        .iter()
        .enumerate()
        .map(|(p, name)| {
            let nodes = fleet.nodes().iter().zip(&topo.partition).filter(|&(_, &q)| q as usize == p).map(|(n, _)| n.clone()).collect();
            let guard = guards.partitions.get(&(p as u32)).copied().unwrap_or(guards.fleet);
            let mut engine = config.scheduling.engine(guard);
            // The fleet's non-preemptible partitions: their work is never
            // taken back (their nodes carry the partition's number, or 0
            // for agent nodes of a partition that had none at start).
            if config.fleet.non_preemptible_partitions.contains(&(p as u32)) {
                engine.protected_partitions = [p as u32, 0].into_iter().collect();
            }
            let part = Partition::new(name.clone(), berth_core::Fleet::new(models.clone(), nodes)?, engine);
            {
                let mut st = part.state.lock().unwrap();
                st.compaction = super::state::LiveCompaction::new(config.scheduling.compaction.clone(), config.scheduling.auto_compaction);
                st.clock = config.scheduling.clock.clone();
                st.harvest = config.scheduling.harvest;
                st.outcome.started_unix_ms = st.clock.unix_ms();
                if config.scheduling.retention.capture_bytes > 0 {
                    // Before recovery: a segment starts from an empty engine.
                    let dir = crate::capture::dir_of(&config.state_dir, name);
                    let bounds = crate::capture::Bounds::of_total(config.scheduling.retention.capture_bytes);
                    st.capture = Some(crate::capture::CaptureLog::open(&dir, name, bounds, st.clock.unix_ms()).with_context(|| format!("opening the capture in {}", dir.display()))?);
                    let st = &mut *st;
                    st.engine.start_capture(&st.fleet);
                }
            }
            Ok(part)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let store: Option<Arc<dyn crate::store::Store>> = match &config.store {
        StoreChoice::Embedded => Some(Arc::new(crate::store::redb::RedbStore::open(&config.state_dir.join("state.redb"))?)),
        StoreChoice::Memory => None,
        StoreChoice::Given(s) => Some(s.0.clone()),
        StoreChoice::Etcd(etcd) => {
            let etcd = etcd.clone();
            Some(Arc::new(tokio::task::spawn_blocking(move || crate::store::etcd::EtcdStore::lead(etcd)).await??))
        }
    };
    // Each partition's placement versions, and its rank hook's.
    use super::state::{hook_key, PolicyHook};
    // Pool partitions: their catalogs and executors, and a pool hook each.
    let pool_specs = config
        .fleet
        .pool
        .iter()
        .map(|p| {
            let file = crate::pool::PoolFile::load(&p.market).with_context(|| format!("[[pool]] of partition {}", p.partition))?;
            Ok(super::pooling::PoolSpec { partition: format!("p{}", p.partition), config: file.config(), executors: p.executors.clone() })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for spec in &pool_specs {
        anyhow::ensure!(names.contains(&spec.partition), "[[pool]]: partition {} does not exist", spec.partition);
    }
    let mut keys: Vec<String> = names.iter().flat_map(|n| [n.clone(), hook_key(n, PolicyHook::Rank), hook_key(n, PolicyHook::Compact)]).collect();
    keys.extend(pool_specs.iter().map(|s| hook_key(&s.partition, PolicyHook::Pool)));
    let registry = Registry::open_in(&config.state_dir, &keys, store.clone())?;
    let engine = Arc::new(PolicyEngine::new(Some(registry.artifact_dir()))?);
    let retention = config.scheduling.retention;
    let rotation = super::decisions::Rotation { max_bytes: retention.decision_log_bytes, keep_files: retention.decision_log_files };
    let decisions = DecisionLog::open_rotating(Some(&config.state_dir), 100_000, rotation)?;
    let mut live = Live::new(
        partitions,
        models,
        registry,
        decisions,
        engine,
        config.access.clone(),
        config.limits,
        config.breaker,
        config.max_upload_bytes,
        config.scheduling.clock.clone(),
    );
    live.retention = retention;
    live.lend_max_memory_mib = config.scheduling.lend_max_memory_mib;
    live.contract = config.scheduling.contract;
    live.cost_per_gpu_hour = config.fleet.costs();
    live.work = config.fleet.work.clone();
    live.pool_partitions = pool_specs.iter().map(|s| s.partition.clone()).collect();
    let live = Arc::new(live);
    for name in &names {
        live.restore(name, &config.default_policy).with_context(|| format!("partition {name}"))?;
        live.restore_aux(name, PolicyHook::Rank).with_context(|| format!("partition {name}: rank hook"))?;
        live.restore_aux(name, PolicyHook::Compact).with_context(|| format!("partition {name}: compact hook"))?;
    }
    for spec in &pool_specs {
        live.restore_aux(&spec.partition, PolicyHook::Pool).with_context(|| format!("partition {}: pool hook", spec.partition))?;
    }
    let mut agents = agents;
    if let Some(store) = store {
        agents.host_identity = super::persist::host_identity(&*store).with_context(|| format!("the host's identity in {}", store.describe()))?;
        let started = std::time::Instant::now();
        let (jobs, running, held) = live.recover(&*store).with_context(|| format!("recovering state from {}", store.describe()))?;
        live.recover_guards(&*store).with_context(|| format!("recovering guards from {}", store.describe()))?;
        live.recover_compactions(&*store).with_context(|| format!("recovering the compaction ledger from {}", store.describe()))?;
        tracing::info!(target: "berth::serve", store = %store.describe(), jobs, running, held, took_ms = started.elapsed().as_millis() as u64, "state recovered");
        let _ = live.store.set(store);
    }
    let schedulers = (0..names.len())
        .map(|p| {
            let live = live.clone();
            std::thread::Builder::new().name(format!("berth-sched-{p}")).spawn(move || live.run_partition(p))
        })
        .collect::<std::io::Result<Vec<_>>>()?;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    let listener = tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    let mut builder = Server::builder();
    if let Some(tls) = &config.tls {
        let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let mut t = ServerTlsConfig::new().identity(TlsIdentity::from_pem(read(&tls.cert)?, read(&tls.key)?));
        if let Some(ca) = &tls.client_ca {
            t = t.client_ca_root(Certificate::from_pem(read(ca)?)).client_auth_optional(true);
        }
        builder = builder.tls_config(t)?;
    }
    // Messages up to twice the upload limit reach the handler, which refuses
    // an oversized component with RESOURCE_EXHAUSTED and the limit; larger
    // ones the transport refuses with OUT_OF_RANGE before reading them.
    let hub = crate::serve::hub::Hub::new(live.clone(), agents);
    let actuator: Arc<dyn super::state::Actuator> = hub.clone();
    let _ = live.actuator.set(Arc::downgrade(&actuator));
    tasks.push(hub.spawn_sweeper(stopped.clone()));
    let pools = Arc::new(super::pooling::Pools {
        pools: pool_specs.iter().map(|s| Arc::new(super::pooling::PoolRun::new(s, names.iter().position(|n| *n == s.partition).expect("checked")))).collect(),
    });
    let _ = hub.pools.set(pools.clone());
    if !pools.pools.is_empty() {
        tasks.push(super::pooling::spawn_supervisor(pools.clone(), live.clone(), hub.clone(), stopped.clone()));
    }
    let console_hub = hub.clone();
    let handle_hub = hub.clone();
    let service = BerthServer::new(Service { live: live.clone(), agents: Some(hub.clone()) }).max_decoding_message_size(2 * config.max_upload_bytes + (64 << 10));
    let router = builder.add_service(service).add_service(crate::proto::agent_hub_server::AgentHubServer::new(hub));
    let mut rx = stopped.clone();
    tasks.push(tokio::spawn(async move {
        // Without TCP_NODELAY a small reply waits for the client's delayed
        // ACK (about 40 ms a call on Linux loopback).
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        if let Err(e) = router.serve_with_incoming_shutdown(incoming, async move { drop(rx.wait_for(|s| *s).await) }).await {
            tracing::error!(target: "berth::serve", "gRPC server failed: {e}");
        }
    }));

    let mut metrics_addr = None;
    if let Some(listen) = config.metrics_listen {
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
        metrics_addr = Some(listener.local_addr()?);
        let m = live.clone();
        // The web console shares the listener; it answers its API on loopback only.
        let console = super::console::router(Service { live: live.clone(), agents: Some(console_hub) }, listen.ip().is_loopback());
        let app = axum::Router::new().route("/metrics", axum::routing::get(move || async move { m.metrics.render() })).merge(console);
        let mut rx = stopped.clone();
        tasks.push(tokio::spawn(async move {
            let shutdown = async move { drop(rx.wait_for(|s| *s).await) };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::error!(target: "berth::serve", "metrics server failed: {e}");
            }
        }));
    }
    let mut inference_addr = None;
    if let Some(listen) = config.inference_listen {
        anyhow::ensure!(listen.ip().is_loopback(), "--inference-listen {listen}: plaintext, so loopback only (put a TLS-terminating proxy in front)");
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
        let at = listener.local_addr()?;
        inference_addr = Some(at);
        let app = super::completions::router(live.clone(), pools.clone());
        let mut rx = stopped.clone();
        tasks.push(tokio::spawn(async move {
            let shutdown = async move { drop(rx.wait_for(|s| *s).await) };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::error!(target: "berth::serve", "inference endpoint failed: {e}");
            }
        }));
        tracing::info!(target: "berth::serve", "inference endpoint on http://{at}/v1/completions ({} pool partitions)", pools.pools.len());
    }
    tracing::info!(target: "berth::serve", %addr, tls = config.tls.is_some(), partitions = names.len(), "serving");
    Ok(ServeHandle { addr, metrics_addr, inference_addr, live, hub: handle_hub, stop: Some(stop), tasks, schedulers })
}
