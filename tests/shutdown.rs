//! Graceful shutdown under load: SIGTERM to a real `usher proxy` while
//! ~2,000 requests/s flow through it (some of them slow), leasing from a
//! real `usher server`.
//!
//! What clients see: every request the sidecar read before it stopped is
//! answered normally (here: every request the upstream received got its 200
//! at the client). The listener closes at once, so new connections are
//! refused at the TCP level. Open HTTP/1.1 connections get answers with
//! `connection: close` for a grace of 1 s, then idle ones are closed; a
//! request written into one at that very instant is never read (the client
//! sees the connection close without a response, and the upstream never
//! sees the request, so retrying it is safe). Then the leases are released.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};

use support::upstream::get;
use support::{Usher, http_get, write_file};

/// Requests per second offered in total, over `CONNS` connections.
const RATE: f64 = 2000.0;
const CONNS: usize = 40;
/// Connections that send only slow requests (answered after `SLOW`).
const SLOW_CONNS: usize = 4;
const SLOW: Duration = Duration::from_millis(1500);

#[derive(Default)]
struct Seen {
    received: AtomicU64,
    slow_received: AtomicU64,
    in_flight: AtomicU64,
}

/// An upstream that answers `/slow` after `SLOW` and anything else after 5 ms.
async fn upstream(seen: Arc<Seen>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        seen.received.fetch_add(1, Ordering::SeqCst);
                        seen.in_flight.fetch_add(1, Ordering::SeqCst);
                        let slow = req.uri().path() == "/slow";
                        if slow {
                            seen.slow_received.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(if slow { SLOW } else { Duration::from_millis(5) }).await;
                        seen.in_flight.fetch_sub(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from_static(b"ok"),
                        )))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

#[derive(Default)]
struct Clients {
    ok: AtomicU64,
    slow_ok: AtomicU64,
    refused_429: AtomicU64,
    /// Statuses other than 2xx and 429, and errors before SIGTERM: failures.
    wrong: std::sync::Mutex<Vec<String>>,
    /// After SIGTERM: connections refused by the closed listener.
    conn_refused: AtomicU64,
    /// After SIGTERM: a request on a keep-alive connection the sidecar closed without reading it.
    unread: AtomicU64,
}

async fn client(
    addr: SocketAddr,
    path: &'static str,
    every: Duration,
    until: Instant,
    term: Arc<AtomicBool>,
    c: Arc<Clients>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn: Option<hyper::client::conn::http1::SendRequest<support::upstream::TestBody>> = None;
    while Instant::now() < until {
        tick.tick().await;
        if let Some(s) = conn.as_mut()
            && s.ready().await.is_err()
        {
            conn = None; // closed by the sidecar between requests
        }
        let s = match conn.as_mut() {
            Some(s) => s,
            None => {
                let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
                    if term.load(Ordering::SeqCst) {
                        c.conn_refused.fetch_add(1, Ordering::SeqCst);
                        return; // the listener is closed: this client is done
                    }
                    c.wrong.lock().unwrap().push("connect failed before SIGTERM".into());
                    return;
                };
                let Ok((s, driver)) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await else {
                    continue;
                };
                tokio::spawn(driver);
                conn.insert(s)
            }
        };
        let answered = match s.send_request(get("app.local", path)).await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                resp.into_body().collect().await.map(|_| status).map_err(|e| format!("body failed: {e}"))
            }
            Err(e) => Err(format!("no response: {e}")),
        };
        match answered {
            Ok(200) if path == "/slow" => drop(c.slow_ok.fetch_add(1, Ordering::SeqCst)),
            Ok(200..=299) => drop(c.ok.fetch_add(1, Ordering::SeqCst)),
            Ok(429) => drop(c.refused_429.fetch_add(1, Ordering::SeqCst)),
            Ok(other) => c.wrong.lock().unwrap().push(format!("{path}: status {other}")),
            Err(_) if term.load(Ordering::SeqCst) => {
                c.unread.fetch_add(1, Ordering::SeqCst);
                conn = None;
            }
            Err(e) => {
                c.wrong.lock().unwrap().push(format!("{path} before SIGTERM: {e}"));
                conn = None;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_fails_no_accepted_request_and_releases_the_leases() {
    let dir = tempfile::tempdir().unwrap();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = write_file(
        dir.path(),
        "server.yaml",
        "resources:\n  - identifier_glob: '*'\n    capacity: 100000\n    algorithm: { kind: FAIR_SHARE, lease_length: 20, refresh_interval: 2, learning_mode_duration: 0 }\n",
    );
    let listen = format!("127.0.0.1:{port}");
    let server = Usher::start(
        &["server", "--config", cfg.to_str().unwrap(), "--listen", &listen, "--admin-listen", "127.0.0.1:0"],
        &[],
        "usher server listening",
    );
    let seen = Arc::new(Seen::default());
    let up = upstream(seen.clone()).await;
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "drain_timeout: 20s\n\
             doorman:\n  servers: [\"{listen}\"]\n  client_id: sidecar-term\n\
             upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 100000, burst: 500, max_wait: 100ms, wants: 100000 }}\n  \
             inflight: {{ kind: gauge, capacity: 1000, max_wait: 100ms }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api, inflight] }}\n"
        ),
    );
    let mut p = Usher::proxy(&routes);
    let addr = p.addr("listen");
    let holds = || {
        let (code, body) = http_get(server.addr("admin"), "/debug/resources?resource=api&format=json");
        code == 200 && body.contains("sidecar-term")
    };
    assert_eventually!(holds(), Duration::from_secs(10), "the sidecar holds a lease");

    let term = Arc::new(AtomicBool::new(false));
    let clients = Arc::new(Clients::default());
    let until = Instant::now() + Duration::from_secs(8);
    let every = Duration::from_secs_f64(CONNS as f64 / RATE);
    let mut tasks = Vec::new();
    for i in 0..CONNS + SLOW_CONNS {
        let (path, every) = if i < CONNS { ("/x", every) } else { ("/slow", Duration::from_millis(200)) };
        let (term, clients) = (term.clone(), clients.clone());
        // Slow clients start staggered, so some are mid-request whenever SIGTERM comes.
        let start = if i < CONNS { Duration::ZERO } else { SLOW.mul_f64((i - CONNS) as f64 / SLOW_CONNS as f64) };
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(start).await;
            client(addr, path, every, until, term, clients).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let before = seen.received.load(Ordering::SeqCst);
    let in_flight = seen.in_flight.load(Ordering::SeqCst);
    let slow_in_flight =
        seen.slow_received.load(Ordering::SeqCst).saturating_sub(clients.slow_ok.load(Ordering::SeqCst));
    term.store(true, Ordering::SeqCst);
    p.signal("TERM");
    let signalled = Instant::now();
    assert_eq!(p.wait_exit(Duration::from_secs(25)), Some(0), "{}", p.log());
    let drained = signalled.elapsed();
    for t in tasks {
        t.await.unwrap();
    }
    let got = |a: &AtomicU64| a.load(Ordering::SeqCst);
    let (received, slow_received) = (got(&seen.received), got(&seen.slow_received));
    let (ok, slow_ok) = (got(&clients.ok), got(&clients.slow_ok));
    eprintln!(
        "{:.0} req/s before SIGTERM; {in_flight} in flight at the upstream at SIGTERM ({slow_in_flight} slow); exit after {drained:?}; \
         upstream saw {received} ({slow_received} slow); clients: {ok} ok, {slow_ok} slow ok, {} 429, \
         {} refused connections, {} unread on closing keep-alive connections",
        before as f64 / 3.1,
        got(&clients.refused_429),
        got(&clients.conn_refused),
        got(&clients.unread),
    );
    let wrong = clients.wrong.lock().unwrap().clone();
    assert!(wrong.is_empty(), "failures: {:?}", &wrong[..wrong.len().min(10)]);
    assert!(slow_in_flight > 0, "slow requests were in flight at SIGTERM");
    assert_eq!(
        ok + slow_ok,
        received,
        "every request that reached the upstream was answered with its 200 (none cut by the shutdown)"
    );
    assert_eq!(slow_ok, slow_received, "the slow requests in flight at SIGTERM completed");
    // Busy keep-alive connections learn of the shutdown from an answer
    // (`connection: close`) during the drain grace, so none is closed under a request.
    assert_eq!(got(&clients.unread), 0, "no request was written into a connection the sidecar closed");
    assert!(drained >= SLOW / 8, "the sidecar waited for the slow requests: it exited after {drained:?}");
    assert!(p.log().contains("released every lease"), "{}", p.log());
    assert!(!holds(), "the server no longer holds the sidecar's lease");
    assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(), "the listener is gone");
}

/// The processes whose parent is `pid` and that are zombies.
fn zombies_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // pid (comm) state ppid ...: comm may hold spaces, so read after its ')'.
        let Some((head, rest)) = stat.rsplit_once(") ") else { continue };
        let mut fields = rest.split(' ');
        let (state, ppid) = (fields.next(), fields.next().and_then(|p| p.parse::<u32>().ok()));
        if state == Some("Z") && ppid == Some(pid) {
            out.push(head.split(' ').next().and_then(|p| p.parse().ok()).unwrap_or(0));
        }
    }
    out
}

/// As a container's PID 1 (the image has no init), usher reaps the
/// processes orphaned in its PID namespace (what `kubectl exec` leaves
/// running) once they exit: no zombie piles up. Needs `unshare` and
/// `nsenter` with the right to make a PID namespace (root); says so and
/// passes without them.
#[test]
fn as_pid_1_orphans_are_reaped() {
    let ok = |c: &mut std::process::Command| c.output().is_ok_and(|o| o.status.success());
    if !ok(std::process::Command::new("unshare").args(["--pid", "--fork", "--mount-proc", "true"])) {
        eprintln!("SKIPPED: cannot make a PID namespace here (unshare --pid needs root)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(dir.path(), "routes.yaml", "routes:\n  - { name: all, match: { path_prefix: / } }\n");
    let u = Usher::start_wrapped(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        &["proxy", "--routes", routes.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[],
        "usher proxy listening",
    );
    // usher is the only child of `unshare`, and PID 1 inside.
    let children = format!("/proc/{0}/task/{0}/children", u.child.id());
    let usher: u32 = std::fs::read_to_string(&children).unwrap().trim().parse().unwrap();
    let inside = std::fs::read_to_string(format!("/proc/{usher}/status")).unwrap();
    let nspid = inside.lines().find(|l| l.starts_with("NSpid:")).unwrap_or_default().to_string();
    assert!(nspid.split_whitespace().last() == Some("1"), "usher is PID 1 in its namespace: {nspid}");
    // Three processes left behind in usher's namespace, as `kubectl exec sh -c 'cmd &'` does.
    for _ in 0..3 {
        let status = std::process::Command::new("nsenter")
            .args(["-t", &usher.to_string(), "-p", "-m", "sh", "-c", "sleep 0.2 & exit 0"])
            .status()
            .unwrap();
        assert!(status.success());
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(zombies_of(usher), Vec::<u32>::new(), "the orphans were reaped\n{}", u.log());
}
