//! The request body as the general path forwards it: the client's, cut off
//! with an error once it passes `limits.max_body_bytes`, and its errors told
//! apart from the upstream's.
//!
//! It streams: a chunked body is not held back to check its framing first.
//! A body whose framing breaks mid-way fails here, the upstream's request is
//! aborted (never completed) and the client gets a 400; holding bodies back
//! would delay every upload and stall clients that stream while reading the
//! answer (README, Security).
//!
//! It also says how far it got ([`Progress`]): the upstream's `timeout` for
//! response headers runs from the body's end, and a client that sends no
//! body bytes for that long is told so (408), not the upstream blamed.
//!
//! A route that reads the body before admission (a cost taken from it, or
//! OpenAI's usage asked for) has its first bytes read ahead ([`read_ahead`]):
//! up to a bound, each piece within the same `timeout`. They go upstream
//! first ([`Ahead`]), then the rest as it streams.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use tokio::time::Instant;

use usher_core::error::error_chain;
use usher_enforce::respond::{BoxError, ProxyError};

/// How the general path forwards a request's body, set in its extensions
/// when `limits.max_body_bytes` is configured or a route read the body ahead.
#[derive(Debug, Clone, Default)]
pub(crate) struct BodyPlan {
    /// `limits.max_body_bytes`.
    pub(crate) limit: Option<u64>,
    /// What a route read of the body before admission.
    pub(crate) ahead: Option<Box<Ahead>>,
}

/// A request body's first bytes, read before admission for a route that
/// reads the body: sent upstream before the rest.
#[derive(Debug, Clone)]
pub(crate) struct Ahead {
    /// The bytes read (taken as they are sent).
    pub(crate) data: Bytes,
    /// The body's trailers, when it ended with some.
    pub(crate) trailers: Option<HeaderMap>,
    /// `data` is the whole body; else it passed the bound, and the rest is to come.
    pub(crate) whole: bool,
}

impl Ahead {
    /// Whether nothing is left to send of it.
    pub(crate) fn is_empty(&self) -> bool {
        self.data.is_empty() && self.trailers.is_none()
    }

    /// Its next frame to send: the data, then the trailers.
    fn next_frame(&mut self) -> Option<Frame<Bytes>> {
        if !self.data.is_empty() {
            return Some(Frame::data(std::mem::take(&mut self.data)));
        }
        self.trailers.take().map(Frame::trailers)
    }
}

/// Reads up to `bound` bytes of `req`'s body ahead of admission, each piece
/// within `timeout` of the last, and keeps them in its [`BodyPlan`]: the
/// whole body, or its first bytes past the bound. A body that declares a
/// length over the bound is not read. A body over `limits.max_body_bytes`
/// is refused (413), one the client stops sending is a 408, one it cannot
/// frame a 400.
pub(crate) async fn read_ahead(
    mut req: http::Request<Incoming>,
    bound: usize,
    timeout: Duration,
) -> Result<http::Request<Incoming>, ProxyError> {
    let limit = req.extensions().get::<BodyPlan>().and_then(|p| p.limit);
    let (mut data, mut trailers) = (BytesMut::new(), None);
    let mut whole = req.body().size_hint().lower() <= bound as u64;
    while whole && !req.body().is_end_stream() {
        let frame = match tokio::time::timeout(timeout, req.body_mut().frame()).await {
            Err(_) => return Err(ProxyError::ClientStalled { route: String::new(), after: timeout }),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(ProxyError::BadRequest(error_chain(&ClientBody(e)))),
            Ok(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(d) => data.extend_from_slice(&d),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
        if let Some(limit) = limit.filter(|l| data.len() as u64 > *l) {
            return Err(ProxyError::BodyTooLarge { limit });
        }
        whole = data.len() <= bound;
    }
    let ahead = Some(Box::new(Ahead { data: data.freeze(), trailers, whole }));
    match req.extensions_mut().get_mut::<BodyPlan>() {
        Some(plan) => plan.ahead = ahead,
        None => {
            req.extensions_mut().insert(BodyPlan { limit: None, ahead });
        }
    }
    Ok(req)
}

/// The request body as forwarded: the client's, cut off with an error once
/// it passes the body limit.
pub struct RequestBody {
    pub(crate) inner: Incoming,
    /// What a route read ahead: sent before the rest of `inner`.
    pub(crate) ahead: Option<Box<Ahead>>,
    pub(crate) limit: Option<u64>,
    pub(crate) seen: u64,
    /// Set for a body not known to be empty: how far it got.
    pub(crate) progress: Option<Arc<Progress>>,
}

/// How far a streamed request body got, as [`RequestBody`] records it.
pub(crate) struct Progress {
    start: Instant,
    /// Nanoseconds from `start` to the last frame from the client, or the body's end.
    last: AtomicU64,
    state: AtomicU8,
}

/// Where a streamed request body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sending {
    /// Not asked for more since its last frame (the upstream is not taking it yet).
    Streaming,
    /// Asked for more, and the client has not sent it.
    AwaitingClient,
    /// Sent whole.
    Done,
}

impl Progress {
    #[allow(
        clippy::disallowed_methods,
        reason = "the response deadline follows the body's progress on tokio's timer, in tokio's time"
    )]
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Progress { start: Instant::now(), last: AtomicU64::new(0), state: AtomicU8::new(0) })
    }

    /// Where the body stands, and since when (its last frame, or its end).
    pub(crate) fn read(&self) -> (Sending, Instant) {
        let state = match self.state.load(Ordering::Acquire) {
            0 => Sending::Streaming,
            1 => Sending::AwaitingClient,
            _ => Sending::Done,
        };
        (state, self.start + Duration::from_nanos(self.last.load(Ordering::Acquire)))
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "the response deadline follows the body's progress on tokio's timer, in tokio's time"
    )]
    fn moved(&self, state: Sending) {
        let at = Instant::now().saturating_duration_since(self.start).as_nanos() as u64;
        self.last.store(at, Ordering::Release);
        self.set(state);
    }

    fn set(&self, state: Sending) {
        self.state.store(state as u8, Ordering::Release);
    }
}

/// A request body went past `limits.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than {limit} bytes")]
pub(crate) struct BodyTooLarge {
    pub limit: u64,
}

/// Reading the client's request body failed (bad chunked framing, a
/// Content-Length the body does not match, a reset): the client's fault.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the request body: {0}")]
pub(crate) struct ClientBody(hyper::Error);

impl RequestBody {
    /// The next frame of what was read ahead; None once it is all sent.
    #[cold]
    fn send_ahead(&mut self) -> Option<Frame<Bytes>> {
        let ahead = self.ahead.as_mut()?;
        let frame = ahead.next_frame();
        if ahead.is_empty() {
            self.ahead = None;
        }
        let frame = frame?;
        if let Some(data) = frame.data_ref() {
            self.seen = self.seen.saturating_add(data.len() as u64);
        }
        if let Some(p) = &self.progress {
            p.moved(if self.is_end_stream() { Sending::Done } else { Sending::Streaming });
        }
        Some(frame)
    }
}

impl hyper::body::Body for RequestBody {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        if self.ahead.is_some()
            && let Some(frame) = self.send_ahead()
        {
            return Poll::Ready(Some(Ok(frame)));
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Some(p) = &self.progress {
            match &polled {
                Poll::Pending => p.set(Sending::AwaitingClient),
                Poll::Ready(None) => p.moved(Sending::Done),
                // A Content-Length body ends with its last bytes: hyper asks no further.
                Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => p.moved(Sending::Done),
                Poll::Ready(_) => p.moved(Sending::Streaming),
            }
        }
        let frame = match std::task::ready!(polled) {
            None => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(Box::new(ClientBody(e))))),
            Some(Ok(f)) => f,
        };
        if let (Some(limit), Some(data)) = (self.limit, frame.data_ref()) {
            self.seen = self.seen.saturating_add(data.len() as u64);
            if self.seen > limit {
                return Poll::Ready(Some(Err(Box::new(BodyTooLarge { limit }))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let inner = self.inner.size_hint();
        let Some(n) = self.ahead.as_ref().map(|a| a.data.len() as u64) else { return inner };
        let mut hint = hyper::body::SizeHint::new();
        hint.set_lower(inner.lower() + n);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + n);
        }
        hint
    }
}
