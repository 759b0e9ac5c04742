//! Property tests of the core: whatever sequence of placements and releases
//! happens, nothing is ever over-committed and accounting stays exact.

use berth_core::placement::{default_gpus, validate_mask};
use berth_core::{Fleet, Node, PlacementPolicy, Placer, PolicyError, TaskMeta, TaskShape, predicate};
use berth_sdk::{Nodes, Scores, Task};
use proptest::prelude::*;

/// A test policy: scores are a function of free resources, GPU choice is
/// left to the host. Simple, deterministic, and not the core's own logic.
struct MostFree;

impl PlacementPolicy for MostFree {
    fn describe(&self) -> String {
        "most-free".into()
    }
    fn score(&mut self, _task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Ok(Scores::from_scores(nodes.iter().map(|n| f64::from(n.gpu_free_total()) + f64::from(n.cpu_free_milli) / 1e6).collect()))
    }
}

fn arb_shape() -> impl Strategy<Value = TaskShape> {
    (0u32..5, 1u32..=1000, 0u32..40_000, 0u64..100_000, prop::option::of(0u32..2)).prop_map(|(kind, milli, cpu, mem, model)| {
        let (gpu_count, gpu_milli) = match kind {
            0 => (0, 0),
            1 => (1, milli),
            2 => (1, 1000),
            3 => (2, 1000),
            _ => (4, 1000),
        };
        TaskShape { gpu_count, gpu_milli, cpu_milli: cpu, memory_mib: mem, models: model.into_iter().collect() }
    })
}

fn small_fleet(gpus_per_node: usize) -> Fleet {
    let nodes = (0..12)
        .map(|i| {
            let mut n = Node::new(format!("n{i}"), Some(i % 2), if i == 11 { 0 } else { gpus_per_node }, 64_000, 256_000);
            n.switch_domain = i / 4;
            n
        })
        .map(|mut n| {
            if n.gpus.is_empty() {
                n.model = None;
            }
            n
        })
        .collect();
    Fleet::new(vec!["A".into(), "B".into()], nodes).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn placements_never_over_commit(shapes in prop::collection::vec(arb_shape(), 1..150), releases in prop::collection::vec(any::<prop::sample::Index>(), 0..60), gpus in 1usize..9) {
        let mut fleet = small_fleet(gpus);
        let mut placer = Placer::new();
        let mut held = Vec::new();
        let mut releases = releases.into_iter();
        for (i, shape) in shapes.iter().enumerate() {
            prop_assert!(shape.check().is_ok());
            // The brief free summary never rules out a node the predicate
            // accepts (candidates are filtered by it first).
            for (n, f) in fleet.nodes().iter().zip(fleet.free_summaries()) {
                prop_assert!(f.may_fit(shape) || predicate::check(n, shape).is_err(), "node {}: ruled out by its summary {:?}, accepted by the predicate", n.name, f);
            }
            match placer.place(&fleet, shape, TaskMeta { job_id: i as u64, ..Default::default() }, &mut MostFree, None).unwrap() {
                Some(p) => {
                    let node = &fleet.nodes()[p.node as usize];
                    prop_assert!(predicate::check(node, shape).is_ok());
                    prop_assert_eq!(p.gpus.count_ones(), shape.gpu_count);
                    let alloc = Fleet::allocation(p.node, shape, p.gpus);
                    fleet.allocate(&alloc).unwrap();
                    held.push(alloc);
                }
                None => {
                    // Nothing fits: the predicate must agree for every node.
                    prop_assert!(fleet.nodes().iter().all(|n| predicate::check(n, shape).is_err()));
                }
            }
            if i % 3 == 0 && !held.is_empty() {
                if let Some(ix) = releases.next() {
                    let alloc = held.swap_remove(ix.index(held.len()));
                    fleet.release(&alloc).unwrap();
                }
            }
            prop_assert!(fleet.check_invariants().is_ok(), "{:?}", fleet.check_invariants());
        }
        let held_milli: u64 = held.iter().map(|a| a.gpu_milli_total()).sum();
        prop_assert_eq!(fleet.gpu_allocated_milli(), held_milli);
        for alloc in held.drain(..) {
            fleet.release(&alloc).unwrap();
        }
        prop_assert_eq!(fleet.gpu_allocated_milli(), 0);
        prop_assert!(fleet.nodes().iter().all(|n| n.is_idle()));
    }

    #[test]
    fn over_commit_is_refused_and_changes_nothing(shape in arb_shape(), repeat in 1usize..40) {
        let mut fleet = small_fleet(8);
        let node = 0;
        let before_total = fleet.gpu_allocated_milli();
        let mut ok = 0;
        for _ in 0..repeat {
            let mask = default_gpus(&fleet.nodes()[node], &shape);
            let snapshot = fleet.nodes()[node].clone();
            let fits = predicate::check(&snapshot, &TaskShape { models: vec![], ..shape.clone() }).is_ok();
            if mask.count_ones() != shape.gpu_count {
                prop_assert!(!fits);
                continue;
            }
            let alloc = Fleet::allocation(node as u32, &shape, mask);
            match fleet.allocate(&alloc) {
                Ok(()) => { prop_assert!(fits); ok += 1; }
                Err(_) => prop_assert_eq!(&fleet.nodes()[node], &snapshot),
            }
        }
        prop_assert!(fleet.check_invariants().is_ok());
        prop_assert!(fleet.gpu_allocated_milli() >= before_total);
        prop_assert!(ok <= repeat);
    }
}

#[test]
fn release_of_what_was_never_held_is_refused() {
    let mut fleet = small_fleet(8);
    let shape = TaskShape { gpu_count: 1, gpu_milli: 300, cpu_milli: 10, memory_mib: 10, models: vec![] };
    let err = fleet.release(&Fleet::allocation(0, &shape, 1)).unwrap_err();
    assert!(err.to_string().contains("not allocated"), "{err}");
    assert_eq!(fleet.gpu_allocated_milli(), 0);
}

#[test]
fn masks_are_validated() {
    let fleet = small_fleet(4);
    let node = &fleet.nodes()[0];
    let two = TaskShape { gpu_count: 2, gpu_milli: 1000, ..Default::default() };
    assert!(validate_mask(node, 0, &two, 0b11).is_ok());
    assert!(validate_mask(node, 0, &two, 0b1).is_err(), "wrong count");
    assert!(validate_mask(node, 0, &two, 0b1_0001).is_err(), "GPU 4 does not exist");
}

#[test]
fn model_alternatives_are_honoured() {
    let fleet = small_fleet(8);
    let want_b = TaskShape { gpu_count: 1, gpu_milli: 1000, models: vec![1], ..Default::default() };
    let reasons = Placer::unfit_reasons(&fleet, &want_b);
    // Nodes 0,2,..,10 are model A (6 nodes) and node 11 has no GPU.
    assert_eq!(reasons.get(&berth_core::Unfit::ModelMismatch), Some(&7));
    let either = TaskShape { models: vec![0, 1], ..want_b };
    assert_eq!(Placer::unfit_reasons(&fleet, &either).get(&berth_core::Unfit::ModelMismatch), Some(&1));
}

/// A domain-local test policy that also names GPUs: prefers fuller nodes in
/// fuller domains
/// (scores tie often, so the tie order matters) and picks the highest-index
/// fitting GPUs, never the host's default.
struct FullestHighGpus;

impl PlacementPolicy for FullestHighGpus {
    fn describe(&self) -> String {
        "fullest-high-gpus".into()
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        let mut scores = Vec::new();
        let mut masks = Vec::new();
        // Busyness of each switch domain among the candidates, as the
        // topology policy uses it: allowed by the locality rule.
        let mut per_domain: std::collections::HashMap<u32, u64> = Default::default();
        for n in nodes.iter() {
            *per_domain.entry(n.switch_domain).or_default() += u64::from(n.gpu_free_total());
        }
        for n in nodes.iter() {
            scores.push(-f64::from(n.gpu_free_total() / 1000) - (per_domain[&n.switch_domain] / 4000) as f64);
            let mut mask = 0u64;
            let fitting = n.gpu_free_milli.iter().enumerate().rev().filter(|&(_, &f)| f >= task.gpu_milli);
            for (g, _) in fitting.take(task.gpu_count as usize) {
                mask |= 1 << g;
            }
            masks.push(if task.gpu_count == 0 { 0 } else { mask });
        }
        Ok(Scores { scores, gpus: masks })
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// A gang placed with one scoring call (plus one-node rescoring) lands
    /// exactly where one call per task would put it, and a gang that does
    /// not fit leaves the fleet as it was.
    #[test]
    fn gang_placement_matches_task_by_task(
        background in prop::collection::vec(arb_shape(), 0..40),
        gang in arb_shape(),
        count in 1u32..12,
        ranked in any::<bool>(),
        fullest in any::<bool>(),
    ) {
        let mut fleet = small_fleet(8);
        let mut placer = Placer::new();
        for (i, shape) in background.iter().enumerate() {
            if let Some(p) = placer.place(&fleet, shape, TaskMeta { job_id: i as u64, ..Default::default() }, &mut MostFree, None).unwrap() {
                fleet.allocate(&Fleet::allocation(p.node, shape, p.gpus)).unwrap();
            }
        }
        let tie_rank: Vec<u32> = (0..12).map(|i| (i * 7) % 12).collect();
        let tie_rank = ranked.then_some(&tie_rank[..]);
        let mut policy: Box<dyn PlacementPolicy> = if fullest { Box::new(FullestHighGpus) } else { Box::new(MostFree) };
        let meta = TaskMeta { job_id: 99, gang_size: count, ..Default::default() };

        // The reference: one call per task, allocating as it goes.
        let mut by_task = fleet.clone();
        let mut expected = Vec::new();
        for index in 0..count {
            match placer.place(&by_task, &gang, TaskMeta { gang_index: index, ..meta }, policy.as_mut(), tie_rank).unwrap() {
                Some(p) => {
                    let alloc = Fleet::allocation(p.node, &gang, p.gpus);
                    by_task.allocate(&alloc).unwrap();
                    expected.push(alloc);
                }
                None => {
                    expected.clear();
                    break;
                }
            }
        }

        let before = fleet.clone();
        let got = placer.place_tasks(&mut fleet, &gang, meta, count, policy.as_mut(), tie_rank, &|_, _| true).unwrap();
        match got {
            Some(allocs) => {
                prop_assert_eq!(&allocs, &expected);
                prop_assert_eq!(fleet.nodes(), by_task.nodes());
            }
            None => {
                prop_assert!(expected.is_empty(), "task by task placed {} tasks", expected.len());
                prop_assert_eq!(fleet.nodes(), before.nodes());
            }
        }
        prop_assert!(fleet.check_invariants().is_ok());
    }
}
