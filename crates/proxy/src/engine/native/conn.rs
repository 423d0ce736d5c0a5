//! The connection loop: reads and parses each request, hands it to the
//! pipeline while watching the client, writes the answer, and keeps the
//! connection open for the next one, until it closes or brings a request
//! for the general path.

use std::mem::MaybeUninit;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use http::{Method, Response};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tower::Service;
use tower::util::ServiceFn;

use super::buffers::Buffers;
use super::forward::forward;
use super::head::{self, Head, Parsed, why};
use super::relay::answered;
use super::request::Request;
use super::timers::Timers;
use super::watch::{App, watching};
use super::{Connection, READ_CHUNK, Served, Services, fields, response};
use crate::pipeline::{Exchange, Pipeline, Reply, Stack};
use usher_core::config::listener::ListenerLimits;
use usher_enforce::respond::{self, BoxError, ProxyBody, ProxyError};

/// Serves a client connection whose first bytes (`buf`) are not HTTP/2,
/// until it closes or brings a request for the general path. The first
/// request head must be complete by `deadline`.
pub(crate) async fn serve<I>(
    server: &impl Connection,
    services: &Services<'_>,
    mut io: I,
    mut buf: BytesMut,
    deadline: Instant,
) -> Result<Served<I>, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let limits = *server.limits();
    let mut bufs = Buffers::default();
    let mut timers = Timers::new(server, deadline);
    // While a request waits, a pipelined one may arrive: room for it, no more.
    let room = limits.max_header_bytes + head::MAX_BODY as usize;
    let mut current = Current::new(services, forward);
    loop {
        let (replied, taken) = {
            let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; head::MAX_HEADERS];
            match head::parse(&buf, &mut storage, &limits) {
                Parsed::Partial { head_complete } => {
                    let idle = buf.is_empty();
                    buf.reserve(READ_CHUNK);
                    let read = io.read_buf(&mut buf);
                    // The (small) body the native path waits for counts against the same deadline.
                    let got = tokio::select! {
                        biased;
                        // Shutting down: an idle connection closes; a half-read request is finished.
                        () = timers.closing.as_mut(), if idle => return Ok(Served::Closed),
                        r = read => r,
                        () = timers.head.expired() => {
                            return Err(timed_out(server, &mut io, head_complete, &limits, &mut bufs.out).await);
                        }
                    };
                    match got {
                        Ok(0) if buf.is_empty() => return Ok(Served::Closed),
                        Ok(0) => return Err("the client closed the connection in the middle of a request".into()),
                        // More of the same request: its deadline stands.
                        Ok(_) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                Parsed::HandOff(why) => return Ok(hand_off(services, why, buf, io)),
                Parsed::Ready(h) => {
                    current.refresh(services);
                    // A reload since the connection came may have lowered
                    // the body limit parsing checked: the general path
                    // refuses such a body (413), as it does any over it.
                    if current.snapshot.config.limits.max_body_bytes.is_some_and(|max| h.body_len as u64 > max) {
                        return Ok(hand_off(services, why::BODY, buf, io));
                    }
                    let taken = Taken::of(&h);
                    let body = &buf[h.head_len..taken.consumed];
                    let req = Request { head: h, body, bufs: &mut bufs, deadline: &mut timers.upstream };
                    (current.stack.call(Exchange::new(req)), taken)
                }
            }
        };
        let reply = {
            // Pinned here, and dropped before the buffers it borrowed are used again.
            let replied = std::pin::pin!(replied);
            match watching(&mut io, &mut buf, room + taken.consumed, replied).await {
                // The client left: dropping the exchange gave its admission back.
                None => break,
                Some(Ok(reply)) => reply,
            }
        };
        let open = match reply {
            // Nothing of it has happened: hyper serves it from its first byte.
            Reply::Unserved(why) => return Ok(hand_off(services, why, buf, io)),
            Reply::Made(resp) => {
                buf.advance(taken.consumed);
                write_generated(server, &mut io, resp, taken.close, taken.head_request, &mut bufs.out).await?
            }
            Reply::Upstream { answer, held } => {
                buf.advance(taken.consumed);
                let mut app = App { io: &mut io, buf: &mut buf, room };
                // The pipeline is done with the answer: the buffers it borrowed are free again.
                let sending = answer.sending;
                answered(server, &mut app, &mut bufs, sending, held, taken).await?
            }
        };
        if !open {
            break;
        }
        // Answered, and the connection stays open for the next request.
        timers.next_head(limits.header_timeout);
        bufs.trim(&mut buf);
    }
    let _ = io.shutdown().await;
    Ok(Served::Closed)
}

/// The connection's request stack, built from the pipeline snapshot in
/// force; rebuilt only when a reload has swapped the snapshot (the old one
/// is held, so its address cannot come back as another's).
struct Current<F> {
    /// The snapshot the stack was built from.
    snapshot: Arc<Pipeline>,
    /// The stack, `forward` its innermost stage.
    stack: Stack<ServiceFn<F>>,
    /// The engine's forward stage.
    forward: F,
}

impl<F: Copy> Current<F> {
    /// The stack of the snapshot in force, with `forward` inside.
    fn new(services: &Services<'_>, forward: F) -> Self {
        let snapshot = services.pipeline.load_full();
        let stack = snapshot.stack_on(services.listener, tower::service_fn(forward));
        Current { snapshot, stack, forward }
    }

    /// Rebuilds the stack if a reload has swapped the snapshot since.
    #[inline]
    fn refresh(&mut self, services: &Services<'_>) {
        let current = services.pipeline.load();
        if !Arc::ptr_eq(&current, &self.snapshot) {
            self.snapshot = arc_swap::Guard::into_inner(current);
            self.stack = self.snapshot.stack_on(services.listener, tower::service_fn(self.forward));
        }
    }
}

/// Counts a hand-off and gives the connection to hyper.
fn hand_off<I>(services: &Services<'_>, why: &'static str, buf: BytesMut, io: I) -> Served<I> {
    services.handoffs.with_label_values(&[why]).inc();
    tracing::trace!(reason = why, "request handed to the general HTTP/1.1 path");
    Served::HandOff(buf, io)
}

/// What the connection keeps of a request while the pipeline serves it.
#[derive(Clone, Copy)]
pub(super) struct Taken {
    /// Bytes of the client's buffer the request took.
    consumed: usize,
    /// The client asked to close after this exchange.
    pub(super) close: bool,
    /// The request was HEAD: the answer has no body.
    head_request: bool,
}

impl Taken {
    /// What the connection keeps of the request `h`.
    #[inline]
    fn of(h: &Head<'_>) -> Self {
        Taken { consumed: h.head_len + h.body_len, close: h.close, head_request: h.method == Method::HEAD }
    }
}

/// The header timeout passed while a request was being read: a head still
/// incomplete ends the connection; a request whose body stalled is answered
/// (408), as on the general path. Returns the error that ends the connection.
async fn timed_out<I: AsyncWrite + Unpin>(
    server: &impl Connection,
    io: &mut I,
    head_complete: bool,
    limits: &ListenerLimits,
    out: &mut Vec<u8>,
) -> BoxError {
    if !head_complete {
        return "no complete request head within the header timeout".into();
    }
    let e = ProxyError::BodyTimeout { after: limits.header_timeout };
    let answer = respond::proxy_error(&e, false);
    let write = write_generated(server, io, answer, true, false, out);
    let _ = tokio::time::timeout(limits.header_timeout, write).await;
    e.into()
}

/// Writes a response usher made itself (a refusal, an error), without its
/// body to a HEAD request; returns whether the connection stays open.
async fn write_generated<I: AsyncWrite + Unpin>(
    server: &impl Connection,
    io: &mut I,
    resp: Response<ProxyBody>,
    close: bool,
    head_request: bool,
    out: &mut Vec<u8>,
) -> Result<bool, BoxError> {
    let close = close || server.is_draining();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(parts.status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        fields::push_field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    fields::push_field(out, b"content-length", itoa::Buffer::new().format(body.len()).as_bytes());
    response::push_date(out);
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !head_request {
        out.extend_from_slice(&body);
    }
    io.write_all(out).await?;
    io.flush().await?;
    out.clear();
    Ok(!close)
}
