//! The capacity server through its real interfaces: the `usher server`
//! binary on 127.0.0.1:0, driven by a tonic client and its admin HTTP port.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{Usher, alias_bomb, http_get, metric, peak_rss_kib, write_file};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{self as proto, GetCapacityRequest, ResourceRequest};

const CONFIG: &str = r#"
resources:
  # Doorman's grants, without spare capacity: the tests follow exact leases.
  - identifier_glob: fair
    capacity: 120
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0, parameters: [{ name: spare, value: keep }] }
  - identifier_glob: prop
    capacity: 120
    algorithm: { kind: PROPORTIONAL_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }
  - identifier_glob: short
    capacity: 100
    safe_capacity: 7
    algorithm: { kind: FAIR_SHARE, lease_length: 2, refresh_interval: 1, learning_mode_duration: 0 }
  - identifier_glob: learn
    capacity: 100
    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 5, learning_mode_duration: 30 }
  - identifier_glob: "*"
    capacity: 1000
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15, learning_mode_duration: 0 }
"#;

struct Server {
    usher: Usher,
    dir: tempfile::TempDir,
}

impl Server {
    fn start(config: &str, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let cfg = write_file(dir.path(), "resources.yaml", config);
        let mut args = vec![
            "server",
            "--config",
            cfg.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--min-request-interval",
            "0s",
        ];
        args.extend_from_slice(extra);
        let usher = Usher::start(&args, &[], "usher server listening");
        Server { usher, dir }
    }

    async fn client(&self) -> CapacityClient<tonic::transport::Channel> {
        CapacityClient::connect(format!("http://{}", self.usher.addr("grpc"))).await.unwrap()
    }

    fn admin(&self, path: &str) -> (u16, String) {
        http_get(self.usher.addr("admin"), path)
    }

    fn status(&self) -> serde_json::Value {
        let (code, body) = self.admin("/debug/status?format=json");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

fn ask(resource: &str, wants: f64) -> ResourceRequest {
    ResourceRequest { resource_id: resource.into(), wants, ..Default::default() }
}

/// One GetCapacity for `client`; returns the grants by resource id.
async fn get(
    c: &mut CapacityClient<tonic::transport::Channel>,
    client: &str,
    asks: Vec<ResourceRequest>,
) -> Vec<(String, f64)> {
    let resp =
        c.get_capacity(GetCapacityRequest { client_id: client.into(), resource: asks }).await.unwrap().into_inner();
    assert!(resp.mastership.is_none());
    resp.response.into_iter().map(|r| (r.resource_id, r.gets.capacity)).collect()
}

async fn grant(c: &mut CapacityClient<tonic::transport::Channel>, client: &str, resource: &str, wants: f64) -> f64 {
    let g = get(c, client, vec![ask(resource, wants)]).await;
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].0, resource);
    g[0].1
}

#[tokio::test]
async fn fair_and_proportional_sequences_with_release() {
    let s = Server::start(CONFIG, &[]);
    let mut c = s.client().await;
    // First round: the first client takes everything it can; later ones find nothing unused.
    assert_eq!(
        get(&mut c, "c0", vec![ask("fair", 1000.0), ask("prop", 60.0)]).await,
        vec![("fair".into(), 120.0), ("prop".into(), 60.0)]
    );
    assert_eq!(
        get(&mut c, "c1", vec![ask("fair", 60.0), ask("prop", 60.0)]).await,
        vec![("fair".into(), 0.0), ("prop".into(), 60.0)]
    );
    assert_eq!(
        get(&mut c, "c2", vec![ask("fair", 10.0), ask("prop", 10.0)]).await,
        vec![("fair".into(), 0.0), ("prop".into(), 0.0)]
    );
    // Second round: max-min (fair) and Doorman's proportional share.
    assert_eq!(grant(&mut c, "c0", "fair", 1000.0).await, 55.0);
    assert_eq!(grant(&mut c, "c1", "fair", 60.0).await, 55.0);
    assert_eq!(grant(&mut c, "c2", "fair", 10.0).await, 10.0);
    assert_eq!(grant(&mut c, "c0", "prop", 60.0).await, 55.0);
    assert_eq!(grant(&mut c, "c1", "prop", 60.0).await, 55.0);
    assert_eq!(grant(&mut c, "c2", "prop", 10.0).await, 10.0, "all that c0 and c1 leave");
    // Release c0: its capacity becomes free at once.
    c.release_capacity(proto::ReleaseCapacityRequest {
        client_id: "c0".into(),
        resource_id: vec!["fair".into(), "unknown".into()],
    })
    .await
    .unwrap();
    assert_eq!(grant(&mut c, "c1", "fair", 60.0).await, 60.0);
    let st = s.status();
    let fair = st["resources"].as_array().unwrap().iter().find(|r| r["id"] == "fair").unwrap();
    assert_eq!(fair["clients"], 2);
    assert_eq!(fair["sum_has"], 70.0);
}

#[tokio::test]
async fn lease_expiry_frees_capacity() {
    let s = Server::start(CONFIG, &[]);
    let mut c = s.client().await;
    let r = c
        .get_capacity(GetCapacityRequest { client_id: "a".into(), resource: vec![ask("short", 100.0)] })
        .await
        .unwrap()
        .into_inner();
    let lease = &r.response[0];
    assert_eq!(lease.gets.capacity, 100.0);
    assert_eq!(lease.gets.refresh_interval, 1);
    assert_eq!(lease.safe_capacity, Some(7.0));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!((lease.gets.expiry_time - (now + 2)).abs() <= 1, "expiry {} vs now {now}", lease.gets.expiry_time);
    assert_eq!(grant(&mut c, "b", "short", 100.0).await, 0.0, "a holds everything");
    // a never refreshes: once its lease expires, b gets the whole capacity.
    let mut got = 0.0;
    for _ in 0..100 {
        got = grant(&mut c, "b", "short", 100.0).await;
        if got == 100.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 100.0);
    let leases: serde_json::Value =
        serde_json::from_str(&s.admin("/debug/resources?resource=short&format=json").1).unwrap();
    let clients: Vec<&str> =
        leases["leases"].as_array().unwrap().iter().map(|l| l["client_id"].as_str().unwrap()).collect();
    assert_eq!(clients, vec!["b"], "the expired lease is gone");
}

#[tokio::test]
async fn learning_mode_hands_back_has() {
    let s = Server::start(CONFIG, &[]);
    let mut c = s.client().await;
    let with_has = ResourceRequest {
        returned: None,
        reserve: None,
        backlog: None,
        unit_account: None,
        window: None,
        upstream_quota: None,
        resource_id: "learn".into(),
        priority: 1,
        has: Some(proto::Lease { expiry_time: 0, refresh_interval: 5, capacity: 40.0 }),
        wants: 100.0,
    };
    assert_eq!(get(&mut c, "a", vec![with_has]).await[0].1, 40.0);
    assert_eq!(grant(&mut c, "b", "learn", 100.0).await, 0.0, "no has reported: nothing handed out while learning");
    let (_, text) = s.admin("/metrics");
    assert_eq!(metric(&text, "usher_server_resource_learning_mode", &[("resource", "learn")]), Some(1.0));
    assert_eq!(metric(&text, "usher_server_resource_wants", &[("resource", "learn")]), Some(200.0));
    assert_eq!(metric(&text, "usher_server_resource_has", &[("resource", "learn")]), Some(40.0));
}

/// Learning mode believes the lease a client reports (`has`) only up to the
/// resource's capacity, and its expiry only up to a lease length from now
/// (`learning_grant` and the reported expiry's cap in server/store.rs): a
/// client that claims 1e300 until 30 years from now is handed back the
/// capacity for one lease length, and once that lease has lapsed (and been
/// held as long again: the liar may still run on it) an honest client gets
/// what it asks for.
#[tokio::test]
async fn learning_mode_believes_a_liar_only_up_to_the_capacity_and_a_lease_length() {
    const LEASE: i64 = 8;
    // Learning lasts 3 s (less than its bound, refresh × 7/6 + 3 s), so the
    // liar's lease is still running when it ends.
    // Doorman's grants, without spare capacity: the honest client gets exactly what it asks for.
    let config = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 8, refresh_interval: 2, learning_mode_duration: 3, parameters: [{ name: spare, value: keep }] }\n";
    let s = Server::start(config, &[]);
    let mut c = s.client().await;
    let unix_now = || SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;

    let (asked, before) = (Instant::now(), unix_now());
    let liar = ResourceRequest {
        returned: None,
        reserve: None,
        backlog: None,
        unit_account: None,
        window: None,
        upstream_quota: None,
        resource_id: "r".into(),
        priority: 0,
        has: Some(proto::Lease { expiry_time: before + 1_000_000_000, refresh_interval: 2, capacity: 1e300 }),
        wants: 5.0,
    };
    let resp = c
        .get_capacity(GetCapacityRequest { client_id: "liar".into(), resource: vec![liar] })
        .await
        .unwrap()
        .into_inner();
    let after = unix_now();
    let lease = &resp.response[0].gets;
    // Outside learning mode a client wanting 5 gets 5: 100 is its report, capped.
    assert_eq!(lease.capacity, 100.0, "the reported 1e300 is believed up to the capacity");
    // (A lease ends on the whole second at or after its length.)
    assert!(
        (before + LEASE..=after + LEASE + 1).contains(&lease.expiry_time),
        "the reported expiry is believed up to a lease length from now: {} not in {}..={}",
        lease.expiry_time,
        before + LEASE,
        after + LEASE + 1
    );
    let (_, text) = s.admin("/metrics");
    assert_eq!(metric(&text, "usher_server_resource_has", &[("resource", "r")]), Some(100.0));

    // Learning ends; the liar's capped lease still holds the whole capacity.
    assert_eventually!(
        metric(&s.admin("/metrics").1, "usher_server_resource_learning_mode", &[("resource", "r")]) == Some(0.0),
        Duration::from_secs(10),
        "learning mode ends"
    );
    let ended = asked.elapsed();
    assert!(ended < Duration::from_secs(LEASE as u64 - 1), "learning ended {ended:?} after the liar asked");
    // Decided before the answer came back, so before the liar's lease ends.
    while asked.elapsed() < Duration::from_secs(LEASE as u64) {
        let got = grant(&mut c, "honest", "r", 60.0).await;
        if asked.elapsed() < Duration::from_secs(LEASE as u64) {
            assert_eq!(got, 0.0, "the liar's lease is believed until it ends ({:?})", asked.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The lapsed lease is held for as long again; then the honest client
    // gets all it wants. A believed expiry 30 years out would never lapse.
    let mut got = 0.0;
    while asked.elapsed() < Duration::from_secs(2 * LEASE as u64 + 5) {
        got = grant(&mut c, "honest", "r", 60.0).await;
        if got == 60.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 60.0, "the honest client's share, {:?} after the liar asked", asked.elapsed());
}

#[tokio::test]
async fn server_capacity_sums_bands_and_carries_the_algorithm() {
    let config = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 10, learning_mode_duration: 0 }\n";
    let s = Server::start(config, &[]);
    let mut c = s.client().await;
    let bands = (1..=5).map(|i| proto::PriorityBandAggregate { priority: i, num_clients: i, wants: 200.0 }).collect();
    let r = c
        .get_server_capacity(proto::GetServerCapacityRequest {
            server_id: "child:1".into(),
            resource: vec![proto::ServerCapacityResourceRequest {
                upstream_quota: None,
                resource_id: "x".into(),
                has: None,
                wants: bands,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let x = &r.response[0];
    assert_eq!(x.gets.capacity, 100.0);
    let alg = x.algorithm.as_ref().unwrap();
    assert_eq!(alg.kind, proto::algorithm::Kind::FairShare as i32);
    assert_eq!((alg.lease_length, alg.refresh_interval), (60, 10));
    assert_eq!(x.safe_capacity, Some(100.0 / 15.0), "dynamic: capacity / the 15 subclients");
    let d = c.discovery(proto::DiscoveryRequest {}).await.unwrap().into_inner();
    assert!(d.is_master);
    assert_eq!(d.mastership.master_address.as_deref(), Some(s.usher.fields["server_id"].as_str()));
}

#[tokio::test]
async fn bad_requests_are_invalid_argument_and_store_nothing() {
    let s = Server::start(CONFIG, &[]);
    let mut c = s.client().await;
    let cases: Vec<(GetCapacityRequest, &str)> = vec![
        (GetCapacityRequest { client_id: "".into(), resource: vec![ask("fair", 1.0)] }, "client_id must not be empty"),
        (
            GetCapacityRequest { client_id: "a".into(), resource: vec![ask("", 1.0)] },
            "resource[0].resource_id must not be empty",
        ),
        (
            GetCapacityRequest { client_id: "a".into(), resource: vec![ask("fair", 1.0), ask("prop", f64::NAN)] },
            "resource[1].wants must be a finite number >= 0, got NaN",
        ),
        (
            GetCapacityRequest { client_id: "a".into(), resource: vec![ask("fair", f64::INFINITY)] },
            "resource[0].wants must be a finite number >= 0, got inf",
        ),
        (
            GetCapacityRequest { client_id: "a".into(), resource: vec![ask("fair", -1.0)] },
            "resource[0].wants must be a finite number >= 0, got -1",
        ),
        (
            GetCapacityRequest { client_id: "a".into(), resource: vec![ask("fair", 1.0), ask("fair", 2.0)] },
            "resource[1]: resource `fair` appears more than once",
        ),
    ];
    for (req, want) in cases {
        let err = c.get_capacity(req).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(want), "{:?} does not contain {want:?}", err.message());
    }
    let bad_band = proto::GetServerCapacityRequest {
        server_id: "s".into(),
        resource: vec![proto::ServerCapacityResourceRequest {
            upstream_quota: None,
            resource_id: "fair".into(),
            has: None,
            wants: vec![proto::PriorityBandAggregate { priority: 1, num_clients: 0, wants: 5.0 }],
        }],
    };
    let err = c.get_server_capacity(bad_band).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("resource[0].wants[0].num_clients must be at least 1, got 0"), "{}", err.message());
    assert_eq!(s.status()["resources"].as_array().unwrap().len(), 0, "nothing was stored");
    let (_, text) = s.admin("/metrics");
    assert_eq!(
        metric(&text, "usher_server_rpc_errors_total", &[("method", "GetCapacity"), ("code", "InvalidArgument")]),
        Some(6.0)
    );
}

#[tokio::test]
async fn reload_on_file_change_and_sighup_keeps_old_config_when_invalid() {
    let s = Server::start(CONFIG, &[]);
    let path = s.dir.path().join("resources.yaml");
    let mut c = s.client().await;
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 1000.0);

    // A change to the file is picked up without a signal.
    std::fs::write(&path, CONFIG.replace("capacity: 1000", "capacity: 300")).unwrap();
    let mut got = 0.0;
    for _ in 0..100 {
        got = grant(&mut c, "a", "other", 5000.0).await;
        if got == 300.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 300.0, "file change applied\n{}", s.usher.log());

    // An invalid file is rejected; the old config stays in force.
    std::fs::write(&path, "resources:\n  - identifier_glob: x\n    capacity: oops\n").unwrap();
    s.usher.signal("HUP");
    s.usher.wait_for_log(
        "resources.yaml:3:15: resources[0].capacity: expected a number, found `oops`",
        Duration::from_secs(10),
    );
    assert!(s.usher.log().contains("configuration rejected, keeping the previous one"), "{}", s.usher.log());
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 300.0);
    let (_, text) = s.admin("/metrics");
    assert!(metric(&text, "usher_config_reload_errors_total", &[]).unwrap() >= 1.0);
    assert!(s.status()["config_error"].as_str().unwrap().contains("expected a number"));

    // SIGHUP applies a valid file at once. Write it in a temporary file and
    // rename it over the config, as editors and ConfigMap updates do.
    let tmp = s.dir.path().join("next.yaml");
    std::fs::write(&tmp, CONFIG.replace("capacity: 1000", "capacity: 50")).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    s.usher.signal("HUP");
    let mut got = 0.0;
    for _ in 0..100 {
        got = grant(&mut c, "a", "other", 5000.0).await;
        if got == 50.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got, 50.0);
    assert!(s.status()["config_error"].is_null());
}

/// A live reload into a resources file of a kilobyte whose nested aliases
/// would expand to 43 million nodes is refused at once, naming the file and
/// the alias, without the memory the expansion would take; the server keeps
/// serving its last good configuration and still applies the next good file.
#[tokio::test]
async fn a_reload_into_an_alias_bomb_is_refused_at_once_and_the_old_config_stays() {
    let mut s = Server::start(CONFIG, &[]);
    let path = s.dir.path().join("resources.yaml");
    let mut c = s.client().await;
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 1000.0);
    let peak = peak_rss_kib(s.usher.child.id());

    let tmp = s.dir.path().join("next.yaml");
    std::fs::write(&tmp, format!("resources: []\n{}", alias_bomb())).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let want = format!("{}:8:17: this alias would make the document more than 200000 nodes", path.display());
    let started = Instant::now();
    s.usher.wait_for_log(&want, Duration::from_secs(10));
    let took = started.elapsed();
    assert!(s.usher.log().contains("configuration rejected, keeping the previous one"), "{}", s.usher.log());
    assert_eq!(s.usher.child.try_wait().unwrap(), None, "the server is still running");
    let grown = peak_rss_kib(s.usher.child.id()).saturating_sub(peak);
    eprintln!("figures: refused {took:?} after it was written; peak resident memory +{grown} KiB");
    assert!(grown < 64 * 1024, "the peak resident memory grew by {grown} KiB");
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 1000.0, "the last good configuration stays");
    let (_, text) = s.admin("/metrics");
    assert_eq!(metric(&text, "usher_config_reload_errors_total", &[]), Some(1.0));
    assert!(s.status()["config_error"].as_str().is_some_and(|e| e.contains(&want)), "{}", s.status());

    // The reloader lives on: the next good file is applied.
    std::fs::write(&tmp, CONFIG.replace("capacity: 1000", "capacity: 300")).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    s.usher.wait_for_log("configuration reloaded", Duration::from_secs(10));
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 300.0);
    assert!(s.status()["config_error"].is_null(), "{}", s.status());
}

#[tokio::test]
async fn configmap_symlink_swap_is_picked_up() {
    // Kubernetes mounts config.yaml -> ..data/config.yaml, ..data -> ..TIMESTAMP,
    // and updates by re-pointing ..data atomically.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("..v1")).unwrap();
    std::fs::write(d.join("..v1/resources.yaml"), CONFIG).unwrap();
    std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/resources.yaml", d.join("resources.yaml")).unwrap();
    let cfg = d.join("resources.yaml");
    let usher = Usher::server(&["--config", cfg.to_str().unwrap(), "--min-request-interval", "0s"]);
    let mut c = CapacityClient::connect(format!("http://{}", usher.addr("grpc"))).await.unwrap();
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 1000.0);
    std::fs::create_dir(d.join("..v2")).unwrap();
    std::fs::write(d.join("..v2/resources.yaml"), CONFIG.replace("capacity: 1000", "capacity: 222")).unwrap();
    std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    usher.wait_for_log("configuration reloaded", Duration::from_secs(10));
    assert_eq!(grant(&mut c, "a", "other", 5000.0).await, 222.0);
}

#[test]
fn bad_config_at_startup_exits_64_naming_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(
        dir.path(),
        "bad.yaml",
        "resources:\n  - identifier_glob: a\n    capacity: 10\n    algorithm: { kind: FAIR_SHARE, lease_length: 5, refresh_interval: 10 }\n",
    );
    let (code, _out, err) = support::run_usher(&[
        "server",
        "--config",
        cfg.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("bad.yaml:4:50: resources[0].algorithm.lease_length: lease_length (5) must be at least refresh_interval (10)"), "{err}");
    assert!(err.contains("bad.yaml:2:3: resources: no catch-all entry"), "every error is reported: {err}");
}

#[tokio::test]
async fn metrics_and_status_reflect_state_and_sigterm_exits_cleanly() {
    let mut s = Server::start(CONFIG, &[]);
    let mut c = s.client().await;
    grant(&mut c, "a", "fair", 30.0).await;
    grant(&mut c, "b", "fair", 50.0).await;
    let (code, text) = s.admin("/metrics");
    assert_eq!(code, 200);
    assert_eq!(metric(&text, "usher_server_resource_capacity", &[("resource", "fair")]), Some(120.0));
    assert_eq!(metric(&text, "usher_server_resource_has", &[("resource", "fair")]), Some(80.0));
    assert_eq!(metric(&text, "usher_server_resource_wants", &[("resource", "fair")]), Some(80.0));
    assert_eq!(metric(&text, "usher_server_resource_clients", &[("resource", "fair")]), Some(2.0));
    assert_eq!(metric(&text, "usher_server_rpc_requests_total", &[("method", "GetCapacity")]), Some(2.0));
    assert!(text.contains("usher_server_rpc_duration_seconds_bucket"));
    let st = s.status();
    assert_eq!(st["is_master"], true);
    assert_eq!(st["ready"], true);
    assert_eq!(st["resources"][0]["id"], "fair");
    assert_eq!(st["resources"][0]["algorithm"], "FAIR_SHARE");
    assert_eq!(st["resources"][0]["sum_has"], 80.0);
    let (code, html) = s.admin("/debug/status");
    assert_eq!(code, 200);
    assert!(html.contains("<td><a href=\"/debug/resources?resource=fair\">fair</a></td>"), "{html}");
    assert_eq!(s.admin("/healthz").0, 200);
    assert_eq!(s.admin("/readyz").0, 200);
    assert_eq!(s.admin("/debug/resources?resource=nope").0, 404);
    s.usher.signal("TERM");
    assert_eq!(s.usher.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(s.usher.log().contains("usher server stopped"));
}

#[tokio::test]
async fn without_config_the_builtin_default_serves() {
    let u = Usher::server(&["--min-request-interval", "0s"]);
    assert!(u.log().contains("no --config given"), "{}", u.log());
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    assert_eq!(grant(&mut c, "a", "anything", 80.0).await, 80.0);
    assert_eq!(grant(&mut c, "b", "anything", 80.0).await, 20.0, "capacity 100, a holds 80");
}

#[tokio::test]
async fn flags_can_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(dir.path(), "r.yaml", CONFIG);
    let u = Usher::start(
        &["server"],
        &[
            ("USHER_CONFIG", cfg.to_str().unwrap()),
            ("USHER_LISTEN", "127.0.0.1:0"),
            ("USHER_ADMIN_LISTEN", "127.0.0.1:0"),
            ("USHER_ADVERTISE_ADDR", "capacity-0.example:15100"),
            ("USHER_MIN_REQUEST_INTERVAL", "0s"),
        ],
        "usher server listening",
    );
    assert_eq!(u.fields["server_id"], "capacity-0.example:15100");
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    let d = c.discovery(proto::DiscoveryRequest {}).await.unwrap().into_inner();
    assert_eq!(d.mastership.master_address.as_deref(), Some("capacity-0.example:15100"));
    assert_eq!(grant(&mut c, "a", "fair", 10.0).await, 10.0);
    assert_eq!(grant(&mut c, "a", "fair", 20.0).await, 20.0, "min request interval 0s from the environment");
}
