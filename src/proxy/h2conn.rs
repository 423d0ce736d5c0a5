//! An HTTP/2 upstream's one multiplexed connection for the native path
//! (h2c, or TLS with ALPN `h2`), driven with the `h2` crate directly.
//!
//! hyper's h2 client hands every request through a channel to its
//! connection task, which spawns a task per request to wait for the answer
//! and hand it back through another channel: three tasks and two hand-offs
//! per exchange. Here the client connection's task opens the stream itself
//! and waits on it; only the connection's own task (reading and writing
//! frames) is in between, as the protocol needs.
//!
//! One connection per upstream, opened by the first request and shared by
//! every later one (up to the peer's `SETTINGS_MAX_CONCURRENT_STREAMS`;
//! more wait for a stream to end). A connection that closed (the upstream
//! went away, sent GOAWAY, or idled it out) is replaced by the next request;
//! a request the upstream did not process goes out once more on a new one.
//! Nothing runs while the connection is idle; one idle for longer than the
//! upstream pools' idle timeout is replaced by the next request rather than
//! trusted (a middlebox may have dropped it silently), and closes.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Request, Response};

use super::pool::{Stream, Tls, dial};
use crate::error::error_chain;

/// Flow-control windows and limits, as hyper's h2 client sets them.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// Largest response head accepted (decoded), as on the native HTTP/1.1 path.
const MAX_HEADER_LIST: u32 = 256 * 1024;

/// Why an exchange failed.
pub enum H2Error {
    /// No connection could be made.
    Connect(String),
    /// The connection or the stream failed.
    Stream(String),
    /// The upstream picked `http/1.1` in ALPN: the new connection, for the
    /// upstream's HTTP/1.1 pool.
    Http1(Stream),
}

/// The upstream's multiplexed connection, opened when first needed.
pub struct H2Upstream {
    addr: String,
    tls: Option<Tls>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// The connection's handle, cloned per request, and when it was last used.
    current: Mutex<Option<(SendRequest<Bytes>, Instant)>>,
    /// Held while a connection is being made, so that a burst of first
    /// requests makes one, not one each.
    dialing: tokio::sync::Mutex<()>,
}

impl H2Upstream {
    /// `tls` offers ALPN `h2` (and `http/1.1`, whose connection a request
    /// gets back, see [`H2Error::Http1`]); `None` for h2c (prior knowledge).
    pub fn new(addr: String, tls: Option<Tls>, connect_timeout: Duration, idle_timeout: Duration) -> Self {
        H2Upstream {
            addr,
            tls,
            connect_timeout,
            idle_timeout,
            current: Mutex::new(None),
            dialing: tokio::sync::Mutex::new(()),
        }
    }

    /// Sends `req` with `body` (`end_of_stream` with its head when empty) and
    /// waits for the answer's head. A request the upstream did not process
    /// goes out once more on a new connection: one never sent (its
    /// connection had closed), one refused with `REFUSED_STREAM`, and an
    /// `idempotent` one cut off by the upstream's GOAWAY.
    pub async fn send(
        &self,
        req: Request<()>,
        body: Bytes,
        idempotent: bool,
    ) -> Result<Response<h2::RecvStream>, H2Error> {
        let mut again = Some(req.clone());
        let mut req = req;
        loop {
            let sender = self.sender().await?;
            let e = match exchange(sender, req, body.clone()).await {
                Ok(resp) => return Ok(resp),
                Err(e) => e,
            };
            let gone = e.error.is_go_away() || e.error.is_io() || !e.sent;
            if gone {
                self.forget();
            }
            let unprocessed = !e.sent
                || (e.error.is_remote() && e.error.reason() == Some(h2::Reason::REFUSED_STREAM))
                || (idempotent && e.error.is_go_away() && e.error.is_remote());
            match again.take() {
                Some(next) if unprocessed => {
                    tracing::debug!(upstream = %self.addr, error = %e.error, "h2 request not processed; sending it on a new connection");
                    req = next;
                }
                _ => return Err(H2Error::Stream(error_chain(&e.error))),
            }
        }
    }

    /// The connection's handle (a new connection's when there is none, or it closed).
    async fn sender(&self) -> Result<SendRequest<Bytes>, H2Error> {
        if let Some(s) = self.usable() {
            return Ok(s);
        }
        let _dialing = self.dialing.lock().await;
        // Another request may have made one meanwhile.
        if let Some(s) = self.usable() {
            return Ok(s);
        }
        let io = dial(&self.addr, self.tls.as_ref(), self.connect_timeout).await.map_err(H2Error::Connect)?;
        if let Stream::Tls(tls) = &io
            && tls.get_ref().1.alpn_protocol() != Some(b"h2")
        {
            return Err(H2Error::Http1(io));
        }
        let handshake = h2::client::Builder::new()
            .enable_push(false)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .handshake::<_, Bytes>(io);
        let (sender, conn) = tokio::time::timeout(self.connect_timeout, handshake)
            .await
            .map_err(|_| H2Error::Connect(format!("h2 handshake timed out after {:?}", self.connect_timeout)))?
            .map_err(|e| H2Error::Connect(format!("h2 handshake: {}", error_chain(&e))))?;
        let addr = self.addr.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(upstream = %addr, error = %e, "h2 upstream connection ended");
            }
        });
        *self.current.lock().expect("h2 upstream lock") = Some((sender.clone(), Instant::now()));
        Ok(sender)
    }

    /// The current connection's handle, unless it has closed or idled too long.
    fn usable(&self) -> Option<SendRequest<Bytes>> {
        let now = Instant::now();
        let mut current = self.current.lock().expect("h2 upstream lock");
        let (sender, used) = current.as_mut()?;
        let mut s = sender.clone();
        // A closed connection says so at once; one at its stream limit is still usable (the request waits).
        let open = !matches!(
            s.poll_ready(&mut std::task::Context::from_waker(std::task::Waker::noop())),
            std::task::Poll::Ready(Err(_))
        );
        if open && now.duration_since(*used) < self.idle_timeout {
            *used = now;
            Some(s)
        } else {
            // Dropped: once its last stream ends, the connection closes.
            *current = None;
            None
        }
    }

    /// Drops the current connection's handle: the next request makes a new one.
    fn forget(&self) {
        *self.current.lock().expect("h2 upstream lock") = None;
    }
}

/// An exchange's failure, and whether any of the request was sent.
struct Failed {
    error: h2::Error,
    sent: bool,
}

/// One exchange on `sender`'s connection: the head, the body (if any, as
/// flow control lets it go), and the answer's head. The body is sent while
/// the answer is awaited, so an upstream that answers without reading it
/// all is not waited for.
async fn exchange(
    sender: SendRequest<Bytes>,
    req: Request<()>,
    body: Bytes,
) -> Result<Response<h2::RecvStream>, Failed> {
    let unsent = |error| Failed { error, sent: false };
    let sent = |error| Failed { error, sent: true };
    let mut sender = sender.ready().await.map_err(unsent)?;
    let (response, stream) = sender.send_request(req, body.is_empty()).map_err(unsent)?;
    if body.is_empty() {
        return response.await.map_err(sent);
    }
    let mut response = std::pin::pin!(response);
    tokio::select! {
        biased;
        r = &mut response => r.map_err(sent),
        done = send_body(stream, body) => {
            done.map_err(sent)?;
            response.await.map_err(sent)
        }
    }
}

/// Sends `body` on `stream`, as much at a time as the peer's window allows.
async fn send_body(mut stream: h2::SendStream<Bytes>, mut body: Bytes) -> Result<(), h2::Error> {
    stream.reserve_capacity(body.len());
    while !body.is_empty() {
        let granted = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
            Some(Ok(n)) => n,
            Some(Err(e)) => return Err(e),
            // The stream was reset (the upstream answered and stopped reading).
            None => return Ok(()),
        };
        let chunk = body.split_to(granted.min(body.len()));
        stream.send_data(chunk, body.is_empty())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// An h2c server on 127.0.0.1:0 that answers with the request body's
    /// length; counts its connections.
    async fn server() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns = Arc::new(AtomicUsize::new(0));
        let counted = conns.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                        use http_body_util::BodyExt;
                        let body = req.into_body().collect().await?.to_bytes();
                        Ok::<_, hyper::Error>(Response::new(http_body_util::Full::new(Bytes::from(
                            body.len().to_string(),
                        ))))
                    });
                    let builder = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                    let _ = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
                });
            }
        });
        (addr, conns)
    }

    async fn text(resp: Response<h2::RecvStream>) -> String {
        let mut body = resp.into_body();
        let mut out = Vec::new();
        while let Some(data) = body.data().await {
            let data = data.unwrap();
            let _ = body.flow_control().release_capacity(data.len());
            out.extend_from_slice(&data);
        }
        String::from_utf8(out).unwrap()
    }

    /// Twenty first requests at once make one connection; a connection idle
    /// past the idle timeout is replaced by the next request; a body larger
    /// than the peer's first stream window (64 KiB) goes out whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_shares_one_connection_and_an_idle_one_is_replaced() {
        let (addr, conns) = server().await;
        let idle = Duration::from_millis(300);
        let up = Arc::new(H2Upstream::new(addr, None, Duration::from_secs(5), idle));
        let get = || Request::get("http://up.test/").body(()).unwrap();
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (up, req) = (up.clone(), get());
            burst.spawn(async move { text(up.send(req, Bytes::new(), true).await.ok().unwrap()).await });
        }
        while let Some(got) = burst.join_next().await {
            assert_eq!(got.unwrap(), "0");
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1, "one connection for the burst");

        // Idle for longer than the timeout: the next request opens a new one.
        tokio::time::sleep(idle + Duration::from_millis(200)).await;
        let body = Bytes::from(vec![b'x'; 100 * 1024]);
        let req = Request::post("http://up.test/").body(()).unwrap();
        assert_eq!(text(up.send(req, body, false).await.ok().unwrap()).await, (100 * 1024).to_string());
        assert_eq!(conns.load(Ordering::SeqCst), 2, "the idle connection was replaced");
    }
}
