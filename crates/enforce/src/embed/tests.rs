use std::convert::Infallible;

use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt};

use http::HeaderName;

use super::*;

fn config(yaml: &str) -> RoutesConfig {
    RoutesConfig::parse("embed.yaml", yaml).unwrap_or_else(|e| panic!("{e}"))
}

type Svc = tower::util::BoxCloneService<Request<String>, Response<LimitBody<Full<Bytes>>>, Infallible>;

fn limited(layer: LimitLayer) -> Svc {
    let ok = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
    });
    tower::util::BoxCloneService::new(ServiceBuilder::new().layer(layer).service(ok))
}

async fn status(svc: &Svc, req: Request<String>) -> (u16, Response<LimitBody<Full<Bytes>>>) {
    let resp = svc.clone().oneshot(req).await.unwrap();
    (resp.status().as_u16(), resp)
}

#[tokio::test]
async fn a_gauge_permit_lasts_until_the_body_ends_and_clones_share_one_budget() {
    let limits = Limits::start(config("resources:\n  g: { kind: gauge, capacity: 1 }\n")).await.unwrap();
    assert_eq!(limits.source(), Source::Embedded);
    let svc = limited(limits.layer("g").unwrap());
    let (first, body) = status(&svc, Request::new(String::new())).await;
    assert_eq!(first, 200);
    // Another clone of the service, as another connection would use: the same budget.
    let (second, refusal) = status(&svc.clone(), Request::new(String::new())).await;
    assert_eq!(second, 429);
    assert!(refusal.headers().contains_key("retry-after"));
    let text = refusal.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("urn:usher:problem:rate-limited"), "{text:?}");
    // The body ends: the permit goes back.
    body.into_body().collect().await.unwrap();
    assert_eq!(status(&svc, Request::new(String::new())).await.0, 200);
    limits.shutdown().await;
}

#[tokio::test]
async fn a_templated_id_keeps_one_budget_per_value_and_grpc_gets_resource_exhausted() {
    let limits = Limits::start(config(
        "resources:\n  t: { kind: rate, capacity: 1/min, id: \"t/{header.x-tenant}\", max_keys: 2 }\n",
    ))
    .await
    .unwrap();
    let svc = limited(limits.layer("t").unwrap());
    let tenant = |t: &str| Request::builder().header("x-tenant", t).body(String::new()).unwrap();
    assert_eq!(status(&svc, tenant("a")).await.0, 200);
    assert_eq!(status(&svc, tenant("a")).await.0, 429);
    assert_eq!(status(&svc, tenant("b")).await.0, 200, "another tenant has its own budget");
    let grpc =
        Request::builder().header("x-tenant", "a").header("content-type", "application/grpc").body(String::new());
    let (code, resp) = status(&svc, grpc.unwrap()).await;
    assert_eq!((code, resp.headers()["grpc-status"].to_str().unwrap()), (200, "8"));
    assert_eq!(status(&svc, tenant("c")).await.0, 429, "max_keys: a third tenant is refused");
    assert!(matches!(limits.layer("nope"), Err(UnknownResource(_))));
    limits.shutdown().await;
}

/// A service stack of `layer` around `inner`, which answers with `answer(n)` to its `n`th call (from 0).
fn answering(
    layer: LimitLayer,
    answer: impl Fn(usize) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
) -> (Svc, Arc<std::sync::atomic::AtomicUsize>) {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = calls.clone();
    let inner = tower::service_fn(move |_req: Request<String>| {
        let n = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let resp = answer(n);
        async move { Ok::<_, Infallible>(resp) }
    });
    (tower::util::BoxCloneService::new(ServiceBuilder::new().layer(layer).service(inner)), calls)
}

fn calls(c: &std::sync::atomic::AtomicUsize) -> usize {
    c.load(std::sync::atomic::Ordering::SeqCst)
}

#[tokio::test]
async fn a_shadow_resource_forwards_every_request_and_counts_what_its_enforcing_twin_refuses() {
    let limits = Limits::start(config(
        "resources:\n  enforced: { kind: rate, capacity: 1/min, burst: 2 }\n  \
         shadowed: { kind: rate, capacity: 1/min, burst: 2, shadow: true }\n  \
         slots: { kind: gauge, capacity: 1, shadow: true }\n",
    ))
    .await
    .unwrap();
    let (enforced, _) = answering(limits.layer("enforced").unwrap(), |_| Response::new(Full::new(Bytes::new())));
    let (shadowed, reached) = answering(limits.layer("shadowed").unwrap(), |_| Response::new(Full::new(Bytes::new())));
    let mut codes = (Vec::new(), Vec::new());
    for _ in 0..5 {
        codes.0.push(status(&enforced, Request::new(String::new())).await.0);
        codes.1.push(status(&shadowed, Request::new(String::new())).await.0);
    }
    assert_eq!(codes.0, [200, 200, 429, 429, 429]);
    assert_eq!(codes.1, [200; 5], "shadow mode refuses nothing");
    assert_eq!(calls(&reached), 5, "every request reached the inner service");
    let twin = limits.outcomes("enforced").unwrap();
    let shadow = limits.outcomes("shadowed").unwrap();
    assert_eq!((twin.admitted, twin.refused, twin.shadow_refused), (2, 3, 0));
    assert_eq!((shadow.admitted, shadow.refused, shadow.shadow_refused), (5, 0, twin.refused));
    // The sidecar's series, in the registry.
    let families = limits.registry().gather();
    let requests = families.iter().find(|f| f.name() == "usher_proxy_resource_requests_total").unwrap();
    let counted = requests.get_metric().iter().find(|m| {
        let labels: Vec<_> = m.get_label().iter().map(|l| (l.name(), l.value())).collect();
        labels.contains(&("resource", "shadowed")) && labels.contains(&("outcome", "shadow_refused"))
    });
    assert_eq!(counted.map(|m| m.get_counter().get_value()), Some(3.0));

    // Outside a tower stack too.
    let permit = limits.admit("shadowed", 1.0).await.unwrap();
    assert!(permit.shadow_refused());
    assert_eq!(limits.outcomes("shadowed").unwrap().shadow_refused, 4);

    // A shadow gauge's permit, as an enforced one's, lasts until the body ends.
    let (slots, _) = answering(limits.layer("slots").unwrap(), |_| Response::new(Full::new(Bytes::from("ok"))));
    let (first, body) = status(&slots, Request::new(String::new())).await;
    assert_eq!((first, status(&slots, Request::new(String::new())).await.0), (200, 200));
    assert_eq!(limits.outcomes("slots").unwrap().shadow_refused, 1, "the first request holds the slot");
    body.into_body().collect().await.unwrap();
    assert_eq!(status(&slots, Request::new(String::new())).await.0, 200);
    assert_eq!(limits.outcomes("slots").unwrap().shadow_refused, 1, "the slot was given back");
    limits.shutdown().await;
}

#[tokio::test]
async fn costs_read_from_a_request_header_are_settled_from_the_answer() {
    let limits = Limits::start(config(
        "resources:\n  tokens: { kind: rate, capacity: 1000/min, burst: 1000 }\n  \
         unsettled: { kind: rate, capacity: 1000/min, burst: 1000 }\n",
    ))
    .await
    .unwrap();
    let max_tokens = HeaderName::from_static("x-max-tokens");
    let usage = HeaderName::from_static("x-usage-total-tokens");
    // An LLM's answer: each request used 300 tokens.
    let used = |_| Response::builder().header("x-usage-total-tokens", "300").body(Full::new(Bytes::new())).unwrap();
    let layer = limits.layer("tokens").unwrap().cost_from_header(max_tokens.clone()).settle_from_header(usage);
    let (settled, _) = answering(layer, used);
    let (unsettled, _) = answering(limits.layer("unsettled").unwrap().cost_from_header(max_tokens), used);
    let ask = |n: &str| Request::builder().header("x-max-tokens", n).body(String::new()).unwrap();
    let mut codes = (Vec::new(), Vec::new());
    for _ in 0..3 {
        codes.0.push(status(&settled, ask("600")).await.0);
        codes.1.push(status(&unsettled, ask("600")).await.0);
    }
    // 1000 of burst: 600 charged, 300 spent, 300 given back, and so on.
    assert_eq!(codes.0, [200, 200, 429], "settled");
    assert_eq!(codes.1, [200, 429, 429], "each request keeps the 600 it was charged");
    // Without the header, the layer's own cost.
    let (fallback, _) = answering(
        limits.layer_with_cost("unsettled", 500.0).unwrap().cost_from_header(HeaderName::from_static("x-max-tokens")),
        used,
    );
    assert_eq!(status(&fallback, Request::new(String::new())).await.0, 429, "500 charged: only 400 are left");
    limits.shutdown().await;
}

/// A GitHub-like answer: `remaining` of 60, renewed 30 s from now.
fn github(status: u16, remaining: u32) -> Response<Full<Bytes>> {
    let now = Clock::system().now().as_secs();
    Response::builder()
        .status(status)
        .header("x-ratelimit-limit", "60")
        .header("x-ratelimit-remaining", remaining.to_string())
        .header("x-ratelimit-reset", (now + 30).to_string())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test]
async fn an_answer_that_says_the_quota_is_spent_holds_the_key_until_its_reset() {
    let limits = Limits::start(config(
        "resources:\n  gh: { kind: rate, capacity: 100/s, burst: 100, upstream_quota: { headers: github } }\n",
    ))
    .await
    .unwrap();
    // Two answers with quota left, then GitHub's 403 with nothing remaining.
    let (svc, reached) =
        answering(limits.layer("gh").unwrap(), |n| if n < 2 { github(200, 2 - n as u32) } else { github(403, 0) });
    for want in [200, 200, 403] {
        assert_eq!(status(&svc, Request::new(String::new())).await.0, want);
    }
    let (code, refusal) = status(&svc, Request::new(String::new())).await;
    assert_eq!(code, 429, "held until the reset");
    let retry: u64 = refusal.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((28..=31).contains(&retry), "Retry-After {retry}: the reset is 30 s away");
    let text = refusal.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("is held: its upstream asked to wait"), "{text:?}");
    assert_eq!(calls(&reached), 3, "the held request never reached the inner service");
    assert_eq!(limits.capacity("gh"), Some(0.0));
    // The quota as the key keeps it, for the lease client to carry up the tree.
    let key = limits.inner.table.resource("gh").unwrap().get("gh").unwrap();
    let (quota, _) = key.quota(false);
    assert_eq!(quota.map(|q| (q.limit, q.remaining)), Some((60.0, 0.0)));
    limits.shutdown().await;
}
