use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::clock::Time;
use crate::config::resources::ResourcesConfig;
use crate::lease::OnExpiry;
use crate::lease::core::{CallError, Lease, Mode};
use crate::lease::transport::{BoxFuture, LocalTransport};
use crate::proto;
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

/// A client of `s1` behind a transport whose calls hang from the start (a
/// blackholed server), with `cache` as its lease cache.
fn start_hanging(
    clock: Clock,
    cache: Option<PathBuf>,
) -> (LeaseClient, Arc<Recorder>, CancellationToken, tokio::task::JoinHandle<()>) {
    let transport = Arc::new(Hanging { net: LocalTransport::new(), hang: AtomicBool::new(true) });
    let enforcer = Arc::new(Recorder::default());
    let shutdown = CancellationToken::new();
    let (client, task) = LeaseClient::start(
        CoreConfig::new("c", vec!["s1".into()]),
        clock,
        transport,
        enforcer.clone(),
        cache,
        shutdown.clone(),
    );
    (client, enforcer, shutdown, task)
}

#[tokio::test]
async fn a_cached_lease_holds_from_the_start_and_start_up_does_not_wait() {
    let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.json");
    let lease = Lease {
        capacity: 7.0,
        expiry: clock.now().saturating_add(Duration::from_secs(30)),
        refresh_interval: Duration::from_secs(10),
    };
    cache::write(&path, "c", &[("api".into(), lease)]).unwrap();
    let (client, enforcer, shutdown, task) = start_hanging(clock, Some(path));
    assert_eq!(*enforcer.0.lock().unwrap(), vec![Capacity::Limited(7.0)], "enforced before anything else runs");
    let t0 = tokio::time::Instant::now();
    assert_eq!(client.ready(Duration::from_secs(2)).await, Start::Leased);
    assert!(t0.elapsed() < Duration::from_secs(1), "no start-up wait: {:?}", t0.elapsed());
    let key = &client.status().keys[0];
    assert_eq!((key.mode, key.source, key.capacity), (Mode::Leased, Source::Cache, Capacity::Limited(7.0)));
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_key_without_a_lease_follows_on_expiry_once_start_up_stops_waiting() {
    let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
    let (client, enforcer, shutdown, task) = start_hanging(clock, None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(enforcer.0.lock().unwrap().is_empty(), "during the wait the configured capacity holds");
    assert_eq!(client.ready(Duration::from_millis(200)).await, Start::Waited);
    assert_eq!(enforcer.0.lock().unwrap().last(), Some(&Capacity::Limited(0.0)), "on_expiry safe, no safe capacity");
    let key = &client.status().keys[0];
    assert_eq!((key.mode, key.source), (Mode::Pending, Source::OnExpiry));
    shutdown.cancel();
    task.await.unwrap();
}
