//! The routes file's `limits:` in force on a real listener (in process, on
//! 127.0.0.1:0, in front of a real counting upstream): the connection bound
//! (further connections wait in the backlog and are served once a slot
//! frees), header size and count limits (431, nothing forwarded) and the
//! request body limit (413 problem+json, by declared length or while
//! streaming).

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{Proxy, serve};

use support::upstream::{Upstream, get, h1, send1};

async fn start(up: SocketAddr, limits: &str) -> (SocketAddr, CancellationToken) {
    let yaml = format!(
        "limits: {limits}\n\
         upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
         routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up }}\n"
    );
    let cfg = RoutesConfig::parse("limits.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    let (clock, _handle) = Clock::manual(Time::from_secs(1_000_000));
    let proxy = Proxy::new(cfg, "limits.yaml".into(), clock, prometheus::Registry::new()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve(proxy, listener, stop.clone(), Duration::from_secs(1)));
    (addr, stop)
}

/// Sends `raw` and reads one response (the sidecar closes or the response
/// ends): (status, body).
async fn raw(addr: SocketAddr, raw: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    // The sidecar may answer (and close) before it has read everything.
    let _ = s.write_all(raw).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()));
            if len.and_then(|l| l.parse::<usize>().ok()).is_some_and(|l| body.len() >= l) {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

/// With `max_connections: 3`, a fourth connection is not served while three
/// are open, and is served as soon as one of them closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_bound_wait_for_a_free_slot() {
    let up = Upstream::start().await;
    let (addr, _stop) = start(up.addr, "{ max_connections: 3, header_timeout: 60s }").await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = h1(addr).await;
        assert_eq!(send1(&mut c, get("api.test", "/x")).await.status, 200);
        held.push(c);
    }
    let mut fourth = h1(addr).await;
    let waiting = tokio::spawn(async move { send1(&mut fourth, get("api.test", "/x")).await.status });
    // Negative check, bounded: not served within 1 s while the three are open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "a fourth connection was served while max_connections (3) were open");
    assert_eq!(up.stats.requests(), 3);
    drop(held.pop());
    let status = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting connection was served once a slot freed")
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(up.stats.requests(), 4);
}

/// A head over `max_header_bytes`, or with more than `max_headers` fields,
/// gets 431 and reaches nothing; one just under both limits passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_size_and_count_limits_answer_431() {
    let up = Upstream::start().await;
    let (addr, _stop) = start(up.addr, "{ max_header_bytes: 16KiB, max_headers: 20 }").await;
    let big = format!("GET /x HTTP/1.1\r\nHost: api.test\r\nX-Big: {}\r\n\r\n", "a".repeat(20_000));
    assert_eq!(raw(addr, big.as_bytes()).await.0, 431, "a 20 KB header under a 16 KiB limit");
    let many: String = (0..30).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many = format!("GET /x HTTP/1.1\r\nHost: api.test\r\n{many}\r\n");
    assert_eq!(raw(addr, many.as_bytes()).await.0, 431, "31 header fields under a limit of 20");
    assert_eq!(up.stats.requests(), 0, "nothing reached the upstream");
    let fine = format!("GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\nX-Ok: {}\r\n\r\n", "a".repeat(8_000));
    assert_eq!(raw(addr, fine.as_bytes()).await.0, 200);
    assert_eq!(up.stats.requests(), 1);
}

/// `max_body_bytes: 1KiB`: a declared 2,000-byte body gets 413 problem+json
/// and nothing is forwarded; a chunked body that passes 1 KiB while streaming
/// is cut off and gets 413; a 1,000-byte body passes whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_answer_413() {
    let up = Upstream::start().await;
    let (addr, _stop) = start(up.addr, "{ max_body_bytes: 1KiB }").await;
    let declared = format!("POST /sink HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2000\r\n\r\n{}", "a".repeat(2000));
    let (status, body) = raw(addr, declared.as_bytes()).await;
    assert_eq!(status, 413, "{body}");
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["type"], "urn:usher:problem:body-too-large");
    assert!(problem["detail"].as_str().unwrap().contains("1024 bytes"), "{problem}");
    assert_eq!(up.stats.requests(), 0, "a declared oversize body is refused before forwarding");

    let chunk = "b".repeat(600);
    let chunked = format!(
        "POST /sink HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    let (status, body) = raw(addr, chunked.as_bytes()).await;
    assert_eq!(status, 413, "{body}");
    assert!(up.stats.bytes_received.load(Ordering::SeqCst) <= 1024, "more than the limit was forwarded");

    // The upstream's sink answers with the bytes it read of this request's
    // body (its running count may still take in the cut-off body's first
    // chunk, which reached it before the 413).
    let fine = format!("POST /sink HTTP/1.1\r\nHost: api.test\r\nContent-Length: 1000\r\n\r\n{}", "c".repeat(1000));
    assert_eq!(raw(addr, fine.as_bytes()).await, (200, "1000".to_string()), "a body within the limit passes whole");
    // Whenever the cut-off body's part reached the upstream, it was no more than the limit.
    let total = up.stats.bytes_received.load(Ordering::SeqCst);
    assert!(total <= 1024 + 1000, "more than the limit of the cut-off body was forwarded: {total} in all");
}

/// `usher check` validates the section with file:line:column and prints the
/// limits in force.
#[test]
fn usher_check_shows_and_validates_limits() {
    let dir = tempfile::tempdir().unwrap();
    let good = support::write_file(
        dir.path(),
        "good.yaml",
        "limits: { max_connections: 10, max_body_bytes: 1MiB }\nroutes: []\n",
    );
    let (code, out, err) = support::run_usher(&["check", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("listener limits: max_connections 10, header_timeout 10s"), "{out}");
    assert!(out.contains("max_body_bytes 1048576"), "{out}");
    let bad = support::write_file(
        dir.path(),
        "bad.yaml",
        "limits:\n  max_header_bytes: 1KiB\n  header_timeout: soon\nroutes: []\n",
    );
    let (code, _, err) = support::run_usher(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("bad.yaml:2:21") && err.contains("limits.max_header_bytes"), "{err}");
    assert!(err.contains("bad.yaml:3:19") && err.contains("limits.header_timeout"), "{err}");
}
