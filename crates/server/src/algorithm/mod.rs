//! Capacity allocation algorithms: pure functions, no I/O, no clock.
//!
//! Each resource's clients are kept in a [`DemandIndex`]; an algorithm looks at
//! the index (which already holds the requester with its *new* wants and its
//! *current* has) and decides what the requester gets. The index answers the
//! aggregate questions the share algorithms need in O(log n), so one decision
//! never walks every client.
//!
//! Invariants every algorithm keeps (property-tested):
//! - a grant is never negative and never NaN;
//! - only NO_ALGORITHM grants more than the client wants;
//! - PROPORTIONAL_SHARE and FAIR_SHARE never grant more than
//!   `capacity - outstanding`, where outstanding is what the other clients
//!   hold, so leases already handed out stay honoured. STATIC's capacity is a
//!   per-client cap (Doorman's own test vectors grant 100 + 10 + 100 from a
//!   STATIC resource of 100), and NO_ALGORITHM ignores capacity.

mod index;

pub use index::{ClientSlot, DemandIndex};

pub use usher_core::config::resources::Kind;

/// What the requesting client asks for. The same values must already be in
/// the index under the client's slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// What it wants now (finite, >= 0).
    pub wants: f64,
    /// How many end clients it speaks for (>= 1).
    pub subclients: u64,
    /// What it holds now (its unexpired lease), counted in the index's total has.
    pub has: f64,
}

/// Decides the requester's grant.
pub fn decide(kind: Kind, capacity: f64, demand: &DemandIndex, req: &Request) -> f64 {
    let capacity = capacity.max(0.0);
    let grant = match kind {
        Kind::NoAlgorithm => return req.wants.max(0.0),
        Kind::Static => return req.wants.min(capacity).max(0.0),
        Kind::ProportionalShare => proportional_share(capacity, demand, req),
        Kind::FairShare => fair_share(capacity, demand, req),
    };
    let unused = capacity - (demand.total_has() - req.has);
    clamp(grant.min(req.wants).min(unused))
}

fn clamp(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 { 0.0 } else { x }
}

/// Max-min fairness run to its fixed point: every subclient gets the same
/// level `L`, except clients that want less than `L` per subclient, which get
/// what they want.
fn fair_share(capacity: f64, demand: &DemandIndex, req: &Request) -> f64 {
    if demand.total_wants() <= capacity {
        return req.wants;
    }
    let level = demand.water_level(capacity);
    if level.is_infinite() {
        // Only clients without subclients are short: nobody's share is
        // limited (and `inf * 0` would be NaN).
        return req.wants;
    }
    req.wants.min(level * req.subclients as f64)
}

/// Doorman's proportional share: an equal share per subclient, plus a part of
/// what under-asking clients leave, in proportion to how much the requester
/// wants above its equal share.
fn proportional_share(capacity: f64, demand: &DemandIndex, req: &Request) -> f64 {
    let count = demand.total_subclients() as f64;
    if count <= 0.0 {
        return 0.0;
    }
    let equal = capacity / count;
    let own_equal = equal * req.subclients as f64;
    if req.wants <= own_equal || demand.total_wants() <= capacity {
        return req.wants;
    }
    // Clients at or below their equal share leave `extra` unused; clients above
    // it want `wants_extra` more in total.
    let (low_wants, low_subs) = demand.sums_at_or_below(equal);
    let extra = equal * low_subs as f64 - low_wants;
    let high_wants = demand.total_wants() - low_wants;
    let high_subs = demand.total_subclients() - low_subs;
    let wants_extra = high_wants - equal * high_subs as f64;
    if wants_extra <= 0.0 {
        return own_equal;
    }
    own_equal + (req.wants - own_equal) / wants_extra * extra.max(0.0)
}

#[cfg(test)]
mod tests;
