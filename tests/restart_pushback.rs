//! Promises a sidecar keeps across a restart and an upstream's pushback
//! (issue 14 item 8), measured with real processes: `usher server` and
//! `usher proxy` binaries, counting upstreams on 127.0.0.1, load from this
//! test. Each test prints its figures (`figures:` lines) before it asserts,
//! for benches/RESULTS.md.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::load::{Answer, Tally, drive, drive_recorded};
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
    assert_eq!(key["capacity"], lease, "{st}");
    assert_eq!(st["keys"][0]["capacity"], lease, "the limiter enforces the cached lease: {st}");
    let log = p.log();
    let line = log.lines().find(|l| l.contains("enforcing a cached lease")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("resource_id=api") && line.contains("capacity=20"), "{line}");
    assert!(!log.contains("no lease yet"), "nothing follows on_expiry while the cached lease is valid:\n{log}");
    load.await.unwrap();
}

/// A sidecar stopped gracefully gives its leases back, and so empties its
/// cache: restarted, it asks the server rather than enforcing a lease the
/// server may have handed to someone else meanwhile (it enforced it again,
/// over capacity until its first refresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_empties_the_cache_so_a_restart_asks_the_server() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = start_server(
        dir.path(),
        "resources:\n  - identifier_glob: '*'\n    capacity: 60\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 10, learning_mode_duration: 0 }\n",
        port,
    );
    let up = Upstream::start().await;
    let cache = dir.path().join("leases.json");
    let doorman =
        format!("  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-g\n  cache_file: {}\n", cache.display());
    let text = routes(&doorman, up.addr, "capacity: 60, burst: 5, wants: 20");
    let routes_file = write_file(dir.path(), "routes.yaml", &text);
    let mut p = Usher::proxy(&routes_file);
    assert_eventually!(
        std::fs::read_to_string(&cache).is_ok_and(|c| c.contains("\"capacity\": 20.0")),
        Duration::from_secs(10),
        "the lease of 20 is cached"
    );
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(10)), Some(0), "{}", p.log());
    assert!(p.log().contains("released every lease"), "{}", p.log());
    let cached = std::fs::read_to_string(&cache).unwrap();
    assert!(!cached.contains("\"capacity\""), "no lease left in the cache: {cached}");

    let p = Usher::proxy(&routes_file);
    let st = status(&p);
    assert!(!p.log().contains("enforcing cached leases"), "{}", p.log());
    assert_ne!(st["lease"]["keys"][0]["source"], "cache", "{st}");
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
    assert_eq!(key["capacity"], 10.0, "{st}");
    assert_eq!(st["keys"][0]["capacity"], 10.0, "the limiter enforces on_expiry, not the routes file's 60: {st}");
    let line = log.lines().find(|l| l.contains("no lease yet")).unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains("resource_id=api") && line.contains("on_expiry=safe") && line.contains("capacity=10"),
        "{line}"
    );
}

/// Two sidecars share 100/s; a's upstream answers 429 with `Retry-After: 2`
/// for 2 s. Nothing reaches it during the hold, the next request soon after,
/// usher's own 429s say how long the hold still lasts, and a is back at its
/// previous rate soon after its upstream recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushback_with_retry_after_holds_for_it_then_recovers_the_previous_rate() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = start_server(
        dir.path(),
        "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 2, learning_mode_duration: 0 }\n",
        port,
    );
    let (ua, ub) = (Upstream::start().await, Upstream::start().await);
    let sidecar = |name: &str, up: &Upstream| {
        let doorman =
            format!("  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-{name}\n  min_interval: 500ms\n");
        let text = routes(&doorman, up.addr, "capacity: 100, burst: 5, wants: auto");
        Usher::proxy(&write_file(dir.path(), &format!("{name}.yaml"), &text))
    };
    let (pa, pb) = (sidecar("a", &ua), sidecar("b", &ub));
    // Before any traffic neither wants anything (`wants: auto` without
    // demand asks for 0); both hold some of the spare capacity, and never
    // more than the 100 together.
    let has = |p: &Usher| status(p)["lease"]["keys"][0]["has"].as_f64().unwrap_or(0.0);
    assert_eventually!(
        {
            let (a, b) = (has(&pa), has(&pb));
            a > 0.0 && b > 0.0 && a + b <= 100.0 + 1e-9
        },
        Duration::from_secs(10),
        "both hold a lease of the 100: a {}, b {}",
        has(&pa),
        has(&pb)
    );
    let answers = Arc::new(Mutex::new(Vec::<Answer>::new()));
    let (ta, tb) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let run = Duration::from_secs(14);
    let load_a = tokio::spawn(drive_recorded(pa.addr("listen"), 80.0, run, ta.clone(), answers.clone()));
    let load_b = tokio::spawn(drive(pb.addr("listen"), 80.0, run, tb.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let base_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = ua.stats.arrivals_between(base_from, Instant::now()).len() as f64 / 3.0;

    ua.stats.push_back(Duration::from_secs(2), 2);
    let pushed = Instant::now();
    assert_eventually!(
        ua.stats.arrivals_between(pushed, Instant::now()).iter().any(|(_, s)| *s == 429),
        Duration::from_secs(2),
        "the upstream pushed back"
    );
    let first = ua.stats.arrivals_between(pushed, Instant::now()).iter().find(|(_, s)| *s == 429).unwrap().0;
    let recovered = first + Duration::from_secs(2);
    let hold_st = {
        tokio::time::sleep(Duration::from_millis(300)).await;
        status(&pa)
    };
    tokio::time::sleep((recovered + Duration::from_secs(5)).saturating_duration_since(Instant::now())).await;

    // Everything at a's upstream from 100 ms after its first 429 (requests
    // already admitted by then may still arrive): the first is the probe.
    let later = ua.stats.arrivals_between(first + Duration::from_millis(100), Instant::now());
    let next = later.first().map(|(t, _)| *t - first);
    let rate = |from: Duration, to: Duration| {
        let n = ua.stats.arrivals_between(recovered + from, recovered + to).iter().filter(|(_, s)| *s == 200).count();
        n as f64 / (to - from).as_secs_f64()
    };
    let back_after = (1..=50)
        .map(|i| Duration::from_millis(100 * i))
        .find(|end| *end >= Duration::from_secs(1) && rate(*end - Duration::from_secs(1), *end) >= 0.85 * before);
    let held: Vec<Answer> = answers
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|a| {
            a.status == 429
                && a.sent >= first + Duration::from_millis(100)
                && a.sent < first + Duration::from_millis(1900)
        })
        .collect();
    let retry_afters: Vec<(f64, Option<u64>)> =
        held.iter().map(|a| ((recovered - a.answered).as_secs_f64(), a.retry_after)).collect();
    let per_second: Vec<f64> = (0..5).map(|s| rate(Duration::from_secs(s), Duration::from_secs(s + 1))).collect();
    eprintln!(
        "figures: pushback: before {before:.1}/s; next request at the upstream {:?} after its first 429; \
         back at >= 85% after {:?} of the upstream recovering; per second after: {per_second:.1?}",
        next, back_after
    );
    eprintln!(
        "figures: pushback: usher's 429s during the hold (hold left at the answer, Retry-After): {:.2?}",
        retry_afters.iter().step_by((retry_afters.len() / 8).max(1)).collect::<Vec<_>>()
    );

    let next = next.expect("the upstream saw a request after the hold");
    assert!(
        next >= Duration::from_millis(1950),
        "no request reached the upstream during the hold: one {next:?} after the first 429"
    );
    assert!(next <= Duration::from_millis(2500), "the next request reached the upstream {next:?} after the first 429");
    assert!(!held.is_empty(), "a refused requests during the hold");
    for a in &held {
        let left_at_answer = recovered.saturating_duration_since(a.answered).as_secs_f64();
        let left_at_send = recovered.saturating_duration_since(a.sent).as_secs_f64();
        let ra = a.retry_after.expect("usher's 429 carries Retry-After") as f64;
        assert!(
            ra >= left_at_answer - 0.05 && ra <= left_at_send + 1.25,
            "Retry-After {ra} with {left_at_answer:.2} s of the hold left"
        );
    }
    assert_eq!(hold_st["pushback"][0]["id"], "api", "{hold_st}");
    assert!(hold_st["pushback"][0]["hold_s"].as_f64().unwrap() > 0.0, "the status page shows the hold: {hold_st}");
    let rate_2_3 = rate(Duration::from_secs(2), Duration::from_secs(3));
    let rate_3_5 = rate(Duration::from_secs(3), Duration::from_secs(5));
    assert!(
        rate_2_3 >= 0.85 * before && rate_3_5 >= 0.85 * before,
        "a is back at >= 85% of {before:.1}/s within 3 s of its upstream recovering: {rate_2_3:.1}/s, then {rate_3_5:.1}/s\n{}",
        status(&pa)
    );
    load_a.await.unwrap();
    load_b.await.unwrap();
}
