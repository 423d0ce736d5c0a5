//! The capacity a resource shares when its upstream reports its own quota:
//! the freshest observation its clients carried up (`lease::quota`) is the
//! truth, so spending by consumers outside usher is accounted for.
//!
//! - A fixed window (GitHub's `x-ratelimit-*`, the IETF draft's `RateLimit`):
//!   what remains, less what the fleet may have spent since it was seen,
//!   spread over the time to the reset plus [`LAG`]; after the reset, the
//!   whole limit over one window, until a fresh observation comes.
//! - A continuous bucket (OpenAI's, Anthropic's): the configured capacity
//!   (the refill rate), cut in proportion while the bucket is under half full.
//! - Spent (nothing remains before the reset): 0 until the reset.

use std::time::Duration;

use crate::clock::Time;
use crate::lease::quota::Observation;

/// How stale the leases a fleet holds may be when the capacity changes: a
/// fixed window's remainder is spread over this much more than is left, so
/// that leases granted a refresh ago do not run it dry before the reset.
pub const LAG: Duration = Duration::from_secs(2);
/// An observation older than this no longer steers the capacity.
pub const STALE: Duration = Duration::from_secs(3600);

/// A resource's upstream quota, as its server knows it.
#[derive(Debug, Clone, Default)]
pub struct QuotaState {
    /// The freshest observation.
    pub latest: Option<Observation>,
    /// The window's length, learnt from two resets.
    window: Option<Duration>,
}

impl QuotaState {
    /// Takes an observation a client carried up; the freshest one wins.
    pub fn observe(&mut self, o: Observation) {
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
        let spent_since = granted * now.since(o.observed).as_secs_f64();
        let left = (o.remaining - spent_since).max(0.0);
        Some(left / (o.reset.since(now) + LAG).as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        q.observe(window(200.0, 0.0, 28.0));
        assert!((q.capacity(at(0.0), 8.0, 0.0).unwrap() - 200.0 / 30.0).abs() < 1e-9);
        // Two seconds on at 5/s: what the fleet may have spent since is counted.
        assert!((q.capacity(at(2.0), 8.0, 5.0).unwrap() - 190.0 / 28.0).abs() < 1e-9);
        // An older observation does not replace a fresher one.
        q.observe(window(10.0, -1.0, 28.0));
        assert_eq!(q.latest.unwrap().remaining, 200.0);
        // Spent: nothing until the reset; after it, the window's limit once the window is known.
        q.observe(window(0.0, 10.0, 28.0));
        assert_eq!(q.capacity(at(20.0), 8.0, 5.0), Some(0.0));
        assert_eq!(q.capacity(at(29.0), 8.0, 5.0), None, "the window's length is not known yet");
        q.observe(window(239.0, 29.0, 58.0));
        q.observe(window(0.0, 50.0, 58.0));
        let renewed = q.capacity(at(59.0), 8.0, 5.0).unwrap();
        assert!((renewed - 240.0 / 32.0).abs() < 1e-9, "{renewed}");
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
        q.observe(bucket(6000.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(100.0));
        q.observe(bucket(1500.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(50.0));
        q.observe(bucket(0.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(0.0));
    }
}
