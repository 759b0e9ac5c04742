//! The exact compaction optimum of a small partition, as a mixed-integer
//! program (good_lp over microlp, pure Rust): where every allocation should
//! end up so that the most GPU nodes are idle, and among those the fewest
//! allocations move.
//!
//! Variables: `x[a][k]` (allocation `a` ends on node `k`; only nodes it may
//! use: same GPU model, a gang member's own switch domain, immovable work
//! fixed), `s[a][k][g]` (a shared-GPU allocation on GPU `g` of `k`),
//! `w[k][g]` (GPU `g` of `k` taken by whole-GPU work) and `y[k]` (node `k`
//! idle). Constraints: each allocation on one node; per node CPU and memory;
//! whole GPUs taken = whole GPUs wanted; per GPU shared milli + 1000 w <=
//! 1000; `y[k] + x[a][k] <= 1`. Objective: maximise `B * sum y - moves` with
//! `B` larger than any move count, i.e. idle nodes first, then fewest moves.
//!
//! This is the optimum of the end state: it ignores the order of moves and
//! the room make-before-break needs in between, so it is an upper bound on
//! what any plan of moves can reach, and the gap to it is conservative. The
//! current placement is the warm start, so a time limit still returns the
//! best end state found.

use std::time::{Duration, Instant};

use berth_core::compaction::{CompactionConfig, Running};
use berth_core::fleet::{Fleet, NodeId};
use good_lp::solvers::microlp::microlp;
use good_lp::{Expression, ResolutionError, Solution, SolutionStatus, SolverModel, Variable, WithInitialSolution, WithTimeLimit, variable, variables};
use serde::Serialize;

/// Largest partition the exact solver takes.
pub const MAX_NODES: usize = 25;

/// The exact optimum and, once known, the heuristic's result beside it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Gap {
    pub nodes: usize,
    pub allocations: usize,
    pub variables: usize,
    pub idle_before: u64,
    /// Idle GPU nodes at the optimum (or the best found, see
    /// `proven_optimal`).
    pub optimum_idle: u64,
    pub optimum_moves: u64,
    pub proven_optimal: bool,
    pub solve_ms: f64,
    pub heuristic_idle: u64,
    pub heuristic_moves: u64,
}

/// Solves the partition `nodes` exactly (at most [`MAX_NODES`] nodes).
/// `warm`: an end state to start from (the heuristic's `running` after its
/// moves, same ids), so that a time limit returns at least as good an end
/// state; `None` starts from the current placement.
pub fn solve(
    fleet: &Fleet,
    nodes: &[NodeId],
    running: &[Running],
    warm_state: Option<&[Running]>,
    config: &CompactionConfig,
    now: u64,
    time_limit: Duration,
) -> anyhow::Result<Gap> {
    anyhow::ensure!(nodes.len() <= MAX_NODES, "the exact solver takes at most {MAX_NODES} nodes, the partition has {}", nodes.len());
    let started = Instant::now();
    // Schedulable GPU nodes take part; work elsewhere stays and is ignored.
    let ks: Vec<NodeId> = nodes.iter().copied().filter(|&k| fleet.node(k).is_some_and(|n| n.schedulable && !n.gpus.is_empty())).collect();
    let pos = |id: NodeId| ks.iter().position(|&k| k == id);
    let allocs: Vec<&Running> = running.iter().filter(|r| pos(r.node).is_some()).collect();
    let idle_before = ks.iter().filter(|&&k| fleet.node(k).is_some_and(|n| n.is_idle())).count() as u64;
    // Where each allocation starts in the warm start (node, GPU mask).
    let start: Vec<(NodeId, u64)> = allocs
        .iter()
        .map(|r| warm_state.and_then(|w| w.iter().find(|x| x.id == r.id)).map_or((r.node, r.gpus), |x| (x.node, x.gpus)))
        .collect();
    let start_ok = start.iter().all(|&(n, _)| pos(n).is_some());
    let start: Vec<(NodeId, u64)> = if start_ok { start } else { allocs.iter().map(|r| (r.node, r.gpus)).collect() };
    let mut vars = variables!();
    let mut warm: Vec<(Variable, f64)> = Vec::new();
    let mut count = 0usize;
    // x[a] = list of (node position, var); s[a] = (node position, gpu, var).
    let mut x: Vec<Vec<(usize, Variable)>> = Vec::with_capacity(allocs.len());
    let mut s: Vec<Vec<(usize, usize, Variable)>> = Vec::with_capacity(allocs.len());
    for (ai, r) in allocs.iter().enumerate() {
        let cur = pos(r.node).expect("filtered");
        let (wnode, wmask) = start[ai];
        let wk = pos(wnode).expect("checked");
        let src = fleet.node(r.node).expect("in fleet");
        let gpus = r.gpus.count_ones() as usize;
        let shared = gpus == 1 && r.gpu_milli < 1000;
        let mut xs = Vec::new();
        let mut ss = Vec::new();
        for (i, &k) in ks.iter().enumerate() {
            let n = fleet.node(k).expect("in fleet");
            let allowed = if i == cur || i == wk {
                true
            } else {
                r.may_move(config, now)
                    && (gpus == 0 || n.model == src.model)
                    && (r.gang_id == 0 || n.switch_domain == src.switch_domain)
                    && n.gpus.len() >= gpus
                    && n.cpu_total_milli >= r.cpu_milli
                    && n.memory_total_mib >= r.memory_mib
            };
            if !allowed {
                continue;
            }
            let v = vars.add(variable().binary());
            count += 1;
            warm.push((v, if i == wk { 1.0 } else { 0.0 }));
            xs.push((i, v));
            if shared {
                for g in 0..n.gpus.len() {
                    let sv = vars.add(variable().binary());
                    count += 1;
                    let here = i == wk && wmask & (1 << g) != 0;
                    warm.push((sv, if here { 1.0 } else { 0.0 }));
                    ss.push((i, g, sv));
                }
            }
        }
        x.push(xs);
        s.push(ss);
    }
    // w[k][g], y[k]
    let mut w: Vec<Vec<Variable>> = Vec::with_capacity(ks.len());
    let mut y: Vec<Variable> = Vec::with_capacity(ks.len());
    for &k in &ks {
        let n = fleet.node(k).expect("in fleet");
        let mut row = Vec::new();
        for g in 0..n.gpus.len() {
            let v = vars.add(variable().binary());
            count += 1;
            let whole_here = allocs.iter().zip(&start).any(|(r, &(n, m))| n == k && r.gpu_milli >= 1000 && m & (1 << g) != 0);
            warm.push((v, if whole_here { 1.0 } else { 0.0 }));
            row.push(v);
        }
        w.push(row);
        let v = vars.add(variable().binary());
        count += 1;
        let empty = !start.iter().any(|&(node, _)| node == k);
        warm.push((v, if empty { 1.0 } else { 0.0 }));
        y.push(v);
    }
    let big = (allocs.len() + 1) as f64;
    let mut objective = Expression::from(0.0);
    for v in &y {
        objective += big * *v;
    }
    for (a, r) in allocs.iter().enumerate() {
        let cur = pos(r.node).expect("filtered");
        if let Some(&(_, v)) = x[a].iter().find(|(i, _)| *i == cur) {
            objective += v;
        }
    }
    let mut model = vars.maximise(objective).using(microlp);
    for (a, r) in allocs.iter().enumerate() {
        let one: Expression = x[a].iter().map(|(_, v)| *v).sum();
        model = model.with(one.eq(1.0));
        // A shared allocation sits on exactly one GPU of its node.
        for &(i, v) in &x[a] {
            if !s[a].is_empty() {
                let on: Expression = s[a].iter().filter(|(j, _, _)| *j == i).map(|(_, _, sv)| *sv).sum();
                model = model.with(on.eq(v));
            }
            model = model.with((y[i] + v).leq(1.0));
        }
        let _ = r;
    }
    for (i, &k) in ks.iter().enumerate() {
        let n = fleet.node(k).expect("in fleet");
        let mut cpu = Expression::from(0.0);
        let mut mem = Expression::from(0.0);
        let mut whole = Expression::from(0.0);
        let mut per_gpu: Vec<Expression> = (0..n.gpus.len()).map(|_| Expression::from(0.0)).collect();
        for (a, r) in allocs.iter().enumerate() {
            let Some(&(_, v)) = x[a].iter().find(|(j, _)| *j == i) else { continue };
            cpu += f64::from(r.cpu_milli) * v;
            mem += r.memory_mib as f64 * v;
            if r.gpu_milli >= 1000 {
                whole += f64::from(r.gpus.count_ones()) * v;
            }
            for &(j, g, sv) in &s[a] {
                if j == i {
                    per_gpu[g] += f64::from(r.gpu_milli) * sv;
                }
            }
        }
        model = model.with(cpu.leq(f64::from(n.cpu_total_milli)));
        model = model.with(mem.leq(n.memory_total_mib as f64));
        let taken: Expression = w[i].iter().copied().sum();
        model = model.with(taken.eq(whole));
        for (g, e) in per_gpu.into_iter().enumerate() {
            model = model.with((e + 1000.0 * w[i][g]).leq(1000.0));
        }
    }
    let model = model.with_initial_solution(warm).with_time_limit(time_limit.as_secs_f64());
    let solution = match model.solve() {
        Ok(sol) => sol,
        Err(ResolutionError::Infeasible) => anyhow::bail!("the exact model is infeasible: the snapshot is inconsistent"),
        Err(e) => anyhow::bail!("exact solver: {e}"),
    };
    let proven_optimal = matches!(solution.status(), SolutionStatus::Optimal);
    let optimum_idle = y.iter().filter(|v| solution.value(**v) > 0.5).count() as u64;
    let mut optimum_moves = 0;
    for (a, r) in allocs.iter().enumerate() {
        let cur = pos(r.node).expect("filtered");
        let stays = x[a].iter().any(|&(i, v)| i == cur && solution.value(v) > 0.5);
        optimum_moves += u64::from(!stays);
    }
    Ok(Gap {
        nodes: ks.len(),
        allocations: allocs.len(),
        variables: count,
        idle_before,
        optimum_idle,
        optimum_moves,
        proven_optimal,
        solve_ms: started.elapsed().as_secs_f64() * 1e3,
        heuristic_idle: 0,
        heuristic_moves: 0,
    })
}
