//! GetCapacity throughput and latency of a real `usher server` process with
//! many distinct clients on one FAIR_SHARE resource.
//!
//! `cargo bench --bench server_load` runs the full measurement (10,000 clients,
//! 10 s); `-- --test` runs a one-second smoke version (what CI does). Options:
//! `--clients N --connections N --concurrency N --seconds N`, and
//! `--server-cpu LIST` to pin the server with `taskset` (`benches/run.sh`
//! pins it to one core and this generator to the other).
//! The load generator shares the machine with the server, so on a 2-core box
//! the figures are a lower bound.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::io::BufRead;
use usher::proto::capacity_client::CapacityClient;
use usher::proto::{GetCapacityRequest, ResourceRequest};

const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 10000\n    algorithm: { kind: FAIR_SHARE, lease_length: 300, refresh_interval: 60, learning_mode_duration: 0 }\n";

struct Opts {
    clients: u64,
    connections: usize,
    concurrency: usize,
    seconds: u64,
    server_cpu: Option<String>,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`; `cargo test --benches` and `-- --test` ask for a smoke run.
    let smoke = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let get = |name: &str, default: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Opts {
        clients: get("--clients", if smoke { 200 } else { 10_000 }),
        connections: get("--connections", 4) as usize,
        concurrency: get("--concurrency", 64) as usize,
        seconds: get("--seconds", if smoke { 1 } else { 10 }),
        server_cpu: args.iter().position(|a| a == "--server-cpu").and_then(|i| args.get(i + 1)).cloned(),
    }
}

fn main() {
    let o = opts();
    let dir = std::env::temp_dir().join(format!("usher-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("resources.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let mut cmd = match &o.server_cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpu, env!("CARGO_BIN_EXE_usher")]);
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_usher")),
    };
    let mut child = cmd
        .args(["server", "--config", cfg.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--min-request-interval", "0s"])
        .env("USHER_LOG", "warn,usher::server=info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start usher server");
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut addr = None;
    for line in stderr.lines().map_while(Result::ok) {
        if let Some(rest) = line.split("grpc=").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_string);
            break;
        }
    }
    let addr = addr.expect("server address in log");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let result = rt.block_on(run(&o, &addr));
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let (count, elapsed, mut lat) = result;
    lat.sort_unstable();
    let pct =
        |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0);
    println!(
        "server_load: clients={} connections={} concurrency={} seconds={:.1} requests={} rate={:.0}/s p50={}us p99={}us p99.9={}us max={}us",
        o.clients,
        o.connections,
        o.concurrency,
        elapsed.as_secs_f64(),
        count,
        count as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99),
        pct(0.999),
        lat.last().copied().unwrap_or(0)
    );
}

async fn run(o: &Opts, addr: &str) -> (u64, Duration, Vec<u32>) {
    let mut channels = Vec::new();
    for _ in 0..o.connections {
        channels.push(CapacityClient::connect(format!("http://{addr}")).await.expect("connect"));
    }
    // Register every client once so the resource holds `clients` leases.
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
                    c.get_capacity(request(n, 1.0 + (n % 7) as f64)).await.expect("warm-up request");
                }
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
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
                    c.get_capacity(request(n, 1.0 + (n % 13) as f64)).await.expect("request");
                    lat.push(t.elapsed().as_micros() as u32);
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    (all.len() as u64, start.elapsed(), all)
}

fn request(n: u64, wants: f64) -> GetCapacityRequest {
    GetCapacityRequest {
        client_id: format!("client-{n}"),
        resource: vec![ResourceRequest { resource_id: "shared".into(), priority: 0, has: None, wants }],
    }
}
