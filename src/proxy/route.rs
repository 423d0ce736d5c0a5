//! Routing: which route a request takes, the upstream it goes to, and the
//! admission [`Plan`] (limiter keys and costs) it must pass. Built from a
//! routes file; swapped whole on reload.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use http::{Method, Request, header};

use super::metrics::{Metrics, ResourceMetrics, RouteMetrics, SettleMetrics};
use super::respond::ProxyError;
use super::upstream::{Target, Upstream};
use crate::config::routes::{
    CostRule, DefaultAction, IdTemplate, Match, ResourceKind, RoutesConfig, Segment, SettleFrom,
};
use crate::limit::{Kind, LeaseTable, Limiter, Plan, ResourceLimits, ResourceSpec};

/// One compiled route. Everything a request needs that does not depend on
/// the request itself is resolved here once per routes file: the upstream,
/// the resources' limiters (a fixed id's on first use) and the metric handles.
pub struct Route {
    pub name: String,
    matcher: Match,
    upstream: Option<Arc<Upstream>>,
    pub resources: Vec<RouteResource>,
    pub metrics: RouteMetrics,
    /// How the route backs off when its upstream answers 429 or 503.
    pub pushback: crate::config::doorman::PushbackConfig,
    /// The plan of a route whose resource ids and costs are all fixed: the
    /// same for every request, so built on the first one.
    fixed_plan: Option<OnceLock<Plan>>,
    /// A resource settles its cost from the response (its head, or its JSON
    /// body): the engine keeps the response's head for it.
    pub settles: bool,
    /// A resource reads the upstream's quota headers (the head is kept too).
    pub quotas: bool,
    /// Set on an upstream listener's routes: that upstream, for the access log.
    pub listener: Option<String>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("name", &self.name).field("matcher", &self.matcher).finish()
    }
}

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
    /// Where the real cost is settled from, and how settling went.
    pub settle: Option<Arc<Settle>>,
    /// The resource's burst: a cost read from a request counts as at most this.
    burst: f64,
    /// The upstream's quota headers, when they steer the resource.
    pub quota: Option<Arc<crate::config::quota::UpstreamQuota>>,
    /// The limiter of a fixed id, found on the first request (fixed keys are never forgotten).
    fixed: OnceLock<Arc<Limiter>>,
    pub metrics: ResourceMetrics,
}

/// Where a route resource's real cost is settled from, and its counters.
pub struct Settle {
    pub from: SettleFrom,
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
            settle: rule
                .and_then(|c| c.settle.clone())
                .map(|from| Arc::new(Settle { from, metrics: metrics.settle(route, name) })),
            burst: res.burst,
            quota: res.upstream_quota.clone().map(Arc::new),
            fixed: OnceLock::new(),
            metrics: metrics.resource(name),
        })
    }

    /// The keys of `plan` (enforced, then shadow) that are this resource's,
    /// with the cost each was charged at admission.
    pub fn keys_in<'p>(&'p self, plan: &'p Plan) -> impl Iterator<Item = &'p (Arc<Limiter>, f64)> {
        plan.items.iter().chain(plan.shadow.iter()).filter(|(l, _)| self.limits.owns(l))
    }

    /// Whether every request gets the same key at the same cost.
    pub fn is_fixed(&self) -> bool {
        self.template.is_fixed() && self.cost_header.is_none()
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
        let named = req.header(h).and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| v.trim().parse::<f64>().ok());
        match named {
            Some(c) if c.is_finite() && c > 0.0 => c.min(self.burst.max(1.0)),
            _ => self.cost,
        }
    }

    /// The limiter of a resource whose id is fixed.
    pub fn fixed_limiter(&self) -> Arc<Limiter> {
        self.fixed.get_or_init(|| self.limits.limiter(&self.template.text)).clone()
    }
}

/// Where a request goes and what it must be admitted by.
#[derive(Debug)]
pub struct Resolved {
    /// The route taken; for a request no route matched (default passthrough), `_passthrough`.
    pub route: Arc<Route>,
    pub plan: Plan,
    pub target: Target,
}

impl Resolved {
    pub fn route_name(&self) -> &str {
        &self.route.name
    }
}

/// The routes of one routes file.
pub struct Routing {
    routes: Vec<Arc<Route>>,
    passthrough: Arc<Route>,
    default: DefaultAction,
    direct: Arc<Upstream>,
}

/// The listener a connection arrived on: the main one, or an upstream's own
/// (`upstreams.NAME.listen`), numbered from 1 in the order the sidecar
/// opened them. Small and `Copy`: a connection carries it to its stack.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerId(u16);

impl ListenerId {
    /// The proxy's main listener (`listen`, `--listen`).
    pub const MAIN: ListenerId = ListenerId(0);

    /// The listener of the `index`th (from 0) upstream listener.
    pub fn upstream(index: usize) -> ListenerId {
        ListenerId(u16::try_from(index + 1).expect("fewer than 65,535 upstream listeners"))
    }

    /// Which upstream listener this is (from 0); `None` for the main one.
    pub fn index(self) -> Option<usize> {
        usize::from(self.0).checked_sub(1)
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
            burst_one_second: r.burst_one_second,
            max_wait: r.max_wait,
            max_queue: r.max_queue,
            max_keys: r.max_keys,
            window: r.capacity.window,
            shared: cfg.doorman.is_some(),
            shadow: r.shadow,
            upstream_quota: r.upstream_quota.is_some(),
        })
        .collect()
}

/// The route name of requests no route matched, under the passthrough default.
pub const PASSTHROUGH: &str = "_passthrough";

impl Routing {
    /// Compiles `cfg`; `upstreams` are the built clients by name, `table`
    /// already configured with `cfg`'s resources.
    pub fn new(
        cfg: &RoutesConfig,
        upstreams: &HashMap<String, Arc<Upstream>>,
        direct: Arc<Upstream>,
        table: &LeaseTable,
        metrics: &Metrics,
    ) -> Self {
        Self::compile(cfg, None, upstreams, direct, table, metrics)
    }

    /// Compiles the routing of upstream `upstream`'s own listener: every
    /// request on it goes to that upstream, matched against its routes (in
    /// file order) with their `match.host` left out; one that none matches
    /// is a 403 (never passthrough: its Host is the sidecar's own), and no
    /// CONNECT finds a route (no route names a host). The main listener's
    /// request path is the same code: nothing on it asks which listener.
    pub fn for_upstream_listener(
        cfg: &RoutesConfig,
        upstream: &str,
        upstreams: &HashMap<String, Arc<Upstream>>,
        direct: Arc<Upstream>,
        table: &LeaseTable,
        metrics: &Metrics,
    ) -> Self {
        Self::compile(cfg, Some(upstream), upstreams, direct, table, metrics)
    }

    fn compile(
        cfg: &RoutesConfig,
        listener_of: Option<&str>,
        upstreams: &HashMap<String, Arc<Upstream>>,
        direct: Arc<Upstream>,
        table: &LeaseTable,
        metrics: &Metrics,
    ) -> Self {
        let routes = cfg
            .routes
            .iter()
            .filter(|r| listener_of.is_none_or(|up| r.upstream.as_deref() == Some(up)))
            .map(|r| {
                let mut matcher = r.matcher.clone();
                if listener_of.is_some() {
                    // The listener says where a request goes, not its Host.
                    matcher.host = None;
                }
                Arc::new(Route {
                    name: r.name.clone(),
                    matcher,
                    upstream: r.upstream.as_ref().and_then(|u| upstreams.get(u).cloned()),
                    resources: r
                        .resources
                        .iter()
                        // Validated at load: every named resource exists, and the table has it.
                        .filter_map(|(name, cost)| {
                            RouteResource::new(cfg, &r.name, name, *cost, r.cost_rules.get(name), table, metrics)
                        })
                        .collect(),
                    metrics: metrics.route(&r.name),
                    pushback: r.pushback,
                    fixed_plan: r
                        .resources
                        .iter()
                        .all(|(name, _)| {
                            cfg.resources.get(name).is_some_and(|res| res.id.is_fixed())
                                && r.cost_rules.get(name).is_none_or(|c| c.header.is_none())
                        })
                        .then(OnceLock::new),
                    settles: r.cost_rules.values().any(|c| c.settle.is_some()),
                    quotas: r.resources.iter().any(|(name, _)| cfg.resources[name].upstream_quota.is_some()),
                    listener: listener_of.map(str::to_string),
                })
            })
            .collect();
        let passthrough = Arc::new(Route {
            name: PASSTHROUGH.into(),
            matcher: Match::default(),
            upstream: None,
            resources: Vec::new(),
            metrics: metrics.route(PASSTHROUGH),
            pushback: Default::default(),
            fixed_plan: None,
            settles: false,
            quotas: false,
            listener: None,
        });
        let default = if listener_of.is_some() { DefaultAction::Deny } else { cfg.default };
        Routing { routes, passthrough, default, direct }
    }

    /// Resolves a request to its route, target and plan.
    pub fn resolve<B>(&self, req: &Request<B>) -> Result<Resolved, ProxyError> {
        if req.method() == Method::CONNECT {
            let host = request_host(req);
            let authority = req.uri().authority().map(|a| a.to_string()).unwrap_or_default();
            // CONNECT goes only to hosts a route names, whatever the default.
            let route = self
                .routes
                .iter()
                .find(|r| r.matcher.host.as_deref().is_some_and(|h| host_matches(h, &host)))
                .ok_or_else(|| ProxyError::ConnectDenied { authority, host: host.to_string() })?;
            return resolved(route, req, &host, Target::Direct(self.direct.clone()));
        }
        self.resolve_view(req)
    }

    /// Resolves a request other than CONNECT, seen through [`RequestView`].
    pub fn resolve_view<R: RequestView>(&self, req: &R) -> Result<Resolved, ProxyError> {
        let host = request_host(req);
        let path = req.path();
        match self.routes.iter().find(|r| matches(&r.matcher, req, &host, path)) {
            Some(route) => {
                let target = match &route.upstream {
                    Some(u) => Target::Upstream(u.clone()),
                    None => Target::Direct(self.direct.clone()),
                };
                resolved(route, req, &host, target)
            }
            None if self.default == DefaultAction::Passthrough => Ok(Resolved {
                route: self.passthrough.clone(),
                plan: Plan::default(),
                target: Target::Direct(self.direct.clone()),
            }),
            None => Err(ProxyError::NoRoute {
                method: req.method().to_string(),
                host: host.into_owned(),
                path: path.to_string(),
            }),
        }
    }
}

/// What routing reads of a request: implemented for [`http::Request`] (the
/// general path) and for the native HTTP/1.1 path's parsed request head,
/// which routes without building a header map.
pub trait RequestView {
    fn method(&self) -> &Method;
    /// The host of an absolute-form target, if the request has one.
    fn uri_host(&self) -> Option<&str>;
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

fn resolved<R: RequestView>(route: &Arc<Route>, req: &R, host: &str, target: Target) -> Result<Resolved, ProxyError> {
    if let Some(fixed) = &route.fixed_plan {
        let plan =
            fixed.get_or_init(|| Plan::new(route.resources.iter().map(|r| (r.fixed_limiter(), r.cost)).collect()));
        return Ok(Resolved { route: route.clone(), plan: plan.clone(), target });
    }
    let mut items = Vec::with_capacity(route.resources.len());
    for r in &route.resources {
        items.push(r.item(req, host)?);
    }
    Ok(Resolved { route: route.clone(), plan: Plan::new(items), target })
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

fn host_matches(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            host.len() > suffix.len() + 1 && host.ends_with(suffix) && host[..host.len() - suffix.len()].ends_with('.')
        }
        None => pattern == host,
    }
}

fn matches<R: RequestView>(m: &Match, req: &R, host: &str, path: &str) -> bool {
    m.host.as_deref().is_none_or(|h| host_matches(h, host))
        && m.path_prefix.as_deref().is_none_or(|p| path.starts_with(p))
        && (m.methods.is_empty() || m.methods.contains(req.method()))
        && m.headers.iter().all(|(name, value)| match (req.header(name.as_str()), value) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(got), Some(want)) => got == want.as_bytes(),
        })
}

/// The limiter of a templated resource for one request (`host` is
/// [`request_host`]): its id rendered, the key found or made. A 400 when the
/// id cannot be made (a header that is not UTF-8, an id over the servers'
/// limit), a 429 when the resource already tracks `max_keys` ids.
pub fn templated_limiter<R: RequestView>(
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
    fn hosts_and_templates() {
        assert!(host_matches("*.example.com", "api.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
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
