//! The one request pipeline: every request, on both HTTP/1.1 engines, on
//! HTTP/2 and CONNECT, passes through the same tower stack, built with a
//! [`tower::ServiceBuilder`] from the current [`Pipeline`] snapshot:
//!
//! ```text
//! respond  the one place errors become answers (problem+json, gRPC status)  respond.rs
//!  guard   loop, Host, body limit, no h2c upgrade                            guard/
//!  account in flight, metrics, access log, pushback                          account/
//!  route   the route, its admission Plan, the target; a body it reads        route.rs, route/
//!  limit   admission by the Plan (usher_limit::admit): a typed Refused       limit/
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
//!
//! # Why not tower-http
//!
//! tower-http has layers for some of what the stages and the engines do by
//! hand. None is used. Every tower-http layer serves an `http::Request<B>`
//! and answers an `http::Response<B>`; this stack serves an [`Exchange`] of
//! any [`Inbound`] and answers a [`Reply`]. The native engine's request is a
//! head parsed in place in the connection's buffer, its body already read
//! whole: it is never an `http::Request`. So a tower-http layer could only
//! sit inside hyper's forward service, serving one engine of two, and the
//! native one would still do the same by hand. Each layer also misses
//! something usher needs:
//!
//! - `RequestBodyLimit` answers a declared length over the limit with its
//!   own 413 (`text/plain`, "length limit exceeded") and cuts a longer
//!   streamed body with a `LengthLimitError`. usher's 413 is problem+json
//!   (`urn:usher:problem:body-too-large`), or gRPC status 8 for a gRPC
//!   request, made by the respond stage like every other error; a body cut
//!   mid-stream fails the exchange, which the account stage counts and logs
//!   with its route. On hyper's path the limit lives in the body wrapper
//!   usher needs anyway (`RequestBody` in `upstream/body.rs`: it tells the
//!   client's body errors from the upstream's and records the progress the
//!   response deadline follows); `Limited` would be a second wrapper. The
//!   native parser hands a request over the limit to hyper before the
//!   pipeline sees it, at no cost to the others.
//! - `SetRequestHeader` cannot set `Via` (`1.1 usher`) where it must go: after
//!   hyper's forward has stripped the hop-by-hop fields (a client's
//!   `Connection: via` would remove one set before) and rewritten `Host` for
//!   the target. The native engine writes `Via` as bytes while it encodes the
//!   head for the upstream: there is no header map to set it in. Reading
//!   `Via` to catch a loop is the guard's and the native parser's.
//! - `Timeout` runs one fixed duration from `call` and answers an empty 408
//!   (or another fixed status). usher's deadline is the route's upstream's
//!   `timeout`, known only after routing. It covers the response headers,
//!   from the end of the request body, and starts over with each piece of
//!   body the client sends: a stalled upload is a 408 `ClientStalled`, a
//!   silent upstream a 504 `UpstreamTimeout`, each problem+json and counted
//!   apart (`client_timeout`, `upstream_error`). A wait for admission does
//!   not count against it; each resource bounds that with `max_wait`. The
//!   native engine keeps one lazy timer per connection, re-armed only when
//!   it must fire sooner, not a new `Sleep` per request.
//! - `Trace` makes a `tracing` span per request, times it, wraps the
//!   response body and classes the outcome by status. usher records each
//!   request once, in the account stage: metrics and one access-log line by
//!   admission outcome (admitted, paced, refused, shadow_refused, no_route,
//!   upstream_error, client_timeout) with its route, keys, wait and upstream
//!   time, timed by the injected [`Clock`] (virtual in tests and `usher
//!   sim`) and written off the request path; `debug` events name a failure's
//!   route. A span would be allocated per request whenever its level is on,
//!   and a status class cannot tell refused from paced.

mod account;
mod future;
pub(crate) mod guard;
mod limit;
mod respond;
mod route;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Response, StatusCode};
use tower::ServiceBuilder;

use crate::route::{ListenerId, Resolved, Route, Routing};
use crate::upstream::Upstream;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_enforce::request_body::Body;
use usher_enforce::resource::RequestView;
use usher_enforce::respond::{ProxyBody, ProxyError};
use usher_enforce::settle::BodySettle;
use usher_limit::admit::{self, Admitted, Plan, Refused};

pub use account::{Account, AccountFuture, AccountLayer, Accounts};
pub use future::Early;
pub use guard::{Guard, GuardLayer};
pub use limit::{Limit, LimitFuture, LimitLayer};
pub use respond::{Respond, RespondFuture, RespondLayer};
pub use route::{RouteFuture, RouteLayer, RouteStage};

// === the snapshot ===

/// Everything a request is served by that a routes file decides: its
/// routing, upstreams and limits, swapped as one on reload.
pub struct Pipeline {
    /// The routes file this snapshot was built from.
    pub config: Arc<RoutesConfig>,
    /// The main listener's view of the routes.
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
    /// The snapshot of one routes file: its routing, each upstream
    /// listener's view of it, and its upstreams.
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

    /// The stages, outermost first, around `forward`, routing with `routing`.
    fn stack_with<F>(&self, routing: Arc<Routing>, forward: F) -> Stack<F> {
        ServiceBuilder::new()
            .layer(RespondLayer::new(self.clock.clone()))
            .layer(GuardLayer::new(self.config.limits.max_body_bytes))
            .layer(AccountLayer::new(self.accounts.clone()))
            .layer(RouteLayer::new(routing))
            .layer(LimitLayer::new(self.clock.clone()))
            .service(forward)
    }
}

// === what flows through ===

/// A request as an engine hands it to the pipeline.
pub trait Inbound: RequestView + Sized {
    /// The request as the engine's `forward` service takes it, once routed.
    type Ready: ReadAhead;

    /// Whether errors are answered as gRPC statuses.
    fn grpc(&self) -> bool;

    /// The guard stage's checks, before routing; `max_body` is `limits.max_body_bytes`.
    fn guard(&mut self, max_body: Option<u64>) -> Result<(), ProxyError>;

    /// The route, plan and target.
    fn resolve(&self, routing: &Routing) -> Result<Resolved, ProxyError> {
        routing.resolve_view(self)
    }

    /// The request's body, for a route that reads it, when the engine holds
    /// it whole before routing (the native path's small bodies); None when
    /// it streams: it is then read once the request is ready ([`ReadAhead`]).
    fn in_hand(&mut self) -> Option<&mut dyn BodyAccess> {
        None
    }

    /// Prepares the request for its target, or says why this engine cannot
    /// forward it there (the target is another engine's). `keep_head`: the
    /// route reads the answer's header fields ([`Answer::header`]).
    fn ready(self, target: crate::upstream::Target, keep_head: bool) -> Result<Self::Ready, &'static str>;
}

/// A request's body as a route that reads it sees it (`Route::body`).
pub trait BodyAccess {
    /// The body as read: whole, or over the bound.
    fn body(&self) -> Body<'_>;

    /// Sends `body` upstream instead of the one read, with its length.
    fn replace_body(&mut self, body: Vec<u8>);
}

/// A request made ready for its target whose body a route reads before
/// admission, when the engine did not hold it whole ([`Inbound::in_hand`]).
pub trait ReadAhead: BodyAccess + Sized {
    /// [`ReadAhead::read_ahead`]'s future.
    type Reading: Future<Output = Result<Self, ProxyError>> + Unpin;

    /// Reads up to `bound` bytes of the body, each piece within `timeout`
    /// of the last (else [`ProxyError::ClientStalled`]); what it read goes
    /// upstream first, then the rest as it streams.
    fn read_ahead(self, bound: usize, timeout: Duration) -> Self::Reading;
}

/// An upstream's answer as the engine's `forward` service returns it.
pub trait Answer {
    /// The upstream's status code.
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
    /// The request: as the engine read it, then as its `forward` takes it.
    pub req: R,
    /// What the stages learnt of it so far.
    pub meta: Meta,
}

impl<R> Exchange<R> {
    /// A request as it enters the pipeline: nothing learnt of it yet.
    #[inline]
    pub fn new(req: R) -> Self {
        Exchange { req, meta: Meta::default() }
    }
}

/// What the stages learn of a request, travelling with it and back.
#[derive(Default)]
pub struct Meta {
    /// When the respond stage saw the request, for the access log's times.
    arrived: Time,
    /// Errors are answered as gRPC statuses.
    grpc: bool,
    /// The route taken, once routed.
    route: Option<Arc<Route>>,
    /// The keys and costs the request is admitted by.
    plan: Plan,
    /// Its place in its route's in-flight count, from routing on.
    in_flight: Option<InFlight>,
    /// The admission's gauge permits and how long it waited, once admitted.
    admitted: Option<Admitted>,
    /// What the plan's shadow resources would have done (none: it has none).
    shadow: Option<admit::Shadow>,
    /// A refusal's: how long an upstream's `Retry-After` still holds a key of the plan.
    hold: Option<Duration>,
    /// usher asked the upstream for the usage the app did not ask for
    /// (`stream_options.include_usage` added to a streamed request): the
    /// answer's stream loses it again on its way to the app
    /// (`usher_enforce::settle`'s `hide`).
    usage_injected: bool,
}

/// Why a request got no upstream answer.
#[derive(Debug)]
pub enum Error {
    /// A request usher cannot serve (bad, unroutable, too large) or one the
    /// upstream failed.
    Proxy(ProxyError),
    /// Boxed: a refusal is the rare path, and a smaller error keeps every stage's future small.
    Refused(Box<Refused>),
    /// This engine cannot forward to the route's target.
    Unserved(&'static str),
}

/// An error and what the stages had learnt by then.
pub struct Failure {
    /// Why the request got no upstream answer.
    pub error: Error,
    /// What the stages had learnt of the request.
    meta: Meta,
}

/// An upstream answer and what the stages had learnt by then.
pub struct Answered<A> {
    /// The answer as the engine's `forward` service returned it.
    answer: A,
    /// What the stages had learnt of the request.
    meta: Meta,
}

/// What the pipeline gives back.
pub enum Reply<A> {
    /// The upstream answered; `held` lasts until its body has been sent.
    Upstream {
        /// The upstream's answer, its body still to relay.
        answer: A,
        /// What the request holds until that body has been sent.
        held: Held,
    },
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
    /// The route taken: its body errors are counted, its name is in gRPC trailers.
    route: Option<Arc<Route>>,
    /// The request is gRPC: a body that fails ends in trailers carrying a status.
    grpc: bool,
    /// Released when dropped: the in-flight count, the gauge permits, the shadow keys' permits.
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

    /// Whether the body is a stream of events read for a cost: the engine
    /// reads it on when the app leaves ([`Held::left`]).
    #[inline]
    pub fn reads_stream(&self) -> bool {
        self.settle.as_ref().is_some_and(|s| s.is_stream())
    }

    /// Whether the app gets the body edited: the engine relays what
    /// [`Held::edit`] gives it, not what the upstream sent (and frames it
    /// anew: a length the upstream gave no longer holds).
    #[inline]
    pub fn edits(&self) -> bool {
        self.settle.as_ref().is_some_and(|s| s.edits())
    }

    /// Reads the body's next bytes (de-chunked) and appends to `out` what
    /// of them the app gets ([`usher_enforce::settle::BodySettle::edit`]).
    pub fn edit(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match &mut self.settle {
            Some(s) => s.edit(data, out),
            None => out.extend_from_slice(data),
        }
    }

    /// The body has ended: appends to `out` what an edited body still held back.
    pub fn flush(&mut self, out: &mut Vec<u8>) {
        if let Some(s) = &mut self.settle {
            s.flush(out);
        }
    }

    /// The app left before the body's end: what the engine reads on is
    /// read for the cost only, which counts as `client_gone`.
    pub fn left(&mut self) {
        if let Some(s) = &mut self.settle {
            s.left();
        }
    }

    /// How long the engine reads on after the app left: the route's
    /// upstream `timeout`.
    pub fn read_on_for(&self) -> Duration {
        self.route.as_ref().map_or(usher_core::config::routes::DEFAULT_TIMEOUT, |r| r.timeout())
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
    /// with instead of a reset stream ([`usher_enforce::respond::body_failed_trailers`]),
    /// or None for a request that is not gRPC (the client sees it cut).
    pub fn body_error(&mut self, error: &dyn std::fmt::Display) -> Option<http::HeaderMap> {
        self.body_failed();
        let held = std::mem::take(self);
        let route = held.route.as_ref().map_or("_none", |r| r.name.as_str());
        held.grpc.then(|| usher_enforce::respond::body_failed_trailers(route, error))
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
    /// Counts one more request in `gauge` until the result is dropped.
    #[inline]
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
