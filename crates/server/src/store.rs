//! The resource store: per resource, every client's lease, kept so that one
//! GetCapacity decision costs O(log n) in the number of clients.
//!
//! A resource is created from the first matching template the first time it
//! is asked for. Expired leases are dropped on every access and by a periodic
//! [`Store::sweep`], so status and metrics never count one; what a dropped
//! lease leaves behind is a *reservation* (see `Reservation`).
//!
//! Lower usher servers carry their node's identity and epoch in their server
//! id (`<node>#<epoch>`, see [`split_identity`]): the store keys them by node,
//! so a node's new master replaces its predecessor's entry instead of standing
//! beside it, and a stale master can no longer change or release it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::algorithm::{self, ClientSlot, DemandIndex, Kind};
use few::{Clients, Reservations};
use usher_core::clock::{Clock, Time};
use usher_core::config::resources::{Algorithm, CATCH_ALL, ResourcesConfig, Template};

/// One priority band of a lower server's demand.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Band {
    /// The band's priority; higher is served first under `priority_mode=strict`.
    pub priority: i64,
    /// The clients in the band (at least 1).
    pub num_clients: i64,
    /// What they want in total.
    pub wants: f64,
}

/// Who is asking: an end client, or a lower server speaking for its clients.
#[derive(Debug, Clone, PartialEq)]
pub enum Requester {
    /// An end client (`GetCapacity`).
    Client {
        /// Its priority.
        priority: i64,
    },
    /// A lower server (`GetServerCapacity`).
    Server {
        /// Its clients' demand, by priority.
        bands: Vec<Band>,
    },
}

/// One resource's part of a capacity request, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRequest {
    /// The resource asked for.
    pub resource_id: String,
    /// What the requester wants, in capacity units (finite, >= 0).
    pub wants: f64,
    /// The end clients it speaks for: 1 for a client, a lower server's sum over its bands.
    pub subclients: u64,
    /// The capacity the requester says it holds (its `has` lease).
    pub reported_has: Option<f64>,
    /// When that lease expires.
    pub reported_expiry: Option<Time>,
    /// Who asks.
    pub requester: Requester,
    /// What the requester last read of the upstream's own quota.
    pub quota: Option<usher_lease::quota::Observation>,
    /// The client's account of a calendar quota's current unit (usher's extension).
    pub account: Option<crate::calendar::Account>,
    /// Seconds of its leased rate the client's bucket holds (usher's
    /// extension; finite, > 0): the root pools the burst of the capacity
    /// nobody holds by it (see `pool`).
    pub window: Option<f64>,
    /// What the client says of its bucket (usher's extensions).
    pub bucket: BucketReport,
}

/// A client's bucket below its share of the burst (see `pool`), as its lease keeps it.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Units (0: no such bucket).
    size: f32,
    /// Its share of the burst minus `size`, counted in the pool's size.
    saving: f32,
}

/// What an usher client says of its bucket with a request, for the pooled
/// burst (see `pool`): every amount finite and >= 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BucketReport {
    /// Units it keeps at hand when it asks; `None`: it gives nothing back,
    /// and its bucket is its lease's share of the burst.
    pub reserve: Option<f64>,
    /// Units it took out of its bucket for the pool as it asked.
    pub returned: f64,
    /// Units of requests waiting at it now.
    pub backlog: f64,
}

/// The separator between a node's identity and its master's epoch in the
/// server id an usher intermediate sends its parent: `zone-a#1700000000123456`.
pub const EPOCH_SEPARATOR: char = '#';

/// Splits a requester id into the key the store files it under and the
/// epoch of the master speaking for that node, if the id carries one (only
/// ids ending in `#` and digits do; any other id is its own key).
pub fn split_identity(id: &str) -> (&str, Option<u64>) {
    match id.rsplit_once(EPOCH_SEPARATOR) {
        Some((node, e)) if !node.is_empty() && !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
            match e.parse() {
                Ok(epoch) => (node, Some(epoch)),
                Err(_) => (id, None),
            }
        }
        _ => (id, None),
    }
}

/// The name of the algorithm parameter with which a parent tells a lower
/// usher server's new master how many subclients its predecessor spoke for
/// (0: none of the predecessor's leases is still valid). A real Doorman
/// server ignores parameters it does not know.
pub const PREDECESSOR_PARAMETER: &str = "usher.predecessor_subclients";

/// How long after a server becomes master its clients have all been heard
/// from, beyond the refresh interval it hands out (× 7/6 for client jitter):
/// clients cut off from the old master retry within the lease client's
/// backoff cap, plus one discovery.
pub const RECONNECT_ALLOWANCE: Duration = Duration::from_secs(3);

/// How long past a lapsed lease's hold (at least a lease length) the server
/// keeps reserving a client's default safe capacity (its share, see
/// `Resource::share_safe`). A client cut off from the tree runs on it for
/// as long as it stays cut off: one that comes back later than this may have
/// used it beside what was handed to others. A client gone for good (killed
/// without releasing; a restart under a new id) keeps it from the others
/// this long: longer would cost them more, shorter would cover less.
pub const SHARE_KEPT: Duration = Duration::from_secs(30);

/// The refresh interval of a lease whose client should come back soon: its
/// grant was cut to what others leave unused, or the resource is new.
pub const FAST_REFRESH: Duration = Duration::from_secs(1);
/// A grant this much below the client's share counts as held back.
pub const HELD_BACK_MARGIN: f64 = 0.03;

/// The answer for one resource.
#[derive(Debug, Clone)]
pub struct Grant {
    /// The capacity granted.
    pub capacity: f64,
    /// When the lease expires.
    pub expiry: Time,
    /// When the requester should ask again.
    pub refresh_interval: Duration,
    /// What the requester may use once its lease lapses (< 0: unlimited).
    pub safe_capacity: f64,
    /// The algorithm in force, to hand down to a lower server.
    pub algorithm: Algorithm,
    /// The `identifier_glob` of the template the resource matched (at an
    /// intermediate whose own is the catch-all: the parent's, once known).
    pub template: String,
    /// For a lower usher server's master: how many subclients its
    /// predecessor spoke for (see [`PREDECESSOR_PARAMETER`]); `None` while
    /// this server cannot know (in learning mode itself).
    pub predecessor_subclients: Option<u64>,
    /// The upstream's quota as this server knows it, when its clients report one.
    pub quota: Option<usher_lease::quota::Observation>,
    /// The capacity a root shares for the resource now (clients size their
    /// share of its burst by it); `None` elsewhere.
    pub resource_capacity: Option<f64>,
    /// The part of `capacity` that is spare: capacity nobody wants now,
    /// handed out beyond the client's wants (see [`SPARE_PARAMETER`]).
    pub spare: f64,
    /// `safe_capacity` is the client's share of the resource (none is
    /// configured): it may be above the client's lease.
    pub share_safe: bool,
    /// The first grant above 0 to a client this server held no lease and no
    /// reservation for when it first asked, outside learning mode: nobody's
    /// bucket holds the share of the burst this lease brings (see the
    /// proto's `fresh`).
    pub fresh: bool,
    /// A calendar quota's allotment: units the client may spend from now
    /// until the unit's reset (`capacity` is the same as a rate).
    pub allotment: Option<f64>,
    /// Units of the pooled burst moved into the client's bucket, for a lease
    /// that grew out of free capacity or a backlog reported (see `pool`); 0
    /// for most answers.
    pub credit: f64,
    /// The most the client's bucket may hold until its next request, below
    /// its lease's share of the burst (see `pool`); 0: no such limit.
    pub bucket: f64,
    /// With a bucket: units the pool holds once this answer is given.
    pub pooled: f64,
}

/// The algorithm parameter that says what a resource does with capacity
/// nobody wants: `share` hands it out beside the grants (FAIR_SHARE's
/// default), `keep` hands out no more than is wanted (the default of the
/// other algorithms, and Doorman's behaviour).
pub const SPARE_PARAMETER: &str = "spare";

/// A resource new to a server counts as still meeting its clients for at
/// least this long (see `Resource::arriving`): long enough for sidecars
/// started together to measure their demand and ask again (half a second of
/// traffic, and the lease client's minimum interval of a second), also
/// where the refresh interval is a second.
pub const ARRIVALS: Duration = Duration::from_secs(5);

/// While a new resource's clients are still arriving, spare capacity goes
/// out as if this many more subclients were about to ask for their share.
const ARRIVING_MORE: f64 = 2.0;

/// A lease that carries spare capacity is refreshed at least this often:
/// when a client's demand rises beyond what is free, the others give their
/// spare back within this long, not a whole refresh interval later.
pub const SPARE_REFRESH: Duration = Duration::from_secs(3);

/// Spare capacity is handed out as if this many more subclients wanted a
/// share of it: that share stays free, so that a client whose demand rises,
/// or a new one, finds some at once rather than a refresh interval later.
pub const SPARE_KEPT_FREE: f64 = 1.0;

/// Where a resource pools the burst of the capacity nobody holds (see
/// `pool`), at least this part of the spare capacity stays free, so that the
/// pool holds something to credit a client whose demand rises (with three
/// clients or fewer, [`SPARE_KEPT_FREE`] keeps as much already). Measured
/// on the LLM fleet's three replicas (tests/llm_fleet, underload): p95
/// 0.13 s with a quarter, 1.7 s with half, 3.0 s with three quarters: what
/// stays in the buckets passes at once, what is pooled only on an ask.
pub const POOLED_SPARE: f64 = 0.25;

/// How a request is decided (see [`Resource::decide`]).
#[derive(Debug, Clone, Copy)]
struct Decision {
    /// Learning mode: hand back what the client holds.
    learning: bool,
    /// A request sooner than this after the client's last gets its lease back unchanged.
    min_interval: Duration,
    /// The same request decided again after its answer was held ([`Store::decide_again`]).
    again: bool,
    /// Other clients may come (a resource may have more than one): a new
    /// resource's leases carry a fast refresh during its first interval.
    arrivals: bool,
}

/// One request for one resource, as the steps of [`Resource::decide`] read it.
struct Ask<'a> {
    req: &'a LeaseRequest,
    /// The client's key: a lower server's node id, without its epoch.
    client: &'a str,
    /// The epoch of the master speaking for a lower usher node.
    epoch: Option<u64>,
    now: Time,
    role: Role,
    /// The algorithm in force.
    alg: Algorithm,
    /// The capacity to share now ([`Resource::capacity`]).
    capacity: Option<f64>,
    /// The request's demand per priority band ([`bands_of`]).
    bands: &'a [(i64, f64, u64)],
    d: Decision,
    /// This server held a lease or a reservation for the client before the request.
    known: bool,
}

/// What a node's new master inherits from its predecessor: the floor of
/// what the predecessor's clients may hold, until when, and how many
/// subclients it spoke for.
type Inherited = (f64, Time, u64);

/// A request from a master older than the one the store knows for its node.
struct Stale;

/// The client's state before the lease being decided (see [`Resource::refile`]).
struct Prior {
    slot: ClientSlot,
    /// What it was counted as holding.
    has: f64,
    /// It asks for more than before: its measured demand may be arriving.
    grew: bool,
    /// What it inherited as a floor, and until when ([`ClientLease::floor`]).
    floor: Option<(f64, Time)>,
    /// What this server tells a node's new master of its predecessor
    /// ([`ClientLease::predecessor_subclients`]).
    predecessor: Option<u64>,
}

/// What a new master knows of the leases its predecessor handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Predecessor {
    /// Nothing: it learns for as long as learning mode allows.
    Unknown,
    /// There was none (a fresh deployment): no learning mode.
    NoneOutstanding,
    /// None can still be valid or held, but clients whose holds ended may run
    /// on their safe capacity: learning mode lasts [`RECONNECT_ALLOWANCE`],
    /// while they reconnect (they retry within the lease client's backoff
    /// cap) and are each counted at that safe capacity.
    Lapsed,
    /// Some may be valid until then: learning mode ends then at the latest.
    Until(Time),
}

const NO_HORIZON: u64 = u64::MAX;

impl Predecessor {
    fn encode(self) -> u64 {
        match self {
            Predecessor::Unknown => u64::MAX,
            Predecessor::Lapsed => u64::MAX - 1,
            Predecessor::NoneOutstanding => 0,
            Predecessor::Until(t) => t.as_nanos().clamp(1, u64::MAX - 2),
        }
    }

    fn decode(v: u64) -> Self {
        match v {
            u64::MAX => Predecessor::Unknown,
            n if n == u64::MAX - 1 => Predecessor::Lapsed,
            0 => Predecessor::NoneOutstanding,
            n => Predecessor::Until(Time::from_nanos(n)),
        }
    }
}

/// Bounds that keep one server's memory finite whatever its clients send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most clients one resource may have (`--max-clients-per-resource`).
    pub max_clients_per_resource: usize,
    /// The most resources the store may track (`--max-resources`).
    pub max_resources: usize,
}

/// Default `--max-clients-per-resource`.
pub const DEFAULT_MAX_CLIENTS_PER_RESOURCE: usize = 100_000;
/// Default `--max-resources`.
pub const DEFAULT_MAX_RESOURCES: usize = 100_000;

impl Default for Limits {
    fn default() -> Self {
        Limits { max_clients_per_resource: DEFAULT_MAX_CLIENTS_PER_RESOURCE, max_resources: DEFAULT_MAX_RESOURCES }
    }
}

/// A request that would grow the store past its [`Limits`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitError {
    /// A new client of a resource that has as many as it may.
    #[error("resource `{resource}` already has {limit} clients (the server's --max-clients-per-resource)")]
    TooManyClients {
        /// The resource.
        resource: String,
        /// [`Limits::max_clients_per_resource`].
        limit: usize,
    },
    /// A new resource while the store tracks as many as it may.
    #[error("the server already tracks {limit} resources (its --max-resources)")]
    TooManyResources {
        /// [`Limits::max_resources`].
        limit: usize,
    },
}

/// Where a server sits in the tree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Role {
    /// Holds the configured capacity.
    Root,
    /// Leases its capacity from a parent; leases it hands down refresh
    /// `decay_factor` times as often as its own (never faster than every second).
    Intermediate {
        /// The factor, in (0, 1] (`--decay-factor`).
        decay_factor: f64,
    },
}

/// What an intermediate server holds from its parent for one resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentLease {
    /// The capacity granted.
    pub capacity: f64,
    /// When the lease expires.
    pub expiry: Time,
    /// When the parent wants to be asked again.
    pub refresh_interval: Duration,
    /// The parent's algorithm for the resource, which a catch-all template here adopts.
    pub algorithm: Option<Algorithm>,
    /// The parent's safe capacity for the resource, per subclient.
    pub safe_capacity: Option<f64>,
    /// The parent's template for the resource, if it says.
    pub template: Option<String>,
    /// What the parent said of this node's previous master (see [`PREDECESSOR_PARAMETER`]).
    pub predecessor_subclients: Option<u64>,
    /// The subclients this server reported in the request the lease answers.
    pub answered_subclients: Option<u64>,
    /// The capacity the root shares for the resource, if it said.
    pub resource_capacity: Option<f64>,
}

/// One resource's demand, as an intermediate server reports it to its parent.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentDemand {
    /// The resource.
    pub resource_id: String,
    /// What this server's clients want in total.
    pub wants: f64,
    /// The same demand by priority band.
    pub bands: Vec<Band>,
    /// What this server's clients hold now, in unexpired leases, plus what is
    /// reserved for clients whose leases lapsed.
    pub handed_out: f64,
    /// The freshest upstream quota its clients reported.
    pub quota: Option<usher_lease::quota::Observation>,
}

#[derive(Debug, Clone)]
struct ClientLease {
    slot: ClientSlot,
    /// `safe` is this end client's share of the resource (no safe capacity
    /// configured): counted in [`Resource::told`], reserved in full when the
    /// lease lapses (see [`Reservation`]).
    share: bool,
    /// What the last answer granted.
    granted: f64,
    /// What counts as outstanding: the grant, or for a lower server the
    /// larger of the grant and what it reports having handed out, until it
    /// reports less (this is what keeps a rebalancing tree from overshooting).
    has: f64,
    wants: f64,
    subclients: u64,
    requester: Requester,
    expiry: Time,
    refresh_interval: Duration,
    last_request: Time,
    /// What only a lower usher node's lease has (boxed: an end client's
    /// has none of it).
    lineage: Option<Box<Lineage>>,
    /// The safe capacity per subclient the last answer carried (< 0: unlimited).
    safe: f64,
    /// The part of `granted` that is spare (see [`Grant::spare`]).
    spare: f64,
    /// An answer told the client it was fresh (see [`Grant::fresh`]): its
    /// bucket was filled once, and never is again.
    filled: bool,
    /// The bucket the last answer gave it ([`Grant::bucket`]; 0: none).
    bucket: f32,
    /// Its share of the burst minus that bucket, counted in the pool's size.
    saving: f32,
}

/// The part of a lease only a lower usher node's master has.
#[derive(Debug, Clone, PartialEq)]
struct Lineage {
    /// The epoch of the master speaking for a lower usher node.
    epoch: Option<u64>,
    /// What a node's new master inherits from its predecessor: its `has`
    /// counts as at least this much until then, because the predecessor's
    /// leases to its clients run until then and the new master may not have
    /// heard of them all yet.
    floor: Option<(f64, Time)>,
    /// What the parent tells a new master of its predecessor.
    predecessor_subclients: Option<u64>,
}

impl Lineage {
    /// `None` when there is nothing to keep.
    fn boxed(epoch: Option<u64>, floor: Option<(f64, Time)>, predecessor_subclients: Option<u64>) -> Option<Box<Self>> {
        let l = Lineage { epoch, floor, predecessor_subclients };
        (l != Lineage { epoch: None, floor: None, predecessor_subclients: None }).then(|| Box::new(l))
    }
}

impl ClientLease {
    fn epoch(&self) -> Option<u64> {
        self.lineage.as_ref().and_then(|l| l.epoch)
    }

    fn floor(&self) -> Option<(f64, Time)> {
        self.lineage.as_ref().and_then(|l| l.floor)
    }

    fn predecessor_subclients(&self) -> Option<u64> {
        self.lineage.as_ref().and_then(|l| l.predecessor_subclients)
    }
}

/// What a lease leaves behind when it expires unrenewed: its client now holds
/// it for as long again as it was granted for (`lease::Mode::Held`), then
/// runs on its safe capacity (a configured one never more than its last
/// lease, see [`safe_for`]; by default its share, see
/// [`Resource::share_safe`], reserved from the lapse and for [`SHARE_KEPT`]
/// past the hold), or is gone. What the client may use stays counted as handed
/// out, so nobody else can be given what a client cut off from the tree goes
/// on using: the whole lease (a lower server's: at least what its clients
/// hold) while the client holds it, then its safe capacity, until one lease
/// length after the expiry.
///
/// Reserving the whole lease for the whole lease length instead held back
/// capacity nobody used: a new intermediate master's 2 s leases from before
/// its parent answered, lapsing, kept their whole amount counted (and
/// reported to the parent) for a full lease length, and the tree's other
/// clients were cut for seconds after a failover (tests/tree_failover.rs).
#[derive(Debug, Clone, PartialEq)]
struct Reservation {
    /// What is reserved now.
    amount: f64,
    /// Until when the whole lease is held; `then` is reserved after it.
    hold_until: Time,
    then: f64,
    until: Time,
    epoch: Option<u64>,
    /// Subclients that may still hold leases under it: a lower server's,
    /// released or lapsed, until `hold_until` (its subclients' leases end
    /// with its own, and they hold them as long as it holds its own).
    holders: u64,
    /// An end client's share (its safe capacity) and its subclients, kept
    /// counted in [`Resource::told`] while reserved; 0 for any other.
    told: f64,
    sharers: u64,
}

struct Resource {
    template: Arc<Template>,
    /// Boxed: most resources (all of a root's) never have one.
    parent: Option<Box<ParentLease>>,
    /// Demand per priority band (see [`bands`]), for `priority_mode=strict`
    /// and an intermediate's report to its parent; `None` until either asks
    /// for it (a root's non-strict resources never do), kept up to date from
    /// then on.
    by_priority: Option<BTreeMap<i64, DemandIndex>>,
    /// Inline while few (see `few`): most resources have one client.
    clients: Clients,
    index: DemandIndex,
    expiries: Expiries,
    reservations: Reservations,
    reserved: f64,
    /// What end clients with a lease were told as their share (their safe
    /// capacity); with `told_reserved`, never more than the capacity, so
    /// clients that all fall back on it at once stay within it.
    told: f64,
    /// What reservations keep of lapsed clients' shares, and their
    /// subclients (who count when a share is computed).
    told_reserved: f64,
    sharers: u64,
    /// Learning mode ended early: every expected client has reported, or
    /// nothing of a predecessor is outstanding.
    learned: bool,
    /// When learning mode ends, as last computed.
    learning_end: Option<Time>,
    /// When this master first saw the resource.
    created: Time,
    /// The upstream's own account of its quota, once a client reports one
    /// (boxed: most resources never have one).
    quota: Option<Box<super::quota::QuotaState>>,
    /// `window: calendar` at a root: what the fleet spent of the current
    /// unit. The index, the leases and the algorithms then count units of
    /// it, not units per second (see `allot`).
    calendar: Option<Box<crate::calendar::Calendar>>,
    /// The store's [`Predecessor`] and lease horizon, as of this request.
    predecessor: Predecessor,
    horizon: Option<Time>,
    /// The pooled burst of the capacity nobody holds, once a client
    /// reported its window (boxed: most resources never have one).
    pool: Option<Box<pool::Pool>>,
}

/// A resource's leases by expiry, soonest first: inline while there is one
/// (a tenant key's), a sorted vector while there are few (a tree's smallest
/// node holds room for eleven), a tree beyond.
#[derive(Debug)]
enum Expiries {
    One(Option<(Time, ClientSlot)>),
    Few(Vec<(Time, ClientSlot)>),
    Many(BTreeSet<(Time, ClientSlot)>),
}

/// Past this many leases a resource's expiries go in a tree.
const FEW_EXPIRIES: usize = 8;

impl Default for Expiries {
    fn default() -> Self {
        Expiries::One(None)
    }
}

impl Expiries {
    fn first(&self) -> Option<&(Time, ClientSlot)> {
        match self {
            Expiries::One(e) => e.as_ref(),
            Expiries::Few(v) => v.first(),
            Expiries::Many(set) => set.first(),
        }
    }

    fn insert(&mut self, e: (Time, ClientSlot)) {
        match self {
            Expiries::One(None) => *self = Expiries::One(Some(e)),
            Expiries::One(Some(x)) if *x == e => {}
            Expiries::One(Some(x)) => {
                let x = *x;
                let mut v = Vec::with_capacity(2);
                v.extend([x.min(e), x.max(e)]);
                *self = Expiries::Few(v);
            }
            Expiries::Few(v) if v.len() < FEW_EXPIRIES => {
                if let Err(i) = v.binary_search(&e) {
                    if v.len() == v.capacity() {
                        v.reserve_exact(1);
                    }
                    v.insert(i, e);
                }
            }
            Expiries::Few(v) => {
                let mut set: BTreeSet<_> = mem::take(v).into_iter().collect();
                set.insert(e);
                *self = Expiries::Many(set);
            }
            Expiries::Many(set) => {
                set.insert(e);
            }
        }
    }

    fn remove(&mut self, e: &(Time, ClientSlot)) {
        match self {
            Expiries::One(x) => {
                if x.as_ref() == Some(e) {
                    *x = None;
                }
            }
            Expiries::Few(v) => {
                if let Ok(i) = v.binary_search(e) {
                    v.remove(i);
                }
                if v.is_empty() {
                    *self = Expiries::One(None);
                }
            }
            Expiries::Many(set) => {
                set.remove(e);
            }
        }
    }
}

/// The capacity server's state.
pub struct Store {
    clock: Clock,
    config: ArcSwap<ResourcesConfig>,
    /// Each resource boxed on its own (a map's spare room is then a pointer
    /// wide), keyed by its id.
    resources: RwLock<HashMap<Box<str>, Box<Mutex<Resource>>>>,
    master_since: AtomicU64,
    /// What this master knows of its predecessor's leases ([`Predecessor`], encoded).
    predecessor: AtomicU64,
    /// No lease expires after this ([`Store::set_lease_horizon`]; `NO_HORIZON`: none).
    horizon: AtomicU64,
    min_request_interval: Duration,
    role: Role,
    limits: Limits,
    /// Woken when a held answer may come out differently (see [`Store::changed`]).
    changed: tokio::sync::Notify,
    catch_all: Mutex<CatchAll>,
}

/// The resource ids that fell to the catch-all `*` template while the
/// configuration names others: each is warned about and counted once (a
/// typo such as `github_core` for `github-core` silently got the catch-all's
/// capacity). Remembered up to [`CATCH_ALL_REMEMBERED`] ids; past that each
/// new resource is still counted, and warned about no more.
#[derive(Default)]
struct CatchAll {
    seen: std::collections::HashSet<String>,
    counter: Option<prometheus::IntCounter>,
}

/// How many catch-all resource ids the store remembers, to warn once each.
pub const CATCH_ALL_REMEMBERED: usize = 1000;

/// What status pages and metrics show of a resource.
#[derive(Debug, Clone, Serialize)]
pub struct ResourceStatus {
    /// The resource id.
    pub id: String,
    /// The `identifier_glob` of the template it matched.
    pub template: String,
    /// The algorithm's kind, as the configuration names it.
    pub algorithm: &'static str,
    /// The capacity shared now (0 at an intermediate without a lease from its parent).
    pub capacity: f64,
    /// What the unexpired leases count as held.
    pub sum_has: f64,
    /// What the clients want.
    pub sum_wants: f64,
    /// Clients with an unexpired lease.
    pub clients: usize,
    /// Of `clients`, how many are lower servers speaking for their own clients.
    pub server_clients: usize,
    /// The end clients all of them speak for.
    pub subclients: u64,
    /// Capacity kept for clients whose leases lapsed (they run on their safe capacity).
    pub reserved: f64,
    /// Learning mode: clients get back what they report holding.
    pub learning_mode: bool,
    /// Seconds left in learning mode.
    pub learning_left_s: f64,
    /// An intermediate server's lease from its parent.
    pub parent_capacity: Option<f64>,
    /// Seconds until that lease expires (0 once it has).
    pub parent_expires_in_s: Option<f64>,
    /// The quota the capacity follows: the upstream's own account, or a
    /// calendar window's.
    pub quota: Option<QuotaStatus>,
}

/// A quota the shared capacity follows, as status pages show it.
#[derive(Debug, Clone, Serialize)]
pub struct QuotaStatus {
    /// `upstream` (its clients read it from the upstream's answers) or
    /// `calendar` (`window: calendar`, counted by this server).
    pub source: &'static str,
    /// The quota per window.
    pub limit: f64,
    /// What is left of it.
    pub remaining: f64,
    /// Seconds until it renews.
    pub reset_in_s: f64,
}

impl ResourceStatus {
    /// Whether the configuration names this resource exactly (not through a glob).
    pub fn is_configured(&self) -> bool {
        self.template == self.id
    }
}

/// Orders resources for the views that show only the first few (`/metrics`,
/// `/debug/status`): resources the configuration names exactly come first,
/// then the busiest by the larger of sum has and sum wants, ties broken by id,
/// so one store always gives one order.
pub fn rank(resources: &mut [ResourceStatus]) {
    let weight = |r: &ResourceStatus| r.sum_has.max(r.sum_wants);
    resources.sort_by(|a, b| {
        b.is_configured()
            .cmp(&a.is_configured())
            .then_with(|| weight(b).total_cmp(&weight(a)))
            .then_with(|| a.id.cmp(&b.id))
    });
}

/// One client's lease, for `/debug/resources`.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    /// The client's id (a lower server's node, without its epoch).
    pub client_id: String,
    /// `client` or `server`.
    pub kind: &'static str,
    /// An end client's priority.
    pub priority: Option<i64>,
    /// A lower server's demand by priority band.
    pub bands: Vec<Band>,
    /// What the last answer granted.
    pub has: f64,
    /// What the client wants.
    pub wants: f64,
    /// The end clients it speaks for.
    pub subclients: u64,
    /// Seconds until the lease expires.
    pub expires_in_s: f64,
    /// The refresh interval the lease carries, in whole seconds.
    pub refresh_interval_s: u64,
}

impl Store {
    /// An empty store of a root server that has just become master, with
    /// nothing known of a predecessor: it learns as long as its configuration allows.
    pub fn new(clock: Clock, config: ResourcesConfig, min_request_interval: Duration) -> Self {
        let now = clock.now();
        Store {
            clock,
            config: ArcSwap::from_pointee(config),
            resources: RwLock::new(HashMap::new()),
            master_since: AtomicU64::new(now.as_nanos()),
            predecessor: AtomicU64::new(Predecessor::Unknown.encode()),
            horizon: AtomicU64::new(NO_HORIZON),
            min_request_interval,
            role: Role::Root,
            limits: Limits::default(),
            changed: tokio::sync::Notify::new(),
            catch_all: Mutex::new(CatchAll::default()),
        }
    }

    /// Counts the resources that fall to the catch-all in `counter`.
    pub fn set_catch_all_counter(&mut self, counter: prometheus::IntCounter) {
        self.catch_all.get_mut().expect("catch-all lock poisoned").counter = Some(counter);
    }

    /// Warns about and counts a new resource that only the catch-all matched.
    fn fell_to_catch_all(&self, id: &str, cfg: &ResourcesConfig, template: &Template) {
        if template.identifier_glob != CATCH_ALL || cfg.templates.len() < 2 {
            return;
        }
        let mut c = self.catch_all.lock().expect("catch-all lock poisoned");
        if c.seen.contains(id) {
            return;
        }
        if let Some(n) = &c.counter {
            n.inc();
        }
        match c.seen.len() {
            n if n < CATCH_ALL_REMEMBERED => {
                let named: Vec<&str> = cfg.templates.iter().map(|t| t.identifier_glob.as_str()).take(6).collect();
                tracing::warn!(
                    resource = %id,
                    capacity = template.capacity,
                    algorithm = template.algorithm.kind.name(),
                    "resource id matched no template but the catch-all `*` (a typo?); configured: {}",
                    named.join(", ")
                );
                c.seen.insert(id.to_string());
            }
            n if n == CATCH_ALL_REMEMBERED => {
                tracing::warn!(
                    "{CATCH_ALL_REMEMBERED} resource ids fell to the catch-all `*`: more are counted in usher_server_catch_all_resources_total, not logged"
                );
                c.seen.insert(String::new());
            }
            _ => {}
        }
    }

    /// Bounds what the store may grow to from now on.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// The most clients one resource may have (`--max-clients-per-resource`);
    /// a lower server's bands count towards it.
    pub fn max_clients_per_resource(&self) -> usize {
        self.limits.max_clients_per_resource
    }

    /// Checks that serving `client` on `resource_ids` stays within the limits.
    /// Checked before anything is stored, so a refused request changes nothing.
    pub fn check_limits<'a>(
        &self,
        client: &str,
        resource_ids: impl Iterator<Item = &'a str>,
    ) -> Result<(), LimitError> {
        let map = self.resources.read().expect("store lock poisoned");
        let mut new_resources = 0;
        for id in resource_ids {
            match map.get(id) {
                None => new_resources += 1,
                Some(res) => {
                    let r = res.lock().expect("resource lock poisoned");
                    if r.clients.len() >= self.limits.max_clients_per_resource && !r.clients.contains_key(client) {
                        return Err(LimitError::TooManyClients {
                            resource: id.to_string(),
                            limit: self.limits.max_clients_per_resource,
                        });
                    }
                }
            }
        }
        if new_resources > 0 && map.len() + new_resources > self.limits.max_resources {
            return Err(LimitError::TooManyResources { limit: self.limits.max_resources });
        }
        Ok(())
    }

    /// Makes this store an intermediate server's (or a root's).
    pub fn set_role(&mut self, role: Role) {
        self.role = role;
    }

    /// Where this server sits in the tree.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Records what the parent granted for a resource (`None`: nothing held).
    pub fn set_parent_lease(&self, resource_id: &str, lease: Option<ParentLease>) {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        if let Some(res) = map.get(resource_id) {
            let mut r = res.lock().expect("resource lock poisoned");
            let before = r.parent.as_ref().filter(|p| p.expiry > now).map_or(0.0, |p| p.capacity);
            let grew = lease.as_ref().is_some_and(|p| p.expiry > now && (r.parent.is_none() || p.capacity > before));
            r.parent = lease.map(Box::new);
            drop(r);
            if grew {
                self.wake();
            }
        }
    }

    /// Completes when a held answer may come out differently: a lease from
    /// the parent arrived or grew, a client came down or left, or a master
    /// became known ([`Store::wake`]). Create it (and `enable` it) before the
    /// request that depends on it, so a change in between is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Wakes every answer held on [`changed`](Self::changed).
    pub fn wake(&self) {
        self.changed.notify_waiters();
    }

    /// Every resource with demand, aggregated into priority bands, for the parent.
    pub fn parent_demand(&self) -> Vec<ParentDemand> {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut out: Vec<ParentDemand> = map
            .iter()
            .filter_map(|(id, res)| {
                let mut r = res.lock().expect("resource lock poisoned");
                r.expire(now);
                if r.clients.is_empty() && r.reserved <= 0.0 {
                    return None;
                }
                let bands = r
                    .by_priority()
                    .iter()
                    .filter(|(_, idx)| !idx.is_empty())
                    .map(|(p, idx)| Band {
                        priority: *p,
                        num_clients: idx.total_subclients().min(i64::MAX as u64) as i64,
                        wants: idx.total_wants(),
                    })
                    .collect();
                Some(ParentDemand {
                    resource_id: id.to_string(),
                    wants: r.index.total_wants(),
                    bands,
                    // What every client is counted as holding (a lower
                    // server's clients may still hold more than it was last
                    // granted); clients running on their safe capacity use it
                    // as surely as a lease.
                    handed_out: r.index.total_has() + r.reserved,
                    quota: r.quota.as_ref().and_then(|q| q.latest),
                })
            })
            .collect();
        out.sort_by(|a, b| a.resource_id.cmp(&b.resource_id));
        out
    }

    /// The clock every decision reads.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<ResourcesConfig> {
        self.config.load_full()
    }

    /// Marks the moment this server became master: learning mode starts over
    /// and everything known about leases is forgotten, the predecessor's
    /// included (until [`Store::set_predecessor`] says otherwise).
    pub fn become_master(&self) {
        let mut map = self.resources.write().expect("store lock poisoned");
        map.clear();
        self.master_since.store(self.clock.now().as_nanos(), Ordering::Release);
        self.predecessor.store(Predecessor::Unknown.encode(), Ordering::Release);
        self.horizon.store(NO_HORIZON, Ordering::Release);
    }

    /// What this master knows of the leases its predecessor handed out
    /// (from a record the predecessor kept, see `server::horizon`): learning
    /// mode lasts only while some of them may still be valid.
    pub fn set_predecessor(&self, p: Predecessor) {
        self.predecessor.store(p.encode(), Ordering::Release);
    }

    fn predecessor(&self) -> Predecessor {
        Predecessor::decode(self.predecessor.load(Ordering::Acquire))
    }

    /// No lease handed out from now on expires after `until`: the time this
    /// master has recorded for its successor as the end of its leases.
    pub fn set_lease_horizon(&self, until: Option<Time>) {
        self.horizon.store(until.map_or(NO_HORIZON, Time::as_nanos), Ordering::Release);
    }

    fn lease_horizon(&self) -> Option<Time> {
        match self.horizon.load(Ordering::Acquire) {
            NO_HORIZON => None,
            n => Some(Time::from_nanos(n)),
        }
    }

    /// The longest lease this server may hand out: its configuration's, or a
    /// parent's algorithm's.
    pub fn longest_lease(&self) -> Duration {
        let configured = self.config.load().templates.iter().map(|t| t.algorithm.lease_length).max();
        let map = self.resources.read().expect("store lock poisoned");
        let adopted = map
            .values()
            .filter_map(|r| {
                r.lock().expect("resource lock poisoned").parent.as_ref()?.algorithm.as_ref().map(|a| a.lease_length)
            })
            .max();
        configured.max(adopted).unwrap_or(Duration::ZERO)
    }

    /// Installs a new configuration. Existing leases stay valid; the next
    /// decision for each resource uses its new template.
    pub fn reload(&self, config: ResourcesConfig) {
        let map = self.resources.read().expect("store lock poisoned");
        for (id, res) in map.iter() {
            if let Some(t) = config.find(id) {
                res.lock().expect("resource lock poisoned").template = t.clone();
            }
        }
        self.config.store(Arc::new(config));
    }

    fn master_since(&self) -> Time {
        Time::from_nanos(self.master_since.load(Ordering::Acquire))
    }

    /// This master's epoch, for its node identity towards a parent: the
    /// moment it became master, in microseconds since the Unix epoch.
    pub fn master_epoch(&self) -> u64 {
        self.master_since.load(Ordering::Acquire) / 1000
    }

    /// Decides one resource of a request from `client`.
    pub fn get_capacity(&self, client: &str, req: &LeaseRequest) -> Grant {
        self.decide(client, req, false)
    }

    /// Decides the same request again, once [`changed`](Self::changed) fired
    /// while its answer was held (never "too early": it is the same request).
    pub fn decide_again(&self, client: &str, req: &LeaseRequest) -> Grant {
        self.decide(client, req, true)
    }

    fn decide(&self, client: &str, req: &LeaseRequest, again: bool) -> Grant {
        let now = self.clock.now();
        loop {
            {
                // The map's read lock is held while the resource changes, so a
                // sweep cannot drop a resource that a request is filling.
                let map = self.resources.read().expect("store lock poisoned");
                if let Some(res) = map.get(req.resource_id.as_str()) {
                    let mut r = res.lock().expect("resource lock poisoned");
                    r.expire(now);
                    r.predecessor = self.predecessor();
                    r.horizon = self.lease_horizon();
                    let learning = r.learning_until(self.master_since(), now, self.role).is_some();
                    let held = r.index.total_has();
                    // The same request again is never "too early".
                    let min_interval = if again { Duration::ZERO } else { self.min_request_interval };
                    let arrivals = self.limits.max_clients_per_resource > 1;
                    let d = Decision { learning, min_interval, again, arrivals };
                    let grant = r.decide(client, req, now, d, self.role);
                    if r.index.total_has() < held - 1e-9 {
                        self.wake();
                    }
                    return grant;
                }
            }
            let cfg = self.config.load();
            let template = cfg.find(&req.resource_id).expect("validated config has a catch-all").clone();
            let mut map = self.resources.write().expect("store lock poisoned");
            map.entry(req.resource_id.as_str().into()).or_insert_with(|| {
                self.fell_to_catch_all(&req.resource_id, &cfg, &template);
                let mut r = Resource::new(template);
                r.created = now;
                Box::new(Mutex::new(r))
            });
        }
    }

    /// Forgets `client`'s leases on the named resources; unknown ids are ignored.
    /// A lower server's lease is only released by its node's current master,
    /// and stays reserved until it would have expired: the leases it handed
    /// its own clients run until then.
    pub fn release(&self, client: &str, resource_id: &str) {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        if let Some(res) = map.get(resource_id) {
            res.lock().expect("resource lock poisoned").release(client, now);
            self.wake();
        }
    }

    /// Drops expired leases everywhere, and resources left with no client.
    ///
    /// The pass over every resource takes the map's read lock: requests for
    /// the resources it holds go on meanwhile (at a million tenant keys a
    /// pass is a good part of a second). Only the resources found idle are
    /// removed under the write lock, each checked again there: a client may
    /// have come back in between.
    pub fn sweep(&self) {
        let now = self.clock.now();
        let idle: Vec<Box<str>> = {
            let map = self.resources.read().expect("store lock poisoned");
            map.iter()
                .filter_map(|(id, res)| {
                    let mut r = res.lock().expect("resource lock poisoned");
                    r.expire(now);
                    r.idle(now).then(|| id.clone())
                })
                .collect()
        };
        if idle.is_empty() {
            return;
        }
        let mut map = self.resources.write().expect("store lock poisoned");
        for id in idle {
            if map.get_mut(&id).is_some_and(|res| res.get_mut().expect("resource lock poisoned").idle(now)) {
                map.remove(&id);
            }
        }
    }

    /// Every known resource, sorted by id.
    pub fn status(&self) -> Vec<ResourceStatus> {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut out: Vec<ResourceStatus> = map
            .iter()
            .map(|(id, res)| self.status_of(id, &mut res.lock().expect("resource lock poisoned"), now))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// The first `max` resources in [`rank`] order, and how many there are
    /// in all; `each` sees every resource's status on the way (the metrics'
    /// per-template sums). It holds no more than twice `max` statuses at
    /// once: a scrape of a store with a million keys costs no more memory
    /// than one of a few thousand.
    pub fn top_status(&self, max: usize, mut each: impl FnMut(&ResourceStatus)) -> (Vec<ResourceStatus>, usize) {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut top = Vec::new();
        for (id, res) in map.iter() {
            let s = self.status_of(id, &mut res.lock().expect("resource lock poisoned"), now);
            each(&s);
            top.push(s);
            if top.len() >= max.saturating_mul(2).max(64) {
                rank(&mut top);
                top.truncate(max);
            }
        }
        rank(&mut top);
        top.truncate(max);
        (top, map.len())
    }

    /// What status pages and metrics show of one resource now.
    fn status_of(&self, id: &str, r: &mut Resource, now: Time) -> ResourceStatus {
        r.expire(now);
        r.predecessor = self.predecessor();
        if r.calendar.is_some() {
            // A unit may have ended since the last request: the page
            // shows the one now running.
            r.follow_calendar(now, self.role);
        }
        let until = r.learning_until(self.master_since(), now, self.role);
        ResourceStatus {
            id: id.to_string(),
            template: r.template.identifier_glob.clone(),
            algorithm: r.template.algorithm.kind.name(),
            capacity: r.capacity(now, self.role).unwrap_or(0.0),
            sum_has: r.index.total_has() * r.rate_factor(now),
            sum_wants: r.index.total_wants() * r.rate_factor(now),
            clients: r.clients.len(),
            server_clients: r.clients.values().filter(|l| matches!(l.requester, Requester::Server { .. })).count(),
            subclients: r.index.total_subclients(),
            reserved: r.reserved,
            learning_mode: until.is_some(),
            learning_left_s: until.map_or(0.0, |u| u.since(now).as_secs_f64()),
            parent_capacity: r.parent.as_ref().map(|p| p.capacity),
            parent_expires_in_s: r.parent.as_ref().map(|p| p.expiry.since(now).as_secs_f64()),
            quota: r.quota_view(now).map(|o| QuotaStatus {
                source: match r.quota.as_ref().is_some_and(|q| q.latest.is_some()) {
                    true => "upstream",
                    false => "calendar",
                },
                limit: o.limit,
                remaining: o.remaining,
                reset_in_s: o.reset.since(now).as_secs_f64(),
            }),
        }
    }

    /// One resource's unexpired leases, sorted by client id.
    pub fn leases(&self, resource_id: &str) -> Option<Vec<LeaseStatus>> {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut r = map.get(resource_id)?.lock().expect("resource lock poisoned");
        r.expire(now);
        let mut out: Vec<LeaseStatus> = r
            .clients
            .iter()
            .map(|(id, l)| LeaseStatus {
                client_id: id.to_string(),
                kind: match l.requester {
                    Requester::Client { .. } => "client",
                    Requester::Server { .. } => "server",
                },
                priority: match l.requester {
                    Requester::Client { priority } => Some(priority),
                    Requester::Server { .. } => None,
                },
                bands: match &l.requester {
                    Requester::Server { bands } => bands.clone(),
                    Requester::Client { .. } => Vec::new(),
                },
                has: l.granted,
                wants: l.wants,
                subclients: l.subclients,
                expires_in_s: l.expiry.since(now).as_secs_f64(),
                refresh_interval_s: l.refresh_interval.as_secs(),
            })
            .collect();
        out.sort_by(|a, b| a.client_id.cmp(&b.client_id));
        Some(out)
    }
}

// === impl Resource ===

impl Resource {
    fn new(template: Arc<Template>) -> Self {
        Resource {
            quota: None,
            calendar: None,
            template,
            parent: None,
            by_priority: None,
            clients: Clients::default(),
            index: DemandIndex::new(),
            expiries: Expiries::default(),
            reservations: Reservations::default(),
            reserved: 0.0,
            told: 0.0,
            told_reserved: 0.0,
            sharers: 0,
            learned: false,
            learning_end: None,
            created: Time::from_nanos(0),
            predecessor: Predecessor::Unknown,
            horizon: None,
            pool: None,
        }
    }

    /// Nothing left to keep: no client, no reservation, and no calendar
    /// count that still matters (see [`Store::sweep`]).
    fn idle(&self, now: Time) -> bool {
        self.clients.is_empty()
            && self.reservations.is_empty()
            && !self.calendar.as_ref().is_some_and(|c| c.counts(now))
    }

    fn expire(&mut self, now: Time) {
        self.advance_pool(now);
        while let Some(&(expiry, slot)) = self.expiries.first() {
            if expiry > now {
                break;
            }
            let owner = self.clients.owner(slot).expect("expiring slot has an owner");
            if self.calendar.is_some() {
                // What it may still spend stays counted in its unit instead.
                self.remove(&owner);
                continue;
            }
            let l = self.clients.get(&owner).expect("expiring slot has a lease");
            let lease_length = self.algorithm().lease_length;
            // An intermediate's lease cut at this server's own lease from its
            // parent, so short that it ended before its client was due back,
            // runs on while the parent lease, since renewed, lasts: to where
            // it would have ended uncut, or until its client is overdue
            // (a refresh interval, jittered, and a second). Its client holds
            // it (see `lease::Mode::Held`) and comes back at its refresh.
            // Swept, it would come back as a newcomer, its demand forgotten
            // meanwhile, and whichever client asked first after such a sweep
            // took the others' shares (leases of 2 s, cut every second).
            let uncut = l.last_request.saturating_add(lease_length);
            let due = l.last_request.saturating_add(l.refresh_interval.mul_f64(7.0 / 6.0));
            let overdue = due.saturating_add(Duration::from_secs(1));
            let cut = expiry < uncut && expiry < due;
            if let Some(renewed) = self.parent.as_ref().map(|p| p.expiry).filter(|e| *e > now && cut) {
                let to = self.cap_expiry(uncut.min(renewed).min(overdue));
                if to > now {
                    let slot = l.slot;
                    self.expiries.remove(&(expiry, slot));
                    self.expiries.insert((to, slot));
                    self.clients.get_mut(&owner).expect("expiring slot has a lease").expiry = to;
                    continue;
                }
            }
            let amount = l.has.max(l.floor().filter(|f| f.1 > expiry).map_or(0.0, |f| f.0));
            // A lease lasts up to a second more than its length (it ends on
            // a whole second), and so may its hold.
            let longest = lease_length.saturating_add(Duration::from_secs(1));
            let until = expiry.saturating_add(longest);
            // The client holds its lease for as long again as it was granted for.
            let hold_until = expiry.saturating_add(expiry.since(l.last_request).min(longest));
            let r = if l.share {
                // Its share is what it runs on once the hold ends; reserved
                // from now, so that no lease granted from now on outlasts
                // the hold, and kept while it may still be cut off.
                let told = l.safe * l.subclients as f64;
                // The client holds a lease below its share a refresh
                // interval longer (`lease::Core::hold`).
                let hold_until = hold_until.saturating_add(l.refresh_interval.mul_f64(7.0 / 6.0));
                let until = hold_until.saturating_add(lease_length.max(SHARE_KEPT));
                Reservation {
                    amount: amount.max(told),
                    hold_until,
                    then: told,
                    until,
                    epoch: l.epoch(),
                    holders: 0,
                    told,
                    sharers: l.subclients,
                }
            } else {
                let then = if l.safe < 0.0 { amount } else { amount.min(l.safe * l.subclients as f64) };
                // A lower server's subclients hold their leases from it as
                // long as it holds its own (`lease::Mode::Held`).
                let holders = if l.epoch().is_some() { l.subclients } else { 0 };
                Reservation { amount, hold_until, then, until, epoch: l.epoch(), holders, told: 0.0, sharers: 0 }
            };
            self.remove(&owner);
            if r.amount > 0.0 && r.until > now {
                self.reserve(owner, r);
            }
        }
        if self.reservations.values().any(|r| r.until <= now || (r.hold_until <= now && r.amount > r.then)) {
            self.reservations.retain(|_, r| {
                if r.hold_until <= now {
                    r.amount = r.amount.min(r.then);
                }
                r.until > now && r.amount > 0.0
            });
            self.recount_reservations();
        }
        self.settle_pool(None);
    }

    fn recount_reservations(&mut self) {
        let rs = self.reservations.values();
        self.reserved = rs.clone().map(|r| r.amount).sum();
        self.told_reserved = rs.clone().map(|r| r.told).sum();
        self.sharers = rs.map(|r| r.sharers).sum();
    }

    fn reserve(&mut self, client: Arc<str>, r: Reservation) {
        self.reserved += r.amount;
        self.told_reserved += r.told;
        self.sharers += r.sharers;
        if let Some(old) = self.reservations.insert(client, r) {
            self.reserved -= old.amount;
            self.told_reserved -= old.told;
            self.sharers -= old.sharers;
        }
    }

    fn unreserve(&mut self, client: &str) -> Option<Reservation> {
        let r = self.reservations.remove(client)?;
        if self.reservations.is_empty() {
            (self.reserved, self.told_reserved, self.sharers) = (0.0, 0.0, 0);
        } else {
            self.reserved = (self.reserved - r.amount).max(0.0);
            self.told_reserved = (self.told_reserved - r.told).max(0.0);
            self.sharers -= r.sharers;
        }
        Some(r)
    }

    /// A release: a client's lease goes at once; a lower server's only when
    /// its node's current master sends it, and it stays reserved until it
    /// would have expired.
    fn release(&mut self, id: &str, now: Time) {
        self.advance_pool(now);
        self.release_lease(id, now);
        self.settle_pool(None);
    }

    /// [`Resource::release`], the pool aside.
    fn release_lease(&mut self, id: &str, now: Time) {
        let (node, epoch) = split_identity(id);
        let Some(l) = self.clients.get(node).filter(|l| l.epoch().is_some() && epoch.is_some()) else {
            self.remove(id);
            self.unreserve(id);
            return;
        };
        if l.epoch() > epoch {
            return;
        }
        let keep = l.has.max(l.floor().filter(|f| f.1 > now).map_or(0.0, |f| f.0));
        let (until, holders) = (l.expiry, l.subclients);
        let key: Arc<str> = Arc::from(node);
        self.remove(node);
        if keep > 0.0 && until > now {
            let r = Reservation {
                amount: keep,
                hold_until: until,
                then: keep,
                until,
                epoch,
                holders,
                told: 0.0,
                sharers: 0,
            };
            self.reserve(key, r);
        }
    }

    /// `Some(end)` while this resource is in learning mode. A new master
    /// learns until every client that may hold a lease from its predecessor
    /// has reported: for `learning_mode_duration` at most, and no longer than
    /// the refresh interval it hands out (× 7/6 for jitter) plus
    /// [`RECONNECT_ALLOWANCE`]. An intermediate learns until its parent has
    /// answered, and stops early when the parent says how many subclients
    /// its predecessor had and all have reported, or that it had none.
    fn learning_until(&mut self, master_since: Time, now: Time, role: Role) -> Option<Time> {
        self.learning_end = self.learning_end_at(master_since, now, role);
        self.learning_end
    }

    fn learning_end_at(&mut self, master_since: Time, now: Time, role: Role) -> Option<Time> {
        if self.learned {
            return None;
        }
        // Nothing of a predecessor can be outstanding (a fresh deployment, or
        // its leases have all expired): nothing to learn.
        let outstanding_until = match self.predecessor {
            Predecessor::Unknown => None,
            Predecessor::NoneOutstanding => Some(now),
            Predecessor::Lapsed => Some(master_since.saturating_add(RECONNECT_ALLOWANCE)),
            Predecessor::Until(t) => Some(t),
        };
        if outstanding_until.is_some_and(|t| now >= t) {
            self.learned = true;
            return None;
        }
        let alg = self.algorithm().clone();
        let mut refresh = alg.refresh_interval;
        if let Role::Intermediate { decay_factor } = role {
            match &self.parent {
                // Nothing to hand out yet: hand back what clients hold.
                None => return Some(now.saturating_add(Duration::from_secs(1))),
                Some(p) => {
                    // Every predecessor subclient is back, and the parent's
                    // lease counts them all: ending sooner shared a lease
                    // sized for the first to come back (one of two clients
                    // of tests/tree_failover.rs at 13 of its 20 for a second).
                    match p.predecessor_subclients {
                        Some(n)
                            if self.index.total_subclients() >= n && p.answered_subclients.is_some_and(|a| a >= n) =>
                        {
                            self.learned = true;
                            return None;
                        }
                        _ => {}
                    }
                    refresh = p.refresh_interval.mul_f64(decay_factor).max(Duration::from_secs(1));
                }
            }
        }
        let bound = refresh.mul_f64(7.0 / 6.0) + RECONNECT_ALLOWANCE;
        let mut until = master_since.saturating_add(alg.learning_mode_duration.min(bound));
        if let Some(t) = outstanding_until {
            until = until.min(t);
        }
        if now >= until {
            self.learned = true;
            return None;
        }
        Some(until)
    }

    fn remove(&mut self, client: &str) {
        if let Some(l) = self.clients.remove(client) {
            if let Some(p) = self.pool.as_mut().filter(|_| l.saving > 0.0) {
                p.save(f64::from(l.saving), 0.0);
            }
            self.forget_in_unit(client, &l);
            self.untell(&l);
            self.expiries.remove(&(l.expiry, l.slot));
            self.index.remove(l.slot);
            self.unfile_bands(l.slot, bands_of(&l.requester, l.wants, l.subclients));
        }
    }

    /// Takes what `l` was told as its share out of [`Resource::told`].
    fn untell(&mut self, l: &ClientLease) {
        if l.share {
            self.told = if self.clients.is_empty() { 0.0 } else { (self.told - l.safe * l.subclients as f64).max(0.0) };
        }
    }

    /// An end client's default safe capacity: its share of `capacity` by
    /// subclients, counting those of lapsed clients still on theirs, and no
    /// more than what the others were told leaves (a share told earlier, when
    /// fewer clients shared, stays counted until its client hears the new one).
    /// Unlike a configured safe capacity it is not capped at the client's
    /// lease: an idle client cut off from the tree runs on its share, not on
    /// nothing. `told_before`: what the client itself was told until now.
    fn share_safe(&self, subclients: u64, capacity: f64, told_before: f64) -> f64 {
        let n = self.index.total_subclients() + self.sharers;
        let share = if n == 0 { capacity } else { capacity * subclients as f64 / n as f64 };
        let others = (self.told - told_before).max(0.0) + self.told_reserved;
        share.min(capacity - others).max(0.0)
    }

    fn unfile_bands(&mut self, slot: ClientSlot, bands: impl IntoIterator<Item = (i64, f64, u64)>) {
        let Some(by_priority) = &mut self.by_priority else { return };
        for (p, _, _) in bands {
            if let Some(idx) = by_priority.get_mut(&p) {
                idx.remove(slot);
                if idx.is_empty() {
                    by_priority.remove(&p);
                }
            }
        }
    }

    fn file_bands(&mut self, slot: ClientSlot, bands: impl IntoIterator<Item = (i64, f64, u64)>, has: f64) {
        let Some(by_priority) = &mut self.by_priority else { return };
        for (p, wants, subs) in bands {
            by_priority.entry(p).or_default().upsert(slot, wants, subs, has);
        }
    }

    /// The demand per priority band, filed from every client's lease the
    /// first time it is asked for (as [`Resource::file_bands`] keeps it).
    fn by_priority(&mut self) -> &BTreeMap<i64, DemandIndex> {
        self.by_priority.get_or_insert_with(|| {
            let mut by_priority: BTreeMap<i64, DemandIndex> = BTreeMap::new();
            for l in self.clients.values() {
                for (p, wants, subs) in bands_of(&l.requester, l.wants, l.subclients) {
                    by_priority.entry(p).or_default().upsert(l.slot, wants, subs, l.has);
                }
            }
            by_priority
        })
    }

    /// Never beyond the lease horizon this master has recorded.
    fn cap_expiry(&self, expiry: Time) -> Time {
        self.horizon.map_or(expiry, |h| expiry.min(h))
    }

    /// True when the resource's template names it (not the catch-all), so a
    /// local algorithm beats one adopted from the parent.
    fn has_local_template(&self) -> bool {
        self.template.identifier_glob != CATCH_ALL
    }

    /// The template the resource matched, for a client's status page: the
    /// parent's at an intermediate whose own is the catch-all.
    fn template_name(&self) -> String {
        match self.parent.as_ref().and_then(|p| p.template.as_ref()) {
            Some(t) if !self.has_local_template() => t.clone(),
            _ => self.template.identifier_glob.clone(),
        }
    }

    /// The algorithm in force.
    fn algorithm(&self) -> &Algorithm {
        match self.parent.as_ref().and_then(|p| p.algorithm.as_ref()) {
            Some(a) if !self.has_local_template() => a,
            _ => &self.template.algorithm,
        }
    }

    /// The capacity to share now: the template's at a root; at an
    /// intermediate, the parent's unexpired grant, or `None`.
    fn capacity(&self, now: Time, role: Role) -> Option<f64> {
        match (role, &self.parent) {
            (Role::Root, _) => {
                let granted = self.index.total_has() * self.rate_factor(now);
                let upstream = self.quota.as_ref().and_then(|q| q.capacity(now, self.template.capacity, granted));
                let calendar =
                    self.calendar.as_ref().map(|c| c.capacity(now, self.calendar_budget(), self.index.total_has()));
                Some(match (upstream, calendar) {
                    (Some(u), Some(c)) => u.min(c),
                    (u, c) => u.or(c).unwrap_or(self.template.capacity),
                })
            }
            (Role::Intermediate { .. }, Some(p)) if p.expiry > now => Some(p.capacity),
            _ => None,
        }
    }

    /// A calendar window's budget: the capacity over one unit.
    fn calendar_budget(&self) -> f64 {
        self.template.calendar.map_or(0.0, |unit| self.template.capacity * unit.as_secs_f64())
    }

    /// The quota as the resource's clients are told it: the upstream's own
    /// account, or a calendar window's.
    fn quota_view(&self, now: Time) -> Option<usher_lease::quota::Observation> {
        self.quota
            .as_ref()
            .and_then(|q| q.latest)
            .or_else(|| self.calendar.as_ref().map(|c| c.observation(now, self.calendar_budget())))
    }

    fn configured_safe_capacity(&self) -> Option<f64> {
        match &self.parent {
            Some(p) if !self.has_local_template() => p.safe_capacity.or(self.template.safe_capacity),
            _ => self.template.safe_capacity,
        }
    }

    fn safe_capacity(&self, capacity: f64) -> f64 {
        match self.configured_safe_capacity() {
            Some(s) => s,
            None => {
                let n = self.index.total_subclients();
                if n == 0 { capacity } else { capacity / n as f64 }
            }
        }
    }

    /// The grant of `client`'s current lease, unchanged.
    fn unchanged(&self, client: &str, now: Time, capacity: Option<f64>, alg: Algorithm) -> Grant {
        let l = self.clients.get(client).expect("the client has a lease");
        Grant {
            quota: self.quota_view(now),
            resource_capacity: None,
            spare: l.spare,
            share_safe: l.share,
            fresh: false,
            allotment: None,
            credit: 0.0,
            bucket: f64::from(l.bucket),
            pooled: 0.0,
            capacity: l.granted,
            expiry: l.expiry,
            refresh_interval: l.refresh_interval,
            safe_capacity: match l.share {
                true => l.safe * l.subclients as f64,
                false => safe_for(&l.requester, self.safe_capacity(capacity.unwrap_or(0.0)), l.granted),
            },
            algorithm: alg,
            template: self.template_name(),
            predecessor_subclients: l.predecessor_subclients(),
        }
    }

    /// An intermediate with no lease from its parent and a client that holds
    /// none: the answer is an already expired lease, so the client keeps
    /// running on its safe capacity rather than on a lease of 0, and asks
    /// again in a second. Its demand is recorded, so the parent hears of it.
    /// The safe capacity is capped at what is still reserved for the client
    /// here while that reservation lasts; once it has lapsed, the client
    /// gets the whole of it, as a client cut off from the tree would use it
    /// (this node, cut off from its parent, hands nothing to anyone): capped
    /// at nothing, a root outage of two lease lengths left every client
    /// behind a live intermediate on 0, worse off than one whose servers
    /// were all gone.
    fn nothing_to_hand_out(
        &mut self,
        client: &str,
        req: &LeaseRequest,
        now: Time,
        alg: Algorithm,
        bands: &[(i64, f64, u64)],
    ) -> Grant {
        let slot = self.clients.new_slot();
        let expiry = self.cap_expiry(now.saturating_add(Duration::from_secs(2)));
        self.index.upsert(slot, req.wants, req.subclients, 0.0);
        self.file_bands(slot, bands.iter().copied(), 0.0);
        self.expiries.insert((expiry, slot));
        let safe = self.safe_capacity(self.parent.as_ref().map_or(0.0, |p| p.capacity));
        self.clients.insert(
            client,
            ClientLease {
                slot,
                share: false,
                granted: 0.0,
                has: 0.0,
                wants: req.wants,
                subclients: req.subclients,
                requester: req.requester.clone(),
                expiry,
                refresh_interval: Duration::from_secs(1),
                last_request: now,
                lineage: None,
                safe,
                spare: 0.0,
                filled: false,
                bucket: 0.0,
                saving: 0.0,
            },
        );
        // While its reservation lasts, it may run on that and no more.
        let safe_capacity = match self.reservations.get(client) {
            Some(r) => safe_for(&req.requester, safe, r.amount),
            None => safe,
        };
        Grant {
            quota: self.quota_view(now),
            resource_capacity: None,
            spare: 0.0,
            share_safe: false,
            fresh: false,
            allotment: None,
            credit: 0.0,
            bucket: 0.0,
            pooled: 0.0,
            capacity: 0.0,
            expiry: now,
            refresh_interval: Duration::from_secs(1),
            safe_capacity,
            algorithm: alg,
            template: self.template_name(),
            predecessor_subclients: None,
        }
    }

    /// The most learning mode believes a client holds: the parent's grant,
    /// else the configured capacity; nothing says it at an intermediate that
    /// has no lease from its parent yet and no template of its own (its
    /// catch-all's capacity is a placeholder): a client's leases from its
    /// predecessor are believed whole until the parent answers, where
    /// capped at that placeholder (0) they were all cut to nothing.
    fn learning_limit(&self, a: &Ask<'_>) -> f64 {
        match (a.capacity, a.role) {
            (Some(c), _) => c,
            (None, Role::Intermediate { .. }) if !self.has_local_template() => f64::INFINITY,
            (None, _) => self.template.capacity,
        }
    }

    /// What learning mode hands a client: what it reports holding, and at
    /// least the safe capacity this server's own configuration gives it
    /// (what a client cut off from the tree uses anyway), never more than it
    /// wants; 0 without one (a dynamic safe capacity could hand one newcomer
    /// everything). A client holding a lease of 0 got nothing for the whole
    /// of learning mode before (a sidecar that first asked with a measured
    /// demand of 0 refused everything for the 14.7 s a lone root learns).
    /// What it reports is believed up to the resource's capacity (`limit`:
    /// the parent's grant, else the configured one): no predecessor handed
    /// out more, and a client that claims more must not keep it.
    fn learning_grant(&self, req: &LeaseRequest, limit: f64) -> f64 {
        let safe = match self.template.safe_capacity {
            Some(s) if s >= 0.0 => req.wants.min(s * req.subclients as f64),
            _ => 0.0,
        };
        match req.reported_has {
            // More than it holds is not covered by what the parent counts.
            Some(h) if h > 0.0 && limit >= 0.0 => h.min(limit),
            Some(h) if h > 0.0 => h,
            _ => safe,
        }
    }

    /// Decides the request of client `id` for this resource, and files the
    /// lease it answers with.
    fn decide(&mut self, id: &str, req: &LeaseRequest, now: Time, d: Decision, role: Role) -> Grant {
        self.observe_quota(req, now, role);
        if self.calendar.is_some() {
            return self.allot(id, req, now, d, role);
        }
        self.decide_lease(id, req, now, d, role)
    }

    /// Decides a request in the resource's own units: per second, or a
    /// calendar unit's units (see `allot`).
    fn decide_lease(&mut self, id: &str, req: &LeaseRequest, now: Time, d: Decision, role: Role) -> Grant {
        let (client, epoch) = client_key(id, req);
        let alg = self.algorithm().clone();
        let capacity = self.shared_capacity(now, role);
        let bands: Vec<(i64, f64, u64)> = bands_of(&req.requester, req.wants, req.subclients).collect();
        if alg.parameter("priority_mode") == Some("strict") && is_shared(alg.kind) {
            // Filed before this request changes anything, so the bands hold
            // what every lease held until now.
            self.by_priority();
        }
        let known = self.clients.contains_key(client) || self.reservations.contains_key(client);
        let ask = Ask { req, client, epoch, now, role, alg, capacity, bands: &bands, d, known };
        // A node's new master asking while there is nothing to hand out (no
        // lease from the parent) is told so, and its predecessor's lease is
        // left as it is: counted until it ends, then reserved as any lapsed
        // lease. The new master takes it over once there is capacity again;
        // it comes back within a second.
        if capacity.is_none()
            && !d.learning
            && let (Some(e), Some(le)) = (epoch, self.clients.get(client).and_then(ClientLease::epoch))
            && e > le
        {
            let nothing = self.nothing_for_a_stale_master(now, capacity, ask.alg);
            return Grant { refresh_interval: Duration::from_secs(1), ..nothing };
        }
        let Ok(inherited) = self.succeed(&ask) else {
            return self.unchanged(client, now, capacity, ask.alg);
        };
        // A client that holds nothing, asking while there is nothing to hand
        // out, is answered so again, and stays known (with its demand) for
        // two more seconds: were its entry left to lapse, a lower server
        // whose clients all lapsed at once would have no demand for an
        // instant and give its own lease back.
        if capacity.is_none()
            && !d.learning
            && self.clients.get(client).is_none_or(|l| l.granted <= 0.0 && l.has <= 0.0)
        {
            self.remove(client);
            return self.nothing_to_hand_out(client, req, now, ask.alg, &bands);
        }
        let Ok(inherited) = self.take_reservation(&ask, inherited) else {
            return self.nothing_for_a_stale_master(now, capacity, ask.alg);
        };
        let (padded, padded_bands);
        let ask = match self.successor_demand(&ask, inherited) {
            Some(r) => {
                padded = r;
                padded_bands = bands_of(&padded.requester, padded.wants, padded.subclients).collect::<Vec<_>>();
                Ask { req: &padded, bands: &padded_bands, ..ask }
            }
            None => ask,
        };
        // A too-early request gets its lease back unchanged; only its demand
        // is recorded. So does every request while an intermediate server's
        // own lease has lapsed: granted leases run to their expiry, and no new
        // capacity is handed out until the parent renews. Not in learning
        // mode, which hands back what each client holds.
        // (A calendar unit's first request is never too early: the old unit's lease is void.)
        let too_early = self.clients.get(client).is_some_and(|l| {
            now.since(l.last_request) < d.min_interval
                && self.calendar.as_ref().is_none_or(|c| l.last_request >= c.start())
        });
        let lapsed = !d.learning && capacity.is_none() && self.clients.contains_key(client);
        if too_early || lapsed {
            self.record_demand(&ask);
            // What it gave back and its backlog count all the same.
            let l = self.clients.get(client).expect("checked above");
            let (granted, refresh, old) = (l.granted, l.refresh_interval, (l.bucket, l.saving));
            let (credit, b) = self.draw_pool(&ask, granted, 0.0, false, refresh, old);
            self.set_bucket(client, b);
            return Grant { credit, pooled: self.pooled(b), ..self.unchanged(client, now, capacity, ask.alg) };
        }
        self.renew(ask, inherited)
    }

    /// Takes the upstream quota the request reports, and brings a calendar
    /// window's count up to `now`.
    fn observe_quota(&mut self, req: &LeaseRequest, now: Time, role: Role) {
        if let Some(o) = req.quota {
            let granted = self.index.total_has();
            self.quota.get_or_insert_default().observe(o, granted);
        }
        self.follow_calendar(now, role);
    }

    /// A node's new master takes its predecessor's place, inheriting what
    /// the predecessor's clients may still hold as a floor; a stale master
    /// changes nothing (`Err`).
    fn succeed(&mut self, a: &Ask<'_>) -> Result<Option<Inherited>, Stale> {
        let mut inherited: Option<Inherited> = None;
        if let (Some(e), Some(l)) = (a.epoch, self.clients.get(a.client))
            && let Some(le) = l.epoch()
        {
            if e < le {
                return Err(Stale);
            }
            if e > le {
                let floor = l.has.max(l.floor().filter(|f| f.1 > a.now).map_or(0.0, |f| f.0));
                inherited = Some((floor, l.expiry, l.subclients));
                self.remove(a.client);
            }
        }
        Ok(inherited)
    }

    /// A node's new master speaks at first for the subclients it has
    /// heard from, not yet for all of its predecessor's, which still hold
    /// their leases. While it learns, and until it speaks for as many,
    /// its demand counts the missing subclients at their part of what its
    /// predecessor's lease held: its grant is not cut below what its
    /// subtree holds, nor are its siblings' shares or this server's own
    /// report upwards. This server counts that lease as held meanwhile
    /// anyway (the floor in `counted_has`). Only while the new master
    /// learns, which it does for at least `learning_mode_duration` or
    /// [`RECONNECT_ALLOWANCE`], whichever is less, from its epoch (the
    /// moment it became master): a learning master hands each client what
    /// it reports holding, so a padded grant goes to no client beyond its
    /// lease; once it shares, clients that never came back may still hold
    /// theirs. `None`: the request stands as it is.
    fn successor_demand(&self, a: &Ask<'_>, inherited: Option<Inherited>) -> Option<LeaseRequest> {
        let Requester::Server { bands } = &a.req.requester else { return None };
        let epoch = a.epoch?;
        let learns = a.alg.learning_mode_duration.min(RECONNECT_ALLOWANCE);
        if a.d.learning || a.now >= Time::from_nanos(epoch.saturating_mul(1_000)).saturating_add(learns) {
            return None;
        }
        let (floor, until, predecessor) = match inherited {
            Some(i) => i,
            None => {
                let l = self.clients.get(a.client)?;
                let (f, until) = l.floor()?;
                (f, until, l.predecessor_subclients()?)
            }
        };
        if until <= a.now || floor <= 0.0 || a.req.subclients >= predecessor {
            return None;
        }
        let missing = predecessor - a.req.subclients;
        let wants = floor * missing as f64 / predecessor as f64;
        let mut bands = bands.clone();
        // The missing subclients' priorities are unknown: the lowest band's.
        match bands.iter_mut().min_by_key(|b| b.priority) {
            Some(b) => {
                b.wants += wants;
                b.num_clients = b.num_clients.saturating_add(missing.min(i64::MAX as u64) as i64);
            }
            None => bands.push(Band { priority: 0, num_clients: missing.min(i64::MAX as u64) as i64, wants }),
        }
        Some(LeaseRequest {
            wants: a.req.wants + wants,
            subclients: predecessor,
            requester: Requester::Server { bands },
            ..a.req.clone()
        })
    }

    /// Ends the reservation a lapsed lease of the client left, if any: a
    /// node's master inherits it beside what it inherited from its
    /// predecessor's lease; a stale master of that node gets nothing (`Err`).
    fn take_reservation(&mut self, a: &Ask<'_>, inherited: Option<Inherited>) -> Result<Option<Inherited>, Stale> {
        let Some(r) = self.reservations.get(a.client) else { return Ok(inherited) };
        if a.epoch.is_some() && r.epoch > a.epoch {
            // A stale master of a node whose lease lapsed: nothing to give it.
            return Err(Stale);
        }
        let r = self.unreserve(a.client).expect("checked above");
        if a.epoch.is_some() {
            let (floor, until, holders) = inherited.unwrap_or((0.0, a.now, 0));
            let held = if r.hold_until > a.now { r.holders } else { 0 };
            return Ok(Some((floor.max(r.amount), until.max(r.until), holders.max(held))));
        }
        Ok(inherited)
    }

    /// The answer to a stale master of a node whose lease lapsed, or to a
    /// new master while there is nothing to hand out: an expired lease of
    /// nothing.
    fn nothing_for_a_stale_master(&self, now: Time, capacity: Option<f64>, alg: Algorithm) -> Grant {
        Grant {
            quota: self.quota_view(now),
            resource_capacity: None,
            spare: 0.0,
            share_safe: false,
            fresh: false,
            allotment: None,
            credit: 0.0,
            bucket: 0.0,
            pooled: 0.0,
            capacity: 0.0,
            expiry: now,
            refresh_interval: alg.refresh_interval,
            safe_capacity: self.safe_capacity(capacity.unwrap_or(0.0)),
            algorithm: alg,
            template: self.template_name(),
            predecessor_subclients: None,
        }
    }

    /// Records the demand of a request whose lease stays as it is.
    fn record_demand(&mut self, a: &Ask<'_>) {
        let req = a.req;
        let l = self.clients.get_mut(a.client).expect("checked above");
        let old_bands: Vec<_> = bands_of(&l.requester, l.wants, l.subclients).collect();
        if l.share {
            // Its share per subclient stands; what it was told follows its subclients.
            self.told += l.safe * (req.subclients as f64 - l.subclients as f64);
        }
        l.wants = req.wants;
        l.subclients = req.subclients;
        l.requester = req.requester.clone();
        let (slot, has) = (l.slot, l.has);
        self.index.upsert(slot, req.wants, req.subclients, has);
        self.unfile_bands(slot, old_bands);
        self.file_bands(slot, a.bands.iter().copied(), has);
    }

    /// Decides a new lease for the client, files it, and answers with it.
    fn renew(&mut self, a: Ask<'_>, inherited: Option<Inherited>) -> Grant {
        let (req, now) = (a.req, a.now);
        // A client met anew, whose bucket no answer has filled yet.
        let first = match self.clients.get(a.client) {
            Some(l) => !l.filled,
            None => !a.known,
        };
        let old = self.clients.get(a.client).map_or((0.0, 0.0), |l| (l.bucket, l.saving));
        let prior = self.refile(&a, inherited);
        self.open_pool(&a);
        let (earned, held_back) = self.grant(&a, &prior);
        let spare = self.spare(&a, &prior, earned);
        let granted = earned + spare;
        // Its bucket fills with its first lease above 0 that is its share:
        // with spare capacity below the capacity (the first leases, while a
        // resource's clients arrive, are only their first guesses), or any
        // above it (or where nothing is spared).
        let settled = spare > 0.0 || !shares_spare(&a.alg) || a.capacity.is_some_and(|c| self.index.total_wants() >= c);
        let fresh = first && !a.d.learning && granted > 0.0 && settled;
        let filled = !first || fresh;
        let has = self.counted_has(&a, granted, &prior);
        let (expiry, mut refresh) = self.lease_times(&a, held_back);
        if spare > 0.0 && matches!(req.requester, Requester::Client { .. }) {
            // Spare capacity comes back within this long when another client
            // needs it. (Not a lower server's: the root's load stays that of
            // its intermediates, each refreshing at its interval.)
            refresh = refresh.min(SPARE_REFRESH);
        }
        let safe = self.safe_capacity(a.capacity.unwrap_or(0.0));
        let (share, told) = self.tell_share(&a);
        let lease = ClientLease {
            slot: prior.slot,
            share,
            granted,
            has,
            wants: req.wants,
            subclients: req.subclients,
            requester: req.requester.clone(),
            expiry,
            refresh_interval: refresh,
            last_request: now,
            lineage: Lineage::boxed(a.epoch, prior.floor, prior.predecessor),
            safe: match told {
                Some(t) => t / req.subclients.max(1) as f64,
                None => self.configured_safe_capacity().unwrap_or(safe),
            },
            spare,
            filled,
            bucket: 0.0,
            saving: 0.0,
        };
        self.index.upsert(prior.slot, req.wants, req.subclients, has);
        self.file_bands(prior.slot, a.bands.iter().copied(), has);
        self.expiries.insert((expiry, prior.slot));
        self.clients.insert(a.client, lease);
        let (credit, b) = self.draw_pool(&a, granted, granted - prior.has, fresh, refresh, old);
        self.set_bucket(a.client, b);
        Grant {
            credit,
            bucket: f64::from(b.size),
            pooled: self.pooled(b),
            quota: self.quota_view(now),
            // (What the root shares: an intermediate passes on its parent's.)
            resource_capacity: match a.role {
                Role::Root => a.capacity,
                Role::Intermediate { .. } => self.parent.as_ref().and_then(|p| p.resource_capacity),
            },
            spare,
            share_safe: share,
            fresh,
            allotment: None,
            capacity: granted,
            expiry,
            refresh_interval: refresh,
            safe_capacity: told.unwrap_or_else(|| safe_for(&req.requester, safe, granted)),
            algorithm: a.alg,
            template: self.template_name(),
            predecessor_subclients: prior.predecessor,
        }
    }

    /// Brings the pool up to `a.now` before the client's lease changes, and
    /// opens one at a root's rate resource that shares spare capacity when
    /// the client reports its window: full while nobody holds any of the
    /// capacity (as a first grant is `fresh`), else empty.
    fn open_pool(&mut self, a: &Ask<'_>) {
        self.advance_pool(a.now);
        let Some(w) = a.req.window else { return };
        let pooled = a.role == Role::Root
            && self.calendar.is_none()
            && !a.d.learning
            && shares_spare(&a.alg)
            && matches!(a.req.requester, Requester::Client { .. });
        let Some(cap) = a.capacity.filter(|_| pooled) else { return };
        match &mut self.pool {
            Some(p) => p.report(w),
            None => {
                let held = self.index.total_has() + self.reserved;
                let p = pool::Pool::new(a.now, w, cap, cap - held, held <= 1e-9);
                self.pool = Some(Box::new(p));
            }
        }
    }

    /// The pool's part of an answer to a client granted `granted`, its
    /// lease grown by `grown`, to be refreshed in `refresh`; `old`: the
    /// bucket and saving its last answer gave it. Takes what it gave back
    /// (no more than its share of the burst then), moves the burst of its growth or its
    /// backlog into its bucket, sizes its bucket if it keeps a reserve while
    /// another client shares the resource, and settles the pool at the new
    /// leases. Returns the credit and the bucket (0: none). No credit and no
    /// bucket for a client that reported no window (a Doorman client), a
    /// lower server, or in learning mode (which hands back what clients
    /// hold); no credit for a `fresh` lease, whose bucket starts full anyway
    /// (its burst still leaves the pool).
    fn draw_pool(
        &mut self,
        a: &Ask<'_>,
        granted: f64,
        grown: f64,
        fresh: bool,
        refresh: Duration,
        old: (f32, f32),
    ) -> (f64, Bucket) {
        let shared = self.clients.len() > 1;
        let Some(p) = &mut self.pool else { return (0.0, Bucket::default()) };
        let (mut credit, mut bucket, mut saving) = (0.0, 0.0, 0.0);
        let report = a.req.bucket;
        if matches!(a.req.requester, Requester::Client { .. }) && a.req.window.is_some() && !a.d.learning {
            // No more than its last answer's share of the burst: its bucket,
            // and what that bucket clipped when it first came.
            p.give(report.returned.min(f64::from(old.0) + f64::from(old.1)));
            credit = p.credit_for(grown, report.backlog);
            if let Some(reserve) = report.reserve.filter(|_| shared && !fresh) {
                let share = granted * p.window();
                let b = (reserve + granted * refresh.as_secs_f64() + credit).min(share);
                if share - b > 1e-6 {
                    (bucket, saving) = (b, share - b);
                }
            }
        }
        // Kept as the lease keeps it, so the pool's sum takes back what it added.
        let b = Bucket { size: bucket as f32, saving: saving as f32 };
        p.save(f64::from(old.1), f64::from(b.saving));
        self.settle_pool(a.capacity);
        (if fresh { 0.0 } else { credit }, b)
    }

    /// What the pool holds, told to a client given bucket `b`.
    fn pooled(&self, b: Bucket) -> f64 {
        match (&self.pool, b.size > 0.0) {
            (Some(p), true) => p.level(),
            _ => 0.0,
        }
    }

    /// Keeps the bucket an answer gives the client.
    fn set_bucket(&mut self, client: &str, b: Bucket) {
        if let Some(l) = self.clients.get_mut(client) {
            (l.bucket, l.saving) = (b.size, b.saving);
        }
    }

    /// Refills the pool up to `now` at the free rate of the leases as they
    /// stood: called before any of them changes.
    fn advance_pool(&mut self, now: Time) {
        if let Some(p) = &mut self.pool {
            p.advance(now);
        }
    }

    /// The leases changed: the pool's free rate follows them (`capacity`:
    /// the capacity shared now, if known), its level capped at its size.
    fn settle_pool(&mut self, capacity: Option<f64>) {
        let held = self.index.total_has() + self.reserved;
        if let Some(p) = &mut self.pool {
            let cap = capacity.unwrap_or(p.capacity());
            p.settle(cap, cap - held);
        }
    }

    /// Files the request's demand in the client's slot, still counting what
    /// it holds, and says what it held before.
    fn refile(&mut self, a: &Ask<'_>, inherited: Option<Inherited>) -> Prior {
        let (req, now) = (a.req, a.now);
        let slot = match self.clients.get(a.client) {
            Some(l) => {
                self.expiries.remove(&(l.expiry, l.slot));
                l.slot
            }
            None => self.clients.new_slot(),
        };
        let previous = self.clients.get(a.client);
        let (old_has, old_bands): (f64, Vec<_>) =
            previous.map_or((0.0, Vec::new()), |l| (l.has, bands_of(&l.requester, l.wants, l.subclients).collect()));
        // The client asked before for less: its measured demand may be arriving.
        let grew = previous.is_some_and(|l| req.wants > l.wants + 1e-9);
        // Kept for a lease length past its end: see `lapsed` in `counted_has`.
        let lease_length = self.algorithm().lease_length;
        let floor = inherited
            .map(|(f, until, _)| (f, until))
            .or(previous.and_then(|l| l.floor()))
            .filter(|f| f.1.saturating_add(lease_length) > now && f.0 > 0.0);
        let predecessor = match (a.epoch, a.d.learning) {
            (None, _) | (_, true) => None,
            (Some(_), false) => match (inherited, previous) {
                (Some((_, _, n)), _) => Some(n),
                (None, Some(l)) => l.predecessor_subclients(),
                (None, None) => Some(0),
            },
        };
        self.index.upsert(slot, req.wants, req.subclients, old_has);
        self.unfile_bands(slot, old_bands);
        self.file_bands(slot, a.bands.iter().copied(), old_has);
        Prior { slot, has: old_has, grew, floor, predecessor }
    }

    /// What the client is granted, and whether others still hold what it
    /// is due: then it comes back soon to collect it, instead of a whole
    /// refresh interval later.
    fn grant(&self, a: &Ask<'_>, prior: &Prior) -> (f64, bool) {
        match a.capacity {
            _ if a.d.learning => (self.learning_grant(a.req, self.learning_limit(a)), false),
            None => (0.0, false),
            Some(cap) => self.shared_grant(a, prior, cap),
        }
    }

    /// [`Resource::grant`] out of `cap`, the capacity to share now.
    fn shared_grant(&self, a: &Ask<'_>, prior: &Prior, cap: f64) -> (f64, bool) {
        let (req, alg, old_has) = (a.req, &a.alg, prior.has);
        // Capacity reserved for lapsed clients is nobody's to share.
        let cap = (cap - self.reserved).max(0.0);
        let unused = cap - (self.index.total_has() - old_has);
        let mut held_back = unused < req.wants - 1e-9 && is_shared(alg.kind);
        let r = algorithm::Request { wants: req.wants, subclients: req.subclients, has: old_has };
        let strict = alg.parameter("priority_mode") == Some("strict") && is_shared(alg.kind);
        let decide = |r: &algorithm::Request| {
            if strict {
                self.strict_priority(cap, a.bands, r)
            } else {
                algorithm::decide(alg.kind, cap, &self.index, r)
            }
        };
        let mut granted = decide(&r);
        if a.d.again {
            // A newcomer decided again after its answer was held:
            // others held with it are about to be decided too, and
            // must find their shares unused, so no more than the
            // share it would have if nobody held more than theirs
            // (not the others' shares while they still hold nothing).
            granted = granted.min(decide(&algorithm::Request { has: self.index.total_has(), ..r }));
        }
        if held_back {
            // The share the algorithm would give if nobody held more
            // than theirs: counting everyone's holdings as this
            // client's lifts the "never above unused" cap.
            let share = decide(&algorithm::Request { has: self.index.total_has(), ..r });
            // A client keeps what it holds, up to its share: that
            // never adds to what is outstanding. When this server's
            // own capacity was cut below what its clients hold, each
            // of them comes down to its share at its next request,
            // instead of the first to ask dropping to nothing while
            // the others still hold theirs.
            granted = granted.max(old_has.min(share));
            held_back = granted < share * (1.0 - HELD_BACK_MARGIN) - 1e-9;
        }
        if prior.grew && self.arriving(a) && is_shared(alg.kind) {
            // Clients are still arriving, and the wants of those that
            // asked first may not be their demand yet (a sidecar asks
            // for its routes file's capacity, 1/s say, before it has
            // measured any): a client asking for more than before
            // grows no further than its equal share then, or the
            // first whose measured demand arrives takes what the
            // others are about to ask for (47-58/s of 90 for a
            // second, the others 1-15/s).
            let equal = cap * req.subclients as f64 / self.index.total_subclients().max(1) as f64;
            granted = granted.min(equal.max(old_has));
        }
        if self.opening(a.now) && is_shared(alg.kind) {
            granted = self.opening_share(cap, req.subclients, old_has);
            held_back = false;
        }
        (granted, held_back)
    }

    /// Whether the resource's clients may still be arriving: it is new to
    /// this server (a refresh interval, and at least [`ARRIVALS`]) and may
    /// have more than one client. Its first clients' wants may not be their
    /// demand yet (a sidecar asks for its routes file's capacity before it
    /// has measured any), so none grows past an equal share meanwhile, and
    /// their leases refresh every second.
    fn arriving(&self, a: &Ask<'_>) -> bool {
        a.d.arrivals && a.now.since(self.created) < a.alg.refresh_interval.max(ARRIVALS)
    }

    /// The spare capacity handed to the client beside the `earned` grant:
    /// when all wants together are below the capacity to share, what
    /// nobody wants is handed out, within what the others leave unused,
    /// half in proportion to the wants and half raising the clients that
    /// want least to one level (per subclient); a share of it (as if
    /// [`SPARE_KEPT_FREE`] more subclients wanted some) stays free. So a
    /// burst passes at once wherever it lands (a client's bucket is its
    /// lease's share of the fleet's burst), the busiest clients' queues
    /// have room, and a quiet client keeps some capacity instead of none.
    /// Not in learning mode, not as a calendar unit opens (see
    /// `Resource::opening`), and not where the template keeps spare
    /// capacity (see [`SPARE_PARAMETER`]).
    fn spare(&self, a: &Ask<'_>, prior: &Prior, earned: f64) -> f64 {
        let Some(cap) = a.capacity.filter(|_| !a.d.learning && shares_spare(&a.alg)) else { return 0.0 };
        if self.opening(a.now) {
            return 0.0;
        }
        let cap = (cap - self.reserved).max(0.0);
        let free = cap - self.index.total_wants();
        let others = self.index.total_has() - prior.has;
        let unused = cap - others - earned;
        if free <= 1e-9 || unused <= 1e-9 {
            return 0.0;
        }
        // (A calendar unit's unspent allotments come back at each refresh:
        // none need stay free.)
        let free_share = if self.calendar.is_some() { 0.0 } else { SPARE_KEPT_FREE };
        let n = self.index.total_subclients() as f64 + free_share;
        let mut kept = free * free_share / n.max(1.0);
        if self.pool.is_some() {
            // Where the burst of what nobody holds is pooled, more stays
            // free: a client whose demand rises draws its burst from the pool.
            kept = kept.max(free * POOLED_SPARE);
        }
        // Half of what is handed out goes in proportion to the wants (the
        // busiest clients' queues have room too), half raises those that
        // want least to one level.
        let target = cap - kept;
        let wants = self.index.total_wants();
        let scale = if wants > 0.0 { 1.0 + (target - wants).max(0.0) / 2.0 / wants } else { 1.0 };
        let floor = self.index.floor_level(target / scale) * scale * a.req.subclients as f64;
        let mut lease = floor.max(a.req.wants * scale);
        if self.arriving(a) {
            // While a new resource's clients are still arriving, no more than
            // an equal share as if two more were about to ask: the first to
            // ask would hold what the others are about to want (a lone first
            // sidecar given half of it held 45/s for two seconds while the
            // third had 13 of its 30).
            let equal = cap * a.req.subclients as f64 / (self.index.total_subclients() as f64 + ARRIVING_MORE);
            lease = lease.min(equal.max(earned));
        }
        (lease - earned).min(unused).max(0.0)
    }

    /// What counts as outstanding for the client: its grant, or for a lower
    /// server at least what it reports having handed out and what it inherited.
    fn counted_has(&self, a: &Ask<'_>, granted: f64, prior: &Prior) -> f64 {
        let req = a.req;
        match req.requester {
            Requester::Server { .. } => {
                let reported = granted.max(req.reported_has.unwrap_or(0.0));
                match prior.floor {
                    Some((f, until)) if until > a.now => reported.max(f),
                    // The predecessor's leases have lapsed: those of its
                    // subclients that have not come back to the new master
                    // are counted at their safe capacity (at most the floor)
                    // for up to a lease length. They may hold more (a lapsed
                    // lease is held: see `lease::Mode::Held`), but counting
                    // their part of the floor instead let the new master keep
                    // it as its own grant (a cut grant keeps min(has, share))
                    // and hand it out again: scenario seven reached 110.55%
                    // (benches/RESULTS.md, step 13).
                    Some((f, _)) => {
                        let missing = prior.predecessor.unwrap_or(0).saturating_sub(req.subclients);
                        let safe = self.configured_safe_capacity().unwrap_or(f);
                        let lapsed = if safe < 0.0 { f } else { (safe * missing as f64).min(f) };
                        reported + lapsed
                    }
                    None => reported,
                }
            }
            Requester::Client { .. } => granted,
        }
    }

    /// The new lease's expiry and refresh interval.
    fn lease_times(&self, a: &Ask<'_>, held_back: bool) -> (Time, Duration) {
        let (req, now, alg) = (a.req, a.now, &a.alg);
        // A lease ends on a whole second: the wire carries its expiry in
        // whole seconds, rounded down, and a client that was told a second
        // less than the books hold saw its lease run out before the refresh
        // of a 2 s lease. (An intermediate's parent lease then also ends
        // where its parent's books say, not up to a second before.)
        let (mut expiry, mut refresh) = (now.saturating_add(alg.lease_length).ceil_secs(), alg.refresh_interval);
        let parent = self.parent.as_ref().filter(|p| p.expiry > now);
        if let (Role::Intermediate { decay_factor }, Some(p)) = (a.role, &self.parent) {
            // Never promise beyond what this server itself holds.
            expiry = expiry.min(p.expiry);
            refresh = p.refresh_interval.mul_f64(decay_factor).max(Duration::from_secs(1));
        }
        if a.d.learning {
            // Hand back what the client holds, for at least as long as it holds it.
            if matches!(a.role, Role::Intermediate { .. }) && parent.is_none() {
                expiry = now.saturating_add(Duration::from_secs(2));
            }
            // (No predecessor's lease lasted longer than a lease length from
            // now: a reported expiry beyond that is not believed.)
            if req.reported_has.is_some()
                && let Some(e) = req.reported_expiry
            {
                expiry = expiry.max(e.min(now.saturating_add(alg.lease_length)));
            }
            // Come back when learning ends, to be given a real share.
            if let Some(end) = self.learning_end {
                let left = Duration::from_secs(end.since(now).as_secs_f64().ceil() as u64);
                refresh = refresh.min(left).max(Duration::from_secs(1));
            }
        } else if a.capacity.is_none() {
            // Nothing to hand out yet (no lease from the parent): come back soon.
            refresh = Duration::from_secs(1);
            expiry = now.saturating_add(Duration::from_secs(2));
        } else if held_back || self.quota.is_some() || self.arriving(a) {
            // (A capacity that follows the upstream's quota changes by the
            // second: its clients come back every second to follow it.)
            // Adaptive refresh: the grant was cut to what others leave
            // unused, or the resource is new and its clients are still
            // arriving (a first-come client must not keep everything for a
            // whole interval). In steady state neither holds, and neither
            // ever does on a sidecar's embedded server (its one client).
            refresh = refresh.min(FAST_REFRESH);
        }
        if let Some(c) = &self.calendar {
            // A calendar window: come back often enough to follow what is
            // left of the unit, and at its boundary for the renewed budget.
            let to_reset = Duration::from_secs(c.reset().since(now).as_secs_f64().ceil() as u64);
            refresh = refresh.min((c.unit() / 60).max(FAST_REFRESH)).min(to_reset.max(FAST_REFRESH));
        }
        (self.cap_expiry(expiry), refresh)
    }

    /// Whether the client's safe capacity is its share, and that share,
    /// counted in [`Resource::told`] in place of what it was told before.
    fn tell_share(&mut self, a: &Ask<'_>) -> (bool, Option<f64>) {
        let req = a.req;
        // Not while learning: a new master does not know the shares its
        // predecessor told, and the first client back would be told all of it.
        let share = !a.d.learning
            && matches!(req.requester, Requester::Client { .. })
            && self.configured_safe_capacity().is_none();
        let told_before = self.clients.get(a.client).filter(|l| l.share).map_or(0.0, |l| l.safe * l.subclients as f64);
        let told = share.then(|| self.share_safe(req.subclients, a.capacity.unwrap_or(0.0), told_before));
        if let Some(t) = told {
            self.told += t;
        }
        self.told = (self.told - told_before).max(0.0);
        (share, told)
    }

    /// Strict priorities: higher bands are satisfied first, up to their wants;
    /// each band is shared max-min fairly within what the bands above leave.
    fn strict_priority(&self, capacity: f64, bands: &[(i64, f64, u64)], r: &algorithm::Request) -> f64 {
        let mut left = capacity;
        let mut grant = 0.0;
        let by_priority = self.by_priority.as_ref().expect("filed for a strict resource");
        for (p, idx) in by_priority.iter().rev() {
            if let Some((_, wants, subs)) = bands.iter().find(|(bp, _, _)| bp == p) {
                let level = idx.water_level(left.max(0.0));
                grant += wants.min(level * *subs as f64);
            }
            left = (left - idx.total_wants()).max(0.0);
        }
        let unused = capacity - (self.index.total_has() - r.has);
        grant.min(r.wants).min(unused).max(0.0)
    }
}

/// A client's demand per priority band: an end client's all in its one
/// priority, a lower server's in the bands it reported.
fn bands_of(requester: &Requester, wants: f64, subclients: u64) -> impl Iterator<Item = (i64, f64, u64)> + '_ {
    let (own, reported) = match requester {
        Requester::Client { priority } => (Some((*priority, wants, subclients)), &[][..]),
        Requester::Server { bands } => (None, &bands[..]),
    };
    own.into_iter().chain(reported.iter().map(|b| (b.priority, b.wants, b.num_clients.max(1) as u64)))
}

/// The configured safe capacity to tell a requester that holds `held`: an
/// end client's is never more than what it holds (the default, its share, is
/// [`Resource::share_safe`]'s). A client runs on its safe capacity once
/// its lease lapses; capped so, it never uses more than is already counted for
/// it (its lease, then its reservation), so no lapse, however it falls, can
/// take capacity that was handed to someone else. A lower server gets the
/// safe capacity per subclient, and caps its own clients the same way.
/// Unlimited (< 0) stays unlimited: that cannot be covered.
fn safe_for(requester: &Requester, safe: f64, held: f64) -> f64 {
    match requester {
        Requester::Client { .. } if safe >= 0.0 => safe.min(held.max(0.0)),
        _ => safe,
    }
}

/// Whether a template hands out spare capacity (see [`SPARE_PARAMETER`]):
/// FAIR_SHARE does unless told `keep`; the others only when told `share`.
pub fn shares_spare(alg: &Algorithm) -> bool {
    match alg.parameter(SPARE_PARAMETER) {
        Some("share") => is_shared(alg.kind),
        Some(_) => false,
        None => alg.kind == Kind::FairShare,
    }
}

/// True for the kinds whose grants share one capacity.
pub fn is_shared(kind: Kind) -> bool {
    matches!(kind, Kind::ProportionalShare | Kind::FairShare)
}

/// The key a request's client is filed under (a lower server's node id,
/// without its epoch), and the epoch of the master speaking for that node.
fn client_key<'a>(id: &'a str, req: &LeaseRequest) -> (&'a str, Option<u64>) {
    match req.requester {
        Requester::Server { .. } => split_identity(id),
        Requester::Client { .. } => (id, None),
    }
}

mod allot;
mod few;
mod pool;
#[cfg(test)]
mod tests;
