//! The one request pipeline: every request, on both HTTP/1.1 engines, on
//! HTTP/2 and CONNECT, passes through the same tower stack, built with a
//! [`tower::ServiceBuilder`] from the current [`Pipeline`] snapshot:
//!
//! ```text
//! respond  the one place errors become answers (problem+json, gRPC status)
//!  guard   loop, Host, body limit, no h2c upgrade          (guard.rs)
//!  account in flight, metrics, access log, pushback        (usher_enforce::pushback)
//!  route   the route, its admission Plan, the target       (super::route)
//!  limit   admission by the Plan: a typed Refused          (usher_limit::admit)
//!  forward the engine's own: hyper's client, or the native path's pooled stream
//! ```
//!
//! An engine hands in its request as an [`Inbound`] (the native path's parsed
//! head, or hyper's `Request`) and the innermost `forward` service; it gets back
//! a [`Reply`]: the upstream's answer with what must be held until its body
//! ends ([`Held`]: the admission's gauge permits and the in-flight count), an
//! answer usher made itself, or [`Reply::Unserved`] when the engine cannot
//! forward to the route's target (the native path then hands the request to
//! hyper, before anything of it has happened).
//!
//! No stage allocates per request in the common case: each future is a
//! named state machine, the admission is decided at once unless it waits, and
//! what a stage learns travels in the exchange's [`Meta`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{Response, StatusCode};
use pin_project_lite::pin_project;
use tower::{Layer, Service, ServiceBuilder};

use super::ops::access_log::{self, AccessLog};
use super::route::{ListenerId, Resolved, Route, Routing};
use super::upstream::Upstream;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_enforce::feedback;
use usher_enforce::metrics::Metrics;
use usher_enforce::pushback::Pushback;
use usher_enforce::resource::RequestView;
use usher_enforce::respond::{self, ProxyBody, ProxyError};
use usher_enforce::settle::{self, BodySettle};
use usher_limit::admit::{self, Admission, Admitted, Plan, Reason, Refused};
use usher_limit::{Kind, LeaseTable};

// === the snapshot ===

/// Everything a request is served by that a routes file decides: its
/// routing, upstreams and limits, swapped as one on reload.
pub struct Pipeline {
    pub config: Arc<RoutesConfig>,
    routing: Arc<Routing>,
    /// By upstream listener ([`ListenerId::index`]): its view of the routes.
    listeners: Vec<Arc<Routing>>,
    /// Built upstreams by name, reused by the next snapshot while their configuration is unchanged.
    pub(super) upstreams: HashMap<String, Arc<Upstream>>,
    accounts: Arc<Accounts>,
    clock: Clock,
}

/// The stack an engine serves with, around its own `forward` service `F`.
pub type Stack<F> = Respond<Guard<Account<RouteStage<Limit<F>>>>>;

impl Pipeline {
    pub(super) fn new(
        config: Arc<RoutesConfig>,
        routing: Routing,
        listeners: Vec<Routing>,
        upstreams: HashMap<String, Arc<Upstream>>,
        accounts: Arc<Accounts>,
        clock: Clock,
    ) -> Self {
        let listeners = listeners.into_iter().map(Arc::new).collect();
        Pipeline { config, routing: Arc::new(routing), listeners, upstreams, accounts, clock }
    }

    /// The request pipeline around `forward`, for the main listener's requests.
    pub fn stack<F>(&self, forward: F) -> Stack<F> {
        self.stack_with(self.routing.clone(), forward)
    }

    /// The request pipeline around `forward`, for requests that arrived on
    /// `listener`: its stack routes with that listener's view of the routes,
    /// so the request path itself does not look at the listener. Out of
    /// line: the native engine's connection loop, which builds its stack
    /// once, compiles as it did before upstream listeners (callgrind).
    #[inline(never)]
    pub fn stack_on<F>(&self, listener: ListenerId, forward: F) -> Stack<F> {
        let routing = match listener.index() {
            None => &self.routing,
            // Every snapshot has a view for every listener opened at start.
            Some(i) => &self.listeners[i],
        };
        self.stack_with(routing.clone(), forward)
    }

    fn stack_with<F>(&self, routing: Arc<Routing>, forward: F) -> Stack<F> {
        ServiceBuilder::new()
            .layer(RespondLayer { clock: self.clock.clone() })
            .layer(GuardLayer { max_body: self.config.limits.max_body_bytes })
            .layer(AccountLayer { accounts: self.accounts.clone() })
            .layer(RouteLayer { routing })
            .layer(LimitLayer { clock: self.clock.clone() })
            .service(forward)
    }
}

// === what flows through ===

/// A request as an engine hands it to the pipeline.
pub trait Inbound: RequestView + Sized {
    /// The request as the engine's `forward` service takes it, once routed.
    type Ready;

    /// Whether errors are answered as gRPC statuses.
    fn grpc(&self) -> bool;

    /// The checks before routing (`proxy/guard.rs`); `max_body` is `limits.max_body_bytes`.
    fn guard(&mut self, max_body: Option<u64>) -> Result<(), ProxyError>;

    /// The route, plan and target.
    fn resolve(&self, routing: &Routing) -> Result<Resolved, ProxyError> {
        routing.resolve_view(self)
    }

    /// Prepares the request for its target, or says why this engine cannot
    /// forward it there (the target is another engine's). `keep_head`: the
    /// route reads the answer's header fields ([`Answer::header`]).
    fn ready(self, target: super::upstream::Target, keep_head: bool) -> Result<Self::Ready, &'static str>;
}

/// An upstream's answer as the engine's `forward` service returns it.
pub trait Answer {
    fn status(&self) -> StatusCode;
    /// The upstream's `Retry-After`, for pushback.
    fn retry_after(&self) -> Option<Duration>;
    /// The value of the header field `name` (lower-case), when the request
    /// was made ready to keep the answer's head.
    fn header(&self, _name: &str) -> Option<&[u8]> {
        None
    }
    /// Set when the exchange outlives the answer's body (a tunnel, an
    /// upgraded connection): what is held moves there, not into the reply.
    fn hold(&self) -> Option<Hold> {
        None
    }
}

/// A request in the pipeline, and what the stages learnt of it.
pub struct Exchange<R> {
    pub req: R,
    pub meta: Meta,
}

impl<R> Exchange<R> {
    pub fn new(req: R) -> Self {
        Exchange { req, meta: Meta::default() }
    }
}

/// What the stages learn of a request, travelling with it and back.
#[derive(Default)]
pub struct Meta {
    arrived: Time,
    grpc: bool,
    route: Option<Arc<Route>>,
    plan: Plan,
    in_flight: Option<InFlight>,
    admitted: Option<Admitted>,
    /// What the plan's shadow resources would have done (none: it has none).
    shadow: Option<admit::Shadow>,
    /// A refusal's: how long an upstream's `Retry-After` still holds a key of the plan.
    hold: Option<Duration>,
}

/// Why a request got no upstream answer.
#[derive(Debug)]
pub enum Error {
    Proxy(ProxyError),
    /// Boxed: a refusal is the rare path, and a smaller error keeps every stage's future small.
    Refused(Box<Refused>),
    /// This engine cannot forward to the route's target.
    Unserved(&'static str),
}

/// An error and what the stages had learnt by then.
pub struct Failure {
    pub error: Error,
    meta: Meta,
}

/// An upstream answer and what the stages had learnt by then.
pub struct Answered<A> {
    answer: A,
    meta: Meta,
}

/// What the pipeline gives back.
pub enum Reply<A> {
    /// The upstream answered; `held` lasts until its body has been sent.
    Upstream { answer: A, held: Held },
    /// An answer usher made itself (a refusal, an error).
    Made(Response<ProxyBody>),
    /// The engine cannot forward to the route's target: nothing has happened.
    Unserved(&'static str),
}

/// What a request holds while its response body is sent: its gauge permits
/// and its place in the in-flight count; and, for a route that settles a
/// cost from the JSON body, that body's copy.
#[derive(Default)]
pub struct Held {
    route: Option<Arc<Route>>,
    /// The request is gRPC: a body that fails ends in trailers carrying a status.
    grpc: bool,
    _in_flight: Option<InFlight>,
    _admitted: Option<Admitted>,
    _shadow: Option<admit::Shadow>,
    /// The body read for the costs it settles (`settle: { response_json }`).
    settle: Option<Box<BodySettle>>,
}

impl Held {
    /// Copies the body's next bytes (de-chunked) as they are relayed, when
    /// the route settles a cost from them; one check otherwise.
    #[inline]
    pub fn tee(&mut self, data: &[u8]) {
        if let Some(s) = &mut self.settle {
            s.push(data);
        }
    }

    /// The body's last bytes are in hand: the costs it carries are settled,
    /// before those bytes are written (the app's next request finds them
    /// settled) and before what the request holds is released.
    #[inline]
    pub fn end(&mut self) {
        if let Some(s) = self.settle.take() {
            s.finish();
        }
    }

    /// Counts a response body that failed after its head was sent (the
    /// client sees it cut): `usher_proxy_response_body_errors_total`.
    pub fn body_failed(&self) {
        if let Some(r) = &self.route {
            r.metrics.body_errors.inc();
        }
    }

    /// A response body failed after its head was sent: counts it, releases
    /// what the request holds, and gives the gRPC trailers the body ends
    /// with instead of a reset stream ([`respond::body_failed_trailers`]),
    /// or None for a request that is not gRPC (the client sees it cut).
    pub fn body_error(&mut self, error: &dyn std::fmt::Display) -> Option<http::HeaderMap> {
        self.body_failed();
        let held = std::mem::take(self);
        let route = held.route.as_ref().map_or("_none", |r| r.name.as_str());
        held.grpc.then(|| respond::body_failed_trailers(route, error))
    }
}

/// Put in an answer whose exchange outlives its body (CONNECT, an upgrade):
/// what the request holds moves into it and is released when the last clone
/// is dropped, e.g. by the task that copies the tunnel.
#[derive(Clone, Default)]
pub struct Hold(Arc<Mutex<Option<Held>>>);

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

/// Counts a request in flight for its route until dropped.
pub struct InFlight(prometheus::IntGauge);

impl InFlight {
    fn new(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        InFlight(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

pin_project! {
    /// A stage's future: failed at once, or the inner service's.
    #[project = EarlyProj]
    pub enum Early<F> {
        Now { out: Option<Failure> },
        Inner { #[pin] fut: F },
    }
}

impl<F, T> Future for Early<F>
where
    F: Future<Output = Result<T, Failure>>,
{
    type Output = Result<T, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            EarlyProj::Now { out } => Poll::Ready(Err(out.take().expect("polled after completion"))),
            EarlyProj::Inner { fut } => fut.poll(cx),
        }
    }
}

// === respond ===

/// The one place errors become answers: problem+json, or a gRPC status.
#[derive(Clone)]
pub struct RespondLayer {
    clock: Clock,
}

impl<S> Layer<S> for RespondLayer {
    type Service = Respond<S>;
    fn layer(&self, inner: S) -> Respond<S> {
        Respond { inner, clock: self.clock.clone() }
    }
}

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
    clock: Clock,
}

impl<S, R, A> Service<Exchange<R>> for Respond<S>
where
    R: Inbound,
    S: Service<Exchange<R>, Response = Reply<A>, Error = Failure>,
{
    type Response = Reply<A>;
    type Error = std::convert::Infallible;
    type Future = RespondFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The stages below are always ready.
        let _ = ready!(self.inner.poll_ready(cx));
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut ex: Exchange<R>) -> Self::Future {
        ex.meta.arrived = self.clock.now();
        ex.meta.grpc = ex.req.grpc();
        RespondFuture { inner: self.inner.call(ex) }
    }
}

pin_project! {
    pub struct RespondFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F, A> Future for RespondFuture<F>
where
    F: Future<Output = Result<Reply<A>, Failure>>,
{
    type Output = Result<Reply<A>, std::convert::Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(Ok(match ready!(self.project().inner.poll(cx)) {
            Ok(reply) => reply,
            Err(Failure { error: Error::Unserved(why), .. }) => Reply::Unserved(why),
            Err(Failure { error: Error::Refused(r), meta }) => Reply::Made(match meta.hold {
                Some(hold) => respond::refused_held(&r, hold, meta.grpc),
                None => respond::refused(&r, meta.grpc),
            }),
            Err(Failure { error: Error::Proxy(e), meta }) => Reply::Made(respond::proxy_error(&e, meta.grpc)),
        }))
    }
}

// === guard ===

/// The checks every request must pass before anything else (super::guard).
#[derive(Clone, Copy)]
pub struct GuardLayer {
    max_body: Option<u64>,
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;
    fn layer(&self, inner: S) -> Guard<S> {
        Guard { inner, max_body: self.max_body }
    }
}

#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    max_body: Option<u64>,
}

impl<S, R> Service<Exchange<R>> for Guard<S>
where
    R: Inbound,
    S: Service<Exchange<R>, Error = Failure>,
{
    type Response = S::Response;
    type Error = Failure;
    type Future = Early<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut ex: Exchange<R>) -> Self::Future {
        match ex.req.guard(self.max_body) {
            Ok(()) => Early::Inner { fut: self.inner.call(ex) },
            Err(e) => Early::Now { out: Some(Failure { error: Error::Proxy(e), meta: ex.meta }) },
        }
    }
}

// === account ===

/// What the account stage writes to: shared by every snapshot.
pub struct Accounts {
    pub metrics: Arc<Metrics>,
    /// One JSON line per request, when the routes file names a file.
    pub access_log: Option<AccessLog>,
    /// This sidecar's client id, for the access log.
    pub client_id: String,
    pub pushback: Arc<Pushback>,
    pub table: Arc<LeaseTable>,
    /// Why keys enforce 0, from the lease client once it runs: the 429 says.
    pub zero_reasons: std::sync::OnceLock<usher_lease::driver::ZeroReasons>,
}

#[derive(Clone)]
pub struct AccountLayer {
    accounts: Arc<Accounts>,
}

impl<S> Layer<S> for AccountLayer {
    type Service = Account<S>;
    fn layer(&self, inner: S) -> Account<S> {
        Account { inner, accounts: self.accounts.clone() }
    }
}

/// Accounts for every request that passed the guard: in flight, metrics by
/// route and resource, the access log, and the upstream's pushback.
#[derive(Clone)]
pub struct Account<S> {
    inner: S,
    accounts: Arc<Accounts>,
}

impl<S, R, A> Service<Exchange<R>> for Account<S>
where
    S: Service<Exchange<R>, Response = Answered<A>, Error = Failure>,
    A: Answer,
{
    type Response = Reply<A>;
    type Error = Failure;
    type Future = AccountFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, ex: Exchange<R>) -> Self::Future {
        AccountFuture { inner: self.inner.call(ex), accounts: self.accounts.clone() }
    }
}

pin_project! {
    pub struct AccountFuture<F> {
        #[pin]
        inner: F,
        accounts: Arc<Accounts>,
    }
}

impl<F, A> Future for AccountFuture<F>
where
    F: Future<Output = Result<Answered<A>, Failure>>,
    A: Answer,
{
    type Output = Result<Reply<A>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let acc = &**this.accounts;
        Poll::Ready(match ready!(this.inner.poll(cx)) {
            Ok(Answered { answer, meta }) => {
                let settle = acc.answered(&meta, answer.status(), || answer.retry_after(), |name| answer.header(name));
                let held = Held {
                    route: meta.route,
                    grpc: meta.grpc,
                    _in_flight: meta.in_flight,
                    _admitted: meta.admitted,
                    _shadow: meta.shadow,
                    settle,
                };
                let held = match answer.hold() {
                    Some(hold) => {
                        let route = held.route.clone();
                        *hold.0.lock().expect("hold lock") = Some(held);
                        Held { route, ..Held::default() }
                    }
                    None => held,
                };
                Ok(Reply::Upstream { answer, held })
            }
            Err(mut f) => {
                acc.failed(&mut f);
                Err(f)
            }
        })
    }
}

impl Accounts {
    /// An upstream's answer (the one outcome of a request that reached it):
    /// admission metrics, pushback, costs settled from its head, the access
    /// log. Returns what reads its body for the costs the body settles.
    fn answered<'a>(
        &self,
        meta: &Meta,
        status: StatusCode,
        retry_after: impl Fn() -> Option<Duration>,
        header: impl Fn(&str) -> Option<&'a [u8]>,
    ) -> Option<Box<BodySettle>> {
        let Some(route) = &meta.route else { return None };
        let (paced, waited) = meta.admitted.as_ref().map_or((false, Duration::ZERO), |a| (a.paced, a.waited));
        if paced { &route.metrics.paced } else { &route.metrics.admitted }.inc();
        if !route.resources.is_empty() {
            let secs = waited.as_secs_f64();
            for r in route.resources.iter() {
                if paced { &r.metrics.paced } else { &r.metrics.admitted }.inc();
                r.metrics.wait.observe(secs);
            }
        }
        let spent = match route.quotas {
            true => {
                let clock = self.table.clock();
                feedback::observe_quota(&route.resources, &meta.plan, status, retry_after(), &header, clock)
            }
            false => None,
        };
        match spent {
            // The upstream says its quota is spent until a known time: every
            // key of the plan is held until then.
            Some(hold) => {
                feedback::hold_spent(&self.pushback, &self.table, &meta.plan, hold, &route.pushback, &route.name)
            }
            None => self.observe_pushback(route, &meta.plan, status, retry_after),
        }
        let settle = match route.settles {
            true => settle::on_answer(&route.resources, &meta.plan, status, &header),
            false => None,
        };
        let outcome = match &meta.shadow {
            Some(admit::Shadow { refused: Some(resource), .. }) => {
                // Forwarded all the same: counted as what enforcing would have done.
                self.metrics.requests.with_label_values(&[&route.name, "shadow_refused"]).inc();
                self.metrics.resource_requests.with_label_values(&[resource, "shadow_refused"]).inc();
                "shadow_refused"
            }
            _ if paced => "paced",
            _ => "admitted",
        };
        let waited = meta.shadow.as_ref().map_or(waited, |s| waited.max(s.would_wait));
        self.log(&route.name, meta, outcome, waited, status);
        settle
    }

    /// A request that got no upstream answer.
    fn failed(&self, f: &mut Failure) {
        if let (Error::Proxy(ProxyError::ClientStalled { route, .. }), Some(r)) = (&mut f.error, &f.meta.route) {
            route.clone_from(&r.name);
        }
        if let Error::Refused(r) = &mut f.error {
            // While an upstream's Retry-After holds a key of the request, the 429 says when that ends.
            let now = self.table.clock().now();
            f.meta.hold = f.meta.plan.items.iter().filter_map(|(l, _)| self.pushback.hold_left(l.id(), now)).max();
            if r.reason == Reason::ZeroCapacity
                && let Some(zeros) = self.zero_reasons.get()
            {
                r.why = zeros.read().expect("zero reasons poisoned").get(&r.id).copied();
            }
        }
        let meta = &f.meta;
        match (&f.error, &meta.route) {
            (Error::Unserved(_), _) => {}
            (Error::Refused(r), Some(route)) => {
                route.metrics.refused.inc();
                match route.resources.iter().find(|res| res.metrics.name == r.resource) {
                    Some(res) => res.metrics.refused.inc(),
                    None => self.metrics.resource_requests.with_label_values(&[&r.resource, "refused"]).inc(),
                }
                self.log(&route.name, meta, "refused", r.waited, respond::refused_status(meta.grpc));
            }
            (Error::Proxy(e @ ProxyError::ClientStalled { .. }), Some(route)) => {
                route.metrics.client_timeout.inc();
                tracing::debug!(route = %route.name, error = %e, "client stalled");
                self.log(&route.name, meta, "client_timeout", Duration::ZERO, respond::status(e, meta.grpc));
            }
            (Error::Proxy(e), Some(route)) => {
                route.metrics.upstream_error.inc();
                tracing::debug!(route = %route.name, error = %e, "upstream error");
                self.log(&route.name, meta, "upstream_error", Duration::ZERO, respond::status(e, meta.grpc));
            }
            // Routing found no route (or no room for another key).
            (Error::Proxy(e), None) => {
                self.metrics.requests.with_label_values(&["_none", "no_route"]).inc();
                self.log("_none", meta, "no_route", Duration::ZERO, respond::status(e, meta.grpc));
            }
            (Error::Refused(_), None) => {}
        }
    }

    /// Feeds an upstream answer (its status and `Retry-After`) to the route's pushback state.
    fn observe_pushback(
        &self,
        route: &Route,
        plan: &Plan,
        status: StatusCode,
        retry_after: impl FnOnce() -> Option<Duration>,
    ) {
        // The common case (a success while nothing is backed off) costs one atomic load.
        if plan.is_empty() || self.pushback.is_quiet(status) {
            return;
        }
        let now = self.table.clock().now();
        // Read and written under the pushback lock: the lease client's write of a new lease cannot cross it.
        let keys = plan.items.iter().map(|(l, _)| &**l);
        self.pushback.on_response(keys, status, retry_after(), now, &route.pushback, |id, capacity| {
            tracing::debug!(route = %route.name, resource_id = %id, capacity, %status, "upstream pushback");
            self.table.set_capacity(id, capacity);
        });
    }

    /// Appends one line to the access log, if there is one.
    fn log(&self, route: &str, meta: &Meta, outcome: &str, waited: Duration, status: StatusCode) {
        let Some(log) = &self.access_log else { return };
        let now = self.table.clock().now();
        let total = now.since(meta.arrived);
        let upstream = matches!(outcome, "admitted" | "paced" | "upstream_error" | "client_timeout")
            .then(|| total.saturating_sub(waited));
        log.record(&access_log::Entry {
            time: now.as_secs_f64(),
            client: self.client_id.clone(),
            route: route.to_string(),
            resources: meta
                .plan
                .items
                .iter()
                .map(|(l, _)| access_log::KeyEntry {
                    resource: l.spec().name.clone(),
                    id: l.id().to_string(),
                    kind: match l.kind() {
                        Kind::Rate => "rate".into(),
                        Kind::Gauge => "gauge".into(),
                    },
                    capacity: l.capacity(),
                })
                .collect(),
            outcome: outcome.to_string(),
            wait_ms: waited.as_secs_f64() * 1e3,
            status: status.as_u16(),
            upstream_ms: upstream.map(|d| d.as_secs_f64() * 1e3),
            total_ms: total.as_secs_f64() * 1e3,
            listener: meta.route.as_ref().and_then(|r| r.listener.clone()),
        });
    }
}

// === route ===

#[derive(Clone)]
pub struct RouteLayer {
    routing: Arc<Routing>,
}

impl<S> Layer<S> for RouteLayer {
    type Service = RouteStage<S>;
    fn layer(&self, inner: S) -> RouteStage<S> {
        RouteStage { inner, routing: self.routing.clone() }
    }
}

/// Finds the request's route, its admission plan and its target (named
/// apart from [`Route`], a compiled route).
#[derive(Clone)]
pub struct RouteStage<S> {
    inner: S,
    routing: Arc<Routing>,
}

impl<S, R> Service<Exchange<R>> for RouteStage<S>
where
    R: Inbound,
    S: Service<Exchange<R::Ready>, Error = Failure>,
{
    type Response = S::Response;
    type Error = Failure;
    type Future = Early<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, ex: Exchange<R>) -> Self::Future {
        let Exchange { req, mut meta } = ex;
        let fail = |error, meta| Early::Now { out: Some(Failure { error, meta }) };
        let Resolved { route, plan, target } = match req.resolve(&self.routing) {
            Ok(r) => r,
            Err(e) => return fail(Error::Proxy(e), meta),
        };
        let req = match req.ready(target, route.settles || route.quotas) {
            Ok(r) => r,
            Err(why) => return fail(Error::Unserved(why), meta),
        };
        meta.in_flight = Some(InFlight::new(&route.metrics.in_flight));
        meta.route = Some(route);
        meta.plan = plan;
        Early::Inner { fut: self.inner.call(Exchange { req, meta }) }
    }
}

// === limit ===

#[derive(Clone)]
pub struct LimitLayer {
    clock: Clock,
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;
    fn layer(&self, inner: S) -> Limit<S> {
        Limit { inner, clock: self.clock.clone() }
    }
}

/// Admits the request by its plan (all or nothing), then forwards it.
#[derive(Clone)]
pub struct Limit<S> {
    inner: S,
    clock: Clock,
}

impl<S, R> Service<Exchange<R>> for Limit<S>
where
    S: Service<R, Error = ProxyError> + Clone,
{
    type Response = Answered<S::Response>;
    type Error = Failure;
    type Future = LimitFuture<S, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        // The engines' forward services are always ready.
        match ready!(self.inner.poll_ready(cx)) {
            Ok(()) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(Failure { error: Error::Proxy(e), meta: Meta::default() })),
        }
    }

    fn call(&mut self, ex: Exchange<R>) -> Self::Future {
        let Exchange { req, mut meta } = ex;
        if meta.plan.items.is_empty() {
            // Nothing enforced: shadow resources are decided, and it goes on at once.
            meta.shadow = admit::shadow(&meta.plan, &self.clock);
            return LimitFuture {
                state: State::Forwarding { fut: self.inner.call(req) },
                meta: Some(meta),
                clock: None,
            };
        }
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let admission = admit::start(&meta.plan, &self.clock);
        // The clock goes along only for shadow keys, decided once admitted.
        let clock = (!meta.plan.shadow.is_empty()).then(|| self.clock.clone());
        LimitFuture { state: State::Admitting { admission, pending: Some((inner, req)) }, meta: Some(meta), clock }
    }
}

pin_project! {
    pub struct LimitFuture<S: Service<R>, R> {
        #[pin]
        state: State<S, R>,
        meta: Option<Meta>,
        clock: Option<Clock>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<R>, R> {
        Admitting { admission: Admission, pending: Option<(S, R)> },
        Forwarding { #[pin] fut: S::Future },
    }
}

impl<S, R> Future for LimitFuture<S, R>
where
    S: Service<R, Error = ProxyError>,
{
    type Output = Result<Answered<S::Response>, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Admitting { admission, pending } => {
                    let admitted = ready!(Pin::new(admission).poll(cx));
                    let meta = this.meta.as_mut().expect("polled after completion");
                    match admitted {
                        Ok(a) => {
                            meta.admitted = Some(a);
                            if let Some(clock) = this.clock.as_ref() {
                                meta.shadow = admit::shadow(&meta.plan, clock);
                            }
                        }
                        Err(r) => {
                            let meta = this.meta.take().expect("polled after completion");
                            return Poll::Ready(Err(Failure { error: Error::Refused(Box::new(r)), meta }));
                        }
                    }
                    let (mut svc, req) = pending.take().expect("request pending");
                    let fut = svc.call(req);
                    this.state.set(State::Forwarding { fut });
                }
                StateProj::Forwarding { fut } => {
                    let out = ready!(fut.poll(cx));
                    let meta = this.meta.take().expect("polled after completion");
                    return Poll::Ready(match out {
                        Ok(answer) => Ok(Answered { answer, meta }),
                        Err(e) => Err(Failure { error: Error::Proxy(e), meta }),
                    });
                }
            }
        }
    }
}
