//! The seeded synthetic ASI workload: job classes in ASI's proportions,
//! model pinning, lognormal durations, gangs up to hundreds of GPUs, CPU:GPU
//! ratios up to 8 GPUs + 128 cores, and a daily cycle in high-priority
//! demand.

use anyhow::Context;
use berth_core::sim::Job;
use berth_core::{Fleet, TaskShape};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

/// Job classes, in the order of [`WorkloadConfig::class_shares`].
/// The fifth, `cpu-only`, is drawn apart (see [`WorkloadConfig::cpu_only_share`]).
pub const CLASSES: [&str; 5] = ["online-inference", "offline-inference", "training", "development", "cpu-only"];
/// Index of the CPU-only class in [`CLASSES`].
pub const CPU_ONLY: usize = 4;
/// Priority of high-priority classes (online inference, training,
/// development); offline inference is low priority.
pub const HIGH_PRIORITY: u32 = 10;
/// Priority of low-priority work (offline inference).
pub const LOW_PRIORITY: u32 = 1;

/// A workload description.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkloadConfig {
    pub seed: u64,
    /// Simulated days of arrivals.
    pub days: f64,
    /// Mean GPU demand as a share of the fleet's GPUs; sets the arrival rate.
    pub load: f64,
    /// Relative swing of high-priority arrivals over the day (0: flat).
    pub daily_amplitude: f64,
    /// Shares of jobs per class in %: online inference, offline inference,
    /// training, development (ASI: 54.6, 21.6, 19.5, 3.4).
    pub class_shares: [f64; 4],
    /// Share of jobs pinned to one GPU model (ASI: over 99%).
    pub pinned_share: f64,
    /// Median and 90th percentile of job durations, in hours (ASI: ~5, ~24).
    pub duration_median_h: f64,
    pub duration_p90_h: f64,
    /// CPU-only jobs (no GPU: data processing, builds, services sharing the
    /// GPU nodes' hosts) per GPU job, drawn from their own random stream so
    /// the GPU jobs are the same with or without them (0: none, the
    /// default). ASI: CPU-only jobs dominate CPU use on 80% of GPU nodes.
    pub cpu_only_share: f64,
    /// Median and 90th percentile of a CPU-only job's duration, in hours.
    pub cpu_only_median_h: f64,
    pub cpu_only_p90_h: f64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            seed: 1,
            days: 7.0,
            load: 0.9,
            daily_amplitude: 0.3,
            class_shares: [54.6, 21.6, 19.5, 3.4],
            pinned_share: 0.993,
            duration_median_h: 5.0,
            duration_p90_h: 24.0,
            cpu_only_share: 0.0,
            cpu_only_median_h: 1.0,
            cpu_only_p90_h: 8.0,
        }
    }
}

/// The `backlog` preset: ASI's mix of high-priority work with a large
/// backlog of low-priority offline inference (about a third of the fleet's
/// GPUs in low-priority demand on top of the high-priority load), the case
/// where ASI's allocation went from 68% with high priority alone to 93%
/// with low-priority fill.
pub const BACKLOG: &str = "# High-priority work as in ASI's mix, plus a low-priority backlog.
load = 2.0
class_shares = [40.0, 220.0, 12.0, 2.0]
";

/// The `colocated` preset: ASI's mix with as many CPU-only jobs as GPU
/// jobs sharing the GPU nodes, the case where where CPU-only work lands
/// decides how much training gets done (replay with `--interference`).
pub const COLOCATED: &str = "# ASI's mix plus one CPU-only job per GPU job.
cpu_only_share = 1.0
";

/// Names of the built-in workloads `--workload` takes besides a file.
pub const PRESETS: [&str; 3] = ["asi", "backlog", "colocated"];

impl WorkloadConfig {
    /// A built-in workload by name (`asi`: the default mix; `backlog`), or
    /// a TOML file.
    pub fn load(spec: &str) -> anyhow::Result<WorkloadConfig> {
        match spec {
            "asi" => Ok(WorkloadConfig::default()),
            "backlog" | "colocated" => {
                let text = if spec == "backlog" { BACKLOG } else { COLOCATED };
                let cfg: WorkloadConfig = crate::text::parse_toml(text).with_context(|| format!("the embedded {spec} workload"))?;
                cfg.check()?;
                Ok(cfg)
            }
            path => WorkloadConfig::load_file(path).with_context(|| format!("a workload is a preset ({}) or a TOML file", PRESETS.join(", "))),
        }
    }

    pub fn load_file(path: &str) -> anyhow::Result<WorkloadConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading workload config {path}"))?;
        let cfg: WorkloadConfig = crate::text::parse_toml(&text).with_context(|| format!("workload config {path}"))?;
        cfg.check().with_context(|| format!("workload config {path}"))?;
        Ok(cfg)
    }

    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.days > 0.0 && self.days <= 366.0, "days must be in (0, 366]");
        anyhow::ensure!(self.load > 0.0 && self.load <= 5.0, "load must be in (0, 5]");
        anyhow::ensure!((0.0..1.0).contains(&self.daily_amplitude), "daily_amplitude must be in [0, 1)");
        anyhow::ensure!(self.class_shares.iter().all(|s| *s >= 0.0) && self.class_shares.iter().sum::<f64>() > 0.0, "class_shares must be non-negative, not all 0");
        anyhow::ensure!((0.0..=1.0).contains(&self.pinned_share), "pinned_share must be in [0, 1]");
        anyhow::ensure!(
            self.duration_median_h > 0.0 && self.duration_p90_h > self.duration_median_h,
            "need 0 < duration_median_h < duration_p90_h"
        );
        anyhow::ensure!((0.0..=20.0).contains(&self.cpu_only_share), "cpu_only_share must be in [0, 20]");
        anyhow::ensure!(
            self.cpu_only_median_h > 0.0 && self.cpu_only_p90_h > self.cpu_only_median_h,
            "need 0 < cpu_only_median_h < cpu_only_p90_h"
        );
        Ok(())
    }

    /// Generates the jobs for `fleet`: models are drawn in proportion to the
    /// fleet's GPUs, and no task asks more CPU or memory than a node of its
    /// model has (such a job could never start).
    pub fn generate(&self, fleet: &Fleet) -> Vec<Job> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let models = ModelInfo::of(fleet);
        let sigma = (self.duration_p90_h / self.duration_median_h).ln() / 1.281_551_565_5;
        let mean_duration_s = self.duration_median_h * 3600.0 * (sigma * sigma / 2.0).exp();
        // Mean GPUs per job, from a probe sample of the same mix.
        let mut probe = ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed);
        let mean_gpus = (0..4000).map(|_| self.draw_shape(&mut probe, &models).gpus() as f64).sum::<f64>() / 4000.0;
        let total_gpus = fleet.gpu_total_milli() as f64 / 1000.0;
        let rate = self.load * total_gpus / (mean_gpus * mean_duration_s); // jobs per second
        let horizon = self.days * 86_400.0;
        let peak = rate * (1.0 + self.daily_amplitude);
        let mut jobs = Vec::new();
        let mut t = 0.0;
        loop {
            t += -rng.random::<f64>().max(1e-12).ln() / peak;
            if t >= horizon {
                break;
            }
            let mut job = self.draw_shape(&mut rng, &models);
            // Thinning: high-priority demand follows the daily cycle, low
            // priority is flat; both average to `rate`.
            let cycle = if job.priority >= HIGH_PRIORITY {
                1.0 + self.daily_amplitude * (std::f64::consts::TAU * t / 86_400.0).sin()
            } else {
                1.0
            };
            if !rng.random_bool((cycle / (1.0 + self.daily_amplitude)).clamp(0.0, 1.0)) {
                continue;
            }
            let z: f64 = standard_normal(&mut rng);
            let hours = (self.duration_median_h * (sigma * z).exp()).clamp(0.05, 24.0 * 14.0);
            job.id = jobs.len() as u64;
            job.arrival_s = t as u64;
            job.duration_s = (hours * 3600.0) as u64;
            jobs.push(job);
        }
        if self.cpu_only_share > 0.0 {
            self.add_cpu_only(fleet, &mut jobs);
        }
        jobs
    }

    /// Adds `cpu_only_share` CPU-only jobs per GPU job, arriving evenly over
    /// the horizon, from a random stream of their own; then orders every
    /// job by arrival and numbers them again.
    fn add_cpu_only(&self, fleet: &Fleet, jobs: &mut Vec<Job>) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0xc0_0c0c);
        let count = (jobs.len() as f64 * self.cpu_only_share).round() as usize;
        let horizon = self.days * 86_400.0;
        let sigma = (self.cpu_only_p90_h / self.cpu_only_median_h).ln() / 1.281_551_565_5;
        // No larger than a quarter of the smallest GPU node's host.
        let smallest = fleet.nodes().iter().filter(|n| !n.gpus.is_empty()).map(|n| (n.cpu_total_milli, n.memory_total_mib)).min().unwrap_or((16_000, 65_536));
        for _ in 0..count {
            let cores = [2u32, 4, 8, 16][rng.random_range(0..4)].min((smallest.0 / 4000).max(1));
            let memory_mib = (u64::from(cores) * 4096).min(smallest.1 / 4);
            let z = standard_normal(&mut rng);
            let hours = (self.cpu_only_median_h * (sigma * z).exp()).clamp(0.05, 24.0 * 7.0);
            jobs.push(Job {
                class: CPU_ONLY as u8,
                priority: HIGH_PRIORITY,
                arrival_s: (rng.random::<f64>() * horizon) as u64,
                duration_s: (hours * 3600.0) as u64,
                tasks: 1,
                shape: TaskShape { gpu_count: 0, gpu_milli: 0, cpu_milli: cores * 1000, memory_mib, models: vec![] },
                declared_class: Some(berth_core::TaskClass::CpuOnly),
                ..Job::default()
            });
        }
        jobs.sort_by_key(|j| j.arrival_s);
        for (i, j) in jobs.iter_mut().enumerate() {
            j.id = i as u64;
        }
    }

    fn draw_shape(&self, rng: &mut ChaCha8Rng, models: &[ModelInfo]) -> Job {
        let total: f64 = self.class_shares.iter().sum();
        let mut pick = rng.random::<f64>() * total;
        let mut class = 0;
        for (i, s) in self.class_shares.iter().enumerate() {
            if pick < *s {
                class = i;
                break;
            }
            pick -= s;
            class = i;
        }
        let choose = |rng: &mut ChaCha8Rng, options: &[(u32, u32)]| {
            let sum: u32 = options.iter().map(|o| o.1).sum();
            let mut p = rng.random_range(0..sum);
            for &(v, w) in options {
                if p < w {
                    return v;
                }
                p -= w;
            }
            options[options.len() - 1].0
        };
        // (GPUs per task, tasks)
        let (gpus, tasks) = match class {
            0 => (choose(rng, &[(1, 50), (2, 20), (4, 15), (8, 15)]), 1),
            1 => (choose(rng, &[(1, 60), (2, 20), (4, 10), (8, 10)]), 1),
            2 => {
                if rng.random_bool(0.25) {
                    (choose(rng, &[(1, 40), (2, 30), (4, 30)]), 1)
                } else {
                    (8, choose(rng, &[(1, 30), (2, 20), (4, 15), (8, 15), (16, 10), (32, 7), (64, 3)]))
                }
            }
            _ => (choose(rng, &[(1, 70), (2, 30)]), 1),
        };
        let pinned = rng.random_bool(self.pinned_share);
        let model = {
            let sum: u64 = models.iter().map(|m| m.gpus).sum();
            let mut p = rng.random_range(0..sum.max(1));
            let mut chosen = 0;
            for (i, m) in models.iter().enumerate() {
                if p < m.gpus {
                    chosen = i;
                    break;
                }
                p -= m.gpus;
            }
            chosen
        };
        let info = &models[model];
        // CPU per GPU in whole-core steps; whole-node tasks often take the
        // whole host (8 GPUs + 128 cores where the host has them).
        let per_gpu_cores = [4u32, 8, 12, 16][rng.random_range(0..4)];
        let cpu_cores = (gpus * per_gpu_cores).min(info.cpu_cores);
        let memory_gib = (u64::from(gpus) * [64u64, 128, 192, 256][rng.random_range(0..4)]).min(info.memory_mib / 1024);
        Job {
            id: 0,
            class: class as u8,
            priority: if class == 1 { LOW_PRIORITY } else { HIGH_PRIORITY },
            arrival_s: 0,
            duration_s: 0,
            tasks,
            shape: TaskShape {
                gpu_count: gpus.min(info.gpus_per_node),
                gpu_milli: 1000,
                cpu_milli: cpu_cores * 1000,
                memory_mib: memory_gib * 1024,
                models: if pinned { vec![model as u32] } else { vec![] },
            },
            partition: None,
            contract: None,
            reports_exit: false,
            declared_class: Some(task_class(class)),
        }
    }
}

/// What the generator needs to know of each model: GPUs installed, and the
/// smallest node of that model (so generated tasks fit some node).
struct ModelInfo {
    gpus: u64,
    gpus_per_node: u32,
    cpu_cores: u32,
    memory_mib: u64,
}

impl ModelInfo {
    fn of(fleet: &Fleet) -> Vec<ModelInfo> {
        let mut out: Vec<ModelInfo> =
            fleet.models.iter().map(|_| ModelInfo { gpus: 0, gpus_per_node: u32::MAX, cpu_cores: u32::MAX, memory_mib: u64::MAX }).collect();
        for node in fleet.nodes() {
            if let Some(m) = node.model {
                let info = &mut out[m as usize];
                info.gpus += node.gpus.len() as u64;
                info.gpus_per_node = info.gpus_per_node.min(node.gpus.len() as u32);
                info.cpu_cores = info.cpu_cores.min(node.cpu_total_milli / 1000);
                info.memory_mib = info.memory_mib.min(node.memory_total_mib);
            }
        }
        out
    }
}

fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; one draw is enough here.
    let u1: f64 = rng.random::<f64>().max(1e-12);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The contract's class of an ASI class: online and offline inference are
/// inference, training and development are training.
fn task_class(class: usize) -> berth_core::TaskClass {
    match class {
        0 | 1 => berth_core::TaskClass::Inference,
        CPU_ONLY => berth_core::TaskClass::CpuOnly,
        _ => berth_core::TaskClass::Training,
    }
}

/// Columns of a workload CSV, in order.
pub const CSV_COLUMNS: [&str; 10] =
    ["id", "class", "arrival_s", "duration_s", "tasks", "gpus", "gpu_milli", "cpu_milli", "memory_mib", "model"];

/// Reads jobs from a CSV with [`CSV_COLUMNS`]: `class` one of [`CLASSES`]
/// (which sets the priority; policies see a job without GPUs as cpu-only,
/// and a cpu-only row with GPUs is refused), `model` a model of `fleet` or
/// empty for any;
/// an optional last column `partition` submits a job to a partition (empty:
/// anywhere).
/// A bad row is an error naming file, line and column.
pub fn read_csv(path: &std::path::Path, fleet: &Fleet) -> Result<Vec<Job>, crate::replay::openb::TraceError> {
    let mut reader = crate::replay::openb::Reader::open(path)?;
    reader.require(&CSV_COLUMNS)?;
    let with_partition = reader.has_column(CSV_COLUMNS.len(), "partition");
    let partitions = fleet.nodes().iter().map(|n| n.partition + 1).max().unwrap_or(0);
    let mut jobs = Vec::new();
    reader.rows(|row| {
        let class = CLASSES.iter().position(|c| *c == row.str(1)).ok_or_else(|| row.err(1, format!("{:?} is not one of {CLASSES:?}", row.str(1))))?;
        let model = match row.str(9) {
            "" => vec![],
            m => vec![fleet.model_id(m).ok_or_else(|| row.err(9, format!("model {m:?} is not in the fleet ({:?})", fleet.models)))?],
        };
        let gpus: u32 = row.num(5)?;
        if class == CPU_ONLY && gpus > 0 {
            return Err(row.err(5, format!("{gpus} GPUs for a cpu-only job: it asks for none")));
        }
        let job = Job {
            id: row.num(0)?,
            class: class as u8,
            priority: if class == 1 { LOW_PRIORITY } else { HIGH_PRIORITY },
            arrival_s: row.num(2)?,
            duration_s: row.num(3)?,
            tasks: row.num(4)?,
            shape: TaskShape { gpu_count: gpus, gpu_milli: row.num(6)?, cpu_milli: row.num(7)?, memory_mib: row.num(8)?, models: model },
            partition: match with_partition.then(|| row.str(10)) {
                None | Some("") => None,
                Some(_) => {
                    let p: u32 = row.num(10)?;
                    if p >= partitions {
                        return Err(row.err(10, format!("partition {p} does not exist (the fleet has {partitions})")));
                    }
                    Some(p)
                }
            },
            contract: None,
            reports_exit: false,
            declared_class: Some(if gpus == 0 { berth_core::TaskClass::CpuOnly } else { task_class(class) }),
        };
        if job.tasks == 0 {
            return Err(row.err(4, "a job needs at least one task"));
        }
        job.shape.check().map_err(|e| row.err(6, e))?;
        jobs.push(job);
        Ok(())
    })?;
    Ok(jobs)
}
