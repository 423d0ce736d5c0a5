use super::*;

/// A buffer a large exchange grew is given back; one within [`KEEP`] is
/// kept with its capacity, so the everyday path does not reallocate.
#[test]
fn trimming_gives_back_only_what_a_large_exchange_grew() {
    let mut bufs = Buffers {
        req: Vec::with_capacity(KEEP * 4),
        up: BytesMut::with_capacity(KEEP / 2),
        out: Vec::with_capacity(KEEP + 1),
        fields: FieldStarts::default(),
    };
    let mut client = BytesMut::with_capacity(KEEP * 2);
    client.extend_from_slice(b"GET / HTTP/1.1\r\n");
    bufs.trim(&mut client);
    assert_eq!(bufs.req.capacity(), 0);
    assert!(bufs.up.capacity() >= KEEP / 2, "kept: {}", bufs.up.capacity());
    assert_eq!(bufs.out.capacity(), 0);
    assert_eq!(&client[..], b"GET / HTTP/1.1\r\n", "a buffer holding a pipelined request is left alone");
    assert!(client.capacity() > KEEP);
    client.clear();
    bufs.trim(&mut client);
    assert_eq!(client.capacity(), 0);
}

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
