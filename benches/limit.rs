//! The cost of one admit decision on the request path, uncontended:
//! a rate key's GCRA reservation, a gauge permit taken and given back, and
//! the whole all-or-nothing admission of a one-resource plan (demand meter,
//! reservation, in-flight accounting, release) as the proxy runs it.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
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
