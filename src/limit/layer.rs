//! The tower middleware: [`LimitLayer`] wraps a service in [`Limit`], which
//! admits each request by the [`Plan`] found in its extensions (no plan:
//! passthrough), then calls the inner service and wraps the response body in
//! a [`PermitBody`] that holds the admission until the body ends.
//!
//! The limiter state lives in the plan's `Arc<Limiter>`s, never in the
//! service, so every clone (every connection, every HTTP/2 stream) shares
//! one budget.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::Buf;
use http::{Request, Response};
use hyper::body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::admit::{Admitted, Plan, Refused, admit};
use crate::clock::Clock;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Adds admission control to a service.
#[derive(Debug, Clone)]
pub struct LimitLayer {
    clock: Clock,
}

impl LimitLayer {
    pub fn new(clock: Clock) -> Self {
        LimitLayer { clock }
    }
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;

    fn layer(&self, inner: S) -> Limit<S> {
        Limit { inner, clock: self.clock.clone() }
    }
}

/// Admits requests by their [`Plan`] before calling `S`.
#[derive(Debug, Clone)]
pub struct Limit<S> {
    inner: S,
    clock: Clock,
}

/// How a request was admitted: put in its response's extensions so outer
/// layers (metrics, the access log) can see how long it waited.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    pub waited: std::time::Duration,
    pub paced: bool,
}

type Admitting = Pin<Box<dyn Future<Output = Result<Admitted, Refused>> + Send>>;

/// Put in a response's extensions by an inner service whose exchange
/// outlives the response body (a protocol upgrade): the admission moves
/// into it and is released when the last clone is dropped, e.g. by the task
/// that copies the upgraded connection.
#[derive(Clone, Default)]
pub struct Hold(Arc<Mutex<Option<Admitted>>>);

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

impl<S, B, RB> Service<Request<B>> for Limit<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    S::Error: Into<BoxError>,
{
    type Response = Response<PermitBody<RB>>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        match req.extensions_mut().remove::<Plan>() {
            Some(plan) if !plan.is_empty() => {
                let clock = self.clock.clone();
                ResponseFuture {
                    admission: Some(Box::pin(async move { admit(&plan, &clock).await })),
                    pending: Some((inner, req)),
                    admitted: None,
                    call: None,
                }
            }
            _ => ResponseFuture { admission: None, pending: None, admitted: None, call: Some(inner.call(req)) },
        }
    }
}

pin_project! {
    /// Admits, then calls the inner service.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        admission: Option<Admitting>,
        pending: Option<(S, Request<B>)>,
        admitted: Option<Admitted>,
        #[pin]
        call: Option<S::Future>,
    }
}

impl<S, B, RB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<Response<PermitBody<RB>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            if let Some(fut) = this.call.as_mut().as_pin_mut() {
                let mut resp = ready!(fut.poll(cx)).map_err(Into::into)?;
                let mut admitted = this.admitted.take();
                if let Some(a) = &admitted {
                    resp.extensions_mut().insert(Admission { waited: a.waited, paced: a.paced });
                }
                if let Some(hold) = resp.extensions().get::<Hold>() {
                    *hold.0.lock().expect("hold lock") = admitted.take();
                }
                return Poll::Ready(Ok(resp.map(|body| PermitBody { inner: body, admitted })));
            }
            let adm = this.admission.as_mut().expect("ResponseFuture polled after completion");
            match ready!(adm.as_mut().poll(cx)) {
                Ok(a) => {
                    *this.admission = None;
                    let (mut svc, req) = this.pending.take().expect("request pending");
                    *this.admitted = Some(a);
                    this.call.set(Some(svc.call(req)));
                }
                Err(refused) => {
                    *this.admission = None;
                    return Poll::Ready(Err(Box::new(refused)));
                }
            }
        }
    }
}

pin_project! {
    /// A response body that holds its request's admission (gauge permits,
    /// in-flight count) until the body ends or is dropped.
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        admitted: Option<Admitted>,
    }
}

impl<B> PermitBody<B> {
    pub fn new(inner: B, admitted: Option<Admitted>) -> Self {
        PermitBody { inner, admitted }
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body,
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        if frame.is_none() || matches!(frame, Some(Err(_))) {
            *this.admitted = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
