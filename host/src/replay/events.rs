//! `berth replay --events`: what a live partition was given (its capture,
//! see [`crate::capture`]), replayed.
//!
//! - **Exact re-decision**: each segment that starts with the engine's start
//!   is given, input by input, to a fresh engine with the policy versions the
//!   live host used (found by content hash); every decision is compared with
//!   the captured one, and the first difference is named.
//! - **Counterfactual**: the same arrivals, with their captured durations,
//!   replayed under other policies on the fleet the capture saw, side by side
//!   with what happened live.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use berth_core::capture::{Fidelity, Input, PolicyRef, Replayer};
use berth_core::engine::{Deciders, SimConfig};
use berth_core::preemption::PreemptionPolicy;
use berth_core::{Decision, Fleet, Job, Node, PlacementPolicy, PolicyError};
use berth_sdk::{Allocations, Domains, Nodes, Scores, Task};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::capture::Capture;
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// Components found by content hash: the bundled policies and every
/// `.wasm` in the folders given (a state directory's `components/` holds
/// every version uploaded to the live host).
pub struct Components {
    by_sha: HashMap<String, PathBuf>,
}

impl Components {
    pub fn scan(dirs: &[PathBuf]) -> anyhow::Result<Components> {
        let mut by_sha = HashMap::new();
        let bundled = crate::catalog::policy_dir();
        for dir in dirs.iter().map(PathBuf::as_path).chain([bundled.as_path()]) {
            let entries: Vec<PathBuf> = if dir.is_file() {
                vec![dir.to_path_buf()]
            } else {
                match std::fs::read_dir(dir) {
                    Ok(e) => e.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "wasm")).collect(),
                    Err(e) if dir == bundled.as_path() && e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                    Err(e) => return Err(e).with_context(|| format!("--components {}", dir.display())),
                }
            };
            for path in entries {
                let bytes = std::fs::read(&path).with_context(|| path.display().to_string())?;
                by_sha.entry(hex::encode(Sha256::digest(&bytes))).or_insert(path);
            }
        }
        Ok(Components { by_sha })
    }

    pub fn path_of(&self, sha256: &str) -> anyhow::Result<&Path> {
        self.by_sha.get(sha256).map(PathBuf::as_path).ok_or_else(|| {
            anyhow::anyhow!("no component with sha256 {sha256} among {} found (pass --components with the live host's state directory's components/ folder, or the .wasm)", self.by_sha.len())
        })
    }
}

/// Policy instances of a replay: one per instance the live host made (a
/// version activated again starts over, as live), or for captures that do
/// not number them, one per role and version for the whole segment.
struct Instances<'a> {
    engine: &'a Arc<PolicyEngine>,
    components: &'a Components,
    limits: Limits,
    /// By the live instance (a candidate promoted keeps its state), or by
    /// role and version where the capture does not number instances.
    loaded: HashMap<(Option<Role>, PolicyRef), WasmPolicy>,
    names: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Role {
    Place,
    Candidate,
    Rank,
}

/// The key of `r`'s instance in `role`.
fn instance_key(role: Role, r: &PolicyRef) -> (Option<Role>, PolicyRef) {
    ((r.instance == 0).then_some(role), r.clone())
}

impl Instances<'_> {
    fn get(&mut self, role: Role, r: &PolicyRef) -> anyhow::Result<()> {
        let key = instance_key(role, r);
        if !self.loaded.contains_key(&key) {
            let path = self.components.path_of(&r.sha256)?;
            let loaded = LoadedPolicy::from_file(self.engine, path).with_context(|| format!("loading {}", path.display()))?;
            self.names.insert(r.sha256.clone(), format!("{}@{}", loaded.info.name, loaded.info.version));
            let mut policy = WasmPolicy::new(self.engine.clone(), loaded, self.limits);
            if !r.config.is_empty() {
                policy.configure(&r.config)?;
            }
            self.loaded.insert(key, policy);
        }
        Ok(())
    }

    fn take(&mut self, role: Role, r: &PolicyRef) -> WasmPolicy {
        self.loaded.remove(&instance_key(role, r)).expect("loaded by get")
    }

    fn put(&mut self, role: Role, r: &PolicyRef, policy: WasmPolicy) {
        self.loaded.insert(instance_key(role, r), policy);
    }
}

/// The live host's split A/B, as replay makes it: a job in the candidate's
/// share is decided by the candidate; once the candidate fails a job, the
/// active version decides the rest of that job's attempt (as live).
struct Split<'a> {
    active: &'a mut WasmPolicy,
    candidate: Option<(&'a mut WasmPolicy, f64)>,
    /// The job whose attempt the candidate failed.
    fell_back: Option<u64>,
}

impl Split<'_> {
    fn call<T>(&mut self, job_id: u64, mut f: impl FnMut(&mut dyn PlacementPolicy) -> Result<T, PolicyError>) -> Result<T, PolicyError> {
        if self.fell_back.is_some_and(|j| j != job_id) {
            self.fell_back = None;
        }
        if let Some((c, fraction)) = &mut self.candidate
            && self.fell_back.is_none()
            && crate::serve::shadow::in_split(job_id, *fraction)
        {
            match f(&mut **c) {
                Ok(v) => return Ok(v),
                Err(_) => self.fell_back = Some(job_id),
            }
        }
        f(&mut *self.active)
    }
}

impl PlacementPolicy for Split<'_> {
    fn describe(&self) -> String {
        "replayed split".into()
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        self.call(task.job_id, |p| p.score(task, nodes))
    }
    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        self.call(task.job_id, |p| p.score_domains(task, domains))
    }
}

/// The engine's default victim order (no rank version active).
pub struct DefaultRanking;

impl PreemptionPolicy for DefaultRanking {
    fn describe(&self) -> String {
        "default ranking".into()
    }
    fn rank(&mut self, _demand: &Task, _victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        Ok(None)
    }
}

/// One segment's exact re-decision.
#[derive(Clone, Debug, Serialize)]
pub struct ExactReport {
    pub segment: u64,
    pub inputs: usize,
    pub fidelity: Fidelity,
    /// The policy versions the segment used (name@version by sha256).
    pub policies: BTreeMap<String, String>,
    /// What happened, measured on the replayed fleet.
    pub tally: RunRow,
    /// Why the segment was not replayed (it lost its start to rotation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Replays every segment of `capture` exactly. A segment that cannot be
/// replayed (a component not found, an input naming what was never there)
/// is an error when `strict`, else reported as not replayed.
pub fn exact(engine: &Arc<PolicyEngine>, capture: &Capture, components: &Components, limits: Limits, strict: bool) -> anyhow::Result<Vec<ExactReport>> {
    let mut reports = Vec::new();
    for segment in &capture.segments {
        if !segment.complete() {
            let why = if segment.windowed {
                "exported from a time on (--since): inputs before it are missing"
            } else {
                "its first file was rotated away: it does not begin with the engine's start"
            };
            reports.push(ExactReport {
                segment: segment.id,
                inputs: segment.inputs.len(),
                fidelity: Fidelity::default(),
                policies: BTreeMap::new(),
                tally: RunRow::default(),
                skipped: Some(why.into()),
            });
            continue;
        }
        match exact_segment(engine, segment, components, limits) {
            Ok(report) => reports.push(report),
            Err(e) if !strict => reports.push(ExactReport {
                segment: segment.id,
                inputs: segment.inputs.len(),
                fidelity: Fidelity::default(),
                policies: BTreeMap::new(),
                tally: RunRow::default(),
                skipped: Some(format!("{e:#}")),
            }),
            Err(e) => return Err(e),
        }
    }
    Ok(reports)
}

fn exact_segment(engine: &Arc<PolicyEngine>, segment: &crate::capture::Segment, components: &Components, limits: Limits) -> anyhow::Result<ExactReport> {
    {
        let mut replayer = Replayer::new(&segment.inputs[0].input).map_err(anyhow::Error::msg)?;
        let mut instances = Instances { engine, components, limits, loaded: HashMap::new(), names: BTreeMap::new() };
        let mut arms: Option<(PolicyRef, Option<(PolicyRef, f64)>, Option<PolicyRef>)> = None;
        let mut tally = Tally::new("as captured (live)", replayer.engine.config.high_priority);
        for (k, line) in segment.inputs.iter().enumerate().skip(1) {
            let input = &line.input;
            if let Input::Arms { place, split, rank } = input {
                let wanted = [Some((Role::Place, place)), split.as_ref().map(|(c, _)| (Role::Candidate, c)), rank.as_ref().map(|r| (Role::Rank, r))];
                // A file is untrusted: one instance cannot answer in two roles.
                let keys: Vec<_> = wanted.iter().flatten().map(|(role, r)| instance_key(*role, r)).collect();
                anyhow::ensure!(
                    (1..keys.len()).all(|i| !keys[..i].contains(&keys[i])),
                    "segment {}, input {k}: one policy instance noted in two roles",
                    segment.id
                );
                for (role, r) in wanted.into_iter().flatten() {
                    instances.get(role, r).with_context(|| format!("segment {}, input {k}", segment.id))?;
                }
                arms = Some((place.clone(), split.clone(), rank.clone()));
            }
            tally.see(input, &replayer);
            if let Input::Pass { .. } = input {
                let Some((place, split, rank)) = &arms else { anyhow::bail!("segment {}, input {k}: a pass before the policy versions were noted", segment.id) };
                let mut active = instances.take(Role::Place, place);
                let mut candidate = split.as_ref().map(|(c, f)| (instances.take(Role::Candidate, c), *f));
                let mut ranker = rank.as_ref().map(|r| instances.take(Role::Rank, r));
                let result = {
                    let mut chooser = Split { active: &mut active, candidate: candidate.as_mut().map(|(c, f)| (c, *f)), fell_back: None };
                    let mut default = DefaultRanking;
                    let preemption: &mut dyn PreemptionPolicy = match ranker.as_mut() {
                        Some(r) => r,
                        None => &mut default,
                    };
                    replayer.step(input, &mut chooser, Some(preemption))
                };
                instances.put(Role::Place, place, active);
                if let (Some((c, _)), Some((p, _))) = (split, candidate) {
                    instances.put(Role::Candidate, c, p);
                }
                if let (Some(r), Some(p)) = (rank, ranker) {
                    instances.put(Role::Rank, r, p);
                }
                result.map_err(|e| anyhow::anyhow!("segment {}: {e}", segment.id))?;
            } else {
                replayer.step(input, &mut DefaultPlacement, None).map_err(|e| anyhow::anyhow!("segment {}: {e}", segment.id))?;
            }
            tally.after(input, &replayer.fleet);
            if !replayer.fidelity.exact() {
                // What follows was decided on a state this replay no longer has.
                break;
            }
        }
        Ok(ExactReport { segment: segment.id, inputs: segment.inputs.len(), fidelity: replayer.fidelity.clone(), policies: instances.names, tally: tally.row(), skipped: None })
    }
}

/// Never asked: inputs other than passes place nothing.
struct DefaultPlacement;

impl PlacementPolicy for DefaultPlacement {
    fn describe(&self) -> String {
        "none".into()
    }
    fn score(&mut self, _task: &Task, _nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Err(PolicyError::Trap("placement asked outside a pass".into()))
    }
}

/// One run's figures, side by side with the others'.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RunRow {
    pub run: String,
    pub jobs: usize,
    pub started: usize,
    /// Waits from arrival to first start, s, of high- and low-priority
    /// jobs started: p50 and p99.
    pub high_wait_s: [u64; 2],
    pub low_wait_s: [u64; 2],
    /// Time-averaged allocated over installed GPUs, %.
    pub allocation_pct: f64,
    pub evictions: u64,
    pub lost_gpu_h: f64,
    /// The outcome: GPU-hours of work done and kept by the end (work an
    /// eviction lost is not counted). For the live run, each job's GPUs
    /// times the time it ran, less the work lost; `None` where the capture
    /// does not say (several segments).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub done_gpu_h: Option<f64>,
    /// Tasks moved (live compaction, migrations).
    pub moves: u64,
    /// Time-averaged nodes partly used (some but not all GPUs allocated).
    pub partly_used_nodes: f64,
}

/// Counts a run's figures from its inputs, decisions and fleet over time.
struct Tally {
    row: RunRow,
    high_priority: u32,
    arrivals: HashMap<u64, (u64, bool)>,
    started: HashMap<u64, u64>,
    last: Option<(u64, f64, f64, f64)>,
    integrals: (f64, f64, f64, f64),
}

impl Tally {
    fn new(run: &str, high_priority: u32) -> Tally {
        Tally { row: RunRow { run: run.into(), ..Default::default() }, high_priority, arrivals: HashMap::new(), started: HashMap::new(), last: None, integrals: Default::default() }
    }

    /// Before `input` is given (the fleet as it stood until then).
    fn see(&mut self, input: &Input, replayer: &Replayer) {
        if let Some(now) = input.now() {
            self.observe(now, &replayer.fleet);
        }
        match input {
            Input::Register { job, .. } => {
                self.arrivals.entry(job.id).or_insert((job.arrival_s, job.priority >= self.high_priority));
            }
            Input::ReplaceHeld { .. } => self.row.moves += 1,
            _ => {}
        }
    }

    /// After `input` was given: its decisions (the captured ones: the
    /// replay stops at the first that differs).
    fn after(&mut self, input: &Input, fleet: &Fleet) {
        let decisions = match input {
            Input::Pass { decisions, .. } | Input::TakeAnnounced { decisions } | Input::TakeBroken { decisions } => decisions.as_slice(),
            _ => &[],
        };
        self.decided(decisions);
        if let Some(now) = input.now() {
            self.observe(now, fleet);
        }
    }

    fn decided<'a>(&mut self, decisions: impl IntoIterator<Item = &'a Decision>) {
        for d in decisions {
            match d {
                Decision::Place { job, start_s, .. } => {
                    self.started.entry(*job).or_insert(*start_s);
                }
                Decision::Evict { lost_gpu_s, .. } => {
                    self.row.evictions += 1;
                    self.row.lost_gpu_h += lost_gpu_s / 3600.0;
                }
                _ => {}
            }
        }
    }

    fn observe(&mut self, now: u64, fleet: &Fleet) {
        let total = fleet.gpu_total_milli() as f64;
        let allocated = fleet.gpu_allocated_milli() as f64;
        let partly = fleet.nodes().iter().filter(|n| !n.gpus.is_empty() && n.gpu_free_milli() > 0 && n.gpu_free_milli() < n.gpu_total_milli()).count() as f64;
        if let Some((t, a, tot, p)) = self.last
            && now > t
        {
            let dt = (now - t) as f64;
            self.integrals.0 += a * dt;
            self.integrals.1 += tot * dt;
            self.integrals.2 += p * dt;
            self.integrals.3 += dt;
        }
        if self.last.is_none_or(|(t, ..)| now >= t) {
            self.last = Some((now, allocated, total, partly));
        }
    }

    fn row(mut self) -> RunRow {
        let pct = |mut v: Vec<u64>| -> [u64; 2] {
            v.sort_unstable();
            let at = |q: f64| v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1).min(v.len().saturating_sub(1))).copied().unwrap_or(0);
            [at(0.5), at(0.99)]
        };
        let waits = |high: bool| self.started.iter().filter_map(|(id, s)| self.arrivals.get(id).filter(|(_, h)| *h == high).map(|(a, _)| s.saturating_sub(*a))).collect::<Vec<u64>>();
        self.row.high_wait_s = pct(waits(true));
        self.row.low_wait_s = pct(waits(false));
        self.row.jobs = self.arrivals.len();
        self.row.started = self.started.keys().filter(|id| self.arrivals.contains_key(id)).count();
        let (a, tot, p, t) = self.integrals;
        self.row.allocation_pct = if tot > 0.0 { 100.0 * a / tot } else { 0.0 };
        self.row.partly_used_nodes = if t > 0.0 { p / t } else { 0.0 };
        self.row
    }
}

/// The arrivals of a capture as replayable work: each job as submitted,
/// lasting as long as its captured run did.
pub struct Workload {
    pub fleet: Fleet,
    pub jobs: Vec<Job>,
    pub config: SimConfig,
    /// The first captured time: replayed times count from it.
    pub origin_s: u64,
    pub horizon_s: u64,
    /// Jobs cancelled before they ever started (not replayed).
    pub cancelled_waiting: usize,
    /// Jobs still running at the capture's end (their duration is a lower bound).
    pub unfinished: usize,
    /// GPU-hours the live run's jobs ran (each job's GPUs times the sum of
    /// its runs, until the capture's end for those still running).
    pub live_ran_gpu_h: f64,
}

/// Builds the counterfactual's input from every segment of `capture`.
/// The fleet is every node the capture saw, idle, as last defined; agent
/// nodes and simulated nodes stay apart (jobs with a command ran only on
/// agents' nodes) as two partitions of the replayed fleet.
pub fn workload(capture: &Capture) -> anyhow::Result<Workload> {
    let mut config: Option<SimConfig> = None;
    let mut models: Vec<String> = Vec::new();
    let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
    let mut agent_names: std::collections::BTreeSet<String> = Default::default();
    let mut jobs: BTreeMap<u64, Job> = BTreeMap::new();
    let mut starts: HashMap<u64, u64> = HashMap::new();
    let mut ran_s: HashMap<u64, u64> = HashMap::new();
    let mut ended: std::collections::BTreeSet<u64> = Default::default();
    let mut cancelled_waiting = 0;
    let mut latest_guards = None;
    let (mut first, mut last) = (u64::MAX, 0u64);
    for segment in &capture.segments {
        // Node names by id within this segment (ids are per host start).
        let mut names: Vec<String> = Vec::new();
        let mut job_of_slot: HashMap<usize, u64> = HashMap::new();
        let put = |id: u32, node: &Node, models_now: &[String], names: &mut Vec<String>, models: &mut Vec<String>, nodes: &mut BTreeMap<String, Node>| {
            let model = node.model.and_then(|m| models_now.get(m as usize)).map(|name| berth_core::fleet::intern_model(models, name));
            let mut idle = Node::new(node.name.clone(), model, node.gpus.len(), node.cpu_total_milli, node.memory_total_mib);
            idle.switch_domain = node.switch_domain;
            idle.aggregation = node.aggregation;
            if names.len() <= id as usize {
                names.resize(id as usize + 1, String::new());
            }
            names[id as usize] = node.name.clone();
            nodes.insert(node.name.clone(), idle);
        };
        let mut seg_models: Vec<String> = Vec::new();
        let mut agent_ids: std::collections::BTreeSet<u32> = Default::default();
        for line in &segment.inputs {
            if let Some(now) = line.input.now() {
                first = first.min(now);
                last = last.max(now);
            }
            match &line.input {
                Input::Start { config: c, models: m, nodes: n } => {
                    config.get_or_insert_with(|| c.clone());
                    seg_models = m.clone();
                    for (id, node) in n.iter().enumerate() {
                        put(id as u32, node, &seg_models, &mut names, &mut models, &mut nodes);
                    }
                }
                Input::Nodes { models: m, nodes: n } => {
                    if let Some(m) = m {
                        seg_models = m.clone();
                    }
                    for (id, node) in n {
                        put(*id, node, &seg_models, &mut names, &mut models, &mut nodes);
                    }
                }
                Input::AgentNodes { nodes: ids } => {
                    // Named at the segment's end: the note comes before the
                    // pass that adds a new agent's node.
                    agent_ids.extend(ids.iter().copied());
                }
                Input::Guards { guards } => latest_guards = Some(guards.clone()),
                Input::Register { slot, job } => {
                    job_of_slot.insert(*slot, job.id);
                    jobs.entry(job.id).or_insert_with(|| job.clone());
                }
                Input::RestoreRunning { slot, started_s, .. } | Input::RestoreSleeping { slot, started_s, .. } => {
                    // Running when the host restarted: its run goes on.
                    if let Some(&id) = job_of_slot.get(slot) {
                        starts.entry(id).or_insert(*started_s);
                    }
                }
                Input::Pass { now, events, decisions, .. } => {
                    // A simulated world (a converted trace) ends jobs inside
                    // passes; a live host applies its ends first.
                    for event in events {
                        ended_by(*now, event, &job_of_slot, &mut starts, &mut ran_s, &mut ended, &mut jobs, &mut cancelled_waiting);
                    }
                    tally_decisions(decisions, &mut starts, &mut ran_s);
                }
                Input::TakeAnnounced { decisions } => tally_decisions(decisions, &mut starts, &mut ran_s),
                Input::Apply { now, event, .. } => ended_by(*now, event, &job_of_slot, &mut starts, &mut ran_s, &mut ended, &mut jobs, &mut cancelled_waiting),
                _ => {}
            }
        }
        agent_names.extend(agent_ids.iter().filter_map(|&id| names.get(id as usize).cloned()));
    }
    let config = config.ok_or_else(|| anyhow::anyhow!("the capture holds no segment start (its first files were rotated away): nothing says what the fleet was"))?;
    anyhow::ensure!(!nodes.is_empty(), "the capture saw no nodes");
    let origin_s = if first == u64::MAX { 0 } else { first };
    let horizon_s = last.saturating_sub(origin_s).max(1);
    let mut unfinished = 0;
    let mut replayed = Vec::new();
    let mut live_ran_gpu_h = 0.0;
    for (id, mut job) in jobs {
        if let Some(s) = starts.get(&id) {
            // Still running at the end: as long as it ran until then.
            *ran_s.entry(id).or_default() += last.saturating_sub(*s);
            unfinished += 1;
        }
        live_ran_gpu_h += job.gpus_held() * ran_s.get(&id).copied().unwrap_or(0) as f64 / 3600.0;
        job.duration_s = match ran_s.get(&id) {
            Some(&d) => d.max(1),
            None => job.duration_s.clamp(1, horizon_s),
        };
        if !ended.contains(&id) && ran_s.contains_key(&id) && !starts.contains_key(&id) {
            unfinished += 1;
        }
        // Submitted before the capture began (recovered at a start): it
        // arrives when the capture begins.
        job.arrival_s = job.arrival_s.saturating_sub(origin_s);
        // Agent work stays on agents' nodes, simulated work off them.
        job.partition = Some(u32::from(job.reports_exit));
        job.reports_exit = false;
        replayed.push(job);
    }
    let fleet_nodes = nodes
        .into_values()
        .map(|mut n| {
            n.partition = u32::from(agent_names.contains(&n.name));
            n
        })
        .collect();
    let fleet = Fleet::new(models, fleet_nodes).map_err(|e| anyhow::anyhow!("the captured fleet: {e}"))?;
    // The settings as they were last: an operator's guard (recovered at
    // each start, changed at run time); a partition whose work is never
    // taken back protects both of the replayed partitions.
    let guards = latest_guards.unwrap_or(config.guards.clone());
    let protected_partitions = if config.protected_partitions.is_empty() { Default::default() } else { [0, 1].into_iter().collect() };
    let config = SimConfig { horizon_s, guards, protected_partitions, ..config };
    Ok(Workload { fleet, jobs: replayed, config, origin_s, horizon_s, cancelled_waiting, unfinished, live_ran_gpu_h })
}

/// Starts and stops of runs a pass decided (for the counterfactual's
/// durations).
fn tally_decisions(decisions: &[Decision], starts: &mut HashMap<u64, u64>, ran_s: &mut HashMap<u64, u64>) {
    for d in decisions {
        match d {
            Decision::Place { job, start_s, .. } => {
                starts.insert(*job, *start_s);
            }
            Decision::Evict { job, stop_by_s, .. } => {
                if let Some(s) = starts.remove(job) {
                    *ran_s.entry(*job).or_default() += stop_by_s.saturating_sub(s);
                }
            }
            _ => {}
        }
    }
}

/// A run ended by `event` at `now`: counted in `ran_s`; a job cancelled
/// before it ever ran is left out of the counterfactual.
#[allow(clippy::too_many_arguments)]
fn ended_by(
    now: u64,
    event: &berth_core::Event,
    job_of_slot: &HashMap<usize, u64>,
    starts: &mut HashMap<u64, u64>,
    ran_s: &mut HashMap<u64, u64>,
    ended: &mut std::collections::BTreeSet<u64>,
    jobs: &mut BTreeMap<u64, Job>,
    cancelled_waiting: &mut usize,
) {
    use berth_core::Event;
    let (Event::End(slot) | Event::Cancel(slot) | Event::Requeue(slot) | Event::Unstarted(slot)) = event else { return };
    let Some(&id) = job_of_slot.get(slot) else { return };
    match starts.remove(&id) {
        Some(s) => *ran_s.entry(id).or_default() += now.saturating_sub(s),
        None if matches!(event, Event::Cancel(_)) && !ran_s.contains_key(&id) => {
            *cancelled_waiting += 1;
            jobs.remove(&id);
        }
        None => {}
    }
    if matches!(event, Event::End(_) | Event::Cancel(_)) {
        ended.insert(id);
    }
}

/// `--contract`: the partition's default priority contract for the
/// counterfactual runs, as `key=value` pairs over `base` (the captured one):
/// `notice`, `grace`, `checkpoint-every` and `max-outage` in seconds,
/// `per-day` interruptions, `checkpoint-on-notice` true or false. Jobs that
/// bought their own contract keep it.
pub fn parse_contract(text: &str, base: berth_core::job::PriorityContract) -> anyhow::Result<berth_core::job::PriorityContract> {
    anyhow::ensure!(text.len() <= 1024, "--contract: {} bytes, more than 1024", text.len());
    let mut c = base;
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').ok_or_else(|| anyhow::anyhow!("--contract {:?}: expected key=value", crate::text::printable(pair, 64)))?;
        let secs = || value.trim().parse::<u64>().with_context(|| format!("--contract {key}: {:?} is not a number of seconds", crate::text::printable(value, 32)));
        match key.trim() {
            "notice" => c.notice_s = secs()?,
            "grace" => c.grace_s = secs()?,
            "checkpoint-every" => c.checkpoint_every_s = secs()?,
            "max-outage" => c.max_outage_s = secs()?,
            "per-day" => c.max_interruptions_per_day = value.trim().parse().with_context(|| format!("--contract per-day: {:?} is not a count", crate::text::printable(value, 32)))?,
            "checkpoint-on-notice" => c.checkpoint_on_notice = value.trim().parse().with_context(|| format!("--contract checkpoint-on-notice: {:?} is not true or false", crate::text::printable(value, 32)))?,
            other => anyhow::bail!("--contract: unknown key {:?} (notice, grace, per-day, checkpoint-every, checkpoint-on-notice, max-outage)", crate::text::printable(other, 32)),
        }
    }
    anyhow::ensure!(c.checkpoint_every_s > 0, "--contract checkpoint-every must be positive");
    Ok(c)
}

/// A contract in words, for the counterfactual's header.
pub fn contract_text(c: &berth_core::job::PriorityContract) -> String {
    format!(
        "notice {} s, grace {} s, at most {} a day, checkpoint every {} s{}{}",
        c.notice_s,
        c.grace_s,
        c.max_interruptions_per_day,
        c.checkpoint_every_s,
        if c.checkpoint_on_notice { ", checkpoint on notice" } else { "" },
        if c.max_outage_s > 0 { format!(", out at most {} s", c.max_outage_s) } else { String::new() }
    )
}

/// A starvation guard in words, for the counterfactual's header.
pub fn guard_text(guard: Option<&berth_core::engine::StarvationGuard>) -> String {
    let Some(g) = guard else { return "none".into() };
    let mut parts = Vec::new();
    if g.reserve_after_s != u64::MAX {
        parts.push(format!("reserve after {:.2} h", g.reserve_after_s as f64 / 3600.0));
    }
    if g.aging_per_hour > 0.0 {
        parts.push(format!("aging {} points/h", g.aging_per_hour));
    }
    if let Some(w) = &g.window {
        parts.push(format!("admission window {} min, {} GPU-h", w.window_s / 60, w.small_gpu_h));
    }
    if parts.is_empty() { "none".into() } else { parts.join(", ") }
}

/// Runs the workload under `placement` (and `rank`), counting what the
/// live run is counted by.
pub fn counterfactual<'a>(
    name: &str,
    work: &Workload,
    placement: &'a mut dyn PlacementPolicy,
    rank: &'a mut dyn PreemptionPolicy,
    compaction: Option<(&'a mut dyn berth_core::compaction::CompactionPolicy, berth_core::compaction::CompactionConfig)>,
) -> anyhow::Result<RunRow> {
    let mut fleet = work.fleet.clone();
    let mut tally = Tally::new(name, work.config.high_priority);
    for job in &work.jobs {
        tally.arrivals.insert(job.id, (job.arrival_s, job.priority >= work.config.high_priority));
    }
    let mut log = Vec::new();
    let mut observed: Vec<(u64, f64, f64, f64)> = Vec::new();
    {
        let deciders = Deciders { placement, preemption: Some(rank), compaction };
        let mut watch = |now: u64, _: &berth_core::Engine, fleet: &Fleet| {
            let partly = fleet.nodes().iter().filter(|n| !n.gpus.is_empty() && n.gpu_free_milli() > 0 && n.gpu_free_milli() < n.gpu_total_milli()).count() as f64;
            observed.push((now, fleet.gpu_allocated_milli() as f64, fleet.gpu_total_milli() as f64, partly));
        };
        let out = berth_core::sim::simulate_watched(&mut fleet, &work.jobs, deciders, work.config.clone(), Some(&mut log), &mut watch).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        tally.row.moves = out.compaction.moves_run;
        tally.row.done_gpu_h = Some(out.jobs.iter().map(|o| o.work_gpu_s).sum::<f64>() / 3600.0);
        // The fleet as the last events left it held until the horizon.
        watch(work.horizon_s, &berth_core::Engine::new(SimConfig::default()), &fleet);
    }
    // Each look is before that time's events: the fleet as it stood since
    // the previous look.
    let mut since: Option<u64> = None;
    for (now, a, tot, p) in observed {
        if let Some(t) = since
            && now > t
        {
            let dt = (now - t) as f64;
            tally.integrals = (tally.integrals.0 + a * dt, tally.integrals.1 + tot * dt, tally.integrals.2 + p * dt, tally.integrals.3 + dt);
        }
        since = Some(now);
    }
    tally.decided(log.iter().map(|(_, d)| d));
    Ok(tally.row())
}

/// The side-by-side table.
pub fn table(rows: &[RunRow]) -> String {
    let mut out = format!(
        "{:<28} {:>6} {:>8} {:>16} {:>16} {:>7} {:>6} {:>8} {:>9} {:>6} {:>7}\n",
        "run", "jobs", "started", "high wait p50/99", "low wait p50/99", "alloc%", "evict", "lost GPUh", "done GPUh", "moves", "partly"
    );
    for r in rows {
        out += &format!(
            "{:<28} {:>6} {:>8} {:>16} {:>16} {:>7.2} {:>6} {:>8.2} {:>9} {:>6} {:>7.2}\n",
            crate::text::printable(&r.run, 28),
            r.jobs,
            r.started,
            format!("{}/{} s", r.high_wait_s[0], r.high_wait_s[1]),
            format!("{}/{} s", r.low_wait_s[0], r.low_wait_s[1]),
            r.allocation_pct,
            r.evictions,
            r.lost_gpu_h,
            r.done_gpu_h.map_or("-".into(), |d| format!("{d:.2}")),
            r.moves,
            r.partly_used_nodes
        );
    }
    out
}

/// The report as one self-contained HTML page.
pub fn html(setting: &str, exact: &[ExactReport], rows: &[RunRow]) -> String {
    use super::report::escape_html as e;
    let mut h = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>Berth: a capture replayed</title>\n<style>{}</style>\n</head>\n<body>\n<h1>A capture replayed</h1>\n<p class=\"meta\">{}</p>\n",
        super::report::STYLE,
        e(setting)
    );
    if !exact.is_empty() {
        h += "<h2>Exact re-decision</h2>\n<table id=\"fidelity\">\n<thead><tr><th>segment</th><th>inputs</th><th>passes</th><th>decisions identical</th><th>first difference</th></tr></thead>\n<tbody>\n";
        for x in exact {
            let first = match (&x.skipped, &x.fidelity.first_difference) {
                (Some(why), _) => format!("not replayed: {why}"),
                (None, Some(d)) => format!("input {}: captured {} / replayed {}", d.input, d.captured.as_deref().unwrap_or("nothing"), d.replayed.as_deref().unwrap_or("nothing")),
                (None, None) => "none".into(),
            };
            h += &format!(
                "<tr><th scope=\"row\">{}</th><td>{}</td><td>{}</td><td>{} / {}</td><td>{}</td></tr>\n",
                x.segment,
                x.inputs,
                x.fidelity.passes,
                x.fidelity.identical,
                x.fidelity.decisions,
                e(&first)
            );
        }
        h += "</tbody>\n</table>\n";
    }
    if !rows.is_empty() {
        h += "<h2>Side by side</h2>\n<table id=\"runs\">\n<thead><tr><th>run</th><th>jobs</th><th>started</th><th>high-priority wait p50 / p99 (s)</th><th>low-priority wait p50 / p99 (s)</th><th>allocation %</th><th>evictions</th><th>work lost GPU-h</th><th>work done GPU-h</th><th>moves</th><th>partly used nodes</th></tr></thead>\n<tbody>\n";
        for r in rows {
            h += &format!(
                "<tr><th scope=\"row\">{}</th><td>{}</td><td>{}</td><td>{} / {}</td><td>{} / {}</td><td>{:.2}</td><td>{}</td><td>{:.2}</td><td>{}</td><td>{}</td><td>{:.2}</td></tr>\n",
                e(&r.run),
                r.jobs,
                r.started,
                r.high_wait_s[0],
                r.high_wait_s[1],
                r.low_wait_s[0],
                r.low_wait_s[1],
                r.allocation_pct,
                r.evictions,
                r.lost_gpu_h,
                r.done_gpu_h.map_or("-".into(), |d| format!("{d:.2}")),
                r.moves,
                r.partly_used_nodes
            );
        }
        h += "</tbody>\n</table>\n";
    }
    h += "</body>\n</html>\n";
    h
}
