//! What clients can make the capacity server hold beyond the store: series
//! on `/metrics` and rows on `/debug/status` for client-chosen resource ids,
//! and gRPC connections that send nothing. Each is bounded.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::{Usher, http_get, metric, write_file};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, ResourceRequest};

/// Doorman's grants, without spare capacity: the test follows exact leases.
const ALGO: &str = "{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0, parameters: [{ name: spare, value: keep }] }";

fn start(extra: &[&str]) -> (Usher, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "resources:\n  - identifier_glob: fixed\n    capacity: 10\n    algorithm: {ALGO}\n  \
         - identifier_glob: 'big*'\n    capacity: 100\n    algorithm: {ALGO}\n  \
         - identifier_glob: '*'\n    capacity: 100\n    algorithm: {ALGO}\n"
    );
    let cfg = write_file(dir.path(), "r.yaml", &config);
    let mut args =
        vec!["server", "--config", cfg.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    (Usher::start(&args, &[], "usher server listening"), dir)
}

fn ask(ids: impl IntoIterator<Item = (String, f64)>) -> GetCapacityRequest {
    GetCapacityRequest {
        client_id: "c".into(),
        resource: ids
            .into_iter()
            .map(|(id, wants)| ResourceRequest {
                returned: None,
                reserve: None,
                backlog: None,
                unit_account: None,
                window: None,
                upstream_quota: None,
                resource_id: id,
                priority: 0,
                has: None,
                wants,
            })
            .collect(),
    }
}

fn series(text: &str, name: &str) -> usize {
    text.lines().filter(|l| l.starts_with(&format!("{name}{{"))).count()
}

#[tokio::test]
async fn metrics_and_status_list_a_bounded_number_of_resources() {
    let (u, _dir) = start(&["--metrics-max-resources", "100"]);
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    c.get_capacity(ask([("fixed".to_string(), 0.5)])).await.unwrap();
    c.get_capacity(ask((0..10).map(|i| (format!("big{i}"), 50.0)))).await.unwrap();
    for batch in 0..5 {
        c.get_capacity(ask((0..1000).map(|i| (format!("r{:04}", batch * 1000 + i), 1.0)))).await.unwrap();
    }

    let (code, m) = http_get(u.addr("admin"), "/metrics");
    assert_eq!(code, 200);
    for name in [
        "usher_server_resource_capacity",
        "usher_server_resource_has",
        "usher_server_resource_wants",
        "usher_server_resource_clients",
        "usher_server_resource_learning_mode",
    ] {
        assert_eq!(series(&m, name), 100, "{name}: one series for each of the first 100 resources");
    }
    assert_eq!(metric(&m, "usher_server_resources", &[]), Some(5011.0));
    assert_eq!(metric(&m, "usher_server_resources_unlisted", &[]), Some(4911.0));
    // Configured by name first, then the busiest, then by id.
    assert_eq!(metric(&m, "usher_server_resource_capacity", &[("resource", "fixed")]), Some(10.0));
    assert_eq!(metric(&m, "usher_server_resource_has", &[("resource", "big9")]), Some(50.0));
    assert_eq!(metric(&m, "usher_server_resource_has", &[("resource", "r0088")]), Some(1.0));
    assert_eq!(metric(&m, "usher_server_resource_has", &[("resource", "r0089")]), None);
    // Every resource counts in the per-template sums.
    assert_eq!(metric(&m, "usher_server_template_resources", &[("template", "*")]), Some(5000.0));
    assert_eq!(metric(&m, "usher_server_template_has", &[("template", "*")]), Some(5000.0));
    assert_eq!(metric(&m, "usher_server_template_wants", &[("template", "big*")]), Some(500.0));
    assert_eq!(metric(&m, "usher_server_template_clients", &[("template", "fixed")]), Some(1.0));
    assert!(m.len() < 100_000, "/metrics is {} bytes", m.len());

    let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(st["resources"].as_array().unwrap().len(), 200);
    assert_eq!(st["resources_total"], 5011);
    assert_eq!(st["resources_unlisted"], 4811);
    assert_eq!(st["resources"][0]["id"], "fixed");
    assert_eq!(st["resources"][1]["id"], "big0");
    assert!(body.len() < 200_000, "JSON status is {} bytes", body.len());

    let (_, html) = http_get(u.addr("admin"), "/debug/status");
    assert_eq!(html.matches("<a href=\"/debug/resources?resource=").count(), 200);
    assert!(html.contains("200 of 5011 resources listed"), "{}", &html[html.len().saturating_sub(600)..]);
    assert!(html.contains("4811 more not shown"));
    assert!(html.contains("/debug/resources?resource=ID"));
    // Any one is still there to see.
    let (code, one) = http_get(u.addr("admin"), "/debug/resources?resource=r4999&format=json");
    assert_eq!(code, 200, "{one}");
}

/// Whether the server has closed `s` (reading what it sent meanwhile).
fn closed(mut s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

fn scrape(u: &Usher, name: &str) -> Option<f64> {
    metric(&http_get(u.addr("admin"), "/metrics").1, name, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_capped_and_closed_after_the_preface_timeout() {
    let (u, _dir) = start(&["--max-connections", "20", "--preface-timeout", "2s"]);
    let grpc = u.addr("grpc");
    let mut c = CapacityClient::connect(format!("http://{grpc}")).await.unwrap();
    c.get_capacity(ask([("a".to_string(), 1.0)])).await.unwrap();

    let opened = Instant::now();
    let silent: Vec<TcpStream> = (0..100).map(|_| TcpStream::connect(grpc).unwrap()).collect();
    // The client above holds one slot: 19 are let in, 81 closed at once.
    assert_eventually!(
        silent.iter().filter(|s| closed(s)).count() == 81,
        Duration::from_millis(1500),
        "81 connections past --max-connections should be closed at once"
    );
    assert!(opened.elapsed() < Duration::from_secs(2), "closed before the preface timeout could have");
    let m = http_get(u.addr("admin"), "/metrics").1;
    assert_eq!(metric(&m, "usher_server_connections_refused_total", &[]), Some(81.0));
    assert_eq!(metric(&m, "usher_server_connections", &[]), Some(20.0));
    // The client connected before the flood is still answered.
    c.get_capacity(ask([("a".to_string(), 2.0)])).await.unwrap();
    assert!(u.log().contains("--max-connections are open"), "the refusals are logged");
    assert_eq!(u.log().matches("--max-connections are open").count(), 1, "once, not once per connection");

    // The 19 silent ones go when their preface is late; new clients get in again.
    assert_eventually!(
        silent.iter().all(closed),
        Duration::from_secs(5),
        "silent connections should be closed after --preface-timeout"
    );
    assert!(opened.elapsed() >= Duration::from_millis(1900), "not before the timeout: {:?}", opened.elapsed());
    assert_eq!(scrape(&u, "usher_server_connections_timed_out_total"), Some(19.0));
    assert_eventually!(
        scrape(&u, "usher_server_connections") == Some(1.0),
        Duration::from_secs(2),
        "only the real client's connection stays"
    );
    let mut fresh = CapacityClient::connect(format!("http://{grpc}")).await.unwrap();
    fresh.get_capacity(ask([("b".to_string(), 1.0)])).await.unwrap();
    c.get_capacity(ask([("a".to_string(), 3.0)])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_after_the_preface_is_dropped_by_keepalive() {
    let (u, _dir) =
        start(&["--preface-timeout", "60s", "--http2-keepalive-interval", "1s", "--http2-keepalive-timeout", "1s"]);
    let grpc = u.addr("grpc");
    let mut c = CapacityClient::connect(format!("http://{grpc}")).await.unwrap();
    c.get_capacity(ask([("a".to_string(), 1.0)])).await.unwrap();

    // The preface and an empty SETTINGS frame, then silence: PINGs go unanswered.
    let raw = TcpStream::connect(grpc).unwrap();
    (&raw).write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").unwrap();
    let start = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    assert!(!closed(&raw), "open while the keepalive has not yet failed");
    assert_eventually!(closed(&raw), Duration::from_secs(6), "an unanswered PING should close the connection");
    assert!(start.elapsed() >= Duration::from_millis(1500), "{:?}", start.elapsed());
    // A real client answers the PINGs and keeps its connection.
    assert_eq!(scrape(&u, "usher_server_connections"), Some(1.0));
    c.get_capacity(ask([("a".to_string(), 2.0)])).await.unwrap();
    assert_eq!(scrape(&u, "usher_server_connections_timed_out_total"), Some(0.0));
}
