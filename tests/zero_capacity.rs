//! A sidecar that enforces 0 says why: at WARN once per key and cause when
//! it first refuses a request for it (a key that idles down to 0 refuses
//! nobody and says so at debug), on its status page and in the 429's
//! problem+json; and servers that are down
//! are logged when the failures start, not at every retry, and once when
//! they answer again.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::time::{Duration, Instant};

use support::{Usher, free_port, http_get, write_file};

/// How many lines of `log` hold every one of `needles`.
fn lines_with(log: &str, needles: &[&str]) -> usize {
    log.lines().filter(|l| needles.iter().all(|n| l.contains(n))).count()
}

#[test]
fn a_key_at_zero_says_why_and_down_servers_are_logged_once_until_they_answer() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on `port` until the server is started on it below.
    let port = free_port();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: zero-test\n\
             \x20 backoff: {{ initial: 20ms, max: 50ms }}\n\
             upstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 5, on_expiry: safe }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n"
        ),
    );
    // Debug lines count the failures the WARN lines leave out.
    let p = Usher::start(
        &["proxy", "--routes", routes.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[("USHER_LOG", "info,usher_lease::failing=debug")],
        "usher proxy listening",
    );
    let why = "no lease yet and no safe capacity";

    // Many failed calls, one WARN line for their start.
    let deadline = Instant::now() + Duration::from_secs(20);
    while lines_with(&p.log(), &["DEBUG", "discovery failed"]) < 10 {
        assert!(Instant::now() < deadline, "too few retries:\n{}", p.log());
        std::thread::sleep(Duration::from_millis(20));
    }

    assert_eq!(lines_with(&p.log(), &["WARN", "capacity of 0"]), 0, "not before it refuses anyone:\n{}", p.log());
    let (code, body) = http_get(p.addr("listen"), "/x");
    assert_eq!(code, 429, "{body}");
    assert_eq!(http_get(p.addr("listen"), "/x").0, 429);
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["zero_capacity_reason"], why, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains(why), "{problem}");

    let (_, st) = http_get(p.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["lease"]["keys"][0]["zero_reason"], why, "{st}");
    let (_, html) = http_get(p.addr("admin"), "/debug/status");
    assert!(html.contains(why), "{html}");

    let log = p.log();
    assert_eq!(lines_with(&log, &["WARN", "discovery failed"]), 1, "{log}");
    assert_eq!(lines_with(&log, &["WARN", "refusing requests", "capacity of 0", "resource_id=api", why]), 1, "{log}");

    // The server comes up: said once, and the key leaves 0.
    let config = write_file(
        dir.path(),
        "resources.yaml",
        "resources:\n  - identifier_glob: \"*\"\n    capacity: 10\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }\n",
    );
    let _server = Usher::server_at(&config, port, &[]);
    p.wait_for_log("discovery answers again", Duration::from_secs(20));
    p.wait_for_log("no longer enforcing 0", Duration::from_secs(20));
    let (_, st) = http_get(p.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["lease"]["keys"][0]["zero_reason"], serde_json::Value::Null, "{st}");
    assert_eq!(st["lease"]["keys"][0]["mode"], "leased", "{st}");
    let log = p.log();
    assert_eq!(lines_with(&log, &["discovery answers again"]), 1, "{log}");
    assert_eq!(lines_with(&log, &["WARN", "capacity of 0"]), 1, "{log}");
    assert_eq!(lines_with(&log, &["INFO", "no longer enforcing 0"]), 1, "it had refused someone: {log}");
}
