//! The executor protocol: JSON lines over a Unix socket, one message per
//! line, `type` naming it (docs/src/executor-protocol.md). `Down` goes to
//! the executor (from the agent that started it), `Up` comes back. A real
//! inference engine implements the same messages; Berth's synthetic
//! executor (`berth executor`) times them by the pool's cost model.

use berth_core::pool::PoolConfig;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// Longest line either side sends, in bytes (a 1,000-model catalog is
/// about 150 KB).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Most models in a catalog an executor accepts.
pub const MAX_MODELS: usize = 4096;
/// Most requests one executor holds at once (waiting and decoding).
pub const MAX_IN_FLIGHT: usize = 65_536;
/// Longest prompt and output of one request, tokens (the pool simulator's
/// caps for trace requests).
pub const MAX_PROMPT_TOKENS: u32 = 32_768;
pub const MAX_OUTPUT_TOKENS: u32 = 8_192;

/// To the executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Down {
    /// First message, once: who the executor is (its index in the pool and
    /// its tensor-parallel degree: GPUs) and the pool it serves (GPU kind,
    /// cost model, SLO, catalog). Its memory is `tp` x the GPU's.
    Configure { executor: u32, tp: u32, pool: PoolConfig },
    /// The models it serves from now on (the pool placement's rows for
    /// it): a model not listed any more drains (its queued and running
    /// requests finish) and is then unloaded; a pinned model is loaded at
    /// once and never evicted.
    Place { rows: Vec<PlaceRow> },
    /// A request for one of its models: queued, prefilled, then decoded.
    Admit { id: u64, model: u32, prompt_tokens: u32, output_tokens: u32 },
    /// Forget a request (its client left); tokens of a step already under
    /// way may still come.
    Cancel { id: u64 },
    /// A pool-step policy (a wasm component, base64) to ask from the next
    /// step on, replacing the one before; `digest` names it in the answer
    /// (`policy`). Loaded beside the steps, swapped between two. An empty
    /// `component`: the default step from now on. With `shadow`, the
    /// component is a candidate instead: asked beside the active one on the
    /// same view every step, its choice compared and logged, never run (an
    /// empty component ends the shadow).
    Policy {
        digest: String,
        component: String,
        #[serde(default)]
        shadow: bool,
    },
    /// Finish the step under way and exit.
    Shutdown,
}

/// One model on the executor.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceRow {
    /// Index in the catalog.
    pub model: u32,
    /// Routing weight the host gives it here (at least 1).
    pub weight: u32,
    #[serde(default)]
    pub pinned: bool,
}

/// From the executor. Times are seconds since `ready`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Up {
    /// Configured: its memory in bytes.
    Ready { executor: u32, memory_bytes: u64 },
    /// A model's weights are on the GPUs, after `seconds` of loading
    /// (`from_disk`: not in the host's memory cache).
    Loaded { model: u32, seconds: f64, from_disk: bool },
    /// A model's weights left the GPUs.
    Evicted { model: u32 },
    /// Token `index` (0-based) of a request.
    Token { id: u64, index: u32, text: String, t: f64 },
    /// A request's last token came.
    Done { id: u64, tokens: u32, t: f64 },
    /// A request that cannot be served here (never fits memory, unknown
    /// model, bad size): `why` says which.
    Rejected { id: u64, why: String },
    /// One step ran: what it was, how long, and whether the executor's
    /// pool-step policy chose it (`by`: `policy`, `default`, or
    /// `fallback` where the policy's answer was refused: `why`); with a
    /// candidate in shadow, what it would have chosen instead.
    Step {
        phase: String,
        model: u32,
        batch: u32,
        iterations: u32,
        seconds: f64,
        by: String,
        why: Option<String>,
        t: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shadow: Option<ShadowChoice>,
    },
    /// GPU memory in use after a step.
    Memory { weights_bytes: u64, kv_bytes: u64, memory_bytes: u64 },
    /// A `policy` message was applied (`loaded`) or refused (`why`); the
    /// policy before it decides meanwhile and on refusal. Also sent, not
    /// loaded, when the executor stops asking a policy whose answers it
    /// refused three times in a row. `shadow`: the answer is about the
    /// candidate in shadow.
    Policy {
        digest: String,
        loaded: bool,
        why: Option<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shadow: bool,
    },
    /// A message refused (the executor goes on): what and why.
    Error { what: String },
}

/// What a pool-step candidate in shadow chose on the view the step was
/// decided on: `agreed` when it is the very step chosen (phase, model,
/// iterations and evictions); `why` when its answer was refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShadowChoice {
    pub agreed: bool,
    pub phase: String,
    /// Catalog index of the model it would have run (0 when idle or refused).
    pub model: u32,
    pub iterations: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// Parses one line from the agent, naming what is wrong.
pub fn parse_down(line: &str) -> Result<Down, String> {
    if line.len() > MAX_LINE_BYTES {
        return Err(format!("a line of {} bytes (at most {MAX_LINE_BYTES})", line.len()));
    }
    serde_json::from_str(line).map_err(|e| format!("not an executor message: {e}"))
}

/// Reads the next line into `buf` (without its newline), never holding more
/// than [`MAX_LINE_BYTES`]: `None` at the end of the stream or on a read
/// error, `Some(Err)` for an over-long line (skipped to its end).
pub async fn next_line<R: AsyncBufRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> Option<Result<(), String>> {
    buf.clear();
    let n = (&mut *r).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', buf).await.ok()?;
    if n == 0 {
        return None;
    }
    if buf.len() > MAX_LINE_BYTES {
        buf.clear();
        if buf_ends_line(r).await {
            return Some(Err(format!("a line over {MAX_LINE_BYTES} bytes")));
        }
        return None;
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    }
    Some(Ok(()))
}

/// Reads past the next newline, a buffer at a time; false at the end of
/// the stream or on an error.
async fn buf_ends_line<R: AsyncBufRead + Unpin>(r: &mut R) -> bool {
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
