//! A hostile pool policy. Its answers depend on the pool's size, so one
//! component breaks each pool rule in its own scenario of `berth policy
//! test`: with six executors or more, `pool-place` names an executor that
//! does not exist; with fewer, it places as the host's default would and
//! `pool-step` never returns.

use berth_sdk::{Hooks, Policy, PoolExecutor, PoolPlacement, PoolState, PoolStep};

#[derive(Default)]
struct HostilePool;

impl Policy for HostilePool {
    const NAME: &'static str = "hostile-pool";
    const VERSION: &'static str = "0.0.1";
    const HOOKS: Hooks = Hooks::POOL_PLACE.union(Hooks::POOL_STEP);

    fn pool_place(&mut self, s: &PoolState) -> Result<PoolPlacement, String> {
        let mut out = berth_sdk::default_pool_place(s);
        if s.executors() >= 6 {
            out.push(s.executors() as u32 + 3, 0, 1, false);
        }
        Ok(out)
    }

    fn pool_step(&mut self, _x: &PoolExecutor) -> Result<PoolStep, String> {
        let mut x = 0u64;
        loop {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }
}

berth_sdk::export!(HostilePool);
