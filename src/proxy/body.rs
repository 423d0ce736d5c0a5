//! The request body as the general path forwards it: the client's, cut off
//! with an error once it passes `limits.max_body_bytes`, and its errors told
//! apart from the upstream's.
//!
//! It streams: a chunked body is not held back to check its framing first.
//! A body whose framing breaks mid-way fails here, the upstream's request is
//! aborted (never completed) and the client gets a 400; holding bodies back
//! would delay every upload and stall clients that stream while reading the
//! answer (README, Security).

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::Incoming;

use crate::limit::layer::BoxError;

/// `limits.max_body_bytes`, set in a request's extensions when configured.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub u64);

/// The request body as forwarded: the client's, cut off with an error once
/// it passes the body limit.
pub struct RequestBody {
    pub(super) inner: Incoming,
    pub(super) limit: Option<u64>,
    pub(super) seen: u64,
}

/// A request body went past `limits.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than {limit} bytes")]
pub struct BodyTooLarge {
    pub limit: u64,
}

/// Reading the client's request body failed (bad chunked framing, a
/// Content-Length the body does not match, a reset): the client's fault.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the request body: {0}")]
pub struct ClientBody(hyper::Error);

impl hyper::body::Body for RequestBody {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let frame = match std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
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
