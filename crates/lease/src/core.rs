//! The lease client's state machine, free of I/O and of real time.
//!
//! The driver (or `usher sim`) feeds it demand and RPC results and asks it
//! what to do next; the core decides whom to call, with what, and when, and
//! what capacity each key may use right now. Keeping it sans-I/O is what lets
//! tests and the simulator run the exact production logic in virtual time.
//!
//! Refreshes: an early refresh (a new key, a key whose demand moved, a key
//! whose lease asks to hear from it before the regular refresh:
//! kept in `Core`'s `dues`) carries only the keys that ask early. Every key goes in
//! the regular refresh, which follows the leases that ask later than a
//! second ([`SOON`]) and last their interval (all of them if none does).
//! While the servers fail ([`Core::failing`]) only the backoff times calls.
//!
//! Calendar quotas: a lease that carries an allotment (usher's extension)
//! is handed to the enforcement side as one ([`Core::take_allotments`]); the
//! key's account goes up with its requests, and the key asks again just
//! after the unit's reset (spread over [`BOUNDARY_SPREAD`], bypassing the
//! minimum interval), so a renewed quota is there within a second.
//!
//! Expiry: a lapsed lease is held as long again, matching the server's
//! reservation for a lapsed client (a refresh longer when it is below its
//! safe capacity); then the key follows its `on_expiry`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;

use super::backoff::{Backoff, BackoffConfig, jitter};
use usher_core::clock::Time;
use usher_proto as proto;

/// A key whose `wants` is this much below its lease gives the rest back
/// early (see [`Core::set_demand`]).
pub const GIVE_BACK: f64 = 0.05;

/// A lease to refresh this soon says the server expects to have more for the
/// key shortly (usher hands a client 1 s when others still hold its share):
/// early asks do not back off (see [`Core::set_demand`]).
pub const SOON: Duration = Duration::from_secs(1);
/// How soon a client tries the next server after one failed, before it backs
/// off: long enough not to spin, short against a lease's life.
pub const NEXT_SERVER: Duration = Duration::from_millis(50);
/// Longest wait (before jitter) between rounds of the server list until a
/// server first answers: a client with no lease yet enforces only its
/// on-expiry capacity, and a fresh tree (etcd, servers and sidecars started
/// together) is ready a few seconds in, so a 2 s backoff step there was paid
/// by every first request.
pub const FIRST_ANSWER_RETRY: Duration = Duration::from_secs(1);
/// A key with an allotment asks again this long after its unit's reset at
/// most: each client draws its moment in it once, so a fleet does not ask
/// at once, and the new unit's quota is there within a second.
pub const BOUNDARY_SPREAD: Duration = Duration::from_millis(300);

/// How soon a key with requests waiting asks again while the server's last
/// answer said its pool holds units: the pooled burst is a round trip away,
/// not a minimum interval away. An ask the pool answers with nothing ends
/// it (the answer says the pool is empty), so a fleet over its capacity
/// asks no more often than before.
pub const POOL_ASK: Duration = Duration::from_millis(100);

/// What a key may use once its lease has expired (or before the first one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExpiry {
    /// As if granted what is wanted.
    Optimistic,
    /// Nothing.
    Pessimistic,
    /// The server's safe capacity, else the configured one (-1 = unlimited).
    Safe,
}

impl OnExpiry {
    /// The name the routes file and status pages use.
    pub fn name(self) -> &'static str {
        match self {
            OnExpiry::Optimistic => "optimistic",
            OnExpiry::Pessimistic => "pessimistic",
            OnExpiry::Safe => "safe",
        }
    }
}

/// The capacity a key may use now. Status pages show it plainly: a number,
/// or the string `"unlimited"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// Units per second (rate) or in flight (gauge); 0 refuses every request.
    Limited(f64),
    /// No limit.
    Unlimited,
}

impl Serialize for Capacity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Capacity::Limited(c) => s.serialize_f64(*c),
            Capacity::Unlimited => s.serialize_str("unlimited"),
        }
    }
}

/// Where a key's capacity currently comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// An unexpired lease.
    Leased,
    /// No lease has arrived yet: `on_expiry` applies.
    Pending,
    /// The lease expired unrenewed and is held: still enforced, for as long
    /// again as it was granted for, because the server that granted it keeps
    /// it reserved that long (see `server::store::Reservation`). A server
    /// outage shorter than that costs nothing; after it, `on_expiry` applies.
    Held,
    /// The lease expired: `on_expiry` applies.
    Expired,
}

impl Mode {
    /// The name logs and status pages use.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Leased => "leased",
            Mode::Pending => "pending",
            Mode::Held => "held",
            Mode::Expired => "expired",
        }
    }
}

/// Where the capacity a key may use comes from, for status pages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A lease the servers granted.
    Lease,
    /// A lease read from the on-disk cache at start-up, not yet renewed.
    Cache,
    /// No unexpired lease: the key's `on_expiry`.
    OnExpiry,
}

/// What the enforcement side reports for one key at each refresh.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDemand {
    /// The Doorman resource id the key leases.
    pub resource_id: String,
    /// The priority band the servers share the resource's capacity by.
    pub priority: i64,
    /// The capacity the key asks for: units per second (rate) or in flight (gauge).
    pub wants: f64,
    /// What the key may use with no unexpired lease.
    pub on_expiry: OnExpiry,
    /// Used in safe mode when the server sent none.
    pub safe_capacity: Option<f64>,
    /// Refusals or queued requests show demand above what the key may use:
    /// with `wants` above the lease, refresh early (see [`Core::set_demand`]).
    pub pressure: bool,
    /// The freshest account of the upstream's own quota for this key,
    /// carried to the servers with its requests.
    pub quota: Option<super::quota::Observation>,
    /// The key's account of its calendar unit, while it holds an allotment
    /// (boxed: most keys never have one).
    pub account: Option<Box<usher_limit::allot::Account>>,
    /// Seconds of its leased rate the key's bucket holds (a shared rate
    /// key's burst over its lease), reported so that a root server can pool
    /// the burst of the capacity nobody holds and credit it when the lease
    /// grows (usher's extension).
    pub window: Option<f64>,
}

/// A change of the demand (see [`Core::update_demand`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DemandUpdate {
    /// The keys whose demand is new or changed; every key when `complete`.
    pub changed: Vec<KeyDemand>,
    /// Keys gone since the last update: their leases are released.
    pub removed: Vec<String>,
    /// `changed` holds every key: a key not in it is gone.
    pub complete: bool,
    /// The enforcement side was rebuilt before this read (a reload): its
    /// keys, all there again now, get their capacity applied once more.
    pub rebuilt: bool,
}

/// A lease as received.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Lease {
    /// The capacity granted: units per second (rate) or in flight (gauge).
    pub capacity: f64,
    /// When the grant ends, to the second.
    #[serde(serialize_with = "ser_time")]
    pub expiry: Time,
    /// How long after the answer the server wants to hear from the key again.
    pub refresh_interval: Duration,
}

fn ser_time<S: serde::Serializer>(t: &Time, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_i64(t.as_secs())
}

impl Lease {
    /// The lease a server granted, as enforced: a capacity that is not a
    /// finite number counts as 0 (an answer with one is refused before this),
    /// and a refresh interval is at least a second.
    fn granted(gets: &proto::Lease) -> Self {
        Lease {
            capacity: if gets.capacity.is_finite() { gets.capacity.max(0.0) } else { 0.0 },
            expiry: Time::from_secs(gets.expiry_time.max(0) as u64),
            refresh_interval: Duration::from_secs(gets.refresh_interval.max(1) as u64),
        }
    }
}

#[derive(Debug, Clone)]
struct KeyState {
    /// Its `resource_id` is left empty: the key's id is the map's key.
    demand: KeyDemand,
    lease: Option<Lease>,
    /// Until when an expired `lease` is held (see [`Mode::Held`]): its
    /// expiry plus the time it was granted for; `None` for a lease from the
    /// cache or one that arrived already expired.
    hold_until: Option<Time>,
    server_safe: Option<f64>,
    /// The capacity the server shares for the resource (usher's extension).
    fleet: Option<f64>,
    /// The part of the lease that is spare: capacity nobody wanted, handed
    /// out beyond `wants` (usher's extension; 0 from other servers).
    spare: f64,
    /// The server's safe capacity is the key's share of the resource, which
    /// may be above its lease (usher's extension): see [`hold`].
    share_safe: bool,
    /// The last answer's lease was the server's first above 0 for the key
    /// (usher's extension): its bucket may start full, once.
    fresh: bool,
    /// Units of the server's pooled burst credited with the last answers and
    /// not yet taken (usher's extension): they go into the key's bucket.
    credit: f64,
    /// The most the key's bucket may hold until its next request, below its
    /// lease's share of the burst, as the last answer said (usher's
    /// extension; 0: no such limit).
    bucket: f32,
    /// With `bucket`: units the server's pool held after the last answer.
    pooled: f32,
    /// When the quota the server follows renews, while it says that quota
    /// is spent (usher's extension: its account of the upstream's quota, or
    /// of a calendar window): refusals meanwhile say how long to wait.
    renews: Option<Time>,
    /// The server's template the key matched, if it says (usher servers do).
    template: Option<Arc<str>>,
    mode: Mode,
    last_error: Option<String>,
    /// The lease came from the on-disk cache and no answer has replaced it yet.
    cached: bool,
    /// The demand is away from the lease: it asks early (see [`Core::set_demand`]).
    away: bool,
    /// How long after the last request it asks again while away
    /// (`Duration::MAX`: not before its refresh is due).
    early_wait: Duration,
    /// The lease it held when a request went out while it was away.
    asked_with: Option<f64>,
    /// A request to the servers carried it and has not been answered yet.
    asked: bool,
    /// A request that carried it was answered, or a call to the servers
    /// failed, since it was made: until then a key with no lease keeps the
    /// capacity it was made with (see [`Core::take_changes`]).
    settled: bool,
    /// A calendar quota's allotment came with its last lease (boxed: most
    /// keys never have one).
    allot: Option<Box<KeyAllot>>,
    /// When its lease asks to hear from it again, if that is before the
    /// refresh of every key (a server that has just met the resource, or
    /// that expects to have more for it soon, asks within a second; or an
    /// early answer's lease that wants renewing before every key's refresh
    /// comes): an early call carries it then, with any other key due by
    /// then (see [`Core::on_refresh`]). Kept in [`Core::dues`] too.
    due: Option<Time>,
}

impl KeyState {
    /// A key of `demand` with no lease yet, asking early again after
    /// `min` once away; `settled`: it follows its `on_expiry` at once.
    fn new(demand: KeyDemand, min: Duration, settled: bool) -> Self {
        KeyState {
            demand,
            lease: None,
            hold_until: None,
            server_safe: None,
            fleet: None,
            spare: 0.0,
            share_safe: false,
            fresh: false,
            credit: 0.0,
            bucket: 0.0,
            pooled: 0.0,
            renews: None,
            template: None,
            mode: Mode::Pending,
            last_error: None,
            cached: false,
            away: false,
            early_wait: min,
            asked_with: None,
            asked: false,
            settled,
            allot: None,
            due: None,
        }
    }

    /// Whether the demand is away from the lease (see [`Core::set_demand`]);
    /// a key that is not asks early again after the minimum interval.
    fn restate(&mut self, min: Duration) -> bool {
        let d = &self.demand;
        let lease = self.lease.filter(|_| self.mode == Mode::Leased).map(|l| (l.capacity, self.earned(&l)));
        // Spare capacity is not given back: the server hands it out because nobody wants it.
        self.away = lease.is_some_and(|(c, earned)| {
            (d.pressure && d.wants > c + 1e-9) || d.wants < earned * (1.0 - GIVE_BACK) - 1e-9
        });
        if !self.away {
            self.early_wait = min;
        }
        self.away
    }

    /// Whether the key has requests waiting beyond its lease while the
    /// server's last answer said its pool holds at least a unit: it asks
    /// again after [`POOL_ASK`], not after its early wait.
    fn draws(&self) -> bool {
        self.away
            && self.pooled >= 1.0
            && self.demand.pressure
            && self.lease.is_some_and(|l| self.mode == Mode::Leased && self.demand.wants > l.capacity + 1e-9)
    }

    /// What `lease` grants for the key's wants: the lease without its spare part.
    fn earned(&self, lease: &Lease) -> f64 {
        (lease.capacity - self.spare).max(0.0)
    }

    /// Whether an early refresh made before `by` carries it: a key made
    /// since the last answer with no lease yet, one whose demand is away
    /// from its lease, or one whose own refresh is due by then. The others
    /// wait for the refresh of every key, when it is due.
    fn asks_early(&self, by: Time) -> bool {
        self.away
            || (self.mode == Mode::Pending && self.lease.is_none())
            || self.due.is_some_and(|d| d <= by)
            || self.allot.as_ref().and_then(|a| a.boundary).is_some_and(|b| b <= by)
    }

    /// The account its request reports: while it holds an allotment.
    fn account(&self) -> Option<usher_limit::allot::Account> {
        self.demand.account.as_deref().copied().filter(|_| self.allot.is_some())
    }

    /// When the key changes mode by itself (its lease expires, its hold ends).
    fn lapse(&self) -> Option<Time> {
        match self.mode {
            Mode::Leased => self.lease.map(|l| l.expiry),
            Mode::Held => self.hold_until,
            Mode::Pending | Mode::Expired => None,
        }
    }

    /// Keeps what a server said of the key's resource beside its lease at
    /// `now`: its safe capacity, the capacity it shares, when a spent quota
    /// renews, and the template the key matched (`last`: the name of the
    /// last one, which most keys share).
    fn heard(&mut self, r: &proto::ResourceResponse, now: Time, last: &mut Option<Arc<str>>) {
        self.server_safe = r.safe_capacity.filter(|s| s.is_finite());
        self.fleet = r.resource_capacity.filter(|c| c.is_finite() && *c > 0.0);
        self.spare = r.spare.filter(|c| c.is_finite() && *c > 0.0).map_or(0.0, |c| c.min(r.gets.capacity.max(0.0)));
        self.share_safe = r.share_safe == Some(true);
        self.fresh |= r.fresh == Some(true);
        self.credit += r.credit.filter(|c| c.is_finite() && *c > 0.0).unwrap_or(0.0);
        self.bucket = r.bucket.filter(|b| b.is_finite() && *b > 0.0).map_or(0.0, |b| b as f32);
        self.pooled = r.pooled.filter(|p| p.is_finite() && *p > 0.0 && self.bucket > 0.0).map_or(0.0, |p| p as f32);
        self.renews =
            r.upstream_quota.as_ref().and_then(super::quota::from_proto).filter(|o| o.exhausted(now)).map(|o| o.reset);
        self.template = match (&r.template, &self.template) {
            (None, _) => None,
            (Some(t), Some(kt)) if **kt == **t => Some(kt.clone()),
            // Most keys match one template: share its name.
            (Some(t), _) => match &*last {
                Some(l) if **l == **t => Some(l.clone()),
                _ => {
                    let t: Arc<str> = Arc::from(t.as_str());
                    *last = Some(t.clone());
                    Some(t)
                }
            },
        };
    }

    /// How long to wait before the next early ask, once one made while the
    /// key held `asked_with` is answered with `lease`: `min` if the lease
    /// moved towards `wants` or asks to hear from the key within [`SOON`];
    /// else twice the last wait, and from the refresh interval on
    /// `Duration::MAX` (the key waits for its refresh).
    fn early_wait_after(&self, asked_with: f64, lease: &Lease, min: Duration) -> Duration {
        let w = self.demand.wants;
        let moved = (w - self.earned(lease)).abs() < (w - asked_with).abs() - 1e-9;
        if moved || lease.refresh_interval <= SOON {
            min
        } else {
            match self.early_wait.saturating_mul(2).max(min) {
                w if w >= lease.refresh_interval => Duration::MAX,
                w => w,
            }
        }
    }

    /// Takes a lease answered at `now`: enforced if unexpired, held past its
    /// expiry as [`hold`] says (`jitter`: the refresh jitter). Returns the
    /// mode the key had.
    fn take(&mut self, lease: Lease, now: Time, jitter: f64) -> Mode {
        self.lease = Some(lease);
        let short = self.demand.on_expiry == OnExpiry::Safe && self.share_safe;
        self.hold_until = (lease.expiry > now)
            .then(|| lease.expiry.saturating_add(hold(&lease, self.server_safe, short, now, jitter)));
        self.cached = false;
        self.last_error = None;
        let from = self.mode;
        self.mode = if lease.expiry > now { Mode::Leased } else { Mode::Expired };
        from
    }

    fn capacity(&self) -> Capacity {
        match (self.mode, self.lease) {
            (Mode::Leased, Some(l)) => Capacity::Limited(l.capacity),
            // Held with on_expiry safe: no more than the safe capacity (see [`hold`]).
            (Mode::Held, Some(l)) => match (self.demand.on_expiry, self.fallback()) {
                (OnExpiry::Safe, Capacity::Limited(s)) if self.share_safe => Capacity::Limited(l.capacity.min(s)),
                _ => Capacity::Limited(l.capacity),
            },
            _ => self.fallback(),
        }
    }

    /// What the key may use with no lease: its `on_expiry`.
    fn fallback(&self) -> Capacity {
        match self.demand.on_expiry {
            OnExpiry::Optimistic => Capacity::Limited(self.demand.wants),
            OnExpiry::Pessimistic => Capacity::Limited(0.0),
            OnExpiry::Safe => match self.server_safe.or(self.demand.safe_capacity) {
                Some(s) if s < 0.0 => Capacity::Unlimited,
                Some(s) => Capacity::Limited(s),
                None => Capacity::Limited(0.0),
            },
        }
    }
}

/// What a key with an allotment keeps beside its lease.
#[derive(Debug, Clone, Default)]
struct KeyAllot {
    /// When it asks again after its unit's reset (see [`BOUNDARY_SPREAD`]);
    /// kept in [`Core::boundaries`] too.
    boundary: Option<Time>,
    /// The mark of the account the request in flight carried.
    asked_mark: Option<f64>,
}

/// Why a key enforces a capacity of 0, as logs, status pages and 429s say it.
pub struct ZeroReason;

impl ZeroReason {
    /// The lease is 0.
    pub const LEASE_ZERO: &'static str = "the lease is 0: the server gave this key nothing (its capacity is \
         given out, or it is in learning mode after a master change and hands back only what a client already had)";
    /// No lease has come, and on_expiry is safe with no safe capacity.
    pub const NO_LEASE_NO_SAFE: &'static str = "no lease yet and no safe capacity";
    /// The lease expired, and on_expiry is safe with no safe capacity.
    pub const EXPIRED_NO_SAFE: &'static str = "the lease expired and there is no safe capacity";
    /// No lease, and on_expiry is safe with a safe capacity of 0.
    pub const SAFE_ZERO: &'static str = "no lease, and the safe capacity is 0";
    /// No lease, and on_expiry is pessimistic.
    pub const PESSIMISTIC: &'static str = "no lease, and on_expiry is pessimistic";
    /// No lease, and on_expiry is optimistic while the key wants 0.
    pub const WANTS_ZERO: &'static str = "no lease, and on_expiry is optimistic but it wants 0";
    /// The lease is 0 because the quota the server follows is spent until it renews.
    pub const QUOTA_SPENT: &'static str =
        "the quota the server follows (the upstream's own, or a calendar window) is spent until it renews";
}

impl KeyState {
    /// Why the key enforces 0 now, if it does.
    fn zero_reason(&self) -> Option<&'static str> {
        if self.capacity() != Capacity::Limited(0.0) {
            return None;
        }
        Some(match (self.mode, self.lease) {
            (Mode::Leased | Mode::Held, Some(_)) if self.renews.is_some() => ZeroReason::QUOTA_SPENT,
            (Mode::Leased, Some(_)) => ZeroReason::LEASE_ZERO,
            (Mode::Held, Some(l)) if l.capacity <= 0.0 => ZeroReason::LEASE_ZERO,
            (mode, _) => match self.demand.on_expiry {
                OnExpiry::Pessimistic => ZeroReason::PESSIMISTIC,
                OnExpiry::Optimistic => ZeroReason::WANTS_ZERO,
                OnExpiry::Safe => match (self.server_safe.or(self.demand.safe_capacity), mode) {
                    (Some(_), _) => ZeroReason::SAFE_ZERO,
                    (None, Mode::Pending) => ZeroReason::NO_LEASE_NO_SAFE,
                    (None, _) => ZeroReason::EXPIRED_NO_SAFE,
                },
            },
        })
    }
}

/// How long a lapsed `lease`, received at `now`, is held (see [`Mode::Held`]).
///
/// `short`: `on_expiry` is safe and the safe capacity is the key's share of
/// the resource (an usher server's default), which may be above its lease:
/// an idle key holds little or nothing and falls back on more. Then the
/// lease is held for one refresh interval (jittered as refreshes
/// are, `jitter`), at the lease or the safe capacity, whichever is less; then
/// the key runs on its safe capacity, whatever the lease length. No other
/// client's lease outlives that interval: the servers stopped answering this
/// key less than a refresh interval after its last lease, and granted nobody
/// anything after that. So once it is over every client of the resource is
/// at or below its safe capacity, and the safe capacities (shares, by
/// default) add up to no more than the capacity. Before it, a key uses no
/// more than its lease, and the leases add up to no more either.
///
/// (A second more: expiries go on the wire in whole seconds.) A lease cut
/// short, shorter than its refresh interval (an intermediate's, near the end
/// of its own lease), says nothing of how long the others' last: it is held
/// as with the other `on_expiry`s.
///
/// Otherwise (a configured safe capacity, never above the lease; another
/// `on_expiry`; a server that does not say), as long as it was granted for;
/// with a safe capacity above the lease, a refresh interval more. Every key
/// then comes down only once the others' holds are over, and a long outage
/// costs nothing for a lease length.
fn hold(lease: &Lease, safe: Option<f64>, short: bool, now: Time, jitter: f64) -> Duration {
    let stagger = lease.refresh_interval.mul_f64(1.0 + jitter.clamp(0.0, 1.0));
    let held = lease.expiry.since(now);
    if short && held >= lease.refresh_interval {
        return stagger + Duration::from_secs(1);
    }
    match safe {
        Some(s) if s > lease.capacity + 1e-9 => held + stagger,
        _ => held,
    }
}

/// The allotment an answer carries (usher's extension), and the reset of the
/// unit it is of (the quota the answer names): both, or neither.
fn allotment_of(r: &proto::ResourceResponse) -> Option<(f64, Time)> {
    let units = r.allotment.filter(|u| u.is_finite() && *u >= 0.0)?;
    let quota = r.upstream_quota.as_ref().and_then(super::quota::from_proto).filter(|o| !o.continuous)?;
    Some((units, quota.reset))
}

/// The earlier of two times, `None` being never.
fn earliest(a: Option<Time>, b: Option<Time>) -> Option<Time> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// When the leases of one answer ask to be refreshed, and how the lapses of
/// their keys moved, gathered as [`Core::on_refresh`] takes them.
struct Answer {
    now: Time,
    /// The minimum interval between requests.
    min: Duration,
    /// How far into its refresh interval each lease asks to be refreshed (a
    /// jittered second, read as a factor): one draw for the whole answer, so
    /// the keys it carried stay together.
    spread: Duration,
    /// The shortest draw of the jitter, as a fraction of an interval.
    shortest: f64,
    /// The refresh of every key: the first a lease asks for, leaving out
    /// leases that ask within a second or are cut short (their keys ask on
    /// their own), unless every lease is such.
    regular: Option<Time>,
    /// The first refresh a lease cut short asks for.
    cut_first: Option<Time>,
    /// The first refresh any lease asks for.
    first: Option<Time>,
    /// The keys that may ask on their own, and when.
    own: Vec<(String, Time)>,
    /// A key whose lapse was the earliest got a new lease: [`Core::lapse`]
    /// is worked out once, at the end, not once a key.
    relapse: bool,
    /// The earliest lapse of the keys that got a lease.
    later: Option<Time>,
}

impl Answer {
    fn new(now: Time, cfg: &CoreConfig, rng: &mut SmallRng) -> Self {
        Answer {
            now,
            min: cfg.min_interval,
            spread: jitter(Duration::from_secs(1), cfg.jitter, rng),
            shortest: 1.0 - cfg.jitter.clamp(0.0, 1.0),
            regular: None,
            cut_first: None,
            first: None,
            own: Vec::new(),
            relapse: false,
            later: None,
        }
    }

    /// When `l` asks to be refreshed; also when it must be renewed by
    /// (before it runs out, leaving room for one retry), and whether it is
    /// cut short: it runs out before even the shortest draw of its interval
    /// (capped at an intermediate's own expiry, or answered already expired).
    fn next_of(&self, l: &Lease) -> (Time, Time, bool) {
        let now = self.now;
        let margin = (l.expiry.since(now) / 10).max(Duration::from_millis(500));
        let next = now.saturating_add(l.refresh_interval.mul_f64(self.spread.as_secs_f64()));
        let by_expiry = l.expiry.saturating_sub(margin);
        let cut = by_expiry < now.saturating_add(l.refresh_interval.mul_f64(self.shortest));
        (next.min(by_expiry).max(now.saturating_add(self.min)), by_expiry, cut)
    }

    /// Notes the refresh that key `id`'s new `lease` asks for: the
    /// refresh of every key (unless the call was `partial`), or one of its
    /// own before `next_refresh`.
    fn schedule(&mut self, id: String, lease: &Lease, partial: bool, next_refresh: Time) {
        let (next, by_expiry, cut) = self.next_of(lease);
        let soon = lease.refresh_interval <= SOON;
        self.first = earliest(self.first, Some(next));
        if cut && !soon {
            self.cut_first = earliest(self.cut_first, Some(next));
        }
        // An early answer gives a key a refresh of its own only if it
        // cannot wait for every key's (it would ask within a second, or
        // its lease would run out first); the others join that refresh.
        if soon || cut || (partial && by_expiry < next_refresh) {
            self.own.push((id, next));
        } else if !partial {
            self.regular = earliest(self.regular, Some(next));
        }
    }
}

/// Tunables of the lease client; defaults are documented in the README.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// The id sent with every request; servers key their leases by it.
    pub client_id: String,
    /// Capacity server addresses of one node; any of them, Discovery finds the master.
    pub servers: Vec<String>,
    /// Refresh times are drawn from `interval × (1 ± jitter)`.
    pub jitter: f64,
    /// Never ask more often than this (the server's minimum request interval).
    pub min_interval: Duration,
    /// How failed calls are retried.
    pub backoff: BackoffConfig,
    /// Seeds the jitter, so that a test or a simulation draws the same times again.
    pub seed: u64,
}

impl CoreConfig {
    /// The defaults for `client_id` calling `servers`, with a random seed.
    pub fn new(client_id: impl Into<String>, servers: Vec<String>) -> Self {
        CoreConfig {
            client_id: client_id.into(),
            servers,
            jitter: 1.0 / 6.0,
            min_interval: Duration::from_secs(1),
            backoff: BackoffConfig::default(),
            seed: rand::random(),
        }
    }
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Ask `target` who the master is.
    Discover {
        /// The server to ask.
        target: String,
    },
    /// Send this bulk request to `target`.
    Refresh {
        /// The master.
        target: String,
        /// The keys carried and what each wants and has.
        request: proto::GetCapacityRequest,
    },
    /// Give these leases back.
    Release {
        /// The master.
        target: String,
        /// The keys given back.
        request: proto::ReleaseCapacityRequest,
    },
    /// Nothing to do before this time (or before new demand arrives).
    Wait {
        /// When to ask [`Core::next_action`] again at the latest.
        until: Time,
    },
}

/// A failed call, classified.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The server rejected the request itself: retrying it unchanged will fail again.
    Permanent(String),
    /// Unreachable, timed out, overloaded: try again, perhaps elsewhere.
    Transient(String),
}

impl CallError {
    /// Classifies a gRPC status: a request the server cannot take
    /// (`InvalidArgument`, `Unimplemented`, `PermissionDenied`,
    /// `Unauthenticated`) is permanent, anything else transient.
    pub fn from_status(s: &tonic::Status) -> Self {
        let msg = format!("{:?}: {}", s.code(), s.message());
        match s.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::Unimplemented
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated => CallError::Permanent(msg),
            _ => CallError::Transient(msg),
        }
    }

    fn message(&self) -> &str {
        match self {
            CallError::Permanent(m) | CallError::Transient(m) => m,
        }
    }
}

/// A change of a key's mode, for logs and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The key.
    pub resource_id: String,
    /// Its mode before.
    pub from: Mode,
    /// Its mode now.
    pub to: Mode,
    /// What it may use in its new mode.
    pub capacity: Capacity,
}

/// A lease an answer carried for one of the keys that the client did not
/// take (see [`Core::on_refresh`]), for logs.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    /// The key whose lease was refused.
    pub resource_id: String,
    /// Names the resource, the server and what was wrong, as the key's
    /// `last_error` shows it.
    pub message: String,
}

/// What is wrong with a lease in an answer, in the words a server uses for
/// the same fields of a request (`server::service`) and of its resources
/// file (`safe_capacity`); `None` if nothing.
fn check_lease(r: &proto::ResourceResponse) -> Option<String> {
    let c = r.gets.capacity;
    if !c.is_finite() || c < 0.0 {
        return Some(format!("gets.capacity must be a finite number >= 0, got {c}"));
    }
    match r.safe_capacity {
        Some(s) if !(s == -1.0 || (s.is_finite() && s >= 0.0)) => {
            Some(format!("safe_capacity must be -1 (unlimited), 0 (stop) or a positive capacity, got {s}"))
        }
        _ => None,
    }
}

/// The lease client's state.
pub struct Core {
    cfg: CoreConfig,
    /// Boxed: a tree node holds eleven entries and is often half full, so
    /// with many keys (a sidecar's tenants) a state in place cost twice its size.
    keys: BTreeMap<String, Box<KeyState>>,
    /// Keys whose capacity may have changed since [`Core::take_changes`]
    /// last returned them: the enforcement side applies these only, not
    /// every key at every poll. Ids of keys since removed are skipped there.
    changed: BTreeSet<String>,
    /// A lease or a mode changed since the last demand update: whether each
    /// key is away is worked out again at the next one, for keys it leaves
    /// out too.
    restate: bool,
    /// The earliest [`KeyState::lapse`] of any key (`None`: no key lapses),
    /// kept up to date as leases come and keys go: no key changes mode by
    /// itself before then, so [`Core::expire`] visits every key only then.
    lapse: Option<Time>,
    /// How many keys are away: with none, no key is visited for an early ask.
    away: usize,
    /// The keys whose own refresh comes before every key's, by time (see
    /// [`KeyState::due`]): an early call is due at the first.
    dues: BTreeSet<(Time, String)>,
    to_release: Vec<String>,
    /// The keys with an allotment, by when they ask again after their
    /// unit's reset ([`KeyAllot::boundary`]).
    boundaries: BTreeSet<(Time, String)>,
    /// How long after a reset this client asks (drawn once in [`BOUNDARY_SPREAD`]).
    boundary_offset: Duration,
    /// Allotments to hand to the enforcement side, or their end (`None`).
    allotments: Vec<(String, Option<usher_limit::allot::Allotment>)>,
    /// The last template name a server sent, shared by the keys that match it.
    last_template: Option<Arc<str>>,
    master: Option<String>,
    rotation: usize,
    /// Servers still to try at once before the next backoff step: a server
    /// that fails (its master died, say) sends the client straight on to the
    /// next one, and the backoff grows once per round of all of them.
    next_at_once: usize,
    redirects: u32,
    backoff: Backoff,
    rng: SmallRng,
    next_refresh: Time,
    last_request: Option<Time>,
    in_flight: bool,
    /// When the call in flight (or the last one) was made: a transient
    /// failure's backoff counts from there, so a call that hung until its
    /// timeout (a TLS handshake with a server still starting) is retried
    /// once the backoff since it began has passed, not a backoff later.
    attempt_started: Time,
    early: bool,
    /// The call in flight is an early one and carries only the keys that
    /// ask early ([`KeyState::asks_early`]): its answer leaves the refresh
    /// of every key where it was, and gives a key it carried a refresh of
    /// its own if its lease asks for one sooner ([`KeyState::due`]).
    partial: bool,
    last_error: Option<String>,
    /// A call to the servers (a refresh or a discovery; not a release)
    /// failed and no refresh has succeeded since: until one does, calls
    /// follow the backoff alone (no early asks), each carries every key,
    /// and a new key follows its `on_expiry` at once.
    failing: bool,
    transitions: Vec<Transition>,
    refreshes: u64,
}

/// One key as status pages show it.
#[derive(Debug, Clone, Serialize)]
pub struct KeyStatus {
    /// The key.
    pub resource_id: String,
    /// Where its capacity comes from, by lease state.
    pub mode: Mode,
    /// Where its capacity comes from, by origin.
    pub source: Source,
    /// What it may use with no unexpired lease.
    pub on_expiry: OnExpiry,
    /// What it may use now.
    pub capacity: Capacity,
    /// What it asks for.
    pub wants: f64,
    /// The capacity of its last lease, expired or not.
    pub has: Option<f64>,
    /// When its last lease ends (unix seconds).
    pub expiry: Option<i64>,
    /// Its last lease's refresh interval, in seconds.
    pub refresh_interval_s: Option<u64>,
    /// The safe capacity its `on_expiry` uses: the server's, else the configured one.
    pub safe_capacity: Option<f64>,
    /// The capacity server's template (`identifier_glob`) the key matched,
    /// when the server says (usher servers do; a catch-all `*` there may be a
    /// typo in the id or in the server's configuration).
    pub template: Option<String>,
    /// Why its last call failed, or why its lease in the last answer was refused.
    pub last_error: Option<String>,
    /// When it asks on its own, before every key's refresh (unix seconds):
    /// its lease wants renewing sooner.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub asks_at: Option<i64>,
    /// Why the key enforces 0, when it does (see [`ZeroReason`]).
    pub zero_reason: Option<&'static str>,
}

impl Core {
    /// A client with no key, whose first call is due at `now`.
    pub fn new(cfg: CoreConfig, now: Time) -> Self {
        // (A draw of its own: the refresh jitter's sequence stays as it was.)
        let mut own = SmallRng::seed_from_u64(cfg.seed ^ 0x5ca1_ab1e);
        let boundary_offset = BOUNDARY_SPREAD.mul_f64(rand::Rng::random_range(&mut own, 0.0..1.0));
        Core {
            rng: SmallRng::seed_from_u64(cfg.seed),
            boundaries: BTreeSet::new(),
            boundary_offset,
            allotments: Vec::new(),
            backoff: Backoff::new(cfg.backoff),
            next_at_once: cfg.servers.len().saturating_sub(1),
            cfg,
            keys: BTreeMap::new(),
            changed: BTreeSet::new(),
            restate: false,
            lapse: None,
            away: 0,
            dues: BTreeSet::new(),
            to_release: Vec::new(),
            last_template: None,
            master: None,
            rotation: 0,
            redirects: 0,
            next_refresh: now,
            last_request: None,
            attempt_started: now,
            in_flight: false,
            early: false,
            partial: false,
            last_error: None,
            failing: false,
            transitions: Vec::new(),
            refreshes: 0,
        }
    }

    /// The id sent with every request.
    pub fn client_id(&self) -> &str {
        &self.cfg.client_id
    }

    /// The server calls go to, once Discovery or a redirect named it.
    pub fn master(&self) -> Option<&str> {
        self.master.as_deref()
    }

    /// What went wrong last: a failed call or release, or a lease the last answer refused.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// Whether a call to the servers failed and no refresh has succeeded
    /// since (a failed release does not count: its leases simply expire on
    /// the server).
    pub fn failing(&self) -> bool {
        self.failing
    }

    /// When every key's refresh is due (or, while no master is known, the next Discovery).
    pub fn next_refresh(&self) -> Time {
        self.next_refresh
    }

    /// The next moment a key's capacity can change that the client knows
    /// of: its next call to the servers (every key's refresh, or a key's own
    /// earlier one), or a lease's expiry or the end of its hold. A refusal's
    /// `Retry-After` says no later (see `usher_limit::admit`).
    pub fn next_renewal(&self) -> Time {
        let own = self.dues.first().map(|(t, _)| *t);
        let boundary = self.boundaries.first().map(|(t, _)| *t);
        let next = earliest(earliest(Some(self.next_refresh), own), self.lapse);
        earliest(next, boundary).unwrap_or(self.next_refresh)
    }

    /// The allotments received since the last call, for the enforcement
    /// side, and the keys whose allotment ended (`None`: the lease lapsed, or
    /// the servers no longer send one).
    pub fn take_allotments(&mut self) -> Vec<(String, Option<usher_limit::allot::Allotment>)> {
        std::mem::take(&mut self.allotments)
    }

    /// Sets when the key `id` asks after its unit's reset (`None`: not).
    fn set_boundary(&mut self, id: &str, at: Option<Time>) {
        let Some(k) = self.keys.get_mut(id) else { return };
        let Some(a) = k.allot.as_mut() else { return };
        if a.boundary == at {
            return;
        }
        if let Some(old) = std::mem::replace(&mut a.boundary, at) {
            self.boundaries.remove(&(old, id.to_string()));
        }
        if let Some(t) = at {
            self.boundaries.insert((t, id.to_string()));
        }
    }

    /// Ends the allotment of key `id`, if it has one: the enforcement side hears of it.
    fn end_allotment(&mut self, id: &str) {
        self.set_boundary(id, None);
        if let Some(k) = self.keys.get_mut(id)
            && k.allot.take().is_some()
        {
            self.allotments.push((id.to_string(), None));
        }
    }

    /// Moves the next regular refresh to `at`, for a simulation or a test
    /// that looks at early refreshes alone.
    pub fn set_next_refresh(&mut self, at: Time) {
        self.next_refresh = at;
    }

    /// Successful bulk refreshes so far.
    pub fn refreshes(&self) -> u64 {
        self.refreshes
    }

    /// Installs a lease known from elsewhere (the on-disk cache): enforced at
    /// once if unexpired, and reported as `has` so a learning server hands it back.
    pub fn preload(&mut self, mut demand: KeyDemand, lease: Lease, now: Time) {
        if lease.expiry <= now {
            return;
        }
        let id = std::mem::take(&mut demand.resource_id);
        self.changed.insert(id.clone());
        self.restate = true;
        let before = self.keys.insert(
            id.clone(),
            Box::new(KeyState {
                lease: Some(lease),
                mode: Mode::Leased,
                cached: true,
                ..KeyState::new(demand, self.cfg.min_interval, false)
            }),
        );
        self.away -= usize::from(before.as_ref().is_some_and(|k| k.away));
        if let Some(b) = before.as_ref().and_then(|k| k.allot.as_ref()).and_then(|a| a.boundary) {
            self.boundaries.remove(&(b, id.clone()));
        }
        if let Some(d) = before.as_ref().and_then(|k| k.due) {
            self.dues.remove(&(d, id));
        }
        self.lapsed(before.and_then(|k| k.lapse()), Some(lease.expiry));
    }

    /// Spreads the first refresh uniformly over `window` (a fleet restarting
    /// together must not refresh together).
    pub fn delay_first_refresh(&mut self, now: Time, window: Duration) {
        let d = window.mul_f64(rand::Rng::random_range(&mut self.rng, 0.0..1.0));
        self.next_refresh = now.saturating_add(d);
    }

    /// Replaces the demand. New keys ask for a refresh at once; keys that
    /// disappeared are released. A key whose demand is away from its lease
    /// asks early (after the minimum interval): under pressure with `wants`
    /// above the lease (it may get more), or with `wants` more than
    /// [`GIVE_BACK`] below it (what it holds idle goes to others sooner). An
    /// early ask whose answer did not move the lease towards `wants` (the
    /// server had nothing more, or learns) doubles the wait for the next
    /// one, unless the server asked to hear from it within [`SOON`], and
    /// past the refresh interval the key waits for its refresh: in a steady
    /// overload the request rate is the one the server asks for.
    pub fn set_demand(&mut self, demand: Vec<KeyDemand>) {
        self.update_demand(DemandUpdate { changed: demand, removed: Vec::new(), complete: true, rebuilt: false });
    }

    /// [`set_demand`](Self::set_demand) for the keys in `update`: a key
    /// left out of an update that is not `complete` keeps its last demand,
    /// so a sidecar with many keys reports only those whose demand changed
    /// and those it forgot.
    pub fn update_demand(&mut self, update: DemandUpdate) {
        let DemandUpdate { changed, removed, complete, rebuilt } = update;
        let fresh: BTreeMap<String, KeyDemand> =
            changed.into_iter().map(|mut d| (std::mem::take(&mut d.resource_id), d)).collect();
        let gone: Vec<String> = match complete {
            true => self.keys.keys().filter(|k| !fresh.contains_key(*k)).cloned().collect(),
            false => removed.into_iter().filter(|k| !fresh.contains_key(k) && self.keys.contains_key(k)).collect(),
        };
        let mut relapse = false;
        for id in gone {
            self.changed.remove(&id);
            if let Some(k) = self.keys.remove(&id) {
                relapse |= k.lapse().is_some() && k.lapse() == self.lapse;
                self.away -= usize::from(k.away);
                if let Some(d) = k.due {
                    self.dues.remove(&(d, id.clone()));
                }
                if let Some(b) = k.allot.and_then(|a| a.boundary) {
                    self.boundaries.remove(&(b, id.clone()));
                }
            }
            self.to_release.push(id);
        }
        if relapse {
            self.lapsed(self.lapse, None);
        }
        let min = self.cfg.min_interval;
        // Every key is restated below when the update is complete.
        if std::mem::take(&mut self.restate) && !complete {
            for (_, k) in self.keys.iter_mut().filter(|(id, _)| !fresh.contains_key(*id)) {
                self.away = self.away - usize::from(k.away) + usize::from(k.restate(min));
            }
        }
        for (id, d) in fresh {
            match self.keys.get_mut(&id) {
                Some(k) => {
                    // Without a lease, demand decides the capacity (on_expiry).
                    let before = k.capacity();
                    k.demand = d;
                    self.away = self.away - usize::from(k.away) + usize::from(k.restate(min));
                    if k.capacity() != before {
                        self.changed.insert(id);
                    }
                }
                None => {
                    self.early = true;
                    self.to_release.retain(|r| *r != id);
                    self.changed.insert(id.clone());
                    self.keys.insert(
                        id,
                        // While the servers fail, a new key follows its
                        // `on_expiry` at once, as every other key does.
                        Box::new(KeyState::new(d, self.cfg.min_interval, self.failing)),
                    );
                }
            }
        }
        if rebuilt {
            self.mark_all_changed();
        }
    }

    /// The capacity each key may use now, after applying expiries at `now`.
    pub fn capacities(&mut self, now: Time) -> Vec<(String, Capacity)> {
        self.expire(now);
        self.keys.iter().map(|(id, k)| (id.clone(), k.capacity())).collect()
    }

    /// The capacity of each key whose capacity may have changed since the
    /// last call (a key was made, a lease arrived, expired or ended its hold,
    /// demand moved an `on_expiry` capacity), after applying expiries at
    /// `now`, and of the keys in `also`, changed or not. A key with no lease
    /// yet is left out and kept for a later call until a request that carried
    /// it was answered or a call failed (it keeps the capacity it was made
    /// with: a new key is not refused for the round trip its lease takes, nor
    /// is the request that made it, whenever the demand is read), unless
    /// `force_pending` (the start-up wait is over while the first call hangs).
    pub fn take_changes(&mut self, now: Time, also: &[String], force_pending: bool) -> Vec<(String, Capacity)> {
        self.expire(now);
        let changed = std::mem::take(&mut self.changed);
        let also = also.iter().filter(|id| !changed.contains(*id)).cloned();
        let mut out = Vec::new();
        for id in changed.iter().cloned().chain(also) {
            let Some(k) = self.keys.get(&id) else { continue };
            if k.mode == Mode::Pending && !k.settled && !force_pending {
                self.changed.insert(id);
            } else {
                out.push((id, k.capacity()));
            }
        }
        out
    }

    /// Makes [`take_changes`](Self::take_changes) return every key once more
    /// (the enforcement side was rebuilt: its keys start from their
    /// configured capacity).
    pub fn mark_all_changed(&mut self) {
        self.changed.extend(self.keys.keys().cloned());
    }

    /// One key's capacity now: [`capacities`](Self::capacities) without
    /// building the list (`usher sim` asks for it per client and step).
    pub fn capacity(&mut self, resource_id: &str, now: Time) -> Option<Capacity> {
        self.expire(now);
        self.keys.get(resource_id).map(|k| k.capacity())
    }

    /// Mode changes since the last call.
    pub fn take_transitions(&mut self) -> Vec<Transition> {
        std::mem::take(&mut self.transitions)
    }

    /// Keeps [`Core::lapse`] true after a key's lapse moved from `before` to `after`.
    fn lapsed(&mut self, before: Option<Time>, after: Option<Time>) {
        if before.is_some() && before == self.lapse {
            self.lapse = self.keys.values().filter_map(|k| k.lapse()).min();
        } else {
            self.lapse = earliest(self.lapse, after);
        }
    }

    fn expire(&mut self, now: Time) {
        if self.lapse.is_none_or(|t| t > now) {
            return;
        }
        let mut lapse: Option<Time> = None;
        for (id, k) in self.keys.iter_mut() {
            let from = k.mode;
            let held = k.hold_until.is_some_and(|h| h > now);
            k.mode = match from {
                Mode::Leased if k.lease.is_some_and(|l| l.expiry <= now) => {
                    if held {
                        Mode::Held
                    } else {
                        Mode::Expired
                    }
                }
                Mode::Held if !held => Mode::Expired,
                m => m,
            };
            if k.mode == Mode::Expired
                && let Some(a) = k.allot.take()
            {
                // Its `on_expiry` applies now, not what was left of its allotment.
                if let Some(b) = a.boundary {
                    self.boundaries.remove(&(b, id.clone()));
                }
                self.allotments.push((id.clone(), None));
            }
            if k.mode != from {
                self.changed.insert(id.clone());
                self.restate = true;
                self.transitions.push(Transition { resource_id: id.clone(), from, to: k.mode, capacity: k.capacity() });
            }
            lapse = earliest(lapse, k.lapse());
        }
        self.lapse = lapse;
    }

    /// When the next key changes mode by itself (a lease expires, a hold
    /// ends): a driver that sleeps until an action is due must wake then to
    /// apply it.
    fn next_lapse(&self) -> Option<Time> {
        self.lapse
    }

    fn target(&self) -> Option<String> {
        self.master.clone().or_else(|| self.cfg.servers.get(self.rotation % self.cfg.servers.len().max(1)).cloned())
    }

    /// What to do now. Call again after every result and whenever demand
    /// changes. A wait ends no later than the next lease expiry or end of a
    /// hold, when the capacities change by themselves.
    pub fn next_action(&mut self, now: Time) -> Action {
        match self.next_action_unbounded(now) {
            Action::Wait { until } => {
                Action::Wait { until: self.next_lapse().map_or(until, |t| until.min(t).max(now)) }
            }
            a => a,
        }
    }

    fn next_action_unbounded(&mut self, now: Time) -> Action {
        self.expire(now);
        if self.in_flight {
            return Action::Wait { until: self.next_refresh.max(now.saturating_add(Duration::from_millis(100))) };
        }
        let Some(target) = self.target() else {
            return Action::Wait { until: now.saturating_add(Duration::from_secs(3600)) };
        };
        if self.master.is_none() {
            if now < self.next_refresh {
                return Action::Wait { until: self.next_refresh };
            }
            self.in_flight = true;
            self.attempt_started = now;
            return Action::Discover { target };
        }
        if !self.to_release.is_empty() {
            let ids = std::mem::take(&mut self.to_release);
            return Action::Release {
                target,
                request: proto::ReleaseCapacityRequest { client_id: self.cfg.client_id.clone(), resource_id: ids },
            };
        }
        // While the servers fail, the backoff alone says when to call again.
        let asking = !self.failing;
        let (due, own) = self.refresh_due(now, asking);
        if self.keys.is_empty() || now < due {
            return Action::Wait {
                until: if self.keys.is_empty() { now.saturating_add(Duration::from_secs(3600)) } else { due },
            };
        }
        // Before every key's refresh is due, only the keys that ask early
        // are carried: a new tenant among 100,000 costs one resource on the
        // wire and at the server, not 100,000. Not when every key's refresh
        // is due within the minimum interval anyway (it would follow at
        // once, and the server would call the keys carried twice too
        // early), nor after a failed call (keys that lost their lease get
        // it back with the first call that succeeds).
        let by = now.saturating_add(self.cfg.min_interval);
        let mut partial = by < self.next_refresh && asking;
        if partial {
            match self.keys.values().filter(|k| k.asks_early(by)).count() {
                0 => {
                    self.early = false;
                    // (Never a wait that is already over: that would spin.)
                    let until = own.map_or(self.next_refresh, |t| t.min(self.next_refresh));
                    return Action::Wait { until: until.max(now.saturating_add(Duration::from_millis(1))) };
                }
                // Every key asks early: this is every key's refresh.
                n if n == self.keys.len() => partial = false,
                _ => {}
            }
        }
        self.refresh(now, target, partial.then_some(by))
    }

    /// When the next refresh is due: every key's, or earlier (never before
    /// the minimum interval since the last request, nor before `now`) when
    /// a new key or one away from its lease asks early, or when a key's own
    /// refresh comes (returned too). Only every key's counts unless `asking`.
    fn refresh_due(&self, now: Time, asking: bool) -> (Time, Option<Time>) {
        // One pass over the keys away from their lease (only while some
        // are): the soonest one asks again, and whether one draws on the
        // server's pool (it asks after POOL_ASK, not the minimum interval).
        let (mut drawing, mut soonest) = (false, None::<Duration>);
        if self.away > 0 && asking {
            for k in self.keys.values().filter(|k| k.away) {
                let draws = k.draws();
                drawing |= draws;
                let wait = if draws { POOL_ASK } else { k.early_wait };
                soonest = Some(soonest.map_or(wait, |s| s.min(wait)));
            }
        }
        let min = if drawing { POOL_ASK.min(self.cfg.min_interval) } else { self.cfg.min_interval };
        let earliest_allowed = self.last_request.map_or(now, |t| t.saturating_add(min));
        let mut due =
            if self.early && asking { self.next_refresh.min(earliest_allowed.max(now)) } else { self.next_refresh };
        debug_assert_eq!(self.away, self.keys.values().filter(|k| k.away).count(), "keys away");
        debug_assert_eq!(self.dues.len(), self.keys.values().filter(|k| k.due.is_some()).count(), "own refreshes");
        debug_assert!(self.dues.iter().all(|(t, id)| self.keys.get(id).is_some_and(|k| k.due == Some(*t))));
        if let (Some(last), Some(wait)) = (self.last_request, soonest) {
            due = due.min(last.saturating_add(wait).max(earliest_allowed).max(now));
        }
        // A key's own refresh.
        let own = self.dues.first().map(|(t, _)| *t).filter(|_| asking);
        if let Some(t) = own {
            due = due.min(t.max(earliest_allowed).max(now));
        }
        // A calendar unit's reset: the old unit's allotment is void, so
        // the minimum interval does not hold it back (once a unit).
        if let Some((t, _)) = self.boundaries.first().filter(|_| asking) {
            due = due.min((*t).max(now));
        }
        (due, own)
    }

    /// Sends a refresh to `target` now: of every key, or with `early` of
    /// those that ask early by then.
    fn refresh(&mut self, now: Time, target: String, early: Option<Time>) -> Action {
        let carried = |k: &KeyState| early.is_none_or(|by| k.asks_early(by));
        let partial = early.is_some();
        self.in_flight = true;
        self.partial = partial;
        self.attempt_started = now;
        self.early = false;
        self.last_request = Some(now);
        for k in self.keys.values_mut().filter(|k| carried(k)) {
            k.asked_with = k.away.then(|| k.lease.map_or(0.0, |l| k.earned(&l)));
            k.asked = true;
            let mark = k.account().map(|a| a.mark);
            if let Some(a) = k.allot.as_mut() {
                a.asked_mark = mark;
            }
        }
        Action::Refresh { target, request: self.request(now, early) }
    }

    /// The GetCapacity request the core sends at `now`: every key, or with
    /// `early` only the keys that ask before the regular refresh.
    pub fn request(&self, now: Time, early: Option<Time>) -> proto::GetCapacityRequest {
        let resource = self
            .keys
            .iter()
            .filter(|(_, k)| early.is_none_or(|by| k.asks_early(by)))
            .map(|(id, k)| proto::ResourceRequest {
                resource_id: id.clone(),
                priority: k.demand.priority,
                // A held lease is reported too (its expiry past): a server
                // learning what its predecessor's clients hold must count it.
                has: k.lease.filter(|l| (k.mode == Mode::Leased && l.expiry > now) || k.mode == Mode::Held).map(|l| {
                    proto::Lease {
                        expiry_time: l.expiry.as_secs(),
                        refresh_interval: l.refresh_interval.as_secs() as i64,
                        capacity: l.capacity,
                    }
                }),
                wants: if k.demand.wants.is_finite() { k.demand.wants.max(0.0) } else { 0.0 },
                upstream_quota: k.demand.quota.as_ref().map(super::quota::to_proto),
                window: k.demand.window,
                // What the enforcement side says of the bucket, as it sends (`Enforcer::give_back`).
                reserve: None,
                returned: None,
                backlog: None,
                unit_account: k.account().map(|a| proto::UnitAccount {
                    reset_unix_ms: (a.reset.as_nanos() / 1_000_000).min(i64::MAX as u64) as i64,
                    spent: a.spent,
                    left: a.left,
                    passed: Some(a.passed),
                    charged: Some(a.charged),
                }),
            })
            .collect();
        proto::GetCapacityRequest { client_id: self.cfg.client_id.clone(), resource }
    }

    fn fail(&mut self, now: Time, err: CallError, rotate: bool) {
        self.in_flight = false;
        for k in self.keys.values_mut() {
            (k.asked, k.settled) = (false, true);
        }
        let msg = err.message().to_string();
        if rotate {
            self.master = None;
            self.rotation = self.rotation.wrapping_add(1);
        }
        let permanent = matches!(err, CallError::Permanent(_));
        let delay = match err {
            CallError::Transient(_) if rotate && self.next_at_once > 0 => {
                self.next_at_once -= 1;
                NEXT_SERVER
            }
            // A permanent error is not retried in a tight loop: wait at least a full backoff step.
            CallError::Permanent(_) => {
                self.next_at_once = self.cfg.servers.len().saturating_sub(1);
                self.backoff.on_failure(&mut self.rng).max(super::backoff::PERMANENT_RETRY)
            }
            CallError::Transient(_) => {
                self.next_at_once = self.cfg.servers.len().saturating_sub(1);
                let d = self.backoff.on_failure(&mut self.rng);
                if self.refreshes == 0 {
                    d.min(super::backoff::jitter(FIRST_ANSWER_RETRY, self.cfg.backoff.randomization, &mut self.rng))
                } else {
                    d
                }
            }
        };
        let from = if permanent { now } else { self.attempt_started.min(now) };
        self.next_refresh = from.saturating_add(delay).max(now);
        self.last_error = Some(msg);
        self.failing = true;
    }

    /// Takes an answer to a Discovery (or its failure): a master found is
    /// called at once; otherwise the next server is tried, after a backoff.
    pub fn on_discovery(&mut self, now: Time, target: &str, result: Result<proto::DiscoveryResponse, CallError>) {
        match result {
            Ok(d) if d.is_master => self.found_master(now, target.to_string()),
            Ok(d) => match d.mastership.master_address.filter(|a| !a.is_empty()) {
                Some(addr) => self.found_master(now, addr),
                None => self.fail(now, CallError::Transient(format!("{target} knows no master")), true),
            },
            Err(e) => self.fail(now, e, true),
        }
    }

    fn found_master(&mut self, now: Time, addr: String) {
        self.in_flight = false;
        self.master = Some(addr);
        self.next_refresh = self.next_refresh.min(now);
        self.early = true;
    }

    /// Takes an answer to a release; a failure is only noted.
    pub fn on_release(&mut self, _now: Time, result: Result<proto::ReleaseCapacityResponse, CallError>) {
        if let Err(e) = result {
            // Unreleased leases simply expire on the server.
            self.last_error = Some(format!("release failed: {}", e.message()));
        }
    }

    /// Takes an answer to a refresh (or its failure). A lease the answer
    /// carries that is malformed (a capacity NaN, infinite or negative, a
    /// safe capacity other than -1 or a finite number >= 0), or any lease of
    /// a resource the answer names more than once, is refused: its key goes
    /// on as if the answer had left it out (it keeps its lease until that
    /// expires, or follows its `on_expiry`, and joins the next refresh), and
    /// says why in its `last_error` and in the client's. Returns those refused.
    pub fn on_refresh(&mut self, now: Time, result: Result<proto::GetCapacityResponse, CallError>) -> Vec<Refused> {
        let resp = match result {
            Err(e) => {
                self.refresh_failed(now, e);
                return Vec::new();
            }
            Ok(r) => r,
        };
        if let Some(m) = resp.mastership.filter(|_| resp.response.is_empty()) {
            self.redirected(now, m);
            return Vec::new();
        }
        let refused = self.refused(&resp.response);
        self.answered(&refused);
        let mut answer = Answer::new(now, &self.cfg, &mut self.rng);
        for r in resp.response {
            self.take_lease(now, r, &refused, &mut answer);
        }
        self.reschedule(now, answer);
        refused.into_iter().map(|(resource_id, message)| Refused { resource_id, message }).collect()
    }

    /// A refresh failed: every key says why, and the next call follows the
    /// backoff (to the next server, when the failure was transient).
    fn refresh_failed(&mut self, now: Time, e: CallError) {
        let rotate = matches!(e, CallError::Transient(_));
        for k in self.keys.values_mut() {
            k.last_error = Some(e.message().to_string());
        }
        self.fail(now, e, rotate);
    }

    /// An answer with no lease that names the master: calls go there at
    /// once, for a few redirects in a row; past them, or with no master
    /// named, the call failed.
    fn redirected(&mut self, now: Time, m: proto::Mastership) {
        self.in_flight = false;
        self.redirects += 1;
        match m.master_address.filter(|a| !a.is_empty()) {
            Some(addr) if self.redirects <= self.cfg.servers.len() as u32 + 2 => {
                self.master = Some(addr);
                self.next_refresh = now;
                self.early = true;
                self.last_request = None;
            }
            _ => self.fail(now, CallError::Transient("no master known; retrying".into()), true),
        }
    }

    /// A refresh was answered: the backoff eases, the client's error is the
    /// leases the answer `refused` (if any), and every key the request
    /// carried is settled.
    fn answered(&mut self, refused: &BTreeMap<String, String>) {
        self.in_flight = false;
        self.redirects = 0;
        self.refreshes += 1;
        self.next_at_once = self.cfg.servers.len().saturating_sub(1);
        self.backoff.on_success();
        self.last_error = refused.values().next().map(|m| match refused.len() {
            1 => m.clone(),
            n => format!("{m} (and {} more leases refused)", n - 1),
        });
        self.failing = false;
        // Every key the request carried was answered, with a lease or
        // without; its own refresh, if it had one, is worked out anew.
        for (id, k) in self.keys.iter_mut().filter(|(_, k)| k.asked) {
            (k.asked, k.settled) = (false, true);
            if let Some(d) = k.due.take() {
                self.dues.remove(&(d, id.clone()));
            }
            // Its answer says when it asks after the next reset.
            if let Some(b) = k.allot.as_mut().and_then(|a| a.boundary.take()) {
                self.boundaries.remove(&(b, id.clone()));
            }
        }
    }

    /// Takes one lease of an answer: its key's new capacity and mode, what
    /// the server said beside it, and when it asks to be refreshed (noted in
    /// `answer`). A lease of a key the client does not have is ignored; a
    /// `refused` one only says why.
    fn take_lease(
        &mut self,
        now: Time,
        r: proto::ResourceResponse,
        refused: &BTreeMap<String, String>,
        answer: &mut Answer,
    ) {
        let Some(k) = self.keys.get_mut(&r.resource_id) else { return };
        if let Some(message) = refused.get(&r.resource_id) {
            k.last_error = Some(message.clone());
            return;
        }
        let allotment = allotment_of(&r);
        self.restate = true;
        let before = k.capacity();
        answer.relapse |= k.lapse().is_some() && k.lapse() == self.lapse;
        let lease = Lease::granted(&r.gets);
        let bucket = k.bucket;
        k.heard(&r, now, &mut self.last_template);
        // A credit answered the ask as a grown lease would: the key may ask again as soon.
        let credited = r.credit.is_some_and(|c| c > 0.0);
        if let Some(asked_with) = k.asked_with.take() {
            k.early_wait = match credited {
                true => self.cfg.min_interval,
                false => k.early_wait_after(asked_with, &lease, self.cfg.min_interval),
            };
        }
        let from = k.take(lease, now, self.cfg.jitter);
        if from != k.mode {
            self.transitions.push(Transition {
                resource_id: r.resource_id.clone(),
                from,
                to: k.mode,
                capacity: k.capacity(),
            });
        }
        // A credit or a new bucket goes to the enforcement side with the capacity, changed or not.
        if k.capacity() != before || credited || k.bucket != bucket {
            self.changed.insert(r.resource_id.clone());
        }
        answer.later = earliest(answer.later, k.lapse());
        let leased = k.mode == Mode::Leased;
        self.take_allotment(&r.resource_id, allotment.filter(|_| leased), now);
        answer.schedule(r.resource_id, &lease, self.partial, self.next_refresh);
    }

    /// Takes the allotment (units, reset) an answer carried for key `id`, or
    /// its absence: handed to the enforcement side, with the mark of the
    /// account its request carried; the key asks again after the reset.
    fn take_allotment(&mut self, id: &str, allotment: Option<(f64, Time)>, now: Time) {
        let Some((units, reset)) = allotment else { return self.end_allotment(id) };
        let Some(k) = self.keys.get_mut(id) else { return };
        let mark = k.allot.get_or_insert_default().asked_mark.take();
        let a = usher_limit::allot::Allotment { units, reset, mark };
        self.allotments.push((id.to_string(), Some(a)));
        self.set_boundary(id, (reset > now).then(|| reset.saturating_add(self.boundary_offset)));
    }

    /// After an answer's leases are taken: the earliest lapse, the refresh
    /// of every key, and the keys that ask on their own before it.
    fn reschedule(&mut self, now: Time, answer: Answer) {
        match answer.relapse {
            true => self.lapsed(self.lapse, None),
            false => self.lapsed(None, answer.later),
        }
        // The keys an early call left out keep the refresh they had, and
        // a key it carried asks on its own if its lease wants it sooner.
        if !self.partial {
            let fallback = || {
                now.saturating_add(jitter(Duration::from_secs(5), self.cfg.jitter, &mut self.rng))
                    .max(now.saturating_add(answer.min))
            };
            self.next_refresh = answer.regular.or(answer.cut_first).or(answer.first).unwrap_or_else(fallback);
        }
        for (id, t) in answer.own.into_iter().filter(|(_, t)| *t < self.next_refresh) {
            if let Some(k) = self.keys.get_mut(&id) {
                // (An answer names a key once: a key named twice was refused above.)
                if let Some(old) = k.due.replace(t) {
                    self.dues.remove(&(old, id.clone()));
                }
                self.dues.insert((t, id));
            }
        }
    }

    /// The leases of an answer to refuse, by resource id, and why (see
    /// [`Core::on_refresh`]): only those of keys this client has.
    fn refused(&self, answer: &[proto::ResourceResponse]) -> BTreeMap<String, String> {
        let server = self.target().unwrap_or_default();
        let mut refused = BTreeMap::new();
        let mut seen = BTreeSet::new();
        for r in answer.iter().filter(|r| self.keys.contains_key(&r.resource_id)) {
            let why = match seen.insert(r.resource_id.as_str()) {
                false => Some(format!("resource `{}` appears more than once in one answer", r.resource_id)),
                true => check_lease(r),
            };
            if let Some(why) = why {
                let message = format!("lease for `{}` from {server} refused: {why}", r.resource_id);
                // The first reason stays: a duplicate of a malformed lease is refused for that.
                refused.entry(r.resource_id.clone()).or_insert(message);
            }
        }
        refused
    }

    /// Everything, for status pages.
    pub fn status(&self) -> Vec<KeyStatus> {
        self.keys
            .iter()
            .map(|(id, k)| KeyStatus {
                resource_id: id.clone(),
                mode: k.mode,
                source: match (k.mode, k.cached) {
                    (Mode::Leased, true) => Source::Cache,
                    (Mode::Leased | Mode::Held, false) => Source::Lease,
                    _ => Source::OnExpiry,
                },
                on_expiry: k.demand.on_expiry,
                capacity: k.capacity(),
                wants: k.demand.wants,
                has: k.lease.map(|l| l.capacity),
                expiry: k.lease.map(|l| l.expiry.as_secs()),
                refresh_interval_s: k.lease.map(|l| l.refresh_interval.as_secs()),
                safe_capacity: k.server_safe.or(k.demand.safe_capacity),
                template: k.template.as_deref().map(str::to_string),
                last_error: k.last_error.clone(),
                asks_at: k.due.map(|t| t.as_secs()),
                zero_reason: k.zero_reason(),
            })
            .collect()
    }

    /// Why `resource_id` enforces a capacity of 0, if it does.
    pub fn zero_reason(&self, resource_id: &str) -> Option<&'static str> {
        self.keys.get(resource_id).and_then(|k| k.zero_reason())
    }

    /// Whether the client keeps a key for `resource_id`.
    pub fn has_key(&self, resource_id: &str) -> bool {
        self.keys.contains_key(resource_id)
    }

    /// The capacity the servers last said they share for `resource_id` (an
    /// usher server's extension), if they did.
    pub fn fleet_capacity(&self, resource_id: &str) -> Option<f64> {
        self.keys.get(resource_id).and_then(|k| k.fleet)
    }

    /// Whether the server's last lease for `resource_id` was its first
    /// above 0 for the key, not yet taken: true once, then false.
    pub fn take_fresh(&mut self, resource_id: &str) -> bool {
        self.keys.get_mut(resource_id).is_some_and(|k| std::mem::take(&mut k.fresh))
    }

    /// Units of the server's pooled burst credited to `resource_id` and not
    /// yet taken: their sum once, then 0.
    pub fn take_credit(&mut self, resource_id: &str) -> f64 {
        self.keys.get_mut(resource_id).map_or(0.0, |k| std::mem::take(&mut k.credit))
    }

    /// The most `resource_id`'s bucket may hold until its next request, and
    /// what the server's pool held, as the last answer said, while its
    /// lease is in force.
    pub fn bucket(&self, resource_id: &str) -> Option<(f64, f64)> {
        let k = self.keys.get(resource_id)?;
        (k.mode == Mode::Leased && k.bucket > 0.0).then_some((f64::from(k.bucket), f64::from(k.pooled)))
    }

    /// When the quota the server follows for `resource_id` renews, while
    /// the server says it is spent.
    pub fn renews(&self, resource_id: &str) -> Option<Time> {
        self.keys.get(resource_id).and_then(|k| k.renews)
    }

    /// The last lease received for `resource_id`, expired or not.
    pub fn lease_of(&self, resource_id: &str) -> Option<Lease> {
        self.keys.get(resource_id).and_then(|k| k.lease)
    }

    /// Every unexpired lease, for the on-disk cache.
    pub fn leases(&self, now: Time) -> Vec<(String, Lease)> {
        self.keys
            .iter()
            .filter_map(|(id, k)| k.lease.filter(|l| k.mode == Mode::Leased && l.expiry > now).map(|l| (id.clone(), l)))
            .collect()
    }

    /// The release of every key, for shutdown (None when nothing is held or no master is known).
    pub fn release_all(&mut self) -> Option<(String, proto::ReleaseCapacityRequest)> {
        let target = self.master.clone()?;
        let mut ids: Vec<String> = self.keys.keys().cloned().collect();
        ids.append(&mut self.to_release);
        (!ids.is_empty()).then(|| {
            (target, proto::ReleaseCapacityRequest { client_id: self.cfg.client_id.clone(), resource_id: ids })
        })
    }
}
