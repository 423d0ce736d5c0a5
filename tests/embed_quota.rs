//! `usher_enforce::embed` leasing from a real `usher server`, as sidecars do: two
//! services' layers share one fleet's burst (each bucket holds its lease's
//! share of it), and an upstream quota one service finds spent (its inner
//! service's answer says so) stops the other within a refresh, through the
//! server.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use support::{Usher, write_file};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};
use usher_core::config::routes::RoutesConfig;
use usher_enforce::embed::{LimitBody, Limits};

type Svc = BoxCloneService<Request<String>, Response<LimitBody<Full<Bytes>>>, Infallible>;

/// A capacity server sharing every resource at `capacity` per second, with
/// no learning mode (a server that has been running for a while).
fn server(dir: &Path, capacity: f64, lease_length: u32, refresh: u32) -> Usher {
    let config = format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: {capacity}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: {lease_length}, refresh_interval: {refresh}, learning_mode_duration: 0 }}\n"
    );
    Usher::server(&[
        "--config",
        write_file(dir, "resources.yaml", &config).to_str().unwrap(),
        "--min-request-interval",
        "0s",
    ])
}

/// Two services' limits, leasing `resources` (a YAML mapping) from `server`.
async fn two_services(server: &Usher, resources: &str) -> (Limits, Limits) {
    let grpc = server.addr("grpc");
    let config = |i: usize| {
        let yaml = format!("doorman: {{ servers: [\"{grpc}\"], client_id: service-{i} }}\nresources:\n{resources}");
        RoutesConfig::parse("embed.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"))
    };
    let (a, b) = tokio::join!(Limits::start(config(0)), Limits::start(config(1)));
    (a.expect("doorman: needs no embedded server"), b.expect("doorman: needs no embedded server"))
}

/// `layer` of `limits`' resource `resource` around a service answering `answer`.
fn service<F>(limits: &Limits, resource: &str, answer: F) -> Svc
where
    F: Fn() -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    let inner = tower::service_fn(move |_req: Request<String>| {
        let resp = answer();
        async move { Ok::<_, Infallible>(resp) }
    });
    BoxCloneService::new(ServiceBuilder::new().layer(limits.layer(resource).unwrap()).service(inner))
}

fn ok() -> Response<Full<Bytes>> {
    Response::new(Full::new(Bytes::new()))
}

async fn status(svc: &Svc) -> u16 {
    svc.clone().oneshot(Request::new(String::new())).await.unwrap().status().as_u16()
}

/// Both services get `n` requests at once; returns how many each admitted.
async fn both_fire(a: &Svc, b: &Svc, n: usize) -> [u64; 2] {
    let fire = |svc: Svc| async move {
        let mut admitted = 0;
        for _ in 0..n {
            admitted += u64::from(status(&svc).await == 200);
        }
        admitted
    };
    let (a, b) = tokio::join!(fire(a.clone()), fire(b.clone()));
    [a, b]
}

/// Polls `cond` every 50 ms until it holds or `patience` runs out.
async fn eventually<F: Future<Output = bool>>(patience: Duration, mut cond: impl FnMut() -> F) -> bool {
    let deadline = Instant::now() + patience;
    while Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_spend_one_fleet_burst_fresh_and_after_idle() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), 1.0, 30, 2);
    // A fixed `wants`: the leases stay while the services are idle.
    let (la, lb) = two_services(&server, "  api: { kind: rate, capacity: 60/min, burst: 30, wants: 1 }\n").await;
    let (a, b) = (service(&la, "api", ok), service(&lb, "api", ok));
    let fresh = both_fire(&a, &b, 40).await;
    let total: u64 = fresh.iter().sum();
    assert!(total <= 30 + 2 + 2, "fresh: {fresh:?} admitted of a fleet's burst of 30");
    assert!(fresh.iter().all(|n| *n >= 1), "fresh: each service admits at least one request: {fresh:?}");

    // Idle: each bucket refills at its half of the lease (about 4 in 8 s).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let idle = both_fire(&a, &b, 40).await;
    let total: u64 = idle.iter().sum();
    assert!(total <= 30 + 2 + 2, "after idle: {idle:?} admitted of a fleet's burst of 30");
    assert!(idle.iter().all(|n| *n >= 2), "each service refilled at its share of the lease: {idle:?}");
    la.shutdown().await;
    lb.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_holds_its_share_of_the_fleets_burst() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), 12.0, 30, 2);
    let (la, lb) = two_services(&server, "  api: { kind: rate, capacity: 12/s, burst: 30, wants: 6 }\n").await;
    let (a, b) = (service(&la, "api", ok), service(&lb, "api", ok));
    // 6/s each: a bucket of 15 fills in 2.5 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let burst = both_fire(&a, &b, 40).await;
    let total: u64 = burst.iter().sum();
    assert!((27..=30 + 2).contains(&total), "the fleet's burst of 30 is there to spend, once: {burst:?}");
    assert!(burst.iter().all(|n| (12..=18).contains(n)), "each holds about half of it: {burst:?}");
    la.shutdown().await;
    lb.shutdown().await;
}

/// GitHub's answer to a spent quota: 403, nothing remaining until `reset` (epoch seconds).
fn spent(reset: u64) -> Response<Full<Bytes>> {
    Response::builder()
        .status(403)
        .header("x-ratelimit-limit", "600")
        .header("x-ratelimit-remaining", "0")
        .header("x-ratelimit-reset", reset.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_one_service_finds_spent_stops_the_other_through_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = server(dir.path(), 10.0, 5, 1);
    // A fixed `wants`: each service holds its half while nothing is spent.
    let resources =
        "  github: { kind: rate, capacity: 10/s, burst: 10, wants: 5, upstream_quota: { headers: github } }\n";
    let (la, lb) = two_services(&server, resources).await;
    let reset = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 30;
    // Service A's client meets the spent quota; service B's answers carry no quota headers.
    let a = service(&la, "github", move || spent(reset));
    let b = service(&lb, "github", ok);
    let leased = eventually(Duration::from_secs(5), || async { lb.capacity("github") == Some(5.0) }).await;
    assert!(leased, "B leases its half: {:?}/s", lb.capacity("github"));
    assert_eq!(status(&b).await, 200, "B admits before anyone has seen the quota spent");
    assert_eq!(status(&a).await, 403, "A's client meets the spent quota");
    assert_eq!(status(&a).await, 429, "A holds its key at once");
    // A carries the quota up; the server shares 0 until the reset; B's next lease says so.
    let stopped = eventually(Duration::from_secs(10), || async { lb.capacity("github") == Some(0.0) }).await;
    assert!(stopped, "B still has {:?}/s", lb.capacity("github"));
    assert_eq!(status(&b).await, 429, "B refuses until the reset");
    la.shutdown().await;
    lb.shutdown().await;
}
