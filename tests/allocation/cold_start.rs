//! Cold start under any load shape: three sidecars start together against a
//! server sharing 90/s (FAIR_SHARE, leases of 20 s refreshed every 5 s),
//! each with `wants: auto`, a fleet burst of 2 and `max_wait: 50ms`. From the
//! second second on, each admits at least 90% of its share (27 of 30) in
//! every second, counted at its own upstream; no second's total passes the
//! capacity, the fleet's burst and one request per sidecar (95). Five runs
//! in a row of each shape:
//!
//! - closed loop: 6 connections per app, each sending its next request as
//!   soon as the previous one is answered, 200 or 429;
//! - the same, with the whole capacity as the first `wants`;
//! - open loop at 1.5 times the share (45/s per app).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{fleet, join, key, server, support};
use support::load::{Tally, closed_loop, drive};
use support::retry_after::Limit;
use support::upstream::Upstream;

/// The server has been running for a while: what it learns at its own start
/// is not what these tests are about.
const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 90\n    algorithm: { kind: FAIR_SHARE, lease_length: 20, refresh_interval: 5, learning_mode_duration: 0 }\n";

const RUNS: usize = 5;
const SECS: usize = 8;
/// 90% of a third of 90/s.
const LEAST: usize = 27;
/// The capacity, the fleet's burst, one request per sidecar.
const MOST: usize = 90 + 2 + 3;

/// How the apps load their sidecars.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// This many connections per app, each sending as soon as answered.
    Closed(usize),
    /// This many requests per second per app, whatever the answers.
    Open(f64),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_each_sidecar_has_its_share_from_the_second_second() {
    runs(1, Shape::Closed(6)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_first_asking_the_whole_capacity_each_has_its_share_from_the_second_second() {
    runs(90, Shape::Closed(6)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_at_one_and_a_half_shares_each_has_its_share_from_the_second_second() {
    runs(1, Shape::Open(45.0)).await;
}

/// [`RUNS`] runs in a row; fails naming every run's numbers if any missed a bar.
async fn runs(first_wants: u32, shape: Shape) {
    let mut reports = Vec::new();
    let mut passed = 0;
    for run in 1..=RUNS {
        let (ok, report) = one_run(first_wants, shape).await;
        passed += usize::from(ok);
        reports.push(format!("run {run} ({}): {report}", if ok { "met the bars" } else { "MISSED" }));
    }
    let report =
        format!("first wants {first_wants}, {shape:?}: {passed} of {RUNS} runs met the bars\n{}", reports.join("\n"));
    assert_eq!(passed, RUNS, "{report}");
    eprintln!("{report}");
}

/// A fresh server and fleet, loaded for [`SECS`]: whether the bars held, and
/// what each sidecar admitted each second.
async fn one_run(first_wants: u32, shape: Shape) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let ups = [Upstream::start().await, Upstream::start().await, Upstream::start().await];
    let res =
        format!("    kind: rate\n    capacity: {first_wants}\n    burst: 2\n    wants: auto\n    max_wait: 50ms\n");
    let (_server, port) = server(dir.path(), CONFIG);
    let sidecars = fleet(dir.path(), port, &ups.each_ref(), "cold", &res);
    let started = Instant::now();
    let dur = Duration::from_secs(SECS as u64);
    let tallies: Vec<Arc<Tally>> = sidecars.iter().map(|_| Arc::new(Tally::limited(Limit::Secs(5)))).collect();
    let tasks = sidecars.iter().zip(&tallies).map(|(s, t)| match shape {
        Shape::Closed(conns) => tokio::spawn(closed_loop(s.addr("listen"), conns, dur, t.clone())),
        Shape::Open(rate) => tokio::spawn(drive(s.addr("listen"), rate, dur, t.clone())),
    });
    let (_, failures) = join(tasks.collect()).await;
    let per: Vec<Vec<usize>> = ups.iter().map(|u| u.stats.per_second(started, SECS)).collect();
    let total: Vec<usize> = (0..SECS).map(|s| per.iter().map(|p| p[s]).sum()).collect();
    let shares = per.iter().all(|p| p[1..].iter().all(|n| *n >= LEAST));
    let capped = total.iter().all(|n| *n <= MOST);
    let report = format!(
        "each at least {LEAST}/s from the second second: {shares}, no second over {MOST}: {capped}\n  \
         per sidecar per second {per:?}, total {total:?}\n  {:?}\n  keys {:?}{}",
        tallies.iter().map(|t| t.summary()).collect::<Vec<_>>(),
        sidecars.iter().map(key).collect::<Vec<_>>(),
        if failures.is_empty() { String::new() } else { format!("; {failures:?}") }
    );
    (shares && capped && failures.is_empty(), report)
}
