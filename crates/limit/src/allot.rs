//! A calendar quota's allotment, as one rate key enforces it.
//!
//! Where the servers share a quota that renews whole at each boundary of a
//! UTC unit (`window: calendar`), a key's lease is an **allotment**: units it
//! may spend from now until the unit's reset, at once if it likes. The key
//! then holds exactly what is left of it: a burst spends it at once, nothing
//! refills before the reset, and at the reset what is left is void (the
//! servers share the new unit's budget anew). One request always passes a
//! key whose allotment is untouched and above 0, even one that costs more
//! than is left: the one request per sidecar that the fleet's bound allows.
//!
//! A new allotment replaces the old one, less what the key admitted since
//! the request that asked for it read its account ([`Allotment::mark`]): the
//! servers counted what the key had spent by then, and hand out the rest.
//! So what the key may spend in a unit is always what the servers counted
//! for it.
//!
//! The key counts what it admits in the unit ([`Account`]), for the lease
//! client to report with its next request: from its first allotment on, and
//! from each reset on. The account names the reset it counts from, so the
//! servers know which unit it is of even when no allotment for the new unit
//! came yet.

use usher_core::clock::Time;

/// What the servers granted a key: `units` to spend until `reset`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allotment {
    /// Units the key may spend from now until `reset`.
    pub units: f64,
    /// The reset of the unit the allotment is of.
    pub reset: Time,
    /// The key's [`Account::mark`] in the request it answers, if that
    /// request carried an account: what the key admitted since is taken off.
    pub mark: Option<f64>,
}

/// A key's account of its unit, which the lease client reports to the servers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Account {
    /// The reset of the unit it counts in (its last allotment's); once that
    /// has passed, `spent` counts from it.
    pub reset: Time,
    /// Units admitted in the unit.
    pub spent: f64,
    /// What is left of the allotment (never below 0).
    pub left: f64,
    /// `reset` has passed with no allotment of the next unit yet: `spent`
    /// counts from it, in the next unit. (Without it an account read just
    /// before a reset and sent just after it is one of the unit that ended.)
    pub passed: bool,
    /// Units admitted under allotments so far, a running total: the answer
    /// to a request that carried this account takes off what was admitted
    /// after it ([`Allotment::mark`]).
    pub mark: f64,
    /// Units ever charged under allotments, a running total that only
    /// grows (what settled costs gave back is not taken off): less than a
    /// key reported before tells the servers it restarted, where `spent`
    /// also falls when a cost settles below its charge.
    pub charged: f64,
}

/// One key's allotment state (kept under its rate's lock).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Allot {
    /// What is left; below 0 after a request that cost more than was left.
    left: f64,
    /// Nothing was admitted since the allotment was set.
    untouched: bool,
    /// The reset of the unit counted in.
    reset: Time,
    /// Units admitted under allotments so far, never reset.
    admitted: f64,
    /// `admitted` when the unit counted in began.
    base: f64,
    /// `reset` has passed: the count goes on from it, for the next unit.
    rolled: bool,
    /// Units ever charged, never given back (see [`Account::charged`]).
    charged: f64,
}

/// Resets a clock's reading and the wire's rounding put this far apart are the same.
const SKEW_NS: u64 = 500_000_000;

impl Allot {
    /// A key's first allotment, at `now`: it counts from here.
    pub(crate) fn new(a: Allotment, now: Time) -> Self {
        let mut s = Allot {
            left: 0.0,
            untouched: false,
            reset: a.reset,
            admitted: 0.0,
            base: 0.0,
            rolled: false,
            charged: 0.0,
        };
        s.replace(a, now);
        s
    }

    /// At the reset, what is left is void and the count starts again.
    fn roll(&mut self, now: Time) {
        if !self.rolled && now >= self.reset {
            (self.left, self.untouched, self.base, self.rolled) = (0.0, false, self.admitted, true);
        }
    }

    /// Takes a new allotment at `now`: what the key may spend becomes its
    /// units less what was admitted since its mark. One of a unit already
    /// over leaves nothing; one of an earlier unit than the one counted in
    /// changes nothing.
    pub(crate) fn replace(&mut self, a: Allotment, now: Time) {
        self.roll(now);
        let (new, old) = (a.reset.as_nanos(), self.reset.as_nanos());
        if new.saturating_add(SKEW_NS) < old {
            return;
        }
        if new > old.saturating_add(SKEW_NS) {
            // A later unit: its count starts at the reset (rolled), or now.
            if !self.rolled {
                self.base = self.admitted;
            }
            (self.reset, self.rolled) = (a.reset, false);
        }
        if a.reset <= now || !a.units.is_finite() {
            (self.left, self.untouched) = (0.0, false);
            return;
        }
        let since = a.mark.map_or(0.0, |m| (self.admitted - m).max(0.0));
        self.left = a.units.max(0.0) - since;
        self.untouched = true;
    }

    /// Admits `cost` units now if what is left covers them, or if nothing
    /// was taken from an allotment above 0 yet.
    pub(crate) fn take(&mut self, now: Time, cost: f64) -> bool {
        self.roll(now);
        if self.open(now, cost) {
            self.left -= cost;
            self.admitted += cost;
            self.charged += cost;
            self.untouched = false;
            return true;
        }
        false
    }

    /// Gives back `cost` units admitted and not used.
    pub(crate) fn give_back(&mut self, cost: f64) {
        self.left += cost;
        self.admitted -= cost;
    }

    /// Charges `units` more (a cost settled above its charge), or gives
    /// them back when negative.
    pub(crate) fn charge(&mut self, units: f64) {
        self.left -= units;
        self.admitted += units;
        self.charged += units.max(0.0);
    }

    /// Whether a request of `cost` could pass now without a new allotment.
    pub(crate) fn open(&mut self, now: Time, cost: f64) -> bool {
        self.roll(now);
        self.left >= cost - 1e-9 || (self.untouched && self.left > 0.0)
    }

    /// What is left now (never below 0).
    pub(crate) fn left(&mut self, now: Time) -> f64 {
        self.roll(now);
        self.left.max(0.0)
    }

    /// The reset of the unit counted in.
    pub(crate) fn reset(&self) -> Time {
        self.reset
    }

    /// The key's account at `now`.
    pub(crate) fn account(&mut self, now: Time) -> Account {
        self.roll(now);
        Account {
            reset: self.reset,
            spent: (self.admitted - self.base).max(0.0),
            left: self.left.max(0.0),
            mark: self.admitted,
            passed: self.rolled,
            charged: self.charged,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: f64) -> Time {
        Time::from_nanos((1_800_000_000.0e9 + s * 1e9) as u64)
    }

    fn allot(units: f64, reset: f64, mark: Option<f64>) -> Allotment {
        Allotment { units, reset: at(reset), mark }
    }

    /// A burst spends an allotment at once; nothing refills before the
    /// reset; the reset voids what is left and the count starts again.
    #[test]
    fn a_burst_spends_it_at_once_and_nothing_refills_before_the_reset() {
        let mut a = Allot::new(allot(40.0, 60.0, None), at(0.1));
        let passed = (0..50).filter(|_| a.take(at(0.2), 1.0)).count();
        assert_eq!(passed, 40, "the whole allotment at once, not a second of it");
        assert!(!a.take(at(59.0), 1.0), "nothing refilled a minute on");
        assert_eq!(
            a.account(at(59.0)),
            Account { reset: at(60.0), spent: 40.0, left: 0.0, mark: 40.0, passed: false, charged: 40.0 }
        );
        a.replace(allot(5.0, 60.0, Some(40.0)), at(59.5));
        assert!(a.take(at(59.6), 3.0));
        // The reset voids the 2 left; what is admitted from then on counts for the next unit.
        assert!(!a.open(at(60.0), 1.0) && !a.take(at(60.0), 1.0));
        assert_eq!(
            a.account(at(60.1)),
            Account { reset: at(60.0), spent: 0.0, left: 0.0, mark: 43.0, passed: true, charged: 43.0 }
        );
        a.replace(allot(30.0, 120.0, Some(43.0)), at(60.2));
        assert!(a.take(at(60.3), 1.0));
        assert_eq!(
            a.account(at(60.3)),
            Account { reset: at(120.0), spent: 1.0, left: 29.0, mark: 44.0, passed: false, charged: 44.0 }
        );
    }

    /// A new allotment replaces the old one less what was admitted since
    /// the request that asked for it read its account.
    #[test]
    fn a_new_allotment_is_less_what_was_admitted_since_the_request() {
        let mut a = Allot::new(allot(10.0, 60.0, None), at(1.0));
        assert!(a.take(at(1.0), 4.0));
        let sent = a.account(at(1.0));
        assert_eq!((sent.spent, sent.left, sent.mark), (4.0, 6.0, 4.0));
        // While the request is under way, 3 more pass.
        assert!(a.take(at(1.1), 3.0));
        // The server counted 4 spent and grants 20 more: 3 of them are gone already.
        a.replace(allot(20.0, 60.0, Some(sent.mark)), at(1.2));
        assert_eq!(a.left(at(1.2)), 17.0);
        // An answer of an earlier unit changes nothing; one of a unit already over leaves nothing.
        a.replace(allot(99.0, 0.0, Some(7.0)), at(1.3));
        assert_eq!(a.left(at(1.3)), 17.0);
        a.replace(allot(99.0, 60.0, Some(7.0)), at(61.0));
        assert_eq!(a.left(at(61.0)), 0.0);
    }

    /// One request always passes an untouched allotment above 0, even one
    /// that costs more than is left; the next waits for a new allotment.
    #[test]
    fn one_request_passes_an_untouched_allotment() {
        let mut a = Allot::new(allot(0.5, 60.0, None), at(0.0));
        assert!(a.take(at(0.0), 3.0), "one request, whatever it costs");
        assert!(!a.take(at(0.0), 1.0));
        assert_eq!(a.account(at(0.0)).left, 0.0, "an overdraft reports nothing left");
        a.replace(allot(0.0, 60.0, Some(3.0)), at(1.0));
        assert!(!a.take(at(1.0), 1.0), "an allotment of 0 passes nothing");
        a.give_back(3.0);
        assert_eq!(a.account(at(1.0)).spent, 0.0);
    }
}
