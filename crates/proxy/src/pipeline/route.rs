//! The route stage: finds a request's route ([`crate::route::Routing`]), its
//! admission plan and its target, and makes the request ready for that
//! target ([`Inbound::ready`]). From here the request counts as in flight
//! for its route.

use std::sync::Arc;
use std::task::{Context, Poll};

use tower::{Layer, Service};

use super::{Early, Error, Exchange, Failure, InFlight, Inbound};
use crate::route::{Resolved, Routing};

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
        let fail = |error, meta| Early::failed(Failure { error, meta });
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
        Early::inner(self.inner.call(Exchange { req, meta }))
    }
}
