//! The capacity a resource shares when its upstream reports its own quota:
//! the freshest observation its clients carried up (`lease::quota`) is the
//! truth, so spending by consumers outside usher is accounted for.
//!
//! - A fixed window (GitHub's `x-ratelimit-*`, the IETF draft's `RateLimit`):
//!   what remains, less what the fleet may have spent since it was seen and
//!   what others outside usher will spend until the reset (their rate is
//!   what the remainder fell by beyond the fleet's leases), spread over the
//!   time to the reset plus a lag (a quarter of it, at most [`LAG`]); after
//!   the reset, the whole limit over one window, until it is seen again.
//! - A continuous bucket (OpenAI's, Anthropic's): the configured capacity
//!   (the refill rate), cut in proportion while the bucket is under half full.
//! - Spent (nothing remains before the reset): 0 until the reset.
//!
//! A resource with `window: calendar` is a fixed window kept by the server
//! itself (`calendar`).

use std::time::Duration;

use usher_core::clock::Time;
use usher_lease::quota::Observation;

/// How stale the leases a fleet holds may be when the capacity changes: a
/// fixed window's remainder is spread over this much more than is left, so
/// that leases granted a refresh ago do not run it dry before the reset.
pub const LAG: Duration = Duration::from_secs(2);
/// An observation older than this no longer steers the capacity.
pub const STALE: Duration = Duration::from_secs(3600);

/// Observations this far apart measure what others spend.
const OUTSIDE_SPAN: Duration = Duration::from_secs(2);

/// A resource's upstream quota, as its server knows it.
#[derive(Debug, Clone, Default)]
pub struct QuotaState {
    /// The freshest observation.
    pub latest: Option<Observation>,
    /// The window's length, learnt from two resets.
    window: Option<Duration>,
    /// An earlier observation of the same window, and what the fleet's
    /// leases granted since: what the remainder fell by beyond that was spent
    /// by others.
    base: Option<(Observation, f64)>,
    /// What consumers outside usher spend per second (smoothed).
    outside: f64,
}

impl QuotaState {
    /// Takes an observation a client carried up; the freshest one wins.
    /// `granted`: what the resource's leases grant now, per second.
    pub fn observe(&mut self, o: Observation, granted: f64) {
        if let Some(prev) = self.latest {
            if o.observed < prev.observed {
                return;
            }
            if !o.continuous && o.reset > prev.reset.saturating_add(Duration::from_millis(500)) {
                let step = o.reset.since(prev.reset);
                // A reset moved on by whole windows: the window is the smallest such step seen.
                self.window = Some(self.window.map_or(step, |w| w.min(step)));
            }
        }
        match self.base {
            // (Resets read from different answers differ by rounding.)
            Some((b, g))
                if !o.continuous && b.reset.since(o.reset).max(o.reset.since(b.reset)) < Duration::from_millis(500) =>
            {
                let span = o.observed.since(b.observed);
                if span >= OUTSIDE_SPAN {
                    let others = ((b.remaining - o.remaining) / span.as_secs_f64() - g.max(granted)).max(0.0);
                    self.outside += 0.5 * (others - self.outside);
                    self.base = Some((o, granted));
                }
            }
            _ => self.base = Some((o, granted)),
        }
        self.latest = Some(o);
    }

    /// The capacity to share at `now`: `configured` is the resource's own
    /// (per second), `granted` what its leases grant now in total. None
    /// without a fresh observation.
    pub fn capacity(&self, now: Time, configured: f64, granted: f64) -> Option<f64> {
        let o = self.latest?;
        if now.since(o.observed) > STALE {
            return None;
        }
        if o.continuous {
            let fill = if o.limit > 0.0 { (2.0 * o.remaining / o.limit).clamp(0.0, 1.0) } else { 1.0 };
            return Some(if o.exhausted(now) { 0.0 } else { configured * fill });
        }
        if now >= o.reset {
            // Renewed whole: the limit over a window, until it is seen again.
            let window = self.window?;
            return Some(o.limit / (window + LAG).as_secs_f64());
        }
        if o.exhausted(now) {
            return Some(0.0);
        }
        let to_reset = o.reset.since(now).as_secs_f64();
        let spent_since = (granted + self.outside) * now.since(o.observed).as_secs_f64();
        let left = (o.remaining - spent_since - self.outside * to_reset).max(0.0);
        let lag = (to_reset / 4.0).min(LAG.as_secs_f64());
        Some(left / (to_reset + lag).max(0.001))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl QuotaState {
        fn observe_at(&mut self, o: Observation) {
            self.observe(o, 0.0)
        }
    }

    fn at(s: f64) -> Time {
        Time::from_nanos((1_800_000_000.0e9 + s * 1e9) as u64)
    }

    fn window(remaining: f64, observed: f64, reset: f64) -> Observation {
        Observation { limit: 240.0, remaining, reset: at(reset), observed: at(observed), continuous: false }
    }

    #[test]
    fn a_fixed_window_shares_what_remains_until_its_reset() {
        let mut q = QuotaState::default();
        assert_eq!(q.capacity(at(0.0), 8.0, 0.0), None, "no observation: the configured capacity");
        q.observe_at(window(200.0, 0.0, 28.0));
        // Over the time to the reset and a lag of 2 s.
        assert!((q.capacity(at(0.0), 8.0, 0.0).unwrap() - 200.0 / 30.0).abs() < 1e-9);
        // Two seconds on at 5/s: what the fleet may have spent since is counted.
        assert!((q.capacity(at(2.0), 8.0, 5.0).unwrap() - 190.0 / 28.0).abs() < 1e-9);
        // Near the reset the lag is a quarter of what is left.
        assert!((q.capacity(at(24.0), 8.0, 0.0).unwrap() - 200.0 / 5.0).abs() < 1e-9);
        // An older observation does not replace a fresher one.
        q.observe_at(window(10.0, -1.0, 28.0));
        assert_eq!(q.latest.unwrap().remaining, 200.0);
        // Spent: nothing until the reset; after it, the window's limit once the window is known.
        q.observe_at(window(0.0, 10.0, 28.0));
        assert_eq!(q.capacity(at(20.0), 8.0, 5.0), Some(0.0));
        assert_eq!(q.capacity(at(29.0), 8.0, 5.0), None, "the window's length is not known yet");
        assert!(q.outside > 5.0, "the remainder fell faster than any lease: others spend {}", q.outside);
        q.observe_at(window(239.0, 29.0, 58.0));
        q.observe_at(window(0.0, 50.0, 58.0));
        let renewed = q.capacity(at(59.0), 8.0, 5.0).unwrap();
        assert!((renewed - 240.0 / 32.0).abs() < 1e-9, "{renewed}");
    }

    /// What others outside usher spend is measured, and left to them.
    #[test]
    fn what_others_spend_is_left_to_them() {
        let mut q = QuotaState::default();
        // The fleet is granted 4/s; the remainder falls by 6/s: others spend 2/s.
        for i in 0..10 {
            let t = f64::from(i) * 2.0;
            q.observe(window(200.0 - 12.0 * f64::from(i), t, 30.0), 4.0);
        }
        assert!((q.outside - 2.0).abs() < 0.1, "{}", q.outside);
        // At 18 s: 92 left, others take 2/s × 12 s; the rest over 12 s + 2 s.
        let c = q.capacity(at(18.0), 8.0, 4.0).unwrap();
        assert!((c - (92.0 - q.outside * 12.0) / 14.0).abs() < 1e-6, "{c}");
    }

    #[test]
    fn a_continuous_bucket_slows_down_below_half_full() {
        let mut q = QuotaState::default();
        let bucket = |remaining: f64| Observation {
            limit: 6000.0,
            remaining,
            reset: at(10.0),
            observed: at(0.0),
            continuous: true,
        };
        q.observe_at(bucket(6000.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(100.0));
        q.observe_at(bucket(1500.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(50.0));
        q.observe_at(bucket(0.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(0.0));
    }
}
