//! interference-aware: best fit, but CPU-only work and GPU training are kept
//! off each other's nodes (contract 0.4.0).
//!
//! The ASI paper found CPU-only jobs dominating CPU use on 80% of GPU nodes
//! and lowering the median training job's SM utilisation by 10% (p90 18%):
//! the GPU stays allocated while completed work falls. This policy scores a
//! node as best-fit does (least CPU and GPU left after the task, 0..100
//! points), then takes points off for the neighbours the task would get:
//!
//! - a CPU-only task loses `cpu_beside_gpu` points on a node running GPU
//!   tasks (more than best fit can give, so it goes to a node without GPU
//!   work whenever one fits), plus the node's measured CPU pressure;
//! - a training task loses points for the share of the node's CPU held by
//!   CPU-only tasks and for the measured CPU pressure and use;
//! - an inference task the same at `inference_share` of the weight.
//!
//! Measured columns (`cpu-pressure`, `cpu-used-milli`) come from the node's
//! agent; without one they are zero and the allocated CPU, so the policy
//! still separates the classes by what is allocated.

use berth_sdk::{Hooks, NodeView, Nodes, Policy, Scores, Task, TaskClass};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InterferenceAware {
    /// Largest node's CPU and GPU capacity, for the best-fit term.
    pub max_cpu_milli: f64,
    pub max_gpu_milli: f64,
    /// Points a CPU-only task loses on a node running GPU tasks.
    pub cpu_beside_gpu: f64,
    /// Points a training task loses per share of the node's CPU held by
    /// CPU-only tasks (all of it: this many points).
    pub gpu_beside_cpu: f64,
    /// Points lost per unit of measured CPU pressure (all of the last 10 s
    /// waiting: this many points).
    pub pressure: f64,
    /// Points a training task loses per share of the node's CPU measured in
    /// use beyond what is allocated to GPU tasks (work outside Berth, or
    /// tasks above their request).
    pub busy: f64,
    /// Inference is latency-bound, hurt less than training by a busy CPU:
    /// its penalties are this share of training's.
    pub inference_share: f64,
}

impl Default for InterferenceAware {
    fn default() -> Self {
        InterferenceAware {
            max_cpu_milli: 128_000.0,
            max_gpu_milli: 8_000.0,
            cpu_beside_gpu: 200.0,
            gpu_beside_cpu: 200.0,
            pressure: 100.0,
            busy: 50.0,
            inference_share: 0.5,
        }
    }
}

impl InterferenceAware {
    fn best_fit(&self, task: &Task, n: &NodeView) -> f64 {
        let left = (f64::from(n.cpu_free_milli) - f64::from(task.cpu_milli)) / self.max_cpu_milli * 0.5
            + (f64::from(n.gpu_free_total()) - task.total_gpu_milli() as f64) / self.max_gpu_milli * 0.5;
        ((1.0 - left) * 100.0).trunc()
    }

    /// Points the task loses for the neighbours it would get on `n`.
    fn penalty(&self, task: &Task, n: &NodeView) -> f64 {
        let c = &n.contention;
        let total = f64::from(n.cpu_total_milli.max(1));
        let pressure = f64::from(c.cpu_pressure) / 1000.0 * self.pressure;
        match task.class {
            TaskClass::CpuOnly => pressure + if c.gpu_tasks > 0 { self.cpu_beside_gpu } else { 0.0 },
            TaskClass::Training | TaskClass::Inference => {
                let share = if task.class == TaskClass::Inference { self.inference_share } else { 1.0 };
                let cpu_only = f64::from(c.cpu_only_milli) / total;
                // Use beyond the CPU-only and GPU tasks' requests is work the
                // host did not place (or tasks over their request).
                let allocated = f64::from(n.cpu_total_milli - n.cpu_free_milli);
                let beyond = (f64::from(c.cpu_used_milli) - allocated).max(0.0) / total;
                share * (cpu_only * self.gpu_beside_cpu + pressure + beyond * self.busy)
            }
        }
    }
}

impl Policy for InterferenceAware {
    const NAME: &'static str = "interference-aware";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        if !config.trim().is_empty() {
            let parsed: InterferenceAware = serde_json::from_str(config).map_err(|e| format!("interference-aware: bad configuration: {e}"))?;
            let weights = [parsed.max_cpu_milli, parsed.max_gpu_milli, parsed.cpu_beside_gpu, parsed.gpu_beside_cpu, parsed.pressure, parsed.busy, parsed.inference_share];
            if weights.iter().any(|w| !w.is_finite() || *w < 0.0) || parsed.max_cpu_milli == 0.0 || parsed.max_gpu_milli == 0.0 {
                return Err("interference-aware: every weight must be finite and >= 0, the capacities > 0".into());
            }
            *self = parsed;
        }
        Ok(())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        Ok(Scores::from_scores(nodes.iter().map(|n| self.best_fit(task, &n) - self.penalty(task, &n)).collect()))
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
        // Best fit alone would put the CPU-only task beside the GPU task's
        // node only if it were fuller; here it picks node 1 (less CPU free).
        let plain = Task { class: TaskClass::Training, ..cpu.clone() };
        let s = p.score(&plain, &n).unwrap().scores;
        assert!(s[1] < s[0], "training-classed work avoids the CPU-only node: {s:?}");
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
