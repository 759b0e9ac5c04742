//! fgd: Fragmentation Gradient Descent (Weng et al., "Beware of
//! Fragmentation", USENIX ATC'23). A node's fragmentation is the idle GPU
//! capacity that the workload's typical tasks, weighted by popularity,
//! cannot use there; FGD places each task where it grows fragmentation the
//! least, choosing the shared GPU inside the node the same way.
//!
//! Configuration (JSON): `{"typical_pods": [{"cpu_milli", "gpu_milli",
//! "gpu_count", "models": [...], "weight"}...]}`, the workload's most
//! popular shapes. Without it every GPU shape counts as typical equally.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use berth_sdk::{Hooks, NodeView, Nodes, Policy, Scores, Task};
use serde::Deserialize;

/// One typical task shape and its share of the workload.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct TypicalPod {
    pub cpu_milli: u32,
    /// Per-GPU thousandths; 0 for CPU-only shapes.
    pub gpu_milli: u32,
    pub gpu_count: u32,
    /// Accepted models by name; empty accepts any.
    #[serde(default)]
    pub models: Vec<String>,
    pub weight: f64,
}

#[derive(Deserialize, Default)]
struct Config {
    #[serde(default)]
    typical_pods: Vec<TypicalPod>,
}

/// Fragmentation of one node state, cached: most nodes are unchanged
/// between decisions and many share a state, so a hit is the common case.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct StateKey {
    model: u32,
    cpu_free: u32,
    gpus: u8,
    /// Free milli per GPU, sorted (fragmentation ignores GPU order).
    free: [u16; 8],
}

#[derive(Default)]
struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

const CACHE_LIMIT: usize = 1 << 18;

#[derive(Default)]
pub struct Fgd {
    typical: Vec<TypicalPod>,
    /// `typical[i].models` resolved against the batch's model table.
    resolved: Vec<Vec<u32>>,
    resolved_for: Vec<String>,
    cache: HashMap<StateKey, f64, BuildHasherDefault<FxHasher>>,
}

impl Fgd {
    pub fn with_typical_pods(typical: Vec<TypicalPod>) -> Fgd {
        Fgd { typical, ..Fgd::default() }
    }

    fn resolve_models(&mut self, models: &[String]) {
        if self.resolved_for.as_slice() == models && self.resolved.len() == self.typical.len() {
            return;
        }
        self.resolved = self
            .typical
            .iter()
            .map(|t| t.models.iter().map(|m| models.iter().position(|x| x == m).map_or(u32::MAX, |i| i as u32)).collect())
            .collect();
        self.resolved_for = models.to_vec();
        self.cache.clear();
    }

    /// Fragmentation of a node in the given state (see the module docs):
    /// for each typical shape, all idle GPU capacity counts unless the
    /// shape fits the node on CPU and GPU, in which case only the GPUs too
    /// small for it count.
    fn frag_uncached(&self, model: u32, cpu_free: u32, free: &[u32]) -> f64 {
        let total: u32 = free.iter().sum();
        let total = f64::from(total);
        // Buckets as the authors' code keeps them: q1 q2 q3 q4 xl xr na.
        let mut b = [0f64; 7];
        for (t, models) in self.typical.iter().zip(&self.resolved) {
            let f = t.weight;
            if t.gpu_milli == 0 {
                b[if cpu_free >= t.cpu_milli { 4 } else { 5 }] += f * total;
                continue;
            }
            if !t.models.is_empty() && !models.contains(&model) {
                b[6] += f * total;
                continue;
            }
            let fitting = free.iter().filter(|&&g| g >= t.gpu_milli).count() as u32;
            let cpu_ok = cpu_free >= t.cpu_milli;
            match (fitting >= t.gpu_count, cpu_ok) {
                (true, true) => {
                    let small: u32 = free.iter().filter(|&&g| g < t.gpu_milli).sum();
                    b[1] += f * f64::from(small);
                    b[2] += f * (total - f64::from(small));
                }
                (true, false) => b[3] += f * total,
                (false, true) => b[1] += f * total,
                (false, false) => b[0] += f * total,
            }
        }
        b[0] + b[1] + b[3] + b[4] + b[5] + b[6]
    }

    fn frag(&mut self, model: u32, cpu_free: u32, free: &[u32]) -> f64 {
        if free.len() > 8 {
            return self.frag_uncached(model, cpu_free, free);
        }
        let mut key = StateKey { model, cpu_free, gpus: free.len() as u8, free: [0; 8] };
        for (k, &g) in key.free.iter_mut().zip(free) {
            *k = g as u16;
        }
        key.free[..free.len()].sort_unstable();
        if let Some(&f) = self.cache.get(&key) {
            return f;
        }
        let f = self.frag_uncached(model, cpu_free, free);
        if self.cache.len() >= CACHE_LIMIT {
            self.cache.clear();
        }
        self.cache.insert(key, f);
        f
    }

    /// Score of one node and, for a shared GPU, the chosen GPU's mask.
    fn score_node(&mut self, task: &Task, node: &NodeView) -> (f64, u64) {
        let before = self.frag(node.model, node.cpu_free_milli, node.gpu_free_milli);
        let cpu_after = node.cpu_free_milli.saturating_sub(task.cpu_milli);
        let mut after = [0u32; 64];
        let n = node.gpu_free_milli.len().min(64);
        after[..n].copy_from_slice(&node.gpu_free_milli[..n]);
        let after = &mut after[..n];
        if task.gpu_count == 1 && task.gpu_milli < 1000 {
            // Try each fitting GPU; the first reaching the best whole-point
            // score wins. GPUs with equal free give equal scores.
            let mut best: Option<(f64, usize)> = None;
            let mut tried: Vec<u32> = Vec::with_capacity(8);
            let mut tried_score: Vec<f64> = Vec::with_capacity(8);
            for g in 0..n {
                let free = node.gpu_free_milli[g];
                if free < task.gpu_milli {
                    continue;
                }
                let s = match tried.iter().position(|&t| t == free) {
                    Some(i) => tried_score[i],
                    None => {
                        after[g] = free - task.gpu_milli;
                        let s = points(before - self.frag(node.model, cpu_after, after));
                        after[g] = free;
                        tried.push(free);
                        tried_score.push(s);
                        s
                    }
                };
                if best.is_none_or(|(b, _)| s > b) {
                    best = Some((s, g));
                }
            }
            return best.map_or((0.0, 0), |(s, g)| (s, 1u64 << g));
        }
        // Whole GPUs (or none): take the fitting GPUs with the least free,
        // lowest index first; for whole GPUs these are the first idle ones.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&g| after[g]);
        let mut taken = 0;
        for g in order {
            if taken == task.gpu_count {
                break;
            }
            if after[g] >= task.gpu_milli {
                after[g] -= task.gpu_milli;
                taken += 1;
            }
        }
        (points(before - self.frag(node.model, cpu_after, after)), 0)
    }
}

/// sigmoid(drop / 1000) in whole points, 0..=100, as the authors score.
fn points(frag_drop: f64) -> f64 {
    (100.0 / (1.0 + (-frag_drop / 1000.0).exp())).trunc()
}

impl Policy for Fgd {
    const NAME: &'static str = "fgd";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        let c: Config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(config).map_err(|e| format!("fgd: bad configuration: {e}"))?
        };
        if let Some(t) = c.typical_pods.iter().find(|t| !(t.weight.is_finite() && t.weight >= 0.0)) {
            return Err(format!("fgd: typical pod weight {} is not a non-negative number", t.weight));
        }
        *self = Fgd::with_typical_pods(c.typical_pods);
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        if self.typical.is_empty() {
            // No workload given: every GPU shape that can occur is typical.
            self.typical = [(1000u32, 1u32), (1000, 2), (1000, 4), (1000, 8), (500, 1), (250, 1)]
                .into_iter()
                .map(|(m, k)| TypicalPod { cpu_milli: 0, gpu_milli: m, gpu_count: k, models: vec![], weight: 1.0 / 6.0 })
                .collect();
        }
        self.resolve_models(&nodes.models);
        let mut scores = Vec::with_capacity(nodes.len());
        let mut gpus = Vec::with_capacity(nodes.len());
        for node in nodes.iter() {
            let (s, mask) = self.score_node(task, &node);
            scores.push(s);
            gpus.push(mask);
        }
        Ok(Scores { scores, gpus })
    }
}

berth_sdk::export!(Fgd);
