//! A tree's intermediate loses its master under load (issue 14, "Done
//! means"): real etcd, a root, intermediate A with two members elected through
//! etcd, intermediate B, four sidecars each offered 30/s, measured at their
//! upstreams second by second. Leases (10 s), refresh (2 s at the root, 1 s
//! below) and the election TTL (3 s) are short so the test is lean; what it
//! measures is relative to them.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::etcd::{EtcdServer, elected_member_with};
use support::load::{Tally, drive};
use support::upstream::{Upstream, routes};
use support::{Usher, write_file};

const CAPACITY: f64 = 80.0;
const OFFERED: f64 = 30.0;
const BURST: f64 = 2.0;
const REFRESH: Duration = Duration::from_secs(2);
const TTL: Duration = Duration::from_secs(3);
const ROOT: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 80\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 2 }\n";
/// An intermediate's own file: only the catch-all, so it shares what its
/// parent grants under the parent's algorithm.
const MIDDLE: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 0\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 2 }\n";

fn sidecar(dir: &std::path::Path, name: &str, up: &Upstream, servers: &[&String]) -> Usher {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    let doorman = format!("doorman:\n  servers: [{}]\n  client_id: {name}\n", list.join(", "));
    let res = format!("    kind: rate\n    capacity: 40\n    burst: {BURST}\n    wants: auto\n");
    Usher::proxy(&write_file(dir, &format!("{name}.yaml"), &routes(up, &doorman, &res)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_intermediates_master_under_load_keeps_the_tree_full() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (root_cfg, mid_cfg) = (write_file(dir.path(), "root.yaml", ROOT), write_file(dir.path(), "mid.yaml", MIDDLE));
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
    let loads: Vec<_> = sidecars
        .iter()
        .map(|s| {
            let dur = Duration::from_secs(warm + after + 2);
            tokio::spawn(drive(s.addr("listen"), OFFERED, dur, Arc::new(Tally::default())))
        })
        .collect();
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
    let mut state = String::from("state 35 s after the kill:");
    let alive = [("root", &root), ("b", &b), ("a (new master)", &a[1 - master].0)];
    for (name, u) in alive {
        let (_, body) = support::http_get(u.addr("admin"), "/debug/resources?resource=api&format=json");
        state += &format!("\n{name}: {body}");
    }
    for (name, s) in ["a0", "a1", "b0", "b1"].iter().zip(&sidecars) {
        let (_, body) = support::http_get(s.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        state += &format!("\n{name}: {}", v["lease"]["keys"]);
    }
    for l in loads {
        l.await.unwrap();
    }

    let per: Vec<Vec<usize>> = ups.iter().map(|u| u.stats.per_second(killed, after as usize)).collect();
    let total: Vec<usize> = (0..after as usize).map(|s| per.iter().map(|p| p[s]).sum()).collect();
    let report = format!(
        "per second after the kill: a0 {:?}\na1 {:?}\nb0 {:?}\nb1 {:?}\ntotal {total:?}\n{state}",
        per[0], per[1], per[2], per[3]
    );
    // No second above capacity plus the four sidecars' bursts, from the start.
    let secs = killed.duration_since(start).as_secs() as usize + after as usize;
    let all: Vec<usize> = (0..secs).map(|s| ups.iter().map(|u| u.stats.per_second(start, secs)[s]).sum()).collect();
    let bound = CAPACITY + 4.0 * BURST;
    assert!(all.iter().all(|n| *n as f64 <= bound), "a second above {bound}: {all:?}");
    // The 40 s after the kill: at least 95% of capacity on average.
    let mean = total.iter().sum::<usize>() as f64 / after as f64;
    assert!(mean >= 0.95 * CAPACITY, "mean {mean:.1}/s over the 40 s after the kill\n{report}");
    // A's sidecars are back at 90% of their fair share (20/s) within two
    // refresh intervals plus the election TTL, and stay there.
    let back = (2 * REFRESH + TTL).as_secs() as usize;
    for p in &per[..2] {
        assert!(p[back..].iter().all(|n| *n as f64 >= 0.9 * 20.0), "not back by {back} s\n{report}");
    }
    eprintln!("mean {mean:.1}/s over the 40 s after the kill; {report}");
}
