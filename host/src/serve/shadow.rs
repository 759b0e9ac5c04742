//! Shadow and split A/B runs of a candidate policy version.
//!
//! Shadow: the candidate decides every job beside the active version, on a
//! copy of the same fleet state; its decision is logged, never actuated, and
//! the two are compared (same placement? how each scores the other's pick?
//! switch domains used, partly used nodes after). Split: a stable hash of
//! the job id sends a fraction of jobs to the candidate, whose decisions are
//! actuated; each arm's outcomes are tallied.

use std::collections::VecDeque;

use berth_core::{PlacementPolicy, PolicyError};
use berth_sdk::{Domains, Nodes, Scores, Task};

use super::decisions::Placed;

/// How a candidate runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    Shadow,
    /// The fraction of jobs the candidate decides.
    Split(f64),
}

/// Whether `job_id` falls in the candidate's share of a split: a fixed mix
/// of the id, so the same job always lands in the same arm.
pub fn in_split(job_id: u64, fraction: f64) -> bool {
    let mut z = job_id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

/// Wraps a policy and keeps the scores of its first `score` call (the
/// first task of the job), so each arm can be asked what it thinks of the
/// other's pick.
pub struct Recording<'a> {
    pub inner: &'a mut dyn PlacementPolicy,
    /// Candidate node ids and their scores.
    pub first: Option<(Vec<u32>, Vec<f64>)>,
}

impl PlacementPolicy for Recording<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn score(&mut self, task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        let r = self.inner.score(task, nodes);
        if self.first.is_none()
            && let Ok(s) = &r
        {
            self.first = Some((nodes.ids.clone(), s.scores.clone()));
        }
        r
    }
    fn score_domains(&mut self, task: &Task, domains: &mut Domains) -> Result<Option<Vec<f64>>, PolicyError> {
        self.inner.score_domains(task, domains)
    }
}

/// How much better an arm scored its own pick than the other arm's pick
/// (both nodes among its first task's candidates).
pub fn score_gap(first: &Option<(Vec<u32>, Vec<f64>)>, own: u32, other: u32) -> Option<f64> {
    let (ids, scores) = first.as_ref()?;
    let at = |n: u32| ids.iter().position(|&i| i == n).and_then(|k| scores.get(k).copied());
    Some(at(own)? - at(other)?)
}

/// One arm's tally in split mode.
#[derive(Clone, Debug, Default)]
pub struct ArmStats {
    pub decisions: u64,
    pub placed: u64,
    pub errors: u64,
    pub latency_us_sum: u64,
    pub wait_s_sum: f64,
    pub gangs: u64,
    pub gang_domains_sum: u64,
    pub partial_after_sum: u64,
}

impl ArmStats {
    pub fn record(&mut self, latency_us: u64, placed: Option<(f64, u32, bool)>, error: bool, partial_after: u64) {
        self.decisions += 1;
        self.latency_us_sum += latency_us;
        self.partial_after_sum += partial_after;
        if error {
            self.errors += 1;
        }
        if let Some((wait_s, domains, gang)) = placed {
            self.placed += 1;
            self.wait_s_sum += wait_s;
            if gang {
                self.gangs += 1;
                self.gang_domains_sum += u64::from(domains);
            }
        }
    }
}

/// Where the arms differed on one job.
#[derive(Clone, Debug)]
pub struct Diff {
    pub decision_id: u64,
    pub job_id: u64,
    pub active: Vec<Placed>,
    pub candidate: Vec<Placed>,
    pub note: String,
}

/// The running comparison of one candidate against the active version;
/// starts empty whenever a candidate is set.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub samples: u64,
    pub agree: u64,
    pub candidate_gap: (f64, u64),
    pub active_gap: (f64, u64),
    pub domains_active: u64,
    pub domains_candidate: u64,
    pub gang_samples: u64,
    pub partial_active: u64,
    pub partial_candidate: u64,
    pub candidate_errors: u64,
    pub recent_diffs: VecDeque<Diff>,
    /// The latest samples, for plots over time (at most [`POINTS`]).
    pub points: VecDeque<Point>,
    /// Split mode: [active, candidate].
    pub arms: [ArmStats; 2],
}

/// Shadow samples kept for plots over time.
pub const POINTS: usize = 400;

/// One shadow sample as the plots show it.
#[derive(Clone, Debug)]
pub struct Point {
    pub unix_ms: u64,
    pub job_id: u64,
    pub agree: bool,
    pub candidate_gap: Option<f64>,
    pub active_gap: Option<f64>,
    pub partial_after: (u64, u64),
}

/// One shadow comparison's inputs.
pub struct Sample {
    pub job_id: u64,
    pub agree: bool,
    pub candidate_gap: Option<f64>,
    pub active_gap: Option<f64>,
    /// Switch domains used, when both placed a multi-task job.
    pub domains: Option<(u32, u32)>,
    pub partial_after: (u64, u64),
}

impl Stats {
    pub fn add_sample(&mut self, s: Sample, diff: Option<Diff>) {
        self.samples += 1;
        self.agree += u64::from(s.agree);
        self.points.push_back(Point {
            unix_ms: crate::util::unix_ms(),
            job_id: s.job_id,
            agree: s.agree,
            candidate_gap: s.candidate_gap,
            active_gap: s.active_gap,
            partial_after: s.partial_after,
        });
        if self.points.len() > POINTS {
            self.points.pop_front();
        }
        if let Some(g) = s.candidate_gap {
            self.candidate_gap.0 += g;
            self.candidate_gap.1 += 1;
        }
        if let Some(g) = s.active_gap {
            self.active_gap.0 += g;
            self.active_gap.1 += 1;
        }
        if let Some((a, c)) = s.domains {
            self.gang_samples += 1;
            self.domains_active += u64::from(a);
            self.domains_candidate += u64::from(c);
        }
        self.partial_active += s.partial_after.0;
        self.partial_candidate += s.partial_after.1;
        if let Some(d) = diff {
            self.recent_diffs.push_back(d);
            if self.recent_diffs.len() > 20 {
                self.recent_diffs.pop_front();
            }
        }
    }
}

/// A mean that is 0 over nothing.
pub fn mean(sum: f64, n: u64) -> f64 {
    if n == 0 { 0.0 } else { sum / n as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_stable_and_near_its_fraction() {
        let chosen = (0..10_000).filter(|&j| in_split(j, 0.3)).count();
        assert!((2700..3300).contains(&chosen), "{chosen}");
        assert_eq!(in_split(42, 0.3), in_split(42, 0.3));
        assert!(!(0..1000).any(|j| in_split(j, 0.0)));
    }

    #[test]
    fn gaps_compare_picks_within_one_arms_scores() {
        let first = Some((vec![4, 7, 9], vec![1.0, 5.0, 2.0]));
        assert_eq!(score_gap(&first, 7, 9), Some(3.0));
        assert_eq!(score_gap(&first, 7, 8), None);
    }
}

/// A shadow rank candidate beside the active ranking: on every preemption
/// the candidate ranks the same victims for the same demand, and the
/// victims each would take are compared (never actuated).
#[derive(Clone, Debug, Default)]
pub struct RankStats {
    pub samples: u64,
    /// Both would take exactly the same victims (or both none).
    pub agreed: u64,
    /// Jobs each would interrupt, and the GPU-seconds of work each would
    /// lose (since each victim's last checkpoint).
    pub active_victims: u64,
    pub candidate_victims: u64,
    pub active_lost_gpu_s: f64,
    pub candidate_lost_gpu_s: f64,
    /// The candidate failed (trap, deadline, invalid answer).
    pub candidate_errors: u64,
}

/// One arm's compaction plans, summed over steps.
#[derive(Clone, Debug, Default)]
pub struct CompactTally {
    pub chains: u64,
    pub moves: u64,
    pub nodes_freed: i64,
    pub state_bytes: u64,
    pub benefit_gpu_s: f64,
    pub cost_gpu_s: f64,
}

impl CompactTally {
    /// Adds a checked plan: the chains selection keeps, and their moves.
    pub fn add(&mut self, planned: &berth_core::compaction::Planned) {
        for c in planned.chains.iter().filter(|c| c.run) {
            self.chains += 1;
            self.nodes_freed += c.nodes_freed;
            self.benefit_gpu_s += c.benefit_gpu_s;
            self.cost_gpu_s += c.cost_gpu_s;
        }
        self.moves += planned.moves.len() as u64;
        self.state_bytes += planned.moves.iter().map(|m| m.state_bytes).sum::<u64>();
    }
}

/// A compact candidate in shadow: what each arm planned on the same
/// snapshots (the candidate's plans are never run).
#[derive(Clone, Debug, Default)]
pub struct CompactStats {
    pub steps: u64,
    pub active: CompactTally,
    pub candidate: CompactTally,
    pub candidate_errors: u64,
}

/// One arm's pool placements, summed over replans.
#[derive(Clone, Debug, Default)]
pub struct PlaceTally {
    /// Executor-model pairs placed.
    pub pairs: u64,
    /// Distinct models placed somewhere.
    pub models_placed: u64,
    /// Executors given at least one model.
    pub executors_used: u64,
    /// Requests per second of models with traffic that it left unplaced
    /// (they wait for the next placement).
    pub unplaced_rate: f64,
    /// The busiest executor's offered work: each model's arrival rate times
    /// its service time, shared between its executors by routing weight
    /// (request-seconds per second, before batching).
    pub busiest_offered: f64,
}

impl PlaceTally {
    /// Adds one checked placement made on `state`.
    pub fn add(&mut self, state: &berth_sdk::PoolState, p: &berth_sdk::PoolPlacement) {
        let models = state.model_tp.len();
        let executors = state.executor_tp.len();
        let mut weight_of_model = vec![0u64; models];
        let mut placed = vec![false; models];
        let mut used = vec![false; executors];
        for i in 0..p.executor.len() {
            let (e, m) = (p.executor[i] as usize, p.model[i] as usize);
            if m < models && e < executors {
                weight_of_model[m] += u64::from(p.weight[i]);
                placed[m] = true;
                used[e] = true;
            }
        }
        let mut offered = vec![0.0f64; executors];
        for i in 0..p.executor.len() {
            let (e, m) = (p.executor[i] as usize, p.model[i] as usize);
            if m < models && e < executors && weight_of_model[m] > 0 {
                offered[e] += state.model_rate[m] * state.model_service_s[m] * f64::from(p.weight[i]) / weight_of_model[m] as f64;
            }
        }
        self.pairs += p.executor.len() as u64;
        self.models_placed += placed.iter().filter(|&&b| b).count() as u64;
        self.executors_used += used.iter().filter(|&&b| b).count() as u64;
        self.unplaced_rate += (0..models).filter(|&m| !placed[m]).map(|m| state.model_rate[m]).sum::<f64>();
        self.busiest_offered += offered.iter().copied().fold(0.0, f64::max);
    }
}

/// A pool candidate in shadow beside the active pool version (or the
/// default): it places on every replan's state and steps on every step's
/// view inside the executors; neither is ever acted on.
#[derive(Clone, Debug, Default)]
pub struct PoolStats {
    /// Replans both arms placed on.
    pub replans: u64,
    /// Replans where the candidate placed exactly the same pairs, weights
    /// and pins.
    pub agreed: u64,
    pub active: PlaceTally,
    pub candidate: PlaceTally,
    /// The candidate's placement failed or was refused.
    pub candidate_errors: u64,
    /// Executor steps the candidate was asked about, those where it chose
    /// the very step run, and those where its answer was refused.
    pub steps: u64,
    pub steps_agreed: u64,
    pub step_errors: u64,
}

/// Whether two placements are the same pairs with the same weights and
/// pins, in any order.
pub fn same_placement(a: &berth_sdk::PoolPlacement, b: &berth_sdk::PoolPlacement) -> bool {
    let rows = |p: &berth_sdk::PoolPlacement| {
        let mut v: Vec<(u32, u32, u32, u8)> = (0..p.executor.len()).map(|i| (p.executor[i], p.model[i], p.weight[i], p.pinned[i])).collect();
        v.sort_unstable();
        v
    };
    rows(a) == rows(b)
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    #[test]
    fn a_placement_tally_shares_offered_work_by_weight_and_counts_unplaced_traffic() {
        let mut state = berth_sdk::PoolState::default();
        for (rate, service) in [(2.0, 0.5), (1.0, 1.0), (4.0, 0.25)] {
            state.model_tp.push(1);
            state.model_rate.push(rate);
            state.model_service_s.push(service);
        }
        state.executor_tp = vec![1, 1];
        let mut p = berth_sdk::PoolPlacement::default();
        // Model 0 on both executors (weights 3:1), model 1 on executor 1; model 2 unplaced.
        p.push(0, 0, 3, false);
        p.push(1, 0, 1, false);
        p.push(1, 1, 1, false);
        let mut t = PlaceTally::default();
        t.add(&state, &p);
        assert_eq!((t.pairs, t.models_placed, t.executors_used), (3, 2, 2));
        assert!((t.unplaced_rate - 4.0).abs() < 1e-9);
        // Executor 0: 1.0 x 3/4 = 0.75; executor 1: 1.0 x 1/4 + 1.0 = 1.25.
        assert!((t.busiest_offered - 1.25).abs() < 1e-9, "{t:?}");
        let mut q = berth_sdk::PoolPlacement::default();
        q.push(1, 1, 1, false);
        q.push(1, 0, 1, false);
        q.push(0, 0, 3, false);
        assert!(same_placement(&p, &q));
        q.weight[0] = 2;
        assert!(!same_placement(&p, &q));
    }
}
