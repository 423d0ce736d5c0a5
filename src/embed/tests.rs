use std::convert::Infallible;

use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt};

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
    let limits = Limits::start(config("resources:\n  g: { kind: gauge, capacity: 1 }\n")).await;
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
    .await;
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
