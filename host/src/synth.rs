//! Seeded synthetic fleets and tasks for the demo, benchmarks and tests.

use berth_core::{Fleet, Node, TaskShape};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `nodes` eight-GPU nodes over two models and switch domains of 32 nodes,
/// each partly occupied at random when `occupied` is true.
pub fn fleet(nodes: usize, seed: u64, occupied: bool) -> Fleet {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let models = vec!["H800".to_string(), "A100".to_string()];
    let nodes = (0..nodes)
        .map(|i| {
            let mut node = Node::new(format!("node-{i:05}"), Some((i % 2) as u32), 8, 128_000, 1 << 20);
            node.switch_domain = (i / 32) as u32;
            if occupied {
                for gpu in node.gpus.iter_mut() {
                    *gpu = [1000, 1000, 0, 500, 250, 750][rng.random_range(0..6)];
                }
                node.cpu_free_milli = rng.random_range(0..=128) * 1000;
                node.memory_free_mib = rng.random_range(0..=1024) << 10;
            }
            node
        })
        .collect();
    Fleet::new(models, nodes).expect("generated fleet is valid")
}

/// A random task shape: shared fractions, 1, 2, 4 and 8 whole GPUs, a few
/// CPU-only tasks; CPU and memory in proportion.
pub fn task(rng: &mut impl Rng) -> TaskShape {
    let (gpu_count, gpu_milli) = match rng.random_range(0..100) {
        0..5 => (0, 0),
        5..35 => (1, [250, 500, 750][rng.random_range(0..3)]),
        35..65 => (1, 1000),
        65..80 => (2, 1000),
        80..92 => (4, 1000),
        _ => (8, 1000),
    };
    let gpus = gpu_count.max(1);
    TaskShape {
        gpu_count,
        gpu_milli,
        cpu_milli: gpus * rng.random_range(2..=16) * 1000,
        memory_mib: u64::from(gpus) * rng.random_range(8..=96) * 1024,
        models: if rng.random_bool(0.7) { vec![rng.random_range(0..2)] } else { vec![] },
    }
}
