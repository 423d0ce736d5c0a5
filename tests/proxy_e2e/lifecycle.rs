//! The sidecar's life: live reloads of the routes file (connections and
//! limiter state kept, a lowered body limit applied at once, bad files
//! refused with the last good routes serving on) and draining in-flight
//! requests on SIGTERM.

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::Duration;

use http::{Request, StatusCode};

use support::upstream::{self, Upstream, get, h1, send1};
use support::{http_get, metric, write_file};

use crate::{replace, start_proxy, within};

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
