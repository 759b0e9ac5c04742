//! pool-token: token-level pooling after Aegaeon (SOSP'25). Models are not
//! pinned: each executor of a class serves several models and switches
//! between them between batches, so a burst of one model and a trickle of
//! many share the same GPUs.
//!
//! Placement (`pool-place`, every re-planning interval): each model's
//! demand (arrival rate, half recent window and half long-run average, x
//! executor-seconds per request) decides how many executors serve it
//! (`ceil(demand / target_load)`, at least one); executors are filled
//! least-loaded first, keeping a model where it was when that executor is
//! not over the average, so switches and drains stay rare.
//!
//! Steps (`pool-step`): prefill in grouped first-come-first-served order
//! (the oldest waiting request's model, its whole queue in one batch) for
//! time to first token, unless a decoding batch would miss a token
//! deadline during the switch and prefill; decode the batch with the least
//! slack for as many iterations as the others' slack allows (a weighted
//! round robin inside the time-between-tokens target). When a model must
//! be loaded, models with nothing waiting and nothing decoding are evicted
//! first, longest idle first. Configuration: `target_load = 0.6`.

use berth_sdk::{decode_quantum, Hooks, Policy, PoolExecutor, PoolPlacement, PoolState, PoolStep};

pub struct Token {
    target_load: f64,
    max_iterations: u32,
    last: Option<PoolPlacement>,
}

impl Default for Token {
    fn default() -> Self {
        Token { target_load: 0.6, max_iterations: berth_sdk::DEFAULT_MAX_ITERATIONS, last: None }
    }
}

impl Policy for Token {
    const NAME: &'static str = "pool-token";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::POOL_PLACE.union(Hooks::POOL_STEP);

    fn configure(&mut self, config: &str) -> Result<(), String> {
        for line in config.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("expected key = value, got {line:?}"))?;
            match k.trim() {
                "target_load" => {
                    let x: f64 = v.trim().parse().map_err(|e| format!("target_load: {e}"))?;
                    if !(x > 0.0 && x <= 1.0) {
                        return Err(format!("target_load must be in (0, 1], got {x}"));
                    }
                    self.target_load = x;
                }
                "max_iterations" => {
                    let x: u32 = v.trim().parse().map_err(|e| format!("max_iterations: {e}"))?;
                    self.max_iterations = x.max(1);
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        let now_s = s.now_ms as f64 / 1000.0;
        let demand: Vec<f64> = (0..s.models())
            .map(|m| {
                let long_run = if now_s > 0.0 { s.model_arrived[m] as f64 / now_s } else { s.model_rate[m] };
                (0.5 * s.model_rate[m] + 0.5 * long_run) * s.model_service_s[m]
            })
            .collect();
        let mut order: Vec<usize> = (0..s.models()).collect();
        order.sort_by(|&a, &b| demand[b].total_cmp(&demand[a]).then(a.cmp(&b)));
        let mut previous: Vec<Vec<usize>> = vec![Vec::new(); s.models()];
        if let Some(last) = &self.last {
            // The pool may have changed since (executors gone).
            for i in (0..last.len()).filter(|&i| (last.model[i] as usize) < s.models() && (last.executor[i] as usize) < s.executors()) {
                previous[last.model[i] as usize].push(last.executor[i] as usize);
            }
        }
        let mut load = vec![0f64; s.executors()];
        let mut weights = vec![0u64; s.executors()];
        let mut out = PoolPlacement::default();
        let class_total = |tp: u32| -> (f64, usize) {
            let d: f64 = (0..s.models()).filter(|&m| s.model_tp[m] == tp).map(|m| demand[m]).sum();
            (d, (0..s.executors()).filter(|&e| s.executor_tp[e] == tp).count())
        };
        for m in order {
            let tp = s.model_tp[m];
            let (total, n) = class_total(tp);
            if n == 0 {
                continue;
            }
            let average = total / n as f64;
            // Enough executors for the mean demand at the target load, and
            // for the peak demand (the busiest window so far) at full load,
            // so a burst spreads over replicas instead of queueing.
            let peak = s.model_peak_rate[m] * s.model_service_s[m];
            let replicas = ((demand[m] / self.target_load).ceil().max(peak.ceil()) as usize).clamp(1, n);
            let w = s.model_weight_bytes[m];
            // Room to keep the model resident beside the executor's other
            // models (a quarter of memory left for KV cache): then it
            // never has to switch there.
            let room = |e: usize, weights: &[u64]| (weights[e] + w) as f64 <= s.executor_memory_bytes[e] as f64 * 0.75;
            let mut chosen: Vec<usize> = Vec::new();
            for &e in &previous[m] {
                if chosen.len() < replicas && s.executor_tp[e] == tp && load[e] + demand[m] / replicas as f64 <= average.max(1e-9) * 1.25 {
                    chosen.push(e);
                }
            }
            while chosen.len() < replicas {
                let e = (0..s.executors())
                    .filter(|&e| s.executor_tp[e] == tp && !chosen.contains(&e))
                    .min_by(|&a, &b| {
                        // Least loaded, preferring executors with room while
                        // that costs at most a quarter of the average load.
                        let cost = |e: usize| load[e] + if room(e, &weights) { 0.0 } else { 0.25 * average };
                        cost(a).total_cmp(&cost(b)).then(a.cmp(&b))
                    })
                    .expect("replicas <= executors of the class");
                chosen.push(e);
            }
            for e in chosen {
                load[e] += demand[m] / replicas as f64;
                weights[e] += w;
                out.push(e as u32, m as u32, 1, false);
            }
        }
        self.last = Some(out.clone());
        Ok(out)
    }

    fn pool_step(&mut self, x: &PoolExecutor) -> Result<PoolStep, String> {
        let tbt = x.tbt_target_ms as i64;
        let rows = 0..x.len();
        let urgent = rows.clone().filter(|&r| x.decoding[r] > 0).min_by_key(|&r| (x.decode_slack_ms[r], x.model[r]));
        // Grouped first-come-first-served: models by their oldest waiting
        // request; the first whose weights fit (resident, or room after
        // evicting idle models) is prefilled. A model that does not fit
        // waits for decoding batches to finish and free their memory.
        let mut waiting: Vec<usize> = rows.clone().filter(|&r| x.waiting[r] > 0).collect();
        waiting.sort_by_key(|&r| (std::cmp::Reverse(x.oldest_wait_ms[r]), x.model[r]));
        let oldest = waiting.first().copied();
        if let Some(p) = waiting.into_iter().find(|&p| fits(x, p)) {
            // Prefill first, if every decoding batch keeps a token deadline
            // through the load and the prefill (estimated as one target).
            let cost_ms = (x.load_s[p] * 1000.0) as i64 + tbt;
            let safe = urgent.is_none_or(|u| x.decode_slack_ms[u] > cost_ms + tbt);
            if safe {
                let mut step = PoolStep::prefill(p);
                if x.resident[p] == 0 {
                    step.evict = evictions(x, p);
                }
                return Ok(step);
            }
        }
        let Some(u) = urgent else { return Ok(PoolStep::idle()) };
        let mut n = decode_quantum(x, u, self.max_iterations);
        if oldest.is_some_and(|p| fits(x, p)) {
            // Someone who fits waits for a first token: give them the
            // executor soon. Otherwise decode on, to free memory.
            let iteration_ms = (x.decode_iteration_s[u] * 1000.0).max(0.001);
            n = n.min(((2 * tbt) as f64 / iteration_ms).max(1.0) as u32);
        }
        Ok(PoolStep::decode(u, n))
    }
}

/// Whether row `p`'s weights fit now, with a tenth of memory to spare for
/// KV cache, counting what evicting idle models would free.
fn fits(x: &PoolExecutor, p: usize) -> bool {
    if x.resident[p] == 1 {
        return true;
    }
    let evictable: u64 = (0..x.len())
        .filter(|&r| r != p && x.resident[r] == 1 && x.pinned[r] == 0 && x.decoding[r] == 0)
        .map(|r| x.weight_bytes[r])
        .sum();
    x.used_bytes.saturating_sub(evictable) + x.weight_bytes[p] + x.memory_bytes / 10 <= x.memory_bytes
}

/// Resident rows to drop before loading row `p`: idle ones (nothing
/// waiting or decoding, not pinned), longest idle first, until `p`'s
/// weights fit with a tenth of memory to spare for its KV cache.
fn evictions(x: &PoolExecutor, p: usize) -> Vec<u32> {
    let mut idle: Vec<usize> =
        (0..x.len()).filter(|&r| r != p && x.resident[r] == 1 && x.pinned[r] == 0 && x.decoding[r] == 0 && x.waiting[r] == 0).collect();
    idle.sort_by_key(|&r| (std::cmp::Reverse(x.idle_ms[r]), x.model[r]));
    let need = x.weight_bytes[p] + x.memory_bytes / 10;
    let mut used = x.used_bytes;
    let mut out = Vec::new();
    for r in idle {
        if used + need <= x.memory_bytes {
            break;
        }
        used -= x.weight_bytes[r];
        out.push(r as u32);
    }
    out
}

berth_sdk::export!(Token);
