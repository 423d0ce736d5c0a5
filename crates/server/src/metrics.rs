//! The capacity server's Prometheus metrics, registered in an injected registry.

use std::collections::BTreeMap;

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::store;

/// Default `--metrics-max-resources`: resources beyond this many get no
/// per-resource series, only their share of the per-template sums.
pub const DEFAULT_METRICS_MAX_RESOURCES: usize = 1000;

/// The server's metrics; `/metrics` serves `registry`.
pub struct Metrics {
    /// The registry every metric here is registered in.
    pub registry: Registry,
    /// The capacity RPCs.
    pub(crate) rpc: RpcMetrics,
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
    /// Resources in the store.
    resources: IntGauge,
    /// Resources without per-resource series.
    resources_unlisted: IntGauge,
    templates: TemplateGauges,
    resource: ResourceGauges,
    is_master: IntGaugeVec,
}

/// The capacity RPCs' metrics, by method.
pub(crate) struct RpcMetrics {
    /// RPCs received.
    pub(crate) requests: IntCounterVec,
    /// RPCs answered with an error, by gRPC code too.
    pub(crate) errors: IntCounterVec,
    /// Time to answer.
    pub(crate) duration: HistogramVec,
}

/// The sums over the resources of each template (labelled by configuration).
struct TemplateGauges {
    resources: IntGaugeVec,
    has: GaugeVec,
    wants: GaugeVec,
    clients: IntGaugeVec,
}

/// One resource's series (labelled by ids the clients choose: bounded by
/// `--metrics-max-resources`).
struct ResourceGauges {
    capacity: GaugeVec,
    has: GaugeVec,
    wants: GaugeVec,
    clients: IntGaugeVec,
    learning: IntGaugeVec,
}

/// Registers `c` in `r` and hands it back.
fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("metric names are unique");
    c
}

/// A counter registered in `r`.
fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    reg(r, IntCounter::new(name, help).expect("valid metric"))
}

/// A gauge registered in `r`.
fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    reg(r, IntGauge::new(name, help).expect("valid metric"))
}

/// Gauges by `label`, registered in `r`.
fn gauge_vec(r: &Registry, name: &str, help: &str, label: &str) -> GaugeVec {
    reg(r, GaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric"))
}

/// Integer gauges by `label`, registered in `r`.
fn int_gauge_vec(r: &Registry, name: &str, help: &str, label: &str) -> IntGaugeVec {
    reg(r, IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric"))
}

impl Metrics {
    /// Registers every metric in `registry`.
    ///
    /// # Panics
    ///
    /// When `registry` already holds one of them (another server's metrics).
    pub fn new(registry: Registry) -> Self {
        let r = &registry;
        Metrics {
            rpc: RpcMetrics::new(r),
            config_reloads: counter(r, "usher_config_reloads_total", "Configuration reloads applied."),
            config_reload_errors: counter(
                r,
                "usher_config_reload_errors_total",
                "Configuration reloads rejected; the previous configuration stays in force.",
            ),
            tls_handshake_failures: counter(
                r,
                "usher_server_tls_handshake_failures_total",
                "gRPC connections refused because their TLS handshake failed (reason in the log and /debug/status).",
            ),
            mastership_changes: counter(
                r,
                "usher_server_mastership_changes_total",
                "Times this server became or stopped being the master of its node.",
            ),
            catch_all_resources: counter(
                r,
                "usher_server_catch_all_resources_total",
                "Resource ids that matched only the catch-all `*` template while others are configured (a typo?).",
            ),
            connections: gauge(r, "usher_server_connections", "gRPC connections open."),
            connections_refused: counter(
                r,
                "usher_server_connections_refused_total",
                "gRPC connections closed at once because --max-connections were open.",
            ),
            connections_timed_out: counter(
                r,
                "usher_server_connections_timed_out_total",
                "gRPC connections closed because they sent no complete HTTP/2 preface within --preface-timeout.",
            ),
            resources: gauge(
                r,
                "usher_server_resources",
                "Resources in the store (with at least one unexpired lease or a parent lease).",
            ),
            resources_unlisted: gauge(
                r,
                "usher_server_resources_unlisted",
                "Resources in the store without usher_server_resource_* series (beyond --metrics-max-resources).",
            ),
            templates: TemplateGauges::new(r),
            resource: ResourceGauges::new(r),
            is_master: int_gauge_vec(
                r,
                "usher_server_is_master",
                "1 when this server is the master of its node.",
                "server_id",
            ),
            registry,
        }
    }

    /// Sets the resource gauges from a fresh look at `store`; resources that
    /// are gone disappear from the exposition. Only the first `max_listed` in
    /// [`store::rank`] order get per-resource series (their ids are chosen by
    /// clients, so their number is not ours to leave unbounded); every
    /// resource counts in the per-template sums, whose labels come from the
    /// configuration.
    pub fn set_resources(&self, store: &store::Store, max_listed: usize, server_id: &str, is_master: bool) {
        let (res, tpl) = (&self.resource, &self.templates);
        for g in [&res.capacity, &res.has, &res.wants, &tpl.has, &tpl.wants] {
            g.reset();
        }
        for g in [&res.clients, &res.learning, &tpl.resources, &tpl.clients] {
            g.reset();
        }
        let mut templates: BTreeMap<String, (i64, f64, f64, i64)> = BTreeMap::new();
        let (listed, total) = store.top_status(max_listed, |r| {
            if !templates.contains_key(&r.template) {
                templates.insert(r.template.clone(), Default::default());
            }
            let t = templates.get_mut(&r.template).expect("just filed");
            t.0 += 1;
            t.1 += r.sum_has;
            t.2 += r.sum_wants;
            t.3 += r.clients as i64;
        });
        for (t, (n, has, wants, clients)) in &templates {
            let l = [t.as_str()];
            tpl.resources.with_label_values(&l).set(*n);
            tpl.has.with_label_values(&l).set(*has);
            tpl.wants.with_label_values(&l).set(*wants);
            tpl.clients.with_label_values(&l).set(*clients);
        }
        self.resources.set(total as i64);
        self.resources_unlisted.set(total.saturating_sub(max_listed) as i64);
        for r in &listed {
            let l = [r.id.as_str()];
            res.capacity.with_label_values(&l).set(r.capacity);
            res.has.with_label_values(&l).set(r.sum_has);
            res.wants.with_label_values(&l).set(r.sum_wants);
            res.clients.with_label_values(&l).set(r.clients as i64);
            res.learning.with_label_values(&l).set(i64::from(r.learning_mode));
        }
        self.is_master.reset();
        self.is_master.with_label_values(&[server_id]).set(i64::from(is_master));
    }
}

impl RpcMetrics {
    /// Registers the RPC metrics in `r`.
    fn new(r: &Registry) -> Self {
        let requests = IntCounterVec::new(
            Opts::new("usher_server_rpc_requests_total", "Capacity RPCs received, by method."),
            &["method"],
        );
        let errors = IntCounterVec::new(
            Opts::new(
                "usher_server_rpc_errors_total",
                "Capacity RPCs answered with an error, by method and gRPC code.",
            ),
            &["method", "code"],
        );
        let duration = HistogramVec::new(
            HistogramOpts::new("usher_server_rpc_duration_seconds", "Time to answer a capacity RPC, by method.")
                .buckets(vec![0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.1]),
            &["method"],
        );
        RpcMetrics {
            requests: reg(r, requests.expect("valid metric")),
            errors: reg(r, errors.expect("valid metric")),
            duration: reg(r, duration.expect("valid metric")),
        }
    }
}

impl TemplateGauges {
    /// Registers the per-template gauges in `r`.
    fn new(r: &Registry) -> Self {
        TemplateGauges {
            resources: int_gauge_vec(
                r,
                "usher_server_template_resources",
                "Resources in the store, by the identifier_glob of the template they matched.",
                "template",
            ),
            has: gauge_vec(r, "usher_server_template_has", "Sum of unexpired leases granted, by template.", "template"),
            wants: gauge_vec(r, "usher_server_template_wants", "Sum of what clients want, by template.", "template"),
            clients: int_gauge_vec(r, "usher_server_template_clients", "Unexpired leases, by template.", "template"),
        }
    }
}

impl ResourceGauges {
    /// Registers the per-resource gauges in `r`.
    fn new(r: &Registry) -> Self {
        let label = "resource";
        ResourceGauges {
            capacity: gauge_vec(r, "usher_server_resource_capacity", "Configured capacity of a resource.", label),
            has: gauge_vec(r, "usher_server_resource_has", "Sum of unexpired leases granted on a resource.", label),
            wants: gauge_vec(r, "usher_server_resource_wants", "Sum of what the clients of a resource want.", label),
            clients: int_gauge_vec(
                r,
                "usher_server_resource_clients",
                "Clients holding an unexpired lease on a resource.",
                label,
            ),
            learning: int_gauge_vec(
                r,
                "usher_server_resource_learning_mode",
                "1 while a resource is in learning mode.",
                label,
            ),
        }
    }
}
