//! interference-aware: topology-aware packing (topo-entropy's), with
//! CPU-only work and GPU training kept off each other's nodes (contract
//! 0.4.0).
//!
//! The ASI paper found CPU-only jobs dominating CPU use on 80% of GPU nodes
//! and lowering the median training job's SM utilisation by 10% (p90 18%):
//! the GPU stays allocated while completed work falls. This policy scores a
//! node as topo-entropy does (fullest node, busiest switch domain: about
//! 0..110 points; gangs choose their domain as topo-entropy does), then
//! moves points for the neighbours the task would get:
//!
//! - a CPU-only task gains `cpu_cluster` points on a node that already runs
//!   CPU-only work (so such work gathers on few nodes, packed by CPU) and
//!   loses `cpu_beside_gpu` on a node running GPU tasks;
//! - a training task loses `gpu_beside_cpu` points on a node running
//!   CPU-only work (plus its share of the node's CPU), and points for the
//!   measured CPU pressure and for CPU in use beyond what is allocated;
//! - an inference task the same at `inference_share` of the weight (0 by
//!   default: serving tolerates the neighbours training does not, and the
//!   GPUs of nodes with CPU-only work are then put to use).
//!
//! Measured columns (`cpu-pressure`, `cpu-used-milli`) come from the node's
//! agent; without one they are zero and the allocated CPU, so the policy
//! still separates the classes by what is allocated.

#[path = "../../topo-entropy/src/score.rs"]
mod topo;

use topo::TopoEntropy;
use berth_sdk::{Domains, Hooks, NodeView, Nodes, Policy, Scores, Task, TaskClass};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InterferenceAware {
    /// Points a CPU-only task gains on a node already running CPU-only work.
    pub cpu_cluster: f64,
    /// Points a CPU-only task loses on a node running GPU tasks.
    pub cpu_beside_gpu: f64,
    /// Points a CPU-only task gains for the share of the node's CPU it
    /// leaves allocated (packs CPU-only work by CPU).
    pub cpu_fit: f64,
    /// Points a training task loses on a node running CPU-only work, plus
    /// as many again for all of its CPU held by CPU-only tasks.
    pub gpu_beside_cpu: f64,
    /// Points lost per unit of measured CPU pressure (all of the last 10 s
    /// waiting: this many points).
    pub pressure: f64,
    /// Points a training task loses per share of the node's CPU measured in
    /// use beyond what is allocated (work outside Berth, or tasks above
    /// their request).
    pub busy: f64,
    /// Inference's penalties as a share of training's.
    pub inference_share: f64,
}

impl Default for InterferenceAware {
    fn default() -> Self {
        InterferenceAware { cpu_cluster: 150.0, cpu_beside_gpu: 100.0, cpu_fit: 20.0, gpu_beside_cpu: 150.0, pressure: 100.0, busy: 50.0, inference_share: 0.0 }
    }
}

impl InterferenceAware {
    /// Points the task gains (positive) or loses for the neighbours it
    /// would get on `n`.
    fn neighbours(&self, task: &Task, n: &NodeView) -> f64 {
        let c = &n.contention;
        let total = f64::from(n.cpu_total_milli.max(1));
        let pressure = f64::from(c.cpu_pressure) / 1000.0 * self.pressure;
        match task.class {
            TaskClass::CpuOnly => {
                let cluster = if c.cpu_only_milli > 0 { self.cpu_cluster } else { 0.0 };
                let beside_gpu = if c.gpu_tasks > 0 { self.cpu_beside_gpu } else { 0.0 };
                let fit = (f64::from(n.cpu_total_milli - n.cpu_free_milli) + f64::from(task.cpu_milli)) / total * self.cpu_fit;
                cluster + fit - beside_gpu - pressure
            }
            TaskClass::Training | TaskClass::Inference => {
                let share = if task.class == TaskClass::Inference { self.inference_share } else { 1.0 };
                let cpu_only = if c.cpu_only_milli > 0 { 1.0 + f64::from(c.cpu_only_milli) / total } else { 0.0 };
                // Use beyond what is allocated is work the host did not
                // place (or tasks over their request).
                let allocated = f64::from(n.cpu_total_milli - n.cpu_free_milli);
                let beyond = (f64::from(c.cpu_used_milli) - allocated).max(0.0) / total;
                -share * (cpu_only * self.gpu_beside_cpu + pressure + beyond * self.busy)
            }
        }
    }
}

impl Policy for InterferenceAware {
    const NAME: &'static str = "interference-aware";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE.union(Hooks::DOMAINS);

    fn configure(&mut self, config: &str) -> Result<(), String> {
        if !config.trim().is_empty() {
            let parsed: InterferenceAware = serde_json::from_str(config).map_err(|e| format!("interference-aware: bad configuration: {e}"))?;
            let weights = [parsed.cpu_cluster, parsed.cpu_beside_gpu, parsed.cpu_fit, parsed.gpu_beside_cpu, parsed.pressure, parsed.busy, parsed.inference_share];
            if weights.iter().any(|w| !w.is_finite() || *w < 0.0 || *w > 1e6) {
                return Err("interference-aware: every weight must be finite, in 0..=1e6".into());
            }
            *self = parsed;
        }
        Ok(())
    }

    fn score_domains(&mut self, task: &Task, domains: &Domains) -> Result<Vec<f64>, String> {
        TopoEntropy.score_domains(task, domains)
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        let mut scores = TopoEntropy.score(task, nodes)?;
        for (s, n) in scores.scores.iter_mut().zip(nodes.iter()) {
            *s += self.neighbours(task, &n);
        }
        Ok(scores)
    }
}

berth_sdk::export!(InterferenceAware);

#[cfg(test)]
mod tests {
    use super::*;
    use berth_sdk::Contention;

    /// Two 8-GPU nodes: node 0 runs a GPU task, node 1 runs CPU-only work.
    fn two_nodes() -> Nodes {
        let mut n = Nodes { models: vec!["H800".into()], ..Nodes::default() };
        n.push(0, 0, 0, 96_000, 128_000, 1 << 20, 1 << 21, &[0, 1000, 1000, 1000, 1000, 1000, 1000, 1000], 2);
        n.set_contention(0, Contention { gpu_tasks: 1, cpu_used_milli: 32_000, ..Contention::default() });
        n.push(1, 0, 0, 64_000, 128_000, 1 << 20, 1 << 21, &[1000; 8], 0);
        n.set_contention(1, Contention { cpu_only_milli: 64_000, cpu_used_milli: 64_000, ..Contention::default() });
        n
    }

    fn best(scores: &[f64]) -> usize {
        (0..scores.len()).max_by(|&a, &b| scores[a].total_cmp(&scores[b])).unwrap()
    }

    #[test]
    fn cpu_only_work_goes_where_no_gpu_task_runs_and_training_where_no_cpu_only_work_does() {
        let mut p = InterferenceAware::default();
        let n = two_nodes();
        let cpu = Task { cpu_milli: 8000, memory_mib: 1024, class: TaskClass::CpuOnly, ..Task::default() };
        assert_eq!(best(&p.score(&cpu, &n).unwrap().scores), 1);
        let train = Task { gpu_count: 1, gpu_milli: 1000, cpu_milli: 8000, class: TaskClass::Training, ..Task::default() };
        assert_eq!(best(&p.score(&train, &n).unwrap().scores), 0);
        // topo-entropy alone puts the CPU-only task on the node with the
        // fuller GPUs, beside the GPU task.
        let plain = TopoEntropy.score(&cpu, &n).unwrap().scores;
        assert_eq!(best(&plain), 0, "{plain:?}");
    }

    #[test]
    fn measured_pressure_counts_against_a_node() {
        let mut p = InterferenceAware::default();
        let mut n = two_nodes();
        let train = Task { gpu_count: 1, gpu_milli: 1000, cpu_milli: 8000, class: TaskClass::Training, ..Task::default() };
        let calm = p.score(&train, &n).unwrap().scores[0];
        n.set_contention(0, Contention { gpu_tasks: 1, cpu_used_milli: 32_000, cpu_pressure: 500, ..Contention::default() });
        let pressed = p.score(&train, &n).unwrap().scores[0];
        assert!(pressed < calm - 40.0, "{calm} -> {pressed}");
    }

    #[test]
    fn a_bad_configuration_is_refused_and_the_old_one_kept() {
        let mut p = InterferenceAware::default();
        assert!(p.configure(r#"{"pressure": -1}"#).is_err());
        assert!(p.configure(r#"{"presure": 1}"#).is_err());
        assert_eq!(p.pressure, 100.0);
        p.configure(r#"{"cpu_beside_gpu": 50}"#).unwrap();
        assert_eq!(p.cpu_beside_gpu, 50.0);
    }
}
