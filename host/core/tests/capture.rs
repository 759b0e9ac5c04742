//! Capture and exact re-decision in the core: a world drives an engine with
//! capture on (arrivals, passes, ends, cancels, checkpoints, a node cordoned
//! outside the engine, preemption); the captured inputs, through JSON, make a
//! fresh engine decide exactly the same; another policy does not.

mod common;

use berth_core::capture::{Input, Replayer};
use berth_core::engine::{Deciders, Event, SimConfig};
use berth_core::preemption::PreemptionPolicy;
use berth_core::{Fleet, Job, Node, PlacementPolicy, PolicyError, TaskShape, World};
use berth_sdk::{Allocations, Nodes, Scores, Task};
use rand::{Rng, SeedableRng};

/// Packs: the fullest node first.
struct Pack;

impl PlacementPolicy for Pack {
    fn describe(&self) -> String {
        "pack".into()
    }
    fn score(&mut self, _task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Ok(Scores::from_scores(nodes.iter().map(|n| -f64::from(n.gpu_free_total())).collect()))
    }
}

/// Takes the newest victims first.
struct Newest;

impl PreemptionPolicy for Newest {
    fn describe(&self) -> String {
        "newest".into()
    }
    fn rank(&mut self, _demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        let mut order: Vec<u32> = (0..victims.len() as u32).collect();
        order.reverse();
        Ok(Some(order))
    }
}

fn job(id: u64, now: u64, gpus: u32, priority: u32) -> Job {
    Job {
        id,
        priority,
        arrival_s: now,
        duration_s: 10_000,
        tasks: 1 + u32::from(gpus == 8 && id % 3 == 0),
        shape: TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000 * gpus, memory_mib: 1024, models: vec![] },
        ..Job::default()
    }
}

/// Drives an engine as a live world would, with capture on; returns the
/// captured inputs and how many decisions were made.
fn drive(seed: u64) -> (Vec<Input>, usize) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut fleet = Fleet::new(vec!["A".into()], (0..6).map(|i| Node::new(format!("n{i}"), Some(0), 8, 64_000, 512_000)).collect()).unwrap();
    let config = SimConfig { high_priority: 10, ..SimConfig::default() };
    let mut engine = berth_core::Engine::new(config);
    engine.start_capture(&fleet);
    let (mut place, mut rank) = (Pack, Newest);
    let mut slots = Vec::new();
    let mut decided = 0;
    for step in 0..400u64 {
        let now = step * 30;
        match rng.random_range(0..10) {
            0..=3 => {
                let gpus = [1, 2, 4, 8][rng.random_range(0..4)];
                let slot = engine.register(job(step, now, gpus, if rng.random_bool(0.3) { 20 } else { 1 }));
                engine.apply(&mut fleet, now, Event::Arrive(slot));
                slots.push(slot);
            }
            4 if !slots.is_empty() => {
                let slot = slots.swap_remove(rng.random_range(0..slots.len()));
                engine.apply(&mut fleet, now, Event::End(slot));
                engine.forget(slot);
            }
            5 if !slots.is_empty() => {
                let slot = slots.swap_remove(rng.random_range(0..slots.len()));
                engine.apply(&mut fleet, now, Event::Cancel(slot));
                engine.forget(slot);
            }
            6 if !slots.is_empty() => {
                let slot = slots[rng.random_range(0..slots.len())];
                engine.apply(&mut fleet, now, Event::Checkpoint(slot));
            }
            7 => {
                // The world cordons or uncordons a node outside the engine.
                let id = rng.random_range(0..6);
                let on = !fleet.node(id).unwrap().schedulable;
                fleet.set_schedulable(id, on).unwrap();
                engine.apply(&mut fleet, now, Event::FleetChanged);
            }
            _ => {}
        }
        let mut deciders = Deciders { placement: &mut place, preemption: Some(&mut rank), compaction: None };
        let pass = engine.handle(&mut fleet, now, [], &mut deciders, &mut World::default());
        decided += pass.decisions.len();
        // Evicted work reports its exit a little later.
        for d in &pass.decisions {
            if let berth_core::Decision::Evict { slot, .. } = d {
                engine.apply(&mut fleet, now + 5, Event::Vacated(*slot));
            }
        }
    }
    (engine.take_captured(), decided)
}

fn replay(inputs: &[Input], place: &mut dyn PlacementPolicy) -> Replayer {
    let mut replayer = Replayer::new(&inputs[0]).unwrap();
    let mut rank = Newest;
    for input in &inputs[1..] {
        replayer.step(input, &mut *place, Some(&mut rank)).unwrap();
        if !replayer.fidelity.exact() {
            // What follows was decided on a fleet this replay no longer has.
            break;
        }
    }
    replayer
}

#[test]
fn a_captured_run_is_decided_again_exactly() {
    for seed in 1..=3 {
        let (inputs, decided) = drive(seed);
        assert!(decided > 50, "seed {seed}: only {decided} decisions");
        assert!(inputs.iter().any(|i| matches!(i, Input::Nodes { .. })), "a cordon outside the engine is captured as node states");
        assert!(inputs.iter().any(|i| matches!(i, Input::Pass { decisions, .. } if decisions.iter().any(|d| matches!(d, berth_core::Decision::Evict { .. })))), "seed {seed}: no preemption");
        // Through the file format.
        let text: String = inputs.iter().map(|i| serde_json::to_string(i).unwrap() + "\n").collect();
        let read: Vec<Input> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(read.len(), inputs.len());
        if let Some(k) = (0..read.len()).find(|&k| read[k] != inputs[k]) {
            panic!("input {k} reads back as {:?}, written as {:?}", read[k], inputs[k]);
        }
        let replayer = replay(&read, &mut Pack);
        let f = &replayer.fidelity;
        assert!(f.exact(), "seed {seed}: {:?}", f.first_difference);
        assert_eq!(f.identical, f.decisions);
        assert!(f.decisions as usize >= decided, "every decision compared: {} of {decided}", f.decisions);
    }
}

#[test]
fn another_policy_is_caught_at_its_first_difference() {
    let (inputs, _) = drive(1);
    let replayer = replay(&inputs, &mut common::FirstFit);
    let f = &replayer.fidelity;
    let first = f.first_difference.as_ref().expect("first-fit decides otherwise than pack");
    assert!(f.identical < f.decisions);
    assert!(first.captured.is_some() || first.replayed.is_some());
    assert!(first.input > 0 && first.input < inputs.len());
}

#[test]
fn a_replay_refuses_input_that_does_not_start_a_capture() {
    let (inputs, _) = drive(2);
    assert!(Replayer::new(&inputs[1]).is_err());
    let mut replayer = Replayer::new(&inputs[0]).unwrap();
    let err = replayer.step(&inputs[0], &mut Pack, None).unwrap_err();
    assert!(err.contains("second start"), "{err}");
}
