//! Costs settled from the answer's JSON body, through `usher proxy`
//! (`settle: { response_json: usage.total_tokens }`): the number at the path
//! replaces what was charged at admission, the difference charged to the
//! key or given back, on both engines, whatever the body's framing. A body
//! that cannot be read (too large, not JSON, without the path, compressed,
//! cut short) passes to the app untouched and keeps its charge.
//!
//! The stand-in LLM answers `{"id":..,"usage":{"total_tokens":N}}` with N
//! from the request's `x-tokens`, in one piece with a `content-length`, or
//! in several chunks without one (`x-framing: chunked`), over HTTP/1.1 or
//! h2c; a few paths answer bodies that cannot be settled.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http::Request;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Response, StatusCode};
use support::upstream::{Client, TestBody, empty, read, serve_fn};
use support::{Usher, metric, write_file};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The bucket every resource starts with; each request is charged 100 at admission.
const BURST: u64 = 500;

/// Over the 256 KiB read for a settled cost.
const LARGE: usize = 300 * 1024;

/// The stand-in's answer to `req`.
fn answer(req: &Request<Incoming>) -> (Vec<(&'static str, &'static str)>, Vec<u8>) {
    let tokens: u64 = req.headers().get("x-tokens").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1);
    let usage = format!(
        r#"{{"id":"chatcmpl-{tokens}","object":"chat.completion","usage":{{"prompt_tokens":3,"total_tokens":{tokens}}}}}"#
    );
    let json = vec![("content-type", "application/json")];
    let last = req.uri().path().rsplit('/').next().unwrap_or("");
    match last {
        // Each would settle to 1 token if it were read.
        "large" => {
            let pad = "x".repeat(LARGE);
            (json, format!(r#"{{"usage":{{"total_tokens":1}},"pad":"{pad}"}}"#).into_bytes())
        }
        "not-json" => (json, br#"{"usage":{"total_tokens":1}} and then some"#.to_vec()),
        "missing" => (json, br#"{"usage":{"tokens":1}}"#.to_vec()),
        "gzip" => (
            vec![("content-type", "application/json"), ("content-encoding", "gzip")],
            br#"{"usage":{"total_tokens":1}}"#.to_vec(),
        ),
        "stream" => (vec![("content-type", "text/event-stream")], br#"{"usage":{"total_tokens":1}}"#.to_vec()),
        _ => (json, usage.into_bytes()),
    }
}

/// The stand-in LLM on 127.0.0.1:0, speaking HTTP/1.1 and h2c. A request
/// to `/stall` gets the start of a chunked body, and never its end.
async fn llm() -> SocketAddr {
    serve_fn(respond).await
}

fn respond(req: &Request<Incoming>) -> Response<TestBody> {
    if req.uri().path().ends_with("/stall") {
        let start = one_frame(Bytes::from_static(br#"{"usage":{"total_tokens":1},"#));
        let body = StreamBody::new(tokio_stream::StreamExt::chain(start, tokio_stream::pending()));
        return Response::builder().header("content-type", "application/json").body(body.boxed_unsync()).unwrap();
    }
    let (headers, body) = answer(req);
    let chunked = req.headers().get("x-framing").is_some_and(|v| v == "chunked");
    let mut resp = Response::builder();
    for (k, v) in headers {
        resp = resp.header(k, v);
    }
    let body = match chunked {
        // In pieces cut through keys and numbers: a body without a length, sent chunked.
        true => {
            let mut cuts = vec![0, 7, 19, body.len() / 2, body.len() - 3, body.len()];
            cuts.sort_unstable();
            cuts.dedup();
            let pieces: Vec<_> = cuts
                .windows(2)
                .map(|w| Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(&body[w[0]..w[1]]))))
                .collect();
            StreamBody::new(tokio_stream::iter(pieces)).boxed_unsync()
        }
        false => Full::new(Bytes::from(body)).boxed_unsync(),
    };
    resp.body(body).unwrap()
}

/// A stream of one data frame.
fn one_frame(b: Bytes) -> tokio_stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>> {
    tokio_stream::iter(vec![Ok(Frame::data(b))])
}

/// A routes file: each route `/NAME` (any path under it) charges 100 of its
/// own resource `NAME` (a bucket of [`BURST`]) and settles it from
/// `usage.total_tokens`; `h2c-` routes go to the upstream over h2c.
fn routes_file(up: SocketAddr, names: &[&str]) -> String {
    let mut f = format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\" }}\n  llm-h2c: {{ url: \"http://{up}\", h2c: true }}\nresources:\n"
    );
    for n in names {
        f += &format!("  {n}: {{ kind: rate, capacity: 1/s, burst: {BURST} }}\n");
    }
    f += "routes:\n";
    for n in names {
        let upstream = if n.starts_with("h2c-") { "llm-h2c" } else { "llm" };
        f += &format!(
            "  - name: {n}\n    upstream: {upstream}\n    match: {{ path_prefix: /{n} }}\n    resources:\n      \
             - {{ resource: {n}, cost: 100, settle: {{ response_json: usage.total_tokens }} }}\n"
        );
    }
    f
}

/// Sends a POST to `path` costing `tokens` and reads the answer whole.
async fn send(client: &mut Client, path: &str, tokens: u64, framing: &str) -> (StatusCode, Bytes) {
    let req = Request::post(path)
        .header("host", "llm.local")
        .header("x-tokens", tokens.to_string())
        .header("x-framing", framing)
        .body(empty())
        .unwrap();
    let got = read(client.send(req).await).await;
    (got.status, got.body)
}

fn settles(text: &str, route: &str, outcome: &str) -> f64 {
    metric(text, "usher_proxy_settles_total", &[("route", route), ("outcome", outcome)]).unwrap_or(0.0)
}

/// Each engine settles from a body with a length and from a chunked one,
/// from an HTTP/1.1 upstream and from an h2c one: answers of 300 and 450
/// tokens, charged 100 each, leave a debt on a bucket of 500, and the next
/// requests are refused (the charge alone would pass five); answers of 5
/// to 24 tokens give back the rest of each 100, so twenty pass.
async fn settles_on(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let up = llm().await;
    let names = ["debt", "refund", "h2c-debt", "h2c-refund"];
    for framing in ["length", "chunked"] {
        let file = write_file(dir.path(), &format!("{framing}.yaml"), &routes_file(up, &names));
        let sidecar = Usher::proxy(&file);
        let mut client = Client::new(engine, sidecar.addr("listen")).await;
        for prefix in ["", "h2c-"] {
            let what = format!("{engine} engine, {framing} body, {prefix}debt");
            let mut statuses = Vec::new();
            for tokens in [300, 450, 1, 1] {
                let (status, body) =
                    send(&mut client, &format!("/{prefix}debt/v1/chat/completions"), tokens, framing).await;
                if status == 200 {
                    assert!(body.ends_with(format!("\"total_tokens\":{tokens}}}}}").as_bytes()), "{what}: {body:?}");
                }
                statuses.push(status.as_u16());
            }
            assert_eq!(statuses, [200, 200, 429, 429], "{what}: 750 tokens spent of 500, a debt");

            let what = format!("{engine} engine, {framing} body, {prefix}refund");
            let mut statuses = Vec::new();
            for tokens in 5..25 {
                statuses.push(send(&mut client, &format!("/{prefix}refund/v1/chat"), tokens, framing).await.0.as_u16());
            }
            assert!(statuses.iter().all(|s| *s == 200), "{what}: 290 tokens spent of 500: {statuses:?}");
        }
        let text = sidecar.metrics();
        for n in names {
            let settled = if n.ends_with("debt") { 2.0 } else { 20.0 };
            assert_eq!(settles(&text, n, "settled"), settled, "{engine} engine, {framing} body, {n}:\n{text}");
        }
        let handoffs = metric(&text, "usher_proxy_http1_handoffs_total", &[]).unwrap_or(0.0);
        assert_eq!(handoffs, 0.0, "{engine} engine, {framing} body: no request left the engine it came to");
        assert!(!sidecar.log().contains("cost not settled"), "{}", sidecar.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_costs_settle_on_the_native_engine() {
    settles_on("native").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_costs_settle_on_the_hyper_engine() {
    settles_on("hyper").await;
}

/// A body that cannot be settled passes to the app byte for byte, and its
/// charge of 100 stands: five requests spend the bucket of 500 (each would
/// settle to 1 token if it were read), and each reason is counted and
/// warned about once.
async fn unreadable_on(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let up = llm().await;
    let cases = [
        ("large", "length", "too_large"),
        ("large", "chunked", "too_large"),
        ("not-json", "length", "not_json"),
        ("missing", "chunked", "missing"),
        ("gzip", "length", "encoded"),
        // A stream of events with no event at all (no `data:` line) has no cost in it.
        ("stream", "chunked", "missing"),
    ];
    let names: Vec<String> = cases.iter().map(|(p, f, _)| format!("{p}-{f}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes_file(up, &names)));
    let mut client = Client::new(engine, sidecar.addr("listen")).await;
    let direct = llm().await;
    let mut direct_client = Client::new("native", direct).await;
    for (path, framing, outcome) in cases {
        let what = format!("{engine} engine, {path}, {framing} body");
        let route = format!("{path}-{framing}");
        // What the upstream sends, asked of it directly.
        let (status, want) = send(&mut direct_client, &format!("/{route}/{path}"), 1, framing).await;
        assert_eq!(status, 200);
        let mut statuses = Vec::new();
        for _ in 0..6 {
            let (status, body) = send(&mut client, &format!("/{route}/{path}"), 1, framing).await;
            if status == 200 {
                assert!(body == want, "{what}: the body changed on its way ({} bytes, not {})", body.len(), want.len());
            }
            statuses.push(status.as_u16());
        }
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429], "{what}: each answer keeps its charge of 100");
        let text = sidecar.metrics();
        assert_eq!(settles(&text, &route, outcome), 5.0, "{what}:\n{text}");
        assert_eq!(settles(&text, &route, "settled"), 0.0, "{what}:\n{text}");
        let log = sidecar.log();
        let warned =
            log.lines().filter(|l| l.contains("WARN") && l.contains("cost not settled") && l.contains(&route)).count();
        assert_eq!(warned, 1, "{what}: warned once:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_bodies_pass_untouched_and_keep_their_charge_on_the_native_engine() {
    unreadable_on("native").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_bodies_pass_untouched_and_keep_their_charge_on_the_hyper_engine() {
    unreadable_on("hyper").await;
}

/// An app that leaves before the body ends leaves the charge as it is, and
/// it is counted as `incomplete`: the native engine notices the app's EOF
/// while the body is idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_leaves_mid_body_keeps_the_charge() {
    let dir = tempfile::tempdir().unwrap();
    let up = llm().await;
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes_file(up, &["chat"])));
    let addr = sidecar.addr("listen");
    for _ in 0..2 {
        let mut app = tokio::net::TcpStream::connect(addr).await.unwrap();
        app.write_all(b"POST /chat/stall HTTP/1.1\r\nhost: llm.local\r\ncontent-length: 0\r\n\r\n").await.unwrap();
        // The head and the body's first bytes, then the app goes.
        let mut got = Vec::new();
        while !got.windows(15).any(|w| w == b"total_tokens\":1") {
            let mut buf = [0u8; 1024];
            let n = tokio::time::timeout(Duration::from_secs(10), app.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "the sidecar closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
    }
    assert_eventually!(
        settles(&sidecar.metrics(), "chat", "incomplete") == 2.0,
        Duration::from_secs(10),
        "the two cut bodies are counted:\n{}",
        sidecar.metrics()
    );
    // 300 of 500 left: had the cut bodies settled to 1 token, four would pass.
    let mut client = Client::new("native", addr).await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(send(&mut client, "/chat/v1", 100, "length").await.0.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    let log = sidecar.log();
    assert!(log.contains("did not end"), "{log}");
}
