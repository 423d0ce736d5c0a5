//! Connects the sidecar's LeaseTable to the lease client: demand meters
//! become `wants`, leases become limiter capacities. Without a `doorman:`
//! section the sidecar starts an embedded capacity server (the same code as
//! `usher server`) configured from the resources' capacities, and leases from
//! it through the same refresher, so the single-machine default runs the
//! production path. The embedded server is the `embedded-server` feature
//! (on by default); without it a routes file needs `doorman:`
//! ([`EmbeddedServerOff`]).
//!
//! Capacities: a lease becomes the key's capacity times its pushback factor;
//! a long upstream hold gives the lease back and asks again before the hold
//! ends. A key with no lease keeps the capacity it was made with until a
//! request that carried it is answered (or a call fails). Capacity writes
//! from pushback (the request path) and from leases (the lease client) go
//! under the pushback lock, and a first pushback reads the capacity it backs
//! off from under that lock too.
//!
//! Demand is read every 100 ms, less often when a read takes over a
//! twentieth of that time; calls to the servers in between add no reads.
//! While the sidecar is quiet (no request since the last read) demand is
//! read only when an action is due: a refresh, a lease's expiry or hold end,
//! a templated key's idle timeout. The table's `Activity` (a new key, a
//! waiting or refused request, a reload, the first request after a quiet
//! spell) wakes a quiet lease client at once. Each read visits every key (a
//! measured rate moves as its window slides) but reports only the keys whose
//! (wants, pressure) changed and those forgotten (every key after a reload);
//! the lease core keeps the last demand of the others, and hands back only
//! the capacities that changed (plus, every turn, the keys under pushback).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pushback::Pushback;
use usher_core::clock::Time;
use usher_core::config::doorman::{LeaseSettings, Wants};
use usher_core::config::routes::{ResourceKind, RoutesConfig};
#[cfg(feature = "embedded-server")]
use usher_core::config::{
    resources::{Algorithm, ResourcesConfig, Template},
    routes::Segment,
};
use usher_lease::backoff::BackoffConfig;
use usher_lease::core::{Capacity, CoreConfig, DemandUpdate, KeyDemand, Mode, OnExpiry};
use usher_lease::driver::{Enforcer, LeaseClient, Runs, ServerSaid};
use usher_lease::transport::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_RPC_TIMEOUT, GrpcTransport, Transport};
use usher_limit::{LeaseTable, Limiter};
#[cfg(feature = "embedded-server")]
use usher_server::{LocalTransport, Node};

/// The embedded server's address in the in-process transport.
#[cfg(feature = "embedded-server")]
pub const EMBEDDED: &str = "embedded";
/// How often the lease client may refresh early from the embedded server.
const EMBEDDED_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The embedded server's refresh interval. Its only client is this
/// sidecar, so a refresh changes nothing that an early ask would not (new
/// keys and demand away from the lease ask at once, a reloaded capacity by
/// [`TableEnforcer::demand`]): long, so an idle sidecar wakes for its
/// leases once an hour.
#[cfg(feature = "embedded-server")]
const EMBEDDED_REFRESH_INTERVAL: Duration = Duration::from_secs(3600);
/// The embedded server's lease length: three refresh intervals.
#[cfg(feature = "embedded-server")]
const EMBEDDED_LEASE_LENGTH: Duration = Duration::from_secs(3 * 3600);
/// A local key whose bucket is full is forgotten once unused this long,
/// before its `key_idle_timeout`, while its resource is crowded (see
/// [`TableEnforcer::local_forget_at`]): long enough that a tenant calling
/// every few seconds keeps its key (a key made again costs more than one
/// kept), short enough that a million tenants seen once do not stay in
/// memory.
pub const LOCAL_IDLE: Duration = Duration::from_secs(10);
/// A templated resource is crowded when it holds more keys than this, or
/// more than half its `max_keys`: only then are its local keys forgotten
/// after [`LOCAL_IDLE`]. Below, a key stays to its `key_idle_timeout`, so a
/// tenant that comes back within it finds its key (no key is made again on
/// the request path), at about 0.3 KB a key: 21 MB at this count.
pub const LOCAL_KEEP: usize = 65_536;

/// Whether a resource holding `keys` keys of at most `max_keys` is crowded ([`LOCAL_KEEP`]).
pub fn crowded(keys: usize, max_keys: usize) -> bool {
    keys > LOCAL_KEEP.min(max_keys / 2)
}
/// The window over which a rate resource's demand is measured: short, so
/// that wants follow demand up and down within a refresh or two.
const DEMAND_WINDOW: Duration = Duration::from_secs(2);
/// A slow key's demand never reads below its traffic over this long (see `Measured::floor`).
const FLOOR_WINDOW: Duration = Duration::from_secs(300);
const MINUTE: Duration = Duration::from_secs(60);
/// A queue at a rate key asks for what passes it within this long at most (see [`drain`]).
const DRAIN: Duration = Duration::from_secs(5);
/// How long the peak in flight of a gauge is remembered.
const PEAK_WINDOW: Duration = Duration::from_secs(10);

#[derive(Default)]
struct KeyMemory {
    refused: u64,
    /// Boxed, made at the first measurement: a key with a fixed `wants`
    /// (every key of an embedded server, by default) never needs it.
    measured: Option<Box<Measured>>,
    /// The (wants, pressure) last reported to the lease client: a demand
    /// read reports the key again only when they change.
    reported: Option<(f64, bool)>,
}

/// A slow key's demand is measured over this long (from `LONG_WINDOW` to
/// twice as long ago): a key used at under a request a second often has no
/// request in [`DEMAND_WINDOW`], and read there it asked for 0.
const LONG_WINDOW: Duration = Duration::from_secs(30);
/// The short window measures the rate once it holds this many requests.
/// Requests, not cost units: one LLM call costs hundreds of tokens, and a
/// window holding one or two calls (and the refunds of others settled
/// there) read anywhere from 0 to four times the demand.
const SHORT_REQUESTS: u64 = 4;

/// Traffic is measured once it was seen over this long (before, the
/// key asks for nothing, or `min_wants`).
const FIRST_SPAN: Duration = Duration::from_millis(500);

/// A key with nothing since its first requests asks for them over the
/// time since, fading, until this long after them (then it stopped).
const FIRST_FADE: Duration = Duration::from_secs(10);

/// A key's arrivals so far: in cost units (less what settled below its
/// charge), and in requests.
#[derive(Debug, Clone, Copy, Default)]
struct Arrivals {
    units: f64,
    requests: u64,
}

/// What measuring a key's demand (`wants: auto`) remembers.
#[derive(Default)]
struct Measured {
    /// (time, arrivals so far) readings over the last [`DEMAND_WINDOW`].
    arrivals: VecDeque<(Time, Arrivals)>,
    /// Two (time, arrivals so far) anchors for the long window: the older
    /// is one to two [`LONG_WINDOW`]s old once traffic has run that long.
    anchors: [Option<(Time, Arrivals)>; 2],
    /// When the last request arrived, and how many had by then.
    last_arrival: Option<(Time, u64)>,
    /// When traffic was first read, and the arrivals then.
    first: Option<(Time, Arrivals)>,
    /// The last measured rate: once demand was measured, a read that cannot
    /// measure it (a slow or stalled call to the servers spaced the reads
    /// out) keeps it rather than asking for nothing again.
    last_rate: Option<f64>,
    /// (time, peak in flight + waiters) over the peak window.
    peaks: VecDeque<(Time, f64)>,
    /// (time, arrivals so far) a minute or more apart, over the last
    /// [`FLOOR_WINDOW`] (see [`Measured::floor`]).
    minutes: VecDeque<(Time, Arrivals)>,
    headroom: usher_lease::headroom::Headroom,
}

impl Measured {
    /// The arrival rate in cost units at `now` (`total` arrivals so far),
    /// or None before traffic was seen over half a second. Over
    /// [`DEMAND_WINDOW`] once that holds [`SHORT_REQUESTS`]; for a slower
    /// key over the long window, until no request came for three times its
    /// usual gap (it stopped: the short window's rate, 0, applies), and
    /// apps it refused are not due back (`retries_due`: the latest
    /// `Retry-After` it gave; an app that waits it out is not gone, and its
    /// share must be there when it comes back). Once measured, a read that
    /// cannot measure keeps the last rate.
    fn measure(&mut self, now: Time, total: Arrivals, retries_due: Option<Time>) -> Option<f64> {
        if total.requests > 0 {
            self.first.get_or_insert((now, total));
            if self.last_arrival.is_none_or(|(_, n)| n != total.requests) {
                self.last_arrival = Some((now, total.requests));
            }
            match self.anchors {
                [None, _] => self.anchors = [Some((now, total)), None],
                [Some(_), None] => self.anchors[1] = Some((now, total)),
                [Some(_), Some((t1, _))] if now.since(t1) >= LONG_WINDOW => {
                    self.anchors = [self.anchors[1], Some((now, total))];
                }
                _ => {}
            }
            if self.minutes.back().is_none_or(|(t, _)| now.since(*t) >= MINUTE) {
                self.minutes.push_back((now, total));
            }
            while self.minutes.len() > 2 && self.minutes.front().is_some_and(|(t, _)| now.since(*t) > FLOOR_WINDOW) {
                self.minutes.pop_front();
            }
        }
        // (Refunds settled in a window may outweigh what arrived in it.)
        let short = match (self.arrivals.front(), self.arrivals.back()) {
            (Some((t0, a0)), Some((t1, a1))) if total.requests > 0 && t1.since(*t0) >= FIRST_SPAN => {
                Some((a1.requests - a0.requests, ((a1.units - a0.units) / t1.since(*t0).as_secs_f64()).max(0.0)))
            }
            _ => None,
        };
        let long = match (self.anchors[0], self.last_arrival) {
            (Some((t0, a0)), Some((_, n))) if now.since(t0) >= DEMAND_WINDOW && n > a0.requests => {
                // Over ten seconds at least: a few calls in a sidecar's first
                // seconds are no rate yet (read over the seconds they came
                // in, three LLM calls asked for 130 tokens a second where 40
                // were wanted, and the fleet looked overloaded).
                let secs = now.since(t0).max(LONG_WINDOW).as_secs_f64();
                Some((((total.units - a0.units) / secs).max(0.0), (n - a0.requests) as f64 / secs))
            }
            // Nothing since the first requests, half a second to ten seconds
            // on: they are the rate so far, over at least [`FIRST_FADE`] (a
            // key asked once, then again a few seconds later, kept a lease
            // for the second rather than asking for 0 in between; read over
            // the short window, two LLM calls at a sidecar's start asked for
            // 200 tokens a second, the fleet looked overloaded, and no spare
            // capacity went to the quiet sidecars).
            (Some((t0, a0)), Some((_, n)))
                if self.first.is_some_and(|(t, _)| t == t0)
                    && n == a0.requests
                    && (FIRST_SPAN..FIRST_FADE).contains(&now.since(t0)) =>
            {
                let secs = LONG_WINDOW.as_secs_f64();
                Some((a0.units / secs, a0.requests as f64 / secs))
            }
            _ => None,
        };
        let rate = match (short, long) {
            (Some((requests, rate)), _) if requests >= SHORT_REQUESTS => Some(rate),
            (short, Some((long, requests_per_s))) => {
                let gap = self.last_arrival.map_or(Duration::MAX, |(t, _)| now.since(t));
                let waited_out = retries_due.is_none_or(|t| now > t.saturating_add(DEMAND_WINDOW));
                let stopped = waited_out && gap.as_secs_f64() > (3.0 / requests_per_s).max(DEMAND_WINDOW.as_secs_f64());
                match stopped {
                    true => short.map(|(_, r)| r).or(Some(0.0)),
                    false => Some(long),
                }
            }
            (short, None) => short.map(|(_, r)| r),
        };
        if rate.is_some() {
            self.last_rate = rate;
        }
        rate.or(self.last_rate).map(|r| r.max(self.floor(now, total)))
    }

    /// What the key's traffic came to over the last few minutes (from one
    /// to [`FLOOR_WINDOW`]), a floor under its measured rate: a key called a
    /// few times a minute reads 0 between its calls, and asking for 0 while
    /// the others' rates wander up to the capacity, it was leased nothing
    /// and its next call waited for a lease. A key that stopped gives its
    /// lease back as its calls leave the window.
    fn floor(&self, now: Time, total: Arrivals) -> f64 {
        match self.minutes.front() {
            Some((t0, a0)) if now.since(*t0) >= MINUTE => {
                let secs = now.since(*t0).as_secs_f64();
                // Only a slow key's (under two requests a second, as the
                // short window counts them): a busy key that stops gives
                // its lease back at once.
                let slow = ((total.requests - a0.requests) as f64 / secs)
                    < SHORT_REQUESTS as f64 / DEMAND_WINDOW.as_secs_f64();
                if slow { ((total.units - a0.units) / secs).max(0.0) } else { 0.0 }
            }
            _ => 0.0,
        }
    }
}

/// The sidecar as the lease client sees it: its lease table, pushback, and
/// the routes file in force.
pub struct TableEnforcer {
    table: Arc<LeaseTable>,
    pushback: Arc<Pushback>,
    /// The routes file in force (a reload changes it).
    config: ConfigSource,
    transitions: Transitions,
    /// The embedded capacity server, for a routes file without `doorman:`.
    embedded: Option<Embedded>,
    /// Keys may be local (see [`crate::resource::is_local`]): the lease
    /// client leases from an embedded server, whose only client it is.
    local_keys: bool,
    memory: Mutex<HashMap<String, KeyMemory>>,
    /// The routes file in force at the last demand read: the next one
    /// reports every key if it changed.
    read_config: Mutex<Option<Arc<RoutesConfig>>>,
    /// The routes file in force when capacities were last applied to every
    /// key: a reload may have made keys anew (see [`Enforcer::rebuilt`]).
    applied_config: Mutex<Option<Arc<RoutesConfig>>>,
    /// The lease client this enforcer serves, for the refresh interval of a
    /// key's last lease: set once it started, taken at shutdown (the client
    /// holds this enforcer, so keeping it would keep both alive).
    client: Mutex<Option<LeaseClient>>,
    /// The last demand poll's reading (arrivals of every key, number of
    /// keys), against which the next one tells whether anything happened.
    last: Mutex<Option<(f64, usize)>>,
    /// Nothing happened between the last two demand polls (see [`Enforcer::quiet`]).
    quiet: AtomicBool,
    /// When the next templated key, unused from the last poll on, becomes
    /// idle and is to be forgotten (see [`Enforcer::due`]).
    next_idle: Mutex<Option<Time>>,
    /// Keys whose lease about to be applied is the servers' first for them
    /// (see [`ServerSaid::fresh`]): filled once applied.
    fresh: Mutex<Vec<String>>,
    /// Templated keys' events, summarised in the info log.
    keylog: Mutex<crate::keylog::KeyLog>,
    /// Keys credited with the servers' pooled burst, and how much (see
    /// [`ServerSaid::credit`]): added to their buckets once their leases apply.
    credits: Mutex<Vec<(String, f64)>>,
}

/// A resource's lease settings, kind, configured capacity (units per
/// second, or in flight), whether its id is fixed, and whether its keys
/// are local (no lease: [`crate::resource::is_local`]).
#[derive(Clone, Copy)]
struct Settings<'a> {
    lease: &'a LeaseSettings,
    kind: ResourceKind,
    capacity: f64,
    fixed: bool,
    local: bool,
    /// Its keys are [`crowded`] (read once per pass over them).
    crowded: bool,
}

impl TableEnforcer {
    fn config(&self) -> Arc<RoutesConfig> {
        (self.config)()
    }

    fn settings<'a>(&self, cfg: &'a RoutesConfig, resource: &str) -> Option<Settings<'a>> {
        cfg.resources.get(resource).map(|r| Settings {
            lease: &r.lease,
            kind: r.kind,
            capacity: match r.kind {
                ResourceKind::Rate => r.capacity.per_second(),
                ResourceKind::Gauge => r.capacity.per_window,
            },
            fixed: r.id.is_fixed(),
            local: self.local_keys && crate::resource::is_local(cfg, r),
            crowded: self.table.resource(resource).is_some_and(|l| crowded(l.len(), r.max_keys)),
        })
    }

    /// The wants of one key: fixed, or measured (README: "wants: auto").
    fn wants(
        &self,
        m: &mut KeyMemory,
        l: &usher_limit::Limiter,
        kind: ResourceKind,
        settings: &LeaseSettings,
        capacity: f64,
        now: Time,
    ) -> (f64, bool) {
        let (id, sample) = (l.id(), l.demand().sample(now));
        let refused_since = sample.refused.saturating_sub(m.refused);
        let refused_now = refused_since > 0;
        m.refused = sample.refused;
        let pressure_signal = refused_now || sample.waiters > 0;
        let embedded_default = if self.embedded.is_some() { Wants::Fixed(capacity) } else { Wants::Auto };
        let wants = match settings.wants.unwrap_or(embedded_default) {
            Wants::Fixed(w) => w,
            Wants::Auto => {
                let m = m.measured.get_or_insert_default();
                let measured = match kind {
                    ResourceKind::Rate => {
                        let total = Arrivals { units: l.demand().arrivals(), requests: l.demand().requests() };
                        // Nothing is recorded before the first arrival: the
                        // window starts with the traffic, not with the idle
                        // time before it (which read a fresh sidecar's 45/s as
                        // 5/s a tenth of a second in, and gave its lease back),
                        // and what arrived before its first sample is left out
                        // (requests queued while a sidecar waited for its first
                        // lease arrive at once: counted, they doubled the rate).
                        if total.requests > 0 {
                            m.arrivals.push_back((now, total));
                        }
                        while m.arrivals.len() > 2
                            && m.arrivals.front().is_some_and(|(t, _)| now.since(*t) > DEMAND_WINDOW)
                        {
                            m.arrivals.pop_front();
                        }
                        m.measure(now, total, l.demand().retries_due())
                            .map(|rate| rate * m.headroom.factor(now, rate, pressure_signal, settings.headroom))
                            .map(|w| w.max(drain(l, now)))
                    }
                    ResourceKind::Gauge => {
                        let held = (l.demand().take_peak() + sample.waiters.max(0)) as f64;
                        // A refused request wanted a slot the lease did not
                        // have, as a refused arrival counts in a rate's wants:
                        // each counts, up to the configured capacity. (A gauge
                        // leased 0 after an idle spell, with `max_wait: 0`,
                        // refuses every request at once: counting only what
                        // was in flight, it would ask for 0 for ever.)
                        let peak = held + (refused_since as f64).min((capacity - held).max(0.0));
                        m.peaks.push_back((now, peak));
                        while m.peaks.front().is_some_and(|(t, _)| now.since(*t) > PEAK_WINDOW) {
                            m.peaks.pop_front();
                        }
                        let seen = sample.admitted + sample.paced + sample.refused > 0;
                        seen.then(|| m.peaks.iter().map(|(_, p)| *p).fold(0.0, f64::max))
                    }
                };
                // Before any demand was measured, ask for nothing (or
                // `min_wants`): below the capacity the servers' spare
                // capacity serves the first requests, and a first guess of
                // the routes file's capacity held most of an LLM budget for
                // a sidecar whose app called once a minute, while a busier
                // one's calls waited 18 s.
                let w = measured.unwrap_or(0.0).max(settings.min_wants);
                settings.max_wants.map_or(w, |mx| w.min(mx))
            }
        };
        // A key its upstream pushes back on gives back what it cannot use for
        // a while, so the capacity flows to sidecars that can use it, and asks
        // for it again in time to have it when it can.
        if let Some(pushed) = self.pushback.lease_wants(id, wants, now, || self.relet_lead(id)) {
            return pushed;
        }
        (wants, pressure_signal && wants > l.capacity() + 1e-9)
    }
}

/// What a rate key with requests waiting needs to pass them soon: its
/// capacity, and its backlog over its `max_wait` (at least a second, at
/// most [`DRAIN`]). A clump of calls at a key that is measured over half a
/// minute (an LLM app's few calls a minute) asks at once for what serves
/// it, rather than once the clump has moved its rate.
fn drain(l: &usher_limit::Limiter, now: Time) -> f64 {
    match l.rate() {
        Some(r) if l.demand().waiters() > 0 => {
            let backlog = r.backlog(now);
            let over = l.spec().max_wait.clamp(Duration::from_secs(1), DRAIN).as_secs_f64();
            if backlog > 0.0 && r.capacity().is_finite() { r.capacity() + backlog / over } else { 0.0 }
        }
        _ => 0.0,
    }
}

impl TableEnforcer {
    /// How long getting the lease of `id` back would take (see
    /// [`super::pushback::relet_lead`]), from its last lease's refresh interval.
    fn relet_lead(&self, id: &str) -> Duration {
        let cfg = self.config();
        let jitter = cfg.doorman.as_ref().map_or(usher_core::config::doorman::DEFAULT_JITTER, |d| d.jitter);
        let client = self.client.lock().expect("enforcer client").clone();
        let lease = client.and_then(|c| c.lease_of(id));
        let refresh = lease.map_or(Duration::ZERO, |l| l.refresh_interval);
        super::pushback::relet_lead(refresh, min_interval(&cfg), jitter)
    }

    /// Applies pushback to the local keys among `ids` (no lease:
    /// [`crate::resource::is_local`]) against their configured capacity, as
    /// the lease client re-applies a leased key's lease every turn: their
    /// recovery steps and holds take effect without one.
    fn reapply_local(&self, ids: &[String]) {
        let cfg = self.config();
        let now = self.table.clock().now();
        for r in cfg.resources.values().filter(|r| crate::resource::is_local(&cfg, r)) {
            let Some(limits) = self.table.resource(&r.name) else { continue };
            let capacity = limits.spec().capacity;
            for l in ids.iter().filter_map(|id| limits.get(id)) {
                self.pushback.apply(l.id(), capacity, now, |c, hold| {
                    l.set_capacity(c);
                    if hold.is_some() {
                        l.set_hold(hold);
                    }
                });
            }
        }
    }

    /// Reads the demand: every key's when `full` or when the routes file
    /// changed since the last read (its settings are every key's), else
    /// only the keys whose (wants, pressure) changed since they were last
    /// reported, and the keys forgotten. Every key is still visited: a
    /// measured rate moves while its window slides, with no new request.
    fn read(&self, full: bool) -> DemandUpdate {
        // Asleep unless this read finds something: an arrival from here on wakes the lease client.
        let activity = self.table.activity();
        activity.sleep(true);
        let cfg = self.config();
        // A new routes file may have rebuilt resources (and dropped their
        // keys): the core applies every key again once this read made them
        // (a re-apply before it, `Enforcer::rebuilt`, can miss keys not made yet).
        let rebuilt = self.first_read_of(&cfg);
        let full = full || rebuilt;
        // A routes file reloaded into the embedded server: every key asks for
        // its (maybe raised) capacity now, not at its next refresh.
        let reloaded = self.embedded.as_ref().is_some_and(|e| e.reload(&cfg));
        // Fixed ids need a lease before their first request; templated keys
        // appear as requests name them.
        for r in cfg.resources.values().filter(|r| r.id.is_fixed()) {
            if let Some(limits) = self.table.resource(&r.name) {
                limits.limiter(&r.id.text);
            }
        }
        self.table.settle();
        let reading = self.read_keys(&cfg, full, reloaded);
        activity.sleep(self.note(&reading));
        {
            let forgotten = reading.forgotten.values().map(|(_, ids)| ids.len() as u64).sum();
            let mut log = self.keylog.lock().expect("enforcer key log");
            let now = self.table.clock().now();
            log.read(now, reading.made, forgotten);
            log.tick(now, reading.templated);
        }
        let removed = self.forget(reading.forgotten);
        DemandUpdate { changed: reading.demand, removed, complete: full, rebuilt }
    }

    /// Whether `cfg` is not the routes file the last demand read saw; it is from now on.
    fn first_read_of(&self, cfg: &Arc<RoutesConfig>) -> bool {
        let mut read = self.read_config.lock().expect("enforcer config");
        let same = read.as_ref().is_some_and(|r| Arc::ptr_eq(r, cfg));
        *read = Some(cfg.clone());
        !same
    }

    /// One pass over every key: what changed since the last read (to tell a
    /// quiet table), the keys gone idle, and the demand of the others to
    /// report (every key's when `full`; with pressure when `reloaded`).
    fn read_keys(&self, cfg: &RoutesConfig, full: bool, reloaded: bool) -> Reading {
        let now = self.table.clock().now();
        let mut reading = Reading::default();
        // Keys come resource by resource: its settings are looked up once per run of them.
        let mut current: Option<(&str, Option<Settings<'_>>)> = None;
        let mut mem = self.memory.lock().expect("enforcer memory");
        if full {
            // Every key present is reported below; one the core drops now (its
            // resource rebuilt by a reload) must be reported again when a
            // request makes it anew, whatever its demand then.
            for m in mem.values_mut() {
                m.reported = None;
            }
        }
        self.table.each_limiter(|resource, l| {
            reading.arrivals += l.demand().arrivals();
            reading.busy |= l.demand().in_flight() > 0 || l.demand().waiters() > 0;
            reading.keys += 1;
            let settings = match current {
                Some((name, settings)) if name == resource => settings,
                _ => {
                    let (name, settings) = cfg
                        .resources
                        .get_key_value(resource)
                        .map_or((None, None), |(name, _)| (Some(name.as_str()), self.settings(cfg, resource)));
                    if let Some(name) = name {
                        current = Some((name, settings));
                    }
                    settings
                }
            };
            let Some(Settings { lease: settings, kind, capacity, fixed, local, crowded }) = settings else { return };
            if !fixed {
                // A templated key is forgotten once idle for its key_idle_timeout.
                reading.templated += 1;
                let (used, first) = l.last_use(now);
                reading.made += u64::from(first);
                let at = match local && crowded {
                    true => self.local_forget_at(l, used, settings.key_idle_timeout, now),
                    false => used.saturating_add(settings.key_idle_timeout),
                };
                if at <= now {
                    mem.remove(l.id());
                    tracing::debug!(resource, id = %l.id(), idle = ?settings.key_idle_timeout, "forgot an idle key; releasing its lease");
                    let (_, ids) = reading.forgotten.entry(resource.to_string()).or_insert((local, Vec::new()));
                    ids.push(l.id().to_string());
                    return;
                }
                reading.next_idle = Some(reading.next_idle.map_or(at, |n| n.min(at)));
            }
            if local {
                // No lease, so nothing to report (and, after a reload made
                // the resource local, nothing to remember).
                if full {
                    mem.remove(l.id());
                }
                return;
            }
            // Looked up before it is inserted: no new id string per key and read.
            if !mem.contains_key(l.id()) {
                mem.insert(l.id().to_string(), KeyMemory::default());
            }
            let m = mem.get_mut(l.id()).expect("inserted above");
            let (wants, pressure) = self.wants(m, l, kind, settings, capacity, now);
            let reported = Some((wants, pressure || reloaded));
            // A fresh account of the upstream's quota goes up too, and a
            // calendar unit's account at every read (it moves with each request).
            let (_, fresh_quota) = l.quota(false);
            let account = l.account();
            if full || m.reported != reported || fresh_quota || account.is_some() {
                m.reported = reported;
                reading.demand.push(KeyDemand {
                    resource_id: l.id().to_string(),
                    priority: settings.priority,
                    wants,
                    on_expiry: on_expiry(settings.on_expiry),
                    safe_capacity: settings.safe_capacity,
                    pressure: pressure || reloaded,
                    quota: l.quota(true).0,
                    account: account.map(Box::new),
                    window: l.window(),
                });
            }
        });
        reading
    }

    /// When a local key of a crowded resource ([`crowded`]) unused since
    /// `used` is forgotten: once it has been idle for [`LOCAL_IDLE`] (or
    /// its `key_idle_timeout`, if shorter) and holds nothing a key made
    /// anew would not ([`usher_limit::Limiter::fresh_at`]: its bucket full,
    /// nothing told, no pushback), else at its timeout, as any templated
    /// key. Its next
    /// request makes it again with the same outcome, and a tenant seen once
    /// costs nothing after that. Until it has idled, that moment is
    /// returned (the lease client looks again then): one addition, as for a
    /// key that leases, on this pass over every key.
    #[inline]
    fn local_forget_at(&self, l: &Limiter, used: Time, timeout: Duration, now: Time) -> Time {
        let idle = used.saturating_add(LOCAL_IDLE.min(timeout));
        if idle > now {
            return idle;
        }
        let timeout = used.saturating_add(timeout);
        match l.fresh_at() {
            Some(full) if !self.pushback.tracks(l.id()) => full.max(idle).min(timeout),
            _ => timeout,
        }
    }

    /// Keeps what `reading` found for the next read and the lease client;
    /// returns whether nothing happened since the last read (quiet).
    fn note(&self, reading: &Reading) -> bool {
        let seen = (reading.arrivals, reading.keys);
        let mut last = self.last.lock().expect("enforcer reading");
        let quiet = !reading.busy && reading.forgotten.is_empty() && !self.pushback.any() && *last == Some(seen);
        *last = Some(seen);
        self.quiet.store(quiet, Ordering::Relaxed);
        *self.next_idle.lock().expect("enforcer next idle") = reading.next_idle;
        quiet
    }

    /// Removes the keys gone idle, by resource (one copy of a resource's
    /// snapshot), and returns the ids whose leases are to be released (a
    /// local key has none).
    fn forget(&self, forgotten: HashMap<String, (bool, Vec<String>)>) -> Vec<String> {
        let mut removed = Vec::new();
        for (resource, (local, ids)) in forgotten {
            let limits = self.table.resource(&resource);
            if local {
                // A local key used since the read is kept: its bucket may
                // no longer be full. (A request that found it a moment
                // before and arrives after this check still spends from it.)
                if let Some(limits) = limits {
                    limits.remove_all_if(ids.iter().map(String::as_str), Limiter::untouched);
                }
                continue;
            }
            if let Some(limits) = limits {
                limits.remove_all(ids.iter().map(String::as_str));
            }
            // A templated id another resource also made keeps its lease for that one.
            removed.extend(ids.into_iter().filter(|id| !self.table.contains(id)));
        }
        removed
    }
}

/// What one demand read found over every key.
#[derive(Default)]
struct Reading {
    /// Every key's arrivals so far.
    arrivals: f64,
    /// Whether any key had a request in flight or waiting.
    busy: bool,
    /// How many keys there were.
    keys: usize,
    /// When the next templated key becomes idle, if none is used until then.
    next_idle: Option<Time>,
    /// The keys whose demand is reported.
    demand: Vec<KeyDemand>,
    /// The idle keys, by resource, and whether its keys are local: removed together.
    forgotten: HashMap<String, (bool, Vec<String>)>,
    /// Templated keys seen for the first time.
    made: u64,
    /// How many keys were templated ones.
    templated: usize,
}

impl Enforcer for TableEnforcer {
    fn demand(&self) -> Vec<KeyDemand> {
        self.forget_transitions(self.read(true)).changed
    }

    fn demand_update(&self) -> DemandUpdate {
        self.forget_transitions(self.read(false))
    }

    fn quiet(&self) -> bool {
        self.quiet.load(Ordering::Relaxed)
    }

    fn due(&self) -> Option<Time> {
        let idle = *self.next_idle.lock().expect("enforcer next idle");
        let summary = self.keylog.lock().expect("enforcer key log").due();
        idle.into_iter().chain(summary).min()
    }

    fn activity(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(self.table.activity().notify())
    }

    fn on_transition(&self, t: &usher_lease::core::Transition) {
        // A change the core noted before the key was forgotten leaves no series behind.
        if self.table.contains(&t.resource_id) {
            self.transitions.count(&t.resource_id, t.from, t.to);
        }
        // A shared key's first lease from the servers (a cached one moves no
        // key out of pending) fills its bucket if nobody else can hold that
        // share of the fleet's burst.
        if (t.from, t.to) == (Mode::Pending, Mode::Leased) {
            self.table.fill(&t.resource_id, false);
        }
        if self.per_key(&t.resource_id) {
            self.keylog.lock().expect("enforcer key log").transition(self.table.clock().now(), t.from, t.to);
        }
    }

    fn per_key(&self, id: &str) -> bool {
        !self.config().resources.values().any(|r| r.id.is_fixed() && r.id.text == id)
    }

    fn rebuilt(&self) -> bool {
        // A reload configures the table before it stores the new file: once
        // the file is seen here, the resources it made are in the table.
        let cfg = self.config();
        let mut applied = self.applied_config.lock().expect("enforcer config");
        let rebuilt = !applied.as_ref().is_some_and(|a| Arc::ptr_eq(a, &cfg));
        *applied = Some(cfg);
        rebuilt
    }

    fn server_said(&self, said: &[(String, ServerSaid)]) {
        let mut fresh = self.fresh.lock().expect("enforcer fresh keys");
        for (id, s) in said {
            if let Some(c) = s.fleet {
                self.table.set_fleet(id, c);
            }
            self.table.set_renews(id, s.renews);
            self.table.set_bucket(id, s.bucket);
            if s.fresh {
                fresh.push(id.clone());
            }
            if s.credit > 0.0 {
                self.credits.lock().expect("enforcer credited keys").push((id.clone(), s.credit));
            }
        }
    }

    fn reapply(&self) -> Vec<String> {
        let ids = self.pushback.ids();
        if self.local_keys && !ids.is_empty() {
            self.reapply_local(&ids);
        }
        ids
    }

    fn allot(&self, allotments: &[(String, Option<usher_limit::allot::Allotment>)]) {
        for (id, a) in allotments {
            self.table.allot(id, *a);
        }
    }

    fn next_renewal(&self, at: Time) {
        self.table.set_renewal(Some(at));
    }

    fn give_back(&self, id: &str) -> Option<usher_limit::table::BucketSaid> {
        self.table.give_back(id)
    }

    fn apply(&self, capacities: &[(String, Capacity)]) {
        let now = self.table.clock().now();
        for (id, cap) in capacities {
            let c = match cap {
                Capacity::Limited(c) => *c,
                Capacity::Unlimited => f64::INFINITY,
            };
            self.pushback.apply(id, c, now, |c, hold| {
                self.table.set_capacity(id, c);
                if hold.is_some() {
                    self.table.set_hold(id, hold);
                }
            });
        }
        // A key the servers leased for the first time starts with its share of the fleet's burst.
        for id in self.fresh.lock().expect("enforcer fresh keys").drain(..) {
            self.table.fill(&id, true);
        }
        // A lease grown out of free capacity brings its share of the pooled burst.
        for (id, units) in self.credits.lock().expect("enforcer credited keys").drain(..) {
            self.table.credit(&id, units);
        }
    }
}

/// The lease client's copy of a resource's `on_expiry`.
fn on_expiry(o: usher_core::config::doorman::OnExpiry) -> OnExpiry {
    match o {
        usher_core::config::doorman::OnExpiry::Optimistic => OnExpiry::Optimistic,
        usher_core::config::doorman::OnExpiry::Pessimistic => OnExpiry::Pessimistic,
        usher_core::config::doorman::OnExpiry::Safe => OnExpiry::Safe,
    }
}

/// The embedded server's resources: one template per routes-file resource,
/// its capacity the resource's total, shared FAIR_SHARE; templated ids become
/// globs (`github/{header.x-tenant}` → `github/*`).
#[cfg(feature = "embedded-server")]
pub fn embedded_resources(cfg: &RoutesConfig) -> ResourcesConfig {
    let algorithm = Algorithm {
        kind: usher_core::config::resources::Kind::FairShare,
        lease_length: EMBEDDED_LEASE_LENGTH,
        refresh_interval: EMBEDDED_REFRESH_INTERVAL,
        learning_mode_duration: Duration::ZERO,
        parameters: vec![],
    };
    let mut templates: Vec<Arc<Template>> = Vec::new();
    // Keys that match no resource's glob (there should be none) get nothing,
    // unless a resource's id is a placeholder alone: its glob is `*`, and the
    // routes file lets no other resource's id meet it.
    let mut catch_all = Template {
        identifier_glob: "*".into(),
        capacity: 0.0,
        safe_capacity: Some(0.0),
        description: Some("catch-all".into()),
        algorithm: algorithm.clone(),
        calendar: None,
    };
    let mut fixed: Vec<_> = cfg.resources.values().filter(|r| r.id.is_fixed()).collect();
    fixed.extend(cfg.resources.values().filter(|r| !r.id.is_fixed()));
    for r in fixed {
        let glob: String =
            r.id.segments
                .iter()
                .map(|s| match s {
                    Segment::Literal(t) => t.replace(['*', '?', '['], "?"),
                    _ => "*".to_string(),
                })
                .collect();
        if templates.iter().any(|t| t.identifier_glob == glob) {
            continue;
        }
        let capacity = match r.kind {
            ResourceKind::Rate => r.capacity.per_second(),
            ResourceKind::Gauge => r.capacity.per_window,
        };
        let template = Template {
            identifier_glob: glob,
            capacity,
            safe_capacity: r.lease.safe_capacity,
            description: Some(format!("routes-file resource `{}`", r.name)),
            algorithm: algorithm.clone(),
            calendar: r.calendar.then_some(r.capacity.window),
        };
        match template.identifier_glob == "*" {
            true => catch_all = template,
            false => templates.push(Arc::new(template)),
        }
    }
    templates.push(Arc::new(catch_all));
    ResourcesConfig { templates }
}

/// The lease client's shortest time between two refreshes.
fn min_interval(cfg: &RoutesConfig) -> Duration {
    cfg.doorman.as_ref().map_or(EMBEDDED_MIN_INTERVAL, |d| d.min_interval)
}

/// Where the enforcer reads the routes file in force.
pub type ConfigSource = Arc<dyn Fn() -> Arc<RoutesConfig> + Send + Sync>;

/// Starts a lease client for `table`, whose resources `config` describes
/// (and whose `doorman:` section, or its absence, says where capacity comes
/// from). Fails only without the `embedded-server` feature, for a routes
/// file without `doorman:`.
pub fn start_with(
    config: ConfigSource,
    table: Arc<LeaseTable>,
    pushback: Arc<Pushback>,
    registry: &prometheus::Registry,
    shutdown: CancellationToken,
) -> Result<(LeaseClient, tokio::task::JoinHandle<()>), EmbeddedServerOff> {
    start_wired(config, table, pushback, registry, shutdown, Wiring::default())
}

/// How a lease client is wired to its servers and its runtime, beyond its
/// routes file: what [`start_wired`] takes.
#[derive(Clone)]
pub struct Wiring {
    /// The transport to the `doorman:` section's servers, instead of gRPC
    /// (an in-process one, for a simulation in virtual time).
    pub transport: Option<Arc<dyn Transport>>,
    /// Where the lease client runs: a thread of its own (the default), or
    /// a task on the caller's runtime (whose time a test may pause).
    pub runs: Runs,
}

impl Default for Wiring {
    fn default() -> Self {
        Wiring { transport: None, runs: Runs::OwnThread }
    }
}

/// [`start_with`], wired as `wiring` says.
pub fn start_wired(
    config: ConfigSource,
    table: Arc<LeaseTable>,
    pushback: Arc<Pushback>,
    registry: &prometheus::Registry,
    shutdown: CancellationToken,
    wiring: Wiring,
) -> Result<(LeaseClient, tokio::task::JoinHandle<()>), EmbeddedServerOff> {
    let cfg = config();
    let clock = table.clock().clone();
    let (core_cfg, transport, embedded, cache) = match &cfg.doorman {
        Some(d) => {
            let (c, grpc) = remote(d);
            (c, wiring.transport.unwrap_or(grpc), None, d.cache_file.clone())
        }
        None => {
            let (c, transport, embedded) = Embedded::start(&cfg, &clock)?;
            (c, transport, Some(embedded), None)
        }
    };
    let transitions = Transitions::default();
    let _ = registry.register(Box::new(transitions.clone()));
    let enforcer = Arc::new(TableEnforcer {
        table,
        pushback,
        config,
        transitions,
        local_keys: embedded.is_some(),
        embedded,
        memory: Mutex::new(HashMap::new()),
        read_config: Mutex::new(None),
        applied_config: Mutex::new(None),
        client: Mutex::new(None),
        last: Mutex::new(None),
        quiet: AtomicBool::new(false),
        next_idle: Mutex::new(None),
        fresh: Mutex::new(Vec::new()),
        keylog: Mutex::default(),
        credits: Mutex::new(Vec::new()),
    });
    // On a thread of its own: with many tenant keys, reading their demand and
    // (embedded) deciding their leases takes long enough to stall requests.
    let (client, task) =
        LeaseClient::start_on(wiring.runs, core_cfg, clock, transport, enforcer.clone(), cache, shutdown.clone());
    *enforcer.client.lock().expect("enforcer client") = Some(client.clone());
    tokio::spawn(async move {
        shutdown.cancelled().await;
        enforcer.client.lock().expect("enforcer client").take();
    });
    Ok((client, task))
}

/// The lease client's settings and transport for the capacity servers `d` names.
fn remote(d: &usher_core::config::doorman::DoormanConfig) -> (CoreConfig, Arc<dyn Transport>) {
    let mut c = CoreConfig::new(d.client_id.clone(), d.servers.clone());
    c.jitter = d.jitter;
    c.min_interval = d.min_interval;
    c.backoff = BackoffConfig::from(d.backoff);
    tracing::info!(servers = %d.servers.join(","), client_id = %d.client_id, "leasing capacity from Doorman servers");
    let tls = d.tls.as_ref().map(|files| {
        // Checked when the routes file was read; a file that went bad since is
        // reported on every call, in the log and on the status page.
        usher_core::tls::ClientTls::load(files).map_err(|e| format!("doorman.tls: {}: {}", e.path, e.reason))
    });
    if let Some(files) = &d.tls {
        tracing::info!(ca = %files.ca.display(), client_cert = files.cert.is_some(), "capacity servers over TLS");
    }
    let transport = GrpcTransport::new(DEFAULT_RPC_TIMEOUT, DEFAULT_CONNECT_TIMEOUT).with_tls(tls);
    (c, Arc::new(transport))
}

// === impl Embedded ===

/// A routes file without `doorman:` needs the embedded capacity server,
/// which this build leaves out: usher-enforce's `embedded-server` feature is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the routes file has no `doorman:` section, and usher-enforce was built without its `embedded-server` feature: \
     add `doorman:` to lease capacity from usher or Doorman servers, or enable the `embedded-server` feature"
)]
pub struct EmbeddedServerOff;

/// Bad configuration: exit code 64 (`EX_USAGE`).
impl From<EmbeddedServerOff> for usher_core::error::RunError {
    fn from(e: EmbeddedServerOff) -> Self {
        usher_core::error::RunError::Usage(e.to_string())
    }
}

/// The embedded capacity server, for a routes file without `doorman:`.
#[cfg(feature = "embedded-server")]
struct Embedded {
    node: Arc<Node>,
    /// The routes file last loaded into it.
    seen: Mutex<Option<Arc<RoutesConfig>>>,
}

/// Without the `embedded-server` feature there is none.
#[cfg(not(feature = "embedded-server"))]
enum Embedded {}

#[cfg(feature = "embedded-server")]
impl Embedded {
    /// Starts the embedded capacity server for `cfg`'s resources; returns
    /// the lease client's settings and the in-process transport to it.
    fn start(
        cfg: &RoutesConfig,
        clock: &usher_core::clock::Clock,
    ) -> Result<(CoreConfig, Arc<dyn Transport>, Embedded), EmbeddedServerOff> {
        let mut node = Node::new(
            EMBEDDED.into(),
            "<embedded: the routes file's capacities>".into(),
            embedded_resources(cfg),
            clock.clone(),
            Duration::ZERO,
            prometheus::Registry::new(),
        );
        // The routes file's max_keys already bound the keys; the embedded server
        // takes every one of them (a standalone server's --max-resources does not
        // apply), from its one client, this sidecar.
        node.store.set_limits(usher_server::store::Limits { max_resources: usize::MAX, max_clients_per_resource: 1 });
        let node = Arc::new(node);
        let local = LocalTransport::new();
        local.add(EMBEDDED, node.clone());
        let mut c = CoreConfig::new(usher_core::config::doorman::default_client_id(), vec![EMBEDDED.into()]);
        c.min_interval = min_interval(cfg);
        tracing::info!("no `doorman:` section: leasing from an embedded capacity server");
        Ok((c, Arc::new(local), Embedded { node, seen: Mutex::new(None) }))
    }

    /// Loads `cfg` into the server unless it already holds it; true when
    /// that replaced an earlier routes file (a reload).
    fn reload(&self, cfg: &Arc<RoutesConfig>) -> bool {
        let mut seen = self.seen.lock().expect("enforcer config");
        if seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, cfg)) {
            return false;
        }
        self.node.store.reload(embedded_resources(cfg));
        let reloaded = seen.is_some();
        *seen = Some(cfg.clone());
        reloaded
    }
}

#[cfg(not(feature = "embedded-server"))]
impl Embedded {
    /// Fails: this build has no embedded server.
    fn start(
        _cfg: &RoutesConfig,
        _clock: &usher_core::clock::Clock,
    ) -> Result<(CoreConfig, Arc<dyn Transport>, Embedded), EmbeddedServerOff> {
        Err(EmbeddedServerOff)
    }

    /// Never called: there is no `Embedded` to call it on.
    fn reload(&self, _cfg: &Arc<RoutesConfig>) -> bool {
        match *self {}
    }
}

// === impl Transitions ===

/// `usher_lease_transitions_total{resource_id, from, to}`: how often each
/// key's lease changed mode. Counted here, a few dozen bytes per key, and
/// rendered at each scrape: a counter vector's series (each with its own
/// descriptor and label strings) cost some 570 bytes per templated key, a
/// fifth of a sidecar's memory per key (tests/key_memory.rs). A key's
/// counts go when it is forgotten ([`TableEnforcer::forget_transitions`]):
/// tenants that come and go leave no series behind.
#[derive(Clone)]
struct Transitions {
    desc: prometheus::core::Desc,
    counts: Arc<Mutex<HashMap<Box<str>, Changes>>>,
}

/// One key's mode changes so far: (from, to, how many times).
type Changes = Vec<(Mode, Mode, u64)>;

impl Default for Transitions {
    fn default() -> Self {
        let desc = prometheus::core::Desc::new(
            "usher_lease_transitions_total".into(),
            "Lease mode changes of a resource key (leased, pending, expired).".into(),
            vec!["resource_id".into(), "from".into(), "to".into()],
            HashMap::new(),
        )
        .expect("valid metric");
        Transitions { desc, counts: Arc::default() }
    }
}

impl TableEnforcer {
    /// Drops the transition counts of the keys `update` says are gone (README:
    /// per-key series carry at most `max_keys` ids per resource): of those it
    /// removed, or, when it holds every key, of every key not in the table
    /// (a reload dropped it). A key made again counts from zero.
    fn forget_transitions(&self, update: DemandUpdate) -> DemandUpdate {
        if update.complete {
            self.transitions.retain(|id| self.table.contains(id));
        } else if !update.removed.is_empty() {
            self.transitions.forget(&update.removed);
        }
        update
    }
}

impl Transitions {
    fn forget(&self, ids: &[String]) {
        let mut counts = self.counts.lock().expect("transition counts");
        for id in ids {
            counts.remove(id.as_str());
        }
    }

    fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.counts.lock().expect("transition counts").retain(|id, _| keep(id));
    }

    fn count(&self, id: &str, from: Mode, to: Mode) {
        let mut counts = self.counts.lock().expect("transition counts");
        if !counts.contains_key(id) {
            counts.insert(id.into(), Vec::new());
        }
        let key = counts.get_mut(id).expect("inserted above");
        match key.iter_mut().find(|(f, t, _)| (*f, *t) == (from, to)) {
            Some((_, _, n)) => *n += 1,
            None => {
                // A key sees a few kinds of change at most: room for each as it comes.
                key.reserve_exact(1);
                key.push((from, to, 1));
            }
        }
    }
}

impl prometheus::core::Collector for Transitions {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::proto::{Counter, LabelPair, Metric, MetricFamily, MetricType};
        let label = |name: &str, value: &str| {
            let mut l = LabelPair::default();
            l.set_name(name.into());
            l.set_value(value.into());
            l
        };
        let counts = self.counts.lock().expect("transition counts");
        let mut metrics = Vec::new();
        for (id, changes) in counts.iter() {
            for (from, to, n) in changes {
                let mut counter = Counter::default();
                counter.set_value(*n as f64);
                let mut m = Metric::default();
                // In the order of their names, as a counter vector's.
                m.set_label(vec![label("from", from.name()), label("resource_id", id), label("to", to.name())]);
                m.set_counter(counter);
                metrics.push(m);
            }
        }
        let mut family = MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(MetricType::COUNTER);
        family.set_metric(metrics);
        vec![family]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use usher_core::clock::{Clock, Time};

    /// A sidecar's enforcer with no lease client: `tenant` is templated.
    fn enforcer() -> TableEnforcer {
        enforcer_and_time().0
    }

    /// [`enforcer`], and the hand on its clock.
    fn enforcer_and_time() -> (TableEnforcer, Arc<usher_core::clock::ManualClock>) {
        enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  fixed: { kind: rate, capacity: 1000/s, burst: 100 }\n  \
             tenant: { kind: rate, capacity: 10/s, id: \"t/{header.x-tenant}\" }\n\
             routes:\n  - { name: all, upstream: up, resources: [fixed, tenant] }\n",
        )
    }

    /// [`enforcer_and_time`] for the routes file `yaml`.
    /// What the enforcer asks for `name`'s key now (and whether it is short).
    fn wants_now(e: &TableEnforcer, name: &str) -> (f64, bool) {
        let l = e.table.resource(name).unwrap().try_limiter(name).unwrap();
        let cfg = e.config();
        let Settings { lease: settings, kind, capacity, .. } = e.settings(&cfg, name).unwrap();
        let mut memory = e.memory.lock().unwrap();
        let m = memory.entry(name.to_string()).or_default();
        e.wants(m, &l, kind, settings, capacity, e.table.clock().now())
    }

    fn enforcer_of(yaml: &str) -> (TableEnforcer, Arc<usher_core::clock::ManualClock>) {
        let cfg = Arc::new(RoutesConfig::parse("routes.yaml", yaml).unwrap());
        let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
        let table = Arc::new(LeaseTable::new(clock));
        table.configure(crate::resource::specs(&cfg));
        let registry = prometheus::Registry::new();
        let e = TableEnforcer {
            table,
            pushback: Arc::new(Pushback::new(&registry)),
            config: Arc::new(move || cfg.clone()),
            transitions: Transitions::default(),
            embedded: None,
            local_keys: false,
            memory: Mutex::new(HashMap::new()),
            read_config: Mutex::new(None),
            applied_config: Mutex::new(None),
            client: Mutex::new(None),
            last: Mutex::new(None),
            quiet: AtomicBool::new(false),
            next_idle: Mutex::new(None),
            fresh: Mutex::new(Vec::new()),
            keylog: Mutex::default(),
            credits: Mutex::new(Vec::new()),
        };
        (e, time)
    }

    /// Without the embedded server, a routes file without `doorman:` is an
    /// error that says what to do (exit code 64), and nothing starts.
    #[cfg(not(feature = "embedded-server"))]
    #[test]
    fn without_the_embedded_server_a_routes_file_needs_doorman() {
        let cfg =
            Arc::new(RoutesConfig::parse("routes.yaml", "resources:\n  api: { kind: rate, capacity: 1/s }\n").unwrap());
        let table = Arc::new(LeaseTable::new(Clock::system()));
        table.configure(crate::resource::specs(&cfg));
        let registry = prometheus::Registry::new();
        let pushback = Arc::new(Pushback::new(&registry));
        let started = start_with(Arc::new(move || cfg.clone()), table, pushback, &registry, CancellationToken::new());
        let err = started.err().expect("an error, not a lease client");
        let said = err.to_string();
        assert!(
            said.contains("no `doorman:` section") && said.contains("enable the `embedded-server` feature"),
            "{said}"
        );
        assert_eq!(usher_core::error::RunError::from(err).exit_code(), usher_core::error::EXIT_USAGE);
    }

    /// The ids an update reports as changed, sorted, and its wants by id.
    fn reported(u: &DemandUpdate) -> (Vec<&str>, HashMap<&str, f64>) {
        let mut ids: Vec<&str> = u.changed.iter().map(|d| d.resource_id.as_str()).collect();
        ids.sort();
        (ids, u.changed.iter().map(|d| (d.resource_id.as_str(), d.wants)).collect())
    }

    #[test]
    fn a_demand_read_reports_only_the_keys_whose_demand_moved() {
        let (e, time) = enforcer_and_time();
        let acme = e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        let u = e.demand_update();
        assert!(u.complete, "the first read has every key");
        assert_eq!(reported(&u).0, ["fixed", "t/acme"]);
        let u = e.demand_update();
        assert_eq!((u.changed.len(), u.removed.len(), u.complete), (0, 0, false), "nothing moved: {u:?}");

        // Traffic that grows: the tenant's measured wants move at every read,
        // and only its key is reported (once measured: half a second in).
        let mut last = 0.0;
        for i in 1..=20 {
            acme.demand().arrive(f64::from(i));
            time.advance(Duration::from_millis(100));
            let u = e.demand_update();
            let (ids, wants) = reported(&u);
            if i > 6 {
                assert_eq!(ids, ["t/acme"], "read {i}");
                assert_ne!(wants["t/acme"], last, "read {i}");
                last = wants["t/acme"];
            } else {
                assert!(!ids.contains(&"fixed"), "read {i}: {ids:?}");
            }
        }
        // No more requests: the rate is measured again as its window slides.
        time.advance(Duration::from_millis(100));
        let u = e.demand_update();
        assert_eq!(reported(&u).0, ["t/acme"], "no arrival, still re-measured");
        assert_ne!(reported(&u).1["t/acme"], last);

        // A reload reports every key again.
        let cfg = e.config();
        let reloaded = Arc::new(RoutesConfig::clone(&cfg));
        let e = TableEnforcer { config: Arc::new(move || reloaded.clone()), ..e };
        let u = e.demand_update();
        assert!(u.complete);
        assert_eq!(reported(&u).0, ["fixed", "t/acme"]);

        // An idle key is reported gone, once.
        time.advance(usher_core::config::doorman::DEFAULT_KEY_IDLE_TIMEOUT + Duration::from_secs(3));
        let u = e.demand_update();
        assert_eq!(u.removed, ["t/acme"]);
        assert!(e.table.resource("tenant").unwrap().get("t/acme").is_none());
        let u = e.demand_update();
        assert!(u.removed.is_empty() && u.changed.is_empty(), "{u:?}");
    }

    /// With an embedded server, a templated rate key is local: it enforces
    /// its configured capacity, is never reported to the lease client, and
    /// is still forgotten once idle. A resource the server must steer (here
    /// an upstream's quota headers) and a fixed id keep their leases; a new
    /// key of the same tenant after forgetting is local again.
    #[test]
    fn an_embedded_servers_templated_rate_keys_are_local() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  fixed: { kind: rate, capacity: 1000/s, burst: 100 }\n  \
             tenant: { kind: rate, capacity: 10/s, id: \"t/{header.x-tenant}\", key_idle_timeout: 60s, max_keys: 1 }\n  \
             quota: { kind: rate, capacity: 10/s, id: \"q/{header.x-tenant}\", upstream_quota: { headers: github } }\n\
             routes:\n  - { name: all, upstream: up, resources: [fixed, tenant, quota] }\n",
        );
        let e = TableEnforcer { local_keys: true, ..e };
        let acme = e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        e.table.resource("quota").unwrap().try_limiter("q/acme").unwrap();
        let u = e.demand_update();
        assert_eq!(reported(&u).0, ["fixed", "q/acme"], "the local key is not reported");
        assert_eq!(acme.capacity(), 10.0, "a local key holds its configured capacity");
        assert!(!e.memory.lock().unwrap().contains_key("t/acme"), "and nothing is remembered of it");
        // Used now and then, it stays; idle with a full bucket for
        // LOCAL_IDLE (under its 60 s timeout), it is forgotten: its resource
        // is crowded (one key of one allowed).
        time.advance(Duration::from_secs(8));
        acme.demand().arrive(1.0);
        e.demand_update();
        time.advance(LOCAL_IDLE - Duration::from_secs(1));
        e.demand_update();
        assert!(e.table.resource("tenant").unwrap().get("t/acme").is_some(), "used 9 s ago: kept");
        time.advance(Duration::from_secs(1));
        let u = e.demand_update();
        assert!(e.table.resource("tenant").unwrap().get("t/acme").is_none(), "idle 10 s, bucket full: forgotten");
        assert!(!u.removed.contains(&"t/acme".to_string()), "no lease to release: {u:?}");
        // The tenant comes back: a new local key, at its configured capacity.
        let again = e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        assert_eq!(again.capacity(), 10.0);
        assert!(!reported(&e.demand_update()).0.contains(&"t/acme"));
    }

    /// A local key idle for LOCAL_IDLE is forgotten only if a key made anew
    /// would be the same: one whose bucket is still filling stays until it
    /// is full (and the lease client is due then), or until its
    /// key_idle_timeout if that comes first; one backed off by its upstream
    /// stays while it is; a key of a resource that leases keeps its
    /// key_idle_timeout. (The tenant resource is crowded: more keys than
    /// half its max_keys.)
    #[test]
    fn a_local_key_is_forgotten_early_only_when_a_new_key_would_be_the_same() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  tenant: { kind: rate, capacity: 6/min, burst: 3, id: \"t/{header.x-tenant}\", max_keys: 3 }\n  \
             leased: { kind: rate, capacity: 6/min, burst: 3, id: \"l/{header.x-tenant}\", wants: auto }\n  \
             slow: { kind: rate, capacity: 1/h, burst: 2, id: \"s/{header.x-tenant}\", key_idle_timeout: 25s }\n\
             routes:\n  - { name: all, upstream: up, resources: [tenant, leased, slow] }\n",
        );
        let e = TableEnforcer { local_keys: true, ..e };
        let start = e.table.clock().now();
        let limits = e.table.resource("tenant").unwrap();
        let (idle, spent, pushed) = (
            limits.try_limiter("t/idle").unwrap(),
            limits.try_limiter("t/spent").unwrap(),
            limits.try_limiter("t/pushed").unwrap(),
        );
        let leased = e.table.resource("leased").unwrap().try_limiter("l/idle").unwrap();
        for _ in 0..3 {
            assert!(usher_limit::rate::try_admit(spent.rate().unwrap(), e.table.clock(), 1.0));
        }
        let slow = e.table.resource("slow").unwrap().try_limiter("s/spent").unwrap();
        for _ in 0..2 {
            assert!(usher_limit::rate::try_admit(slow.rate().unwrap(), e.table.clock(), 1.0));
        }
        let cfg = usher_core::config::doorman::PushbackConfig::default();
        e.pushback.on_response([&*pushed], http::StatusCode::TOO_MANY_REQUESTS, None, start, &cfg, |_, _| {});
        assert!(e.pushback.tracks("t/pushed"));
        e.demand_update();
        let present = |id: &str| e.table.contains(id);
        time.advance(LOCAL_IDLE);
        e.demand_update();
        assert!(!present("t/idle"), "a full bucket, idle 10 s: forgotten");
        assert!(present("t/spent"), "3 units spent at 6/min: full 30 s after");
        assert!(present("t/pushed"), "backed off: kept");
        assert!(present("l/idle"), "a leased key waits for its key_idle_timeout");
        assert!(present("s/spent"), "full in two hours");
        assert_eq!(*e.next_idle.lock().unwrap(), Some(start.saturating_add(Duration::from_secs(25))));
        time.advance(Duration::from_secs(15));
        e.demand_update();
        assert!(!present("s/spent"), "still filling, but idle for its 25 s key_idle_timeout: forgotten");
        assert_eq!(*e.next_idle.lock().unwrap(), Some(start.saturating_add(Duration::from_secs(30))));
        time.advance(Duration::from_secs(5) - Duration::from_millis(1));
        e.demand_update();
        assert!(present("t/spent"), "not full yet");
        time.advance(Duration::from_millis(1));
        e.demand_update();
        assert!(!present("t/spent"), "full: forgotten");
        time.advance(Duration::from_secs(60));
        e.demand_update();
        assert!(present("l/idle"), "70 s idle, under its 5 min timeout");
        drop((idle, leased, slow));
    }

    /// Below [`crowded`], a local key idle with a full bucket stays to its
    /// key_idle_timeout: a tenant that comes back finds it, and no key is
    /// made again on the request path. Once the resource holds more than
    /// half its max_keys, the keys idle for LOCAL_IDLE go (the newer ones
    /// not yet), and those left keep theirs again.
    #[test]
    fn a_local_key_is_kept_to_its_timeout_while_its_resource_is_not_crowded() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  tenant: { kind: rate, capacity: 10/s, id: \"t/{header.x-tenant}\", max_keys: 10, key_idle_timeout: 60s }\n\
             routes:\n  - { name: all, upstream: up, resources: [tenant] }\n",
        );
        let e = TableEnforcer { local_keys: true, ..e };
        let limits = e.table.resource("tenant").unwrap();
        let make = |ids: std::ops::Range<usize>| ids.for_each(|i| drop(limits.try_limiter(&format!("t/{i}")).unwrap()));
        let present = |i: usize| e.table.contains(&format!("t/{i}"));
        make(0..5);
        e.demand_update();
        time.advance(LOCAL_IDLE * 3);
        e.demand_update();
        assert!((0..5).all(present), "5 keys of 10 allowed: not crowded, all kept past LOCAL_IDLE");
        make(5..6);
        e.demand_update();
        assert!(!(0..5).any(present), "6 of 10: crowded, the five idle 30 s go");
        assert!(present(5), "the new one is not idle");
        time.advance(LOCAL_IDLE * 3);
        e.demand_update();
        assert!(present(5), "alone again: kept");
        time.advance(Duration::from_secs(30));
        e.demand_update();
        assert!(!present(5), "idle for its 60 s key_idle_timeout: forgotten");
        assert!((0..4).all(|n| !crowded(n, 10)) && crowded(6, 10) && crowded(LOCAL_KEEP + 1, usize::MAX));
        assert!(!crowded(LOCAL_KEEP, usize::MAX));
    }

    /// A key used at under one request a second (0.5/s, as LLM calls are)
    /// asks for its rate at every read, though its 2 s window is often
    /// empty (over its first 30 s, for less: a few requests are no rate
    /// yet); reads spaced out by a slow control plane keep the estimate
    /// instead of going back to the routes file's capacity; a key that
    /// stops asks for nothing soon after.
    #[test]
    fn a_slow_keys_demand_is_measured_over_a_longer_window() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  llm: { kind: rate, capacity: 50/s, wants: auto }\n\
             routes:\n  - { name: all, upstream: up, resources: [llm] }\n",
        );
        let llm = e.table.resource("llm").unwrap().try_limiter("llm").unwrap();
        let wants = |e: &TableEnforcer| wants_now(e, "llm").0;
        // One request every 2 s, reads every 100 ms, for a minute.
        let mut seen = Vec::new();
        for tick in 0..600 {
            if tick % 20 == 0 {
                llm.demand().arrive(1.0);
            }
            time.advance(Duration::from_millis(100));
            let w = wants(&e);
            if tick >= 100 {
                seen.push(w);
            }
        }
        let (lo, hi) = seen.iter().fold((f64::MAX, 0.0f64), |(lo, hi), w| (lo.min(*w), hi.max(*w)));
        assert!(lo > 0.1 && hi <= 1.0, "wants between {lo} and {hi} at 0.5 requests/s");
        let (lo, hi) = seen[200..].iter().fold((f64::MAX, 0.0f64), |(lo, hi), w| (lo.min(*w), hi.max(*w)));
        assert!(lo >= 0.4 && hi <= 1.0, "from 30 s on, wants between {lo} and {hi} at 0.5 requests/s");
        // A slow control plane: reads 3 s apart, traffic at 20/s.
        for _ in 0..5 {
            for _ in 0..60 {
                llm.demand().arrive(1.0);
            }
            time.advance(Duration::from_secs(3));
            let w = wants(&e);
            assert!(w > 5.0 && w < 50.0, "reads 3 s apart measure the demand, not the first guess: {w}");
        }
        // Stopped: nothing is wanted within a few seconds.
        for _ in 0..50 {
            time.advance(Duration::from_millis(100));
            wants(&e);
        }
        assert_eq!(wants(&e), 0.0);
    }

    /// A key asked once keeps asking for that request over thirty seconds,
    /// for ten, so that a second request a few seconds later finds a lease;
    /// one that sent a burst and stopped asks for nothing soon.
    #[test]
    fn a_key_asked_once_keeps_a_fading_lease() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  llm: { kind: rate, capacity: 50/s, wants: auto }\n  \
             burst: { kind: rate, capacity: 50/s, wants: auto }\n\
             routes:\n  - { name: all, upstream: up, resources: [llm, burst] }\n",
        );
        let wants = |e: &TableEnforcer, name: &str| wants_now(e, name).0;
        e.table.resource("llm").unwrap().try_limiter("llm").unwrap().demand().arrive(1.0);
        let burst = e.table.resource("burst").unwrap().try_limiter("burst").unwrap();
        for _ in 0..10 {
            burst.demand().arrive(1.0);
        }
        let mut seen = Vec::new();
        for _ in 0..100 {
            wants(&e, "llm");
            wants(&e, "burst");
            time.advance(Duration::from_millis(100));
            seen.push((wants(&e, "llm"), wants(&e, "burst")));
        }
        // From half a second on: about one request over thirty seconds, never 0
        // in between; then it stopped.
        for (i, (w, _)) in seen.iter().enumerate().skip(5).take(90) {
            let t = (i + 1) as f64 / 10.0;
            assert!(*w >= 0.5 / 30.0 && *w <= 2.0 / 30.0, "at {t} s one request asks for {w}");
        }
        for _ in 0..10 {
            time.advance(Duration::from_millis(100));
            wants(&e, "llm");
        }
        assert_eq!(wants(&e, "llm"), 0.0, "ten seconds on, one request is over");
        assert_eq!(seen.last().unwrap().1, 0.0, "a burst of 10 that stopped asks for nothing");
    }

    /// An LLM call every 2 s, charged 150 tokens and settled from its
    /// answer at 50 to 250: its 2 s window holds one call or none (and
    /// refunds), so measured there wants swung from 0 to 500 tokens/s; it
    /// is measured over the long window, as any slow key is (a short window
    /// that reads more still counts: one 250-token call in 2 s, 125/s).
    #[test]
    fn a_slow_key_of_costly_requests_asks_for_its_tokens_steadily() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  tokens: { kind: rate, capacity: 6000/min, burst: 250, wants: auto }\n\
             routes:\n  - { name: all, upstream: up, resources: [tokens] }\n",
        );
        let tokens = e.table.resource("tokens").unwrap().try_limiter("tokens").unwrap();
        let wants = |e: &TableEnforcer| wants_now(e, "tokens").0;
        // Reads every 100 ms for 90 s; real costs cycle through 50..=250 (150 on average).
        let mut seen = Vec::new();
        for tick in 0..900 {
            match tick % 20 {
                0 => tokens.demand().arrive(150.0),
                2 => tokens.demand().settle(f64::from((tick / 20 * 37) % 201 + 50) - 150.0),
                _ => {}
            }
            time.advance(Duration::from_millis(100));
            let w = wants(&e);
            if tick >= 400 {
                seen.push(w);
            }
        }
        let (lo, hi) = seen.iter().fold((f64::MAX, 0.0f64), |(lo, hi), w| (lo.min(*w), hi.max(*w)));
        assert!(lo >= 60.0 && hi <= 125.0 * 1.1, "wants between {lo} and {hi} at 75 tokens/s");
    }

    /// A gauge leased nothing (after an idle spell) whose requests are
    /// refused at once (`max_wait: 0`) asks for what the refusals show it
    /// wants, up to its configured capacity, and says it is short (an early
    /// refresh): counting only what was in flight, it asked for 0 for ever.
    #[test]
    fn refused_requests_are_a_gauge_s_demand() {
        let (e, time) = enforcer_of(
            "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
             resources:\n  slots: { kind: gauge, capacity: 5 }\n\
             routes:\n  - { name: all, upstream: up, resources: [slots] }\n",
        );
        let slots = e.table.resource("slots").unwrap().try_limiter("slots").unwrap();
        let wants = |e: &TableEnforcer| wants_now(e, "slots");
        // One request in flight, then none for longer than the peak window: wants 0.
        slots.demand().record(usher_limit::demand::Outcome::Admitted);
        slots.demand().enter();
        assert_eq!(wants(&e), (1.0, false));
        slots.demand().leave();
        for _ in 0..12 {
            time.advance(Duration::from_secs(1));
            wants(&e);
        }
        assert_eq!(wants(&e), (0.0, false), "idle: nothing wanted");
        slots.set_capacity(0.0);
        // Requests come and are refused at once: each is a slot wanted.
        for _ in 0..2 {
            slots.demand().record(usher_limit::demand::Outcome::Refused);
        }
        time.advance(Duration::from_millis(100));
        assert_eq!(wants(&e), (2.0, true), "two refused: two slots wanted, and short of them");
        for _ in 0..20 {
            slots.demand().record(usher_limit::demand::Outcome::Refused);
        }
        time.advance(Duration::from_millis(100));
        assert_eq!(wants(&e), (5.0, true), "never more than the configured capacity for refusals");
        // The peak stays for the window, then goes.
        time.advance(Duration::from_secs(11));
        assert_eq!(wants(&e), (0.0, false));
    }

    /// A reload that rebuilds a resource (its kind changed) drops its keys
    /// from the lease client; a key a request then makes anew is reported
    /// again, though its demand is what it was before the reload.
    #[test]
    fn a_key_made_anew_after_a_reload_rebuilt_its_resource_is_reported_again() {
        let e = enforcer();
        e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        assert_eq!(reported(&e.demand_update()).0, ["fixed", "t/acme"]);
        let yaml = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                    resources:\n  fixed: { kind: rate, capacity: 1000/s, burst: 100 }\n  \
                    tenant: { kind: gauge, capacity: 10, id: \"t/{header.x-tenant}\" }\n\
                    routes:\n  - { name: all, upstream: up, resources: [fixed, tenant] }\n";
        let gauge = Arc::new(RoutesConfig::parse("routes.yaml", yaml).unwrap());
        e.table.configure(crate::resource::specs(&gauge));
        let e = TableEnforcer { config: Arc::new(move || gauge.clone()), ..e };
        let u = e.demand_update();
        assert!(u.complete && u.rebuilt, "{u:?}");
        assert_eq!(reported(&u).0, ["fixed"], "the rebuilt resource has no key yet");
        e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        let u = e.demand_update();
        assert!(!u.complete && !u.rebuilt, "{u:?}");
        // (Nothing measured yet: it asks for nothing.)
        assert_eq!(reported(&u), (vec!["t/acme"], HashMap::from([("t/acme", 0.0)])));
    }

    #[test]
    fn transitions_are_rendered_as_a_counter_vector_renders_them() {
        use prometheus::core::Collector;
        let (ours, vector) = (
            Transitions::default(),
            prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "usher_lease_transitions_total",
                    "Lease mode changes of a resource key (leased, pending, expired).",
                ),
                &["resource_id", "from", "to"],
            )
            .unwrap(),
        );
        // Each registered afresh (a clone shares the counts).
        fn text(c: &(impl Collector + Clone + 'static)) -> String {
            let r = prometheus::Registry::new();
            r.register(Box::new(c.clone())).unwrap();
            prometheus::TextEncoder::new().encode_to_string(&r.gather()).unwrap()
        }
        assert_eq!(text(&ours), "", "nothing counted, nothing rendered");
        assert_eq!(text(&ours), text(&vector));
        for (id, from, to) in [
            ("t/b", Mode::Pending, Mode::Leased),
            ("t/a", Mode::Pending, Mode::Leased),
            ("t/a", Mode::Leased, Mode::Held),
            ("t/a", Mode::Held, Mode::Leased),
            ("t/a", Mode::Leased, Mode::Held),
        ] {
            ours.count(id, from, to);
            vector.with_label_values(&[id, from.name(), to.name()]).inc();
        }
        assert_eq!(text(&ours), text(&vector));
        assert!(
            text(&ours).contains("usher_lease_transitions_total{from=\"leased\",resource_id=\"t/a\",to=\"held\"} 2\n"),
            "{}",
            text(&ours)
        );
    }

    /// A forgotten key's transition counts go with it (README: per-key
    /// series carry at most `max_keys` ids per resource), and a change the
    /// core noted for it before it was forgotten does not bring them back.
    #[test]
    fn a_forgotten_keys_transitions_are_dropped() {
        use usher_lease::core::{Capacity, Transition};
        let (e, time) = enforcer_and_time();
        e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        e.demand_update();
        let change = |id: &str| Transition {
            resource_id: id.into(),
            from: Mode::Pending,
            to: Mode::Leased,
            capacity: Capacity::Limited(1.0),
        };
        e.on_transition(&change("t/acme"));
        e.on_transition(&change("fixed"));
        let ids = || {
            let mut ids: Vec<String> = e.transitions.counts.lock().unwrap().keys().map(|k| k.to_string()).collect();
            ids.sort();
            ids
        };
        assert_eq!(ids(), ["fixed", "t/acme"]);
        time.advance(usher_core::config::doorman::DEFAULT_KEY_IDLE_TIMEOUT + Duration::from_secs(3));
        assert_eq!(e.demand_update().removed, ["t/acme"]);
        assert_eq!(ids(), ["fixed"], "the forgotten key's counts are dropped");
        e.on_transition(&change("t/acme"));
        assert_eq!(ids(), ["fixed"], "a late change of a forgotten key is not counted");
    }

    /// Whether `activity` was notified since it was last taken.
    fn notified(activity: &tokio::sync::Notify) -> bool {
        use std::future::Future;
        let mut n = std::pin::pin!(activity.notified());
        n.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())).is_ready()
    }

    #[test]
    fn the_enforcer_is_quiet_only_when_nothing_happened_between_two_polls() {
        let e = enforcer();
        let activity = e.table.activity().notify();
        e.demand();
        assert!(!e.quiet(), "the first poll has nothing to compare with");
        e.demand();
        assert!(e.quiet(), "no request, no key made");
        while notified(&activity) {}

        // Asleep, the first request through admission wakes the lease client, once.
        let fixed = e.table.resource("fixed").unwrap().limiter("fixed");
        let plan = usher_limit::admit::Plan::new(vec![(fixed.clone(), 1.0)]);
        let clock = e.table.clock().clone();
        drop(usher_limit::admit::start(&plan, &clock));
        assert!(notified(&activity), "the first arrival wakes a sleeping lease client");
        drop(usher_limit::admit::start(&plan, &clock));
        assert!(!notified(&activity), "the next ones do not");
        e.demand();
        e.demand();
        assert!(e.quiet());
        while notified(&activity) {}

        // A request (an arrival) makes the next poll busy, the one after quiet again.
        fixed.demand().arrive(1.0);
        e.demand();
        assert!(!e.quiet(), "a request arrived");
        e.demand();
        assert!(e.quiet());

        // A request in flight keeps it busy.
        fixed.demand().enter();
        e.demand();
        e.demand();
        assert!(!e.quiet(), "a request is in flight");
        fixed.demand().leave();
        e.demand();
        assert!(e.quiet());
        assert!(!notified(&activity), "nothing asked for the lease client");

        // A new tenant key wakes the lease client at once, and is not quiet.
        e.table.resource("tenant").unwrap().try_limiter("t/acme").unwrap();
        assert!(notified(&activity), "a new key is activity");
        e.demand();
        assert!(!e.quiet(), "a key was made");
        e.demand();
        assert!(e.quiet());
    }
}
