//! The pool simulator: memory never over-committed, every request served or
//! counted as an SLO miss, same seed same result, host-side validation of
//! policy answers, and the cost model's figures. Policies run natively
//! (the same sources as their wasm components).

use berth_core::PolicyError;
use berth_core::pool::*;
use berth_sdk::{PoolExecutor, PoolPlacement, PoolState, PoolStep};
use proptest::prelude::*;

fn market() -> PoolConfig {
    let mut t: toml::Table = toml::from_str(include_str!("../../../examples/pool/market.toml")).unwrap();
    t.remove("workload");
    t.remove("search");
    let cfg: PoolConfig = t.try_into().unwrap();
    cfg.validate().unwrap();
    cfg
}

const POLICIES: [&str; 4] = ["dedicated", "scale-to-zero", "muxserve", "token"];

fn policy(name: &str) -> Box<dyn PoolPolicy> {
    match name {
        "dedicated" => Box::new(NativePool(berth_policy_pool_dedicated::Dedicated::default())),
        "scale-to-zero" => Box::new(NativePool(berth_policy_pool_scale_to_zero::ScaleToZero::default())),
        "muxserve" => Box::new(NativePool(berth_policy_pool_muxserve::MuxServe::default())),
        "token" => Box::new(NativePool(berth_policy_pool_token::Token::default())),
        other => panic!("no policy {other}"),
    }
}

fn factory(name: &'static str) -> impl FnMut() -> Result<Box<dyn PoolPolicy>, PolicyError> {
    move || Ok(policy(name))
}

/// Checks a run from the host's own step log and counters, never from
/// what the policy said.
fn check_invariants(cfg: &PoolConfig, reqs: &[Request], out: &PoolOutcome, steps: &[StepRecord]) {
    let gpu_bytes = (cfg.gpu.memory_gb * 1e9) as u64;
    for s in steps {
        assert!(s.used_bytes <= s.memory_bytes, "step {s:?} over-commits its executor");
        // Per GPU: every GPU of a TP group holds 1/tp of weights and KV.
        assert!(s.used_bytes.div_ceil(u64::from(s.tp)) <= gpu_bytes, "step {s:?} over-commits a GPU");
        assert!(s.end_s >= s.start_s);
    }
    assert!(out.peak_memory_fraction <= 1.0);
    assert_eq!(out.requests, reqs.len() as u64);
    assert_eq!(out.finished + out.unfinished + out.rejected, out.requests, "every request is finished, unfinished or rejected: {out:?}");
    assert!(out.met_slo <= out.finished);
    assert_eq!(out.met_slo + out.ttft_missed + out.tbt_missed, out.finished, "a finished request met its SLO or missed TTFT or TBT: {out:?}");
    let per_class: u64 = out.classes.iter().map(|c| c.1).sum();
    assert_eq!(per_class, out.requests);
    assert_eq!(out.classes.iter().map(|c| c.2).sum::<u64>(), out.met_slo);
    assert!((out.attainment - out.met_slo as f64 / out.requests.max(1) as f64).abs() < 1e-12);
}

#[test]
fn memory_is_never_over_committed_and_every_request_is_accounted_for() {
    let cfg = market();
    // Loaded enough that pools switch, evict and fill KV cache.
    let reqs = Synthetic { rate: 3.0, duration_s: 300.0, ..Default::default() }.generate(cfg.models.len(), 11);
    for name in POLICIES {
        for layout in [vec![(1, 2), (4, 3)], vec![(1, 6), (4, 10)], vec![(1, 30), (4, 20)]] {
            let opts = RunOptions { layout: layout.clone(), record_steps: true };
            let (out, steps) = run(&cfg, &reqs, &opts, &mut *policy(name)).unwrap_or_else(|e| panic!("{name} on {layout:?}: {e}"));
            assert!(!steps.is_empty(), "{name}: no steps");
            assert_eq!(steps.len() as u64, out.steps);
            check_invariants(&cfg, &reqs, &out, &steps);
        }
    }
}

#[test]
fn same_seed_same_result_and_another_seed_another() {
    let cfg = market();
    let a = Synthetic::default().generate(cfg.models.len(), 5);
    let b = Synthetic::default().generate(cfg.models.len(), 5);
    assert_eq!(a, b);
    let c = Synthetic::default().generate(cfg.models.len(), 6);
    assert_ne!(a, c);
    for name in POLICIES {
        let opts = RunOptions { layout: vec![(1, 3), (4, 4)], record_steps: true };
        let first = run(&cfg, &a, &opts, &mut *policy(name)).unwrap();
        let second = run(&cfg, &b, &opts, &mut *policy(name)).unwrap();
        assert_eq!(first.0, second.0, "{name}");
        assert_eq!(first.1, second.1, "{name}");
        let other = run(&cfg, &c, &opts, &mut *policy(name)).unwrap();
        assert_ne!(first.1, other.1, "{name}: a different seed gave the same steps");
    }
}

#[test]
fn a_pool_too_small_misses_and_an_ample_one_meets_the_slo() {
    let cfg = market();
    let reqs = Synthetic { rate: 1.0, duration_s: 300.0, ..Default::default() }.generate(cfg.models.len(), 3);
    let ample = RunOptions { layout: vec![(1, 40), (4, 30)], record_steps: false };
    let (out, _) = run(&cfg, &reqs, &ample, &mut *policy("dedicated")).unwrap();
    assert!(out.attainment >= 0.99, "{out:?}");
    assert_eq!(out.switches, 0, "dedicated never switches after the warm start");
    let tiny = RunOptions { layout: vec![(1, 1), (4, 1)], record_steps: false };
    let (out, _) = run(&cfg, &reqs, &tiny, &mut *policy("dedicated")).unwrap();
    assert!(out.attainment < 0.5, "one executor per class cannot serve 47 dedicated models: {out:?}");
    // Token-level pooling on the same tiny pool serves every model.
    let (out, _) = run(&cfg, &reqs, &tiny, &mut *policy("token")).unwrap();
    assert!(out.finished > reqs.len() as u64 / 2, "{out:?}");
    assert!(out.switches > 0 && out.models_per_executor_max > 1, "{out:?}");
}

type PlaceFn = Box<dyn FnMut(&PoolState) -> PoolPlacement>;
type StepFn = Box<dyn FnMut(&PoolExecutor) -> Option<PoolStep>>;

/// A test double that answers whatever it is told to.
struct Scripted {
    place: PlaceFn,
    step: StepFn,
}

impl PoolPolicy for Scripted {
    fn describe(&self) -> String {
        "scripted".into()
    }
    fn pool_place(&mut self, s: &PoolState) -> Result<Option<PoolPlacement>, PolicyError> {
        Ok(Some((self.place)(s)))
    }
    fn pool_step(&mut self, x: &PoolExecutor) -> Result<Option<PoolStep>, PolicyError> {
        Ok((self.step)(x))
    }
}

fn expect_invalid(cfg: &PoolConfig, place: impl FnMut(&PoolState) -> PoolPlacement + 'static, step: impl FnMut(&PoolExecutor) -> Option<PoolStep> + 'static, what: &str) {
    let reqs = Synthetic { rate: 2.0, duration_s: 60.0, ..Default::default() }.generate(cfg.models.len(), 1);
    let opts = RunOptions { layout: vec![(1, 2), (4, 2)], record_steps: false };
    let mut p = Scripted { place: Box::new(place), step: Box::new(step) };
    match run(cfg, &reqs, &opts, &mut p) {
        Err(PolicyError::InvalidOutput(msg)) => assert!(msg.contains(what), "{msg:?} should mention {what:?}"),
        other => panic!("expected an invalid-output error about {what}, got {other:?}"),
    }
}

#[test]
fn the_host_refuses_invalid_pool_answers() {
    let cfg = market();
    // Pinning every small model on executor 0 over-commits it.
    expect_invalid(
        &cfg,
        |s| {
            let mut p = PoolPlacement::default();
            for m in 0..s.models() {
                if s.model_tp[m] == 1 {
                    p.push(0, m as u32, 1, true);
                }
            }
            p
        },
        |_| None,
        "pinned weights",
    );
    // A model on an executor of another degree.
    let large = cfg.models.iter().position(|m| m.tp == 4).unwrap() as u32;
    expect_invalid(
        &cfg,
        move |_| {
            let mut p = PoolPlacement::default();
            p.push(0, large, 1, false);
            p
        },
        |_| None,
        "needs tp",
    );
    // Unknown executor and model ids, ragged columns, duplicates, weight 0.
    expect_invalid(&cfg, |_| PoolPlacement { executor: vec![99], model: vec![0], weight: vec![1], pinned: vec![0] }, |_| None, "executor 99");
    expect_invalid(&cfg, |_| PoolPlacement { executor: vec![0], model: vec![999], weight: vec![1], pinned: vec![0] }, |_| None, "model 999");
    expect_invalid(&cfg, |_| PoolPlacement { executor: vec![0, 0], model: vec![0], weight: vec![1], pinned: vec![0] }, |_| None, "differ in length");
    expect_invalid(&cfg, |_| PoolPlacement { executor: vec![0, 0], model: vec![0, 0], weight: vec![1, 1], pinned: vec![0, 0] }, |_| None, "twice");
    expect_invalid(&cfg, |_| PoolPlacement { executor: vec![0], model: vec![0], weight: vec![0], pinned: vec![0] }, |_| None, "weight 0");
    // Steps: a row out of range, a prefill with nothing waiting, zero
    // iterations, evicting the row to run.
    expect_invalid(&cfg, berth_sdk::default_pool_place, |x| Some(PoolStep::prefill(x.len() + 3)), "step row");
    expect_invalid(
        &cfg,
        berth_sdk::default_pool_place,
        |x| {
            let empty = (0..x.len()).find(|&r| x.waiting[r] == 0)?;
            Some(PoolStep::prefill(empty))
        },
        "nothing waiting",
    );
    expect_invalid(
        &cfg,
        berth_sdk::default_pool_place,
        |x| {
            let r = (0..x.len()).find(|&r| x.decoding[r] > 0);
            Some(match r {
                Some(r) => PoolStep::decode(r, 0),
                None => berth_sdk::default_pool_step(x, 64),
            })
        },
        "decode iterations",
    );
    expect_invalid(
        &cfg,
        berth_sdk::default_pool_place,
        |x| {
            let mut s = berth_sdk::default_pool_step(x, 64);
            s.evict = vec![s.row];
            Some(s)
        },
        "evict row",
    );
}

#[test]
fn cost_model_defaults_match_their_sources() {
    let cfg = market();
    let small7 = cfg.models.iter().position(|m| m.params_b == 7.0).unwrap();
    let large72 = cfg.models.iter().position(|m| m.params_b > 72.0).unwrap();
    // 7B in BF16: 14 GB read at 80% of 4 TB/s = 4.4 ms, + 2 ms.
    let d = cfg.decode_iteration_s(small7, 0);
    assert!((d - (0.002 + 14e9 / 3.2e12)).abs() < 1e-9, "{d}");
    // 72.7B at TP=4: each GPU reads a quarter.
    let d = cfg.decode_iteration_s(large72, 0);
    assert!((d - (0.002 + 145.4e9 / 4.0 / 3.2e12)).abs() < 1e-9, "{d}");
    // KV reads add to decode, linearly.
    assert!(cfg.decode_iteration_s(small7, 10_000) > cfg.decode_iteration_s(small7, 0));
    // Prefill: 1,000 tokens of 7B = 14 TFLOP at 50% of 148 TFLOPS, + 20 ms.
    let p = cfg.prefill_s(small7, 1000);
    assert!((p - (0.02 + 14e12 / 74e12)).abs() < 1e-9, "{p}");
    // A 72B load from host memory: 0.3 s + 36 GB per GPU at 32 GB/s.
    let l = cfg.load_s(large72, true);
    assert!((l - (0.3 + 145.4e9 / 4.0 / 32e9)).abs() < 1e-6, "{l}");
    assert!(cfg.load_s(large72, false) > l + 70.0, "a disk read of 145 GB at 2 GB/s");
}

#[test]
fn synthetic_workload_follows_its_settings() {
    let cfg = market();
    let syn = Synthetic { rate: 5.0, duration_s: 1000.0, ..Default::default() };
    let reqs = syn.generate(cfg.models.len(), 9);
    let rate = reqs.len() as f64 / 1000.0;
    assert!((rate - 5.0).abs() < 0.5, "{rate}");
    assert!(reqs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
    let mut prompts: Vec<u32> = reqs.iter().map(|r| r.prompt_tokens).collect();
    prompts.sort_unstable();
    let median = prompts[prompts.len() / 2] as f64;
    assert!((median / 1020.0 - 1.0).abs() < 0.15, "{median}");
    // Long tail: the most popular model gets far more than the median one.
    let mut per_model = vec![0usize; cfg.models.len()];
    for r in &reqs {
        per_model[r.model as usize] += 1;
    }
    per_model.sort_unstable();
    assert!(per_model[per_model.len() - 1] > 10 * per_model[per_model.len() / 2].max(1), "{per_model:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random catalogs, loads, pools and policies: the invariants hold.
    #[test]
    fn invariants_hold_on_random_pools(
        seed in 0u64..1000,
        rate in 0.2f64..6.0,
        small in 1u32..6,
        large in 1u32..4,
        memory_gb in prop::sample::select(vec![40.0, 80.0, 96.0]),
        which in 0usize..4,
    ) {
        let mut cfg = market();
        cfg.gpu.memory_gb = memory_gb;
        // Keep only models that fit the smaller GPUs.
        cfg.models.retain(|m| (m.weight_bytes() as f64) < memory_gb * 1e9 * f64::from(m.tp) * 0.8);
        prop_assume!(cfg.models.iter().any(|m| m.tp == 1) && cfg.models.iter().any(|m| m.tp == 4));
        let reqs = Synthetic { rate, duration_s: 120.0, ..Default::default() }.generate(cfg.models.len(), seed);
        let opts = RunOptions { layout: vec![(1, small), (4, large)], record_steps: true };
        match run(&cfg, &reqs, &opts, &mut *policy(POLICIES[which])) {
            Ok((out, steps)) => check_invariants(&cfg, &reqs, &out, &steps),
            // Static policies may pin more than a small GPU holds: refused.
            Err(PolicyError::InvalidOutput(msg)) => prop_assert!(msg.contains("pinned") || msg.contains("does not fit"), "{}", msg),
            Err(e) => prop_assert!(false, "{}", e),
        }
    }
}

#[test]
fn gpu_search_finds_the_smallest_passing_pool() {
    let cfg = market();
    let reqs = Synthetic { rate: 1.0, duration_s: 300.0, ..Default::default() }.generate(cfg.models.len(), 2);
    let found = gpus_needed(&cfg, &reqs, 128, &mut factory("token")).unwrap();
    let layout = found.layout.clone().expect("token-level pooling reaches 99% within 128 executors");
    assert!(found.outcome.attainment >= cfg.slo.target);
    assert_eq!(found.gpus.unwrap(), layout.iter().map(|&(tp, c)| tp * c).sum::<u32>());
    // One executor fewer in any class misses that class's target.
    for k in 0..layout.len() {
        if layout[k].1 <= 1 {
            continue;
        }
        let mut smaller = layout.clone();
        smaller[k].1 -= 1;
        let (out, _) = run(&cfg, &reqs, &RunOptions { layout: smaller, record_steps: false }, &mut *policy("token")).unwrap();
        assert!(class_attainment(&out, layout[k].0) < cfg.slo.target, "class tp={} passes with fewer executors", layout[k].0);
    }
}
