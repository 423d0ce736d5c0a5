//! The capacity server's resources file: Doorman's YAML, read exactly as the
//! original reads it (proto field names, enum values by name), validated the
//! way the original validates it, plus the checks whose absence made the
//! original crash.

use std::sync::Arc;
use std::time::Duration;

use super::yaml::{Checker, ConfigError, MapView, Node, parse};

/// The catch-all glob that must end every resources file.
pub const CATCH_ALL: &str = "*";

/// The text of [`ResourcesConfig::builtin_default`].
pub const DEFAULT_RESOURCES: &str = include_str!("default_resources.yaml");

/// A validated resources file.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourcesConfig {
    /// The templates in file order; the last is the catch-all.
    pub templates: Vec<Arc<Template>>,
}

/// One `resources:` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    /// The resource ids this template applies to: an exact id or a glob.
    pub identifier_glob: String,
    /// Units per second (a file may write `600/min`, `5000/h`, `1000/day`).
    pub capacity: f64,
    /// Units per second. `None`: dynamic (capacity / number of clients). `-1` unlimited, `0` stop.
    pub safe_capacity: Option<f64>,
    /// Free text, shown on status pages.
    pub description: Option<String>,
    /// How the capacity is shared out, and the leases' timing.
    pub algorithm: Algorithm,
    /// `window: calendar`: the capacity is a quota of `capacity × unit`
    /// that renews whole at each UTC boundary of this unit (the capacity's
    /// own, as in `1000/day`). `None`: a steady rate.
    pub calendar: Option<Duration>,
}

/// A template's algorithm and lease parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Algorithm {
    /// How the capacity is shared among clients.
    pub kind: Kind,
    /// How long a granted lease lasts.
    pub lease_length: Duration,
    /// How often a client should refresh its lease.
    pub refresh_interval: Duration,
    /// How long a new master only learns; defaults to the lease length.
    pub learning_mode_duration: Duration,
    /// `NamedParameter`s, in file order.
    pub parameters: Vec<(String, Option<String>)>,
}

impl Algorithm {
    /// The value of the named parameter; `None` if absent or given no value.
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.parameters.iter().find(|(n, _)| n == name).and_then(|(_, v)| v.as_deref())
    }
}

impl ResourcesConfig {
    /// Parses and validates a resources file's text; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, ConfigError> {
        let root = parse(file, text)?;
        let mut ck = Checker::new(file);
        let templates = read_root(&mut ck, &root);
        ck.finish(ResourcesConfig { templates })
    }

    /// The built-in resources of a server started without `--config`.
    pub fn builtin_default() -> Self {
        Self::parse("<built-in default>", DEFAULT_RESOURCES).expect("the built-in default resources are valid")
    }

    /// Reads and parses a resources file from disk.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = super::file::read_config(path, "resources file")?;
        Self::parse(&name, &text)
    }

    /// The template for a resource id: an exact match first, then the first
    /// matching glob in file order.
    pub fn find(&self, resource_id: &str) -> Option<&Arc<Template>> {
        self.templates
            .iter()
            .find(|t| t.identifier_glob == resource_id)
            .or_else(|| self.templates.iter().find(|t| glob_match(&t.identifier_glob, resource_id)))
    }
}

fn read_root(ck: &mut Checker, root: &Node) -> Vec<Arc<Template>> {
    let Some(top) = ck.map(root, "", &["resources"]) else { return Vec::new() };
    let Some(list) =
        ck.required(&top, "resources", Some("list resource templates, ending with an `identifier_glob: \"*\"` entry"))
    else {
        return Vec::new();
    };
    let Some(items) = ck.seq(list, "resources") else { return Vec::new() };
    let mut out = Vec::new();
    let mut globs: Vec<&str> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let path = format!("resources[{i}]");
        if let Some(t) = read_template(ck, item, &path) {
            if globs.contains(&t.identifier_glob.as_str()) {
                ck.error(
                    item.loc,
                    &format!("{path}.identifier_glob"),
                    format!("`{}` is listed twice; the later entry would never match", t.identifier_glob),
                    None,
                );
            }
            out.push(Arc::new(t));
        }
        if let Some(g) = item_glob(item) {
            globs.push(g);
        }
    }
    match globs.iter().position(|g| *g == CATCH_ALL) {
        None => ck.error(
            list.loc,
            "resources",
            "no catch-all entry",
            Some("add `- identifier_glob: \"*\"` as the last entry".into()),
        ),
        Some(pos) if pos + 1 != items.len() => ck.error(
            items[pos].loc,
            &format!("resources[{pos}].identifier_glob"),
            "the catch-all `*` entry must be the last entry",
            Some("entries after it would never match; move it to the end".into()),
        ),
        _ => {}
    }
    out
}

fn item_glob(item: &Node) -> Option<&str> {
    match &item.value {
        super::yaml::Value::Map(entries) => {
            entries.iter().find(|(k, _)| k.as_str() == Some("identifier_glob")).and_then(|(_, v)| v.as_str())
        }
        _ => None,
    }
}

const TEMPLATE_FIELDS: &[&str] =
    &["identifier_glob", "capacity", "safe_capacity", "description", "algorithm", "window"];
const ALGORITHM_FIELDS: &[&str] = &["kind", "lease_length", "refresh_interval", "parameters", "learning_mode_duration"];

fn read_template(ck: &mut Checker, node: &Node, path: &str) -> Option<Template> {
    let m = ck.map(node, path, TEMPLATE_FIELDS)?;
    let glob = ck
        .required(&m, "identifier_glob", Some("a resource id, or a glob such as `api/*`"))
        .and_then(|n| ck.string(n, &m.child("identifier_glob")));
    if let Some(g) = &glob
        && g.is_empty()
    {
        ck.error(m.loc(), &m.child("identifier_glob"), "must not be empty", None);
    }
    let capacity = m.get("capacity").and_then(|n| non_negative(ck, n, &m.child("capacity")));
    let safe_capacity = m.get("safe_capacity").and_then(|n| {
        let v = rate(ck, n, &m.child("safe_capacity"))?;
        if v == -1.0 || (v.is_finite() && v >= 0.0) {
            Some(v)
        } else {
            ck.error(
                n.loc,
                &m.child("safe_capacity"),
                format!("must be -1 (unlimited), 0 (stop) or a positive capacity, not {v}"),
                None,
            );
            None
        }
    });
    if m.get("capacity").is_none() && m.get("safe_capacity").is_none() {
        ck.error(
            m.loc(),
            &m.child("capacity"),
            "missing required field",
            Some("a template needs `capacity` (or at least `safe_capacity`)".into()),
        );
    }
    let description = m.get("description").and_then(|n| ck.string(n, &m.child("description")));
    let algorithm = ck
        .required(
            &m,
            "algorithm",
            Some("e.g. `algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }`"),
        )
        .and_then(|n| read_algorithm(ck, n, &m.child("algorithm")));
    let calendar = match m.get("window") {
        None => Some(None),
        Some(n) => {
            let unit = m
                .get("capacity")
                .and_then(|c| c.as_str())
                .filter(|s| s.contains('/'))
                .and_then(|s| super::routes::parse_capacity(s).ok())
                .map(|c| c.window);
            window(ck, n, &m.child("window"), unit)
        }
    };
    Some(Template {
        identifier_glob: glob?,
        capacity: capacity.unwrap_or(0.0),
        safe_capacity,
        description,
        algorithm: algorithm?,
        calendar: calendar?,
    })
}

/// A `window:` field: `calendar` (the capacity renews whole at each UTC
/// boundary of its unit, `unit`) or `rolling` (a steady rate, the default).
pub(super) fn window(ck: &mut Checker, n: &Node, path: &str, unit: Option<Duration>) -> Option<Option<Duration>> {
    let s = ck.string(n, path)?;
    match (s.as_str(), unit) {
        ("rolling", _) => Some(None),
        ("calendar", Some(unit)) => Some(Some(unit)),
        ("calendar", None) => {
            ck.error(
                n.loc,
                path,
                "a calendar window needs a capacity with a unit",
                Some("e.g. `capacity: 1000/day`: 1000 in each UTC day".into()),
            );
            None
        }
        (other, _) => {
            let hint = super::yaml::closest(other, &["calendar", "rolling"])
                .map_or("calendar or rolling".to_string(), |c| format!("did you mean `{c}`?"));
            ck.error(n.loc, path, format!("unknown window `{other}`"), Some(hint));
            None
        }
    }
}

/// The hint for a capacity that does not parse.
const RATE_HINT: &str = "a number per second (Doorman's unit), or e.g. 50/s, 600/min, 5000/h, 1000/day";

/// A capacity in units per second: a bare number (per second, as Doorman
/// reads it) or a rate with a unit, parsed as a routes file's capacity is.
pub(super) fn rate(ck: &mut Checker, n: &Node, path: &str) -> Option<f64> {
    match &n.value {
        super::yaml::Value::Scalar(s, _) if s.contains('/') => match super::routes::parse_capacity(s) {
            Ok(c) => Some(c.per_second()),
            Err(e) => {
                ck.error(n.loc, path, e, Some(RATE_HINT.into()));
                None
            }
        },
        _ => ck.f64(n, path),
    }
}

fn non_negative(ck: &mut Checker, n: &Node, path: &str) -> Option<f64> {
    let v = rate(ck, n, path)?;
    if v.is_finite() && v >= 0.0 {
        Some(v)
    } else {
        ck.error(n.loc, path, format!("must be a finite number >= 0, not {v}"), None);
        None
    }
}

fn read_algorithm(ck: &mut Checker, node: &Node, path: &str) -> Option<Algorithm> {
    let m = ck.map(node, path, ALGORITHM_FIELDS)?;
    let kind = ck.required(&m, "kind", Some("NO_ALGORITHM, STATIC, PROPORTIONAL_SHARE or FAIR_SHARE")).and_then(|n| {
        let s = ck.string(n, &m.child("kind"))?;
        let names = ["NO_ALGORITHM", "STATIC", "PROPORTIONAL_SHARE", "FAIR_SHARE"];
        let k = Kind::from_name(&s);
        if k.is_none() {
            let hint = super::yaml::closest(&s, &names)
                .map(|c| format!("did you mean `{c}`?"))
                .unwrap_or_else(|| format!("one of {}", names.join(", ")));
            ck.error(n.loc, &m.child("kind"), format!("unknown algorithm `{s}`"), Some(hint));
        }
        k
    });
    let lease = seconds_at_least_one(ck, &m, "lease_length");
    let refresh = seconds_at_least_one(ck, &m, "refresh_interval");
    if let (Some(l), Some(r)) = (lease, refresh)
        && l < r
    {
        let n = m.get("lease_length").expect("present when parsed");
        ck.error(
            n.loc,
            &m.child("lease_length"),
            format!("lease_length ({l}) must be at least refresh_interval ({r})"),
            Some("a client must be able to refresh before its lease expires".into()),
        );
    }
    let learning = match m.get("learning_mode_duration") {
        None => lease,
        Some(n) => ck.i64(n, &m.child("learning_mode_duration")).map(|v| v.max(0)),
    };
    let parameters = m.get("parameters").map(|n| read_parameters(ck, n, &m.child("parameters"))).unwrap_or_default();
    Some(Algorithm {
        kind: kind?,
        lease_length: Duration::from_secs(lease? as u64),
        refresh_interval: Duration::from_secs(refresh? as u64),
        learning_mode_duration: Duration::from_secs(learning? as u64),
        parameters,
    })
}

fn seconds_at_least_one(ck: &mut Checker, m: &MapView<'_>, key: &str) -> Option<i64> {
    let n = ck.required(m, key, Some("whole seconds, at least 1"))?;
    let v = ck.i64(n, &m.child(key))?;
    if v < 1 {
        ck.error(n.loc, &m.child(key), format!("must be at least 1 second, not {v}"), None);
        return None;
    }
    Some(v)
}

fn read_parameters(ck: &mut Checker, node: &Node, path: &str) -> Vec<(String, Option<String>)> {
    let Some(items) = ck.seq(node, path) else { return Vec::new() };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let p = format!("{path}[{i}]");
        let Some(m) = ck.map(item, &p, &["name", "value"]) else { continue };
        let name = ck.required(&m, "name", None).and_then(|n| ck.string(n, &m.child("name")));
        let value = m.get("value").and_then(|n| ck.string(n, &m.child("value")));
        if let (Some("spare"), Some(v)) = (name.as_deref(), value.as_deref())
            && !matches!(v, "share" | "keep")
        {
            let at = m.get("value").map_or(item.loc, |n| n.loc);
            let hint = Some("`share` hands out capacity nobody wants; `keep` grants no more than is wanted".into());
            ck.error(at, &m.child("value"), format!("spare must be `share` or `keep`, not `{v}`"), hint);
        }
        if let Some(name) = name {
            out.push((name, value));
        }
    }
    out
}

/// Glob matching for `identifier_glob`: `*` matches any run of characters,
/// `?` one character, `[abc]`/`[a-z]`/`[!a]` a character class; `\` escapes.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with single-star backtracking: linear for realistic globs.
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() {
            match p[pi] {
                '*' => {
                    star = Some((pi, ti));
                    pi += 1;
                    continue;
                }
                '?' => {
                    pi += 1;
                    ti += 1;
                    continue;
                }
                '[' => {
                    if let Some((matched, next)) = class_match(&p, pi, t[ti])
                        && matched
                    {
                        pi = next;
                        ti += 1;
                        continue;
                    }
                }
                '\\' if pi + 1 < p.len() && p[pi + 1] == t[ti] => {
                    pi += 2;
                    ti += 1;
                    continue;
                }
                c if c == t[ti] => {
                    pi += 1;
                    ti += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, st)) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Matches `c` against the class starting at `p[start] == '['`; returns
/// (matched, index after the class), or None for an unterminated class.
fn class_match(p: &[char], start: usize, c: char) -> Option<(bool, usize)> {
    let mut i = start + 1;
    let negate = matches!(p.get(i), Some('!') | Some('^'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while i < p.len() && (p[i] != ']' || first) {
        first = false;
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            if p[i] <= c && c <= p[i + 2] {
                matched = true;
            }
            i += 3;
        } else {
            if p[i] == c {
                matched = true;
            }
            i += 1;
        }
    }
    (i < p.len()).then_some((matched != negate, i + 1))
}

/// The four Doorman algorithm kinds (numbering matches the wire enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Every client gets what it wants; the capacity is ignored.
    NoAlgorithm,
    /// Every client gets what it wants, up to the capacity each.
    Static,
    /// An equal share per subclient, plus what others leave in proportion to wants.
    ProportionalShare,
    /// Max-min fair shares per subclient.
    FairShare,
}

impl Kind {
    /// The kind's name in a resources file and on the wire (`FAIR_SHARE`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::NoAlgorithm => "NO_ALGORITHM",
            Kind::Static => "STATIC",
            Kind::ProportionalShare => "PROPORTIONAL_SHARE",
            Kind::FairShare => "FAIR_SHARE",
        }
    }

    /// The kind a resources file names; `None` for an unknown name.
    pub fn from_name(s: &str) -> Option<Kind> {
        Some(match s {
            "NO_ALGORITHM" => Kind::NoAlgorithm,
            "STATIC" => Kind::Static,
            "PROPORTIONAL_SHARE" => Kind::ProportionalShare,
            "FAIR_SHARE" => Kind::FairShare,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests;
