//! pool-dedicated: every model on executors of its own, sized for its peak
//! (the marketplace's baseline before pooling). Each model of a
//! tensor-parallel class gets one executor if there are enough, and the
//! rest go to the models with the highest peak demand per executor held
//! (peak arrival rate x executor-seconds per request), D'Hondt style.
//! Static and pinned: weights load once and never move.

use berth_sdk::{Hooks, Policy, PoolPlacement, PoolState};

#[derive(Default)]
pub struct Dedicated {
    /// The plan, for the pool it was made for (executors' degrees, models):
    /// a pool that changes gets a new one.
    plan: Option<(Vec<u32>, usize, PoolPlacement)>,
}

/// Executors per model for `demand` (one entry per model) given `executors`:
/// one each while they last (highest demand first), the rest by D'Hondt.
pub fn apportion(demand: &[f64], executors: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..demand.len()).collect();
    order.sort_by(|&a, &b| demand[b].total_cmp(&demand[a]).then(a.cmp(&b)));
    let mut count = vec![0usize; demand.len()];
    for &m in order.iter().take(executors) {
        count[m] = 1;
    }
    for _ in demand.len()..executors {
        let best = order
            .iter()
            .copied()
            .max_by(|&a, &b| (demand[a] / (count[a] + 1) as f64).total_cmp(&(demand[b] / (count[b] + 1) as f64)).then(b.cmp(&a)))
            .expect("models");
        count[best] += 1;
    }
    count
}

impl Policy for Dedicated {
    const NAME: &'static str = "pool-dedicated";
    const VERSION: &'static str = "1.0.0";
    const HOOKS: Hooks = Hooks::POOL_PLACE;

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        if let Some((tps, models, plan)) = &self.plan
            && *tps == s.executor_tp
            && *models == s.models()
        {
            return Ok(plan.clone());
        }
        let mut out = PoolPlacement::default();
        let mut tps: Vec<u32> = s.model_tp.clone();
        tps.sort_unstable();
        tps.dedup();
        for tp in tps {
            let models: Vec<usize> = (0..s.models()).filter(|&m| s.model_tp[m] == tp).collect();
            let execs: Vec<usize> = (0..s.executors()).filter(|&e| s.executor_tp[e] == tp).collect();
            let demand: Vec<f64> = models.iter().map(|&m| s.model_peak_rate[m].max(s.model_rate[m]) * s.model_service_s[m] + 1e-9).collect();
            let count = apportion(&demand, execs.len());
            let mut next = execs.iter();
            for (k, &m) in models.iter().enumerate() {
                for _ in 0..count[k] {
                    let e = *next.next().expect("apportioned at most the executors");
                    out.push(e as u32, m as u32, 1, true);
                }
            }
        }
        self.plan = Some((s.executor_tp.clone(), s.models(), out.clone()));
        Ok(out)
    }
}

berth_sdk::export!(Dedicated);
