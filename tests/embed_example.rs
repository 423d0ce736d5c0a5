//! `crates/enforce/examples/axum_limited.rs` end to end: a real `usher server`, the
//! example (an axum service with `usher_enforce::embed`'s layer) leasing from it,
//! and requests to the example. The capacity it enforces is the one the
//! server granted, not the one it asked for; the server sees its lease, and
//! gets it back when the example stops.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{Usher, http_get, metric, write_file};

/// Builds the example (a no-op when it is up to date) and returns its path.
fn example() -> std::path::PathBuf {
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", "usher-enforce", "--example", "axum_limited"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "the example builds");
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples").join("axum_limited")
}

#[test]
fn the_axum_example_enforces_what_a_real_server_leases_it() {
    let dir = tempfile::tempdir().unwrap();
    // 2/s for everyone, no learning mode: the example's first lease is its share.
    let resources = write_file(
        dir.path(),
        "resources.yaml",
        "resources:\n  - identifier_glob: \"*\"\n    capacity: 2\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }\n",
    );
    let server = Usher::server(&["--config", resources.to_str().unwrap()]);
    let grpc = server.addr("grpc");

    let mut child = Command::new(example())
        .args(["--server", &grpc.to_string(), "--listen", "127.0.0.1:0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the example starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr: SocketAddr = line
        .strip_prefix("listening on ")
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    assert!(line.contains("Remote"), "the example leases from the server: {line}");

    // The server granted 2/s (the example asked for 100): 20 quick requests
    // get the burst of 1 and about 2/s, the rest are refused with Retry-After.
    let started = std::time::Instant::now();
    let codes: Vec<u16> = (0..20).map(|_| http_get(addr, "/hello").0).collect();
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = codes.iter().filter(|c| **c == 200).count() as f64;
    let refused = codes.iter().filter(|c| **c == 429).count() as f64;
    assert_eq!(admitted + refused, 20.0, "{codes:?}");
    assert!(admitted >= 1.0 && admitted <= 2.0 + 2.0 * elapsed, "{admitted} admitted in {elapsed:.2} s: {codes:?}");

    // The server holds the example's lease.
    let (_, m) = http_get(server.addr("admin"), "/metrics");
    assert_eq!(metric(&m, "usher_server_resource_has", &[("resource", "hello")]), Some(2.0), "{m}");

    // Closing its stdin stops it; it gives the lease back.
    drop(child.stdin.take());
    assert_eventually!(
        child.try_wait().unwrap().is_some(),
        Duration::from_secs(10),
        "the example stops when its stdin closes"
    );
    assert_eventually!(
        metric(&http_get(server.addr("admin"), "/metrics").1, "usher_server_resource_has", &[("resource", "hello")])
            .unwrap_or(0.0)
            == 0.0,
        Duration::from_secs(5),
        "the example gave its lease back"
    );
}
