//! The info log's summary of templated keys.
//!
//! A templated resource (`id: "tenant/{header.x-tenant}"`) makes a key per
//! tenant, up to a million of them. A line per key's event would be a million
//! lines, so each key's events go to the debug log, and the info log gets one
//! line that counts them: how many keys were made, first leased, held, expired
//! and forgotten, and how many there are now. The first line comes
//! [`FIRST_SUMMARY`] after the first event (an operator sees at once that keys
//! are being made), the next ones at most every [`SUMMARY_EVERY`], and none
//! while nothing happens.

use std::time::Duration;

use usher_core::clock::Time;
use usher_lease::core::Mode;

/// How long after the first event the first summary comes.
pub const FIRST_SUMMARY: Duration = Duration::from_secs(10);
/// The shortest time between two summaries.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// Counts of templated keys' events since the last summary.
#[derive(Debug, Default)]
pub(crate) struct KeyLog {
    counts: Counts,
    /// When the counts began: the first event since the last summary.
    since: Option<Time>,
    /// When the last summary was logged.
    last: Option<Time>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    made: u64,
    leased: u64,
    held: u64,
    expired: u64,
    forgotten: u64,
}

impl KeyLog {
    /// `n` templated keys were made (by their first requests) and
    /// `forgotten` were forgotten (idle for their `key_idle_timeout`).
    pub(crate) fn read(&mut self, now: Time, made: u64, forgotten: u64) {
        if made + forgotten > 0 {
            let c = self.begin(now);
            c.made += made;
            c.forgotten += forgotten;
        }
    }

    /// A templated key changed mode: counted when it got its first lease, or
    /// its lease went held or expired.
    pub(crate) fn transition(&mut self, now: Time, from: Mode, to: Mode) {
        let c = match (from, to) {
            (Mode::Pending, Mode::Leased) => &mut self.begin(now).leased,
            (_, Mode::Held) => &mut self.begin(now).held,
            (_, Mode::Expired) => &mut self.begin(now).expired,
            _ => return,
        };
        *c += 1;
    }

    fn begin(&mut self, now: Time) -> &mut Counts {
        self.since.get_or_insert(now);
        &mut self.counts
    }

    /// When the next summary is due, if there is anything to summarise.
    pub(crate) fn due(&self) -> Option<Time> {
        let since = self.since?;
        Some(match self.last {
            None => since.saturating_add(FIRST_SUMMARY),
            Some(last) => last.saturating_add(SUMMARY_EVERY),
        })
    }

    /// Logs the summary at info if its time has come, with `keys` templated
    /// keys there now; returns whether it did.
    pub(crate) fn tick(&mut self, now: Time, keys: usize) -> bool {
        let (Some(since), Some(due)) = (self.since, self.due()) else { return false };
        if now < due {
            return false;
        }
        let Counts { made, leased, held, expired, forgotten } = std::mem::take(&mut self.counts);
        let over_s = now.since(self.last.unwrap_or(since)).as_secs();
        tracing::info!(made, leased, held, expired, forgotten, keys, over_s, "templated keys");
        self.since = None;
        self.last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: u64) -> Time {
        Time::from_secs(s)
    }

    #[test]
    fn the_first_summary_comes_soon_the_next_at_most_a_minute_apart_and_none_while_quiet() {
        let mut log = KeyLog::default();
        assert!(!log.tick(at(100), 0), "nothing happened: no summary");
        log.read(at(100), 1, 0);
        log.read(at(100), 0, 0);
        log.transition(at(100), Mode::Pending, Mode::Leased);
        assert_eq!(log.due(), Some(at(110)));
        assert!(!log.tick(at(109), 1), "before the first summary is due");
        assert!(log.tick(at(110), 1));
        assert_eq!(log.counts, Counts::default(), "the counts start again");
        log.read(at(111), 0, 1);
        assert!(!log.tick(at(150), 0), "within a minute of the last summary");
        assert!(log.tick(at(170), 0));
        assert!(!log.tick(at(400), 0), "quiet since: no summary");
        assert_eq!(log.due(), None, "and no read is due for one");
    }

    #[test]
    fn only_first_leases_holds_and_expiries_are_counted() {
        let mut log = KeyLog::default();
        log.transition(at(1), Mode::Pending, Mode::Leased);
        log.transition(at(1), Mode::Leased, Mode::Held);
        log.transition(at(1), Mode::Held, Mode::Expired);
        log.transition(at(1), Mode::Expired, Mode::Leased);
        log.transition(at(1), Mode::Held, Mode::Leased);
        assert_eq!(log.counts, Counts { made: 0, leased: 1, held: 1, expired: 1, forgotten: 0 });
    }
}
