//! The `doorman.Capacity` gRPC service: validates requests, asks the store,
//! and answers in Doorman's wire format. A server that is not the master
//! answers the capacity RPCs with only a mastership redirect.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use super::Node;
use super::calendar::Account;
use super::store::{Band, BucketReport, Grant, LeaseRequest, PREDECESSOR_PARAMETER, Requester, split_identity};
use usher_core::clock::Time;
use usher_proto as proto;
use usher_proto::capacity_server::Capacity;

/// Longest a request is held when its answer would send a newcomer away
/// empty-handed, so that it can be answered as soon as that changes:
/// - a capacity request from a requester that holds no lease, wants some and
///   gets 0 (an intermediate with no lease from its parent yet, or a
///   first-come client holding the whole share) is decided again as soon as
///   capacity is freed (the parent's lease arrives or grows, a client comes
///   down or leaves);
/// - any request to a server that knows no master yet (its election is under
///   way) is answered once a master is known.
///
/// A fresh tree's sidecars so get a share in the answer to their first
/// request, instead of a lease of 0 or "no master" and another round trip a
/// second or two later. A second and a half covers an intermediate's next
/// request to its parent and a first-come client's next refresh (each at
/// most a second after the first); never more than half the caller's own
/// deadline.
pub const NEWCOMER_WAIT: std::time::Duration = std::time::Duration::from_millis(1500);

/// The tonic service; cheap to clone, all state lives in the shared [`Node`].
#[derive(Clone)]
pub struct CapacityService {
    node: Arc<Node>,
    newcomer_wait: std::time::Duration,
}

impl CapacityService {
    /// The service answering for `node`.
    pub fn new(node: Arc<Node>) -> Self {
        CapacityService { node, newcomer_wait: NEWCOMER_WAIT }
    }

    /// Never holds an answer (see [`NEWCOMER_WAIT`]): for callers in virtual
    /// time (the simulator), where nothing can change while a call waits.
    pub fn without_newcomer_wait(self) -> Self {
        CapacityService { newcomer_wait: std::time::Duration::ZERO, ..self }
    }

    /// The service as tonic serves it, accepting requests of up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> proto::capacity_server::CapacityServer<Self> {
        proto::capacity_server::CapacityServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Runs `f`, recording the RPC's count, errors and duration.
    fn observe<T>(&self, method: &str, f: impl FnOnce() -> Result<T, Status>) -> Result<Response<T>, Status> {
        let start = rpc_start();
        let out = f();
        self.record(method, start, out)
    }

    /// As [`observe`](Self::observe) for a request that may be held.
    /// `f(again)` answers and says whether the answer sends a newcomer away
    /// empty-handed; then, within the wait allowed ([`NEWCOMER_WAIT`]), it is
    /// answered once more (`again`) whenever that may have changed.
    async fn observe_newcomers<T>(
        &self,
        method: &str,
        deadline: Option<std::time::Duration>,
        f: impl Fn(bool) -> Result<(T, bool), Status>,
    ) -> Result<Response<T>, Status> {
        let start = rpc_start();
        let wait = deadline.map_or(self.newcomer_wait, |d| self.newcomer_wait.min(d / 2));
        // One deadline for the whole call: every round waits for what is left of it.
        #[allow(clippy::disallowed_methods, reason = "timeout_at takes its deadline in tokio's time")]
        let until = tokio::time::Instant::now() + wait;
        let mut again = false;
        let out = loop {
            let changed = self.node.store.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let out = f(again);
            if !matches!(out, Ok((_, true))) || wait.is_zero() || tokio::time::timeout_at(until, changed).await.is_err()
            {
                break out;
            }
            again = true;
        };
        self.record(method, start, out.map(|(t, _)| t))
    }

    /// Counts the RPC `method` that started at `start`, and its error if it failed.
    fn record<T>(&self, method: &str, start: Instant, out: Result<T, Status>) -> Result<Response<T>, Status> {
        let m = &self.node.metrics;
        m.rpc.requests.with_label_values(&[method]).inc();
        m.rpc.duration.with_label_values(&[method]).observe(start.elapsed().as_secs_f64());
        if let Err(s) = &out {
            m.rpc.errors.with_label_values(&[method, code_name(s.code())]).inc();
            tracing::debug!(method, code = ?s.code(), message = s.message(), "rejected request");
        }
        out.map(Response::new)
    }

    /// Decides `ask` for `client`; `again` when it was decided before in this call.
    fn decide(&self, client: &str, ask: &LeaseRequest, again: bool) -> Grant {
        if again { self.node.store.decide_again(client, ask) } else { self.node.store.get_capacity(client, ask) }
    }

    /// Refuses a request that would grow the store past its limits.
    fn within_limits(&self, client: &str, asks: &[LeaseRequest]) -> Result<(), Status> {
        self.node
            .store
            .check_limits(client, asks.iter().map(|a| a.resource_id.as_str()))
            .map_err(|e| Status::resource_exhausted(e.to_string()))
    }

    /// `Some(mastership)` when this server must redirect instead of answering.
    fn redirect(&self) -> Option<proto::Mastership> {
        let m = self.node.mastership();
        (!m.is_master).then(|| proto::Mastership { master_address: m.master_address.clone() })
    }
}

/// When an RPC started, for its duration in `usher_server_rpc_duration_seconds`.
#[allow(
    clippy::disallowed_methods,
    reason = "the RPC duration histogram measures real time spent answering, whatever clock the store runs on"
)]
fn rpc_start() -> Instant {
    Instant::now()
}

/// Whether `g` hands nothing to a requester that holds no lease and wants some.
fn starves_a_newcomer(ask: &LeaseRequest, g: &Grant) -> bool {
    ask.reported_has.is_none() && ask.wants > 0.0 && g.capacity <= 0.0
}

/// The caller's deadline from its `grpc-timeout` header (an integer of at
/// most 8 digits and a unit: H, M, S, m, u or n), if it sent a valid one.
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let v = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => std::time::Duration::from_secs(n * 3600),
        "M" => std::time::Duration::from_secs(n * 60),
        "S" => std::time::Duration::from_secs(n),
        "m" => std::time::Duration::from_millis(n),
        "u" => std::time::Duration::from_micros(n),
        "n" => std::time::Duration::from_nanos(n),
        _ => return None,
    })
}

/// The gRPC code as the error metric labels it.
fn code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::InvalidArgument => "InvalidArgument",
        tonic::Code::ResourceExhausted => "ResourceExhausted",
        tonic::Code::Unavailable => "Unavailable",
        _ => "Other",
    }
}

/// The lease `g` grants, as the wire carries it.
fn wire_lease(g: &Grant) -> proto::Lease {
    proto::Lease {
        expiry_time: g.expiry.as_secs(),
        refresh_interval: g.refresh_interval.as_secs() as i64,
        capacity: g.capacity,
    }
}

/// The algorithm `a`, as the wire carries it.
pub(crate) fn wire_algorithm(a: &usher_core::config::resources::Algorithm) -> proto::Algorithm {
    let kind = match a.kind {
        usher_core::config::resources::Kind::NoAlgorithm => proto::algorithm::Kind::NoAlgorithm,
        usher_core::config::resources::Kind::Static => proto::algorithm::Kind::Static,
        usher_core::config::resources::Kind::ProportionalShare => proto::algorithm::Kind::ProportionalShare,
        usher_core::config::resources::Kind::FairShare => proto::algorithm::Kind::FairShare,
    };
    proto::Algorithm {
        kind: kind as i32,
        lease_length: a.lease_length.as_secs() as i64,
        refresh_interval: a.refresh_interval.as_secs() as i64,
        parameters: a
            .parameters
            .iter()
            .map(|(n, v)| proto::NamedParameter { name: n.clone(), value: v.clone() })
            .collect(),
        learning_mode_duration: Some(a.learning_mode_duration.as_secs() as i64),
    }
}

// === validation ===

/// An `InvalidArgument` status saying `msg`.
fn invalid(msg: String) -> Status {
    Status::invalid_argument(msg)
}

/// Longest accepted client, server or resource id, in bytes: the sidecar's
/// limit on the ids it makes, so one it sends is never refused.
pub const MAX_ID_BYTES: usize = usher_core::config::MAX_ID_BYTES;
/// Most resources accepted in one request.
pub const MAX_RESOURCES_PER_REQUEST: usize = 10_000;
/// Most priority bands accepted for one resource.
pub const MAX_BANDS: usize = 1000;
/// Largest accepted request message.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Checks that the id in `field` is neither empty nor too long.
fn check_id(field: &str, id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(invalid(format!("{field} must not be empty")));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(invalid(format!("{field} is {} bytes long; at most {MAX_ID_BYTES} are accepted", id.len())));
    }
    Ok(())
}

/// Checks that a request has no more than `max` of `what`.
fn check_count(what: &str, n: usize, max: usize) -> Result<(), Status> {
    if n > max {
        return Err(invalid(format!("{n} {what} in one request; at most {max} are accepted")));
    }
    Ok(())
}

/// Checks that the amount in `field` is finite and not negative.
fn check_amount(field: &str, v: f64) -> Result<(), Status> {
    if !v.is_finite() || v < 0.0 {
        return Err(invalid(format!("{field} must be a finite number >= 0, got {v}")));
    }
    Ok(())
}

/// A reported window: a finite number of seconds above 0 (usher's extension).
fn check_window(field: &str, w: Option<f64>) -> Result<Option<f64>, Status> {
    match w {
        Some(v) if !v.is_finite() || v <= 0.0 => {
            Err(invalid(format!("{field} must be a finite number of seconds > 0, got {v}")))
        }
        w => Ok(w),
    }
}

/// What a client says of its bucket (usher's extensions), each amount
/// checked as every amount is.
fn check_bucket(field: &str, r: &proto::ResourceRequest) -> Result<BucketReport, Status> {
    let amount = |name: &str, v: Option<f64>| match v {
        Some(v) => check_amount(&format!("{field}.{name}"), v).map(|()| Some(v)),
        None => Ok(None),
    };
    Ok(BucketReport {
        reserve: amount("reserve", r.reserve)?,
        returned: amount("returned", r.returned)?.unwrap_or(0.0),
        backlog: amount("backlog", r.backlog)?.unwrap_or(0.0),
    })
}

/// The reported lease's capacity and expiry.
fn check_has(field: &str, has: &Option<proto::Lease>) -> Result<(Option<f64>, Option<Time>), Status> {
    match has {
        None => Ok((None, None)),
        Some(l) => {
            check_amount(&format!("{field}.capacity"), l.capacity)?;
            Ok((Some(l.capacity), Some(Time::from_secs(l.expiry_time.max(0) as u64))))
        }
    }
}

/// A client's account of a calendar unit (an usher extension), checked as
/// every amount is.
fn check_account(field: &str, a: &Option<proto::UnitAccount>) -> Result<Option<Account>, Status> {
    let Some(a) = a else { return Ok(None) };
    check_amount(&format!("{field}.spent"), a.spent)?;
    check_amount(&format!("{field}.left"), a.left)?;
    if a.reset_unix_ms <= 0 {
        return Err(invalid(format!("{field}.reset_unix_ms must be a time after the epoch, got {}", a.reset_unix_ms)));
    }
    let reset = Time::from_nanos((a.reset_unix_ms as u64).saturating_mul(1_000_000));
    if let Some(c) = a.charged {
        check_amount(&format!("{field}.charged"), c)?;
    }
    Ok(Some(Account { reset, spent: a.spent, left: a.left, passed: a.passed.unwrap_or(false), charged: a.charged }))
}

/// Checks that resource `id` appears once in a request.
fn check_unique<'a>(seen: &mut HashSet<&'a str>, field: &str, id: &'a str) -> Result<(), Status> {
    if !seen.insert(id) {
        return Err(invalid(format!("{field}: resource `{id}` appears more than once in one request")));
    }
    Ok(())
}

/// Validates a whole GetCapacity request before anything is stored.
pub fn client_requests(req: &proto::GetCapacityRequest) -> Result<Vec<LeaseRequest>, Status> {
    check_id("client_id", &req.client_id)?;
    check_count("resources", req.resource.len(), MAX_RESOURCES_PER_REQUEST)?;
    let mut seen = HashSet::new();
    req.resource
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let f = format!("resource[{i}]");
            check_id(&format!("{f}.resource_id"), &r.resource_id)?;
            check_unique(&mut seen, &f, &r.resource_id)?;
            check_amount(&format!("{f}.wants"), r.wants)?;
            let (reported_has, reported_expiry) = check_has(&format!("{f}.has"), &r.has)?;
            Ok(LeaseRequest {
                resource_id: r.resource_id.clone(),
                wants: r.wants,
                subclients: 1,
                reported_has,
                reported_expiry,
                requester: Requester::Client { priority: r.priority },
                quota: r.upstream_quota.as_ref().and_then(usher_lease::quota::from_proto),
                account: check_account(&format!("{f}.unit_account"), &r.unit_account)?,
                window: check_window(&format!("{f}.window"), r.window)?,
                bucket: check_bucket(&f, r)?,
            })
        })
        .collect()
}

/// Validates a whole GetServerCapacity request before anything is stored.
pub fn server_requests(req: &proto::GetServerCapacityRequest) -> Result<Vec<LeaseRequest>, Status> {
    check_id("server_id", &req.server_id)?;
    check_count("resources", req.resource.len(), MAX_RESOURCES_PER_REQUEST)?;
    let mut seen = HashSet::new();
    req.resource
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let f = format!("resource[{i}]");
            check_id(&format!("{f}.resource_id"), &r.resource_id)?;
            check_unique(&mut seen, &f, &r.resource_id)?;
            let (reported_has, reported_expiry) = check_has(&format!("{f}.has"), &r.has)?;
            check_count(&format!("priority bands for {f}"), r.wants.len(), MAX_BANDS)?;
            let mut wants = 0.0;
            let mut subclients: u64 = 0;
            let mut bands = Vec::with_capacity(r.wants.len());
            for (j, b) in r.wants.iter().enumerate() {
                let bf = format!("{f}.wants[{j}]");
                if b.num_clients < 1 {
                    return Err(invalid(format!("{bf}.num_clients must be at least 1, got {}", b.num_clients)));
                }
                check_amount(&format!("{bf}.wants"), b.wants)?;
                wants += b.wants;
                subclients = subclients.saturating_add(b.num_clients as u64);
                bands.push(Band { priority: b.priority, num_clients: b.num_clients, wants: b.wants });
            }
            check_amount(&format!("{f}.wants"), wants)?;
            Ok(LeaseRequest {
                resource_id: r.resource_id.clone(),
                wants,
                // A server with no band yet still counts as one subclient.
                subclients: subclients.max(1),
                reported_has,
                reported_expiry,
                requester: Requester::Server { bands },
                quota: r.upstream_quota.as_ref().and_then(usher_lease::quota::from_proto),
                account: None,
                window: None,
                bucket: Default::default(),
            })
        })
        .collect()
}

#[tonic::async_trait]
impl Capacity for CapacityService {
    async fn discovery(
        &self,
        req: Request<proto::DiscoveryRequest>,
    ) -> Result<Response<proto::DiscoveryResponse>, Status> {
        self.observe_newcomers("Discovery", grpc_timeout(req.metadata()), |_| {
            let m = self.node.mastership();
            let unknown = m.master_address.is_none();
            Ok((
                proto::DiscoveryResponse {
                    mastership: proto::Mastership { master_address: m.master_address.clone() },
                    is_master: m.is_master,
                },
                unknown,
            ))
        })
        .await
    }

    async fn get_capacity(
        &self,
        req: Request<proto::GetCapacityRequest>,
    ) -> Result<Response<proto::GetCapacityResponse>, Status> {
        let deadline = grpc_timeout(req.metadata());
        let req = req.into_inner();
        self.observe_newcomers("GetCapacity", deadline, |again| {
            if let Some(m) = self.redirect() {
                let unknown = m.master_address.is_none();
                return Ok((proto::GetCapacityResponse { response: vec![], mastership: Some(m) }, unknown));
            }
            let asks = client_requests(&req)?;
            self.within_limits(&req.client_id, &asks)?;
            let mut starved = false;
            let response = asks
                .iter()
                .map(|a| {
                    let g = self.decide(&req.client_id, a, again);
                    starved |= starves_a_newcomer(a, &g);
                    proto::ResourceResponse {
                        allotment: g.allotment,
                        resource_capacity: g.resource_capacity,
                        spare: (g.spare > 0.0).then_some(g.spare),
                        share_safe: g.share_safe.then_some(true),
                        fresh: g.fresh.then_some(true),
                        credit: (g.credit > 0.0).then_some(g.credit),
                        bucket: (g.bucket > 0.0).then_some(g.bucket),
                        pooled: (g.bucket > 0.0).then_some(g.pooled),
                        upstream_quota: g.quota.as_ref().map(usher_lease::quota::to_proto),
                        resource_id: a.resource_id.clone(),
                        gets: wire_lease(&g),
                        safe_capacity: Some(g.safe_capacity),
                        template: Some(g.template),
                    }
                })
                .collect();
            Ok((proto::GetCapacityResponse { response, mastership: None }, starved))
        })
        .await
    }

    async fn get_server_capacity(
        &self,
        req: Request<proto::GetServerCapacityRequest>,
    ) -> Result<Response<proto::GetServerCapacityResponse>, Status> {
        let deadline = grpc_timeout(req.metadata());
        let req = req.into_inner();
        self.observe_newcomers("GetServerCapacity", deadline, |again| {
            if let Some(m) = self.redirect() {
                let unknown = m.master_address.is_none();
                return Ok((proto::GetServerCapacityResponse { response: vec![], mastership: Some(m) }, unknown));
            }
            let asks = server_requests(&req)?;
            // A lower server's bands weigh as many clients as they say: no
            // more than one resource may have here (else one request could
            // claim 2^63 clients and leave every other client ~nothing).
            let max = self.node.store.max_clients_per_resource() as u64;
            if let Some((i, a)) = asks.iter().enumerate().find(|(_, a)| a.subclients > max) {
                return Err(invalid(format!(
                    "resource[{i}]: its bands count {} clients; a resource here has at most {max} \
                     (the server's --max-clients-per-resource)",
                    a.subclients
                )));
            }
            self.within_limits(split_identity(&req.server_id).0, &asks)?;
            let mut starved = false;
            let response = asks
                .iter()
                .map(|a| {
                    let g = self.decide(&req.server_id, a, again);
                    starved |= starves_a_newcomer(a, &g);
                    let mut algorithm = wire_algorithm(&g.algorithm);
                    if let Some(n) = g.predecessor_subclients {
                        algorithm.parameters.push(proto::NamedParameter {
                            name: PREDECESSOR_PARAMETER.into(),
                            value: Some(n.to_string()),
                        });
                    }
                    proto::ServerCapacityResourceResponse {
                        resource_capacity: g.resource_capacity,
                        spare: (g.spare > 0.0).then_some(g.spare),
                        upstream_quota: g.quota.as_ref().map(usher_lease::quota::to_proto),
                        resource_id: a.resource_id.clone(),
                        gets: wire_lease(&g),
                        algorithm: Some(algorithm),
                        safe_capacity: Some(g.safe_capacity),
                        template: Some(g.template),
                    }
                })
                .collect();
            Ok((proto::GetServerCapacityResponse { response, mastership: None }, starved))
        })
        .await
    }

    async fn release_capacity(
        &self,
        req: Request<proto::ReleaseCapacityRequest>,
    ) -> Result<Response<proto::ReleaseCapacityResponse>, Status> {
        let req = req.into_inner();
        self.observe("ReleaseCapacity", || {
            if let Some(m) = self.redirect() {
                return Ok(proto::ReleaseCapacityResponse { mastership: Some(m) });
            }
            check_id("client_id", &req.client_id)?;
            for id in &req.resource_id {
                self.node.store.release(&req.client_id, id);
            }
            Ok(proto::ReleaseCapacityResponse { mastership: None })
        })
    }
}
