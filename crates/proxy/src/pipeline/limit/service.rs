//! [`Limit`]: the limit stage's service.

use std::task::{Context, Poll, ready};

use tower::Service;

use super::LimitFuture;
use crate::pipeline::{Answered, Error, Exchange, Failure, Meta};
use usher_core::clock::Clock;
use usher_enforce::respond::ProxyError;
use usher_limit::admit;

/// Admits the request by its plan (all or nothing), then forwards it.
#[derive(Clone)]
pub struct Limit<S> {
    inner: S,
    clock: Clock,
}

impl<S> Limit<S> {
    /// The limit stage around the engine's forward service `inner`.
    #[inline]
    pub(super) fn new(inner: S, clock: Clock) -> Self {
        Limit { inner, clock }
    }
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
            return LimitFuture::forwarding(self.inner.call(req), meta);
        }
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let admission = admit::start(&meta.plan, &self.clock);
        // The clock goes along only for shadow keys, decided once admitted.
        let clock = (!meta.plan.shadow.is_empty()).then(|| self.clock.clone());
        LimitFuture::admitting(admission, (inner, req), meta, clock)
    }
}
