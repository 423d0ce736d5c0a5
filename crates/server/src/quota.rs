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
//!   (the refill rate), cut while the bucket falls fast enough to be empty
//!   within [`HORIZON`]: by how fast it falls (smoothed over readings at
//!   least [`TREND_SPAN`] apart), and never below the capacity scaled by
//!   how full the bucket is (the whole of it at half full, none at empty).
//!   A bucket that holds steady or refills,
//!   however low, is spent no faster than it refills: the fleet keeps the
//!   whole rate, so that a fleet over its quota spends it all. So does a
//!   bucket that falls slowly far from empty: the fall that is left of a
//!   fleet's first burst, or the jitter of readings a call apart, does not
//!   cut a fleet that spends exactly the refill. A fleet whose capacity is
//!   the bucket's whole refill rate gets up to [`CATCH_UP`] more while the
//!   bucket is over a third full: its sidecars keep reserves and pace whole
//!   calls, so they spend a little less than their leases, and what they
//!   leave shows as the bucket rising; spending it keeps each minute at the
//!   API's whole rate.
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
/// At most this share of the capacity is added while a continuous bucket
/// is over a third full, for a fleet that shares the bucket's whole
/// refill: what is over a third goes out over [`CATCH_UP_SPAN`]. The third
/// kept is margin: a few calls sent at once (reserves spent together) take
/// a bucket kept there nowhere near what [`HORIZON`] counts as emptying,
/// and the API still holds room for them.
pub const CATCH_UP: f64 = 0.1;
/// See [`CATCH_UP`].
pub const CATCH_UP_SPAN: Duration = Duration::from_secs(20);
/// A continuous bucket is cut while, at the rate it falls, it would be
/// empty within this long: the time a cut takes to reach the fleet (a
/// trend span or two, then a lease refresh), with margin.
pub const HORIZON: Duration = Duration::from_secs(30);

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
    /// How fast that bucket refills, per second: what it lacks over the
    /// time it says it takes to be full, from the last reading that lacked
    /// some.
    refill: Option<f64>,
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
            let to_full = o.reset.since(o.observed).as_secs_f64();
            if o.remaining < o.limit && to_full >= 1.0 {
                self.refill = Some((o.limit - o.remaining) / to_full);
            }
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

    /// What a continuous bucket over a third full adds to a capacity that is
    /// its whole refill (see [`CATCH_UP`]); 0 for a capacity set below it,
    /// which is a margin its owner chose.
    fn catch_up(&self, o: &Observation, configured: f64) -> f64 {
        let over = o.remaining - o.limit / 3.0;
        match self.refill {
            Some(refill) if configured >= 0.98 * refill && over > 0.0 => {
                (over / CATCH_UP_SPAN.as_secs_f64()).min(configured * CATCH_UP)
            }
            _ => 0.0,
        }
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
            let emptying = self.drain > 0.0 && o.remaining < self.drain * HORIZON.as_secs_f64();
            return Some(match (o.exhausted(now), emptying) {
                (true, _) => 0.0,
                (false, true) => (configured - self.drain).max(configured * fill),
                (false, false) => configured + self.catch_up(&o, configured),
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
    /// would leave quota unspent). A slow fall far from empty costs
    /// nothing; near empty, it costs its own rate. Readings closer than [`TREND_SPAN`] to the last compared one say
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
        // A slow fall, 5/s for a while: 140 s from empty, not cut.
        for i in 0..8 {
            q.observe_at(bucket(900.0 - 25.0 * f64::from(i + 1), 36.0 + 5.0 * f64::from(i)));
        }
        assert_eq!(c(&q, 72.0), 100.0);
        // The same fall 25 s from empty: cut by about as much.
        for i in 0..23 {
            q.observe_at(bucket(700.0 - 25.0 * f64::from(i + 1), 76.0 + 5.0 * f64::from(i)));
        }
        assert!((c(&q, 187.0) - 95.0).abs() < 0.1, "{}", c(&q, 187.0));
    }

    /// A fleet that shares the bucket's whole refill gets what is over a
    /// third full on top, a little at a time; one that keeps a margin below
    /// the refill does not, nor one whose bucket is under a third.
    #[test]
    fn a_bucket_over_a_third_full_adds_to_a_fleet_sharing_its_whole_refill() {
        // 60 requests a minute: 1/s; the reset says when it is full.
        let read = |remaining: f64, observed: f64| Observation {
            limit: 60.0,
            remaining,
            reset: at(observed + (60.0 - remaining)),
            observed: at(observed),
            continuous: true,
        };
        let mut q = QuotaState::default();
        q.observe_at(read(60.0, 0.0));
        assert_eq!(q.capacity(at(0.5), 1.0, 0.0), Some(1.0), "full: its refill rate is not known yet");
        q.observe_at(read(21.0, 1.0));
        let c = q.capacity(at(1.5), 1.0, 0.0).unwrap();
        assert!((c - (1.0 + 1.0 / 20.0)).abs() < 1e-9, "1 over a third, over 20 s: {c}");
        q.observe_at(read(50.0, 2.0));
        assert!((q.capacity(at(2.5), 1.0, 0.0).unwrap() - 1.1).abs() < 1e-9, "at most a tenth more");
        assert_eq!(q.capacity(at(2.5), 0.97, 0.0), Some(0.97), "a margin below the refill is kept");
        q.observe_at(read(19.0, 3.0));
        assert_eq!(q.capacity(at(3.5), 1.0, 0.0), Some(1.0), "under a third: the capacity");
    }

    /// A fleet's first burst (its buckets spent at once) takes a bucket of
    /// 60 requests to half; then the fleet spends exactly the refill, and
    /// readings a call apart jitter around the level. Once the fall has
    /// stopped, the fleet keeps the whole rate: a cut for the jitter would
    /// leave a minute's quota unspent.
    #[test]
    fn a_bucket_that_stops_falling_near_half_full_is_not_cut_for_jitter() {
        let mut q = QuotaState::default();
        let fleet = |remaining: f64, observed: f64| Observation {
            limit: 60.0,
            remaining,
            reset: at(observed + 1.0),
            observed: at(observed),
            continuous: true,
        };
        for (i, left) in [60.0, 50.0, 40.0, 30.0].into_iter().enumerate() {
            q.observe_at(fleet(left, 5.0 * i as f64));
        }
        // Falling at 2/s, 15 s from empty: cut, but not below the rate at half full.
        assert_eq!(q.capacity(at(15.5), 1.0, 0.0), Some(1.0));
        q.observe_at(fleet(29.0, 20.0));
        assert!(q.capacity(at(20.5), 1.0, 0.0).unwrap() < 1.0, "still falling at about 1/s: cut");
        for (i, left) in [31.0, 28.0, 30.0, 29.0, 28.0, 30.0].into_iter().enumerate() {
            let t = 25.0 + 5.0 * i as f64;
            q.observe_at(fleet(left, t));
            assert_eq!(q.capacity(at(t + 0.5), 1.0, 0.0), Some(1.0), "at {t} s, {left} left");
        }
    }
}
