//! The model pools' OpenAI-compatible endpoint (`berth serve
//! --inference-listen`): `POST /v1/completions` (streamed as server-sent
//! events with `"stream": true`), `POST /v1/chat/completions` and `GET
//! /v1/models`, authenticated by the access file's bearer tokens (the
//! tenant role on the pool's partition), every size bounded. Requests go
//! to [`super::pooling`]; tokens come back as the executors stream them.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::auth::{Identity, Role};
use super::pooling::{Event, PoolRun, Pools};
use super::state::Live;
use crate::executor::protocol::{MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS};

/// Largest request body, bytes (a 32,768-token prompt as text is ~130 KB;
/// as token ids ~200 KB).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Longest model name, and most chat messages.
pub const MAX_MODEL_NAME: usize = 256;
pub const MAX_MESSAGES: usize = 256;
/// Output tokens when the request names none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

#[derive(Clone)]
struct Ctx {
    live: Arc<Live>,
    pools: Arc<Pools>,
}

/// The endpoint's routes.
pub fn router(live: Arc<Live>, pools: Arc<Pools>) -> axum::Router {
    let ctx = Ctx { live, pools };
    let (c1, c2, c3) = (ctx.clone(), ctx.clone(), ctx);
    axum::Router::new()
        .route("/v1/completions", post(move |h: HeaderMap, b: Bytes| async move { c1.complete(&h, &b, false).await }))
        .route("/v1/chat/completions", post(move |h: HeaderMap, b: Bytes| async move { c2.complete(&h, &b, true).await }))
        .route("/v1/models", get(move |h: HeaderMap| async move { c3.models(&h) }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// `prompt`: text, or token ids (as OpenAI accepts).
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Deserialize)]
struct Message {
    #[allow(dead_code)]
    role: String,
    content: String,
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
}

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({ "error": { "message": message.into(), "type": kind } });
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// Tokens of a text: one per 4 bytes, at least one (the synthetic
/// executor's tokenizer; a real engine counts its own).
fn text_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4).max(1)
}

impl Ctx {
    fn caller(&self, h: &HeaderMap) -> Result<Identity, Response> {
        let value = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
        self.live.access.identify_bearer(value).map_err(|e| error(StatusCode::UNAUTHORIZED, "authentication_error", e.to_string()))
    }

    /// The pools `id` may send requests to.
    fn usable<'a>(&'a self, id: &'a Identity) -> impl Iterator<Item = &'a Arc<PoolRun>> + 'a {
        self.pools.pools.iter().filter(move |p| id.role_in(&p.partition) >= Some(Role::Tenant))
    }

    fn models(&self, h: &HeaderMap) -> Response {
        let id = match self.caller(h) {
            Ok(id) => id,
            Err(r) => return r,
        };
        let data: Vec<_> = self
            .usable(&id)
            .flat_map(|p| p.cfg.models.iter().map(move |m| json!({ "id": m.name, "object": "model", "owned_by": p.partition })))
            .collect();
        (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], json!({ "object": "list", "data": data }).to_string()).into_response()
    }

    async fn complete(&self, h: &HeaderMap, body: &Bytes, chat: bool) -> Response {
        let id = match self.caller(h) {
            Ok(id) => id,
            Err(r) => return r,
        };
        let req: CompletionRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", format!("request body: {e}")),
        };
        if req.model.len() > MAX_MODEL_NAME {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", format!("model name of {} bytes (at most {MAX_MODEL_NAME})", req.model.len()));
        }
        let prompt = match (chat, &req.prompt, &req.messages) {
            (false, Some(Prompt::Text(t)), _) => text_tokens(t),
            (false, Some(Prompt::Tokens(t)), _) => t.len() as u64,
            (true, _, Some(msgs)) if msgs.len() <= MAX_MESSAGES && !msgs.is_empty() => msgs.iter().map(|m| text_tokens(&m.content)).sum(),
            (true, _, Some(msgs)) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", format!("{} messages (1..={MAX_MESSAGES})", msgs.len())),
            (false, None, _) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", "prompt is required"),
            (true, _, None) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", "messages is required"),
        };
        if prompt > u64::from(MAX_PROMPT_TOKENS) {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", format!("a prompt of {prompt} tokens (at most {MAX_PROMPT_TOKENS})"));
        }
        let output = req.max_completion_tokens.or(req.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
        if output == 0 || output > MAX_OUTPUT_TOKENS {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", format!("max_tokens {output} (1..={MAX_OUTPUT_TOKENS})"));
        }
        // The same answer for a model that does not exist and one the caller may not use.
        let Some((pool, model)) = self.usable(&id).find_map(|p| p.model(&req.model).map(|m| (p.clone(), m))) else {
            return error(StatusCode::NOT_FOUND, "invalid_request_error", format!("no model \"{}\" that {} may use", crate::text::printable(&req.model, 64), id.name));
        };
        let (rid, rx) = match pool.submit(&self.live, model, prompt as u32, output).await {
            Ok(x) => x,
            Err(why) => return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", why),
        };
        let tokens = Tokens { rx, pool: pool.clone(), live: self.live.clone(), id: rid, finished: false };
        let meta = Meta { id: format!("cmpl-{}-{rid}", pool.partition), model: req.model.clone(), created: crate::util::unix_ms() / 1000, chat };
        if req.stream {
            let stream = Sse { tokens, meta, ended: false };
            return Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "text/event-stream")
                .header(header::CACHE_CONTROL, "no-cache")
                .body(Body::from_stream(stream))
                .expect("valid response");
        }
        let mut tokens = tokens;
        let mut text = String::new();
        let mut count = 0u32;
        while let Some(ev) = tokens.rx.recv().await {
            match ev {
                Event::Token { text: t, .. } => {
                    text.push_str(&t);
                    count += 1;
                }
                Event::Done { tokens: n } => {
                    tokens.finished = true;
                    count = count.max(n);
                    break;
                }
                Event::Failed(why) => {
                    tokens.finished = true;
                    return error(StatusCode::BAD_GATEWAY, "server_error", why);
                }
            }
        }
        let choice = if chat {
            json!({ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "length" })
        } else {
            json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": "length" })
        };
        let body = json!({
            "id": meta.id, "object": if chat { "chat.completion" } else { "text_completion" }, "created": meta.created, "model": meta.model,
            "choices": [choice],
            "usage": { "prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + u64::from(count) },
        });
        (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

struct Meta {
    id: String,
    model: String,
    created: u64,
    chat: bool,
}

/// A request's events; dropped before its end (the client left), its
/// executor forgets it.
struct Tokens {
    rx: mpsc::UnboundedReceiver<Event>,
    pool: Arc<PoolRun>,
    live: Arc<Live>,
    id: u64,
    finished: bool,
}

impl Drop for Tokens {
    fn drop(&mut self) {
        if !self.finished {
            self.pool.cancel(&self.live, self.id);
        }
    }
}

/// The events as server-sent events, OpenAI's chunk shape, ending in
/// `data: [DONE]`.
struct Sse {
    tokens: Tokens,
    meta: Meta,
    ended: bool,
}

impl Sse {
    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> String {
        let choice = if self.meta.chat {
            json!({ "index": 0, "delta": text.map_or(json!({}), |t| json!({ "content": t })), "finish_reason": finish })
        } else {
            json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish })
        };
        let object = if self.meta.chat { "chat.completion.chunk" } else { "text_completion" };
        format!("data: {}\n\n", json!({ "id": self.meta.id, "object": object, "created": self.meta.created, "model": self.meta.model, "choices": [choice] }))
    }
}

impl tokio_stream::Stream for Sse {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.tokens.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Event::Token { text, .. })) => Poll::Ready(Some(Ok(Bytes::from(self.chunk(Some(&text), None))))),
            Poll::Ready(Some(Event::Done { .. })) => {
                self.tokens.finished = true;
                self.ended = true;
                Poll::Ready(Some(Ok(Bytes::from(self.chunk(None, Some("length")) + "data: [DONE]\n\n"))))
            }
            Poll::Ready(Some(Event::Failed(why))) => {
                self.tokens.finished = true;
                self.ended = true;
                let e = json!({ "error": { "message": why, "type": "server_error" } });
                Poll::Ready(Some(Ok(Bytes::from(format!("data: {e}\n\ndata: [DONE]\n\n")))))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }
}
