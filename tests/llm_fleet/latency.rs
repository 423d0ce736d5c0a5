//! How long apps wait, through usher and without it. A call's latency is
//! what its app waits before it can use the answer: for a streamed call,
//! the time to its first chunk; for the others, the time to the whole
//! answer. Both from the moment the app calls the SDK, retries included.

use crate::app::AppCall;

/// A call's latency in seconds; `None` for a call that got no answer.
pub(crate) fn latency(c: &AppCall) -> Option<f64> {
    if c.outcome != "ok" {
        return None;
    }
    if c.streamed { c.first_chunk.map(|t| t - c.start) } else { Some(c.end - c.start) }
}

/// The 50th and 95th percentiles of some latencies, and how many there were.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spread {
    pub(crate) n: usize,
    pub(crate) p50: f64,
    pub(crate) p95: f64,
}

impl Spread {
    /// Of `calls`' latencies (nearest rank); `None` if no call was answered.
    pub(crate) fn of<'a>(calls: impl IntoIterator<Item = &'a AppCall>) -> Option<Spread> {
        let mut v: Vec<f64> = calls.into_iter().filter_map(latency).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Spread { n: v.len(), p50: rank(0.5), p95: rank(0.95) })
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p50 {:.3} s, p95 {:.3} s ({} calls)", self.p50, self.p95, self.n)
    }
}

/// The latency bars: through usher, p50 within `margins.0` seconds of the
/// direct run's and p95 within `margins.1`. Returns the report's lines
/// (`origin`: when the arrivals started) and the bars missed.
pub(crate) fn compare(via: &[AppCall], direct: &[AppCall], origin: f64, margins: (f64, f64)) -> (String, Vec<String>) {
    let (p50_margin, p95_margin) = margins;
    let line = |what: &str, keep: fn(&AppCall) -> bool| {
        let show = |s: Option<Spread>| s.map_or("no answers".to_string(), |s| s.to_string());
        let (u, d) = (Spread::of(via.iter().filter(|c| keep(c))), Spread::of(direct.iter().filter(|c| keep(c))));
        format!("latency, {what}: through usher {}; direct {}", show(u), show(d))
    };
    let report = [
        line("all (streamed: to the first chunk; others: to the whole answer)", |_| true),
        line("streamed, to the first chunk", |c| c.streamed),
        line("not streamed, to the whole answer", |c| !c.streamed),
        format!("latency added, the most:\n{}", most_added(via, direct, origin, 5)),
        format!("slowest direct:\n{}", slowest(direct, origin, 3)),
    ]
    .join("\n");
    let mut missed = Vec::new();
    match (Spread::of(via), Spread::of(direct)) {
        (Some(u), Some(d)) => {
            if u.p50 - d.p50 > p50_margin {
                missed.push(format!("p50 {:.3} s through usher, over {:.3} s direct + {p50_margin} s", u.p50, d.p50));
            }
            if u.p95 - d.p95 > p95_margin {
                missed.push(format!("p95 {:.3} s through usher, over {:.3} s direct + {p95_margin} s", u.p95, d.p95));
            }
        }
        _ => missed.push("no latency to compare: a run had no answers".to_string()),
    }
    (report, missed)
}

/// The `n` calls whose latency through usher most exceeds their twins',
/// one a line: by how much, and when they started (seconds from `origin`).
fn most_added(via: &[AppCall], direct: &[AppCall], origin: f64, n: usize) -> String {
    let twins: std::collections::HashMap<&str, f64> =
        direct.iter().filter_map(|c| Some((c.id.as_str(), latency(c)?))).collect();
    let mut added: Vec<(f64, &AppCall)> =
        via.iter().filter_map(|c| Some((latency(c)? - twins.get(c.id.as_str())?, c))).collect();
    added.sort_by(|a, b| b.0.total_cmp(&a.0));
    let lines: Vec<String> = added
        .iter()
        .take(n)
        .map(|(d, c)| {
            format!("  +{d:.3} s: {} at +{:.1} s{}", c.id, c.start - origin, if c.streamed { ", streamed" } else { "" })
        })
        .collect();
    lines.join("\n")
}

/// The `n` slowest of `calls`, one a line, with when they started (seconds from `origin`).
fn slowest(calls: &[AppCall], origin: f64, n: usize) -> String {
    let mut all: Vec<(f64, &AppCall)> = calls.iter().filter_map(|c| Some((latency(c)?, c))).collect();
    all.sort_by(|a, b| b.0.total_cmp(&a.0));
    let line = |(l, c): &(f64, &AppCall)| {
        format!("  {l:.3} s: {} at +{:.1} s{}", c.id, c.start - origin, if c.streamed { ", streamed" } else { "" })
    };
    all.iter().take(n).map(line).collect::<Vec<_>>().join("\n")
}
