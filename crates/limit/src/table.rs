//! The LeaseTable: per resource, per key, the limiter state that enforces a
//! capacity. It is the interface the lease client writes to
//! ([`LeaseTable::set_capacity`], [`Limiter::set_capacity`]) and reads demand
//! from ([`LeaseTable::limiters`], [`Limiter::demand`]).
//!
//! Readers on the request path load arc-swap snapshots: no lock is shared
//! across resources or keys. A templated resource creates a key on its first
//! request, up to `max_keys`; a request for one more is refused. Its keys
//! are spread over [`SHARDS`] shards by a hash of the id, each with its own
//! snapshot and lock (a resource with a fixed id has one). Up to
//! [`FOLD_SMALL`] keys in a shard, a new key replaces the shard's snapshot
//! at once. Beyond, new keys go into a small locked set first, folded into
//! the snapshot once it holds a quarter as many keys as the snapshot, or at
//! the next demand poll a second after its first key came
//! ([`LeaseTable::settle`]): a new key costs O(1) amortised (a copy of the
//! whole snapshot per new key made creating n keys O(n²)), and is read
//! lock-free from its fold on. A fold or a forget copies one shard, not
//! every key: with a million keys spread evenly, a new key waits behind a
//! copy of some 16,000.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use once_cell::race::OnceBox;
use serde::Serialize;
use tokio::sync::Notify;

use super::demand::DemandMeter;
use super::gauge::Gauge;
use super::rate::Rate;
use usher_core::clock::{Clock, Time};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
/// What a resource limits.
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Units per second, paced by a [`Rate`].
    Rate,
    /// Units in flight, held by [`Gauge`] permits.
    Gauge,
}

/// How one resource is limited; built from the routes file, or a lease.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceSpec {
    /// The configured name, which refusals and metrics carry.
    pub name: String,
    /// Whether it limits a rate or what is in flight.
    pub kind: Kind,
    /// Units per second (rate) or in flight (gauge).
    pub capacity: f64,
    /// Rate only: units that may pass at once from idle, for the whole
    /// fleet: a key's own bucket holds the share of it that its capacity is
    /// of `capacity` ([`Limiter::set_capacity`]).
    pub burst: f64,
    /// The longest a request waits for its slot or permit before it is refused.
    pub max_wait: Duration,
    /// How many requests may wait at one key; one more is refused at once.
    pub max_queue: usize,
    /// The most distinct ids a templated resource makes keys for.
    pub max_keys: usize,
    /// The window the capacity was written over (`/min` → 60 s), for `RateLimit-Policy`.
    pub window: Duration,
    /// Other sidecars share the capacity (a `doorman:` section): a new key
    /// starts with one request's worth of its burst, not all of it, since
    /// the fleet's burst may be spent already; its first lease fills it if
    /// that lease is the whole capacity ([`Limiter::fill`]).
    pub shared: bool,
    /// No burst was written: a key bursts this long of its own capacity
    /// (its lease), whatever the fleet's capacity.
    pub burst_span: Option<Duration>,
    /// Shadow mode: decisions are made and counted, never enforced.
    pub shadow: bool,
    /// The upstream reports its own quota: each key keeps the freshest
    /// account of it ([`Limiter::observe`]).
    pub upstream_quota: bool,
    /// Its id is a template (a key per tenant): its keys are sharded.
    pub templated: bool,
}

impl ResourceSpec {
    /// The burst of a key whose capacity is `capacity`: the fleet's burst
    /// times the share it holds of the resource's capacity (`fleet`, as the
    /// servers share it, else the configured one; all of it at or above
    /// that), at least one unit.
    pub fn burst_at(&self, capacity: f64, fleet: Option<f64>) -> f64 {
        if let Some(span) = self.burst_span {
            // The span at the leased rate (the fleet's burst is the span of
            // the capacity the servers share), and room for one request more
            // below two: a bucket of one at a slow lease is full between
            // most requests and drops what it earns meanwhile (a key leased
            // 0.67/s, asked every second, would pass one request in two
            // seconds). The one more is the fleet bound's one per sidecar.
            return if capacity.is_finite() {
                let b = capacity * span.as_secs_f64();
                b.max(1.0 + b.clamp(0.0, 1.0))
            } else {
                self.burst.max(1.0)
            };
        }
        let whole = fleet.unwrap_or(self.capacity);
        let share = if whole > 0.0 && capacity.is_finite() { (capacity / whole).min(1.0) } else { 1.0 };
        (self.burst * share.max(0.0)).max(1.0)
    }
}

/// The limiter of one resource key (one Doorman resource id).
pub struct Limiter {
    /// The id, which its resource's set of keys looks it up by ([`Key`]).
    id: Box<str>,
    pacer: Pacer,
    demand: DemandMeter,
    /// Its resource's spec, clock and activity, one copy for all its keys.
    shared: Arc<Shared>,
    /// What few keys are told (an upstream's hold, what the servers said of
    /// the key), made by the first write of something other than "none":
    /// a key never told anything pays a pointer for it. No box reads as
    /// nothing said. Made with the key for a resource whose upstream
    /// reports its quota, which only such a key keeps.
    rare: OnceBox<Rare>,
    /// When the lease side last saw the key used (nanoseconds of [`Time`],
    /// 0: never looked), and its arrivals then (f64 bits): see
    /// [`Limiter::last_use`]. Kept here, not in a map beside the table, so
    /// that a key the lease client never sees costs no entry elsewhere.
    used_at: AtomicU64,
    used_arrivals: AtomicU64,
}

/// What limits a key: its kind and its state, in one field.
enum Pacer {
    Rate(Rate),
    Gauge(Arc<Gauge>),
}

/// What few keys are told ([`Limiter::rare`]); each field reads 0 for "none".
#[derive(Default)]
struct Rare {
    /// When an upstream's `Retry-After` ends (nanoseconds of [`Time`], 0:
    /// none): read only by an admission that has to wait.
    hold_until: AtomicU64,
    /// The capacity the servers share for this key's resource (f64 bits; 0:
    /// not said): its burst is its share of the resource's, reckoned
    /// against this rather than the routes file's capacity.
    fleet: AtomicU64,
    /// The bucket the servers gave the key's lease, below its share of the
    /// fleet's burst (see [`Limiter::give_back`]), and what their pool held
    /// then: two f32s' bits, the bucket's above (0: none).
    bucket: AtomicU64,
    /// Units a smaller bucket from the servers took out of the key's bucket
    /// (f32 bits): given back with its next request, not lost.
    owed: AtomicU32,
    /// When the spent quota the servers follow renews (nanoseconds of
    /// [`Time`], 0: not spent, or not said).
    renews: AtomicU64,
    /// The upstream's freshest account of its quota, for a resource whose
    /// upstream reports one (`None` for the others; boxed, so that a key
    /// told of its lease's bucket or fleet pays a pointer for it).
    quota: Option<Box<Mutex<QuotaCell>>>,
    /// It was given a calendar quota's allotment: set before the first,
    /// never cleared, so that [`Limiter::account`] takes the rate's lock
    /// only for such a key.
    allotted: AtomicBool,
}

/// A key's freshest upstream quota, and whether the lease client has it.
#[derive(Debug, Default)]
struct QuotaCell {
    latest: Option<super::quota::Observation>,
    reported: bool,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("id", &self.id)
            .field("kind", &self.kind())
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Limiter {
    fn new(id: Box<str>, shared: Arc<Shared>) -> Self {
        let s = shared.spec.load();
        let clock = &shared.clock;
        let pacer = match s.kind {
            Kind::Rate => {
                let available = if s.shared { 1.0 } else { f64::INFINITY };
                Pacer::Rate(Rate::starting(s.capacity, s.burst, available, clock.now()))
            }
            Kind::Gauge => Pacer::Gauge(Gauge::new(gauge_units(s.capacity))),
        };
        Limiter {
            id,
            pacer,
            demand: DemandMeter::default(),
            shared,
            rare: match s.upstream_quota {
                true => OnceBox::with_value(Box::new(Rare { quota: Some(Box::default()), ..Rare::default() })),
                false => OnceBox::new(),
            },
            used_at: AtomicU64::new(0),
            used_arrivals: AtomicU64::new(0),
        }
    }

    /// What the key was told, made now if it was told nothing yet.
    fn rare(&self) -> &Rare {
        self.rare.get_or_init(Box::default)
    }

    /// Reads one of the rarely set fields: 0 if the key was told nothing.
    fn rare_u64(&self, field: impl FnOnce(&Rare) -> &AtomicU64) -> u64 {
        self.rare.get().map_or(0, |r| field(r).load(Ordering::Relaxed))
    }

    /// Sets one of the rarely set fields; storing 0 (none) in a key told
    /// nothing yet makes no box.
    fn set_rare_u64(&self, bits: u64, field: impl FnOnce(&Rare) -> &AtomicU64) {
        match self.rare.get() {
            Some(r) => field(r).store(bits, Ordering::Relaxed),
            None if bits == 0 => {}
            None => field(self.rare()).store(bits, Ordering::Relaxed),
        }
    }

    /// Whether the lease side has read the key's use yet ([`Limiter::last_use`]).
    pub fn watched(&self) -> bool {
        self.used_at.load(Ordering::Relaxed) != 0
    }

    /// When the key was last used as of `now`, read by the lease side at
    /// each demand poll: `now` if it had an arrival since the last call, or
    /// a request in flight or waiting, else the time of the last call that
    /// saw it used. The flag says this is the first call for the key. Not
    /// on the request path: the request path only counts arrivals.
    pub fn last_use(&self, now: Time) -> (Time, bool) {
        let arrivals = self.demand.arrivals();
        let busy = self.demand.in_flight() > 0 || self.demand.waiters() > 0;
        let at = self.used_at.load(Ordering::Relaxed);
        if at != 0 && !busy && f64::from_bits(self.used_arrivals.load(Ordering::Relaxed)) == arrivals {
            return (Time::from_nanos(at), false);
        }
        self.used_at.store(now.as_nanos().max(1), Ordering::Relaxed);
        self.used_arrivals.store(arrivals.to_bits(), Ordering::Relaxed);
        (now, at == 0)
    }

    /// Whether nothing happened at the key since the lease side last looked
    /// ([`Limiter::last_use`]): no arrival, nothing in flight or waiting.
    pub fn untouched(&self) -> bool {
        self.used_at.load(Ordering::Relaxed) != 0
            && self.demand.in_flight() == 0
            && self.demand.waiters() == 0
            && f64::from_bits(self.used_arrivals.load(Ordering::Relaxed)) == self.demand.arrivals()
    }

    /// When the key holds nothing a key made now for its id would not, if
    /// ever on its own: a rate key nobody waits at and nothing is in flight
    /// at, told nothing ([`Limiter::rare`]), at its resource's capacity and
    /// burst with no allotment, from the moment its bucket is full. Such a
    /// key can be dropped and made again by its next request with the same
    /// outcome (see the enforcer's local keys). `None` for a gauge, a key
    /// in use, or one whose state a new key would not have.
    pub fn fresh_at(&self) -> Option<Time> {
        if self.rare.get().is_some() || self.demand.in_flight() > 0 || self.demand.waiters() > 0 {
            return None;
        }
        let spec = self.shared.spec.load();
        self.rate()?.fresh_at(spec.capacity, spec.burst)
    }

    /// Keeps an upstream's account of its quota if it is the freshest.
    pub fn observe(&self, o: super::quota::Observation) {
        if let Some(cell) = self.rare.get().and_then(|r| r.quota.as_ref()) {
            let mut c = cell.lock().expect("quota lock");
            if c.latest.is_none_or(|l| o.observed >= l.observed) {
                c.latest = Some(o);
                c.reported = false;
            }
        }
    }

    /// The freshest upstream quota, and whether it is new since the last
    /// call that `report`ed it.
    pub fn quota(&self, report: bool) -> (Option<super::quota::Observation>, bool) {
        let Some(cell) = self.rare.get().and_then(|r| r.quota.as_ref()) else { return (None, false) };
        let mut c = cell.lock().expect("quota lock");
        let new = !c.reported && c.latest.is_some();
        if report {
            c.reported = true;
        }
        (c.latest, new)
    }

    /// Records when the upstream's `Retry-After` for this key ends (upstream
    /// pushback): an admission that would have to wait past it and past
    /// `max_wait` is refused at once.
    pub fn set_hold(&self, until: Option<Time>) {
        self.set_rare_u64(until.map_or(0, Time::as_nanos), |r| &r.hold_until);
    }

    /// When the upstream's `Retry-After` for this key ends, if it was given.
    pub fn hold_until(&self) -> Option<Time> {
        let n = self.rare_u64(|r| &r.hold_until);
        (n > 0).then(|| Time::from_nanos(n))
    }

    /// Tells the lease client that this key needs it now (a request waits
    /// or is refused): see [`LeaseTable::activity`].
    pub fn nudge(&self) {
        self.shared.activity.nudge();
    }

    /// A request arrived: wakes a lease client that went to sleep.
    #[inline]
    pub fn arrived(&self) {
        self.shared.activity.arrived();
    }

    /// The Doorman resource id this key enforces.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the key is a rate or a gauge.
    pub fn kind(&self) -> Kind {
        match self.pacer {
            Pacer::Rate(_) => Kind::Rate,
            Pacer::Gauge(_) => Kind::Gauge,
        }
    }

    /// Its resource's spec as configured now.
    pub fn spec(&self) -> Arc<ResourceSpec> {
        self.shared.spec.load_full()
    }

    /// Whether its resource is in shadow mode (decided, never enforced).
    pub fn is_shadow(&self) -> bool {
        self.shared.spec.load().shadow
    }

    /// What the key is asked for.
    pub fn demand(&self) -> &DemandMeter {
        &self.demand
    }

    /// The pacer of a rate key; `None` for a gauge.
    #[inline]
    pub fn rate(&self) -> Option<&Rate> {
        match &self.pacer {
            Pacer::Rate(r) => Some(r),
            Pacer::Gauge(_) => None,
        }
    }

    /// The semaphore of a gauge key; `None` for a rate.
    #[inline]
    pub fn gauge(&self) -> Option<&Arc<Gauge>> {
        match &self.pacer {
            Pacer::Rate(_) => None,
            Pacer::Gauge(g) => Some(g),
        }
    }

    /// The clock its limiter reads.
    pub fn clock(&self) -> &Clock {
        &self.shared.clock
    }

    /// Current capacity: units per second (rate) or in flight (gauge).
    pub fn capacity(&self) -> f64 {
        match (self.rate(), self.gauge()) {
            (Some(r), _) => r.capacity(),
            (_, Some(g)) => g.capacity() as f64,
            _ => 0.0,
        }
    }

    /// Applies a capacity live: no fresh burst, waiters kept, nothing in
    /// flight cancelled. Setting the current capacity again changes nothing.
    /// `f64::INFINITY` means unlimited; NaN and negatives mean 0. Gauges
    /// round a fractional capacity down.
    pub fn set_capacity(&self, capacity: f64) {
        let capacity = if capacity.is_nan() { 0.0 } else { capacity.max(0.0) };
        if let Some(r) = self.rate() {
            let now = self.shared.clock.now();
            match self.bucket() {
                // What a smaller bucket clips is owed to the servers' pool.
                Some(bucket) => self.owe(r.set(now, capacity, bucket)),
                None => {
                    r.set(now, capacity, self.shared.spec.load().burst_at(capacity, self.fleet()));
                }
            }
        }
        if let Some(g) = self.gauge() {
            g.set_capacity(gauge_units(capacity));
        }
    }

    /// Fills a shared key's bucket at its first lease, if nobody else can
    /// hold that share of the fleet's burst: the servers said they held no
    /// lease for the key before (`fresh`: a new client, or a new key of
    /// one; a sidecar restarted under the same id is not, so a restart
    /// adds no burst), or the lease is the whole capacity. Each bucket
    /// holds its lease's share of the burst, and a new lease comes from
    /// capacity nobody holds.
    pub fn fill(&self, fresh: bool) {
        let spec = self.shared.spec.load();
        let whole = self.fleet().unwrap_or(spec.capacity);
        // (An allotment is what the key may spend: a burst is no part of it.)
        if let Some(r) = self.rate()
            && spec.shared
            && (fresh || r.capacity() >= whole * (1.0 - 1e-9))
            && r.allotment_reset().is_none()
        {
            r.charge(self.shared.clock.now(), -r.burst());
        }
    }

    /// The next moment the lease client may change this key's capacity, if
    /// it said (see [`LeaseTable::set_renewal`]).
    pub fn renewal(&self) -> Option<Time> {
        self.shared.activity.renewal()
    }

    /// Records when the quota the servers follow for this key's resource
    /// renews, while they say it is spent (None: it is not): a refusal for
    /// capacity 0 meanwhile says to retry then.
    pub fn set_renews(&self, renews: Option<Time>) {
        self.set_rare_u64(renews.map_or(0, |t| t.as_nanos().max(1)), |r| &r.renews);
    }

    /// When the spent quota the servers follow for this key renews, while they say it is spent.
    pub fn renews(&self) -> Option<Time> {
        let n = self.rare_u64(|r| &r.renews);
        (n > 0).then(|| Time::from_nanos(n))
    }

    /// How long a request refused for capacity 0 at `now` should wait: until
    /// the spent quota renews, if the servers said when, else a second.
    pub fn zero_retry(&self, now: Time) -> Duration {
        match self.rare_u64(|r| &r.renews) {
            0 => Duration::from_secs(1),
            t => Time::from_nanos(t).since(now).max(Duration::from_secs(1)),
        }
    }

    /// Records the bucket the servers gave the key's lease and what their
    /// pool held (`None`: its bucket is its share of the fleet's burst),
    /// applied with the lease's capacity.
    pub fn set_bucket(&self, bucket: Option<(f64, f64)>) {
        let bits = match bucket.filter(|(b, _)| b.is_finite() && *b > 0.0) {
            Some((b, pooled)) => {
                let pooled = if pooled.is_finite() { pooled.max(0.0) } else { 0.0 };
                (u64::from((b.max(1.0) as f32).to_bits()) << 32) | u64::from((pooled as f32).to_bits())
            }
            None => 0,
        };
        self.set_rare_u64(bits, |r| &r.bucket);
    }

    /// The bucket the servers gave the key's lease, if they did.
    pub fn bucket(&self) -> Option<f64> {
        let bits = self.rare_u64(|r| &r.bucket);
        (bits != 0).then(|| f64::from(f32::from_bits((bits >> 32) as u32)))
    }

    /// Units the servers' pool held when they last gave the key a bucket (0:
    /// no bucket): a request that would wait past its `max_wait` at the
    /// key's lease may wait for a credit of them (see [`Rate::reserve_ticket`]).
    pub fn pooled(&self) -> f64 {
        f64::from(f32::from_bits(self.rare_u64(|r| &r.bucket) as u32))
    }

    /// What a shared rate key says of its bucket as a request for its lease
    /// goes out, for the servers' pooled burst: its reserve, the units it
    /// gives back, and its backlog. Where the servers gave it a bucket
    /// ([`Limiter::set_bucket`]), what the bucket holds above the reserve
    /// is taken out now and given back. The reserve is what it keeps at
    /// hand: [`RESERVE_SPAN`] of its capacity, or [`RESERVE_REQUESTS`] of
    /// its mean cost, whichever is more; before its first request, its
    /// whole bucket (no cost is known yet). `None` for a gauge, a key of one
    /// sidecar alone, and an allotment.
    pub fn give_back(&self) -> Option<BucketSaid> {
        let r = self.rate().filter(|_| self.shared.spec.load().shared)?;
        if r.allotment_reset().is_some() {
            return None;
        }
        let now = self.shared.clock.now();
        let requests = self.demand.requests();
        let reserve = if requests == 0 {
            // No request yet says what one costs: the key keeps its whole
            // bucket, so that its first request, of any cost, passes at once.
            Some(r.burst()).filter(|b| b.is_finite()).unwrap_or(0.0)
        } else {
            let mean = (self.demand.arrivals() / requests as f64).max(1e-9);
            let capacity = r.capacity();
            let span = if capacity.is_finite() { capacity * RESERVE_SPAN.as_secs_f64() } else { 0.0 };
            span.max(mean * RESERVE_REQUESTS)
        };
        let owed = self.rare.get().map_or(0, |r| r.owed.swap(0, Ordering::Relaxed));
        let mut returned = f64::from(f32::from_bits(owed));
        if self.bucket().is_some() {
            let level = r.available(now);
            if level.is_finite() && level > reserve {
                r.charge(now, level - reserve);
                returned += level - reserve;
            }
        }
        Some(BucketSaid { reserve, returned, backlog: r.backlog(now) })
    }

    /// Records the capacity the servers share for this key's resource.
    pub fn set_fleet(&self, capacity: f64) {
        self.set_rare_u64(capacity.to_bits(), |r| &r.fleet);
    }

    /// The capacity the servers share for this key's resource, if they said.
    pub fn fleet(&self) -> Option<f64> {
        let bits = self.rare_u64(|r| &r.fleet);
        (bits != 0).then(|| f64::from_bits(bits))
    }

    /// Charges `units` more to a rate key (a settled cost above the one
    /// charged at admission), or gives them back when negative. Where the
    /// servers gave the key a bucket, what a full bucket has no room for is
    /// owed to their pool.
    pub fn charge(&self, units: f64) {
        if let Some(r) = self.rate() {
            self.owe(r.charge(self.shared.clock.now(), units));
        }
    }

    /// Owes `units` a bucket from the servers had no room for (clipped by a
    /// smaller bucket, or given back to a full one) to their pool: given
    /// back with the key's next request ([`Limiter::give_back`]), not lost.
    fn owe(&self, units: f64) {
        if units.is_finite() && units > 0.0 && self.bucket().is_some() {
            let add = |o: u32| Some((f32::from_bits(o) + units as f32).to_bits());
            // (A bucket was given: the box is made.)
            let _ = self.rare().owed.fetch_update(Ordering::Relaxed, Ordering::Relaxed, add);
        }
    }

    /// Units that could be admitted now without waiting, fractions included.
    pub fn available(&self) -> f64 {
        match (self.rate(), self.gauge()) {
            (Some(r), _) => r.available(self.shared.clock.now()),
            (_, Some(g)) => g.remaining() as f64,
            _ => 0.0,
        }
    }

    /// Adds `units` of the servers' pooled burst to a shared rate key's
    /// bucket at once, up to its size: they were moved out of the servers'
    /// pool as the lease grew, so the fleet's buckets and the pool together
    /// still hold no more than its burst. Not to an allotment (no burst).
    pub fn credit(&self, units: f64) {
        let spec = self.shared.spec.load();
        if let Some(r) = self.rate()
            && spec.shared
            && units.is_finite()
            && units > 0.0
            && r.allotment_reset().is_none()
        {
            self.owe(r.charge(self.shared.clock.now(), -units));
        }
    }

    /// Seconds of its leased rate a shared rate key's bucket holds: the
    /// burst span, or the fleet's burst over the capacity the servers share
    /// (else the configured one). `None` for a gauge, a key of one sidecar
    /// alone, or a capacity of 0.
    pub fn window(&self) -> Option<f64> {
        let spec = self.shared.spec.load();
        self.rate().filter(|_| spec.shared)?;
        let w = match spec.burst_span {
            Some(span) => span.as_secs_f64(),
            None => spec.burst / self.fleet().unwrap_or(spec.capacity),
        };
        (w.is_finite() && w > 0.0).then_some(w)
    }

    /// Takes a calendar quota's allotment (`None`: it ended), see
    /// [`Rate::allot`]; a gauge has none.
    pub fn allot(&self, a: Option<super::allot::Allotment>) {
        if let Some(r) = self.rate() {
            match a {
                Some(a) => {
                    // Before the allotment: a reader that sees none looks no further.
                    self.rare().allotted.store(true, Ordering::Relaxed);
                    r.allot(self.shared.clock.now(), a)
                }
                None => r.end_allotment(self.shared.clock.now()),
            }
        }
    }

    /// The key's account of its calendar unit, while it holds an allotment.
    /// A key that never held one answers without the rate's lock: the lease
    /// client asks every key at every demand read.
    pub fn account(&self) -> Option<super::allot::Account> {
        if !self.rare.get().is_some_and(|r| r.allotted.load(Ordering::Relaxed)) {
            return None;
        }
        self.rate().and_then(|r| r.account(self.shared.clock.now()))
    }

    /// Units that could be admitted now without waiting.
    pub fn remaining(&self) -> u64 {
        match (self.rate(), self.gauge()) {
            (Some(r), _) => r.remaining(self.shared.clock.now()),
            (_, Some(g)) => g.remaining(),
            _ => 0,
        }
    }
}

/// Seconds of its capacity a shared rate key keeps at hand when the servers
/// pool the rest of its burst (see [`Limiter::give_back`]).
pub const RESERVE_SPAN: Duration = Duration::from_secs(5);
/// Requests of its mean cost a shared rate key keeps at hand, at least.
pub const RESERVE_REQUESTS: f64 = 2.0;

/// What a shared rate key says of its bucket with a request (see [`Limiter::give_back`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSaid {
    /// Units it keeps at hand.
    pub reserve: f64,
    /// Units it took out of its bucket for the servers' pool.
    pub returned: f64,
    /// Units of requests waiting now.
    pub backlog: f64,
}

/// What an unlimited gauge holds: more than any process can have in flight.
pub const UNLIMITED_GAUGE: u64 = 1 << 30;

fn gauge_units(capacity: f64) -> u64 {
    if capacity.is_nan() || capacity <= 0.0 { 0 } else { (capacity.floor() as u64).min(UNLIMITED_GAUGE) }
}

/// What every key of one resource shares: one pointer per key where three
/// fields took 32 bytes.
struct Shared {
    spec: ArcSwap<ResourceSpec>,
    /// The table's clock.
    clock: Clock,
    /// The table's [`LeaseTable::activity`].
    activity: Arc<Activity>,
}

/// One configured resource and its keys.
pub struct ResourceLimits {
    /// Its spec, clock and activity, which each key holds too.
    shared: Arc<Shared>,
    /// Its keys, in the shard a hash of the id picks ([`shard_index`]): one
    /// shard for a fixed id, [`SHARDS`] for a template.
    shards: Box<[Shard]>,
    /// How many keys the shards hold together: taken before a key is made,
    /// so that `max_keys` bounds them all, whatever shard each is in.
    count: AtomicUsize,
}

/// Some of a resource's keys.
#[derive(Default)]
struct Shard {
    /// Settled keys, read lock-free.
    keys: ArcSwap<HashSet<Key>>,
    /// Keys made since the last fold into `keys`. Its lock also serialises
    /// every change of `keys`; a lookup takes it only for an id `keys` lacks.
    recent: Mutex<Recent>,
    /// Whether `recent` may hold a key: a miss in `keys` is then looked up there.
    has_recent: AtomicBool,
}

/// Shards of a templated resource's keys: a power of two.
pub const SHARDS: usize = 1 << SHARD_BITS;
const SHARD_BITS: u32 = 6;

/// The shard of a templated resource that holds `id`: the top bits of a
/// multiplicative hash over the id's bytes, eight at a time (a handful of
/// instructions for an id of a few dozen bytes, where the set's own hash
/// is keyed and slower). Ids that all fall into one shard cost what an
/// unsharded set does, no more.
fn shard_index(id: &str) -> usize {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let mut chunks = id.as_bytes().chunks_exact(8);
    let mut h = (&mut chunks).fold(id.len() as u64, |h, c| mix(h, u64::from_le_bytes(c.try_into().expect("8 bytes"))));
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = mix(h, u64::from_le_bytes(w));
    }
    (h >> (64 - SHARD_BITS)) as usize
}

/// A key in its resource's set, found by its id: one pointer a slot, where
/// a map from a shared id took three, and the id has one owner.
#[derive(Clone)]
struct Key(Arc<Limiter>);

impl Borrow<str> for Key {
    fn borrow(&self) -> &str {
        &self.0.id
    }
}

impl std::hash::Hash for Key {
    /// As its id hashes, which [`Borrow`] lookups rely on.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for Key {}

/// Keys made since the last fold, and when the first of them was.
#[derive(Default)]
struct Recent {
    keys: HashSet<Key>,
    since: Option<usher_core::clock::Time>,
}

/// Up to this many keys in a shard, a new key is folded into its snapshot at
/// once (a copy this small costs less than locking on the request path).
pub const FOLD_SMALL: usize = 16;
/// Otherwise `recent` is folded when it holds a quarter of the snapshot's keys...
const FOLD_FRACTION: usize = 4;
/// ... or at the first [`LeaseTable::settle`] this long after its first key.
pub const FOLD_AFTER: Duration = Duration::from_secs(1);
/// The most room a shard's recent set keeps for its next batch after a fold.
const RECENT_ROOM: usize = 256;

/// Tells a lease client that sleeps between slow demand polls (see
/// `lease::driver::QUIET_POLL`) that the table needs it now: a new key, new
/// resources, a request of a key that waits or is refused, and, once the
/// client said it goes to sleep, the first request that arrives.
#[derive(Default)]
pub struct Activity {
    notify: Arc<Notify>,
    asleep: AtomicBool,
    /// The next moment the lease client may change a capacity (nanoseconds
    /// of [`Time`], 0: not said): see [`LeaseTable::set_renewal`].
    renewal: AtomicU64,
}

impl Activity {
    /// What the lease client waits on.
    pub fn notify(&self) -> Arc<Notify> {
        self.notify.clone()
    }

    /// Wakes the lease client now.
    pub fn nudge(&self) {
        self.notify.notify_one();
    }

    /// The lease client goes to sleep (or not): while it sleeps, the next
    /// arrival wakes it. Set before reading demand, so that an arrival
    /// during the read is not missed.
    pub fn sleep(&self, asleep: bool) {
        self.asleep.store(asleep, Ordering::Relaxed);
    }

    /// The next moment the lease client may change a capacity, if it said.
    pub fn renewal(&self) -> Option<Time> {
        let n = self.renewal.load(Ordering::Relaxed);
        (n > 0).then(|| Time::from_nanos(n))
    }

    /// On the request path: one relaxed load while the lease client is awake.
    #[inline]
    fn arrived(&self) {
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }
}

pub use usher_core::config::MAX_ID_BYTES;

/// Why a templated resource makes no key for an id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRefused {
    /// It already has `max_keys` distinct ids.
    #[error("resource `{resource}` already tracks {max_keys} distinct ids (its max_keys)")]
    Full {
        /// The resource's name.
        resource: String,
        /// Its `max_keys`.
        max_keys: usize,
    },
    /// The id, rendered from the request, is longer than [`MAX_ID_BYTES`].
    #[error(
        "resource `{resource}`: this request makes a lease id of {bytes} bytes; capacity servers accept at most {MAX_ID_BYTES}"
    )]
    TooLong {
        /// The resource's name.
        resource: String,
        /// The id's length in bytes.
        bytes: usize,
    },
}

impl ResourceLimits {
    fn new(spec: ResourceSpec, clock: Clock, activity: Arc<Activity>) -> Self {
        let shards = (0..shards_of(&spec)).map(|_| Shard::default()).collect();
        ResourceLimits {
            shared: Arc::new(Shared { spec: ArcSwap::from_pointee(spec), clock, activity }),
            shards,
            count: AtomicUsize::new(0),
        }
    }

    /// The shard that holds `id`.
    #[inline]
    fn shard(&self, id: &str) -> &Shard {
        match self.shards.len() {
            1 => &self.shards[0],
            _ => &self.shards[shard_index(id)],
        }
    }

    /// The resource's spec as configured now.
    pub fn spec(&self) -> Arc<ResourceSpec> {
        self.shared.spec.load_full()
    }

    /// Whether `l` is one of this resource's keys: every key shares its
    /// resource's spec cell, so this is a pointer compare, where comparing
    /// names would load the key's spec first.
    pub fn owns(&self, l: &Limiter) -> bool {
        Arc::ptr_eq(&self.shared, &l.shared)
    }

    /// The limiter for `id`, created on first use (fixed ids: no bound applies).
    pub fn limiter(&self, id: &str) -> Arc<Limiter> {
        self.get_or_create(id, usize::MAX).expect("an unbounded key set is never full")
    }

    /// The limiter for a templated `id`, created on first use unless the
    /// resource already has `max_keys` keys.
    pub fn try_limiter(&self, id: &str) -> Result<Arc<Limiter>, KeyRefused> {
        self.get_or_create(id, self.shared.spec.load().max_keys)
    }

    /// The limiter for `id` if it exists.
    pub fn get(&self, id: &str) -> Option<Arc<Limiter>> {
        let shard = self.shard(id);
        if let Some(k) = shard.keys.load().get(id) {
            return Some(k.0.clone());
        }
        if !shard.has_recent.load(Ordering::Acquire) {
            return None;
        }
        let recent = shard.recent.lock().expect("key lock");
        // A fold may have moved it meanwhile.
        recent.keys.get(id).map(|k| k.0.clone()).or_else(|| shard.keys.load().get(id).map(|k| k.0.clone()))
    }

    fn get_or_create(&self, id: &str, bound: usize) -> Result<Arc<Limiter>, KeyRefused> {
        let shard = self.shard(id);
        if let Some(k) = shard.keys.load().get(id) {
            return Ok(k.0.clone());
        }
        if id.len() > MAX_ID_BYTES {
            return Err(KeyRefused::TooLong { resource: self.shared.spec.load().name.clone(), bytes: id.len() });
        }
        let mut recent = shard.recent.lock().expect("key lock");
        let keys = shard.keys.load();
        if let Some(k) = recent.keys.get(id).or_else(|| keys.get(id)) {
            return Ok(k.0.clone());
        }
        // Counted before it is made: two shards making the last key allowed
        // at once cannot both make it.
        if self.count.fetch_add(1, Ordering::AcqRel) >= bound {
            self.count.fetch_sub(1, Ordering::AcqRel);
            let spec = self.shared.spec.load();
            return Err(KeyRefused::Full { resource: spec.name.clone(), max_keys: spec.max_keys });
        }
        let held = keys.len() + recent.keys.len();
        let l = Arc::new(Limiter::new(id.into(), self.shared.clone()));
        self.shared.activity.nudge();
        recent.keys.insert(Key(l.clone()));
        recent.since.get_or_insert_with(|| self.shared.clock.now());
        if held < FOLD_SMALL || recent.keys.len() >= keys.len() / FOLD_FRACTION {
            shard.fold(&mut recent, &keys);
        } else {
            shard.has_recent.store(true, Ordering::Release);
        }
        Ok(l)
    }

    /// Folds each shard's recent keys into its snapshot if the first came
    /// at least [`FOLD_AFTER`] ago, so that a key set that stops growing
    /// ends up read lock-free.
    fn settle(&self) {
        let now = self.shared.clock.now();
        for shard in self.shards.iter().filter(|s| s.has_recent.load(Ordering::Acquire)) {
            let mut recent = shard.recent.lock().expect("key lock");
            if recent.since.is_some_and(|t| now.since(t) >= FOLD_AFTER) {
                let keys = shard.keys.load_full();
                shard.fold(&mut recent, &keys);
            }
        }
    }

    /// Forgets a key (an idle templated id); requests holding it finish normally.
    pub fn remove(&self, id: &str) {
        self.remove_all(std::iter::once(id));
    }

    /// Forgets keys at once: one copy of each shard they are in, however many.
    pub fn remove_all<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        self.remove_all_if(ids, |_| true);
    }

    /// Forgets those of `ids` whose limiter `forget` says yes to, asked
    /// under their shard's lock: no key can be made or forgotten meanwhile.
    pub fn remove_all_if<'a>(&self, ids: impl IntoIterator<Item = &'a str>, forget: impl Fn(&Limiter) -> bool) {
        let mut by_shard: Vec<Vec<&str>> = vec![Vec::new(); self.shards.len()];
        for id in ids {
            let i = if self.shards.len() == 1 { 0 } else { shard_index(id) };
            by_shard[i].push(id);
        }
        for (shard, ids) in self.shards.iter().zip(by_shard).filter(|(_, ids)| !ids.is_empty()) {
            let removed = shard.remove_all(ids, &forget);
            self.count.fetch_sub(removed, Ordering::AcqRel);
        }
    }

    /// Every key, by id.
    pub fn limiters(&self) -> Vec<Arc<Limiter>> {
        let mut v = Vec::with_capacity(self.len());
        self.each(|l| v.push(l.clone()));
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Calls `f` with every key, shard by shard, each seen once: under the
    /// lock that serialises a shard's folds, its keys are listed, and `f`
    /// is called after.
    fn each(&self, mut f: impl FnMut(&Arc<Limiter>)) {
        for shard in self.shards.iter() {
            let recent = shard.recent.lock().expect("key lock");
            let keys = shard.keys.load_full();
            let made: Vec<Arc<Limiter>> = recent.keys.iter().map(|k| k.0.clone()).collect();
            drop(recent);
            for l in keys.iter().map(|k| &k.0).chain(&made) {
                f(l);
            }
        }
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Whether it has no key yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How many shards `spec`'s keys are spread over.
fn shards_of(spec: &ResourceSpec) -> usize {
    if spec.templated { SHARDS } else { 1 }
}

impl Shard {
    /// Moves the recent keys into a new snapshot: a copy of the table as it
    /// is, and the recent keys inserted. Only a copy that must grow hashes
    /// its ids again; inserting each key into a new set hashed all of them
    /// at every fold.
    fn fold(&self, recent: &mut Recent, keys: &HashSet<Key>) {
        let mut next = HashSet::clone(keys);
        // Taken, not drained, so that a burst's room is given back; the
        // next batch gets the room of this one (up to RECENT_ROOM) instead
        // of growing from empty, rehashing at each doubling.
        let room = recent.keys.len().min(RECENT_ROOM);
        next.extend(std::mem::replace(&mut recent.keys, HashSet::with_capacity(room)));
        recent.since = None;
        self.keys.store(Arc::new(next));
        self.has_recent.store(false, Ordering::Release);
    }

    /// Forgets those of `ids` that `forget` says yes to (one copy of the
    /// snapshot, however many); returns how many it forgot.
    fn remove_all(&self, ids: Vec<&str>, forget: &dyn Fn(&Limiter) -> bool) -> usize {
        let mut recent = self.recent.lock().expect("key lock");
        let keys = self.keys.load();
        let mut next: Option<HashSet<Key>> = None;
        let mut removed = 0;
        for id in ids {
            let gone = match (recent.keys.get(id), keys.get(id)) {
                (Some(k), _) => forget(&k.0) && recent.keys.remove(id),
                (None, Some(k)) => forget(&k.0) && next.get_or_insert_with(|| HashSet::clone(&keys)).remove(id),
                (None, None) => false,
            };
            removed += usize::from(gone);
        }
        if let Some(mut next) = next {
            // A copy keeps the room of the keys it lost: a shard that emptied
            // gives it back.
            if next.len() * 4 < next.capacity() {
                next.shrink_to_fit();
            }
            self.keys.store(Arc::new(next));
        }
        if recent.keys.is_empty() {
            recent.since = None;
            self.has_recent.store(false, Ordering::Release);
        }
        removed
    }
}

/// Every resource the sidecar enforces.
pub struct LeaseTable {
    clock: Clock,
    resources: ArcSwap<HashMap<String, Arc<ResourceLimits>>>,
    activity: Arc<Activity>,
}

impl LeaseTable {
    /// An empty table whose limiters read `clock`; [`LeaseTable::configure`] fills it.
    pub fn new(clock: Clock) -> Self {
        LeaseTable { clock, resources: ArcSwap::default(), activity: Arc::new(Activity::default()) }
    }

    /// What wakes the lease client before its next demand poll: see [`Activity`].
    pub fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// Records the next moment the lease client may change a capacity (its
    /// next call to the servers, a lease's expiry): a refusal's
    /// `Retry-After` says no later than that ([`Limiter::renewal`]).
    pub fn set_renewal(&self, at: Option<Time>) {
        self.activity.renewal.store(at.map_or(0, |t| t.as_nanos().max(1)), Ordering::Relaxed);
    }

    /// The clock its limiters read.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Installs a set of resources (startup or reload). A resource whose name
    /// and kind are unchanged keeps its keys and their limiter state; if its
    /// configured capacity or burst changed, the change is applied live, to
    /// the keys still at the configured capacity: a key whose capacity a
    /// lease set keeps it (the file's capacity is what applies without one).
    pub fn configure(&self, specs: Vec<ResourceSpec>) {
        let old = self.resources.load();
        let mut next = HashMap::new();
        for spec in specs {
            let entry = match old.get(&spec.name) {
                Some(r) if r.shared.spec.load().kind == spec.kind && r.shards.len() == shards_of(&spec) => {
                    let prev = r.shared.spec.swap(Arc::new(spec.clone()));
                    if prev.capacity != spec.capacity || prev.burst != spec.burst {
                        for l in r.limiters() {
                            let configured = match spec.kind {
                                Kind::Rate => prev.capacity,
                                Kind::Gauge => gauge_units(prev.capacity) as f64,
                            };
                            // Re-applying a leased capacity picks up a new burst.
                            let c = if l.capacity() == configured { spec.capacity } else { l.capacity() };
                            l.set_capacity(c);
                        }
                    }
                    r.clone()
                }
                _ => Arc::new(ResourceLimits::new(spec.clone(), self.clock.clone(), self.activity.clone())),
            };
            next.insert(spec.name, entry);
        }
        self.resources.store(Arc::new(next));
        self.activity.nudge();
    }

    /// The resource configured as `name`.
    pub fn resource(&self, name: &str) -> Option<Arc<ResourceLimits>> {
        self.resources.load().get(name).cloned()
    }

    /// Calls `f` with every key of every resource (its resource's name, its
    /// limiter), in no particular order: the lease client's demand read,
    /// which must not sort or copy ids for a hundred thousand keys.
    pub fn each_limiter(&self, mut f: impl FnMut(&str, &Arc<Limiter>)) {
        for (name, r) in self.resources.load().iter() {
            r.each(|l| f(name, l));
        }
    }

    /// Every key of every resource, by resource name then id.
    pub fn limiters(&self) -> Vec<(String, Arc<Limiter>)> {
        let res = self.resources.load();
        let mut names: Vec<_> = res.keys().cloned().collect();
        names.sort();
        names.into_iter().flat_map(|n| res[&n].limiters().into_iter().map(move |l| (n.clone(), l))).collect()
    }

    /// Folds each resource's recent keys into its snapshot once they have
    /// waited [`FOLD_AFTER`]; the lease client calls it at every demand poll.
    pub fn settle(&self) {
        for r in self.resources.load().values() {
            r.settle();
        }
    }

    /// Whether any resource has a key whose id is `id`.
    pub fn contains(&self, id: &str) -> bool {
        self.resources.load().values().any(|r| r.get(id).is_some())
    }

    /// Records the end of the upstream's hold on every key whose id is `id`
    /// (see [`Limiter::set_hold`]).
    pub fn set_hold(&self, id: &str, until: Option<Time>) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.set_hold(until);
            }
        }
    }

    /// Fills the bucket of every key whose id is `id` at its first lease
    /// (see [`Limiter::fill`]).
    pub fn fill(&self, id: &str, fresh: bool) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.fill(fresh);
            }
        }
    }

    /// Records the bucket the servers gave every key whose id is `id` (see
    /// [`Limiter::set_bucket`]).
    pub fn set_bucket(&self, id: &str, bucket: Option<(f64, f64)>) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.set_bucket(bucket);
            }
        }
    }

    /// What the first key whose id is `id` says of its bucket as a request
    /// for its lease goes out (see [`Limiter::give_back`]).
    pub fn give_back(&self, id: &str) -> Option<BucketSaid> {
        self.resources.load().values().find_map(|r| r.get(id)).and_then(|l| l.give_back())
    }

    /// Credits every key whose id is `id` with `units` of the servers'
    /// pooled burst (see [`Limiter::credit`]).
    pub fn credit(&self, id: &str, units: f64) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.credit(units);
            }
        }
    }

    /// Records when the spent quota of every key whose id is `id` renews
    /// (see [`Limiter::set_renews`]).
    pub fn set_renews(&self, id: &str, renews: Option<Time>) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.set_renews(renews);
            }
        }
    }

    /// Gives every key whose id is `id` a calendar quota's allotment, or
    /// ends it (see [`Limiter::allot`]).
    pub fn allot(&self, id: &str, a: Option<super::allot::Allotment>) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.allot(a);
            }
        }
    }

    /// Records the capacity the servers share for every key whose id is `id`.
    pub fn set_fleet(&self, id: &str, capacity: f64) {
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.set_fleet(capacity);
            }
        }
    }

    /// Sets the capacity of every key whose id is `id`; false if there is none.
    pub fn set_capacity(&self, id: &str, capacity: f64) -> bool {
        let mut found = false;
        for r in self.resources.load().values() {
            if let Some(l) = r.get(id) {
                l.set_capacity(capacity);
                found = true;
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use usher_core::clock::Time;

    fn spec(name: &str, kind: Kind, capacity: f64) -> ResourceSpec {
        ResourceSpec {
            name: name.into(),
            kind,
            capacity,
            burst: 2.0,
            max_wait: Duration::ZERO,
            max_queue: 10,
            max_keys: 3,
            window: Duration::from_secs(1),
            shared: false,
            burst_span: None,
            shadow: false,
            upstream_quota: false,
            templated: false,
        }
    }

    /// A key leased less than two a second, asked more often than its
    /// lease allows, passes its whole lease (a bucket of one would drop
    /// what it earns while full between requests).
    #[test]
    fn a_slow_lease_asked_often_passes_all_of_it() {
        let (clock, h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![ResourceSpec { burst_span: Some(Duration::from_secs(1)), ..spec("r", Kind::Rate, 2.0) }]);
        let k = t.resource("r").unwrap().limiter("r");
        assert!(t.set_capacity("r", 2.0 / 3.0));
        let passed = (0..60)
            .filter(|_| {
                h.advance(Duration::from_secs(1));
                super::super::rate::try_admit(k.rate().unwrap(), k.clock(), 1.0)
            })
            .count();
        assert!((39..=42).contains(&passed), "{passed} of 60 s at 2/3 a second");
        // One second's worth of a fast lease, as before.
        assert!(t.set_capacity("r", 50.0));
        assert_eq!(t.resource("r").unwrap().spec().burst_at(50.0, None), 50.0);
        assert_eq!(t.resource("r").unwrap().spec().burst_at(0.5, None), 1.5);
    }

    /// A shared key given a bucket below its share of the burst gives back,
    /// with its next request, what that bucket clipped, what a settled cost
    /// gave back beyond it, and what it holds above its reserve; nothing is
    /// lost, and nothing is given twice.
    #[test]
    fn a_smaller_bucket_owes_what_it_clipped_and_gives_back_above_the_reserve() {
        let (clock, _h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        // 1/s shared by a fleet, a minute's burst: a full bucket of 60 at the whole capacity.
        t.configure(vec![ResourceSpec { burst: 60.0, shared: true, ..spec("r", Kind::Rate, 1.0) }]);
        let k = t.resource("r").unwrap().limiter("r");
        assert!(t.set_capacity("r", 1.0));
        t.fill("r", true);
        assert_eq!(k.available(), 60.0);
        // The servers pool all but 10 of it: 50 are clipped, owed to the pool.
        t.set_bucket("r", Some((10.0, 40.0)));
        assert!(t.set_capacity("r", 1.0));
        assert_eq!(k.available(), 10.0);
        // Before its first request it keeps its whole bucket, and gives back
        // only what it owes.
        let b = t.give_back("r").expect("a shared rate key");
        assert_eq!((b.reserve, b.returned, k.available()), (10.0, 50.0, 10.0));
        // Once a request of 1 came, its next ask gives back what it holds
        // above its reserve (5 s of 1/s), and keeps the reserve.
        k.demand().arrive(1.0);
        let b = t.give_back("r").unwrap();
        assert_eq!((b.reserve, b.returned, b.backlog), (5.0, 5.0, 0.0));
        assert_eq!(k.available(), 5.0);
        assert_eq!(t.give_back("r").unwrap().returned, 0.0, "given once");
        // A settled cost gives 8 back to a bucket of 10 holding 5: the 3 it
        // has no room for are owed too, with the 5 above the reserve.
        k.charge(-8.0);
        assert_eq!(k.available(), 10.0);
        let b = t.give_back("r").unwrap();
        assert_eq!((b.returned, k.available()), (8.0, 5.0));
    }

    /// A templated resource makes a key per tenant: what one costs is
    /// mostly its limiter's size (tests/key_memory.rs has the heap bytes).
    /// Growing any of these by a field fails here first.
    #[test]
    #[cfg(all(target_pointer_width = "64", target_os = "linux"))]
    fn a_key_stays_small() {
        use std::mem::size_of;
        assert!(size_of::<Limiter>() <= 240, "Limiter: {} bytes", size_of::<Limiter>());
        assert!(size_of::<Rate>() <= 104, "Rate: {} bytes", size_of::<Rate>());
        assert!(size_of::<DemandMeter>() <= 80, "DemandMeter: {} bytes", size_of::<DemandMeter>());
        assert!(size_of::<Rare>() <= 48, "Rare: {} bytes", size_of::<Rare>());
        assert_eq!(size_of::<Key>(), 8, "a slot of a resource's set of keys");
    }

    #[test]
    fn reload_keeps_state_of_unchanged_resources() {
        let (clock, _h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![spec("a", Kind::Rate, 1.0), spec("g", Kind::Gauge, 1.0)]);
        let a = t.resource("a").unwrap().limiter("a");
        assert_eq!(a.remaining(), 2);
        assert!(super::super::rate::try_admit(a.rate().unwrap(), a.clock(), 1.0));
        t.configure(vec![spec("a", Kind::Rate, 1.0), spec("g", Kind::Rate, 1.0)]);
        let a2 = t.resource("a").unwrap().limiter("a");
        assert!(Arc::ptr_eq(&a, &a2));
        assert_eq!(a2.remaining(), 1, "state kept");
        assert_eq!(t.resource("g").unwrap().limiter("g").kind(), Kind::Rate, "kind change rebuilds");
        assert!(t.set_capacity("a", 5.0));
        assert_eq!(a.capacity(), 5.0);
        assert!(!t.set_capacity("nope", 5.0));
    }

    #[test]
    fn a_reload_moves_keys_at_the_file_capacity_but_not_leased_ones() {
        let (clock, _h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![spec("r", Kind::Rate, 1.0), spec("g", Kind::Gauge, 3.0)]);
        let r = t.resource("r").unwrap();
        let (leased, plain) = (r.limiter("r/leased"), r.limiter("r/plain"));
        let g = t.resource("g").unwrap().limiter("g");
        assert!(t.set_capacity("r/leased", 5.0));
        t.configure(vec![spec("r", Kind::Rate, 2.0), spec("g", Kind::Gauge, 4.0)]);
        assert_eq!(leased.capacity(), 5.0, "a leased capacity survives a reload");
        assert_eq!(plain.capacity(), 2.0);
        assert_eq!(g.capacity(), 4.0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Use(u16),
        Forget(Vec<u16>),
        Settle,
    }

    fn ops() -> impl proptest::strategy::Strategy<Value = Vec<Op>> {
        use proptest::prelude::*;
        // Ids from a range wide enough to pass FOLD_SMALL many times, so both ways of
        // adding a key (folded at once, or recent first) are exercised.
        let op = prop_oneof![
            20 => (0u16..3000).prop_map(Op::Use),
            2 => proptest::collection::vec(0u16..3000, 0..40).prop_map(Op::Forget),
            1 => Just(Op::Settle),
        ];
        proptest::collection::vec(op, 1..4000)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

        /// Against a plain map: every key made is found again (the same
        /// limiter, whether it is still recent or folded), forgotten keys are
        /// gone, and the bound counts both.
        #[test]
        fn keys_behave_as_one_map_however_they_are_stored(ops in ops(), bound in 900usize..2500) {
            let (clock, h) = Clock::manual(Time::from_secs(10));
            let t = LeaseTable::new(clock);
            t.configure(vec![ResourceSpec { max_keys: bound, templated: true, ..spec("r", Kind::Rate, 1.0) }]);
            let r = t.resource("r").unwrap();
            let mut model: HashMap<String, Arc<Limiter>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Use(i) => {
                        let id = format!("r/{i}");
                        match (r.try_limiter(&id), model.get(&id)) {
                            (Ok(l), Some(m)) => proptest::prop_assert!(Arc::ptr_eq(&l, m), "{id} changed limiter"),
                            (Ok(l), None) => {
                                proptest::prop_assert!(model.len() < bound, "{id} made past the bound");
                                model.insert(id, l);
                            }
                            (Err(_), known) => {
                                proptest::prop_assert!(known.is_none() && model.len() >= bound, "{id} refused")
                            }
                        }
                    }
                    Op::Forget(ids) => {
                        let ids: Vec<String> = ids.iter().map(|i| format!("r/{i}")).collect();
                        r.remove_all(ids.iter().map(String::as_str));
                        for id in &ids {
                            model.remove(id);
                            proptest::prop_assert!(r.get(id).is_none(), "{id} still there");
                        }
                    }
                    Op::Settle => {
                        h.advance(FOLD_AFTER);
                        t.settle();
                    }
                }
            }
            proptest::prop_assert_eq!(r.len(), model.len());
            let mut ids: Vec<String> = r.limiters().iter().map(|l| l.id().to_string()).collect();
            let mut want: Vec<String> = model.keys().cloned().collect();
            ids.sort();
            want.sort();
            proptest::prop_assert_eq!(ids, want);
            for (id, l) in &model {
                proptest::prop_assert!(Arc::ptr_eq(&r.get(id).unwrap(), l));
                proptest::prop_assert!(t.set_capacity(id, 3.0));
            }
        }
    }

    /// A templated resource's ids spread over every shard, whatever their
    /// form (a shared prefix, numbers, names), none holding far more than
    /// its share; the bound holds across shards; a reload that makes a
    /// fixed id templated shards its keys anew.
    #[test]
    fn a_templated_resources_keys_spread_over_its_shards() {
        let (clock, _h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![ResourceSpec { max_keys: 30_000, templated: true, ..spec("r", Kind::Rate, 1.0) }]);
        let r = t.resource("r").unwrap();
        assert_eq!(r.shards.len(), SHARDS);
        for form in ["t/tenant-{i:06}", "{i}", "org-{i}.example.com/users"] {
            let mut per = [0usize; SHARDS];
            for i in 0..10_000 {
                per[shard_index(&form.replace("{i:06}", &format!("{i:06}")).replace("{i}", &i.to_string()))] += 1;
            }
            let (lo, hi) = (per.iter().min().unwrap(), per.iter().max().unwrap());
            assert!(*lo > 10_000 / SHARDS / 2 && *hi < 10_000 / SHARDS * 2, "{form}: {per:?}");
        }
        for i in 0..30_000 {
            r.try_limiter(&format!("t/{i}")).unwrap();
        }
        assert!(matches!(r.try_limiter("t/one-more"), Err(KeyRefused::Full { .. })));
        assert_eq!((r.len(), r.limiters().len()), (30_000, 30_000));
        let ids: Vec<String> = (0..100).map(|i| format!("t/{i}")).collect();
        r.remove_all_if(ids.iter().map(String::as_str), |l| l.id() != "t/7");
        assert_eq!(r.len(), 29_901, "one kept");
        assert!(r.get("t/7").is_some() && r.get("t/8").is_none());
        r.remove_all(["t/7", "t/7", "t/no-such"]);
        assert_eq!(r.len(), 29_900);
        r.try_limiter("t/one-more").unwrap();
        let fixed = spec("f", Kind::Rate, 1.0);
        t.configure(vec![fixed.clone()]);
        assert_eq!(t.resource("f").unwrap().shards.len(), 1);
        t.configure(vec![ResourceSpec { templated: true, ..fixed }]);
        assert_eq!(t.resource("f").unwrap().shards.len(), SHARDS);
    }

    /// A table with one fixed-id rate resource `r` of unbounded keys, and its clock.
    fn one_resource() -> (LeaseTable, Arc<usher_core::clock::ManualClock>) {
        let (clock, h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![ResourceSpec { max_keys: usize::MAX, ..spec("r", Kind::Rate, 1.0) }]);
        (t, h)
    }

    #[test]
    fn past_fold_small_new_keys_wait_in_recent_until_a_quarter_or_a_second() {
        let (t, h) = one_resource();
        let r = t.resource("r").unwrap();
        for i in 0..FOLD_SMALL {
            r.limiter(&format!("k{i}"));
        }
        assert_eq!(r.shards[0].keys.load().len(), FOLD_SMALL, "small: each key folded at once");
        r.limiter("late");
        assert!(r.shards[0].keys.load().get("late").is_none() && r.get("late").is_some(), "recent first");
        t.settle();
        assert!(r.shards[0].keys.load().get("late").is_none(), "not before FOLD_AFTER");
        h.advance(FOLD_AFTER);
        t.settle();
        assert!(r.shards[0].keys.load().get("late").is_some(), "folded by the demand poll");
        for i in 0..FOLD_SMALL / FOLD_FRACTION {
            r.limiter(&format!("q{i}"));
        }
        assert_eq!(r.shards[0].keys.load().len(), FOLD_SMALL + 1 + FOLD_SMALL / FOLD_FRACTION, "a quarter: folded");
    }

    /// After a fold, the recent set keeps room for a batch like the one it
    /// folded, so the next batch does not grow it from empty; never more
    /// than RECENT_ROOM, so a burst's room is given back.
    #[test]
    fn a_fold_leaves_the_recent_set_room_for_the_next_batch_and_no_more() {
        let (t, h) = one_resource();
        let r = t.resource("r").unwrap();
        let settle = || {
            h.advance(FOLD_AFTER);
            t.settle();
        };
        let room = |r: &ResourceLimits| r.shards[0].recent.lock().unwrap().keys.capacity();
        // A snapshot of 100 keys folds its recent keys at 25.
        for i in 0..100 {
            r.limiter(&format!("a{i}"));
        }
        settle();
        let before = r.shards[0].keys.load().len();
        for i in 0..before / FOLD_FRACTION {
            r.limiter(&format!("b{i}"));
        }
        assert!(r.shards[0].recent.lock().unwrap().keys.is_empty(), "folded at a quarter");
        assert!(room(&r) >= before / FOLD_FRACTION, "room for the next batch: {}", room(&r));
        // A large batch leaves no more than RECENT_ROOM behind.
        for i in 0..4_000 {
            r.limiter(&format!("c{i}"));
        }
        settle();
        assert!(room(&r) <= 2 * RECENT_ROOM, "a burst's room is given back: {}", room(&r));
    }

    #[test]
    fn templated_keys_are_bounded_and_can_be_forgotten() {
        let (clock, _h) = Clock::manual(Time::from_secs(10));
        let t = LeaseTable::new(clock);
        t.configure(vec![spec("r", Kind::Rate, 1.0)]);
        let r = t.resource("r").unwrap();
        for i in 0..3 {
            assert_eq!(r.try_limiter(&format!("r/{i}")).unwrap().id(), format!("r/{i}"));
        }
        let full = r.try_limiter("r/3").unwrap_err();
        assert_eq!(full, KeyRefused::Full { resource: "r".into(), max_keys: 3 });
        assert_eq!(full.to_string(), "resource `r` already tracks 3 distinct ids (its max_keys)");
        assert_eq!(r.try_limiter("r/1").unwrap().id(), "r/1", "known ids are still served");
        assert_eq!(r.limiters().len(), 3);
        r.remove("r/0");
        assert_eq!(r.try_limiter("r/3").unwrap().id(), "r/3", "a forgotten key frees a place");
    }
}
