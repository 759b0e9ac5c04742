//! `berth pool-load`: a pool file's workload (its synthetic generator, or
//! an Azure LLM trace spread over its catalog, as `berth replay --pool`
//! builds it) sent to a live pool's `/v1/completions` by concurrent
//! streaming clients at the requests' arrival times, each measured where
//! its tokens arrive; with `--simulate`, the same requests through the pool
//! simulator on the same executors, side by side.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use berth_core::pool::{self, PoolOutcome, Request, RunOptions};
use serde::Serialize;

use super::{PoolFile, Source};
use crate::wasm::{Limits, LoadedPolicy, PolicyEngine, WasmPolicy};

/// Requests in flight at once (one client thread each).
pub const MAX_CLIENTS: usize = 1024;

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// The pool's endpoint (`berth serve --inference-listen`).
    #[arg(long, default_value = "http://127.0.0.1:7452")]
    pub endpoint: String,
    /// File holding the tenant's bearer token (one line).
    #[arg(long, conflicts_with = "trial")]
    pub token_file: Option<PathBuf>,
    /// Use the trial access file's tenant (alice-example-token).
    #[arg(long)]
    pub trial: bool,
    /// The pool file the live pool serves (`default`: the embedded market):
    /// its catalog names the models, its SLO judges the requests, its
    /// workload makes them.
    #[arg(long, default_value = "default")]
    pub pool: String,
    /// Arrivals and token counts from an Azure LLM inference trace (its
    /// first `workload.duration_s` seconds), spread over the catalog.
    #[arg(long)]
    pub azure: Option<PathBuf>,
    /// Seed of the workload (model popularity, synthetic arrivals).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Arrival-rate multiplier: the same requests, this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Seconds of the workload (of the trace, with --azure) to send,
    /// instead of the pool file's `workload.duration_s`; with --rate the
    /// wall time is this divided by the rate.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Also run the same requests through the pool simulator under these
    /// pool policies (names or .wasm paths), on --layout.
    #[arg(long)]
    pub simulate: Vec<String>,
    /// The live pool's executors, `TPxCOUNT` comma-separated (as its
    /// `[[pool]] executors`), for --simulate.
    #[arg(long, default_value = "1x4,4x1")]
    pub layout: String,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What one request saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    pub model: u32,
    pub tp: u32,
    pub ttft_s: Option<f64>,
    pub tokens: u32,
    pub met: bool,
    pub error: Option<String>,
    /// Largest gap between two tokens.
    pub max_tbt_s: f64,
}

/// The live run's figures, the simulator's rule applied to what arrived.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Live {
    pub requests: usize,
    pub met_slo: usize,
    pub attainment: f64,
    pub failed: usize,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub tbt_p50_s: f64,
    pub tbt_p99_s: f64,
    /// Per tensor-parallel class: (tp, requests, met).
    pub classes: Vec<(u32, u64, u64)>,
    /// Requests sent later than their arrival time by more than 100 ms
    /// (the client was the bottleneck).
    pub late_sends: usize,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Simulated {
    pub policy: String,
    pub at_layout: PoolOutcome,
    pub gpus_needed: Option<u32>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub source: String,
    pub requests: usize,
    pub layout: Vec<(u32, u32)>,
    pub gpus: u32,
    pub live: Live,
    pub simulated: Vec<Simulated>,
}

fn parse_layout(s: &str) -> anyhow::Result<Vec<(u32, u32)>> {
    s.split(',')
        .map(|p| {
            let (tp, n) = p.trim().split_once('x').with_context(|| format!("--layout {p:?}: TPxCOUNT"))?;
            Ok((tp.parse().with_context(|| format!("--layout {p:?}"))?, n.parse().with_context(|| format!("--layout {p:?}"))?))
        })
        .collect()
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One streamed completion, judged by the SLO: token i by arrival + TTFT +
/// i x TBT (arrival: when it was due to be sent).
fn send(agent: &ureq::Agent, url: &str, auth: &str, name: &str, r: &Request, due: Instant, slo: pool::Slo) -> (Sample, Vec<f64>) {
    let mut s = Sample { model: r.model, ..Default::default() };
    let mut gaps = Vec::new();
    let body = serde_json::json!({ "model": name, "prompt": vec![0u32; r.prompt_tokens as usize], "max_tokens": r.output_tokens, "stream": true });
    let resp = agent.post(url).header("Authorization", auth).header("Content-Type", "application/json").send(body.to_string());
    let mut resp = match resp {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(e.to_string());
            return (s, gaps);
        }
    };
    if resp.status() != 200 {
        s.error = Some(format!("{}: {}", resp.status(), resp.body_mut().read_to_string().unwrap_or_default()));
        return (s, gaps);
    }
    let mut last: Option<Instant> = None;
    let mut late = false;
    let mut done = false;
    for line in BufReader::new(resp.into_body().into_reader()).lines() {
        let Ok(line) = line else { break };
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let now = Instant::now();
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        if let Some(e) = v.get("error") {
            s.error = Some(e.to_string());
            continue;
        }
        if !v["choices"][0]["finish_reason"].is_null() {
            continue;
        }
        let since = now.duration_since(due).as_secs_f64();
        if s.tokens == 0 {
            s.ttft_s = Some(since);
        }
        if since > slo.ttft_s + f64::from(s.tokens) * slo.tbt_s {
            late = true;
        }
        if let Some(l) = last {
            let gap = now.duration_since(l).as_secs_f64();
            s.max_tbt_s = s.max_tbt_s.max(gap);
            gaps.push(gap);
        }
        last = Some(now);
        s.tokens += 1;
    }
    s.met = done && !late && s.error.is_none() && s.tokens >= r.output_tokens;
    (s, gaps)
}

pub fn main(args: LoadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.rate.is_finite() && args.rate > 0.0, "--rate must be positive");
    let mut file = PoolFile::load(&args.pool)?;
    if let Some(d) = args.duration_s {
        anyhow::ensure!(d.is_finite() && d > 0.0 && d <= 86_400.0, "--duration-s must be in (0, 86400] seconds");
        file.workload.synthetic.duration_s = d;
    }
    let cfg = file.config();
    let source = match &args.azure {
        Some(p) => Source::Azure(Arc::new(super::read_azure(p)?), p.clone()),
        None => Source::Synthetic,
    };
    let reqs = super::requests(&file, &source, args.seed, args.rate);
    anyhow::ensure!(!reqs.is_empty(), "the workload has no requests");
    let layout = parse_layout(&args.layout)?;
    let token = match (&args.token_file, args.trial) {
        (Some(p), _) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?.trim().to_string(),
        (None, true) => "alice-example-token".to_string(),
        (None, false) => anyhow::bail!("give --token-file (a tenant of the pool's partition) or --trial"),
    };
    let auth = format!("Bearer {token}");
    let url = format!("{}/v1/completions", args.endpoint.trim_end_matches('/'));
    eprintln!("pool-load: {} requests over {:.0} s to {url}", reqs.len(), reqs.last().map_or(0.0, |r| r.arrival_s));
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(600))).build().into();
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<(Sample, Vec<f64>)>();
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut late_sends = 0;
    for r in &reqs {
        let due = started + Duration::from_secs_f64(r.arrival_s);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        while in_flight.load(std::sync::atomic::Ordering::Acquire) >= MAX_CLIENTS {
            std::thread::sleep(Duration::from_millis(5));
        }
        if Instant::now().duration_since(due) > Duration::from_millis(100) {
            late_sends += 1;
        }
        let (agent, url, auth, tx, in_flight) = (agent.clone(), url.clone(), auth.clone(), tx.clone(), in_flight.clone());
        let (name, r, slo) = (cfg.models[r.model as usize].name.clone(), *r, cfg.slo);
        in_flight.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        std::thread::Builder::new().stack_size(256 << 10).spawn(move || {
            let out = send(&agent, &url, &auth, &name, &r, due, slo);
            in_flight.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            let _ = tx.send(out);
        })?;
    }
    drop(tx);
    let mut samples = Vec::with_capacity(reqs.len());
    let mut gaps = Vec::new();
    for (mut s, g) in rx {
        s.tp = cfg.models[s.model as usize].tp;
        samples.push(s);
        gaps.extend(g);
    }
    let mut ttfts: Vec<f64> = samples.iter().filter_map(|s| s.ttft_s).collect();
    let met = samples.iter().filter(|s| s.met).count();
    let mut classes: Vec<(u32, u64, u64)> = cfg.classes().into_iter().map(|tp| (tp, 0, 0)).collect();
    for s in &samples {
        if let Some(c) = classes.iter_mut().find(|c| c.0 == s.tp) {
            c.1 += 1;
            c.2 += u64::from(s.met);
        }
    }
    let live = Live {
        requests: samples.len(),
        met_slo: met,
        attainment: met as f64 / samples.len().max(1) as f64,
        failed: samples.iter().filter(|s| s.error.is_some()).count(),
        ttft_p50_s: quantile(&mut ttfts, 0.5),
        ttft_p99_s: quantile(&mut ttfts, 0.99),
        tbt_p50_s: quantile(&mut gaps, 0.5),
        tbt_p99_s: quantile(&mut gaps, 0.99),
        classes,
        late_sends,
        seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(e) = samples.iter().find_map(|s| s.error.as_ref()) {
        eprintln!("pool-load: {} requests failed; the first: {}", live.failed, crate::text::printable(e, 300));
    }
    let mut simulated = Vec::new();
    if !args.simulate.is_empty() {
        let engine = Arc::new(PolicyEngine::new(PolicyEngine::default_cache_dir())?);
        for name in &args.simulate {
            let path = crate::catalog::resolve(name)?;
            let loaded = LoadedPolicy::from_file(&engine, &path).map_err(|e| anyhow::anyhow!("policy {name}: {e}"))?;
            let mut make = || -> Result<Box<dyn pool::PoolPolicy>, berth_core::PolicyError> {
                let mut p = WasmPolicy::new(engine.clone(), loaded.clone(), Limits::default());
                p.warm()?;
                Ok(Box::new(p))
            };
            let mut p = make().map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            let at_layout = pool::run(&cfg, &reqs, &RunOptions { layout: layout.clone(), record_steps: false }, &mut *p).map_err(|e| anyhow::anyhow!("{name}: {e}"))?.0;
            let needed = pool::gpus_needed(&cfg, &reqs, file.search.max_executors, &mut make).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            simulated.push(Simulated { policy: name.clone(), at_layout, gpus_needed: needed.gpus });
        }
    }
    let source_name = match &source {
        Source::Synthetic => "synthetic".to_string(),
        Source::Azure(_, p) => p.display().to_string(),
    };
    let report = Report { source: source_name, requests: reqs.len(), gpus: layout.iter().map(|&(tp, n)| tp * n).sum(), layout, live, simulated };
    print!("{}", render(&report, cfg.slo.target));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn render(r: &Report, target: f64) -> String {
    let mut out = format!("{} requests from {}, {} GPUs as {:?} (tp, executors); SLO target {:.0}%\n", r.requests, r.source, r.gpus, r.layout, target * 100.0);
    out += &format!(
        "live        attainment {:>6.1}%  ({} met, {} failed)  TTFT p50 {:.2} s p99 {:.2} s  TBT p50 {:.3} s p99 {:.3} s\n",
        r.live.attainment * 100.0,
        r.live.met_slo,
        r.live.failed,
        r.live.ttft_p50_s,
        r.live.ttft_p99_s,
        r.live.tbt_p50_s,
        r.live.tbt_p99_s
    );
    for s in &r.simulated {
        out += &format!(
            "simulated   attainment {:>6.1}%  ({} met)  under {}; GPUs it needs for the target: {}\n",
            s.at_layout.attainment * 100.0,
            s.at_layout.met_slo,
            s.policy,
            s.gpus_needed.map_or("not reached".into(), |g| g.to_string())
        );
    }
    if r.live.late_sends > 0 {
        out += &format!("({} requests were sent over 100 ms late: the client, not the pool, set their pace)\n", r.live.late_sends);
    }
    out
}
