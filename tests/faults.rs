//! Faults between the sidecar and its capacity server: a real `usher proxy`
//! leases from a real `usher server` through a TCP fault proxy that
//! blackholes, delays, resets or closes the connections while load runs
//! against the sidecar; and a master failover under load.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::etcd::elected_member;
use support::faultproxy::{FaultProxy, Mode};
use support::load::{Tally, drive_strict};
use support::upstream::Upstream;
use support::{Usher, free_port, http_get, write_file};

/// These tests measure rates in real time: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Lease length and refresh interval the server hands out.
const LEASE: Duration = Duration::from_secs(4);
const REFRESH: Duration = Duration::from_secs(1);
/// The sidecar's `backoff.max`.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const CAPACITY: f64 = 40.0;
const SAFE: f64 = 5.0;

fn start_server(dir: &Path, name: &str, port: u16) -> Usher {
    let cfg = write_file(
        dir,
        &format!("{name}.yaml"),
        &format!(
            "resources:\n  - identifier_glob: '*'\n    capacity: {CAPACITY}\n    safe_capacity: {SAFE}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: {}, refresh_interval: {}, learning_mode_duration: 0 }}\n",
            LEASE.as_secs(),
            REFRESH.as_secs()
        ),
    );
    Usher::server_at(&cfg, port, &[])
}

fn start_sidecar(dir: &Path, up: &Upstream, servers: &[String], client_id: &str) -> Usher {
    let servers = servers.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
    let text = format!(
        "doorman:\n  servers: [{servers}]\n  client_id: {client_id}\n  min_interval: 200ms\n  backoff: {{ initial: 200ms, max: {}ms }}\n\
         upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  api: {{ kind: rate, capacity: {CAPACITY}, burst: 2, max_wait: 500ms, wants: {CAPACITY}, on_expiry: safe }}\n\
         routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
        BACKOFF_MAX.as_millis(),
        up.addr
    );
    Usher::proxy(&write_file(dir, &format!("{client_id}.yaml"), &text))
}

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn key(u: &Usher) -> serde_json::Value {
    status(u)["lease"]["keys"][0].clone()
}

async fn rate_over(up: &Upstream, d: Duration) -> f64 {
    let n0 = up.stats.requests();
    let t0 = Instant::now();
    tokio::time::sleep(d).await;
    (up.stats.requests() - n0) as f64 / t0.elapsed().as_secs_f64()
}

/// Sleeps until `at`.
async fn until(at: Instant) {
    tokio::time::sleep(at.saturating_duration_since(Instant::now())).await;
}

// The resource paces for up to 500 ms (`max_wait`) rather than refusing at
// once: the admitted rate then equals the capacity even when a loaded machine
// bunches the arrivals, so the rate checks below measure the limiter and not
// the load generator.

/// The scenario for one fault mode: lease, fault for 4 × the lease length
/// under load, heal, and check every phase.
async fn fault_scenario(mode: Mode) {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start_server(dir.path(), "server", port);
    let server_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let faults = FaultProxy::start(server_addr).await;
    let up = Upstream::start().await;
    let p = start_sidecar(dir.path(), &up, &[faults.addr.to_string()], "sidecar-fault");
    let leased = |p: &Usher| key(p)["mode"] == "leased" && key(p)["has"] == CAPACITY;
    assert_eventually!(leased(&p), Duration::from_secs(10), "the sidecar leases through the fault proxy");

    let fault_len = LEASE * 4;
    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive_strict(p.addr("listen"), 100.0, fault_len + Duration::from_secs(10), tally.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = rate_over(&up, Duration::from_secs(2)).await;
    assert!((r - CAPACITY).abs() <= 6.0, "{mode:?}: the leased rate before the fault is {r:.1}/s");

    faults.set(mode);
    let t0 = Instant::now();
    let refreshes_at_fault = status(&p)["lease"]["refreshes"].as_u64().unwrap();
    // The last renewal was at most one refresh interval (+ jitter) ago: the
    // lease is valid for at least another LEASE - 1.2 × REFRESH.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = rate_over(&up, Duration::from_secs(2)).await;
    assert!(
        (CAPACITY - 8.0..=CAPACITY + 6.0).contains(&r),
        "{mode:?}: the rate stays at the lease while it is valid: {r:.1}/s\n{}",
        status(&p)
    );
    if let Mode::Delay(_) = mode {
        // Renewals still get through, only slower: the lease never expires.
        let (n0, s0) = (up.stats.requests(), Instant::now());
        while t0.elapsed() < fault_len - Duration::from_millis(500) {
            let k = key(&p);
            assert_eq!(k["mode"], "leased", "{mode:?}: a slow server still renews the lease: {k}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let renewed = status(&p)["lease"]["refreshes"].as_u64().unwrap() - refreshes_at_fault;
        assert!(renewed >= 3, "{mode:?}: renewals went on through the delay: {renewed}");
        let r = (up.stats.requests() - n0) as f64 / s0.elapsed().as_secs_f64();
        assert!(
            (r - CAPACITY).abs() <= 6.0,
            "{mode:?}: the rate stays at the lease throughout: {r:.1}/s\n{}\n{}",
            tally.summary(),
            status(&p)
        );
    } else {
        // The last grant was before the fault began (at most a jittered
        // refresh before it), so the lease has expired by LEASE after it and
        // the whole second after that (leases end on a whole second), even
        // while a renewal hangs on a blackholed server. It is held for as
        // long again as it was granted for (the server keeps it reserved that
        // long): from at least 6.8 s after the fault began. What the limiter
        // enforces is read, not a rate measured over time.
        until(t0 + LEASE + Duration::from_millis(1100)).await;
        let st = status(&p);
        assert_eq!(st["lease"]["keys"][0]["mode"], "held", "{mode:?}: the lease expired on time and is held: {st}");
        assert_eq!(st["keys"][0]["capacity"], CAPACITY, "{mode:?}: the held lease is enforced: {st}");
        until(t0 + (LEASE + Duration::from_secs(1)) * 2 + Duration::from_millis(100)).await;
        let k = key(&p);
        assert_eq!(k["mode"], "expired", "{mode:?}: the hold ended on time: {}", status(&p));
        // Then safe capacity, until the fault ends.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let r = rate_over(&up, fault_len - LEASE * 2 - Duration::from_millis(3500)).await;
        assert!(
            (r - SAFE).abs() <= 2.5,
            "{mode:?}: on_expiry safe admits the safe capacity {SAFE}/s: {r:.1}/s\n{}",
            status(&p)
        );
    }
    until(t0 + fault_len).await;
    faults.set(Mode::Pass);
    let healed = Instant::now();
    let before = status(&p)["lease"]["refreshes"].as_u64().unwrap();
    // Renewed within one refresh interval and one maximal backoff, with slack for a loaded machine.
    let patience = REFRESH + BACKOFF_MAX + Duration::from_secs(3);
    assert_eventually!(
        leased(&p) && status(&p)["lease"]["refreshes"].as_u64().unwrap() > before,
        patience,
        "{mode:?}: the lease is renewed within {patience:?} of the fault ending: {}",
        status(&p)
    );
    let took = healed.elapsed();
    eprintln!("{mode:?}: lease renewed {took:?} after the fault ended");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = rate_over(&up, Duration::from_secs(2)).await;
    assert!(
        (r - CAPACITY).abs() <= 6.0,
        "{mode:?}: the leased rate is back: {r:.1}/s\n{}\n{}",
        tally.summary(),
        status(&p)
    );
    load.await.unwrap();
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "{mode:?}: the app sees only 2xx and 429: {}", tally.summary());
    assert_eq!(
        tally.errors.load(Ordering::Relaxed),
        0,
        "{mode:?}: no request lost its connection: {}",
        tally.summary()
    );
    if !matches!(mode, Mode::Delay(_)) {
        assert!(tally.refused.load(Ordering::Relaxed) > 0, "{mode:?}: safe capacity refused some: {}", tally.summary());
    }
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_capacity_server() {
    fault_scenario(Mode::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resetting_capacity_server() {
    fault_scenario(Mode::Reset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_capacity_server() {
    fault_scenario(Mode::Close).await;
}

/// Half a second each way: a renewal takes a second. The lease survives as
/// long as round trip + refresh interval (+ jitter) + the second lost to the
/// wire's whole-second expiry stay below the lease length (here ~3.2 s < 4 s);
/// with 1 s each way it would lapse between renewals, which is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_capacity_server() {
    fault_scenario(Mode::Delay(Duration::from_millis(500))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_failover_under_load_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    let mut a = start_server(dir.path(), "a", pa);
    let b = start_server(dir.path(), "b", pb);
    let (addr_a, addr_b) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb}"));
    let up = Upstream::start().await;
    let p = start_sidecar(dir.path(), &up, &[addr_a.clone(), addr_b.clone()], "sidecar-failover");
    let holds = |server: &Usher| {
        let (code, body) = http_get(server.addr("admin"), "/debug/resources?resource=api&format=json");
        code == 200 && body.contains("sidecar-failover")
    };
    assert_eventually!(
        status(&p)["lease"]["master"] == addr_a.as_str() && key(&p)["mode"] == "leased",
        Duration::from_secs(10),
        "the sidecar leases from the first server: {}",
        status(&p)
    );
    assert!(holds(&a));

    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive_strict(p.addr("listen"), 100.0, Duration::from_secs(12), tally.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.child.kill().unwrap();
    let _ = a.wait_exit(Duration::from_secs(5));
    let killed = Instant::now();
    assert_eventually!(
        status(&p)["lease"]["master"] == addr_b.as_str() && key(&p)["mode"] == "leased" && holds(&b),
        Duration::from_secs(8),
        "the lease moves to the second server: {}",
        status(&p)
    );
    eprintln!("failover took {:?}", killed.elapsed());
    // The lease never lapsed: the rate at the upstream stays at the lease.
    let r = rate_over(&up, Duration::from_secs(3)).await;
    assert!((r - CAPACITY).abs() <= 6.0, "the leased rate holds after failover: {r:.1}/s");
    load.await.unwrap();
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "the app sees only 2xx and 429: {}", tally.summary());
    assert_eq!(tally.errors.load(Ordering::Relaxed), 0, "no request lost its connection: {}", tally.summary());
    assert!(tally.ok.load(Ordering::Relaxed) > 300, "the load ran: {}", tally.summary());
}

/// The same through a real master election on etcd: three servers, the
/// master is killed mid-load, another wins and the sidecar follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_master_failover_under_load_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let etcd = support::etcd::EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(
        dir.path(),
        "resources.yaml",
        &format!(
            "resources:\n  - identifier_glob: '*'\n    capacity: {CAPACITY}\n    safe_capacity: {SAFE}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1, learning_mode_duration: 10 }}\n"
        ),
    );
    let mut members: Vec<(Usher, String)> =
        (0..3).map(|_| elected_member(&etcd.endpoint, &cfg, "/faults/master")).collect();
    assert_eventually!(
        members.iter().filter(|(u, _)| u.is_master()).count() == 1,
        Duration::from_secs(15),
        "one master"
    );
    let up = Upstream::start().await;
    let servers: Vec<String> = members.iter().map(|(_, a)| a.clone()).collect();
    let p = start_sidecar(dir.path(), &up, &servers, "sidecar-etcd");
    let master = members.iter().position(|(u, _)| u.is_master()).unwrap();
    assert_eventually!(
        status(&p)["lease"]["master"] == members[master].1.as_str()
            && key(&p)["mode"] == "leased"
            && key(&p)["has"] == CAPACITY,
        Duration::from_secs(30),
        "the sidecar leases from the master (after its learning mode): {}",
        status(&p)
    );

    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive_strict(p.addr("listen"), 100.0, Duration::from_secs(14), tally.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    members[master].0.child.kill().unwrap();
    let killed = Instant::now();
    let n0 = up.stats.requests();
    // The lease (10 s) outlives the election (TTL 3 s) and the sidecar's search
    // for the new master even on a loaded machine, and the new master's
    // learning mode hands the lease back: enforced throughout.
    let mut moved = None;
    while killed.elapsed() < Duration::from_secs(10) {
        let st = status(&p);
        let k = &st["lease"]["keys"][0];
        assert!(k["mode"] == "leased" && k["has"] == CAPACITY, "the lease holds through the failover: {st}");
        let now_master = st["lease"]["master"].as_str().unwrap_or("").to_string();
        if moved.is_none() && !now_master.is_empty() && now_master != members[master].1 {
            moved = Some((now_master, killed.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let r = (up.stats.requests() - n0) as f64 / killed.elapsed().as_secs_f64();
    assert!((r - CAPACITY).abs() <= 6.0, "the leased rate holds through the failover: {r:.1}/s");
    let (new_master, took) = moved.unwrap_or_else(|| panic!("the sidecar never left the dead master: {}", status(&p)));
    eprintln!("the sidecar moved to the new master {new_master} after {took:?}");
    let winner = members.iter().find(|(_, a)| *a == new_master).expect("the new master is a member");
    assert!(winner.0.is_master(), "the sidecar follows the elected master");
    let (_, body) = http_get(winner.0.addr("admin"), "/debug/resources?resource=api&format=json");
    assert!(body.contains("sidecar-etcd"), "the new master holds the sidecar's lease: {body}");
    load.await.unwrap();
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "the app sees only 2xx and 429: {}", tally.summary());
    assert_eq!(tally.errors.load(Ordering::Relaxed), 0, "no request lost its connection: {}", tally.summary());
}
