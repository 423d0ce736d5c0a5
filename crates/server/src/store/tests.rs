use std::time::Duration;

use proptest::prelude::*;

use super::*;
use usher_core::config::resources::{Algorithm, ResourcesConfig, Template};

/// A template that grants no more than is wanted (`spare: keep`): most tests
/// here follow exact grants; [`sharing`] is FAIR_SHARE as it comes.
fn template(kind: Kind, capacity: f64, lease: u64, refresh: u64, learning: u64) -> Arc<Template> {
    let mut t = (*sharing(kind, capacity, lease, refresh, learning)).clone();
    t.algorithm.parameters = vec![(SPARE_PARAMETER.into(), Some("keep".into()))];
    Arc::new(t)
}

/// A template as written, with no parameters.
fn sharing(kind: Kind, capacity: f64, lease: u64, refresh: u64, learning: u64) -> Arc<Template> {
    Arc::new(Template {
        identifier_glob: "*".into(),
        capacity,
        safe_capacity: None,
        description: None,
        algorithm: Algorithm {
            kind,
            lease_length: Duration::from_secs(lease),
            refresh_interval: Duration::from_secs(refresh),
            learning_mode_duration: Duration::from_secs(learning),
            parameters: vec![],
        },
        calendar: None,
    })
}

fn store(
    kind: Kind,
    capacity: f64,
    learning: u64,
    min_interval: Duration,
) -> (Store, Arc<usher_core::clock::ManualClock>) {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![template(kind, capacity, 10, 5, learning)] };
    (Store::new(clock, cfg, min_interval), handle)
}

fn req(resource: &str, wants: f64, has: Option<f64>) -> LeaseRequest {
    LeaseRequest {
        bucket: Default::default(),
        resource_id: resource.into(),
        wants,
        subclients: 1,
        reported_has: has,
        reported_expiry: None,
        requester: Requester::Client { priority: 0 },
        quota: None,
        account: None,
        window: None,
    }
}

#[test]
fn lease_store_sums_cleanup_and_release() {
    // Doorman's lease-store facts, driven through learning mode so that each
    // client is granted exactly the has it reports.
    let mut r = Resource::new(template(Kind::FairShare, 100.0, 10, 5, 0));
    let now = Time::from_secs(500);
    r.decide(
        "a",
        &req("x", 12.0, Some(10.0)),
        now,
        Decision { learning: true, min_interval: Duration::ZERO, again: false, arrivals: true },
        Role::Root,
    );
    r.decide(
        "b",
        &req("x", 12.0, Some(10.0)),
        now,
        Decision { learning: true, min_interval: Duration::ZERO, again: false, arrivals: true },
        Role::Root,
    );
    r.template = template(Kind::FairShare, 100.0, 20, 5, 0);
    r.decide(
        "c",
        &req("x", 20.0, Some(15.0)),
        now,
        Decision { learning: true, min_interval: Duration::ZERO, again: false, arrivals: true },
        Role::Root,
    );
    assert_eq!((r.index.total_has(), r.index.total_wants(), r.index.total_subclients()), (35.0, 44.0, 3));
    r.expire(now.saturating_add(Duration::from_secs(10)));
    assert_eq!((r.index.total_has(), r.index.total_wants(), r.clients.len()), (15.0, 20.0, 1));
    r.remove("c");
    assert_eq!((r.index.total_has(), r.index.total_wants(), r.index.total_subclients()), (0.0, 0.0, 0));
}

#[test]
fn learning_mode_hands_back_has_then_ends() {
    let (s, clock) = store(Kind::FairShare, 100.0, 5, Duration::ZERO);
    let g = s.get_capacity("a", &req("r", 80.0, Some(70.0)));
    assert_eq!(g.capacity, 70.0, "learning mode grants the reported has");
    let g = s.get_capacity("b", &req("r", 80.0, None));
    assert_eq!(g.capacity, 0.0, "no has reported: 0");
    assert!(s.status()[0].learning_mode);
    clock.advance(Duration::from_secs(5));
    let g = s.get_capacity("b", &req("r", 80.0, None));
    assert_eq!(g.capacity, 30.0, "fair share is 50, but a still holds 70 of 100");
    assert!(!s.status()[0].learning_mode);
}

/// Learning mode believes what a client reports holding up to the
/// resource's capacity and for at most a lease length: a client that claims
/// everything for ever must not keep it once learning ends.
#[test]
fn learning_mode_believes_a_reported_lease_only_within_the_capacity_and_a_lease_length() {
    let (s, clock) = store(Kind::FairShare, 100.0, 5, Duration::ZERO);
    let now = clock.now();
    let liar = LeaseRequest {
        reported_expiry: Some(now.saturating_add(Duration::from_secs(1_000_000_000))),
        ..req("r", 1e300, Some(1e300))
    };
    let g = s.get_capacity("liar", &liar);
    assert_eq!(g.capacity, 100.0, "at most the capacity");
    assert!(g.expiry <= now.saturating_add(Duration::from_secs(10)), "at most a lease length: {:?}", g.expiry);
    // After learning mode and the liar's lease (reserved as long again once
    // lapsed: the liar may still hold it; asked while learning, it was told
    // no share), an honest client gets its share.
    clock.advance(Duration::from_secs(21));
    let g = s.get_capacity("honest", &req("r", 10.0, None));
    assert_eq!(g.capacity - g.spare, 10.0);
}

/// Below the capacity, what nobody wants is handed out beside the grants,
/// raising the clients that want least to one level, with one share kept
/// free for a client whose demand rises; above it, nothing is spare. A template that keeps spare capacity
/// grants no more than is wanted.
#[test]
fn spare_capacity_is_shared_below_the_capacity_and_one_share_kept_free() {
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, 100.0, 10, 5, 0)] };
    let (s, clock) = (Store::new(clock, cfg, Duration::ZERO), time);
    // While a new resource's clients are still arriving, spare capacity goes
    // out as if two more were about to ask; the first lease with spare fills a bucket, once.
    let a = s.get_capacity("a", &req("r", 10.0, None));
    assert!((a.capacity - 100.0 / 3.0).abs() < 1e-9 && a.fresh, "{a:?}");
    clock.advance(ARRIVALS + Duration::from_secs(1));
    let a = s.get_capacity("a", &req("r", 10.0, None));
    assert_eq!((a.capacity, a.spare), (55.0, 45.0), "90 spare over a and one share kept free");
    assert!(!a.fresh, "once");
    assert!(a.share_safe, "no safe capacity is configured: a's is its share");
    let b = s.get_capacity("b", &req("r", 20.0, None));
    // 70 spare, a third of it kept free: a and b raised to (100 - 70/3) / 2 each.
    assert!((b.spare - ((100.0 - 70.0 / 3.0) / 2.0 - 20.0)).abs() < 1e-9, "{b:?}");
    assert_eq!(b.capacity, 20.0 + b.spare);
    let c = s.get_capacity("c", &req("r", 90.0, None));
    assert_eq!(c.spare, 0.0, "wants above the capacity: nothing is spare");
    assert!(c.capacity <= 100.0 - a.capacity - b.capacity + 1e-9);
    let total: f64 = s.status()[0].sum_has;
    assert!(total <= 100.0 + 1e-9, "{total}");

    let mut keep = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    keep.algorithm.parameters = vec![(SPARE_PARAMETER.into(), Some("keep".into()))];
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let s = Store::new(clock, ResourcesConfig { templates: vec![Arc::new(keep)] }, Duration::ZERO);
    s.get_capacity("a", &req("r", 10.0, None));
    handle.advance(Duration::from_secs(6));
    let g = s.get_capacity("a", &req("r", 10.0, None));
    assert_eq!((g.capacity, g.spare), (10.0, 0.0));

    let (s, _) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    let mut configured = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    configured.safe_capacity = Some(5.0);
    s.reload(ResourcesConfig { templates: vec![Arc::new(configured)] });
    assert!(!s.get_capacity("a", &req("r", 10.0, None)).share_safe, "a configured safe capacity is no share");
}

#[test]
fn too_early_request_gets_its_lease_back_and_records_wants() {
    let (s, clock) = store(Kind::FairShare, 100.0, 0, Duration::from_secs(1));
    let first = s.get_capacity("a", &req("r", 40.0, None));
    assert_eq!(first.capacity, 40.0);
    clock.advance(Duration::from_millis(300));
    let again = s.get_capacity("a", &req("r", 90.0, None));
    assert_eq!(again.capacity, 40.0);
    assert_eq!(again.expiry, first.expiry, "the lease is returned unchanged");
    assert_eq!(s.status()[0].sum_wants, 90.0, "the new wants is recorded");
    clock.advance(Duration::from_millis(800));
    assert_eq!(s.get_capacity("a", &req("r", 90.0, None)).capacity, 90.0);
}

#[test]
fn dynamic_safe_capacity_counts_the_requester() {
    let (s, _clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    assert_eq!(s.get_capacity("a", &req("r", 100.0, None)).safe_capacity, 100.0);
    // A lower server gets it per subclient, uncapped: it caps its own clients.
    let server = LeaseRequest { requester: Requester::Server { bands: vec![] }, ..req("r", 10.0, None) };
    let g = s.get_capacity("b", &server);
    assert_eq!((g.capacity, g.safe_capacity), (0.0, 50.0));
}

#[test]
fn an_end_clients_safe_capacity_never_exceeds_its_lease_so_its_lapse_is_covered() {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut t = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    t.safe_capacity = Some(10.0);
    let s = Store::new(clock, ResourcesConfig { templates: vec![Arc::new(t)] }, Duration::ZERO);
    let a = s.get_capacity("a", &req("r", 4.0, None));
    assert_eq!((a.capacity, a.safe_capacity), (4.0, 4.0), "configured 10, but a holds 4");
    let b = s.get_capacity("b", &req("r", 200.0, None));
    assert_eq!((b.capacity, b.safe_capacity), (96.0, 10.0));
    // a lapses and runs on its safe capacity (4): that stays reserved, so b's
    // next grant and a fit within the capacity.
    handle.advance(Duration::from_secs(10));
    let b = s.get_capacity("b", &req("r", 200.0, None));
    let st = s.status();
    assert_eq!((b.capacity, st[0].reserved, st[0].clients), (96.0, 4.0, 1), "{st:?}");
    assert!(b.capacity + a.safe_capacity <= 100.0);
    // a comes back: its reservation goes, and it is served as before.
    assert_eq!(s.get_capacity("a", &req("r", 4.0, None)).capacity, 4.0);
    assert_eq!(s.status()[0].reserved, 0.0);
}

#[test]
fn sweep_drops_expired_leases_and_empty_resources() {
    let (s, clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    s.get_capacity("a", &req("r", 10.0, None));
    clock.advance(Duration::from_secs(9));
    s.sweep();
    assert_eq!(s.status().len(), 1);
    clock.advance(Duration::from_secs(1));
    s.sweep();
    // The lapsed client runs on its safe capacity once its hold ends (by
    // default its share: the whole capacity, alone), so that stays reserved
    // through the hold (a refresh interval × 7/6 longer for a lease below
    // its share: `lease::Core`'s hold) and SHARE_KEPT after it.
    let st = s.status();
    assert_eq!((st.len(), st[0].clients, st[0].reserved), (1, 0, 100.0), "{st:?}");
    // (Its lease, the resource's first, asked to hear from it within a second.)
    let hold = Duration::from_secs(10) + FAST_REFRESH.mul_f64(7.0 / 6.0);
    clock.advance(hold + SHARE_KEPT - Duration::from_millis(1));
    s.sweep();
    assert_eq!(s.status()[0].reserved, 100.0);
    clock.advance(Duration::from_millis(1));
    s.sweep();
    assert!(s.status().is_empty());
}

#[test]
fn sweep_drops_only_the_idle_resources() {
    let (s, clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    for id in ["idle-1", "busy", "idle-2"] {
        s.get_capacity("a", &req(id, 10.0, None));
    }
    clock.advance(Duration::from_secs(9));
    s.get_capacity("a", &req("busy", 10.0, None));
    clock.advance(Duration::from_secs(600));
    s.get_capacity("b", &req("busy", 10.0, None));
    s.sweep();
    let ids: Vec<String> = s.status().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, ["busy"]);
}

fn server_req(wants: f64, subclients: u64, has: Option<f64>) -> LeaseRequest {
    LeaseRequest {
        subclients,
        requester: Requester::Server { bands: vec![Band { priority: 0, num_clients: subclients as i64, wants }] },
        ..req("r", wants, has)
    }
}

#[test]
fn a_new_masters_missing_subclients_stay_counted_after_the_predecessors_leases_lapse() {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut t = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    t.safe_capacity = Some(10.0);
    let s = Store::new(clock, ResourcesConfig { templates: vec![Arc::new(t)] }, Duration::ZERO);
    // Node n's master speaks for 5 clients holding 50.
    assert_eq!(s.get_capacity("n#1", &server_req(50.0, 5, None)).capacity, 50.0);
    // A new master hears from 3 of them (20): the predecessor's 50 stays
    // counted until its lease would have expired.
    handle.advance(Duration::from_secs(2));
    s.get_capacity("n#2", &server_req(20.0, 3, Some(20.0)));
    assert_eq!(s.get_capacity("c", &req("r", 100.0, None)).capacity, 50.0);
    // Then the 2 missing clients' leases lapse: they run on their safe
    // capacity (10 each, never above their leases), so 20 + 20 stays counted.
    handle.advance(Duration::from_secs(9));
    s.get_capacity("n#2", &server_req(20.0, 3, Some(20.0)));
    assert_eq!(s.status()[0].sum_has, 40.0 + 50.0);
    assert_eq!(s.get_capacity("c", &req("r", 100.0, None)).capacity, 60.0);
    // Once they are back (5 subclients), only what the master reports counts.
    s.get_capacity("n#2", &server_req(40.0, 5, Some(40.0)));
    assert_eq!(s.status()[0].sum_has, 40.0 + 60.0);
}

/// An intermediate's store (decay factor 0.5) with `t` as its one
/// template and no predecessor's lease outstanding, its clock, and the
/// clock's handle.
fn intermediate(t: Arc<Template>) -> (Store, Clock, Arc<usher_core::clock::ManualClock>) {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut s = Store::new(clock.clone(), ResourcesConfig { templates: vec![t] }, Duration::ZERO);
    s.set_role(Role::Intermediate { decay_factor: 0.5 });
    s.set_predecessor(Predecessor::NoneOutstanding);
    (s, clock, handle)
}

/// A lease from the parent of `capacity`, ending at `expiry`, refreshed every `refresh` seconds.
fn parent_lease(capacity: f64, expiry: Time, refresh: u64) -> ParentLease {
    ParentLease {
        resource_capacity: None,
        capacity,
        expiry,
        refresh_interval: Duration::from_secs(refresh),
        algorithm: None,
        safe_capacity: None,
        template: None,
        predecessor_subclients: None,
        answered_subclients: None,
    }
}

/// A node's master whose epoch is `now`: it became master then.
fn master(node: &str, now: Time) -> String {
    format!("{node}#{}", now.as_nanos() / 1_000)
}

#[test]
fn a_new_master_that_has_not_heard_its_whole_subtree_keeps_its_predecessors_lease() {
    let (s, clock) = store(Kind::FairShare, 100.0, 60, Duration::ZERO);
    s.set_predecessor(Predecessor::NoneOutstanding);
    // Nodes n and m, 5 subclients each wanting 80: 50 each once both ask again.
    for id in ["n#1", "m#1", "n#1", "m#1"] {
        s.get_capacity(id, &server_req(80.0, 5, None));
    }
    assert_eq!(s.get_capacity("n#1", &server_req(80.0, 5, Some(50.0))).capacity, 50.0);
    // n's new master has heard from 1 of its 5 subclients (holding 10):
    // the 4 others still hold their leases, so while it learns it keeps
    // the 50 its predecessor held, and its demand, told upwards, counts
    // them too.
    clock.advance(Duration::from_secs(2));
    let n2 = master("n", clock.now());
    let g = s.get_capacity(&n2, &server_req(10.0, 1, Some(10.0)));
    assert_eq!((g.capacity, g.predecessor_subclients), (50.0, Some(5)));
    let up = &s.parent_demand()[0];
    assert_eq!((up.wants, up.bands[0].num_clients), (80.0 + 10.0 + 40.0, 10), "{up:?}");
    assert_eq!(s.status()[0].sum_has, 100.0);
    // Once it speaks for all 5, its demand is what it reports.
    let g = s.get_capacity(&n2, &server_req(30.0, 5, Some(50.0)));
    assert_eq!(g.capacity, 30.0);
    assert_eq!(s.parent_demand()[0].wants, 80.0 + 30.0);
    // Past the first moments of its mastership (RECONNECT_ALLOWANCE: it
    // may have stopped learning, and shares what it has among the clients
    // that came back), its report stands as it is, however few it speaks for.
    let (s, clock) = store(Kind::FairShare, 100.0, 60, Duration::ZERO);
    s.set_predecessor(Predecessor::NoneOutstanding);
    s.get_capacity("n#1", &server_req(50.0, 5, None));
    let n2 = master("n", clock.now());
    clock.advance(RECONNECT_ALLOWANCE);
    assert_eq!(s.get_capacity(&n2, &server_req(10.0, 1, Some(10.0))).capacity, 10.0);
}

#[test]
fn a_lapsed_lower_servers_subclients_count_as_holding_until_its_hold_ends() {
    // n's lease (10 s, granted at 0) lapses unrenewed at 10 s; its 5
    // subclients hold their leases from it until 20 s.
    let (s, clock) = store(Kind::FairShare, 100.0, 60, Duration::ZERO);
    s.set_predecessor(Predecessor::NoneOutstanding);
    s.get_capacity("n#1", &server_req(50.0, 5, None));
    clock.advance(Duration::from_secs(11));
    s.sweep();
    assert_eq!(s.status()[0].reserved, 50.0);
    // Its new master, having heard from 1 of them, learns that 5 may hold
    // leases (so it learns until they are back), and keeps the 50.
    let g = s.get_capacity(&master("n", clock.now()), &server_req(10.0, 1, Some(10.0)));
    assert_eq!((g.capacity, g.predecessor_subclients), (50.0, Some(5)));
    // Past the hold, nobody holds a lease under the lapsed one, though it
    // stays reserved (at what its subclients run on after): the new
    // master's report stands as it is, however few it speaks for. An
    // intermediate whose own parent lease ends in 4 s grants leases that
    // short: held until 8 s, reserved until 14 s.
    let (s, clock, handle) = intermediate(template(Kind::FairShare, 100.0, 10, 5, 60));
    let parent = |clock: &Clock, secs| parent_lease(100.0, clock.now().saturating_add(Duration::from_secs(secs)), 5);
    // (The resource is made by its first request, and only then takes a parent lease.)
    s.get_capacity("n#1", &server_req(50.0, 5, None));
    s.set_parent_lease("r", Some(parent(&clock, 4)));
    assert_eq!(
        s.get_capacity("n#1", &server_req(50.0, 5, Some(50.0))).expiry,
        clock.now().saturating_add(Duration::from_secs(4))
    );
    handle.advance(Duration::from_secs(9));
    s.set_parent_lease("r", Some(parent(&clock, 10)));
    s.sweep();
    assert!(s.status()[0].reserved > 0.0, "{:?}", s.status());
    let g = s.get_capacity(&master("n", clock.now()), &server_req(10.0, 1, Some(10.0)));
    assert_eq!((g.capacity, g.predecessor_subclients), (10.0, Some(0)));
}

/// A node's new master that asks while this intermediate holds no parent
/// lease is told there is nothing to hand out (an expired lease, as any
/// client then), and its predecessor's lease stays as it is: counted until
/// it ends, in what this server reports upwards too, then reserved. Once
/// the parent lease is back, the new master takes it over.
#[test]
fn a_new_master_asking_while_there_is_no_parent_lease_leaves_its_predecessors_lease_counted() {
    let (s, clock, handle) = intermediate(template(Kind::FairShare, 100.0, 10, 5, 0));
    let parent = |clock: &Clock| parent_lease(100.0, clock.now().saturating_add(Duration::from_secs(20)), 5);
    // (The resource is made by its first request, and only then takes a parent lease.)
    s.get_capacity("n#1", &server_req(50.0, 5, None));
    s.set_parent_lease("r", Some(parent(&clock)));
    let g = s.get_capacity("n#1", &server_req(50.0, 5, Some(50.0)));
    assert_eq!((g.capacity, g.expiry), (50.0, clock.now().saturating_add(Duration::from_secs(10))));
    // The link to the parent loses its lease (refused, or given up) while
    // n's lease runs; then n's new master asks.
    handle.advance(Duration::from_secs(2));
    s.set_parent_lease("r", None);
    let n2 = master("n", clock.now());
    let g = s.get_capacity(&n2, &server_req(50.0, 5, Some(50.0)));
    assert_eq!((g.capacity, g.expiry, g.refresh_interval), (0.0, clock.now(), Duration::from_secs(1)));
    assert_eq!(s.status()[0].sum_has, 50.0, "the predecessor's 50 stay counted");
    assert_eq!(s.parent_demand()[0].handed_out, 50.0, "and are reported upwards");
    // Its lease ends 10 s after it was granted: then it is reserved in full
    // while its subclients hold theirs.
    handle.advance(Duration::from_secs(9));
    s.get_capacity(&n2, &server_req(50.0, 5, Some(50.0)));
    assert_eq!(s.status()[0].reserved, 50.0, "{:?}", s.status());
    assert_eq!(s.parent_demand()[0].handed_out, 50.0);
    // The parent lease is back: the new master takes the node's lease over.
    s.set_parent_lease("r", Some(parent(&clock)));
    let g = s.get_capacity(&n2, &server_req(50.0, 5, Some(50.0)));
    assert_eq!((g.capacity, g.predecessor_subclients), (50.0, Some(5)));
    assert_eq!(s.parent_demand()[0].handed_out, 50.0);
}

fn learning_store(lease: u64, refresh: u64) -> (Store, Arc<usher_core::clock::ManualClock>) {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![template(Kind::FairShare, 100.0, lease, refresh, lease)] };
    (Store::new(clock, cfg, Duration::ZERO), handle)
}

#[test]
fn a_new_master_learns_only_while_a_predecessors_lease_may_be_outstanding() {
    // Unknown: learning mode for its whole bound (refresh 5 s × 7/6 + 3 s).
    let (s, _clock) = learning_store(60, 5);
    s.become_master();
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 0.0, "learning: reports nothing, gets 0");
    // A fresh deployment (no record): no learning mode at all.
    let (s, _clock) = learning_store(60, 5);
    s.become_master();
    s.set_predecessor(Predecessor::NoneOutstanding);
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 80.0);
    assert!(!s.status()[0].learning_mode);
    // A record 4 s ahead: learning ends then, before its bound.
    let (s, clock) = learning_store(60, 5);
    s.become_master();
    s.set_predecessor(Predecessor::Until(clock.now().saturating_add(Duration::from_secs(4))));
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 0.0);
    assert_eq!(s.status()[0].learning_left_s, 4.0);
    clock.advance(Duration::from_secs(4));
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 80.0);
    // A record already past: no lease is outstanding, but clients on their
    // safe capacity reconnect; learning lasts the reconnect allowance.
    let (s, clock) = learning_store(60, 5);
    s.become_master();
    s.set_predecessor(Predecessor::Lapsed);
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 0.0);
    assert_eq!(s.status()[0].learning_left_s, RECONNECT_ALLOWANCE.as_secs_f64());
    clock.advance(RECONNECT_ALLOWANCE);
    assert_eq!(s.get_capacity("a", &req("r", 80.0, None)).capacity, 80.0);
}

#[test]
fn no_lease_outlives_the_recorded_horizon() {
    let (s, clock) = learning_store(60, 5);
    s.set_predecessor(Predecessor::NoneOutstanding);
    let h = clock.now().saturating_add(Duration::from_secs(20));
    s.set_lease_horizon(Some(h));
    assert_eq!(s.get_capacity("a", &req("r", 10.0, None)).expiry, h, "60 s lease cut to the horizon");
    s.set_lease_horizon(None);
    let g = s.get_capacity("a", &req("r", 10.0, None));
    assert_eq!(g.expiry, clock.now().saturating_add(Duration::from_secs(60)));
    assert_eq!(s.longest_lease(), Duration::from_secs(60));
}

#[test]
fn a_cut_capacity_brings_each_client_down_to_its_share_not_to_nothing() {
    let (s, _clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    assert_eq!(s.get_capacity("a", &req("r", 60.0, None)).capacity, 60.0);
    assert_eq!(s.get_capacity("b", &req("r", 60.0, None)).capacity, 40.0);
    s.reload(ResourcesConfig { templates: vec![template(Kind::FairShare, 50.0, 10, 5, 0)] });
    // Share 25 each; b still holds 40, so nothing is unused for a. It keeps
    // 25 of its 60 (never more than it held), not the 0 left unused.
    assert_eq!(s.get_capacity("a", &req("r", 60.0, None)).capacity, 25.0);
    assert_eq!(s.get_capacity("b", &req("r", 60.0, None)).capacity, 25.0);
    assert_eq!(s.status()[0].sum_has, 50.0);
    // A newcomer holding nothing still gets only what is unused.
    assert_eq!(s.get_capacity("c", &req("r", 60.0, None)).capacity, 0.0);
}

#[test]
fn an_intermediate_without_a_parent_lease_keeps_clients_that_hold_nothing_known() {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![template(Kind::FairShare, 100.0, 60, 8, 0)] };
    let mut s = Store::new(clock, cfg, Duration::ZERO);
    s.set_role(Role::Intermediate { decay_factor: 0.5 });
    s.set_predecessor(Predecessor::NoneOutstanding);
    for _ in 0..5 {
        let g = s.get_capacity("a", &req("r", 30.0, None));
        assert_eq!((g.capacity, g.expiry), (0.0, handle.now()), "an expired lease: nothing to hand out yet");
        handle.advance(Duration::from_secs(1));
        // Its demand stays there for the parent to hear of, without a gap.
        assert_eq!(s.parent_demand().iter().map(|d| d.wants).sum::<f64>(), 30.0);
    }
}

/// An intermediate cut off from its parent for longer than its clients'
/// leases and their reservations tells them the whole safe capacity, as a
/// client cut off from the tree would use it; while a client's reservation
/// lasts, no more than that. (It told them 0 once the reservation lapsed:
/// a root outage of two lease lengths cut every client behind it to 0.)
#[test]
fn an_intermediate_cut_off_from_its_parent_tells_clients_the_safe_capacity() {
    let (s, clock, handle) = intermediate(template(Kind::FairShare, 100.0, 10, 5, 0));
    s.get_capacity("a", &req("r", 10.0, None));
    s.set_parent_lease(
        "r",
        Some(ParentLease {
            safe_capacity: Some(2.0),
            ..parent_lease(20.0, clock.now().saturating_add(Duration::from_secs(10)), 5)
        }),
    );
    let g = s.get_capacity("a", &req("r", 10.0, None));
    assert_eq!((g.capacity, g.safe_capacity), (10.0, 2.0));
    // The parent is gone: its lease, the client's (never longer) and the
    // client's reservation (a lease length more) run out in turn.
    let mut told = Vec::new();
    for _ in 0..30 {
        handle.advance(Duration::from_secs(1));
        let g = s.get_capacity("a", &req("r", 10.0, Some(0.0)));
        assert!(g.capacity == 0.0 || g.expiry > clock.now(), "no new capacity: {g:?}");
        told.push(g.safe_capacity);
    }
    assert!(told.iter().all(|&safe| safe == 2.0), "the safe capacity throughout: {told:?}");
}

#[test]
fn an_intermediate_reports_what_its_clients_hold_not_what_it_last_granted() {
    let (clock, _handle) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![template(Kind::FairShare, 100.0, 60, 8, 0)] };
    let mut s = Store::new(clock.clone(), cfg, Duration::ZERO);
    s.set_role(Role::Intermediate { decay_factor: 0.5 });
    s.set_predecessor(Predecessor::NoneOutstanding);
    let lease = |capacity| parent_lease(capacity, clock.now().saturating_add(Duration::from_secs(60)), 8);
    s.get_capacity("leaf#1", &server_req(80.0, 4, None));
    s.set_parent_lease("r", Some(lease(100.0)));
    assert_eq!(s.get_capacity("leaf#1", &server_req(80.0, 4, None)).capacity, 80.0);
    // The parent cuts this server to 40; the leaf is granted 40 but its
    // clients hold 80 until they refresh: 80 is what is out there.
    s.set_parent_lease("r", Some(lease(40.0)));
    assert_eq!(s.get_capacity("leaf#1", &server_req(80.0, 4, Some(80.0))).capacity, 40.0);
    assert_eq!(s.parent_demand()[0].handed_out, 80.0);
}

#[test]
fn reload_applies_the_new_capacity_to_the_next_decision() {
    let (s, _clock) = store(Kind::Static, 100.0, 0, Duration::ZERO);
    assert_eq!(s.get_capacity("a", &req("r", 500.0, None)).capacity, 100.0);
    s.reload(ResourcesConfig { templates: vec![template(Kind::Static, 7.0, 10, 5, 0)] });
    assert_eq!(s.get_capacity("a", &req("r", 500.0, None)).capacity, 7.0);
    assert_eq!(s.status()[0].capacity, 7.0);
}

#[derive(Debug, Clone)]
enum Op {
    Ask { client: u8, wants: f64, subclients: u64 },
    Release { client: u8 },
    Advance { millis: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..12, 0.0f64..300.0, 1u64..4).prop_map(|(client, wants, subclients)| Op::Ask { client, wants, subclients }),
        1 => (0u8..12).prop_map(|client| Op::Release { client }),
        3 => (0u64..6000).prop_map(|millis| Op::Advance { millis }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random request sequences with time advancing and leases expiring: the
    /// sum of unexpired grants never exceeds capacity for the share
    /// algorithms, no grant is negative, no grant exceeds wants.
    #[test]
    fn grants_stay_within_capacity(
        kind in prop_oneof![Just(Kind::FairShare), Just(Kind::ProportionalShare), Just(Kind::Static), Just(Kind::NoAlgorithm)],
        capacity in 0.0f64..500.0,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let (s, clock) = store(kind, capacity, 0, Duration::ZERO);
        // The model: client -> (grant, expiry).
        let mut model: HashMap<u8, (f64, Time)> = HashMap::new();
        for op in ops {
            match op {
                Op::Ask { client, wants, subclients } => {
                    let mut r = req("res", wants, None);
                    r.subclients = subclients;
                    let g = s.get_capacity(&format!("c{client}"), &r);
                    prop_assert!(g.capacity >= 0.0 && !g.capacity.is_nan());
                    if kind != Kind::NoAlgorithm {
                        // Beyond wants only what nobody wants (FAIR_SHARE's spare).
                        prop_assert!(g.capacity - g.spare <= wants + 1e-9);
                        prop_assert!(g.spare == 0.0 || kind == Kind::FairShare);
                    }
                    if kind == Kind::Static {
                        prop_assert!(g.capacity <= capacity + 1e-9);
                    }
                    model.insert(client, (g.capacity, g.expiry));
                }
                Op::Release { client } => {
                    s.release(&format!("c{client}"), "res");
                    model.remove(&client);
                }
                Op::Advance { millis } => clock.advance(Duration::from_millis(millis)),
            }
            let now = clock.now();
            model.retain(|_, (_, exp)| *exp > now);
            let outstanding: f64 = model.values().map(|(g, _)| g).sum();
            if is_shared(kind) {
                prop_assert!(outstanding <= capacity + 1e-6, "{outstanding} > {capacity}");
            }
            let st = s.status();
            let has = st.first().map_or(0.0, |r| r.sum_has);
            prop_assert!((has - outstanding).abs() < 1e-6, "store says {has}, model {outstanding}");
        }
    }
}

#[test]
fn learning_mode_hands_the_safe_capacity_to_a_client_holding_nothing_and_echoes_any_other() {
    let mut t = (*template(Kind::FairShare, 50.0, 60, 10, 60)).clone();
    t.safe_capacity = Some(2.0);
    let mut r = Resource::new(Arc::new(t));
    let learn = Decision { learning: true, min_interval: Duration::ZERO, again: false, arrivals: true };
    let now = Time::from_secs(500);
    // New, holding 0, holding more than the safe capacity, wanting less than it.
    assert_eq!(r.decide("new", &req("x", 10.0, None), now, learn, Role::Root).capacity, 2.0);
    assert_eq!(r.decide("zero", &req("x", 10.0, Some(0.0)), now, learn, Role::Root).capacity, 2.0);
    assert_eq!(r.decide("more", &req("x", 10.0, Some(7.0)), now, learn, Role::Root).capacity, 7.0);
    assert_eq!(r.decide("small", &req("x", 0.5, Some(0.0)), now, learn, Role::Root).capacity, 0.5);
    // Holding less than the safe capacity: what it holds, no more (a parent
    // counts this subtree at what it reports; more would not be covered).
    assert_eq!(r.decide("less", &req("x", 10.0, Some(1.5)), now, learn, Role::Root).capacity, 1.5);
}

#[test]
fn a_lapsed_lease_stays_reserved_in_full_for_a_lease_length() {
    // Its client holds it for as long again as it was granted for (see
    // `lease::Mode::Held`), whatever its safe capacity.
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut t = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    t.safe_capacity = Some(10.0);
    let s = Store::new(clock, ResourcesConfig { templates: vec![Arc::new(t)] }, Duration::ZERO);
    assert_eq!(s.get_capacity("a", &req("r", 60.0, None)).capacity, 60.0);
    assert_eq!(s.get_capacity("b", &req("r", 200.0, None)).capacity, 40.0);
    handle.advance(Duration::from_secs(6));
    assert_eq!(s.get_capacity("b", &req("r", 200.0, Some(40.0))).capacity, 40.0);
    // a's lease lapses at 10 s: its 60 stay reserved, b gets no more.
    handle.advance(Duration::from_secs(5));
    let b = s.get_capacity("b", &req("r", 200.0, Some(40.0)));
    let st = s.status();
    assert_eq!((b.capacity, st[0].reserved, st[0].clients), (40.0, 60.0, 1), "{st:?}");
    // A lease length after the lapse, the hold is over and so is the reservation.
    handle.advance(Duration::from_secs(10));
    let b = s.get_capacity("b", &req("r", 200.0, Some(40.0)));
    assert_eq!((b.capacity, s.status()[0].reserved), (100.0, 0.0));
}

/// A lease ends on a whole second, after the lease length: the wire's
/// `expiry_time` (whole seconds, rounded down) then says what the books say,
/// not up to a second less.
#[test]
fn a_lease_ends_on_the_whole_second_after_its_length() {
    let (s, clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    clock.advance(Duration::from_millis(300));
    let g = s.get_capacity("a", &req("r", 10.0, None));
    assert_eq!(g.expiry, Time::from_secs(1_000_000 + 10 + 1));
    assert_eq!(Time::from_secs(g.expiry.as_secs() as u64), g.expiry);
    // A lease asked for on the second lasts the lease length exactly.
    clock.advance(Duration::from_millis(700));
    assert_eq!(s.get_capacity("a", &req("r", 10.0, None)).expiry, Time::from_secs(1_000_001 + 10));
}

/// A new master of an intermediate with no template of its own, learning
/// before its parent has answered, believes the leases its clients report:
/// its catch-all's capacity (0) says nothing of the resource's.
#[test]
fn an_intermediate_learning_before_its_parent_answers_hands_back_what_clients_hold() {
    let (clock, _handle) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![template(Kind::FairShare, 0.0, 10, 5, 10)] };
    let mut s = Store::new(clock, cfg, Duration::ZERO);
    s.set_role(Role::Intermediate { decay_factor: 0.5 });
    s.become_master();
    let g = s.get_capacity("a", &req("r", 30.0, Some(20.0)));
    assert_eq!(g.capacity, 20.0, "what it holds, not the catch-all's 0");
    assert!(s.status()[0].learning_mode);
}

/// A lease that ends on the whole second after its length is held by its
/// client for as long again as it was granted for, more than a lease length:
/// the lapsed lease stays reserved in full that long.
#[test]
fn a_lapsed_lease_is_reserved_in_full_for_its_whole_hold() {
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut t = (*template(Kind::FairShare, 100.0, 10, 5, 0)).clone();
    t.safe_capacity = Some(4.0);
    let s = Store::new(clock.clone(), ResourcesConfig { templates: vec![Arc::new(t)] }, Duration::ZERO);
    s.set_predecessor(Predecessor::NoneOutstanding);
    handle.advance(Duration::from_millis(300));
    let g = s.get_capacity("a", &req("r", 60.0, None));
    assert_eq!((g.capacity, g.expiry), (60.0, Time::from_secs(1_000_011)));
    // Its client holds it until 1,000,021.7 s: 10.7 s past its end.
    let reserved = |s: &Store| s.status().first().map_or(0.0, |r| r.reserved);
    handle.set(Time::from_nanos(1_000_021_600_000_000));
    s.sweep();
    assert_eq!(reserved(&s), 60.0, "held: the whole lease");
    handle.advance(Duration::from_millis(200));
    s.sweep();
    assert_eq!(reserved(&s), 4.0, "after the hold: its safe capacity");
}

/// An intermediate's lease cut at its own parent lease so short that it ends
/// before its client is due back is not a lapse while the parent lease is
/// renewed: the client stays known, with its demand, and its next request
/// is decided as a renewal. Swept at every cut (2 s leases, refreshed every
/// second), the first client back took what the others held as its own.
#[test]
fn a_lease_cut_short_at_the_parents_expiry_runs_on_while_the_parent_lease_is_renewed() {
    let (s, clock, handle) = intermediate(template(Kind::FairShare, 100.0, 2, 1, 0));
    let parent = |secs: f64| parent_lease(40.0, clock.now().saturating_add(Duration::from_secs_f64(secs)), 1);
    // (The resource is made by its first request, and only then takes a parent lease.)
    s.get_capacity("a", &req("r", 36.0, None));
    s.set_parent_lease("r", Some(parent(1.0)));
    let a = s.get_capacity("a", &req("r", 36.0, None));
    assert_eq!((a.capacity, a.refresh_interval), (36.0, Duration::from_secs(1)));
    assert_eq!(a.expiry, clock.now().saturating_add(Duration::from_secs(1)), "cut at the parent's expiry");
    assert_eq!(s.get_capacity("b", &req("r", 40.0, None)).capacity, 4.0, "what a leaves");
    // The parent lease is renewed; a's and b's leases end before they are due back.
    handle.advance(Duration::from_millis(800));
    s.set_parent_lease("r", Some(parent(2.0)));
    handle.advance(Duration::from_millis(400));
    let st = s.status();
    assert_eq!((st[0].clients, st[0].sum_has, st[0].reserved), (2, 40.0, 0.0), "{st:?}");
    // a is back first: b still wants 40, so a comes down to its share.
    assert_eq!(s.get_capacity("a", &req("r", 40.0, None)).capacity, 20.0);
    // b never comes back: once it is overdue, its lease lapses as any other.
    handle.advance(Duration::from_secs(1));
    let st = s.status();
    assert_eq!((st[0].clients, st[0].reserved), (1, 4.0), "{st:?}");
}

#[test]
fn a_short_lapsed_lease_is_reserved_in_full_while_held_then_at_its_safe_capacity() {
    // An intermediate's leases end with its parent's: a 20 s lease out of a
    // 60 s lease length. Its client holds it 20 s more, then runs on its
    // safe capacity (10): that much stays reserved up to a lease length
    // after the lapse, and no more.
    let (clock, handle) = Clock::manual(Time::from_secs(1_000_000));
    let mut t = (*template(Kind::FairShare, 100.0, 60, 8, 0)).clone();
    t.safe_capacity = Some(10.0);
    let mut s = Store::new(clock.clone(), ResourcesConfig { templates: vec![Arc::new(t)] }, Duration::ZERO);
    s.set_role(Role::Intermediate { decay_factor: 0.5 });
    s.set_predecessor(Predecessor::NoneOutstanding);
    let lease = |secs| parent_lease(100.0, clock.now().saturating_add(Duration::from_secs(secs)), 8);
    s.get_capacity("a", &req("r", 60.0, None));
    s.set_parent_lease("r", Some(lease(20)));
    let a = s.get_capacity("a", &req("r", 60.0, None));
    assert_eq!((a.capacity, a.expiry), (60.0, handle.now().saturating_add(Duration::from_secs(20))));
    handle.advance(Duration::from_secs(19));
    s.set_parent_lease("r", Some(lease(120)));
    handle.advance(Duration::from_secs(2));
    let reserved = |s: &Store| s.status()[0].reserved;
    assert_eq!(reserved(&s), 60.0, "held: the whole lease");
    assert_eq!(s.get_capacity("b", &req("r", 200.0, None)).capacity, 40.0);
    handle.advance(Duration::from_secs(20));
    assert_eq!(reserved(&s), 10.0, "after the hold: the safe capacity");
    assert_eq!(s.parent_demand()[0].handed_out, 50.0, "b's 40 and the 10 reserved");
    // (A lease may last a second more than its length, ending on a whole second.)
    handle.advance(Duration::from_secs(39));
    assert_eq!(reserved(&s), 10.0, "until a lease length and a second after the lapse");
    handle.advance(Duration::from_secs(1));
    assert_eq!(reserved(&s), 40.0, "a's reservation is over; b's lease (granted at 21 s for 60) has just lapsed");
}

fn strict(mut t: Arc<Template>) -> Arc<Template> {
    Arc::make_mut(&mut t).algorithm.parameters = vec![("priority_mode".into(), Some("strict".into()))];
    t
}

#[test]
fn strict_priorities_count_every_band_also_when_filed_after_a_reload() {
    let prio = |p: i64| LeaseRequest { requester: Requester::Client { priority: p }, ..req("r", 80.0, None) };
    // Strict from the start, and strict only from a reload on, after both
    // leases were granted: the bands filed then hold both clients.
    for reloaded in [false, true] {
        let t = template(Kind::FairShare, 100.0, 10, 5, 0);
        let (clock, _time) = Clock::manual(Time::from_secs(1_000_000));
        let first = if reloaded { t.clone() } else { strict(t.clone()) };
        let s = Store::new(clock, ResourcesConfig { templates: vec![first] }, Duration::ZERO);
        assert_eq!(s.get_capacity("lo", &prio(0)).capacity, 80.0, "alone");
        assert_eq!(s.get_capacity("hi", &prio(1)).capacity, 20.0, "what lo leaves unused");
        if reloaded {
            s.reload(ResourcesConfig { templates: vec![strict(t)] });
        }
        // Strictly, hi's band comes first: lo gets what its 80 leave (fair
        // share alone would keep lo at 50).
        assert_eq!(s.get_capacity("lo", &prio(0)).capacity, 20.0, "reloaded: {reloaded}");
        assert_eq!(s.get_capacity("hi", &prio(1)).capacity, 80.0, "reloaded: {reloaded}");
    }
}

#[test]
fn a_lower_servers_bands_reach_the_parent_per_priority() {
    let (s, _clock) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    let band = |priority, num_clients, wants| Band { priority, num_clients, wants };
    let server = |bands| LeaseRequest { requester: Requester::Server { bands }, ..req("r", 30.0, None) };
    s.get_capacity("a", &server(vec![band(0, 2, 10.0), band(1, 1, 20.0)]));
    s.get_capacity("b", &req("r", 5.0, None));
    let bands = |s: &Store| s.parent_demand()[0].bands.clone();
    assert_eq!(bands(&s), vec![band(0, 3, 15.0), band(1, 1, 20.0)]);
    // Once filed, kept up to date: a's new bands replace its old ones.
    s.get_capacity("a", &server(vec![band(2, 4, 30.0)]));
    assert_eq!(bands(&s), vec![band(0, 1, 5.0), band(2, 4, 30.0)]);
    s.release("b", "r");
    assert_eq!(bands(&s), vec![band(2, 4, 30.0)]);
}

proptest! {
    /// A resource's expiries, inline while one, a vector while few and a
    /// tree beyond, keep
    /// the order and contents a tree alone would.
    #[test]
    fn expiries_keep_a_trees_order(ops in proptest::collection::vec((any::<bool>(), 0u64..6, 0u32..24), 0..200)) {
        let (mut ours, mut tree) = (Expiries::default(), BTreeSet::new());
        for (insert, t, slot) in ops {
            let e = (Time::from_secs(t), slot);
            if insert {
                ours.insert(e);
                tree.insert(e);
            } else {
                ours.remove(&e);
                tree.remove(&e);
            }
            prop_assert_eq!(ours.first(), tree.first());
            let all: Vec<_> = match &ours {
                Expiries::One(e) => e.iter().copied().collect(),
                Expiries::Few(v) => v.clone(),
                Expiries::Many(set) => set.iter().copied().collect(),
            };
            prop_assert_eq!(all, tree.iter().copied().collect::<Vec<_>>());
        }
    }
}

/// A resource with the default safe capacity (none configured), capacity
/// `capacity`, leases of 10 s refreshed every 5 s.
fn share_store(capacity: f64) -> (Store, Arc<usher_core::clock::ManualClock>) {
    store(Kind::FairShare, capacity, 0, Duration::ZERO)
}

#[test]
fn idle_clients_are_told_their_share_never_more_than_the_capacity_in_all() {
    let (s, clock) = share_store(10.0);
    assert_eq!(s.get_capacity("a", &req("r", 0.0, None)).safe_capacity, 10.0, "alone: the whole capacity");
    // a was told 10 and may run on it until it hears otherwise: b's share waits.
    assert_eq!(s.get_capacity("b", &req("r", 0.0, None)).safe_capacity, 0.0);
    clock.advance(Duration::from_secs(5));
    assert_eq!(s.get_capacity("a", &req("r", 0.0, None)).safe_capacity, 5.0);
    assert_eq!(s.get_capacity("b", &req("r", 0.0, None)).safe_capacity, 5.0);
    assert_eq!(s.get_capacity("a", &req("r", 0.0, None)).safe_capacity, 5.0, "steady");
    // A new master learning knows nothing of the shares its predecessor
    // told: the safe capacity it tells is capped at the lease until it has
    // learnt (the first client back is not told the whole capacity).
    let (s, _clock) = learning_store(60, 5);
    s.become_master();
    let g = s.get_capacity("a", &req("r", 0.0, Some(0.0)));
    assert_eq!((g.capacity, g.safe_capacity), (0.0, 0.0));
    // A configured safe capacity is capped at the lease, as before.
    let mut t = (*template(Kind::FairShare, 10.0, 10, 5, 0)).clone();
    t.safe_capacity = Some(4.0);
    let s = Store::new(
        Clock::manual(Time::from_secs(1)).0,
        ResourcesConfig { templates: vec![Arc::new(t)] },
        Duration::ZERO,
    );
    assert_eq!(s.get_capacity("a", &req("r", 0.0, None)).safe_capacity, 0.0);
}

#[test]
fn an_idle_clients_share_is_lent_while_its_lease_runs_and_reserved_once_it_lapses() {
    let (s, clock) = share_store(10.0);
    s.get_capacity("a", &req("r", 0.0, None));
    s.get_capacity("b", &req("r", 10.0, None));
    clock.advance(Duration::from_secs(5));
    assert_eq!(s.get_capacity("a", &req("r", 0.0, None)).safe_capacity, 5.0);
    // b gets what a leaves while a's lease runs.
    let b = s.get_capacity("b", &req("r", 10.0, None));
    assert_eq!((b.capacity, b.safe_capacity), (10.0, 5.0));
    // a is cut off: its lease lapses at 15 s, it holds it (0) until 25 s,
    // then runs on its share (5). Reserved from the lapse, so b's next grant
    // (lasting to 25 s at most) leaves it room.
    clock.advance(Duration::from_secs(5));
    assert_eq!(s.get_capacity("b", &req("r", 10.0, None)).capacity, 10.0, "a's lease still runs");
    clock.advance(Duration::from_secs(5));
    let b = s.get_capacity("b", &req("r", 10.0, None));
    assert_eq!(b.capacity, 5.0, "a lapsed: its share is reserved");
    assert_eq!(s.status()[0].reserved, 5.0);
    // Kept through the hold (a refresh longer) and SHARE_KEPT after it; then b gets it all.
    clock.advance(Duration::from_secs(16) + SHARE_KEPT);
    assert_eq!(s.get_capacity("b", &req("r", 10.0, None)).capacity, 10.0);
    // a comes back before that: its reservation goes, it is served anew.
}

/// Three clients cut off together and coming back one by one: those back
/// first get no more than the capacity leaves beside the shares of those
/// still cut off (before, the first two got their whole demand, 70 of 60).
#[test]
fn clients_coming_back_one_by_one_leave_room_for_those_still_cut_off() {
    let (s, clock) = share_store(60.0);
    for round in 0..2 {
        for c in ["a", "b", "c"] {
            let g = s.get_capacity(c, &req("r", 35.0, None));
            if round == 1 {
                assert_eq!((g.capacity, g.safe_capacity), (20.0, 20.0), "{c}");
            }
        }
        clock.advance(Duration::from_secs(5));
    }
    // Cut off for 25 s: every lease lapsed and its hold ended.
    clock.advance(Duration::from_secs(20));
    assert_eq!(s.status()[0].reserved, 60.0);
    let a = s.get_capacity("a", &req("r", 35.0, None));
    let b = s.get_capacity("b", &req("r", 35.0, None));
    assert!(a.capacity + b.capacity + 20.0 <= 60.0 + 1e-9, "a {} b {} c on 20", a.capacity, b.capacity);
    assert!(a.safe_capacity + b.safe_capacity + 20.0 <= 60.0 + 1e-9);
    assert_eq!((a.capacity, b.capacity), (20.0, 20.0));
    // c back too: still within the capacity, and fair.
    let c = s.get_capacity("c", &req("r", 35.0, None));
    assert_eq!(c.capacity, 20.0);
}

#[derive(Debug, Clone)]
struct Told {
    safe: f64,
    asked: Time,
    expiry: Time,
    refresh: Duration,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random request sequences: what the server told its clients as their
    /// share, while it may be run on (its lease, its hold, then
    /// [`SHARE_KEPT`]), never adds up to more than the capacity.
    #[test]
    fn shares_told_stay_within_capacity(
        capacity in 0.0f64..500.0,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let (s, clock) = share_store(capacity);
        let mut model: HashMap<u8, Told> = HashMap::new();
        let lease = Duration::from_secs(10);
        for op in ops {
            match op {
                Op::Ask { client, wants, subclients } => {
                    let mut r = req("res", wants, None);
                    r.subclients = subclients;
                    let g = s.get_capacity(&format!("c{client}"), &r);
                    prop_assert!(g.safe_capacity >= 0.0);
                    model.insert(client, Told { safe: g.safe_capacity, asked: clock.now(), expiry: g.expiry, refresh: g.refresh_interval });
                }
                Op::Release { client } => {
                    s.release(&format!("c{client}"), "res");
                    model.remove(&client);
                }
                Op::Advance { millis } => clock.advance(Duration::from_millis(millis)),
            }
            let now = clock.now();
            model.retain(|_, t| {
                let hold = t.expiry.since(t.asked).min(lease) + t.refresh.mul_f64(7.0 / 6.0);
                t.expiry.saturating_add(hold + lease.max(SHARE_KEPT)) > now
            });
            let told: f64 = model.values().map(|t| t.safe).sum();
            prop_assert!(told <= capacity + 1e-6, "told {told} > {capacity}");
        }
    }
}

/// While a resource's clients are still arriving (its first refresh
/// interval), one whose wants grow past what it asked before (its measured
/// demand arriving) gets no more than its equal share: the others may be
/// about to ask for theirs. After it, max-min fairness as ever.
#[test]
fn a_client_whose_first_wants_understated_its_demand_grows_to_its_equal_share_while_others_arrive() {
    let (s, clock) = store(Kind::FairShare, 90.0, 0, Duration::ZERO);
    for c in ["a", "b", "c"] {
        assert_eq!(s.get_capacity(c, &req("r", 1.0, None)).capacity, 1.0);
    }
    clock.advance(Duration::from_secs(1));
    let a = s.get_capacity("a", &req("r", 50.0, None));
    assert_eq!((a.capacity, a.refresh_interval), (30.0, FAST_REFRESH), "its equal share, and come back soon");
    // A newcomer asking for much at once is not held to it (nothing it asked before understated).
    assert_eq!(s.get_capacity("d", &req("r", 20.0, None)).capacity, 20.0);
    // After the first refresh interval (5 s): what the others leave.
    clock.advance(Duration::from_secs(4));
    assert_eq!(s.get_capacity("a", &req("r", 90.0, None)).capacity, 90.0 - 1.0 - 1.0 - 20.0);
}

/// A client that reports its window (`w` seconds) wanting `wants`.
fn windowed(wants: f64, w: f64) -> LeaseRequest {
    LeaseRequest { window: Some(w), ..req("r", wants, None) }
}

/// Below the capacity, a lease that grows out of free capacity is credited
/// the pooled burst of its growth (its growth × the window), no more than
/// the pool holds; a client that reports no window (a Doorman client), and
/// a resource that keeps its spare capacity, pool nothing.
#[test]
fn a_grown_lease_is_credited_the_pooled_burst_of_its_growth() {
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, 100.0, 10, 5, 0)] };
    let s = Store::new(clock, cfg, Duration::ZERO);
    for c in ["a", "b", "c"] {
        let g = s.get_capacity(c, &windowed(5.0, 60.0));
        assert_eq!(g.credit, 0.0, "a first lease fills its bucket as `fresh` instead: {g:?}");
    }
    time.advance(ARRIVALS + Duration::from_secs(1));
    let before: Vec<f64> = ["a", "b", "c"].iter().map(|c| s.get_capacity(c, &windowed(5.0, 60.0)).capacity).collect();
    // Half of the spare stays free: the pool holds its burst.
    let free = 100.0 - before.iter().sum::<f64>();
    assert!(free >= 100.0 * POOLED_SPARE * (85.0 / 100.0) - 1e-9, "{before:?}");
    let a = s.get_capacity("a", &windowed(40.0, 60.0));
    let grown = a.capacity - before[0];
    assert!(grown > 0.0, "{a:?}");
    assert!(a.credit > 0.0 && a.credit <= grown * 60.0 + 1e-9, "credit {} for {grown}/s", a.credit);
    // The pool was drawn: at once, a second growth is credited no more than
    // what was left (the pool held at most the free capacity's burst).
    let b = s.get_capacity("b", &windowed(40.0, 60.0));
    assert!(a.credit + b.credit <= free * 60.0 + 1e-6, "{} + {} of {}", a.credit, b.credit, free * 60.0);

    // A Doorman client reports no window: no credit, and no pool.
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, 100.0, 10, 5, 0)] };
    let s = Store::new(clock, cfg, Duration::ZERO);
    s.get_capacity("a", &req("r", 5.0, None));
    time.advance(ARRIVALS + Duration::from_secs(1));
    s.get_capacity("a", &req("r", 5.0, None));
    let g = s.get_capacity("a", &req("r", 40.0, None));
    assert_eq!(g.credit, 0.0);

    // `spare: keep`: nothing is pooled.
    let (s, time) = store(Kind::FairShare, 100.0, 0, Duration::ZERO);
    s.get_capacity("a", &windowed(5.0, 60.0));
    time.advance(Duration::from_secs(6));
    let g = s.get_capacity("a", &windowed(40.0, 60.0));
    assert_eq!((g.capacity, g.credit), (40.0, 0.0));
}

proptest! {
    /// Three sidecars whose buckets hold their leases' share of a 60 s
    /// burst (full once their first leases settled, topped up by credits,
    /// refilled at their leases) spend no more than `capacity × T + burst`
    /// over any run of requests after that, however their wants move and
    /// whatever they spend. (The first leases are left out: a `fresh` fill
    /// is its own trade-off, see the proto's `fresh`.)
    #[test]
    fn credited_buckets_keep_the_fleet_bound(
        steps in proptest::collection::vec((0u64..2_000, [0.0f64..120.0, 0.0f64..120.0, 0.0f64..120.0], 0.0f64..1.0), 1..80),
    ) {
        let (cap, w) = (100.0, 60.0);
        let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
        let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, cap, 10, 5, 0)] };
        let s = Store::new(clock, cfg, Duration::ZERO);
        let clients = ["a", "b", "c"];
        for c in clients {
            s.get_capacity(c, &windowed(5.0, w));
        }
        time.advance(ARRIVALS + Duration::from_secs(1));
        // Every bucket starts full; the pool holds at most the rest of the burst.
        let mut leases = clients.map(|c| s.get_capacity(c, &windowed(5.0, w)).capacity);
        let mut buckets = leases.map(|l| l * w);
        let (mut t, mut spent) = (0.0, 0.0);
        for (ms, wants, spend) in steps {
            time.advance(Duration::from_millis(ms));
            let dt = ms as f64 / 1000.0;
            t += dt;
            for i in 0..3 {
                buckets[i] = (buckets[i] + leases[i] * dt).min(leases[i] * w);
            }
            for (i, c) in clients.into_iter().enumerate() {
                let g = s.get_capacity(c, &windowed(wants[i], w));
                prop_assert!(!g.fresh);
                leases[i] = g.capacity;
                buckets[i] = (buckets[i].min(g.capacity * w) + g.credit).min(g.capacity * w);
            }
            for b in &mut buckets {
                spent += *b * spend;
                *b *= 1.0 - spend;
            }
            prop_assert!(spent <= cap * t + cap * w + 1e-6, "spent {spent} in {t} s");
        }
    }
}

/// A client that keeps a reserve is given a bucket below its share of the
/// burst once another client shares the resource, the rest of its share
/// counted in the pool; what it gives back goes into the pool, and a backlog
/// it reports is credited at once, its lease grown or not. A Doorman client
/// (no window) gets neither, and a lone client keeps its whole share.
#[test]
fn a_reserve_pools_the_rest_of_a_share_and_a_backlog_is_credited() {
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, 100.0, 10, 5, 0)] };
    let s = Store::new(clock, cfg, Duration::ZERO);
    let w = 60.0;
    let reserving = |wants: f64, returned: f64, backlog: f64| LeaseRequest {
        bucket: BucketReport { reserve: Some(2.0), returned, backlog },
        ..windowed(wants, w)
    };
    let alone = s.get_capacity("a", &reserving(10.0, 0.0, 0.0));
    assert_eq!(alone.bucket, 0.0, "a lone client keeps its whole share: {alone:?}");
    s.get_capacity("b", &reserving(10.0, 0.0, 0.0));
    time.advance(ARRIVALS + Duration::from_secs(1));
    let a = s.get_capacity("a", &reserving(10.0, 0.0, 0.0));
    // Its reserve, and what its lease refills until its next request.
    let refill = a.capacity * a.refresh_interval.as_secs_f64();
    assert!(a.bucket > 0.0 && (a.bucket - (2.0 + refill + a.credit)).abs() < 1e-3, "{a:?}");
    assert!(a.bucket < a.capacity * w, "{a:?}");
    // What it gives back and its backlog: the backlog is credited though its lease stays.
    time.advance(Duration::from_secs(2));
    s.get_capacity("b", &reserving(10.0, 0.0, 0.0));
    let before = s.get_capacity("a", &reserving(10.0, a.bucket, 0.0));
    time.advance(Duration::from_secs(2));
    let after = s.get_capacity("a", &reserving(10.0, 0.0, 25.0));
    assert!((after.capacity - before.capacity).abs() < 1e-9, "{before:?} {after:?}");
    assert!((after.credit - 25.0).abs() < 1e-6, "the backlog is credited: {after:?}");
    assert!(after.pooled > 0.0, "{after:?}");
    // Its bucket holds the credit beside its reserve.
    assert!(after.bucket >= 25.0 + 2.0 - 1e-3, "{after:?}");
    // A Doorman client: no bucket and no credit, whatever it sends.
    let d = s.get_capacity(
        "d",
        &LeaseRequest {
            bucket: BucketReport { reserve: Some(2.0), returned: 0.0, backlog: 50.0 },
            ..req("r", 10.0, None)
        },
    );
    assert_eq!((d.bucket, d.credit), (0.0, 0.0), "{d:?}");
}

/// What the pool of resource `id` holds now.
fn pool_level(s: &Store, id: &str) -> f64 {
    let map = s.resources.read().unwrap();
    map.get(id).and_then(|r| r.lock().unwrap().pool.as_ref().map(|p| p.level())).unwrap_or(0.0)
}

/// Three idle clients that ask every 3 s give back what their buckets
/// refill above their reserves, for minutes: the pool fills up to the burst
/// their buckets do not hold, never beyond.
#[test]
fn idle_clients_fill_the_pool_up_to_the_burst_and_no_more() {
    let (cap, w, reserve) = (100.0, 60.0, 30.0);
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, cap, 10, 5, 0)] };
    let s = Store::new(clock, cfg, Duration::ZERO);
    let ask = |returned: f64| LeaseRequest {
        bucket: BucketReport { reserve: Some(reserve), returned, backlog: 0.0 },
        ..windowed(20.0, w)
    };
    let clients = ["a", "b", "c"];
    let (mut sizes, mut buckets, mut leases, mut owed) = ([0.0; 3], [0.0; 3], [0.0; 3], [0.0f64; 3]);
    for round in 0..200 {
        for (i, c) in clients.into_iter().enumerate() {
            let limited = sizes[i] > 0.0 && sizes[i] < leases[i] * w - 1e-9;
            let above = if limited { (buckets[i] - reserve).max(0.0) } else { 0.0 };
            buckets[i] -= above;
            let returned = above + std::mem::take(&mut owed[i]);
            let g = s.get_capacity(c, &ask(returned));
            leases[i] = g.capacity;
            sizes[i] = if g.bucket > 0.0 { g.bucket } else { g.capacity * w };
            // What a bucket from the server clips is owed, and given back with the next request.
            if g.bucket > 0.0 {
                owed[i] += (buckets[i] - sizes[i]).max(0.0);
            }
            buckets[i] = if g.fresh { sizes[i] } else { (buckets[i].min(sizes[i]) + g.credit).min(sizes[i]) };
        }
        let pooled = pool_level(&s, "r");
        let held = buckets.iter().sum::<f64>() + pooled + owed.iter().sum::<f64>();
        assert!(held <= cap * w + 1e-6, "round {round}: {buckets:?}, {owed:?} owed and {pooled} in the pool");
        time.advance(Duration::from_secs(3));
        for i in 0..3 {
            buckets[i] = (buckets[i] + leases[i] * 3.0).min(sizes[i]);
        }
    }
    let pooled = pool_level(&s, "r");
    // Most of the burst is pooled by then.
    assert!(pooled > 0.8 * cap * w, "{pooled} of {} pooled; buckets {buckets:?}", cap * w);
}

proptest! {
    /// Three clients keep reserves and give back what their buckets hold
    /// above them at each request, with backlogs of any size; each bucket
    /// refills at its lease, up to the bucket its last answer gave it (or
    /// its share of the burst), and takes its credits up to that size. Over
    /// the run they spend no more than `capacity × T + burst`, whatever they
    /// spend when.
    #[test]
    fn given_back_buckets_keep_the_fleet_bound(
        steps in proptest::collection::vec(
            (
                0u64..6_000,
                [0.0f64..120.0, 0.0f64..120.0, 0.0f64..120.0],
                [0.0f64..3_000.0, 0.0f64..3_000.0, 0.0f64..3_000.0],
                // Long idle spells, then everything at once, as well as anything between.
                prop_oneof![Just(0.0), Just(0.0), Just(1.0), 0.0f64..1.0],
            ),
            1..120,
        ),
    ) {
        let (cap, w) = (100.0, 60.0);
        let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
        let cfg = ResourcesConfig { templates: vec![sharing(Kind::FairShare, cap, 10, 5, 0)] };
        let s = Store::new(clock, cfg, Duration::ZERO);
        let clients = ["a", "b", "c"];
        let reserve = 30.0;
        let ask = |wants: f64, returned: f64, backlog: f64| LeaseRequest {
            bucket: BucketReport { reserve: Some(reserve), returned, backlog },
            ..windowed(wants, w)
        };
        for c in clients {
            s.get_capacity(c, &ask(5.0, 0.0, 0.0));
        }
        time.advance(ARRIVALS + Duration::from_secs(1));
        // Every bucket starts full; the pool holds at most the rest of the burst.
        let mut leases = [0.0; 3];
        let mut sizes = [0.0; 3];
        for (i, c) in clients.into_iter().enumerate() {
            let g = s.get_capacity(c, &ask(5.0, 0.0, 0.0));
            leases[i] = g.capacity;
            sizes[i] = if g.bucket > 0.0 { g.bucket } else { g.capacity * w };
        }
        let mut buckets = sizes;
        let mut owed = [0.0f64; 3];
        let (mut t, mut spent) = (0.0, 0.0);
        for (ms, wants, backlogs, spend) in steps {
            time.advance(Duration::from_millis(ms));
            let dt = ms as f64 / 1000.0;
            t += dt;
            for i in 0..3 {
                buckets[i] = (buckets[i] + leases[i] * dt).min(sizes[i]);
            }
            for (i, c) in clients.into_iter().enumerate() {
                let limited = sizes[i] < leases[i] * w - 1e-9;
                let above = if limited { (buckets[i] - reserve).max(0.0) } else { 0.0 };
                buckets[i] -= above;
                let returned = above + std::mem::take(&mut owed[i]);
                let g = s.get_capacity(c, &ask(wants[i], returned, backlogs[i]));
                leases[i] = g.capacity;
                sizes[i] = if g.bucket > 0.0 { g.bucket } else { g.capacity * w };
                // What a bucket from the server clips is owed, and given back with the next request.
                if g.bucket > 0.0 {
                    owed[i] += (buckets[i] - sizes[i]).max(0.0);
                }
                buckets[i] = (buckets[i].min(sizes[i]) + g.credit).min(sizes[i]);
            }
            let pooled = pool_level(&s, "r");
            // The buckets, what they owe and the pool never hold more than the burst.
            let held = buckets.iter().sum::<f64>() + pooled + owed.iter().sum::<f64>();
            prop_assert!(held <= cap * w + 1e-6, "{buckets:?}, {owed:?} owed and {pooled} in the pool");
            for b in &mut buckets {
                spent += *b * spend;
                *b *= 1.0 - spend;
            }
            prop_assert!(spent <= cap * t + cap * w + 1e-6, "spent {spent} in {t} s");
        }
    }
}

/// A resource's clients move from the inline list to the map and back as
/// they come and go: every lease keeps its own slot, slots are reused, and
/// the sums are the same as if the clients had come in one go.
#[test]
fn clients_past_the_inline_few_keep_their_slots_and_sums() {
    let mut r = Resource::new(template(Kind::FairShare, 1000.0, 10, 5, 0));
    let d = Decision { learning: true, min_interval: Duration::ZERO, again: false, arrivals: true };
    let now = Time::from_secs(500);
    let ask = |r: &mut Resource, id: &str, n: f64| r.decide(id, &req("x", n, Some(n)), now, d, Role::Root);
    let check = |r: &Resource, ids: &[String]| {
        let mut slots: Vec<ClientSlot> = ids.iter().map(|id| r.clients.get(id).expect("a lease").slot).collect();
        for (id, s) in ids.iter().zip(&slots) {
            assert_eq!(r.clients.owner(*s).as_deref(), Some(id.as_str()), "slot {s} names its client");
        }
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), ids.len(), "one slot per client");
        let wants: f64 = ids.iter().map(|id| id[1..].parse::<f64>().unwrap()).sum();
        assert_eq!((r.clients.len(), r.index.len(), r.index.total_has()), (ids.len(), ids.len(), wants));
    };
    let mut ids: Vec<String> = (1..=12).map(|i| format!("c{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        ask(&mut r, id, (i + 1) as f64);
        check(&r, &ids[..=i]);
    }
    assert!(matches!(r.clients, few::Clients::Many(_)));
    for id in ["c3", "c7", "c12"] {
        r.remove(id);
        ids.retain(|i| i != id);
        check(&r, &ids);
    }
    for id in ["c20", "c30", "c40"] {
        ask(&mut r, id, id[1..].parse().unwrap());
        ids.push(id.to_string());
        check(&r, &ids);
    }
    let max_slot = ids.iter().map(|id| r.clients.get(id).unwrap().slot).max();
    assert_eq!(max_slot, Some(11), "freed slots are reused before new ones");
    for id in std::mem::take(&mut ids) {
        r.remove(&id);
    }
    assert!(matches!(&r.clients, few::Clients::Few(v) if v.capacity() == 0), "the last client takes the storage");
    ask(&mut r, "c5", 5.0);
    check(&r, &["c5".to_string()]);
}

/// The first few resources in rank order, found while holding a bounded
/// number of statuses, are the ones a full sort finds; every resource is
/// seen once on the way.
#[test]
fn top_status_matches_a_full_ranking() {
    let (s, _clock) = store(Kind::FairShare, 1000.0, 0, Duration::ZERO);
    for i in 0..300u32 {
        // Many ties (the same wants), broken by id.
        s.get_capacity("a", &req(&format!("r{i}"), f64::from(i % 17), None));
    }
    let mut all = s.status();
    rank(&mut all);
    for max in [0, 1, 10, 150, 1000] {
        let mut seen = 0;
        let (top, total) = s.top_status(max, |_| seen += 1);
        assert_eq!((total, seen), (300, 300));
        let ids = |v: &[ResourceStatus]| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&top), ids(&all[..max.min(300)]), "the first {max}");
    }
}

/// Reservations go from nothing to a vector to a map and back, and find,
/// replace and drop each client's as a map alone would.
#[test]
fn reservations_past_the_inline_few_behave_as_a_map() {
    let r = |amount: f64| Reservation {
        amount,
        hold_until: Time::from_secs(1),
        then: amount,
        until: Time::from_secs(2),
        epoch: None,
        holders: 0,
        told: 0.0,
        sharers: 0,
    };
    let (mut ours, mut map) = (few::Reservations::default(), HashMap::new());
    let same = |ours: &few::Reservations, map: &HashMap<String, Reservation>| {
        let mut a: Vec<f64> = ours.values().map(|r| r.amount).collect();
        let mut b: Vec<f64> = map.values().map(|r| r.amount).collect();
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        assert_eq!(a, b);
        assert!(map.keys().all(|k| ours.get(k).map(|r| r.amount) == Some(map[k].amount)));
        assert_eq!(ours.is_empty(), map.is_empty());
    };
    for i in 0..12 {
        let id = format!("c{i}");
        assert_eq!(ours.insert(Arc::from(id.as_str()), r(i as f64)), map.insert(id, r(i as f64)));
        same(&ours, &map);
    }
    assert!(matches!(ours, few::Reservations::Many(_)));
    assert_eq!(ours.insert(Arc::from("c3"), r(30.0)).map(|r| r.amount), Some(3.0));
    map.insert("c3".into(), r(30.0));
    assert_eq!(ours.remove("c4").map(|r| r.amount), map.remove("c4").map(|r| r.amount));
    ours.retain(|_, r| r.amount < 8.0);
    map.retain(|_, r| r.amount < 8.0);
    same(&ours, &map);
    ours.retain(|_, _| false);
    assert!(matches!(ours, few::Reservations::None), "an emptied set holds no storage");
    ours.insert(Arc::from("c1"), r(1.0));
    assert!(ours.contains_key("c1") && !ours.contains_key("c2"));
}
