//! Upstream pushback through a real `usher proxy` process and a real
//! upstream on 127.0.0.1: what the app sees while the upstream's
//! `Retry-After` holds a resource, and when the hold ends.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::upstream::{self, Upstream, get, h1, send1};
use support::{Usher, write_file};

/// A proxy in front of `up` with one resource `api` of `resource` (YAML flow fields).
fn proxy(dir: &std::path::Path, up: &Upstream, resource: &str) -> Usher {
    let text = upstream::routes(up, "", &format!("    {{ {resource} }}\n"));
    Usher::proxy(&write_file(dir, "routes.yaml", &text))
}

/// A gauge of capacity 1 backed off by the default multiplier (0.5) would
/// admit nothing once the hold ends, until fully recovered 5 s later: it
/// keeps 1, and a request that arrived during a hold shorter than its
/// `max_wait` goes out when the hold ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gauge_of_one_admits_a_request_when_the_hold_ends() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let p = proxy(dir.path(), &up, "kind: gauge, capacity: 1, max_wait: 3s");
    let mut c = h1(p.addr("listen")).await;

    up.stats.push_back(Duration::from_millis(200), 1);
    let r = send1(&mut c, get("app", "/")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "the upstream's own 429: {}", r.text());
    let pushed = Instant::now();

    // Sent during the 1 s hold: it waits for the hold's end, within its 3 s max_wait.
    let r = send1(&mut c, get("app", "/")).await;
    let took = pushed.elapsed();
    assert_eq!(r.status, StatusCode::OK, "admitted when the hold ended: {}\n{}", r.text(), p.log());
    assert!(took < Duration::from_secs(2), "went out at the hold's end (1 s), not at full recovery: {took:?}");

    // Still backed off (factor 0.5), and the gauge enforces 1, not 0.5 rounded down to 0.
    let (_, body) = support::http_get(p.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(st["pushback"][0]["factor"], 0.5, "{st}");
    assert_eq!(st["keys"][0]["capacity"], 1.0, "{st}");
    let r = send1(&mut c, get("app", "/")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
}

/// A request that arrives while the upstream's `Retry-After` holds its
/// resource past its `max_wait` is refused at once, and the 429 says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_longer_than_max_wait_is_refused_at_once_naming_the_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    for resource in ["kind: gauge, capacity: 3, max_wait: 1s", "kind: rate, capacity: 50/s, max_wait: 1s"] {
        let p = proxy(dir.path(), &up, resource);
        let mut c = h1(p.addr("listen")).await;
        up.stats.push_back(Duration::from_millis(200), 3);
        let r = send1(&mut c, get("app", "/")).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "the upstream's own 429: {}", r.text());

        let asked = Instant::now();
        let r = send1(&mut c, get("app", "/")).await;
        let took = asked.elapsed();
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{resource}: {}", r.text());
        assert!(took < Duration::from_millis(500), "{resource}: refused at once, not after max_wait: {took:?}");
        let body = r.json();
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.contains("upstream asked to wait (Retry-After)"), "{resource}: {detail}");
        assert!(detail.contains("longer than max_wait 1000ms"), "{resource}: {detail}");
        let hold = body["upstream_hold_ms"].as_u64().unwrap();
        assert!((2000..=3000).contains(&hold), "{resource}: {body}");
        assert_eq!(body["waited_ms"], 0, "{body}");
        assert_eq!(r.header("retry-after"), "3", "{resource}: the rest of the hold, rounded up");
    }
}
