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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::clock::Time;
    use crate::config::resources::ResourcesConfig;
    use crate::lease::OnExpiry;
    use crate::lease::core::{CallError, Mode};
    use crate::lease::transport::BoxFuture;
    use crate::proto;
    use crate::server::LocalTransport;
    use crate::server::Node;

    /// A server whose calls hang forever once `hang` is set, as a blackholed one does.
    struct Hanging {
        net: LocalTransport,
        hang: AtomicBool,
    }

    impl Hanging {
        fn pass<'a, T: Send + 'a>(&'a self, f: BoxFuture<'a, T>) -> BoxFuture<'a, T> {
            if self.hang.load(Ordering::SeqCst) { Box::pin(std::future::pending()) } else { f }
        }
    }

    impl Transport for Hanging {
        fn discovery(&self, addr: &str) -> BoxFuture<'_, Result<proto::DiscoveryResponse, CallError>> {
            self.pass(self.net.discovery(addr))
        }
        fn get_capacity(
            &self,
            addr: &str,
            req: proto::GetCapacityRequest,
        ) -> BoxFuture<'_, Result<proto::GetCapacityResponse, CallError>> {
            self.pass(self.net.get_capacity(addr, req))
        }
        fn release_capacity(
            &self,
            addr: &str,
            req: proto::ReleaseCapacityRequest,
        ) -> BoxFuture<'_, Result<proto::ReleaseCapacityResponse, CallError>> {
            self.pass(self.net.release_capacity(addr, req))
        }
        fn get_server_capacity(
            &self,
            addr: &str,
            req: proto::GetServerCapacityRequest,
        ) -> BoxFuture<'_, Result<proto::GetServerCapacityResponse, CallError>> {
            self.pass(self.net.get_server_capacity(addr, req))
        }
    }

    #[derive(Default)]
    struct Recorder(Mutex<Vec<Capacity>>);

    impl Enforcer for Recorder {
        fn demand(&self) -> Vec<KeyDemand> {
            vec![KeyDemand {
                resource_id: "api".into(),
                priority: 0,
                wants: 10.0,
                on_expiry: OnExpiry::Safe,
                safe_capacity: None,
                pressure: false,
            }]
        }
        fn apply(&self, capacities: &[(String, Capacity)]) {
            if let Some((_, c)) = capacities.first() {
                self.0.lock().unwrap().push(*c);
            }
        }
    }

    async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_lease_expires_on_time_while_a_renewal_hangs() {
        let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
        let cfg = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    safe_capacity: 4\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 10, learning_mode_duration: 0 }\n";
        let node = Arc::new(Node::new(
            "s1".into(),
            "test".into(),
            ResourcesConfig::parse("test", cfg).unwrap(),
            clock.clone(),
            Duration::ZERO,
            prometheus::Registry::new(),
        ));
        let transport = Arc::new(Hanging { net: LocalTransport::new(), hang: AtomicBool::new(false) });
        transport.net.add("s1", node);
        let enforcer = Arc::new(Recorder::default());
        let shutdown = CancellationToken::new();
        let (client, task) = LeaseClient::start(
            CoreConfig::new("c", vec!["s1".into()]),
            clock,
            transport.clone(),
            enforcer.clone(),
            None,
            shutdown.clone(),
        );
        let mode = |c: &LeaseClient| c.status().keys.first().map(|k| k.mode);
        eventually("leased", || mode(&client) == Some(Mode::Leased)).await;
        // The server stops answering; the next renewal (due within 10 s) hangs.
        transport.hang.store(true, Ordering::SeqCst);
        time.advance(Duration::from_secs(12));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(mode(&client), Some(Mode::Leased), "the lease is still valid");
        // Past the lease's expiry: the key falls to its safe capacity although the call still hangs.
        time.advance(Duration::from_secs(20));
        eventually("the lease expires while the renewal hangs", || mode(&client) == Some(Mode::Expired)).await;
        eventually("the safe capacity applies", || enforcer.0.lock().unwrap().last() == Some(&Capacity::Limited(4.0)))
            .await;
        shutdown.cancel();
        task.await.unwrap();
    }
}
