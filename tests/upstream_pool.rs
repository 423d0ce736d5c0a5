//! The connection pool of plain-HTTP/1.1 upstreams, through the real
//! `usher proxy`: connections are reused after every kind of body, a
//! connection the upstream closed while idle costs the app nothing (the
//! request goes out on a new one), an upgraded connection is never
//! handed to another request, and an upstream URL's base path prefixes the
//! origin-form target the pool sends. An `https://` upstream that speaks
//! HTTP/1.1 (`http2: false`, or learned from its ALPN answer) gets the same
//! pool of TLS connections.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{Method, Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::upstream::{Got, H1, H2, TestPki, Upstream, empty, full, get, get_abs, h1, h2, send1, send2};
use support::{Usher, write_file};

fn routes(dir: &std::path::Path, up: std::net::SocketAddr) -> std::path::PathBuf {
    write_file(
        dir,
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
             resources:\n  r: {{ kind: rate, capacity: 100000/s, burst: 1000 }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [r] }}\n"
        ),
    )
}

/// Request `i` of a sequence that goes through every kind of body: a
/// Content-Length answer, a streamed one of 200 kB (chunked), none at all
/// (HEAD), and a request body (POST). `h2`: for an HTTP/2 connection (absolute URI).
fn of_every_kind(i: usize, h2: bool) -> Request<support::upstream::TestBody> {
    let (method, path, body) = match i % 4 {
        0 => (Method::GET, "/ok", empty()),
        1 => (Method::GET, "/stream?bytes=200000", empty()),
        2 => (Method::HEAD, "/ok", empty()),
        _ => (Method::POST, "/sink", full(vec![b'x'; 70_000])),
    };
    let b = if h2 {
        Request::builder().uri(format!("http://app.test{path}"))
    } else {
        Request::builder().uri(path).header("host", "app.test")
    };
    b.method(method).body(body).unwrap()
}

fn check_kind(i: usize, r: &Got) {
    assert_eq!(r.status, StatusCode::OK, "request {i}: {}", r.text());
    match i % 4 {
        1 => assert_eq!(r.body.len(), 200_000, "request {i}"),
        3 => assert_eq!(r.text(), "70000", "request {i}"),
        _ => {}
    }
}

/// Sends on an HTTP/1.1 connection (the native engine), answered within 10 s.
async fn via1(c: &mut H1, req: Request<support::upstream::TestBody>) -> Got {
    tokio::time::timeout(Duration::from_secs(10), send1(c, req)).await.expect("answered in time")
}

/// Sends on an HTTP/2 connection (the general engine), answered within 10 s.
async fn via2(c: &mut H2, req: Request<support::upstream::TestBody>) -> Got {
    tokio::time::timeout(Duration::from_secs(10), send2(c, req)).await.expect("answered in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_upstream_connection_serves_sequential_requests_of_every_kind() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), up.addr));
    let mut c = h1(u.addr("listen")).await;
    for i in 0..32 {
        check_kind(i, &via1(&mut c, of_every_kind(i, false)).await);
    }
    assert_eq!(up.stats.requests(), 32);
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1, "every request reused the first connection");
}

/// The native engine (HTTP/1.1 apps) and the general one (HTTP/2 apps,
/// and HTTP/1.1 with `USHER_HTTP1=hyper`) draw on one pool per upstream:
/// requests alternating between them, and back-to-back requests on the
/// general engine, all go out on one upstream connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_engines_share_one_pool_per_upstream() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), up.addr));
    let mut general = both_engines(&u).await;
    for i in 0..16 {
        check_kind(i, &via2(&mut general, of_every_kind(i, true)).await);
    }
    assert_eq!(up.stats.requests(), 48);
    assert_eq!(
        up.stats.connections.load(Ordering::SeqCst),
        1,
        "every request, on either engine, reused the first connection"
    );

    // The general engine alone, as `USHER_HTTP1=hyper` runs HTTP/1.1 apps.
    let up = Upstream::start().await;
    let routes = routes(dir.path(), up.addr);
    let hyper_only = Usher::start(
        &["proxy", "--routes", routes.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[("USHER_HTTP1", "hyper")],
        "usher proxy listening",
    );
    let mut c = h1(hyper_only.addr("listen")).await;
    for i in 0..16 {
        check_kind(i, &via1(&mut c, of_every_kind(i, false)).await);
    }
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1, "the general engine reused its connection too");
}

/// Alternates the native and the general engine over 32 requests of every
/// kind (two on one, two on the other: every kind on both, and every
/// hand-over both ways); returns the general engine's connection.
async fn both_engines(u: &Usher) -> H2 {
    let mut native = h1(u.addr("listen")).await;
    let mut general = h2(u.addr("listen")).await;
    for i in 0..32 {
        let r = if (i / 2) % 2 == 0 {
            via1(&mut native, of_every_kind(i, false)).await
        } else {
            via2(&mut general, of_every_kind(i, true)).await
        };
        check_kind(i, &r);
    }
    general
}

/// An `https://` upstream with `http2: false` (though it offers h2): every
/// request, from either engine, goes in HTTP/1.1 on one TLS connection.
/// With the default (`http2` offered) to an upstream that answers ALPN
/// with http/1.1: the first request's connection learns it and goes to the
/// pool, which carries that request and every later one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_that_speaks_http1_gets_one_pool_of_tls_connections() {
    let pki = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = write_file(dir.path(), "ca.pem", &pki.ca_pem);
    let tls_routes = |up: &Upstream, http2: bool| {
        write_file(
            dir.path(),
            &format!("routes-{http2}.yaml"),
            &format!(
                "upstreams:\n  up: {{ url: \"https://localhost:{}\", ca_file: \"{}\", http2: {http2} }}\n\
                 routes:\n  - {{ name: all, upstream: up }}\n",
                up.addr.port(),
                ca.display()
            ),
        )
    };

    let up = Upstream::tls(&pki).await;
    let u = Usher::proxy(&tls_routes(&up, false));
    both_engines(&u).await;
    assert_eq!(up.stats.requests(), 32);
    let versions = up.stats.versions.lock().unwrap().clone();
    assert!(versions.iter().all(|v| *v == http::Version::HTTP_11), "{versions:?}");
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1, "one TLS connection for every request");
    let host = format!("localhost:{}", up.addr.port());
    assert!(up.stats.hosts.lock().unwrap().iter().all(|h| *h == host), "{:?}", up.stats.hosts.lock().unwrap());

    let up = Upstream::tls_http1(&pki).await;
    let u = Usher::proxy(&tls_routes(&up, true));
    both_engines(&u).await;
    assert_eq!(up.stats.requests(), 32);
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1, "the first request's connection, pooled, for all");
    u.wait_for_log("speaks HTTP/1.1 over TLS", Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_url_with_a_base_path_prefixes_every_request() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{}/v2/\" }}\nroutes:\n  - {{ name: all, upstream: up }}\n",
            up.addr
        ),
    );
    let u = Usher::proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    for path in ["/repos/x?page=2", "/"] {
        let r = send1(&mut c, get("app.test", path)).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text());
    }
    assert_eq!(up.stats.targets.lock().unwrap().as_slice(), ["/v2/repos/x?page=2", "/v2/"]);
    assert_eq!(up.stats.hosts.lock().unwrap().as_slice(), [up.addr.to_string(), up.addr.to_string()]);
}

/// An upstream that answers one request per connection and then closes it
/// without saying so (no `connection: close`), as a server whose keep-alive
/// timeout just passed does.
async fn closing_upstream() -> (std::net::SocketAddr, Arc<AtomicU64>) {
    one_answer_upstream(|_| (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", true)).await
}

/// An upstream that reads one request head per connection and writes
/// `answer(n)`'s bytes on its `n`th connection (counted from 0), then
/// closes it at once if `answer` says so, or five seconds later.
async fn one_answer_upstream(answer: fn(u64) -> (&'static [u8], bool)) -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicU64::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let (bytes, close) = answer(n);
                let _ = s.write_all(bytes).await;
                if !close {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            });
        }
    });
    (addr, conns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_upstream_closed_is_replaced_without_an_error() {
    let (addr, conns) = closing_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), addr));
    let mut native = h1(u.addr("listen")).await;
    let mut general = h2(u.addr("listen")).await;
    for i in 0..20 {
        // Both engines, on the upstream's one pool.
        let r = if i % 2 == 0 {
            via1(&mut native, get("app.test", "/x")).await
        } else {
            via2(&mut general, get_abs("app.test", "/x")).await
        };
        assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "request {i}");
        // The connection went back to the pool and was closed while idle.
        // (A close that crosses a request already on the wire is HTTP/1.1's
        // keep-alive race, which no pool can hide without retrying.)
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(conns.load(Ordering::SeqCst), 20, "one connection per request, as the upstream wants");
}

/// An upstream that says `connection: close`, or answers in HTTP/1.0, or
/// sends a body that ends with the connection, gets a new connection for
/// the next request on either engine (its old one is never reused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_answer_ends_is_not_reused_by_either_engine() {
    // Each answer ends its connection a different way; only the close-delimited body closes it at once.
    let (addr, conns) = one_answer_upstream(|n| match n % 3 {
        0 => (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok", false),
        1 => (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
        _ => (b"HTTP/1.1 200 OK\r\n\r\nok", true),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), addr));
    let mut native = h1(u.addr("listen")).await;
    let mut general = h2(u.addr("listen")).await;
    for i in 0..12 {
        let r = if (i / 3) % 2 == 0 {
            via1(&mut native, get("app.test", "/x")).await
        } else {
            via2(&mut general, get_abs("app.test", "/x")).await
        };
        assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "request {i}");
    }
    assert_eq!(conns.load(Ordering::SeqCst), 12, "a new connection for every request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_connection_is_not_reused() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), up.addr));
    let proxy = u.addr("listen");
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(b"GET /upgrade HTTP/1.1\r\nhost: app.test\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "closed before the 101");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&got));
    // While the tunnel is open, other requests go out on other connections.
    let mut c = h1(proxy).await;
    for _ in 0..3 {
        let r = send1(&mut c, get("app.test", "/ok")).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    s.write_all(b"ping\n").await.unwrap();
    let mut echo = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut echo)).await.unwrap().unwrap();
    assert_eq!(&echo, b"ping\n", "the tunnel still echoes");
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 2, "the tunnel's connection and one pooled one");
}

/// An upstream that answers every request at once, before reading its
/// chunked body, then reads the body to its end; it records the bodies.
async fn early_answering_upstream() -> (std::net::SocketAddr, Arc<AtomicU64>, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicU64::new(0));
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (counted, seen) = (conns.clone(), bodies.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                loop {
                    // One request head, answered at once.
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    buf.drain(..end);
                    if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.is_err() {
                        return;
                    }
                    if !head.contains("transfer-encoding: chunked") {
                        continue;
                    }
                    // Then its chunked body, to the last chunk.
                    let end = loop {
                        if let Some(i) = buf.windows(5).position(|w| w == b"0\r\n\r\n") {
                            break i + 5;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    seen.lock().unwrap().push(String::from_utf8_lossy(&buf[..end]).into_owned());
                    buf.drain(..end);
                }
            });
        }
    });
    (addr, conns, bodies)
}

/// Reads from `c` until an answer whose body is `ok` has come.
async fn read_answer(c: &mut tokio::net::TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\nok") {
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "closed before the answer: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// An upstream that answers before the request's body has all come (the
/// general engine forwards chunked bodies): the rest of the body still
/// reaches it, and its connection then serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_answered_before_its_request_body_ended_finishes_the_body_and_is_reused() {
    let (addr, conns, bodies) = early_answering_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), addr));
    let mut c = tokio::net::TcpStream::connect(u.addr("listen")).await.unwrap();
    c.write_all(b"POST /up HTTP/1.1\r\nhost: app.test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        .await
        .unwrap();
    let first = read_answer(&mut c).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // The rest of the body, after the answer.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.write_all(b"6\r\n world\r\n0\r\n\r\n").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while bodies.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the rest of the body never reached the upstream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(bodies.lock().unwrap()[0], "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
    c.write_all(b"GET /next HTTP/1.1\r\nhost: app.test\r\n\r\n").await.unwrap();
    let second = read_answer(&mut c).await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    assert_eq!(conns.load(Ordering::SeqCst), 1, "the connection went back to the pool once the body was sent");
}
