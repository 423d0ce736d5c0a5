//! Relaying an upstream's answer to the client: the head that parsing left in
//! the connection's `out` buffer, then the body, by its framing (a length,
//! chunks, or until the upstream closes) from a pooled stream, or as data
//! frames from an h2 stream. While the body is idle the client is watched
//! ([`App`]), and what the request holds is released as the body's last
//! bytes come in, before they are written.

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::Connection;
use super::body::{BodyError, home, refill, release, send, tee};
use super::buffers::Buffers;
use super::conn::Taken;
use super::forward::{Carried, Sending};
use super::response::{self, Dechunker, Framing, ResponseHead};
use super::watch::App;
use crate::pipeline;
use crate::upstream::pool::{Pool, Stream};
use usher_enforce::respond::BoxError;

/// Sends the client an upstream's answer (head and body); returns whether
/// the connection stays open for another request. (A stream of events
/// read for a cost goes its own way: [`stream::answered`](super::stream::answered).)
pub(super) async fn answered<I>(
    server: &impl Connection,
    app: &mut App<'_, I>,
    bufs: &mut Buffers,
    answer: Sending,
    held: pipeline::Held,
    taken: Taken,
) -> Result<bool, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let Sending { body, head, upstream } = answer;
    let close = end_head(server, taken, &mut bufs.out);
    let mut held = Some(held);
    let relayed = match body {
        Carried::Stream(stream) => {
            let pool = upstream.plain.as_ref().filter(|_| head.reusable).map(|p| &*p.pool);
            relay(&head, stream, &mut bufs.up, app, &mut bufs.out, &mut held, pool).await
        }
        Carried::Shared(body) => relay_frames(head.framing, body, app, &mut bufs.out, &mut held).await,
    };
    Ok(stays_open(relayed, close, held))
}

/// Ends the client's head in `out` (`connection: close` when the
/// connection closes after this answer); returns whether it does.
#[inline(always)]
pub(super) fn end_head(server: &impl Connection, taken: Taken, out: &mut Vec<u8>) -> bool {
    let close = taken.close || server.is_draining();
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    close
}

/// Whether the connection stays open after a body was `relayed` (not if
/// it failed, or `close`). A body that failed is counted, and what its
/// request holds released here; one that ended was released as its last
/// bytes went out. (Always inlined: `answered` is the connection loop's,
/// callgrind.)
#[inline(always)]
pub(super) fn stays_open(relayed: Result<(), BodyError>, close: bool, held: Option<pipeline::Held>) -> bool {
    match relayed {
        Ok(()) => !close,
        Err(BodyError::Upstream(e)) => {
            // The status is already sent: the client sees its body cut.
            if let Some(held) = &held {
                held.body_failed();
            }
            tracing::debug!(error = %e, "response body failed after the headers");
            false
        }
        Err(BodyError::Client(e)) => {
            tracing::debug!(error = %e, "client connection failed while sending the response");
            false
        }
    }
}

/// Sends the client the head in `out` and the body that follows `head` on
/// `stream` (its first bytes already in `up`). When the body ended cleanly
/// with nothing after it, the stream goes back to `pool` (if given: the
/// answer left the connection reusable) to carry another request.
///
/// `held` (the admission's gauge permits, the in-flight count) is released,
/// and the stream put back, once the body's last bytes are in hand, before
/// they are written: a client that has the whole answer may send its next
/// request on another connection at once, and must find the slot free and
/// the upstream connection in the pool (as hyper's body does, `h1pool`).
async fn relay<I>(
    head: &ResponseHead,
    mut stream: Stream,
    up: &mut BytesMut,
    app: &mut App<'_, I>,
    out: &mut Vec<u8>,
    held: &mut Option<pipeline::Held>,
    pool: Option<&Pool>,
) -> Result<(), BodyError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    match head.framing {
        Framing::Empty => {
            home(stream, up.is_empty(), held, pool);
            send(app.io, out).await?
        }
        Framing::Length(n) => {
            let first = up.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            tee(held, &up[..first]);
            out.extend_from_slice(&up[..first]);
            up.advance(first);
            let mut left = n - first as u64;
            if left == 0 {
                home(stream, up.is_empty(), held, pool);
                send(app.io, out).await?;
            } else {
                send(app.io, out).await?;
                loop {
                    refill(up);
                    more(app.wait(stream.read_buf(up)).await?, || {
                        cut(&format!("{left} bytes before the end of the body"))
                    })?;
                    let take = up.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    tee(held, &up[..take]);
                    left -= take as u64;
                    if left == 0 {
                        home(stream, up.len() == take, held, pool);
                        app.io.write_all(&up[..take]).await.map_err(BodyError::Client)?;
                        up.advance(take);
                        break;
                    }
                    app.io.write_all(&up[..take]).await.map_err(BodyError::Client)?;
                    up.advance(take);
                }
            }
        }
        Framing::Chunked => {
            let mut chunks = Dechunker::default();
            loop {
                let used = match chunks.feed(up, out, |data| tee(held, data)) {
                    Ok(used) => used,
                    Err(e) => {
                        // The head and what decoded before the fault still go
                        // out, so the client always sees the same cut answer,
                        // however the upstream's bytes were split into reads.
                        send(app.io, out).await?;
                        app.io.flush().await.map_err(BodyError::Client)?;
                        return Err(BodyError::Upstream(e.to_string()));
                    }
                };
                up.advance(used);
                if chunks.is_done() {
                    home(stream, up.is_empty(), held, pool);
                    send(app.io, out).await?;
                    break;
                }
                send(app.io, out).await?;
                refill(up);
                more(app.wait(stream.read_buf(up)).await?, || cut("in the middle of a chunked body"))?;
            }
        }
        Framing::Close => loop {
            // What has come goes out before the next read: a body that
            // trickles (a stream of events) is not held back by the wait.
            tee(held, up);
            response::push_chunk(out, up);
            send(app.io, out).await?;
            refill(up);
            let n = app.wait(stream.read_buf(up)).await?.map_err(|e| BodyError::Upstream(e.to_string()))?;
            if n == 0 {
                release(held);
                out.extend_from_slice(b"0\r\n\r\n");
                send(app.io, out).await?;
                app.io.flush().await.map_err(BodyError::Client)?;
                return Ok(());
            }
        },
    }
    app.io.flush().await.map_err(BodyError::Client)
}

/// A read of a body whose end is still to come: more bytes, or `cut` at
/// the upstream's EOF, or the upstream's error.
#[inline]
fn more(read: std::io::Result<usize>, cut: impl FnOnce() -> BodyError) -> Result<(), BodyError> {
    match read {
        Ok(0) => Err(cut()),
        Ok(_) => Ok(()),
        Err(e) => Err(BodyError::Upstream(e.to_string())),
    }
}

/// The upstream closed its connection before the body's end (`what` says where).
fn cut(what: &str) -> BodyError {
    BodyError::Upstream(format!("the upstream closed the connection {what}"))
}

/// Sends the client the head in `out` and the body of an answer from a
/// multiplexed upstream, as it comes (chunked unless its length is known;
/// trailers are dropped, as the client asked for none). `held` is released
/// once the last data is in hand, as in [`relay`].
async fn relay_frames<I>(
    framing: Framing,
    mut body: h2::RecvStream,
    app: &mut App<'_, I>,
    out: &mut Vec<u8>,
    held: &mut Option<pipeline::Held>,
) -> Result<(), BodyError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let chunked = framing == Framing::Chunked;
    if framing != Framing::Empty {
        while !body.is_end_stream() {
            match app.wait(body.data()).await? {
                None => break,
                Some(Ok(data)) => {
                    tee(held, &data);
                    if chunked {
                        response::push_chunk(out, &data);
                    } else {
                        out.extend_from_slice(&data);
                    }
                    if !body.is_end_stream() {
                        send(app.io, out).await?;
                    }
                    // Written: the upstream may send as much again (a slow app slows it down).
                    let _ = body.flow_control().release_capacity(data.len());
                }
                Some(Err(e)) => {
                    // What came before the fault still goes out, head first.
                    send(app.io, out).await?;
                    app.io.flush().await.map_err(BodyError::Client)?;
                    return Err(BodyError::Upstream(usher_core::error::error_chain(&e)));
                }
            }
        }
        if chunked {
            out.extend_from_slice(b"0\r\n\r\n");
        }
    }
    release(held);
    send(app.io, out).await?;
    app.io.flush().await.map_err(BodyError::Client)
}
