//! Upstream faults through a real `usher proxy`: resets before and in the
//! middle of a body, slow headers, refused connections and untrusted TLS,
//! each a clear problem; then a storm of 10,000 requests with random faults
//! and abandoning clients, after which nothing is left in flight or waiting.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::upstream::{TestPki, Upstream, get, get_abs, h1, h2, read};
use support::{Usher, http_get, metric, write_file};

/// A hand-written HTTP/1.1 upstream that misbehaves as the request path says:
/// `/ok`, `/error` (500), `/stall` (never answers), `/reset` (RST after the
/// request), `/close` (FIN after the request), `/midbody` (a 200 with
/// `content-length: 1000`, 100 bytes, then RST), `/midbody-chunked` (one
/// chunk, then RST). Connections are kept alive after `/ok` and `/error`.
struct FaultyUpstream {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultyUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn faulty_upstream() -> FaultyUpstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicU64::new(0));
    let count = requests.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            tokio::spawn(serve_faulty(s, count.clone()));
        }
    });
    FaultyUpstream { addr, requests, task }
}

async fn serve_faulty(mut s: TcpStream, count: Arc<AtomicU64>) {
    let mut buf = Vec::new();
    loop {
        // One request head (the requests have no body).
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        buf.drain(..head_end);
        count.fetch_add(1, Ordering::SeqCst);
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
        let kind = path.rsplit('/').next().unwrap_or("");
        match kind {
            "error" => {
                let _ = s.write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom").await;
            }
            "stall" => {
                // Never answers; ends when the proxy gives up and closes.
                let mut sink = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(30), async {
                    while let Ok(n) = s.read(&mut sink).await {
                        if n == 0 {
                            break;
                        }
                    }
                })
                .await;
                return;
            }
            "reset" => {
                let _ = s.set_zero_linger();
                return;
            }
            "close" => return,
            "midbody" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n").await;
                let _ = s.write_all(&[b'x'; 100]).await;
                let _ = s.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = s.set_zero_linger();
                return;
            }
            "midbody-chunked" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n64\r\n").await;
                let _ = s.write_all(&[b'x'; 100]).await;
                let _ = s.write_all(b"\r\n").await;
                let _ = s.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = s.set_zero_linger();
                return;
            }
            _ => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
            }
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One request on a fresh connection: (status, content-type, body or the body's error).
async fn fetch(proxy: SocketAddr, path: &str) -> (u16, String, Result<String, String>) {
    let mut c = h1(proxy).await;
    c.ready().await.unwrap();
    let resp = c.send_request(get("app.local", path)).await.unwrap_or_else(|e| panic!("{path}: no response: {e}"));
    let status = resp.status().as_u16();
    let ct = resp.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .map_err(|e| e.to_string());
    (status, ct, body)
}

fn problem(path: &str, got: &(u16, String, Result<String, String>)) -> serde_json::Value {
    assert_eq!(got.1, "application/problem+json", "{path}: {got:?}");
    let body = got.2.as_ref().unwrap_or_else(|e| panic!("{path}: the problem body is whole: {e}"));
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_upstream_fault_is_a_clear_problem() {
    let dir = tempfile::tempdir().unwrap();
    let faulty = faulty_upstream().await;
    let pki = TestPki::new();
    let tls = Upstream::tls(&pki).await;
    let dead = free_port();
    let routes = format!(
        "upstreams:\n  faulty: {{ url: \"http://{}\", timeout: 500ms }}\n  gone: {{ url: \"http://127.0.0.1:{dead}\" }}\n  \
         untrusted: {{ url: \"https://localhost:{}\" }}\n\
         routes:\n  - {{ name: gone, match: {{ path_prefix: /gone }}, upstream: gone }}\n  \
         - {{ name: untrusted, match: {{ path_prefix: /tls }}, upstream: untrusted }}\n  \
         - {{ name: faulty, upstream: faulty }}\n",
        faulty.addr,
        tls.addr.port()
    );
    let p = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    let addr = p.addr("listen");

    // Slow headers: 504 after the route's timeout, not before.
    let t0 = Instant::now();
    let got = fetch(addr, "/stall").await;
    let took = t0.elapsed();
    assert_eq!(got.0, 504, "{got:?}");
    assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(10), "504 after the timeout: {took:?}");
    let pj = problem("/stall", &got);
    assert_eq!(pj["type"], "urn:usher:problem:upstream-timeout");
    assert_eq!(pj["upstream"], "faulty");
    assert!(pj["detail"].as_str().unwrap().contains("500ms"), "the detail names the timeout: {pj}");

    // Each 502 names the upstream and says what went wrong.
    for (path, upstream, kind, says) in [
        ("/reset", "faulty", "upstream-error", "reset"),
        ("/close", "faulty", "upstream-error", "closed"),
        ("/gone/x", "gone", "upstream-connect", "refused"),
        ("/tls/x", "untrusted", "upstream-connect", "certificate"),
    ] {
        let got = fetch(addr, path).await;
        assert_eq!(got.0, 502, "{path}: {got:?}");
        let pj = problem(path, &got);
        eprintln!("{path}: {pj}");
        assert_eq!(pj["type"], format!("urn:usher:problem:{kind}"), "{path}: {pj}");
        assert_eq!(pj["upstream"], upstream, "{path}: {pj}");
        assert_eq!(pj["status"], 502);
        let detail = pj["detail"].as_str().unwrap().to_lowercase();
        assert!(detail.contains(upstream) && detail.contains(says), "{path}: the detail says {says:?}: {detail}");
        assert!(!detail.contains("client error ("), "{path}: no client-library jargon: {detail}");
        if path.starts_with("/tls") {
            assert!(detail.contains("ca_file"), "the detail says what to do: {detail}");
        }
    }

    // A reset after the response headers cannot become a 502: the app sees
    // the body fail, never a short body that looks complete.
    for path in ["/midbody", "/midbody-chunked"] {
        let got = fetch(addr, path).await;
        assert_eq!(got.0, 200, "{path}: {got:?}");
        assert!(got.2.is_err(), "{path}: the truncated body ends in an error, not a clean end: {got:?}");
    }
    // Over HTTP/2 the stream is reset and the connection stays usable.
    let mut c2 = h2(addr).await;
    for path in ["/midbody", "/midbody-chunked"] {
        c2.ready().await.unwrap();
        let resp = c2.send_request(get_abs("app.local", path)).await;
        if let Ok(resp) = resp {
            assert_eq!(resp.status(), 200, "{path} over h2");
            assert!(resp.into_body().collect().await.is_err(), "{path} over h2: the body ends in an error");
        }
    }
    c2.ready().await.unwrap();
    let ok = read(c2.send_request(get_abs("app.local", "/ok")).await.unwrap()).await;
    assert_eq!(ok.status, 200, "the h2 connection survives its reset streams: {}", ok.text());
    // Nothing is left in flight.
    assert_eventually!(
        {
            let (_, m) = http_get(p.addr("admin"), "/metrics");
            ["faulty", "gone", "untrusted"]
                .iter()
                .all(|r| metric(&m, "usher_proxy_in_flight", &[("route", r)]).unwrap_or(0.0) == 0.0)
        },
        Duration::from_secs(5),
        "every request left flight"
    );
    assert!(faulty.requests.load(Ordering::SeqCst) >= 5);
    let (_, m) = http_get(p.addr("admin"), "/metrics");
    assert_eq!(
        metric(&m, "usher_proxy_response_body_errors_total", &[("route", "faulty")]),
        Some(4.0),
        "every cut body is counted (2 over HTTP/1.1, 2 over HTTP/2)"
    );
}

/// What one storm request asked the upstream to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Fault {
    Ok,
    Error,
    Stall,
    Reset,
    MidBody,
}

impl Fault {
    fn pick(rng: &mut impl Rng) -> Fault {
        match rng.random_range(0..100) {
            0..50 => Fault::Ok,
            50..65 => Fault::Error,
            65..75 => Fault::Stall,
            75..88 => Fault::Reset,
            _ => Fault::MidBody,
        }
    }

    fn path(self) -> &'static str {
        match self {
            Fault::Ok => "/ok",
            Fault::Error => "/error",
            Fault::Stall => "/stall",
            Fault::Reset => "/reset",
            Fault::MidBody => "/midbody",
        }
    }

    /// The status the app must see when the request is admitted.
    fn status(self) -> u16 {
        match self {
            Fault::Ok | Fault::MidBody => 200,
            Fault::Error => 500,
            Fault::Stall => 504,
            Fault::Reset => 502,
        }
    }
}

#[derive(Default)]
struct StormTally {
    sent: AtomicU64,
    expected: AtomicU64,
    refused: AtomicU64,
    abandoned: AtomicU64,
    body_errors: AtomicU64,
    wrong: std::sync::Mutex<Vec<String>>,
}

const STORM: u64 = 10_000;
const GAUGE: u64 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_storm_leaks_no_permit_and_no_waiter() {
    let dir = tempfile::tempdir().unwrap();
    let faulty = faulty_upstream().await;
    let routes = format!(
        "upstreams:\n  faulty: {{ url: \"http://{}\", timeout: 200ms }}\n\
         resources:\n  inflight: {{ kind: gauge, capacity: {GAUGE}, max_wait: 100ms }}\n  \
         api: {{ kind: rate, capacity: 5000, burst: 50, max_wait: 50ms }}\n\
         routes:\n  - {{ name: storm, upstream: faulty, resources: [api, inflight] }}\n",
        faulty.addr
    );
    let p = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    let addr = p.addr("listen");
    let tally = Arc::new(StormTally::default());
    let deadline = Instant::now() + Duration::from_secs(120);
    let seed: u64 = rand::random();
    eprintln!("storm seed {seed}");
    let mut workers = Vec::new();
    for w in 0..48u64 {
        let tally = tally.clone();
        workers.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ w);
            let mut conn = None;
            while tally.sent.fetch_add(1, Ordering::SeqCst) < STORM && Instant::now() < deadline {
                let fault = Fault::pick(&mut rng);
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => conn.insert(h1(addr).await),
                };
                if c.ready().await.is_err() {
                    // The proxy closed this connection after a failed body: not a request lost.
                    conn = None;
                    tally.sent.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                let req = get("app.local", fault.path());
                // One in seven clients gives up after a random moment and drops its connection.
                let patience = if rng.random_range(0..7) == 0 {
                    Duration::from_millis(rng.random_range(0..250))
                } else {
                    Duration::from_secs(30)
                };
                let outcome = tokio::time::timeout(patience, async {
                    let resp = c.send_request(req).await.map_err(|e| format!("no response: {e}"))?;
                    Ok::<_, String>(read_lenient(resp).await)
                })
                .await;
                let (status, body_ok) = match outcome {
                    Err(_) => {
                        tally.abandoned.fetch_add(1, Ordering::SeqCst);
                        conn = None;
                        continue;
                    }
                    // The upstream reset after its headers: if that reaches the sidecar before
                    // it has flushed the headers, the app sees the connection close with no
                    // response instead of a cut body; an error either way, never a clean answer.
                    Ok(Err(_)) if fault == Fault::MidBody => {
                        tally.body_errors.fetch_add(1, Ordering::SeqCst);
                        conn = None;
                        continue;
                    }
                    Ok(Err(e)) => {
                        tally.wrong.lock().unwrap().push(format!("worker {w} {fault:?}: {e}"));
                        conn = None;
                        continue;
                    }
                    Ok(Ok(got)) => got,
                };
                if status == 429 {
                    tally.refused.fetch_add(1, Ordering::SeqCst);
                } else if status != fault.status() {
                    tally.wrong.lock().unwrap().push(format!("{fault:?}: status {status}"));
                } else if fault == Fault::MidBody {
                    if body_ok {
                        tally.wrong.lock().unwrap().push("MidBody: a truncated body ended cleanly".into());
                    }
                    tally.body_errors.fetch_add(1, Ordering::SeqCst);
                    conn = None;
                } else if !body_ok {
                    tally.wrong.lock().unwrap().push(format!("{fault:?}: the body failed"));
                    conn = None;
                } else {
                    tally.expected.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let (expected, refused, abandoned, body_errors) = (
        tally.expected.load(Ordering::SeqCst),
        tally.refused.load(Ordering::SeqCst),
        tally.abandoned.load(Ordering::SeqCst),
        tally.body_errors.load(Ordering::SeqCst),
    );
    let wrong = tally.wrong.lock().unwrap().clone();
    let done = expected + refused + abandoned + body_errors + wrong.len() as u64;
    eprintln!("storm: {expected} as expected, {refused} refused, {abandoned} abandoned, {body_errors} cut bodies");
    assert!(wrong.is_empty(), "{} wrong answers, e.g. {:?}", wrong.len(), &wrong[..wrong.len().min(10)]);
    assert_eq!(done, STORM, "all {STORM} requests ran within the time bound");
    assert!(
        abandoned > 100 && body_errors > 100 && expected > 1000 && refused > 100,
        "the storm had every kind of fault, and the gauge's queue overflowed"
    );

    // Afterwards: nothing in flight, no permit held, nobody waiting.
    let settled = || {
        let (_, m) = http_get(p.addr("admin"), "/metrics");
        let get = |name: &str, labels: &[(&str, &str)]| metric(&m, name, labels).unwrap_or(-1.0);
        (
            get("usher_proxy_in_flight", &[("route", "storm")]),
            get("usher_proxy_resource_in_flight", &[("resource", "inflight")]),
            get("usher_proxy_waiters", &[("resource", "inflight")]),
            get("usher_proxy_waiters", &[("resource", "api")]),
        )
    };
    assert_eventually!(
        settled() == (0.0, 0.0, 0.0, 0.0),
        Duration::from_secs(10),
        "in flight and waiters return to 0 (route in flight, gauge in flight, gauge waiters, rate waiters): {:?}",
        settled()
    );
    let (_, body) = http_get(p.addr("admin"), "/debug/status?format=json");
    let st: serde_json::Value = serde_json::from_str(&body).unwrap();
    let gauge = st["keys"].as_array().unwrap().iter().find(|k| k["resource"] == "inflight").unwrap().clone();
    assert_eq!(gauge["capacity"], GAUGE as f64, "{gauge}");
    assert_eq!(gauge["remaining"], GAUGE, "every gauge permit came back: {gauge}");
    assert_eq!(gauge["demand"]["in_flight"], 0, "{gauge}");
    assert_eq!(gauge["demand"]["waiters"], 0, "{gauge}");
    // And the sidecar still works: the whole gauge is usable at once.
    let mut c = h1(addr).await;
    c.ready().await.unwrap();
    let ok = read(c.send_request(get("app.local", "/ok")).await.unwrap()).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

/// (status, whether the body arrived whole).
async fn read_lenient(resp: http::Response<hyper::body::Incoming>) -> (u16, bool) {
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.is_ok())
}

/// A TCP relay to `to` whose connections can be frozen: a frozen one
/// forwards nothing either way (as a middlebox that dropped it, or a
/// frozen upstream host).
struct Freezer {
    addr: SocketAddr,
    /// Connections accepted so far.
    conns: Arc<AtomicU64>,
    /// Connections numbered up to this are frozen.
    frozen: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Freezer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Freezer {
    async fn start(to: SocketAddr) -> Freezer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (conns, frozen) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (c, f) = (conns.clone(), frozen.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                let f = f.clone();
                tokio::spawn(async move {
                    let Ok(mut up) = TcpStream::connect(to).await else { return };
                    let (mut a, mut b) = ([0u8; 16384], [0u8; 16384]);
                    loop {
                        if n <= f.load(Ordering::SeqCst) {
                            // Frozen: read (and drop) what the proxy sends until it closes.
                            loop {
                                match down.read(&mut a).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(_) => {}
                                }
                            }
                        }
                        let tick = tokio::time::sleep(Duration::from_millis(50));
                        tokio::select! {
                            r = down.read(&mut a) => match r {
                                Ok(0) | Err(_) => return,
                                Ok(k) if n > f.load(Ordering::SeqCst) => { if up.write_all(&a[..k]).await.is_err() { return } }
                                Ok(_) => {}
                            },
                            r = up.read(&mut b) => match r {
                                Ok(0) | Err(_) => return,
                                Ok(k) if n > f.load(Ordering::SeqCst) => { if down.write_all(&b[..k]).await.is_err() { return } }
                                Ok(_) => {}
                            },
                            () = tick => {}
                        }
                    }
                });
            }
        });
        Freezer { addr, conns, frozen, task }
    }
}

/// An h2 upstream connection that goes silent (frozen by a middlebox or a
/// stuck host) is found out on the native path: a request on it times out,
/// a PING goes unanswered for 5 s, and the connection takes no new
/// requests; the request after that gets a new connection and its answer,
/// instead of timing out on the dead one as every request did before.
/// (hyper's client, which carries gRPC, sends no PINGs: gRPC servers close
/// connections that PING more often than once every few minutes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dead_h2_upstream_connection_is_retired_on_the_native_path() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let relay = Freezer::start(up.addr).await;
    let text = format!(
        "upstreams:\n  up: {{ url: \"http://{}\", h2c: true, timeout: 1s }}\n\
         routes:\n  - {{ name: api, match: {{ path_prefix: / }}, upstream: up }}\n",
        relay.addr
    );
    let p = Usher::proxy(&write_file(dir.path(), "routes.yaml", &text));
    let status = || {
        let addr = p.addr("listen");
        async move {
            let mut c = h1(addr).await;
            let r = support::upstream::send1(&mut c, get("app", "/")).await;
            (r.status.as_u16(), r.text())
        }
    };
    let first = status().await;
    assert_eq!(first.0, 200, "{first:?}\n{}", p.log());
    assert_eq!(relay.conns.load(Ordering::SeqCst), 1);
    relay.frozen.store(1, Ordering::SeqCst);

    let timed_out = status().await;
    assert_eq!(timed_out.0, 504, "{timed_out:?}");
    p.wait_for_log("did not answer a PING", Duration::from_secs(10));
    let again = status().await;
    assert_eq!(again.0, 200, "{again:?}\n{}", p.log());
    assert_eq!(relay.conns.load(Ordering::SeqCst), 2, "on a new connection");
}
