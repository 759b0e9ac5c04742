//! The `berth compact` command line and the replay's `--save-snapshot`
//! hooks; `main.rs` only forwards to these.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use berth_core::compaction::CompactionConfig;

use super::{CompactOptions, SnapshotFile};
use crate::wasm::PolicyEngine;

/// `berth compact`: one compaction step per partition of a saved snapshot
/// (hysteresis bypassed; validation, payback and make-before-break as in
/// replay), before/after figures and the migration ledger; or, with
/// `--live`, one step on a running `berth serve`.
#[derive(clap::Args, Debug)]
pub struct CompactArgs {
    /// Snapshot saved by `berth replay ... --save-snapshot FILE --at ...`.
    #[arg(long, required_unless_present = "live", conflicts_with = "live")]
    pub snapshot: Option<PathBuf>,
    /// Compact a partition of a running `berth serve` (operator): its
    /// active compact policy plans, and the chains that pay back run
    /// make-before-break on its agents.
    #[arg(long, requires = "partition")]
    pub live: bool,
    /// With --live: print the plan, its payback and what it would free;
    /// nothing moves.
    #[arg(long, requires = "live")]
    pub dry_run: bool,
    #[command(flatten)]
    pub conn: crate::serve::cli::Conn,
    /// Compaction policy: a bundled component name (`ipc`), a .wasm path,
    /// or `ipc-native` (the IPC policy compiled into berth, not sandboxed).
    #[arg(long, default_value = "ipc")]
    pub policy: String,
    /// The policy's configuration text (JSON or `key = value`), e.g.
    /// '{"depth": 3, "rounds": 5}'.
    #[arg(long, default_value = "")]
    pub policy_config: String,
    /// Compaction settings (JSON object of `CompactionConfig` fields, e.g.
    /// '{"payback_margin": 2.0}'); unknown fields are errors.
    #[arg(long)]
    pub config: Option<String>,
    /// Only this partition: its number in a snapshot, its name (e.g. p0)
    /// with --live.
    #[arg(long)]
    pub partition: Option<String>,
    /// Deadline of one policy call, ms.
    #[arg(long, default_value_t = 60_000)]
    pub deadline_ms: u64,
    /// Also solve partitions of at most 25 nodes exactly (MILP) and report
    /// the heuristic's gap.
    #[arg(long)]
    pub exact: bool,
    /// Time limit of one exact solve, s.
    #[arg(long, default_value_t = 300.0)]
    pub exact_time_limit_s: f64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(engine: impl FnOnce() -> anyhow::Result<Arc<PolicyEngine>>, args: CompactArgs) -> anyhow::Result<()> {
    if args.live {
        let partition = args.partition.clone().context("--live needs --partition")?;
        return crate::serve::cli::compact_live(partition, args.dry_run, args.json, args.conn);
    }
    let engine = engine()?;
    let snapshot = args.snapshot.clone().context("--snapshot (or --live)")?;
    let partition = args.partition.as_deref().map(|p| p.parse::<u32>().with_context(|| format!("--partition {p:?}: a snapshot's partitions are numbers"))).transpose()?;
    let config: CompactionConfig = match &args.config {
        Some(text) => serde_json::from_str(text).context("--config")?,
        None => CompactionConfig::default(),
    };
    config.check().map_err(anyhow::Error::msg).context("--config")?;
    anyhow::ensure!(args.exact_time_limit_s.is_finite() && args.exact_time_limit_s > 0.0, "--exact-time-limit-s must be positive");
    let opts = CompactOptions {
        policy: &args.policy,
        policy_config: &args.policy_config,
        partition,
        deadline: Duration::from_millis(args.deadline_ms.max(1)),
        exact: args.exact,
        exact_time_limit: Duration::from_secs_f64(args.exact_time_limit_s),
        config,
    };
    let report = super::run(&engine, &snapshot, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", super::table(&report));
    }
    Ok(())
}

fn announce(file: &SnapshotFile, out: &Path) {
    let allocated: usize = file.running.len();
    eprintln!(
        "saved snapshot {} ({} nodes, {} running allocations, {} pending shapes, at {})",
        out.display(),
        file.nodes.len(),
        allocated,
        file.pending.len(),
        file.at
    );
}

/// `berth replay --nodes .. --pods .. --save-snapshot FILE --at P%`: the
/// first policy and the first seed.
pub fn save_openb(engine: &Arc<PolicyEngine>, nodes: Option<&Path>, pods: Option<&Path>, policies: &[String], seeds: &[u64], at: &str, out: &Path) -> anyhow::Result<()> {
    let (Some(nodes), Some(pods)) = (nodes, pods) else {
        anyhow::bail!("--save-snapshot needs a trace (--nodes and --pods) or a fleet (--fleet)");
    };
    let policy = policies.first().context("--save-snapshot needs a placement --policy")?;
    let seed = *seeds.first().context("--save-snapshot needs a seed")?;
    let file = super::save_openb(engine, nodes, pods, policy, seed, at, out)?;
    announce(&file, out);
    Ok(())
}

/// `berth replay --fleet .. --save-snapshot FILE --at T`: the core
/// simulation up to the snapshot time with the first policy.
#[allow(clippy::too_many_arguments)]
pub fn save_event(
    engine: &Arc<PolicyEngine>,
    fleet: &berth_core::Fleet,
    jobs: &[berth_core::sim::Job],
    guards: &berth_core::sim::Guards,
    policies: &[String],
    fleet_spec: &str,
    seed: u64,
    at: &str,
    out: &Path,
) -> anyhow::Result<()> {
    let policy = policies.first().context("--save-snapshot needs a placement --policy")?;
    let source = format!("fleet {fleet_spec} ({} nodes), {} jobs, {policy}, seed {seed}", fleet.nodes().len(), jobs.len());
    let file = super::save_event(engine, fleet, jobs, guards, policy, source, at, out)?;
    announce(&file, out);
    Ok(())
}
