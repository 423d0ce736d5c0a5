//! Runs the lease [`Core`] in real time: performs its calls over a
//! [`Transport`], applies the resulting capacities to the enforcement side,
//! logs every mode change, keeps the lease cache, and releases every lease
//! on shutdown.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::cache;
use super::core::{Action, Capacity, Core, CoreConfig, KeyDemand, KeyStatus};
use super::transport::Transport;
use crate::clock::Clock;

/// The enforcement side, as the lease client sees it.
pub trait Enforcer: Send + Sync + 'static {
    /// Every key that needs a lease now, with what it wants.
    fn demand(&self) -> Vec<KeyDemand>;
    /// The capacity each key may use now.
    fn apply(&self, capacities: &[(String, Capacity)]);
    /// A key changed mode (leased, pending, expired); already logged.
    fn on_transition(&self, _t: &super::core::Transition) {}
}

/// How often demand is re-read while nothing else is due.
pub const DEMAND_POLL: Duration = Duration::from_millis(100);
/// How long shutdown waits for ReleaseCapacity.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// A running lease client.
#[derive(Clone)]
pub struct LeaseClient {
    core: Arc<Mutex<Core>>,
    wake: Arc<Notify>,
}

/// What status pages show of the lease client.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClientStatus {
    pub client_id: String,
    pub master: Option<String>,
    pub last_error: Option<String>,
    pub next_refresh: i64,
    pub refreshes: u64,
    pub keys: Vec<KeyStatus>,
}

impl LeaseClient {
    /// Starts the client; it runs until `shutdown` is cancelled, then releases
    /// its leases. The returned handle reports status and takes wake-ups.
    pub fn start(
        cfg: CoreConfig,
        clock: Clock,
        transport: Arc<dyn Transport>,
        enforcer: Arc<dyn Enforcer>,
        cache_file: Option<PathBuf>,
        shutdown: CancellationToken,
    ) -> (LeaseClient, tokio::task::JoinHandle<()>) {
        let now = clock.now();
        let mut core = Core::new(cfg, now);
        if let Some(path) = &cache_file {
            let cached = cache::read(path, core.client_id(), now);
            if !cached.is_empty() {
                let demand = enforcer.demand();
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
        }
        let client = LeaseClient { core: Arc::new(Mutex::new(core)), wake: Arc::new(Notify::new()) };
        let task = tokio::spawn(run(client.clone(), clock, transport, enforcer, cache_file, shutdown));
        (client, task)
    }

    /// Waits until the first refresh has been answered (or failed), at most `limit`.
    /// Returns whether leases arrived.
    pub async fn first_refresh(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let (done, failed) = {
                let c = self.core.lock().expect("lease core poisoned");
                (c.refreshes() > 0, c.last_error().is_some())
            };
            if done || failed || tokio::time::Instant::now() >= deadline {
                return done;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Re-reads demand now instead of at the next poll (a new key appeared).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

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

/// Applies the capacities of now (a lease that has just expired falls to its
/// `on_expiry` capacity) and logs the mode changes.
fn enforce(client: &LeaseClient, clock: &Clock, enforcer: &dyn Enforcer) {
    let (capacities, transitions) = {
        let mut core = client.core.lock().expect("lease core poisoned");
        // Until the first answer (or failure), keys keep their configured
        // capacity rather than dropping to `on_expiry` for a few milliseconds.
        let known = core.refreshes() > 0 || core.last_error().is_some();
        let caps = if known { core.capacities(clock.now()) } else { Vec::new() };
        (caps, core.take_transitions())
    };
    if !capacities.is_empty() {
        enforcer.apply(&capacities);
    }
    for t in transitions {
        tracing::info!(resource = %t.resource_id, from = ?t.from, to = ?t.to, capacity = ?t.capacity, "lease mode changed");
        enforcer.on_transition(&t);
    }
}

/// Waits for one call to the server (None on shutdown). Leases keep expiring
/// on time meanwhile: a call can hang for the whole RPC timeout against a
/// blackholed server, longer than what is left of a lease.
async fn call<T>(
    fut: impl Future<Output = T>,
    client: &LeaseClient,
    clock: &Clock,
    enforcer: &dyn Enforcer,
    shutdown: &CancellationToken,
) -> Option<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = &mut fut => return Some(r),
            _ = tokio::time::sleep(DEMAND_POLL) => enforce(client, clock, enforcer),
        }
    }
}

async fn run(
    client: LeaseClient,
    clock: Clock,
    transport: Arc<dyn Transport>,
    enforcer: Arc<dyn Enforcer>,
    cache_file: Option<PathBuf>,
    shutdown: CancellationToken,
) {
    loop {
        let demand = enforcer.demand();
        let action = {
            let mut core = client.core.lock().expect("lease core poisoned");
            core.set_demand(demand);
            core.next_action(clock.now())
        };
        enforce(&client, &clock, &*enforcer);
        match action {
            Action::Wait { until } => {
                let d = until.since(clock.now()).min(DEMAND_POLL);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = client.wake.notified() => {}
                    _ = tokio::time::sleep(d) => {}
                }
            }
            Action::Discover { target } => {
                let Some(r) = call(transport.discovery(&target), &client, &clock, &*enforcer, &shutdown).await else {
                    break;
                };
                if let Err(e) = &r {
                    tracing::warn!(server = %target, error = ?e, "discovery failed; trying the next server");
                }
                client.core.lock().expect("lease core poisoned").on_discovery(clock.now(), &target, r);
            }
            Action::Refresh { target, request } => {
                let Some(r) =
                    call(transport.get_capacity(&target, request), &client, &clock, &*enforcer, &shutdown).await
                else {
                    break;
                };
                if let Err(e) = &r {
                    tracing::warn!(server = %target, error = ?e, "lease refresh failed");
                }
                let ok = r.is_ok();
                let mut core = client.core.lock().expect("lease core poisoned");
                core.on_refresh(clock.now(), r);
                // New leases apply at once, not at the next turn of the loop.
                let caps = core.capacities(clock.now());
                enforcer.apply(&caps);
                if ok && let Some(path) = &cache_file {
                    let leases = core.leases(clock.now());
                    let id = core.client_id().to_string();
                    drop(core);
                    if let Err(e) = cache::write(path, &id, &leases) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot write the lease cache");
                    }
                }
            }
            Action::Release { target, request } => {
                let r = transport.release_capacity(&target, request).await;
                client.core.lock().expect("lease core poisoned").on_release(clock.now(), r);
            }
        }
    }
    let release = client.core.lock().expect("lease core poisoned").release_all();
    if let Some((target, req)) = release {
        let n = req.resource_id.len();
        match tokio::time::timeout(RELEASE_TIMEOUT, transport.release_capacity(&target, req)).await {
            Ok(Ok(_)) => tracing::info!(server = %target, resources = n, "released every lease"),
            Ok(Err(e)) => {
                tracing::warn!(server = %target, error = ?e, "releasing leases failed; they will expire on the server")
            }
            Err(_) => tracing::warn!(server = %target, "releasing leases timed out; they will expire on the server"),
        }
    }
}
