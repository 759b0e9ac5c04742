//! The `berth` command line: parses arguments and calls the library.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use berth::wasm::{LoadedPolicy, PolicyEngine};
use berth::{bench, catalog, componentize, demo};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "berth", version, about = "GPU-fleet scheduler with sandboxed WebAssembly policies")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Place a seeded, generated workload on a generated fleet with bundled policies.
    Demo {
        #[arg(long, default_value_t = 256)]
        nodes: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Policies to compare (names or .wasm paths).
        #[arg(long = "policy", default_values_t = ["binpack".to_string(), "spread".to_string()])]
        policies: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Policy components: inspect, build.
    Policy {
        #[command(subcommand)]
        what: PolicyCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Time one placement-scoring call in wasm and natively.
    Score {
        #[arg(long)]
        policy: String,
        #[arg(long, default_value_t = 10_000)]
        candidates: usize,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Load a component and print what it says about itself.
    Info { policy: String },
    /// Wrap a core wasm module built with berth-sdk into a component.
    Componentize {
        module: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// List bundled components.
    List,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let engine = || PolicyEngine::new(PolicyEngine::default_cache_dir()).map(Arc::new);
    match cli.command {
        Command::Demo { nodes, seed, policies, json } => {
            let rows = demo::run(engine()?, &policies, nodes, seed)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!("demo: {nodes} generated 8-GPU nodes, seed {seed}, GPU demand 110% of capacity");
                println!("{:<28} {:>7} {:>7} {:>9} {:>11} {:>10} {:>9}", "policy", "tasks", "placed", "unplaced", "allocated%", "idle nodes", "partial");
                for r in rows {
                    println!(
                        "{:<28} {:>7} {:>7} {:>9} {:>11.2} {:>10} {:>9}",
                        r.policy, r.tasks, r.placed, r.unplaced, r.allocated_pct, r.idle_nodes, r.partial_nodes
                    );
                }
            }
        }
        Command::Bench { what: BenchCommand::Score { policy, candidates, json } } => {
            anyhow::ensure!(candidates > 0, "--candidates must be at least 1");
            let r = bench::score(engine()?, &policy, candidates)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{} at {} candidates: wasm {:.1} us, native {}, ratio {}, instantiate {:.1} us ({} samples)",
                    r.policy,
                    r.candidates,
                    r.wasm_ns as f64 / 1e3,
                    r.native_ns.map_or("n/a".into(), |n| format!("{:.1} us", n as f64 / 1e3)),
                    r.ratio.map_or("n/a".into(), |x| format!("{x:.2}")),
                    r.instantiate_ns as f64 / 1e3,
                    r.samples
                );
            }
        }
        Command::Policy { what } => match what {
            PolicyCommand::Info { policy } => {
                let loaded = LoadedPolicy::from_file(&*engine()?, &catalog::resolve(&policy)?)?;
                println!("name:    {}\nversion: {}\nhooks:   {}\nsha256:  {}", loaded.info.name, loaded.info.version, loaded.info.hooks, loaded.hash);
            }
            PolicyCommand::Componentize { module, output } => {
                let bytes = std::fs::read(&module).with_context(|| format!("reading {}", module.display()))?;
                let component = componentize::componentize(&bytes).with_context(|| format!("componentizing {}", module.display()))?;
                std::fs::write(&output, component).with_context(|| format!("writing {}", output.display()))?;
            }
            PolicyCommand::List => {
                let dir = catalog::policy_dir();
                println!("{}:", dir.display());
                for name in catalog::available(&dir) {
                    println!("  {name}");
                }
            }
        },
    }
    Ok(())
}
