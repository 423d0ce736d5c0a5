//! A parsed request as the pipeline sees it ([`Request`], an [`Inbound`]),
//! and how it is made ready for its upstream ([`Prepared`]): encoded for
//! the upstream's HTTP/1.1 pool, made for its h2 connection, or both while
//! the upstream's ALPN answer is still to come.

use std::sync::Arc;

use http::Method;

use super::buffers::Buffers;
use super::head::{Head, why};
use super::timers::Lazy;
use crate::pipeline::Inbound;
use crate::upstream::{Target, Upstream};
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

    #[inline]
    fn ready(self, target: Target, keep_head: bool) -> Result<Prepared<'c>, &'static str> {
        let Target::Upstream(upstream) = target else { return Err(why::UPSTREAM) };
        let send = match upstream.plain.as_ref() {
            Some(plain) if plain.h1() => {
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                self.head.encode(&plain.prefix, host, self.body, &mut self.bufs.req);
                Send::Pool
            }
            _ if upstream.multiplexed().is_some() => {
                let head = self.head.request(&upstream.config.url).ok_or(why::UPSTREAM)?;
                Send::Shared(Box::new((head, bytes::Bytes::copy_from_slice(self.body))))
            }
            // An `https://` upstream whose ALPN answer is still to come: the
            // request is made ready for either, and the answer picks.
            Some(plain) if plain.unknown() && upstream.h2.is_some() => {
                let head = self.head.request(&upstream.config.url).ok_or(why::UPSTREAM)?;
                self.bufs.req.clear();
                let host = upstream.host.as_ref().map_or(&b""[..], |h| h.as_bytes());
                self.head.encode(&plain.prefix, host, self.body, &mut self.bufs.req);
                Send::Probe(Box::new((head, bytes::Bytes::copy_from_slice(self.body))))
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
