//! `berth demo`: a seeded, generated fleet and workload placed by bundled
//! wasm policies, side by side. Needs no trace files.

use std::sync::Arc;

use berth_core::{Fleet, PlacementPolicy, Placer, TaskMeta};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};
use crate::{catalog, synth};

#[derive(Debug, Serialize)]
pub struct DemoRow {
    pub policy: String,
    pub tasks: usize,
    pub placed: usize,
    pub unplaced: usize,
    /// Allocated milli-GPU over installed, %.
    pub allocated_pct: f64,
    /// Nodes with nothing allocated (room for 8-GPU jobs).
    pub idle_nodes: usize,
    /// Nodes partly occupied.
    pub partial_nodes: usize,
}

/// Offers the same seeded stream of tasks (GPU demand 110% of capacity) to
/// each policy on a fresh copy of the same fleet.
pub fn run(engine: Arc<PolicyEngine>, policies: &[String], nodes: usize, seed: u64) -> anyhow::Result<Vec<DemoRow>> {
    let base = synth::fleet(nodes, seed, false);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tasks = Vec::new();
    let mut demand = 0;
    while demand < base.gpu_total_milli() * 11 / 10 {
        let t = synth::task(&mut rng);
        demand += t.total_gpu_milli();
        tasks.push(t);
    }
    let mut rows = Vec::new();
    for spec in policies {
        let loaded = LoadedPolicy::from_file(&engine, &catalog::resolve(spec)?)?;
        let mut policy = WasmPolicy::new(engine.clone(), loaded, Limits::default());
        let mut fleet: Fleet = base.clone();
        let mut placer = Placer::new();
        let mut placed = 0;
        for (i, shape) in tasks.iter().enumerate() {
            let meta = TaskMeta { job_id: i as u64, class: berth_core::TaskClass::implied(shape.gpu_count), ..TaskMeta::default() };
            if let Some(p) = placer.place(&fleet, shape, meta, &mut policy, None)? {
                fleet.allocate(&Fleet::allocation(p.node, shape, p.gpus))?;
                placed += 1;
            }
        }
        fleet.check_invariants().map_err(anyhow::Error::msg)?;
        let idle = fleet.nodes().iter().filter(|n| n.is_idle()).count();
        rows.push(DemoRow {
            policy: policy.describe(),
            tasks: tasks.len(),
            placed,
            unplaced: tasks.len() - placed,
            allocated_pct: 100.0 * fleet.gpu_allocated_milli() as f64 / fleet.gpu_total_milli() as f64,
            idle_nodes: idle,
            partial_nodes: fleet.nodes().len() - idle,
        });
    }
    Ok(rows)
}
