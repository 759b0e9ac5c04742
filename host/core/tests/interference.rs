//! Contention as the core keeps it (contract 0.4.0's columns) and replay's
//! interference model: what a node holds for CPU-only work follows its
//! allocations, a measurement marks a node changed only when it moves
//! enough, and training beside CPU-only work loses the share it is given.

use berth_core::engine::SimConfig;
use berth_core::fleet::Measured;
use berth_core::sim::{simulate, Interference};
use berth_core::{Allocation, Fleet, Job, Node, TaskClass, TaskShape};

mod common;

use common::FirstFit;

fn fleet() -> Fleet {
    Fleet::new(vec!["A".into()], vec![Node::new("n0", Some(0), 8, 64_000, 256_000)]).unwrap()
}

#[test]
fn a_nodes_contention_follows_its_allocations() {
    let mut f = fleet();
    let cpu = Allocation { node: 0, gpus: 0, gpu_milli: 0, cpu_milli: 6000, memory_mib: 1024 };
    let gpu = Allocation { node: 0, gpus: 0b11, gpu_milli: 1000, cpu_milli: 8000, memory_mib: 1024 };
    f.allocate(&cpu).unwrap();
    f.allocate(&gpu).unwrap();
    let c = f.nodes()[0].contention();
    assert_eq!((c.gpu_tasks, c.cpu_only_milli), (1, 6000));
    // Nothing measures it: CPU "used" is what is allocated, no pressure.
    assert_eq!((c.cpu_used_milli, c.cpu_pressure), (14_000, 0));
    f.release(&cpu).unwrap();
    assert_eq!(f.nodes()[0].contention().cpu_only_milli, 0);
    // A release of CPU-only work the node does not hold is refused.
    assert!(f.release(&cpu).is_err());
    f.release(&gpu).unwrap();
    assert_eq!(f.nodes()[0].contention().gpu_tasks, 0);
    f.check_invariants().unwrap();
}

#[test]
fn a_measurement_marks_the_node_changed_only_when_it_moves_enough() {
    let mut f = fleet();
    let m = Measured { cpu_used_milli: 2000, cpu_pressure: 100, memory_pressure: 0, io_pressure: 0 };
    let mark = f.changes();
    f.set_measured(0, Some(m)).unwrap();
    assert!(f.changes() > mark, "a first measurement is a change");
    assert_eq!(f.nodes()[0].contention().cpu_pressure, 100);
    let mark = f.changes();
    f.set_measured(0, Some(Measured { cpu_used_milli: 2050, cpu_pressure: 110, ..m })).unwrap();
    assert_eq!(f.changes(), mark, "a small move is not");
    assert_eq!(f.nodes()[0].contention().cpu_used_milli, 2000, "and is not taken");
    f.set_measured(0, Some(Measured { cpu_pressure: 300, ..m })).unwrap();
    assert!(f.changes() > mark);
    assert!(f.set_measured(7, None).is_err(), "an unknown node is refused");
}

#[test]
fn per_job_losses_have_the_median_and_p90_asked_for() {
    let model = Interference::ASI;
    let mut losses: Vec<f64> = (0..20_000u64).map(|id| model.loss_of(id)).collect();
    assert_eq!(model.loss_of(42), model.loss_of(42), "one job, one loss");
    losses.sort_by(f64::total_cmp);
    let (median, p90) = (losses[10_000], losses[18_000]);
    assert!((0.095..0.105).contains(&median), "median {median}");
    assert!((0.17..0.19).contains(&p90), "p90 {p90}");
    assert!(losses.iter().all(|l| (0.0..=0.9).contains(l)));
    assert!(Interference { median_loss: 0.2, p90_loss: 0.1 }.check().is_err());
    assert!(Interference { median_loss: 0.1, p90_loss: 0.95 }.check().is_err());
}

/// A training job of 2 GPUs for 6,000 s; a CPU-only job beside it for the
/// first 3,000 s when `neighbour`.
fn run(neighbour: bool, class: Option<TaskClass>) -> f64 {
    let gpu = TaskShape { gpu_count: 2, gpu_milli: 1000, cpu_milli: 4000, memory_mib: 1024, models: vec![] };
    let cpu = TaskShape { gpu_count: 0, gpu_milli: 0, cpu_milli: 4000, memory_mib: 1024, models: vec![] };
    let mut jobs = vec![Job { id: 1, duration_s: 6000, tasks: 1, shape: gpu, declared_class: class, ..Job::default() }];
    if neighbour {
        jobs.push(Job { id: 2, duration_s: 3000, tasks: 1, shape: cpu, ..Job::default() });
    }
    let config = SimConfig { horizon_s: 10_000, interference: Some(Interference::ASI), ..SimConfig::default() };
    simulate(&mut fleet(), &jobs, &mut FirstFit, config).unwrap().interference_lost_gpu_s
}

#[test]
fn training_beside_cpu_only_work_loses_its_share_while_it_is_there() {
    let loss = Interference::ASI.loss_of(1);
    let lost = run(true, None);
    // 2 GPUs x 3,000 s beside the neighbour, sampled every 300 s.
    let want = 2.0 * 3000.0 * loss;
    assert!((lost - want).abs() <= 2.0 * Interference::SAMPLE_S * loss + 1e-9, "lost {lost} GPU-s, want about {want}");
    assert_eq!(run(false, None), 0.0, "alone it loses nothing");
    assert_eq!(run(true, Some(TaskClass::Inference)), 0.0, "inference is not modelled as slowed");
}

#[test]
fn a_saved_snapshot_keeps_each_allocations_class() {
    use berth_core::compaction::Running;
    let r = Running {
        id: 1,
        job_id: 2,
        node: 0,
        gpus: 0,
        gpu_milli: 0,
        cpu_milli: 4000,
        memory_mib: 1024,
        priority: 0,
        movable: true,
        gang_id: 0,
        state_bytes: 0,
        remaining_s: 0,
        running_s: 0,
        since_checkpoint_s: 0,
        last_moved_s: None,
        class: TaskClass::CpuOnly,
    };
    let text = serde_json::to_string(&r).unwrap();
    assert!(text.contains("\"class\":\"cpu-only\""), "{text}");
    assert_eq!(serde_json::from_str::<Running>(&text).unwrap(), r);
    // One saved before classes existed reads as training.
    let old = text.replace(",\"class\":\"cpu-only\"", "");
    assert_eq!(serde_json::from_str::<Running>(&old).unwrap().class, TaskClass::Training);
    assert!(serde_json::from_str::<Running>(&text.replace("cpu-only", "gpu-heavy")).is_err());
}
