//! `usher demo`: a self-contained tour on loopback. One process starts an
//! upstream, a capacity server and three sidecars that share one resource
//! while offering it different loads, drives them for `--duration`, shows a
//! live table of wants, has, admitted/s and refused/s per sidecar, and ends
//! with a summary. Everything runs the production code paths: the real
//! gRPC server, real `usher proxy` instances, real HTTP.

#![allow(clippy::disallowed_methods, reason = "the demo runs real processes and reports wall-clock time")]

/// `println!` that says whether the line was written: `false` once stdout is
/// gone (its reader, such as `| head`, stopped reading), where `println!`
/// would panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let written = writeln!(std::io::stdout().lock(), $($arg)*).is_ok();
        written
    }};
}

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use usher_core::clock::Clock;
use usher_core::config::resources::ResourcesConfig;
use usher_core::error::RunError;
use usher_proxy::ProxyOptions;
use usher_server::{CapacityService, Node};

/// The shared resource's capacity, per second.
pub const CAPACITY: f64 = 100.0;
/// What each sidecar offers, per second.
pub const OFFERED: [f64; 3] = [30.0, 80.0, 160.0];

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// How long to drive load.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = crate::parse_duration)]
    pub duration: Duration,
    /// Print the summary only (no live table): for scripts and logs.
    #[arg(long)]
    pub quiet: bool,
    /// Draw each sidecar's lease and admitted rate over time to this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<std::path::PathBuf>,
    /// Print the summary as one JSON object (no live table).
    #[arg(long)]
    pub json: bool,
}

/// What `usher demo --json` prints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoReport {
    pub capacity_per_s: f64,
    pub sidecars: Vec<SidecarSummary>,
    /// Requests that reached the upstream (admitted by all sidecars together)
    /// in each whole second of load.
    pub admitted_each_second: Vec<u64>,
    /// The fewest admitted in any second after the first.
    pub min_admitted_after_first_second: u64,
}

/// One sidecar's figures over the run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SidecarSummary {
    pub name: String,
    pub offered_per_s: f64,
    pub admitted_per_s: f64,
    pub refused_per_s: f64,
    pub has: f64,
}

fn free_addr() -> Result<SocketAddr, RunError> {
    let l =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| RunError::Other(format!("no loopback port: {e}")))?;
    l.local_addr().map_err(|e| RunError::Other(e.to_string()))
}

/// When each request reached the upstream: what the sidecars admitted, timed
/// where it lands rather than when its answer gets back to the load.
type Arrivals = Arc<std::sync::Mutex<Vec<Instant>>>;

async fn upstream(shutdown: CancellationToken, arrivals: Arrivals) -> Result<SocketAddr, RunError> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| RunError::Other(e.to_string()))?;
    let addr = listener.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => return,
                a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
            };
            let arrivals = arrivals.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    arrivals.lock().expect("arrivals lock").push(Instant::now());
                    async {
                        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
                            b"hello from the upstream\n",
                        ))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

async fn capacity_server(shutdown: CancellationToken) -> Result<SocketAddr, RunError> {
    let text = format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: {CAPACITY}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 20, refresh_interval: 2, learning_mode_duration: 0 }}\n"
    );
    let cfg = ResourcesConfig::parse("<demo>", &text)?;
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| RunError::Other(e.to_string()))?;
    let addr = listener.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let node = Arc::new(Node::new(
        addr.to_string(),
        "<demo>".into(),
        cfg,
        Clock::system(),
        Duration::ZERO,
        prometheus::Registry::new(),
    ));
    let svc = CapacityService::new(node).into_server();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown.cancelled_owned(),
            )
            .await;
    });
    Ok(addr)
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    refused: AtomicU64,
}

async fn load(addr: SocketAddr, rate: f64, until: Instant, counts: Arc<Counts>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while Instant::now() < until {
        tick.tick().await;
        let client = client.clone();
        let counts = counts.clone();
        tokio::spawn(async move {
            let req = http::Request::get(format!("http://{addr}/demo")).body(Empty::new()).expect("valid request");
            if let Ok(resp) = client.request(req).await {
                let c = if resp.status().is_success() { &counts.ok } else { &counts.refused };
                c.fetch_add(1, Ordering::Relaxed);
                let _ = resp.into_body().collect().await;
            }
        });
    }
}

/// Whether the sidecar behind `admin` holds a lease.
async fn leased(admin: SocketAddr) -> bool {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let Ok(req) = http::Request::get(format!("http://{admin}/debug/status?format=json")).body(Empty::new()) else {
        return false;
    };
    let Ok(resp) = client.request(req).await else { return false };
    let Ok(body) = resp.into_body().collect().await else { return false };
    let v: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap_or_default();
    v["lease"]["keys"][0]["mode"].as_str() == Some("leased")
}

async fn lease_of(admin: SocketAddr) -> (f64, f64) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let req = http::Request::get(format!("http://{admin}/debug/status?format=json"))
        .body(Empty::new())
        .expect("valid request");
    let Ok(resp) = client.request(req).await else { return (0.0, 0.0) };
    let Ok(body) = resp.into_body().collect().await else { return (0.0, 0.0) };
    let v: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap_or_default();
    let k = &v["lease"]["keys"][0];
    (k["wants"].as_f64().unwrap_or(0.0), k["has"].as_f64().unwrap_or(0.0))
}

/// Per second: (t, per sidecar (lease, admitted in that second)).
type History = Vec<(f64, Vec<(f64, f64)>)>;

/// Runs the demo and returns the per-sidecar summary, the history and the
/// requests that reached the upstream in each whole second.
pub async fn run_demo(args: &DemoArgs) -> Result<(Vec<SidecarSummary>, History, Vec<u64>), RunError> {
    // The sidecars stop first, so they can release their leases to a server still running.
    let shutdown = CancellationToken::new();
    let sidecars_stop = CancellationToken::new();
    let arrivals: Arrivals = Arc::default();
    let up = upstream(shutdown.clone(), arrivals.clone()).await?;
    let server = capacity_server(shutdown.clone()).await?;
    let dir = std::env::temp_dir().join(format!("usher-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| RunError::Other(format!("cannot create {}: {e}", dir.display())))?;
    let sidecars = start_sidecars(&dir, server, up, &sidecars_stop)?;
    wait_for_sidecars(&sidecars).await?;
    let start = Instant::now();
    let until = start + args.duration;
    let counts: Vec<Arc<Counts>> = sidecars.iter().map(|_| Arc::new(Counts::default())).collect();
    for (s, c) in sidecars.iter().zip(&counts) {
        tokio::spawn(load(s.listen, s.offered, until, c.clone()));
    }
    if !args.quiet && !args.json {
        out!(
            "usher demo: 3 sidecars share one resource of {CAPACITY}/s (FAIR_SHARE) from a capacity server on {server};\n\
             they offer {}/s, {}/s and {}/s to an upstream on {up}. Ctrl-C stops early.\n",
            OFFERED[0],
            OFFERED[1],
            OFFERED[2]
        );
    }
    let (last, history) = watch(args, &sidecars, &counts, start).await;
    let secs = args.duration.as_secs().max(1) as f64;
    let mut summary = Vec::new();
    for (s, last) in sidecars.iter().zip(&last) {
        let (_, has) = lease_of(s.admin).await;
        summary.push(SidecarSummary {
            name: s.name.clone(),
            offered_per_s: s.offered,
            admitted_per_s: last.0 as f64 / secs,
            refused_per_s: last.1 as f64 / secs,
            has,
        });
    }
    sidecars_stop.cancel();
    for s in sidecars {
        let _ = tokio::time::timeout(Duration::from_secs(20), s.task).await;
    }
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(&dir);
    let mut each_second = vec![0; args.duration.as_secs() as usize];
    for t in arrivals.lock().expect("arrivals lock").iter().filter(|t| **t >= start) {
        if let Some(n) = each_second.get_mut(t.duration_since(start).as_secs() as usize) {
            *n += 1;
        }
    }
    Ok((summary, history, each_second))
}

/// One of the demo's sidecars, running in this process.
struct Sidecar {
    name: String,
    offered: f64,
    listen: SocketAddr,
    admin: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), RunError>>,
}

/// Starts the three sidecars, each with a routes file in `dir` that leases
/// from `server` and forwards to `up`; they stop on `stop`.
fn start_sidecars(
    dir: &std::path::Path,
    server: SocketAddr,
    up: SocketAddr,
    stop: &CancellationToken,
) -> Result<Vec<Sidecar>, RunError> {
    let mut sidecars = Vec::new();
    for (i, offered) in OFFERED.iter().enumerate() {
        let (listen, admin) = (free_addr()?, free_addr()?);
        let routes = format!(
            "doorman:\n  servers: [\"{server}\"]\n  client_id: demo-sidecar-{i}\n  min_interval: 500ms\n\
             upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: {CAPACITY}, burst: 5, wants: auto }}\n\
             routes:\n  - {{ name: demo, upstream: up, resources: [api] }}\n"
        );
        let path = dir.join(format!("sidecar-{i}.yaml"));
        std::fs::write(&path, routes).map_err(|e| RunError::Other(format!("cannot write {}: {e}", path.display())))?;
        let args =
            ProxyOptions { routes: path, listen: Some(listen), admin_listen: Some(admin), http1: Default::default() };
        let task = tokio::spawn(usher_proxy::run(args, stop.clone()));
        sidecars.push(Sidecar { name: format!("sidecar-{i}"), offered: *offered, listen, admin, task });
    }
    Ok(sidecars)
}

/// Waits until every sidecar answers, then until each holds its first lease
/// (or 5 s have passed): load sent earlier queues in the listen backlog and
/// arrives at once, a burst that reads as twice the offered rate.
async fn wait_for_sidecars(sidecars: &[Sidecar]) -> Result<(), RunError> {
    for s in sidecars {
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(s.admin).await.is_err() {
            if Instant::now() > deadline {
                return Err(RunError::Other(format!("a demo sidecar did not start on {}", s.admin)));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for s in sidecars {
        while !leased(s.admin).await && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Reads every sidecar once per whole second of load, on the second, and
/// prints the table unless quiet; returns the last (admitted, refused)
/// counts of each sidecar and the history the plots draw.
async fn watch(
    args: &DemoArgs,
    sidecars: &[Sidecar],
    counts: &[Arc<Counts>],
    start: Instant,
) -> (Vec<(u64, u64)>, History) {
    let mut last: Vec<(u64, u64)> = vec![(0, 0); sidecars.len()];
    let mut history: History = Vec::new();
    let mut tick = tokio::time::interval_at((start + Duration::from_secs(1)).into(), Duration::from_secs(1));
    for _ in 0..args.duration.as_secs() {
        tick.tick().await;
        let mut lines = Vec::new();
        let mut total_has = 0.0;
        let mut point = Vec::new();
        // The counts first, all at once, then the slower status reads.
        let now: Vec<(u64, u64)> =
            counts.iter().map(|c| (c.ok.load(Ordering::Relaxed), c.refused.load(Ordering::Relaxed))).collect();
        for (i, s) in sidecars.iter().enumerate() {
            let (wants, has) = lease_of(s.admin).await;
            let (ok, refused) = now[i];
            let (d_ok, d_ref) = (ok - last[i].0, refused - last[i].1);
            last[i] = (ok, refused);
            total_has += has;
            point.push((has, d_ok as f64));
            let (name, offered) = (&s.name, s.offered);
            lines.push(format!("  {name:<10} {offered:>8.0} {wants:>8.1} {has:>8.1} {d_ok:>12} {d_ref:>11}"));
        }
        history.push((start.elapsed().as_secs_f64(), point));
        if !args.quiet && !args.json {
            let mut shown = out!(
                "t={:>3.0}s      offered    wants      has   admitted/s   refused/s",
                start.elapsed().as_secs_f64()
            );
            for l in lines {
                shown &= out!("{l}");
            }
            shown &= out!("  {:<10} {:>8} {:>8} {total_has:>8.1}   (capacity {CAPACITY})\n", "total", "", "");
            if !shown {
                // Nobody reads the table any more (`| head`): the demo ends here.
                break;
            }
        }
    }
    (last, history)
}

/// `usher demo`.
pub async fn run(args: DemoArgs, shutdown: CancellationToken) -> Result<(), RunError> {
    let (summary, history, admitted_each_second) = tokio::select! {
        s = run_demo(&args) => s?,
        _ = shutdown.cancelled() => return Ok(()),
    };
    let min_after_first = admitted_each_second.iter().skip(1).copied().min().unwrap_or(0);
    if args.json {
        let report = DemoReport {
            capacity_per_s: CAPACITY,
            sidecars: summary,
            admitted_each_second,
            min_admitted_after_first_second: min_after_first,
        };
        out!("{}", serde_json::to_string_pretty(&report).expect("report serialises"));
        return Ok(());
    }
    if let Some(path) = &args.plot {
        let colors = [[30, 150, 60], [40, 90, 200], [200, 120, 20]];
        let mut series = vec![crate::plot::Series {
            name: "capacity".into(),
            rgb: [200, 40, 40],
            points: history.iter().map(|(t, _)| (*t, CAPACITY)).collect(),
        }];
        for (i, rgb) in colors.iter().enumerate() {
            series.push(crate::plot::Series {
                name: format!("lease {i}"),
                rgb: *rgb,
                points: history.iter().map(|(t, p)| (*t, p[i].0)).collect(),
            });
        }
        crate::plot::line_chart(path, "usher demo: each sidecar's lease", &series)
            .map_err(|e| RunError::Other(format!("cannot write {}: {e}", path.display())))?;
        out!("plot written to {}", path.display());
    }
    out!("summary over {:?} (capacity {CAPACITY}/s, FAIR_SHARE):", args.duration);
    out!("  {:<10} {:>10} {:>12} {:>11} {:>10}", "sidecar", "offered/s", "admitted/s", "refused/s", "lease");
    let mut total = 0.0;
    for s in &summary {
        total += s.admitted_per_s;
        out!(
            "  {:<10} {:>10.0} {:>12.1} {:>11.1} {:>10.1}",
            s.name,
            s.offered_per_s,
            s.admitted_per_s,
            s.refused_per_s,
            s.has
        );
    }
    out!("  {:<10} {:>10} {:>12.1}   (never above the capacity plus bursts)", "total", "", total);
    out!(
        "  admitted each second after the first: at least {min_after_first} of {CAPACITY} ({:?})",
        &admitted_each_second[1.min(admitted_each_second.len())..]
    );
    out!(
        "Each sidecar asks for its measured demand plus 10% headroom (1% once its demand holds steady);\n\
         the server shares the capacity max-min fairly, so the lightest sidecar gets what it asks for and\n\
         the others split the rest evenly."
    );
    Ok(())
}
