//! [`Accounts`]: what the account stage writes to (metrics, the access log,
//! pushback, the lease table), and how it records each outcome.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use crate::ops::access_log::{self, AccessLog};
use crate::pipeline::{Error, Failure, Meta};
use crate::route::Route;
use usher_enforce::feedback;
use usher_enforce::metrics::Metrics;
use usher_enforce::pushback::Pushback;
use usher_enforce::respond::{self, ProxyError};
use usher_enforce::settle::{self, BodySettle};
use usher_limit::admit::{self, Plan, Reason};
use usher_limit::{Kind, LeaseTable};

/// What the account stage writes to: shared by every snapshot.
pub struct Accounts {
    /// The proxy's metrics, by route and by resource.
    pub metrics: Arc<Metrics>,
    /// One JSON line per request, when the routes file names a file.
    pub access_log: Option<AccessLog>,
    /// This sidecar's client id, for the access log.
    pub client_id: String,
    /// Backing off from upstreams that answer 429 or 503.
    pub pushback: Arc<Pushback>,
    /// The limiters' keys, whose capacities pushback lowers; its clock times the access log.
    pub table: Arc<LeaseTable>,
    /// Why keys enforce 0, from the lease client once it runs: the 429 says.
    pub zero_reasons: std::sync::OnceLock<usher_lease::driver::ZeroReasons>,
}

impl Accounts {
    /// An upstream's answer (the one outcome of a request that reached it):
    /// admission metrics, pushback, costs settled from its head, the access
    /// log. Returns what reads its body for the costs the body settles.
    pub(super) fn answered<'a>(
        &self,
        meta: &Meta,
        status: StatusCode,
        retry_after: impl Fn() -> Option<Duration>,
        header: impl Fn(&str) -> Option<&'a [u8]>,
    ) -> Option<Box<BodySettle>> {
        let Some(route) = &meta.route else { return None };
        let (paced, waited) = meta.admitted.as_ref().map_or((false, Duration::ZERO), |a| (a.paced, a.waited));
        if paced { &route.metrics.paced } else { &route.metrics.admitted }.inc();
        if !route.resources.is_empty() {
            let secs = waited.as_secs_f64();
            for r in route.resources.iter() {
                if paced { &r.metrics.paced } else { &r.metrics.admitted }.inc();
                r.metrics.wait.observe(secs);
            }
        }
        let spent = match route.quotas {
            true => {
                let clock = self.table.clock();
                feedback::observe_quota(&route.resources, &meta.plan, status, retry_after(), &header, clock)
            }
            false => None,
        };
        match spent {
            // The upstream says its quota is spent until a known time: every
            // key of the plan is held until then.
            Some(hold) => {
                feedback::hold_spent(&self.pushback, &self.table, &meta.plan, hold, &route.pushback, &route.name)
            }
            None => self.observe_pushback(route, &meta.plan, status, retry_after),
        }
        let settle = match route.settles {
            true => settle::on_answer(&route.resources, &meta.plan, status, &header, meta.usage_injected),
            false => None,
        };
        let outcome = match &meta.shadow {
            Some(admit::Shadow { refused: Some(resource), .. }) => {
                // Forwarded all the same: counted as what enforcing would have done.
                self.metrics.requests.with_label_values(&[&route.name, "shadow_refused"]).inc();
                self.metrics.resource_requests.with_label_values(&[resource, "shadow_refused"]).inc();
                "shadow_refused"
            }
            _ if paced => "paced",
            _ => "admitted",
        };
        let waited = meta.shadow.as_ref().map_or(waited, |s| waited.max(s.would_wait));
        self.log(&route.name, meta, outcome, waited, status);
        settle
    }

    /// A request that got no upstream answer.
    pub(super) fn failed(&self, f: &mut Failure) {
        if let (Error::Proxy(ProxyError::ClientStalled { route, .. }), Some(r)) = (&mut f.error, &f.meta.route) {
            route.clone_from(&r.name);
        }
        if let Error::Refused(r) = &mut f.error {
            // While an upstream's Retry-After holds a key of the request, the 429 says when that ends.
            let now = self.table.clock().now();
            f.meta.hold = f.meta.plan.items.iter().filter_map(|(l, _)| self.pushback.hold_left(l.id(), now)).max();
            if r.reason == Reason::ZeroCapacity
                && let Some(zeros) = self.zero_reasons.get()
            {
                let zeros = zeros.read().expect("zero reasons poisoned");
                let note = zeros.get(&r.id);
                if let Some(n) = note {
                    n.refused(&r.id);
                }
                r.why = note.map(|n| n.why);
            }
        }
        let meta = &f.meta;
        match (&f.error, &meta.route) {
            (Error::Unserved(_), _) => {}
            (Error::Refused(r), Some(route)) => {
                route.metrics.refused.inc();
                match route.resources.iter().find(|res| res.metrics.name == r.resource) {
                    Some(res) => res.metrics.refused.inc(),
                    None => self.metrics.resource_requests.with_label_values(&[&r.resource, "refused"]).inc(),
                }
                self.log(&route.name, meta, "refused", r.waited, respond::refused_status(meta.grpc));
            }
            (Error::Proxy(e @ ProxyError::ClientStalled { .. }), Some(route)) => {
                route.metrics.client_timeout.inc();
                tracing::debug!(route = %route.name, error = %e, "client stalled");
                self.log(&route.name, meta, "client_timeout", Duration::ZERO, respond::status(e, meta.grpc));
            }
            (Error::Proxy(e), Some(route)) => {
                route.metrics.upstream_error.inc();
                tracing::debug!(route = %route.name, error = %e, "upstream error");
                self.log(&route.name, meta, "upstream_error", Duration::ZERO, respond::status(e, meta.grpc));
            }
            // Routing found no route (or no room for another key).
            (Error::Proxy(e), None) => {
                self.metrics.requests.with_label_values(&["_none", "no_route"]).inc();
                self.log("_none", meta, "no_route", Duration::ZERO, respond::status(e, meta.grpc));
            }
            (Error::Refused(_), None) => {}
        }
    }

    /// Feeds an upstream answer (its status and `Retry-After`) to the route's pushback state.
    fn observe_pushback(
        &self,
        route: &Route,
        plan: &Plan,
        status: StatusCode,
        retry_after: impl FnOnce() -> Option<Duration>,
    ) {
        // The common case (a success while nothing is backed off) costs one atomic load.
        if plan.is_empty() || self.pushback.is_quiet(status) {
            return;
        }
        let now = self.table.clock().now();
        // Read and written under the pushback lock: the lease client's write of a new lease cannot cross it.
        let keys = plan.items.iter().map(|(l, _)| &**l);
        self.pushback.on_response(keys, status, retry_after(), now, &route.pushback, |id, capacity| {
            tracing::debug!(route = %route.name, resource_id = %id, capacity, %status, "upstream pushback");
            self.table.set_capacity(id, capacity);
        });
    }

    /// Appends one line to the access log, if there is one.
    fn log(&self, route: &str, meta: &Meta, outcome: &str, waited: Duration, status: StatusCode) {
        let Some(log) = &self.access_log else { return };
        let now = self.table.clock().now();
        let total = now.since(meta.arrived);
        let upstream = matches!(outcome, "admitted" | "paced" | "upstream_error" | "client_timeout")
            .then(|| total.saturating_sub(waited));
        log.record(&access_log::Entry {
            time: now.as_secs_f64(),
            client: self.client_id.clone(),
            route: route.to_string(),
            resources: meta
                .plan
                .items
                .iter()
                .map(|(l, _)| access_log::KeyEntry {
                    resource: l.spec().name.clone(),
                    id: l.id().to_string(),
                    kind: match l.kind() {
                        Kind::Rate => "rate".into(),
                        Kind::Gauge => "gauge".into(),
                    },
                    capacity: l.capacity(),
                })
                .collect(),
            outcome: outcome.to_string(),
            wait_ms: waited.as_secs_f64() * 1e3,
            status: status.as_u16(),
            upstream_ms: upstream.map(|d| d.as_secs_f64() * 1e3),
            total_ms: total.as_secs_f64() * 1e3,
            listener: meta.route.as_ref().and_then(|r| r.listener.clone()),
        });
    }
}
