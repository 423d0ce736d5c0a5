//! The cost of one admit decision on the request path, uncontended:
//! a rate key's GCRA reservation, a gauge permit taken and given back, and
//! the whole all-or-nothing admission of a one-resource plan (demand meter,
//! reservation, in-flight accounting, release) as the proxy runs it; the
//! same two decisions with a second thread hammering the same key; and
//! loading the LeaseTable snapshot to find a resource and its key.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use usher::clock::Clock;
use usher::limit::admit::admit;
use usher::limit::rate::Reservation;
use usher::limit::{Gauge, Kind, LeaseTable, Plan, Rate, ResourceSpec};

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

criterion_group!(benches, bench);
criterion_main!(benches);
