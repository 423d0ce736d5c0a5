//! Streamed LLM answers settled through `usher proxy`: a route resource's
//! cost read from a stream of server-sent events as it passes (`settle: {
//! usage: openai | anthropic }`, `settle: { response_json: PATH }`), on both
//! engines, from HTTP/1.1 and h2c upstreams, chunked or with a length. The
//! app gets every byte the upstream sent, the usage too when it asked for
//! it; an app that leaves mid-stream is charged what the stream says it
//! used. The bucket is read from `/debug/status`, the outcomes from
//! `/metrics`.
//!
//! The stand-in LLM answers by the last step of the path with OpenAI's or
//! Anthropic's streams (or a JSON body), cut into pieces through events and
//! sent a few milliseconds apart, with a `content-length` when the request
//! says `x-framing: length`.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::{Response, StatusCode};
use support::upstream::{Client, empty, read, serve_fn};
use support::{Usher, http_get, metric, write_file};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Each resource's bucket: `capacity: 1/h`, so what a test spends is not
/// refilled while it runs.
const BURST: f64 = 1000.0;

/// An OpenAI Chat Completions stream whose request asked for the usage
/// (`stream_options.include_usage`): 9 + 12 = 21 tokens.
const CHAT_USAGE: &[&str] = &[
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo \\\"usage\\\": {}\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n",
    "data: [DONE]\n\n",
];

/// The same stream without the usage (the app did not ask for it).
const CHAT: &[&str] = &[
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
];

/// An OpenAI Responses stream, with `\r\n` line ends: 5 + 7 = 12 tokens.
const RESPONSES: &[&str] = &[
    "event: response.created\r\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r1\",\"status\":\"in_progress\",\"usage\":null}}\r\n\r\n",
    "event: response.output_text.delta\r\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\r\n\r\n",
    "event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r1\",\"status\":\"completed\",\
     \"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\"}]}],\
     \"usage\":{\"input_tokens\":5,\"output_tokens\":7,\"total_tokens\":12}}}\r\n\r\n",
];

/// An Anthropic Messages stream: 25 input tokens (`message_start`), 15
/// output tokens (the last `message_delta`); one event's data on two lines.
const ANTHROPIC: &[&str] = &[
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"content\":[],\
     \"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n",
    "event: ping\ndata: {\"type\": \"ping\"}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\ndata: \"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":10}}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n",
    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// An Anthropic answer not streamed: 95 + 53 = 148 tokens.
const ANTHROPIC_JSON: &str = "{\"id\":\"m2\",\"type\":\"message\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}],\
                              \"usage\":{\"input_tokens\":95,\"output_tokens\":53}}";

/// What the stand-in answers to a path ending in `kind`: its content type and body.
fn answer(kind: &str) -> (&'static str, String) {
    match kind {
        "chat-usage" => ("text/event-stream", CHAT_USAGE.concat()),
        "chat" => ("text/event-stream", CHAT.concat()),
        "responses" => ("text/event-stream", RESPONSES.concat()),
        "anthropic" => ("text/event-stream", ANTHROPIC.concat()),
        "anthropic-json" => ("application/json", ANTHROPIC_JSON.into()),
        // Ten content chunks, then the usage: long enough for an app to leave in the middle.
        "slow" => {
            let content = &CHAT_USAGE[1];
            ("text/event-stream", [&[*content; 10][..], &CHAT_USAGE[4..]].concat().concat())
        }
        other => panic!("no answer {other}"),
    }
}

/// A body sent in pieces `pause` apart, with its length when `sized`;
/// after the last piece it never ends when `stalls`.
struct Pieces {
    pieces: std::vec::IntoIter<Bytes>,
    len: u64,
    sized: bool,
    stalls: bool,
    pause: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Awaited before the second piece.
    gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    sent: usize,
}

/// What a `-gated` answer waits for after its first event: the test's word
/// that the app has that event.
static GATE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

impl Body for Pieces {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let pause = self.pause;
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(pause)));
        std::task::ready!(sleep.as_mut().poll(cx));
        let second = self.sent == 1;
        if let Some(gate) = self.gate.as_mut().filter(|_| second) {
            std::task::ready!(gate.as_mut().poll(cx));
            self.gate = None;
        }
        self.sleep = None;
        self.sent += 1;
        match self.pieces.next() {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
            None if self.stalls => Poll::Pending,
            None => Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.sized {
            true => SizeHint::with_exact(self.len),
            false => SizeHint::default(),
        }
    }
}

/// The stand-in's answer to `req`, cut into pieces through its events.
fn respond(req: &Request<Incoming>) -> Response<Pieces> {
    let kind = req.uri().path().rsplit('/').next().unwrap_or_default().to_string();
    let (stalls, kind) = match kind.strip_suffix("-stall") {
        Some(k) => (true, k.to_string()),
        None => (false, kind),
    };
    let (gated, kind) = match kind.strip_suffix("-gated") {
        Some(k) => (true, k.to_string()),
        None => (false, kind),
    };
    let (content_type, body) = answer(&kind);
    let body = Bytes::from(body);
    let step = if kind == "slow" { body.len() / 12 } else { 37 };
    let mut pieces: Vec<Bytes> =
        (0..body.len()).step_by(step).map(|i| body.slice(i..(i + step).min(body.len()))).collect();
    if stalls {
        pieces.truncate(4);
    }
    let gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>> = gated.then(|| {
        // The first event whole, then the rest once the app has it.
        let first = body.windows(2).position(|w| w == b"\n\n").unwrap() + 2;
        pieces = vec![body.slice(..first), body.slice(first..)];
        Box::pin(async { GATE.acquire().await.unwrap().forget() }) as _
    });
    let pause = Duration::from_millis(if kind == "slow" || stalls { 40 } else { 3 });
    let sized = req.headers().get("x-framing").is_some_and(|v| v == "length") && !stalls;
    let len = body.len() as u64;
    let body = Pieces { pieces: pieces.into_iter(), len, sized, stalls, pause, sleep: None, gate, sent: 0 };
    Response::builder().header("content-type", content_type).body(body).unwrap()
}

/// A routes file: each route `/NAME/` charges 100 of its own resource
/// `NAME` (a bucket of [`BURST`]) and settles it as `settle` says; `h2c-`
/// routes reach the upstream over h2c, `short-` ones with a timeout of 1s.
fn routes_file(up: SocketAddr, routes: &[(&str, &str)]) -> String {
    let mut f = format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\" }}\n  llm-h2c: {{ url: \"http://{up}\", h2c: true }}\n  \
         llm-short: {{ url: \"http://{up}\", timeout: 1s }}\nresources:\n"
    );
    for (n, _) in routes {
        f += &format!("  {n}: {{ kind: rate, capacity: 1/h, burst: {BURST} }}\n");
    }
    f += "routes:\n";
    for (n, settle) in routes {
        let upstream = match n.split('-').next() {
            Some("h2c") => "llm-h2c",
            Some("short") => "llm-short",
            _ => "llm",
        };
        f += &format!(
            "  - name: {n}\n    upstream: {upstream}\n    match: {{ path_prefix: /{n}/ }}\n    resources:\n      \
             - {{ resource: {n}, cost: 100, settle: {settle} }}\n"
        );
    }
    f
}

/// POSTs to `path` and returns the response, its body unread.
async fn post(client: &mut Client, path: &str, framing: &str) -> Response<Incoming> {
    client
        .send(Request::post(path).header("host", "llm.local").header("x-framing", framing).body(empty()).unwrap())
        .await
}

fn settles(text: &str, route: &str, outcome: &str) -> f64 {
    metric(text, "usher_proxy_settles_total", &[("route", route), ("outcome", outcome)]).unwrap_or(0.0)
}

/// What resource `name`'s key could pass now, from `/debug/status`.
fn remaining(sidecar: &Usher, name: &str) -> f64 {
    let (code, text) = http_get(sidecar.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{text}");
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    let keys = status["keys"].as_array().unwrap();
    let key = keys.iter().find(|k| k["resource"] == name).unwrap_or_else(|| panic!("no key of {name}: {text}"));
    key["remaining"].as_f64().unwrap()
}

/// Each engine, from HTTP/1.1 and h2c upstreams, chunked and with a length:
/// four answers per route, each charged 100 at admission and settled to
/// what its stream says. The bytes reach the app as the upstream sent them,
/// the usage chunk too when the app asked for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_settle_on_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let up = serve_fn(respond).await;
    // (route, settle, the answer it gets, its real cost; None: none, the charge stands)
    let cases = [
        ("chat", "{ usage: openai }", "chat-usage", Some(21.0)),
        ("h2c-chat", "{ usage: openai }", "chat-usage", Some(21.0)),
        ("chat-input", "{ usage: openai, tokens: input }", "chat-usage", Some(9.0)),
        ("chat-json", "{ response_json: usage.total_tokens }", "chat-usage", Some(21.0)),
        ("chat-none", "{ usage: openai }", "chat", None),
        ("responses", "{ usage: openai }", "responses", Some(12.0)),
        ("anthropic", "{ usage: anthropic }", "anthropic", Some(40.0)),
        ("h2c-anthropic-out", "{ usage: anthropic, tokens: output }", "anthropic", Some(15.0)),
        ("anthropic-json", "{ usage: anthropic }", "anthropic-json", Some(148.0)),
    ];
    let mut routes: Vec<(&str, &str)> = cases.iter().map(|(r, s, _, _)| (*r, *s)).collect();
    routes.push(("head", "{ usage: openai }"));
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes_file(up, &routes)));
    for engine in ["native", "hyper"] {
        let mut client = Client::new(engine, sidecar.addr("listen")).await;
        // An answer without a body (to HEAD) has no cost in it: its charge stands.
        let req = Request::head("/head/v1/chat-usage").header("host", "llm.local").body(empty()).unwrap();
        let got = read(client.send(req).await).await;
        assert!(got.status == StatusCode::OK && got.body.is_empty(), "{engine}: {got:?}");
        for framing in ["chunked", "length"] {
            for (route, _, kind, _) in cases {
                let got = read(post(&mut client, &format!("/{route}/v1/{kind}"), framing).await).await;
                let what = format!("{engine} engine, {framing}, {route}");
                assert_eq!(got.status, StatusCode::OK, "{what}: {}", got.text());
                assert_eq!(got.text(), answer(kind).1, "{what}: the app gets every byte as sent");
            }
        }
    }
    let text = sidecar.metrics();
    for (route, _, _, real) in cases {
        let want = BURST - 4.0 * real.unwrap_or(100.0);
        let left = remaining(&sidecar, route);
        assert!((left - want).abs() < 0.5, "{route}: {left} left, not {want}");
        let (settled, missing) = if real.is_some() { (4.0, 0.0) } else { (0.0, 4.0) };
        assert_eq!(settles(&text, route, "settled"), settled, "{route}:\n{text}");
        assert_eq!(settles(&text, route, "missing"), missing, "{route}:\n{text}");
    }
    assert_eq!(settles(&text, "head", "empty"), 2.0, "{text}");
    assert!((remaining(&sidecar, "head") - (BURST - 200.0)).abs() < 0.5);
    let handoffs = metric(&text, "usher_proxy_http1_handoffs_total", &[]).unwrap_or(0.0);
    assert_eq!(handoffs, 0.0, "the HTTP/1.1 requests stayed on the native engine");
    let log = sidecar.log();
    let warned = log.lines().filter(|l| l.contains("WARN") && l.contains("cost not settled")).collect::<Vec<_>>();
    assert!(warned.len() == 1 && warned[0].contains("chat-none"), "one warning, for the stream without usage:\n{log}");
}

/// No piece of a stream waits for usher: the stand-in sends its second
/// piece only once the app has the first event, on both engines, chunked
/// and with a length. (Had usher held the stream back, the app would wait
/// for ever.) The stream is settled all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_piece_of_a_stream_reaches_the_app_before_the_next_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let up = serve_fn(respond).await;
    let sidecar =
        Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes_file(up, &[("chat", "{ usage: openai }")])));
    for engine in ["native", "hyper"] {
        let mut client = Client::new(engine, sidecar.addr("listen")).await;
        for framing in ["chunked", "length"] {
            let mut body = post(&mut client, "/chat/v1/chat-usage-gated", framing).await.into_body();
            let mut got = Vec::new();
            while !got.ends_with(b"\n\n") {
                let frame = tokio::time::timeout(Duration::from_secs(10), body.frame()).await;
                let frame = frame.unwrap_or_else(|_| panic!("{engine}, {framing}: the first event was held back"));
                got.extend_from_slice(frame.unwrap().unwrap().data_ref().unwrap());
            }
            assert_eq!(got, CHAT_USAGE[0].as_bytes(), "{engine}, {framing}");
            GATE.add_permits(1);
            got.extend_from_slice(&body.collect().await.unwrap().to_bytes());
            assert_eq!(String::from_utf8_lossy(&got), CHAT_USAGE.concat(), "{engine}, {framing}");
        }
    }
    assert_eq!(settles(&sidecar.metrics(), "chat", "settled"), 4.0);
    assert!((remaining(&sidecar, "chat") - (BURST - 4.0 * 21.0)).abs() < 0.5);
}

/// Reads `resp`'s body until it has the start of `events` events, then drops it.
async fn read_events(resp: Response<Incoming>, events: usize) {
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while got.windows(6).filter(|w| w == b"data: ").count() < events {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame()).await.unwrap().unwrap().unwrap();
        got.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..]));
    }
}

/// An app that leaves after two events: usher reads the rest of the stream
/// for its cost and charges what it says (21 tokens, not the 100 charged
/// at admission); a stream that does not end within the upstream's timeout
/// keeps the admission's charge. Either way the answer counts as `client_gone`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_leaves_mid_stream_is_charged_what_the_stream_used() {
    let dir = tempfile::tempdir().unwrap();
    let up = serve_fn(respond).await;
    let routes = [
        ("gone-native", "{ usage: openai }"),
        ("gone-hyper", "{ usage: openai }"),
        ("short-native", "{ usage: openai }"),
        ("short-hyper", "{ usage: openai }"),
    ];
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes_file(up, &routes)));
    let addr = sidecar.addr("listen");
    for (route, kind) in [("gone", "slow"), ("short", "slow-stall")] {
        // The native engine: an HTTP/1.1 app that closes its connection.
        let mut app = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("POST /{route}-native/v1/{kind} HTTP/1.1\r\nhost: llm.local\r\ncontent-length: 0\r\n\r\n");
        app.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        while got.windows(6).filter(|w| w == b"data: ").count() < 2 {
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(10), app.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "the sidecar closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        drop(app);
        // The hyper engine: an h2c app that resets its stream.
        let mut client = Client::new("hyper", addr).await;
        read_events(post(&mut client, &format!("/{route}-hyper/v1/{kind}"), "chunked").await, 2).await;
        drop(client);
    }
    for route in ["gone-native", "gone-hyper", "short-native", "short-hyper"] {
        assert_eventually!(
            settles(&sidecar.metrics(), route, "client_gone") == 1.0,
            Duration::from_secs(10),
            "{route}: counted as client_gone:\n{}",
            sidecar.metrics()
        );
        let want = if route.starts_with("gone") { BURST - 21.0 } else { BURST - 100.0 };
        let left = remaining(&sidecar, route);
        assert!((left - want).abs() < 0.5, "{route}: {left} left, not {want}");
        assert_eq!(settles(&sidecar.metrics(), route, "settled"), 0.0);
    }
}

/// A budget in dollars: each call is charged 0.50 at admission and settled
/// to its tokens' price, fractions of a cent that count all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_in_dollars_is_settled_to_the_price_of_the_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let up = serve_fn(respond).await;
    let file = format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\" }}\n\
         resources:\n  llm-usd: {{ kind: rate, capacity: 1/day, burst: 2 }}\n\
         routes:\n  - name: chat\n    upstream: llm\n    resources:\n      \
         - {{ resource: llm-usd, cost: 0.5, settle: {{ usage: openai, price: {{ input_per_million: 1000, output_per_million: 4000 }} }} }}\n"
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &file));
    let mut client = Client::new("native", sidecar.addr("listen")).await;
    for _ in 0..3 {
        let got = read(post(&mut client, "/v1/chat-usage", "chunked").await).await;
        assert_eq!(got.status, StatusCode::OK, "{}", got.text());
    }
    // 9 input tokens at $1000/M and 12 output tokens at $4000/M: $0.057 a call.
    let left = remaining(&sidecar, "llm-usd");
    let want = 2.0 - 3.0 * 0.057;
    assert!((want..want + 0.001).contains(&left), "{left} left, not {want} (unsettled: {})", 2.0 - 1.5);
    assert_eq!(settles(&sidecar.metrics(), "chat", "settled"), 3.0);
}
