//! Which requests go where: unrouted requests get 403 (and the admin pages
//! answer), forward-proxy style and CONNECT tunnels, protocol upgrades that
//! hold their gauge, `default: passthrough`, and a request that would loop.

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::Duration;

use http::{Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::upstream::{self, Upstream, get, h1, send1};
use support::{http_get, metric, write_file};

use crate::{read_head, start_proxy, within};

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
