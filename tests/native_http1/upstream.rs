//! The upstream side of the native path: h2 upstreams (h2c, or `https://`
//! with ALPN) kept on the native path over one multiplexed connection, a
//! closed h2 connection replaced, an upstream that drops h2 for HTTP/1.1
//! followed to the pool; and a stale pooled HTTP/1.1 connection (an
//! idempotent request retried on a new one, a POST whose bytes the upstream
//! took not retried; hyper's pool, pinned).

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use usher_proxy::Http1;

use support::upstream::Upstream;

use crate::client::Client;
use crate::scripted::{Reply, Scripted, answer};
use crate::wire::{Seen, multiset};
use crate::{API, PATIENCE, handoffs, routes, sidecar};

// === HTTP/2 upstreams ===

/// Requests for an HTTP/2 upstream (h2c, or an `https://` one whose ALPN
/// picks h2: its first request's connection tells) stay on the native path,
/// all on the upstream's one multiplexed connection, and come back as
/// hyper's would: the same status, fields and body for a body of known
/// length, a streamed one (chunked), an answer to HEAD, and a small POST body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_an_h2_upstream_stay_on_the_native_path() {
    let pki = support::upstream::TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let exchanges = [
        ("GET", "/x", ""),
        ("GET", "/stream?bytes=70000", ""),
        ("GET", "/hold-body", ""),
        ("HEAD", "/x", ""),
        ("POST", "/sink", "hello"),
    ];
    let mut by_engine = Vec::new();
    for engine in [Http1::Native, Http1::Hyper] {
        let (h2c, tls) = (Upstream::start().await, Upstream::tls(&pki).await);
        let yaml = format!(
            "upstreams:\n  c: {{ url: \"http://{}\", h2c: true }}\n  \
               t: {{ url: \"https://localhost:{}\", ca_file: \"{}\" }}\n\
             routes:\n  - {{ name: c, match: {{ host: c.test }}, upstream: c }}\n  \
               - {{ name: t, match: {{ host: t.test }}, upstream: t }}\n",
            h2c.addr,
            tls.addr.port(),
            ca.display()
        );
        // `/hold-body` sends its second part once it has a permit: at once.
        h2c.gate.add_permits(1);
        tls.gate.add_permits(1);
        let side = sidecar(&yaml, engine).await;
        // The TLS upstream's first answer, on a connection of its own, tells what it speaks.
        let mut first = Client::connect(side.addr).await;
        first.send("GET /first HTTP/1.1\r\nHost: t.test\r\n\r\n").await;
        assert_eq!(first.response(false).await.status, 200);

        let mut c = Client::connect(side.addr).await;
        let mut got = Vec::new();
        for host in ["c.test", "t.test"] {
            for (method, path, body) in exchanges {
                let length =
                    if body.is_empty() { String::new() } else { format!("Content-Length: {}\r\n", body.len()) };
                // Fields around Host (which the upstream's authority replaces) arrive as sent.
                c.send(format!(
                    "{method} {path} HTTP/1.1\r\nAccept: text/plain; q=0.9\r\nHost: {host}\r\n\
                     X-Seq: {method} {path}\r\n{length}\r\n{body}"
                ))
                .await;
                let r = c.response(method == "HEAD").await;
                got.push((host, method, path, r.status, multiset(&r.headers), r.text()));
            }
        }
        // One connection each, which the TLS upstream's first request opened and learned h2 on;
        // every target and field value as the client sent it.
        let sent: Vec<String> = exchanges.iter().map(|(m, p, _)| format!("{m} {p}")).collect();
        for (up, requests) in [(&h2c, 5), (&tls, 6)] {
            let targets = up.stats.targets.lock().unwrap().clone();
            let paths: Vec<String> = exchanges.iter().map(|(_, p, _)| p.to_string()).collect();
            assert_eq!(targets[requests - 5..], paths[..], "{engine:?}");
            assert_eq!(*up.stats.seq.lock().unwrap(), sent, "{engine:?}");
            let versions = up.stats.versions.lock().unwrap().clone();
            assert_eq!(versions, vec![http::Version::HTTP_2; requests], "{engine:?}");
            assert_eq!(up.stats.connections.load(std::sync::atomic::Ordering::SeqCst), 1, "{engine:?}");
        }
        assert_eq!(handoffs(&side.proxy), BTreeMap::new(), "{engine:?}: nothing went to hyper");
        by_engine.push(got);
    }
    let native = &by_engine[0];
    for (host, method, path, status, headers, text) in native {
        let framing = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(*status, 200, "{method} {host}{path}");
        match (*method, *path) {
            ("GET", "/x") => assert_eq!((text.as_str(), framing("content-length")), ("ok", Some("2"))),
            ("GET", "/stream?bytes=70000") => {
                assert_eq!((text.len(), framing("content-length")), (70000, Some("70000")));
            }
            // No length known: chunked.
            ("GET", _) => assert_eq!((text.as_str(), framing("transfer-encoding")), ("first last", Some("chunked"))),
            ("HEAD", _) => assert_eq!(text, ""),
            _ => assert_eq!(text, "5", "the upstream got the 5-byte body"),
        }
    }
    assert_eq!(by_engine[0], by_engine[1], "the native path answers as hyper does");
}

/// An h2c upstream that answers one request per connection, then closes it
/// gracefully (GOAWAY): `conns` counts its connections.
async fn one_request_per_h2_connection() -> (SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::Ordering::SeqCst;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let n = counted.fetch_add(1, SeqCst) + 1;
            tokio::spawn(async move {
                let served = Arc::new(tokio::sync::Notify::new());
                let notify = served.clone();
                let svc = hyper::service::service_fn(move |_req| {
                    notify.notify_one();
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(support::upstream::full(format!(
                            "conn {n}"
                        ))))
                    }
                });
                let builder = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    () = served.notified() => conn.as_mut().graceful_shutdown(),
                }
                let _ = conn.await;
            });
        }
    });
    (addr, conns)
}

/// The native path's h2 connection, closed by the upstream (GOAWAY after
/// each answer), is replaced by the next request's, whatever the timing;
/// an h2c upstream nobody listens on is a 502 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_h2_upstream_connection_is_replaced_and_a_dead_one_is_a_502() {
    let (addr, conns) = one_request_per_h2_connection().await;
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let yaml = format!(
        "upstreams:\n  c: {{ url: \"http://{addr}\", h2c: true }}\n  gone: {{ url: \"http://{dead_addr}\", h2c: true }}\n\
         routes:\n  - {{ name: c, match: {{ host: c.test }}, upstream: c }}\n  \
           - {{ name: gone, match: {{ host: gone.test }}, upstream: gone }}\n"
    );
    let side = sidecar(&yaml, Http1::Native).await;
    let mut c = Client::connect(side.addr).await;
    let mut bodies = Vec::new();
    for _ in 0..5 {
        c.send("GET /x HTTP/1.1\r\nHost: c.test\r\n\r\n").await;
        let r = c.response(false).await;
        assert_eq!(r.status, 200, "{}", r.text());
        bodies.push(r.text());
    }
    // The upstream closed each connection after its first request, so the
    // answers came on several connections, in order: a connection once
    // replaced is never used again. (A graceful h2 close still takes streams
    // opened before the upstream's final GOAWAY, so two answers can share a
    // connection: the count of connections is not fixed.)
    let numbers: Vec<u64> =
        bodies.iter().map(|b| b.strip_prefix("conn ").and_then(|n| n.parse().ok()).expect("conn N")).collect();
    assert!(numbers.windows(2).all(|w| w[0] <= w[1]), "{bodies:?}");
    assert!(numbers[4] > numbers[0], "the closed connection was replaced: {bodies:?}");
    assert!(conns.load(std::sync::atomic::Ordering::SeqCst) >= numbers[4]);

    c.send("GET /x HTTP/1.1\r\nHost: gone.test\r\n\r\n").await;
    let r = c.response(false).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["upstream"], "gone", "{}", r.text());
    assert_eq!(handoffs(&side.proxy), BTreeMap::new());
}

/// A TLS upstream on 127.0.0.1:0 whose ALPN answer can change: `h2` (and
/// `http/1.1`) while `h2` is true, only `http/1.1` after. Each answer's body
/// is the version and method and target it came with ("HTTP/2.0 GET /x");
/// `closing` sends every open connection a graceful close (GOAWAY, or
/// `Connection: close`); `open` counts the connections still open.
struct SwitchingAlpn {
    addr: SocketAddr,
    h2: Arc<std::sync::atomic::AtomicBool>,
    closing: Arc<tokio::sync::Notify>,
    open: Arc<std::sync::atomic::AtomicI64>,
    accepted: Arc<std::sync::atomic::AtomicU64>,
}

impl SwitchingAlpn {
    async fn start(pki: &support::upstream::TestPki) -> SwitchingAlpn {
        use std::sync::atomic::Ordering::SeqCst;
        let (with_h2, http1_only) = (pki.acceptor(&[b"h2", b"http/1.1"]), pki.acceptor(&[b"http/1.1"]));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = SwitchingAlpn {
            addr: listener.local_addr().unwrap(),
            h2: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            closing: Arc::new(tokio::sync::Notify::new()),
            open: Arc::new(std::sync::atomic::AtomicI64::new(0)),
            accepted: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        let (h2, closing, open, accepted) = (up.h2.clone(), up.closing.clone(), up.open.clone(), up.accepted.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                accepted.fetch_add(1, SeqCst);
                let acceptor = if h2.load(SeqCst) { with_h2.clone() } else { http1_only.clone() };
                let (closing, open) = (closing.clone(), open.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    open.fetch_add(1, SeqCst);
                    let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                        let text = format!("{:?} {} {}", req.version(), req.method(), req.uri().path());
                        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(text),
                        )))
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
                    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
                    let mut conn = std::pin::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => {}
                        () = closing.notified() => {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.await;
                        }
                    }
                    open.fetch_sub(1, SeqCst);
                });
            }
        });
        up
    }
}

/// An `https://` upstream that picked h2 and, behind the same address, now
/// picks `http/1.1` (a new server, a load balancer reconfigured) is followed
/// to the HTTP/1.1 pool: the request that finds out goes there on the new
/// connection, and every later one too; no 502, nothing handed off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_drops_h2_for_http1_is_followed_to_the_pool() {
    use std::sync::atomic::Ordering::SeqCst;
    let pki = support::upstream::TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    for engine in [Http1::Native, Http1::Hyper] {
        let up = SwitchingAlpn::start(&pki).await;
        let yaml = format!(
            "upstreams:\n  t: {{ url: \"https://localhost:{}\", ca_file: \"{}\" }}\n\
             routes:\n  - {{ name: t, match: {{ host: t.test }}, upstream: t }}\n",
            up.addr.port(),
            ca.display()
        );
        let side = sidecar(&yaml, engine).await;
        let mut c = Client::connect(side.addr).await;
        let mut ask = async |path: &str| {
            c.send(format!("GET {path} HTTP/1.1\r\nHost: t.test\r\n\r\n")).await;
            let r = c.response(false).await;
            (r.status, r.text())
        };
        for path in ["/a", "/b"] {
            assert_eq!(ask(path).await, (200, format!("HTTP/2.0 GET {path}")), "{engine:?}");
        }
        // The upstream turns to HTTP/1.1 only and closes the h2 connection.
        up.h2.store(false, SeqCst);
        up.closing.notify_waiters();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while up.open.load(SeqCst) > 0 {
            assert!(std::time::Instant::now() < deadline, "{engine:?}: the h2 connection did not close");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for path in ["/c", "/d", "/e"] {
            assert_eq!(ask(path).await, (200, format!("HTTP/1.1 GET {path}")), "{engine:?}");
        }
        // One h2 connection, then one HTTP/1.1 connection that carried every
        // later request (hyper's engine: hyper-util's client finds out on a
        // connection of its own, and the pool then dials one).
        let connections = if engine == Http1::Native { 2 } else { 3 };
        assert_eq!(up.accepted.load(SeqCst), connections, "{engine:?}");
        assert_eq!(handoffs(&side.proxy), BTreeMap::new(), "{engine:?}: nothing went to hyper");
    }
}

// === a stale pooled upstream connection ===

/// `/once` is answered (with keep-alive fields) only as the first request
/// on an upstream connection; as a later one the upstream reads it whole and
/// closes without answering. `/bye` is answered, then the connection closed.
fn stale_script(seen: &Seen) -> Reply {
    let ok = |close| {
        answer(
            &b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=60\r\nContent-Length: 2\r\n\r\nok"[..],
            close,
        )
    };
    match (seen.path(), seen.nth) {
        ("/once", 0) => ok(false),
        ("/once", _) => Reply::Hangup,
        ("/bye", _) => ok(true),
        _ => answer(&b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"[..], false),
    }
}

/// A pooled upstream connection that closes as it is reused: a GET is
/// retried on a new connection and answered; a POST whose bytes the
/// upstream took before closing is not sent again and gets a 502 that says
/// the connection closed; a POST on a connection the upstream had closed
/// before it goes out on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_pooled_connection_retries_only_what_is_safe_to_send_twice() {
    let up = Scripted::start(stale_script).await;
    let side = sidecar(&routes(up.addr, ""), Http1::Native).await;
    let mut c = Client::connect(side.addr).await;
    let seen = || up.seen().iter().map(|s| (s.conn, s.nth, s.request_line.clone())).collect::<Vec<_>>();

    // A GET on the reused connection: taken, unanswered, retried on a new one.
    for _ in 0..2 {
        c.send(format!("GET /once HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        let r = c.response(false).await;
        assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    }
    assert_eq!(
        seen(),
        [(0, 0, "GET /once HTTP/1.1".into()), (0, 1, "GET /once HTTP/1.1".into()), (1, 0, "GET /once HTTP/1.1".into())]
    );
    assert_eq!(up.connections(), 2);

    // A POST on the reused connection: taken, unanswered, not sent again.
    c.send(format!("POST /once HTTP/1.1\r\nHost: {API}\r\nContent-Length: 4\r\n\r\ndata")).await;
    let r = c.response(false).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let problem = r.json();
    assert_eq!(problem["type"], "urn:usher:problem:upstream-error", "{problem}");
    assert_eq!(
        problem["detail"],
        "upstream `up` failed before sending response headers: connection closed before message completed",
        "{problem}"
    );
    assert_eq!(seen().len(), 4);
    assert_eq!(seen()[3], (1, 1, "POST /once HTTP/1.1".into()), "the POST reached the upstream once");
    assert_eq!(up.connections(), 2, "and was not sent again");

    // The upstream answers on a new connection and closes it right after...
    c.send(format!("GET /bye HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
    assert_eq!(c.response(false).await.status, 200);
    assert_eq!(seen()[4], (2, 0, "GET /bye HTTP/1.1".into()));
    assert_eventually!(up.closed().contains(&2), PATIENCE, "the upstream closed connection 2: {:?}", up.closed());
    // ... so a POST after that goes out on a new connection, once.
    c.send(format!("POST /once HTTP/1.1\r\nHost: {API}\r\nContent-Length: 4\r\n\r\ndata")).await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    assert_eq!(seen().len(), 6);
    assert_eq!(seen()[5], (3, 0, "POST /once HTTP/1.1".into()));
    assert_eq!(up.connections(), 4);
    assert_eq!(handoffs(&side.proxy), BTreeMap::new());
}

/// The same stale connection under `Http1::Hyper`: hyper's pool resends
/// only a request it could not write, so the GET the upstream took and
/// dropped gets a 502 where the native path retries it. A difference, pinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_general_path_does_not_resend_a_get_the_upstream_took_and_dropped() {
    let up = Scripted::start(stale_script).await;
    let side = sidecar(&routes(up.addr, ""), Http1::Hyper).await;
    let mut c = Client::connect(side.addr).await;
    c.send(format!("GET /once HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
    assert_eq!(c.response(false).await.status, 200);
    c.send(format!("GET /once HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
    let r = c.response(false).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["type"], "urn:usher:problem:upstream-error");
    let seen: Vec<_> = up.seen().iter().map(|s| (s.conn, s.nth)).collect();
    assert_eq!(seen, [(0, 0), (0, 1)], "taken once, not resent");
}
