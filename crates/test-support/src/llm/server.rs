//! The stand-ins' server: admission against the buckets, answers whole or
//! streamed, and the record of every call.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::render::{self, Draft};
use super::request::{self, Ask};
use super::{Bucket, Call, Endpoint, LlmConfig, Metering, Spend, fnv1a, spend_by_minute, unix_now};
use crate::upstream::{TestBody, full};

/// Whose API a stand-in plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    OpenAi,
    Anthropic,
}

// === buckets ===

/// The buckets of one account (OpenAI uses `tokens`; Anthropic `input` and `output`).
struct Account {
    requests: Bucket,
    tokens: Bucket,
    input: Bucket,
    output: Bucket,
}

impl Account {
    /// Refills the buckets, checks that a request and `need` (input, output
    /// tokens) fit, and if so takes the request and `charge`.
    fn take(&mut self, dialect: Dialect, need: (u64, u64), charge: (u64, u64)) -> Result<(), Refusal> {
        let now = Instant::now();
        for b in [&mut self.requests, &mut self.tokens, &mut self.input, &mut self.output] {
            b.refill(now);
        }
        check(&self.requests, "requests", 1.0)?;
        match dialect {
            Dialect::OpenAi => check(&self.tokens, "tokens", (need.0 + need.1) as f64)?,
            Dialect::Anthropic => {
                check(&self.input, "input-tokens", need.0 as f64)?;
                check(&self.output, "output-tokens", need.1 as f64)?;
            }
        }
        self.requests.take(1.0);
        match dialect {
            Dialect::OpenAi => self.tokens.take((charge.0 + charge.1) as f64),
            Dialect::Anthropic => {
                self.input.take(charge.0 as f64);
                self.output.take(charge.1 as f64);
            }
        }
        Ok(())
    }
}

/// Why a call is refused: the bucket, and the figures its 429 names.
struct Refusal {
    bucket: &'static str,
    limit: f64,
    used: f64,
    requested: f64,
    retry_after: u64,
}

/// Checks `need` against `b`: `Err` if it would overdraw it.
fn check(b: &Bucket, name: &'static str, need: f64) -> Result<(), Refusal> {
    if b.fits(need) {
        return Ok(());
    }
    let used = (b.size() - b.level()).max(0.0);
    Err(Refusal { bucket: name, limit: b.size(), used, requested: need, retry_after: b.retry_after(need) })
}

// === state ===

struct Inner {
    cfg: LlmConfig,
    dialect: Dialect,
    state: Mutex<State>,
}

struct State {
    account: Account,
    /// Calls without an `x-call-id` so far: their draws' sequence.
    seq: u64,
    calls: Vec<Call>,
}

/// A call let in: its place in the record and its answer.
struct Admitted {
    index: usize,
    draft: Draft,
    /// What Admission metering charged on arrival (input, output).
    charged: (u64, u64),
}

impl Inner {
    /// Draws the call's output, checks and charges the buckets on arrival,
    /// and records the call.
    fn admit(&self, endpoint: Endpoint, id: Option<String>, ask: &Ask) -> Result<Admitted, Refusal> {
        let cfg = &self.cfg;
        let mut st = self.state.lock().unwrap();
        let draw = match &id {
            Some(id) => splitmix(cfg.seed ^ fnv1a(id.as_bytes())),
            None => {
                st.seq += 1;
                splitmix(cfg.seed.wrapping_add(st.seq.wrapping_mul(0x9e37_79b9)))
            }
        };
        let draft = generate(cfg, ask, draw);
        let charged = match cfg.metering {
            Metering::Answer => (0, 0),
            Metering::Admission => (draft.input, ask.limit.unwrap_or(cfg.default_output_limit)),
        };
        let need = if cfg.metering == Metering::Answer { (draft.input, draft.output) } else { charged };
        let verdict = st.account.take(self.dialect, need, charged);
        let arrived = unix_now();
        let refused = verdict.as_ref().err();
        st.calls.push(Call {
            id,
            endpoint,
            arrived,
            finished: refused.map(|_| arrived),
            status: if refused.is_some() { 429 } else { 200 },
            refused_by: refused.map(|r| r.bucket),
            input_tokens: 0,
            output_tokens: 0,
            streamed: ask.stream,
            asked_usage: ask.include_usage,
            complete: refused.is_some(),
            sent: Bytes::new(),
            plain: Bytes::new(),
        });
        verdict.map(|()| Admitted { index: st.calls.len() - 1, draft, charged })
    }

    /// Ends call `a`: charges its real cost (or settles the admission's
    /// charge) and records its tokens and bodies.
    fn finish(&self, a: &Admitted, complete: bool, sent: Bytes, plain: Bytes) {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        let acc = &mut st.account;
        for b in [&mut acc.tokens, &mut acc.input, &mut acc.output] {
            b.refill(now);
        }
        let (input, output) = (a.draft.input, a.draft.output);
        match (self.dialect, self.cfg.metering) {
            (Dialect::OpenAi, Metering::Answer) => acc.tokens.take((input + output) as f64),
            (Dialect::OpenAi, Metering::Admission) => {}
            (Dialect::Anthropic, Metering::Answer) => {
                acc.input.take(input as f64);
                acc.output.take(output as f64);
            }
            // Anthropic estimates output by max_tokens and corrects it at the end.
            (Dialect::Anthropic, Metering::Admission) => {
                acc.output.give(a.charged.1 as f64 - output as f64);
            }
        }
        let call = &mut st.calls[a.index];
        call.finished = Some(unix_now());
        call.input_tokens = input;
        call.output_tokens = output;
        call.complete = complete;
        call.sent = sent;
        call.plain = plain;
    }

    /// The quota headers of the account as it stands (none if switched off).
    fn quota_headers(&self) -> Vec<(String, String)> {
        if !self.cfg.quota_headers {
            return Vec::new();
        }
        let st = self.state.lock().unwrap();
        let a = &st.account;
        match self.dialect {
            Dialect::OpenAi => [("requests", &a.requests), ("tokens", &a.tokens)]
                .into_iter()
                .flat_map(|(name, b)| {
                    [
                        (format!("x-ratelimit-limit-{name}"), format!("{}", b.size().round() as u64)),
                        (format!("x-ratelimit-remaining-{name}"), b.remaining().to_string()),
                        (format!("x-ratelimit-reset-{name}"), super::go_duration(b.until_full())),
                    ]
                })
                .collect(),
            Dialect::Anthropic => {
                let ratio = |b: &Bucket| b.level() / b.size();
                let tighter = if ratio(&a.input) <= ratio(&a.output) { &a.input } else { &a.output };
                [
                    ("requests", &a.requests),
                    ("tokens", tighter),
                    ("input-tokens", &a.input),
                    ("output-tokens", &a.output),
                ]
                .into_iter()
                .flat_map(|(name, b)| {
                    let reset = SystemTime::now() + Duration::from_secs_f64(b.until_full().max(0.0));
                    [
                        (format!("anthropic-ratelimit-{name}-limit"), format!("{}", b.size().round() as u64)),
                        (format!("anthropic-ratelimit-{name}-remaining"), b.remaining().to_string()),
                        (
                            format!("anthropic-ratelimit-{name}-reset"),
                            humantime::format_rfc3339_seconds(reset).to_string(),
                        ),
                    ]
                })
                .collect()
            }
        }
    }
}

/// splitmix64's output for `x`.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const WORDS: [&str; 16] = [
    "the", "quick", "model", "writes", "a", "short", "answer", "about", "leases", "and", "tokens", "per", "minute",
    "to", "each", "app",
];

/// The answer a draw makes: its output tokens (capped by the request's
/// limit) and its text, `tokens_per_chunk` words to a piece.
fn generate(cfg: &LlmConfig, ask: &Ask, draw: u64) -> Draft {
    let (lo, hi) = (*cfg.completion.start(), *cfg.completion.end());
    let drawn = lo + draw % (hi - lo + 1);
    let output = ask.limit.map_or(drawn, |l| drawn.min(l));
    let mut x = draw | 1;
    let words: Vec<&str> = (0..output)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            WORDS[(x % WORDS.len() as u64) as usize]
        })
        .collect();
    let pieces = words.chunks(cfg.tokens_per_chunk.max(1) as usize).map(|c| format!("{} ", c.join(" "))).collect();
    Draft {
        id: format!("{draw:016x}"),
        model: ask.model.clone(),
        created: unix_now() as u64,
        input: ask.input_tokens(),
        output,
        capped: output < drawn,
        limit: ask.limit,
        pieces,
    }
}

// === the server ===

/// A running stand-in; stops accepting connections when dropped.
pub struct LlmApi {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// When it started, Unix seconds.
    pub started: f64,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LlmApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LlmApi {
    /// An OpenAI-like API: `/v1/chat/completions` and `/v1/responses`.
    pub async fn openai(cfg: LlmConfig) -> LlmApi {
        Self::start(cfg, Dialect::OpenAi).await
    }

    /// An Anthropic-like API: `/v1/messages`.
    pub async fn anthropic(cfg: LlmConfig) -> LlmApi {
        Self::start(cfg, Dialect::Anthropic).await
    }

    async fn start(cfg: LlmConfig, dialect: Dialect) -> LlmApi {
        assert!(cfg.completion.start() <= cfg.completion.end(), "an empty completion range");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let now = Instant::now();
        let account = Account {
            requests: Bucket::full(cfg.requests_per_min, now),
            tokens: Bucket::full(cfg.tokens_per_min, now),
            input: Bucket::full(cfg.input_tokens_per_min, now),
            output: Bucket::full(cfg.output_tokens_per_min, now),
        };
        let inner = Arc::new(Inner { cfg, dialect, state: Mutex::new(State { account, seq: 0, calls: Vec::new() }) });
        let shared = inner.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let inner = shared.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let inner = inner.clone();
                        async move { Ok::<_, Infallible>(handle(inner, req).await) }
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        });
        LlmApi { addr, started: unix_now(), inner, task }
    }

    /// Every call so far, in arrival order.
    pub fn calls(&self) -> Vec<Call> {
        self.inner.state.lock().unwrap().calls.clone()
    }

    /// Spend by minute since `origin` (Unix seconds), by when answers ended.
    pub fn spend_by_minute(&self, origin: f64) -> Vec<Spend> {
        spend_by_minute(&self.inner.state.lock().unwrap().calls, origin)
    }

    /// Calls answered 429 that arrived at or after `since` (Unix seconds).
    pub fn refusals_since(&self, since: f64) -> usize {
        self.inner.state.lock().unwrap().calls.iter().filter(|c| c.status == 429 && c.arrived >= since).count()
    }
}

// === answers ===

async fn handle(inner: Arc<Inner>, req: Request<Incoming>) -> Response<TestBody> {
    let endpoint = match (inner.dialect, req.method().as_str(), req.uri().path()) {
        (Dialect::OpenAi, "POST", "/v1/chat/completions") => Endpoint::Chat,
        (Dialect::OpenAi, "POST", "/v1/responses") => Endpoint::Responses,
        (Dialect::Anthropic, "POST", "/v1/messages") => Endpoint::Messages,
        _ => {
            return error(
                &inner,
                StatusCode::NOT_FOUND,
                &format!("Invalid URL ({} {})", req.method(), req.uri().path()),
            );
        }
    };
    let id = req.headers().get("x-call-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let ask = match request::parse(endpoint, &body) {
        Ok(a) => a,
        Err(msg) => return error(&inner, StatusCode::BAD_REQUEST, &msg),
    };
    let admitted = match inner.admit(endpoint, id, &ask) {
        Ok(a) => a,
        Err(r) => return refuse(&inner, &ask, &r),
    };
    let draft = &admitted.draft;
    if !ask.stream {
        tokio::time::sleep(inner.cfg.chunk_every * draft.pieces.len() as u32).await;
        let body = Bytes::from(match endpoint {
            Endpoint::Chat => render::chat_json(draft),
            Endpoint::Responses => render::responses_json(draft),
            Endpoint::Messages => render::messages_json(draft),
        });
        inner.finish(&admitted, true, body.clone(), body.clone());
        return answer(&inner, StatusCode::OK, "application/json", &draft.id, full(body));
    }
    let (events, plain) = match endpoint {
        Endpoint::Chat => (render::chat_stream(draft, ask.include_usage), render::chat_stream(draft, false).concat()),
        Endpoint::Responses => (render::responses_stream(draft), String::new()),
        Endpoint::Messages => (render::messages_stream(draft), String::new()),
    };
    let plain = if plain.is_empty() { events.concat() } else { plain };
    let id = draft.id.clone();
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(stream(inner.clone(), admitted, events, Bytes::from(plain), tx));
    answer(&inner, StatusCode::OK, "text/event-stream; charset=utf-8", &id, ChannelBody(rx).boxed_unsync())
}

/// Sends `events` one every `chunk_every`, then ends the call.
async fn stream(inner: Arc<Inner>, admitted: Admitted, events: Vec<String>, plain: Bytes, tx: mpsc::Sender<Bytes>) {
    let mut sent = Vec::new();
    let mut complete = true;
    for (i, e) in events.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(inner.cfg.chunk_every).await;
        }
        if tx.send(Bytes::from(e.clone())).await.is_err() {
            complete = false;
            break;
        }
        sent.extend_from_slice(e.as_bytes());
    }
    drop(tx);
    inner.finish(&admitted, complete, Bytes::from(sent), plain);
}

/// A response with the account's headers and the API's request id.
fn answer(inner: &Inner, status: StatusCode, content_type: &str, id: &str, body: TestBody) -> Response<TestBody> {
    let mut b = Response::builder().status(status).header("content-type", content_type);
    b = match inner.dialect {
        Dialect::OpenAi => b.header("x-request-id", format!("req_{id}")),
        Dialect::Anthropic => b.header("request-id", format!("req_{id}")),
    };
    for (k, v) in inner.quota_headers() {
        b = b.header(k, v);
    }
    if status == StatusCode::OK && content_type.starts_with("text/event-stream") {
        b = b.header("cache-control", "no-cache");
    }
    b.body(body).unwrap()
}

/// A 429 in the API's words, with `retry-after`.
fn refuse(inner: &Inner, ask: &Ask, r: &Refusal) -> Response<TestBody> {
    let body = match inner.dialect {
        Dialect::OpenAi => {
            let (per, short) = if r.bucket == "requests" { ("requests", "RPM") } else { ("tokens", "TPM") };
            let message = format!(
                "Rate limit reached for {} in organization org-usher on {per} per min ({short}): Limit {}, Used {}, Requested {}. Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.",
                ask.model,
                r.limit.round(),
                r.used.round(),
                r.requested.round(),
                super::go_duration(r.retry_after as f64)
            );
            render::openai_error(&message, per, Some("rate_limit_exceeded"))
        }
        Dialect::Anthropic => {
            let message = format!(
                "This request would exceed the rate limit for your organization (org-usher) of {} {} per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later.",
                r.limit.round(),
                r.bucket.replace('-', " ")
            );
            render::anthropic_error("rate_limit_error", &message, "req_refused")
        }
    };
    let mut resp = answer(inner, StatusCode::TOO_MANY_REQUESTS, "application/json", "refused", full(body));
    resp.headers_mut().insert("retry-after", r.retry_after.into());
    resp
}

/// A 400 or 404 in the API's words.
fn error(inner: &Inner, status: StatusCode, message: &str) -> Response<TestBody> {
    let body = match inner.dialect {
        Dialect::OpenAi => render::openai_error(message, "invalid_request_error", None),
        Dialect::Anthropic => {
            let kind = if status == StatusCode::NOT_FOUND { "not_found_error" } else { "invalid_request_error" };
            render::anthropic_error(kind, message, "req_error")
        }
    };
    answer(inner, status, "application/json", "error", full(body))
}

/// A body fed by a channel, one frame a message, ended when the sender goes.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
