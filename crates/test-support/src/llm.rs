//! Stand-ins for LLM APIs: real hyper servers on 127.0.0.1:0 (HTTP/1.1 and
//! h2c) that answer, stream, meter and refuse as OpenAI's and Anthropic's
//! APIs do, and record every call for the tests' assertions.
//!
//! ```no_run
//! # async fn demo() {
//! use usher_test_support::llm::{LlmApi, LlmConfig};
//! let api = LlmApi::openai(LlmConfig { tokens_per_min: 6000.0, ..LlmConfig::default() }).await;
//! // Point a client (or a sidecar's upstream) at `http://{api.addr}/v1`, then:
//! let per_minute = api.spend_by_minute(api.started);
//! # let _ = per_minute;
//! # }
//! ```
//!
//! - [`LlmApi::openai`] serves `POST /v1/chat/completions` (`messages`,
//!   `max_tokens` or `max_completion_tokens`, `stream`, `stream_options`)
//!   and `POST /v1/responses` (`input`, `instructions`, `max_output_tokens`,
//!   `stream`). [`LlmApi::anthropic`] serves `POST /v1/messages` (`system`,
//!   `messages`, `max_tokens`, which is required, and `stream`).
//! - **A call's real cost.** Its input tokens are the prompt's characters ÷ 4,
//!   rounded up (the text of every message, string or `text` parts, plus
//!   `instructions` or `system`). Its output tokens are drawn from
//!   [`LlmConfig::completion`], capped by the request's output limit. The
//!   draw is seeded: from the seed and the request's `x-call-id` header when
//!   it has one (a retried call draws the same), else from the seed and the
//!   call's place in arrival order. A capped answer ends as the API's do
//!   (`finish_reason: "length"`, `stop_reason: "max_tokens"`, the Responses
//!   API's `response.incomplete`).
//! - **Buckets.** Requests, and tokens (OpenAI: input plus output; Anthropic:
//!   input and output apart), each holds a minute's limit and refills
//!   continuously. With [`Metering::Answer`] (the default) a call is refused
//!   if its real cost would overdraw a bucket when it arrives, and its cost is
//!   taken when its answer ends, so calls in flight together can take a
//!   bucket below 0. With [`Metering::Admission`] a call is charged when it
//!   arrives, as the APIs document: OpenAI takes the prompt plus the output
//!   limit and keeps it; Anthropic takes the input and the output limit and
//!   gives back the unused output at the end.
//! - **Headers.** Every answer carries the quota headers the API sends
//!   (OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets
//!   as Go durations; Anthropic's `anthropic-ratelimit-{requests,tokens,
//!   input-tokens,output-tokens}-{limit,remaining,reset}`, resets in RFC 3339),
//!   unless [`LlmConfig::quota_headers`] is off. A refused call gets the API's
//!   429 body and `retry-after` in whole seconds. Usage is never in a header.
//! - **Streams** are server-sent events, one event every
//!   [`LlmConfig::chunk_every`]. OpenAI's chat stream carries usage only when
//!   the request set `stream_options.include_usage: true`: then every chunk
//!   has `"usage":null` and a last chunk with empty `choices` has the usage,
//!   before `data: [DONE]`. The Responses API's stream ends with
//!   `response.completed`; Anthropic's with `message_delta` (the output
//!   tokens) and `message_stop`.
//! - **Records.** Each [`Call`] keeps its arrival and finish, status, real
//!   tokens, whether it streamed and asked for usage, whether its body went
//!   out whole, and the body's bytes: as sent, and as they would have been
//!   had the request not asked for usage.

mod render;
mod request;
mod server;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

pub use server::LlmApi;

/// How a stand-in meters a call against its token buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metering {
    /// Refused if its real cost would overdraw a bucket on arrival; charged
    /// its real cost when the answer ends.
    Answer,
    /// Charged on arrival as the API documents (see the module docs).
    Admission,
}

/// A stand-in's account and behaviour.
#[derive(Clone, Debug)]
pub struct LlmConfig {
    /// Seeds every call's output length and text.
    pub seed: u64,
    /// Output tokens a call draws from, before the request's limit.
    pub completion: RangeInclusive<u64>,
    /// Requests a minute (RPM).
    pub requests_per_min: f64,
    /// OpenAI: tokens a minute (TPM), input and output together.
    pub tokens_per_min: f64,
    /// Anthropic: input tokens a minute (ITPM).
    pub input_tokens_per_min: f64,
    /// Anthropic: output tokens a minute (OTPM).
    pub output_tokens_per_min: f64,
    /// Whether answers carry the quota headers.
    pub quota_headers: bool,
    /// When a call's tokens are taken from the buckets.
    pub metering: Metering,
    /// The pause between two events of a stream; a whole answer takes as
    /// long as its stream would.
    pub chunk_every: Duration,
    /// Output tokens in each event that carries text.
    pub tokens_per_chunk: u64,
    /// The output limit of a request that sets none (OpenAI's estimate at
    /// admission counts it).
    pub default_output_limit: u64,
}

impl Default for LlmConfig {
    /// 120 requests and 6,000 tokens a minute (Anthropic: 6,000 input and
    /// 6,000 output), 50 to 250 output tokens a call, quota headers on,
    /// metered on answer, an event every 5 ms with 10 tokens each.
    fn default() -> Self {
        LlmConfig {
            seed: 1,
            completion: 50..=250,
            requests_per_min: 120.0,
            tokens_per_min: 6000.0,
            input_tokens_per_min: 6000.0,
            output_tokens_per_min: 6000.0,
            quota_headers: true,
            metering: Metering::Answer,
            chunk_every: Duration::from_millis(5),
            tokens_per_chunk: 10,
            default_output_limit: 4096,
        }
    }
}

/// Which API a call went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// OpenAI's `/v1/chat/completions`.
    Chat,
    /// OpenAI's `/v1/responses`.
    Responses,
    /// Anthropic's `/v1/messages`.
    Messages,
}

/// One call the stand-in received.
#[derive(Clone, Debug)]
pub struct Call {
    /// The request's `x-call-id` header.
    pub id: Option<String>,
    /// Where it went.
    pub endpoint: Endpoint,
    /// When it arrived, Unix seconds.
    pub arrived: f64,
    /// When its answer ended (at once for a refusal), Unix seconds; `None`
    /// while it runs.
    pub finished: Option<f64>,
    /// The answer's status: 200 or 429 (a request the API cannot read gets
    /// a 400 and no record).
    pub status: u16,
    /// The bucket that refused it: `requests`, `tokens`, `input-tokens` or
    /// `output-tokens`.
    pub refused_by: Option<&'static str>,
    /// Its real input tokens (0 unless answered 200).
    pub input_tokens: u64,
    /// Its real output tokens (0 unless answered 200).
    pub output_tokens: u64,
    /// The request set `stream: true`.
    pub streamed: bool,
    /// The request set `stream_options.include_usage: true`.
    pub asked_usage: bool,
    /// The whole body went out (false: the client left first).
    pub complete: bool,
    /// The body as sent, once the answer has ended.
    pub sent: Bytes,
    /// The body as it would have been had the request not asked for usage:
    /// what an app that did not ask should receive.
    pub plain: Bytes,
}

impl Call {
    /// Input plus output tokens.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

/// Tokens spent in one period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spend {
    /// Calls answered whose answer ended in the period.
    pub calls: u64,
    /// Their input tokens.
    pub input: u64,
    /// Their output tokens.
    pub output: u64,
}

impl Spend {
    /// Input plus output tokens.
    pub fn total(&self) -> u64 {
        self.input + self.output
    }
}

/// Spend by minute since `origin` (Unix seconds): element `m` holds the
/// calls answered 200 whose answer ended in `[origin + 60m, origin + 60(m+1))`.
pub fn spend_by_minute(calls: &[Call], origin: f64) -> Vec<Spend> {
    let mut minutes: Vec<Spend> = Vec::new();
    for c in calls.iter().filter(|c| c.status == 200) {
        let Some(end) = c.finished else { continue };
        if end < origin {
            continue;
        }
        let m = ((end - origin) / 60.0) as usize;
        if minutes.len() <= m {
            minutes.resize(m + 1, Spend::default());
        }
        minutes[m].calls += 1;
        minutes[m].input += c.input_tokens;
        minutes[m].output += c.output_tokens;
    }
    minutes
}

/// A bucket that holds a minute's limit and refills continuously, as
/// OpenAI's and Anthropic's do; a charge may take it below 0 (a debt).
#[derive(Debug, Clone)]
pub struct Bucket {
    size: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket of `per_min`.
    pub fn full(per_min: f64, now: Instant) -> Self {
        Bucket { size: per_min, level: per_min, at: now }
    }

    /// What it holds when full: the limit a minute.
    pub fn size(&self) -> f64 {
        self.size
    }

    /// What it holds now (as of the last [`Bucket::refill`]).
    pub fn level(&self) -> f64 {
        self.level
    }

    fn per_s(&self) -> f64 {
        self.size / 60.0
    }

    /// Adds what has flowed in since the last refill, up to full.
    pub fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_s()).min(self.size);
        self.at = now;
    }

    /// Whether it holds at least `amount`.
    pub fn fits(&self, amount: f64) -> bool {
        self.level >= amount
    }

    /// Takes `amount`, below 0 if need be.
    pub fn take(&mut self, amount: f64) {
        self.level -= amount;
    }

    /// Gives `amount` back, up to full.
    pub fn give(&mut self, amount: f64) {
        self.level = (self.level + amount).min(self.size);
    }

    /// Seconds until it holds `need`, rounded up to a whole second, at least 1.
    pub fn retry_after(&self, need: f64) -> u64 {
        (((need - self.level) / self.per_s()).ceil() as u64).max(1)
    }

    /// Seconds until it is full: what OpenAI's `x-ratelimit-reset-*` says.
    pub fn until_full(&self) -> f64 {
        (self.size - self.level) / self.per_s()
    }

    /// Whole units it holds, 0 when in debt: what `*-remaining` headers say.
    pub fn remaining(&self) -> u64 {
        self.level.max(0.0).floor() as u64
    }
}

/// FNV-1a, 64 bits.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// A body's digest as `tests/llm/app.py` writes it: FNV-1a 64, 16 hex digits.
pub fn digest(body: &[u8]) -> String {
    format!("{:016x}", fnv1a(body))
}

/// Now, in Unix seconds.
pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs_f64()
}

/// A duration as Go (and OpenAI's reset headers) write it: `6m0s`, `1.5s`,
/// `120ms`, `0s`.
pub fn go_duration(secs: f64) -> String {
    let ms = (secs.max(0.0) * 1000.0).round() as u64;
    if ms == 0 {
        "0s".into()
    } else if ms < 1000 {
        format!("{ms}ms")
    } else {
        let (m, s) = (ms / 60_000, (ms % 60_000) as f64 / 1000.0);
        if m > 0 { format!("{m}m{s}s") } else { format!("{s}s") }
    }
}

/// One server-sent event: its `event:` field, if any, and its data (the
/// `data:` lines joined with `\n`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field.
    pub event: Option<String>,
    /// The data.
    pub data: String,
}

/// Splits a whole `text/event-stream` body into its events (lines end in
/// `\n` or `\r\n`; an event without data is skipped, as the SSE spec says).
pub fn sse_events(body: &[u8]) -> Vec<SseEvent> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let (mut event, mut data) = (None, Vec::new());
        for line in block.lines() {
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => event = Some(value.to_string()),
                "data" => data.push(value),
                _ => {}
            }
        }
        if !data.is_empty() {
            out.push(SseEvent { event, data: data.join("\n") });
        }
    }
    out
}

/// The address of a running stand-in's API root, as SDKs take it:
/// `http://ADDR/v1` for OpenAI, `http://ADDR` for Anthropic.
pub fn base_url(addr: SocketAddr, endpoint: Endpoint) -> String {
    match endpoint {
        Endpoint::Chat | Endpoint::Responses => format!("http://{addr}/v1"),
        Endpoint::Messages => format!("http://{addr}"),
    }
}
