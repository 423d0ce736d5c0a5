//! The connection pool of a plain-HTTP/1.1 upstream (`http://`, not `h2c`):
//! idle `hyper::client::conn::http1` senders in a LIFO stack.
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
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::upstream::RequestBody;

/// Idle connections kept per upstream; more are closed when they come back.
const MAX_IDLE: usize = 512;

/// Why a request got no response from the pool.
#[derive(Debug)]
pub enum PoolError {
    /// No connection: refused, unreachable, or `connect_timeout` passed.
    Connect(String),
    /// The exchange failed on an open connection.
    Http(hyper::Error),
}

pub struct H1Pool {
    /// `host:port` to connect to.
    addr: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<Vec<(SendRequest<RequestBody>, Instant)>>,
    reaper: std::sync::Once,
}

impl H1Pool {
    pub fn new(addr: String, connect_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(H1Pool {
            addr,
            connect_timeout,
            idle_timeout,
            idle: Mutex::new(Vec::new()),
            reaper: std::sync::Once::new(),
        })
    }

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
                        tracing::debug!(upstream = %self.addr, error = %e.error(), "pooled connection closed before the request; retrying on a new one");
                        req = r;
                    }
                    _ => return Err(PoolError::Http(e.into_error())),
                },
            }
        }
    }

    /// The most recently used idle connection that can take a request now.
    fn checkout(&self) -> Option<SendRequest<RequestBody>> {
        let mut idle = self.idle.lock().expect("pool lock");
        while let Some((sender, since)) = idle.pop() {
            if sender.is_ready() && since.elapsed() < self.idle_timeout {
                return Some(sender);
            }
        }
        None
    }

    fn put(&self, sender: SendRequest<RequestBody>) {
        if !sender.is_ready() {
            return;
        }
        let mut idle = self.idle.lock().expect("pool lock");
        if idle.len() < MAX_IDLE {
            idle.push((sender, Instant::now()));
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<SendRequest<RequestBody>, PoolError> {
        self.reaper.call_once(|| spawn_reaper(Arc::downgrade(self), self.idle_timeout));
        let stream = match tokio::time::timeout(self.connect_timeout, tokio::net::TcpStream::connect(&self.addr)).await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(PoolError::Connect(format!("tcp connect error: {e}"))),
            Err(_) => {
                return Err(PoolError::Connect(format!("tcp connect timed out after {:?}", self.connect_timeout)));
            }
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| PoolError::Connect(e.to_string()))?;
        let addr = self.addr.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(upstream = %addr, error = %e, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }
}

/// Closes connections idle for longer than `idle_timeout`, until the pool is gone.
fn spawn_reaper(pool: Weak<H1Pool>, idle_timeout: Duration) {
    every_third_of(idle_timeout, pool, move |pool| {
        pool.idle.lock().expect("pool lock").retain(|(s, since)| since.elapsed() < idle_timeout && !s.is_closed());
    });
}

/// Runs `sweep` on a pool three times per `idle_timeout` (so no connection
/// outlives it by more than a third) until the pool is gone.
pub(super) fn every_third_of<P: Send + Sync + 'static>(
    idle_timeout: Duration,
    pool: Weak<P>,
    sweep: impl Fn(&P) + Send + 'static,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(idle_timeout / 3);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else { return };
            sweep(&pool);
        }
    });
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
