//! The lease client's driver against real capacity servers in-process: a
//! test of `usher_lease::driver` that needs `usher_server`, so it lives here
//! (the lease crate does not depend on the server).

#![allow(
    clippy::disallowed_methods,
    reason = "tests bound waits in tokio's time and measure real stalls on the wall clock"
)]

use std::sync::atomic::{AtomicBool, Ordering};

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use usher_core::clock::Clock;
use usher_core::clock::Time;
use usher_core::config::resources::ResourcesConfig;
use usher_lease::OnExpiry;
use usher_lease::cache;
use usher_lease::core::{CallError, Lease, Mode};
use usher_lease::core::{Capacity, CoreConfig, KeyDemand, Source};
use usher_lease::driver::*;
use usher_lease::transport::BoxFuture;
use usher_lease::transport::Transport;
use usher_proto as proto;
use usher_server::{LocalTransport, Node};

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
            quota: None,
            account: None,
            window: None,
        }]
    }
    fn apply(&self, capacities: &[(String, Capacity)]) {
        if let Some((_, c)) = capacities.first() {
            self.0.lock().unwrap().push(*c);
        }
    }
}

/// A capacity server `s1` with the resources in `cfg` (YAML).
fn node(cfg: &str, clock: &Clock) -> Arc<Node> {
    Arc::new(Node::new(
        "s1".into(),
        "test".into(),
        ResourcesConfig::parse("test", cfg).unwrap(),
        clock.clone(),
        Duration::ZERO,
        prometheus::Registry::new(),
    ))
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
    let node = node(cfg, &clock);
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
    // Past the lease's expiry the lease is held, for as long again as it was
    // granted for; then the key falls to its safe capacity although the call still hangs.
    time.advance(Duration::from_secs(20));
    eventually("the lease is held while the renewal hangs", || mode(&client) == Some(Mode::Held)).await;
    assert_ne!(enforcer.0.lock().unwrap().last(), Some(&Capacity::Limited(4.0)), "the held lease is enforced");
    time.advance(Duration::from_secs(30));
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
    let (client, shutdown, task) = client_of(clock, transport, enforcer.clone(), cache);
    (client, enforcer, shutdown, task)
}

/// A lease client `c` of `s1` through `transport`.
fn client_of(
    clock: Clock,
    transport: Arc<dyn Transport>,
    enforcer: Arc<dyn Enforcer>,
    cache: Option<PathBuf>,
) -> (LeaseClient, CancellationToken, tokio::task::JoinHandle<()>) {
    let shutdown = CancellationToken::new();
    let (client, task) = LeaseClient::start(
        CoreConfig::new("c", vec!["s1".into()]),
        clock,
        transport,
        enforcer,
        cache,
        shutdown.clone(),
    );
    (client, shutdown, task)
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

/// An enforcer that counts its demand polls, quiet or not as the test says,
/// each taking `cost` of real time (as reading many keys does).
struct Polled {
    polls: std::sync::atomic::AtomicUsize,
    quiet: AtomicBool,
    activity: Arc<Notify>,
    cost: Duration,
}

impl Enforcer for Polled {
    fn demand(&self) -> Vec<KeyDemand> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.cost);
        Recorder::default().demand()
    }
    fn apply(&self, _: &[(String, Capacity)]) {}
    fn quiet(&self) -> bool {
        self.quiet.load(Ordering::SeqCst)
    }
    fn activity(&self) -> Option<Arc<Notify>> {
        Some(self.activity.clone())
    }
}

/// A master that grants every request its wants for an hour, to be
/// refreshed in an hour: between refreshes only demand polls wake a client.
struct Steady(Clock);

impl Transport for Steady {
    fn discovery(&self, _: &str) -> BoxFuture<'_, Result<proto::DiscoveryResponse, CallError>> {
        let mastership = proto::Mastership { master_address: Some("s1".into()) };
        Box::pin(async move { Ok(proto::DiscoveryResponse { mastership, is_master: true }) })
    }
    fn get_capacity(
        &self,
        _: &str,
        req: proto::GetCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetCapacityResponse, CallError>> {
        let expiry_time = self.0.now().as_secs() + 3600;
        let response = req
            .resource
            .into_iter()
            .map(|r| proto::ResourceResponse {
                pooled: None,
                bucket: None,
                allotment: None,
                credit: None,
                resource_capacity: None,
                spare: None,
                share_safe: None,
                fresh: None,
                upstream_quota: None,
                resource_id: r.resource_id,
                gets: proto::Lease { expiry_time, refresh_interval: 3600, capacity: r.wants },
                safe_capacity: None,
                template: None,
            })
            .collect();
        Box::pin(async move { Ok(proto::GetCapacityResponse { response, mastership: None }) })
    }
    fn release_capacity(
        &self,
        _: &str,
        _: proto::ReleaseCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::ReleaseCapacityResponse, CallError>> {
        Box::pin(async { Ok(proto::ReleaseCapacityResponse::default()) })
    }
    fn get_server_capacity(
        &self,
        _: &str,
        _: proto::GetServerCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetServerCapacityResponse, CallError>> {
        Box::pin(async { Ok(proto::GetServerCapacityResponse::default()) })
    }
}

/// Lets `d` pass on the manual clock and tokio's paused one together, 10 ms at a time.
async fn pass(time: &usher_core::clock::ManualClock, d: Duration) {
    for _ in 0..d.as_millis() / 10 {
        time.advance(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A quiet enforcer's demand is read only when something is due (here
/// nothing is for an hour), not ten times a second, and at once when it
/// signals activity; a busy one's every 100 ms.
#[tokio::test(start_paused = true)]
async fn a_quiet_enforcer_is_read_only_when_something_is_due_and_at_once_on_activity() {
    let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
    let transport = Arc::new(Steady(clock.clone()));
    let enforcer = Arc::new(Polled {
        polls: Default::default(),
        quiet: AtomicBool::new(false),
        activity: Arc::new(Notify::new()),
        cost: Duration::ZERO,
    });
    let (client, shutdown, task) = client_of(clock, transport, enforcer.clone(), None);
    let mode = |c: &LeaseClient| c.status().keys.first().map(|k| k.mode);
    eventually("leased", || mode(&client) == Some(Mode::Leased)).await;
    let polls = || enforcer.polls.load(Ordering::SeqCst);

    // Busy: every 100 ms (no refresh is due for an hour).
    let before = polls();
    pass(&time, Duration::from_secs(10)).await;
    let busy = polls() - before;
    assert!((95..=120).contains(&busy), "{busy} polls in 10 s while busy");

    // Quiet: not read again within QUIET_POLL while nothing is due.
    enforcer.quiet.store(true, Ordering::SeqCst);
    pass(&time, Duration::from_millis(150)).await;
    let before = polls();
    pass(&time, Duration::from_secs(30)).await;
    let quiet = polls() - before;
    assert_eq!(quiet, 0, "{quiet} polls in 30 s while quiet, with nothing due");

    // Activity wakes it at once, not at the next poll.
    pass(&time, Duration::from_millis(300)).await;
    let before = polls();
    enforcer.activity.notify_one();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(polls() - before, 1, "activity is read at once");
    shutdown.cancel();
    task.await.unwrap();
}

/// Demand that takes 20 ms to read is read every 400 ms, not every 100 ms:
/// the lease client's bookkeeping takes at most a twentieth of the time.
#[tokio::test(start_paused = true)]
async fn costly_demand_is_read_less_often() {
    let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
    let transport = Arc::new(Steady(clock.clone()));
    let enforcer = Arc::new(Polled {
        polls: Default::default(),
        quiet: AtomicBool::new(false),
        activity: Arc::new(Notify::new()),
        cost: Duration::from_millis(20),
    });
    let (client, shutdown, task) = client_of(clock, transport, enforcer.clone(), None);
    let mode = |c: &LeaseClient| c.status().keys.first().map(|k| k.mode);
    eventually("leased", || mode(&client) == Some(Mode::Leased)).await;
    let before = enforcer.polls.load(Ordering::SeqCst);
    for _ in 0..400 {
        time.advance(Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let polls = enforcer.polls.load(Ordering::SeqCst) - before;
    // At least 20 × 20 ms apart (real time may run longer than the 20 ms asked).
    assert!((3..=11).contains(&polls), "{polls} polls in 4 s of 20 ms each");
    shutdown.cancel();
    task.await.unwrap();
}

/// Keys that keep arriving (one more at every read), each read taking 20 ms.
struct Arriving {
    reads: std::sync::atomic::AtomicUsize,
}

impl Enforcer for Arriving {
    fn demand(&self) -> Vec<KeyDemand> {
        let n = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
        std::thread::sleep(Duration::from_millis(20));
        Many(n).demand()
    }
    fn apply(&self, _: &[(String, Capacity)]) {}
}

/// While keys keep arriving with a short minimum interval (the embedded
/// server's 100 ms), each early refresh is not followed by a read of every
/// key: demand is still read once a poll (here 400 ms, for 20 ms reads).
#[tokio::test(start_paused = true)]
async fn demand_is_read_once_a_poll_while_keys_arrive_and_refresh_early() {
    let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
    let mut cfg = CoreConfig::new("c", vec!["s1".into()]);
    cfg.min_interval = Duration::from_millis(100);
    let enforcer = Arc::new(Arriving { reads: Default::default() });
    let shutdown = CancellationToken::new();
    let (client, task) =
        LeaseClient::start(cfg, clock.clone(), Arc::new(Steady(clock)), enforcer.clone(), None, shutdown.clone());
    eventually("leased", || client.status().keys.iter().any(|k| k.mode == Mode::Leased)).await;
    let before = (enforcer.reads.load(Ordering::SeqCst), client.status().keys.len());
    pass(&time, Duration::from_secs(4)).await;
    let reads = enforcer.reads.load(Ordering::SeqCst) - before.0;
    assert!((3..=11).contains(&reads), "{reads} reads in 4 s of 20 ms each");
    // The keys read are still asked for: every one has a lease.
    eventually("every key leased", || client.status().keys.iter().all(|k| k.mode == Mode::Leased)).await;
    assert!(client.status().keys.len() > before.1);
    shutdown.cancel();
    task.await.unwrap();
}

/// Demand that takes 300 ms to read, every time (thousands of keys).
struct Slow;

impl Enforcer for Slow {
    fn demand(&self) -> Vec<KeyDemand> {
        std::thread::sleep(Duration::from_millis(300));
        Recorder::default().demand()
    }
    fn apply(&self, _: &[(String, Capacity)]) {}
}

/// How long the longest of 20 ticks of 10 ms took on the caller's
/// (current-thread) runtime, with a lease client whose demand is slow to
/// read running where `runs` says.
fn longest_tick_beside_a_slow_client(runs: Runs) -> Duration {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
        let transport = Arc::new(LocalTransport::new());
        let cfg = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 10, learning_mode_duration: 0 }\n";
        transport.add("s1", node(cfg, &clock));
        let shutdown = CancellationToken::new();
        let (_client, task) = LeaseClient::start_on(
            runs,
            CoreConfig::new("c", vec!["s1".into()]),
            clock,
            transport,
            Arc::new(Slow),
            None,
            shutdown.clone(),
        );
        let mut longest = Duration::ZERO;
        for _ in 0..20 {
            let t = std::time::Instant::now();
            tokio::time::sleep(Duration::from_millis(10)).await;
            longest = longest.max(t.elapsed());
        }
        shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        longest
    })
}

/// On a thread of its own, a lease client whose every demand read takes
/// 300 ms leaves the proxy's runtime free; as a task there, it stalls it.
#[test]
fn a_client_on_its_own_thread_does_not_stall_the_callers_runtime() {
    let own = longest_tick_beside_a_slow_client(Runs::OwnThread);
    assert!(own < Duration::from_millis(200), "a tick took {own:?} beside a client on its own thread");
    let here = longest_tick_beside_a_slow_client(Runs::Here);
    assert!(here >= Duration::from_millis(250), "the same client as a task should stall a tick (longest {here:?})");
}

/// Demand for `n` keys at once (a sidecar with many tenants).
struct Many(usize);

impl Enforcer for Many {
    fn demand(&self) -> Vec<KeyDemand> {
        (0..self.0)
            .map(|i| KeyDemand {
                resource_id: format!("t/{i}"),
                priority: 0,
                wants: 1.0,
                on_expiry: OnExpiry::Safe,
                safe_capacity: None,
                pressure: false,
                quota: None,
                account: None,
                window: None,
            })
            .collect()
    }
    fn apply(&self, _: &[(String, Capacity)]) {}
}

/// 12,000 keys are more than a server takes in one GetCapacity: the refresh
/// goes in two calls, and every key gets its lease.
#[tokio::test]
async fn more_keys_than_one_call_takes_are_leased_in_several() {
    assert_eq!(MAX_RESOURCES_PER_CALL, usher_server::service::MAX_RESOURCES_PER_REQUEST);
    let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
    let transport = Arc::new(LocalTransport::new());
    let cfg = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 30, learning_mode_duration: 0 }\n";
    transport.add("s1", node(cfg, &clock));
    let shutdown = CancellationToken::new();
    let (client, task) = LeaseClient::start(
        CoreConfig::new("c", vec!["s1".into()]),
        clock,
        transport,
        Arc::new(Many(12_000)),
        None,
        shutdown.clone(),
    );
    eventually("every key leased", || {
        let s = client.status();
        s.keys.len() == 12_000 && s.keys.iter().all(|k| k.mode == Mode::Leased)
    })
    .await;
    assert!(client.status().last_error.is_none(), "{:?}", client.status().last_error);
    shutdown.cancel();
    task.await.unwrap();
}

/// Two keys; records every capacity applied, and says it was rebuilt or
/// has a key to re-apply when the test says so.
#[derive(Default)]
struct Applied {
    applied: Mutex<Vec<(String, Capacity)>>,
    rebuilt: AtomicBool,
    reapply: Mutex<Vec<String>>,
}

impl Enforcer for Applied {
    fn demand(&self) -> Vec<KeyDemand> {
        ["a", "b"]
            .iter()
            .map(|id| KeyDemand {
                resource_id: id.to_string(),
                priority: 0,
                wants: 10.0,
                on_expiry: OnExpiry::Pessimistic,
                safe_capacity: None,
                pressure: false,
                quota: None,
                account: None,
                window: None,
            })
            .collect()
    }
    fn apply(&self, capacities: &[(String, Capacity)]) {
        self.applied.lock().unwrap().extend_from_slice(capacities);
    }
    fn rebuilt(&self) -> bool {
        self.rebuilt.swap(false, Ordering::SeqCst)
    }
    fn reapply(&self) -> Vec<String> {
        self.reapply.lock().unwrap().clone()
    }
}

/// Each capacity is applied when it changes, not at every poll; every key
/// again after a rebuild; a key the enforcer asks for at every turn.
#[tokio::test(start_paused = true)]
async fn only_changed_capacities_are_applied() {
    let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
    let enforcer = Arc::new(Applied::default());
    let (client, shutdown, task) = client_of(clock.clone(), Arc::new(Steady(clock)), enforcer.clone(), None);
    eventually("leased", || client.status().keys.iter().all(|k| k.mode == Mode::Leased)).await;
    pass(&time, Duration::from_millis(200)).await;
    let take = || std::mem::take(&mut *enforcer.applied.lock().unwrap());
    let leased = |ids: &[&str]| ids.iter().map(|id| (id.to_string(), Capacity::Limited(10.0))).collect::<Vec<_>>();
    assert_eq!(take(), leased(&["a", "b"]), "each lease applied once (pending keys wait during start-up)");
    pass(&time, Duration::from_secs(2)).await;
    assert_eq!(take(), vec![], "twenty polls, nothing changed, nothing applied");
    enforcer.rebuilt.store(true, Ordering::SeqCst);
    pass(&time, Duration::from_millis(200)).await;
    assert_eq!(take(), leased(&["a", "b"]), "a rebuilt enforcer gets every key once");
    *enforcer.reapply.lock().unwrap() = vec!["b".into()];
    pass(&time, Duration::from_secs(1)).await;
    let again = take();
    assert!(again.len() >= 5 && again.iter().all(|(id, _)| id == "b"), "{again:?}");
    shutdown.cancel();
    task.await.unwrap();
}

/// An enforcer with no keys until `made` is set, then [`Recorder`]'s key.
#[derive(Default)]
struct Later {
    made: AtomicBool,
    rec: Recorder,
}

impl Enforcer for Later {
    fn demand(&self) -> Vec<KeyDemand> {
        if self.made.load(Ordering::SeqCst) { self.rec.demand() } else { Vec::new() }
    }
    fn apply(&self, capacities: &[(String, Capacity)]) {
        self.rec.apply(capacities);
    }
}

/// A sidecar that starts with no keys (only templated ones, made by
/// requests) is not waiting for a first call when start-up ends. A key made
/// later keeps its configured capacity while the call that carries it is
/// out, even if that call is slow: a new tenant's first request is not
/// refused for the round trip its lease takes.
#[tokio::test]
async fn a_key_made_after_start_up_keeps_its_capacity_while_its_first_call_is_out() {
    let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
    let cfg = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 10, learning_mode_duration: 0 }\n";
    let transport = Arc::new(Hanging { net: LocalTransport::new(), hang: AtomicBool::new(false) });
    transport.net.add("s1", node(cfg, &clock));
    let enforcer = Arc::new(Later::default());
    let (client, shutdown, task) = client_of(clock, transport.clone(), enforcer.clone(), None);
    assert_eq!(client.ready(Duration::from_secs(2)).await, Start::Leased, "no key: nothing to wait for");
    // The servers turn slow; then a request makes the key.
    transport.hang.store(true, Ordering::SeqCst);
    enforcer.made.store(true, Ordering::SeqCst);
    eventually("the key is made", || !client.status().keys.is_empty()).await;
    tokio::time::sleep(DEMAND_POLL * 5).await;
    let key = &client.status().keys[0];
    assert_eq!(key.mode, Mode::Pending);
    assert!(
        enforcer.rec.0.lock().unwrap().is_empty(),
        "the configured capacity holds while the key's first call is out: {:?}",
        enforcer.rec.0.lock().unwrap()
    );
    shutdown.cancel();
    task.await.unwrap();
}
