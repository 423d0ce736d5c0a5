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
//!   What others spend is measured while the fleet's answers keep coming;
//!   measured no more for [`OUTSIDE_FADE`], it fades (see [`QuotaState`]).
//! - A continuous bucket (OpenAI's, Anthropic's): the configured capacity
//!   (the refill rate), cut while the bucket is under half full and
//!   falling: by how fast it falls (smoothed over readings at least
//!   [`TREND_SPAN`] apart), and never below the share of it that is full.
//!   A bucket that holds steady or refills, however low, is spent no faster
//!   than it refills: the fleet keeps the whole rate, so that a fleet over
//!   its quota spends it all.
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
/// A continuous bucket's readings this far apart measure how fast it falls.
pub const TREND_SPAN: Duration = Duration::from_secs(5);

/// What others spend, measured no more for this long, halves with each
/// such span after: see [`QuotaState`].
pub const OUTSIDE_FADE: Duration = Duration::from_secs(5);

/// A resource's upstream quota, as its server knows it.
///
/// What others outside usher spend is what the remainder fell by beyond
/// the fleet's leases. A fleet also spends what its buckets hold (a burst,
/// the pooled burst credited to a growing lease), which counts as others'
/// until the buckets are empty: at a fleet's first requests the measure can
/// take all that remains, and the fleet is given 0. A fleet given 0 sends
/// nothing, so no answer measures it again, and the next windows would
/// start with it and give 0 again. So a measure not renewed for
/// [`OUTSIDE_FADE`] fades: the fleet gets capacity back, and its answers
/// measure what others really spend.
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
    /// What consumers outside usher spend per second (smoothed), and when
    /// it was last measured.
    outside: f64,
    measured: Option<Time>,
    /// A continuous bucket's last reading compared.
    trend: Option<Observation>,
    /// How fast that bucket falls, per second, between readings at least
    /// [`TREND_SPAN`] apart, each new measure averaged with the last
    /// (above 0: spent faster than it refills; negative: it refills).
    drain: f64,
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
        if o.continuous {
            match self.trend {
                Some(b) if o.observed.since(b.observed) < TREND_SPAN => {}
                Some(b) => {
                    let drain = (b.remaining - o.remaining) / o.observed.since(b.observed).as_secs_f64();
                    self.drain = 0.5 * (self.drain + drain);
                    self.trend = Some(o);
                }
                None => self.trend = Some(o),
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
                    let before = self.outside_at(o.observed);
                    self.outside = before + 0.5 * (others - before);
                    self.measured = Some(o.observed);
                    self.base = Some((o, granted));
                }
            }
            _ => self.base = Some((o, granted)),
        }
        self.latest = Some(o);
    }

    /// What others spend per second as of `now`: the last measure, halved
    /// for each [`OUTSIDE_FADE`] beyond the first since it was made.
    fn outside_at(&self, now: Time) -> f64 {
        let Some(at) = self.measured else { return self.outside };
        let quiet = now.since(at).saturating_sub(OUTSIDE_FADE);
        if quiet.is_zero() {
            return self.outside;
        }
        self.outside * 0.5f64.powf(quiet.as_secs_f64() / OUTSIDE_FADE.as_secs_f64())
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
            return Some(match (o.exhausted(now), self.drain > 0.0) {
                (true, _) => 0.0,
                (false, true) => (configured - self.drain).max(configured * fill),
                (false, false) => configured,
            });
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
        let outside = self.outside_at(now);
        let spent_since = (granted + outside) * now.since(o.observed).as_secs_f64();
        let left = (o.remaining - spent_since - outside * to_reset).max(0.0);
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

    /// A fleet that spent its buckets at its first requests looks like
    /// others spending: given 0 for it, it sends nothing, so nothing
    /// measures again. The measure fades, and the next window is shared.
    #[test]
    fn what_others_seemed_to_spend_fades_when_nothing_measures_it() {
        let mut q = QuotaState::default();
        // Leased 2/s, the fleet spends 18/s out of its buckets for 4 s.
        q.observe(window(240.0, 0.0, 30.0), 2.0);
        q.observe(window(204.0, 2.0, 30.0), 2.0);
        q.observe(window(168.0, 4.0, 30.0), 2.0);
        assert!(q.outside > 10.0, "the fleet's buckets look like others spending: {}", q.outside);
        assert_eq!(q.capacity(at(4.5), 8.0, 2.0), Some(0.0), "so the fleet is given 0");
        // Given 0, the fleet sends nothing until the next window, where
        // one request sees it whole.
        q.observe(window(236.0, 31.0, 60.0), 0.0);
        let c = q.capacity(at(31.0), 8.0, 0.0).unwrap();
        assert!(c > 0.75 * 236.0 / 31.0, "the next window is shared: {c}");
        // A measure as fresh as the answers that make it is not touched.
        assert_eq!(q.outside_at(at(4.0).saturating_add(OUTSIDE_FADE)), q.outside);
    }

    fn bucket(remaining: f64, observed: f64) -> Observation {
        Observation { limit: 6000.0, remaining, reset: at(observed + 10.0), observed: at(observed), continuous: true }
    }

    /// A continuous bucket falling below half full slows the fleet by how
    /// fast it falls (never below the share of it that is full); an empty
    /// one stops it until it refills.
    #[test]
    fn a_continuous_bucket_slows_down_below_half_full_while_it_falls() {
        let mut q = QuotaState::default();
        q.observe_at(bucket(6000.0, 0.0));
        assert_eq!(q.capacity(at(1.0), 100.0, 0.0), Some(100.0));
        // 900/s lost over 5 s, smoothed to 450/s: cut to the half that is full.
        q.observe_at(bucket(1500.0, 5.0));
        assert_eq!(q.capacity(at(6.0), 100.0, 0.0), Some(50.0));
        q.observe_at(bucket(0.0, 10.0));
        assert_eq!(q.capacity(at(11.0), 100.0, 0.0), Some(0.0));
    }

    /// A fleet over its quota keeps the bucket low. Spent as fast as it
    /// refills, it holds steady: the fleet gets back the whole rate (a cut
    /// would leave quota unspent). A slow fall costs only its own rate.
    /// Readings closer than [`TREND_SPAN`] to the last compared one say
    /// nothing of the trend.
    #[test]
    fn a_low_bucket_that_holds_steady_or_refills_gets_back_the_whole_rate() {
        let mut q = QuotaState::default();
        let c = |q: &QuotaState, t: f64| q.capacity(at(t), 100.0, 0.0).unwrap();
        q.observe_at(bucket(3000.0, 0.0));
        q.observe_at(bucket(600.0, 5.0));
        // Falling at 240/s (smoothed): cut to the fifth that is full.
        assert_eq!(c(&q, 5.5), 20.0);
        q.observe_at(bucket(700.0, 6.0));
        assert!((c(&q, 6.5) - 100.0 * 1400.0 / 6000.0).abs() < 1e-9, "too soon to say: still falling");
        // It holds steady: the smoothed fall halves with each reading (at
        // 11 s, 100 more than at 5 s: -16.7/s, smoothed with 240/s).
        let fall = (240.0 - 100.0 / 6.0) / 2.0;
        for (t, want) in [(11.0, 100.0f64 - fall), (16.0, 100.0 - fall / 2.0), (21.0, 100.0 - fall / 4.0)] {
            q.observe_at(bucket(700.0, t));
            assert!((c(&q, t + 0.5) - want.max(100.0 * 1400.0 / 6000.0)).abs() < 1e-9, "{t}: {}", c(&q, t + 0.5));
        }
        // It refills: the whole rate.
        q.observe_at(bucket(800.0, 26.0));
        q.observe_at(bucket(900.0, 31.0));
        assert_eq!(c(&q, 31.5), 100.0);
        // A slow fall, 5/s for a while: cut by about as much.
        for i in 0..8 {
            q.observe_at(bucket(900.0 - 25.0 * f64::from(i + 1), 36.0 + 5.0 * f64::from(i)));
        }
        assert!((c(&q, 72.0) - 95.0).abs() < 0.1, "{}", c(&q, 72.0));
    }
}
