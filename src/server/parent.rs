//! An intermediate server's link to its parent: one `GetServerCapacity` per
//! refresh for every resource with demand, aggregated into priority bands.
//!
//! Scheduling, discovery, redirects, failover across the parent addresses and
//! backoff are the lease client's [`Core`]; this module only translates its
//! requests into the server protocol and hands each grant to the store.
//! `has` carries the larger of the parent's grant and what this server has
//! actually handed out, so a parent in learning mode after a failover hands
//! back what is in use instead of starving the subtree.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::Node;
use super::store::{Band, ParentLease};
use crate::clock::{Clock, Time};
use crate::config::resources::Algorithm;
use crate::lease::core::{Action, Core, CoreConfig, KeyDemand, OnExpiry};
use crate::lease::transport::Transport;
use crate::proto;

/// What status pages show of the link to the parent.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ParentStatus {
    pub servers: Vec<String>,
    pub master: Option<String>,
    pub last_error: Option<String>,
    pub refreshes: u64,
    pub next_refresh: i64,
}

/// The parent link's shared state, readable by status pages.
#[derive(Default)]
pub struct ParentLink {
    status: Mutex<ParentStatus>,
}

impl ParentLink {
    pub fn status(&self) -> ParentStatus {
        self.status.lock().expect("parent status poisoned").clone()
    }
}

fn algorithm_from_wire(a: &proto::Algorithm) -> Option<Algorithm> {
    use crate::algorithm::Kind;
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
        parameters: a.parameters.iter().map(|p| (p.name.clone(), p.value.clone())).collect(),
    })
}

/// Polls the parent until `shutdown`, then releases what this server holds.
pub async fn run(
    node: Arc<Node>,
    link: Arc<ParentLink>,
    parents: Vec<String>,
    transport: Arc<dyn Transport>,
    clock: Clock,
    shutdown: CancellationToken,
) {
    let mut cfg = CoreConfig::new(node.server_id.clone(), parents.clone());
    cfg.min_interval = Duration::from_secs(1);
    let mut core = Core::new(cfg, clock.now());
    let mut extras: HashMap<String, (Option<Algorithm>, Option<f64>)> = HashMap::new();
    loop {
        let now = clock.now();
        let demand = node.store.parent_demand();
        let by_id: HashMap<String, (Vec<Band>, f64)> =
            demand.iter().map(|d| (d.resource_id.clone(), (d.bands.clone(), d.handed_out))).collect();
        core.set_demand(
            demand
                .iter()
                .map(|d| KeyDemand {
                    resource_id: d.resource_id.clone(),
                    priority: 0,
                    wants: d.wants,
                    on_expiry: OnExpiry::Pessimistic,
                    safe_capacity: None,
                    pressure: false,
                })
                .collect(),
        );
        for t in core.take_transitions() {
            tracing::info!(resource = %t.resource_id, from = ?t.from, to = ?t.to, "lease from parent changed");
        }
        publish(&node, &core, &extras);
        *link.status.lock().expect("parent status poisoned") = ParentStatus {
            servers: parents.clone(),
            master: core.master().map(str::to_string),
            last_error: core.last_error().map(str::to_string),
            refreshes: core.refreshes(),
            next_refresh: core.next_refresh().as_secs(),
        };
        match core.next_action(now) {
            Action::Wait { until } => {
                let d = until.since(clock.now()).min(Duration::from_millis(100));
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(d) => {}
                }
            }
            Action::Discover { target } => {
                let r = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = transport.discovery(&target) => r,
                };
                if let Err(e) = &r {
                    tracing::warn!(parent = %target, error = ?e, "parent discovery failed");
                }
                core.on_discovery(clock.now(), &target, r);
            }
            Action::Release { target, request } => {
                let r = transport.release_capacity(&target, request).await;
                core.on_release(clock.now(), r);
            }
            Action::Refresh { target, request } => {
                let req = server_request(&request, &by_id, now);
                let r = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    r = transport.get_server_capacity(&target, req) => r,
                };
                if let Err(e) = &r {
                    tracing::warn!(parent = %target, error = ?e, "refresh from parent failed");
                }
                let r = r.map(|resp| {
                    for rr in &resp.response {
                        extras.insert(
                            rr.resource_id.clone(),
                            (rr.algorithm.as_ref().and_then(algorithm_from_wire), rr.safe_capacity),
                        );
                    }
                    client_response(resp)
                });
                core.on_refresh(clock.now(), r);
                publish(&node, &core, &extras);
            }
        }
    }
    if let Some((target, req)) = core.release_all() {
        let _ = tokio::time::timeout(Duration::from_secs(2), transport.release_capacity(&target, req)).await;
    }
}

/// Hands every lease from the parent to the store.
fn publish(node: &Node, core: &Core, extras: &HashMap<String, (Option<Algorithm>, Option<f64>)>) {
    for d in node.store.parent_demand() {
        let lease = core.lease_of(&d.resource_id).map(|l| {
            let (algorithm, safe_capacity) = extras.get(&d.resource_id).cloned().unwrap_or((None, None));
            ParentLease {
                capacity: l.capacity,
                expiry: l.expiry,
                refresh_interval: l.refresh_interval,
                algorithm,
                safe_capacity,
            }
        });
        node.store.set_parent_lease(&d.resource_id, lease);
    }
}

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
            proto::ServerCapacityResourceRequest { resource_id: r.resource_id.clone(), has, wants }
        })
        .collect();
    proto::GetServerCapacityRequest { server_id: req.client_id.clone(), resource }
}

fn client_response(resp: proto::GetServerCapacityResponse) -> proto::GetCapacityResponse {
    proto::GetCapacityResponse {
        response: resp
            .response
            .into_iter()
            .map(|r| proto::ResourceResponse {
                resource_id: r.resource_id,
                gets: r.gets,
                safe_capacity: r.safe_capacity,
            })
            .collect(),
        mastership: resp.mastership,
    }
}
