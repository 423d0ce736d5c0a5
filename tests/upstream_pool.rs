//! The connection pool of plain-HTTP/1.1 upstreams, through the real
//! `usher proxy`: connections are reused after every kind of body, a
//! connection the upstream closed while idle costs the app nothing (the
//! request goes out on a new one), an upgraded connection is never
//! handed to another request, and an upstream URL's base path prefixes the
//! origin-form target the pool sends.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{Method, Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::upstream::{Upstream, empty, get, h1, send1};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_upstream_connection_serves_sequential_requests_of_every_kind() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let u = Usher::proxy(&routes(dir.path(), up.addr));
    let mut c = h1(u.addr("listen")).await;
    for i in 0..30 {
        let req = match i % 3 {
            // Content-Length body.
            0 => get("app.test", "/ok"),
            // A streamed body of 200 kB (chunked).
            1 => get("app.test", "/stream?bytes=200000"),
            // No body at all.
            _ => Request::builder().method(Method::HEAD).uri("/ok").header("host", "app.test").body(empty()).unwrap(),
        };
        let r = tokio::time::timeout(Duration::from_secs(10), send1(&mut c, req)).await.expect("answered in time");
        assert_eq!(r.status, StatusCode::OK, "request {i}: {}", r.text());
        if i % 3 == 1 {
            assert_eq!(r.body.len(), 200_000, "request {i}");
        }
    }
    assert_eq!(up.stats.requests(), 30);
    assert_eq!(up.stats.connections.load(Ordering::SeqCst), 1, "every request reused the first connection");
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicU64::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
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
    let mut c = h1(u.addr("listen")).await;
    for i in 0..20 {
        let r = tokio::time::timeout(Duration::from_secs(10), send1(&mut c, get("app.test", "/x")))
            .await
            .expect("answered in time");
        assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "request {i}");
        // The connection went back to the pool and was closed while idle.
        // (A close that crosses a request already on the wire is HTTP/1.1's
        // keep-alive race, which no pool can hide without retrying.)
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(conns.load(Ordering::SeqCst), 20, "one connection per request, as the upstream wants");
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
