//! A GCRA pacer for one rate key.
//!
//! State is one theoretical arrival time (TAT) behind a mutex held for a few
//! arithmetic operations. A request *reserves* its slot on arrival (TAT moves
//! on by `cost × interval`) and then sleeps until the slot: reservations are
//! handed out in arrival order, so pacing is FIFO without a queue structure.
//! A reservation can be given back (a client that disconnects while waiting,
//! or a multi-resource admission refused elsewhere).
//!
//! Why not governor: a live capacity change must carry the GCRA state across
//! (no fresh burst) and an all-or-nothing admission must undo a reservation;
//! governor exposes neither its TAT nor an undo, and a replaced limiter starts
//! with a full burst.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use crate::clock::{Clock, Time};

/// A rate: `capacity` units per second, `burst` units at once from idle.
pub struct Rate {
    state: Mutex<State>,
    /// Woken on capacity changes, for requests waiting on capacity 0.
    pub(crate) changed: Notify,
}

#[derive(Debug)]
struct State {
    /// Theoretical arrival time, nanoseconds on the limiter's clock.
    tat: f64,
    /// Nanoseconds per unit; infinite at capacity 0.
    interval: f64,
    burst: f64,
    capacity: f64,
}

/// The outcome of [`Rate::reserve`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reservation {
    /// Reserved: the request may pass after waiting this long.
    Slot { wait: Duration, cost: f64 },
    /// Not reserved: the earliest the request would pass (never, at capacity 0).
    TooLate { wait: Option<Duration> },
}

/// Nanoseconds per unit: infinite at capacity 0 (nothing passes), zero when
/// the capacity is infinite (unlimited: everything passes).
fn interval_of(capacity: f64) -> f64 {
    if capacity.is_infinite() {
        0.0
    } else if capacity > 0.0 {
        1e9 / capacity
    } else {
        f64::INFINITY
    }
}

impl Rate {
    pub fn new(capacity: f64, burst: f64, now: Time) -> Self {
        Rate {
            // An idle start: the whole burst is available.
            state: Mutex::new(State {
                tat: now.as_nanos() as f64,
                interval: interval_of(capacity),
                burst: burst.max(1.0),
                capacity,
            }),
            changed: Notify::new(),
        }
    }

    pub fn capacity(&self) -> f64 {
        self.state.lock().expect("rate lock").capacity
    }

    pub fn burst(&self) -> f64 {
        self.state.lock().expect("rate lock").burst
    }

    /// Reserves `cost` units if they can pass within `max_wait` of `now`.
    pub fn reserve(&self, now: Time, cost: f64, max_wait: Duration) -> Reservation {
        let now = now.as_nanos() as f64;
        let mut s = self.state.lock().expect("rate lock");
        if !s.interval.is_finite() {
            return Reservation::TooLate { wait: None };
        }
        if s.interval == 0.0 {
            return Reservation::Slot { wait: Duration::ZERO, cost: 0.0 };
        }
        let new_tat = s.tat.max(now) + cost * s.interval;
        let wait_ns = (new_tat - now - s.burst * s.interval).max(0.0);
        let wait = Duration::from_nanos(wait_ns.ceil() as u64);
        if wait > max_wait {
            return Reservation::TooLate { wait: Some(wait) };
        }
        s.tat = new_tat;
        Reservation::Slot { wait, cost }
    }

    /// Gives a reservation of `cost` units back.
    pub fn release(&self, cost: f64) {
        let mut s = self.state.lock().expect("rate lock");
        if s.interval.is_finite() {
            s.tat -= cost * s.interval;
        }
    }

    /// Units that could pass right now without waiting, rounded down.
    pub fn remaining(&self, now: Time) -> u64 {
        let now = now.as_nanos() as f64;
        let s = self.state.lock().expect("rate lock");
        if !s.interval.is_finite() {
            return 0;
        }
        if s.interval == 0.0 {
            return u64::MAX;
        }
        let used = (s.tat - now).max(0.0) / s.interval;
        (s.burst - used).max(0.0).floor() as u64
    }

    /// Changes capacity and burst live. The backlog (how full the bucket is,
    /// in units) is carried over, so a change never hands out a fresh burst;
    /// requests already holding a slot keep it.
    pub fn set(&self, now: Time, capacity: f64, burst: f64) {
        let now_ns = now.as_nanos() as f64;
        let mut s = self.state.lock().expect("rate lock");
        if s.capacity == capacity && s.burst == burst {
            return;
        }
        let backlog_units = if s.interval == 0.0 {
            // From unlimited: nothing was tracked, so nothing is owed.
            0.0
        } else if s.interval.is_finite() {
            (s.tat - now_ns).max(0.0) / s.interval
        } else {
            // From capacity 0: treat the bucket as full, so the new capacity starts paced, not with a burst.
            s.burst
        };
        s.interval = interval_of(capacity);
        s.capacity = capacity;
        s.burst = burst.max(1.0);
        s.tat = if s.interval.is_finite() { now_ns + backlog_units * s.interval } else { now_ns };
        drop(s);
        self.changed.notify_waiters();
    }
}

/// Convenience for tests and benches: one admit decision with no waiting.
pub fn try_admit(rate: &Rate, clock: &Clock, cost: f64) -> bool {
    matches!(rate.reserve(clock.now(), cost, Duration::ZERO), Reservation::Slot { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Time {
        Time::from_nanos(1_000_000_000_000 + ms * 1_000_000)
    }

    #[test]
    fn burst_then_one_per_interval() {
        let r = Rate::new(10.0, 3.0, at(0));
        for _ in 0..3 {
            assert_eq!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::Slot { wait: Duration::ZERO, cost: 1.0 });
        }
        assert_eq!(
            r.reserve(at(0), 1.0, Duration::ZERO),
            Reservation::TooLate { wait: Some(Duration::from_millis(100)) }
        );
        assert!(matches!(r.reserve(at(100), 1.0, Duration::ZERO), Reservation::Slot { .. }));
        assert!(matches!(r.reserve(at(150), 1.0, Duration::ZERO), Reservation::TooLate { .. }));
    }

    #[test]
    fn reservations_queue_in_arrival_order() {
        let r = Rate::new(10.0, 1.0, at(0));
        let waits: Vec<_> = (0..4)
            .map(|_| match r.reserve(at(0), 1.0, Duration::from_millis(250)) {
                Reservation::Slot { wait, .. } => Some(wait.as_millis()),
                Reservation::TooLate { .. } => None,
            })
            .collect();
        assert_eq!(waits, vec![Some(0), Some(100), Some(200), None]);
        r.release(1.0);
        assert_eq!(
            r.reserve(at(0), 1.0, Duration::from_millis(250)),
            Reservation::Slot { wait: Duration::from_millis(200), cost: 1.0 }
        );
    }

    #[test]
    fn capacity_change_carries_the_backlog_and_gives_no_burst() {
        let r = Rate::new(10.0, 5.0, at(0));
        for _ in 0..5 {
            assert!(matches!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::Slot { .. }));
        }
        // Bucket full at 10/s; raising to 100/s must not refill it.
        r.set(at(0), 100.0, 5.0);
        assert_eq!(r.remaining(at(0)), 0);
        assert_eq!(
            r.reserve(at(0), 1.0, Duration::ZERO),
            Reservation::TooLate { wait: Some(Duration::from_millis(10)) }
        );
        // Lowering to 1/s: the full bucket drains at the new rate.
        r.set(at(0), 1.0, 5.0);
        assert_eq!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::TooLate { wait: Some(Duration::from_secs(1)) });
        // The same capacity again changes nothing.
        r.set(at(0), 1.0, 5.0);
        assert_eq!(r.remaining(at(1000)), 1);
    }

    #[test]
    fn zero_capacity_never_reserves_and_recovers_without_a_burst() {
        let r = Rate::new(0.0, 5.0, at(0));
        assert_eq!(r.reserve(at(0), 1.0, Duration::from_secs(3600)), Reservation::TooLate { wait: None });
        r.set(at(0), 10.0, 5.0);
        assert_eq!(r.remaining(at(0)), 0);
        assert!(matches!(r.reserve(at(100), 1.0, Duration::ZERO), Reservation::Slot { .. }));
    }

    #[test]
    fn infinite_capacity_is_unlimited() {
        let r = Rate::new(f64::INFINITY, 1.0, at(0));
        for _ in 0..1000 {
            assert!(matches!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::Slot { .. }));
        }
        r.set(at(0), 10.0, 1.0);
        assert!(matches!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::Slot { .. }));
        assert!(matches!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::TooLate { .. }));
    }

    #[test]
    fn fractional_capacity() {
        let r = Rate::new(0.5, 1.0, at(0));
        assert!(matches!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::Slot { .. }));
        assert_eq!(r.reserve(at(0), 1.0, Duration::ZERO), Reservation::TooLate { wait: Some(Duration::from_secs(2)) });
    }
}
