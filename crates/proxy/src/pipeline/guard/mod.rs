//! The guard stage: the checks every request must pass before it is routed,
//! made by the engine that read it ([`Inbound::guard`]). hyper's requests are
//! checked here ([`checks`]); the native engine's parser hands to hyper every
//! request these checks could refuse, so what reaches its guard passes.

mod checks;

use std::task::{Context, Poll};

use tower::{Layer, Service};

use super::{Early, Error, Exchange, Failure, Inbound};

pub(crate) use checks::VIA;
pub(crate) use checks::{check, strip_h2c};

/// The checks every request must pass before anything else.
#[derive(Clone, Copy)]
pub struct GuardLayer {
    max_body: Option<u64>,
}

impl GuardLayer {
    /// A guard that refuses a declared body over `max_body` (`limits.max_body_bytes`).
    #[inline]
    pub(super) fn new(max_body: Option<u64>) -> Self {
        GuardLayer { max_body }
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;
    fn layer(&self, inner: S) -> Guard<S> {
        Guard { inner, max_body: self.max_body }
    }
}

/// Fails a request that does not pass the engine's checks; passes the
/// others on.
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
            Ok(()) => Early::inner(self.inner.call(ex)),
            Err(e) => Early::failed(Failure { error: Error::Proxy(e), meta: ex.meta }),
        }
    }
}
