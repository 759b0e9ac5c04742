//! Trace replay: readers, the FGD protocol, and the published FGD table.

use std::path::{Path, PathBuf};

use berth::replay::fgd::{typical_pods, Experiment};
use berth::replay::openb::{read_nodes, read_pods, TraceError};
use berth::replay::report::{published_name, read_published};
use berth::replay::{self, ReplayOptions};
use berth::wasm::Limits;

use crate::common::{engine, policy_path, repo_root, wasm_policy};

const SIX: [&str; 6] = ["random", "dotprod", "gpu-clustering", "gpu-packing", "best-fit", "fgd"];

/// The openb trace folder (`$BERTH_OPENB_DIR`, else `../shared/data/openb`).
/// CI sets BERTH_REQUIRE_TRACES=1 so a missing folder fails there; elsewhere
/// the trace tests are skipped with a message.
pub(crate) fn openb_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("BERTH_OPENB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared/data/openb"));
    if dir.join("openb_node_list_gpu_node.csv").is_file() {
        return Some(dir);
    }
    crate::common::skip(&format!("openb trace not found at {}", dir.display()));
    None
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("berth-test-{}-{name}", std::process::id()))
}

const POD_HEADER: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n";

#[test]
fn malformed_rows_name_file_line_and_column() {
    let dir = scratch("malformed");
    let pods = write(&dir, "pods.csv", &format!("{POD_HEADER}p1,1000,10,1,500,,LS,Running,0,5,0\np2,lots,10,1,500,,LS,Running,0,5,0\n"));
    let err = read_pods(&pods).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TraceError::Row { line: 3, .. }), "{err:?}");
    assert!(text.contains("pods.csv:3") && text.contains("cpu_milli") && text.contains("lots"), "{text}");

    let pods = write(&dir, "short.csv", &format!("{POD_HEADER}p1,1000,10,1,500,,LS\n"));
    let text = read_pods(&pods).unwrap_err().to_string();
    assert!(text.contains("short.csv:2") && text.contains("7 fields"), "{text}");

    let pods = write(&dir, "milli.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1,1,1,1500\n");
    let text = read_pods(&pods).unwrap_err().to_string();
    assert!(text.contains("milli.csv:2") && text.contains("gpu_milli") && text.contains("exceeds 1000"), "{text}");

    let pods = write(&dir, "shared.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1,1,2,500\n");
    assert!(read_pods(&pods).unwrap_err().to_string().contains("single GPU"));

    let nodes = write(&dir, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn1,1000,10,2,\n");
    let text = read_nodes(&nodes).unwrap_err().to_string();
    assert!(text.contains("nodes.csv:2") && text.contains("model"), "{text}");

    let nodes = write(&dir, "header.csv", "name,cpu,mem\nn1,1,1\n");
    assert!(read_nodes(&nodes).unwrap_err().to_string().contains("expected column 1 to be \"sn\""));

    let missing = read_pods(&dir.join("absent.csv")).unwrap_err().to_string();
    assert!(missing.contains("absent.csv"), "{missing}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_openb_file_reads_completely() {
    let Some(dir) = openb_dir() else { return };
    assert_eq!(read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap().len(), 1213);
    assert_eq!(read_nodes(&dir.join("openb_node_list_all_node.csv")).unwrap().len(), 1523);
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        if name.starts_with("openb_pod_list_") {
            let rows = std::fs::read_to_string(entry.path()).unwrap().lines().count() - 1;
            assert_eq!(read_pods(&entry.path()).unwrap().len(), rows, "{name}: every row is read");
            files += 1;
        }
    }
    assert_eq!(files, 13);
}

#[test]
fn tuning_and_typical_pods_follow_the_protocol() {
    let Some(dir) = openb_dir() else { return };
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
    let pods = read_pods(&dir.join("openb_pod_list_default.csv")).unwrap();
    let exp = Experiment::new(&nodes, &pods).unwrap();
    assert_eq!(exp.fleet().gpu_total_milli(), 6_212_000);
    let target = 1.3 * 6_212_000.0;
    let (order, tie_rank) = exp.arrival_order(42);
    // The originals come first, each exactly once, shuffled.
    let mut originals = order[..8152].to_vec();
    assert_ne!(originals, (0..8152).collect::<Vec<_>>());
    originals.sort_unstable();
    assert_eq!(originals, (0..8152).collect::<Vec<_>>());
    let demand: u64 = order.iter().map(|&i| exp.pods()[i].1.total_gpu_milli()).sum();
    assert!(demand as f64 <= target + 7000.0 && demand as f64 > target - 8000.0, "tuned demand {demand}");
    assert!(order.len() > 10_500 && order.len() < 11_300, "{} pods (authors: 10,866 for seed 42)", order.len());
    let mut ranks = tie_rank.clone();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..1213).collect::<Vec<_>>());
    assert_ne!(exp.arrival_order(43).0, order, "seeds differ");

    // The authors' typical pods for this trace: 35 shapes covering 95.26%,
    // led by (3152 mCPU, 810 mGPU x 1) with 1,047 pods; a CPU-only shape 6th.
    let typical = typical_pods(&exp);
    assert_eq!(typical.len(), 35);
    assert_eq!((typical[0].cpu_milli, typical[0].gpu_milli, typical[0].gpu_count), (3152, 810, 1));
    assert!((typical[0].weight - 1047.0 / 8152.0 / 0.9526).abs() < 1e-3, "{}", typical[0].weight);
    assert_eq!((typical[5].cpu_milli, typical[5].gpu_milli, typical[5].gpu_count), (12500, 0, 0));
    assert!((typical.iter().map(|t| t.weight).sum::<f64>() - 1.0).abs() < 1e-9);

    // A list above the target is pruned instead.
    let pods = read_pods(&dir.join("openb_pod_list_multigpu40.csv")).unwrap();
    let exp = Experiment::new(&nodes, &pods).unwrap();
    let (order, _) = exp.arrival_order(42);
    assert!(order.len() < pods.len());
    let demand: u64 = order.iter().map(|&i| exp.pods()[i].1.total_gpu_milli()).sum();
    assert!(demand as f64 <= target);
}

fn replay_six(dir: &Path, trace: &str) -> berth::replay::ReplayOutcome {
    replay_policies(dir, trace, &SIX)
}

/// The FGD protocol (seeds 42-51, wasm components) on one openb trace.
fn replay_policies(dir: &Path, trace: &str, policies: &[&str]) -> berth::replay::ReplayOutcome {
    let opts = ReplayOptions {
        trace: Some((dir.join("openb_node_list_gpu_node.csv"), dir.join(format!("{trace}.csv")))),
        synthetic_nodes: 0,
        policies: policies.iter().map(|p| p.to_string()).collect(),
        seeds: (42..=51).collect(),
        keep_order: false,
        native: false,
        workers: 0,
        progress: false,
        decisions_dir: None,
        typical_from: None,
        limits: berth::wasm::Limits { deadline: std::time::Duration::from_secs(10), ..Default::default() },
        extra_config: Default::default(),
    };
    replay::run(engine(), &opts).unwrap()
}

/// The acceptance bar: every policy's mean at 100% arrival within 0.5
/// percentage points of the published mean, and the same ranking.
fn matches_published(trace: &str) {
    let Some(dir) = openb_dir() else { return };
    let outcome = replay_six(&dir, trace);
    let published = read_published(&dir.join("fgd_published_unallocated.csv"), trace).unwrap();
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for policy in SIX {
        assert!(published_name(policy).is_some());
        let row = outcome.rows.iter().find(|r| r.policy == policy && r.arrived_pct == 100).expect("100% point");
        assert_eq!(row.seeds, 10);
        let paper = published[&(policy.to_string(), 100)];
        let diff = row.unallocated_pct_mean - paper;
        assert!(diff.abs() <= 0.5, "{trace} {policy}: berth {:.3} vs published {paper:.3}", row.unallocated_pct_mean);
        ours.push((row.unallocated_pct_mean, policy));
        theirs.push((paper, policy));
    }
    fn rank(v: &mut [(f64, &'static str)]) -> Vec<&'static str> {
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
        v.iter().map(|x| x.1).collect()
    }
    assert_eq!(rank(&mut ours), rank(&mut theirs), "{trace}: ranking differs");
    // Nothing is ever over-committed and nothing allocates past capacity.
    assert!(outcome.runs.iter().all(|r| r.final_unallocated_pct >= 0.0 && r.pods_placed <= r.pods_offered));
}

#[test]
fn fgd_table_default_trace() {
    matches_published("openb_pod_list_default");
}

#[test]
fn fgd_table_gpuspec20() {
    matches_published("openb_pod_list_gpuspec20");
}

#[test]
fn fgd_table_multigpu40() {
    matches_published("openb_pod_list_multigpu40");
}

/// berth-frag (docs/src/beyond-fgd.md) leaves less GPU capacity unallocated
/// at 100% arrival than FGD, both replayed here under the protocol, and
/// than FGD's published mean.
fn berth_frag_beats_fgd(trace: &str) {
    let Some(dir) = openb_dir() else { return };
    let outcome = replay_policies(&dir, trace, &["fgd", "berth-frag"]);
    let at100 = |policy: &str| {
        let row = outcome.rows.iter().find(|r| r.policy == policy && r.arrived_pct == 100).expect("100% point");
        assert_eq!(row.seeds, 10);
        row.unallocated_pct_mean
    };
    let (fgd, ours) = (at100("fgd"), at100("berth-frag"));
    let published = read_published(&dir.join("fgd_published_unallocated.csv"), trace).unwrap()[&("fgd".to_string(), 100)];
    assert!(ours < fgd, "{trace}: berth-frag {ours:.3} vs fgd {fgd:.3}");
    assert!(ours < published, "{trace}: berth-frag {ours:.3} vs fgd published {published:.3}");
    assert!(outcome.runs.iter().all(|r| r.pods_placed > 0 && r.pods_placed <= r.pods_offered));
}

#[test]
fn berth_frag_beats_fgd_default() {
    berth_frag_beats_fgd("openb_pod_list_default");
}

#[test]
fn berth_frag_beats_fgd_cpu200() {
    berth_frag_beats_fgd("openb_pod_list_cpu200");
}

/// berth-frag's `cpu_bound` rule (docs/src/beyond-fgd.md, "Held out"):
/// silent on work that asks less CPU per GPU than the cluster holds (its
/// decisions are those without the rule, run for run); on the same pods
/// asking more CPU than that, its decisions are FGD's.
#[test]
fn berth_frag_gives_way_to_fgds_terms_only_where_cpu_runs_out() {
    use berth::replay::openb::{NodeRow, PodRow};
    let (nodes, pods) = berth::replay::synthetic::trace(600, 4);
    let cluster = nodes.iter().map(|n| f64::from(n.cpu_milli)).sum::<f64>() / nodes.iter().map(|n| f64::from(n.gpus) * 1000.0).sum::<f64>();
    let ratio = |pods: &[PodRow]| pods.iter().map(|p| f64::from(p.cpu_milli)).sum::<f64>() / pods.iter().map(|p| p.total_gpu_milli() as f64).sum::<f64>() / cluster;
    // The same pods asking half as much CPU again (at most a node's).
    let most = nodes.iter().map(|n: &NodeRow| n.cpu_milli).max().unwrap();
    let heavy: Vec<PodRow> = pods.iter().map(|p| PodRow { cpu_milli: (p.cpu_milli * 3 / 2).min(most), ..p.clone() }).collect();
    let (light_ratio, heavy_ratio) = (ratio(&pods), ratio(&heavy));
    assert!(light_ratio < 1.0 && heavy_ratio > 1.0, "CPU per GPU against the cluster's: {light_ratio:.2} and {heavy_ratio:.2}");
    let run = |pods: &[PodRow], extra: &str| {
        let exp = Experiment::new(&nodes, pods).unwrap();
        let config = replay::policy_config_with(&typical_pods(&exp), 3, &replay::parse_extra_config(extra).unwrap());
        let mut p = wasm_policy(&policy_path("berth-frag"), Limits::default());
        p.configure(&config).unwrap();
        exp.run(3, &mut p, false, |_| {}).unwrap()
    };
    let off = r#"{"weights": {"cpu_bound": 0}}"#;
    let (light, light_off) = (run(&pods, "{}"), run(&pods, off));
    assert!(light.pods_offered > 1000, "{} pods: too few for the rule to act", light.pods_offered);
    assert_eq!(light.curve, light_off.curve, "the rule acted on work that is not CPU-bound");
    let (heavy_on, heavy_off) = (run(&heavy, "{}"), run(&heavy, off));
    assert!(heavy_on.pods_offered > 1000);
    // CPU-bound: FGD's decisions, run for run.
    let exp = Experiment::new(&nodes, &heavy).unwrap();
    let mut fgd = wasm_policy(&policy_path("fgd"), Limits::default());
    fgd.configure(&replay::policy_config(&typical_pods(&exp), 3)).unwrap();
    assert_eq!(heavy_on.curve, exp.run(3, &mut fgd, false, |_| {}).unwrap().curve, "CPU-bound work placed otherwise than FGD places it");
    assert_ne!(heavy_on.curve, heavy_off.curve, "the rule did not act on CPU-bound work ({heavy_ratio:.2}; {} pods offered, {} placed)", heavy_on.pods_offered, heavy_on.pods_placed);
}

/// `berth policy typical-pods` prints the configuration replay gives
/// FGD-style policies (for `berth policy upload --config` on a live
/// partition): the same typical pods, weights summing to 1.
#[test]
fn typical_pods_cli_prints_what_replay_configures() {
    let Some(dir) = openb_dir() else { return };
    let (nodes, pods) = (dir.join("openb_node_list_gpu_node.csv"), dir.join("openb_pod_list_gpuspec25.csv"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["policy", "typical-pods", "--seed", "7", "--nodes"])
        .arg(&nodes)
        .arg("--pods")
        .arg(&pods)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let exp = Experiment::new(&read_nodes(&nodes).unwrap(), &read_pods(&pods).unwrap()).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&replay::policy_config(&typical_pods(&exp), 7)).unwrap();
    assert_eq!(printed, expected);
    let typical = printed["typical_pods"].as_array().unwrap();
    assert!(typical.iter().any(|t| !t["models"].as_array().unwrap().is_empty()), "gpuspec25 pins pods to models");
    let total: f64 = typical.iter().map(|t| t["weight"].as_f64().unwrap()).sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
}

/// Every bundled FGD-paper policy decides the same in wasm and natively,
/// run for run, on a generated trace.
#[test]
fn six_policies_wasm_equals_native() {
    let (nodes, pods) = berth::replay::synthetic::trace(120, 5);
    let exp = Experiment::new(&nodes, &pods).unwrap();
    let config = replay::policy_config(&typical_pods(&exp), 3);
    for name in SIX {
        let mut wasm = wasm_policy(&policy_path(name), Limits::default());
        wasm.configure(&config).unwrap();
        let mut native = berth::native::by_name(name).unwrap();
        native.configure(&config).unwrap();
        let a = exp.run(3, &mut wasm, false, |_| {}).unwrap();
        let b = exp.run(3, &mut *native, false, |_| {}).unwrap();
        assert_eq!(a.curve, b.curve, "{name}");
        assert_eq!(a.pods_placed, b.pods_placed, "{name}");
        assert!(a.pods_placed > 0);
    }
}

#[test]
fn keep_order_ignores_the_seed() {
    let (nodes, pods) = berth::replay::synthetic::trace(60, 2);
    let exp = Experiment::new(&nodes, &pods).unwrap();
    let run = |seed, keep| {
        let mut p = wasm_policy(&policy_path("best-fit"), Limits::default());
        exp.run(seed, &mut p, keep, |_| {}).unwrap()
    };
    let (a, b) = (run(1, true), run(2, true));
    assert_eq!(a.curve, b.curve);
    assert_eq!(a.pods_offered, pods.len(), "no tuning with --keep-order");
    assert_ne!(run(1, false).curve, run(2, false).curve, "shuffled replays depend on the seed");
}

/// `--policy-config` reaches the policy: berth-frag with its score made
/// linear (`weights.points = 0`) decides differently from its defaults on
/// the same seeds, and an explicit copy of a default changes nothing.
#[test]
fn policy_config_reaches_the_replayed_policy() {
    let dir = scratch("policy-config");
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("r.json");
    let run = |config: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_berth"));
        cmd.args(["replay", "--policy", "berth-frag", "--seeds", "1-2", "--synthetic-nodes", "80", "--quiet", "--workers", "1", "--json"]);
        cmd.arg(&json);
        if let Some(config) = config {
            cmd.args(["--policy-config", config]);
        }
        let out = cmd.env("BERTH_POLICY_DIR", repo_root().join("target/policies")).output().unwrap();
        assert!(out.status.success(), "{config:?}: {}", String::from_utf8_lossy(&out.stderr));
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let recorded = doc.get("policy_config").cloned();
        assert_eq!(recorded, config.map(|c| serde_json::from_str::<serde_json::Value>(c).unwrap()), "the file records the settings");
        doc["results"].clone()
    };
    let defaults = run(None);
    assert!(defaults.as_array().is_some_and(|r| r.len() >= 100), "{defaults}");
    assert_eq!(run(Some(r#"{"weights": {"points": 1}}"#)), defaults);
    assert_ne!(run(Some(r#"{"weights": {"points": 0}}"#)), defaults);
    let _ = std::fs::remove_dir_all(&dir);
}

/// berth-frag's `keep` term: a rare shape only the two big nodes can host
/// (8 GPUs and 120 cores; under 5% of pods, so not a typical pod) keeps the
/// second big node whole while one-GPU work has room elsewhere. Without the
/// term, the one-GPU pods take the big node first (ties go to node order
/// with --keep-order) and the second big pod fails.
#[test]
fn berth_frag_keeps_big_nodes_for_shapes_only_they_fit() {
    let dir = scratch("keep");
    std::fs::create_dir_all(&dir).unwrap();
    let mut nodes = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    nodes += "big-0,128000,786432,8,G3\nbig-1,128000,786432,8,G3\n";
    for i in 0..20 {
        nodes += &format!("small-{i:02},96000,393216,8,G2\n");
    }
    let mut pods = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n");
    pods += "pod-000,120000,737280,8,1000\n";
    for i in 1..=60 {
        pods += &format!("pod-{i:03},4000,16384,1,1000\n");
    }
    pods += "pod-061,120000,737280,8,1000\n";
    let (nodes, pods) = (write(&dir, "nodes.csv", &nodes), write(&dir, "pods.csv", &pods));
    let last_pod_node = |config: &str| {
        let decisions = dir.join(format!("decisions-{}", config.len()));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .args(["replay", "--policy", "berth-frag", "--seeds", "1", "--keep-order", "--quiet", "--nodes"])
            .arg(&nodes)
            .arg("--pods")
            .arg(&pods)
            .arg("--decisions")
            .arg(&decisions)
            .args(["--policy-config", config])
            .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{config}: {}", String::from_utf8_lossy(&out.stderr));
        let csv = std::fs::read_to_string(decisions.join("berth-frag-seed1.csv")).unwrap();
        let rows: Vec<Vec<String>> = csv.lines().skip(1).map(|l| l.split(',').map(str::to_string).collect()).collect();
        assert_eq!(rows.len(), 62, "{csv}");
        assert_eq!(rows[0][2], "big-0", "the first big pod takes a big node");
        let one_gpu_on_big = rows[1..61].iter().filter(|r| r[2].starts_with("big")).count();
        (rows[61][2].clone(), one_gpu_on_big)
    };
    assert_eq!(last_pod_node("{}"), ("big-1".to_string(), 0), "with the term (the default)");
    let (node, on_big) = last_pod_node(r#"{"weights": {"keep": 0}}"#);
    assert_eq!(node, "", "without the term the second big pod fails");
    assert!(on_big > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// berth-frag's scarcity term charges the pinned work a placement
/// displaces (`displaced`, 0.4.0): model P's pinned pods ask 6 cores per
/// GPU, so on a P node with 2 GPUs and 8 cores their room is 1.33 GPUs
/// (CPU runs out first) and a one-core unpinned task leaves them 1: it
/// displaces a third of a GPU there, a whole one on a P node with 16
/// cores. With the change the CPU-poor P node scores above the CPU-rich
/// one for that task; charged by GPU taken (0.3.0), it does not.
#[test]
fn berth_frag_charges_the_pinned_work_a_task_displaces() {
    use berth_core::PlacementPolicy;
    use berth_sdk::{Nodes, Task};
    let config = |displaced: u32| {
        serde_json::json!({
            "typical_pods": [
                {"cpu_milli": 6000, "gpu_milli": 1000, "gpu_count": 1, "models": ["P"], "weight": 0.5},
                {"cpu_milli": 1000, "gpu_milli": 1000, "gpu_count": 1, "models": [], "weight": 0.5}
            ],
            "weights": {"displaced": displaced}
        })
        .to_string()
    };
    let mut nodes = Nodes { models: vec!["P".into(), "G".into()], ..Nodes::default() };
    nodes.push(0, 0, 0, 8000, 8000, 65_536, 65_536, &[1000, 1000], 0);
    nodes.push(1, 0, 0, 16_000, 16_000, 65_536, 65_536, &[1000, 1000], 0);
    nodes.push(2, 1, 0, 96_000, 96_000, 393_216, 393_216, &[1000; 8], 0);
    let task = Task { gpu_count: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, gang_size: 1, ..Task::default() };
    let scores = |displaced: u32| {
        let mut p = wasm_policy(&policy_path("berth-frag"), Limits::default());
        p.configure(&config(displaced)).unwrap();
        p.score(&task, &mut nodes.clone()).unwrap().scores
    };
    let (now, before) = (scores(1), scores(0));
    assert!(now[0] > now[1], "displaced: CPU-poor P {} against CPU-rich P {}", now[0], now[1]);
    assert!(before[0] <= before[1], "by GPU taken: CPU-poor P {} against CPU-rich P {}", before[0], before[1]);
    // Unpinned work still goes to the model nobody pins first.
    assert!(now[2] > now[0] && before[2] > before[0], "{now:?} {before:?}");
    assert_eq!(scores(1), now, "the same call, the same scores");
}

#[test]
fn cli_replay_writes_json_and_svg_and_rejects_bad_input() {
    let dir = scratch("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let berth = env!("CARGO_BIN_EXE_berth");
    let json = dir.join("r.json");
    let svg = dir.join("r.svg");
    let out = std::process::Command::new(berth)
        .args(["replay", "--policy", "fgd", "--policy", "best-fit", "--seeds", "1-2", "--synthetic-nodes", "60", "--quiet"])
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("arrived 100%") && stdout.contains("fgd"), "{stdout}");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let results = doc["results"].as_array().unwrap();
    for key in ["policy", "arrived_pct", "unallocated_pct_mean", "unallocated_pct_min", "unallocated_pct_max", "seeds"] {
        assert!(results.iter().all(|r| r.get(key).is_some()), "{key}");
    }
    let fgd_points = results.iter().filter(|r| r["policy"] == "fgd").count();
    assert!(fgd_points >= 120, "{fgd_points} arrival points");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("best-fit"));

    for (args, needle) in [
        (vec!["replay", "--policy", "no-such-policy", "--seeds", "1"], "no policy named \"no-such-policy\""),
        (vec!["replay", "--policy", "fgd", "--seeds", "9-3"], "--seeds"),
        (vec!["replay", "--policy", "fgd", "--nodes", "/nonexistent/n.csv", "--pods", "/nonexistent/p.csv"], "/nonexistent/n.csv"),
        (vec!["replay", "--policy", "fgd", "--nodes", "/nonexistent/n.csv"], "--pods"),
        (vec!["replay", "--policy", "fgd", "--seeds", "1", "--policy-config", "[1]"], "not a JSON object"),
        (vec!["replay", "--policy", "fgd", "--seeds", "1", "--policy-config", "{\"seed\": 3}"], "\"seed\" is set by replay"),
        (vec!["replay", "--policy", "berth-frag", "--seeds", "1", "--synthetic-nodes", "20", "--policy-config", "{\"weights\": {\"scale\": -1}}"], "weights.scale must be positive"),
    ] {
        let out = std::process::Command::new(berth)
            .args(&args)
            .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `berth trace variant`: every family reaches its level, keeps what it
/// does not change, reads back as an openb pod list, and is the same file
/// for the same seed (another seed draws other pods); a pin is only ever
/// drawn where an empty node of its models holds the pod.
#[test]
fn generated_variants_reach_their_level_and_are_seeded() {
    use berth::replay::variants::{generate, shares, write_csv, Family, Mix};
    let Some(dir) = openb_dir() else { return };
    let base = read_pods(&dir.join("openb_pod_list_default.csv")).unwrap();
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
    let b = shares(&base);
    let cases = [(Family::Cpu, 300, Mix::Openb), (Family::Gpushare, 50, Mix::Openb), (Family::Gpuspec, 20, Mix::V100), (Family::Gpuspec, 30, Mix::Openb), (Family::Multigpu, 35, Mix::Openb), (Family::Multigpu, 5, Mix::Openb)];
    for (family, level, mix) in cases {
        let made = generate(&base, &nodes, family, level, mix, 7).unwrap();
        let s = shares(&made);
        let what = format!("{family:?} {level} {mix:?}: {s:?}");
        let near = |got: f64, want: f64, within: f64| assert!((got - want).abs() <= within, "{what}: {got} against {want}");
        match family {
            Family::Cpu => {
                near(s.cpu_only_pods, f64::from(level) / 1000.0, 0.001);
                assert_eq!(made.iter().filter(|p| p.num_gpu > 0).count(), base.iter().filter(|p| p.num_gpu > 0).count(), "{what}");
            }
            Family::Gpushare => {
                near(s.shared_gpu_demand, f64::from(level) / 100.0, 0.002);
                assert_eq!((s.pods, s.cpu_only_pods), (b.pods, b.cpu_only_pods), "{what}");
            }
            Family::Gpuspec => {
                near(s.pinned_gpu_pods, f64::from(level) / 100.0, 0.001);
                assert_eq!(made.iter().map(|p| (p.cpu_milli, p.num_gpu, p.gpu_milli)).collect::<Vec<_>>(), base.iter().map(|p| (p.cpu_milli, p.num_gpu, p.gpu_milli)).collect::<Vec<_>>(), "{what}: shapes kept");
                for p in made.iter().filter(|p| !p.gpu_spec.is_empty()) {
                    assert!(nodes.iter().any(|n| p.gpu_spec.contains(&n.model) && n.gpus >= p.num_gpu && n.cpu_milli >= p.cpu_milli && n.memory_mib >= p.memory_mib), "{p:?} fits no node of its models");
                    if mix == Mix::V100 {
                        assert!(p.gpu_spec.iter().all(|m| m.starts_with("V100") || m == "P100"), "{p:?}");
                    }
                }
            }
            Family::Multigpu => {
                near(s.multi_gpu_demand, f64::from(level) / 100.0, 0.01);
                near(s.cpu_only_pods, b.cpu_only_pods, 0.02);
            }
        }
        let names: std::collections::BTreeSet<&str> = made.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names.len(), made.len(), "{what}: pod names repeat");
        // Written and read back: the same pods.
        let path = scratch(&format!("variant-{family:?}-{level}.csv"));
        write_csv(&made, std::fs::File::create(&path).unwrap()).unwrap();
        let again = read_pods(&path).unwrap();
        assert_eq!(again.len(), made.len());
        assert!(again.iter().zip(&made).all(|(a, m)| (a.name.as_str(), a.num_gpu, a.gpu_milli, &a.gpu_spec, a.cpu_milli) == (m.name.as_str(), m.num_gpu, m.gpu_milli, &m.gpu_spec, m.cpu_milli)), "{what}");
        let _ = std::fs::remove_file(&path);
        // Seeded.
        assert_eq!(generate(&base, &nodes, family, level, mix, 7).unwrap(), made, "{what}: not reproducible");
        assert_ne!(generate(&base, &nodes, family, level, mix, 8).unwrap(), made, "{what}: another seed drew the same pods");
    }
    assert!(generate(&base, &nodes, Family::Gpushare, 101, Mix::Openb, 7).unwrap_err().contains("at most"));
}

/// The command line writes the file and says what it reached.
#[test]
fn the_trace_variant_command_writes_a_pod_list_replay_reads() {
    let Some(dir) = openb_dir() else { return };
    let out = scratch("variant-cli.csv");
    let run = std::process::Command::new(crate::agent::BERTH)
        .args(["trace", "variant", "--family", "gpushare", "--level", "70", "--seed", "3", "--pods"])
        .arg(dir.join("openb_pod_list_default.csv"))
        .arg("--nodes")
        .arg(dir.join("openb_node_list_gpu_node.csv"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{said}");
    assert!(said.contains("shared-GPU demand 70.0% (28.5%)"), "{said}");
    let pods = read_pods(&out).unwrap();
    assert_eq!(pods.len(), 8152);
    let _ = std::fs::remove_file(&out);
}
