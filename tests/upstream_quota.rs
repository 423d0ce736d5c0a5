//! The upstream's own quota headers steer the fleet. A GitHub-like upstream
//! renews a quota whole at fixed windows aligned to the epoch, says so on
//! every answer (`x-ratelimit-limit`, `-remaining`, `-reset` in epoch
//! seconds, `-used`) and answers an exhausted quota with 403 and
//! `x-ratelimit-remaining: 0`, as GitHub does. Another consumer spends a
//! fifth of the same quota outside usher. Three sidecars with
//! `upstream_quota: { headers: github }` lease from a real `usher server`:
//! after the first window none of their requests meets a 403, nearly every
//! window's quota is spent, and they share it evenly.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::load::{Answer, Tally, drive_recorded};
use support::upstream::{get, h1};
use support::{Usher, free_port, write_file};

const WINDOW: u64 = 30;
const LIMIT: u64 = 240;

/// One window's counts: answered 200 to sidecars and to the other consumer,
/// 403s to sidecars and to the other consumer.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    sidecars: u64,
    other: u64,
    refused_sidecars: u64,
    refused_other: u64,
}

type Windows = Arc<Mutex<std::collections::BTreeMap<u64, Counts>>>;

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The GitHub-like upstream: `LIMIT` requests per `WINDOW` seconds.
async fn github() -> (SocketAddr, Windows) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let windows: Windows = Arc::default();
    let w = windows.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let windows = w.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let windows = windows.clone();
                    async move {
                        let other = req.headers().contains_key("x-other-consumer");
                        let now = unix_now();
                        let k = now as u64 / WINDOW;
                        let mut all = windows.lock().unwrap();
                        let c = all.entry(k).or_default();
                        let used = c.sidecars + c.other;
                        let allowed = used < LIMIT;
                        match (allowed, other) {
                            (true, false) => c.sidecars += 1,
                            (true, true) => c.other += 1,
                            (false, false) => c.refused_sidecars += 1,
                            (false, true) => c.refused_other += 1,
                        }
                        let used = c.sidecars + c.other;
                        let b = Response::builder()
                            .status(if allowed { 200 } else { 403 })
                            .header("x-ratelimit-limit", LIMIT.to_string())
                            .header("x-ratelimit-remaining", (LIMIT - used).to_string())
                            .header("x-ratelimit-used", used.to_string())
                            .header("x-ratelimit-reset", ((k + 1) * WINDOW).to_string());
                        Ok::<_, Infallible>(b.body(Full::new(Bytes::from_static(b"{}"))).unwrap())
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, windows)
}

/// The other consumer: `rate` requests per second straight to the upstream, for `dur`.
async fn other_consumer(up: SocketAddr, rate: f64, dur: Duration) {
    let mut client = h1(up).await;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let start = Instant::now();
    while start.elapsed() < dur {
        tick.tick().await;
        let mut req = get("api.github.local", "/repos");
        req.headers_mut().insert("x-other-consumer", "1".parse().unwrap());
        client.ready().await.unwrap();
        let _ = client.send_request(req).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_follow_a_github_like_quota_with_another_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let (up, windows) = github().await;
    let port = free_port();
    // The documented quota: 240 per 30 s.
    let config = format!(
        "resources:\n  - identifier_glob: github\n    capacity: {LIMIT}/{WINDOW}\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 5, refresh_interval: 1, learning_mode_duration: 0 }}\n  - identifier_glob: '*'\n    capacity: 0\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 5, refresh_interval: 1 }}\n"
    )
    .replace(&format!("{LIMIT}/{WINDOW}"), &format!("{}", LIMIT as f64 / WINDOW as f64));
    let _server = Usher::server_at(&write_file(dir.path(), "resources.yaml", &config), port, &[]);
    let sidecars: Vec<Usher> = (0..3)
        .map(|i| {
            let routes = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: gh-{i}\n\
                 upstreams:\n  gh: {{ url: \"http://{up}\" }}\n\
                 resources:\n  github: {{ kind: rate, capacity: 480/min, upstream_quota: {{ headers: github }} }}\n\
                 routes:\n  - name: gh\n    upstream: gh\n    resources: [github]\n"
            );
            Usher::proxy(&write_file(dir.path(), &format!("s{i}.yaml"), &routes))
        })
        .collect();

    // Start on a window's boundary, then three windows: the first is learnt.
    let next = (unix_now() as u64 / WINDOW + 1) * WINDOW;
    tokio::time::sleep(Duration::from_secs_f64(next as f64 - unix_now())).await;
    let dur = Duration::from_secs(3 * WINDOW);
    let other = tokio::spawn(other_consumer(up, LIMIT as f64 / WINDOW as f64 * 0.2, dur));
    let learnt = Instant::now() + Duration::from_secs(WINDOW);
    let answers: Vec<Arc<Mutex<Vec<Answer>>>> = (0..3).map(|_| Arc::default()).collect();
    let loads: Vec<_> = sidecars
        .iter()
        .zip(&answers)
        .map(|(s, a)| {
            let tally = Arc::new(Tally::default());
            tokio::spawn(drive_recorded(s.addr("listen"), 5.0, dur, tally, a.clone()))
        })
        .collect();
    for l in loads {
        l.await.unwrap();
    }
    other.await.unwrap();

    let first = next / WINDOW;
    let all = windows.lock().unwrap().clone();
    let report = format!("windows from the start: {:?}", all.range(first..first + 3).collect::<Vec<_>>());
    eprintln!("{report}");
    let later: Vec<Counts> = (first + 1..first + 3).map(|k| all.get(&k).copied().unwrap_or_default()).collect();
    for c in &later {
        assert_eq!(c.refused_sidecars, 0, "a sidecar's request met the exhausted quota\n{report}");
        let spent = c.sidecars + c.other;
        assert!(spent as f64 >= 0.95 * LIMIT as f64, "a window's quota left unspent\n{report}");
    }
    let left: f64 = later.iter().map(|c| (LIMIT - (c.sidecars + c.other)) as f64).sum::<f64>() / later.len() as f64;
    assert!(left <= 0.02 * LIMIT as f64, "{left} left at the reset on average\n{report}");
    // Each sidecar's share of the windows after the learnt one.
    let ok: Vec<usize> = answers
        .iter()
        .map(|a| a.lock().unwrap().iter().filter(|a| a.status == 200 && a.sent >= learnt).count())
        .collect();
    eprintln!("each sidecar's requests answered 200 after the learnt window: {ok:?}");
    let (lo, hi) = (*ok.iter().min().unwrap() as f64, *ok.iter().max().unwrap() as f64);
    assert!(hi <= lo * 1.15 + 2.0, "the sidecars' shares differ by more than 15%: {ok:?}\n{report}");
}

/// A quota spent while some sidecars have yet to meet it: the one that meets
/// the upstream's 403 holds its keys, the server shares 0 until the reset,
/// and another sidecar's own 429s say to wait until the reset (not a
/// second), without its requests reaching the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_that_never_met_the_spent_quota_says_when_it_renews() {
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let reset = unix_now() as u64 + 45;
    let remaining = Arc::new(AtomicI64::new(100));
    let from_b = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let (rem, b) = (remaining.clone(), from_b.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let (rem, b) = (rem.clone(), b.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    if req.headers().get("x-app").is_some_and(|v| v == "b") {
                        b.fetch_add(1, Ordering::SeqCst);
                    }
                    let left = rem.load(Ordering::SeqCst);
                    if left > 0 {
                        rem.fetch_sub(1, Ordering::SeqCst);
                    }
                    let resp = Response::builder()
                        .status(if left > 0 { 200 } else { 403 })
                        .header("x-ratelimit-limit", "100")
                        .header("x-ratelimit-remaining", (left - 1).max(0).to_string())
                        .header("x-ratelimit-reset", reset.to_string())
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .unwrap();
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let port = free_port();
    let config = "resources:\n  - identifier_glob: github\n    capacity: 5000/h\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n  - identifier_glob: '*'\n    capacity: 0\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n";
    let server = Usher::server_at(&write_file(dir.path(), "resources.yaml", config), port, &[]);
    let sidecars: Vec<Usher> = ["a", "b"]
        .iter()
        .map(|who| {
            let routes = format!(
                "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: gh-{who}\n\
                 upstreams:\n  gh: {{ url: \"http://{up}\" }}\n\
                 resources:\n  github: {{ kind: rate, capacity: 5000/h, upstream_quota: {{ headers: github }} }}\n\
                 routes:\n  - name: gh\n    upstream: gh\n    resources: [github]\n"
            );
            Usher::proxy(&write_file(dir.path(), &format!("{who}.yaml"), &routes))
        })
        .collect();
    let ask = |who: &'static str, i: usize| {
        let addr = sidecars[i].addr("listen");
        async move {
            let mut c = h1(addr).await;
            let mut req = get("api.github.local", "/repos");
            req.headers_mut().insert("x-app", who.parse().unwrap());
            c.ready().await.unwrap();
            c.send_request(req).await.unwrap()
        }
    };
    // Both have a lease and have seen the quota with plenty left.
    assert_eq!(ask("a", 0).await.status(), 200);
    assert_eq!(ask("b", 1).await.status(), 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Others outside usher spend the rest; a meets the 403.
    remaining.store(0, std::sync::atomic::Ordering::SeqCst);
    let resp = ask("a", 0).await;
    let status = resp.status();
    let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
    assert_eq!(
        status,
        403,
        "{}\nserver: {}\nsidecar: {}",
        String::from_utf8_lossy(&body),
        support::http_get(server.addr("admin"), "/debug/status?format=json").1,
        support::http_get(sidecars[0].addr("admin"), "/debug/status?format=json").1
    );
    // Within a few refreshes, b's lease is 0 and says until when. (Asked
    // before that, b would send one request, meet the 403 itself and answer
    // with its own hold: that is not what this test is about.)
    let seen_b = from_b.load(std::sync::atomic::Ordering::SeqCst);
    let b_has = || {
        let (_, status) = support::http_get(sidecars[1].addr("admin"), "/debug/status?format=json");
        let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
        status["lease"]["keys"][0]["has"].as_f64()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while b_has() != Some(0.0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        b_has(),
        Some(0.0),
        "b's lease never went to 0: {}",
        support::http_get(sidecars[1].addr("admin"), "/debug/status?format=json").1
    );
    let resp = ask("b", 1).await;
    let status = resp.status().as_u16();
    let retry: u64 = resp.headers().get("retry-after").map_or(0, |v| v.to_str().unwrap().parse().unwrap());
    let body = String::from_utf8_lossy(&http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes())
        .into_owned();
    let left = reset as f64 - unix_now();
    assert_eq!(status, 429, "{body}");
    assert!(
        retry as f64 >= left - 2.0 && retry as f64 <= left + 2.0,
        "Retry-After {retry} with {left:.0} s to the reset: {body}"
    );
    assert!(body.contains("spent until it renews"), "{body}");
    // None of b's requests reached the spent upstream.
    assert_eq!(from_b.load(std::sync::atomic::Ordering::SeqCst), seen_b, "b sent to a spent upstream");
}
