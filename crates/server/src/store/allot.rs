//! The store's side of a calendar quota (`window: calendar` at a root, see
//! `crate::calendar`): its leases are allotments, units a client may spend
//! until the unit's reset.
//!
//! Such a resource's index, leases and algorithm run in units of the
//! current unit, not units per second: a request's wants (per second) are
//! taken over the time to the reset, its `has` is its outstanding
//! allotment, and the capacity is the budget less what is spent
//! ([`Resource::allot`]). The answer carries the allotment, and as its lease
//! the same over the time to the reset, which is what a client that knows
//! nothing of allotments (a Doorman client, a lower server) enforces.
//!
//! At a boundary every allotment is void: what clients hold goes to 0 and
//! their wants are taken over the new unit. Until every client known then has
//! asked (for [`OPENING`] at most), each gets its equal share of what is
//! left, whatever it wants: a client that asks before its app's burst has
//! been measured gets its part of the unit all the same, and the first to ask
//! cannot take the others' parts.

use std::time::Duration;

use super::{ClientLease, Decision, Grant, LeaseRequest, Predecessor, Requester, Resource, Role, client_key, safe_for};
use crate::calendar::Calendar;
use usher_core::clock::Time;

/// How long a unit's opening lasts at most (see the module docs): its
/// clients ask within a few hundred milliseconds of the boundary.
pub(super) const OPENING: Duration = Duration::from_secs(2);

impl Resource {
    /// Decides a calendar quota's request of client `id`: takes its account,
    /// decides in units, and answers with the allotment and its rate.
    pub(super) fn allot(&mut self, id: &str, req: &LeaseRequest, now: Time, d: Decision, role: Role) -> Grant {
        let (client, _) = client_key(id, req);
        let c = self.calendar.as_mut().expect("a calendar resource");
        let (per_second, start) = (c.per_second(now), c.start());
        let prior = self.clients.get(client).map(|l| (l.has, l.last_request < start));
        let has = prior.map_or(0.0, |(h, _)| h);
        let held = c.report(client, req.account, has);
        if held != has {
            self.hold(client, held);
        }
        let units = LeaseRequest {
            wants: req.wants / per_second,
            reported_has: match req.account {
                Some(_) => Some(held),
                None => req.reported_has.map(|h| h / per_second),
            },
            requester: scaled(&req.requester, 1.0 / per_second),
            ..req.clone()
        };
        let grant = self.decide_lease(id, &units, now, d, role);
        let c = self.calendar.as_mut().expect("a calendar resource");
        if prior.is_some_and(|(_, unheard)| unheard) {
            c.heard();
        }
        if req.account.is_none() {
            c.leased(client, grant.capacity * per_second);
        }
        self.per_second(grant, per_second, &req.requester)
    }

    /// An answer decided in units, as the wire carries it: the allotment,
    /// and as the lease its rate over the time to the reset.
    fn per_second(&self, mut g: Grant, per_second: f64, requester: &Requester) -> Grant {
        g.allotment = Some(g.capacity);
        g.capacity *= per_second;
        g.spare *= per_second;
        g.resource_capacity = g.resource_capacity.map(|c| c * per_second);
        if g.safe_capacity >= 0.0 {
            // A configured safe capacity is per second already.
            g.safe_capacity = match self.configured_safe_capacity() {
                Some(s) if s >= 0.0 => safe_for(requester, s, g.capacity),
                _ => g.safe_capacity * per_second,
            };
        }
        g
    }

    /// Sets what `client` holds outstanding, after its report.
    fn hold(&mut self, client: &str, held: f64) {
        let Some(l) = self.clients.get_mut(client) else { return };
        l.has = held;
        if matches!(l.requester, Requester::Client { .. }) {
            l.granted = held;
        }
        l.spare = l.spare.min(held);
        self.index.upsert(l.slot, l.wants, l.subclients, held);
        // Filed again from the leases when next needed.
        self.by_priority = None;
    }

    /// Units per second of an allotment now: 1 unless the resource is a
    /// calendar quota's, whose leases count units of the current unit.
    pub(super) fn rate_factor(&self, now: Time) -> f64 {
        self.calendar.as_ref().map_or(1.0, |c| c.per_second(now))
    }

    /// The capacity the algorithms share now: a calendar unit's units (the
    /// smaller of it and an upstream's quota, taken over the same time),
    /// else [`Resource::capacity`].
    pub(super) fn shared_capacity(&self, now: Time, role: Role) -> Option<f64> {
        let Some(c) = &self.calendar else { return self.capacity(now, role) };
        let outstanding = self.index.total_has();
        let units = c.capacity_units(self.calendar_budget(), outstanding);
        let per_second = c.per_second(now);
        let upstream =
            self.quota.as_ref().and_then(|q| q.capacity(now, self.template.capacity, outstanding * per_second));
        Some(upstream.map_or(units, |u| units.min(u / per_second)))
    }

    /// Brings a calendar window's count up to `now` (at a root, where the
    /// resource's own template applies); at a boundary, voids the
    /// allotments of the unit that ended.
    pub(super) fn follow_calendar(&mut self, now: Time, role: Role) {
        let unit = match role {
            Role::Root => self.template.calendar,
            Role::Intermediate { .. } => None,
        };
        let before = self.rate_factor(now);
        match (unit, &mut self.calendar) {
            (Some(unit), Some(c)) if c.unit() == unit => {
                if let Some(passed) = c.advance(now) {
                    self.new_unit(passed, now);
                }
            }
            (Some(unit), _) => {
                let fresh = self.predecessor == Predecessor::NoneOutstanding;
                let c = Calendar::new(unit, self.calendar_budget(), now, fresh);
                let after = c.per_second(now);
                self.calendar = Some(Box::new(c));
                // (Leases granted before, per second or in another unit's units.)
                self.rescale(|_| before / after, before / after);
            }
            (None, Some(_)) => {
                self.calendar = None;
                self.rescale(|_| before, before);
            }
            (None, None) => {}
        }
    }

    /// A new unit began when `passed` did: nobody holds anything of it yet,
    /// and every client's wants are taken over the new unit.
    fn new_unit(&mut self, passed: Time, now: Time) {
        let per_second = self.rate_factor(now);
        self.rescale(|l| Calendar::per_second_before(passed, l.last_request) / per_second, 0.0);
        let clients = self.clients.len();
        if let Some(c) = &mut self.calendar {
            c.began(clients);
        }
    }

    /// Multiplies every client's wants by `wants(lease)` and what it holds by `has`.
    fn rescale(&mut self, wants: impl Fn(&ClientLease) -> f64, has: f64) {
        for l in self.clients.values_mut() {
            let f = wants(l);
            l.wants *= f;
            l.requester = scaled(&l.requester, f);
            l.has *= has;
            l.granted *= has;
            l.spare *= has;
            self.index.upsert(l.slot, l.wants, l.subclients, l.has);
        }
        self.by_priority = None;
    }

    /// Whether a unit's opening is under way at `now` (see the module docs).
    pub(super) fn opening(&self, now: Time) -> bool {
        self.calendar.as_ref().is_some_and(|c| c.unheard() > 0 && now.since(c.start()) < OPENING)
    }

    /// A client's grant during a unit's opening: its equal share of `cap`,
    /// within what the others leave.
    pub(super) fn opening_share(&self, cap: f64, subclients: u64, has: f64) -> f64 {
        let equal = cap * subclients as f64 / self.index.total_subclients().max(1) as f64;
        let unused = cap - (self.index.total_has() - has);
        equal.min(unused).max(0.0)
    }

    /// `client` leaves: what it committed stays counted in its unit.
    pub(super) fn forget_in_unit(&mut self, client: &str, l: &ClientLease) {
        if let Some(c) = &mut self.calendar {
            c.forget(client, l.has);
            if l.last_request < c.start() {
                c.heard();
            }
        }
    }
}

/// A lower server's bands with their wants multiplied by `f`.
fn scaled(requester: &Requester, f: f64) -> Requester {
    match requester {
        Requester::Client { priority } => Requester::Client { priority: *priority },
        Requester::Server { bands } => {
            Requester::Server { bands: bands.iter().map(|b| super::Band { wants: b.wants * f, ..*b }).collect() }
        }
    }
}

#[cfg(test)]
mod tests;
