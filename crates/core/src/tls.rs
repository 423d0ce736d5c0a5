//! TLS for the Doorman gRPC between sidecars, intermediate servers and root
//! servers: loading PEM files with errors that name the file and the reason,
//! the server's acceptor (optional client-certificate verification, a
//! certificate swapped in place on reload) and the client's connector.
//!
//! rustls with ring, through tokio-rustls: the same stack as the sidecar's
//! upstream TLS, so TLS to capacity servers adds no crate to the build.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Which file (or setting) a TLS error is about; callers turn it into a flag
/// or a routes-file field name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// The CA certificates file.
    Ca,
    /// The certificate chain file.
    Cert,
    /// The private key file.
    Key,
    /// The name to verify in the server's certificate.
    ServerName,
}

/// A TLS file that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    /// Which file or setting is wrong.
    pub which: Which,
    /// The file's path (or the server name) as given.
    pub path: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FileError {
    fn new(which: Which, path: &Path, reason: impl Into<String>) -> Self {
        FileError { which, path: path.display().to_string(), reason: reason.into() }
    }
}

fn read(which: Which, path: &Path) -> Result<Vec<u8>, FileError> {
    crate::config::file::read_capped(path, crate::config::file::MAX_FILE_BYTES)
        .map_err(|e| FileError::new(which, path, format!("cannot read it: {e}")))
}

/// Every certificate in a PEM file (at least one).
pub fn read_certs(which: Which, path: &Path) -> Result<Vec<CertificateDer<'static>>, FileError> {
    let bytes = read(which, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FileError::new(which, path, format!("not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(FileError::new(which, path, "holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, FileError> {
    let bytes = read(Which::Key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        let reason = match e {
            rustls::pki_types::pem::Error::NoItemsFound => {
                "holds no PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)".to_string()
            }
            e => format!("not a valid PEM private key: {e}"),
        };
        FileError::new(Which::Key, path, reason)
    })
}

/// A certificate chain and its private key, checked to belong together.
pub fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, FileError> {
    let chain = read_certs(Which::Cert, cert)?;
    let der = read_key(key)?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| FileError::new(Which::Key, key, format!("unsupported private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing);
    match ck.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(ck),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(FileError::new(
            Which::Key,
            key,
            format!("does not match the certificate in {} (its public key differs)", cert.display()),
        )),
        Err(e) => Err(FileError::new(Which::Cert, cert, format!("cannot parse the first certificate: {e}"))),
    }
}

/// The CA certificates in a PEM file, as trust anchors.
pub fn read_roots(path: &Path) -> Result<RootCertStore, FileError> {
    let mut roots = RootCertStore::empty();
    for (i, c) in read_certs(Which::Ca, path)?.into_iter().enumerate() {
        roots
            .add(c)
            .map_err(|e| FileError::new(Which::Ca, path, format!("certificate #{} is not a usable CA: {e}", i + 1)))?;
    }
    Ok(roots)
}

// === Client ===

/// Where a client's TLS settings come from: the routes file's `doorman.tls`
/// or an intermediate server's `--parent-tls-*` flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFiles {
    /// CA certificates that sign the servers' certificates.
    pub ca: PathBuf,
    /// Client certificate chain, for servers that require mTLS; given with `key`.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key; given with `cert`.
    pub key: Option<PathBuf>,
    /// Name to verify in the servers' certificates instead of each address's host.
    pub server_name: Option<String>,
}

/// A ready client TLS configuration.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Reads and checks every file.
    pub fn load(files: &ClientFiles) -> Result<Self, FileError> {
        let roots = read_roots(&files.ca)?;
        let server_name = match &files.server_name {
            None => None,
            Some(n) => Some(ServerName::try_from(n.clone()).map_err(|_| FileError {
                which: Which::ServerName,
                path: n.clone(),
                reason: "is not a valid DNS name or IP address".into(),
            })?),
        };
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots);
        let mut config = match (&files.cert, &files.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let ck = certified_key(cert, key)?;
                builder.with_client_cert_resolver(Arc::new(ClientCert {
                    stamp: Mutex::new(stamps(cert, key)),
                    cert: cert.clone(),
                    key: key.clone(),
                    current: ArcSwap::from_pointee(ck),
                }))
            }
            (Some(cert), None) => {
                return Err(FileError::new(Which::Key, cert, "a client certificate needs its private key too"));
            }
            (None, Some(key)) => {
                return Err(FileError::new(Which::Cert, key, "a client private key needs its certificate too"));
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ClientTls { config: Arc::new(config), server_name })
    }

    /// The same settings offering `protocols` in ALPN instead of `h2` (etcd's
    /// JSON gateway speaks HTTP/1.1).
    pub fn with_alpn(&self, protocols: &[&[u8]]) -> Self {
        let mut config = (*self.config).clone();
        config.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
        ClientTls { config: Arc::new(config), server_name: self.server_name.clone() }
    }

    /// A tonic (or hyper-util) connector that dials TCP and speaks TLS over it.
    pub fn connector(&self) -> Connector {
        Connector { tls: self.clone(), last_error: Arc::default() }
    }
}

/// The client certificate, read again when its files change (cert-manager
/// rotates them in place). A connection presents it only in its handshake, so
/// the check costs two `stat`s per new connection and nothing per RPC.
#[derive(Debug)]
struct ClientCert {
    cert: PathBuf,
    key: PathBuf,
    current: ArcSwap<CertifiedKey>,
    stamp: Mutex<[Option<std::time::SystemTime>; 2]>,
}

fn stamps(cert: &Path, key: &Path) -> [Option<std::time::SystemTime>; 2] {
    [cert, key].map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
}

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        let now = stamps(&self.cert, &self.key);
        let mut stamp = self.stamp.lock().expect("client cert stamp poisoned");
        if *stamp != now {
            *stamp = now;
            // Half-way through a rotation the pair may not match yet; the second
            // file's change brings another try.
            match certified_key(&self.cert, &self.key) {
                Ok(ck) => {
                    tracing::info!(cert = %self.cert.display(), "client certificate reloaded");
                    self.current.store(Arc::new(ck));
                }
                Err(e) => {
                    tracing::warn!(file = %e.path, "client certificate not reloaded, keeping the previous one: {}", e.reason)
                }
            }
        }
        Some(self.current.load_full())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Connects to `host:port` from a URI and completes a TLS handshake,
/// verifying the server's certificate for the host (or the configured name).
#[derive(Clone)]
pub struct Connector {
    tls: ClientTls,
    last_error: Arc<Mutex<Option<String>>>,
}

impl Connector {
    /// The last I/O error on a connection this connector made, cleared by reading it.
    ///
    /// With TLS 1.3 a server refuses a client certificate (or its absence)
    /// only after the client's handshake has completed, with an alert that
    /// ends the connection; the RPC in flight then only learns that it was
    /// cancelled. This keeps the alert so the caller can say why.
    pub fn take_error(&self) -> Option<String> {
        self.last_error.lock().expect("connector error poisoned").take()
    }
}

/// What a [`Connector`] yields: a [`ClientConn`] that hyper and tonic can drive.
pub type ClientStream = hyper_util::rt::TokioIo<ClientConn>;

/// A client TLS connection that remembers its last I/O error.
pub struct ClientConn {
    inner: tokio_rustls::client::TlsStream<TcpStream>,
    last_error: Arc<Mutex<Option<String>>>,
}

impl ClientConn {
    /// Records an error; one from reading (an alert) wins over a broken pipe on writing.
    fn note<T>(&self, r: Poll<io::Result<T>>, reading: bool) -> Poll<io::Result<T>> {
        if let Poll::Ready(Err(e)) = &r {
            let mut slot = self.last_error.lock().expect("connector error poisoned");
            if reading || slot.is_none() {
                *slot = Some(e.to_string());
            }
        }
        r
    }
}

impl hyper_util::client::legacy::connect::Connection for ClientConn {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        let c = hyper_util::client::legacy::connect::Connected::new();
        if self.inner.get_ref().1.alpn_protocol() == Some(b"h2") { c.negotiated_h2() } else { c }
    }
}

impl AsyncRead for ClientConn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.note(r, true)
    }
}

impl AsyncWrite for ClientConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(r, false)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(r, false)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(r, false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tower::Service<http::Uri> for Connector {
    type Response = ClientStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<ClientStream>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let tls = self.tls.clone();
        let last_error = self.last_error.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_string();
            let port = uri.port_u16().unwrap_or(443);
            let name = match tls.server_name {
                Some(n) => n,
                None => ServerName::try_from(host.clone()).map_err(|_| {
                    io::Error::new(io::ErrorKind::InvalidInput, format!("`{host}` is not a valid TLS server name"))
                })?,
            };
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let stream =
                tokio_rustls::TlsConnector::from(tls.config).connect(name.clone(), tcp).await.map_err(|e| {
                    let cleartext = matches!(
                        e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()),
                        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType))
                    );
                    let hint = if cleartext {
                        " (the server does not answer in TLS: it probably serves cleartext gRPC; \
                     start it with --tls-cert and --tls-key, or drop TLS on this client)"
                    } else {
                        ""
                    };
                    io::Error::new(
                        e.kind(),
                        format!("TLS handshake with {host}:{port} (as {}) failed: {e}{hint}", name.to_str()),
                    )
                })?;
            Ok(hyper_util::rt::TokioIo::new(ClientConn { inner: stream, last_error }))
        })
    }
}

// === Server ===

/// Where the server's TLS settings come from: `--tls-cert`, `--tls-key`, `--tls-client-ca`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFiles {
    /// The server's certificate chain (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key (`--tls-key`).
    pub key: PathBuf,
    /// CA certificates that sign client certificates; `None` = no client certificates asked for.
    pub client_ca: Option<PathBuf>,
}

/// What the status page shows of the server's TLS.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerTlsStatus {
    /// The certificate file's path.
    pub cert_file: String,
    /// Whether clients must present a certificate.
    pub client_auth: bool,
    /// When the certificate in use was loaded (Unix seconds).
    pub cert_loaded_at: i64,
    /// How many times a changed certificate was swapped in.
    pub reloads: u64,
    /// Why the latest reload kept the old certificate; `None` once one succeeds.
    pub last_reload_error: Option<String>,
    /// How many connections failed their handshake.
    pub handshake_failures: u64,
    /// The latest failed handshake's peer and reason.
    pub last_handshake_error: Option<String>,
}

/// The server's TLS: an acceptor whose certificate can be swapped in place.
pub struct ServerTls {
    files: ServerFiles,
    resolver: Arc<Resolver>,
    acceptor: tokio_rustls::TlsAcceptor,
    status: Mutex<ServerTlsStatus>,
}

#[derive(Debug)]
struct Resolver(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

impl ServerTls {
    /// Reads and checks every file; `now` (Unix seconds) is shown as the load time.
    pub fn load(files: ServerFiles, now: i64) -> Result<Self, FileError> {
        let ck = certified_key(&files.cert, &files.key)?;
        let resolver = Arc::new(Resolver(ArcSwap::from_pointee(ck)));
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions");
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = read_roots(ca)?;
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|e| FileError::new(Which::Ca, ca, format!("cannot verify clients with it: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        let status = ServerTlsStatus {
            cert_file: files.cert.display().to_string(),
            client_auth: files.client_ca.is_some(),
            cert_loaded_at: now,
            ..Default::default()
        };
        Ok(ServerTls {
            files,
            resolver,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            status: Mutex::new(status),
        })
    }

    /// The files the TLS settings are read from.
    pub fn files(&self) -> &ServerFiles {
        &self.files
    }

    /// A snapshot of what the status page shows.
    pub fn status(&self) -> ServerTlsStatus {
        self.status.lock().expect("tls status poisoned").clone()
    }

    /// Reads the certificate and key again; a good pair replaces the one in
    /// use for new connections, a bad one is reported and the old one kept.
    /// `Ok(false)`: the files still hold the pair in use.
    pub fn reload(&self, now: i64) -> Result<bool, FileError> {
        let result = certified_key(&self.files.cert, &self.files.key);
        let mut st = self.status.lock().expect("tls status poisoned");
        match result {
            Ok(ck) => {
                st.last_reload_error = None;
                if ck.cert == self.resolver.0.load().cert {
                    return Ok(false);
                }
                self.resolver.0.store(Arc::new(ck));
                st.reloads += 1;
                st.cert_loaded_at = now;
                Ok(true)
            }
            Err(e) => {
                st.last_reload_error = Some(format!("{}: {}", e.path, e.reason));
                Err(e)
            }
        }
    }

    fn handshake_failed(&self, peer: SocketAddr, reason: String) {
        tracing::warn!(%peer, "TLS connection refused: {reason}");
        let mut st = self.status.lock().expect("tls status poisoned");
        st.handshake_failures += 1;
        st.last_handshake_error = Some(format!("{peer}: {reason}"));
    }

    /// Runs the TLS handshake of an accepted connection, within
    /// [`HANDSHAKE_TIMEOUT`]. A failure is logged with the reason and `None`
    /// returned. The caller runs each handshake in its own task, so a slow
    /// client holds up nobody else.
    pub async fn accept(&self, tcp: TcpStream, peer: SocketAddr) -> Option<TlsConn> {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.handshake(tcp)).await {
            Ok(Ok(conn)) => Some(conn),
            Ok(Err(reason)) => {
                self.handshake_failed(peer, reason);
                None
            }
            Err(_) => {
                self.handshake_failed(peer, format!("no TLS handshake within {}s", HANDSHAKE_TIMEOUT.as_secs()));
                None
            }
        }
    }

    async fn handshake(&self, tcp: TcpStream) -> Result<TlsConn, String> {
        let _ = tcp.set_nodelay(true);
        // A TLS connection starts with a handshake record (0x16); say plainly
        // when a client speaks cleartext gRPC instead of a cryptic alert.
        let mut first = [0u8; 4];
        match tcp.peek(&mut first).await {
            Ok(0) => return Err("closed before the TLS handshake".into()),
            Ok(_) if first[0] == 0x16 => {}
            Ok(n) if first[..n].starts_with(b"PRI ") || b"PRI ".starts_with(&first[..n]) => {
                return Err("the client speaks cleartext HTTP/2 (gRPC without TLS) but this server requires TLS; \
                     configure TLS on the client (doorman.tls in a routes file, --parent-tls-ca on an intermediate server)"
                    .into());
            }
            Ok(_) => return Err("the client did not start a TLS handshake (not TLS, or not gRPC)".into()),
            Err(e) => return Err(format!("cannot read from the client: {e}")),
        }
        match self.acceptor.accept(tcp).into_fallible().await {
            Ok(conn) => Ok(TlsConn(conn)),
            Err((e, tcp)) => {
                // The alert saying why is written; close gently so it reaches the client.
                tokio::spawn(linger_close(tcp));
                Err(format!("TLS handshake failed: {e}"))
            }
        }
    }
}

/// How long a refused connection is drained before it is dropped.
const LINGER: Duration = Duration::from_secs(1);

/// Half-closes `tcp` and discards what the client still sends for a moment.
///
/// With TLS 1.3 a client sends its first requests right behind its half of
/// the handshake. Dropping a socket with unread data sends a reset, and a
/// reset makes the client's kernel throw away the alert that says why it
/// was refused (a missing or untrusted client certificate).
async fn linger_close(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut buf = [0u8; 4096];
    let drain = async {
        let mut total = 0usize;
        while let Ok(n) = tcp.read(&mut buf).await {
            total += n;
            if n == 0 || total > 64 * 1024 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

/// An accepted TLS connection, as tonic's server wants it.
pub struct TlsConn(tokio_rustls::server::TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
