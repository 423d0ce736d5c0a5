//! The general path's exchanges with an HTTP/1.1 upstream (`http://`, not
//! `h2c`, or `https://` speaking HTTP/1.1), on the same pool as the native path ([`crate::upstream::pool::Pool`]):
//! one pool per upstream, whichever engine serves the app.
//!
//! Each exchange takes an idle connection: one this path left (a hyper
//! `http1` client connection, kept whole) or a bare stream, over which it
//! puts a new one. It drives that connection where the exchange is, not in
//! a task of its own: while waiting for the response head, and then from
//! the response body's `poll_frame`. When the body ends cleanly the
//! connection goes back on the stack before the body's last frame is
//! handed out, so the app's next request, whichever engine serves it,
//! finds it idle (the native path takes it apart for its stream). It is
//! not put back after an upgrade, an error, a body dropped half read, an
//! answer that closes the connection (`Connection: close`, HTTP/1.0, a
//! close-delimited body), or with bytes nobody asked for. A request that a
//! reused connection refused before sending anything (the upstream had just
//! closed it) is retried once on a new one, as hyper-util does.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Request, Response, StatusCode, Version};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::upstream::body::RequestBody;
use crate::upstream::pool::{HyperConn, Pool, Pooled};

/// Why a request got no response from the pool.
#[derive(Debug)]
pub(crate) enum PoolError {
    /// No connection: refused, unreachable, or `connect_timeout` passed.
    Connect(String),
    /// The exchange failed on an open connection.
    Http(hyper::Error),
}

/// Where an exchange's connection runs.
enum On {
    /// Driven by the exchange, then by its response body.
    Here(Box<HyperConn>),
    /// In a task of its own (a protocol upgrade); its sender is kept until
    /// the answer, so the connection never sees its user gone mid-request.
    Task(#[allow(dead_code)] SendRequest<RequestBody>),
    /// It ended before the answer.
    Ended,
}

/// Sends `req` (origin-form URI, Host set) on an idle connection of `pool`
/// or a new one. With `upgrade`, the request asks to switch protocols: its
/// connection runs in a task of its own, which hyper's upgrade needs, and
/// never returns to the pool.
pub(crate) async fn send(
    pool: &Arc<Pool>,
    mut req: Request<RequestBody>,
    upgrade: bool,
) -> Result<Response<PooledBody>, PoolError> {
    loop {
        let (pooled, reused) = match pool.checkout_any() {
            Some(p) => (p, true),
            None => (Pooled::Bare(pool.connect().await.map_err(PoolError::Connect)?), false),
        };
        // Boxed once per connection, never moved again: a hyper connection is some 700 bytes.
        let hc = match pooled {
            Pooled::Hyper(h) => h,
            Pooled::Bare(stream) => {
                let (sender, conn) = hyper::client::conn::http1::Builder::new()
                    .handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| PoolError::Connect(e.to_string()))?;
                Box::new(HyperConn { sender, conn })
            }
        };
        // (The request's future holds no borrow of its sender.)
        let (mut on, sent) = if upgrade {
            let HyperConn { mut sender, conn } = *hc;
            let addr = pool.addr().to_string();
            tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    tracing::debug!(upstream = %addr, error = %e, "upstream connection ended with an error");
                }
            });
            let sent = sender.try_send_request(req);
            (On::Task(sender), sent)
        } else {
            let mut hc = hc;
            let sent = hc.sender.try_send_request(req);
            (On::Here(hc), sent)
        };
        let mut sent = std::pin::pin!(sent);
        let answered = poll_fn(|cx| {
            if let Poll::Ready(r) = sent.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            let On::Here(hc) = &mut on else { return Poll::Pending };
            // A connection that ended (cleanly or not) answers the request
            // with an error once it is dropped; until then it drives the exchange.
            if hc.conn.poll_without_shutdown(cx).is_ready() {
                on = On::Ended;
            }
            // It may have just read the answer: taken now, not on a wake-up
            // that would poll the whole exchange again.
            sent.as_mut().poll(cx)
        })
        .await;
        match answered {
            Ok(resp) => {
                let reusable = reusable(&resp);
                let driven = match on {
                    On::Here(hc) => Some(Driven { hc, reusable, pool: Arc::downgrade(pool) }),
                    On::Task(_) | On::Ended => None,
                };
                return Ok(resp.map(|inner| PooledBody { inner, driven }));
            }
            Err(mut e) => match e.take_message() {
                Some(r) if reused => {
                    tracing::debug!(upstream = %pool.addr(), error = %e.error(), "pooled connection closed before the request; retrying on a new one");
                    req = r;
                }
                _ => return Err(PoolError::Http(e.into_error())),
            },
        }
    }
}

/// Whether the connection can carry another request once `resp` has ended:
/// not a switched protocol, not closed by the upstream's answer, and not
/// a body that ends only when the connection does.
fn reusable(resp: &Response<Incoming>) -> bool {
    resp.status() != StatusCode::SWITCHING_PROTOCOLS
        && resp.version() == Version::HTTP_11
        && !asks_close(resp.headers())
        && (resp.body().is_end_stream()
            || resp.headers().contains_key(header::CONTENT_LENGTH)
            || resp.headers().contains_key(header::TRANSFER_ENCODING))
}

fn asks_close(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
}

/// A connection driven by the exchange that uses it.
struct Driven {
    hc: Box<HyperConn>,
    /// Whether it may carry another request once the body has ended.
    reusable: bool,
    pool: Weak<Pool>,
}

impl Driven {
    /// Ends the exchange after its body ended: the connection goes back on
    /// the stack whole (after the rest of the request's body, should the
    /// upstream have answered before it), to be polled when next checked out.
    fn home(self) {
        if let (true, Some(pool)) = (self.reusable, self.pool.upgrade()) {
            pool.put_hyper(self.hc);
        }
    }
}

pin_project_lite::pin_project! {
    /// An upstream response body that drives its connection; the stream
    /// goes back to the pool once the body has ended cleanly.
    pub struct PooledBody {
        #[pin]
        inner: Incoming,
        // None once the body ended or failed, or when the connection runs in a task.
        driven: Option<Driven>,
    }

    impl PinnedDrop for PooledBody {
        fn drop(this: Pin<&mut Self>) {
            // A body with nothing in it may be dropped unread.
            let this = this.project();
            if this.inner.is_end_stream()
                && let Some(driven) = this.driven.take()
            {
                driven.home();
            }
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let mut this = self.project();
        let mut frame = this.inner.as_mut().poll_frame(cx);
        if frame.is_pending()
            && let Some(driven) = this.driven
        {
            // The connection reads what the body waits for (and writes what
            // is left of the request's body).
            if driven.hc.conn.poll_without_shutdown(cx).is_ready() {
                // It ended: the body has all there is, or the error.
                *this.driven = None;
            }
            frame = this.inner.as_mut().poll_frame(cx);
        }
        let Poll::Ready(frame) = frame else { return Poll::Pending };
        match &frame {
            // A failed body leaves the connection in an unknown state: it is not reused.
            Some(Err(_)) => *this.driven = None,
            // Home before the last frame is handed out, so the app's next request finds the stream.
            None => this.driven.take().map_or((), Driven::home),
            Some(Ok(_)) if this.inner.is_end_stream() => this.driven.take().map_or((), Driven::home),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
