//! [`Early`]: the future of a stage that may fail a request before the
//! services below it see it (the guard, the route stage).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use super::Failure;

pin_project! {
    /// A stage's future: failed at once, or the inner service's.
    #[project = EarlyProj]
    pub enum Early<F> {
        Now { out: Option<Failure> },
        Inner { #[pin] fut: F },
    }
}

impl<F, T> Future for Early<F>
where
    F: Future<Output = Result<T, Failure>>,
{
    type Output = Result<T, Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            EarlyProj::Now { out } => Poll::Ready(Err(out.take().expect("polled after completion"))),
            EarlyProj::Inner { fut } => fut.poll(cx),
        }
    }
}
