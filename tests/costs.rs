//! Costs from the request and the response, through `usher proxy`: a route
//! can charge what a request header names (`cost: "{header.NAME}"`, with
//! `default_cost` when it names none), and settle the real cost from the
//! response (`settle: { response_header: NAME }`): the difference from what
//! was charged at admission is charged to the key, or given back. An
//! LLM-like upstream reports each request's tokens in `x-usage-total-tokens`.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::upstream::{get, h1};
use support::{Usher, write_file};

/// An upstream that answers each request with a token cost from `costs`
/// (in turn) in `x-usage-total-tokens`, and records (time, cost).
struct Llm {
    addr: SocketAddr,
    spent: Arc<Mutex<Vec<(Instant, u64)>>>,
}

async fn llm(costs: Vec<u64>) -> Llm {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let spent = Arc::new(Mutex::new(Vec::new()));
    let (s, costs) = (spent.clone(), Arc::new(costs));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (spent, costs) = (s.clone(), costs.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                    let (spent, costs) = (spent.clone(), costs.clone());
                    async move {
                        let mut spent = spent.lock().unwrap();
                        let cost = costs[spent.len() % costs.len()];
                        spent.push((Instant::now(), cost));
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("x-usage-total-tokens", cost.to_string())
                                .body(Full::new(Bytes::from_static(b"{}")))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Llm { addr, spent }
}

/// Sends one request every `every` for `dur` on one connection, with the
/// extra header `header` when given; returns the statuses.
async fn paced(addr: SocketAddr, every: Duration, dur: Duration, header: Option<(&str, &str)>) -> Vec<u16> {
    let mut client = h1(addr).await;
    let start = Instant::now();
    let mut statuses = Vec::new();
    let mut tick = tokio::time::interval(every);
    while start.elapsed() < dur {
        tick.tick().await;
        let mut req = get("llm.local", "/v1/chat");
        if let Some((k, v)) = header {
            req.headers_mut().insert(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        client.ready().await.unwrap();
        statuses.push(client.send_request(req).await.unwrap().status().as_u16());
    }
    statuses
}

fn routes_file(up: SocketAddr, resource: &str, entry: &str) -> String {
    format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\" }}\nresources:\n  tokens: {resource}\nroutes:\n  - name: chat\n    upstream: llm\n    resources:\n      - {entry}\n"
    )
}

/// Tokens spent settle at the configured rate though each request's real
/// cost is known only from its answer: charged 100 at admission, each
/// request's real 220-250 is charged when it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_costs_keep_the_tokens_spent_at_the_configured_rate() {
    let dir = tempfile::tempdir().unwrap();
    // Well above the guess of 100: the guessed cost alone would spend some
    // 2,300 tokens in 10 s, more than twice the budget.
    let up = llm(vec![250, 220, 250, 240, 230, 250]).await;
    let file = routes_file(
        up.addr,
        "{ kind: rate, capacity: 6000/min, burst: 250, max_wait: 5s }",
        "{ resource: tokens, cost: 100, settle: { response_header: x-usage-total-tokens } }",
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &file));
    // 4 requests/s offered: some 800 tokens/s against 100/s.
    let secs = Duration::from_secs(16);
    let loads: Vec<_> =
        (0..4).map(|_| tokio::spawn(paced(sidecar.addr("listen"), Duration::from_secs(1), secs, None))).collect();
    let start = Instant::now();
    for l in loads {
        l.await.unwrap();
    }
    // From 4 s in (the embedded sidecar starts with its burst) to 14 s.
    let (from, to) = (start + Duration::from_secs(4), start + Duration::from_secs(14));
    let spent: u64 = up.spent.lock().unwrap().iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, c)| c).sum();
    // 10 s at 100 tokens/s, give or take the one debt in flight at either end.
    assert!((700..=1250 + 250).contains(&spent), "{spent} tokens spent in 10 s at 100/s");
}

/// A cost named by a request header is charged; without the header the
/// route's default applies; a header above the burst counts as the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_named_by_the_request_is_charged() {
    let dir = tempfile::tempdir().unwrap();
    let up = llm(vec![1]).await;
    let file = routes_file(
        up.addr,
        "{ kind: rate, capacity: 1/s, burst: 1000 }",
        "{ resource: tokens, cost: \"{header.x-max-tokens}\", default_cost: 10 }",
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &file));
    let addr = sidecar.addr("listen");
    // 1000 in the bucket: two of 400 pass, the third does not.
    let big = paced(addr, Duration::from_millis(20), Duration::from_millis(50), Some(("x-max-tokens", "400"))).await;
    assert_eq!(&big[..3], &[200, 200, 429], "{big:?}");
    // 200 left: twenty at the default of 10 pass.
    let small = paced(addr, Duration::from_millis(5), Duration::from_millis(125), None).await;
    let ok = small.iter().filter(|s| **s == 200).count();
    assert!((19..=21).contains(&ok), "{ok} of {} at the default cost of 10 passed", small.len());
    // Rude values count as the default, or as the burst at most.
    let sidecar2 = Usher::proxy(&write_file(dir.path(), "routes2.yaml", &file));
    let huge = paced(
        sidecar2.addr("listen"),
        Duration::from_millis(20),
        Duration::from_millis(30),
        Some(("x-max-tokens", "1e12")),
    )
    .await;
    assert_eq!(&huge[..2], &[200, 429], "a header cost above the burst spends the burst: {huge:?}");
}

/// The general (hyper) path settles too: over h2c, each answer's real cost
/// of 400 replaces the 100 charged at admission, so a bucket of 500 passes
/// two requests, not five.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_settle_on_the_general_path_too() {
    let dir = tempfile::tempdir().unwrap();
    let up = llm(vec![400]).await;
    let file = routes_file(
        up.addr,
        "{ kind: rate, capacity: 1/s, burst: 500 }",
        "{ resource: tokens, cost: 100, settle: { response_header: x-usage-total-tokens } }",
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &file));
    let mut client = support::upstream::h2(sidecar.addr("listen")).await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        client.ready().await.unwrap();
        let req = get("llm.local", "/v1/chat");
        statuses.push(client.send_request(req).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429], "charged 400 each once settled");
    let (_, text) = support::http_get(sidecar.addr("admin"), "/metrics");
    let settled = support::metric(&text, "usher_proxy_settles_total", &[("route", "chat"), ("outcome", "settled")]);
    assert_eq!(settled, Some(2.0), "{text}");
}
