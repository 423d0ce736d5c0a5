//! [`RouteFuture`]: the route stage's future, which for a route that reads
//! the request's body waits for it ([`ReadAhead`]), then works out what it
//! says ([`read`]: the plan's costs, the body to send instead) before the
//! request goes on to admission.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::Service;

use crate::pipeline::{BodyAccess, Error, Exchange, Failure, Meta, ReadAhead};
use crate::route::Route;
use usher_enforce::metrics::BodyOutcome;
use usher_enforce::request_body;
use usher_enforce::respond::ProxyError;

pin_project! {
    /// The route stage's future: failed at once, reading ahead the body of
    /// a request whose route reads it, or the inner service's.
    pub struct RouteFuture<S, T>
    where
        T: ReadAhead,
        S: Service<Exchange<T>>,
    {
        #[pin]
        state: State<S, T>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, T>
    where
        T: ReadAhead,
        S: Service<Exchange<T>>,
    {
        Now { out: Option<Failure> },
        // Boxed: only routes that read bodies come here, and every other
        // request's future stays as small as it was.
        Reading { reading: Option<Box<Reading<S, T>>> },
        Inner { #[pin] fut: S::Future },
    }
}

/// A ready request whose body is being read ahead, and what it goes on with.
struct Reading<S, T: ReadAhead> {
    read: T::Reading,
    /// The inner service, ready.
    svc: S,
    /// Routed: the route, its plan (at the costs it falls back to), in flight.
    meta: Meta,
}

impl<S, T> RouteFuture<S, T>
where
    T: ReadAhead,
    S: Service<Exchange<T>>,
{
    /// The stage failed the request.
    #[inline]
    pub(super) fn failed(failure: Failure) -> Self {
        RouteFuture { state: State::Now { out: Some(failure) } }
    }

    /// The request went on at once: the inner service's future `fut`.
    #[inline]
    pub(super) fn inner(fut: S::Future) -> Self {
        RouteFuture { state: State::Inner { fut } }
    }

    /// A request whose body `read` reads ahead, then goes to `svc`.
    pub(super) fn reading(read: T::Reading, svc: S, meta: Meta) -> Self {
        RouteFuture { state: State::Reading { reading: Some(Box::new(Reading { read, svc, meta })) } }
    }
}

impl<S, T> Future for RouteFuture<S, T>
where
    T: ReadAhead,
    S: Service<Exchange<T>, Error = Failure>,
{
    type Output = Result<S::Response, Failure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project().state.project() {
                StateProj::Now { out } => return Poll::Ready(Err(out.take().expect("polled after completion"))),
                StateProj::Inner { fut } => return fut.poll(cx),
                StateProj::Reading { reading } => {
                    let r = reading.as_mut().expect("polled after completion");
                    let read = ready!(Pin::new(&mut r.read).poll(cx));
                    let r = reading.take().expect("polled after completion");
                    self.set(go_on(read, *r));
                }
            }
        }
    }
}

/// The body was read ahead (or failed to be): what it says is worked out
/// and the request goes on to `svc`.
fn go_on<S, T>(read: Result<T, ProxyError>, r: Reading<S, T>) -> RouteFuture<S, T>
where
    T: ReadAhead,
    S: Service<Exchange<T>, Error = Failure>,
{
    let Reading { read: _, mut svc, mut meta } = r;
    let mut req = match read {
        Ok(req) => req,
        Err(e) => return RouteFuture::failed(Failure { error: Error::Proxy(e), meta }),
    };
    let route = meta.route.clone().expect("routed");
    count(&route, read_into(&route, &mut meta, &mut req));
    RouteFuture::inner(svc.call(Exchange { req, meta }))
}

/// Reads the body of a request on `route` (routed: `meta`): its costs go
/// in the plan, and a body that asks for OpenAI's usage on the app's behalf
/// replaces the app's. Returns what became of the body, to count once the
/// request goes on ([`count`]).
pub(super) fn read(route: &Route, meta: &mut Meta, body: &mut dyn BodyAccess) -> BodyOutcome {
    read_into(route, meta, body)
}

fn read_into(route: &Route, meta: &mut Meta, body: &mut (impl BodyAccess + ?Sized)) -> BodyOutcome {
    let ask_usage = route.body.as_ref().is_some_and(|b| b.ask_usage);
    let found = request_body::read(&route.resources, &meta.plan, body.body(), ask_usage);
    if let Some(sent) = found.body {
        body.replace_body(sent);
        meta.usage_injected = true;
    }
    if let Some(plan) = found.plan {
        meta.plan = plan;
    }
    found.outcome
}

/// Counts what became of a body the route read.
pub(super) fn count(route: &Route, outcome: BodyOutcome) {
    if let Some(b) = &route.body {
        b.metrics.count(outcome);
    }
}
