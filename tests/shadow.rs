//! Shadow mode: a resource with `shadow: true` makes every decision as if
//! enforced and counts it, but forwards every request at once. Two sidecars
//! with the same routes file, one of them in shadow mode, under the same
//! load: the shadow one refuses nothing, and what it counts as
//! `shadow_refused` (metrics and access log) matches the enforcing twin's
//! refusals.

use usher_test_support as support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use support::load::{Tally, drive};
use support::upstream::{Upstream, routes};
use support::{Usher, http_get, metric, write_file};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_resource_forwards_everything_and_counts_what_it_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let (up_enforced, up_shadow) = (Upstream::start().await, Upstream::start().await);
    let res = "    kind: rate\n    capacity: 10/s\n    burst: 5\n";
    let log = dir.path().join("access.log");
    let enforced = Usher::proxy(&write_file(dir.path(), "enforced.yaml", &routes(&up_enforced, "", res)));
    let shadow_file =
        format!("access_log: {}\n{}", log.display(), routes(&up_shadow, "", &format!("{res}    shadow: true\n")));
    let shadow = Usher::proxy(&write_file(dir.path(), "shadow.yaml", &shadow_file));

    let (te, ts) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let secs = Duration::from_secs(4);
    let a = tokio::spawn(drive(enforced.addr("listen"), 40.0, secs, te.clone()));
    let b = tokio::spawn(drive(shadow.addr("listen"), 40.0, secs, ts.clone()));
    a.await.unwrap();
    b.await.unwrap();

    let refused = te.refused.load(Ordering::Relaxed);
    assert!(refused > 50, "the enforcing twin refuses: {}", te.summary());
    assert_eq!(ts.refused.load(Ordering::Relaxed), 0, "shadow refuses nothing: {}", ts.summary());
    assert_eq!(up_shadow.stats.requests(), ts.ok.load(Ordering::Relaxed), "every request reached its upstream");

    let (_, text) = http_get(shadow.addr("admin"), "/metrics");
    let counted = metric(&text, "usher_proxy_requests_total", &[("route", "all"), ("outcome", "shadow_refused")])
        .expect("a shadow_refused series");
    let by_resource =
        metric(&text, "usher_proxy_resource_requests_total", &[("resource", "api"), ("outcome", "shadow_refused")]);
    assert_eq!(by_resource, Some(counted));
    let (e, s) = (refused as f64, counted);
    assert!((s - e).abs() <= 0.05 * e + 2.0, "shadow counted {s} refusals, its enforcing twin refused {e}");

    // The access log says so, line by line.
    let mut lines = 0;
    for _ in 0..50 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        lines = text.lines().filter(|l| l.contains("\"outcome\":\"shadow_refused\"")).count();
        if lines as f64 >= counted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lines as f64, counted, "one access log line per shadow refusal");

    // The status page shows the resource in shadow mode.
    let (_, body) = http_get(shadow.addr("admin"), "/debug/status?format=json");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["keys"][0]["shadow"], true, "{body}");
}
