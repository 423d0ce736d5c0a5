//! The connections to one plain-HTTP/1.1 upstream, for both engines: bare
//! TCP streams on a LIFO stack (the most recently used is the most likely
//! to still be open). No task per connection: a stream is driven by the
//! exchange that checked it out (the native path's request loop, or the
//! general path's response body, `super::h1pool`), and goes back on the
//! stack once a response has ended cleanly. One that the upstream closed,
//! or that idled past `idle_timeout`, is never handed out, and a reaper
//! closes them three times per timeout until the pool is gone.
//!
//! An idle stream that became readable (the upstream closed it, or sent
//! bytes nobody asked for) is not reused, and telling costs no system call
//! in the common case: the reactor has already recorded the readiness.

use std::io;
use std::sync::{Arc, Mutex, Once, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// A plain-HTTP/1.1 upstream's idle streams, shared by both engines.
pub struct Pool {
    /// `host:port` to connect to.
    addr: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    stack: Mutex<Vec<(TcpStream, Instant)>>,
    reaper: Once,
}

impl Pool {
    pub fn new(addr: String, connect_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Pool { addr, connect_timeout, idle_timeout, stack: Mutex::new(Vec::new()), reaper: Once::new() })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The most recently used idle connection that is still usable.
    pub fn checkout(&self) -> Option<TcpStream> {
        let mut stack = self.stack.lock().expect("pool lock");
        while let Some((conn, since)) = stack.pop() {
            if since.elapsed() < self.idle_timeout && quiet(&conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Puts a connection whose last response ended cleanly back on the stack.
    pub fn put(&self, conn: TcpStream) {
        if !quiet(&conn) {
            return;
        }
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
            pool.stack.lock().expect("pool lock").retain(|(c, since)| since.elapsed() < idle_timeout && quiet(c));
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
