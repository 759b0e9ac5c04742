//! The FGD paper's experiment protocol (Weng et al., ATC'23), as their
//! simulator runs it: the GPU nodes of a node list; the pod list sorted by
//! name, shuffled with the seed, then tuned to 130% of the cluster's GPU
//! capacity; pods placed one at a time with no departures; the unallocated
//! GPU share sampled at each 1% of arrived GPU demand.
//!
//! Go's random stream is not reproduced, so single seeds differ from the
//! authors'; means over seeds are what compare. No IO here.

use berth_core::{Fleet, Node, PlacementPolicy, Placer, PolicyError, TaskMeta, TaskShape};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::openb::{NodeRow, PodRow};
use super::report::{Curve, MAX_ARRIVAL_PCT};

/// Tuned GPU demand, as a multiple of the cluster's GPU capacity.
pub const TUNE_TARGET: f64 = 1.3;

/// A cluster and workload ready to replay with many seeds and policies.
pub struct Experiment {
    fleet: Fleet,
    /// Name-sorted pods with their shapes.
    pods: Vec<(PodRow, TaskShape)>,
    /// Node names, for the seeded tie-break.
    node_names: Vec<String>,
}

/// What one (policy, seed) run produced.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub curve: Curve,
    pub pods_offered: usize,
    pub pods_placed: usize,
    /// Unallocated GPU % after the last pod.
    pub final_unallocated_pct: f64,
    /// Every attempt in order: (pod index in the name-sorted list, node and
    /// GPU mask, or `None` when nothing fitted).
    pub decisions: Vec<(usize, Option<(u32, u64)>)>,
}

impl Experiment {
    /// Builds the cluster from the GPU nodes of `nodes` (CPU-only nodes are
    /// left out, as the authors' cluster is their GPU node list) and checks
    /// every pod against the models the cluster knows.
    pub fn new(nodes: &[NodeRow], pods: &[PodRow]) -> Result<Experiment, String> {
        let mut models: Vec<String> = Vec::new();
        let mut fleet_nodes = Vec::new();
        let mut node_names = Vec::new();
        for row in nodes.iter().filter(|n| n.gpus > 0) {
            let model = berth_core::fleet::intern_model(&mut models, &row.model);
            fleet_nodes.push(Node::new(&row.name, Some(model), row.gpus as usize, row.cpu_milli, row.memory_mib));
            node_names.push(row.name.clone());
        }
        if fleet_nodes.is_empty() {
            return Err("the node list has no GPU nodes".into());
        }
        let fleet = Fleet::new(models, fleet_nodes).map_err(|e| e.to_string())?;
        let mut sorted: Vec<&PodRow> = pods.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        let mut shaped = Vec::with_capacity(sorted.len());
        for pod in sorted {
            // A model the cluster lacks is not an error: such a pod simply
            // never fits (as in the authors' simulator).
            let models = pod.gpu_spec.iter().map(|m| fleet.model_id(m).unwrap_or(u32::MAX)).collect();
            let shape = TaskShape {
                gpu_count: pod.num_gpu,
                gpu_milli: if pod.num_gpu == 0 { 0 } else { pod.gpu_milli },
                cpu_milli: pod.cpu_milli,
                memory_mib: pod.memory_mib,
                models,
            };
            shape.check().map_err(|e| format!("pod {}: {e}", pod.name))?;
            shaped.push((pod.clone(), shape));
        }
        Ok(Experiment { fleet, pods: shaped, node_names })
    }

    /// Writes one run's decisions as CSV: `step,pod,node,gpus` (node empty
    /// and gpus empty for a pod that fitted nowhere; gpus as indexes joined
    /// by `|`), for pod-by-pod comparison with another simulator.
    pub fn decisions_csv(&self, run: &RunResult) -> String {
        let mut out = String::from("step,pod,node,gpus\n");
        for (step, (pod, placed)) in run.decisions.iter().enumerate() {
            let (node, gpus) = match placed {
                Some((n, mask)) => (
                    self.node_names[*n as usize].as_str(),
                    berth_core::fleet::gpus_of(*mask).map(|g| g.to_string()).collect::<Vec<_>>().join("|"),
                ),
                None => ("", String::new()),
            };
            out.push_str(&format!("{step},{},{node},{gpus}\n", self.pods[*pod].0.name));
        }
        out
    }

    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// Pods of the workload, name-sorted, with their shapes.
    pub fn pods(&self) -> &[(PodRow, TaskShape)] {
        &self.pods
    }

    /// The order pods arrive in for `seed`: shuffled, then tuned to the
    /// target by appending random copies (or removing random pods when the
    /// list is above it), plus the seeded node tie-break order.
    pub fn arrival_order(&self, seed: u64) -> (Vec<usize>, Vec<u32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let _throwaway: u64 = rng.random();
        let mut order: Vec<usize> = (0..self.pods.len()).collect();
        order.shuffle(&mut rng);
        let capacity = self.fleet.gpu_total_milli() as f64;
        let target = capacity * TUNE_TARGET;
        let mut total: f64 = order.iter().map(|&i| self.pods[i].1.total_gpu_milli() as f64).sum();
        if total < target {
            loop {
                let i = rng.random_range(0..self.pods.len());
                let shape = &self.pods[i].1;
                // The authors' check compares the per-GPU share with the
                // target while the total adds the whole request.
                if total + f64::from(shape.gpu_milli) > target {
                    break;
                }
                total += shape.total_gpu_milli() as f64;
                order.push(i);
            }
        } else {
            while total > target && !order.is_empty() {
                let k = rng.random_range(0..order.len());
                total -= self.pods[order[k]].1.total_gpu_milli() as f64;
                order.remove(k);
            }
        }
        (order, self.tie_rank(&mut rng))
    }

    /// A random 4-digit prefix per node; ties go to the smallest prefixed
    /// name. Returned as each node's rank in that order.
    fn tie_rank(&self, rng: &mut ChaCha8Rng) -> Vec<u32> {
        let prefixed: Vec<(u32, &str)> = self.node_names.iter().map(|n| (rng.random_range(0..10_000u32), n.as_str())).collect();
        let mut by_name: Vec<usize> = (0..prefixed.len()).collect();
        by_name.sort_by(|&a, &b| prefixed[a].cmp(&prefixed[b]));
        let mut rank = vec![0u32; prefixed.len()];
        for (r, &node) in by_name.iter().enumerate() {
            rank[node] = r as u32;
        }
        rank
    }

    /// Replays one seed with one policy. `keep_order` replays the pod list
    /// exactly as given (no shuffle, no tuning; ties by node order).
    pub fn run(
        &self,
        seed: u64,
        policy: &mut dyn PlacementPolicy,
        keep_order: bool,
        mut progress: impl FnMut(usize),
    ) -> Result<RunResult, PolicyError> {
        let (order, tie_rank) = if keep_order {
            ((0..self.pods.len()).collect(), (0..self.fleet.nodes().len() as u32).collect())
        } else {
            self.arrival_order(seed)
        };
        let mut fleet = self.fleet.clone();
        let mut placer = Placer::new();
        let capacity = fleet.gpu_total_milli() as f64;
        let mut requested = 0f64;
        let mut sums = vec![(0f64, 0u32); MAX_ARRIVAL_PCT + 2];
        let mut placed = 0;
        let mut decisions = Vec::with_capacity(order.len());
        for (k, &i) in order.iter().enumerate() {
            let shape = &self.pods[i].1;
            let meta = TaskMeta { job_id: i as u64, class: berth_core::TaskClass::implied(shape.gpu_count), ..TaskMeta::default() };
            let placement = placer.place(&fleet, shape, meta, policy, Some(&tie_rank))?;
            if let Some(p) = &placement {
                fleet.allocate(&Fleet::allocation(p.node, shape, p.gpus)).map_err(|e| PolicyError::InvalidOutput(e.to_string()))?;
                placed += 1;
            }
            decisions.push((i, placement.map(|p| (p.node, p.gpus))));
            requested += shape.total_gpu_milli() as f64;
            let arrived = round_half_even(requested / capacity * 100.0);
            if arrived >= 0.0 && (arrived as usize) < sums.len() {
                let alloc = round2(fleet.gpu_allocated_milli() as f64 / capacity * 100.0);
                let slot = &mut sums[arrived as usize];
                slot.0 += alloc;
                slot.1 += 1;
            }
            if k % 256 == 255 {
                progress(256);
            }
        }
        progress(order.len() % 256);
        debug_assert!(fleet.check_invariants().is_ok());
        Ok(RunResult {
            curve: curve_from(&sums),
            pods_offered: order.len(),
            pods_placed: placed,
            final_unallocated_pct: 100.0 - 100.0 * fleet.gpu_allocated_milli() as f64 / capacity,
            decisions,
        })
    }
}

/// Allocation samples per arrival point -> unallocated % per point: the mean
/// of the records at the point, else of those within +-1 point.
fn curve_from(sums: &[(f64, u32)]) -> Curve {
    (0..=MAX_ARRIVAL_PCT)
        .map(|p| {
            let at = |q: usize| sums.get(q).copied().unwrap_or((0.0, 0));
            let (s, n) = at(p);
            let (s, n) = if n > 0 {
                (s, n)
            } else {
                let (a, b) = (if p > 0 { at(p - 1) } else { (0.0, 0) }, at(p + 1));
                (a.0 + b.0, a.1 + b.1)
            };
            (n > 0).then(|| round2(100.0 - round2(s / f64::from(n))))
        })
        .collect()
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 { 2.0 * (x / 2.0).round() } else { r }
}

/// A typical task shape of the workload, as FGD's configuration wants it.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct TypicalPod {
    pub cpu_milli: u32,
    pub gpu_milli: u32,
    pub gpu_count: u32,
    pub models: Vec<String>,
    pub weight: f64,
}

/// The workload's typical pods, as the FGD authors build them: shapes keyed
/// by (CPU, per-GPU milli, GPU count, model spec) over the original pod list
/// (memory is not part of the key; CPU-only pods count), most popular first
/// (ties by key, descending), taken until 95% of pods are covered, weights
/// renormalised to sum to 1.
pub fn typical_pods(exp: &Experiment) -> Vec<TypicalPod> {
    let mut counts: std::collections::BTreeMap<(u32, u32, u32, String), u64> = Default::default();
    for (pod, shape) in exp.pods() {
        *counts.entry((pod.cpu_milli, shape.gpu_milli, shape.gpu_count, pod.gpu_spec.join("|"))).or_default() += 1;
    }
    let mut entries: Vec<_> = counts.into_iter().collect();
    entries.sort_by(|(ka, ca), (kb, cb)| cb.cmp(ca).then_with(|| kb.cmp(ka)));
    let total = exp.pods().len() as f64;
    let expected = 95.0 * total / 100.0;
    let mut cum = 0f64;
    let mut taken = Vec::new();
    for ((cpu_milli, gpu_milli, gpu_count, spec), count) in &entries {
        if cum >= expected {
            break;
        }
        cum += *count as f64;
        taken.push(TypicalPod {
            cpu_milli: *cpu_milli,
            gpu_milli: *gpu_milli,
            gpu_count: *gpu_count,
            models: spec.split('|').filter(|m| !m.is_empty()).map(str::to_string).collect(),
            weight: *count as f64 / total,
        });
    }
    if taken.len() < entries.len() {
        for t in &mut taken {
            t.weight /= cum / total;
        }
    }
    taken
}
