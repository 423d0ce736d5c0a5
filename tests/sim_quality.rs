//! The allocation quality bars of `usher sim`, through the real binary: each
//! built-in scenario over seeds 1 to 10 hands out at least 99.5% of what it
//! could after start-up (the mean over the seeds), and no second of any
//! seed goes above the capacity. The simulator runs in virtual time and a
//! seed gives the same run every time, so these figures move only when the
//! allocation does. Each scenario is also held to what it reads now, less
//! 0.01 points ([`FLOORS`]): a change that costs utilisation anywhere fails
//! here, not in a benchmark nobody reran. Raise a floor when allocation
//! improves; lower one only with the reason in `benches/RESULTS.md`.
//! `benches/sim.sh` prints the same figures.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use usher_test_support::usher_bin;

const SEEDS: u64 = 10;
const SCENARIOS: [&str; 7] = ["one", "two", "three", "four", "five", "six", "seven"];
/// The least mean utilisation after start-up, over the seeds, of any scenario.
const UTILISATION: f64 = 0.995;
/// Each scenario's least mean utilisation: what it read when last raised
/// (one 99.689%, two 99.615%, three 99.518%, four 100%, five 99.768%, six
/// 99.806%, seven 99.549%), less 0.01 points.
const FLOORS: [(&str, f64); 7] = [
    ("one", 0.9968),
    ("two", 0.9960),
    ("three", 0.9951),
    ("four", 0.9999),
    ("five", 0.9976),
    ("six", 0.9980),
    ("seven", 0.9954),
];

/// A run's utilisation after start-up and its worst second, as shares of the capacity.
type Figures = (f64, f64);

/// `usher sim --scenario name --seed seed --json`: its [`Figures`].
fn run(name: &str, seed: u64) -> Figures {
    let out = Command::new(usher_bin())
        .args(["sim", "--scenario", name, "--seed", &seed.to_string(), "--json"])
        .output()
        .expect("run usher sim");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{name} seed {seed}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{name} seed {seed}: {e}: {stdout}"));
    let field = |k: &str| report[k].as_f64().unwrap_or_else(|| panic!("{name} seed {seed}: no {k}: {stdout}"));
    (field("utilisation"), field("max_overshoot"))
}

#[test]
fn every_scenario_hands_out_its_capacity_and_never_more() {
    // Every (scenario, seed), taken in turn by a few threads, the longest
    // scenario (seven: an hour) first.
    let jobs: Vec<(&str, u64)> = SCENARIOS.iter().rev().flat_map(|s| (1..=SEEDS).map(move |seed| (*s, seed))).collect();
    let next = AtomicUsize::new(0);
    let results: Vec<((&str, u64), Figures)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(&(s, seed)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                        done.push(((s, seed), run(s, seed)));
                    }
                    done
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a sim thread panicked")).collect()
    });
    let mut missed = Vec::new();
    let mut table = String::new();
    for name in SCENARIOS {
        let mine: Vec<_> = results.iter().filter(|((s, _), _)| *s == name).map(|(_, r)| *r).collect();
        let mean = mine.iter().map(|r| r.0).sum::<f64>() / mine.len() as f64;
        let worst = mine.iter().map(|r| r.1).fold(0.0, f64::max);
        table.push_str(&format!("{name}: utilisation {:.3}%, max overshoot {:.2}%\n", 100.0 * mean, 100.0 * worst));
        if mean < UTILISATION {
            missed.push(format!("{name}: utilisation {:.2}% < {:.1}%", 100.0 * mean, 100.0 * UTILISATION));
        }
        let floor = FLOORS.iter().find(|(n, _)| *n == name).map_or(UTILISATION, |f| f.1);
        if mean < floor {
            missed.push(format!("{name}: utilisation {:.3}% < its floor {:.2}%", 100.0 * mean, 100.0 * floor));
        }
        if worst > 1.0 + 1e-9 {
            missed.push(format!("{name}: a second at {:.2}% of the capacity", 100.0 * worst));
        }
    }
    eprintln!("{table}");
    assert!(missed.is_empty(), "missed: {missed:?}\n{table}");
}
