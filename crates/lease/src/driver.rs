//! Runs the lease [`Core`] in real time: performs its calls over a
//! [`Transport`], applies the resulting capacities to the enforcement side,
//! logs every mode change, keeps the lease cache, and releases every lease
//! on shutdown.
//!
//! Start-up: unexpired cached leases are enforced before the first request;
//! a key with no lease keeps its configured capacity until the first call to
//! the servers has been answered or has failed, or [`LeaseClient::ready`]
//! stops waiting for it, and then follows its `on_expiry`.
//!
//! The sidecar runs this loop on a thread of its own ([`Runs::OwnThread`]),
//! so that reading thousands of keys' demand never holds up the request
//! workers. A refresh goes out in GetCapacity calls of at most
//! [`MAX_RESOURCES_PER_CALL`] keys ([`crate::batch`], which an
//! intermediate's GetServerCapacity and every release go through too), and
//! their answers are merged.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::core::{Action, Capacity, Core, CoreConfig, DemandUpdate, KeyDemand, KeyStatus, Lease, Mode, Source};
use super::failing::Failing;
use super::transport::Transport;
use super::{batch, cache};
use usher_core::clock::{Clock, Time};
use usher_proto as proto;

/// What the servers said of a key's resource beside its lease (usher's
/// extensions; a Doorman server says neither).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerSaid {
    /// The capacity they share for the resource.
    pub fleet: Option<f64>,
    /// When the quota they follow renews, while they say it is spent.
    pub renews: Option<Time>,
    /// The lease is their first above 0 for the key: nobody's bucket holds
    /// its share of the fleet's burst, so the key's may start full.
    pub fresh: bool,
    /// Units of their pooled burst credited to the key: they go into its
    /// bucket at once, up to its size.
    pub credit: f64,
    /// The most the key's bucket may hold until its next request, below its
    /// lease's share of the fleet's burst: the rest is pooled at the server,
    /// and the key gives back what it holds above its reserve when it asks.
    /// With it, the units their pool held after the answer.
    pub bucket: Option<(f64, f64)>,
}

/// The enforcement side, as the lease client sees it.
pub trait Enforcer: Send + Sync + 'static {
    /// Every key that needs a lease now, with what it wants.
    fn demand(&self) -> Vec<KeyDemand>;
    /// What changed since the last read of the demand (this or
    /// [`Enforcer::demand`]): by default every key's. An enforcer with many
    /// keys reports only those whose demand changed and those it forgot;
    /// the others keep what they reported last.
    fn demand_update(&self) -> DemandUpdate {
        DemandUpdate { changed: self.demand(), removed: Vec::new(), complete: true, rebuilt: false }
    }
    /// The capacity each of these keys may use now: those whose capacity
    /// changed since the last call, those of [`Enforcer::reapply`], and
    /// every key after [`Enforcer::rebuilt`] said so. The others keep what
    /// was applied last.
    fn apply(&self, capacities: &[(String, Capacity)]);
    /// Whether the enforcement side was rebuilt since the last call (a reload
    /// made keys anew at their configured capacity): every key's capacity is
    /// then applied again. Asked before each apply; true the first time.
    fn rebuilt(&self) -> bool {
        false
    }
    /// Keys whose capacity, once applied, the enforcer adjusts by itself
    /// over time (upstream pushback): applied at every turn, changed or not.
    fn reapply(&self) -> Vec<String> {
        Vec::new()
    }
    /// A key changed mode (leased, held, pending, expired); already logged
    /// (at debug for a key of [`Enforcer::per_key`]).
    fn on_transition(&self, _t: &super::core::Transition) {}
    /// Whether `id` is one of many keys of one resource (a templated id
    /// makes one per tenant, up to a million): its events are logged at
    /// debug, and the enforcer summarises them at info, so the log does
    /// not grow by a line per key.
    fn per_key(&self, _id: &str) -> bool {
        false
    }

    /// What the servers said of the resources of keys about to be applied
    /// (`apply`), beside their leases: the capacity they share (each key's
    /// share of its resource's burst is reckoned against it), and when a
    /// spent quota renews (refusals meanwhile say how long to wait).
    fn server_said(&self, _said: &[(String, ServerSaid)]) {}
    /// Calendar quotas' allotments that came with leases since the last
    /// call (see [`Core::take_allotments`]), applied after the capacities;
    /// `None`: the key's allotment ended.
    ///
    /// [`Core::take_allotments`]: super::core::Core::take_allotments
    fn allot(&self, _allotments: &[(String, Option<usher_limit::allot::Allotment>)]) {}
    /// The next moment a key's capacity can change that the lease client
    /// knows of (see [`Core::next_renewal`]), told at every turn.
    ///
    /// [`Core::next_renewal`]: super::core::Core::next_renewal
    fn next_renewal(&self, _at: Time) {}
    /// A request for the lease of `id`, a shared rate key (it reports a
    /// window), is about to go to the servers: what the key says of its
    /// bucket (its reserve, what it gives back, its backlog; usher's
    /// extensions). Out of a bucket the servers limited
    /// ([`ServerSaid::bucket`]), what it holds above the reserve is taken
    /// now, to be given back.
    fn give_back(&self, _id: &str) -> Option<usher_limit::table::BucketSaid> {
        None
    }
    /// Whether the last [`Enforcer::demand`] found nothing going on (no
    /// request since the one before, none in flight or waiting, no key
    /// made or forgotten): demand is then re-read when an action is due (at
    /// most [`QUIET_POLL`] apart) instead of every [`DEMAND_POLL`], and at
    /// once on [`Enforcer::activity`].
    fn quiet(&self) -> bool {
        false
    }
    /// Notified when a quiet enforcer needs its demand read now.
    fn activity(&self) -> Option<Arc<Notify>> {
        None
    }
    /// When a quiet enforcer's demand must be read again even if nothing
    /// happens (a templated key's idle timeout ends then), as of the last
    /// [`Enforcer::demand`]; `None`: only when an action is due.
    fn due(&self) -> Option<Time> {
        None
    }
}

/// How often demand is re-read while nothing else is due.
pub const DEMAND_POLL: Duration = Duration::from_millis(100);
/// The lease client's bookkeeping (reading demand, applying capacities: work
/// that grows with the number of keys) takes at most one part in this many
/// of a core: with many keys, demand is read less often than every
/// [`DEMAND_POLL`] (with 100,000 keys, every 10 ms of bookkeeping stretches
/// the poll to 200 ms), rather than the poll starving the requests it serves.
const BOOKKEEPING_SHARE: u32 = 20;

/// The longest a quiet enforcer's demand goes unread (a safety net). Otherwise
/// it is read only when something is due (a refresh, a lease's expiry or the
/// end of its hold: each one re-reads demand first; the enforcer's own
/// [`Enforcer::due`], when an idle key is to be forgotten) and when the
/// enforcer signals activity (a new key, a request that waits or is refused,
/// the first request after a quiet spell): an idle sidecar wakes for its
/// refreshes only.
pub const QUIET_POLL: Duration = Duration::from_secs(3600);
/// How long shutdown waits for ReleaseCapacity.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// A running lease client.
#[derive(Clone)]
pub struct LeaseClient {
    core: Arc<Mutex<Core>>,
    wake: Arc<Notify>,
    /// Start-up stopped waiting for the first call ([`LeaseClient::ready`]
    /// returned [`Start::Waited`]): a key with no lease follows its
    /// `on_expiry` even while that call still hangs. A start-up that had
    /// nothing to wait for (no key yet, or only cached leases) leaves it
    /// unset: a key made later keeps its configured capacity until its own
    /// call is answered or fails.
    waited_out: Arc<AtomicBool>,
    /// Held while capacities are taken from the core and applied: each
    /// change is applied once, so two applications (the loop's and
    /// [`LeaseClient::ready`]'s) must not cross, an older value last.
    applying: Arc<Mutex<()>>,
    clock: Clock,
    enforcer: Arc<dyn Enforcer>,
    /// The keys that enforce 0, and why: logged once per key and cause,
    /// read by the 429 of a request such a key refuses.
    zeros: ZeroReasons,
}

/// The keys that enforce a capacity of 0, and why (a [`super::core::ZeroReason`]).
pub type ZeroReasons = Arc<std::sync::RwLock<std::collections::HashMap<String, ZeroNote>>>;

/// Why a key enforces 0, and whether a refusal for it was logged.
#[derive(Debug)]
pub struct ZeroNote {
    /// Why (a [`super::core::ZeroReason`]).
    pub why: &'static str,
    /// A request was refused for it and logged as a warning: once per key
    /// and cause (a key that idles down to 0 refuses nobody and is not worth one).
    pub warned: AtomicBool,
}

impl ZeroNote {
    /// Logs, once per key and cause, that `id` refuses requests that have
    /// demand because it enforces 0: the first such refusal is worth a
    /// warning, the rest are counted in metrics and the access log.
    pub fn refused(&self, id: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                resource_id = %id,
                reason = self.why,
                "refusing requests: this key enforces a capacity of 0 (said once per key and cause)"
            );
        }
    }
}

/// How start-up ended, as [`LeaseClient::ready`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Every key already held an unexpired lease (from the cache): no wait.
    Leased,
    /// The first call to the servers was answered.
    Answered,
    /// The first call to the servers failed.
    Failed,
    /// Nothing came back within the wait.
    Waited,
}

/// What status pages show of the lease client.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClientStatus {
    /// The id the client sends with every request.
    pub client_id: String,
    /// The server its calls go to, once known.
    pub master: Option<String>,
    /// What went wrong last: a failed call, or a lease the last answer refused.
    pub last_error: Option<String>,
    /// When every key's refresh is due (unix seconds).
    pub next_refresh: i64,
    /// Successful refreshes so far.
    pub refreshes: u64,
    /// Every key, by id.
    pub keys: Vec<KeyStatus>,
}

/// Where the client's loop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// A task on the caller's runtime.
    Here,
    /// A thread of its own (a current-thread runtime on tokio's blocking
    /// pool): its work on many keys (reading demand, deciding leases in an
    /// embedded server) never holds up the request workers, which only share
    /// the CPU with it, a scheduler's time slice at a time.
    OwnThread,
}

impl LeaseClient {
    /// Starts the client as a task on the caller's runtime; it runs until
    /// `shutdown` is cancelled, then releases its leases. The returned handle
    /// reports status and takes wake-ups.
    pub fn start(
        cfg: CoreConfig,
        clock: Clock,
        transport: Arc<dyn Transport>,
        enforcer: Arc<dyn Enforcer>,
        cache_file: Option<PathBuf>,
        shutdown: CancellationToken,
    ) -> (LeaseClient, tokio::task::JoinHandle<()>) {
        Self::start_on(Runs::Here, cfg, clock, transport, enforcer, cache_file, shutdown)
    }

    /// [`LeaseClient::start`], with its loop where `runs` says.
    pub fn start_on(
        runs: Runs,
        cfg: CoreConfig,
        clock: Clock,
        transport: Arc<dyn Transport>,
        enforcer: Arc<dyn Enforcer>,
        cache_file: Option<PathBuf>,
        shutdown: CancellationToken,
    ) -> (LeaseClient, tokio::task::JoinHandle<()>) {
        let now = clock.now();
        let mut core = Core::new(cfg, now);
        // The keys known before the first request (fixed ids), so start-up
        // can tell whether every one of them already holds a lease.
        let demand = enforcer.demand();
        core.set_demand(demand.clone());
        if let Some(path) = &cache_file {
            preload(&mut core, path, &demand, now);
        }
        let client = LeaseClient {
            core: Arc::new(Mutex::new(core)),
            wake: Arc::new(Notify::new()),
            waited_out: Arc::new(AtomicBool::new(false)),
            applying: Arc::new(Mutex::new(())),
            clock: clock.clone(),
            enforcer: enforcer.clone(),
            zeros: ZeroReasons::default(),
        };
        // Cached leases hold from the first request on.
        enforce(&client);
        let work = run(client.clone(), transport, cache_file, shutdown);
        let task = match runs {
            Runs::Here => tokio::spawn(work),
            Runs::OwnThread => {
                let caller = tokio::runtime::Handle::current();
                tokio::task::spawn_blocking(move || {
                    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(rt) => rt.block_on(work),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot start the lease client's runtime; it runs on the proxy's");
                            caller.block_on(work)
                        }
                    }
                })
            }
        };
        (client, task)
    }

    /// Waits, at most `limit`, until every key holds an unexpired lease (a
    /// cached one counts: then there is no wait at all) or the first call to
    /// the servers has been answered or has failed. From then on a key with
    /// no lease follows its `on_expiry`. Logs what each key enforces.
    pub async fn ready(&self, limit: Duration) -> Start {
        let deadline = runtime_now() + limit;
        let start = loop {
            let found = {
                let c = self.core.lock().expect("lease core poisoned");
                if c.refreshes() > 0 {
                    Some(Start::Answered)
                } else if c.failing() {
                    Some(Start::Failed)
                } else if c.status().iter().all(|k| k.mode == Mode::Leased) {
                    Some(Start::Leased)
                } else {
                    None
                }
            };
            if let Some(s) = found {
                break s;
            }
            if runtime_now() >= deadline {
                break Start::Waited;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        self.waited_out.store(start == Start::Waited, Ordering::SeqCst);
        enforce(self);
        let status = self.status();
        let now = self.clock.now().as_secs();
        let why = match self.core.lock().expect("lease core poisoned").failing() {
            true => status.last_error.clone().unwrap_or_default(),
            false => format!("no answer within {limit:?}"),
        };
        // A templated resource's keys (cached ones, at start) are counted in
        // the cache line, not one line each.
        for k in status.keys.iter().filter(|k| !self.enforcer.per_key(&k.resource_id)) {
            let capacity = show(k.capacity);
            match k.source {
                Source::Cache => tracing::info!(
                    resource_id = %k.resource_id,
                    capacity = %capacity,
                    expires_in_s = k.expiry.map_or(0, |e| e - now),
                    "enforcing a cached lease until the servers answer"
                ),
                Source::Lease => {
                    tracing::info!(resource_id = %k.resource_id, capacity = %capacity, "enforcing the lease")
                }
                Source::OnExpiry => tracing::warn!(
                    resource_id = %k.resource_id,
                    on_expiry = %k.on_expiry.name(),
                    capacity = %capacity,
                    reason = %why,
                    "no lease yet; enforcing on_expiry until one arrives"
                ),
            }
        }
        start
    }

    /// The last lease received for `resource_id`, expired or not.
    pub fn lease_of(&self, resource_id: &str) -> Option<Lease> {
        self.core.lock().expect("lease core poisoned").lease_of(resource_id)
    }

    /// The keys that enforce 0 now, and why; shared, kept up to date.
    pub fn zero_reasons(&self) -> ZeroReasons {
        self.zeros.clone()
    }

    /// Re-reads demand now instead of at the next poll (a new key appeared).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// What status pages show of the client now.
    pub fn status(&self) -> ClientStatus {
        let c = self.core.lock().expect("lease core poisoned");
        ClientStatus {
            client_id: c.client_id().to_string(),
            master: c.master().map(str::to_string),
            last_error: c.last_error().map(str::to_string),
            next_refresh: c.next_refresh().as_secs(),
            refreshes: c.refreshes(),
            keys: c.status(),
        }
    }
}

/// Installs the unexpired leases cached at `path` of the keys in `demand`,
/// and spreads the first refresh over the shortest of their intervals.
fn preload(core: &mut Core, path: &std::path::Path, demand: &[KeyDemand], now: Time) {
    let cached = cache::read(path, core.client_id(), now);
    if cached.is_empty() {
        return;
    }
    let mut first = Duration::from_secs(3600);
    let mut n = 0;
    for (id, lease) in cached {
        if let Some(d) = demand.iter().find(|d| d.resource_id == id) {
            first = first.min(lease.refresh_interval);
            core.preload(d.clone(), lease, now);
            n += 1;
        }
    }
    if n > 0 {
        tracing::info!(leases = n, path = %path.display(), "enforcing cached leases; first refresh spread over one refresh interval");
        core.delay_first_refresh(now, first);
    }
}

/// A capacity as logs show it.
fn show(c: Capacity) -> String {
    match c {
        Capacity::Limited(c) => format!("{c}"),
        Capacity::Unlimited => "unlimited".into(),
    }
}

/// Applies the capacities of now that changed since the last time (a lease
/// that has just expired falls to its `on_expiry` capacity) and logs the
/// mode changes. With many keys only the few that changed are visited.
fn enforce(client: &LeaseClient) {
    let (clock, enforcer) = (&client.clock, &*client.enforcer);
    let _applying = client.applying.lock().expect("lease apply poisoned");
    let rebuilt = enforcer.rebuilt();
    let also = enforcer.reapply();
    let (capacities, transitions, fleet, allotments) = {
        let mut core = client.core.lock().expect("lease core poisoned");
        if rebuilt {
            core.mark_all_changed();
        }
        // A key with no lease keeps its configured capacity until the first
        // answer to a request that carried it (or a failure), rather than
        // dropping to `on_expiry` for a round trip; cached leases apply at
        // once. Once the start-up wait is over while the first call still
        // hangs, `on_expiry` applies.
        let hanging = client.waited_out.load(Ordering::SeqCst) && core.refreshes() == 0 && !core.failing();
        let caps = core.take_changes(clock.now(), &also, hanging);
        enforcer.next_renewal(core.next_renewal());
        note_zeros(&client.zeros, &core, &caps);
        let said: Vec<(String, ServerSaid)> = caps
            .iter()
            .map(|(id, _)| {
                let (fresh, credit) = (core.take_fresh(id), core.take_credit(id));
                let (fleet, renews, bucket) = (core.fleet_capacity(id), core.renews(id), core.bucket(id));
                (id.clone(), ServerSaid { fleet, renews, fresh, credit, bucket })
            })
            .collect();
        (caps, core.take_transitions(), said, core.take_allotments())
    };
    if !fleet.is_empty() {
        enforcer.server_said(&fleet);
    }
    if !capacities.is_empty() {
        enforcer.apply(&capacities);
    }
    if !allotments.is_empty() {
        enforcer.allot(&allotments);
    }
    for t in transitions {
        let (id, from, to, capacity) = (&t.resource_id, t.from.name(), t.to.name(), show(t.capacity));
        if enforcer.per_key(id) {
            tracing::debug!(resource = %id, from, to, capacity = %capacity, "lease mode changed");
        } else {
            tracing::info!(resource = %id, from, to, capacity = %capacity, "lease mode changed");
        }
        enforcer.on_transition(&t);
    }
}

/// Most keys [`ZeroReasons`] remembers before it forgets those the core forgot.
const ZEROS_KEPT: usize = 4096;

/// Records why the keys whose capacity changed to 0 enforce 0 (and forgets
/// those that no longer do), logging a key at WARN once per cause.
fn note_zeros(zeros: &ZeroReasons, core: &Core, changed: &[(String, Capacity)]) {
    let mut z = zeros.write().expect("zero reasons poisoned");
    let mut grew = false;
    for (id, cap) in changed {
        let why = match cap {
            Capacity::Limited(c) if *c == 0.0 => core.zero_reason(id),
            _ => None,
        };
        match why {
            Some(why) if z.get(id).is_none_or(|n| n.why != why) => {
                // Idle keys give their leases back: a capacity of 0 is news only once it refuses someone.
                tracing::debug!(resource_id = %id, reason = why, "enforcing a capacity of 0");
                grew |= z.insert(id.clone(), ZeroNote { why, warned: AtomicBool::new(false) }).is_none();
            }
            Some(_) => {}
            None => match z.remove(id) {
                Some(n) if n.warned.load(Ordering::Relaxed) => {
                    tracing::info!(resource_id = %id, capacity = %show(*cap), "no longer enforcing 0")
                }
                Some(_) => tracing::debug!(resource_id = %id, capacity = %show(*cap), "no longer enforcing 0"),
                None => {}
            },
        }
    }
    if grew && z.len() > ZEROS_KEPT {
        z.retain(|id, _| core.has_key(id));
    }
}

/// Most refused leases logged one by one after an answer; the rest are counted.
const REFUSALS_LOGGED: usize = 10;

/// Logs the leases the core refused in `server`'s answer (see [`Core::on_refresh`]).
fn log_refused(server: &str, refused: &[super::core::Refused]) {
    for r in refused.iter().take(REFUSALS_LOGGED) {
        tracing::warn!(server = %server, resource = %r.resource_id, "{}", r.message);
    }
    if refused.len() > REFUSALS_LOGGED {
        tracing::warn!(server = %server, more = refused.len() - REFUSALS_LOGGED, "more leases refused in the same answer");
    }
}

/// Logs the master a call's answer named (`how`: a redirect, or Discovery),
/// if it is another than before: every later call goes there.
fn log_new_master(server: &str, before: Option<&str>, after: Option<&str>, how: &str) {
    if let Some(after) = after.filter(|a| Some(*a) != before) {
        tracing::info!(server = %server, previous = %before.unwrap_or("none"), master = %after, by = how, "new master: calls go there from now on");
    }
}

pub use super::batch::MAX_RESOURCES_PER_CALL;

/// Waits for one call to the server (None on shutdown). Leases keep expiring
/// on time meanwhile: a call can hang for the whole RPC timeout against a
/// blackholed server, longer than what is left of a lease.
async fn call<T>(
    fut: impl Future<Output = T>,
    client: &LeaseClient,
    shutdown: &CancellationToken,
    poll: Duration,
) -> Option<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = &mut fut => return Some(r),
            _ = tokio::time::sleep(poll) => enforce(client),
        }
    }
}

async fn nudged(activity: Option<&Notify>) {
    match activity {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// The runtime's time, for what is paced on tokio's timer as its sleeps are
/// (the start-up wait, the demand poll), not on the lease clock.
#[allow(clippy::disallowed_methods, reason = "start-up and the demand poll wait on tokio's timer, whose time this is")]
fn runtime_now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

/// Runs the client until `shutdown`, then releases every lease.
async fn run(
    client: LeaseClient,
    transport: Arc<dyn Transport>,
    cache_file: Option<PathBuf>,
    shutdown: CancellationToken,
) {
    let mut turns = Turns::new(client, transport, cache_file, shutdown);
    while turns.turn().await {}
    turns.release_all().await;
}

/// The client's loop: each turn reads demand if a poll is due, asks the
/// core what to do, and does it.
struct Turns {
    client: LeaseClient,
    transport: Arc<dyn Transport>,
    cache_file: Option<PathBuf>,
    shutdown: CancellationToken,
    /// Notified when a quiet enforcer needs its demand read now.
    activity: Option<Arc<Notify>>,
    /// When demand was last read (the runtime's time), and the poll that
    /// reading set (from what it cost in real time, not the lease clock's:
    /// what the work costs the process).
    last_read: Option<(tokio::time::Instant, Duration)>,
    /// Woken by activity or `LeaseClient::wake`: demand is read at once.
    woken: bool,
    /// While the servers are down, one line a minute for each kind of call.
    discovery: Failing,
    refreshing: Failing,
}

impl Turns {
    fn new(
        client: LeaseClient,
        transport: Arc<dyn Transport>,
        cache_file: Option<PathBuf>,
        shutdown: CancellationToken,
    ) -> Self {
        let activity = client.enforcer.activity();
        Turns {
            client,
            transport,
            cache_file,
            shutdown,
            activity,
            last_read: None,
            woken: true,
            discovery: Failing::new("discovery answers again"),
            refreshing: Failing::new("lease refreshes answer again"),
        }
    }

    /// One turn of the loop; false on shutdown.
    async fn turn(&mut self) -> bool {
        let action = self.next_action();
        self.woken = false;
        let (read_at, poll) = self.last_read.expect("demand is read at the first turn");
        // Until the next read is due.
        let poll_left = poll.saturating_sub(read_at.elapsed());
        match action {
            Action::Wait { until } => self.wait(until, poll_left).await,
            Action::Discover { target } => self.discover(target, poll).await,
            Action::Refresh { target, request } => self.refresh(target, request, poll).await,
            Action::Release { target, request } => {
                let r = batch::release_capacity(&*self.transport, &target, request).await;
                let now = self.client.clock.now();
                self.client.core.lock().expect("lease core poisoned").on_release(now, r);
                true
            }
        }
    }

    /// What the core says to do now, after reading demand if a poll is due,
    /// with the capacities of now applied.
    fn next_action(&mut self) -> Action {
        let client = &self.client;
        // Demand is read once a poll (and at once when woken), not after
        // every call: with many keys a read is the costly part, and new keys
        // with a short minimum interval (the embedded server's 100 ms) would
        // otherwise have it read after every early refresh.
        let read = self.woken || self.last_read.is_none_or(|(at, poll)| at.elapsed() >= poll);
        if !read {
            let action = client.core.lock().expect("lease core poisoned").next_action(client.clock.now());
            enforce(client);
            return action;
        }
        #[allow(
            clippy::disallowed_methods,
            reason = "the poll stretches with what a read costs the process in real time"
        )]
        let started = std::time::Instant::now();
        let update = client.enforcer.demand_update();
        let action = {
            let mut core = client.core.lock().expect("lease core poisoned");
            core.update_demand(update);
            core.next_action(client.clock.now())
        };
        enforce(client);
        let poll = DEMAND_POLL.max(started.elapsed() * BOOKKEEPING_SHARE);
        self.last_read = Some((runtime_now(), poll));
        action
    }

    /// Sleeps until `until` on the lease clock, or the next demand poll
    /// (`poll_left`; a quiet enforcer's is longer), or a wake-up; false on
    /// shutdown.
    async fn wait(&mut self, until: Time, poll_left: Duration) -> bool {
        let (clock, enforcer) = (&self.client.clock, &*self.client.enforcer);
        let quiet = enforcer.quiet();
        let now = clock.now();
        let d = until.since(now).min(match quiet {
            true => QUIET_POLL.min(enforcer.due().map_or(Duration::MAX, |t| t.since(now))).max(poll_left),
            false => poll_left,
        });

        tokio::select! {
            _ = self.shutdown.cancelled() => return false,
            _ = self.client.wake.notified() => self.woken = true,
            _ = tokio::time::sleep(d) => {}
            // A busy enforcer's nudges are not listened to: its demand is read every poll anyway.
            _ = nudged(self.activity.as_deref()), if quiet => self.woken = true,
        }
        true
    }

    /// Asks `target` who the master is; false on shutdown.
    async fn discover(&mut self, target: String, poll: Duration) -> bool {
        let client = &self.client;
        let Some(r) = call(self.transport.discovery(&target), client, &self.shutdown, poll).await else {
            return false;
        };
        self.discovery.saw(&target, "discovery failed; trying the next server", r.as_ref().err());
        let mut core = client.core.lock().expect("lease core poisoned");
        let before = core.master().map(str::to_string);
        core.on_discovery(client.clock.now(), &target, r);
        log_new_master(&target, before.as_deref(), core.master(), "Discovery");
        true
    }

    /// Refreshes leases at `target`, applies them at once and keeps them in
    /// the cache; false on shutdown.
    async fn refresh(&mut self, target: String, mut request: proto::GetCapacityRequest, poll: Duration) -> bool {
        let client = &self.client;
        for r in request.resource.iter_mut().filter(|r| r.window.is_some()) {
            if let Some(b) = client.enforcer.give_back(&r.resource_id) {
                r.reserve = Some(b.reserve);
                r.returned = (b.returned > 0.0).then_some(b.returned);
                r.backlog = (b.backlog > 0.0).then_some(b.backlog);
            }
        }
        let Some(r) = call(batch::get_capacity(&*self.transport, &target, request), client, &self.shutdown, poll).await
        else {
            return false;
        };
        self.refreshing.saw(&target, "lease refresh failed", r.as_ref().err());
        let ok = r.is_ok();
        let refused = {
            let mut core = client.core.lock().expect("lease core poisoned");
            let before = core.master().map(str::to_string);
            let refused = core.on_refresh(client.clock.now(), r);
            log_new_master(&target, before.as_deref(), core.master(), "a redirect");
            refused
        };
        log_refused(&target, &refused);
        // New leases apply at once, not at the next turn of the loop.
        enforce(client);
        if ok && let Some(path) = &self.cache_file {
            let core = client.core.lock().expect("lease core poisoned");
            let leases = core.leases(client.clock.now());
            let id = core.client_id().to_string();
            drop(core);
            if let Err(e) = cache::write(path, &id, &leases) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the lease cache");
            }
        }
        true
    }

    /// At shutdown: gives every lease back, within [`RELEASE_TIMEOUT`], and
    /// empties the cache once the servers have them.
    async fn release_all(&self) {
        let client = &self.client;
        let release = client.core.lock().expect("lease core poisoned").release_all();
        let Some((target, req)) = release else { return };
        let n = req.resource_id.len();
        match tokio::time::timeout(RELEASE_TIMEOUT, batch::release_capacity(&*self.transport, &target, req)).await {
            Ok(Ok(_)) => {
                tracing::info!(server = %target, resources = n, "released every lease");
                // The servers have them back: a restart must not enforce them
                // again from the cache (they may be someone else's by then).
                if let Some(path) = &self.cache_file {
                    let id = client.core.lock().expect("lease core poisoned").client_id().to_string();
                    if let Err(e) = cache::write(path, &id, &[]) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot empty the lease cache after the release");
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(server = %target, error = ?e, "releasing leases failed; they will expire on the server")
            }
            Err(_) => tracing::warn!(server = %target, "releasing leases timed out; they will expire on the server"),
        }
    }
}
