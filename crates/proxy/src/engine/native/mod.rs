//! The native HTTP/1.1 path: usher's own request loop for the everyday
//! exchange between an app and an HTTP/1.1 upstream (plain or TLS).
//!
//! hyper serves every request through two tasks (the client connection's
//! and the upstream connection's), channels between them, a header map per
//! message and per side, and a tower stack. For a sidecar whose every
//! request is one small exchange, that was 36,000 instructions a request
//! against nginx's 16,000. Here one task per client connection parses the
//! request in place ([`head`]), hands it to the same request pipeline as
//! every other request ([`crate::pipeline`]: guard, account, route, limit)
//! as a [`Request`](request::Request), whose forward stage ([`forward`]) writes it to a pooled
//! upstream stream this task drives itself (`crate::upstream::pool`), and streams the
//! response back ([`response`]), all in reused buffers. The engine is
//! framing only: it sees the pipeline, not `Proxy`, through [`Connection`]
//! and [`Services`].
//!
//! Whatever is not that everyday exchange (a malformed or ambiguous head, a
//! chunked or large request body, `Expect`, `Upgrade`, CONNECT, HTTP/1.0, a
//! request for an HTTPS, h2c or passthrough origin, which the pipeline's
//! route stage answers with `Reply::Unserved`, gRPC) is handed to hyper
//! before anything of it has happened: the connection's unread bytes,
//! that request first, go to the general path, which serves the connection
//! from then on. `usher_proxy_http1_handoffs_total{reason}` counts why.
//! `USHER_HTTP1=hyper` turns the native path off.
//!
//! Behaviour matches the general path's: the same routing, admission,
//! metrics, access log, pushback, error responses, header and body limits,
//! header timeout (an idle keep-alive connection is closed after it),
//! `connection: close` while draining, and a client's EOF cancelling its
//! request while it waits for capacity or for the upstream, or while its
//! answer's body is idle (a stream of events between two events: the
//! upstream's connection is closed, or its h2 stream reset, and the
//! request's permits are freed at once, not when the next event comes).
//!
//! The files follow an exchange: [`conn`] runs the connection (read,
//! parse, hand off, keep alive), [`request`] makes a parsed request ready
//! for its upstream, [`forward`] sends it on a pooled stream (or, in
//! [`shared`], on an h2 connection) and reads the answer's head, and
//! [`relay`] streams the answer's body back while [`watch`] keeps an eye on
//! the client ([`stream`] a stream of events read for its cost). [`buffers`] and [`timers`] are what a connection keeps
//! between requests; [`head`], [`response`] and [`fields`] are the parsers
//! and encoders.

mod body;
mod buffers;
mod conn;
mod fields;
mod forward;
mod head;
mod relay;
mod request;
mod response;
mod shared;
mod stream;
mod timers;
mod watch;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use tokio_util::sync::CancellationToken;

pub(crate) use conn::serve;
pub(crate) use head::why;

use crate::pipeline::Pipeline;
use crate::route::ListenerId;
use usher_core::config::listener::ListenerLimits;

/// Bytes asked of the kernel per read.
const READ_CHUNK: usize = 16 * 1024;

/// How a connection left the native path.
pub(crate) enum Served<I> {
    /// It is closed, or the client went away.
    Closed,
    /// It brought a request the native path does not serve: the general path
    /// serves it from `buf` (that request and anything after it) on.
    HandOff(BytesMut, I),
}

/// What the native path needs of the server its connection belongs to.
pub(crate) trait Connection {
    /// The listener's limits: header size and count, body size, header timeout.
    fn limits(&self) -> &ListenerLimits;
    /// Whether answers must carry `connection: close`.
    fn is_draining(&self) -> bool;
    /// Cancelled when idle connections must close.
    fn closing(&self) -> &CancellationToken;
}

/// What the native path serves requests with: the current pipeline, the
/// counter of hand-offs to hyper by reason, and the listener the connection
/// arrived on (routing depends on it).
pub(crate) struct Services<'s> {
    /// The pipeline snapshot in force, swapped as one by a reload.
    pub(crate) pipeline: &'s ArcSwap<Pipeline>,
    /// `usher_proxy_http1_handoffs_total`, by [`why`] label.
    pub(crate) handoffs: &'s prometheus::IntCounterVec,
    /// The listener the connection arrived on.
    pub(crate) listener: ListenerId,
}
