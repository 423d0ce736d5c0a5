//! An upstream's idle connections, for both HTTP/1.1 paths: the general
//! path keeps hyper senders ([`super::h1pool`]), the native path bare TCP
//! streams (`super::h1::Pool`). Idle connections wait on a LIFO stack (the
//! most recently used is the most likely to still be open); one that the
//! upstream closed, or that idled past `idle_timeout`, is never handed out,
//! and a reaper closes them three times per timeout until the pool is gone.

use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// A pooled connection.
pub trait Conn: Send + 'static {
    /// Whether it can take another request: the upstream has not closed it
    /// (and, for a bare stream, has sent nothing unasked).
    fn usable(&self) -> bool;
}

pub struct Idle<C> {
    /// `host:port` to connect to.
    addr: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    stack: Mutex<Vec<(C, Instant)>>,
    reaper: Once,
}

impl<C: Conn> Idle<C> {
    pub fn new(addr: String, connect_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Idle { addr, connect_timeout, idle_timeout, stack: Mutex::new(Vec::new()), reaper: Once::new() })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The most recently used idle connection that is still usable.
    pub fn checkout(&self) -> Option<C> {
        let mut stack = self.stack.lock().expect("pool lock");
        while let Some((conn, since)) = stack.pop() {
            if since.elapsed() < self.idle_timeout && conn.usable() {
                return Some(conn);
            }
        }
        None
    }

    /// Puts a connection whose last response ended cleanly back on the stack.
    pub fn put(&self, conn: C) {
        if !conn.usable() {
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
fn spawn_reaper<C: Conn>(pool: Weak<Idle<C>>, idle_timeout: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(idle_timeout / 3);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else { return };
            pool.stack.lock().expect("pool lock").retain(|(c, since)| since.elapsed() < idle_timeout && c.usable());
        }
    });
}
