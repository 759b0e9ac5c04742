//! pool-scale-to-zero: request-level scaling (ServerlessLLM, OSDI'24). An
//! executor serves one model at a time: a model is loaded when requests
//! for it arrive and an executor is free (or holds an idle model, which is
//! dropped, longest idle first), serves every request that comes while it
//! is there, and is unloaded after `keep_alive_s` idle. A busy model with
//! `scale_out_queue` or more requests queued on one executor gets another
//! free executor. The host's default step runs each executor.

use berth_sdk::{Hooks, Policy, PoolPlacement, PoolState};

pub struct ScaleToZero {
    keep_alive_ms: u64,
    scale_out_queue: u32,
}

impl Default for ScaleToZero {
    fn default() -> Self {
        ScaleToZero { keep_alive_ms: 30_000, scale_out_queue: 16 }
    }
}

impl Policy for ScaleToZero {
    const NAME: &'static str = "pool-scale-to-zero";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::POOL_PLACE;

    fn configure(&mut self, config: &str) -> Result<(), String> {
        for line in config.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("expected key = value, got {line:?}"))?;
            let x: f64 = v.trim().parse().map_err(|e| format!("{}: {e}", k.trim()))?;
            match k.trim() {
                "keep_alive_s" if x >= 0.0 => self.keep_alive_ms = (x * 1000.0) as u64,
                "scale_out_queue" if x >= 1.0 => self.scale_out_queue = x as u32,
                "keep_alive_s" | "scale_out_queue" => return Err(format!("{} out of range: {x}", k.trim())),
                _ => {}
            }
        }
        Ok(())
    }

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        // Pairs that stay: with work, or idle within the keep-alive.
        let mut holder: Vec<Option<(usize, u32, u64)>> = vec![None; s.executors()]; // (model, load, idle)
        for i in 0..s.assigned_executor.len() {
            let (e, m) = (s.assigned_executor[i] as usize, s.assigned_model[i] as usize);
            let (load, idle) = (s.assigned_load[i], s.assigned_idle_ms[i]);
            // A pair that never ran yet is kept: its load is in flight.
            if load > 0 || idle < self.keep_alive_ms || idle == u64::MAX {
                if holder[e].is_none_or(|(_, l, _)| load > l) {
                    holder[e] = Some((m, load, idle));
                }
            }
        }
        let mut served = vec![false; s.models()];
        for h in holder.iter().flatten() {
            served[h.0] = true;
        }
        // Models waiting for an executor, most queued first.
        let mut wanting: Vec<usize> = (0..s.models()).filter(|&m| s.model_queued[m] > 0 && !served[m]).collect();
        // Scale out: busy models with a long queue on their executor.
        for e in 0..s.executors() {
            if let Some((m, load, _)) = holder[e]
                && load >= self.scale_out_queue
                && !wanting.contains(&m)
            {
                wanting.push(m);
            }
        }
        wanting.sort_by(|&a, &b| s.model_queued[b].cmp(&s.model_queued[a]).then(a.cmp(&b)));
        for m in wanting {
            let tp = s.model_tp[m];
            let free = (0..s.executors()).find(|&e| s.executor_tp[e] == tp && holder[e].is_none());
            let idle = (0..s.executors())
                .filter(|&e| s.executor_tp[e] == tp && holder[e].is_some_and(|(_, load, _)| load == 0))
                .max_by_key(|&e| (holder[e].map(|h| h.2).unwrap_or(0), std::cmp::Reverse(e)));
            if let Some(e) = free.or(idle) {
                holder[e] = Some((m, 0, u64::MAX));
            }
        }
        let mut out = PoolPlacement::default();
        for (e, h) in holder.iter().enumerate() {
            if let Some((m, _, _)) = h {
                out.push(e as u32, *m as u32, 1, true);
            }
        }
        Ok(out)
    }
}

berth_sdk::export!(ScaleToZero);
