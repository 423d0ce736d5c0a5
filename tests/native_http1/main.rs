//! The native HTTP/1.1 path (`crates/proxy/src/engine/native`) end to end,
//! in process: real sidecars on 127.0.0.1:0 ([`serve_with`] with
//! [`Http1::Native`] or [`Http1::Hyper`]) in front of real upstreams on
//! 127.0.0.1:0, mostly a scripted raw-TCP upstream that records the exact
//! requests it receives and answers what each test scripts, byte for byte.
//!
//! The tests, by the part of the path they exercise:
//! - [`differential`]: the same requests through a native and a hyper
//!   sidecar must reach the upstream alike and come back alike, and as the
//!   request and the script call for: a table of the everyday cases, a
//!   property test over generated combinations, the known differences
//!   between the engines, pinned, and regressions.
//! - [`connection`]: the client's connection: keep-alive (50 requests, one
//!   upstream connection), pipelining, the header timeout.
//! - [`admission`]: one outcome counted per request, and a client leaving
//!   while it waits for capacity.
//! - [`relay`]: relaying the upstream's answer: a gauge slot free once an
//!   answer's last bytes went out (both engines, every framing), broken and
//!   trickling bodies, and a client that leaves while its answer's body is
//!   idle (the real binary, HTTP/1.1, h2c and h2 over TLS upstreams).
//! - [`handoff`]: hand-off to hyper (`usher_proxy_http1_handoffs_total{reason}`),
//!   `Http1::Hyper` serving everything without one, and the binary's
//!   `--http1` flag and `USHER_HTTP1`.
//! - [`upstream`]: the upstream side: h2 upstreams (h2c, ALPN, GOAWAY, one
//!   that drops h2 for HTTP/1.1) and a stale pooled HTTP/1.1 connection (an
//!   idempotent request retried on a new one, a POST whose bytes the
//!   upstream took not retried).
//!
//! The shared harness: sidecars and their metrics (here), HTTP/1.1
//! messages parsed strictly ([`wire`]), a raw client ([`client`]) and the
//! scripted upstream ([`scripted`]).
//!
//! Which engine served a request is visible on the wire: the native path
//! forwards header names as it received them (`X-Served-By-Case`), hyper
//! writes them in lower case (`x-served-by-case`).

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

mod client;
mod scripted;
mod wire;

mod admission;
mod connection;
mod differential;
mod handoff;
mod relay;
mod upstream;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{Http1, Proxy, serve_with};

/// How long any one response may take to arrive whole.
const PATIENCE: Duration = Duration::from_secs(10);
/// The host routed to the upstream at its root.
const API: &str = "api.test";
/// The host routed to the same upstream under `/base/`.
const BASED: &str = "base.test";

// === sidecars ===

/// An in-process sidecar; stops serving when dropped.
struct Sidecar {
    proxy: Arc<Proxy>,
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A sidecar on 127.0.0.1:0 with a manual clock (admission never waits on wall time).
async fn sidecar(yaml: &str, engine: Http1) -> Sidecar {
    let (clock, _manual) = Clock::manual(Time::from_secs(1_000_000));
    sidecar_with(yaml, engine, clock).await
}

async fn sidecar_with(yaml: &str, engine: Http1, clock: Clock) -> Sidecar {
    let cfg = RoutesConfig::parse("native_http1.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
    let proxy = Proxy::new(cfg, "native_http1.yaml".into(), clock, prometheus::Registry::new()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve_with(proxy.clone(), listener, stop.clone(), Duration::from_secs(1), engine));
    Sidecar { proxy, addr, stop }
}

/// A routes file: `top` (e.g. `limits:`), then `api.test` routed to the
/// upstream at `up`, and `base.test` to it under `/base/`.
fn routes(up: SocketAddr, top: &str) -> String {
    format!(
        "{top}upstreams:\n  up: {{ url: \"http://{up}\" }}\n  based: {{ url: \"http://{up}/base/\" }}\n\
         routes:\n  - {{ name: api, match: {{ host: {API} }}, upstream: up }}\n  \
         - {{ name: based, match: {{ host: {BASED} }}, upstream: based }}\n"
    )
}

/// The sidecar's metrics in the text exposition format.
fn metrics_text(p: &Proxy) -> String {
    p.metrics.observe_table(&p.table);
    let mut out = Vec::new();
    prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &p.metrics.registry.gather(), &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// `usher_proxy_http1_handoffs_total` by reason, the non-zero ones only.
fn handoffs(p: &Proxy) -> BTreeMap<String, u64> {
    let text = metrics_text(p);
    let prefix = "usher_proxy_http1_handoffs_total{reason=\"";
    let series: Vec<(String, u64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|l| {
            let (reason, rest) = l.split_once('"').unwrap();
            let value = rest.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            (reason.to_string(), value as u64)
        })
        .collect();
    assert!(
        series.iter().any(|(r, _)| r == "transfer_encoding"),
        "the hand-off counter is registered with its reasons up front:\n{text}"
    );
    series.into_iter().filter(|(_, v)| *v > 0).collect()
}

fn reasons(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(r, n)| (r.to_string(), *n)).collect()
}

/// Requests waiting for capacity on `resource`, from the LeaseTable.
fn waiters(p: &Proxy, resource: &str) -> i64 {
    p.table.resource(resource).unwrap().limiters().iter().map(|l| l.demand().waiters()).sum()
}
