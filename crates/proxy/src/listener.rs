//! The proxy listener's connections: HTTP/1.1 and h2c on one port, served
//! under the routes file's [`ListenerLimits`]: a bound on connections, a
//! deadline for the first bytes and for every request head, header size and
//! count limits, and HTTP/2 flood protection (rapid reset, CONTINUATION).
//!
//! HTTP/1.1 connections start on the native path (`super::engine::native`), which
//! hands a connection to hyper when it brings a request it does not serve;
//! h2c connections, and every connection under `--http1 hyper`, go to hyper.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::engine::native::{self, Served, Services};
use super::route::ListenerId;
use super::sidecar::Proxy;
use usher_core::config::listener::ListenerLimits;
use usher_enforce::respond::BoxError;

/// The first bytes of every HTTP/2 prior-knowledge connection.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Streams a client may reset before the server has accepted them
/// (RUSTSEC-2023-0034, "rapid reset"); beyond it the connection gets GOAWAY.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset because of the client's errors
/// (RUSTSEC-2024-0332); beyond it the connection gets GOAWAY.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 256;

/// What serves HTTP/1.1 connections (`--http1`, `USHER_HTTP1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Http1 {
    /// usher's own request loop for everyday requests to HTTP/1.1
    /// upstreams (plain or TLS); a connection moves to hyper at its first other request.
    #[default]
    Native,
    /// hyper for every request.
    Hyper,
}

/// Serves connections with one set of limits. Cheap to clone.
#[derive(Clone)]
pub struct ConnServer {
    /// For HTTP/2 prior-knowledge connections.
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// For connections whose first bytes are HTTP/1.1: hyper's own builder,
    /// so its first read takes every byte already read (the auto builder's
    /// protocol detection hands it only 24 bytes first, and hyper parses a
    /// partial head again only once it ends in an empty line: a malformed
    /// head was then never answered `400`, only timed out).
    h1: Arc<hyper::server::conn::http1::Builder>,
    limits: ListenerLimits,
    /// Once cancelled, every HTTP/1.1 answer carries `connection: close`.
    draining: CancellationToken,
    /// Once cancelled, idle connections close and busy ones close after their answer.
    closing: CancellationToken,
    http1: Http1,
    /// The listener this server's connections arrive on: routing depends on it.
    listener: ListenerId,
}

impl ConnServer {
    /// A server for connections under `limits`, on the main listener, with
    /// the native path for HTTP/1.1.
    pub fn new(limits: ListenerLimits) -> Self {
        let mut h1 = hyper::server::conn::http1::Builder::new();
        h1.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            // No half-close: a client's EOF cancels its request, so a client that
            // gives up while waiting for capacity frees its place at once.
            .max_buf_size(limits.max_header_bytes)
            .max_headers(limits.max_headers);
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.max_concurrent_streams)
            .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
            .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
            .max_local_error_reset_streams(MAX_LOCAL_ERROR_RESET_STREAMS);
        ConnServer {
            builder: Arc::new(builder),
            h1: Arc::new(h1),
            limits,
            draining: CancellationToken::new(),
            closing: CancellationToken::new(),
            http1: Http1::default(),
            listener: ListenerId::MAIN,
        }
    }

    /// Answers HTTP/1.1 requests with `connection: close` once `token` is
    /// cancelled, so a busy keep-alive client learns of a shutdown from an
    /// answer instead of writing into a connection that is being closed.
    pub fn draining_on(mut self, token: CancellationToken) -> Self {
        self.draining = token;
        self
    }

    /// Closes idle connections, and busy ones after their current answer,
    /// once `token` is cancelled (the end of a graceful shutdown).
    pub fn closing_on(mut self, token: CancellationToken) -> Self {
        self.closing = token;
        self
    }

    /// Chooses what serves HTTP/1.1 connections.
    pub fn http1(mut self, http1: Http1) -> Self {
        self.http1 = http1;
        self
    }

    /// Serves connections that arrived on `listener` (the main one by default).
    pub fn on_listener(mut self, listener: ListenerId) -> Self {
        self.listener = listener;
        self
    }

    /// The limits its connections are served under.
    pub fn limits(&self) -> &ListenerLimits {
        &self.limits
    }

    /// Whether answers must carry `connection: close`.
    pub(super) fn is_draining(&self) -> bool {
        self.draining.is_cancelled() || self.closing.is_cancelled()
    }

    /// Serves one client connection on any byte stream until it closes.
    ///
    /// The client must send enough bytes to tell HTTP/1.1 from HTTP/2 within
    /// the header timeout (hyper's own detection waits forever), and its
    /// first HTTP/1.1 request head within the same deadline; later heads are
    /// bounded by the header timeout from the end of the previous answer.
    pub async fn serve<I>(&self, proxy: Arc<Proxy>, mut io: I) -> Result<(), BoxError>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        #[allow(
            clippy::disallowed_methods,
            reason = "the header timeout is an I/O deadline on tokio's timer, which keeps tokio's time"
        )]
        let deadline = Instant::now() + self.limits.header_timeout;
        let mut buf = BytesMut::with_capacity(FIRST_READ);
        match tokio::time::timeout_at(deadline, sniff(&mut io, &mut buf)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err("no request within the header timeout".into()),
        }
        if buf.is_empty() {
            return Ok(());
        }
        let h2 = buf.starts_with(H2_PREFACE);
        let (buf, io) = if self.http1 == Http1::Native && !h2 {
            let services = Services {
                pipeline: &proxy.pipeline,
                handoffs: &proxy.metrics.http1_handoffs,
                listener: self.listener,
            };
            match native::serve(self, &services, io, buf, deadline).await? {
                Served::Closed => return Ok(()),
                Served::HandOff(buf, io) => (buf, io),
            }
        } else {
            (buf, io)
        };
        self.serve_hyper(proxy, Prefixed { prefix: buf.freeze(), io }, h2).await
    }

    /// Serves a connection with hyper: HTTP/2 when `h2` (its first bytes
    /// were the preface), else HTTP/1.1.
    async fn serve_hyper<I>(&self, proxy: Arc<Proxy>, io: Prefixed<I>, h2: bool) -> Result<(), BoxError>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let server = self.clone();
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let (proxy, server) = (proxy.clone(), server.clone());
            async move {
                let h1 = req.version() <= http::Version::HTTP_11 && req.method() != http::Method::CONNECT;
                let mut resp = proxy.handle_on(server.listener, req).await;
                if h1 && server.is_draining() && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                    resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(resp)
            }
        });
        if h2 {
            let conn = self.builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
            tokio::pin!(conn);
            tokio::select! {
                done = conn.as_mut() => return done,
                _ = self.closing.cancelled() => {}
            }
            conn.as_mut().graceful_shutdown();
            return conn.await;
        }
        let conn = self.h1.serve_connection(TokioIo::new(io), svc).with_upgrades();
        tokio::pin!(conn);
        tokio::select! {
            done = conn.as_mut() => return done.map_err(Into::into),
            _ = self.closing.cancelled() => {}
        }
        conn.as_mut().graceful_shutdown();
        conn.await.map_err(Into::into)
    }
}

impl native::Connection for ConnServer {
    fn limits(&self) -> &ListenerLimits {
        &self.limits
    }

    fn is_draining(&self) -> bool {
        ConnServer::is_draining(self)
    }

    fn closing(&self) -> &CancellationToken {
        &self.closing
    }
}

/// The first read's buffer; it grows as a request needs.
const FIRST_READ: usize = 8 * 1024;

/// Reads until the bytes so far decide the protocol: they stop matching the
/// HTTP/2 preface (HTTP/1.1), or they hold the whole preface (HTTP/2), or
/// EOF. Whatever a read brings beyond that stays in `buf`.
async fn sniff<I: AsyncRead + Unpin>(io: &mut I, buf: &mut BytesMut) -> io::Result<()> {
    while buf.len() < H2_PREFACE.len() {
        if io.read_buf(buf).await? == 0 {
            break;
        }
        let n = buf.len().min(H2_PREFACE.len());
        if buf[..n] != H2_PREFACE[..n] {
            break;
        }
    }
    Ok(())
}

/// A byte stream with bytes already read from it put back in front.
struct Prefixed<I> {
    prefix: Bytes,
    io: I,
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.prefix.has_remaining() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sniffed(b: &mut tokio::io::DuplexStream) -> BytesMut {
        let mut buf = BytesMut::new();
        sniff(b, &mut buf).await.unwrap();
        buf
    }

    #[tokio::test]
    async fn sniff_stops_at_the_first_byte_that_is_not_the_preface() {
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"GET / HTTP/1.1\r\n").await.unwrap();
        let p = sniffed(&mut b).await;
        assert!(!p.is_empty() && !H2_PREFACE.starts_with(&p), "{p:?}");
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, H2_PREFACE).await.unwrap();
        assert_eq!(&sniffed(&mut b).await[..], H2_PREFACE);
        drop(a);
        assert!(sniffed(&mut b).await.is_empty());
    }
}
