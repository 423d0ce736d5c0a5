//! The headroom a measured rate is asked for with (`wants: auto`): the
//! configured margin while demand moves; while demand holds steady, half of
//! it after [`STEADY`], a quarter after twice that, and so on down to a tenth,
//! so capacity a sidecar holds beyond its use ends small (about 1% of its rate
//! with the default 1.1) and goes to sidecars that want more, a little at a
//! time (each step is picked up by the others' next refresh without a visible
//! dip). A refusal or a queued request doubles the margin back (one step): a
//! stray clump of arrivals costs the others a little, not the whole margin,
//! and refusals that go on bring all of it back within a few readings.

use std::time::Duration;

use usher_core::clock::Time;

/// How long demand must hold steady, without refusals or queued requests,
/// before the headroom shrinks by half, and again by half after each more.
pub const STEADY: Duration = Duration::from_millis(250);
/// Demand within this fraction of where it settled counts as steady.
pub const STEADY_BAND: f64 = 0.1;
/// Steady demand keeps at least this share of the configured margin.
pub const STEADY_SHARE: f64 = 0.1;
/// Halvings past which the margin is at [`STEADY_SHARE`] (0.5⁴ < 0.1).
const MAX_HALVINGS: u32 = 4;

/// One key's headroom state.
#[derive(Debug, Clone, Default)]
pub struct Headroom {
    /// Where demand settled: since when, at what rate, and how many halvings
    /// the margin had at that moment.
    settled: Option<Settled>,
}

#[derive(Debug, Clone, Copy)]
struct Settled {
    since: Time,
    rate: f64,
    halvings: u32,
}

impl Settled {
    fn halvings_at(&self, now: Time) -> u32 {
        let steps = (now.since(self.since).as_secs_f64() / STEADY.as_secs_f64()).floor() as u32;
        (self.halvings + steps.min(MAX_HALVINGS)).min(MAX_HALVINGS)
    }
}

impl Headroom {
    /// The factor to multiply the measured `rate` by at `now`, given the
    /// configured `headroom` (≥ 1) and whether requests were refused or
    /// queued since the last reading (`pressure`).
    pub fn factor(&mut self, now: Time, rate: f64, pressure: bool, headroom: f64) -> f64 {
        let settled = match self.settled {
            Some(s) if (rate - s.rate).abs() <= STEADY_BAND * s.rate => {
                if pressure {
                    Settled { since: now, rate: s.rate, halvings: s.halvings_at(now).saturating_sub(1) }
                } else {
                    s
                }
            }
            _ => Settled { since: now, rate, halvings: 0 },
        };
        self.settled = Some(settled);
        1.0 + (headroom - 1.0) * 0.5f64.powi(settled.halvings_at(now) as i32).max(STEADY_SHARE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_shrinks_while_demand_holds_steady_and_comes_back_with_refusals_or_a_move() {
        let mut h = Headroom::default();
        let t0 = Time::from_secs(1_000);
        let at = |ms: u64| t0.saturating_add(Duration::from_millis(ms));
        // STEADY is 250 ms.
        assert_eq!(h.factor(at(0), 30.0, false, 1.1), 1.1);
        assert_eq!(h.factor(at(200), 31.0, false, 1.1), 1.1, "not steady for 250 ms yet");
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(h.factor(at(250), 29.0, false, 1.1), 1.05), "steady within 10% for 250 ms: half");
        assert!(close(h.factor(at(500), 30.0, false, 1.1), 1.025), "500 ms: a quarter");
        assert!(close(h.factor(at(750), 30.0, false, 1.1), 1.0125));
        assert!(close(h.factor(at(1_000), 30.0, false, 1.1), 1.01), "then a tenth at least");
        assert!(close(h.factor(at(60_000), 30.0, false, 1.1), 1.01));
        assert!(close(h.factor(at(60_100), 30.0, true, 1.1), 1.0125), "a refusal doubles the margin");
        assert!(close(h.factor(at(60_200), 30.0, true, 1.1), 1.025), "another doubles it again");
        assert!(close(h.factor(at(60_400), 30.0, false, 1.1), 1.025), "200 ms since the refusal: still");
        assert!(close(h.factor(at(60_450), 30.0, false, 1.1), 1.0125), "250 ms: halved again");
        assert!(close(h.factor(at(60_500), 30.0, true, 1.1), 1.025));
        assert!(close(h.factor(at(60_550), 30.0, true, 1.1), 1.05));
        assert_eq!(h.factor(at(60_600), 30.0, true, 1.1), 1.1, "refusals that go on: the whole margin");
        assert_eq!(h.factor(at(60_650), 30.0, true, 1.1), 1.1, "and no more");
        assert_eq!(h.factor(at(61_000), 40.0, false, 1.1), 1.1, "demand moved by a third: the full margin");
        assert_eq!(h.factor(at(62_000), 40.0, false, 1.0), 1.0, "no margin configured, none added");
    }
}
