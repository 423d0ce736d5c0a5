//! The capacity server's admin pages: metrics, health, readiness, and the
//! `/debug/status` and `/debug/resources` views (HTML, or JSON with `?format=json`).

use std::fmt::Write;
use std::sync::Arc;

use http::StatusCode;
use serde::Serialize;

use super::Node;
use super::store::{LeaseStatus, ResourceStatus};
use usher_core::admin::{self, Handler, escape};

/// Resources listed on `/debug/status` (HTML and JSON), in [`store::rank`]
/// order; the page refreshes itself, so it must stay cheap however many
/// resources clients create. `/debug/resources?resource=ID` shows any one.
pub(crate) const STATUS_MAX_RESOURCES: usize = 200;

/// Capacities are units per second, as in Doorman's resources file (a
/// sidecar that enforces a resource as a gauge reads them as requests in flight).
pub(crate) const CAPACITY_UNIT: &str = "per_second";

/// What `/debug/status` shows.
#[derive(Serialize)]
struct Status {
    server_id: String,
    role: &'static str,
    parent: Option<super::parent::ParentStatus>,
    election: Option<super::election::ElectionStatus>,
    etcd: Option<super::etcd::EtcdStatus>,
    is_master: bool,
    master_address: Option<String>,
    ready: bool,
    config_source: String,
    config_loaded_at: Option<i64>,
    config_error: Option<String>,
    tls: Option<usher_core::tls::ServerTlsStatus>,
    /// Resources in the store.
    resources_total: usize,
    /// Of those, how many `resources` leaves out (beyond [`STATUS_MAX_RESOURCES`]).
    resources_unlisted: usize,
    /// The unit of every capacity, has and wants below: [`CAPACITY_UNIT`].
    capacity_unit: &'static str,
    resources: Vec<ResourceStatus>,
}

/// What `/debug/resources` shows: one resource's leases.
#[derive(Serialize)]
struct ResourceLeases {
    resource: String,
    leases: Vec<LeaseStatus>,
}

/// The `/debug/status` view of `node` now.
fn status(node: &Node) -> Status {
    let m = node.mastership();
    let cs = node.config_state();
    let (resources, total) = node.store.top_status(STATUS_MAX_RESOURCES, |_| {});
    Status {
        server_id: node.server_id.clone(),
        role: if node.parent.is_some() { "intermediate" } else { "root" },
        parent: node.parent.as_ref().map(|p| p.status()),
        election: node.election.as_ref().map(|e| e.status()),
        etcd: node.etcd.as_ref().map(|e| e.status()),
        is_master: m.is_master,
        master_address: m.master_address.clone(),
        ready: node.is_ready(),
        config_source: node.config_source.clone(),
        config_loaded_at: cs.loaded_at.map(|t| t.as_secs()),
        config_error: cs.last_error,
        tls: node.tls.as_ref().map(|t| t.status()),
        resources_total: total,
        resources_unlisted: total - resources.len(),
        capacity_unit: CAPACITY_UNIT,
        resources,
    }
}

/// Serves the admin pages of `node`.
pub(crate) fn handler(node: Arc<Node>) -> Handler {
    Arc::new(move |req| {
        let json = admin::query_param(&req.uri, "format").as_deref() == Some("json");
        match req.uri.path() {
            "/metrics" => {
                let m = node.mastership();
                node.metrics.set_resources(&node.store, node.metrics_max_resources, &node.server_id, m.is_master);
                admin::metrics(&node.metrics.registry)
            }
            "/healthz" => admin::text(StatusCode::OK, "ok\n"),
            "/readyz" if node.is_ready() => admin::text(StatusCode::OK, "ready\n"),
            "/readyz" => admin::text(StatusCode::SERVICE_UNAVAILABLE, "not ready: no master known\n"),
            "/debug/status" | "/" => {
                let s = status(&node);
                if json { admin::json(&s) } else { admin::html(status_html(&s)) }
            }
            "/debug/resources" => {
                let Some(id) = admin::query_param(&req.uri, "resource") else {
                    return admin::text(StatusCode::BAD_REQUEST, "missing ?resource=ID\n");
                };
                match node.store.leases(&id) {
                    None => admin::text(
                        StatusCode::NOT_FOUND,
                        format!("no resource `{id}` (no client has asked for it, or every lease expired)\n"),
                    ),
                    Some(leases) => {
                        let r = ResourceLeases { resource: id, leases };
                        if json { admin::json(&r) } else { admin::html(leases_html(&r)) }
                    }
                }
            }
            other => admin::not_found(other),
        }
    })
}

/// `/debug/status` as an HTML page.
fn status_html(s: &Status) -> String {
    let mut b = String::new();
    let _ = write!(
        b,
        "<p>Server <b>{}</b>, role {}, {}. Master: {}.</p><p>Config <code>{}</code>{}</p>",
        escape(&s.server_id),
        s.role,
        if s.is_master { "<b>master</b>" } else { "not master" },
        escape(s.master_address.as_deref().unwrap_or("unknown")),
        escape(&s.config_source),
        match &s.config_error {
            Some(e) => format!(" <span class=err>last reload rejected: <pre>{}</pre></span>", escape(e)),
            None => String::new(),
        }
    );
    if let Some(e) = &s.election {
        let _ = write!(
            b,
            "<p>Election on <code>{}</code> (TTL {} s): <b>{}</b>{}{}</p>",
            escape(&e.key),
            e.ttl_s,
            e.state,
            match (e.lease_id, e.revision) {
                (Some(l), Some(r)) => format!(", etcd lease <code>{l:x}</code>, key revision {r}"),
                _ => String::new(),
            },
            e.last_error.as_deref().map(|x| format!(", <span class=err>{}</span>", escape(x))).unwrap_or_default()
        );
    }
    if let Some(t) = &s.tls {
        let _ = write!(
            b,
            "<p>gRPC over {} with <code>{}</code> ({} reloads){}; {} handshakes refused{}</p>",
            if t.client_auth { "mutual TLS" } else { "TLS" },
            escape(&t.cert_file),
            t.reloads,
            t.last_reload_error
                .as_deref()
                .map(|e| format!(", <span class=err>last reload rejected: {}</span>", escape(e)))
                .unwrap_or_default(),
            t.handshake_failures,
            t.last_handshake_error
                .as_deref()
                .map(|e| format!(", <span class=err>last: {}</span>", escape(e)))
                .unwrap_or_default()
        );
    }
    if let Some(p) = &s.parent {
        let _ = write!(
            b,
            "<p>Parent: {} (master {}), {} refreshes{}</p>",
            escape(&p.servers.join(", ")),
            escape(p.master.as_deref().unwrap_or("unknown")),
            p.refreshes,
            p.last_error
                .as_deref()
                .map(|e| format!(", <span class=err>last error: {}</span>", escape(e)))
                .unwrap_or_default()
        );
    }
    resources_table(&mut b, s);
    admin::page("usher server", &b)
}

/// The resources `/debug/status` lists, and how many it leaves out.
fn resources_table(b: &mut String, s: &Status) {
    b.push_str("<table id=resources><tr><th>resource</th><th>template</th><th>algorithm</th><th>capacity</th><th>sum has</th><th>sum wants</th><th>clients (servers)</th><th>from parent</th><th>quota</th><th>learning</th></tr>");
    for r in &s.resources {
        let _ = write!(
            b,
            "<tr><td><a href=\"/debug/resources?resource={id_q}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} ({})</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&r.template),
            r.algorithm,
            per_s(r.capacity),
            per_s(r.sum_has),
            per_s(r.sum_wants),
            r.clients,
            r.server_clients,
            r.parent_capacity.map(per_s).unwrap_or_else(|| "-".into()),
            r.quota
                .as_ref()
                .map(|q| format!(
                    "{:.0} of {:.0} left, renews in {:.0}s ({})",
                    q.remaining, q.limit, q.reset_in_s, q.source
                ))
                .unwrap_or_else(|| "-".into()),
            if r.learning_mode { format!("{:.0}s left", r.learning_left_s) } else { "no".into() },
            id = escape(&r.id),
            id_q = escape(&percent_encode(&r.id)),
        );
    }
    b.push_str("</table>");
    if s.resources_unlisted > 0 {
        let _ = write!(
            b,
            "<p id=unlisted>{} of {} resources listed (those the configuration names, then the busiest); {} more not shown. \
             See one with <code>/debug/resources?resource=ID</code>.</p>",
            s.resources.len(),
            s.resources_total,
            s.resources_unlisted
        );
    }
}

/// `/debug/resources` as an HTML page.
fn leases_html(r: &ResourceLeases) -> String {
    let mut b = String::from(
        "<p><a href=\"/debug/status\">back</a></p><table id=leases><tr><th>client</th><th>kind</th><th>has</th><th>wants</th><th>subclients</th><th>expires in</th></tr>",
    );
    for l in &r.leases {
        let _ = write!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}s</td></tr>",
            escape(&l.client_id),
            l.kind,
            per_s(l.has),
            per_s(l.wants),
            l.subclients,
            l.expires_in_s
        );
    }
    b.push_str("</table>");
    admin::page(&format!("usher server: {}", r.resource), &b)
}

/// A capacity as the HTML pages show it, with its unit: `8.333/s`.
fn per_s(v: f64) -> String {
    format!("{v:.3}/s")
}

/// Percent-encodes everything outside RFC 3986's unreserved characters, for
/// a value in a URL's query or path.
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
