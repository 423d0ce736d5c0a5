//! `window: calendar`: a quota that renews whole at each UTC boundary of its
//! unit. Apps offer far more than the quota, at a steady rate or in bursts
//! just after each minute begins; a stand-in upstream counts what reaches it
//! in each UTC minute. Across a fleet leasing from a real `usher server`
//! (three sidecars) and in embedded mode (one sidecar, no `doorman:`
//! section): no minute gets more than its quota plus one request per
//! sidecar, and every full minute gets nearly all of it, bursts included.
//!
//! The tests run at once (`usher_test_support::at_once`), each on its own
//! processes and upstream: each takes the first whole minute after it
//! starts.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use std::process::ExitCode;

use usher_test_support as support;
use usher_test_support::at_once::{self, Run, Runtime};

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

/// A counting upstream, a capacity server sharing `reports-api` as 120 in
/// each UTC minute, and three sidecars leasing it, whose resource has
/// `extra` settings (their files live as long as the directory returned).
async fn fleet(extra: &str) -> (tempfile::TempDir, Minutes, Usher, Vec<Usher>) {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, (up, minutes)) = (tmp.path(), counting_upstream().await);
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
    let server = Usher::server_at(&write_file(dir, "resources.yaml", resources), port, &[]);
    let sidecars: Vec<Usher> = (0..3)
        .map(|i| {
            let routes = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: app-{i}\n\
                 upstreams:\n  reports: {{ url: \"http://{up}\" }}\n\
                 resources:\n  reports-api: {{ kind: rate, capacity: 120/min{extra} }}\n\
                 routes:\n  - name: reports\n    upstream: reports\n    resources: [reports-api]\n"
            );
            Usher::proxy(&write_file(dir, &format!("s{i}.yaml"), &routes))
        })
        .collect();
    (tmp, minutes, server, sidecars)
}

/// Fires `burst` requests at once at each sidecar, at once and again just
/// after the next UTC minute begins; then checks every minute's count: at
/// most `quota + slack`, and at least `floor` in the whole one (nothing
/// reaches the upstream in it after its burst).
async fn burst_and_check(sidecars: &[Usher], burst: usize, minutes: &Minutes, quota: u64, slack: u64, floor: u64) {
    let whole = unix_now() as u64 / 60 + 1;
    let mut fired = Vec::new();
    for at in [None, Some(whole as f64 * 60.0 + 0.1)] {
        if let Some(at) = at {
            tokio::time::sleep(Duration::from_secs_f64((at - unix_now()).max(0.0))).await;
        }
        let tallies: Vec<Arc<Tally>> = sidecars.iter().map(|_| Arc::new(Tally::default())).collect();
        let shots: Vec<_> = sidecars
            .iter()
            .zip(&tallies)
            .flat_map(|(s, t)| (0..burst).map(move |_| tokio::spawn(shoot(s.addr("listen"), t.clone()))))
            .collect();
        for shot in shots {
            shot.await.unwrap();
        }
        fired.push(tallies.iter().map(|t| t.summary()).collect::<Vec<_>>());
    }
    let counts = minutes.lock().unwrap().clone();
    let report = format!("per UTC minute: {counts:?} (the whole one: {whole}); sidecars, burst by burst: {fired:?}");
    eprintln!("{report}");
    for (m, n) in &counts {
        assert!(*n <= quota + slack, "minute {m} got {n} of a {quota} quota\n{report}");
    }
    let got = counts.get(&whole).copied().unwrap_or(0);
    assert!(got >= floor, "the whole minute {whole} got only {got} of {quota}\n{report}");
    assert!(fired.iter().flatten().all(|t| t.contains("errors 0")), "{report}");
}

/// One request to the sidecar at `addr`, on a connection of its own.
async fn shoot(addr: SocketAddr, tally: Arc<Tally>) {
    let mut c = support::upstream::h1(addr).await;
    let status = support::upstream::send1(&mut c, support::upstream::get("app.local", "/x")).await.status.as_u16();
    let counter = match status {
        200 => &tally.ok,
        429 => &tally.refused,
        _ => &tally.other,
    };
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

async fn three_sidecars_spend_a_calendar_minute_once() {
    let (_dir, minutes, server, sidecars) = fleet("").await;
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

/// Apps that fire 50 requests each at once, just after each minute begins,
/// get the whole quota through: it is spendable from the start of the unit,
/// not spread over it.
async fn three_sidecars_that_burst_get_the_whole_minute() {
    let (_dir, minutes, _server, sidecars) = fleet(", max_wait: 500ms").await;
    burst_and_check(&sidecars, 50, &minutes, 120, 3, 110).await;
}

/// The same with the sidecar's embedded server keeping the count.
async fn an_embedded_sidecar_that_bursts_gets_the_whole_minute() {
    let (_dir, minutes, sidecar) = embedded(", max_wait: 500ms").await;
    burst_and_check(&[sidecar], 150, &minutes, 120, 1, 110).await;
}

async fn an_embedded_sidecar_spends_a_calendar_minute_once() {
    let (_dir, minutes, sidecar) = embedded("").await;
    offer_and_check(&[sidecar], 6.0, &minutes, 120, 1, 110).await;
}

/// A counting upstream and one sidecar with no `doorman:` section whose
/// resource is 120 in each UTC minute, with `extra` settings.
async fn embedded(extra: &str) -> (tempfile::TempDir, Minutes, Usher) {
    let dir = tempfile::tempdir().unwrap();
    let (up, minutes) = counting_upstream().await;
    let routes = format!(
        "upstreams:\n  reports: {{ url: \"http://{up}\" }}\n\
         resources:\n  reports-api: {{ kind: rate, capacity: 120/min, window: calendar{extra} }}\n\
         routes:\n  - name: reports\n    upstream: reports\n    resources: [reports-api]\n"
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    (dir, minutes, sidecar)
}

/// With a `doorman:` section the capacity servers' resources file decides a
/// resource's window: a routes file's `window: calendar` is ignored there.
/// `usher check` (exit 0) and the sidecar's start-up log say so, naming the
/// field's position; without `doorman:` neither says anything.
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

/// Every test, by name: they run at once (`usher_test_support::at_once`).
const TESTS: &[(&str, Run)] = &[
    ("a_calendar_window_beside_a_doorman_section_is_said_to_be_ignored", || {
        Box::pin(async { a_calendar_window_beside_a_doorman_section_is_said_to_be_ignored() })
    }),
    ("three_sidecars_spend_a_calendar_minute_once", || Box::pin(three_sidecars_spend_a_calendar_minute_once())),
    ("three_sidecars_that_burst_get_the_whole_minute", || Box::pin(three_sidecars_that_burst_get_the_whole_minute())),
    ("an_embedded_sidecar_that_bursts_gets_the_whole_minute", || {
        Box::pin(an_embedded_sidecar_that_bursts_gets_the_whole_minute())
    }),
    ("an_embedded_sidecar_spends_a_calendar_minute_once", || {
        Box::pin(an_embedded_sidecar_spends_a_calendar_minute_once())
    }),
];

fn main() -> ExitCode {
    at_once::main(TESTS, &[], Runtime::PerTest(2))
}
