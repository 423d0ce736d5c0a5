//! The sidecars' keys over a run, read from their status pages every few
//! seconds while the apps run: what each key enforces (per minute) and the
//! units it would pass at once. A report shows them when a bar is missed,
//! so the failure says where the capacity was.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;
use usher_test_support::http_get;
use usher_test_support::llm::unix_now;

use crate::fleet::blocking;

/// One key of one sidecar at one moment.
struct Sample {
    /// When, Unix seconds.
    at: f64,
    sidecar: usize,
    resource: String,
    per_min: f64,
    remaining: i64,
    /// Which round of reads.
    round: u64,
    /// The API's own account the key holds: when it was read (Unix
    /// seconds) and what remained.
    api: Option<(f64, f64)>,
}

/// Reads the status pages until stopped; at most `MAX_SAMPLES` rounds.
pub(crate) struct Sampler {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
    every: Duration,
}

const MAX_SAMPLES: usize = 100;

/// One resource in one round of reads: the fleet's total per minute, and
/// the freshest account of the API's bucket (when read, what remained).
type Round = (f64, Option<(f64, f64)>);

impl Sampler {
    /// Starts reading the sidecars at `admins` every `every`.
    pub(crate) fn start(admins: Vec<SocketAddr>, every: Duration) -> Sampler {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            for round in 0..MAX_SAMPLES as u64 {
                let admins = admins.clone();
                samples.extend(blocking(move || read_all(&admins, round)).await);
                tokio::select! {
                    _ = stopped.changed() => break,
                    _ = tokio::time::sleep(every) => {}
                }
            }
            samples
        });
        Sampler { stop, task, every }
    }

    /// Stops, and writes what it read: per resource, one line per sidecar,
    /// `per minute (remaining)` at each sample, from `origin` (Unix seconds).
    pub(crate) async fn finish(self, origin: f64) -> String {
        let _ = self.stop.send(true);
        let samples = self.task.await.unwrap_or_default();
        let mut rows: BTreeMap<(&str, usize), Vec<String>> = BTreeMap::new();
        // Per resource and round: the fleet's total per minute, and the
        // freshest account of the API's own bucket any sidecar holds.
        let mut fleet: BTreeMap<&str, BTreeMap<u64, Round>> = BTreeMap::new();
        for s in &samples {
            rows.entry((&s.resource, s.sidecar)).or_default().push(format!("{:.1}({})", s.per_min, s.remaining));
            let round = fleet.entry(&s.resource).or_default().entry(s.round).or_default();
            round.0 += s.per_min;
            if s.api.is_some_and(|(at, _)| round.1.is_none_or(|(seen, _)| at > seen)) {
                round.1 = s.api;
            }
        }
        let from = samples.first().map_or(0.0, |s| s.at - origin);
        let mut out = format!(
            "keys: per minute (remaining) every {} s from {from:+.0} s, by sidecar; \
             then the fleet's total per minute [the API's remaining]",
            self.every.as_secs_f64()
        );
        for ((resource, sidecar), values) in rows {
            out.push_str(&format!("\n  {resource} {sidecar}: {}", values.join(" ")));
        }
        for (resource, rounds) in fleet {
            let totals = rounds.values().map(|(total, api)| match api {
                Some((_, left)) => format!("{total:.1}[{left:.0}]"),
                None => format!("{total:.1}"),
            });
            out.push_str(&format!("\n  {resource} fleet: {}", totals.collect::<Vec<_>>().join(" ")));
        }
        out
    }
}

/// Every key of every sidecar now.
fn read_all(admins: &[SocketAddr], round: u64) -> Vec<Sample> {
    let at = unix_now();
    let mut out = Vec::new();
    for (sidecar, a) in admins.iter().enumerate() {
        let (code, body) = http_get(*a, "/debug/status?format=json");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { continue };
        if code != 200 {
            continue;
        }
        for k in v["keys"].as_array().into_iter().flatten() {
            out.push(Sample {
                at,
                sidecar,
                resource: k["resource"].as_str().unwrap_or("?").to_string(),
                per_min: k["capacity"].as_f64().unwrap_or(f64::NAN) * 60.0,
                remaining: k["remaining"].as_f64().map_or(-1, |r| r.floor() as i64),
                round,
                api: k["upstream_quota"]["observed"].as_f64().zip(k["upstream_quota"]["remaining"].as_f64()),
            });
        }
    }
    out
}
