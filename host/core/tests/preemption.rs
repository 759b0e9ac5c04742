//! Preemption in the core: the victims chosen, what eviction costs them
//! under their contract, and the event loop taking capacity back.

use berth_core::preemption::{choose_victims, evict, EvictionLatency, PreemptionPolicy, PriorityContract};
use berth_core::sim::{simulate, simulate_with, Deciders, Job, SimConfig};
use berth_core::{Allocation, Fleet, Node, PlacementPolicy, PolicyError, TaskShape};
use berth_sdk::{Allocations, Nodes, Scores, Task};
use proptest::prelude::*;

struct Pack;

impl PlacementPolicy for Pack {
    fn describe(&self) -> String {
        "pack".into()
    }
    fn score(&mut self, _task: &Task, nodes: &mut Nodes) -> Result<Scores, PolicyError> {
        Ok(Scores::from_scores(nodes.iter().map(|n| -f64::from(n.gpu_free_total())).collect()))
    }
}

/// Ranks victims in the order given by a key of their columns, and records
/// what it was shown.
struct RankBy {
    key: fn(&Allocations, usize) -> u64,
    seen_priorities: Vec<u32>,
}

impl PreemptionPolicy for RankBy {
    fn describe(&self) -> String {
        "rank-by".into()
    }
    fn rank(&mut self, _demand: &Task, victims: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
        self.seen_priorities.extend(&victims.priority);
        let mut order: Vec<u32> = (0..victims.len() as u32).collect();
        order.sort_by_key(|&i| ((self.key)(victims, i as usize), i));
        Ok(Some(order))
    }
}

fn fleet(nodes: u32) -> Fleet {
    Fleet::new(vec!["A".into()], (0..nodes).map(|i| Node::new(format!("n{i}"), Some(0), 8, 64_000, 512_000)).collect()).unwrap()
}

fn shape(gpus: u32) -> TaskShape {
    TaskShape { gpu_count: gpus, gpu_milli: 1000, cpu_milli: 1000 * gpus, memory_mib: 1024, models: vec![] }
}

#[test]
fn eviction_follows_the_contract() {
    let c = PriorityContract { notice_s: 30, grace_s: 30, checkpoint_every_s: 600, checkpoint_on_notice: false, max_interruptions_per_day: 3, ..PriorityContract::default() };
    // Vacates in 10 s after 1,000 s of work: keeps the checkpoint at 600 s.
    let e = evict(&c, 1000, 10.0);
    assert_eq!((e.vacate_s, e.forced, e.kept_s, e.lost_s), (10, false, 600, 410));
    // Too slow: killed at notice + grace.
    let e = evict(&c, 1000, 500.0);
    assert_eq!((e.vacate_s, e.forced, e.kept_s, e.lost_s), (60, true, 600, 460));
    // Checkpointing on notice keeps everything, unless killed first.
    let on_notice = PriorityContract { checkpoint_on_notice: true, ..c };
    assert_eq!(evict(&on_notice, 1000, 10.0).lost_s, 0);
    assert_eq!(evict(&on_notice, 1000, 500.0).lost_s, 460);
}

#[test]
fn eviction_latency_matches_asi() {
    let l = EvictionLatency::default();
    let mut draws: Vec<f64> = (0..20_000u64).map(|k| l.sample_s(k)).collect();
    draws.sort_by(f64::total_cmp);
    let mean = draws.iter().sum::<f64>() / draws.len() as f64;
    let p95 = draws[draws.len() * 95 / 100];
    assert!((mean - 13.0).abs() < 1.5, "mean {mean}");
    assert!((p95 - 48.0).abs() < 5.0, "p95 {p95}");
    assert_eq!(l.sample_s(42), l.sample_s(42));
}

#[test]
fn victims_are_the_shortest_sufficient_prefix_and_no_more() {
    // Two nodes; node 0 holds a 4-GPU job (a) and a 2-GPU job (b), node 1 a
    // 6-GPU job (c). A demand for 6 GPUs on one node.
    let mut f = fleet(2);
    let a = [Allocation { node: 0, gpus: 0b1111, gpu_milli: 1000, cpu_milli: 4000, memory_mib: 1024 }];
    let b = [Allocation { node: 0, gpus: 0b11_0000, gpu_milli: 1000, cpu_milli: 2000, memory_mib: 1024 }];
    let c = [Allocation { node: 1, gpus: 0b11_1111, gpu_milli: 1000, cpu_milli: 6000, memory_mib: 1024 }];
    for x in [&a, &b, &c] {
        f.allocate(&x[0]).unwrap();
    }
    let all = |_: u32, _: &Node| true;
    // Ranked b, c, a: b alone frees 4 on node 0 (not enough), c then frees
    // node 1: enough, and b is given back as not needed.
    let picked = choose_victims(&f, &shape(6), 1, &all, &[&b, &c, &a]).unwrap();
    assert_eq!(picked, vec![1]);
    // Ranked b, a: b alone is not enough; with a gone, b is not needed.
    assert_eq!(choose_victims(&f, &shape(6), 1, &all, &[&b, &a]).unwrap(), vec![1]);
    // A demand for 7 needs both on node 0 (or c and one more).
    assert_eq!(choose_victims(&f, &shape(7), 1, &all, &[&b, &a, &c]).unwrap(), vec![0, 1]);
    // Not enough even with everything: none.
    assert_eq!(choose_victims(&f, &shape(8), 3, &all, &[&a, &b, &c]), None);
    // The fleet itself is untouched.
    assert_eq!(f.gpu_allocated_milli(), 12_000);
}

/// A low-priority stream fills the fleet; high-priority jobs arrive later.
fn workload() -> Vec<Job> {
    let mut jobs = Vec::new();
    for k in 0..8u64 {
        // Low priority: 4 GPUs each, long; two of them gangs of 2 tasks.
        let tasks = if k < 2 { 2 } else { 1 };
        jobs.push(Job { id: k, priority: 0, arrival_s: k, duration_s: 20 * 3600, tasks, shape: shape(4), ..Job::default() });
    }
    for k in 0..3u64 {
        jobs.push(Job { id: 100 + k, priority: 10, arrival_s: 3600 + k * 600, duration_s: 3600, tasks: 1, shape: shape(8), ..Job::default() });
    }
    jobs
}

#[test]
fn high_priority_takes_capacity_back_and_low_priority_resumes() {
    let jobs = workload();
    let config = SimConfig { horizon_s: 3 * 86_400, high_priority: 10, ..SimConfig::default() };
    let mut f = fleet(5);
    let without = simulate(&mut f, &jobs, &mut Pack, config.clone()).unwrap();
    let mut f = fleet(5);
    let mut ranker = RankBy { key: |v, i| v.running_s[i], seen_priorities: vec![] };
    let with = simulate_with(&mut f, &jobs, Deciders { placement: &mut Pack, preemption: Some(&mut ranker), compaction: None }, config.clone()).unwrap();
    f.check_invariants().unwrap();
    assert!(ranker.seen_priorities.iter().all(|&p| p == 0), "only low priority is offered as a victim");

    let high: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].priority == 10).collect();
    for &h in &high {
        let waited = |o: &berth_core::sim::SimOutcome| o.jobs[h].start_s.map(|s| s - jobs[h].arrival_s);
        // Without preemption the fleet is full of 20 h jobs.
        assert!(waited(&without).unwrap() >= 15 * 3600, "{:?}", waited(&without));
        // With it, the job starts after its victims vacate (notice + grace at most).
        assert!(waited(&with).unwrap() <= 60, "{:?}", waited(&with));
    }
    assert!(with.evictions >= 3 && with.evictions <= 6, "{} evictions", with.evictions);
    let interrupted: Vec<usize> = (0..jobs.len()).filter(|&i| with.jobs[i].interruptions > 0).collect();
    // A gang is evicted whole: both its tasks' GPUs come back together, and
    // no high-priority job is ever interrupted.
    assert!(interrupted.iter().all(|&i| jobs[i].priority == 0));
    // Every low-priority job still finishes, later than without preemption,
    // and lost work is what its contract allows (at most an hour per
    // interruption, since checkpoints are hourly).
    for i in 0..8 {
        let (a, b) = (without.jobs[i].end_s.unwrap(), with.jobs[i].end_s.unwrap());
        assert!(b >= a || with.jobs[i].interruptions == 0, "job {i}: {a} vs {b}");
        let gpus = jobs[i].gpus() as f64;
        assert!(with.jobs[i].lost_gpu_s <= f64::from(with.jobs[i].interruptions) * gpus * 3660.0);
    }
    assert!((with.lost_gpu_s - with.jobs.iter().map(|o| o.lost_gpu_s).sum::<f64>()).abs() < 1e-6);
}

#[test]
fn interruptions_per_day_are_capped() {
    let mut jobs = vec![Job { id: 1, priority: 0, duration_s: 10 * 86_400, tasks: 1, shape: shape(8), ..Job::default() }];
    // A high-priority 8-GPU job every two hours: each needs the one node.
    for k in 0..12u64 {
        jobs.push(Job { id: 10 + k, priority: 10, arrival_s: 3600 + k * 7200, duration_s: 600, tasks: 1, shape: shape(8), ..Job::default() });
    }
    let contract = PriorityContract { max_interruptions_per_day: 2, ..PriorityContract::default() };
    jobs[0].contract = Some(contract);
    let config = SimConfig { horizon_s: 86_400, high_priority: 10, ..SimConfig::default() };
    let mut f = fleet(1);
    let mut ranker = RankBy { key: |v, i| v.since_checkpoint_s[i], seen_priorities: vec![] };
    let out = simulate_with(&mut f, &jobs, Deciders { placement: &mut Pack, preemption: Some(&mut ranker), compaction: None }, config).unwrap();
    assert_eq!(out.jobs[0].interruptions, 2);
    assert_eq!(out.evictions, 2);
    // Taken back twice, it waits out the day instead of running where it
    // could no longer be taken back: no high-priority job waits for it.
    for k in 1..jobs.len() {
        let waited = out.jobs[k].start_s.map(|s| s - jobs[k].arrival_s);
        assert!(waited.is_some_and(|w| w <= 60), "job {}: waited {waited:?}", jobs[k].id);
    }
    assert!(out.jobs[0].end_s.is_none());
}

/// With preemption, low-priority work is invisible to high priority: a
/// high-priority job goes where it would go with no low-priority work (here
/// the node already half used by high priority, keeping the other node
/// free of high-priority work for a whole-node job), and the ranker picks
/// the victims there, not wherever it likes best.
#[test]
fn high_priority_goes_where_it_would_go_without_low_priority_work() {
    use berth_core::engine::World;
    use berth_core::{Decision, Engine, Event};
    let mut f = fleet(2);
    let mut engine = Engine::new(SimConfig { high_priority: 10, ..SimConfig::default() });
    let mut job = |id: u64, priority: u32, gpus: u32| engine.register(Job { id, priority, duration_s: 86_400, tasks: 1, shape: shape(gpus), ..Job::default() });
    let h1 = job(1, 10, 4);
    let lows: Vec<usize> = (2..=4).map(|id| job(id, 0, 4)).collect();
    let h2 = job(5, 10, 4);
    let h3 = job(6, 10, 8);
    // The ranker likes the lowest job id best: job 2, on node 1.
    let mut ranker = RankBy { key: |v, i| v.job_ids[i], seen_priorities: vec![] };
    let mut pass = |engine: &mut Engine, f: &mut Fleet, now: u64, events: Vec<Event>| {
        let mut deciders = Deciders { placement: &mut Pack, preemption: Some(&mut ranker), compaction: None };
        let p = engine.handle(f, now, events, &mut deciders, &mut World { eligible: None, observer: None });
        assert!(p.error.is_none());
        p.decisions
    };
    let node_of = |d: &[Decision], job: u64| {
        d.iter().find_map(|d| match d {
            Decision::Place { job: j, allocations, .. } if *j == job => Some(allocations[0].node),
            _ => None,
        })
    };
    let d = pass(&mut engine, &mut f, 0, vec![Event::Arrive(h1)]);
    assert_eq!(node_of(&d, 1), Some(0));
    // Low work goes first where high priority holds nothing (node 1), then
    // beside it: the fleet is full.
    let d = pass(&mut engine, &mut f, 1, lows.iter().map(|&l| Event::Arrive(l)).collect());
    assert_eq!((node_of(&d, 2), node_of(&d, 3), node_of(&d, 4)), (Some(1), Some(1), Some(0)), "{d:?}");
    let d = pass(&mut engine, &mut f, 100, vec![Event::Arrive(h2)]);
    assert_eq!(node_of(&d, 5), Some(0), "{d:?}");
    let evicted: Vec<u64> = d.iter().filter_map(|d| if let Decision::Evict { job, .. } = d { Some(*job) } else { None }).collect();
    assert_eq!(evicted, vec![4], "only the low work in its way");
    // A whole-node job still finds a node free of high-priority work.
    let d = pass(&mut engine, &mut f, 200, vec![Event::Arrive(h3)]);
    assert_eq!(node_of(&d, 6), Some(1), "{d:?}");
    f.check_invariants().unwrap();
}

#[test]
fn a_ranking_that_breaks_the_contract_is_refused() {
    struct Repeats;
    impl PreemptionPolicy for Repeats {
        fn describe(&self) -> String {
            "repeats".into()
        }
        fn rank(&mut self, _: &Task, v: &mut Allocations) -> Result<Option<Vec<u32>>, PolicyError> {
            Ok(Some(vec![0; v.len() + 1]))
        }
    }
    let jobs = workload();
    let config = SimConfig { horizon_s: 86_400, high_priority: 10, ..SimConfig::default() };
    let err = simulate_with(&mut fleet(5), &jobs, Deciders { placement: &mut Pack, preemption: Some(&mut Repeats), compaction: None }, config).unwrap_err();
    assert!(matches!(err, PolicyError::InvalidOutput(ref m) if m.contains("repeated")), "{err}");
}

/// Two nodes held by online-inference replicas for days; low-priority work
/// arrives all the time. With harvesting, the replicas sleep in the trough,
/// their GPUs run the low-priority work, and at the wake the borrowers are
/// evicted and the replicas take their own GPUs back.
#[test]
fn sleeping_replicas_lend_their_gpus_and_wake_on_them() {
    use berth_core::harvest::Harvest;
    let mut jobs = Vec::new();
    for k in 0..2u64 {
        jobs.push(Job { id: k, class: 0, priority: 10, arrival_s: 0, duration_s: 5 * 86_400, tasks: 1, shape: shape(8), ..Job::default() });
    }
    for k in 0..100u64 {
        jobs.push(Job { id: 100 + k, class: 1, priority: 0, arrival_s: k * 1800, duration_s: 4 * 3600, tasks: 1, shape: shape(4), ..Job::default() });
    }
    let harvest = Harvest { class: 0, sleep_at_s: 2 * 3600, wake_at_s: 8 * 3600, share: 1.0 };
    let config = SimConfig { horizon_s: 2 * 86_400, high_priority: 10, harvest: Some(harvest), ..SimConfig::default() };

    let mut f = fleet(2);
    let without = simulate(&mut f, &jobs, &mut Pack, SimConfig { harvest: None, ..config.clone() }).unwrap();
    assert!(without.jobs[2..].iter().all(|o| o.start_s.is_none()), "no room without harvesting");

    let mut f = fleet(2);
    let with = simulate(&mut f, &jobs, &mut Pack, config).unwrap();
    f.check_invariants().unwrap();
    assert_eq!(with.sleeps, 4, "two replicas, two nights");
    let trough_gpu_s = 2.0 * 2.0 * 8.0 * 6.0 * 3600.0;
    assert!((with.standby_gpu_s - trough_gpu_s).abs() < 1.0, "standby {} vs {trough_gpu_s}", with.standby_gpu_s);
    assert!(with.harvested_gpu_s > 0.5 * trough_gpu_s && with.harvested_gpu_s <= with.standby_gpu_s, "harvested {}", with.harvested_gpu_s);
    assert!(with.wake_evictions >= 2, "{} borrowers evicted at the wakes", with.wake_evictions);
    assert_eq!(with.wake_failures, 0);
    assert!(with.jobs[2..].iter().any(|o| o.end_s.is_some()), "borrowers finish work");
    // The replicas run to the end on their own GPUs, never interrupted.
    assert_eq!(with.running_at_end.iter().filter(|(_, j, _)| *j < 2).count(), 2);
    for (_, j, allocs) in &with.running_at_end {
        if *j < 2 {
            assert_eq!(allocs.len(), 1);
            assert_eq!(allocs[0].gpus, 0xff);
        }
    }
    assert!(with.jobs[..2].iter().all(|o| o.interruptions == 0));
    // Allocation counts a sleeping replica's GPUs once, borrowed or not.
    assert!(with.utilisation.all_milli_s <= f.gpu_total_milli() as f64 * with.utilisation.seconds + 1.0);
}

/// A borrower whose contract forbids another interruption runs on lent
/// GPUs only if it ends, with a margin, before their owners wake: none is
/// evicted at a wake, and the trough's early hours are still harvested.
#[test]
fn a_borrower_that_may_not_be_interrupted_ends_before_the_owner_wakes() {
    use berth_core::harvest::Harvest;
    use berth_core::job::PriorityContract;
    let firm = PriorityContract { max_interruptions_per_day: 0, ..PriorityContract::default() };
    let mut jobs = Vec::new();
    for k in 0..2u64 {
        jobs.push(Job { id: k, class: 0, priority: 10, arrival_s: 0, duration_s: 5 * 86_400, tasks: 1, shape: shape(8), ..Job::default() });
    }
    for k in 0..100u64 {
        let contract = Some(firm);
        jobs.push(Job { id: 100 + k, class: 1, priority: 0, arrival_s: k * 1800, duration_s: 3 * 3600, tasks: 1, shape: shape(4), contract, ..Job::default() });
    }
    let harvest = Harvest { class: 0, sleep_at_s: 2 * 3600, wake_at_s: 8 * 3600, share: 1.0 };
    let config = SimConfig { horizon_s: 2 * 86_400, high_priority: 10, harvest: Some(harvest), ..SimConfig::default() };
    let mut f = fleet(2);
    let out = simulate(&mut f, &jobs, &mut Pack, config).unwrap();
    f.check_invariants().unwrap();
    assert_eq!(out.wake_evictions, 0, "no borrower is taken back at a wake");
    assert_eq!(out.wake_failures, 0);
    assert!(out.harvested_gpu_s > 0.0, "lent GPUs still run work that ends in time");
    // Every borrower started at most 8 h - 3 h x 1.2 after a sleep began.
    for (o, j) in out.jobs[2..].iter().zip(&jobs[2..]) {
        if let Some(start) = o.start_s {
            let at = start % 86_400;
            assert!(!(2 * 3600..8 * 3600).contains(&at) || at + j.duration_s + j.duration_s / 5 <= 8 * 3600, "job {} started at {at} s of the day", j.id);
        }
    }
}

/// Work on a non-preemptible partition is never taken back.
#[test]
fn protected_partitions_keep_their_work() {
    let jobs = vec![
        Job { id: 1, priority: 0, duration_s: 86_400, tasks: 1, shape: shape(8), ..Job::default() },
        Job { id: 2, priority: 10, arrival_s: 600, duration_s: 3600, tasks: 1, shape: shape(8), ..Job::default() },
    ];
    let run = |protected: &[u32]| {
        let mut f = fleet(1);
        let config = SimConfig { horizon_s: 7200, high_priority: 10, protected_partitions: protected.iter().copied().collect(), ..SimConfig::default() };
        let mut ranker = RankBy { key: |v, i| v.running_s[i], seen_priorities: vec![] };
        simulate_with(&mut f, &jobs, Deciders { placement: &mut Pack, preemption: Some(&mut ranker), compaction: None }, config).unwrap()
    };
    let open = run(&[]);
    assert_eq!((open.evictions, open.jobs[1].start_s.is_some()), (1, true));
    let protected = run(&[0]);
    assert_eq!((protected.evictions, protected.jobs[1].start_s), (0, None));
}

/// The IPC compaction policy compiled natively (it moves low-priority work
/// to free whole nodes).
struct Ipc(berth_policy_ipc::Ipc);

impl berth_core::compaction::CompactionPolicy for Ipc {
    fn describe(&self) -> String {
        "ipc (native)".into()
    }
    fn compact(&mut self, s: &mut berth_sdk::Snapshot) -> Result<berth_sdk::Plan, PolicyError> {
        use berth_sdk::Policy;
        self.0.compact(s).map_err(PolicyError::Guest)
    }
}

/// One step of the world around an engine with preemption.
#[derive(Clone, Debug)]
enum Step {
    /// A job: high priority or not, GPUs per task, half or whole GPUs, tasks.
    Submit { high: bool, gpus: u32, half: bool, tasks: u32, reports_exit: bool },
    /// The k-th running job (mod their count) ends, leaves, is requeued,
    /// sleeps (high priority), checkpoints.
    End(usize),
    Leaving(usize),
    Requeue(usize),
    SleepJob(usize),
    /// The k-th sleeping job wakes; the k-th evicted job reports its exit.
    WakeJob(usize),
    Vacated(usize),
    /// A node is cordoned or uncordoned outside the engine.
    Cordon(u32, bool),
    Compact,
    /// The live host's make-before-break move, done outside the engine:
    /// the k-th running job's first task gets a copy on node n (allocated
    /// on the fleet), then the old copy is released and the engine told
    /// (`replace_held`).
    Migrate(usize, u32),
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (any::<bool>(), 1u32..=4, any::<bool>(), 1u32..=3, any::<bool>())
            .prop_map(|(high, gpus, half, tasks, reports_exit)| Step::Submit { high, gpus, half, tasks, reports_exit }),
        2 => any::<usize>().prop_map(Step::End),
        1 => any::<usize>().prop_map(Step::Leaving),
        1 => any::<usize>().prop_map(Step::Requeue),
        1 => any::<usize>().prop_map(Step::SleepJob),
        1 => any::<usize>().prop_map(Step::WakeJob),
        1 => any::<usize>().prop_map(Step::Vacated),
        1 => (0u32..6, any::<bool>()).prop_map(|(n, c)| Step::Cordon(n, c)),
        1 => Just(Step::Compact),
        1 => (any::<usize>(), 0u32..6).prop_map(|(k, n)| Step::Migrate(k, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// High priority decides on a view of the fleet without low-priority
    /// work, kept from pass to pass by the nodes that changed. Whatever
    /// happens (placements, preemptions, ends, departures, sleeps and
    /// wakes, requeues, cordons, compaction moves, the live host's
    /// migrations), the kept view is the one made anew from the fleet
    /// after every pass.
    #[test]
    fn the_kept_view_without_low_priority_work_never_drifts(steps in prop::collection::vec(arb_step(), 1..60)) {
        use berth_core::engine::{Deciders, World};
        use berth_core::{Engine, Event};
        let mut f = fleet(6);
        let config = SimConfig { high_priority: 5, ..SimConfig::default() };
        let compaction = berth_core::compaction::CompactionConfig {
            start_partial_pct: 0.0,
            stop_partial_pct: 0.0,
            min_residence_s: 0,
            payback_margin: 0.0,
            ..Default::default()
        };
        let mut engine = Engine::new(config);
        let (mut placement, mut rank, mut compact) = (Pack, RankBy { key: |v, i| v.priority[i].into(), seen_priorities: Vec::new() }, Ipc(berth_policy_ipc::Ipc::default()));
        let mut now = 0;
        let mut next_id = 1;
        let mut slots = Vec::new();
        for step in steps {
            now += 7;
            let running: Vec<usize> = slots.iter().copied().filter(|&s| engine.planned_end(s).is_some() && !engine.is_sleeping(s)).collect();
            let pick = |k: usize, from: &[usize]| (!from.is_empty()).then(|| from[k % from.len()]);
            let mut events = Vec::new();
            match step {
                Step::Submit { high, gpus, half, tasks, reports_exit } => {
                    let shape = TaskShape { gpu_milli: if half { 500 } else { 1000 }, ..shape(gpus) };
                    let job = Job { id: next_id, priority: if high { 5 } else { 1 }, duration_s: 600, tasks, shape, reports_exit, ..Job::default() };
                    next_id += 1;
                    let s = engine.register(job);
                    slots.push(s);
                    events.push(Event::Arrive(s));
                }
                Step::End(k) => events.extend(pick(k, &running).map(Event::End)),
                Step::Leaving(k) => events.extend(pick(k, &running).map(Event::Leaving)),
                Step::Requeue(k) => events.extend(pick(k, &running).map(Event::Requeue)),
                Step::SleepJob(k) => {
                    let sleepers: Vec<usize> = running.iter().copied().filter(|&s| engine.can_sleep(s)).collect();
                    events.extend(pick(k, &sleepers).map(Event::SleepJob));
                }
                Step::WakeJob(k) => {
                    let asleep: Vec<usize> = slots.iter().copied().filter(|&s| engine.is_sleeping(s)).collect();
                    events.extend(pick(k, &asleep).map(Event::WakeJob));
                }
                Step::Vacated(k) => {
                    let stopping: Vec<usize> = slots.iter().copied().filter(|&s| engine.job(s).reports_exit && engine.planned_end(s).is_none() && engine.held(s).is_empty()).collect();
                    events.extend(pick(k, &stopping).map(Event::Vacated));
                }
                Step::Cordon(n, cordoned) => {
                    f.set_schedulable(n, !cordoned).unwrap();
                    events.push(Event::FleetChanged);
                }
                Step::Compact => events.push(Event::Compact),
                Step::Migrate(k, n) => {
                    if let Some(slot) = pick(k, &running) {
                        let old = engine.held(slot)[0].clone();
                        let node = &f.nodes()[n as usize];
                        let free: Vec<usize> = (0..node.gpus.len()).filter(|&g| node.gpus[g] >= old.gpu_milli).collect();
                        let want = old.gpus.count_ones() as usize;
                        if n != old.node && free.len() >= want {
                            let mask = free[..want].iter().fold(0u64, |m, &g| m | 1 << g);
                            let new = berth_core::Allocation { node: n, gpus: mask, ..old.clone() };
                            if f.allocate(&new).is_ok() {
                                // The view is brought up to date while both
                                // copies are held (the move under way)...
                                if let Err(e) = engine.check_high_view(&f) {
                                    prop_assert!(false, "during a move: {e}");
                                }
                                // ...then the old copy goes.
                                f.release(&old).unwrap();
                                prop_assert!(engine.replace_held(slot, &old, new));
                            }
                        }
                    }
                }
            }
            let mut deciders = Deciders { placement: &mut placement, preemption: Some(&mut rank), compaction: Some((&mut compact, compaction.clone())) };
            let pass = engine.handle(&mut f, now, events, &mut deciders, &mut World { eligible: None, observer: None });
            prop_assert!(pass.error.is_none(), "{:?}", pass.error);
            f.check_invariants().unwrap();
            if let Err(e) = engine.check_high_view(&f) {
                prop_assert!(false, "after {now} s: {e}");
            }
        }
    }
}
