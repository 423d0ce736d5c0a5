//! Admission through the real proxy stack, in process: real listeners on
//! 127.0.0.1:0, a real counting upstream, and a manual clock driving the
//! limiters so counts are exact and no test waits on wall time.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{Request, StatusCode};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use usher_core::clock::{Clock, ManualClock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{Proxy, serve};

use support::upstream::{self, Upstream, get, get_abs, h1, h2, read, send1, send2};

/// Awaits a spawned task for at most 20 s of wall time.
async fn within<T>(task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), task).await.expect("task finished in time").unwrap()
}

struct Harness {
    proxy: Arc<Proxy>,
    addr: SocketAddr,
    clock: Arc<ManualClock>,
    stop: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start(yaml: &str) -> Harness {
    let cfg = RoutesConfig::parse("test.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let proxy = Proxy::new(cfg, "test.yaml".into(), clock, prometheus::Registry::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve(proxy.clone(), listener, stop.clone(), Duration::from_secs(5)));
    Harness { proxy, addr, clock: handle, stop }
}

/// Polls `cond` every 2 ms for at most 10 s of wall time.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn waiters(p: &Proxy, resource: &str) -> i64 {
    p.table.resource(resource).unwrap().limiters().iter().map(|l| l.demand().waiters()).sum()
}

fn one_rate(up: SocketAddr, capacity: &str, burst: u32, max_wait: &str) -> String {
    format!(
        "upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
         resources:\n  api: {{ kind: rate, capacity: {capacity}, burst: {burst}, max_wait: {max_wait} }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [api] }}\n"
    )
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

/// 50 connections hammer a 20/s, burst 5 resource while the clock moves in
/// 50 ms steps; after each step every connection has been refused at least
/// once, so the budget is spent. The upstream must see burst + 20/s × time.
async fn rate_accuracy(proto: Proto) {
    const CONNS: usize = 50;
    const STEPS: u64 = 60; // 3 s of virtual time
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "20/s", 5, "0s")).await;
    let (gen_tx, gen_rx) = watch::channel(0u64);
    let parked = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CONNS {
        let (mut gen_rx, parked, ok, addr) = (gen_rx.clone(), parked.clone(), ok.clone(), h.addr);
        tasks.push(tokio::spawn(async move {
            let mut c1 = None;
            let mut c2 = None;
            match proto {
                Proto::H1 => c1 = Some(h1(addr).await),
                Proto::H2 => c2 = Some(h2(addr).await),
            }
            // Bounded: at most this many requests per connection.
            for _ in 0..10_000 {
                let resp = match (&mut c1, &mut c2) {
                    (Some(c), _) => {
                        c.ready().await.unwrap();
                        c.send_request(get("api.test", "/x")).await.unwrap()
                    }
                    (_, Some(c)) => {
                        c.ready().await.unwrap();
                        c.send_request(get_abs("api.test", "/x")).await.unwrap()
                    }
                    _ => unreachable!(),
                };
                let status = read(resp).await.status;
                if status == StatusCode::OK {
                    ok.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
                // Spent at this instant: park until the clock moves.
                let seen = *gen_rx.borrow_and_update();
                parked.fetch_add(1, Ordering::SeqCst);
                if seen >= STEPS || gen_rx.changed().await.is_err() {
                    return;
                }
            }
            panic!("request bound reached");
        }));
    }
    for step in 1..=STEPS {
        let want = step * CONNS as u64;
        let p = parked.clone();
        eventually("every connection refused at this instant", || p.load(Ordering::SeqCst) >= want).await;
        h.clock.advance(Duration::from_millis(50));
        gen_tx.send(step).unwrap();
    }
    let p = parked.clone();
    eventually("every connection refused at the end", || p.load(Ordering::SeqCst) >= (STEPS + 1) * CONNS as u64).await;
    drop(gen_tx);
    for t in tasks {
        within(t).await;
    }
    let expected = 5 + 20 * STEPS * 50 / 1000;
    let got = up.stats.requests();
    assert!(got.abs_diff(expected) <= 1, "{proto:?}: upstream saw {got}, expected {expected} ± 1");
    assert_eq!(ok.load(Ordering::SeqCst), got, "every 200 reached the upstream once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_accuracy_http1_50_connections_one_budget() {
    rate_accuracy(Proto::H1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_accuracy_h2c_50_connections_one_budget() {
    rate_accuracy(Proto::H2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacing_is_fifo_and_the_refusal_is_exact() {
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "10/s", 1, "350ms")).await;
    let mut first = h1(h.addr).await;
    let r = send1(&mut first, seq_req("0")).await;
    assert_eq!(r.status, StatusCode::OK);

    // Three more arrive one after another; each waits 100 ms longer than the last.
    let mut waiting = Vec::new();
    for i in 1..=3 {
        let addr = h.addr;
        waiting.push(tokio::spawn(async move {
            let mut c = h1(addr).await;
            send1(&mut c, seq_req(&i.to_string())).await
        }));
        let p = h.proxy.clone();
        eventually("the request is queued", || waiters(&p, "api") == i).await;
    }
    // The fourth would wait 400 ms > max_wait: refused at once.
    let r = send1(&mut first, seq_req("4")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.header("ratelimit-policy"), "\"api\";q=10;w=1");
    assert_eq!(r.header("ratelimit"), "\"api\";r=0;t=1");
    assert_eq!(r.header("content-type"), "application/problem+json");
    assert_eq!(
        r.json(),
        json!({
            "type": "urn:usher:problem:rate-limited",
            "title": "Too Many Requests",
            "status": 429,
            "detail": "resource `api` (id `api`) has no capacity within max_wait 350ms; waited 0ms; retry in 1 s",
            "resource": "api",
            "resource_id": "api",
            "kind": "rate",
            "waited_ms": 0,
            "max_wait_ms": 350,
            "retry_after_s": 1,
        })
    );

    // Each 100 ms step releases exactly the next one, in arrival order.
    for n in 2..=4u64 {
        h.clock.advance(Duration::from_millis(100));
        let s = up.stats.clone();
        eventually("the next paced request reaches the upstream", || s.requests() == n).await;
    }
    for t in waiting {
        assert_eq!(within(t).await.status, StatusCode::OK);
    }
    assert_eq!(up.stats.seq(), ["0", "1", "2", "3"]);
}

fn seq_req(seq: &str) -> Request<upstream::TestBody> {
    Request::get("/x").header("host", "api.test").header("x-seq", seq).body(upstream::empty()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_returns_its_slot() {
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "10/s", 1, "1s")).await;
    let mut c = h1(h.addr).await;
    assert_eq!(send1(&mut c, seq_req("0")).await.status, StatusCode::OK);
    let addr = h.addr;
    let quitter = tokio::spawn(async move {
        let mut c = h1(addr).await;
        let _ = c.send_request(seq_req("quitter")).await;
    });
    let p = h.proxy.clone();
    eventually("the quitter is queued", || waiters(&p, "api") == 1).await;
    quitter.abort();
    let p = h.proxy.clone();
    eventually("the quitter left the queue", || waiters(&p, "api") == 0).await;
    // Its slot (100 ms) is free again: a newcomer gets it, not the one after.
    let addr = h.addr;
    let next = tokio::spawn(async move {
        let mut c = h1(addr).await;
        send1(&mut c, seq_req("1")).await
    });
    let p = h.proxy.clone();
    eventually("the newcomer is queued", || waiters(&p, "api") == 1).await;
    h.clock.advance(Duration::from_millis(100));
    assert_eq!(within(next).await.status, StatusCode::OK);
    assert_eq!(up.stats.seq(), ["0", "1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_capacity_changes_give_no_burst() {
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "10/s", 5, "0s")).await;
    let mut c = h1(h.addr).await;
    macro_rules! send {
        () => {
            send1(&mut c, get("api.test", "/x")).await.status
        };
    }
    for _ in 0..5 {
        assert_eq!(send!(), StatusCode::OK);
    }
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS);

    // Raised tenfold: still no burst; one request per 10 ms.
    assert!(h.proxy.table.set_capacity("api", 100.0));
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS, "a raise must not refill the bucket");
    h.clock.advance(Duration::from_millis(10));
    assert_eq!(send!(), StatusCode::OK);
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS);

    // Lowered to 1/s: 10 ms no longer earns a request; a second does.
    assert!(h.proxy.table.set_capacity("api", 1.0));
    h.clock.advance(Duration::from_millis(10));
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS);
    h.clock.advance(Duration::from_secs(1));
    assert_eq!(send!(), StatusCode::OK);
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS);

    // Renewing the same capacity changes nothing.
    assert!(h.proxy.table.set_capacity("api", 1.0));
    assert_eq!(send!(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(up.stats.requests(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_capacity_refuses_after_max_wait_unless_raised() {
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "0", 1, "1s")).await;
    let addr = h.addr;
    let refused = tokio::spawn(async move { send1(&mut h1(addr).await, get("api.test", "/x")).await });
    let p = h.proxy.clone();
    eventually("queued on capacity 0", || waiters(&p, "api") == 1).await;
    h.clock.advance(Duration::from_millis(1000));
    let r = within(refused).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.json()["waited_ms"], 1000);

    let admitted = tokio::spawn(async move { send1(&mut h1(addr).await, get("api.test", "/x")).await });
    let p = h.proxy.clone();
    eventually("queued on capacity 0", || waiters(&p, "api") == 1).await;
    h.proxy.table.set_capacity("api", 10.0);
    h.clock.advance(Duration::from_millis(100));
    assert_eq!(within(admitted).await.status, StatusCode::OK, "a raise within max_wait admits the waiter");
    assert_eq!(up.stats.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauge_never_exceeds_capacity_at_the_upstream() {
    let up = Upstream::gated().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  inflight: {{ kind: gauge, capacity: 3, max_wait: 1h }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [inflight] }}\n",
        up.addr
    );
    let h = start(&yaml).await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let addr = h.addr;
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                send1(&mut h1(addr).await, get("api.test", "/x")).await.status
            } else {
                send2(&mut h2(addr).await, get_abs("api.test", "/x")).await.status
            }
        }));
    }
    let (s, p) = (up.stats.clone(), h.proxy.clone());
    eventually("3 in flight and 17 waiting", || s.in_flight() == 3 && waiters(&p, "inflight") == 17).await;
    for released in 1..=20u64 {
        up.gate.add_permits(1);
        let s = up.stats.clone();
        eventually("one more completes", || s.requests() >= (released + 3).min(20)).await;
    }
    for t in tasks {
        assert_eq!(within(t).await, StatusCode::OK);
    }
    assert_eq!(up.stats.requests(), 20);
    assert_eq!(up.stats.max_in_flight(), 3, "never more than the capacity at the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauge_permit_is_held_until_the_body_ends() {
    let up = Upstream::start().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  one: {{ kind: gauge, capacity: 1, max_wait: 1h }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [one] }}\n",
        up.addr
    );
    let h = start(&yaml).await;
    let mut c = h1(h.addr).await;
    let mut resp = c.send_request(get("api.test", "/hold-body")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let first = resp.body_mut().frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"first ");

    let addr = h.addr;
    let second = tokio::spawn(async move { send1(&mut h1(addr).await, get("api.test", "/x")).await });
    let p = h.proxy.clone();
    eventually("the second request waits for the first body", || waiters(&p, "one") == 1).await;
    assert_eq!(up.stats.requests(), 1);
    up.gate.add_permits(1);
    let rest = read(resp).await;
    assert_eq!(rest.text(), "last");
    assert_eq!(within(second).await.status, StatusCode::OK);
    assert_eq!(up.stats.requests(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_resources_are_all_or_nothing() {
    let up = Upstream::gated().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  r: {{ kind: rate, capacity: 1/s, burst: 1 }}\n  g: {{ kind: gauge, capacity: 1 }}\n\
         routes:\n  - {{ name: gauge-only, match: {{ path_prefix: /g }}, upstream: up, resources: [g] }}\n  \
         - {{ name: both, match: {{ path_prefix: /both }}, upstream: up, resources: [r, g] }}\n  \
         - {{ name: rate-only, match: {{ path_prefix: /r }}, upstream: up, resources: [r] }}\n",
        up.addr
    );
    let h = start(&yaml).await;
    // Hold the gauge with a gated request.
    let addr = h.addr;
    let holder = tokio::spawn(async move { send1(&mut h1(addr).await, get("api.test", "/g")).await });
    let s = up.stats.clone();
    eventually("the holder is in flight", || s.in_flight() == 1).await;

    // `both` is refused by the gauge and must leave the rate untouched.
    let mut c = h1(h.addr).await;
    let r = send1(&mut c, get("api.test", "/both")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.json()["resource"], "g");
    assert_eq!(r.header("ratelimit-policy"), "\"g\";q=1;qu=\"concurrent-requests\"");
    up.gate.add_permits(2);
    assert_eq!(within(holder).await.status, StatusCode::OK);
    let r = send1(&mut c, get("api.test", "/both")).await;
    assert_eq!(r.status, StatusCode::OK, "the rate's only token was not consumed by the refusal");

    // Now the rate is spent: `both` is refused by it and must not take the gauge.
    let r = send1(&mut c, get("api.test", "/both")).await;
    assert_eq!(r.json()["resource"], "r");
    let g = h.proxy.table.resource("g").unwrap().limiters()[0].clone();
    assert_eq!(g.gauge().unwrap().in_flight(), 0);
    assert_eq!(g.remaining(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_requests_are_refused_with_resource_exhausted() {
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "0", 1, "0s")).await;
    let mut c = h2(h.addr).await;
    let req = Request::post("http://api.test/pkg.Service/Method")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(upstream::full(vec![0u8, 0, 0, 0, 0]))
        .unwrap();
    let r = send2(&mut c, req).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), "8");
    assert!(r.header("grpc-message").contains("resource `api`"), "{}", r.header("grpc-message"));
    assert_eq!(r.header("content-type"), "application/grpc");
    assert_eq!(up.stats.requests(), 0);
}

/// A gRPC answer's body: one message, then a failure (the upstream resets
/// the stream) a moment later: a reset at once would discard the head and
/// message still queued in the upstream's HTTP/2 connection.
struct CutBody {
    sent: bool,
    pause: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for CutBody {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>> {
        if !self.sent {
            self.sent = true;
            let message = bytes::Bytes::from_static(&[0, 0, 0, 0, 1, 42]);
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(message))));
        }
        std::task::ready!(self.pause.as_mut().poll(cx));
        std::task::Poll::Ready(Some(Err(std::io::Error::other("the upstream gave up"))))
    }
}

/// An h2c upstream on 127.0.0.1:0 that answers every call with a gRPC head
/// and one message, then resets the stream.
async fn cutting_grpc_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    let resp = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(CutBody { sent: false, pause: Box::pin(tokio::time::sleep(Duration::from_millis(100))) })
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                });
                let builder = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                let _ = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
            });
        }
    });
    addr
}

/// An upstream that cuts a gRPC answer mid-stream: the client gets the
/// message that came, then trailers with `grpc-status: 14` (UNAVAILABLE)
/// and the reason, not a reset stream; the body error is counted and the
/// call's gauge slot is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_body_cut_by_the_upstream_ends_in_trailers_with_a_status() {
    let up = cutting_grpc_upstream().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{up}\", h2c: true }}\n\
         resources:\n  calls: {{ kind: gauge, capacity: 1 }}\n\
         routes:\n  - {{ name: grpc, upstream: up, resources: [calls] }}\n"
    );
    let h = start(&yaml).await;
    let mut c = h2(h.addr).await;
    for call in 0..3 {
        let req = Request::post("http://api.test/pkg.Service/Stream")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(upstream::full(vec![0u8, 0, 0, 0, 0]))
            .unwrap();
        c.ready().await.unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "call {call}");
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap_or_else(|e| panic!("call {call}: the stream was reset, not ended with a status: {e}"));
        let trailers = body.trailers().cloned().unwrap_or_else(|| panic!("call {call}: no trailers"));
        assert_eq!(body.to_bytes().as_ref(), [0, 0, 0, 0, 1, 42], "call {call}: the message that came");
        assert_eq!(trailers["grpc-status"], "14", "call {call}: {trailers:?}");
        let message = trailers["grpc-message"].to_str().unwrap();
        assert!(message.contains("route `grpc`") && message.contains("body failed"), "call {call}: {message}");
    }
    let g = h.proxy.table.resource("calls").unwrap().limiters()[0].clone();
    assert_eq!(g.gauge().unwrap().in_flight(), 0, "the calls' slots were given back");
    h.proxy.metrics.observe_table(&h.proxy.table);
    let mut out = Vec::new();
    prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &h.proxy.metrics.registry.gather(), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("usher_proxy_response_body_errors_total{route=\"grpc\"} 3"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templated_ids_give_each_key_its_own_budget_up_to_max_keys() {
    let up = Upstream::start().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  per-tenant: {{ kind: rate, id: \"t/{{header.x-tenant}}\", capacity: 1/s, burst: 2, max_keys: 2 }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [per-tenant] }}\n",
        up.addr
    );
    let h = start(&yaml).await;
    let mut c = h1(h.addr).await;
    let mut status = async |tenant: &str| {
        let req =
            Request::get("/x").header("host", "api.test").header("x-tenant", tenant).body(upstream::empty()).unwrap();
        send1(&mut c, req).await
    };
    for tenant in ["a", "b"] {
        assert_eq!(status(tenant).await.status, StatusCode::OK);
        assert_eq!(status(tenant).await.status, StatusCode::OK);
        let r = status(tenant).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.json()["resource_id"], format!("t/{tenant}"));
    }
    // Beyond max_keys, a new id is refused with a 429 naming the bound; known ids still pass.
    let r = status("c").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.json()["type"], "urn:usher:problem:too-many-keys");
    assert!(
        r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("resource `per-tenant` already tracks 2 distinct ids (its max_keys)"),
        "{}",
        r.text()
    );
    let ids: Vec<String> =
        h.proxy.table.resource("per-tenant").unwrap().limiters().iter().map(|l| l.id().to_string()).collect();
    assert_eq!(ids, ["t/a", "t/b"]);
    assert!(h.proxy.table.set_capacity("t/a", 1000.0), "the lease client addresses keys by resource id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_queue_is_bounded() {
    let up = Upstream::gated().await;
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  g: {{ kind: gauge, capacity: 1, max_wait: 1h, max_queue: 1 }}\n  \
         r: {{ kind: rate, capacity: 1/s, burst: 1, max_wait: 1h, max_queue: 1 }}\n\
         routes:\n  - {{ name: g, match: {{ path_prefix: /g }}, upstream: up, resources: [g] }}\n  \
         - {{ name: r, match: {{ path_prefix: /r }}, upstream: up, resources: [r] }}\n",
        up.addr
    );
    let h = start(&yaml).await;
    let spawn = |path: &'static str| {
        let addr = h.addr;
        tokio::spawn(async move { send1(&mut h1(addr).await, get("api.test", path)).await })
    };
    // Gauge: one in flight, one waiting, the third is refused at once.
    let holder = spawn("/g");
    let s = up.stats.clone();
    eventually("the holder is in flight", || s.in_flight() == 1).await;
    let waiter = spawn("/g");
    let p = h.proxy.clone();
    eventually("one request waits", || waiters(&p, "g") == 1).await;
    let r = send1(&mut h1(h.addr).await, get("api.test", "/g")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.json()["detail"].as_str().unwrap().contains("too many requests waiting"), "{}", r.text());
    up.gate.add_permits(2);
    assert_eq!(within(holder).await.status, StatusCode::OK);
    assert_eq!(within(waiter).await.status, StatusCode::OK);

    // Rate: the burst passes, one is paced, the next is refused at once.
    up.gate.add_permits(3);
    assert_eq!(send1(&mut h1(h.addr).await, get("api.test", "/r")).await.status, StatusCode::OK);
    let paced = spawn("/r");
    let p = h.proxy.clone();
    eventually("one request is paced", || waiters(&p, "r") == 1).await;
    let r = send1(&mut h1(h.addr).await, get("api.test", "/r")).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), "2", "two slots ahead: 2 s");
    h.clock.advance(Duration::from_secs(1));
    assert_eq!(within(paced).await.status, StatusCode::OK);
}

/// As `rate_accuracy`, but every request is paced instead of refused: 50
/// connections each keep one request waiting in the pacer while the clock
/// moves in 50 ms steps. Whenever all 50 are parked in the pacer again, the
/// upstream must have seen exactly burst + 20/s × elapsed.
async fn paced_rate_accuracy(proto: Proto) {
    const CONNS: i64 = 50;
    const STEPS: u64 = 40; // 2 s of virtual time
    let up = Upstream::start().await;
    let h = start(&one_rate(up.addr, "20/s", 5, "1h")).await;
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..CONNS {
        let (addr, stop) = (h.addr, stop.clone());
        tasks.push(tokio::spawn(async move {
            let (mut c1, mut c2) = (None, None);
            match proto {
                Proto::H1 => c1 = Some(h1(addr).await),
                Proto::H2 => c2 = Some(h2(addr).await),
            }
            // Bounded: at most this many requests per connection.
            for _ in 0..1_000 {
                let send = async {
                    match (&mut c1, &mut c2) {
                        (Some(c), _) => send1(c, get("api.test", "/x")).await,
                        (_, Some(c)) => send2(c, get_abs("api.test", "/x")).await,
                        _ => unreachable!(),
                    }
                };
                tokio::select! {
                    r = send => assert_eq!(r.status, StatusCode::OK),
                    _ = stop.cancelled() => return,
                }
            }
            panic!("request bound reached");
        }));
    }
    let settled = |h: &Harness| waiters(&h.proxy, "api") == CONNS;
    for step in 0..=STEPS {
        if step > 0 {
            h.clock.advance(Duration::from_millis(50));
        }
        // Exactly one more slot per step: an overshoot never equals `expected` again and times out.
        let expected = 5 + step;
        eventually(&format!("{proto:?}: {expected} admitted after {} ms, the rest paced", step * 50), || {
            up.stats.requests() == expected && settled(&h)
        })
        .await;
    }
    // Stable: every connection is parked in the pacer, so nothing more can arrive.
    assert_eq!(up.stats.requests(), 5 + STEPS);
    stop.cancel();
    for t in tasks {
        within(t).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_rate_accuracy_http1_50_connections() {
    paced_rate_accuracy(Proto::H1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_rate_accuracy_h2c_50_connections() {
    paced_rate_accuracy(Proto::H2).await;
}
