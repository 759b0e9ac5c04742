//! Fleet and topology configuration (TOML) and the seeded fleet generator.
//!
//! Nodes of one shape are laid out in order; every `nodes_per_switch`
//! consecutive nodes of a shape share an access switch (a switch domain never
//! mixes models, as in ASI where a switch joins 32-64 eight-GPU nodes), every
//! `switches_per_aggregation` switches an aggregation switch, and every
//! `nodes_per_partition` nodes a partition.

use anyhow::Context;
use berth_core::sim::{Guards, StarvationGuard};
use berth_core::{Fleet, Node};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

/// Nodes a fleet config may describe (ASI's default has 20,000): a bound
/// on what building the fleet allocates.
pub const MAX_NODES: u64 = 1_000_000;

/// A fleet description.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Seed for node health.
    #[serde(default)]
    pub seed: u64,
    /// Nodes under one access switch (ASI: 32-64 eight-GPU nodes).
    pub nodes_per_switch: u32,
    /// Access switches under one aggregation switch.
    #[serde(default = "default_aggregation")]
    pub switches_per_aggregation: u32,
    /// Nodes per partition (ASI compacts partitions of about 500 nodes).
    pub nodes_per_partition: u32,
    /// Share of nodes marked unhealthy (not schedulable), 0..1.
    #[serde(default)]
    pub unhealthy_fraction: f64,
    /// Node shapes and how many of each.
    pub shapes: Vec<NodeShape>,
    /// The fleet-wide starvation guard (absent: off).
    #[serde(default)]
    pub guard: Option<GuardConfig>,
    /// Starvation guards of particular partitions, overriding `guard`.
    #[serde(default)]
    pub partition_guard: Vec<PartitionGuardConfig>,
    /// Partitions whose work is never taken back by preemption (sold as
    /// non-preemptible); low-priority work elsewhere stays preemptible.
    #[serde(default)]
    pub non_preemptible_partitions: Vec<u32>,
    /// What one GPU-hour costs, by GPU model (any currency; models compared
    /// case-insensitively): prices the outcome (work per unit of cost).
    /// Absent: the outcome is per installed GPU-hour only.
    #[serde(default)]
    pub cost_per_gpu_hour: std::collections::BTreeMap<String, f64>,
    /// Replay's work model: how fast placed work advances (absent: every
    /// run at the reference rate).
    #[serde(default)]
    pub work: Option<WorkConfig>,
    /// Model-pool partitions (`berth serve`): their agent nodes' GPUs serve
    /// a catalog of models as executors instead of running jobs.
    #[serde(default)]
    pub pool: Vec<PoolPartitionConfig>,
}

/// `[[pool]] partition = 1, market = "default", executors = [[1, 4], [4, 1]]`:
/// partition 1 is a model pool serving the market file's catalog (`default`:
/// the embedded one, else a path relative to the fleet config's folder; a
/// pool file as for `berth replay --pool`) on executors
/// of `[tp, count]` GPUs each, started on the partition's agent nodes.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolPartitionConfig {
    pub partition: u32,
    #[serde(default = "default_market")]
    pub market: String,
    pub executors: Vec<(u32, u32)>,
}

fn default_market() -> String {
    "default".into()
}

/// Executors one pool may declare (a bound on what the host starts).
pub const MAX_POOL_EXECUTORS: u32 = 4096;

/// `[work]`: a job's duration is its work at the reference rate; a run
/// advances it at its GPU model's speed, divided by the slowdown when its
/// tasks span switch domains (see [`berth_core::sim::WorkRates`]).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkConfig {
    /// ASI: all-reduce inside one access-switch domain is up to 27% faster.
    #[serde(default = "default_slowdown")]
    pub cross_domain_slowdown: f64,
    /// Speed of each GPU model against the reference (models compared
    /// case-insensitively; unnamed: 1).
    #[serde(default)]
    pub model_speed: std::collections::BTreeMap<String, f64>,
}

impl WorkConfig {
    /// The work model for `fleet`'s GPU models.
    pub fn rates(&self, fleet: &Fleet) -> berth_core::sim::WorkRates {
        let speed = |name: &str| self.model_speed.iter().find(|(m, _)| m.eq_ignore_ascii_case(name)).map_or(1.0, |(_, &v)| v);
        berth_core::sim::WorkRates { model_speed: fleet.models.iter().map(|m| speed(m)).collect(), cross_domain_slowdown: self.cross_domain_slowdown }
    }
}

fn default_slowdown() -> f64 {
    1.27
}

/// Starvation-guard settings (see [`berth_core::sim::StarvationGuard`]).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    /// Hours a job waits, unable to start, before it gets a reservation
    /// (absent: no reservations, aging only).
    pub reserve_after_h: Option<f64>,
    /// Priority points a waiting job gains per hour.
    #[serde(default)]
    pub aging_per_hour: f64,
    /// An admission window of this many minutes: while a job that cannot
    /// start waits, at most `window_gpu_h` GPU-hours of smaller work start
    /// ahead of it per window.
    #[serde(default)]
    pub window_min: Option<f64>,
    #[serde(default)]
    pub window_gpu_h: f64,
}

/// A guard for some partitions: `[[partition_guard]] partitions = [3, 4]`
/// with `reserve_after_h` / `aging_per_hour`, or `off = true`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PartitionGuardConfig {
    pub partitions: Vec<u32>,
    #[serde(default)]
    pub off: bool,
    pub reserve_after_h: Option<f64>,
    #[serde(default)]
    pub aging_per_hour: f64,
    #[serde(default)]
    pub window_min: Option<f64>,
    #[serde(default)]
    pub window_gpu_h: f64,
}

impl GuardConfig {
    /// The core's guard; `None` when it would do nothing.
    pub fn to_guard(&self) -> anyhow::Result<Option<StarvationGuard>> {
        let reserve = self.reserve_after_h.map(|h| {
            anyhow::ensure!(h.is_finite() && h >= 0.0, "reserve_after_h must be a non-negative number of hours, not {h}");
            Ok((h * 3600.0) as u64)
        });
        let reserve_after_s = reserve.transpose()?.unwrap_or(u64::MAX);
        anyhow::ensure!(
            self.aging_per_hour.is_finite() && self.aging_per_hour >= 0.0,
            "aging_per_hour must be a non-negative number, not {}",
            self.aging_per_hour
        );
        let window = match self.window_min {
            Some(m) => {
                anyhow::ensure!(m.is_finite() && m > 0.0, "window_min must be a positive number of minutes, not {m}");
                let w = berth_core::engine::AdmissionWindow { window_s: (m * 60.0).round().max(1.0) as u64, small_gpu_h: self.window_gpu_h };
                w.check().map_err(anyhow::Error::msg)?;
                Some(w)
            }
            None => None,
        };
        let any = reserve_after_s != u64::MAX || self.aging_per_hour > 0.0 || window.is_some();
        Ok(any.then_some(StarvationGuard { reserve_after_s, aging_per_hour: self.aging_per_hour, window }))
    }
}

fn default_aggregation() -> u32 {
    8
}

/// One kind of node.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeShape {
    /// GPU model name (e.g. "H20").
    pub model: String,
    pub count: u32,
    pub gpus: u32,
    pub cpu_cores: u32,
    pub memory_gib: u32,
}

/// Where each node sits in the topology (parallel to the fleet's nodes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Topology {
    pub partition: Vec<u32>,
    pub aggregation: Vec<u32>,
    /// Nodes per access switch, for the domain lower bound of a gang.
    pub nodes_per_switch: u32,
}

/// The embedded default: a synthetic ASI fleet of 20,000 eight-GPU nodes
/// (160,000 GPUs) over five models, 48 nodes per access switch, partitions
/// of 500 nodes.
pub const ASI_DEFAULT: &str = r#"
seed = 7
nodes_per_switch = 48
switches_per_aggregation = 8
nodes_per_partition = 500
unhealthy_fraction = 0.004

[[shapes]]
model = "H20"
count = 6000
gpus = 8
cpu_cores = 128
memory_gib = 2048

[[shapes]]
model = "H800"
count = 5000
gpus = 8
cpu_cores = 128
memory_gib = 2048

[[shapes]]
model = "A100"
count = 4000
gpus = 8
cpu_cores = 96
memory_gib = 1024

[[shapes]]
model = "L20"
count = 3000
gpus = 8
cpu_cores = 64
memory_gib = 1024

[[shapes]]
model = "PPU"
count = 2000
gpus = 8
cpu_cores = 96
memory_gib = 1024

# Illustrative: how fast each model advances training work against an
# H800, and what a GPU-hour of each costs (any currency). The outcome
# (work per installed GPU-hour and per cost) reads both.
[work]
cross_domain_slowdown = 1.27

[work.model_speed]
H800 = 1.0
PPU = 0.8
A100 = 0.65
H20 = 0.45
L20 = 0.3

[cost_per_gpu_hour]
H800 = 2.0
PPU = 1.0
A100 = 1.3
H20 = 1.1
L20 = 0.6
"#;

impl FleetConfig {
    pub fn parse(text: &str, origin: &str) -> anyhow::Result<FleetConfig> {
        let cfg: FleetConfig = crate::text::parse_toml(text).with_context(|| format!("fleet config {origin}"))?;
        cfg.check().with_context(|| format!("fleet config {origin}"))?;
        Ok(cfg)
    }

    /// Reads a fleet config file, or the embedded default for `asi`.
    pub fn load(spec: &str) -> anyhow::Result<FleetConfig> {
        if spec == "asi" {
            return FleetConfig::parse(ASI_DEFAULT, "(embedded asi)");
        }
        let text = std::fs::read_to_string(spec).with_context(|| format!("reading fleet config {spec}"))?;
        let mut cfg = FleetConfig::parse(&text, spec)?;
        // A pool's market path is the config file's, as written there.
        let dir = std::path::Path::new(spec).parent().unwrap_or(std::path::Path::new(""));
        for pool in &mut cfg.pool {
            if pool.market != "default" && std::path::Path::new(&pool.market).is_relative() {
                pool.market = dir.join(&pool.market).display().to_string();
            }
        }
        Ok(cfg)
    }

    /// Scales every shape's count by `factor` (at least one node each), for
    /// smaller runs of the same mix.
    pub fn scaled(&self, factor: f64) -> FleetConfig {
        let mut c = self.clone();
        for s in &mut c.shapes {
            s.count = ((f64::from(s.count) * factor).round() as u32).max(1);
        }
        c
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.nodes_per_switch > 0, "nodes_per_switch must be positive");
        anyhow::ensure!(self.switches_per_aggregation > 0, "switches_per_aggregation must be positive");
        anyhow::ensure!(self.nodes_per_partition > 0, "nodes_per_partition must be positive");
        anyhow::ensure!((0.0..1.0).contains(&self.unhealthy_fraction), "unhealthy_fraction must be in [0, 1)");
        anyhow::ensure!(!self.shapes.is_empty(), "no node shapes");
        let total: u64 = self.shapes.iter().map(|s| u64::from(s.count)).sum();
        anyhow::ensure!(total <= MAX_NODES, "{total} nodes: a fleet config may describe at most {MAX_NODES}");
        for (i, s) in self.shapes.iter().enumerate() {
            let at = format!("shapes[{i}] ({})", s.model);
            anyhow::ensure!(!s.model.is_empty(), "{at}: empty model");
            anyhow::ensure!(s.gpus as usize <= berth_core::MAX_GPUS_PER_NODE, "{at}: {} GPUs per node is too many", s.gpus);
            anyhow::ensure!(s.cpu_cores > 0 && s.memory_gib > 0, "{at}: CPU and memory must be positive");
        }
        self.guards()?;
        if let Some(w) = &self.work {
            anyhow::ensure!(w.cross_domain_slowdown.is_finite() && w.cross_domain_slowdown >= 1.0, "work.cross_domain_slowdown: at least 1, not {}", w.cross_domain_slowdown);
            for (model, &v) in &w.model_speed {
                anyhow::ensure!(v.is_finite() && v > 0.0 && v <= 100.0, "work.model_speed.{model}: a speed in (0, 100], not {v}");
            }
        }
        for (model, &c) in &self.cost_per_gpu_hour {
            anyhow::ensure!(c.is_finite() && c >= 0.0, "cost_per_gpu_hour.{model}: a non-negative number, not {c}");
        }
        let mut pools = std::collections::BTreeSet::new();
        for (i, pool) in self.pool.iter().enumerate() {
            let at = format!("pool[{i}]");
            anyhow::ensure!(pool.partition < self.partitions(), "{at}: partition {} does not exist (the fleet has {})", pool.partition, self.partitions());
            anyhow::ensure!(pools.insert(pool.partition), "{at}: partition {} is a pool already", pool.partition);
            anyhow::ensure!(!pool.executors.is_empty(), "{at}: no executors listed ([[tp, count], ...])");
            let total: u64 = pool.executors.iter().map(|&(_, c)| u64::from(c)).sum();
            anyhow::ensure!(total >= 1 && total <= u64::from(MAX_POOL_EXECUTORS), "{at}: {total} executors (1..={MAX_POOL_EXECUTORS})");
            anyhow::ensure!(pool.executors.iter().all(|&(tp, _)| (1..=64).contains(&tp)), "{at}: an executor's tp must be 1..=64");
            anyhow::ensure!(pool.market.len() <= 4096, "{at}: market path longer than 4096 bytes");
        }
        for &p in &self.non_preemptible_partitions {
            anyhow::ensure!(p < self.partitions(), "non_preemptible_partitions: partition {p} does not exist (the fleet has {})", self.partitions());
        }
        Ok(())
    }

    /// The work model for `fleet`'s GPU models, if the config has one.
    pub fn work_rates(&self, fleet: &Fleet) -> Option<berth_core::sim::WorkRates> {
        Some(self.work.as_ref()?.rates(fleet))
    }

    /// The cost table with models in lower case.
    pub fn costs(&self) -> std::collections::BTreeMap<String, f64> {
        self.cost_per_gpu_hour.iter().map(|(m, &c)| (m.to_ascii_lowercase(), c)).collect()
    }

    /// Partitions the fleet has (numbered from 0).
    pub fn partitions(&self) -> u32 {
        let nodes: u64 = self.shapes.iter().map(|s| u64::from(s.count)).sum();
        nodes.div_ceil(u64::from(self.nodes_per_partition)) as u32
    }

    /// The starvation guards: fleet-wide and per partition.
    pub fn guards(&self) -> anyhow::Result<Guards> {
        let fleet = match &self.guard {
            Some(g) => g.to_guard().context("[guard]")?,
            None => None,
        };
        let mut guards = Guards { fleet, ..Guards::default() };
        for (i, pg) in self.partition_guard.iter().enumerate() {
            let at = format!("partition_guard[{i}]");
            anyhow::ensure!(!pg.partitions.is_empty(), "{at}: no partitions listed");
            anyhow::ensure!(!(pg.off && (pg.reserve_after_h.is_some() || pg.aging_per_hour > 0.0 || pg.window_min.is_some())), "{at}: off = true with settings");
            let guard = if pg.off {
                None
            } else {
                GuardConfig { reserve_after_h: pg.reserve_after_h, aging_per_hour: pg.aging_per_hour, window_min: pg.window_min, window_gpu_h: pg.window_gpu_h }.to_guard().context(at.clone())?
            };
            for &p in &pg.partitions {
                anyhow::ensure!(p < self.partitions(), "{at}: partition {p} does not exist (the fleet has {})", self.partitions());
                anyhow::ensure!(guards.partitions.insert(p, guard).is_none(), "{at}: partition {p} has a guard already");
            }
        }
        Ok(guards)
    }

    /// Builds the fleet and its topology.
    pub fn build(&self) -> anyhow::Result<(Fleet, Topology)> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut models: Vec<String> = Vec::new();
        let mut nodes = Vec::new();
        let mut topo = Topology { nodes_per_switch: self.nodes_per_switch, ..Topology::default() };
        let mut switch = 0u32;
        for shape in &self.shapes {
            let model = berth_core::fleet::intern_model(&mut models, &shape.model);
            for k in 0..shape.count {
                if k > 0 && k % self.nodes_per_switch == 0 {
                    switch += 1;
                }
                let id = nodes.len() as u32;
                let mut node = Node::new(
                    format!("{}-{id:05}", shape.model.to_lowercase()),
                    (shape.gpus > 0).then_some(model),
                    shape.gpus as usize,
                    shape.cpu_cores * 1000,
                    u64::from(shape.memory_gib) * 1024,
                );
                node.switch_domain = switch;
                node.aggregation = switch / self.switches_per_aggregation;
                node.partition = id / self.nodes_per_partition;
                node.schedulable = !rng.random_bool(self.unhealthy_fraction);
                topo.partition.push(id / self.nodes_per_partition);
                topo.aggregation.push(switch / self.switches_per_aggregation);
                nodes.push(node);
            }
            switch += 1;
        }
        Ok((Fleet::new(models, nodes)?, topo))
    }
}
