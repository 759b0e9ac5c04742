//! Hostile guests: every misbehaviour gives the right typed error within the
//! deadline, and the same policy then answers an honest call correctly.

use std::time::{Duration, Instant};

use berth::bench::batch;
use berth::wasm::Limits;
use berth_core::{Fleet, PlacementPolicy, Placer, PolicyError, TaskMeta, TaskShape};
use berth_sdk::Allocations;

use crate::common::{guest_path, wasm_policy};

/// The deadline of the timeout test. Other tests get a generous one, so a
/// loaded CI machine cannot turn their failure into a timeout.
const DEADLINE: Duration = Duration::from_millis(100);

fn limits() -> Limits {
    Limits { deadline: Duration::from_secs(5), memory_bytes: 64 << 20, log_lines_per_call: 5, ..Limits::default() }
}

/// A small fleet where every node fits a half-GPU task.
fn fleet() -> Fleet {
    berth::synth::fleet(40, 3, false)
}

fn shape() -> TaskShape {
    TaskShape { gpu_count: 1, gpu_milli: 500, cpu_milli: 1000, memory_mib: 1024, models: vec![] }
}

/// Places with the hostile policy acting as `job`, through the core (which
/// validates the answer), and times the call.
fn place_as(policy: &mut dyn PlacementPolicy, job: u64) -> (Result<Option<berth_core::Placement>, PolicyError>, Duration) {
    let fleet = fleet();
    let start = Instant::now();
    let r = Placer::new().place(&fleet, &shape(), TaskMeta { job_id: job, ..Default::default() }, policy, None);
    (r, start.elapsed())
}

/// The honest answer: the node with the most free GPU, lowest id on ties
/// (all nodes are idle, so node 0), on its best-fit GPU 0.
fn assert_honest(policy: &mut dyn PlacementPolicy) {
    let (r, _) = place_as(policy, 0);
    let p = r.expect("honest call after a failure must succeed").expect("fits");
    assert_eq!(p.node, 0);
    assert_eq!(p.gpus, 1);
    assert_eq!(p.score, 8000.0);
}

fn check(job: u64, expect: impl Fn(&PolicyError) -> bool, what: &str) {
    check_with(limits(), job, expect, what)
}

fn check_with(limits: Limits, job: u64, expect: impl Fn(&PolicyError) -> bool, what: &str) {
    let deadline = limits.deadline;
    let mut policy = wasm_policy(&guest_path("hostile"), limits);
    assert_honest(&mut policy);
    let (r, took) = place_as(&mut policy, job);
    let err = r.expect_err(what);
    assert!(expect(&err), "{what}: got {err:?}");
    // Generous bound for a loaded 2-core CI machine; the point is that the
    // host is never stalled by the guest.
    assert!(took < deadline * 20, "{what}: took {took:?}");
    assert_honest(&mut policy);
}

#[test]
fn infinite_loop_times_out() {
    check_with(Limits { deadline: DEADLINE, ..limits() }, 1, |e| matches!(e, PolicyError::Timeout { deadline_ms: 100 }), "infinite loop");
}

#[test]
fn memory_bomb_hits_the_cap() {
    check(2, |e| matches!(e, PolicyError::OutOfMemory { cap_bytes } if *cap_bytes == 64 << 20), "memory bomb");
}

#[test]
fn panic_is_a_trap() {
    check(3, |e| matches!(e, PolicyError::Trap(_)), "panic");
}

#[test]
fn wrong_length_is_invalid() {
    check(4, |e| matches!(e, PolicyError::InvalidOutput(m) if m.contains("41 scores for 40")), "wrong length");
}

#[test]
fn nan_score_is_invalid() {
    check(5, |e| matches!(e, PolicyError::InvalidOutput(m) if m.contains("NaN")), "NaN score");
}

#[test]
fn infinite_score_is_invalid() {
    check(8, |e| matches!(e, PolicyError::InvalidOutput(m) if m.contains("inf")), "infinite score");
}

#[test]
fn unknown_gpu_is_invalid() {
    check(6, |e| matches!(e, PolicyError::InvalidOutput(m) if m.contains("does not have")), "unknown GPU");
}

#[test]
fn huge_output_is_contained() {
    // 6M f64 = 48 MB: either the guest hits its 64 MiB cap building it, or
    // the host rejects the length. Both are contained errors.
    check(
        7,
        |e| matches!(e, PolicyError::OutOfMemory { .. }) || matches!(e, PolicyError::InvalidOutput(m) if m.contains("6000000 scores")),
        "huge output",
    );
}

#[test]
fn stack_overflow_is_a_trap() {
    check(9, |e| matches!(e, PolicyError::Trap(_)), "stack overflow");
}

#[test]
fn guest_error_is_reported() {
    check(11, |e| matches!(e, PolicyError::Guest(m) if m.contains("declines")), "guest error");
}

#[test]
fn log_flood_is_rate_limited_and_the_call_succeeds() {
    let mut policy = wasm_policy(&guest_path("hostile"), limits());
    let (r, _) = place_as(&mut policy, 10);
    assert!(r.expect("log flood still answers").is_some());
}

#[test]
fn rejected_configuration_keeps_the_old_one() {
    let mut policy = wasm_policy(&guest_path("hostile"), limits());
    policy.configure("mode = 'fine'").unwrap();
    assert!(matches!(policy.configure("reject"), Err(PolicyError::Guest(_))));
    assert_honest(&mut policy);
}

#[test]
fn rank_answers_are_checked() {
    let mut policy = wasm_policy(&guest_path("hostile"), limits());
    let mut victims = Allocations {
        ids: vec![10, 11, 12],
        job_ids: vec![1, 2, 3],
        node: vec![0; 3],
        gpus: vec![1, 2, 4],
        gpu_milli: vec![1000; 3],
        cpu_milli: vec![0; 3],
        memory_mib: vec![0; 3],
        priority: vec![0; 3],
        movable: vec![1; 3],
        gang_id: vec![0; 3],
        state_bytes: vec![0; 3],
        remaining_s: vec![0; 3],
        running_s: vec![0; 3],
        since_checkpoint_s: vec![0; 3],
        class: vec![0; 3],
        tier: vec![1; 3],
        interruptions_left: vec![u32::MAX; 3],
    };
    let task = |job| berth_sdk::Task { job_id: job, gpu_count: 1, gpu_milli: 1000, ..Default::default() };
    assert_eq!(policy.rank(&task(0), &mut victims).unwrap(), vec![2, 1, 0]);
    assert!(matches!(policy.rank(&task(1), &mut victims), Err(PolicyError::InvalidOutput(m)) if m.contains("twice")));
    assert!(matches!(policy.rank(&task(2), &mut victims), Err(PolicyError::InvalidOutput(m)) if m.contains("out of")));
    // The columns come back intact after the call.
    assert_eq!(victims.ids, vec![10, 11, 12]);
}

#[test]
fn unclaimed_hook_is_unsupported() {
    let mut policy = wasm_policy(&crate::common::policy_path("binpack"), Limits::default());
    let mut victims = Allocations::default();
    assert_eq!(policy.rank(&berth_sdk::Task::default(), &mut victims), Err(PolicyError::Unsupported("rank")));
}

#[test]
fn columns_survive_a_trap() {
    let mut policy = wasm_policy(&guest_path("hostile"), limits());
    let (task, mut nodes) = batch(50, 1);
    let before = nodes.clone();
    let task = berth_sdk::Task { job_id: 3, ..task };
    assert!(policy.score(&task, &mut nodes).is_err());
    assert_eq!(nodes, before);
    assert_eq!(policy.instantiations, 1);
    let honest = berth_sdk::Task { job_id: 0, ..task };
    assert_eq!(policy.score(&honest, &mut nodes).unwrap().scores.len(), 50);
    assert_eq!(policy.instantiations, 2, "a trapped instance is replaced, not re-entered");
}

#[test]
fn domain_scores_are_checked() {
    let mut policy = wasm_policy(&guest_path("hostile"), limits());
    let mut domains = berth_sdk::Domains {
        ids: vec![3, 7],
        aggregation: vec![0, 0],
        nodes: vec![4, 4],
        idle_nodes: vec![4, 1],
        gpus_total: vec![32, 32],
        gpus_idle: vec![32, 8],
        fitting_tasks: vec![4, 1],
    };
    let task = |job| berth_sdk::Task { job_id: job, gpu_count: 8, gpu_milli: 1000, gang_size: 4, ..Default::default() };
    assert_eq!(policy.score_domains_raw(&task(0), &mut domains).unwrap(), Some(vec![0.0, 0.0]));
    let err = policy.score_domains_raw(&task(1), &mut domains).unwrap_err();
    assert!(matches!(&err, PolicyError::InvalidOutput(m) if m.contains("5 domain scores for 2")), "{err:?}");
    let err = policy.score_domains_raw(&task(2), &mut domains).unwrap_err();
    assert!(matches!(&err, PolicyError::InvalidOutput(m) if m.contains("domain 3")), "{err:?}");
    assert_eq!(domains.ids, vec![3, 7], "columns come back");
}
