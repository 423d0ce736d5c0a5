//! `usher sim`: the real capacity servers, algorithms, parent links and lease
//! clients, wired through an in-memory transport and driven by a manual
//! clock, to measure utilisation, overshoot, convergence and fairness of a
//! tree in virtual time. Deterministic for a seed.

pub mod scenario;

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

pub use scenario::Scenario;
use scenario::{DemandModel, EventKind, Target};
use usher_core::clock::{Clock, ManualClock, Time};
use usher_core::config::resources::{Algorithm, ResourcesConfig, Template};
use usher_lease::core::{Action, Capacity, Core, CoreConfig, KeyDemand, OnExpiry};
use usher_lease::transport::Transport;
use usher_server::LocalTransport;
use usher_server::horizon;
use usher_server::parent::{ParentAction, ParentSync, current_link};
use usher_server::store::Role;
use usher_server::{Mastership, Node};

/// The simulation's time step.
pub const STEP: Duration = Duration::from_millis(250);
/// How often the report samples the tree.
pub const SAMPLE: Duration = Duration::from_secs(1);
/// The tree has recovered (from start-up or a mishap) once it hands out at
/// least this share of min(demand, capacity).
pub const RECOVERED: f64 = 0.95;
const RESOURCE: &str = "resource";

/// The figures `usher sim` reports (the keys of `--json`).
///
/// "Used" is Σ over clients of min(has, wants): capacity a client holds
/// beyond its demand is idle, not used. The target is min(Σ wants, capacity).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// Mean of used / target over the samples after start-up.
    pub utilisation: f64,
    /// Start-up: the time until the tree first hands out ≥ 95% of the target.
    pub startup_s: f64,
    /// Mean of used / target during start-up (1 when start-up took no sample).
    pub startup_utilisation: f64,
    /// Maximum of handed_out / capacity, start-up included.
    pub max_overshoot: f64,
    /// Mean of handed_out / capacity over the samples where it exceeds 1.
    pub mean_overshoot_when_over: f64,
    /// Number of distinct periods during which handed_out exceeded capacity.
    pub shortfall_events: u64,
    /// Mean over mishaps of the time until the tree is back at ≥ 95% of the
    /// target for good (see [`KindFigures::convergence_mean_s`]).
    pub convergence_mean_s: f64,
    /// The worst of those times.
    pub convergence_worst_s: f64,
    /// Capacity RPCs (GetCapacity, GetServerCapacity, Discovery) per second
    /// over the whole tree, after start-up.
    pub rpcs_per_s: f64,
    /// The same RPCs arriving at each level of the tree (0 = the root), per
    /// second over the last half of the run (start-up and a new resource's
    /// 1 s refreshes long past): what the tree's shape spares the root.
    pub rpcs_per_s_by_level: Vec<f64>,
    /// Clients in the tree (every leaf has `clients_per_leaf`).
    pub clients: u64,
    /// Mean Jain's index of has/wants over clients whose demand exceeds their equal share.
    pub fairness: f64,
    /// The same figures per kind of mishap (`client_spike`, `election`,
    /// `master_loss`; `none` for the time before the first one).
    pub mishaps: std::collections::BTreeMap<String, KindFigures>,
}

/// One kind of mishap's figures. A sample belongs to the last mishap that
/// started at or before it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KindFigures {
    pub count: u64,
    /// Mean of used / target over the samples after start-up that belong to this kind.
    pub utilisation: f64,
    pub max_overshoot: f64,
    /// From the moment recovery can start (the mishap itself; for a master
    /// loss, the moment the node is back) to the end of the last sample
    /// below 95% of the target in the mishap's window: until the next mishap,
    /// at most a lease and a refresh interval (0 if none dipped; the whole
    /// window if the tree never came back in it).
    pub convergence_mean_s: f64,
    pub convergence_worst_s: f64,
}

/// A mishap as it happened, for the report.
#[derive(Debug, Clone, PartialEq)]
struct Mishap {
    kind: &'static str,
    at: f64,
    /// When the tree can start recovering: the mishap, or the end of an outage.
    recover_from: f64,
}

/// One point of the time series.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub t: f64,
    pub capacity: f64,
    pub wants: f64,
    pub has: f64,
    /// Σ min(has, wants) over clients.
    pub used: f64,
    /// Capacity RPCs so far.
    pub rpcs: u64,
    /// Capacity RPCs so far that arrived at each level (0 = the root).
    pub rpcs_by_level: Vec<u64>,
    pub fairness: Option<f64>,
}

impl Sample {
    fn target(&self) -> f64 {
        self.wants.min(self.capacity)
    }

    fn ratio(&self) -> f64 {
        let t = self.target();
        if t <= 0.0 { 1.0 } else { (self.used / t).min(1.0) }
    }

    fn recovered(&self) -> bool {
        self.used >= RECOVERED * self.target() - 1e-9
    }
}

struct SimNode {
    addr: String,
    node: Arc<Node>,
    /// The parent's address, and the current master's link to it.
    parent: Option<(String, Option<(u64, ParentSync)>)>,
    down_until: Option<Time>,
    /// Seeds the links of this node's masters.
    seed: u64,
    /// Until when its master's leases may be outstanding, as recorded next to
    /// its election key (see `server::horizon`).
    record: Option<Time>,
}

/// Capacity RPCs counted by the level of the node they reach, so the root's
/// load can be told apart from the tree's.
#[derive(Default)]
struct RpcCount {
    total: u64,
    by_level: Vec<u64>,
    level_of: std::collections::HashMap<String, usize>,
}

impl RpcCount {
    fn hit(&mut self, target: &str) {
        self.total += 1;
        if let Some(&l) = self.level_of.get(target) {
            self.by_level[l] += 1;
        }
    }
}

struct SimClient {
    core: Core,
    base: f64,
    wants: f64,
}

/// A running simulation.
pub struct Sim {
    sc: Scenario,
    clock: Clock,
    time: Arc<ManualClock>,
    start: Time,
    net: LocalTransport,
    nodes: Vec<SimNode>,
    clients: Vec<SimClient>,
    rng: SmallRng,
    rt: tokio::runtime::Runtime,
    pub samples: Vec<Sample>,
    mishaps: Vec<Mishap>,
    rpcs: RpcCount,
    /// Print every event to stderr.
    pub trace: bool,
}

fn template(sc: &Scenario) -> ResourcesConfig {
    ResourcesConfig {
        templates: vec![Arc::new(Template {
            identifier_glob: "*".into(),
            capacity: sc.capacity,
            safe_capacity: Some(sc.safe_capacity),
            description: None,
            algorithm: Algorithm {
                kind: sc.algorithm,
                lease_length: sc.lease_length,
                refresh_interval: sc.refresh_interval,
                learning_mode_duration: sc.learning_mode_duration,
                parameters: vec![],
            },
            calendar: None,
        })],
    }
}

impl Sim {
    pub fn new(sc: Scenario, seed: u64) -> Sim {
        let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
        let start = clock.now();
        let net = LocalTransport::new();
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut nodes = Vec::new();
        // Breadth-first: node 0 is the root; each level's nodes lease from the level above.
        let mut level: Vec<usize> = vec![0];
        let root = Arc::new(Node::new(
            "n0".into(),
            "sim".into(),
            template(&sc),
            clock.clone(),
            Duration::from_secs(1),
            prometheus::Registry::new(),
        ));
        net.add("n0", root.clone());
        nodes.push(SimNode { addr: "n0".into(), node: root, parent: None, down_until: None, seed: 0, record: None });
        let mut rpcs = RpcCount { by_level: vec![0; sc.tree.len() + 1], ..RpcCount::default() };
        rpcs.level_of.insert("n0".into(), 0);
        for (depth, fanout) in sc.tree.iter().enumerate() {
            let mut next = Vec::new();
            for &p in &level {
                for _ in 0..*fanout {
                    let addr = format!("n{}", nodes.len());
                    let mut node = Node::new(
                        addr.clone(),
                        "sim".into(),
                        template(&sc),
                        clock.clone(),
                        Duration::from_secs(1),
                        prometheus::Registry::new(),
                    );
                    node.store.set_role(Role::Intermediate { decay_factor: 0.5 });
                    let node = Arc::new(node);
                    net.add(addr.clone(), node.clone());
                    rpcs.level_of.insert(addr.clone(), depth + 1);
                    let parent_addr = nodes[p].addr.clone();
                    next.push(nodes.len());
                    nodes.push(SimNode {
                        addr,
                        node,
                        parent: Some((parent_addr, None)),
                        down_until: None,
                        seed: rng.random(),
                        record: None,
                    });
                }
            }
            level = next;
        }
        // A fresh deployment: no master has recorded anything yet.
        for n in &nodes {
            n.node.store.set_predecessor(horizon::outstanding(None, start, Duration::ZERO));
        }
        let mut clients = Vec::new();
        for &leaf in &level {
            for i in 0..sc.clients_per_leaf {
                let mut cfg = CoreConfig::new(format!("{}-c{i}", nodes[leaf].addr), vec![nodes[leaf].addr.clone()]);
                cfg.seed = rng.random();
                let base = sc.demand.initial();
                clients.push(SimClient { core: Core::new(cfg, start), base, wants: base });
            }
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
        Sim {
            sc,
            clock,
            time,
            start,
            net,
            nodes,
            clients,
            rng,
            rt,
            samples: Vec::new(),
            mishaps: Vec::new(),
            rpcs,
            trace: false,
        }
    }

    fn elapsed(&self) -> f64 {
        self.clock.now().since(self.start).as_secs_f64()
    }

    /// Runs the whole scenario; `progress` is called with the fraction done.
    pub fn run(&mut self, mut progress: impl FnMut(f64)) -> Report {
        let total = self.sc.duration;
        let steps = (total.as_secs_f64() / STEP.as_secs_f64()).round() as u64;
        let mut events = self.sc.events.clone();
        events.sort_by_key(|e| e.at);
        let mut next_event = 0;
        let walk_every = match self.sc.demand {
            DemandModel::RandomWalk { every, .. } => Some(every),
            DemandModel::Constant { .. } => None,
        };
        let mut last_walk = Duration::ZERO;
        let mut last_mishap = Duration::ZERO;
        let mut last_sample: Option<Duration> = None;
        for step in 0..=steps {
            let t = STEP * step as u32;
            while next_event < events.len() && events[next_event].at <= t {
                let kind = events[next_event].kind.clone();
                self.apply(&kind);
                next_event += 1;
            }
            if let Some(m) = self.sc.mishaps.clone()
                && t >= last_mishap + m.every
            {
                last_mishap = t;
                let total_w = m.client_spike + m.election + m.master_loss;
                if total_w > 0.0 {
                    let x = self.rng.random_range(0.0..total_w);
                    let kind = if x < m.client_spike {
                        EventKind::ClientSpike { clients: 1, wants: None, by: Some(m.spike_by) }
                    } else if x < m.client_spike + m.election {
                        EventKind::Election { node: Target::Random }
                    } else {
                        let d = m.max_loss.mul_f64(self.rng.random_range(0.0..1.0));
                        EventKind::MasterLoss { node: Target::Random, duration: d }
                    };
                    self.apply(&kind);
                }
            }
            if let (Some(every), DemandModel::RandomWalk { change_pct, .. }) = (walk_every, &self.sc.demand)
                && t >= last_walk + every
            {
                last_walk = t;
                let pct = *change_pct / 100.0;
                for c in &mut self.clients {
                    let f = 1.0 + self.rng.random_range(-pct..=pct);
                    c.base = (c.base * f).max(0.0);
                    c.wants = (c.wants * f).max(0.0);
                }
            }
            self.heal();
            self.tick();
            if last_sample.is_none_or(|s| t >= s + SAMPLE) {
                last_sample = Some(t);
                self.sample();
            }
            if step % (steps / 20).max(1) == 0 {
                progress(step as f64 / steps.max(1) as f64);
            }
            self.time.advance(STEP);
        }
        self.report()
    }

    fn pick_node(&mut self, target: &Target) -> usize {
        let i = match target {
            Target::Root => 0,
            Target::Index(i) => (*i).min(self.nodes.len() - 1),
            Target::Random => self.rng.random_range(0..self.nodes.len()),
        };
        if self.trace {
            eprintln!("  strikes node {i} ({})", self.nodes[i].addr);
        }
        i
    }

    fn apply(&mut self, kind: &EventKind) {
        if self.trace {
            eprintln!("t={:.1}s {kind:?}", self.elapsed());
        }
        match kind {
            EventKind::MasterLoss { node, duration } => {
                let at = self.elapsed();
                self.mishaps.push(Mishap { kind: "master_loss", at, recover_from: at + duration.as_secs_f64() });
                let i = self.pick_node(node);
                let until = self.clock.now().saturating_add(*duration);
                self.net.set_up(&self.nodes[i].addr, false);
                self.nodes[i].down_until = Some(until);
            }
            EventKind::Election { node } => {
                let at = self.elapsed();
                self.mishaps.push(Mishap { kind: "election", at, recover_from: at });
                let i = self.pick_node(node);
                self.reelect(i);
            }
            EventKind::ClientSpike { clients, wants, by } => {
                for _ in 0..*clients {
                    let c = self.rng.random_range(0..self.clients.len());
                    let cl = &mut self.clients[c];
                    cl.wants = match (wants, by) {
                        (Some(w), _) => *w,
                        (None, Some(b)) => cl.wants + b,
                        (None, None) => cl.wants * 2.0,
                    };
                }
                let at = self.elapsed();
                self.mishaps.push(Mishap { kind: "client_spike", at, recover_from: at });
            }
        }
    }

    /// A new master takes over node `i`: empty state, learning mode, and a
    /// fresh link to its parent under the node's identity and a new epoch.
    fn reelect(&mut self, i: usize) {
        self.nodes[i].seed = self.rng.random();
        let now = self.clock.now();
        let n = &self.nodes[i].node;
        n.set_mastership(Mastership { is_master: false, master_address: None });
        n.set_mastership(Mastership { is_master: true, master_address: Some(self.nodes[i].addr.clone()) });
        n.store.set_predecessor(horizon::outstanding(self.nodes[i].record, now, n.store.longest_lease()));
        self.record(i);
    }

    /// Node `i`'s master records its lease horizon, as at each renewal of
    /// its election lease (here: every step).
    fn record(&mut self, i: usize) {
        let node = &self.nodes[i].node;
        let h = horizon::horizon(self.clock.now(), node.store.longest_lease(), STEP);
        node.store.set_lease_horizon(Some(h));
        self.nodes[i].record = Some(h);
    }

    fn heal(&mut self) {
        let now = self.clock.now();
        for i in 0..self.nodes.len() {
            if self.nodes[i].down_until.is_some_and(|u| u <= now) {
                self.nodes[i].down_until = None;
                self.net.set_up(&self.nodes[i].addr, true);
                self.reelect(i);
            }
        }
    }

    /// One time step: every parent link and every client does what is due.
    fn tick(&mut self) {
        for i in 0..self.nodes.len() {
            let node = self.nodes[i].node.clone();
            // A lost master is gone: it speaks to nobody.
            if self.nodes[i].down_until.is_some() {
                continue;
            }
            self.record(i);
            let now = self.clock.now();
            let seed = self.nodes[i].seed ^ node.store.master_epoch();
            let Some((parent, slot)) = self.nodes[i].parent.as_mut() else { continue };
            let Some(sync) = current_link(slot, &node, std::slice::from_ref(parent), now, Some(seed)) else { continue };
            for _ in 0..8 {
                let now = self.clock.now();
                match sync.next_action(&node, now) {
                    ParentAction::Wait(_) => break,
                    ParentAction::Discover(target) => {
                        self.rpcs.hit(&target);
                        let r = self.rt.block_on(self.net.discovery(&target));
                        sync.on_discovery(now, &target, r);
                    }
                    ParentAction::Release(target, req) => {
                        let r = self.rt.block_on(self.net.release_capacity(&target, req));
                        sync.on_release(now, r);
                    }
                    ParentAction::Refresh(target, req) => {
                        self.rpcs.hit(&target);
                        let r = self.rt.block_on(self.net.get_server_capacity(&target, req));
                        sync.on_refresh(&node, now, r);
                    }
                }
            }
        }
        for c in &mut self.clients {
            // A client refuses what it wants beyond what it may use, and says
            // so, as a sidecar does.
            let now = self.clock.now();
            let pressure = c.wants > client_has(c, now) + 1e-9;
            c.core.set_demand(vec![KeyDemand {
                resource_id: RESOURCE.into(),
                priority: 0,
                wants: c.wants,
                on_expiry: OnExpiry::Safe,
                safe_capacity: Some(self.sc.safe_capacity),
                pressure,
                quota: None,
                account: None,
                window: None,
            }]);
            for _ in 0..8 {
                let now = self.clock.now();
                match c.core.next_action(now) {
                    Action::Wait { .. } => break,
                    Action::Discover { target } => {
                        self.rpcs.hit(&target);
                        let r = self.rt.block_on(self.net.discovery(&target));
                        c.core.on_discovery(now, &target, r);
                    }
                    Action::Refresh { target, request } => {
                        self.rpcs.hit(&target);
                        let r = self.rt.block_on(self.net.get_capacity(&target, request));
                        c.core.on_refresh(now, r);
                    }
                    Action::Release { target, request } => {
                        let r = self.rt.block_on(self.net.release_capacity(&target, request));
                        c.core.on_release(now, r);
                    }
                }
            }
        }
    }

    fn sample(&mut self) {
        let now = self.clock.now();
        let (mut has, mut wants, mut used) = (0.0, 0.0, 0.0);
        for c in &mut self.clients {
            let h = client_has(c, now);
            wants += c.wants;
            has += h;
            used += h.min(c.wants);
        }
        let t = self.elapsed();
        let fairness = self.fairness_now();
        self.samples.push(Sample {
            t,
            capacity: self.sc.capacity,
            wants,
            has,
            used,
            rpcs: self.rpcs.total,
            rpcs_by_level: self.rpcs.by_level.clone(),
            fairness,
        });
    }

    fn fairness_now(&mut self) -> Option<f64> {
        let now = self.clock.now();
        let share = self.sc.capacity / self.clients.len().max(1) as f64;
        let ratios: Vec<f64> =
            self.clients.iter_mut().filter(|c| c.wants > share).map(|c| client_has(c, now) / c.wants).collect();
        if ratios.len() < 2 {
            return None;
        }
        let sum: f64 = ratios.iter().sum();
        let sq: f64 = ratios.iter().map(|r| r * r).sum();
        (sq > 0.0).then(|| sum * sum / (ratios.len() as f64 * sq))
    }

    fn report(&mut self) -> Report {
        let horizon = (self.sc.lease_length + self.sc.refresh_interval).as_secs_f64();
        let mut r = report(&self.samples, &self.mishaps, self.sc.duration.as_secs_f64(), horizon);
        r.clients = self.clients.len() as u64;
        r
    }
}

/// What a client may use now (its wants when unlimited).
fn client_has(c: &mut SimClient, now: Time) -> f64 {
    match c.core.capacity(RESOURCE, now) {
        Some(Capacity::Limited(v)) => v,
        Some(Capacity::Unlimited) => c.wants,
        None => 0.0,
    }
}

/// Computes the report from a run's samples and mishaps. A mishap's window
/// ends at the next mishap, or `horizon` after recovery could start (a lease
/// and a refresh: every effect of a mishap shows within that), so a dip of
/// demand much later is not blamed on it.
fn report(samples: &[Sample], mishaps: &[Mishap], duration: f64, horizon: f64) -> Report {
    let step = SAMPLE.as_secs_f64();
    let startup_end = samples.iter().find(|s| s.recovered()).map_or(duration, |s| s.t);
    let (startup, steady): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.t < startup_end);
    let cap_over = |s: &Sample| s.has / s.capacity.max(1e-9);
    let over: Vec<f64> = samples.iter().map(cap_over).filter(|r| *r > 1.0 + 1e-9).collect();
    let mut events = 0;
    let mut was_over = false;
    for s in samples {
        let is_over = cap_over(s) > 1.0 + 1e-9;
        if is_over && !was_over {
            events += 1;
        }
        was_over = is_over;
    }
    // Per mishap: the time until the tree is back for good within its window.
    let mut by_kind: std::collections::BTreeMap<String, (Vec<f64>, Vec<&Sample>)> = Default::default();
    let mut all_conv = Vec::new();
    for m in mishaps {
        let end = mishaps
            .iter()
            .map(|n| n.at)
            .filter(|&a| a > m.recover_from)
            .fold(duration.min(m.recover_from + horizon), f64::min);
        let last_bad = samples.iter().rfind(|s| s.t >= m.recover_from && s.t < end && !s.recovered());
        let conv = last_bad.map_or(0.0, |s| (s.t + step - m.recover_from).min(end - m.recover_from).max(0.0));
        all_conv.push(conv);
        by_kind.entry(m.kind.to_string()).or_default().0.push(conv);
    }
    for s in &steady {
        let kind = mishaps.iter().rfind(|m| m.at <= s.t).map_or("none", |m| m.kind);
        by_kind.entry(kind.to_string()).or_default().1.push(s);
    }
    let figures = by_kind
        .into_iter()
        .map(|(kind, (conv, ss))| {
            let count = mishaps.iter().filter(|m| m.kind == kind).count() as u64;
            let ratios: Vec<f64> = ss.iter().map(|s| s.ratio()).collect();
            let fig = KindFigures {
                count,
                utilisation: mean(&ratios),
                max_overshoot: ss.iter().map(|s| cap_over(s)).fold(0.0, f64::max),
                convergence_mean_s: mean(&conv),
                convergence_worst_s: conv.iter().copied().fold(0.0, f64::max),
            };
            (kind, fig)
        })
        .collect();
    let rpcs_per_s = match (steady.first(), steady.last()) {
        (Some(a), Some(b)) if b.t > a.t => (b.rpcs - a.rpcs) as f64 / (b.t - a.t),
        _ => 0.0,
    };
    let second_half = samples.iter().find(|s| s.t >= duration / 2.0);
    let rpcs_per_s_by_level = match (second_half, samples.last()) {
        (Some(a), Some(b)) if b.t > a.t => {
            a.rpcs_by_level.iter().zip(&b.rpcs_by_level).map(|(x, y)| (y - x) as f64 / (b.t - a.t)).collect()
        }
        _ => vec![0.0; samples.first().map_or(0, |s| s.rpcs_by_level.len())],
    };
    let fair: Vec<f64> = steady.iter().filter_map(|s| s.fairness).collect();
    Report {
        utilisation: mean(&steady.iter().map(|s| s.ratio()).collect::<Vec<_>>()),
        startup_s: startup_end,
        startup_utilisation: if startup.is_empty() {
            1.0
        } else {
            mean(&startup.iter().map(|s| s.ratio()).collect::<Vec<_>>())
        },
        max_overshoot: samples.iter().map(cap_over).fold(0.0, f64::max),
        mean_overshoot_when_over: mean(&over),
        shortfall_events: events,
        convergence_mean_s: mean(&all_conv),
        convergence_worst_s: all_conv.iter().copied().fold(0.0, f64::max),
        rpcs_per_s,
        rpcs_per_s_by_level,
        clients: 0,
        fairness: if fair.is_empty() { 1.0 } else { mean(&fair) },
        mishaps: figures,
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / xs.len() as f64 }
}

/// The time series as CSV.
pub fn csv(samples: &[Sample]) -> String {
    let mut out = String::from("t_s,capacity,total_wants,total_has,total_used\n");
    for s in samples {
        out.push_str(&format!("{:.2},{:.3},{:.3},{:.3},{:.3}\n", s.t, s.capacity, s.wants, s.has, s.used));
    }
    out
}

/// `usher sim` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Scenario file (YAML); see deploy/examples/sim/.
    #[arg(value_name = "SCENARIO.yaml", required_unless_present = "scenario")]
    pub file: Option<std::path::PathBuf>,
    /// A built-in scenario instead of a file: one, two, three, four, five, six or seven.
    #[arg(long, value_name = "NAME", conflicts_with = "file")]
    pub scenario: Option<String>,
    /// Random seed; the same seed gives the same run [default: the scenario's, else 1].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Override the scenario's duration, e.g. 300s (CI runs short forms).
    #[arg(long, value_name = "DURATION", value_parser = crate::parse_duration)]
    pub duration: Option<Duration>,
    /// Override the number of clients: this many in all, shared evenly by the
    /// leaves (the scenario's `clients_per_leaf` becomes N / leaves, at least 1).
    #[arg(long, value_name = "N")]
    pub clients: Option<usize>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Write the time series (t, capacity, total wants, total has) to this CSV file.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<std::path::PathBuf>,
    /// Print every event and mishap, and the node it strikes, to stderr.
    #[arg(long)]
    pub trace: bool,
    /// Draw capacity, total wants and total has over time to this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<std::path::PathBuf>,
}

/// Runs `usher sim`.
pub fn run(args: SimArgs) -> Result<(), usher_core::error::RunError> {
    use usher_core::error::RunError;
    let mut sc = match (&args.file, &args.scenario) {
        (_, Some(name)) => Scenario::builtin(name).ok_or_else(|| {
            let names: Vec<&str> = scenario::BUILTIN.iter().map(|(n, _)| *n).collect();
            RunError::Usage(format!("no built-in scenario `{name}`; choose one of {}", names.join(", ")))
        })?,
        (Some(path), None) => Scenario::load(path)?,
        (None, None) => return Err(RunError::Usage("give a scenario file or --scenario NAME".into())),
    };
    if let Some(d) = args.duration {
        sc.duration = d;
    }
    if let Some(n) = args.clients {
        sc.clients_per_leaf = (n / sc.leaves()).max(1);
    }
    let seed = args.seed.unwrap_or(sc.seed);
    let name = sc.name.clone();
    let sim_secs = sc.duration.as_secs();
    #[allow(clippy::disallowed_methods, reason = "reports how long the simulation took in real time")]
    let started = std::time::Instant::now();
    let mut sim = Sim::new(sc, seed);
    sim.trace = args.trace;
    let long = sim_secs > 600;
    let report = sim.run(|f| {
        if long {
            eprint!("\rsim {name}: {:>3.0}% of {sim_secs} s simulated", f * 100.0);
        }
    });
    if long {
        eprintln!();
    }
    if let Some(path) = &args.csv {
        std::fs::write(path, csv(&sim.samples))
            .map_err(|e| RunError::Other(format!("cannot write {}: {e}", path.display())))?;
    }
    if let Some(path) = &args.plot {
        let series = |name: &str, rgb: [u8; 3], f: fn(&Sample) -> f64| crate::plot::Series {
            name: name.into(),
            rgb,
            points: sim.samples.iter().map(|s| (s.t, f(s))).collect(),
        };
        crate::plot::line_chart(
            path,
            &format!("scenario {name}"),
            &[
                series("capacity", [200, 40, 40], |s| s.capacity),
                series("wants", [40, 90, 200], |s| s.wants),
                series("has", [30, 150, 60], |s| s.has),
            ],
        )
        .map_err(|e| RunError::Other(format!("cannot write {}: {e}", path.display())))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("report serialises"));
    } else {
        println!("scenario {name} (seed {seed}, {sim_secs} s simulated in {:.1} s)", started.elapsed().as_secs_f64());
        println!(
            "  start-up                  {:>8.1} s at {:.2}%",
            report.startup_s,
            report.startup_utilisation * 100.0
        );
        println!("  utilisation after it      {:>8.2}%", report.utilisation * 100.0);
        println!("  max overshoot             {:>8.2}%", report.max_overshoot * 100.0);
        println!("  mean overshoot when over  {:>8.2}%", report.mean_overshoot_when_over * 100.0);
        println!("  shortfall events          {:>8}", report.shortfall_events);
        println!(
            "  convergence after mishaps {:>8.1} s mean, {:.1} s worst",
            report.convergence_mean_s, report.convergence_worst_s
        );
        println!("  clients                   {:>8} on {} servers", report.clients, sim.nodes.len());
        println!("  capacity RPCs             {:>8.2} /s", report.rpcs_per_s);
        for (level, r) in report.rpcs_per_s_by_level.iter().enumerate() {
            let what = if level == 0 { "at the root".to_string() } else { format!("at level {level}") };
            println!("    {what:<23} {r:>8.2} /s");
        }
        println!("  fairness (Jain)           {:>8.3}", report.fairness);
        for (kind, f) in &report.mishaps {
            println!(
                "  {kind:<13} x{:<4} utilisation {:>6.2}%, max overshoot {:>6.2}%, convergence {:.1} s mean, {:.1} s worst",
                f.count,
                f.utilisation * 100.0,
                f.max_overshoot * 100.0,
                f.convergence_mean_s,
                f.convergence_worst_s
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
