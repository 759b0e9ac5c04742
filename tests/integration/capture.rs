//! Capture and replay of what a live partition was given (`berth capture
//! export`, `berth replay --events`). The exact re-decision check runs at
//! the end of the live tests that exercise a mechanism with real agents
//! (compaction, preemption, harvesting across a host restart: see
//! [`replays_exactly`]); here, the file format and its bounds, and a capture
//! replayed under other policies with its report in a headless browser.

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
