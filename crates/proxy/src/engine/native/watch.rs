//! The client, watched while it waits: for the pipeline's answer (capacity,
//! the upstream) and for the next bytes of an answer's body. A pipelined
//! request that arrives meanwhile is kept; the client's EOF ends the wait
//! at once, so a client that gives up frees its place and its permits then.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::READ_CHUNK;
use super::body::BodyError;

/// Runs `fut` while reading whatever the client sends meanwhile into `buf`
/// (a pipelined request), up to `room` bytes. The client's EOF, or a read
/// error, cancels `fut` (returns `None`): a client that gives up frees its
/// place in the queue at once. `fut` is polled first, and the client read
/// only while `fut` waits: a `fut` that is ready at once costs no read.
pub(super) async fn watching<I, F>(
    io: &mut I,
    buf: &mut BytesMut,
    room: usize,
    mut fut: Pin<&mut F>,
) -> Option<F::Output>
where
    I: AsyncRead + Unpin,
    F: Future,
{
    std::future::poll_fn(|cx| {
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            // Full: what else comes waits unread (the client's EOF too) until `fut` is done.
            if buf.len() >= room {
                return Poll::Pending;
            }
            buf.reserve(READ_CHUNK);
            match std::pin::pin!(io.read_buf(buf)).poll(cx) {
                Poll::Ready(Ok(0) | Err(_)) => return Poll::Ready(None),
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await
}

/// The client's connection while an answer's body goes out to it: written
/// to, and read (see [`watching`]) while the body is idle, so that a client
/// that leaves between two events of a stream ends the exchange then, not
/// when the next event comes.
pub(super) struct App<'a, I> {
    /// The client's connection.
    pub(super) io: &'a mut I,
    /// The client's buffer: what it sends meanwhile (a pipelined request) is kept there.
    pub(super) buf: &'a mut BytesMut,
    /// How much of a pipelined request `buf` may take meanwhile.
    pub(super) room: usize,
}

impl<I: AsyncRead + Unpin> App<'_, I> {
    /// Waits for `body` (the body's next bytes), unless the client leaves first.
    pub(super) async fn wait<F: Future>(&mut self, body: F) -> Result<F::Output, BodyError> {
        let body = std::pin::pin!(body);
        watching(self.io, self.buf, self.room, body).await.ok_or_else(|| {
            BodyError::Client(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the client closed its connection while the body was idle",
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// While an answer's body is idle, what the client sends (a pipelined
    /// request) is read into its buffer and kept, and the wait goes on; the
    /// client's EOF ends the wait at once, the body still to come.
    #[tokio::test]
    async fn an_idle_body_keeps_a_pipelined_request_and_ends_at_the_client_s_eof() {
        use std::task::{Context, Waker};

        let (mut client, mut server) = tokio::io::duplex(4096);
        let mut buf = BytesMut::new();
        let next = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n";
        client.write_all(next).await.unwrap();
        let (body, came) = tokio::sync::oneshot::channel::<&str>();
        let mut app = App { io: &mut server, buf: &mut buf, room: 1024 };
        {
            let mut waiting = std::pin::pin!(app.wait(came));
            let mut cx = Context::from_waker(Waker::noop());
            assert!(waiting.as_mut().poll(&mut cx).is_pending(), "a pipelined request is no reason to stop");
            body.send("event").unwrap();
            assert!(matches!(waiting.await, Ok(Ok("event"))));
        }
        assert_eq!(&app.buf[..], next, "the pipelined request is kept for later");

        drop(client);
        let left = app.wait(std::future::pending::<()>()).await;
        assert!(matches!(left, Err(BodyError::Client(_))), "the client's EOF ends the wait");
        assert_eq!(&app.buf[..], next);
    }
}
