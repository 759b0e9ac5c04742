//! The `berth` command line: parses arguments and calls the library.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use berth::wasm::{LoadedPolicy, PolicyEngine};
use berth::replay::{self, report};
use berth::{bench, catalog, componentize, demo};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "berth",
    version,
    about = "GPU-fleet scheduler with sandboxed WebAssembly policies",
    after_help = "Exit status: 0 done (also when the reader of the output went away, as in `berth jobs | head`); 1 failed; \
                  2 wrong command line; 3 the server refused the request; 4 the server could not be reached or could not serve now."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Place a seeded, generated workload on a generated fleet with bundled policies.
    Demo {
        /// Generated 8-GPU nodes.
        #[arg(long, default_value_t = 256)]
        nodes: usize,
        /// Seed of the generated fleet and workload.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Policies to compare (names or .wasm paths).
        #[arg(long = "policy", default_values_t = ["binpack".to_string(), "spread".to_string()])]
        policies: Vec<String>,
        /// Print the rows as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Event-driven replay of a fleet config (`--fleet`), then the
    /// accounting at the end: installed / healthy / schedulable / busy /
    /// productive GPUs per model, stranded GPUs by cause, and a shape quote.
    Report(ReplayArgs),
    /// Replay a trace (openb node and pod lists, or a generated one) with
    /// each policy and seed under the FGD paper's protocol.
    Replay(ReplayArgs),
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
    /// The live host: a gRPC API over a simulated fleet advancing in real
    /// time, per-partition versioned policies, shadow A/B, circuit breaker.
    Serve(berth::serve::cli::ServeArgs),
    /// The node agent: discovers GPUs (NVML, or --synthetic-gpus 8xH20),
    /// registers with `berth serve`, sends heartbeats and telemetry, and
    /// runs allocations as child processes on their GPUs.
    Agent(berth::agent::run::AgentArgs),
    /// Run inside a task started by `berth agent`: report that the task just
    /// saved a checkpoint, so preemption ranks it, and counts work lost, from now.
    Checkpointed,
    /// Run inside a task started by `berth agent`: report work done (steps,
    /// tokens, requests: the job's --work-unit), which the host counts in
    /// the outcome (`berth accounting`); work after the last checkpoint is
    /// counted lost if the task is preempted, migrated or fails.
    Progress {
        /// Units done since the last `berth progress` (added to the task's count).
        units: u64,
        /// UNITS is the task's whole count so far in this run (a run's
        /// count starts at 0, also after a restart from a checkpoint), not
        /// an increment.
        #[arg(long)]
        total: bool,
    },
    /// Run inside a task started by `berth agent`: report that the task
    /// serves, so its migrated copy takes over (jobs submitted with --wait-ready).
    Ready,
    /// One model-pool executor with synthetic timings: connects to a Unix
    /// socket and serves the executor protocol (load and evict models,
    /// admit requests, prefill and decode, stream tokens), each step timed
    /// by the pool's cost model and chosen by a pool-step policy or the
    /// default step.
    Executor(berth::executor::ExecutorArgs),
    /// Sends a pool file's workload (synthetic, or an Azure trace spread
    /// over its catalog) to a live pool's /v1/completions as concurrent
    /// streaming clients at the requests' arrival times, and reports SLO
    /// attainment, TTFT and TBT as measured there; with --simulate, the
    /// same requests through the pool simulator, side by side.
    PoolLoad(berth::pool::load::LoadArgs),
    /// Node agents and allocations: list, start, stop, sleep, wake, checkpoint.
    Alloc {
        #[command(subcommand)]
        what: berth::agent::run::AllocCommand,
    },
    /// In-place compaction over a snapshot saved by `berth replay ...
    /// --save-snapshot`: a policy's plan, validated and run make-before-
    /// break, with before/after figures and the migration ledger.
    Compact(berth::compact::cli::CompactArgs),
    /// Trace files: generate openb-like variants nobody fitted on.
    Trace {
        #[command(subcommand)]
        what: TraceCommand,
    },
    #[command(flatten)]
    Api(berth::serve::cli::ApiCommand),
}

#[derive(Subcommand)]
enum TraceCommand {
    /// An openb-like pod list that changes one property of a published one,
    /// as the FGD authors built their families (see docs/src/beyond-fgd.md):
    /// CPU-only pods, shared-GPU demand, pinned GPU models, or multi-GPU
    /// demand. Seeded: the same arguments give the same file.
    Variant {
        /// The pod list to start from (e.g. openb_pod_list_default.csv).
        #[arg(long)]
        pods: PathBuf,
        /// The cluster's node list (pins are drawn only where a node of the
        /// models could hold the pod).
        #[arg(long)]
        nodes: PathBuf,
        /// Which property changes.
        #[arg(long, value_enum)]
        family: berth::replay::variants::Family,
        /// Its level: CPU-only pods per mille of the pods (cpu); percent of
        /// the GPU demand (gpushare, multigpu); percent of the GPU pods
        /// pinned (gpuspec).
        #[arg(long)]
        level: u32,
        /// gpuspec: the models pins are drawn from.
        #[arg(long, value_enum, default_value = "openb")]
        mix: berth::replay::variants::Mix,
        /// Seed of every draw.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Where to write the pod list (default: stdout).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// One seed of an openb trace under the FGD protocol.
#[derive(clap::Args)]
struct OpenbTrace {
    /// openb node list (e.g. ../shared/data/openb/openb_node_list_gpu_node.csv).
    #[arg(long)]
    nodes: PathBuf,
    /// openb pod list.
    #[arg(long)]
    pods: PathBuf,
    /// Seed of the arrival order (and of policies' random tie order).
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Model pools: replay a pool file (TOML, or `default` for the embedded
    /// 47-model market on H20) under pool policies (default: the four
    /// bundled ones) and report GPUs needed for the SLO target, attainment
    /// and goodput on a fixed pool, sustained arrival rate, models per
    /// executor, switches and bytes moved, for each of --seeds (the table
    /// is the first seed's; medians over all of them beside Aegaeon's).
    #[arg(long, conflicts_with_all = ["fleet", "nodes", "pods", "keep_order", "native", "decisions", "typical_from", "save_snapshot"])]
    pool: Option<String>,
    /// Replay a live partition's capture (`berth capture export`): without
    /// --policy, every segment is decided again with the policy versions
    /// the host used (found by content hash) and the decisions compared
    /// (exits 1 at the first difference); with --policy, the same arrivals
    /// and captured durations run under each policy, side by side with
    /// what happened live (--json, --html).
    #[arg(long, conflicts_with_all = ["pool", "fleet", "nodes", "pods", "keep_order", "native", "decisions", "typical_from", "save_snapshot"])]
    events: Option<PathBuf>,
    /// With --events: where the live host's policy versions are (a state
    /// directory's components/ folder, a folder of .wasm, or one .wasm;
    /// repeatable). The bundled policies are always looked in.
    #[arg(long = "components", requires = "events")]
    components: Vec<PathBuf>,
    /// With --events and --policy: the rank policy of the counterfactual
    /// runs (default: the one the capture used last, or the default order).
    #[arg(long, requires = "events")]
    rank: Option<String>,
    /// With --pool: take arrivals and token counts from an Azure LLM
    /// inference trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) instead
    /// of the synthetic generator, spread over the catalog by popularity.
    #[arg(long, requires = "pool")]
    azure: Option<PathBuf>,
    /// Event-driven replay on a fleet config (TOML, or `asi` for the
    /// embedded synthetic ASI fleet of 20,000 nodes): jobs arrive and leave
    /// in simulated time, gangs start all or nothing.
    #[arg(long, conflicts_with_all = ["nodes", "pods", "keep_order", "native", "decisions", "typical_from"])]
    fleet: Option<String>,
    #[command(flatten)]
    trace: berth::replay::convert::FleetTraceArgs,
    /// Quote a shape at the end of a --fleet run, e.g.
    /// `model=H800,gpus=8,cores=128,memory-gib=512,tasks=32,same-domain,deadline-h=2`:
    /// how many could start now, when the next could, and whether one can
    /// start by the deadline.
    #[arg(long, requires = "fleet")]
    quote: Option<String>,
    /// Check quotes with a probability against what happened: ask this
    /// many quotes at random moments of a --fleet run (shapes of random
    /// jobs, deadlines 10 min to 8 h), submit each quoted copy as a short
    /// job, and print the reliability table and the Brier score. Runs the
    /// first --policy (with --compact if given; not with --preempt).
    #[arg(long, requires = "fleet", conflicts_with = "preempt")]
    calibrate: Option<u32>,
    /// Samples per calibration quote (at most 10,000).
    #[arg(long, default_value_t = 200, requires = "calibrate")]
    calibrate_samples: u32,
    /// Starvation guard for --fleet and the counterfactual runs of
    /// --events (in place of the captured one): reserve capacity for a job
    /// that has waited this many hours and still cannot start (backfill
    /// only work that ends before the reservation).
    #[arg(long)]
    reserve_after_h: Option<f64>,
    /// Interference for --fleet: a training job sharing a node with
    /// CPU-only work loses this share of its GPUs' work while it does, as
    /// MEDIAN,P90 of a per-job draw (ASI: 0.10,0.18). Lost work comes off
    /// the outcome; pair with --workload colocated (CPU-only jobs).
    #[arg(long, requires = "fleet", value_name = "MEDIAN,P90")]
    interference: Option<String>,
    /// Starvation guard for --fleet and --events counterfactuals: priority
    /// points a waiting job gains per hour.
    #[arg(long, default_value_t = 0.0)]
    aging: f64,
    /// Starvation guard for --fleet and --events counterfactuals: an
    /// admission window, "MINUTES,GPU_H": while a job that cannot start
    /// waits, at most GPU_H GPU-hours of smaller work start ahead of it per
    /// window of MINUTES.
    #[arg(long, value_name = "MINUTES,GPU_H")]
    admission_window: Option<String>,
    /// The counterfactual runs of --events under this default priority
    /// contract (over the captured one; jobs that bought their own keep
    /// it): key=value pairs, e.g. "notice=120,grace=60,per-day=1"; keys
    /// notice, grace, per-day, checkpoint-every, checkpoint-on-notice,
    /// max-outage (seconds).
    #[arg(long, requires = "events")]
    contract: Option<String>,
    /// The counterfactual runs of --events with no starvation guard at all
    /// (in place of the captured one).
    #[arg(long, requires = "events", conflicts_with_all = ["reserve_after_h", "admission_window"])]
    no_guard: bool,
    /// Preemption for --fleet: compare high priority alone, low-priority
    /// fill without preemption, and fill with each of these ranking policies
    /// (e.g. spot-gpu, smallest-first, newest-first); the first --policy
    /// places.
    #[arg(long = "preempt", requires = "fleet")]
    preempt: Vec<String>,
    /// Compaction for --fleet (and the counterfactual runs of --events):
    /// run this compaction policy (e.g. ipc) every period over every
    /// partition, configured by --compact-config (TOML of the compaction
    /// settings, e.g. period_s, min_residence_s).
    #[arg(long)]
    compact: Option<String>,
    /// With --compact: the compaction settings (TOML of `CompactionConfig`
    /// fields, e.g. period_s, min_residence_s).
    #[arg(long, requires = "compact")]
    compact_config: Option<PathBuf>,
    /// With --preempt: sleep-state harvesting, "SLEEP_H-WAKE_H[:SHARE]"
    /// (hours of the simulated day; share of idle online-inference replicas,
    /// default 0.5), e.g. 15-21 for the synthetic workload's trough.
    #[arg(long, requires = "preempt")]
    harvest: Option<String>,
    /// With --preempt: the low-priority contract's maximum outage in
    /// seconds (0: none). Preempted work then waits ahead of new work and
    /// runs again at its daily cap; running later is a broken promise,
    /// priced in the "credit GPUh" column.
    #[arg(long, requires = "preempt", default_value_t = 0)]
    max_outage_s: u64,
    /// With --preempt: the tiers low-priority jobs are sold as,
    /// "GUARANTEED,PREEMPTIBLE,OPPORTUNISTIC" percentages summing to 100
    /// (drawn per job), e.g. 10,60,30: guaranteed work is never a victim,
    /// opportunistic work is stopped without notice or cap. Prints each
    /// tier's completion, interruptions and credits per run
    #[arg(long, requires = "preempt", value_name = "G,P,O", default_value = "0,100,0")]
    tiers: String,
    /// Node list CSV (sn,cpu_milli,memory_mib,gpu,model). Omit both --nodes
    /// and --pods to replay a seeded, generated trace.
    #[arg(long, requires = "pods")]
    nodes: Option<PathBuf>,
    /// Pod list CSV (openb format, 11 or 5 columns).
    #[arg(long, requires = "nodes")]
    pods: Option<PathBuf>,
    /// Policies (names of bundled components or .wasm paths); repeatable.
    #[arg(long = "policy", required_unless_present_any = ["pool", "events"])]
    policies: Vec<String>,
    /// Seeds: a range `42-51`, a list `1,2,3`, or one seed.
    #[arg(long, default_value = "42-51")]
    seeds: String,
    /// Write every arrival point 1..130 as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw unallocated % against arrival % as SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write one self-contained HTML report (opens offline). Trace replay:
    /// the curves with min/max bands over the seeds, the table beside the
    /// published figures, and every run. --fleet: each run's allocation
    /// beside its outcome, ranked both ways, and the calibration of quotes
    /// with --calibrate. Not with --pool.
    #[arg(long, conflicts_with_all = ["pool", "save_snapshot"])]
    html: Option<PathBuf>,
    /// Replay the pod list exactly as given: no shuffle, no tuning, ties to
    /// the first node.
    #[arg(long)]
    keep_order: bool,
    /// Run native builds of the bundled policies instead of wasm (to measure
    /// the wasm overhead; not sandboxed).
    #[arg(long)]
    native: bool,
    /// Published results to show beside Berth's (default: the FGD table next
    /// to the pod list, if there is one).
    #[arg(long)]
    published: Option<PathBuf>,
    /// Nodes of the generated trace.
    #[arg(long, default_value_t = 400)]
    synthetic_nodes: usize,
    /// Write every run's decisions (step, pod, node, GPUs) as CSV files in
    /// this folder, for pod-by-pod comparison with another simulator.
    #[arg(long)]
    decisions: Option<PathBuf>,
    /// Compute FGD's typical pods from this pod list rather than the
    /// replayed one (use the original workload when replaying another
    /// simulator's tuned order with --keep-order).
    #[arg(long)]
    typical_from: Option<PathBuf>,
    /// A JSON object whose keys are added to every replayed policy's
    /// configuration, for sweeps of a policy's own settings, e.g.
    /// '{"weights": {"cpu": 1}}' for berth-frag (not with --fleet, --pool
    /// or --save-snapshot)
    #[arg(long, conflicts_with_all = ["fleet", "pool", "save_snapshot"])]
    policy_config: Option<String>,
    /// Save a compaction snapshot (JSON) of the replay at --at, with the
    /// first --policy and seed, and stop there (see `berth compact`).
    #[arg(long, requires = "at")]
    save_snapshot: Option<PathBuf>,
    /// When --save-snapshot takes the snapshot: `95%` (of GPU demand
    /// arrived for a trace; of jobs arrived for --fleet) or, for --fleet, a
    /// simulated time (`36h`, `90m`, `1.5d`, `7200s`).
    #[arg(long, requires = "save_snapshot")]
    at: Option<String>,
    /// Worker threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Deadline of one policy call, ms of the calling thread's CPU time
    /// (replay is offline: time spent waiting for a core on a busy machine
    /// does not count). Generous by default; the live host's is 500 ms of
    /// elapsed time.
    #[arg(long, default_value_t = 5000)]
    deadline_ms: u64,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Place jobs of the synthetic ASI workload on a fleet config (default:
    /// the 20,000-node ASI fleet) with no departures; time each job.
    Place {
        /// Placement policy (bundled name or .wasm path).
        #[arg(long)]
        policy: String,
        /// Fleet config: `asi` (the embedded 20,000-node fleet) or a TOML file.
        #[arg(long, default_value = "asi")]
        fleet: String,
        /// Scale every node count of the fleet config (e.g. 0.05).
        #[arg(long, default_value_t = 1.0)]
        fleet_scale: f64,
        /// Jobs to place.
        #[arg(long, default_value_t = 3000)]
        jobs: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Compare policy languages: component size, load from the cached
    /// artifact, one scoring call and one openb replay (default trace, or a
    /// generated one without $BERTH_OPENB_DIR / ../shared/data/openb), each
    /// as a ratio to the first policy.
    Languages {
        /// Policies to compare (repeatable); ratios are to the first.
        /// Default: the bundled ones of the hook (place: best-fit in Rust,
        /// Python, JS and C; rank: spot-gpu, spot-gpu-py; compact: drain,
        /// drain-js; pool: pool-demand, pool-demand-c).
        #[arg(long = "policy")]
        policies: Vec<String>,
        /// The hook to measure: place (component size, load, one scoring
        /// call, an openb replay), or rank, compact or pool (latency p50
        /// and p99 of every call on generated inputs, and the instance's
        /// memory after them).
        #[arg(long, default_value = "place")]
        hook: String,
        /// Candidate nodes in the scoring call.
        #[arg(long, default_value_t = 1000)]
        candidates: usize,
        /// Seed of the generated candidates and of the replay.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Time every scoring call of each policy while it replays one seed of
    /// an openb pod list under the FGD protocol (wasm, one thread): p50,
    /// p99 and max of one call over the nodes that fit each pod.
    ScoreReplay {
        /// Policy name or component path (repeatable).
        #[arg(long = "policy", required = true)]
        policies: Vec<String>,
        #[command(flatten)]
        trace: OpenbTrace,
        /// Print one JSON object per policy instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The simulation test of the live host as a soak: seeded operations
    /// (submit, cancel, exits, clock moves, migrations, live compaction,
    /// sleep and wake, policy swaps, agent and host restarts, store outages
    /// and slow stores) on an
    /// in-process `berth serve` with simulated agents, checking the
    /// invariants against the agents' processes after each. Prints the
    /// figures; exits non-zero with the seed and the shortest failing
    /// operation list on a violation.
    Chaos {
        /// Stop starting seeds after this many seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// The first seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Most seeds to run.
        #[arg(long, default_value_t = u64::MAX)]
        seeds: u64,
        /// Operations per seed.
        #[arg(long, default_value_t = 300)]
        operations: usize,
        /// Simulated agent nodes (eight GPUs each).
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// Placement policy (bundled name or .wasm path).
        #[arg(long, default_value = "binpack")]
        policy: String,
        /// Rank policy (bundled name or .wasm path).
        #[arg(long, default_value = "spot-gpu")]
        rank: String,
        /// Placement policies the runs swap to and back from (repeat the
        /// flag; bundled names or .wasm paths).
        #[arg(long = "swap-to", default_value = "spread")]
        alternates: Vec<String>,
        /// Rank policies the runs swap to and back from (repeat the flag).
        #[arg(long = "rank-swap-to", default_value = "newest-first")]
        rank_alternates: Vec<String>,
        /// Compact policy for live compaction steps ("none": no compaction).
        #[arg(long, default_value = "ipc")]
        compact: String,
        /// No harvest schedule (by default sleepable replicas sleep 1 and
        /// wake 3 simulated minutes into each run).
        #[arg(long)]
        no_harvest: bool,
        /// Judge safety only: no liveness check at the end of each run
        /// (that every job shown running has its processes once the faults
        /// are over).
        #[arg(long)]
        no_liveness: bool,
        /// Where the runs keep their hosts' stores.
        #[arg(long, default_value = "target/chaos")]
        state_dir: PathBuf,
        /// Seeds run side by side, each with its own host, store and agents.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
        parallel: u16,
    },
    /// A long-lived host's footprint: an in-process `berth serve` on a manual
    /// clock runs many one-second jobs in rounds; at each tenth it prints
    /// resident memory, jobs kept, the store's size and one `berth jobs`
    /// page's latency.
    Retention {
        /// Jobs to run in all.
        #[arg(long, default_value_t = 100_000)]
        jobs: u64,
        /// Ended jobs kept (the host's --retain-ended-jobs).
        #[arg(long, default_value_t = 50_000)]
        keep: usize,
        /// Jobs submitted per round (1-256: one GPU each on 256 GPUs).
        #[arg(long, default_value_t = 200)]
        round: u32,
        /// Keep no store (memory only) instead of the embedded one.
        #[arg(long)]
        memory_store: bool,
        /// Placement policy (bundled name or .wasm path).
        #[arg(long, default_value = "binpack")]
        policy: String,
        /// The host's state directory for the run (deleted after).
        #[arg(long, default_value = "target/bench-retention")]
        state_dir: PathBuf,
        /// Print the samples as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Decision latency of a live host with preemption: an in-process
    /// `berth serve` on one partition of N eight-GPU nodes, filled with
    /// low-priority whole-node jobs; high-priority jobs then arrive one at a
    /// time and the rank policy picks each one's victim.
    Live {
        /// Eight-GPU nodes in the partition.
        #[arg(long, default_value_t = 2000)]
        nodes: u32,
        /// Placement policy (bundled name or .wasm path).
        #[arg(long, default_value = "binpack")]
        policy: String,
        /// Rank policy (bundled name or .wasm path).
        #[arg(long, default_value = "spot-gpu")]
        rank: String,
        /// High-priority arrivals, each needing a preemption.
        #[arg(long, default_value_t = 100)]
        preemptions: usize,
        /// The capture's bound, MiB (as `berth serve --capture-mib`; 0: off).
        #[arg(long, default_value_t = 256)]
        capture_mib: u64,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// What capture costs the engine: one partition of N eight-GPU nodes
    /// driven as the live host drives it (an arrival, a pass placing it
    /// with the wasm policy, the oldest work ending at 90% full), with
    /// capture off and on (recorded and written as JSON lines), the fastest
    /// of three runs each; and the bytes written.
    Capture {
        /// Eight-GPU nodes in the partition.
        #[arg(long, default_value_t = 2000)]
        nodes: u32,
        /// Jobs to place.
        #[arg(long, default_value_t = 20_000)]
        jobs: usize,
        /// Placement policy (bundled name or .wasm path).
        #[arg(long, default_value = "binpack")]
        policy: String,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// One live host for a fleet of agent nodes: `berth serve` in-process
    /// with N eight-GPU agent nodes (over the real agent API, beating with
    /// telemetry) in switch domains, the ASI workload arriving at a
    /// speed-up, preemption, live compaction and an operator polling.
    /// Reports decision and pass times, submit to start, heartbeat cost,
    /// CPU, memory and store size.
    Fleet {
        /// Eight-GPU agent nodes (20000: an ASI-sized fleet).
        #[arg(long, default_value_t = 2000)]
        nodes: u32,
        /// Nodes per access switch.
        #[arg(long, default_value_t = 48)]
        nodes_per_switch: u32,
        /// Each node's heartbeat period, ms (the agent's default).
        #[arg(long, default_value_t = 1000)]
        heartbeat_ms: u64,
        /// Wall-clock seconds of arrivals.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Simulated seconds per wall-clock second (arrivals and durations).
        #[arg(long, default_value_t = 600.0)]
        speedup: f64,
        /// Start this many hours into the workload: the jobs alive then are
        /// submitted at once (the fleet in its steady state).
        #[arg(long, default_value_t = 24.0)]
        warm_hours: f64,
        /// Workload: a preset (asi, backlog, colocated) or a TOML file.
        #[arg(long, default_value = "asi")]
        workload: String,
        /// Placement policy (bundled name or .wasm path).
        #[arg(long, default_value = "binpack")]
        policy: String,
        /// Rank policy (bundled name or .wasm path).
        #[arg(long, default_value = "spot-gpu")]
        rank: String,
        /// Compact policy for live compaction steps, or `none`.
        #[arg(long, default_value = "ipc")]
        compact: String,
        /// Low-priority half-GPU tasks placed after the warm start (in jobs
        /// of eight), running through the run: 150000 at 20000 nodes gives
        /// ASI's task count.
        #[arg(long, default_value_t = 0)]
        fill_tasks: u32,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Live compaction at scale: `berth serve` with N eight-GPU agent nodes
    /// (in-process agents over the real agent API) half filled with movable
    /// one-GPU tasks and whole-node jobs waiting; times dry-run steps, then
    /// runs one step make-before-break and reads its ledger.
    CompactLive {
        /// Eight-GPU agent nodes in the partition.
        #[arg(long, default_value_t = 500)]
        nodes: u32,
        /// Compact policy (bundled name or .wasm path).
        #[arg(long, default_value = "ipc")]
        compact: String,
        /// Dry-run steps to time.
        #[arg(long, default_value_t = 10)]
        plan_runs: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Time one placement-scoring call in wasm and natively.
    Score {
        /// Policy to time (bundled name or .wasm path).
        #[arg(long)]
        policy: String,
        /// Candidate nodes in the scoring call.
        #[arg(long, default_value_t = 10_000)]
        candidates: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Load a component and print what it says about itself.
    Info {
        /// A bundled component name or a .wasm path.
        policy: String,
    },
    /// Wrap a core wasm module built with berth-sdk into a component.
    Componentize {
        /// The core wasm module (wasm32-unknown-unknown, built with berth-sdk).
        module: PathBuf,
        /// Where to write the component.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// List bundled components.
    List,
    /// Print the `configure` text FGD-style policies (fgd, berth-frag) get
    /// in replay: the typical pods of a pod list (openb CSV), for `berth
    /// policy upload --config` on a live partition.
    TypicalPods(OpenbTrace),
    #[command(flatten)]
    Registry(berth::serve::cli::PolicyApiCommand),
    /// Run the conformance suite on a component: every claimed hook against
    /// fixed scenarios, pass or fail per contract rule; exits non-zero on a
    /// failure.
    Test {
        /// The component: a .wasm path or a bundled name.
        component: PathBuf,
        /// Per-call deadline (default: the host's).
        #[arg(long)]
        deadline_ms: Option<u64>,
        /// Memory cap per instance (default: the host's).
        #[arg(long)]
        memory_mib: Option<u64>,
        /// Configuration passed to `configure` first (default: empty).
        #[arg(long, default_value = "")]
        config: String,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Scaffold a policy project in a new folder `<name>` that builds to a
    /// component (see its README).
    New {
        /// rust, python, js or c.
        #[arg(long)]
        lang: String,
        /// The hook the policy starts with, as a working example: place
        /// (best fit), rank (least work lost, SpotGPU), compact (free whole
        /// nodes, one move per allocation) or pool (demand-balanced model
        /// pool: pool-place and pool-step).
        #[arg(long, default_value = "place")]
        hook: String,
        /// Policy name (lowercase with dashes); also the folder created.
        name: String,
        /// Create the folder here instead of the current directory.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match berth::client::exit_code(&e) {
            None => std::process::ExitCode::SUCCESS,
            Some(code) => {
                eprintln!("Error: {e:?}");
                std::process::ExitCode::from(code)
            }
        },
    }
}

/// Output written to a reader that went away (`berth jobs | head -1`) ends
/// the command quietly, with status 0: Rust ignores SIGPIPE, so `println!`
/// would panic with a backtrace instead.
fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("");
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info)
    }));
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // The docs test checks every command line the book shows against the
    // flags as they are, without running it.
    if std::env::var_os("BERTH_CHECK_ARGS").is_some_and(|v| v == "1") {
        return Ok(());
    }
    // (Not for the long-running host and agent: a closed stdout must not
    // end them silently.)
    if !matches!(cli.command, Command::Serve(_) | Command::Agent(_) | Command::Executor(_)) {
        quiet_on_closed_pipe();
    }
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
        Command::Replay(args) => replay(engine()?, args)?,
        Command::Compact(args) => berth::compact::cli::run(|| Ok(engine()?), args)?,
        Command::Trace { what: TraceCommand::Variant { pods, nodes, family, level, mix, seed, out } } => {
            use berth::replay::{openb, variants};
            let base = openb::read_pods(&pods)?;
            let cluster = openb::read_nodes(&nodes)?;
            let made = variants::generate(&base, &cluster, family, level, mix, seed).map_err(|e| anyhow::anyhow!("{family:?} {level}: {e}"))?;
            match &out {
                Some(path) => {
                    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
                    variants::write_csv(&made, std::io::BufWriter::new(file)).with_context(|| format!("writing {}", path.display()))?;
                }
                None => variants::write_csv(&made, std::io::stdout().lock())?,
            }
            let (a, b) = (variants::shares(&base), variants::shares(&made));
            eprintln!(
                "{} pods (base {}): CPU-only pods {:.1}% (base {:.1}%), shared-GPU demand {:.1}% ({:.1}%), pinned GPU pods {:.1}% ({:.1}%), multi-GPU demand {:.1}% ({:.1}%)",
                b.pods, a.pods, 100.0 * b.cpu_only_pods, 100.0 * a.cpu_only_pods, 100.0 * b.shared_gpu_demand, 100.0 * a.shared_gpu_demand,
                100.0 * b.pinned_gpu_pods, 100.0 * a.pinned_gpu_pods, 100.0 * b.multi_gpu_demand, 100.0 * a.multi_gpu_demand
            );
        }
        Command::Report(args) => {
            let fleet = args.fleet.clone().ok_or_else(|| anyhow::anyhow!("berth report needs --fleet (asi or a fleet TOML)"))?;
            prepare_outputs([&args.json, &args.svg, &args.html].into_iter().flatten().map(PathBuf::as_path))?;
            event_replay(engine()?, &fleet, &args, true)?
        }
        Command::Bench { what: BenchCommand::Place { policy, fleet, fleet_scale, jobs, json } } => {
            let r = bench::place(engine()?, &policy, &fleet, fleet_scale, jobs)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{} on {} nodes, {} jobs ({} tasks placed): per job p50 {:.0} us, p99 {:.0} us, max {:.0} us; single-task p99 {:.0} us; {:.0} placements/s on one core",
                    r.policy, r.nodes, r.jobs, r.tasks_placed, r.job_p50_us, r.job_p99_us, r.job_max_us, r.single_p99_us, r.placements_per_s
                );
            }
        }
        Command::Bench { what: BenchCommand::Chaos { seconds, seed, seeds, operations, nodes, policy, rank, alternates, rank_alternates, compact, no_harvest, no_liveness, state_dir, parallel } } => {
            let config = berth::chaos::ChaosConfig {
                nodes,
                operations,
                state_dir,
                placement: std::fs::read(catalog::resolve(&policy)?)?,
                rank: Some(std::fs::read(catalog::resolve(&rank)?)?),
                alternates: alternates.iter().map(|a| Ok((std::fs::read(catalog::resolve(a)?)?, String::new()))).collect::<anyhow::Result<_>>()?,
                notice_s: 5,
                compact: if compact == "none" { None } else { Some(std::fs::read(catalog::resolve(&compact)?)?) },
                rank_alternates: rank_alternates.iter().map(|a| Ok(std::fs::read(catalog::resolve(a)?)?)).collect::<anyhow::Result<_>>()?,
                harvest: !no_harvest,
                liveness: !no_liveness,
            };
            let s = berth::chaos::soak(&config, seed, seeds, std::time::Duration::from_secs(seconds), usize::from(parallel))?;
            let secs = s.elapsed.as_secs_f64();
            println!(
                "chaos: {} seeds from {seed} ({parallel} at a time) in {secs:.1} s ({:.0} operations/s), {}; violations: {}",
                s.seeds,
                s.total.operations as f64 / secs.max(1e-9),
                s.total,
                usize::from(s.failure.is_some())
            );
            if let Some(report) = s.failure_report() {
                eprint!("{report}");
                std::process::exit(1);
            }
        }
        Command::Bench { what: BenchCommand::Retention { jobs, keep, round, memory_store, policy, state_dir, json } } => {
            let b = berth::bench_retention::RetentionBench { jobs, keep, round, embedded_store: !memory_store, state_dir, policy };
            berth::bench_retention::run(&b, |s| {
                if json {
                    println!("{}", serde_json::to_string(s).expect("samples serialize"));
                } else {
                    println!(
                        "{:>9} jobs in {:>7.1} s: RSS {:>7.1} MiB, {:>6} jobs kept, store {:>7.1} MiB, one 50-job page {:.2} ms",
                        s.jobs, s.elapsed_s, s.rss_mib, s.kept_jobs, s.store_mib, s.list_page_ms
                    );
                }
            })?;
        }
        Command::Bench { what: BenchCommand::Fleet { nodes, nodes_per_switch, heartbeat_ms, seconds, speedup, warm_hours, workload, policy, rank, compact, fill_tasks, json } } => {
            let compact = (compact != "none").then_some(compact);
            let args = berth::bench_fleet::FleetArgs { nodes, nodes_per_switch, heartbeat_ms, seconds, speedup, warm_hours, workload, policy, rank, compact, fill_tasks };
            let r = berth::bench_fleet::fleet(&args)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                print!("{}", r.table());
            }
        }
        Command::Bench { what: BenchCommand::Capture { nodes, jobs, policy, json } } => {
            let r = berth::bench_live::capture_cost(&policy, nodes, jobs)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "capture, {} nodes, {} jobs with {policy}: {:.0} decisions/s off, {:.0} on ({:+.1}%); the start (the whole fleet) {:.0} KiB, then {:.0} KiB per 1,000 jobs",
                    r.nodes,
                    r.jobs,
                    r.decisions_per_s_off,
                    r.decisions_per_s_on,
                    -r.cost_pct,
                    r.start_bytes as f64 / 1024.0,
                    r.bytes_per_1000_jobs / 1024.0
                );
            }
        }
        Command::Bench { what: BenchCommand::Live { nodes, policy, rank, preemptions, capture_mib, json } } => {
            let runs = [berth::bench_live::live(&policy, &rank, nodes, preemptions, capture_mib.min(1 << 30) << 20)?];
            if json {
                println!("{}", serde_json::to_string(&runs[0])?);
                return Ok(());
            }
            for r in &runs {
                let jobs = u64::from(r.fill_jobs) + r.preemptions as u64;
                println!(
                    "live host, {} nodes ({} GPUs), {} / {}: filled with {} jobs in {:.1} s; {} preemptions: deciding pass p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; submit to eviction p50 {} ms, p99 {} ms{}",
                    r.nodes,
                    r.nodes * 8,
                    r.policy,
                    r.rank,
                    r.fill_jobs,
                    r.fill_s,
                    r.preemptions,
                    r.pass_p50_us as f64 / 1e3,
                    r.pass_p99_us as f64 / 1e3,
                    r.pass_max_us as f64 / 1e3,
                    r.submit_to_decision_p50_ms,
                    r.submit_to_decision_p99_ms,
                    if r.capture_bytes_bound == 0 {
                        String::new()
                    } else {
                        format!(
                            "; captured {:.1} MiB: the start (the whole fleet) {:.0} KiB, then {:.0} KiB per 1,000 jobs",
                            r.capture_bytes as f64 / 1048576.0,
                            r.capture_start_bytes as f64 / 1024.0,
                            (r.capture_bytes - r.capture_start_bytes) as f64 / 1024.0 / jobs as f64 * 1000.0
                        )
                    }
                );
            }
        }
        Command::Bench { what: BenchCommand::CompactLive { nodes, compact, plan_runs, json } } => {
            let r = berth::bench_live::compact_live(&compact, nodes, plan_runs)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "live compaction, {} agent nodes, {} running one-GPU tasks ({} partly used nodes), {}: plan (dry-run step through the API) p50 {:.1} ms, max {:.1} ms over {} runs; one step ran {} chains ({} moves) make-before-break in {:.2} s: {} chains done, {} rolled back, {} moves done, idle nodes {} -> {}, {:.1} GiB of state moved; {} of {} waiting whole-node jobs started",
                    r.nodes,
                    r.tasks,
                    r.partial_nodes,
                    r.compact,
                    r.plan_p50_ms,
                    r.plan_max_ms,
                    r.plan_runs,
                    r.chains_run,
                    r.moves,
                    r.run_s,
                    r.chains_done,
                    r.chains_rolled_back,
                    r.moves_done,
                    r.idle_nodes_before,
                    r.idle_nodes_after,
                    r.bytes_moved as f64 / f64::from(1u32 << 30),
                    r.whole_node_jobs_started,
                    r.whole_node_jobs
                );
            }
        }
        Command::Bench { what: BenchCommand::Languages { policies, hook, candidates: _, seed, json } } if hook != "place" => {
            let policies = if policies.is_empty() { berth::langbench::default_policies(&hook) } else { policies };
            let r = berth::langbench::hooks(engine()?, &hook, &policies, seed)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}: {}; seed {}", r.hook, r.input, r.seed);
                print!("{}", berth::langbench::hook_table(&r));
            }
        }
        Command::Bench { what: BenchCommand::Languages { policies, hook, candidates, seed, json } } => {
            let policies = if policies.is_empty() { berth::langbench::default_policies(&hook) } else { policies };
            anyhow::ensure!(candidates > 0, "--candidates must be at least 1");
            let r = berth::langbench::run(engine()?, &policies, candidates, seed, berth::langbench::openb_dir().as_deref())?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{} candidates per scoring call; replay of {}, seed {}, one worker", r.candidates, r.trace, r.seed);
                print!("{}", berth::langbench::table(&r));
            }
        }
        Command::Bench { what: BenchCommand::ScoreReplay { policies, trace: OpenbTrace { nodes, pods, seed }, json } } => {
            let engine = engine()?;
            for policy in &policies {
                let r = bench::score_replay(engine.clone(), policy, &nodes, &pods, seed)?;
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!(
                        "{}: {} score calls on {} nodes ({:.0} candidates per call on average): p50 {:.0} us, p99 {:.0} us, max {:.0} us",
                        r.policy, r.calls, r.nodes, r.mean_candidates, r.p50_us, r.p99_us, r.max_us
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
        Command::Serve(args) => berth::serve::cli::serve(args)?,
        Command::Agent(args) => berth::agent::run::main(args)?,
        Command::Executor(args) => berth::executor::main(args)?,
        Command::PoolLoad(args) => berth::pool::load::main(args)?,
        Command::Checkpointed => berth::agent::run::report_checkpoint()?,
        Command::Progress { units, total } => berth::agent::run::report_progress(units, total)?,
        Command::Ready => berth::agent::run::report_ready()?,
        Command::Alloc { what } => berth::agent::run::alloc(what)?,
        Command::Api(cmd) => berth::serve::cli::run(cmd)?,
        Command::Policy { what } => match what {
            PolicyCommand::Registry(cmd) => berth::serve::cli::run_policy(cmd)?,
            PolicyCommand::Info { policy } => {
                let loaded = LoadedPolicy::from_file(&*engine()?, &catalog::resolve(&policy)?)?;
                println!(
                    "name:     {}\nversion:  {}\nhooks:    {}\ncontract: berth:policy@{}\nsha256:   {}",
                    loaded.info.name, loaded.info.version, loaded.info.hooks, loaded.contract, loaded.hash
                );
            }
            PolicyCommand::Componentize { module, output } => {
                let bytes = std::fs::read(&module).with_context(|| format!("reading {}", module.display()))?;
                let component = componentize::componentize(&bytes).with_context(|| format!("componentizing {}", module.display()))?;
                std::fs::write(&output, component).with_context(|| format!("writing {}", output.display()))?;
            }
            PolicyCommand::Test { component, deadline_ms, memory_mib, config, json } => {
                let mut opts = berth::conformance::Options { config, ..Default::default() };
                if let Some(ms) = deadline_ms {
                    opts.limits.deadline = std::time::Duration::from_millis(ms);
                }
                if let Some(mib) = memory_mib {
                    opts.limits.memory_bytes = mib << 20;
                }
                let report = berth::conformance::run_file(engine()?, &catalog::resolve(&component.to_string_lossy())?, &opts)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    println!("{report}");
                }
                if !report.passed() {
                    std::process::exit(1);
                }
            }
            PolicyCommand::New { lang, hook, name, dir } => {
                let root = dir.unwrap_or_else(|| PathBuf::from("."));
                let created = berth::scaffold::create(&lang, &hook, &name, &root)?;
                println!("created {}; see its README.md: build, then test", created.display());
            }
            PolicyCommand::TypicalPods(trace) => {
                println!("{}", berth::replay::openb_trace_config(&trace.nodes, &trace.pods, trace.seed)?.1);
            }
            PolicyCommand::List => {
                let found = catalog::find_policy_dir();
                println!("{} ({}):", found.dir.display(), found.source);
                for name in catalog::available(&found.dir) {
                    println!("  {name}");
                }
            }
        },
    }
    Ok(())
}

/// Creates the folders of a command's output files before any work is done
/// (a long replay must not fail at its end for want of one), naming the
/// path that cannot be made.
fn prepare_outputs<'a>(paths: impl IntoIterator<Item = &'a std::path::Path>) -> anyhow::Result<()> {
    for path in paths {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {} for {}", dir.display(), path.display()))?;
        }
    }
    Ok(())
}

fn replay(engine: Arc<PolicyEngine>, args: ReplayArgs) -> anyhow::Result<()> {
    prepare_outputs([&args.json, &args.svg, &args.html, &args.save_snapshot].into_iter().flatten().map(PathBuf::as_path))?;
    if let Some(dir) = &args.decisions {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    anyhow::ensure!(
        args.fleet.is_some() || args.events.is_some() || (args.reserve_after_h.is_none() && args.aging == 0.0 && args.admission_window.is_none()),
        "--reserve-after-h, --aging and --admission-window run with --fleet or --events"
    );
    if let Some(spec) = &args.pool {
        return pool_replay(engine, spec, &args);
    }
    if let Some(path) = &args.events {
        return events_replay(engine, path, &args);
    }
    anyhow::ensure!(args.compact.is_none() || args.fleet.is_some(), "--compact runs with --fleet or --events");
    if let Some(fleet) = &args.fleet {
        return event_replay(engine, fleet, &args, false);
    }
    if let (Some(out), Some(at)) = (&args.save_snapshot, &args.at) {
        let seeds = replay::parse_seeds(&args.seeds).context("--seeds")?;
        return berth::compact::cli::save_openb(&engine, args.nodes.as_deref(), args.pods.as_deref(), &args.policies, &seeds, at, out);
    }
    let opts = replay::ReplayOptions {
        trace: args.nodes.clone().zip(args.pods.clone()),
        synthetic_nodes: args.synthetic_nodes,
        policies: args.policies.clone(),
        seeds: replay::parse_seeds(&args.seeds).context("--seeds")?,
        keep_order: args.keep_order,
        native: args.native,
        workers: args.workers,
        progress: !args.quiet,
        decisions_dir: args.decisions.clone(),
        typical_from: args.typical_from.clone(),
        limits: replay_limits(&args),
        extra_config: match &args.policy_config {
            Some(text) => replay::parse_extra_config(text).context("--policy-config")?,
            None => Default::default(),
        },
    };
    anyhow::ensure!(opts.synthetic_nodes > 0, "--synthetic-nodes must be at least 1");
    let started = std::time::Instant::now();
    let outcome = replay::run(engine, &opts)?;
    let elapsed = started.elapsed();

    let workload = args.pods.as_ref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned());
    let published_path = args
        .published
        .clone()
        .or_else(|| args.pods.as_ref().and_then(|p| p.parent()).map(|d| d.join("fgd_published_unallocated.csv")).filter(|p| p.is_file()));
    let published = match (&published_path, &workload) {
        (Some(path), Some(w)) => report::read_published(path, w)?,
        _ => Default::default(),
    };
    let source = workload.clone().unwrap_or_else(|| format!("generated trace ({} nodes)", opts.synthetic_nodes));
    let settings = if opts.extra_config.is_empty() { String::new() } else { format!("; policy config {}", serde_json::Value::Object(opts.extra_config.clone())) };
    println!(
        "{source}: {} policies x {} seeds in {:.1} s ({}{settings})",
        outcome.policies.len(),
        opts.seeds.len(),
        elapsed.as_secs_f64(),
        if opts.native { "native" } else { "wasm" }
    );
    print!("{}", report::table(&outcome.rows, &outcome.policies, &published));
    if let Some(path) = &args.json {
        report::write_json(path, &outcome.rows, &opts.extra_config)?;
    }
    if let Some(path) = &args.svg {
        report::write_svg(path, &format!("Unallocated GPUs: {source}"), &outcome.rows, &outcome.policies)?;
    }
    if let Some(path) = &args.html {
        let meta = report::HtmlMeta {
            source: &source,
            seeds: &opts.seeds,
            mode: if opts.native { "native" } else { "wasm" },
            keep_order: opts.keep_order,
            elapsed_s: elapsed.as_secs_f64(),
            published_from: published_path.as_deref().filter(|_| !published.is_empty()),
        };
        report::write_html(path, &meta, &outcome, &published)?;
    }
    Ok(())
}

/// `--compact` and `--compact-config`: the compaction policy and its
/// settings, checked (event replay and the counterfactuals of --events).
fn load_compaction(engine: &Arc<PolicyEngine>, args: &ReplayArgs) -> anyhow::Result<Option<(Arc<LoadedPolicy>, berth_core::compaction::CompactionConfig)>> {
    let Some(spec) = &args.compact else { return Ok(None) };
    let path = catalog::resolve(spec)?;
    let planner = LoadedPolicy::from_file(engine, &path).with_context(|| format!("loading {}", path.display()))?;
    let config: berth_core::compaction::CompactionConfig = match &args.compact_config {
        Some(p) => berth::text::parse_toml(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
            .with_context(|| format!("compaction config {}", p.display()))?,
        None => Default::default(),
    };
    config.check().map_err(anyhow::Error::msg).context("compaction config")?;
    Ok(Some((planner, config)))
}

/// The starvation guard the replay flags set (`--reserve-after-h`,
/// `--aging`, `--admission-window`, `--no-guard`), or `None` where none of
/// them is given.
fn guard_flags(args: &ReplayArgs) -> anyhow::Result<Option<Option<berth_core::engine::StarvationGuard>>> {
    if args.no_guard {
        return Ok(Some(None));
    }
    if args.reserve_after_h.is_none() && args.aging == 0.0 && args.admission_window.is_none() {
        return Ok(None);
    }
    let (window_min, window_gpu_h) = match args.admission_window.as_deref() {
        Some(text) => {
            let (m, h) = text.split_once(',').ok_or_else(|| anyhow::anyhow!("--admission-window {text}: MINUTES,GPU_H"))?;
            (Some(m.trim().parse::<f64>().context("--admission-window minutes")?), h.trim().parse::<f64>().context("--admission-window GPU-hours")?)
        }
        None => (None, 0.0),
    };
    let flags = berth::asi::fleet::GuardConfig { reserve_after_h: args.reserve_after_h, aging_per_hour: args.aging, window_min, window_gpu_h };
    Ok(Some(flags.to_guard().context("--reserve-after-h / --aging / --admission-window")?))
}

/// `berth replay --events`: a live capture decided again, or run under
/// other policies.
fn events_replay(engine: Arc<PolicyEngine>, path: &std::path::Path, args: &ReplayArgs) -> anyhow::Result<()> {
    use berth::replay::events;
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let capture = berth::capture::read(std::io::BufReader::new(file), &path.display().to_string())?;
    anyhow::ensure!(!capture.segments.is_empty(), "{}: no capture in it (`berth capture export` writes one)", path.display());
    anyhow::ensure!(
        !(args.policies.is_empty() && (guard_flags(args)?.is_some() || args.contract.is_some())),
        "the guard and contract flags set the counterfactual runs' (exact replay uses the captured ones): give --policy"
    );
    if let Some(text) = &args.contract {
        // Refused before the exact replay's minutes, not after.
        events::parse_contract(text, Default::default())?;
    }
    let components = events::Components::scan(&args.components)?;
    let limits = replay_limits(args);
    let inputs: usize = capture.segments.iter().map(|s| s.inputs.len()).sum();
    let setting = format!("partition {}: {} segment(s), {inputs} inputs, from {}", berth::text::printable(&capture.partition, 64), capture.segments.len(), path.display());
    println!("{setting}");
    // Exact re-decision always: it measures the live run the others are beside.
    for s in capture.segments.iter().filter(|s| s.skipped > 0) {
        println!("segment {}: {} line(s) not read (not inputs of {} version {})", s.id, s.skipped, berth_core::capture::FORMAT, berth_core::capture::VERSION);
    }
    let exact = events::exact(&engine, &capture, &components, limits, args.policies.is_empty())?;
    for x in &exact {
        // By name: the map is by digest, which differs between builds.
        let mut names: Vec<&str> = x.policies.values().map(String::as_str).collect();
        names.sort_unstable();
        match (&x.skipped, &x.fidelity.first_difference) {
            (Some(why), _) => println!("segment {}: not replayed: {why}", x.segment),
            (None, None) => println!(
                "segment {}: {} inputs, {} passes, decisions identical {} / {} (100%); policies {}",
                x.segment,
                x.inputs,
                x.fidelity.passes,
                x.fidelity.identical,
                x.fidelity.decisions,
                names.join(", ")
            ),
            (None, Some(d)) => println!(
                "segment {}: FIRST DIFFERENCE at input {} (t={}): captured {}, replayed {}; identical {} / {} before it",
                x.segment,
                d.input,
                d.now.map_or("-".into(), |t| t.to_string()),
                d.captured.as_deref().unwrap_or("nothing"),
                d.replayed.as_deref().unwrap_or("nothing"),
                x.fidelity.identical,
                x.fidelity.decisions
            ),
        }
    }
    let mut rows: Vec<events::RunRow> = exact.iter().filter(|x| x.skipped.is_none()).map(|x| x.tally.clone()).collect();
    let live_work = events::workload(&capture).ok();
    if let ([live], Some(work)) = (rows.as_mut_slice(), &live_work)
        && capture.segments.len() == 1
    {
        // What the live run's jobs ran, less what evictions lost.
        live.done_gpu_h = Some((work.live_ran_gpu_h - live.lost_gpu_h).max(0.0));
    }
    if rows.len() > 1 {
        for (r, x) in rows.iter_mut().zip(exact.iter().filter(|x| x.skipped.is_none())) {
            r.run = format!("as captured, segment {}", x.segment);
        }
    }
    if !args.policies.is_empty() {
        let mut work = match live_work {
            Some(w) => w,
            None => events::workload(&capture)?,
        };
        // The guard flags replace the captured guard, everywhere.
        if let Some(guard) = guard_flags(args)? {
            println!("counterfactual starvation guard: {}", events::guard_text(guard.as_ref()));
            work.config.guards = berth_core::engine::Guards::everywhere(guard);
        }
        if let Some(text) = &args.contract {
            work.config.contract = events::parse_contract(text, work.config.contract)?;
            println!("counterfactual contract: {}", events::contract_text(&work.config.contract));
        }
        println!(
            "counterfactual: {} jobs on {} nodes over {} ({} cancelled before they started left out, {} unfinished at the end)",
            work.jobs.len(),
            work.fleet.nodes().len(),
            if work.horizon_s < 3600 { format!("{} s", work.horizon_s) } else { format!("{:.1} h", work.horizon_s as f64 / 3600.0) },
            work.cancelled_waiting,
            work.unfinished
        );
        // Compaction in the counterfactual runs (`--compact`, `--compact-config`).
        let compaction = load_compaction(&engine, args)?;
        let last_rank = capture.segments.iter().flat_map(|s| &s.inputs).filter_map(|l| match &l.input {
            berth_core::capture::Input::Arms { rank, .. } => Some(rank.clone()),
            _ => None,
        }).last().flatten();
        for spec in &args.policies {
            let p = catalog::resolve(spec)?;
            let loaded = LoadedPolicy::from_file(&engine, &p).with_context(|| format!("loading {}", p.display()))?;
            let mut placement = berth::wasm::WasmPolicy::new(engine.clone(), loaded.clone(), limits);
            let mut rank: Box<dyn berth_core::preemption::PreemptionPolicy> = match (&args.rank, &last_rank) {
                (Some(spec), _) => {
                    let r = catalog::resolve(spec)?;
                    Box::new(berth::wasm::WasmPolicy::new(engine.clone(), LoadedPolicy::from_file(&engine, &r).with_context(|| format!("loading {}", r.display()))?, limits))
                }
                (None, Some(r)) => {
                    let path = components.path_of(&r.sha256)?;
                    let mut w = berth::wasm::WasmPolicy::new(engine.clone(), LoadedPolicy::from_file(&engine, path)?, limits);
                    if !r.config.is_empty() {
                        w.configure(&r.config)?;
                    }
                    Box::new(w)
                }
                (None, None) => Box::new(events::DefaultRanking),
            };
            let mut planner = compaction.as_ref().map(|(p, c)| (berth::wasm::WasmPolicy::new(engine.clone(), p.clone(), limits), c.clone()));
            let compact = planner.as_mut().map(|(p, c)| (p as &mut dyn berth_core::compaction::CompactionPolicy, c.clone()));
            rows.push(events::counterfactual(&loaded.info.name, &work, &mut placement, &mut *rank, compact)?);
        }
    }
    if !rows.is_empty() {
        print!("{}", events::table(&rows));
    }
    if let Some(out) = &args.json {
        std::fs::write(out, serde_json::to_string_pretty(&serde_json::json!({ "exact": exact, "runs": rows }))?).with_context(|| format!("writing {}", out.display()))?;
    }
    if let Some(out) = &args.html {
        std::fs::write(out, events::html(&setting, &exact, &rows)).with_context(|| format!("writing {}", out.display()))?;
    }
    if args.policies.is_empty() && exact.iter().any(|x| x.skipped.is_none() && !x.fidelity.exact()) {
        anyhow::bail!("the replay decided otherwise than the live host (first difference above)");
    }
    Ok(())
}

/// `berth replay --pool`: the pool policies compared on one workload.
fn pool_replay(engine: Arc<PolicyEngine>, spec: &str, args: &ReplayArgs) -> anyhow::Result<()> {
    use berth::pool;
    let file = pool::PoolFile::load(spec)?;
    let source = match &args.azure {
        Some(path) => pool::Source::Azure(Arc::new(pool::read_azure(path)?), path.clone()),
        None => pool::Source::Synthetic,
    };
    let seeds = replay::parse_seeds(&args.seeds).context("--seeds")?;
    let policies: Vec<String> = if args.policies.is_empty() { pool::DEFAULT_POLICIES.iter().map(|s| s.to_string()).collect() } else { args.policies.clone() };
    let mut all = Vec::new();
    for seed in seeds {
        let opts = pool::Options { policies: policies.clone(), seed, limits: replay_limits(args), progress: !args.quiet };
        all.push(pool::compare(engine.clone(), &file, &source, &opts)?);
    }
    print!("{}", pool::report::report(&all));
    if let Some(path) = &args.json {
        pool::report::write_json(path, &all)?;
    }
    if let (Some(path), Some(first)) = (&args.svg, all.first()) {
        pool::report::write_svg(path, first)?;
    }
    Ok(())
}

/// Parses `model=H800,gpus=8,cores=128,memory-gib=512,tasks=32,same-domain`.
fn parse_quote(spec: &str, fleet: &berth_core::Fleet) -> anyhow::Result<(berth_core::accounting::PendingShape, Option<u64>)> {
    let mut shape = berth_core::TaskShape { gpu_count: 1, gpu_milli: 1000, ..Default::default() };
    let (mut tasks, mut same_domain, mut deadline) = (1u32, false, None);
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        let num = || value.parse::<u32>().with_context(|| format!("--quote {key}={value:?}: not a whole number"));
        match key {
            "model" => {
                let id = fleet.model_id(value).ok_or_else(|| anyhow::anyhow!("--quote model={value:?}: the fleet has {:?}", fleet.models))?;
                shape.models = vec![id];
            }
            "gpus" => shape.gpu_count = num()?,
            "cores" => shape.cpu_milli = num()? * 1000,
            "memory-gib" => shape.memory_mib = u64::from(num()?) * 1024,
            "tasks" => tasks = num()?.max(1),
            "same-domain" => same_domain = true,
            "deadline-h" => {
                let h: f64 = value.parse().with_context(|| format!("--quote deadline-h={value:?}: not a number"))?;
                anyhow::ensure!(h >= 0.0 && h.is_finite(), "--quote deadline-h must be a non-negative number of hours");
                deadline = Some((h * 3600.0) as u64);
            }
            other => anyhow::bail!("--quote: unknown key {other:?} (model, gpus, cores, memory-gib, tasks, same-domain, deadline-h)"),
        }
    }
    if shape.gpu_count == 0 {
        shape.gpu_milli = 0;
    }
    shape.check().map_err(|e| anyhow::anyhow!("--quote: {e}"))?;
    Ok((berth_core::accounting::PendingShape { shape, tasks, same_domain }, deadline))
}

/// `MEDIAN,P90` shares of work lost (e.g. `0.10,0.18`).
fn parse_interference(text: &str) -> anyhow::Result<berth_core::sim::Interference> {
    let (median, p90) = text.split_once(',').ok_or_else(|| anyhow::anyhow!("expected MEDIAN,P90 (e.g. 0.10,0.18), not {text:?}"))?;
    let model = berth_core::sim::Interference { median_loss: median.trim().parse()?, p90_loss: p90.trim().parse()? };
    model.check().map_err(anyhow::Error::msg)?;
    Ok(model)
}

fn event_replay(engine: Arc<PolicyEngine>, fleet_spec: &str, args: &ReplayArgs, accounting: bool) -> anyhow::Result<()> {
    use berth::asi::report as asi_report;
    let seeds = replay::parse_seeds(&args.seeds).context("--seeds")?;
    anyhow::ensure!(seeds.len() == 1, "event-driven replay takes one seed (--seeds N)");
    let trace = berth::replay::convert::fleet_trace(fleet_spec, &args.trace, seeds[0])?;
    let berth::replay::convert::FleetTrace { config, fleet, topology: topo, jobs, days } = trace;
    let horizon = (days * 86_400.0) as u64;
    let setting = format!(
        "{fleet_spec} fleet: {} nodes, {} GPUs; {} jobs over {:.1} simulated days, seed {}",
        fleet.nodes().len(),
        fleet.nodes().iter().map(|n| n.gpus.len()).sum::<usize>(),
        jobs.len(),
        days,
        seeds[0]
    );
    // The fleet config's guards, with the fleet-wide one replaced by the
    // command-line flags when given.
    let mut guards = config.guards().with_context(|| format!("fleet config {fleet_spec}"))?;
    if let Some(flags) = guard_flags(args)? {
        guards.fleet = flags;
    }
    // Mechanisms compose in one run; what cannot is refused, never dropped.
    anyhow::ensure!(
        args.save_snapshot.is_none() || (args.preempt.is_empty() && args.compact.is_none()),
        "--save-snapshot takes the placement-only state: it does not run --preempt or --compact"
    );
    anyhow::ensure!(
        !(accounting && !args.preempt.is_empty()),
        "`berth report` prints one run's accounting; with --preempt use `berth replay --fleet ... --preempt` (each run's quote with --quote)"
    );
    if let (Some(out), Some(at)) = (&args.save_snapshot, &args.at) {
        return berth::compact::cli::save_event(&engine, &fleet, &jobs, &guards, &args.policies, fleet_spec, seeds[0], at, out);
    }
    let request = args.quote.as_deref().map(|q| parse_quote(q, &fleet)).transpose()?;
    // How fast placed work advances, and what GPU-hours cost: the outcome.
    let interference = args.interference.as_deref().map(parse_interference).transpose().context("--interference")?;
    let economics = asi_report::Economics { work: config.work_rates(&fleet), interference, cost_per_gpu_hour: config.costs() };
    let compaction = load_compaction(&engine, args)?;
    if let Some(quotes) = args.calibrate {
        anyhow::ensure!((1..=100_000).contains(&quotes), "--calibrate takes 1 to 100,000 quotes");
        anyhow::ensure!((1..=berth_core::forecast::MAX_SAMPLES).contains(&args.calibrate_samples), "--calibrate-samples takes 1 to 10,000");
        let path = catalog::resolve(&args.policies[0])?;
        let placement = LoadedPolicy::from_file(&engine, &path).with_context(|| format!("loading {}", path.display()))?;
        if !args.quiet {
            eprintln!("simulating {} jobs with {} and {quotes} probe quotes ...", jobs.len(), placement.info.name);
        }
        let run = berth::asi::calibration::Run { engine: &engine, placement: &placement, compaction: compaction.as_ref(), limits: replay_limits(args), guards: &guards, work: economics.work.clone() };
        let c = berth::asi::calibration::run(run, &fleet, &jobs, horizon, quotes, args.calibrate_samples, seeds[0])?;
        print!("{}", berth::asi::calibration::table(&c));
        write_fleet_html(args, &setting, &[], Some(&c))?;
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({ "calibration": c }))?).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    if !args.preempt.is_empty() {
        let load = |spec: &String| -> anyhow::Result<Arc<LoadedPolicy>> {
            let path = catalog::resolve(spec)?;
            LoadedPolicy::from_file(&engine, &path).with_context(|| format!("loading {}", path.display()))
        };
        let placement = load(&args.policies[0])?;
        let rankers = args.preempt.iter().map(load).collect::<anyhow::Result<Vec<_>>>()?;
        if !args.quiet {
            eprintln!("simulating {} jobs, {} runs ...", jobs.len(), rankers.len() + 2);
        }
        let harvest = args.harvest.as_deref().map(berth::asi::preempt::parse_harvest).transpose().context("--harvest")?;
        let base = berth_core::sim::SimConfig {
            horizon_s: horizon,
            guards: guards.clone(),
            harvest,
            protected_partitions: config.non_preemptible_partitions.iter().copied().collect(),
            work: economics.work.clone(),
            contract: berth_core::job::PriorityContract { max_outage_s: args.max_outage_s, ..Default::default() },
            ..Default::default()
        };
        // Compaction and the quote run in every one of the runs.
        let tiers = berth::asi::preempt::TierMix::parse(&args.tiers).context("--tiers")?;
        let alongside = berth::asi::preempt::Alongside { compaction: compaction.as_ref(), quote: request.as_ref(), costs: Some(&economics.cost_per_gpu_hour), tiers };
        let rows = berth::asi::preempt::compare(&engine, &placement, &rankers, &fleet, &jobs, &base, alongside, replay_limits(args))?;
        print!("{}", berth::asi::preempt::table(&rows));
        let html_rows: Vec<_> = rows
            .iter()
            .map(|r| berth::asi::html::RunRow { name: &r.run, allocation_pct: r.allocation_pct, high_priority_allocation_pct: r.high_priority_allocation_pct, outcome: &r.outcome })
            .collect();
        write_fleet_html(args, &setting, &html_rows, None)?;
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({ "preemption": rows }))?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let mut reports = Vec::new();
    for spec in &args.policies {
        let path = catalog::resolve(spec)?;
        let loaded = LoadedPolicy::from_file(&engine, &path).with_context(|| format!("loading {}", path.display()))?;
        if !args.quiet {
            eprintln!("simulating {} jobs with {} ...", jobs.len(), loaded.info.name);
        }
        reports.push(asi_report::run_policy(&engine, &loaded, &fleet, &topo, &jobs, horizon, &guards, request.as_ref(), compaction.as_ref(), replay_limits(args), &economics)?);
    }
    print!("{}", asi_report::table(&reports));
    let html_rows: Vec<_> = reports
        .iter()
        .map(|r| berth::asi::html::RunRow { name: &r.policy, allocation_pct: r.allocation_pct, high_priority_allocation_pct: r.high_priority_allocation_pct, outcome: &r.outcome })
        .collect();
    write_fleet_html(args, &setting, &html_rows, None)?;
    if accounting || request.is_some() {
        for r in &reports {
            print!("\n{}", asi_report::accounting_table(r));
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({ "reports": reports }))?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Writes the --fleet replay's HTML page when --html asks for one.
fn write_fleet_html(args: &ReplayArgs, setting: &str, runs: &[berth::asi::html::RunRow<'_>], calibration: Option<&berth::asi::calibration::Calibrated>) -> anyhow::Result<()> {
    let Some(path) = &args.html else { return Ok(()) };
    let page = berth::asi::html::page(setting, runs, calibration)?;
    std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))
}

/// The policies' limits in replay: the live host's, with `--deadline-ms`.
fn replay_limits(args: &ReplayArgs) -> berth::wasm::Limits {
    berth::wasm::Limits {
        deadline: std::time::Duration::from_millis(args.deadline_ms.max(1)),
        clock: berth::wasm::DeadlineClock::ThreadCpu,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every argument and subcommand of `berth`, with the path to it, that
    /// has no help text.
    fn missing_help(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || id == "help" || id == "version" {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                let name = arg.get_long().map_or_else(|| format!("<{id}>"), |l| format!("--{l}"));
                out.push(format!("{path} {name}"));
            }
        }
        for sub in cmd.get_subcommands() {
            let sub_path = format!("{path} {}", sub.get_name());
            if sub.get_name() == "help" {
                continue;
            }
            if sub.get_about().is_none() && sub.get_long_about().is_none() {
                out.push(format!("{sub_path} (subcommand)"));
            }
            missing_help(sub, &sub_path, out);
        }
    }

    #[test]
    fn every_flag_of_every_subcommand_has_help() {
        let mut cmd = super::Cli::command();
        cmd.build();
        let mut missing = Vec::new();
        missing_help(&cmd, "berth", &mut missing);
        assert!(missing.is_empty(), "arguments without help text:\n  {}", missing.join("\n  "));
        // The walk reaches deep: it saw the flags of `berth serve` and
        // `berth policy shadow` (a subcommand flattened from another enum).
        let serve = cmd.find_subcommand("serve").expect("berth serve");
        assert!(serve.get_arguments().any(|a| a.get_long() == Some("etcd-prefix")));
        let shadow = cmd.find_subcommand("policy").and_then(|p| p.find_subcommand("shadow")).expect("berth policy shadow");
        assert!(shadow.get_arguments().any(|a| a.get_long() == Some("fraction")));
    }

    #[test]
    fn clap_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
