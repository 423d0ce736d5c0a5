//! The connections to one plain-HTTP/1.1 upstream, for both engines, on a
//! LIFO stack (the most recently used is the most likely to still be open):
//! bare TCP streams the native path left, and hyper client connections the
//! general path left (`super::h1pool`), each taken as the other engine
//! needs it. No task per connection: a connection is driven by the exchange
//! that checked it out, and goes back on the stack once a response has
//! ended cleanly (one still sending a request body that the upstream
//! answered early is finished by a task first, for at most `idle_timeout`).
//! One that the upstream closed, or that idled past `idle_timeout`, is never
//! handed out, and a reaper closes them three times per timeout until the
//! pool is gone.
//!
//! An idle stream that became readable (the upstream closed it, or sent
//! bytes nobody asked for) is not reused, and telling costs no system call
//! in the common case: the reactor has already recorded the readiness.

use std::io;
use std::sync::{Arc, Mutex, Once, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::body::RequestBody;

/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// A hyper HTTP/1.1 client connection over a pooled stream, as the general
/// path leaves it after an exchange: kept whole, so its next exchange on
/// that engine needs no new handshake (and its buffers are reused); the
/// native path takes it apart for the stream.
pub struct HyperConn {
    pub sender: SendRequest<RequestBody>,
    pub conn: Connection<TokioIo<TcpStream>, RequestBody>,
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
    fn into_stream(self) -> Option<TcpStream> {
        let parts = self.conn.into_parts();
        parts.read_buf.is_empty().then(|| parts.io.into_inner()).filter(quiet)
    }
}

/// An idle connection: a bare stream (the native path's), or a hyper
/// connection (the general path's).
pub enum Pooled {
    Bare(TcpStream),
    Hyper(Box<HyperConn>),
}

impl Pooled {
    /// The connection, if it can take a request now. A hyper connection
    /// still busy goes to a task that finishes its work and then puts it back.
    fn check(self, pool: &Arc<Pool>) -> Option<Pooled> {
        let mut h = match self {
            Pooled::Bare(s) => return quiet(&s).then_some(Pooled::Bare(s)),
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

/// A plain-HTTP/1.1 upstream's idle connections, shared by both engines.
pub struct Pool {
    /// `host:port` to connect to.
    addr: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    stack: Mutex<Vec<(Pooled, Instant)>>,
    reaper: Once,
}

impl Pool {
    pub fn new(addr: String, connect_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Pool { addr, connect_timeout, idle_timeout, stack: Mutex::new(Vec::new()), reaper: Once::new() })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The most recently used idle connection that is still usable, as it was left.
    pub fn checkout_any(self: &Arc<Self>) -> Option<Pooled> {
        loop {
            let (conn, since) = self.stack.lock().expect("pool lock").pop()?;
            if since.elapsed() < self.idle_timeout
                && let Some(conn) = conn.check(self)
            {
                return Some(conn);
            }
        }
    }

    /// The most recently used idle connection that is still usable, as a bare stream.
    pub fn checkout(self: &Arc<Self>) -> Option<TcpStream> {
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
    pub fn put(&self, conn: TcpStream) {
        if quiet(&conn) {
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

    fn push(&self, conn: Pooled) {
        let mut stack = self.stack.lock().expect("pool lock");
        if stack.len() < MAX_IDLE {
            stack.push((conn, Instant::now()));
        }
    }

    /// A new TCP connection to the upstream (`TCP_NODELAY` set), or why
    /// there is none, for a `502`'s detail. The first one starts the reaper.
    pub async fn connect_tcp(self: &Arc<Self>) -> Result<TcpStream, String> {
        self.reaper.call_once(|| spawn_reaper(Arc::downgrade(self), self.idle_timeout));
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("tcp connect error: {e}")),
            Err(_) => return Err(format!("tcp connect timed out after {:?}", self.connect_timeout)),
        };
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.stack.lock().expect("pool lock").len()
    }
}

/// Closes connections idle for longer than `idle_timeout`, or no longer
/// usable, three times per `idle_timeout` (so none outlives it by more than
/// a third), until the pool is gone.
fn spawn_reaper(pool: Weak<Pool>, idle_timeout: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(idle_timeout / 3);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else { return };
            // Checked outside the lock (a busy hyper connection goes to a task).
            let idle = std::mem::take(&mut *pool.stack.lock().expect("pool lock"));
            let kept: Vec<_> = idle
                .into_iter()
                .filter(|(_, since)| since.elapsed() < idle_timeout)
                .filter_map(|(c, since)| c.check(&pool).map(|c| (c, since)))
                .collect();
            // Newer ones came back meanwhile: they go on top.
            let mut stack = pool.stack.lock().expect("pool lock");
            let newer = std::mem::replace(&mut *stack, kept);
            stack.extend(newer);
            let excess = stack.len().saturating_sub(MAX_IDLE);
            stack.drain(..excess);
        }
    });
}

/// Whether an idle stream has nothing to read: neither bytes nor EOF.
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
        let pool =
            Pool::new(listener.local_addr().unwrap().to_string(), Duration::from_secs(1), Duration::from_secs(60));
        let (a, b) = (pool.connect_tcp().await.unwrap(), pool.connect_tcp().await.unwrap());
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

        let c = pool.connect_tcp().await.unwrap();
        let _server_side = listener.accept().await.unwrap();
        pool.put(c);
        assert!(pool.checkout().is_some(), "a quiet one is handed out");
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = Duration::from_millis(300);
        let pool = Pool::new(listener.local_addr().unwrap().to_string(), Duration::from_secs(1), idle);
        let c = pool.connect_tcp().await.unwrap();
        let _server_side = listener.accept().await.unwrap();
        pool.put(c);
        assert_eq!(pool.idle_count(), 1);
        tokio::time::sleep(idle * 2).await;
        assert_eq!(pool.idle_count(), 0, "the reaper closed it");
    }
}
