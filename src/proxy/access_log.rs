//! The optional access log: one JSON line per request, written by a
//! dedicated thread so the request path only formats a line and hands it
//! over. When the writer falls behind, lines are dropped and counted in
//! `usher_proxy_access_log_dropped_total`: the request path never waits on disk.

use std::io::Write;
use std::path::Path;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::Duration;

use prometheus::IntCounter;
use serde::{Deserialize, Serialize};

/// Lines buffered between the request path and the writer.
pub const QUEUE: usize = 16_384;

/// One key a request was admitted (or refused) by.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyEntry {
    pub resource: String,
    pub id: String,
    /// `rate` (capacity per second) or `gauge` (capacity in flight).
    pub kind: String,
    /// The capacity in force for this key when the request was decided.
    pub capacity: f64,
}

/// One request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// Seconds since the Unix epoch, when the response headers were ready.
    pub time: f64,
    /// The sidecar's client id, so logs of many sidecars can be audited together.
    pub client: String,
    pub route: String,
    pub resources: Vec<KeyEntry>,
    /// admitted, paced, refused, upstream_error, client_timeout or no_route.
    pub outcome: String,
    pub wait_ms: f64,
    pub status: u16,
    /// From admission to the upstream's response headers.
    pub upstream_ms: Option<f64>,
    /// From arrival to the response headers.
    pub total_ms: f64,
}

pub struct AccessLog {
    tx: SyncSender<String>,
    dropped: IntCounter,
}

impl AccessLog {
    /// Opens (appends to) `path` and starts the writer thread.
    pub fn open(path: &Path, registry: &prometheus::Registry) -> std::io::Result<AccessLog> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let dropped = IntCounter::new(
            "usher_proxy_access_log_dropped_total",
            "Access log lines dropped because the writer fell behind.",
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(dropped.clone()));
        let name = path.display().to_string();
        std::thread::Builder::new().name("access-log".into()).spawn(move || write_lines(rx, file, &name))?;
        Ok(AccessLog { tx, dropped })
    }

    pub fn record(&self, e: &Entry) {
        let Ok(line) = serde_json::to_string(e) else { return };
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => self.dropped.inc(),
        }
    }
}

/// Writes lines as they come; flushes whenever the queue stays empty for 200 ms.
fn write_lines(rx: Receiver<String>, file: std::fs::File, name: &str) {
    let mut w = std::io::BufWriter::new(file);
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                if writeln!(w, "{line}").is_err() {
                    tracing::warn!(file = %name, "cannot write the access log");
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = w.flush();
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = w.flush();
                return;
            }
        }
    }
}
