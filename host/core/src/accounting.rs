//! Fleet accounting with the three denominators ASI reports need:
//! physical (installed, powered, healthy), schedulable (idle capacity some
//! pending shape can use now) and productive (allocated and advancing
//! work), plus reclaimable capacity, idle GPUs stranded by cause, the
//! outcome (completed work per installed accelerator-hour and per cost) and
//! shape quotes. Pure functions of fleet state.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::fleet::{Allocation, Fleet, Node};
use crate::predicate::{self, Unfit};
use crate::capacity::{fitting_tasks, tasks_on_node};
use crate::task::TaskShape;
use crate::units::MILLI_PER_GPU;

/// GPUs (in whole GPUs, fractional where shared) of one group of nodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Denominators {
    pub installed: f64,
    /// Installed on nodes not reported powered down.
    pub powered: f64,
    /// Powered, reachable and not failed.
    pub healthy: f64,
    /// Idle GPU capacity on healthy nodes that at least one pending shape
    /// could use now.
    pub schedulable: f64,
    pub busy: f64,
    /// Allocated and advancing work (from telemetry; the caller's estimate
    /// in replay).
    pub productive: f64,
    /// GPUs a high-priority job could have without waiting for work to
    /// end: held by preemptible (low-priority) work, or lent by a sleeping
    /// job and idle.
    pub reclaimable: f64,
}

impl Denominators {
    /// Adds `other`'s GPUs to these.
    pub fn add(&mut self, other: &Denominators) {
        self.installed += other.installed;
        self.powered += other.powered;
        self.healthy += other.healthy;
        self.schedulable += other.schedulable;
        self.busy += other.busy;
        self.productive += other.productive;
        self.reclaimable += other.reclaimable;
    }
}

/// What the caller knows of one node beyond the fleet's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeFacts {
    /// False when the node reported itself powered down.
    pub powered: bool,
    /// Allocated milli-GPU doing useful work there.
    pub productive_milli: u64,
    /// Milli-GPU held by preemptible work, or lent by sleeping work and idle.
    pub reclaimable_milli: u64,
}

/// Why idle GPUs on healthy nodes serve no pending shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum StrandedCause {
    /// No pending shape accepts the node's GPU model.
    ModelMismatch,
    /// The GPUs are free but the host lacks CPU or memory for any shape.
    CpuStarved,
    /// The node is partly used: too few whole GPUs (or shares) left.
    PartiallyUsed,
    /// A task would fit the node, but its gang cannot fit the node's switch
    /// domain.
    Topology,
}

/// A pending shape: per-task shape, tasks, and whether the gang must stay
/// within one switch domain.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingShape {
    pub shape: TaskShape,
    pub tasks: u32,
    pub same_domain: bool,
}

/// The accounting of a fleet at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Accounting {
    pub total: Denominators,
    /// By GPU model name.
    pub by_model: BTreeMap<String, Denominators>,
    /// By partition (as the caller numbers them).
    pub by_partition: BTreeMap<u32, Denominators>,
    /// Idle GPUs on healthy nodes no pending shape can use, by cause.
    pub stranded: BTreeMap<StrandedCause, f64>,
}

fn gpus(milli: u64) -> f64 {
    milli as f64 / f64::from(MILLI_PER_GPU)
}

/// How the idle GPUs of one healthy node stand against the pending shapes:
/// `None` if some shape can use them, else the cause.
fn idle_cause(node: &Node, pending: &[PendingShape], room: &[BTreeMap<u32, u32>]) -> Option<StrandedCause> {
    let mut best: Option<StrandedCause> = None;
    let mut note = |c: StrandedCause| best = Some(best.map_or(c, |b: StrandedCause| b.max(c)));
    for (p, room) in pending.iter().zip(room) {
        match predicate::check(node, &p.shape) {
            Ok(()) => {
                if p.same_domain && p.tasks > 1 && room.get(&node.switch_domain).copied().unwrap_or(0) < p.tasks {
                    note(StrandedCause::Topology);
                } else {
                    return None;
                }
            }
            Err(Unfit::ModelMismatch) | Err(Unfit::Unschedulable) => note(StrandedCause::ModelMismatch),
            Err(Unfit::Cpu) | Err(Unfit::Memory) => {
                // CPU-starved only if the GPUs themselves would do.
                let gpu_only = TaskShape { cpu_milli: 0, memory_mib: 0, ..p.shape.clone() };
                if predicate::check(node, &gpu_only).is_ok() {
                    note(StrandedCause::CpuStarved);
                } else {
                    note(StrandedCause::PartiallyUsed);
                }
            }
            Err(Unfit::GpuCount) | Err(Unfit::GpuFree) => note(StrandedCause::PartiallyUsed),
        }
    }
    Some(best.unwrap_or(StrandedCause::ModelMismatch))
}

/// Accounts `fleet` against the `pending` shapes. `partition_of[node]` names
/// each node's partition; `facts(node)` says what the fleet's records do
/// not (power, productive and reclaimable GPUs).
pub fn account(fleet: &Fleet, pending: &[PendingShape], partition_of: &[u32], facts: &dyn Fn(usize, &Node) -> NodeFacts) -> Accounting {
    let mut acc = Accounting::default();
    // Tasks of each same-domain gang shape that fit per domain, computed
    // once per shape.
    let room: Vec<BTreeMap<u32, u32>> = pending
        .iter()
        .map(|p| {
            let mut m = BTreeMap::new();
            if p.same_domain && p.tasks > 1 {
                for n in fleet.nodes() {
                    *m.entry(n.switch_domain).or_insert(0) += tasks_on_node(n, &p.shape);
                }
            }
            m
        })
        .collect();
    for (i, node) in fleet.nodes().iter().enumerate() {
        let installed = node.gpu_total_milli();
        let free = node.gpu_free_milli();
        let busy = installed - free;
        let f = facts(i, node);
        let mut d = Denominators {
            installed: gpus(installed),
            powered: if f.powered { gpus(installed) } else { 0.0 },
            busy: gpus(busy),
            productive: gpus(f.productive_milli.min(busy)),
            reclaimable: gpus(f.reclaimable_milli.min(installed)),
            ..Default::default()
        };
        if node.schedulable && f.powered {
            d.healthy = gpus(installed);
            if free > 0 {
                match idle_cause(node, pending, &room) {
                    None => d.schedulable = gpus(free),
                    Some(cause) => *acc.stranded.entry(cause).or_insert(0.0) += gpus(free),
                }
            }
        }
        let model = node.model.map_or_else(|| "cpu-only".to_string(), |m| fleet.models[m as usize].clone());
        for target in [&mut acc.total, acc.by_model.entry(model).or_default(), acc.by_partition.entry(partition_of.get(i).copied().unwrap_or(0)).or_default()] {
            target.add(&d);
        }
    }
    acc
}

/// Work counted in a job's own units (steps, tokens, requests within SLO).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Work {
    /// Units reported done.
    pub done: f64,
    /// Of those, units lost: done after the last checkpoint by a run that
    /// was preempted, migrated or failed, so done again after.
    pub lost: f64,
}

impl Work {
    /// Work that counts: done and not lost.
    pub fn goodput(&self) -> f64 {
        (self.done - self.lost).max(0.0)
    }

}

/// The outcome: completed work normalised by the installed
/// accelerator-hours and by their cost over the same time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Outcome {
    pub work: Work,
    pub installed_gpu_hours: f64,
    /// Goodput per installed GPU-hour (0 before any hour is counted).
    pub per_installed_gpu_hour: f64,
    /// The installed GPU-hours priced by the cost table; `None` without one.
    pub cost: Option<f64>,
    /// Goodput per unit of cost.
    pub per_cost: Option<f64>,
}

/// The outcome of `work` done on `installed_gpu_hours` costing `cost`.
pub fn outcome(work: Work, installed_gpu_hours: f64, cost: Option<f64>) -> Outcome {
    let per = |d: f64| if d > 0.0 { work.goodput() / d } else { 0.0 };
    Outcome { work, installed_gpu_hours, per_installed_gpu_hour: per(installed_gpu_hours), cost, per_cost: cost.map(per) }
}

/// A shape quote: how many could start now, and when the next could.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Quote {
    /// Copies of the whole request (all tasks) that fit right now.
    pub now: u32,
    /// Seconds from now until one more copy could start as running work
    /// ends on plan; `None` if never (or not within the running work).
    pub next_in_s: Option<u64>,
    /// With a start deadline (seconds from now): whether one copy can start
    /// by then (now, or as running work ends).
    pub meets_deadline: Option<bool>,
}

/// Copies of the whole `request` that fit `fleet` now, counting up to
/// `enough` (a same-domain gang is counted per switch domain).
pub fn copies(fleet: &Fleet, request: &PendingShape, enough: u32) -> u32 {
    let tasks = request.tasks.max(1);
    if request.same_domain && tasks > 1 {
        let mut per: BTreeMap<u32, u32> = BTreeMap::new();
        for n in fleet.nodes() {
            let t = per.entry(n.switch_domain).or_insert(0);
            *t = t.saturating_add(tasks_on_node(n, &request.shape));
        }
        per.values().fold(0u32, |sum, &t| sum.saturating_add(t / tasks)).min(enough)
    } else {
        fitting_tasks(fleet, &request.shape, enough.saturating_mul(tasks)) / tasks
    }
}

/// Installed GPU-hours of `fleet`, each node's GPUs counted for
/// `hours_of(node)`, and their cost by `costs` (GPU model in lower case to
/// the price of a GPU-hour) when it prices every model present (`None`
/// otherwise, or without a table).
pub fn installed_gpu_hours(fleet: &Fleet, costs: &BTreeMap<String, f64>, hours_of: &dyn Fn(usize) -> f64) -> (f64, Option<f64>) {
    let (mut hours, mut cost) = (0.0, (!costs.is_empty()).then_some(0.0));
    for (i, n) in fleet.nodes().iter().enumerate().filter(|(_, n)| !n.gpus.is_empty()) {
        let h = n.gpus.len() as f64 * hours_of(i);
        hours += h;
        let price = n.model.and_then(|m| costs.get(&fleet.models[m as usize].to_ascii_lowercase()));
        cost = cost.zip(price).map(|(c, p)| c + p * h);
    }
    (hours, cost)
}

/// Quotes `request` on `fleet`, given running work as (planned end, its
/// allocations), at time `now_s`, against an optional start deadline
/// (seconds from now).
pub fn quote(fleet: &Fleet, request: &PendingShape, running: &[(u64, Vec<Allocation>)], now_s: u64, deadline_s: Option<u64>) -> Quote {
    let copies = |f: &Fleet| copies(f, request, u32::MAX);
    let now = copies(fleet);
    let mut ends: Vec<&(u64, Vec<Allocation>)> = running.iter().collect();
    ends.sort_by_key(|(end, _)| *end);
    let mut scratch = fleet.clone();
    let mut next_in_s = None;
    for (end, allocs) in ends {
        for a in allocs {
            if scratch.release(a).is_err() {
                return Quote { now, next_in_s: None, meets_deadline: deadline_s.map(|_| now > 0) };
            }
        }
        if copies(&scratch) > now {
            next_in_s = Some(end.saturating_sub(now_s));
            break;
        }
    }
    let meets_deadline = deadline_s.map(|d| now > 0 || next_in_s.is_some_and(|n| n <= d));
    Quote { now, next_in_s, meets_deadline }
}
