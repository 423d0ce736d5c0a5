//! One budget for a fleet: bursts are part of it. Three sidecars lease one
//! resource from a real `usher server`; each routes file gives the fleet's
//! capacity and burst. When the three apps fire at once, what reaches the
//! upstream in the next two seconds is at most `capacity × 2 s + burst`, plus
//! one request per sidecar: on a fresh start, after an idle spell, and for a
//! daily quota whose default burst is the whole quota. (Each sidecar's bucket
//! used to be sized by its own routes file: 90 requests passed where one
//! budget allows 32, and 600 of a 300/day quota.)

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::load::{self, Tally};
use support::upstream::{Upstream, doorman, get, h1, routes};
use support::{Usher, free_port, write_file};

/// Sends `n` requests to the sidecar at `addr` as fast as 8 connections
/// allow, and returns how many were admitted (200).
async fn fire(addr: std::net::SocketAddr, n: usize) -> u64 {
    let tally = Arc::new(Tally::default());
    load::fire(addr, n, 8, tally.clone()).await;
    tally.ok.load(Ordering::Relaxed)
}

/// A capacity server sharing one resource of `capacity` per second, with no
/// learning mode (a server that has been running for a while).
fn server(dir: &Path, capacity: f64) -> (Usher, u16) {
    let port = free_port();
    let config = format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: {capacity}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 30, refresh_interval: 2, learning_mode_duration: 0 }}\n"
    );
    (Usher::server_at(&write_file(dir, "resources.yaml", &config), port, &[]), port)
}

/// Three sidecars of one upstream, each with the resource `res` (indented YAML).
fn sidecars(dir: &Path, port: u16, up: &Upstream, res: &str) -> Vec<Usher> {
    let files: Vec<_> = (0..3)
        .map(|i| write_file(dir, &format!("s{i}.yaml"), &routes(up, &doorman(port, &format!("fleet-{i}")), res)))
        .collect();
    Usher::proxies(&files)
}

/// The three apps fire `n` requests each at once; returns what reached the
/// upstream in the two seconds from then, and what each sidecar admitted.
async fn all_fire(sidecars: &[Usher], up: &Upstream, n: usize) -> (usize, Vec<u64>) {
    let start = Instant::now();
    let fired: Vec<_> = sidecars.iter().map(|s| tokio::spawn(fire(s.addr("listen"), n))).collect();
    let mut admitted = Vec::new();
    for f in fired {
        admitted.push(f.await.unwrap());
    }
    let until = start + Duration::from_secs(2);
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    (up.stats.arrivals_between(start, until).len(), admitted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleets_bursts_add_up_to_one_burst_fresh_and_after_idle() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, port) = server(dir.path(), 1.0);
    let up = Upstream::start().await;
    // A fixed `wants`: the leases stay while the apps are idle.
    let res = "    kind: rate\n    capacity: 60/min\n    burst: 30\n    wants: 1\n";
    let fleet = sidecars(dir.path(), port, &up, res);
    let (fresh, admitted) = all_fire(&fleet, &up, 40).await;
    assert!(fresh <= 30 + 2 + 3, "fresh: {fresh} reached the upstream in 2 s (admitted {admitted:?})");
    assert!(fresh >= 3, "fresh: each sidecar passes at least one request: {fresh} ({admitted:?})");

    // Idle: each bucket refills at its third of the lease (about 2.7 in 8 s).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (idle, admitted) = all_fire(&fleet, &up, 40).await;
    assert!(idle <= 30 + 2 + 3, "after idle: {idle} reached the upstream in 2 s (admitted {admitted:?})");
    assert!(admitted.iter().all(|a| *a >= 2), "each sidecar refilled at its share of the lease: {admitted:?}");
}

/// Each sidecar's bucket holds its share of the fleet's burst: after an
/// idle spell long enough to fill them, the fleet spends one burst, split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sidecar_holds_its_share_of_the_burst() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, port) = server(dir.path(), 12.0);
    let up = Upstream::start().await;
    let res = "    kind: rate
    capacity: 12/s
    burst: 30
    wants: 4
";
    let fleet = sidecars(dir.path(), port, &up, res);
    // 4/s each: a bucket of 10 fills in 2.5 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (burst, admitted) = all_fire(&fleet, &up, 40).await;
    assert!(burst <= 30 + 24 + 3, "{burst} reached the upstream in 2 s (admitted {admitted:?})");
    let total: u64 = admitted.iter().sum();
    assert!(total >= 27, "the fleet's burst is there to spend: {admitted:?}");
    assert!(admitted.iter().all(|a| (8..=14).contains(a)), "each holds about a third of it: {admitted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_quotas_default_burst_is_the_fleets_not_each_sidecars() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, port) = server(dir.path(), 300.0 / 86400.0);
    let up = Upstream::start().await;
    // The default burst of a daily quota is the whole quota, for the whole fleet.
    let res = "    kind: rate\n    capacity: 300/day\n";
    let fleet = sidecars(dir.path(), port, &up, res);
    let (fresh, admitted) = all_fire(&fleet, &up, 400).await;
    assert!(fresh <= 303, "{fresh} of a 300/day quota reached the upstream at once (admitted {admitted:?})");
    assert!(fresh >= 3, "each sidecar passes at least one request: {fresh} ({admitted:?})");
}

/// With the defaults (no `burst`, no `max_wait`), requests sent one after
/// another within the rate are never refused: a `capacity: 100/s` resource
/// once refused a second `curl` a few milliseconds after the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_within_the_rate_pass_with_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let sidecar =
        Usher::proxy(&write_file(dir.path(), "r.yaml", &routes(&up, "", "    kind: rate\n    capacity: 100/s\n")));
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let mut client = h1(sidecar.addr("listen")).await;
        client.ready().await.unwrap();
        statuses.push(client.send_request(get("app.local", "/x")).await.unwrap().status().as_u16());
    }
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
}

/// A routes file whose `capacity` is a small first guess (1/min, against the
/// server's 3/s) does not make each sidecar's bucket the whole burst: its
/// share, and whether its first lease fills it, are reckoned against the
/// capacity the server says it shares (each first lease, 1/s, is far above
/// 1/min: reckoned against the routes file, each bucket filled to 30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_first_wants_does_not_multiply_the_fleets_burst() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, port) = server(dir.path(), 3.0);
    let up = Upstream::start().await;
    let res = "    kind: rate\n    capacity: 1/min\n    burst: 30\n    wants: 1\n";
    let fleet = sidecars(dir.path(), port, &up, res);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (fired, admitted) = all_fire(&fleet, &up, 40).await;
    assert!(fired <= 30 + 2 * 3 + 3, "{fired} reached the upstream in 2 s (admitted {admitted:?})");
}
