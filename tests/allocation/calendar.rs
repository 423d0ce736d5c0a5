//! Calendar windows, spendable: a quota of 120 per UTC minute, leased by
//! three sidecars from a real server (leases of 60 s refreshed every 15 s,
//! as a user would write them). Each app fires 50 requests at once just
//! after each UTC minute begins; each sidecar may pace them for 500 ms. In
//! each of three whole minutes, at least 110 of the 150 reach the upstream,
//! and never more than 123 (the quota, and one request per sidecar).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{join, key, server, support};
use support::load::{Tally, fire};
use support::retry_after::Limit;
use support::upstream::Upstream;
use support::{Usher, write_file};

const RESOURCES: &str = "resources:
  - identifier_glob: cal
    capacity: 120/min
    window: calendar
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }
  - identifier_glob: '*'
    capacity: 0
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }
";

/// Whole minutes measured.
const MINUTES: u64 = 3;
/// Requests each app fires at the start of each minute.
const FIRED: usize = 50;

fn unix_now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

/// Sleeps until `at` (unix time).
async fn until(at: Duration) {
    tokio::time::sleep(at.saturating_sub(unix_now())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_at_each_minute_spend_a_calendar_quota_and_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let (server, port) = server(dir.path(), RESOURCES);
    let up = Upstream::start().await;
    let files: Vec<_> = (0..3)
        .map(|i| {
            let routes = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: cal-{i}\n\
                 upstreams:\n  up: {{ url: \"http://{}\" }}\n\
                 resources:\n  cal: {{ kind: rate, capacity: 120/min, max_wait: 500ms }}\n\
                 routes:\n  - name: all\n    upstream: up\n    resources: [cal]\n",
                up.addr
            );
            write_file(dir.path(), &format!("cal-{i}.yaml"), &routes)
        })
        .collect();
    let sidecars = Usher::proxies(&files);
    // The first whole minute begins at least 5 s from now: the sidecars have their first leases by then.
    let first = (unix_now().as_secs() + 5).div_ceil(60);
    let mut tallies = Vec::new();
    let mut failures = Vec::new();
    for m in first..first + MINUTES {
        until(Duration::from_secs(m * 60) + Duration::from_millis(100)).await;
        let fired: Vec<Arc<Tally>> =
            sidecars.iter().map(|_| Arc::new(Tally::limited(Limit::UtcBoundary(60)))).collect();
        let tasks =
            sidecars.iter().zip(&fired).map(|(s, t)| tokio::spawn(fire(s.addr("listen"), FIRED, FIRED, t.clone())));
        failures.extend(join(tasks.collect()).await.1);
        tallies.push((m, fired));
    }
    let counts = up.stats.per_utc_unit(60);
    let mut report = format!("reached the upstream, by UTC minute: {counts:?}\n");
    for (m, fired) in &tallies {
        let each: Vec<String> = fired.iter().map(|t| t.summary()).collect();
        report.push_str(&format!("minute {m}: {each:#?}\n"));
    }
    let status = server.status();
    let quota = status["resources"].as_array().unwrap().iter().find(|r| r["id"] == "cal").map(|r| r["quota"].clone());
    report.push_str(&format!(
        "server's quota: {quota:?}\nsidecars' keys: {:?}",
        sidecars.iter().map(key).collect::<Vec<_>>()
    ));
    let mut missed = failures;
    missed.extend(counts.iter().filter(|(_, n)| **n > 123).map(|(m, n)| format!("minute {m}: {n} of a 120 quota")));
    for m in first..first + MINUTES {
        let n = counts.get(&m).copied().unwrap_or(0);
        if n < 110 {
            missed.push(format!("minute {m}: only {n} of the 120 quota"));
        }
    }
    assert!(missed.is_empty(), "{missed:#?}\n{report}");
    eprintln!("{report}");
}
