//! The event loop's queue: a waiting gang starts at the first event at which
//! all its tasks fit, however the capacity came back (the loop keeps a bound
//! per waiting gang and skips scans while it is too small; these tests fail
//! if the bound is not raised by every departure, or counts the wrong nodes).

use berth_core::sim::{simulate, Job, SimConfig};
use berth_core::{Fleet, Node, PlacementPolicy, PolicyError, TaskShape};
use berth_sdk::{Nodes, Scores, Task};

struct FirstFit;

impl PlacementPolicy for FirstFit {
    fn describe(&self) -> String {
        "first-fit".into()
    }
    fn score(&mut self, _task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Ok(Scores::from_scores(nodes.iter().map(|n| -f64::from(n.id)).collect()))
    }
}

/// Two partitions of four 8-GPU nodes, one switch domain each.
fn fleet() -> Fleet {
    let nodes = (0..8u32)
        .map(|i| {
            let mut n = Node::new(format!("n{i}"), Some(0), 8, 64_000, 256_000);
            n.partition = i / 4;
            n.switch_domain = i / 4;
            n
        })
        .collect();
    Fleet::new(vec!["A".into()], nodes).unwrap()
}

fn whole_node() -> TaskShape {
    TaskShape { gpu_count: 8, gpu_milli: 1000, cpu_milli: 8000, memory_mib: 8192, models: vec![] }
}

fn small() -> TaskShape {
    TaskShape { gpu_count: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: vec![] }
}

/// Four whole-node jobs fill partition 0 and end one by one (one event
/// each); a gang of four whole nodes waits for all of them. Small jobs
/// arriving in between add events at which nothing was freed.
fn run(gang_partition: Option<u32>, fillers_in: u32) -> (Vec<Job>, berth_core::sim::SimOutcome) {
    let mut jobs = Vec::new();
    for k in 0..4u64 {
        jobs.push(Job { id: k, arrival_s: 0, duration_s: 3600 * (k + 1), tasks: 1, shape: whole_node(), partition: Some(fillers_in), ..Job::default() });
    }
    jobs.push(Job { id: 4, arrival_s: 60, duration_s: 3600, tasks: 4, shape: whole_node(), partition: gang_partition, ..Job::default() });
    // Short small jobs on the other partition: events without departures
    // that matter to the gang.
    for k in 0..20u64 {
        jobs.push(Job { id: 5 + k, arrival_s: 120 + k * 900, duration_s: 300, tasks: 1, shape: small(), partition: Some(1 - fillers_in), ..Job::default() });
    }
    let mut fleet = fleet();
    let out = simulate(&mut fleet, &jobs, &mut FirstFit, SimConfig { horizon_s: 24 * 3600, high_priority: 0, ..SimConfig::default() }).unwrap();
    fleet.check_invariants().unwrap();
    (jobs, out)
}

#[test]
fn a_waiting_gang_starts_when_the_last_node_it_needs_frees() {
    let (_, out) = run(Some(0), 0);
    // The fillers end at 1, 2, 3 and 4 h; only then do four nodes fit.
    assert_eq!(out.jobs[4].start_s, Some(4 * 3600), "gang start");
    assert_eq!(out.jobs[4].domains, 1);
}

#[test]
fn capacity_freed_in_another_partition_does_not_start_a_gang() {
    // Partition 1 is full until 4 h; the small jobs come and go in
    // partition 0, which the gang may not use.
    let (_, out) = run(Some(1), 1);
    assert_eq!(out.jobs[4].start_s, Some(4 * 3600), "gang start");
    // Every small job ran at once in its own partition.
    assert!(out.jobs[5..].iter().zip(0u64..).all(|(o, k)| o.start_s == Some(120 + k * 900)));
}

#[test]
fn a_fleet_wide_gang_uses_capacity_wherever_it_frees() {
    // Fillers in partition 0, gang not bound to a partition: partition 1's
    // four nodes hold it at once, despite the 1-GPU jobs passing through.
    let (_, out) = run(None, 0);
    assert_eq!(out.jobs[4].start_s, Some(60), "gang start");
}
