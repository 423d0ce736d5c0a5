//! The pooled burst, through real processes: one `usher server`, three
//! `usher proxy` sidecars sharing a per-minute rate, one counting upstream.
//! Each sidecar makes a call every 12 s (a quarter of the capacity in all);
//! then the third gets a clump of calls well beyond its own bucket but
//! within what its bucket and the pool hold. Where the server shares spare
//! capacity, the clump's lease growth is credited the pooled burst and the
//! clump passes within seconds; with `spare: keep` (Doorman's grants, no
//! pool) it waits for its bucket to refill at its lease. Calls that keep
//! coming in waves, with the sidecars' default minimum interval (1 s),
//! wait no more than a few round trips: while the pool holds units, the
//! sidecar asks again soon after its last ask. A quiet sidecar's first
//! call, costlier than a reserve sized by its small lease, passes at once
//! from the bucket it kept. Either way the upstream never sees more than
//! `capacity × T + burst`.
//!
//! The tests wait on the wall clock far more than they compute, so they run
//! at once (`usher_test_support::at_once`), each on its own processes.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use std::process::ExitCode;

use usher_test_support as support;
use usher_test_support::at_once::{self, Run, Runtime};

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use support::upstream::{Upstream, get, h1, send1};
use support::{Usher, free_port, http_get, write_file};

/// The fleet's capacity, 60 calls a minute, in calls a second.
const PER_SECOND: f64 = 1.0;

/// The fleet's burst: one minute of it (the default for a per-minute rate).
const BURST: f64 = 60.0;

/// Calls in the clump: beyond one sidecar's bucket (its lease of about
/// 0.26/s holds 15 calls), within its bucket and the pool (a quarter of the
/// 0.9/s spare stays pooled: 13 calls).
const CLUMP: usize = 26;

/// Calls in a larger clump: beyond what the third sidecar's bucket and the
/// burst of the free capacity hold (about 28 calls), within what the fleet
/// holds once the quiet sidecars gave back what their buckets held above
/// their reserves (about 50 of the 60).
const BIG_CLUMP: usize = 44;

/// Waves of calls that keep coming: this many, of [`WAVE`] calls each,
/// [`WAVE_GAP`] apart (48 calls in 1.75 s: beyond the third sidecar's
/// bucket, within what the fleet holds).
const WAVES: usize = 8;
const WAVE: usize = 6;
const WAVE_GAP: Duration = Duration::from_millis(250);

/// The longest a call of the waves may take: a few asks a round trip
/// apart. A sidecar that waited its minimum interval (1 s) between asks
/// would keep some calls waiting longer.
const ROUND_TRIPS: Duration = Duration::from_millis(600);

/// Each sidecar's steady load: a call this often.
const EVERY: Duration = Duration::from_secs(12);

/// How long the clump may take with a pool: its lease growth's credit
/// arrives with the sidecar's next ask (within its 500 ms minimum interval
/// and the server's 1 s) and passes it at once. Without one, its bucket
/// refills at its grown lease (about 0.5/s while the others hold their
/// spare): some 20 s for the 11 calls beyond it.
const SMALL_WAIT: Duration = Duration::from_secs(8);

/// The server's resources file: the fleet's 60/min, FAIR_SHARE, with `extra`
/// algorithm parameters.
fn resources(extra: &str) -> String {
    format!(
        "resources:\n  - identifier_glob: '*'\n    capacity: 60/min\n    algorithm: {{ kind: FAIR_SHARE, \
         lease_length: 30, refresh_interval: 5, learning_mode_duration: 0{extra} }}\n"
    )
}

/// The clump tests' sidecars ask the servers at most every 500 ms.
const MIN_INTERVAL: &str = "  min_interval: 500ms\n";

/// A sidecar's routes file, with `extra` lines in its `doorman:` section:
/// the fleet's rate, calls waiting up to 120 s (a call is refused at once
/// when its slot at the current lease is further off than that: the
/// clump's calls all wait for the lease to grow).
fn sidecar_with(up: &Upstream, port: u16, id: &str, extra: &str) -> String {
    format!(
        "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {id}\n{extra}\
         upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  api: {{ kind: rate, capacity: 60/min, max_wait: 120s, max_queue: 100, wants: auto }}\n\
         routes:\n  - name: all\n    match: {{ path_prefix: / }}\n    upstream: up\n    resources: [api]\n",
        up.addr
    )
}

/// Each sidecar's steady load: `calls` calls, one every [`EVERY`].
fn steady(sidecars: &[Usher], calls: usize) -> Vec<tokio::task::JoinHandle<()>> {
    let ok = Arc::new(AtomicU64::new(0));
    sidecars
        .iter()
        .map(|s| {
            let (addr, ok) = (s.addr("listen"), ok.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(EVERY);
                for _ in 0..calls {
                    tick.tick().await;
                    call(addr, ok.clone()).await;
                }
            })
        })
        .collect()
}

/// One call through `addr`; counts a 200 in `ok`.
async fn call(addr: SocketAddr, ok: Arc<AtomicU64>) -> u16 {
    let mut c = h1(addr).await;
    let status = send1(&mut c, get("app.local", "/x")).await.status.as_u16();
    if status == 200 {
        ok.fetch_add(1, Ordering::Relaxed);
    }
    status
}

/// The lease a sidecar holds for `api`, once it has one.
fn lease(s: &Usher) -> Option<f64> {
    let (code, body) = http_get(s.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["lease"]["keys"][0]["has"].as_f64()
}

/// Waits `at_least`, and until every sidecar holds a lease; fails past `at_most`.
async fn settle(sidecars: &[Usher], at_least: Duration, at_most: Duration) {
    let start = Instant::now();
    while start.elapsed() < at_least || sidecars.iter().any(|s| lease(s).is_none()) {
        assert!(start.elapsed() < at_most, "leases: {:?}", sidecars.iter().map(lease).collect::<Vec<_>>());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What one fleet did with a clump at its third sidecar.
struct Clump {
    /// When the last call of the clump was answered, from its start.
    took: Duration,
    /// The longest any call of the clump took, from when it was sent.
    slowest: Duration,
    /// The calls answered 200.
    ok: u64,
    /// The upstream's count, and the seconds since the fleet started.
    upstream: u64,
    secs: f64,
}

/// A clump: waves of calls sent together, each `(after the first, calls)`.
type Waves = [(Duration, usize)];

/// All `n` calls at once.
fn at_once(n: usize) -> [(Duration, usize); 1] {
    [(Duration::ZERO, n)]
}

/// Starts a server with `extra` parameters and three sidecars (with
/// `sidecar_extra` in their `doorman:` sections), lets their leases settle
/// while idle, then fires a clump of `waves` at the third sidecar.
async fn clump(dir: &Path, extra: &str, sidecar_extra: &str, waves: &Waves) -> Clump {
    let port = free_port();
    let up = Upstream::start().await;
    let started = Instant::now();
    let _server = Usher::server_at(&write_file(dir, "server.yaml", &resources(extra)), port, &[]);
    let sidecars: Vec<Usher> = ["a", "b", "c"]
        .iter()
        .map(|id| Usher::proxy(&write_file(dir, &format!("{id}.yaml"), &sidecar_with(&up, port, id, sidecar_extra))))
        .collect();
    // Every sidecar's steady load, for as long as the test may run.
    let steady = steady(&sidecars, 12);
    // The resource's clients arrive in its first 5 s; after them, each
    // sidecar's wants follow its measured demand, and its lease follows them.
    // The leases the first guesses took come back to the pool at its free
    // rate: a window (60 s) fills it.
    settle(&sidecars, Duration::from_secs(70), Duration::from_secs(90)).await;
    let clumped = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut calls = Vec::new();
    for &(after, n) in waves {
        tokio::time::sleep_until((t0 + after).into()).await;
        calls.extend((0..n).map(|_| {
            let (addr, ok) = (sidecars[2].addr("listen"), clumped.clone());
            tokio::spawn(async move {
                let sent = Instant::now();
                call(addr, ok).await;
                sent.elapsed()
            })
        }));
    }
    let mut slowest = Duration::ZERO;
    for c in calls {
        slowest = slowest.max(c.await.unwrap());
    }
    let took = t0.elapsed();
    for s in steady {
        s.abort();
    }
    Clump {
        took,
        slowest,
        ok: clumped.load(Ordering::Relaxed),
        upstream: up.stats.requests(),
        secs: started.elapsed().as_secs_f64(),
    }
}

async fn a_quiet_sidecars_clump_draws_the_pooled_burst_and_the_fleet_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let pooled = clump(&subdir(dir.path(), "pooled"), "", MIN_INTERVAL, &at_once(CLUMP)).await;
    let keep = clump(
        &subdir(dir.path(), "keep"),
        ", parameters: [{ name: spare, value: keep }]",
        MIN_INTERVAL,
        &at_once(CLUMP),
    )
    .await;
    eprintln!(
        "figures: pooled: {} of {CLUMP} in {:.1?}; spare: keep: {} of {CLUMP} in {:.1?}",
        pooled.ok, pooled.took, keep.ok, keep.took
    );
    bounded("pooled", &pooled);
    bounded("keep", &keep);
    passed_soon("the clump draws the pooled burst", &pooled, CLUMP);
    // Without a pool, the calls beyond the bucket wait at the lease's rate,
    // or are refused at once where that is beyond their max_wait.
    assert!(
        keep.ok < CLUMP as u64 || keep.took > SMALL_WAIT,
        "without a pool the clump waits for its bucket: {} of {CLUMP} in {:.1?}",
        keep.ok,
        keep.took
    );
}

/// The upstream saw no more than capacity × T + burst, and one call more
/// per sidecar (a bucket's first request's worth before its first lease).
fn bounded(name: &str, c: &Clump) {
    let bound = PER_SECOND * c.secs + BURST + 3.0;
    assert!(c.upstream as f64 <= bound, "{name}: {} calls at the upstream in {:.1} s > {bound:.1}", c.upstream, c.secs);
}

/// The quiet sidecars keep a reserve of two calls and give back what their
/// buckets hold above it each time they ask: the pool holds most of the
/// fleet's burst, and a clump at any sidecar, beyond its own share of the
/// burst and the free capacity's, is credited its backlog and passes within
/// seconds, as it would against the upstream's one bucket.
async fn a_clump_beyond_its_share_draws_what_the_quiet_sidecars_gave_back() {
    let dir = tempfile::tempdir().unwrap();
    let c = clump(dir.path(), "", MIN_INTERVAL, &at_once(BIG_CLUMP)).await;
    eprintln!("figures: {} of {BIG_CLUMP} in {:.1?}; {} at the upstream in {:.1} s", c.ok, c.took, c.upstream, c.secs);
    bounded("pooled", &c);
    passed_soon("the clump draws what the others gave back", &c, BIG_CLUMP);
}

/// Every one of the clump's `n` calls passed, within [`SMALL_WAIT`].
fn passed_soon(what: &str, c: &Clump, n: usize) {
    assert!(c.ok == n as u64 && c.took <= SMALL_WAIT, "{what}: {} of {n} in {:.1?}", c.ok, c.took);
}

/// A new directory `name` in `dir`.
fn subdir(dir: &Path, name: &str) -> std::path::PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Calls that keep coming to a quiet sidecar, with the sidecar's defaults
/// (it asks the servers at most once a second): waves of calls 250 ms
/// apart, each beyond what the sidecar's bucket holds by then. While the
/// server's pool holds units, the sidecar asks again a round trip after
/// its last ask, not a second later, so no call waits much longer than
/// that: the API's one bucket would have served each at once.
async fn calls_that_keep_coming_draw_the_pool_a_round_trip_apart() {
    let dir = tempfile::tempdir().unwrap();
    let waves: Vec<(Duration, usize)> = (0..WAVES).map(|i| (WAVE_GAP * i as u32, WAVE)).collect();
    let c = clump(dir.path(), "", "", &waves).await;
    let n = WAVES * WAVE;
    eprintln!(
        "figures: {} of {n} in {:.1?}, the slowest call {:.1?}; {} at the upstream in {:.1} s",
        c.ok, c.took, c.slowest, c.upstream, c.secs
    );
    bounded("pooled", &c);
    assert!(
        c.ok == n as u64 && c.slowest <= ROUND_TRIPS,
        "calls that keep coming: {} of {n}, the slowest in {:.1?} (at most {ROUND_TRIPS:?})",
        c.ok,
        c.slowest
    );
}

/// A token-like rate: 6,000 units a minute, each call 300 of them (an LLM
/// call's estimate), shared by three sidecars with their defaults.
fn token_sidecar(up: &Upstream, port: u16, id: &str) -> String {
    format!(
        "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {id}\n\
         upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tokens: {{ kind: rate, capacity: 6000/min, max_wait: 30s, wants: auto }}\n\
         routes:\n  - name: all\n    match: {{ path_prefix: / }}\n    upstream: up\n    \
         resources: [{{ resource: tokens, cost: {COST} }}]\n",
        up.addr
    )
}

/// What one call costs of the token-like rate: more than 5 s of a quiet
/// sidecar's lease, far less than its share of the burst.
const COST: u32 = 300;

/// The longest a quiet sidecar's first call may take: its bucket is there.
const FIRST_CALL: Duration = Duration::from_millis(150);

/// A sidecar that has not had a call yet keeps its whole bucket (no cost is
/// known to size a reserve by), so its first call, however costly, passes at
/// once while its peers, busy from the start, pool theirs. Measured over a
/// fleet that has run 20 s: its peers' calls every 12 s (half the
/// capacity), its own none.
async fn a_quiet_sidecars_first_call_passes_at_once_whatever_it_costs() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let up = Upstream::start().await;
    let server = resources("").replace("60/min", "6000/min");
    let _server = Usher::server_at(&write_file(dir.path(), "server.yaml", &server), port, &[]);
    let sidecars: Vec<Usher> = ["a", "b", "c"]
        .iter()
        .map(|id| Usher::proxy(&write_file(dir.path(), &format!("{id}.yaml"), &token_sidecar(&up, port, id))))
        .collect();
    let busy = steady(&sidecars[..2], 5);
    settle(&sidecars, Duration::from_secs(20), Duration::from_secs(40)).await;
    let first = Arc::new(AtomicU64::new(0));
    let sent = Instant::now();
    let status = call(sidecars[2].addr("listen"), first.clone()).await;
    let took = sent.elapsed();
    for b in busy {
        b.abort();
    }
    eprintln!("figures: the quiet sidecar's first call: {status} in {took:.1?}; its lease {:?}/s", lease(&sidecars[2]));
    assert!(status == 200 && took <= FIRST_CALL, "the quiet sidecar's first call: {status} in {took:.1?}");
}

/// Every test, by name: they run at once (`usher_test_support::at_once`).
const TESTS: &[(&str, Run)] = &[
    ("a_quiet_sidecars_clump_draws_the_pooled_burst_and_the_fleet_stays_bounded", || {
        Box::pin(a_quiet_sidecars_clump_draws_the_pooled_burst_and_the_fleet_stays_bounded())
    }),
    ("a_clump_beyond_its_share_draws_what_the_quiet_sidecars_gave_back", || {
        Box::pin(a_clump_beyond_its_share_draws_what_the_quiet_sidecars_gave_back())
    }),
    ("calls_that_keep_coming_draw_the_pool_a_round_trip_apart", || {
        Box::pin(calls_that_keep_coming_draw_the_pool_a_round_trip_apart())
    }),
    ("a_quiet_sidecars_first_call_passes_at_once_whatever_it_costs", || {
        Box::pin(a_quiet_sidecars_first_call_passes_at_once_whatever_it_costs())
    }),
];

fn main() -> ExitCode {
    at_once::main(TESTS, &[], Runtime::PerTest(2))
}
