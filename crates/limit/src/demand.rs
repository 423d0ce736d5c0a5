//! The demand meter of one resource key: what the lease client reads to
//! compute `wants`.
//!
//! The request path only touches atomics; the smoothing state is updated by
//! whoever samples (the lease refresher, the metrics scrape), under its own lock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use once_cell::race::OnceBox;
use serde::Serialize;

use usher_core::clock::Time;

/// Time constant of the smoothed arrival rate.
pub const SMOOTHING: Duration = Duration::from_secs(10);

/// Counts what one key is asked for: arrivals, outcomes, requests in
/// flight and waiting, and a smoothed arrival rate.
#[derive(Debug, Default)]
pub struct DemandMeter {
    /// Every arrival (admitted, paced or refused) of a whole cost, in cost
    /// units: most routes charge whole costs, counted by one `fetch_add`.
    whole: AtomicU64,
    /// The rest of the arrivals, in cost units: fractional costs and settled
    /// differences, as the bits of an `f64`. A float keeps any cost (a
    /// budget's 0.00015 $ as well as a refund of a thousand tokens) to its
    /// relative precision, where a count of thousandths lost the tiny ones.
    rest: AtomicU64,
    /// Every arrival, counted once whatever its cost.
    requests: AtomicU64,
    admitted: AtomicU64,
    paced: AtomicU64,
    refused: AtomicU64,
    in_flight: AtomicI64,
    peak_in_flight: AtomicI64,
    waiters: AtomicI64,
    /// The smoothed rate and the latest refusal's `Retry-After`, made at
    /// the first [`DemandMeter::sample`] (the lease side's and the status
    /// page's) or refusal: a key nobody samples and nothing refuses, as a
    /// local tenant key, pays a pointer for them.
    seldom: OnceBox<Seldom>,
}

/// What a key needs once it is sampled or refused ([`DemandMeter::seldom`]).
#[derive(Debug, Default)]
struct Seldom {
    smooth: Mutex<Smooth>,
    /// The latest `Retry-After` a refusal gave (nanoseconds of [`Time`], 0:
    /// none): until then the apps told to wait are coming back.
    retry_at: AtomicU64,
}

#[derive(Debug, Default)]
struct Smooth {
    last: Option<(Time, f64)>,
    rate: f64,
    /// Peak in flight in the current window.
    peak: i64,
}

/// One reading of a meter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DemandSample {
    /// Smoothed arrivals per second (cost units), counting admitted, paced and refused.
    pub rate: f64,
    /// Highest number in flight since the last [`DemandMeter::take_peak`].
    pub peak_in_flight: i64,
    /// Requests admitted and not yet finished.
    pub in_flight: i64,
    /// Requests waiting for a slot, a raised capacity or a gauge permit.
    pub waiters: i64,
    /// Requests admitted at once, since the meter was made.
    pub admitted: u64,
    /// Requests admitted after a wait, since the meter was made.
    pub paced: u64,
    /// Requests refused, since the meter was made.
    pub refused: u64,
}

/// How one request fared at one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted at once.
    Admitted,
    /// Admitted after waiting for capacity.
    Paced,
    /// Refused.
    Refused,
}

impl DemandMeter {
    /// Counts a request of `cost` units, whatever becomes of it.
    #[inline]
    pub fn arrive(&self, cost: f64) {
        // (Casts and a comparison: `fract` is a library call.)
        let whole = cost as u64;
        if whole as f64 == cost {
            self.whole.fetch_add(whole, Ordering::Relaxed);
        } else {
            self.add(cost);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// A settled cost differs from the one that arrived by `delta` units.
    pub fn settle(&self, delta: f64) {
        self.add(delta);
    }

    /// Adds `units` (a fractional cost, or a settled difference) to the rest of the arrivals.
    fn add(&self, units: f64) {
        if !units.is_finite() {
            return;
        }
        let _ = self
            .rest
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| Some((f64::from_bits(a) + units).to_bits()));
    }

    /// Counts how a request fared.
    pub fn record(&self, outcome: Outcome) {
        let c = match outcome {
            Outcome::Admitted => &self.admitted,
            Outcome::Paced => &self.paced,
            Outcome::Refused => &self.refused,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A refusal told its app to come back at `at` (its `Retry-After`).
    pub fn retry_at(&self, at: Time) {
        self.seldom.get_or_init(Box::default).retry_at.fetch_max(at.as_nanos(), Ordering::Relaxed);
    }

    /// The latest moment a refused app was told to come back, if any was.
    pub fn retries_due(&self) -> Option<Time> {
        let n = self.seldom.get().map_or(0, |s| s.retry_at.load(Ordering::Relaxed));
        (n > 0).then(|| Time::from_nanos(n))
    }

    /// Counts a request in flight (admitted), raising the peak if it is one.
    pub fn enter(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::Relaxed);
    }

    /// Counts a request in flight as finished.
    pub fn leave(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts a request that starts waiting.
    pub fn wait_begin(&self) {
        self.waiters.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request that stops waiting, however the wait ended.
    pub fn wait_end(&self) {
        self.waiters.fetch_sub(1, Ordering::Relaxed);
    }

    /// Requests waiting now.
    pub fn waiters(&self) -> i64 {
        self.waiters.load(Ordering::Relaxed)
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Total arrivals so far, in cost units (never below 0: a refund
    /// takes back at most the cost that arrived).
    pub fn arrivals(&self) -> f64 {
        let rest = f64::from_bits(self.rest.load(Ordering::Relaxed));
        (self.whole.load(Ordering::Relaxed) as f64 + rest).max(0.0)
    }

    /// Total arrivals so far, in requests.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Returns the peak in flight since the previous call and starts a new
    /// window: the lease client calls it once per refresh.
    pub fn take_peak(&self) -> i64 {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        self.peak_in_flight.swap(in_flight, Ordering::Relaxed).max(in_flight)
    }

    /// Updates the smoothed rate at `now` and returns a reading. Any number
    /// of readers may sample: the smoothing is weighted by elapsed time.
    pub fn sample(&self, now: Time) -> DemandSample {
        let count = self.arrivals();
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let mut s = self.seldom.get_or_init(Box::default).smooth.lock().expect("demand lock");
        let window_peak = self.peak_in_flight.load(Ordering::Relaxed);
        match s.last {
            None => s.last = Some((now, count)),
            Some((t0, c0)) => {
                let dt = now.since(t0).as_secs_f64();
                if dt > 0.0 {
                    // A cost settled below its charge takes arrivals back:
                    // the count may be below the last reading's.
                    let inst = (count - c0) / dt;
                    let alpha = 1.0 - (-dt / SMOOTHING.as_secs_f64()).exp();
                    s.rate += alpha * (inst - s.rate);
                    s.last = Some((now, count));
                }
            }
        }
        s.peak = window_peak.max(in_flight);
        DemandSample {
            rate: s.rate.max(0.0),
            peak_in_flight: s.peak,
            in_flight,
            waiters: self.waiters.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            paced: self.paced.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothed_rate_converges_and_peak_resets() {
        let m = DemandMeter::default();
        let mut t = Time::from_secs(1000);
        m.sample(t);
        for _ in 0..120 {
            for _ in 0..20 {
                m.arrive(1.0);
            }
            t = t.saturating_add(Duration::from_secs(1));
            m.sample(t);
        }
        let s = m.sample(t);
        assert!((s.rate - 20.0).abs() < 0.01, "rate {}", s.rate);
        m.enter();
        m.enter();
        m.leave();
        assert_eq!(m.sample(t).peak_in_flight, 2);
        assert_eq!(m.take_peak(), 2);
        assert_eq!(m.sample(t).peak_in_flight, 1);
    }

    /// A cost settled below its charge after a reading (an LLM's answer
    /// shorter than its guess) takes back arrivals that reading counted.
    #[test]
    fn a_refund_after_a_reading_lowers_the_rate() {
        let m = DemandMeter::default();
        let mut t = Time::from_secs(1000);
        m.sample(t);
        m.arrive(150.0);
        t = t.saturating_add(Duration::from_secs(1));
        let charged = m.sample(t).rate;
        assert!(charged > 0.0);
        m.settle(-100.0);
        t = t.saturating_add(Duration::from_secs(1));
        let settled = m.sample(t).rate;
        assert!((0.0..charged).contains(&settled), "{settled} after {charged}");
        assert_eq!(m.arrivals(), 50.0);
    }

    /// A cost far below one unit counts (a budget in dollars: 0.00015 $ a
    /// call), and so does one far above it, each to its own precision.
    #[test]
    fn tiny_and_huge_costs_both_count() {
        let m = DemandMeter::default();
        let mut t = Time::from_secs(1000);
        m.sample(t);
        for _ in 0..1000 {
            m.arrive(0.00015);
        }
        assert!((m.arrivals() - 0.15).abs() < 1e-12, "{}", m.arrivals());
        m.settle(-0.00005);
        assert!((m.arrivals() - 0.14995).abs() < 1e-12, "{}", m.arrivals());
        t = t.saturating_add(Duration::from_secs(1));
        assert!(m.sample(t).rate > 0.0, "tiny costs make a rate");
        m.settle(-0.15);
        assert_eq!(m.arrivals(), 0.0, "a refund never takes the count below 0");
        let big = DemandMeter::default();
        for _ in 0..1000 {
            big.arrive(1e9);
            big.arrive(1.0);
        }
        assert_eq!(big.arrivals(), 1_000_000_001_000.0, "whole costs add up exactly");
    }
}
