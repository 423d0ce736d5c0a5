//! A calendar quota's unit, counted in units: `window: calendar` at a root.
//!
//! The quota renews whole at each UTC boundary of its unit (a minute, an
//! hour, a day). Within a unit the root shares it as **allotments**: units a
//! client may spend from now until the reset, at once if it likes. So a
//! fleet that bursts when a unit begins finds the whole quota there, not a
//! rate spread over the unit.
//!
//! What the root counts of the current unit:
//!
//! - a client that reports its account (usher clients, for keys whose last
//!   answer carried an allotment): the units it says it spent, and its
//!   outstanding allotment (kept by the store, as the client's `has`),
//!   assumed unspent until it reports otherwise;
//! - a client that reports nothing (a Doorman client, a lower server): what
//!   its lease's rate allows, as time passes;
//! - clients no longer tracked (released, expired, restarted under the same
//!   id: it reports less spent than before, or no account at all): what
//!   they had committed, spent and outstanding, until the boundary;
//! - a root that did not see the unit begin (a restart, a new master) takes
//!   the larger of what its clients report and the fleet having spent
//!   evenly until then.
//!
//! The share algorithms are scale-free, so the store runs them in units:
//! the capacity is the budget less everything spent, a client's wants its
//! wanted rate times the time left, its has its outstanding allotment
//! ([`Calendar::capacity_units`]). The lease's rate is the allotment over the
//! time to the reset plus a lag ([`Calendar::per_second`]), which is what a
//! Doorman client enforces.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use usher_core::clock::Time;
use usher_lease::quota::Observation;

/// How much longer than the time to the reset an allotment's rate is spread
/// over: a quarter of that time, at most this much. A lease reaches its
/// client a moment after it is decided.
const LAG: Duration = Duration::from_millis(500);
/// Resets read from different clocks and wire rounding (milliseconds) differ
/// by less than this.
const SKEW: Duration = Duration::from_millis(500);

/// A client's account of its unit (protocol field 111): the reset of the
/// unit it counts in, what it spent in that unit, and what is left of its
/// allotment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Account {
    /// The reset its last allotment named.
    pub reset: Time,
    /// Units it admitted in the unit.
    pub spent: f64,
    /// What is left of its allotment.
    pub left: f64,
    /// `reset` has passed with no allotment of the next unit yet: `spent`
    /// counts from it, in the next unit.
    pub passed: bool,
    /// Units it ever charged, a running total that only grows while it
    /// runs (absent from an older client): less than before means it
    /// restarted, where `spent` also falls when a cost settles below its
    /// charge.
    pub charged: Option<f64>,
}

/// What the root knows of one client in the current unit.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Party {
    /// It reports its account: what it said it spent, and charged in all.
    Reports { spent: f64, charged: Option<f64> },
    /// It reports none: its lease's rate is counted as it runs.
    Rate { rate: f64 },
}

/// The current unit of a `window: calendar` resource at a root.
#[derive(Debug, Clone, PartialEq)]
pub struct Calendar {
    unit: Duration,
    /// The current unit's start.
    start: Time,
    /// What the leases of clients that report no account allowed since
    /// `start`, counted at `rates` per second.
    accrued: f64,
    /// The rates of those leases, together.
    rates: f64,
    /// When `accrued` was last brought up to date.
    at: Time,
    /// A root that did not see the unit begin: the fleet taken to have spent
    /// evenly until then.
    assumed: f64,
    /// What clients no longer tracked had committed (spent and outstanding).
    gone: f64,
    /// What each client is counted by.
    parties: HashMap<Arc<str>, Party>,
    /// What the clients that report said they spent, together.
    reported: f64,
    /// Clients known when the unit began that have not asked in it yet:
    /// until they have, no client gets more than its equal share.
    unheard: usize,
}

impl Calendar {
    /// A calendar quota first seen at `now`, of `budget` units per `unit`.
    /// `fresh`: nobody handed out any of it before (a new deployment).
    /// Otherwise what the fleet spent of the current unit before is not
    /// known here (a restart, a new master): at least an even spending is
    /// counted, so that a restart never hands out a unit's budget twice.
    pub fn new(unit: Duration, budget: f64, now: Time, fresh: bool) -> Self {
        let start = unit_start(now, unit);
        let assumed = match fresh {
            true => 0.0,
            false => budget * now.since(start).as_secs_f64() / unit.as_secs_f64(),
        };
        Calendar {
            unit,
            start,
            accrued: 0.0,
            rates: 0.0,
            at: now,
            assumed,
            gone: 0.0,
            parties: HashMap::new(),
            reported: 0.0,
            unheard: 0,
        }
    }

    /// The unit's length.
    pub fn unit(&self) -> Duration {
        self.unit
    }

    /// The current unit's start.
    pub fn start(&self) -> Time {
        self.start
    }

    /// The next boundary.
    pub fn reset(&self) -> Time {
        self.start.saturating_add(self.unit)
    }

    /// Brings the count up to `now`. At a boundary everything starts again
    /// from 0, but for what rate leases allowed since it: returns the reset
    /// that passed, so the store can void the allotments it bounded.
    pub fn advance(&mut self, now: Time) -> Option<Time> {
        if now <= self.at {
            return None;
        }
        let start = unit_start(now, self.unit);
        let passed = (start > self.start).then(|| self.reset());
        if passed.is_some() {
            // (What was allowed before the boundary counted in the old unit.)
            self.accrued = self.rates * now.since(start.max(self.at)).as_secs_f64();
            self.start = start;
            self.assumed = 0.0;
            self.gone = 0.0;
            self.reported = 0.0;
            self.parties.retain(|_, p| matches!(p, Party::Rate { .. }));
        } else {
            self.accrued += self.rates * now.since(self.at).as_secs_f64();
        }
        self.at = now;
        passed
    }

    /// Clients known at the boundary that have not asked since, as the store
    /// counts them ([`Calendar::began`], [`Calendar::heard`]).
    pub fn unheard(&self) -> usize {
        self.unheard
    }

    /// A unit began with `clients` clients, none heard from in it yet.
    pub fn began(&mut self, clients: usize) {
        self.unheard = clients;
    }

    /// A client known at the boundary asked (or left) for the first time in this unit.
    pub fn heard(&mut self) {
        self.unheard = self.unheard.saturating_sub(1);
    }

    /// What is counted as spent: by the clients that report, by the rate
    /// leases, and by clients no longer tracked.
    fn spent(&self) -> f64 {
        self.accrued + self.reported + self.gone
    }

    /// What to take off the budget before the algorithm takes off the
    /// outstanding allotments (`outstanding`, their sum): what is spent, or
    /// if more, what a root that did not see the unit begin assumes less
    /// what is outstanding.
    fn taken(&self, outstanding: f64) -> f64 {
        self.assumed.max(self.spent() + outstanding) - outstanding
    }

    /// The units to share now, out of `budget`: what is not spent (the
    /// outstanding allotments are the clients' `has`).
    pub fn capacity_units(&self, budget: f64, outstanding: f64) -> f64 {
        (budget - self.taken(outstanding)).max(0.0)
    }

    /// Units per second of an allotment at `now`: one over the time to the
    /// reset plus a lag (a quarter of that time, at most half a second).
    pub fn per_second(&self, now: Time) -> f64 {
        let to_reset = self.reset().since(now).as_secs_f64();
        let lag = (to_reset / 4.0).min(LAG.as_secs_f64());
        1.0 / (to_reset + lag).max(0.001)
    }

    /// The same, for the unit that ended at `reset` (its clients' last wants
    /// were reckoned with it).
    pub fn per_second_before(reset: Time, at: Time) -> f64 {
        let to_reset = reset.since(at).as_secs_f64();
        let lag = (to_reset / 4.0).min(LAG.as_secs_f64());
        1.0 / (to_reset + lag).max(0.001)
    }

    /// An account as it counts in the current unit: one of this unit, or
    /// one that counts from a reset that has passed (from this unit's start,
    /// or from earlier: more than this unit's spending, never less), as it
    /// is; one of the unit that ended (read before the reset, sent after
    /// it) as nothing spent and nothing left of this one; one of a later
    /// unit (a clock ahead of this one) not at all.
    pub fn in_unit(&self, a: Account) -> Option<Account> {
        let near = |t: Time| t.since(a.reset).max(a.reset.since(t)) <= SKEW;
        match a.passed {
            true => Some(a),
            false if near(self.reset()) => Some(a),
            false if a.reset <= self.start.saturating_add(SKEW) => Some(Account { spent: 0.0, left: 0.0, ..a }),
            false => None,
        }
    }

    /// Takes `client`'s report before its request is decided, given what it
    /// holds outstanding (`has`); returns what it holds now. A report moves
    /// what the client spent since its last one from its outstanding
    /// allotment to its spent, and never counts it holding less than it says
    /// is left. A client that reports less spent than before, or that stops
    /// reporting, has restarted under the same id: what it had committed
    /// stays counted until the boundary, and it holds nothing.
    pub fn report(&mut self, client: &str, account: Option<Account>, has: f64) -> f64 {
        let party = self.parties.get(client).copied();
        let account = account.and_then(|a| self.in_unit(a));
        match (party, account) {
            (Some(Party::Reports { spent, charged }), Some(a)) if restarted(spent, charged, &a) => {
                self.gone += spent + has;
                self.reported += a.spent - spent;
                self.set(client, Party::Reports { spent: a.spent, charged: a.charged });
                a.left
            }
            (Some(Party::Reports { spent, .. }), Some(a)) => {
                // (Less spent than before: costs settled below their
                // charges, and what they gave back is its again.)
                self.reported += a.spent - spent;
                self.set(client, Party::Reports { spent: a.spent, charged: a.charged });
                (has - (a.spent - spent)).max(a.left).max(0.0)
            }
            (rate, Some(a)) => {
                // Its first report: what its lease's rate allowed so far stays counted.
                if let Some(Party::Rate { rate }) = rate {
                    self.rates -= rate;
                }
                self.reported += a.spent;
                self.set(client, Party::Reports { spent: a.spent, charged: a.charged });
                (has - a.spent).max(a.left).max(0.0)
            }
            (Some(Party::Reports { spent, .. }), None) => {
                self.gone += spent + has;
                self.reported -= spent;
                self.set(client, Party::Rate { rate: 0.0 });
                0.0
            }
            (_, None) => has,
        }
    }

    /// Records the rate of `client`'s new lease, if it reports no account.
    pub fn leased(&mut self, client: &str, rate: f64) {
        match self.parties.get(client).copied() {
            Some(Party::Reports { .. }) => {}
            Some(Party::Rate { rate: old }) => {
                self.rates += rate - old;
                self.set(client, Party::Rate { rate });
            }
            None => {
                self.rates += rate;
                self.set(client, Party::Rate { rate });
            }
        }
    }

    /// `client` is no longer tracked (released, expired): what it committed
    /// (what it spent, and `has` outstanding) stays counted until the boundary.
    pub fn forget(&mut self, client: &str, has: f64) {
        match self.parties.remove(client) {
            Some(Party::Reports { spent, .. }) => {
                self.reported -= spent;
                self.gone += spent + has;
            }
            Some(Party::Rate { rate }) => {
                self.rates -= rate;
                self.gone += has;
            }
            None => self.gone += has,
        }
    }

    fn set(&mut self, client: &str, party: Party) {
        match self.parties.get_mut(client) {
            Some(p) => *p = party,
            None => {
                self.parties.insert(Arc::from(client), party);
            }
        }
    }

    /// Whether the current unit still counts anything at `now`: a resource
    /// with no client left keeps it until the boundary, or a client that
    /// comes back would find the unit's budget whole again.
    pub fn counts(&self, now: Time) -> bool {
        now < self.reset() && (self.spent() > 0.0 || self.assumed > 0.0)
    }

    /// The capacity shared now as a rate, for status pages and the clients'
    /// view: what is not spent of `budget` (`outstanding` allotments
    /// included), over the time to the reset plus the lag.
    pub fn capacity(&self, now: Time, budget: f64, outstanding: f64) -> f64 {
        (budget - self.taken(outstanding)).max(0.0) * self.per_second(now)
    }

    /// The quota as an upstream would report it: for status pages and the
    /// clients' view. What `remaining` counts is what nobody spent yet.
    pub fn observation(&self, now: Time, budget: f64) -> Observation {
        Observation {
            limit: budget,
            remaining: (budget - self.assumed.max(self.spent())).max(0.0),
            reset: self.reset(),
            observed: now,
            continuous: false,
        }
    }
}

/// Whether a client that reported `spent` (and `charged` in all) before has
/// restarted, given its new account: its running total of charges fell, or,
/// from a client that sends none, what it spent did.
fn restarted(spent: f64, charged: Option<f64>, a: &Account) -> bool {
    match (charged, a.charged) {
        (Some(before), Some(now)) => now + 1e-9 < before,
        _ => a.spent + 1e-9 < spent,
    }
}

/// The start of the UTC unit `now` falls in (units divide the day, and the
/// epoch began at midnight UTC).
fn unit_start(now: Time, unit: Duration) -> Time {
    let unit = unit.as_nanos().max(1) as u64;
    Time::from_nanos(now.as_nanos() / unit * unit)
}

#[cfg(test)]
mod tests;
