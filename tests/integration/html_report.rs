//! `berth replay --html`: the report is written by the real binary from a
//! real replay, then opened in a real headless browser (Debian's chromium,
//! driven over WebDriver by chromedriver on loopback), which must lay out
//! the plot and the tables. Skipped with a message where chromium or
//! chromedriver is missing (scripts/install-chromium.sh), except under CI.

use std::io::BufRead;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use berth::replay::report::{aggregate, curves_svg, escape_html, html, Curve, HtmlMeta, Published, MAX_ARRIVAL_PCT};
use berth::replay::{ReplayOutcome, RunSummary};

use crate::common::repo_root;

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("berth-test-{}-{name}", std::process::id()))
}

/// A small openb-format trace: 48 eight-GPU nodes, 700 pods of whole and
/// shared GPUs (five-column pod list), from a fixed linear congruential
/// sequence so it is the same every run.
fn write_trace(dir: &Path) -> (PathBuf, PathBuf) {
    let nodes = dir.join("nodes.csv");
    let pods = dir.join("html_pods.csv");
    let mut n = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for i in 0..48 {
        n.push_str(&format!("node-{i:03},96000,786432,8,{}\n", if i % 3 == 0 { "A10" } else { "V100M32" }));
    }
    let mut p = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n");
    let mut x: u64 = 12345;
    for i in 0..700 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let r = (x >> 33) % 100;
        let (num_gpu, gpu_milli) = match r {
            0..=39 => (1, 1000),
            40..=54 => (2, 1000),
            55..=62 => (4, 1000),
            63..=66 => (8, 1000),
            _ => (1, 100 * (1 + (x >> 20) % 9)),
        };
        p.push_str(&format!("pod-{i:04},{},{},{num_gpu},{gpu_milli}\n", 4000 + (x >> 40) % 8 * 1000, 16384));
    }
    std::fs::write(&nodes, n).unwrap();
    std::fs::write(&pods, p).unwrap();
    (nodes, pods)
}

/// Published figures for the test trace, in the FGD CSV's format. Invented
/// for the test (this trace was never published): they check that the
/// report puts published means beside Berth's and computes the difference.
fn write_published(dir: &Path) -> PathBuf {
    let path = dir.join("fgd_published_unallocated.csv");
    let mut text = String::from("workload,policy,arrived_pct,unallocated_pct_mean,unallocated_pct_min,unallocated_pct_max,seeds\n");
    for (pct, mean) in [(90, 12.5), (95, 10.25), (100, 8.0), (110, 6.5), (130, 5.0)] {
        text.push_str(&format!("html_pods,06-FGD,{pct},{mean},{mean},{mean},10\n"));
    }
    std::fs::write(&path, text).unwrap();
    path
}

pub(crate) fn find_tool(candidates: &[&str]) -> Option<PathBuf> {
    candidates.iter().map(PathBuf::from).find(|p| p.is_file()).or_else(|| {
        let name = Path::new(candidates[0]).file_name()?.to_owned();
        std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(&name)).find(|p| p.is_file())
    })
}

/// chromedriver on a loopback port, killed when dropped.
pub(crate) struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    pub(crate) fn start(binary: &Path) -> Driver {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = Command::new(binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        // chromedriver prints a line once it listens.
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || std::io::BufReader::new(stdout).lines().for_each(drop));
        let driver = Driver { child, url: format!("http://127.0.0.1:{port}") };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(status) = driver.call("GET", "/status", None) {
                if status["ready"] == true {
                    return driver;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not become ready on port {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One WebDriver command; returns its `value`, or an error naming the
    /// command and WebDriver's message.
    pub(crate) fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let url = format!("{}{path}", self.url);
        let response = match (method, body) {
            ("GET", _) => agent.get(&url).call(),
            ("DELETE", _) => agent.delete(&url).call(),
            (_, body) => agent.post(&url).header("Content-Type", "application/json").send(body.unwrap_or_else(|| json!({})).to_string()),
        };
        let mut response = response.map_err(|e| format!("{method} {path}: {e}"))?;
        let status = response.status();
        let text = response.body_mut().with_config().limit(64 << 20).read_to_string().map_err(|e| format!("{method} {path}: {e}"))?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| format!("{method} {path}: {e}: {text}"))?;
        let value = doc.get("value").cloned().unwrap_or(Value::Null);
        if !status.is_success() || value.get("error").is_some() {
            return Err(format!("{method} {path}: HTTP {status}: {value}"));
        }
        Ok(value)
    }
}

#[test]
fn replay_html_report_renders_in_headless_chromium() {
    let dir = scratch("html-report");
    std::fs::create_dir_all(&dir).unwrap();
    let (nodes, pods) = write_trace(&dir);
    let published = write_published(&dir);
    let html = dir.join("report.html");
    let json_path = dir.join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["replay", "--policy", "fgd", "--policy", "best-fit", "--policy", "random", "--seeds", "1-3", "--quiet"])
        .arg("--nodes")
        .arg(&nodes)
        .arg("--pods")
        .arg(&pods)
        .arg("--published")
        .arg(&published)
        .arg("--html")
        .arg(&html)
        .arg("--json")
        .arg(&json_path)
        .env("BERTH_POLICY_DIR", repo_root().join("target/policies"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(&html).unwrap();

    // Self-contained: nothing is fetched. The only URL is the SVG namespace.
    for needle in ["<script", "<link", "<img", "<iframe", "src=", "href=", "@import", "url("] {
        assert!(!page.contains(needle), "the report contains {needle:?}");
    }
    let urls: Vec<&str> = page.match_indices("http").map(|(i, _)| &page[i..(i + 30).min(page.len())]).collect();
    assert!(urls.iter().all(|u| u.starts_with("http://www.w3.org/2000/svg")), "{urls:?}");
    // The published figures sit beside Berth's, with the difference.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let fgd_100 = doc["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["policy"] == "fgd" && r["arrived_pct"] == 100)
        .and_then(|r| r["unallocated_pct_mean"].as_f64())
        .expect("fgd reached 100% arrival");
    assert!(page.contains(&format!("<td>{:+.2}</td>", fgd_100 - 8.0)), "fgd's difference from the published 8.00 at 100%");
    assert!(page.contains("<td>8.00</td>") && page.contains("<td>10.25</td>"));

    let (Some(chromedriver), Some(chromium)) =
        (find_tool(&["/usr/bin/chromedriver"]), find_tool(&["/usr/lib/chromium/chromium", "/usr/bin/chromium"]))
    else {
        crate::common::skip("the browser half: chromium or chromedriver is not installed (scripts/install-chromium.sh)");
        return;
    };
    let driver = Driver::start(&chromedriver);
    let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": chromium,
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,1900",
                 "--user-data-dir=".to_string() + &dir.join("chromium-profile").to_string_lossy()]
    }}}});
    let session = driver.call("POST", "/session", Some(caps)).expect("a chromium session");
    let id = session["sessionId"].as_str().expect("session id").to_string();
    let s = |path: &str| format!("/session/{id}{path}");
    let file_url = format!("file://{}", html.canonicalize().unwrap().display());
    driver.call("POST", &s("/url"), Some(json!({"url": file_url}))).unwrap();

    // Measured by the browser's layout: the plot has a size, each policy's
    // curve has a length and its band an area, the tables have their rows.
    let script = r#"
        const svg = document.querySelector('#curves svg');
        const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
        const lines = [...document.querySelectorAll('#curves svg polyline')].map(p => p.getTotalLength());
        const bands = [...document.querySelectorAll('#curves svg polygon')].map(p => { const b = p.getBBox(); return [b.width, b.height]; });
        const texts = [...document.querySelectorAll('#curves svg text')].map(t => t.textContent.trim());
        return {
            title: document.title,
            svg: [box.width, box.height],
            lines, bands, texts,
            circles: document.querySelectorAll('#curves svg circle').length,
            summary: [...document.querySelectorAll('#summary tbody tr')].map(r => r.className),
            runs: document.querySelectorAll('#runs tbody tr').length,
            summaryHeight: document.querySelector('#summary').getBoundingClientRect().height,
        };"#;
    let seen = driver.call("POST", &s("/execute/sync"), Some(json!({"script": script, "args": []}))).unwrap();
    let screenshot = driver.call("GET", &s("/screenshot"), None).unwrap();
    let _ = driver.call("DELETE", &s(""), None);
    drop(driver);

    use base64::Engine;
    let png = base64::engine::general_purpose::STANDARD.decode(screenshot.as_str().unwrap()).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000, "a screenshot of {} bytes", png.len());
    let keep = repo_root().join("target/html-report");
    std::fs::create_dir_all(&keep).unwrap();
    std::fs::write(keep.join("report.png"), &png).unwrap();
    std::fs::copy(&html, keep.join("report.html")).unwrap();
    eprintln!("screenshot: {}", keep.join("report.png").display());

    assert_eq!(seen["title"], "Berth replay: html_pods", "{seen}");
    let size = |v: &Value, i: usize| v[i].as_f64().unwrap();
    assert!(size(&seen["svg"], 0) > 600.0 && size(&seen["svg"], 1) > 300.0, "plot laid out: {seen}");
    // Three policies: three curves (and three legend strokes, paths not
    // polylines), each longer than the plot is wide, and three bands.
    let lines: Vec<f64> = seen["lines"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert!(lines.iter().filter(|&&l| l > 500.0).count() >= 3, "curves: {lines:?}");
    let bands = seen["bands"].as_array().unwrap();
    assert!(bands.len() >= 3 && bands.iter().all(|b| size(b, 0) > 400.0 && size(b, 1) > 0.0), "bands: {bands:?}");
    let texts: Vec<&str> = seen["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    for label in ["fgd", "best-fit", "random", "unallocated GPU %"] {
        assert!(texts.contains(&label), "{label} in the plot's text: {texts:?}");
    }
    assert_eq!(seen["circles"], 5, "the five published means of fgd");
    // fgd has Berth, published and difference rows; the others one each.
    let rows: Vec<&str> = seen["summary"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert_eq!(rows, ["berth", "published", "diff", "berth", "berth"]);
    assert_eq!(seen["runs"], 9, "3 policies x 3 seeds");
    assert!(seen["summaryHeight"].as_f64().unwrap() > 50.0);
    let _ = std::fs::remove_dir_all(&dir);
}

// The page itself, without a browser: escaping, bands, published rows.

fn outcome(policy: &str) -> ReplayOutcome {
    let curves: Vec<Curve> =
        (0..2).map(|s| (0..=MAX_ARRIVAL_PCT).map(|p| (p > 0).then(|| 100.0 - p as f64 * 0.5 + s as f64)).collect()).collect();
    ReplayOutcome {
        policies: vec![policy.to_string()],
        rows: aggregate(policy, &curves),
        runs: vec![RunSummary { policy: policy.to_string(), seed: 1, pods_offered: 10, pods_placed: 9, final_unallocated_pct: 35.0 }],
    }
}

fn meta(source: &str) -> HtmlMeta<'_> {
    HtmlMeta { source, seeds: &[1, 2], mode: "wasm", keep_order: false, elapsed_s: 0.5, published_from: None }
}

#[test]
fn guest_and_user_text_is_escaped() {
    let evil = "<script>alert(1)</script>\"'&";
    let page = html(&meta("pods<b>"), &outcome(evil), &Published::new()).unwrap();
    assert!(!page.contains("<script") && !page.contains("pods<b>"), "{page}");
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#39;&amp;"));
    assert!(page.contains("pods&lt;b&gt;"));
    assert_eq!(escape_html("a\u{7}b"), "a\u{fffd}b");
}

#[test]
fn bands_span_min_to_max_and_published_rows_appear_only_when_known() {
    let o = outcome("fgd");
    // Two seeds one point apart: the band is as wide as the difference.
    let at_100 = o.rows.iter().find(|r| r.arrived_pct == 100).unwrap();
    assert_eq!((at_100.unallocated_pct_min, at_100.unallocated_pct_max), (50.0, 51.0));
    let svg = curves_svg("t", &o.rows, &o.policies, &Published::new()).unwrap();
    assert_eq!(svg.matches("<polygon").count(), 1, "one band");
    let page = html(&meta("trace"), &o, &Published::new()).unwrap();
    assert!(!page.contains("class=\"published\""));
    let mut published = Published::new();
    published.insert(("fgd".into(), 100), 49.0);
    let page = html(&meta("trace"), &o, &published).unwrap();
    assert!(page.contains("<tr class=\"published\"><td>published</td><td>-</td><td>-</td><td>49.00</td>"), "{page}");
    assert!(page.contains("<td>+1.50</td>"), "50.5 - 49.0");
    assert_eq!(page.matches("<circle").count(), 1, "the one published mean is marked");
    assert!(page.contains("seeds 1-2"));
}
