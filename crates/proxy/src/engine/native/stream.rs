//! Relaying an answer that is a stream of events read for its cost (a
//! streamed LLM answer whose usage settles the cost): each piece goes out
//! as it comes, as [`relay`](super::relay) sends any body, and is read on
//! its way. Two things differ from other bodies, and keep this path apart
//! from theirs:
//!
//! - An edited stream (usage usher asked for on the app's behalf, taken
//!   out again: [`Held::edit`]) goes out as the edit makes it, in chunks
//!   of usher's own: a length the upstream gave no longer holds, and the
//!   head said `transfer-encoding: chunked` instead ([`response::rechunk`]).
//! - When the app leaves, the stream is read on, for its cost, within the
//!   upstream's `timeout` and [`MAX_READ_ON`] bytes ([`Held::left`]), in a
//!   task of its own: the app's connection closes at once.

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::Connection;
use super::body::{BodyError, home, refill, release, send};
use super::buffers::Buffers;
use super::conn::Taken;
use super::forward::{Carried, Sending};
use super::relay::{end_head, stays_open};
use super::response::{self, Dechunker, Framing, ResponseHead};
use super::watch::App;
use crate::pipeline::Held;
use crate::upstream::pool::{Pool, Stream};
use usher_enforce::respond::BoxError;
use usher_enforce::settle::MAX_READ_ON;

/// Sends the client an upstream's answer that is a stream of events read
/// for its cost (`held` [reads a stream](Held::reads_stream), and the
/// answer has a body); returns whether the connection stays open, as
/// [`answered`](super::relay::answered) does for any other.
pub(super) async fn answered<I>(
    server: &impl Connection,
    app: &mut App<'_, I>,
    bufs: &mut Buffers,
    answer: Sending,
    held: Held,
    taken: Taken,
) -> Result<bool, BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let Sending { body, head, upstream } = answer;
    if held.edits() && matches!(head.framing, Framing::Length(_)) {
        response::rechunk(&mut bufs.out);
    }
    let close = end_head(server, taken, &mut bufs.out);
    let mut held = Some(held);
    let pool = upstream.plain.as_ref().filter(|_| head.reusable).map(|p| p.pool.clone());
    let relayed = relay(&head, body, &mut bufs.up, app, &mut bufs.out, &mut held, pool).await;
    Ok(stays_open(relayed, close, held))
}

/// Sends the client the head in `out` and the stream that follows it (its
/// first bytes in `up`, for a pooled stream), read for its cost by `held`;
/// when the app leaves, reads on ([`read_on`]). `held` is released (the
/// cost settled), and a pooled stream put back in `pool`, once the last
/// bytes are in hand, as in [`relay`](super::relay).
async fn relay<I>(
    head: &ResponseHead,
    body: Carried,
    up: &mut BytesMut,
    app: &mut App<'_, I>,
    out: &mut Vec<u8>,
    held: &mut Option<Held>,
    pool: Option<Arc<Pool>>,
) -> Result<(), BodyError>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let mut source = Source::new(head.framing, body, up);
    let edits = held.as_ref().is_some_and(Held::edits);
    // The client's framing: the upstream's length, unless edited; chunks otherwise.
    let chunked = edits || !matches!(head.framing, Framing::Length(_));
    let mut edited = Vec::new();
    loop {
        let taken = source.take(up, |data| match held {
            Some(h) if edits => h.edit(data, &mut edited),
            _ => {
                if let Some(h) = held {
                    h.tee(data);
                }
                put(out, data, chunked);
            }
        });
        put(out, &edited, true);
        edited.clear();
        let ended = match taken {
            Ok(ended) => ended,
            Err(e) => return Err(upstream_failed(app, out, e).await),
        };
        if !ended {
            if let Err(e) = send(app.io, out).await {
                return Err(gone(e, source, up, held, pool));
            }
            match app.wait(source.read(up)).await {
                Err(e) => return Err(gone(e, source, up, held, pool)),
                Ok(Err(e)) => return Err(upstream_failed(app, out, e).await),
                Ok(Ok(false)) => continue,
                Ok(Ok(true)) if source.ends_at_eof() => {}
                Ok(Ok(true)) => return Err(upstream_failed(app, out, CUT.into()).await),
            }
        }
        if let Some(h) = held.as_mut().filter(|_| edits) {
            h.flush(&mut edited);
            put(out, &edited, true);
        }
        if chunked {
            out.extend_from_slice(b"0\r\n\r\n");
        }
        source.home(up.is_empty(), held, pool.as_deref());
        send(app.io, out).await?;
        return app.io.flush().await.map_err(BodyError::Client);
    }
}

/// Why a body with a length or chunks ended before them.
const CUT: &str = "the upstream closed the connection before the end of the body";

/// Appends body bytes for the client: as they are, or as a chunk.
fn put(out: &mut Vec<u8>, data: &[u8], chunked: bool) {
    match chunked {
        true => response::push_chunk(out, data),
        false => out.extend_from_slice(data),
    }
}

/// The upstream broke the stream: what came before goes out (the client
/// sees it cut), and the error says why.
async fn upstream_failed<I>(app: &mut App<'_, I>, out: &mut Vec<u8>, why: String) -> BodyError
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    if let Err(e) = send(app.io, out).await {
        return e;
    }
    if let Err(e) = app.io.flush().await {
        return BodyError::Client(e);
    }
    BodyError::Upstream(why)
}

/// The app left (`why`): the rest of the stream is read for its cost in a
/// task of its own ([`read_on`]), with what is held. Returns `why`.
fn gone(
    why: BodyError,
    source: Source,
    up: &mut BytesMut,
    held: &mut Option<Held>,
    pool: Option<Arc<Pool>>,
) -> BodyError {
    if let Some(mut h) = held.take() {
        h.left();
        tokio::spawn(read_on(source, up.split(), h, pool));
    }
    why
}

/// Reads the rest of a stream its app left (its next bytes in `up`), for
/// its cost: to its end, within the route's upstream `timeout` and
/// [`MAX_READ_ON`] bytes. Then `held` settles it (and a pooled stream goes
/// back to `pool`); otherwise the admission's charge stands when `held` is
/// dropped. Either way the answer counts as `client_gone`.
async fn read_on(mut source: Source, mut up: BytesMut, held: Held, pool: Option<Arc<Pool>>) {
    let within = held.read_on_for();
    let mut held = Some(held);
    // (A sleep, not a deadline: the connection loop's clock reads stay inlined, callgrind.)
    let ended = tokio::select! {
        ended = read_rest(&mut source, &mut up, &mut held) => ended,
        () = tokio::time::sleep(within) => false,
    };
    if ended {
        source.home(up.is_empty(), &mut held, pool.as_deref());
    }
}

/// Reads the rest of a stream into `held`: true once it has ended, false
/// when it fails or passes [`MAX_READ_ON`] bytes.
async fn read_rest(source: &mut Source, up: &mut BytesMut, held: &mut Option<Held>) -> bool {
    let mut left = MAX_READ_ON;
    loop {
        let taken = source.take(up, |data| {
            left = left.saturating_sub(data.len() as u64);
            if let Some(h) = held.as_mut() {
                h.tee(data);
            }
        });
        match taken {
            Ok(true) => return true,
            Ok(false) if left > 0 => {}
            _ => return false,
        }
        match source.read(up).await {
            Ok(false) => {}
            Ok(true) => return source.ends_at_eof(),
            Err(_) => return false,
        }
    }
}

/// Where the stream comes from: a pooled stream, with its framing and
/// where it is in it, or an h2 stream's data frames. Either way its bytes
/// are read into the connection's `up` buffer, and taken from there.
enum Source {
    Stream {
        stream: Stream,
        framing: Framing,
        /// Bytes of a `Length` body still to come.
        left: u64,
        chunks: Dechunker,
        /// What the dechunker writes (its re-chunked data), unused here.
        scratch: Vec<u8>,
    },
    Frames(h2::RecvStream),
}

impl Source {
    fn new(framing: Framing, body: Carried, up: &mut BytesMut) -> Self {
        match body {
            Carried::Stream(stream) => {
                let left = match framing {
                    Framing::Length(n) => n,
                    _ => 0,
                };
                Source::Stream { stream, framing, left, chunks: Dechunker::default(), scratch: Vec::new() }
            }
            Carried::Shared(frames) => {
                up.clear();
                Source::Frames(frames)
            }
        }
    }

    /// Hands the body's bytes in `up` to `data`, consuming them; true when
    /// the body has ended. An error breaks the body's framing.
    fn take(&mut self, up: &mut BytesMut, mut data: impl FnMut(&[u8])) -> Result<bool, String> {
        match self {
            Source::Stream { framing: Framing::Length(_), left, .. } => {
                let n = up.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                data(&up[..n]);
                up.advance(n);
                *left -= n as u64;
                Ok(*left == 0)
            }
            Source::Stream { framing: Framing::Chunked, chunks, scratch, .. } => {
                let used = chunks.feed(up, scratch, data).map_err(str::to_string);
                scratch.clear();
                up.advance(used?);
                Ok(chunks.is_done())
            }
            Source::Stream { framing: Framing::Empty, .. } => Ok(true),
            Source::Stream { framing: Framing::Close, .. } | Source::Frames(_) => {
                data(up);
                up.clear();
                Ok(matches!(self, Source::Frames(f) if f.is_end_stream()))
            }
        }
    }

    /// Reads more of the body into `up` (taken empty, but for a pooled
    /// stream's bytes after a body's end); true at the upstream's end of it.
    async fn read(&mut self, up: &mut BytesMut) -> Result<bool, String> {
        match self {
            Source::Stream { stream, .. } => {
                refill(up);
                stream.read_buf(up).await.map(|n| n == 0).map_err(|e| e.to_string())
            }
            Source::Frames(frames) => match frames.data().await {
                None => Ok(true),
                Some(Ok(data)) => {
                    up.extend_from_slice(&data);
                    // Taken: the upstream may send as much again.
                    let _ = frames.flow_control().release_capacity(data.len());
                    Ok(false)
                }
                Some(Err(e)) => Err(usher_core::error::error_chain(&e)),
            },
        }
    }

    /// Whether the upstream's end of the stream is the body's end (no
    /// length and no chunks said where it ends).
    fn ends_at_eof(&self) -> bool {
        matches!(self, Source::Stream { framing: Framing::Close, .. } | Source::Frames(_))
    }

    /// The body is all in hand: `held` is released (its cost settled), and
    /// a pooled stream goes back to `pool` if the body ended `clean`.
    fn home(self, clean: bool, held: &mut Option<Held>, pool: Option<&Pool>) {
        match self {
            Source::Stream { stream, .. } => home(stream, clean, held, pool),
            Source::Frames(_) => release(held),
        }
    }
}
