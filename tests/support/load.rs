//! Open-loop load for integration tests: a fixed request rate over a few
//! HTTP/1.1 connections, counting 200s, 429s and anything else.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::upstream::{get, h1};

#[derive(Default)]
pub struct Tally {
    pub ok: AtomicU64,
    pub refused: AtomicU64,
    pub other: AtomicU64,
}

/// Offers `rate` requests per second to the proxy at `addr` for `dur`. Each
/// connection sends at most 12.5 requests/s, so the offered rate holds even
/// when a busy machine slows responses down to tens of milliseconds.
pub async fn drive(addr: std::net::SocketAddr, rate: f64, dur: Duration, tally: Arc<Tally>) {
    let conns = (rate / 12.5).ceil().clamp(4.0, 32.0) as usize;
    let every = Duration::from_secs_f64(conns as f64 / rate);
    let deadline = Instant::now() + dur;
    let mut tasks = Vec::new();
    for i in 0..conns {
        let tally = tally.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(every.mul_f64(i as f64 / conns as f64)).await;
            let mut c = h1(addr).await;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while Instant::now() < deadline {
                tick.tick().await;
                if c.ready().await.is_err() {
                    // The proxy closed the connection (it is shutting down): not an answer.
                    return;
                }
                let status = match c.send_request(get("app.local", "/x")).await {
                    Ok(r) => r.status().as_u16(),
                    Err(e) if e.is_incomplete_message() || e.is_closed() => return,
                    Err(e) => panic!("request failed: {e}"),
                };
                let counter = match status {
                    200 => &tally.ok,
                    429 => &tally.refused,
                    _ => &tally.other,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}
