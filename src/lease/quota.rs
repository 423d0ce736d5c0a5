//! What an upstream says of its own quota (its rate limit headers), as the
//! lease client carries it to the capacity servers: the freshest
//! observation of each key goes up the tree with its requests, and the
//! server that owns the resource turns it into the capacity it shares
//! (`server::quota`).

use crate::clock::Time;
pub use crate::limit::quota::Observation;
use crate::proto;

fn ms(t: Time) -> i64 {
    (t.as_nanos() / 1_000_000).min(i64::MAX as u64) as i64
}

impl Observation {
    pub fn to_proto(&self) -> proto::UpstreamQuota {
        proto::UpstreamQuota {
            limit: self.limit,
            remaining: self.remaining,
            reset_unix_ms: ms(self.reset),
            observed_unix_ms: ms(self.observed),
            continuous: Some(self.continuous),
        }
    }

    /// An observation from the wire, if it makes sense (numbers finite and
    /// not negative, times after the epoch).
    pub fn from_proto(q: &proto::UpstreamQuota) -> Option<Observation> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(q.limit) || !ok(q.remaining) || q.reset_unix_ms <= 0 || q.observed_unix_ms <= 0 {
            return None;
        }
        let time = |ms: i64| Time::from_nanos((ms as u64).saturating_mul(1_000_000));
        Some(Observation {
            limit: q.limit,
            remaining: q.remaining,
            reset: time(q.reset_unix_ms),
            observed: time(q.observed_unix_ms),
            continuous: q.continuous.unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_goes_over_the_wire_and_nonsense_does_not() {
        let o = Observation {
            limit: 5000.0,
            remaining: 4321.0,
            reset: Time::from_secs(1_800_000_000),
            observed: Time::from_nanos(1_799_999_000_123_000_000),
            continuous: false,
        };
        assert_eq!(Observation::from_proto(&o.to_proto()), Some(o));
        let bad = proto::UpstreamQuota { limit: f64::NAN, ..o.to_proto() };
        assert_eq!(Observation::from_proto(&bad), None);
        let bad = proto::UpstreamQuota { remaining: -1.0, ..o.to_proto() };
        assert_eq!(Observation::from_proto(&bad), None);
        let newer = Observation { observed: Time::from_secs(1_800_000_001), ..o };
        assert_eq!(Observation::fresher(Some(newer), Some(o)), Some(newer));
        assert_eq!(Observation::fresher(None, Some(o)), Some(o));
    }
}
