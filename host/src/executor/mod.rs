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
}

/// Runs an executor until the socket closes or `shutdown` comes.
pub fn main(args: ExecutorArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(args))
}

/// The pool-step policy an executor asks, and the one being loaded to
/// replace it (a `policy` message): loading runs beside the steps, the swap
/// happens between two.
struct Policies {
    active: Option<Box<dyn PoolPolicy + Send>>,
    /// The digest the host named the active one by (empty: from --policy).
    active_digest: String,
    engine: Option<Arc<crate::wasm::PolicyEngine>>,
    limits: crate::wasm::Limits,
    loading: Option<(String, tokio::task::JoinHandle<Result<Box<dyn PoolPolicy + Send>, String>>)>,
}

impl Policies {
    fn engine(&mut self) -> anyhow::Result<Arc<crate::wasm::PolicyEngine>> {
        if self.engine.is_none() {
            self.engine = Some(Arc::new(crate::wasm::PolicyEngine::new(crate::wasm::PolicyEngine::default_cache_dir())?));
        }
        Ok(self.engine.clone().expect("just set"))
    }

    /// Starts loading `component` (base64) on a blocking thread.
    fn load(&mut self, digest: String, component: &str) -> Result<(), String> {
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
        if let Some((_, old)) = self.loading.replace((digest, task)) {
            old.abort();
        }
        Ok(())
    }

    /// The loaded replacement, once ready: swapped in, the answer sent.
    async fn swap_if_loaded<W: tokio::io::AsyncWrite + Unpin>(&mut self, serving: &mut Serving, out: &mut BufWriter<W>) -> anyhow::Result<()> {
        if !self.loading.as_ref().is_some_and(|(_, t)| t.is_finished()) {
            return Ok(());
        }
        let (digest, task) = self.loading.take().expect("checked");
        let answer = match task.await.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok(policy) => {
                self.active = Some(policy);
                self.active_digest = digest.clone();
                serving.policy_failures = 0;
                Up::Policy { digest, loaded: true, why: None }
            }
            Err(why) => Up::Policy { digest, loaded: false, why: Some(why) },
        };
        send(out, &answer).await
    }
}

async fn run(args: ExecutorArgs) -> anyhow::Result<()> {
    let limits = crate::wasm::Limits { deadline: Duration::from_millis(args.step_deadline_ms.max(1)), ..Default::default() };
    let mut policies = Policies { active: None, active_digest: String::new(), engine: None, limits, loading: None };
    if let Some(path) = &args.policy {
        let engine = policies.engine()?;
        let loaded = crate::wasm::LoadedPolicy::from_file(&engine, path).with_context(|| format!("loading {}", path.display()))?;
        policies.active = Some(Box::new(crate::wasm::WasmPolicy::new(engine, loaded, limits)));
    }
    let stream = UnixStream::connect(&args.socket).await.with_context(|| format!("connecting to {}", args.socket.display()))?;
    let (rd, wr) = stream.into_split();
    let mut out = BufWriter::new(wr);
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
                    send(&mut out, &Up::Ready { executor, memory_bytes: s.memory() }).await?;
                    out.flush().await?;
                    break s;
                }
                Err(why) => send(&mut out, &Up::Error { what: format!("configure: {why}") }).await?,
            },
            Some(Ok(other)) => send(&mut out, &Up::Error { what: format!("{} before configure", kind(&other)) }).await?,
            Some(Err(why)) => send(&mut out, &Up::Error { what: why }).await?,
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
        let plan = serving.step(now(), policies.active.as_mut().map(|p| &mut **p as &mut dyn PoolPolicy));
        if serving.policy_failures >= POLICY_FAILURES_TO_TRIP && policies.active.take().is_some() {
            let why = format!("pool-step policy refused {POLICY_FAILURES_TO_TRIP} times in a row: the default step decides from now on");
            send(&mut out, &Up::Error { what: why.clone() }).await?;
            // The host trips the version it sent (its breaker's record).
            send(&mut out, &Up::Policy { digest: std::mem::take(&mut policies.active_digest), loaded: false, why: Some(why) }).await?;
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
                    send(&mut out, &up).await?;
                }
                out.flush().await?;
                tokio::time::sleep_until((t0 + Duration::from_secs_f64(plan.seconds.max(0.0))).into()).await;
            }
            // Work that cannot run now (the policy idles, or no room), or
            // a policy being loaded: ask again soon, or on a message.
            None if serving.busy() || policies.loading.is_some() => tokio::select! {
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
async fn handle<W: tokio::io::AsyncWrite + Unpin>(serving: &mut Serving, policies: &mut Policies, msg: Result<Down, String>, now: f64, out: &mut BufWriter<W>) -> anyhow::Result<bool> {
    match msg {
        Ok(Down::Policy { digest, component }) => {
            let digest = crate::text::printable(&digest, 80).into_owned();
            if component.is_empty() {
                // Back to the default step, at once.
                if let Some((_, task)) = policies.loading.take() {
                    task.abort();
                }
                policies.active = None;
                policies.active_digest = String::new();
                serving.policy_failures = 0;
                send(out, &Up::Policy { digest, loaded: true, why: None }).await?;
            } else if let Err(why) = policies.load(digest.clone(), &component) {
                send(out, &Up::Policy { digest, loaded: false, why: Some(why) }).await?;
            }
        }
        Err(why) => send(out, &Up::Error { what: why }).await?,
        Ok(Down::Configure { .. }) => send(out, &Up::Error { what: "configure: already configured".into() }).await?,
        Ok(Down::Place { rows }) => {
            if let Err(why) = serving.place(&rows) {
                send(out, &Up::Error { what: format!("place: {why}") }).await?;
            }
        }
        Ok(Down::Admit { id, model, prompt_tokens, output_tokens }) => {
            if let Err(why) = serving.admit(id, model, prompt_tokens, output_tokens, now) {
                send(out, &Up::Rejected { id, why }).await?;
            }
        }
        Ok(Down::Cancel { id }) => {
            if serving.cancel(id) {
                send(out, &serving.memory_report()).await?;
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

async fn send<W: tokio::io::AsyncWrite + Unpin>(out: &mut BufWriter<W>, up: &Up) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(up)?;
    line.push(b'\n');
    out.write_all(&line).await?;
    Ok(())
}
