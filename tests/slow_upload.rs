//! A request body that streams longer than the upstream's `timeout`, and one
//! the client stops sending, through a real `usher proxy` process (its
//! general path: chunked bodies) to a real upstream on 127.0.0.1.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::time::{Duration, Instant};

use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::upstream::{Upstream, get, h1, send1};
use support::{Usher, http_get, metric, write_file};

/// A proxy to `up` (`timeout: 1s`, HTTP/1.1 or h2c) through a gauge of 1.
fn proxy(dir: &std::path::Path, up: &Upstream, h2c: bool) -> Usher {
    let text = format!(
        "upstreams:\n  up: {{ url: \"http://{}\", timeout: 1s, h2c: {h2c} }}\n\
         resources:\n  api: {{ kind: gauge, capacity: 1, max_wait: 100ms }}\n\
         routes:\n  - name: uploads\n    match: {{ path_prefix: / }}\n    upstream: up\n    resources: [api]\n",
        up.addr
    );
    Usher::proxy(&write_file(dir, "routes.yaml", &text))
}

/// Opens a chunked upload to `/sink`.
async fn upload(p: &Usher) -> TcpStream {
    let mut s = TcpStream::connect(p.addr("listen")).await.unwrap();
    s.write_all(b"POST /sink HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    s
}

/// The whole answer (the proxy closes the connection after it).
async fn answer(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await.expect("answered").unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// An upload that keeps sending for twice the upstream's `timeout` is
/// forwarded whole: the timeout for response headers starts once the body
/// has been sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_longer_than_the_upstream_timeout_is_forwarded_whole() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    for h2c in [false, true] {
        let p = proxy(dir.path(), &up, h2c);
        let mut s = upload(&p).await;
        for _ in 0..8 {
            s.write_all(b"5\r\nhello\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        s.write_all(b"0\r\n\r\n").await.unwrap();
        let got = answer(&mut s).await;
        assert!(got.starts_with("HTTP/1.1 200"), "h2c {h2c}: {got}\n{}", p.log());
        assert_eq!(got.split("\r\n\r\n").nth(1), Some("40"), "h2c {h2c}: all 40 bytes arrived: {got}");
    }
}

/// A client that stops sending its body mid-way gets 408 naming the route
/// once the upstream's `timeout` passes with nothing from it, not a 504
/// blaming the upstream, and its gauge permit is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_mid_body_gets_408_and_frees_its_permit() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    for h2c in [false, true] {
        let p = proxy(dir.path(), &up, h2c);
        let mut s = upload(&p).await;
        s.write_all(b"5\r\nhello\r\n").await.unwrap();
        let stalled = Instant::now();
        let got = answer(&mut s).await;
        let took = stalled.elapsed();
        assert!(got.starts_with("HTTP/1.1 408"), "h2c {h2c}: {got}\n{}", p.log());
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "h2c {h2c}: {took:?}");
        let body: serde_json::Value = serde_json::from_str(got.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["type"], "urn:usher:problem:client-timeout", "{body}");
        assert_eq!(body["status"], 408, "{body}");
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains("route `uploads`") && detail.contains("client stopped sending"), "{detail}");

        let mut c = h1(p.addr("listen")).await;
        let r = send1(&mut c, get("app", "/")).await;
        assert_eq!(r.status, StatusCode::OK, "h2c {h2c}: the stalled upload's permit is free: {}", r.text());

        // Counted as the client's doing, not the upstream's.
        let text = http_get(p.addr("admin"), "/metrics").1;
        let count =
            |outcome| metric(&text, "usher_proxy_requests_total", &[("route", "uploads"), ("outcome", outcome)]);
        assert_eq!(count("client_timeout"), Some(1.0), "h2c {h2c}: {text}");
        assert_eq!(count("upstream_error"), Some(0.0), "h2c {h2c}: {text}");
        assert_eq!(count("admitted"), Some(1.0), "h2c {h2c}: {text}");
    }
}
