//! Responsive, jittered exponential backoff for calls to capacity servers.
//!
//! Each failure multiplies the delay up (with jitter, so a fleet that failed
//! together does not retry together); every `down_threshold` consecutive
//! successes multiply it back down, so a flapping server is retried gently
//! and a recovered one quickly.

use std::time::Duration;

use rand::Rng;

/// Default `backoff.max`: the routes file's
/// ([`usher_core::config::doorman::DEFAULT_BACKOFF_MAX`]).
pub const DEFAULT_MAX: Duration = usher_core::config::doorman::DEFAULT_BACKOFF_MAX;
/// How long a permanent error (the server refused the request itself) waits
/// before the same request is tried again.
pub const PERMANENT_RETRY: Duration = Duration::from_secs(15);

/// Backoff parameters; the defaults are documented in the README.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackoffConfig {
    /// The delay after a first failure.
    pub initial: Duration,
    /// The longest delay, jitter included.
    pub max: Duration,
    /// What each further failure multiplies the delay by.
    pub multiplier: f64,
    /// Each delay is drawn uniformly from `delay × (1 ± randomization)`.
    pub randomization: f64,
    /// What `down_threshold` successes in a row multiply the delay by.
    pub down_multiplier: f64,
    /// Successes in a row that shrink the delay once.
    pub down_threshold: u32,
}

impl Default for BackoffConfig {
    /// The routes file's defaults (`usher_core::config::doorman::Backoff`),
    /// and halving the delay after three successes in a row.
    fn default() -> Self {
        BackoffConfig::from(usher_core::config::doorman::Backoff::default())
    }
}

impl From<usher_core::config::doorman::Backoff> for BackoffConfig {
    /// A routes file's `doorman.backoff`, with the delay halved after three
    /// successes in a row.
    fn from(b: usher_core::config::doorman::Backoff) -> Self {
        BackoffConfig {
            initial: b.initial,
            max: b.max,
            multiplier: b.multiplier,
            randomization: b.randomization,
            down_multiplier: 0.5,
            down_threshold: 3,
        }
    }
}

/// The delay before calling again, grown by failures and shrunk by successes.
#[derive(Debug, Clone)]
pub struct Backoff {
    cfg: BackoffConfig,
    current: Option<Duration>,
    successes: u32,
}

impl Backoff {
    /// A backoff with no failure yet.
    pub fn new(cfg: BackoffConfig) -> Self {
        Backoff { cfg, current: None, successes: 0 }
    }

    /// The delay before the next attempt after a failure.
    pub fn on_failure(&mut self, rng: &mut impl Rng) -> Duration {
        self.successes = 0;
        let next = match self.current {
            None => self.cfg.initial,
            Some(d) => d.mul_f64(self.cfg.multiplier).min(self.cfg.max),
        };
        self.current = Some(next);
        jitter(next, self.cfg.randomization, rng).min(self.cfg.max)
    }

    /// Records a success; enough of them in a row shrink the delay.
    pub fn on_success(&mut self) {
        self.successes += 1;
        if self.successes >= self.cfg.down_threshold {
            self.successes = 0;
            self.current = self.current.map(|d| d.mul_f64(self.cfg.down_multiplier)).filter(|d| *d >= self.cfg.initial);
        }
    }

    /// The un-jittered delay the next failure would start from.
    pub fn current(&self) -> Option<Duration> {
        self.current
    }
}

/// `d × u` with `u` uniform in `[1 - fraction, 1 + fraction]`.
pub fn jitter(d: Duration, fraction: f64, rng: &mut impl Rng) -> Duration {
    let f = fraction.clamp(0.0, 1.0);
    if f == 0.0 {
        return d;
    }
    d.mul_f64(rng.random_range(1.0 - f..=1.0 + f))
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;

    #[test]
    fn grows_with_jitter_caps_and_recovers() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut b = Backoff::new(BackoffConfig::default());
        let d1 = b.on_failure(&mut rng);
        assert!(d1 >= Duration::from_millis(350) && d1 <= Duration::from_millis(650), "{d1:?}");
        for _ in 0..30 {
            assert!(b.on_failure(&mut rng) <= DEFAULT_MAX);
        }
        assert_eq!(b.current(), Some(DEFAULT_MAX));
        for _ in 0..3 {
            b.on_success();
        }
        assert_eq!(b.current(), Some(DEFAULT_MAX / 2), "three successes halve the delay");
        for _ in 0..30 {
            b.on_success();
        }
        assert_eq!(b.current(), None, "fully recovered");
    }

    #[test]
    fn jitter_spreads_uniformly_within_bounds() {
        let mut rng = SmallRng::seed_from_u64(1);
        let d = Duration::from_secs(60);
        let xs: Vec<f64> = (0..2000).map(|_| jitter(d, 1.0 / 6.0, &mut rng).as_secs_f64()).collect();
        assert!(xs.iter().all(|x| (50.0..=70.0).contains(x)));
        let low = xs.iter().filter(|x| **x < 55.0).count();
        let high = xs.iter().filter(|x| **x > 65.0).count();
        assert!(low > 300 && high > 300, "both quarters of the range are used: {low} {high}");
    }
}
