//! The pipeline's innermost stage on the native path: sends a prepared
//! request to its upstream and reads the answer's head, within the
//! upstream's timeout. On the upstream's HTTP/1.1 pool the request is
//! written to a pooled stream this task drives itself ([`roundtrip`]); on
//! its h2 connection, see [`super::shared`].

use std::sync::Arc;

use bytes::Buf;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::READ_CHUNK;
use super::buffers::Buffers;
use super::request::{Prepared, Send};
use super::response::{self, ResponseHead};
use super::shared::{probe, shared_or_pool};
use crate::pipeline;
use crate::upstream::Upstream;
use crate::upstream::pool::{Pool, Stream};
use usher_enforce::respond::ProxyError;

/// The upstream's answer: what the connection sends, and, for a route that
/// reads the answer's fields, the connection's buffers, lent until the
/// pipeline is done with the answer (the client's head is read where it
/// was written: no copy).
pub(super) struct Answer<'c> {
    /// What the connection sends.
    pub(super) sending: Sending,
    /// `out` holds the client's version of the head, `fields` where its fields start.
    fields: Option<&'c Buffers>,
}

/// An answer as the connection sends it: its head (the client's version of
/// it is in the connection's `out` buffer) and where its body comes from.
pub(super) struct Sending {
    /// Where the answer's body comes from.
    pub(super) body: Carried,
    /// The answer's head, as the native path needs it.
    pub(super) head: ResponseHead,
    /// The upstream that answered.
    pub(super) upstream: Arc<Upstream>,
}

/// An answer's body.
pub(super) enum Carried {
    /// The rest of it on the pooled stream (its first bytes in the connection's `up` buffer).
    Stream(Stream),
    /// Data from the multiplexed connection's stream.
    Shared(h2::RecvStream),
}

impl pipeline::Answer for Answer<'_> {
    fn status(&self) -> StatusCode {
        self.sending.head.status
    }

    fn retry_after(&self) -> Option<std::time::Duration> {
        self.sending.head.retry_after
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        // The fields as the client gets them, found where parsing marked them.
        let bufs = self.fields?;
        bufs.fields.find(&bufs.out, name)
    }
}

/// The pipeline's innermost stage on the native path: sends the request
/// (on a pooled connection, or on the upstream's multiplexed one) and reads
/// the answer's head, within the upstream's `timeout`.
pub(super) async fn forward(p: Prepared<'_>) -> Result<Answer<'_>, ProxyError> {
    let Prepared { send, keep_head, upstream, bufs, deadline, head_request, idempotent } = p;
    bufs.fields.reset(keep_head);
    #[allow(
        clippy::disallowed_methods,
        reason = "the upstream's timeout is an I/O deadline on tokio's timer, and its latency is observed in tokio's time"
    )]
    let started = Instant::now();
    let timeout = upstream.config.timeout;
    deadline.set(started + timeout);
    let name = || upstream.name().to_string();
    let answered = match send {
        Send::Pool => {
            let pool = &upstream.plain.as_ref().expect("ready pools only for HTTP/1.1 upstreams").pool;
            tokio::select! {
                biased;
                r = roundtrip(pool, &name, head_request, idempotent, bufs) => {
                    Some(r.map(|(stream, head)| (Carried::Stream(stream), head)))
                }
                () = deadline.expired() => None,
            }
        }
        Send::Shared(req) => tokio::select! {
            biased;
            r = shared_or_pool(&upstream, *req, head_request, idempotent, bufs) => Some(r),
            () = deadline.expired() => None,
        },
        Send::Probe(req) => tokio::select! {
            biased;
            r = probe(&upstream, *req, head_request, idempotent, bufs) => Some(r),
            () = deadline.expired() => None,
        },
    };
    upstream.observe(started);
    match answered {
        Some(Ok((body, head))) => {
            let fields = keep_head.then_some(&*bufs);
            Ok(Answer { sending: Sending { body, head, upstream }, fields })
        }
        Some(Err(e)) => Err(e),
        None => {
            // The upstream's multiplexed connection may be dead: it is checked.
            if let Some(h2) = &upstream.h2 {
                h2.timed_out();
            }
            Err(ProxyError::UpstreamTimeout { upstream: name(), after: timeout })
        }
    }
}

/// Sends `bufs.req` to the upstream and reads its final response head,
/// whose version for the client goes to `bufs.out`. A reused connection that fails
/// before any byte of an answer (the upstream closed it as it was being
/// reused) is retried once on a new one: always when the request could not
/// be written, and for idempotent requests when the answer never came.
pub(super) async fn roundtrip(
    pool: &Arc<Pool>,
    name: &(dyn Fn() -> String + Sync),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Stream, ResponseHead), ProxyError> {
    let Buffers { req, up, out, fields, .. } = bufs;
    let failed = |reason: String| ProxyError::Upstream { upstream: name(), reason };
    let mut fresh = false;
    'connection: loop {
        let (mut stream, reused) = match if fresh { None } else { pool.checkout() } {
            Some(s) => (s, true),
            None => {
                // Boxed: a new connection is rare on a busy path, and the
                // connect future would otherwise make every exchange's larger.
                let s = Box::pin(pool.connect())
                    .await
                    .map_err(|reason| ProxyError::UpstreamConnect { upstream: name(), reason })?;
                (s, false)
            }
        };
        if let Err(e) = stream.write_all(req).await {
            if reused {
                tracing::debug!(upstream = %name(), error = %e, "pooled connection closed before the request; retrying on a new one");
                fresh = true;
                continue 'connection;
            }
            return Err(failed(e.to_string()));
        }
        up.clear();
        loop {
            out.clear();
            fields.clear();
            match response::parse(up, head_request, out, fields) {
                Ok(response::Parsed::Final(n, head)) => {
                    up.advance(n);
                    return Ok((stream, head));
                }
                Ok(response::Parsed::Interim(n)) => {
                    up.advance(n);
                    continue;
                }
                Ok(response::Parsed::Partial) => {}
                Err(reason) => return Err(failed(reason)),
            }
            up.reserve(READ_CHUNK);
            let reason = match stream.read_buf(up).await {
                Ok(0) => "connection closed before message completed".to_string(),
                Ok(_) => continue,
                Err(e) => e.to_string(),
            };
            if reused && up.is_empty() && idempotent {
                tracing::debug!(upstream = %name(), reason, "pooled connection closed without answering; retrying on a new one");
                fresh = true;
                continue 'connection;
            }
            return Err(failed(reason));
        }
    }
}
