//! A standalone server's record, in a local file, of until when its leases
//! may be outstanding: the `--state-file` analogue of the etcd record that an
//! elected server keeps (see `horizon`).
//!
//! The file holds one line, the time (milliseconds since the Unix epoch) by
//! which every lease the server has handed out, or will hand out before its
//! next write, has expired. It is rewritten every [`RECORD_EVERY`] through a
//! temporary file and a rename, so a crash mid-write leaves the old record
//! whole. At start a missing file is a fresh start (no learning mode); a
//! record whose leases and holds have lapsed is learnt from only while
//! clients reconnect; a later one is learnt from until then at the latest;
//! an unreadable or corrupt one is warned about and learnt from as long as
//! learning mode allows. A server that cannot write its record learns at
//! every start, as one without a record would: its next start could not
//! tell that leases are outstanding.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Node;
use super::horizon;
use super::store::Predecessor;
use usher_core::clock::{Clock, Time};

/// How often the record is written again.
pub const RECORD_EVERY: Duration = Duration::from_secs(2);

/// The default `--state-file` for a server listening on `port`:
/// `$XDG_STATE_HOME/usher/server-PORT.state`, else
/// `$HOME/.local/state/usher/server-PORT.state`, else the same name in the
/// temporary directory. `None` for port 0: an address nobody can know
/// before the server starts has no predecessor to tell apart.
pub fn default_path(port: u16) -> Option<PathBuf> {
    if port == 0 {
        return None;
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let dir = env("XDG_STATE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".local/state")))
        .map(|d| d.join("usher"))
        .unwrap_or_else(std::env::temp_dir);
    Some(dir.join(format!("server-{port}.state")))
}

/// What the file at `path` says at `now`, when clients hold an expired
/// lease for up to `hold`: a missing file is a fresh start.
pub fn read(path: &Path, now: Time, hold: Duration) -> Predecessor {
    match usher_core::config::file::read_text(path) {
        Ok(text) => {
            let p = horizon::predecessor(Some(&text), now, hold);
            if p == Predecessor::Unknown {
                tracing::warn!(
                    path = %path.display(),
                    "the state file does not hold a time (milliseconds since the Unix epoch); learning as if nothing were known"
                );
            }
            p
        }
        Err(usher_core::config::file::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            Predecessor::NoneOutstanding
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the state file; learning as if nothing were known");
            Predecessor::Unknown
        }
    }
}

/// Writes `t` to `path` atomically: a temporary file beside it, synced, then renamed over it.
pub fn write(path: &Path, t: Time) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().ok_or_else(|| std::io::Error::other("the path names no file"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = dir.join(tmp_name);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(format!("{}\n", horizon::encode(t)).as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// At start, before the server serves: reads what the last run recorded and
/// records this run's horizon. Returns whether the record could be written.
pub fn take_over(path: &Path, node: &Node, clock: &Clock) -> bool {
    let now = clock.now();
    let before = read(path, now, node.store.longest_lease());
    let h = horizon::horizon(now, node.store.longest_lease(), RECORD_EVERY);
    match write(path, h) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "state file: recording until when leases may be outstanding");
            horizon::apply(node, (before, h));
            true
        }
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "cannot write the state file: learning mode at this start and the next, as without one"
            );
            false
        }
    }
}

/// Rewrites the record every [`RECORD_EVERY`] until `shutdown`; a failure is
/// warned about once (leases then end at the last time written) and a
/// recovery logged.
pub async fn run(path: PathBuf, node: Arc<Node>, clock: Clock, recorded: bool, shutdown: CancellationToken) {
    let mut failing = !recorded;
    let mut tick = tokio::time::interval(RECORD_EVERY);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let h = horizon::horizon(clock.now(), node.store.longest_lease(), RECORD_EVERY);
        match write(&path, h) {
            Ok(()) => {
                if failing {
                    tracing::info!(path = %path.display(), "the state file is written again");
                    failing = false;
                }
                node.store.set_lease_horizon(Some(h));
            }
            Err(e) if !failing => {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the state file; leases end at the last time written");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_a_fresh_start_and_a_written_one_is_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/server.state");
        let now = Time::from_secs(1_800_000_000);
        assert_eq!(read(&path, now, Duration::ZERO), Predecessor::NoneOutstanding);
        let later = now.saturating_add(Duration::from_secs(30));
        write(&path, later).unwrap();
        assert_eq!(read(&path, now, Duration::ZERO), Predecessor::Until(later.saturating_add(horizon::CLOCK_SKEW)));
        // Written again in place; no temporary file is left behind.
        write(&path, now).unwrap();
        let names: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("server.state")]);
        let long_after = now.saturating_add(Duration::from_secs(60));
        assert_eq!(read(&path, long_after, Duration::from_secs(10)), Predecessor::Lapsed);
    }

    #[test]
    fn a_corrupt_or_unreadable_file_is_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let now = Time::from_secs(1_800_000_000);
        let garbage = dir.path().join("garbage");
        std::fs::write(&garbage, "not a time\n").unwrap();
        assert_eq!(read(&garbage, now, Duration::ZERO), Predecessor::Unknown);
        assert_eq!(read(dir.path(), now, Duration::ZERO), Predecessor::Unknown, "a directory");
        let in_a_file = garbage.join("x.state");
        assert!(write(&in_a_file, now).is_err(), "a parent that is a file");
    }

    #[test]
    fn the_default_depends_on_the_port() {
        assert_eq!(default_path(0), None);
        let p = default_path(15100).unwrap();
        assert!(p.ends_with("server-15100.state"), "{}", p.display());
    }
}
