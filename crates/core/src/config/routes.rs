//! The sidecar's routes file: listeners, upstreams, resources (rate or
//! gauge, with capacities such as `50/s` or `1000/day`) and the routes that
//! map requests to an upstream and to the resources they consume.
//!
//! Parsed once into typed structs through the position-keeping reader in
//! [`super::yaml`], so every error is reported with its `file:line:column`.
//! Defaults are the `DEFAULT_*` constants below, documented in docs/proxy.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::usage::{self, UsageRule};
use super::yaml::{Checker, ConfigError, Loc, MapView, Node, Value, closest, parse};

mod checks;
mod dialect;

pub use dialect::ApiDialect;

/// Proxy listener when neither the file nor `--listen` sets one.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:15001";
/// Admin listener when neither the file nor `--admin-listen` sets one.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:15000";
/// Upstream TCP (and TLS) connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Upstream timeout until response headers arrive.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request may wait for capacity before it is refused.
pub const DEFAULT_MAX_WAIT: Duration = Duration::ZERO;
/// Bound on the number of distinct ids a templated resource tracks.
pub const DEFAULT_MAX_KEYS: usize = 1000;
/// Bound on the number of requests waiting for one resource key.
pub const DEFAULT_MAX_QUEUE: usize = 1024;
/// How long in-flight requests may take to finish after SIGTERM.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(15);

/// A validated routes file.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutesConfig {
    /// The shared proxy listener's address.
    pub listen: SocketAddr,
    /// The admin listener's address.
    pub admin: SocketAddr,
    /// What happens to a request no route matches.
    pub default: DefaultAction,
    /// How long in-flight requests may take to finish after SIGTERM.
    pub drain_timeout: Duration,
    /// Where to lease capacity from; `None` = an embedded capacity server.
    pub doorman: Option<super::doorman::DoormanConfig>,
    /// One JSON line per request is appended here (off when `None`).
    pub access_log: Option<PathBuf>,
    /// The upstreams, by name.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    /// The resources, by name.
    pub resources: BTreeMap<String, ResourceConfig>,
    /// The routes in file order; the first that matches a request wins.
    pub routes: Vec<RouteConfig>,
    /// What the listener accepts from clients (`limits:`).
    pub limits: super::listener::ListenerLimits,
    /// Settings that are valid but ignored, each with its position:
    /// `usher check` prints them, the sidecar logs them at start and reload.
    pub warnings: Vec<super::yaml::Diagnostic>,
}

/// What happens to a request that no route matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultAction {
    /// 403 problem+json.
    Deny,
    /// Forwarded to the origin the request names, with no limits.
    Passthrough,
}

/// One `upstreams:` entry: where requests are forwarded, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamConfig {
    /// The upstream's name in the file.
    pub name: String,
    /// `http://` or `https://` authority, with an optional base path.
    pub url: http::Uri,
    /// TCP plus TLS connect timeout (more than zero).
    pub connect_timeout: Duration,
    /// How long the upstream may take to send response headers (more than zero).
    pub timeout: Duration,
    /// Extra PEM roots, added to the system's.
    pub ca_file: Option<PathBuf>,
    /// Speak HTTP/2 with prior knowledge to an `http://` upstream (h2c, e.g. gRPC).
    pub h2c: bool,
    /// Offer HTTP/2 in ALPN to an `https://` upstream (`http2: false` offers HTTP/1.1 only).
    pub http2: bool,
    /// A listener of the upstream's own: every request on it goes to this upstream.
    pub listen: Option<SocketAddr>,
}

/// What a resource limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceKind {
    /// Requests (or cost units) per unit of time: GCRA.
    Rate,
    /// Requests in flight: a semaphore.
    Gauge,
}

/// A capacity as written: `per_window` units per `window`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Units in each window (finite, at least 0).
    pub per_window: f64,
    /// The window: a second, minute, hour or day.
    pub window: Duration,
}

impl Capacity {
    /// Units per second.
    pub fn per_second(&self) -> f64 {
        self.per_window / self.window.as_secs_f64()
    }
}

/// One `resources:` entry: a budget that routes consume.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceConfig {
    /// The resource's name in the file.
    pub name: String,
    /// Whether it limits a rate or requests in flight.
    pub kind: ResourceKind,
    /// The Doorman resource id, possibly templated.
    pub id: IdTemplate,
    /// The capacity as written; for a gauge, `per_window` requests in flight.
    pub capacity: Capacity,
    /// The longest a request may wait for capacity before it is refused.
    pub max_wait: Duration,
    /// Rate only: units that may pass at once from an idle start.
    pub burst: f64,
    /// The file gives no burst: each key bursts this long of what it is
    /// leased (see [`default_burst_span`]; `burst` is then that of the
    /// file's capacity, for `usher check`). `None`: the file's `burst` is
    /// the fleet's, each key holding its lease's share of it.
    pub burst_span: Option<Duration>,
    /// The most distinct ids a templated resource tracks (at least 1).
    pub max_keys: usize,
    /// The most requests waiting for one key (at least 1).
    pub max_queue: usize,
    /// How each key's lease is asked for and used.
    pub lease: super::doorman::LeaseSettings,
    /// Shadow mode: every decision is made and counted, none enforced.
    pub shadow: bool,
    /// The upstream's own quota headers, which steer the resource's capacity.
    pub upstream_quota: Option<super::quota::UpstreamQuota>,
    /// `window: calendar`: the capacity renews whole at each UTC boundary of
    /// its unit (the capacity's `window`). Honoured by the server that owns
    /// the resource: the embedded one here, a resources file's template in a tree.
    pub calendar: bool,
}

/// One piece of a templated id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text taken as it is.
    Literal(String),
    /// The request's host (`{host}`).
    Host,
    /// The request's method (`{method}`).
    Method,
    /// The Nth (1-based) segment of the path.
    Path(usize),
    /// A request header (lower-case name).
    Header(String),
}

/// A resource id such as `github/{header.x-tenant}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdTemplate {
    /// The template as written.
    pub text: String,
    /// Its pieces, in order.
    pub segments: Vec<Segment>,
}

impl IdTemplate {
    /// Whether the id has no placeholders: every request makes the same id.
    pub fn is_fixed(&self) -> bool {
        self.segments.iter().all(|s| matches!(s, Segment::Literal(_)))
    }

    /// Parses a template; `Err` says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut segments = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                segments.push(Segment::Literal(rest[..open].to_string()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err("unclosed `{`".into());
            };
            let var = &rest[open + 1..open + close];
            segments.push(match var {
                "host" => Segment::Host,
                "method" => Segment::Method,
                v if v.starts_with("path.") => match v["path.".len()..].parse::<usize>() {
                    Ok(n) if n >= 1 => Segment::Path(n),
                    _ => return Err(format!("`{{{v}}}`: path segments are numbered from 1, e.g. {{path.1}}")),
                },
                v if v.starts_with("header.") && v.len() > "header.".len() => {
                    let name = &v["header.".len()..];
                    if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                        return Err(format!("`{name}` is not a valid header name"));
                    }
                    Segment::Header(name.to_ascii_lowercase())
                }
                v => {
                    return Err(format!(
                        "unknown variable `{{{v}}}`; use {{host}}, {{method}}, {{path.N}} or {{header.NAME}}"
                    ));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err("unmatched `}`".into());
        }
        if !rest.is_empty() {
            segments.push(Segment::Literal(rest.to_string()));
        }
        Ok(IdTemplate { text: text.to_string(), segments })
    }

    /// The literal text between placeholders: one piece more than there are
    /// placeholders (a fixed id is one piece), each maybe empty.
    fn pieces(&self) -> Vec<String> {
        let mut pieces = vec![String::new()];
        for s in &self.segments {
            match s {
                Segment::Literal(l) => pieces.last_mut().expect("one piece at least").push_str(l),
                _ => pieces.push(String::new()),
            }
        }
        pieces
    }

    /// Whether `id` is one this template can make. Any placeholder is taken
    /// to make any text, the empty text too (a missing header does).
    pub fn can_make(&self, id: &str) -> bool {
        let pieces = self.pieces();
        let [first, middle @ .., last] = &pieces[..] else {
            return pieces[0] == id;
        };
        let Some(mut rest) = id.strip_prefix(first.as_str()).and_then(|r| r.strip_suffix(last.as_str())) else {
            return false;
        };
        for m in middle {
            match rest.find(m.as_str()) {
                Some(at) => rest = &rest[at + m.len()..],
                None => return false,
            }
        }
        true
    }

    /// Whether this id and `other` could be the same lease id for some
    /// request. Two templates can if, and only if, the literal prefix of one
    /// begins the other's and the literal suffix of one ends the other's
    /// (with any placeholder making any text, the longer prefix, both
    /// templates' middle literals and the longer suffix, in that order, are
    /// made by both).
    pub fn could_meet(&self, other: &IdTemplate) -> bool {
        match (self.is_fixed(), other.is_fixed()) {
            (true, true) => self.text == other.text,
            (true, false) => other.can_make(&self.text),
            (false, true) => self.can_make(&other.text),
            (false, false) => {
                let (a, b) = (self.pieces(), other.pieces());
                let (pa, pb) = (&a[0], &b[0]);
                let (sa, sb) = (&a[a.len() - 1], &b[b.len() - 1]);
                (pa.starts_with(pb.as_str()) || pb.starts_with(pa.as_str()))
                    && (sa.ends_with(sb.as_str()) || sb.ends_with(sa.as_str()))
            }
        }
    }
}

/// One `routes:` entry: which requests it takes, where they go, and what they cost.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteConfig {
    /// The route's name, unique in the file; it labels metrics.
    pub name: String,
    /// Which requests the route takes.
    pub matcher: Match,
    /// `None`: forward to the origin the request names.
    pub upstream: Option<String>,
    /// (resource name, cost), in file order: the cost charged at admission
    /// (with `cost_rules`, the one charged when the request names none).
    pub resources: Vec<(String, f64)>,
    /// Costs read from the request or settled from the response, by resource name.
    pub cost_rules: BTreeMap<String, CostRule>,
    /// How the route backs off when its upstream answers 429 or 503.
    pub pushback: super::doorman::PushbackConfig,
}

/// How a route's cost for one resource is found beyond a fixed number.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CostRule {
    /// `cost: "{header.NAME}"`: the request header (lower-case) holding the
    /// cost; when it is absent or not a number > 0, the route's `cost`
    /// (`default_cost`) is charged. A cost above the resource's burst counts
    /// as the burst.
    pub header: Option<String>,
    /// `cost: "{json.PATH}"` or `cost: { estimate: API }`: the cost read from
    /// the request's JSON body; when it cannot be, the route's `cost` is
    /// charged. A cost above the resource's burst counts as the burst.
    pub body: Option<BodyCost>,
    /// `settle: { .. }`: where the real cost is read from the answer; the
    /// difference from what was charged at admission is charged to the key,
    /// or given back.
    pub settle: Option<SettleFrom>,
}

impl CostRule {
    /// The cost, in this entry's units, of an LLM call of `input_tokens`
    /// prompt tokens and `output_tokens` answer tokens: what an estimate
    /// charges at admission. A token is a unit.
    pub fn units(&self, input_tokens: f64, output_tokens: f64) -> f64 {
        let (i, o) = (input_tokens, output_tokens);
        match &self.settle {
            // The tokens and the price the answer is settled by.
            Some(SettleFrom::Usage(u)) => u.cost(Some(i), Some(o), None).unwrap_or(i + o),
            _ => i + o,
        }
    }

    /// Whether the entry settles from OpenAI's usage (`settle: { usage:
    /// openai }`): a streamed Chat Completions request then asks for it
    /// (`stream_options.include_usage`).
    pub fn wants_openai_usage(&self) -> bool {
        matches!(&self.settle, Some(SettleFrom::Usage(u)) if u.api == LlmApi::OpenAi)
    }
}

/// A cost read from the request's JSON body.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyCost {
    /// `cost: "{json.PATH}"`: a number greater than 0 at PATH.
    Json(JsonPath),
    /// `cost: { estimate: API }`: an LLM call's tokens, estimated from its
    /// prompt and the output limit it sets.
    Estimate(Estimate),
}

/// `the number at `budget.max` in the request's JSON`, or `an estimate of
/// the openai call's tokens (1024 output tokens when it sets no limit)`.
impl std::fmt::Display for BodyCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyCost::Json(p) => write!(f, "the number at `{}` in the request's JSON", p.text),
            BodyCost::Estimate(e) => write!(
                f,
                "an estimate of the {} call's tokens ({} output tokens when it sets no limit)",
                e.api, e.default_output_tokens
            ),
        }
    }
}

/// `cost: { estimate: API, default_output_tokens: N }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Whose request shapes are read.
    pub api: LlmApi,
    /// The output tokens counted for a request that sets no output limit (at least 1).
    pub default_output_tokens: u64,
}

/// The output tokens an estimate counts for a request that sets no output
/// limit: a long answer's, not the model's most.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 1024;

/// An LLM API whose request and answer shapes usher reads.
pub use super::usage::UsageApi as LlmApi;

/// Where a resource's real cost is read from once the upstream has answered.
#[derive(Debug, Clone, PartialEq)]
pub enum SettleFrom {
    /// `response_header: NAME`: a response header (lower-case name).
    Header(String),
    /// `response_json: PATH`: a number in the answer's JSON body, or in the
    /// last of its server-sent events whose data has one there.
    Json(JsonPath),
    /// `usage: PRESET`: the token counts an LLM API reports, in its JSON
    /// body or its stream of events.
    Usage(UsageRule),
}

/// The most steps a `response_json` path may have.
pub const MAX_JSON_PATH_STEPS: usize = 32;

/// A dotted path into a JSON document: `usage.total_tokens`, or
/// `choices.0.usage.total_tokens` (a step of digits also indexes an array).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    /// The path as written, for messages.
    pub text: String,
    /// Object keys (or array indices) from the document's root.
    pub steps: Vec<String>,
}

impl JsonPath {
    /// Parses a dotted path; `Err` says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err("the path is empty".into());
        }
        let steps: Vec<String> = text.split('.').map(str::to_string).collect();
        if steps.iter().any(String::is_empty) {
            return Err(format!("`{text}` has an empty step: steps are separated by one `.`"));
        }
        if steps.len() > MAX_JSON_PATH_STEPS {
            return Err(format!("`{text}` has {} steps, more than {MAX_JSON_PATH_STEPS}", steps.len()));
        }
        Ok(JsonPath { text: text.to_string(), steps })
    }
}

/// A route's `match:`: what a request must have for the route to take it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Match {
    /// Lower-case host without port; `*.example.com` matches subdomains.
    pub host: Option<String>,
    /// The request path must start with this (itself starting with `/`).
    pub path_prefix: Option<String>,
    /// Empty: any method.
    pub methods: Vec<http::Method>,
    /// Header name (lower-case) and required value (`None`: present).
    pub headers: Vec<(http::HeaderName, Option<String>)>,
}

impl RoutesConfig {
    /// Parses and validates a routes file's text; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, ConfigError> {
        Self::parse_env(file, text, false).map(|(cfg, _)| cfg)
    }

    /// Parses as [`Self::parse`] does, except that with `allow_unset_env` an
    /// unset `${VAR}` stays as written; returns the names of those unset.
    pub fn parse_env(file: &str, text: &str, allow_unset_env: bool) -> Result<(Self, Vec<String>), ConfigError> {
        let root = parse(file, text)?;
        let mut ck = Checker::new(file);
        ck.unset_env = allow_unset_env.then(Vec::new);
        let cfg = read_root(&mut ck, &root);
        let unset = ck.unset_env.take().unwrap_or_default();
        let warnings = std::mem::take(&mut ck.warnings);
        let cfg = cfg.map(|c| (RoutesConfig { warnings, ..c }, unset));
        match cfg {
            Some(cfg) => ck.finish(cfg),
            None => {
                if ck.diagnostics.is_empty() {
                    ck.error(root.loc, "", "the routes file is empty", None);
                }
                Err(ck.finish(()).expect_err("diagnostics were reported"))
            }
        }
    }

    /// Reads and parses a routes file from disk.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = super::file::read_config(path, "routes file")?;
        Self::parse(&name, &text)
    }
}

const ROOT_FIELDS: &[&str] = &[
    "listen",
    "admin",
    "default",
    "drain_timeout",
    "access_log",
    "doorman",
    "upstreams",
    "resources",
    "routes",
    "limits",
];
const UPSTREAM_FIELDS: &[&str] = &["url", "connect_timeout", "timeout", "ca_file", "h2c", "http2", "listen"];
const RESOURCE_FIELDS: &[&str] = &[
    "kind",
    "id",
    "capacity",
    "max_wait",
    "burst",
    "max_keys",
    "max_queue",
    "wants",
    "priority",
    "on_expiry",
    "safe_capacity",
    "min_wants",
    "max_wants",
    "headroom",
    "key_idle_timeout",
    "shadow",
    "upstream_quota",
    "window",
];
const ROUTE_FIELDS: &[&str] = &["name", "match", "upstream", "resources", "pushback"];
const MATCH_FIELDS: &[&str] = &["host", "path_prefix", "methods", "headers"];

fn read_root(ck: &mut Checker, root: &Node) -> Option<RoutesConfig> {
    if root.is_null() {
        return None;
    }
    let top = ck.map(root, "", ROOT_FIELDS)?;
    let listen = addr(ck, &top, "listen", DEFAULT_LISTEN);
    let admin = addr(ck, &top, "admin", DEFAULT_ADMIN);
    let default = read_default(ck, &top);
    let drain_timeout =
        top.get("drain_timeout").map_or(Some(DEFAULT_DRAIN_TIMEOUT), |n| ck.duration(n, "drain_timeout"));
    let access_log = top.get("access_log").and_then(|n| ck.string(n, "access_log")).map(PathBuf::from);
    let doorman = match top.get("doorman") {
        None => Some(None),
        Some(n) => super::doorman::read_doorman(ck, n).map(Some),
    };

    let limits = top.get("limits").map_or(Some(Default::default()), |n| super::listener::read_limits(ck, n));

    // Names count as defined even when their entry has errors, so one mistake is reported once.
    let (upstreams, up_names) = read_upstreams(ck, &top, [("listen", listen), ("admin", admin)]);
    let (resources, res_names) = read_resources(ck, &top);
    let routes = read_routes(ck, &top, &up_names, &res_names, &resources);
    checks::listeners_served(ck, &top, &upstreams, &routes);
    if doorman.as_ref().is_some_and(Option::is_some) {
        checks::calendar_with_doorman(ck, &top, &resources);
    }
    Some(RoutesConfig {
        listen: listen?,
        admin: admin?,
        default: default?,
        drain_timeout: drain_timeout?,
        doorman: doorman?,
        access_log,
        upstreams,
        resources,
        routes,
        limits: limits?,
        warnings: Vec::new(),
    })
}

/// Reads `default:`: `deny` when it is absent, or `passthrough`.
fn read_default(ck: &mut Checker, top: &MapView<'_>) -> Option<DefaultAction> {
    match top.get("default") {
        None => Some(DefaultAction::Deny),
        Some(n) => match ck.string(n, "default").as_deref() {
            Some("deny") => Some(DefaultAction::Deny),
            Some("passthrough") => Some(DefaultAction::Passthrough),
            Some(other) => {
                ck.error(n.loc, "default", format!("unknown action `{other}`"), Some("deny or passthrough".into()));
                None
            }
            None => None,
        },
    }
}

/// Reads `upstreams:`, then refuses an upstream `listen` that one of
/// `listeners` (the top-level ones) or an earlier upstream has. Returns the
/// valid upstreams and every name given.
fn read_upstreams(
    ck: &mut Checker,
    top: &MapView<'_>,
    listeners: [(&str, Option<SocketAddr>); 2],
) -> (BTreeMap<String, UpstreamConfig>, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut upstreams = BTreeMap::new();
    if let Some(n) = top.get("upstreams")
        && let Some(m) = ck.map(n, "upstreams", &[])
    {
        for (k, v) in m.entries() {
            let Some(name) = k.as_str() else { continue };
            names.push(name.to_string());
            if let Some(u) = read_upstream(ck, name, v, &m.child(name)) {
                upstreams.insert(name.to_string(), u);
            }
        }
        check_listeners(ck, &m, &upstreams, listeners);
    }
    (upstreams, names)
}

/// Reads `resources:`, refusing ids that could meet. Returns the valid
/// resources and every name given.
fn read_resources(ck: &mut Checker, top: &MapView<'_>) -> (BTreeMap<String, ResourceConfig>, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut resources = BTreeMap::new();
    if let Some(n) = top.get("resources")
        && let Some(m) = ck.map(n, "resources", &[])
    {
        // A lease id is one resource's: two limiters on one id would each
        // enforce the whole lease (and the server grants one), so no two
        // resources may have ids that could make the same lease id.
        let mut ids: Vec<(String, IdTemplate)> = Vec::new();
        for (k, v) in m.entries() {
            let Some(name) = k.as_str() else { continue };
            names.push(name.to_string());
            if let Some(r) = read_resource(ck, name, v, &m.child(name)) {
                check_id_meets(ck, &ids, &r.id, (k, v), &m.child(name));
                ids.push((name.to_string(), r.id.clone()));
                resources.insert(name.to_string(), r);
            }
        }
    }
    (resources, names)
}

/// Refuses `id`, of the resource `entry` (its key and value) at `path`, if
/// it could make the same lease id as one of `earlier`'s (resource name, id).
fn check_id_meets(
    ck: &mut Checker,
    earlier: &[(String, IdTemplate)],
    id: &IdTemplate,
    entry: (&Node, &Node),
    path: &str,
) {
    // The latest resource it meets, as the one named.
    let Some((other, that_id)) = earlier.iter().rev().find(|(_, t)| t.could_meet(id)) else { return };
    let (k, v) = entry;
    let at = field_loc(v, "id");
    let (this, that) = (&id.text, &that_id.text);
    let message = match (id.is_fixed(), that_id.is_fixed()) {
        (true, true) => format!("id `{this}` is already resource `{other}`'s"),
        (true, false) => format!("id `{this}` is one resource `{other}`'s id `{that}` could make"),
        (false, true) => format!("id `{this}` could make resource `{other}`'s id `{that}`"),
        (false, false) => {
            format!("id `{this}` could make the same lease id as resource `{other}`'s id `{that}`")
        }
    };
    let hint = if id.is_fixed() && that_id.is_fixed() {
        "each resource leases its own id; routes can share one resource"
    } else {
        "each resource leases its own ids: give the two literal prefixes neither of which begins \
         the other (e.g. `a/{header.x}` and `b/{header.x}`), or let the routes share one resource"
    };
    ck.error(at.unwrap_or(k.loc), &format!("{path}.id"), message, Some(hint.into()));
}

/// Where field `key` of a mapping is, if `node` is a mapping that has it.
fn field_loc(node: &Node, key: &str) -> Option<Loc> {
    match &node.value {
        Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, n)| n.loc),
        _ => None,
    }
}

/// Reads `routes:`, refusing a route name used twice.
fn read_routes(
    ck: &mut Checker,
    top: &MapView<'_>,
    up_names: &[String],
    res_names: &[String],
    resources: &BTreeMap<String, ResourceConfig>,
) -> Vec<RouteConfig> {
    let mut routes = Vec::new();
    if let Some(n) = top.get("routes")
        && let Some(items) = ck.seq(n, "routes")
    {
        let up_names: Vec<&str> = up_names.iter().map(String::as_str).collect();
        let res_names: Vec<&str> = res_names.iter().map(String::as_str).collect();
        let mut seen: Vec<String> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("routes[{i}]");
            if let Some(r) = read_route(ck, item, &path, &up_names, &res_names, resources) {
                if seen.contains(&r.name) {
                    ck.error(
                        item.loc,
                        &format!("{path}.name"),
                        format!("route name `{}` is used twice", r.name),
                        Some("route names label metrics; make them unique".into()),
                    );
                }
                seen.push(r.name.clone());
                routes.push(r);
            }
        }
    }
    routes
}

/// Refuses an upstream `listen` that another listener of the file already
/// has: the top-level `listen` or `admin`, or an earlier upstream's. Port 0
/// (any free port) clashes with nothing; an unspecified IP (0.0.0.0, ::)
/// clashes with every IP of its family on the same port.
fn check_listeners(
    ck: &mut Checker,
    ups: &MapView<'_>,
    upstreams: &BTreeMap<String, UpstreamConfig>,
    top: [(&str, Option<SocketAddr>); 2],
) {
    let mut taken: Vec<(String, SocketAddr)> =
        top.iter().filter_map(|(key, a)| a.map(|a| (format!("`{key}`"), a))).collect();
    // In file order, so the later of two clashing upstreams is the one named.
    for (k, v) in ups.entries() {
        let Some(name) = k.as_str() else { continue };
        let Some(a) = upstreams.get(name).and_then(|u| u.listen) else { continue };
        if let Some((owner, _)) = taken.iter().find(|(_, t)| clash(*t, a)) {
            let at = field_loc(v, "listen");
            let path = format!("{}.listen", ups.child(name));
            ck.error(
                at.unwrap_or(k.loc),
                &path,
                format!("`{a}` is already the address of {owner}"),
                Some("each listener needs an address of its own".into()),
            );
        }
        taken.push((format!("upstream `{name}`"), a));
    }
}

/// Whether two listeners could not both bind.
fn clash(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && a.is_ipv4() == b.is_ipv4()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn addr(ck: &mut Checker, m: &MapView<'_>, key: &str, default: &str) -> Option<SocketAddr> {
    let Some(n) = m.get(key) else {
        return Some(default.parse().expect("default address parses"));
    };
    let s = ck.string(n, &m.child(key))?;
    match s.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            ck.error(n.loc, &m.child(key), format!("`{s}` is not an IP:port address"), Some(format!("e.g. {default}")));
            None
        }
    }
}

fn read_upstream(ck: &mut Checker, name: &str, node: &Node, path: &str) -> Option<UpstreamConfig> {
    let m = ck.map(node, path, UPSTREAM_FIELDS)?;
    let url = ck.required(&m, "url", Some("e.g. https://api.github.com")).and_then(|n| {
        let s = ck.string(n, &m.child("url"))?;
        match s.parse::<http::Uri>() {
            Ok(u)
                if matches!(u.scheme_str(), Some("http" | "https"))
                    && u.authority().is_some()
                    && u.query().is_none() =>
            {
                Some(u)
            }
            _ => {
                ck.error(
                    n.loc,
                    &m.child("url"),
                    format!("`{s}` is not an http:// or https:// URL"),
                    Some("write scheme://host[:port][/base-path], without a query".into()),
                );
                None
            }
        }
    });
    let connect_timeout = positive_duration(ck, &m, "connect_timeout", DEFAULT_CONNECT_TIMEOUT);
    let timeout = positive_duration(ck, &m, "timeout", DEFAULT_TIMEOUT);
    let ca_file = m.get("ca_file").and_then(|n| {
        let s = ck.string(n, &m.child("ca_file"))?;
        let p = PathBuf::from(&s);
        if !p.is_file() {
            ck.error(
                n.loc,
                &m.child("ca_file"),
                format!("`{s}` is not a readable file"),
                Some("a PEM file of CA certificates".into()),
            );
        }
        Some(p)
    });
    let h2c = m.get("h2c").map_or(Some(false), |n| ck.bool(n, &m.child("h2c")));
    if let (Some(u), Some(true)) = (&url, h2c)
        && u.scheme_str() == Some("https")
    {
        ck.error(
            m.loc(),
            &m.child("h2c"),
            "h2c applies to http:// upstreams only",
            Some("https upstreams negotiate HTTP/2 with ALPN".into()),
        );
    }
    let http2 = m.get("http2").map_or(Some(true), |n| ck.bool(n, &m.child("http2")));
    let listen = match m.get("listen") {
        None => Some(None),
        Some(_) => addr(ck, &m, "listen", "127.0.0.1:15002").map(Some),
    };
    if let (Some(true), Some(false)) = (h2c, http2) {
        ck.error(
            m.loc(),
            &m.child("http2"),
            "`http2: false` contradicts `h2c: true`",
            Some("h2c speaks only HTTP/2; drop one of the two".into()),
        );
    }
    Some(UpstreamConfig {
        name: name.to_string(),
        url: url?,
        connect_timeout: connect_timeout?,
        timeout: timeout?,
        ca_file,
        h2c: h2c?,
        http2: http2?,
        listen: listen?,
    })
}

fn positive_duration(ck: &mut Checker, m: &MapView<'_>, key: &str, default: Duration) -> Option<Duration> {
    let Some(n) = m.get(key) else { return Some(default) };
    let d = ck.duration(n, &m.child(key))?;
    if d.is_zero() {
        ck.error(n.loc, &m.child(key), "must be longer than zero", None);
        return None;
    }
    Some(d)
}

/// Parses `50`, `50/s`, `3000/min`, `20000/h` or `1000/day`.
pub fn parse_capacity(s: &str) -> Result<Capacity, String> {
    let (num, unit) = s.split_once('/').map_or((s, "s"), |(n, u)| (n.trim(), u.trim()));
    let window = match unit {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        "d" | "day" => Duration::from_secs(86400),
        other => return Err(format!("unknown unit `/{other}`; use /s, /min, /h or /day")),
    };
    let per_window: f64 = num.trim().parse().map_err(|_| format!("`{num}` is not a number"))?;
    if !per_window.is_finite() || per_window < 0.0 {
        return Err(format!("must be a finite number >= 0, not {per_window}"));
    }
    Ok(Capacity { per_window, window })
}

fn read_resource(ck: &mut Checker, name: &str, node: &Node, path: &str) -> Option<ResourceConfig> {
    let m = ck.map(node, path, RESOURCE_FIELDS)?;
    let kind = read_kind(ck, &m);
    let id = read_id(ck, &m, name);
    let capacity = read_capacity(ck, &m, kind);
    let max_wait = m.get("max_wait").map_or(Some(DEFAULT_MAX_WAIT), |n| ck.duration(n, &m.child("max_wait")));
    let burst = read_burst(ck, &m, kind, capacity);
    let burst_span = capacity.filter(|_| m.get("burst").is_none()).map(|c| default_burst_span(c.window));
    let max_keys = count(ck, &m, "max_keys", DEFAULT_MAX_KEYS);
    let max_queue = count(ck, &m, "max_queue", DEFAULT_MAX_QUEUE);
    let lease = super::doorman::read_lease_settings(ck, &m);
    let shadow = m.get("shadow").map_or(Some(false), |n| ck.bool(n, &m.child("shadow")));
    let upstream_quota = match m.get("upstream_quota") {
        None => Some(None),
        Some(n) => super::quota::read(ck, n, &m.child("upstream_quota")).map(Some),
    };
    let calendar = read_calendar(ck, &m, kind, capacity);
    Some(ResourceConfig {
        name: name.to_string(),
        kind: kind?,
        id: id?,
        capacity: capacity?,
        max_wait: max_wait?,
        burst: burst?,
        burst_span,
        max_keys: max_keys?,
        max_queue: max_queue?,
        lease: lease?,
        shadow: shadow?,
        upstream_quota: upstream_quota?,
        calendar: calendar?,
    })
}

/// Reads a resource's `kind:`, `rate` or `gauge`.
fn read_kind(ck: &mut Checker, m: &MapView<'_>) -> Option<ResourceKind> {
    let n = ck.required(m, "kind", Some("rate or gauge"))?;
    let s = ck.string(n, &m.child("kind"))?;
    match s.as_str() {
        "rate" => Some(ResourceKind::Rate),
        "gauge" => Some(ResourceKind::Gauge),
        other => {
            let hint = closest(other, &["rate", "gauge"])
                .map_or("rate or gauge".to_string(), |c| format!("did you mean `{c}`?"));
            ck.error(n.loc, &m.child("kind"), format!("unknown kind `{other}`"), Some(hint));
            None
        }
    }
}

/// Reads a resource's `id:`, a template of at most [`super::MAX_ID_BYTES`]
/// literal bytes; the resource's name when it is absent.
fn read_id(ck: &mut Checker, m: &MapView<'_>, name: &str) -> Option<IdTemplate> {
    let Some(n) = m.get("id") else {
        return Some(IdTemplate { text: name.to_string(), segments: vec![Segment::Literal(name.to_string())] });
    };
    let s = ck.string(n, &m.child("id"))?;
    match IdTemplate::parse(&s) {
        Ok(t) if t.text.is_empty() => {
            ck.error(n.loc, &m.child("id"), "must not be empty", None);
            None
        }
        Ok(t) if literal_bytes(&t) > crate::config::MAX_ID_BYTES => {
            let max = crate::config::MAX_ID_BYTES;
            let what = if t.is_fixed() { "" } else { " without its placeholders" };
            let msg = format!("is {} bytes long{what}; capacity servers accept at most {max}", literal_bytes(&t));
            ck.error(n.loc, &m.child("id"), msg, None);
            None
        }
        Ok(t) => Some(t),
        Err(e) => {
            ck.error(n.loc, &m.child("id"), e, None);
            None
        }
    }
}

/// Reads a resource's `capacity:`; a gauge's is a number, without a unit.
fn read_capacity(ck: &mut Checker, m: &MapView<'_>, kind: Option<ResourceKind>) -> Option<Capacity> {
    let n = ck.required(m, "capacity", Some("e.g. 50, 50/s, 3000/min, 20000/h or 1000/day"))?;
    let text = match &n.value {
        Value::Scalar(s, _) => s.clone(),
        _ => {
            ck.error(n.loc, &m.child("capacity"), "expected a capacity such as 50/s", None);
            return None;
        }
    };
    match parse_capacity(&text) {
        Ok(c) => {
            if kind == Some(ResourceKind::Gauge) && text.contains('/') {
                ck.error(
                    n.loc,
                    &m.child("capacity"),
                    "a gauge's capacity is a number of requests in flight, not a rate",
                    Some(format!("write `{}`", c.per_window)),
                );
                return None;
            }
            Some(c)
        }
        Err(e) => {
            ck.error(n.loc, &m.child("capacity"), e, Some("e.g. 50, 50/s, 3000/min, 20000/h or 1000/day".into()));
            None
        }
    }
}

/// Reads a rate resource's `burst:`, at least 1; [`default_burst`] when it is absent.
fn read_burst(
    ck: &mut Checker,
    m: &MapView<'_>,
    kind: Option<ResourceKind>,
    capacity: Option<Capacity>,
) -> Option<f64> {
    let Some(n) = m.get("burst") else { return Some(default_burst(capacity)) };
    let b = ck.f64(n, &m.child("burst"));
    if kind == Some(ResourceKind::Gauge) {
        ck.error(n.loc, &m.child("burst"), "burst applies to rate resources only", None);
    }
    match b {
        Some(b) if b.is_finite() && b >= 1.0 => Some(b),
        Some(b) => {
            ck.error(n.loc, &m.child("burst"), format!("must be at least 1, not {b}"), None);
            None
        }
        None => None,
    }
}

/// Reads a rate resource's `window:`: whether its capacity renews whole at
/// each UTC boundary of the unit written with it.
fn read_calendar(
    ck: &mut Checker,
    m: &MapView<'_>,
    kind: Option<ResourceKind>,
    capacity: Option<Capacity>,
) -> Option<bool> {
    match m.get("window") {
        None => Some(false),
        Some(n) if kind == Some(ResourceKind::Gauge) => {
            ck.error(n.loc, &m.child("window"), "a window applies to rate resources only", None);
            None
        }
        Some(n) => {
            let written = m.get("capacity").and_then(|c| c.as_str()).is_some_and(|s| s.contains('/'));
            let unit = capacity.filter(|_| written).map(|c| c.window);
            super::resources::window(ck, n, &m.child("window"), unit).map(|c| c.is_some())
        }
    }
}

/// A rate resource's burst when the file gives none: this long of its
/// capacity, for the whole fleet, at least one request (each key bursts
/// this long of its lease, its share of the capacity the servers share):
/// - per second (`50` or `50/s`): a second, so that a few requests in a
///   row within the rate are never refused;
/// - per minute (`6000/min`): the minute, as an API whose limit is written
///   per minute lets it be spent at once (and as governor's
///   `Quota::per_minute` bursts): calls that come a few at a time, a few
///   times a minute, are not held back below the quota;
/// - per hour: a minute;
/// - per day: the whole day, since it may be spent at any time of the day.
pub fn default_burst_span(window: Duration) -> Duration {
    let minute = Duration::from_secs(60);
    match window {
        w if w >= Duration::from_secs(86400) => w,
        w if w > minute => minute,
        w => w.max(Duration::from_secs(1)),
    }
}

/// A rate resource's burst when the file gives none (see [`default_burst_span`]).
pub fn default_burst(capacity: Option<Capacity>) -> f64 {
    match capacity {
        Some(c) => (c.per_second() * default_burst_span(c.window).as_secs_f64()).max(1.0),
        None => 1.0,
    }
}

fn count(ck: &mut Checker, m: &MapView<'_>, key: &str, default: usize) -> Option<usize> {
    let Some(n) = m.get(key) else { return Some(default) };
    let v = ck.i64(n, &m.child(key))?;
    if v < 1 {
        ck.error(n.loc, &m.child(key), format!("must be at least 1, not {v}"), None);
        return None;
    }
    Some(v as usize)
}

fn read_route(
    ck: &mut Checker,
    node: &Node,
    path: &str,
    upstreams: &[&str],
    resource_names: &[&str],
    resources: &BTreeMap<String, ResourceConfig>,
) -> Option<RouteConfig> {
    let m = ck.map(node, path, ROUTE_FIELDS)?;
    let name =
        ck.required(&m, "name", Some("a short name; it labels metrics")).and_then(|n| ck.string(n, &m.child("name")));
    let matcher = match m.get("match") {
        None => Some(Match::default()),
        Some(n) => read_match(ck, n, &m.child("match")),
    };
    let upstream = read_upstream_name(ck, &m, upstreams);
    let (list, rules) = read_route_resources(ck, &m, resource_names, resources);
    let pushback = match m.get("pushback") {
        None => Some(super::doorman::PushbackConfig::default()),
        Some(n) => super::doorman::read_pushback(ck, n, &m.child("pushback")),
    };
    Some(RouteConfig {
        name: name?,
        matcher: matcher?,
        upstream,
        resources: list,
        cost_rules: rules,
        pushback: pushback?,
    })
}

/// Reads a route's `upstream:`; an unknown name is reported, and kept.
fn read_upstream_name(ck: &mut Checker, m: &MapView<'_>, upstreams: &[&str]) -> Option<String> {
    let n = m.get("upstream")?;
    let s = ck.string(n, &m.child("upstream"))?;
    if !upstreams.contains(&s.as_str()) {
        let hint = closest(&s, upstreams).map_or_else(
            || {
                if upstreams.is_empty() {
                    "define it under `upstreams:`".to_string()
                } else {
                    format!("known upstreams: {}", upstreams.join(", "))
                }
            },
            |c| format!("did you mean `{c}`?"),
        );
        ck.error(n.loc, &m.child("upstream"), format!("unknown upstream `{s}`"), Some(hint));
    }
    Some(s)
}

/// Reads a route's `resources:`: each entry a resource's name (cost 1) or a
/// mapping with its cost. Returns (resource, cost) in file order, and the
/// cost rules of the resources kept.
fn read_route_resources(
    ck: &mut Checker,
    m: &MapView<'_>,
    resource_names: &[&str],
    resources: &BTreeMap<String, ResourceConfig>,
) -> (Vec<(String, f64)>, BTreeMap<String, CostRule>) {
    let mut list = Vec::new();
    let mut rules = BTreeMap::new();
    if let Some(n) = m.get("resources")
        && let Some(items) = ck.seq(n, &m.child("resources"))
    {
        for (i, item) in items.iter().enumerate() {
            let p = format!("{}[{i}]", m.child("resources"));
            let entry = match &item.value {
                Value::Scalar(..) => ck.string(item, &p).map(|s| (s, 1.0, item, false)),
                _ => read_cost_entry(ck, item, &p, &mut rules),
            };
            let Some((res, mut cost, at, worked_out)) = entry else { continue };
            if !check_listed(ck, at, &p, &res, resource_names, &list) {
                continue;
            }
            if let Some(rc) = resources.get(&res) {
                if worked_out {
                    cost = cost.min(rc.burst);
                }
                if rc.kind == ResourceKind::Gauge && rules.get(&res).is_some_and(|r| r.body.is_some()) {
                    let why =
                        format!("`{res}` is a gauge: a cost read from the request's body applies to rate resources");
                    ck.error(at.loc, &p, why, None);
                    continue;
                }
            }
            if check_cost(ck, at, &p, &res, cost, resources) {
                list.push((res, cost));
            }
        }
    }
    rules.retain(|name, _| list.iter().any(|(r, _)| r == name));
    (list, rules)
}

/// Reads a mapping in a route's `resources:` (`resource`, `cost`,
/// `default_cost`, `default_output_tokens`, `settle`), adding its cost rule,
/// if any, to `rules`. Returns the resource's name, the cost, the node that
/// names it, and whether the cost was worked out rather than written (an
/// estimate's fallback, which counts as the burst at most).
fn read_cost_entry<'a>(
    ck: &mut Checker,
    item: &'a Node,
    path: &str,
    rules: &mut BTreeMap<String, CostRule>,
) -> Option<(String, f64, &'a Node, bool)> {
    let rm = ck.map(item, path, &["resource", "cost", "default_cost", "default_output_tokens", "settle"])?;
    let r = ck.required(&rm, "resource", None).and_then(|n| ck.string(n, &rm.child("resource")).map(|s| (s, n)));
    let mut rule = CostRule::default();
    if let Some(n) = rm.get("settle") {
        rule.settle = settle_from(ck, n, &rm.child("settle"));
    }
    let cost = read_cost(ck, &rm, &mut rule);
    if rule != CostRule::default()
        && let Some((name, _)) = &r
    {
        rules.insert(name.clone(), rule);
    }
    match (r, cost) {
        (Some((s, n)), Some((c, worked_out))) => Some((s, c, n, worked_out)),
        _ => None,
    }
}

/// Reads an entry's `cost:`: a number > 0 (1 when absent);
/// `"{header.NAME}"` or `"{json.PATH}"`, which set `rule` and return
/// `default_cost` (1 when absent) for a request that names none; or
/// `{ estimate: API }`, whose fallback is `default_cost`, else the estimate
/// of a request with no prompt and no output limit (worked out: true).
fn read_cost(ck: &mut Checker, rm: &MapView<'_>, rule: &mut CostRule) -> Option<(f64, bool)> {
    if let Some(n) = rm.get("default_output_tokens")
        && !rm.get("cost").is_some_and(|c| matches!(c.value, Value::Map(_)))
    {
        let hint = "e.g. cost: { estimate: openai, default_output_tokens: 1000 }";
        let field = rm.child("default_output_tokens");
        ck.error(n.loc, &field, "default_output_tokens applies to an estimated cost", Some(hint.into()));
    }
    match rm.get("cost") {
        Some(n) if matches!(n.value, Value::Map(_)) => {
            let estimate = read_estimate(ck, n, rm);
            let default = positive(ck, rm, "default_cost");
            let estimate = estimate?;
            rule.body = Some(BodyCost::Estimate(estimate));
            match default? {
                Some(c) => Some((c, false)),
                None => Some((rule.units(0.0, estimate.default_output_tokens as f64), true)),
            }
        }
        Some(n) if matches!(&n.value, Value::Scalar(t, _) if t.trim_start().starts_with('{')) => {
            let text = n.as_str().unwrap_or_default().trim();
            match request_cost(text) {
                Ok(from) => {
                    match from {
                        Ok(header) => rule.header = Some(header),
                        Err(path) => rule.body = Some(BodyCost::Json(path)),
                    }
                    positive(ck, rm, "default_cost").map(|c| (c.unwrap_or(1.0), false))
                }
                Err(why) => {
                    ck.error(n.loc, &rm.child("cost"), why, Some(COST_FORMS.into()));
                    None
                }
            }
        }
        _ => {
            if let Some(n) = rm.get("default_cost") {
                ck.error(
                    n.loc,
                    &rm.child("default_cost"),
                    "default_cost applies to a cost read from the request",
                    Some(
                        "write cost: \"{header.NAME}\", \"{json.PATH}\" or { estimate: openai }, or drop default_cost"
                            .into(),
                    ),
                );
            }
            positive(ck, rm, "cost").map(|c| (c.unwrap_or(1.0), false))
        }
    }
}

/// The forms a `cost:` takes, for hints.
const COST_FORMS: &str =
    "e.g. cost: 150, cost: \"{header.x-max-tokens}\", cost: \"{json.max_tokens}\" or cost: { estimate: openai }";

/// A cost read from the request, as written (`{header.NAME}` or
/// `{json.PATH}`): the header's lower-case name, or the JSON path; `Err`
/// says what is wrong.
fn request_cost(text: &str) -> Result<Result<String, JsonPath>, String> {
    if let Some(path) = text.strip_prefix("{json.").and_then(|t| t.strip_suffix('}')) {
        return JsonPath::parse(path).map(Err).map_err(|why| format!("`{text}`: {why}"));
    }
    match IdTemplate::parse(text) {
        Ok(t) => match &t.segments[..] {
            [Segment::Header(h)] => Ok(Ok(h.clone())),
            _ => Err("expected a number, \"{header.NAME}\", \"{json.PATH}\" or { estimate: API }".into()),
        },
        Err(why) => Err(why),
    }
}

/// Reads `cost: { estimate: API, default_output_tokens: N }`;
/// `default_output_tokens` may also be written beside `cost`, in `entry`.
fn read_estimate(ck: &mut Checker, node: &Node, entry: &MapView<'_>) -> Option<Estimate> {
    let path = entry.child("cost");
    let m = ck.map(node, &path, &["estimate", "default_output_tokens"])?;
    let hint = "openai (Chat Completions, Responses) or anthropic (Messages)";
    // A misspelt key was reported as unknown: it is not also missing.
    let misspelt = m.entries().any(|(k, _)| !matches!(k.as_str(), Some("estimate" | "default_output_tokens")));
    let api = match m.get("estimate") {
        None if misspelt => None,
        None => ck.required(&m, "estimate", Some(hint)).and(None),
        Some(n) => ck.string(n, &m.child("estimate")).and_then(|name| {
            let api = llm_api(&name);
            if api.is_none() {
                ck.error(n.loc, &m.child("estimate"), format!("unknown API `{name}`"), Some(hint.into()));
            }
            api
        }),
    };
    let output = match (m.get("default_output_tokens"), entry.get("default_output_tokens")) {
        (Some(_), Some(n)) => {
            let why = "default_output_tokens is given twice: in cost and beside it";
            ck.error(n.loc, &entry.child("default_output_tokens"), why, None);
            None
        }
        (Some(n), None) => tokens(ck, n, &m.child("default_output_tokens")),
        (None, Some(n)) => tokens(ck, n, &entry.child("default_output_tokens")),
        (None, None) => Some(DEFAULT_OUTPUT_TOKENS),
    };
    Some(Estimate { api: api?, default_output_tokens: output? })
}

/// An API's name in the routes file.
fn llm_api(name: &str) -> Option<LlmApi> {
    [LlmApi::OpenAi, LlmApi::Anthropic].into_iter().find(|a| a.to_string() == name)
}

/// A count of tokens, at least 1.
fn tokens(ck: &mut Checker, n: &Node, path: &str) -> Option<u64> {
    let v = ck.i64(n, path)?;
    match u64::try_from(v) {
        Ok(t) if t >= 1 => Some(t),
        _ => {
            ck.error(n.loc, path, format!("must be at least 1, not {v}"), None);
            None
        }
    }
}

/// An optional number greater than 0: `Some(None)` when `key` is absent,
/// `None` once a bad value is reported.
fn positive(ck: &mut Checker, m: &MapView<'_>, key: &str) -> Option<Option<f64>> {
    match m.get(key) {
        None => Some(None),
        Some(n) => match ck.f64(n, &m.child(key)) {
            Some(c) if c.is_finite() && c > 0.0 => Some(Some(c)),
            Some(c) => {
                ck.error(n.loc, &m.child(key), format!("must be greater than 0, not {c}"), None);
                None
            }
            None => None,
        },
    }
}

/// Whether a route may list resource `res`: it is defined, and not in
/// `list` already. Reports why not at `at`.
fn check_listed(
    ck: &mut Checker,
    at: &Node,
    path: &str,
    res: &str,
    resource_names: &[&str],
    list: &[(String, f64)],
) -> bool {
    if !resource_names.contains(&res) {
        let hint = closest(res, resource_names)
            .map_or_else(|| "define it under `resources:`".to_string(), |c| format!("did you mean `{c}`?"));
        ck.error(at.loc, path, format!("unknown resource `{res}`"), Some(hint));
        return false;
    }
    if list.iter().any(|(r, _)| *r == res) {
        ck.error(at.loc, path, format!("resource `{res}` is listed twice"), Some("raise its cost instead".into()));
        return false;
    }
    true
}

/// Whether resource `res` could ever pass a request of `cost`: within a
/// rate's burst, or a whole number within a gauge's capacity. Reports why
/// not at `at`.
fn check_cost(
    ck: &mut Checker,
    at: &Node,
    path: &str,
    res: &str,
    cost: f64,
    resources: &BTreeMap<String, ResourceConfig>,
) -> bool {
    let Some(rc) = resources.get(res) else { return true };
    // (A default burst follows the lease: with capacity servers the file's
    // capacity is only a first guess, and its span of it says nothing.)
    if rc.kind == ResourceKind::Rate && rc.burst_span.is_none() && cost > rc.burst {
        ck.error(
            at.loc,
            path,
            format!(
                "cost {cost} is larger than resource `{res}`'s burst of {} (the most that may pass at once)",
                rc.burst
            ),
            Some(format!("raise `{res}`'s burst to at least {cost}, or lower the cost")),
        );
        return false;
    }
    if rc.kind == ResourceKind::Gauge && cost > rc.capacity.per_window {
        ck.error(
            at.loc,
            path,
            format!("cost {cost} is more than gauge `{res}`'s capacity of {} in flight", rc.capacity.per_window),
            Some("no request could ever pass: raise the capacity or lower the cost".into()),
        );
        return false;
    }
    if rc.kind == ResourceKind::Gauge && cost.fract() != 0.0 {
        ck.error(at.loc, path, format!("a gauge's cost is a whole number of requests in flight, not {cost}"), None);
        return false;
    }
    true
}

/// The keys of a `settle:` mapping that say where the cost is read from.
const SETTLE_SOURCES: [&str; 3] = ["response_header", "response_json", "usage"];

/// Reads a resource's `settle:` mapping: one of `response_header: NAME`,
/// `response_json: PATH` or `usage: PRESET` (with its `tokens` and `price`).
fn settle_from(ck: &mut Checker, node: &Node, path: &str) -> Option<SettleFrom> {
    let m = ck.map(node, path, &[&SETTLE_SOURCES[..], &["tokens", "price"]].concat())?;
    // Looked up with nulls kept: `response_json:` with no value is a missing path, not a missing field.
    let given = |key: &str| m.entries().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v);
    let sources: Vec<(&str, &Node)> = SETTLE_SOURCES.iter().filter_map(|k| Some((*k, given(k)?))).collect();
    let extras: Vec<(&str, &Node)> = ["tokens", "price"].iter().filter_map(|k| Some((*k, given(k)?))).collect();
    match sources[..] {
        [_, (key, second), ..] => {
            ck.error(
                second.loc,
                &m.child(key),
                "give one of response_header, response_json or usage",
                Some("a cost is settled from one place".into()),
            );
            None
        }
        // Keys that are there and say no source were unknown, and said so.
        [] if extras.is_empty() && m.entries().next().is_some() => None,
        [] if extras.is_empty() => {
            ck.error(
                m.loc(),
                path,
                "expected response_header, response_json or usage",
                Some("e.g. settle: { usage: openai } or settle: { response_json: usage.total_tokens }".into()),
            );
            None
        }
        [] | [("response_header" | "response_json", _)] if !extras.is_empty() => {
            let (key, at) = extras[0];
            ck.error(
                at.loc,
                &m.child(key),
                format!("`{key}` applies to a cost settled from token counts (usage)"),
                Some("e.g. settle: { usage: openai, tokens: output }".into()),
            );
            None
        }
        [("usage", n)] => usage::read(ck, &m, n).map(SettleFrom::Usage),
        [("response_header", h)] => {
            let field = m.child("response_header");
            let name = ck.string(h, &field)?;
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                ck.error(h.loc, &field, format!("`{name}` is not a valid header name"), None);
                return None;
            }
            Some(SettleFrom::Header(name.to_ascii_lowercase()))
        }
        [(_, j)] => {
            let field = m.child("response_json");
            let text = ck.string(j, &field)?;
            match JsonPath::parse(&text) {
                Ok(p) => Some(SettleFrom::Json(p)),
                Err(why) => {
                    ck.error(j.loc, &field, why, Some("a dotted path such as usage.total_tokens".into()));
                    None
                }
            }
        }
        [] => None,
    }
}

fn read_match(ck: &mut Checker, node: &Node, path: &str) -> Option<Match> {
    let m = ck.map(node, path, MATCH_FIELDS)?;
    let host = m.get("host").and_then(|n| ck.string(n, &m.child("host"))).map(|h| h.to_ascii_lowercase());
    let path_prefix = m.get("path_prefix").and_then(|n| {
        let s = ck.string(n, &m.child("path_prefix"))?;
        if !s.starts_with('/') {
            ck.error(n.loc, &m.child("path_prefix"), format!("`{s}` must start with /"), None);
        }
        Some(s)
    });
    let mut methods = Vec::new();
    if let Some(n) = m.get("methods")
        && let Some(items) = ck.seq(n, &m.child("methods"))
    {
        for (i, item) in items.iter().enumerate() {
            let p = format!("{}[{i}]", m.child("methods"));
            if let Some(s) = ck.string(item, &p) {
                match http::Method::from_bytes(s.to_ascii_uppercase().as_bytes()) {
                    Ok(meth) => methods.push(meth),
                    Err(_) => ck.error(item.loc, &p, format!("`{s}` is not an HTTP method"), None),
                }
            }
        }
    }
    let mut headers = Vec::new();
    if let Some(n) = m.get("headers")
        && let Some(hm) = ck.map(n, &m.child("headers"), &[])
    {
        for (k, v) in hm.entries() {
            let Some(name) = k.as_str() else { continue };
            let p = hm.child(name);
            let Ok(hn) = http::HeaderName::from_bytes(name.as_bytes()) else {
                ck.error(k.loc, &p, format!("`{name}` is not a valid header name"), None);
                continue;
            };
            let value = if v.is_null() { None } else { ck.string(v, &p) };
            headers.push((hn, value));
        }
    }
    Some(Match { host, path_prefix, methods, headers })
}

/// The bytes of an id template's literal text: the least any id it makes has.
fn literal_bytes(t: &IdTemplate) -> usize {
    t.segments.iter().map(|s| if let Segment::Literal(l) = s { l.len() } else { 0 }).sum()
}

#[cfg(test)]
mod tests;
