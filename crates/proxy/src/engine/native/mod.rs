//! The native HTTP/1.1 path: usher's own request loop for the everyday
//! exchange between an app and an HTTP/1.1 upstream (plain or TLS).
//!
//! hyper serves every request through two tasks (the client connection's
//! and the upstream connection's), channels between them, a header map per
//! message and per side, and a tower stack. For a sidecar whose every
//! request is one small exchange, that was 36,000 instructions a request
//! against nginx's 16,000. Here one task per client connection parses the
//! request in place ([`head`]), hands it to the same request pipeline as
//! every other request ([`crate::pipeline`]: guard, account, route, limit)
//! as a [`Request`], whose forward stage ([`forward`]) writes it to a pooled
//! upstream stream this task drives itself (`crate::upstream::pool`), and streams the
//! response back ([`response`]), all in reused buffers. The engine is
//! framing only: it sees the pipeline, not `Proxy`, through [`Connection`]
//! and [`Services`].
//!
//! Whatever is not that everyday exchange (a malformed or ambiguous head, a
//! chunked or large request body, `Expect`, `Upgrade`, CONNECT, HTTP/1.0, a
//! request for an HTTPS, h2c or passthrough origin, which the pipeline's
//! route stage answers with `Reply::Unserved`, gRPC) is handed to hyper
//! before anything of it has happened: the connection's unread bytes,
//! that request first, go to the general path, which serves the connection
//! from then on. `usher_proxy_http1_handoffs_total{reason}` counts why.
//! `USHER_HTTP1=hyper` turns the native path off.
//!
//! Behaviour matches the general path's: the same routing, admission,
//! metrics, access log, pushback, error responses, header and body limits,
//! header timeout (an idle keep-alive connection is closed after it),
//! `connection: close` while draining, and a client's EOF cancelling its
//! request while it waits for capacity or for the upstream, or while its
//! answer's body is idle (a stream of events between two events: the
//! upstream's connection is closed, or its h2 stream reset, and the
//! request's permits are freed at once, not when the next event comes).

mod fields;
mod head;
mod response;

use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::Poll;

use arc_swap::ArcSwap;
use bytes::{Buf, BytesMut};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tower::Service;

pub use head::why;

use crate::pipeline::{self, Exchange, Inbound, Pipeline, Reply};
use crate::route::ListenerId;
use crate::upstream::h2conn::H2Error;
use crate::upstream::pool::{Pool, Stream};
use crate::upstream::{Target, Upstream};
use head::Parsed;
use response::{Dechunker, FieldStarts, Framing, ResponseHead};
use usher_core::config::listener::ListenerLimits;
use usher_enforce::resource::RequestView;
use usher_enforce::respond::BoxError;
use usher_enforce::respond::{self, ProxyBody, ProxyError};

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
    /// Where the fields of the response head in `out` start, for a route
    /// that reads them.
    fields: FieldStarts,
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

/// What the native path needs of the server its connection belongs to.
pub trait Connection {
    fn limits(&self) -> &ListenerLimits;
    /// Whether answers must carry `connection: close`.
    fn is_draining(&self) -> bool;
    /// Cancelled when idle connections must close.
    fn closing(&self) -> &CancellationToken;
}

/// What the native path serves requests with: the current pipeline, the
/// counter of hand-offs to hyper by reason, and the listener the connection
/// arrived on (routing depends on it).
pub struct Services<'s> {
    pub pipeline: &'s ArcSwap<Pipeline>,
    pub handoffs: &'s prometheus::IntCounterVec,
    pub listener: ListenerId,
}

/// Serves a client connection whose first bytes (`buf`) are not HTTP/2,
/// until it closes or brings a request for the general path. The first
/// request head must be complete by `deadline`.
pub async fn serve<I>(
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
    let mut timers = Timers {
        head: Lazy::new(deadline),
        upstream: Lazy::new(deadline),
        closing: Box::pin(server.closing().clone().cancelled_owned()),
    };
    // While a request waits, a pipelined one may arrive: room for it, no more.
    let room = limits.max_header_bytes + head::MAX_BODY as usize;
    // The connection's stack, built from the snapshot in force; rebuilt only
    // when a reload has swapped the snapshot (the old one is held, so its
    // address cannot come back as another's).
    let mut snapshot = services.pipeline.load_full();
    let mut stack = snapshot.stack_on(services.listener, tower::service_fn(forward));
    loop {
        let (replied, framing) = {
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
                            if !head_complete {
                                return Err("no complete request head within the header timeout".into());
                            }
                            // A request whose body stalled is answered (408), as on the general path.
                            let e = ProxyError::BodyTimeout { after: limits.header_timeout };
                            let answer = respond::proxy_error(&e, false);
                            let write = write_generated(server, &mut io, answer, true, false, &mut bufs.out);
                            let _ = tokio::time::timeout(limits.header_timeout, write).await;
                            return Err(e.into());
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
                    let current = services.pipeline.load();
                    if !std::sync::Arc::ptr_eq(&current, &snapshot) {
                        snapshot = arc_swap::Guard::into_inner(current);
                        stack = snapshot.stack_on(services.listener, tower::service_fn(forward));
                    }
                    // A reload since the connection came may have lowered
                    // the body limit parsing checked: the general path
                    // refuses such a body (413), as it does any over it.
                    if snapshot.config.limits.max_body_bytes.is_some_and(|max| h.body_len as u64 > max) {
                        return Ok(hand_off(services, why::BODY, buf, io));
                    }
                    let framing = Taken {
                        consumed: h.head_len + h.body_len,
                        close: h.close,
                        head_request: h.method == Method::HEAD,
                    };
                    let body = &buf[h.head_len..framing.consumed];
                    let req = Request { head: h, body, bufs: &mut bufs, deadline: &mut timers.upstream };
                    (stack.call(Exchange::new(req)), framing)
                }
            }
        };
        let reply = {
            // Pinned here, and dropped before the buffers it borrowed are used again.
            let replied = std::pin::pin!(replied);
            match watching(&mut io, &mut buf, room + framing.consumed, replied).await {
                // The client left: dropping the exchange gave its admission back.
                None => break,
                Some(Ok(reply)) => reply,
            }
        };
        // Nothing of it has happened: hyper serves it from its first byte.
        if let Reply::Unserved(why) = reply {
            return Ok(hand_off(services, why, buf, io));
        }
        buf.advance(framing.consumed);
        let open = match reply {
            Reply::Unserved(_) => unreachable!("handed off above"),
            Reply::Made(resp) => {
                write_generated(server, &mut io, resp, framing.close, framing.head_request, &mut bufs.out).await?
            }
            Reply::Upstream { answer, held } => {
                let mut app = App { io: &mut io, buf: &mut buf, room };
                // The pipeline is done with the answer: the buffers it borrowed are free again.
                let sending = answer.sending;
                answered(server, &mut app, &mut bufs, sending, held, framing).await?
            }
        };
        if !open {
            break;
        }
        // Answered, and the connection stays open for the next request.
        timers.head.set(Instant::now() + limits.header_timeout);
        bufs.trim(&mut buf);
    }
    let _ = io.shutdown().await;
    Ok(Served::Closed)
}

/// Counts a hand-off and gives the connection to hyper.
fn hand_off<I>(services: &Services<'_>, why: &'static str, buf: BytesMut, io: I) -> Served<I> {
    services.handoffs.with_label_values(&[why]).inc();
    tracing::trace!(reason = why, "request handed to the general HTTP/1.1 path");
    Served::HandOff(buf, io)
}

/// What the connection keeps of a request while the pipeline serves it.
#[derive(Clone, Copy)]
struct Taken {
    /// Bytes of the client's buffer the request took.
    consumed: usize,
    /// The client asked to close after this exchange.
    close: bool,
    /// The request was HEAD: the answer has no body.
    head_request: bool,
}

/// A parsed request as the pipeline sees it.
struct Request<'a, 'c> {
    head: head::Head<'a>,
    body: &'a [u8],
    /// The connection's buffers: the request is encoded into them for its upstream.
    bufs: &'c mut Buffers,
    deadline: &'c mut Lazy,
}

impl RequestView for Request<'_, '_> {
    fn method(&self) -> &Method {
        self.head.method()
    }

    fn uri_host(&self) -> Option<&str> {
        None
    }

    fn path(&self) -> &str {
        self.head.path()
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.head.header(name)
    }
}

impl<'c> Inbound for Request<'_, 'c> {
    type Ready = Prepared<'c>;

    fn grpc(&self) -> bool {
        // gRPC is handed off while parsing.
        false
    }

    fn guard(&mut self, _max_body: Option<u64>) -> Result<(), ProxyError> {
        // Parsing handed off every request these checks could refuse (a
        // `Via` of ours, no Host or several, a body over the limit in force,
        // an Upgrade): see `serve`.
        Ok(())
    }

    fn ready(self, target: Target, keep_head: bool) -> Result<Prepared<'c>, &'static str> {
        let Target::Upstream(upstream) = target else { return Err(why::UPSTREAM) };
        let send = match upstream.plain.as_ref() {
            Some(plain) if plain.h1() => {
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                self.head.encode(&plain.prefix, host, self.body, &mut self.bufs.req);
                Send::Pool
            }
            _ if upstream.multiplexed().is_some() => {
                let head = self.head.request(&upstream.config.url).ok_or(why::UPSTREAM)?;
                Send::Shared(Box::new((head, bytes::Bytes::copy_from_slice(self.body))))
            }
            // An `https://` upstream whose ALPN answer is still to come: the
            // request is made ready for either, and the answer picks.
            Some(plain) if plain.unknown() && upstream.h2.is_some() => {
                let head = self.head.request(&upstream.config.url).ok_or(why::UPSTREAM)?;
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                self.head.encode(&plain.prefix, host, self.body, &mut self.bufs.req);
                Send::Probe(Box::new((head, bytes::Bytes::copy_from_slice(self.body))))
            }
            _ => return Err(why::UPSTREAM),
        };
        Ok(Prepared {
            send,
            keep_head,
            idempotent: self.head.idempotent(),
            head_request: self.head.method == Method::HEAD,
            upstream,
            bufs: self.bufs,
            deadline: self.deadline,
        })
    }
}

/// How a prepared request goes upstream.
enum Send {
    /// On a stream of the upstream's HTTP/1.1 pool, as encoded in the connection's `req` buffer.
    Pool,
    /// On the upstream's multiplexed h2 connection: the head and the body
    /// (boxed: the everyday HTTP/1.1 exchange's futures stay small).
    Shared(Box<(http::Request<()>, bytes::Bytes)>),
    /// To an upstream that may pick h2 or HTTP/1.1 in ALPN: on h2 as
    /// `Shared`, else on the pool (encoded as for `Pool` too), and it learns which.
    Probe(Box<(http::Request<()>, bytes::Bytes)>),
}

/// A request made ready for its upstream.
struct Prepared<'c> {
    send: Send,
    /// The route reads the answer's header fields: parsing marks them, and
    /// the answer lends the head they are in ([`Answer::fields`]).
    keep_head: bool,
    /// An upstream the native path forwards to (`ready` checked).
    upstream: std::sync::Arc<Upstream>,
    bufs: &'c mut Buffers,
    deadline: &'c mut Lazy,
    head_request: bool,
    idempotent: bool,
}

/// The upstream's answer: what the connection sends, and, for a route that
/// reads the answer's fields, the connection's buffers, lent until the
/// pipeline is done with the answer (the client's head is read where it
/// was written: no copy).
struct Answer<'c> {
    sending: Sending,
    /// `out` holds the client's version of the head, `fields` where its fields start.
    fields: Option<&'c Buffers>,
}

/// An answer as the connection sends it: its head (the client's version of
/// it is in the connection's `out` buffer) and where its body comes from.
struct Sending {
    body: Carried,
    head: ResponseHead,
    upstream: std::sync::Arc<Upstream>,
}

/// An answer's body.
enum Carried {
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
async fn forward(p: Prepared<'_>) -> Result<Answer<'_>, ProxyError> {
    let Prepared { send, keep_head, upstream, bufs, deadline, head_request, idempotent } = p;
    bufs.fields.reset(keep_head);
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

/// Sends `req` on the upstream's multiplexed h2 connection and puts the
/// client's version of the answer's head in `bufs.out`.
async fn shared(
    upstream: &Upstream,
    (req, body): (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), H2Error> {
    let h2 = upstream.h2.as_ref().expect("ready sends only h2 upstreams' requests here");
    let resp = h2.send(req, body, idempotent).await?;
    let (parts, body) = resp.into_parts();
    // The length is known from `content-length`, or from a stream that ended with its head.
    let exact = match body.is_end_stream() {
        true => Some(0),
        false => parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| fields::parse_length(v.as_bytes())),
    };
    bufs.out.clear();
    bufs.fields.clear();
    let head = response::from_parts(&parts, head_request, exact, &mut bufs.out, &mut bufs.fields);
    Ok((Carried::Shared(body), head))
}

/// Sends `req` on the upstream's multiplexed h2 connection; if a new
/// connection's ALPN answer says the upstream now picks `http/1.1` (it picked
/// h2 before), on its HTTP/1.1 pool instead, encoded for it here.
async fn shared_or_pool(
    upstream: &Upstream,
    req: (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    match shared(upstream, req, head_request, idempotent, bufs).await {
        Err(H2Error::Http1(stream, unsent)) if upstream.plain.is_some() => {
            let (req, body) = *unsent;
            bufs.req.clear();
            let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
            head::Head::encode_made(&req, host, &body, &mut bufs.req);
            on_pool(upstream, stream, head_request, idempotent, bufs).await
        }
        r => r.map_err(|e| h2_failed(upstream, e)),
    }
}

/// Sends a request to an `https://` upstream whose ALPN answer is not yet
/// known: on h2 if its new connection picks h2, else (the connection goes
/// to the upstream's HTTP/1.1 pool) on the pool, as encoded in `bufs.req`.
/// Either way the upstream has learned what it speaks.
async fn probe(
    upstream: &Upstream,
    req: (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    let plain = upstream.plain.as_ref().expect("ready probes only upstreams with a pool");
    match shared(upstream, req, head_request, idempotent, bufs).await {
        Err(H2Error::Http1(stream, _)) => on_pool(upstream, stream, head_request, idempotent, bufs).await,
        Ok(answer) => {
            plain.learn(http::Version::HTTP_2, upstream.name());
            Ok(answer)
        }
        Err(e) => Err(h2_failed(upstream, e)),
    }
}

/// Sends the request encoded in `bufs.req` on the HTTP/1.1 pool of an
/// upstream whose new connection (`stream`, which carries it) just picked
/// `http/1.1` in ALPN, and takes note that it speaks HTTP/1.1 (a request
/// that waited meanwhile has no connection: it dials on the pool itself).
async fn on_pool(
    upstream: &Upstream,
    stream: Option<Stream>,
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    let plain = upstream.plain.as_ref().expect("only an upstream with a pool picks http/1.1 in ALPN");
    plain.learn(http::Version::HTTP_11, upstream.name());
    if let Some(stream) = stream {
        plain.pool.put(stream);
    }
    let name = || upstream.name().to_string();
    roundtrip(&plain.pool, &name, head_request, idempotent, bufs)
        .await
        .map(|(stream, head)| (Carried::Stream(stream), head))
}

/// An exchange on an h2 upstream's connection that failed, as the app is told.
fn h2_failed(upstream: &Upstream, e: H2Error) -> ProxyError {
    let upstream = upstream.name().to_string();
    match e {
        H2Error::Connect(reason) => ProxyError::UpstreamConnect { upstream, reason },
        H2Error::Stream(reason) => ProxyError::Upstream { upstream, reason },
        // An h2c upstream has no ALPN: only an `https://` one (which has a pool) answers so.
        H2Error::Http1(..) => ProxyError::Upstream { upstream, reason: "the upstream picks http/1.1 in ALPN".into() },
    }
}

/// Sends the client an upstream's answer (head and body); returns whether
/// the connection stays open for another request.
async fn answered<I>(
    server: &impl Connection,
    app: &mut App<'_, I>,
    bufs: &mut Buffers,
    answer: Sending,
    held: pipeline::Held,
    taken: Taken,
) -> Result<bool, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let Sending { body, head, upstream } = answer;
    let close = taken.close || server.is_draining();
    if close {
        bufs.out.extend_from_slice(b"connection: close\r\n");
    }
    bufs.out.extend_from_slice(b"\r\n");
    let mut held = Some(held);
    let relayed = match body {
        Carried::Stream(stream) => {
            let pool = upstream.plain.as_ref().filter(|_| head.reusable).map(|p| &*p.pool);
            relay(&head, stream, &mut bufs.up, app, &mut bufs.out, &mut held, pool).await
        }
        Carried::Shared(body) => relay_frames(head.framing, body, app, &mut bufs.out, &mut held).await,
    };
    let open = match relayed {
        Ok(()) => !close,
        Err(BodyError::Upstream(e)) => {
            // The status is already sent: the client sees its body cut.
            if let Some(held) = &held {
                held.body_failed();
            }
            tracing::debug!(error = %e, "response body failed after the headers");
            false
        }
        Err(BodyError::Client(e)) => {
            tracing::debug!(error = %e, "client connection failed while sending the response");
            false
        }
    };
    // A body that failed holds until here; one that ended was released as its last bytes went out.
    drop(held);
    Ok(open)
}

/// Runs `fut` while reading whatever the client sends meanwhile into `buf`
/// (a pipelined request), up to `room` bytes. The client's EOF, or a read
/// error, cancels `fut` (returns `None`): a client that gives up frees its
/// place in the queue at once. `fut` is polled first, and the client read
/// only while `fut` waits: a `fut` that is ready at once costs no read.
async fn watching<I, F>(io: &mut I, buf: &mut BytesMut, room: usize, mut fut: Pin<&mut F>) -> Option<F::Output>
where
    I: AsyncRead + Unpin,
    F: Future,
{
    std::future::poll_fn(|cx| {
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            // Full: what else comes waits unread (the client's EOF too) until `fut` is done.
            if buf.len() >= room {
                return Poll::Pending;
            }
            buf.reserve(READ_CHUNK);
            match std::pin::pin!(io.read_buf(buf)).poll(cx) {
                Poll::Ready(Ok(0) | Err(_)) => return Poll::Ready(None),
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await
}

/// The client's connection while an answer's body goes out to it: written
/// to, and read (see [`watching`]) while the body is idle, so that a client
/// that leaves between two events of a stream ends the exchange then, not
/// when the next event comes.
struct App<'a, I> {
    io: &'a mut I,
    /// The client's buffer: what it sends meanwhile (a pipelined request) is kept there.
    buf: &'a mut BytesMut,
    room: usize,
}

impl<I: AsyncRead + Unpin> App<'_, I> {
    /// Waits for `body` (the body's next bytes), unless the client leaves first.
    async fn wait<F: Future>(&mut self, body: F) -> Result<F::Output, BodyError> {
        let body = std::pin::pin!(body);
        watching(self.io, self.buf, self.room, body).await.ok_or_else(|| {
            BodyError::Client(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the client closed its connection while the body was idle",
            ))
        })
    }
}

/// Sends `bufs.req` to the upstream and reads its final response head,
/// whose version for the client goes to `bufs.out`. A reused connection that fails
/// before any byte of an answer (the upstream closed it as it was being
/// reused) is retried once on a new one: always when the request could not
/// be written, and for idempotent requests when the answer never came.
async fn roundtrip(
    pool: &std::sync::Arc<crate::upstream::pool::Pool>,
    name: &(dyn Fn() -> String + Sync),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Stream, ResponseHead), ProxyError> {
    let Buffers { req, up, out, fields } = bufs;
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

enum BodyError {
    Upstream(String),
    Client(std::io::Error),
}

/// Sends the client the head in `out` and the body that follows `head` on
/// `stream` (its first bytes already in `up`). When the body ended cleanly
/// with nothing after it, the stream goes back to `pool` (if given: the
/// answer left the connection reusable) to carry another request.
///
/// `held` (the admission's gauge permits, the in-flight count) is released,
/// and the stream put back, once the body's last bytes are in hand, before
/// they are written: a client that has the whole answer may send its next
/// request on another connection at once, and must find the slot free and
/// the upstream connection in the pool (as hyper's body does, `h1pool`).
async fn relay<I>(
    head: &ResponseHead,
    mut stream: Stream,
    up: &mut BytesMut,
    app: &mut App<'_, I>,
    out: &mut Vec<u8>,
    held: &mut Option<pipeline::Held>,
    pool: Option<&Pool>,
) -> Result<(), BodyError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    // The body is all in hand: bytes after it are a broken upstream, whose connection is not reused.
    let home = |stream: Stream, clean: bool, held: &mut Option<pipeline::Held>| {
        release(held);
        if let (true, Some(pool)) = (clean, pool) {
            pool.put(stream);
        }
    };
    let cut = |what: &str| BodyError::Upstream(format!("the upstream closed the connection {what}"));
    match head.framing {
        Framing::Empty => {
            home(stream, up.is_empty(), held);
            send(app.io, out).await?
        }
        Framing::Length(n) => {
            let first = up.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            tee(held, &up[..first]);
            out.extend_from_slice(&up[..first]);
            up.advance(first);
            let mut left = n - first as u64;
            if left == 0 {
                home(stream, up.is_empty(), held);
                send(app.io, out).await?;
            } else {
                send(app.io, out).await?;
                loop {
                    up.clear();
                    up.reserve(READ_CHUNK);
                    match app.wait(stream.read_buf(up)).await? {
                        Ok(0) => return Err(cut(&format!("{left} bytes before the end of the body"))),
                        Ok(_) => {}
                        Err(e) => return Err(BodyError::Upstream(e.to_string())),
                    }
                    let take = up.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    tee(held, &up[..take]);
                    left -= take as u64;
                    if left == 0 {
                        home(stream, up.len() == take, held);
                        app.io.write_all(&up[..take]).await.map_err(BodyError::Client)?;
                        up.advance(take);
                        break;
                    }
                    app.io.write_all(&up[..take]).await.map_err(BodyError::Client)?;
                    up.advance(take);
                }
            }
        }
        Framing::Chunked => {
            let mut chunks = Dechunker::default();
            loop {
                let used = match chunks.feed(up, out, |data| tee(held, data)) {
                    Ok(used) => used,
                    Err(e) => {
                        // The head and what decoded before the fault still go
                        // out, so the client always sees the same cut answer,
                        // however the upstream's bytes were split into reads.
                        send(app.io, out).await?;
                        app.io.flush().await.map_err(BodyError::Client)?;
                        return Err(BodyError::Upstream(e.to_string()));
                    }
                };
                up.advance(used);
                if chunks.is_done() {
                    home(stream, up.is_empty(), held);
                    send(app.io, out).await?;
                    break;
                }
                send(app.io, out).await?;
                up.clear();
                up.reserve(READ_CHUNK);
                match app.wait(stream.read_buf(up)).await? {
                    Ok(0) => return Err(cut("in the middle of a chunked body")),
                    Ok(_) => {}
                    Err(e) => return Err(BodyError::Upstream(e.to_string())),
                }
            }
        }
        Framing::Close => loop {
            // What has come goes out before the next read: a body that
            // trickles (a stream of events) is not held back by the wait.
            tee(held, up);
            response::push_chunk(out, up);
            send(app.io, out).await?;
            up.clear();
            up.reserve(READ_CHUNK);
            let n = app.wait(stream.read_buf(up)).await?.map_err(|e| BodyError::Upstream(e.to_string()))?;
            if n == 0 {
                release(held);
                out.extend_from_slice(b"0\r\n\r\n");
                send(app.io, out).await?;
                app.io.flush().await.map_err(BodyError::Client)?;
                return Ok(());
            }
        },
    }
    app.io.flush().await.map_err(BodyError::Client)
}

/// Sends the client the head in `out` and the body of an answer from a
/// multiplexed upstream, as it comes (chunked unless its length is known;
/// trailers are dropped, as the client asked for none). `held` is released
/// once the last data is in hand, as in [`relay`].
async fn relay_frames<I>(
    framing: Framing,
    mut body: h2::RecvStream,
    app: &mut App<'_, I>,
    out: &mut Vec<u8>,
    held: &mut Option<pipeline::Held>,
) -> Result<(), BodyError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let chunked = framing == Framing::Chunked;
    if framing != Framing::Empty {
        while !body.is_end_stream() {
            match app.wait(body.data()).await? {
                None => break,
                Some(Ok(data)) => {
                    tee(held, &data);
                    if chunked {
                        response::push_chunk(out, &data);
                    } else {
                        out.extend_from_slice(&data);
                    }
                    if !body.is_end_stream() {
                        send(app.io, out).await?;
                    }
                    // Written: the upstream may send as much again (a slow app slows it down).
                    let _ = body.flow_control().release_capacity(data.len());
                }
                Some(Err(e)) => {
                    // What came before the fault still goes out, head first.
                    send(app.io, out).await?;
                    app.io.flush().await.map_err(BodyError::Client)?;
                    return Err(BodyError::Upstream(usher_core::error::error_chain(&e)));
                }
            }
        }
        if chunked {
            out.extend_from_slice(b"0\r\n\r\n");
        }
    }
    release(held);
    send(app.io, out).await?;
    app.io.flush().await.map_err(BodyError::Client)
}

/// Copies relayed body bytes for the costs they settle, if the route reads them.
#[inline]
fn tee(held: &mut Option<pipeline::Held>, data: &[u8]) {
    if let Some(h) = held {
        h.tee(data);
    }
}

/// The body's last bytes are in hand: its costs are settled, and what the
/// request holds is released.
#[inline]
fn release(held: &mut Option<pipeline::Held>) {
    if let Some(mut h) = held.take() {
        h.end();
    }
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

#[cfg(test)]
mod tests;
