//! The sidecar leasing from real capacity servers: `usher server` and
//! `usher proxy` processes, counting upstreams on 127.0.0.1:0, load from
//! this test.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::load::{Tally, drive};
use support::upstream::{Upstream, get, h1, routes, send1};
use support::{Usher, free_port, http_get, write_file};

/// These tests measure rates in real time: run them one at a time so they
/// do not starve each other of the machine's two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn start_server(dir: &Path, name: &str, config: &str, port: u16) -> Usher {
    Usher::server_at(&write_file(dir, &format!("{name}.yaml"), config), port, &[])
}

fn start_proxy(dir: &Path, name: &str, routes: &str) -> Usher {
    let p = write_file(dir, &format!("{name}.yaml"), routes);
    Usher::proxy(&p)
}

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

const FAIR: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 2, learning_mode_duration: 0 }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_split_a_fair_share_and_follow_a_demand_shift() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start_server(dir.path(), "server", FAIR, port);
    let (ua, ub) = (Upstream::start().await, Upstream::start().await);
    // max_wait 40 ms: a clump of arrivals (the load generator on a loaded
    // machine) waits for its slots instead of being refused beyond the burst,
    // which lost a's rate below its lease (82.3/s with a lease of 100 once);
    // it is under the load's 80 ms per connection, so it never slows the load.
    let res = "    kind: rate\n    capacity: 100\n    burst: 5\n    max_wait: 40ms\n    wants: auto\n";
    let doorman =
        |id: &str| format!("doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {id}\n  min_interval: 500ms\n");
    let pa = start_proxy(dir.path(), "a", &routes(&ua, &doorman("sidecar-a"), res));
    let pb = start_proxy(dir.path(), "b", &routes(&ub, &doorman("sidecar-b"), res));
    let (ta, tb) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let load_a = tokio::spawn(drive(pa.addr("listen"), 200.0, Duration::from_secs(25), ta.clone()));
    let load_b = tokio::spawn(drive(pb.addr("listen"), 200.0, Duration::from_secs(12), tb.clone()));
    // Let the leases settle, then measure 5 s at the upstreams.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (a0, b0) = (ua.stats.requests(), ub.stats.requests());
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let secs = t0.elapsed().as_secs_f64();
    let (ra, rb) = ((ua.stats.requests() - a0) as f64 / secs, (ub.stats.requests() - b0) as f64 / secs);
    assert!(
        (ra - 50.0).abs() <= 2.5 && (rb - 50.0).abs() <= 2.5,
        "each sidecar admits 50/s ± 5%: a {ra:.1}/s, b {rb:.1}/s\n{}",
        status(&pa)
    );
    assert!(ra + rb <= 100.0 + 10.0 / secs + 1e-9, "the total stays within capacity + burst: {:.1}/s", ra + rb);
    load_b.await.unwrap();
    // b goes idle: b's next refresh reads its fallen demand and gives its
    // share back (or the one after, if its measured demand has not yet
    // fallen 5% below its lease), and a's next refresh takes it: within three
    // refresh intervals (2 s, + 1/6 jitter each; 2.5-4.5 s in five runs). Then
    // a admits ≥ 95/s.
    let idle = Instant::now();
    let lease_a = || status(&pa)["lease"]["keys"][0]["has"].as_f64().unwrap_or(0.0);
    while lease_a() < 95.0 {
        assert!(idle.elapsed() < Duration::from_millis(7000), "a's lease after b went idle: {}", status(&pa));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("figures: a's lease reached {} {:?} after b went idle", lease_a(), idle.elapsed());
    let a1 = ua.stats.requests();
    let t1 = Instant::now();
    // 4 s (load a runs until 25 s), so one stall of the load weighs less.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let ra = (ua.stats.requests() - a1) as f64 / t1.elapsed().as_secs_f64();
    assert!(ra >= 95.0, "a takes over the idle share: {ra:.1}/s\n{}", status(&pa));
    load_a.await.unwrap();
    for t in [&ta, &tb] {
        assert_eq!(t.other.load(Ordering::Relaxed), 0, "the app sees only 200 and 429");
    }
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_mode_admits_the_first_requests() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let p = start_proxy(dir.path(), "p", &routes(&up, "", "    kind: rate\n    capacity: 20\n    burst: 5\n"));
    let mut c = h1(p.addr("listen")).await;
    for i in 0..5 {
        let got = send1(&mut c, get("app.local", "/x")).await;
        assert_eq!(got.status, 200, "request {i} of a fresh sidecar is admitted: {}", got.text());
    }
    let mut leased = false;
    for _ in 0..50 {
        let st = status(&p);
        if st["lease"]["master"] == "embedded" && st["lease"]["keys"][0]["mode"] == "leased" {
            assert_eq!(st["lease"]["keys"][0]["has"], 20.0);
            leased = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(leased, "the embedded server leased the capacity: {}", status(&p));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_over_to_the_second_server_and_releases_on_sigterm() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start_server(dir.path(), "server", FAIR, port);
    let up = Upstream::start().await;
    let dead = free_port();
    let doorman =
        format!("doorman:\n  servers: [\"127.0.0.1:{dead}\", \"127.0.0.1:{port}\"]\n  client_id: sidecar-f\n");
    let mut p =
        start_proxy(dir.path(), "p", &routes(&up, &doorman, "    kind: rate\n    capacity: 30\n    wants: 30\n"));
    let mut ok = false;
    for _ in 0..100 {
        let st = status(&p);
        // What it wants, or more: below the capacity the server hands out spare too.
        let has = st["lease"]["keys"][0]["has"].as_f64().unwrap_or(0.0);
        if st["lease"]["master"] == format!("127.0.0.1:{port}") && has >= 30.0 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the second server is used: {}", status(&p));
    let (_, body) = http_get(server.addr("admin"), "/debug/resources?resource=api&format=json");
    assert!(body.contains("sidecar-f"), "{body}");

    // SIGTERM under load: in-flight requests finish, then the lease is released.
    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive(p.addr("listen"), 100.0, Duration::from_secs(2), tally.clone()));
    tokio::time::sleep(Duration::from_millis(700)).await;
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(20)), Some(0), "{}", p.log());
    let _ = load.await;
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "no request that was answered failed");
    assert!(p.log().contains("released every lease"), "{}", p.log());
    let (code, body) = http_get(server.addr("admin"), "/debug/resources?resource=api&format=json");
    assert!(code == 404 || !body.contains("sidecar-f"), "the server no longer holds the lease: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_loss_holds_the_lease_then_falls_back_to_safe_capacity_and_recovers() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = "resources:\n  - identifier_glob: '*'\n    capacity: 40\n    safe_capacity: 5\n    algorithm: { kind: FAIR_SHARE, lease_length: 4, refresh_interval: 1, learning_mode_duration: 4 }\n";
    let mut server = start_server(
        dir.path(),
        "server",
        &config.replace("learning_mode_duration: 4", "learning_mode_duration: 0"),
        port,
    );
    let up = Upstream::start().await;
    let doorman = format!(
        "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-s\n  min_interval: 200ms\n  backoff: {{ initial: 200ms, max: 1s }}\n"
    );
    let p = start_proxy(
        dir.path(),
        "p",
        &routes(&up, &doorman, "    kind: rate\n    capacity: 40\n    burst: 2\n    wants: 40\n    on_expiry: safe\n"),
    );
    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive(p.addr("listen"), 100.0, Duration::from_secs(24), tally.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Lease: ~40/s at the upstream.
    let r = rate_over(&up, Duration::from_secs(2)).await;
    assert!((r - 40.0).abs() <= 4.0, "leased rate {r:.1}/s");
    server.child.kill().unwrap();
    let killed = Instant::now();
    // The lease is honoured until it expires (4 s), then held for another
    // lease length (the server keeps it reserved), then safe mode: 5/s.
    // Rates are counted over fixed windows from the kill, by arrival time at
    // the upstream, so a loaded machine that reads them late cannot shorten
    // a window into noise.
    tokio::time::sleep(Duration::from_millis(4400).saturating_sub(killed.elapsed())).await;
    let mode = status(&p)["lease"]["keys"][0]["mode"].clone();
    let read_at = killed.elapsed();
    let rate = |from: Duration, to: Duration| {
        up.stats.arrivals_between(killed + from, killed + to).len() as f64 / (to - from).as_secs_f64()
    };
    let r = rate(Duration::ZERO, Duration::from_secs(2));
    assert!(r >= 36.0, "still the lease while it is valid: {r:.1}/s");
    // The lease (valid for up to 4 s, granted within a refresh before the
    // kill) has expired by 4.4 s, and its hold lasts as long again: still
    // the whole rate, not the 5/s an expired lease would give.
    let r = rate(Duration::from_secs(2), Duration::from_millis(4400));
    assert!(r >= 34.0, "the held lease is enforced: {r:.1}/s\n{}", status(&p));
    // The status said so, when it was read on time (the transition counts below say so in any case).
    if read_at < Duration::from_millis(4800) {
        assert_eq!(mode, "held", "read {read_at:?} after the kill\n{}", status(&p));
    }
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(killed.elapsed())).await;
    let r = rate_over(&up, Duration::from_secs(3)).await;
    assert!((r - 5.0).abs() <= 1.5, "safe capacity after the hold: {r:.1}/s\n{}", status(&p));
    assert_eq!(status(&p)["lease"]["keys"][0]["mode"], "expired");
    let (_, metrics) = http_get(p.addr("admin"), "/metrics");
    for (from, to) in [("leased", "held"), ("held", "expired")] {
        assert_eq!(
            support::metric(
                &metrics,
                "usher_lease_transitions_total",
                &[("resource_id", "api"), ("from", from), ("to", to)]
            ),
            Some(1.0),
            "the transition {from} -> {to} is counted"
        );
    }
    // The server comes back (learning mode): the lease returns.
    let _server2 = start_server(dir.path(), "server2", config, port);
    let mut back = false;
    for _ in 0..60 {
        if status(&p)["lease"]["keys"][0]["mode"] == "leased" {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "the lease comes back: {}", status(&p));
    load.await.unwrap();
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "the app saw no 5xx at any point");
}

async fn rate_over(up: &Upstream, d: Duration) -> f64 {
    let n0 = up.stats.requests();
    let t0 = Instant::now();
    tokio::time::sleep(d).await;
    (up.stats.requests() - n0) as f64 / t0.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_enforces_its_cached_lease_and_reports_it() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let learning = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 5, learning_mode_duration: 30 }\n";
    let mut server = start_server(
        dir.path(),
        "server",
        &learning.replace("learning_mode_duration: 30", "learning_mode_duration: 0"),
        port,
    );
    let up = Upstream::start().await;
    let cache = dir.path().join("leases.json");
    let doorman = format!(
        "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-c\n  cache_file: {}\n",
        cache.display()
    );
    let text = routes(&up, &doorman, "    kind: rate\n    capacity: 10\n    wants: 40\n    on_expiry: pessimistic\n");
    let mut p = start_proxy(dir.path(), "p", &text);
    assert_eventually!(
        std::fs::read_to_string(&cache).is_ok_and(|c| c.contains("\"capacity\": 40.0")),
        Duration::from_secs(10),
        "the lease is cached"
    );
    // The sidecar and the server both die; a fresh server starts in learning mode.
    p.child.kill().unwrap();
    let _ = p.wait_exit(Duration::from_secs(5));
    server.child.kill().unwrap();
    let _ = server.wait_exit(Duration::from_secs(5));
    let server = start_server(dir.path(), "server2", learning, port);
    let p = start_proxy(dir.path(), "p2", &text);
    let st = status(&p);
    assert_eq!(st["lease"]["keys"][0]["mode"], "leased", "the cached lease is enforced at once: {st}");
    assert_eq!(st["lease"]["keys"][0]["has"], 40.0);
    assert!(p.log().contains("enforcing cached leases"), "{}", p.log());
    // Its first refresh presents the cached lease as `has`; learning mode hands it back.
    assert_eventually!(
        {
            let (_, body) = http_get(server.addr("admin"), "/debug/resources?resource=api&format=json");
            body.contains("sidecar-c") && body.contains("\"has\": 40.0")
        },
        Duration::from_secs(10),
        "the server sees the cached has"
    );
}

/// Requests `u` answered with 200 over the next `d`, per second.
async fn ok_rate(u: &Upstream, d: Duration) -> f64 {
    let t0 = Instant::now();
    tokio::time::sleep(d).await;
    let ok = u.stats.arrivals_between(t0, Instant::now()).iter().filter(|(_, s)| *s == 200).count();
    ok as f64 / t0.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_pushback_frees_the_lease_for_the_other_sidecar() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = start_server(dir.path(), "server", FAIR, port);
    let (ua, ub) = (Upstream::start().await, Upstream::start().await);
    let text = |u: &Upstream, id: &str| {
        format!(
            "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {id}\n  min_interval: 500ms\n\
             upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 100, burst: 5, wants: auto }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api], pushback: {{ recover_after: 5 }} }}\n",
            u.addr
        )
    };
    let pa = start_proxy(dir.path(), "a", &text(&ua, "sidecar-a"));
    let pb = start_proxy(dir.path(), "b", &text(&ub, "sidecar-b"));
    let (ta, tb) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let load_a = tokio::spawn(drive(pa.addr("listen"), 200.0, Duration::from_secs(32), ta.clone()));
    let load_b = tokio::spawn(drive(pb.addr("listen"), 200.0, Duration::from_secs(32), tb.clone()));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (ra, rb) = (ok_rate(&ua, Duration::from_secs(2)).await, ok_rate(&ub, Duration::from_secs(2)).await);
    assert!((ra - 50.0).abs() <= 7.5 && (rb - 50.0).abs() <= 7.5, "fair before: a {ra:.1}/s, b {rb:.1}/s");

    // a's upstream pushes back for 8 s, saying so. (A hold shorter than
    // getting the lease back, 3.3 s here, keeps it: tests/restart_pushback.rs.)
    ua.stats.push_back(Duration::from_secs(8), 8);
    let pushed_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let st = status(&pa);
    assert!(!st["pushback"].as_array().unwrap().is_empty(), "a shows its pushback: {st}");
    let wants_a = st["lease"]["keys"][0]["wants"].as_f64().unwrap();
    assert!(wants_a < 50.0, "a asks for less while pushed back: {wants_a}");
    // b's lease grows to what a freed, within the pushback period (8 s): a
    // asks for less at once, and b is answered at its next refresh (2 s
    // apart, ± jitter), or at an early one.
    let mut b_has = 0.0;
    while pushed_at.elapsed() < Duration::from_millis(6000) {
        b_has = status(&pb)["lease"]["keys"][0]["has"].as_f64().unwrap();
        if b_has >= 90.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(b_has >= 90.0, "b picks up the capacity a freed: has {b_has}\n{}", status(&pb));
    let rb = ok_rate(&ub, Duration::from_millis(1400)).await;
    assert!(
        rb >= 80.0,
        "b admits what it was given: {rb:.1}/s\n{}\nb tally: ok {} refused {}",
        status(&pb),
        tb.ok.load(Ordering::Relaxed),
        tb.refused.load(Ordering::Relaxed)
    );
    // Both recover, once a's upstream stopped pushing back (after 8 s).
    tokio::time::sleep(Duration::from_secs(12).saturating_sub(pushed_at.elapsed())).await;
    let (ra, rb) = (ok_rate(&ua, Duration::from_secs(3)).await, ok_rate(&ub, Duration::from_secs(3)).await);
    assert!(
        (ra - 50.0).abs() <= 7.5 && (rb - 50.0).abs() <= 7.5,
        "fair again after: a {ra:.1}/s, b {rb:.1}/s\n{}",
        status(&pa)
    );
    let (_, metrics) = http_get(pa.addr("admin"), "/metrics");
    assert!(support::metric(&metrics, "usher_proxy_pushback_total", &[("resource_id", "api")]).unwrap_or(0.0) >= 1.0);
    load_a.await.unwrap();
    load_b.await.unwrap();
}

/// A capacity server (FAIR) and a sidecar leasing from it, as `client_id`,
/// the templated resource `api` (`tenant/{header.x-tenant}`, 10 a key),
/// with `extra` lines added to the resource.
struct Tenants {
    server: Usher,
    proxy: Usher,
    client_id: String,
    _up: Upstream,
    _dir: tempfile::TempDir,
}

impl Tenants {
    async fn start(client_id: &str, extra: &str) -> Tenants {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let server = start_server(dir.path(), "server", FAIR, port);
        let up = Upstream::start().await;
        let doorman =
            format!("doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {client_id}\n  min_interval: 200ms\n");
        let res =
            format!("    kind: rate\n    id: \"tenant/{{header.x-tenant}}\"\n    capacity: 10\n    wants: 10\n{extra}");
        let proxy = start_proxy(dir.path(), "p", &routes(&up, &doorman, &res));
        Tenants { server, proxy, client_id: client_id.into(), _up: up, _dir: dir }
    }

    /// A request of `tenant`'s.
    fn request(tenant: &str) -> http::Request<support::upstream::TestBody> {
        http::Request::get("/x")
            .header("host", "app.local")
            .header("x-tenant", tenant)
            .body(support::upstream::empty())
            .unwrap()
    }

    /// Whether the server holds a lease of `tenant`'s key for the sidecar.
    fn held(&self, tenant: &str) -> bool {
        let (code, body) =
            http_get(self.server.addr("admin"), &format!("/debug/resources?resource=tenant/{tenant}&format=json"));
        code == 200 && body.contains(&self.client_id)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_templated_keys_are_released_and_forgotten() {
    let _serial = SERIAL.lock().await;
    let t = Tenants::start("sidecar-t", "    key_idle_timeout: 1s\n").await;
    let p = &t.proxy;
    let mut c = h1(p.addr("listen")).await;
    assert_eq!(send1(&mut c, Tenants::request("acme")).await.status, 200);
    assert_eventually!(t.held("acme"), Duration::from_secs(5), "the new key is leased");
    // No more requests for that tenant: after the idle timeout the key is released and forgotten.
    assert_eventually!(!t.held("acme"), Duration::from_secs(6), "the idle key's lease is released");
    let keys = status(p)["keys"].as_array().unwrap().len();
    assert_eq!(keys, 0, "the key is forgotten: {}", status(p));
    // The key's events are at debug; the info log counts them in one line.
    p.wait_for_log("templated keys", Duration::from_secs(15));
    let log = p.log();
    let line = log.lines().find(|l| l.contains("templated keys")).expect("the summary");
    let f = support::log_fields(line);
    let counts = ["made", "leased", "forgotten", "keys"].map(|k| f.get(k).map_or("", String::as_str));
    assert_eq!(counts, ["1", "1", "1", "0"], "{line}");
    assert!(!log.contains("tenant/acme"), "no info line names the key:\n{log}");
}

/// A request whose header would make a lease id longer than capacity
/// servers accept is refused (400, naming the resource) instead of making a
/// key: that id in the sidecar's GetCapacity had the server refuse every
/// call, and every key of the sidecar lost its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_too_long_for_a_lease_id_is_refused_and_other_keys_keep_their_leases() {
    let _serial = SERIAL.lock().await;
    let t = Tenants::start("sidecar-l", "").await;
    let p = &t.proxy;
    let mut c = h1(p.addr("listen")).await;
    assert_eq!(send1(&mut c, Tenants::request("acme")).await.status, 200);
    assert_eventually!(t.held("acme"), Duration::from_secs(5), "the first key is leased");
    let long = "A".repeat(2000);
    let refused = send1(&mut c, Tenants::request(&long)).await;
    assert_eq!(refused.status, 400);
    let body = String::from_utf8_lossy(&refused.body);
    assert!(body.contains("resource `api`") && body.contains("2007 bytes") && body.contains("1024"), "{body}");
    // A tenant made after it is leased, and the lease client reports no error.
    assert_eq!(send1(&mut c, Tenants::request("globex")).await.status, 200);
    assert_eventually!(t.held("globex"), Duration::from_secs(5), "a later key is leased: {}", status(p));
    assert!(t.held("acme"));
    assert!(status(p)["last_error"].is_null(), "{}", status(p));
    assert!(!t.server.log().contains("at most 1024"), "{}", t.server.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_that_wakes_up_reaches_its_share_within_two_seconds() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = start_server(dir.path(), "server", FAIR, port);
    let (ua, ub) = (Upstream::start().await, Upstream::start().await);
    let res = "    kind: rate\n    capacity: 100\n    burst: 5\n    wants: auto\n";
    let doorman =
        |id: &str| format!("doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {id}\n  min_interval: 500ms\n");
    let pa = start_proxy(dir.path(), "a", &routes(&ua, &doorman("wake-a"), res));
    let pb = start_proxy(dir.path(), "b", &routes(&ub, &doorman("wake-b"), res));
    let (ta, tb) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let load_a = tokio::spawn(drive(pa.addr("listen"), 200.0, Duration::from_secs(16), ta.clone()));
    drive(pb.addr("listen"), 200.0, Duration::from_secs(3), tb.clone()).await;
    // b goes idle: its wants fall to 0 and a takes nearly everything.
    let has = |p: &Usher| status(p)["lease"]["keys"][0]["has"].as_f64().unwrap_or(0.0);
    assert_eventually!(has(&pb) < 10.0 && has(&pa) > 90.0, Duration::from_secs(8), "idle b gives its share to a");
    // b wakes up with 200/s: refusals trigger an early refresh, and it reaches its share within 2 s.
    let woke = Instant::now();
    let load_b = tokio::spawn(drive(pb.addr("listen"), 200.0, Duration::from_secs(4), tb.clone()));
    let mut reached = None;
    while woke.elapsed() < Duration::from_secs(3) {
        if has(&pb) >= 45.0 {
            reached = Some(woke.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = reached.unwrap_or_else(|| panic!("b never reached its share: {}", status(&pb)));
    assert!(took <= Duration::from_secs(2), "b reached its share after {took:?}");
    load_b.await.unwrap();
    load_a.await.unwrap();
}

/// A reload that changes a templated resource's kind rebuilds it and drops
/// its keys (their leases are released). A request that makes a key anew
/// gets it leased again, whatever its demand was before: the lease client
/// hears only of keys whose demand moved, and this one's did not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_made_anew_after_a_reload_rebuilt_its_resource_is_leased_again() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // The server grants 4 of the 10 each key wants: a key left out of the
    // lease client's demand would run at its file's 10 instead.
    let server = start_server(dir.path(), "server", &FAIR.replace("capacity: 100", "capacity: 4"), port);
    let up = Upstream::start().await;
    let doorman =
        format!("doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: sidecar-r\n  min_interval: 200ms\n");
    let res = |kind: &str| {
        format!(
            "    kind: {kind}\n    id: \"tenant/{{header.x-tenant}}\"\n    capacity: 10\n    wants: 10\n    key_idle_timeout: 60s\n"
        )
    };
    let path = write_file(dir.path(), "p.yaml", &routes(&up, &doorman, &res("rate")));
    let p = Usher::proxy(&path);
    let acme = || {
        http::Request::get("/x")
            .header("host", "app.local")
            .header("x-tenant", "acme")
            .body(support::upstream::empty())
            .unwrap()
    };
    let mut c = h1(p.addr("listen")).await;
    assert_eq!(send1(&mut c, acme()).await.status, 200);
    let held = || {
        let (code, body) = http_get(server.addr("admin"), "/debug/resources?resource=tenant/acme&format=json");
        code == 200 && body.contains("sidecar-r")
    };
    let key =
        || status(&p)["lease"]["keys"].as_array().unwrap().iter().find(|k| k["resource_id"] == "tenant/acme").cloned();
    let leased = || key().is_some_and(|k| k["mode"] == "leased" && k["has"] == 4.0);
    assert_eventually!(held() && leased(), Duration::from_secs(5), "the key is leased: {:?}", key());

    // Same wants, another kind: the resource is rebuilt, its key dropped and released.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, routes(&up, &doorman, &res("gauge"))).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    p.wait_for_log("routes reloaded", Duration::from_secs(20));
    assert_eventually!(!held(), Duration::from_secs(5), "the rebuilt resource's key is released");

    // The tenant comes back: its key is made anew and leased again.
    let mut c = h1(p.addr("listen")).await;
    let r = send1(&mut c, acme()).await;
    assert_eq!(r.status, 200, "{:?} {}", r.body, status(&p));
    assert_eventually!(held() && leased(), Duration::from_secs(5), "the key made anew is leased again: {:?}", key());

    // A new tenant's first request is admitted at the file's capacity, not
    // refused at `on_expiry` (safe, 0 here) when the lease client reads the
    // new key before the request is admitted: its lease is a round trip away.
    for i in 0..20 {
        let req = http::Request::get("/x")
            .header("host", "app.local")
            .header("x-tenant", format!("new-{i}"))
            .body(support::upstream::empty())
            .unwrap();
        let r = send1(&mut c, req).await;
        assert_eq!(r.status, 200, "tenant new-{i}: {:?}", r.body);
    }
}

/// What the fake capacity server answers to GetCapacity.
#[derive(Clone, Debug, PartialEq)]
enum Answer {
    /// A lease of 100 for every resource.
    Good,
    /// By resource: `nan`, `inf`, `neg` a capacity NaN, +inf, -5; `safe` a
    /// safe capacity NaN; `dup` two leases (5, then 999); the rest good.
    Malformed,
    /// Only a mastership redirect to this address.
    Redirect(String),
}

/// A Doorman server that answers as `answer` says, master of itself.
#[derive(Clone)]
struct FakeDoorman {
    addr: String,
    answer: Arc<std::sync::Mutex<Answer>>,
}

impl FakeDoorman {
    async fn start(answer: Answer) -> FakeDoorman {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = FakeDoorman {
            addr: listener.local_addr().unwrap().to_string(),
            answer: Arc::new(std::sync::Mutex::new(answer)),
        };
        let svc = usher_proto::capacity_server::CapacityServer::new(fake.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        fake
    }

    fn answer(&self, a: Answer) {
        *self.answer.lock().unwrap() = a;
    }
}

#[tonic::async_trait]
impl usher_proto::capacity_server::Capacity for FakeDoorman {
    async fn discovery(
        &self,
        _: tonic::Request<usher_proto::DiscoveryRequest>,
    ) -> Result<tonic::Response<usher_proto::DiscoveryResponse>, tonic::Status> {
        Ok(tonic::Response::new(usher_proto::DiscoveryResponse {
            mastership: usher_proto::Mastership { master_address: Some(self.addr.clone()) },
            is_master: true,
        }))
    }

    async fn get_capacity(
        &self,
        req: tonic::Request<usher_proto::GetCapacityRequest>,
    ) -> Result<tonic::Response<usher_proto::GetCapacityResponse>, tonic::Status> {
        use usher_proto::{GetCapacityResponse, Lease, Mastership, ResourceResponse};
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        let lease = |id: &str, capacity: f64, safe_capacity: Option<f64>| ResourceResponse {
            pooled: None,
            bucket: None,
            allotment: None,
            credit: None,
            resource_capacity: None,
            spare: None,
            share_safe: None,
            fresh: None,
            upstream_quota: None,
            resource_id: id.into(),
            // 3 s, asked again every second: a refused lease runs out soon.
            gets: Lease { expiry_time: now + 3, refresh_interval: 1, capacity },
            safe_capacity,
            template: None,
        };
        let answer = self.answer.lock().unwrap().clone();
        let mut response = Vec::new();
        for r in &req.get_ref().resource {
            let id = r.resource_id.as_str();
            match (&answer, id) {
                (Answer::Redirect(to), _) => {
                    let mastership = Some(Mastership { master_address: Some(to.clone()) });
                    return Ok(tonic::Response::new(GetCapacityResponse { response: vec![], mastership }));
                }
                (Answer::Malformed, "nan") => response.push(lease(id, f64::NAN, None)),
                (Answer::Malformed, "inf") => response.push(lease(id, f64::INFINITY, None)),
                (Answer::Malformed, "neg") => response.push(lease(id, -5.0, None)),
                (Answer::Malformed, "safe") => response.push(lease(id, 100.0, Some(f64::NAN))),
                (Answer::Malformed, "dup") => response.extend([lease(id, 5.0, None), lease(id, 999.0, None)]),
                _ => response.push(lease(id, 100.0, None)),
            }
        }
        Ok(tonic::Response::new(GetCapacityResponse { response, mastership: None }))
    }

    async fn get_server_capacity(
        &self,
        _: tonic::Request<usher_proto::GetServerCapacityRequest>,
    ) -> Result<tonic::Response<usher_proto::GetServerCapacityResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("a fake for sidecars"))
    }

    async fn release_capacity(
        &self,
        _: tonic::Request<usher_proto::ReleaseCapacityRequest>,
    ) -> Result<tonic::Response<usher_proto::ReleaseCapacityResponse>, tonic::Status> {
        Ok(tonic::Response::new(usher_proto::ReleaseCapacityResponse::default()))
    }
}

/// A capacity server that answers malformed leases (capacity NaN, +inf or
/// negative, safe capacity NaN, a resource twice): the sidecar refuses each
/// for its resource, logs it naming the server, shows it on the status page,
/// and goes on with the lease it had until it runs out (and is held), then
/// with `on_expiry`; a redirect to another master is logged and followed,
/// and that master's good leases clear the errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_leases_from_a_server_are_refused_and_shown() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (FakeDoorman::start(Answer::Good).await, FakeDoorman::start(Answer::Good).await);
    let up = Upstream::start().await;
    let ids = ["nan", "inf", "neg", "safe", "dup", "fine"];
    let mut yaml = format!(
        "doorman:\n  servers: [\"{}\"]\n  client_id: sidecar-m\n  min_interval: 200ms\n\
         upstreams:\n  up: {{ url: \"http://{}\" }}\nresources:\n",
        a.addr, up.addr
    );
    for id in ids {
        yaml += &format!("  {id}: {{ kind: rate, capacity: 100/s, wants: 50, on_expiry: pessimistic }}\n");
    }
    yaml += "routes:\n";
    for id in ids {
        yaml += &format!("  - {{ name: {id}, match: {{ path_prefix: /{id} }}, upstream: up, resources: [{id}] }}\n");
    }
    let p = Usher::proxy(&write_file(dir.path(), "p.yaml", &yaml));
    let key = |id: &str| {
        status(&p)["lease"]["keys"].as_array().unwrap().iter().find(|k| k["resource_id"] == id).cloned().unwrap()
    };
    let leased = |id: &str| {
        let k = key(id);
        k["mode"] == "leased" && k["has"] == 100.0 && k["last_error"].is_null()
    };
    let mut c = h1(p.addr("listen")).await;
    assert_eventually!(ids.iter().all(|id| leased(id)), Duration::from_secs(10), "leased: {}", status(&p));

    a.answer(Answer::Malformed);
    let refused = |id: &str, why: &str| {
        let e = key(id)["last_error"].as_str().unwrap_or_default().to_string();
        e == format!("lease for `{id}` from {} refused: {why}", a.addr)
    };
    let finite = "gets.capacity must be a finite number >= 0, got";
    let expected = [
        ("nan", format!("{finite} NaN")),
        ("inf", format!("{finite} inf")),
        ("neg", format!("{finite} -5")),
        ("safe", "safe_capacity must be -1 (unlimited), 0 (stop) or a positive capacity, got NaN".to_string()),
        ("dup", "resource `dup` appears more than once in one answer".to_string()),
    ];
    assert_eventually!(
        expected.iter().all(|(id, why)| refused(id, why)),
        Duration::from_secs(5),
        "every malformed lease is refused: {}",
        status(&p)
    );
    let s = status(&p);
    assert!(s["lease"]["last_error"].as_str().is_some_and(|e| e.contains("refused")), "{s}");
    // Each keeps the lease it had (leased or, past its expiry, held): its requests pass.
    for (id, _) in &expected {
        let k = key(id);
        assert!(k["mode"] == "leased" || k["mode"] == "held", "{id}: {k}");
        assert_eq!(k["has"], 100.0, "{id}: the lease it had, not 999 or 0: {k}");
        assert_eq!(send1(&mut c, get("app", &format!("/{id}"))).await.status, 200, "{id}: {}", status(&p));
    }
    assert!(leased("fine"), "the good lease in the same answer is taken: {}", status(&p));
    for (id, why) in &expected {
        let line = format!("lease for `{id}` from {} refused: {why}", a.addr);
        p.wait_for_log(&line, Duration::from_secs(5));
        let logged = p.log().lines().find(|l| l.contains(&line)).unwrap().to_string();
        assert!(logged.contains("WARN") && logged.contains(&format!("server={}", a.addr)), "{logged}");
    }

    // Still refused, the lease runs out and its hold ends: on_expiry (pessimistic) applies.
    assert_eventually!(key("nan")["mode"] == "expired", Duration::from_secs(10), "{}", status(&p));
    assert_eq!(send1(&mut c, get("app", "/nan")).await.status, 429, "{}", status(&p));
    assert_eq!(send1(&mut c, get("app", "/fine")).await.status, 200, "{}", status(&p));

    // A redirect elsewhere is logged, naming both masters, and followed.
    a.answer(Answer::Redirect(b.addr.clone()));
    p.wait_for_log(&format!("master={}", b.addr), Duration::from_secs(5));
    let logged = p.log().lines().find(|l| l.contains(&format!("master={}", b.addr))).unwrap().to_string();
    assert!(logged.contains(&format!("previous={}", a.addr)), "{logged}");
    assert_eventually!(ids.iter().all(|id| leased(id)), Duration::from_secs(10), "leased again: {}", status(&p));
    assert!(status(&p)["lease"]["last_error"].is_null(), "{}", status(&p));
    assert_eq!(send1(&mut c, get("app", "/nan")).await.status, 200, "{}", status(&p));
}
