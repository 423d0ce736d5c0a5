//! The latency a real `usher proxy` process adds over calling the upstream
//! directly, under an open-loop load at a fixed request rate.
//!
//! `cargo bench --bench proxy_latency` runs the full measurement (10,000
//! req/s for 10 s over 32 HTTP/1.1 keep-alive connections, each request
//! admitted by a rate and a gauge resource); `-- --test` (what `cargo test
//! --benches` passes) runs a one-second smoke version at 1,000 req/s.
//! Options: `--rate N --seconds N --connections N`. The load generator, the
//! upstream and usher share the machine, so on a 2-core box the added
//! latency includes CPU contention and is an upper bound.

use std::convert::Infallible;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

struct Opts {
    rate: u64,
    seconds: u64,
    connections: u64,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    let smoke = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let get = |name: &str, default: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Opts {
        rate: get("--rate", if smoke { 1_000 } else { 10_000 }),
        seconds: get("--seconds", if smoke { 1 } else { 10 }),
        connections: get("--connections", 32),
    }
}

async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// Sends `rate` requests per second for `seconds` to `addr`, open loop
/// (each connection on its own fixed schedule); returns sorted latencies.
/// A response slower than the interval delays that connection's next send
/// (`MissedTickBehavior::Burst` then catches up), so stalls still show.
async fn load(addr: SocketAddr, o: &Opts) -> Vec<Duration> {
    let per_conn = Duration::from_secs_f64(o.connections as f64 / o.rate as f64);
    let count = o.rate * o.seconds / o.connections;
    let mut tasks = Vec::new();
    for i in 0..o.connections {
        // Stagger connections across one interval.
        let stagger = per_conn.mul_f64(i as f64 / o.connections as f64);
        tasks.push(tokio::spawn(async move {
            let s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
            tokio::spawn(conn);
            let start = tokio::time::Instant::now() + stagger;
            let mut tick = tokio::time::interval_at(start, per_conn);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut lat = Vec::with_capacity(count as usize);
            for _ in 0..count {
                tick.tick().await;
                send.ready().await.unwrap();
                // tokio's timer has millisecond granularity, so latency is timed from the send,
                // not from the tick; each connection has at most one request outstanding.
                let sent = Instant::now();
                let req = Request::get("/x").header("host", "bench.test").body(Empty::<Bytes>::new()).unwrap();
                let resp = send.send_request(req).await.unwrap();
                assert!(resp.status().is_success(), "status {}", resp.status());
                resp.into_body().collect().await.unwrap();
                lat.push(sent.elapsed());
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn pct(v: &[Duration], p: f64) -> Duration {
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let up = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let routes = dir.path().join("routes.yaml");
        std::fs::write(
            &routes,
            format!(
                "upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
                 resources:\n  r: {{ kind: rate, capacity: 1000000/s, burst: 1000 }}\n  g: {{ kind: gauge, capacity: 10000 }}\n\
                 routes:\n  - {{ name: bench, upstream: up, resources: [r, g] }}\n"
            ),
        )
        .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_usher"))
            .args(["proxy", "--routes", routes.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .env("USHER_LOG", "warn,usher=info")
            .env("NO_COLOR", "1")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        // Keeps draining stderr so usher never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if line.contains("usher proxy listening") {
                    let addr: Option<SocketAddr> =
                        line.split_whitespace().find_map(|w| w.strip_prefix("listen=")).and_then(|a| a.parse().ok());
                    let _ = tx.send(addr);
                }
            }
        });
        let proxy = rx.recv_timeout(Duration::from_secs(20)).ok().flatten();
        let proxy = proxy.expect("usher proxy did not start");

        let started = Instant::now();
        let direct = load(up, &o).await;
        let via = load(proxy, &o).await;
        let _ = child.kill();
        let _ = child.wait();
        println!(
            "proxy_latency: {} req/s for {} s over {} connections ({:.1} s wall)",
            o.rate,
            o.seconds,
            o.connections,
            started.elapsed().as_secs_f64()
        );
        for (name, v) in [("direct", &direct), ("via usher", &via)] {
            println!(
                "  {name:>10}: n={} p50={:?} p90={:?} p99={:?} max={:?}",
                v.len(),
                pct(v, 0.50),
                pct(v, 0.90),
                pct(v, 0.99),
                v[v.len() - 1]
            );
        }
        let added = |p: f64| pct(&via, p).saturating_sub(pct(&direct, p));
        println!("  added by usher: p50={:?} p99={:?}", added(0.50), added(0.99));
    });
}
