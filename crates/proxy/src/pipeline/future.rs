//! [`Early`]: the future of a stage that may fail a request before the
//! services below it see it (the guard, the route stage).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use super::Failure;

pin_project! {
    /// A stage's future: failed at once, or the inner service's.
    pub struct Early<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Now { out: Option<Failure> },
        Inner { #[pin] fut: F },
    }
}

impl<F> Early<F> {
    /// The stage failed the request: ready at once with `failure`.
    #[inline]
    pub(super) fn failed(failure: Failure) -> Self {
        Early { state: State::Now { out: Some(failure) } }
    }

    /// The stage passed the request on: the inner service's future `fut`.
    #[inline]
    pub(super) fn inner(fut: F) -> Self {
        Early { state: State::Inner { fut } }
    }
}

impl<F, T> Future for Early<F>
where
    F: Future<Output = Result<T, Failure>>,
{
    type Output = Result<T, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Now { out } => Poll::Ready(Err(out.take().expect("polled after completion"))),
            StateProj::Inner { fut } => fut.poll(cx),
        }
    }
}
