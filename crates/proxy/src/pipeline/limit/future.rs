//! [`LimitFuture`]: waits for the admission, if it must, then for the
//! forward service's answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::Service;

use crate::pipeline::{Answered, Error, Failure, Meta};
use usher_core::clock::Clock;
use usher_enforce::respond::ProxyError;
use usher_limit::admit::{self, Admission};

pin_project! {
    /// The [`Limit`](super::Limit) service's future: admitting the request,
    /// then forwarding it.
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

impl<S: Service<R>, R> LimitFuture<S, R> {
    /// A request admitted at once (nothing enforced), forwarded by `fut`.
    #[inline]
    pub(super) fn forwarding(fut: S::Future, meta: Meta) -> Self {
        LimitFuture { state: State::Forwarding { fut }, meta: Some(meta), clock: None }
    }

    /// A request that `pending`'s service forwards once `admission` admits
    /// it; `clock`, when the plan has shadow keys, decides them then.
    #[inline]
    pub(super) fn admitting(admission: Admission, pending: (S, R), meta: Meta, clock: Option<Clock>) -> Self {
        LimitFuture { state: State::Admitting { admission, pending: Some(pending) }, meta: Some(meta), clock }
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
