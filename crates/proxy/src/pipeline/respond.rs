//! The respond stage, the stack's outermost: the one place a request's
//! failure becomes the answer usher makes (`usher_enforce::respond`:
//! problem+json, a gRPC status for a gRPC request, or the error shape of
//! the API the route leads to). It stamps the request's arrival and whether
//! it is gRPC, which the stages below and the answer go by.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::{Error, Exchange, Failure, Inbound, Reply};
use usher_core::clock::Clock;
use usher_enforce::respond;

/// The one place errors become answers: problem+json, or a gRPC status.
#[derive(Clone)]
pub struct RespondLayer {
    clock: Clock,
}

impl RespondLayer {
    /// A respond stage that stamps arrivals with `clock`.
    #[inline]
    pub(super) fn new(clock: Clock) -> Self {
        RespondLayer { clock }
    }
}

impl<S> Layer<S> for RespondLayer {
    type Service = Respond<S>;
    fn layer(&self, inner: S) -> Respond<S> {
        Respond { inner, clock: self.clock.clone() }
    }
}

/// Answers every request: the stages' reply, or the answer made of their
/// failure. It never fails itself.
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
    /// The [`Respond`] service's future: the stages' reply, with a failure
    /// made into an answer.
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
            Err(Failure { error: Error::Refused(r), meta }) => {
                Reply::Made(respond::refused_in(&r, meta.hold, meta.grpc, dialect(&meta)))
            }
            Err(Failure { error: Error::Proxy(e), meta }) => {
                Reply::Made(respond::proxy_error_in(&e, meta.grpc, dialect(&meta)))
            }
        }))
    }
}

/// The error shape of the API the request's route leads to, if it has one
/// (a request that found no route gets problem+json).
fn dialect(meta: &super::Meta) -> Option<respond::ApiDialect> {
    meta.route.as_ref().and_then(|r| r.dialect)
}
