//! Upstreams: their clients and pools, where a request goes ([`Target`]),
//! the request URI and hop-by-hop rules. The general path's forwarding
//! service is `crate::engine::hyper`. Per upstream: one pool of streams (TCP, or
//! TLS to an `https://` upstream that speaks HTTP/1.1) for HTTP/1.1
//! (`crate::upstream::pool`), shared by both engines (the native path's exchange in
//! `crate::engine::native`, the general path's in `crate::upstream::exchange`), or hyper-util's
//! pooled client (h2 by ALPN over rustls, h2c, passthrough origins, and an
//! `https://` upstream until its first answer says what it speaks);
//! hop-by-hop header removal (RFC 9110 §7.6.1), protocol upgrades, connect
//! and response-header timeouts. Bodies stream both ways.

pub(crate) mod body;
pub(crate) mod exchange;
pub(crate) mod h2conn;
pub(crate) mod pool;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use crate::upstream::body::RequestBody;
use crate::upstream::exchange::PooledBody;
use crate::upstream::h2conn::H2Upstream;
use crate::upstream::pool::{Pool, Tls};
use usher_core::config::routes::UpstreamConfig;
use usher_core::error::error_chain;
use usher_enforce::metrics::Metrics;
use usher_enforce::respond::ProxyError;

/// Idle pooled connections are closed after this long.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Connect timeout for origins reached without an upstream (passthrough, CONNECT).
pub const DIRECT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Response-header timeout for origins reached without an upstream.
pub const DIRECT_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) type HttpsClient = Client<HttpsConnector<HttpConnector>, RequestBody>;

/// One upstream: its configuration and its connection pool.
pub struct Upstream {
    /// The upstream as the routes file configures it.
    pub config: UpstreamConfig,
    /// hyper-util's client, for what the upstream's own pool does not serve
    /// (h2c, passthrough origins, an `https://` upstream that may pick h2); none
    /// for an upstream known to speak HTTP/1.1.
    pub(crate) client: Option<HttpsClient>,
    /// `usher_proxy_upstream_seconds` for this upstream.
    seconds: prometheus::Histogram,
    /// The Host field of a pooled upstream: its host, and its port unless the scheme's default.
    pub(crate) host: Option<HeaderValue>,
    /// An HTTP/1.1 upstream's own pool (plain or TLS), used by both engines instead of `client`.
    pub(crate) plain: Option<Plain>,
    /// The native path's multiplexed connection to an upstream that speaks
    /// h2 (h2c, or an `https://` one that picked h2 in ALPN).
    pub(crate) h2: Option<H2Upstream>,
}

/// An HTTP/1.1 upstream's connections (plain, or TLS to an `https://` one),
/// whichever engine serves the app.
pub struct Plain {
    /// The upstream's idle connections, shared by both engines.
    pub pool: Arc<Pool>,
    /// The upstream URL's path without its trailing `/`, put before every request's path.
    pub prefix: String,
    /// What the upstream speaks: HTTP/1.1 (`http://`, or `https://` with
    /// `http2: false`, or learned); unknown for an `https://` upstream that
    /// may pick h2 in ALPN, until its first answer (or its first new
    /// connection's ALPN answer) tells; h2 once it picked h2 (the pool is
    /// then unused, unless a later connection's ALPN answer is `http/1.1`).
    speaks: AtomicU8,
}

const H1: u8 = 0;
const UNKNOWN: u8 = 1;
const H2: u8 = 2;

impl Plain {
    /// Whether requests go on this pool.
    pub fn h1(&self) -> bool {
        self.speaks.load(Ordering::Relaxed) == H1
    }

    /// Whether what the upstream speaks is still to be learned (from its ALPN answer).
    pub fn unknown(&self) -> bool {
        self.speaks.load(Ordering::Relaxed) == UNKNOWN
    }

    /// Takes note of what the upstream speaks, from the version of an answer
    /// (through hyper-util's client) or its ALPN answer on a new connection:
    /// HTTP/1.1 moves the upstream's requests to the pool (with the native
    /// path's speed), h2 keeps them on its multiplexed connection. An
    /// upstream that picked h2 and now picks `http/1.1` (a new server or load
    /// balancer behind the same name) is followed to the pool; one known to
    /// speak HTTP/1.1 stays on it (the pool offers nothing else).
    pub fn learn(&self, version: http::Version, upstream: &str) {
        let speaks = if version == http::Version::HTTP_2 { H2 } else { H1 };
        let before = self.speaks.load(Ordering::Relaxed);
        if before == speaks || before == H1 {
            return;
        }
        if self.speaks.compare_exchange(before, speaks, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            match (before, speaks) {
                (H2, _) => tracing::warn!(
                    upstream,
                    "the upstream picked h2 in ALPN before and picks http/1.1 now: its requests use usher's \
                     HTTP/1.1 connection pool from now on"
                ),
                (_, H1) => tracing::info!(
                    upstream,
                    "the upstream speaks HTTP/1.1 over TLS: its requests use usher's own connection pool from now on"
                ),
                _ => tracing::info!(
                    upstream,
                    "the upstream picked h2 in ALPN: its requests share multiplexed connections"
                ),
            }
        }
    }
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
            let pem = usher_core::config::file::read_capped(ca, usher_core::config::file::MAX_FILE_BYTES)
                .map_err(|e| format!("cannot read ca_file {}: {e}", ca.display()))?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("bad PEM in ca_file {}: {e}", ca.display()))?;
            if certs.is_empty() {
                return Err(format!("ca_file {} holds no certificates", ca.display()));
            }
            for c in certs {
                roots.add(c).map_err(|e| format!("bad certificate in ca_file {}: {e}", ca.display()))?;
            }
        }
        let https = config.url.scheme() == Some(&http::uri::Scheme::HTTPS);
        let default_port = if https { 443 } else { 80 };
        let host = (!config.h2c)
            .then(|| {
                let host = config.url.host()?;
                let value = match config.url.port_u16() {
                    Some(port) if port != default_port => format!("{host}:{port}"),
                    _ => host.to_string(),
                };
                HeaderValue::from_str(&value).ok()
            })
            .flatten();
        let addr = |h: &str| format!("{h}:{}", config.url.port_u16().unwrap_or(default_port));
        let tls = |h: &str, alpn: &[&[u8]]| -> Result<Option<Tls>, String> {
            if !https {
                return Ok(None);
            }
            let name = ServerName::try_from(h.trim_start_matches('[').trim_end_matches(']').to_string())
                .map_err(|e| format!("`{h}` is not a name a TLS certificate can carry: {e}"))?;
            let tls = tls_config(roots.clone(), alpn.iter().map(|p| p.to_vec()).collect())?;
            Ok(Some(Tls { connector: tokio_rustls::TlsConnector::from(Arc::new(tls)), name }))
        };
        let h2 = match config.url.host() {
            Some(h) if config.h2c || (https && config.http2) => Some(H2Upstream::new(
                addr(h),
                tls(h, &[b"h2", b"http/1.1"])?,
                config.connect_timeout,
                POOL_IDLE_TIMEOUT,
            )),
            _ => None,
        };
        let plain = match (&host, config.url.host()) {
            (Some(_), Some(h)) => {
                let (addr, tls) = (addr(h), tls(h, &[b"http/1.1"])?);
                Some(Plain {
                    pool: Pool::new(addr, tls, config.connect_timeout, POOL_IDLE_TIMEOUT),
                    prefix: config.url.path().trim_end_matches('/').to_string(),
                    speaks: AtomicU8::new(if https && config.http2 { UNKNOWN } else { H1 }),
                })
            }
            _ => None,
        };
        // hyper-util's client for what the pool does not serve: h2c, and an
        // `https://` upstream that may pick h2, until it is known to speak HTTP/1.1.
        let client = match &plain {
            Some(p) if p.h1() => None,
            _ => Some(client(roots, &config)?),
        };
        let seconds = metrics.upstream_seconds.with_label_values(&[&config.name]);
        Ok(Upstream { config, client, seconds, host, plain, h2 })
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
            http2: true,
            listen: None,
        };
        let client = Some(client(roots.clone(), &config)?);
        let seconds = metrics.upstream_seconds.with_label_values(&[&config.name]);
        Ok(Upstream { config, client, seconds, host: None, plain: None, h2: None })
    }

    /// The upstream's name in the routes file.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The native path's multiplexed connection, for an upstream known to
    /// speak h2: h2c, or an `https://` upstream that picked h2 in ALPN.
    pub(crate) fn multiplexed(&self) -> Option<&H2Upstream> {
        let h2 = self.config.h2c || self.plain.as_ref().is_some_and(|p| p.speaks.load(Ordering::Relaxed) == H2);
        self.h2.as_ref().filter(|_| h2)
    }

    /// Records how long the upstream took to send its response head.
    #[inline]
    pub fn observe(&self, started: tokio::time::Instant) {
        self.seconds.observe(started.elapsed().as_secs_f64());
    }
}

/// hyper-util's pooled client for `config`: over TLS, HTTP/2 when the
/// upstream picks it in ALPN (offered unless `http2: false`), else HTTP/1.1;
/// over plain TCP, HTTP/2 with prior knowledge when `h2c`, else HTTP/1.1.
/// No keep-alive PINGs: this client carries gRPC, and gRPC servers close
/// connections that PING more often than they allow (grpc-go: once every
/// 5 minutes by default, `too_many_pings`).
/// An HTTP/2 upstream carries every request on one connection per upstream
/// (hyper-util's pool shares it); HTTP/1.1 keeps one connection per request
/// in flight, each resuming the TLS session of an earlier one (rustls keeps
/// its tickets in memory, per server name).
fn client(roots: RootCertStore, config: &UpstreamConfig) -> Result<HttpsClient, String> {
    let tls = tls_config(roots, vec![])?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1();
    let https = if config.http2 { https.enable_http2().wrap_connector(http) } else { https.wrap_connector(http) };
    Ok(Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .http2_only(config.h2c)
        .build(https))
}

/// rustls's client settings: ring, TLS 1.2 and 1.3, `roots`, ALPN `alpn`
/// (hyper-rustls sets its own), and the default resumption (session tickets
/// kept in memory per server name).
fn tls_config(roots: RootCertStore, alpn: Vec<Vec<u8>>) -> Result<rustls::ClientConfig, String> {
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = alpn;
    Ok(tls)
}

/// Why a request to an upstream through hyper-util's client failed, for the
/// app and the operator: the causes under hyper-util's own `client error
/// (Connect)` wrapper, which only names the stage, and what to do about an
/// untrusted certificate.
pub(crate) fn client_error(e: &hyper_util::client::legacy::Error) -> String {
    let mut s = match std::error::Error::source(e) {
        Some(cause) => error_chain(cause),
        None => error_chain(e),
    };
    if s.contains("invalid peer certificate") {
        s.push_str(crate::upstream::pool::UNTRUSTED);
    }
    s
}

/// Where a request goes; set by routing in the request's extensions.
#[derive(Debug, Clone)]
pub enum Target {
    /// A configured upstream: its URL replaces the request's scheme and authority.
    Upstream(Arc<Upstream>),
    /// The origin the request names (absolute-form URI, or Host header).
    Direct(Arc<Upstream>),
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Field names that never cross a proxy (RFC 9110 §7.6.1), whatever the
/// Connection field says (TE only when it is not `trailers`, which
/// [`strip_hop_by_hop`] checks). Case-insensitive: the native HTTP/1.1 path
/// asks with names as the app wrote them.
pub(crate) fn hop_by_hop(name: &str) -> bool {
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
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
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

/// The URI to send: the upstream's scheme, authority and base path, then the request's path and query.
/// `origin_form`: the path and query only, for a connection of the upstream's own.
pub(crate) fn upstream_uri(base: &Uri, req: &Uri, origin_form: bool) -> Result<Uri, ProxyError> {
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

/// A response body from either kind of client.
pub enum UpstreamBody {
    /// From an HTTP/1.1 upstream's own pool.
    Own(PooledBody),
    /// From hyper-util's pool (h2, h2c, passthrough).
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
