//! The real `usher proxy` binary against real upstreams on 127.0.0.1:0:
//! configuration errors, refusals of unrouted requests, upstream failures,
//! forward-proxy style and CONNECT, TLS origination, streaming with bounded
//! memory, reloads, and lease keys.
//!
//! - [`config`]: a bad routes file at start: every error with its position,
//!   exit 64.
//! - [`routing`]: unrouted requests (403) and the admin pages, forward-proxy
//!   style and CONNECT tunnels, protocol upgrades, `default: passthrough`
//!   and loop detection.
//! - [`upstream`]: upstream failures (502, 504), TLS origination, h2 to
//!   `https://` and h2c upstreams, a 200 MB body both ways in bounded memory,
//!   and oversized request heads.
//! - [`lifecycle`]: live reloads of the routes file (kept connections and
//!   limiter state, bad files refused) and draining on SIGTERM.
//! - [`lease`]: the embedded server's leases and templated keys (idle keys
//!   forgotten, non-UTF-8 values, lease state and transition metrics).

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

mod config;
mod lease;
mod lifecycle;
mod routing;
mod upstream;

use usher_test_support as support;

use std::path::Path;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use support::Usher;

/// Awaits a spawned task for at most 20 s of wall time.
async fn within<T>(task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), task).await.expect("task finished in time").unwrap()
}

fn start_proxy(routes: &Path) -> Usher {
    Usher::proxy(routes)
}

async fn read_head(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte)).await.expect("response head").unwrap();
        assert!(n == 1, "connection closed after {:?}", String::from_utf8_lossy(&buf));
        buf.push(byte[0]);
        assert!(buf.len() < 64 * 1024);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Replaces a file atomically, as editors and ConfigMap updates do, so no reload sees half a file.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
