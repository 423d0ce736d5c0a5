//! The routes file's `limits:` section: what one sidecar listener accepts
//! from its clients (connections, header timeout and size, body size, HTTP/2
//! streams). Defaults are the `DEFAULT_*` constants, documented in
//! docs/proxy.md ("Listener limits").

use std::time::Duration;

use super::yaml::{Checker, Node, Value};

/// Connections served at once; more wait in the kernel's accept backlog.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// A client must send a request's headers within this long (and an idle
/// keep-alive connection is closed after it).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head (HTTP/1.1 buffer, HTTP/2 header list).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// Most header fields in one HTTP/1.1 request.
pub const DEFAULT_MAX_HEADERS: usize = 100;
/// Largest request body; `None` = unlimited (bodies stream, they are not buffered).
pub const DEFAULT_MAX_BODY_BYTES: Option<u64> = None;
/// Concurrent HTTP/2 streams per connection.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;

/// Smallest `max_header_bytes` hyper accepts (its read buffer cannot be smaller).
pub const MIN_HEADER_BYTES: usize = 8192;

const FIELDS: &[&str] = &[
    "max_connections",
    "header_timeout",
    "max_header_bytes",
    "max_headers",
    "max_body_bytes",
    "max_concurrent_streams",
];

/// Validated listener limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Connections served at once (at least 1).
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (more than zero).
    pub header_timeout: Duration,
    /// Largest request head, in bytes (at least [`MIN_HEADER_BYTES`]).
    pub max_header_bytes: usize,
    /// Most header fields in one HTTP/1.1 request.
    pub max_headers: usize,
    /// Largest request body, in bytes; `None` = unlimited.
    pub max_body_bytes: Option<u64>,
    /// Concurrent HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
        }
    }
}

impl std::fmt::Display for ListenerLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max_connections {}, header_timeout {:?}, max_header_bytes {}, max_headers {}, max_body_bytes {}, max_concurrent_streams {}",
            self.max_connections,
            self.header_timeout,
            self.max_header_bytes,
            self.max_headers,
            self.max_body_bytes.map_or_else(|| "unlimited".to_string(), |b| b.to_string()),
            self.max_concurrent_streams
        )
    }
}

/// Parses `65536`, `64KiB`, `1MiB`, `1GiB`, `10KB`, `10MB` or `1GB` to bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    let mult: u64 = match unit {
        "" | "B" => 1,
        "KB" | "kB" => 1000,
        "MB" => 1000 * 1000,
        "GB" => 1000 * 1000 * 1000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => return Err(format!("unknown unit `{other}`; use B, KB, MB, GB, KiB, MiB or GiB")),
    };
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size such as 65536, 64KiB or 10MB"))?;
    n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"))
}

/// Reads the `limits:` section (`node` is its value).
pub(crate) fn read_limits(ck: &mut Checker, node: &Node) -> Option<ListenerLimits> {
    let m = ck.map(node, "limits", FIELDS)?;
    let d = ListenerLimits::default();
    let size = |ck: &mut Checker, key: &str, min: u64, max: u64| -> Option<Option<u64>> {
        let Some(n) = m.get(key) else { return Some(None) };
        let path = m.child(key);
        let text = match &n.value {
            Value::Scalar(s, _) => s.clone(),
            _ => {
                ck.error(n.loc, &path, "expected a size such as 65536, 64KiB or 10MB", None);
                return None;
            }
        };
        match parse_size(&text) {
            Ok(v) if (min..=max).contains(&v) => Some(Some(v)),
            Ok(v) => {
                ck.error(n.loc, &path, format!("must be between {min} and {max} bytes, not {v}"), None);
                None
            }
            Err(e) => {
                ck.error(n.loc, &path, e, Some("e.g. 65536, 64KiB or 10MB".into()));
                None
            }
        }
    };
    let max_header_bytes = size(ck, "max_header_bytes", MIN_HEADER_BYTES as u64, u32::MAX as u64)
        .map(|v| v.map_or(d.max_header_bytes, |v| v as usize));
    let max_body_bytes = size(ck, "max_body_bytes", 1, u64::MAX).map(|v| v.or(d.max_body_bytes));
    let max_connections = count(ck, &m, "max_connections", d.max_connections, 1_000_000);
    let max_headers = count(ck, &m, "max_headers", d.max_headers, 10_000);
    let max_concurrent_streams =
        count(ck, &m, "max_concurrent_streams", d.max_concurrent_streams as usize, 1_000_000).map(|v| v as u32);
    let header_timeout = match m.get("header_timeout") {
        None => Some(d.header_timeout),
        Some(n) => match ck.duration(n, &m.child("header_timeout")) {
            Some(t) if t.is_zero() => {
                ck.error(n.loc, &m.child("header_timeout"), "must be longer than zero", None);
                None
            }
            t => t,
        },
    };
    Some(ListenerLimits {
        max_connections: max_connections?,
        header_timeout: header_timeout?,
        max_header_bytes: max_header_bytes?,
        max_headers: max_headers?,
        max_body_bytes: max_body_bytes?,
        max_concurrent_streams: max_concurrent_streams?,
    })
}

fn count(ck: &mut Checker, m: &super::yaml::MapView<'_>, key: &str, default: usize, max: usize) -> Option<usize> {
    let Some(n) = m.get(key) else { return Some(default) };
    let v = ck.i64(n, &m.child(key))?;
    if v < 1 || v as u64 > max as u64 {
        ck.error(n.loc, &m.child(key), format!("must be between 1 and {max}, not {v}"), None);
        return None;
    }
    Some(v as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::routes::RoutesConfig;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("1 MiB"), Ok(1 << 20));
        assert!(parse_size("+5").is_err());
        assert!(parse_size("5TB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("99999999999999GiB").unwrap_err().contains("too large"));
    }

    #[test]
    fn defaults_and_values() {
        let cfg = RoutesConfig::parse("r.yaml", "routes: []\n").unwrap();
        assert_eq!(cfg.limits, ListenerLimits::default());
        let cfg = RoutesConfig::parse(
            "r.yaml",
            "limits:\n  max_connections: 10\n  header_timeout: 1500ms\n  max_header_bytes: 16KiB\n  max_headers: 20\n  max_body_bytes: 1MB\n  max_concurrent_streams: 8\n",
        )
        .unwrap();
        assert_eq!(
            cfg.limits,
            ListenerLimits {
                max_connections: 10,
                header_timeout: Duration::from_millis(1500),
                max_header_bytes: 16384,
                max_headers: 20,
                max_body_bytes: Some(1_000_000),
                max_concurrent_streams: 8,
            }
        );
    }

    #[test]
    fn errors_name_line_column_and_field() {
        let e = RoutesConfig::parse(
            "r.yaml",
            "limits:\n  max_connections: 0\n  header_timeout: 0s\n  max_header_bytes: 100\n  max_body_bytes: lots\n  max_streams: 3\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("r.yaml:2:20") && e.contains("limits.max_connections"), "{e}");
        assert!(e.contains("r.yaml:3:19") && e.contains("limits.header_timeout"), "{e}");
        assert!(e.contains("r.yaml:4:21") && e.contains("between 8192"), "{e}");
        assert!(e.contains("r.yaml:5:19") && e.contains("limits.max_body_bytes"), "{e}");
        assert!(e.contains("max_streams"), "{e}");
    }
}
