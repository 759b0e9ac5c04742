//! A task gets what it asked for on its node and no more, checked against
//! the process table and the kernel's own counters: a real `berth serve`
//! and a real agent with cgroups; a task asking for one core runs two busy
//! loops and uses one core; a task over its memory limit is killed alone
//! and reported as such (`berth jobs`, `berth explain`); its neighbour runs
//! on; the agent reports the node's pressure and each task's use.

use std::path::Path;
use std::time::{Duration, Instant};

use berth::proto as pb;

use crate::agent::{agent, descendants, dir, jobs, serve, until_logged, BERTH};

/// CPU time (user + system, seconds) of processes `pids` now.
fn cpu_seconds(pids: &[u32]) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    pids.iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
            // After the name: state is field 0, utime 11, stime 12.
            let num = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            (num(11) + num(12)) / ticks
        })
        .sum()
}

/// The CPUs this process may use.
fn own_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cli(url: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(BERTH).args(args).env("BERTH_SERVER", url).env("BERTH_TOKEN", "ops-test-token").output().unwrap();
    assert!(out.status.success(), "berth {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn job(argv: &str, cores: u32, memory_mib: u64) -> pb::SubmitJobRequest {
    let spec = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 1, cpu_milli: cores * 1000, memory_mib, argv: vec!["sh".into(), "-c".into(), argv.into()], ..Default::default() };
    pb::SubmitJobRequest { job: Some(spec), ..Default::default() }
}

/// The supervisor of job `id`'s first task, once it runs.
async fn task_pid(d: &Path, api: &berth::client::Client, hub: &berth::agent::HubClient, id: u64) -> u32 {
    until_logged(d, &format!("job {id}'s task running"), Duration::from_secs(60), || {
        let (mut hub, api) = (hub.clone(), api.clone());
        async move {
            let alloc = jobs(&api).await.into_iter().find(|j| j.id == id)?.runs.first()?.allocation_id;
            let allocs = hub.list_agents(pb::ListAgentsRequest::default()).await.ok()?.into_inner().allocations;
            allocs.into_iter().find(|a| a.id == alloc && a.state == "running" && a.pid != 0).map(|a| a.pid)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_gets_the_cores_and_memory_it_asked_for_and_an_oom_kill_is_its_own() {
    if own_cpus() < 2 {
        crate::common::skip("fewer than 2 CPUs: a one-core limit cannot be told from the machine's");
        return;
    }
    // It measures how much CPU a hog gets: not while another test loads the
    // CPUs on purpose (a clean-clone CI run saw 0.24 cores beside one).
    let _cpu = crate::common::cpu_measuring();
    let d = dir("isolation");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--metrics-listen", "127.0.0.1:0"]).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let node = until_logged(&d, "n1 registered", Duration::from_secs(60), || {
        let mut hub = hub.clone();
        async move { hub.list_agents(pb::ListAgentsRequest::default()).await.ok()?.into_inner().agents.into_iter().find(|a| a.node == "n1") }
    })
    .await;
    if !node.isolation.starts_with("cgroup") {
        crate::common::skip(&format!("the agent has no cgroups here ({}): nothing enforces a task's memory", node.isolation));
        return;
    }

    // One core asked for, two busy loops run: the kernel holds it to one.
    let hog = api.submit_job(job("while :; do :; done & while :; do :; done", 1, 1024)).await.unwrap().into_inner().job_id;
    let neighbour = api.submit_job(job("sleep 600", 1, 1024)).await.unwrap().into_inner().job_id;
    let hog_pid = task_pid(&d, &api, &hub, hog).await;
    let neighbour_pid = task_pid(&d, &api, &hub, neighbour).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loops = descendants(hog_pid);
    // Tasks outlive a killed agent by design: a failure below must not
    // leave the hog spinning under the tests after it.
    let _reaper = Reaper(loops.iter().copied().chain([hog_pid]).collect());
    assert!(loops.len() >= 2, "the hog's loops are not running: {loops:?}");
    let (t0, c0) = (Instant::now(), cpu_seconds(&loops));
    tokio::time::sleep(Duration::from_secs(4)).await;
    let cores = (cpu_seconds(&loops) - c0) / t0.elapsed().as_secs_f64();
    assert!(cores <= 1.15, "a task asking for 1 core used {cores:.2} cores (measured in the process table)");
    assert!(cores >= 0.3, "the hog barely ran ({cores:.2} cores): the measurement says nothing");

    // The host has the kernel's view of it: throttled, about a core.
    let run = until_logged(&d, "the hog's usage reported, throttled", Duration::from_secs(30), || {
        let api = api.clone();
        async move {
            let r = jobs(&api).await.into_iter().find(|j| j.id == hog)?.runs.first()?.clone();
            let throttled = r.usage.as_ref().is_some_and(|u| u.nr_throttled > 0 && u.cpu_milli > 0);
            throttled.then_some(r)
        }
    })
    .await;
    let u = run.usage.unwrap();
    assert!(u.cpu_milli <= 1150, "reported {} thousandths of a core for a one-core task", u.cpu_milli);
    let beat = until_logged(&d, "the node's contention reported", Duration::from_secs(30), || {
        let mut hub = hub.clone();
        async move {
            let a = hub.list_agents(pb::ListAgentsRequest::default()).await.ok()?.into_inner().agents.into_iter().find(|a| a.node == "n1")?;
            a.contention.filter(|c| c.tasks_cpu_milli >= 500)
        }
    })
    .await;
    if Path::new("/proc/pressure/cpu").exists() {
        assert!(beat.cpu.is_some(), "the node's CPU pressure is missing: {beat:?}");
    }
    let explain = cli(&url, &["explain", &hog.to_string()]);
    assert!(explain.contains("held back") && explain.contains("of 1.00 cores"), "explain shows no usage:\n{explain}");

    // Over its memory: killed by the kernel, alone, and said so.
    let greedy = api.submit_job(job("head -c 3000000000 /dev/zero | tail > /dev/null", 1, 256)).await.unwrap().into_inner().job_id;
    let failed = until_logged(&d, "the greedy job failed", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == greedy && j.state == "failed") }
    })
    .await;
    assert_eq!(failed.runs[0].limit, "oom", "the run is not marked OOM: {:?}", failed.runs[0]);
    let listed = cli(&url, &["jobs", "--partition", "p0"]);
    let line = listed.lines().find(|l| l.split_whitespace().next() == Some(&greedy.to_string())).unwrap();
    assert!(line.contains("over its memory limit"), "berth jobs does not say why:\n{listed}");
    let explain = cli(&url, &["explain", &greedy.to_string()]);
    assert!(explain.contains("killed by the kernel over its memory limit"), "explain does not say why:\n{explain}");
    assert!(crate::agent::alive(neighbour_pid), "the neighbour died with the greedy task");
    assert!(descendants(neighbour_pid).iter().any(|&p| crate::agent::alive(p)), "the neighbour's process is gone");
    let running: Vec<u64> = jobs(&api).await.into_iter().filter(|j| j.state == "running").map(|j| j.id).collect();
    assert!(running.contains(&neighbour) && running.contains(&hog), "the other jobs stopped: {running:?}");
    let text = scrape(&d).await;
    assert!(text.contains("berth_task_oom_kills_total{partition=\"p0\"} 1"), "no OOM kill counted:\n{text}");
    assert!(text.contains("berth_node_task_cores{node=\"n1\",partition=\"p0\",tasks=\"all\"}"), "no node task cores:\n{text}");

    for id in [hog, neighbour] {
        api.cancel_job(pb::CancelJobRequest { job_id: id }).await.unwrap();
    }
    until_logged(&d, "the loops and the neighbour stopped", Duration::from_secs(30), || {
        let gone = loops.iter().chain([&neighbour_pid]).all(|&p| !crate::agent::alive(p));
        async move { gone.then_some(()) }
    })
    .await;
}

/// The host's /metrics (its address from the log line "metrics on ...").
async fn scrape(d: &Path) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let log = std::fs::read_to_string(d.join("serve.log")).unwrap();
    let addr = log.split("metrics on http://").nth(1).and_then(|r| r.split('/').next()).expect("the metrics address in the log").to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The CPU list a process may run on (/proc/PID/status).
fn allowed_cpus(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap_or("").trim().to_string()
}

/// Two agents on one machine given disjoint CPU lists are two nodes for
/// CPU purposes: each offers its CPUs' cores, and its tasks run on its
/// CPUs only, with cgroups (a cpuset) or, asked for, affinity alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_one_machine_split_its_cpus_and_their_tasks_stay_on_them() {
    if own_cpus() < 2 {
        crate::common::skip("fewer than 2 CPUs: nothing to split");
        return;
    }
    let d = dir("cpu-split");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &[]).await;
    let _n1 = agent(&d, &url, "n1", "1xH20", &["--cpus", "0"]);
    let _n2 = agent(&d, &url, "n2", "1xH20", &["--cpus", "1", "--isolation", "affinity"]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let agents = until_logged(&d, "both agents registered", Duration::from_secs(60), || {
        let mut hub = hub.clone();
        async move {
            let agents = hub.list_agents(pb::ListAgentsRequest::default()).await.ok()?.into_inner().agents;
            (agents.len() == 2).then_some(agents)
        }
    })
    .await;
    let by_node = |n: &str| agents.iter().find(|a| a.node == n).unwrap().clone();
    assert_eq!((by_node("n1").cpus.as_str(), by_node("n2").cpus.as_str()), ("0", "1"));
    assert_eq!(by_node("n2").isolation, "affinity");
    for n in ["n1", "n2"] {
        let info = until_logged(&d, &format!("{n} in the fleet"), Duration::from_secs(30), || {
            let api = api.clone();
            async move { crate::agent::node_info(&api, n).await }
        })
        .await;
        assert_eq!(info.cpu_total_milli, 1000, "{n} offers the cores of its CPU list");
    }
    let a = api.submit_job(job("sleep 600", 1, 512)).await.unwrap().into_inner().job_id;
    let b = api.submit_job(job("sleep 600", 1, 512)).await.unwrap().into_inner().job_id;
    for id in [a, b] {
        let pid = task_pid(&d, &api, &hub, id).await;
        let node = jobs(&api).await.into_iter().find(|j| j.id == id).unwrap().runs[0].node.clone();
        let want = if node == "n1" { "0" } else { "1" };
        // The task once it runs its own program (between fork and exec the
        // child is still the supervisor's image, not yet confined).
        let task = until_logged(&d, "the task's process", Duration::from_secs(10), || {
            let below = descendants(pid).into_iter().find(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() != "berth"));
            async move { below }
        })
        .await;
        assert_eq!(allowed_cpus(task), want, "job {id}'s task on {node} runs on CPUs {} (its node has {want})", allowed_cpus(task));
    }
    for id in [a, b] {
        api.cancel_job(pb::CancelJobRequest { job_id: id }).await.unwrap();
    }
    until_logged(&d, "both tasks stopped", Duration::from_secs(30), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().all(|j| j.runs.iter().all(|r| !matches!(r.state.as_str(), "starting" | "running"))).then_some(()) }
    })
    .await;
}

/// Kills the processes it names when dropped (a test that fails midway
/// leaves nothing running). Emptied once they are known gone, so no reused
/// pid is hit.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: kill has no memory preconditions; a pid gone (or
            // reused after its exit was waited for) is the worst case, and
            // these were the test's own tasks a moment ago.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// Work units a task has written to `file` (its counter), 0 before the
/// first. The task rewrites the file in place: a read between its truncate
/// and its write finds it empty, so such a read is taken again.
fn counted(file: &Path) -> f64 {
    for _ in 0..1000 {
        if let Some(n) = std::fs::read_to_string(file).ok().and_then(|t| t.trim().parse::<f64>().ok()) {
            return n;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    0.0
}

/// Work units per second of the counter in `file`: the best of eight
/// half-second windows. Other tests share the machine and only ever slow
/// the task; the best window is its rate when they let it be, while a
/// neighbour on its own CPU holds every window down.
async fn rate(file: &Path) -> f64 {
    let mut best = 0.0f64;
    for _ in 0..8 {
        let (c0, t0) = (counted(file), Instant::now());
        tokio::time::sleep(Duration::from_millis(500)).await;
        best = best.max((counted(file) - c0) / t0.elapsed().as_secs_f64());
    }
    best
}

/// One run of the interference scenario under placement policy `policy`:
/// two agents pinned to one CPU each (affinity only, no CPU quota, four
/// cores declared: requests may share a CPU), a training task counting its
/// work, then a CPU-only busy loop submitted. Returns the training task's
/// rate after the hog started over its rate before, and the CPUs the
/// training task and the hog may run on (from the process table).
async fn training_beside_a_hog(policy: &str) -> (f64, (String, String)) {
    let d = dir(&format!("interference-{policy}"));
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--default-policy", policy]).await;
    let common = ["--isolation", "affinity", "--cpu-cores", "4"];
    let _n1 = agent(&d, &url, "n1", "2xH20", &[&["--cpus", "0"][..], &common].concat());
    let _n2 = agent(&d, &url, "n2", "2xH20", &[&["--cpus", "1"][..], &common].concat());
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    until_logged(&d, "both agents registered", Duration::from_secs(60), || {
        let mut hub = hub.clone();
        async move { (hub.list_agents(pb::ListAgentsRequest::default()).await.ok()?.into_inner().agents.len() == 2).then_some(()) }
    })
    .await;
    let counter = d.join("work");
    let count = format!("i=0; while :; do i=$((i+1)); if [ $((i % 500)) -eq 0 ]; then echo $i > {}; fi; done", counter.display());
    // Each under `timeout`: tasks outlive a killed agent (it adopts them
    // when it comes back), and these spin; nothing may be left spinning on
    // a machine other tests share, whatever happens here. (--foreground:
    // in its own process group a stop on an agent without cgroups, which
    // signals the task's group, would not reach it.)
    let submit = |script: String, gpus: u32, class: &str| pb::SubmitJobRequest {
        job: Some(pb::JobSpec {
            partition: "p0".into(),
            tasks: 1,
            gpus,
            cpu_milli: 1000,
            memory_mib: 256,
            class: class.into(),
            argv: vec!["timeout".into(), "--foreground".into(), "90".into(), "sh".into(), "-c".into(), script],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut reaper = Reaper(Vec::new());
    let training = api.submit_job(submit(count, 1, "training")).await.unwrap().into_inner().job_id;
    let training_supervisor = task_pid(&d, &api, &hub, training).await;
    reaper.0.extend(descendants(training_supervisor));
    until_logged(&d, "the training task counting", Duration::from_secs(30), || async { (counted(&counter) > 0.0).then_some(()) }).await;
    let alone = rate(&counter).await;
    let hog = api.submit_job(submit("while :; do :; done".into(), 0, "cpu-only")).await.unwrap().into_inner().job_id;
    let hog_supervisor = task_pid(&d, &api, &hub, hog).await;
    reaper.0.extend(descendants(hog_supervisor));
    // The hog's first half second is its start (fork, exec, placement).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let beside = rate(&counter).await;
    // Read once both run their own programs (between fork and exec a child
    // is its supervisor's image, not yet pinned).
    let cpus_of = |supervisor: u32| descendants(supervisor).last().map(|&p| allowed_cpus(p)).unwrap_or_default();
    let (training_cpus, hog_cpus) = (cpus_of(training_supervisor), cpus_of(hog_supervisor));
    let all = jobs(&api).await;
    let node_of = |id: u64| all.iter().find(|j| j.id == id).and_then(|j| j.runs.first()).map(|r| r.node.clone()).unwrap();
    let shared = node_of(training) == node_of(hog);
    let class_of = |id: u64| all.iter().find(|j| j.id == id).and_then(|j| j.spec.as_ref()).map(|s| s.class.clone()).unwrap();
    assert_eq!((class_of(training).as_str(), class_of(hog).as_str()), ("training", "cpu-only"), "each job shows the class it declared");
    eprintln!("{policy}: training {alone:.0} units/s alone, {beside:.0} with the hog started ({:.2}); the hog on {} ({})", beside / alone, node_of(hog), if shared { "shared" } else { "apart" });
    for id in [training, hog] {
        api.cancel_job(pb::CancelJobRequest { job_id: id }).await.unwrap();
    }
    // Their processes gone before the agents are: a cancel is a stop.
    until_logged(&d, "both tasks stopped", Duration::from_secs(30), || {
        let gone = !reaper.0.iter().any(|&p| crate::agent::alive(p));
        async move { gone.then_some(()) }
    })
    .await;
    // Gone: their pids may be reused from now on.
    reaper.0.clear();
    assert_eq!(shared, training_cpus == hog_cpus, "{policy}: the nodes ({shared}) and the CPUs ({training_cpus}, {hog_cpus}) disagree");
    (beside / alone, (training_cpus, hog_cpus))
}

/// The acceptance, live: the interference-aware policy keeps a
/// CPU-only hog off the node of a training task (whose rate then holds),
/// where best-fit puts it beside it (and the training task loses a measured
/// share). Rates come from the task's own counter; nodes from the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_interference_aware_policy_keeps_a_cpu_hog_off_a_training_node() {
    if own_cpus() < 2 {
        crate::common::skip("fewer than 2 CPUs: two agents cannot each have one");
        return;
    }
    let _cpu = crate::common::cpu_measuring();
    let (naive, naive_cpus) = training_beside_a_hog("best-fit").await;
    let (aware, aware_cpus) = training_beside_a_hog("interference-aware").await;
    // Physical truth: where the two processes may run.
    assert_eq!(naive_cpus.0, naive_cpus.1, "best-fit packs the hog beside the training task, on its CPU (the naive case)");
    assert_ne!(aware_cpus.0, aware_cpus.1, "the interference-aware policy puts the hog on the other node's CPU");
    // One CPU shared by two busy processes: about half each (the bound
    // leaves room for a loaded machine). Apart, the rate is reported, not
    // asserted: on a 2-CPU machine shared with other tests a hog on one CPU
    // pushes everything else onto the other, the training task's (two
    // clean-clone CI runs read 0.55 and 0.58 there; alone it keeps
    // 0.97-1.03).
    assert!(naive < 0.75, "beside the hog the training task keeps {naive:.2} of its rate");
    eprintln!("training rate kept: {naive:.2} beside the hog (best-fit), {aware:.2} apart (interference-aware)");
}
