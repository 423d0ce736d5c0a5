//! The lease client's core against real capacity servers in-process, on a
//! manual clock: a test of `usher_lease::core` that needs `usher_server`, so
//! it lives here (the lease crate does not depend on the server).

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Duration;

use usher_core::clock::Time;
use usher_core::clock::{Clock, ManualClock};
use usher_core::config::resources::ResourcesConfig;
use usher_lease::core::*;
use usher_lease::transport::Transport;
use usher_proto as proto;
use usher_server::LocalTransport;
use usher_server::{Mastership, Node};

/// Most tests here follow exact grants, so the template hands out no spare
/// capacity (`spare: keep`); [`SPARE`] is FAIR_SHARE as it comes.
const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    safe_capacity: 4\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 12, learning_mode_duration: 0, parameters: [{name: spare, value: keep}] }\n";
const SPARE: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    safe_capacity: 4\n    algorithm: { kind: FAIR_SHARE, lease_length: 30, refresh_interval: 12, learning_mode_duration: 0 }\n";

/// Real capacity servers in-process, a manual clock, and a stepper that
/// carries out a core's actions the way the driver does.
struct World {
    clock: Clock,
    time: Arc<ManualClock>,
    net: LocalTransport,
    nodes: HashMap<String, Arc<Node>>,
    rt: tokio::runtime::Runtime,
}

impl World {
    fn new(servers: &[&str]) -> World {
        World::with(servers, CONFIG)
    }

    fn with(servers: &[&str], config: &str) -> World {
        let (clock, time) = Clock::manual(Time::from_secs(1_700_000_000));
        let net = LocalTransport::new();
        let mut nodes = HashMap::new();
        for s in servers {
            let cfg = ResourcesConfig::parse("test", config).unwrap();
            let node = Arc::new(Node::new(
                s.to_string(),
                "test".into(),
                cfg,
                clock.clone(),
                Duration::ZERO,
                prometheus::Registry::new(),
            ));
            net.add(*s, node.clone());
            nodes.insert(s.to_string(), node);
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        World { clock, time, net, nodes, rt }
    }

    fn core(&self, id: &str, servers: &[&str]) -> Core {
        let mut cfg = CoreConfig::new(id, servers.iter().map(|s| s.to_string()).collect());
        cfg.seed = id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Core::new(cfg, self.clock.now())
    }

    /// Runs actions until the core waits; returns how many calls it made.
    fn step(&self, core: &mut Core) -> usize {
        let mut calls = 0;
        loop {
            let now = self.clock.now();
            match core.next_action(now) {
                Action::Wait { .. } => return calls,
                Action::Discover { target } => {
                    let r = self.rt.block_on(self.net.discovery(&target));
                    core.on_discovery(self.clock.now(), &target, r);
                }
                Action::Refresh { target, request } => {
                    let r = self.rt.block_on(self.net.get_capacity(&target, request));
                    core.on_refresh(self.clock.now(), r);
                }
                Action::Release { target, request } => {
                    let r = self.rt.block_on(self.net.release_capacity(&target, request));
                    core.on_release(self.clock.now(), r);
                }
            }
            calls += 1;
            assert!(calls < 50, "the core keeps calling without waiting");
        }
    }

    fn advance(&self, d: Duration) {
        self.time.advance(d);
    }

    /// Makes `resource` known to `server` for a refresh interval, so its
    /// leases carry the configured interval, not the short one of a new
    /// resource whose clients are still arriving.
    fn settle(&self, server: &str, resource: &str) {
        let mut warm = self.core("warm-up", &[server]);
        warm.set_demand(vec![demand(resource, 0.0, OnExpiry::Safe)]);
        self.step(&mut warm);
        self.advance(Duration::from_secs(12));
    }
}

fn demand(id: &str, wants: f64, on_expiry: OnExpiry) -> KeyDemand {
    KeyDemand {
        resource_id: id.into(),
        priority: 0,
        wants,
        on_expiry,
        safe_capacity: Some(2.0),
        pressure: false,
        quota: None,
        account: None,
        window: None,
    }
}

fn cap(core: &mut Core, now: Time, id: &str) -> Capacity {
    core.capacities(now).into_iter().find(|(k, _)| k == id).unwrap().1
}

#[test]
fn first_refresh_leases_and_schedules_the_next_before_expiry() {
    let w = World::new(&["s1"]);
    w.settle("s1", "r");
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 60.0, OnExpiry::Pessimistic)]);
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(0.0), "pending: on_expiry applies");
    w.step(&mut c);
    assert_eq!(c.master(), Some("s1"));
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(60.0));
    let wait = c.next_refresh().since(w.clock.now());
    assert!(wait >= Duration::from_secs(10) && wait <= Duration::from_secs(14), "12 s ± 1/6: {wait:?}");
    assert_eq!(c.take_transitions().len(), 1);
}

#[test]
fn fails_over_to_the_next_server_when_one_is_unreachable() {
    let w = World::new(&["s1", "s2"]);
    w.net.set_up("s1", false);
    let mut c = w.core("a", &["s1", "s2"]);
    c.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
    w.step(&mut c);
    assert!(c.last_error().unwrap().contains("unreachable"));
    w.advance(Duration::from_secs(1));
    w.step(&mut c);
    assert_eq!(c.master(), Some("s2"));
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(10.0));
}

#[test]
fn a_dead_master_sends_the_client_to_the_next_server_at_once_and_a_dead_round_backs_off() {
    let w = World::new(&["s1", "s2"]);
    let mut c = w.core("a", &["s1", "s2"]);
    c.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
    w.step(&mut c);
    assert_eq!(c.master(), Some("s1"));
    // s1 dies holding the client's lease: the refresh fails, and the next
    // server is asked NEXT_SERVER later, not a backoff step later.
    w.net.set_up("s1", false);
    w.advance(c.next_refresh().since(w.clock.now()));
    w.step(&mut c);
    assert_eq!(c.master(), None);
    assert_eq!(c.next_refresh().since(w.clock.now()), NEXT_SERVER);
    w.advance(NEXT_SERVER);
    w.step(&mut c);
    assert_eq!(c.master(), Some("s2"), "{:?}", c.last_error());
    // Both down: one quick try of the other server, then the backoff.
    w.net.set_up("s2", false);
    w.advance(c.next_refresh().since(w.clock.now()));
    w.step(&mut c);
    assert_eq!(c.next_refresh().since(w.clock.now()), NEXT_SERVER);
    w.advance(NEXT_SERVER);
    w.step(&mut c);
    assert!(c.next_refresh().since(w.clock.now()) > NEXT_SERVER * 4, "a round of failures backs off");
}

#[test]
fn until_a_server_first_answers_rounds_are_at_most_a_jittered_second_apart() {
    let w = World::new(&["s1"]);
    w.net.set_up("s1", false);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
    let limit = FIRST_ANSWER_RETRY.mul_f64(1.0 + CoreConfig::new("x", vec![]).backoff.randomization);
    let mut longest = Duration::ZERO;
    for _ in 0..12 {
        w.step(&mut c);
        let wait = c.next_refresh().since(w.clock.now());
        longest = longest.max(wait);
        w.advance(wait);
    }
    assert!(longest <= limit && longest > FIRST_ANSWER_RETRY / 2, "no lease yet: {longest:?}");
    // Once a server has answered, failures back off to the full maximum.
    w.net.set_up("s1", true);
    w.step(&mut c);
    assert_eq!(c.master(), Some("s1"));
    w.net.set_up("s1", false);
    let mut longest = Duration::ZERO;
    for _ in 0..12 {
        w.advance(c.next_refresh().since(w.clock.now()));
        w.step(&mut c);
        longest = longest.max(c.next_refresh().since(w.clock.now()));
    }
    assert!(longest > limit, "after the first answer the backoff grows past a second: {longest:?}");
}

#[test]
fn a_call_that_hung_until_its_timeout_is_retried_by_the_backoff_from_its_start() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
    let Action::Discover { target } = c.next_action(w.clock.now()) else { panic!("discovers first") };
    // The call hangs for 2 s (a TLS handshake with a server still starting).
    w.advance(Duration::from_secs(2));
    c.on_discovery(w.clock.now(), &target, Err(CallError::Transient("deadline has elapsed".into())));
    assert_eq!(c.next_refresh(), w.clock.now(), "the backoff since the call began has passed: retry now");
    // A call that fails at once waits its backoff from now.
    let Action::Discover { target } = c.next_action(w.clock.now()) else { panic!("discovers again") };
    c.on_discovery(w.clock.now(), &target, Err(CallError::Transient("refused".into())));
    assert!(
        c.next_refresh() > w.clock.now().saturating_add(Duration::from_millis(300)),
        "{:?}",
        c.next_refresh().since(w.clock.now())
    );
}

#[test]
fn follows_a_mastership_redirect_at_once() {
    let w = World::new(&["s1", "s2"]);
    w.nodes["s1"].set_mastership(Mastership { is_master: false, master_address: Some("s2".into()) });
    let mut c = w.core("a", &["s1", "s2"]);
    c.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
    let calls = w.step(&mut c);
    assert_eq!(c.master(), Some("s2"));
    assert_eq!(calls, 2, "discovery at s1 names s2, then one refresh there");
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(10.0));
    // s2 loses mastership to s1: the next refresh is redirected and followed.
    w.nodes["s2"].set_mastership(Mastership { is_master: false, master_address: Some("s1".into()) });
    w.nodes["s1"].set_mastership(Mastership { is_master: true, master_address: Some("s1".into()) });
    w.advance(Duration::from_secs(15));
    w.step(&mut c);
    assert_eq!(c.master(), Some("s1"));
    assert_eq!(c.status()[0].mode, Mode::Leased);
}

#[test]
fn expiry_follows_on_expiry_per_key() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![
        demand("opt", 50.0, OnExpiry::Optimistic),
        demand("pes", 50.0, OnExpiry::Pessimistic),
        demand("safe", 50.0, OnExpiry::Safe),
    ]);
    w.step(&mut c);
    w.net.set_up("s1", false);
    // Refreshes now fail; the leases hold until they expire 30 s after grant.
    for _ in 0..28 {
        w.advance(Duration::from_secs(1));
        w.step(&mut c);
    }
    assert_eq!(cap(&mut c, w.clock.now(), "pes"), Capacity::Limited(50.0), "still within the lease");
    // Expired unrenewed: each lease is held for as long again as it was
    // granted for (the server keeps it reserved that long), and reported.
    w.advance(Duration::from_secs(3));
    w.step(&mut c);
    let now = w.clock.now();
    for k in ["opt", "pes", "safe"] {
        assert_eq!(cap(&mut c, now, k), Capacity::Limited(50.0), "{k} is held");
    }
    assert!(c.status().iter().all(|k| k.mode == Mode::Held && k.source == Source::Lease), "{:?}", c.status());
    let tr = c.take_transitions();
    assert_eq!(tr.iter().filter(|t| (t.from, t.to) == (Mode::Leased, Mode::Held)).count(), 3);
    assert!(c.request(now, None).resource.iter().all(|r| r.has.as_ref().is_some_and(|h| h.capacity == 50.0)));
    // The hold ends 30 s after the expiry: on_expiry applies.
    w.advance(Duration::from_secs(27));
    w.step(&mut c);
    assert_eq!(c.status()[0].mode, Mode::Held, "the hold lasts as long as the lease did");
    w.advance(Duration::from_secs(3));
    w.step(&mut c);
    let now = w.clock.now();
    assert_eq!(cap(&mut c, now, "opt"), Capacity::Limited(50.0));
    assert_eq!(cap(&mut c, now, "pes"), Capacity::Limited(0.0));
    assert_eq!(cap(&mut c, now, "safe"), Capacity::Limited(4.0), "the server's safe capacity beats the configured 2");
    assert!(c.request(now, None).resource.iter().all(|r| r.has.is_none()), "an expired lease is not reported");
    let tr = c.take_transitions();
    assert_eq!(tr.iter().filter(|t| (t.from, t.to) == (Mode::Held, Mode::Expired)).count(), 3);
    // The server comes back: leases return.
    w.net.set_up("s1", true);
    for _ in 0..40 {
        w.advance(Duration::from_secs(1));
        w.step(&mut c);
    }
    assert!(c.status().iter().all(|k| k.mode == Mode::Leased), "{:?}", c.status());
}

/// A driver sleeps until the action a wait names: the wait ends when a lease
/// expires or its hold ends, whatever the refresh schedule, so the new
/// capacity is applied on time by a sidecar that reads nothing in between.
#[test]
fn a_wait_ends_when_a_lease_lapses_and_when_its_hold_ends() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 50.0, OnExpiry::Safe)]);
    w.step(&mut c);
    let now = w.clock.now();
    let lease = c.lease_of("r").expect("leased");
    let hold_end = lease.expiry.saturating_add(lease.expiry.since(now));
    // Nothing else due for a long time (as with a refresh that backed off).
    c.set_next_refresh(hold_end.saturating_add(Duration::from_secs(3600)));
    assert_eq!(c.next_action(now), Action::Wait { until: lease.expiry });
    w.advance(lease.expiry.since(now));
    let now = w.clock.now();
    assert_eq!(c.next_action(now), Action::Wait { until: hold_end });
    assert_eq!(c.status()[0].mode, Mode::Held);
    w.advance(hold_end.since(now));
    let now = w.clock.now();
    assert_eq!(c.next_action(now), Action::Wait { until: c.next_refresh() });
    assert_eq!(c.status()[0].mode, Mode::Expired);
}

#[test]
fn refreshes_of_a_fleet_started_together_spread_out() {
    let w = World::new(&["s1"]);
    w.settle("s1", "r");
    let mut cores: Vec<Core> = (0..50).map(|i| w.core(&format!("client-{i}"), &["s1"])).collect();
    for c in &mut cores {
        c.set_demand(vec![demand("r", 1.0, OnExpiry::Safe)]);
        w.step(c);
    }
    let start = w.clock.now();
    // Run 30 s in 100 ms steps, recording when each client makes its second refresh.
    let mut second: Vec<Option<f64>> = vec![None; cores.len()];
    for _ in 0..300 {
        w.advance(Duration::from_millis(100));
        for (i, c) in cores.iter_mut().enumerate() {
            if w.step(c) > 0 && c.refreshes() == 3 {
                second[i] = Some(w.clock.now().since(start).as_secs_f64());
            }
        }
    }
    let times: Vec<f64> = second.into_iter().map(|t| t.expect("every client refreshed twice")).collect();
    let spread = times.iter().cloned().fold(f64::MIN, f64::max) - times.iter().cloned().fold(f64::MAX, f64::min);
    assert!(spread >= 12.0 / 3.0, "second refreshes spread over {spread:.2}s of a 12 s interval");
    assert!(times.iter().all(|t| (20.0..=28.0).contains(t)), "two intervals of 12 s ± 1/6: {times:?}");
}

#[test]
fn new_keys_refresh_early_but_not_faster_than_the_minimum_interval() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r1", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    w.advance(Duration::from_millis(300));
    c.set_demand(vec![demand("r1", 5.0, OnExpiry::Safe), demand("r2", 5.0, OnExpiry::Safe)]);
    assert_eq!(w.step(&mut c), 0, "within the minimum interval of the last request");
    w.advance(Duration::from_millis(700));
    assert_eq!(w.step(&mut c), 1, "one early refresh once the interval has passed");
    assert_eq!(c.status().iter().filter(|k| k.mode == Mode::Leased).count(), 2);
    // Pressure alone also triggers one.
    w.advance(Duration::from_secs(1));
    let mut d = demand("r1", 50.0, OnExpiry::Safe);
    d.pressure = true;
    c.set_demand(vec![d, demand("r2", 5.0, OnExpiry::Safe)]);
    assert_eq!(w.step(&mut c), 1);
    assert_eq!(cap(&mut c, w.clock.now(), "r1"), Capacity::Limited(50.0));
}

/// The times (seconds from `start`) at which `core` called, stepping the
/// clock by 250 ms for `secs` seconds with `demand` set before each step.
fn calls_over(w: &World, core: &mut Core, secs: u64, demand: impl Fn() -> Vec<KeyDemand>) -> Vec<f64> {
    let start = w.clock.now();
    let mut at = Vec::new();
    while w.clock.now().since(start) < Duration::from_secs(secs) {
        core.set_demand(demand());
        if w.step(core) > 0 {
            at.push(w.clock.now().since(start).as_secs_f64());
        }
        w.advance(Duration::from_millis(250));
    }
    at
}

#[test]
fn early_asks_under_pressure_back_off_when_the_server_has_nothing_more() {
    let w = World::new(&["s1"]);
    w.settle("s1", "r");
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 150.0, OnExpiry::Safe)]);
    w.step(&mut c);
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(100.0), "all there is");
    // Refusing all along: it asks 1 s, 2 s, 4 s and 8 s after its last ask,
    // then only when its refresh (12 s ± 1/6) is due.
    let pressed = || {
        let mut d = demand("r", 150.0, OnExpiry::Safe);
        d.pressure = true;
        vec![d]
    };
    let at = calls_over(&w, &mut c, 60, pressed);
    assert_eq!(at[..4], [1.0, 3.0, 7.0, 15.0], "{at:?}");
    let gaps: Vec<f64> = at.windows(2).map(|p| p[1] - p[0]).collect();
    assert!(gaps[3..].iter().all(|g| (10.0..=14.25).contains(g)), "then the refresh interval: {at:?}");
    assert!(at.len() <= 8, "60 s: four early asks and four refreshes at most: {at:?}");
}

#[test]
fn an_early_ask_that_gets_more_is_followed_by_another_at_once() {
    let w = World::new(&["s1"]);
    w.settle("s1", "r");
    let mut a = w.core("a", &["s1"]);
    let mut b = w.core("b", &["s1"]);
    a.set_demand(vec![demand("r", 70.0, OnExpiry::Safe)]);
    w.step(&mut a);
    b.set_demand(vec![demand("r", 70.0, OnExpiry::Safe)]);
    w.step(&mut b);
    assert_eq!(cap(&mut b, w.clock.now(), "r"), Capacity::Limited(30.0), "a holds 70");
    // a's demand falls to 20: it gives the rest back within a second, and
    // b, refusing, has its fair share (80) a second after that.
    let pressed = || {
        let mut d = demand("r", 90.0, OnExpiry::Safe);
        d.pressure = true;
        vec![d]
    };
    w.advance(Duration::from_secs(1));
    for _ in 0..12 {
        a.set_demand(vec![demand("r", 20.0, OnExpiry::Safe)]);
        w.step(&mut a);
        b.set_demand(pressed());
        w.step(&mut b);
        w.advance(Duration::from_millis(250));
    }
    assert_eq!(cap(&mut a, w.clock.now(), "r"), Capacity::Limited(20.0), "a gave back early");
    assert_eq!(cap(&mut b, w.clock.now(), "r"), Capacity::Limited(80.0), "b took it early");
}

#[test]
fn demand_a_little_below_the_lease_waits_for_the_refresh() {
    let w = World::new(&["s1"]);
    w.settle("s1", "r");
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r", 60.0, OnExpiry::Safe)]);
    w.step(&mut c);
    let at = calls_over(&w, &mut c, 9, || vec![demand("r", 60.0 * (1.0 - GIVE_BACK) + 0.1, OnExpiry::Safe)]);
    assert!(at.is_empty(), "{at:?}");
    let at = calls_over(&w, &mut c, 2, || vec![demand("r", 60.0 * (1.0 - GIVE_BACK) - 0.1, OnExpiry::Safe)]);
    assert_eq!(at, [0.0], "more than {GIVE_BACK} below: at once");
}

#[test]
fn dropped_keys_are_released_and_permanent_errors_back_off() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("r1", 70.0, OnExpiry::Safe), demand("r2", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    c.set_demand(vec![demand("r2", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    let leases = w.nodes["s1"].store.leases("r1").unwrap_or_default();
    assert!(leases.is_empty(), "r1 was released: {leases:?}");

    let mut bad = w.core("", &["s1"]);
    bad.set_demand(vec![demand("r", 1.0, OnExpiry::Safe)]);
    w.step(&mut bad);
    assert!(bad.last_error().unwrap().contains("InvalidArgument"), "{:?}", bad.last_error());
    assert!(bad.next_refresh().since(w.clock.now()) >= Duration::from_secs(15), "no tight retry loop");
    // Nor does a key made meanwhile bring the retry forward.
    w.advance(Duration::from_secs(2));
    bad.set_demand(vec![demand("r", 1.0, OnExpiry::Safe), demand("new", 1.0, OnExpiry::Safe)]);
    assert_eq!(w.step(&mut bad), 0, "a new key waits for the backoff while the servers refuse");
    let applied = bad.take_changes(w.clock.now(), &[], false);
    assert!(applied.iter().any(|(id, _)| id == "new"), "and follows on_expiry at once: {applied:?}");
}

/// A release that fails (its leases simply expire on the server) does not
/// count as the servers failing: keys still ask early.
#[test]
fn a_failed_release_does_not_hold_back_early_asks() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let keys = |n: usize| (0..n).map(|i| demand(&format!("k{i}"), 5.0, OnExpiry::Safe)).collect::<Vec<_>>();
    let mut warm = w.core("warm-up", &["s1"]);
    warm.set_demand(keys(5));
    w.step(&mut warm);
    w.advance(Duration::from_secs(12));
    c.set_demand(keys(6));
    w.step(&mut c);
    assert_eq!(c.lease_of("k5").unwrap().refresh_interval, Duration::from_secs(1), "a resource the server just met");
    c.on_release(w.clock.now(), Err(CallError::Transient("timed out".into())));
    assert!(c.last_error().unwrap().contains("release failed"));
    assert!(!c.failing());
    w.advance(Duration::from_millis(1200));
    match c.next_action(w.clock.now()) {
        Action::Refresh { request, .. } => {
            let ids: Vec<&str> = request.resource.iter().map(|r| r.resource_id.as_str()).collect();
            assert_eq!(ids, ["k5"], "the key whose lease asked for it, alone");
        }
        other => panic!("the key's own refresh waited: {other:?}"),
    }
}

#[test]
fn cached_leases_are_enforced_and_reported_as_has() {
    let w = World::new(&["s1"]);
    // A fresh master in learning mode hands back what a restarted client reports.
    let cfg = ResourcesConfig::parse("t", &CONFIG.replace("learning_mode_duration: 0", "learning_mode_duration: 30"))
        .unwrap();
    w.nodes["s1"].store.reload(cfg);
    w.nodes["s1"].store.become_master();
    let mut c = w.core("a", &["s1"]);
    let now = w.clock.now();
    let lease = Lease {
        capacity: 33.0,
        expiry: now.saturating_add(Duration::from_secs(20)),
        refresh_interval: Duration::from_secs(12),
    };
    c.preload(demand("r", 80.0, OnExpiry::Pessimistic), lease, now);
    c.delay_first_refresh(now, Duration::from_secs(12));
    assert_eq!(cap(&mut c, now, "r"), Capacity::Limited(33.0), "enforced at once");
    assert!(c.next_refresh() > now, "the first refresh is spread, not immediate");
    w.advance(Duration::from_secs(12));
    w.step(&mut c);
    assert_eq!(cap(&mut c, w.clock.now(), "r"), Capacity::Limited(33.0), "learning mode handed has back");
    assert_eq!(w.nodes["s1"].store.leases("r").unwrap()[0].has, 33.0);
}

#[test]
fn one_refresh_carries_every_key_whatever_their_number() {
    // 2,000 tenant keys of one client: one GetCapacity per refresh round,
    // not one per key, and each key leased by it.
    let w = World::new(&["s1"]);
    let mut c = w.core("many", &["s1"]);
    let keys = 2_000;
    c.set_demand((0..keys).map(|i| demand(&format!("tenant-{i}"), 1.0, OnExpiry::Safe)).collect());
    let Action::Discover { target } = c.next_action(w.clock.now()) else { panic!("discovers first") };
    c.on_discovery(w.clock.now(), &target, w.rt.block_on(w.net.discovery(&target)));
    let Action::Refresh { target, request } = c.next_action(w.clock.now()) else { panic!("then refreshes") };
    assert_eq!(request.resource.len(), keys, "every key in one request");
    // What a key costs on the wire: the server's message limit bounds the keys per client.
    let per_key = prost::Message::encoded_len(&request) as f64 / keys as f64;
    assert!(per_key < 40.0, "{per_key} bytes per key");
    c.on_refresh(w.clock.now(), w.rt.block_on(w.net.get_capacity(&target, request)));
    assert!(matches!(c.next_action(w.clock.now()), Action::Wait { .. }), "nothing more this round");
    let leased = c.capacities(w.clock.now()).iter().filter(|(_, cap)| *cap == Capacity::Limited(1.0)).count();
    assert_eq!(leased, keys);
    // The next round reports each key's lease too: still one request.
    w.advance(c.next_refresh().since(w.clock.now()));
    let Action::Refresh { request, .. } = c.next_action(w.clock.now()) else { panic!("refreshes again") };
    assert_eq!(request.resource.len(), keys);
    let per_key = prost::Message::encoded_len(&request) as f64 / keys as f64;
    assert!(per_key < 64.0, "{per_key} bytes per key with its lease");
}

/// `(id, capacity)` pairs as [`Core::take_changes`] returns them.
fn limited(v: &[(&str, f64)]) -> Vec<(String, Capacity)> {
    v.iter().map(|(id, c)| (id.to_string(), Capacity::Limited(*c))).collect()
}

#[test]
fn only_the_capacities_that_changed_come_back() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let now = w.clock.now();
    c.set_demand(vec![demand("a", 10.0, OnExpiry::Pessimistic), demand("b", 20.0, OnExpiry::Optimistic)]);
    assert_eq!(c.take_changes(now, &[], true), limited(&[("a", 0.0), ("b", 20.0)]), "new keys");
    assert_eq!(c.take_changes(now, &[], true), vec![], "nothing changed since");
    // New demand moves the optimistic key's on_expiry capacity, not the pessimistic one's.
    c.set_demand(vec![demand("a", 11.0, OnExpiry::Pessimistic), demand("b", 25.0, OnExpiry::Optimistic)]);
    assert_eq!(c.take_changes(now, &[], true), limited(&[("b", 25.0)]));
    // Keys asked for come back changed or not; unknown ones do not.
    assert_eq!(c.take_changes(now, &["a".into(), "zz".into()], true), limited(&[("a", 0.0)]));
    // During start-up a key with no lease yet is kept for a later call.
    let three = || {
        vec![
            demand("a", 11.0, OnExpiry::Pessimistic),
            demand("b", 25.0, OnExpiry::Optimistic),
            demand("c", 5.0, OnExpiry::Optimistic),
        ]
    };
    c.set_demand(three());
    assert_eq!(c.take_changes(now, &[], false), vec![], "pending keys wait");
    assert_eq!(c.take_changes(now, &[], true), limited(&[("c", 5.0)]), "and come back once it is over");
    // Leases arrive: only the key whose capacity moved (0 → 11) comes back;
    // the optimistic ones were already enforcing what they are granted.
    w.step(&mut c);
    assert_eq!(c.lease_of("b").map(|l| l.capacity), Some(25.0));
    assert_eq!(c.take_changes(w.clock.now(), &[], true), limited(&[("a", 11.0)]));
    c.set_demand(three());
    assert_eq!(c.take_changes(w.clock.now(), &[], true), vec![], "the same demand again changes nothing");
    // Past the lease and its hold, every key falls to its on_expiry.
    let expiry = c.lease_of("a").unwrap().expiry;
    w.advance(expiry.since(now) * 2 + Duration::from_secs(1));
    assert_eq!(c.take_changes(w.clock.now(), &[], true), limited(&[("a", 0.0), ("b", 25.0), ("c", 5.0)]));
    // After a rebuild every key comes back; a key dropped meanwhile does not.
    c.mark_all_changed();
    c.set_demand(vec![demand("a", 11.0, OnExpiry::Pessimistic), demand("c", 5.0, OnExpiry::Optimistic)]);
    assert_eq!(c.take_changes(w.clock.now(), &[], true), limited(&[("a", 0.0), ("c", 5.0)]));
}

/// An update that follows a rebuild of the enforcement side brings every
/// key's capacity back once more, changed or not; a key removed before it
/// is taken was does not come back.
#[test]
fn a_rebuilt_update_brings_every_capacity_back() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let now = w.clock.now();
    let ab = || vec![demand("a", 10.0, OnExpiry::Optimistic), demand("b", 20.0, OnExpiry::Optimistic)];
    c.set_demand(ab());
    assert_eq!(c.take_changes(now, &[], true), limited(&[("a", 10.0), ("b", 20.0)]));
    c.update_demand(DemandUpdate { changed: ab(), removed: vec![], complete: true, rebuilt: false });
    assert_eq!(c.take_changes(now, &[], true), vec![], "the same demand, nothing rebuilt");
    c.update_demand(DemandUpdate { changed: ab(), removed: vec![], complete: true, rebuilt: true });
    c.update_demand(partial(vec![], &["b"]));
    assert_eq!(c.take_changes(now, &[], true), limited(&[("a", 10.0)]));
}

fn partial(changed: Vec<KeyDemand>, removed: &[&str]) -> DemandUpdate {
    DemandUpdate { changed, removed: removed.iter().map(|s| s.to_string()).collect(), complete: false, rebuilt: false }
}

#[test]
fn a_partial_update_keeps_the_demand_of_the_keys_it_leaves_out_and_releases_those_it_removes() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("a", 10.0, OnExpiry::Optimistic), demand("b", 20.0, OnExpiry::Optimistic)]);
    w.step(&mut c);
    let wants = |c: &Core| c.status().into_iter().map(|k| (k.resource_id, k.wants)).collect::<Vec<_>>();
    c.update_demand(partial(vec![demand("b", 30.0, OnExpiry::Optimistic)], &[]));
    assert_eq!(wants(&c), [("a".to_string(), 10.0), ("b".to_string(), 30.0)]);
    assert!(matches!(c.next_action(w.clock.now()), Action::Wait { .. }), "nothing to release");
    // A removal releases the key (an unknown one is ignored).
    c.update_demand(partial(vec![], &["a", "zz"]));
    assert_eq!(wants(&c), [("b".to_string(), 30.0)]);
    match c.next_action(w.clock.now()) {
        Action::Release { request, .. } => assert_eq!(request.resource_id, ["a"]),
        a => panic!("{a:?}"),
    }
    // A complete update drops every key it does not name.
    c.set_demand(vec![demand("c", 1.0, OnExpiry::Optimistic)]);
    match c.next_action(w.clock.now()) {
        Action::Release { request, .. } => assert_eq!(request.resource_id, ["b"]),
        a => panic!("{a:?}"),
    }
}

/// A key asks early while its demand is away from its lease; once the lease
/// came to it, it stops, though no update named it again.
#[test]
fn a_key_left_out_of_updates_stops_asking_early_once_its_lease_follows_its_demand() {
    let w = World::new(&["s1"]);
    w.settle("s1", "b");
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("b", 20.0, OnExpiry::Optimistic)]);
    w.step(&mut c);
    assert_eq!(c.lease_of("b").map(|l| l.capacity), Some(20.0));
    // Far below its lease: it gives the rest back after the minimum interval.
    c.update_demand(partial(vec![demand("b", 5.0, OnExpiry::Optimistic)], &[]));
    w.advance(Duration::from_secs(1));
    assert_eq!(w.step(&mut c), 1, "an early ask");
    assert_eq!(c.lease_of("b").map(|l| l.capacity), Some(5.0));
    for _ in 0..5 {
        c.update_demand(partial(vec![], &[]));
        w.advance(Duration::from_secs(1));
        assert_eq!(w.step(&mut c), 0, "no more early asks: the lease is what it wants");
    }
}

/// The next lapse is kept as keys come and go: a wait ends when the
/// earliest remaining lease expires, not when a forgotten one would have.
#[test]
fn a_wait_ends_at_the_lapse_of_the_keys_still_there() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let now = w.clock.now();
    let lease = |s: u64| Lease {
        capacity: 5.0,
        expiry: now.saturating_add(Duration::from_secs(s)),
        refresh_interval: Duration::from_secs(5),
    };
    c.preload(demand("a", 5.0, OnExpiry::Safe), lease(10), now);
    c.preload(demand("b", 5.0, OnExpiry::Safe), lease(20), now);
    c.preload(demand("c", 5.0, OnExpiry::Safe), lease(30), now);
    c.set_next_refresh(now.saturating_add(Duration::from_secs(3600)));
    assert_eq!(c.next_action(now), Action::Wait { until: lease(10).expiry });
    c.update_demand(partial(vec![], &["a"]));
    assert_eq!(c.next_action(now), Action::Wait { until: lease(20).expiry }, "a is gone");
    // A cached lease is not held: past its expiry the key follows on_expiry.
    w.advance(Duration::from_secs(20));
    assert_eq!(c.next_action(w.clock.now()), Action::Wait { until: lease(30).expiry });
    let modes: Vec<Mode> = c.status().iter().map(|k| k.mode).collect();
    assert_eq!(modes, [Mode::Expired, Mode::Leased]);
    assert_eq!(c.take_changes(w.clock.now(), &[], true), limited(&[("b", 2.0), ("c", 5.0)]));
}

/// A key with no lease keeps the capacity it was made with until a request
/// that carried it is answered (or a call fails): a new key, or the request
/// that made it, is not refused at `on_expiry` for the round trip its lease
/// takes. A key made while a request is in flight waits for its own.
#[test]
fn a_new_key_falls_to_on_expiry_only_once_a_request_for_it_was_answered() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("a", 10.0, OnExpiry::Pessimistic)]);
    assert_eq!(c.take_changes(w.clock.now(), &[], false), vec![], "not asked yet");
    w.step(&mut c);
    assert_eq!(c.take_changes(w.clock.now(), &[], false), limited(&[("a", 10.0)]), "leased");

    // b arrives while a request (carrying a only) is in flight.
    w.advance(Duration::from_secs(15));
    let Action::Refresh { target, request } = c.next_action(w.clock.now()) else { panic!("a refresh is due") };
    c.set_demand(vec![demand("a", 10.0, OnExpiry::Pessimistic), demand("b", 5.0, OnExpiry::Pessimistic)]);
    assert_eq!(c.take_changes(w.clock.now(), &[], false), vec![], "b waits for a request of its own");
    let answer = w.rt.block_on(w.net.get_capacity(&target, request));
    c.on_refresh(w.clock.now(), answer);
    assert_eq!(c.take_changes(w.clock.now(), &[], false), vec![], "an answer that did not carry b");
    // b's own request (after the minimum interval) fails: b falls to its on_expiry.
    w.advance(Duration::from_secs(2));
    let Action::Refresh { target, .. } = c.next_action(w.clock.now()) else { panic!("b asks at once") };
    c.on_refresh(w.clock.now(), Err(CallError::Transient(format!("{target}: refused"))));
    assert_eq!(c.take_changes(w.clock.now(), &[], false), limited(&[("b", 0.0)]), "settled by the failure");
    // A key made while the servers fail follows its on_expiry at once.
    c.set_demand(vec![demand("c", 5.0, OnExpiry::Pessimistic)]);
    assert_eq!(c.take_changes(w.clock.now(), &[], false), limited(&[("c", 0.0)]), "made during an outage");
    // `force_pending`: the start-up wait is over while the first call hangs.
    let mut fresh = w.core("f", &["s1"]);
    fresh.set_demand(vec![demand("d", 5.0, OnExpiry::Pessimistic)]);
    assert_eq!(fresh.take_changes(w.clock.now(), &[], false), vec![]);
    assert_eq!(fresh.take_changes(w.clock.now(), &[], true), limited(&[("d", 0.0)]));
}

/// An early refresh carries only the keys that ask early (a new key, a key
/// whose demand moved); the regular refresh carries every key, when it is
/// due: an early answer never puts it back.
#[test]
fn an_early_refresh_carries_only_the_keys_that_ask_early() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let keys = |n: usize| (0..n).map(|i| demand(&format!("k{i}"), 5.0, OnExpiry::Safe)).collect::<Vec<_>>();
    // Resources the server has known for a refresh interval: their leases
    // carry the interval of 12 s, not the second of new ones.
    let mut warm = w.core("warm-up", &["s1"]);
    warm.set_demand(keys(51));
    w.step(&mut warm);
    w.advance(Duration::from_secs(12));
    c.set_demand(keys(50));
    w.step(&mut c);
    let first = c.lease_of("k0").unwrap();
    assert_eq!(first.refresh_interval, Duration::from_secs(12));
    let regular = c.next_refresh();
    let carried = |a: &Action| match a {
        Action::Refresh { request, .. } => request.resource.iter().map(|r| r.resource_id.clone()).collect::<Vec<_>>(),
        other => panic!("expected a refresh, got {other:?}"),
    };
    // A new key, after the minimum interval: asked for alone.
    w.advance(Duration::from_secs(2));
    c.set_demand(keys(51));
    let a = c.next_action(w.clock.now());
    assert_eq!(carried(&a), ["k50"]);
    let Action::Refresh { target, request } = a else { unreachable!() };
    let answer = w.rt.block_on(w.net.get_capacity(&target, request));
    c.on_refresh(w.clock.now(), answer);
    assert_eq!(c.lease_of("k50").map(|l| l.capacity), Some(5.0));
    assert_eq!(c.next_refresh(), regular, "an early answer does not move every key's refresh");
    // A key whose demand moved asks early, alone too.
    w.advance(Duration::from_secs(2));
    let mut moved = keys(51);
    moved[7].wants = 1.0;
    c.set_demand(moved.clone());
    let a = c.next_action(w.clock.now());
    assert_eq!(carried(&a), ["k7"]);
    let Action::Refresh { target, request } = a else { unreachable!() };
    let answer = w.rt.block_on(w.net.get_capacity(&target, request));
    c.on_refresh(w.clock.now(), answer);
    assert_eq!(c.lease_of("k7").map(|l| l.capacity), Some(1.0));
    assert_eq!(c.next_refresh(), regular, "nor does a second one");
    // A new key within the minimum interval of every key's refresh: that
    // refresh goes now, with every key.
    w.advance(regular.since(w.clock.now()).saturating_sub(Duration::from_millis(500)));
    moved.push(demand("k51", 5.0, OnExpiry::Safe));
    c.set_demand(moved.clone());
    assert_eq!(carried(&c.next_action(w.clock.now())).len(), 52, "every key, half a second early");
    assert!(w.clock.now() < first.expiry, "every key refreshed before its lease ran out");
}

/// A lease that asks to hear from its key within a second (a server that
/// has just met the resource, while its clients are arriving) brings that
/// key's next ask forward, not the refresh of every key: tenants new to a
/// shared server cost one resource a call each, and join the refresh of
/// every key once the server settles on them. Three clients, three draws of
/// the jitter.
#[test]
fn a_lease_that_asks_soon_brings_forward_its_own_key_only() {
    for client in ["a", "b", "c"] {
        let w = World::new(&["s1"]);
        let mut c = w.core(client, &["s1"]);
        let keys = |n: usize| (0..n).map(|i| demand(&format!("k{i}"), 5.0, OnExpiry::Safe)).collect::<Vec<_>>();
        let mut warm = w.core("warm-up", &["s1"]);
        warm.set_demand(keys(50));
        w.step(&mut warm);
        w.advance(Duration::from_secs(12));
        // The first refresh carries fifty keys the server knows and one it does not.
        let start = w.clock.now();
        c.set_demand(keys(51));
        w.step(&mut c);
        assert_eq!(c.lease_of("k0").unwrap().refresh_interval, Duration::from_secs(12));
        assert_eq!(c.lease_of("k50").unwrap().refresh_interval, Duration::from_secs(1));
        let regular = c.next_refresh();
        let asks_at = |c: &Core, id: &str| c.status().into_iter().find(|k| k.resource_id == id).unwrap().asks_at;
        assert!(asks_at(&c, "k50").is_some_and(|t| t < regular.as_secs()), "status shows k50's own refresh");
        assert_eq!(asks_at(&c, "k0"), None);
        assert!(
            regular.since(w.clock.now()) >= Duration::from_secs(9),
            "{client}: every key's refresh follows the 12 s leases, not the new key's second: {:?}",
            regular.since(w.clock.now())
        );
        // For 40 s: the new keys ask on their own (a second one comes with
        // an early call) until every key's refresh comes, when it is due.
        let mut calls: Vec<(Duration, Vec<String>)> = Vec::new();
        while w.clock.now().since(start) < Duration::from_secs(40) {
            assert!(calls.len() < 80, "{client}: too many calls: {calls:?}");
            if calls.len() == 3 && c.lease_of("k51").is_none() {
                c.set_demand(keys(52));
            }
            match c.next_action(w.clock.now()) {
                Action::Wait { until } => {
                    assert!(until > w.clock.now(), "{client}: a wait that is over before it starts");
                    w.advance(until.since(w.clock.now()));
                }
                Action::Refresh { target, request } => {
                    let ids: Vec<String> = request.resource.iter().map(|r| r.resource_id.clone()).collect();
                    let answer = w.rt.block_on(w.net.get_capacity(&target, request));
                    c.on_refresh(w.clock.now(), answer);
                    calls.push((w.clock.now().since(start), ids));
                }
                other => panic!("{client}: unexpected {other:?}"),
            }
        }
        assert!(
            calls.windows(2).all(|p| p[1].0 >= p[0].0 + Duration::from_secs(1)),
            "{client}: calls at least the minimum interval apart: {calls:?}"
        );
        let full = calls.iter().position(|(_, ids)| ids.len() == 52).expect("a refresh of every key");
        let (before, after) = calls.split_at(full);
        assert!(before.len() >= 5, "{client}: the new keys asked about once a second: {calls:?}");
        assert!(
            before.iter().all(|(_, ids)| ids.iter().all(|id| id == "k50" || id == "k51")),
            "{client}: only the new keys asked early: {calls:?}"
        );
        assert!(before.iter().any(|(_, ids)| ids.iter().any(|id| id == "k51")), "{client}: {calls:?}");
        // Within the minimum interval of when it was due (a key due by then
        // brings it that much forward), not later.
        let due = regular.since(start);
        assert!(
            after[0].0 + Duration::from_secs(1) >= due && after[0].0 <= due,
            "{client}: every key's refresh at {:?}, due at {due:?}",
            after[0].0
        );
        // Once the server has settled on them (it has known k51, made at
        // about 3 s, for 12 s), the new keys ask with the others: from 20 s
        // on every call carries every key.
        let late: Vec<_> = after.iter().filter(|(t, _)| *t >= Duration::from_secs(20)).collect();
        assert!(!late.is_empty(), "{client}: {calls:?}");
        assert!(
            late.iter().all(|(_, ids)| ids.len() == 52),
            "{client}: the new keys joined every key's refresh: {calls:?}"
        );
        assert_eq!(c.lease_of("k50").unwrap().refresh_interval, Duration::from_secs(12), "{client}");
    }
}

/// A lease that runs out before its refresh interval is over (an
/// intermediate caps its clients' leases at its own lease's expiry; a server
/// with no lease from its parent answers with one already expired) makes
/// its own key ask before then, not every key.
#[test]
fn a_lease_that_runs_out_early_brings_forward_its_own_key_only() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("a", 5.0, OnExpiry::Safe), demand("b", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    w.advance(c.next_refresh().since(w.clock.now()));
    let Action::Refresh { request, .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
    assert_eq!(request.resource.len(), 2);
    let now = w.clock.now();
    let lease = |id: &str, expires_in: u64| proto::ResourceResponse {
        pooled: None,
        bucket: None,
        allotment: None,
        credit: None,
        resource_capacity: None,
        spare: None,
        share_safe: None,
        fresh: None,
        upstream_quota: None,
        resource_id: id.into(),
        gets: proto::Lease {
            capacity: 5.0,
            expiry_time: now.saturating_add(Duration::from_secs(expires_in)).as_secs(),
            refresh_interval: 12,
        },
        safe_capacity: None,
        template: None,
    };
    let answer = proto::GetCapacityResponse { response: vec![lease("a", 30), lease("b", 4)], mastership: None };
    c.on_refresh(now, Ok(answer));
    assert!(
        c.next_refresh().since(now) >= Duration::from_secs(9),
        "every key's refresh follows a's 12 s, not b's expiry: {:?}",
        c.next_refresh().since(now)
    );
    w.advance(Duration::from_millis(3600));
    match c.next_action(w.clock.now()) {
        Action::Refresh { request, .. } => {
            let ids: Vec<&str> = request.resource.iter().map(|r| r.resource_id.as_str()).collect();
            assert_eq!(ids, ["b"], "b asks before its lease runs out, alone");
        }
        other => panic!("b waited past its lease's end: {other:?}"),
    }
    // A lease that lasts its interval (10 s and 10 s, the shortest a
    // server allows) is not cut short, whatever the draw of the jitter:
    // with one that asks within a second, every key's refresh follows it.
    for client in ["a", "b", "c", "d"] {
        let mut c = w.core(client, &["s1"]);
        c.set_demand(vec![demand("a", 5.0, OnExpiry::Safe), demand("b", 5.0, OnExpiry::Safe)]);
        w.step(&mut c);
        w.advance(c.next_refresh().since(w.clock.now()));
        let Action::Refresh { .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
        let now = w.clock.now();
        let lease = |id: &str, interval: i64| proto::ResourceResponse {
            pooled: None,
            bucket: None,
            allotment: None,
            credit: None,
            resource_capacity: None,
            spare: None,
            share_safe: None,
            fresh: None,
            upstream_quota: None,
            resource_id: id.into(),
            gets: proto::Lease {
                capacity: 5.0,
                expiry_time: now.saturating_add(Duration::from_secs(11)).as_secs(),
                refresh_interval: interval,
            },
            safe_capacity: None,
            template: None,
        };
        c.on_refresh(
            now,
            Ok(proto::GetCapacityResponse { response: vec![lease("a", 10), lease("b", 1)], mastership: None }),
        );
        let regular = c.next_refresh().since(now);
        assert!(regular >= Duration::from_secs(8), "{client}: every key's refresh at {regular:?}, not b's second");
    }
}

/// An answer whose lease for a key is malformed (capacity NaN, infinite or
/// negative; safe capacity NaN or below -1), or that names a key twice, is
/// refused for that key: it goes on as if the answer had left it out (its
/// lease, or its `on_expiry`), says why, and the other keys take theirs.
#[test]
fn a_malformed_or_repeated_lease_in_an_answer_is_refused_for_its_key() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let ids = ["nan", "inf", "neg", "safe-nan", "safe-neg", "dup", "good", "unlimited-safe"];
    c.set_demand(ids.iter().map(|id| demand(id, 5.0, OnExpiry::Safe)).collect());
    w.step(&mut c);
    for id in ids {
        assert_eq!(cap(&mut c, w.clock.now(), id), Capacity::Limited(5.0), "{id}: leased");
    }
    let first = c.lease_of("nan").unwrap();
    c.take_transitions();
    // A key whose first answer is refused has no lease to keep.
    c.update_demand(DemandUpdate {
        changed: vec![demand("new", 5.0, OnExpiry::Safe)],
        removed: vec![],
        complete: false,
        rebuilt: false,
    });
    w.advance(c.next_refresh().since(w.clock.now()));
    let Action::Refresh { target, .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
    let now = w.clock.now();
    let lease = |id: &str, capacity: f64, safe: Option<f64>| proto::ResourceResponse {
        pooled: None,
        bucket: None,
        allotment: None,
        credit: None,
        resource_capacity: None,
        spare: None,
        share_safe: None,
        fresh: None,
        upstream_quota: None,
        resource_id: id.into(),
        gets: proto::Lease {
            capacity,
            expiry_time: now.saturating_add(Duration::from_secs(30)).as_secs(),
            refresh_interval: 12,
        },
        safe_capacity: safe,
        template: None,
    };
    let answer = proto::GetCapacityResponse {
        response: vec![
            lease("nan", f64::NAN, None),
            lease("inf", f64::INFINITY, None),
            lease("neg", -5.0, None),
            lease("safe-nan", 7.0, Some(f64::NAN)),
            lease("safe-neg", 7.0, Some(-5.0)),
            lease("dup", 5.0, None),
            lease("good", 7.0, Some(3.0)),
            lease("unlimited-safe", 7.0, Some(-1.0)),
            lease("dup", 999.0, None),
            lease("new", f64::NAN, None),
        ],
        mastership: None,
    };
    let refused = c.on_refresh(now, Ok(answer));
    let mut refused_ids: Vec<&str> = refused.iter().map(|r| r.resource_id.as_str()).collect();
    refused_ids.sort();
    assert_eq!(refused_ids, ["dup", "inf", "nan", "neg", "new", "safe-nan", "safe-neg"]);
    let status: HashMap<String, KeyStatus> = c.status().into_iter().map(|k| (k.resource_id.clone(), k)).collect();
    let error = |id: &str| status[id].last_error.clone().unwrap_or_default();
    for (id, why) in [
        ("nan", "gets.capacity must be a finite number >= 0, got NaN"),
        ("inf", "gets.capacity must be a finite number >= 0, got inf"),
        ("neg", "gets.capacity must be a finite number >= 0, got -5"),
        ("safe-nan", "safe_capacity must be -1 (unlimited), 0 (stop) or a positive capacity, got NaN"),
        ("safe-neg", "safe_capacity must be -1 (unlimited), 0 (stop) or a positive capacity, got -5"),
        ("dup", "resource `dup` appears more than once in one answer"),
    ] {
        assert_eq!(error(id), format!("lease for `{id}` from {target} refused: {why}"), "{id}");
        assert!(refused.iter().any(|r| r.resource_id == id && r.message == error(id)), "{id}: {refused:?}");
        // As if the answer had not named it: the lease it had, unexpired.
        assert_eq!(status[id].mode, Mode::Leased, "{id}");
        assert_eq!(cap(&mut c, now, id), Capacity::Limited(5.0), "{id} keeps its lease");
        assert_eq!(c.lease_of(id), Some(first), "{id}");
    }
    for id in ["good", "unlimited-safe"] {
        assert_eq!(cap(&mut c, now, id), Capacity::Limited(7.0), "{id} takes its new lease");
        assert_eq!(status[id].last_error, None, "{id}");
    }
    assert_eq!(status["good"].safe_capacity, Some(3.0));
    // A new key refused its first lease follows its on_expiry (safe: the configured 2).
    assert_eq!((status["new"].mode, cap(&mut c, now, "new")), (Mode::Pending, Capacity::Limited(2.0)));
    assert!(error("new").contains("got NaN"), "{}", error("new"));
    let last = c.last_error().unwrap_or_default().to_string();
    assert!(last.starts_with("lease for `") && last.ends_with("(and 6 more leases refused)"), "{last}");
    assert!(!c.failing(), "the call itself succeeded");
    // No mode changed: the refused keys made no transition.
    assert!(c.take_transitions().iter().all(|t| t.resource_id == "new"), "only the new key may settle");

    // The refused keys keep their lease until it runs out, then are held, as without an answer.
    w.advance(first.expiry.since(now));
    let now = w.clock.now();
    assert_eq!(c.status().iter().find(|k| k.resource_id == "nan").unwrap().mode, Mode::Leased);
    c.capacities(now);
    assert_eq!(c.status().iter().find(|k| k.resource_id == "nan").unwrap().mode, Mode::Held);
    assert_eq!(c.status().iter().find(|k| k.resource_id == "good").unwrap().mode, Mode::Leased);

    // The next good answer clears the errors.
    w.step(&mut c);
    assert_eq!(c.last_error(), None);
    assert!(c.status().iter().all(|k| k.last_error.is_none() && k.mode == Mode::Leased), "{:?}", c.status());
}

#[test]
fn a_key_at_zero_says_why_and_one_above_says_nothing() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    let no_safe = |id: &str, wants: f64, on_expiry| KeyDemand { safe_capacity: None, ..demand(id, wants, on_expiry) };
    c.set_demand(vec![
        no_safe("unsafe", 5.0, OnExpiry::Safe),
        demand("pes", 5.0, OnExpiry::Pessimistic),
        no_safe("nothing", 0.0, OnExpiry::Optimistic),
        demand("some", 5.0, OnExpiry::Safe),
    ]);
    assert_eq!(c.zero_reason("unsafe"), Some(ZeroReason::NO_LEASE_NO_SAFE));
    assert_eq!(c.zero_reason("pes"), Some(ZeroReason::PESSIMISTIC));
    assert_eq!(c.zero_reason("nothing"), Some(ZeroReason::WANTS_ZERO));
    assert_eq!(c.zero_reason("some"), None, "its safe capacity is 2");
    w.step(&mut c);
    assert_eq!(c.zero_reason("nothing"), Some(ZeroReason::LEASE_ZERO), "it asked for 0 and got it");
    for k in ["unsafe", "pes", "some"] {
        assert_eq!(c.zero_reason(k), None, "{k} is leased 5");
    }
    let status = c.status();
    let nothing = status.iter().find(|k| k.resource_id == "nothing").unwrap();
    assert_eq!(nothing.zero_reason, Some(ZeroReason::LEASE_ZERO));
}

/// From a server that does not say its safe capacity is a share (a Doorman
/// server), a lease below its safe capacity is
/// held a jittered refresh interval longer than it was granted for, so that
/// another client's lease, granted up to a refresh later and held as long
/// again, has ended before this one runs on its share. A lease at or above
/// its safe capacity is held as long as it was granted for, as before.
#[test]
fn a_lease_below_its_safe_capacity_is_held_a_refresh_interval_longer() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("idle", 0.0, OnExpiry::Safe), demand("busy", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    w.advance(c.next_refresh().since(w.clock.now()));
    let Action::Refresh { .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
    let now = w.clock.now();
    let lease = |id: &str, capacity: f64| proto::ResourceResponse {
        pooled: None,
        bucket: None,
        allotment: None,
        credit: None,
        resource_capacity: None,
        spare: None,
        share_safe: None,
        fresh: None,
        upstream_quota: None,
        resource_id: id.into(),
        gets: proto::Lease {
            capacity,
            expiry_time: now.saturating_add(Duration::from_secs(30)).as_secs(),
            refresh_interval: 12,
        },
        safe_capacity: Some(5.0),
        template: None,
    };
    let answer =
        proto::GetCapacityResponse { response: vec![lease("idle", 0.0), lease("busy", 5.0)], mastership: None };
    assert!(c.on_refresh(now, Ok(answer)).is_empty());
    c.set_next_refresh(now.saturating_add(Duration::from_secs(3600)));
    let expiry = c.lease_of("idle").unwrap().expiry;
    let held = expiry.since(now);
    let mode = |c: &Core, id: &str| c.status().into_iter().find(|k| k.resource_id == id).unwrap().mode;
    w.advance(expiry.since(now) + held - Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!((mode(&c, "idle"), mode(&c, "busy")), (Mode::Held, Mode::Held));
    w.advance(Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!((mode(&c, "idle"), mode(&c, "busy")), (Mode::Held, Mode::Expired), "the lease at its safe capacity");
    // 12 s × (1 + 1/6) later.
    w.advance(Duration::from_secs(14) - Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!(mode(&c, "idle"), Mode::Held);
    w.advance(Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!(mode(&c, "idle"), Mode::Expired);
    assert_eq!(cap(&mut c, w.clock.now(), "idle"), Capacity::Limited(5.0), "then its share");
}

/// A lapsed lease with `on_expiry: safe` whose safe capacity is its share
/// (an usher server's default) is held for a jittered refresh
/// interval (and a second), whatever the lease length, at the lease or the
/// safe capacity, whichever is less: an idle key holding 0 runs on its
/// share a refresh interval after its expiry (never a lease length later),
/// and a busy key holding more than its share comes down to it at once. So
/// whoever falls back, the fleet stays within the sum of the leases, then
/// of the shares.
#[test]
fn a_lapsed_lease_is_held_a_refresh_interval_at_no_more_than_its_safe_capacity() {
    let w = World::new(&["s1"]);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("idle", 0.0, OnExpiry::Safe), demand("busy", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    w.advance(c.next_refresh().since(w.clock.now()));
    let Action::Refresh { .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
    let now = w.clock.now();
    let lease = |id: &str, capacity: f64| proto::ResourceResponse {
        pooled: None,
        bucket: None,
        allotment: None,
        credit: None,
        resource_capacity: None,
        spare: None,
        share_safe: Some(true),
        fresh: None,
        upstream_quota: None,
        resource_id: id.into(),
        gets: proto::Lease {
            capacity,
            expiry_time: now.saturating_add(Duration::from_secs(60)).as_secs(),
            refresh_interval: 12,
        },
        safe_capacity: Some(5.0),
        template: None,
    };
    let answer =
        proto::GetCapacityResponse { response: vec![lease("idle", 0.0), lease("busy", 30.0)], mastership: None };
    assert!(c.on_refresh(now, Ok(answer)).is_empty());
    c.set_next_refresh(now.saturating_add(Duration::from_secs(3600)));
    let expiry = c.lease_of("idle").unwrap().expiry;
    let mode = |c: &Core, id: &str| c.status().into_iter().find(|k| k.resource_id == id).unwrap().mode;
    w.advance(expiry.since(now));
    w.step(&mut c);
    let at = w.clock.now();
    assert_eq!((mode(&c, "idle"), mode(&c, "busy")), (Mode::Held, Mode::Held));
    assert_eq!(cap(&mut c, at, "idle"), Capacity::Limited(0.0), "held at its lease, below its safe capacity");
    assert_eq!(cap(&mut c, at, "busy"), Capacity::Limited(5.0), "held at its safe capacity, below its lease");
    // 12 s × (1 + 1/6) and a second later, not 60 s.
    w.advance(Duration::from_secs(15) - Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!(mode(&c, "idle"), Mode::Held);
    w.advance(Duration::from_millis(1));
    w.step(&mut c);
    assert_eq!((mode(&c, "idle"), mode(&c, "busy")), (Mode::Expired, Mode::Expired));
    assert_eq!(cap(&mut c, w.clock.now(), "idle"), Capacity::Limited(5.0), "then its share");
    assert_eq!(cap(&mut c, w.clock.now(), "busy"), Capacity::Limited(5.0));
}

/// Spare capacity (what nobody wants, handed out beside the grants) is not
/// given back early: a key whose demand is far below its lease only because
/// of spare waits for its refresh. A key whose demand rises gets the share
/// kept free at once, and the rest once the others' refreshes give back
/// their spare.
#[test]
fn spare_capacity_is_kept_until_the_refresh_and_a_rise_finds_some_at_once() {
    let w = World::with(&["s1"], SPARE);
    let (mut a, mut b) = (w.core("a", &["s1"]), w.core("b", &["s1"]));
    // Past a new resource's first refresh interval (12 s), while its clients arrive.
    for _ in 0..56 {
        a.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
        w.step(&mut a);
        b.set_demand(vec![demand("r", 20.0, OnExpiry::Safe)]);
        w.step(&mut b);
        w.advance(Duration::from_millis(250));
    }
    let Capacity::Limited(la) = cap(&mut a, w.clock.now(), "r") else { panic!("a is limited") };
    assert!(la > 15.0, "a holds its 10 and spare beside it: {la}");
    // A lease carrying spare refreshes every 3 s (not 12): never earlier.
    let at = calls_over(&w, &mut a, 9, || vec![demand("r", 10.0, OnExpiry::Safe)]);
    assert!(
        at.windows(2).all(|w| w[1] - w[0] >= 3.0 * 5.0 / 6.0),
        "a key holding spare asks no earlier than its refresh: {at:?}"
    );
    // b's demand rises above what is free: it gets the share kept free at once.
    let Capacity::Limited(before) = cap(&mut b, w.clock.now(), "r") else { panic!("b is limited") };
    b.set_demand(vec![KeyDemand { pressure: true, ..demand("r", 85.0, OnExpiry::Safe) }]);
    w.step(&mut b);
    let Capacity::Limited(after) = cap(&mut b, w.clock.now(), "r") else { panic!("b is limited") };
    assert!(after > before + 1.0, "the free share at once: {before} -> {after}");
    // Once a refreshes (it gives its spare back), b reaches all but a's 10 within a refresh interval.
    for _ in 0..60 {
        w.advance(Duration::from_millis(250));
        a.set_demand(vec![demand("r", 10.0, OnExpiry::Safe)]);
        w.step(&mut a);
        b.set_demand(vec![KeyDemand { pressure: true, ..demand("r", 85.0, OnExpiry::Safe) }]);
        w.step(&mut b);
    }
    let (Capacity::Limited(la), Capacity::Limited(lb)) =
        (cap(&mut a, w.clock.now(), "r"), cap(&mut b, w.clock.now(), "r"))
    else {
        panic!("both limited")
    };
    assert!(lb >= 85.0 && la <= 15.0, "b has what it wants, a its 10 and a little spare: a {la}, b {lb}");
    assert!(la + lb <= 100.0 + 1e-9);
}

/// A calendar quota of 120 a minute, as allotments.
const CALENDAR: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 120/min\n    window: calendar\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15, learning_mode_duration: 0 }\n";

/// A key whose lease carries an allotment hands it to the enforcement side,
/// reports its account with its requests (the answer's allotment carries
/// the account's mark back), and asks again within 300 ms of each unit's
/// reset, however recently it asked before it.
#[test]
fn a_calendar_key_reports_its_account_and_asks_just_after_each_reset() {
    let w = World::with(&["s1"], CALENDAR);
    let mut c = w.core("a", &["s1"]);
    c.set_demand(vec![demand("cal", 5.0, OnExpiry::Safe)]);
    w.step(&mut c);
    let first = c.take_allotments();
    let [(id, Some(a))] = &first[..] else { panic!("one allotment: {first:?}") };
    let reset = a.reset;
    assert_eq!((id.as_str(), a.mark), ("cal", None), "its first request carried no account");
    assert_eq!(reset.as_secs() % 60, 0, "a minute's reset: {reset:?}");
    let mut sent: Vec<(Time, proto::GetCapacityRequest, f64)> = Vec::new();
    let mut mark = 0.0;
    let last_call = reset.saturating_sub(Duration::from_millis(150));
    while w.clock.now() < reset.saturating_add(Duration::from_millis(400)) {
        w.advance(Duration::from_millis(10));
        mark += 1.0;
        // (A running total of what the key admitted, as its limiter keeps it.)
        let account = usher_limit::allot::Account { reset, spent: 1.0, left: 0.0, mark, passed: false, charged: mark };
        c.update_demand(DemandUpdate {
            changed: vec![KeyDemand { account: Some(Box::new(account)), ..demand("cal", 5.0, OnExpiry::Safe) }],
            ..DemandUpdate::default()
        });
        if w.clock.now() == last_call {
            // A call just before the reset: the next one is due in a second.
            c.set_next_refresh(last_call);
        }
        while let Action::Refresh { target, request } = c.next_action(w.clock.now()) {
            sent.push((w.clock.now(), request.clone(), mark));
            let r = w.rt.block_on(w.net.get_capacity(&target, request));
            c.on_refresh(w.clock.now(), r);
        }
    }
    let times: Vec<f64> = sent.iter().map(|(t, _, _)| t.as_secs_f64() - reset.as_secs_f64()).collect();
    let [.., before, after] = times[..] else { panic!("{times:?}") };
    assert!((before + 0.15).abs() < 1e-6, "{times:?}");
    assert!(
        (0.0..0.3).contains(&after),
        "asked within 300 ms of the reset, its minimum interval notwithstanding: {times:?}"
    );
    let (_, request, mark) = sent.last().unwrap();
    let account = request.resource[0].unit_account.expect("the account goes up");
    assert_eq!(account.reset_unix_ms as u64, reset.as_nanos() / 1_000_000);
    let answered = c.take_allotments();
    let Some((_, Some(next))) = answered.last() else { panic!("{answered:?}") };
    assert_eq!(next.reset, reset.saturating_add(Duration::from_secs(60)), "the new unit's allotment");
    assert_eq!(next.mark, Some(*mark), "with the mark of the account it answers");
    assert!(next.units > 100.0, "the new unit whole: {next:?}");
    assert!(c.next_renewal() <= reset.saturating_add(Duration::from_secs(61)));
}

/// A key with requests waiting asks again a [`POOL_ASK`] after its last
/// request while the server's last answer said its pool holds units (the
/// pooled burst is a round trip away); once an answer says the pool is
/// empty, it waits its minimum interval again.
#[test]
fn a_key_with_requests_waiting_asks_again_soon_while_the_pool_holds_units() {
    let w = World::new(&["s1"]);
    for (pooled, soonest) in
        [(Some(50.0), POOL_ASK), (None, Duration::from_secs(1)), (Some(0.0), Duration::from_secs(1))]
    {
        let mut c = w.core("a", &["s1"]);
        c.set_demand(vec![demand("r", 5.0, OnExpiry::Safe)]);
        w.step(&mut c);
        w.advance(c.next_refresh().since(w.clock.now()));
        let Action::Refresh { .. } = c.next_action(w.clock.now()) else { panic!("a refresh was due") };
        let now = w.clock.now();
        let lease = proto::ResourceResponse {
            pooled,
            bucket: Some(10.0),
            allotment: None,
            credit: None,
            resource_capacity: Some(100.0),
            spare: None,
            share_safe: None,
            fresh: None,
            upstream_quota: None,
            resource_id: "r".into(),
            gets: proto::Lease {
                capacity: 5.0,
                expiry_time: now.saturating_add(Duration::from_secs(30)).as_secs(),
                refresh_interval: 12,
            },
            safe_capacity: None,
            template: None,
        };
        c.on_refresh(now, Ok(proto::GetCapacityResponse { response: vec![lease], mastership: None }));
        // Requests wait: the key's demand rises above its lease.
        w.advance(Duration::from_millis(10));
        c.set_demand(vec![KeyDemand { pressure: true, ..demand("r", 20.0, OnExpiry::Safe) }]);
        let at = w.clock.now();
        match c.next_action(at) {
            Action::Wait { until } => {
                assert_eq!(
                    until.since(now),
                    soonest,
                    "with {pooled:?} in the pool the key asks {soonest:?} after its last request"
                )
            }
            other => panic!("asked at once, within the minimum interval: {other:?}"),
        }
    }
}
