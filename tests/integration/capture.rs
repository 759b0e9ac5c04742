//! Capture and replay of what a live partition was given (`berth capture
//! export`, `berth replay --events`). The exact re-decision check runs at
//! the end of the live tests that exercise a mechanism with real agents
//! (compaction, preemption, harvesting across a host restart: see
//! [`replays_exactly`]); here, all three in one run on a manual clock, the
//! file format and its bounds, and a capture replayed under other policies
//! with its report in a headless browser.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use crate::agent::BERTH;

/// Exports partition p0's capture from the host at `url` with the real CLI
/// and replays it exactly with the host's components (`state` is its state
/// directory): every segment with its start is decided again, decision for
/// decision, and at least `min_decisions` were compared. Returns the
/// capture's path and the replay's report.
pub(crate) fn replays_exactly(d: &Path, url: &str, state: &Path, min_decisions: u64) -> (PathBuf, String) {
    let events = d.join("p0.events");
    let out = Command::new(BERTH).args(["capture", "export", "--partition", "p0", "--server", url, "--token", "ops-test-token"]).output().unwrap();
    assert!(out.status.success(), "berth capture export: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(&events, &out.stdout).unwrap();
    let out = Command::new(BERTH)
        .args(["replay", "--events"])
        .arg(&events)
        .arg("--components")
        .arg(state.join("components"))
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the capture did not replay exactly:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    let mut compared = 0;
    for line in report.lines().filter(|l| l.starts_with("segment ")) {
        assert!(!line.contains("DIFFERENCE"), "{report}");
        if let Some(counts) = line.split("decisions identical ").nth(1) {
            let (same, all) = counts.split_once(" / ").unwrap();
            let all: u64 = all.split_whitespace().next().unwrap().parse().unwrap();
            assert_eq!(same.parse::<u64>().unwrap(), all, "{line}");
            assert!(line.contains("(100%)"), "{line}");
            compared += all;
        }
    }
    assert!(compared >= min_decisions, "{compared} decisions compared, fewer than {min_decisions}:\n{report}");
    (events, report)
}

/// The CLI's replay of `events` with `args`, its stdout.
fn replay(events: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(BERTH).args(["replay", "--events"]).arg(events).args(args).env("RUST_BACKTRACE", "0").output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

/// A capture with the first difference planted is caught there; a capture
/// of another format version is refused with both versions named; a
/// segment that lost its start is told, not replayed.
#[test]
fn a_tampered_capture_is_caught_at_its_first_difference() {
    let d = std::env::temp_dir().join(format!("berth-test-{}-capture-tamper", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let events = crate::live_replay::captured_run(&d);
    let text = std::fs::read_to_string(&events).unwrap();
    let (ok, report) = replay(&events, &[]);
    assert!(ok && report.contains("(100%)"), "{report}");

    // Another node for the first placement of the capture.
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let k = lines.iter().position(|l| l.contains("\"input\":\"pass\"") && l.contains("\"Place\"")).expect("a placement");
    let mut pass: Value = serde_json::from_str(&lines[k]).unwrap();
    let node = &mut pass["decisions"][0]["Place"]["allocations"][0]["node"];
    *node = json!(node.as_u64().unwrap() + 1);
    lines[k] = pass.to_string();
    let tampered = d.join("tampered.events");
    std::fs::write(&tampered, lines.join("\n") + "\n").unwrap();
    let (ok, report) = replay(&tampered, &[]);
    assert!(!ok, "{report}");
    assert!(report.contains(&format!("FIRST DIFFERENCE at input {k}")) || report.contains("FIRST DIFFERENCE at input"), "{report}");
    assert!(report.contains("the replay decided otherwise"), "{report}");

    // A later format version is refused, naming both.
    let newer = d.join("newer.events");
    std::fs::write(&newer, text.replacen("\"version\":1", "\"version\":9", 1)).unwrap();
    let (ok, report) = replay(&newer, &[]);
    assert!(!ok && report.contains("version 9") && report.contains("version 1"), "{report}");

    // Without its start (rotated away), a segment is not replayed exactly.
    let headless: Vec<&str> = text.lines().filter(|l| !l.contains("\"input\":\"start\"")).collect();
    let rotated = d.join("rotated.events");
    std::fs::write(&rotated, headless.join("\n") + "\n").unwrap();
    let (ok, report) = replay(&rotated, &[]);
    assert!(ok && report.contains("not replayed: its first file was rotated away"), "{report}");
    let _ = std::fs::remove_dir_all(&d);
}

/// The same capture under other placement policies: a report side by side
/// with what happened live (the counterfactual differs and is plausible:
/// the same jobs, each started at most once per run), as JSON and as an
/// HTML page laid out by headless chromium.
#[test]
fn a_capture_replayed_under_other_policies_reports_side_by_side_in_a_browser() {
    let d = std::env::temp_dir().join(format!("berth-test-{}-capture-counterfactual", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let events = crate::live_replay::captured_run(&d);
    let (html, json_path) = (d.join("report.html"), d.join("report.json"));
    let (ok, report) = replay(
        &events,
        &["--policy", "binpack", "--policy", "spread", "--html", html.to_str().unwrap(), "--json", json_path.to_str().unwrap()],
    );
    assert!(ok, "{report}");
    assert!(report.contains("(100%)"), "{report}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let runs = doc["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["run"].as_str().unwrap()).collect();
    assert_eq!(names, ["as captured (live)", "binpack", "spread"], "{report}");
    // The counterfactual under another starvation guard, or none: said in
    // its header, the same jobs replayed; both at once are refused.
    let (ok, guarded) = replay(&events, &["--policy", "binpack", "--reserve-after-h", "0.5", "--aging", "2", "--admission-window", "30,4"]);
    assert!(ok && guarded.contains("counterfactual starvation guard: reserve after 0.50 h, aging 2 points/h, admission window 30 min, 4 GPU-h"), "{guarded}");
    let (ok, unguarded) = replay(&events, &["--policy", "binpack", "--no-guard"]);
    assert!(ok && unguarded.contains("counterfactual starvation guard: none"), "{unguarded}");
    let (ok, both) = replay(&events, &["--policy", "binpack", "--no-guard", "--reserve-after-h", "1"]);
    assert!(!ok && both.contains("--no-guard") && both.contains("--reserve-after-h"), "{both}");
    let (ok, bad) = replay(&events, &["--policy", "binpack", "--admission-window", "30"]);
    assert!(!ok && bad.contains("MINUTES,GPU_H"), "{bad}");
    let (ok, exact_only) = replay(&events, &["--no-guard"]);
    assert!(!ok && exact_only.contains("give --policy"), "exact replay keeps the captured guard: {exact_only}");
    let (ok, contract) = replay(&events, &["--policy", "binpack", "--contract", "notice=120,per-day=1"]);
    assert!(ok && contract.contains("counterfactual contract: notice 120 s, grace 30 s, at most 1 a day"), "{contract}");
    let (ok, bad) = replay(&events, &["--policy", "binpack", "--contract", "notice=soon"]);
    assert!(!ok && bad.contains("--contract notice") && !bad.contains("segment 1"), "refused before the replay: {bad}");
    let live = &runs[0];
    for r in runs {
        // The same arrivals in every run; all started within the capture.
        assert_eq!(r["jobs"], live["jobs"], "{report}");
        assert!(r["started"].as_u64().unwrap() <= r["jobs"].as_u64().unwrap(), "{report}");
        let alloc = r["allocation_pct"].as_f64().unwrap();
        assert!(alloc > 0.0 && alloc <= 100.0, "{report}");
    }
    assert!(live["evictions"].as_u64().unwrap() > 0, "the live run preempted: {report}");
    // Spreading leaves more nodes partly used than packing does.
    assert!(runs[2]["partly_used_nodes"].as_f64().unwrap() > runs[1]["partly_used_nodes"].as_f64().unwrap(), "{report}");

    let page = std::fs::read_to_string(&html).unwrap();
    for needle in ["<script", "<link", "<img", "src=", "href=", "url("] {
        assert!(!page.contains(needle), "the report contains {needle:?}");
    }
    use crate::html_report::{find_tool, Driver};
    let (Some(chromedriver), Some(chromium)) =
        (find_tool(&["/usr/bin/chromedriver"]), find_tool(&["/usr/lib/chromium/chromium", "/usr/bin/chromium"]))
    else {
        crate::common::skip("the browser half: chromium or chromedriver is not installed (scripts/install-chromium.sh)");
        return;
    };
    let driver = Driver::start(&chromedriver);
    let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": chromium,
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,900",
                 "--user-data-dir=".to_string() + &d.join("chromium-profile").to_string_lossy()]
    }}}});
    let session = driver.call("POST", "/session", Some(caps)).expect("a chromium session");
    let id = session["sessionId"].as_str().expect("session id").to_string();
    let s = |path: &str| format!("/session/{id}{path}");
    driver.call("POST", &s("/url"), Some(json!({"url": format!("file://{}", html.canonicalize().unwrap().display())}))).unwrap();
    let script = r#"
        const rows = t => [...document.querySelectorAll(t + ' tbody tr')].map(r => [...r.children].map(c => c.textContent.trim()));
        const box = document.querySelector('#runs').getBoundingClientRect();
        return { title: document.title, fidelity: rows('#fidelity'), runs: rows('#runs'), width: box.width, height: box.height };"#;
    let seen = driver.call("POST", &s("/execute/sync"), Some(json!({"script": script, "args": []}))).unwrap();
    let _ = driver.call("DELETE", &s(""), None);
    drop(driver);
    assert_eq!(seen["title"], "Berth: a capture replayed", "{seen}");
    let fidelity = seen["fidelity"].as_array().unwrap();
    assert_eq!(fidelity.len(), 1, "{seen}");
    assert_eq!(fidelity[0][4], "none", "no first difference: {seen}");
    let shown: Vec<&str> = seen["runs"].as_array().unwrap().iter().map(|r| r[0].as_str().unwrap()).collect();
    assert_eq!(shown, names, "{seen}");
    assert!(seen["width"].as_f64().unwrap() > 500.0 && seen["height"].as_f64().unwrap() > 60.0, "laid out: {seen}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A partition's capture stays within its bound: files are cut and the
/// oldest deleted, never the one being written; what is left exports in
/// order, and a window keeps the headers and the start with the inputs
/// inside it.
#[test]
fn the_capture_is_cut_and_pruned_within_its_bound_and_exports_a_window() {
    use berth::capture::{export, files, Bounds, CaptureLog, Window};
    use berth_core::capture::Input;
    let d = std::env::temp_dir().join(format!("berth-test-{}-capture-bounds", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let bounds = Bounds { total_bytes: 200_000, file_bytes: 20_000 };
    let mut log = CaptureLog::open(&d, "p0", bounds, 0).unwrap();
    for now in 0..5_000u64 {
        log.write(vec![Input::DueWakeups { now }], now * 1000);
    }
    log.sync();
    let kept = files(&d).unwrap();
    let total: u64 = kept.iter().map(|(_, _, p)| std::fs::metadata(p).unwrap().len()).sum();
    assert!(kept.len() > 2 && total <= bounds.total_bytes + bounds.file_bytes, "{} files, {total} bytes", kept.len());
    assert!(kept.iter().all(|(s, _, _)| *s == 1) && kept[0].1 > 0, "the oldest parts went first: {kept:?}");
    // A second host start opens the next segment beside the first.
    drop(log);
    let mut next = CaptureLog::open(&d, "p0", bounds, 0).unwrap();
    next.write(vec![Input::DueWakeups { now: 9_999 }], 0);
    next.sync();
    assert_eq!(files(&d).unwrap().last().unwrap().0, 2);

    let mut times = Vec::new();
    let mut text = String::new();
    let lines = export(&d, Window { since: Some(4_990), until: Some(4_994) }, |line| {
        let v: Value = serde_json::from_str(line).unwrap();
        if let Some(t) = v["now"].as_u64() {
            times.push(t);
        }
        text += line;
        text.push('\n');
        Ok(())
    })
    .unwrap();
    assert_eq!(times, [4_990, 4_991, 4_992, 4_993, 4_994]);
    assert!(lines as usize > times.len(), "the files' headers come too");
    // The window is in the headers: its segments are not taken for whole ones.
    let read = berth::capture::read(text.as_bytes(), "window").unwrap();
    assert!(!read.segments.is_empty() && read.segments.iter().all(|s| s.windowed && !s.complete()), "{:?}", read.segments.iter().map(|s| s.id).collect::<Vec<_>>());
    // A line with no end is refused before it is held.
    let endless = format!("{{\"format\":\"berth-capture\",\"version\":1,\"partition\":\"p0\",\"segment\":1,\"part\":0,\"started_unix_ms\":0}}\n{}", "x".repeat(1000));
    assert!(berth::capture::read(endless.as_bytes(), "endless").is_ok(), "a short torn line is only skipped");
    let _ = std::fs::remove_dir_all(&d);
}

/// `berth bench capture` runs end to end (its figures are the benchmark's).
#[test]
fn the_capture_benchmark_measures_both_ways_and_the_bytes() {
    let out = Command::new(BERTH).args(["bench", "capture", "--nodes", "16", "--jobs", "300", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(r["decisions_per_s_off"].as_f64().unwrap() > 0.0 && r["decisions_per_s_on"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["start_bytes"].as_u64().unwrap() > 16 * 100 && r["bytes_per_1000_jobs"].as_f64().unwrap() > 1000.0, "{r}");
}

/// Moves the test's clock a second at a time, poking partition p0's loop to
/// run what fell due, until `f` gives a value (at most 90 s of the
/// machine's time: a liveness bound).
async fn tick_until<T, F: std::future::Future<Output = Option<T>>>(clock: &berth::serve::clock::ManualClock, live: &berth::serve::state::Live, what: &str, mut f: impl FnMut() -> F) -> T {
    use berth::serve::clock::Clock;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(std::time::Instant::now() < end, "timed out waiting for {what} (the test's clock at {} s)", clock.unix_ms() / 1000);
        clock.set(clock.unix_ms() + 1000);
        live.hold(0, false);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// One live run of every mechanism the capture must carry, on a clock the
/// test moves by hand: an in-process host (its timers, notices, run times
/// and decisions on a [`berth::serve::clock::ManualClock`]) serving real
/// sockets, two real `berth agent` processes whose tasks are real child
/// processes, spot-gpu ranking and ipc compacting as wasm. Live compaction
/// frees a node for a whole-node job (make-before-break); a high-priority
/// job preempts under a notice that only the test's clock ends; a sleeping
/// replica lends its GPUs and takes them back on wake. The partition's
/// capture, exported through the CLI, replays decision for decision (the
/// replay stops at the first difference), and every time in it is the
/// test's clock's. No GPU has two running owners in any sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_live_run_with_two_agents_on_a_manual_clock_replays_exactly() {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    use berth::proto as pb;
    use berth::serve::clock::{Clock, ManualClock};

    use crate::agent::{agent, agent_job, dir, jobs, task_asleep};
    use crate::live_compaction::{fragment, ledger, schedulable, spec, until_running, upload_compact};

    /// Far from the machine's clock: a time taken from it would stand out.
    const T0_S: u64 = 1_000_000;
    const NOTICE_S: u64 = 5;
    let d = dir("capture-one-run");
    let state = d.join("state");
    let clock = Arc::new(ManualClock::at(T0_S * 1000));
    let mut cfg = crate::serve::config(&state, crate::agent::ACCESS);
    cfg.scheduling.clock = clock.clone();
    cfg.scheduling.auto_compaction = false;
    cfg.scheduling.contract.notice_s = NOTICE_S;
    // The hub's silence timer runs on the test's clock, which moves ten
    // times faster than the machine's while the test waits: no node loss
    // here (a loaded machine must not make one).
    let hub_config = berth::serve::hub::HubConfig { heartbeat_timeout: Duration::from_secs(24 * 3600), reschedule_after: None, ..Default::default() };
    let host = berth::serve::server::start_with_agents(cfg, hub_config).await.unwrap();
    let live = host.live.clone();
    let url = format!("http://{}", host.addr);
    let hook = format!("echo $BERTH_ALLOCATION > {}/ckpt-$BERTH_ALLOCATION", d.display());
    let _n1 = agent(&d, &url, "n1", "4xH20", &["--checkpoint-hook", &hook]);
    let _n2 = agent(&d, &url, "n2", "4xH20", &["--checkpoint-hook", &hook]);
    let mut api = berth::client::connect(&url, Some("ops-test-token"), None, None).await.unwrap();
    let mut hub = berth::agent::connect_hub(&url, Some("ops-test-token"), None).await.unwrap();
    schedulable(&api, &["n1", "n2"]).await;
    crate::preempt::upload_rank(&mut api, &crate::common::policy_path("spot-gpu")).await;
    upload_compact(&mut api, "ipc").await;
    let client = api.clone();
    let submit = |spec: pb::JobSpec| {
        let mut api = client.clone();
        async move { api.submit_job(pb::SubmitJobRequest { job: Some(spec), ..Default::default() }).await.unwrap().into_inner().job_id }
    };
    // The jobs as the API shows them, no GPU used by two running tasks.
    let sample = || {
        let api = client.clone();
        async move {
            let js = jobs(&api).await;
            // A sleeping replica's GPUs are lent: only running tasks count.
            assert_eq!(crate::harvest::shared_gpus(&js), None);
            js
        }
    };
    let find = |js: &[pb::Job], id: u64| js.iter().find(|j| j.id == id).cloned().unwrap_or_else(|| panic!("job {id} not listed"));
    let all_finished = |ids: Vec<u64>| {
        let sample = sample.clone();
        move || {
            let (ids, sample) = (ids.clone(), sample.clone());
            async move { sample().await.iter().filter(|j| ids.contains(&j.id)).all(|j| j.state == "finished").then_some(()) }
        }
    };
    let step = |s: u64| {
        clock.set(clock.unix_ms() + s * 1000);
        live.hold(0, false);
    };

    // 1. Compaction: two half-used nodes; ipc moves one 2-GPU job onto the
    // other node (the new copy first), and a whole-node job starts on the
    // node it emptied once the move is verified (on the test's clock).
    std::fs::write(d.join("ready-ok"), "").unwrap();
    let (a, b) = fragment(&d, &mut api, &mut hub).await;
    let whole = submit(spec(&d, 4, false)).await;
    crate::live_replay::settle(&live);
    assert_eq!(find(&sample().await, whole).state, "pending");
    let chains = api.compact_live(pb::CompactLiveRequest { partition: "p0".into(), dry_run: false }).await.unwrap().into_inner().chain_ids;
    assert_eq!(chains.len(), 1);
    let started = tick_until(&clock, &live, "the whole-node job running", || {
        let sample = sample.clone();
        async move { sample().await.into_iter().find(|j| j.id == whole && j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|x| x.state == "running")) }
    })
    .await;
    let emptied = [&a, &b].iter().find(|j| j.runs[0].node == started.runs[0].node).map(|j| j.id);
    assert!(emptied.is_some(), "the whole-node job runs where a moved job was: {started:?}");
    let chain = tick_until(&clock, &live, "the chain closed", || {
        let api = api.clone();
        async move { ledger(&api).await.into_iter().find(|c| c.state != "running") }
    })
    .await;
    assert_eq!((chain.id, chain.state.as_str(), chain.moves.len()), (chains[0], "done", 1), "{chain:?}");
    std::fs::write(d.join("release"), "0").unwrap();
    tick_until(&clock, &live, "the compaction phase's jobs finished", all_finished(vec![a.id, b.id, whole])).await;

    // 2. Preemption: low-priority fill started ten seconds apart; a
    // priority-5 job that does not fit takes spot-gpu's victims, which get
    // their checkpoint notice and keep running until the test's clock
    // passes the notice.
    let mut low = Vec::new();
    for gpus in [4, 2, 1, 1] {
        let id = submit(agent_job(&d, gpus, 1)).await;
        until_running(&api, id).await;
        low.push(id);
        step(10);
    }
    let before = sample().await;
    let mut high = agent_job(&d, 2, 1);
    high.priority = 5;
    let submitted_ms = clock.unix_ms();
    let h = submit(high).await;
    crate::live_replay::settle(&live);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let noticed = sample().await;
    let victims: Vec<u64> = noticed.iter().filter(|j| low.contains(&j.id) && j.detail.contains(&format!("preempted for job {h}"))).map(|j| j.id).collect();
    assert!(!victims.is_empty(), "no victim for job {h}: {noticed:?}");
    // Placed on its victims' GPUs, not started: they run on under notice.
    assert!(find(&noticed, h).runs.is_empty(), "the preemptor started before its victims' notice ran out on the test's clock: {:?}", find(&noticed, h));
    for v in &victims {
        let j = find(&noticed, *v);
        assert!(j.state == "evicting" && j.runs.iter().all(|x| x.state == "running"), "victim {v} stopped before its notice ran out: {j:?}");
    }
    let hj = tick_until(&clock, &live, "the preemptor running", || {
        let sample = sample.clone();
        async move { sample().await.into_iter().find(|j| j.id == h && j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|r| r.state == "running")) }
    })
    .await;
    assert!(clock.unix_ms() >= submitted_ms + NOTICE_S * 1000, "started {} ms after its submission, within the notice", clock.unix_ms() - submitted_ms);
    for v in &victims {
        let run = &find(&before, *v).runs[0];
        let noted = std::fs::read_to_string(d.join(format!("ckpt-{}", run.allocation_id))).unwrap_or_default();
        assert_eq!(noted.trim(), run.allocation_id.to_string(), "no checkpoint notice for victim {v}");
    }
    assert!(hj.runs[0].gpus.iter().all(|g| victims.iter().any(|v| find(&before, *v).runs[0].node == hj.runs[0].node && find(&before, *v).runs[0].gpus.contains(g))), "the preemptor runs on its victims' GPUs: {hj:?}");
    for id in low.iter().chain([&h]) {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    let mut phase: Vec<u64> = low.clone();
    phase.push(h);
    tick_until(&clock, &live, "the preemption phase's jobs finished", all_finished(phase)).await;

    // 3. Harvesting: a low-priority filler on one node, a priority-5
    // replica on the other; asleep, the replica lends its GPUs to a waiting
    // low-priority job; woken, it takes them back after the borrower's notice.
    let filler = submit(agent_job(&d, 4, 1)).await;
    until_running(&api, filler).await;
    let mut replica = agent_job(&d, 4, 1);
    replica.priority = 5;
    let r = submit(replica).await;
    let rj = until_running(&api, r).await;
    let allocs = hub.list_agents(pb::ListAgentsRequest::default()).await.unwrap().into_inner().allocations;
    let pid = allocs.iter().find(|x| x.id == rj.runs[0].allocation_id).expect("the replica's allocation").pid;
    let borrower = submit(agent_job(&d, 2, 1)).await;
    crate::live_replay::settle(&live);
    assert_eq!(find(&sample().await, borrower).state, "pending");
    api.sleep_job(pb::SleepJobRequest { job_id: r }).await.unwrap();
    let lent = tick_until(&clock, &live, "the replica asleep and the borrower on its GPUs", || {
        let sample = sample.clone();
        async move {
            let js = sample().await;
            let asleep = js.iter().any(|j| j.id == r && j.sleep == "asleep" && !j.runs.is_empty() && j.runs.iter().all(|x| x.state == "sleeping"));
            js.into_iter().find(|j| asleep && j.id == borrower && j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|x| x.state == "running"))
        }
    })
    .await;
    assert!(task_asleep(pid), "the replica's process is not asleep");
    assert!(lent.runs[0].node == rj.runs[0].node && lent.runs[0].gpus.iter().all(|g| rj.runs[0].gpus.contains(g)), "the borrower runs on the replica's GPUs: {lent:?}");
    api.wake_job(pb::SleepJobRequest { job_id: r }).await.unwrap();
    tick_until(&clock, &live, "the replica awake again", || {
        let sample = sample.clone();
        async move { sample().await.into_iter().find(|j| j.id == r && j.sleep == "awake" && j.state == "running" && !j.runs.is_empty() && j.runs.iter().all(|x| x.state == "running")) }
    })
    .await;
    assert!(!task_asleep(pid), "the replica's process is still asleep");
    let noted = std::fs::read_to_string(d.join(format!("ckpt-{}", lent.runs[0].allocation_id))).unwrap_or_default();
    assert_eq!(noted.trim(), lent.runs[0].allocation_id.to_string(), "no checkpoint notice for the borrower");
    for id in [filler, r, borrower] {
        std::fs::write(d.join(format!("release-{id}")), "0").unwrap();
    }
    tick_until(&clock, &live, "the harvest phase's jobs finished", all_finished(vec![filler, r, borrower])).await;
    let end_s = clock.unix_ms() / 1000;

    // The capture: exported with the CLI, replayed exactly.
    let (events, report) = replays_exactly(&d, &url, &state, 15);
    let mut inputs = BTreeSet::new();
    let mut decided = BTreeSet::new();
    let mut times = 0;
    for line in std::fs::read_to_string(&events).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        if let Some(input) = v["input"].as_str() {
            inputs.insert(input.to_string());
        }
        if let Some(now) = v["now"].as_u64() {
            assert!((T0_S..=end_s).contains(&now), "a time off the test's clock ({now} s, the run was {T0_S}..{end_s} s): {line}");
            times += 1;
        }
        for dec in v["decisions"].as_array().into_iter().flatten() {
            if let Some((kind, body)) = dec.as_object().and_then(|o| o.iter().next()) {
                decided.insert(if kind == "Evict" && body["wake"] == json!(true) { "Evict on wake".to_string() } else { kind.clone() });
            }
        }
    }
    assert!(times > 20, "{times} timed inputs");
    assert!(inputs.contains("replace_held"), "the move is not in the capture: {inputs:?}");
    for want in ["Place", "Evict", "Evict on wake", "Sleep", "Wake"] {
        assert!(decided.contains(want), "no {want} decision in the capture: {decided:?}\n{report}");
    }
    println!("one live run on a manual clock ({} s of it): {report}", end_s - T0_S);
    host.shutdown().await;
    let _ = std::fs::remove_dir_all(&d);
}

/// The `(same, all)` counts of an exact replay's segment lines.
fn identical(report: &str) -> (u64, u64) {
    let line = report.lines().find(|l| l.starts_with("segment ")).unwrap_or_else(|| panic!("no segment line:\n{report}"));
    let counts = line.split("decisions identical ").nth(1).unwrap_or_else(|| panic!("{line}"));
    let (same, all) = counts.split_once(" / ").unwrap();
    (same.parse().unwrap(), all.split_whitespace().next().unwrap().parse().unwrap())
}

/// The counterfactual's runs of `berth replay --events` with `args`, from
/// its JSON.
fn runs_of(d: &Path, events: &Path, args: &[&str]) -> (String, Vec<Value>) {
    let json = d.join("runs.json");
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--json", json.to_str().unwrap()]);
    let (ok, report) = replay(events, &all);
    assert!(ok, "{report}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, doc["runs"].as_array().unwrap().clone())
}

/// A trace turned into a capture (`berth capture convert`) is what a live
/// host given it would have recorded: its exact replay decides every one
/// of its placements and evictions again, and its counterfactual reads the
/// same jobs. An ASI-like day with preemption ranked by spot-gpu, and the
/// openb trace with each pod's own arrival and lifetime.
#[test]
fn a_trace_converted_to_a_capture_replays_exactly_and_under_other_policies() {
    let d = std::env::temp_dir().join(format!("berth-test-{}-capture-convert", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let asi = d.join("asi.events");
    let out = Command::new(BERTH)
        .args(["capture", "convert", "--fleet", "asi", "--fleet-scale", "0.05", "--days", "1", "--seed", "3", "--rank", "spot-gpu", "--out"])
        .arg(&asi)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (report, runs) = runs_of(&d, &asi, &["--policy", "binpack", "--policy", "spread"]);
    let (same, all) = identical(&report);
    assert!(same == all && all > 1000, "{report}");
    assert!(report.contains("spot-gpu@") && report.contains("binpack@"), "the converting versions by digest: {report}");
    let (live, binpack, spread) = (&runs[0], &runs[1], &runs[2]);
    assert!(live["evictions"].as_u64().unwrap() > 0, "preemption ran in the converted day: {live}");
    // The outcome column: the live run's work is what its jobs ran less
    // what evictions lost; a counterfactual's work is at most all of what
    // ran live (its jobs' durations are their live runs).
    let ran = live["done_gpu_h"].as_f64().unwrap() + live["lost_gpu_h"].as_f64().unwrap();
    for r in [live, binpack, spread] {
        let done = r["done_gpu_h"].as_f64().unwrap();
        assert!(done > 0.5 * ran && done <= ran + 1e-6, "{report}");
    }
    // A stricter contract (one interruption a day) evicts less.
    let (_, strict) = runs_of(&d, &asi, &["--policy", "binpack", "--contract", "per-day=1"]);
    assert!(strict[1]["evictions"].as_u64().unwrap() < binpack["evictions"].as_u64().unwrap(), "{strict:?}");
    for r in [binpack, spread] {
        assert_eq!(r["jobs"], live["jobs"], "the same arrivals in every run: {report}");
    }
    // Spread leaves more nodes partly used than the packing it was
    // converted with.
    assert!(spread["partly_used_nodes"].as_f64().unwrap() > 2.0 * live["partly_used_nodes"].as_f64().unwrap(), "{report}");
    // A tampered conversion is caught: the converting policy named wrongly
    // (binpack's placements decided by spread) differs at once.
    let text = std::fs::read_to_string(&asi).unwrap();
    let spread_sha = {
        let wasm = std::fs::read(crate::common::policy_path("spread")).unwrap();
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&wasm))
    };
    let binpack_sha = text.split("\"place\":{\"sha256\":\"").nth(1).unwrap()[..64].to_string();
    let swapped = d.join("swapped.events");
    std::fs::write(&swapped, text.replace(&binpack_sha, &spread_sha)).unwrap();
    let (ok, diff) = replay(&swapped, &[]);
    assert!(!ok && diff.contains("FIRST DIFFERENCE"), "{diff}");

    let Some(openb) = crate::replay::openb_dir() else { return };
    let pods = openb.join("openb_pod_list_default.csv");
    let timed = std::fs::read_to_string(&pods)
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split(',').collect();
            !f[8].is_empty() && !f[9].is_empty()
        })
        .count();
    let events = d.join("openb.events");
    let out = Command::new(BERTH).args(["capture", "convert", "--openb"]).arg(openb.join("openb_node_list_gpu_node.csv")).arg(&pods).arg("--out").arg(&events).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (report, runs) = runs_of(&d, &events, &["--policy", "fgd"]);
    let (same, all) = identical(&report);
    assert!(same == all && all as usize >= timed, "every pod placed and compared: {report}");
    assert_eq!(runs[0]["jobs"].as_u64().unwrap() as usize, timed, "{report}");
    assert_eq!(runs[1]["jobs"], runs[0]["jobs"], "{report}");
    assert!(runs.iter().all(|r| r["started"] == r["jobs"]), "{report}");
}

/// A policy that keeps state between calls (random's generator) answers
/// from a fresh instance each time a version is activated, live; the
/// capture numbers the instances, so an A-B-A (random, binpack, random
/// again) replays exactly: the second random starts its sequence over, as
/// the host's did, where one instance per version would have gone on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_activated_again_replays_from_a_fresh_instance() {
    use berth::proto as pb;

    use crate::serve::{client, config, job, settle, state_dir, upload, ACCESS};

    let state = state_dir("capture-aba");
    let h = berth::serve::start(config(&state, ACCESS)).await.unwrap();
    let mut ops = client(&h, "ops-test-token").await;
    let random = upload(&mut ops, "p0", crate::common::policy_path("random")).await;
    let mut alice = client(&h, "alice-test-token").await;
    for version in [random, 1, random] {
        ops.activate_policy(pb::ActivatePolicyRequest { partition: "p0".into(), version, ..Default::default() }).await.expect("activate");
        let mut ids = Vec::new();
        for _ in 0..6 {
            ids.push(alice.submit_job(job("p0", 1)).await.expect("submit").into_inner().job_id);
        }
        let all = settle(&mut ops, "p0").await;
        for id in ids {
            let j = all.iter().find(|j| j.id == id).unwrap();
            assert_eq!((j.state.as_str(), j.policy_version), ("running", version), "{j:?}");
        }
    }
    let d = state.join("replay");
    std::fs::create_dir_all(&d).unwrap();
    let (events, report) = replays_exactly(&d, &format!("http://{}", h.addr), &state, 18);
    assert!(report.contains("random@") && report.contains("binpack@"), "{report}");
    let text = std::fs::read_to_string(&events).unwrap();
    let random_sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(std::fs::read(crate::common::policy_path("random")).unwrap()))
    };
    let instances: std::collections::BTreeSet<u64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["input"] == "arms" && v["place"]["sha256"] == random_sha.as_str())
        .map(|v| v["place"]["instance"].as_u64().unwrap())
        .collect();
    assert_eq!(instances.len(), 2, "two instances of random noted: {instances:?}");
    // Numbered as one instance per version (an older capture), the same
    // file decides otherwise at the second activation.
    let mut merged = String::new();
    for line in text.lines() {
        match serde_json::from_str::<Value>(line) {
            Ok(mut v) if v["input"] == "arms" => {
                for role in ["place", "rank"] {
                    if let Some(r) = v.get_mut(role).and_then(Value::as_object_mut) {
                        r.remove("instance");
                    }
                }
                merged += &v.to_string();
            }
            _ => merged += line,
        }
        merged.push('\n');
    }
    let unnumbered = d.join("unnumbered.events");
    std::fs::write(&unnumbered, merged).unwrap();
    let (ok, diff) = replay(&unnumbered, &["--components", state.join("components").to_str().unwrap()]);
    assert!(!ok && diff.contains("FIRST DIFFERENCE"), "{diff}");
    h.shutdown().await;
}
