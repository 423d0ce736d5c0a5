//! The sidecar's Prometheus metrics, registered in an injected registry.
//! Labels are bounded: route and resource names from the routes file, and
//! upstream names (or, for passthrough, the origin authority).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use usher_limit::LeaseTable;

pub struct Metrics {
    pub registry: Registry,
    /// By route and outcome: admitted, paced, refused, upstream_error,
    /// client_timeout, no_route.
    pub requests: IntCounterVec,
    /// By resource and outcome: admitted, paced, refused.
    pub resource_requests: IntCounterVec,
    pub wait_seconds: HistogramVec,
    pub in_flight: IntGaugeVec,
    pub upstream_seconds: HistogramVec,
    /// Response bodies that failed after their headers were sent, by route.
    pub body_errors: IntCounterVec,
    pub config_reloads: IntCounter,
    pub config_reload_errors: IntCounter,
    /// HTTP/1.1 requests the native path handed to the general one, by reason.
    pub http1_handoffs: IntCounterVec,
    /// Answers read for a settled cost, by route, resource and outcome.
    settles: IntCounterVec,
    capacity: prometheus::GaugeVec,
    demand: prometheus::GaugeVec,
    /// The upstream's own account of its quota, by resource and field.
    upstream_quota: prometheus::GaugeVec,
    resource_in_flight: IntGaugeVec,
    waiters: IntGaugeVec,
    keys: IntGaugeVec,
}

impl Metrics {
    pub fn new(registry: Registry) -> Self {
        let requests = IntCounterVec::new(
            Opts::new("usher_proxy_requests_total", "Requests by route and outcome"),
            &["route", "outcome"],
        )
        .expect("metric");
        let resource_requests = IntCounterVec::new(
            Opts::new("usher_proxy_resource_requests_total", "Admission decisions by resource and outcome"),
            &["resource", "outcome"],
        )
        .expect("metric");
        let wait_seconds = HistogramVec::new(
            HistogramOpts::new("usher_proxy_wait_seconds", "Time admitted requests waited for capacity")
                .buckets(vec![0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &["resource"],
        )
        .expect("metric");
        let in_flight = IntGaugeVec::new(Opts::new("usher_proxy_in_flight", "Requests in flight by route"), &["route"])
            .expect("metric");
        let upstream_seconds = HistogramVec::new(
            HistogramOpts::new("usher_proxy_upstream_seconds", "Time until upstream response headers"),
            &["upstream"],
        )
        .expect("metric");
        let body_errors = IntCounterVec::new(
            Opts::new(
                "usher_proxy_response_body_errors_total",
                "Responses whose body failed after the headers were sent (upstream reset mid-body)",
            ),
            &["route"],
        )
        .expect("metric");
        let config_reloads =
            IntCounter::new("usher_proxy_config_reloads_total", "Routes files applied").expect("metric");
        let config_reload_errors =
            IntCounter::new("usher_proxy_config_reload_errors_total", "Routes files rejected").expect("metric");
        let http1_handoffs = IntCounterVec::new(
            Opts::new(
                "usher_proxy_http1_handoffs_total",
                "HTTP/1.1 connections the native path handed to the general (hyper) path, by the request that made it",
            ),
            &["reason"],
        )
        .expect("metric");
        let settles = IntCounterVec::new(
            Opts::new(
                "usher_proxy_settles_total",
                "Answers read for a cost settled from the response, by route, resource and outcome (settled, or why not)",
            ),
            &["route", "resource", "outcome"],
        )
        .expect("metric");
        let capacity = prometheus::GaugeVec::new(
            Opts::new("usher_proxy_capacity", "Current capacity per resource, summed over its keys"),
            &["resource"],
        )
        .expect("metric");
        let demand = prometheus::GaugeVec::new(
            Opts::new("usher_proxy_demand", "Smoothed arrivals per second per resource (admitted, paced and refused)"),
            &["resource"],
        )
        .expect("metric");
        let upstream_quota = prometheus::GaugeVec::new(
            Opts::new(
                "usher_proxy_upstream_quota",
                "The upstream's latest account of its quota, from its rate limit headers: limit, remaining, reset_seconds",
            ),
            &["resource", "field"],
        )
        .expect("metric");
        let resource_in_flight = IntGaugeVec::new(
            Opts::new("usher_proxy_resource_in_flight", "Requests in flight per resource"),
            &["resource"],
        )
        .expect("metric");
        let waiters = IntGaugeVec::new(
            Opts::new("usher_proxy_waiters", "Requests waiting for capacity per resource"),
            &["resource"],
        )
        .expect("metric");
        let keys = IntGaugeVec::new(
            Opts::new("usher_proxy_resource_keys", "Distinct ids tracked per resource"),
            &["resource"],
        )
        .expect("metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(resource_requests.clone()),
            Box::new(wait_seconds.clone()),
            Box::new(in_flight.clone()),
            Box::new(upstream_seconds.clone()),
            Box::new(body_errors.clone()),
            Box::new(config_reloads.clone()),
            Box::new(config_reload_errors.clone()),
            Box::new(http1_handoffs.clone()),
            Box::new(settles.clone()),
            Box::new(capacity.clone()),
            Box::new(demand.clone()),
            Box::new(upstream_quota.clone()),
            Box::new(resource_in_flight.clone()),
            Box::new(waiters.clone()),
            Box::new(keys.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            requests,
            resource_requests,
            wait_seconds,
            in_flight,
            upstream_seconds,
            body_errors,
            config_reloads,
            config_reload_errors,
            http1_handoffs,
            settles,
            capacity,
            demand,
            upstream_quota,
            resource_in_flight,
            waiters,
            keys,
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
            route: route.to_string(),
            resource: resource.to_string(),
            counts: Default::default(),
            warned: Default::default(),
        };
        // Shown from the start: a dashboard has a series to rate.
        m.counter(SettleOutcome::Settled);
        m
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

/// A route's request counters by outcome, its in-flight gauge and its body-error counter.
#[derive(Clone)]
pub struct RouteMetrics {
    pub admitted: IntCounter,
    pub paced: IntCounter,
    pub refused: IntCounter,
    pub upstream_error: IntCounter,
    /// The app stopped sending its request body (a 408).
    pub client_timeout: IntCounter,
    pub in_flight: IntGauge,
    pub body_errors: IntCounter,
}

/// A resource's admission counters by outcome and its wait histogram.
#[derive(Clone)]
pub struct ResourceMetrics {
    pub name: String,
    pub admitted: IntCounter,
    pub paced: IntCounter,
    pub refused: IntCounter,
    pub wait: Histogram,
    upstream_quota: prometheus::GaugeVec,
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

/// What became of an answer read for a settled cost: settled, or why not
/// (the admission's charge then stands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettleOutcome {
    /// The real cost was read and the difference charged or given back.
    Settled,
    /// The header is absent, or the JSON path holds no number of at least 0.
    Missing,
    /// The body is not JSON.
    NotJson,
    /// The body is over the most that is read (`settle::MAX_JSON_BODY`).
    TooLarge,
    /// The body is compressed (`content-encoding`).
    Encoded,
    /// The body is a stream of events (`text/event-stream`).
    Streaming,
    /// The body is empty (a HEAD request, a 204).
    Empty,
    /// The body did not end: the app left, or the upstream cut it.
    Incomplete,
    /// An answer other than 2xx that did not carry the cost.
    Status,
}

impl SettleOutcome {
    pub const COUNT: usize = 9;

    /// The `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            SettleOutcome::Settled => "settled",
            SettleOutcome::Missing => "missing",
            SettleOutcome::NotJson => "not_json",
            SettleOutcome::TooLarge => "too_large",
            SettleOutcome::Encoded => "encoded",
            SettleOutcome::Streaming => "streaming",
            SettleOutcome::Empty => "empty",
            SettleOutcome::Incomplete => "incomplete",
            SettleOutcome::Status => "status",
        }
    }
}

/// One route resource's settle counters, each series made on its first
/// use, and whether each outcome was warned about yet.
pub struct SettleMetrics {
    vec: IntCounterVec,
    pub route: String,
    pub resource: String,
    counts: [std::sync::OnceLock<IntCounter>; SettleOutcome::COUNT],
    warned: [std::sync::atomic::AtomicBool; SettleOutcome::COUNT],
}

impl SettleMetrics {
    fn counter(&self, o: SettleOutcome) -> &IntCounter {
        self.counts[o as usize].get_or_init(|| self.vec.with_label_values(&[&self.route, &self.resource, o.label()]))
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
