//! Until when a master's leases may be outstanding, recorded in etcd next to
//! its node's election key, so that the next master learns only while
//! something can be outstanding.
//!
//! A new master knows nothing of the leases its predecessor handed out, so it
//! starts in learning mode (see `store`). But a fresh deployment has no
//! predecessor, and a master that comes back after every lease has expired has
//! nothing to learn either; learning then only holds every client at the
//! lease it reports (0 at a cold start), or, once clients whose leases lapsed
//! run on their safe capacity, only needs to hear from them, which takes the
//! reconnect allowance. So every master records in etcd, at
//! `<election key>/leases-until`, a time by which every lease it has handed out
//! or will hand out before its next write has expired: `now + longest lease +
//! the write interval`, written when it wins the election (before it hands out
//! anything) and again at every renewal. The store never hands out a lease
//! expiring after the last time written ([`Store::set_lease_horizon`]), so a
//! late write shortens leases rather than leaving one uncovered. A new master
//! that finds no record skips learning; one that finds a time more than the
//! longest lease past (clients hold a lapsed lease that long; allowing
//! [`CLOCK_SKEW`] between the servers' clocks) learns only for the reconnect
//! allowance; one that finds a later time learns until that time plus the
//! longest lease at the latest.
//!
//! [`Store::set_lease_horizon`]: super::store::Store::set_lease_horizon

use std::time::Duration;

use super::Node;
use super::etcd::{Etcd, EtcdError};
use super::store::Predecessor;
use usher_core::clock::{Clock, Time};

/// What two servers' clocks may differ by: a recorded time counts as passed
/// only this long after it.
pub const CLOCK_SKEW: Duration = Duration::from_secs(2);

/// The record's key: next to the election key, so whatever may write that may
/// write this too.
pub fn record_key(election_key: &str) -> String {
    format!("{}/leases-until", election_key.trim_end_matches('/'))
}

/// The time to record at `now`: every lease handed out until the next write,
/// due within `every`, has expired by then.
pub fn horizon(now: Time, longest_lease: Duration, every: Duration) -> Time {
    now.saturating_add(longest_lease + every)
}

/// The record's value: milliseconds since the Unix epoch.
pub fn encode(t: Time) -> String {
    (t.as_nanos() / 1_000_000).to_string()
}

/// What a new master makes of the record it found at `now`, when clients
/// hold an expired lease for up to `hold` (the longest lease: see
/// `lease::Mode::Held`).
pub fn predecessor(record: Option<&str>, now: Time, hold: Duration) -> Predecessor {
    match record.map(|v| v.trim().parse::<u64>()) {
        None => outstanding(None, now, hold),
        Some(Ok(ms)) => outstanding(Some(Time::from_nanos(ms.saturating_mul(1_000_000))), now, hold),
        // Not ours to read: learn, as without a record.
        Some(Err(_)) => Predecessor::Unknown,
    }
}

/// What a new master makes of a recorded time (`None`: no record) at `now`:
/// a lease that lapsed unrenewed is still held by its client for up to
/// `hold` after the recorded time, so until then something is outstanding.
pub fn outstanding(recorded: Option<Time>, now: Time, hold: Duration) -> Predecessor {
    match recorded.map(|t| t.saturating_add(CLOCK_SKEW + hold)) {
        Some(until) if until > now => Predecessor::Until(until),
        // Leases and their holds lapsed: their clients may run on their safe capacity.
        Some(_) => Predecessor::Lapsed,
        None => Predecessor::NoneOutstanding,
    }
}

/// When a server has won its node's election, before it acts as master:
/// reads what its predecessor recorded and records its own horizon. The
/// caller makes it master and then calls [`apply`]; on an error it must not
/// become master (its leases would not be covered by a record).
pub async fn take_over(
    etcd: &Etcd,
    election_key: &str,
    node: &Node,
    clock: &Clock,
    every: Duration,
) -> Result<(Predecessor, Time), EtcdError> {
    let key = record_key(election_key);
    let found = etcd.get(&key).await?;
    let now = clock.now();
    let before = predecessor(found.as_deref(), now, node.store.longest_lease());
    if before == Predecessor::Unknown {
        tracing::warn!(key = %key, value = ?found, "unreadable lease record; learning as if nothing were known");
    }
    let h = horizon(now, node.store.longest_lease(), every);
    etcd.put(&key, &encode(h)).await?;
    Ok((before, h))
}

/// Tells the store, once this server is master, what [`take_over`] found and wrote.
pub fn apply(node: &Node, (before, h): (Predecessor, Time)) {
    match before {
        Predecessor::NoneOutstanding => tracing::info!("no predecessor on record: learning mode skipped"),
        Predecessor::Lapsed => {
            tracing::info!("a predecessor's leases have all expired: learning only while clients reconnect")
        }
        Predecessor::Until(t) => {
            tracing::info!(until_unix_s = t.as_secs(), "a predecessor's leases may be outstanding")
        }
        Predecessor::Unknown => {}
    }
    node.store.set_predecessor(before);
    node.store.set_lease_horizon(Some(h));
}

/// At every renewal of the master's election lease: records the horizon again.
pub async fn renew(
    etcd: &Etcd,
    election_key: &str,
    node: &Node,
    clock: &Clock,
    every: Duration,
) -> Result<(), EtcdError> {
    let h = horizon(clock.now(), node.store.longest_lease(), every);
    etcd.put(&record_key(election_key), &encode(h)).await?;
    node.store.set_lease_horizon(Some(h));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_says_whether_anything_can_be_outstanding() {
        let now = Time::from_secs(1_800_000_000);
        let zero = Duration::ZERO;
        assert_eq!(predecessor(None, now, zero), Predecessor::NoneOutstanding, "no record: a fresh deployment");
        let passed = encode(now.saturating_sub(CLOCK_SKEW));
        assert_eq!(
            predecessor(Some(&passed), now, zero),
            Predecessor::Lapsed,
            "expired leases, clients on safe capacity"
        );
        let later = now.saturating_add(Duration::from_secs(30));
        assert_eq!(predecessor(Some(&encode(later)), now, zero), Predecessor::Until(later.saturating_add(CLOCK_SKEW)));
        let just = encode(now.saturating_sub(Duration::from_secs(1)));
        assert!(matches!(predecessor(Some(&just), now, zero), Predecessor::Until(_)), "within the clock skew");
        assert_eq!(predecessor(Some("soon"), now, zero), Predecessor::Unknown);
        // Clients hold lapsed leases for up to a lease length: a record 50 s
        // past still has leases outstanding with leases of 60 s, until the
        // record plus the skew plus the hold.
        let hold = Duration::from_secs(60);
        let ago = now.saturating_sub(Duration::from_secs(50));
        assert_eq!(
            predecessor(Some(&encode(ago)), now, hold),
            Predecessor::Until(ago.saturating_add(CLOCK_SKEW + hold)),
            "held leases are outstanding"
        );
        let long_ago = encode(now.saturating_sub(Duration::from_secs(70)));
        assert_eq!(predecessor(Some(&long_ago), now, hold), Predecessor::Lapsed, "holds lapsed too");
        assert_eq!(record_key("/usher/election/root"), "/usher/election/root/leases-until");
        let h = horizon(now, Duration::from_secs(60), Duration::from_secs(2));
        assert_eq!(h, now.saturating_add(Duration::from_secs(62)));
    }
}
