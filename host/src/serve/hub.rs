//! The host side of node agents, served by `berth serve` beside the Berth
//! API: registrations, heartbeats and telemetry, GPU health, node
//! reachability, and the command streams that actuate allocations.
//!
//! Agent nodes also join their partition's fleet (`serve::actuation`), so
//! jobs with argv are placed onto them by the partition's policy; the hub
//! is the scheduler's [`Actuator`]: it sends the start and stop commands
//! and feeds exits, health and measured activity back to the fleet.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::serve::state::AgentTopology;
use crate::serve::auth::{check_node_name, Identity, Role};
use crate::proto::{self as pb, agent_hub_server::AgentHub};
use crate::serve::lifecycle::{Report, TaskState};
use crate::serve::state::{Actuator, Beat, Live, Reconciled, Start};

/// Host-side agent settings.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// A node whose last heartbeat is older than this is unreachable.
    pub heartbeat_timeout: Duration,
    /// An allocated GPU counts as productive when its SM utilisation is at
    /// least this (percent).
    pub productive_sm_pct: u32,
    /// How long an unreachable node's jobs wait for it before they are
    /// requeued elsewhere (None: they wait for it forever).
    pub reschedule_after: Option<Duration>,
    /// The host's identity, told to agents when they register (see
    /// [`crate::serve::persist::host_identity`]); empty: none.
    pub host_identity: String,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig { heartbeat_timeout: Duration::from_secs(10), productive_sm_pct: 10, reschedule_after: Some(Duration::from_secs(60)), host_identity: String::new() }
    }
}

struct GpuState {
    info: pb::GpuInfo,
    healthy: bool,
    reason: String,
    last: Option<pb::GpuTelemetry>,
}

/// What one heartbeat changed, for the node's partition.
struct BeatNews {
    /// GPUs newly unhealthy, and GPUs measured active.
    unhealthy: Vec<u32>,
    active: Vec<u32>,
    /// The node's reachability changed: whether it can take work now.
    schedulable: Option<bool>,
    registered_below: Option<u64>,
    /// The node's power state changed: (powered down, command stream held).
    power: Option<(bool, bool)>,
}

struct AgentRecord {
    partition: String,
    source: String,
    session: u64,
    gpus: Vec<GpuState>,
    last_heartbeat: Instant,
    last_heartbeat_unix_ms: u64,
    heartbeats: u64,
    reachable: bool,
    commands: Option<mpsc::Sender<Result<pb::AgentCommand, Status>>>,
    /// Commands put on the current stream: a driver that counts what it
    /// received knows whether any is still in flight.
    sent: u64,
    /// Until the first heartbeat after the registration: allocations
    /// numbered below this, held here, must be in its running list.
    registered_below: Option<u64>,
    /// Orphans already told to stop.
    stopped: std::collections::HashSet<u64>,
    /// Its jobs were requeued after the grace.
    given_up: bool,
    /// Whether it reports itself powered down (None: no beat yet this
    /// session, so the first beat's state is passed on whatever it is).
    powered_down: Option<bool>,
    /// How it confines tasks ("cgroup-v1", "affinity", ...) and its CPUs.
    isolation: String,
    cpus: String,
    /// Its latest contention sample.
    contention: Option<pb::NodeContention>,
}

#[derive(Default)]
struct HubState {
    agents: BTreeMap<String, AgentRecord>,
    /// Which node registered each GPU UUID: a registration's duplicate
    /// check without a scan of every node's GPUs.
    gpu_owner: std::collections::HashMap<String, String>,
    allocations: BTreeMap<u64, pb::AllocationInfo>,
    /// Allocations that stopped holding GPUs, oldest first: listed until
    /// the retention's count of newer ones ended.
    ended: std::collections::VecDeque<u64>,
    next_session: u64,
    /// Per running allocation, its CPU time at the first and the latest
    /// heartbeat that carried it: its average CPU rate over its life here
    /// (steadier than one beat's).
    cpu_seen: std::collections::HashMap<u64, ((Instant, u64), (Instant, u64))>,
}

impl HubState {
    /// Allocation `id` holds no GPUs any more: the oldest ended ones past
    /// `keep` leave the listing.
    fn ended(&mut self, id: u64, keep: usize) {
        self.cpu_seen.remove(&id);
        self.ended.push_back(id);
        while self.ended.len() > keep {
            let Some(old) = self.ended.pop_front() else { break };
            if self.allocations.get(&old).is_some_and(|a| !holds_gpus(&a.state)) {
                self.allocations.remove(&old);
            }
        }
    }
}

/// Thousandths of a core used between the first and the latest samples of
/// an allocation's CPU time (None: under a second apart).
fn average_cpu_milli(&((t0, c0), (t1, c1)): &((Instant, u64), (Instant, u64))) -> Option<u32> {
    let ms = t1.saturating_duration_since(t0).as_millis() as u64;
    (ms >= 1000).then(|| (c1.saturating_sub(c0).saturating_mul(1000) / ms).min(u64::from(u32::MAX)) as u32)
}

/// Allocation states that hold their GPUs (a process not gone).
fn holds_gpus(state: &str) -> bool {
    TaskState::parse(state).is_some_and(|t| !t.is_gone())
}

pub struct Hub {
    live: Arc<Live>,
    config: HubConfig,
    /// Lock order: a partition's state, then this; never the reverse. The
    /// scheduler holds its partition's state while it starts and stops
    /// tasks through the hub, so nothing here calls into `live` while
    /// holding this lock (a report and a pass met in a deadlock that way).
    state: Mutex<HubState>,
    /// The host's model pools, whose executors relay through agents.
    pub pools: std::sync::OnceLock<Arc<crate::serve::pooling::Pools>>,
}

type Reply<T> = Result<Response<T>, Status>;

impl Hub {
    /// What the cgroups of allocations `ids` said they used (latest
    /// heartbeat, or their end) and "oom" where the kernel killed one over
    /// its memory limit; only those the hub still lists.
    pub fn usage_of(&self, ids: impl IntoIterator<Item = u64>) -> std::collections::HashMap<u64, (Option<pb::TaskUsage>, String)> {
        let st = self.state.lock().unwrap();
        ids.into_iter().filter_map(|id| st.allocations.get(&id).map(|a| (id, (a.usage.clone(), a.limit.clone())))).collect()
    }

    pub fn new(live: Arc<Live>, config: HubConfig) -> Arc<Hub> {
        Arc::new(Hub { live, config, state: Mutex::new(HubState { next_session: 1, ..HubState::default() }), pools: Default::default() })
    }

    fn who<T>(&self, req: &Request<T>) -> Result<Identity, Status> {
        Ok(self.live.access.identify(req)?)
    }

    fn require(&self, id: &Identity, partition: &str, role: Role) -> Result<(), Status> {
        // Permission before existence, as in the API.
        id.require(partition, role)?;
        self.live.partition_index(partition)?;
        Ok(())
    }

    /// Marks nodes whose heartbeats stopped as unreachable (logged once per
    /// transition), and gives up those silent past the grace (their jobs
    /// requeued, their GPUs fenced). Runs every quarter of the timeout, and
    /// before node listings. Returns how many nodes it gave up.
    pub fn sweep(&self) -> usize {
        let (mut lost, mut give_up) = (Vec::new(), Vec::new());
        {
            let mut st = self.state.lock().unwrap();
            // The host's clock: a simulation moves it by hand, and nodes
            // go silent on it, not on the machine's.
            let now = self.live.clock.now();
            for (name, a) in st.agents.iter_mut() {
                let silent = now.duration_since(a.last_heartbeat);
                if silent > self.config.heartbeat_timeout && a.reachable {
                    a.reachable = false;
                    tracing::warn!(target: "berth::agent", node = %name, "node unreachable: no heartbeat for {:?}", self.config.heartbeat_timeout);
                    lost.push((a.partition.clone(), name.clone()));
                }
                if let Some(grace) = self.config.reschedule_after
                    && !a.reachable
                    && !a.given_up
                    && silent > self.config.heartbeat_timeout + grace
                {
                    a.given_up = true;
                    give_up.push((a.partition.clone(), name.clone(), silent));
                }
            }
        }
        // The fleet is told after the hub's lock is dropped (the scheduler
        // holds a partition's lock while it calls the hub).
        for (partition, node) in lost {
            self.live.agent_node_schedulable(&partition, &node, false);
        }
        let given_up = give_up.len();
        for (partition, node, silent) in give_up {
            let jobs = self.live.give_up_node(&partition, &node, &format!("node {node} unreachable for {:.1} s", silent.as_secs_f64()));
            if !jobs.is_empty() {
                tracing::warn!(target: "berth::agent", node = %node, ?jobs, "node given up: jobs requeued, its GPUs fenced until it returns");
            }
        }
        given_up
    }

    /// Ends every agent's command stream (the host is stopping; an agent
    /// reconnects to whoever serves next).
    pub fn close_command_streams(&self) {
        let mut st = self.state.lock().unwrap();
        for a in st.agents.values_mut() {
            a.commands = None;
        }
    }

    /// Spawns the sweeper on the current runtime; it stops with `stop`.
    pub fn spawn_sweeper(self: &Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let hub = self.clone();
        let period = (self.config.heartbeat_timeout / 4).max(Duration::from_millis(20));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(period) => {
                        crate::util::may_block(|| hub.sweep());
                    }
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    }

    /// Reachability ("ready", "unreachable") and unhealthy GPU count of
    /// every agent node, for `ListNodes`.
    pub fn node_states(&self) -> BTreeMap<String, (String, u32)> {
        self.sweep();
        let st = self.state.lock().unwrap();
        st.agents
            .iter()
            .map(|(name, a)| (name.clone(), (if a.reachable { "ready" } else { "unreachable" }.to_string(), a.gpus.iter().filter(|g| !g.healthy).count() as u32)))
            .collect()
    }

    /// The partition of agent node `node`, if `id` may act as it. A caller
    /// that could act as that name nowhere is refused before any lookup; one
    /// whose role is in another partition than the node's gets the answer a
    /// missing node gets, so neither learns what exists.
    fn agent_node_partition(&self, id: &Identity, node: &str) -> Result<String, Status> {
        check_node_name(node).map_err(Status::invalid_argument)?;
        if !id.could_act_as_node(node) {
            return Err(denied_node(id, node));
        }
        let partition = self.state.lock().unwrap().agents.get(node).map(|a| a.partition.clone());
        match partition {
            Some(p) if id.may_act_as_node(&p, node) => Ok(p),
            _ => Err(Status::not_found(format!("no agent node {node} that {} may act as", id.name))),
        }
    }

    /// The partition of an agent node, for the hub's own bookkeeping.
    fn agent_partition(&self, node: &str) -> Result<String, Status> {
        let st = self.state.lock().unwrap();
        st.agents.get(node).map(|a| a.partition.clone()).ok_or_else(|| Status::not_found(format!("no agent node {}", crate::text::printable(node, 64))))
    }

    /// Records a registration; returns the reply and the GPUs that keep an
    /// unhealthy mark from before.
    fn register_locked(&self, r: pb::RegisterAgentRequest, id: &Identity, registered_below: u64) -> (pb::RegisterAgentResponse, Vec<u32>) {
        let mut st = self.state.lock().unwrap();
        let session = st.next_session;
        st.next_session += 1;
        let mut gpus = r.gpus.into_iter().map(|info| GpuState { info, healthy: true, reason: String::new(), last: None }).collect::<Vec<_>>();
        // A node re-registering keeps the health marks of GPUs it still has.
        if let Some(p) = st.agents.remove(&r.node) {
            for g in &p.gpus {
                if st.gpu_owner.get(&g.info.uuid).is_some_and(|owner| *owner == r.node) {
                    st.gpu_owner.remove(&g.info.uuid);
                }
            }
            for g in gpus.iter_mut() {
                if let Some(old) = p.gpus.iter().find(|o| o.info.uuid == g.info.uuid && !o.healthy) {
                    g.healthy = false;
                    g.reason = old.reason.clone();
                }
            }
        }
        for g in &gpus {
            st.gpu_owner.insert(g.info.uuid.clone(), r.node.clone());
        }
        let unhealthy = gpus.iter().filter(|g| !g.healthy).map(|g| g.info.index).collect();
        tracing::info!(target: "berth::agent", node = %r.node, partition = %r.partition, gpus = gpus.len(), source = %r.source, by = %id.name, "agent registered");
        st.agents.insert(
            r.node.clone(),
            AgentRecord {
                partition: r.partition,
                source: r.source,
                session,
                gpus,
                last_heartbeat: self.live.clock.now(),
                last_heartbeat_unix_ms: self.live.clock.unix_ms(),
                heartbeats: 0,
                reachable: true,
                commands: None,
                sent: 0,
                registered_below: Some(registered_below),
                stopped: Default::default(),
                given_up: false,
                powered_down: None,
                isolation: r.isolation,
                cpus: r.cpus,
                contention: None,
            },
        );
        (pb::RegisterAgentResponse { session, heartbeat_timeout_ms: self.config.heartbeat_timeout.as_millis() as u64, host_identity: self.config.host_identity.clone() }, unhealthy)
    }

    /// Records a heartbeat; returns what the partition must learn of it.
    fn heartbeat_locked(&self, r: &pb::HeartbeatRequest) -> Result<BeatNews, Status> {
        let mut st = self.state.lock().unwrap();
        let a = st.agents.get_mut(&r.node).ok_or_else(|| Status::not_found(format!("no agent node {:?}", r.node)))?;
        if a.session != r.session {
            return Err(Status::not_found(format!("session {} of node {} is over: register again", r.session, r.node)));
        }
        let mut schedulable = None;
        if !a.reachable {
            tracing::info!(target: "berth::agent", node = %r.node, "node reachable again");
            schedulable = Some(a.commands.as_ref().is_some_and(|c| !c.is_closed()));
        }
        a.last_heartbeat = self.live.clock.now();
        a.last_heartbeat_unix_ms = self.live.clock.unix_ms();
        a.heartbeats += 1;
        a.reachable = true;
        a.given_up = false;
        let registered_below = a.registered_below.take();
        let mut power = None;
        if a.powered_down != Some(r.powered_down) {
            a.powered_down = Some(r.powered_down);
            power = Some((r.powered_down, a.commands.as_ref().is_some_and(|c| !c.is_closed())));
        }
        let (mut unhealthy, mut active) = (Vec::new(), Vec::new());
        for t in &r.gpus {
            let Some(g) = a.gpus.iter_mut().find(|g| g.info.index == t.index) else { continue };
            if let Some(e) = t.events.first()
                && g.healthy
            {
                g.healthy = false;
                g.reason = format!("{} {}: {}", e.kind, e.code, e.detail);
                tracing::warn!(target: "berth::agent", node = %r.node, gpu = g.info.index, uuid = %g.info.uuid, "GPU unhealthy: {}", g.reason);
                unhealthy.push(t.index);
            }
            if t.sm_util_pct >= self.config.productive_sm_pct {
                active.push(t.index);
            }
            g.last = Some(t.clone());
        }
        a.contention = r.contention.clone();
        // Each task's use, kept with its allocation (this node's only).
        let now = Instant::now();
        for u in &r.tasks {
            if let Some(alloc) = st.allocations.get_mut(&u.allocation_id).filter(|x| x.node == r.node) {
                alloc.usage = Some(u.clone());
                let seen = st.cpu_seen.entry(u.allocation_id).or_insert(((now, u.cpu_ms), (now, u.cpu_ms)));
                seen.1 = (now, u.cpu_ms);
            }
        }
        Ok(BeatNews { unhealthy, active, schedulable, registered_below, power })
    }

    fn send(&self, node: &str, cmd: pb::AgentCommand) -> Result<(), Status> {
        let mut st = self.state.lock().unwrap();
        let a = st.agents.get_mut(node).ok_or_else(|| Status::not_found(format!("no agent node {node:?}")))?;
        if !a.reachable {
            return Err(Status::failed_precondition(format!("node {node} is unreachable")));
        }
        let tx = a.commands.as_ref().ok_or_else(|| Status::failed_precondition(format!("node {node} holds no command stream")))?;
        // Never waits: a full stream is an undelivered command.
        tx.try_send(Ok(cmd)).map_err(|e| Status::unavailable(format!("node {node}: command not delivered: {e}")))?;
        a.sent += 1;
        Ok(())
    }

    /// Records a held allocation and sends its start command; on a failed
    /// send the allocation ends failed (its hold released).
    fn dispatch_start(&self, alloc: pb::AllocationInfo, cmd: pb::AgentCommand) -> Result<(), Status> {
        let id = alloc.id;
        let node = alloc.node.clone();
        self.state.lock().unwrap().allocations.insert(id, alloc);
        if let Err(e) = self.send(&node, cmd) {
            {
                let mut st = self.state.lock().unwrap();
                if let Some(a) = st.allocations.get_mut(&id) {
                    a.state = "failed".into();
                    a.detail = e.message().to_string();
                    st.ended(id, self.live.retention.ended_allocations);
                }
            }
            self.live.task_report(id, Report::State(TaskState::Failed), -1, 0, e.message(), None);
            return Err(e);
        }
        Ok(())
    }

    /// The UUIDs of GPUs `gpus` of agent node `node`, each of which must
    /// exist and be healthy.
    fn healthy_gpu_uuids(&self, node: &str, gpus: &[u32]) -> Result<Vec<String>, Status> {
        let st = self.state.lock().unwrap();
        let a = st.agents.get(node).ok_or_else(|| Status::not_found(format!("no agent node {node:?}")))?;
        let mut uuids = Vec::new();
        for &g in gpus {
            let gpu = a.gpus.iter().find(|x| x.info.index == g).ok_or_else(|| Status::invalid_argument(format!("node {node} has no GPU {g}")))?;
            if !gpu.healthy {
                return Err(Status::failed_precondition(format!("GPU {g} of node {node} is unhealthy ({})", gpu.reason)));
            }
            uuids.push(gpu.info.uuid.clone());
        }
        Ok(uuids)
    }

    /// The agent node and partition of allocation `id`, when a pool
    /// started it.
    fn executor_of(&self, id: u64) -> Option<(String, String)> {
        let st = self.state.lock().unwrap();
        let a = st.allocations.get(&id).filter(|a| a.started_by == crate::serve::pooling::POOL_STARTER && holds_gpus(&a.state))?;
        Some((a.node.clone(), st.agents.get(&a.node)?.partition.clone()))
    }

    /// Commands sent to `node` on the stream of `session` (none if that
    /// session is over or holds no stream).
    pub fn commands_sent(&self, node: &str, session: u64) -> Option<u64> {
        let st = self.state.lock().unwrap();
        st.agents.get(node).filter(|a| a.session == session && a.commands.is_some()).map(|a| a.sent)
    }
}

/// Longest detail of an agent's report kept, in bytes (escaped).
const MAX_REPORT_DETAIL: usize = 1024;

/// The refusal of a caller that may not act as agent node `node` (a
/// validated name): it says nothing of whether the node exists.
fn denied_node(id: &Identity, node: &str) -> Status {
    tracing::warn!(target: "berth::serve::auth", identity = %id.name, node, "denied: not an agent of this node");
    Status::permission_denied(format!("{} may not act as agent node {node}: that needs an agent identity naming it, or the operator role", id.name))
}

/// Longest text field an agent may send (model, UUID, PCI id, event kind
/// and detail, source, version), in bytes.
pub const MAX_AGENT_FIELD_BYTES: usize = 256;
/// Most GPUs in a registration or a heartbeat.
pub const MAX_AGENT_GPUS: usize = berth_core::MAX_GPUS_PER_NODE;
/// Most NVLink peers of a GPU, health events per GPU in one heartbeat, and
/// allocations reported running.
pub const MAX_AGENT_LIST: usize = 4096;

fn field(name: &str, value: &str) -> Result<(), Status> {
    if value.len() > MAX_AGENT_FIELD_BYTES {
        return Err(Status::invalid_argument(format!("{name} is {} bytes: at most {MAX_AGENT_FIELD_BYTES}", value.len())));
    }
    Ok(())
}

fn list(name: &str, len: usize, max: usize) -> Result<(), Status> {
    if len > max {
        return Err(Status::invalid_argument(format!("{name} has {len} entries: at most {max}")));
    }
    Ok(())
}

/// Size bounds of a registration: what the hub keeps per node.
fn check_registration(r: &pb::RegisterAgentRequest) -> Result<(), Status> {
    field("source", &r.source)?;
    field("agent_version", &r.agent_version)?;
    // Shown in listings as sent: one of the known names, a plain CPU list.
    if !["", "cgroup-v2", "cgroup-v1", "affinity", "none"].contains(&r.isolation.as_str()) {
        return Err(Status::invalid_argument(format!("isolation \"{}\": one of cgroup-v2, cgroup-v1, affinity, none", crate::text::printable(&r.isolation, 32))));
    }
    field("cpus", &r.cpus)?;
    if !r.cpus.bytes().all(|b| b.is_ascii_digit() || b == b',' || b == b'-') {
        return Err(Status::invalid_argument(format!("cpus \"{}\": a CPU list such as 0-3,6", crate::text::printable(&r.cpus, 32))));
    }
    list("gpus", r.gpus.len(), MAX_AGENT_GPUS)?;
    for (i, g) in r.gpus.iter().enumerate() {
        field("gpus.uuid", &g.uuid)?;
        field("gpus.model", &g.model)?;
        // Printed in listings and logs, and a key of the fleet's models.
        let plain = |s: &str, extra: &[u8]| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b) || extra.contains(&b));
        if !plain(&g.model, b" ()+") || g.model.starts_with(' ') || g.model.ends_with(' ') {
            return Err(Status::invalid_argument(format!(
                "gpus[{i}].model \"{}\": letters, digits, spaces and -_.()+ only",
                crate::text::printable(&g.model, 64)
            )));
        }
        if !plain(&g.uuid, b"") {
            return Err(Status::invalid_argument(format!("gpus[{i}].uuid \"{}\": letters, digits and -_. only", crate::text::printable(&g.uuid, 64))));
        }
        if r.gpus[..i].iter().any(|o| o.uuid == g.uuid) {
            return Err(Status::invalid_argument(format!("gpus[{i}].uuid {} appears twice", g.uuid)));
        }
        field("gpus.pci_bus_id", &g.pci_bus_id)?;
        list("gpus.nvlink_peers", g.nvlink_peers.len(), MAX_AGENT_GPUS)?;
        for p in &g.nvlink_peers {
            field("gpus.nvlink_peers", p)?;
        }
    }
    Ok(())
}

/// Size bounds of a heartbeat: its telemetry is kept until the next one.
fn check_heartbeat(r: &pb::HeartbeatRequest) -> Result<(), Status> {
    list("gpus", r.gpus.len(), MAX_AGENT_GPUS)?;
    list("running", r.running.len(), MAX_AGENT_LIST)?;
    list("tasks", r.tasks.len(), MAX_AGENT_LIST)?;
    if let Some(c) = &r.contention {
        for (name, p) in [("cpu", &c.cpu), ("memory", &c.memory), ("io", &c.io)] {
            if let Some(p) = p
                && [p.some_avg10, p.some_avg60, p.full_avg10].iter().any(|v| !v.is_finite() || !(0.0..=100.0).contains(v))
            {
                return Err(Status::invalid_argument(format!("contention.{name}: pressure averages are percentages (0-100)")));
            }
        }
    }
    for g in &r.gpus {
        list("gpus.events", g.events.len(), 64)?;
        for e in &g.events {
            field("gpus.events.kind", &e.kind)?;
            field("gpus.events.detail", &e.detail)?;
        }
    }
    Ok(())
}

impl crate::serve::pooling::ExecutorHost for Hub {
    /// A partition's agent nodes that take commands, each with its healthy
    /// GPUs no allocation holds.
    fn free_agent_gpus(&self, partition: &str) -> Vec<(String, Vec<u32>)> {
        let st = self.state.lock().unwrap();
        let held: std::collections::HashSet<(&str, u32)> =
            st.allocations.values().filter(|a| holds_gpus(&a.state)).flat_map(|a| a.gpus.iter().map(move |&g| (a.node.as_str(), g))).collect();
        st.agents
            .iter()
            .filter(|(_, a)| a.partition == partition && a.reachable && a.commands.is_some() && a.powered_down != Some(true))
            .map(|(n, a)| (n.clone(), a.gpus.iter().filter(|g| g.healthy && !held.contains(&(n.as_str(), g.info.index))).map(|g| g.info.index).collect()))
            .collect()
    }

    /// Starts a pool executor on `gpus` of agent node `node`: held in the
    /// fleet first (one owner per GPU), then the agent's start command.
    fn start_executor(&self, partition: &str, node: &str, gpus: &[u32]) -> Result<u64, Status> {
        let uuids = self.healthy_gpu_uuids(node, gpus)?;
        let id = self.live.hold_manual(partition, node, gpus)?;
        let alloc = pb::AllocationInfo {
            id,
            node: node.to_string(),
            gpus: gpus.to_vec(),
            gpu_uuids: uuids.clone(),
            argv: vec!["berth".into(), "executor".into()],
            state: "starting".into(),
            started_by: crate::serve::pooling::POOL_STARTER.into(),
            ..Default::default()
        };
        let cmd = pb::AgentCommand { allocation_id: id, action: "start".into(), gpu_uuids: uuids, executor: true, ..Default::default() };
        self.dispatch_start(alloc, cmd)?;
        Ok(id)
    }

    /// Whether allocation `id` is listed and still holds its GPUs.
    fn allocation_holds(&self, id: u64) -> bool {
        self.state.lock().unwrap().allocations.get(&id).is_some_and(|a| holds_gpus(&a.state))
    }
}

type CommandStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::AgentCommand, Status>> + Send>>;
type ExecutorStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ExecutorFrame, Status>> + Send>>;

#[tonic::async_trait]
impl AgentHub for Arc<Hub> {
    async fn register(&self, req: Request<pb::RegisterAgentRequest>) -> Reply<pb::RegisterAgentResponse> {
        let hub = self.clone();
        crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let r = req.into_inner();
            check_node_name(&r.node).map_err(Status::invalid_argument)?;
            // Permission before existence: the partition's name is the caller's.
            if !id.may_act_as_node(&r.partition, &r.node) {
                return Err(denied_node(&id, &r.node));
            }
            hub.live.partition_index(&r.partition)?;
            check_registration(&r)?;
            {
                let st = hub.state.lock().unwrap();
                let taken = r.gpus.iter().find_map(|g| st.gpu_owner.get(&g.uuid).filter(|owner| **owner != r.node).map(|owner| (owner.clone(), g.uuid.clone())));
                if let Some((other, uuid)) = taken {
                    return Err(Status::already_exists(format!("node {}: GPU {uuid} is registered by node {other}", r.node)));
                }
            }
            let model = r.gpus.first().map_or("cpu-only", |g| g.model.as_str());
            if r.gpus.iter().any(|g| g.model != model) {
                return Err(Status::invalid_argument(format!("node {}: GPUs of more than one model", r.node)));
            }
            if r.gpus.iter().enumerate().any(|(i, g)| g.index as usize != i) {
                return Err(Status::invalid_argument(format!("node {}: GPU indexes must be 0..{}", r.node, r.gpus.len())));
            }
            let topology = AgentTopology { switch_domain: r.switch_domain, aggregation: r.aggregation };
            hub.live.agent_node_up(&r.partition, &r.node, model, r.gpus.len(), r.cpu_milli, r.memory_mib, topology)?;
            let (partition, node) = (r.partition.clone(), r.node.clone());
            let mark = hub.live.registration_mark();
            let response = hub.register_locked(r, &id, mark);
            // Until its command stream is held, the node takes no work.
            hub.live.agent_node_schedulable(&partition, &node, false);
            for g in response.1 {
                hub.live.agent_gpu_unhealthy(&partition, &node, g);
            }
            Ok(Response::new(response.0))
        }).await
    }

    async fn heartbeat(&self, req: Request<pb::HeartbeatRequest>) -> Reply<pb::HeartbeatResponse> {
        // Short locks only (the hub's, the beat queue's): run on the async
        // worker. A fleet's heartbeats are most of the host's calls, and
        // handing a worker's tasks to another thread per call costs more
        // than the call.
        let id = self.who(&req)?;
        let r = req.into_inner();
        let partition = self.agent_node_partition(&id, &r.node)?;
        check_heartbeat(&r)?;
        let BeatNews { unhealthy, active, schedulable, registered_below, power } = self.heartbeat_locked(&r)?;
        if let Some(c) = &r.contention {
            let m = &self.live.metrics;
            for (resource, p) in [("cpu", &c.cpu), ("memory", &c.memory), ("io", &c.io)] {
                if let Some(p) = p {
                    m.node_pressure.with_label_values(&[partition.as_str(), r.node.as_str(), resource]).set(f64::from(p.some_avg10) / 100.0);
                }
            }
            m.node_task_cores.with_label_values(&[partition.as_str(), r.node.as_str(), "all"]).set(f64::from(c.tasks_cpu_milli) / 1000.0);
            m.node_task_cores.with_label_values(&[partition.as_str(), r.node.as_str(), "cpu_only"]).set(f64::from(c.cpu_only_cpu_milli) / 1000.0);
        }
        if schedulable.is_some() || !unhealthy.is_empty() || power.is_some() {
            // A node back, a GPU newly unhealthy, a node powered down or
            // up: rare, taken in now (the partition's lock may be held by a
            // pass).
            crate::util::may_block(|| {
                if let Some((down, reachable)) = power {
                    self.live.agent_node_power(&partition, &r.node, down, reachable);
                }
                if let Some(on) = schedulable {
                    self.live.agent_node_schedulable(&partition, &r.node, on);
                }
                for g in unhealthy {
                    self.live.agent_gpu_unhealthy(&partition, &r.node, g);
                }
            });
        }
        // What the node runs against what the fleet holds there (adopt the
        // known, stop the orphans, end what is gone) is reconciled by the
        // partition's scheduler between passes: the reply never waits for a
        // pass.
        let measured = r.contention.as_ref().map(measured);
        self.live.beat(&partition, Beat { node: r.node, running: r.running, active, registered_below, measured });
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    type CommandsStream = CommandStream;
    type ExecutorStream = ExecutorStream;

    async fn executor(&self, req: Request<tonic::Streaming<pb::ExecutorFrame>>) -> Reply<Self::ExecutorStream> {
        let id = self.who(&req)?;
        let mut up = req.into_inner();
        let first = up.message().await?.ok_or_else(|| Status::invalid_argument("an executor stream opens with a frame naming its allocation"))?;
        check_node_name(&first.node).map_err(Status::invalid_argument)?;
        // One answer for a missing executor and one the caller may not relay.
        let refused = || Status::not_found(format!("no pool executor {} on node {} that {} may relay", first.allocation_id, first.node, id.name));
        let (node, partition) = self.executor_of(first.allocation_id).ok_or_else(refused)?;
        if node != first.node || !id.may_act_as_node(&partition, &node) {
            return Err(refused());
        }
        let pool = self.pools.get().and_then(|p| p.by_executor(first.allocation_id)).cloned().ok_or_else(refused)?;
        let (tx, rx) = mpsc::unbounded_channel();
        pool.attach(first.allocation_id, tx).map_err(Status::failed_precondition)?;
        let live = self.live.clone();
        let alloc = first.allocation_id;
        tokio::spawn(async move {
            loop {
                match up.message().await {
                    Ok(Some(f)) => {
                        if let Some((digest, why)) = pool.on_line(&live, alloc, &f.line) {
                            // Off the async workers: a trip writes the registry.
                            let (pool, live) = (pool.clone(), live.clone());
                            let _ = tokio::task::spawn_blocking(move || pool.trip_step(&live, &digest, &why)).await;
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            pool.detach(&live, alloc);
            tracing::info!(target: "berth::pool", allocation = alloc, "executor relay ended");
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)) as ExecutorStream))
    }

    async fn commands(&self, req: Request<pb::CommandsRequest>) -> Reply<Self::CommandsStream> {
        let hub = self.clone();
        crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let r = req.into_inner();
            let partition = hub.agent_node_partition(&id, &r.node)?;
            let (tx, rx) = mpsc::channel(64);
            let reachable = {
                let mut st = hub.state.lock().unwrap();
                let a = st.agents.get_mut(&r.node).ok_or_else(|| Status::not_found(format!("no agent node {:?}", r.node)))?;
                if a.session != r.session {
                    return Err(Status::not_found(format!("session {} of node {} is over: register again", r.session, r.node)));
                }
                a.commands = Some(tx);
                a.sent = 0;
                a.reachable
            };
            // Commands can reach it now: it may take work.
            hub.live.agent_node_schedulable(&partition, &r.node, reachable);
            Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as Self::CommandsStream))
        }).await
    }

    async fn report_allocation(&self, req: Request<pb::AllocationReport>) -> Reply<pb::AllocationReportResponse> {
        let hub = self.clone();
        let (taken, taken_in) = tokio::sync::oneshot::channel();
        let reply = crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let mut r = req.into_inner();
            // A node not registered (yet: a restarted host) is not told the
            // allocation is unknown, which would make its agent drop the
            // report: the task's end would be lost and the job run again.
            let partition = hub.agent_node_partition(&id, &r.node).map_err(|s| {
                if s.code() == tonic::Code::NotFound { Status::failed_precondition(format!("{}: register, then report", s.message())) } else { s }
            })?;
            // Only states the host knows are taken in; the detail is kept
            // printable and bounded (it is shown to the job's viewers).
            let report = Report::parse(&r.state)
                .ok_or_else(|| Status::invalid_argument(format!("state \"{}\": one of {}", crate::text::printable(&r.state, 32), Report::names())))?;
            r.detail = crate::text::printable(&r.detail, MAX_REPORT_DETAIL).into_owned();
            // One count per GPU of the task, at most a node's GPUs.
            list("gpu_memory_used_mib", r.gpu_memory_used_mib.len(), MAX_AGENT_GPUS)?;
            // Started before this host (re)started: the fleet knows it, the hub
            // learns it now. Looked up before the hub's lock is taken.
            let known = hub.state.lock().unwrap().allocations.contains_key(&r.allocation_id);
            let found = if known { None } else { hub.live.allocation_node(r.allocation_id).filter(|(node, _)| *node == r.node) };
            {
                let mut st = hub.state.lock().unwrap();
                let a = match (st.allocations.entry(r.allocation_id), found) {
                    (std::collections::btree_map::Entry::Occupied(o), _) => o.into_mut(),
                    (std::collections::btree_map::Entry::Vacant(slot), Some((node, gpus))) => {
                        slot.insert(pb::AllocationInfo { id: r.allocation_id, node, gpus, state: "running".into(), ..Default::default() })
                    }
                    (std::collections::btree_map::Entry::Vacant(_), None) => {
                        return Err(Status::not_found(format!("no allocation {} on node {}", r.allocation_id, r.node)));
                    }
                };
                // Another node's allocation: answered as a missing one.
                if a.node != r.node {
                    return Err(Status::not_found(format!("no allocation {} on node {}", r.allocation_id, r.node)));
                }
                if report == Report::Progress {
                    tracing::debug!(target: "berth::agent", allocation = a.id, node = %r.node, work_units = r.work_units, "progress report");
                } else {
                    tracing::info!(target: "berth::agent", allocation = a.id, node = %r.node, state = %r.state, exit_code = r.exit_code, signal = r.signal, "allocation report");
                }
                // A checkpoint, readiness or progress report leaves the
                // task's state as it was.
                if let Report::State(_) = report {
                    a.state = r.state.clone();
                }
                if r.pid != 0 {
                    a.pid = r.pid;
                }
                a.exit_code = r.exit_code;
                a.signal = r.signal;
                a.detail = r.detail.clone();
                if r.usage.is_some() {
                    a.usage = r.usage.clone();
                }
                if r.limit == "oom" && a.limit != "oom" {
                    a.limit = r.limit.clone();
                    hub.live.metrics.oom_kills.with_label_values(&[partition.as_str()]).inc();
                }
                if !holds_gpus(&a.state) {
                    st.ended(r.allocation_id, hub.live.retention.ended_allocations);
                }
            }
            // An exit frees the GPUs in the fleet (and may end the job).
            let stopped = r.stopped.then_some(super::state::Stopped { to_exit_ms: r.stop_to_exit_ms, killed: r.killed });
            let queued = super::state::QueuedReport {
                alloc_id: r.allocation_id,
                report,
                exit_code: r.exit_code,
                signal: r.signal,
                detail: r.detail,
                stopped,
                work_units: r.work_units,
                work_checkpointed: r.work_checkpointed,
                gpu_memory_held_mib: r.gpu_memory_used_mib.iter().copied().max().unwrap_or(0),
                taken: Some(taken),
            };
            hub.live.queue_report(&partition, queued);
            Ok(Response::new(pb::AllocationReportResponse {}))
        }).await?;
        // Answered once the report is in the partition's state (an end
        // stored): the agent forgets an acknowledged exit, and a host that
        // stopped first must not have it lost. Waited for here, not on a
        // thread.
        taken_in.await.map_err(|_| Status::unavailable("the host stopped before taking the report in: send it again"))?;
        Ok(reply)
    }

    async fn list_agents(&self, req: Request<pb::ListAgentsRequest>) -> Reply<pb::ListAgentsResponse> {
        let hub = self.clone();
        crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let want = req.into_inner().partition;
            if !want.is_empty() {
                hub.require(&id, &want, Role::Viewer)?;
            }
            hub.sweep();
            let st = hub.state.lock().unwrap();
            let visible = |p: &str| (want.is_empty() || want == p) && id.can_view(p);
            let mut holder: BTreeMap<(&str, u32), u64> = BTreeMap::new();
            for a in st.allocations.values().filter(|a| holds_gpus(&a.state)) {
                for &g in &a.gpus {
                    holder.insert((a.node.as_str(), g), a.id);
                }
            }
            let agents = st
                .agents
                .iter()
                .filter(|(_, a)| visible(&a.partition))
                .map(|(name, a)| pb::AgentInfo {
                    node: name.clone(),
                    partition: a.partition.clone(),
                    source: a.source.clone(),
                    state: if a.reachable { "ready" } else { "unreachable" }.into(),
                    last_heartbeat_unix_ms: a.last_heartbeat_unix_ms,
                    heartbeats: a.heartbeats,
                    contention: a.contention.clone(),
                    isolation: a.isolation.clone(),
                    cpus: a.cpus.clone(),
                    commands_connected: a.commands.as_ref().is_some_and(|c| !c.is_closed()),
                    gpus: a
                        .gpus
                        .iter()
                        .map(|g| pb::GpuStatus {
                            info: Some(g.info.clone()),
                            healthy: g.healthy,
                            unhealthy_reason: g.reason.clone(),
                            last: g.last.clone(),
                            allocation_id: holder.get(&(name.as_str(), g.info.index)).copied().unwrap_or(0),
                        })
                        .collect(),
                })
                .collect();
            let allocations = st
                .allocations
                .values()
                .filter(|al| st.agents.get(&al.node).is_some_and(|a| visible(&a.partition)))
                .cloned()
                .collect();
            Ok(Response::new(pb::ListAgentsResponse { agents, allocations }))
        }).await
    }

    async fn start_allocation(&self, req: Request<pb::StartAllocationRequest>) -> Reply<pb::StartAllocationResponse> {
        let hub = self.clone();
        crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let r = req.into_inner();
            check_node_name(&r.node).map_err(Status::invalid_argument)?;
            if !id.is_operator_somewhere() {
                return Err(Status::permission_denied(format!("{} holds the operator role nowhere; starting an allocation needs it", id.name)));
            }
            let partition = hub.state.lock().unwrap().agents.get(&r.node).map(|a| a.partition.clone());
            let partition = match partition {
                Some(p) if id.role_in(&p) == Some(Role::Operator) => p,
                _ => return Err(Status::not_found(format!("no agent node {} where {} is an operator", r.node, id.name))),
            };
            crate::serve::bounds::check_task_command(&r.argv, &r.env).map_err(Status::invalid_argument)?;
            let uuids = hub.healthy_gpu_uuids(&r.node, &r.gpus)?;
            // No GPU ever has two owners: the fleet holds them (or says who does).
            let id_ = hub.live.hold_manual(&partition, &r.node, &r.gpus)?;
            let alloc = pb::AllocationInfo {
                id: id_,
                node: r.node.clone(),
                gpus: r.gpus.clone(),
                gpu_uuids: uuids.clone(),
                argv: r.argv.clone(),
                state: "starting".into(),
                started_by: id.name.clone(),
                ..Default::default()
            };
            let cmd = pb::AgentCommand { allocation_id: id_, action: "start".into(), argv: r.argv, gpu_uuids: uuids, env: r.env, ..Default::default() };
            hub.dispatch_start(alloc.clone(), cmd)?;
            tracing::info!(target: "berth::agent", allocation = alloc.id, node = %alloc.node, gpus = ?alloc.gpus, by = %id.name, "allocation sent");
            Ok(Response::new(pb::StartAllocationResponse { allocation_id: alloc.id, gpu_uuids: alloc.gpu_uuids }))
        }).await
    }

    async fn control_allocation(&self, req: Request<pb::ControlAllocationRequest>) -> Reply<pb::ControlAllocationResponse> {
        let hub = self.clone();
        crate::util::off_worker(move || {
            let id = hub.who(&req)?;
            let r = req.into_inner();
            if !matches!(r.action.as_str(), "stop" | "sleep" | "wake" | "checkpoint") {
                return Err(Status::invalid_argument(format!("action \"{}\": one of stop, sleep, wake, checkpoint", crate::text::printable(&r.action, 32))));
            }
            if !id.is_operator_somewhere() {
                return Err(Status::permission_denied(format!("{} holds the operator role nowhere; controlling an allocation needs it", id.name)));
            }
            // A missing allocation and one the caller may not control get the
            // same answer; whether it ended is told only to its operators.
            let missing = || Status::not_found(format!("no allocation {} where {} is an operator", r.allocation_id, id.name));
            let (node, state) = {
                let st = hub.state.lock().unwrap();
                let a = st.allocations.get(&r.allocation_id).ok_or_else(missing)?;
                (a.node.clone(), a.state.clone())
            };
            let partition = hub.agent_partition(&node).map_err(|_| missing())?;
            if id.role_in(&partition) != Some(Role::Operator) {
                return Err(missing());
            }
            if !holds_gpus(&state) {
                return Err(Status::failed_precondition(format!("allocation {} is {state}", r.allocation_id)));
            }
            // A harvested job's task sleeps and wakes through the engine (a
            // sleeper's GPUs are lent): a direct wake would run the replica
            // beside the borrower of its GPUs.
            if matches!(r.action.as_str(), "sleep" | "wake")
                && let Some(job) = hub.live.harvested_job_of(&partition, r.allocation_id)
            {
                return Err(Status::failed_precondition(format!(
                    "allocation {} is a task of job {job}, which harvesting manages: its sleep and wake follow the partition's harvest schedule (berth sleep / berth wake), not direct controls",
                    r.allocation_id
                )));
            }
            hub.send(&node, pb::AgentCommand { allocation_id: r.allocation_id, action: r.action, ..Default::default() })?;
            Ok(Response::new(pb::ControlAllocationResponse {}))
        }).await
    }
}

/// The scheduler starts and stops job tasks through the hub.
impl Actuator for Hub {
    fn start(&self, s: Start<'_>) -> Result<(), String> {
        let cmd = {
            let mut st = self.state.lock().unwrap();
            let a = st.agents.get(s.node).ok_or_else(|| format!("no agent node {:?}", s.node))?;
            let uuids = s
                .gpus
                .iter()
                .map(|&g| a.gpus.iter().find(|x| x.info.index == g).map(|x| x.info.uuid.clone()).ok_or_else(|| format!("node {} has no GPU {g}", s.node)))
                .collect::<Result<Vec<_>, _>>()?;
            st.allocations.insert(
                s.alloc_id,
                pb::AllocationInfo {
                    id: s.alloc_id,
                    node: s.node.to_string(),
                    gpus: s.gpus.to_vec(),
                    gpu_uuids: uuids.clone(),
                    argv: s.argv.to_vec(),
                    state: "starting".into(),
                    started_by: format!("job {}", s.job_id),
                    ..Default::default()
                },
            );
            let env = s.env.iter().map(|(k, v)| (k.clone(), v.clone())).chain([("BERTH_JOB".to_string(), s.job_id.to_string())]).collect();
            pb::AgentCommand { allocation_id: s.alloc_id, action: "start".into(), argv: s.argv.to_vec(), gpu_uuids: uuids, env, cpu_milli: s.cpu_milli, memory_mib: s.memory_mib, executor: false }
        };
        tracing::info!(target: "berth::agent", allocation = s.alloc_id, job = s.job_id, node = %s.node, gpus = ?s.gpus, "task sent");
        self.send(s.node, cmd).map_err(|e| e.message().to_string()).inspect_err(|e| {
            let mut st = self.state.lock().unwrap();
            if let Some(a) = st.allocations.get_mut(&s.alloc_id) {
                a.state = "failed".into();
                a.detail = e.clone();
                st.ended(s.alloc_id, self.live.retention.ended_allocations);
            }
        })
    }

    fn usage(&self, alloc_id: u64) -> Option<pb::TaskUsage> {
        self.state.lock().unwrap().allocations.get(&alloc_id).and_then(|a| a.usage.clone())
    }

    fn cpu_rate_milli(&self, alloc_id: u64) -> Option<u32> {
        self.state.lock().unwrap().cpu_seen.get(&alloc_id).and_then(average_cpu_milli)
    }

    fn node_cpu_milli(&self, node: &str, except: u64, lifetime: bool) -> u32 {
        let st = self.state.lock().unwrap();
        st.allocations
            .values()
            .filter(|a| a.node == node && a.id != except && holds_gpus(&a.state))
            .filter_map(|a| {
                // Its average over its life here, or its latest beat's.
                let average = st.cpu_seen.get(&a.id).filter(|_| lifetime).and_then(average_cpu_milli);
                average.or_else(|| a.usage.as_ref().map(|u| u.cpu_milli))
            })
            .fold(0u32, u32::saturating_add)
    }

    fn stop(&self, alloc_id: u64, node: &str) -> bool {
        let sent = self.send(node, pb::AgentCommand { allocation_id: alloc_id, action: "stop".into(), ..Default::default() });
        if let Err(e) = &sent {
            tracing::warn!(target: "berth::agent", allocation = alloc_id, node, "stop not delivered: {}", e.message());
        }
        sent.is_ok()
    }

    fn checkpoint(&self, alloc_id: u64, node: &str) {
        if let Err(e) = self.send(node, pb::AgentCommand { allocation_id: alloc_id, action: "checkpoint".into(), ..Default::default() }) {
            tracing::warn!(target: "berth::agent", allocation = alloc_id, node, "checkpoint notice not delivered: {}", e.message());
        }
    }

    fn reconciled(&self, found: Vec<Reconciled>) {
        let mut stop = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            for r in found {
                // Allocations the hub does not know yet (started before a
                // restart of the host).
                for (a, gpus) in r.held {
                    if let std::collections::btree_map::Entry::Vacant(slot) = st.allocations.entry(a) {
                        tracing::info!(target: "berth::agent", allocation = a, node = %r.node, "allocation adopted");
                        slot.insert(pb::AllocationInfo { id: a, node: r.node.clone(), gpus, state: "running".into(), ..Default::default() });
                    }
                }
                let Some(agent) = st.agents.get_mut(&r.node) else { continue };
                for a in r.orphans {
                    if agent.stopped.insert(a) {
                        stop.push((a, r.node.clone()));
                    }
                }
            }
        }
        for (a, node) in stop {
            tracing::warn!(target: "berth::agent", allocation = a, node = %node, "orphan: telling the node to stop it");
            if let Err(e) = self.send(&node, pb::AgentCommand { allocation_id: a, action: "stop".into(), ..Default::default() }) {
                tracing::warn!(target: "berth::agent", allocation = a, "stop not delivered: {}", e.message());
                if let Some(x) = self.state.lock().unwrap().agents.get_mut(&node) {
                    x.stopped.remove(&a);
                }
            }
        }
    }

    fn sleep(&self, alloc_id: u64, node: &str, wake: bool) {
        let action = if wake { "wake" } else { "sleep" };
        if let Err(e) = self.send(node, pb::AgentCommand { allocation_id: alloc_id, action: action.into(), ..Default::default() }) {
            tracing::warn!(target: "berth::agent", allocation = alloc_id, node, "{action} not delivered: {}", e.message());
        }
    }
}

/// A heartbeat's contention sample as the fleet keeps it for policies:
/// CPU in thousandths of a core, pressures (percentages on the wire, checked
/// to lie in 0..=100) in thousandths.
fn measured(c: &pb::NodeContention) -> berth_core::fleet::Measured {
    let some = |p: &Option<pb::Pressure>| p.as_ref().map_or(0, |p| (p.some_avg10.clamp(0.0, 100.0) * 10.0).round() as u32);
    berth_core::fleet::Measured { cpu_used_milli: c.tasks_cpu_milli, cpu_pressure: some(&c.cpu), memory_pressure: some(&c.memory), io_pressure: some(&c.io) }
}
