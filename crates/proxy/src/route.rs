//! Routing: which route a request takes, the upstream it goes to, and the
//! admission [`Plan`] (limiter keys and costs) it must pass. Built from a
//! routes file; swapped whole on reload.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use http::{Method, Request};

use super::upstream::{Target, Upstream};
use usher_core::config::routes::{CostRule, DefaultAction, Match, RouteConfig, RoutesConfig};
use usher_enforce::metrics::{Metrics, RequestBodyMetrics, RouteMetrics};
use usher_enforce::resource::{RequestView, RouteResource, request_host};
use usher_enforce::respond::ProxyError;
use usher_limit::{LeaseTable, Plan};

/// One compiled route. Everything a request needs that does not depend on
/// the request itself is resolved here once per routes file: the upstream,
/// the resources' limiters (a fixed id's on first use) and the metric handles.
pub struct Route {
    /// The route's name in the routes file, and its metrics' `route` label.
    pub name: String,
    matcher: Match,
    upstream: Option<Arc<Upstream>>,
    /// The resources a request on this route is admitted by.
    pub resources: Arc<[RouteResource]>,
    /// The route's metric handles, resolved once.
    pub metrics: RouteMetrics,
    /// How the route backs off when its upstream answers 429 or 503.
    pub pushback: usher_core::config::doorman::PushbackConfig,
    /// The plan of a route whose resource ids and costs are all fixed: the
    /// same for every request, so built on the first one.
    fixed_plan: Option<OnceLock<Plan>>,
    /// A resource settles its cost from the response (its head, or its JSON
    /// body): the engine keeps the response's head for it.
    pub settles: bool,
    /// A resource reads the upstream's quota headers (the head is kept too).
    pub quotas: bool,
    /// The route reads the request's body before admission (a cost taken
    /// from it, or OpenAI's usage asked for); none for every other route.
    pub body: Option<BodyReads>,
    /// Set on an upstream listener's routes: that upstream, for the access log.
    pub listener: Option<String>,
    /// The API the route leads to, whose error shape usher's own answers
    /// take ([`RoutesConfig::api_dialect`]).
    pub dialect: Option<usher_enforce::respond::ApiDialect>,
}

impl Route {
    /// The upstream's `timeout` (the default one for the origins a request names).
    pub fn timeout(&self) -> std::time::Duration {
        self.upstream.as_ref().map_or(usher_core::config::routes::DEFAULT_TIMEOUT, |u| u.config.timeout)
    }
}

/// What a route reads the request's body for.
pub struct BodyReads {
    /// A resource settles from OpenAI's usage: a streamed Chat Completions
    /// request is made to ask for it.
    pub ask_usage: bool,
    /// `usher_proxy_request_body_total` of the route, by outcome.
    pub metrics: RequestBodyMetrics,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("name", &self.name).field("matcher", &self.matcher).finish()
    }
}

/// Where a request goes and what it must be admitted by.
#[derive(Debug)]
pub struct Resolved {
    /// The route taken; for a request no route matched (default passthrough), `_passthrough`.
    pub route: Arc<Route>,
    /// The keys and costs the request must be admitted by.
    pub plan: Plan,
    /// Where the request goes once admitted.
    pub target: Target,
}

impl Resolved {
    /// The route's name.
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
                                && r.cost_rules.get(name).is_none_or(|c| c.header.is_none() && c.body.is_none())
                        })
                        .then(OnceLock::new),
                    settles: r.cost_rules.values().any(|c| c.settle.is_some()),
                    quotas: r.resources.iter().any(|(name, _)| cfg.resources[name].upstream_quota.is_some()),
                    body: body_reads(r, metrics),
                    listener: listener_of.map(str::to_string),
                    dialect: cfg.api_dialect(r),
                })
            })
            .collect();
        let passthrough = Arc::new(Route {
            name: PASSTHROUGH.into(),
            matcher: Match::default(),
            upstream: None,
            resources: Arc::new([]),
            metrics: metrics.route(PASSTHROUGH),
            pushback: Default::default(),
            fixed_plan: None,
            settles: false,
            quotas: false,
            body: None,
            listener: None,
            dialect: None,
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

/// What route `r` reads the request's body for; None when nothing.
fn body_reads(r: &RouteConfig, metrics: &Metrics) -> Option<BodyReads> {
    let costs = r.cost_rules.values().any(|c| c.body.is_some());
    let ask_usage = r.cost_rules.values().any(CostRule::wants_openai_usage);
    (costs || ask_usage).then(|| BodyReads { ask_usage, metrics: metrics.request_body(&r.name) })
}

fn resolved<R: RequestView>(route: &Arc<Route>, req: &R, host: &str, target: Target) -> Result<Resolved, ProxyError> {
    if let Some(fixed) = &route.fixed_plan {
        let plan =
            fixed.get_or_init(|| Plan::new(route.resources.iter().map(|r| (r.fixed_limiter(), r.cost)).collect()));
        return Ok(Resolved { route: route.clone(), plan: plan.clone(), target });
    }
    let mut items = Vec::with_capacity(route.resources.len());
    for r in route.resources.iter() {
        items.push(r.item(req, host)?);
    }
    Ok(Resolved { route: route.clone(), plan: Plan::new(items), target })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        assert!(host_matches("*.example.com", "api.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
        assert!(host_matches("api.example.com", "api.example.com"));
    }
}
