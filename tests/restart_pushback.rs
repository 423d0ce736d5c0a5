//! Promises a sidecar keeps across a restart and an upstream's pushback
//! (issue 14 item 8), measured with real processes: `usher server` and
//! `usher proxy` binaries, counting upstreams on 127.0.0.1, load from this
//! test. Each test prints its figures (`figures:` lines) before it asserts,
//! for benches/RESULTS.md.

mod support;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::load::{Tally, drive_recorded};
use support::upstream::Upstream;
use support::{Usher, free_port, http_get, write_file};

/// These tests measure rates in real time: one at a time, so they do not
/// starve each other of the machine's two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn start_server(dir: &Path, config: &str, port: u16) -> Usher {
    Usher::server_at(&write_file(dir, "server.yaml", config), port, &[])
}

/// A routes file: one rate resource `api` (its fields in `resource`) on one upstream.
fn routes(doorman: &str, upstream: std::net::SocketAddr, resource: &str) -> String {
    format!(
        "doorman:\n{doorman}upstreams:\n  up: {{ url: \"http://{upstream}\" }}\n\
         resources:\n  api: {{ kind: rate, {resource} }}\n\
         routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n"
    )
}

/// The scenario: a sidecar with a cache file holds 20/s of a 60/s
/// FAIR_SHARE resource while offered 40/s; the server goes away for good and
/// the sidecar restarts (on the same address, the load never stops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_a_cache_and_a_dead_server_enforces_the_cached_lease_at_once() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = start_server(
        dir.path(),
        "resources:\n  - identifier_glob: '*'\n    capacity: 60\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 10, learning_mode_duration: 0 }\n",
        port,
    );
    let up = Upstream::start().await;
    let cache = dir.path().join("leases.json");
    let doorman =
        format!("  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-r\n  cache_file: {}\n", cache.display());
    // The routes file's capacity (60) is what a sidecar without a lease would enforce.
    let text = routes(
        &doorman,
        up.addr,
        "capacity: 60, burst: 5, wants: auto, max_wants: 20, on_expiry: safe, safe_capacity: 10",
    );
    let routes_file = write_file(dir.path(), "routes.yaml", &text);
    let listen = free_port();
    let mut p = Usher::proxy_at(&routes_file, listen);
    let (lease, burst) = (20.0, 5.0);

    let tally = Arc::new(Tally::default());
    let answers = Arc::new(Mutex::new(Vec::new()));
    let addr = format!("127.0.0.1:{listen}").parse().unwrap();
    let load = tokio::spawn(drive_recorded(addr, 40.0, Duration::from_secs(12), tally.clone(), answers.clone()));
    assert_eventually!(
        std::fs::read_to_string(&cache).is_ok_and(|c| c.contains("\"capacity\": 20.0")),
        Duration::from_secs(10),
        "the lease of 20 is cached"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The server goes away for good; the sidecar crashes and is restarted.
    server.child.kill().unwrap();
    let _ = server.wait_exit(Duration::from_secs(5));
    let killed = Instant::now();
    p.child.kill().unwrap();
    let _ = p.wait_exit(Duration::from_secs(5));
    let p = Usher::proxy_at(&routes_file, listen);
    let listening = killed.elapsed();
    let st = status(&p);
    let watch = Duration::from_secs(6);
    tokio::time::sleep(watch).await;
    let end = killed + watch;

    let worst = up.stats.max_in_window(killed, end, Duration::from_secs(1));
    let gap = up.stats.longest_gap(killed - Duration::from_millis(500), end);
    let after = up.stats.arrivals_between(killed + Duration::from_secs(2), end).len() as f64 / 4.0;
    eprintln!(
        "figures: restart: listening {:.2} s after the kill; worst 1 s window at the upstream {worst} \
         (lease {lease} + burst {burst}); longest pause at the upstream {:.2} s; {after:.1}/s from 2 s to 6 s",
        listening.as_secs_f64(),
        gap.as_secs_f64()
    );
    eprintln!("figures: restart: log:\n{}", p.log());

    assert!(
        worst as f64 <= lease + burst + 1.0,
        "no second above the cached lease plus burst after the restart: {worst}\n{}",
        p.log()
    );
    assert!(gap < Duration::from_secs(1), "no pause at the upstream across the restart: {gap:?}\n{}", p.log());
    assert!(after >= 0.8 * lease, "the restarted sidecar serves its cached lease: {after:.1}/s");

    // What the status page and the log say is what the limiter enforces.
    let key = &st["lease"]["keys"][0];
    assert_eq!(key["mode"], "leased", "{st}");
    assert_eq!(key["source"], "cache", "{st}");
    assert_eq!(key["capacity"]["Limited"], lease, "{st}");
    assert_eq!(st["keys"][0]["capacity"], lease, "the limiter enforces the cached lease: {st}");
    let log = p.log();
    let line = log.lines().find(|l| l.contains("enforcing a cached lease")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("resource_id=api") && line.contains("capacity=20"), "{line}");
    assert!(!log.contains("no lease yet"), "nothing follows on_expiry while the cached lease is valid:\n{log}");
    load.await.unwrap();
}

/// A sidecar whose capacity server never answers: once it stops waiting, the
/// log, the status page and the limiter all say `on_expiry` applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_that_gets_no_answer_says_and_enforces_on_expiry() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // A server that accepts connections and never says a word.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap();
    let _hole = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    let up = Upstream::start().await;
    let doorman = format!("  servers: [\"{hole_addr}\"]\n  client_id: sidecar-h\n");
    let text = routes(&doorman, up.addr, "capacity: 60, on_expiry: safe, safe_capacity: 10");
    let p = Usher::proxy(&write_file(dir.path(), "routes.yaml", &text));
    let st = status(&p);
    let log = p.log();
    eprintln!("figures: no answer: limiter {} with on_expiry safe 10; log:\n{log}", st["keys"][0]["capacity"]);
    let key = &st["lease"]["keys"][0];
    assert_eq!(key["mode"], "pending", "{st}");
    assert_eq!(key["source"], "on_expiry", "{st}");
    assert_eq!(key["capacity"]["Limited"], 10.0, "{st}");
    assert_eq!(st["keys"][0]["capacity"], 10.0, "the limiter enforces on_expiry, not the routes file's 60: {st}");
    let line = log.lines().find(|l| l.contains("no lease yet")).unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains("resource_id=api") && line.contains("on_expiry=safe") && line.contains("capacity=10"),
        "{line}"
    );
}
