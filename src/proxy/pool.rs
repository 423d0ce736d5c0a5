//! The native path's connections to one plain-HTTP/1.1 upstream: bare TCP
//! streams on the shared [`Idle`] stack. No task per connection: a stream
//! is driven by the client connection that checked it out, and goes back on
//! the stack once a response has ended cleanly.
//!
//! An idle stream that became readable (the upstream closed it, or sent
//! bytes nobody asked for) is not reused, and telling costs no system call
//! in the common case: the reactor has already recorded the readiness.

use std::io;
use std::task::{Context, Poll, Waker};

use tokio::net::TcpStream;

use super::idle::{Conn, Idle};

/// A plain-HTTP/1.1 upstream's idle streams for the native path.
pub type Pool = Idle<TcpStream>;

impl Conn for TcpStream {
    fn usable(&self) -> bool {
        quiet(self)
    }
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
