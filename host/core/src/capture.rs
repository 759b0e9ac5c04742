//! Capture: every input the engine is given, in the order it is given, so
//! that what a live host saw can be run again through the same engine
//! (exact re-decision) or under other policies (a counterfactual).
//!
//! The engine records its own inputs when capture is on
//! ([`crate::Engine::start_capture`]): there is no single place in a world
//! that drives it (the live host calls it from a dozen), but every call
//! goes through the engine. Changes the world made to the fleet outside the
//! engine (an agent's node added, a health change, a migration's copy, a
//! measurement) are recorded as the states of the nodes changed since the
//! engine last saw the fleet, at the next call that takes the fleet: the
//! engine reads the fleet only there. What the world decides beside the
//! engine and a replay must know (which policy versions answered, which
//! nodes are agents') it notes itself ([`crate::Engine::capture_note`]).
//!
//! Decisions are recorded with the inputs that made them, so a replay can
//! say how many of its own are identical and where the first difference is.

use serde::{Deserialize, Serialize};

use crate::engine::{Decision, Event, Guards, Pass, SimConfig, Slot};
use crate::fleet::{Allocation, Fleet, Node, NodeId};
use crate::job::Job;
use crate::policy::PlacementPolicy;

/// The format's name and version, written in every file's header.
pub const FORMAT: &str = "berth-capture";
pub const VERSION: u32 = 1;

/// One input of the engine (or an output a replay compares), as recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "input", rename_all = "snake_case")]
pub enum Input {
    /// Capture starts: the engine's settings and the whole fleet.
    Start { config: SimConfig, models: Vec<String>, nodes: Vec<Node> },
    /// Nodes the world changed (or added) since the engine last saw the
    /// fleet, as they are now; `models` when the model list grew.
    Nodes {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        models: Option<Vec<String>>,
        nodes: Vec<(NodeId, Node)>,
    },
    Register { slot: Slot, job: Job },
    Forget { slot: Slot },
    /// An event applied without a pass; `job` is the id of the slot's job
    /// (slots are reused), for readers.
    Apply {
        now: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<u64>,
        event: Event,
    },
    /// A pass ([`crate::Engine::handle`]) with its events, and what it
    /// decided (compared by a replay, not replayed).
    Pass {
        now: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        events: Vec<Event>,
        decisions: Vec<Decision>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    DueWakeups { now: u64 },
    Guards { guards: Guards },
    RestoreRunning { slot: Slot, allocations: Vec<Allocation>, started_s: u64 },
    RestoreSleeping { slot: Slot, allocations: Vec<Allocation>, started_s: u64 },
    RestoreInterruptions { slot: Slot, times: Vec<u64>, now: u64 },
    RestoreEvicting { slot: Slot, still_running: Vec<Allocation> },
    RestoreAwaiting { slot: Slot, victims: Vec<Slot> },
    /// A task moved (live compaction, `berth migrate`).
    ReplaceHeld { slot: Slot, old: Allocation, new: Allocation },
    /// Decisions the world took out of the engine between passes.
    TakeAnnounced { decisions: Vec<Decision> },
    TakeBroken { decisions: Vec<Decision> },
    /// The policy versions the next passes ask: placement, a split
    /// candidate with the share of jobs it decides, preemption ranking.
    Arms {
        place: PolicyRef,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        split: Option<(PolicyRef, f64)>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rank: Option<PolicyRef>,
    },
    /// The nodes run by agents (jobs with a command run only there;
    /// simulated jobs never do).
    AgentNodes { nodes: Vec<NodeId> },
}

impl Input {
    /// The engine time the input carries, if it carries one.
    pub fn now(&self) -> Option<u64> {
        match self {
            Input::Apply { now, .. } | Input::Pass { now, .. } | Input::DueWakeups { now } | Input::RestoreInterruptions { now, .. } => Some(*now),
            _ => None,
        }
    }
}

/// A policy version as a replay finds it again: the component's content
/// hash and the configuration it was given.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PolicyRef {
    pub sha256: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config: String,
}

/// The engine's record of its inputs while capture is on.
#[derive(Debug)]
pub(crate) struct Recorder {
    pub inputs: Vec<Input>,
    /// The fleet's change count and identity when the engine last saw it.
    mark: u64,
    lineage: u64,
    models: usize,
}

impl Recorder {
    pub fn start(config: &SimConfig, fleet: &Fleet) -> Recorder {
        let start = Input::Start { config: config.clone(), models: fleet.models.clone(), nodes: fleet.nodes().to_vec() };
        Recorder { inputs: vec![start], mark: fleet.changes(), lineage: fleet.lineage(), models: fleet.models.len() }
    }

    /// Records the nodes changed since the engine last saw `fleet`.
    pub fn saw(&mut self, fleet: &Fleet) {
        let all = fleet.lineage() != self.lineage;
        if !all && fleet.changes() == self.mark && fleet.models.len() == self.models {
            return; // nothing changed since (the common case: no scan)
        }
        let nodes: Vec<(NodeId, Node)> =
            if all { fleet.nodes().iter().enumerate().map(|(i, n)| (i as NodeId, n.clone())).collect() } else { fleet.changed_since(self.mark).map(|id| (id, fleet.nodes()[id as usize].clone())).collect() };
        let models = (fleet.models.len() != self.models || all).then(|| fleet.models.clone());
        if !nodes.is_empty() || models.is_some() {
            self.inputs.push(Input::Nodes { models, nodes });
        }
        self.left(fleet);
    }

    /// The engine is done with `fleet` for this call.
    pub fn left(&mut self, fleet: &Fleet) {
        self.mark = fleet.changes();
        self.lineage = fleet.lineage();
        self.models = fleet.models.len();
    }
}

/// Makes the replayed fleet's nodes what a [`Input::Nodes`] says.
pub fn put_nodes(fleet: &mut Fleet, models: Option<&[String]>, nodes: &[(NodeId, Node)]) -> Result<(), String> {
    let models = models.map(<[String]>::to_vec).unwrap_or_else(|| fleet.models.clone());
    if nodes.is_empty() {
        fleet.models = models;
        return Ok(());
    }
    for (id, node) in nodes {
        let len = fleet.nodes().len() as NodeId;
        let at = match *id {
            id if id < len => Some(id),
            id if id == len => None,
            id => return Err(format!("node {id} recorded before node {len}")),
        };
        fleet.put_node(models.clone(), at, node.clone()).map_err(|e| format!("node {id} ({}): {e}", node.name))?;
    }
    Ok(())
}

/// The first decision of a replay that differs from the capture's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// Which input (0-based line of the capture's inputs) made it.
    pub input: usize,
    pub now: Option<u64>,
    pub captured: Option<String>,
    pub replayed: Option<String>,
}

/// A decision without what only labels it: the rank policy's description
/// (a live host names its version, a replay the component) is not a choice.
fn comparable(d: &Decision) -> Decision {
    let mut d = d.clone();
    if let Decision::Evict { ranker, .. } = &mut d {
        ranker.clear();
    }
    d
}

/// How faithfully a replay remade the captured decisions.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Fidelity {
    pub decisions: u64,
    pub identical: u64,
    pub passes: u64,
    pub first_difference: Option<Difference>,
}

impl Fidelity {
    /// Compares one call's decisions (and pass error) with the capture's.
    pub fn compare(&mut self, input: usize, now: Option<u64>, captured: &[Decision], replayed: &[Decision], errors: (Option<&str>, Option<&str>)) {
        self.decisions += captured.len().max(replayed.len()) as u64;
        let mut first = None;
        for k in 0..captured.len().max(replayed.len()) {
            let (c, r) = (captured.get(k), replayed.get(k));
            if c.map(comparable) == r.map(comparable) {
                self.identical += 1;
            } else if first.is_none() {
                first = Some(Difference { input, now, captured: c.map(|d| format!("{d:?}")), replayed: r.map(|d| format!("{d:?}")) });
            }
        }
        if first.is_none() && errors.0 != errors.1 {
            first = Some(Difference { input, now, captured: errors.0.map(|e| format!("error: {e}")), replayed: errors.1.map(|e| format!("error: {e}")) });
        }
        if self.first_difference.is_none() {
            self.first_difference = first;
        }
    }

    pub fn exact(&self) -> bool {
        self.first_difference.is_none()
    }
}

/// Replays captured inputs through a fresh engine: every input is given to
/// it as the live host gave it, and every pass's decisions are compared
/// with the ones captured. The caller supplies the policies a pass asks
/// (it looks them up by the hashes of [`Input::Arms`]).
pub struct Replayer {
    pub engine: crate::Engine,
    pub fleet: Fleet,
    /// Nodes run by agents (see [`Input::AgentNodes`]).
    pub agent_nodes: Vec<bool>,
    pub fidelity: Fidelity,
    next: usize,
}

impl Replayer {
    /// From a capture's [`Input::Start`].
    pub fn new(start: &Input) -> Result<Replayer, String> {
        let Input::Start { config, models, nodes } = start else { return Err("a capture to replay begins with a start input".into()) };
        let fleet = Fleet::new(models.clone(), nodes.clone()).map_err(|e| format!("the captured fleet: {e}"))?;
        Ok(Replayer { engine: crate::Engine::new(config.clone()), fleet, agent_nodes: Vec::new(), fidelity: Fidelity::default(), next: 1 })
    }

    /// Gives the engine input `input` (the next of the capture): a pass
    /// asks `placement` (and `preemption`, when given).
    pub fn step<'a>(&mut self, input: &Input, placement: &'a mut dyn PlacementPolicy, preemption: Option<&'a mut dyn crate::preemption::PreemptionPolicy>) -> Result<(), String> {
        let at = self.next;
        self.next += 1;
        let (engine, fleet) = (&mut self.engine, &mut self.fleet);
        match input {
            Input::Start { .. } => return Err(format!("input {at}: a second start (a host restart): replay each segment from its own start")),
            Input::Nodes { models, nodes } => put_nodes(fleet, models.as_deref(), nodes).map_err(|e| format!("input {at}: {e}"))?,
            Input::Register { slot, job } => {
                let got = engine.register(job.clone());
                if got != *slot {
                    return Err(format!("input {at}: job {} registered in slot {got}, captured in slot {slot}", job.id));
                }
            }
            Input::Forget { slot } => {
                engine.forget(*slot);
            }
            Input::Apply { now, event, .. } => engine.apply(fleet, *now, event.clone()),
            Input::Pass { now, events, decisions, error } => {
                let agents = &self.agent_nodes;
                let eligible = |job: &Job, id: NodeId, _: &Node| agents.get(id as usize).copied().unwrap_or(false) == job.reports_exit;
                let mut deciders = crate::engine::Deciders { placement, preemption, compaction: None };
                let mut world = crate::World { eligible: Some(&eligible), observer: None };
                let pass: Pass = engine.handle(fleet, *now, events.iter().cloned(), &mut deciders, &mut world);
                let replayed_error = pass.error.as_ref().map(|(_, hook, e)| format!("{hook:?}: {e}"));
                self.fidelity.passes += 1;
                self.fidelity.compare(at, Some(*now), decisions, &pass.decisions, (error.as_deref(), replayed_error.as_deref()));
            }
            Input::DueWakeups { now } => {
                engine.take_due_wakeups(*now);
            }
            Input::Guards { guards } => engine.set_guards(guards.clone()),
            Input::RestoreRunning { slot, allocations, started_s } => {
                engine.restore_running(fleet, *slot, allocations.clone(), *started_s).map_err(|e| format!("input {at}: {e}"))?;
            }
            Input::RestoreSleeping { slot, allocations, started_s } => engine.restore_sleeping(*slot, allocations.clone(), *started_s),
            Input::RestoreInterruptions { slot, times, now } => engine.restore_interruptions(*slot, times.clone(), *now),
            Input::RestoreEvicting { slot, still_running } => engine.restore_evicting(fleet, *slot, still_running),
            Input::RestoreAwaiting { slot, victims } => engine.restore_awaiting(*slot, victims.iter().copied()),
            Input::ReplaceHeld { slot, old, new } => {
                engine.replace_held(*slot, old, new.clone());
            }
            Input::TakeAnnounced { decisions } => {
                let got = engine.take_announced();
                self.fidelity.compare(at, None, decisions, &got, (None, None));
            }
            Input::TakeBroken { decisions } => {
                let got = engine.take_broken();
                self.fidelity.compare(at, None, decisions, &got, (None, None));
            }
            Input::Arms { .. } => {}
            Input::AgentNodes { nodes } => {
                self.agent_nodes = vec![false; self.fleet.nodes().len().max(nodes.iter().map(|&n| n as usize + 1).max().unwrap_or(0))];
                for &n in nodes {
                    self.agent_nodes[n as usize] = true;
                }
            }
        }
        Ok(())
    }
}
