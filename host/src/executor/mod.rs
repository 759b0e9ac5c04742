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
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;

use protocol::{parse_down, Down, Up, MAX_LINE_BYTES};
use serving::Serving;

/// Refused pool-step answers in a row after which the executor stops
/// asking its policy and steps by the documented default.
pub const POLICY_FAILURES_TO_TRIP: u32 = 3;

#[derive(clap::Args, Debug)]
pub struct ExecutorArgs {
    /// Unix socket to connect to (the agent's for this executor, or any
    /// program speaking the executor protocol); messages are JSON lines.
    #[arg(long)]
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

async fn run(args: ExecutorArgs) -> anyhow::Result<()> {
    let mut policy: Option<Box<dyn PoolPolicy>> = match &args.policy {
        None => None,
        Some(path) => {
            let engine = Arc::new(crate::wasm::PolicyEngine::new(crate::wasm::PolicyEngine::default_cache_dir())?);
            let loaded = crate::wasm::LoadedPolicy::from_file(&engine, path).with_context(|| format!("loading {}", path.display()))?;
            let limits = crate::wasm::Limits { deadline: Duration::from_millis(args.step_deadline_ms.max(1)), ..Default::default() };
            Some(Box::new(crate::wasm::WasmPolicy::new(engine, loaded, limits)))
        }
    };
    let stream = UnixStream::connect(&args.socket).await.with_context(|| format!("connecting to {}", args.socket.display()))?;
    let (rd, wr) = stream.into_split();
    let mut out = BufWriter::new(wr);
    // Lines are read on their own task so that messages queue while a step
    // runs (a request that comes mid-step waits for the next, as on a GPU).
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Down, String>>(1024);
    tokio::spawn(async move {
        let mut lines = BufReader::new(rd);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let n = match (&mut lines).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut buf).await {
                Ok(n) => n,
                Err(_) => return,
            };
            if n == 0 {
                return;
            }
            let msg = if buf.len() > MAX_LINE_BYTES {
                // Skip the rest of the over-long line without keeping it.
                if !skip_line(&mut lines).await {
                    return;
                }
                Err(format!("a line over {MAX_LINE_BYTES} bytes"))
            } else {
                match std::str::from_utf8(&buf) {
                    Ok(line) if line.trim().is_empty() => continue,
                    Ok(line) => parse_down(line.trim_end()),
                    Err(_) => Err("a line that is not UTF-8".into()),
                }
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
            if !handle(&mut serving, msg, now(), &mut out).await? {
                return Ok(());
            }
        }
        out.flush().await?;
        let plan = serving.step(now(), policy.as_mut().map(|p| &mut **p as &mut dyn PoolPolicy));
        if serving.policy_failures >= POLICY_FAILURES_TO_TRIP && policy.take().is_some() {
            send(&mut out, &Up::Error { what: format!("pool-step policy refused {POLICY_FAILURES_TO_TRIP} times in a row: the default step decides from now on") }).await?;
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
            None => match rx.recv().await {
                None => return Ok(()),
                Some(msg) => {
                    if !handle(&mut serving, msg, now(), &mut out).await? {
                        return Ok(());
                    }
                }
            },
        }
    }
}

/// Applies one message; false on `shutdown`.
async fn handle<W: tokio::io::AsyncWrite + Unpin>(serving: &mut Serving, msg: Result<Down, String>, now: f64, out: &mut BufWriter<W>) -> anyhow::Result<bool> {
    match msg {
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

/// Reads past the next newline, a buffer at a time; false at the end of
/// the stream or on an error.
async fn skip_line<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> bool {
    loop {
        let (found, n) = match r.fill_buf().await {
            Ok([]) | Err(_) => return false,
            Ok(chunk) => match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, chunk.len()),
            },
        };
        r.consume(n);
        if found {
            return true;
        }
    }
}

fn kind(d: &Down) -> &'static str {
    match d {
        Down::Configure { .. } => "configure",
        Down::Place { .. } => "place",
        Down::Admit { .. } => "admit",
        Down::Cancel { .. } => "cancel",
        Down::Shutdown => "shutdown",
    }
}

async fn send<W: tokio::io::AsyncWrite + Unpin>(out: &mut BufWriter<W>, up: &Up) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(up)?;
    line.push(b'\n');
    out.write_all(&line).await?;
    Ok(())
}
