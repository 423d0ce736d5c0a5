//! An upstream's own listener (`upstreams.NAME.listen`), through the real
//! `usher proxy` binary: an app pointed at it as a base URL (its requests
//! carry `Host: 127.0.0.1:PORT`) reaches that upstream, on both HTTP/1.1
//! engines and on h2c; two upstreams with the same paths on two listeners
//! each get their own requests; the main listener routes as before; bad
//! listener addresses are refused with their position; a reload keeps the
//! listeners open and applies the routes.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::upstream::{Upstream, get, get_abs, h1, h2, send1, send2};
use support::{Usher, http_get, metric, run_usher, write_file};

/// `usher proxy` on 127.0.0.1:0 with `--http1 ENGINE`.
fn proxy(routes: &Path, engine: &str) -> Usher {
    let routes = routes.to_str().expect("a UTF-8 path");
    Usher::start(
        &["proxy", "--routes", routes, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--http1", engine],
        &[],
        "usher proxy listening",
    )
}

async fn scrape(admin: SocketAddr) -> String {
    tokio::task::spawn_blocking(move || http_get(admin, "/metrics").1).await.unwrap()
}

/// Two upstreams serving the same paths (`/v1/...`), each with a listener
/// of its own; upstream `a` is also reachable on the main listener by host.
fn two_apis(a: &Upstream, b: &Upstream) -> String {
    format!(
        "upstreams:\n\
         \x20 a: {{ url: \"http://{}\", listen: 127.0.0.1:0 }}\n\
         \x20 b: {{ url: \"http://{}\", listen: 127.0.0.1:0 }}\n\
         resources:\n\
         \x20 a-rate: {{ kind: rate, capacity: 1000/s, burst: 100 }}\n\
         routes:\n\
         \x20 - {{ name: a, match: {{ host: api.a.test, path_prefix: /v1 }}, upstream: a, resources: [a-rate] }}\n\
         \x20 - {{ name: b, match: {{ host: api.b.test, path_prefix: /v1, methods: [GET] }}, upstream: b }}\n",
        a.addr, b.addr
    )
}

async fn overlapping_paths_on_two_listeners(engine: &str) {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let routes = write_file(dir.path(), "routes.yaml", &format!("access_log: {}\n{}", log.display(), two_apis(&a, &b)));
    let u = proxy(&routes, engine);
    let (main, on_a, on_b) = (u.addr("listen"), u.upstream_listener("a"), u.upstream_listener("b"));
    assert!(on_a != on_b && on_a != main && on_b != main, "{main} {on_a} {on_b}");

    // As an SDK with its base URL set sends them: Host is the listener's own address.
    let mut ca = h1(on_a).await;
    let r = send1(&mut ca, get(&on_a.to_string(), "/v1/repos")).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "{engine}");
    assert_eq!((a.stats.requests(), b.stats.requests()), (1, 0));
    assert_eq!(a.stats.hosts.lock().unwrap().as_slice(), [a.addr.to_string()], "Host is the upstream's");
    let mut cb = h1(on_b).await;
    let r = send1(&mut cb, get(&on_b.to_string(), "/v1/repos")).await;
    assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "{engine}");
    assert_eq!((a.stats.requests(), b.stats.requests()), (1, 1));
    // Any Host, and the other upstream's host too: the listener decides.
    let r = send1(&mut ca, get("api.b.test", "/v1/other")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((a.stats.requests(), b.stats.requests()), (2, 1));

    // path_prefix and methods still apply; nothing matching is the usual 403.
    let r = send1(&mut ca, get(&on_a.to_string(), "/v2/repos")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.json()["type"], "urn:usher:problem:no-route");
    let post = http::Request::post("/v1/repos").header("host", on_b.to_string()).body(support::upstream::empty());
    let r = send1(&mut cb, post.unwrap()).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "route b takes GET only");
    assert_eq!((a.stats.requests(), b.stats.requests()), (2, 1));

    // h2c on an upstream's listener.
    let mut c2 = h2(on_b).await;
    let r = send2(&mut c2, get_abs(&on_b.to_string(), "/v1/h2")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((a.stats.requests(), b.stats.requests()), (2, 2));

    // The main listener routes by host, as before: its own address is no route.
    let mut cm = h1(main).await;
    let r = send1(&mut cm, get(&main.to_string(), "/v1/repos")).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = send1(&mut cm, get("api.a.test", "/v1/repos")).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = send1(&mut cm, get("api.b.test", "/v1/repos")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((a.stats.requests(), b.stats.requests()), (3, 3));

    // No tunnels from an upstream's listener.
    let mut s = tokio::net::TcpStream::connect(on_a).await.unwrap();
    s.write_all(format!("CONNECT {x} HTTP/1.1\r\nHost: {x}\r\n\r\n", x = a.addr).as_bytes()).await.unwrap();
    let mut head = vec![0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 403", "{}", String::from_utf8_lossy(&head));

    let m = scrape(u.addr("admin")).await;
    let count = |route| metric(&m, "usher_proxy_requests_total", &[("route", route), ("outcome", "admitted")]);
    assert_eq!((count("a"), count("b")), (Some(3.0), Some(3.0)), "{engine}");
    assert_eq!(
        metric(&m, "usher_proxy_resource_requests_total", &[("resource", "a-rate"), ("outcome", "admitted")]),
        Some(3.0)
    );
    // The access log names the upstream whose listener routed a request (not on the main listener).
    let lines = || std::fs::read_to_string(&log).unwrap_or_default().lines().count();
    assert_eventually!(lines() >= 10, Duration::from_secs(10), "{} access log lines of 10", lines());
    let entries: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let on = |listener: Option<&str>| {
        let mut seen: Vec<String> = entries
            .iter()
            .filter(|e| e["listener"].as_str() == listener)
            .map(|e| format!("{} {}", e["route"].as_str().unwrap(), e["outcome"].as_str().unwrap()))
            .collect();
        seen.sort();
        seen
    };
    assert_eq!(on(Some("a")), ["a admitted", "a admitted"], "{entries:?}");
    assert_eq!(on(Some("b")), ["b admitted", "b admitted"], "{entries:?}");
    let main_and_refused =
        ["_none no_route", "_none no_route", "_none no_route", "_none no_route", "a admitted", "b admitted"];
    assert_eq!(on(None), main_and_refused, "{entries:?}");
    if engine == "native" {
        // The native engine itself routed the HTTP/1.1 GETs (only CONNECT went to hyper).
        let handoffs: f64 = m
            .lines()
            .filter(|l| l.starts_with("usher_proxy_http1_handoffs_total{") && !l.contains("reason=\"connect\""))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        assert_eq!(handoffs, 0.0, "{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_apis_with_the_same_paths_on_two_listeners_native() {
    overlapping_paths_on_two_listeners("native").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_apis_with_the_same_paths_on_two_listeners_hyper() {
    overlapping_paths_on_two_listeners("hyper").await;
}

/// The Quickstart's own file, with a local upstream for api.github.com and
/// a free port for 15002: an SDK pointed at the listener reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_serves_an_app_pointed_at_its_base_url() {
    let quick = include_str!("../deploy/examples/quickstart.yaml");
    assert!(quick.contains("{ url: https://api.github.com, listen: 127.0.0.1:15002 }"), "{quick}");
    let up = Upstream::start().await;
    let text = quick
        .replace("https://api.github.com", &format!("http://{}", up.addr))
        .replace("127.0.0.1:15002", "127.0.0.1:0");
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(dir.path(), "quickstart.yaml", &text);
    let u = proxy(&routes, "native");
    let base = u.upstream_listener("github");
    let mut c = h1(base).await;
    for path in ["/repos/o/r", "/user", "/"] {
        let r = send1(&mut c, get(&base.to_string(), path)).await;
        assert_eq!((r.status, r.text().as_str()), (StatusCode::OK, "ok"), "{path}");
    }
    assert_eq!(up.stats.targets.lock().unwrap().as_slice(), ["/repos/o/r", "/user", "/"]);
    let m = scrape(u.addr("admin")).await;
    assert_eq!(
        metric(&m, "usher_proxy_resource_requests_total", &[("resource", "github-core"), ("outcome", "admitted")]),
        Some(3.0)
    );

    // `usher check` shows the listener of the file as written.
    let path = format!("{}/deploy/examples/quickstart.yaml", env!("CARGO_MANIFEST_DIR"));
    let (code, out, err) = run_usher(&["check", &path]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("upstream listener: 127.0.0.1:15002 (every request on it goes to upstream `github`)"),
        "{out}"
    );
}

#[test]
fn listener_addresses_that_clash_or_are_not_ip_port_are_refused_with_their_position() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_file(
        dir.path(),
        "bad.yaml",
        "listen: 127.0.0.1:15001\n\
         upstreams:\n\
         \x20 a: { url: http://a.test, listen: 127.0.0.1:15001 }\n\
         \x20 b: { url: http://b.test, listen: 127.0.0.1:15009 }\n\
         \x20 c:\n\
         \x20   url: http://c.test\n\
         \x20   listen: 127.0.0.1:15009\n\
         \x20 d: { url: http://d.test, listen: api.test:80 }\n",
    );
    let file = bad.to_str().unwrap();
    for args in [vec!["check", file], vec!["proxy", "--routes", file, "--admin-listen", "127.0.0.1:0"]] {
        let (code, _, err) = run_usher(&args);
        assert_eq!(code, 64, "{args:?}: {err}");
        for want in [
            format!("{file}:3:36: upstreams.a.listen: `127.0.0.1:15001` is already the address of `listen`"),
            format!("{file}:7:13: upstreams.c.listen: `127.0.0.1:15009` is already the address of upstream `b`"),
            format!("{file}:8:36: upstreams.d.listen: `api.test:80` is not an IP:port address"),
        ] {
            assert!(err.contains(&want), "{args:?}: missing {want:?} in:\n{err}");
        }
    }
}

/// Replaces a file atomically, as editors and ConfigMap updates do.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Listeners change only on restart: a reload that moves one says so at
/// WARN, and the open listener keeps serving its upstream, by the new routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_listeners_and_applies_the_routes() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dir = tempfile::tempdir().unwrap();
    let first = two_apis(&a, &b);
    let routes = write_file(dir.path(), "routes.yaml", &first);
    let u = proxy(&routes, "native");
    let on_a = u.upstream_listener("a");
    let mut c = h1(on_a).await;
    assert_eq!(send1(&mut c, get(&on_a.to_string(), "/v1/x")).await.status, StatusCode::OK);
    assert_eq!(send1(&mut c, get(&on_a.to_string(), "/v2/x")).await.status, StatusCode::FORBIDDEN);

    // Upstream `a` asks for another address, and its route moves to /v2.
    let free = support::free_port();
    let second = first
        .replace("listen: 127.0.0.1:0 }\n  b:", &format!("listen: 127.0.0.1:{free} }}\n  b:"))
        .replace("path_prefix: /v1 }, upstream: a", "path_prefix: /v2 }, upstream: a");
    assert_ne!(first, second);
    replace(&routes, &second);
    u.wait_for_log("routes reloaded", Duration::from_secs(20));
    u.wait_for_log("upstream listeners change only on restart", Duration::from_secs(1));
    assert!(u.log().contains("kept=a=127.0.0.1:0,b=127.0.0.1:0"), "{}", u.log());
    assert_eq!(send1(&mut c, get(&on_a.to_string(), "/v2/x")).await.status, StatusCode::OK, "same connection");
    assert_eq!(send1(&mut c, get(&on_a.to_string(), "/v1/x")).await.status, StatusCode::FORBIDDEN);
    let mut fresh = h1(on_a).await;
    assert_eq!(send1(&mut fresh, get(&on_a.to_string(), "/v2/y")).await.status, StatusCode::OK, "new connection");
    assert!(std::net::TcpStream::connect(("127.0.0.1", free)).is_err(), "no listener opened on the reloaded address");
    assert_eq!((a.stats.requests(), b.stats.requests()), (3, 0));
}

/// An upstream listener's address that is taken stops the sidecar at start, naming it.
#[test]
fn a_taken_upstream_listener_address_stops_the_sidecar_at_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  a: {{ url: http://a.test, listen: {addr} }}\nroutes:\n  - {{ name: a, upstream: a }}\n"
        ),
    );
    let (code, _, err) = run_usher(&[
        "proxy",
        "--routes",
        routes.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, 69, "{err}");
    assert!(err.contains(&format!("cannot listen on {addr} (upstream listener)")), "{err}");
}

/// A route without `upstream` is served on the main listener only (forward
/// proxy style). A file whose upstream listener no route names could only
/// answer 403 there: `usher check` and start-up refuse it at that `listen`,
/// naming the route to add `upstream:` to. The same route beside one that
/// names the upstream is a forward proxy's, and is kept.
#[test]
fn an_upstream_listener_no_route_names_is_refused_and_forward_proxy_routes_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let text = "upstreams:\n\
                \x20 llm: { url: http://llm.test, listen: 127.0.0.1:0 }\n\
                resources:\n\
                \x20 calls: { kind: rate, capacity: 5/s }\n\
                routes:\n\
                \x20 - name: chat\n\
                \x20   resources: [calls]\n";
    let bad = write_file(dir.path(), "bad.yaml", text);
    let file = bad.to_str().unwrap();
    for args in [
        vec!["check", file],
        vec!["proxy", "--routes", file, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
    ] {
        let (code, _, err) = run_usher(&args);
        assert_eq!(code, 64, "{args:?}: {err}");
        let want = format!(
            "{file}:2:40: upstreams.llm.listen: no route has `upstream: llm`, so every request on this listener \
             would get 403 (no-route) (hint: add `upstream: llm` to route `chat` (line 6): a route without \
             `upstream` serves only the main listener)"
        );
        assert!(err.contains(&want), "{args:?}: missing {want:?} in:\n{err}");
    }
    let good = write_file(dir.path(), "good.yaml", &format!("{text}  - {{ name: llm, upstream: llm }}\n"));
    let (code, out, err) = run_usher(&["check", good.to_str().unwrap()]);
    assert_eq!(code, 0, "a route without upstream beside one naming it is valid:\n{out}{err}");
}
