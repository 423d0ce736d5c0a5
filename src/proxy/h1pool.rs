//! The general path's connection pool for a plain-HTTP/1.1 upstream
//! (`http://`, not `h2c`): idle `hyper::client::conn::http1` senders on the
//! shared [`Idle`] stack.
//!
//! hyper-util's general pool (kept for HTTPS, h2c and passthrough origins)
//! hashes its `(scheme, authority)` key twice per request and hands each
//! connection back through its own future; one upstream needs neither. A
//! sender goes back on the stack when its response body has ended cleanly
//! (not after an upgrade, an error, or a body dropped half read), and a
//! request that a reused connection refused before sending anything (the
//! upstream had just closed it) is retried once on a fresh connection, as
//! hyper-util does.

use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use super::body::RequestBody;
use super::idle::{Conn, Idle};

/// Why a request got no response from the pool.
#[derive(Debug)]
pub enum PoolError {
    /// No connection: refused, unreachable, or `connect_timeout` passed.
    Connect(String),
    /// The exchange failed on an open connection.
    Http(hyper::Error),
}

/// A plain-HTTP/1.1 upstream's idle hyper senders.
pub type H1Pool = Idle<SendRequest<RequestBody>>;

impl Conn for SendRequest<RequestBody> {
    fn usable(&self) -> bool {
        self.is_ready()
    }
}

impl H1Pool {
    /// Sends `req` (origin-form URI, Host set) on an idle connection or a new one.
    pub async fn send(self: &Arc<Self>, mut req: Request<RequestBody>) -> Result<Response<PooledBody>, PoolError> {
        loop {
            let (mut sender, reused) = match self.checkout() {
                Some(s) => (s, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    // A switched protocol owns the connection from now on.
                    let back =
                        (resp.status() != StatusCode::SWITCHING_PROTOCOLS).then(|| (sender, Arc::downgrade(self)));
                    return Ok(resp.map(|inner| PooledBody { inner, back, ended: false }));
                }
                Err(mut e) => match e.take_message() {
                    Some(r) if reused => {
                        tracing::debug!(upstream = %self.addr(), error = %e.error(), "pooled connection closed before the request; retrying on a new one");
                        req = r;
                    }
                    _ => return Err(PoolError::Http(e.into_error())),
                },
            }
        }
    }

    /// A new connection with its hyper connection task.
    async fn connect(self: &Arc<Self>) -> Result<SendRequest<RequestBody>, PoolError> {
        let stream = self.connect_tcp().await.map_err(PoolError::Connect)?;
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| PoolError::Connect(e.to_string()))?;
        let addr = self.addr().to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(upstream = %addr, error = %e, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }
}

pin_project_lite::pin_project! {
    /// An upstream response body; its connection goes back to the pool once
    /// the body has ended.
    pub struct PooledBody {
        #[pin]
        inner: Incoming,
        back: Option<(SendRequest<RequestBody>, Weak<H1Pool>)>,
        ended: bool,
    }

    impl PinnedDrop for PooledBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if (*this.ended || this.inner.is_end_stream())
                && let Some((sender, pool)) = this.back.take()
                && let Some(pool) = pool.upgrade()
            {
                pool.put(sender);
            }
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            None => *this.ended = true,
            // A failed body leaves the connection in an unknown state: it is not reused.
            Some(Err(_)) => *this.back = None,
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
