//! A route's resources: the key a request is admitted by (its id rendered
//! from the request), its cost, and what the answer settles. The sidecar's
//! routes and `embed`'s layers both admit through a [`RouteResource`].

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use http::{Method, Request, header};

use crate::metrics::{Metrics, ResourceMetrics, SettleMetrics};
use crate::respond::ProxyError;
use usher_core::config::routes::{
    BodyCost, CostRule, IdTemplate, ResourceConfig, ResourceKind, RoutesConfig, Segment, SettleFrom,
};
use usher_limit::{Kind, LeaseTable, Limiter, Plan, ResourceLimits, ResourceSpec};

/// One resource a route must be admitted by (and, in `crate::embed`, the
/// one resource a layer admits by): its keys, the cost of a request, and
/// what it reads from the answer.
#[derive(Clone)]
pub struct RouteResource {
    limits: Arc<ResourceLimits>,
    template: IdTemplate,
    /// The cost charged at admission when no header names one.
    pub cost: f64,
    /// The request header the cost is read from (`cost` when it has none).
    pub cost_header: Option<String>,
    /// The entry's rule, when the cost is read from the request's body
    /// (`cost` when it cannot be): its `body` is set.
    body_rule: Option<Box<CostRule>>,
    /// Where the real cost is settled from, and how settling went.
    pub settle: Option<Arc<Settle>>,
    /// The resource's burst: a cost read from a request counts as at most this.
    burst: f64,
    /// The upstream's quota headers, when they steer the resource.
    pub quota: Option<Arc<usher_core::config::quota::UpstreamQuota>>,
    /// Whether the route's answers carry them.
    pub quota_watch: Option<Arc<crate::metrics::QuotaWatch>>,
    /// The limiter of a fixed id, found on the first request (fixed keys are never forgotten).
    fixed: OnceLock<Arc<Limiter>>,
    /// The resource's counters.
    pub metrics: ResourceMetrics,
}

/// Where a route resource's real cost is settled from, and its counters.
pub struct Settle {
    /// The answer's header or JSON path that holds the real cost.
    pub from: SettleFrom,
    /// How settling went, by outcome.
    pub metrics: SettleMetrics,
}

impl RouteResource {
    /// The resource `name` of `cfg` on route `route`, charged `cost` or as `rule` says; None
    /// when `table` (configured with `cfg`) lacks it.
    pub fn new(
        cfg: &RoutesConfig,
        route: &str,
        name: &str,
        cost: f64,
        rule: Option<&CostRule>,
        table: &LeaseTable,
        metrics: &Metrics,
    ) -> Option<Self> {
        let res = cfg.resources.get(name)?;
        Some(RouteResource {
            limits: table.resource(name)?,
            template: res.id.clone(),
            cost,
            cost_header: rule.and_then(|c| c.header.clone()),
            body_rule: rule.filter(|c| c.body.is_some()).map(|c| Box::new(c.clone())),
            settle: rule
                .and_then(|c| c.settle.clone())
                .map(|from| Arc::new(Settle { from, metrics: metrics.settle(route, name) })),
            burst: res.burst,
            quota: res.upstream_quota.clone().map(Arc::new),
            quota_watch: res.upstream_quota.as_ref().map(|q| metrics.quota_watch(route, name, q)),
            fixed: OnceLock::new(),
            metrics: metrics.resource(name),
        })
    }

    /// The keys of `plan` (enforced, then shadow) that are this resource's,
    /// with the cost each was charged at admission.
    pub(crate) fn keys_in<'p>(&'p self, plan: &'p Plan) -> impl Iterator<Item = &'p (Arc<Limiter>, f64)> {
        plan.items.iter().chain(plan.shadow.iter()).filter(|(l, _)| self.limits.owns(l))
    }

    /// Whether the key `l` is one of this resource's.
    pub fn owns(&self, l: &Limiter) -> bool {
        self.limits.owns(l)
    }

    /// Whether every request gets the same key at the same cost.
    pub fn is_fixed(&self) -> bool {
        self.template.is_fixed() && self.cost_header.is_none() && self.body_rule.is_none()
    }

    /// Whether the cost is read from the request's body ([`RouteResource::body_cost`]).
    pub fn reads_body(&self) -> bool {
        self.body_rule.is_some()
    }

    /// The cost of a request whose JSON body is `doc`, as the entry says to
    /// read it (at most the resource's burst); `cost` when the body does not
    /// give one above 0.
    pub fn body_cost(&self, doc: &serde_json::Value) -> f64 {
        let Some(rule) = &self.body_rule else { return self.cost };
        let read = match &rule.body {
            Some(BodyCost::Json(path)) => crate::request_body::number_at(doc, path),
            Some(BodyCost::Estimate(e)) => crate::request_body::estimate::tokens(e, doc)
                .map(|(input, output)| rule.units(input as f64, output as f64)),
            None => None,
        };
        self.capped(read)
    }

    /// The key `req` is admitted by and its cost (`host`: [`request_host`]).
    pub fn item<R: RequestView>(&self, req: &R, host: &str) -> Result<(Arc<Limiter>, f64), ProxyError> {
        let limiter = match self.template.is_fixed() {
            true => self.fixed_limiter(),
            false => templated_limiter(&self.limits, &self.template, req, host)?,
        };
        Ok((limiter, self.cost_of(req)))
    }

    /// The cost of `req`: read from its header when the route says so (at
    /// most the resource's burst), else the configured one.
    fn cost_of<R: RequestView>(&self, req: &R) -> f64 {
        let Some(h) = &self.cost_header else { return self.cost };
        self.capped(req.header(h).and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| v.trim().parse::<f64>().ok()))
    }

    /// A cost read from the request: at most the resource's burst; the
    /// configured one when there is none above 0.
    fn capped(&self, read: Option<f64>) -> f64 {
        match read {
            Some(c) if c.is_finite() && c > 0.0 => c.min(self.burst.max(1.0)),
            _ => self.cost,
        }
    }

    /// The limiter of a resource whose id is fixed.
    pub fn fixed_limiter(&self) -> Arc<Limiter> {
        self.fixed.get_or_init(|| self.limits.limiter(&self.template.text)).clone()
    }
}

/// Whether the keys of resource `r` take their routes-file capacity and
/// never lease it: a templated rate resource of a sidecar with no `doorman:`
/// section (an embedded server, whose only client is this sidecar, would
/// lease each key just that) that needs nothing else of the server. A
/// calendar window (allotments), an upstream's quota headers (the server
/// steers the capacity by them), a `wants` below the capacity and a gauge
/// keep their leases. Such a key ("local") holds no lease state and no
/// entry in the embedded server's store: a sidecar with a million tenants
/// holds a million limiters and nothing more.
pub fn is_local(cfg: &RoutesConfig, r: &ResourceConfig) -> bool {
    use usher_core::config::doorman::Wants;
    cfg.doorman.is_none()
        && r.kind == ResourceKind::Rate
        && !r.id.is_fixed()
        && !r.calendar
        && r.upstream_quota.is_none()
        && match r.lease.wants {
            None => true,
            Some(Wants::Fixed(w)) => w >= r.capacity.per_second(),
            Some(Wants::Auto) => false,
        }
}

/// The resource specs of a routes file, for [`LeaseTable::configure`].
pub fn specs(cfg: &RoutesConfig) -> Vec<ResourceSpec> {
    cfg.resources
        .values()
        .map(|r| ResourceSpec {
            name: r.name.clone(),
            kind: match r.kind {
                ResourceKind::Rate => Kind::Rate,
                ResourceKind::Gauge => Kind::Gauge,
            },
            capacity: match r.kind {
                ResourceKind::Rate => r.capacity.per_second(),
                ResourceKind::Gauge => r.capacity.per_window,
            },
            burst: r.burst,
            burst_span: r.burst_span,
            max_wait: r.max_wait,
            max_queue: r.max_queue,
            max_keys: r.max_keys,
            window: r.capacity.window,
            shared: cfg.doorman.is_some(),
            shadow: r.shadow,
            upstream_quota: r.upstream_quota.is_some(),
            templated: !r.id.is_fixed(),
        })
        .collect()
}

/// What routing reads of a request: implemented for [`http::Request`] (the
/// general path) and for the native HTTP/1.1 path's parsed request head,
/// which routes without building a header map.
pub trait RequestView {
    /// The request's method.
    fn method(&self) -> &Method;
    /// The host of an absolute-form target, if the request has one.
    fn uri_host(&self) -> Option<&str>;
    /// The target's path.
    fn path(&self) -> &str;
    /// The first value of the header `name` (lower-case).
    fn header(&self, name: &str) -> Option<&[u8]>;
}

impl<B> RequestView for Request<B> {
    fn method(&self) -> &Method {
        self.method()
    }

    fn uri_host(&self) -> Option<&str> {
        self.uri().host()
    }

    fn path(&self) -> &str {
        self.uri().path()
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().get(name).map(|v| v.as_bytes())
    }
}

/// The request's host, lower-case, without port: from the URI, else the Host header.
pub fn request_host<R: RequestView>(req: &R) -> Cow<'_, str> {
    let raw = req.uri_host().or_else(|| req.header(header::HOST.as_str()).and_then(visible_ascii)).unwrap_or_default();
    let host = match raw.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => raw.rsplit_once(':').map_or(raw, |(h, _)| h),
    };
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

/// A header value as text when it is visible ASCII (what `HeaderValue::to_str` accepts).
fn visible_ascii(v: &[u8]) -> Option<&str> {
    v.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b)).then(|| std::str::from_utf8(v).ok()).flatten()
}

/// The limiter of a templated resource for one request (`host` is
/// [`request_host`]): its id rendered, the key found or made. A 400 when the
/// id cannot be made (a header that is not UTF-8, an id over the servers'
/// limit), a 429 when the resource already tracks `max_keys` ids.
fn templated_limiter<R: RequestView>(
    limits: &ResourceLimits,
    t: &IdTemplate,
    req: &R,
    host: &str,
) -> Result<Arc<Limiter>, ProxyError> {
    let id = render(t, req, host).map_err(|header| {
        ProxyError::BadRequest(format!(
            "resource `{}`: the header `{header}` is not UTF-8 text, so no lease id can be made of it",
            limits.spec().name
        ))
    })?;
    limits.try_limiter(&id).map_err(ProxyError::from)
}

/// Renders a templated resource id for one request; the error is a header
/// the id takes whose value is not UTF-8. (Replacing its bytes, as a lossy
/// conversion would, could give two clients' different values one id: one
/// budget.)
fn render<'t, R: RequestView>(t: &'t IdTemplate, req: &R, host: &str) -> Result<String, &'t str> {
    let mut out = String::new();
    for s in &t.segments {
        match s {
            Segment::Literal(l) => out.push_str(l),
            Segment::Host => out.push_str(host),
            Segment::Method => out.push_str(req.method().as_str()),
            Segment::Path(n) => out.push_str(req.path().split('/').filter(|p| !p.is_empty()).nth(n - 1).unwrap_or("")),
            Segment::Header(h) => {
                out.push_str(std::str::from_utf8(req.header(h).unwrap_or_default()).map_err(|_| h.as_str())?)
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_templates_render_ids() {
        let req = Request::builder()
            .method("POST")
            .uri("http://API.example.com:8080/v1/repos/x")
            .header("x-tenant", "acme")
            .body(())
            .unwrap();
        let host = request_host(&req);
        assert_eq!(host, "api.example.com");
        let t = IdTemplate::parse("gh/{header.x-tenant}/{method}/{path.2}/{host}").unwrap();
        assert_eq!(render(&t, &req, &host), Ok("gh/acme/POST/repos/api.example.com".to_string()));
        let other = |v: &[u8]| {
            let req = Request::builder()
                .uri("/")
                .header("x-tenant", http::HeaderValue::from_bytes(v).unwrap())
                .body(())
                .unwrap();
            render(&t, &req, "h").map_err(str::to_string)
        };
        // UTF-8 beyond ASCII is kept as it is; other bytes make no id.
        assert_eq!(other("café".as_bytes()), Ok("gh/café/GET//h".to_string()));
        assert_eq!(other(b"\xff"), Err("x-tenant".to_string()));
        assert_eq!(other(b"\xfe"), Err("x-tenant".to_string()));
    }
}
