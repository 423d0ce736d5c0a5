//! The general path (hyper) as the pipeline's engine: its requests as
//! [`Inbound`]s, its answers as [`Answer`]s, and its forward stage, which
//! sends a request to its [`Target`] (an upstream's own HTTP/1.1 pool, shared
//! with the native path, or
//! hyper-util's client for h2, h2c and passthrough origins, and for an
//! `https://` upstream until its first answer says it speaks HTTP/1.1) or opens a
//! CONNECT tunnel. Protocol upgrades (WebSocket) are joined here; the
//! exchange's admission moves into a [`Hold`] for as long as they last.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;

use crate::pipeline::guard::{self, VIA};
use crate::pipeline::{Answer, BodyAccess, Held, Hold, Inbound, ReadAhead};
use crate::route::{Resolved, Routing};
use crate::upstream::body::{self, BodyPlan, BodyTooLarge, ClientBody, Progress, RequestBody, Sending};
use crate::upstream::exchange::{self, PoolError};
use crate::upstream::{DIRECT_CONNECT_TIMEOUT, Target, UpstreamBody, client_error, strip_hop_by_hop, upstream_uri};
use usher_core::error::error_chain;
use usher_enforce::request_body::Body as RequestBodyRead;
use usher_enforce::respond::BoxError;
use usher_enforce::respond::{ProxyBody, ProxyError, is_grpc};
use usher_enforce::settle::MAX_READ_ON;

/// The general path's innermost stage: sends a request to its [`Target`],
/// or opens a CONNECT tunnel.
#[derive(Clone, Copy, Default)]
pub(crate) struct Forward;

impl tower::Service<Request<Incoming>> for Forward {
    type Response = Response<UpstreamBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<UpstreamBody>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        if req.method() == http::Method::CONNECT {
            return Box::pin(connect(req));
        }
        Box::pin(forward(req))
    }
}

/// A request from hyper, as the pipeline sees it.
impl Inbound for Request<Incoming> {
    type Ready = Request<Incoming>;

    fn grpc(&self) -> bool {
        self.method() != http::Method::CONNECT && is_grpc(self.headers())
    }

    fn guard(&mut self, max_body: Option<u64>) -> Result<(), ProxyError> {
        guard::check(self)?;
        guard::strip_h2c(self.headers_mut());
        if let Some(limit) = max_body {
            // A declared length over the limit is refused before anything is
            // forwarded; a body without one is cut off where it passes the limit.
            if hyper::body::Body::size_hint(self.body()).lower() > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            self.extensions_mut().insert(BodyPlan { limit: Some(limit), ahead: None });
        }
        Ok(())
    }

    fn resolve(&self, routing: &Routing) -> Result<Resolved, ProxyError> {
        routing.resolve(self)
    }

    fn ready(mut self, target: Target, _keep_head: bool) -> Result<Self, &'static str> {
        self.extensions_mut().insert(target);
        Ok(self)
    }
}

/// A route that reads the body reads it once the request is ready: its
/// first bytes ([`body::read_ahead`]) go upstream before the rest.
impl ReadAhead for Request<Incoming> {
    type Reading = Pin<Box<dyn Future<Output = Result<Self, ProxyError>> + Send>>;

    fn read_ahead(self, bound: usize, timeout: Duration) -> Self::Reading {
        Box::pin(body::read_ahead(self, bound, timeout))
    }
}

impl BodyAccess for Request<Incoming> {
    fn body(&self) -> RequestBodyRead<'_> {
        match self.extensions().get::<BodyPlan>().and_then(|p| p.ahead.as_deref()) {
            Some(ahead) if ahead.whole => RequestBodyRead::Whole(&ahead.data),
            _ => RequestBodyRead::TooLarge,
        }
    }

    fn replace_body(&mut self, body: Vec<u8>) {
        if self.headers().contains_key(header::CONTENT_LENGTH) {
            self.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        }
        if let Some(ahead) = self.extensions_mut().get_mut::<BodyPlan>().and_then(|p| p.ahead.as_deref_mut()) {
            ahead.data = Bytes::from(body);
        }
    }
}

impl Answer for Response<UpstreamBody> {
    fn status(&self) -> StatusCode {
        Response::status(self)
    }

    fn retry_after(&self) -> Option<Duration> {
        usher_enforce::pushback::retry_after(self.headers())
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().get(name).map(|v| v.as_bytes())
    }

    fn hold(&self) -> Option<Hold> {
        self.extensions().get::<Hold>().cloned()
    }
}

/// A CONNECT tunnel to the authority it names: opened once admitted, and
/// holding the admission (gauge permits) for as long as it is open.
async fn connect(req: Request<Incoming>) -> Result<Response<UpstreamBody>, ProxyError> {
    let Some(authority) = req.uri().authority().map(|a| a.to_string()) else {
        return Err(ProxyError::BadRequest("CONNECT needs host:port".into()));
    };
    let stream = match tokio::time::timeout(DIRECT_CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&authority)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(ProxyError::UpstreamConnect { upstream: authority, reason: e.to_string() }),
        Err(_) => return Err(ProxyError::UpstreamTimeout { upstream: authority, after: DIRECT_CONNECT_TIMEOUT }),
    };
    let hold = Hold::default();
    let mut resp = Response::new(UpstreamBody::Empty);
    resp.extensions_mut().insert(hold.clone());
    tokio::spawn(async move {
        let _hold = hold;
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => {
                let mut stream = stream;
                let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(upgraded), &mut stream).await;
            }
            Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
        }
    });
    Ok(resp)
}

fn wants_upgrade(req: &Request<Incoming>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")))
}

/// The URI of a request forwarded to the origin it names.
fn direct_uri(req: &Request<Incoming>) -> Result<Uri, ProxyError> {
    let uri = req.uri();
    if uri.scheme().is_some() && uri.authority().is_some() {
        return Ok(uri.clone());
    }
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .ok_or_else(|| ProxyError::BadRequest("no Host header and no absolute URI".into()))?;
    let pq = uri.path_and_query().map_or("/", |p| p.as_str());
    format!("http://{host}{pq}").parse().map_err(|e| ProxyError::BadRequest(format!("bad Host header: {e}")))
}

async fn forward(mut req: Request<Incoming>) -> Result<Response<UpstreamBody>, ProxyError> {
    let target = req.extensions_mut().remove::<Target>().ok_or_else(|| ProxyError::BadRequest("no target".into()))?;
    // An HTTP/1.1 upstream's requests go on its own pool (origin form, its Host).
    let pooled = match &target {
        Target::Upstream(u) => u.plain.as_ref().is_some_and(|p| p.h1()),
        Target::Direct(_) => false,
    };
    let (up, uri) = match &target {
        Target::Upstream(u) => (u.clone(), upstream_uri(&u.config.url, req.uri(), pooled)?),
        Target::Direct(u) => (u.clone(), direct_uri(&req)?),
    };
    // Named in errors only.
    let direct_authority = matches!(target, Target::Direct(_)).then(|| uri.authority().cloned()).flatten();
    let name = || match (&target, &direct_authority) {
        (Target::Upstream(u), _) => u.name().to_string(),
        (Target::Direct(_), a) => a.as_ref().map_or_else(String::new, |a| a.to_string()),
    };
    let upgrade = wants_upgrade(&req);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    strip_hop_by_hop(req.headers_mut(), upgrade);
    if let Target::Upstream(u) = &target {
        match u.host.as_ref().filter(|_| pooled) {
            // HTTP/1.1 on the pool: the upstream's Host, built once rather than by the client per request.
            Some(host) => req.headers_mut().insert(header::HOST, host.clone()),
            // The client sets Host (HTTP/1.1) or :authority (HTTP/2, ALPN) from the URI.
            None => req.headers_mut().remove(header::HOST),
        };
    }
    req.headers_mut().append(header::VIA, HeaderValue::from_static(VIA));
    *req.uri_mut() = uri;
    *req.version_mut() = if up.config.h2c { Version::HTTP_2 } else { Version::HTTP_11 };

    let (limit, ahead) = req.extensions_mut().get_mut::<BodyPlan>().map_or((None, None), |p| (p.limit, p.ahead.take()));
    let progress = (!req.body().is_end_stream()).then(Progress::new);
    let ahead = ahead.filter(|a| !a.is_empty());
    let req = req.map(|inner| RequestBody { inner, ahead, limit, seen: 0, progress: progress.clone() });
    let timeout = up.config.timeout;
    let late = |late: Late| match late {
        Late::Upstream => ProxyError::UpstreamTimeout { upstream: name(), after: timeout },
        // The route is named where the failure is accounted for (pipeline).
        Late::Client => ProxyError::ClientStalled { route: String::new(), after: timeout },
    };

    #[allow(
        clippy::disallowed_methods,
        reason = "the upstream's timeout is an I/O deadline on tokio's timer, and its latency is observed in tokio's time"
    )]
    let started = tokio::time::Instant::now();
    if let Some(plain) = up.plain.as_ref().filter(|_| pooled) {
        let sent = within(timeout, progress.as_deref(), exchange::send(&plain.pool, req, upgrade)).await;
        up.observe(started);
        let resp = match sent {
            Err(l) => return Err(late(l)),
            Ok(Err(PoolError::Connect(reason))) => {
                return Err(ProxyError::UpstreamConnect { upstream: name(), reason });
            }
            Ok(Err(PoolError::Http(e))) => return Err(failed(&e, name(), error_chain(&e))),
            Ok(Ok(r)) => r,
        };
        return Ok(finish(resp.map(UpstreamBody::Own), client_upgrade));
    }
    let client = up.client.as_ref().expect("an upstream without a pool of its own has a client");
    let sent = within(timeout, progress.as_deref(), client.request(req)).await;
    up.observe(started);
    let resp = match sent {
        Err(l) => return Err(late(l)),
        Ok(Err(e)) if e.is_connect() => {
            return Err(ProxyError::UpstreamConnect { upstream: name(), reason: client_error(&e) });
        }
        Ok(Err(e)) => return Err(failed(&e, name(), client_error(&e))),
        Ok(Ok(r)) => r,
    };
    if let Some(plain) = &up.plain {
        plain.learn(resp.version(), up.name());
    }
    Ok(finish(resp.map(UpstreamBody::Shared), client_upgrade))
}

/// Who kept the response headers from coming within the upstream's `timeout`.
enum Late {
    Upstream,
    /// The client stopped sending its request body.
    Client,
}

/// Awaits the upstream's response headers: within `timeout` of the request
/// body's end (the upstream cannot be expected to answer before it has it
/// all), and while the body streams, within `timeout` of the client's last
/// bytes. A body the upstream stopped taking counts against the upstream.
#[allow(
    clippy::disallowed_methods,
    reason = "the response deadline is an I/O deadline on tokio's timer, which keeps tokio's time"
)]
async fn within<F: Future>(timeout: Duration, progress: Option<&Progress>, sent: F) -> Result<F::Output, Late> {
    tokio::pin!(sent);
    let mut deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(out) = tokio::time::timeout_at(deadline, sent.as_mut()).await {
            return Ok(out);
        }
        let Some(p) = progress else { return Err(Late::Upstream) };
        let (state, since) = p.read();
        if since + timeout > tokio::time::Instant::now() {
            deadline = since + timeout;
            continue;
        }
        return Err(match state {
            Sending::AwaitingClient => Late::Client,
            Sending::Streaming | Sending::Done => Late::Upstream,
        });
    }
}

/// An exchange that failed after connecting: the client's body (too large,
/// unreadable) or the upstream's fault.
fn failed(e: &(dyn std::error::Error + 'static), upstream: String, reason: String) -> ProxyError {
    if let Some(limit) = too_large(e) {
        return ProxyError::BodyTooLarge { limit };
    }
    if let Some(c) = source_of::<ClientBody>(e) {
        return ProxyError::BadRequest(error_chain(c));
    }
    ProxyError::Upstream { upstream, reason }
}

/// Joins an upgraded exchange's two sides, and strips the response's hop-by-hop fields.
fn finish(
    mut resp: Response<UpstreamBody>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Response<UpstreamBody> {
    // An intermediary answers in its own version (RFC 9110 §2.5), as the
    // native path does: hyper then frames a close-delimited HTTP/1.0 body
    // with chunks for an HTTP/1.1 client (and answers an HTTP/1.0 client in 1.0).
    if resp.version() == Version::HTTP_10 {
        *resp.version_mut() = Version::HTTP_11;
    }
    let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(client_side)) = (switching, client_upgrade) {
        let upstream_side = hyper::upgrade::on(&mut resp);
        // The admission (gauge permits) lasts as long as the upgraded connection.
        let hold = Hold::default();
        resp.extensions_mut().insert(hold.clone());
        tokio::spawn(async move {
            let _hold = hold;
            match tokio::try_join!(client_side, upstream_side) {
                Ok((a, b)) => {
                    let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade failed"),
            }
        });
    }
    strip_hop_by_hop(resp.headers_mut(), switching);
    resp
}

/// The body limit, if `e` was caused by a request body passing it.
fn too_large(e: &(dyn std::error::Error + 'static)) -> Option<u64> {
    source_of::<BodyTooLarge>(e).map(|t| t.limit)
}

/// The first error of type `T` in `e`'s chain.
fn source_of<'a, T: std::error::Error + 'static>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a T> {
    let mut src: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if let Some(t) = inner.downcast_ref::<T>() {
            return Some(t);
        }
        src = inner.source();
    }
    None
}

/// The answer hyper sends for an upstream's: its body holds what the request
/// holds until its last bytes are handed out. An edited body (usage taken
/// out) loses its length: hyper frames it in chunks, or h2 data frames.
pub(crate) fn respond(mut answer: Response<UpstreamBody>, mut held: Held) -> Response<ProxyBody> {
    // (An answer without a body, to HEAD, keeps the length it states.)
    let edits = held.edits() && !answer.body().is_end_stream();
    if edits {
        answer.headers_mut().remove(header::CONTENT_LENGTH);
    }
    answer.map(|b| {
        // hyper may never poll a body that is over before it starts (a HEAD, a 204).
        if b.is_end_stream() {
            held.end();
        }
        Tracked { inner: b, held, ended: false, edits }.boxed_unsync()
    })
}

pin_project! {
    /// An upstream's response body on the general path: holds what its
    /// request holds (gauge permits, in flight) until it ends, and counts a
    /// failure after the head was sent. A stream of events read for a cost
    /// is read on, in a task of its own, if the app leaves before its end.
    struct Tracked {
        #[pin]
        inner: UpstreamBody,
        held: Held,
        // The body ended early (gRPC trailers made of an error): the inner body is done with.
        ended: bool,
        // The app gets the body as `Held::edit` makes it.
        edits: bool,
    }

    impl PinnedDrop for Tracked {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if this.held.reads_stream() {
                // The app left mid-stream (hyper drops the body it cannot send).
                let body = std::mem::replace(this.inner.get_mut(), UpstreamBody::Empty);
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(read_on(body, std::mem::take(this.held)));
                }
            }
        }
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.edits {
            return self.poll_edited(cx);
        }
        let mut this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        match &frame {
            // The status is already sent: a gRPC client gets trailers with a
            // status, any other sees its body cut; counted either way.
            Some(Err(e)) => {
                if let Some(trailers) = Tracked::failed(this.held, e) {
                    *this.ended = true;
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
            }
            None => {
                this.held.end();
                *this.held = Held::default();
            }
            // The last data: what the request holds is free before hyper
            // writes it, so a client that has the whole answer finds it free.
            Some(Ok(f)) => {
                if let Some(data) = f.data_ref() {
                    this.held.tee(data);
                }
                if this.inner.is_end_stream() {
                    this.held.end();
                    *this.held = Held::default();
                }
            }
        }
        Poll::Ready(frame.map(|f| f.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.edits {
            true => SizeHint::default(),
            false => self.inner.size_hint(),
        }
    }
}

impl Tracked {
    /// Polls an edited body: each piece of data as [`Held::edit`] makes
    /// it, none while it holds an event back; what it still holds goes out
    /// at the end.
    fn poll_edited(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        loop {
            if *this.ended {
                return Poll::Ready(None);
            }
            let mut edited = Vec::new();
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Err(e)) => {
                    let trailers = Tracked::failed(this.held, &e);
                    *this.ended = trailers.is_some();
                    return Poll::Ready(Some(trailers.map(Frame::trailers).ok_or_else(|| Box::new(e) as BoxError)));
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => this.held.edit(&data, &mut edited),
                    // Trailers, after the last data: nothing is held back then.
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                None => *this.ended = true,
            }
            if *this.ended || this.inner.is_end_stream() {
                this.held.flush(&mut edited);
                this.held.end();
                *this.held = Held::default();
                *this.ended = true;
            }
            if !edited.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(edited)))));
            }
        }
    }

    /// The body failed after its head was sent: counted, and for gRPC the trailers it ends with.
    fn failed(held: &mut Held, e: &hyper::Error) -> Option<http::HeaderMap> {
        tracing::debug!(error = %e, "response body failed after the headers");
        held.body_error(e)
    }
}

/// Reads on a stream of events whose app left, for its cost: to its end,
/// within the route's upstream `timeout` and [`MAX_READ_ON`] bytes. Its
/// cost is settled if it ends so; else the admission's charge stands.
/// Either way it counts as `client_gone`.
async fn read_on(mut body: UpstreamBody, mut held: Held) {
    held.left();
    let within = held.read_on_for();
    let read = async {
        let mut left = MAX_READ_ON;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Some(data) = frame.data_ref() {
                let Some(l) = left.checked_sub(data.len() as u64) else { return false };
                left = l;
                held.tee(data);
            }
        }
        true
    };
    // (A sleep, not a timeout: the connection loop's clock reads stay inlined, callgrind.)
    let ended = tokio::select! {
        ended = read => ended,
        () = tokio::time::sleep(within) => false,
    };
    if ended {
        held.end();
    }
}
