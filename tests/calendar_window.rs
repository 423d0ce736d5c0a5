//! `window: calendar`: a quota that renews whole at each UTC boundary of its
//! unit. Apps offer far more than the quota; a stand-in upstream counts what
//! reaches it in each UTC minute. Across a fleet leasing from a real
//! `usher server` (three sidecars) and in embedded mode (one sidecar, no
//! `doorman:` section): no minute gets more than its quota plus one request
//! per sidecar, and every full minute gets nearly all of it.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::load::{Tally, drive};
use support::{Usher, free_port, http_get, run_usher, write_file};

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// Requests that reached the upstream, by UTC minute.
type Minutes = Arc<Mutex<BTreeMap<u64, u64>>>;

/// An upstream that answers everything and counts arrivals per UTC minute.
async fn counting_upstream() -> (SocketAddr, Minutes) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let minutes: Minutes = Arc::default();
    let m = minutes.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let minutes = m.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                    *minutes.lock().unwrap().entry(unix_now() as u64 / 60).or_default() += 1;
                    async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, minutes)
}

/// Drives each sidecar at `rate` until the end of the first whole UTC minute
/// after now, then checks every minute's count: at most `quota + slack`,
/// and at least `floor` in the whole one.
async fn offer_and_check(sidecars: &[Usher], rate: f64, minutes: &Minutes, quota: u64, slack: u64, floor: u64) {
    let start = unix_now();
    let whole = start as u64 / 60 + 1;
    let dur = Duration::from_secs_f64((whole + 1) as f64 * 60.0 - start);
    let tallies: Vec<Arc<Tally>> = sidecars.iter().map(|_| Arc::new(Tally::default())).collect();
    let loads: Vec<_> = sidecars
        .iter()
        .zip(&tallies)
        .map(|(s, t)| tokio::spawn(drive(s.addr("listen"), rate, dur, t.clone())))
        .collect();
    for l in loads {
        l.await.unwrap();
    }
    let counts = minutes.lock().unwrap().clone();
    let report = format!(
        "per UTC minute: {counts:?} (the whole one: {whole}); sidecars: {:?}",
        tallies.iter().map(|t| t.summary()).collect::<Vec<_>>()
    );
    eprintln!("{report}");
    for (m, n) in &counts {
        assert!(*n <= quota + slack, "minute {m} got {n} of a {quota} quota\n{report}");
    }
    let got = counts.get(&whole).copied().unwrap_or(0);
    assert!(got >= floor, "the whole minute {whole} got only {got} of {quota}\n{report}");
    for t in &tallies {
        assert_eq!(t.errors.load(std::sync::atomic::Ordering::Relaxed), 0, "{report}");
        assert!(t.refused.load(std::sync::atomic::Ordering::Relaxed) > 0, "offered more than the quota\n{report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_spend_a_calendar_minute_once() {
    let dir = tempfile::tempdir().unwrap();
    let (up, minutes) = counting_upstream().await;
    let port = free_port();
    let resources = concat!(
        "resources:\n",
        "  - identifier_glob: reports-api\n",
        "    capacity: 120/min\n",
        "    window: calendar\n",
        "    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n",
        "  - identifier_glob: '*'\n",
        "    capacity: 0\n",
        "    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n",
    );
    let server = Usher::server_at(&write_file(dir.path(), "resources.yaml", resources), port, &[]);
    let sidecars: Vec<Usher> = (0..3)
        .map(|i| {
            let routes = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: app-{i}\n\
                 upstreams:\n  reports: {{ url: \"http://{up}\" }}\n\
                 resources:\n  reports-api: {{ kind: rate, capacity: 120/min }}\n\
                 routes:\n  - name: reports\n    upstream: reports\n    resources: [reports-api]\n"
            );
            Usher::proxy(&write_file(dir.path(), &format!("s{i}.yaml"), &routes))
        })
        .collect();
    offer_and_check(&sidecars, 3.0, &minutes, 120, 3, 110).await;
    // The server's status page shows the quota it counts.
    let (code, body) = http_get(server.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let r = status["resources"].as_array().unwrap().iter().find(|r| r["id"] == "reports-api").expect(&body);
    assert_eq!(r["quota"]["source"], "calendar", "{r}");
    assert_eq!(r["quota"]["limit"], 120.0, "{r}");
    let (left, reset) = (r["quota"]["remaining"].as_f64().unwrap(), r["quota"]["reset_in_s"].as_f64().unwrap());
    assert!((0.0..=120.0).contains(&left) && reset > 0.0 && reset <= 60.0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_sidecar_spends_a_calendar_minute_once() {
    let dir = tempfile::tempdir().unwrap();
    let (up, minutes) = counting_upstream().await;
    let routes = format!(
        "upstreams:\n  reports: {{ url: \"http://{up}\" }}\n\
         resources:\n  reports-api: {{ kind: rate, capacity: 120/min, window: calendar }}\n\
         routes:\n  - name: reports\n    upstream: reports\n    resources: [reports-api]\n"
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    offer_and_check(&[sidecar], 6.0, &minutes, 120, 1, 110).await;
}

/// With a `doorman:` section the capacity servers' resources file decides a
/// resource's window: a routes file's `window: calendar` is ignored there.
/// `usher check` (exit 0) and the sidecar's start-up log say so, naming the
/// field's position; without `doorman:` neither says anything.
#[test]
fn a_calendar_window_beside_a_doorman_section_is_said_to_be_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let resources = "resources:\n  reports:\n    kind: rate\n    capacity: 120/min\n    window: calendar\n";
    let leased = write_file(
        dir.path(),
        "leased.yaml",
        &format!("doorman:\n  servers: [\"127.0.0.1:{}\"]\n  client_id: a\n{resources}", free_port()),
    );
    let embedded = write_file(dir.path(), "embedded.yaml", resources);
    let file = leased.to_str().unwrap();
    let want = format!(
        "{file}:8:13: resources.reports.window: `window: calendar` applies only without a `doorman:` section; \
         with capacity servers it is ignored here (hint: write `window: calendar` in the capacity server's \
         resources file, on the entry whose identifier_glob matches `reports`"
    );
    let (code, out, err) = run_usher(&["check", file]);
    assert_eq!(code, 0, "a warning, not an error:\n{out}{err}");
    assert!(out.contains(&format!("  warning: {want}")), "{out}");
    let (code, out, _) = run_usher(&["check", embedded.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(!out.contains("warning"), "embedded mode keeps the window: {out}");

    let sidecar = Usher::start(
        &["proxy", "--routes", file, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[],
        "usher proxy listening",
    );
    let log = sidecar.log();
    assert!(log.lines().any(|l| l.contains("WARN") && l.contains(&want)), "{log}");
}
