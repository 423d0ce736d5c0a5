//! Bounds on the capacity server's gRPC connections: how many may be open at
//! once (`--max-connections`, enforced where they are accepted), and how long
//! a new one may take to send its complete HTTP/2 preface
//! (`--preface-timeout`). HTTP/2 keepalive pings, set on tonic's builder in
//! the parent module, drop peers that stop answering afterwards.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

use usher_core::tls::{ServerTls, TlsConn};

/// Default `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default `--preface-timeout`, the same as the TLS handshake's.
pub const DEFAULT_PREFACE_TIMEOUT: &str = "10s";
/// Default `--http2-keepalive-interval`.
pub const DEFAULT_KEEPALIVE_INTERVAL: &str = "30s";
/// Default `--http2-keepalive-timeout`.
pub const DEFAULT_KEEPALIVE_TIMEOUT: &str = "10s";
/// Refused connections are logged at most this often (each one is counted).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The bounds, from the flags.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connections open at once, TLS handshakes included (`--max-connections`).
    pub(crate) max_connections: usize,
    /// How long a new connection has to send its complete HTTP/2 preface (`--preface-timeout`).
    pub(crate) preface_timeout: Duration,
}

/// Where the listener counts what it does.
#[derive(Clone)]
pub(crate) struct Counters {
    /// Connections open now.
    pub(crate) open: IntGauge,
    /// Connections closed at once because every slot was taken.
    pub(crate) refused: IntCounter,
    /// Connections closed because their preface came too late.
    pub(crate) timed_out: IntCounter,
    /// Connections whose TLS handshake failed.
    pub(crate) tls_failures: IntCounter,
}

/// Accepts connections on `listener` and yields them to tonic, each holding
/// one of `limits.max_connections` slots until it closes; a connection that
/// finds every slot taken is closed at once. With `tls`, handshakes run
/// concurrently (a slot is held from the accept on, so handshakes in progress
/// count too).
pub(crate) fn incoming(
    listener: TcpListener,
    limits: Limits,
    tls: Option<Arc<ServerTls>>,
    counters: Counters,
    shutdown: CancellationToken,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(64);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        let mut refusals = Refusals { last_logged: None, unlogged: 0 };
        loop {
            let (tcp, peer) = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: pause instead of spinning.
                        tracing::warn!(error = %e, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                counters.refused.inc();
                refusals.refused(peer, limits.max_connections);
                drop(tcp);
                continue;
            };
            let slot = Slot::new(permit, counters.open.clone());
            let _ = tcp.set_nodelay(true);
            match &tls {
                None => {
                    let conn = Conn::new(Io::Plain(tcp), slot, limits.preface_timeout, counters.timed_out.clone());
                    if tx.send(Ok(conn)).await.is_err() {
                        return;
                    }
                }
                Some(tls) => {
                    let (tls, tx, counters) = (tls.clone(), tx.clone(), counters.clone());
                    tokio::spawn(async move {
                        match tls.accept(tcp, peer).await {
                            Some(c) => {
                                let conn =
                                    Conn::new(Io::Tls(Box::new(c)), slot, limits.preface_timeout, counters.timed_out);
                                let _ = tx.send(Ok(conn)).await;
                            }
                            None => counters.tls_failures.inc(),
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// Logs refused connections at most once per [`REFUSAL_LOG_INTERVAL`]: a
/// flood must not turn into a flood of log lines.
struct Refusals {
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl Refusals {
    fn refused(&mut self, peer: SocketAddr, max: usize) {
        self.unlogged += 1;
        if self.last_logged.is_some_and(|t| t.elapsed() < REFUSAL_LOG_INTERVAL) {
            return;
        }
        tracing::warn!(
            %peer,
            refused = self.unlogged,
            max_connections = max,
            "gRPC connections closed at once: --max-connections are open (logged at most every 10 s; \
             all are counted in usher_server_connections_refused_total)"
        );
        #[allow(
            clippy::disallowed_methods,
            reason = "log lines are paced in real time, whatever clock the store runs on"
        )]
        let now = Instant::now();
        self.last_logged = Some(now);
        self.unlogged = 0;
    }
}

/// One of the `--max-connections` slots, counted in the open-connections gauge.
struct Slot {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, open: IntGauge) -> Self {
        open.inc();
        Slot { _permit: permit, open }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// A connection's stream: plain TCP, or TLS over it.
enum Io {
    Plain(TcpStream),
    Tls(Box<TlsConn>),
}

/// The client connection preface (RFC 9113 §3.4): 24 fixed octets, then a
/// SETTINGS frame (a 9-octet header whose first 3 octets are its length).
const MAGIC_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;

/// How far a connection is with its preface.
enum Preface {
    /// Until the whole preface is read, by `deadline`.
    Awaited {
        deadline: Pin<Box<Sleep>>,
        timeout: Duration,
        seen: usize,
        header: [u8; FRAME_HEADER_LEN],
    },
    Received,
    /// The deadline passed: every read fails, so the connection is closed.
    Late,
}

impl Preface {
    /// Counts `bytes` read after `seen` others; true once the preface is complete.
    fn read(seen: &mut usize, header: &mut [u8; FRAME_HEADER_LEN], bytes: &[u8]) -> bool {
        for (pos, b) in (*seen..).zip(bytes).take_while(|(pos, _)| *pos < MAGIC_LEN + FRAME_HEADER_LEN) {
            if pos >= MAGIC_LEN {
                header[pos - MAGIC_LEN] = *b;
            }
        }
        *seen += bytes.len();
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        *seen >= MAGIC_LEN + FRAME_HEADER_LEN + len
    }
}

/// An accepted gRPC connection: holds its slot, and fails its reads once the
/// preface deadline passes without a complete preface.
pub(crate) struct Conn {
    io: Io,
    preface: Preface,
    timed_out: IntCounter,
    _slot: Slot,
}

impl Conn {
    fn new(io: Io, slot: Slot, timeout: Duration, timed_out: IntCounter) -> Self {
        let deadline = Box::pin(tokio::time::sleep(timeout));
        Conn {
            io,
            preface: Preface::Awaited { deadline, timeout, seen: 0, header: [0; FRAME_HEADER_LEN] },
            timed_out,
            _slot: slot,
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match &self.io {
            Io::Plain(t) => t.connect_info(),
            Io::Tls(t) => t.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let late = |timeout: Duration| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no complete HTTP/2 preface within {timeout:?} (--preface-timeout)"),
            )
        };
        let expired = match &mut this.preface {
            Preface::Late => return Poll::Ready(Err(late(Duration::ZERO))),
            Preface::Awaited { deadline, timeout, .. } => deadline.as_mut().poll(cx).is_ready().then_some(*timeout),
            Preface::Received => None,
        };
        if let Some(timeout) = expired {
            let e = late(timeout);
            tracing::debug!(error = %e, "closing a gRPC connection");
            this.preface = Preface::Late;
            this.timed_out.inc();
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let r = match &mut this.io {
            Io::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Io::Tls(t) => Pin::new(t).poll_read(cx, buf),
        };
        if let (Poll::Ready(Ok(())), Preface::Awaited { seen, header, .. }) = (&r, &mut this.preface)
            && Preface::read(seen, header, &buf.filled()[before..])
        {
            this.preface = Preface::Received;
        }
        r
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(t) => Pin::new(t).poll_write(cx, buf),
            Io::Tls(t) => Pin::new(t).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Io::Tls(t) => Pin::new(t).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(t) => t.is_write_vectored(),
            Io::Tls(t) => t.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(t) => Pin::new(t).poll_flush(cx),
            Io::Tls(t) => Pin::new(t).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Io::Tls(t) => Pin::new(t).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_complete_after_its_settings_frame() {
        let mut p = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        p.extend_from_slice(&[0, 0, 12, 4, 0, 0, 0, 0, 0]);
        p.extend_from_slice(&[0; 12]);
        for split in 0..p.len() {
            let (mut seen, mut header) = (0, [0; FRAME_HEADER_LEN]);
            let first = Preface::read(&mut seen, &mut header, &p[..split]);
            assert!(!first, "incomplete after {split} bytes");
            assert!(Preface::read(&mut seen, &mut header, &p[split..]), "complete (split at {split})");
        }
        let (mut seen, mut header) = (0, [0; FRAME_HEADER_LEN]);
        assert!(!Preface::read(&mut seen, &mut header, &p[..p.len() - 1]));
    }
}
