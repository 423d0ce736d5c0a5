//! GetCapacity throughput, latency and cost of a real `usher server` process
//! with many distinct clients on one FAIR_SHARE resource.
//!
//! `cargo bench --bench server_load` runs the full measurement (10,000 clients,
//! 10 s); `-- --test` runs a few-second smoke version of both modes (what CI
//! does). Options: `--clients N --connections N --concurrency N --seconds N`,
//! `--server-cpu LIST` to pin the server with `taskset` (`benches/run.sh`
//! pins it to one core and this generator to the other), and `--pids FILE` to
//! list the server's pid for a script's cleanup, `--usher PATH` to measure
//! another build of the server.
//!
//! Every client is registered first (one GetCapacity each, as fast as the
//! callers go, at most [`REGISTER_LIMIT`]); the report has the server's RSS
//! before and after (so memory per client) and its CPU time (utime + stime
//! from `/proc/PID/stat`) over the timed phase, as ms per 1,000 GetCapacity.
//!
//! Every request reports a lease it holds (of 0 at first): the server holds a
//! newcomer's request (none reported) that would get nothing for up to 1.5 s,
//! until capacity is freed (`server::service`), and on a resource 4× over its
//! capacity that is nearly every newcomer once the first quarter holds it
//! all, which would make registering 10,000 clients take minutes. The lease
//! reported changes nothing else outside learning mode (off here).
//!
//! `--refresh S` measures the steady refresh load instead: every client asks
//! again when the interval the server handed it runs out, reporting what it
//! holds, as a sidecar does, with its ±1/6 jitter (the resource's
//! `refresh_interval` is `--refresh-interval R`, default 10 s). A client's
//! first full interval is drawn from (0, R], as for a fleet started over an
//! interval rather than within the second registration takes. After
//! registration the clients run for 2 R (a new resource hands out 1 s
//! intervals for its first R; see `server::store`), then S seconds are measured: RPCs per second, how many of
//! the answers carried the full interval, how late each refresh left against
//! its due time, and the server's CPU.
//!
//! `--keys N` measures a fleet's tenant keys instead: N resources leased in
//! batches by 10 clients, then forgotten (see `keys`).
//!
//! The load generator shares the machine with the server, so on a 2-core box
//! the figures are a lower bound.

#![allow(clippy::disallowed_methods, reason = "benchmarks time real processes on the wall clock")]

#[path = "server_load/keys.rs"]
mod keys;
mod loadgen;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use loadgen::procfs;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, Lease, ResourceRequest};

/// The lease a client reports before it got one (see the module doc).
const ZERO: Lease = Lease { expiry_time: 0, refresh_interval: 0, capacity: 0.0 };

/// Registering the clients gives up after this long (the run then fails).
const REGISTER_LIMIT: Duration = Duration::from_secs(180);

fn config(refresh_interval: u64) -> String {
    format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: 10000\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 300, refresh_interval: {refresh_interval}, learning_mode_duration: 0 }}\n"
    )
}

struct Opts {
    smoke: bool,
    clients: u64,
    connections: usize,
    concurrency: usize,
    /// Callers in the refresh run (`--concurrency`, default 512): enough that
    /// 100,000 clients' refreshes leave on time at a few ms each.
    refresh_callers: usize,
    seconds: u64,
    server_cpu: Option<String>,
    /// A file to append the server's pid to, so a script that stops this
    /// generator can stop the server too.
    pids: Option<String>,
    refresh: Option<u64>,
    refresh_interval: u64,
    /// The `usher` binary to measure (`--usher PATH`; default: this build's).
    usher: String,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`; `cargo test --benches` and `-- --test` ask for a smoke run.
    let smoke = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let get = |name: &str, default: u64| value(name).and_then(|v| v.parse().ok()).unwrap_or(default);
    Opts {
        smoke,
        clients: get("--clients", if smoke { 200 } else { 10_000 }).max(1),
        connections: get("--connections", 4).max(1) as usize,
        concurrency: get("--concurrency", 64).max(1) as usize,
        refresh_callers: get("--concurrency", 512).max(1) as usize,
        seconds: get("--seconds", if smoke { 1 } else { 10 }),
        server_cpu: value("--server-cpu").cloned(),
        pids: value("--pids").cloned(),
        refresh: value("--refresh").and_then(|v| v.parse().ok()),
        refresh_interval: get("--refresh-interval", if smoke { 1 } else { 10 }).max(1),
        usher: value("--usher").cloned().unwrap_or_else(|| env!("CARGO_BIN_EXE_usher").to_string()),
    }
}

/// A running `usher server`, stopped on drop.
struct Server {
    child: std::process::Child,
    addr: String,
    /// Its admin listener (`/metrics`).
    admin: String,
    dir: std::path::PathBuf,
}

impl Server {
    fn start(o: &Opts, config: &str) -> Server {
        Server::start_with(o, config, &[])
    }

    /// A server started with `extra` arguments besides the bench's own.
    fn start_with(o: &Opts, config: &str, extra: &[&str]) -> Server {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let nth = STARTED.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("usher-bench-{}-{nth}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("resources.yaml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = match &o.server_cpu {
            Some(cpu) => {
                // taskset execs the server, so the pid is the server's.
                let mut c = Command::new("taskset");
                c.args(["-c", cpu, &o.usher]);
                c
            }
            None => Command::new(&o.usher),
        };
        let mut child = cmd
            .args([
                "server",
                "--config",
                cfg.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .args(["--min-request-interval", "0s"])
            .args(extra)
            .env("USHER_LOG", "warn,usher_server=info")
            .env("NO_COLOR", "1")
            .stderr(Stdio::piped())
            .spawn()
            .expect("start usher server");
        if let Some(path) = &o.pids {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open the pid file");
            writeln!(f, "{}", child.id()).expect("write the pid file");
        }
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let mut addrs = None;
        let field = |line: &str, name: &str| Some(line.split(name).nth(1)?.split_whitespace().next()?.to_string());
        for line in lines.by_ref().map_while(Result::ok) {
            if let (Some(grpc), Some(admin)) = (field(&line, "grpc="), field(&line, "admin=")) {
                addrs = Some((grpc, admin));
                break;
            }
        }
        let (addr, admin) = addrs.expect("server addresses in log");
        // The rest of the log is drained, so the server never waits on a full pipe.
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
        Server { child, addr, admin, dir }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn rss_mb(&self) -> f64 {
        procfs::status_mb(self.pid(), "VmRSS").unwrap_or(f64::NAN)
    }

    fn cpu_ms(&self) -> u64 {
        procfs::cpu_ms(self.pid()).unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let keys = keys::KeyOpts::parse(o.smoke);
    if let Some(k) = &keys {
        rt.block_on(keys::run(&o, k));
        if !o.smoke {
            return;
        }
    }
    if o.refresh.is_none() || o.smoke {
        let server = Server::start(&o, &config(60));
        rt.block_on(get_capacity(&o, &server));
    }
    if let Some(seconds) = o.refresh.or(o.smoke.then_some(1)) {
        let server = Server::start(&o, &config(o.refresh_interval));
        rt.block_on(refresh(&o, &server, seconds));
    }
}

async fn channels(o: &Opts, addr: &str) -> Vec<CapacityClient<tonic::transport::Channel>> {
    let mut channels = Vec::new();
    for _ in 0..o.connections {
        channels.push(CapacityClient::connect(format!("http://{addr}")).await.expect("connect"));
    }
    channels
}

/// Registers every client once, then sends GetCapacity as fast as the
/// callers go for `--seconds`.
async fn get_capacity(o: &Opts, server: &Server) {
    let rss0 = server.rss_mb();
    let channels = channels(o, &server.addr).await;
    // Register every client once so the resource holds `clients` leases.
    let registered = Instant::now();
    let give_up = registered + REGISTER_LIMIT;
    let next = Arc::new(AtomicU64::new(0));
    let warm: Vec<_> = (0..o.concurrency)
        .map(|i| {
            let mut c = channels[i % channels.len()].clone();
            let next = next.clone();
            let clients = o.clients;
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= clients {
                        return;
                    }
                    assert!(Instant::now() < give_up, "registering {clients} clients took over {REGISTER_LIMIT:?}");
                    c.get_capacity(request(n, 1.0 + (n % 7) as f64, Some(ZERO))).await.expect("warm-up request");
                }
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    let register_s = registered.elapsed().as_secs_f64();
    let rss1 = server.rss_mb();
    let cpu0 = server.cpu_ms();
    let deadline = Instant::now() + Duration::from_secs(o.seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..o.concurrency)
        .map(|i| {
            let mut c = channels[i % channels.len()].clone();
            let next = next.clone();
            let clients = o.clients;
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(1 << 16);
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed) % clients;
                    let t = Instant::now();
                    c.get_capacity(request(n, 1.0 + (n % 13) as f64, Some(ZERO))).await.expect("request");
                    lat.push(t.elapsed().as_micros() as u32);
                }
                lat
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let elapsed = start.elapsed();
    let cpu = server.cpu_ms().saturating_sub(cpu0);
    let count = lat.len() as u64;
    lat.sort_unstable();
    let pct = |p: f64| pct(&lat, p);
    println!(
        "server_load: clients={} connections={} concurrency={} seconds={:.1} requests={} rate={:.0}/s p50={}us p99={}us p99.9={}us max={}us cpu_ms_per_1k={:.1} register_s={:.1} rss_before_mb={:.1} rss_after_mb={:.1} bytes_per_client={:.0}",
        o.clients,
        o.connections,
        o.concurrency,
        elapsed.as_secs_f64(),
        count,
        count as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99),
        pct(0.999),
        lat.last().copied().unwrap_or(0),
        cpu as f64 * 1000.0 / count.max(1) as f64,
        register_s,
        rss0,
        rss1,
        (rss1 - rss0) * 1024.0 * 1024.0 / o.clients as f64,
    );
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    sorted.get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(0)
}

/// What the refresh run's callers share: when the measured window is, and
/// what happened in it.
#[derive(Default)]
struct Window {
    /// Callers that have registered all their clients.
    registered: AtomicUsize,
    /// (start, end), set once every client is registered.
    bounds: OnceLock<(Instant, Instant)>,
    rpcs: AtomicU64,
    /// Answers in the window that carried the full refresh interval.
    full: AtomicU64,
}

/// Every client refreshes when the interval it was handed runs out, for
/// registration + 2 × the refresh interval + `seconds`.
async fn refresh(o: &Opts, server: &Server, seconds: u64) {
    let channels = channels(o, &server.addr).await;
    let interval = Duration::from_secs(o.refresh_interval);
    let t0 = Instant::now();
    let hard_stop = t0 + REGISTER_LIMIT + interval * 2 + Duration::from_secs(seconds + 5);
    let window = Arc::new(Window::default());
    let callers = o.refresh_callers.min(o.clients as usize);
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let mut c = channels[i % channels.len()].clone();
            let window = window.clone();
            let (clients, callers) = (o.clients, callers as u64);
            tokio::spawn(async move {
                // This caller's clients: n ≡ i (mod callers), each due at once.
                let mine: Vec<u64> = (i as u64..clients).step_by(callers as usize).collect();
                let mut leases: Vec<Option<Lease>> = vec![None; mine.len()];
                let mut spread = vec![false; mine.len()];
                let mut rng = SmallRng::seed_from_u64(i as u64);
                let mut due: BinaryHeap<Reverse<(Instant, usize)>> =
                    (0..mine.len()).map(|k| Reverse((t0, k))).collect();
                let mut unregistered = mine.len();
                let mut late = Vec::new();
                while let Some(Reverse((at, k))) = due.pop() {
                    if window.bounds.get().is_some_and(|&(_, end)| at >= end) || at >= hard_stop {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                    let sent = Instant::now();
                    let n = mine[k];
                    let resp = c
                        .get_capacity(request(n, 1.0 + (n % 7) as f64, Some(leases[k].unwrap_or(ZERO))))
                        .await
                        .expect("refresh request")
                        .into_inner();
                    let lease = resp.response.into_iter().next().map(|r| r.gets).expect("a lease");
                    let every = Duration::from_secs(lease.refresh_interval.max(1) as u64);
                    if let Some(&(start, end)) = window.bounds.get()
                        && sent >= start
                        && sent < end
                    {
                        window.rpcs.fetch_add(1, Ordering::Relaxed);
                        if every >= interval {
                            window.full.fetch_add(1, Ordering::Relaxed);
                        }
                        late.push(sent.saturating_duration_since(at).as_micros() as u32);
                    }
                    if leases[k].is_none() {
                        unregistered -= 1;
                        if unregistered == 0 && window.registered.fetch_add(1, Ordering::AcqRel) + 1 == callers as usize
                        {
                            let start = Instant::now() + interval * 2;
                            let _ = window.bounds.set((start, start + Duration::from_secs(seconds)));
                        }
                    }
                    leases[k] = Some(lease);
                    // A client's first full interval is drawn from (0, R], as if
                    // the fleet had started over an interval, not within a second
                    // (so the measured window does not catch a whole fleet's
                    // refreshes at one edge); after that, the lease client's own
                    // jitter of ±1/6 (`lease::core`).
                    let next = if every >= interval && !std::mem::replace(&mut spread[k], true) {
                        every.mul_f64(rng.random_range(0.0..1.0))
                    } else {
                        every.mul_f64(1.0 + rng.random_range(-1.0 / 6.0..=1.0 / 6.0))
                    };
                    due.push(Reverse((Instant::now() + next, k)));
                }
                late
            })
        })
        .collect();
    // The server's CPU and RSS over the window, read when it starts and ends.
    let (start, end) = loop {
        if let Some(&b) = window.bounds.get() {
            break b;
        }
        assert!(Instant::now() < t0 + REGISTER_LIMIT, "registering {} clients took too long", o.clients);
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let register_s = (start - interval * 2).duration_since(t0).as_secs_f64();
    tokio::time::sleep_until(start.into()).await;
    let cpu0 = server.cpu_ms();
    tokio::time::sleep_until(end.into()).await;
    let cpu = server.cpu_ms().saturating_sub(cpu0);
    let rss = server.rss_mb();
    let mut late = Vec::new();
    for t in tasks {
        late.extend(t.await.unwrap());
    }
    late.sort_unstable();
    let rpcs = window.rpcs.load(Ordering::Relaxed);
    let secs = (end - start).as_secs_f64();
    println!(
        "server_refresh: clients={} refresh_interval={}s seconds={:.0} rpcs={} rate={:.1}/s clients_per_interval={:.1}/s full_interval={:.1}% late_p50={}us late_p99={}us cpu_ms_per_s={:.1} cpu_ms_per_1k={:.1} register_s={:.1} rss_mb={:.1}",
        o.clients,
        o.refresh_interval,
        secs,
        rpcs,
        rpcs as f64 / secs,
        o.clients as f64 / o.refresh_interval as f64,
        window.full.load(Ordering::Relaxed) as f64 * 100.0 / rpcs.max(1) as f64,
        pct(&late, 0.5),
        pct(&late, 0.99),
        cpu as f64 / secs,
        cpu as f64 * 1000.0 / rpcs.max(1) as f64,
        register_s,
        rss,
    );
}

fn request(n: u64, wants: f64, has: Option<Lease>) -> GetCapacityRequest {
    GetCapacityRequest {
        client_id: format!("client-{n}"),
        resource: vec![ResourceRequest {
            returned: None,
            reserve: None,
            backlog: None,
            unit_account: None,
            window: None,
            upstream_quota: None,
            resource_id: "shared".into(),
            priority: 0,
            has,
            wants,
        }],
    }
}
