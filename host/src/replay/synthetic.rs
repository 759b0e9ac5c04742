//! A seeded, generated cluster and pod list shaped like the openb trace
//! (mixed GPU models and node sizes; whole, shared, multi-GPU and CPU-only
//! pods), so the replay demo needs no trace files.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::openb::{NodeRow, PodRow};

/// `nodes` GPU nodes and a pod list whose GPU demand is about 100% of them.
pub fn trace(nodes: usize, seed: u64) -> (Vec<NodeRow>, Vec<PodRow>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // (model, GPUs, CPU milli, memory MiB, share of nodes in %)
    let shapes = [
        ("G2", 8, 96_000, 393_216, 45),
        ("T4", 2, 104_000, 524_288, 30),
        ("P100", 2, 64_000, 262_144, 10),
        ("V100M32", 8, 96_000, 786_432, 5),
        ("G3", 8, 128_000, 786_432, 5),
        ("V100M16", 4, 32_000, 131_072, 5),
    ];
    let mut node_rows = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let mut pick = rng.random_range(0..100);
        let shape = shapes.iter().find(|s| {
            if pick < s.4 {
                true
            } else {
                pick -= s.4;
                false
            }
        });
        let (model, gpus, cpu, mem, _) = *shape.unwrap_or(&shapes[0]);
        node_rows.push(NodeRow { name: format!("synth-node-{i:04}"), cpu_milli: cpu, memory_mib: mem, gpus, model: model.into() });
    }
    let capacity: u64 = node_rows.iter().map(|n| u64::from(n.gpus) * 1000).sum();
    let mut pods = Vec::new();
    let mut demand = 0;
    while demand < capacity {
        let (num_gpu, gpu_milli) = match rng.random_range(0..100) {
            0..13 => (0, 0),
            13..61 => (1, 1000),
            61..88 => (1, [230, 320, 470, 460, 650, 810][rng.random_range(0..6)]),
            88..95 => (2, 1000),
            95..98 => (4, 1000),
            _ => (8, 1000),
        };
        let cpu = [2_000, 4_000, 6_000, 8_000, 12_000, 16_000, 32_000][rng.random_range(0..7)] * num_gpu.max(1);
        let spec = if num_gpu > 0 && rng.random_bool(0.05) { vec!["V100M16".to_string(), "V100M32".to_string()] } else { vec![] };
        demand += u64::from(num_gpu) * u64::from(gpu_milli);
        pods.push(PodRow {
            name: format!("synth-pod-{:05}", pods.len()),
            cpu_milli: cpu,
            memory_mib: u64::from(cpu / 1000) * 4096,
            num_gpu,
            gpu_milli,
            gpu_spec: spec,
            qos: "LS".into(),
            creation_time: None,
            deletion_time: None,
        });
    }
    (node_rows, pods)
}
