//! Allocation in virtual time, over the matrix of setups users write: real
//! capacity servers and real sidecar limiters (lease client, enforcer,
//! GCRA, demand meters) in one process, on a clock that jumps from event to
//! event (see [`vt`]). Each scenario runs at several lease lengths and
//! refresh intervals, with the loads real apps put on a sidecar: Poisson
//! calls a few times a minute, open-loop and closed-loop overload, clients
//! that retry after Retry-After, idle after load. The same scenarios run
//! with real processes, at one point of each row, in `tests/allocation/`
//! and `tests/llm_fleet/`.
//!
//! Virtual time makes each outcome independent of the machine's load, so
//! the scenarios run at once (`usher_test_support::at_once`), each on a
//! paused runtime of its own.

#![allow(clippy::disallowed_methods, reason = "the harness reads tokio's paused clock")]

mod vt;

use std::process::ExitCode;

use std::time::Duration;
use usher_test_support::at_once::{self, Run, Runtime};

use rand::Rng;
use vt::{Load, Record, World, drive, fleet_per_second, summary};

/// The lease lengths and refresh intervals every scenario runs at.
const LEASES: [(u64, u64); 4] = [(2, 1), (20, 5), (60, 10), (60, 15)];

fn resources(name: &str, capacity: &str, lease: u64, refresh: u64, extra: &str) -> String {
    format!(
        "resources:\n  - identifier_glob: {name}\n    capacity: {capacity}\n{extra}    algorithm: {{ kind: FAIR_SHARE, lease_length: {lease}, refresh_interval: {refresh} }}\n  \
         - identifier_glob: '*'\n    capacity: 0\n    algorithm: {{ kind: FAIR_SHARE, lease_length: {lease}, refresh_interval: {refresh} }}\n"
    )
}

fn routes(client: &str, resource: &str, settings: &str) -> String {
    format!(
        "doorman:\n  servers: [\"root:1\"]\n  client_id: {client}\nresources:\n  {resource}: {{ kind: rate, {settings} }}\n"
    )
}

/// An LLM call's tokens: a prompt of about 60 and 50 to 250 written.
fn llm_cost(rng: &mut rand::rngs::SmallRng) -> f64 {
    60.0 + rng.random_range(50.0..250.0f64).round()
}

/// Below the quota a call passes at once wherever it lands: three replicas
/// calling at Poisson arrivals of 0.05, 0.10 and 0.20 calls a second
/// (73% of a 6,000 tokens/min budget), bursts and lulls included, with the
/// settings docs/guides/llm.md gives (`max_wait: 60s`, the burst left to
/// its default: the minute's count). The apps start calling 20 s after
/// their sidecars (an SDK takes seconds to load). No call is refused, and
/// 95% of the fleet's calls pass within a second of the upstream's own
/// latency.
async fn below_the_quota_calls_pass_at_once() {
    let mut failures = Vec::new();
    for (lease, refresh) in LEASES {
        for first in ["6000/min", "60/min"] {
            let world = World::new();
            world.server("root:1", &resources("llm-tokens", "6000/min", lease, refresh, ""));
            let mut sidecars = Vec::new();
            for i in 0..3 {
                let settings = format!("capacity: {first}, max_wait: 60s");
                sidecars.push(world.sidecar(&routes(&format!("app-{i}"), "llm-tokens", &settings)).await);
            }
            let records: Vec<Record> = (0..3).map(|_| Record::default()).collect();
            let mut loads = tokio::task::JoinSet::new();
            for (i, rate) in [0.05, 0.10, 0.20].into_iter().enumerate() {
                let latency = Duration::from_millis(500);
                let (w, s, r) = (world.clone(), sidecars[i].clone(), records[i].clone());
                loads.spawn(drive(
                    w,
                    s,
                    "llm-tokens",
                    Load::Poisson(rate),
                    llm_cost,
                    latency,
                    20.0,
                    600.0,
                    std::env::var("USHER_VT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7u64) + i as u64,
                    r,
                ));
            }
            while loads.join_next().await.is_some() {}
            let refused: usize = records.iter().map(Record::refused).sum();
            let p95 = Record::merged(&records).took_quantile(0.95);
            if refused > 0 || p95 > 1.5 {
                failures.push(format!(
                    "lease {lease}/{refresh}, first wants {first}: {refused} refused, p95 {p95:.2}s\n{}",
                    summary(&records)
                ));
            }
            let _ = fleet_per_second(&records, 0, 600);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs `loads` (one per sidecar, from virtual second `from` for `secs`)
/// against the sidecars, each request of `cost` units; returns the records.
async fn run(
    world: &World,
    sidecars: &[usher_enforce::embed::Limits],
    resource: &'static str,
    loads: &[Load],
    cost: f64,
    from: f64,
    secs: f64,
) -> Vec<Record> {
    let records: Vec<Record> = loads.iter().map(|_| Record::default()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, load) in loads.iter().enumerate() {
        let (w, s, r) = (world.clone(), sidecars[i].clone(), records[i].clone());
        tasks.spawn(drive(w, s, resource, *load, move |_| cost, Duration::ZERO, from, secs, 11 + i as u64, r));
    }
    while tasks.join_next().await.is_some() {}
    records
}

/// Sums `per` (units a second) over windows of `w` seconds.
fn windows(per: &[f64], w: usize) -> Vec<f64> {
    per.chunks(w).filter(|c| c.len() == w).map(|c| c.iter().sum()).collect()
}

/// Above the quota the whole of it is used, and fairly: three sidecars share
/// 60/s, each app offering one and a half times its share, open-loop, in a
/// closed loop, or as SDKs that retry twice after Retry-After. Every 5 s
/// after the first 10, the fleet passes at least 95% of the capacity and
/// each sidecar at least 90% of its share; no window passes more than the
/// capacity and the fleet's burst; every Retry-After is between 1 s and the
/// refresh interval (jittered, and a second).
async fn above_the_quota_the_whole_of_it_is_used_fairly() {
    let mut failures = Vec::new();
    for (lease, refresh) in LEASES {
        for (name, load) in
            [("open", Load::Open(30.0)), ("closed", Load::Closed(4)), ("retrying", Load::Retrying(30.0, 2))]
        {
            for first in ["60/s", "1/s"] {
                let world = World::new();
                world.server("root:1", &resources("api", "60/s", lease, refresh, ""));
                let mut sidecars = Vec::new();
                for i in 0..3 {
                    let settings = format!("capacity: {first}, max_wait: 1s");
                    sidecars.push(world.sidecar(&routes(&format!("app-{i}"), "api", &settings)).await);
                }
                let records = run(&world, &sidecars, "api", &[load; 3], 1.0, 1.0, 60.0).await;
                let fleet = windows(&fleet_per_second(&records, 11, 61), 5);
                let each: Vec<Vec<f64>> = records.iter().map(|r| windows(&r.admitted_per_second(11, 61), 5)).collect();
                let retry_bound = (refresh as f64 * 7.0 / 6.0 + 1.0).ceil() as u64;
                let bad_retry: Vec<u64> =
                    records.iter().flat_map(Record::retry_afters).filter(|s| *s < 1 || *s > retry_bound).collect();
                let used = fleet.iter().all(|n| *n >= 0.95 * 300.0);
                let fair = each.iter().all(|w| w.iter().all(|n| *n >= 0.9 * 100.0));
                let capped = fleet.iter().all(|n| *n <= 300.0 + 60.0 + 3.0);
                if !(used && fair && capped && bad_retry.is_empty()) {
                    failures.push(format!(
                        "lease {lease}/{refresh}, {name}, first wants {first}: used {used}, fair {fair}, capped {capped}, bad Retry-After {bad_retry:?}\n  fleet per 5 s {fleet:?}\n  each {each:?}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Cold start under any load shape: three sidecars start together against
/// 90/s, each driven by a closed loop (or open-loop at one and a half
/// times its share), whatever the first `wants`. From the second second on,
/// each has at least 90% of its share in every second, and no second passes
/// more than the capacity and the fleet's burst (2) and one request each.
async fn a_cold_start_is_fair_from_the_second_second() {
    let mut failures = Vec::new();
    for (lease, refresh) in LEASES {
        for load in [Load::Closed(6), Load::Open(45.0)] {
            for first in ["1", "90"] {
                let world = World::new();
                world.server("root:1", &resources("api", "90", lease, refresh, ""));
                let mut sidecars = Vec::new();
                for i in 0..3 {
                    let settings = format!("capacity: {first}, burst: 2, max_wait: 50ms");
                    sidecars.push(world.sidecar(&routes(&format!("app-{i}"), "api", &settings)).await);
                }
                let from = world.elapsed().ceil();
                let records = run(&world, &sidecars, "api", &[load; 3], 1.0, from, 8.0).await;
                let (a, b) = (from as usize + 1, from as usize + 8);
                let each: Vec<Vec<f64>> = records.iter().map(|r| r.admitted_per_second(a, b)).collect();
                let fleet = fleet_per_second(&records, a - 1, b);
                let fair = each.iter().all(|w| w.iter().all(|n| *n >= 27.0));
                let capped = fleet.iter().all(|n| *n <= 90.0 + 2.0 + 3.0);
                if !(fair && capped) {
                    failures.push(format!(
                        "lease {lease}/{refresh}, {load:?}, first wants {first}: fair {fair}, capped {capped}\n  each {each:?}\n  fleet {fleet:?}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// An idle sidecar cut off from every server runs on its share once its
/// lease lapses, whatever the lease length: two sidecars serve 8/s each for
/// 10 s, sit idle for 25 s, then every server is gone for good; 30 s later
/// each gets 10 requests at 1/s and admits at least 9. No second passes
/// more than the capacity, the fleet's burst and one request each.
async fn an_idle_sidecar_cut_off_runs_on_its_share_at_any_lease_length() {
    let mut failures = Vec::new();
    for (lease, refresh) in [(2, 1), (20, 5), (60, 15), (60, 10), (10, 10)] {
        let world = World::new();
        world.server("root:1", &resources("api", "600/min", lease, refresh, ""));
        let mut sidecars = Vec::new();
        for i in 0..2 {
            let settings = "capacity: 10/s, burst: 2, max_wait: 200ms";
            sidecars.push(world.sidecar(&routes(&format!("app-{i}"), "api", settings)).await);
        }
        let busy = run(&world, &sidecars, "api", &[Load::Open(8.0); 2], 1.0, 1.0, 10.0).await;
        tokio::time::sleep(Duration::from_secs(25)).await;
        world.net.set_up("root:1", false);
        tokio::time::sleep(Duration::from_secs(30)).await;
        let at = world.elapsed();
        let late = run(&world, &sidecars, "api", &[Load::Open(1.0); 2], 1.0, at, 10.0).await;
        let admitted: Vec<usize> = late.iter().map(|r| r.all().iter().filter(|o| o.status == 200).count()).collect();
        let all: Vec<Record> = busy.iter().chain(&late).cloned().collect();
        let fleet = fleet_per_second(&all, 0, at as usize + 12);
        let capped = fleet.iter().all(|n| *n <= 10.0 + 2.0 + 2.0);
        if admitted.iter().any(|n| *n < 9) || !capped {
            let keys: Vec<String> = sidecars
                .iter()
                .map(|s| format!("{:?}", s.lease_client().status().keys.first().map(|k| (k.mode, k.capacity))))
                .collect();
            failures.push(format!("lease {lease}/{refresh}: admitted {admitted:?} of 10 each, capped {capped}; keys {keys:?}\n  fleet {fleet:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every test, by name: they run at once (`usher_test_support::at_once`).
const TESTS: &[(&str, Run)] = &[
    ("below_the_quota_calls_pass_at_once", || Box::pin(below_the_quota_calls_pass_at_once())),
    ("above_the_quota_the_whole_of_it_is_used_fairly", || Box::pin(above_the_quota_the_whole_of_it_is_used_fairly())),
    ("a_cold_start_is_fair_from_the_second_second", || Box::pin(a_cold_start_is_fair_from_the_second_second())),
    ("an_idle_sidecar_cut_off_runs_on_its_share_at_any_lease_length", || {
        Box::pin(an_idle_sidecar_cut_off_runs_on_its_share_at_any_lease_length())
    }),
];

fn main() -> ExitCode {
    at_once::main(TESTS, &[], Runtime::PerTestPaused)
}
