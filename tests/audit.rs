//! The access log and `usher audit`: known answers from a log this test
//! writes, and a real sidecar's log audited end to end.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::sync::Arc;
use std::time::Duration;

use support::load::{Tally, drive};
use support::upstream::Upstream;
use support::{Usher, run_usher, write_file};

fn line(time: f64, client: &str, id: &str, kind: &str, capacity: f64, outcome: &str, total_ms: f64) -> String {
    format!(
        r#"{{"time":{time},"client":"{client}","route":"r","resources":[{{"resource":"x","id":"{id}","kind":"{kind}","capacity":{capacity}}}],"outcome":"{outcome}","wait_ms":0,"status":200,"upstream_ms":1,"total_ms":{total_ms}}}"#
    )
}

#[test]
fn audit_gives_known_answers_on_a_known_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Vec::new();
    let mut b = Vec::new();
    // Two sidecars share "api": 6/s and 4/s leases (10 in all) for 5 s, both full.
    for s in 100..105 {
        for i in 0..6 {
            a.push(line(s as f64 + i as f64 * 0.1, "a", "api", "rate", 6.0, "admitted", 2.0));
        }
        for i in 0..4 {
            b.push(line(s as f64 + i as f64 * 0.1 + 0.05, "b", "api", "rate", 4.0, "admitted", 2.0));
        }
        b.push(line(s as f64 + 0.9, "b", "api", "rate", 4.0, "refused", 0.0));
    }
    // Then a's lease grows to 16 (20 in all): 12 admitted in the first second, 20 in the next.
    for i in 0..8 {
        a.push(line(105.0 + i as f64 * 0.1, "a", "api", "rate", 16.0, "admitted", 2.0));
    }
    for i in 0..16 {
        a.push(line(106.0 + i as f64 * 0.05, "a", "api", "rate", 16.0, "admitted", 2.0));
    }
    for i in 0..4 {
        b.push(line(105.0 + i as f64 * 0.1, "b", "api", "rate", 4.0, "admitted", 2.0));
        b.push(line(106.0 + i as f64 * 0.1, "b", "api", "rate", 4.0, "admitted", 2.0));
    }
    // A gauge: three requests overlap at 200.5 s.
    for (end, dur) in [(200.6, 300.0), (200.7, 400.0), (200.8, 500.0), (201.5, 100.0)] {
        a.push(line(end, "a", "conns", "gauge", 3.0, "admitted", dur));
    }
    let fa = write_file(dir.path(), "a.jsonl", &(a.join("\n") + "\nnot json\n"));
    let fb = write_file(dir.path(), "b.jsonl", &b.join("\n"));
    let (code, out, err) = run_usher(&["audit", "--json", fa.to_str().unwrap(), fb.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("a.jsonl:") && err.contains("not an access log line"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let api = &v[0];
    assert_eq!(api["id"], "api");
    assert_eq!(api["requests"], 30 + 20 + 5 + 12 + 20);
    assert_eq!(api["admitted"], 50 + 12 + 20);
    assert_eq!(api["refused"], 5);
    assert_eq!(api["peak_1s"], 20.0);
    assert_eq!(api["capacity_at_peak_1s"], 20.0, "capacities of both sidecars are summed");
    assert_eq!(api["convergence_s"], 1.0, "capacity 10 -> 20 at 105 s; 20 admitted at 106 s");
    let conns = &v[1];
    assert_eq!(conns["id"], "conns");
    assert_eq!(conns["peak_concurrency"], 3);
    assert_eq!(conns["kind"], "gauge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecars_access_log_audits_within_its_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let log = dir.path().join("access.jsonl");
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "access_log: {}\nupstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 10, burst: 2 }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
            log.display(),
            up.addr
        ),
    );
    let p = Usher::proxy(&routes);
    let tally = Arc::new(Tally::default());
    drive(p.addr("listen"), 40.0, Duration::from_secs(4), tally.clone()).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // the writer flushes within 200 ms
    let text = std::fs::read_to_string(&log).unwrap();
    let lines = text.lines().count() as u64;
    let sent =
        tally.ok.load(std::sync::atomic::Ordering::Relaxed) + tally.refused.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(lines, sent, "one line per request");
    let (code, out, err) = run_usher(&["audit", "--json", log.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let api = &v[0];
    assert_eq!(api["admitted"].as_u64().unwrap(), tally.ok.load(std::sync::atomic::Ordering::Relaxed));
    assert!(api["refused"].as_u64().unwrap() > 0);
    assert!(api["peak_1s"].as_f64().unwrap() <= 10.0 + 2.0 + 1.0, "{api}");
    assert_eq!(api["capacity_at_peak_1s"], 10.0);
    let (code, table, _) =
        run_usher(&["audit", log.to_str().unwrap(), "--plot", dir.path().join("a.png").to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(table.contains("resource id") && table.contains("api"), "{table}");
}

/// A rotated access log (moved away, as logrotate's default `create` mode
/// does, or removed) is noticed at the next line, at most a second late:
/// later lines go to a new file at the configured path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_access_log_is_opened_anew_at_its_path() {
    use support::upstream::{get, h1, send1};
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let log = dir.path().join("access.jsonl");
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "access_log: {}\nupstreams:\n  up: {{ url: \"http://{}\" }}\nroutes:\n  - {{ name: all, upstream: up }}\n",
            log.display(),
            up.addr
        ),
    );
    let p = Usher::proxy(&routes);
    let mut c = h1(p.addr("listen")).await;
    let lines = |path: &std::path::Path| std::fs::read_to_string(path).map_or(0, |t| t.lines().count());
    for _ in 0..3 {
        assert_eq!(send1(&mut c, get("app", "/")).await.status, 200);
    }
    assert_eventually!(lines(&log) == 3, Duration::from_secs(5), "three lines: {}", lines(&log));
    // Moved away: the next lines go to a new file at the path.
    let rotated = dir.path().join("access.jsonl.1");
    std::fs::rename(&log, &rotated).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for _ in 0..2 {
        assert_eq!(send1(&mut c, get("app", "/")).await.status, 200);
    }
    assert_eventually!(lines(&log) == 2, Duration::from_secs(5), "a new file: {} lines", lines(&log));
    assert_eq!(lines(&rotated), 3, "the rotated file keeps what it had");
    // Removed: the same.
    std::fs::remove_file(&log).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(send1(&mut c, get("app", "/")).await.status, 200);
    assert_eventually!(lines(&log) == 1, Duration::from_secs(5), "a new file again: {} lines", lines(&log));
    p.wait_for_log("the access log was moved or removed", Duration::from_secs(1));
}
