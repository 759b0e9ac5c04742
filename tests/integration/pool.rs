//! Model pools with the real wasm components: the four pool policies load
//! (contract 0.3.0) and run under the host's checks, wasm decides exactly
//! as native, older components are refused clearly, the Azure reader names
//! bad rows, and `berth replay --pool` writes its table, JSON and SVG.

use std::path::{Path, PathBuf};
use std::process::Command;

use berth::pool::{self, PoolFile, Source};
use berth_core::pool::{NativePool, PoolOutcome, PoolPolicy, RunOptions, StepRecord};
use berth_core::PolicyError;

use crate::common::{guest_path, policy_path, repo_root, wasm_policy};

const POOL: [&str; 4] = ["pool-dedicated", "pool-scale-to-zero", "pool-muxserve", "pool-token"];

fn market() -> PoolFile {
    PoolFile::load("default").unwrap()
}

/// A short, busy workload of the default market.
fn short(file: &mut PoolFile, rate: f64, seconds: f64) -> Vec<berth_core::pool::Request> {
    file.workload.synthetic.rate = rate;
    file.workload.synthetic.duration_s = seconds;
    pool::requests(file, &Source::Synthetic, 42, 1.0)
}

fn check(file: &PoolFile, out: &PoolOutcome, steps: &[StepRecord]) {
    let gpu = (file.gpu.memory_gb * 1e9) as u64;
    for s in steps {
        assert!(s.used_bytes <= s.memory_bytes && s.used_bytes.div_ceil(u64::from(s.tp)) <= gpu, "over-committed: {s:?}");
    }
    assert_eq!(out.finished + out.unfinished + out.rejected, out.requests);
    assert_eq!(out.met_slo + out.ttft_missed + out.tbt_missed, out.finished);
}

#[test]
fn the_four_pool_components_load_and_run_under_the_hosts_checks() {
    let mut file = market();
    let cfg = file.config();
    let reqs = short(&mut file, 3.0, 120.0);
    for name in POOL {
        let mut p = wasm_policy(&policy_path(name), Default::default());
        let loaded = crate::common::load(&policy_path(name));
        assert_eq!(loaded.contract, "0.4.0", "{name}");
        assert!(p.has_pool_hooks(), "{name}");
        let opts = RunOptions { layout: vec![(1, 3), (4, 4)], record_steps: true };
        let (out, steps) = berth_core::pool::run(&cfg, &reqs, &opts, &mut p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.step_calls > 0 && out.place_calls > 0, "{name}: {out:?}");
        assert!(out.finished > 0, "{name}: {out:?}");
        check(&file, &out, &steps);
    }
}

#[test]
fn wasm_pool_policies_decide_exactly_as_native() {
    let mut file = market();
    let cfg = file.config();
    let reqs = short(&mut file, 2.0, 120.0);
    let natives: Vec<(&str, Box<dyn PoolPolicy>)> = vec![
        ("pool-dedicated", Box::new(NativePool(berth_policy_pool_dedicated::Dedicated::default()))),
        ("pool-scale-to-zero", Box::new(NativePool(berth_policy_pool_scale_to_zero::ScaleToZero::default()))),
        ("pool-muxserve", Box::new(NativePool(berth_policy_pool_muxserve::MuxServe::default()))),
        ("pool-token", Box::new(NativePool(berth_policy_pool_token::Token::default()))),
    ];
    for (name, mut native) in natives {
        let opts = RunOptions { layout: vec![(1, 2), (4, 3)], record_steps: true };
        let mut wasm = wasm_policy(&policy_path(name), Default::default());
        let a = berth_core::pool::run(&cfg, &reqs, &opts, &mut wasm).unwrap();
        let b = berth_core::pool::run(&cfg, &reqs, &opts, &mut *native).unwrap();
        assert_eq!(a.0, b.0, "{name}");
        assert_eq!(a.1, b.1, "{name}");
    }
}

#[test]
fn older_components_keep_loading_but_have_no_pool_hooks() {
    let mut file = market();
    let cfg = file.config();
    let reqs = short(&mut file, 1.0, 30.0);
    // best-fit-py is built against 0.2.0, the v010 guest against 0.1.0.
    for (path, contract) in [(policy_path("best-fit-py"), "0.2.0"), (guest_path("v010"), "0.1.0")] {
        let loaded = crate::common::load(&path);
        assert_eq!(loaded.contract, contract);
        let mut p = wasm_policy(&path, Default::default());
        let opts = RunOptions { layout: vec![(1, 1), (4, 1)], record_steps: false };
        match berth_core::pool::run(&cfg, &reqs, &opts, &mut p) {
            Err(e @ PolicyError::Unsupported(_)) => {
                let msg = e.to_string();
                assert!(msg.contains("pool") && msg.contains(contract), "{msg}");
            }
            other => panic!("{}: expected an unsupported-hook error, got {other:?}", path.display()),
        }
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn azure_reader_names_the_file_line_and_field_of_a_bad_row() {
    let dir = std::env::temp_dir().join(format!("berth-pool-azure-{}", std::process::id()));
    let good = write(&dir, "good.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n");
    let rows = pool::read_azure(&good).unwrap();
    assert_eq!(rows.len(), 2);
    assert!((rows[1].t_s - 4.314579).abs() < 1e-6, "{rows:?}");
    assert_eq!((rows[0].prompt, rows[0].output), (374, 44));
    let cases = [
        ("bad-tokens.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.00,lots,44\n", ":3: ContextTokens"),
        ("bad-time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.68,374,44\n", ":2: TIMESTAMP"),
        ("bad-gen.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,-1\n", ":2: GeneratedTokens"),
        ("no-column.csv", "TIMESTAMP,Context\n2023-11-16 18:15:46.68,374\n", "no ContextTokens column"),
    ];
    for (name, text, want) in cases {
        let path = write(&dir, name, text);
        let err = format!("{:#}", pool::read_azure(&path).unwrap_err());
        assert!(err.contains(name) && err.contains(want), "{err:?} should name {name} and {want:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Azure traces (`$BERTH_AZURE_DIR`, else `../shared/data/azure-llm`),
/// or `None` (skipped) unless BERTH_REQUIRE_TRACES is set.
pub(crate) fn azure_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("BERTH_AZURE_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared/data/azure-llm"));
    if dir.join("AzureLLMInferenceTrace_conv.csv").is_file() {
        return Some(dir);
    }
    crate::common::skip(&format!("Azure LLM traces not found at {}", dir.display()));
    None
}

#[test]
fn azure_traces_replay_under_token_level_pooling() {
    let Some(dir) = azure_dir() else { return };
    let mut file = market();
    file.workload.synthetic.duration_s = 300.0;
    let cfg = file.config();
    for trace in ["AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"] {
        let rows = pool::read_azure(&dir.join(trace)).unwrap();
        assert!(rows.len() > 1000, "{trace}: {} rows", rows.len());
        let source = Source::Azure(std::sync::Arc::new(rows), dir.join(trace));
        let reqs = pool::requests(&file, &source, 42, 1.0);
        assert!(!reqs.is_empty() && reqs.iter().all(|r| r.arrival_s < 300.0));
        let mut p = wasm_policy(&policy_path("pool-token"), Default::default());
        let opts = RunOptions { layout: vec![(1, 8), (4, 12)], record_steps: true };
        let (out, steps) = berth_core::pool::run(&cfg, &reqs, &opts, &mut p).unwrap();
        check(&file, &out, &steps);
        assert!(out.finished > reqs.len() as u64 * 9 / 10, "{trace}: {out:?}");
    }
}

#[test]
fn replay_pool_cli_writes_table_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("berth-pool-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A small pool file: four models, two per class, one minute.
    let text = r#"
        replan_interval_s = 10.0
        [workload]
        rate = 0.5
        duration_s = 60.0
        [search]
        max_executors = 16
        [[models]]
        name = "a"
        params_b = 7.0
        tp = 1
        kv_bytes_per_token = 524288
        [[models]]
        name = "b"
        params_b = 1.8
        tp = 1
        kv_bytes_per_token = 196608
        [[models]]
        name = "c"
        params_b = 72.7
        tp = 4
        kv_bytes_per_token = 327680
        [[models]]
        name = "d"
        params_b = 32.5
        tp = 4
        kv_bytes_per_token = 262144
    "#;
    let toml = write(&dir, "small.toml", text);
    let (json, svg) = (dir.join("pool.json"), dir.join("pool.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["replay", "--pool"])
        .arg(&toml)
        .args(["--seeds", "7", "--quiet", "--json"])
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for name in POOL {
        assert!(stdout.contains(name), "{name} missing from\n{stdout}");
    }
    assert!(stdout.contains("1,192 -> 213 (-82%)"), "{stdout}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(json["headlines"].as_array().unwrap().len(), 1, "one seed, one headline");
    let report = &json["comparisons"][0];
    assert_eq!(report["seed"].as_u64(), Some(7));
    assert_eq!(report["policies"].as_array().unwrap().len(), 4);
    for p in report["policies"].as_array().unwrap() {
        let at = &p["at_fixed"];
        assert_eq!(
            at["finished"].as_u64().unwrap() + at["unfinished"].as_u64().unwrap() + at["rejected"].as_u64().unwrap(),
            at["requests"].as_u64().unwrap()
        );
    }
    let dedicated = report["policies"][0]["gpus_needed"].as_u64().expect("dedicated reaches the target");
    assert!(dedicated >= 2 + 8, "dedicated needs an executor per model: {dedicated}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    // A 0.2.0 component is refused with a clear message.
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["replay", "--pool"])
        .arg(&toml)
        .args(["--policy", "binpack", "--quiet"])
        .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("binpack") && err.contains("pool"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 10's goal on the default 47-model market, through the wasm
/// components, over ten seeds: token-level pooling needs at least 80% fewer
/// GPUs than dedicated and sustains at least 2x the arrival rate of
/// request-level scaling, both as medians (single seeds vary; the README
/// gives them all).
#[test]
fn default_market_meets_the_goal_in_the_median() {
    let file = market();
    let mut reductions = Vec::new();
    let mut ratios = Vec::new();
    for seed in 42..52 {
        let opts = pool::Options { policies: POOL.iter().map(|s| s.to_string()).collect(), seed, limits: Default::default(), progress: false };
        let c = pool::compare(crate::common::engine(), &file, &Source::Synthetic, &opts).unwrap();
        for p in &c.policies {
            let f = &p.at_fixed;
            assert_eq!(f.finished + f.unfinished + f.rejected, f.requests, "{}", p.policy);
        }
        let h = pool::report::headline(&c);
        reductions.push(h.reduction.expect("both reach 99%"));
        ratios.push(h.rate_vs_request_level.expect("request-level sustains some rate"));
    }
    reductions.sort_by(f64::total_cmp);
    ratios.sort_by(f64::total_cmp);
    let (r, k) = ((reductions[4] + reductions[5]) / 2.0, (ratios[4] + ratios[5]) / 2.0);
    assert!(r >= 0.8, "median GPU reduction {r:.3}: {reductions:?}");
    assert!(k >= 2.0, "median rate ratio {k:.2}: {ratios:?}");
}
