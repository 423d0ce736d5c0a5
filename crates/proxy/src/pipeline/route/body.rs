//! [`RouteFuture`]: the route stage's future, which for a route that reads
//! the request's body waits for it ([`ReadAhead`]), then works out what it
//! says ([`read`]: the plan's costs, the body to send instead) before the
//! request goes on to admission.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::Service;

use super::BodyRead;
use crate::pipeline::{BodyAccess, Error, Exchange, Failure, Inbound, Meta, ReadAhead};
use crate::route::Route;
use crate::upstream::Target;
use usher_enforce::metrics::BodyOutcome;
use usher_enforce::request_body;
use usher_enforce::respond::ProxyError;
use usher_limit::admit::Plan;

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
fn go_on<S, T>(ahead: Result<T, ProxyError>, r: Reading<S, T>) -> RouteFuture<S, T>
where
    T: ReadAhead,
    S: Service<Exchange<T>, Error = Failure>,
{
    let Reading { read: _, mut svc, mut meta } = r;
    let mut req = match ahead {
        Ok(req) => req,
        Err(e) => return RouteFuture::failed(Failure { error: Error::Proxy(e), meta }),
    };
    let route = meta.route.clone().expect("routed");
    let mut plan = std::mem::take(&mut meta.plan);
    count(&route, read(&route, &mut plan, &mut meta, &mut req));
    meta.plan = plan;
    RouteFuture::inner(svc.call(Exchange { req, meta }))
}

/// The body of a request on `route`, a route that reads it: read now if the
/// engine holds it ([`Inbound::in_hand`]), else to read once the request is
/// ready, within its upstream's `timeout` per piece. Out of line, and by
/// reference: the everyday request's path stays as it was.
#[cold]
#[inline(never)]
pub(super) fn in_hand<R: Inbound>(
    route: &Route,
    plan: &mut Plan,
    meta: &mut Meta,
    req: &mut R,
    target: &Target,
) -> BodyRead {
    match req.in_hand() {
        Some(body) => BodyRead::InHand(read(route, plan, meta, body)),
        None => BodyRead::Ahead(match target {
            Target::Upstream(u) | Target::Direct(u) => u.config.timeout,
        }),
    }
}

/// Reads the body of a request on `route`: its costs go in `plan`, and a
/// body that asks for OpenAI's usage on the app's behalf replaces the app's
/// (`meta` says so). Returns what became of the body, to count once the
/// request goes on ([`count`]).
fn read(route: &Route, plan: &mut Plan, meta: &mut Meta, body: &mut (impl BodyAccess + ?Sized)) -> BodyOutcome {
    let ask_usage = route.body.as_ref().is_some_and(|b| b.ask_usage);
    let found = request_body::read(&route.resources, plan, body.body(), ask_usage);
    if let Some(sent) = found.body {
        body.replace_body(sent);
        meta.usage_injected = true;
    }
    if let Some(recosted) = found.plan {
        *plan = recosted;
    }
    found.outcome
}

/// Counts what became of a body the route read.
#[cold]
pub(super) fn count(route: &Route, outcome: BodyOutcome) {
    if let Some(b) = &route.body {
        b.metrics.count(outcome);
    }
}
