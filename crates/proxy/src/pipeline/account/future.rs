//! [`AccountFuture`]: accounts for a request's outcome once the stages
//! below have it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use super::Accounts;
use crate::pipeline::{Answer, Answered, Failure, Held, Reply};

pin_project! {
    /// The [`Account`](super::Account) service's future: the upstream's
    /// answer with what the request holds until its body ends, or the
    /// failure, each accounted for.
    pub struct AccountFuture<F> {
        #[pin]
        inner: F,
        accounts: Arc<Accounts>,
    }
}

impl<F> AccountFuture<F> {
    /// Accounts for `inner`'s outcome in `accounts`.
    #[inline]
    pub(super) fn new(inner: F, accounts: Arc<Accounts>) -> Self {
        AccountFuture { inner, accounts }
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
