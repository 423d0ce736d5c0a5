//! The cost of one admit decision on the request path, uncontended:
//! a rate key's GCRA reservation, a gauge permit taken and given back, and
//! the whole all-or-nothing admission of a one-resource plan (demand meter,
//! reservation, in-flight accounting, release) as the proxy runs it; the
//! same two decisions with a second thread hammering the same key; loading
//! the LeaseTable snapshot to find a resource and its key; and, for
//! templated resources with many tenant keys, making keys (per key, from an
//! empty table to 1k, 10k and 100k: flat means O(1) amortised) and the whole
//! admission of one key among 1 to 100k (flat means the key count costs the
//! request path nothing).

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use usher_core::clock::Clock;
use usher_limit::admit::admit;
use usher_limit::rate::Reservation;
use usher_limit::{Gauge, Kind, LeaseTable, Plan, Rate, ResourceSpec};

fn spec(kind: Kind) -> ResourceSpec {
    ResourceSpec {
        name: "bench".into(),
        kind,
        // High enough that every decision admits: the fast path is what requests take.
        capacity: 1e12,
        burst: 1e6,
        max_wait: Duration::ZERO,
        max_queue: 1024,
        max_keys: 1,
        window: Duration::from_secs(1),
        shared: false,
        burst_span: None,
        shadow: false,
        upstream_quota: false,
        templated: false,
    }
}

/// Polls a future that never waits (an admission with capacity to spare) once.
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the benchmark's admission had to wait"),
    }
}

fn bench(c: &mut Criterion) {
    let clock = Clock::system();
    let rate = Rate::new(1e12, 1e6, clock.now());
    c.bench_function("rate: reserve one unit (GCRA decision)", |b| {
        b.iter(|| {
            let r = rate.reserve(clock.now(), black_box(1.0), Duration::ZERO);
            assert!(matches!(r, Reservation::Slot { .. }));
        })
    });

    let gauge = Gauge::new(1_000);
    c.bench_function("gauge: take and give back one permit", |b| {
        b.iter(|| {
            let p = gauge.try_acquire(black_box(1)).expect("permit");
            drop(p);
        })
    });

    // Contended: a second thread takes decisions on the same key the whole time.
    // A burst of 1,000 s of capacity: the rival thread may be preempted between its
    // clock read and its reservation, and must not make a decision wait.
    let rate = Arc::new(Rate::new(1e12, 1e15, clock.now()));
    let gauge = Arc::new(Gauge::new(1_000));
    let stop = Arc::new(AtomicBool::new(false));
    let rival = {
        let (rate, gauge, stop, clock) = (rate.clone(), gauge.clone(), stop.clone(), clock.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                black_box(rate.reserve(clock.now(), 1.0, Duration::ZERO));
                drop(black_box(gauge.try_acquire(1)));
            }
        })
    };
    c.bench_function("rate: reserve one unit, 2 threads on the same key", |b| {
        b.iter(|| {
            let r = rate.reserve(clock.now(), black_box(1.0), Duration::ZERO);
            assert!(matches!(r, Reservation::Slot { .. }));
        })
    });
    c.bench_function("gauge: take and give back one permit, 2 threads on the same key", |b| {
        b.iter(|| {
            let p = gauge.try_acquire(black_box(1)).expect("permit");
            drop(p);
        })
    });
    stop.store(true, Ordering::Relaxed);
    rival.join().unwrap();

    // The request path's lookup: load the snapshot, find the resource among 100, then its key.
    let table = LeaseTable::new(clock.clone());
    table.configure(
        (0..100)
            .map(|i| ResourceSpec {
                name: format!("resource-{i}"),
                ..spec(if i % 2 == 0 { Kind::Rate } else { Kind::Gauge })
            })
            .collect(),
    );
    table.resource("resource-42").expect("configured").limiter("key");
    c.bench_function("LeaseTable: load the snapshot and find a resource (of 100) and its key", |b| {
        b.iter(|| {
            let r = table.resource(black_box("resource-42")).expect("configured");
            black_box(r.limiter(black_box("key")));
        })
    });

    for kind in [Kind::Rate, Kind::Gauge] {
        let table = LeaseTable::new(clock.clone());
        table.configure(vec![spec(kind)]);
        let limiter = table.resource("bench").expect("configured").limiter("bench");
        let plan = Plan::new(vec![(limiter, 1.0)]);
        c.bench_function(&format!("admit: one {kind:?} resource, whole admission and release"), |b| {
            b.iter(|| {
                let admitted = ready(admit(black_box(&plan), &clock)).expect("admitted");
                drop(admitted);
            })
        });
    }
}

/// A templated resource with room for any number of keys.
fn tenants(clock: &Clock) -> LeaseTable {
    let table = LeaseTable::new(clock.clone());
    table.configure(vec![ResourceSpec { name: "tenants".into(), max_keys: usize::MAX, ..spec(Kind::Rate) }]);
    table
}

fn many_keys(c: &mut Criterion) {
    let clock = Clock::system();
    let mut g = c.benchmark_group("tenant keys: make n keys in an empty table");
    for n in [1_000u64, 10_000, 100_000] {
        let ids: Vec<String> = (0..n).map(|i| format!("tenant-{i}")).collect();
        g.throughput(Throughput::Elements(n));
        g.bench_function(format!("{n} keys"), |b| {
            b.iter_batched(
                || tenants(&clock),
                |table| {
                    let r = table.resource("tenants").expect("configured");
                    for id in &ids {
                        black_box(r.try_limiter(id).expect("room"));
                    }
                    table
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    let mut g = c.benchmark_group("tenant keys: admit one key among n");
    for n in [1u64, 1_000, 10_000, 100_000] {
        let table = tenants(&clock);
        let r = table.resource("tenants").expect("configured");
        let ids: Vec<String> = (0..n).map(|i| format!("tenant-{i}")).collect();
        for id in &ids {
            r.try_limiter(id).expect("room");
        }
        // Keys made last wait in a small locked map until the demand poll folds them.
        std::thread::sleep(usher_limit::table::FOLD_AFTER);
        table.settle();
        let mut i = 0usize;
        g.bench_function(format!("{n} keys"), |b| {
            b.iter(|| {
                // A different key each time, as tenants' requests come.
                i = (i + 7919) % ids.len();
                let l = table.resource("tenants").expect("configured").try_limiter(&ids[i]).expect("known");
                let plan = Plan::new(vec![(l, 1.0)]);
                drop(ready(admit(black_box(&plan), &clock)).expect("admitted"));
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, many_keys);
criterion_main!(benches);
