//! The connections to one HTTP/1.1 upstream (plain TCP, or TLS when the
//! upstream is `https://` and speaks HTTP/1.1), for both engines, on a
//! LIFO stack (the most recently used is the most likely to still be open):
//! bare TCP streams the native path left, and hyper client connections the
//! general path left (`crate::upstream::exchange`), each taken as the other engine
//! needs it. No task per connection: a connection is driven by the exchange
//! that checked it out, and goes back on the stack once a response has
//! ended cleanly (one still sending a request body that the upstream
//! answered early is finished by a task first, for at most `idle_timeout`).
//! One that the upstream closed, or that idled past `idle_timeout`, is never
//! handed out, and a reaper closes them three times per timeout while any
//! connection is idle (it ends when none is, so an idle sidecar's pools
//! wake nobody, and starts again with the next one put back).
//!
//! An idle stream that became readable (the upstream closed it, or sent
//! bytes nobody asked for) is not reused, and telling costs no system call
//! in the common case: the reactor has already recorded the readiness. Over
//! TLS the look goes through rustls, which takes in what a server sends
//! unasked and is no fault (TLS 1.3 session tickets) and says whether
//! anything else came.
//!
//! TLS connections resume the session of an earlier one (rustls keeps
//! session tickets per server name, shared by the upstream's connections).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::upstream::body::RequestBody;

/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// A connection to an upstream: TCP, or TLS over TCP.
pub enum Stream {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    /// Whether an idle stream has nothing to read: neither bytes nor EOF
    /// (over TLS: nor a close_notify; session tickets are taken in).
    fn quiet(&mut self) -> bool {
        match self {
            Stream::Tcp(s) => quiet(s),
            Stream::Tls(s) => {
                let mut byte = [0u8; 1];
                let mut buf = ReadBuf::new(&mut byte);
                let pending = Pin::new(&mut **s).poll_read(&mut Context::from_waker(Waker::noop()), &mut buf);
                pending.is_pending()
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// How a pool's connections are secured: the connector (the upstream's
/// roots, ALPN `http/1.1`) and the name its certificate must carry.
pub struct Tls {
    pub connector: TlsConnector,
    pub name: ServerName<'static>,
}

/// A hyper HTTP/1.1 client connection over a pooled stream, as the general
/// path leaves it after an exchange: kept whole, so its next exchange on
/// that engine needs no new handshake (and its buffers are reused); the
/// native path takes it apart for the stream.
pub struct HyperConn {
    pub sender: SendRequest<RequestBody>,
    pub conn: Connection<TokioIo<Stream>, RequestBody>,
}

impl HyperConn {
    /// Polls it once, so an upstream's close or bytes nobody asked for are
    /// seen (tokio reads only when the reactor saw the stream readable):
    /// whether it is open, and whether it waits for a request (one still
    /// busy finishing a request body that the upstream answered early does not).
    fn poll_idle(&mut self) -> (bool, bool) {
        let open = self.conn.poll_without_shutdown(&mut Context::from_waker(Waker::noop())).is_pending();
        (open, open && self.sender.is_ready())
    }

    /// The bare stream, unless the upstream sent bytes nobody asked for.
    fn into_stream(self) -> Option<Stream> {
        let parts = self.conn.into_parts();
        let mut stream = parts.read_buf.is_empty().then(|| parts.io.into_inner())?;
        stream.quiet().then_some(stream)
    }
}

/// An idle connection: a bare stream (the native path's), or a hyper
/// connection (the general path's).
pub enum Pooled {
    Bare(Stream),
    Hyper(Box<HyperConn>),
}

impl Pooled {
    /// The connection, if it can take a request now. A hyper connection
    /// still busy goes to a task that finishes its work and then puts it back.
    fn check(self, pool: &Arc<Pool>) -> Option<Pooled> {
        let mut h = match self {
            Pooled::Bare(mut s) => return s.quiet().then_some(Pooled::Bare(s)),
            Pooled::Hyper(h) => h,
        };
        match h.poll_idle() {
            (_, true) => Some(Pooled::Hyper(h)),
            (false, _) => None,
            (true, false) => {
                finish(h, pool);
                None
            }
        }
    }
}

/// Drives a hyper connection that still has work (the rest of a request
/// body that the upstream answered early) in a task, and puts it back on
/// `pool` once it waits for a request; one that ends, or is still busy after
/// the pool's `idle_timeout` (an app that stopped sending its body but kept
/// its connection), is dropped.
fn finish(mut h: Box<HyperConn>, pool: &Arc<Pool>) {
    let patience = pool.idle_timeout;
    let pool = Arc::downgrade(pool);
    tokio::spawn(async move {
        let done = std::future::poll_fn(|cx| {
            if h.conn.poll_without_shutdown(cx).is_ready() {
                return Poll::Ready(false);
            }
            h.sender.poll_ready(cx).map(|r| r.is_ok())
        });
        let ready = tokio::time::timeout(patience, done).await.unwrap_or(false);
        if let (true, Some(pool)) = (ready, pool.upgrade()) {
            pool.push(Pooled::Hyper(h));
        }
    });
}

/// An HTTP/1.1 upstream's idle connections, shared by both engines.
pub struct Pool {
    /// `host:port` to connect to.
    addr: String,
    /// For an `https://` upstream.
    tls: Option<Tls>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    stack: Mutex<Idle>,
    /// Itself, for the reaper it starts.
    me: Weak<Pool>,
}

/// The idle connections, and whether a reaper runs for them.
#[derive(Default)]
struct Idle {
    conns: Vec<(Pooled, Instant)>,
    reaping: bool,
}

impl Pool {
    pub fn new(addr: String, tls: Option<Tls>, connect_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new_cyclic(|me| Pool {
            addr,
            tls,
            connect_timeout,
            idle_timeout,
            stack: Mutex::new(Idle::default()),
            me: me.clone(),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The most recently used idle connection that is still usable, as it was left.
    pub fn checkout_any(self: &Arc<Self>) -> Option<Pooled> {
        loop {
            let (conn, since) = self.stack.lock().expect("pool lock").conns.pop()?;
            if since.elapsed() < self.idle_timeout
                && let Some(conn) = conn.check(self)
            {
                return Some(conn);
            }
        }
    }

    /// The most recently used idle connection that is still usable, as a bare stream.
    pub fn checkout(self: &Arc<Self>) -> Option<Stream> {
        loop {
            match self.checkout_any()? {
                Pooled::Bare(s) => return Some(s),
                Pooled::Hyper(h) => {
                    if let Some(s) = h.into_stream() {
                        return Some(s);
                    }
                }
            }
        }
    }

    /// Puts a connection whose last response ended cleanly back on the stack.
    pub fn put(&self, mut conn: Stream) {
        if conn.quiet() {
            self.push(Pooled::Bare(conn));
        }
    }

    /// Puts a hyper connection whose last response ended cleanly back on
    /// the stack, or, while it still sends the request's body, in a task
    /// that puts it back when it is done. (Closes are seen at checkout.)
    pub fn put_hyper(self: &Arc<Self>, conn: Box<HyperConn>) {
        if conn.sender.is_ready() {
            self.push(Pooled::Hyper(conn));
        } else {
            finish(conn, self);
        }
    }

    /// Keeps `conn` idle for the next request, and starts the reaper of idle connections.
    #[allow(
        clippy::disallowed_methods,
        reason = "an idle connection's age runs in tokio's time, which its reaper's timer keeps"
    )]
    fn push(&self, conn: Pooled) {
        let mut idle = self.stack.lock().expect("pool lock");
        if idle.conns.len() < MAX_IDLE {
            idle.conns.push((conn, Instant::now()));
        }
        if !idle.reaping
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            idle.reaping = true;
            rt.spawn(reap(self.me.clone(), self.idle_timeout));
        }
    }

    /// A new connection to the upstream (TCP with `TCP_NODELAY`, then the
    /// TLS handshake for an `https://` one, both within `connect_timeout`),
    /// or why there is none, for a `502`'s detail.
    pub async fn connect(self: &Arc<Self>) -> Result<Stream, String> {
        dial(&self.addr, self.tls.as_ref(), self.connect_timeout).await
    }

    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.stack.lock().expect("pool lock").conns.len()
    }

    #[cfg(test)]
    fn reaping(&self) -> bool {
        self.stack.lock().expect("pool lock").reaping
    }
}

/// Closes connections idle for longer than `idle_timeout`, or no longer
/// usable, three times per `idle_timeout` (so none outlives it by more than
/// a third), until none is idle or the pool is gone.
async fn reap(pool: Weak<Pool>, idle_timeout: Duration) {
    let mut tick = tokio::time::interval(idle_timeout / 3);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        // Checked outside the lock (a busy hyper connection goes to a task).
        let idle = std::mem::take(&mut pool.stack.lock().expect("pool lock").conns);
        let kept: Vec<_> = idle
            .into_iter()
            .filter(|(_, since)| since.elapsed() < idle_timeout)
            .filter_map(|(c, since)| c.check(&pool).map(|c| (c, since)))
            .collect();
        // Newer ones came back meanwhile: they go on top.
        let mut idle = pool.stack.lock().expect("pool lock");
        let newer = std::mem::replace(&mut idle.conns, kept);
        idle.conns.extend(newer);
        let excess = idle.conns.len().saturating_sub(MAX_IDLE);
        idle.conns.drain(..excess);
        if idle.conns.is_empty() {
            // The next connection put back starts another.
            idle.reaping = false;
            return;
        }
    }
}

/// A new connection to `addr` (TLS over it with `tls`), within `limit`; the
/// error says what failed, as a `502` names it.
pub(crate) async fn dial(addr: &str, tls: Option<&Tls>, limit: Duration) -> Result<Stream, String> {
    let connecting = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| format!("tcp connect error: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = tls else { return Ok(Stream::Tcp(tcp)) };
        let s = tls.connector.connect(tls.name.clone(), tcp).await.map_err(|e| tls_error(&e))?;
        Ok(Stream::Tls(Box::new(s)))
    };
    match tokio::time::timeout(limit, connecting).await {
        Ok(r) => r,
        Err(_) => Err(format!("connect timed out after {limit:?}")),
    }
}

/// What a `502` adds to a certificate the upstream's roots do not trust.
pub(crate) const UNTRUSTED: &str =
    " (the upstream's certificate is not trusted: name the CA that signed it in the upstream's ca_file)";

/// A TLS handshake's failure as a `502` names it: rustls's own words (e.g.
/// `invalid peer certificate: UnknownIssuer`), and what to do about an
/// untrusted certificate.
fn tls_error(e: &io::Error) -> String {
    let mut s = format!("tls handshake: {}", e.get_ref().map_or_else(|| e.to_string(), |i| i.to_string()));
    if s.contains("invalid peer certificate") {
        s.push_str(UNTRUSTED);
    }
    s
}

/// Whether an idle TCP stream has nothing to read: neither bytes nor EOF.
fn quiet(stream: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    match stream.poll_read_ready(&mut cx) {
        Poll::Pending => true,
        Poll::Ready(Err(_)) => false,
        // Readiness can outlive the bytes that caused it: look.
        Poll::Ready(Ok(())) => {
            matches!(stream.try_read(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use super::*;

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_not_handed_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(
            listener.local_addr().unwrap().to_string(),
            None,
            Duration::from_secs(1),
            Duration::from_secs(60),
        );
        let (a, b) = (pool.connect().await.unwrap(), pool.connect().await.unwrap());
        let (mut sa, _) = listener.accept().await.unwrap();
        let (sb, _) = listener.accept().await.unwrap();
        pool.put(a);
        pool.put(b);
        // The upstream closes the second (most recent) one and writes stray bytes on the first.
        drop(sb);
        sa.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(pool.checkout().is_none(), "neither is quiet");
        assert_eq!(pool.idle_count(), 0);

        let c = pool.connect().await.unwrap();
        let _server_side = listener.accept().await.unwrap();
        pool.put(c);
        assert!(pool.checkout().is_some(), "a quiet one is handed out");
    }

    /// A TLS connection is quiet with only the server's session tickets
    /// unread, and not once the server has closed it (close_notify, FIN).
    #[tokio::test]
    async fn a_tls_connection_is_quiet_after_its_session_tickets_and_not_after_a_close() {
        use rcgen::{CertificateParams, KeyPair};
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_string()]).unwrap().self_signed(&key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tls = Tls {
            connector: TlsConnector::from(Arc::new(client)),
            name: ServerName::try_from("localhost".to_string()).unwrap(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(
            listener.local_addr().unwrap().to_string(),
            Some(tls),
            Duration::from_secs(1),
            Duration::from_secs(60),
        );
        let (accepted, c) =
            tokio::join!(async { acceptor.accept(listener.accept().await.unwrap().0).await.unwrap() }, pool.connect());
        let (c, mut server_side) = (c.unwrap(), accepted);
        assert!(matches!(c, Stream::Tls(_)));
        server_side.flush().await.unwrap();
        // The server's TLS 1.3 session tickets arrive after the handshake.
        tokio::time::sleep(Duration::from_millis(100)).await;
        pool.put(c);
        let c = pool.checkout().expect("session tickets are no reason to drop a connection");
        pool.put(c);
        server_side.shutdown().await.unwrap();
        drop(server_side);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(pool.checkout().is_none(), "closed by the server");
        let err = match pool.connect().await {
            Ok(_) => panic!("the listener accepts, but nobody answers the handshake within the timeout"),
            Err(e) => e,
        };
        assert!(err.contains("timed out"), "{err}");
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = Duration::from_millis(300);
        let pool = Pool::new(listener.local_addr().unwrap().to_string(), None, Duration::from_secs(1), idle);
        let c = pool.connect().await.unwrap();
        let _server_side = listener.accept().await.unwrap();
        pool.put(c);
        assert_eq!(pool.idle_count(), 1);
        tokio::time::sleep(idle * 2).await;
        assert_eq!(pool.idle_count(), 0, "the reaper closed it");
        // With nothing idle the reaper has ended (an idle sidecar's timers
        // stay quiet); the next connection put back starts another.
        assert!(!pool.reaping());
        let c = pool.connect().await.unwrap();
        let _server_side = listener.accept().await.unwrap();
        pool.put(c);
        assert!(pool.reaping());
        tokio::time::sleep(idle * 2).await;
        assert_eq!((pool.idle_count(), pool.reaping()), (0, false), "closed by a new reaper, which ended too");
    }
}
