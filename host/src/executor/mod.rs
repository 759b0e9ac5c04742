//! A pool executor (Aegaeon): one process serving the models a pool's
//! placement gives it, on `tp` GPUs, step by step, over the executor
//! protocol ([`protocol`], docs/src/executor-protocol.md). `berth executor`
//! is the synthetic one: the control path is real (a process, a socket,
//! a pool-step policy asked each step, tokens streamed as they come) while
//! the arithmetic is the pool simulator's cost model, slept in wall time,
//! as synthetic GPUs are for training jobs. Neither `serve` nor `agent`:
//! both sides speak it.

pub mod protocol;
pub mod serving;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use berth_core::pool::PoolPolicy;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;

use protocol::{parse_down, Down, Up};
use serving::Serving;

/// How soon an executor with work it could not run asks again (in the
/// simulator, the next event; live, time passes without one).
pub const RETRY: Duration = Duration::from_millis(10);

/// The variable the agent sets to the executor's socket.
pub const SOCKET_ENV: &str = "BERTH_EXECUTOR_SOCKET";

/// Refused pool-step answers in a row after which the executor stops
/// asking its policy and steps by the documented default.
pub const POLICY_FAILURES_TO_TRIP: u32 = 3;

#[derive(clap::Args, Debug)]
pub struct ExecutorArgs {
    /// Unix socket to connect to (the agent's for this executor, which
    /// sets $BERTH_EXECUTOR_SOCKET, or any program speaking the executor
    /// protocol); messages are JSON lines.
    #[arg(long, env = "BERTH_EXECUTOR_SOCKET")]
    pub socket: PathBuf,
    /// A pool-step policy (.wasm component, contract 0.3.0 or later) asked
    /// for every step; without it, the documented default step. Refused
    /// answers are replaced by the default step, and after three in a row
    /// the policy is no longer asked.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Wall-clock budget of one pool-step call, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub step_deadline_ms: u64,
    /// File to log every decision to, one JSON line each (steps and who
    /// chose them, loads, evictions, refusals, policy swaps); the agent
    /// sets it to `<state>/exec-<allocation>.decisions.jsonl`.
    #[arg(long, env = "BERTH_EXECUTOR_DECISION_LOG")]
    pub decision_log: Option<PathBuf>,
    /// Size at which the decision log moves to `<file>.1` and starts anew,
    /// in bytes (so an executor keeps at most twice this).
    #[arg(long, default_value_t = DECISION_LOG_BYTES)]
    pub decision_log_bytes: u64,
}

/// Default size of an executor's decision log before it rotates.
pub const DECISION_LOG_BYTES: u64 = 8 << 20;

/// The variable the agent sets to the executor's decision log.
pub const DECISION_LOG_ENV: &str = "BERTH_EXECUTOR_DECISION_LOG";

/// Runs an executor until the socket closes or `shutdown` comes.
pub fn main(args: ExecutorArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(args))
}

/// A pool-step policy an executor asks (or, in shadow, compares), the
/// digest the host named it by (empty: from --policy), and one being loaded
/// to replace it: loading runs beside the steps, the swap happens between
/// two.
#[derive(Default)]
struct PolicySlot {
    policy: Option<Box<dyn PoolPolicy + Send>>,
    digest: String,
    loading: Option<(String, tokio::task::JoinHandle<Result<Box<dyn PoolPolicy + Send>, String>>)>,
}

impl PolicySlot {
    fn policy(&mut self) -> Option<&mut dyn PoolPolicy> {
        self.policy.as_mut().map(|p| &mut **p as &mut dyn PoolPolicy)
    }

    /// Drops the policy and any load under way; its digest, if any.
    fn clear(&mut self) -> Option<String> {
        if let Some((_, task)) = self.loading.take() {
            task.abort();
        }
        self.policy.take().map(|_| std::mem::take(&mut self.digest))
    }
}

/// The active pool-step policy and a candidate in shadow.
struct Policies {
    active: PolicySlot,
    shadow: PolicySlot,
    engine: Option<Arc<crate::wasm::PolicyEngine>>,
    limits: crate::wasm::Limits,
}

impl Policies {
    fn engine(&mut self) -> anyhow::Result<Arc<crate::wasm::PolicyEngine>> {
        if self.engine.is_none() {
            self.engine = Some(Arc::new(crate::wasm::PolicyEngine::new(crate::wasm::PolicyEngine::default_cache_dir())?));
        }
        Ok(self.engine.clone().expect("just set"))
    }

    fn slot(&mut self, shadow: bool) -> &mut PolicySlot {
        if shadow { &mut self.shadow } else { &mut self.active }
    }

    fn loading(&self) -> bool {
        self.active.loading.is_some() || self.shadow.loading.is_some()
    }

    /// Starts loading `component` (base64) on a blocking thread.
    fn load(&mut self, shadow: bool, digest: String, component: &str) -> Result<(), String> {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD.decode(component.trim()).map_err(|e| format!("component is not base64: {e}"))?;
        let engine = self.engine().map_err(|e| format!("{e:#}"))?;
        let limits = self.limits;
        let task = tokio::task::spawn_blocking(move || -> Result<Box<dyn PoolPolicy + Send>, String> {
            let loaded = crate::wasm::LoadedPolicy::from_bytes(&engine, &bytes).map_err(|e| e.to_string())?;
            let mut policy = crate::wasm::WasmPolicy::new(engine, loaded, limits);
            policy.warm().map_err(|e| e.to_string())?;
            Ok(Box::new(policy))
        });
        // A newer policy replaces one still loading.
        if let Some((_, old)) = self.slot(shadow).loading.replace((digest, task)) {
            old.abort();
        }
        Ok(())
    }

    /// The loaded replacements, once ready: swapped in, the answers sent.
    async fn swap_if_loaded<W: tokio::io::AsyncWrite + Unpin>(&mut self, serving: &mut Serving, out: &mut Out<W>) -> anyhow::Result<()> {
        for shadow in [false, true] {
            let slot = self.slot(shadow);
            if !slot.loading.as_ref().is_some_and(|(_, t)| t.is_finished()) {
                continue;
            }
            let (digest, task) = slot.loading.take().expect("checked");
            let answer = match task.await.map_err(|e| e.to_string()).and_then(|r| r) {
                Ok(policy) => {
                    let slot = self.slot(shadow);
                    slot.policy = Some(policy);
                    slot.digest = digest.clone();
                    if shadow {
                        serving.shadow_failures = 0;
                    } else {
                        serving.policy_failures = 0;
                    }
                    Up::Policy { digest, loaded: true, why: None, shadow }
                }
                Err(why) => Up::Policy { digest, loaded: false, why: Some(why), shadow },
            };
            out.send(&answer).await?;
        }
        Ok(())
    }
}

async fn run(args: ExecutorArgs) -> anyhow::Result<()> {
    let limits = crate::wasm::Limits { deadline: Duration::from_millis(args.step_deadline_ms.max(1)), ..Default::default() };
    let mut policies = Policies { active: PolicySlot::default(), shadow: PolicySlot::default(), engine: None, limits };
    if let Some(path) = &args.policy {
        let engine = policies.engine()?;
        let loaded = crate::wasm::LoadedPolicy::from_file(&engine, path).with_context(|| format!("loading {}", path.display()))?;
        policies.active.policy = Some(Box::new(crate::wasm::WasmPolicy::new(engine, loaded, limits)));
    }
    let stream = UnixStream::connect(&args.socket).await.with_context(|| format!("connecting to {}", args.socket.display()))?;
    let (rd, wr) = stream.into_split();
    let log = match &args.decision_log {
        Some(path) => Some(DecisionLog::open(path.clone(), args.decision_log_bytes).with_context(|| format!("opening the decision log {}", path.display()))?),
        None => None,
    };
    let mut out = Out { w: BufWriter::new(wr), log };
    // Lines are read on their own task so that messages queue while a step
    // runs (a request that comes mid-step waits for the next, as on a GPU).
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Down, String>>(1024);
    tokio::spawn(async move {
        let mut lines = BufReader::new(rd);
        let mut buf = Vec::new();
        while let Some(read) = protocol::next_line(&mut lines, &mut buf).await {
            let msg = match read {
                Err(why) => Err(why),
                Ok(()) => match std::str::from_utf8(&buf) {
                    Ok(line) if line.trim().is_empty() => continue,
                    Ok(line) => parse_down(line.trim_end()),
                    Err(_) => Err("a line that is not UTF-8".into()),
                },
            };
            if tx.send(msg).await.is_err() {
                return;
            }
        }
    });
    // The first message configures the executor.
    let mut serving = loop {
        match rx.recv().await {
            None => return Ok(()),
            Some(Ok(Down::Configure { executor, tp, pool })) => match Serving::new(executor, tp, pool) {
                Ok(s) => {
                    if let Some(log) = &mut out.log {
                        log.executor = Some(executor);
                    }
                    out.send(&Up::Ready { executor, memory_bytes: s.memory() }).await?;
                    out.flush().await?;
                    break s;
                }
                Err(why) => out.send(&Up::Error { what: format!("configure: {why}") }).await?,
            },
            Some(Ok(other)) => out.send(&Up::Error { what: format!("{} before configure", kind(&other)) }).await?,
            Some(Err(why)) => out.send(&Up::Error { what: why }).await?,
        }
        out.flush().await?;
    };
    let start = Instant::now();
    let now = || start.elapsed().as_secs_f64();
    loop {
        // Everything that came meanwhile, then one step.
        while let Ok(msg) = rx.try_recv() {
            if !handle(&mut serving, &mut policies, msg, now(), &mut out).await? {
                return Ok(());
            }
        }
        policies.swap_if_loaded(&mut serving, &mut out).await?;
        out.flush().await?;
        let plan = serving.step(now(), policies.active.policy(), policies.shadow.policy());
        if serving.policy_failures >= POLICY_FAILURES_TO_TRIP
            && let Some(digest) = policies.active.clear()
        {
            let why = format!("pool-step policy refused {POLICY_FAILURES_TO_TRIP} times in a row: the default step decides from now on");
            out.send(&Up::Error { what: why.clone() }).await?;
            // The host trips the version it sent (its breaker's record).
            out.send(&Up::Policy { digest, loaded: false, why: Some(why), shadow: false }).await?;
        }
        if serving.shadow_failures >= POLICY_FAILURES_TO_TRIP
            && let Some(digest) = policies.shadow.clear()
        {
            // A candidate costs a call per step: one that keeps failing is
            // no longer asked (the host hears why; nothing else changes).
            let why = format!("pool-step candidate refused {POLICY_FAILURES_TO_TRIP} times in a row: no longer asked");
            out.send(&Up::Policy { digest, loaded: false, why: Some(why), shadow: true }).await?;
            serving.shadow_failures = 0;
        }
        match plan {
            Some(plan) => {
                let t0 = Instant::now();
                for (at, up) in plan.out {
                    let due = t0 + Duration::from_secs_f64(at.max(0.0));
                    if due > Instant::now() {
                        out.flush().await?;
                        tokio::time::sleep_until(due.into()).await;
                    }
                    out.send(&up).await?;
                }
                out.flush().await?;
                tokio::time::sleep_until((t0 + Duration::from_secs_f64(plan.seconds.max(0.0))).into()).await;
            }
            // Work that cannot run now (the policy idles, or no room), or
            // a policy being loaded: ask again soon, or on a message.
            None if serving.busy() || policies.loading() => tokio::select! {
                msg = rx.recv() => match msg {
                    None => return Ok(()),
                    Some(msg) => {
                        if !handle(&mut serving, &mut policies, msg, now(), &mut out).await? {
                            return Ok(());
                        }
                    }
                },
                _ = tokio::time::sleep(RETRY) => {}
            },
            None => match rx.recv().await {
                None => return Ok(()),
                Some(msg) => {
                    if !handle(&mut serving, &mut policies, msg, now(), &mut out).await? {
                        return Ok(());
                    }
                }
            },
        }
    }
}

/// Applies one message; false on `shutdown`.
async fn handle<W: tokio::io::AsyncWrite + Unpin>(serving: &mut Serving, policies: &mut Policies, msg: Result<Down, String>, now: f64, out: &mut Out<W>) -> anyhow::Result<bool> {
    match msg {
        Ok(Down::Policy { digest, component, shadow }) => {
            let digest = crate::text::printable(&digest, 80).into_owned();
            if component.is_empty() {
                // Back to the default step (or no candidate), at once.
                policies.slot(shadow).clear();
                if shadow {
                    serving.shadow_failures = 0;
                } else {
                    serving.policy_failures = 0;
                }
                out.send(&Up::Policy { digest, loaded: true, why: None, shadow }).await?;
            } else if let Err(why) = policies.load(shadow, digest.clone(), &component) {
                out.send(&Up::Policy { digest, loaded: false, why: Some(why), shadow }).await?;
            }
        }
        Err(why) => out.send(&Up::Error { what: why }).await?,
        Ok(Down::Configure { .. }) => out.send(&Up::Error { what: "configure: already configured".into() }).await?,
        Ok(Down::Place { rows }) => {
            if let Err(why) = serving.place(&rows) {
                out.send(&Up::Error { what: format!("place: {why}") }).await?;
            }
        }
        Ok(Down::Admit { id, model, prompt_tokens, output_tokens }) => {
            if let Err(why) = serving.admit(id, model, prompt_tokens, output_tokens, now) {
                out.send(&Up::Rejected { id, why }).await?;
            }
        }
        Ok(Down::Cancel { id }) => {
            if serving.cancel(id) {
                out.send(&serving.memory_report()).await?;
            }
        }
        Ok(Down::Shutdown) => {
            out.flush().await?;
            return Ok(false);
        }
    }
    Ok(true)
}

fn kind(d: &Down) -> &'static str {
    match d {
        Down::Configure { .. } => "configure",
        Down::Place { .. } => "place",
        Down::Admit { .. } => "admit",
        Down::Cancel { .. } => "cancel",
        Down::Policy { .. } => "policy",
        Down::Shutdown => "shutdown",
    }
}

/// The socket to the agent, and the executor's own decision log beside it.
struct Out<W> {
    w: BufWriter<W>,
    log: Option<DecisionLog>,
}

impl<W: tokio::io::AsyncWrite + Unpin> Out<W> {
    async fn send(&mut self, up: &Up) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(up)?;
        if let Some(log) = &mut self.log {
            log.record(up, &line);
        }
        line.push(b'\n');
        self.w.write_all(&line).await?;
        Ok(())
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        self.w.flush().await?;
        if let Some(log) = &mut self.log {
            log.flush();
        }
        Ok(())
    }
}

/// The executor's decisions, one JSON line each (its protocol message with
/// `unix_ms` and `executor` added): every step (who chose it, why a
/// policy's answer was refused, what a candidate in shadow would have
/// chosen), every model loaded or evicted, every request refused, every
/// policy swap. Bounded: past `max_bytes` the file moves to `<path>.1`
/// (replacing the one before) and a new one starts.
pub struct DecisionLog {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    written: u64,
    max_bytes: u64,
    executor: Option<u32>,
}

impl DecisionLog {
    pub fn open(path: PathBuf, max_bytes: u64) -> std::io::Result<DecisionLog> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
        let written = file.metadata()?.len();
        Ok(DecisionLog { path, file: std::io::BufWriter::new(file), written, max_bytes: max_bytes.max(4096), executor: None })
    }

    /// Whether a message is a decision the log keeps.
    fn keeps(up: &Up) -> bool {
        matches!(up, Up::Step { .. } | Up::Loaded { .. } | Up::Evicted { .. } | Up::Rejected { .. } | Up::Policy { .. })
    }

    fn record(&mut self, up: &Up, json: &[u8]) {
        if !Self::keeps(up) {
            return;
        }
        use std::io::Write as _;
        // `{"type":...` becomes `{"unix_ms":N,"executor":E,"type":...`.
        let head = match self.executor {
            Some(e) => format!("{{\"unix_ms\":{},\"executor\":{e},", crate::util::unix_ms()),
            None => format!("{{\"unix_ms\":{},", crate::util::unix_ms()),
        };
        let len = (head.len() + json.len()) as u64;
        if self.written + len > self.max_bytes {
            self.rotate();
        }
        let ok = self.file.write_all(head.as_bytes()).and_then(|()| self.file.write_all(&json[1..])).and_then(|()| self.file.write_all(b"\n"));
        match ok {
            Ok(()) => self.written += len,
            Err(e) => eprintln!("berth executor: decision log {}: {e}", self.path.display()),
        }
    }

    fn rotate(&mut self) {
        use std::io::Write as _;
        let _ = self.file.flush();
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let reopened = std::fs::rename(&self.path, &old).and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&self.path));
        match reopened {
            Ok(f) => {
                self.file = std::io::BufWriter::new(f);
                self.written = 0;
            }
            Err(e) => eprintln!("berth executor: rotating the decision log {}: {e}", self.path.display()),
        }
    }

    fn flush(&mut self) {
        use std::io::Write as _;
        let _ = self.file.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(by: &str) -> Up {
        Up::Step { phase: "decode".into(), model: 3, batch: 2, iterations: 8, seconds: 0.1, by: by.into(), why: None, t: 1.0, shadow: None }
    }

    #[test]
    fn the_decision_log_keeps_decisions_only_and_stays_within_twice_its_bound() {
        let dir = std::env::temp_dir().join(format!("berth-decision-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("exec-7.decisions.jsonl");
        let mut log = DecisionLog::open(path.clone(), 4096).unwrap();
        log.executor = Some(2);
        for i in 0..200 {
            let up = if i % 2 == 0 { step("policy") } else { Up::Token { id: 1, index: i, text: " t".into(), t: 0.0 } };
            log.record(&up, &serde_json::to_vec(&up).unwrap());
        }
        log.flush();
        let current = std::fs::read_to_string(&path).unwrap();
        let rotated = std::fs::read_to_string(dir.join("exec-7.decisions.jsonl.1")).unwrap();
        assert!(current.len() <= 4096 && rotated.len() <= 4096, "{} and {} bytes", current.len(), rotated.len());
        for line in current.lines().chain(rotated.lines()) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["type"], "step", "tokens are not decisions: {line}");
            assert_eq!(v["executor"], 2);
            assert_eq!(v["by"], "policy");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
