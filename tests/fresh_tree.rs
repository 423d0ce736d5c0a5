//! A fresh tree, started as deploy/ starts it (etcd, an elected root, an
//! elected zone intermediate, a sidecar, each with the args and mounted files
//! of its manifest), admits its first request within 5 s of the sidecar
//! starting: a new master with no predecessor on record skips learning mode
//! (README: "Learning mode"; src/server/horizon.rs).

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::{Duration, Instant};

use support::etcd::EtcdServer;
use support::upstream::{Upstream, get, h1, send1};
use support::{Usher, deploy, free_port, write_file};

/// `usher server` with `args` on a fixed loopback port, advertising it.
fn server(args: &[&str]) -> (Usher, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut all = vec!["server", "--listen", &addr, "--admin-listen", "127.0.0.1:0", "--advertise-addr", &addr];
    all.extend_from_slice(args);
    (Usher::start(&all, &[], "usher server listening"), addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_tree_from_deploy_admits_its_first_request_within_5s() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let resources = deploy::block("deploy/server-tree/20-resources-configmap.yaml", "resources.yaml");
    let resources = write_file(dir.path(), "resources.yaml", &resources);
    let e = etcd.endpoint.as_str();
    // deploy/server-tree/30-root.yaml and 31-intermediate-zone-a.yaml.
    let (root, root_addr) = server(&[
        "--config",
        resources.to_str().unwrap(),
        "--min-request-interval=1s",
        "--etcd-endpoints",
        e,
        "--election-key=/usher/election/root",
        "--election-ttl=10s",
    ]);
    let (zone, zone_addr) = server(&[
        "--min-request-interval=1s",
        "--parent",
        &root_addr,
        "--etcd-endpoints",
        e,
        "--election-key=/usher/election/zone-a",
        "--election-ttl=10s",
    ]);
    assert_eventually!(root.is_master() && zone.is_master(), Duration::from_secs(15), "both nodes elect a master");
    // deploy/sidecar/example-app.yaml, pointed at this zone and upstream.
    let up = Upstream::start().await;
    let routes = deploy::block("deploy/sidecar/example-app.yaml", "routes.yaml")
        .replace("usher.usher.svc:15100", &zone_addr)
        .replace("https://api.github.com", &format!("http://{}", up.addr))
        .replace("${POD_NAME}", "example-app-0")
        .replace("/var/run/usher/leases.json", dir.path().join("leases.json").to_str().unwrap());
    let routes = write_file(dir.path(), "routes.yaml", &routes);
    let started = Instant::now();
    let proxy = Usher::proxy(&routes);
    let mut c = h1(proxy.addr("listen")).await;
    let mut refused = 0;
    let first = loop {
        let got = send1(&mut c, get("api.github.com", "/rate_limit")).await;
        if got.status == 200 {
            break started.elapsed();
        }
        assert_eq!(got.status, 429, "only refusals before the first lease: {}", got.text());
        refused += 1;
        assert!(started.elapsed() < Duration::from_secs(30), "nothing admitted in 30 s\n{}", zone.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(up.stats.requests(), 1);
    assert!(
        first <= Duration::from_secs(5),
        "first request admitted {first:?} after the sidecar started ({refused} refused before)\n{}",
        root.log()
    );
    assert!(root.log().contains("no predecessor on record") && zone.log().contains("no predecessor on record"));
    eprintln!("first request admitted {first:?} after the sidecar started; {refused} refused before");
}
