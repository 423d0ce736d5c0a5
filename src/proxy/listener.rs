//! The proxy listener's connections: HTTP/1.1 and h2c on one port, served
//! under the routes file's [`ListenerLimits`]: a bound on connections, a
//! deadline for the first bytes and for every request head, header size and
//! count limits, and HTTP/2 flood protection (rapid reset, CONTINUATION).

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

use super::Proxy;
use crate::config::limits::ListenerLimits;
use crate::limit::layer::BoxError;

/// The first bytes of every HTTP/2 prior-knowledge connection.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Streams a client may reset before the server has accepted them
/// (RUSTSEC-2023-0034, "rapid reset"); beyond it the connection gets GOAWAY.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset because of the client's errors
/// (RUSTSEC-2024-0332); beyond it the connection gets GOAWAY.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 256;

/// Serves connections with one set of limits. Cheap to clone.
#[derive(Clone)]
pub struct ConnServer {
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: ListenerLimits,
    /// Once cancelled, every HTTP/1.1 answer carries `connection: close`.
    draining: CancellationToken,
}

impl ConnServer {
    pub fn new(limits: ListenerLimits) -> Self {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            // No half-close: a client's EOF cancels its request, so a client that
            // gives up while waiting for capacity frees its place at once.
            .max_buf_size(limits.max_header_bytes)
            .max_headers(limits.max_headers);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.max_concurrent_streams)
            .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
            .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
            .max_local_error_reset_streams(MAX_LOCAL_ERROR_RESET_STREAMS);
        ConnServer { builder: Arc::new(builder), limits, draining: CancellationToken::new() }
    }

    /// Answers HTTP/1.1 requests with `connection: close` once `token` is
    /// cancelled, so a busy keep-alive client learns of a shutdown from an
    /// answer instead of writing into a connection that is being closed.
    pub fn draining_on(mut self, token: CancellationToken) -> Self {
        self.draining = token;
        self
    }

    pub fn limits(&self) -> &ListenerLimits {
        &self.limits
    }

    /// Serves one client connection on any byte stream until it closes.
    ///
    /// The client must send enough bytes to tell HTTP/1.1 from HTTP/2 within
    /// the header timeout (hyper's own detection waits forever), after which
    /// HTTP/1.1 request heads are bounded by hyper's header read timeout.
    /// `watcher` lets a graceful shutdown drain the connection.
    pub async fn serve<I>(&self, proxy: Arc<Proxy>, mut io: I, watcher: Option<Watcher>) -> Result<(), BoxError>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let prefix = match tokio::time::timeout(self.limits.header_timeout, sniff(&mut io)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err("no request within the header timeout".into()),
        };
        if prefix.is_empty() {
            return Ok(());
        }
        let io = TokioIo::new(Prefixed { prefix, io });
        let draining = self.draining.clone();
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let proxy = proxy.clone();
            let draining = draining.clone();
            async move {
                let h1 = req.version() <= http::Version::HTTP_11 && req.method() != http::Method::CONNECT;
                let mut resp = proxy.handle(req).await;
                if h1 && draining.is_cancelled() && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                    resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(resp)
            }
        });
        let conn = self.builder.serve_connection_with_upgrades(io, svc);
        match watcher {
            Some(w) => w.watch(conn.into_owned()).await,
            None => conn.await,
        }
    }
}

/// Reads until the bytes so far decide the protocol: they stop matching the
/// HTTP/2 preface (HTTP/1.1), or they are the whole preface (HTTP/2), or EOF.
async fn sniff<I: AsyncRead + Unpin>(io: &mut I) -> io::Result<Bytes> {
    let mut buf = vec![0u8; H2_PREFACE.len()];
    let mut filled = 0;
    while filled < buf.len() {
        let n = io.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
        if buf[..filled] != H2_PREFACE[..filled] {
            break;
        }
    }
    buf.truncate(filled);
    Ok(Bytes::from(buf))
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

    #[tokio::test]
    async fn sniff_stops_at_the_first_byte_that_is_not_the_preface() {
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"GET / HTTP/1.1\r\n").await.unwrap();
        let p = sniff(&mut b).await.unwrap();
        assert!(!p.is_empty() && !H2_PREFACE.starts_with(&p), "{p:?}");
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, H2_PREFACE).await.unwrap();
        assert_eq!(&sniff(&mut b).await.unwrap()[..], H2_PREFACE);
        drop(a);
        assert!(sniff(&mut b).await.unwrap().is_empty());
    }
}
