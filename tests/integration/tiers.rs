//! Tiers and credits live: a real `berth serve` and a real synthetic agent.
//! A guaranteed job is never a victim, an opportunistic one is stopped
//! without a checkpoint notice and owed nothing, preemptible work kept out
//! of service past its contract's maximum outage is a broken promise
//! credited to its tenant, and the credits survive a host killed with
//! SIGKILL.

use std::time::Duration;

use berth::proto as pb;

use crate::agent::{agent, agent_job, assert_one_owner, dir, free_port, jobs, kill9, serve, until, BERTH};
use crate::common::policy_path;
use crate::preempt::{running, schedulable, upload_rank};

async fn credits_of(api: &mut berth::client::Client, tenant: &str) -> Option<pb::CreditRow> {
    let rows = api.credits(pb::CreditsRequest { partition: "p0".into(), tenant: String::new() }).await.unwrap().into_inner().rows;
    rows.into_iter().find(|r| r.tenant == tenant)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_hold_on_an_agent_and_credits_survive_a_host_killed_with_sigkill() {
    let d = dir("tiers");
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--listen", listen.as_str(), "--agent-timeout-ms", "3000", "--notice-s", "2", "--max-outage-s", "2"];
    let (mut host, url) = serve(&d, "serve1", &d.join("state"), &args).await;
    let hook = format!("echo $BERTH_ALLOCATION > {}/ckpt-$BERTH_ALLOCATION", d.display());
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--checkpoint-hook", &hook]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut alice = berth::client::connect(&url, Some("alice-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    upload_rank(&mut api, &policy_path("spot-gpu")).await;

    // Alice's low-priority fill, one GPU each: guaranteed, preemptible,
    // opportunistic, preemptible.
    let mut low = Vec::new();
    for tier in ["guaranteed", "preemptible", "opportunistic", "preemptible"] {
        let job = pb::JobSpec { tier: tier.into(), ..agent_job(&d, 1, 1) };
        low.push(alice.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap().into_inner().job_id);
        running(&api, &low).await;
    }
    let (g, p, o, f) = (low[0], low[1], low[2], low[3]);
    // Seconds of unsaved work (the engine counts whole seconds).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = jobs(&api).await;
    let alloc_of = |id: u64| before.iter().find(|j| j.id == id).unwrap().runs[0].allocation_id;

    // A high-priority job for three GPUs: every candidate is taken, the
    // guaranteed job is none (the rank policy is never shown it).
    let mut high = agent_job(&d, 3, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    let job = |id: u64| all.iter().find(|j| j.id == id).unwrap().clone();
    assert_eq!(job(g).state, "running", "{:?}", job(g));
    for v in [p, o, f] {
        assert_eq!(job(v).state, "pending", "{:?}", job(v));
        assert!(job(v).detail.contains(&format!("preempted for job {h}")), "{:?}", job(v));
    }
    // Preemptible work got its checkpoint notice and is credited its lost
    // work; opportunistic work was stopped at once, owed nothing.
    for v in [p, f] {
        assert!(d.join(format!("ckpt-{}", alloc_of(v))).exists(), "no checkpoint notice for job {v}");
        assert!(job(v).detail.contains("GPU-h credited to alice"), "{:?}", job(v));
    }
    assert!(!d.join(format!("ckpt-{}", alloc_of(o))).exists(), "an opportunistic job got a notice");
    assert!(!job(o).detail.contains("credited"), "{:?}", job(o));
    let owed = credits_of(&mut api, "alice").await.expect("alice is owed");
    assert_eq!((owed.preemptions, owed.broken_promises), (3, 0), "{owed:?}");
    assert!(owed.lost_gpu_seconds > 0.0 && owed.credit_gpu_hours > 0.0, "{owed:?}");

    // New work arrives while the victims are out; their outage passes its
    // 2 s bound before the high job ends. Placed again ahead of the new
    // job, each preemptible victim is a broken promise: one GPU-hour each.
    let newer = alice.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    tokio::time::sleep(Duration::from_secs(3)).await;
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
    running(&api, &[p, f]).await;
    assert_eq!(jobs(&api).await.iter().find(|j| j.id == newer).unwrap().state, "pending");
    let owed = until("the broken promises credited", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move { credits_of(&mut api, "alice").await.filter(|c| c.broken_promises == 2) }
    })
    .await;
    assert!(owed.credit_gpu_hours >= 2.0, "the floor, one GPU-hour per broken promise of a one-GPU job: {owed:?}");

    // A tenant sees its own account; a viewer sees none; the CLI prints it.
    assert!(credits_of(&mut alice, "alice").await.is_some());
    let mut watcher = berth::client::connect(&url, Some("watcher-test-token"), None, None).await.unwrap();
    assert!(watcher.credits(pb::CreditsRequest::default()).await.unwrap().into_inner().rows.is_empty());
    let out = std::process::Command::new(BERTH).args(["credits", "--server", &url, "--token", "alice-test-token"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.lines().any(|l| l.starts_with("p0") && l.contains("alice")), "{text}");

    // Durable: the same account after a SIGKILL and a restart. The tasks
    // end as the new host comes up, before their agent has registered with
    // it: their ends are kept and delivered, not lost (a lost end would
    // run the job again and count a broken promise that never was).
    kill9(&mut host);
    for id in low.iter().chain([&newer]) {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    let (_host, url2) = serve(&d, "serve2", &d.join("state"), &args).await;
    assert_eq!(url2, url);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let after = credits_of(&mut api, "alice").await.expect("credits kept");
    assert_eq!((after.preemptions, after.broken_promises), (owed.preemptions, owed.broken_promises));
    assert!((after.credit_gpu_hours - owed.credit_gpu_hours).abs() < 1e-9 && (after.lost_gpu_seconds - owed.lost_gpu_seconds).abs() < 1e-6, "{after:?} vs {owed:?}");
    let ended = until("all done", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let all = jobs(&api).await;
            all.iter().all(|j| j.state == "finished").then_some(all)
        }
    })
    .await;
    // Each ran once more after the preemption at most: no run was lost.
    for j in &ended {
        assert!(j.runs.iter().all(|r| r.state == "exited"), "job {}: {:?}", j.id, j.runs);
    }
    let again = credits_of(&mut api, "alice").await.unwrap();
    assert_eq!(again.broken_promises, owed.broken_promises, "no promise broken by the restart: {again:?}");
}

/// An agent's report for a node this host has not registered (a host that
/// just restarted) is refused as a precondition, not as an unknown
/// allocation: the agent keeps the report and sends it once registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_before_registration_is_kept_not_dropped() {
    let d = dir("tiers-report");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &[]).await;
    let mut hub = berth::agent::connect_hub(&url, Some("agent-test-token"), None).await.unwrap();
    let r = pb::AllocationReport { node: "n9".into(), allocation_id: 7, state: "exited".into(), ..Default::default() };
    let e = hub.report_allocation(r).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("register, then report"), "{e:?}");
}

/// Contract 0.4.0 shows a rank policy each victim's tier and remaining
/// allowance; spot-gpu takes opportunistic work first among equal
/// priorities (nobody is owed for it), then the least recomputation.
#[test]
fn spot_gpu_takes_work_nobody_is_owed_for_first() {
    let mut policy = crate::common::wasm_policy(&policy_path("spot-gpu"), berth::wasm::Limits::default());
    let rank = |policy: &mut berth::wasm::WasmPolicy, tiers: [berth_sdk::Tier; 2]| {
        let mut victims = berth_sdk::Allocations::default();
        // Job 1 loses a minute of one GPU, job 2 an hour.
        for (k, since) in [60u64, 3600].into_iter().enumerate() {
            victims.push(berth_sdk::AllocationRow {
                id: k as u32,
                job_id: k as u64 + 1,
                gpus: 1 << k,
                gpu_milli: 1000,
                movable: true,
                since_checkpoint_s: since,
                tier: tiers[k],
                interruptions_left: if tiers[k] == berth_sdk::Tier::Opportunistic { u32::MAX } else { 1 },
                ..Default::default()
            });
        }
        let demand = berth_sdk::Task { job_id: 9, gpu_count: 1, gpu_milli: 1000, priority: 5, ..Default::default() };
        let order = policy.rank(&demand, &mut victims).unwrap();
        order.iter().map(|&i| victims.job_ids[i as usize]).collect::<Vec<u64>>()
    };
    use berth_sdk::Tier::{Opportunistic, Preemptible};
    assert_eq!(rank(&mut policy, [Preemptible, Preemptible]), vec![1, 2], "the least recomputation first");
    assert_eq!(rank(&mut policy, [Preemptible, Opportunistic]), vec![2, 1], "opportunistic first");
}

/// An in-process host on two simulated 8-GPU H800 nodes, one switch domain
/// each; `layout` sets how they are split into partitions (fleet TOML keys),
/// `access` is the access file.
async fn two_h800_host(name: &str, layout: &str, access: &str) -> (berth::serve::ServeHandle, berth::serve::ServeConfig) {
    let fleet = format!("seed = 1\nnodes_per_switch = 1\n{layout}\n[[shapes]]\nmodel = \"H800\"\ncount = 2\ngpus = 8\ncpu_cores = 128\nmemory_gib = 1024\n");
    let dir = crate::serve::state_dir(name);
    let mut cfg = crate::serve::config(&dir, access);
    cfg.fleet = berth::asi::fleet::FleetConfig::parse(&fleet, name).unwrap();
    (berth::serve::start(cfg.clone()).await.unwrap(), cfg)
}

/// The fleet's non-preemptible partitions hold live too: in p0 (listed) a
/// high-priority job waits behind low-priority work; in p1 it takes it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_preemptible_partition_keeps_its_work_live() {
    let (h, _) = two_h800_host("tiers-protected", "nodes_per_partition = 1\nnon_preemptible_partitions = [0]\n", crate::serve::ACCESS).await;
    let mut ops = crate::serve::client(&h, "ops-test-token").await;
    let job = |partition: &str, priority: u32| pb::SubmitJobRequest {
        job: Some(pb::JobSpec { partition: partition.into(), tasks: 1, gpus: 8, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s: 3600.0, priority, ..Default::default() }),
        ..Default::default()
    };
    let mut low = Vec::new();
    for p in ["p0", "p1"] {
        low.push(ops.submit_job(job(p, 0)).await.unwrap().into_inner().job_id);
    }
    until("both low jobs running", Duration::from_secs(30), || {
        let mut ops = ops.clone();
        async move {
            let all = [crate::serve::jobs(&mut ops, "p0").await, crate::serve::jobs(&mut ops, "p1").await].concat();
            all.iter().all(|j| j.state == "running").then_some(())
        }
    })
    .await;
    let high: Vec<u64> = {
        let mut ids = Vec::new();
        for p in ["p0", "p1"] {
            ids.push(ops.submit_job(job(p, 5)).await.unwrap().into_inner().job_id);
        }
        ids
    };
    // p1's high job takes its partition's GPUs back; p0's waits.
    until("p1's high job running", Duration::from_secs(30), || {
        let mut ops = ops.clone();
        let id = high[1];
        async move { crate::serve::jobs(&mut ops, "p1").await.iter().any(|j| j.id == id && j.state == "running").then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let p0 = crate::serve::jobs(&mut ops, "p0").await;
    let state = |id: u64| p0.iter().find(|j| j.id == id).unwrap().state.clone();
    assert_eq!((state(low[0]), state(high[0])), ("running".to_string(), "pending".to_string()), "{p0:?}");
    let p1 = crate::serve::jobs(&mut ops, "p1").await;
    assert_ne!(p1.iter().find(|j| j.id == low[1]).unwrap().state, "running", "{p1:?}");
    h.shutdown().await;
}

/// `berth quote` offers each tier the caller may buy, with the contract it
/// would run under: a tenant limited to preemptible and opportunistic work
/// gets those two, an operator all three; a high priority could start now
/// by taking back the low work that fills the partition, the fill's own
/// priority only as that work ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quote_offers_each_tier_the_caller_may_buy() {
    // (Top-level keys before the identity tables.)
    let access = format!("tenant_tiers = {{ \"*\" = [\"preemptible\", \"opportunistic\"] }}\n{}", crate::serve::ACCESS);
    let (h, cfg) = two_h800_host("tiers-offers", "nodes_per_partition = 2\n", &access).await;
    let notice_s = cfg.scheduling.contract.notice_s;
    let mut ops = crate::serve::client(&h, "ops-test-token").await;
    let mut alice = crate::serve::client(&h, "alice-test-token").await;
    // Low-priority work fills both nodes for an hour.
    let mut low = Vec::new();
    for _ in 0..2 {
        let job = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 8, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, duration_s: 3600.0, ..Default::default() };
        low.push(ops.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap().into_inner().job_id);
    }
    until("the low work running", Duration::from_secs(30), || {
        let mut ops = ops.clone();
        async move { crate::serve::jobs(&mut ops, "p0").await.iter().all(|j| j.state == "running").then_some(()) }
    })
    .await;
    let ask = |priority: u32| pb::QuoteRequest { partition: "p0".into(), tasks: 1, gpus: 8, cpu_milli: 4000, memory_mib: 16 << 10, priority, ..Default::default() };
    let tiers = |offers: &[pb::TierOffer]| offers.iter().map(|o| o.tier.clone()).collect::<Vec<_>>();

    let offers = alice.quote(ask(0)).await.unwrap().into_inner().offers;
    assert_eq!(tiers(&offers), ["preemptible", "opportunistic"], "{offers:?}");
    for o in &offers {
        assert_eq!((o.now, o.by_preemption), (0, 0), "{o:?}");
        assert!(o.has_next && (3000..=3600).contains(&o.next_in_s), "as the low work ends: {o:?}");
    }
    let (p, o) = (&offers[0], &offers[1]);
    assert_eq!((p.notice_s, p.max_interruptions_per_day, p.credit_per_lost_gpu_h, p.broken_multiplier), (notice_s, 3, 1.0, 3.0), "{p:?}");
    assert_eq!((o.notice_s, o.grace_s, o.max_interruptions_per_day, o.credit_per_lost_gpu_h), (0, 0, u32::MAX, 0.0), "{o:?}");

    // High priority: both nodes' low work may be taken back (by the
    // default ranking, no rank policy uploaded): two copies now.
    let offers = ops.quote(ask(5)).await.unwrap().into_inner().offers;
    assert_eq!(tiers(&offers), ["guaranteed", "preemptible", "opportunistic"], "{offers:?}");
    assert!(offers.iter().all(|o| o.now == 0 && o.by_preemption == 2), "{offers:?}");
    assert_eq!(offers[0].max_interruptions_per_day, 0, "guaranteed is never stopped: {:?}", offers[0]);
    // ... and none of it for work of the same priority as the fill.
    assert!(ops.quote(ask(0)).await.unwrap().into_inner().offers.iter().all(|o| o.by_preemption == 0));

    // The CLI prints one line per tier offered.
    let url = format!("http://{}", h.addr);
    let out = std::process::Command::new(BERTH).args(["quote", "--server", &url, "--token", "alice-test-token", "--partition", "p0", "--gpus", "8"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let line = |tier: &str| text.lines().find(|l| l.trim_start().starts_with(&format!("{tier}:"))).map(str::to_string);
    assert!(line("guaranteed").is_none(), "{text}");
    assert!(line("preemptible").is_some_and(|l| l.contains(&format!("{notice_s} s notice")) && l.contains("at most 3 interruption")), "{text}");
    assert!(line("opportunistic").is_some_and(|l| l.contains("stopped without notice") && l.contains("not credited")), "{text}");
    h.shutdown().await;
}

/// An opportunistic job's budget is charged only for what ran: stopped
/// without notice for high-priority work, it is charged its run so far and
/// nothing while it waits; run again, its process is stopped when the
/// budget is spent and the job ends finished. The charge survives a host
/// killed with SIGKILL. A budget on any other tier, or a bad number, is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opportunistic_budget_is_charged_only_for_what_ran() {
    let d = dir("tiers-budget");
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--listen", listen.as_str(), "--agent-timeout-ms", "3000", "--notice-s", "2"];
    let (mut host, url) = serve(&d, "serve1", &d.join("state"), &args).await;
    let hook = format!("echo $BERTH_ALLOCATION > {}/ckpt-$BERTH_ALLOCATION", d.display());
    let _n1 = agent(&d, &url, "n1", "2xH20", &["--checkpoint-hook", &hook]);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut alice = berth::client::connect(&url, Some("alice-test-token"), None, None).await.unwrap();
    schedulable(&api, "n1").await;
    upload_rank(&mut api.clone(), &policy_path("spot-gpu")).await;

    for (tier, budget) in [("preemptible", 1.0), ("opportunistic", -1.0), ("opportunistic", f64::NAN)] {
        let job = pb::JobSpec { tier: tier.into(), budget_gpu_h: budget, ..agent_job(&d, 1, 1) };
        let e = alice.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{tier} {budget}: {e:?}");
        assert!(e.message().contains("budget_gpu_h"), "{e:?}");
    }

    // 20 GPU-seconds on two GPUs: ten seconds of run.
    const BUDGET_GPU_S: f64 = 20.0;
    let job = pb::JobSpec { tier: "opportunistic".into(), budget_gpu_h: BUDGET_GPU_S / 3600.0, ..agent_job(&d, 2, 1) };
    let o = alice.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap().into_inner().job_id;
    let first = running(&api, &[o]).await;
    let alloc = first[0].runs[0].allocation_id;
    let ran_from = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let h = api.clone().submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    running(&api, &[h]).await;
    let ran_s = ran_from.elapsed().as_secs_f64();
    let charged_s = |all: &[pb::Job]| all.iter().find(|j| j.id == o).unwrap().charged_gpu_h * 3600.0;
    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    let job = all.iter().find(|j| j.id == o).unwrap();
    assert_eq!(job.state, "pending", "{job:?}");
    assert!(!d.join(format!("ckpt-{alloc}")).exists(), "an opportunistic job got a notice");
    // Its process is gone (the high job's started on the same GPUs), and
    // the charge is its run: at least the three seconds slept, at most the
    // time it was seen to run, on two GPUs.
    let first_charge = charged_s(&all);
    assert!((2.0 * 3.0..=2.0 * (ran_s + 1.0)).contains(&first_charge), "charged {first_charge} GPU-s for about {ran_s} s on 2 GPUs");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(charged_s(&jobs(&api).await), first_charge, "nothing charged while it waits");

    // Run again, it is stopped once the budget is spent, and ends.
    std::fs::write(d.join(format!("release-{h}")), "0").unwrap();
    let second_from = std::time::Instant::now();
    let ended = until("the budget spent", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == o && j.state == "finished") }
    })
    .await;
    let second_s = second_from.elapsed().as_secs_f64();
    assert!(ended.detail.contains("budget spent"), "{ended:?}");
    assert!(ended.runs.iter().all(|r| !matches!(r.state.as_str(), "starting" | "running")), "{:?}", ended.runs);
    let total = ended.charged_gpu_h * 3600.0;
    // Spent to the second, plus the seconds its process took to stop.
    assert!((BUDGET_GPU_S - 2.0..=BUDGET_GPU_S + 2.0 * 4.0).contains(&total), "charged {total} GPU-s of a {BUDGET_GPU_S} budget");
    assert!(second_s + 0.5 >= (BUDGET_GPU_S - first_charge) / 2.0 - 1.0, "stopped after {second_s} s: before its budget was spent");
    let out = std::process::Command::new(BERTH).args(["jobs", "--server", &url, "--token", "alice-test-token", "--partition", "p0"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l.trim_start().starts_with(&o.to_string()) && l.contains("[opportunistic,") && l.contains("GPU-h used]")), "{text}");

    // Durable.
    kill9(&mut host);
    let (_host, _) = serve(&d, "serve2", &d.join("state"), &args).await;
    let again = until("the host back", Duration::from_secs(60), || {
        let api = api.clone();
        async move { api.clone().list_jobs(pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await.ok().map(|r| r.into_inner().jobs) }
    })
    .await;
    assert_eq!(charged_s(&again), total, "the charge kept across the restart");
}

/// A preemptible job already at its daily cap that the host stops again
/// (its node lost) is a broken promise, past-cap, credited to its tenant;
/// with an outage bound it is placed again ahead of newer work of its
/// priority. Two real agents; one is killed with SIGKILL under the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_stopped_past_its_cap_is_credited_and_placed_again_first() {
    let d = dir("tiers-pastcap");
    let args = ["--agent-timeout-ms", "1000", "--reschedule-after-ms", "1000", "--notice-s", "1", "--max-interruptions-per-day", "1", "--max-outage-s", "600"];
    let (_host, url) = serve(&d, "serve", &d.join("state"), &args).await;
    let mut agents = std::collections::BTreeMap::new();
    for n in ["n1", "n2"] {
        agents.insert(n.to_string(), agent(&d, &url, n, "1xH20", &[]));
    }
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut alice = berth::client::connect(&url, Some("alice-test-token"), None, None).await.unwrap();
    for n in ["n1", "n2"] {
        schedulable(&api, n).await;
    }
    upload_rank(&mut api, &policy_path("spot-gpu")).await;
    let high = || pb::JobSpec { priority: 5, ..agent_job(&d, 1, 1) };
    let submit = |api: &mut berth::client::Client, job: pb::JobSpec| {
        let mut api = api.clone();
        async move { api.submit_job(pb::SubmitJobRequest { job: Some(job), ..Default::default() }).await.unwrap().into_inner().job_id }
    };
    // High-priority work on one node, alice's preemptible job on the other.
    let h0 = submit(&mut api, high()).await;
    running(&api, &[h0]).await;
    let p = submit(&mut alice, agent_job(&d, 1, 1)).await;
    running(&api, &[p]).await;
    // A second high job takes p's GPU back: p's one interruption today.
    let h1 = submit(&mut api, high()).await;
    running(&api, &[h1]).await;
    let newer = submit(&mut alice, agent_job(&d, 1, 1)).await;
    let owed = credits_of(&mut api, "alice").await.expect("the preemption is on the ledger");
    assert_eq!((owed.preemptions, owed.broken_promises), (1, 0), "{owed:?}");
    // h0 ends: p, interrupted, runs again ahead of the newer job.
    std::fs::write(d.join(format!("release-{h0}")), "0").unwrap();
    let again = running(&api, &[p]).await;
    assert_eq!(jobs(&api).await.iter().find(|j| j.id == newer).unwrap().state, "pending");
    let node = again[0].runs[0].node.clone();

    // Its node is lost (agent killed, past the reschedule wait): p is
    // stopped again at its cap, a broken promise of at least a GPU-hour.
    kill9(agents.get_mut(&node).unwrap());
    let owed = until("the past-cap promise credited", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move { credits_of(&mut api, "alice").await.filter(|c| c.broken_promises == 1) }
    })
    .await;
    assert!(owed.credit_gpu_hours >= 1.0, "the floor, one GPU-hour for a one-GPU job: {owed:?}");
    let log = crate::agent::plain(&std::fs::read_to_string(d.join("serve.log")).unwrap());
    assert!(log.lines().any(|l| l.contains("promise broken: stopped by the host past its daily interruption cap") && l.contains(&format!("job={p} "))), "no past-cap promise logged for job {p}");
    let requeued = jobs(&api).await.into_iter().find(|j| j.id == p).unwrap();
    assert_eq!(requeued.state, "pending", "{requeued:?}");
    assert!(requeued.detail.contains("requeued"), "{requeued:?}");

    // h1 ends: p, interrupted, is placed again before the newer job.
    std::fs::write(d.join(format!("release-{h1}")), "0").unwrap();
    running(&api, &[p]).await;
    let all = jobs(&api).await;
    assert_one_owner(&all, &[]);
    assert_eq!(all.iter().find(|j| j.id == newer).unwrap().state, "pending", "{all:?}");
    // (The lost run's process outlived its agent: let it and the rest end.)
    for id in [p, newer] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}
