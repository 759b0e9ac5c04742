//! ipc: in-place compaction by recursive ejection chains, after ASI's IPC.
//!
//! Each round walks the partially occupied nodes, easiest first (nodes of a
//! model some pending shape wants whole nodes of come first, then least
//! allocated GPU, then fewest allocations), and tries to empty each one (the
//! "wanted" node): every allocation on it is re-homed on another busy node
//! of the same GPU model (best fit: the destination left with the least
//! free GPU), never on an idle node and never on a node emptied before. When
//! nothing has room, it ejects: it picks a node where removing one smaller
//! movable allocation makes room, re-homes that one recursively (depth - 1),
//! then moves in. The moves that empty one node form one chain, in the order
//! they must run (deepest ejection first), each valid on the state left by
//! the ones before. A node that cannot be emptied is rolled back and left
//! alone. Rounds repeat until one frees nothing or `rounds` is reached.
//!
//! Gang members move only inside their switch domain; immovable allocations
//! (pinned, or moved recently: the host says so with `movable = 0`) stay, and
//! a node holding one is never a target. Every allocation moves at most once
//! per plan.
//!
//! Configuration (`configure`, per partition), JSON or `key = value` lines;
//! unknown keys are ignored (replay sends a seed to every policy):
//! `depth` (1..=8, default 3), `rounds` (1..=100, default 5),
//! `max_targets` (0 = no limit: nodes to free per plan), `work_limit`
//! (node visits per plan before it stops searching, default 50,000,000).

use std::collections::HashMap;

use berth_sdk::{Hooks, Plan, Policy, Snapshot};

const ANY_MODEL: u32 = u32::MAX;

#[derive(Clone, Debug, PartialEq)]
pub struct Ipc {
    pub depth: u32,
    pub rounds: u32,
    pub max_targets: u32,
    pub work_limit: u64,
}

impl Default for Ipc {
    fn default() -> Self {
        Ipc { depth: 3, rounds: 5, max_targets: 0, work_limit: 50_000_000 }
    }
}

fn parse_config(text: &str, into: &mut Ipc) -> Result<(), String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(());
    }
    let mut set = |key: &str, value: f64| -> Result<(), String> {
        let int = |lo: f64, hi: f64| {
            if value.fract() != 0.0 || value < lo || value > hi {
                Err(format!("ipc: {key} must be an integer in {lo}..={hi}, got {value}"))
            } else {
                Ok(value)
            }
        };
        match key {
            "depth" => into.depth = int(1.0, 8.0)? as u32,
            "rounds" => into.rounds = int(1.0, 100.0)? as u32,
            "max_targets" => into.max_targets = int(0.0, 1e9)? as u32,
            "work_limit" => into.work_limit = int(1.0, 1e15)? as u64,
            _ => {}
        }
        Ok(())
    };
    if text.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("ipc: configuration is not valid JSON: {e}"))?;
        let obj = v.as_object().ok_or("ipc: configuration must be a JSON object")?;
        for (k, v) in obj {
            if ["depth", "rounds", "max_targets", "work_limit"].contains(&k.as_str()) {
                let n = v.as_f64().ok_or_else(|| format!("ipc: {k} must be a number"))?;
                set(k, n)?;
            }
        }
        return Ok(());
    }
    for (no, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with('[') {
            continue;
        }
        let (k, v) = line.split_once('=').ok_or_else(|| format!("ipc: line {}: expected key = value", no + 1))?;
        let k = k.trim();
        if ["depth", "rounds", "max_targets", "work_limit"].contains(&k) {
            let n: f64 = v.trim().parse().map_err(|_| format!("ipc: line {}: {k} must be a number", no + 1))?;
            set(k, n)?;
        }
    }
    Ok(())
}

/// The search state: the snapshot's capacity, updated by tentative moves.
struct State<'a> {
    s: &'a Snapshot,
    gpu_free: Vec<Vec<u32>>,
    cpu_free: Vec<u32>,
    mem_free: Vec<u64>,
    /// Allocations on each node (indexes into the snapshot's allocations).
    on: Vec<Vec<usize>>,
    node_of: Vec<usize>,
    mask_of: Vec<u64>,
    moved: Vec<bool>,
    /// Nodes that take nothing more (emptied by this plan).
    locked: Vec<bool>,
    /// Tentative moves in execution order: (allocation, from, from mask, to, to mask).
    journal: Vec<(usize, usize, u64, usize, u64)>,
    work: u64,
    work_limit: u64,
}

impl<'a> State<'a> {
    fn new(s: &'a Snapshot, work_limit: u64) -> Result<State<'a>, String> {
        let n = &s.nodes;
        let index: HashMap<u32, usize> = n.ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let gpu_free = (0..n.len()).map(|i| n.get(i).gpu_free_milli.to_vec()).collect();
        let mut on = vec![Vec::new(); n.len()];
        let a = &s.allocations;
        let mut node_of = Vec::with_capacity(a.len());
        for i in 0..a.len() {
            let &k = index.get(&a.node[i]).ok_or_else(|| format!("ipc: allocation {} on unknown node {}", a.ids[i], a.node[i]))?;
            on[k].push(i);
            node_of.push(k);
        }
        Ok(State {
            s,
            gpu_free,
            cpu_free: n.cpu_free_milli.clone(),
            mem_free: n.memory_free_mib.clone(),
            on,
            node_of,
            mask_of: a.gpus.clone(),
            moved: vec![false; a.len()],
            locked: vec![false; n.len()],
            journal: Vec::new(),
            work: 0,
            work_limit,
        })
    }

    fn idle(&self, k: usize) -> bool {
        let n = &self.s.nodes;
        self.on[k].is_empty()
            && self.gpu_free[k].iter().all(|&f| f == 1000)
            && self.cpu_free[k] == n.cpu_total_milli[k]
            && self.mem_free[k] == n.memory_total_mib[k]
    }

    fn gpu_used(&self, k: usize) -> u64 {
        self.gpu_free[k].iter().map(|&f| u64::from(1000 - f.min(1000))).sum()
    }

    /// The GPUs allocation `a` would take on node `k` (the host's rule:
    /// whole GPUs lowest index first, a shared GPU best fit), if it fits.
    fn fit(&self, a: usize, k: usize) -> Option<u64> {
        let al = &self.s.allocations;
        if self.cpu_free[k] < al.cpu_milli[a] || self.mem_free[k] < al.memory_mib[a] {
            return None;
        }
        let count = self.mask_of[a].count_ones() as usize;
        if count == 0 {
            return Some(0);
        }
        let milli = al.gpu_milli[a];
        let free = &self.gpu_free[k];
        if milli < 1000 {
            return free.iter().enumerate().filter(|&(_, &f)| f >= milli).min_by_key(|&(g, &f)| (f, g)).map(|(g, _)| 1u64 << g);
        }
        let mut mask = 0u64;
        let mut got = 0;
        for (g, &f) in free.iter().enumerate() {
            if got == count {
                break;
            }
            if f >= milli {
                mask |= 1 << g;
                got += 1;
            }
        }
        (got == count).then_some(mask)
    }

    fn take(&mut self, a: usize, k: usize, mask: u64) {
        let al = &self.s.allocations;
        self.cpu_free[k] -= al.cpu_milli[a];
        self.mem_free[k] -= al.memory_mib[a];
        for g in 0..64 {
            if mask >> g & 1 == 1 {
                self.gpu_free[k][g] -= al.gpu_milli[a];
            }
        }
        self.on[k].push(a);
        self.node_of[a] = k;
        self.mask_of[a] = mask;
    }

    fn give(&mut self, a: usize) {
        let al = &self.s.allocations;
        let k = self.node_of[a];
        let mask = self.mask_of[a];
        self.cpu_free[k] += al.cpu_milli[a];
        self.mem_free[k] += al.memory_mib[a];
        for g in 0..64 {
            if mask >> g & 1 == 1 {
                self.gpu_free[k][g] += al.gpu_milli[a];
            }
        }
        let pos = self.on[k].iter().position(|&x| x == a).expect("on its node");
        self.on[k].swap_remove(pos);
    }

    /// Moves `a` to `k` and records it.
    fn move_to(&mut self, a: usize, k: usize, mask: u64) {
        let (from, from_mask) = (self.node_of[a], self.mask_of[a]);
        self.give(a);
        self.take(a, k, mask);
        self.moved[a] = true;
        self.journal.push((a, from, from_mask, k, mask));
    }

    /// Undoes the journal back to `mark`.
    fn rollback(&mut self, mark: usize) {
        while self.journal.len() > mark {
            let (a, from, from_mask, _, _) = self.journal.pop().expect("non-empty");
            self.give(a);
            self.take(a, from, from_mask);
            self.moved[a] = false;
        }
    }

    /// Whether `a` may go to node `k` at all (not counting capacity).
    fn allowed(&self, a: usize, k: usize, avoid: &[usize]) -> bool {
        let n = &self.s.nodes;
        let al = &self.s.allocations;
        let src = self.node_of[a];
        k != src
            && !self.locked[k]
            && !avoid.contains(&k)
            && (self.mask_of[a] == 0 || n.model[k] == n.model[src])
            && (al.gang_id[a] == 0 || n.switch_domain[k] == n.switch_domain[src])
            && !self.idle(k)
    }

    fn size(&self, a: usize) -> u64 {
        let al = &self.s.allocations;
        u64::from(self.mask_of[a].count_ones()) * u64::from(al.gpu_milli[a]) * 1_000_000 + u64::from(al.cpu_milli[a])
    }

    /// Re-homes allocation `a` (currently on a node in `avoid`) with at most
    /// `depth` levels of ejection. On failure the state is as before.
    fn rehome(&mut self, a: usize, depth: u32, avoid: &mut Vec<usize>) -> bool {
        let nodes = self.s.nodes.len();
        self.work += nodes as u64;
        if self.work > self.work_limit {
            return false;
        }
        // Direct: best fit among allowed nodes.
        let mut best: Option<(u64, usize, u64)> = None;
        for k in 0..nodes {
            if !self.allowed(a, k, avoid) {
                continue;
            }
            if let Some(mask) = self.fit(a, k) {
                let left = self.gpu_free[k].iter().map(|&f| u64::from(f)).sum::<u64>();
                if best.is_none_or(|(l, bk, _)| (left, k) < (l, bk)) {
                    best = Some((left, k, mask));
                }
            }
        }
        if let Some((_, k, mask)) = best {
            self.move_to(a, k, mask);
            return true;
        }
        if depth <= 1 {
            return false;
        }
        // Ejection: a node where taking out one smaller movable allocation
        // makes room; fewest GPU left over first.
        let al = &self.s.allocations;
        let size_a = self.size(a);
        let mut candidates: Vec<(u64, u64, usize, usize)> = Vec::new();
        for k in 0..nodes {
            if !self.allowed(a, k, avoid) {
                continue;
            }
            for &b in &self.on[k] {
                if self.moved[b] || al.movable[b] == 0 || self.size(b) >= size_a {
                    continue;
                }
                candidates.push((self.size(b), self.gpu_used(k), k, b));
            }
        }
        self.work += candidates.len() as u64;
        // Smallest ejected allocation first, on the busiest node.
        candidates.sort_by_key(|&(sb, used, k, b)| (sb, std::cmp::Reverse(used), k, b));
        for &(_, _, k, b) in candidates.iter().take(8) {
            let mark = self.journal.len();
            // Would `a` fit once `b` is gone?
            let (bk, bmask) = (self.node_of[b], self.mask_of[b]);
            self.give(b);
            let fits = self.fit(a, k).is_some();
            self.take(b, bk, bmask);
            if !fits {
                continue;
            }
            avoid.push(k);
            let ok = self.rehome(b, depth - 1, avoid);
            avoid.pop();
            if ok {
                if let Some(mask) = self.fit(a, k) {
                    self.move_to(a, k, mask);
                    return true;
                }
            }
            self.rollback(mark);
        }
        false
    }
}

impl Ipc {
    /// The plan for `s` (the `compact` hook without the trait).
    pub fn plan(&self, s: &Snapshot) -> Result<Plan, String> {
        let mut st = State::new(s, self.work_limit)?;
        let n = &s.nodes;
        let al = &s.allocations;
        // Models some pending shape wants whole nodes of.
        let wanted = |model: u32| s.pending.whole_nodes.iter().zip(&s.pending.model).any(|(&w, &m)| w > 0 && (m == ANY_MODEL || m == model));
        let mut plan = Plan::default();
        let mut chain = 0u32;
        let mut freed = 0u32;
        'rounds: for _ in 0..self.rounds {
            let mut targets: Vec<usize> = (0..n.len())
                .filter(|&k| !st.locked[k] && !st.on[k].is_empty() && st.on[k].iter().all(|&a| al.movable[a] == 1 && !st.moved[a]))
                .collect();
            targets.sort_by_key(|&k| (!wanted(n.model[k]), st.gpu_used(k), st.on[k].len(), k));
            let mut progress = false;
            for t in targets {
                if self.max_targets > 0 && freed >= self.max_targets {
                    break 'rounds;
                }
                if st.work > st.work_limit {
                    break 'rounds;
                }
                if st.on[t].is_empty() || st.on[t].iter().any(|&a| st.moved[a] || al.movable[a] == 0) {
                    continue;
                }
                let mark = st.journal.len();
                st.locked[t] = true;
                let mut residents = st.on[t].clone();
                residents.sort_by_key(|&a| (std::cmp::Reverse(st.size(a)), a));
                let mut ok = true;
                for a in residents {
                    let mut avoid = vec![t];
                    if !st.rehome(a, self.depth, &mut avoid) {
                        ok = false;
                        break;
                    }
                }
                if ok && st.idle(t) {
                    for &(a, _, _, k, mask) in &st.journal[mark..] {
                        plan.chain.push(chain);
                        plan.allocation.push(al.ids[a]);
                        plan.dest_node.push(n.ids[k]);
                        plan.dest_gpus.push(mask);
                    }
                    // Keep the journal: later chains start from this state.
                    chain += 1;
                    freed += 1;
                    progress = true;
                } else {
                    st.rollback(mark);
                    st.locked[t] = false;
                }
            }
            if !progress {
                break;
            }
        }
        Ok(plan)
    }
}

impl Policy for Ipc {
    const NAME: &'static str = "ipc";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::COMPACT;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut next = Ipc::default();
        parse_config(config, &mut next)?;
        *self = next;
        Ok(())
    }

    fn compact(&mut self, snapshot: &Snapshot) -> Result<Plan, String> {
        self.plan(snapshot)
    }
}

berth_sdk::export!(Ipc);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_json_and_lines() {
        let mut p = Ipc::default();
        p.configure(r#"{"depth": 2, "rounds": 7, "seed": 42}"#).unwrap();
        assert_eq!((p.depth, p.rounds), (2, 7));
        p.configure("depth = 4\nrounds = 1\n").unwrap();
        assert_eq!((p.depth, p.rounds), (4, 1));
        p.configure("").unwrap();
        assert_eq!((p.depth, p.rounds), (3, 5));
        assert!(p.configure(r#"{"depth": 0}"#).unwrap_err().contains("depth"));
        assert!(p.configure("rounds = x").unwrap_err().contains("rounds"));
    }
}
