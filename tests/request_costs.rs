//! Costs read from the request's body, and usage asked for on the app's
//! behalf, through a real `usher proxy` on each way a body reaches it: a
//! small `content-length` body (the native HTTP/1.1 engine), a chunked one
//! (hyper, HTTP/1.1) and HTTP/2 (hyper). The upstream is a stand-in that
//! records what it received. What was charged at admission shows in which
//! requests a bucket of known size lets through.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::upstream::{full, h1, h2, send1, send2};
use support::{Usher, http_get, metric, write_file};

/// What the upstream received of one request.
#[derive(Debug, Clone)]
struct Seen {
    content_length: Option<String>,
    body: Bytes,
}

/// An upstream (HTTP/1.1 and h2c) that records each request and answers `{}`.
struct Echo {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Echo {
    async fn start() -> Echo {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let seen = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let content_length =
                                req.headers().get("content-length").map(|v| v.to_str().unwrap().to_string());
                            let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                            seen.lock().unwrap().push(Seen { content_length, body });
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Echo { addr, seen }
    }

    /// What the upstream received last.
    fn last(&self) -> Seen {
        self.seen.lock().unwrap().last().cloned().expect("the upstream received a request")
    }

    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

/// How a request reaches the sidecar.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Via {
    /// HTTP/1.1 with a `content-length` (the native engine, for a body of at most 64 KiB).
    Length,
    /// HTTP/1.1, chunked, in three pieces (hyper).
    Chunked,
    /// HTTP/2 with prior knowledge (hyper).
    H2,
}

const VIAS: [Via; 3] = [Via::Length, Via::Chunked, Via::H2];

/// Sends a POST of `body` to `/v1/chat/completions`; returns its status.
async fn post(addr: SocketAddr, via: Via, body: &[u8]) -> u16 {
    let path = "/v1/chat/completions";
    let req = |uri: String| {
        Request::post(uri).header("content-type", "application/json").body(full(Bytes::copy_from_slice(body))).unwrap()
    };
    match via {
        Via::Length => {
            let mut r = req(path.into());
            r.headers_mut().insert("host", "llm.local".parse().unwrap());
            send1(&mut h1(addr).await, r).await.status.as_u16()
        }
        Via::H2 => send2(&mut h2(addr).await, req(format!("http://llm.local{path}"))).await.status.as_u16(),
        Via::Chunked => {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: llm.local\r\ncontent-type: application/json\r\n\
                 Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            );
            s.write_all(head.as_bytes()).await.unwrap();
            let third = body.len().div_ceil(3).max(1);
            for piece in body.chunks(third) {
                s.write_all(format!("{:x}\r\n", piece.len()).as_bytes()).await.unwrap();
                s.write_all(piece).await.unwrap();
                s.write_all(b"\r\n").await.unwrap();
                s.flush().await.unwrap();
            }
            s.write_all(b"0\r\n\r\n").await.unwrap();
            status_of(&answer(&mut s).await)
        }
    }
}

/// The whole answer to a request sent with `Connection: close`.
async fn answer(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await.expect("answered").unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(answer: &str) -> u16 {
    answer.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// A sidecar with one route, `chat`, to `up`, whose one resource is `resource` used as `entry`.
fn sidecar(dir: &std::path::Path, up: &Echo, resource: &str, entry: &str) -> Usher {
    // One file per sidecar of a test.
    let name = format!("routes-{}.yaml", dir.read_dir().unwrap().count());
    let file = format!(
        "upstreams:\n  llm: {{ url: \"http://{}\", timeout: 1s }}\nresources:\n  tokens: {resource}\n\
         routes:\n  - name: chat\n    match: {{ path_prefix: /v1/ }}\n    upstream: llm\n    resources:\n      - {entry}\n  \
         - name: plain\n    upstream: llm\n",
        up.addr
    );
    Usher::proxy(&write_file(dir, &name, &file))
}

/// A resource no test request here comes near the limit of.
const ROOMY: &str = "{ kind: rate, capacity: 100/s }";
/// A bucket of 1000 that refills too slowly to matter in a test.
const BUCKET: &str = "{ kind: rate, capacity: 1/h, burst: 1000 }";
/// An entry that settles from OpenAI's usage: streamed chat calls ask for it.
const ASKS_USAGE: &str = "{ resource: tokens, settle: { usage: openai } }";
/// An entry charged an OpenAI call's estimate.
const ESTIMATE: &str = "{ resource: tokens, cost: { estimate: openai } }";

fn metrics(p: &Usher) -> String {
    http_get(p.addr("admin"), "/metrics").1
}

fn bodies(text: &str, outcome: &str) -> f64 {
    metric(text, "usher_proxy_request_body_total", &[("route", "chat"), ("outcome", outcome)]).unwrap_or(0.0)
}

/// Requests the native engine handed to hyper, for any reason.
fn handoffs(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("usher_proxy_http1_handoffs_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A streamed Chat Completions call that did not ask for its usage gets
/// `stream_options.include_usage` added on its way upstream, on every
/// engine, and its `content-length` says the new length; one that asked,
/// one that is not streamed and a body that is not JSON pass byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_call_asks_for_its_usage_on_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    let up = Echo::start().await;
    let p = sidecar(dir.path(), &up, ROOMY, ASKS_USAGE);
    let addr = p.addr("listen");
    let streamed = br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut sent = streamed[..streamed.len() - 1].to_vec();
    sent.extend_from_slice(br#","stream_options":{"include_usage":true}}"#);
    let untouched: [&[u8]; 3] = [
        br#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
        b"model=gpt-4o&stream=true",
    ];
    for via in VIAS {
        assert_eq!(post(addr, via, streamed).await, 200, "{via:?}\n{}", p.log());
        let seen = up.last();
        assert_eq!(String::from_utf8_lossy(&seen.body), String::from_utf8_lossy(&sent), "{via:?}");
        if via != Via::Chunked {
            assert_eq!(seen.content_length, Some(sent.len().to_string()), "{via:?}: the length is the new body's");
        }
        for body in untouched {
            assert_eq!(post(addr, via, body).await, 200, "{via:?}");
            assert_eq!(up.last().body, body, "{via:?}: forwarded byte for byte");
        }
    }
    let text = metrics(&p);
    assert_eq!(handoffs(&text), 4.0, "the 4 chunked requests went to hyper, the others stayed native:\n{text}");
    assert_eq!(bodies(&text, "usage_added"), 3.0, "{text}");
    assert_eq!(bodies(&text, "read"), 6.0, "{text}");
    assert_eq!(bodies(&text, "not_json"), 3.0, "{text}");
    // A route that reads no body is not counted.
    assert_eq!(http_get(addr, "/plain").0, 200);
    let text = metrics(&p);
    let series = |route: &str| {
        let label = format!("route=\"{route}\"");
        text.lines().filter(|l| l.starts_with("usher_proxy_request_body_total{") && l.contains(&label)).count()
    };
    assert_eq!((series("chat"), series("plain")), (5, 0), "{text}");
}

/// A chat request of `chars` characters of prompt and an output limit of `max_tokens`.
fn chat(chars: usize, max_tokens: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "gpt-4o",
        "messages": [{"role": "system", "content": "x".repeat(chars / 2)}, {"role": "user", "content": "y".repeat(chars - chars / 2)}],
        "max_tokens": max_tokens,
    }))
    .unwrap()
}

/// An estimate charges the prompt's characters ÷ 4 plus the output limit:
/// in a bucket of 1000, a call of 400 characters and 500 output tokens
/// (600) passes once, and then calls of 300 and 100 fill what is left
/// exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_estimate_is_charged_at_admission_on_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    let up = Echo::start().await;
    for via in VIAS {
        let p = sidecar(dir.path(), &up, BUCKET, ESTIMATE);
        let mut got = Vec::new();
        for (chars, max_tokens) in [(400, 500), (400, 500), (4, 299), (4, 299), (4, 99)] {
            got.push(post(p.addr("listen"), via, &chat(chars, max_tokens)).await);
        }
        assert_eq!(got, [200, 429, 200, 429, 200], "{via:?}: charged 600, 300 and 100\n{}", p.log());
        let text = metrics(&p);
        assert_eq!(bodies(&text, "read"), 5.0, "{text}");
    }
}

/// `{json.PATH}` charges the number there; a body that is not JSON, or
/// has no number above 0 there, or is over 1 MiB, charges `default_cost`,
/// and is forwarded as it came. A number above the burst counts as the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_at_a_json_path_and_its_fallbacks() {
    let dir = tempfile::tempdir().unwrap();
    let up = Echo::start().await;
    let entry = "{ resource: tokens, cost: \"{json.budget.0}\", default_cost: 100 }";
    let large = {
        let mut b = br#"{"budget":[1],"pad":""#.to_vec();
        b.resize(1024 * 1024 + 100, b'p');
        b.extend_from_slice(br#""}"#);
        b
    };
    for via in VIAS {
        let p = sidecar(dir.path(), &up, BUCKET, entry);
        let mut got = Vec::new();
        // 700, refused; then three fallbacks of 100 fill the 300 left and one more is refused.
        for body in [
            &br#"{"budget":[700]}"#[..],
            br#"{"budget":[700]}"#,
            b"not json",
            br#"{"budget":[0]}"#,
            &large,
            br#"{"budget":[1]}"#,
        ] {
            got.push(post(p.addr("listen"), via, body).await);
            if got.last() == Some(&200) {
                assert!(up.last().body == body, "{via:?}: forwarded as it came");
            }
        }
        assert_eq!(got, [200, 429, 200, 200, 200, 429], "{via:?}\n{}", p.log());
        let text = metrics(&p);
        assert_eq!((bodies(&text, "read"), bodies(&text, "not_json"), bodies(&text, "too_large")), (4.0, 1.0, 1.0));
    }
    let p = sidecar(dir.path(), &up, BUCKET, entry);
    let over = post(p.addr("listen"), Via::Length, br#"{"budget":[1e12]}"#).await;
    let after = post(p.addr("listen"), Via::Length, br#"{"budget":[1]}"#).await;
    assert_eq!((over, after), (200, 429), "a cost above the burst spends the burst");
}

/// A chunked body larger than what is read ahead reaches the upstream
/// whole and unchanged: its first 1 MiB read before admission, the rest
/// as it streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_streamed_body_is_forwarded_whole() {
    let dir = tempfile::tempdir().unwrap();
    let up = Echo::start().await;
    let p = sidecar(dir.path(), &up, ROOMY, ASKS_USAGE);
    let body: Vec<u8> = (0..3 * 1024 * 1024 / 2).map(|i| b"stream\"{}[],: "[i % 14]).collect();
    assert_eq!(post(p.addr("listen"), Via::Chunked, &body).await, 200, "{}", p.log());
    assert_eq!(up.count(), 1);
    let seen = up.last();
    assert_eq!(seen.body.len(), body.len());
    assert!(seen.body == body, "the upstream got the body as sent");
    assert_eq!(bodies(&metrics(&p), "too_large"), 1.0);
}

/// A body that stops coming before the sidecar has read it is answered
/// with 408 once the upstream's `timeout` (1 s) passes without a byte of it,
/// as any stalled upload is, and nothing reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_while_it_is_read_gets_408() {
    let dir = tempfile::tempdir().unwrap();
    let up = Echo::start().await;
    let p = sidecar(dir.path(), &up, ROOMY, ESTIMATE);
    let mut s = TcpStream::connect(p.addr("listen")).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: llm.local\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
          9\r\n{\"model\":\r\n",
    )
    .await
    .unwrap();
    let got = answer(&mut s).await;
    assert_eq!(status_of(&got), 408, "{got}\n{}", p.log());
    assert_eq!(up.count(), 0);
    let text = metrics(&p);
    let stalled = metric(&text, "usher_proxy_requests_total", &[("route", "chat"), ("outcome", "client_timeout")]);
    assert_eq!(stalled, Some(1.0), "{text}");
    assert_eq!(metric(&text, "usher_proxy_in_flight", &[("route", "chat")]), Some(0.0), "{text}");
}
