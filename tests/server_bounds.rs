//! What clients can make the capacity server hold beyond the store: series
//! on `/metrics` and rows on `/debug/status` for client-chosen resource ids.
//! Each is bounded.

mod support;

use support::{Usher, http_get, metric, write_file};
use usher::proto::capacity_client::CapacityClient;
use usher::proto::{GetCapacityRequest, ResourceRequest};

const ALGO: &str = "{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }";

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
            .map(|(id, wants)| ResourceRequest { resource_id: id, priority: 0, has: None, wants })
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
