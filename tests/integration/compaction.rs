//! Compaction end to end: the IPC policy as a wasm component frees whole
//! nodes through the host's validation and make-before-break execution, the
//! exact solver is never beaten by the heuristic, and `berth compact` /
//! `berth replay --save-snapshot` work as real processes.

use std::process::Command;
use std::time::Duration;

use berth::compact::{milp, SnapshotFile};
use berth::wasm::Limits;
use berth_core::compaction::{self, CompactionConfig, Running, SimulatedActuator, Wanted};
use berth_core::fleet::{Fleet, Node, NodeId};
use berth_core::placement::default_gpus;
use berth_core::TaskShape;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common;

/// `nodes` 8-GPU H800 nodes (4 per switch domain), each holding a few
/// small allocations chosen by `seed`: a fragmented partition.
fn fragmented(nodes: usize, seed: u64) -> (Fleet, Vec<Running>) {
    let list = (0..nodes)
        .map(|i| {
            let mut n = Node::new(format!("n{i}"), Some(0), 8, 128_000, 1 << 20);
            n.switch_domain = (i / 4) as u32;
            n.aggregation = (i / 16) as u32;
            n
        })
        .collect();
    let mut fleet = Fleet::new(vec!["H800".into()], list).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut running = Vec::new();
    for k in 0..nodes as NodeId {
        for _ in 0..rng.random_range(1..=3) {
            let (gpus, milli) = [(1, 1000), (2, 1000), (1, 500), (1, 250)][rng.random_range(0..4)];
            let s = TaskShape { gpu_count: gpus, gpu_milli: milli, cpu_milli: 8_000, memory_mib: 32_768, models: vec![] };
            let n = fleet.node(k).unwrap();
            if berth_core::predicate::check(n, &s).is_err() {
                continue;
            }
            let a = Fleet::allocation(k, &s, default_gpus(n, &s));
            fleet.allocate(&a).unwrap();
            let id = running.len() as u32;
            running.push(Running {
                id,
                job_id: u64::from(id),
                node: k,
                gpus: a.gpus,
                gpu_milli: milli,
                cpu_milli: s.cpu_milli,
                memory_mib: s.memory_mib,
                priority: 1,
                movable: true,
                gang_id: 0,
                state_bytes: 30 << 30,
                remaining_s: 12 * 3600,
                running_s: 3600,
                since_checkpoint_s: 900,
                last_moved_s: None,
                class: Default::default(),
            });
        }
    }
    (fleet, running)
}

fn always_on() -> CompactionConfig {
    CompactionConfig { start_partial_pct: 0.0, stop_partial_pct: 0.0, ..CompactionConfig::default() }
}

#[test]
fn wasm_ipc_frees_whole_nodes_on_a_fragmented_partition() {
    let (mut fleet, mut running) = fragmented(60, 1);
    let nodes: Vec<NodeId> = compaction::partition_nodes(&fleet, None);
    let mut policy = common::wasm_policy(&common::policy_path("ipc"), Limits { deadline: Duration::from_secs(30), ..Limits::default() });
    policy.configure(r#"{"depth": 3, "rounds": 5}"#).unwrap();
    let pending = vec![Wanted { gpu_count: 8, gpu_milli: 1000, cpu_milli: 64_000, memory_mib: 1 << 19, model: Some(0), tasks: 2, whole_nodes: 2 }];
    let mut active = false;
    let out = compaction::step(&mut fleet, &nodes, &mut running, &pending, &mut policy, &always_on(), &mut active, &mut SimulatedActuator, 0)
        .unwrap();
    assert!(out.rejected.is_none(), "{:?}", out.rejected);
    let l = &out.ledger;
    assert_eq!(l.idle_nodes_before, 0);
    assert!(l.whole_nodes_gained >= 5, "gained {}", l.whole_nodes_gained);
    assert!(l.partial_nodes_after < l.partial_nodes_before);
    assert!(l.gang_unblocked);
    assert_eq!(l.bytes_moved(), l.moves_run * (30 << 30));
    fleet.check_invariants().unwrap();
    // Same answer natively (the wasm sandbox changes nothing).
    let (mut f2, mut r2) = fragmented(60, 1);
    let mut native = berth::native::NativePolicy::<berth_policy_ipc::Ipc>::default();
    native.configure(r#"{"depth": 3, "rounds": 5}"#).unwrap();
    let mut active = false;
    let out2 = compaction::step(&mut f2, &nodes, &mut r2, &pending, &mut native, &always_on(), &mut active, &mut SimulatedActuator, 0).unwrap();
    assert_eq!(out2.ledger, out.ledger);
}

#[test]
fn the_exact_optimum_is_never_below_the_heuristic() {
    let mut gaps = Vec::new();
    for seed in 0..4 {
        let (fleet, running) = fragmented(10, 100 + seed);
        let nodes: Vec<NodeId> = compaction::partition_nodes(&fleet, None);
        let config = CompactionConfig { speculative_value: 1.0, payback_margin: 0.0, ..always_on() };
        let exact = milp::solve(&fleet, &nodes, &running, None, &config, 0, Duration::from_secs(120)).unwrap();
        let (mut f, mut r) = (fleet.clone(), running.clone());
        let mut native = berth::native::NativePolicy::<berth_policy_ipc::Ipc>::default();
        let mut active = false;
        let out = compaction::step(&mut f, &nodes, &mut r, &[], &mut native, &config, &mut active, &mut SimulatedActuator, 0).unwrap();
        let heuristic = out.ledger.idle_nodes_after;
        assert!(exact.optimum_idle >= exact.idle_before);
        assert!(exact.optimum_idle >= heuristic, "seed {seed}: exact {} < heuristic {heuristic}", exact.optimum_idle);
        if exact.optimum_idle == heuristic && exact.proven_optimal {
            assert!(exact.optimum_moves <= out.ledger.moves_run, "seed {seed}: same nodes with more moves at the optimum");
        }
        gaps.push((exact.optimum_idle - heuristic, exact.optimum_moves, out.ledger.moves_run, exact.solve_ms));
    }
    println!("gap (nodes, optimum moves, heuristic moves, solve ms) per seed at 10 nodes: {gaps:?}");
}

fn berth() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_berth"));
    c.env("BERTH_POLICY_DIR", common::repo_root().join("target/policies"));
    c
}

#[test]
fn berth_compact_on_a_saved_snapshot() {
    let dir = std::env::temp_dir().join(format!("berth-compact-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (fleet, running) = fragmented(40, 7);
    let file = SnapshotFile::capture(&fleet, running, vec![], "test".into(), "now".into(), 0);
    let path = dir.join("snap.json");
    file.save(&path).unwrap();
    let out = berth().args(["compact", "--snapshot"]).arg(&path).args(["--policy", "ipc", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let total = &report["total"];
    let (before, after) = (total["partial_nodes_before"].as_u64().unwrap(), total["partial_nodes_after"].as_u64().unwrap());
    assert_eq!(before, 40);
    assert!(after < before, "{before} -> {after}");
    assert!(total["whole_nodes_gained"].as_i64().unwrap() > 0);
    assert!(total["moves_run"].as_u64().unwrap() > 0);
    // The text report prints the figures and the ledger.
    let out = berth().args(["compact", "--snapshot"]).arg(&path).args(["--policy", "ipc"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("partially occupied nodes 40 ->") && text.contains("bytes moved"), "{text}");
    // A bad file is a clear error.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"format": "something-else", "version": 1}"#).unwrap();
    let out = berth().args(["compact", "--snapshot"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a Berth compaction snapshot"));
    std::fs::write(&bad, r#"{"format": "berth-compaction-snapshot", "version": 99}"#).unwrap();
    let out = berth().args(["compact", "--snapshot"]).arg(&bad).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("version"));
    // An over-committed snapshot names the allocation.
    let mut broken = file.clone();
    let dup = broken.running[0].clone();
    broken.running.push(Running { id: 9999, ..dup.clone() });
    broken.running.push(Running { id: 9998, ..dup.clone() });
    broken.running.push(Running { id: 9997, ..dup });
    broken.save(&bad).unwrap();
    let out = berth().args(["compact", "--snapshot"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("allocation 999"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replay_saves_a_snapshot_that_berth_compact_reads() {
    let dir = std::env::temp_dir().join(format!("berth-compact-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fleet = dir.join("fleet.toml");
    std::fs::write(
        &fleet,
        "seed = 7\nnodes_per_switch = 8\nswitches_per_aggregation = 4\nnodes_per_partition = 40\nunhealthy_fraction = 0.0\n\n\
         [[shapes]]\nmodel = \"H800\"\ncount = 80\ngpus = 8\ncpu_cores = 128\nmemory_gib = 2048\n",
    )
    .unwrap();
    let snap = dir.join("snap.json");
    let out = berth()
        .args(["replay", "--fleet"])
        .arg(&fleet)
        .args(["--days", "1", "--seeds", "1", "--policy", "best-fit", "--quiet", "--save-snapshot"])
        .arg(&snap)
        .args(["--at", "12h"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = SnapshotFile::load(&snap).unwrap();
    assert_eq!(file.now_s, 12 * 3600);
    assert_eq!(file.nodes.len(), 80);
    assert_eq!(file.partitions(), vec![0, 1]);
    assert!(!file.running.is_empty());
    assert!(file.running.iter().all(|r| r.remaining_s > 0));
    let out = berth().args(["compact", "--snapshot"]).arg(&snap).args(["--policy", "ipc", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["partitions"].as_array().unwrap().len(), 2);
    assert!(report["total"]["partial_nodes_after"].as_u64() <= report["total"]["partial_nodes_before"].as_u64());
    // --at for a trace is a percentage; a time is refused with a clear error.
    let out = berth().args(["replay", "--nodes", "x.csv", "--pods", "y.csv", "--policy", "fgd", "--save-snapshot"]).arg(&snap).args(["--at", "12h"]).output().unwrap();
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
