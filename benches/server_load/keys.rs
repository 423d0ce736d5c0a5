//! A fleet's tenant keys on one `usher server`: memory per key, the lease
//! RPCs it sustains, its CPU, and whether it forgets keys nobody leases.
//!
//! `cargo bench --bench server_load -- --keys 1000000` runs it (the smoke
//! run, `cargo test --benches`, asks for 3,000). `--sidecars N` clients
//! (default 10) each ask for their keys in batches of `--batch` (default
//! 1,000) resources per GetCapacity, one batch in flight per client, as the
//! lease client does. Key `k` belongs to client `k mod N`; `--shared P`
//! percent of the keys (default 10) are also leased by the next two clients,
//! as a tenant busy on three sidecars is. Every key matches one template
//! (`t/*`, FAIR_SHARE), so the server holds one resource per key.
//!
//! Phases, each timed, with the server's RSS (`VmRSS`) and CPU (utime +
//! stime) read at both ends: *register* (every client asks for its keys
//! once), *refresh* (`--rounds` rounds, each client asking again for all its
//! keys and reporting what it holds), a `/metrics` *scrape*, *forget* (no
//! client asks; the leases expire, and the resource count on `/metrics` must
//! fall to 0), and *again* (as many new keys as the first time: RSS should
//! barely grow, as the forgotten keys' memory is reused).
//!
//! The template configures a safe capacity, so a lapsed lease's reservation
//! ends one lease length after its expiry (`--lease S`, default 60 s; the
//! smoke run 2 s) and a key is forgotten about two lease lengths after its
//! last refresh. The load generator shares the machine with the server.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, Lease, ResourceRequest};

use super::{Opts, Server};

/// What the key run is asked for.
pub(crate) struct KeyOpts {
    keys: u64,
    sidecars: u64,
    batch: usize,
    shared: u64,
    rounds: u32,
    lease: u64,
}

impl KeyOpts {
    /// The key run's options, if `--keys` asks for it (or a smoke run).
    pub(crate) fn parse(smoke: bool) -> Option<KeyOpts> {
        let args: Vec<String> = std::env::args().collect();
        let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
        let get = |name: &str, default: u64| value(name).and_then(|v| v.parse().ok()).unwrap_or(default);
        let keys = value("--keys").and_then(|v| v.parse().ok()).or(smoke.then_some(3_000))?;
        Some(KeyOpts {
            keys,
            sidecars: get("--sidecars", 10).max(1),
            batch: get("--batch", 1000).max(1) as usize,
            shared: get("--shared", 10).min(100),
            rounds: get("--rounds", if smoke { 1 } else { 2 }).max(1) as u32,
            lease: get("--lease", if smoke { 2 } else { 60 }).max(1),
        })
    }

    fn config(&self) -> String {
        format!(
            "resources:\n  - identifier_glob: 't/*'\n    capacity: 1000000\n    safe_capacity: 1\n    \
             algorithm: {{ kind: FAIR_SHARE, lease_length: {}, refresh_interval: {}, learning_mode_duration: 0 }}\n  \
             - identifier_glob: '*'\n    capacity: 0\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 30 }}\n",
            self.lease,
            (self.lease / 2).max(1),
        )
    }

    /// The keys client `c` leases, of the wave named `wave`.
    fn keys_of(&self, c: u64, wave: &str) -> Vec<String> {
        let n = self.sidecars;
        (0..self.keys)
            .filter(|k| k % n == c || (k % 100 < self.shared && [(k + 1) % n, (k + 2) % n].contains(&c)))
            .map(|k| format!("t/{wave}-{k:07}"))
            .collect()
    }
}

/// What one phase cost the server.
struct Phase {
    name: &'static str,
    secs: f64,
    rpcs: u64,
    requests: u64,
    cpu_ms: u64,
    rss_mb: f64,
}

impl Phase {
    fn print(&self, keys: u64, rss0: f64) {
        println!(
            "server_keys: phase={} seconds={:.1} rpcs={} rpcs_per_s={:.0} resource_requests_per_s={:.0} \
             cpu_percent={:.0} cpu_us_per_resource_request={:.2} rss_mb={:.1} rss_bytes_per_key={:.0}",
            self.name,
            self.secs,
            self.rpcs,
            self.rpcs as f64 / self.secs,
            self.requests as f64 / self.secs,
            self.cpu_ms as f64 / self.secs / 10.0,
            self.cpu_ms as f64 * 1000.0 / self.requests.max(1) as f64,
            self.rss_mb,
            (self.rss_mb - rss0) * 1024.0 * 1024.0 / keys as f64,
        );
    }
}

/// Runs the phases (see the module doc) against a server of its own.
pub(crate) async fn run(o: &Opts, k: &KeyOpts) {
    let max = (2 * k.keys + 1).to_string();
    let server = Server::start_with(o, &k.config(), &["--max-resources", &max]);
    let rss0 = server.rss_mb();
    let first: Vec<Vec<String>> = (0..k.sidecars).map(|c| k.keys_of(c, "tenant")).collect();
    let total: usize = first.iter().map(Vec::len).sum();
    println!(
        "server_keys: keys={} sidecars={} shared_percent={} resource_leases={} batch={} lease_s={} rss_start_mb={rss0:.1}",
        k.keys, k.sidecars, k.shared, total, k.batch, k.lease
    );
    let limit = Duration::from_secs(k.lease);
    let (reg, mut leases) = ask_all(&server, "register", &first, None, k.batch).await;
    reg.print(k.keys, rss0);
    assert!(reg.secs < limit.as_secs_f64(), "registering took longer than a lease: the first keys lapsed");
    for _ in 0..k.rounds {
        let (p, l) = ask_all(&server, "refresh", &first, Some(leases), k.batch).await;
        p.print(k.keys, rss0);
        leases = l;
    }
    let scraped = Instant::now();
    assert_eq!(resources(&server), k.keys, "every key is a resource of its own");
    println!("server_keys: phase=scrape seconds={:.2} rss_mb={:.1}", scraped.elapsed().as_secs_f64(), server.rss_mb());
    let forgot = Instant::now();
    let give_up = forgot + limit * 3 + Duration::from_secs(30);
    while resources(&server) > 0 {
        assert!(Instant::now() < give_up, "the server still holds keys whose leases all expired");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rss_forgot = server.rss_mb();
    println!(
        "server_keys: phase=forget seconds={:.1} resources=0 rss_mb={rss_forgot:.1}",
        forgot.elapsed().as_secs_f64()
    );
    let again: Vec<Vec<String>> = (0..k.sidecars).map(|c| k.keys_of(c, "again")).collect();
    let (p, _) = ask_all(&server, "again", &again, None, k.batch).await;
    p.print(k.keys, rss0);
    println!("server_keys: again_growth_mb={:.1} first_growth_mb={:.1}", p.rss_mb - rss_forgot, reg.rss_mb - rss0);
}

/// Every client asks for all its keys once, in batches, one in flight each.
async fn ask_all(
    server: &Server,
    name: &'static str,
    keys: &[Vec<String>],
    held: Option<Vec<Vec<Lease>>>,
    batch: usize,
) -> (Phase, Vec<Vec<Lease>>) {
    let cpu0 = server.cpu_ms();
    let start = Instant::now();
    let mut held = held.unwrap_or_else(|| keys.iter().map(|_| Vec::new()).collect());
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .zip(held.iter_mut().map(std::mem::take))
        .enumerate()
        .map(|(c, (mine, has))| {
            let addr = server.addr.clone();
            tokio::spawn(async move { ask_client(&addr, c, &mine, has, batch).await })
        })
        .collect();
    let mut rpcs = 0;
    for (c, t) in tasks.into_iter().enumerate() {
        let (n, leases) = t.await.expect("a client's task");
        rpcs += n;
        held[c] = leases;
    }
    let secs = start.elapsed().as_secs_f64();
    let requests = keys.iter().map(|k| k.len() as u64).sum();
    let (cpu_ms, rss_mb) = (server.cpu_ms().saturating_sub(cpu0), server.rss_mb());
    (Phase { name, secs, rpcs, requests, cpu_ms, rss_mb }, held)
}

/// One client's batches; returns its RPC count and the leases it got.
async fn ask_client(addr: &str, c: usize, keys: &[String], has: Vec<Lease>, batch: usize) -> (u64, Vec<Lease>) {
    let mut client = CapacityClient::connect(format!("http://{addr}")).await.expect("connect");
    let mut got = Vec::with_capacity(keys.len());
    let mut rpcs = 0;
    for (i, ids) in keys.chunks(batch).enumerate() {
        let resource = ids
            .iter()
            .enumerate()
            .map(|(j, id)| ResourceRequest {
                returned: None,
                reserve: None,
                backlog: None,
                unit_account: None,
                window: None,
                upstream_quota: None,
                resource_id: id.clone(),
                priority: 0,
                has: has.get(i * batch + j).copied(),
                wants: 10.0,
            })
            .collect();
        let req = GetCapacityRequest { client_id: format!("sidecar-{c}"), resource };
        let resp = client.get_capacity(req).await.expect("GetCapacity").into_inner();
        assert_eq!(resp.response.len(), ids.len(), "one answer per resource asked for");
        for r in resp.response {
            assert!(r.gets.capacity > 0.0, "{}: a key with spare capacity got nothing", r.resource_id);
            got.push(r.gets);
        }
        rpcs += 1;
    }
    (rpcs, got)
}

/// `usher_server_resources` on the server's `/metrics`.
fn resources(server: &Server) -> u64 {
    let mut s = std::net::TcpStream::connect(&server.admin).expect("connect to the admin port");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n").expect("send the scrape");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read the scrape");
    body.lines()
        .find_map(|l| l.strip_prefix("usher_server_resources "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("usher_server_resources on /metrics") as u64
}
