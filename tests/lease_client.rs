//! The lease client library against a real `usher server` process.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{Usher, http_get, write_file};
use usher::clock::Clock;
use usher::lease::core::CoreConfig;
use usher::lease::transport::{GrpcTransport, Transport};
use usher::lease::{Capacity, Enforcer, KeyDemand, LeaseClient, OnExpiry};

struct Fixed;

impl Enforcer for Fixed {
    fn demand(&self) -> Vec<KeyDemand> {
        vec![KeyDemand {
            resource_id: "shared".into(),
            priority: 0,
            wants: 1.0,
            on_expiry: OnExpiry::Pessimistic,
            safe_capacity: None,
            pressure: false,
        }]
    }
    fn apply(&self, _: &[(String, Capacity)]) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_started_together_spread_their_refreshes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(
        dir.path(),
        "r.yaml",
        "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 3, learning_mode_duration: 0 }\n",
    );
    let server = Usher::server(&["--config", cfg.to_str().unwrap(), "--min-request-interval", "0s"]);
    let addr = server.addr("grpc").to_string();
    let transport: Arc<dyn Transport> = Arc::new(GrpcTransport::new(Duration::from_secs(2), Duration::from_secs(1)));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let cfg = CoreConfig::new(format!("client-{i:02}"), vec![addr.clone()]);
        let (_, task) =
            LeaseClient::start(cfg, Clock::system(), transport.clone(), Arc::new(Fixed), None, shutdown.clone());
        tasks.push(task);
    }
    // All 50 refreshed together at start. Their third requests fall in
    // [2 × 3 s × 5/6, 2 × 3 s × 7/6] = [5 s, 7 s]; the fourth come no earlier than 7.5 s.
    tokio::time::sleep_until(start + Duration::from_millis(7250)).await;
    let (_, body) = http_get(server.addr("admin"), "/debug/resources?resource=shared&format=json");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let expiries: Vec<f64> =
        v["leases"].as_array().unwrap().iter().map(|l| l["expires_in_s"].as_f64().unwrap()).collect();
    assert_eq!(expiries.len(), 50, "{body}");
    // Each lease expires 10 s after the server took that client's latest
    // request, so the spread of expiries is the spread of the refreshes as the
    // server saw them. Unjittered they would all come within milliseconds; the
    // jitter spreads them over about 1.6 s here (third requests in [5 s, 7 s]),
    // and a busy machine, whose server takes queued requests in bursts,
    // narrows what the server sees (0.96 s in one CI run): half a second is
    // far from both.
    let spread = expiries.iter().cloned().fold(f64::MIN, f64::max) - expiries.iter().cloned().fold(f64::MAX, f64::min);
    assert!(spread >= 0.5, "refreshes spread over {spread:.2} s, not apart: {expiries:?}");
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    // And every client released its lease on shutdown.
    let (code, body) = http_get(server.addr("admin"), "/debug/resources?resource=shared&format=json");
    assert!(code == 404 || body.contains("\"leases\": []"), "{body}");
}
