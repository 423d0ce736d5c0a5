//! `usher audit ACCESS_LOG...`: reads the access logs of one or many
//! sidecars in one streaming pass and reports, per resource id, what was
//! admitted against the capacity in force: the peak admitted rate over 1 s
//! and 10 s windows, the peak concurrency of gauges, refusals, and how long
//! the admitted rate took to match a changed capacity. It lets a user verify
//! from their own traffic that usher does what it claims.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::path::PathBuf;

use serde::Serialize;

use usher_core::error::RunError;
use usher_proxy::ops::access_log::Entry;

#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Access log files (JSON lines), from one or many sidecars.
    #[arg(value_name = "ACCESS_LOG", required = true)]
    pub files: Vec<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Draw admitted/s and capacity over time, per resource id, to this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}

/// Per second of one id: admitted count, and each client's capacity in force.
#[derive(Default)]
struct Second {
    admitted: u64,
    capacity: HashMap<String, f64>,
}

#[derive(Default)]
struct IdStats {
    kind: String,
    requests: u64,
    admitted: u64,
    refused: u64,
    upstream_errors: u64,
    seconds: BTreeMap<i64, Second>,
    /// Concurrency changes in 1 ms slots: +1 at arrival, -1 at the response.
    flight: HashMap<i64, i64>,
}

/// What `usher audit` reports for one resource id.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IdReport {
    pub id: String,
    pub kind: String,
    pub requests: u64,
    pub admitted: u64,
    pub refused: u64,
    pub upstream_errors: u64,
    /// Highest admitted count in one second, and the capacity in force then.
    pub peak_1s: f64,
    pub capacity_at_peak_1s: f64,
    /// Highest mean admitted/s over 10 consecutive seconds, and the mean capacity then.
    pub peak_10s: f64,
    pub capacity_at_peak_10s: f64,
    /// Highest number of requests in flight at once (meaningful for gauges).
    pub peak_concurrency: i64,
    /// The worst time from a capacity change to the admitted rate matching it (±10%);
    /// `None` when capacity never changed (or the rate never matched).
    pub convergence_s: Option<f64>,
}

/// Reads the logs (streaming) and computes the report.
pub fn audit(files: &[PathBuf]) -> Result<Vec<IdReport>, RunError> {
    let mut ids: BTreeMap<String, IdStats> = BTreeMap::new();
    let mut bad = 0u64;
    for f in files {
        let file = std::fs::File::open(f).map_err(|e| RunError::Usage(format!("cannot read {}: {e}", f.display())))?;
        for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| RunError::Other(format!("{}:{}: {e}", f.display(), n + 1)))?;
            if line.trim().is_empty() {
                continue;
            }
            let Ok(e) = serde_json::from_str::<Entry>(&line) else {
                bad += 1;
                if bad <= 5 {
                    eprintln!("{}:{}: not an access log line; skipped", f.display(), n + 1);
                }
                continue;
            };
            add(&mut ids, &e);
        }
    }
    if bad > 5 {
        eprintln!("... {bad} lines skipped in all");
    }
    Ok(ids.into_iter().map(|(id, s)| report(id, s)).collect())
}

fn add(ids: &mut BTreeMap<String, IdStats>, e: &Entry) {
    let sec = e.time.floor() as i64;
    let end_ms = (e.time * 1e3).round() as i64;
    let start_ms = end_ms - e.total_ms.round() as i64;
    for k in &e.resources {
        let s = ids.entry(k.id.clone()).or_default();
        s.kind.clone_from(&k.kind);
        s.requests += 1;
        let b = s.seconds.entry(sec).or_default();
        let cap = b.capacity.entry(e.client.clone()).or_insert(0.0);
        *cap = cap.max(k.capacity);
        match e.outcome.as_str() {
            "admitted" | "paced" => {
                s.admitted += 1;
                b.admitted += 1;
                *s.flight.entry(start_ms).or_default() += 1;
                *s.flight.entry(end_ms.max(start_ms + 1)).or_default() -= 1;
            }
            "refused" => s.refused += 1,
            "upstream_error" => s.upstream_errors += 1,
            _ => {}
        }
    }
}

fn report(id: String, s: IdStats) -> IdReport {
    let series: Vec<(i64, f64, f64)> =
        s.seconds.iter().map(|(t, b)| (*t, b.admitted as f64, b.capacity.values().sum::<f64>())).collect();
    let (mut peak_1s, mut cap_1s) = (0.0, 0.0);
    for (_, a, c) in &series {
        if *a > peak_1s {
            (peak_1s, cap_1s) = (*a, *c);
        }
    }
    // 10 s windows over consecutive seconds (missing seconds count as 0 admitted).
    let (mut peak_10s, mut cap_10s) = (0.0, 0.0);
    if let (Some(first), Some(last)) = (series.first(), series.last()) {
        let by_t: HashMap<i64, (f64, f64)> = series.iter().map(|(t, a, c)| (*t, (*a, *c))).collect();
        let mut t = first.0;
        while t + 9 <= last.0.max(first.0 + 9) {
            let (mut a, mut c, mut n) = (0.0, 0.0, 0.0);
            for u in t..t + 10 {
                if let Some((x, y)) = by_t.get(&u) {
                    a += x;
                    c += y;
                    n += 1.0;
                }
            }
            if a / 10.0 > peak_10s {
                peak_10s = a / 10.0;
                cap_10s = if n > 0.0 { c / n } else { 0.0 };
            }
            t += 1;
        }
    }
    let mut slots: Vec<(&i64, &i64)> = s.flight.iter().collect();
    slots.sort();
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in slots {
        now += d;
        peak = peak.max(now);
    }
    IdReport {
        id,
        kind: s.kind,
        requests: s.requests,
        admitted: s.admitted,
        refused: s.refused,
        upstream_errors: s.upstream_errors,
        peak_1s,
        capacity_at_peak_1s: cap_1s,
        peak_10s,
        capacity_at_peak_10s: cap_10s,
        peak_concurrency: peak,
        convergence_s: convergence(&series),
    }
}

/// After each change of capacity (by more than 5%), the seconds until the
/// admitted count is within 10% of it; the worst over all changes.
fn convergence(series: &[(i64, f64, f64)]) -> Option<f64> {
    let mut worst: Option<f64> = None;
    for w in series.windows(2) {
        let ((_, _, c0), (t1, _, c1)) = (w[0], w[1]);
        if c1 <= 0.0 || (c1 - c0).abs() <= 0.05 * c0.max(c1) {
            continue;
        }
        let reached = series.iter().filter(|(t, _, _)| *t >= t1).find(|(_, a, c)| (a - c).abs() <= 0.1 * c);
        let took = reached.map(|(t, _, _)| (t - t1) as f64);
        if let Some(d) = took {
            worst = Some(worst.map_or(d, |x: f64| x.max(d)));
        }
    }
    worst
}

/// Runs `usher audit`.
pub fn run(args: AuditArgs) -> Result<(), RunError> {
    let reports = audit(&args.files)?;
    if let Some(path) = &args.plot {
        plot(&args.files, path)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports).expect("report serialises"));
        return Ok(());
    }
    println!(
        "{:<28} {:>5} {:>9} {:>9} {:>8} {:>16} {:>16} {:>11} {:>11}",
        "resource id",
        "kind",
        "requests",
        "admitted",
        "refused",
        "peak 1s (cap)",
        "peak 10s (cap)",
        "peak conc.",
        "converge s"
    );
    for r in &reports {
        println!(
            "{:<28} {:>5} {:>9} {:>9} {:>8} {:>16} {:>16} {:>11} {:>11}",
            r.id,
            r.kind,
            r.requests,
            r.admitted,
            r.refused,
            format!("{:.0} ({:.1})", r.peak_1s, r.capacity_at_peak_1s),
            format!("{:.1} ({:.1})", r.peak_10s, r.capacity_at_peak_10s),
            r.peak_concurrency,
            r.convergence_s.map_or("-".to_string(), |c| format!("{c:.0}")),
        );
    }
    Ok(())
}

/// Admitted/s and capacity over time for every id, as one chart.
fn plot(files: &[PathBuf], path: &std::path::Path) -> Result<(), RunError> {
    let mut ids: BTreeMap<String, IdStats> = BTreeMap::new();
    for f in files {
        let file = std::fs::File::open(f).map_err(|e| RunError::Usage(format!("cannot read {}: {e}", f.display())))?;
        for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
            if let Ok(e) = serde_json::from_str::<Entry>(&line) {
                add(&mut ids, &e);
            }
        }
    }
    let t0 = ids.values().filter_map(|s| s.seconds.keys().next().copied()).min().unwrap_or(0);
    let palette = [[40, 90, 200], [30, 150, 60], [200, 120, 20], [150, 60, 170]];
    let mut series = Vec::new();
    for (i, (id, s)) in ids.iter().enumerate().take(4) {
        series.push(crate::plot::Series {
            name: format!("{id} admitted"),
            rgb: palette[i % palette.len()],
            points: s.seconds.iter().map(|(t, b)| ((t - t0) as f64, b.admitted as f64)).collect(),
        });
        series.push(crate::plot::Series {
            name: "capacity".into(),
            rgb: [200, 40, 40],
            points: s.seconds.iter().map(|(t, b)| ((t - t0) as f64, b.capacity.values().sum::<f64>())).collect(),
        });
    }
    crate::plot::line_chart(path, "usher audit: admitted per second", &series)
        .map_err(|e| RunError::Other(format!("cannot write {}: {e}", path.display())))
}
