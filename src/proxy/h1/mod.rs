//! The native HTTP/1.1 path: usher's own request loop for the everyday
//! exchange between an app and a plain-HTTP/1.1 upstream.
//!
//! hyper serves every request through two tasks (the client connection's
//! and the upstream connection's), channels between them, a header map per
//! message and per side, and a tower stack. For a sidecar whose every
//! request is one small exchange, that was 36,000 instructions a request
//! against nginx's 16,000. Here one task per client connection parses the
//! request in place ([`head`]), routes and admits it with the same code as
//! the general path ([`super::route`], [`crate::limit::admit`]), writes it
//! to a pooled upstream stream it drives itself ([`pool`]), and streams the
//! response back ([`response`]), all in reused buffers.
//!
//! Whatever is not that everyday exchange (a malformed or ambiguous head, a
//! chunked or large request body, `Expect`, `Upgrade`, CONNECT, HTTP/1.0, a
//! request for an HTTPS, h2c or passthrough origin, gRPC) is handed to
//! hyper before anything of it has happened: the connection's unread bytes,
//! that request first, go to the general path, which serves the connection
//! from then on. `usher_proxy_http1_handoffs_total{reason}` counts why.
//! `USHER_HTTP1=hyper` turns the native path off.
//!
//! Behaviour matches the general path's: the same routing, admission,
//! metrics, access log, pushback, error responses, header and body limits,
//! header timeout (an idle keep-alive connection is closed after it),
//! `connection: close` while draining, and a client's EOF cancelling its
//! request while it waits for capacity or for the upstream.

mod head;
mod pool;
mod response;

use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::{Buf, BytesMut};
use http::Response;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

pub use head::why;
pub use pool::Pool;

use super::listener::ConnServer;
use super::respond::ProxyError;
use super::route::Route;
use super::upstream::{self, Target, Upstream};
use super::{InFlight, Proxy, ProxyBody};
use crate::limit::Plan;
use crate::limit::admit::admit;
use crate::limit::layer::{Admission, BoxError};
use head::Parsed;
use response::{Dechunker, Framing, ResponseHead};

/// Bytes asked of the kernel per read.
const READ_CHUNK: usize = 16 * 1024;

/// How a connection left the native path.
pub enum Served<I> {
    /// It is closed, or the client went away.
    Closed,
    /// It brought a request the native path does not serve: the general path
    /// serves it from `buf` (that request and anything after it) on.
    HandOff(BytesMut, I),
}

/// One connection's reused buffers.
#[derive(Default)]
struct Buffers {
    /// The request as sent upstream.
    req: Vec<u8>,
    /// Bytes read from the upstream.
    up: BytesMut,
    /// Bytes for the client.
    out: Vec<u8>,
}

/// Buffer capacity a connection keeps between requests; a buffer a large
/// exchange grew past it is given back, so idle connections stay small.
const KEEP: usize = 32 * 1024;

impl Buffers {
    /// Between requests: gives back what grew past [`KEEP`], and the
    /// client's buffer `client` too once it holds nothing (no pipelined request).
    fn trim(&mut self, client: &mut BytesMut) {
        if self.req.capacity() > KEEP {
            self.req = Vec::new();
        }
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
        if self.up.capacity() > KEEP {
            self.up = BytesMut::new();
        }
        if client.is_empty() && client.capacity() > KEEP {
            *client = BytesMut::new();
        }
    }
}

/// A deadline that moves with every request but whose timer is re-armed
/// only when it fires before the deadline (nginx's lazy timers): one timer
/// registration per timeout period on a busy connection, not two per request.
struct Lazy {
    sleep: Pin<Box<Sleep>>,
    deadline: Instant,
}

impl Lazy {
    fn new(deadline: Instant) -> Self {
        Lazy { sleep: Box::pin(tokio::time::sleep_until(deadline)), deadline }
    }

    /// Moves the deadline; the timer is touched only if it must fire sooner.
    fn set(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if deadline < self.sleep.deadline() {
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// Completes once the deadline has passed.
    async fn expired(&mut self) {
        std::future::poll_fn(|cx| {
            while self.sleep.as_mut().poll(cx).is_ready() {
                if self.sleep.deadline() >= self.deadline {
                    return Poll::Ready(());
                }
                let deadline = self.deadline;
                self.sleep.as_mut().reset(deadline);
            }
            Poll::Pending
        })
        .await
    }
}

/// One connection's timers and its shutdown signal, kept across requests.
struct Timers {
    /// The next request head (and its small body) must be in by then.
    head: Lazy,
    /// The upstream's response head must be in by then.
    upstream: Lazy,
    /// Shutdown's end: idle connections close.
    closing: Pin<Box<WaitForCancellationFutureOwned>>,
}

/// A routed request, ready to be admitted and forwarded.
struct Exchange {
    route: Arc<Route>,
    plan: Plan,
    /// An upstream with a native side (`prepare` checked).
    upstream: Arc<Upstream>,
    /// Bytes of the client's buffer this request took.
    consumed: usize,
    head_request: bool,
    idempotent: bool,
    /// The client asked to close after this exchange.
    close: bool,
}

impl Exchange {
    fn pool(&self) -> &Arc<Pool> {
        &self.upstream.native.as_ref().expect("prepare routes only upstreams with a native side").pool
    }
}

enum Step {
    Read {
        head_complete: bool,
    },
    HandOff(&'static str),
    Exchange(Exchange),
    /// Answered without the upstream (no route).
    Answer(Box<Answer>),
}

/// A response usher makes itself, and how to send it.
struct Answer {
    resp: Response<ProxyBody>,
    /// Bytes of the client's buffer the request took.
    consumed: usize,
    /// The client asked to close after this exchange.
    close: bool,
    /// The request was HEAD: the answer has no body.
    head_request: bool,
}

/// Serves a client connection whose first bytes (`buf`) are not HTTP/2,
/// until it closes or brings a request for the general path. The first
/// request head must be complete by `deadline`.
pub async fn serve<I>(
    server: &ConnServer,
    proxy: &Arc<Proxy>,
    mut io: I,
    mut buf: BytesMut,
    deadline: Instant,
) -> Result<Served<I>, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let limits = *server.limits();
    let mut bufs = Buffers::default();
    let mut timers = Timers {
        head: Lazy::new(deadline),
        upstream: Lazy::new(deadline),
        closing: Box::pin(server.closing().clone().cancelled_owned()),
    };
    loop {
        let step = {
            let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; head::MAX_HEADERS];
            match head::parse(&buf, &mut storage, &limits) {
                Parsed::Partial { head_complete } => Step::Read { head_complete },
                Parsed::HandOff(why) => Step::HandOff(why),
                Parsed::Ready(h) => prepare(proxy, &h, &buf, &mut bufs.req),
            }
        };
        match step {
            Step::HandOff(why) => {
                proxy.metrics.http1_handoffs.with_label_values(&[why]).inc();
                tracing::trace!(reason = why, "request handed to the general HTTP/1.1 path");
                return Ok(Served::HandOff(buf, io));
            }
            Step::Read { head_complete } => {
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
                        return Err(if head_complete {
                            "request body not received within the header timeout".into()
                        } else {
                            "no complete request head within the header timeout".into()
                        });
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
            Step::Answer(answer) => {
                let Answer { resp, consumed, close, head_request } = *answer;
                buf.advance(consumed);
                if !write_generated(server, &mut io, resp, close, head_request, &mut bufs.out).await? {
                    break;
                }
            }
            Step::Exchange(ex) => {
                buf.advance(ex.consumed);
                if !exchange(server, proxy, &mut io, &mut buf, &mut bufs, &mut timers.upstream, ex).await? {
                    break;
                }
            }
        }
        // Answered, and the connection stays open for the next request.
        timers.head.set(Instant::now() + limits.header_timeout);
        bufs.trim(&mut buf);
    }
    let _ = io.shutdown().await;
    Ok(Served::Closed)
}

/// Routes a parsed request and encodes it for its upstream, or says why
/// the general path must serve it.
fn prepare(proxy: &Proxy, h: &head::Head<'_>, buf: &[u8], req: &mut Vec<u8>) -> Step {
    let consumed = h.head_len + h.body_len;
    let head_request = h.method == http::Method::HEAD;
    let resolved = match proxy.routing.load().resolve_view(h) {
        Ok(r) => r,
        Err(e) => {
            let resp = proxy.route_error(&e, false, proxy.table.clock().now());
            return Step::Answer(Box::new(Answer { resp, consumed, close: h.close, head_request }));
        }
    };
    let Target::Upstream(upstream) = resolved.target else { return Step::HandOff(why::UPSTREAM) };
    let Some(native) = &upstream.native else { return Step::HandOff(why::UPSTREAM) };
    req.clear();
    let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
    h.encode(&native.prefix, host, &buf[h.head_len..consumed], req);
    Step::Exchange(Exchange {
        route: resolved.route,
        plan: resolved.plan,
        upstream,
        consumed,
        head_request,
        idempotent: h.idempotent(),
        close: h.close,
    })
}

/// Admits, forwards and answers one request; returns whether the
/// connection stays open for another.
async fn exchange<I>(
    server: &ConnServer,
    proxy: &Proxy,
    io: &mut I,
    buf: &mut BytesMut,
    bufs: &mut Buffers,
    deadline: &mut Lazy,
    ex: Exchange,
) -> Result<bool, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let clock = proxy.table.clock();
    let arrived = clock.now();
    let route = &ex.route;
    let in_flight = InFlight::new(&route.metrics.in_flight);
    // While the request waits, a pipelined one may arrive: room for it, no more.
    let room = server.limits().max_header_bytes + head::MAX_BODY as usize;

    let admitted = if ex.plan.is_empty() {
        None
    } else {
        match watching(io, buf, room, admit(&ex.plan, clock)).await {
            // The client left: dropping the admission gave its place back.
            None => return Ok(false),
            Some(Err(refused)) => {
                let resp = proxy.refuse(route, &ex.plan, &refused, false, arrived);
                return write_generated(server, io, resp, ex.close, ex.head_request, &mut bufs.out).await;
            }
            Some(Ok(a)) => Some(a),
        }
    };
    let admission = admitted.as_ref().map(|a| Admission { waited: a.waited, paced: a.paced });

    let started = Instant::now();
    let timeout = ex.upstream.config.timeout;
    deadline.set(started + timeout);
    let answered = async {
        tokio::select! {
            biased;
            r = roundtrip(&ex, &bufs.req, &mut bufs.up, &mut bufs.out) => Some(r),
            () = deadline.expired() => None,
        }
    };
    let sent = watching(io, buf, room, answered).await;
    upstream::observe(&ex.upstream, &proxy.metrics, started);
    let answer = match sent {
        None => return Ok(false),
        Some(Some(answer)) => answer,
        Some(None) => Err(ProxyError::UpstreamTimeout { upstream: ex.upstream.name().to_string(), after: timeout }),
    };
    let (stream, head) = match answer {
        Ok(got) => got,
        Err(err) => {
            let resp = proxy.upstream_failed(route, &ex.plan, Box::new(err), false, arrived);
            return write_generated(server, io, resp, ex.close, ex.head_request, &mut bufs.out).await;
        }
    };
    proxy.record_answer(route, &ex.plan, admission, head.status, || head.retry_after, arrived);

    let close = ex.close || server.is_draining();
    if close {
        bufs.out.extend_from_slice(b"connection: close\r\n");
    }
    bufs.out.extend_from_slice(b"\r\n");
    let relayed = relay(&head, stream, &mut bufs.up, io, &mut bufs.out).await;
    // The admission (gauge permits) and the in-flight count last until the body has ended.
    drop((admitted, in_flight));
    match relayed {
        Ok(Some(stream)) if head.reusable => ex.pool().put(stream),
        Ok(_) => {}
        Err(BodyError::Upstream(e)) => {
            // The status is already sent: the client sees its body cut.
            route.metrics.body_errors.inc();
            tracing::debug!(route = %route.name, error = %e, "response body failed after the headers");
            return Ok(false);
        }
        Err(BodyError::Client(e)) => {
            tracing::debug!(error = %e, "client connection failed while sending the response");
            return Ok(false);
        }
    }
    Ok(!close)
}

/// Runs `fut` while reading whatever the client sends meanwhile into `buf`
/// (a pipelined request), up to `room` bytes. The client's EOF, or a read
/// error, cancels `fut` (returns `None`): a client that gives up frees its
/// place in the queue at once.
async fn watching<I, F>(io: &mut I, buf: &mut BytesMut, room: usize, fut: F) -> Option<F::Output>
where
    I: AsyncRead + Unpin,
    F: Future,
{
    tokio::pin!(fut);
    loop {
        if buf.len() >= room {
            return Some(fut.await);
        }
        buf.reserve(READ_CHUNK);
        tokio::select! {
            biased;
            out = &mut fut => return Some(out),
            r = io.read_buf(buf) => match r {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            },
        }
    }
}

/// Sends `req` to the upstream and reads its final response head, whose
/// version for the client goes to `out`. A reused connection that fails
/// before any byte of an answer (the upstream closed it as it was being
/// reused) is retried once on a new one: always when the request could not
/// be written, and for idempotent requests when the answer never came.
async fn roundtrip(
    ex: &Exchange,
    req: &[u8],
    up: &mut BytesMut,
    out: &mut Vec<u8>,
) -> Result<(TcpStream, ResponseHead), ProxyError> {
    let name = || ex.upstream.name().to_string();
    let failed = |reason: String| ProxyError::Upstream { upstream: name(), reason };
    let mut fresh = false;
    'connection: loop {
        let (mut stream, reused) = match if fresh { None } else { ex.pool().checkout() } {
            Some(s) => (s, true),
            None => {
                let s = ex
                    .pool()
                    .connect_tcp()
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
            match response::parse(up, ex.head_request, out) {
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
            if reused && up.is_empty() && ex.idempotent {
                tracing::debug!(upstream = %name(), reason, "pooled connection closed without answering; retrying on a new one");
                fresh = true;
                continue 'connection;
            }
            return Err(failed(reason));
        }
    }
}

enum BodyError {
    Upstream(String),
    Client(std::io::Error),
}

/// Sends the client the head in `out` and the body that follows `head` on
/// `stream` (its first bytes already in `up`). Returns the stream when the
/// body ended cleanly with nothing after it, so it can carry another request.
async fn relay<I>(
    head: &ResponseHead,
    mut stream: TcpStream,
    up: &mut BytesMut,
    io: &mut I,
    out: &mut Vec<u8>,
) -> Result<Option<TcpStream>, BodyError>
where
    I: AsyncWrite + Unpin,
{
    let cut = |what: &str| BodyError::Upstream(format!("the upstream closed the connection {what}"));
    match head.framing {
        Framing::Empty => send(io, out).await?,
        Framing::Length(n) => {
            let first = up.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            out.extend_from_slice(&up[..first]);
            up.advance(first);
            let mut left = n - first as u64;
            send(io, out).await?;
            while left > 0 {
                up.clear();
                up.reserve(READ_CHUNK);
                match stream.read_buf(up).await {
                    Ok(0) => return Err(cut(&format!("{left} bytes before the end of the body"))),
                    Ok(_) => {}
                    Err(e) => return Err(BodyError::Upstream(e.to_string())),
                }
                let take = up.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                io.write_all(&up[..take]).await.map_err(BodyError::Client)?;
                up.advance(take);
                left -= take as u64;
            }
        }
        Framing::Chunked => {
            let mut chunks = Dechunker::default();
            loop {
                let used = match chunks.feed(up, out) {
                    Ok(used) => used,
                    Err(e) => {
                        // The head and what decoded before the fault still go
                        // out, so the client always sees the same cut answer,
                        // however the upstream's bytes were split into reads.
                        send(io, out).await?;
                        io.flush().await.map_err(BodyError::Client)?;
                        return Err(BodyError::Upstream(e.to_string()));
                    }
                };
                up.advance(used);
                send(io, out).await?;
                if chunks.is_done() {
                    break;
                }
                up.clear();
                up.reserve(READ_CHUNK);
                match stream.read_buf(up).await {
                    Ok(0) => return Err(cut("in the middle of a chunked body")),
                    Ok(_) => {}
                    Err(e) => return Err(BodyError::Upstream(e.to_string())),
                }
            }
        }
        Framing::Close => loop {
            // What has come goes out before the next read: a body that
            // trickles (a stream of events) is not held back by the wait.
            response::push_chunk(out, up);
            send(io, out).await?;
            up.clear();
            up.reserve(READ_CHUNK);
            let n = stream.read_buf(up).await.map_err(|e| BodyError::Upstream(e.to_string()))?;
            if n == 0 {
                out.extend_from_slice(b"0\r\n\r\n");
                send(io, out).await?;
                io.flush().await.map_err(BodyError::Client)?;
                return Ok(None);
            }
        },
    }
    io.flush().await.map_err(BodyError::Client)?;
    // Bytes after the body are a broken upstream: its connection is not reused.
    Ok(up.is_empty().then_some(stream))
}

/// Writes and empties `out`.
async fn send<I: AsyncWrite + Unpin>(io: &mut I, out: &mut Vec<u8>) -> Result<(), BodyError> {
    if !out.is_empty() {
        io.write_all(out).await.map_err(BodyError::Client)?;
        out.clear();
    }
    Ok(())
}

/// Writes a response usher made itself (a refusal, an error), without its
/// body to a HEAD request; returns whether the connection stays open.
async fn write_generated<I: AsyncWrite + Unpin>(
    server: &ConnServer,
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
        response::push_field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    response::push_field(out, b"content-length", itoa::Buffer::new().format(body.len()).as_bytes());
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

/// The upstream side of a plain-HTTP/1.1 upstream on the native path.
pub struct Native {
    pub pool: Arc<Pool>,
    /// The upstream URL's path without its trailing `/`, put before every request's path.
    pub prefix: String,
}

#[cfg(test)]
mod tests;
