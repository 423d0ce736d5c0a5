//! The upstream side: failures answered 502 and 504 naming the upstream,
//! TLS origination, HTTP/2 to `https://` upstreams (one multiplexed
//! connection unless `http2: false`) and to h2c ones, a 200 MB body
//! streamed both ways in bounded memory, and request heads too large to
//! forward.

use usher_test_support as support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Request, StatusCode};
use tokio::io::AsyncWriteExt;

use support::upstream::{self, Generated, TestPki, Upstream, get, h1, h2, send1, send2};
use support::write_file;

use crate::{read_head, start_proxy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_502_and_504_naming_the_upstream() {
    let slow = Upstream::gated().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // bound, then dropped
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  slow: {{ url: \"http://{}\", timeout: 300ms }}\n  gone: {{ url: \"http://{closed}\" }}\n\
             routes:\n  - {{ name: slow, match: {{ path_prefix: /slow }}, upstream: slow }}\n  \
             - {{ name: gone, match: {{ path_prefix: /gone }}, upstream: gone }}\n",
            slow.addr
        ),
    );
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    let r = send1(&mut c, get("x", "/slow")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.json()["upstream"], "slow");
    assert_eq!(r.json()["type"], "urn:usher:problem:upstream-timeout");
    let r = send1(&mut c, get("x", "/gone")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.json()["upstream"], "gone");
    assert_eq!(r.header("content-type"), "application/problem+json");
    slow.gate.add_permits(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_originated_with_system_roots_plus_the_ca_file() {
    let pki = TestPki::new();
    let up = Upstream::tls(&pki).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = write_file(dir.path(), "ca.pem", &pki.ca_pem);
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  \
               trusted: {{ url: \"https://localhost:{p}\", ca_file: \"{ca}\" }}\n  \
               untrusted: {{ url: \"https://localhost:{p}\" }}\n\
             routes:\n  - {{ name: trusted, match: {{ path_prefix: /t }}, upstream: trusted }}\n  \
               - {{ name: untrusted, match: {{ path_prefix: /u }}, upstream: untrusted }}\n",
            p = up.addr.port(),
            ca = ca.display()
        ),
    );
    let u = start_proxy(&routes);
    let mut c = h2(u.addr("listen")).await;
    let r = send2(&mut c, Request::get("http://app/t").body(upstream::empty()).unwrap()).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"));
    assert_eq!(up.stats.versions.lock().unwrap().as_slice(), [http::Version::HTTP_2], "h2 by ALPN");
    let r = send2(&mut c, Request::get("http://app/u").body(upstream::empty()).unwrap()).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert_eq!(r.json()["upstream"], "untrusted");
    assert!(r.json()["detail"].as_str().unwrap().contains("certificate"), "{}", r.text());
}

/// An `https://` upstream that offers h2 and http/1.1 gets HTTP/2 by default,
/// every request on one connection (concurrent ones multiplexed), and
/// HTTP/1.1 with `http2: false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstreams_share_one_h2_connection_unless_http2_is_off() {
    let pki = TestPki::new();
    let (h2_up, h1_up) = (Upstream::tls_gated(&pki).await, Upstream::tls_gated(&pki).await);
    let dir = tempfile::tempdir().unwrap();
    let ca = write_file(dir.path(), "ca.pem", &pki.ca_pem);
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  \
               multiplexed: {{ url: \"https://localhost:{}\", ca_file: \"{ca}\" }}\n  \
               pooled: {{ url: \"https://localhost:{}\", ca_file: \"{ca}\", http2: false }}\n\
             routes:\n  - {{ name: m, match: {{ path_prefix: /m }}, upstream: multiplexed }}\n  \
               - {{ name: p, match: {{ path_prefix: /p }}, upstream: pooled }}\n",
            h2_up.addr.port(),
            h1_up.addr.port(),
            ca = ca.display()
        ),
    );
    let u = start_proxy(&routes);
    let addr = u.addr("listen");
    for (prefix, up, version) in [("/m", &h2_up, http::Version::HTTP_2), ("/p", &h1_up, http::Version::HTTP_11)] {
        // One request first (the connection exists), then 16 held at the upstream at once,
        // from 16 app connections.
        up.gate.add_permits(1);
        let mut c = h1(addr).await;
        c.ready().await.unwrap();
        let r = c.send_request(get("app", &format!("{prefix}/first"))).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..16 {
            let path = format!("{prefix}/held?i={i}");
            tasks.spawn(async move {
                let mut c = h1(addr).await;
                c.ready().await.unwrap();
                c.send_request(get("app", &path)).await.unwrap().status()
            });
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while up.stats.in_flight.load(Ordering::SeqCst) < 16 {
            assert!(std::time::Instant::now() < deadline, "{prefix}: 16 requests never reached the upstream together");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        up.gate.add_permits(16);
        while let Some(status) = tasks.join_next().await {
            assert_eq!(status.unwrap(), StatusCode::OK);
        }
        let versions = up.stats.versions.lock().unwrap().clone();
        assert_eq!(versions.len(), 17);
        assert!(versions.iter().all(|v| *v == version), "{prefix}: {versions:?}");
        let conns = up.stats.connections.load(Ordering::SeqCst);
        assert_eq!(up.stats.max_in_flight.load(Ordering::SeqCst), 16, "{prefix}: all 16 in flight at once");
        if version == http::Version::HTTP_2 {
            assert_eq!(conns, 1, "h2: one connection carries every request");
        } else {
            assert!(conns >= 16, "HTTP/1.1: one connection per request in flight, {conns} made");
        }
    }
}

fn vm_hwm_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mb_body_streams_both_ways_in_bounded_memory() {
    const SIZE: u64 = 200 * 1024 * 1024;
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  inflight: {{ kind: gauge, capacity: 4 }}\n\
             routes:\n  - {{ name: bulk, upstream: up, resources: [inflight] }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;

    c.ready().await.unwrap();
    let mut resp = c.send_request(get("x", &format!("/stream?bytes={SIZE}"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let mut got = 0u64;
    while let Some(frame) = resp.body_mut().frame().await {
        if let Some(d) = frame.unwrap().data_ref() {
            got += d.len() as u64;
        }
    }
    assert_eq!(got, SIZE);

    let req = Request::post("/sink").header("host", "x").body(Generated::new(SIZE).boxed_unsync()).unwrap();
    let r = send1(&mut c, req).await;
    assert_eq!(r.text(), SIZE.to_string());

    let peak_mib = vm_hwm_kib(u.child.id()) / 1024;
    assert!(peak_mib < 100, "usher's peak RSS was {peak_mib} MiB while streaming 2 × 200 MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_upstreams_get_http2_and_oversized_heads_are_refused() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  grpc: {{ url: \"http://{}\", h2c: true }}\nroutes:\n  - {{ name: grpc, upstream: grpc }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    let req = Request::post("/pkg.Svc/Call")
        .header("host", "app")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(upstream::full(vec![0u8, 0, 0, 0, 0]))
        .unwrap();
    assert_eq!(send1(&mut c, req).await.status, StatusCode::OK);
    assert_eq!(up.stats.versions.lock().unwrap().as_slice(), [http::Version::HTTP_2]);

    // A request head beyond the 64 KiB limit is refused before it reaches routing.
    let mut s = tokio::net::TcpStream::connect(u.addr("listen")).await.unwrap();
    let big = "a".repeat(100 * 1024);
    s.write_all(format!("GET / HTTP/1.1\r\nHost: app\r\nX-Big: {big}\r\n\r\n").as_bytes()).await.unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
    assert_eq!(up.stats.requests(), 1);
}
