//! A small HTTP/1.1 load generator and upstream shared by the end-to-end
//! benches (`e2e`).
//!
//! - [`open_loop`] sends requests on a fixed schedule (request `i` is due at
//!   `start + i / rate`) over a pool of keep-alive connections and times each
//!   one from its *intended* send time, as wrk2 does, so a stalled server
//!   cannot hide its stall by slowing the generator (coordinated omission).
//!   Waiting for a due time sleeps until the last 2 ms and then yields in a
//!   loop, so sends leave within a few microseconds of their due time
//!   rather than tokio's millisecond timer granularity.
//! - [`closed_loop`] hammers a path from N connections as fast as answers
//!   come back and counts statuses.
//! - [`upstream`] is a minimal hyper server that answers `ok`, counts
//!   requests under `/rate`, and holds requests under `/gauge` for 50 ms
//!   while tracking the most it had in flight at once; with
//!   [`Seen::quota`] set, its answers carry a quota and a cost in headers.
//!
//! Latencies are kept exactly (one `u64` of nanoseconds per request; a
//! 10 s run at 50k req/s is 4 MB), so percentiles need no histogram error.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::TokioIo;

/// What the upstream saw.
#[derive(Default)]
pub struct Seen {
    pub total: AtomicU64,
    pub rate: AtomicU64,
    pub gauge_now: AtomicI64,
    pub gauge_max: AtomicI64,
    /// TLS upstreams: connections accepted, open now, and handshakes by kind.
    pub conns: AtomicU64,
    pub open: AtomicI64,
    pub full: AtomicU64,
    pub resumed: AtomicU64,
    /// Connections that chose h2 in ALPN.
    pub h2: AtomicU64,
    /// Answers carry GitHub's quota headers (`x-ratelimit-*`, a quota far
    /// from spent, one less remaining with each answer) and `x-usage: 2`
    /// (a cost settled above the 1 charged at admission).
    pub quota: AtomicBool,
}

/// TLS counters at one moment; [`Seen::tls`].
#[derive(Clone, Copy, Default, Debug)]
pub struct TlsCount {
    pub conns: u64,
    pub full: u64,
    pub resumed: u64,
    pub h2: u64,
}

impl std::ops::Sub for TlsCount {
    type Output = TlsCount;
    fn sub(self, b: TlsCount) -> TlsCount {
        TlsCount {
            conns: self.conns - b.conns,
            full: self.full - b.full,
            resumed: self.resumed - b.resumed,
            h2: self.h2 - b.h2,
        }
    }
}

impl std::ops::AddAssign for TlsCount {
    fn add_assign(&mut self, b: TlsCount) {
        self.conns += b.conns;
        self.full += b.full;
        self.resumed += b.resumed;
        self.h2 += b.h2;
    }
}

impl Seen {
    pub fn reset(&self) {
        self.rate.store(0, Ordering::SeqCst);
        self.gauge_max.store(0, Ordering::SeqCst);
    }

    pub fn tls(&self) -> TlsCount {
        TlsCount {
            conns: self.conns.load(Ordering::SeqCst),
            full: self.full.load(Ordering::SeqCst),
            resumed: self.resumed.load(Ordering::SeqCst),
            h2: self.h2.load(Ordering::SeqCst),
        }
    }
}

/// How long the upstream holds a `/gauge` request.
pub const GAUGE_HOLD: Duration = Duration::from_millis(50);

/// The upstream's answer: `ok`, counting `/rate` and holding `/gauge`.
async fn answer(req: Request<hyper::body::Incoming>, seen: Arc<Seen>) -> Result<Response<Full<Bytes>>, Infallible> {
    let n = seen.total.fetch_add(1, Ordering::Relaxed);
    if seen.quota.load(Ordering::Relaxed) {
        return Ok(with_quota(n));
    }
    let path = req.uri().path();
    if path.starts_with("/rate") {
        seen.rate.fetch_add(1, Ordering::Relaxed);
    } else if path.starts_with("/gauge") {
        let now = seen.gauge_now.fetch_add(1, Ordering::SeqCst) + 1;
        seen.gauge_max.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(GAUGE_HOLD).await;
        seen.gauge_now.fetch_sub(1, Ordering::SeqCst);
    }
    Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
}

/// `ok`, with GitHub's quota headers (a billion an hour, `n` used) and a
/// cost of 2 in `x-usage`.
fn with_quota(n: u64) -> Response<Full<Bytes>> {
    const LIMIT: u64 = 1_000_000_000;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Response::builder()
        .header("x-ratelimit-limit", LIMIT)
        .header("x-ratelimit-remaining", LIMIT.saturating_sub(n + 1))
        .header("x-ratelimit-reset", now.as_secs() + 3600)
        .header("x-ratelimit-used", n + 1)
        .header("x-ratelimit-resource", "core")
        .header("x-usage", "2")
        .body(Full::new(Bytes::from_static(b"ok")))
        .unwrap()
}

/// Starts the upstream on 127.0.0.1:0 on the current runtime.
pub async fn upstream() -> (SocketAddr, Arc<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let _ = s.set_nodelay(true);
            let seen = s2.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| answer(req, seen.clone()));
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    (addr, seen)
}

/// A CA's PEM and a certificate it signed for `localhost` and 127.0.0.1, with its key.
pub struct Pki {
    pub ca_pem: String,
    cert: rustls::pki_types::CertificateDer<'static>,
    key: Vec<u8>,
}

impl Pki {
    pub fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "usher bench CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        Pki { ca_pem: ca_cert.pem(), cert: leaf.der().clone(), key: key.serialize_der() }
    }
}

/// The same upstream over TLS 1.3 on 127.0.0.1:0, with session tickets
/// (resumption) and ALPN `http/1.1`, or `h2` and `http/1.1` when `h2`;
/// [`Seen`] counts connections and full and resumed handshakes.
pub async fn tls_upstream(pki: &Pki, h2: bool) -> (SocketAddr, Arc<Seen>) {
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(pki.key.clone().into());
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![pki.cert.clone()], key)
        .unwrap();
    cfg.ticketer = rustls::crypto::ring::Ticketer::new().unwrap();
    cfg.alpn_protocols = if h2 { vec![b"h2".to_vec(), b"http/1.1".to_vec()] } else { vec![b"http/1.1".to_vec()] };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let _ = s.set_nodelay(true);
            let (seen, acceptor) = (s2.clone(), acceptor.clone());
            tokio::spawn(async move {
                seen.conns.fetch_add(1, Ordering::SeqCst);
                let Ok(tls) = acceptor.accept(s).await else { return };
                let (_, conn) = tls.get_ref();
                match conn.handshake_kind() {
                    Some(rustls::HandshakeKind::Resumed) => seen.resumed.fetch_add(1, Ordering::SeqCst),
                    _ => seen.full.fetch_add(1, Ordering::SeqCst),
                };
                let is_h2 = conn.alpn_protocol() == Some(b"h2");
                if is_h2 {
                    seen.h2.fetch_add(1, Ordering::SeqCst);
                }
                seen.open.fetch_add(1, Ordering::SeqCst);
                let s3 = seen.clone();
                let svc = hyper::service::service_fn(move |req| answer(req, s3.clone()));
                let io = TokioIo::new(tls);
                let _ = if is_h2 {
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .max_concurrent_streams(1000)
                        .serve_connection(io, svc)
                        .await
                } else {
                    hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await
                };
                seen.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (addr, seen)
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn connect(addr: SocketAddr) -> std::io::Result<Sender> {
    let s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    Ok(send)
}

fn request(path: &str) -> Request<Empty<Bytes>> {
    Request::get(path).header("host", "bench.test").body(Empty::new()).unwrap()
}

/// Sends one request; `Ok(status)` once the whole body has arrived.
async fn once(send: &mut Sender, path: &str) -> Result<u16, ()> {
    send_one(send, request(path)).await
}

async fn send_one(send: &mut Sender, req: Request<Empty<Bytes>>) -> Result<u16, ()> {
    send.ready().await.map_err(|_| ())?;
    let resp = send.send_request(req).await.map_err(|_| ())?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await.map_err(|_| ())?;
    Ok(status)
}

/// Sleeps until `t`, then spins (yielding to other tasks) for the last stretch.
pub async fn wait_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        if t - now > Duration::from_millis(2) {
            tokio::time::sleep_until((t - Duration::from_micros(1500)).into()).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// The result of one open-loop run.
pub struct OpenLoop {
    /// Latency of each successful (2xx) request from its intended send time, sorted.
    pub lat_ns: Vec<u64>,
    /// Requests that failed or were not 2xx.
    pub errors: u64,
    /// Requests scheduled.
    pub scheduled: u64,
    /// Wall time from the first due time to the last answer.
    pub wall: Duration,
}

impl OpenLoop {
    /// The `p` quantile in microseconds (NaN when nothing succeeded).
    pub fn pct_us(&self, p: f64) -> f64 {
        if self.lat_ns.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_ns.len() as f64 * p) as usize).min(self.lat_ns.len() - 1);
        self.lat_ns[i] as f64 / 1000.0
    }
}

/// Open-loop load: `rate` requests per second for `dur` over `conns`
/// keep-alive connections to `addr`. A request that finds every connection
/// busy waits for one, and that wait counts in its latency.
pub async fn open_loop(addr: SocketAddr, path: &'static str, rate: f64, dur: Duration, conns: usize) -> OpenLoop {
    open_loop_keyed(addr, path, rate, dur, conns, None).await
}

/// [`open_loop`], with request `i` naming tenant `{prefix}{i}` in an
/// `x-tenant` field when `tenants` is `Some(prefix)`.
pub async fn open_loop_keyed(
    addr: SocketAddr,
    path: &'static str,
    rate: f64,
    dur: Duration,
    conns: usize,
    tenants: Option<Arc<str>>,
) -> OpenLoop {
    let n = (rate * dur.as_secs_f64()).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let (idle_tx, mut idle_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let mut txs = Vec::with_capacity(conns);
    let mut workers = Vec::with_capacity(conns);
    for id in 0..conns {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, u64)>(1);
        txs.push(tx);
        let idle_tx = idle_tx.clone();
        let tenants = tenants.clone();
        let mut send = connect(addr).await.ok();
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            let _ = idle_tx.send(id);
            while let Some((due, i)) = rx.recv().await {
                if send.is_none() {
                    send = connect(addr).await.ok();
                }
                let mut req = request(path);
                if let Some(prefix) = &tenants {
                    req.headers_mut().insert("x-tenant", format!("{prefix}{i}").parse().unwrap());
                }
                let ok = match send.as_mut() {
                    Some(s) => send_one(s, req).await,
                    None => Err(()),
                };
                match ok {
                    Ok(status) if (200..300).contains(&status) => lat.push(due.elapsed().as_nanos() as u64),
                    Ok(_) => errors += 1,
                    Err(()) => {
                        errors += 1;
                        send = None;
                    }
                }
                let _ = idle_tx.send(id);
            }
            (lat, errors)
        }));
    }
    drop(idle_tx);
    let start = Instant::now() + Duration::from_millis(5);
    let mut abandoned = 0;
    for i in 0..n {
        let due = start + interval.mul_f64(i as f64);
        wait_until(due).await;
        let id = idle_rx.recv().await.expect("a worker is alive");
        // More than a second behind schedule: the target is saturated; stop
        // rather than let the run grow without bound, and count the rest as errors.
        if due.elapsed() > Duration::from_secs(1) {
            abandoned = n - i;
            break;
        }
        txs[id].send((due, i)).await.expect("worker alive");
    }
    drop(txs);
    let mut out =
        OpenLoop { lat_ns: Vec::with_capacity(n as usize), errors: abandoned, scheduled: n, wall: Duration::ZERO };
    for w in workers {
        let (lat, errors) = w.await.unwrap();
        out.lat_ns.extend(lat);
        out.errors += errors;
    }
    out.wall = start.elapsed();
    out.lat_ns.sort_unstable();
    out
}

/// The result of one closed-loop run.
#[derive(Default, Debug)]
pub struct ClosedLoop {
    pub ok: u64,
    pub refused: u64,
    pub other: u64,
    pub wall: Duration,
}

/// Closed-loop load: `conns` connections each send the next request as soon
/// as the previous answer has arrived, for `dur`.
pub async fn closed_loop(addr: SocketAddr, path: &'static str, conns: usize, dur: Duration) -> ClosedLoop {
    let start = Instant::now();
    let end = start + dur;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        tasks.push(tokio::spawn(async move {
            let mut r = ClosedLoop::default();
            let mut send = None;
            while Instant::now() < end {
                if send.is_none() {
                    send = connect(addr).await.ok();
                }
                let Some(s) = send.as_mut() else {
                    r.other += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                match once(s, path).await {
                    Ok(s) if (200..300).contains(&s) => r.ok += 1,
                    Ok(429) | Ok(503) => r.refused += 1,
                    Ok(_) => r.other += 1,
                    Err(()) => {
                        r.other += 1;
                        send = None;
                    }
                }
            }
            r
        }));
    }
    let mut total = ClosedLoop::default();
    for t in tasks {
        let r = t.await.unwrap();
        total.ok += r.ok;
        total.refused += r.refused;
        total.other += r.other;
    }
    total.wall = start.elapsed();
    total
}

/// Process figures from /proc.
pub mod procfs {
    /// utime + stime of `pid` in milliseconds (assumes 100 clock ticks per second, Linux's USER_HZ).
    pub fn cpu_ms(pid: u32) -> Option<u64> {
        cpu_split_ms(pid).map(|(user, sys)| user + sys)
    }

    /// utime and stime of `pid` apart, in milliseconds: user space against the kernel.
    pub fn cpu_split_ms(pid: u32) -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let after = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        Some((f.get(11)?.parse::<u64>().ok()? * 10, f.get(12)?.parse::<u64>().ok()? * 10))
    }

    /// A `/proc/PID/status` field in kB (`VmRSS`, `VmHWM`), as MB.
    pub fn status_mb(pid: u32, field: &str) -> Option<f64> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = s.lines().find(|l| l.starts_with(field))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    }

    /// Open file descriptors of `pid`.
    pub fn fds(pid: u32) -> Option<usize> {
        Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
    }

    /// CPU time (ns, from `schedstat`) and context switches (voluntary and
    /// not) of every thread of `pid`, summed.
    pub fn sched(pid: u32) -> Option<(u64, u64)> {
        let mut total = (0, 0);
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
            let path = task.path();
            let ns = std::fs::read_to_string(path.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
            let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
            let switches: u64 = status
                .lines()
                .filter(|l| l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            total = (total.0 + ns, total.1 + switches);
        }
        Some(total)
    }

    /// Threads of `pid`.
    pub fn threads(pid: u32) -> Option<usize> {
        Some(std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count())
    }

    /// The first child of `pid` (nginx's worker under its master).
    pub fn first_child(pid: u32) -> Option<u32> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
        s.split_whitespace().next()?.parse().ok()
    }
}
