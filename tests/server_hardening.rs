//! The capacity server under hostile input: giant ids, huge requests,
//! unbounded clients and resources. Every refusal is a clear gRPC error and
//! nothing is stored.

use usher_test_support as support;

use support::{Usher, http_get, write_file};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, ResourceRequest};

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
            .map(|id| ResourceRequest {
                returned: None,
                reserve: None,
                backlog: None,
                unit_account: None,
                window: None,
                upstream_quota: None,
                resource_id: id,
                priority: 0,
                has: None,
                wants: 1.0,
            })
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

/// A lower server's bands weigh as many clients as they claim: claiming
/// more than a resource may have here is refused, naming the field, and
/// leaves the honest clients' shares alone (one request claiming 2^63 - 1
/// clients cut them to ~1e-18).
#[tokio::test]
async fn a_lower_server_cannot_claim_more_clients_than_a_resource_may_have() {
    use usher_proto::{GetServerCapacityRequest, PriorityBandAggregate, ServerCapacityResourceRequest};
    let (u, _dir) = start(&["--max-clients-per-resource", "1000"]);
    let mut c = CapacityClient::connect(format!("http://{}", u.addr("grpc"))).await.unwrap();
    let honest = |c: &mut CapacityClient<tonic::transport::Channel>| {
        let mut c = c.clone();
        async move {
            let mut r = ask("honest", vec!["api".into()]);
            r.resource[0].wants = 60.0;
            c.get_capacity(r).await.unwrap().into_inner().response[0].gets.capacity
        }
    };
    assert_eq!(honest(&mut c).await, 60.0);
    let claim = |n: i64| GetServerCapacityRequest {
        server_id: "liar".into(),
        resource: vec![ServerCapacityResourceRequest {
            upstream_quota: None,
            resource_id: "api".into(),
            has: None,
            wants: vec![
                PriorityBandAggregate { priority: 0, num_clients: n, wants: 100.0 },
                PriorityBandAggregate { priority: 1, num_clients: n, wants: 100.0 },
            ],
        }],
    };
    for n in [i64::MAX, 501] {
        let err = c.get_server_capacity(claim(n)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{n}: {err:?}");
        assert!(
            err.message().contains("resource[0]: its bands count")
                && err.message().contains("at most 1000 (the server's --max-clients-per-resource)"),
            "{}",
            err.message()
        );
    }
    assert_eq!(honest(&mut c).await, 60.0, "the honest client's share is untouched");
    // A claim within the bound is served.
    assert!(c.get_server_capacity(claim(500)).await.is_ok());
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
