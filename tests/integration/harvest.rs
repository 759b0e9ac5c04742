//! Sleep-state harvesting, live: a real `berth serve`, a real synthetic
//! agent, real child processes. An operator puts a high-priority replica to
//! sleep through the CLI; once the agent reports it asleep (SIGSTOP, the
//! default sleep hook) a waiting low-priority job runs on its GPUs, and a
//! high-priority job may not. The loan survives a host killed with SIGKILL.
//! On wake the borrower gets its checkpoint notice and stops, and only then
//! is the replica woken: no sample ever sees both running on a GPU.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth::proto as pb;

use crate::agent::{agent, agent_job, dir, free_port, jobs, kill9, serve, task_asleep, until, BERTH};

/// The state letter of a process in /proc (T: stopped).
fn proc_state(pid: u32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("gone").to_string()
}

/// `berth sleep|wake JOB` through the CLI as the operator.
fn cli(url: &str, action: &str, job: u64) -> String {
    let out = Command::new(BERTH).args([action, &job.to_string(), "--server", url, "--token", "ops-test-token"]).output().unwrap();
    assert!(out.status.success(), "berth {action}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn job(js: &[pb::Job], id: u64) -> pb::Job {
    js.iter().find(|j| j.id == id).cloned().unwrap_or_else(|| panic!("no job {id} in {js:?}"))
}

/// GPUs used by two processes that run (a sleeping one uses none).
pub(crate) fn shared_gpus(js: &[pb::Job]) -> Option<String> {
    let mut owners: std::collections::BTreeMap<(String, u32), u64> = Default::default();
    for j in js {
        for r in j.runs.iter().filter(|r| matches!(r.state.as_str(), "starting" | "running")) {
            for &g in &r.gpus {
                if let Some(other) = owners.insert((r.node.clone(), g), j.id) {
                    return Some(format!("GPU {g} of {} run by jobs {other} and {}", r.node, j.id));
                }
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_replica_lends_its_gpus_to_low_priority_work_and_gets_them_back_on_wake() {
    let d = dir("harvest");
    let state = d.join("state");
    let listen = format!("127.0.0.1:{}", free_port());
    let extra = ["--listen", listen.as_str(), "--agent-timeout-ms", "3000", "--notice-s", "1"];
    let (mut host, url) = serve(&d, "serve1", &state, &extra).await;
    let hook = format!("echo $BERTH_ALLOCATION > {}/ckpt-$BERTH_ALLOCATION", d.display());
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--checkpoint-hook", &hook]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let schedulable = |api: &berth::client::Client| {
        let api = api.clone();
        until("n1 schedulable", Duration::from_secs(60), move || {
            let mut api = api.clone();
            async move { api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes.into_iter().find(|n| n.name == "n1" && n.schedulable) }
        })
    };
    schedulable(&api).await;

    // The replica: high priority, the whole node.
    let mut replica = agent_job(&d, 4, 1);
    replica.priority = 5;
    let r = api.submit_job(pb::SubmitJobRequest { job: Some(replica), ..Default::default() }).await.unwrap().into_inner().job_id;
    let up = |api: &berth::client::Client, what: &'static str, f: fn(&pb::Job) -> bool, id: u64| {
        let api = api.clone();
        until(what, Duration::from_secs(60), move || {
            let api = api.clone();
            async move { jobs(&api).await.into_iter().find(|j| j.id == id && f(j)) }
        })
    };
    let awake = |j: &pb::Job| j.state == "running" && j.sleep == "awake" && !j.runs.is_empty() && j.runs.iter().all(|r| r.state == "running");
    let rj = up(&api, "the replica running", awake, r).await;
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let allocs = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner().allocations;
    let pid = allocs.iter().find(|a| a.id == rj.runs[0].allocation_id).expect("the replica's allocation").pid;

    // Low-priority work waits: no GPU is free.
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(job(&jobs(&api).await, low).state, "pending");

    // Asleep (the agent stopped its processes), its GPUs lent: the
    // low-priority job runs on them.
    let said = cli(&url, "sleep", r);
    assert!(said.contains(&format!("job {r}: ")) && (said.contains("asked to sleep") || said.contains("asleep")), "{said}");
    let asleep = |j: &pb::Job| j.sleep == "asleep" && j.runs.iter().all(|r| r.state == "sleeping");
    up(&api, "the replica asleep", asleep, r).await;
    assert!(task_asleep(pid), "the replica's process is neither frozen nor stopped");
    let borrower = up(&api, "the borrower running on lent GPUs", awake, low).await;
    assert!(borrower.runs[0].gpus.iter().all(|g| rj.runs[0].gpus.contains(g)), "{borrower:?}");
    assert_eq!(shared_gpus(&jobs(&api).await), None);
    // A harvested replica is not woken behind the engine's back: a direct
    // wake would run it beside the borrower of its GPUs.
    let direct = pb::ControlAllocationRequest { allocation_id: rj.runs[0].allocation_id, action: "wake".into() };
    let e = hub.control_allocation(direct).await.unwrap_err();
    assert!(e.code() == tonic::Code::FailedPrecondition && e.message().contains("harvest schedule"), "{e:?}");
    assert!(task_asleep(pid), "the replica stays asleep");

    // Lent GPUs are for low-priority work only: a high-priority job waits
    // (and takes nothing back from the borrower either).
    let mut high = agent_job(&d, 1, 1);
    high.priority = 5;
    let h = api.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let js = jobs(&api).await;
    assert_eq!(job(&js, h).state, "pending", "{:?}", job(&js, h));
    assert_eq!(job(&js, low).state, "running");
    let why = api.explain_job(pb::ExplainJobRequest { job_id: h, ..Default::default() }).await.unwrap().into_inner();
    assert!(why.summary.contains("1 nodes: GPUs lent by a sleeping job"), "{why:?}");
    api.cancel_job(pb::CancelJobRequest { job_id: h }).await.unwrap();

    // The loan is durable: a host killed with SIGKILL comes back on its
    // store with the replica asleep and the borrower on its GPUs.
    kill9(&mut host);
    let (mut _host, url2) = serve(&d, "serve2", &state, &extra).await;
    assert_eq!(url2, url);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let js = jobs(&api).await;
    assert_eq!(job(&js, r).sleep, "asleep", "{:?}", job(&js, r));
    assert_eq!(job(&js, low).state, "running");
    schedulable(&api).await;

    // Wake: the borrower gets its checkpoint notice and stops; the replica
    // is woken once its process is gone. A watcher samples the jobs all along.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let watcher = {
        let (api, stop, seen) = (api.clone(), stop.clone(), seen.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let Some(clash) = shared_gpus(&jobs(&api).await) {
                    seen.lock().unwrap().push(clash);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let said = cli(&url, "wake", r);
    assert!(said.contains(&format!("job {r}: waking")), "{said}");
    up(&api, "the replica awake again", awake, r).await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    assert_eq!(*seen.lock().unwrap(), Vec::<String>::new(), "a GPU had two running users during the wake");
    assert!(!task_asleep(pid), "the replica's process is still asleep");
    let js = jobs(&api).await;
    let l = job(&js, low);
    assert_eq!(l.state, "pending", "{l:?}");
    assert!(l.detail.contains(&format!("job {r} wakes")), "{l:?}");
    let alloc = borrower.runs[0].allocation_id;
    let noted = std::fs::read_to_string(d.join(format!("ckpt-{alloc}"))).unwrap_or_default();
    assert_eq!(noted.trim(), alloc.to_string(), "no checkpoint notice for the borrower");

    // The decision log has the harvest: asleep, waking, the borrower taken back.
    let log = api.query_decisions(pb::QueryDecisionsRequest { partition: "p0".into(), limit: 1000, ..Default::default() }).await.unwrap().into_inner().decisions;
    let harvest: Vec<(u64, String)> = log.iter().filter(|d| d.arm == "harvest").map(|d| (d.job_id, d.outcome.clone())).collect();
    for want in [(r, "asleep"), (r, "waking"), (low, "evicted")] {
        assert!(harvest.iter().any(|(j, o)| *j == want.0 && o == want.1), "no {want:?} in {harvest:?}");
    }

    // A replica that is not asleep cannot be woken; nothing is left running.
    let e = api.wake_job(pb::SleepJobRequest { job_id: r }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    api.cancel_job(pb::CancelJobRequest { job_id: low }).await.unwrap();
    std::fs::write(d.join(format!("release-{r}")), "0").unwrap();
    up(&api, "the replica finished", |j| j.state == "finished", r).await;
    // Both host lives (the first killed with SIGKILL) replay exactly: the
    // sleep, the loan, the restart's recovery, the wake and its eviction.
    let (_, report) = crate::capture::replays_exactly(&d, &url, &state, 4);
    assert_eq!(report.lines().filter(|l| l.starts_with("segment ") && l.contains("(100%)")).count(), 2, "{report}");
}

/// Found by the simulation test: a replica cancelled while asleep was
/// stopped with SIGTERM and continued (SIGCONT) to act on it, back onto
/// GPUs lent to a borrower; and its stored record said awake, so a restart
/// fenced GPUs the borrower held. Now the frozen process is killed where it
/// stands (SIGKILL, never seen running again) while the borrower runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cancelled_asleep_is_killed_frozen_not_woken_onto_its_lent_gpus() {
    let d = dir("harvest-cancel");
    let listen = format!("127.0.0.1:{}", free_port());
    let extra = ["--listen", listen.as_str(), "--agent-timeout-ms", "3000", "--notice-s", "1"];
    let (_host, url) = serve(&d, "serve", &d.join("state"), &extra).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let find = |api: &berth::client::Client, what: &'static str, f: fn(&pb::Job) -> bool, id: u64| {
        let api = api.clone();
        until(what, Duration::from_secs(60), move || {
            let api = api.clone();
            async move { jobs(&api).await.into_iter().find(|j| j.id == id && f(j)) }
        })
    };
    // The replica beats while it runs and notes a SIGTERM it acts on: either
    // after the freeze means it ran again on GPUs it had lent.
    let (beats, termed) = (d.join("beats"), d.join("termed"));
    let script = format!(
        "trap 'echo term > {}; exit 3' TERM; while :; do echo beat >> {}; sleep 0.02; done",
        termed.display(),
        beats.display()
    );
    let mut replica = agent_job(&d, 4, 1);
    replica.priority = 5;
    replica.argv = vec!["sh".into(), "-c".into(), script];
    let r = api.submit_job(pb::SubmitJobRequest { job: Some(replica), ..Default::default() }).await.unwrap().into_inner().job_id;
    let awake = |j: &pb::Job| j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|r| r.state == "running");
    let rj = find(&api, "the replica running", awake, r).await;
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let allocs = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner().allocations;
    let pid = allocs.iter().find(|a| a.id == rj.runs[0].allocation_id).expect("the replica's allocation").pid;
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    cli(&url, "sleep", r);
    find(&api, "the borrower running on lent GPUs", awake, low).await;
    assert!(task_asleep(pid), "the replica's process is frozen");
    let beats_frozen = std::fs::read_to_string(&beats).unwrap().lines().count();
    assert!(beats_frozen > 0, "the replica never beat");

    api.cancel_job(pb::CancelJobRequest { job_id: r }).await.unwrap();
    // The process state is no witness here: a stopped task woken by SIGKILL
    // shows "R" while it exits. What it did is: no beat, no SIGTERM handled.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !matches!(proc_state(pid).as_str(), "gone" | "Z") {
        assert!(std::time::Instant::now() < deadline, "the cancelled replica's process {pid} still exists after 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!termed.exists(), "the frozen replica was continued and acted on SIGTERM");
    let beats_after = std::fs::read_to_string(&beats).unwrap().lines().count();
    assert_eq!(beats_after, beats_frozen, "the frozen replica ran again before it was gone");
    let ended = find(&api, "the replica's task gone", |j| j.runs.iter().all(|r| r.state != "sleeping" && r.state != "running"), r).await;
    assert_eq!(ended.state, "cancelled", "{ended:?}");
    assert_eq!(ended.runs[0].signal, libc::SIGKILL, "killed where it stood: {ended:?}");
    assert_eq!(ended.sleep, "awake", "a job with no process left has none asleep: {ended:?}");
    let js = jobs(&api).await;
    assert_eq!(job(&js, low).state, "running", "the borrower runs on: {:?}", job(&js, low));
    assert_eq!(shared_gpus(&js), None);
}

/// The harvest schedule of `berth serve --harvest 2-3:1`, on a clock moved
/// by hand: at 02:00 the running `sleepable` job sleeps (a job without
/// processes sleeps at once) and a waiting low-priority job takes its GPUs;
/// a job not marked sleepable stays awake; at 03:00 it wakes and the
/// borrower is taken back.
#[test]
fn the_harvest_schedule_puts_sleepable_jobs_to_sleep_in_the_trough_and_wakes_them() {
    use berth::serve::clock::ManualClock;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = crate::serve::state_dir("harvest-schedule");
    let day = 20_000 * 86_400u64;
    let clock = Arc::new(ManualClock::at((day + 2 * 3600 - 10) * 1000));
    let mut cfg = crate::serve::config(&dir, crate::agent::ACCESS);
    cfg.scheduling.clock = clock.clone();
    cfg.scheduling.harvest = Some(berth::asi::preempt::parse_harvest("2-3:1").unwrap());
    let h = rt.block_on(berth::serve::start(cfg)).unwrap();
    let api = rt.block_on(crate::serve::client(&h, "ops-test-token"));
    let submit = |gpus: u32, priority: u32, sleepable: bool| {
        // One partition of 32 eight-GPU nodes: 32 whole-node jobs fill it.
        let spec = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus, gpu_milli: 1000, cpu_milli: 1000, memory_mib: 1024, priority, duration_s: 36_000.0, sleepable, ..Default::default() };
        rt.block_on(api.clone().submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() })).unwrap().into_inner().job_id
    };
    let replica = submit(8, 5, true);
    let others: Vec<u64> = (0..31).map(|_| submit(8, 5, false)).collect();
    let low = submit(8, 0, false);
    let state = |id: u64| {
        let js = rt.block_on(jobs(&api));
        let j = job(&js, id);
        (j.state, j.sleep)
    };
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let started = std::time::Instant::now();
        while !f() {
            assert!(started.elapsed() < Duration::from_secs(30), "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for("the partition full", &|| state(replica).0 == "running" && others.iter().all(|&o| state(o).0 == "running"));
    assert_eq!(state(low).0, "pending");
    clock.set((day + 2 * 3600 + 1) * 1000);
    wait_for("the replica asleep at 02:00", &|| state(replica).1 == "asleep");
    wait_for("the low-priority job on its GPUs", &|| state(low).0 == "running");
    assert!(others.iter().all(|&o| state(o).1 == "awake"), "a job not marked sleepable slept");
    clock.set((day + 3 * 3600 + 1) * 1000);
    wait_for("the replica awake at 03:00", &|| state(replica).1 == "awake");
    let js = rt.block_on(jobs(&api));
    let l = job(&js, low);
    assert_eq!(l.state, "pending", "{l:?}");
    assert!(l.detail.contains(&format!("job {replica} wakes")), "{l:?}");
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sleeping replica whose GPU memory is still held lends nothing: its
/// task declares 40 GiB on each GPU (the synthetic agent's stand-in for
/// NVML), so once asleep its agent reports the memory and the host keeps
/// its GPUs from a borrower; a replica whose sleep released it (below
/// --lend-max-memory-mib) lends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_replica_that_still_holds_gpu_memory_lends_nothing() {
    let d = dir("harvest-memory");
    let (_host, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "1"]).await;
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let until_job = |api: &berth::client::Client, what: &'static str, id: u64, f: fn(&pb::Job) -> bool| {
        let api = api.clone();
        until(what, Duration::from_secs(60), move || {
            let api = api.clone();
            async move { jobs(&api).await.into_iter().find(|j| j.id == id && f(j)) }
        })
    };
    // Two replicas, one GPU each: one keeps 40 GiB resident, one releases
    // everything but a 300 MiB context.
    let mut ids = Vec::new();
    for mib in [40_960, 300] {
        let mut replica = agent_job(&d, 1, 1);
        replica.priority = 5;
        replica.argv = vec!["sh".into(), "-c".into(), format!("echo {mib} > $BERTH_GPU_MEMORY; sleep 600")];
        ids.push(api.submit_job(pb::SubmitJobRequest { job: Some(replica), ..Default::default() }).await.unwrap().into_inner().job_id);
    }
    let (held, released) = (ids[0], ids[1]);
    for &id in &ids {
        until_job(&api, "a replica running", id, |j| j.state == "running" && j.runs.iter().all(|r| r.state == "running")).await;
    }
    // Its memory declared before it sleeps (the task wrote it at start).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let low = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;

    cli(&url, "sleep", held);
    let refused = until_job(&api, "the holding replica's tasks asleep", held, |j| j.runs.iter().all(|r| r.state == "sleeping") && j.runs[0].state == "sleeping").await;
    let why = until("the refusal said", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            let e = api.explain_job(pb::ExplainJobRequest { job_id: held, ..Default::default() }).await.ok()?.into_inner();
            e.last_decision.contains("GPUs not lent").then_some(e.last_decision)
        }
    })
    .await;
    assert!(why.contains("40960 MiB"), "{why}");
    assert_ne!(refused.sleep, "asleep", "the replica counts as asleep with its memory held: {refused:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let js = jobs(&api).await;
    assert_eq!(job(&js, low).state, "pending", "a borrower started beside GPU memory still held: {:?}", job(&js, low));

    // The other replica's sleep released its memory: its GPU is lent.
    cli(&url, "sleep", released);
    until_job(&api, "the releasing replica asleep", released, |j| j.sleep == "asleep").await;
    let borrower = until_job(&api, "the borrower on the lent GPU", low, |j| j.state == "running").await;
    let lent = job(&jobs(&api).await, released).runs[0].gpus.clone();
    assert_eq!(borrower.runs[0].gpus, lent, "{borrower:?}");
    assert_eq!(shared_gpus(&jobs(&api).await), None);
    for id in [low, held, released] {
        api.cancel_job(pb::CancelJobRequest { job_id: id }).await.unwrap();
    }
    // Their processes gone (a frozen one is killed where it stands), so
    // nothing outlives the test.
    until("the replicas' and the borrower's processes gone", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().all(|j| j.runs.iter().all(|r| !matches!(r.state.as_str(), "starting" | "running" | "sleeping"))).then_some(()) }
    })
    .await;
}
