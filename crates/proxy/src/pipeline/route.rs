//! The route stage: finds a request's route ([`crate::route::Routing`]), its
//! admission plan and its target, and makes the request ready for that
//! target ([`Inbound::ready`]). From here the request counts as in flight
//! for its route.
//!
//! A route that reads the request's body ([`Route::body`](crate::route::Route::body):
//! a cost taken from it, or OpenAI's usage asked for) has it read first
//! ([`RouteFuture`]); every other request goes on at once.

mod body;

use std::sync::Arc;
use std::task::{Context, Poll};

use tower::{Layer, Service};

use super::{Error, Exchange, Failure, InFlight, Inbound, Meta, ReadAhead};
use crate::route::{Resolved, Routing};
use crate::upstream::Target;
use usher_enforce::request_body::MAX_REQUEST_BODY;

pub use body::RouteFuture;

/// Routes requests with one view of the routes (the main listener's, or an
/// upstream listener's).
#[derive(Clone)]
pub struct RouteLayer {
    routing: Arc<Routing>,
}

impl RouteLayer {
    /// A route stage that routes with `routing`.
    #[inline]
    pub(super) fn new(routing: Arc<Routing>) -> Self {
        RouteLayer { routing }
    }
}

impl<S> Layer<S> for RouteLayer {
    type Service = RouteStage<S>;
    fn layer(&self, inner: S) -> RouteStage<S> {
        RouteStage { inner, routing: self.routing.clone() }
    }
}

/// Finds the request's route, its admission plan and its target (named
/// apart from [`Route`](crate::route::Route), a compiled route).
#[derive(Clone)]
pub struct RouteStage<S> {
    inner: S,
    routing: Arc<Routing>,
}

impl<S, R> Service<Exchange<R>> for RouteStage<S>
where
    R: Inbound,
    S: Service<Exchange<R::Ready>, Error = Failure> + Clone,
{
    type Response = S::Response;
    type Error = Failure;
    type Future = RouteFuture<S, R::Ready>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, ex: Exchange<R>) -> Self::Future {
        let Exchange { req, mut meta } = ex;
        let fail = |error, meta| RouteFuture::failed(Failure { error, meta });
        let Resolved { route, plan, target } = match req.resolve(&self.routing) {
            Ok(r) => r,
            Err(e) => return fail(Error::Proxy(e), meta),
        };
        if route.body.is_some() {
            return self.call_reading(req, meta, Resolved { route, plan, target });
        }
        let req = match req.ready(target, route.settles || route.quotas) {
            Ok(r) => r,
            Err(why) => return fail(Error::Unserved(why), meta),
        };
        meta.in_flight = Some(InFlight::new(&route.metrics.in_flight));
        meta.route = Some(route);
        meta.plan = plan;
        RouteFuture::inner(self.inner.call(Exchange { req, meta }))
    }
}

impl<S: Clone> RouteStage<S> {
    /// [`Service::call`] for a request whose route reads its body: read in
    /// hand (the native path), or ahead once the request is ready. Out of
    /// line: no other request comes here.
    #[inline(never)]
    fn call_reading<R>(&mut self, mut req: R, mut meta: Meta, resolved: Resolved) -> RouteFuture<S, R::Ready>
    where
        R: Inbound,
        S: Service<Exchange<R::Ready>, Error = Failure>,
    {
        let Resolved { route, plan, target } = resolved;
        // In flight while its body comes; a failure then is the route's, with its keys.
        meta.in_flight = Some(InFlight::new(&route.metrics.in_flight));
        meta.route = Some(route.clone());
        meta.plan = plan;
        let timeout = match &target {
            Target::Upstream(u) | Target::Direct(u) => u.config.timeout,
        };
        let found = req.in_hand().map(|body| body::read(&route, &mut meta, body));
        let req = match req.ready(target, route.settles || route.quotas) {
            Ok(r) => r,
            // Nothing happened: the engine that serves it counts its body.
            Err(why) => return RouteFuture::failed(Failure { error: Error::Unserved(why), meta }),
        };
        if let Some(outcome) = found {
            body::count(&route, outcome);
            return RouteFuture::inner(self.inner.call(Exchange { req, meta }));
        }
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        RouteFuture::reading(req.read_ahead(MAX_REQUEST_BODY, timeout), svc, meta)
    }
}
