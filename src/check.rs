//! `usher check FILE...`: validates routes files, resources files and
//! simulation scenarios, telling them apart by content, and prints every
//! error with its `file:line:column`, what was expected, and a hint.

use std::path::PathBuf;
use std::time::Duration;

use crate::sim::Scenario;
use usher_core::config::ConfigError;
use usher_core::config::resources::{ResourcesConfig, Template};
use usher_core::config::routes::{CostRule, ResourceConfig, ResourceKind, RoutesConfig, SettleFrom};
use usher_core::config::yaml::{Node, Value, parse};
use usher_core::error::RunError;

#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// Routes files (sidecar), resources files (capacity server) or sim scenarios.
    #[arg(value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
    /// Check routes files whose `${VAR}`s are not set here (a ConfigMap's file in CI): they
    /// stay as written, and the unset ones are named.
    #[arg(long)]
    pub allow_unset_env: bool,
}

/// What a file is, judged by its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Routes,
    Resources,
    Scenario,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Routes => "routes file",
            Kind::Resources => "resources file",
            Kind::Scenario => "sim scenario",
        }
    }
}

fn has_key<'a>(root: &'a Node, key: &str) -> Option<&'a Node> {
    match &root.value {
        Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
        _ => None,
    }
}

/// Tells the kind of a parsed file from its top-level keys.
pub fn classify(root: &Node) -> Option<Kind> {
    if has_key(root, "clients_per_leaf").is_some() || has_key(root, "tree").is_some() {
        return Some(Kind::Scenario);
    }
    if let Some(r) = has_key(root, "resources")
        && matches!(r.value, Value::Seq(_))
    {
        return Some(Kind::Resources);
    }
    ["routes", "upstreams", "listen", "doorman", "resources"]
        .iter()
        .any(|k| has_key(root, k).is_some())
        .then_some(Kind::Routes)
}

/// A valid file, parsed.
pub enum Checked {
    /// A routes file, and the `${VAR}`s left unset (`--allow-unset-env`).
    Routes(Box<RoutesConfig>, Vec<String>),
    Resources(ResourcesConfig),
    Scenario,
}

impl Checked {
    pub fn kind(&self) -> Kind {
        match self {
            Checked::Routes(..) => Kind::Routes,
            Checked::Resources(_) => Kind::Resources,
            Checked::Scenario => Kind::Scenario,
        }
    }
}

/// Checks one file: what it holds, or every error found. With
/// `allow_unset_env` a routes file's unset `${VAR}`s stay as written.
pub fn check_file(path: &std::path::Path, allow_unset_env: bool) -> Result<Checked, ConfigError> {
    let name = path.display().to_string();
    let text = usher_core::config::file::read_config(path, "it")?;
    let root = parse(&name, &text)?;
    let kind = classify(&root).ok_or_else(|| {
        let mut e = ConfigError::whole_file(&name, "cannot tell what kind of file this is");
        e.diagnostics[0].hint = Some(
            "a routes file has `routes:`/`upstreams:`; a resources file has a `resources:` list of `identifier_glob` entries; a scenario has `tree:` and `clients_per_leaf:`".into(),
        );
        e
    })?;
    match kind {
        Kind::Routes => {
            RoutesConfig::parse_env(&name, &text, allow_unset_env).map(|(c, unset)| Checked::Routes(Box::new(c), unset))
        }
        Kind::Resources => ResourcesConfig::parse(&name, &text).map(Checked::Resources),
        Kind::Scenario => Scenario::parse(&name, &text).map(|_| Checked::Scenario),
    }
}

/// Runs `usher check`: 0 when every file is valid, 64 otherwise.
pub fn run(args: CheckArgs) -> Result<(), RunError> {
    let mut bad = 0;
    for f in &args.files {
        match check_file(f, args.allow_unset_env) {
            Ok(checked) => {
                println!("{}: ok ({})", f.display(), checked.kind().name());
                for line in summary(&checked) {
                    println!("  {line}");
                }
            }
            Err(e) => {
                bad += 1;
                eprintln!("{e}");
            }
        }
    }
    if bad > 0 {
        return Err(RunError::Usage(format!("{bad} of {} file(s) invalid", args.files.len())));
    }
    Ok(())
}

/// What a valid file resolves to, a line each: every resource as it will be
/// enforced or served.
pub fn summary(checked: &Checked) -> Vec<String> {
    match checked {
        Checked::Routes(cfg, unset) => routes_summary(cfg, unset),
        Checked::Resources(cfg) => {
            let mut out = vec![
                "capacities per second (for a resource the sidecars enforce as a gauge: requests in flight)".into(),
            ];
            out.extend(cfg.templates.iter().map(|t| template_line(t)));
            out
        }
        Checked::Scenario => Vec::new(),
    }
}

fn routes_summary(cfg: &RoutesConfig, unset: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    if !unset.is_empty() {
        out.push(format!("unset environment variables, checked as written: {}", unset.join(", ")));
    }
    out.extend(cfg.warnings.iter().map(|w| format!("warning: {w}")));
    out.push(match &cfg.doorman {
        None => "capacity from: the embedded capacity server (this file's capacities)".to_string(),
        Some(d) => format!(
            "capacity from: the Doorman servers {} as client `{}` (a resource's capacity applies until its first lease)",
            d.servers.join(", "),
            d.client_id
        ),
    });
    for r in cfg.resources.values() {
        out.push(resource_line(r));
    }
    for r in &cfg.routes {
        out.extend(
            r.resources.iter().filter_map(|(res, cost)| Some(cost_line(&r.name, res, *cost, r.cost_rules.get(res)?))),
        );
    }
    out.push(format!("listener limits: {}", cfg.limits));
    for (name, a) in cfg.upstreams.iter().filter_map(|(n, u)| Some((n, u.listen?))) {
        out.push(format!("upstream listener: {a} (every request on it goes to upstream `{name}`)"));
    }
    out
}

/// How a route's resource is charged beyond a fixed cost: read from the
/// request, settled from the answer.
fn cost_line(route: &str, resource: &str, cost: f64, rule: &CostRule) -> String {
    let charged = match (&rule.header, &rule.body) {
        (Some(h), _) => format!("the request's `{h}` header ({} without it)", number(cost)),
        (None, Some(body)) => format!("{body}, or {} when the body cannot be read,", number(cost)),
        (None, None) => number(cost),
    };
    let settled = match &rule.settle {
        None => String::new(),
        Some(SettleFrom::Header(h)) => format!(", settled from the answer's `{h}` header"),
        Some(SettleFrom::Json(p)) => {
            format!(", settled from `{}` in the answer's JSON (or its last event that has it)", p.text)
        }
        Some(SettleFrom::Usage(u)) => format!(", settled from the answer's {u}"),
    };
    format!("route {route}: resource {resource} costs {charged} at admission{settled}")
}

fn resource_line(r: &ResourceConfig) -> String {
    let c = r.capacity;
    let amount = match r.kind {
        ResourceKind::Rate if c.window == Duration::from_secs(1) => format!("{}/s", number(c.per_window)),
        ResourceKind::Rate => {
            format!("{}/{} = {}/s", number(c.per_window), window_name(c.window), number(c.per_second()))
        }
        ResourceKind::Gauge => format!("{} in flight", number(c.per_window)),
    };
    let burst = match r.kind {
        ResourceKind::Rate => format!(", burst {}", number(r.burst)),
        ResourceKind::Gauge => String::new(),
    };
    let kind = match r.kind {
        ResourceKind::Rate => "rate",
        ResourceKind::Gauge => "gauge",
    };
    let mut extras = String::new();
    if r.calendar {
        extras += &format!(", {} per UTC {} (window: calendar)", number(c.per_window), unit_name(c.window));
    }
    if let Some(q) = &r.upstream_quota {
        let headers = match q.ietf {
            true => "RateLimit, RateLimit-Policy".to_string(),
            false => format!("{}, {}, {}", q.limit, q.remaining, q.reset),
        };
        extras += &format!(", follows the upstream's quota headers ({}: {headers})", q.source);
    }
    if r.shadow {
        extras += ", shadow (decides and counts, never refuses)";
    }
    format!(
        "resource {}: {kind} {amount}{burst}, max_wait {}, id `{}`{extras}",
        r.name,
        humantime::format_duration(r.max_wait),
        r.id.text
    )
}

fn template_line(t: &Template) -> String {
    let a = &t.algorithm;
    let safe = match t.safe_capacity {
        None => "dynamic".to_string(),
        Some(-1.0) => "unlimited".to_string(),
        Some(v) => format!("{}/s", number(v)),
    };
    let calendar = t
        .calendar
        .map(|unit| {
            format!(" ({} per UTC {}, window: calendar)", number(t.capacity * unit.as_secs_f64()), unit_name(unit))
        })
        .unwrap_or_default();
    format!(
        "resource `{}`: {}/s{calendar}, {}, lease_length {}s, refresh_interval {}s, safe_capacity {safe}",
        t.identifier_glob,
        number(t.capacity),
        a.kind.name(),
        a.lease_length.as_secs(),
        a.refresh_interval.as_secs(),
    )
}

/// A calendar unit in words.
fn unit_name(w: Duration) -> &'static str {
    match w.as_secs() {
        1 => "second",
        60 => "minute",
        3600 => "hour",
        _ => "day",
    }
}

fn window_name(w: Duration) -> String {
    match w.as_secs() {
        60 => "min".into(),
        3600 => "h".into(),
        86400 => "day".into(),
        _ => humantime::format_duration(w).to_string(),
    }
}

/// A capacity for people: whole numbers as they are, others to three
/// significant digits (5000/h is `1.39`/s, 1/min is `0.0167`/s).
pub fn number(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        return format!("{v}");
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

#[cfg(test)]
mod tests {
    use super::number;

    #[test]
    fn numbers_for_people() {
        assert_eq!(number(5000.0 / 3600.0), "1.39");
        assert_eq!(number(1.0 / 60.0), "0.0167");
        assert_eq!(number(50.0), "50");
        assert_eq!(number(8.333333), "8.33");
        assert_eq!(number(123.456), "123");
        assert_eq!(number(0.5), "0.5");
    }
}
