//! The buffers a connection reuses from one request to the next, and how
//! they are trimmed between requests so that idle connections stay small.

use bytes::BytesMut;

use super::response::FieldStarts;

/// One connection's reused buffers.
#[derive(Default)]
pub(super) struct Buffers {
    /// The request as sent upstream.
    pub(super) req: Vec<u8>,
    /// Bytes read from the upstream.
    pub(super) up: BytesMut,
    /// Bytes for the client.
    pub(super) out: Vec<u8>,
    /// Where the fields of the response head in `out` start, for a route
    /// that reads them.
    pub(super) fields: FieldStarts,
    /// The body sent upstream instead of the app's, for a route that asked
    /// for usage on its behalf: set while the request is routed, taken as it
    /// is made ready. Kept here, not in the request, which the everyday path
    /// moves through every stage.
    pub(super) rewritten: Option<Vec<u8>>,
}

/// Buffer capacity a connection keeps between requests; a buffer a large
/// exchange grew past it is given back, so idle connections stay small.
const KEEP: usize = 32 * 1024;

impl Buffers {
    /// Between requests: gives back what grew past [`KEEP`], and the
    /// client's buffer `client` too once it holds nothing (no pipelined request).
    #[inline]
    pub(super) fn trim(&mut self, client: &mut BytesMut) {
        if self.req.capacity() > KEEP {
            self.req = Vec::new();
        }
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
        if self.up.capacity() > KEEP {
            self.up = BytesMut::new();
        }
        if client.is_empty() && client.capacity() > KEEP {
            *client = BytesMut::new();
        }
    }
}

#[cfg(test)]
mod tests {
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
            rewritten: None,
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
}
