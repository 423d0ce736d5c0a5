//! The sidecar's Prometheus metrics, registered in an injected registry.
//! Labels are bounded: route and resource names from the routes file, and
//! upstream names (or, for passthrough, the origin authority).

use prometheus::core::Collector;
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use usher_limit::LeaseTable;

/// Every series of the sidecar's requests, resources and routes files.
pub struct Metrics {
    /// The registry every series here is registered in.
    pub registry: Registry,
    /// By route and outcome: admitted, paced, refused, upstream_error,
    /// client_timeout, no_route.
    pub requests: IntCounterVec,
    /// By resource and outcome: admitted, paced, refused.
    pub resource_requests: IntCounterVec,
    /// How long admitted requests waited for capacity, by resource.
    pub wait_seconds: HistogramVec,
    /// Requests in flight, by route.
    pub in_flight: IntGaugeVec,
    /// Time until the upstream's response head, by upstream.
    pub upstream_seconds: HistogramVec,
    /// Response bodies that failed after their headers were sent, by route.
    pub body_errors: IntCounterVec,
    /// Routes files applied.
    pub config_reloads: IntCounter,
    /// Routes files rejected.
    pub config_reload_errors: IntCounter,
    /// HTTP/1.1 requests the native path handed to the general one, by reason.
    pub http1_handoffs: IntCounterVec,
    /// Answers read for a settled cost, by route, resource and outcome.
    settles: IntCounterVec,
    /// Server-sent events passed over for their size, by route and resource.
    settle_skipped: IntCounterVec,
    /// Request bodies read for a route's costs or usage, by route and outcome.
    request_bodies: IntCounterVec,
    capacity: GaugeVec,
    demand: GaugeVec,
    /// The upstream's own account of its quota, by resource and field.
    upstream_quota: GaugeVec,
    resource_in_flight: IntGaugeVec,
    waiters: IntGaugeVec,
    keys: IntGaugeVec,
    /// Whether each route's answers carry its resources' quota headers, by
    /// (route, resource): kept across reloads while the preset is the same.
    quota_watches: std::sync::Mutex<Vec<std::sync::Arc<QuotaWatch>>>,
}

/// The buckets of `usher_proxy_wait_seconds`, in seconds.
const WAIT_BUCKETS: [f64; 13] = [0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

impl Metrics {
    /// Makes every series and registers it in `registry`. Panics if the
    /// registry already holds one of these names.
    pub fn new(registry: Registry) -> Self {
        let r = &registry;
        Metrics {
            // Requests, by route.
            requests: counters(r, "usher_proxy_requests_total", "Requests by route and outcome", &["route", "outcome"]),
            in_flight: register(
                r,
                IntGaugeVec::new(Opts::new("usher_proxy_in_flight", "Requests in flight by route"), &["route"]),
            ),
            body_errors: counters(
                r,
                "usher_proxy_response_body_errors_total",
                "Responses whose body failed after the headers were sent (upstream reset mid-body)",
                &["route"],
            ),
            // Admission, by resource.
            resource_requests: counters(
                r,
                "usher_proxy_resource_requests_total",
                "Admission decisions by resource and outcome",
                &["resource", "outcome"],
            ),
            wait_seconds: histograms(
                r,
                HistogramOpts::new("usher_proxy_wait_seconds", "Time admitted requests waited for capacity")
                    .buckets(WAIT_BUCKETS.to_vec()),
                &["resource"],
            ),
            // Upstreams.
            upstream_seconds: histograms(
                r,
                HistogramOpts::new("usher_proxy_upstream_seconds", "Time until upstream response headers"),
                &["upstream"],
            ),
            // The routes file, and the HTTP/1.1 engines.
            config_reloads: register(r, IntCounter::new("usher_proxy_config_reloads_total", "Routes files applied")),
            config_reload_errors: register(
                r,
                IntCounter::new("usher_proxy_config_reload_errors_total", "Routes files rejected"),
            ),
            http1_handoffs: counters(
                r,
                "usher_proxy_http1_handoffs_total",
                "HTTP/1.1 connections the native path handed to the general (hyper) path, by the request that made it",
                &["reason"],
            ),
            // Settled costs.
            settles: counters(
                r,
                "usher_proxy_settles_total",
                "Answers read for a cost settled from the response, by route, resource and outcome (settled, or why not)",
                &["route", "resource", "outcome"],
            ),
            settle_skipped: counters(
                r,
                "usher_proxy_settle_events_skipped_total",
                "Server-sent events of answers read for a settled cost that were passed over for their size (over 1 MiB), \
                 by route and resource",
                &["route", "resource"],
            ),
            request_bodies: counters(
                r,
                "usher_proxy_request_body_total",
                "Request bodies read for costs or for the usage asked of an LLM API, by route and outcome",
                &["route", "outcome"],
            ),
            // Per-resource gauges, refreshed at scrape time (`observe_table`).
            capacity: gauges(
                r,
                "usher_proxy_capacity",
                "Current capacity per resource, summed over its keys",
                &["resource"],
            ),
            demand: gauges(
                r,
                "usher_proxy_demand",
                "Smoothed arrivals per second per resource (admitted, paced and refused)",
                &["resource"],
            ),
            upstream_quota: gauges(
                r,
                "usher_proxy_upstream_quota",
                "The upstream's latest account of its quota, from its rate limit headers: limit, remaining, reset_seconds",
                &["resource", "field"],
            ),
            resource_in_flight: int_gauges(r, "usher_proxy_resource_in_flight", "Requests in flight per resource"),
            waiters: int_gauges(r, "usher_proxy_waiters", "Requests waiting for capacity per resource"),
            keys: int_gauges(r, "usher_proxy_resource_keys", "Distinct ids tracked per resource"),
            quota_watches: Default::default(),
            registry,
        }
    }

    /// One route's handles, looked up once per routes file rather than once
    /// per request (a label lookup hashes the labels under a lock).
    pub fn route(&self, route: &str) -> RouteMetrics {
        let outcome = |o: &str| self.requests.with_label_values(&[route, o]);
        RouteMetrics {
            admitted: outcome("admitted"),
            paced: outcome("paced"),
            refused: outcome("refused"),
            upstream_error: outcome("upstream_error"),
            client_timeout: outcome("client_timeout"),
            in_flight: self.in_flight.with_label_values(&[route]),
            body_errors: self.body_errors.with_label_values(&[route]),
        }
    }

    /// One resource's handles, as [`Metrics::route`].
    pub fn resource(&self, resource: &str) -> ResourceMetrics {
        let outcome = |o: &str| self.resource_requests.with_label_values(&[resource, o]);
        ResourceMetrics {
            name: resource.to_string(),
            admitted: outcome("admitted"),
            paced: outcome("paced"),
            refused: outcome("refused"),
            wait: self.wait_seconds.with_label_values(&[resource]),
            upstream_quota: self.upstream_quota.clone(),
            quota_series: std::sync::OnceLock::new(),
        }
    }

    /// The settle counters of one resource of one route.
    pub fn settle(&self, route: &str, resource: &str) -> SettleMetrics {
        let m = SettleMetrics {
            vec: self.settles.clone(),
            skipped_vec: self.settle_skipped.clone(),
            route: route.to_string(),
            resource: resource.to_string(),
            counts: Default::default(),
            warned: Default::default(),
            skipped: Default::default(),
        };
        // Shown from the start: a dashboard has a series to rate.
        m.counter(SettleOutcome::Settled);
        m
    }

    /// The watch on whether route `route`'s answers carry the headers
    /// resource `resource` reads (`quota`): the one made before for the same
    /// preset and headers (a reload keeps its count), or a new one.
    pub fn quota_watch(
        &self,
        route: &str,
        resource: &str,
        quota: &usher_core::config::quota::UpstreamQuota,
    ) -> std::sync::Arc<QuotaWatch> {
        let headers = match quota.ietf {
            true => "ratelimit, ratelimit-policy".to_string(),
            false => format!("{}, {}, {}", quota.limit, quota.remaining, quota.reset),
        };
        let mut all = self.quota_watches.lock().expect("quota watches poisoned");
        let same = |w: &QuotaWatch| w.route == route && w.resource == resource;
        if let Some(w) = all.iter().find(|w| same(w) && w.preset == quota.source && w.headers == headers) {
            return w.clone();
        }
        all.retain(|w| !same(w));
        let w = std::sync::Arc::new(QuotaWatch {
            route: route.to_string(),
            resource: resource.to_string(),
            preset: quota.source.clone(),
            headers,
            missed: Default::default(),
            unseen: Default::default(),
            warned: Default::default(),
        });
        all.push(w.clone());
        w
    }

    /// The (route, resource) pairs whose quota headers are missing from the
    /// route's answers now ([`QuotaWatch::unseen`]).
    pub fn quota_unseen(&self) -> Vec<std::sync::Arc<QuotaWatch>> {
        let all = self.quota_watches.lock().expect("quota watches poisoned");
        all.iter().filter(|w| w.unseen().is_some()).cloned().collect()
    }

    /// The request-body counters of a route that reads bodies, every
    /// outcome's series shown from the start.
    pub fn request_body(&self, route: &str) -> RequestBodyMetrics {
        RequestBodyMetrics(BodyOutcome::ALL.map(|o| self.request_bodies.with_label_values(&[route, o.label()])))
    }

    /// Refreshes the per-resource gauges from the LeaseTable (at scrape time).
    pub fn observe_table(&self, table: &LeaseTable) {
        let now = table.clock().now();
        for g in [&self.capacity, &self.demand] {
            g.reset();
        }
        for g in [&self.resource_in_flight, &self.waiters, &self.keys] {
            g.reset();
        }
        for (name, l) in table.limiters() {
            let s = l.demand().sample(now);
            self.capacity.with_label_values(&[&name]).add(l.capacity());
            self.demand.with_label_values(&[&name]).add(s.rate);
            self.resource_in_flight.with_label_values(&[&name]).add(s.in_flight);
            self.waiters.with_label_values(&[&name]).add(s.waiters);
            self.keys.with_label_values(&[&name]).inc();
        }
    }
}

/// Registers the series `made`; panics when it cannot be made or its name is taken.
fn register<C: Collector + Clone + 'static>(registry: &Registry, made: prometheus::Result<C>) -> C {
    let c = made.expect("metric");
    registry.register(Box::new(c.clone())).expect("metric names are unique");
    c
}

fn counters(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(registry, IntCounterVec::new(Opts::new(name, help), labels))
}

fn histograms(registry: &Registry, opts: HistogramOpts, labels: &[&str]) -> HistogramVec {
    register(registry, HistogramVec::new(opts, labels))
}

fn gauges(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    register(registry, GaugeVec::new(Opts::new(name, help), labels))
}

/// Gauges of whole numbers, by resource.
fn int_gauges(registry: &Registry, name: &str, help: &str) -> IntGaugeVec {
    register(registry, IntGaugeVec::new(Opts::new(name, help), &["resource"]))
}

/// A route's request counters by outcome, its in-flight gauge and its body-error counter.
#[derive(Clone)]
pub struct RouteMetrics {
    /// Requests admitted at once.
    pub admitted: IntCounter,
    /// Requests admitted after waiting for capacity.
    pub paced: IntCounter,
    /// Requests refused.
    pub refused: IntCounter,
    /// Requests that failed after routing (mostly the upstream's failures).
    pub upstream_error: IntCounter,
    /// The app stopped sending its request body (a 408).
    pub client_timeout: IntCounter,
    /// Requests in flight.
    pub in_flight: IntGauge,
    /// Response bodies that failed after their headers were sent.
    pub body_errors: IntCounter,
}

/// A resource's admission counters by outcome and its wait histogram.
#[derive(Clone)]
pub struct ResourceMetrics {
    /// The resource's name.
    pub name: String,
    /// Requests admitted at once.
    pub admitted: IntCounter,
    /// Requests admitted after waiting for capacity.
    pub paced: IntCounter,
    /// Requests refused.
    pub refused: IntCounter,
    /// How long admitted requests waited.
    pub wait: Histogram,
    upstream_quota: GaugeVec,
    /// The `limit`, `remaining` and `reset_seconds` series, made at the
    /// first answer that carried the upstream's quota (never for a resource
    /// without `upstream_quota`).
    quota_series: std::sync::OnceLock<[prometheus::Gauge; 3]>,
}

impl ResourceMetrics {
    /// Shows the upstream's latest account of its quota (limit, remaining,
    /// seconds to its reset) beside the lease.
    pub fn observe_quota(&self, o: &usher_lease::quota::Observation, now: usher_core::clock::Time) {
        let [limit, remaining, reset] = self.quota_series.get_or_init(|| {
            ["limit", "remaining", "reset_seconds"].map(|f| self.upstream_quota.with_label_values(&[&self.name, f]))
        });
        limit.set(o.limit);
        remaining.set(o.remaining);
        reset.set(o.reset.since(now).as_secs_f64());
    }
}

/// What became of a request body a route reads (for its costs, or to ask
/// for usage): the `outcome` of `usher_proxy_request_body_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyOutcome {
    /// A JSON body, read and forwarded as it came.
    Read,
    /// A JSON body to which `stream_options.include_usage` was added.
    UsageAdded,
    /// A body that is not one JSON document: its costs fall back.
    NotJson,
    /// A body over the most that is read: forwarded as it came, its costs fall back.
    TooLarge,
    /// No body: its costs fall back.
    Empty,
}

impl BodyOutcome {
    /// Every outcome, in the order of their counters.
    const ALL: [BodyOutcome; 5] =
        [BodyOutcome::Read, BodyOutcome::UsageAdded, BodyOutcome::NotJson, BodyOutcome::TooLarge, BodyOutcome::Empty];

    /// The `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            BodyOutcome::Read => "read",
            BodyOutcome::UsageAdded => "usage_added",
            BodyOutcome::NotJson => "not_json",
            BodyOutcome::TooLarge => "too_large",
            BodyOutcome::Empty => "empty",
        }
    }
}

/// One route's request-body counters, by outcome.
#[derive(Clone)]
pub struct RequestBodyMetrics([IntCounter; 5]);

impl RequestBodyMetrics {
    /// Counts one request body's outcome.
    pub fn count(&self, o: BodyOutcome) {
        self.0[o as usize].inc();
    }
}

/// What became of an answer read for a settled cost: settled, or why not
/// (the admission's charge then stands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleOutcome {
    /// The real cost was read and the difference charged or given back.
    Settled,
    /// The header is absent, or the body (or its events) holds no number
    /// of at least 0 at the JSON path, or no token counts.
    Missing,
    /// The body is not JSON.
    NotJson,
    /// The body is over the most that is read (`settle::MAX_JSON_BODY`), or
    /// the events that would carry the cost were (`settle::MAX_EVENT`).
    TooLarge,
    /// The body is compressed (`content-encoding`).
    Encoded,
    /// The body is empty (a HEAD request, a 204).
    Empty,
    /// The body did not end: the upstream cut it (or the app left a body
    /// that is not a stream of events).
    Incomplete,
    /// The app left while a stream of events was relayed: usher read on,
    /// and settled the cost if the stream ended in time.
    ClientGone,
    /// An answer other than 2xx that did not carry the cost.
    Status,
}

impl SettleOutcome {
    /// How many outcomes there are.
    const COUNT: usize = 9;

    /// The `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            SettleOutcome::Settled => "settled",
            SettleOutcome::Missing => "missing",
            SettleOutcome::NotJson => "not_json",
            SettleOutcome::TooLarge => "too_large",
            SettleOutcome::Encoded => "encoded",
            SettleOutcome::Empty => "empty",
            SettleOutcome::Incomplete => "incomplete",
            SettleOutcome::ClientGone => "client_gone",
            SettleOutcome::Status => "status",
        }
    }
}

/// One route resource's settle counters, each series made on its first
/// use, and whether each outcome was warned about yet.
pub struct SettleMetrics {
    vec: IntCounterVec,
    skipped_vec: IntCounterVec,
    /// The route's name.
    pub route: String,
    /// The resource's name.
    pub resource: String,
    counts: [std::sync::OnceLock<IntCounter>; SettleOutcome::COUNT],
    warned: [std::sync::atomic::AtomicBool; SettleOutcome::COUNT],
    skipped: std::sync::OnceLock<IntCounter>,
}

impl SettleMetrics {
    fn counter(&self, o: SettleOutcome) -> &IntCounter {
        self.counts[o as usize].get_or_init(|| self.vec.with_label_values(&[&self.route, &self.resource, o.label()]))
    }

    /// Counts `n` server-sent events passed over for their size.
    pub fn skipped(&self, n: u64) {
        self.skipped.get_or_init(|| self.skipped_vec.with_label_values(&[&self.route, &self.resource])).inc_by(n);
    }

    /// Counts one answer's outcome; true the first time it is not `Settled`
    /// (the caller warns once).
    pub fn count(&self, o: SettleOutcome) -> bool {
        self.counter(o).inc();
        o != SettleOutcome::Settled && {
            let warned = &self.warned[o as usize];
            !warned.load(std::sync::atomic::Ordering::Relaxed)
                && !warned.swap(true, std::sync::atomic::Ordering::Relaxed)
        }
    }
}

/// How many successful answers in a row must lack the quota headers a
/// resource reads before usher says they are missing.
pub const QUOTA_UNSEEN_AFTER: u32 = 10;

/// Whether a route's answers carry the quota headers one of its resources
/// reads (`upstream_quota`). A preset that names headers the upstream never
/// sends (`github` on an OpenAI route) leaves the quota unfollowed without a
/// word; this makes it said: after [`QUOTA_UNSEEN_AFTER`] successful answers
/// in a row without them, until an answer carries them again.
pub struct QuotaWatch {
    /// The route's name.
    pub route: String,
    /// The resource's name.
    pub resource: String,
    /// The preset's name, or `headers` for headers named in the file.
    pub preset: String,
    /// The headers read, lower-case, comma-separated.
    pub headers: String,
    /// Successful answers in a row without them (saturating).
    missed: std::sync::atomic::AtomicU32,
    /// Set once `QUOTA_UNSEEN_AFTER` answers in a row lacked them.
    unseen: std::sync::atomic::AtomicBool,
    /// The warning was logged (once per route and resource).
    warned: std::sync::atomic::AtomicBool,
}

impl QuotaWatch {
    /// An answer carried the quota: clears the count. True when the headers
    /// had been missing until now (the caller says they are back).
    pub fn seen(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if self.missed.load(Relaxed) != 0 {
            self.missed.store(0, Relaxed);
        }
        self.unseen.load(Relaxed) && self.unseen.swap(false, Relaxed)
    }

    /// A successful answer without the quota. True the first time the
    /// headers count as missing (the caller warns, once).
    pub fn missed(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let n = self.missed.fetch_add(1, Relaxed).saturating_add(1);
        if n == u32::MAX {
            self.missed.store(u32::MAX - 1, Relaxed);
        }
        n >= QUOTA_UNSEEN_AFTER
            && !self.unseen.load(Relaxed)
            && !self.unseen.swap(true, Relaxed)
            && !self.warned.swap(true, Relaxed)
    }

    /// How many successful answers in a row lacked the headers, when that
    /// is enough to say they are missing.
    pub fn unseen(&self) -> Option<u32> {
        use std::sync::atomic::Ordering::Relaxed;
        self.unseen.load(Relaxed).then(|| self.missed.load(Relaxed))
    }
}
