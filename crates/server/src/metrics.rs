//! The capacity server's Prometheus metrics, registered in an injected registry.

use std::collections::BTreeMap;

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::store::{self, ResourceStatus};

/// Default `--metrics-max-resources`: resources beyond this many get no
/// per-resource series, only their share of the per-template sums.
pub const DEFAULT_METRICS_MAX_RESOURCES: usize = 1000;

/// The server's metrics; `/metrics` serves `registry`.
pub struct Metrics {
    /// The registry every metric here is registered in.
    pub registry: Registry,
    /// Capacity RPCs received, by method.
    pub(crate) rpc_requests: IntCounterVec,
    /// Capacity RPCs answered with an error, by method and gRPC code.
    pub(crate) rpc_errors: IntCounterVec,
    /// Time to answer a capacity RPC, by method.
    pub(crate) rpc_duration: HistogramVec,
    /// Configuration reloads applied.
    pub(crate) config_reloads: IntCounter,
    /// Configuration reloads rejected.
    pub(crate) config_reload_errors: IntCounter,
    /// gRPC connections whose TLS handshake failed.
    pub(crate) tls_handshake_failures: IntCounter,
    /// Times this server became or stopped being its node's master.
    pub(crate) mastership_changes: IntCounter,
    /// Resource ids only the catch-all `*` template matched, while the
    /// configuration has others (each counted once; see `store::CatchAll`).
    pub(crate) catch_all_resources: IntCounter,
    /// gRPC connections open (TLS handshakes in progress included).
    pub(crate) connections: IntGauge,
    /// gRPC connections closed at once because `--max-connections` were open.
    pub(crate) connections_refused: IntCounter,
    /// gRPC connections closed because they sent no complete HTTP/2 preface in time.
    pub(crate) connections_timed_out: IntCounter,
    resource_capacity: GaugeVec,
    resource_has: GaugeVec,
    resource_wants: GaugeVec,
    resource_clients: IntGaugeVec,
    resource_learning: IntGaugeVec,
    resources: IntGauge,
    resources_unlisted: IntGauge,
    template_resources: IntGaugeVec,
    template_has: GaugeVec,
    template_wants: GaugeVec,
    template_clients: IntGaugeVec,
    is_master: IntGaugeVec,
}

/// Registers `c` in `r` and hands it back.
fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("metric names are unique");
    c
}

impl Metrics {
    /// Registers every metric in `registry`.
    ///
    /// # Panics
    ///
    /// When `registry` already holds one of them (another server's metrics).
    pub fn new(registry: Registry) -> Self {
        let r = &registry;
        let res =
            |name: &str, help: &str| reg(r, GaugeVec::new(Opts::new(name, help), &["resource"]).expect("valid metric"));
        let tpl =
            |name: &str, help: &str| reg(r, GaugeVec::new(Opts::new(name, help), &["template"]).expect("valid metric"));
        let int_tpl = |name: &str, help: &str| {
            reg(r, IntGaugeVec::new(Opts::new(name, help), &["template"]).expect("valid metric"))
        };
        let gauge = |name: &str, help: &str| reg(r, IntGauge::new(name, help).expect("valid metric"));
        let counter = |name: &str, help: &str| reg(r, IntCounter::new(name, help).expect("valid metric"));
        Metrics {
            rpc_requests: reg(
                r,
                IntCounterVec::new(
                    Opts::new("usher_server_rpc_requests_total", "Capacity RPCs received, by method."),
                    &["method"],
                )
                .expect("valid metric"),
            ),
            rpc_errors: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "usher_server_rpc_errors_total",
                        "Capacity RPCs answered with an error, by method and gRPC code.",
                    ),
                    &["method", "code"],
                )
                .expect("valid metric"),
            ),
            rpc_duration: reg(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "usher_server_rpc_duration_seconds",
                        "Time to answer a capacity RPC, by method.",
                    )
                    .buckets(vec![0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1]),
                    &["method"],
                )
                .expect("valid metric"),
            ),
            config_reloads: reg(
                r,
                IntCounter::new("usher_config_reloads_total", "Configuration reloads applied.").expect("valid metric"),
            ),
            config_reload_errors: reg(
                r,
                IntCounter::new(
                    "usher_config_reload_errors_total",
                    "Configuration reloads rejected; the previous configuration stays in force.",
                )
                .expect("valid metric"),
            ),
            tls_handshake_failures: reg(
                r,
                IntCounter::new(
                    "usher_server_tls_handshake_failures_total",
                    "gRPC connections refused because their TLS handshake failed (reason in the log and /debug/status).",
                )
                .expect("valid metric"),
            ),
            mastership_changes: reg(
                r,
                IntCounter::new(
                    "usher_server_mastership_changes_total",
                    "Times this server became or stopped being the master of its node.",
                )
                .expect("valid metric"),
            ),
            catch_all_resources: counter(
                "usher_server_catch_all_resources_total",
                "Resource ids that matched only the catch-all `*` template while others are configured (a typo?).",
            ),
            connections: gauge("usher_server_connections", "gRPC connections open."),
            connections_refused: counter(
                "usher_server_connections_refused_total",
                "gRPC connections closed at once because --max-connections were open.",
            ),
            connections_timed_out: counter(
                "usher_server_connections_timed_out_total",
                "gRPC connections closed because they sent no complete HTTP/2 preface within --preface-timeout.",
            ),
            resources: gauge("usher_server_resources", "Resources in the store (with at least one unexpired lease or a parent lease)."),
            resources_unlisted: gauge(
                "usher_server_resources_unlisted",
                "Resources in the store without usher_server_resource_* series (beyond --metrics-max-resources).",
            ),
            template_resources: int_tpl(
                "usher_server_template_resources",
                "Resources in the store, by the identifier_glob of the template they matched.",
            ),
            template_has: tpl("usher_server_template_has", "Sum of unexpired leases granted, by template."),
            template_wants: tpl("usher_server_template_wants", "Sum of what clients want, by template."),
            template_clients: int_tpl("usher_server_template_clients", "Unexpired leases, by template."),
            resource_capacity: res("usher_server_resource_capacity", "Configured capacity of a resource."),
            resource_has: res("usher_server_resource_has", "Sum of unexpired leases granted on a resource."),
            resource_wants: res("usher_server_resource_wants", "Sum of what the clients of a resource want."),
            resource_clients: reg(
                r,
                IntGaugeVec::new(
                    Opts::new("usher_server_resource_clients", "Clients holding an unexpired lease on a resource."),
                    &["resource"],
                )
                .expect("valid metric"),
            ),
            resource_learning: reg(
                r,
                IntGaugeVec::new(
                    Opts::new("usher_server_resource_learning_mode", "1 while a resource is in learning mode."),
                    &["resource"],
                )
                .expect("valid metric"),
            ),
            is_master: reg(
                r,
                IntGaugeVec::new(
                    Opts::new("usher_server_is_master", "1 when this server is the master of its node."),
                    &["server_id"],
                )
                .expect("valid metric"),
            ),
            registry,
        }
    }

    /// Sets the resource gauges from a fresh snapshot; resources that are
    /// gone disappear from the exposition. Only the first `max_listed` in
    /// [`store::rank`] order get per-resource series (their ids are chosen by
    /// clients, so their number is not ours to leave unbounded); every
    /// resource counts in the per-template sums, whose labels come from the
    /// configuration.
    pub fn set_resources(
        &self,
        mut resources: Vec<ResourceStatus>,
        max_listed: usize,
        server_id: &str,
        is_master: bool,
    ) {
        for g in [
            &self.resource_capacity,
            &self.resource_has,
            &self.resource_wants,
            &self.template_has,
            &self.template_wants,
        ] {
            g.reset();
        }
        for g in [&self.resource_clients, &self.resource_learning, &self.template_resources, &self.template_clients] {
            g.reset();
        }
        let mut templates: BTreeMap<&str, (i64, f64, f64, i64)> = BTreeMap::new();
        for r in &resources {
            let t = templates.entry(r.template.as_str()).or_default();
            t.0 += 1;
            t.1 += r.sum_has;
            t.2 += r.sum_wants;
            t.3 += r.clients as i64;
        }
        for (t, (n, has, wants, clients)) in templates {
            let l = [t];
            self.template_resources.with_label_values(&l).set(n);
            self.template_has.with_label_values(&l).set(has);
            self.template_wants.with_label_values(&l).set(wants);
            self.template_clients.with_label_values(&l).set(clients);
        }
        self.resources.set(resources.len() as i64);
        self.resources_unlisted.set(resources.len().saturating_sub(max_listed) as i64);
        store::rank(&mut resources);
        for r in resources.iter().take(max_listed) {
            let l = [r.id.as_str()];
            self.resource_capacity.with_label_values(&l).set(r.capacity);
            self.resource_has.with_label_values(&l).set(r.sum_has);
            self.resource_wants.with_label_values(&l).set(r.sum_wants);
            self.resource_clients.with_label_values(&l).set(r.clients as i64);
            self.resource_learning.with_label_values(&l).set(i64::from(r.learning_mode));
        }
        self.is_master.reset();
        self.is_master.with_label_values(&[server_id]).set(i64::from(is_master));
    }
}
