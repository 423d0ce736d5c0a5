//! The client's connection: keep-alive (50 requests, one upstream
//! connection), pipelining, and the header timeout closing idle and
//! half-sent connections.

use usher_test_support as support;

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use usher_proxy::Http1;

use support::upstream::Upstream;

use crate::client::Client;
use crate::scripted::{Scripted, echo};
use crate::{API, PATIENCE, handoffs, routes, sidecar};

// === keep-alive and pooling ===

/// 50 sequential requests (GETs and POSTs with bodies) on one client
/// connection are all answered, in order, and reach the upstream over one
/// connection; nothing is handed off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_requests_on_one_connection_share_one_upstream_connection() {
    let up = Upstream::start().await;
    let side = sidecar(&routes(up.addr, ""), Http1::Native).await;
    let mut c = Client::connect(side.addr).await;
    for i in 0..50 {
        if i % 5 == 4 {
            let body = "b".repeat(i * 10);
            c.send(format!(
                "POST /sink HTTP/1.1\r\nHost: {API}\r\nX-Seq: {i}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ))
            .await;
            let r = c.response(false).await;
            assert_eq!((r.status, r.text()), (200, (i * 10).to_string()), "request {i}");
        } else {
            c.send(format!("GET /x?i={i} HTTP/1.1\r\nHost: {API}\r\nX-Seq: {i}\r\n\r\n")).await;
            let r = c.response(false).await;
            assert_eq!((r.status, r.text().as_str()), (200, "ok"), "request {i}");
        }
    }
    assert_eq!(up.stats.requests(), 50);
    assert_eq!(up.stats.seq(), (0..50).map(|i| i.to_string()).collect::<Vec<_>>(), "in order");
    assert_eq!(up.stats.connections.load(std::sync::atomic::Ordering::SeqCst), 1, "one upstream connection");
    assert_eq!(handoffs(&side.proxy), BTreeMap::new());
}

// === pipelining ===

/// Three requests in one write are answered in order, the last (asking to
/// close) followed by the sidecar closing; they reach the upstream in order
/// over one connection. The same on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    for engine in [Http1::Native, Http1::Hyper] {
        let up = Scripted::start(echo).await;
        let side = sidecar(&routes(up.addr, ""), engine).await;
        let mut c = Client::connect(side.addr).await;
        c.send(format!(
            "GET /one?a=1 HTTP/1.1\r\nHost: {API}\r\n\r\n\
             POST /two HTTP/1.1\r\nHost: {API}\r\nContent-Length: 5\r\n\r\nhello\
             GET /three HTTP/1.1\r\nHost: {API}\r\nConnection: close\r\n\r\n"
        ))
        .await;
        let bodies = [c.response(false).await, c.response(false).await, c.response(false).await]
            .map(|r| (r.status, r.text(), r.header("connection").map(str::to_string)));
        assert_eq!(
            bodies,
            [
                (200, "GET /one?a=1 ".to_string(), None),
                (200, "POST /two hello".to_string(), None),
                (200, "GET /three ".to_string(), Some("close".to_string())),
            ],
            "{engine:?}"
        );
        let (_, after) = c.closed_within(PATIENCE).await;
        assert!(after.is_empty(), "{engine:?}: nothing after the last answer: {:?}", after.escape_ascii().to_string());
        let seen: Vec<_> = up.seen().iter().map(|s| (s.conn, s.request_line.clone())).collect();
        assert_eq!(
            seen,
            [(0, "GET /one?a=1 HTTP/1.1".into()), (0, "POST /two HTTP/1.1".into()), (0, "GET /three HTTP/1.1".into())],
            "{engine:?}"
        );
        assert_eq!(handoffs(&side.proxy), BTreeMap::new(), "{engine:?}");
    }
}

// === header timeout ===

/// With `header_timeout: 1s`: an idle keep-alive connection after one
/// answer, a new connection that sends half a head, a kept-alive one that
/// sends half a head, and one that drips a head a byte at a time are each
/// closed, without an answer, about a
/// second later. The same on both engines. On the native path a small body
/// it buffers counts against the same deadline (hyper gives a body none):
/// a request whose body stalls gets a 408 before the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_timeout_closes_idle_and_half_sent_connections() {
    let up = Upstream::start().await;
    let yaml = routes(up.addr, "limits: { header_timeout: 1s }\n");
    let (native, hyper) = (sidecar(&yaml, Http1::Native).await, sidecar(&yaml, Http1::Hyper).await);
    let get = format!("GET /x HTTP/1.1\r\nHost: {API}\r\n\r\n");
    let half = format!("GET /x HTTP/1.1\r\nHost: {API}\r\nX-Partial: ");

    let idle = |addr| {
        let get = get.clone();
        async move {
            let mut c = Client::connect(addr).await;
            c.send(&get).await;
            assert_eq!(c.response(false).await.status, 200);
            c.closed_within(Duration::from_secs(5)).await
        }
    };
    let half_first = |addr| {
        let half = half.clone();
        async move {
            let mut c = Client::connect(addr).await;
            c.send(&half).await;
            c.closed_within(Duration::from_secs(5)).await
        }
    };
    let half_later = |addr| {
        let (get, half) = (get.clone(), half.clone());
        async move {
            let mut c = Client::connect(addr).await;
            c.send(&get).await;
            assert_eq!(c.response(false).await.status, 200);
            c.send(&half).await;
            c.closed_within(Duration::from_secs(5)).await
        }
    };
    let half_body = |addr| async move {
        let mut c = Client::connect(addr).await;
        c.send(format!("POST /sink HTTP/1.1\r\nHost: {API}\r\nContent-Length: 10\r\n\r\nabc")).await;
        c.closed_within(Duration::from_secs(5)).await
    };
    // A head dripped a byte every 200 ms: the drip does not move the deadline.
    let dripping = |addr| {
        let half = half.clone();
        async move {
            let mut c = Client::connect(addr).await;
            let started = Instant::now();
            c.send(&half).await;
            let mut got = Vec::new();
            let mut chunk = [0u8; 1024];
            while started.elapsed() < Duration::from_secs(5) {
                tokio::select! {
                    r = c.stream.read(&mut chunk) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                    },
                    () = tokio::time::sleep(Duration::from_millis(200)) => {
                        if c.stream.write_all(b"a").await.is_err() {
                            break;
                        }
                    }
                }
            }
            (started.elapsed(), got)
        }
    };
    let got = tokio::join!(
        idle(native.addr),
        half_first(native.addr),
        half_later(native.addr),
        half_body(native.addr),
        dripping(native.addr),
        idle(hyper.addr),
        half_first(hyper.addr),
        half_later(hyper.addr),
        dripping(hyper.addr),
    );
    let got = [got.0, got.1, got.2, got.3, got.4, got.5, got.6, got.7, got.8];
    let names = [
        "native idle",
        "native half head",
        "native half head after a request",
        "native half body",
        "native dripped head",
        "hyper idle",
        "hyper half head",
        "hyper half head after a request",
        "hyper dripped head",
    ];
    for ((took, bytes), name) in got.iter().zip(names) {
        if name == "native half body" {
            // A request whose head came is answered: 408, then the connection closes.
            let text = String::from_utf8_lossy(bytes);
            assert!(text.starts_with("HTTP/1.1 408 Request Timeout\r\n"), "{name}: {text}");
            assert!(text.contains("\r\nconnection: close\r\n"), "{name}: {text}");
            assert!(
                text.contains("urn:usher:problem:client-timeout") && text.contains("header_timeout"),
                "{name}: {text}"
            );
        } else {
            assert!(bytes.is_empty(), "{name}: closed without an answer, got {:?}", bytes.escape_ascii().to_string());
        }
        assert!(
            (Duration::from_millis(700)..=Duration::from_secs(3)).contains(took),
            "{name}: closed after {took:?}, expected about 1 s"
        );
    }
    assert_eq!(up.stats.requests(), 4, "the half heads and the half body reached nothing");
    assert_eq!(handoffs(&native.proxy), BTreeMap::new());
}
