use super::*;

/// A buffer a large exchange grew is given back; one within [`KEEP`] is
/// kept with its capacity, so the everyday path does not reallocate.
#[test]
fn trimming_gives_back_only_what_a_large_exchange_grew() {
    let mut bufs = Buffers {
        req: Vec::with_capacity(KEEP * 4),
        up: BytesMut::with_capacity(KEEP / 2),
        out: Vec::with_capacity(KEEP + 1),
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
