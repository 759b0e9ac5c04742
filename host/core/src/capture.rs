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

use serde::Serialize;

pub use crate::engine::{Input, PolicyRef};
use crate::engine::{Decision, Event, Pass, Slot};
use crate::fleet::{Fleet, Node, NodeId};
use crate::job::Job;
use crate::policy::PlacementPolicy;

/// The format's name and version, written in every file's header.
pub const FORMAT: &str = "berth-capture";
pub const VERSION: u32 = 1;

/// The most nodes a replayed fleet may name (a bound on what a file can ask
/// a replay to allocate).
pub const MAX_NODES: usize = 1 << 20;

/// The slots an input names (a registration makes its own).
fn slots_named(input: &Input) -> Vec<Slot> {
    fn of(e: &Event) -> Option<Slot> {
        match e {
            Event::Arrive(j) | Event::End(j) | Event::Cancel(j) | Event::Leaving(j) | Event::Requeue(j) | Event::Unstarted(j) | Event::Vacated(j) | Event::Checkpoint(j) | Event::SleepJob(j) | Event::WakeJob(j) => Some(*j),
            Event::FleetChanged | Event::Sleep | Event::Wake | Event::Compact => None,
        }
    }
    match input {
        Input::Forget { slot } | Input::RestoreRunning { slot, .. } | Input::RestoreSleeping { slot, .. } | Input::RestoreInterruptions { slot, .. } | Input::RestoreEvicting { slot, .. } | Input::ReplaceHeld { slot, .. } => vec![*slot],
        Input::RestoreAwaiting { slot, victims } => std::iter::once(*slot).chain(victims.iter().copied()).collect(),
        Input::Apply { event, .. } => of(event).into_iter().collect(),
        Input::Pass { events, .. } => events.iter().filter_map(of).collect(),
        _ => Vec::new(),
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
        // A capture is a file: a slot or node it names that does not exist
        // is an error here, never an index out of bounds in the engine.
        let slots = self.engine.slot_count();
        if let Some(bad) = slots_named(input).into_iter().find(|&s| s >= slots) {
            return Err(format!("input {at}: slot {bad} was never registered ({slots} slots)"));
        }
        let nodes = self.fleet.nodes().len();
        if let Input::ReplaceHeld { old, new, .. } = input
            && let Some(bad) = [old.node, new.node].into_iter().find(|&n| n as usize >= nodes)
        {
            return Err(format!("input {at}: node {bad} is not in the fleet ({nodes} nodes)"));
        }
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
                // Noted before the pass that adds a new agent's node: ids may
                // run a little past the fleet, never past a fleet's bound.
                if let Some(&bad) = nodes.iter().find(|&&n| n as usize >= MAX_NODES) {
                    return Err(format!("input {at}: node {bad} is past the {MAX_NODES} nodes a fleet may have"));
                }
                self.agent_nodes = vec![false; self.fleet.nodes().len().max(nodes.iter().map(|&n| n as usize + 1).max().unwrap_or(0))];
                for &n in nodes {
                    self.agent_nodes[n as usize] = true;
                }
            }
        }
        Ok(())
    }
}
