//! Placement: filter with the predicate, ask the policy, check its answer,
//! choose. The core, not the policy, has the last word on every GPU.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

use berth_sdk::{Nodes, Scores, Task};

use crate::fleet::{gpus_of, Allocation, Fleet, Node, NodeId};
use crate::job::Job;
use crate::policy::{PlacementPolicy, PolicyError};
use crate::predicate::{self, Unfit};
pub use crate::task::{fill_task, TaskMeta};
use crate::task::TaskShape;
use crate::units::MILLI_PER_GPU;

/// Where a task goes.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub node: NodeId,
    /// GPUs used on that node (bit g = GPU g).
    pub gpus: u64,
    /// The winning score.
    pub score: f64,
}

/// Places tasks one at a time. Keeps its column buffers between calls so a
/// placement allocates nothing in steady state.
#[derive(Default)]
pub struct Placer {
    batch: Nodes,
    candidates: Vec<NodeId>,
    task: Task,
}

impl Placer {
    pub fn new() -> Placer {
        Placer::default()
    }

    /// Picks a node and GPUs for `shape`, or `None` when no node fits.
    /// Ties in score go to the lowest `tie_rank[node]` (a seeded order in
    /// replay), then to the lowest node id. Does not allocate: the caller
    /// applies the placement with [`Fleet::allocate`].
    pub fn place(
        &mut self,
        fleet: &Fleet,
        shape: &TaskShape,
        meta: TaskMeta,
        policy: &mut dyn PlacementPolicy,
        tie_rank: Option<&[u32]>,
    ) -> Result<Option<Placement>, PolicyError> {
        self.place_among(fleet, shape, meta, policy, tie_rank, &|_, _| true)
    }

    /// [`Placer::place`] restricted to the nodes `keep` accepts (e.g. the
    /// switch domains chosen for a gang).
    pub fn place_among(
        &mut self,
        fleet: &Fleet,
        shape: &TaskShape,
        meta: TaskMeta,
        policy: &mut dyn PlacementPolicy,
        tie_rank: Option<&[u32]>,
        keep: &dyn Fn(NodeId, &Node) -> bool,
    ) -> Result<Option<Placement>, PolicyError> {
        let Some(answer) = self.score_candidates(fleet, shape, meta, policy, keep)? else { return Ok(None) };
        let rank = |id: NodeId| (tie_rank.map_or(id, |r| r[id as usize]), id);
        let mut best = 0;
        for i in 1..self.candidates.len() {
            let (a, b) = (answer.scores[i], answer.scores[best]);
            if a > b || (a == b && rank(self.candidates[i]) < rank(self.candidates[best])) {
                best = i;
            }
        }
        let node_id = self.candidates[best];
        let mask = chosen_gpus(&fleet.nodes()[node_id as usize], shape, answer.gpus.get(best).copied());
        Ok(Some(Placement { node: node_id, gpus: mask, score: answer.scores[best] }))
    }

    /// Every node `keep` accepts whose score for `shape` equals the best:
    /// the nodes the policy finds equally good (empty when none fits).
    pub fn tied_best(
        &mut self,
        fleet: &Fleet,
        shape: &TaskShape,
        meta: TaskMeta,
        policy: &mut dyn PlacementPolicy,
        keep: &dyn Fn(NodeId, &Node) -> bool,
    ) -> Result<Vec<NodeId>, PolicyError> {
        let Some(answer) = self.score_candidates(fleet, shape, meta, policy, keep)? else { return Ok(Vec::new()) };
        let best = answer.scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Ok(self.candidates.iter().zip(&answer.scores).filter(|&(_, &s)| s == best).map(|(&id, _)| id).collect())
    }

    /// Places `count` tasks of `shape` (a gang) all or nothing, allocating
    /// them on `fleet`; on `None` or an error nothing stays allocated.
    ///
    /// One scoring call covers every candidate; after a task lands, only the
    /// candidates in the switch domain of the node it landed on are scored
    /// again, because a score may depend on the task, the node and the other
    /// candidates of its switch domain, but on nothing further away (the
    /// contract's locality rule). So the tasks land exactly where one call
    /// per task would put them, at a fraction of the cost: a 32-task gang on
    /// 20,000 nodes is one large call and 31 calls of one domain each.
    #[allow(clippy::too_many_arguments)]
    pub fn place_tasks(
        &mut self,
        fleet: &mut Fleet,
        shape: &TaskShape,
        meta: TaskMeta,
        count: u32,
        policy: &mut dyn PlacementPolicy,
        tie_rank: Option<&[u32]>,
        keep: &dyn Fn(NodeId, &Node) -> bool,
    ) -> Result<Option<Vec<Allocation>>, PolicyError> {
        let mut allocs = Vec::with_capacity(count as usize);
        if count == 0 {
            return Ok(Some(allocs));
        }
        let Some(answer) = self.score_candidates(fleet, shape, meta, policy, keep)? else { return Ok(None) };
        let candidates = std::mem::take(&mut self.candidates);
        let rank = |id: NodeId| (tie_rank.map_or(id, |r| r[id as usize]), id);
        // Heap entries carry a stamp; rescoring a candidate bumps its stamp,
        // which makes its older entries stale.
        let mut stamp = vec![0u32; candidates.len()];
        let entry = |score: f64, i: usize, stamp: u32, mask: Option<u64>| Ranked { score: score + 0.0, rank: rank(candidates[i]), index: i, stamp, mask };
        let mut heap: BinaryHeap<Ranked> = (0..candidates.len()).map(|i| entry(answer.scores[i], i, 0, answer.gpus.get(i).copied())).collect();
        let mut by_domain: HashMap<u32, Vec<usize>> = HashMap::new();
        if count > 1 {
            for (i, &id) in candidates.iter().enumerate() {
                by_domain.entry(fleet.nodes()[id as usize].switch_domain).or_default().push(i);
            }
        }
        let mut rescored = Vec::new();
        let mut result = Ok(true);
        for index in 0..count {
            let best = loop {
                match heap.pop() {
                    Some(e) if e.stamp != stamp[e.index] => continue,
                    other => break other,
                }
            };
            let Some(best) = best else {
                result = Ok(false);
                break;
            };
            let node_id = candidates[best.index];
            stamp[best.index] += 1;
            let mask = chosen_gpus(&fleet.nodes()[node_id as usize], shape, best.mask);
            let alloc = Fleet::allocation(node_id, shape, mask);
            if let Err(e) = fleet.allocate(&alloc) {
                result = Err(PolicyError::InvalidOutput(e.to_string()));
                break;
            }
            allocs.push(alloc);
            if index + 1 == count {
                break;
            }
            // Only this node changed: score its domain's candidates again.
            let domain = fleet.nodes()[node_id as usize].switch_domain;
            rescored.clear();
            rescored.extend(by_domain[&domain].iter().copied().filter(|&i| predicate::check(&fleet.nodes()[candidates[i] as usize], shape).is_ok()));
            if rescored.is_empty() {
                continue;
            }
            self.candidates.clear();
            self.candidates.extend(rescored.iter().map(|&i| candidates[i]));
            fill_task(&mut self.task, shape, TaskMeta { gang_index: index + 1, ..meta });
            self.fill_batch(fleet);
            match self.checked_score(fleet, shape, policy) {
                Ok(again) => {
                    for (k, &i) in rescored.iter().enumerate() {
                        stamp[i] += 1;
                        heap.push(entry(again.scores[k], i, stamp[i], again.gpus.get(k).copied()));
                    }
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.candidates = candidates;
        match result {
            Ok(true) => Ok(Some(allocs)),
            other => {
                for alloc in allocs.drain(..) {
                    fleet.release(&alloc).expect("just allocated");
                }
                other.map(|_| None)
            }
        }
    }

    /// Filters the candidates `keep` accepts through the predicate, scores
    /// them in one call and checks the answer; `None` when none fits.
    fn score_candidates(
        &mut self,
        fleet: &Fleet,
        shape: &TaskShape,
        meta: TaskMeta,
        policy: &mut dyn PlacementPolicy,
        keep: &dyn Fn(NodeId, &Node) -> bool,
    ) -> Result<Option<Scores>, PolicyError> {
        self.candidates.clear();
        // The brief free summaries rule most nodes out of a busy fleet
        // without reading them; the rest pass the caller's filter and the
        // full predicate as before (the same candidates, in the same order).
        let nodes = fleet.nodes();
        self.candidates.extend(
            fleet
                .free_summaries()
                .iter()
                .enumerate()
                .filter(|&(i, f)| f.may_fit(shape) && keep(i as NodeId, &nodes[i]) && predicate::check(&nodes[i], shape).is_ok())
                .map(|(i, _)| i as NodeId),
        );
        if self.candidates.is_empty() {
            return Ok(None);
        }
        fill_task(&mut self.task, shape, meta);
        self.fill_batch(fleet);
        self.checked_score(fleet, shape, policy).map(Some)
    }

    /// One scoring call over the current batch, with every score and mask
    /// checked: one score per candidate, all finite, masks valid.
    fn checked_score(&mut self, fleet: &Fleet, shape: &TaskShape, policy: &mut dyn PlacementPolicy) -> Result<Scores, PolicyError> {
        let answer = policy.score(&self.task, &mut self.batch)?;
        let n = self.candidates.len();
        if answer.scores.len() != n {
            return Err(PolicyError::InvalidOutput(format!("{} scores for {n} candidate nodes", answer.scores.len())));
        }
        if let Some(i) = answer.scores.iter().position(|s| !s.is_finite()) {
            return Err(PolicyError::InvalidOutput(format!(
                "score of node {} is {}",
                self.candidates[i], answer.scores[i]
            )));
        }
        if !answer.gpus.is_empty() {
            if answer.gpus.len() != n {
                return Err(PolicyError::InvalidOutput(format!("{} GPU masks for {n} candidate nodes", answer.gpus.len())));
            }
            for (i, &mask) in answer.gpus.iter().enumerate() {
                let id = self.candidates[i];
                validate_mask(&fleet.nodes()[id as usize], id, shape, mask)?;
            }
        }
        Ok(answer)
    }

    /// Why each node refuses `shape`, counted by first failing reason (for
    /// "why is my job pending" answers).
    pub fn unfit_reasons(fleet: &Fleet, shape: &TaskShape) -> BTreeMap<Unfit, u32> {
        let mut reasons = BTreeMap::new();
        for node in fleet.nodes() {
            if let Err(why) = predicate::check(node, shape) {
                *reasons.entry(why).or_insert(0) += 1;
            }
        }
        reasons
    }

    fn fill_batch(&mut self, fleet: &Fleet) {
        let b = &mut self.batch;
        b.clear();
        if b.models != fleet.models {
            b.models = fleet.models.clone();
        }
        for &id in &self.candidates {
            let n = &fleet.nodes()[id as usize];
            b.push(
                id,
                n.model.unwrap_or(u32::MAX),
                n.switch_domain,
                n.cpu_free_milli,
                n.cpu_total_milli,
                n.memory_free_mib,
                n.memory_total_mib,
                &n.gpus,
                n.alloc_kinds(),
            );
            b.set_contention(b.len() - 1, n.contention());
        }
    }
}

/// A scored candidate in the gang heap: highest score first, then the
/// lowest (tie rank, node id).
struct Ranked {
    score: f64,
    rank: (u32, NodeId),
    /// Index into the candidates, and the candidate's stamp when scored.
    index: usize,
    stamp: u32,
    mask: Option<u64>,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.rank.cmp(&self.rank))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

/// The policy's mask when it named one (already validated), else the host's.
fn chosen_gpus(node: &Node, shape: &TaskShape, policy_mask: Option<u64>) -> u64 {
    match policy_mask {
        Some(m) if m != 0 => m,
        _ => default_gpus(node, shape),
    }
}

/// Checks a policy's GPU mask for one candidate: 0 (host chooses), or
/// exactly the task's GPU count, all existing and each with enough free.
pub fn validate_mask(node: &Node, id: NodeId, shape: &TaskShape, mask: u64) -> Result<(), PolicyError> {
    if mask == 0 {
        return Ok(());
    }
    let gpus = node.gpus.len();
    if gpus < 64 && mask >> gpus != 0 {
        return Err(PolicyError::InvalidOutput(format!("GPU mask {mask:#x} names a GPU node {id} does not have ({gpus} GPUs)")));
    }
    if mask.count_ones() != shape.gpu_count {
        return Err(PolicyError::InvalidOutput(format!(
            "GPU mask {mask:#x} for node {id} names {} GPUs, task wants {}",
            mask.count_ones(),
            shape.gpu_count
        )));
    }
    if let Some(g) = gpus_of(mask).find(|&g| node.gpus[g] < shape.gpu_milli) {
        return Err(PolicyError::InvalidOutput(format!(
            "GPU {g} of node {id} has {} milli free, task wants {}",
            node.gpus[g], shape.gpu_milli
        )));
    }
    Ok(())
}

/// The host's GPU choice: whole GPUs lowest index first among idle ones; a
/// shared GPU on the fitting GPU with the least free (best fit). The node
/// must already pass the predicate.
pub fn default_gpus(node: &Node, shape: &TaskShape) -> u64 {
    if shape.gpu_count == 0 {
        return 0;
    }
    if shape.gpu_milli < MILLI_PER_GPU {
        let best = node.gpus.iter().enumerate().filter(|&(_, &f)| f >= shape.gpu_milli).min_by_key(|&(g, &f)| (f, g));
        return best.map_or(0, |(g, _)| 1u64 << g);
    }
    let mut mask = 0u64;
    for (g, _) in node.gpus.iter().enumerate().filter(|&(_, &f)| f >= shape.gpu_milli).take(shape.gpu_count as usize) {
        mask |= 1u64 << g;
    }
    mask
}

/// Places every task of `job` or none (see [`Placer::place_tasks`]), a gang
/// first choosing switch domains when the policy scores them. Returns the
/// allocations and the number of distinct switch domains used.
pub fn place_gang(
    fleet: &mut Fleet,
    placer: &mut Placer,
    policy: &mut dyn PlacementPolicy,
    job: &Job,
    placements: &mut u64,
    keep: &dyn Fn(NodeId, &Node) -> bool,
) -> Result<Option<(Vec<Allocation>, u32)>, PolicyError> {
    if job.tasks > 1 && crate::capacity::fitting_tasks_among(fleet, &job.shape, job.tasks, keep) < job.tasks {
        return Ok(None); // cannot fit even ignoring placement: skip the policy
    }
    place_fitting_gang(fleet, placer, policy, job, placements, keep, None)
}

/// [`place_gang`] for a caller that has already counted that all the gang's
/// tasks fit among the nodes `keep` accepts; ties in score go to the lowest
/// `tie_rank[node]` (default: the node id).
pub fn place_fitting_gang(
    fleet: &mut Fleet,
    placer: &mut Placer,
    policy: &mut dyn PlacementPolicy,
    job: &Job,
    placements: &mut u64,
    keep: &dyn Fn(NodeId, &Node) -> bool,
    tie_rank: Option<&[u32]>,
) -> Result<Option<(Vec<Allocation>, u32)>, PolicyError> {
    // A gang asks the policy for switch domains first; with an answer, its
    // tasks go only to the best domains that together hold it.
    let mut allowed: Option<HashSet<u32>> = None;
    if job.tasks > 1 {
        let (mut domains, _) = crate::capacity::domain_table_among(fleet, &job.shape, keep);
        let mut task = berth_sdk::Task::default();
        fill_task(&mut task, &job.shape, job.meta());
        if let Some(scores) = policy.score_domains(&task, &mut domains)? {
            if scores.len() != domains.len() || scores.iter().any(|s| !s.is_finite()) {
                return Err(PolicyError::InvalidOutput(format!("{} domain scores for {} domains, or one not finite", scores.len(), domains.len())));
            }
            let mut order: Vec<usize> = (0..domains.len()).collect();
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(domains.ids[a].cmp(&domains.ids[b])));
            let mut chosen = HashSet::new();
            let mut fits = 0u32;
            for i in order {
                if fits >= job.tasks {
                    break;
                }
                if domains.fitting_tasks[i] > 0 {
                    chosen.insert(domains.ids[i]);
                    fits += domains.fitting_tasks[i];
                }
            }
            allowed = Some(chosen);
        }
    }
    let keep = |id: NodeId, n: &crate::fleet::Node| keep(id, n) && allowed.as_ref().is_none_or(|a| a.contains(&n.switch_domain));
    let meta = job.meta();
    let Some(allocs) = placer.place_tasks(fleet, &job.shape, meta, job.tasks, policy, tie_rank, &keep)? else { return Ok(None) };
    *placements += u64::from(job.tasks);
    let domains: HashSet<u32> = allocs.iter().map(|a| fleet.nodes()[a.node as usize].switch_domain).collect();
    Ok(Some((allocs, domains.len() as u32)))
}

