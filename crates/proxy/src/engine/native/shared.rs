//! Forwarding on an upstream's shared (multiplexed h2) connection: the
//! request goes out as a stream of it, unless a new connection's ALPN
//! answer says the upstream speaks HTTP/1.1, and then on its pool.

use super::buffers::Buffers;
use super::fields;
use super::forward::{Carried, roundtrip};
use super::head::Head;
use super::response::{self, ResponseHead};
use crate::upstream::Upstream;
use crate::upstream::h2conn::H2Error;
use crate::upstream::pool::Stream;
use usher_enforce::respond::ProxyError;

/// Sends `req` on the upstream's multiplexed h2 connection and puts the
/// client's version of the answer's head in `bufs.out`.
async fn shared(
    upstream: &Upstream,
    (req, body): (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), H2Error> {
    let h2 = upstream.h2.as_ref().expect("ready sends only h2 upstreams' requests here");
    let resp = h2.send(req, body, idempotent).await?;
    let (parts, body) = resp.into_parts();
    // The length is known from `content-length`, or from a stream that ended with its head.
    let exact = match body.is_end_stream() {
        true => Some(0),
        false => parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| fields::parse_length(v.as_bytes())),
    };
    bufs.out.clear();
    bufs.fields.clear();
    let head = response::from_parts(&parts, head_request, exact, &mut bufs.out, &mut bufs.fields);
    Ok((Carried::Shared(body), head))
}

/// Sends `req` on the upstream's multiplexed h2 connection; if a new
/// connection's ALPN answer says the upstream now picks `http/1.1` (it picked
/// h2 before), on its HTTP/1.1 pool instead, encoded for it here.
pub(super) async fn shared_or_pool(
    upstream: &Upstream,
    req: (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    match shared(upstream, req, head_request, idempotent, bufs).await {
        Err(H2Error::Http1(stream, unsent)) if upstream.plain.is_some() => {
            let (req, body) = *unsent;
            bufs.req.clear();
            let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
            Head::encode_made(&req, host, &body, &mut bufs.req);
            on_pool(upstream, stream, head_request, idempotent, bufs).await
        }
        r => r.map_err(|e| h2_failed(upstream, e)),
    }
}

/// Sends a request to an `https://` upstream whose ALPN answer is not yet
/// known: on h2 if its new connection picks h2, else (the connection goes
/// to the upstream's HTTP/1.1 pool) on the pool, as encoded in `bufs.req`.
/// Either way the upstream has learned what it speaks.
pub(super) async fn probe(
    upstream: &Upstream,
    req: (http::Request<()>, bytes::Bytes),
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    let plain = upstream.plain.as_ref().expect("ready probes only upstreams with a pool");
    match shared(upstream, req, head_request, idempotent, bufs).await {
        Err(H2Error::Http1(stream, _)) => on_pool(upstream, stream, head_request, idempotent, bufs).await,
        Ok(answer) => {
            plain.learn(http::Version::HTTP_2, upstream.name());
            Ok(answer)
        }
        Err(e) => Err(h2_failed(upstream, e)),
    }
}

/// Sends the request encoded in `bufs.req` on the HTTP/1.1 pool of an
/// upstream whose new connection (`stream`, which carries it) just picked
/// `http/1.1` in ALPN, and takes note that it speaks HTTP/1.1 (a request
/// that waited meanwhile has no connection: it dials on the pool itself).
async fn on_pool(
    upstream: &Upstream,
    stream: Option<Stream>,
    head_request: bool,
    idempotent: bool,
    bufs: &mut Buffers,
) -> Result<(Carried, ResponseHead), ProxyError> {
    let plain = upstream.plain.as_ref().expect("only an upstream with a pool picks http/1.1 in ALPN");
    plain.learn(http::Version::HTTP_11, upstream.name());
    if let Some(stream) = stream {
        plain.pool.put(stream);
    }
    let name = || upstream.name().to_string();
    roundtrip(&plain.pool, &name, head_request, idempotent, bufs)
        .await
        .map(|(stream, head)| (Carried::Stream(stream), head))
}

/// An exchange on an h2 upstream's connection that failed, as the app is told.
fn h2_failed(upstream: &Upstream, e: H2Error) -> ProxyError {
    let upstream = upstream.name().to_string();
    match e {
        H2Error::Connect(reason) => ProxyError::UpstreamConnect { upstream, reason },
        H2Error::Stream(reason) => ProxyError::Upstream { upstream, reason },
        // An h2c upstream has no ALPN: only an `https://` one (which has a pool) answers so.
        H2Error::Http1(..) => ProxyError::Upstream { upstream, reason: "the upstream picks http/1.1 in ALPN".into() },
    }
}
