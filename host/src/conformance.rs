//! `berth policy test`: a conformance suite for policy components in any
//! language. Every hook the component claims runs against fixed scenarios
//! (small fleets with several models, shared GPUs, cordoned and CPU-only
//! nodes, gangs with switch domains, running allocations for ranking and
//! compaction), and every answer is checked against the contract. Each
//! rule passes or fails on its own, with the first few failing scenarios
//! named, so an author sees exactly what to fix.
//!
//! Scenario `k` of a hook carries job id `k`: a policy that misbehaves on
//! one input fails on that scenario only.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::{fleet::gpus_of, predicate, Allocation, Fleet, Node, PolicyError, TaskShape};
use berth_sdk::{Allocations, Domains, Hooks, Nodes, Pending, Plan, Scores, Snapshot, Task};
use serde::Serialize;

use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// Most failing scenarios listed per rule.
const SHOWN: usize = 3;

/// One rule's verdict.
#[derive(Clone, Debug, Serialize)]
pub struct RuleResult {
    /// `hook/rule`, e.g. `score/finite`.
    pub rule: String,
    /// What the rule asks of the policy.
    pub what: &'static str,
    /// Calls or answers the rule looked at.
    pub checked: usize,
    /// One line per failing scenario.
    pub failures: Vec<String>,
}

impl RuleResult {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The suite's verdict on one component.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub policy: String,
    pub version: String,
    pub contract: String,
    pub hooks: String,
    pub deadline_ms: u64,
    pub memory_cap_mib: u64,
    /// Slowest call of the run, in ms.
    pub slowest_call_ms: f64,
    pub rules: Vec<RuleResult>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.rules.iter().all(RuleResult::passed)
    }

    /// Names of the failed rules.
    pub fn failed(&self) -> Vec<&str> {
        self.rules.iter().filter(|r| !r.passed()).map(|r| r.rule.as_str()).collect()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} {} (berth:policy@{}, hooks: {}), deadline {} ms, memory cap {} MiB",
            self.policy,
            self.version,
            self.contract,
            if self.hooks.is_empty() { "none" } else { &self.hooks },
            self.deadline_ms,
            self.memory_cap_mib
        )?;
        for r in &self.rules {
            let verdict = if r.passed() { "PASS" } else { "FAIL" };
            writeln!(f, "{verdict}  {:<28} {} ({} checked)", r.rule, r.what, r.checked)?;
            for line in r.failures.iter().take(SHOWN) {
                // Failures quote the policy (its errors): escaped, bounded.
                writeln!(f, "        {}", crate::text::printable(line, 512))?;
            }
            if r.failures.len() > SHOWN {
                writeln!(f, "        ... and {} more", r.failures.len() - SHOWN)?;
            }
        }
        let failed = self.rules.iter().filter(|r| !r.passed()).count();
        writeln!(f, "slowest call: {:.1} ms", self.slowest_call_ms)?;
        write!(f, "{} passed, {} failed", self.rules.len() - failed, failed)
    }
}

/// Options of a run.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Deadline and memory cap every call runs under (the host's defaults
    /// unless an operator would set others).
    pub limits: Limits,
    /// Configuration passed to `configure` before the scenarios.
    pub config: String,
}

/// Collects verdicts in rule order.
#[derive(Default)]
struct Rules {
    order: Vec<String>,
    by_name: BTreeMap<String, RuleResult>,
}

impl Rules {
    fn declare(&mut self, rule: &str, what: &'static str) {
        if !self.by_name.contains_key(rule) {
            self.order.push(rule.to_string());
            self.by_name.insert(rule.to_string(), RuleResult { rule: rule.to_string(), what, checked: 0, failures: Vec::new() });
        }
    }

    fn check(&mut self, rule: &str, ok: bool, failure: impl FnOnce() -> String) {
        let r = self.by_name.get_mut(rule).unwrap_or_else(|| panic!("rule {rule} declared"));
        r.checked += 1;
        if !ok {
            r.failures.push(failure());
        }
    }

    fn into_vec(mut self) -> Vec<RuleResult> {
        self.order.iter().map(|n| self.by_name.remove(n).expect("declared")).collect()
    }
}

/// The rules every hook's calls share: how a call may fail at all.
fn declare_call_rules(rules: &mut Rules, hook: &str) {
    rules.declare(&format!("{hook}/no-trap"), "no trap (panic, unreachable, stack overflow)");
    rules.declare(&format!("{hook}/no-error"), "no error returned on valid input");
    rules.declare(&format!("{hook}/deadline"), "every call within the deadline");
    rules.declare(&format!("{hook}/memory-cap"), "memory stays under the cap");
}

/// Files a call under the four call rules: it fails the one its error
/// belongs to and counts as checked for the others.
fn call_outcome<T>(rules: &mut Rules, hook: &str, label: &str, result: &Result<T, PolicyError>) {
    let failed = match result {
        Ok(_) => None,
        Err(PolicyError::Trap(_)) => Some("no-trap"),
        Err(PolicyError::Timeout { .. }) => Some("deadline"),
        Err(PolicyError::OutOfMemory { .. }) => Some("memory-cap"),
        Err(_) => Some("no-error"),
    };
    for rule in ["no-trap", "no-error", "deadline", "memory-cap"] {
        rules.check(&format!("{hook}/{rule}"), failed != Some(rule), || {
            format!("{label}: {}", result.as_ref().err().map(brief).unwrap_or_default())
        });
    }
}

/// An error on one line: a trap's wasm backtrace is left out, its cause kept.
fn brief(e: &PolicyError) -> String {
    let text = e.to_string();
    match (e, text.rfind("wasm trap: ")) {
        (PolicyError::Trap(_), Some(i)) => match text.find("memory fault") {
            Some(f) => format!("policy trapped: {}", text[f..].lines().next().unwrap_or_default()),
            None => format!("policy trapped: {}", text[i..].lines().next().unwrap_or_default()),
        },
        _ => text.lines().next().unwrap_or_default().to_string(),
    }
}

/// One placement-scoring scenario: a fleet and a task; the batch is the
/// nodes that pass the predicate, as the host would send.
struct ScoreCase {
    name: &'static str,
    fleet: Arc<Fleet>,
    shape: TaskShape,
    gang_size: u32,
    gang_index: u32,
    priority: u32,
}

struct DomainCase {
    name: &'static str,
    fleet: Arc<Fleet>,
    shape: TaskShape,
    gang_size: u32,
}

struct RankCase {
    name: &'static str,
    demand: TaskShape,
    victims: Allocations,
}

struct CompactCase {
    name: &'static str,
    /// The fleet the snapshot was taken of, with its allocations applied.
    fleet: Arc<Fleet>,
    snapshot: Snapshot,
}

fn node(name: &str, model: Option<u32>, gpus: usize, cores: u32, gib: u64, domain: u32) -> Node {
    let mut n = Node::new(name, model, gpus, cores * 1000, gib << 10);
    n.switch_domain = domain;
    n.aggregation = domain / 2;
    n
}

fn shape(gpu_count: u32, gpu_milli: u32, cores: u32, gib: u64, models: &[u32]) -> TaskShape {
    TaskShape { gpu_count, gpu_milli, cpu_milli: cores * 1000, memory_mib: gib << 10, models: models.to_vec() }
}

/// A mixed fleet: three GPU models, 8- and 4-GPU nodes, CPU-only nodes, a
/// cordoned node, four switch domains; shared GPUs, whole-GPU and CPU-only
/// work running. Returns the fleet and what runs on it.
fn mixed_fleet() -> (Fleet, Vec<Allocation>) {
    let models = vec!["H800".to_string(), "A100".to_string(), "L20".to_string()];
    let mut nodes = Vec::new();
    for i in 0..16u32 {
        let (model, gpus, cores, gib) = match i % 4 {
            0 => (Some(0), 8, 128, 1024),
            1 => (Some(1), 8, 96, 768),
            2 => (Some(2), 4, 64, 512),
            _ => (Some(0), 8, 128, 2048),
        };
        nodes.push(node(&format!("gpu-{i:02}"), model, gpus, cores, gib, i / 4));
    }
    nodes.push(node("cpu-00", None, 0, 64, 256, 0));
    nodes.push(node("cpu-01", None, 0, 32, 128, 3));
    let mut fleet = Fleet::new(models, nodes).expect("valid fleet");
    fleet.set_schedulable(7, false).expect("node 7 exists");
    let running: Vec<(u32, u64, TaskShape)> = vec![
        (0, 0b1, shape(1, 500, 4, 32, &[])),
        (0, 0b1, shape(1, 250, 2, 16, &[])),
        (0, 0b110, shape(2, 1000, 16, 128, &[])),
        (1, 0b1111_0000, shape(4, 1000, 32, 256, &[])),
        (2, 0b10, shape(1, 750, 8, 64, &[])),
        (3, 0xff, shape(8, 1000, 96, 1024, &[])),
        (5, 0b1, shape(1, 1000, 8, 64, &[])),
        (5, 0b10, shape(1, 300, 4, 32, &[])),
        (5, 0b100, shape(1, 600, 4, 32, &[])),
        (9, 0b1100, shape(2, 1000, 8, 64, &[])),
        (10, 0b1, shape(1, 100, 1, 8, &[])),
        (12, 0b1111, shape(4, 1000, 64, 512, &[])),
        (14, 0b1, shape(1, 900, 4, 16, &[])),
        (16, 0, shape(0, 0, 16, 64, &[])),
    ];
    let mut allocs = Vec::new();
    for (n, mask, s) in running {
        let a = Fleet::allocation(n, &s, mask);
        fleet.allocate(&a).expect("scenario allocation fits");
        allocs.push(a);
    }
    (fleet, allocs)
}

/// An idle fleet of one model and a large, partly occupied one.
fn other_fleets() -> (Fleet, Fleet) {
    let idle = Fleet::new(vec!["H20".into()], (0..6).map(|i| node(&format!("idle-{i}"), Some(0), 8, 192, 2048, i / 3)).collect())
        .expect("valid fleet");
    (idle, crate::synth::fleet(2_000, 11, true))
}

fn score_cases() -> Vec<ScoreCase> {
    let (mixed, _) = mixed_fleet();
    let (idle, large) = other_fleets();
    let (mixed, idle, large) = (Arc::new(mixed), Arc::new(idle), Arc::new(large));
    let case = |name, fleet: &Arc<Fleet>, shape: TaskShape| ScoreCase {
        name,
        fleet: fleet.clone(),
        shape,
        gang_size: 1,
        gang_index: 0,
        priority: 0,
    };
    vec![
        case("half a GPU, any model", &mixed, shape(1, 500, 4, 32, &[])),
        case("quarter GPU on an A100", &mixed, shape(1, 250, 2, 16, &[1])),
        case("one whole GPU", &mixed, shape(1, 1000, 8, 64, &[])),
        case("two GPUs on an H800", &mixed, shape(2, 1000, 16, 128, &[0])),
        case("four GPUs, H800 or L20", &mixed, shape(4, 1000, 32, 256, &[0, 2])),
        case("eight GPUs", &mixed, shape(8, 1000, 64, 512, &[])),
        case("CPU only", &mixed, shape(0, 0, 8, 32, &[])),
        case("tiny share", &mixed, shape(1, 1, 0, 0, &[])),
        case("large memory", &mixed, shape(1, 1000, 8, 1500, &[])),
        case("idle fleet, one GPU", &idle, shape(1, 1000, 8, 64, &[])),
        case("idle fleet, shared GPU", &idle, shape(1, 600, 4, 32, &[])),
        case("2,000 nodes, half a GPU", &large, shape(1, 500, 4, 16, &[])),
        ScoreCase { gang_size: 4, gang_index: 2, priority: 5, ..case("gang task 3 of 4", &mixed, shape(2, 1000, 16, 128, &[])) },
        case("2,000 nodes, eight GPUs", &large, shape(8, 1000, 16, 64, &[0])),
    ]
}

fn domain_cases() -> Vec<DomainCase> {
    let (mixed, _) = mixed_fleet();
    let (_, large) = other_fleets();
    let (mixed, large) = (Arc::new(mixed), Arc::new(large));
    vec![
        DomainCase { name: "gang of 4 x 2 GPUs", fleet: mixed.clone(), shape: shape(2, 1000, 16, 128, &[]), gang_size: 4 },
        DomainCase { name: "gang of 8 x 8 GPUs on H800", fleet: mixed.clone(), shape: shape(8, 1000, 64, 512, &[0]), gang_size: 8 },
        DomainCase { name: "gang of 3 shared GPUs", fleet: mixed, shape: shape(1, 500, 4, 32, &[]), gang_size: 3 },
        DomainCase { name: "gang of 64 x 8 GPUs, 2,000 nodes", fleet: large, shape: shape(8, 1000, 16, 64, &[]), gang_size: 64 },
    ]
}

/// Running allocations as the contract's columns, with varied priority,
/// gangs, movability and checkpoints.
fn allocation_columns(allocs: &[Allocation]) -> Allocations {
    let mut a = Allocations::default();
    for (i, al) in allocs.iter().enumerate() {
        let i = i as u32;
        a.ids.push(100 + i);
        a.job_ids.push(u64::from(1000 + i / 2));
        a.node.push(al.node);
        a.gpus.push(al.gpus);
        a.gpu_milli.push(al.gpu_milli);
        a.cpu_milli.push(al.cpu_milli);
        a.memory_mib.push(al.memory_mib);
        a.priority.push(i % 3);
        a.movable.push(u8::from(i % 5 != 4));
        a.gang_id.push(if i.is_multiple_of(4) { u64::from(7 + i / 8) } else { 0 });
        a.state_bytes.push(u64::from(i) << 30);
        a.remaining_s.push(u64::from(i * 600));
        a.running_s.push(u64::from(3600 + i * 60));
        a.since_checkpoint_s.push(u64::from(i * 97 % 3600));
        // Every class, the CPU-only one where no GPU is held.
        a.class.push(if al.gpus == 0 { berth_sdk::TaskClass::CpuOnly as u8 } else { (i % 2) as u8 });
        // Preemptible and opportunistic work (guaranteed work is never a
        // victim), some at its last interruption, opportunistic uncapped.
        let opportunistic = i % 3 == 2;
        a.tier.push(if opportunistic { berth_sdk::Tier::Opportunistic } else { berth_sdk::Tier::Preemptible } as u8);
        a.interruptions_left.push(if opportunistic { u32::MAX } else { 1 + i % 3 });
    }
    a
}

fn rank_cases() -> Vec<RankCase> {
    let (_, allocs) = mixed_fleet();
    let all = allocation_columns(&allocs);
    let mut one = allocation_columns(&allocs[..1]);
    one.priority[0] = 1;
    vec![
        RankCase { name: "eight GPUs wanted, 14 victims", demand: shape(8, 1000, 64, 512, &[0]), victims: all.clone() },
        RankCase { name: "half a GPU wanted, 14 victims", demand: shape(1, 500, 4, 32, &[]), victims: all },
        RankCase { name: "one victim", demand: shape(1, 1000, 8, 64, &[]), victims: one },
    ]
}

/// The columns of every node of a fleet (what a snapshot carries).
pub fn nodes_of(fleet: &Fleet, keep: impl Fn(&Node) -> bool) -> Nodes {
    let mut nodes = Nodes { models: fleet.models.clone(), ..Nodes::default() };
    for (id, n) in fleet.nodes().iter().enumerate().filter(|(_, n)| keep(n)) {
        nodes.push(
            id as u32,
            n.model.unwrap_or(u32::MAX),
            n.switch_domain,
            n.cpu_free_milli,
            n.cpu_total_milli,
            n.memory_free_mib,
            n.memory_total_mib,
            &n.gpus,
            n.alloc_kinds(),
        );
        nodes.set_contention(nodes.len() - 1, n.contention());
    }
    nodes
}

fn compact_cases() -> Vec<CompactCase> {
    let (fleet, allocs) = mixed_fleet();
    let pending = Pending { gpu_count: vec![8, 1, 4], gpu_milli: vec![1000, 500, 1000], whole_nodes: vec![2, 0, 0], model: vec![0, u32::MAX, 2] };
    let full = Snapshot { nodes: nodes_of(&fleet, |_| true), allocations: allocation_columns(&allocs), pending: pending.clone() };
    let empty = Snapshot { nodes: nodes_of(&fleet, |_| true), allocations: Allocations::default(), pending: Pending::default() };
    let fleet = Arc::new(fleet);
    vec![
        CompactCase { name: "mixed fleet, three pending shapes", fleet: fleet.clone(), snapshot: full },
        CompactCase { name: "nothing running", fleet, snapshot: empty },
    ]
}

/// One model-pool scenario: the embedded market's models on a few
/// executors, a short synthetic workload run through the pool simulation,
/// which asks `pool-place` and `pool-step` and checks every answer by the
/// same rules as `berth replay --pool`.
struct PoolCase {
    name: &'static str,
    /// Executors per tensor-parallel degree.
    layout: Vec<(u32, u32)>,
    rate: f64,
    duration_s: f64,
    seed: u64,
}

fn pool_cases() -> Vec<PoolCase> {
    vec![
        PoolCase { name: "47 models on 4 + 2 executors, 2 requests a second for 30 s", layout: vec![(1, 4), (4, 2)], rate: 2.0, duration_s: 30.0, seed: 1 },
        PoolCase { name: "one executor per degree: models switch", layout: vec![(1, 1), (4, 1)], rate: 1.0, duration_s: 30.0, seed: 2 },
    ]
}

/// Which hook a pool run called last (an error belongs to it), and the
/// slowest call.
struct PoolWatch<'a> {
    policy: &'a mut WasmPolicy,
    last: &'static str,
    slowest: Duration,
}

impl berth_core::pool::PoolPolicy for PoolWatch<'_> {
    fn describe(&self) -> String {
        self.policy.describe()
    }
    fn pool_place(&mut self, state: &berth_sdk::PoolState) -> Result<Option<berth_sdk::PoolPlacement>, PolicyError> {
        self.last = "pool-place";
        let t = Instant::now();
        let r = self.policy.pool_place(state);
        self.slowest = self.slowest.max(t.elapsed());
        r
    }
    fn pool_step(&mut self, executor: &berth_sdk::PoolExecutor) -> Result<Option<berth_sdk::PoolStep>, PolicyError> {
        self.last = "pool-step";
        let t = Instant::now();
        let r = self.policy.pool_step(executor);
        self.slowest = self.slowest.max(t.elapsed());
        r
    }
}

/// Runs one pool scenario and files its verdicts under the hooks claimed:
/// an error counts against the hook that gave it, a refused answer under
/// that hook's `valid` rule; a run that completes passes every rule.
fn pool_pass(
    policy: &mut WasmPolicy,
    hooks: Hooks,
    k: usize,
    case: &PoolCase,
    rules: Option<&mut Rules>,
    slowest: &mut Duration,
) -> Option<String> {
    use berth_core::pool::{self, PoolPolicy, RunOptions, Synthetic};
    let file = crate::pool::PoolFile::load("default").expect("the embedded market parses");
    let cfg = file.config();
    let requests = Synthetic { rate: case.rate, duration_s: case.duration_s, ..file.workload.synthetic.clone() }.generate(cfg.models.len(), case.seed);
    let mut watch = PoolWatch { policy, last: "", slowest: Duration::ZERO };
    let result = pool::run(&cfg, &requests, &RunOptions { layout: case.layout.clone(), record_steps: false }, &mut watch as &mut dyn PoolPolicy);
    *slowest = (*slowest).max(watch.slowest);
    let label = format!("scenario {k} ({}, {} requests)", case.name, requests.len());
    if let Some(rules) = rules {
        for (hook, flag) in [("pool-place", Hooks::POOL_PLACE), ("pool-step", Hooks::POOL_STEP)] {
            if !hooks.contains(flag) {
                continue;
            }
            let mine = result.as_ref().err().filter(|_| watch.last == hook);
            let refused = matches!(mine, Some(PolicyError::InvalidOutput(_)));
            rules.check(&format!("{hook}/valid"), !refused, || format!("{label}: {}", mine.map(brief).unwrap_or_default()));
            let call = match mine {
                Some(e) if !refused => Err(e.clone()),
                _ => Ok(()),
            };
            call_outcome(rules, hook, &label, &call);
        }
    }
    result.ok().map(|(outcome, _)| serde_json::to_string(&outcome).unwrap_or_default())
}

fn task_of(shape: &TaskShape, job_id: u64, gang_size: u32, gang_index: u32, priority: u32) -> Task {
    Task {
        job_id,
        gpu_count: shape.gpu_count,
        gpu_milli: shape.gpu_milli,
        cpu_milli: shape.cpu_milli,
        memory_mib: shape.memory_mib,
        models: shape.models.clone(),
        priority,
        gang_size,
        gang_index,
        class: berth_sdk::TaskClass::implied(shape.gpu_count),
    }
}

/// Every answer of one pass over the scenarios, for the determinism check.
#[derive(Default, PartialEq, Debug)]
struct Answers {
    score: Vec<Option<(Vec<u64>, Vec<u64>)>>,
    domains: Vec<Option<Vec<u64>>>,
    rank: Vec<Option<Vec<u32>>>,
    compact: Vec<Option<Plan>>,
    /// Each pool scenario's outcome, as JSON.
    pool: Vec<Option<String>>,
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

struct Suite {
    score: Vec<ScoreCase>,
    domains: Vec<DomainCase>,
    rank: Vec<RankCase>,
    compact: Vec<CompactCase>,
    pool: Vec<PoolCase>,
}

/// Runs the suite on a component file.
pub fn run_file(engine: Arc<PolicyEngine>, path: &std::path::Path, opts: &Options) -> anyhow::Result<Report> {
    let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(run(engine, &bytes, opts))
}

/// Runs the suite on a component's bytes. A component that does not load
/// fails the `load` rule and nothing else runs.
pub fn run(engine: Arc<PolicyEngine>, bytes: &[u8], opts: &Options) -> Report {
    let mut rules = Rules::default();
    rules.declare("load", "compiles, links with only the host's imports, `info` names a policy");
    let mut report = Report {
        policy: "?".into(),
        version: "?".into(),
        contract: "?".into(),
        hooks: String::new(),
        deadline_ms: opts.limits.deadline.as_millis() as u64,
        memory_cap_mib: opts.limits.memory_bytes >> 20,
        slowest_call_ms: 0.0,
        rules: Vec::new(),
    };
    match LoadedPolicy::from_bytes(&engine, bytes) {
        Ok(loaded) => run_loaded(engine, &loaded, opts),
        Err(e) => {
            rules.check("load", false, || e.to_string());
            report.rules = rules.into_vec();
            report
        }
    }
}

/// Runs the suite on a component already loaded (it passed `load`).
pub fn run_loaded(engine: Arc<PolicyEngine>, loaded: &Arc<LoadedPolicy>, opts: &Options) -> Report {
    let mut rules = Rules::default();
    rules.declare("load", "compiles, links with only the host's imports, `info` names a policy");
    rules.check("load", true, String::new);
    let mut report = Report {
        policy: String::new(),
        version: String::new(),
        contract: String::new(),
        hooks: String::new(),
        deadline_ms: opts.limits.deadline.as_millis() as u64,
        memory_cap_mib: opts.limits.memory_bytes >> 20,
        slowest_call_ms: 0.0,
        rules: Vec::new(),
    };
    report.policy = loaded.info.name.clone();
    report.version = loaded.info.version.clone();
    report.contract = loaded.contract.to_string();
    report.hooks = loaded.info.hooks.to_string();
    let hooks = loaded.info.hooks;

    rules.declare("configure/accepts", "accepts the empty configuration (or the one given)");
    for hook in ["score", "score-domains", "rank", "compact", "pool-place", "pool-step"] {
        let claimed = match hook {
            "score" => hooks.contains(Hooks::SCORE),
            "score-domains" => hooks.contains(Hooks::DOMAINS),
            "rank" => hooks.contains(Hooks::RANK),
            "pool-place" => hooks.contains(Hooks::POOL_PLACE),
            "pool-step" => hooks.contains(Hooks::POOL_STEP),
            _ => hooks.contains(Hooks::COMPACT),
        };
        if !claimed {
            continue;
        }
        declare_call_rules(&mut rules, hook);
        match hook {
            "score" => {
                rules.declare("score/length", "one score per node, one GPU mask per node or none");
                rules.declare("score/finite", "no NaN or infinite score");
                rules.declare("score/gpu-masks", "masks name the task's GPU count, existing GPUs with enough free");
                rules.declare("score/memory-steady", "memory does not grow call after call (no leak)");
            }
            "score-domains" => {
                rules.declare("score-domains/length", "one score per domain");
                rules.declare("score-domains/finite", "no NaN or infinite score");
            }
            "rank" => {
                rules.declare("rank/in-range", "every index names a victim");
                rules.declare("rank/unique", "no victim ranked twice");
            }
            "pool-place" => rules.declare(
                "pool-place/valid",
                "the pool's rules accept every placement (executors and models exist, tensor-parallel degrees match, weights >= 1, no pair twice, pinned weights fit)",
            ),
            "pool-step" => rules.declare(
                "pool-step/valid",
                "the pool's rules accept every step (the row exists and has work for its phase, iterations within the cap, evicted rows resident, unpinned and idle)",
            ),
            _ => {
                rules.declare("compact/lengths", "the plan's four columns have one entry per move");
                rules.declare("compact/chains", "chains numbered from 0, each chain's moves contiguous");
                rules.declare("compact/moves", "moves name movable allocations and nodes of the snapshot");
                rules.declare("compact/gpu-masks", "destination masks name the allocation's GPU count on existing GPUs");
                rules.declare(
                    "compact/host-accepts",
                    "the live host's validation accepts the plan (each allocation moved once, never onto its own node, destinations with room)",
                );
            }
        }
        rules.declare(&format!("{hook}/deterministic"), "a fresh instance answers the same calls the same");
    }

    let suite = Suite { score: score_cases(), domains: domain_cases(), rank: rank_cases(), compact: compact_cases(), pool: pool_cases() };
    let mut slowest = Duration::ZERO;
    let first = pass(&engine, loaded, opts, &suite, Some(&mut rules), &mut slowest);
    let second = pass(&engine, loaded, opts, &suite, None, &mut slowest);
    report.slowest_call_ms = slowest.as_secs_f64() * 1e3;
    if let (Some(a), Some(b)) = (first, second) {
        let mut compare = |hook: &str, names: Vec<&str>, same: Vec<bool>| {
            let rule = format!("{hook}/deterministic");
            if !rules.by_name.contains_key(&rule) {
                return;
            }
            for (k, (name, same)) in names.into_iter().zip(same).enumerate() {
                rules.check(&rule, same, || format!("scenario {k} ({name}): the second instance answered differently"));
            }
        };
        compare("score", suite.score.iter().map(|c| c.name).collect(), a.score.iter().zip(&b.score).map(|(x, y)| x == y).collect());
        compare(
            "score-domains",
            suite.domains.iter().map(|c| c.name).collect(),
            a.domains.iter().zip(&b.domains).map(|(x, y)| x == y).collect(),
        );
        compare("rank", suite.rank.iter().map(|c| c.name).collect(), a.rank.iter().zip(&b.rank).map(|(x, y)| x == y).collect());
        compare("compact", suite.compact.iter().map(|c| c.name).collect(), a.compact.iter().zip(&b.compact).map(|(x, y)| x == y).collect());
        // A pool run's outcome depends on every answer of both hooks.
        let same: Vec<bool> = a.pool.iter().zip(&b.pool).map(|(x, y)| x == y).collect();
        compare("pool-place", suite.pool.iter().map(|c| c.name).collect(), same.clone());
        compare("pool-step", suite.pool.iter().map(|c| c.name).collect(), same);
    }
    report.rules = rules.into_vec();
    report
}

/// One pass over every scenario on a fresh, configured instance; checks
/// the answers when `rules` is given. `None` if configuration failed.
fn pass(
    engine: &Arc<PolicyEngine>,
    loaded: &Arc<LoadedPolicy>,
    opts: &Options,
    suite: &Suite,
    mut rules: Option<&mut Rules>,
    slowest: &mut Duration,
) -> Option<Answers> {
    let mut policy = WasmPolicy::new(engine.clone(), loaded.clone(), opts.limits);
    let configured = policy.configure(&opts.config);
    if let Some(rules) = rules.as_deref_mut() {
        rules.check("configure/accepts", configured.is_ok(), || format!("configure({:?}): {}", opts.config, configured.clone().unwrap_err()));
    }
    configured.ok()?;
    let hooks = loaded.info.hooks;
    let mut answers = Answers::default();
    let mut timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        *slowest = (*slowest).max(t.elapsed());
    };

    if hooks.contains(Hooks::SCORE) {
        for (k, case) in suite.score.iter().enumerate() {
            let mut nodes = nodes_of(&case.fleet, |n| predicate::check(n, &case.shape).is_ok());
            let task = task_of(&case.shape, k as u64, case.gang_size, case.gang_index, case.priority);
            let mut result = Err(PolicyError::Unsupported("score"));
            timed(&mut || result = policy.score_raw(&task, &mut nodes));
            let label = format!("scenario {k} ({}, {} nodes)", case.name, nodes.len());
            answers.score.push(result.as_ref().ok().map(|s| (bits(&s.scores), s.gpus.clone())));
            if let Some(rules) = rules.as_deref_mut() {
                call_outcome(rules, "score", &label, &result);
                if let Ok(answer) = &result {
                    check_scores(rules, &label, &case.fleet, &case.shape, &nodes, answer);
                }
            }
        }
    }
    if hooks.contains(Hooks::SCORE)
        && let Some(rules) = rules.as_deref_mut()
        && let Some(case) = suite.score.first()
    {
        check_memory_steady(rules, &mut policy, case);
    }
    if hooks.contains(Hooks::DOMAINS) {
        for (k, case) in suite.domains.iter().enumerate() {
            let (mut domains, _) = berth_core::sim::domain_table(&case.fleet, &case.shape);
            let task = task_of(&case.shape, k as u64, case.gang_size, 0, 0);
            let mut result = Err(PolicyError::Unsupported("score-domains"));
            timed(&mut || result = policy.score_domains_raw(&task, &mut domains));
            let label = format!("scenario {k} ({}, {} domains)", case.name, domains.len());
            // The host checks length and finiteness itself; file its
            // verdict under the rule it broke.
            let result = result.map(|s| s.unwrap_or_default());
            answers.domains.push(result.as_ref().ok().map(|s| bits(s)));
            if let Some(rules) = rules.as_deref_mut() {
                check_domains(rules, &label, &domains, &result);
            }
        }
    }
    if hooks.contains(Hooks::RANK) {
        for (k, case) in suite.rank.iter().enumerate() {
            let mut victims = case.victims.clone();
            let task = task_of(&case.demand, k as u64, 1, 0, 9);
            let mut result = Err(PolicyError::Unsupported("rank"));
            timed(&mut || result = policy.rank(&task, &mut victims));
            let label = format!("scenario {k} ({})", case.name);
            answers.rank.push(result.as_ref().ok().cloned());
            if let Some(rules) = rules.as_deref_mut() {
                check_rank(rules, &label, &result);
            }
        }
    }
    if hooks.contains(Hooks::COMPACT) {
        for (k, case) in suite.compact.iter().enumerate() {
            let mut snapshot = case.snapshot.clone();
            let mut result = Err(PolicyError::Unsupported("compact"));
            timed(&mut || result = policy.compact(&mut snapshot));
            let label = format!("scenario {k} ({})", case.name);
            answers.compact.push(result.as_ref().ok().cloned());
            if let Some(rules) = rules.as_deref_mut() {
                call_outcome(rules, "compact", &label, &result);
                if let Ok(plan) = &result {
                    check_plan(rules, &label, &case.snapshot, plan);
                    check_plan_host(rules, &label, case, plan);
                }
            }
        }
    }
    if hooks.contains(Hooks::POOL_PLACE) || hooks.contains(Hooks::POOL_STEP) {
        for (k, case) in suite.pool.iter().enumerate() {
            answers.pool.push(pool_pass(&mut policy, hooks, k, case, rules.as_deref_mut(), slowest));
        }
    }
    Some(answers)
}

fn check_scores(rules: &mut Rules, label: &str, fleet: &Fleet, shape: &TaskShape, nodes: &Nodes, answer: &Scores) {
    let n = nodes.len();
    let lengths_ok = answer.scores.len() == n && (answer.gpus.is_empty() || answer.gpus.len() == n);
    rules.check("score/length", lengths_ok, || {
        format!("{label}: {} scores and {} GPU masks for {n} nodes", answer.scores.len(), answer.gpus.len())
    });
    let bad = answer.scores.iter().position(|s| !s.is_finite());
    rules.check("score/finite", bad.is_none(), || format!("{label}: score {} is {}", bad.unwrap_or(0), answer.scores[bad.unwrap_or(0)]));
    let mut mask_error = None;
    if answer.gpus.len() == n {
        for (i, &mask) in answer.gpus.iter().enumerate() {
            let id = nodes.ids[i];
            if let Err(e) = berth_core::placement::validate_mask(&fleet.nodes()[id as usize], id, shape, mask) {
                mask_error = Some(format!("{label}: {e}"));
                break;
            }
        }
    }
    rules.check("score/gpu-masks", mask_error.is_none(), || mask_error.clone().unwrap_or_default());
}

fn check_domains(rules: &mut Rules, label: &str, domains: &Domains, result: &Result<Vec<f64>, PolicyError>) {
    // The policy host rejects a wrong length or a non-finite score as
    // InvalidOutput before the answer reaches us: tell the two apart by the
    // domain count in the message it writes.
    let (length_bad, finite_bad) = match result {
        Err(PolicyError::InvalidOutput(msg)) if msg.contains("domain scores for") => (Some(msg.clone()), None),
        Err(PolicyError::InvalidOutput(msg)) => (None, Some(msg.clone())),
        Ok(s) => (
            (s.len() != domains.len()).then(|| format!("{} scores for {} domains", s.len(), domains.len())),
            s.iter().find(|x| !x.is_finite()).map(|x| format!("a score is {x}")),
        ),
        Err(_) => (None, None),
    };
    let other = match result {
        Err(PolicyError::InvalidOutput(_)) => Ok(()),
        Err(e) => Err(e.clone()),
        Ok(_) => Ok(()),
    };
    call_outcome(rules, "score-domains", label, &other);
    if matches!(result, Ok(_) | Err(PolicyError::InvalidOutput(_))) {
        rules.check("score-domains/length", length_bad.is_none(), || format!("{label}: {}", length_bad.clone().unwrap_or_default()));
        rules.check("score-domains/finite", finite_bad.is_none(), || format!("{label}: {}", finite_bad.clone().unwrap_or_default()));
    }
}

fn check_rank(rules: &mut Rules, label: &str, result: &Result<Vec<u32>, PolicyError>) {
    // As for domains: the policy host checks indexes and says which way
    // they are wrong ("out of" the victims, or "ranked twice").
    let other = match result {
        Err(PolicyError::InvalidOutput(_)) | Ok(_) => Ok(()),
        Err(e) => Err(e.clone()),
    };
    call_outcome(rules, "rank", label, &other);
    match result {
        Err(PolicyError::InvalidOutput(msg)) => {
            let twice = msg.contains("twice");
            rules.check("rank/in-range", twice, || format!("{label}: {msg}"));
            rules.check("rank/unique", !twice, || format!("{label}: {msg}"));
        }
        Ok(_) => {
            rules.check("rank/in-range", true, String::new);
            rules.check("rank/unique", true, String::new);
        }
        Err(_) => {}
    }
}

/// Growth of an instance's memory over this many identical calls, after
/// the suite has warmed it, that fails `score/memory-steady`.
const LEAK_CALLS: usize = 8;
const LEAK_BYTES: u64 = 16 << 20;

/// Calls the first score scenario [`LEAK_CALLS`] more times: an allocator
/// keeps what it grew, but an honest policy reuses it, so its memory stops
/// growing once warm. A leak grows it every call until the cap ends it live.
fn check_memory_steady(rules: &mut Rules, policy: &mut WasmPolicy, case: &ScoreCase) {
    let task = task_of(&case.shape, 0, case.gang_size, case.gang_index, case.priority);
    let before = policy.memory_bytes();
    let mut failure = None;
    for call in 0..LEAK_CALLS {
        let mut nodes = nodes_of(&case.fleet, |n| predicate::check(n, &case.shape).is_ok());
        if let Err(e) = policy.score_raw(&task, &mut nodes) {
            failure = Some(format!("repeat call {} of scenario 0: {}", call + 1, brief(&e)));
            break;
        }
    }
    let grown = policy.memory_bytes().saturating_sub(before);
    if failure.is_none() && grown > LEAK_BYTES {
        failure = Some(format!("{LEAK_CALLS} repeats of scenario 0 grew memory by {} MiB (at most {} MiB)", grown >> 20, LEAK_BYTES >> 20));
    }
    rules.check("score/memory-steady", failure.is_none(), || failure.clone().unwrap_or_default());
}

/// The plan as the live host validates it ([`berth_core::compaction::validate`]),
/// so a policy that passes here is not refused live for its plans.
fn check_plan_host(rules: &mut Rules, label: &str, case: &CompactCase, plan: &Plan) {
    let a = &case.snapshot.allocations;
    let running: Vec<berth_core::compaction::Running> = (0..a.ids.len())
        .map(|i| berth_core::compaction::Running {
            id: a.ids[i],
            job_id: a.job_ids[i],
            node: a.node[i],
            gpus: a.gpus[i],
            gpu_milli: a.gpu_milli[i],
            cpu_milli: a.cpu_milli[i],
            memory_mib: a.memory_mib[i],
            priority: a.priority[i],
            movable: a.movable[i] != 0,
            gang_id: a.gang_id[i],
            state_bytes: a.state_bytes[i],
            remaining_s: a.remaining_s[i],
            running_s: a.running_s[i],
            since_checkpoint_s: a.since_checkpoint_s[i],
            last_moved_s: None,
            class: a.class.get(i).and_then(|&c| berth_sdk::TaskClass::from_number(c)).unwrap_or_default(),
        })
        .collect();
    let config = berth_core::compaction::CompactionConfig::default();
    let verdict = berth_core::compaction::validate(&case.fleet, &case.snapshot.nodes.ids, &running, plan, &config, 0);
    rules.check("compact/host-accepts", verdict.is_ok(), || {
        let e = verdict.as_ref().err().expect("failed");
        match e.move_index {
            Some(i) => format!("{label}: move {i}: {}", e.reason),
            None => format!("{label}: {}", e.reason),
        }
    });
}

fn check_plan(rules: &mut Rules, label: &str, snapshot: &Snapshot, plan: &Plan) {
    let moves = plan.chain.len();
    let lengths_ok = plan.allocation.len() == moves && plan.dest_node.len() == moves && plan.dest_gpus.len() == moves;
    rules.check("compact/lengths", lengths_ok, || {
        format!(
            "{label}: columns of {}, {}, {} and {} entries",
            moves,
            plan.allocation.len(),
            plan.dest_node.len(),
            plan.dest_gpus.len()
        )
    });
    if !lengths_ok {
        return;
    }
    // Chains start at 0 and each next chain is the previous + 1.
    let mut chains_ok = plan.chain.first().is_none_or(|&c| c == 0);
    for w in plan.chain.windows(2) {
        chains_ok &= w[1] == w[0] || w[1] == w[0] + 1;
    }
    rules.check("compact/chains", chains_ok, || format!("{label}: chain column {:?}", &plan.chain[..moves.min(16)]));
    let allocs = &snapshot.allocations;
    let nodes = &snapshot.nodes;
    let node_ids: HashSet<u32> = nodes.ids.iter().copied().collect();
    let mut move_error = None;
    let mut mask_error = None;
    for m in 0..moves {
        let Some(a) = allocs.ids.iter().position(|&id| id == plan.allocation[m]) else {
            move_error.get_or_insert(format!("{label}: move {m} names allocation {}, not in the snapshot", plan.allocation[m]));
            continue;
        };
        if allocs.movable[a] == 0 {
            move_error.get_or_insert(format!("{label}: move {m} moves allocation {}, which is not movable", plan.allocation[m]));
        }
        let dest = plan.dest_node[m];
        if !node_ids.contains(&dest) {
            move_error.get_or_insert(format!("{label}: move {m} goes to node {dest}, not in the snapshot"));
            continue;
        }
        let mask = plan.dest_gpus[m];
        if mask != 0 {
            let i = nodes.ids.iter().position(|&id| id == dest).expect("checked above");
            let gpus = nodes.gpu_count[i];
            let wanted = allocs.gpus[a].count_ones();
            if (gpus < 64 && mask >> gpus != 0) || mask.count_ones() != wanted {
                mask_error.get_or_insert(format!(
                    "{label}: move {m}: mask {mask:#x} on a {gpus}-GPU node for an allocation of {wanted} GPUs (GPUs {:?})",
                    gpus_of(mask).collect::<Vec<_>>()
                ));
            }
        }
    }
    rules.check("compact/moves", move_error.is_none(), || move_error.clone().unwrap_or_default());
    rules.check("compact/gpu-masks", mask_error.is_none(), || mask_error.clone().unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        let mut r = Rules::default();
        for rule in ["compact/lengths", "compact/chains", "compact/moves", "compact/gpu-masks", "score/length", "score/finite", "score/gpu-masks"] {
            r.declare(rule, "");
        }
        r
    }

    fn failed(r: Rules) -> Vec<String> {
        r.into_vec().into_iter().filter(|r| !r.passed()).map(|r| r.rule).collect()
    }

    // No bundled policy claims `compact`, so its checks are tested here.
    #[test]
    fn plans_are_checked_rule_by_rule() {
        let snapshot = &compact_cases()[0].snapshot;
        let movable = snapshot.allocations.ids[0];
        let pinned = snapshot.allocations.ids[4]; // movable is 0 for every fifth
        assert_eq!(snapshot.allocations.movable[4], 0);
        let check = |plan: Plan| {
            let mut r = rules();
            check_plan(&mut r, "case", snapshot, &plan);
            failed(r)
        };
        let ok = Plan { chain: vec![0, 0, 1], allocation: vec![movable; 3], dest_node: vec![2, 3, 4], dest_gpus: vec![0, 0b1, 0] };
        assert!(check(ok.clone()).is_empty());
        assert!(check(Plan::default()).is_empty());
        assert_eq!(check(Plan { dest_gpus: vec![0], ..ok.clone() }), ["compact/lengths"]);
        assert_eq!(check(Plan { chain: vec![1, 1, 2], ..ok.clone() }), ["compact/chains"]);
        assert_eq!(check(Plan { chain: vec![0, 2, 2], ..ok.clone() }), ["compact/chains"]);
        assert_eq!(check(Plan { allocation: vec![movable, pinned, movable], ..ok.clone() }), ["compact/moves"]);
        assert_eq!(check(Plan { allocation: vec![movable, 9999, movable], ..ok.clone() }), ["compact/moves"]);
        assert_eq!(check(Plan { dest_node: vec![2, 999, 4], ..ok.clone() }), ["compact/moves"]);
        // Allocation 0 holds one GPU: two named, or a GPU a 4-GPU node lacks.
        assert_eq!(check(Plan { dest_gpus: vec![0, 0b11, 0], ..ok.clone() }), ["compact/gpu-masks"]);
        assert_eq!(check(Plan { dest_node: vec![2, 2, 4], dest_gpus: vec![0, 1 << 5, 0], ..ok }), ["compact/gpu-masks"]);
    }

    #[test]
    fn plans_are_checked_as_the_host_would() {
        let case = &compact_cases()[0];
        let a = &case.snapshot.allocations;
        // Allocation 1: a quarter GPU on node 0 (an H800), in no gang.
        let id = a.ids[1];
        assert_eq!((a.node[1], a.gang_id[1], a.movable[1]), (0, 0, 1));
        let check = |plan: Plan| {
            let mut r = Rules::default();
            r.declare("compact/host-accepts", "test");
            check_plan_host(&mut r, "case", case, &plan);
            r.into_vec().remove(0).failures
        };
        let one = |dest: u32| Plan { chain: vec![0], allocation: vec![id], dest_node: vec![dest], dest_gpus: vec![0] };
        // Node 4 is an idle H800 like node 0.
        assert!(check(one(4)).is_empty(), "{:?}", check(one(4)));
        let twice = Plan { chain: vec![0, 0], allocation: vec![id, id], dest_node: vec![4, 8], dest_gpus: vec![0, 0] };
        assert!(check(twice)[0].contains("moved twice"));
        assert!(check(one(0))[0].contains("already runs on node 0"));
        // Node 3 is full: all eight GPUs taken.
        assert!(check(one(3))[0].contains("node 3"), "{:?}", check(one(3)));
    }

    #[test]
    fn scores_are_checked_rule_by_rule() {
        let case = &score_cases()[0];
        let nodes = nodes_of(&case.fleet, |n| predicate::check(n, &case.shape).is_ok());
        let n = nodes.len();
        let check = |scores: Scores| {
            let mut r = rules();
            check_scores(&mut r, "case", &case.fleet, &case.shape, &nodes, &scores);
            failed(r)
        };
        assert!(check(Scores::from_scores(vec![1.0; n])).is_empty());
        assert_eq!(check(Scores::from_scores(vec![1.0; n - 1])), ["score/length"]);
        let mut nan = vec![1.0; n];
        nan[n - 1] = f64::NAN;
        assert_eq!(check(Scores::from_scores(nan)), ["score/finite"]);
        // Half a GPU: a mask must name exactly one GPU with 500 free.
        assert!(check(Scores { scores: vec![1.0; n], gpus: vec![0; n] }).is_empty());
        assert_eq!(check(Scores { scores: vec![1.0; n], gpus: vec![0b11; n] }), ["score/gpu-masks"]);
        assert_eq!(check(Scores { scores: vec![1.0; n], gpus: vec![0; n + 1] }), ["score/length"]);
    }
}
