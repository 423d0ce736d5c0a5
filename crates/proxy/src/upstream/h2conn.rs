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
//! a request the upstream did not process goes out once more. Requests that
//! wait while a connection is made share its outcome: its failure too, so a
//! burst to a dead upstream fails within one `connect_timeout`, not one
//! after another. Nothing runs while the connection is idle; one idle for
//! longer than the upstream pools' idle timeout is replaced by the next
//! request rather than trusted (a middlebox may have dropped it silently),
//! and closes. One in use that went silent is found when a request on it
//! times out: a PING it does not answer within [`PING_TIMEOUT`] retires it
//! (new requests open a new connection), and [`PING_GRACE`] later closes it. Over TLS, ALPN offers `h2` and `http/1.1`: an upstream that
//! picks `http/1.1` gets its connection handed back for the HTTP/1.1 pool.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Request, Response};

use crate::upstream::pool::{Stream, Tls, dial};
use usher_core::error::error_chain;

/// Streams opened before the peer's SETTINGS say how many it takes (hyper's figure).
const INITIAL_MAX_SEND_STREAMS: usize = 100;
/// Flow-control windows and limits, as hyper's h2 client sets them.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// Largest response head accepted (decoded), as on the native HTTP/1.1 path.
const MAX_HEADER_LIST: u32 = 256 * 1024;
/// How long a connection under suspicion (a request on it timed out) has
/// to answer a PING before it takes no new requests.
pub(crate) const PING_TIMEOUT: Duration = Duration::from_secs(5);
/// How much longer it has before it is closed, failing the streams still on it.
pub(crate) const PING_GRACE: Duration = Duration::from_secs(30);

/// Why an exchange failed.
pub(crate) enum H2Error {
    /// No connection could be made.
    Connect(String),
    /// The connection or the stream failed.
    Stream(String),
    /// The upstream picks `http/1.1` in ALPN: the new connection, for the
    /// upstream's HTTP/1.1 pool (`None` for a request that waited while
    /// another one learned it: it dials on the pool itself), and the
    /// request, never sent, to send there.
    Http1(Option<Stream>, Box<(Request<()>, Bytes)>),
}

/// Why no connection is at hand: as [`H2Error`], before a request is attached.
enum NoSender {
    Connect(String),
    Http1(Option<Stream>),
}

/// The connection in use.
struct Current {
    sender: SendRequest<Bytes>,
    /// Asks the connection's task to check it with a PING.
    check: std::sync::Arc<tokio::sync::Notify>,
    /// Set by the connection's task when it failed the check: no new requests.
    retired: std::sync::Arc<AtomicBool>,
    /// When a request last took it.
    used: Instant,
    /// Which connection this is, so that a late failure of an old one does
    /// not drop its successor.
    generation: u64,
}

/// The upstream's multiplexed connection, opened when first needed.
pub(crate) struct H2Upstream {
    addr: String,
    tls: Option<Tls>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    current: Mutex<Option<Current>>,
    generations: AtomicU64,
    /// Held while a connection is being made, so that a burst of first
    /// requests makes one, not one each.
    dialing: tokio::sync::Mutex<()>,
    /// The last failed attempt to connect, and when: requests that waited
    /// for it get its answer rather than each trying again in turn.
    failed: Mutex<Option<(Instant, String)>>,
    /// The upstream answered ALPN with `http/1.1`.
    http1: AtomicBool,
}

impl H2Upstream {
    /// `tls` offers ALPN `h2` (and `http/1.1`, whose connection a request
    /// gets back, see [`H2Error::Http1`]); `None` for h2c (prior knowledge).
    pub(crate) fn new(addr: String, tls: Option<Tls>, connect_timeout: Duration, idle_timeout: Duration) -> Self {
        H2Upstream {
            addr,
            tls,
            connect_timeout,
            idle_timeout,
            current: Mutex::new(None),
            generations: AtomicU64::new(0),
            dialing: tokio::sync::Mutex::new(()),
            failed: Mutex::new(None),
            http1: AtomicBool::new(false),
        }
    }

    /// Sends `req` with `body` (`end_of_stream` with its head when empty) and
    /// waits for the answer's head. A request the upstream did not process
    /// goes out once more: one never sent (on a new connection: its own had
    /// closed), one refused with `REFUSED_STREAM`, and an `idempotent` one
    /// cut off by the upstream's GOAWAY (on a new connection).
    pub(crate) async fn send(
        &self,
        req: Request<()>,
        body: Bytes,
        idempotent: bool,
    ) -> Result<Response<h2::RecvStream>, H2Error> {
        let mut again = Some(req.clone());
        let mut req = req;
        loop {
            let (sender, generation) = match self.sender().await {
                Ok(s) => s,
                Err(NoSender::Connect(e)) => return Err(H2Error::Connect(e)),
                Err(NoSender::Http1(stream)) => return Err(H2Error::Http1(stream, Box::new((req, body)))),
            };
            let e = match exchange(sender, req, body.clone(), self.idle_timeout).await {
                Ok(resp) => return Ok(resp),
                Err(e) => e,
            };
            if e.error.is_go_away() || e.error.is_io() || !e.sent {
                self.forget(generation);
            }
            let unprocessed = !e.sent
                || (e.error.is_remote() && e.error.reason() == Some(h2::Reason::REFUSED_STREAM))
                || (idempotent && e.error.is_go_away() && e.error.is_remote());
            match again.take() {
                Some(next) if unprocessed => {
                    tracing::debug!(upstream = %self.addr, error = %e.error, "h2 request not processed; sending it again");
                    req = next;
                }
                _ => return Err(H2Error::Stream(error_chain(&e.error))),
            }
        }
    }

    /// The connection's handle and generation (a new connection's when
    /// there is none, or it closed).
    #[allow(
        clippy::disallowed_methods,
        reason = "orders a failed dial before the requests that waited for it, in tokio's time like the connect timeout"
    )]
    async fn sender(&self) -> Result<(SendRequest<Bytes>, u64), NoSender> {
        if let Some(s) = self.usable() {
            return Ok(s);
        }
        if self.http1.load(Ordering::Relaxed) {
            return Err(NoSender::Http1(None));
        }
        let asked = Instant::now();
        let _dialing = self.dialing.lock().await;
        // Another request may have made one meanwhile, or failed to.
        if let Some(s) = self.usable() {
            return Ok(s);
        }
        if self.http1.load(Ordering::Relaxed) {
            return Err(NoSender::Http1(None));
        }
        if let Some((at, e)) = self.failed.lock().expect("h2 upstream lock").as_ref()
            && *at >= asked
        {
            return Err(NoSender::Connect(e.clone()));
        }
        // One deadline for the whole of it: TCP, TLS and the h2 handshake.
        let made = match tokio::time::timeout(self.connect_timeout, self.connect()).await {
            Ok(made) => made,
            Err(_) => Err(NoSender::Connect(format!("connect timed out after {:?}", self.connect_timeout))),
        };
        if let Err(NoSender::Connect(e)) = &made {
            *self.failed.lock().expect("h2 upstream lock") = Some((Instant::now(), e.clone()));
        }
        made
    }

    /// A new connection (TCP, TLS, the h2 handshake), made the current one.
    #[allow(
        clippy::disallowed_methods,
        reason = "a connection's idle time runs in tokio's time, like its other timers"
    )]
    async fn connect(&self) -> Result<(SendRequest<Bytes>, u64), NoSender> {
        let io = dial(&self.addr, self.tls.as_ref(), self.connect_timeout).await.map_err(NoSender::Connect)?;
        if let Stream::Tls(tls) = &io
            && tls.get_ref().1.alpn_protocol() != Some(b"h2")
        {
            self.http1.store(true, Ordering::Relaxed);
            return Err(NoSender::Http1(Some(io)));
        }
        let (sender, conn) = h2::client::Builder::new()
            .enable_push(false)
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|e| NoSender::Connect(format!("h2 handshake: {}", error_chain(&e))))?;
        let check = std::sync::Arc::new(tokio::sync::Notify::new());
        let retired = std::sync::Arc::new(AtomicBool::new(false));
        tokio::spawn(drive(conn, self.addr.clone(), check.clone(), retired.clone()));
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        *self.current.lock().expect("h2 upstream lock") =
            Some(Current { sender: sender.clone(), check, retired, used: Instant::now(), generation });
        *self.failed.lock().expect("h2 upstream lock") = None;
        Ok((sender, generation))
    }

    /// The current connection's handle and generation, unless it has closed or idled too long.
    #[allow(
        clippy::disallowed_methods,
        reason = "a connection's idle time runs in tokio's time, like its other timers"
    )]
    fn usable(&self) -> Option<(SendRequest<Bytes>, u64)> {
        let now = Instant::now();
        let mut current = self.current.lock().expect("h2 upstream lock");
        let c = current.as_mut()?;
        let mut s = c.sender.clone();
        // A closed connection says so at once; one at its stream limit is still usable (the request waits).
        let open = !matches!(
            s.poll_ready(&mut std::task::Context::from_waker(std::task::Waker::noop())),
            std::task::Poll::Ready(Err(_))
        );
        if open && !c.retired.load(Ordering::Relaxed) && now.duration_since(c.used) < self.idle_timeout {
            c.used = now;
            Some((s, c.generation))
        } else {
            // Dropped: once its last stream ends, the connection closes.
            *current = None;
            None
        }
    }

    /// A request on the current connection got no answer within the
    /// upstream's `timeout`: the connection's task sends a PING, and retires
    /// the connection if no answer comes within [`PING_TIMEOUT`] (see
    /// `drive`), so that later requests do not go on waiting on a
    /// connection a middlebox or a frozen upstream silently dropped.
    /// Nothing else times an open connection: nothing runs while it is idle.
    pub(crate) fn timed_out(&self) {
        if let Some(c) = self.current.lock().expect("h2 upstream lock").as_ref() {
            c.check.notify_one();
        }
    }

    /// Drops connection `generation`'s handle if it is still the current
    /// one: the next request makes a new one.
    fn forget(&self, generation: u64) {
        let mut current = self.current.lock().expect("h2 upstream lock");
        if current.as_ref().is_some_and(|c| c.generation == generation) {
            *current = None;
        }
    }
}

/// Drives a connection until it ends; when asked (see
/// [`H2Upstream::timed_out`]), checks it with a PING. No answer within
/// [`PING_TIMEOUT`]: the connection takes no new requests (`retired`; the
/// next one opens a new connection), and the streams still on it go on,
/// since a busy upstream on a slow link may answer the PING late, behind
/// the data it is sending. Still no answer [`PING_GRACE`] later: the
/// connection is dropped, which fails those streams at once. Checks are at
/// most one per [`PING_TIMEOUT`] (timeouts that come together make one).
#[allow(clippy::disallowed_methods, reason = "PING checks are spaced in tokio's time, like the PING timeouts")]
async fn drive(
    mut conn: h2::client::Connection<Stream, Bytes>,
    addr: String,
    check: std::sync::Arc<tokio::sync::Notify>,
    retired: std::sync::Arc<AtomicBool>,
) {
    let mut pinger = conn.ping_pong();
    let mut last_check: Option<Instant> = None;
    let ended = loop {
        tokio::select! {
            r = &mut conn => break r,
            () = check.notified() => {}
        }
        if last_check.is_some_and(|t| t.elapsed() < PING_TIMEOUT) {
            continue;
        }
        last_check = Some(Instant::now());
        let Some(pinger) = pinger.as_mut() else { continue };
        let mut pong = std::pin::pin!(pinger.ping(h2::Ping::opaque()));
        let first = tokio::time::sleep(PING_TIMEOUT);
        let answered = tokio::select! {
            r = &mut conn => break r,
            answered = &mut pong => Some(answered),
            () = first => None,
        };
        let answered = match answered {
            Some(a) => a,
            None => {
                retired.store(true, Ordering::Relaxed);
                tracing::warn!(
                    upstream = %addr,
                    "h2 upstream connection did not answer a PING within {PING_TIMEOUT:?} after a request on it timed out; \
                     new requests go on a new connection"
                );
                tokio::select! {
                    r = &mut conn => break r,
                    answered = &mut pong => answered,
                    () = tokio::time::sleep(PING_GRACE) => {
                        tracing::warn!(upstream = %addr, "h2 upstream connection still silent {PING_GRACE:?} later; closed");
                        return;
                    }
                }
            }
        };
        match answered {
            Ok(_) => tracing::debug!(upstream = %addr, "h2 upstream connection answered a PING after a timeout"),
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = ended {
        tracing::debug!(upstream = %addr, error = %e, "h2 upstream connection ended");
    }
}

/// An exchange's failure, and whether any of the request was sent.
struct Failed {
    error: h2::Error,
    sent: bool,
}

/// One exchange on `sender`'s connection: the head, the body, and the
/// answer's head. A body the peer's windows take at once goes with the head;
/// the rest of a larger one is sent by a task of its own (for at most
/// `limit`), so an upstream that answers before reading it all still gets
/// it all, as with hyper's client.
async fn exchange(
    sender: SendRequest<Bytes>,
    req: Request<()>,
    body: Bytes,
    limit: Duration,
) -> Result<Response<h2::RecvStream>, Failed> {
    let unsent = |error| Failed { error, sent: false };
    let mut sender = sender.ready().await.map_err(unsent)?;
    let (response, mut stream) = sender.send_request(req, body.is_empty()).map_err(unsent)?;
    if !body.is_empty() {
        stream.reserve_capacity(body.len());
        if stream.capacity() >= body.len() {
            stream.send_data(body, true).map_err(|error| Failed { error, sent: true })?;
        } else {
            tokio::spawn(async move {
                match tokio::time::timeout(limit, send_body(&mut stream, body)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "h2 request body not sent whole"),
                    Err(_) => stream.send_reset(h2::Reason::CANCEL),
                }
            });
        }
    }
    response.await.map_err(|error| Failed { error, sent: true })
}

/// Sends `body` on `stream`, as much at a time as the peer's window allows.
async fn send_body(stream: &mut h2::SendStream<Bytes>, mut body: Bytes) -> Result<(), h2::Error> {
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

    /// A response body that is one piece of data, sent when it comes.
    struct Later(Option<tokio::sync::oneshot::Receiver<Bytes>>);

    impl hyper::body::Body for Later {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            let Some(rx) = self.0.as_mut() else { return std::task::Poll::Ready(None) };
            let got = std::task::ready!(std::pin::Pin::new(rx).poll(cx));
            self.0 = None;
            std::task::Poll::Ready(got.ok().map(|b| Ok(hyper::body::Frame::data(b))))
        }
    }

    /// An h2c server on 127.0.0.1:0 that answers with the request body's
    /// length: at `/early`, with its head at once and the length once the
    /// whole body is in; elsewhere once the whole body is in. Counts its connections.
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
                        let early = req.uri().path() == "/early";
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        let reading = async move {
                            let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                            let _ = tx.send(Bytes::from(body.len().to_string()));
                        };
                        if early {
                            tokio::spawn(reading);
                        } else {
                            reading.await;
                        }
                        Ok::<_, hyper::Error>(Response::new(Later(Some(rx))))
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

        // An answer whose head comes before the upstream read the body: the
        // rest of a body past the stream's first window still goes out.
        let body = Bytes::from(vec![b'y'; 200 * 1024]);
        let req = Request::post("http://up.test/early").body(()).unwrap();
        let resp = up.send(req, body, false).await.ok().unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), text(resp)).await.expect("the whole body was sent");
        assert_eq!(got, (200 * 1024).to_string());
    }

    /// A listener on 127.0.0.1:0 that counts the connections it accepts and
    /// holds them open, saying nothing (after the TLS handshake, with `tls`).
    async fn holding_listener(tls: Option<tokio_rustls::TlsAcceptor>) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns = Arc::new(AtomicUsize::new(0));
        let counted = conns.clone();
        tokio::spawn(async move {
            let (mut plain, mut secured) = (Vec::new(), Vec::new());
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                match &tls {
                    None => plain.push(stream),
                    Some(acceptor) => secured.extend(acceptor.accept(stream).await.ok()),
                }
            }
        });
        (addr, conns)
    }

    /// A burst of requests to an upstream that accepts TCP and then says
    /// nothing (the TLS handshake never ends) all get the first attempt's
    /// failure, rather than each trying again after the one before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_share_a_failed_connect() {
        let (addr, conns) = holding_listener(None).await;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let tls = Tls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            name: rustls::pki_types::ServerName::try_from("localhost").unwrap(),
        };
        let up = Arc::new(H2Upstream::new(addr, Some(tls), Duration::from_millis(300), Duration::from_secs(90)));
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let up = up.clone();
            burst.spawn(async move {
                let req = Request::get("https://localhost/").body(()).unwrap();
                match up.send(req, Bytes::new(), true).await {
                    Err(H2Error::Connect(e)) => e,
                    _ => panic!("not a connect failure"),
                }
            });
        }
        while let Some(e) = burst.join_next().await {
            assert!(e.unwrap().contains("timed out"));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1, "one attempt for the whole burst");
    }

    /// An upstream that answers ALPN with `http/1.1`: the first request gets
    /// the connection back (for the HTTP/1.1 pool); one after it is told at
    /// once, without another connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http1_alpn_answer_hands_its_connection_back_once() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap().self_signed(&key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let (addr, conns) = holding_listener(Some(tokio_rustls::TlsAcceptor::from(Arc::new(server)))).await;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let tls = Tls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
            name: rustls::pki_types::ServerName::try_from("localhost").unwrap(),
        };
        let up = H2Upstream::new(addr, Some(tls), Duration::from_secs(5), Duration::from_secs(90));
        let get = || Request::get("https://localhost/").body(()).unwrap();
        assert!(matches!(up.send(get(), Bytes::new(), true).await, Err(H2Error::Http1(Some(_), _))));
        assert!(matches!(up.send(get(), Bytes::new(), true).await, Err(H2Error::Http1(None, _))));
        assert_eq!(conns.load(Ordering::SeqCst), 1);
    }
}
