//! The sidecar's admin pages: metrics, health, readiness and
//! `/debug/status` (HTML, or JSON with `?format=json`).

use std::fmt::Write;
use std::sync::Arc;

use http::StatusCode;
use serde::Serialize;

use crate::sidecar::{Proxy, readiness};
use usher_core::admin::{self, Handler, escape};
use usher_lease::core::{Capacity, Source};
use usher_limit::{DemandSample, Kind};

#[derive(Serialize)]
struct Status {
    ready: bool,
    routes_file: String,
    config_loaded_at: Option<i64>,
    config_error: Option<String>,
    routes: Vec<String>,
    keys: Vec<KeyStatus>,
    /// The lease client: master, last error, and per key has, wants, expiry, mode.
    lease: Option<usher_lease::driver::ClientStatus>,
    /// Keys backing off because their upstream answered 429 or 503.
    pushback: Vec<usher_enforce::pushback::KeyPushback>,
    /// Resources whose quota headers a route's answers lack: their upstream quota is not followed.
    upstream_quota_unseen: Vec<QuotaUnseen>,
    /// Seconds since the epoch when this status was taken.
    now_s: i64,
}

#[derive(Serialize)]
struct KeyStatus {
    resource: String,
    id: String,
    kind: Kind,
    #[serde(serialize_with = "plain_capacity")]
    capacity: f64,
    /// `per_second` (a rate) or `in_flight` (a gauge).
    unit: &'static str,
    /// Units that could pass now, to a millionth (a budget's fractions
    /// count): a whole number when it is one.
    #[serde(serialize_with = "plain_number")]
    remaining: f64,
    max_wait_ms: u64,
    /// Shadow mode: decided and counted, never enforced.
    shadow: bool,
    /// The key holds no lease: it enforces its routes-file capacity (a
    /// templated rate key of a sidecar with no `doorman:` section; see
    /// `usher_enforce::resource::is_local`). The lease list omits it.
    local: bool,
    /// The upstream's latest account of its quota, when its headers steer the resource.
    upstream_quota: Option<usher_lease::quota::Observation>,
    demand: DemandSample,
}

/// A resource whose quota headers have not been in its route's last successful answers.
#[derive(Serialize)]
struct QuotaUnseen {
    route: String,
    resource: String,
    /// The `upstream_quota` preset, or `headers` for named ones.
    preset: String,
    /// The headers it reads.
    headers: String,
    /// Successful answers in a row without them.
    answers: u32,
}

/// The resources of `cfg`'s routes whose quota headers are missing now.
fn quota_unseen(p: &Proxy, cfg: &usher_core::config::routes::RoutesConfig) -> Vec<QuotaUnseen> {
    let configured = |route: &str, resource: &str| {
        cfg.routes.iter().any(|r| r.name == route && r.resources.iter().any(|(n, _)| n == resource))
    };
    p.metrics
        .quota_unseen()
        .into_iter()
        .filter(|w| configured(&w.route, &w.resource))
        .filter_map(|w| {
            Some(QuotaUnseen {
                answers: w.unseen()?,
                route: w.route.clone(),
                resource: w.resource.clone(),
                preset: w.preset.clone(),
                headers: w.headers.clone(),
            })
        })
        .collect()
}

fn status(p: &Proxy) -> Status {
    let cs = p.config_state();
    let now = p.table.clock().now();
    let cfg = p.config();
    let local =
        |resource: &str| cfg.resources.get(resource).is_some_and(|r| usher_enforce::resource::is_local(&cfg, r));
    Status {
        ready: readiness(p) == StatusCode::OK,
        routes_file: p.config_source.clone(),
        config_loaded_at: cs.loaded_at.map(|t| t.as_secs()),
        config_error: cs.last_error,
        routes: cfg.routes.iter().map(|r| r.name.clone()).collect(),
        upstream_quota_unseen: quota_unseen(p, &cfg),
        keys: p
            .table
            .limiters()
            .into_iter()
            .map(|(resource, l)| KeyStatus {
                local: local(&resource),
                resource,
                id: l.id().to_string(),
                kind: l.kind(),
                capacity: l.capacity(),
                unit: unit_name(l.kind()),
                remaining: (l.available() * 1e6).floor() / 1e6,
                max_wait_ms: l.spec().max_wait.as_millis() as u64,
                shadow: l.is_shadow(),
                upstream_quota: l.quota(false).0,
                demand: l.demand().sample(now),
            })
            .collect(),
        lease: p.lease.get().map(|c| c.status()),
        pushback: p.pushback.status(now),
        now_s: now.as_secs(),
    }
}

/// `usher_proxy_lease_state{resource_id, state}`: 1 for the state a lease key
/// is in, 0 for the others (a state set, so an alert on `expired` or `safe`
/// has a series to watch before it ever fires). `held`: the lease expired
/// unrenewed and is still enforced (see `lease::Mode::Held`); `safe`: no
/// lease, and the key enforces its safe capacity. A local key (no lease at
/// all, see `usher_enforce::resource::is_local`) has one series, `local`:
/// it has no other state to move to.
fn lease_state_gauge(proxy: &Proxy) -> prometheus::IntGaugeVec {
    let g = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "usher_proxy_lease_state",
            "1 for the lease state of a resource key (leased, held, pending, expired, safe), 0 for the others.",
        ),
        &["resource_id", "state"],
    )
    .expect("valid metric");
    let _ = proxy.metrics.registry.register(Box::new(g.clone()));
    g
}

fn observe_lease_states(g: &prometheus::IntGaugeVec, proxy: &Proxy) {
    use usher_lease::{Mode, OnExpiry};
    g.reset();
    let cfg = proxy.config();
    let local: Vec<&str> = cfg
        .resources
        .values()
        .filter(|r| usher_enforce::resource::is_local(&cfg, r))
        .map(|r| r.name.as_str())
        .collect();
    if !local.is_empty() {
        proxy.table.each_limiter(|resource, l| {
            if local.contains(&resource) {
                g.with_label_values(&[l.id(), "local"]).set(1);
            }
        });
    }
    let Some(status) = proxy.lease.get().map(|c| c.status()) else { return };
    for k in &status.keys {
        let state = match (k.mode, k.on_expiry) {
            (Mode::Leased | Mode::Held, _) => k.mode.name(),
            (_, OnExpiry::Safe) => "safe",
            (Mode::Pending | Mode::Expired, _) => k.mode.name(),
        };
        for s in ["leased", "held", "pending", "expired", "safe"] {
            g.with_label_values(&[&k.resource_id, s]).set(i64::from(s == state));
        }
    }
}

/// The admin listener's handler: `/metrics`, `/healthz`, `/readyz` and `/debug/status` for `proxy`.
pub(crate) fn handler(proxy: Arc<Proxy>) -> Handler {
    let lease_states = lease_state_gauge(&proxy);
    let scraping = std::sync::Mutex::new(());
    Arc::new(move |req| {
        let json = admin::query_param(&req.uri, "format").as_deref() == Some("json");
        match req.uri.path() {
            "/metrics" => {
                // The lease states are filled for one scrape and emptied after
                // it: kept between scrapes, five series per key (each with its
                // own label strings) held kilobytes per tenant key. One scrape
                // at a time, so none empties what another is writing out.
                let _one = scraping.lock().expect("scrape lock");
                proxy.metrics.observe_table(&proxy.table);
                observe_lease_states(&lease_states, &proxy);
                let answer = admin::metrics(&proxy.metrics.registry);
                lease_states.reset();
                answer
            }
            "/healthz" => admin::text(StatusCode::OK, "ok\n"),
            "/readyz" => match readiness(&proxy) {
                StatusCode::OK => admin::text(StatusCode::OK, "ready\n"),
                s => admin::text(s, "not ready: no routes loaded\n"),
            },
            "/debug/status" | "/" => {
                let s = status(&proxy);
                if json { admin::json(&s) } else { admin::html(status_html(&s)) }
            }
            other => admin::not_found(other),
        }
    })
}

/// A capacity as JSON: a number, or `"unlimited"` (JSON has no infinity).
fn plain_capacity<S: serde::Serializer>(c: &f64, s: S) -> Result<S::Ok, S::Error> {
    if c.is_infinite() { s.serialize_str("unlimited") } else { s.serialize_f64(*c) }
}

/// A number of units: whole ones as integers (`3`, not `3.0`), unlimited as the most a `u64` holds.
fn plain_number<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    match *v {
        v if v.is_infinite() || v >= u64::MAX as f64 => s.serialize_u64(u64::MAX),
        v if v.fract() == 0.0 && v >= 0.0 => s.serialize_u64(v as u64),
        v => s.serialize_f64(v),
    }
}

fn unit_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Rate => "per_second",
        Kind::Gauge => "in_flight",
    }
}

/// A rate as the HTML page shows it: two decimals, or three significant
/// digits below 1 (a budget's demand in dollars a second is tiny).
fn figure(v: f64) -> String {
    match v {
        0.0 => "0.00".into(),
        v if v.abs() >= 1.0 || !v.is_finite() => format!("{v:.2}"),
        v => format!("{v:.*}", (2 - v.abs().log10().floor() as i32).clamp(2, 12) as usize),
    }
}

/// A capacity with its unit, as the HTML page shows it: `8.333/s`, `4 in flight`.
fn with_unit(c: f64, kind: Kind) -> String {
    match (kind, c.is_infinite()) {
        (_, true) => "unlimited".into(),
        (Kind::Rate, false) => format!("{c:.3}/s"),
        (Kind::Gauge, false) => format!("{c} in flight"),
    }
}

fn source_name(s: Source) -> &'static str {
    match s {
        Source::Lease => "lease",
        Source::Cache => "cached lease",
        Source::OnExpiry => "on_expiry",
    }
}

fn status_html(s: &Status) -> String {
    let mut b = String::new();
    let _ = write!(
        b,
        "<p>Routes file <code>{}</code>{}</p><p>Routes: {}</p>",
        escape(&s.routes_file),
        match &s.config_error {
            Some(e) => format!(" <span class=err>last reload rejected: <pre>{}</pre></span>", escape(e)),
            None => String::new(),
        },
        escape(&s.routes.join(", "))
    );
    b.push_str(
        "<table id=keys><tr><th>resource</th><th>id</th><th>kind</th><th>capacity</th><th>remaining</th>\
         <th>demand/s</th><th>in flight</th><th>peak</th><th>waiting</th><th>admitted</th><th>paced</th><th>refused</th></tr>",
    );
    for k in &s.keys {
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{:?}{}{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&k.resource),
            escape(&k.id),
            k.kind,
            if k.shadow { " (shadow)" } else { "" },
            if k.local { " (local: no lease)" } else { "" },
            with_unit(k.capacity, k.kind),
            k.remaining,
            figure(k.demand.rate),
            k.demand.in_flight,
            k.demand.peak_in_flight,
            k.demand.waiters,
            k.demand.admitted,
            k.demand.paced,
            k.demand.refused,
        );
    }
    b.push_str("</table>");
    if !s.upstream_quota_unseen.is_empty() {
        b.push_str(
            "<h2>Upstream quota headers not seen</h2><p class=err>These resources follow quota headers that \
             their route's recent successful answers did not carry: the upstream's quota is not followed.</p>\
             <table id=quota-unseen><tr><th>route</th><th>resource</th><th>preset</th><th>headers read</th>\
             <th>answers without</th></tr>",
        );
        for u in &s.upstream_quota_unseen {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&u.route),
                escape(&u.resource),
                escape(&u.preset),
                escape(&u.headers),
                u.answers
            );
        }
        b.push_str("</table>");
    }
    if let Some(l) = &s.lease {
        let _ = write!(
            b,
            "<h2>Leases</h2><p>Client <code>{}</code>, master {}, {} refreshes{}</p>\
             <table id=leases><tr><th>resource id</th><th>mode</th><th>has</th><th>enforcing</th><th>wants</th><th>expiry</th><th>safe</th><th>on expiry</th><th>server template</th><th>error</th></tr>",
            escape(&l.client_id),
            escape(l.master.as_deref().unwrap_or("unknown")),
            l.refreshes,
            l.last_error
                .as_deref()
                .map(|e| format!(", <span class=err>last error: {}</span>", escape(e)))
                .unwrap_or_default()
        );
        let kinds: std::collections::HashMap<&str, Kind> = s.keys.iter().map(|k| (k.id.as_str(), k.kind)).collect();
        for k in &l.keys {
            let kind = kinds.get(k.resource_id.as_str()).copied().unwrap_or(Kind::Rate);
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{:?}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&k.resource_id),
                k.mode,
                k.has.map(|h| with_unit(h, kind)).unwrap_or_else(|| "-".into()),
                match (k.capacity, k.source) {
                    (Capacity::Limited(c), s) => match k.zero_reason {
                        Some(why) => format!(
                            "{} ({}): <span class=err>{}</span>",
                            with_unit(c, kind),
                            source_name(s),
                            escape(why)
                        ),
                        None => format!("{} ({})", with_unit(c, kind), source_name(s)),
                    },
                    (Capacity::Unlimited, s) => format!("unlimited ({})", source_name(s)),
                },
                with_unit(k.wants, kind),
                k.expiry.map(|e| format!("in {}s", e - s.now_s)).unwrap_or_else(|| "-".into()),
                k.safe_capacity.map(|s| format!("{s}")).unwrap_or_else(|| "-".into()),
                k.on_expiry.name(),
                escape(k.template.as_deref().unwrap_or("-")),
                escape(k.last_error.as_deref().unwrap_or("")),
            );
        }
        b.push_str("</table>");
    }
    admin::page("usher proxy", &b)
}
