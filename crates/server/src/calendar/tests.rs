use super::*;

const MINUTE: Duration = Duration::from_secs(60);

/// Seconds into a UTC minute (1,800,000,000 is a whole number of minutes).
fn t(s: f64) -> Time {
    Time::from_nanos(((1_800_000_000.0 + s) * 1e9) as u64)
}

fn account(reset: f64, spent: f64, left: f64) -> Option<Account> {
    Some(Account { reset: t(reset), spent, left, passed: false, charged: None })
}

/// A new deployment has the whole unit; a root that starts in the middle
/// of one assumes the fleet spent evenly until then, unless its clients
/// report more; the boundary renews it whole.
#[test]
fn a_unit_is_whole_from_its_start_and_a_late_root_counts_at_least_even_spending() {
    let fresh = Calendar::new(MINUTE, 120.0, t(15.0), true);
    assert_eq!(fresh.capacity_units(120.0, 0.0), 120.0, "a new deployment has all of it");
    let mut c = Calendar::new(MINUTE, 120.0, t(15.0), false);
    assert!((c.capacity_units(120.0, 0.0) - 90.0).abs() < 1e-9, "a quarter of the minute gone");
    // `a` reports 5 spent and 10 left: less than assumed, which still counts
    // (as some other client's), so 90 more can go beside its 10.
    assert_eq!(c.report("a", account(60.0, 5.0, 10.0), 0.0), 10.0, "learning hands back what is left");
    assert!((c.capacity_units(120.0, 10.0) - 100.0).abs() < 1e-9);
    // `b` reports 40 spent: more than assumed, which no longer counts.
    c.report("b", account(60.0, 40.0, 0.0), 0.0);
    assert!((c.capacity_units(120.0, 10.0) - (120.0 - 45.0)).abs() < 1e-9);
    assert_eq!(c.observation(t(20.0), 120.0).remaining, 75.0);
    // The boundary: whole again, the assumption gone, the reports too.
    assert_eq!(c.advance(t(60.5)), Some(t(60.0)));
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0);
    assert_eq!(c.reset(), t(120.0));
    assert!(!c.counts(t(61.0)), "nothing counted in the new unit yet");
}

/// A report moves what was spent from the outstanding allotment to the
/// spent; a client that reports less spent than before (restarted under
/// the same id), or that stops reporting, keeps its old commitment counted
/// until the boundary; so does one that leaves.
#[test]
fn what_a_client_committed_stays_counted_until_the_boundary() {
    let mut c = Calendar::new(MINUTE, 120.0, t(0.0), true);
    // `a` was allotted 40 and spent 25 of it: it holds 15.
    assert_eq!(c.report("a", account(60.0, 25.0, 15.0), 40.0), 15.0);
    assert_eq!(c.capacity_units(120.0, 15.0), 95.0);
    // A lost answer: it says more is left than was counted; the larger counts.
    assert_eq!(c.report("a", account(60.0, 30.0, 20.0), 15.0), 20.0);
    // Restarted: it reports 2 spent. Its old 30 spent and 20 held stay counted.
    assert_eq!(c.report("a", account(60.0, 2.0, 0.0), 20.0), 0.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0 - 50.0 - 2.0);
    // `b` reports 10 spent, holds 5, then stops reporting (it forgot the key).
    assert_eq!(c.report("b", account(60.0, 10.0, 5.0), 5.0), 5.0);
    assert_eq!(c.report("b", None, 5.0), 0.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0 - 52.0 - 15.0);
    // `a` leaves holding 8: its 2 spent and 8 held stay.
    c.report("a", account(60.0, 2.0, 8.0), 8.0);
    c.forget("a", 8.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0 - 52.0 - 15.0 - 8.0);
    assert!(c.counts(t(30.0)), "a resource with nobody left keeps its count");
    // An account of a later unit (a clock ahead) is not taken.
    assert_eq!(c.in_unit(Account { reset: t(120.0), spent: 1.0, left: 0.0, passed: false, charged: None }), None);
    c.advance(t(61.0));
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0);
}

/// Costs settled below their charges lower what a client reports spent:
/// what they gave back is the fleet's again, and the client holds it. Only
/// a running total of charges that falls says the client restarted.
#[test]
fn a_settled_refund_is_given_back_and_only_fewer_charges_mean_a_restart() {
    let mut c = Calendar::new(MINUTE, 120.0, t(0.0), true);
    let charged = |spent: f64, left: f64, charged: f64| {
        Some(Account { reset: t(60.0), spent, left, passed: false, charged: Some(charged) })
    };
    // `a` was allotted 40 and charged 25 (five calls at 5 each): it holds 15.
    assert_eq!(c.report("a", charged(25.0, 15.0, 25.0), 40.0), 15.0);
    assert_eq!(c.capacity_units(120.0, 15.0), 95.0, "what it holds is the algorithm's to count");
    // Four of them settled at 1: 16 given back. It spent 9 and holds 31.
    assert_eq!(c.report("a", charged(9.0, 31.0, 25.0), 15.0), 31.0);
    assert_eq!(c.capacity_units(120.0, 31.0), 120.0 - 9.0);
    // Restarted: its running total starts again. Its 9 spent and 31 held stay counted.
    assert_eq!(c.report("a", charged(2.0, 0.0, 2.0), 31.0), 0.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0 - 40.0 - 2.0);
}

/// A client that reports no account (a Doorman client) is counted by what
/// its lease's rate allows as time passes, across the boundary too.
#[test]
fn a_rate_lease_is_counted_as_it_runs() {
    let mut c = Calendar::new(MINUTE, 120.0, t(0.0), true);
    c.report("doorman", None, 0.0);
    c.leased("doorman", 2.0);
    c.advance(t(20.0));
    assert!((c.capacity_units(120.0, 0.0) - 80.0).abs() < 1e-9);
    c.leased("doorman", 1.0);
    c.advance(t(50.0));
    assert!((c.capacity_units(120.0, 0.0) - 50.0).abs() < 1e-9);
    // Across the boundary only what ran after it counts.
    c.advance(t(62.0));
    assert!((c.capacity_units(120.0, 0.0) - 118.0).abs() < 1e-9);
    // Its first report: its rate no longer runs; what it allowed stays.
    c.report("doorman", account(120.0, 1.0, 3.0), 4.0);
    c.advance(t(70.0));
    assert!((c.capacity_units(120.0, 3.0) - (120.0 - 2.0 - 1.0)).abs() < 1e-9);
    c.forget("doorman", 3.0);
    assert!((c.capacity_units(120.0, 0.0) - (120.0 - 2.0 - 4.0)).abs() < 1e-9);
}

/// An allotment's rate: over the time to the reset plus a lag (a quarter of
/// it, at most half a second).
#[test]
fn an_allotment_is_a_rate_over_the_time_to_the_reset() {
    let c = Calendar::new(MINUTE, 120.0, t(0.0), true);
    assert!((1.0 / c.per_second(t(0.0)) - 60.5).abs() < 1e-9);
    assert!((1.0 / c.per_second(t(59.0)) - 1.25).abs() < 1e-9);
    assert!((c.capacity(t(0.0), 120.0, 0.0) - 120.0 / 60.5).abs() < 1e-9);
}

/// An account read just before a reset and sent just after it is one of the
/// unit that ended: nothing of the new unit is spent. One that says the
/// reset has passed counts from it.
#[test]
fn an_account_of_the_unit_that_ended_counts_nothing_of_the_new_one() {
    let mut c = Calendar::new(MINUTE, 120.0, t(0.0), true);
    c.advance(t(60.05));
    let stale = Account { reset: t(60.0), spent: 119.0, left: 1.0, passed: false, charged: None };
    assert_eq!(c.in_unit(stale), Some(Account { spent: 0.0, left: 0.0, ..stale }));
    assert_eq!(c.report("a", Some(stale), 0.0), 0.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 120.0, "the new unit is whole");
    let passed = Account { reset: t(60.0), spent: 2.0, left: 0.0, passed: true, charged: None };
    assert_eq!(c.in_unit(passed), Some(passed));
    c.report("a", Some(passed), 0.0);
    assert_eq!(c.capacity_units(120.0, 0.0), 118.0);
    // Counting from an earlier reset still: more than this unit's spending, never less.
    let long = Account { reset: t(0.0), spent: 5.0, left: 0.0, passed: true, charged: None };
    assert_eq!(c.in_unit(long), Some(long));
}
