//! drain: frees whole nodes, one move per allocation (no ejection chains;
//! `ipc` adds those). Candidates are nodes whose allocations are all
//! movable and none in a gang, emptiest first (least GPU allocated, then
//! fewest allocations, then batch order). Each candidate's allocations,
//! largest first, go to the best-fitting other node: the same GPU model
//! for GPU work, already busy (never onto an idle node), not emptied by
//! this plan, with room for its CPU, memory and GPUs (whole GPUs lowest
//! index first, a shared GPU the fullest that fits); best is the node left
//! with the least free GPU, then batch order. A candidate whose
//! allocations all find room becomes one chain; otherwise nothing of it
//! moves. A node that took a moved allocation is never emptied after
//! (each allocation moves at most once). drain-js is the same rule in
//! JavaScript.

use berth_sdk::{Hooks, Plan, Policy, Snapshot};

#[derive(Default)]
pub struct Drain;

/// The GPUs an allocation of `count` GPUs at `milli` each takes on a node
/// with these free thousandths, if it fits.
fn fit_gpus(free: &[u32], count: u32, milli: u32) -> Option<u64> {
    if count == 0 {
        return Some(0);
    }
    if milli < 1000 {
        let best = (0..free.len()).filter(|&g| free[g] >= milli).min_by_key(|&g| (free[g], g))?;
        return Some(1 << best);
    }
    let chosen: Vec<usize> = (0..free.len()).filter(|&g| free[g] >= milli).take(count as usize).collect();
    (chosen.len() == count as usize).then(|| chosen.iter().fold(0u64, |m, &g| m | 1 << g))
}

pub fn plan(s: &Snapshot) -> Plan {
    let (n, a) = (&s.nodes, &s.allocations);
    let mut free: Vec<Vec<u32>> = (0..n.len()).map(|k| n.get(k).gpu_free_milli.to_vec()).collect();
    let mut cpu = n.cpu_free_milli.clone();
    let mut mem = n.memory_free_mib.clone();
    let mut on: Vec<Vec<usize>> = vec![Vec::new(); n.len()];
    for i in 0..a.len() {
        if let Some(k) = n.ids.iter().position(|&id| id == a.node[i]) {
            on[k].push(i);
        }
    }
    let size = |i: usize| u64::from(a.gpus[i].count_ones()) * u64::from(a.gpu_milli[i]);
    let used = |k: usize, free: &[Vec<u32>]| free[k].iter().map(|&f| u64::from(1000 - f.min(1000))).sum::<u64>();
    let mut candidates: Vec<usize> =
        (0..n.len()).filter(|&k| !on[k].is_empty() && on[k].iter().all(|&i| a.movable[i] == 1 && a.gang_id[i] == 0)).collect();
    candidates.sort_by_key(|&k| (used(k, &free), on[k].len(), k));
    let mut emptied = vec![false; n.len()];
    let mut received = vec![false; n.len()];
    let mut out = Plan::default();
    let mut chain = 0;
    for t in candidates {
        if received[t] {
            continue;
        }
        let mut residents = on[t].clone();
        residents.sort_by_key(|&i| (std::cmp::Reverse((size(i), a.cpu_milli[i])), i));
        // Tentative moves: (allocation, destination, GPUs); undone on failure.
        let mut moves: Vec<(usize, usize, u64)> = Vec::new();
        for &i in &residents {
            let count = a.gpus[i].count_ones();
            let best = (0..n.len())
                .filter(|&k| k != t && !emptied[k] && !on[k].is_empty() && (count == 0 || n.model[k] == n.model[t]))
                .filter(|&k| cpu[k] >= a.cpu_milli[i] && mem[k] >= a.memory_mib[i])
                .filter_map(|k| Some((free[k].iter().map(|&f| u64::from(f)).sum::<u64>(), k, fit_gpus(&free[k], count, a.gpu_milli[i])?)))
                .min_by_key(|&(left, k, _)| (left, k));
            let Some((_, k, mask)) = best else { break };
            cpu[k] -= a.cpu_milli[i];
            mem[k] -= a.memory_mib[i];
            (0..free[k].len()).filter(|&g| mask >> g & 1 == 1).for_each(|g| free[k][g] -= a.gpu_milli[i]);
            on[k].push(i);
            moves.push((i, k, mask));
        }
        if moves.len() < residents.len() {
            for &(i, k, mask) in moves.iter().rev() {
                cpu[k] += a.cpu_milli[i];
                mem[k] += a.memory_mib[i];
                (0..free[k].len()).filter(|&g| mask >> g & 1 == 1).for_each(|g| free[k][g] += a.gpu_milli[i]);
                on[k].pop();
            }
            continue;
        }
        for &(i, k, mask) in &moves {
            received[k] = true;
            out.chain.push(chain);
            out.allocation.push(a.ids[i]);
            out.dest_node.push(n.ids[k]);
            out.dest_gpus.push(mask);
        }
        on[t].clear();
        emptied[t] = true;
        chain += 1;
    }
    out
}

impl Policy for Drain {
    const NAME: &'static str = "drain";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::COMPACT;

    fn compact(&mut self, snapshot: &Snapshot) -> Result<Plan, String> {
        Ok(plan(snapshot))
    }
}

berth_sdk::export!(Drain);
