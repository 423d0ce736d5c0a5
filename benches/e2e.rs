//! End-to-end comparison in one run: a minimal upstream called directly,
//! through a real `usher proxy` and through nginx (`proxy_pass` +
//! `limit_req`), alternating A/B/C in rounds, plus enforcement accuracy
//! (usher's rate and gauge resources against nginx's `limit_req` and
//! `limit_conn`) and a soak mode. `benches/run.sh` is the way to run it;
//! see benches/README.md.
//!
//! The tool itself (load generator and upstream) runs on a current-thread
//! runtime; `run.sh` pins it to one core and the proxies, through
//! `--proxy-cpu`, to the other.
//!
//! `cargo test --benches` (no `--bench` argument) runs a few-second smoke
//! version against usher only.

#![allow(clippy::disallowed_methods, reason = "benchmarks time real processes on the wall clock")]

#[path = "loadgen/mod.rs"]
mod loadgen;

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use loadgen::{OpenLoop, procfs};

// === options ===

struct Opts {
    smoke: bool,
    rounds: usize,
    seconds: f64,
    rates: Vec<f64>,
    sweep: Vec<f64>,
    sweep_seconds: f64,
    /// Interleaved passes over the sweep; each rate is judged by its median across them.
    sweep_rounds: usize,
    conns: usize,
    acc_seconds: f64,
    gauge_seconds: f64,
    nginx: bool,
    no_accuracy: bool,
    proxy_cpu: Option<String>,
    out: PathBuf,
    soak: Option<f64>,
    soak_rate: f64,
    usher_env: Vec<(String, String)>,
    /// Extra usher targets, each with its own environment (`--variant=NAME:ENV=VALUE`),
    /// binary (`--variant=NAME:bin=PATH`) or both, comma-separated
    /// (`--variant=NAME:bin=PATH,ENV=VALUE`), for before/after comparisons in one run.
    variants: Vec<(String, Vec<(String, String)>)>,
    /// `--callgrind S`: count instructions per request under valgrind for S seconds per target.
    callgrind: Option<f64>,
    /// `--quota-answers`: the upstreams' answers carry GitHub's quota headers
    /// and a cost (`x-usage`), which `quota=` variants read (loadgen::Seen::quota).
    quota_answers: bool,
    /// `--idle S`: measure each proxy's cost while idle for S seconds.
    idle: Option<f64>,
    /// `--idle-settle S`: seconds between the traffic and the idle measurement
    /// (default 3; past the pools' 90 s idle timeout to see the steady state).
    idle_settle: f64,
    /// `--keys N,N,...`: first requests of N new tenant keys, then N known ones, per proxy.
    keys: Vec<u64>,
    /// Requests per second of the `--keys` runs.
    keys_rate: f64,
    /// `--new-keys`: `--callgrind`'s keyed rounds name tenants not seen
    /// before (each request makes its key), where they repeat known ones.
    new_keys: bool,
    /// `--upstream https` (TLS 1.3, ALPN http/1.1) or `--upstream h2` (ALPN h2 and
    /// http/1.1): each proxy reaches its own TLS upstream; `None` is plain HTTP/1.1.
    tls: Option<bool>,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    let smoke = args.iter().any(|a| a == "--test") || !args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let num = |name: &str, full: f64, quick_v: f64, smoke_v: f64| {
        get(name).and_then(|v| v.parse().ok()).unwrap_or(if smoke {
            smoke_v
        } else if quick {
            quick_v
        } else {
            full
        })
    };
    let list = |name: &str, default: &str| -> Vec<f64> {
        get(name).unwrap_or_else(|| default.to_string()).split(',').filter_map(|v| v.trim().parse().ok()).collect()
    };
    let (rates, sweep) = if smoke {
        (list("--rates", "500"), list("--sweep", ""))
    } else if quick {
        (list("--rates", "2000,10000"), list("--sweep", "5000,15000,25000,40000"))
    } else {
        (list("--rates", "2000,10000"), list("--sweep", "2000,5000,10000,15000,20000,25000,30000,40000,50000,60000"))
    };
    Opts {
        smoke,
        rounds: num("--rounds", 4.0, 2.0, 1.0) as usize,
        seconds: num("--seconds", 10.0, 2.0, 0.5),
        rates,
        sweep,
        sweep_seconds: num("--sweep-seconds", 5.0, 2.0, 0.5),
        sweep_rounds: (num("--sweep-rounds", 3.0, 1.0, 1.0) as usize).max(1),
        conns: num("--connections", 64.0, 64.0, 8.0) as usize,
        acc_seconds: num("--accuracy-seconds", 30.0, 5.0, 1.0),
        gauge_seconds: num("--gauge-seconds", 10.0, 3.0, 0.5),
        nginx: !smoke && !args.iter().any(|a| a == "--no-nginx"),
        no_accuracy: args.iter().any(|a| a == "--no-accuracy"),
        proxy_cpu: get("--proxy-cpu"),
        out: PathBuf::from(
            get("--out").unwrap_or_else(|| std::env::temp_dir().join("usher-e2e").display().to_string()),
        ),
        soak: get("--soak").and_then(|v| v.parse().ok()),
        callgrind: get("--callgrind").and_then(|v| v.parse().ok()),
        quota_answers: args.iter().any(|a| a == "--quota-answers"),
        idle: get("--idle").and_then(|v| v.parse().ok()),
        idle_settle: get("--idle-settle").and_then(|v| v.parse().ok()).unwrap_or(3.0),
        keys: list("--keys", "").into_iter().map(|n| n as u64).collect(),
        keys_rate: num("--keys-rate", 5000.0, 5000.0, 1000.0),
        new_keys: args.iter().any(|a| a == "--new-keys"),
        tls: match get("--upstream").as_deref() {
            None | Some("http") => None,
            Some("https") => Some(false),
            Some("h2") => Some(true),
            Some(other) => panic!("--upstream {other}: expected http, https or h2"),
        },
        soak_rate: num("--soak-rate", 5000.0, 5000.0, 500.0),
        usher_env: args
            .iter()
            .filter_map(|a| a.strip_prefix("--usher-env="))
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect(),
        variants: args
            .iter()
            .filter_map(|a| a.strip_prefix("--variant="))
            .filter_map(|v| {
                let (name, kvs) = v.split_once(':')?;
                let kvs = kvs.split(',').map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())));
                Some((name.to_string(), kvs.collect::<Option<Vec<_>>>()?))
            })
            .collect(),
    }
}

// === processes ===

/// A child process killed on drop (so a panic leaves nothing behind).
struct Proc {
    child: Child,
    /// The process to measure (nginx's worker rather than its master).
    pid: u32,
    extra: Vec<u32>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        for pid in std::iter::once(self.child.id()).chain(self.extra.iter().copied()) {
            let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in &self.extra {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
        }
    }
}

fn pinned(o: &Opts, program: &Path) -> Command {
    let mut c = match &o.proxy_cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpu]);
            c
        }
        None if o.callgrind.is_some() => Command::new("valgrind"),
        None => return Command::new(program),
    };
    if o.callgrind.is_some() {
        if o.proxy_cpu.is_some() {
            c.arg("valgrind");
        }
        let out = o.out.join(format!("callgrind.{}.%p", program.file_name().unwrap().to_string_lossy()));
        c.args(["--tool=callgrind", "--quiet"]).arg(format!("--callgrind-out-file={}", out.display()));
    }
    c.arg(program);
    c
}

fn record_pid(out: &Path, pid: u32) {
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(out.join("pids")) {
        let _ = writeln!(f, "{pid}");
    }
}

/// The upstream a proxy sends to: the plain one, or (`--upstream https|h2`)
/// a TLS upstream of its own, so each proxy's connections and handshakes are
/// counted apart.
#[derive(Clone)]
struct Up {
    addr: SocketAddr,
    seen: std::sync::Arc<loadgen::Seen>,
    /// The CA file, for a TLS upstream.
    ca: Option<PathBuf>,
}

impl Up {
    async fn plain(o: &Opts) -> Up {
        let (addr, seen) = loadgen::upstream().await;
        seen.quota.store(o.quota_answers, std::sync::atomic::Ordering::Relaxed);
        Up { addr, seen, ca: None }
    }

    /// A fresh TLS upstream when `o.tls` asks for one, else `plain`.
    async fn for_proxy(o: &Opts, dir: &Path, plain: &Up) -> Up {
        let Some(h2) = o.tls else { return plain.clone() };
        let pki = loadgen::Pki::new();
        let (addr, seen) = loadgen::tls_upstream(&pki, h2).await;
        seen.quota.store(o.quota_answers, std::sync::atomic::Ordering::Relaxed);
        let ca = dir.join(format!("ca-{}.pem", addr.port()));
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        Up { addr, seen, ca: Some(ca) }
    }
}

/// usher's routes: a non-limiting route for the overhead runs, a rate of
/// 1,000/s under `/rate` and a gauge of 50 under `/gauge` for accuracy;
/// with `tenants`, also a rate of 1,000/s per `x-tenant` under `/tenant`.
/// `http2` is the upstream's setting of that name. `quota` (a variant's
/// `quota=`): `headers` makes the non-limiting route read the upstream's
/// quota headers (GitHub's), `settle` settle a cost from a response
/// header, `on` both.
fn usher_routes(up: &Up, tenants: bool, http2: bool, quota: &str) -> String {
    let (resource, route) = if tenants {
        (
            "  tenant: { kind: rate, capacity: 1000/s, burst: 50, id: \"t/{header.x-tenant}\", max_keys: 2000000 }\n",
            "  - { name: tenant, match: { path_prefix: /tenant }, upstream: up, resources: [tenant] }\n",
        )
    } else {
        ("", "")
    };
    let upstream = match &up.ca {
        None => format!("url: \"http://{}\"", up.addr),
        // `http2` only when off: an older binary (`--variant=NAME:bin=...`) may not know the field.
        Some(ca) => format!(
            "url: \"https://{}\", ca_file: \"{}\"{}",
            up.addr,
            ca.display(),
            if http2 { "" } else { ", http2: false" }
        ),
    };
    let headers = matches!(quota, "on" | "headers");
    let settle = matches!(quota, "on" | "settle");
    let quota_resource = if headers { ", upstream_quota: { headers: github }" } else { "" };
    let open_route = if settle {
        "{ name: open, upstream: up, resources: [{ resource: open-rate, settle: { response_header: x-usage } }, open-gauge] }"
    } else {
        "{ name: open, upstream: up, resources: [open-rate, open-gauge] }"
    };
    format!(
        "upstreams:\n  up: {{ {upstream} }}\n\
         resources:\n  \
           open-rate: {{ kind: rate, capacity: 10000000/s, burst: 100000{quota_resource} }}\n  \
           open-gauge: {{ kind: gauge, capacity: 100000 }}\n  \
           acc-rate: {{ kind: rate, capacity: 1000/s, burst: {BURST} }}\n  \
           acc-gauge: {{ kind: gauge, capacity: 50, max_wait: 1s }}\n\
         {resource}\
         routes:\n\
         {route}  \
           - {{ name: rate, match: {{ path_prefix: /rate }}, upstream: up, resources: [acc-rate] }}\n  \
           - {{ name: gauge, match: {{ path_prefix: /gauge }}, upstream: up, resources: [acc-gauge] }}\n  \
           - {open_route}\n"
    )
}

const BURST: u64 = 50;

/// Starts `usher proxy` towards `up`. `extra_env` holds environment settings,
/// and three of the bench's own: `bin=PATH` (another binary), `h2=off`
/// (`http2: false` on the upstream) and `quota=on|headers|settle` (the open
/// route reads quota headers, settles a cost, or both: see [`usher_routes`]).
fn start_usher(o: &Opts, dir: &Path, up: &Up, extra_env: &[(String, String)]) -> (Proc, SocketAddr) {
    let tag: String = extra_env.iter().map(|(k, v)| format!("-{k}={v}")).collect::<String>().replace(['/', ' '], "_");
    let routes = dir.join(format!("routes-{}{tag}.yaml", up.addr.port()));
    let http2 = !extra_env.iter().any(|(k, v)| k == "h2" && v == "off");
    let quota = extra_env.iter().find(|(k, _)| k == "quota").map_or("", |(_, v)| v.as_str());
    std::fs::write(&routes, usher_routes(up, !o.keys.is_empty(), http2, quota)).unwrap();
    let bin = extra_env.iter().find(|(k, _)| k == "bin").map_or(env!("CARGO_BIN_EXE_usher"), |(_, v)| v.as_str());
    let mut cmd = pinned(o, Path::new(bin));
    cmd.args([
        "proxy",
        "--routes",
        routes.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .env("USHER_LOG", "warn,usher=info")
    .env("NO_COLOR", "1")
    .stderr(Stdio::piped());
    for (k, v) in o.usher_env.iter().chain(extra_env).filter(|(k, _)| k != "bin" && k != "h2" && k != "quota") {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start usher proxy");
    let pid = child.id();
    record_pid(&o.out, pid);
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    // Keeps draining stderr so usher never blocks on a full pipe.
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if line.contains("usher proxy listening") {
                let addr: Option<SocketAddr> =
                    line.split_whitespace().find_map(|w| w.strip_prefix("listen=")).and_then(|a| a.parse().ok());
                let _ = tx.send(addr);
            } else if line.contains("WARN") || line.contains("ERROR") {
                eprintln!("usher: {line}");
            }
        }
    });
    let proc = Proc { child, pid, extra: vec![] };
    let addr = rx.recv_timeout(Duration::from_secs(30)).ok().flatten().expect("usher proxy did not start");
    (proc, addr)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn nginx_conf(dir: &Path, port: u16, up: &Up, single_process: bool, tenants: bool) -> String {
    let d = dir.display();
    // To a TLS upstream: verified against its CA, sessions reused, connections kept.
    let (scheme, tls) = match &up.ca {
        None => ("http", String::new()),
        Some(ca) => (
            "https",
            format!(
                "proxy_ssl_trusted_certificate {}; proxy_ssl_verify on; proxy_ssl_name localhost; \
                 proxy_ssl_server_name on; proxy_ssl_protocols TLSv1.3; proxy_ssl_session_reuse on;",
                ca.display()
            ),
        ),
    };
    let up = up.addr;
    // As usher's `/tenant` route: 1,000/s per `x-tenant` (a 256 MB zone holds some 2,000,000
    // keys, as usher's `max_keys`; only the pages its keys touch count in RSS).
    let (zone, location) = if tenants {
        (
            "limit_req_zone $http_x_tenant zone=tenants:256m rate=1000r/s;",
            format!("location /tenant {{ limit_req zone=tenants burst=50 nodelay; proxy_pass {scheme}://up; }}"),
        )
    } else {
        ("", String::new())
    };
    // Under valgrind, the process that serves must be the one started.
    let master = if single_process { "off" } else { "on" };
    format!(
        r#"worker_processes 1;
master_process {master};
daemon off;
user root;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  upstream up {{ server {up}; keepalive 128; keepalive_requests 100000000; }}
  limit_req_zone $binary_remote_addr zone=open:1m rate=10000000r/s;
  limit_req_zone $binary_remote_addr zone=acc:1m rate=1000r/s;
  limit_conn_zone $binary_remote_addr zone=conc:1m;
  {zone}
  limit_req_status 429;
  limit_conn_status 429;
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  {tls}
  server {{
    listen 127.0.0.1:{port};
    location / {{ limit_req zone=open burst=100000 nodelay; proxy_pass {scheme}://up; }}
    location /rate {{ limit_req zone=acc burst={BURST} nodelay; proxy_pass {scheme}://up; }}
    location /gauge {{ limit_conn conc 50; proxy_pass {scheme}://up; }}
    {location}
  }}
}}
"#
    )
}

fn start_nginx(o: &Opts, dir: &Path, up: &Up) -> Option<(Proc, SocketAddr)> {
    let bin = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())?;
    let port = free_port();
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, nginx_conf(dir, port, up, o.callgrind.is_some(), !o.keys.is_empty())).unwrap();
    let child = pinned(o, bin)
        .args(["-c", conf.to_str().unwrap(), "-p", dir.to_str().unwrap(), "-e", "stderr"])
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let master = child.id();
    record_pid(&o.out, master);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut proc = Proc { child, pid: master, extra: vec![] };
    while Instant::now() < deadline {
        if o.callgrind.is_some() && std::net::TcpStream::connect(addr).is_ok() {
            return Some((proc, addr));
        }
        if let Some(worker) = procfs::first_child(master)
            && std::net::TcpStream::connect(addr).is_ok()
        {
            record_pid(&o.out, worker);
            proc.pid = worker;
            proc.extra.push(worker);
            return Some((proc, addr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("nginx did not start; see {}/nginx-error.log", dir.display());
    None
}

// === statistics ===

fn median(v: &mut [f64]) -> f64 {
    let v: &mut Vec<f64> = &mut v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// One measurement on stderr, as it is taken.
fn progress(what: &str, rate: f64, target: &str, s: &Sample) {
    eprintln!(
        "{what} {rate:>6} req/s {target:>6}: p50 {:>7.0} µs p99 {:>7.0} µs p99.9 {:>7.0} µs errors {} cpu/1k {:.1} ms (user {:.1})",
        s.p50, s.p99, s.p999, s.errors, s.cpu_per_k, s.user_per_k
    );
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter().filter(|x| x.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)))
}

/// "median (min–max)" in µs.
fn mmm(v: &[f64]) -> String {
    let (lo, hi) = min_max(v);
    let m = median(&mut v.to_vec());
    if v.len() == 1 { format!("{m:.0}") } else { format!("{m:.0} ({lo:.0}–{hi:.0})") }
}

fn rate_label(r: f64) -> String {
    if r >= 1000.0 { format!("{}k", r / 1000.0) } else { format!("{r}") }
}

// === targets ===

struct Target {
    name: String,
    addr: SocketAddr,
    proc: Option<Proc>,
    /// The upstream this target sends to.
    up: Up,
}

#[derive(Clone)]
struct Sample {
    /// Requests scheduled.
    requests: u64,
    p50: f64,
    p99: f64,
    p999: f64,
    errors: u64,
    /// CPU per 1,000 requests (= µs per request), in all and in user space.
    cpu_per_k: f64,
    user_per_k: f64,
}

impl Sample {
    /// The kernel's part of `cpu_per_k`.
    fn sys_per_k(&self) -> f64 {
        self.cpu_per_k - self.user_per_k
    }

    /// Each figure's median over `samples` (one noisy round does not decide).
    fn median_of(samples: &[Sample]) -> Sample {
        let m = |f: fn(&Sample) -> f64| median(&mut samples.iter().map(f).collect::<Vec<_>>());
        Sample {
            requests: m(|s| s.requests as f64) as u64,
            p50: m(|s| s.p50),
            p99: m(|s| s.p99),
            p999: m(|s| s.p999),
            errors: m(|s| s.errors as f64) as u64,
            cpu_per_k: m(|s| s.cpu_per_k),
            user_per_k: m(|s| s.user_per_k),
        }
    }
}

async fn measure(t: &Target, rate: f64, secs: f64, conns: usize) -> Sample {
    let pid = t.proc.as_ref().map(|p| p.pid);
    let cpu0 = pid.and_then(procfs::cpu_split_ms);
    let r: OpenLoop = loadgen::open_loop(t.addr, "/x", rate, Duration::from_secs_f64(secs), conns).await;
    let cpu1 = pid.and_then(procfs::cpu_split_ms);
    let per_k = |ms: u64| ms as f64 / (r.lat_ns.len() as f64 / 1000.0);
    let (cpu_per_k, user_per_k) = match (cpu0, cpu1) {
        (Some(a), Some(b)) if !r.lat_ns.is_empty() => (per_k(b.0 + b.1 - a.0 - a.1), per_k(b.0 - a.0)),
        _ => (f64::NAN, f64::NAN),
    };
    Sample {
        requests: r.scheduled,
        p50: r.pct_us(0.5),
        p99: r.pct_us(0.99),
        p999: r.pct_us(0.999),
        errors: r.errors,
        cpu_per_k,
        user_per_k,
    }
}

fn rotate<T>(v: &[T], by: usize) -> impl Iterator<Item = (usize, &T)> {
    (0..v.len()).map(move |i| {
        let j = (i + by) % v.len();
        (j, &v[j])
    })
}

// === the run ===

/// Plots `sweep.csv` (series,rate,added_us) as added latency against offered rate,
/// values clamped at `PLOT_CAP_US` so the p50 lines stay readable next to the p99 ones.
fn plot(csv: &Path, png: &Path) {
    let text = std::fs::read_to_string(csv).expect("sweep.csv");
    let colours = [[0, 90, 200], [120, 170, 240], [0, 150, 60], [120, 210, 140]];
    let names = ["usher added p50", "usher added p99", "nginx added p50", "nginx added p99"];
    let series: Vec<usher::plot::Series> = names
        .iter()
        .zip(colours)
        .map(|(name, rgb)| usher::plot::Series {
            name: name.to_string(),
            rgb,
            points: text
                .lines()
                .skip(1)
                .filter_map(|l| {
                    let mut f = l.split(',');
                    (f.next()? == *name).then_some(())?;
                    let x: f64 = f.next()?.parse().ok()?;
                    let y: f64 = f.next()?.parse().ok()?;
                    Some((x / 1000.0, y.min(PLOT_CAP_US)))
                })
                .collect(),
        })
        .collect();
    let title = format!("added latency (us, capped at {PLOT_CAP_US}) against offered rate");
    usher::plot::line_chart_with_x(png, &title, "offered rate (k req/s)", &series).unwrap();
}

const PLOT_CAP_US: f64 = 5000.0;

fn main() {
    let o = opts();
    if let Some(i) = std::env::args().position(|a| a == "--plot-only") {
        // Redraws latency.png from a previous run's sweep.csv.
        let dir = PathBuf::from(std::env::args().nth(i + 1).expect("--plot-only DIR"));
        plot(&dir.join("sweep.csv"), &dir.join("latency.png"));
        return;
    }
    std::fs::create_dir_all(&o.out).unwrap();
    let _ = std::fs::remove_file(o.out.join("pids"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        if let Some(secs) = o.soak {
            soak(&o, secs).await;
        } else if let Some(secs) = o.callgrind {
            instructions(&o, secs).await;
        } else if let Some(secs) = o.idle {
            idle(&o, secs).await;
        } else if !o.keys.is_empty() {
            keys(&o).await;
        } else {
            compare(&o).await;
        }
    });
}

/// Many tenant keys: for each count N, each proxy gets N requests at
/// `--keys-rate`, each naming a tenant it has not seen (its first request
/// makes the key: in usher a limiter and, at the lease client's next read,
/// a lease; in nginx a node of its `limit_req` zone), then the same N
/// tenants again. Latency is added over nothing (no direct call here),
/// from each request's intended send time; CPU per request from `/proc`.
async fn keys(o: &Opts) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::plain(o).await;
    let targets = proxies(o, dir.path(), &up).await;
    let mut md = format!(
        "### Many tenant keys ({} req/s over {} connections, a rate of 1,000/s per tenant)\n\n\
         | keys | target | new keys p50 (µs) | p99 | CPU ms / 1k req | known keys p50 (µs) | p99 | CPU ms / 1k req | errors | RSS after (MB) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        o.keys_rate, o.conns
    );
    for &n in &o.keys {
        for t in &targets {
            let pid = t.proc.as_ref().unwrap().pid;
            let secs = n as f64 / o.keys_rate;
            let prefix: std::sync::Arc<str> = format!("{n}-").into();
            let mut row = format!("| {n} | {} ", t.name);
            let mut errors = 0;
            for pass in ["new", "known"] {
                let cpu0 = procfs::cpu_ms(pid).unwrap_or(0);
                let r = loadgen::open_loop_keyed(
                    t.addr,
                    "/tenant",
                    o.keys_rate,
                    Duration::from_secs_f64(secs),
                    o.conns,
                    Some(prefix.clone()),
                )
                .await;
                let cpu = procfs::cpu_ms(pid).unwrap_or(0).saturating_sub(cpu0) as f64;
                let per_k = cpu / (r.scheduled as f64 / 1000.0);
                eprintln!(
                    "keys {n} {} {pass}: p50 {:.0} µs p99 {:.0} µs cpu/1k {per_k:.1} ms errors {}",
                    t.name,
                    r.pct_us(0.5),
                    r.pct_us(0.99),
                    r.errors
                );
                row.push_str(&format!("| {:.0} | {:.0} | {per_k:.1} ", r.pct_us(0.5), r.pct_us(0.99)));
                errors += r.errors;
            }
            let rss = t.proc.as_ref().and_then(|p| procfs::status_mb(p.pid, "VmRSS")).unwrap_or(f64::NAN);
            md.push_str(&format!("{row}| {errors} | {rss:.1} |\n"));
        }
    }
    print!("{md}");
}

/// usher, its variants and nginx (if there is one), in that order, each
/// towards `plain` or (`--upstream https|h2`) a TLS upstream of its own.
async fn proxies(o: &Opts, dir: &Path, plain: &Up) -> Vec<Target> {
    let mut targets = Vec::new();
    let up = Up::for_proxy(o, dir, plain).await;
    let (usher, addr) = start_usher(o, dir, &up, &[]);
    targets.push(Target { name: "usher".into(), addr, proc: Some(usher), up });
    for (name, env) in &o.variants {
        let up = Up::for_proxy(o, dir, plain).await;
        let (p, addr) = start_usher(o, dir, &up, env);
        targets.push(Target { name: format!("usher {name}"), addr, proc: Some(p), up });
    }
    if o.nginx {
        let up = Up::for_proxy(o, dir, plain).await;
        match start_nginx(o, dir, &up) {
            Some((p, addr)) => targets.push(Target { name: "nginx".into(), addr, proc: Some(p), up }),
            None => {
                eprintln!("nginx not found or did not start: install Debian's `nginx` package (run.sh does, as root)")
            }
        }
    }
    targets
}

/// What an idle proxy costs: after a second of traffic (so pools, leases and
/// caches exist, as in a pod that served a while ago) and `--idle-settle` s,
/// each proxy is left alone for `secs`, all of them at once. CPU time comes
/// from every thread's `/proc/PID/task/TID/schedstat` (nanoseconds, not the
/// 10 ms ticks of `stat`), wake-ups from their context switches; nginx is
/// its master and its worker together.
async fn idle(o: &Opts, secs: f64) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::plain(o).await;
    let targets = proxies(o, dir.path(), &up).await;
    for t in &targets {
        measure(t, 1000.0, 1.0, 8).await;
    }
    tokio::time::sleep(Duration::from_secs_f64(o.idle_settle)).await;
    let pids = |t: &Target| -> Vec<u32> {
        let p = t.proc.as_ref().unwrap();
        let mut v = vec![p.child.id()];
        v.extend(p.extra.iter().copied().filter(|x| *x != p.child.id()));
        v
    };
    let reading = |t: &Target| -> (u64, u64) {
        pids(t).into_iter().filter_map(procfs::sched).fold((0, 0), |(c, w), (c2, w2)| (c + c2, w + w2))
    };
    let start: Vec<(u64, u64)> = targets.iter().map(reading).collect();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let end: Vec<(u64, u64)> = targets.iter().map(reading).collect();
    let mut md = format!(
        "### Idle cost ({secs} s idle, from {} s after 1 s of traffic at 1,000 req/s)\n\n\
         | target | CPU ms per idle hour | wake-ups per second | RSS (MB) | threads | processes |\n|---|---|---|---|---|---|\n",
        o.idle_settle
    );
    for (i, t) in targets.iter().enumerate() {
        let cpu_ns = end[i].0.saturating_sub(start[i].0) as f64;
        let switches = end[i].1.saturating_sub(start[i].1) as f64;
        let ps = pids(t);
        let rss: f64 = ps.iter().filter_map(|p| procfs::status_mb(*p, "VmRSS")).sum();
        let threads: usize = ps.iter().filter_map(|p| procfs::threads(*p)).sum();
        let worker_rss = t.proc.as_ref().and_then(|p| procfs::status_mb(p.pid, "VmRSS")).unwrap_or(f64::NAN);
        let rss = if ps.len() > 1 { format!("{rss:.1} (worker {worker_rss:.1})") } else { format!("{rss:.1}") };
        md.push_str(&format!(
            "| {} | {:.1} | {:.2} | {rss} | {threads} | {} |\n",
            t.name,
            cpu_ns / 1e6 * 3600.0 / secs,
            switches / secs,
            ps.len()
        ));
    }
    print!("{md}");
}

async fn compare(o: &Opts) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::plain(o).await;
    let mut md = String::new();
    // Direct is always the plain upstream: with `--upstream https|h2`, "added" includes the TLS leg.
    let mut targets = vec![Target { name: "direct".into(), addr: up.addr, proc: None, up: up.clone() }];
    targets.extend(proxies(o, dir.path(), &up).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pids: Vec<Option<u32>> = targets.iter().map(|t| t.proc.as_ref().map(|p| p.pid)).collect();
    let rss_idle: Vec<Option<f64>> = pids.iter().map(|p| p.and_then(|p| procfs::status_mb(p, "VmRSS"))).collect();
    let threads: Vec<Option<usize>> = pids.iter().map(|p| p.and_then(procfs::threads)).collect();

    // Warm up every path (connections, pools, caches). Towards a TLS upstream
    // this is each proxy's cold start: 64 connections' worth of requests at once.
    let mut cold = Vec::new();
    for t in &targets {
        let before = t.up.seen.tls();
        let s = measure(t, 2000.0, if o.smoke { 0.2 } else { 1.0 }, o.conns).await;
        cold.push((s.requests, t.up.seen.tls() - before));
    }
    let mut tls_rounds = vec![(0u64, loadgen::TlsCount::default()); targets.len()];

    // 1. Fixed rates, A/B/C rounds with the order rotated each round.
    let nt = targets.len();
    let mut fixed: Vec<Vec<Vec<Sample>>> = vec![vec![Vec::new(); nt]; o.rates.len()]; // [rate][target][round]
    let mut rss_load: Vec<f64> = vec![0.0; nt];
    for round in 0..o.rounds {
        for (ri, &rate) in o.rates.iter().enumerate() {
            for (ti, t) in rotate(&targets, round) {
                let before = t.up.seen.tls();
                let s = measure(t, rate, o.seconds, o.conns).await;
                tls_rounds[ti].0 += s.requests;
                tls_rounds[ti].1 += t.up.seen.tls() - before;
                progress(&format!("round {}", round + 1), rate, &t.name, &s);
                if let Some(pid) = pids[ti]
                    && let Some(rss) = procfs::status_mb(pid, "VmRSS")
                {
                    rss_load[ti] = rss_load[ti].max(rss);
                }
                fixed[ri][ti].push(s);
            }
        }
    }
    let hwm: Vec<Option<f64>> = pids.iter().map(|p| p.and_then(|p| procfs::status_mb(p, "VmHWM"))).collect();

    md.push_str(&format!(
        "### Added latency over direct, open loop, {} rounds of {} s per rate and target (µs, median (min–max) across rounds)\n\n",
        o.rounds, o.seconds
    ));
    md.push_str("| rate | target | p50 | p99 | p99.9 | added p50 | added p99 | added p99.9 | errors | CPU ms / 1k req | of which user / kernel |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (ri, &rate) in o.rates.iter().enumerate() {
        for (ti, t) in targets.iter().enumerate() {
            let col = |f: &dyn Fn(&Sample) -> f64| -> Vec<f64> { fixed[ri][ti].iter().map(f).collect() };
            let added = |f: &dyn Fn(&Sample) -> f64| -> Vec<f64> {
                fixed[ri][ti].iter().zip(&fixed[ri][0]).map(|(s, d)| f(s) - f(d)).collect()
            };
            let errors: u64 = fixed[ri][ti].iter().map(|s| s.errors).sum();
            let (a50, a99, a999, cpu, split) = if ti == 0 {
                ("–".to_string(), "–".to_string(), "–".to_string(), "–".to_string(), "–".to_string())
            } else {
                let cpu = col(&|s| s.cpu_per_k);
                let (lo, hi) = min_max(&cpu);
                (
                    mmm(&added(&|s| s.p50)),
                    mmm(&added(&|s| s.p99)),
                    mmm(&added(&|s| s.p999)),
                    format!("{:.1} ({lo:.1}–{hi:.1})", median(&mut cpu.clone())),
                    format!("{:.1} / {:.1}", median(&mut col(&|s| s.user_per_k)), median(&mut col(&|s| s.sys_per_k()))),
                )
            };
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {a50} | {a99} | {a999} | {errors} | {cpu} | {split} |\n",
                rate_label(rate),
                t.name,
                mmm(&col(&|s| s.p50)),
                mmm(&col(&|s| s.p99)),
                mmm(&col(&|s| s.p999)),
            ));
        }
    }
    if o.tls.is_some() {
        md.push_str(&format!(
            "\n### TLS to the upstream: connections and handshakes counted at the upstream\n\n\
             Cold start: the warm-up, 2,000 req/s over {} app connections for 1 s against a fresh proxy. \
             Rounds: every fixed-rate round above. Handshakes per 1,000 requests count full and resumed ones.\n\n\
             | target | cold start: connections | full | resumed | h2 | rounds: requests | new connections | full | resumed | handshakes / 1k req | connections open at the end |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
            o.conns
        ));
        for (ti, t) in targets.iter().enumerate().skip(1) {
            let (c, (n, r)) = (cold[ti].1, tls_rounds[ti]);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {n} | {} | {} | {} | {:.2} | {} |\n",
                t.name,
                c.conns,
                c.full,
                c.resumed,
                c.h2,
                r.conns,
                r.full,
                r.resumed,
                (r.full + r.resumed) as f64 * 1000.0 / n.max(1) as f64,
                t.up.seen.open.load(Ordering::SeqCst),
            ));
        }
    }
    md.push_str("\n### Memory and threads\n\n| target | threads | RSS idle | RSS under load (max at end of a round) | VmHWM |\n|---|---|---|---|---|\n");
    for (ti, t) in targets.iter().enumerate().skip(1) {
        let f = |v: Option<f64>| v.map(|v| format!("{v:.1} MB")).unwrap_or("–".into());
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} MB | {} |\n",
            t.name,
            threads[ti].map(|n| n.to_string()).unwrap_or("–".into()),
            f(rss_idle[ti]),
            rss_load[ti],
            f(hwm[ti])
        ));
    }

    // 2. The sweep for the knee: interleaved passes, rates rising in each;
    //    every figure of a rate is its median across the passes.
    if !o.sweep.is_empty() {
        let mut passes: Vec<Vec<(f64, Vec<Sample>)>> = vec![Vec::new(); nt];
        for pass in 0..o.sweep_rounds {
            let mut failed = vec![0usize; nt];
            for (k, &rate) in o.sweep.iter().enumerate() {
                for (ti, t) in rotate(&targets, k + pass) {
                    if failed[ti] >= 2 {
                        continue;
                    }
                    let s = measure(t, rate, o.sweep_seconds, o.conns.max((rate / 500.0) as usize)).await;
                    progress(&format!("sweep {}", pass + 1), rate, &t.name, &s);
                    // Past saturation (behind schedule, or queueing for tens of ms) twice running:
                    // higher rates say nothing new. Latency goals are judged afterwards.
                    if s.errors > 0 || s.p50 > 20_000.0 || s.p50.is_nan() {
                        failed[ti] += 1;
                    } else {
                        failed[ti] = 0;
                    }
                    match passes[ti].iter_mut().find(|(r, _)| *r == rate) {
                        Some((_, v)) => v.push(s),
                        None => passes[ti].push((rate, vec![s])),
                    }
                }
            }
        }
        let sweep: Vec<Vec<(f64, Sample)>> =
            passes.iter().map(|t| t.iter().map(|(rate, v)| (*rate, Sample::median_of(v))).collect()).collect();
        md.push_str(&format!(
            "\n### Sweep: {} pass(es) of {} s per rate and target, interleaved; medians across passes (µs; added = target − direct at the same rate)\n\n",
            o.sweep_rounds, o.sweep_seconds
        ));
        md.push_str("| rate |");
        for t in &targets {
            md.push_str(&format!(" {} p50 | {} p99 |", t.name, t.name));
        }
        md.push_str(" usher added p50 / p99 | nginx added p50 / p99 |\n|---|");
        for _ in &targets {
            md.push_str("---|---|");
        }
        md.push_str("---|---|\n");
        let at = |ti: usize, rate: f64| sweep[ti].iter().find(|(r, _)| *r == rate).map(|(_, s)| s.clone());
        let fmt = |s: &Option<Sample>, f: fn(&Sample) -> f64| match s {
            Some(s) if s.errors > 0 => format!("{:.0} ({} err)", f(s), s.errors),
            Some(s) => format!("{:.0}", f(s)),
            None => "–".into(),
        };
        let nginx_i = targets.iter().position(|t| t.name == "nginx");
        let mut usher_pts = (Vec::new(), Vec::new());
        let mut nginx_pts = (Vec::new(), Vec::new());
        for &rate in &o.sweep {
            md.push_str(&format!("| {} |", rate_label(rate)));
            for ti in 0..nt {
                let s = at(ti, rate);
                md.push_str(&format!(" {} | {} |", fmt(&s, |s| s.p50), fmt(&s, |s| s.p99)));
            }
            let d = at(0, rate);
            for (ti, pts) in [(Some(1usize), &mut usher_pts), (nginx_i, &mut nginx_pts)] {
                match ti.and_then(|ti| at(ti, rate)).zip(d.clone()) {
                    Some((s, d)) => {
                        md.push_str(&format!(" {:.0} / {:.0} |", s.p50 - d.p50, s.p99 - d.p99));
                        if s.errors == 0 && d.errors == 0 {
                            pts.0.push((rate / 1000.0, s.p50 - d.p50));
                            pts.1.push((rate / 1000.0, s.p99 - d.p99));
                        }
                    }
                    None => md.push_str(" – |"),
                }
            }
            md.push('\n');
        }
        md.push_str("\n### CPU per request in the sweep (µs: user + kernel), median across passes\n\n| rate |");
        for t in targets.iter().skip(1) {
            md.push_str(&format!(" {} |", t.name));
        }
        md.push_str("\n|---|");
        for _ in targets.iter().skip(1) {
            md.push_str("---|");
        }
        md.push('\n');
        for &rate in &o.sweep {
            md.push_str(&format!("| {} |", rate_label(rate)));
            for ti in 1..nt {
                match at(ti, rate) {
                    Some(s) if s.errors == 0 => {
                        md.push_str(&format!(" {:.1} + {:.1} = {:.1} |", s.user_per_k, s.sys_per_k(), s.cpu_per_k))
                    }
                    Some(_) => md.push_str(" (fell behind) |"),
                    None => md.push_str(" – |"),
                }
            }
            md.push('\n');
        }
        md.push_str(
            "\n### Knee: the highest sweep rate passing, every lower rate passing too\n\n\
             | target | p99 ≤ 1 ms, no errors | added p99 ≤ 1 ms over direct, no errors | keeping up: p50 ≤ 5 ms, no errors |\n|---|---|---|---|\n",
        );
        let top = o.sweep.last().copied().unwrap_or(0.0);
        let knee_of = |ti: usize, pass: &dyn Fn(f64, &Sample) -> bool| -> f64 {
            let mut knee = 0.0;
            for (rate, s) in &sweep[ti] {
                if pass(*rate, s) {
                    knee = *rate;
                } else {
                    break;
                }
            }
            knee
        };
        let show = |k: f64| if k == top { format!("{k} req/s or more") } else { format!("{k} req/s") };
        let mut rel_knees = Vec::new();
        let mut abs_knees = Vec::new();
        for (ti, t) in targets.iter().enumerate() {
            let abs = knee_of(ti, &|_, s| s.p99 <= 1000.0 && s.errors == 0);
            let rel = knee_of(ti, &|rate, s| {
                let d = at(0, rate);
                s.errors == 0 && d.is_some_and(|d| s.p99 - d.p99 <= 1000.0)
            });
            let up = knee_of(ti, &|_, s| s.p50 <= 5000.0 && s.errors == 0);
            md.push_str(&format!("| {} | {} | {} | {} |\n", t.name, show(abs), show(rel), show(up)));
            rel_knees.push(rel);
            abs_knees.push(abs);
        }
        if let Some(n) = nginx_i
            && rel_knees[n] > 0.0
            && abs_knees[n] > 0.0
        {
            md.push_str(&format!(
                "\nusher / nginx knee ratio: **{:.2}** (p99 ≤ 1 ms), **{:.2}** (added p99 ≤ 1 ms)\n",
                abs_knees[1] / abs_knees[n],
                rel_knees[1] / rel_knees[n]
            ));
        }
        // The soak runs at half of this: the relative knee, else the rate usher keeps up with.
        let soak_knee =
            if rel_knees[1] > 0.0 { rel_knees[1] } else { knee_of(1, &|_, s| s.p50 <= 5000.0 && s.errors == 0) };
        std::fs::write(o.out.join("knee.txt"), format!("{soak_knee}\n")).unwrap();
        let mut csv = String::from("series,rate,added_us\n");
        for (name, pts) in [
            ("usher added p50", &usher_pts.0),
            ("usher added p99", &usher_pts.1),
            ("nginx added p50", &nginx_pts.0),
            ("nginx added p99", &nginx_pts.1),
        ] {
            for (x, y) in pts.iter() {
                csv.push_str(&format!("{name},{},{y:.0}\n", x * 1000.0));
            }
        }
        std::fs::write(o.out.join("sweep.csv"), &csv).unwrap();
        let png = o.out.join("latency.png");
        plot(&o.out.join("sweep.csv"), &png);
        md.push_str(&format!("\nPlot: {}\n", png.display()));
    }

    // 3. Accuracy: usher's rate and gauge, then nginx's limit_req and limit_conn.
    if o.no_accuracy {
        println!("{md}");
        std::fs::write(o.out.join("results.md"), &md).unwrap();
        return;
    }
    md.push_str(&format!(
        "\n### Enforcement accuracy\n\nRate: capacity 1,000/s, burst {BURST}, 64 connections closed-loop for {} s; \
         accuracy = upstream count / (1000 × seconds + burst). Gauge: 50, 500 connections closed-loop for {} s, \
         upstream holds each request {} ms.\n\n\
         | target | rate: upstream count | seconds | accuracy | refused | other errors | gauge: max in flight at upstream | gauge: passed | refused |\n|---|---|---|---|---|---|---|---|---|\n",
        o.acc_seconds,
        o.gauge_seconds,
        loadgen::GAUGE_HOLD.as_millis()
    ));
    for t in targets.iter().filter(|t| t.name == "usher" || t.name == "nginx") {
        tokio::time::sleep(Duration::from_secs(1)).await; // let the burst refill
        let seen = &t.up.seen;
        seen.reset();
        let r = loadgen::closed_loop(t.addr, "/rate", 64, Duration::from_secs_f64(o.acc_seconds)).await;
        let count = seen.rate.load(Ordering::SeqCst);
        let secs = r.wall.as_secs_f64();
        let acc = count as f64 / (1000.0 * secs + BURST as f64);
        eprintln!("accuracy {}: rate {count} in {secs:.2} s = {acc:.4}; {r:?}", t.name);
        seen.reset();
        let g = loadgen::closed_loop(t.addr, "/gauge", 500, Duration::from_secs_f64(o.gauge_seconds)).await;
        let max = seen.gauge_max.load(Ordering::SeqCst);
        eprintln!("accuracy {}: gauge max {max}; {g:?}", t.name);
        md.push_str(&format!(
            "| {} | {count} | {secs:.2} | {:.2}% | {} | {} | {max} | {} | {} |\n",
            t.name,
            acc * 100.0,
            r.refused,
            r.other + g.other,
            g.ok,
            g.refused
        ));
    }
    println!("{md}");
    std::fs::write(o.out.join("results.md"), &md).unwrap();
}

/// Soak: open-loop load through usher in 10 s chunks, sampling RSS, open fds
/// and threads after each.
async fn soak(o: &Opts, secs: f64) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::plain(o).await;
    let (usher, addr) = start_usher(o, dir.path(), &up, &[]);
    let pid = usher.pid;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sample = || {
        (
            procfs::status_mb(pid, "VmRSS").unwrap_or(f64::NAN),
            procfs::fds(pid).unwrap_or(0),
            procfs::threads(pid).unwrap_or(0),
        )
    };
    let idle = sample();
    let mut md = format!(
        "### Soak: {} s at {} req/s through usher (10 s chunks)\n\nidle before load: RSS {:.1} MB, {} fds, {} threads\n\n\
         | t (s) | p50 µs | p99 µs | errors | RSS MB | fds | threads |\n|---|---|---|---|---|---|---|\n",
        secs, o.soak_rate, idle.0, idle.1, idle.2
    );
    let mut rows = Vec::new();
    let started = Instant::now();
    let target = Target { name: "usher".into(), addr, proc: Some(usher), up };
    // By wall time: a chunk that falls behind ends early, and the soak still lasts `secs`.
    while started.elapsed().as_secs_f64() < secs - 1.0 {
        let s = measure(&target, o.soak_rate, 10.0, o.conns).await;
        let (rss, fds, thr) = sample();
        let t = started.elapsed().as_secs_f64();
        eprintln!(
            "soak t={t:.0}s p50 {:.0} p99 {:.0} errors {} rss {rss:.1} fds {fds} threads {thr}",
            s.p50, s.p99, s.errors
        );
        md.push_str(&format!("| {t:.0} | {:.0} | {:.0} | {} | {rss:.1} | {fds} | {thr} |\n", s.p50, s.p99, s.errors));
        rows.push((rss, fds, s.errors));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let max_rss = rows.iter().map(|r| r.0).fold(0.0, f64::max);
        let max_fds = rows.iter().map(|r| r.1).max().unwrap_or(0);
        let errors: u64 = rows.iter().map(|r| r.2).sum();
        md.push_str(&format!(
            "\nRSS: first sample {:.1} MB, last {:.1} MB, max {max_rss:.1} MB (drift {:+.1} MB). fds: first {}, last {}, max {max_fds}. errors: {errors}.\n",
            first.0,
            last.0,
            last.0 - first.0,
            first.1,
            last.1
        ));
    }
    drop(target);
    println!("{md}");
    std::fs::write(o.out.join("soak.md"), &md).unwrap();
}

/// Instructions per request of `n` known tenant keys (`--callgrind S
/// --keys N`): `n` new tenants at 500/s make the keys, then callgrind counts
/// the same `n` again at that rate (each a key the table holds, among `n`),
/// [`KEYED_ROUNDS`] times. With `--new-keys`, each round names `n` tenants
/// not seen before instead: the cost of a request that makes its key. The whole process is counted, the lease client's
/// demand reads over every key included, and those come and go (a read
/// every 100 ms while keys are busy, none while the client sleeps), so a
/// round's total moves by a fifth: the least round is the figure. The
/// request path alone (what the connections' tasks run, from
/// `callgrind_annotate`'s inclusive count of `usher_proxy::serve_all`'s
/// connection closure) is given beside it, and moves by far less.
async fn keyed_instructions(o: &Opts, targets: &[Target], n: u64) -> String {
    let which = if o.new_keys { "new" } else { "known" };
    let mut md = format!(
        "\n| target | requests to {n} {which} tenant keys | instructions per request (least of {KEYED_ROUNDS}) | on the request path | ratio to usher |\n|---|---|---|---|---|\n"
    );
    let (rate, secs) = (500.0, Duration::from_secs_f64(n as f64 / 500.0));
    let mut first = None;
    for t in targets {
        let pid = t.proc.as_ref().unwrap().pid;
        let prefix: std::sync::Arc<str> = "known-".into();
        loadgen::open_loop_keyed(t.addr, "/tenant", rate, secs, 4, Some(prefix.clone())).await;
        let (mut best, mut path, mut ok) = (None::<f64>, None::<f64>, 0);
        for round in 0..KEYED_ROUNDS {
            callgrind_control(&["--zero", &pid.to_string()]);
            let tenants: std::sync::Arc<str> = match o.new_keys {
                true => format!("new{round}-").into(),
                false => prefix.clone(),
            };
            let r = loadgen::open_loop_keyed(t.addr, "/tenant", rate, secs, 4, Some(tenants)).await;
            let before: std::collections::HashSet<PathBuf> = dumps(&o.out).into_iter().collect();
            callgrind_control(&["--dump", &pid.to_string()]);
            let dump = dumps(&o.out)
                .into_iter()
                .find(|p| !before.contains(p) && p.to_string_lossy().contains(&format!(".{pid}.")));
            ok = r.scheduled.saturating_sub(r.errors).max(1);
            let per = dump.as_deref().and_then(callgrind_total).map(|n| n as f64 / ok as f64);
            let serving = dump.as_deref().and_then(request_path_total).map(|n| n as f64 / ok as f64);
            eprintln!(
                "{} keyed round {round}: {ok} requests ({} errors), {per:?} instructions each, {serving:?} on the request path",
                t.name, r.errors
            );
            best = match (best, per) {
                (Some(b), Some(p)) => Some(b.min(p)),
                (b, p) => b.or(p),
            };
            path = match (path, serving) {
                (Some(b), Some(p)) => Some(b.min(p)),
                (b, p) => b.or(p),
            };
        }
        let ratio = match (first, best) {
            (Some(f), Some(p)) => format!("{:.3}", p / f),
            _ => "1.000".into(),
        };
        first = first.or(best);
        let fmt = |v: Option<f64>| v.map_or("–".into(), |p| format!("{p:.0}"));
        md.push_str(&format!("| {} | {ok} | {} | {} | {ratio} |\n", t.name, fmt(best), fmt(path)));
    }
    md
}

/// Rounds of [`keyed_instructions`].
const KEYED_ROUNDS: usize = 5;

/// The instructions a callgrind dump counts under the connections' tasks
/// (`usher_proxy::serve_all`'s per-connection closure, inclusive), if
/// `callgrind_annotate` is there and the binary names it.
fn request_path_total(dump: &Path) -> Option<u64> {
    let out =
        Command::new("callgrind_annotate").args(["--inclusive=yes", "--threshold=100"]).arg(dump).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("usher_proxy::serve_all::{{closure}}::{{closure}}"))?;
    line.split_whitespace().next()?.replace(',', "").parse().ok()
}

/// Instructions per proxied request, counted by callgrind (user space only,
/// repeatable to a fraction of a percent, unlike times on a shared machine):
/// each proxy runs under valgrind; after a warm-up its counters are zeroed,
/// `secs` of closed-loop load go through it, and the dump's total is divided
/// by the requests answered. The dumps stay in `--out` for `callgrind_annotate`.
async fn instructions(o: &Opts, secs: f64) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::plain(o).await;
    let targets = proxies(o, dir.path(), &up).await;
    let mut md = format!(
        "### Instructions per request (callgrind, user space, {secs} s of closed-loop load over 4 connections)\n\n\
         | target | requests | instructions per request | ratio to usher |\n|---|---|---|---|\n"
    );
    let mut first = None;
    for t in &targets {
        let pid = t.proc.as_ref().unwrap().pid;
        loadgen::closed_loop(t.addr, "/x", 4, Duration::from_secs(1)).await;
        callgrind_control(&["--zero", &pid.to_string()]);
        let r = loadgen::closed_loop(t.addr, "/x", 4, Duration::from_secs_f64(secs)).await;
        let before: std::collections::HashSet<PathBuf> = dumps(&o.out).into_iter().collect();
        callgrind_control(&["--dump", &pid.to_string()]);
        let dump = dumps(&o.out)
            .into_iter()
            .find(|p| !before.contains(p) && p.to_string_lossy().contains(&format!(".{pid}.")));
        let total = dump.as_deref().and_then(callgrind_total);
        let per = total.map(|n| n as f64 / r.ok.max(1) as f64);
        let ratio = match (first, per) {
            (Some(f), Some(p)) => format!("{:.2}", p / f),
            _ => "1.00".into(),
        };
        first = first.or(per);
        eprintln!("{}: {} requests, {:?} instructions each ({dump:?})", t.name, r.ok, per);
        md.push_str(&format!(
            "| {} | {} | {} | {ratio} |\n",
            t.name,
            r.ok,
            per.map_or("–".into(), |p| format!("{p:.0}"))
        ));
    }
    if let Some(&n) = o.keys.first() {
        md.push_str(&keyed_instructions(o, &targets, n).await);
    }
    drop(targets);
    println!("{md}");
    std::fs::write(o.out.join("instructions.md"), &md).unwrap();
}

fn callgrind_control(args: &[&str]) {
    let ok = Command::new("callgrind_control").args(args).stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    assert!(ok, "callgrind_control {args:?} failed (is valgrind installed?)");
}

fn dumps(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("callgrind.")))
                .collect()
        })
        .unwrap_or_default()
}

/// The `summary:` (or `totals:`) instruction count of a callgrind dump.
fn callgrind_total(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("summary: ").or_else(|| l.strip_prefix("totals: ")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}
