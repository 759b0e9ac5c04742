//! The web console of `berth serve` (`/console` on the metrics listener):
//! its HTTP API under the API's roles, then the page in a real headless
//! browser (chromium over WebDriver, as html_report.rs): a viewer sees the
//! placed job on the fleet and is refused an action; an operator switches a
//! shadow candidate on and the A/B plots fill. Screenshots go to
//! target/console/. The browser half is skipped where chromium is missing,
//! except under CI.

use std::path::Path;
use std::time::{Duration, Instant};

use berth::proto as pb;
use serde_json::{json, Value};

use crate::common::{policy_path, repo_root};
use crate::html_report::{find_tool, Driver};
use crate::serve::{client, config, job, settle, state_dir, upload};

const ACCESS: &str = r#"
[[identities]]
name = "ops"
token = "ops-console-token"
roles = { "*" = "operator" }

[[identities]]
name = "vera"
token = "vera-console-token"
roles = { "*" = "viewer" }
"#;

/// A job name that would run script if the page ever parsed data as markup.
const MARKUP: &str = "<img src=x onerror=\"document.title='pwned'\">";

/// The W3C WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub(crate) fn http(method: &str, url: &str, token: Option<&str>, body: Option<Value>) -> (u16, String, Option<String>) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(30))).build().into();
    let auth = token.map(|t| format!("Bearer {t}"));
    let r = match method {
        "GET" => {
            let mut req = agent.get(url);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            req.call()
        }
        _ => {
            let mut req = agent.post(url).header("Content-Type", "application/json");
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            req.send(body.unwrap_or(json!({})).to_string())
        }
    };
    let mut r = r.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let csp = r.headers().get("content-security-policy").map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap(), csp)
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.call("DELETE", &self.path(""), None);
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// A WebDriver session on one page.
pub(crate) struct Browser {
    driver: Driver,
    session: String,
    profile: std::path::PathBuf,
}

impl Browser {
    /// Headless chromium on `url`, or `None` (the test says it skips)
    /// where chromium or chromedriver is not installed.
    pub(crate) fn open(url: &str, name: &str) -> Option<Browser> {
        let (Some(chromedriver), Some(chromium)) =
            (find_tool(&["/usr/bin/chromedriver"]), find_tool(&["/usr/lib/chromium/chromium", "/usr/bin/chromium"]))
        else {
            crate::common::skip("the browser half: chromium or chromedriver is not installed (scripts/install-chromium.sh)");
            return None;
        };
        let driver = Driver::start(&chromedriver);
        let profile = std::env::temp_dir().join(format!("berth-test-{}-{name}-profile", std::process::id()));
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,3200",
                     format!("--user-data-dir={}", profile.display())]
        }}}});
        let session = driver.call("POST", "/session", Some(caps)).expect("a chromium session");
        let session = session["sessionId"].as_str().expect("session id").to_string();
        let b = Browser { driver, session, profile };
        b.driver.call("POST", &b.path("/url"), Some(json!({"url": url}))).unwrap();
        Some(b)
    }

    fn path(&self, p: &str) -> String {
        format!("/session/{}{p}", self.session)
    }

    pub(crate) fn run(&self, script: &str) -> Value {
        self.driver.call("POST", &self.path("/execute/sync"), Some(json!({"script": script, "args": []}))).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Finds `css` and acts on it; the page re-renders every poll, so an
    /// element gone stale in between is looked up again.
    fn element(&self, css: &str, action: &str, body: Value) {
        let mut last = String::new();
        for _ in 0..10 {
            let found = self.driver.call("POST", &self.path("/element"), Some(json!({"using": "css selector", "value": css})));
            match found.and_then(|e| {
                let id = e[ELEMENT].as_str().unwrap().to_string();
                self.driver.call("POST", &self.path(&format!("/element/{id}/{action}")), Some(body.clone()))
            }) {
                Ok(_) => return,
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("{action} on {css}: {last}");
    }

    pub(crate) fn click(&self, css: &str) {
        self.element(css, "click", json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        self.element(css, "value", json!({"text": text}));
    }

    /// Waits until `script` returns true (a liveness bound: the page polls
    /// every 2 s); on time out saves a screenshot and fails with `show`'s value.
    pub(crate) fn wait(&self, what: &str, script: &str, show: &str) {
        let limit = Instant::now() + Duration::from_secs(60);
        while Instant::now() < limit {
            if self.run(script) == Value::Bool(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        self.screenshot("timeout");
        panic!("waited 60 s for {what}: {}", self.run(show));
    }

    pub(crate) fn screenshot(&self, name: &str) -> usize {
        use base64::Engine;
        let shot = self.driver.call("GET", &self.path("/screenshot"), None).unwrap();
        let png = base64::engine::general_purpose::STANDARD.decode(shot.as_str().unwrap()).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        let dir = repo_root().join("target/console");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), &png).unwrap();
        eprintln!("screenshot: {}", dir.join(format!("{name}.png")).display());
        png.len()
    }

    pub(crate) fn sign_in(&self, token: &str, name: &str) {
        self.type_into("#token", token);
        self.click("#signin");
        self.wait(
            &format!("signed in as {name}"),
            &format!("return document.querySelector('#whoami').textContent.includes('Signed in as {name} ') && !document.querySelector('#main').hidden"),
            "return document.querySelector('#whoami').textContent + ' | ' + document.querySelector('#login-error').textContent",
        );
    }

    /// Clicks an action button of p0's placement hook and confirms it.
    fn act(&self, action: &str) {
        self.click(&format!("button.act[data-action='{action}'][data-partition='p0'][data-hook='place']"));
        self.wait("the confirmation", "return !document.querySelector('#confirm').hidden", "return document.querySelector('#confirm-text').textContent");
        self.click("#confirm-yes");
    }
}

fn notice_contains(text: &str) -> String {
    format!("return document.querySelector('#notice').textContent.includes({})", json!(text))
}

const NOTICE: &str = "return document.querySelector('#notice').textContent";

#[test]
fn console_shows_the_fleet_and_acts_by_role_in_headless_chromium() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = state_dir("console");
    let h = rt.block_on(berth::serve::start(config(&dir, ACCESS))).unwrap();
    let base = format!("http://{}", h.metrics_addr.unwrap());
    let mut ops = rt.block_on(client(&h, "ops-console-token"));
    let mut first = job("p0", 2);
    first.job.as_mut().unwrap().name = MARKUP.into();
    let first = rt.block_on(ops.submit_job(first)).unwrap().into_inner().job_id;
    rt.block_on(settle(&mut ops, "p0"));
    let v2 = rt.block_on(upload(&mut ops, "p0", policy_path("spread")));
    let candidate = |ops: &mut berth::client::Client| {
        let parts = rt.block_on(ops.list_partitions(pb::ListPartitionsRequest {})).unwrap().into_inner().partitions;
        parts.into_iter().find(|p| p.name == "p0").unwrap().shadow_mode
    };

    // The console's API answers as the gRPC API does: no token, 401; a
    // viewer's action, 403 and nothing changes; the page is locked down.
    let (status, page, csp) = http("GET", &format!("{base}/console"), None, None);
    assert_eq!(status, 200);
    assert!(page.contains("<title>Berth console</title>"));
    assert!(csp.is_some_and(|c| c.contains("script-src 'self'") && c.contains("frame-ancestors 'none'")));
    assert_eq!(http("GET", &format!("{base}/console/api/state"), None, None).0, 401);
    assert_eq!(http("GET", &format!("{base}/console/api/state"), Some("not-a-real-token"), None).0, 401);
    let shadow = json!({"partition": "p0", "hook": "place", "action": "shadow", "version": v2});
    let (status, body, _) = http("POST", &format!("{base}/console/api/action"), Some("vera-console-token"), Some(shadow.clone()));
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("vera holds role Viewer"), "{body}");
    assert_eq!(candidate(&mut ops), "off");
    let (status, body, _) = http("GET", &format!("{base}/console/api/state"), Some("vera-console-token"), None);
    assert_eq!(status, 200, "{body}");
    let state: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(state["identity"]["roles"]["p0"], "viewer");
    assert_eq!(state["fleet"].as_array().unwrap().len(), 96);
    assert!(state["jobs"].as_array().unwrap().iter().any(|j| j["id"] == first && j["state"] == "running" && j["spec"]["name"] == MARKUP));
    assert_eq!(state["compactions"], json!([]), "no compaction has run");

    let Some(b) = Browser::open(&format!("{base}/console"), "console") else {
        rt.block_on(h.shutdown());
        return;
    };

    // A viewer: the placed job on the fleet and in the jobs table, its name
    // as text.
    b.sign_in("vera-console-token", "vera");
    b.wait(
        "the placed job on the fleet",
        &format!(
            "const row = document.querySelector('#jobs tr[data-job=\"{first}\"]');
             return !!row && row.querySelector('.state').textContent === 'running'
                 && document.querySelectorAll('#fleet-grid .gpu.used').length >= 2
                 && document.querySelectorAll('#fleet-grid .node.partial').length >= 1"
        ),
        "return document.querySelector('#jobs tbody').textContent + ' | ' + document.querySelector('#fleet-summary').textContent",
    );
    let seen = b.run(&format!(
        "const row = document.querySelector('#jobs tr[data-job=\"{first}\"]');
         const placed = row.querySelector('.placement').textContent.split('[')[0];
         return {{
            name: row.querySelector('.name').textContent,
            markup: document.querySelectorAll('main img, main script').length,
            title: document.title,
            node: placed,
            nodeUsed: document.querySelectorAll(`#fleet-grid .node[data-node=\"${{placed}}\"] .gpu.used`).length,
            domains: document.querySelectorAll('#fleet-grid .domain').length,
            partitions: document.querySelectorAll('#partitions tbody tr').length,
            preemptions: document.querySelectorAll('#preemptions tbody tr').length,
            ledger: document.querySelector('#compactions tbody').textContent,
            total: document.querySelector('#acct tr[data-group=\"total\"]').textContent,
            acctHead: document.querySelector('#acct thead').textContent,
            outcomeRows: document.querySelectorAll('#outcome tbody tr').length,
            outcomeEmpty: !document.querySelector('#outcome-empty').hidden,
         }};"
    ));
    assert_eq!(seen["name"], MARKUP, "{seen}");
    assert_eq!(seen["markup"], 0, "data never becomes markup: {seen}");
    assert_eq!(seen["title"], "Berth console");
    assert_eq!(seen["nodeUsed"], 2, "the job's two GPUs on its node: {seen}");
    assert_eq!(seen["domains"], 6, "3 partitions of 32 nodes, 16 per switch: {seen}");
    assert_eq!(seen["partitions"], 9, "place, rank and compact hooks of 3 partitions: {seen}");
    assert_eq!(seen["preemptions"], 0, "nothing preempted: {seen}");
    assert_eq!(seen["ledger"], "no compaction chain has run", "{seen}");
    assert!(seen["total"].as_str().unwrap().contains("768.0"), "{seen}");
    let head = seen["acctHead"].as_str().unwrap();
    assert!(head.contains("Powered") && head.contains("Reclaimable"), "{seen}");
    // Simulated jobs report no work: the outcome says how to report it.
    assert_eq!((seen["outcomeRows"].as_u64(), seen["outcomeEmpty"].as_bool()), (Some(0), Some(true)), "{seen}");

    // The viewer tries to switch the shadow on: the server refuses it.
    b.act("shadow");
    b.wait("the viewer's refusal", &notice_contains("refused (403)"), NOTICE);
    let notice = b.run(NOTICE);
    assert!(notice.as_str().unwrap().contains("needs Operator"), "{notice}");
    b.screenshot("viewer");
    assert_eq!(candidate(&mut ops), "off", "a viewer changed nothing");

    // An operator switches version 2 on as a shadow; new jobs fill the plots.
    b.click("#signout");
    b.wait("signed out", "return !document.querySelector('#login').hidden && document.querySelectorAll('#jobs tbody tr').length === 0", NOTICE);
    b.sign_in("ops-console-token", "ops");
    b.act("shadow");
    b.wait("the operator's shadow", &notice_contains("shadow of p0 (place): done"), NOTICE);
    assert_eq!(candidate(&mut ops), "shadow");
    for _ in 0..8 {
        rt.block_on(ops.submit_job(job("p0", 1))).unwrap();
    }
    rt.block_on(settle(&mut ops, "p0"));
    b.wait(
        "the A/B plots",
        "const line = document.querySelector('#ab-agree-line');
         return document.querySelector('#ab-partition').value === 'p0' && !!line && line.points.numberOfItems >= 8
             && document.querySelectorAll('#ab-latency rect.bar[data-arm=\"shadow\"]').length >= 1
             && document.querySelectorAll('#ab-latency rect.bar[data-arm=\"active\"]').length >= 1",
        "const l = document.querySelector('#ab-agree-line'); return (l ? l.getAttribute('points') : 'no line') + ' | ' + document.querySelector('#ab-summary').textContent",
    );
    // The decision log filtered to the shadow arm.
    b.run("const f = document.querySelector('#f-arm'); f.value = 'shadow'; f.dispatchEvent(new Event('change')); return true;");
    b.wait(
        "the shadow decisions",
        "const rows = [...document.querySelectorAll('#decisions tbody tr')];
         return rows.length >= 8 && rows.every(r => r.dataset.arm === 'shadow')",
        "return document.querySelector('#decisions tbody').textContent.slice(0, 500)",
    );
    let seen = b.run(
        "return {
            candidate: document.querySelector('#partitions tr[data-partition=\"p0\"][data-hook=\"place\"] .candidate').textContent,
            line: document.querySelector('#ab-agree-line').getTotalLength(),
            plot: document.querySelector('#ab-agreement').getBoundingClientRect().width,
            samples: [...document.querySelectorAll('#ab-summary tr')].find(r => r.textContent.startsWith('Shadow samples')).querySelector('td').textContent,
            bars: [...document.querySelectorAll('#ab-latency rect.bar')].map(r => r.getBBox().height),
            gaps: [...document.querySelectorAll('#ab-gap polyline.series')].map(l => l.dataset.series),
            partial: [...document.querySelectorAll('#ab-partial polyline.series')].map(l => [l.dataset.series, l.points.numberOfItems]),
         };",
    );
    let shot = b.screenshot("operator");
    assert!(shot > 50_000, "a screenshot of {shot} bytes");
    assert!(seen["candidate"].as_str().unwrap().starts_with("shadow: spread@"), "{seen}");
    assert!(seen["line"].as_f64().unwrap() > 100.0 && seen["plot"].as_f64().unwrap() > 400.0, "the agreement plot laid out: {seen}");
    assert!(seen["samples"].as_str().unwrap().parse::<u64>().unwrap() >= 8, "{seen}");
    assert!(seen["bars"].as_array().unwrap().iter().all(|h| h.as_f64().unwrap() > 0.0), "{seen}");
    // Score gaps and partly used nodes per sample, a line per arm.
    assert!(!seen["gaps"].as_array().unwrap().is_empty(), "{seen}");
    let partial = seen["partial"].as_array().unwrap();
    assert_eq!(partial.len(), 2, "{seen}");
    assert!(partial.iter().all(|p| p[1].as_u64().unwrap() >= 8), "a point per shadow sample: {seen}");

    // The first job sleeps (a simulated job: at once): its two GPUs show
    // as lent on the fleet, idle or borrowed by low-priority work.
    let slept = rt.block_on(ops.sleep_job(pb::SleepJobRequest { job_id: first })).unwrap().into_inner();
    assert_eq!(slept.sleep, "asleep", "{slept:?}");
    b.wait(
        "the sleeping job's GPUs",
        &format!(
            "const row = document.querySelector('#jobs tr[data-job=\"{first}\"]');
             return !!row && row.querySelector('.state').textContent === 'asleep'
                 && document.querySelectorAll('#fleet-grid .gpu.sleeping, #fleet-grid .gpu.borrowed').length === 2"
        ),
        "return document.querySelector('#fleet-summary').textContent",
    );
    b.screenshot("harvest");

    // `berth policy report --html` from the real binary: one page that
    // opens offline with the same plots.
    let report = repo_root().join("target/console/ab-report.html");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["policy", "report", "--partition", "p0", "--html"])
        .arg(&report)
        .env("BERTH_SERVER", format!("http://{}", h.addr))
        .env("BERTH_TOKEN", "vera-console-token")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(&report).unwrap();
    assert!(!page.contains("<script") && !page.contains("src=") && !page.contains("href="), "self-contained");
    b.driver.call("POST", &b.path("/url"), Some(json!({"url": format!("file://{}", report.display())}))).unwrap();
    let seen = b.run(
        "return {
            title: document.title,
            line: document.querySelector('#agreement polyline').getTotalLength(),
            bars: document.querySelectorAll('#latency rect.bar').length,
            samples: document.querySelector('#summary').textContent,
         };",
    );
    b.screenshot("ab-report");
    assert_eq!(seen["title"], "Berth A/B: p0", "{seen}");
    assert!(seen["line"].as_f64().unwrap() > 100.0 && seen["bars"].as_u64().unwrap() >= 2, "{seen}");
    assert!(seen["samples"].as_str().unwrap().contains("Shadow samples"), "{seen}");

    drop(b);
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(Path::new(&dir));
}

/// The console's API answers only on a loopback listener: a bearer token
/// must not cross a network in plaintext. The page itself is served.
#[test]
fn the_console_api_refuses_to_answer_off_loopback() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = state_dir("console-wildcard");
    let mut cfg = config(&dir, ACCESS);
    cfg.metrics_listen = Some("0.0.0.0:0".parse().unwrap());
    let h = rt.block_on(berth::serve::start(cfg)).unwrap();
    let base = format!("http://127.0.0.1:{}", h.metrics_addr.unwrap().port());
    assert_eq!(http("GET", &format!("{base}/console"), None, None).0, 200);
    let (status, body, _) = http("GET", &format!("{base}/console/api/state"), Some("ops-console-token"), None);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("only on a loopback"), "{body}");
    let mut ops = rt.block_on(client(&h, "ops-console-token"));
    let v2 = rt.block_on(upload(&mut ops, "p0", policy_path("spread")));
    let shadow = json!({"partition": "p0", "hook": "place", "action": "shadow", "version": v2});
    let (status, body, _) = http("POST", &format!("{base}/console/api/action"), Some("ops-console-token"), Some(shadow));
    assert_eq!(status, 403, "{body}");
    let parts = rt.block_on(ops.list_partitions(pb::ListPartitionsRequest {})).unwrap().into_inner().partitions;
    assert_eq!(parts.iter().find(|p| p.name == "p0").unwrap().shadow_mode, "off", "the refused action changed nothing");
    rt.block_on(h.shutdown());
    let _ = std::fs::remove_dir_all(Path::new(&dir));
}
