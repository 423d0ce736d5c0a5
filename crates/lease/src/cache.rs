//! The on-disk lease cache: lets a restarted sidecar enforce its unexpired
//! leases at once and present them as `has`, so a server in learning mode
//! hands them back. Written atomically (temporary file + rename); a corrupt
//! file is reported and ignored, never fatal.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::core::Lease;
use usher_core::clock::Time;

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct CacheFile {
    version: u32,
    client_id: String,
    leases: Vec<CachedLease>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct CachedLease {
    resource_id: String,
    capacity: f64,
    /// Seconds since the Unix epoch.
    expiry: u64,
    refresh_interval_s: u64,
}

const VERSION: u32 = 1;

/// Writes the leases to `path` atomically.
pub fn write(path: &Path, client_id: &str, leases: &[(String, Lease)]) -> std::io::Result<()> {
    let file = CacheFile {
        version: VERSION,
        client_id: client_id.to_string(),
        leases: leases
            .iter()
            .map(|(id, l)| CachedLease {
                resource_id: id.clone(),
                capacity: l.capacity,
                expiry: l.expiry.as_secs().max(0) as u64,
                refresh_interval_s: l.refresh_interval.as_secs(),
            })
            .collect(),
    };
    let body = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&tmp, body)?;
    std::fs::rename(&tmp, path)
}

/// Reads the unexpired leases of `client_id` from `path`. A missing file is
/// an empty cache; an unreadable or corrupt one is logged and ignored.
pub fn read(path: &Path, client_id: &str, now: Time) -> Vec<(String, Lease)> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the lease cache; starting without it");
            return Vec::new();
        }
    };
    let file: CacheFile = match serde_json::from_slice(&bytes) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "the lease cache is corrupt; ignoring it");
            return Vec::new();
        }
    };
    if file.version != VERSION || file.client_id != client_id {
        tracing::warn!(path = %path.display(), cached_client = %file.client_id, "the lease cache belongs to another client or version; ignoring it");
        return Vec::new();
    }
    file.leases
        .into_iter()
        .filter(|l| l.capacity.is_finite() && l.capacity >= 0.0)
        .map(|l| {
            let lease = Lease {
                capacity: l.capacity,
                expiry: Time::from_secs(l.expiry),
                refresh_interval: Duration::from_secs(l.refresh_interval_s.max(1)),
            };
            (l.resource_id, lease)
        })
        .filter(|(_, l)| l.expiry > now)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_drops_expired_leases() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/leases.json");
        let now = Time::from_secs(1000);
        let live = Lease { capacity: 12.5, expiry: Time::from_secs(1060), refresh_interval: Duration::from_secs(10) };
        let dead = Lease { capacity: 3.0, expiry: Time::from_secs(999), refresh_interval: Duration::from_secs(10) };
        write(&p, "pod-1", &[("a".into(), live), ("b".into(), dead)]).unwrap();
        assert_eq!(read(&p, "pod-1", now), vec![("a".to_string(), live)]);
        assert!(read(&p, "pod-2", now).is_empty(), "another client's cache is not used");
    }

    #[test]
    fn corrupt_or_missing_files_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("leases.json");
        assert!(read(&p, "c", Time::from_secs(1)).is_empty());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(read(&p, "c", Time::from_secs(1)).is_empty());
    }
}
