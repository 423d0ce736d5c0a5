//! A calendar quota in virtual time, through the real capacity servers, lease
//! client cores and limiters: three clients whose apps fire 50 requests at
//! once just after each UTC minute begins, over ten minutes, with a server
//! restart (its state file says leases may be outstanding) and a master
//! change in the middle of a minute. Every minute gets at most its quota
//! plus one request per client, and every full minute nearly all of it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use usher_core::clock::{Clock, ManualClock, Time};
use usher_core::config::resources::ResourcesConfig;
use usher_lease::core::*;
use usher_lease::transport::Transport;
use usher_limit::{Kind, LeaseTable, Limiter, ResourceSpec};
use usher_server::store::Predecessor;
use usher_server::{LocalTransport, Mastership, Node};

const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 120/min\n    window: calendar\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n";
/// The virtual clock's step.
const TICK: Duration = Duration::from_millis(20);
/// How long a request waits for capacity before it is refused.
const MAX_WAIT: Duration = Duration::from_millis(500);

/// One client: its lease core, the limiter it enforces with, and its app's requests.
struct Client {
    core: Core,
    table: LeaseTable,
    key: Arc<Limiter>,
    /// When requests arrived over the last minute, refused ones included (its demand).
    arrived: VecDeque<Time>,
    /// Requests waiting for capacity, by arrival.
    waiting: Vec<Time>,
}

impl Client {
    fn new(id: &str, clock: &Clock) -> Client {
        let mut cfg = CoreConfig::new(id, vec!["s1".into(), "s2".into()]);
        cfg.seed = id.bytes().map(u64::from).sum();
        let table = LeaseTable::new(clock.clone());
        table.configure(vec![ResourceSpec {
            name: "cal".into(),
            kind: Kind::Rate,
            capacity: 2.0,
            burst: 2.0,
            max_wait: MAX_WAIT,
            max_queue: 100,
            max_keys: 1,
            window: Duration::from_secs(60),
            shared: true,
            burst_span: Some(Duration::from_secs(1)),
            shadow: false,
            upstream_quota: false,
            templated: false,
        }]);
        let key = table.resource("cal").unwrap().limiter("cal");
        Client { core: Core::new(cfg, clock.now()), table, key, arrived: VecDeque::new(), waiting: Vec::new() }
    }

    /// What the key wants, as `wants: auto` measures it: the arrivals of the
    /// last 2 s, or if more, of the last minute.
    fn demand(&mut self, now: Time) -> KeyDemand {
        while self.arrived.front().is_some_and(|t| now.since(*t) > Duration::from_secs(60)) {
            self.arrived.pop_front();
        }
        let recent = self.arrived.iter().filter(|t| now.since(**t) <= Duration::from_secs(2)).count();
        KeyDemand {
            resource_id: "cal".into(),
            priority: 0,
            wants: (recent as f64 / 2.0).max(self.arrived.len() as f64 / 60.0),
            on_expiry: OnExpiry::Safe,
            safe_capacity: None,
            pressure: !self.waiting.is_empty(),
            quota: None,
            account: self.key.account().map(Box::new),
            window: None,
        }
    }

    /// Runs the core's actions until it waits, and applies what changed;
    /// reads the demand first when `read` (the driver reads it every
    /// 100 ms, so a request may carry an account read that long before).
    fn step(&mut self, net: &LocalTransport, rt: &tokio::runtime::Runtime, clock: &Clock, read: bool) {
        let now = clock.now();
        if read {
            let demand = self.demand(now);
            self.core.set_demand(vec![demand]);
        }
        for _ in 0..20 {
            match self.core.next_action(now) {
                Action::Wait { .. } => break,
                Action::Discover { target } => {
                    let r = rt.block_on(net.discovery(&target));
                    self.core.on_discovery(now, &target, r);
                }
                Action::Refresh { target, request } => {
                    let r = rt.block_on(net.get_capacity(&target, request));
                    self.core.on_refresh(now, r);
                }
                Action::Release { target, request } => {
                    let r = rt.block_on(net.release_capacity(&target, request));
                    self.core.on_release(now, r);
                }
            }
        }
        for (id, c) in self.core.take_changes(now, &[], false) {
            self.table.set_capacity(&id, if let Capacity::Limited(c) = c { c } else { f64::INFINITY });
        }
        for (id, a) in self.core.take_allotments() {
            self.table.allot(&id, a);
        }
    }

    /// Admits what can pass of the waiting requests; refuses those that
    /// waited `MAX_WAIT`. Returns how many passed.
    fn admit(&mut self, now: Time) -> u64 {
        let rate = self.key.rate().expect("a rate key");
        let mut passed = 0;
        self.waiting.retain(|arrival| {
            if matches!(rate.reserve(now, 1.0, Duration::ZERO), usher_limit::rate::Reservation::Slot { .. }) {
                passed += 1;
                return false;
            }
            now.since(*arrival) < MAX_WAIT
        });
        passed
    }
}

#[test]
fn bursts_at_each_boundary_get_each_unit_once_through_restarts_and_master_changes() {
    // Half a minute before a boundary.
    let first: u64 = 1_800_000_000 / 60 + 1;
    let (clock, time): (Clock, Arc<ManualClock>) = Clock::manual(Time::from_secs(first * 60 - 30));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let net = LocalTransport::new();
    let node = |id: &str| {
        let cfg = ResourcesConfig::parse("test", CONFIG).unwrap();
        Arc::new(Node::new(id.into(), "test".into(), cfg, clock.clone(), Duration::from_secs(1), Default::default()))
    };
    let s1 = node("s1");
    s1.store.set_predecessor(Predecessor::NoneOutstanding);
    let s2 = node("s2");
    s2.set_mastership(Mastership { is_master: false, master_address: Some("s1".into()) });
    net.add("s1", s1);
    net.add("s2", s2.clone());
    let mut clients: Vec<Client> = ["a", "b", "c"].iter().map(|id| Client::new(id, &clock)).collect();
    let mut passed: BTreeMap<u64, u64> = BTreeMap::new();
    let (restart, handover) = (Time::from_secs((first + 3) * 60 + 20), Time::from_secs((first + 6) * 60 + 25));
    let (mut restarted, mut handed_over) = (false, false);
    let end = Time::from_secs((first + 10) * 60);
    let (mut fired, mut late) = (first, first - 1);
    while clock.now() < end {
        time.advance(TICK);
        let now = clock.now();
        let minute = now.as_nanos() / 60_000_000_000;
        if now >= restart && !restarted {
            // s1 restarts: its state file says leases may be outstanding for a lease length.
            restarted = true;
            let fresh = node("s1");
            fresh.store.set_predecessor(Predecessor::Until(now.saturating_add(Duration::from_secs(60))));
            net.add("s1", fresh);
        }
        if now >= handover && !handed_over {
            // s2 takes over from s1 (elected): it learns what the clients hold.
            handed_over = true;
            s2.set_mastership(Mastership { is_master: true, master_address: Some("s2".into()) });
            let old = node("s1");
            old.set_mastership(Mastership { is_master: false, master_address: Some("s2".into()) });
            net.add("s1", old);
        }
        // The apps fire 50 just after each minute begins, and 10 more half a minute on.
        let into = Duration::from_nanos(now.as_nanos() % 60_000_000_000);
        let burst = match (minute == fired, late == minute) {
            (true, _) if into >= Duration::from_millis(100) => 50,
            (false, false) if into >= Duration::from_secs(30) => 10,
            _ => 0,
        };
        if burst == 50 {
            fired += 1;
        } else if burst == 10 {
            late = minute;
        }
        for c in clients.iter_mut().filter(|_| burst > 0) {
            c.arrived.extend(std::iter::repeat_n(now, burst));
            c.waiting.extend(std::iter::repeat_n(now, burst));
        }
        // (Demand is read every 100 ms, a different 20 ms into it for each client.)
        for (i, c) in clients.iter_mut().enumerate() {
            let read = (now.as_nanos() / TICK.as_nanos() as u64 + i as u64).is_multiple_of(5);
            c.step(&net, &rt, &clock, read);
            *passed.entry(minute).or_default() += c.admit(now);
        }
    }
    let report = format!(
        "passed by minute: {passed:?} (first whole minute {first}; restart at {restart:?}, handover at {handover:?})"
    );
    for (minute, n) in &passed {
        assert!(*n <= 120 + 3, "minute {minute} passed {n} of 120\n{report}");
    }
    for (minute, n) in passed.range(first..first + 10) {
        assert!(*n >= 110, "minute {minute} passed only {n} of 120\n{report}");
    }
    assert_eq!(passed.range(first..first + 10).count(), 10, "{report}");
    // The master change took: the clients lease from s2.
    let status = s2.store.status();
    assert_eq!(status.first().map(|r| r.clients), Some(3), "{status:?}");
}
