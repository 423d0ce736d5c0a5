//! A tree of real `usher server` processes: a root and intermediates that
//! lease from it, driven by tonic clients standing in for sidecars.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{Usher, http_get, write_file};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, ResourceRequest};

const ROOT: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 20, refresh_interval: 4, learning_mode_duration: 0 }\n";

fn start_server(dir: &std::path::Path, name: &str, config: Option<&str>, parent: Option<&str>) -> Usher {
    let mut args: Vec<String> =
        vec!["server".into(), "--listen".into(), "127.0.0.1:0".into(), "--admin-listen".into(), "127.0.0.1:0".into()];
    args.extend(["--min-request-interval".into(), "0s".into()]);
    if let Some(c) = config {
        let p = write_file(dir, &format!("{name}.yaml"), c);
        args.extend(["--config".into(), p.to_str().unwrap().to_string()]);
    }
    if let Some(p) = parent {
        args.extend(["--parent".into(), p.to_string()]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Usher::start(&refs, &[], "usher server listening")
}

fn now_secs() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_shared_fairly_across_the_tree_without_overshoot() {
    let dir = tempfile::tempdir().unwrap();
    let root = start_server(dir.path(), "root", Some(ROOT), None);
    let root_addr = root.addr("grpc").to_string();
    let i1 = start_server(dir.path(), "i1", None, Some(&root_addr));
    let i2 = start_server(dir.path(), "i2", None, Some(&root_addr));
    let mut leaves = Vec::new();
    for (name, server) in [("c1", &i1), ("c2", &i1), ("c3", &i2), ("c4", &i2)] {
        let c = CapacityClient::connect(format!("http://{}", server.addr("grpc"))).await.unwrap();
        leaves.push((name, c));
    }
    // Each leaf keeps asking for 100; remember every leaf's latest grant.
    let mut held: HashMap<&str, (f64, i64)> = HashMap::new();
    let mut max_total: f64 = 0.0;
    let start = Instant::now();
    let mut settled_since: Option<Instant> = None;
    while start.elapsed() < Duration::from_secs(40) {
        for (name, c) in leaves.iter_mut() {
            let r = c
                .get_capacity(GetCapacityRequest {
                    client_id: name.to_string(),
                    resource: vec![ResourceRequest {
                        returned: None,
                        reserve: None,
                        backlog: None,
                        unit_account: None,
                        window: None,
                        upstream_quota: None,
                        resource_id: "api".into(),
                        priority: 0,
                        has: None,
                        wants: 100.0,
                    }],
                })
                .await
                .unwrap()
                .into_inner();
            let lease = &r.response[0].gets;
            assert!(lease.expiry_time <= now_secs() + 21, "no lease outlives the root's 20 s lease");
            held.insert(name, (lease.capacity, lease.expiry_time));
        }
        let now = now_secs();
        let total: f64 = held.values().filter(|(_, exp)| *exp >= now).map(|(c, _)| c).sum();
        max_total = max_total.max(total);
        assert!(total <= 100.0 + 1e-6, "the tree handed out {total} of 100: {held:?}");
        let fair = held.values().all(|(c, _)| (*c - 25.0).abs() <= 25.0 * 0.05);
        match (fair, settled_since) {
            (true, None) => settled_since = Some(Instant::now()),
            (false, _) => settled_since = None,
            _ => {}
        }
        if settled_since.is_some_and(|t| t.elapsed() > Duration::from_secs(5)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        settled_since.is_some_and(|t| t.elapsed() > Duration::from_secs(5)),
        "every leaf should hold 25 ± 5% for 5 s: {held:?}\nroot:\n{}\ni1:\n{}",
        root.log(),
        i1.log()
    );
    // The intermediate's status shows its role, its parent and its lease from it.
    let (_, body) = http_get(i1.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(st["role"], "intermediate");
    assert_eq!(st["parent"]["master"], root_addr.as_str());
    assert_eq!(st["resources"][0]["parent_capacity"], 50.0);
    // Leases handed down refresh at the root's interval × 0.5.
    let mut c = CapacityClient::connect(format!("http://{}", i1.addr("grpc"))).await.unwrap();
    let r = c
        .get_capacity(GetCapacityRequest {
            client_id: "c1".into(),
            resource: vec![ResourceRequest {
                returned: None,
                reserve: None,
                backlog: None,
                unit_account: None,
                window: None,
                upstream_quota: None,
                resource_id: "api".into(),
                priority: 0,
                has: None,
                wants: 100.0,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.response[0].gets.refresh_interval, 2);
    // The root sees two server clients, each speaking for two subclients.
    let (_, body) = http_get(root.addr("admin"), "/debug/resources?resource=api&format=json");
    let leases: serde_json::Value = serde_json::from_str(&body).unwrap();
    let kinds: Vec<(&str, u64)> = leases["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["kind"].as_str().unwrap(), l["subclients"].as_u64().unwrap()))
        .collect();
    assert_eq!(kinds, vec![("server", 2), ("server", 2)]);
    let (_, body) = http_get(root.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(st["role"], "root");
    assert_eq!(st["resources"][0]["server_clients"], 2, "children are listed as servers");
}

/// Two priority-1 clients and one priority-2 client each want 60 of the `db`
/// resource, three rounds; returns each client's last grant.
async fn three_rounds(server: std::net::SocketAddr) -> HashMap<&'static str, f64> {
    let mut c = CapacityClient::connect(format!("http://{server}")).await.unwrap();
    let mut last = HashMap::new();
    for _round in 0..3 {
        for (name, priority) in [("low-a", 1), ("low-b", 1), ("high", 2)] {
            let r = c
                .get_capacity(GetCapacityRequest {
                    client_id: name.into(),
                    resource: vec![ResourceRequest {
                        returned: None,
                        reserve: None,
                        backlog: None,
                        unit_account: None,
                        window: None,
                        upstream_quota: None,
                        resource_id: "db".into(),
                        priority,
                        has: None,
                        wants: 60.0,
                    }],
                })
                .await
                .unwrap()
                .into_inner();
            last.insert(name, r.response[0].gets.capacity);
        }
    }
    last
}

#[tokio::test]
async fn strict_priorities_serve_higher_bands_first() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm:\n      kind: FAIR_SHARE\n      lease_length: 60\n      refresh_interval: 5\n      learning_mode_duration: 0\n      parameters: [{name: priority_mode, value: strict}]\n";
    let root = start_server(dir.path(), "root", Some(cfg), None);
    let last = three_rounds(root.addr("grpc")).await;
    assert_eq!(last["high"], 60.0, "priority 2 gets its full demand: {last:?}");
    assert_eq!(last["low-a"], 20.0, "priority 1 shares the rest: {last:?}");
    assert_eq!(last["low-b"], 20.0);
    // Without the parameter the same demand is shared max-min fairly (Doorman-compatible).
    let plain = start_server(
        dir.path(),
        "plain",
        Some(&cfg.replace("      parameters: [{name: priority_mode, value: strict}]\n", "")),
        None,
    );
    let last = three_rounds(plain.addr("grpc")).await;
    let third = 100.0 / 3.0;
    assert!(last.values().all(|v| (v - third).abs() < 1e-9), "{last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_sidecars_under_two_intermediates_split_the_root_fairly() {
    use std::sync::Arc;
    use support::load::{Tally, drive};
    use support::upstream::Upstream;

    let dir = tempfile::tempdir().unwrap();
    let root = start_server(dir.path(), "root", Some(ROOT), None);
    let root_addr = root.addr("grpc").to_string();
    let mids = [
        start_server(dir.path(), "i1", None, Some(&root_addr)),
        start_server(dir.path(), "i2", None, Some(&root_addr)),
    ];
    let mut proxies = Vec::new();
    let mut upstreams = Vec::new();
    for i in 0..4 {
        let up = Upstream::start().await;
        let routes = write_file(
            dir.path(),
            &format!("p{i}.yaml"),
            &format!(
                "doorman:\n  servers: [\"{}\"]\n  client_id: sidecar-{i}\n  min_interval: 500ms\n\
                 upstreams:\n  up: {{ url: \"http://{}\" }}\n\
                 resources:\n  api: {{ kind: rate, capacity: 100, burst: 20, wants: auto }}\n\
                 routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
                mids[i / 2].addr("grpc"),
                up.addr
            ),
        );
        proxies.push(Usher::proxy(&routes));
        upstreams.push(up);
    }
    let tally = Arc::new(Tally::default());
    let loads: Vec<_> = proxies
        .iter()
        .map(|p| tokio::spawn(drive(p.addr("listen"), 100.0, Duration::from_secs(32), tally.clone())))
        .collect();
    // The first sidecars to ask take more; shares settle as leases are refreshed down the tree.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let before: Vec<u64> = upstreams.iter().map(|u| u.stats.requests()).collect();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let secs = t0.elapsed().as_secs_f64();
    let rates: Vec<f64> = upstreams.iter().zip(&before).map(|(u, b)| (u.stats.requests() - b) as f64 / secs).collect();
    let total: f64 = rates.iter().sum();
    assert!(total <= 100.0 * 1.02, "admitted {total:.1}/s across the tree, over 102% of 100: {rates:?}");
    for r in &rates {
        assert!((r - 25.0).abs() <= 25.0 * 0.05, "each sidecar admits 25/s ± 5%: {rates:?}");
    }
    for l in loads {
        l.await.unwrap();
    }
    assert_eq!(tally.other.load(std::sync::atomic::Ordering::Relaxed), 0, "the apps saw only 200 and 429");
}

/// A capacity request that would hand a newcomer nothing is held (at most
/// 1.5 s, and never past half the caller's deadline) and decided again as
/// soon as capacity is freed: at an intermediate with no lease from its parent
/// yet, when the parent's first lease arrives; at any server, when a client
/// holding the newcomer's share comes down. Without it the newcomer got a
/// lease of 0 and asked again a second later (a fresh tree's sidecars refused
/// everything meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_is_answered_with_a_share_as_soon_as_one_is_free() {
    let dir = tempfile::tempdir().unwrap();
    let root = start_server(dir.path(), "root", Some(ROOT), None);
    let root_addr = root.addr("grpc").to_string();
    let ask = |client: &str, resource: &str, wants: f64| GetCapacityRequest {
        client_id: client.into(),
        resource: vec![ResourceRequest {
            returned: None,
            reserve: None,
            backlog: None,
            unit_account: None,
            window: None,
            upstream_quota: None,
            resource_id: resource.into(),
            priority: 0,
            has: None,
            wants,
        }],
    };

    // A fresh intermediate: the first answer carries the parent's share.
    let i1 = start_server(dir.path(), "i1", None, Some(&root_addr));
    let mut c = CapacityClient::connect(format!("http://{}", i1.addr("grpc"))).await.unwrap();
    let started = Instant::now();
    let r = c.get_capacity(ask("c1", "api", 30.0)).await.unwrap().into_inner();
    let lease = r.response[0].gets;
    assert_eq!(lease.capacity, 30.0, "the first answer carries the share: {r:?}");
    assert!(lease.expiry_time > now_secs(), "and a lease that has not lapsed: {r:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "answered within the wait: {:?}", started.elapsed());

    // At the root: a first-come client holds all 100; a newcomer's request
    // is held until that client's next refresh brings it down to its half.
    let mut a = CapacityClient::connect(format!("http://{root_addr}")).await.unwrap();
    let r = a.get_capacity(ask("first", "db", 100.0)).await.unwrap().into_inner();
    assert_eq!(r.response[0].gets.capacity, 100.0);
    let mut b = a.clone();
    let newcomer = tokio::spawn(async move {
        let asked = Instant::now();
        let r = b.get_capacity(ask("newcomer", "db", 100.0)).await.unwrap().into_inner();
        (r.response[0].gets.capacity, asked.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut again = ask("first", "db", 100.0);
    again.resource[0].has = Some(r.response[0].gets);
    let r = a.get_capacity(again).await.unwrap().into_inner();
    assert_eq!(r.response[0].gets.capacity, 50.0, "the first-come client comes down to its share: {r:?}");
    let (got, took) = newcomer.await.unwrap();
    assert_eq!(got, 50.0, "the newcomer is answered with the freed half");
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(1), "held until it was freed: {took:?}");

    // A deadline shorter than the wait is kept: with no parent to ask, the
    // answer (nothing yet, come back soon) comes within half of 200 ms.
    drop(root);
    let mut req = tonic::Request::new(ask("c2", "other", 30.0));
    req.set_timeout(Duration::from_millis(200));
    let r = c.get_capacity(req).await.expect("answered within the caller's deadline").into_inner();
    assert_eq!(r.response[0].gets.capacity, 0.0, "no parent to ask, nothing to hand out: {r:?}");
}
