//! What an upstream says of its own quota (its rate limit headers), as a
//! key keeps it: plain data, carried to the servers by the lease client
//! (`lease::quota`) and turned into a capacity by the server that owns the
//! resource (`server::quota`).

use serde::Serialize;

use usher_core::clock::Time;

/// An upstream's account of its quota at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Observation {
    /// Units per window (or the bucket's size, when `continuous`).
    pub limit: f64,
    /// Units left now.
    pub remaining: f64,
    /// When the window renews whole, or when a continuous bucket is full again.
    #[serde(serialize_with = "unix_s")]
    pub reset: Time,
    /// When the upstream said it.
    #[serde(serialize_with = "unix_s")]
    pub observed: Time,
    /// Refilled continuously (a token bucket) rather than renewed at `reset`.
    pub continuous: bool,
}

fn unix_s<S: serde::Serializer>(t: &Time, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(t.as_secs_f64())
}

impl Observation {
    /// The upstream said the quota is spent: nothing is left before `reset`.
    pub fn exhausted(&self, now: Time) -> bool {
        self.remaining < 1.0 && self.reset > now
    }

    /// The newer of two observations (the later one, by when it was made).
    pub fn fresher(a: Option<Observation>, b: Option<Observation>) -> Option<Observation> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.observed >= a.observed { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}
