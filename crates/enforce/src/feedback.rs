//! What an upstream's answer tells the keys that admitted its request: the
//! upstream's own account of its quota (its rate limit headers, read as
//! `config::quota` says), which each key keeps for the lease client to carry
//! up the tree; and a hold on the keys when that account says the quota is
//! spent (costs settled from the answer are `settle`'s). The sidecar's account stage (`pipeline`) and `crate::embed`'s
//! layer both call it, each with its own way of reading a header.

use std::time::Duration;

use http::StatusCode;

use super::pushback::Pushback;
use crate::metrics::{QUOTA_UNSEEN_AFTER, QuotaWatch};
use crate::resource::RouteResource;
use usher_core::clock::{Clock, Time};
use usher_core::config::doorman::PushbackConfig;
use usher_lease::quota::Observation;
use usher_limit::{LeaseTable, Plan};

/// Reads the upstream's account of its quota from an answer into the
/// plan's keys of the resources that follow it. Returns how long to hold
/// them when it says the quota is spent: a 429, a 403 with nothing
/// remaining (as GitHub answers), or an answer with nothing remaining of a
/// window that has yet to reset. `clock` is read once, and only for an
/// answer that reports a quota: one that does not costs no clock read.
pub fn observe_quota<'a>(
    resources: &[RouteResource],
    plan: &Plan,
    status: StatusCode,
    retry_after: Option<Duration>,
    header: &impl Fn(&str) -> Option<&'a [u8]>,
    clock: &Clock,
) -> Option<Duration> {
    let mut hold: Option<Duration> = None;
    let mut read: Option<Time> = None;
    let mut now = || *read.get_or_insert_with(|| clock.now());
    for r in resources {
        let Some(q) = &r.quota else { continue };
        let read = usher_core::config::quota::parse(q, header, || now().as_secs_f64());
        if let Some(w) = &r.quota_watch {
            watch(w, read.is_some(), status);
        }
        let Some((limit, remaining, secs)) = read else { continue };
        let at = now();
        let until = Duration::from_secs_f64(secs.min(86_400.0));
        let o =
            Observation { limit, remaining, reset: at.saturating_add(until), observed: at, continuous: q.continuous };
        r.metrics.observe_quota(&o, at);
        for (l, _) in r.keys_in(plan) {
            l.observe(o);
        }
        let spent = status == StatusCode::TOO_MANY_REQUESTS
            || (remaining < 1.0 && (status == StatusCode::FORBIDDEN || !q.continuous));
        // A continuous bucket's reset is when it is full again: it has
        // room long before, so it holds for its Retry-After, or a second.
        let until = match q.continuous {
            true => retry_after.unwrap_or(until.min(Duration::from_secs(1))),
            false => until,
        };
        if spent && !until.is_zero() {
            hold = Some(hold.map_or(until, |h| h.max(until)));
        }
    }
    hold
}

/// Counts whether an answer carried the quota a resource reads: a
/// successful answer without it towards the warning, any answer with it
/// as the end of one.
fn watch(w: &QuotaWatch, carried: bool, status: StatusCode) {
    if carried {
        if w.seen() {
            tracing::info!(route = %w.route, resource = %w.resource, preset = %w.preset, "the upstream's quota headers are back: its quota is followed again");
        }
    } else if status.is_success() && w.missed() {
        tracing::warn!(
            route = %w.route,
            resource = %w.resource,
            preset = %w.preset,
            headers = ?w.headers,
            "{QUOTA_UNSEEN_AFTER} successful answers in a row carried no quota these headers give: the upstream's quota is not followed; check `upstream_quota` (its preset is for another API?)"
        );
    }
}

/// Holds every key of `plan` for `hold` ([`observe_quota`] found the
/// upstream's quota spent until then): once, whatever the number of answers
/// in flight that say it, so no backoff factor stacks.
pub fn hold_spent(
    pushback: &Pushback,
    table: &LeaseTable,
    plan: &Plan,
    hold: Duration,
    cfg: &PushbackConfig,
    route: &str,
) {
    let now = table.clock().now();
    let cfg = PushbackConfig { multiplier: 1.0, ..*cfg };
    let keys = plan.items.iter().chain(plan.shadow.iter()).map(|(l, _)| &**l);
    pushback.on_response(keys, StatusCode::TOO_MANY_REQUESTS, Some(hold), now, &cfg, |id, c| {
        tracing::debug!(route, resource_id = %id, capacity = c, hold = ?hold, "upstream quota spent");
        table.set_capacity(id, c);
    });
}
