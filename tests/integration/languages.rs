//! Policies in other languages: the conformance suite (`berth policy
//! test`), best-fit in Rust, Python, JavaScript and C agreeing pod by pod
//! on the openb trace, and `berth policy new` projects that build and pass.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use berth::conformance::{self, Options, Report};
use berth::replay::fgd::{typical_pods, Experiment};
use berth::replay::openb::{read_nodes, read_pods};
use berth::wasm::{Limits, LoadedPolicy, WasmPolicy};

use crate::common::{engine, guest_path, load, policy_path, repo_root};

/// best-fit in every language; the first is the reference.
const BEST_FIT: [&str; 4] = ["best-fit", "best-fit-py", "best-fit-js", "best-fit-c"];

fn conformance(path: &Path) -> Report {
    conformance::run_file(engine(), path, &Options::default()).unwrap()
}

/// A bundled component, compiled once for the whole module (the Python and
/// JavaScript ones take seconds each to compile).
fn bundled(name: &str) -> Arc<LoadedPolicy> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<LoadedPolicy>>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap();
    cache.entry(name.to_string()).or_insert_with(|| load(&policy_path(name))).clone()
}

#[test]
fn best_fit_in_every_language_conforms() {
    for name in BEST_FIT {
        let report = conformance::run_loaded(engine(), &bundled(name), &Options::default());
        assert!(report.passed(), "{name}:\n{report}");
        assert_eq!(report.policy, name);
        // score only: load, configure, and the score rules.
        assert!(report.rules.iter().any(|r| r.rule == "score/deterministic" && r.checked == 14), "{report}");
        assert!(!report.rules.iter().any(|r| r.rule.starts_with("rank/")), "{report}");
    }
}

#[test]
fn every_bundled_policy_conforms() {
    let dir = repo_root().join("target/policies");
    let mut tested = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        let Some(name) = name.strip_suffix(".wasm") else { continue };
        if BEST_FIT[1..].contains(&name) {
            continue; // the test above
        }
        let report = conformance(&entry.path());
        assert!(report.passed(), "{name}:\n{report}");
        tested += 1;
    }
    assert!(tested >= 9, "{tested} bundled policies tested");
    let v010 = conformance(&guest_path("v010"));
    assert!(v010.passed(), "{v010}");
    assert_eq!(v010.contract, "0.1.0");
    // topo-entropy claims score-domains: those rules ran and passed.
    let topo = conformance(&policy_path("topo-entropy"));
    assert!(topo.rules.iter().any(|r| r.rule == "score-domains/finite" && r.checked == 4), "{topo}");
    // pool-token claims both pool hooks: its runs went through the pool's rules.
    let token = conformance(&policy_path("pool-token"));
    for rule in ["pool-place/valid", "pool-step/valid", "pool-step/deterministic"] {
        assert!(token.rules.iter().any(|r| r.rule == rule && r.checked == 2), "{rule}: {token}");
    }
}

#[test]
fn hostile_pool_guest_fails_the_pool_rules_it_breaks() {
    let opts = Options { limits: Limits { deadline: std::time::Duration::from_millis(200), ..Limits::default() }, ..Options::default() };
    let report = conformance::run_file(engine(), &guest_path("hostile-pool"), &opts).unwrap();
    let failed = report.failed();
    // Six executors: an executor that does not exist; two: a step that never ends.
    assert_eq!(failed, ["pool-place/valid", "pool-step/deadline"], "{report}");
    let text = report.to_string();
    assert!(text.contains("scenario 0") && text.contains("executor 9 of 6"), "{text}");
    assert!(text.contains("scenario 1") && text.contains("deadline"), "{text}");
}

#[test]
fn hostile_guest_fails_the_rules_it_breaks() {
    // A generous deadline: on a loaded machine the memory bomb must reach
    // the cap before the deadline, or it is filed as a timeout instead (the
    // infinite loop then costs a second per pass).
    let opts = Options { limits: Limits { deadline: std::time::Duration::from_secs(1), ..Limits::default() }, ..Options::default() };
    let report = conformance::run_file(engine(), &guest_path("hostile"), &opts).unwrap();
    assert!(!report.passed());
    let failed = report.failed();
    // job 1 loops, 2 hoards memory, 3 panics, 4 miscounts, 5 NaN, 6 names
    // a GPU the node lacks, 7 answers 6 million scores, 8 infinity,
    // 9 overflows its stack, 11 declines; rank 1 repeats, 2 overflows;
    // score-domains 1 miscounts, 2 NaN.
    for rule in [
        "score/deadline",
        "score/memory-cap",
        "score/no-trap",
        "score/no-error",
        "score/length",
        "score/finite",
        "score/gpu-masks",
        "score-domains/length",
        "score-domains/finite",
        "rank/in-range",
        "rank/unique",
    ] {
        assert!(failed.contains(&rule), "{rule} should fail:\n{report}");
    }
    for rule in ["load", "configure/accepts", "score/deterministic", "rank/no-trap", "score-domains/no-trap"] {
        assert!(!failed.contains(&rule), "{rule} should pass:\n{report}");
    }
    let text = report.to_string();
    assert!(text.contains("FAIL  score/finite") && text.contains("scenario 5"), "{text}");
    assert!(text.contains("PASS  load"), "{text}");
}

#[test]
fn cli_policy_test_exits_non_zero_on_failure() {
    let berth = env!("CARGO_BIN_EXE_berth");
    let run = |path: PathBuf| Command::new(berth).args(["policy", "test", "--deadline-ms", "200"]).arg(path).output().unwrap();
    let good = run(policy_path("best-fit-c"));
    let stdout = String::from_utf8_lossy(&good.stdout);
    assert!(good.status.success(), "{stdout}{}", String::from_utf8_lossy(&good.stderr));
    assert!(stdout.contains("PASS  score/gpu-masks") && stdout.contains(" passed, 0 failed"), "{stdout}");
    let bad = run(guest_path("hostile"));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stdout).contains("FAIL  rank/unique"));
}

/// The openb folder, or `None` (skipped) unless BERTH_REQUIRE_TRACES is set.
fn openb_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("BERTH_OPENB_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared/data/openb"));
    if dir.join("openb_node_list_gpu_node.csv").is_file() {
        return Some(dir);
    }
    crate::common::skip(&format!("openb trace not found at {}", dir.display()));
    None
}

/// The acceptance test of the four languages: the default openb replay,
/// seeds 42-51, every pod placed on the same node and GPUs as Rust
/// best-fit's (and dropped where it is dropped).
#[test]
fn best_fit_languages_agree_pod_by_pod_on_openb() {
    let Some(dir) = openb_dir() else { return };
    // Both CPUs busy for a while: not beside a test that measures rates.
    let _cpu = crate::common::cpu_measuring();
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
    let pods = read_pods(&dir.join("openb_pod_list_default.csv")).unwrap();
    let exp = Experiment::new(&nodes, &pods).unwrap();
    let typical = typical_pods(&exp);
    let loaded: Vec<_> = BEST_FIT.iter().map(|n| bundled(n)).collect();
    let seeds: Vec<u64> = (42..=51).collect();
    let runs: Vec<(usize, u64)> = (0..BEST_FIT.len()).flat_map(|p| seeds.iter().map(move |&s| (p, s))).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(vec![None; runs.len()]);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(&(p, seed)) = runs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                    // What is compared is placements; the deadline is the
                    // conformance suite's business, and a loaded machine
                    // must not turn a slow Python call into a failed replay.
                    let limits = Limits { deadline: std::time::Duration::from_secs(10), ..Limits::default() };
                    let mut policy = WasmPolicy::new(engine(), loaded[p].clone(), limits);
                    policy.configure(&berth::replay::policy_config(&typical, seed)).unwrap();
                    let r = exp.run(seed, &mut policy, false, |_| {}).unwrap_or_else(|e| panic!("{} seed {seed}: {e}", BEST_FIT[p]));
                    results.lock().unwrap()[p * seeds.len() + (seed - 42) as usize] = Some(r);
                }
            });
        }
    });
    let results: Vec<_> = results.into_inner().unwrap().into_iter().map(Option::unwrap).collect();
    for (k, &seed) in seeds.iter().enumerate() {
        let reference = &results[k];
        assert!(reference.pods_placed > 8_000, "seed {seed}: {} placed", reference.pods_placed);
        for (p, name) in BEST_FIT.iter().enumerate().skip(1) {
            let other = &results[p * seeds.len() + k];
            assert_eq!(other.decisions.len(), reference.decisions.len(), "{name} seed {seed}");
            let first_mismatch = reference.decisions.iter().zip(&other.decisions).position(|(a, b)| a != b);
            assert!(
                first_mismatch.is_none(),
                "{name} seed {seed}: pod {} differs: {:?} vs best-fit {:?}",
                first_mismatch.unwrap(),
                other.decisions[first_mismatch.unwrap()],
                reference.decisions[first_mismatch.unwrap()]
            );
            assert_eq!(other.curve, reference.curve, "{name} seed {seed}");
        }
    }
}

/// The newcomer's path in every language and for every hook, from a fresh
/// folder outside the repository: `berth policy new --hook`, `./build.sh` in
/// the project's folder, `berth policy test`, and the hook's rule deciding
/// as its Rust counterpart's. The build runs with the PATH a user's shell has, with
/// Berth's tool cache taken off it (scripts/lang-env.sh puts it there): the
/// build script must find the tools itself. A language whose toolchain is not
/// installed must fail to build naming the installer to run (and may not be
/// missing under CI or BERTH_REQUIRE_TOOLCHAINS=1).
#[test]
fn scaffolded_projects_build_and_conform() {
    // Sixteen builds keep both CPUs busy: not beside a test that measures
    // rates.
    let _cpu = crate::common::cpu_measuring();
    let berth = env!("CARGO_BIN_EXE_berth");
    let scratch = std::env::temp_dir().join(format!("berth-test-{}-scaffold", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let scratch = scratch.canonicalize().unwrap();
    assert!(!scratch.starts_with(repo_root().canonicalize().unwrap()), "{} is inside the repository", scratch.display());
    let tools = std::env::var_os("BERTH_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/berth-tools"));
    let user_path =
        std::env::join_paths(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).filter(|p| !p.starts_with(&tools))).unwrap();
    // Where build.sh looks: PATH, then the tool cache.
    let searched = std::env::join_paths(std::env::split_paths(&user_path).chain(["py/bin", "npm/bin", "cargo/bin"].iter().map(|d| tools.join(d)))).unwrap();
    let has = |tool: &str| Command::new("sh").arg("-c").arg(format!("command -v {tool}")).env("PATH", &searched).output().is_ok_and(|o| o.status.success());
    let required = ["BERTH_REQUIRE_TOOLCHAINS", "CI"].iter().any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()));
    let new = |lang: &str, hook: &str, name: &str| {
        Command::new(berth).args(["policy", "new", "--lang", lang, "--hook", hook, name, "--dir"]).arg(&scratch).current_dir(&scratch).output().unwrap()
    };
    let mut built = 0;
    let langs = [
        ("rust", "cargo", "install-guest-toolchain.sh"),
        ("python", "componentize-py", "install-lang-toolchains.sh"),
        ("js", "componentize-js", "install-lang-toolchains.sh"),
        ("c", "wit-bindgen", "install-lang-toolchains.sh"),
    ];
    for (lang, tool, installer) in langs {
        for hook in ["place", "rank", "compact", "pool"] {
            let name = format!("hello-{lang}-{hook}");
            let out = new(lang, hook, &name);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let project = scratch.join(&name);
            let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
            for want in ["./build.sh", &format!("berth policy test {name}.wasm"), "berth:policy@0.4.0", "pool-place", installer] {
                assert!(readme.contains(want), "README lacks {want:?}:\n{readme}");
            }
            assert!(!readme.contains("{{"), "unfilled placeholder:\n{readme}");
            if lang != "rust" {
                let wit = std::fs::read_to_string(project.join("wit/policy.wit")).unwrap();
                assert!(wit.contains("package berth:policy@0.4.0;"));
            }
            let build = Command::new("./build.sh")
                .current_dir(&project)
                .env("PATH", &user_path)
                .env_remove("BERTH")
                // Rust: only a cache, the guest build's (with rustc-web a fresh
                // target folder compiles std for wasm32 again); the SDK and the
                // tools are found as a user's are.
                .env("CARGO_TARGET_DIR", repo_root().join("target/guest"))
                .output()
                .unwrap();
            let build_log = format!("{}{}", String::from_utf8_lossy(&build.stdout), String::from_utf8_lossy(&build.stderr));
            if !has(tool) {
                assert!(!required, "{tool} missing for --lang {lang}");
                assert!(!build.status.success(), "{lang} built without {tool}:\n{build_log}");
                assert!(build_log.contains(tool) && build_log.contains(installer), "{lang}: the error must name {tool} and {installer}:\n{build_log}");
                eprintln!("--lang {lang}: {tool} not installed; build.sh said so");
                continue;
            }
            assert!(build.status.success(), "{lang} build:\n{build_log}");
            let test = Command::new(berth).args(["policy", "test", "--json"]).arg(format!("{name}.wasm")).current_dir(&project).output().unwrap();
            let stdout = String::from_utf8_lossy(&test.stdout);
            assert!(test.status.success(), "{lang}: berth policy test failed:\n{stdout}{}", String::from_utf8_lossy(&test.stderr));
            let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(report["policy"], name.as_str(), "{stdout}");
            assert_eq!(report["contract"], "0.4.0", "{lang}: {stdout}");
            let rules: Vec<&str> = report["rules"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
            let claimed = match hook {
                "place" => "score/gpu-masks",
                "rank" => "rank/unique",
                "compact" => "compact/host-accepts",
                _ => "pool-step/valid",
            };
            assert!(rules.contains(&claimed), "{lang} {hook}: {claimed} not checked: {stdout}");
            // Working, not a stub: each hook's rule decides as its Rust
            // counterpart's.
            let wasm = project.join(format!("{name}.wasm"));
            match hook {
                "rank" => assert_ranks_as_spot_gpu(&name, load(&wasm)),
                "compact" => assert_compacts_as_drain(&name, wasm.to_str().unwrap()),
                "pool" => assert_pools_as_pool_demand(&name, load(&wasm)),
                _ => {}
            }
            built += 1;
            // A second project of the same name is refused.
            assert!(!new(lang, hook, &name).status.success());
        }
    }
    assert!(built >= 4, "{built} projects built");
    let bad = Command::new(berth).args(["policy", "new", "--lang", "c", "--hook", "evict", "x"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown hook"));
    let bad = Command::new(berth).args(["policy", "new", "--lang", "cobol", "x"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown language"));
    let _ = std::fs::remove_dir_all(&scratch);
}

/// A build script whose tool is missing says what to install: the Python, JS
/// and C projects built with an empty tool cache and only the system PATH.
#[test]
fn scaffolded_build_names_the_missing_tool() {
    let berth = env!("CARGO_BIN_EXE_berth");
    let scratch = std::env::temp_dir().join(format!("berth-test-{}-scaffold-missing", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let empty_tools = scratch.join("no-tools");
    std::fs::create_dir_all(&empty_tools).unwrap();
    let system_path = "/usr/bin:/bin";
    for (lang, tool) in [("python", "componentize-py"), ("js", "componentize-js"), ("c", "wit-bindgen")] {
        let on_system = Command::new("sh").arg("-c").arg(format!("command -v {tool}")).env("PATH", system_path).output().unwrap().status.success();
        if on_system {
            eprintln!("skipping --lang {lang}: {tool} is installed system-wide");
            continue;
        }
        let name = format!("missing-{lang}");
        let out = Command::new(berth).args(["policy", "new", "--lang", lang, &name, "--dir"]).arg(&scratch).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let build = Command::new("./build.sh").current_dir(scratch.join(&name)).env("PATH", system_path).env("BERTH_TOOLS", &empty_tools).output().unwrap();
        let stderr = String::from_utf8_lossy(&build.stderr);
        assert!(!build.status.success(), "{lang}: {stderr}");
        let installer = repo_root().join("scripts/install-lang-toolchains.sh").canonicalize().unwrap();
        assert!(stderr.contains(&format!("{tool} ")) && stderr.contains(&format!("bash {}", installer.display())), "{lang}: {stderr}");
        assert!(!scratch.join(&name).join(format!("{name}.wasm")).exists());
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Runs `berth replay` with `args` and returns its JSON report.
fn replay_json(args: &[&str], name: &str) -> serde_json::Value {
    let out = std::env::temp_dir().join(format!("berth-test-{}-{name}.json", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_berth")).arg("replay").args(args).arg("--json").arg(&out).output().unwrap();
    assert!(run.status.success(), "{name}: {}", String::from_utf8_lossy(&run.stderr));
    let report = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    report
}

/// Drops every `wall_s` (time taken, not decided).
fn without_wall_time(mut v: serde_json::Value) -> serde_json::Value {
    match &mut v {
        serde_json::Value::Object(map) => {
            map.remove("wall_s");
            for x in map.values_mut() {
                *x = without_wall_time(x.take());
            }
        }
        serde_json::Value::Array(items) => {
            for x in items {
                *x = without_wall_time(x.take());
            }
        }
        _ => {}
    }
    v
}

const FLEET: [&str; 10] = ["--fleet", "asi", "--fleet-scale", "0.02", "--days", "2", "--seeds", "1", "--policy", "best-fit"];

fn lenient() -> Limits {
    // What is compared is decisions; a loaded machine must not turn a slow
    // Python call into a failure.
    Limits { deadline: std::time::Duration::from_secs(10), ..Limits::default() }
}

/// `other` ranks as spot-gpu on 300 random victim lists (gangs, shared
/// GPUs, ties in lost work broken by job id).
fn assert_ranks_as_spot_gpu(label: &str, other: Arc<LoadedPolicy>) {
    use berth_core::pool::SplitMix;
    use berth_sdk::{Allocations, Task};
    let (mut rust, mut other) = (WasmPolicy::new(engine(), bundled("spot-gpu"), lenient()), WasmPolicy::new(engine(), other, lenient()));
    let mut rng = SplitMix::new(7);
    for case in 0..300u64 {
        let n = 1 + rng.below(24);
        let mut v = Allocations::default();
        for i in 0..n {
            let shared = rng.below(4) == 0;
            v.ids.push(i as u32);
            v.job_ids.push(100 + rng.below(n.div_ceil(2)) as u64);
            v.node.push(rng.below(6) as u32);
            v.gpus.push(if shared { 1 << rng.below(8) } else { (1u64 << (1 + rng.below(8))) - 1 });
            v.gpu_milli.push(if shared { 100 * (1 + rng.below(9)) as u32 } else { 1000 });
            v.cpu_milli.push(4000);
            v.memory_mib.push(8192);
            v.priority.push(rng.below(3) as u32);
            v.movable.push(1);
            v.gang_id.push(0);
            v.state_bytes.push(0);
            v.remaining_s.push(0);
            v.running_s.push(3600);
            v.since_checkpoint_s.push(600 * rng.below(4) as u64);
        }
        let demand = Task { job_id: case, gpu_count: 8, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, priority: 9, gang_size: 1, ..Task::default() };
        let (a, b) = (rust.rank(&demand, &mut v.clone()).unwrap(), other.rank(&demand, &mut v.clone()).unwrap_or_else(|e| panic!("{label}: {e}")));
        assert_eq!(a, b, "case {case}: {label} ranks {b:?}, spot-gpu {a:?}");
    }
}

/// `component` (a name or a path) compacts as drain through a two-day
/// replay of the ASI-like fleet: every plan alike, or the reports part.
fn assert_compacts_as_drain(label: &str, component: &str) {
    let rust = without_wall_time(replay_json(&[&FLEET[..], &["--compact", "drain"]].concat(), "drain"));
    let other = without_wall_time(replay_json(&[&FLEET[..], &["--compact", component]].concat(), label));
    let moves = rust["reports"][0]["compaction"]["moves_run"].as_u64().unwrap();
    assert!(moves > 20, "{moves} moves");
    assert_eq!(rust, other, "{label}: the compaction replays differ");
}

/// `other` places and steps as pool-demand through a pool simulation.
fn assert_pools_as_pool_demand(label: &str, other: Arc<LoadedPolicy>) {
    use berth_core::pool::{self, RunOptions, Synthetic};
    let file = berth::pool::PoolFile::load("default").unwrap();
    let cfg = file.config();
    let requests = Synthetic { rate: 2.0, duration_s: 120.0, ..file.workload.synthetic.clone() }.generate(cfg.models.len(), 3);
    let opts = RunOptions { layout: vec![(1, 4), (4, 2)], record_steps: true };
    let run = |loaded: Arc<LoadedPolicy>| pool::run(&cfg, &requests, &opts, &mut WasmPolicy::new(engine(), loaded, lenient())).unwrap_or_else(|e| panic!("{label}: {e}"));
    let ((a, steps_a), (b, steps_b)) = (run(bundled("pool-demand")), run(other));
    assert!(a.step_calls > 100 && steps_a.len() > 100, "{} step calls", a.step_calls);
    if let Some(k) = steps_a.iter().zip(&steps_b).position(|(x, y)| x != y) {
        panic!("step {k}: {label} {:?}, pool-demand {:?}", steps_b[k], steps_a[k]);
    }
    assert_eq!((a, steps_a.len()), (b, steps_b.len()), "{label}");
}

/// The bundled rank, compact and pool policies in Python, JavaScript and C
/// decide as their Rust counterparts on the same inputs: spot-gpu-py as
/// spot-gpu (random victim lists, and a preemption replay), drain-js as
/// drain, pool-demand-c as pool-demand.
#[test]
fn other_hooks_in_other_languages_decide_as_rust() {
    assert_ranks_as_spot_gpu("spot-gpu-py", bundled("spot-gpu-py"));
    let preempt = replay_json(&[&FLEET[..], &["--preempt", "spot-gpu", "--preempt", "spot-gpu-py"]].concat(), "rank");
    let runs = preempt["preemption"].as_array().unwrap();
    let (a, b) = (&runs[runs.len() - 2], &runs[runs.len() - 1]);
    assert_eq!((a["run"].as_str().unwrap(), b["run"].as_str().unwrap()), ("fill + spot-gpu", "fill + spot-gpu-py"));
    assert!(a["evictions"].as_u64().unwrap() > 0, "{a}");
    let strip = |mut x: serde_json::Value| {
        x.as_object_mut().unwrap().remove("run");
        x
    };
    assert_eq!(strip(a.clone()), strip(b.clone()), "the preemption replays differ");
    assert_compacts_as_drain("drain-js", "drain-js");
    assert_pools_as_pool_demand("pool-demand-c", bundled("pool-demand-c"));
}
