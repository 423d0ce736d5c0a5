//! Idle fallback at any lease length: two sidecars share 600/min (10/s,
//! FAIR_SHARE, no `safe_capacity`). Their apps send 8/s each for 10 s, then
//! nothing for 25 s; then the server is killed for good. Thirty seconds
//! later each app sends 10 requests at 1/s: at least 9 of each 10 pass,
//! since an idle sidecar cut off from every server runs on its share. The
//! upstream never sees more than the capacity in any 1 s (10, plus the
//! fleet's burst of 2 and one request per sidecar). With leases of 20 s
//! refreshed every 5 s, 60 s every 15 s, and 2 s every 1 s, side by side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{fleet, join, key, server, support};
use support::load::{Tally, drive_strict};
use support::retry_after::Limit;
use support::upstream::Upstream;

const RES: &str = "    kind: rate\n    capacity: 10/s\n    burst: 2\n    max_wait: 200ms\n";

/// The most the upstream may see in any 1 s: 10/s, the burst of 2, one request per sidecar.
const MOST_IN_1S: usize = 10 + 2 + 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_sidecars_cut_off_for_good_run_on_their_share_at_any_lease_length() {
    let setups = [(20, 5), (60, 15), (2, 1)].map(|(lease, refresh)| tokio::spawn(setup(lease, refresh)));
    let (outcomes, failures) = join(setups.into()).await;
    let outcomes: Vec<(bool, String)> = outcomes.into_iter().flatten().collect();
    let report = outcomes.iter().map(|(_, r)| r.as_str()).collect::<Vec<_>>().join("\n");
    assert!(failures.is_empty(), "{failures:#?}\n{report}");
    assert!(outcomes.iter().all(|(ok, _)| *ok), "{report}");
    eprintln!("{report}");
}

/// One lease length's run: whether it met the bars, and what it measured.
async fn setup(lease: u64, refresh: u64) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: 600/min\n    algorithm: {{ kind: FAIR_SHARE, lease_length: {lease}, refresh_interval: {refresh} }}\n"
    );
    // One upstream: what the fleet sends.
    let up = Arc::new(Upstream::start().await);
    let (path, shared) = (dir.path().to_owned(), up.clone());
    let (mut server, sidecars) = tokio::task::spawn_blocking(move || {
        let (server, port) = server(&path, &config);
        (server, fleet(&path, port, &[&shared, &shared], &format!("idle{lease}"), RES))
    })
    .await
    .unwrap();
    let limit = Limit::Secs(refresh);
    let started = Instant::now();
    let busy = load(&sidecars, 8.0, Duration::from_secs(10), limit).await;
    tokio::time::sleep(Duration::from_secs(25)).await;
    let before = sidecars.iter().map(key).collect::<Vec<_>>();
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let after_at = Instant::now();
    // Ten send times 1 s apart, the last at 9 s.
    let (after, failures) = load(&sidecars, 1.0, Duration::from_millis(9500), limit).await;
    let most = up.stats.max_in_window(started, Instant::now(), Duration::from_secs(1));
    let admitted = after.iter().all(|t| t.ok.load(std::sync::atomic::Ordering::Relaxed) >= 9);
    let capped = most <= MOST_IN_1S;
    let failures: Vec<String> = busy.1.into_iter().chain(failures).collect();
    let report = format!(
        "lease {lease} s, refresh {refresh} s: at least 9 of 10 admitted by each: {admitted}; \
         at most {MOST_IN_1S} in any 1 s at the upstream: {capped} ({most})\n  \
         busy: {:?}\n  idle, before the kill: {before:?}\n  after the kill: {:?}\n  \
         after the kill, per second at the upstream: {:?}\n  keys at the end: {:?}{}",
        busy.0.iter().map(|t| t.summary()).collect::<Vec<_>>(),
        after.iter().map(|t| t.summary()).collect::<Vec<_>>(),
        up.stats.per_second(after_at, 10),
        sidecars.iter().map(key).collect::<Vec<_>>(),
        if failures.is_empty() { String::new() } else { format!("\n  {failures:?}") }
    );
    let ok = admitted && capped && failures.is_empty();
    (ok, report)
}

/// Offers `rate` to each sidecar for `dur`: each one's tally, and the
/// messages of loads that failed (a bad `Retry-After`).
async fn load(sidecars: &[support::Usher], rate: f64, dur: Duration, limit: Limit) -> (Vec<Arc<Tally>>, Vec<String>) {
    let tallies: Vec<Arc<Tally>> = sidecars.iter().map(|_| Arc::new(Tally::limited(limit))).collect();
    let tasks =
        sidecars.iter().zip(&tallies).map(|(s, t)| tokio::spawn(drive_strict(s.addr("listen"), rate, dur, t.clone())));
    let failures = join(tasks.collect()).await.1;
    (tallies, failures)
}
