//! Overload with apps that do as they are told: three sidecars share 60/s
//! (FAIR_SHARE, leases of 20 s refreshed every 5 s), and each app offers
//! about 1.5 times its share (30/s) through 8 connections. A refused request
//! waits out its `Retry-After` and is sent again, at most twice. While the
//! apps wait, their sidecars' demand must not collapse: after the first
//! 10 s, every 10 s window brings at least 95% of 60/s to the upstreams, and
//! each sidecar at least 90% of its share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{fleet, join, key, server, support};
use support::load::{Tally, retrying};
use support::retry_after::Limit;
use support::upstream::Upstream;

const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 60\n    algorithm: { kind: FAIR_SHARE, lease_length: 20, refresh_interval: 5, learning_mode_duration: 0 }\n";

/// What a user writes for the resource: the API's capacity.
const RES: &str = "    kind: rate\n    capacity: 60/s\n";

const SECS: usize = 40;
const WINDOW: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apps_waiting_out_retry_after_keep_the_capacity_used_and_each_share() {
    let dir = tempfile::tempdir().unwrap();
    let ups = [Upstream::start().await, Upstream::start().await, Upstream::start().await];
    let (_server, port) = server(dir.path(), CONFIG);
    let sidecars = fleet(dir.path(), port, &ups.each_ref(), "over", RES);
    let started = Instant::now();
    let dur = Duration::from_secs(SECS as u64);
    let tallies: Vec<Arc<Tally>> = sidecars.iter().map(|_| Arc::new(Tally::limited(Limit::Secs(5)))).collect();
    let tasks = sidecars
        .iter()
        .zip(&tallies)
        .map(|(s, t)| tokio::spawn(retrying(s.addr("listen"), 30.0, 8, 2, dur, t.clone())));
    let (given_up, failures) = join(tasks.collect()).await;
    let per: Vec<Vec<usize>> = ups.iter().map(|u| u.stats.per_second(started, SECS)).collect();
    // Every 10 s window from the 10th second on, sliding by a second.
    let windows: Vec<Vec<usize>> =
        per.iter().map(|p| (WINDOW..=SECS - WINDOW).map(|s| p[s..s + WINDOW].iter().sum()).collect()).collect();
    let fleet: Vec<usize> = (0..windows[0].len()).map(|w| windows.iter().map(|s| s[w]).sum()).collect();
    let report = format!(
        "per sidecar per second {per:?}\n10 s windows from the 10th second: per sidecar {windows:?}, fleet {fleet:?}\n\
         {:?}\ngiven up after two retries {given_up:?}\nkeys {:?}",
        tallies.iter().map(|t| t.summary()).collect::<Vec<_>>(),
        sidecars.iter().map(key).collect::<Vec<_>>(),
    );
    // 95% of 60/s, and 90% of a third of it, over 10 s.
    let mut missed = failures;
    if fleet.iter().any(|n| *n < 570) {
        missed.push("a window under 95% of the capacity (570)".into());
    }
    if windows.iter().flatten().any(|n| *n < 180) {
        missed.push("a sidecar under 90% of its share (180) in a window".into());
    }
    assert!(missed.is_empty(), "{missed:#?}\n{report}");
    eprintln!("{report}");
}
