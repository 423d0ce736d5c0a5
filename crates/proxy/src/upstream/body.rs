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

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use hyper::body::Incoming;

use usher_enforce::respond::BoxError;

/// `limits.max_body_bytes`, set in a request's extensions when configured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyLimit(pub u64);

/// The request body as forwarded: the client's, cut off with an error once
/// it passes the body limit.
pub struct RequestBody {
    pub(crate) inner: Incoming,
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

impl hyper::body::Body for RequestBody {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
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
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}
