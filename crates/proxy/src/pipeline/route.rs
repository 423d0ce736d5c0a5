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
        let Exchange { mut req, mut meta } = ex;
        let fail = |error, meta| RouteFuture::failed(Failure { error, meta });
        let Resolved { route, mut plan, target } = match req.resolve(&self.routing) {
            Ok(r) => r,
            Err(e) => return fail(Error::Proxy(e), meta),
        };
        let body = match route.body.is_some() {
            false => BodyRead::None,
            true => body::in_hand(&route, &mut plan, &mut meta, &mut req, &target),
        };
        let req = match req.ready(target, route.settles || route.quotas) {
            Ok(r) => r,
            // Nothing happened: the engine that serves it counts its body.
            Err(why) => return fail(Error::Unserved(why), meta),
        };
        meta.in_flight = Some(InFlight::new(&route.metrics.in_flight));
        if let BodyRead::InHand(outcome) = body {
            body::count(&route, outcome);
        }
        meta.route = Some(route);
        meta.plan = plan;
        if let BodyRead::Ahead(timeout) = body {
            return self.read_ahead(req, meta, timeout);
        }
        RouteFuture::inner(self.inner.call(Exchange { req, meta }))
    }
}

/// What a route that reads bodies did with the request's, before it is ready.
#[derive(Clone, Copy)]
pub(super) enum BodyRead {
    /// The route reads no body.
    None,
    /// Read where the engine held it (the native path), with this outcome.
    InHand(usher_enforce::metrics::BodyOutcome),
    /// To read once the request is ready, each piece within this long of the last.
    Ahead(std::time::Duration),
}

impl<S: Clone> RouteStage<S> {
    /// Reads ahead the body of a ready request whose route reads it, before
    /// it goes on ([`ReadAhead`]). Out of line: no other request comes here.
    #[cold]
    #[inline(never)]
    fn read_ahead<T>(&mut self, req: T, meta: Meta, timeout: std::time::Duration) -> RouteFuture<S, T>
    where
        T: ReadAhead,
        S: Service<Exchange<T>, Error = Failure>,
    {
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        RouteFuture::reading(req.read_ahead(MAX_REQUEST_BODY, timeout), svc, meta)
    }
}
