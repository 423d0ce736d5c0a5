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
    /// The resource's name.
    pub resource: String,
    /// The key's resource id.
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
    /// The route taken; `_none` when no route matched.
    pub route: String,
    /// The keys the request was decided by.
    pub resources: Vec<KeyEntry>,
    /// admitted, paced, refused, shadow_refused, upstream_error, client_timeout or no_route.
    pub outcome: String,
    /// Milliseconds waited for admission.
    pub wait_ms: f64,
    /// The status code answered.
    pub status: u16,
    /// From admission to the upstream's response headers.
    pub upstream_ms: Option<f64>,
    /// From arrival to the response headers.
    pub total_ms: f64,
    /// The upstream whose own listener routed the request; absent on the main listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener: Option<String>,
}

/// The access log's request side: hands lines to the writer thread.
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
        let path = path.to_path_buf();
        std::thread::Builder::new().name("access-log".into()).spawn(move || write_lines(rx, file, &path))?;
        Ok(AccessLog { tx, dropped })
    }

    /// Hands one request's line to the writer, or counts it dropped when the writer is behind.
    pub fn record(&self, e: &Entry) {
        let Ok(line) = serde_json::to_string(e) else { return };
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => self.dropped.inc(),
        }
    }
}

/// How often, at most, the writer checks that the path still names its file.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Writes lines as they come; flushes whenever the queue stays empty for
/// 200 ms, then sleeps until the next line (no wake-ups while idle). A file
/// moved away or removed (log rotation: `mv` then a signal-less `create`, or
/// `rm`) is noticed at the next line, at most a second late, and the path
/// opened anew, so rotation needs no restart and no `copytruncate`.
#[allow(
    clippy::disallowed_methods,
    reason = "the writer thread checks for log rotation on the wall clock, off the request path"
)]
fn write_lines(rx: Receiver<String>, file: std::fs::File, path: &Path) {
    let name = path.display().to_string();
    let mut w = std::io::BufWriter::new(file);
    let mut dirty = false;
    let mut checked = std::time::Instant::now();
    loop {
        let line = if dirty {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = w.flush();
                    dirty = false;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(line) => line,
                Err(_) => break,
            }
        };
        if checked.elapsed() >= CHECK_EVERY {
            checked = std::time::Instant::now();
            if moved(w.get_ref(), path) {
                let _ = w.flush();
                match std::fs::OpenOptions::new().create(true).append(true).open(path) {
                    Ok(f) => {
                        w = std::io::BufWriter::new(f);
                        tracing::info!(file = %name, "the access log was moved or removed: writing to a new file at its path");
                    }
                    Err(e) => {
                        tracing::warn!(file = %name, error = %e, "cannot open the access log anew; writing on to the old file")
                    }
                }
            }
        }
        if writeln!(w, "{line}").is_err() {
            tracing::warn!(file = %name, "cannot write the access log");
        }
        dirty = true;
    }
    let _ = w.flush();
}

/// Whether `path` no longer names the open `file` (moved, removed, replaced).
fn moved(file: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => (open.dev(), open.ino()) != (named.dev(), named.ino()),
        (_, Err(_)) => true,
        (Err(_), Ok(_)) => false,
    }
}
