//! The same policy source, compiled to wasm and natively, decides the same.

use berth::native;
use berth::wasm::Limits;
use berth_core::{Fleet, PlacementPolicy, Placer, TaskMeta};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::common::{policy_path, wasm_policy};

fn scores_agree(name: &str, nodes: usize, seed: u64, task_seed: u64) {
    let mut wasm = wasm_policy(&policy_path(name), Limits::default());
    let mut native = native::by_name(name).unwrap();
    let (mut task, mut batch) = berth::bench::batch(nodes, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(task_seed);
    let shape = berth::synth::task(&mut rng);
    task.gpu_count = shape.gpu_count;
    task.gpu_milli = shape.gpu_milli;
    task.cpu_milli = shape.cpu_milli;
    task.memory_mib = shape.memory_mib;
    let a = wasm.score(&task, &mut batch).unwrap();
    let b = native.score(&task, &mut batch).unwrap();
    assert_eq!(a.scores.len(), nodes);
    assert_eq!(a, b, "{name}: wasm and native disagree (nodes {nodes}, seed {seed}, task seed {task_seed})");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn binpack_wasm_scores_equal_native(nodes in 1usize..600, seed in any::<u64>(), task_seed in any::<u64>()) {
        scores_agree("binpack", nodes, seed, task_seed);
    }

    #[test]
    fn spread_wasm_scores_equal_native(nodes in 1usize..600, seed in any::<u64>(), task_seed in any::<u64>()) {
        scores_agree("spread", nodes, seed, task_seed);
    }
}

/// A whole placement run: every decision of the wasm build equals the
/// native build's, and the fleet never over-commits.
#[test]
fn binpack_placement_runs_match_native() {
    let mut wasm = wasm_policy(&policy_path("binpack"), Limits::default());
    let mut native = native::by_name("binpack").unwrap();
    let mut fleet_a: Fleet = berth::synth::fleet(64, 9, false);
    let mut fleet_b = fleet_a.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (mut placer_a, mut placer_b) = (Placer::new(), Placer::new());
    let mut placed = 0;
    for job in 0..700u64 {
        let shape = berth::synth::task(&mut rng);
        let meta = TaskMeta { job_id: job, ..Default::default() };
        let a = placer_a.place(&fleet_a, &shape, meta, &mut wasm, None).unwrap();
        let b = placer_b.place(&fleet_b, &shape, meta, &mut *native, None).unwrap();
        assert_eq!(a, b, "job {job}");
        if let Some(p) = a {
            fleet_a.allocate(&Fleet::allocation(p.node, &shape, p.gpus)).unwrap();
            fleet_b.allocate(&Fleet::allocation(p.node, &shape, p.gpus)).unwrap();
            placed += 1;
        }
    }
    fleet_a.check_invariants().unwrap();
    assert!(placed > 100 && placed < 700, "the run should both place and run out of room: {placed}");
}
