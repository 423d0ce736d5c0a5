//! An intermediate server is gone for longer than its leases, then comes
//! back at the same address. A root shares 60/s among three sidecars, each
//! offered 40/s: `r0` leases from the root itself, `m0` and `m1` through the
//! intermediate. While the intermediate is gone, its sidecars hold their
//! leases for a lease length past their expiry, then run on the safe
//! capacity, and the root hands `r0` only what they cannot be using. When it
//! is back (a new master of the same node, as the root sees it), its
//! sidecars get their fair share again within a few refresh intervals.
//! Measured at the three upstreams, second by second, for leases of 2 s and
//! of 10 s: at no second above the capacity plus the fleet's burst.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::load::{Tally, drive_strict};
use support::upstream::{Upstream, routes};
use support::{Usher, free_port, write_file};

const CAPACITY: f64 = 60.0;
/// Twice the fair share (20/s), so that every sidecar wants more than it gets.
const OFFERED: f64 = 40.0;
/// The fleet's burst: each sidecar's bucket holds its share of it.
const BURST: f64 = 6.0;
/// What a sidecar runs on with no lease, per the root's template.
const SAFE: f64 = 4.0;

fn sidecar(dir: &std::path::Path, name: &str, up: &Upstream, server: &str) -> Usher {
    let doorman = format!("doorman:\n  servers: [\"{server}\"]\n  client_id: {name}\n");
    let res = format!("    kind: rate\n    capacity: {OFFERED}\n    burst: {BURST}\n    wants: auto\n");
    Usher::proxy(&write_file(dir, &format!("{name}.yaml"), &routes(up, &doorman, &res)))
}

/// The whole run for leases of `lease` seconds, refreshed every `refresh`.
async fn outage(lease: u64, refresh: u64) {
    let dir = tempfile::tempdir().unwrap();
    let algorithm = format!("algorithm: {{ kind: FAIR_SHARE, lease_length: {lease}, refresh_interval: {refresh} }}");
    let root_cfg = format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: {CAPACITY}\n    safe_capacity: {SAFE}\n    {algorithm}\n"
    );
    // Only the catch-all: the intermediate shares what its parent grants.
    let mid_cfg = format!("resources:\n  - identifier_glob: '*'\n    capacity: 0\n    {algorithm}\n");
    let root_file = write_file(dir.path(), "root.yaml", &root_cfg);
    let mid_file = write_file(dir.path(), "mid.yaml", &mid_cfg);
    let root = Usher::server_at(&root_file, free_port(), &[]);
    let root_addr = root.addr("grpc").to_string();
    let mid_port = free_port();
    let mid_args = ["--parent", root_addr.as_str(), "--node-id", "mid"];
    let mut mid = Usher::server_at(&mid_file, mid_port, &mid_args);
    let mid_addr = format!("127.0.0.1:{mid_port}");
    let ups = [Upstream::start().await, Upstream::start().await, Upstream::start().await];
    let sidecars = [
        sidecar(dir.path(), "r0", &ups[0], &root_addr),
        sidecar(dir.path(), "m0", &ups[1], &mid_addr),
        sidecar(dir.path(), "m1", &ups[2], &mid_addr),
    ];
    let (warm, gone, back) = (10u64, 3 * lease + 2, 25u64);
    let total_secs = warm + gone + back;
    let start = Instant::now();
    let tallies: Vec<Arc<Tally>> = (0..3).map(|_| Arc::new(Tally::default())).collect();
    let loads: Vec<_> = sidecars
        .iter()
        .zip(&tallies)
        .map(|(s, t)| tokio::spawn(drive_strict(s.addr("listen"), OFFERED, Duration::from_secs(total_secs), t.clone())))
        .collect();
    // Each sidecar's lease every 250 ms, read off its status page on a thread
    // of its own (blocking reads on the runtime would stall the loads).
    let admins: Vec<std::net::SocketAddr> = sidecars.iter().map(|s| s.addr("admin")).collect();
    let sampling = std::thread::spawn(move || {
        let mut leases: Vec<Vec<(Instant, f64, String)>> = vec![Vec::new(); admins.len()];
        while start.elapsed() < Duration::from_secs(total_secs) {
            for (i, a) in admins.iter().enumerate() {
                let (_, body) = support::http_get(*a, "/debug/status?format=json");
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let key = &v["lease"]["keys"][0];
                if let Some(c) = key["capacity"].as_f64() {
                    leases[i].push((Instant::now(), c, key["mode"].as_str().unwrap_or("?").to_string()));
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        leases
    });
    tokio::time::sleep(Duration::from_secs(warm)).await;
    let steady: Vec<usize> =
        ups.iter().map(|u| u.stats.per_second(start + Duration::from_secs(6), 4).iter().sum()).collect();
    // What the servers hold at the end of the warm-up, for the messages below.
    let mut state = String::new();
    for (name, u) in [("root", &root), ("intermediate", &mid)] {
        let (_, body) = support::http_get(u.addr("admin"), "/debug/resources?resource=api&format=json");
        state += &format!("\n{name} before the outage: {body}");
    }
    mid.child.kill().unwrap();
    let _ = mid.child.wait();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(gone)).await;
    let _mid = Usher::server_at(&mid_file, mid_port, &mid_args);
    let restarted = Instant::now();
    for l in loads {
        l.await.unwrap();
    }
    let leases = sampling.join().unwrap();

    let secs = total_secs as usize;
    let per: Vec<Vec<usize>> = ups.iter().map(|u| u.stats.per_second(start, secs)).collect();
    let total: Vec<usize> = (0..secs).map(|s| per.iter().map(|p| p[s]).sum()).collect();
    let at = |t: Instant| t.duration_since(start).as_secs_f64();
    let mut report = format!(
        "leases of {lease} s: killed at {:.1} s, back at {:.1} s\nper second: r0 {:?}\nm0 {:?}\nm1 {:?}\ntotal {total:?}",
        at(killed),
        at(restarted),
        per[0],
        per[1],
        per[2]
    );
    for ((name, t), l) in ["r0", "m0", "m1"].iter().zip(&tallies).zip(&leases) {
        let mut last = None;
        let mut changes = Vec::new();
        for (t, c, mode) in l {
            if last.as_ref() != Some(&(*c, mode)) {
                changes.push(format!("{:.1}s:{c:.1}({mode})", at(*t)));
                last = Some((*c, mode));
            }
        }
        report += &format!("\n{name}: load {}; leases {}", t.summary(), changes.join(" "));
    }
    report += &state;
    assert!(
        steady.iter().all(|n| (*n as f64 / 4.0 - 20.0).abs() <= 2.0),
        "before the outage, every sidecar at its fair share of 20/s: {steady:?} over 4 s\n{report}"
    );
    // Never above the capacity, plus the fleet's burst and a request per sidecar.
    let bound = CAPACITY + BURST + 3.0;
    assert!(total.iter().all(|n| *n as f64 <= bound), "a second above {bound}\n{report}");
    // While it is gone, its sidecars never run on nothing: their lease, then
    // the safe capacity (4/s), every second once their leases have lapsed
    // (a second's count moves with the load's timing: at least half of it).
    let (from, to) = ((killed - start).as_secs() as usize + 1, (restarted - start).as_secs() as usize);
    for p in &per[1..] {
        assert!(p[from..to].iter().all(|n| *n as f64 >= SAFE / 2.0), "a sidecar behind it ran dry\n{report}");
    }
    // Back: its sidecars at 90% of their fair share within a few refresh
    // intervals (reconnecting, the intermediate learning for at most 3 s,
    // the root taking back what r0 holds beyond its share), and from then
    // on the three of them use 90% of the capacity.
    let settle = (restarted - start).as_secs() as usize + 3 * refresh as usize + 6;
    for (name, p) in ["m0", "m1"].iter().zip(&per[1..]) {
        let rest = &p[settle..];
        let mean = rest.iter().sum::<usize>() as f64 / rest.len() as f64;
        assert!(mean >= 0.9 * 20.0, "{name} not back at 18/s on average from {settle} s: {mean:.1}\n{report}");
    }
    let rest = &total[settle..];
    let mean = rest.iter().sum::<usize>() as f64 / rest.len() as f64;
    assert!(mean >= 0.9 * CAPACITY, "the fleet at {mean:.1}/s from {settle} s\n{report}");
    for t in &tallies {
        assert_eq!(t.errors.load(std::sync::atomic::Ordering::Relaxed), 0, "requests unanswered\n{report}");
    }
    eprintln!("{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intermediate_gone_longer_than_its_two_second_leases_comes_back_to_its_share() {
    outage(2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intermediate_gone_longer_than_its_ten_second_leases_comes_back_to_its_share() {
    outage(10, 2).await;
}
