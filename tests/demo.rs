//! `usher demo`, the README's first command, through the real binary.

use usher_test_support as support;

#[test]
fn the_demo_shares_one_capacity_among_three_sidecars() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("demo.png");
    let (code, out, err) =
        support::run_usher(&["demo", "--duration", "6s", "--quiet", "--plot", png.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    let rows: Vec<Vec<f64>> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("sidecar-"))
        .map(|l| l.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    let leases: Vec<f64> = rows.iter().map(|r| r[3]).collect();
    let total_lease: f64 = leases.iter().sum();
    // Each lease is printed to one decimal, so the printed sum may exceed the capacity by 3 × 0.05.
    assert!((95.0..=100.0 + 0.15 + 1e-6).contains(&total_lease), "the leases share the capacity: {leases:?}\n{out}");
    for l in &leases {
        assert!((25.0..=40.0).contains(l), "max-min fair shares of 33, 88 and 176 wanted: {leases:?}\n{out}");
    }
    let admitted: f64 = rows.iter().map(|r| r[1]).sum();
    assert!(admitted <= 100.0 + 3.0 * 5.0 / 6.0 + 1.0, "admitted {admitted}/s over a 100/s capacity\n{out}");
    assert!(out.contains("summary over 6s"), "{out}");
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG", "the plot is a PNG");
}

/// From the third second on the three sidecars together admit at least 97%
/// of the capacity every second (counted where requests reach the upstream),
/// at least 90% in the second, and never more than the capacity plus a burst.
#[test]
fn the_demo_keeps_the_capacity_in_use_every_second_after_the_first() {
    let (code, out, err) = support::run_usher(&["demo", "--duration", "10s", "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let capacity = report["capacity_per_s"].as_f64().unwrap();
    let seconds: Vec<u64> =
        report["admitted_each_second"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
    assert_eq!(seconds.len(), 10, "{out}");
    let min_after_first = report["min_admitted_after_first_second"].as_u64().unwrap();
    assert_eq!(min_after_first, *seconds[1..].iter().min().unwrap(), "{out}");
    // The sidecars' wants start at 0 and are measured in their first
    // second: the second second is nearly full, and every one after it.
    assert!(seconds[1] as f64 >= 0.90 * capacity, "the second second below 90% of {capacity}/s: {seconds:?}");
    assert!(
        seconds[2..].iter().all(|n| *n as f64 >= 0.97 * capacity),
        "a second after the first two below 97% of {capacity}/s: {seconds:?}"
    );
    // The burst of 5 each sidecar may spend at once, on top of the rate.
    for (i, n) in seconds.iter().enumerate() {
        assert!(*n as f64 <= capacity + 3.0 * 5.0, "second {i} admitted {n} over {capacity}/s: {seconds:?}");
    }
}
