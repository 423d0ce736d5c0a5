//! [`Account`]: the account stage's service.

use std::sync::Arc;
use std::task::{Context, Poll};

use tower::Service;

use super::{AccountFuture, Accounts};
use crate::pipeline::{Answer, Answered, Exchange, Failure, Reply};

/// Accounts for every request that passed the guard: in flight, metrics by
/// route and resource, the access log, and the upstream's pushback.
#[derive(Clone)]
pub struct Account<S> {
    inner: S,
    accounts: Arc<Accounts>,
}

impl<S> Account<S> {
    /// The account stage around `inner`, writing to `accounts`.
    #[inline]
    pub(super) fn new(inner: S, accounts: Arc<Accounts>) -> Self {
        Account { inner, accounts }
    }
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
        AccountFuture::new(self.inner.call(ex), self.accounts.clone())
    }
}
