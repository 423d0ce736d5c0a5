//! The lease client's part of the routes file: the top-level `doorman:`
//! section (which servers, who we are, how to refresh) and the per-resource
//! lease settings (`wants`, `priority`, `on_expiry`, `safe_capacity`, ...).

use std::path::PathBuf;
use std::time::Duration;

use super::yaml::{Checker, MapView, Node};

/// Default refresh jitter: refreshes are spread uniformly over ±1/6 of the interval.
pub const DEFAULT_JITTER: f64 = 1.0 / 6.0;
/// Default minimum interval between two refreshes (the server's minimum request interval).
pub const DEFAULT_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Default headroom on a measured rate.
pub const DEFAULT_HEADROOM: f64 = 1.1;

/// What a key may use once its lease has expired, or before the first one
/// (`on_expiry`); the lease client has its own copy of this choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExpiry {
    /// As if granted what it wants.
    Optimistic,
    /// Nothing.
    Pessimistic,
    /// The server's safe capacity, else `safe_capacity` (-1 = unlimited).
    Safe,
}

/// `doorman.backoff`: how failed calls to capacity servers back off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// Each failure multiplies the delay by this (at least 1).
    pub multiplier: f64,
    /// Each delay is drawn from `delay × (1 ± randomization)`.
    pub randomization: f64,
}

/// Default `backoff.max`: short, so that clients cut off by a failover are
/// back within a few seconds of a new master; the jitter keeps a fleet that
/// failed together from retrying together.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(2);

impl Default for Backoff {
    /// The defaults in docs/proxy.md's `doorman.` table, which the lease
    /// client's own defaults are too.
    fn default() -> Self {
        Backoff { initial: Duration::from_millis(500), max: DEFAULT_BACKOFF_MAX, multiplier: 1.5, randomization: 0.3 }
    }
}

/// The `doorman:` section: where to lease from.
#[derive(Debug, Clone, PartialEq)]
pub struct DoormanConfig {
    /// Capacity server addresses (`host:port`, `http://` or `https://`), at least one.
    pub servers: Vec<String>,
    /// This sidecar's id at the servers, `${VAR}`s expanded.
    pub client_id: String,
    /// `doorman.tls`: reach every server (and every master they name) over TLS.
    pub tls: Option<crate::tls::ClientFiles>,
    /// Leases are written here after every refresh, to be enforced again after a restart.
    pub cache_file: Option<PathBuf>,
    /// Refreshes are spread over the interval × (1 ± jitter); from 0 to 1.
    pub jitter: f64,
    /// Early refreshes happen at most this often.
    pub min_interval: Duration,
    /// How failed calls back off.
    pub backoff: Backoff,
}

/// What a resource asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wants {
    /// From the demand meter (see docs/proxy.md for the formula).
    Auto,
    /// This many units (per second for a rate, in flight for a gauge).
    Fixed(f64),
}

/// One resource's lease settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseSettings {
    /// `None`: not written; `auto` in Doorman mode, the capacity in embedded mode.
    pub wants: Option<Wants>,
    /// Sent with every request; servers in strict priority mode serve higher values first.
    pub priority: i64,
    /// What a key may use without an unexpired lease.
    pub on_expiry: OnExpiry,
    /// Used by [`OnExpiry::Safe`] when the server sent none; -1 = unlimited.
    pub safe_capacity: Option<f64>,
    /// The least `wants: auto` asks for.
    pub min_wants: f64,
    /// The most `wants: auto` asks for; `None` = no cap.
    pub max_wants: Option<f64>,
    /// Multiplies the measured rate in `wants: auto` (at least 1).
    pub headroom: f64,
    /// A templated key with no request for this long is released and forgotten.
    pub key_idle_timeout: Duration,
}

/// Default `key_idle_timeout`.
pub const DEFAULT_KEY_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            wants: None,
            priority: 0,
            on_expiry: OnExpiry::Safe,
            safe_capacity: None,
            min_wants: 0.0,
            max_wants: None,
            headroom: DEFAULT_HEADROOM,
            key_idle_timeout: DEFAULT_KEY_IDLE_TIMEOUT,
        }
    }
}

/// How a route reacts to its upstream's 429 and 503 answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushbackConfig {
    /// Whether the route backs off at all.
    pub enabled: bool,
    /// Each pushback multiplies the route's admission rate by this.
    pub multiplier: f64,
    /// After this many successes in a row the rate recovers one step.
    pub recover_after: u32,
    /// One recovery step multiplies the rate by this (with ±10% jitter), up to the lease.
    pub recover_step: f64,
}

impl Default for PushbackConfig {
    fn default() -> Self {
        PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 10, recover_step: 1.5 }
    }
}

/// Reads a route's `pushback:`: `false`, `true`, or a mapping of the fields.
pub(crate) fn read_pushback(ck: &mut Checker, node: &Node, path: &str) -> Option<PushbackConfig> {
    let d = PushbackConfig::default();
    if let Some(s) = node.as_str()
        && (s == "true" || s == "false")
    {
        return Some(PushbackConfig { enabled: s == "true", ..d });
    }
    let m = ck.map(node, path, &["enabled", "multiplier", "recover_after", "recover_step"])?;
    let enabled = m.get("enabled").map_or(Some(true), |n| ck.bool(n, &m.child("enabled")))?;
    let multiplier =
        number(ck, &m, "multiplier", |v| v > 0.0 && v < 1.0, "between 0 and 1 (exclusive)")?.unwrap_or(d.multiplier);
    let recover_after = match m.get("recover_after") {
        None => d.recover_after,
        Some(n) => ck.i64(n, &m.child("recover_after"))?.clamp(1, 1_000_000) as u32,
    };
    let recover_step = number(ck, &m, "recover_step", |v| v > 1.0, "greater than 1")?.unwrap_or(d.recover_step);
    Some(PushbackConfig { enabled, multiplier, recover_after, recover_step })
}

/// The per-resource keys this module reads.
pub const LEASE_FIELDS: &[&str] =
    &["wants", "priority", "on_expiry", "safe_capacity", "min_wants", "max_wants", "headroom"];

const DOORMAN_FIELDS: &[&str] = &["servers", "client_id", "tls", "cache_file", "jitter", "min_interval", "backoff"];
const BACKOFF_FIELDS: &[&str] = &["initial", "max", "multiplier", "randomization"];

/// `hostname:pid`, the default client id.
pub fn default_client_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// Expands `${VAR}` from the environment; an unset variable is an error.
pub fn expand_env(s: &str) -> Result<String, String> {
    expand_env_or_keep(s, None)
}

/// Expands `${VAR}` from the environment. An unset variable is an error,
/// unless `unset` is given: then it stays as written (`${VAR}`) and its
/// name is added there.
pub fn expand_env_or_keep(s: &str, mut unset: Option<&mut Vec<String>>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unterminated `${{` in `{s}`"))?;
        let name = &after[..end];
        match (std::env::var(name), unset.as_deref_mut()) {
            (Ok(value), _) => out.push_str(&value),
            (Err(_), Some(names)) => {
                if !names.iter().any(|n| n == name) {
                    names.push(name.to_string());
                }
                out.push_str(&rest[start..start + 3 + end]);
            }
            (Err(_), None) => return Err(format!("environment variable `{name}` is not set")),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn number(ck: &mut Checker, m: &MapView<'_>, key: &str, ok: impl Fn(f64) -> bool, rule: &str) -> Option<Option<f64>> {
    let Some(n) = m.get(key) else { return Some(None) };
    let v = ck.f64(n, &m.child(key))?;
    if !(v.is_finite() && ok(v)) {
        ck.error(n.loc, &m.child(key), format!("must be {rule}, not {v}"), None);
        return None;
    }
    Some(Some(v))
}

/// As [`number`], for a capacity: also `50/s`, `600/min`, `5000/h`, `1000/day` (per second).
fn rate(ck: &mut Checker, m: &MapView<'_>, key: &str, ok: impl Fn(f64) -> bool, rule: &str) -> Option<Option<f64>> {
    let Some(n) = m.get(key) else { return Some(None) };
    let v = super::resources::rate(ck, n, &m.child(key))?;
    if !(v.is_finite() && ok(v)) {
        ck.error(n.loc, &m.child(key), format!("must be {rule}, not {v}"), None);
        return None;
    }
    Some(Some(v))
}

/// Reads the `doorman:` section.
pub(crate) fn read_doorman(ck: &mut Checker, node: &Node) -> Option<DoormanConfig> {
    let m = ck.map(node, "doorman", DOORMAN_FIELDS)?;
    let servers = ck.required(&m, "servers", Some("capacity server addresses, e.g. [doorman-0:15100]")).and_then(|n| {
        let items = ck.seq(n, "doorman.servers")?;
        let list: Vec<String> =
            items.iter().enumerate().filter_map(|(i, it)| ck.string(it, &format!("doorman.servers[{i}]"))).collect();
        if list.is_empty() {
            ck.error(
                n.loc,
                "doorman.servers",
                "needs at least one server",
                Some("or remove `doorman:` for embedded mode".into()),
            );
            return None;
        }
        let mut ok = list.len() == items.len();
        for (i, (addr, it)) in list.iter().zip(items).enumerate() {
            if let Err(e) = check_server_address(addr) {
                ck.error(it.loc, &format!("doorman.servers[{i}]"), e, None);
                ok = false;
            }
        }
        ok.then_some(list)
    });
    let client_id = match m.get("client_id") {
        None => Some(default_client_id()),
        Some(n) => ck.string(n, "doorman.client_id").and_then(|s| match expand_env_or_keep(&s, ck.unset_env.as_mut()) {
            Ok(v) if !v.is_empty() => Some(v),
            Ok(_) => {
                ck.error(n.loc, "doorman.client_id", "expands to an empty string", None);
                None
            }
            Err(e) => {
                ck.error(n.loc, "doorman.client_id", e, Some("set it in the pod spec, e.g. from metadata.name; `usher check --allow-unset-env` checks the file without it".into()));
                None
            }
        }),
    };
    let tls = match m.get("tls") {
        None => Some(None),
        Some(n) => read_tls(ck, n).map(Some),
    };
    // TLS is switched on by `tls:`, not by the address: an `https://` server
    // without it would be dialled in cleartext.
    if m.get("tls").is_none()
        && let Some(super::yaml::Node { value: super::yaml::Value::Seq(items), .. }) = m.get("servers")
    {
        for (i, it) in items.iter().enumerate() {
            if it.as_str().is_some_and(|a| a.starts_with("https://")) {
                ck.error(
                    it.loc,
                    &format!("doorman.servers[{i}]"),
                    "an https:// server needs `doorman.tls`",
                    Some("add `tls: { ca_file: ... }`, or write the address as host:port".into()),
                );
            }
        }
    }
    let cache_file = m.get("cache_file").and_then(|n| ck.string(n, "doorman.cache_file")).map(PathBuf::from);
    let jitter = number(ck, &m, "jitter", |v| (0.0..=1.0).contains(&v), "between 0 and 1")?.unwrap_or(DEFAULT_JITTER);
    let min_interval =
        m.get("min_interval").map_or(Some(DEFAULT_MIN_INTERVAL), |n| ck.duration(n, "doorman.min_interval"));
    let backoff = match m.get("backoff") {
        None => Some(Backoff::default()),
        Some(n) => read_backoff(ck, n),
    };
    Some(DoormanConfig {
        servers: servers?,
        client_id: client_id?,
        tls: tls?,
        cache_file,
        jitter,
        min_interval: min_interval?,
        backoff: backoff?,
    })
}

const TLS_FIELDS: &[&str] = &["ca_file", "cert_file", "key_file", "server_name"];

/// Reads `doorman.tls` and loads every file it names, so a missing file, bad
/// PEM or a key that does not match its certificate is reported at its line.
fn read_tls(ck: &mut Checker, node: &Node) -> Option<crate::tls::ClientFiles> {
    use crate::tls::{ClientFiles, ClientTls, Which};
    let m = ck.map(node, "doorman.tls", TLS_FIELDS)?;
    let ca = ck
        .required(&m, "ca_file", Some("the PEM file of the CA that signs the capacity servers' certificates"))
        .and_then(|n| ck.string(n, "doorman.tls.ca_file"));
    let cert = m.get("cert_file").and_then(|n| ck.string(n, "doorman.tls.cert_file"));
    let key = m.get("key_file").and_then(|n| ck.string(n, "doorman.tls.key_file"));
    let server_name = m.get("server_name").and_then(|n| ck.string(n, "doorman.tls.server_name"));
    let files =
        ClientFiles { ca: PathBuf::from(ca?), cert: cert.map(PathBuf::from), key: key.map(PathBuf::from), server_name };
    if let Err(e) = ClientTls::load(&files) {
        // A missing half of the pair is reported at the half that is there.
        let field = match e.which {
            Which::Ca => "ca_file",
            Which::Cert if files.cert.is_none() => "key_file",
            Which::Key if files.key.is_none() => "cert_file",
            Which::Cert => "cert_file",
            Which::Key => "key_file",
            Which::ServerName => "server_name",
        };
        let loc = m.get(field).map_or(node.loc, |n| n.loc);
        let hint = match field {
            "cert_file" | "key_file" if files.cert.is_none() || files.key.is_none() => {
                Some("give both cert_file and key_file for mTLS, or neither".to_string())
            }
            _ => None,
        };
        let reason = if e.which == Which::ServerName { e.reason } else { format!("{}: {}", e.path, e.reason) };
        ck.error(loc, &m.child(field), reason, hint);
        return None;
    }
    Some(files)
}

fn read_backoff(ck: &mut Checker, node: &Node) -> Option<Backoff> {
    let m = ck.map(node, "doorman.backoff", BACKOFF_FIELDS)?;
    let d = Backoff::default();
    let initial = m.get("initial").map_or(Some(d.initial), |n| ck.duration(n, "doorman.backoff.initial"));
    let max = m.get("max").map_or(Some(d.max), |n| ck.duration(n, "doorman.backoff.max"));
    let multiplier = number(ck, &m, "multiplier", |v| v >= 1.0, "at least 1")?.unwrap_or(d.multiplier);
    let randomization =
        number(ck, &m, "randomization", |v| (0.0..=1.0).contains(&v), "between 0 and 1")?.unwrap_or(d.randomization);
    Some(Backoff { initial: initial?, max: max?, multiplier, randomization })
}

/// Reads the lease settings of one resource from its mapping.
pub(crate) fn read_lease_settings(ck: &mut Checker, m: &MapView<'_>) -> Option<LeaseSettings> {
    let d = LeaseSettings::default();
    let wants = match m.get("wants") {
        None => Some(None),
        Some(n) if n.as_str() == Some("auto") => Some(Some(Wants::Auto)),
        Some(n) => {
            let v = super::resources::rate(ck, n, &m.child("wants"));
            match v {
                Some(v) if v.is_finite() && v >= 0.0 => Some(Some(Wants::Fixed(v))),
                Some(v) => {
                    ck.error(n.loc, &m.child("wants"), format!("must be `auto` or a number >= 0, not {v}"), None);
                    None
                }
                None => None,
            }
        }
    };
    let priority = m.get("priority").map_or(Some(0), |n| ck.i64(n, &m.child("priority")));
    let on_expiry = match m.get("on_expiry") {
        None => Some(d.on_expiry),
        Some(n) => match ck.string(n, &m.child("on_expiry")).as_deref() {
            Some("optimistic") => Some(OnExpiry::Optimistic),
            Some("pessimistic") => Some(OnExpiry::Pessimistic),
            Some("safe") => Some(OnExpiry::Safe),
            Some(other) => {
                ck.error(
                    n.loc,
                    &m.child("on_expiry"),
                    format!("unknown behaviour `{other}`"),
                    Some("optimistic, pessimistic or safe".into()),
                );
                None
            }
            None => None,
        },
    };
    let safe_capacity =
        rate(ck, m, "safe_capacity", |v| v == -1.0 || v >= 0.0, "-1 (unlimited), 0 or a positive capacity")?;
    let min_wants = rate(ck, m, "min_wants", |v| v >= 0.0, "a number >= 0")?.unwrap_or(0.0);
    let max_wants = rate(ck, m, "max_wants", |v| v >= 0.0, "a number >= 0")?;
    let headroom = number(ck, m, "headroom", |v| v >= 1.0, "at least 1")?.unwrap_or(DEFAULT_HEADROOM);
    let key_idle_timeout = m
        .get("key_idle_timeout")
        .map_or(Some(DEFAULT_KEY_IDLE_TIMEOUT), |n| ck.duration(n, &m.child("key_idle_timeout")))?;
    Some(LeaseSettings {
        wants: wants?,
        priority: priority?,
        on_expiry: on_expiry?,
        safe_capacity,
        min_wants,
        max_wants,
        headroom,
        key_idle_timeout,
    })
}

/// Checks a capacity server's address as usher dials it: `host:port`, or
/// `http://` or `https://` before it; the host a name, an IPv4 address or a
/// bracketed IPv6 one; the port from 1 to 65535. The error says what is
/// wrong, for a config file or flag to report before anything runs.
pub fn check_server_address(addr: &str) -> Result<(), String> {
    let (rest, schemed) = match addr.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") => {
            (rest, true)
        }
        Some((scheme, _)) => return Err(format!("`{scheme}://` is not a scheme usher dials (http:// or https://)")),
        None => (addr, false),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Err("is empty: write host:port, e.g. doorman-0:15100".into());
    }
    if rest.contains(['/', '?', '#', '@']) {
        return Err("must be host:port alone (no path, query or user)".into());
    }
    let (host, port) = match rest.strip_prefix('[') {
        Some(v6) => match v6.split_once("]:") {
            Some((h, p)) => (h, p),
            // A scheme's default port (80, 443) stands in for a missing one.
            None if schemed && v6.ends_with(']') => (&v6[..v6.len() - 1], "443"),
            None => return Err("needs a port after the bracketed IPv6 address, e.g. [::1]:15100".into()),
        },
        None => match rest.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                return Err("has more than one `:`; write an IPv6 address in brackets, e.g. [::1]:15100".into());
            }
            Some(("", _)) => return Err("needs a host before the port".into()),
            Some(hp) => hp,
            None if schemed => (rest, "443"),
            None => return Err("needs a port, e.g. doorman-0:15100".into()),
        },
    };
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(format!("port `{port}` is not a number from 1 to 65535")),
    }
    if http::uri::Authority::try_from(rest).is_err() || host.is_empty() {
        return Err(format!("`{host}` is not a host name or address"));
    }
    Ok(())
}

/// [`check_server_address`] as a clap value parser.
pub fn parse_server_address(addr: &str) -> Result<String, String> {
    check_server_address(addr).map(|()| addr.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_expansion() {
        // SAFETY-free: HOME is set in every test environment we run in.
        let home = std::env::var("HOME").unwrap();
        assert_eq!(expand_env("a-${HOME}-b").unwrap(), format!("a-{home}-b"));
        assert!(expand_env("${USHER_SURELY_UNSET_VARIABLE}").unwrap_err().contains("USHER_SURELY_UNSET_VARIABLE"));
        assert!(expand_env("${OPEN").is_err());
        assert_eq!(expand_env("plain").unwrap(), "plain");
        let mut unset = Vec::new();
        let kept = expand_env_or_keep("${USHER_SURELY_UNSET_A}-${HOME}-${USHER_SURELY_UNSET_A}", Some(&mut unset));
        assert_eq!(kept.unwrap(), format!("${{USHER_SURELY_UNSET_A}}-{home}-${{USHER_SURELY_UNSET_A}}"));
        assert_eq!(unset, ["USHER_SURELY_UNSET_A"], "named once");
    }
}
