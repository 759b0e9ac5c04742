//! topo-entropy's scoring, without the component export: other policies
//! build on it by including this file (a second crate exporting the
//! contract's functions would collide with theirs at link time).

use std::collections::HashMap;

use berth_sdk::{Domains, Hooks, Nodes, Policy, Scores, Task};

#[derive(Default)]
pub struct TopoEntropy;

fn xlnx(x: f64) -> f64 {
    if x > 0.0 { x * x.ln() } else { 0.0 }
}

/// Entropy of free capacity over domains after taking `take` tasks' worth
/// from domain `d`, from the precomputed sums (O(1) per domain).
fn entropy_after(sum: f64, sum_xlnx: f64, free_d: f64, take: f64) -> f64 {
    let s = sum - take;
    if s <= 0.0 {
        return 0.0;
    }
    let a = sum_xlnx - xlnx(free_d) + xlnx(free_d - take);
    s.ln() - a / s
}

impl Policy for TopoEntropy {
    const NAME: &'static str = "topo-entropy";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::SCORE.union(Hooks::DOMAINS);

    fn score_domains(&mut self, task: &Task, domains: &Domains) -> Result<Vec<f64>, String> {
        let need = f64::from(task.gang_size.max(1));
        let free: Vec<f64> = domains.fitting_tasks.iter().map(|&f| f64::from(f)).collect();
        let sum: f64 = free.iter().sum();
        let sum_xlnx: f64 = free.iter().map(|&f| xlnx(f)).sum();
        Ok(free
            .iter()
            .map(|&f| {
                if f >= need {
                    // Lower entropy after placing is better; 1e6 above any
                    // domain that cannot hold the gang alone.
                    2e6 - 1e3 * entropy_after(sum, sum_xlnx, f, need)
                } else {
                    f
                }
            })
            .collect())
    }

    fn score(&mut self, task: &Task, nodes: &Nodes) -> Result<Scores, String> {
        // Busyness of each domain among the candidates: share of their GPU
        // capacity in use.
        let mut per_domain: HashMap<u32, (f64, f64)> = HashMap::new();
        for n in nodes.iter() {
            let e = per_domain.entry(n.switch_domain).or_insert((0.0, 0.0));
            e.0 += f64::from(n.gpu_free_total());
            e.1 += 1000.0 * f64::from(n.gpu_count());
        }
        let scores = nodes
            .iter()
            .map(|n| {
                let total = 1000.0 * f64::from(n.gpu_count());
                let fullness = if total > 0.0 {
                    (total - f64::from(n.gpu_free_total()) + task.total_gpu_milli() as f64) / total
                } else {
                    0.0
                };
                let (free, cap) = per_domain[&n.switch_domain];
                let busy = if cap > 0.0 { 1.0 - free / cap } else { 0.0 };
                100.0 * fullness + 10.0 * busy
            })
            .collect();
        Ok(Scores::from_scores(scores))
    }
}

