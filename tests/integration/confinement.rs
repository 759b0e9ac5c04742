//! Tenants confined, one owner per GPU, against the processes on the node:
//! a real `berth serve`, real synthetic agents, real child processes.
//!
//! - A tenant's task sees no credential of the host or the agent, in its
//!   environment or its supervisor's (an agent started with an operator
//!   token exported, as older docs showed).
//! - An agent identity acts only as the nodes it names, and reads nothing.
//! - Callers without a role learn nothing of what exists; bad names are
//!   refused with bounded, escaped errors.
//! - A preemptor cancelled during its victim's notice never lets another
//!   job start on GPUs whose old process still runs (the process table).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use berth::proto as pb;
use tonic::Code;

use crate::agent::{agent, agent_job, agent_token_file, alive, dir, jobs, serve, task_pid, until, Proc, BERTH};
use crate::common::{policy_path, repo_root};
use crate::preempt::schedulable;

async fn api(url: &str, token: &str) -> berth::client::Client {
    berth::client::connect(url, Some(token), None, None).await.unwrap()
}

/// `berth agent` for node `n1`, started the way older docs showed: the
/// operator's token exported in its environment, beside a secret of the
/// operator's shell. It authenticates with its own token file, and passes
/// CUDA_HOME on to tasks (`--task-env`).
fn agent_with_exported_token(d: &Path, url: &str) -> Proc {
    let state = d.join("n1-state").display().to_string();
    let token_file = agent_token_file(d);
    let log = std::fs::File::create(d.join("n1.log")).unwrap();
    let child = Command::new(BERTH)
        .args(["agent", "--node", "n1", "--synthetic-gpus", "2xH20", "--server", url, "--token-file", &token_file])
        .args(["--partition", "p0", "--heartbeat-ms", "200", "--stop-grace-s", "2", "--state-dir", &state, "--task-env", "CUDA_HOME"])
        .current_dir(repo_root())
        .env("BERTH_LOG", "info")
        .env("BERTH_TOKEN", "ops-test-token")
        .env("OPERATOR_SHELL_SECRET", "do-not-leak-me")
        .env("CUDA_HOME", "/opt/cuda-for-tasks")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Proc(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_task_sees_no_credential_of_the_host_or_the_agent() {
    let d = dir("printenv");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000"]).await;
    let n1 = agent_with_exported_token(&d, &url);
    let ops = api(&url, "ops-test-token").await;
    schedulable(&ops, "n1").await;

    // Alice's task writes its environment, its supervisor's and the
    // supervisor's argv, as a hostile tenant would read them.
    let mut alice = api(&url, "alice-test-token").await;
    let dd = d.display();
    let script = format!(
        "env > {dd}/env-$BERTH_JOB; tr '\\0' '\\n' < /proc/$PPID/environ > {dd}/penv-$BERTH_JOB; tr '\\0' ' ' < /proc/$PPID/cmdline > {dd}/pcmd-$BERTH_JOB"
    );
    let mut spec = agent_job(&d, 1, 1);
    spec.argv = vec!["sh".into(), "-c".into(), script];
    spec.env.insert("MY_SETTING".into(), "on".into());
    let job = alice.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap().into_inner().job_id;
    until("alice's task to finish", Duration::from_secs(60), || {
        let ops = ops.clone();
        async move { jobs(&ops).await.iter().any(|j| j.id == job && j.state == "finished").then_some(()) }
    })
    .await;

    let read = |name: &str| std::fs::read_to_string(d.join(format!("{name}-{job}"))).unwrap_or_else(|e| panic!("{name}-{job}: {e}"));
    let (env, penv, pcmd) = (read("env"), read("penv"), read("pcmd"));
    for (what, text) in [("the task's environment", &env), ("its supervisor's environment", &penv), ("its supervisor's argv", &pcmd)] {
        for secret in ["ops-test-token", "agent-test-token", "BERTH_TOKEN", "do-not-leak-me"] {
            assert!(!text.contains(secret), "{what} holds {secret}:\n{text}");
        }
    }
    // What it should have: its job's env, the task variables, a PATH.
    // (CUDA_HOME: passed on by the operator's --task-env.)
    for want in ["MY_SETTING=on", &format!("BERTH_JOB={job}"), "CUDA_VISIBLE_DEVICES=GPU-synthetic-n1-", "BERTH_NODE=n1", "PATH=", "CUDA_HOME=/opt/cuda-for-tasks"] {
        assert!(env.lines().any(|l| l.starts_with(want)), "{want} missing from:\n{env}");
    }
    // The agent itself holds the token in memory only: not in its argv.
    let agent_cmdline = std::fs::read(format!("/proc/{}/cmdline", n1.0.id())).unwrap();
    assert!(!String::from_utf8_lossy(&agent_cmdline).contains("agent-test-token"));

    // Another viewer of the partition sees the program, not its arguments.
    let mut watcher = api(&url, "watcher-test-token").await;
    let seen = watcher.list_jobs(pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await.unwrap().into_inner().jobs;
    let seen = seen.iter().find(|j| j.id == job).unwrap().spec.clone().unwrap();
    assert_eq!((seen.argv.as_slice(), seen.env.len()), (&["sh".to_string()][..], 0), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_identity_acts_only_as_its_node_and_nobody_learns_what_exists() {
    let d = dir("agentrole");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000"]).await;
    let (_n1, _n2) = (agent(&d, &url, "n1", "2xH20", &[]), agent(&d, &url, "n2", "2xH20", &[]));
    let mut ops = api(&url, "ops-test-token").await;
    schedulable(&ops, "n1").await;
    schedulable(&ops, "n2").await;
    let job = ops.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 1, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let alloc = until("the job's task running", Duration::from_secs(60), || {
        let ops = ops.clone();
        async move { jobs(&ops).await.into_iter().find(|j| j.id == job && j.runs.iter().any(|r| r.state == "running")).map(|j| j.runs[0].allocation_id) }
    })
    .await;

    // The agent identity is no API user: no policy upload, no cancel, no listing.
    let mut as_agent = api(&url, "agent-test-token").await;
    let component = std::fs::read(policy_path("binpack")).unwrap();
    let e = as_agent.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = as_agent.cancel_job(pb::CancelJobRequest { job_id: job }).await.unwrap_err();
    assert!(matches!(e.code(), Code::PermissionDenied | Code::NotFound), "{e:?}");
    let e = as_agent.list_jobs(pb::ListJobsRequest { partition: "p0".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(jobs(&ops).await.iter().find(|j| j.id == job).unwrap().state, "running");

    // n1's agent token cannot act as n2 (which exists) nor as n9 (which
    // does not): the same refusal, before any lookup.
    let mut n1_hub = berth::agent::connect_hub(&url, Some("n1-agent-test-token"), None).await.unwrap();
    let mut refusals = Vec::new();
    for node in ["n2", "n9"] {
        let reg = pb::RegisterAgentRequest { node: node.into(), partition: "p0".into(), source: "synthetic".into(), cpu_milli: 1000, memory_mib: 1024, ..Default::default() };
        let e = n1_hub.register(reg).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let e = n1_hub.heartbeat(pb::HeartbeatRequest { node: node.into(), session: 1, ..Default::default() }).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        refusals.push(e.message().replace(node, "NODE"));
        // Nor report another node's allocation as exited.
        let report = pb::AllocationReport { node: node.into(), allocation_id: alloc, state: "exited".into(), ..Default::default() };
        assert_eq!(n1_hub.report_allocation(report).await.unwrap_err().code(), Code::PermissionDenied);
    }
    assert_eq!(refusals[0], refusals[1], "a refusal must not tell an existing node from a missing one");
    // As itself, it may not report n2's allocation either: answered as missing.
    let task_node = jobs(&ops).await.into_iter().find(|j| j.id == job).unwrap().runs[0].node.clone();
    let mut agents_hub = berth::agent::connect_hub(&url, Some("agent-test-token"), None).await.unwrap();
    let other = if task_node == "n1" { "n2" } else { "n1" };
    let report = pb::AllocationReport { node: other.into(), allocation_id: alloc, state: "exited".into(), ..Default::default() };
    let e = agents_hub.report_allocation(report).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let report = pb::AllocationReport { node: other.into(), allocation_id: 987_654, state: "exited".into(), ..Default::default() };
    let missing = agents_hub.report_allocation(report).await.unwrap_err();
    assert_eq!(e.message().replace(&format!(" {alloc} "), " ID "), missing.message().replace(" 987654 ", " ID "));
    // Nor start an allocation (an operator's act).
    let start = pb::StartAllocationRequest { node: "n1".into(), gpus: vec![1], argv: vec!["true".into()], ..Default::default() };
    assert_eq!(agents_hub.start_allocation(start).await.unwrap_err().code(), Code::PermissionDenied);
    assert_eq!(jobs(&ops).await.iter().find(|j| j.id == job).unwrap().state, "running", "no report was taken");

    // A viewer or tenant controlling an allocation: one answer whether it
    // exists or not.
    for token in ["watcher-test-token", "alice-test-token"] {
        let mut hub = berth::agent::connect_hub(&url, Some(token), None).await.unwrap();
        let real = hub.control_allocation(pb::ControlAllocationRequest { allocation_id: alloc, action: "stop".into() }).await.unwrap_err();
        let fake = hub.control_allocation(pb::ControlAllocationRequest { allocation_id: 987_654, action: "stop".into() }).await.unwrap_err();
        assert_eq!((real.code(), fake.code()), (Code::PermissionDenied, Code::PermissionDenied), "{real:?} {fake:?}");
        assert_eq!(real.message(), fake.message());
    }

    // Names: refused with a bounded, escaped error (no forged log line, no
    // metadata overflow), by operators too.
    let mut ops_hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    let huge = "x".repeat(1 << 20);
    for bad in ["n1\nFORGED log line", "n\u{1b}[31mred", "../etc", "a/b", "n\u{202e}1", huge.as_str()] {
        let reg = pb::RegisterAgentRequest { node: bad.into(), partition: "p0".into(), source: "synthetic".into(), cpu_milli: 1000, memory_mib: 1024, ..Default::default() };
        let e = ops_hub.register(reg).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().len() < 512 && !e.message().contains(['\n', '\u{1b}', '\u{202e}']), "{:?}", &e.message()[..e.message().len().min(200)]);
    }
    let gpu = |uuid: &str, model: &str| pb::GpuInfo { index: 0, uuid: uuid.into(), model: model.into(), memory_total_mib: 1024, ..Default::default() };
    let twice = pb::GpuInfo { index: 1, ..gpu("GPU-1", "H20") };
    for gpus in [vec![gpu("GPU-1", "H20\n")], vec![gpu("GPU-1", "H20"), twice], vec![gpu("GPU-synthetic-n1-0", "H20")]] {
        let reg = pb::RegisterAgentRequest { node: "n7".into(), partition: "p0".into(), source: "synthetic".into(), cpu_milli: 1000, memory_mib: 1024, gpus, ..Default::default() };
        let e = ops_hub.register(reg).await.unwrap_err();
        assert!(matches!(e.code(), Code::InvalidArgument | Code::AlreadyExists), "{e:?}");
    }
    // An operator's huge action or list filter comes back bounded.
    let e = ops_hub.control_allocation(pb::ControlAllocationRequest { allocation_id: alloc, action: huge.clone() }).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().len() < 512, "{}", e.message().len());
    let e = ops.list_jobs(pb::ListJobsRequest { partition: "p0".into(), state: huge.clone(), ..Default::default() }).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().len() < 512, "{}", e.message().len());
    std::fs::write(d.join(format!("release-{job}")), "0").unwrap();
}

/// The first repro of the issue, against the process table: low job L
/// holds the node's GPUs; high job H (for half of them) preempts it; H is
/// cancelled during L's notice; new jobs wait. No task of another job runs
/// while L's process is alive, and L is not shown pending while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preemptor_cancelled_during_the_notice_lets_nothing_start_on_gpus_still_in_use() {
    let d = dir("cancelnotice");
    let (_serve, url) = serve(&d, "serve", &d.join("state"), &["--agent-timeout-ms", "3000", "--notice-s", "3"]).await;
    // The checkpoint notice is a hook (the default, SIGUSR1, would end the
    // test's shell at once): L runs through its whole notice.
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--checkpoint-hook", "true"]);
    let mut ops = api(&url, "ops-test-token").await;
    schedulable(&ops, "n1").await;
    let component = std::fs::read(policy_path("spot-gpu")).unwrap();
    let up = ops.upload_policy(pb::UploadPolicyRequest { partition: "p0".into(), component, hook: "rank".into(), ..Default::default() }).await.unwrap().into_inner();
    ops.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version: up.policy.unwrap().version, hook: "rank".into() }).await.unwrap();

    let low = ops.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 4, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    let low_alloc = until("L running", Duration::from_secs(60), || {
        let ops = ops.clone();
        async move { jobs(&ops).await.into_iter().find(|j| j.id == low && j.runs.iter().any(|r| r.state == "running")).map(|j| j.runs[0].allocation_id) }
    })
    .await;
    let low_pid = task_pid(&d.join("n1-state"), low_alloc);
    assert!(alive(low_pid));

    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let h = ops.submit_job(pb::SubmitJobRequest { job: Some(high), ..Default::default() }).await.unwrap().into_inner().job_id;
    until("H placed, waiting for L", Duration::from_secs(60), || {
        let ops = ops.clone();
        async move { jobs(&ops).await.iter().any(|j| j.id == h && j.state == "running").then_some(()) }
    })
    .await;
    // A job for the 2 GPUs H did not take, then H cancelled, then one for all 4.
    let small = ops.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 2, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;
    ops.cancel_job(pb::CancelJobRequest { job_id: h }).await.unwrap();
    let big = ops.submit_job(pb::SubmitJobRequest { job: Some(agent_job(&d, 4, 1)), ..Default::default() }).await.unwrap().into_inner().job_id;

    // Until L's process is gone, nothing else starts (no process of theirs
    // writes its GPUs), and L is not shown pending.
    let mut polls = 0;
    while alive(low_pid) {
        let js = jobs(&ops).await;
        for other in [small, big] {
            let j = js.iter().find(|j| j.id == other).unwrap();
            assert!(j.runs.iter().all(|r| r.state != "running" && r.state != "starting"), "job {other} started beside L's live process {low_pid}: {j:?}");
            let started = std::fs::read_dir(&d).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with(&format!("vis-{other}-")));
            assert!(!started || !alive(low_pid), "job {other}'s process ran while L's ({low_pid}) was alive");
        }
        let l = js.iter().find(|j| j.id == low).unwrap();
        if alive(low_pid) {
            assert_ne!(l.state, "pending", "L is shown pending while its process runs: {l:?}");
        }
        polls += 1;
        assert!(polls < 600, "L's process outlived its notice and stop grace");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(polls > 5, "the check ran while L was alive ({polls} polls)");
    // Then the waiting work runs.
    until("the small job or L running again once L's process is gone", Duration::from_secs(60), || {
        let ops = ops.clone();
        async move { jobs(&ops).await.iter().any(|j| [small, big, low].contains(&j.id) && j.runs.iter().any(|r| r.state == "running")).then_some(()) }
    })
    .await;
    for id in [low, small, big] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
}
