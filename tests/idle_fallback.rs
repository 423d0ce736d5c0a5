//! Idle sidecars whose servers go away for good run on their share of the
//! resource, not on nothing: with no safe capacity configured the server
//! tells every client its share as its safe capacity (reserved when its
//! lease lapses: src/server/store.rs, `Resource::share_safe`), and the
//! default `on_expiry: safe` falls back on it once the lease and its hold
//! ran out. Before, the idle sidecars' last leases were 0 and so was their
//! safe capacity: 0 of 10 requests were admitted.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::load::{Tally, drive};
use support::upstream::{Upstream, get, h1, routes, send1};
use support::{Usher, free_port, http_get, write_file};

const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 10\n    algorithm: { kind: FAIR_SHARE, lease_length: 2, refresh_interval: 1, learning_mode_duration: 0 }\n";

fn key(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["lease"]["keys"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sidecars_cut_off_for_good_admit_their_share() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = Usher::server_at(&write_file(dir.path(), "r.yaml", CONFIG), port, &[]);
    let ups = [Upstream::start().await, Upstream::start().await];
    // Idle: `wants: auto` measures no demand and asks for nothing.
    let res = "    kind: rate\n    capacity: 5\n    burst: 1\n    wants: auto\n";
    let sidecars: Vec<Usher> = ups
        .iter()
        .enumerate()
        .map(|(i, up)| {
            let doorman = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: idle-{i}\n  backoff: {{ initial: 200ms, max: 1s }}\n"
            );
            Usher::proxy(&write_file(dir.path(), &format!("s{i}.yaml"), &routes(up, &doorman, res)))
        })
        .collect();
    // One request each measures a demand; then idle (a lone request's demand
    // fades over 10 s), each asks for 0, holds some of the spare capacity,
    // and is told its share (5) as its safe capacity.
    for s in &sidecars {
        let mut c = h1(s.addr("listen")).await;
        send1(&mut c, get("api.test", "/")).await;
    }
    assert_eventually!(
        sidecars.iter().all(|s| {
            let k = key(s);
            k["mode"] == "leased" && k["wants"] == 0.0 && k["safe_capacity"] == 5.0
        }),
        Duration::from_secs(25),
        "idle sidecars told their share: {} {}",
        key(&sidecars[0]),
        key(&sidecars[1])
    );
    server.child.kill().unwrap();
    let _ = server.wait_exit(Duration::from_secs(5));
    // The lease (2 s) and its hold (as long again) run out.
    assert_eventually!(
        sidecars.iter().all(|s| key(s)["mode"] == "expired"),
        Duration::from_secs(10),
        "the leases ran out: {} {}",
        key(&sidecars[0]),
        key(&sidecars[1])
    );
    let started = Instant::now();
    let secs = 4;
    let loads: Vec<_> = sidecars
        .iter()
        .map(|s| tokio::spawn(drive(s.addr("listen"), 20.0, Duration::from_secs(secs), Arc::new(Tally::default()))))
        .collect();
    for l in loads {
        l.await.unwrap();
    }
    for (i, up) in ups.iter().enumerate() {
        let n = up.stats.arrivals_between(started, started + Duration::from_secs(secs)).len();
        let rate = n as f64 / secs as f64;
        // The share, 5/s, plus the burst of one; at least 3.5/s on a loaded machine.
        assert!(
            (3.5..=5.0 + 1.0).contains(&rate),
            "sidecar {i} admitted {rate:.2}/s, its share is 5/s: {}",
            key(&sidecars[i])
        );
    }
}
