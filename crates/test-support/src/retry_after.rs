//! Checks of the `Retry-After` on usher's 429s: a whole number of seconds,
//! at least 1, and no later than the next renewal the sidecar can know of.
//! That renewal is the key's next refresh (at most its refresh interval, and
//! never past its lease length), or a calendar quota's reset at the next UTC
//! boundary of its unit.
//!
//! Every load of [`crate::load`] checks each 429 it gets with the [`Limit`]
//! of its [`crate::load::Tally`] and fails at its end, naming the values,
//! when one was bad. Without a limit from the test, a day is the most a
//! `Retry-After` may say: no quota renews less often.
//!
//! ```
//! use usher_test_support::retry_after::{Limit, check};
//! let v = http::HeaderValue::from_static("18446744074");
//! assert!(check(Some(&v), Limit::Secs(5)).unwrap_err().contains("18446744074"));
//! ```

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue};

/// The most a `Retry-After` may say when the test names no tighter limit:
/// a day, the longest unit a quota renews in.
pub const DAY_S: u64 = 86_400;

/// How many distinct bad values a [`Checked`] keeps to name (it counts them all).
const KEEP: usize = 16;

/// The latest a 429 may tell the app to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// At most this many seconds: the key's refresh interval, or its lease
    /// length where that is all the test knows.
    Secs(u64),
    /// At most until the next UTC boundary of a calendar unit of this many
    /// seconds (60: a minute), when the quota renews. One second more is
    /// allowed: the sidecar rounds up what is left when it answers, and the
    /// client reads the answer a moment later.
    UtcBoundary(u64),
}

impl Default for Limit {
    fn default() -> Self {
        Limit::Secs(DAY_S)
    }
}

impl Limit {
    /// The most seconds a `Retry-After` read now may say.
    pub fn max_now(&self) -> u64 {
        match *self {
            Limit::Secs(s) => s,
            Limit::UtcBoundary(unit) => {
                let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs_f64();
                let left = unit as f64 - now % unit as f64;
                left.ceil() as u64 + 1
            }
        }
    }
}

/// Checks one 429's `Retry-After` (`None`: it had none): its seconds, or
/// what is wrong with it, naming the value.
pub fn check(value: Option<&HeaderValue>, limit: Limit) -> Result<u64, String> {
    let Some(v) = value else { return Err("a 429 without Retry-After".into()) };
    let text = String::from_utf8_lossy(v.as_bytes());
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("Retry-After {text:?} is not a whole number of seconds"));
    }
    let secs: u64 = text.parse().map_err(|_| format!("Retry-After {text} s does not fit in 64 bits"))?;
    if secs < 1 {
        return Err(format!("Retry-After {secs} s is under 1 s"));
    }
    let max = limit.max_now();
    if secs > max {
        return Err(format!(
            "Retry-After {secs} s is past the next renewal the sidecar can know of: at most {max} s ({limit:?})"
        ));
    }
    Ok(secs)
}

/// The `Retry-After`s of one load's 429s, checked against one [`Limit`].
#[derive(Default)]
pub struct Checked {
    limit: Limit,
    seen: AtomicU64,
    longest: AtomicU64,
    bad: AtomicU64,
    named: Mutex<Vec<String>>,
}

impl Checked {
    /// A record whose 429s may say at most `limit`.
    pub fn new(limit: Limit) -> Checked {
        Checked { limit, ..Checked::default() }
    }

    /// Checks the `Retry-After` in a 429's `headers`: its seconds, or
    /// `None` when it is bad (then kept, to be named).
    pub fn check(&self, headers: &HeaderMap) -> Option<u64> {
        self.seen.fetch_add(1, Ordering::Relaxed);
        match check(headers.get(http::header::RETRY_AFTER), self.limit) {
            Ok(secs) => {
                self.longest.fetch_max(secs, Ordering::Relaxed);
                Some(secs)
            }
            Err(e) => {
                self.bad.fetch_add(1, Ordering::Relaxed);
                let mut named = self.named.lock().unwrap();
                if named.len() < KEEP && !named.contains(&e) {
                    named.push(e);
                }
                None
            }
        }
    }

    /// What was wrong with the bad values seen: each distinct one, the first few.
    pub fn bad(&self) -> Vec<String> {
        self.named.lock().unwrap().clone()
    }

    /// What was checked, on one line, for reports.
    pub fn summary(&self) -> String {
        let bad = self.bad.load(Ordering::Relaxed);
        let mut s = format!(
            "Retry-After: {} checked, longest {} s",
            self.seen.load(Ordering::Relaxed),
            self.longest.load(Ordering::Relaxed)
        );
        if bad > 0 {
            s.push_str(&format!(", {bad} bad: {:?}", self.bad()));
        }
        s
    }

    /// Panics naming the bad values, if there were any.
    pub fn assert_sane(&self) {
        assert_eq!(self.bad.load(Ordering::Relaxed), 0, "bad Retry-After on usher's 429s: {}", self.summary());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(v: &'static str, limit: Limit) -> Result<u64, String> {
        check(Some(&HeaderValue::from_static(v)), limit)
    }

    #[test]
    fn whole_seconds_from_1_to_the_limit_pass() {
        assert_eq!(of("1", Limit::Secs(5)), Ok(1));
        assert_eq!(of("5", Limit::Secs(5)), Ok(5));
    }

    #[test]
    fn bad_values_are_named() {
        for (v, why) in [
            ("0", "under 1 s"),
            ("6", "past the next renewal"),
            ("18446744074", "past the next renewal"),
            ("99999999999999999999", "64 bits"),
            ("1.5", "whole number"),
            ("-1", "whole number"),
            ("", "whole number"),
            ("Wed, 21 Oct 2015 07:28:00 GMT", "whole number"),
        ] {
            let e = of(v, Limit::Secs(5)).unwrap_err();
            assert!(e.contains(v) && e.contains(why), "{v:?}: {e}");
        }
        assert!(check(None, Limit::Secs(5)).unwrap_err().contains("without"));
    }

    #[test]
    fn a_calendar_limit_is_the_time_to_the_boundary() {
        // A minute's boundary is at most 60 s away, plus the rounding second.
        let max = Limit::UtcBoundary(60).max_now();
        assert!((2..=61).contains(&max), "{max}");
        assert!(of("62", Limit::UtcBoundary(60)).is_err());
        assert!(of("1", Limit::UtcBoundary(60)).is_ok());
    }

    #[test]
    fn a_record_keeps_the_bad_ones_and_the_longest() {
        let c = Checked::new(Limit::Secs(5));
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(c.check(&h), Some(3));
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("18446744074"));
        assert_eq!(c.check(&h), None);
        assert_eq!(c.check(&h), None);
        assert!(c.summary().contains("3 checked, longest 3 s, 2 bad"), "{}", c.summary());
        assert_eq!(c.bad().len(), 1, "named once: {:?}", c.bad());
        let caught = std::panic::catch_unwind(|| c.assert_sane()).unwrap_err();
        assert!(caught.downcast_ref::<String>().unwrap().contains("18446744074"));
    }
}
