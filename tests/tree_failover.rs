//! A tree's intermediate loses its master under load: real etcd, a root,
//! intermediate A with two members elected through etcd, intermediate B, four
//! sidecars each offered 40/s, measured at their upstreams second by second.
//! Leases (10 s), refresh (2 s at the root, 1 s below) and the election TTL
//! (3 s) are short so the test is lean; what it measures is relative to them.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::etcd::{EtcdServer, elected_member_with};
use support::load::{Tally, drive_strict};
use support::upstream::{Upstream, routes};
use support::{Usher, write_file};

const CAPACITY: f64 = 80.0;
/// Twice the fair share: with 1.5 times it, a load whose timer ticks bunch up on
/// this busy 2-core machine left slots of the 20/s unused, and a sidecar holding a
/// lease of 20 admitted 16/s before the kill.
const OFFERED: f64 = 40.0;
/// The fleet's burst: each of the four sidecars' buckets holds a quarter of it.
const BURST: f64 = 8.0;
const TTL: Duration = Duration::from_secs(3);

fn sidecar(dir: &std::path::Path, name: &str, up: &Upstream, servers: &[&String]) -> Usher {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    let doorman = format!("doorman:\n  servers: [{}]\n  client_id: {name}\n", list.join(", "));
    let res = format!("    kind: rate\n    capacity: 40\n    burst: {BURST}\n    wants: auto\n");
    Usher::proxy(&write_file(dir, &format!("{name}.yaml"), &routes(up, &doorman, &res)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_intermediates_master_under_load_keeps_the_tree_full() {
    kill_a_master(10, 2).await;
}

/// The whole run, for leases of `lease` seconds refreshed every `refresh` at the root.
async fn kill_a_master(lease: u64, refresh: u64) {
    let algorithm = format!("algorithm: {{ kind: FAIR_SHARE, lease_length: {lease}, refresh_interval: {refresh} }}");
    let root = format!("resources:\n  - identifier_glob: '*'\n    capacity: 80\n    {algorithm}\n");
    // An intermediate's own file: only the catch-all, so it shares what its
    // parent grants under the parent's algorithm.
    let middle = format!("resources:\n  - identifier_glob: '*'\n    capacity: 0\n    {algorithm}\n");
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (root_cfg, mid_cfg) = (write_file(dir.path(), "root.yaml", &root), write_file(dir.path(), "mid.yaml", &middle));
    let e = etcd.endpoint.as_str();
    let (root, root_addr) = elected_member_with(e, &root_cfg, "/t/root", &[]);
    let parent = ["--parent", root_addr.as_str()];
    let mut a: Vec<(Usher, String)> = (0..2).map(|_| elected_member_with(e, &mid_cfg, "/t/a", &parent)).collect();
    let (b, b_addr) = elected_member_with(e, &mid_cfg, "/t/b", &parent);
    assert_eventually!(
        root.is_master() && b.is_master() && a.iter().filter(|(u, _)| u.is_master()).count() == 1,
        Duration::from_secs(15),
        "every node elects one master"
    );
    let ups = [Upstream::start().await, Upstream::start().await, Upstream::start().await, Upstream::start().await];
    let a_addrs: Vec<&String> = a.iter().map(|(_, addr)| addr).collect();
    let sidecars = [
        sidecar(dir.path(), "a0", &ups[0], &a_addrs),
        sidecar(dir.path(), "a1", &ups[1], &a_addrs),
        sidecar(dir.path(), "b0", &ups[2], &[&b_addr]),
        sidecar(dir.path(), "b1", &ups[3], &[&b_addr]),
    ];
    let (warm, after) = (10u64, 40u64);
    let start = Instant::now();
    let tallies: Vec<Arc<Tally>> = (0..4).map(|_| Arc::new(Tally::default())).collect();
    let loads: Vec<_> = sidecars
        .iter()
        .zip(&tallies)
        .map(|(s, t)| {
            let dur = Duration::from_secs(warm + after + 2);
            tokio::spawn(drive_strict(s.addr("listen"), OFFERED, dur, t.clone()))
        })
        .collect();
    // Each sidecar's lease, every 250 ms, read off its status page on a
    // thread of its own (blocking reads on the runtime would stall the loads).
    let admins: Vec<std::net::SocketAddr> = sidecars.iter().map(|s| s.addr("admin")).collect();
    let sampling = std::thread::spawn(move || {
        let mut leases: Vec<Vec<(Instant, f64)>> = vec![Vec::new(); admins.len()];
        while start.elapsed() < Duration::from_secs(warm + after) {
            for (i, a) in admins.iter().enumerate() {
                let (_, body) = support::http_get(*a, "/debug/status?format=json");
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if let Some(c) = v["lease"]["keys"][0]["capacity"].as_f64() {
                    leases[i].push((Instant::now(), c));
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        leases
    });
    tokio::time::sleep(Duration::from_secs(warm)).await;
    let steady: Vec<usize> =
        ups.iter().map(|u| u.stats.per_second(start + Duration::from_secs(6), 4).iter().sum()).collect();
    assert!(
        steady.iter().all(|n| (*n as f64 / 4.0 - 20.0).abs() <= 2.0),
        "steady state: every sidecar at its fair share of 20/s: {steady:?} over 4 s"
    );
    let master = a.iter().position(|(u, _)| u.is_master()).unwrap();
    let killed = Instant::now();
    a[master].0.child.kill().unwrap();
    // What every server and sidecar holds near the end, for the failure
    // messages below (read once, after the figures that are checked began).
    tokio::time::sleep_until((killed + Duration::from_secs(after - 5)).into()).await;
    let admins: Vec<(&str, std::net::SocketAddr)> =
        [("root", &root), ("b", &b), ("a (new master)", &a[1 - master].0)].map(|(n, u)| (n, u.addr("admin"))).into();
    let mut state = tokio::task::spawn_blocking(move || {
        let mut state = String::from("servers 35 s after the kill:");
        for (name, addr) in admins {
            let (_, body) = support::http_get(addr, "/debug/resources?resource=api&format=json");
            state += &format!("\n{name}: {body}");
        }
        state
    })
    .await
    .unwrap();
    for l in loads {
        l.await.unwrap();
    }
    let leases = sampling.join().unwrap();
    for ((name, t), l) in ["a0", "a1", "b0", "b1"].iter().zip(&tallies).zip(&leases) {
        // Each change of lease after the kill, as `seconds:capacity`.
        let mut last = None;
        let mut changes = Vec::new();
        for (t, c) in l.iter().filter(|(t, _)| *t >= killed) {
            if last != Some(*c) {
                changes.push(format!("{:.1}s:{c:.1}", t.duration_since(killed).as_secs_f64()));
                last = Some(*c);
            }
        }
        state += &format!("\n{name}: load {}; lease after the kill {}", t.summary(), changes.join(" "));
    }

    let per: Vec<Vec<usize>> = ups.iter().map(|u| u.stats.per_second(killed, after as usize)).collect();
    let total: Vec<usize> = (0..after as usize).map(|s| per.iter().map(|p| p[s]).sum()).collect();
    let report = format!(
        "per second after the kill: a0 {:?}\na1 {:?}\nb0 {:?}\nb1 {:?}\ntotal {total:?}\n{state}",
        per[0], per[1], per[2], per[3]
    );
    // No second above capacity plus the fleet's burst and one request per sidecar, from the start.
    let secs = killed.duration_since(start).as_secs() as usize + after as usize;
    let all: Vec<usize> = (0..secs).map(|s| ups.iter().map(|u| u.stats.per_second(start, secs)[s]).sum()).collect();
    let bound = CAPACITY + BURST + 4.0;
    assert!(all.iter().all(|n| *n as f64 <= bound), "a second above {bound}: {all:?}");
    // The 40 s after the kill: at least 95% of capacity on average.
    let mean = total.iter().sum::<usize>() as f64 / after as f64;
    assert!(mean >= 0.95 * CAPACITY, "mean {mean:.1}/s over the 40 s after the kill\n{report}");
    // A's sidecars are back at 90% of their fair share (20/s) within two
    // refresh intervals plus the election TTL, and stay there: their leases
    // at every reading, and their admitted rate on average (a single second
    // at the upstream moves with the load's timing on a busy machine).
    let back = 2 * Duration::from_secs(refresh) + TTL;
    for (p, l) in per[..2].iter().zip(&leases) {
        let low = l.iter().find(|(t, c)| *t >= killed + back && *c < 0.9 * 20.0);
        assert!(low.is_none(), "a lease below 18 after {back:?}: {low:?}\n{report}");
        let rest = &p[back.as_secs() as usize..];
        let mean = rest.iter().sum::<usize>() as f64 / rest.len() as f64;
        assert!(mean >= 0.9 * 20.0, "not back at 18/s on average from {back:?}: {mean:.1}\n{report}");
    }
    for t in &tallies {
        assert_eq!(t.errors.load(std::sync::atomic::Ordering::Relaxed), 0, "requests unanswered\n{report}");
    }
    eprintln!("mean {mean:.1}/s over the 40 s after the kill; {report}");
}

/// The root goes away: a sidecar behind a live intermediate keeps its lease
/// while it lasts, then runs on the safe capacity the root configured, as
/// one whose servers were all gone would, not on 0 (it was told a safe
/// capacity of 0 once its reservation at the intermediate lapsed, and
/// refused everything until the root came back). The intermediate's log
/// says when its lease ran out and when the root is back, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_behind_an_intermediate_runs_on_its_safe_capacity_while_the_root_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let root_config = "resources:\n  - identifier_glob: '*'\n    capacity: 20\n    safe_capacity: 2\n    algorithm: { kind: FAIR_SHARE, lease_length: 3, refresh_interval: 1, learning_mode_duration: 0 }\n";
    let root_file = write_file(dir.path(), "root.yaml", root_config);
    let port = support::free_port();
    let mut root = Usher::server_at(&root_file, port, &[]);
    let root_addr = root.addr("grpc").to_string();
    let middle = Usher::server(&["--parent", &root_addr, "--min-request-interval", "0s"]);
    let middle_addr = middle.addr("grpc").to_string();
    let up = Upstream::start().await;
    let doorman = format!("doorman:\n  servers: [\"{middle_addr}\"]\n  client_id: behind\n  min_interval: 200ms\n");
    let res = "    kind: rate\n    capacity: 10\n    burst: 2\n    wants: 10\n";
    let p = Usher::proxy(&write_file(dir.path(), "p.yaml", &routes(&up, &doorman, res)));
    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive_strict(p.addr("listen"), 20.0, Duration::from_secs(20), tally.clone()));
    let rate = |from: Instant, secs: usize| {
        let per = up.stats.per_second(from, secs);
        per.iter().sum::<usize>() as f64 / secs as f64
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    let leased = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = rate(leased, 2);
    assert!(r >= 7.0, "the lease, 10/s, before the root goes: {r}/s\n{}", p.log());
    root.child.kill().unwrap();
    let killed = Instant::now();
    // The intermediate's lease (3 s), the sidecar's (never longer) and its
    // reservation there (3 s more) are over by 7 s: from 8 s on, the safe capacity.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let safe_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = rate(safe_from, 4);
    assert!(
        (1.0..=3.5).contains(&r),
        "the safe capacity, 2/s, {:?} after the root went: {r}/s\n{}",
        safe_from - killed,
        p.log()
    );
    // The intermediate said once that its lease ran out, and did not repeat
    // every failed call (one every second or two) while the root was gone.
    let log = middle.log();
    assert_eq!(log.matches("the lease from the parent ran out unrenewed").count(), 1, "{log}");
    let failures = log.matches("parent discovery failed").count() + log.matches("refresh from parent failed").count();
    assert!(failures <= 2, "{failures} failure lines in 12 s:\n{log}");

    // The root comes back: the intermediate says so, and the lease returns.
    let _root = Usher::server_at(&root_file, port, &[]);
    middle.wait_for_log("the parent answers again", Duration::from_secs(10));
    middle.wait_for_log("the lease from the parent is renewed", Duration::from_secs(10));
    let mode = || {
        let (_, body) = support::http_get(p.addr("admin"), "/debug/status?format=json");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["lease"]["keys"][0]["mode"].clone()
    };
    let since = Instant::now();
    while mode() != "leased" && since.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(mode(), "leased", "{}", p.log());
    load.await.unwrap();
}
