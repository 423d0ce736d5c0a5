//! Abuse of the sidecar's listener by a hostile or broken client, against the
//! real `usher proxy` binary on 127.0.0.1:0: slowloris (1,000 connections that
//! never finish their request head), and the HTTP/2 floods behind
//! RUSTSEC-2023-0034 (rapid reset) and RUSTSEC-2024-0332 (CONTINUATION),
//! written frame by frame so the test controls every byte.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::upstream::{Upstream, get, h1, send1};
use support::{Usher, write_file};

fn routes(dir: &std::path::Path, up: SocketAddr, limits: &str) -> std::path::PathBuf {
    write_file(
        dir,
        "routes.yaml",
        &format!(
            "limits: {limits}\n\
             upstreams:\n  up: {{ url: \"http://{up}\" }}\n\
             routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up }}\n"
        ),
    )
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Open files this process may have (soft limit), raised to `want` if the
/// hard limit allows it (with util-linux's `prlimit`, so no unsafe code).
fn ensure_nofile(want: u64) {
    let read = || {
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
        let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
        let nums: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        (nums[0], nums.get(1).copied().unwrap_or(nums[0]))
    };
    let (soft, hard) = read();
    if soft >= want {
        return;
    }
    let target = want.min(hard);
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("prlimit").args(["--pid", &pid, &format!("--nofile={target}:{hard}")]).status();
    let (soft, _) = read();
    assert!(
        soft >= want,
        "this test needs {want} open files; the limit is {soft} (hard {hard}) and prlimit could not raise it: run `ulimit -n {want}` first"
    );
}

// === slowloris ===

/// How a slow client misbehaves.
#[derive(Clone, Copy, Debug)]
enum Slow {
    /// An HTTP/1.1 request head, one byte every 250 ms, never finished.
    Header,
    /// Connects and sends nothing.
    Silent,
    /// The HTTP/2 preface, one byte every 250 ms.
    Preface,
}

/// Drips bytes until the sidecar closes the connection; returns how long
/// the connection lived, or `None` if it was still open after `give_up`.
async fn drip(mut s: TcpStream, how: Slow, give_up: Duration, open: Arc<AtomicUsize>) -> Option<Duration> {
    let started = Instant::now();
    let text: &[u8] = match how {
        Slow::Header => b"GET /x HTTP/1.1\r\nHost: api.test\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        Slow::Silent => b"",
        Slow::Preface => b"PRI * HTTP/2.0\r\n\r\nSM\r\n",
    };
    let mut i = 0;
    let mut buf = [0u8; 1024];
    let lived = loop {
        if started.elapsed() > give_up {
            break None;
        }
        tokio::select! {
            r = s.read(&mut buf) => match r {
                // The sidecar closed (or answered and then closed: 408 is fine too).
                Ok(0) | Err(_) => break Some(started.elapsed()),
                Ok(_) => continue,
            },
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                if i < text.len() {
                    if s.write_all(&text[i..=i]).await.is_err() {
                        break Some(started.elapsed());
                    }
                    i += 1;
                }
            }
        }
    };
    open.fetch_sub(1, Ordering::SeqCst);
    lived
}

/// 1,000 slow connections (most dripping a request head, some silent, some
/// dripping the HTTP/2 preface) while legitimate requests flow: every
/// legitimate request succeeds, and every slow connection is closed once
/// the 2 s header timeout has passed, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_are_closed_and_legitimate_traffic_flows() {
    const SLOW: usize = 1000;
    const LEGIT: usize = 200;
    let timeout = Duration::from_secs(2);
    ensure_nofile(3 * SLOW as u64 + 512);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let usher = Usher::proxy(&routes(dir.path(), up.addr, "{ header_timeout: 2s, max_connections: 2000 }"));
    let addr = usher.addr("listen");

    let open = Arc::new(AtomicUsize::new(0));
    let mut slow = Vec::new();
    for i in 0..SLOW {
        let how = match i % 10 {
            0 => Slow::Silent,
            1 => Slow::Preface,
            _ => Slow::Header,
        };
        let s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        open.fetch_add(1, Ordering::SeqCst);
        slow.push((how, tokio::spawn(drip(s, how, Duration::from_secs(20), open.clone()))));
    }
    // Legitimate traffic starts once the slow connections are all open.
    let open_at_start = open.load(Ordering::SeqCst);
    assert!(open_at_start > 0, "the slow connections were closed before legitimate traffic began");
    let mut legit = Vec::new();
    for _ in 0..4 {
        legit.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..LEGIT / 4 {
                let mut c = h1(addr).await;
                statuses.push(send1(&mut c, get("api.test", "/x")).await.status.as_u16());
            }
            statuses
        }));
    }
    let mut ok = 0;
    for t in legit {
        let statuses =
            tokio::time::timeout(Duration::from_secs(60), t).await.expect("legitimate traffic finished").unwrap();
        assert!(statuses.iter().all(|s| *s == 200), "legitimate requests failed: {statuses:?}");
        ok += statuses.len();
    }
    assert_eq!(ok, LEGIT);
    eprintln!(
        "{LEGIT} legitimate requests served while {open_at_start} -> {} slow connections were open",
        open.load(Ordering::SeqCst)
    );
    assert_eq!(up.stats.requests(), LEGIT as u64, "the upstream saw only the legitimate requests");

    let mut early = Vec::new();
    let mut never = Vec::new();
    for (how, t) in slow {
        match tokio::time::timeout(Duration::from_secs(60), t).await.expect("slow client finished").unwrap() {
            // A little slack below the timeout for timer granularity.
            Some(lived) if lived + Duration::from_millis(100) < timeout => early.push((how, lived)),
            Some(_) => {}
            None => never.push(how),
        }
    }
    assert!(
        never.is_empty(),
        "{} slow connections were still open 20 s after connecting (header timeout 2 s): {never:?}",
        never.len()
    );
    assert!(early.is_empty(), "closed before the header timeout: {early:?}");
}

// === HTTP/2 floods ===

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK for `GET http://api.test/x`: static-table indices and one literal.
fn get_block() -> Vec<u8> {
    let mut b = vec![0x82, 0x86, 0x04, 0x02, b'/', b'x', 0x01, 0x08];
    b.extend_from_slice(b"api.test");
    b
}

/// Reads frames from the server until a GOAWAY or EOF; returns the GOAWAY's
/// error code, or `None` if the connection just closed.
async fn read_until_goaway(mut r: tokio::net::tcp::OwnedReadHalf) -> Option<u32> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        while buf.len() >= 9 {
            let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            if buf[3] == GOAWAY && len >= 8 {
                return Some(u32::from_be_bytes([buf[13], buf[14], buf[15], buf[16]]));
            }
            buf.drain(..9 + len);
        }
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

struct Flood {
    /// Bytes written before the sidecar stopped reading or closed.
    sent: usize,
    /// GOAWAY's error code, if one came.
    goaway: Option<u32>,
    /// Whether the sidecar closed the connection.
    closed: bool,
}

/// Opens an h2c connection, then writes `next(i)` for i = 0, 1, ... until the
/// sidecar sends GOAWAY or closes, or `max_bytes` are written.
async fn flood(addr: SocketAddr, max_bytes: usize, mut next: impl FnMut(u32) -> Vec<u8>) -> Flood {
    let s = TcpStream::connect(addr).await.unwrap();
    let (r, mut w) = s.into_split();
    let reader = tokio::spawn(read_until_goaway(r));
    w.write_all(PREFACE).await.unwrap();
    w.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let mut sent = 0;
    let mut i = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent < max_bytes && !reader.is_finished() && Instant::now() < deadline {
        let mut batch = Vec::new();
        while batch.len() < 16 * 1024 {
            batch.extend(next(i));
            i += 1;
        }
        match tokio::time::timeout(Duration::from_secs(5), w.write_all(&batch)).await {
            Ok(Ok(())) => sent += batch.len(),
            // A failed or stalled write: the sidecar closed or stopped reading.
            _ => break,
        }
    }
    let goaway = tokio::time::timeout(Duration::from_secs(10), reader).await;
    let (goaway, closed) = match goaway {
        Ok(Ok(code)) => (code, true),
        _ => (None, false),
    };
    Flood { sent, goaway, closed }
}

/// HEADERS then RST_STREAM, over and over on fresh streams: the sidecar
/// answers with GOAWAY (ENHANCE_YOUR_CALM) and closes, long before the flood
/// runs out, and its memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_rapid_reset_gets_goaway() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let usher = Usher::proxy(&routes(dir.path(), up.addr, "{}"));
    let pid = usher.child.id();
    let before = rss_kib(pid);
    let block = get_block();
    let f = flood(usher.addr("listen"), 64 << 20, |i| {
        let id = 2 * i + 1;
        let mut b = frame(HEADERS, END_HEADERS | END_STREAM, id, &block);
        b.extend(frame(RST_STREAM, 0, id, &8u32.to_be_bytes())); // CANCEL
        b
    })
    .await;
    let after = rss_kib(pid);
    assert!(f.closed, "the connection stayed open after {} bytes of rapid resets", f.sent);
    assert_eq!(f.goaway, Some(0xb), "expected GOAWAY ENHANCE_YOUR_CALM after {} bytes", f.sent);
    assert!(f.sent < 32 << 20, "the sidecar read {} bytes of resets before closing", f.sent);
    assert!(after < before + 64 * 1024, "RSS grew from {before} KiB to {after} KiB");
    // The sidecar still serves.
    let mut c = h1(usher.addr("listen")).await;
    assert_eq!(send1(&mut c, get("api.test", "/x")).await.status, 200);
}

/// HEADERS without END_HEADERS, then CONTINUATION frames that never end the
/// block: the sidecar closes the connection (GOAWAY) after about
/// `max_header_bytes`, instead of buffering without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_continuation_flood_is_cut_off() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let usher = Usher::proxy(&routes(dir.path(), up.addr, "{ max_header_bytes: 16KiB }"));
    let pid = usher.child.id();
    let before = rss_kib(pid);
    // Each fragment: a literal header `x-flood: <1000 bytes>` (never indexed).
    let mut fragment = vec![0x10, 0x07];
    fragment.extend_from_slice(b"x-flood");
    fragment.extend_from_slice(&[0x7f, 0xe9, 0x06]); // length 1000 (127 + 873)
    fragment.extend(std::iter::repeat_n(b'a', 1000));
    let block = get_block();
    let f = flood(usher.addr("listen"), 64 << 20, |i| {
        if i == 0 { frame(HEADERS, END_STREAM, 1, &block) } else { frame(CONTINUATION, 0, 1, &fragment) }
    })
    .await;
    let after = rss_kib(pid);
    assert!(f.closed, "the connection stayed open after {} bytes of CONTINUATION", f.sent);
    assert!(f.goaway.is_some(), "no GOAWAY after {} bytes of CONTINUATION", f.sent);
    assert!(f.sent < 32 << 20, "the sidecar read {} bytes of one header block before closing", f.sent);
    assert!(after < before + 64 * 1024, "RSS grew from {before} KiB to {after} KiB");
    let mut c = h1(usher.addr("listen")).await;
    assert_eq!(send1(&mut c, get("api.test", "/x")).await.status, 200);
}
