//! The one source of time for usher's logic.
//!
//! Server, lease and limiter code never call `Instant::now()` or
//! `SystemTime::now()` themselves: they ask a [`Clock`]. The system clock is
//! wall time read once and then advanced monotonically, so a wall-clock step
//! cannot move lease expiries backwards; the manual clock is advanced by tests
//! and by `usher sim`, which run the same code in virtual time.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A point in time: nanoseconds since the Unix epoch.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    /// The Unix epoch, 1970-01-01T00:00:00Z.
    pub const EPOCH: Time = Time(0);

    /// The time `nanos` nanoseconds after the epoch.
    pub fn from_nanos(nanos: u64) -> Self {
        Time(nanos)
    }

    /// The time `secs` seconds after the epoch; saturates at the largest time.
    pub fn from_secs(secs: u64) -> Self {
        Time(secs.saturating_mul(1_000_000_000))
    }

    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole seconds since the epoch, rounded down: the wire's `expiry_time`.
    pub fn as_secs(self) -> i64 {
        (self.0 / 1_000_000_000) as i64
    }

    /// The first whole second at or after this time: a lease's end that
    /// the wire's `expiry_time` carries exactly.
    pub fn ceil_secs(self) -> Time {
        Time(self.0.div_ceil(1_000_000_000).saturating_mul(1_000_000_000))
    }

    /// Seconds since the epoch, with the fraction.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// The time `d` later, or the largest time.
    pub fn saturating_add(self, d: Duration) -> Time {
        Time(self.0.saturating_add(duration_nanos(d)))
    }

    /// The time `d` earlier, or the epoch.
    pub fn saturating_sub(self, d: Duration) -> Time {
        Time(self.0.saturating_sub(duration_nanos(d)))
    }

    /// Time elapsed since `earlier`, zero if `earlier` is later.
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Debug for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Time({}.{:09})", self.0 / 1_000_000_000, self.0 % 1_000_000_000)
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A clock: the system's, or a manual one driven by a test or the simulator.
/// Cloning is cheap and clones of a manual clock share its time.
#[derive(Clone)]
pub enum Clock {
    /// Wall time read once, then advanced by the monotonic clock.
    System(Arc<SystemSource>),
    /// A clock that moves only when its [`ManualClock`] handle says so.
    Manual(Arc<ManualClock>),
}

impl Clock {
    /// The system clock, anchored to the wall clock now.
    pub fn system() -> Self {
        Clock::System(Arc::new(SystemSource::new()))
    }

    /// A manual clock starting at `start`; returns the clock and a handle to advance it.
    pub fn manual(start: Time) -> (Self, Arc<ManualClock>) {
        let m = Arc::new(ManualClock::new(start));
        (Clock::Manual(m.clone()), m)
    }

    /// The current time.
    #[inline]
    pub fn now(&self) -> Time {
        match self {
            Clock::System(s) => s.now(),
            Clock::Manual(m) => m.now(),
        }
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Clock::System(_) => f.write_str("Clock::System"),
            Clock::Manual(m) => write!(f, "Clock::Manual({:?})", m.now()),
        }
    }
}

/// Wall time anchored once, advanced by the monotonic clock.
pub struct SystemSource {
    wall: Time,
    anchor: Instant,
}

impl SystemSource {
    #[allow(clippy::disallowed_methods, reason = "the clock is the one reader of the wall clock")]
    fn new() -> Self {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        SystemSource { wall: Time(duration_nanos(wall)), anchor: Instant::now() }
    }

    fn now(&self) -> Time {
        self.wall.saturating_add(self.anchor.elapsed())
    }
}

/// A clock that moves only when told to.
#[derive(Debug)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    fn new(start: Time) -> Self {
        ManualClock { nanos: AtomicU64::new(start.0) }
    }

    /// The time the clock was last moved to.
    pub fn now(&self) -> Time {
        Time(self.nanos.load(Ordering::Acquire))
    }

    /// Moves the clock `d` forward.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(duration_nanos(d), Ordering::AcqRel);
    }

    /// Moves the clock to `t`; never backwards.
    pub fn set(&self, t: Time) {
        self.nanos.fetch_max(t.0, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_forward_and_is_shared_by_clones() {
        let (clock, handle) = Clock::manual(Time::from_secs(100));
        let clone = clock.clone();
        handle.advance(Duration::from_millis(1500));
        assert_eq!(clone.now(), Time::from_nanos(101_500_000_000));
        assert_eq!(clone.now().as_secs(), 101);
        handle.set(Time::from_secs(50));
        assert_eq!(clock.now().as_secs(), 101, "set never goes backwards");
    }

    #[test]
    fn ceil_secs_rounds_up_to_the_whole_second_and_keeps_a_whole_one() {
        assert_eq!(Time::from_nanos(101_000_000_001).ceil_secs(), Time::from_secs(102));
        assert_eq!(Time::from_nanos(101_999_999_999).ceil_secs(), Time::from_secs(102));
        assert_eq!(Time::from_secs(101).ceil_secs(), Time::from_secs(101));
        assert_eq!(Time::EPOCH.ceil_secs(), Time::EPOCH);
    }

    #[test]
    #[allow(clippy::disallowed_methods, reason = "the clock is the one reader of the wall clock")]
    fn system_clock_is_near_wall_time_and_monotonic() {
        let clock = Clock::system();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
        assert!((a.as_secs() - wall.as_secs() as i64).abs() <= 1);
    }
}
