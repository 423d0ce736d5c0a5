//! The real `usher proxy` binary against real upstreams on 127.0.0.1:0:
//! configuration errors, refusals of unrouted requests, upstream failures,
//! forward-proxy style and CONNECT, TLS origination, streaming with bounded
//! memory, and reloads.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::upstream::{self, Generated, TestPki, Upstream, get, h1, h2, send1, send2};
use support::{Usher, http_get, metric, run_usher, run_usher_for, write_file};

/// Awaits a spawned task for at most 20 s of wall time.
async fn within<T>(task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), task).await.expect("task finished in time").unwrap()
}

fn start_proxy(routes: &Path) -> Usher {
    Usher::proxy(routes)
}

#[test]
fn a_bad_routes_file_reports_every_error_with_its_position_and_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_file(
        dir.path(),
        "routes.yaml",
        "\
upstreams:
  api: { url: \"ftp://nowhere\" }
resources:
  core:
    kind: rate
    capacity: 50/fortnight
    max_wiat: 1s
routes:
  - name: a
    upstream: apj
    resources: [core, missing]
",
    );
    let (code, _out, err) = run_usher(&["proxy", "--routes", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "stderr:\n{err}");
    let f = bad.display().to_string();
    for want in [
        format!("{f}:2:15: upstreams.api.url:"),
        format!("{f}:6:15: resources.core.capacity: unknown unit `/fortnight`"),
        format!("{f}:7:5: resources.core.max_wiat: unknown field (hint: did you mean `max_wait`?)"),
        format!("{f}:10:15: routes[0].upstream: unknown upstream `apj` (hint: did you mean `api`?)"),
        format!("{f}:11:23: routes[0].resources[1]: unknown resource `missing`"),
    ] {
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }

    let (code, _out, err) = run_usher(&["proxy", "--routes", dir.path().join("absent.yaml").to_str().unwrap()]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("absent.yaml:1:1: cannot read routes file"), "{err}");
}

/// Two resources on one lease id would each enforce the whole lease: a
/// routes file with a fixed id twice, or with two templates that could make
/// the same id, is refused at start with its position and the field.
#[test]
fn two_resources_on_one_lease_id_exit_64_naming_the_second_id() {
    let dir = tempfile::tempdir().unwrap();
    let resources = |a: &str, b: &str| {
        format!(
            "upstreams:\n  api: {{ url: \"http://127.0.0.1:9\" }}\n\
             resources:\n  a:\n    kind: rate\n    capacity: 5/s\n    id: {a}\n  \
             b:\n    kind: gauge\n    capacity: 3\n    id: {b}\n\
             routes:\n  - {{ name: r, upstream: api, resources: [a, b] }}\n"
        )
    };
    for (file, text, want) in [
        (
            "fixed.yaml",
            resources("shared", "shared"),
            ":11:9: resources.b.id: id `shared` is already resource `a`'s \
             (hint: each resource leases its own id; routes can share one resource)",
        ),
        (
            "templated.yaml",
            resources("\"t/{header.x-tenant}\"", "\"t/{path.1}\""),
            ":11:9: resources.b.id: id `t/{path.1}` could make the same lease id as resource `a`'s id \
             `t/{header.x-tenant}` (hint: each resource leases its own ids: give the two literal prefixes \
             neither of which begins the other (e.g. `a/{header.x}` and `b/{header.x}`), or let the routes \
             share one resource)",
        ),
    ] {
        let path = write_file(dir.path(), file, &text);
        // Bounded: a file taken would have the proxy serve until killed.
        let (code, err) = run_usher_for(&["proxy", "--routes", path.to_str().unwrap()], &[], Duration::from_secs(20));
        assert_eq!(code, Some(64), "{file}: stderr:\n{err}");
        let want = format!("{}{want}", path.display());
        assert!(err.contains(&want), "{file}: missing {want:?} in:\n{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrouted_requests_get_403_and_the_admin_pages_answer() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api-rate: {{ kind: rate, capacity: 100/s, burst: 10 }}\n\
             routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up, resources: [api-rate] }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    let r = send1(&mut c, get("elsewhere.test", "/secret")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.header("content-type"), "application/problem+json");
    assert_eq!(
        r.json(),
        serde_json::json!({
            "type": "urn:usher:problem:no-route",
            "title": "Forbidden",
            "status": 403,
            "detail": "no route for GET elsewhere.test/secret",
        })
    );
    assert_eq!(up.stats.requests(), 0);
    let r = send1(&mut c, get("api.test", "/ok")).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"));
    assert_eq!(up.stats.hosts.lock().unwrap().as_slice(), [up.addr.to_string()], "Host is the upstream's");

    let admin = u.addr("admin");
    let (s, body) = tokio::task::spawn_blocking(move || http_get(admin, "/metrics")).await.unwrap();
    assert_eq!(s, 200);
    let counts: Vec<&str> = body.lines().filter(|l| l.starts_with("usher_proxy_requests_total")).collect();
    assert_eq!(
        metric(&body, "usher_proxy_requests_total", &[("route", "_none"), ("outcome", "no_route")]),
        Some(1.0),
        "{counts:?}"
    );
    assert_eq!(metric(&body, "usher_proxy_requests_total", &[("route", "api"), ("outcome", "admitted")]), Some(1.0));
    assert_eq!(metric(&body, "usher_proxy_capacity", &[("resource", "api-rate")]), Some(100.0));
    let (s, body) = tokio::task::spawn_blocking(move || http_get(admin, "/debug/status?format=json")).await.unwrap();
    assert_eq!(s, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["keys"][0]["id"], "api-rate");
    assert_eq!(status["keys"][0]["demand"]["admitted"], 1);
    for path in ["/healthz", "/readyz", "/debug/status"] {
        assert_eq!(tokio::task::spawn_blocking(move || http_get(admin, path)).await.unwrap().0, 200, "{path}");
    }
}

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
async fn forward_proxy_style_and_connect_tunnels() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        "resources:\n  tunnels: { kind: gauge, capacity: 1 }\n\
         routes:\n  - { name: local, match: { host: 127.0.0.1 }, resources: [tunnels] }\n",
    );
    let u = start_proxy(&routes);
    let proxy = u.addr("listen");

    // Absolute-form, as an app with HTTP_PROXY set sends it.
    let mut c = h1(proxy).await;
    let req = Request::get(format!("http://{}/fwd", up.addr)).body(upstream::empty()).unwrap();
    let r = send1(&mut c, req).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"));

    // CONNECT to a host a route names: a tunnel that holds the gauge while open.
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n", a = up.addr).as_bytes()).await.unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    s.write_all(b"GET /through HTTP/1.1\r\nHost: tunnel\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200") && resp.ends_with("ok"), "{resp}");
    let admin = u.addr("admin");
    let tunnels_in_flight = move || {
        let (_, body) = http_get(admin, "/metrics");
        metric(&body, "usher_proxy_resource_in_flight", &[("resource", "tunnels")])
    };
    assert_eq!(
        tokio::task::spawn_blocking(tunnels_in_flight).await.unwrap(),
        Some(1.0),
        "the open tunnel holds the gauge"
    );
    drop(s);
    let gone = tokio::task::spawn_blocking(move || {
        assert_eventually!(
            tunnels_in_flight() == Some(0.0),
            Duration::from_secs(10),
            "the closed tunnel kept its permit"
        );
    });
    within(gone).await;

    // A second tunnel while one is open is refused by the gauge.
    let mut held = tokio::net::TcpStream::connect(proxy).await.unwrap();
    held.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n", a = up.addr).as_bytes()).await.unwrap();
    assert!(read_head(&mut held).await.starts_with("HTTP/1.1 200"));
    let mut second = tokio::net::TcpStream::connect(proxy).await.unwrap();
    second.write_all(format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n", a = up.addr).as_bytes()).await.unwrap();
    let head = read_head(&mut second).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("ratelimit-policy: \"tunnels\";q=1;qu=\"concurrent-requests\""),
        "{head}"
    );
    drop(held);

    // CONNECT to a host no route names is refused.
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(
        format!("CONNECT localhost:{p} HTTP/1.1\r\nHost: localhost:{p}\r\n\r\n", p = up.addr.port()).as_bytes(),
    )
    .await
    .unwrap();
    assert!(read_head(&mut s).await.starts_with("HTTP/1.1 403"));
}

async fn read_head(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte)).await.expect("response head").unwrap();
        assert!(n == 1, "connection closed after {:?}", String::from_utf8_lossy(&buf));
        buf.push(byte[0]);
        assert!(buf.len() < 64 * 1024);
    }
    String::from_utf8_lossy(&buf).into_owned()
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

/// Replaces a file atomically, as editors and ConfigMap updates do, so no reload sees half a file.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_connections_and_limiter_state() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let base = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  api: {{ kind: rate, capacity: 1/day, burst: 2 }}\n\
         routes:\n  - {{ name: api, match: {{ path_prefix: /api }}, upstream: up, resources: [api] }}\n",
        up.addr
    );
    let routes = write_file(dir.path(), "routes.yaml", &base);
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    for _ in 0..2 {
        assert_eq!(send1(&mut c, get("x", "/api")).await.status, StatusCode::OK);
    }
    assert_eq!(send1(&mut c, get("x", "/api")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send1(&mut c, get("x", "/other")).await.status, StatusCode::FORBIDDEN);

    // A new route; `api` unchanged.
    replace(&routes, &format!("{base}  - {{ name: other, match: {{ path_prefix: /other }}, upstream: up }}\n"));
    u.wait_for_log("routes reloaded", Duration::from_secs(20));
    assert_eq!(send1(&mut c, get("x", "/other")).await.status, StatusCode::OK, "same connection, new route");
    assert_eq!(
        send1(&mut c, get("x", "/api")).await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the spent budget survived the reload"
    );

    // A broken file is rejected; the previous routes stay.
    replace(&routes, "routes: [ { name: x, upstream: nope } ]\n");
    u.wait_for_log("routes[0].upstream: unknown upstream `nope`", Duration::from_secs(20));
    assert_eq!(send1(&mut c, get("x", "/other")).await.status, StatusCode::OK);
    let admin = u.addr("admin");
    let (_, body) = tokio::task::spawn_blocking(move || http_get(admin, "/metrics")).await.unwrap();
    assert_eq!(metric(&body, "usher_proxy_config_reload_errors_total", &[]), Some(1.0));
    assert_eq!(metric(&body, "usher_proxy_config_reloads_total", &[]), Some(1.0));
}

/// `limits.max_body_bytes` lowered by a reload applies to the next request
/// on a connection the sidecar already had, a small declared body included
/// (the native path checked it against the limit its connection began with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_body_limit_applies_to_small_bodies_on_open_connections() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let base = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         routes:\n  - {{ name: api, upstream: up }}\n",
        up.addr
    );
    let routes = write_file(dir.path(), "routes.yaml", &base);
    let u = start_proxy(&routes);
    let mut c = h1(u.addr("listen")).await;
    let post = |n: usize| Request::post("/sink").header("host", "app").body(upstream::full(vec![b'a'; n])).unwrap();
    assert_eq!(send1(&mut c, post(20)).await.status, StatusCode::OK);
    replace(&routes, &format!("limits: {{ max_body_bytes: 10 }}\n{base}"));
    u.wait_for_log("routes reloaded", Duration::from_secs(20));
    let before = up.stats.requests();
    for mut conn in [c, h1(u.addr("listen")).await] {
        let got = send1(&mut conn, post(20)).await;
        assert_eq!(got.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", String::from_utf8_lossy(&got.body));
        assert_eq!(send1(&mut conn, post(10)).await.status, StatusCode::OK, "a body within the limit passes");
    }
    assert_eq!(up.stats.requests(), before + 2, "nothing over the limit was forwarded");
}

/// The sidecar's status page, which shows `want` as its configuration
/// error, and its counts of rejected and of applied reloads.
async fn rejected(admin: std::net::SocketAddr, want: &str) -> (serde_json::Value, Option<f64>, Option<f64>) {
    let (status, metrics) = tokio::task::spawn_blocking(move || {
        (http_get(admin, "/debug/status?format=json").1, http_get(admin, "/metrics").1)
    })
    .await
    .unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert!(status["config_error"].as_str().is_some_and(|e| e.contains(want)), "{status}");
    let errors = metric(&metrics, "usher_proxy_config_reload_errors_total", &[]);
    (status, errors, metric(&metrics, "usher_proxy_config_reloads_total", &[]))
}

/// A reload into a routes file with two resources on one lease id (a fixed
/// id twice, or two templates that could make the same id) is rejected like
/// any bad file: the previous routes and limiter state stay, the error is
/// logged with its position and shown on the status page, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_into_two_resources_on_one_lease_id_keeps_the_last_good_routes() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The last good file; a bad one adds resources, and a route to `/other` through `other`.
    let file = |extra: &str, other: &str| {
        let route = match other {
            "" => String::new(),
            r => format!("  - {{ name: other, match: {{ path_prefix: /other }}, upstream: up, resources: [{r}] }}\n"),
        };
        format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  core: {{ kind: rate, capacity: 1/day, burst: 2 }}\n{extra}\
             routes:\n  - {{ name: api, match: {{ path_prefix: /api }}, upstream: up, resources: [core] }}\n{route}",
            up.addr
        )
    };
    let routes = write_file(dir.path(), "routes.yaml", &file("", ""));
    let f = routes.display().to_string();
    let u = start_proxy(&routes);
    let admin = u.addr("admin");
    let mut c = h1(u.addr("listen")).await;
    for _ in 0..2 {
        assert_eq!(send1(&mut c, get("x", "/api")).await.status, StatusCode::OK);
    }
    assert_eq!(send1(&mut c, get("x", "/api")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send1(&mut c, get("x", "/other")).await.status, StatusCode::FORBIDDEN);

    let bad = [
        (
            "  extra:\n    kind: rate\n    capacity: 100/s\n    id: core\n",
            "extra",
            format!("{f}:8:9: resources.extra.id: id `core` is already resource `core`'s"),
        ),
        (
            "  t1: { kind: rate, capacity: 100/s, id: \"t/{header.x-tenant}\" }\n  \
             t2:\n    kind: rate\n    capacity: 100/s\n    id: \"t/{path.1}\"\n",
            "t2",
            format!(
                "{f}:9:9: resources.t2.id: id `t/{{path.1}}` could make the same lease id as resource `t1`'s id \
                 `t/{{header.x-tenant}}`"
            ),
        ),
    ];
    for (i, (extra, other, want)) in bad.into_iter().enumerate() {
        replace(&routes, &file(extra, other));
        u.wait_for_log(&want, Duration::from_secs(20));
        assert_eq!(send1(&mut c, get("x", "/other")).await.status, StatusCode::FORBIDDEN, "no route to /other yet");
        assert_eq!(
            send1(&mut c, get("x", "/api")).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "the last good routes and their spent budget stay"
        );
        let (status, errors, reloads) = rejected(admin, &want).await;
        assert_eq!(status["routes"], serde_json::json!(["api"]), "{status}");
        assert_eq!(errors, Some(i as f64 + 1.0));
        assert_eq!(reloads, Some(0.0));
    }
    assert!(!u.log().contains("routes reloaded"), "{}", u.log());
}

/// A live reload into a routes file of a kilobyte whose nested aliases would
/// expand to 43 million nodes (an "alias bomb") is refused at once, naming
/// the file and the alias, without the memory the expansion would take: the
/// sidecar keeps serving its last good routes, counts the error, and still
/// applies the next good file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_into_an_alias_bomb_is_refused_at_once_and_the_last_good_routes_keep_serving() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let base = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         routes:\n  - {{ name: api, match: {{ path_prefix: /api }}, upstream: up }}\n",
        up.addr
    );
    let routes = write_file(dir.path(), "routes.yaml", &base);
    let mut u = start_proxy(&routes);
    let admin = u.addr("admin");
    let mut c = h1(u.addr("listen")).await;
    assert_eq!(send1(&mut c, get("x", "/api")).await.status, StatusCode::OK);
    let peak = support::peak_rss_kib(u.child.id());

    replace(&routes, &support::alias_bomb());
    let want = format!("{}:7:17: this alias would make the document more than 200000 nodes", routes.display());
    let started = std::time::Instant::now();
    u.wait_for_log(&want, Duration::from_secs(10));
    let took = started.elapsed();
    assert!(u.log().contains("routes file rejected, keeping the previous one"), "{}", u.log());
    assert_eq!(u.child.try_wait().unwrap(), None, "the sidecar is still running");
    let grown = support::peak_rss_kib(u.child.id()).saturating_sub(peak);
    eprintln!("figures: refused {took:?} after it was written; peak resident memory +{grown} KiB");
    assert!(grown < 64 * 1024, "the peak resident memory grew by {grown} KiB");
    let before = up.stats.requests();
    for mut conn in [c, h1(u.addr("listen")).await] {
        assert_eq!(send1(&mut conn, get("x", "/api")).await.status, StatusCode::OK, "the last good routes serve");
        assert_eq!(send1(&mut conn, get("x", "/other")).await.status, StatusCode::FORBIDDEN);
    }
    assert_eq!(up.stats.requests(), before + 2);
    let (status, errors, reloads) = rejected(admin, &want).await;
    assert_eq!(status["routes"], serde_json::json!(["api"]), "{status}");
    assert_eq!((errors, reloads), (Some(1.0), Some(0.0)), "one reload rejected, none applied");

    // The reloader lives on: the next good file is applied.
    replace(&routes, &format!("{base}  - {{ name: other, match: {{ path_prefix: /other }}, upstream: up }}\n"));
    u.wait_for_log("routes reloaded", Duration::from_secs(10));
    assert_eq!(send1(&mut h1(u.addr("listen")).await, get("x", "/other")).await.status, StatusCode::OK);
}

/// The embedded server's lease of `api`: (capacity, refresh interval in seconds).
fn embedded_lease(admin: std::net::SocketAddr) -> Option<(f64, f64)> {
    let (_, body) = http_get(admin, "/debug/status?format=json");
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let key = v["lease"]["keys"].as_array()?.iter().find(|k| k["resource_id"] == "api")?.clone();
    Some((key["capacity"].as_f64()?, key["refresh_interval_s"].as_f64()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_lease_is_refreshed_rarely_and_follows_a_reloaded_capacity_at_once() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = |capacity: &str| {
        format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: {capacity} }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [api] }}\n",
            up.addr
        )
    };
    let routes = write_file(dir.path(), "routes.yaml", &file("10/s"));
    let u = start_proxy(&routes);
    let admin = u.addr("admin");
    // The sidecar is its embedded server's only client: it refreshes every
    // hour (an idle sidecar wakes rarely), and asks early when it must.
    assert_eventually!(
        embedded_lease(admin) == Some((10.0, 3600.0)),
        Duration::from_secs(10),
        "{:?}",
        embedded_lease(admin)
    );
    // A raised capacity, with no request at all (no pressure to ask early):
    // leased at once, not at the next refresh.
    replace(&routes, &file("50/s"));
    u.wait_for_log("routes reloaded", Duration::from_secs(20));
    assert_eventually!(
        embedded_lease(admin).is_some_and(|l| l.0 == 50.0),
        Duration::from_secs(5),
        "{:?}",
        embedded_lease(admin)
    );
    // And a lowered one.
    replace(&routes, &file("5/s"));
    assert_eventually!(
        embedded_lease(admin).is_some_and(|l| l.0 == 5.0),
        Duration::from_secs(25),
        "{:?}",
        embedded_lease(admin)
    );
}

/// A templated key nobody uses is forgotten at its `key_idle_timeout`, and
/// its lease released, on a sidecar where nothing else happens (its lease
/// client otherwise sleeps until the next hourly refresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_is_forgotten_at_its_timeout_on_a_quiet_sidecar() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  tenant: {{ kind: rate, capacity: 10/s, id: \"t/{{header.x-tenant}}\", key_idle_timeout: 2s }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    let keys = || {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let ids: Option<Vec<String>> =
            v["lease"]["keys"].as_array().map(|k| k.iter().map(|k| k["resource_id"].to_string()).collect());
        ids.unwrap_or_default()
    };
    let mut c = h1(u.addr("listen")).await;
    let req = Request::get("/x").header("host", "app").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    let sent = std::time::Instant::now();
    assert_eq!(send1(&mut c, req).await.status, StatusCode::OK);
    assert_eventually!(keys() == ["\"t/acme\""], Duration::from_secs(5), "{:?}", keys());
    // Nothing more happens: the key goes at 2 s after its last use (the
    // lease client's reads between then and now end in a quiet wait).
    assert_eventually!(keys().is_empty(), Duration::from_secs(10), "{:?}", keys());
    let took = sent.elapsed();
    assert!(took >= Duration::from_secs(2), "forgotten after {took:?}, before its idle timeout");
    u.wait_for_log("forgot an idle key", Duration::from_secs(5));
}

/// A header whose value is not UTF-8 makes no lease id: two such values
/// would both become U+FFFD and share one budget. The request gets a 400
/// naming the resource and the header, makes no key, and UTF-8 beyond ASCII
/// is a key as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_is_not_utf8_makes_no_key() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 10/s, burst: 5, id: \"t/{{header.x-tenant}}\" }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let keys = || {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys = v["lease"]["keys"].as_array().cloned().unwrap_or_default();
        keys.iter().map(|k| k["resource_id"].as_str().unwrap_or_default().to_string()).collect::<Vec<_>>()
    };
    // Raw bytes on the wire, one request per connection.
    let listen = u.addr("listen");
    let send = |tenant: &'static [u8]| async move {
        let mut s = tokio::net::TcpStream::connect(listen).await.unwrap();
        let mut req = b"GET /x HTTP/1.1\r\nHost: app\r\nConnection: close\r\nX-Tenant: ".to_vec();
        req.extend_from_slice(tenant);
        req.extend_from_slice(b"\r\n\r\n");
        tokio::io::AsyncWriteExt::write_all(&mut s, &req).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read_to_end(&mut s, &mut out))
            .await
            .expect("answered")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    for tenant in [&b"\xff"[..], b"ac\xfeme"] {
        let got = send(tenant).await;
        assert!(got.starts_with("HTTP/1.1 400"), "{got}");
        assert!(got.contains("resource `tenant`") && got.contains("`x-tenant` is not UTF-8"), "{got}");
    }
    assert_eq!(up.stats.requests(), 0, "nothing went upstream");
    let got = send("café".as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eventually!(keys() == ["t/café"], Duration::from_secs(5), "{:?}", keys());
}

/// A resource whose id is a placeholder alone (the tenant's name is the
/// lease id) is leased its capacity by the embedded server, not the
/// catch-all's nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_is_a_placeholder_alone_is_leased_its_capacity() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 10/s, burst: 5, id: \"{{header.x-tenant}}\" }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let lease = || {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys = v["lease"]["keys"].as_array().cloned().unwrap_or_default();
        keys.iter().find(|k| k["resource_id"] == "acme").map(|k| (k["mode"].to_string(), k["capacity"].to_string()))
    };
    let mut c = h1(u.addr("listen")).await;
    let req = || Request::get("/x").header("host", "app").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK);
    assert_eventually!(lease().is_some_and(|(mode, _)| mode == "\"leased\""), Duration::from_secs(5), "{:?}", lease());
    assert_eq!(lease().unwrap().1, "10.0", "the resource's capacity, not the catch-all's 0");
    assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK, "and requests pass under the lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_keys_lease_state_and_transitions_show_on_every_scrape() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 10/s, id: \"t/{{header.x-tenant}}\", max_keys: 10 }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let mut c = h1(u.addr("listen")).await;
    let req = Request::get("/x").header("host", "api.test").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    assert_eq!(send1(&mut c, req).await.status, StatusCode::OK);
    let state =
        |text: &str, s: &str| metric(text, "usher_proxy_lease_state", &[("resource_id", "t/acme"), ("state", s)]);
    let labels = [("resource_id", "t/acme"), ("from", "pending"), ("to", "leased")];
    // The lease client counts the transition just after the key's state changed.
    assert_eventually!(
        {
            let text = http_get(u.addr("admin"), "/metrics").1;
            state(&text, "leased") == Some(1.0) && metric(&text, "usher_lease_transitions_total", &labels).is_some()
        },
        Duration::from_secs(10),
        "the key is leased"
    );
    // The lease states are filled for each scrape (and dropped after it): the
    // next scrape shows them all the same, with the transition counted once.
    for _ in 0..2 {
        let (_, text) = http_get(u.addr("admin"), "/metrics");
        assert_eq!(state(&text, "leased"), Some(1.0), "{text}");
        assert_eq!(state(&text, "pending"), Some(0.0), "{text}");
        assert_eq!(metric(&text, "usher_lease_transitions_total", &labels), Some(1.0), "{text}");
    }
}

/// Tenants that come and go leave no `usher_lease_transitions_total` series
/// behind once their keys are forgotten (README: per-key series carry at
/// most `max_keys` ids per resource); a tenant that comes back counts anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_keys_transition_counts_leave_metrics() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  fixed: {{ kind: rate, capacity: 100/s, burst: 50 }}\n  \
         tenant: {{ kind: rate, capacity: 10/s, id: \"t/{{header.x-tenant}}\", key_idle_timeout: 1s }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [fixed, tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let tenants = ["acme", "globex", "initech", "umbrella", "hooli"];
    let series = |text: &str| -> Vec<String> {
        text.lines().filter(|l| l.starts_with("usher_lease_transitions_total{")).map(str::to_string).collect()
    };
    let tenant_series =
        |text: &str| -> usize { series(text).iter().filter(|l| l.contains("resource_id=\"t/")).count() };
    let mut c = h1(u.addr("listen")).await;
    for round in 0..2 {
        for t in tenants {
            let req =
                Request::get("/x").header("host", "api.test").header("x-tenant", t).body(upstream::empty()).unwrap();
            let r = send1(&mut c, req).await;
            assert_eq!(r.status, StatusCode::OK, "round {round}, {t}: {:?}", r.body);
        }
        // Each tenant's key is leased (pending → leased), and counted.
        assert_eventually!(
            {
                let text = http_get(u.addr("admin"), "/metrics").1;
                tenants.iter().all(|t| {
                    let labels =
                        [("resource_id", format!("t/{t}")), ("from", "pending".into()), ("to", "leased".into())];
                    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    metric(&text, "usher_lease_transitions_total", &labels) == Some(1.0)
                })
            },
            Duration::from_secs(10),
            "round {round}: every tenant's transition is counted once:\n{:?}",
            series(&http_get(u.addr("admin"), "/metrics").1)
        );
        // Idle for their timeout, the keys are forgotten, and their series with them.
        assert_eventually!(
            tenant_series(&http_get(u.addr("admin"), "/metrics").1) == 0,
            Duration::from_secs(10),
            "round {round}: series of forgotten tenants stay:\n{:?}",
            series(&http_get(u.addr("admin"), "/metrics").1)
        );
        let text = http_get(u.addr("admin"), "/metrics").1;
        assert!(
            metric(&text, "usher_lease_transitions_total", &[("resource_id", "fixed")]).is_some(),
            "the fixed key, never forgotten, keeps its count: {:?}",
            series(&text)
        );
    }
    u.wait_for_log("forgot an idle key", Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests() {
    let up = Upstream::gated().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!("upstreams:\n  up: {{ url: \"http://{}\" }}\nroutes:\n  - {{ name: all, upstream: up }}\n", up.addr),
    );
    let mut u = start_proxy(&routes);
    let addr = u.addr("listen");
    let inflight = tokio::spawn(async move { send1(&mut h1(addr).await, get("x", "/slow")).await });
    let s = up.stats.clone();
    assert_eventually!(s.in_flight() == 1, Duration::from_secs(10), "request never reached the upstream");
    u.signal("TERM");
    u.wait_for_log("shutting down", Duration::from_secs(10));
    let mut closed = false;
    for _ in 0..500 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(closed, "the listener stays closed while draining");
    up.gate.add_permits(1);
    let r = within(inflight).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"));
    assert_eq!(u.wait_exit(Duration::from_secs(10)), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_upgrades_pass_through_and_passthrough_default_forwards_unrouted_requests() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "default: passthrough\nupstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  sockets: {{ kind: gauge, capacity: 1 }}\n\
             routes:\n  - {{ name: app, match: {{ host: app.test }}, upstream: up, resources: [sockets] }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    let mut s = tokio::net::TcpStream::connect(u.addr("listen")).await.unwrap();
    s.write_all(b"GET /upgrade HTTP/1.1\r\nHost: app.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.to_ascii_lowercase().contains("upgrade: echo"), "{head}");
    s.write_all(b"ping\n").await.unwrap();
    let mut echoed = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut echoed)).await.expect("echo").unwrap();
    assert_eq!(&echoed, b"ping\n");

    // The upgraded connection holds its gauge permit while open.
    let mut second = tokio::net::TcpStream::connect(u.addr("listen")).await.unwrap();
    second
        .write_all(b"GET /upgrade HTTP/1.1\r\nHost: app.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut second).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    drop(s);
    let admin = u.addr("admin");
    let released = tokio::task::spawn_blocking(move || {
        assert_eventually!(
            metric(&http_get(admin, "/metrics").1, "usher_proxy_resource_in_flight", &[("resource", "sockets")])
                == Some(0.0),
            Duration::from_secs(10),
            "the closed upgrade kept its permit"
        );
    });
    within(released).await;

    // No route for this host, default passthrough: forwarded to the origin it names.
    let mut c = h1(u.addr("listen")).await;
    let req = Request::get(format!("http://{}/direct", up.addr)).body(upstream::empty()).unwrap();
    let r = send1(&mut c, req).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"));
    assert_eq!(up.stats.requests(), 2);

    // A request that would come back through usher is stopped at the second pass.
    let req = Request::get(format!("http://{}/again", u.addr("listen"))).body(upstream::empty()).unwrap();
    let r = send1(&mut c, req).await;
    assert_eq!(r.status, StatusCode::LOOP_DETECTED, "{}", r.text());
    assert_eq!(r.json()["type"], "urn:usher:problem:loop");
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
