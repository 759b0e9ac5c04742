//! Fuzzing with proptest (`cargo fuzz` needs a nightly compiler): every
//! input a file, a config, a caller or a policy hands the host, as
//! arbitrary bytes, as mutations of a seed corpus kept in the repository
//! (`tests/fuzz-corpus/<target>/`), and as structured but hostile values.
//! Each target must never panic and must answer with a clear error or a
//! bounded result.
//!
//! Cases per property: a few hundred by default (all targets together run
//! in well under a minute in release); `BERTH_FUZZ_CASES=N` runs N each:
//!
//! ```text
//! BERTH_FUZZ_CASES=100000 cargo test --release --test fuzz
//! ```
//!
//! Failures found are kept (as proptest seeds) in
//! `tests/fuzz-corpus/proptest-regressions.txt` and replayed first.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use berth::replay::openb::{read_nodes, read_pods};
use berth::serve::auth::Access;
use berth_core::compaction::{CompactionConfig, Running};
use berth_core::preemption::{Candidate, PreemptionPolicy};
use berth_core::{Allocation, Fleet, Job, Node, PlacementPolicy, Placer, PolicyError, TaskMeta, TaskShape};
use berth_sdk::{Allocations, Nodes, Plan, Scores, Task};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `default` cases, or BERTH_FUZZ_CASES.
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("BERTH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    ProptestConfig {
        cases,
        // Relative to the package directory (host/), where tests run.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("../tests/fuzz-corpus/proptest-regressions.txt"))),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    }
}

/// The seed files of one target.
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = repo_root().join("tests/fuzz-corpus").join(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in {}", dir.display());
    files
}

/// Seed files (name, bytes) of each target, read once.
type Seeds = &'static [(String, Vec<u8>)];

fn seeds(target: &'static str) -> Seeds {
    static ALL: OnceLock<std::sync::Mutex<std::collections::HashMap<&'static str, Seeds>>> = OnceLock::new();
    let mut all = ALL.get_or_init(Default::default).lock().unwrap();
    all.entry(target).or_insert_with(|| Box::leak(corpus(target).into_boxed_slice()))
}

/// One edit of a byte string.
#[derive(Clone, Debug)]
enum Edit {
    Flip(prop::sample::Index, u8),
    Insert(prop::sample::Index, Vec<u8>),
    Delete(prop::sample::Index, usize),
    /// Repeats a slice many times (long fields, many rows).
    Repeat(prop::sample::Index, usize, u16),
    /// Splices in a token that parsers care about.
    Token(prop::sample::Index, &'static str),
}

const TOKENS: &[&str] = &[
    ",", "\n", "\r\n", "\"", "=", "[", "]", "[[", "{", "}", "-1", "0", "18446744073709551616", "4294967296", "1e309", "nan", "inf", "\u{0}", "\u{202e}",
    "\u{1b}[31m", "#", "'''", "\"\"\"", "\\u0000", "true", "999999999999999999999999",
];

fn arb_edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<prop::sample::Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Edit::Insert(i, v)),
        (any::<prop::sample::Index>(), 1usize..64).prop_map(|(i, n)| Edit::Delete(i, n)),
        (any::<prop::sample::Index>(), 1usize..32, 1u16..2000).prop_map(|(i, n, k)| Edit::Repeat(i, n, k)),
        (any::<prop::sample::Index>(), prop::sample::select(TOKENS)).prop_map(|(i, t)| Edit::Token(i, t)),
    ]
}

fn mutate(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let at = |i: &prop::sample::Index, len: usize| if len == 0 { 0 } else { i.index(len + 1) };
        match e {
            Edit::Flip(i, x) if !b.is_empty() => {
                let k = i.index(b.len());
                b[k] ^= x;
            }
            Edit::Flip(..) => {}
            Edit::Insert(i, v) => {
                let k = at(i, b.len());
                b.splice(k..k, v.iter().copied());
            }
            Edit::Delete(i, n) => {
                let k = at(i, b.len()).min(b.len());
                let end = (k + n).min(b.len());
                b.drain(k..end);
            }
            Edit::Repeat(i, n, times) => {
                let k = at(i, b.len()).min(b.len());
                let piece: Vec<u8> = b[k..(k + n).min(b.len())].to_vec();
                let rep: Vec<u8> = piece.iter().copied().cycle().take(piece.len() * *times as usize).collect();
                b.splice(k..k, rep);
            }
            Edit::Token(i, t) => {
                let k = at(i, b.len());
                b.splice(k..k, t.bytes());
            }
        }
        b.truncate(4 << 20);
    }
    b
}

/// Arbitrary bytes, or a mutated seed of `target`.
fn input(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds(target).len();
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..512),
        4 => (0..n, prop::collection::vec(arb_edit(), 1..6)).prop_map(move |(s, edits)| mutate(&seeds(target)[s].1, &edits)),
    ]
}

/// An error must say something, and not echo an unbounded input.
fn clear(what: &str, input_len: usize, e: &dyn std::fmt::Display) {
    let text = format!("{e:#}");
    assert!(!text.trim().is_empty(), "{what}: an empty error for a {input_len}-byte input");
    assert!(text.len() <= 8192, "{what}: a {}-byte error for a {input_len}-byte input: {}...", text.len(), &text[..text.floor_char_boundary(300)]);
}

fn scratch(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = repo_root().join("target/tmp").join(format!("fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(format!("{name}-{}.csv", N.fetch_add(1, Ordering::Relaxed)))
}

// ---------------------------------------------------------------- traces

fn check_nodes(bytes: &[u8]) {
    let path = scratch("nodes");
    std::fs::write(&path, bytes).unwrap();
    match read_nodes(&path) {
        Ok(nodes) => {
            assert!(!nodes.is_empty());
            for n in &nodes {
                assert!(!n.name.is_empty() && (n.gpus as usize) <= berth_core::MAX_GPUS_PER_NODE, "{n:?}");
            }
        }
        Err(e) => clear("openb nodes", bytes.len(), &e),
    }
    let _ = std::fs::remove_file(&path);
}

fn check_pods(bytes: &[u8]) {
    let path = scratch("pods");
    std::fs::write(&path, bytes).unwrap();
    match read_pods(&path) {
        Ok(pods) => {
            for p in &pods {
                assert!(!p.name.is_empty() && p.gpu_milli <= 1000, "{p:?}");
            }
        }
        Err(e) => clear("openb pods", bytes.len(), &e),
    }
    let _ = std::fs::remove_file(&path);
}

// ---------------------------------------------------------------- configs

fn check_fleet(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    match berth::asi::fleet::FleetConfig::parse(&text, "fuzz") {
        Ok(cfg) => {
            let total: u64 = cfg.shapes.iter().map(|s| u64::from(s.count)).sum();
            assert!(total <= berth::asi::fleet::MAX_NODES, "{total} nodes accepted");
            // Building is linear in the nodes: only small fleets here.
            if total <= 2000 {
                match cfg.build() {
                    Ok((fleet, _)) => assert_eq!(fleet.nodes().len() as u64, total),
                    Err(e) => clear("fleet build", bytes.len(), &e),
                }
            }
        }
        Err(e) => clear("fleet config", bytes.len(), &e),
    }
}

fn check_compaction_config(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    match berth::text::parse_toml::<CompactionConfig>(&text) {
        Ok(cfg) => {
            if let Err(e) = cfg.check() {
                clear("compaction config", bytes.len(), &e);
            }
        }
        Err(e) => clear("compaction config", bytes.len(), &e),
    }
}

fn check_access(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    match Access::parse(&text) {
        Ok(access) => {
            // Whatever was accepted answers questions without panicking.
            let _ = access.priority_ceiling("p0");
            let _ = access.allow_component(&"0".repeat(64));
        }
        Err(e) => clear("access file", bytes.len(), &e),
    }
}

#[test]
fn every_seed_is_handled() {
    for (name, b) in seeds("openb-nodes") {
        eprintln!("openb-nodes/{name}");
        check_nodes(b);
    }
    for (name, b) in seeds("openb-pods") {
        eprintln!("openb-pods/{name}");
        check_pods(b);
    }
    for (name, b) in seeds("fleet-config") {
        eprintln!("fleet-config/{name}");
        check_fleet(b);
    }
    for (name, b) in seeds("compaction-config") {
        eprintln!("compaction-config/{name}");
        check_compaction_config(b);
    }
    for (name, b) in seeds("access") {
        eprintln!("access/{name}");
        check_access(b);
    }
}

/// Seeds named `bad-*` are refused (with a clear error), `ok-*` accepted.
#[test]
fn hostile_seeds_are_refused_and_good_ones_accepted() {
    let expect = |target: &str, name: &str, ok: bool| {
        if name.starts_with("bad-") {
            assert!(!ok, "{target}/{name} was accepted");
        } else if name.starts_with("ok-") {
            assert!(ok, "{target}/{name} was refused");
        }
    };
    for (name, b) in seeds("openb-nodes") {
        let p = scratch("nodes");
        std::fs::write(&p, b).unwrap();
        expect("openb-nodes", name, read_nodes(&p).is_ok());
    }
    for (name, b) in seeds("openb-pods") {
        let p = scratch("pods");
        std::fs::write(&p, b).unwrap();
        expect("openb-pods", name, read_pods(&p).is_ok());
    }
    for (name, b) in seeds("fleet-config") {
        expect("fleet-config", name, berth::asi::fleet::FleetConfig::parse(&String::from_utf8_lossy(b), "seed").is_ok());
    }
    for (name, b) in seeds("access") {
        expect("access", name, Access::parse(&String::from_utf8_lossy(b)).is_ok());
    }
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn openb_node_reader(bytes in input("openb-nodes")) {
        check_nodes(&bytes);
    }

    #[test]
    fn openb_pod_reader(bytes in input("openb-pods")) {
        check_pods(&bytes);
    }

    #[test]
    fn fleet_config(bytes in input("fleet-config")) {
        check_fleet(&bytes);
    }

    #[test]
    fn compaction_config(bytes in input("compaction-config")) {
        check_compaction_config(&bytes);
    }

    #[test]
    fn access_file(bytes in input("access")) {
        check_access(&bytes);
    }
}

// ------------------------------------------------- policy answer validation

fn fleet() -> Fleet {
    let nodes = (0..6)
        .map(|i| {
            let mut n = Node::new(format!("n{i}"), Some(0), if i == 5 { 0 } else { 8 }, 64_000, 256_000);
            n.switch_domain = i / 3;
            if i == 5 {
                n.model = None;
            }
            n
        })
        .collect();
    Fleet::new(vec!["A".into()], nodes).unwrap()
}

/// A policy whose answer is whatever the fuzzer says.
struct Hostile(Result<Scores, PolicyError>);

impl PlacementPolicy for Hostile {
    fn describe(&self) -> String {
        "hostile".into()
    }
    fn score(&mut self, _task: &Task, _nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        std::mem::replace(&mut self.0, Err(PolicyError::Guest("called twice".into())))
    }
}

struct HostileRank(Option<Vec<u32>>);

impl PreemptionPolicy for HostileRank {
    fn describe(&self) -> String {
        "hostile-rank".into()
    }
    fn rank(&mut self, _demand: &Task, _victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        Ok(self.0.take())
    }
}

fn arb_f64() -> impl Strategy<Value = f64> {
    prop_oneof![any::<f64>(), Just(f64::NAN), Just(f64::INFINITY), Just(f64::NEG_INFINITY), Just(-0.0), -10.0..10.0f64]
}

fn arb_mask() -> impl Strategy<Value = u64> {
    prop_oneof![any::<u64>(), 0u64..256, Just(0), Just(u64::MAX), Just(1 << 63)]
}

fn arb_shape() -> impl Strategy<Value = TaskShape> {
    (0u32..10, 0u32..2000, 0u32..100_000, 0u64..1_000_000).prop_map(|(gpu_count, gpu_milli, cpu_milli, memory_mib)| TaskShape {
        gpu_count,
        gpu_milli: if gpu_count == 0 { 0 } else { gpu_milli.max(1) },
        cpu_milli,
        memory_mib,
        models: Vec::new(),
    })
}

proptest! {
    #![proptest_config(config(1000))]

    /// Scores: any length, any float, any mask; a placement that comes out
    /// is one the fleet accepts.
    #[test]
    fn score_answers(shape in arb_shape(), scores in prop::collection::vec(arb_f64(), 0..10), masks in prop::collection::vec(arb_mask(), 0..10), held in prop::collection::vec((0usize..6, arb_mask()), 0..6)) {
        let mut fleet = fleet();
        for (node, mask) in held {
            let _ = fleet.allocate(&Allocation { node: node as u32, gpus: mask, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 });
        }
        let mut policy = Hostile(Ok(Scores { scores, gpus: masks }));
        match Placer::new().place(&fleet, &shape, TaskMeta::default(), &mut policy, None) {
            Ok(Some(p)) => {
                let a = Allocation { node: p.node, gpus: p.gpus, gpu_milli: shape.gpu_milli, cpu_milli: shape.cpu_milli, memory_mib: shape.memory_mib };
                prop_assert!(p.score.is_finite());
                fleet.allocate(&a).map_err(|e| TestCaseError::fail(format!("accepted placement {p:?} refused by the fleet: {e}")))?;
                fleet.check_invariants().map_err(TestCaseError::fail)?;
            }
            Ok(None) => {}
            Err(e) => clear("score answer", 0, &e),
        }
    }

    /// Rank orders: out of range, repeated, empty, huge.
    #[test]
    fn rank_answers(order in prop::option::of(prop::collection::vec(prop_oneof![0u32..8, any::<u32>()], 0..20)), victims in 1usize..5, gpus in 1u32..9) {
        let mut fleet = fleet();
        let jobs: Vec<Job> = (0..victims).map(|i| Job { id: i as u64 + 1, tasks: 1, duration_s: 100, shape: TaskShape { gpu_count: 2, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: Vec::new() }, ..Job::default() }).collect();
        let held: Vec<Vec<Allocation>> = (0..victims).map(|i| {
            let a = Allocation { node: (i % 4) as u32, gpus: 0b11 << (2 * (i / 4)), gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
            fleet.allocate(&a).unwrap();
            vec![a]
        }).collect();
        let candidates: Vec<Candidate> = jobs.iter().zip(&held).map(|(job, held)| Candidate { job, held, running_s: 10, remaining_s: 90, since_checkpoint_s: 5, tier: berth_core::Tier::Preemptible, interruptions_left: 1 }).collect();
        let demand = Job { id: 99, priority: 10, tasks: 1, duration_s: 100, shape: TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, models: Vec::new() }, ..Job::default() };
        let len = order.as_ref().map_or(0, Vec::len);
        match berth_core::preemption::select_victims(&fleet, &mut HostileRank(order), &demand, &candidates, &|_, _| true) {
            Ok(Some(v)) => {
                let mut seen = std::collections::BTreeSet::new();
                for &i in &v {
                    prop_assert!(i < candidates.len() && seen.insert(i), "victim {i} of {} twice or out of range: {v:?}", candidates.len());
                }
            }
            Ok(None) => {}
            Err(e) => clear("rank answer", len, &e),
        }
    }

    /// Compaction plans: columns of unequal length, unknown allocations and
    /// nodes, masks past the node, chains out of order, moves repeated.
    #[test]
    fn plan_answers(
        chain in prop::collection::vec(prop_oneof![0u32..4, any::<u32>()], 0..8),
        allocation in prop::collection::vec(prop_oneof![0u32..6, any::<u32>()], 0..8),
        dest_node in prop::collection::vec(prop_oneof![0u32..7, any::<u32>()], 0..8),
        dest_gpus in prop::collection::vec(arb_mask(), 0..8),
        pinned in any::<u8>(),
    ) {
        let mut fleet = fleet();
        let running: Vec<Running> = (0..6u32).map(|i| {
            let a = Allocation { node: i % 4, gpus: 1 << (i / 4), gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024 };
            fleet.allocate(&a).unwrap();
            Running {
                id: i, job_id: u64::from(i) + 1, node: a.node, gpus: a.gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, priority: 0,
                movable: pinned & (1 << i) == 0, gang_id: if i < 2 { 7 } else { 0 }, state_bytes: 1 << 30, remaining_s: 100, running_s: 10,
                since_checkpoint_s: 5, last_moved_s: None, class: Default::default(),
            }
        }).collect();
        let nodes: Vec<u32> = (0..6).collect();
        let plan = Plan { chain, allocation, dest_node, dest_gpus };
        let before = fleet.clone();
        match berth_core::compaction::validate(&fleet, &nodes, &running, &plan, &CompactionConfig::default(), 1000) {
            Ok(moves) => prop_assert!(moves.len() <= plan.allocation.len()),
            Err(e) => clear("plan answer", plan.allocation.len(), &e),
        }
        prop_assert_eq!(fleet.nodes(), before.nodes(), "validation changed the fleet");
    }
}

// ------------------------------------------------------- gRPC request bodies

mod grpc {
    use super::*;
    use berth::proto as pb;
    use prost::Message;
    use prost::bytes::{Buf, BufMut};
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
    use tonic::{Code, Status};

    /// Sends and receives bytes as they are: the body is whatever the
    /// fuzzer made, not a message this client encoded.
    #[derive(Clone, Copy, Default)]
    struct Raw;
    struct RawEncoder;
    struct RawDecoder;

    impl Codec for Raw {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = RawEncoder;
        type Decoder = RawDecoder;
        fn encoder(&mut self) -> RawEncoder {
            RawEncoder
        }
        fn decoder(&mut self) -> RawDecoder {
            RawDecoder
        }
    }
    impl Encoder for RawEncoder {
        type Item = Vec<u8>;
        type Error = Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            dst.put_slice(&item);
            Ok(())
        }
    }
    impl Decoder for RawDecoder {
        type Item = Vec<u8>;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
            let mut v = vec![0; src.remaining()];
            src.copy_to_slice(&mut v);
            Ok(Some(v))
        }
    }

    /// Methods fuzzed, with a valid request each (the seeds to mutate).
    fn methods() -> Vec<(&'static str, Vec<u8>)> {
        let job = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s: 60.0, argv: vec!["true".into()], ..Default::default() };
        let gpu = pb::GpuInfo { index: 0, uuid: "GPU-x".into(), model: "H800".into(), memory_total_mib: 80_000, ..Default::default() };
        vec![
            ("/berth.v1.Berth/SubmitJob", pb::SubmitJobRequest { job: Some(job.clone()), ..Default::default() }.encode_to_vec()),
            ("/berth.v1.Berth/CancelJob", pb::CancelJobRequest { job_id: 1 }.encode_to_vec()),
            ("/berth.v1.Berth/ListJobs", pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }.encode_to_vec()),
            ("/berth.v1.Berth/ExplainJob", pb::ExplainJobRequest { job_id: 1, what_if: true }.encode_to_vec()),
            ("/berth.v1.Berth/Quote", pb::QuoteRequest { partition: "p0".into(), tasks: 1, gpus: 1, gpu_milli: 1000, ..Default::default() }.encode_to_vec()),
            ("/berth.v1.Berth/UploadPolicy", pb::UploadPolicyRequest { partition: "p0".into(), component: b"\0asm\x0d\0\x01\0".to_vec(), ..Default::default() }.encode_to_vec()),
            ("/berth.v1.AgentHub/Register", pb::RegisterAgentRequest { node: "fz".into(), partition: "p0".into(), gpus: vec![gpu], ..Default::default() }.encode_to_vec()),
            ("/berth.v1.AgentHub/Heartbeat", pb::HeartbeatRequest { node: "fz".into(), session: 1, running: vec![1, 2], ..Default::default() }.encode_to_vec()),
            ("/berth.v1.AgentHub/ReportAllocation", pb::AllocationReport { allocation_id: 1, node: "fz".into(), state: "exited".into(), ..Default::default() }.encode_to_vec()),
            ("/berth.v1.AgentHub/StartAllocation", pb::StartAllocationRequest { node: "fz".into(), gpus: vec![0], argv: vec!["true".into()], ..Default::default() }.encode_to_vec()),
        ]
    }

    /// Every request type decodes arbitrary bytes to a message or an error.
    fn decode_all(bytes: &[u8]) {
        let _ = pb::SubmitJobRequest::decode(bytes);
        let _ = pb::CancelJobRequest::decode(bytes);
        let _ = pb::ListJobsRequest::decode(bytes);
        let _ = pb::QuoteRequest::decode(bytes);
        let _ = pb::UploadPolicyRequest::decode(bytes);
        let _ = pb::RegisterAgentRequest::decode(bytes);
        let _ = pb::HeartbeatRequest::decode(bytes);
        let _ = pb::AllocationReport::decode(bytes);
        let _ = pb::StartAllocationRequest::decode(bytes);
        let _ = pb::CommandsRequest::decode(bytes);
    }

    struct Host {
        rt: tokio::runtime::Runtime,
        channel: tonic::transport::Channel,
        _handle: berth::serve::ServeHandle,
    }

    /// One live host for every case (an in-process `berth serve`).
    fn host() -> &'static Host {
        static HOST: OnceLock<Host> = OnceLock::new();
        HOST.get_or_init(|| {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let dir = repo_root().join("target/tmp").join(format!("fuzz-serve-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let access = "[[identities]]\nname = \"ops\"\ntoken = \"ops-fuzz-token\"\nroles = { \"*\" = \"operator\" }\n";
            let binpack = repo_root().join("target/policies/binpack.wasm");
            let default_policy = std::fs::read(&binpack).unwrap_or_else(|e| panic!("{}: {e}: run scripts/build-policies.sh first", binpack.display()));
            let config = berth::serve::ServeConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                metrics_listen: None,
                inference_listen: None,
                state_dir: dir,
                fleet: berth::asi::fleet::FleetConfig::parse(berth::serve::server::DEFAULT_FLEET, "default").unwrap(),
                access: Access::parse(access).unwrap(),
                tls: None,
                default_policy,
                limits: Default::default(),
                breaker: Default::default(),
                max_upload_bytes: 1 << 20,
                store: Default::default(),
                scheduling: Default::default(),
            };
            let (handle, channel) = rt.block_on(async {
                let handle = berth::serve::start(config).await.expect("serve");
                let channel = tonic::transport::Channel::from_shared(format!("http://{}", handle.addr)).unwrap().connect().await.unwrap();
                (handle, channel)
            });
            Host { rt, channel, _handle: handle }
        })
    }

    fn call(path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
        let h = host();
        h.rt.block_on(async {
            let mut grpc = tonic::client::Grpc::new(h.channel.clone());
            grpc.ready().await.map_err(|e| Status::unavailable(e.to_string()))?;
            let mut req = tonic::Request::new(body);
            req.metadata_mut().insert("authorization", "Bearer ops-fuzz-token".parse().unwrap());
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            grpc.unary(req, path, Raw).await.map(|r| r.into_inner())
        })
    }

    /// Any body: an answer or a clear error; never INTERNAL or UNKNOWN (a
    /// panic in a handler, or the host's own mistake).
    fn check(path: &'static str, body: Vec<u8>) {
        decode_all(&body);
        let len = body.len();
        match call(path, body) {
            Ok(reply) => assert!(reply.len() < 4 << 20),
            Err(s) => {
                assert!(!matches!(s.code(), Code::Internal | Code::Unknown | Code::Unavailable), "{path}: {:?} {} for a {len}-byte body", s.code(), s.message());
                clear(path, len, &s.message());
            }
        }
    }

    fn arb_body() -> impl Strategy<Value = (usize, Vec<u8>)> {
        let n = methods().len();
        prop_oneof![
            1 => (0..n, prop::collection::vec(any::<u8>(), 0..256)),
            3 => (0..n, prop::collection::vec(arb_edit(), 1..5)).prop_map(|(m, edits)| (m, mutate(&methods()[m].1, &edits))),
            1 => (0..n, any::<prop::sample::Index>()).prop_map(|(m, i)| {
                // A corpus file sent to any method.
                let seeds = seeds("grpc");
                (m, seeds[i.index(seeds.len())].1.clone())
            }),
        ]
    }

    #[test]
    fn grpc_seeds_are_answered() {
        let methods = methods();
        for (name, body) in seeds("grpc") {
            for (path, _) in &methods {
                eprintln!("grpc/{name} -> {path}");
                check(path, body.clone());
            }
        }
        // The host still serves.
        let reply = call("/berth.v1.Berth/ListPartitions", pb::ListPartitionsRequest::default().encode_to_vec()).expect("the host serves after the seeds");
        assert!(pb::ListPartitionsResponse::decode(&reply[..]).unwrap().partitions.len() >= 3);
    }

    proptest! {
        #![proptest_config(config(600))]

        #[test]
        fn grpc_request_bodies((m, body) in arb_body()) {
            let methods = methods();
            check(methods[m].0, body);
        }
    }
}
