//! Master election on a real etcd (Debian's etcd-server) with real `usher
//! server` processes, and configuration stored in etcd.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::etcd::{EtcdServer, elected_member, elected_member_at};
use support::{Usher, http_get, metric};
use usher_core::clock::Clock;
use usher_lease::core::CoreConfig;
use usher_lease::transport::{GrpcTransport, Transport};
use usher_lease::{Capacity, Enforcer, KeyDemand, LeaseClient, OnExpiry};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{self as proto, GetCapacityRequest, ResourceRequest};
use usher_server::etcd::Etcd;

/// Doorman's grants, without spare capacity (`spare: keep`): these tests follow
/// exact leases through failovers.
const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 8, refresh_interval: 2, learning_mode_duration: 8, parameters: [{ name: spare, value: keep }] }\n";

/// Records what the lease client lets the sidecar use.
struct Recorder {
    seen: Mutex<Vec<(Instant, Capacity)>>,
}

impl Enforcer for Recorder {
    fn demand(&self) -> Vec<KeyDemand> {
        vec![KeyDemand {
            resource_id: "api".into(),
            priority: 0,
            wants: 40.0,
            on_expiry: OnExpiry::Pessimistic,
            safe_capacity: None,
            pressure: false,
            quota: None,
            account: None,
            window: None,
        }]
    }

    fn apply(&self, capacities: &[(String, Capacity)]) {
        if let Some((_, c)) = capacities.first() {
            self.seen.lock().unwrap().push((Instant::now(), *c));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_servers_elect_one_master_and_fail_over() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::write_file(dir.path(), "r.yaml", CONFIG);
    let mut members: Vec<(Usher, String)> =
        (0..3).map(|_| elected_member(&etcd.endpoint, &cfg, "/test/master")).collect();
    let addrs: Vec<String> = members.iter().map(|(_, a)| a.clone()).collect();
    assert_eventually!(
        members.iter().filter(|(u, _)| u.is_master()).count() == 1,
        Duration::from_secs(15),
        "exactly one master is elected"
    );
    let master = members.iter().position(|(u, _)| u.is_master()).unwrap();

    // Any member answers Discovery with the master (once it has read the
    // election key: followers poll it); a follower redirects capacity requests.
    let follower = (master + 1) % 3;
    let mut c = CapacityClient::connect(format!("http://{}", addrs[follower])).await.unwrap();
    let mut d = c.discovery(proto::DiscoveryRequest {}).await.unwrap().into_inner();
    let until = Instant::now() + Duration::from_secs(5);
    while d.mastership.master_address.is_none() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        d = c.discovery(proto::DiscoveryRequest {}).await.unwrap().into_inner();
    }
    assert!(!d.is_master);
    assert_eq!(d.mastership.master_address.as_deref(), Some(addrs[master].as_str()));
    let r = c
        .get_capacity(GetCapacityRequest {
            client_id: "x".into(),
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
                wants: 1.0,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.response.is_empty());
    assert_eq!(r.mastership.unwrap().master_address.as_deref(), Some(addrs[master].as_str()));

    // A sidecar's lease client, knowing every member, holds a lease.
    let transport: Arc<dyn Transport> = Arc::new(GrpcTransport::new(Duration::from_secs(2), Duration::from_secs(1)));
    let recorder = Arc::new(Recorder { seen: Mutex::new(Vec::new()) });
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut cfg = CoreConfig::new("sidecar-1", addrs.clone());
    cfg.min_interval = Duration::from_millis(200);
    let (client, task) = LeaseClient::start(cfg, Clock::system(), transport, recorder.clone(), None, shutdown.clone());
    assert_eventually!(
        client.status().keys.first().is_some_and(|k| k.has == Some(40.0)),
        // The master's learning mode (8 s) plus a refresh interval (2 s) and a loaded machine.
        Duration::from_secs(25),
        "the sidecar gets its lease: {:?}",
        client.status()
    );
    let leased_at = Instant::now();

    // Kill the master: another member takes over within TTL + 2 s.
    let killed_at = Instant::now();
    members[master].0.child.kill().unwrap();
    let rest: Vec<usize> = (0..3).filter(|i| *i != master).collect();
    assert_eventually!(
        rest.iter().filter(|i| members[**i].0.is_master()).count() == 1,
        Duration::from_secs(5),
        "a new master within TTL + 2 s"
    );
    let took = killed_at.elapsed();
    let new_master = *rest.iter().find(|i| members[**i].0.is_master()).unwrap();
    assert!(took <= Duration::from_secs(5), "failover took {took:?}");

    // The sidecar follows; the new master, in learning mode, hands its `has` back.
    assert_eventually!(
        client.status().master.as_deref() == Some(addrs[new_master].as_str()),
        Duration::from_secs(10),
        "the sidecar follows the new master: {:?}",
        client.status()
    );
    // Its refresh reaches the new master right after it learned the address.
    let has_at_new_master = || {
        let (_, body) = http_get(members[new_master].0.addr("admin"), "/debug/resources?resource=api&format=json");
        serde_json::from_str::<serde_json::Value>(&body).ok().map(|v| v["leases"][0]["has"].clone())
    };
    assert_eventually!(
        has_at_new_master() == Some(serde_json::json!(40.0)),
        Duration::from_secs(5),
        "learning mode handed has back: {:?}",
        has_at_new_master()
    );
    let seen = recorder.seen.lock().unwrap().clone();
    let dropped: Vec<_> = seen.iter().filter(|(t, c)| *t > leased_at && *c != Capacity::Limited(40.0)).collect();
    assert!(dropped.is_empty(), "the sidecar kept enforcing its lease throughout: {dropped:?}");
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn configuration_is_read_from_etcd_and_kept_when_invalid() {
    let etcd = EtcdServer::start();
    let client = Etcd::new(std::slice::from_ref(&etcd.endpoint), Duration::from_secs(3));
    client.put("/test/config", CONFIG).await.unwrap();
    let u = Usher::server(&[
        "--config",
        "etcd:/test/config",
        "--etcd-endpoints",
        &etcd.endpoint,
        "--election-key",
        "/test/cfg-master",
        "--advertise-addr",
        "127.0.0.1:1",
        "--min-request-interval",
        "0s",
    ]);
    assert_eventually!(u.is_master(), Duration::from_secs(10), "the only member becomes master");
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    let ask = |wants| GetCapacityRequest {
        client_id: "a".into(),
        resource: vec![ResourceRequest {
            returned: None,
            reserve: None,
            backlog: None,
            unit_account: None,
            window: None,
            upstream_quota: None,
            resource_id: "r".into(),
            priority: 0,
            has: Some(proto::Lease { expiry_time: 0, refresh_interval: 1, capacity: 0.0 }),
            wants,
        }],
    };
    let no_learning = CONFIG.replace("learning_mode_duration: 8", "learning_mode_duration: 0");
    client.put("/test/config", &no_learning.replace("capacity: 100", "capacity: 70")).await.unwrap();
    let mut got = 0.0;
    // Within 30 s: five etcd clusters and their servers start side by side here.
    for _ in 0..150 {
        got = c.get_capacity(ask(500.0)).await.unwrap().into_inner().response[0].gets.capacity;
        if got == 70.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(got, 70.0, "a change stored in etcd takes effect; log:\n{}", u.log());
    client.put("/test/config", "resources: [{identifier_glob: x}]\n").await.unwrap();
    u.wait_for_log("configuration rejected", Duration::from_secs(10));
    assert!(u.log().contains("etcd:/test/config:1:13: resources[0].capacity: missing required field"), "{}", u.log());
    assert_eq!(c.get_capacity(ask(500.0)).await.unwrap().into_inner().response[0].gets.capacity, 70.0);
    let (_, text) = http_get(u.addr("admin"), "/metrics");
    assert!(metric(&text, "usher_config_reload_errors_total", &[]).unwrap() >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_root_failover_no_intermediate_hands_out_zero() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::write_file(dir.path(), "root.yaml", CONFIG);
    let mut roots: Vec<(Usher, String)> = (0..2).map(|_| elected_member(&etcd.endpoint, &cfg, "/test/root")).collect();
    let parents = format!("{},{}", roots[0].1, roots[1].1);
    let mid = Usher::server(&["--parent", &parents, "--min-request-interval", "0s"]);
    // Without --config an intermediate shares its parent's grants: it must not claim the root's default.
    assert!(mid.log().contains("shares what its parent grants"), "{}", mid.log());
    assert!(!mid.log().contains("built-in default resources"), "{}", mid.log());
    let mut c = CapacityClient::connect(format!("http://{}", mid.addr("grpc"))).await.unwrap();
    let ask = || GetCapacityRequest {
        client_id: "leaf".into(),
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
            wants: 30.0,
        }],
    };
    let mut got = 0.0;
    for _ in 0..100 {
        got = c.get_capacity(ask()).await.unwrap().into_inner().response[0].gets.capacity;
        if got == 30.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(got, 30.0, "the leaf gets its demand through the intermediate");
    let master = roots.iter().position(|(u, _)| u.is_master()).unwrap();
    roots[master].0.child.kill().unwrap();
    let other = 1 - master;
    // Through the failover and the new root's learning period, the leaf keeps its 30.
    let deadline = Instant::now() + Duration::from_secs(14);
    let mut saw_new_master = false;
    while Instant::now() < deadline {
        let g = c.get_capacity(ask()).await.unwrap().into_inner().response[0].gets.capacity;
        assert_eq!(g, 30.0, "the intermediate never hands out less during the root failover");
        saw_new_master |= roots[other].0.is_master();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(saw_new_master);
    let (_, body) = http_get(roots[other].0.addr("admin"), "/debug/resources?resource=api&format=json");
    let leases: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(leases["leases"][0]["kind"], "server");
    assert_eq!(leases["leases"][0]["has"], 30.0, "learning mode handed the intermediate's has back: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_keeps_enforcing_through_a_master_failover() {
    use std::sync::atomic::Ordering;
    use support::load::{Tally, drive};
    use support::upstream::Upstream;

    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::write_file(dir.path(), "r.yaml", CONFIG);
    let mut members: Vec<(Usher, String)> =
        (0..3).map(|_| elected_member(&etcd.endpoint, &cfg, "/test/sidecar-master")).collect();
    let servers: Vec<String> = members.iter().map(|(_, a)| format!("\"{a}\"")).collect();
    let up = Upstream::start().await;
    let routes = support::write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "doorman:\n  servers: [{}]\n  client_id: app-0\n  min_interval: 200ms\n  backoff: {{ initial: 200ms, max: 1s }}\n\
             upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 40, burst: 4, wants: 40, on_expiry: pessimistic }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
            servers.join(", "),
            up.addr
        ),
    );
    assert_eventually!(
        members.iter().filter(|(u, _)| u.is_master()).count() == 1,
        Duration::from_secs(15),
        "one master"
    );
    let proxy = Usher::proxy(&routes);
    let lease = |u: &Usher| -> (String, f64) {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        (
            v["lease"]["keys"][0]["mode"].as_str().unwrap_or("").to_string(),
            v["lease"]["keys"][0]["has"].as_f64().unwrap_or(0.0),
        )
    };
    assert_eventually!(
        lease(&proxy) == ("leased".to_string(), 40.0),
        Duration::from_secs(10),
        "the sidecar holds its lease"
    );
    let tally = Arc::new(Tally::default());
    let load = tokio::spawn(drive(proxy.addr("listen"), 80.0, Duration::from_secs(12), tally.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let master = members.iter().position(|(u, _)| u.is_master()).unwrap();
    members[master].0.child.kill().unwrap();
    let n0 = up.stats.requests();
    let t0 = Instant::now();
    // Throughout the failover the sidecar keeps its lease and keeps admitting 40/s.
    while t0.elapsed() < Duration::from_secs(8) {
        assert_eq!(lease(&proxy), ("leased".to_string(), 40.0), "the lease is enforced throughout");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rate = (up.stats.requests() - n0) as f64 / t0.elapsed().as_secs_f64();
    assert!((rate - 40.0).abs() <= 4.0, "admitted {rate:.1}/s through the failover");
    load.await.unwrap();
    assert_eq!(tally.other.load(Ordering::Relaxed), 0, "the app saw no 5xx");
    let new_master = (0..3).find(|i| *i != master && members[*i].0.is_master()).expect("a new master");
    let (_, body) = http_get(members[new_master].0.addr("admin"), "/debug/resources?resource=api&format=json");
    assert!(
        body.contains("app-0") && body.contains("\"has\": 40.0"),
        "the new master learned the sidecar's lease: {body}"
    );
}

/// A client that reaches a server while it is still starting (a fresh tree
/// starts etcd, servers and sidecars together) is not refused, nor told "no
/// master": the gRPC port is bound before etcd is waited for, and Discovery
/// is held (at most 1.5 s) until the election names a master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reaches_a_starting_server_is_answered_with_its_master() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::write_file(dir.path(), "r.yaml", CONFIG);
    let endpoint = etcd.endpoint.clone();
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let starting = tokio::task::spawn_blocking(move || elected_member_at(&endpoint, &cfg, "/test/starting", port, &[]));
    let asked = Instant::now();
    let client = loop {
        match CapacityClient::connect(format!("http://{addr}")).await {
            Ok(c) => break c,
            Err(_) => {
                assert!(asked.elapsed() < Duration::from_secs(20), "never bound {addr}");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    let mut client = client;
    let r = client.discovery(proto::DiscoveryRequest {}).await.expect("discovery answered").into_inner();
    let (member, _) = starting.await.unwrap();
    assert!(r.is_master, "the first answer names the master (itself): {r:?}\n{}", member.log());
    assert_eq!(r.mastership.master_address.as_deref(), Some(addr.as_str()));
}
