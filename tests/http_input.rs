//! Property test of the sidecar's HTTP request path, fed through in-memory
//! I/O: hostile HTTP/1.x requests (built from risky pieces, then mutated),
//! HTTP/2 prior-knowledge connections with random frames, and random bytes,
//! each written to one side of a `tokio::io::duplex` pair whose other side is
//! served by the real [`ConnServer`] and [`Proxy`], in front of a real
//! upstream. A failure is a panic, a connection that does not finish within
//! 10 s after the client's EOF (a hang), or an HTTP/1.x answer that is not an
//! HTTP/1.x response. The stable counterpart of `fuzz/fuzz_targets/http.rs`.
//!
//! The other direction too: hostile upstream answers (status lines, framing
//! and chunking that break parsers, then mutated, and random bytes) from a
//! real loopback upstream to a valid request; the app must get an HTTP/1.1
//! response (the upstream's, or a 502) and the connection must finish. The
//! stable counterpart of `fuzz/fuzz_targets/upstream.rs`.

use usher_test_support as support;
use usher_test_support::edits;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{ConnServer, Proxy};

use support::upstream::Upstream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn piece(options: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::sample::select(options).prop_map(str::to_string)
}

/// An HTTP/1.x request assembled from the pieces that break parsers.
fn h1_request() -> impl Strategy<Value = Vec<u8>> {
    let method = piece(&["GET", "POST", "PUT", "HEAD", "OPTIONS", "CONNECT", "DELETE", "PRI", "G\0T", ""]);
    let target = piece(&[
        "/x",
        "/",
        "*",
        "http://api.test/x",
        "http://evil.test/x",
        "api.test:443",
        "/x?a=b&c",
        "//x",
        "/%00",
        "/x#frag",
        "http://api.test:99999/",
        "",
    ]);
    let version = piece(&["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1 ", "http/1.1", "HTTP/9.9", ""]);
    let header = piece(&[
        "Host: api.test",
        "Host: evil.test",
        "Host: api.test:80",
        "Host:",
        "Content-Length: 5",
        "Content-Length: 0",
        "Content-Length: +5",
        "Content-Length: 5, 6",
        "Content-Length: 99999999999999999999",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: chunked, identity",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding:\tchunked",
        "Connection: close",
        "Connection: upgrade",
        "Connection: keep-alive, te",
        "Upgrade: websocket",
        "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAAQAAP__",
        "Expect: 100-continue",
        "TE: trailers",
        "Via: 1.1 usher",
        "Content-Type: application/grpc",
        "X-Tenant: a",
        " folded",
        "X-A: a\rb",
        "X-A: \u{80}\u{ff}",
        "Bad Name: v",
        ": empty name",
    ]);
    let eol = piece(&["\r\n", "\n", "\r"]);
    let body = prop::collection::vec(any::<u8>(), 0..64);
    (method, target, version, prop::collection::vec(header, 0..8), eol, body, 0u8..3).prop_map(
        |(m, t, v, headers, eol, body, chunked)| {
            let mut r = format!("{m} {t} {v}{eol}").into_bytes();
            for h in headers {
                r.extend_from_slice(h.as_bytes());
                r.extend_from_slice(eol.as_bytes());
            }
            r.extend_from_slice(eol.as_bytes());
            match chunked {
                0 => r.extend_from_slice(&body),
                1 => {
                    r.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
                    r.extend_from_slice(&body);
                    r.extend_from_slice(b"\r\n0\r\n\r\n");
                }
                _ => {
                    r.extend_from_slice(b"ffffffffffffffff1\r\n");
                    r.extend_from_slice(&body);
                }
            }
            r
        },
    )
}

/// A byte string with a few bytes replaced, inserted or removed, or a slice repeated.
fn mutate(base: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    use edits::{INSERT, REMOVE, REPEAT_TAIL, REPLACE};
    (base, edits::edits(&[REPLACE, INSERT, REMOVE, REPEAT_TAIL], 0..6)).prop_map(|(mut b, e)| {
        edits::apply(&mut b, &e);
        b
    })
}

/// An h2c connection: the preface, then random frames (any type, flags and
/// stream; small payloads).
fn h2_connection() -> impl Strategy<Value = Vec<u8>> {
    let frame = (0u8..11, any::<u8>(), 0u32..8, prop::collection::vec(any::<u8>(), 0..48), any::<bool>());
    prop::collection::vec(frame, 0..12).prop_map(|frames| {
        let mut b = PREFACE.to_vec();
        // SETTINGS first, as a client must.
        b.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        for (kind, flags, stream, payload, lie) in frames {
            // Sometimes the length field lies about the payload.
            let len = if lie { payload.len() as u32 + 7 } else { payload.len() as u32 };
            b.extend_from_slice(&len.to_be_bytes()[1..]);
            b.extend_from_slice(&[kind, flags]);
            b.extend_from_slice(&stream.to_be_bytes());
            b.extend_from_slice(&payload);
        }
        b
    })
}

fn input() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => mutate(h1_request()),
        2 => mutate(h2_connection()),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

/// Serves `bytes` as one connection through in-memory I/O, then closes the
/// client's side (an EOF cancels a request still in flight); returns what
/// the sidecar wrote back.
async fn serve_bytes(server: &ConnServer, proxy: &Arc<Proxy>, bytes: &[u8]) -> Result<Vec<u8>, String> {
    serve_connection(server, proxy, bytes, true).await
}

/// Serves `bytes` as one connection through in-memory I/O, closing the
/// client's side after them if `half_close`, and reads to the sidecar's
/// EOF. A failure: no EOF within 10 s, a connection task still running 10 s
/// later, or a panic.
async fn serve_connection(
    server: &ConnServer,
    proxy: &Arc<Proxy>,
    bytes: &[u8],
    half_close: bool,
) -> Result<Vec<u8>, String> {
    let (mut client, io) = tokio::io::duplex(64 * 1024);
    let conn = tokio::spawn({
        let (server, proxy) = (server.clone(), proxy.clone());
        async move { server.serve(proxy, io).await.map_err(|e| e.to_string()) }
    });
    let exchange = async {
        // The sidecar may stop reading early (it answered, or gave up).
        let _ = client.write_all(bytes).await;
        if half_close {
            let _ = client.shutdown().await;
        }
        let mut out = Vec::new();
        let _ = client.read_to_end(&mut out).await;
        out
    };
    let out = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("no EOF from the sidecar within 10 s for {:?}", String::from_utf8_lossy(bytes)))?;
    match tokio::time::timeout(Duration::from_secs(10), conn).await {
        Err(_) => {
            Err(format!("connection task still running 10 s after its EOF for {:?}", String::from_utf8_lossy(bytes)))
        }
        Ok(Err(e)) if e.is_panic() => Err(format!("panic serving {:?}: {e}", String::from_utf8_lossy(bytes))),
        Ok(_) => Ok(out),
    }
}

#[test]
fn the_http_request_path_never_panics_or_hangs() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (server, proxy, _up) = rt.block_on(async {
        let up = Upstream::start().await;
        let yaml = format!(
            "limits: {{ header_timeout: 2s, max_body_bytes: 1KiB }}\n\
             upstreams:\n  up: {{ url: \"http://{}\", timeout: 5s }}\n\
             resources:\n  api: {{ kind: rate, capacity: 1000/s, burst: 1000 }}\n  tenant: {{ kind: gauge, id: \"t/{{header.x-tenant}}\", capacity: 5 }}\n\
             routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up, resources: [api, tenant] }}\n",
            up.addr
        );
        let cfg = RoutesConfig::parse("http_input.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
        let limits = cfg.limits;
        let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
        let proxy = Proxy::new(cfg, "http_input.yaml".into(), clock, prometheus::Registry::new()).unwrap();
        (ConnServer::new(limits), proxy, up)
    });
    let mut runner = TestRunner::new(Config { cases: 1000, failure_persistence: None, ..Config::default() });
    let result = runner.run(&input(), |bytes| {
        let out = rt.block_on(serve_bytes(&server, &proxy, &bytes)).map_err(TestCaseError::fail)?;
        // An HTTP/1.x client only ever gets HTTP/1.x responses back.
        if !bytes.starts_with(b"PRI") && !out.is_empty() {
            prop_assert!(
                out.starts_with(b"HTTP/1.1 ") || out.starts_with(b"HTTP/1.0 "),
                "{:?} -> {:?}",
                String::from_utf8_lossy(&bytes),
                String::from_utf8_lossy(&out)
            );
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

// === hostile upstream answers ===

/// An upstream answer assembled from the pieces that break response parsers.
fn h1_response() -> impl Strategy<Value = Vec<u8>> {
    let status = piece(&[
        "HTTP/1.1 200 OK",
        "HTTP/1.1 200",
        "HTTP/1.0 200 OK",
        "HTTP/1.1 204 No Content",
        "HTTP/1.1 304 Not Modified",
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
        "HTTP/1.1 101 Switching Protocols",
        "HTTP/1.1 429 Too Many Requests",
        "HTTP/1.1 999 Odd",
        "HTTP/1.1 20 Short",
        "HTTP/2 200",
        "ICY 200 OK",
        "",
    ]);
    let header = piece(&[
        "Content-Length: 5",
        "Content-Length: 0",
        "Content-Length: 5, 5",
        "Content-Length: 5, 6",
        "Content-Length: -1",
        "Content-Length: 99999999999999999999",
        "Transfer-Encoding: chunked",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: chunked, gzip",
        "Connection: close",
        "Connection: keep-alive, date",
        "Keep-Alive: timeout=1",
        "Retry-After: 3",
        "Retry-After: -1",
        "Date: Sun, 22 Nov 2026 12:00:00 GMT",
        "Trailer: X-T",
        "Upgrade: h2c",
        " folded",
        "Bad Name: v",
        "X-A: \u{80}\u{ff}",
    ]);
    let chunks = piece(&[
        "5\r\nhello\r\n0\r\n\r\n",
        "5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
        "ffffffffffffffff1\r\nx\r\n",
        "5\nhello\r\n0\r\n\r\n",
        "3\r\nhello\r\n",
        "0\r\nno colon\r\n\r\n",
        "",
    ]);
    let eol = piece(&["\r\n", "\n"]);
    let body = prop::collection::vec(any::<u8>(), 0..64);
    (status, prop::collection::vec(header, 0..6), eol, chunks, body, any::<bool>()).prop_map(
        |(status, headers, eol, chunks, body, chunked)| {
            let mut r = format!("{status}{eol}").into_bytes();
            for h in headers {
                r.extend_from_slice(h.as_bytes());
                r.extend_from_slice(eol.as_bytes());
            }
            r.extend_from_slice(eol.as_bytes());
            r.extend_from_slice(if chunked { chunks.as_bytes() } else { &body });
            r
        },
    )
}

/// A loopback upstream that answers each connection's first request head
/// with the current `answer`, then closes.
async fn scripted_upstream(answer: Arc<std::sync::Mutex<Vec<u8>>>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { return };
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let bytes = answer.lock().unwrap().clone();
                let _ = s.write_all(&bytes).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

#[test]
fn hostile_upstream_answers_never_panic_or_hang() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let answer = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (server, proxy) = rt.block_on(async {
        let addr = scripted_upstream(answer.clone()).await;
        let yaml = format!(
            "upstreams:\n  up: {{ url: \"http://{addr}\", timeout: 5s }}\n\
             resources:\n  api: {{ kind: gauge, capacity: 100 }}\n\
             routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up, resources: [api] }}\n"
        );
        let cfg = RoutesConfig::parse("upstream_input.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
        let limits = cfg.limits;
        let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
        let proxy = Proxy::new(cfg, "upstream_input.yaml".into(), clock, prometheus::Registry::new()).unwrap();
        (ConnServer::new(limits), proxy)
    });
    let inputs = prop_oneof![4 => mutate(h1_response()), 1 => prop::collection::vec(any::<u8>(), 0..256)];
    let mut runner = TestRunner::new(Config { cases: 500, failure_persistence: None, ..Config::default() });
    let result = runner.run(&inputs, |bytes| {
        *answer.lock().unwrap() = bytes.clone();
        let request = b"GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n";
        let out = rt.block_on(serve_connection(&server, &proxy, request, false)).map_err(|e| {
            TestCaseError::fail(format!("{e}, the upstream answering {:?}", String::from_utf8_lossy(&bytes)))
        })?;
        prop_assert!(
            out.starts_with(b"HTTP/1.1 "),
            "{:?} -> {:?}",
            String::from_utf8_lossy(&bytes),
            String::from_utf8_lossy(&out)
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The harness notices what it must: a valid request gets its answer.
#[test]
fn a_valid_request_through_memory_is_answered() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let up = Upstream::start().await;
        let yaml = format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\nroutes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up }}\n",
            up.addr
        );
        let cfg = RoutesConfig::parse("t.yaml", &yaml).unwrap();
        let server = ConnServer::new(cfg.limits);
        let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
        let proxy = Proxy::new(cfg, "t.yaml".into(), clock, prometheus::Registry::new()).unwrap();
        let (mut client, io) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move { server.serve(proxy, io).await });
        client.write_all(b"GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut out)).await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 200 OK") && text.ends_with("ok"), "{text}");
        assert_eq!(up.stats.requests(), 1);
    });
}
