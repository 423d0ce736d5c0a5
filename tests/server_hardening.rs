//! The capacity server under hostile input: giant ids, huge requests,
//! unbounded clients and resources. Every refusal is a clear gRPC error and
//! nothing is stored.

mod support;

use support::{Usher, http_get, write_file};
use usher::proto::capacity_client::CapacityClient;
use usher::proto::{GetCapacityRequest, ResourceRequest};

const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }\n";

fn start(extra: &[&str]) -> (Usher, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(dir.path(), "r.yaml", CONFIG);
    let mut args =
        vec!["server", "--config", cfg.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    (Usher::start(&args, &[], "usher server listening"), dir)
}

fn ask(client: &str, ids: Vec<String>) -> GetCapacityRequest {
    GetCapacityRequest {
        client_id: client.into(),
        resource: ids
            .into_iter()
            .map(|id| ResourceRequest { resource_id: id, priority: 0, has: None, wants: 1.0 })
            .collect(),
    }
}

fn resources(u: &Usher) -> usize {
    let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["resources"].as_array().unwrap().len()
}

#[tokio::test]
async fn giant_ids_and_huge_requests_are_refused() {
    let (u, _dir) = start(&[]);
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    let err = c.get_capacity(ask("a", vec!["x".repeat(5000)])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("resource[0].resource_id is 5000 bytes long; at most 1024 are accepted"),
        "{}",
        err.message()
    );
    let err = c.get_capacity(ask(&"c".repeat(2000), vec!["r".into()])).await.unwrap_err();
    assert!(err.message().contains("client_id is 2000 bytes long"), "{}", err.message());

    let many: Vec<String> = (0..20_000).map(|i| format!("r{i}")).collect();
    let err = c.get_capacity(ask("a", many)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("20000 resources in one request; at most 10000 are accepted"), "{}", err.message());

    // Over the 4 MiB message limit: refused before it is decoded.
    let big: Vec<String> = (0..5000).map(|i| format!("{i:0>1000}")).collect();
    let err = c.get_capacity(ask("a", big)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("the limit is: 4194304 bytes"), "{}", err.message());
    assert_eq!(resources(&u), 0, "nothing was stored");
    // The server still serves.
    assert_eq!(c.get_capacity(ask("a", vec!["ok".into()])).await.unwrap().into_inner().response.len(), 1);
}

#[tokio::test]
async fn clients_and_resources_are_bounded() {
    let (u, _dir) = start(&["--max-clients-per-resource", "3", "--max-resources", "5"]);
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    for i in 0..3 {
        c.get_capacity(ask(&format!("c{i}"), vec!["shared".into()])).await.unwrap();
    }
    let err = c.get_capacity(ask("c3", vec!["shared".into()])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("resource `shared` already has 3 clients (the server's --max-clients-per-resource)"),
        "{}",
        err.message()
    );
    // Known clients keep being served.
    c.get_capacity(ask("c1", vec!["shared".into()])).await.unwrap();

    let err = c.get_capacity(ask("c0", (0..6).map(|i| format!("new{i}")).collect())).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains("already tracks 5 resources"), "{}", err.message());
    assert_eq!(resources(&u), 1, "the refused request stored nothing");
    c.get_capacity(ask("c0", (0..4).map(|i| format!("new{i}")).collect())).await.unwrap();
    assert_eq!(resources(&u), 5);
}
