//! What both relays of an answer's body share ([`relay`](super::relay)
//! and [`stream`](super::stream)): why one stops short, the writes to the
//! client, the reads' buffer, and the hand-back of what the request holds.

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::READ_CHUNK;
use crate::pipeline;
use crate::upstream::pool::{Pool, Stream};

/// Why relaying a body stopped short.
pub(super) enum BodyError {
    /// The upstream failed or broke the body's framing.
    Upstream(String),
    /// The client's connection failed, or the client left.
    Client(std::io::Error),
}

/// Empties `up` for the upstream's next bytes, with room for a read.
#[inline]
pub(super) fn refill(up: &mut BytesMut) {
    up.clear();
    up.reserve(READ_CHUNK);
}

/// The body is all in hand: what the request holds is released, and the
/// stream goes back to `pool` if the body ended `clean` (bytes after it are
/// a broken upstream, whose connection is not reused).
#[inline]
pub(super) fn home(stream: Stream, clean: bool, held: &mut Option<pipeline::Held>, pool: Option<&Pool>) {
    release(held);
    if let (true, Some(pool)) = (clean, pool) {
        pool.put(stream);
    }
}

/// Copies relayed body bytes for the costs they settle, if the route reads them.
#[inline]
pub(super) fn tee(held: &mut Option<pipeline::Held>, data: &[u8]) {
    if let Some(h) = held {
        h.tee(data);
    }
}

/// The body's last bytes are in hand: its costs are settled, and what the
/// request holds is released.
#[inline]
pub(super) fn release(held: &mut Option<pipeline::Held>) {
    if let Some(mut h) = held.take() {
        h.end();
    }
}

/// Writes and empties `out`.
pub(super) async fn send<I: AsyncWrite + Unpin>(io: &mut I, out: &mut Vec<u8>) -> Result<(), BodyError> {
    if !out.is_empty() {
        io.write_all(out).await.map_err(BodyError::Client)?;
        out.clear();
    }
    Ok(())
}
