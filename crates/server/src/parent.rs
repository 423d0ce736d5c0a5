//! An intermediate server's link to its parent: one `GetServerCapacity` per
//! refresh for every resource with demand, aggregated into priority bands.
//!
//! Scheduling, discovery, redirects, failover across the parent addresses and
//! backoff are the lease client's [`Core`]; this module only translates its
//! requests into the server protocol and hands each grant to the store.
//! `has` carries the larger of the parent's grant and what this server has
//! actually handed out, so a parent in learning mode after a failover hands
//! back what is in use instead of starving the subtree.
//!
//! Only the node's master speaks to the parent, as `<node id>#<epoch>` (the
//! epoch is the moment it became master): every master of the node shares
//! the node id, so a new master takes over its predecessor's lease at an
//! usher parent instead of standing beside it (a real Doorman parent sees
//! another server id, as before). A master that steps down just stops: it
//! releases nothing, since the lease is now its successor's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::Node;
use super::store::{Band, EPOCH_SEPARATOR, PREDECESSOR_PARAMETER, ParentLease};
use usher_core::clock::{Clock, Time};
use usher_core::config::resources::Algorithm;
use usher_lease::batch;
use usher_lease::core::{Action, CallError, Core, CoreConfig, KeyDemand, Mode, OnExpiry};
use usher_lease::transport::Transport;
use usher_proto as proto;

/// What status pages show of the link to the parent.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ParentStatus {
    /// The parent servers' addresses (`--parent`).
    pub servers: Vec<String>,
    /// The parent node's master, once discovered.
    pub master: Option<String>,
    /// The last failed call's error, until a refresh succeeds.
    pub last_error: Option<String>,
    /// Refreshes the parent answered so far.
    pub refreshes: u64,
    /// When the next regular refresh is due, in Unix seconds.
    pub next_refresh: i64,
}

/// The parent link's shared state, readable by status pages.
#[derive(Default)]
pub struct ParentLink {
    status: Mutex<ParentStatus>,
}

impl ParentLink {
    /// The link as it stood after its last turn.
    pub fn status(&self) -> ParentStatus {
        self.status.lock().expect("parent status poisoned").clone()
    }
}

/// The algorithm a parent hands down, without usher's own parameters, and
/// what those say of this node's predecessor.
fn algorithm_from_wire(a: &proto::Algorithm) -> (Option<Algorithm>, Option<u64>) {
    let predecessor =
        a.parameters.iter().find(|p| p.name == PREDECESSOR_PARAMETER).and_then(|p| p.value.as_deref()?.parse().ok());
    (algorithm(a), predecessor)
}

/// The algorithm of a parent's answer; `None` for a kind this server does not know.
fn algorithm(a: &proto::Algorithm) -> Option<Algorithm> {
    use usher_core::config::resources::Kind;
    let kind = match proto::algorithm::Kind::try_from(a.kind).ok()? {
        proto::algorithm::Kind::NoAlgorithm => Kind::NoAlgorithm,
        proto::algorithm::Kind::Static => Kind::Static,
        proto::algorithm::Kind::ProportionalShare => Kind::ProportionalShare,
        proto::algorithm::Kind::FairShare => Kind::FairShare,
    };
    let secs = |v: i64| Duration::from_secs(v.max(1) as u64);
    Some(Algorithm {
        kind,
        lease_length: secs(a.lease_length),
        refresh_interval: secs(a.refresh_interval),
        learning_mode_duration: Duration::from_secs(a.learning_mode_duration.unwrap_or(a.lease_length).max(0) as u64),
        parameters: a
            .parameters
            .iter()
            .filter(|p| p.name != PREDECESSOR_PARAMETER)
            .map(|p| (p.name.clone(), p.value.clone()))
            .collect(),
    })
}

/// What a parent's answer carries beside the lease: the algorithm, the safe
/// capacity and what it says of this node's predecessor.
type Extras = (Option<Algorithm>, Option<f64>, Option<u64>, Option<String>);

/// The parent link's logic without I/O: what to send and what to do with
/// the answers. `run` drives it in real time; `usher sim` in virtual time.
pub struct ParentSync {
    core: Core,
    extras: HashMap<String, Extras>,
    demand: HashMap<String, (Vec<Band>, f64)>,
    /// The wants of each resource in the last request sent.
    sent: HashMap<String, f64>,
    /// The subclients of each resource in the last request sent, and in the
    /// one the current lease answers.
    sent_subclients: HashMap<String, u64>,
    answered_subclients: HashMap<String, u64>,
}

/// Demand this many times the last request's asks for an early refresh.
pub const GROWTH: f64 = 1.2;

/// What the parent link must do next.
pub enum ParentAction {
    /// Nothing to send until then.
    Wait(Time),
    /// Ask this parent server who its master is.
    Discover(String),
    /// Send this release to this server.
    Release(String, proto::ReleaseCapacityRequest),
    /// Send this capacity request to this server.
    Refresh(String, proto::GetServerCapacityRequest),
}

impl ParentSync {
    /// The link of the master of node `node_id` that became master at `epoch`.
    pub fn new(node_id: &str, epoch: u64, parents: Vec<String>, now: Time, seed: Option<u64>) -> Self {
        let mut cfg = CoreConfig::new(format!("{node_id}{EPOCH_SEPARATOR}{epoch}"), parents);
        cfg.min_interval = Duration::from_secs(1);
        if let Some(s) = seed {
            cfg.seed = s;
        }
        ParentSync {
            core: Core::new(cfg, now),
            extras: HashMap::new(),
            demand: HashMap::new(),
            sent: HashMap::new(),
            sent_subclients: HashMap::new(),
            answered_subclients: HashMap::new(),
        }
    }

    /// Reads the store's demand, hands the current leases to it, and says what to do.
    pub fn next_action(&mut self, node: &Node, now: Time) -> ParentAction {
        let demand = node.store.parent_demand();
        self.demand = demand.iter().map(|d| (d.resource_id.clone(), (d.bands.clone(), d.handed_out))).collect();
        self.core.set_demand(
            demand
                .iter()
                .map(|d| KeyDemand {
                    resource_id: d.resource_id.clone(),
                    priority: 0,
                    wants: d.wants,
                    on_expiry: OnExpiry::Pessimistic,
                    safe_capacity: None,
                    // Demand that grew well past both the last request and
                    // the lease asks at once (within the minimum interval),
                    // not a whole refresh interval later.
                    pressure: d.wants > self.sent.get(&d.resource_id).copied().unwrap_or(0.0) * GROWTH
                        && d.wants > self.core.lease_of(&d.resource_id).map_or(0.0, |l| l.capacity) + 1e-9,
                    quota: d.quota,
                    // (A lower server leases a rate: allotments go to the root's clients.)
                    account: None,
                    window: None,
                })
                .collect(),
        );
        let (mut lapsed, mut back) = (Vec::new(), Vec::new());
        for t in self.core.take_transitions() {
            tracing::debug!(resource = %t.resource_id, from = ?t.from, to = ?t.to, "lease from parent changed");
            match (t.from, t.to) {
                (Mode::Leased, Mode::Held | Mode::Expired) => lapsed.push(t.resource_id),
                (Mode::Held | Mode::Expired, Mode::Leased) => back.push(t.resource_id),
                _ => {}
            }
        }
        // One line for all the resources a turn moved, not one each.
        if let Some(first) = lapsed.first() {
            tracing::warn!(
                resources = lapsed.len(),
                first = %first,
                "the lease from the parent ran out unrenewed: no new capacity is handed out until the parent \
                 answers; clients keep their leases until they end, then are told the safe capacity"
            );
        }
        if let Some(first) = back.first() {
            tracing::info!(resources = back.len(), first = %first, "the lease from the parent is renewed: capacity is handed out again");
        }
        self.publish(node);
        match self.core.next_action(now) {
            Action::Wait { until } => ParentAction::Wait(until),
            Action::Discover { target } => ParentAction::Discover(target),
            Action::Release { target, request } => ParentAction::Release(target, request),
            Action::Refresh { target, request } => {
                for r in &request.resource {
                    self.sent.insert(r.resource_id.clone(), r.wants);
                }
                let req = server_request(&request, &self.demand, now);
                for r in &req.resource {
                    let n = r.wants.iter().map(|b| b.num_clients.max(0) as u64).sum();
                    self.sent_subclients.insert(r.resource_id.clone(), n);
                }
                ParentAction::Refresh(target, req)
            }
        }
    }

    /// Takes a discovery's answer from `target`.
    pub fn on_discovery(&mut self, now: Time, target: &str, r: Result<proto::DiscoveryResponse, CallError>) {
        self.core.on_discovery(now, target, r);
    }

    /// Takes a release's answer.
    pub fn on_release(&mut self, now: Time, r: Result<proto::ReleaseCapacityResponse, CallError>) {
        self.core.on_release(now, r);
    }

    /// Takes a refresh's answer and hands the leases it carries to the store.
    pub fn on_refresh(&mut self, node: &Node, now: Time, r: Result<proto::GetServerCapacityResponse, CallError>) {
        let r = r.map(|resp| {
            for rr in &resp.response {
                let (algorithm, predecessor) = rr.algorithm.as_ref().map_or((None, None), algorithm_from_wire);
                let template = rr.template.clone();
                self.extras.insert(rr.resource_id.clone(), (algorithm, rr.safe_capacity, predecessor, template));
                if let Some(n) = self.sent_subclients.get(&rr.resource_id) {
                    self.answered_subclients.insert(rr.resource_id.clone(), *n);
                }
            }
            client_response(resp)
        });
        for r in self.core.on_refresh(now, r) {
            tracing::warn!(resource = %r.resource_id, "{}", r.message);
        }
        self.publish(node);
    }

    /// The link's status, for the parent servers `servers`.
    pub fn status(&self, servers: &[String]) -> ParentStatus {
        ParentStatus {
            servers: servers.to_vec(),
            master: self.core.master().map(str::to_string),
            last_error: self.core.last_error().map(str::to_string),
            refreshes: self.core.refreshes(),
            next_refresh: self.core.next_refresh().as_secs(),
        }
    }

    /// The release of every lease held from the parent, and the server to
    /// send it to; `None` when no master is known or nothing is held.
    pub fn release_all(&mut self) -> Option<(String, proto::ReleaseCapacityRequest)> {
        self.core.release_all()
    }

    /// Hands every lease from the parent to the store.
    fn publish(&self, node: &Node) {
        for d in node.store.parent_demand() {
            let lease = self.core.lease_of(&d.resource_id).map(|l| {
                let (algorithm, safe_capacity, predecessor_subclients, template) =
                    self.extras.get(&d.resource_id).cloned().unwrap_or((None, None, None, None));
                ParentLease {
                    capacity: l.capacity,
                    expiry: l.expiry,
                    refresh_interval: l.refresh_interval,
                    algorithm,
                    safe_capacity,
                    template,
                    predecessor_subclients,
                    answered_subclients: self.answered_subclients.get(&d.resource_id).copied(),
                    resource_capacity: self.core.fleet_capacity(&d.resource_id),
                }
            });
            node.store.set_parent_lease(&d.resource_id, lease);
        }
    }
}

/// The link of the node's current master: `None` while this server is not
/// master; a fresh link whenever it became master again.
pub fn current_link<'a>(
    slot: &'a mut Option<(u64, ParentSync)>,
    node: &Node,
    parents: &[String],
    now: Time,
    seed: Option<u64>,
) -> Option<&'a mut ParentSync> {
    if !node.mastership().is_master {
        if slot.take().is_some() {
            tracing::info!("no longer master: the parent link stops; the new master takes over this node's lease");
        }
        return None;
    }
    let epoch = node.store.master_epoch();
    if slot.as_ref().is_none_or(|(e, _)| *e != epoch) {
        *slot = Some((epoch, ParentSync::new(&node.node_id, epoch, parents.to_vec(), now, seed)));
    }
    slot.as_mut().map(|(_, s)| s)
}

/// Polls the parent until `shutdown`, then releases what this server holds.
pub(crate) async fn run(
    node: Arc<Node>,
    link: Arc<ParentLink>,
    parents: Vec<String>,
    transport: Arc<dyn Transport>,
    clock: Clock,
    shutdown: CancellationToken,
) {
    let mut slot = None;
    let mut failing = usher_lease::failing::Failing::new("the parent answers again");
    loop {
        let Some(sync) = current_link(&mut slot, &node, &parents, clock.now(), None) else {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            continue;
        };
        let action = sync.next_action(&node, clock.now());
        *link.status.lock().expect("parent status poisoned") = sync.status(&parents);
        match action {
            ParentAction::Wait(until) => {
                let d = until.since(clock.now()).min(Duration::from_millis(100));
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(d) => {}
                }
            }
            ParentAction::Discover(target) => {
                let r = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = transport.discovery(&target) => r,
                };
                failing.saw(&target, "parent discovery failed", r.as_ref().err());
                sync.on_discovery(clock.now(), &target, r);
            }
            ParentAction::Release(target, request) => {
                let r = batch::release_capacity(&*transport, &target, request).await;
                sync.on_release(clock.now(), r);
            }
            ParentAction::Refresh(target, req) => {
                let r = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = batch::get_server_capacity(&*transport, &target, req) => r,
                };
                failing.saw(&target, "refresh from parent failed", r.as_ref().err());
                sync.on_refresh(&node, clock.now(), r);
            }
        }
    }
    if let Some((target, req)) =
        current_link(&mut slot, &node, &parents, clock.now(), None).and_then(|s| s.release_all())
    {
        let _ = tokio::time::timeout(Duration::from_secs(2), batch::release_capacity(&*transport, &target, req)).await;
    }
}

/// The lease client's request as the server protocol's: every resource's
/// demand in the bands the store reported, and as `has` the larger of the
/// parent's grant and what this server has handed out.
fn server_request(
    req: &proto::GetCapacityRequest,
    demand: &HashMap<String, (Vec<Band>, f64)>,
    now: Time,
) -> proto::GetServerCapacityRequest {
    let resource = req
        .resource
        .iter()
        .map(|r| {
            let (bands, handed_out) = demand.get(&r.resource_id).cloned().unwrap_or_default();
            let held = r.has.as_ref().map_or(0.0, |h| h.capacity).max(handed_out);
            let has = (held > 0.0).then(|| proto::Lease {
                expiry_time: r.has.as_ref().map_or(now.as_secs(), |h| h.expiry_time),
                refresh_interval: r.has.as_ref().map_or(1, |h| h.refresh_interval),
                capacity: held,
            });
            let wants = if bands.is_empty() {
                vec![proto::PriorityBandAggregate { priority: r.priority, num_clients: 1, wants: r.wants }]
            } else {
                bands
                    .iter()
                    .map(|b| proto::PriorityBandAggregate {
                        priority: b.priority,
                        num_clients: b.num_clients.max(1),
                        wants: b.wants,
                    })
                    .collect()
            };
            proto::ServerCapacityResourceRequest {
                upstream_quota: r.upstream_quota,
                resource_id: r.resource_id.clone(),
                has,
                wants,
            }
        })
        .collect();
    proto::GetServerCapacityRequest { server_id: req.client_id.clone(), resource }
}

/// A server protocol answer as the lease client reads it.
fn client_response(resp: proto::GetServerCapacityResponse) -> proto::GetCapacityResponse {
    proto::GetCapacityResponse {
        response: resp
            .response
            .into_iter()
            .map(|r| proto::ResourceResponse {
                pooled: None,
                bucket: None,
                allotment: None,
                credit: None,
                resource_capacity: r.resource_capacity,
                spare: r.spare,
                share_safe: None,
                fresh: None,
                upstream_quota: r.upstream_quota,
                resource_id: r.resource_id,
                gets: r.gets,
                safe_capacity: r.safe_capacity,
                template: r.template,
            })
            .collect(),
        mastership: resp.mastership,
    }
}

#[cfg(test)]
mod tests;
