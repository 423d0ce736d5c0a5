//! Open-loop load for integration tests: a fixed request rate over a few
//! HTTP/1.1 connections, counting 200s, 429s and anything else, or keeping
//! every answer with its times and `Retry-After` ([`drive_recorded`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::upstream::{get, h1};

/// Counts of how a load's requests ended, shared with the tasks sending them.
#[derive(Default)]
pub struct Tally {
    /// Requests answered `200` ([`drive`]) or any `2xx` (the strict loads).
    pub ok: AtomicU64,
    /// Requests answered `429`.
    pub refused: AtomicU64,
    /// Requests answered with any other status.
    pub other: AtomicU64,
    /// Requests that got no response at all (connection refused, reset or closed).
    pub errors: AtomicU64,
    /// Connections the proxy closed after an answer (replaced by the strict loads).
    pub closed: AtomicU64,
}

impl Tally {
    /// How many requests got a response of any status.
    pub fn answered(&self) -> u64 {
        self.ok.load(Ordering::Relaxed) + self.refused.load(Ordering::Relaxed) + self.other.load(Ordering::Relaxed)
    }

    /// All five counts on one line, for assertion messages.
    pub fn summary(&self) -> String {
        format!(
            "ok {} refused {} other {} errors {} closed {}",
            self.ok.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.other.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.closed.load(Ordering::Relaxed)
        )
    }
}

/// Offers `rate` requests per second to the proxy at `addr` for `dur`. Each
/// connection sends at most 12.5 requests/s, so the offered rate holds even
/// when a busy machine slows responses down to tens of milliseconds.
pub async fn drive(addr: std::net::SocketAddr, rate: f64, dur: Duration, tally: Arc<Tally>) {
    spread(rate, dur, move |mut ticks| {
        let tally = tally.clone();
        async move {
            let mut c = h1(addr).await;
            while ticks.next().await {
                if c.ready().await.is_err() {
                    // The proxy closed the connection (it is shutting down): not an answer.
                    tally.closed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let status = match c.send_request(get("app.local", "/x")).await {
                    Ok(r) => r.status().as_u16(),
                    Err(e) if e.is_incomplete_message() || e.is_closed() => {
                        tally.closed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(e) => panic!("request failed: {e}"),
                };
                let counter = match status {
                    200 => &tally.ok,
                    429 => &tally.refused,
                    _ => &tally.other,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
    .await
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

/// One answer of a [`drive_recorded`] load.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// When the request was sent.
    pub sent: Instant,
    /// When the response body had been read whole.
    pub answered: Instant,
    /// The response's status code.
    pub status: u16,
    /// `Retry-After` in seconds, when the answer has one.
    pub retry_after: Option<u64>,
}

async fn strict(
    addr: std::net::SocketAddr,
    rate: f64,
    dur: Duration,
    tally: Arc<Tally>,
    answers: Option<Arc<std::sync::Mutex<Vec<Answer>>>>,
) {
    spread(rate, dur, move |mut ticks| {
        let (tally, answers) = (tally.clone(), answers.clone());
        async move {
            let mut conn: Option<super::upstream::H1> = None;
            while ticks.next().await {
                if let Some(c) = conn.as_mut()
                    && c.ready().await.is_err()
                {
                    tally.closed.fetch_add(1, Ordering::Relaxed);
                    conn = None;
                }
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => match connect(addr).await {
                        Some(c) => conn.insert(c),
                        None => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    },
                };
                let sent = Instant::now();
                match tokio::time::timeout(Duration::from_secs(30), c.send_request(get("app.local", "/x"))).await {
                    Ok(Ok(r)) => {
                        let status = r.status().as_u16();
                        let retry_after =
                            r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
                        if http_body_util::BodyExt::collect(r.into_body()).await.is_err() {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            conn = None;
                            continue;
                        }
                        let counter = match status {
                            200..=299 => &tally.ok,
                            429 => &tally.refused,
                            _ => &tally.other,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        if let Some(a) = &answers {
                            let answered = Instant::now();
                            a.lock().unwrap().push(Answer { sent, answered, status, retry_after });
                        }
                    }
                    _ => {
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                        conn = None;
                    }
                }
            }
        }
    })
    .await
}

/// When one connection of a [`spread`] load sends its next request.
struct Ticks {
    interval: tokio::time::Interval,
    deadline: Instant,
}

impl Ticks {
    /// Waits for the next send time; `false` once the run is over.
    async fn next(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        self.interval.tick().await;
        true
    }
}

/// Offers `rate` requests per second for `dur`, spread over enough connections
/// that each sends at most 12.5 requests/s, their send times staggered evenly:
/// `conn` runs one connection's loop and returns when its [`Ticks`] run out.
async fn spread<F, Fut>(rate: f64, dur: Duration, conn: F)
where
    F: Fn(Ticks) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let conns = (rate / 12.5).ceil().clamp(4.0, 32.0) as usize;
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

async fn connect(addr: std::net::SocketAddr) -> Option<super::upstream::H1> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    Some(send)
}
