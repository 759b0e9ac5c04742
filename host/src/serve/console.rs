//! The web console: one page shipped inside the binary (`console.html` and
//! `console.js`, no build step) on the metrics listener at `/console`, and
//! the JSON it polls under `/console/api/`.
//!
//! Every read and every action goes through the gRPC service's own methods
//! with the caller's `authorization` header as metadata, so the console has
//! exactly the API's identities, roles and checks (a viewer sees, an
//! operator acts; a refusal is the API's, answered 401/403). Only the
//! per-GPU fleet picture is read from the live state directly, for the
//! partitions the caller may view.
//!
//! The metrics listener is plaintext, so the API is answered only when it
//! listens on loopback: a bearer token must not cross a network in clear
//! (reach a remote host's console through an SSH tunnel).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{json, Value};
use tonic::Code;

use super::auth::Identity;
use crate::proto::{self as pb, berth_server::Berth};
use super::service::Service;
use super::error::ServeError;

const PAGE: &str = include_str!("console.html");
const SCRIPT: &str = include_str!("console.js");

/// Longest string the console passes on (job names, notes, details): cut
/// and made printable by [`crate::text::printable`].
const MAX_TEXT: usize = 4096;
/// Pending jobs explained per poll (each explanation scans the partition).
const EXPLAINED: usize = 20;
/// Jobs listed per poll.
const JOBS: u32 = 200;
/// Compaction chains listed per poll (newest first).
const COMPACTIONS: u32 = 50;

/// Shared by the handlers.
struct Console {
    service: Service,
    /// The listener is on loopback: the API may be answered.
    loopback: bool,
}

/// The console's routes, to merge into the metrics router.
pub fn router(service: Service, loopback: bool) -> axum::Router {
    let c = Arc::new(Console { service, loopback });
    let (c1, c2, c3, c4) = (c.clone(), c.clone(), c.clone(), c.clone());
    axum::Router::new()
        .route("/console", get(|| async { page("text/html; charset=utf-8", PAGE) }))
        .route("/console/", get(|| async { page("text/html; charset=utf-8", PAGE) }))
        .route("/console/console.js", get(|| async { page("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/console/api/state", get(move |h: HeaderMap| async move { c1.state(&h).await.unwrap_or_else(|e| e) }))
        .route("/console/api/decisions", get(move |h: HeaderMap, u: Uri| async move { c2.decisions(&h, &u).await.unwrap_or_else(|e| e) }))
        .route("/console/api/ab", get(move |h: HeaderMap, u: Uri| async move { c3.ab(&h, &u).await.unwrap_or_else(|e| e) }))
        .route("/console/api/action", post(move |h: HeaderMap, b: Bytes| async move { c4.action(&h, &b).await.unwrap_or_else(|e| e) }))
}

/// A static asset, with a policy that lets it run only its own script and
/// talk only to its own origin, never inside a frame.
fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

type Answer = Result<Response, Response>;

/// JSON, never cached (it carries what a token may see).
fn reply(status: StatusCode, mut body: Value) -> Response {
    printable(&mut body);
    (status, [(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-store"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")], body.to_string())
        .into_response()
}

fn ok(body: Value) -> Answer {
    Ok(reply(StatusCode::OK, body))
}

/// The HTTP status of an API refusal or failure.
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::FailedPrecondition | Code::AlreadyExists => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn refused(s: tonic::Status) -> Response {
    let status = http_status(s.code());
    reply(status, json!({"error": s.message(), "code": format!("{:?}", s.code())}))
}

/// Every string of a reply made printable and bounded (guest and caller
/// text: job names, policy names, notes, details); the page then puts it
/// in the DOM as text only.
fn printable(v: &mut Value) {
    match v {
        Value::String(s) => {
            if let std::borrow::Cow::Owned(o) = crate::text::printable(s, MAX_TEXT) {
                *s = o;
            }
        }
        Value::Array(a) => a.iter_mut().for_each(printable),
        Value::Object(o) => o.values_mut().for_each(printable),
        _ => {}
    }
}

fn to_json<T: serde::Serialize>(t: &T) -> Value {
    serde_json::to_value(t).unwrap_or(Value::Null)
}

/// `key=value` pairs of a query string, percent-decoded.
fn query(uri: &Uri) -> BTreeMap<String, String> {
    fn hex(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    fn decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
                (b'%', Some(hi), Some(lo)) => {
                    out.push(hi << 4 | lo);
                    i += 2;
                }
                (b'+', ..) => out.push(b' '),
                (c, ..) => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

impl Console {
    /// The caller, by the API's token check; refusals are counted as the
    /// API counts them.
    fn identity(&self, headers: &HeaderMap) -> Result<Identity, Response> {
        if !self.loopback {
            return Err(reply(
                StatusCode::FORBIDDEN,
                json!({"error": "the console answers only on a loopback --metrics-listen: tokens would cross the network in plaintext (use an SSH tunnel)"}),
            ));
        }
        let value = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or("\u{fffd}"));
        let id = match value {
            Some(v) => self.service.live.access.identify_bearer(v),
            None => Err(ServeError::Unauthenticated("no credentials: sign in with a bearer token".into())),
        };
        id.map_err(|e| {
            self.service.live.metrics.api_denials.with_label_values(&["unauthenticated"]).inc();
            refused(e.into())
        })
    }

    /// A request to the service carrying the caller's credentials.
    fn request<T>(&self, headers: &HeaderMap, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        if let Some(v) = headers.get(header::AUTHORIZATION)
            && let Ok(v) = v.to_str().unwrap_or("").parse::<tonic::metadata::AsciiMetadataValue>()
        {
            req.metadata_mut().insert("authorization", v);
        }
        req
    }

    /// Everything the console shows but the decision log and the A/B report.
    async fn state(&self, h: &HeaderMap) -> Answer {
        let id = self.identity(h)?;
        let svc = &self.service;
        let live = &svc.live;
        let partitions = svc.list_partitions(self.request(h, pb::ListPartitionsRequest {})).await.map_err(refused)?.into_inner().partitions;
        let mut parts = Vec::new();
        let mut pools = Vec::new();
        for p in &partitions {
            let mut row = to_json(p);
            row["role"] = json!(id.role_in(&p.name).map(|r| format!("{r:?}").to_lowercase()));
            let is_pool = live.pool_partitions.contains(&p.name);
            row["is_pool"] = json!(is_pool);
            if is_pool
                && let Ok(status) = svc.pool_status(self.request(h, pb::PoolStatusRequest { partition: p.name.clone() })).await
            {
                pools.push(super::pooling::status_json(status.get_ref()));
            }
            let hooks: &[&str] = if is_pool { &["place", "rank", "compact", "pool"] } else { &["place", "rank", "compact"] };
            for &hook in hooks {
                let req = pb::PolicyHistoryRequest { partition: p.name.clone(), hook: hook.into() };
                let history = svc.policy_history(self.request(h, req)).await.map_err(refused)?.into_inner();
                let mut history = to_json(&history);
                // The newest events first, a few: the page shows the latest.
                if let Some(events) = history["events"].as_array_mut() {
                    events.reverse();
                    events.truncate(12);
                }
                row[hook] = history;
            }
            parts.push(row);
        }
        let req = pb::ListJobsRequest { limit: JOBS, ..Default::default() };
        let jobs = svc.list_jobs(self.request(h, req)).await.map_err(refused)?.into_inner().jobs;
        let mut job_rows = Vec::new();
        let mut explained = 0;
        for j in &jobs {
            let mut row = to_json(j);
            if j.state == "pending" && explained < EXPLAINED {
                explained += 1;
                if let Ok(e) = svc.explain_job(self.request(h, pb::ExplainJobRequest { job_id: j.id, ..Default::default() })).await {
                    row["explain"] = to_json(e.get_ref());
                }
                let p = j.spec.as_ref().and_then(|s| live.partition_index(&s.partition).ok());
                if let Some(p) = p {
                    let reserved = crate::util::may_block(|| live.partitions[p].lock_state().jobs.get(&j.id).map_or(0, |r| r.reserved_until_s));
                    row["reserved_until_s"] = json!(reserved);
                }
            }
            job_rows.push(row);
        }
        let accounting = svc.accounting(self.request(h, pb::AccountingRequest::default())).await.map_err(refused)?.into_inner();
        let credits = svc.credits(self.request(h, pb::CreditsRequest::default())).await.map_err(refused)?.into_inner().rows;
        let req = pb::ListCompactionsRequest { partition: String::new(), limit: COMPACTIONS };
        let compactions = svc.list_compactions(self.request(h, req)).await.map_err(refused)?.into_inner().chains;
        let fleet = self.fleet(&id, partitions.iter().map(|p| p.name.as_str()));
        ok(json!({
            "identity": {
                "name": id.name,
                "roles": partitions.iter().map(|p| (p.name.clone(), json!(id.role_in(&p.name).map(|r| format!("{r:?}").to_lowercase())))).collect::<serde_json::Map<_, _>>(),
            },
            "partitions": parts,
            "jobs": job_rows,
            "accounting": to_json(&accounting),
            "credits": credits.iter().map(to_json).collect::<Vec<_>>(),
            "compactions": compactions.iter().map(to_json).collect::<Vec<_>>(),
            "pools": pools,
            "fleet": fleet,
        }))
    }

    /// Each node of the partitions `names` (those ListPartitions gave the
    /// caller) with each GPU's state: free, used, shared (partly used),
    /// held (an operator's allocation or fenced off a lost node),
    /// unhealthy, sleeping (lent by a sleeping job, idle) or borrowed (lent
    /// and used by low-priority work).
    fn fleet<'a>(&self, id: &Identity, names: impl Iterator<Item = &'a str>) -> Value {
        let live = &self.service.live;
        let agents = self.service.agents.as_ref().map(|h| h.node_states()).unwrap_or_default();
        let mut nodes = Vec::new();
        for name in names {
            let Ok(p) = live.partition_index(name) else { continue };
            if !id.can_view(name) {
                continue;
            }
            let st = crate::util::may_block(|| live.partitions[p].lock_state());
            let lent = st.engine.lent();
            let mut held: BTreeMap<u32, u64> = BTreeMap::new();
            for a in st.manual.values() {
                *held.entry(a.node).or_default() |= a.gpus;
            }
            for (i, n) in st.fleet.nodes().iter().enumerate() {
                let i = i as u32;
                let gpus: Vec<&str> = n
                    .gpus
                    .iter()
                    .enumerate()
                    .map(|(g, &free)| {
                        if st.health.contains_key(&(i, g as u32)) {
                            "unhealthy"
                        } else if held.get(&i).is_some_and(|m| m & (1 << g) != 0) {
                            "held"
                        } else if lent.get(&i).is_some_and(|m| m & (1 << g) != 0) {
                            // A sleeping job's GPU: idle, or borrowed by low-priority work.
                            if free == berth_core::MILLI_PER_GPU { "sleeping" } else { "borrowed" }
                        } else if free == berth_core::MILLI_PER_GPU {
                            "free"
                        } else if free == 0 {
                            "used"
                        } else {
                            "shared"
                        }
                    })
                    .collect();
                let free = gpus.iter().filter(|&&g| g == "free").count();
                nodes.push(json!({
                    "name": n.name,
                    "partition": name,
                    "model": n.model.map_or_else(|| "cpu-only".into(), |m| st.fleet.models[m as usize].clone()),
                    "switch_domain": n.switch_domain,
                    "schedulable": n.schedulable,
                    "state": if st.agent_ids.contains_key(&n.name) { agents.get(&n.name).map_or("registered", |a| a.0.as_str()) } else { "simulated" },
                    "gpus": gpus,
                    "partial": free > 0 && free < gpus.len(),
                }));
            }
        }
        Value::Array(nodes)
    }

    /// The decision log, newest first, filtered by partition, job and
    /// version (by the API) and by arm and outcome.
    async fn decisions(&self, h: &HeaderMap, uri: &Uri) -> Answer {
        self.identity(h)?;
        let q = query(uri);
        let get = |k: &str| q.get(k).map(|s| s.trim().to_string()).unwrap_or_default();
        let number = |k: &str| -> Result<u64, Response> {
            let s = get(k);
            if s.is_empty() {
                return Ok(0);
            }
            s.parse().map_err(|_| reply(StatusCode::BAD_REQUEST, json!({"error": format!("{k} must be a number")})))
        };
        let (arm, outcome) = (get("arm"), get("outcome"));
        let limit = match number("limit")? {
            0 => 100,
            n => n.min(1000) as usize,
        };
        let req = pb::QueryDecisionsRequest {
            partition: get("partition"),
            job_id: number("job")?,
            policy_version: number("version")? as u32,
            limit: 20_000,
            include_shadow: true,
        };
        let all = self.service.query_decisions(self.request(h, req)).await.map_err(refused)?.into_inner().decisions;
        let rows: Vec<Value> = all
            .iter()
            .filter(|d| arm.is_empty() || d.arm == arm)
            .filter(|d| outcome.is_empty() || d.outcome == outcome)
            .take(limit)
            .map(to_json)
            .collect();
        ok(json!({ "decisions": rows }))
    }

    /// A partition's A/B report, with the series the page plots.
    async fn ab(&self, h: &HeaderMap, uri: &Uri) -> Answer {
        self.identity(h)?;
        let partition = query(uri).remove("partition").unwrap_or_default();
        let report = self.service.shadow_report(self.request(h, pb::ShadowReportRequest { partition: partition.clone(), ..Default::default() })).await.map_err(refused)?.into_inner();
        let req = pb::QueryDecisionsRequest { partition, limit: 20_000, include_shadow: true, ..Default::default() };
        let log = self.service.query_decisions(self.request(h, req)).await.map_err(refused)?.into_inner().decisions;
        let candidate = report.candidate.as_ref().map(|c| c.version);
        let series = ab_series(&log, candidate);
        let mut out = to_json(&report);
        out["series"] = series;
        ok(out)
    }

    /// An operator action, by the API's own method (which checks the role).
    async fn action(&self, h: &HeaderMap, body: &[u8]) -> Answer {
        self.identity(h)?;
        let bad = |m: String| reply(StatusCode::BAD_REQUEST, json!({"error": m}));
        let a: Value = serde_json::from_slice(body).map_err(|e| bad(format!("body: {e}")))?;
        let text = |k: &str| a[k].as_str().unwrap_or("").to_string();
        let (partition, hook, action) = (text("partition"), text("hook"), text("action"));
        let version = a["version"].as_u64().unwrap_or(0).min(u64::from(u32::MAX)) as u32;
        let svc = &self.service;
        let done = match action.as_str() {
            "activate" => {
                let r = svc.activate_policy(self.request(h, pb::ActivatePolicyRequest { partition, version, hook })).await.map_err(refused)?;
                to_json(r.get_ref())
            }
            "rollback" => {
                let r = svc.rollback_policy(self.request(h, pb::RollbackPolicyRequest { partition, version, hook })).await.map_err(refused)?;
                to_json(r.get_ref())
            }
            "shadow" | "split" | "off" => {
                if action == "split" && !hook.is_empty() && hook != "place" {
                    return Err(bad(format!("a split runs on the place hook; a {hook} candidate runs in shadow")));
                }
                let mode = match action.as_str() {
                    "shadow" => pb::ShadowMode::Shadow,
                    "split" => pb::ShadowMode::Split,
                    _ => pb::ShadowMode::Off,
                };
                let fraction = a["fraction"].as_f64().unwrap_or(0.0);
                svc.set_shadow(self.request(h, pb::SetShadowRequest { partition, version, mode: mode as i32, fraction, hook })).await.map_err(refused)?;
                json!({})
            }
            other => return Err(bad(format!("unknown action {other:?}: activate, rollback, shadow, split or off"))),
        };
        ok(json!({ "done": action, "result": done }))
    }
}

/// Upper bounds (µs) of the latency histogram's buckets; the last is open.
pub const LATENCY_BUCKETS_US: [u64; 8] = [100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000];

/// The A/B series of a partition's decision log (any order): for each
/// shadow decision of the candidate (`candidate`: its version; any when
/// `None`), oldest first, whether the actuated decision of the same job
/// that followed it placed the same, and the running agreement rate; and a
/// latency histogram of each arm.
pub fn ab_series(log: &[pb::Decision], candidate: Option<u32>) -> Value {
    let mut sorted: Vec<&pb::Decision> = log.iter().collect();
    sorted.sort_by_key(|d| d.id);
    // Each job's actuated decisions, by position in `sorted`.
    let mut actuated: std::collections::HashMap<u64, Vec<usize>> = std::collections::HashMap::new();
    for (k, d) in sorted.iter().enumerate().filter(|(_, d)| d.actuated) {
        actuated.entry(d.job_id).or_default().push(k);
    }
    let mut agreement = Vec::new();
    let mut agreed = 0u64;
    for (k, d) in sorted.iter().enumerate() {
        if d.arm != "shadow" || candidate.is_some_and(|v| v != d.policy_version) {
            continue;
        }
        // The active arm decides the same job right after its shadow.
        let after = actuated.get(&d.job_id).and_then(|ks| ks.iter().find(|&&a| a > k));
        let Some(a) = after.map(|&a| sorted[a]) else { continue };
        let same = a.outcome == d.outcome && a.placements == d.placements;
        agreed += u64::from(same);
        let n = agreement.len() as u64 + 1;
        agreement.push(json!({"id": d.id, "unix_ms": d.unix_ms, "job": d.job_id, "agree": same, "rate": agreed as f64 / n as f64}));
    }
    let mut latency: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for d in &sorted {
        // Not placement decisions: no latency of their own.
        if d.arm == "rank" || d.arm == "harvest" {
            continue;
        }
        let counts = latency.entry(d.arm.clone()).or_insert_with(|| vec![0; LATENCY_BUCKETS_US.len() + 1]);
        let bucket = LATENCY_BUCKETS_US.iter().position(|&b| d.latency_us <= b).unwrap_or(LATENCY_BUCKETS_US.len());
        counts[bucket] += 1;
    }
    json!({"agreement": agreement, "latency_buckets_us": LATENCY_BUCKETS_US, "latency": latency})
}

/// `berth policy report --html`: the A/B report of `partition` as one
/// self-contained page (no script, nothing fetched): the figures, the
/// agreement over shadow samples and the latency histogram per arm as
/// inline SVG, the split arms and the latest differences.
pub fn report_html(partition: &str, r: &pb::ShadowReportResponse, log: &[pb::Decision]) -> String {
    use crate::replay::report::escape_html as e;
    use std::fmt::Write;
    let esc = |s: &str| e(&crate::text::printable(s, MAX_TEXT));
    let pref = |p: &Option<pb::PolicyRef>| p.as_ref().map_or("none".into(), |p| esc(&format!("{}@{} (v{})", p.name, p.policy_version, p.version)));
    let places = |ps: &[pb::TaskPlacement]| esc(&ps.iter().map(|p| format!("{}{:?}", p.node, p.gpus)).collect::<Vec<_>>().join(" "));
    let series = ab_series(log, r.candidate.as_ref().map(|c| c.version));
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Berth A/B: {p}</title><style>\
         body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2330}}table{{border-collapse:collapse;margin:.5em 0 1.2em}}\
         th,td{{text-align:left;padding:2px 8px;border-bottom:1px solid #e3e6eb}}td.num{{text-align:right}}svg text{{font-size:11px;fill:#4a5160}}\
         </style></head><body>\n<h1>A/B report: partition {p}</h1>\n",
        p = esc(partition)
    );
    let rows: [(&str, String); 10] = [
        ("Mode", esc(&r.mode)),
        ("Active", pref(&r.active)),
        ("Candidate", pref(&r.candidate)),
        ("Shadow samples", r.samples.to_string()),
        ("Agreement rate", format!("{:.3}", r.agreement_rate)),
        ("Candidate score gap (its pick over the active's)", format!("{:.3}", r.mean_candidate_score_gap)),
        ("Active score gap (its pick over the candidate's)", format!("{:.3}", r.mean_active_score_gap)),
        ("Partly used nodes after (active / candidate)", format!("{:.2} / {:.2}", r.mean_partial_nodes_active, r.mean_partial_nodes_candidate)),
        ("Switch domains per gang (active / candidate)", format!("{:.2} / {:.2}", r.mean_domains_active, r.mean_domains_candidate)),
        ("Candidate errors", r.candidate_errors.to_string()),
    ];
    out.push_str("<table id=\"summary\">");
    for (k, v) in rows {
        let _ = write!(out, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    out.push_str("</table>\n<h2>Agreement over shadow samples</h2>\n");
    let (left, right, top, bottom) = (44.0, 548.0, 22.0, 178.0);
    let frame = |out: &mut String, id: &str, label: &str, ticks: &[(f64, String)]| {
        let _ = write!(out, "<svg id=\"{id}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"560\" height=\"220\" viewBox=\"0 0 560 220\">");
        let _ = write!(out, "<line x1=\"{left}\" y1=\"{bottom}\" x2=\"{right}\" y2=\"{bottom}\" stroke=\"#8a91a0\"/><line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{bottom}\" stroke=\"#8a91a0\"/>");
        for (y, t) in ticks {
            let _ = write!(out, "<line x1=\"{}\" y1=\"{y:.1}\" x2=\"{right}\" y2=\"{y:.1}\" stroke=\"#eceef2\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{t}</text>", left - 3.0, left - 5.0, y + 4.0);
        }
        let _ = write!(out, "<text x=\"4\" y=\"12\">{label}</text>");
    };
    let h = bottom - top;
    let points: Vec<f64> = series["agreement"].as_array().map_or(Vec::new(), |a| a.iter().filter_map(|p| p["rate"].as_f64()).collect());
    frame(&mut out, "agreement", "agree", &[0.0, 0.5, 1.0].map(|v| (bottom - v * h, format!("{v:.1}"))));
    if points.is_empty() {
        out.push_str("<text x=\"200\" y=\"100\">no shadow samples</text>");
    } else {
        let w = right - left;
        let x = |i: usize| if points.len() == 1 { left + w / 2.0 } else { left + i as f64 * w / (points.len() - 1) as f64 };
        let line: Vec<String> = points.iter().enumerate().map(|(i, r)| format!("{:.1},{:.1}", x(i), bottom - r * h)).collect();
        let _ = write!(out, "<polyline points=\"{}\" fill=\"none\" stroke=\"#2563eb\" stroke-width=\"2\"/>", line.join(" "));
    }
    let _ = write!(out, "<text x=\"{right}\" y=\"200\" text-anchor=\"end\">shadow samples ({})</text></svg>\n", points.len());
    out.push_str("<h2>Decision latency per arm</h2>\n");
    let arms: Vec<(String, Vec<u64>)> = series["latency"]
        .as_object()
        .map_or(Vec::new(), |o| o.iter().map(|(k, v)| (k.clone(), v.as_array().map_or(Vec::new(), |a| a.iter().filter_map(Value::as_u64).collect()))).collect());
    let max = arms.iter().flat_map(|(_, c)| c.iter().copied()).max().unwrap_or(0).max(1);
    frame(&mut out, "latency", "count", &[0.0, 0.5, 1.0].map(|v| (bottom - v * h, format!("{}", (v * max as f64).round()))));
    let buckets = LATENCY_BUCKETS_US.len() + 1;
    let slot = (right - left) / buckets as f64;
    let bar = (slot - 6.0) / arms.len().max(1) as f64;
    let label = |us: u64| if us >= 1000 { format!("{}ms", us as f64 / 1000.0) } else { format!("{us}µs") };
    let colour = |arm: &str| match arm {
        "active" => "#2563eb",
        "shadow" => "#d97706",
        "candidate" => "#16a34a",
        _ => "#6b7383",
    };
    for b in 0..buckets {
        let text = if b < LATENCY_BUCKETS_US.len() { format!("≤{}", label(LATENCY_BUCKETS_US[b])) } else { format!(">{}", label(LATENCY_BUCKETS_US[b - 1])) };
        let _ = write!(out, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{text}</text>", left + b as f64 * slot + slot / 2.0, bottom + 14.0);
        for (k, (arm, counts)) in arms.iter().enumerate() {
            let c = counts.get(b).copied().unwrap_or(0);
            if c > 0 {
                let bh = c as f64 / max as f64 * h;
                let _ = write!(
                    out,
                    "<rect class=\"bar\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\"><title>{}: {c}</title></rect>",
                    left + b as f64 * slot + 3.0 + k as f64 * bar,
                    bottom - bh,
                    (bar - 1.0).max(1.0),
                    colour(arm),
                    esc(arm)
                );
            }
        }
    }
    for (k, (arm, _)) in arms.iter().enumerate() {
        let x = left + 10.0 + k as f64 * 110.0;
        let _ = write!(out, "<rect x=\"{x}\" y=\"204\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"213\">{}</text>", colour(arm), x + 14.0, esc(arm));
    }
    out.push_str("</svg>\n");
    if !r.arms.is_empty() {
        out.push_str("<h2>Split arms</h2>\n<table id=\"arms\"><tr><th>Arm</th><th>Version</th><th>Decisions</th><th>Placed</th><th>Errors</th><th>Mean latency µs</th><th>Mean wait s</th><th>Partly used nodes after</th><th>Domains per gang</th></tr>");
        for a in &r.arms {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{:.0}</td><td class=\"num\">{:.2}</td><td class=\"num\">{:.2}</td><td class=\"num\">{:.2}</td></tr>",
                esc(&a.arm), pref(&a.policy), a.decisions, a.placed, a.errors, a.mean_latency_us, a.mean_wait_s, a.mean_partial_nodes_after, a.mean_domains_per_gang
            );
        }
        out.push_str("</table>\n");
    }
    out.push_str("<h2>Latest differences</h2>\n<table id=\"diffs\"><tr><th>Decision</th><th>Job</th><th>Active</th><th>Candidate</th><th>Note</th></tr>");
    for d in &r.recent_diffs {
        let _ = write!(out, "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", d.decision_id, d.job_id, places(&d.active), places(&d.candidate), esc(&d.note));
    }
    out.push_str("</table>\n</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(id: u64, job: u64, arm: &str, node: &str, latency_us: u64) -> pb::Decision {
        pb::Decision {
            id,
            job_id: job,
            arm: arm.into(),
            actuated: arm != "shadow",
            outcome: "placed".into(),
            policy_version: if arm == "shadow" { 2 } else { 1 },
            placements: vec![pb::TaskPlacement { node: node.into(), gpus: vec![0] }],
            latency_us,
            ..Default::default()
        }
    }

    #[test]
    fn shadow_decisions_pair_with_the_active_one_of_their_job() {
        let log = vec![d(4, 2, "active", "b", 5_000), d(1, 1, "shadow", "a", 50), d(2, 1, "active", "a", 200), d(3, 2, "shadow", "c", 400_000)];
        let s = ab_series(&log, Some(2));
        let rates: Vec<f64> = s["agreement"].as_array().unwrap().iter().map(|p| p["rate"].as_f64().unwrap()).collect();
        assert_eq!(rates, [1.0, 0.5]);
        assert_eq!(s["latency"]["shadow"][0], 1);
        assert_eq!(s["latency"]["shadow"][LATENCY_BUCKETS_US.len()], 1, "over the last bound: the open bucket");
        assert_eq!(s["latency"]["active"][1], 1);
        assert_eq!(ab_series(&log, Some(3))["agreement"].as_array().unwrap().len(), 0, "another candidate's samples");
    }

    #[test]
    fn replies_are_printable_and_queries_decode() {
        let mut v = json!({"name": "x\u{202e}y\n", "list": ["<b>\u{1b}[31m"]});
        printable(&mut v);
        assert_eq!(v["name"], "x\\u{202e}y\\n");
        assert_eq!(v["list"][0], "<b>\\u{1b}[31m", "markup stays text: the page sets textContent only");
        let q = query(&"/x?partition=p%300&arm=shadow&job=&bad=%zz".parse().unwrap());
        assert_eq!(q["partition"], "p00");
        assert_eq!(q["arm"], "shadow");
        assert_eq!(q["job"], "");
        assert_eq!(q["bad"], "%zz");
    }

    #[test]
    fn the_html_report_is_self_contained_and_escapes_guest_text() {
        let log = vec![d(1, 1, "shadow", "a", 50), d(2, 1, "active", "a", 200)];
        let evil = pb::PolicyRef { version: 2, name: "<script>x</script>".into(), policy_version: "1\u{202e}".into(), sha256: String::new() };
        let r = pb::ShadowReportResponse { mode: "shadow".into(), candidate: Some(evil), samples: 1, agreement_rate: 1.0, ..Default::default() };
        let page = report_html("p0", &r, &log);
        assert!(!page.contains("<script") && page.contains("&lt;script&gt;x&lt;/script&gt;@1\\u{202e}"), "{page}");
        assert!(page.contains("<polyline") && page.matches("class=\"bar\"").count() == 2, "{page}");
        for needle in ["src=", "href=", "<link", "url("] {
            assert!(!page.contains(needle), "{needle}");
        }
    }

    #[test]
    fn refusals_keep_their_meaning_over_http() {
        assert_eq!(http_status(Code::PermissionDenied), StatusCode::FORBIDDEN);
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(http_status(Code::FailedPrecondition), StatusCode::CONFLICT);
    }
}
