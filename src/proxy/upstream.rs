//! Upstream clients and the forwarding service of the general (hyper) path:
//! per upstream, a pool of its own for plain HTTP/1.1 (`super::h1pool`; the
//! native path keeps bare streams, `super::h1::Pool`; both on `super::idle`)
//! or hyper-util's pooled client
//! (HTTP/2 or HTTP/1.1 by ALPN over rustls, h2c, passthrough origins);
//! hop-by-hop header removal (RFC 9110 §7.6.1), protocol upgrades, connect
//! and response-header timeouts. Bodies stream both ways.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::guard;
use super::h1pool::{H1Pool, PoolError, PooledBody};
use super::metrics::Metrics;
use super::pipeline::{Answer, Hold, Inbound};
use super::pool::Pool;
use super::respond::{ProxyError, is_grpc};
use super::route::{Resolved, Routing};
use crate::config::routes::UpstreamConfig;
use crate::limit::layer::BoxError;

/// Idle pooled connections are closed after this long.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Connect timeout for origins reached without an upstream (passthrough, CONNECT).
pub const DIRECT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Response-header timeout for origins reached without an upstream.
pub const DIRECT_TIMEOUT: Duration = Duration::from_secs(60);

/// Marks requests usher forwarded, so a route pointing back at usher is caught.
pub const VIA: &str = "1.1 usher";

type HttpsClient = Client<HttpsConnector<HttpConnector>, RequestBody>;

/// `limits.max_body_bytes`, set in a request's extensions when configured.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub u64);

/// The request body as forwarded: the client's, cut off with an error once
/// it passes the body limit.
pub struct RequestBody {
    inner: Incoming,
    limit: Option<u64>,
    seen: u64,
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

/// One upstream: its configuration and its connection pool.
pub struct Upstream {
    pub config: UpstreamConfig,
    client: HttpsClient,
    /// `usher_proxy_upstream_seconds` for this upstream.
    seconds: prometheus::Histogram,
    /// The Host field of a plain-HTTP/1.1 upstream: its host, and its port unless 80.
    pub(super) host: Option<HeaderValue>,
    /// A plain-HTTP/1.1 upstream's own pool, used instead of `client`.
    pool: Option<Arc<H1Pool>>,
    /// A plain-HTTP/1.1 upstream's connections for the native path.
    pub(super) native: Option<Native>,
}

/// The upstream side of a plain-HTTP/1.1 upstream on the native path.
pub struct Native {
    pub pool: Arc<Pool>,
    /// The upstream URL's path without its trailing `/`, put before every request's path.
    pub prefix: String,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").field("config", &self.config).finish()
    }
}

/// The system's trust roots, loaded once.
pub fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::debug!(error = %e, "skipping a system certificate");
    }
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    tracing::debug!(added, ignored, "system trust roots loaded");
    roots
}

impl Upstream {
    /// Builds the client for `config`; `roots` are the system's, extended by `ca_file`.
    pub fn new(config: UpstreamConfig, roots: &RootCertStore, metrics: &Metrics) -> Result<Self, String> {
        let mut roots = roots.clone();
        if let Some(ca) = &config.ca_file {
            let certs = CertificateDer::pem_file_iter(ca)
                .map_err(|e| format!("cannot read ca_file {}: {e}", ca.display()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("bad PEM in ca_file {}: {e}", ca.display()))?;
            if certs.is_empty() {
                return Err(format!("ca_file {} holds no certificates", ca.display()));
            }
            for c in certs {
                roots.add(c).map_err(|e| format!("bad certificate in ca_file {}: {e}", ca.display()))?;
            }
        }
        let client = client(roots, config.connect_timeout, config.h2c)?;
        let host = (config.url.scheme() == Some(&http::uri::Scheme::HTTP) && !config.h2c)
            .then(|| {
                let host = config.url.host()?;
                let value = match config.url.port_u16() {
                    Some(port) if port != 80 => format!("{host}:{port}"),
                    _ => host.to_string(),
                };
                HeaderValue::from_str(&value).ok()
            })
            .flatten();
        let addr = match (&host, config.url.host()) {
            (Some(_), Some(h)) => Some(format!("{h}:{}", config.url.port_u16().unwrap_or(80))),
            _ => None,
        };
        let pool = addr.clone().map(|a| H1Pool::new(a, config.connect_timeout, POOL_IDLE_TIMEOUT));
        let native = addr.map(|a| Native {
            pool: Pool::new(a, config.connect_timeout, POOL_IDLE_TIMEOUT),
            prefix: config.url.path().trim_end_matches('/').to_string(),
        });
        let seconds = metrics.upstream_seconds.with_label_values(&[&config.name]);
        Ok(Upstream { config, client, seconds, host, pool, native })
    }

    /// A client for origins named by the request itself (passthrough).
    pub fn direct(roots: &RootCertStore, metrics: &Metrics) -> Result<Self, String> {
        let config = UpstreamConfig {
            name: "direct".into(),
            url: Uri::from_static("http://direct.invalid"),
            connect_timeout: DIRECT_CONNECT_TIMEOUT,
            timeout: DIRECT_TIMEOUT,
            ca_file: None,
            h2c: false,
        };
        let client = client(roots.clone(), config.connect_timeout, false)?;
        let seconds = metrics.upstream_seconds.with_label_values(&[&config.name]);
        Ok(Upstream { config, client, seconds, host: None, pool: None, native: None })
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Records how long the upstream took to send its response head.
    pub fn observe(&self, started: tokio::time::Instant) {
        self.seconds.observe(started.elapsed().as_secs_f64());
    }
}

fn client(roots: RootCertStore, connect_timeout: Duration, h2c: bool) -> Result<HttpsClient, String> {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .http2_only(h2c)
        .build(https))
}

/// Where a request goes; set by routing in the request's extensions.
#[derive(Debug, Clone)]
pub enum Target {
    /// A configured upstream: its URL replaces the request's scheme and authority.
    Upstream(Arc<Upstream>),
    /// The origin the request names (absolute-form URI, or Host header).
    Direct(Arc<Upstream>),
}

/// The general path's innermost stage: sends a request to its [`Target`],
/// or opens a CONNECT tunnel.
#[derive(Clone, Copy, Default)]
pub struct Forward;

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
            self.extensions_mut().insert(BodyLimit(limit));
        }
        Ok(())
    }

    fn resolve(&self, routing: &Routing) -> Result<Resolved, ProxyError> {
        routing.resolve(self)
    }

    fn ready(mut self, target: Target) -> Result<Self, &'static str> {
        self.extensions_mut().insert(target);
        Ok(self)
    }
}

impl Answer for Response<UpstreamBody> {
    fn status(&self) -> StatusCode {
        Response::status(self)
    }

    fn retry_after(&self) -> Option<Duration> {
        super::pushback::retry_after(self.headers())
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

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Field names that never cross a proxy (RFC 9110 §7.6.1), whatever the
/// Connection field says (TE only when it is not `trailers`, which
/// [`strip_hop_by_hop`] checks). Case-insensitive: the native HTTP/1.1 path
/// asks with names as the app wrote them.
pub(super) fn hop_by_hop(name: &str) -> bool {
    const NAMES: [&str; 10] = [
        "connection",
        "http2-settings",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    NAMES.iter().any(|n| name.eq_ignore_ascii_case(n))
}

fn always_hop_by_hop(name: &HeaderName) -> bool {
    hop_by_hop(name.as_str())
}

/// Hop-by-hop fields (RFC 9110 §7.6.1) plus those the Connection field names.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // Most messages have none: one pass over the names, no lookups.
    if !headers.keys().any(always_hop_by_hop) {
        if keep_upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        if !(keep_upgrade && n == header::UPGRADE) {
            headers.remove(n);
        }
    }
    for n in [
        KEEP_ALIVE,
        PROXY_CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TRAILER,
        header::TRANSFER_ENCODING,
    ] {
        headers.remove(n);
    }
    // `TE: trailers` is what gRPC needs end to end; any other TE is hop-by-hop.
    if headers.get(header::TE).is_some_and(|v| v != "trailers") {
        headers.remove(header::TE);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::CONNECTION);
        headers.remove(header::UPGRADE);
    }
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

/// The URI to send: the upstream's scheme, authority and base path, then the request's path and query.
/// `origin_form`: the path and query only, for a connection of the upstream's own.
fn upstream_uri(base: &Uri, req: &Uri, origin_form: bool) -> Result<Uri, ProxyError> {
    let bad = |e: &dyn std::fmt::Display| ProxyError::BadRequest(format!("cannot build upstream URI: {e}"));
    let prefix = base.path().trim_end_matches('/');
    let mut parts = http::uri::Parts::default();
    // Cloning the parts shares their bytes; only a base path means building a new path.
    if !origin_form {
        parts.scheme = Some(base.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP));
        parts.authority = base.authority().cloned();
    }
    parts.path_and_query = Some(match (prefix, req.path_and_query()) {
        ("", Some(pq)) => pq.clone(),
        ("", None) => http::uri::PathAndQuery::from_static("/"),
        (prefix, pq) => {
            let pq = pq.map_or("/", |p| p.as_str());
            http::uri::PathAndQuery::try_from(format!("{prefix}{pq}")).map_err(|e| bad(&e))?
        }
    });
    Uri::from_parts(parts).map_err(|e| bad(&e))
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
    let (up, uri) = match &target {
        Target::Upstream(u) => (u.clone(), upstream_uri(&u.config.url, req.uri(), u.pool.is_some())?),
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
        match &u.host {
            // Plain HTTP/1.1: the upstream's Host, built once rather than by the client per request.
            Some(host) => req.headers_mut().insert(header::HOST, host.clone()),
            // The client sets Host (HTTP/1.1) or :authority (HTTP/2, ALPN) from the URI.
            None => req.headers_mut().remove(header::HOST),
        };
    }
    req.headers_mut().append(header::VIA, HeaderValue::from_static(VIA));
    *req.uri_mut() = uri;
    *req.version_mut() = if up.config.h2c { Version::HTTP_2 } else { Version::HTTP_11 };

    let limit = req.extensions().get::<BodyLimit>().map(|l| l.0);
    let req = req.map(|inner| RequestBody { inner, limit, seen: 0 });

    let started = tokio::time::Instant::now();
    if let Some(pool) = &up.pool {
        let sent = tokio::time::timeout(up.config.timeout, pool.send(req)).await;
        up.observe(started);
        let resp = match sent {
            Err(_) => return Err(ProxyError::UpstreamTimeout { upstream: name(), after: up.config.timeout }),
            Ok(Err(PoolError::Connect(reason))) => {
                return Err(ProxyError::UpstreamConnect { upstream: name(), reason });
            }
            Ok(Err(PoolError::Http(e))) => return Err(failed(&e, name(), error_chain(&e))),
            Ok(Ok(r)) => r,
        };
        return Ok(finish(resp.map(UpstreamBody::Own), client_upgrade));
    }
    let sent = tokio::time::timeout(up.config.timeout, up.client.request(req)).await;
    up.observe(started);
    let resp = match sent {
        Err(_) => return Err(ProxyError::UpstreamTimeout { upstream: name(), after: up.config.timeout }),
        Ok(Err(e)) if e.is_connect() => {
            return Err(ProxyError::UpstreamConnect { upstream: name(), reason: reason(&e) });
        }
        Ok(Err(e)) => return Err(failed(&e, name(), reason(&e))),
        Ok(Ok(r)) => r,
    };
    Ok(finish(resp.map(UpstreamBody::Shared), client_upgrade))
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

/// A response body from either kind of client.
pub enum UpstreamBody {
    /// From a plain-HTTP/1.1 upstream's own pool.
    Own(PooledBody),
    /// From hyper-util's pool (HTTPS, h2c, passthrough).
    Shared(Incoming),
    /// None (the answer to CONNECT).
    Empty,
}

impl hyper::body::Body for UpstreamBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        match self.get_mut() {
            UpstreamBody::Own(b) => Pin::new(b).poll_frame(cx),
            UpstreamBody::Shared(b) => Pin::new(b).poll_frame(cx),
            UpstreamBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Own(b) => b.is_end_stream(),
            UpstreamBody::Shared(b) => b.is_end_stream(),
            UpstreamBody::Empty => true,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            UpstreamBody::Own(b) => b.size_hint(),
            UpstreamBody::Shared(b) => b.size_hint(),
            UpstreamBody::Empty => hyper::body::SizeHint::with_exact(0),
        }
    }
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

/// Why a request to an upstream failed, for the app and the operator: the
/// causes under hyper-util's own `client error (Connect)` wrapper, which only
/// names the stage, and what to do about an untrusted certificate.
fn reason(e: &hyper_util::client::legacy::Error) -> String {
    let mut s = match std::error::Error::source(e) {
        Some(cause) => error_chain(cause),
        None => error_chain(e),
    };
    if s.contains("invalid peer certificate") {
        s.push_str(
            " (the upstream's certificate is not trusted: name the CA that signed it in the upstream's ca_file)",
        );
    }
    s
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_names_match_whatever_their_case() {
        for name in ["Connection", "KEEP-ALIVE", "proxy-connection", "Proxy-Authenticate", "TE", "Trailer", "Upgrade"] {
            assert!(hop_by_hop(name), "{name}");
        }
        for name in ["Host", "Content-Length", "Trailers", "X-Connection"] {
            assert!(!hop_by_hop(name), "{name}");
        }
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
        names.sort();
        assert_eq!(names, ["te", "x-kept"]);
    }

    #[test]
    fn upstream_uri_keeps_the_base_path() {
        let base: Uri = "https://api.example.com/v2/".parse().unwrap();
        let req: Uri = "/repos/x?page=2".parse().unwrap();
        assert_eq!(upstream_uri(&base, &req, false).unwrap(), "https://api.example.com/v2/repos/x?page=2");
        // An upstream with a connection pool of its own gets the origin form.
        assert_eq!(upstream_uri(&base, &req, true).unwrap(), "/v2/repos/x?page=2");
        assert_eq!(upstream_uri(&"http://127.0.0.1:9".parse().unwrap(), &req, true).unwrap(), "/repos/x?page=2");
        let abs: Uri = "http://other/a".parse().unwrap();
        assert_eq!(upstream_uri(&"http://127.0.0.1:9".parse().unwrap(), &abs, false).unwrap(), "http://127.0.0.1:9/a");
    }
}
