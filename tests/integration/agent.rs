//! `berth agent` as real processes: the no-driver line and synthetic
//! discovery; a real `berth serve` with two synthetic agents on loopback,
//! children that receive exactly their GPUs, sleep/wake/checkpoint/stop,
//! an XID event taking a GPU out, and a SIGKILLed agent marked unreachable.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use berth::proto as pb;
use tonic::Code;

use crate::common::repo_root;

pub(crate) const BERTH: &str = env!("CARGO_BIN_EXE_berth");

pub(crate) const ACCESS: &str = r#"
[[identities]]
name = "ops"
token = "ops-test-token"
roles = { "*" = "operator" }

[[identities]]
name = "watcher"
token = "watcher-test-token"
roles = { "*" = "viewer" }

[[identities]]
name = "alice"
token = "alice-test-token"
roles = { "*" = "viewer", "p0" = "tenant" }

[[identities]]
name = "carol"
token = "carol-test-token"
roles = { "*" = "viewer", "p1" = "tenant" }

[[identities]]
name = "agents"
token = "agent-test-token"
roles = { "p0" = "agent", "p1" = "agent" }
nodes = ["*"]

[[identities]]
name = "n1-agent"
token = "n1-agent-test-token"
roles = { "p0" = "agent" }
nodes = ["n1"]
"#;

/// The agents' token file in `d` (an identity with the agent role).
pub(crate) fn agent_token_file(d: &Path) -> String {
    let path = d.join("agent-token");
    if !path.exists() {
        std::fs::write(&path, "agent-test-token\n").unwrap();
    }
    path.display().to_string()
}

/// Kills (SIGKILL) and reaps the process when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn dir(name: &str) -> PathBuf {
    let d = repo_root().join("target").join("tmp").join(format!("agent-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub(crate) fn spawn(args: &[&str], log: &Path) -> Proc {
    spawn_into(args, std::fs::File::create(log).unwrap())
}

/// `berth ARGS` from the repository root, its stderr into `log`, with no
/// token or server from the caller's environment.
fn spawn_into(args: &[&str], log: std::fs::File) -> Proc {
    let child = Command::new(BERTH)
        .args(args)
        .current_dir(repo_root())
        .env("BERTH_LOG", "info")
        .env_remove("BERTH_TOKEN")
        .env_remove("BERTH_SERVER")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawning berth");
    Proc(child)
}

/// Polls `f` until it returns Some, for at most `limit` (a liveness bound:
/// it only fails a test that would otherwise hang).
pub(crate) async fn until<T, F: std::future::Future<Output = Option<T>>>(what: &str, limit: Duration, f: impl FnMut() -> F) -> T {
    until_or(what, limit, f, String::new).await
}

/// `until`, and on a timeout the last lines of every log in `d` (the
/// hosts', agents' and etcd's), so a failure seen once in CI can be read.
pub(crate) async fn until_logged<T, F: std::future::Future<Output = Option<T>>>(d: &Path, what: &str, limit: Duration, f: impl FnMut() -> F) -> T {
    until_or(what, limit, f, || format!("\n{}", log_tails(d, 40))).await
}

/// The poll of `until`; a timeout's message ends with `context()`.
async fn until_or<T, F: std::future::Future<Output = Option<T>>>(what: &str, limit: Duration, mut f: impl FnMut() -> F, context: impl FnOnce() -> String) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= end {
            panic!("timed out waiting for {what}{}", context());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The last `lines` lines of each `*.log` in `d`, headed by its name.
pub(crate) fn log_tails(d: &Path, lines: usize) -> String {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(d).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "log")).collect();
    logs.sort();
    let mut out = String::new();
    for p in logs {
        let text = plain(&std::fs::read_to_string(&p).unwrap_or_default());
        let all: Vec<&str> = text.lines().collect();
        out += &format!("--- {} (last {} of {} lines)\n", p.display(), lines.min(all.len()), all.len());
        for l in &all[all.len().saturating_sub(lines)..] {
            out += l;
            out.push('\n');
        }
    }
    out
}

#[test]
fn once_without_a_driver_says_so_in_one_line_and_synthetic_gpus_work() {
    let out = Command::new(BERTH).args(["agent", "--once", "--json", "--node", "n0"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A machine with a driver: NVML answered.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["source"], "nvml");
    } else {
        assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr}");
        assert!(stderr.contains("no NVIDIA driver") && stderr.contains("--synthetic-gpus 8xH20"), "{stderr}");
        assert!(out.stdout.is_empty());
    }

    let out = Command::new(BERTH).args(["agent", "--once", "--json", "--node", "n7", "--synthetic-gpus", "8xH20"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["source"], "synthetic");
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g["uuid"], format!("GPU-synthetic-n7-{i}"));
        assert_eq!(g["model"], "H20");
        assert_eq!(g["memory_total_mib"], 96 * 1024);
    }
    assert_eq!(v["telemetry"].as_array().unwrap().len(), 8);

    let out = Command::new(BERTH).args(["agent", "--once", "--synthetic-gpus", "8xQ9000"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_run_children_on_their_gpus_and_a_killed_agent_becomes_unreachable() {
    let d = dir("two");
    let access = d.join("access.toml");
    std::fs::write(&access, ACCESS).unwrap();
    let serve_log = d.join("serve.log");
    let state = d.join("state");
    let _serve = spawn(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--state-dir",
            state.to_str().unwrap(),
            "--access",
            access.to_str().unwrap(),
            "--agent-timeout-ms",
            "1500",
        ],
        &serve_log,
    );
    let url = until("berth serve to listen", Duration::from_secs(120), || {
        let text = std::fs::read_to_string(&serve_log).unwrap_or_default();
        async move { text.lines().find_map(|l| l.split("API on ").nth(1).map(|r| r.split(',').next().unwrap().trim().to_string())) }
    })
    .await;

    let ckpt = d.join("checkpoint");
    let hook = format!("echo $BERTH_ALLOCATION $BERTH_PID > {}", ckpt.display());
    let token_file = agent_token_file(&d);
    let common = ["--server", &url, "--token-file", &token_file, "--partition", "p0", "--heartbeat-ms", "200"];
    let mut a1: Vec<&str> = vec!["agent", "--node", "n1", "--synthetic-gpus", "8xH20", "--checkpoint-hook", &hook, "--stop-grace-s", "2"];
    a1.extend(common);
    let mut a2: Vec<&str> = vec!["agent", "--node", "n2", "--synthetic-gpus", "4xA100", "--synthetic-xid", "3:79"];
    a2.extend(common);
    let (s1, s2) = (d.join("n1-state").display().to_string(), d.join("n2-state").display().to_string());
    a1.extend(["--state-dir", &s1]);
    a2.extend(["--state-dir", &s2]);
    let _agent1 = spawn(&a1, &d.join("n1.log"));
    let mut agent2 = spawn(&a2, &d.join("n2.log"));

    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let list = |hub: &berth::agent::HubClient| {
        let mut hub = hub.clone();
        async move { hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner() }
    };
    until("both agents registered, heartbeating, holding their command streams", Duration::from_secs(60), || {
        let l = list(&hub);
        async move {
            let l = l.await;
            (l.agents.len() == 2 && l.agents.iter().all(|a| a.state == "ready" && a.heartbeats > 0 && a.commands_connected)).then_some(())
        }
    })
    .await;

    // The Berth API lists them beside the simulated nodes.
    let mut api = berth::client::connect(&url, Some("watcher-test-token"), None, None).await.unwrap();
    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    let n1 = nodes.iter().find(|n| n.name == "n1").expect("n1 listed");
    assert_eq!((n1.source.as_str(), n1.state.as_str(), n1.model.as_str(), n1.gpus, n1.schedulable), ("agent", "ready", "H20", 8, true));
    assert!(nodes.iter().any(|n| n.name == "n2" && n.source == "agent" && n.gpus == 4));
    assert!(nodes.iter().any(|n| n.source == "simulated"));
    // A viewer may not start allocations.
    let mut viewer = berth::agent::connect_hub(&url, Some("watcher-test-token"), None).await.unwrap();
    let denied = viewer.start_allocation(pb::StartAllocationRequest { node: "n1".into(), gpus: vec![0], argv: vec!["true".into()], ..Default::default() }).await;
    assert_eq!(denied.unwrap_err().code(), Code::PermissionDenied);

    // The XID on n2's GPU 3 takes it out of the schedulable set.
    until("n2 GPU 3 unhealthy", Duration::from_secs(60), || {
        let l = list(&hub);
        async move {
            let l = l.await;
            let n2 = l.agents.iter().find(|a| a.node == "n2")?;
            (!n2.gpus[3].healthy && n2.gpus[3].unhealthy_reason.contains("79") && n2.gpus[..3].iter().all(|g| g.healthy)).then_some(())
        }
    })
    .await;
    let r = hub.start_allocation(pb::StartAllocationRequest { node: "n2".into(), gpus: vec![3], argv: vec!["true".into()], ..Default::default() }).await;
    assert_eq!(r.unwrap_err().code(), Code::FailedPrecondition);
    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.iter().find(|n| n.name == "n2").unwrap().gpus_unhealthy, 1);

    // A child on GPUs 2 and 5 of n1 sees exactly their UUIDs, and its exit code comes back.
    let out = d.join("visible");
    let script = format!("echo \"$CUDA_VISIBLE_DEVICES\" > {0}; echo \"$NVIDIA_VISIBLE_DEVICES\" >> {0}; exit 7", out.display());
    let started = hub
        .start_allocation(pb::StartAllocationRequest { node: "n1".into(), gpus: vec![2, 5], argv: vec!["sh".into(), "-c".into(), script], ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let want = "GPU-synthetic-n1-2,GPU-synthetic-n1-5";
    assert_eq!(started.gpu_uuids.join(","), want);
    let sid = started.allocation_id;
    let done = until("the child's exit", Duration::from_secs(60), || {
        let l = list(&hub);
        async move { l.await.allocations.into_iter().find(|a| a.id == sid && a.state == "exited") }
    })
    .await;
    assert_eq!((done.exit_code, done.signal), (7, 0), "{done:?}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), format!("{want}\n{want}\n"));

    // A long child: no second owner for its GPU; sleep, wake, checkpoint (hook), stop.
    let long = hub
        .start_allocation(pb::StartAllocationRequest { node: "n1".into(), gpus: vec![4], argv: vec!["sleep".into(), "600".into()], ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .allocation_id;
    let watch = hub.clone();
    let state = |want: &'static str| {
        let hub = watch.clone();
        move || {
            let l = list(&hub);
            async move { l.await.allocations.into_iter().find(|a| a.id == long && a.state == want) }
        }
    };
    let running = until("the long child running", Duration::from_secs(60), state("running")).await;
    let clash = hub.start_allocation(pb::StartAllocationRequest { node: "n1".into(), gpus: vec![3, 4], argv: vec!["true".into()], ..Default::default() }).await;
    assert_eq!(clash.unwrap_err().code(), Code::FailedPrecondition);
    let control = |action: &str| pb::ControlAllocationRequest { allocation_id: long, action: action.into() };
    hub.control_allocation(control("sleep")).await.unwrap();
    until("sleeping", Duration::from_secs(60), state("sleeping")).await;
    assert!(task_asleep(running.pid), "the child is neither frozen nor stopped");
    hub.control_allocation(control("wake")).await.unwrap();
    until("awake", Duration::from_secs(60), state("running")).await;
    hub.control_allocation(control("checkpoint")).await.unwrap();
    let noted = until("the checkpoint hook", Duration::from_secs(60), || {
        let t = std::fs::read_to_string(&ckpt).unwrap_or_default();
        async move { (!t.is_empty()).then_some(t) }
    })
    .await;
    assert_eq!(noted.trim(), format!("{long} {}", running.pid));
    hub.control_allocation(control("stop")).await.unwrap();
    let stopped = until("stopped", Duration::from_secs(60), state("exited")).await;
    assert_eq!(stopped.signal, libc::SIGTERM, "{stopped:?}");

    // kill -9 of n2's agent: after the heartbeat timeout the node is unreachable.
    agent2.0.kill().unwrap();
    agent2.0.wait().unwrap();
    until("n2 unreachable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
            let n2 = nodes.iter().find(|n| n.name == "n2")?;
            (n2.state == "unreachable" && !n2.schedulable).then_some(())
        }
    })
    .await;
    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.iter().find(|n| n.name == "n1").unwrap().state, "ready");
    let r = hub.start_allocation(pb::StartAllocationRequest { node: "n2".into(), gpus: vec![0], argv: vec!["true".into()], ..Default::default() }).await;
    assert_eq!(r.unwrap_err().code(), Code::FailedPrecondition);

    // `berth nodes` shows it too.
    let out = Command::new(BERTH).args(["nodes", "--partition", "p0", "--server", &url, "--token", "watcher-test-token"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().find(|l| l.starts_with("n2 ")).unwrap_or_else(|| panic!("no n2 in:\n{text}"));
    assert!(line.contains("agent, unreachable") && line.contains("1 GPUs unhealthy"), "{line}");
    assert!(text.lines().any(|l| l.starts_with("n1 ") && l.contains("agent, ready")), "{text}");
    drop(hub);
}

/// Starts `berth serve` on a free loopback port; returns it and its URL.
pub(crate) async fn serve(d: &Path, name: &str, state: &Path, extra: &[&str]) -> (Proc, String) {
    let access = d.join("access.toml");
    std::fs::write(&access, ACCESS).unwrap();
    let log = d.join(format!("{name}.log"));
    let mut args = vec!["serve", "--state-dir", state.to_str().unwrap(), "--access", access.to_str().unwrap()];
    if !extra.contains(&"--metrics-listen") {
        args.extend(["--metrics-listen", "off"]);
    }
    if !extra.contains(&"--listen") {
        args.extend(["--listen", "127.0.0.1:0"]);
    }
    args.extend(extra);
    let mut proc = spawn(&args, &log);
    let url = until("berth serve to listen", Duration::from_secs(120), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(status) = proc.0.try_wait().unwrap() {
            panic!("berth serve exited ({status}):\n{text}");
        }
        async move { text.lines().find_map(|l| l.split("API on ").nth(1).map(|r| r.split(',').next().unwrap().trim().to_string())) }
    })
    .await;
    (proc, url)
}

pub(crate) fn agent(d: &Path, url: &str, node: &str, shape: &str, extra: &[&str]) -> Proc {
    let state = d.join(format!("{node}-state")).display().to_string();
    let token_file = agent_token_file(d);
    let mut args = vec!["agent", "--node", node, "--synthetic-gpus", shape, "--server", url, "--token-file", &token_file, "--partition", "p0", "--heartbeat-ms", "200", "--stop-grace-s", "2", "--state-dir", &state];
    args.extend(extra);
    // Appended, so a restarted agent's log keeps the first one's.
    let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join(format!("{node}.log"))).unwrap();
    spawn_into(&args, log)
}

/// A task that writes the GPUs it sees to `vis-<job>-<allocation>`, then
/// waits for `release-<job>` and exits with the code written there (or 99
/// after two minutes: tasks outlive SIGKILLed agents by design, and must
/// not outlive a failed test for long).
pub(crate) fn task_argv(d: &Path) -> Vec<String> {
    let d = d.display();
    let script = format!(
        "echo \"$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES\" > {d}/vis-$BERTH_JOB-$BERTH_ALLOCATION; \
         i=0; while [ ! -f {d}/release-$BERTH_JOB ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done; \
         [ -f {d}/release-$BERTH_JOB ] || exit 99; exit $(cat {d}/release-$BERTH_JOB)"
    );
    vec!["sh".into(), "-c".into(), script]
}

pub(crate) fn agent_job(d: &Path, gpus: u32, tasks: u32) -> pb::JobSpec {
    pb::JobSpec { partition: "p0".into(), tasks, gpus, cpu_milli: 1000, memory_mib: 1024, argv: task_argv(d), ..Default::default() }
}

pub(crate) async fn jobs(api: &berth::client::Client) -> Vec<pb::Job> {
    api.clone().list_jobs(pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner().jobs
}

/// Every GPU held by at most one running task, none on `forbidden` GPUs.
pub(crate) fn assert_one_owner(jobs: &[pb::Job], forbidden: &[(&str, u32)]) {
    let mut owners: std::collections::BTreeMap<(String, u32), u64> = Default::default();
    for j in jobs {
        for r in j.runs.iter().filter(|r| matches!(r.state.as_str(), "starting" | "running" | "sleeping")) {
            for &g in &r.gpus {
                assert!(!forbidden.contains(&(r.node.as_str(), g)), "job {} runs on unhealthy GPU {g} of {}", j.id, r.node);
                if let Some(other) = owners.insert((r.node.clone(), g), j.id) {
                    panic!("GPU {g} of {} has two owners: jobs {other} and {}", r.node, j.id);
                }
            }
        }
    }
}

fn accounting_total(a: &pb::AccountingResponse) -> pb::Denominators {
    a.rows.iter().find(|r| r.group == "model H20").and_then(|r| r.gpus).expect("an H20 row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_argv_are_placed_on_agent_nodes_and_exits_free_their_gpus() {
    let d = dir("sched");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "1500"]).await;
    // 4 + 2 H20s; GPU 1 of n2 reports XID 79 on its third sample.
    let _n1 = agent(&d, &url, "n1", "4xH20", &[]);
    let _n2 = agent(&d, &url, "n2", "2xH20", &["--synthetic-xid", "1:79"]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    until("both agent nodes schedulable and n2 GPU 1 unhealthy", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
            let ok = |n: &str, unhealthy| nodes.iter().any(|x| x.name == n && x.schedulable && x.gpus_unhealthy == unhealthy);
            (ok("n1", 0) && ok("n2", 1)).then_some(())
        }
    })
    .await;

    // Bad input names what is wrong.
    let mut bad = agent_job(&d, 1, 1);
    bad.models = vec!["Q9000".into()];
    let e = api.submit_job(pb::SubmitJobRequest { job: Some(bad), ..Default::default() }).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().contains("Q9000") && e.message().contains("H20"), "{e:?}");
    let mut bad = agent_job(&d, 1, 1);
    bad.env.insert("A=B".into(), "x".into());
    let e = api.submit_job(pb::SubmitJobRequest { job: Some(bad), ..Default::default() }).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().contains("A=B"), "{e:?}");

    // Five healthy GPUs; 2 + 1 + 1 + 2 asked: the last waits.
    let mut a = agent_job(&d, 2, 1);
    a.models = vec!["H20".into()];
    let mut ids = Vec::new();
    for spec in [a, agent_job(&d, 1, 1), agent_job(&d, 1, 1), agent_job(&d, 2, 1)] {
        ids.push(api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap().into_inner().job_id);
    }
    // A simulated job never lands on an agent node, nor an argv job on a simulated one.
    let sim = api
        .submit_job(pb::SubmitJobRequest { job: Some(pb::JobSpec { partition: "p0".into(), gpus: 1, duration_s: 600.0, ..Default::default() }), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let running = until("three argv jobs running with their processes started", Duration::from_secs(60), || {
        let api = api.clone();
        let ids = ids.clone();
        async move {
            let js = jobs(&api).await;
            let run: Vec<pb::Job> = js.into_iter().filter(|j| ids.contains(&j.id) && j.state == "running" && j.runs.iter().all(|r| r.state == "running")).collect();
            (run.len() == 3).then_some(run)
        }
    })
    .await;
    let all = jobs(&api).await;
    assert_one_owner(&all, &[("n2", 1)]);
    let waiting = all.iter().find(|j| j.id == ids[3]).unwrap();
    assert_eq!(waiting.state, "pending", "{waiting:?}");
    let simjob = all.iter().find(|j| j.id == sim).unwrap();
    assert!(simjob.placements.iter().all(|p| p.node != "n1" && p.node != "n2"), "{simjob:?}");
    for j in &running {
        assert!(j.placements.iter().all(|p| p.node == "n1" || p.node == "n2"), "{j:?}");
        // Each process saw exactly its GPUs, by UUID.
        let r = &j.runs[0];
        let want: Vec<String> = r.gpus.iter().map(|g| format!("GPU-synthetic-{}-{g}", r.node)).collect();
        let want = want.join(",");
        // Written by the process once it runs (after its start was reported).
        let seen = written(d.join(format!("vis-{}-{}", j.id, r.allocation_id))).await;
        assert_eq!(seen.trim(), format!("{want}|{want}"), "job {}", j.id);
        assert_eq!(r.gpus.len() as u32, j.spec.as_ref().unwrap().gpus);
    }

    // Measured activity: every allocated H20 is busy and SM-active; a
    // sleeping (SIGSTOPped) process's GPU stays allocated but is not productive.
    let acc = until("productive = busy = 4 on H20", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            let a = api.accounting(pb::AccountingRequest { partition: "p0".into() }).await.unwrap().into_inner();
            let t = accounting_total(&a);
            (t.busy == 4.0 && t.productive == 4.0).then_some(t)
        }
    })
    .await;
    assert_eq!((acc.installed, acc.healthy), (6.0, 5.0), "{acc:?}");
    let one = running.iter().find(|j| j.spec.as_ref().unwrap().gpus == 1).unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    hub.control_allocation(pb::ControlAllocationRequest { allocation_id: one.runs[0].allocation_id, action: "sleep".into() }).await.unwrap();
    until("productive 3 of busy 4 while one sleeps", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            let a = api.accounting(pb::AccountingRequest { partition: "p0".into() }).await.unwrap().into_inner();
            let t = accounting_total(&a);
            (t.busy == 4.0 && t.productive == 3.0).then_some(())
        }
    })
    .await;
    hub.control_allocation(pb::ControlAllocationRequest { allocation_id: one.runs[0].allocation_id, action: "wake".into() }).await.unwrap();

    // An operator cannot take a GPU a job holds.
    let held = &running[0].runs[0];
    let clash = hub.start_allocation(pb::StartAllocationRequest { node: held.node.clone(), gpus: held.gpus.clone(), argv: vec!["true".into()], ..Default::default() }).await.unwrap_err();
    assert!(clash.code() == Code::FailedPrecondition && clash.message().contains(&format!("job {}", running[0].id)), "{clash:?}");

    // The 2-GPU job exits 0: finished, its GPUs go to the waiting job.
    let two = running.iter().find(|j| j.spec.as_ref().unwrap().gpus == 2).unwrap().id;
    std::fs::write(d.join(format!("release-{two}")), "0").unwrap();
    until("the 2-GPU job finished and the waiting one running", Duration::from_secs(60), || {
        let api = api.clone();
        let ids = ids.clone();
        async move {
            let js = jobs(&api).await;
            let st = |id: u64| js.iter().find(|j| j.id == id).unwrap().state.clone();
            (st(two) == "finished" && st(ids[3]) == "running").then_some(())
        }
    })
    .await;
    assert_one_owner(&jobs(&api).await, &[("n2", 1)]);

    // A non-zero exit fails the job, with the code in its detail.
    let failing = running.iter().find(|j| j.id != two).unwrap().id;
    std::fs::write(d.join(format!("release-{failing}")), "3").unwrap();
    let failed = until("the job failed", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == failing && j.state == "failed") }
    })
    .await;
    assert_eq!(failed.runs[0].exit_code, 3);
    assert!(failed.detail.contains("exit 3"), "{}", failed.detail);

    // Cancel: the process is stopped, and its GPUs come back only on its exit.
    let last = ids[3];
    api.cancel_job(pb::CancelJobRequest { job_id: last }).await.unwrap();
    let gone = until("the cancelled job's process gone", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == last && j.runs.iter().all(|r| r.state == "exited")) }
    })
    .await;
    assert_eq!((gone.state.as_str(), gone.runs[0].signal), ("cancelled", libc::SIGTERM));
    let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    let idle: u32 = nodes.iter().filter(|n| n.source == "agent").map(|n| n.gpus_idle).sum();
    // n1 + n2 have 5 healthy GPUs; one 1-GPU job still runs.
    assert_eq!(idle, 4, "{nodes:?}");
    for id in &ids {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    until("every task gone", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.iter().all(|j| j.runs.iter().all(|r| !matches!(r.state.as_str(), "starting" | "running" | "sleeping"))).then_some(()) }
    })
    .await;
}

/// Log text without its colour escapes.
pub(crate) fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// A loopback port free now (the OS may hand it out again later; good
/// enough for a server restarted on the same address).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub(crate) fn kill9(p: &mut Proc) {
    p.0.kill().unwrap();
    p.0.wait().unwrap();
}

/// Running jobs' placements, as (job, node, GPU) triples.
pub(crate) fn held_gpus(jobs: &[pb::Job]) -> std::collections::BTreeSet<(u64, String, u32)> {
    jobs.iter().filter(|j| j.state == "running").flat_map(|j| j.placements.iter().flat_map(move |p| p.gpus.iter().map(move |&g| (j.id, p.node.clone(), g)))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_with_sigkill_recovers_jobs_and_allocations_from_its_store() {
    let d = dir("restart");
    let state = d.join("state");
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let extra = ["--listen", listen.as_str(), "--agent-timeout-ms", "1500"];
    let (mut host, url) = serve(&d, "serve1", &state, &extra).await;
    let _n1 = agent(&d, &url, "n1", "4xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    until("n1 schedulable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move { api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes.into_iter().find(|n| n.name == "n1" && n.schedulable) }
    })
    .await;
    let held = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let sim = |gpus, tasks| pb::JobSpec { partition: "p0".into(), gpus, tasks, duration_s: 3600.0, ..Default::default() };
    let mut sims = Vec::new();
    for spec in [sim(1, 1), sim(8, 2), sim(8, 1000)] {
        sims.push(api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap().into_inner().job_id);
    }
    let before = until("the agent job's process and two simulated jobs running", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let js = jobs(&api).await;
            let up = js.iter().any(|j| j.id == held && j.runs.iter().all(|r| r.state == "running"));
            (up && js.iter().filter(|j| j.state == "running").count() == 3).then_some(js)
        }
    })
    .await;
    assert_eq!(before.iter().find(|j| j.id == sims[2]).unwrap().state, "pending");
    // The task writes its GPUs once it runs (its start is reported first).
    until("the task wrote its GPUs", Duration::from_secs(30), || {
        let wrote = std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()).any(|e| e.file_name().to_string_lossy().starts_with(&format!("vis-{held}-")));
        async move { wrote.then_some(()) }
    })
    .await;

    // kill -9, then a new process on the same state directory and address.
    kill9(&mut host);
    let restarted = Instant::now();
    let (_host, url2) = serve(&d, "serve2", &state, &extra).await;
    let up_in = restarted.elapsed();
    assert_eq!(url2, url);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let after = jobs(&api).await;
    let key = |js: &[pb::Job]| js.iter().map(|j| (j.id, j.state.clone(), j.placements.clone(), j.runs.iter().map(|r| r.allocation_id).collect::<Vec<_>>())).collect::<Vec<_>>();
    assert_eq!(key(&after), key(&before), "jobs differ after the restart");
    assert_eq!(held_gpus(&after), held_gpus(&before));
    let log = plain(&std::fs::read_to_string(d.join("serve2.log")).unwrap());
    let recovered = log.lines().find(|l| l.contains("state recovered")).unwrap_or_else(|| panic!("no recovery line in:\n{log}"));
    assert!(recovered.contains("jobs=4") && recovered.contains("running=3"), "{recovered}");
    eprintln!("restart: serving again {up_in:?} after the kill; {recovered}");

    // The agent comes back to the new process; its task still runs and
    // holds its GPUs: only 2 of n1's 4 are free, so a 3-GPU job waits.
    until("n1 back and schedulable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move { api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes.into_iter().find(|n| n.name == "n1" && n.schedulable && n.gpus_idle == 2) }
    })
    .await;
    let mut api = api;
    let three = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 3, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    assert!(three > *sims.iter().max().unwrap(), "job ids continue after the restart");
    let two = api.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    until("the 2-GPU job running beside the recovered one", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == two && j.state == "running") }
    })
    .await;
    let now = jobs(&api).await;
    assert_one_owner(&now, &[]);
    assert_eq!(now.iter().find(|j| j.id == three).unwrap().state, "pending");
    // The recovered task's exit reaches the new host and frees its GPUs
    // (with the 2-GPU job's: 4 free, room for 3).
    std::fs::write(d.join(format!("release-{held}")), "0").unwrap();
    std::fs::write(d.join(format!("release-{two}")), "0").unwrap();
    until("the recovered job finished and the 3-GPU one running", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let js = jobs(&api).await;
            let st = |id: u64| js.iter().find(|j| j.id == id).unwrap().state.clone();
            (st(held) == "finished" && st(three) == "running").then_some(())
        }
    })
    .await;
    assert_one_owner(&jobs(&api).await, &[]);
    std::fs::write(d.join(format!("release-{three}")), "0").unwrap();
}

/// The pid of the supervisor of job `job`'s task, from the agent's records.
pub(crate) fn task_pid(state: &Path, alloc: u64) -> u32 {
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(state.join(format!("alloc-{alloc}.json"))).unwrap()).unwrap();
    rec["pid"].as_u64().unwrap() as u32
}

/// The processes below `pid` (its children, theirs, ...).
pub(crate) fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let tids = std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten().filter_map(|e| e.file_name().to_str().and_then(|t| t.parse::<u32>().ok()));
        for tid in tids.collect::<Vec<_>>() {
            let children = std::fs::read_to_string(format!("/proc/{p}/task/{tid}/children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
                out.push(c);
                next.push(c);
            }
        }
    }
    out
}

/// Whether process `pid` is held by a frozen cgroup (v1 freezer or v2).
fn in_frozen_cgroup(pid: u32) -> bool {
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    groups.lines().any(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or("").trim_start_matches('/'));
        if controllers.split(',').any(|c| c == "freezer") {
            std::fs::read_to_string(Path::new("/sys/fs/cgroup/freezer").join(path).join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
        } else if controllers.is_empty() {
            ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
                .iter()
                .any(|root| std::fs::read_to_string(Path::new(root).join(path).join("cgroup.events")).is_ok_and(|s| s.lines().any(|l| l == "frozen 1")))
        } else {
            false
        }
    })
}

/// Whether the task under supervisor `pid` is asleep as its agent puts a
/// task to sleep: its processes in a frozen cgroup (the freezer), or
/// stopped (SIGSTOP to its group, where there is no freezer).
pub(crate) fn task_asleep(pid: u32) -> bool {
    let state = |p: u32| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default().rsplit(')').next().and_then(|r| r.split_whitespace().next()).map(str::to_string);
    let below = descendants(pid);
    !below.is_empty() && below.iter().all(|&p| state(p).as_deref() == Some("T") || in_frozen_cgroup(p))
}

pub(crate) fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    !stat.is_empty() && !matches!(stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()), Some("Z" | "X"))
}

pub(crate) async fn node_info(api: &berth::client::Client, name: &str) -> Option<pb::NodeInfo> {
    let nodes = api.clone().list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
    nodes.into_iter().find(|n| n.name == name)
}

/// A host on `state1` with agent n1 (state folder `n1-state`) running one
/// one-GPU task: (host, agent, job, allocation), once the task's process
/// wrote its file.
async fn a_task_under_a_first_host(d: &Path) -> (Proc, Proc, u64, u64) {
    let (host, url) = serve(d, "serve1", &d.join("state1"), &[]).await;
    let n1 = agent(d, &url, "n1", "2xH20", &[]);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let job = api.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let alloc = until("the first host's task running", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == job && j.state == "running").and_then(|j| j.runs.first().map(|r| r.allocation_id)) }
    })
    .await;
    let vis = d.join(format!("vis-{job}-{alloc}"));
    until("the task started", Duration::from_secs(30), || {
        let up = vis.exists();
        async move { up.then_some(()) }
    })
    .await;
    (host, n1, job, alloc)
}

/// A new host on a fresh state folder (`state2`), and agent n1 back on the
/// same agent state folder, schedulable there: (host, agent, client).
async fn the_agent_under_a_second_host(d: &Path) -> (Proc, Proc, berth::client::Client) {
    let (host, url) = serve(d, "serve2", &d.join("state2"), &[]).await;
    let n1 = agent(d, &url, "n1", "2xH20", &[]);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    until("n1 schedulable on the new host", Duration::from_secs(60), || {
        let api = api.clone();
        async move { node_info(&api, "n1").await.filter(|n| n.schedulable) }
    })
    .await;
    (host, n1, api)
}

/// An agent's state folder outlives unrelated runs: a task that ended
/// while its agent was down, under a host since replaced by one on a fresh
/// state folder, is not reported to the new host (whose allocation ids
/// start again and could name one of its own), and its records go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_tasks_of_an_earlier_host_are_forgotten_not_reported_to_a_new_one() {
    let d = dir("foreign");
    let records = d.join("n1-state");
    let (mut first_host, mut n1, old, alloc) = a_task_under_a_first_host(&d).await;
    // The agent dies; its task ends with no agent to report it; the host
    // goes too.
    kill9(&mut n1);
    std::fs::write(d.join(format!("release-{old}")), "0").unwrap();
    let status = records.join(format!("alloc-{alloc}.status"));
    until("the orphaned task's end recorded", Duration::from_secs(30), || {
        let done = status.exists();
        async move { done.then_some(()) }
    })
    .await;
    kill9(&mut first_host);
    // The new host's first job has the old one's id (both hosts count from
    // 1): the old release file would end it at once, before it is ever
    // seen running (the failure seen once in CI).
    std::fs::remove_file(d.join(format!("release-{old}"))).unwrap();

    // A new host on a fresh state folder; the same agent state folder.
    let (_second_host, _n1, api2) = the_agent_under_a_second_host(&d).await;
    assert!(!status.exists() && !records.join(format!("alloc-{alloc}.json")).exists(), "the earlier host's records are gone");
    let log = plain(&std::fs::read_to_string(d.join("n1.log")).unwrap());
    assert!(!log.contains("does not know this allocation"), "an earlier host's end was reported to the new one:\n{log}");
    // The new host's own work runs and ends as usual, reported by the
    // same agent, though its allocation ids may repeat the earlier host's.
    let new = api2.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    until_logged(&d, "the new host's task running", Duration::from_secs(60), || {
        let api = api2.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == new && j.state == "running") }
    })
    .await;
    std::fs::write(d.join(format!("release-{new}")), "0").unwrap();
    until("the new host's job finished", Duration::from_secs(60), || {
        let api = api2.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == new && j.state == "finished") }
    })
    .await;
}

/// A task an earlier, unrelated host started that still runs when its
/// agent comes back under a new host (fresh state folder) is stopped before
/// the agent takes work: the new host gives the same allocation ids again,
/// and a start naming one was taken for the old task (start ignored, the
/// old process on the GPUs, the new job "running" with no process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_tasks_of_an_earlier_host_are_stopped_before_a_new_one_gives_work() {
    let d = dir("foreignrun");
    let records = d.join("n1-state");
    let (mut first_host, mut n1, old, alloc) = a_task_under_a_first_host(&d).await;
    let old_pid = task_pid(&records, alloc);
    // The agent and the host die; the task runs on, unwatched.
    kill9(&mut n1);
    kill9(&mut first_host);
    assert!(alive(old_pid));

    let (_second_host, _n1, api2) = the_agent_under_a_second_host(&d).await;
    // Gone by the time the node takes work (the stop grace is 2 s).
    assert!(!alive(old_pid), "the earlier host's task still runs (pid {old_pid})");
    // The new host's first job gets the same allocation id, and its own
    // process runs (it writes its own file: the old one's, of the same
    // name, goes first).
    std::fs::remove_file(d.join(format!("vis-{old}-{alloc}"))).unwrap();
    let new = api2.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let new_alloc = until("the new host's task running", Duration::from_secs(60), || {
        let api = api2.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == new && j.state == "running").and_then(|j| j.runs.first().map(|r| r.allocation_id)) }
    })
    .await;
    assert_eq!(new_alloc, alloc, "the test needs the ids to repeat");
    let new_vis = d.join(format!("vis-{new}-{new_alloc}"));
    until("the new task's own process started", Duration::from_secs(30), || {
        let up = new_vis.exists();
        async move { up.then_some(()) }
    })
    .await;
    let log = plain(&std::fs::read_to_string(d.join("n1.log")).unwrap());
    assert!(!log.contains("already running here"), "a start was taken for the earlier task:\n{log}");
    std::fs::write(d.join(format!("release-{new}")), "0").unwrap();
    std::fs::write(d.join(format!("release-{old}")), "0").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_mid_job_is_adopted_back_or_its_job_requeued_with_no_gpu_twice() {
    let d = dir("agentkill");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "1000", "--reschedule-after-ms", "2000"]).await;
    let mut n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let sched = |name: &'static str| {
        let api = api.clone();
        move || {
            let api = api.clone();
            async move { node_info(&api, name).await.filter(|n| n.schedulable) }
        }
    };
    until("n1 schedulable", Duration::from_secs(60), sched("n1")).await;
    let running = |id: u64, node: &'static str| {
        let api = api.clone();
        move || {
            let api = api.clone();
            async move { jobs(&api).await.into_iter().find(|j| j.id == id && j.state == "running" && j.runs.iter().all(|r| r.state == "running" && r.node == node)) }
        }
    };

    // 1. Killed and back within the grace: the task ran on, ended while no
    // agent watched, and the new agent reports how it ended.
    let j1 = api.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let r1 = until("job 1 running on n1", Duration::from_secs(60), running(j1, "n1")).await.runs[0].clone();
    let pid1 = task_pid(&d.join("n1-state"), r1.allocation_id);
    kill9(&mut n1);
    assert!(alive(pid1), "the task outlives its agent");
    std::fs::write(d.join(format!("release-{j1}")), "5").unwrap();
    until("the task's end while no agent ran", Duration::from_secs(30), || async move { (!alive(pid1)).then_some(()) }).await;
    n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let done = until("job 1 failed with the task's own exit code", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == j1 && j.state == "failed") }
    })
    .await;
    assert_eq!((done.runs.len(), done.runs[0].allocation_id, done.runs[0].exit_code), (1, r1.allocation_id, 5), "{done:?}");

    // 2. Killed and back while the task still runs: adopted, same allocation.
    let j2 = api.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let r2 = until("job 2 running on n1", Duration::from_secs(60), running(j2, "n1")).await.runs[0].clone();
    kill9(&mut n1);
    n1 = agent(&d, &url, "n1", "2xH20", &[]);
    until("n1 back", Duration::from_secs(60), sched("n1")).await;
    let log = d.join("n1.log");
    until("the new agent adopted the task", Duration::from_secs(30), || {
        let t = plain(&std::fs::read_to_string(&log).unwrap_or_default());
        async move { t.contains(&format!("adopted a running task allocation={}", r2.allocation_id)).then_some(()) }
    })
    .await;
    std::fs::write(d.join(format!("release-{j2}")), "0").unwrap();
    let done = until("job 2 finished", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == j2 && j.state == "finished") }
    })
    .await;
    assert_eq!(done.runs[0].allocation_id, r2.allocation_id);

    // 3. Killed past the grace: the job is requeued on n2 while n1's GPUs
    // stay fenced (the old process may still run there); when n1 returns,
    // the old process is an orphan and is stopped, then the GPUs come back.
    let j3 = api.clone().submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let r3 = until("job 3 running on n1", Duration::from_secs(60), running(j3, "n1")).await.runs[0].clone();
    let pid3 = task_pid(&d.join("n1-state"), r3.allocation_id);
    let _n2 = agent(&d, &url, "n2", "2xH20", &[]);
    until("n2 schedulable", Duration::from_secs(60), sched("n2")).await;
    let killed = Instant::now();
    kill9(&mut n1);
    let moved = until("job 3 requeued and running on n2", Duration::from_secs(60), running(j3, "n2")).await;
    eprintln!("agent kill: job requeued and running on n2 {:?} after the kill (heartbeat timeout 1 s + grace 2 s)", killed.elapsed());
    assert!(moved.detail.contains("requeued: node n1 unreachable"), "{}", moved.detail);
    assert_ne!(moved.runs[0].allocation_id, r3.allocation_id);
    assert!(alive(pid3), "the old process still runs on n1");
    let n1_info = node_info(&api, "n1").await.unwrap();
    assert_eq!((n1_info.state.as_str(), n1_info.gpus_idle), ("unreachable", 0), "n1's GPUs stay fenced while the old process may run");
    assert_one_owner(&jobs(&api).await, &[]);
    n1 = agent(&d, &url, "n1", "2xH20", &[]);
    until("the orphan stopped and n1's GPUs free again", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let n = node_info(&api, "n1").await?;
            (!alive(pid3) && n.schedulable && n.gpus_idle == 2).then_some(())
        }
    })
    .await;
    let now = jobs(&api).await;
    assert_one_owner(&now, &[]);
    let j3_now = now.iter().find(|j| j.id == j3).unwrap();
    assert_eq!((j3_now.state.as_str(), j3_now.runs[0].node.as_str()), ("running", "n2"), "the requeued job kept running on n2");
    std::fs::write(d.join(format!("release-{j3}")), "0").unwrap();
    until("job 3 finished", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == j3 && j.state == "finished") }
    })
    .await;
    drop(n1);
}

/// A task for migration: writes `start-<allocation>` (ns since the epoch)
/// first, then the GPUs it sees and BERTH_MIGRATED_FROM to
/// `vis-<allocation>`; on SIGTERM lists the processes then alive that
/// were started as its migrated copy (`copies-at-term-<allocation>`: their
/// environment names it in BERTH_MIGRATED_FROM), writes
/// `term-<allocation>` and exits 0;
/// exits 0 on `release` (99 after two minutes, so none outlives a test).
fn migrate_argv(d: &Path) -> Vec<String> {
    let d = d.display();
    let script = format!(
        "date +%s%N > {d}/start-$BERTH_ALLOCATION.tmp && mv {d}/start-$BERTH_ALLOCATION.tmp {d}/start-$BERTH_ALLOCATION; \
         echo \"$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES|$BERTH_MIGRATED_FROM\" > {d}/vis-$BERTH_ALLOCATION; \
         trap 'date +%s%N > {d}/term-$BERTH_ALLOCATION.tmp; \
               grep -lasz \"^BERTH_MIGRATED_FROM=$BERTH_ALLOCATION$\" /proc/[0-9]*/environ > {d}/copies-at-term-$BERTH_ALLOCATION; \
               mv {d}/term-$BERTH_ALLOCATION.tmp {d}/term-$BERTH_ALLOCATION; exit 0' TERM; \
         i=0; while [ ! -f {d}/release ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done; \
         [ -f {d}/release ] || exit 99; exit 0"
    );
    vec!["sh".into(), "-c".into(), script]
}

/// A timestamp file a task wrote, once it is there.
async fn stamp(path: PathBuf) -> u128 {
    until(&format!("{}", path.display()), Duration::from_secs(60), || {
        let t = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse::<u128>().ok());
        async move { t }
    })
    .await
}

/// A line file a task writes once it runs, once it is there.
async fn written(path: PathBuf) -> String {
    until(&format!("{}", path.display()), Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&path).ok().filter(|t| t.ends_with('\n'));
        async move { text }
    })
    .await
}

async fn idle_gpus(api: &berth::client::Client, node: &str) -> u32 {
    node_info(api, node).await.map_or(u32::MAX, |n| n.gpus_idle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_task_migrates_make_before_break_and_a_failed_start_rolls_back() {
    let d = dir("migrate");
    // Nodes stay schedulable for a minute after they fall silent, so the
    // rollback case can aim at a node whose agent is gone.
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "60000"]).await;
    let _n1 = agent(&d, &url, "n1", "2xH20", &[]);
    let _n2 = agent(&d, &url, "n2", "2xH20", &[]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    until("both agent nodes schedulable", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let nodes = api.list_nodes(pb::ListNodesRequest { partition: "p0".into() }).await.unwrap().into_inner().nodes;
            ["n1", "n2"].iter().all(|n| nodes.iter().any(|x| x.name == *n && x.schedulable)).then_some(())
        }
    })
    .await;
    let spec = pb::JobSpec { partition: "p0".into(), tasks: 1, gpus: 2, cpu_milli: 1000, memory_mib: 1024, argv: migrate_argv(&d), ..Default::default() };
    let job = api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap().into_inner().job_id;
    let first = until("the task running", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == job && j.state == "running" && j.runs.len() == 1 && j.runs[0].state == "running").map(|j| j.runs[0].clone()) }
    })
    .await;
    let (src, old) = (first.node.clone(), first.allocation_id);
    let dst = if src == "n1" { "n2" } else { "n1" };
    stamp(d.join(format!("start-{old}"))).await;

    // Bad requests change nothing.
    let e = api.migrate_task(pb::MigrateTaskRequest { allocation_id: old, node: "nowhere".into(), checkpoint: false }).await.unwrap_err();
    assert!(e.code() == Code::FailedPrecondition && e.message().contains("nowhere"), "{e:?}");
    let e = api.migrate_task(pb::MigrateTaskRequest { allocation_id: old, node: src.clone(), checkpoint: false }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = api.migrate_task(pb::MigrateTaskRequest { allocation_id: 999_999, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // Ownership is sampled through the API for the whole move.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (api, stop) = (api.clone(), stop.clone());
        async move {
            let (mut samples, mut both) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let js = jobs(&api).await;
                assert_one_owner(&js, &[]);
                let j = js.iter().find(|j| j.id == job).unwrap();
                assert!(j.runs.len() <= 2, "{j:?}");
                if j.runs.iter().filter(|r| r.state == "running").count() == 2 {
                    both += 1;
                }
                samples += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (samples, both)
        }
    });
    // No destination given: the only other node with room.
    let m = api.migrate_task(pb::MigrateTaskRequest { allocation_id: old, node: String::new(), checkpoint: false }).await.unwrap().into_inner();
    assert_eq!((m.job_id, m.node.as_str(), m.gpus.len()), (job, dst, 2), "{m:?}");
    let moved = until("the old copy gone and the new one in its place", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == job && j.runs.len() == 1 && j.runs[0].allocation_id == m.allocation_id && j.runs[0].replaces == 0) }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (samples, both) = watcher.await.unwrap();
    // (a) The new copy started before the old one was told to stop.
    let new_start = stamp(d.join(format!("start-{}", m.allocation_id))).await;
    let old_term = stamp(d.join(format!("term-{old}"))).await;
    let copies = std::fs::read_to_string(d.join(format!("copies-at-term-{old}"))).unwrap();
    assert!(!copies.trim().is_empty(), "no new copy was running when the old one got its stop signal");
    println!(
        "migration overlap: the new copy's start marker {:.1} ms before the old one's stop marker; at the stop, {} process(es) of the new copy ran; {both} of {samples} API samples saw both copies running",
        (old_term as f64 - new_start as f64) / 1e6,
        copies.lines().count()
    );
    // (b) The new copy saw exactly its new GPUs, and where it came from.
    let want = |node: &str, gpus: &[u32]| gpus.iter().map(|g| format!("GPU-synthetic-{node}-{g}")).collect::<Vec<_>>().join(",");
    let seen = written(d.join(format!("vis-{}", m.allocation_id))).await;
    let w = want(dst, &m.gpus);
    assert_eq!(seen.trim(), format!("{w}|{w}|{old}"));
    let w = want(&src, &first.gpus);
    assert_eq!(written(d.join(format!("vis-{old}"))).await.trim(), format!("{w}|{w}|"));
    // (d) The job still runs, on the destination; the source GPUs are free.
    assert_eq!(moved.state, "running", "{moved:?}");
    assert_eq!((moved.runs[0].node.as_str(), moved.runs[0].state.as_str(), &moved.runs[0].gpus), (dst, "running", &m.gpus));
    assert_eq!(moved.placements[0].node, dst);
    assert_eq!((idle_gpus(&api, &src).await, idle_gpus(&api, dst).await), (2, 0));
    let agents = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner();
    let a = agents.allocations.iter().find(|a| a.id == old).unwrap();
    assert_eq!((a.state.as_str(), a.exit_code, a.signal), ("exited", 0, 0), "{a:?}");

    // (e) A destination that cannot start it: n3's agent is gone (its node
    // still schedulable): the start is not delivered, the reservation is
    // freed and the task keeps running where it is.
    let mut n3 = agent(&d, &url, "n3", "2xH20", &[]);
    until("n3 schedulable", Duration::from_secs(60), || {
        let api = api.clone();
        async move { node_info(&api, "n3").await.filter(|n| n.schedulable).map(|_| ()) }
    })
    .await;
    kill9(&mut n3);
    until("n3's command stream gone", Duration::from_secs(60), || {
        let mut hub = hub.clone();
        async move {
            let l = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner();
            l.agents.iter().any(|a| a.node == "n3" && !a.commands_connected).then_some(())
        }
    })
    .await;
    assert_eq!(idle_gpus(&api, "n3").await, 2);
    let e = api.migrate_task(pb::MigrateTaskRequest { allocation_id: m.allocation_id, node: "n3".into(), checkpoint: true }).await.unwrap_err();
    assert!(e.code() == Code::FailedPrecondition && e.message().contains("rolled back"), "{e:?}");
    let kept = jobs(&api).await.into_iter().find(|j| j.id == job).unwrap();
    assert_eq!(kept.state, "running", "{kept:?}");
    assert_eq!((kept.runs.len(), kept.runs[0].allocation_id, kept.runs[0].state.as_str()), (1, m.allocation_id, "running"), "{kept:?}");
    assert!(kept.detail.contains("rolled back"), "{}", kept.detail);
    assert_eq!((idle_gpus(&api, "n3").await, idle_gpus(&api, dst).await), (2, 0));
    assert!(!d.join(format!("term-{}", m.allocation_id)).exists(), "the running copy was stopped");
    assert_one_owner(&jobs(&api).await, &[]);

    // Released, it finishes normally: the old copy's exit did not end it.
    std::fs::write(d.join("release"), "0").unwrap();
    let done = until("the job finished", Duration::from_secs(60), || {
        let api = api.clone();
        async move { jobs(&api).await.into_iter().find(|j| j.id == job && j.state != "running") }
    })
    .await;
    assert_eq!((done.state.as_str(), done.runs.len(), done.runs[0].exit_code), ("finished", 1, 0), "{done:?}");
    assert_eq!((idle_gpus(&api, "n1").await, idle_gpus(&api, "n2").await), (2, 2));
}
