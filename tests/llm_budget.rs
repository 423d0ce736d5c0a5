//! Three sidecars share an LLM API's token budget. An OpenAI-like upstream
//! refills a bucket of 6,000 tokens continuously over a minute and one of
//! 120 requests likewise; each answer costs 50 to 250 tokens (a seeded
//! generator, drawn in arrival order), deducted when it is answered (after
//! 1 ms a token, as a model writes), and says so in `x-usage-total-tokens`.
//! Every answer carries OpenAI's `x-ratelimit-{limit,remaining,reset}-
//! {requests,tokens}` (resets as Go durations: `6m0s`, `1.5s`, `120ms`); a
//! request that would overdraw either bucket is answered 429 with the same
//! headers, as OpenAI answers "Limit 6000, Used 5900, Requested 250".
//!
//! Three `usher proxy` sidecars with the routes file of docs/guides/llm.md
//! lease from a real `usher server` with the guide's resources file, both
//! scaled to this account: `capacity` 97% of the TPM (5,820/min, as the
//! guide says to keep every minute within the TPM), the fleet's `burst` the
//! largest call (250), 150 tokens charged per call and settled from
//! `x-usage-total-tokens`, `max_wait: 10s`. Each sidecar's app offers 0.5
//! calls a second, about 4,500 tokens a minute: 13,500 in all, more than
//! twice the budget, so usher must hold them back.
//!
//! The apps behave as OpenAI's SDK does: a 429 is retried after its
//! `Retry-After` (at most 20 s), twice at most, and never after the offered
//! load ends; what is still refused then is given up on and counted.
//!
//! The bar, after the first minute (a warm-up): no upstream 429, and the
//! tokens spent in each minute (60-120 s and 120-180 s of the load) at least
//! 90% of 6,000 and at most 6,000 plus one call's largest cost (250). Any 60
//! seconds (sliding, every start) are reported, and held to what
//! docs/proxy.md promises of a fleet ("capacity × T + burst, plus one request
//! per sidecar"), not to the bar: each sidecar passes whole calls, each once
//! its share has paid for the one before, so its spend runs up to a call
//! ahead of its lease, and three such sawtooths make a sliding minute wander
//! by ±350 tokens or so over two minutes of starts: most of the bar's band
//! (850 wide). Even ideal pacers miss the bar on a sliding minute in about a
//! quarter of runs, and on a fixed minute in almost none
//! ([`three_ideal_pacers_miss_the_bar_on_sliding_minutes_not_fixed_ones`]).
//! Measured with seven seeds: each minute 5,639 to 6,123 tokens, any 60 s
//! 5,400 to 6,190 (inside the bar too, but by as little as 0 tokens).

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::llm::{Bucket, go_duration};
use support::{Usher, free_port, write_file};

/// The account's TPM: the upstream's bucket.
const TOKENS_PER_MIN: f64 = 6000.0;
/// What the fleet shares: 97% of the TPM (docs/guides/llm.md).
const CAPACITY_PER_MIN: u64 = 5820;
/// The fleet's burst: the largest call.
const BURST: u64 = MAX_COST;
const REQUESTS_PER_MIN: f64 = 120.0;
const MIN_COST: u64 = 50;
const MAX_COST: u64 = 250;
const SIDECARS: usize = 3;
/// Requests a second each sidecar's app offers.
const OFFERED: f64 = 0.5;
const WARM_UP: Duration = Duration::from_secs(60);
const MEASURED: Duration = Duration::from_secs(120);
const MINUTE: Duration = Duration::from_secs(60);
/// OpenAI's SDK retries a 429 twice by default (`max_retries=2`).
const RETRIES: u32 = 2;
const MAX_RETRY_AFTER: Duration = Duration::from_secs(20);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

// === the OpenAI-like upstream ===

/// What the upstream answered, and when.
#[derive(Debug, Clone, Copy)]
struct Answered {
    at: Instant,
    /// The sidecar whose app sent it.
    app: usize,
    /// Tokens spent; 0 for a 429.
    tokens: u64,
    status: u16,
}

struct Api {
    tokens: Bucket,
    requests: Bucket,
    /// splitmix64's state: each request's cost, in arrival order.
    rng: u64,
    log: Vec<Answered>,
}

impl Api {
    fn cost(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        MIN_COST + (z ^ (z >> 31)) % (MAX_COST - MIN_COST + 1)
    }

    /// Answers a request that costs `cost` from `app`, now.
    fn answer(&mut self, app: usize, cost: u64) -> Response<Full<Bytes>> {
        let now = Instant::now();
        self.tokens.refill(now);
        self.requests.refill(now);
        let ok = self.requests.fits(1.0) && self.tokens.fits(cost as f64);
        if ok {
            self.requests.take(1.0);
            self.tokens.take(cost as f64);
        }
        self.log.push(Answered { at: now, app, tokens: if ok { cost } else { 0 }, status: if ok { 200 } else { 429 } });
        let b = Response::builder()
            .status(if ok { 200 } else { 429 })
            .header("content-type", "application/json")
            .header("x-ratelimit-limit-requests", format!("{}", self.requests.size()))
            .header("x-ratelimit-remaining-requests", self.requests.remaining().to_string())
            .header("x-ratelimit-reset-requests", go_duration(self.requests.until_full()))
            .header("x-ratelimit-limit-tokens", format!("{}", self.tokens.size()))
            .header("x-ratelimit-remaining-tokens", self.tokens.remaining().to_string())
            .header("x-ratelimit-reset-tokens", go_duration(self.tokens.until_full()));
        let b = if ok { b.header("x-usage-total-tokens", cost.to_string()) } else { b };
        let body = if ok {
            format!(r#"{{"object":"chat.completion","usage":{{"total_tokens":{cost}}}}}"#)
        } else {
            r#"{"error":{"type":"tokens","code":"rate_limit_exceeded"}}"#.to_string()
        };
        b.body(Full::new(Bytes::from(body))).unwrap()
    }
}

type Shared = Arc<Mutex<Api>>;

/// The upstream: answers after a latency that grows with the answer's length
/// (1 ms a token), as a model's does.
async fn openai() -> (SocketAddr, Shared) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let now = Instant::now();
    let api = Arc::new(Mutex::new(Api {
        tokens: Bucket::full(TOKENS_PER_MIN, now),
        requests: Bucket::full(REQUESTS_PER_MIN, now),
        rng: 0x5eed_11a1,
        log: Vec::new(),
    }));
    let shared = api.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let api = api.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let api = api.clone();
                    async move {
                        let app = req
                            .headers()
                            .get("x-app")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(usize::MAX);
                        let _ = req.into_body().collect().await;
                        let cost = api.lock().unwrap().cost();
                        tokio::time::sleep(Duration::from_millis(cost)).await;
                        Ok::<_, Infallible>(api.lock().unwrap().answer(app, cost))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, shared)
}

// === the apps ===

/// What one app saw.
#[derive(Default, Debug)]
struct App {
    ok: AtomicU64,
    /// usher's 429s, retried or not.
    refused: AtomicU64,
    /// Given up on: still refused after the retries.
    dropped: AtomicU64,
    /// The upstream's 429s that reached the app.
    upstream_429: AtomicU64,
    other: AtomicU64,
}

/// One chat completion through the sidecar at `addr`: the status and `Retry-After`.
async fn chat(addr: SocketAddr, app: usize) -> Option<(u16, Option<u64>, bool)> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    let req = Request::post("/v1/chat/completions")
        .header("host", "api.openai.local")
        .header("content-type", "application/json")
        .header("x-app", app.to_string())
        .body(Full::new(Bytes::from_static(br#"{"model":"gpt-x","messages":[{"role":"user","content":"hi"}]}"#)))
        .unwrap();
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, send.send_request(req)).await.ok()?.ok()?;
    let status = resp.status().as_u16();
    let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let from_upstream = resp.headers().contains_key("x-ratelimit-limit-tokens");
    tokio::time::timeout(REQUEST_TIMEOUT, resp.into_body().collect()).await.ok()?.ok()?;
    Some((status, retry_after, from_upstream))
}

/// One request as OpenAI's SDK makes it: a 429 is retried after its
/// `Retry-After` (bounded), at most [`RETRIES`] times, never past `end`.
async fn request(addr: SocketAddr, app: usize, tally: Arc<App>, end: Instant) {
    for attempt in 0..=RETRIES {
        let Some((status, retry_after, from_upstream)) = chat(addr, app).await else {
            tally.other.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match (status, from_upstream) {
            (200, _) => {
                tally.ok.fetch_add(1, Ordering::Relaxed);
                return;
            }
            (429, true) => {
                tally.upstream_429.fetch_add(1, Ordering::Relaxed);
                return;
            }
            (429, false) => {
                tally.refused.fetch_add(1, Ordering::Relaxed);
                let wait = Duration::from_secs(retry_after.expect("usher's 429 says when to retry").max(1))
                    .min(MAX_RETRY_AFTER);
                if attempt == RETRIES || Instant::now() + wait >= end {
                    tally.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                tokio::time::sleep(wait).await;
            }
            _ => {
                tally.other.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// An app offering [`OFFERED`] requests a second until `end`, each on its own task.
async fn app(addr: SocketAddr, app: usize, phase: Duration, tally: Arc<App>, end: Instant) {
    let every = Duration::from_secs_f64(1.0 / OFFERED);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = Vec::new();
    loop {
        tick.tick().await;
        if Instant::now() >= end {
            break;
        }
        tasks.push(tokio::spawn(request(addr, app, tally.clone(), end)));
    }
    // Calls still waiting in usher are not measured: a few seconds for those answered, then gone.
    let grace = tokio::time::Instant::now() + Duration::from_secs(5);
    for t in tasks {
        let abort = t.abort_handle();
        if tokio::time::timeout_at(grace, t).await.is_err() {
            abort.abort();
        }
    }
}

// === measuring ===

/// Every 10 s until `end`: each sidecar's `llm-tokens` lease (capacity/wants/has,
/// tokens a second), for the report.
async fn sample_leases(admins: Vec<SocketAddr>, start: Instant, end: Instant) -> Vec<String> {
    let mut rows = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    while Instant::now() < end {
        tick.tick().await;
        let admins = admins.clone();
        let row = tokio::task::spawn_blocking(move || {
            admins
                .iter()
                .map(|a| {
                    let (_, body) = support::http_get(*a, "/debug/status?format=json");
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    let keys = v["lease"]["keys"].as_array().cloned().unwrap_or_default();
                    let k = keys.iter().find(|k| k["resource_id"] == "llm-tokens").cloned().unwrap_or_default();
                    let n = |f: &str| k[f].as_f64().map_or("-".into(), |x| format!("{x:.0}"));
                    format!("{}/{}/{}", n("capacity"), n("wants"), n("has"))
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .await
        .unwrap();
        rows.push(format!("{:>3}s {row}", start.elapsed().as_secs()));
    }
    rows
}

/// The least and the most tokens spent in any 60 s window `[s, s + 60)`
/// that lies within `[from, to]`, every start considered: a window's
/// content changes only where its start passes an answer or its end reaches one.
fn sliding_extremes(spent: &[(f64, u64)], from: f64, to: f64) -> (u64, u64) {
    let w = MINUTE.as_secs_f64();
    let (first, last) = (from, to - w);
    assert!(last >= first, "the measured period is shorter than a window");
    let times: Vec<f64> = spent.iter().map(|s| s.0).collect();
    let mut prefix = vec![0u64];
    for s in spent {
        prefix.push(prefix.last().unwrap() + s.1);
    }
    let sum = |s: f64| {
        let a = times.partition_point(|&t| t < s);
        let b = times.partition_point(|&t| t < s + w);
        prefix[b] - prefix[a]
    };
    let eps = 1e-6;
    let mut starts = vec![first, last];
    for &t in &times {
        starts.extend([t, t + eps, t - w + eps, t - w]);
    }
    let (mut lo, mut hi) = (u64::MAX, 0);
    for s in starts.into_iter().filter(|s| (first..=last).contains(s)) {
        let v = sum(s);
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (lo, hi)
}

#[test]
fn sliding_windows_find_every_extreme() {
    // 100 tokens at 0.5, 1.5, ..., 179.5 s: a window holds 60 of them, wherever it starts.
    let even: Vec<(f64, u64)> = (0..180).map(|i| (f64::from(i) + 0.5, 100)).collect();
    assert_eq!(sliding_extremes(&even, 60.0, 180.0), (6000, 6000));
    // A lump of 500 at 100 s and nothing 60 s later: a window holding it, one that does not.
    let mut lump = even.clone();
    lump.push((100.0, 500));
    lump.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert_eq!(sliding_extremes(&lump, 60.0, 180.0), (6000, 6500));
}

/// Why the bar is held to fixed minutes: three ideal pacers (each passes
/// its next call the moment its lease has paid for the one before, costs
/// 50 to 250 tokens, phases at random) sharing 97% of 6,000 tokens a minute
/// miss the bar on some sliding minute of two in many runs, on a fixed one
/// in almost none.
#[test]
fn three_ideal_pacers_miss_the_bar_on_sliding_minutes_not_fixed_ones() {
    let mut rng: u64 = 7;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (runs, mut sliding_misses, mut fixed_misses) = (400, 0, 0);
    let miss = |t: u64| (t as f64) < 0.9 * TOKENS_PER_MIN || t > TOKENS_PER_MIN as u64 + MAX_COST;
    for _ in 0..runs {
        let mut spent = Vec::new();
        for _ in 0..SIDECARS {
            let per_s = CAPACITY_PER_MIN as f64 / 60.0 / SIDECARS as f64;
            let mut t = (next() % 5000) as f64 / 1000.0;
            while t < 180.0 {
                let cost = MIN_COST + next() % (MAX_COST - MIN_COST + 1);
                spent.push((t, cost));
                t += cost as f64 / per_s;
            }
        }
        spent.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (lo, hi) = sliding_extremes(&spent, 60.0, 180.0);
        sliding_misses += u32::from(miss(lo) || miss(hi));
        let minute = |m: f64| spent.iter().filter(|s| (m..m + 60.0).contains(&s.0)).map(|s| s.1).sum::<u64>();
        fixed_misses += u32::from(miss(minute(60.0)) || miss(minute(120.0)));
    }
    assert!(sliding_misses * 10 > runs, "{sliding_misses} of {runs} runs missed on a sliding minute");
    assert!(fixed_misses * 100 < runs, "{fixed_misses} of {runs} runs missed on a fixed minute");
    eprintln!(
        "ideal pacers: {sliding_misses} of {runs} runs missed on a sliding minute, {fixed_misses} on a fixed one"
    );
}

// === the test ===

fn resources_file() -> String {
    // docs/guides/llm.md, section 1, with this account's figures (no gauge: this
    // upstream has no limit in flight to share).
    format!(
        "resources:\n\
         \x20 - identifier_glob: llm-requests\n\
         \x20   capacity: 120/min\n\
         \x20   algorithm: {{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 10 }}\n\
         \x20 - identifier_glob: llm-tokens\n\
         \x20   capacity: {CAPACITY_PER_MIN}/min\n\
         \x20   algorithm: {{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 10 }}\n\
         \x20 - identifier_glob: \"*\"\n\
         \x20   capacity: 0\n\
         \x20   algorithm: {{ kind: FAIR_SHARE, lease_length: 60, refresh_interval: 10 }}\n"
    )
}

fn routes_file(server_port: u16, up: SocketAddr, i: usize) -> String {
    // docs/guides/llm.md, section 2, with this account's figures.
    format!(
        "doorman:\n\
         \x20 servers: [\"127.0.0.1:{server_port}\"]\n\
         \x20 client_id: llm-{i}\n\
         upstreams:\n\
         \x20 llm: {{ url: \"http://{up}\", listen: \"127.0.0.1:0\" }}\n\
         resources:\n\
         \x20 llm-requests:\n\
         \x20   kind: rate\n\
         \x20   capacity: 120/min\n\
         \x20   max_wait: 10s\n\
         \x20   upstream_quota: {{ headers: openai-requests }}\n\
         \x20 llm-tokens:\n\
         \x20   kind: rate\n\
         \x20   capacity: {CAPACITY_PER_MIN}/min\n\
         \x20   burst: {BURST}\n\
         \x20   max_wait: 10s\n\
         \x20   upstream_quota: {{ headers: openai-tokens }}\n\
         routes:\n\
         \x20 - name: chat\n\
         \x20   upstream: llm\n\
         \x20   match: {{ path_prefix: /v1/chat/ }}\n\
         \x20   resources:\n\
         \x20     - llm-requests\n\
         \x20     - {{ resource: llm-tokens, cost: 150, settle: {{ response_header: x-usage-total-tokens }} }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_share_an_llm_token_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (up, api) = openai().await;
    let port = free_port();
    let _server = Usher::server_at(&write_file(dir.path(), "resources.yaml", &resources_file()), port, &[]);
    let sidecars: Vec<Usher> = (0..SIDECARS)
        .map(|i| Usher::proxy(&write_file(dir.path(), &format!("s{i}.yaml"), &routes_file(port, up, i))))
        .collect();

    let start = Instant::now();
    let end = start + WARM_UP + MEASURED;
    let tallies: Vec<Arc<App>> = (0..SIDECARS).map(|_| Arc::default()).collect();
    let apps: Vec<_> = sidecars
        .iter()
        .zip(&tallies)
        .enumerate()
        .map(|(i, (s, t))| {
            let phase = Duration::from_secs_f64(i as f64 / OFFERED / SIDECARS as f64);
            tokio::spawn(app(s.upstream_listener("llm"), i, phase, t.clone(), end))
        })
        .collect();
    let admins = sidecars.iter().map(|s| s.addr("admin")).collect();
    let sampler = tokio::spawn(sample_leases(admins, start, end));
    for a in apps {
        a.await.unwrap();
    }
    let leases = sampler.await.unwrap().join("\n");
    // The sidecars read the API's own account (the presets' header names are OpenAI's).
    let (_, status) = support::http_get(sidecars[0].addr("admin"), "/debug/status?format=json");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    for (resource, limit) in [("llm-tokens", TOKENS_PER_MIN), ("llm-requests", REQUESTS_PER_MIN)] {
        let keys = status["keys"].as_array().unwrap();
        let key = keys.iter().find(|k| k["resource"] == resource).unwrap();
        assert_eq!(key["upstream_quota"]["limit"].as_f64(), Some(limit), "{resource}: {key}");
        assert_eq!(key["upstream_quota"]["continuous"], true, "{resource}: {key}");
    }

    let log = api.lock().unwrap().log.clone();
    let secs = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
    let spent: Vec<(f64, u64)> = log.iter().filter(|a| a.status == 200).map(|a| (secs(a.at), a.tokens)).collect();
    let (from, to) = (WARM_UP.as_secs_f64(), (WARM_UP + MEASURED).as_secs_f64());
    let in_minute = |m: u64| spent.iter().filter(|s| (s.0 / 60.0).floor() as u64 == m).map(|s| s.1).sum::<u64>();
    let minutes: Vec<u64> = (0..(to / 60.0) as u64).map(in_minute).collect();
    let (lo, hi) = sliding_extremes(&spent, from, to);
    let late_429 = log.iter().filter(|a| a.status == 429 && secs(a.at) >= from).count();
    let all_429 = log.iter().filter(|a| a.status == 429).count();
    let shares: Vec<u64> = (0..SIDECARS)
        .map(|i| log.iter().filter(|a| a.app == i && (from..to).contains(&secs(a.at))).map(|a| a.tokens).sum())
        .collect();
    let report = format!(
        "tokens spent per minute of the load: {minutes:?}; any 60 s after the first minute: {lo}..{hi}; \
         upstream 429s: {late_429} after the first minute, {all_429} in all; tokens per sidecar after the \
         first minute: {shares:?}; apps: {tallies:?}\nllm-tokens capacity/wants/has of each sidecar:\n{leases}"
    );
    eprintln!("{report}");
    assert_eq!(late_429, 0, "the upstream refused calls after the first minute\n{report}");
    for (m, &t) in minutes.iter().enumerate().skip(1) {
        assert!(t as f64 >= 0.9 * TOKENS_PER_MIN, "minute {m} spent under 90% of the TPM\n{report}");
        assert!(t <= TOKENS_PER_MIN as u64 + MAX_COST, "minute {m} spent more than the TPM and one call\n{report}");
    }
    // docs/proxy.md, "Bursts are the fleet's": capacity × T + burst, plus one request per sidecar.
    let promised = CAPACITY_PER_MIN + BURST + SIDECARS as u64 * MAX_COST;
    assert!(hi <= promised, "60 s spent more than the fleet's bound of {promised}\n{report}");
    let total: u64 = shares.iter().sum();
    for (i, s) in shares.iter().enumerate() {
        assert!(*s * 4 >= total, "sidecar {i} had under a quarter of the tokens\n{report}");
    }
}
