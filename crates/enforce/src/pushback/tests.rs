use super::*;

/// A key with the capacity given with it.
impl Key for (String, f64) {
    fn id(&self) -> &str {
        &self.0
    }

    fn capacity(&self) -> f64 {
        self.1
    }
}

fn at(t0: Time, ms: u64) -> Time {
    t0.saturating_add(Duration::from_millis(ms))
}

#[test]
fn backs_off_holds_and_recovers() {
    let p = Pushback::new(&prometheus::Registry::new());
    let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 2, recover_step: 2.0 };
    let t0 = Time::from_secs(100);
    let ids = vec![("k".to_string(), 40.0)];
    assert_eq!(p.effective("k", 40.0, t0), 40.0, "no pushback: the full lease");
    let ch = p.on_response(&ids, StatusCode::TOO_MANY_REQUESTS, Some(Duration::from_secs(2)), t0, &cfg, |_, _| {});
    assert_eq!(ch, vec![("k".to_string(), 0.0)], "held until Retry-After");
    assert_eq!(p.hold_left("k", at(t0, 500)), Some(Duration::from_millis(1500)));
    assert_eq!(p.effective("k", 40.0, at(t0, 1000)), 0.0);
    assert_eq!(p.hold_left("k", at(t0, 2000)), None);
    let t3 = at(t0, 3000);
    assert_eq!(p.effective("k", 40.0, t3), 20.0, "its share of what it had");
    assert_eq!(p.effective("k", 12.0, t3), 12.0, "never more than the lease grants");
    assert_eq!(p.effective("k", 40.0, t3), 20.0);
    p.on_response(&ids, StatusCode::SERVICE_UNAVAILABLE, None, t3, &cfg, |_, _| {});
    assert_eq!(p.effective("k", 40.0, t3), 10.0);
    assert!(p.on_response(&ids, StatusCode::OK, None, t3, &cfg, |_, _| {}).is_empty(), "one success is not enough");
    let ch = p.on_response(&ids, StatusCode::OK, None, t3, &cfg, |_, _| {});
    assert!(ch[0].1 > 10.0 && ch[0].1 < 40.0, "{ch:?}");
    for _ in 0..20 {
        p.on_response(&ids, StatusCode::OK, None, t3, &cfg, |_, _| {});
    }
    assert_eq!(p.effective("k", 40.0, t3), 40.0, "fully recovered");
    assert!(p.status(t3).is_empty());
    let off = PushbackConfig { enabled: false, ..cfg };
    assert!(p.on_response(&ids, StatusCode::TOO_MANY_REQUESTS, None, t3, &off, |_, _| {}).is_empty());
}

#[test]
fn a_hold_gives_the_lease_back_and_asks_for_it_again_before_it_ends() {
    let p = Pushback::new(&prometheus::Registry::new());
    let cfg = PushbackConfig::default();
    let t0 = Time::from_secs(100);
    let lead = Duration::from_secs(1);
    assert_eq!(p.lease_wants("k", 55.0, t0, || lead), None, "not pushed back");
    p.on_response(
        &[("k".to_string(), 40.0)],
        StatusCode::TOO_MANY_REQUESTS,
        Some(Duration::from_secs(5)),
        t0,
        &cfg,
        |_, _| {},
    );
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 100), || lead), Some((0.0, true)), "gives its lease back, early");
    // The lease client applies the 0 it asked for: that is not what it recovers to.
    assert_eq!(p.effective("k", 0.0, at(t0, 600)), 0.0);
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 3900), || lead), Some((0.0, false)));
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 4100), || lead), Some((40.0, true)), "asks for what it had, in time");
    assert_eq!(p.lease_wants("k", 30.0, at(t0, 4100), || lead), Some((30.0, true)), "never more than it wants");
    assert_eq!(p.effective("k", 40.0, at(t0, 4500)), 0.0, "still held");
    assert_eq!(p.effective("k", 40.0, at(t0, 5000)), 20.0, "after the hold: its share of the 40 it had");
    assert_eq!(
        p.lease_wants("k", 55.0, at(t0, 5000), || lead),
        Some((40.0, false)),
        "keeps the lease it recovers into"
    );
    assert_eq!(p.status(at(t0, 5000))[0].before, 40.0);
    // A pushback without Retry-After: it asks only for its share.
    p.on_response(&[("k".to_string(), 20.0)], StatusCode::SERVICE_UNAVAILABLE, None, at(t0, 5100), &cfg, |_, _| {});
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 5200), || lead), Some((10.0, true)));
    assert_eq!(p.effective("k", 10.0, at(t0, 5300)), 10.0);
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 5400), || lead), Some((10.0, false)));
    // Quiet for long enough: recovered, the lease client's own wants again.
    assert_eq!(p.lease_wants("k", 55.0, at(t0, 5100).saturating_add(QUIET_RECOVERY), || lead), None);
}

#[test]
fn a_hold_shorter_than_a_relet_keeps_the_lease() {
    let p = Pushback::new(&prometheus::Registry::new());
    let t0 = Time::from_secs(100);
    let ids = [("k".to_string(), 40.0)];
    p.on_response(
        &ids,
        StatusCode::TOO_MANY_REQUESTS,
        Some(Duration::from_secs(2)),
        t0,
        &PushbackConfig::default(),
        |_, _| {},
    );
    let lead = relet_lead(Duration::from_secs(2), Duration::from_millis(500), 1.0 / 6.0);
    assert_eq!(lead.as_millis(), 3333);
    assert_eq!(p.lease_wants("k", 55.0, t0, || lead), Some((40.0, false)));
    assert_eq!(p.effective("k", 40.0, at(t0, 1999)), 0.0);
    assert_eq!(p.effective("k", 40.0, at(t0, 2000)), 20.0, "probes at once when the hold ends");
}

#[test]
fn a_quiet_key_recovers_without_traffic() {
    let p = Pushback::new(&prometheus::Registry::new());
    let cfg = PushbackConfig::default();
    let t0 = Time::from_secs(100);
    p.on_response(&[("k".to_string(), 40.0)], StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg, |_, _| {});
    assert_eq!(p.effective("k", 40.0, t0.saturating_add(Duration::from_secs(1))), 20.0);
    let later = t0.saturating_add(QUIET_RECOVERY);
    assert_eq!(p.effective("k", 40.0, later), 40.0);
    assert!(p.status(later).is_empty(), "the key is forgotten once recovered");
    assert_eq!(p.hold_left("k", later), None);
}

#[test]
fn retry_after_seconds() {
    let mut h = http::HeaderMap::new();
    h.insert(http::header::RETRY_AFTER, "2".parse().unwrap());
    assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
    h.insert(http::header::RETRY_AFTER, "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap());
    assert_eq!(retry_after(&h), None);
}

/// The lease client re-applies a backed-off key at every turn; a recovered
/// one is no longer listed (its full capacity was written on the answer).
#[test]
fn backed_off_keys_are_listed_for_the_lease_client() {
    let p = Pushback::new(&prometheus::Registry::new());
    let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 1, recover_step: 4.0 };
    let t0 = Time::from_secs(100);
    let ids = [("k".to_string(), 40.0)];
    assert!(p.ids().is_empty(), "nothing backed off");
    p.on_response(&ids, StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg, |_, _| {});
    assert_eq!(p.ids(), ["k"]);
    assert_eq!(p.ids(), ["k"], "at every turn while backed off");
    let mut wrote = Vec::new();
    let ch = p.on_response(&ids, StatusCode::OK, None, t0, &cfg, |id, c| wrote.push((id.to_string(), c)));
    assert_eq!(ch, [("k".to_string(), 40.0)], "recovered at once (0.5 × 4 ≥ 1 with any jitter)");
    assert_eq!(wrote, ch, "each change is written");
    assert!(p.ids().is_empty());
}

/// A lease applied while an upstream answer is being written waits for that
/// write: the newer lease is what the key is left with (each capacity is
/// applied once, so a crossed write would stay until the lease changes).
#[test]
fn a_lease_applied_while_an_answer_writes_comes_after_it() {
    use std::sync::{Arc, Mutex, mpsc};
    let p = Arc::new(Pushback::new(&prometheus::Registry::new()));
    let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 1, recover_step: 4.0 };
    let t0 = Time::from_secs(100);
    let ids = [("k".to_string(), 40.0)];
    p.on_response(&ids, StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg, |_, _| {});
    let table = Arc::new(Mutex::new(Vec::new()));
    let (inside, writing) = mpsc::channel();
    let lease = {
        let (p, table) = (p.clone(), table.clone());
        std::thread::spawn(move || {
            writing.recv().unwrap();
            // A new lease of 10 arrives while the answer's recovery is being written.
            p.apply("k", 10.0, t0, |c, _| table.lock().unwrap().push(c));
        })
    };
    p.on_response(&ids, StatusCode::OK, None, t0, &cfg, |_, c| {
        inside.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        table.lock().unwrap().push(c);
    });
    lease.join().unwrap();
    assert_eq!(*table.lock().unwrap(), [40.0, 10.0], "the recovery's write, then the newer lease's");
}

/// A key's first pushback backs off from the capacity in force when it takes
/// the pushback lock: a lease applied after the request path read the
/// capacity but before it took the lock is the base, not the older one. The
/// key's capacity tells the lease's write (which holds the lock) that it was
/// read; read under the lock, that tells nothing until the write is done.
#[test]
fn a_pushback_backs_off_from_the_lease_in_force_at_the_lock() {
    use std::sync::{Arc, Mutex, mpsc};
    struct Shared {
        capacity: Arc<Mutex<f64>>,
        read: Mutex<mpsc::Sender<()>>,
    }
    impl Key for Shared {
        fn id(&self) -> &str {
            "k"
        }
        fn capacity(&self) -> f64 {
            let c = *self.capacity.lock().unwrap();
            let _ = self.read.lock().unwrap().send(());
            c
        }
    }
    let p = Arc::new(Pushback::new(&prometheus::Registry::new()));
    let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 1, recover_step: 4.0 };
    let t0 = Time::from_secs(100);
    let capacity = Arc::new(Mutex::new(40.0));
    let (read_tx, read_rx) = mpsc::channel();
    let (inside_tx, inside_rx) = mpsc::channel();
    let lease = {
        let (p, capacity) = (p.clone(), capacity.clone());
        std::thread::spawn(move || {
            // A new lease of 10, written under the lock: it waits until the
            // answer read the capacity (at once if that read does not wait
            // for the lock), or gives up after a while.
            p.apply("k", 10.0, t0, |c, _| {
                inside_tx.send(()).unwrap();
                let _ = read_rx.recv_timeout(Duration::from_millis(300));
                *capacity.lock().unwrap() = c;
            });
        })
    };
    inside_rx.recv().unwrap();
    let key = Shared { capacity: capacity.clone(), read: Mutex::new(read_tx) };
    let ch = p.on_response([&key], StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg, |_, c| {
        *capacity.lock().unwrap() = c;
    });
    lease.join().unwrap();
    assert_eq!(p.status(t0)[0].before, 10.0, "the lease in force at the lock is what the key recovers to");
    assert_eq!(ch, [("k".to_string(), 5.0)], "half the lease in force");
    assert_eq!(*capacity.lock().unwrap(), 5.0);
}

/// A gauge key: it admits whole requests, and is told its hold.
struct GaugeKey {
    capacity: f64,
    hold: Mutex<Option<Time>>,
}

impl Key for GaugeKey {
    fn id(&self) -> &str {
        "g"
    }

    fn capacity(&self) -> f64 {
        self.capacity
    }

    fn whole(&self) -> bool {
        true
    }

    fn set_hold(&self, until: Option<Time>) {
        *self.hold.lock().unwrap() = until;
    }
}

#[test]
fn a_gauge_backs_off_to_no_less_than_one_once_its_hold_ends() {
    let p = Pushback::new(&prometheus::Registry::new());
    let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 10, recover_step: 1.5 };
    let t0 = Time::from_secs(100);
    let one = GaugeKey { capacity: 1.0, hold: Mutex::new(None) };
    let ch = p.on_response([&one], StatusCode::TOO_MANY_REQUESTS, Some(Duration::from_secs(2)), t0, &cfg, |_, _| {});
    assert_eq!(ch, [("g".to_string(), 0.0)], "nothing during the hold");
    assert_eq!(*one.hold.lock().unwrap(), Some(at(t0, 2000)), "the key is told when its hold ends");
    p.apply("g", 1.0, at(t0, 500), |c, hold| assert_eq!((c, hold), (0.0, Some(at(t0, 2000))), "a key made anew too"));
    p.apply("g", 1.0, at(t0, 2000), |_, hold| assert_eq!(hold, None, "over"));
    assert_eq!(p.effective("g", 1.0, at(t0, 2000)), 1.0, "0.5 of 1 would admit nothing: one probe at a time");
    assert_eq!(p.effective("g", 0.0, at(t0, 2000)), 0.0, "never more than the lease grants");
    for _ in 0..5 {
        p.on_response([&one], StatusCode::SERVICE_UNAVAILABLE, None, at(t0, 2500), &cfg, |_, _| {});
    }
    assert_eq!(p.effective("g", 1.0, at(t0, 2500)), 1.0, "however far it backs off");

    let p = Pushback::new(&prometheus::Registry::new());
    let five = GaugeKey { capacity: 5.0, hold: Mutex::new(None) };
    p.on_response([&five], StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg, |_, _| {});
    assert_eq!(p.effective("g", 5.0, t0), 2.5, "above 1 it backs off as a rate does (the gauge admits 2)");
}
