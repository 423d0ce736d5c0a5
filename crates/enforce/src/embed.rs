//! usher's limiter inside your own Rust service: lease capacity from a
//! Doorman tree (real `usher server`s, or an embedded capacity server) and
//! enforce it in-process, with no sidecar hop.
//!
//! - [`Limits`]: the lease-client handle. It enforces the resources of a
//!   routes file's `resources:` section and leases their capacity from the
//!   servers its `doorman:` section names, or, without one, from an embedded
//!   capacity server ([`Source`] tells which). Same code, same settings and
//!   same defaults as `usher proxy` (docs/proxy.md, "The routes file").
//! - [`LimitLayer`]: a tower layer admitting each request by one resource
//!   (a templated id is rendered from the request, as in the sidecar), and
//!   answering a refusal itself with the ready-made response.
//! - [`Refusal`]: a typed refusal, with that response: `429` with
//!   `Retry-After`, `RateLimit-Policy`, `RateLimit` and a problem+json body,
//!   or for gRPC requests `grpc-status: 8` (RESOURCE_EXHAUSTED).
//! - [`Limits::outcomes`] and [`Limits::registry`]: what each resource
//!   decided, as the sidecar counts it.
//! - [`RoutesConfig`]: the routes file [`Limits::start`] takes (only its
//!   `resources:` and `doorman:` sections are read).
//!
//! The embedded capacity server is the `embedded-server` feature, on by
//! default; without it a routes file needs `doorman:` ([`EmbeddedServerOff`]).
//! The [crate docs](crate#in-a-rust-service) show both dependencies, and
//! `examples/axum_limited.rs` an axum service.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! # if cfg!(not(feature = "embedded-server")) { return Ok(()) }
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use usher_enforce::embed::{Limits, RoutesConfig};
//!
//! // No `doorman:` section: an embedded capacity server hands out the capacity.
//! // Add `doorman: { servers: [capacity:15100], client_id: my-service }` to
//! // lease it from usher servers instead.
//! let config = RoutesConfig::parse("limits.yaml", "resources:\n  api: { kind: rate, capacity: 2/s, burst: 2 }\n")?;
//! let limits = Limits::start(config).await?;
//!
//! let hello = tower::service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("hello"))))
//! });
//! let mut svc = ServiceBuilder::new().layer(limits.layer("api")?).service(hello);
//! let mut statuses = Vec::new();
//! for _ in 0..3 {
//!     let req = http::Request::new(String::new());
//!     statuses.push(svc.ready().await?.call(req).await?.status().as_u16());
//! }
//! // A burst of 2, then the third is refused with the ready-made 429.
//! assert_eq!(statuses, [200, 200, 429]);
//! limits.shutdown().await;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Shared third-party quotas
//!
//! A resource with `upstream_quota:` reads the quota headers of each answer
//! of the inner service, as the sidecar reads its upstream's. The quota goes
//! into the keys and up the tree, so every service leasing the resource
//! follows it. An answer that says the quota is spent (a `429`, or a `403`
//! with nothing remaining, as GitHub answers) holds the keys until the reset.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! # if cfg!(not(feature = "embedded-server")) { return Ok(()) }
//! use tower::{ServiceBuilder, ServiceExt};
//! use usher_enforce::embed::{Limits, RoutesConfig};
//!
//! let config = RoutesConfig::parse(
//!     "limits.yaml",
//!     "resources:\n  github: { kind: rate, capacity: 5000/h, upstream_quota: { headers: github } }\n",
//! )?;
//! let limits = Limits::start(config).await?;
//! // Stands in for a GitHub client: the quota is spent until a minute from now.
//! let github = tower::service_fn(|_req: http::Request<String>| async {
//!     let reset = usher_core::clock::Clock::system().now().as_secs() + 60;
//!     let answer = http::Response::builder()
//!         .status(403)
//!         .header("x-ratelimit-limit", "5000")
//!         .header("x-ratelimit-remaining", "0")
//!         .header("x-ratelimit-reset", reset.to_string())
//!         .body(http_body_util::Full::new(bytes::Bytes::new()));
//!     Ok::<_, std::convert::Infallible>(answer.unwrap())
//! });
//! let svc = ServiceBuilder::new().layer(limits.layer("github")?).service(github);
//! let first = svc.clone().oneshot(http::Request::new(String::new())).await?;
//! assert_eq!(first.status(), 403);
//! // Held until the reset: refused without calling GitHub.
//! let second = svc.oneshot(http::Request::new(String::new())).await?;
//! assert_eq!(second.status(), 429);
//! assert!(second.headers()["retry-after"].to_str()?.parse::<u64>()? > 50);
//! limits.shutdown().await;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Costs, and settling them from the answer
//!
//! [`Limits::layer_with_cost`] charges a fixed cost. [`LimitLayer::cost_from_header`]
//! charges what a request header names (the routes file's `cost:
//! "{header.NAME}"`), and [`LimitLayer::settle_from_header`] settles the real
//! cost from a header of the answer (`settle: { response_header: NAME }`):
//! what was charged too much is given back, what was charged too little is
//! owed.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! # if cfg!(not(feature = "embedded-server")) { return Ok(()) }
//! use http::HeaderName;
//! use tower::{ServiceBuilder, ServiceExt};
//! use usher_enforce::embed::{Limits, RoutesConfig};
//!
//! let config = RoutesConfig::parse("limits.yaml", "resources:\n  tokens: { kind: rate, capacity: 1000/min, burst: 1000 }\n")?;
//! let limits = Limits::start(config).await?;
//! // Stands in for an LLM client: every request uses 300 tokens.
//! let llm = tower::service_fn(|_req: http::Request<String>| async {
//!     let answer = http::Response::builder().header("x-usage-total-tokens", "300");
//!     Ok::<_, std::convert::Infallible>(answer.body(http_body_util::Full::new(bytes::Bytes::new())).unwrap())
//! });
//! let layer = limits
//!     .layer("tokens")?
//!     .cost_from_header(HeaderName::from_static("x-max-tokens"))
//!     .settle_from_header(HeaderName::from_static("x-usage-total-tokens"));
//! let svc = ServiceBuilder::new().layer(layer).service(llm);
//! let mut statuses = Vec::new();
//! for _ in 0..3 {
//!     let req = http::Request::builder().header("x-max-tokens", "600").body(String::new())?;
//!     statuses.push(svc.clone().oneshot(req).await?.status().as_u16());
//! }
//! // 600 charged, 300 given back, twice; then 400 are left, not 600.
//! assert_eq!(statuses, [200, 200, 429]);
//! limits.shutdown().await;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Shadow mode
//!
//! A resource with `shadow: true` makes every decision as if enforced and
//! forwards every request: [`Limits::outcomes`] counts what it would have
//! refused, and so does `usher_proxy_resource_requests_total{outcome="shadow_refused"}`
//! in [`Limits::registry`].
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! # if cfg!(not(feature = "embedded-server")) { return Ok(()) }
//! use tower::{ServiceBuilder, ServiceExt};
//! use usher_enforce::embed::{Limits, RoutesConfig};
//!
//! let config = RoutesConfig::parse("limits.yaml", "resources:\n  api: { kind: rate, capacity: 2/s, burst: 2, shadow: true }\n")?;
//! let limits = Limits::start(config).await?;
//! let hello = tower::service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("hello"))))
//! });
//! let svc = ServiceBuilder::new().layer(limits.layer("api")?).service(hello);
//! for _ in 0..3 {
//!     let resp = svc.clone().oneshot(http::Request::new(String::new())).await?;
//!     assert_eq!(resp.status(), 200);
//! }
//! assert_eq!(limits.outcomes("api").map(|o| o.shadow_refused), Some(1));
//! limits.shutdown().await;
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use hyper::body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio_util::sync::CancellationToken;
use tower::{Layer, Service};

use crate::metrics::Metrics;
use crate::resource::{self as route, RouteResource, Settle};
use crate::respond::BoxError;
use crate::respond::ProxyBody;
use crate::respond::{self, ProxyError};
use crate::{enforcer as lease, feedback, pushback, settle};
use usher_core::clock::Clock;
use usher_core::config::doorman::PushbackConfig;
use usher_core::config::routes::SettleFrom;
use usher_lease::LeaseClient;
use usher_limit::LeaseTable;
use usher_limit::admit::{self, Admission, Admitted, Plan, Reason, Shadow};

pub use crate::enforcer::{EmbeddedServerOff, Wiring};
pub use usher_core::config::routes::RoutesConfig;
pub use usher_lease::driver::Runs;
pub use usher_limit::Refused;

/// How long [`Limits::start`] waits for the first leases before enforcing
/// the resources' `on_expiry` capacity (as `usher proxy` does).
pub const FIRST_LEASE_WAIT: Duration = crate::FIRST_LEASE_WAIT;

/// Where capacity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An in-process capacity server, configured from the resources' capacities.
    Embedded,
    /// Doorman (or `usher server`) servers.
    Remote {
        /// Their addresses.
        servers: Vec<String>,
        /// The id these limits lease as.
        client_id: String,
    },
}

/// The lease-client handle: the resources it enforces and the lease client
/// that keeps their capacity. Cheap to clone.
#[derive(Clone)]
pub struct Limits {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<RoutesConfig>,
    table: Arc<LeaseTable>,
    client: LeaseClient,
    /// Every resource as a layer admits by it (one unit a request).
    resources: HashMap<String, Resource>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Limits {
    /// Starts enforcing `config`'s resources and leasing their capacity;
    /// returns once the first leases are in, or after [`FIRST_LEASE_WAIT`]
    /// (from then on a key without a lease follows its `on_expiry`).
    /// Needs a tokio runtime. Fails only without the `embedded-server`
    /// feature, for a `config` without `doorman:`.
    pub async fn start(config: RoutesConfig) -> Result<Limits, EmbeddedServerOff> {
        Limits::start_wired(config, Clock::system(), lease::Wiring::default()).await
    }

    /// [`Limits::start`] on `clock`, wired to its servers and runtime as
    /// `wiring` says: for a simulation that runs many services in one
    /// process in virtual time (a manual clock, an in-process transport to
    /// real capacity servers, the lease client on the test's runtime).
    pub async fn start_wired(
        config: RoutesConfig,
        clock: Clock,
        wiring: lease::Wiring,
    ) -> Result<Limits, EmbeddedServerOff> {
        let table = Arc::new(LeaseTable::new(clock.clone()));
        table.configure(route::specs(&config));
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(Metrics::new(registry.clone()));
        let pushback = Arc::new(pushback::Pushback::new(&registry));
        let shared =
            Arc::new(Shared { clock, table: table.clone(), pushback: pushback.clone(), metrics: metrics.clone() });
        let resources = config
            .resources
            .keys()
            .filter_map(|name| {
                let r = RouteResource::new(&config, EMBED_ROUTE, name, 1.0, None, &table, &metrics)?;
                Some((name.clone(), Resource::new(r, shared.clone())))
            })
            .collect();
        let config = Arc::new(config);
        let source = config.clone();
        let stop = CancellationToken::new();
        let (client, task) = lease::start_wired(
            Arc::new(move || source.clone()),
            table.clone(),
            pushback,
            &registry,
            stop.clone(),
            wiring,
        )?;
        // Every key leased (at once from a cache), or the first call answered or failed, or the wait over.
        client.ready(FIRST_LEASE_WAIT).await;
        Ok(Limits {
            inner: Arc::new(Inner {
                config,
                table,
                client,
                resources,
                metrics,
                stop,
                task: std::sync::Mutex::new(Some(task)),
            }),
        })
    }

    /// Where capacity comes from.
    pub fn source(&self) -> Source {
        match &self.inner.config.doorman {
            None => Source::Embedded,
            Some(d) => Source::Remote { servers: d.servers.clone(), client_id: d.client_id.clone() },
        }
    }

    /// The lease client: its status (master, last error, each key's lease).
    pub fn lease_client(&self) -> &LeaseClient {
        &self.inner.client
    }

    /// The capacity `id` (a resource id) may use now: units per second
    /// (rate) or in flight (gauge); `None` for an id nothing has used yet.
    pub fn capacity(&self, id: &str) -> Option<f64> {
        self.inner.table.limiters().into_iter().find(|(_, l)| l.id() == id).map(|(_, l)| l.capacity())
    }

    /// The units `id` (a resource id) could admit now without waiting;
    /// `None` for an id nothing has used yet.
    pub fn remaining(&self, id: &str) -> Option<u64> {
        self.inner.table.limiters().into_iter().find(|(_, l)| l.id() == id).map(|(_, l)| l.remaining())
    }

    /// What `resource`'s layers and admissions decided since the start;
    /// `None` for a resource the configuration does not name.
    pub fn outcomes(&self, resource: &str) -> Option<Outcomes> {
        let r = self.inner.resources.get(resource)?;
        let m = &r.route.metrics;
        // Read only for a shadow resource: reading makes the series.
        let shadow = r.shared.table.resource(resource).is_some_and(|l| l.spec().shadow);
        Some(Outcomes {
            admitted: m.admitted.get(),
            paced: m.paced.get(),
            refused: m.refused.get(),
            shadow_refused: match shadow {
                true => self.inner.metrics.resource_requests.with_label_values(&[resource, SHADOW_REFUSED]).get(),
                false => 0,
            },
        })
    }

    /// The Prometheus registry of these limits: the lease client's series,
    /// upstream pushback's, and the sidecar's per resource:
    /// `usher_proxy_resource_requests_total{resource, outcome}` (the
    /// [`Outcomes`]), `usher_proxy_wait_seconds` and `usher_proxy_upstream_quota`.
    /// Serve it, or gather it into your own.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.inner.metrics.registry
    }

    /// A tower layer admitting every request by `resource`, one unit each
    /// (see [`LimitLayer`] for other costs).
    pub fn layer(&self, resource: &str) -> Result<LimitLayer, UnknownResource> {
        let r = self.inner.resources.get(resource).ok_or_else(|| UnknownResource(resource.to_string()))?;
        Ok(LimitLayer { resource: Arc::new(r.clone()) })
    }

    /// A tower layer admitting every request by `resource`, `cost` units each.
    pub fn layer_with_cost(&self, resource: &str, cost: f64) -> Result<LimitLayer, UnknownResource> {
        Ok(self.layer(resource)?.with(|r| r.cost = cost))
    }

    /// Admits `cost` units of `resource` (a fixed id) outside any tower
    /// stack; the permit holds gauge capacity until dropped. A shadow
    /// resource admits every request and counts what it would refuse.
    pub async fn admit(&self, resource: &str, cost: f64) -> Result<Permit, Refusal> {
        let r = self.inner.resources.get(resource).ok_or_else(|| Refusal::unknown(resource))?;
        let plan = Plan::new(vec![(r.route.fixed_limiter(), cost)]);
        match admit::start(&plan, &r.shared.clock).await {
            Ok(a) => Ok(r.admitted(a, &plan)),
            Err(refused) => Err(r.refused(refused, &plan)),
        }
    }

    /// Stops leasing and gives every lease back to its server.
    pub async fn shutdown(self) {
        self.inner.stop.cancel();
        let task = self.inner.task.lock().expect("task lock").take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The outcome label of a request a shadow resource would have refused.
const SHADOW_REFUSED: &str = "shadow_refused";

/// What one resource decided, by outcome: the counts of
/// `usher_proxy_resource_requests_total{resource, outcome}`, as the sidecar
/// counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// Requests admitted at once (every request of a shadow resource).
    pub admitted: u64,
    /// Requests admitted after waiting for capacity.
    pub paced: u64,
    /// Requests refused.
    pub refused: u64,
    /// Requests a shadow resource would have refused: admitted all the same.
    pub shadow_refused: u64,
}

/// A resource the configuration does not name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no resource `{0}` in the configuration")]
pub struct UnknownResource(pub String);

/// Why a request was not admitted, and the answer to give it.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// No capacity in time (or too many waiting, or capacity 0, or the
    /// upstream said its quota is spent).
    #[error("{0}")]
    Refused(Refused),
    /// Routing-side refusals: a templated resource at its `max_keys`, an unknown resource.
    #[error("{0}")]
    Other(ProxyError),
}

impl Refusal {
    fn unknown(resource: &str) -> Self {
        Refusal::Other(ProxyError::BadRequest(UnknownResource(resource.to_string()).to_string()))
    }

    /// The ready-made answer: `429` with `Retry-After`, `RateLimit-Policy`,
    /// `RateLimit` and a problem+json body, or for gRPC (`grpc`) a
    /// trailers-only `RESOURCE_EXHAUSTED`.
    pub fn response(&self, grpc: bool) -> Response<ProxyBody> {
        match self {
            Refusal::Refused(r) => respond::refused(r, grpc),
            Refusal::Other(e) => respond::proxy_error(e, grpc),
        }
    }
}

/// An admitted request's hold on its resource: gauge capacity (its own, or
/// what a shadow resource would have held) until dropped.
#[derive(Debug)]
pub struct Permit {
    admitted: Admitted,
    shadow: Option<Shadow>,
}

impl Permit {
    /// How long the request waited for capacity.
    pub fn waited(&self) -> Duration {
        self.admitted.waited
    }

    /// Whether a shadow resource would have refused the request.
    pub fn shadow_refused(&self) -> bool {
        self.shadow.as_ref().is_some_and(|s| s.refused.is_some())
    }
}

// === impl Resource ===

/// The route label of embed's settle counters (`usher_proxy_settles_total`).
const EMBED_ROUTE: &str = "embed";

/// What every layer of one [`Limits`] shares; never the lease client, which
/// a layer does not keep running.
struct Shared {
    clock: Clock,
    table: Arc<LeaseTable>,
    pushback: Arc<pushback::Pushback>,
    metrics: Arc<Metrics>,
}

/// One resource as a layer admits by it: a route of one resource, as the
/// sidecar compiles it.
#[derive(Clone)]
struct Resource {
    route: RouteResource,
    /// The plan when every request gets the same one (a fixed id and cost).
    fixed: Option<Plan>,
    shared: Arc<Shared>,
}

impl Resource {
    fn new(route: RouteResource, shared: Arc<Shared>) -> Self {
        let fixed = route.is_fixed().then(|| Plan::new(vec![(route.fixed_limiter(), route.cost)]));
        Resource { route, fixed, shared }
    }

    fn plan<B>(&self, req: &Request<B>) -> Result<Plan, ProxyError> {
        if let Some(p) = &self.fixed {
            return Ok(p.clone());
        }
        Ok(Plan::new(vec![self.route.item(req, &route::request_host(req))?]))
    }

    /// Whether the inner service's answer is read: the upstream's quota, a settled cost.
    fn reads_answer(&self) -> bool {
        self.route.quota.is_some() || self.route.settle.is_some()
    }

    /// Admitted: a shadow resource decides now (it never holds the request
    /// back), and the outcome is counted.
    fn admitted(&self, admitted: Admitted, plan: &Plan) -> Permit {
        let shadow = admit::shadow(plan, &self.shared.clock);
        let m = &self.route.metrics;
        if admitted.paced { &m.paced } else { &m.admitted }.inc();
        m.wait.observe(admitted.waited.as_secs_f64());
        if let Some(Shadow { refused: Some(resource), would_wait, .. }) = &shadow {
            self.shared.metrics.resource_requests.with_label_values(&[resource, SHADOW_REFUSED]).inc();
            tracing::debug!(%resource, ?would_wait, "a shadow resource would have refused a request");
        }
        Permit { admitted, shadow }
    }

    /// Refused: counted; while the upstream holds a key of the plan (its
    /// quota is spent), the refusal says so and when the hold ends.
    fn refused(&self, r: Refused, plan: &Plan) -> Refusal {
        self.route.metrics.refused.inc();
        let now = self.shared.clock.now();
        let hold = plan.items.iter().filter_map(|(l, _)| self.shared.pushback.hold_left(l.id(), now)).max();
        Refusal::Refused(match hold {
            Some(hold) => Refused { reason: Reason::Held, retry_after: r.retry_after.max(hold), ..r },
            None => r,
        })
    }

    /// Reads the inner service's answer as the sidecar reads its upstream's:
    /// the quota it reports (a hold when it is spent), and the settled cost.
    fn answered<B>(&self, plan: &Plan, resp: &Response<B>) {
        let header = |name: &str| resp.headers().get(name).map(|v| v.as_bytes());
        let resources = std::slice::from_ref(&self.route);
        let Shared { table, pushback, .. } = &*self.shared;
        let retry_after = pushback::retry_after(resp.headers());
        if let Some(hold) = feedback::observe_quota(resources, plan, resp.status(), retry_after, &header, table.clock())
        {
            let cfg = PushbackConfig::default();
            feedback::hold_spent(pushback, table, plan, hold, &cfg, &self.route.metrics.name);
        }
        settle::from_headers(resources, plan, resp.status(), &header);
    }
}

// === impl LimitLayer ===

/// Admits requests by one resource (see [`Limits::layer`]). Every clone
/// shares one budget: the limiter state lives in the [`Limits`], never here.
///
/// The inner service's answer is read as the sidecar reads its upstream's:
/// with the resource's `upstream_quota:`, the quota it reports goes into
/// the keys (and up the tree), and an answer that says the quota is spent
/// holds the keys until its reset.
#[derive(Clone)]
pub struct LimitLayer {
    resource: Arc<Resource>,
}

impl LimitLayer {
    /// Charges each request the cost its header `name` holds (the routes
    /// file's `cost: "{header.NAME}"`): a number above 0, at most the
    /// resource's burst; the layer's own cost when the header is absent or
    /// holds none. See the [module docs](self#costs-and-settling-them-from-the-answer).
    pub fn cost_from_header(self, name: HeaderName) -> Self {
        self.with(|r| r.cost_header = Some(name.as_str().to_string()))
    }

    /// Settles each request's cost from the inner service's response
    /// header `name` (the routes file's `settle: { response_header: NAME }`):
    /// the difference from what was charged at admission is charged to the
    /// key, or given back. A response without it settles nothing. See the
    /// [module docs](self#costs-and-settling-them-from-the-answer).
    pub fn settle_from_header(self, name: HeaderName) -> Self {
        let metrics = self.resource.shared.metrics.settle(EMBED_ROUTE, &self.resource.route.metrics.name);
        let from = SettleFrom::Header(name.as_str().to_string());
        self.with(|r| r.settle = Some(Arc::new(Settle { from, metrics })))
    }

    fn with(self, f: impl FnOnce(&mut RouteResource)) -> Self {
        let mut route = self.resource.route.clone();
        f(&mut route);
        LimitLayer { resource: Arc::new(Resource::new(route, self.resource.shared.clone())) }
    }
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;
    fn layer(&self, inner: S) -> Limit<S> {
        Limit { inner, resource: self.resource.clone() }
    }
}

/// The service [`LimitLayer`] makes.
#[derive(Clone)]
pub struct Limit<S> {
    inner: S,
    resource: Arc<Resource>,
}

impl<S, B, RB> Service<Request<B>> for Limit<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    type Response = Response<LimitBody<RB>>;
    type Error = S::Error;
    type Future = LimitFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let grpc = respond::is_grpc(req.headers());
        let plan = match self.resource.plan(&req) {
            Ok(p) => p,
            Err(e) => {
                let state = State::Answered { resp: Some(respond::proxy_error(&e, grpc)) };
                return LimitFuture { state, resource: self.resource.clone(), plan: Plan::default() };
            }
        };
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let admission = admit::start(&plan, &self.resource.shared.clock);
        let state = State::Admitting { admission, pending: Some((inner, req)), grpc };
        LimitFuture { state, resource: self.resource.clone(), plan }
    }
}

pin_project! {
    /// Admits, then calls the inner service and reads its answer.
    pub struct LimitFuture<S: Service<Request<B>>, B> {
        #[pin]
        state: State<S, B>,
        resource: Arc<Resource>,
        plan: Plan,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<Request<B>>, B> {
        Answered { resp: Option<Response<ProxyBody>> },
        Admitting { admission: Admission, pending: Option<(S, Request<B>)>, grpc: bool },
        Calling { #[pin] fut: S::Future, permit: Option<Permit> },
    }
}

impl<S, B, RB> Future for LimitFuture<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    type Output = Result<Response<LimitBody<RB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Answered { resp } => {
                    let resp = resp.take().expect("polled after completion");
                    return Poll::Ready(Ok(resp.map(LimitBody::refused)));
                }
                StateProj::Admitting { admission, pending, grpc } => {
                    let grpc = *grpc;
                    match ready!(Pin::new(admission).poll(cx)) {
                        Ok(a) => {
                            let permit = this.resource.admitted(a, this.plan);
                            let (mut svc, req) = pending.take().expect("request pending");
                            let fut = svc.call(req);
                            this.state.set(State::Calling { fut, permit: Some(permit) });
                        }
                        Err(r) => {
                            let resp = this.resource.refused(r, this.plan).response(grpc);
                            this.state.set(State::Answered { resp: Some(resp) });
                        }
                    }
                }
                StateProj::Calling { fut, permit } => {
                    let resp = ready!(fut.poll(cx))?;
                    if this.resource.reads_answer() {
                        this.resource.answered(this.plan, &resp);
                    }
                    let permit = permit.take();
                    return Poll::Ready(Ok(resp.map(|body| LimitBody::admitted(body, permit))));
                }
            }
        }
    }
}

pin_project! {
    /// A limited service's response body: the inner one, holding the
    /// request's [`Permit`] (gauge capacity) until it ends, or a refusal's.
    pub struct LimitBody<B> {
        #[pin]
        inner: BodyInner<B>,
    }
}

pin_project! {
    #[project = BodyProj]
    enum BodyInner<B> {
        Admitted { #[pin] body: B, permit: Option<Permit> },
        Refused { #[pin] body: ProxyBody },
    }
}

impl<B> LimitBody<B> {
    fn admitted(body: B, permit: Option<Permit>) -> Self {
        LimitBody { inner: BodyInner::Admitted { body, permit } }
    }

    fn refused(body: ProxyBody) -> Self {
        LimitBody { inner: BodyInner::Refused { body } }
    }
}

impl<B> Body for LimitBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().inner.project() {
            BodyProj::Admitted { body, permit } => {
                let frame = ready!(body.poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    *permit = None;
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            BodyProj::Refused { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            BodyInner::Admitted { body, .. } => body.is_end_stream(),
            BodyInner::Refused { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            BodyInner::Admitted { body, .. } => body.size_hint(),
            BodyInner::Refused { body } => body.size_hint(),
        }
    }
}

#[cfg(all(test, feature = "embedded-server"))]
mod tests;

#[cfg(all(test, not(feature = "embedded-server")))]
mod without_the_embedded_server {
    use super::*;

    #[tokio::test]
    async fn limits_without_doorman_do_not_start() {
        let config = RoutesConfig::parse("embed.yaml", "resources:\n  api: { kind: rate, capacity: 1/s }\n").unwrap();
        assert_eq!(Limits::start(config).await.err(), Some(EmbeddedServerOff));
    }
}
