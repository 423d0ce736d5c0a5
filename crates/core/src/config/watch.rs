//! Tells when a config file should be read again: on SIGHUP, on any change in
//! the file's directory (which is how Kubernetes swaps a ConfigMap: it
//! re-points a `..data` symlink, so the file's own inode never changes), and
//! on a slow poll as a fallback for filesystems without inotify (every 5 s;
//! every hour while the directory is watched). Callers compare contents, so
//! a spurious wake-up costs one read.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::file;

/// Why a reload was triggered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The operator asked for it: reload even if the file looks unchanged.
    Signal,
    /// Something changed in the file's directory, or the poll fired.
    FileEvent,
}

/// How long the directory must stay quiet before a changed file is read.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// How often the file is re-read when no event arrives and the directory
/// cannot be watched.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);
/// The same while the directory is watched: a safety net only (inotify
/// reports every change, a Kubernetes ConfigMap's swap included), slow so
/// that an idle process wakes once an hour.
pub const WATCHED_POLL_INTERVAL: Duration = Duration::from_secs(3600);

/// Starts watching `path`. The returned receiver yields a [`Cause`] per
/// trigger (bursts are coalesced) until `shutdown` is cancelled.
pub fn watch(path: &Path, shutdown: CancellationToken) -> mpsc::Receiver<Cause> {
    let (tx, rx) = mpsc::channel(1);
    let dir: PathBuf = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };

    // Editors and `kubectl` write in several steps: wait for a quiet moment
    // before reading, so a half-written file is not reported as invalid.
    let (raw_tx, mut raw_rx) = mpsc::channel::<()>(1);
    let event_tx = raw_tx;
    let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        // A full channel already holds a pending reload.
        if res.is_ok_and(|e| changes_content(&e.kind)) {
            let _ = event_tx.try_send(());
        }
    })
    .and_then(|mut w| w.watch(&dir, RecursiveMode::NonRecursive).map(|()| w));
    let watcher = match watcher {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot watch config directory; relying on SIGHUP and polling");
            None
        }
    };

    let watching = watcher.is_some();
    tokio::spawn(async move {
        let _watcher = watcher; // dropped (and unwatched) when this task ends
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP");
                None
            }
        };
        let mut poll = tokio::time::interval(if watching { WATCHED_POLL_INTERVAL } else { POLL_INTERVAL });
        poll.tick().await;
        loop {
            let cause = tokio::select! {
                _ = shutdown.cancelled() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => Cause::Signal,
                _ = poll.tick() => Cause::FileEvent,
                Some(()) = raw_rx.recv() => {
                    tokio::time::sleep(DEBOUNCE).await;
                    while raw_rx.try_recv().is_ok() {}
                    Cause::FileEvent
                }
            };
            if cause == Cause::Signal {
                // A signal must not be lost to coalescing.
                if tx.send(cause).await.is_err() {
                    return;
                }
            } else {
                let _ = tx.try_send(cause);
            }
        }
    });
    rx
}

/// Whether an event in the watched directory may have changed a file. Opening
/// or reading one does not: inotify reports those too, and counting them made
/// every reload's own read of the file trigger the next reload, five times a
/// second for as long as the process ran.
fn changes_content(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// What a read of the watched file found: its bytes, or why it could not be
/// read (a change from one error to another is a change, and is reported).
type Snapshot = Result<Vec<u8>, String>;

fn snapshot(path: &Path) -> Snapshot {
    file::read_capped(path, file::MAX_FILE_BYTES).map_err(|e| e.to_string())
}

/// Watches `path` and calls `reload` with each trigger whose file content
/// changed (or with every SIGHUP), until `shutdown`. The caller parses,
/// applies, or keeps its last good configuration.
///
/// Reads and `reload` run on the blocking pool, one at a time: parsing a
/// large file must not hold up a runtime thread that serves requests. The
/// reads are bounded ([`file::read_capped`]), so a FIFO or a device at the
/// path cannot wedge this loop: the next trigger is still handled.
pub fn spawn_reloader<F>(path: PathBuf, shutdown: CancellationToken, reload: F) -> tokio::task::JoinHandle<()>
where
    F: Fn(Cause) + Send + Sync + 'static,
{
    let mut causes = watch(&path, shutdown);
    let reload = Arc::new(reload);
    tokio::spawn(async move {
        let p = path.clone();
        let mut last = tokio::task::spawn_blocking(move || snapshot(&p)).await.ok();
        while let Some(cause) = causes.recv().await {
            let (path, reload, before) = (path.clone(), reload.clone(), last.take());
            let read = tokio::task::spawn_blocking(move || {
                let now = snapshot(&path);
                if cause == Cause::Signal || before.as_ref() != Some(&now) {
                    reload(cause);
                }
                now
            });
            // A panic in `reload` is reported by the runtime; the next
            // trigger reads the file afresh.
            last = read.await.ok();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next trigger within `within`, if any.
    async fn next(rx: &mut mpsc::Receiver<Cause>, within: Duration) -> Option<Cause> {
        tokio::time::timeout(within, rx.recv()).await.ok().flatten()
    }

    #[tokio::test]
    async fn reading_the_file_does_not_trigger_a_reload_but_writing_it_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.yaml");
        std::fs::write(&path, "a: 1\n").unwrap();
        let shutdown = CancellationToken::new();
        let mut rx = watch(&path, shutdown.clone());
        // Let the watcher settle: nothing has happened yet.
        assert_eq!(next(&mut rx, Duration::from_millis(300)).await, None);
        for _ in 0..3 {
            std::fs::read(&path).unwrap();
        }
        assert_eq!(next(&mut rx, DEBOUNCE * 4).await, None, "a read is not a change");
        std::fs::write(&path, "a: 2\n").unwrap();
        assert_eq!(next(&mut rx, Duration::from_secs(3)).await, Some(Cause::FileEvent));
        shutdown.cancel();
    }
}
