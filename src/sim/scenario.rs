//! Simulation scenarios: the YAML format, its validation, and the built-in
//! scenarios one to seven from Doorman's design document.

use std::time::Duration;

use usher_core::config::resources::Kind;
use usher_core::config::yaml::{Checker, ConfigError, MapView, Node, parse};

/// How one client's demand moves.
#[derive(Debug, Clone, PartialEq)]
pub enum DemandModel {
    Constant {
        wants: f64,
    },
    /// Starts at `wants` and moves by up to ±`change_pct`% every `every`.
    RandomWalk {
        wants: f64,
        change_pct: f64,
        every: Duration,
    },
}

impl DemandModel {
    pub fn initial(&self) -> f64 {
        match self {
            DemandModel::Constant { wants } | DemandModel::RandomWalk { wants, .. } => *wants,
        }
    }
}

/// Where an event strikes.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Root,
    /// Any node of the tree, drawn at random.
    Random,
    /// Node by index, in breadth-first order (0 = root).
    Index(usize),
}

#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// The node's master is unreachable for `duration`; then a new master is elected.
    MasterLoss { node: Target, duration: Duration },
    /// A new master is elected at once (state lost, learning mode).
    Election { node: Target },
    /// `clients` random clients change their demand.
    ClientSpike { clients: usize, wants: Option<f64>, by: Option<f64> },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub at: Duration,
    pub kind: EventKind,
}

/// Random mishaps at a fixed pace.
#[derive(Debug, Clone, PartialEq)]
pub struct Mishaps {
    pub every: Duration,
    pub client_spike: f64,
    pub election: f64,
    pub master_loss: f64,
    pub spike_by: f64,
    pub max_loss: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub duration: Duration,
    pub seed: u64,
    pub capacity: f64,
    pub algorithm: Kind,
    pub lease_length: Duration,
    pub refresh_interval: Duration,
    pub learning_mode_duration: Duration,
    pub safe_capacity: f64,
    /// Fan-out of each level below the root.
    pub tree: Vec<usize>,
    pub clients_per_leaf: usize,
    pub demand: DemandModel,
    pub events: Vec<Event>,
    pub mishaps: Option<Mishaps>,
}

/// The built-in scenarios, by name, as shipped in `deploy/examples/sim/`.
pub const BUILTIN: &[(&str, &str)] = &[
    ("one", include_str!("../../deploy/examples/sim/one.yaml")),
    ("two", include_str!("../../deploy/examples/sim/two.yaml")),
    ("three", include_str!("../../deploy/examples/sim/three.yaml")),
    ("four", include_str!("../../deploy/examples/sim/four.yaml")),
    ("five", include_str!("../../deploy/examples/sim/five.yaml")),
    ("six", include_str!("../../deploy/examples/sim/six.yaml")),
    ("seven", include_str!("../../deploy/examples/sim/seven.yaml")),
];

impl Scenario {
    pub fn builtin(name: &str) -> Option<Scenario> {
        BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(n, text)| Scenario::parse(&format!("<built-in {n}>"), text).expect("built-in scenarios are valid"))
    }

    pub fn load(path: &std::path::Path) -> Result<Scenario, ConfigError> {
        let name = path.display().to_string();
        let text = usher_core::config::file::read_config(path, "scenario")?;
        Scenario::parse(&name, &text)
    }

    pub fn parse(file: &str, text: &str) -> Result<Scenario, ConfigError> {
        let root = parse(file, text)?;
        let mut ck = Checker::new(file);
        match read(&mut ck, &root) {
            Some(s) => ck.finish(s),
            None => {
                if ck.diagnostics.is_empty() {
                    ck.error(root.loc, "", "invalid scenario", None);
                }
                Err(ck.finish(()).expect_err("diagnostics were reported"))
            }
        }
    }

    /// Number of leaf servers (the ones clients lease from).
    pub fn leaves(&self) -> usize {
        self.tree.iter().product::<usize>().max(1)
    }

    /// Total number of nodes in the tree.
    pub fn nodes(&self) -> usize {
        let mut total = 1;
        let mut level = 1;
        for f in &self.tree {
            level *= f;
            total += level;
        }
        total
    }
}

const FIELDS: &[&str] = &[
    "name",
    "description",
    "duration",
    "seed",
    "capacity",
    "algorithm",
    "lease_length",
    "refresh_interval",
    "learning_mode_duration",
    "safe_capacity",
    "tree",
    "clients_per_leaf",
    "demand",
    "events",
    "mishaps",
];

fn positive(ck: &mut Checker, m: &MapView<'_>, key: &str) -> Option<f64> {
    let n = ck.required(m, key, None)?;
    let v = ck.f64(n, &m.child(key))?;
    if !(v.is_finite() && v >= 0.0) {
        ck.error(n.loc, &m.child(key), format!("must be a finite number >= 0, not {v}"), None);
        return None;
    }
    Some(v)
}

fn secs(ck: &mut Checker, m: &MapView<'_>, key: &str, default: Option<Duration>) -> Option<Duration> {
    match m.get(key) {
        Some(n) => ck.duration(n, &m.child(key)),
        None if default.is_some() => default,
        None => {
            ck.error(m.loc(), &m.child(key), "missing required field", Some("a duration such as 60s".into()));
            None
        }
    }
}

fn read(ck: &mut Checker, root: &Node) -> Option<Scenario> {
    let m = ck.map(root, "", FIELDS)?;
    let name = m.get("name").and_then(|n| ck.string(n, "name")).unwrap_or_else(|| "scenario".into());
    let duration = secs(ck, &m, "duration", None);
    let seed = m.get("seed").and_then(|n| ck.i64(n, "seed")).map_or(1, |v| v as u64);
    let capacity = positive(ck, &m, "capacity");
    let algorithm = ck.required(&m, "algorithm", Some("PROPORTIONAL_SHARE or FAIR_SHARE")).and_then(|n| {
        let s = ck.string(n, "algorithm")?;
        let k = Kind::from_name(&s);
        if k.is_none() {
            ck.error(
                n.loc,
                "algorithm",
                format!("unknown algorithm `{s}`"),
                Some("NO_ALGORITHM, STATIC, PROPORTIONAL_SHARE or FAIR_SHARE".into()),
            );
        }
        k
    });
    let lease = secs(ck, &m, "lease_length", None);
    let refresh = secs(ck, &m, "refresh_interval", None);
    let learning = secs(ck, &m, "learning_mode_duration", lease);
    let safe = m.get("safe_capacity").and_then(|n| ck.f64(n, "safe_capacity")).unwrap_or(-1.0);
    let tree = match m.get("tree") {
        None => Some(Vec::new()),
        Some(n) => ck.seq(n, "tree").map(|items| {
            items
                .iter()
                .enumerate()
                .filter_map(|(i, it)| {
                    let v = ck.i64(it, &format!("tree[{i}]"))?;
                    if v < 1 {
                        ck.error(it.loc, &format!("tree[{i}]"), "a level needs at least one node", None);
                        return None;
                    }
                    Some(v as usize)
                })
                .collect()
        }),
    };
    let clients = ck
        .required(&m, "clients_per_leaf", None)
        .and_then(|n| ck.i64(n, "clients_per_leaf"))
        .map(|v| v.max(1) as usize);
    let demand = ck.required(&m, "demand", None).and_then(|n| read_demand(ck, n));
    let events = m
        .get("events")
        .and_then(|n| ck.seq(n, "events"))
        .map(|items| {
            items.iter().enumerate().filter_map(|(i, it)| read_event(ck, it, &format!("events[{i}]"))).collect()
        })
        .unwrap_or_default();
    let mishaps = m.get("mishaps").and_then(|n| read_mishaps(ck, n));
    Some(Scenario {
        name,
        duration: duration?,
        seed,
        capacity: capacity?,
        algorithm: algorithm?,
        lease_length: lease?,
        refresh_interval: refresh?,
        learning_mode_duration: learning?,
        safe_capacity: safe,
        tree: tree?,
        clients_per_leaf: clients?,
        demand: demand?,
        events,
        mishaps,
    })
}

fn read_demand(ck: &mut Checker, n: &Node) -> Option<DemandModel> {
    let m = ck.map(n, "demand", &["kind", "wants", "change_pct", "every"])?;
    let kind = ck.required(&m, "kind", Some("constant or random_walk")).and_then(|n| ck.string(n, "demand.kind"))?;
    let wants = positive(ck, &m, "wants")?;
    match kind.as_str() {
        "constant" => Some(DemandModel::Constant { wants }),
        "random_walk" => Some(DemandModel::RandomWalk {
            wants,
            change_pct: positive(ck, &m, "change_pct")?,
            every: secs(ck, &m, "every", None)?,
        }),
        other => {
            ck.error(
                n.loc,
                "demand.kind",
                format!("unknown demand kind `{other}`"),
                Some("constant or random_walk".into()),
            );
            None
        }
    }
}

fn read_target(ck: &mut Checker, m: &MapView<'_>) -> Target {
    match m.get("node") {
        None => Target::Random,
        Some(n) => match n.as_str() {
            Some("root") => Target::Root,
            Some("random") => Target::Random,
            _ => ck.i64(n, &m.child("node")).map_or(Target::Random, |i| Target::Index(i.max(0) as usize)),
        },
    }
}

fn read_event(ck: &mut Checker, n: &Node, path: &str) -> Option<Event> {
    let m = ck.map(n, path, &["at", "kind", "node", "duration", "clients", "wants", "by"])?;
    let at = secs(ck, &m, "at", None)?;
    let kind = ck
        .required(&m, "kind", Some("master_loss, election or client_spike"))
        .and_then(|n| ck.string(n, &m.child("kind")))?;
    let kind = match kind.as_str() {
        "master_loss" => EventKind::MasterLoss { node: read_target(ck, &m), duration: secs(ck, &m, "duration", None)? },
        "election" => EventKind::Election { node: read_target(ck, &m) },
        "client_spike" => EventKind::ClientSpike {
            clients: m.get("clients").and_then(|n| ck.i64(n, &m.child("clients"))).map_or(1, |v| v.max(1) as usize),
            wants: m.get("wants").and_then(|n| ck.f64(n, &m.child("wants"))),
            by: m.get("by").and_then(|n| ck.f64(n, &m.child("by"))),
        },
        other => {
            ck.error(
                n.loc,
                &m.child("kind"),
                format!("unknown event `{other}`"),
                Some("master_loss, election or client_spike".into()),
            );
            return None;
        }
    };
    Some(Event { at, kind })
}

fn read_mishaps(ck: &mut Checker, n: &Node) -> Option<Mishaps> {
    let m = ck.map(n, "mishaps", &["every", "weights", "spike_by", "max_loss"])?;
    let every = secs(ck, &m, "every", None)?;
    let w = ck.required(&m, "weights", None)?;
    let wm = ck.map(w, "mishaps.weights", &["client_spike", "election", "master_loss"])?;
    let weight = |ck: &mut Checker, k: &str| wm.get(k).and_then(|n| ck.f64(n, &wm.child(k))).unwrap_or(0.0).max(0.0);
    Some(Mishaps {
        every,
        client_spike: weight(ck, "client_spike"),
        election: weight(ck, "election"),
        master_loss: weight(ck, "master_loss"),
        spike_by: m.get("spike_by").and_then(|n| ck.f64(n, "mishaps.spike_by")).unwrap_or(100.0),
        max_loss: secs(ck, &m, "max_loss", Some(Duration::from_secs(60)))?,
    })
}
