//! A parsed request as the pipeline sees it ([`Request`], an [`Inbound`]),
//! and how it is made ready for its upstream ([`Prepared`]): encoded for
//! the upstream's HTTP/1.1 pool, made for its h2 connection, or both while
//! the upstream's ALPN answer is still to come.

use std::sync::Arc;

use http::Method;

use super::buffers::Buffers;
use super::head::{Head, why};
use super::timers::Lazy;
use crate::pipeline::{BodyAccess, Inbound, ReadAhead};
use crate::upstream::{Target, Upstream};
use usher_enforce::request_body::Body;
use usher_enforce::resource::RequestView;
use usher_enforce::respond::ProxyError;

/// A parsed request as the pipeline sees it.
pub(super) struct Request<'a, 'c> {
    /// The request's head, in the client's buffer.
    pub(super) head: Head<'a>,
    /// The request's body, in the client's buffer.
    pub(super) body: &'a [u8],
    /// The connection's buffers: the request is encoded into them for its upstream.
    pub(super) bufs: &'c mut Buffers,
    /// The connection's deadline for the upstream's answer.
    pub(super) deadline: &'c mut Lazy,
}

impl RequestView for Request<'_, '_> {
    fn method(&self) -> &Method {
        self.head.method()
    }

    fn uri_host(&self) -> Option<&str> {
        None
    }

    fn path(&self) -> &str {
        self.head.path()
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.head.header(name)
    }
}

impl<'c> Inbound for Request<'_, 'c> {
    type Ready = Prepared<'c>;

    fn grpc(&self) -> bool {
        // gRPC is handed off while parsing.
        false
    }

    fn guard(&mut self, _max_body: Option<u64>) -> Result<(), ProxyError> {
        // Parsing handed off every request these checks could refuse (a
        // `Via` of ours, no Host or several, a body over the limit in force,
        // an Upgrade): see `serve`.
        Ok(())
    }

    fn in_hand(&mut self) -> Option<&mut dyn BodyAccess> {
        Some(self)
    }

    #[inline]
    fn ready(self, target: Target, keep_head: bool) -> Result<Prepared<'c>, &'static str> {
        if self.bufs.rewritten.is_some() {
            return self.ready_rewritten(target, keep_head);
        }
        let body = self.body;
        self.prepare(target, keep_head, body, Head::encode, |_| {})
    }
}

impl<'a, 'c> Request<'a, 'c> {
    /// [`Inbound::ready`] with the body usher rewrote (in the connection's
    /// buffers): its length is that body's.
    #[cold]
    #[inline(never)]
    fn ready_rewritten(self, target: Target, keep_head: bool) -> Result<Prepared<'c>, &'static str> {
        let body = self.bufs.rewritten.take().unwrap_or_default();
        let length = http::HeaderValue::from(body.len());
        let h2_length = |h: &mut http::Request<()>| {
            h.headers_mut().insert(http::header::CONTENT_LENGTH, length.clone());
        };
        self.prepare(target, keep_head, &body, Head::encode_rewritten, h2_length)
    }

    /// Makes the request ready for `target` with `body`: encoded (by
    /// `encode`) for its HTTP/1.1 pool, or made for its h2 connection (its
    /// head then passed to `h2_head`). Always inlined: the everyday request
    /// is made ready as it was before rewritten bodies (callgrind).
    #[inline(always)]
    fn prepare(
        self,
        target: Target,
        keep_head: bool,
        body: &[u8],
        encode: impl Fn(&Head<'a>, &str, &[u8], &[u8], &mut Vec<u8>),
        h2_head: impl Fn(&mut http::Request<()>),
    ) -> Result<Prepared<'c>, &'static str> {
        let Target::Upstream(upstream) = target else { return Err(why::UPSTREAM) };
        let h2 = || {
            let mut head = self.head.request(&upstream.config.url).ok_or(why::UPSTREAM)?;
            h2_head(&mut head);
            Ok::<_, &'static str>(Box::new((head, bytes::Bytes::copy_from_slice(body))))
        };
        let send = match upstream.plain.as_ref() {
            Some(plain) if plain.h1() => {
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                encode(&self.head, &plain.prefix, host, body, &mut self.bufs.req);
                Send::Pool
            }
            _ if upstream.multiplexed().is_some() => Send::Shared(h2()?),
            // An `https://` upstream whose ALPN answer is still to come: the
            // request is made ready for either, and the answer picks.
            Some(plain) if plain.unknown() && upstream.h2.is_some() => {
                let made = h2()?;
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                encode(&self.head, &plain.prefix, host, body, &mut self.bufs.req);
                Send::Probe(made)
            }
            _ => return Err(why::UPSTREAM),
        };
        Ok(Prepared {
            send,
            keep_head,
            idempotent: self.head.idempotent(),
            head_request: self.head.method == Method::HEAD,
            upstream,
            bufs: self.bufs,
            deadline: self.deadline,
        })
    }
}

/// The native path holds a request's body whole before routing
/// ([`Inbound::in_hand`]): a route that reads it reads it there.
impl BodyAccess for Request<'_, '_> {
    fn body(&self) -> Body<'_> {
        match &self.bufs.rewritten {
            Some(b) => Body::Whole(b),
            None => Body::Whole(self.body),
        }
    }

    fn replace_body(&mut self, body: Vec<u8>) {
        self.bufs.rewritten = Some(body);
    }
}

/// Never read ahead: the native path's bodies are in hand before routing.
impl BodyAccess for Prepared<'_> {
    fn body(&self) -> Body<'_> {
        Body::TooLarge
    }

    fn replace_body(&mut self, _body: Vec<u8>) {}
}

/// Never read ahead: the native path's bodies are in hand before routing
/// ([`Inbound::in_hand`] is always `Some`).
impl<'c> ReadAhead for Prepared<'c> {
    type Reading = NoReadAhead<'c>;

    fn read_ahead(self, _bound: usize, _timeout: std::time::Duration) -> NoReadAhead<'c> {
        unreachable!("the native path reads bodies in hand, never ahead")
    }
}

/// The read-ahead the native path never makes. It has no value, so the
/// pipeline's read-ahead path is compiled out of the native engine, whose
/// everyday request is then built as it was without it (callgrind).
pub(super) struct NoReadAhead<'c>(std::convert::Infallible, std::marker::PhantomData<Prepared<'c>>);

impl<'c> std::future::Future for NoReadAhead<'c> {
    type Output = Result<Prepared<'c>, ProxyError>;

    fn poll(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        match self.0 {}
    }
}

/// How a prepared request goes upstream.
pub(super) enum Send {
    /// On a stream of the upstream's HTTP/1.1 pool, as encoded in the connection's `req` buffer.
    Pool,
    /// On the upstream's multiplexed h2 connection: the head and the body
    /// (boxed: the everyday HTTP/1.1 exchange's futures stay small).
    Shared(Box<(http::Request<()>, bytes::Bytes)>),
    /// To an upstream that may pick h2 or HTTP/1.1 in ALPN: on h2 as
    /// `Shared`, else on the pool (encoded as for `Pool` too), and it learns which.
    Probe(Box<(http::Request<()>, bytes::Bytes)>),
}

/// A request made ready for its upstream.
pub(super) struct Prepared<'c> {
    /// How the request goes upstream.
    pub(super) send: Send,
    /// The route reads the answer's header fields: parsing marks them, and
    /// the answer lends the head they are in (`forward::Answer::fields`).
    pub(super) keep_head: bool,
    /// An upstream the native path forwards to (`ready` checked).
    pub(super) upstream: Arc<Upstream>,
    /// The connection's buffers, the request encoded in `req` for the pool.
    pub(super) bufs: &'c mut Buffers,
    /// The connection's deadline for the upstream's answer.
    pub(super) deadline: &'c mut Lazy,
    /// The request is HEAD: the answer has no body.
    pub(super) head_request: bool,
    /// The request may be sent again on a new connection (see `forward::roundtrip`).
    pub(super) idempotent: bool,
}
