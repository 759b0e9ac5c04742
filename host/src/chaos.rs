//! The simulation test of the live host, after FoundationDB's simulation
//! testing and TigerBeetle's VOPR. A seed makes a list of operations
//! (submit high and low priority work, cancel at any moment, let processes
//! end, move the clock, migrate a task, compact the partition live, put
//! inference replicas to sleep and wake them (by hand and on the harvest
//! schedule), swap placement and rank versions (hostile ones among them),
//! cut an agent's link until its node is given up, restart an agent, refuse
//! or slow the store's writes for a while or refuse one write among many,
//! kill and restart the host on its store);
//! they drive the real `berth serve` code (the gRPC API, the agent
//! hub, the partition loop, the engine, the store) on a manual clock, with
//! simulated agents in-process speaking the real agent protocol.
//!
//! The simulated agents are the physical truth: which processes run on
//! which GPUs. After every operation, once the host has settled, the
//! invariants are checked against them, not against the host's records:
//! - no GPU is used by two live processes (an asleep replica has let its
//!   GPUs go: a borrower may use them until it wakes);
//! - every process belongs to a job the host holds it for, or has been
//!   told to stop;
//! - nothing of a cancelled or ended job runs without a stop;
//! - every accepted job is listed exactly once, and no refused one is;
//! - nothing of a job whose cancel was acknowledged runs without a stop;
//! - the host's fleet accounting is consistent.
//!
//! Once the operations are done, every fault ends (the store takes writes,
//! cut links come back) and the clock runs past every notice and grace;
//! then nothing may be stuck: every job the host shows running has its
//! processes on the nodes.
//!
//! A failure names the seed and the shortest operation list found (by
//! removing operations while it still fails) that reproduces it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::mpsc;

use crate::agent::HubClient;
use crate::proto as pb;
use crate::serve::clock::{Clock, ManualClock};
use crate::serve::{ServeConfig, ServeHandle};

/// What one run drives.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// Agent nodes (eight H20s each).
    pub nodes: usize,
    /// Operations per seed.
    pub operations: usize,
    /// Where each run keeps its host's store (one folder per seed).
    pub state_dir: PathBuf,
    /// The placement component every partition starts with.
    pub placement: Vec<u8>,
    /// The rank component (preemption); without one, none happens.
    pub rank: Option<Vec<u8>>,
    /// Other placement versions a run swaps to (component, configuration),
    /// hostile ones among them; `placement` is swapped back to as well.
    pub alternates: Vec<(Vec<u8>, String)>,
    /// Seconds of the preemption notice (and of the stop grace after it).
    pub notice_s: u64,
    /// The compact component (live compaction); without one, none happens.
    pub compact: Option<Vec<u8>>,
    /// Other rank versions a run swaps to (`rank` is swapped back to).
    pub rank_alternates: Vec<Vec<u8>>,
    /// A harvest schedule: sleepable replicas sleep 1 minute into the run
    /// and wake 3 minutes into it (simulated time).
    pub harvest: bool,
    /// Once the operations are done and the faults over, judge that
    /// nothing is stuck ([`World::check_live`]).
    pub liveness: bool,
}

/// One operation. Indexes (`pick`) choose among what exists when it runs,
/// modulo its count, so a list stays meaningful with operations removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A job: low-priority ones are movable (live compaction may move them).
    Submit { high: bool, tasks: u32, gpus: u32, limit_s: u32 },
    /// An inference replica: high priority, whole GPUs, sleepable, movable,
    /// no time limit.
    SubmitReplica { gpus: u32 },
    /// Ask a job to sleep (lending its GPUs once its tasks are asleep), or
    /// wake it (borrowers evicted first).
    Sleep { pick: u32 },
    Wake { pick: u32 },
    /// One live compaction step on demand (ejection chains, make-before-break).
    Compact,
    Cancel { pick: u32 },
    /// A running process ends on its own (exit 0, or a failure).
    Exit { pick: u32, code: i32 },
    Advance { seconds: u32 },
    /// Move a running task to another node (make-before-break).
    Migrate { pick: u32, checkpoint: bool },
    /// Upload (again: the same bytes are the same version) and activate a
    /// placement version: `placement` or one of the alternates.
    SwapPolicy { pick: u32 },
    /// Upload and activate a rank version: `rank` or one of its alternates.
    SwapRank { pick: u32 },
    /// The node's link goes down: no heartbeats, commands and reports lost
    /// (its processes go on), until the agent restarts. Past the heartbeat
    /// timeout and the grace the host gives the node up.
    CutAgent { node: u32 },
    RestartAgent { node: u32 },
    /// The store refuses every write (a full disk, a lost etcd quorum) for
    /// this many operations (this one included), or until the host restarts.
    StoreOutage { ops: u32 },
    /// Every store write takes this long (a slow disk, a distant etcd) for
    /// this many operations.
    SlowStore { ops: u32, ms: u32 },
    /// The store refuses `count` writes in a row (transient errors), after
    /// `after` more have gone through: within one operation some of the
    /// host's writes succeed and others fail.
    RefuseWrites { after: u32, count: u32 },
    RestartHost,
}

/// The operations of `seed`.
pub fn operations(seed: u64, count: usize, nodes: usize) -> Vec<Op> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| match rng.random_range(0..202u32) {
            0..46 => {
                let gpus = [1, 2, 4, 8][rng.random_range(0..4usize)];
                let tasks = if gpus == 8 && rng.random_bool(0.3) { 2 } else { 1 };
                let limit_s = if rng.random_bool(0.3) { rng.random_range(5..60) } else { 0 };
                Op::Submit { high: rng.random_bool(0.3), tasks, gpus, limit_s }
            }
            46..60 => Op::SubmitReplica { gpus: [1, 2, 4][rng.random_range(0..3usize)] },
            60..80 => Op::Cancel { pick: rng.random() },
            80..108 => Op::Exit { pick: rng.random(), code: if rng.random_bool(0.2) { 1 } else { 0 } },
            108..156 => Op::Advance { seconds: rng.random_range(1..20) },
            156..159 => Op::SwapPolicy { pick: rng.random() },
            159..160 => Op::SwapRank { pick: rng.random() },
            160..168 => Op::Migrate { pick: rng.random(), checkpoint: rng.random_bool(0.5) },
            168..172 => Op::Sleep { pick: rng.random() },
            172..175 => Op::Wake { pick: rng.random() },
            175..177 => Op::Compact,
            177..180 => Op::CutAgent { node: rng.random_range(0..nodes as u32) },
            180..186 => Op::RestartAgent { node: rng.random_range(0..nodes as u32) },
            186..190 => Op::StoreOutage { ops: rng.random_range(1..6) },
            190..193 => Op::SlowStore { ops: rng.random_range(1..4), ms: rng.random_range(10..150) },
            193..195 => Op::RefuseWrites { after: rng.random_range(0..6), count: rng.random_range(1..3) },
            _ => Op::RestartHost,
        })
        .collect()
}

/// A broken invariant: where, and what.
#[derive(Clone, Debug)]
pub struct Violation {
    pub step: usize,
    pub what: String,
}

/// Figures of one run.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    pub operations: usize,
    pub submitted: usize,
    pub processes_started: usize,
    pub evictions_seen: usize,
    pub host_restarts: usize,
    pub agent_restarts: usize,
    /// Migrations the host accepted.
    pub migrations: usize,
    /// Links cut, and nodes the host gave up.
    pub links_cut: usize,
    pub nodes_given_up: usize,
    /// Placement versions activated by the run (a hostile one is rolled
    /// back by its breaker).
    pub policy_swaps: usize,
    pub rank_swaps: usize,
    /// Sleeps and wakes the host accepted, and asleep reports (by hand or
    /// on the harvest schedule).
    pub sleeps: usize,
    pub wakes: usize,
    pub tasks_asleep: usize,
    pub tasks_woken: usize,
    /// Live compaction steps, and the chains they started.
    pub compactions: usize,
    pub chains_started: usize,
    /// Operations with a slow store.
    pub slow_store_ops: usize,
    /// Times the store was set to refuse a few writes among others.
    pub write_refusals: usize,
    /// Store outages, the writes they refused, and the calls the host
    /// refused because of them.
    pub store_outages: usize,
    pub writes_refused: u64,
    pub calls_refused: usize,
}

/// A process on a simulated node: the physical truth.
#[derive(Clone, Debug)]
struct Process {
    node: usize,
    gpus: Vec<u32>,
    job: u64,
    /// Told to stop: it exits at this clock time (ms).
    exits_at_ms: Option<u64>,
    /// Asleep (its sleep hook ran): its GPUs are free for a borrower.
    asleep: bool,
}

struct SimAgent {
    name: String,
    session: u64,
    hub: HubClient,
    commands: mpsc::UnboundedReceiver<pb::AgentCommand>,
    /// Commands taken from the stream, against the hub's count of those sent.
    received: u64,
    /// Reads the command stream; aborted with the agent (a host shuts down
    /// gracefully only once its streams are closed).
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for SimAgent {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The host's embedded store, with injected write failures: while
/// `failing`, every write is refused (reads pass); while `slow_ms` is not
/// 0, every write takes that long first; with `refusal` (writes to let
/// through, then writes to refuse) set, those writes are refused.
struct FaultyStore {
    inner: crate::store::redb::RedbStore,
    failing: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    slow_ms: Arc<AtomicU64>,
    refusal: Refusal,
}

/// Writes to let through, then writes to refuse; `None`: none to refuse.
type Refusal = Arc<std::sync::Mutex<Option<(u32, u32)>>>;

impl crate::store::Store for FaultyStore {
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, crate::store::StoreError> {
        self.inner.list(prefix)
    }

    fn apply(&self, ops: Vec<crate::store::Op>) -> Result<(), crate::store::StoreError> {
        let slow = self.slow_ms.load(Ordering::SeqCst);
        if slow > 0 {
            std::thread::sleep(Duration::from_millis(slow));
        }
        if self.failing.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(crate::store::StoreError::Backend("injected write failure (the simulation's store outage)".into()));
        }
        // Counted under one lock: writes come from the partition loop and
        // the handlers at once.
        let refuse = {
            let mut refusal = self.refusal.lock().unwrap();
            match *refusal {
                Some((0, left)) => {
                    *refusal = (left > 1).then(|| (0, left - 1));
                    true
                }
                Some((after, left)) => {
                    *refusal = Some((after - 1, left));
                    false
                }
                None => false,
            }
        };
        if refuse {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(crate::store::StoreError::Backend("injected write failure (the simulation's refused writes)".into()));
        }
        self.inner.apply(ops)
    }

    fn describe(&self) -> String {
        format!("{} (simulated outages)", self.inner.describe())
    }
}

/// Whether a call was refused because a store write failed.
fn store_refused(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Internal && s.message().contains("injected write failure")
}

/// The simulated host's one partition, and its callers' tokens.
pub const PARTITION: &str = "p0";
pub const OPERATOR: &str = "chaos-operator-token";
/// May act as the agent of any node named `sim-*` in [`PARTITION`].
pub const AGENT: &str = "chaos-agent-token";
const T0_MS: u64 = 1_800_000_000_000;
/// Longer than any one clock move of a run (at most 19 s).
const HEARTBEAT_TIMEOUT_S: u64 = 30;

struct World {
    config: ChaosConfig,
    seed: u64,
    dir: PathBuf,
    clock: Arc<ManualClock>,
    host: Option<ServeHandle>,
    url: String,
    api: Option<crate::client::Client>,
    agents: Vec<SimAgent>,
    processes: BTreeMap<u64, Process>,
    /// Nodes whose link is down, and the reports their agents keep until it
    /// is back (as the real agent keeps unacknowledged reports).
    cut: std::collections::BTreeSet<usize>,
    unsent: Vec<(usize, pb::AllocationReport)>,
    /// Every job accepted, with whether it was cancelled and when (ms).
    accepted: BTreeMap<u64, Option<u64>>,
    /// The accepted inference replicas (sleepable).
    replicas: std::collections::BTreeSet<u64>,
    /// Set while the store refuses writes; operations left in the outage.
    store_failing: Arc<AtomicBool>,
    writes_refused: Arc<AtomicU64>,
    outage_left: u32,
    store_slow_ms: Arc<AtomicU64>,
    slow_left: u32,
    /// Writes to let through, then writes to refuse.
    refusal: Refusal,
    stats: RunStats,
}

/// The simulated host: one partition of agent nodes (none built in), its
/// store in `dir`, on `clock`.
pub fn serve_config(dir: &std::path::Path, config: &ChaosConfig, clock: Arc<ManualClock>) -> anyhow::Result<ServeConfig> {
    let fleet = "seed = 1\nnodes_per_switch = 16\nswitches_per_aggregation = 4\nnodes_per_partition = 32\nunhealthy_fraction = 0.0\n\
                 [[shapes]]\nmodel = \"H20\"\ncount = 1\ngpus = 8\ncpu_cores = 64\nmemory_gib = 512\n";
    let access = format!(
        "[[identities]]\nname = \"chaos-operator\"\ntoken = \"{OPERATOR}\"\nroles = {{ \"*\" = \"operator\" }}\n\
         [[identities]]\nname = \"chaos-agents\"\ntoken = \"{AGENT}\"\nroles = {{ \"{PARTITION}\" = \"agent\" }}\nnodes = [\"sim-*\"]\n"
    );
    let contract = berth_core::job::PriorityContract { notice_s: config.notice_s, grace_s: config.notice_s, ..Default::default() };
    // The run starts at 08:00 UTC: the trough is 08:01 to 08:03.
    let day_s = T0_MS / 1000 % 86_400;
    let harvest = config.harvest.then_some(berth_core::harvest::Harvest { class: 0, sleep_at_s: day_s + 60, wake_at_s: day_s + 180, share: 0.7 });
    Ok(ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        inference_listen: None,
        state_dir: dir.to_path_buf(),
        fleet: crate::asi::fleet::FleetConfig::parse(fleet, "chaos")?,
        access: crate::serve::auth::Access::parse(&access)?,
        tls: None,
        default_policy: config.placement.clone(),
        limits: crate::wasm::Limits { deadline: Duration::from_secs(5), ..Default::default() },
        breaker: Default::default(),
        max_upload_bytes: 16 << 20,
        store: Default::default(),
        scheduling: crate::serve::server::Scheduling { high_priority: 1, contract, auto_compaction: false, clock, harvest, ..Default::default() },
    })
}

impl World {
    async fn start_host(&mut self, fresh: bool) -> anyhow::Result<()> {
        let mut cfg = serve_config(&self.dir, &self.config, self.clock.clone())?;
        std::fs::create_dir_all(&self.dir)?;
        let inner = crate::store::redb::RedbStore::open(&self.dir.join("state.redb"))?;
        let store = FaultyStore {
            inner,
            failing: self.store_failing.clone(),
            refused: self.writes_refused.clone(),
            slow_ms: self.store_slow_ms.clone(),
            refusal: self.refusal.clone(),
        };
        cfg.store = crate::serve::server::StoreChoice::Given(crate::store::SharedStore(Arc::new(store)));
        // The hub's timers run on the host's (manual) clock: a node whose
        // link is cut goes silent, is unreachable after 30 s and given up 20
        // s later. Connected agents heartbeat before every clock move of at
        // most 20 s, so they never look silent.
        let hub = crate::serve::hub::HubConfig { heartbeat_timeout: Duration::from_secs(HEARTBEAT_TIMEOUT_S), productive_sm_pct: 10, reschedule_after: Some(Duration::from_secs(20)), host_identity: String::new() };
        let h = crate::serve::server::start_with_agents(cfg, hub).await?;
        self.url = format!("http://{}", h.addr);
        self.api = Some(crate::client::connect(&self.url, Some(OPERATOR), None, None).await?);
        self.host = Some(h);
        // A fresh host starts with the run's rank and compact versions; a
        // restarted one keeps its active ones.
        if fresh {
            if let Some(rank) = self.config.rank.clone() {
                self.swap(rank, String::new(), "rank").await?;
            }
            if let Some(compact) = self.config.compact.clone() {
                self.swap(compact, String::new(), "compact").await?;
            }
        }
        Ok(())
    }

    /// Uploads and activates a version for `hook`; whether it is active now
    /// (an active or tripped version is not activated again; a call the
    /// store refused is counted).
    async fn swap(&mut self, component: Vec<u8>, config: String, hook: &str) -> anyhow::Result<bool> {
        let api = self.api.as_mut().expect("connected");
        let up = match api.upload_policy(pb::UploadPolicyRequest { partition: PARTITION.into(), component, config, hook: hook.into(), ..Default::default() }).await {
            Ok(up) => up.into_inner(),
            Err(s) if store_refused(&s) => {
                self.stats.calls_refused += 1;
                return Ok(false);
            }
            Err(s) => return Err(anyhow::Error::from(s).context(format!("upload of a {hook} version"))),
        };
        let version = up.policy.context("an upload names its version")?.version;
        match api.activate_policy(pb::ActivatePolicyRequest { partition: PARTITION.into(), version, hook: hook.into() }).await {
            Ok(_) => Ok(true),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => Ok(false),
            Err(s) if store_refused(&s) => {
                self.stats.calls_refused += 1;
                Ok(false)
            }
            Err(s) => anyhow::bail!("activation of {hook} version {version}: {s:?}"),
        }
    }

    async fn connect_agent(&mut self, i: usize) -> anyhow::Result<SimAgent> {
        let name = format!("sim-{i}");
        let mut hub = crate::agent::connect_hub(&self.url, Some(AGENT), None).await?;
        let gpus = (0..8u32)
            .map(|g| pb::GpuInfo { index: g, uuid: format!("GPU-sim-{i}-{g}"), model: "H20".into(), memory_total_mib: 96 * 1024, ..Default::default() })
            .collect();
        let reg = pb::RegisterAgentRequest { node: name.clone(), partition: PARTITION.into(), gpus, source: "simulated".into(), cpu_milli: 64_000, memory_mib: 512 << 10, ..Default::default() };
        let session = hub.register(reg).await.context("register")?.into_inner().session;
        let mut stream = hub.commands(pb::CommandsRequest { node: name.clone(), session }).await.context("commands")?.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Ok(Some(cmd)) = stream.message().await {
                if tx.send(cmd).is_err() {
                    return;
                }
            }
        });
        let mut agent = SimAgent { name, session, hub, commands: rx, received: 0, reader };
        // The first heartbeat carries what runs here, and what ended while
        // the link was down (its reports follow): the host reconciles.
        let running = self.running_on(i);
        agent.hub.heartbeat(pb::HeartbeatRequest { node: agent.name.clone(), session, running, ..Default::default() }).await.context("heartbeat")?;
        for r in self.take_unsent(i) {
            match agent.hub.report_allocation(r.clone()).await {
                Ok(_) => {}
                Err(s) if store_refused(&s) => self.unsent.push((i, r)),
                Err(s) if s.code() == tonic::Code::NotFound && r.state == "exited" => {} // dropped, as in `report`
                Err(s) => return Err(anyhow::Error::from(s).context(format!("late report of allocation {}", r.allocation_id))),
            }
        }
        Ok(agent)
    }

    /// What node `i`'s agent says runs there: its live processes, and those
    /// whose exit report is still unsent.
    fn running_on(&self, i: usize) -> Vec<u64> {
        let mut running: Vec<u64> = self.processes.iter().filter(|(_, p)| p.node == i).map(|(&a, _)| a).collect();
        running.extend(self.unsent.iter().filter(|(n, _)| *n == i).map(|(_, r)| r.allocation_id));
        running
    }

    /// The reports node `i` has not had acknowledged, taken to send again.
    fn take_unsent(&mut self, i: usize) -> Vec<pb::AllocationReport> {
        let (late, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unsent).into_iter().partition(|(n, _)| *n == i);
        self.unsent = others;
        late.into_iter().map(|(_, r)| r).collect()
    }

    /// Every connected agent heartbeats (what runs on its node).
    async fn heartbeats(&mut self) -> anyhow::Result<()> {
        for i in 0..self.agents.len() {
            if self.cut.contains(&i) {
                continue;
            }
            let running = self.running_on(i);
            let a = &mut self.agents[i];
            a.hub.heartbeat(pb::HeartbeatRequest { node: a.name.clone(), session: a.session, running, ..Default::default() }).await.with_context(|| format!("heartbeat of {}", a.name))?;
            // Reports the host refused before go again.
            for r in self.take_unsent(i) {
                self.report(i, r).await?;
            }
        }
        Ok(())
    }

    fn live(&self) -> &Arc<crate::serve::state::Live> {
        &self.host.as_ref().expect("the host runs").live
    }

    /// Waits until the partition has decided everything due, and the
    /// agents have acted on every command it sent (applying each to the
    /// physical truth and reporting back), until nothing more happens: the
    /// hub counts the commands it sent each agent, the agents count those
    /// they received.
    async fn settle(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            while !self.live().settled(0) {
                anyhow::ensure!(Instant::now() < deadline, "the host did not settle in 60 s");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let got = self.take_commands();
            if got.is_empty() {
                let hub = &self.host.as_ref().expect("the host runs").hub;
                let in_flight = self.agents.iter().filter(|a| hub.commands_sent(&a.name, a.session).is_some_and(|sent| sent > a.received)).map(|a| a.name.clone()).collect::<Vec<_>>();
                if in_flight.is_empty() {
                    return Ok(());
                }
                anyhow::ensure!(Instant::now() < deadline, "commands to {} did not arrive in 60 s", in_flight.join(", "));
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            for (i, cmd) in got {
                self.act(i, cmd).await?;
            }
        }
    }

    /// The commands every agent has received, in order per agent.
    fn take_commands(&mut self) -> Vec<(usize, pb::AgentCommand)> {
        let mut got = Vec::new();
        for (i, a) in self.agents.iter_mut().enumerate() {
            while let Ok(cmd) = a.commands.try_recv() {
                a.received += 1;
                got.push((i, cmd));
            }
        }
        got
    }

    /// One command on simulated node `i`.
    async fn act(&mut self, i: usize, cmd: pb::AgentCommand) -> anyhow::Result<()> {
        if self.cut.contains(&i) {
            return Ok(()); // the link is down: the command is lost
        }
        let id = cmd.allocation_id;
        let now = self.clock.unix_ms();
        let report = |state: &str, exit_code: i32, signal: i32| pb::AllocationReport {
            node: self.agents[i].name.clone(),
            allocation_id: id,
            state: state.into(),
            pid: id as u32,
            exit_code,
            signal,
            detail: String::new(),
            ..Default::default()
        };
        let msg = match cmd.action.as_str() {
            "start" => {
                if self.processes.contains_key(&id) {
                    return Ok(()); // a repeated start, as the real agent ignores it
                }
                let prefix = format!("GPU-sim-{i}-");
                let gpus: Vec<u32> = cmd.gpu_uuids.iter().filter_map(|u| u.strip_prefix(&prefix).and_then(|g| g.parse().ok())).collect();
                anyhow::ensure!(gpus.len() == cmd.gpu_uuids.len(), "allocation {id}: GPUs {:?} are not node {i}'s", cmd.gpu_uuids);
                let job = cmd.env.get("BERTH_JOB").and_then(|j| j.parse().ok()).unwrap_or(0);
                self.processes.insert(id, Process { node: i, gpus, job, exits_at_ms: None, asleep: false });
                self.stats.processes_started += 1;
                report("running", 0, 0)
            }
            "stop" => {
                let Some(p) = self.processes.get_mut(&id) else { return Ok(()) };
                // Gone within the stop grace: some at once, some at the end.
                // One frozen asleep is killed where it stands (the agent's
                // SIGKILL): it never wakes onto its lent GPUs.
                let delay = if p.asleep { 0 } else { splitmix(self.seed ^ id) % (self.config.notice_s * 1000 + 1) };
                p.exits_at_ms.get_or_insert(now + delay);
                return Ok(());
            }
            "checkpoint" => {
                self.stats.evictions_seen += 1;
                return Ok(());
            }
            // The sleep hook ran: the replica let its GPUs go. The wake
            // hook: it takes them back (whoever else is on them).
            "sleep" | "wake" => {
                let Some(p) = self.processes.get_mut(&id) else { return Ok(()) };
                if p.exits_at_ms.is_some() {
                    return Ok(()); // stopping: the hook does nothing
                }
                p.asleep = cmd.action == "sleep";
                if p.asleep {
                    self.stats.tasks_asleep += 1;
                    report("sleeping", 0, 0)
                } else {
                    self.stats.tasks_woken += 1;
                    report("running", 0, 0)
                }
            }
            _ => return Ok(()),
        };
        self.report(i, msg).await
    }

    /// Sends a report; one the host refuses for want of a store write is
    /// kept and sent again with the next heartbeat (as the agent does).
    async fn report(&mut self, i: usize, r: pb::AllocationReport) -> anyhow::Result<()> {
        let id = r.allocation_id;
        match self.agents[i].hub.report_allocation(r.clone()).await {
            Ok(_) => Ok(()),
            Err(s) if store_refused(&s) => {
                self.stats.calls_refused += 1;
                self.unsent.push((i, r));
                Ok(())
            }
            // The exit of a process the host holds nothing for (an orphan it
            // told to stop): dropped, as the real agent drops it. (Whether
            // the host should hold it is judged against its records.)
            Err(s) if s.code() == tonic::Code::NotFound && r.state == "exited" => Ok(()),
            Err(s) => Err(anyhow::Error::from(s).context(format!("report of allocation {id}"))),
        }
    }

    /// Processes whose stop delay ran out exit (signal 15), reported.
    async fn exits_due(&mut self) -> anyhow::Result<()> {
        let now = self.clock.unix_ms();
        let due: Vec<(u64, bool)> = self.processes.iter().filter(|(_, p)| p.exits_at_ms.is_some_and(|t| t <= now)).map(|(&a, p)| (a, p.asleep)).collect();
        for (a, asleep) in due {
            self.end_process(a, 0, if asleep { libc::SIGKILL } else { libc::SIGTERM }).await?;
        }
        Ok(())
    }

    async fn end_process(&mut self, alloc: u64, code: i32, signal: i32) -> anyhow::Result<()> {
        let Some(p) = self.processes.remove(&alloc) else { return Ok(()) };
        let r = pb::AllocationReport { node: self.agents[p.node].name.clone(), allocation_id: alloc, state: "exited".into(), pid: alloc as u32, exit_code: code, signal, detail: String::new(), ..Default::default() };
        if self.cut.contains(&p.node) {
            self.unsent.push((p.node, r));
            return Ok(());
        }
        self.report(p.node, r).await
    }

    async fn apply(&mut self, op: &Op) -> anyhow::Result<()> {
        match *op {
            Op::Submit { .. } | Op::SubmitReplica { .. } => {
                let base = pb::JobSpec { partition: PARTITION.into(), cpu_milli: 1000, memory_mib: 1024, argv: vec!["simulated-task".into()], ..Default::default() };
                let spec = match *op {
                    Op::Submit { high, tasks, gpus, limit_s } => pb::JobSpec { tasks, gpus, priority: if high { 5 } else { 0 }, duration_s: f64::from(limit_s), movable: !high, ..base },
                    Op::SubmitReplica { gpus } => pb::JobSpec { tasks: 1, gpus, priority: 5, sleepable: true, movable: true, ..base },
                    _ => unreachable!("matched above"),
                };
                let api = self.api.as_mut().expect("connected");
                let id = match api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await {
                    Ok(r) => r.into_inner().job_id,
                    Err(s) if store_refused(&s) => {
                        self.stats.calls_refused += 1;
                        return self.end_op().await;
                    }
                    Err(s) => return Err(s.into()),
                };
                anyhow::ensure!(self.accepted.insert(id, None).is_none(), "job id {id} was given twice");
                if matches!(op, Op::SubmitReplica { .. }) {
                    self.replicas.insert(id);
                }
                self.stats.submitted += 1;
            }
            Op::Cancel { pick } => {
                if self.accepted.is_empty() {
                    return Ok(());
                }
                let id = *self.accepted.keys().nth(pick as usize % self.accepted.len()).expect("in range");
                let api = self.api.as_mut().expect("connected");
                match api.cancel_job(pb::CancelJobRequest { job_id: id }).await {
                    Ok(_) => {
                        self.accepted.insert(id, Some(self.clock.unix_ms()));
                    }
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {} // already ended
                    Err(s) if store_refused(&s) => self.stats.calls_refused += 1,
                    Err(s) => anyhow::bail!("cancel of job {id}: {s:?}"),
                }
            }
            Op::Exit { pick, code } => {
                // (A frozen process does not end on its own.)
                let live: Vec<u64> = self.processes.iter().filter(|(_, p)| p.exits_at_ms.is_none() && !p.asleep).map(|(&a, _)| a).collect();
                if !live.is_empty() {
                    self.end_process(live[pick as usize % live.len()], code, 0).await?;
                }
            }
            Op::Advance { seconds } => {
                let target = self.clock.unix_ms() + u64::from(seconds) * 1000;
                // Every moment something is due in between, in order.
                loop {
                    let host_due = self.live().next_due_s(0).map(|s| s * 1000);
                    let exit_due = self.processes.values().filter_map(|p| p.exits_at_ms).min();
                    let next = [host_due, exit_due].into_iter().flatten().filter(|&t| t > self.clock.unix_ms()).min().unwrap_or(target).min(target);
                    self.heartbeats().await?;
                    self.clock.set(next);
                    self.exits_due().await?;
                    // Silent nodes are found on the moved clock.
                    self.stats.nodes_given_up += self.host.as_ref().expect("the host runs").hub.sweep();
                    self.live().hold(0, false); // pokes the loop: timers are due
                    self.settle().await?;
                    if next >= target {
                        break;
                    }
                }
            }
            Op::Migrate { pick, checkpoint } => {
                let movable: Vec<u64> = self.processes.iter().filter(|(_, p)| p.exits_at_ms.is_none() && !self.cut.contains(&p.node)).map(|(&a, _)| a).collect();
                if movable.is_empty() {
                    return Ok(());
                }
                let alloc = movable[pick as usize % movable.len()];
                let api = self.api.as_mut().expect("connected");
                match api.migrate_task(pb::MigrateTaskRequest { allocation_id: alloc, node: String::new(), checkpoint }).await {
                    Ok(_) => self.stats.migrations += 1,
                    // Not running (yet, or any more), migrating already, or no room.
                    Err(s) if matches!(s.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound) => {}
                    Err(s) if store_refused(&s) => self.stats.calls_refused += 1,
                    Err(s) => anyhow::bail!("migration of allocation {alloc}: {s:?}"),
                }
            }
            Op::SwapPolicy { pick } => {
                if self.config.alternates.is_empty() {
                    return Ok(());
                }
                let k = pick as usize % (self.config.alternates.len() + 1);
                let (component, config) = if k == 0 { (self.config.placement.clone(), String::new()) } else { self.config.alternates[k - 1].clone() };
                if self.swap(component, config, "place").await? {
                    self.stats.policy_swaps += 1;
                }
            }
            Op::SwapRank { pick } => {
                let Some(rank) = self.config.rank.clone() else { return Ok(()) };
                let k = pick as usize % (self.config.rank_alternates.len() + 1);
                let component = if k == 0 { rank } else { self.config.rank_alternates[k - 1].clone() };
                if self.swap(component, String::new(), "rank").await? {
                    self.stats.rank_swaps += 1;
                }
            }
            Op::Sleep { pick } | Op::Wake { pick } => {
                // Among the replicas (other jobs are refused the same way, and
                // the pick would mostly land on them).
                let replicas: Vec<u64> = self.replicas.iter().copied().collect();
                if replicas.is_empty() {
                    return Ok(());
                }
                let id = replicas[pick as usize % replicas.len()];
                let sleep = matches!(op, Op::Sleep { .. });
                let api = self.api.as_mut().expect("connected");
                let r = if sleep { api.sleep_job(pb::SleepJobRequest { job_id: id }).await } else { api.wake_job(pb::SleepJobRequest { job_id: id }).await };
                match r {
                    Ok(_) if sleep => self.stats.sleeps += 1,
                    Ok(_) => self.stats.wakes += 1,
                    // Not running, not awake (or not asleep), migrating, ...
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {}
                    Err(s) if store_refused(&s) => self.stats.calls_refused += 1,
                    Err(s) => anyhow::bail!("{} of job {id}: {s:?}", if sleep { "sleep" } else { "wake" }),
                }
            }
            Op::Compact => {
                if self.config.compact.is_none() {
                    return Ok(());
                }
                let api = self.api.as_mut().expect("connected");
                match api.compact_live(pb::CompactLiveRequest { partition: PARTITION.into(), dry_run: false }).await {
                    Ok(r) => {
                        self.stats.compactions += 1;
                        self.stats.chains_started += r.into_inner().chain_ids.len();
                    }
                    // A step running already.
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {}
                    Err(s) if store_refused(&s) => self.stats.calls_refused += 1,
                    Err(s) => anyhow::bail!("live compaction: {s:?}"),
                }
            }
            Op::CutAgent { node } => {
                let i = node as usize % self.agents.len();
                if self.cut.insert(i) {
                    self.stats.links_cut += 1;
                }
            }
            Op::RestartAgent { node } => {
                let i = node as usize % self.agents.len();
                match self.connect_agent(i).await {
                    Ok(a) => {
                        self.cut.remove(&i);
                        self.agents[i] = a;
                        self.stats.agent_restarts += 1;
                    }
                    // Its registration was not stored: the agent is as good
                    // as cut off, and tries again at its next restart.
                    Err(e) if e.chain().any(|c| c.downcast_ref::<tonic::Status>().is_some_and(store_refused)) => {
                        self.cut.insert(i);
                        self.stats.calls_refused += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
            Op::StoreOutage { ops } => {
                self.store_failing.store(true, Ordering::SeqCst);
                self.outage_left = ops.max(1);
                self.stats.store_outages += 1;
            }
            Op::SlowStore { ops, ms } => {
                self.store_slow_ms.store(u64::from(ms), Ordering::SeqCst);
                self.slow_left = ops.max(1);
            }
            Op::RefuseWrites { after, count } => {
                *self.refusal.lock().unwrap() = (count > 0).then_some((after, count));
                self.stats.write_refusals += 1;
            }
            Op::RestartHost => {
                // An outage ends before the host is back (a host that cannot
                // write does not start).
                self.store_failing.store(false, Ordering::SeqCst);
                self.outage_left = 0;
                *self.refusal.lock().unwrap() = None;
                self.agents.clear();
                self.api = None;
                if let Some(h) = self.host.take() {
                    h.shutdown().await;
                }
                self.start_host(false).await?;
                self.cut.clear();
                for i in 0..self.config.nodes {
                    let a = self.connect_agent(i).await?;
                    self.agents.push(a);
                }
                self.stats.host_restarts += 1;
            }
        }
        self.end_op().await
    }

    /// The end of every operation: due exits, a settled host, and one
    /// operation less of a store outage.
    async fn end_op(&mut self) -> anyhow::Result<()> {
        self.exits_due().await?;
        self.settle().await?;
        if self.outage_left > 0 {
            self.outage_left -= 1;
            if self.outage_left == 0 {
                self.store_failing.store(false, Ordering::SeqCst);
            }
        }
        if self.slow_left > 0 {
            self.stats.slow_store_ops += 1;
            self.slow_left -= 1;
            if self.slow_left == 0 {
                self.store_slow_ms.store(0, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    /// After the last operation: every fault ends (the store takes writes,
    /// cut links come back) and the clock moves past every notice and stop
    /// grace, twice (a job queued again by the first may start in the
    /// second), so whatever the run left waiting can happen.
    async fn quiesce(&mut self) -> anyhow::Result<()> {
        self.store_failing.store(false, Ordering::SeqCst);
        self.outage_left = 0;
        self.store_slow_ms.store(0, Ordering::SeqCst);
        self.slow_left = 0;
        *self.refusal.lock().unwrap() = None;
        for i in self.cut.clone() {
            self.apply(&Op::RestartAgent { node: i as u32 }).await?;
        }
        let past = u32::try_from(self.config.notice_s * 2 + 20).unwrap_or(u32::MAX);
        for _ in 0..2 {
            self.apply(&Op::Advance { seconds: past }).await?;
        }
        Ok(())
    }

    /// Once the host was left to settle ([`World::quiesce`]): nothing is
    /// stuck. Every job it shows running has tasks, each with its process
    /// (running or asleep) on the node the host says.
    async fn check_live(&mut self) -> Result<(), String> {
        let api = self.api.clone().expect("connected");
        let jobs = crate::client::list_all_jobs(api, pb::ListJobsRequest { partition: PARTITION.into(), ..Default::default() }).await.map_err(|e| format!("ListJobs: {e:#}"))?;
        for j in jobs.iter().filter(|j| j.state == "running") {
            let tasks: Vec<&pb::TaskRun> = j.runs.iter().filter(|r| matches!(r.state.as_str(), "starting" | "running" | "sleeping")).collect();
            let missing = tasks.iter().find(|r| !self.processes.get(&r.allocation_id).is_some_and(|p| self.agents[p.node].name == r.node));
            if tasks.is_empty() || missing.is_some() {
                return Err(format!(
                    "once every fault had ended and every notice run out, job {} shows running with no process for {} on the nodes (its tasks: {:?}; detail: {:?})",
                    j.id,
                    missing.map_or("any task".to_string(), |r| format!("allocation {} on {}", r.allocation_id, r.node)),
                    j.runs.iter().map(|r| (r.allocation_id, r.node.as_str(), r.state.as_str())).collect::<Vec<_>>(),
                    crate::text::printable(&j.detail, 200)
                ));
            }
        }
        Ok(())
    }

    /// [`World::check`] within [`STEP_LIMIT`]: a hung check is a violation.
    async fn check_bounded(&mut self) -> Result<(), String> {
        bounded("the check", async { Ok(self.check().await) }).await.unwrap_or_else(|e| Err(format!("{e:#}")))
    }

    /// The invariants, against the simulated nodes' processes.
    async fn check(&mut self) -> Result<(), String> {
        // No GPU used by two live processes.
        let mut owner: BTreeMap<(usize, u32), u64> = BTreeMap::new();
        for (&a, p) in self.processes.iter().filter(|(_, p)| !p.asleep) {
            for &g in &p.gpus {
                if let Some(other) = owner.insert((p.node, g), a) {
                    let (x, y) = (&self.processes[&other], p);
                    return Err(format!(
                        "GPU {g} of sim-{} is used by two live processes: allocation {other} (job {}) and {a} (job {})",
                        p.node, x.job, y.job
                    ));
                }
            }
        }
        let api = self.api.clone().expect("connected");
        let jobs = crate::client::list_all_jobs(api, pb::ListJobsRequest { partition: PARTITION.into(), ..Default::default() }).await.map_err(|e| format!("ListJobs: {e:#}"))?;
        // Every accepted job listed exactly once.
        let mut listed: BTreeMap<u64, &pb::Job> = BTreeMap::new();
        for j in &jobs {
            if listed.insert(j.id, j).is_some() {
                return Err(format!("job {} is listed twice", j.id));
            }
        }
        for &id in self.accepted.keys() {
            if !listed.contains_key(&id) {
                return Err(format!("accepted job {id} is not listed"));
            }
        }
        // Only this run submits: a job listed that it was not told was
        // accepted is one whose submission was refused (or invented).
        if let Some(j) = jobs.iter().find(|j| !self.accepted.contains_key(&j.id)) {
            return Err(format!("job {} ({}) is listed, but its submission was refused", j.id, j.state));
        }
        // Every live process is held for its job by the host, or stopping.
        for (&a, p) in &self.processes {
            // Stopping; or on a node cut off, where no stop can arrive (the
            // host fences its GPUs; the stop goes out when the link is back).
            if p.exits_at_ms.is_some() || self.cut.contains(&p.node) {
                continue;
            }
            let Some(j) = listed.get(&p.job) else { return Err(format!("allocation {a} runs for job {} the host does not list", p.job)) };
            if let Some(Some(at)) = self.accepted.get(&p.job) {
                return Err(format!(
                    "allocation {a} of job {} runs on sim-{} with no stop, after the job's cancel was acknowledged (at {} ms of the run); the host shows it {}",
                    p.job,
                    p.node,
                    at - T0_MS,
                    j.state
                ));
            }
            let held = j.runs.iter().any(|r| r.allocation_id == a && matches!(r.state.as_str(), "starting" | "running" | "sleeping"));
            if !held {
                return Err(format!("allocation {a} of job {} ({}) runs on sim-{} with no stop, and the host does not hold it: {:?}", p.job, j.state, p.node, j.runs));
            }
            if matches!(j.state.as_str(), "cancelled" | "finished" | "failed") {
                return Err(format!("allocation {a} of job {} runs, unstopped, after the job is {}", p.job, j.state));
            }
        }
        // The host found no record of its own inconsistent (it logs and
        // counts those instead of panicking).
        for (what, means) in [("release", "a release of capacity the fleet did not hold"), ("restore", "a stored task holding GPUs another stored record holds")] {
            let breaks = self.live().metrics.invariant_breaks.with_label_values(&[PARTITION, what]).get();
            if breaks > 0 {
                return Err(format!("the host counted {breaks} broken invariants (berth_invariant_breaks_total, {what}): {means}"));
            }
        }
        // The host's fleet accounting is consistent.
        let st = self.live().partitions[0].lock_state();
        st.fleet.check_invariants().map_err(|e| format!("fleet: {e}"))?;
        Ok(())
    }
}

/// A 64-bit mix (SplitMix64): per-allocation delays that do not depend on
/// the order commands arrive in.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Runs `ops` from a fresh host (store in `state_dir/seed-<seed>`), checking
/// after each. The first violation ends it.
pub async fn run(config: &ChaosConfig, seed: u64, ops: &[Op]) -> anyhow::Result<Result<RunStats, Violation>> {
    let dir = config.state_dir.join(format!("seed-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut w = World {
        config: config.clone(),
        seed,
        dir: dir.clone(),
        clock: Arc::new(ManualClock::at(T0_MS)),
        host: None,
        url: String::new(),
        api: None,
        agents: Vec::new(),
        processes: BTreeMap::new(),
        cut: Default::default(),
        unsent: Vec::new(),
        accepted: BTreeMap::new(),
        replicas: Default::default(),
        store_failing: Arc::new(AtomicBool::new(false)),
        writes_refused: Arc::new(AtomicU64::new(0)),
        outage_left: 0,
        store_slow_ms: Arc::new(AtomicU64::new(0)),
        slow_left: 0,
        refusal: Default::default(),
        stats: RunStats::default(),
    };
    bounded("the start", async {
        w.start_host(true).await?;
        for i in 0..config.nodes {
            let a = w.connect_agent(i).await?;
            w.agents.push(a);
        }
        w.settle().await
    })
    .await?;
    let mut outcome = Ok(());
    for (step, op) in ops.iter().enumerate() {
        tracing::debug!(target: "berth::chaos", seed, step, ?op, "operation");
        // A host that stops answering is a broken promise too (liveness):
        // a step that takes longer than any run needs is a violation, not a
        // test that never ends.
        if let Err(e) = bounded("the operation", w.apply(op)).await {
            outcome = Err(Violation { step, what: format!("operation failed: {e:#}") });
            break;
        }
        w.stats.operations += 1;
        let mut judged = w.check_bounded().await;
        if judged.is_err() {
            // A report the host takes in after its pass (a loaded machine)
            // is not a violation: let it settle again, then judge.
            tokio::time::sleep(Duration::from_millis(250)).await;
            judged = match bounded("the check", w.settle()).await {
                Ok(()) => w.check_bounded().await,
                Err(e) => Err(format!("operation failed: {e:#}")),
            };
        }
        if let Err(what) = judged {
            outcome = Err(Violation { step, what });
            break;
        }
    }
    if outcome.is_ok() && !ops.is_empty() {
        // Judged at the last operation: the shortest list that still
        // leaves something stuck ends where it was left.
        let step = ops.len() - 1;
        outcome = match bounded("settling after the run", w.quiesce()).await {
            Ok(()) => match w.check_bounded().await {
                Ok(()) if !w.config.liveness => Ok(()),
                Ok(()) => bounded("the liveness check", async { Ok(w.check_live().await) }).await.unwrap_or_else(|e| Err(format!("{e:#}"))),
                Err(what) => Err(what),
            },
            Err(e) => Err(format!("settling after the run: {e:#}")),
        }
        .map_err(|what| Violation { step, what });
    }
    w.agents.clear();
    w.api = None;
    if let Some(h) = w.host.take()
        && tokio::time::timeout(STEP_LIMIT, h.shutdown()).await.is_err()
        && outcome.is_ok()
    {
        outcome = Err(Violation { step: ops.len().saturating_sub(1), what: format!("the host did not shut down within {} s", STEP_LIMIT.as_secs()) });
    }
    let _ = std::fs::remove_dir_all(&dir);
    w.stats.writes_refused = w.writes_refused.load(Ordering::SeqCst);
    Ok(outcome.map(|()| w.stats))
}

/// Longer than any step of a run needs (one settles within 60 s or fails).
const STEP_LIMIT: Duration = Duration::from_secs(120);

/// `step`, or an error naming it if it has not finished within [`STEP_LIMIT`].
async fn bounded<T>(what: &str, step: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    match tokio::time::timeout(STEP_LIMIT, step).await {
        Ok(r) => r,
        Err(_) => anyhow::bail!("{what} hung: no answer within {} s (a call to the host, or the host's shutdown, never returned)", STEP_LIMIT.as_secs()),
    }
}

/// The shortest list found that still fails: operations removed one at a
/// time, last first, while the run still finds a violation (within `budget`).
pub async fn shrink(config: &ChaosConfig, seed: u64, ops: &[Op], budget: Duration) -> anyhow::Result<Vec<Op>> {
    let started = Instant::now();
    let mut ops = ops.to_vec();
    let mut i = ops.len();
    while i > 0 && started.elapsed() < budget {
        i -= 1;
        let mut fewer = ops.clone();
        fewer.remove(i);
        if let Err(v) = run(config, seed, &fewer).await? {
            fewer.truncate(v.step + 1);
            i = i.min(fewer.len());
            ops = fewer;
        }
    }
    Ok(ops)
}

impl std::fmt::Display for RunStats {
    /// What the operations did, for the soak's and the test's summaries.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} operations: {} jobs submitted, {} processes started, {} preemption notices, {} host restarts, {} agent restarts, {} migrations, {} links cut, {} nodes given up, {} placement and {} rank swaps, {} sleeps and {} wakes asked ({} tasks put to sleep, {} woken), {} compaction steps ({} chains), {} store outages and {} short write refusals ({} writes and {} calls refused in all), {} operations on a slow store",
            self.operations,
            self.submitted,
            self.processes_started,
            self.evictions_seen,
            self.host_restarts,
            self.agent_restarts,
            self.migrations,
            self.links_cut,
            self.nodes_given_up,
            self.policy_swaps,
            self.rank_swaps,
            self.sleeps,
            self.wakes,
            self.tasks_asleep,
            self.tasks_woken,
            self.compactions,
            self.chains_started,
            self.store_outages,
            self.write_refusals,
            self.writes_refused,
            self.calls_refused,
            self.slow_store_ops
        )
    }
}

impl RunStats {
    fn add(&mut self, o: &RunStats) {
        self.operations += o.operations;
        self.submitted += o.submitted;
        self.processes_started += o.processes_started;
        self.evictions_seen += o.evictions_seen;
        self.host_restarts += o.host_restarts;
        self.agent_restarts += o.agent_restarts;
        self.migrations += o.migrations;
        self.links_cut += o.links_cut;
        self.nodes_given_up += o.nodes_given_up;
        self.policy_swaps += o.policy_swaps;
        self.rank_swaps += o.rank_swaps;
        self.sleeps += o.sleeps;
        self.wakes += o.wakes;
        self.tasks_asleep += o.tasks_asleep;
        self.tasks_woken += o.tasks_woken;
        self.compactions += o.compactions;
        self.chains_started += o.chains_started;
        self.slow_store_ops += o.slow_store_ops;
        self.write_refusals += o.write_refusals;
        self.store_outages += o.store_outages;
        self.writes_refused += o.writes_refused;
        self.calls_refused += o.calls_refused;
    }
}

/// The outcome of many seeds.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    /// Summed over the seeds (a failing seed counts its operations).
    pub total: RunStats,
    pub elapsed: Duration,
    /// The first failure: seed, violation, and the shortest list found.
    pub failure: Option<(u64, Violation, Vec<Op>)>,
}

/// Runs seeds `first..` until `seeds` are done or `time` has passed,
/// `parallel` at a time, each lane on its own thread with its own runtime
/// (a host that hangs stalls only its lane, and its steps' time limits
/// still fire); stops starting seeds at the first failure, and shrinks the
/// failure of the lowest failing seed once the others have finished.
pub fn soak(config: &ChaosConfig, first: u64, seeds: u64, time: Duration, parallel: usize) -> anyhow::Result<Summary> {
    use std::sync::Mutex;

    #[derive(Default)]
    struct Shared {
        next: u64,
        summary: Summary,
        failed: Option<(u64, Violation, Vec<Op>)>,
        error: Option<anyhow::Error>,
    }
    let started = Instant::now();
    let end = first.saturating_add(seeds);
    let shared = Mutex::new(Shared { next: first, ..Default::default() });
    let runtime = || tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
    std::thread::scope(|scope| {
        for _ in 0..parallel.max(1) {
            let shared = &shared;
            scope.spawn(move || {
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        shared.lock().unwrap().error.get_or_insert(e.into());
                        return;
                    }
                };
                loop {
                    let seed = {
                        let mut s = shared.lock().unwrap();
                        if s.failed.is_some() || s.error.is_some() || s.next >= end || started.elapsed() >= time {
                            break;
                        }
                        s.next += 1;
                        s.summary.seeds += 1;
                        s.next - 1
                    };
                    let ops = operations(seed, config.operations, config.nodes);
                    let outcome = rt.block_on(run(config, seed, &ops));
                    let mut s = shared.lock().unwrap();
                    match outcome {
                        Ok(Ok(r)) => s.summary.total.add(&r),
                        Ok(Err(v)) => {
                            s.summary.total.operations += v.step + 1;
                            if s.failed.as_ref().is_none_or(|(other, _, _)| seed < *other) {
                                s.failed = Some((seed, v, ops));
                            }
                        }
                        Err(e) => {
                            s.error.get_or_insert(e.context(format!("seed {seed}")));
                        }
                    }
                }
                // A host left hung by a failed run must not keep the soak from reporting.
                rt.shutdown_timeout(Duration::from_secs(10));
            });
        }
    });
    let Shared { summary: mut s, failed, error, .. } = shared.into_inner().unwrap();
    if let Some(e) = error {
        return Err(e);
    }
    if let Some((seed, v, ops)) = failed {
        let rt = runtime()?;
        let shortest = rt.block_on(shrink(config, seed, &ops[..=v.step], Duration::from_secs(120)));
        rt.shutdown_timeout(Duration::from_secs(10));
        s.failure = Some((seed, v, shortest?));
    }
    s.elapsed = started.elapsed();
    Ok(s)
}

impl Summary {
    /// The failure as a report: the seed, what broke, and the operations.
    pub fn failure_report(&self) -> Option<String> {
        let (seed, v, ops) = self.failure.as_ref()?;
        let mut out = format!("seed {seed}: step {}: {}\nshortest reproduction ({} operations):\n", v.step, v.what, ops.len());
        for (i, op) in ops.iter().enumerate() {
            out.push_str(&format!("  {i}: {op:?}\n"));
        }
        Some(out)
    }
}
