//! A calendar quota's unit, counted through the store: allotments at a
//! boundary, what clients report, clients that leave or restart, a new
//! master in the middle of a unit.

use std::time::Duration;

use super::super::*;
use crate::calendar::Account;
use usher_core::config::resources::{Algorithm, ResourcesConfig, Template};

/// A minute's boundary (1,800,000,000 is a whole number of minutes).
const BOUNDARY: u64 = 1_800_000_000;

/// 120 a minute, shared FAIR_SHARE as allotments; `learning` seconds of learning mode.
fn store(learning: u64, min_interval: Duration) -> (Store, Arc<usher_core::clock::ManualClock>) {
    let (clock, time) = Clock::manual(Time::from_secs(BOUNDARY));
    let template = Template {
        identifier_glob: "*".into(),
        capacity: 2.0,
        safe_capacity: None,
        description: None,
        algorithm: Algorithm {
            kind: Kind::FairShare,
            lease_length: Duration::from_secs(60),
            refresh_interval: Duration::from_secs(15),
            learning_mode_duration: Duration::from_secs(learning),
            parameters: vec![],
        },
        calendar: Some(Duration::from_secs(60)),
    };
    let store = Store::new(clock, ResourcesConfig { templates: vec![Arc::new(template)] }, min_interval);
    (store, time)
}

/// Seconds from the first boundary.
fn at(s: f64) -> Time {
    Time::from_nanos(((BOUNDARY as f64 + s) * 1e9) as u64)
}

/// A request wanting `wants` per second, with an account if it has one.
fn ask(wants: f64, account: Option<(f64, f64, f64)>) -> LeaseRequest {
    LeaseRequest {
        bucket: Default::default(),
        resource_id: "cal".into(),
        wants,
        subclients: 1,
        reported_has: None,
        reported_expiry: None,
        requester: Requester::Client { priority: 0 },
        window: None,
        quota: None,
        account: account.map(|(reset, spent, left)| Account {
            reset: at(reset),
            spent,
            left,
            passed: false,
            charged: None,
        }),
    }
}

/// The allotment `client` gets for `req`, to a millionth.
fn allotted(s: &Store, client: &str, req: &LeaseRequest) -> f64 {
    (s.get_capacity(client, req).allotment.expect("an allotment") * 1e6).round() / 1e6
}

fn to(time: &usher_core::clock::ManualClock, s: f64) {
    let now = time.now();
    time.advance(at(s).since(now));
}

/// At a boundary every client known then gets its equal share of the whole
/// unit at once, whatever it asked for; what is allotted is not allotted
/// twice; a client that leaves keeps its part counted until the next
/// boundary, where the whole unit is there again.
#[test]
fn a_boundary_shares_the_whole_unit_as_equal_allotments() {
    let (s, time) = store(0, Duration::from_secs(1));
    s.set_predecessor(Predecessor::NoneOutstanding);
    to(&time, 1.0);
    for c in ["a", "b", "c"] {
        s.get_capacity(c, &ask(0.5, None));
    }
    to(&time, 60.1);
    // `a` saw its app's burst (it wants 25 a second), `b` and `c` did not yet.
    let wants = [("a", 25.0), ("b", 0.0), ("c", 0.0)];
    let grants: Vec<Grant> = wants.iter().map(|(c, w)| s.get_capacity(c, &ask(*w, Some((60.0, 0.0, 0.0))))).collect();
    // (Less what their rate leases of the last unit allowed since the boundary.)
    let first = grants[0].allotment.unwrap();
    for g in &grants {
        assert!((g.allotment.unwrap() - first).abs() < 1e-9 && (first - 40.0).abs() < 0.1, "equal thirds: {grants:?}");
        // The lease is the allotment over the time to the reset and a lag, for clients that know no allotments.
        assert!((g.capacity - first / 60.4).abs() < 1e-9, "{g:?}");
    }
    assert_eq!(allotted(&s, "d", &ask(5.0, None)), 0.0, "nothing is allotted twice");
    // `a` spent all of its part at once: nothing more while `b` and `c` hold theirs.
    to(&time, 61.2);
    assert_eq!(allotted(&s, "a", &ask(25.0, Some((120.0, first, 0.0)))), 0.0);
    // `c` leaves holding its part: still counted.
    s.release("c", "cal");
    to(&time, 62.4);
    assert_eq!(allotted(&s, "a", &ask(25.0, Some((120.0, first, 0.0)))), 0.0);
    s.get_capacity("b", &ask(0.0, Some((120.0, 0.0, first))));
    s.get_capacity("d", &ask(5.0, None));
    let status = s.status().into_iter().find(|r| r.id == "cal").unwrap();
    assert_eq!(status.quota.as_ref().map(|q| q.source), Some("calendar"));
    // The next boundary: the whole unit again, in equal parts for those
    // still there (less what `d`'s rate lease allowed since the boundary).
    to(&time, 120.2);
    for c in ["a", "b", "d"] {
        assert!((allotted(&s, c, &ask(1.0, Some((120.0, 0.0, 0.0)))) - 40.0).abs() < 0.1, "{c}");
    }
}

/// What a client reports moves from its allotment to its spent; a request
/// too soon gets its commitment back unchanged; a client restarted under
/// the same id (it reports less spent, or nothing) keeps its old
/// commitment counted; one whose lease expires too.
#[test]
fn what_clients_report_and_what_they_left_behind_are_counted() {
    let (s, time) = store(0, Duration::from_secs(1));
    s.set_predecessor(Predecessor::NoneOutstanding);
    to(&time, 1.0);
    s.get_capacity("a", &ask(10.0, None));
    s.get_capacity("b", &ask(10.0, None));
    to(&time, 60.0);
    let a = s.get_capacity("a", &ask(10.0, Some((60.0, 0.0, 0.0)))).allotment.unwrap();
    let b = s.get_capacity("b", &ask(10.0, Some((60.0, 0.0, 0.0)))).allotment.unwrap();
    assert_eq!((a, b), (60.0, 60.0));
    // Half a second on, `a` spent 10: too soon for a new decision, its commitment stands.
    to(&time, 60.5);
    assert_eq!(allotted(&s, "a", &ask(10.0, Some((120.0, 10.0, 50.0)))), 50.0);
    // `a` restarts under the same id: its first request has no account.
    // Its 10 spent and 50 held stay counted; `b` holds 60: nothing is left.
    to(&time, 62.0);
    assert_eq!(allotted(&s, "a", &ask(10.0, None)), 0.0);
    // `b` spent 30 and gives the rest back: what it spent stays, the 30 it did not goes to `a`.
    to(&time, 63.0);
    assert_eq!(allotted(&s, "b", &ask(0.0, Some((120.0, 30.0, 30.0)))), 0.0);
    to(&time, 64.0);
    let a = s.get_capacity("a", &ask(10.0, Some((120.0, 0.0, 0.0)))).allotment.unwrap();
    assert!((a - 30.0).abs() < 1e-6, "{a}");
    to(&time, 65.0);
    assert_eq!(allotted(&s, "a", &ask(10.0, Some((120.0, 20.0, 10.0)))), 10.0);
    // `a` reports less spent than before (restarted again, after its first
    // answer): its 20 spent and 10 held stay counted, and the unit is spent.
    to(&time, 66.0);
    assert_eq!(allotted(&s, "a", &ask(10.0, Some((120.0, 1.0, 0.0)))), 0.0);
    assert_eq!(s.status()[0].quota.as_ref().unwrap().remaining, 0.0);
    // `b`'s lease expires unrenewed: its 30 spent stay counted.
    to(&time, 125.0);
    let g = s.get_capacity("a", &ask(10.0, Some((120.0, 0.0, 0.0))));
    assert_eq!(g.allotment, Some(120.0), "a new unit, `b` gone: all of it");
}

/// A new master in the middle of a unit learns what its clients hold (their
/// allotments as they stand) and counts the larger of what they report and
/// the fleet having spent evenly until then.
#[test]
fn a_new_master_counts_what_clients_report_or_even_spending() {
    let (s, time) = store(10, Duration::from_secs(1));
    to(&time, 30.0);
    s.become_master();
    // Learning: each gets back what it says is left.
    assert_eq!(allotted(&s, "a", &ask(0.0, Some((60.0, 50.0, 10.0)))), 10.0);
    assert_eq!(allotted(&s, "b", &ask(0.0, Some((60.0, 20.0, 5.0)))), 5.0);
    assert!(s.status()[0].learning_mode);
    to(&time, 41.0);
    // 50 + 10 + 20 + 5 = 85 counted (more than the even 60): 35 to share, all to a newcomer that wants them.
    let g = s.get_capacity("c", &ask(100.0, None));
    assert!((g.allotment.unwrap() - 35.0).abs() < 1e-6, "{g:?}");

    // Had they reported less than even spending, even spending counts.
    let (s, time) = store(10, Duration::from_secs(1));
    to(&time, 30.0);
    s.become_master();
    s.get_capacity("a", &ask(0.0, Some((60.0, 5.0, 0.0))));
    to(&time, 41.0);
    let g = s.get_capacity("c", &ask(100.0, None));
    assert!((g.allotment.unwrap() - 60.0).abs() < 1e-6, "half the minute gone when it became master: {g:?}");
}

/// The status page shows the unit now running, also when no request came
/// since the last one ended: its whole quota, and a reset ahead.
#[test]
fn the_status_page_shows_the_running_unit_after_a_quiet_boundary() {
    let (s, time) = store(0, Duration::from_secs(1));
    s.set_predecessor(Predecessor::NoneOutstanding);
    to(&time, 1.0);
    s.get_capacity("a", &ask(10.0, None));
    to(&time, 130.0);
    let r = s.status().into_iter().find(|r| r.id == "cal").expect("the resource");
    let q = r.quota.expect("the calendar's quota");
    assert_eq!(q.source, "calendar");
    assert!((q.reset_in_s - 50.0).abs() < 1e-6, "the reset of the unit now running: {}", q.reset_in_s);
    assert!((q.remaining - 120.0).abs() < 1e-6, "nothing spent of it: {}", q.remaining);
}
