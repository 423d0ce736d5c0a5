//! Load for integration tests, counting 200s, 429s and anything else in a
//! [`Tally`] and checking every 429's `Retry-After` ([`crate::retry_after`]):
//!
//! - open loop: a fixed request rate over a few HTTP/1.1 connections
//!   ([`drive`], [`drive_strict`]), or keeping every answer with its times
//!   and `Retry-After` ([`drive_recorded`]);
//! - closed loop: connections that each send their next request as soon as
//!   the previous one is answered ([`closed_loop`]), a batch of requests at
//!   once ([`fire`]), and paced clients that wait out each 429's
//!   `Retry-After` and retry ([`retrying`]).
//!
//! Each load fails at its end, naming the values, when a 429's `Retry-After`
//! was bad.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::retry_after::{Checked, Limit};
use super::upstream::{H1, get, h1};

/// Counts of how a load's requests ended, shared with the tasks sending them.
#[derive(Default)]
pub struct Tally {
    /// Requests answered `2xx`.
    pub ok: AtomicU64,
    /// Requests answered `429`.
    pub refused: AtomicU64,
    /// Requests answered with any other status.
    pub other: AtomicU64,
    /// Requests that got no response at all (connection refused, reset or closed).
    pub errors: AtomicU64,
    /// Connections the proxy closed after an answer (replaced by the strict loads).
    pub closed: AtomicU64,
    /// The `Retry-After` of every 429, checked (by default against a day).
    pub retry_after: Checked,
}

impl Tally {
    /// A tally whose 429s may tell the app to wait at most `limit`.
    pub fn limited(limit: Limit) -> Tally {
        Tally { retry_after: Checked::new(limit), ..Tally::default() }
    }

    /// How many requests got a response of any status.
    pub fn answered(&self) -> u64 {
        self.ok.load(Ordering::Relaxed) + self.refused.load(Ordering::Relaxed) + self.other.load(Ordering::Relaxed)
    }

    /// All five counts and the `Retry-After`s on one line, for assertion messages.
    pub fn summary(&self) -> String {
        format!(
            "ok {} refused {} other {} errors {} closed {}; {}",
            self.ok.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.other.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.closed.load(Ordering::Relaxed),
            self.retry_after.summary()
        )
    }

    /// Counts an answer of `status` (a 2xx as `ok`), checking a 429's
    /// `Retry-After`: its seconds when it is a good one.
    fn count(&self, status: u16, headers: &http::HeaderMap) -> Option<u64> {
        let counter = match status {
            200..=299 => &self.ok,
            429 => &self.refused,
            _ => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if status == 429 { self.retry_after.check(headers) } else { None }
    }
}

/// Offers `rate` requests per second to the proxy at `addr` for `dur`. Each
/// connection sends at most 12.5 requests/s, so the offered rate holds even
/// when a busy machine slows responses down to tens of milliseconds.
pub async fn drive(addr: std::net::SocketAddr, rate: f64, dur: Duration, tally: Arc<Tally>) {
    let t = tally.clone();
    spread(rate, dur, move |mut ticks| {
        let tally = t.clone();
        async move {
            let mut c = h1(addr).await;
            while ticks.next().await {
                if c.ready().await.is_err() {
                    // The proxy closed the connection (it is shutting down): not an answer.
                    tally.closed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                match c.send_request(get("app.local", "/x")).await {
                    Ok(r) => tally.count(r.status().as_u16(), r.headers()),
                    Err(e) if e.is_incomplete_message() || e.is_closed() => {
                        tally.closed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(e) => panic!("request failed: {e}"),
                };
            }
        }
    })
    .await;
    tally.retry_after.assert_sane();
}

/// Like [`drive`], but nothing is forgiven: a request that gets no response
/// (refused or broken connection) counts in `errors` and its connection is
/// replaced, so the offered rate holds through the whole run.
pub async fn drive_strict(addr: std::net::SocketAddr, rate: f64, dur: Duration, tally: Arc<Tally>) {
    strict(addr, rate, dur, tally, None).await
}

/// Like [`drive_strict`] (so the offered rate holds through a sidecar
/// restart on the same address), also keeping every answer.
pub async fn drive_recorded(
    addr: std::net::SocketAddr,
    rate: f64,
    dur: Duration,
    tally: Arc<Tally>,
    answers: Arc<std::sync::Mutex<Vec<Answer>>>,
) {
    strict(addr, rate, dur, tally, Some(answers)).await
}

/// One answer of a load that keeps them.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// When the request was sent.
    pub sent: Instant,
    /// When the response body had been read whole.
    pub answered: Instant,
    /// The response's status code.
    pub status: u16,
    /// `Retry-After` in seconds, when the answer is a 429 with a good one.
    pub retry_after: Option<u64>,
}

async fn strict(
    addr: std::net::SocketAddr,
    rate: f64,
    dur: Duration,
    tally: Arc<Tally>,
    answers: Option<Arc<std::sync::Mutex<Vec<Answer>>>>,
) {
    let t = tally.clone();
    spread(rate, dur, move |mut ticks| {
        let (tally, answers) = (t.clone(), answers.clone());
        async move {
            let mut conn = None;
            while ticks.next().await {
                if let Some(a) = exchange(addr, &mut conn, &tally).await
                    && let Some(all) = &answers
                {
                    all.lock().unwrap().push(a);
                }
            }
        }
    })
    .await;
    tally.retry_after.assert_sane();
}

/// Sends one request on the connection in `conn`, made again when there is
/// none or the proxy closed it, and reads the answer whole. The answer is
/// counted in `tally` (a 429's `Retry-After` checked); a request that got
/// none counts in `errors` and drops the connection.
async fn exchange(addr: std::net::SocketAddr, conn: &mut Option<H1>, tally: &Tally) -> Option<Answer> {
    if let Some(c) = conn.as_mut()
        && c.ready().await.is_err()
    {
        tally.closed.fetch_add(1, Ordering::Relaxed);
        *conn = None;
    }
    let c = match conn.as_mut() {
        Some(c) => c,
        None => match connect(addr).await {
            Some(c) => conn.insert(c),
            None => {
                tally.errors.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        },
    };
    let sent = Instant::now();
    let got = async {
        let r = c.send_request(get("app.local", "/x")).await.ok()?;
        let (parts, body) = r.into_parts();
        http_body_util::BodyExt::collect(body).await.ok()?;
        Some(parts)
    };
    match tokio::time::timeout(Duration::from_secs(30), got).await {
        Ok(Some(parts)) => {
            let status = parts.status.as_u16();
            let retry_after = tally.count(status, &parts.headers);
            Some(Answer { sent, answered: Instant::now(), status, retry_after })
        }
        _ => {
            tally.errors.fetch_add(1, Ordering::Relaxed);
            *conn = None;
            None
        }
    }
}

// === closed loop ===

/// The most requests one connection of a [`closed_loop`] sends, so that a
/// loop of fast refusals stays bounded in count as well as in time.
pub const MAX_PER_CONN: u64 = 30_000;

/// Closed-loop load: `conns` connections to `addr`, each sending its next
/// request as soon as the previous one is answered, 200 or 429 alike, for
/// `dur` (and at most [`MAX_PER_CONN`] requests each).
pub async fn closed_loop(addr: std::net::SocketAddr, conns: usize, dur: Duration, tally: Arc<Tally>) {
    let deadline = Instant::now() + dur;
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let tally = tally.clone();
            tokio::spawn(async move {
                let mut conn = None;
                for _ in 0..MAX_PER_CONN {
                    if Instant::now() >= deadline {
                        return;
                    }
                    exchange(addr, &mut conn, &tally).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    tally.retry_after.assert_sane();
}

/// Sends `n` requests to `addr` at once over `conns` connections, each
/// sending its next as soon as the previous one is answered (`conns` equal
/// to `n`: all of them at the same moment).
pub async fn fire(addr: std::net::SocketAddr, n: usize, conns: usize, tally: Arc<Tally>) {
    let tasks: Vec<_> = (0..conns)
        .map(|c| {
            let tally = tally.clone();
            tokio::spawn(async move {
                let mut conn = None;
                for _ in (c..n).step_by(conns) {
                    exchange(addr, &mut conn, &tally).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    tally.retry_after.assert_sane();
}

/// Clients that do as a 429 tells them: `conns` connections offering `rate`
/// requests per second between them for `dur`, each sending at its own
/// pace and never more than one request at a time. A refused request is
/// sent again once its `Retry-After` has passed (1 s when it had no good
/// one), at most `retries` times; then it is given up. Returns how many
/// were given up.
pub async fn retrying(
    addr: std::net::SocketAddr,
    rate: f64,
    conns: usize,
    retries: u32,
    dur: Duration,
    tally: Arc<Tally>,
) -> u64 {
    let given_up = Arc::new(AtomicU64::new(0));
    let (t, g) = (tally.clone(), given_up.clone());
    spread_over(conns, rate, dur, move |mut ticks| {
        let (tally, given_up) = (t.clone(), g.clone());
        async move {
            let mut conn = None;
            while ticks.next().await {
                let mut tries = 0;
                while let Some(a) = exchange(addr, &mut conn, &tally).await
                    && a.status == 429
                {
                    if tries == retries || Instant::now() >= ticks.deadline {
                        given_up.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    tries += 1;
                    tokio::time::sleep(Duration::from_secs(a.retry_after.unwrap_or(1))).await;
                }
            }
        }
    })
    .await;
    tally.retry_after.assert_sane();
    given_up.load(Ordering::Relaxed)
}

// === pacing ===

/// When one connection of a [`spread`] load sends its next request.
struct Ticks {
    interval: tokio::time::Interval,
    deadline: Instant,
}

impl Ticks {
    /// Waits for the next send time; `false` once the run is over (a send
    /// time at or past the end of the run is not one).
    async fn next(&mut self) -> bool {
        // `timeout_at` polls the tick first: a connection behind its pace
        // would get a tick at once, however late, without the first check.
        let end = tokio::time::Instant::from_std(self.deadline);
        Instant::now() < self.deadline && tokio::time::timeout_at(end, self.interval.tick()).await.is_ok()
    }
}

/// Offers `rate` requests per second for `dur`, spread over enough connections
/// that each sends at most 12.5 requests/s ([`spread_over`]).
async fn spread<F, Fut>(rate: f64, dur: Duration, conn: F)
where
    F: Fn(Ticks) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let conns = (rate / 12.5).ceil().clamp(4.0, 32.0) as usize;
    spread_over(conns, rate, dur, conn).await
}

/// Offers `rate` requests per second for `dur` over `conns` connections,
/// their send times staggered evenly: `conn` runs one connection's loop and
/// returns when its [`Ticks`] run out. A connection that falls behind sends
/// its next request at once and keeps its pace from there.
async fn spread_over<F, Fut>(conns: usize, rate: f64, dur: Duration, conn: F)
where
    F: Fn(Ticks) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let every = Duration::from_secs_f64(conns as f64 / rate);
    let start = tokio::time::Instant::now();
    let deadline = Instant::now() + dur;
    let tasks: Vec<_> = (0..conns)
        .map(|i| {
            let mut interval = tokio::time::interval_at(start + every.mul_f64(i as f64 / conns as f64), every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tokio::spawn(conn(Ticks { interval, deadline }))
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn connect(addr: std::net::SocketAddr) -> Option<H1> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    Some(send)
}
