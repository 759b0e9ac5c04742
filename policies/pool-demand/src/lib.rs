//! pool-demand: a demand-balanced model pool. Placement: models in order
//! of demand (recent arrival rate x executor-seconds per request, highest
//! first, then model id), each on the executor of its tensor-parallel
//! degree with the least demand so far (then executor id), unpinned
//! (loaded when a step runs it). Steps: a decoding batch about to be late
//! (slack under two time-between-tokens targets) decodes first, the most
//! urgent one; otherwise the row whose oldest request waited longest is
//! prefilled; otherwise the row with the least slack decodes. Decodes run
//! four iterations. pool-demand-c is the same rule in C.

use berth_sdk::{Hooks, Policy, PoolExecutor, PoolPlacement, PoolState, PoolStep};

/// Decode iterations per step.
pub const ITERATIONS: u32 = 4;

#[derive(Default)]
pub struct PoolDemand;

impl Policy for PoolDemand {
    const NAME: &'static str = "pool-demand";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::POOL_PLACE.union(Hooks::POOL_STEP);

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        let demand: Vec<f64> = (0..s.models()).map(|m| s.model_rate[m] * s.model_service_s[m]).collect();
        let mut order: Vec<usize> = (0..s.models()).collect();
        order.sort_by(|&a, &b| demand[b].total_cmp(&demand[a]).then(a.cmp(&b)));
        let mut load = vec![0f64; s.executors()];
        let mut out = PoolPlacement::default();
        for m in order {
            let least = (0..s.executors()).filter(|&e| s.executor_tp[e] == s.model_tp[m]).min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
            if let Some(e) = least {
                load[e] += demand[m];
                out.push(e as u32, m as u32, 1, false);
            }
        }
        Ok(out)
    }

    fn pool_step(&mut self, x: &PoolExecutor) -> Result<PoolStep, String> {
        let urgent = (0..x.len()).filter(|&r| x.decoding[r] > 0).min_by_key(|&r| (x.decode_slack_ms[r], r));
        if let Some(r) = urgent
            && x.decode_slack_ms[r] < 2 * x.tbt_target_ms as i64
        {
            return Ok(PoolStep::decode(r, ITERATIONS));
        }
        let oldest = (0..x.len()).filter(|&r| x.waiting[r] > 0).min_by_key(|&r| (std::cmp::Reverse(x.oldest_wait_ms[r]), r));
        Ok(match (oldest, urgent) {
            (Some(r), _) => PoolStep::prefill(r),
            (None, Some(r)) => PoolStep::decode(r, ITERATIONS),
            (None, None) => PoolStep::idle(),
        })
    }
}

berth_sdk::export!(PoolDemand);
