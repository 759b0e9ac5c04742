//! pool-muxserve: static multiplexing by memory (MuxServe, ICML'24): models
//! are packed together on executors, all weights resident at once, leaving
//! a fraction of memory for KV cache; colocated models share the
//! executor's compute step by step (the host's default step). Models go in
//! order of demand (mean rate x executor-seconds per request) to the
//! executor with the least demand so far among those with room. Static and
//! pinned. Configuration: `kv_reserve = 0.25` (fraction of memory kept for
//! KV cache).

use berth_sdk::{Hooks, Policy, PoolPlacement, PoolState};

pub struct MuxServe {
    kv_reserve: f64,
    /// The plan, for the pool it was made for (executors' degrees, models):
    /// a pool that changes gets a new one.
    plan: Option<(Vec<u32>, usize, PoolPlacement)>,
}

impl Default for MuxServe {
    fn default() -> Self {
        MuxServe { kv_reserve: 0.25, plan: None }
    }
}

impl Policy for MuxServe {
    const NAME: &'static str = "pool-muxserve";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::POOL_PLACE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        for line in config.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("expected key = value, got {line:?}"))?;
            match k.trim() {
                "kv_reserve" => {
                    let x: f64 = v.trim().parse().map_err(|e| format!("kv_reserve: {e}"))?;
                    if !(0.0..1.0).contains(&x) {
                        return Err(format!("kv_reserve must be in [0, 1), got {x}"));
                    }
                    self.kv_reserve = x;
                }
                // Hosts may send context other policies use (e.g. a seed).
                _ => {}
            }
        }
        self.plan = None;
        Ok(())
    }

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        if let Some((tps, models, plan)) = &self.plan
            && *tps == s.executor_tp
            && *models == s.models()
        {
            return Ok(plan.clone());
        }
        let mut out = PoolPlacement::default();
        let mut order: Vec<usize> = (0..s.models()).collect();
        let demand: Vec<f64> = (0..s.models()).map(|m| s.model_rate[m] * s.model_service_s[m]).collect();
        order.sort_by(|&a, &b| demand[b].total_cmp(&demand[a]).then(a.cmp(&b)));
        let mut weights = vec![0u64; s.executors()];
        let mut load = vec![0f64; s.executors()];
        for m in order {
            let best = (0..s.executors())
                .filter(|&e| s.executor_tp[e] == s.model_tp[m])
                .filter(|&e| {
                    let room = s.executor_memory_bytes[e] as f64 * (1.0 - self.kv_reserve);
                    (weights[e] + s.model_weight_bytes[m]) as f64 <= room
                })
                .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
            if let Some(e) = best {
                weights[e] += s.model_weight_bytes[m];
                load[e] += demand[m];
                out.push(e as u32, m as u32, 1, true);
            }
        }
        self.plan = Some((s.executor_tp.clone(), s.models(), out.clone()));
        Ok(out)
    }
}

berth_sdk::export!(MuxServe);
