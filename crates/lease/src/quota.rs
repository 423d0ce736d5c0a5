//! What an upstream says of its own quota (its rate limit headers), as the
//! lease client carries it to the capacity servers: the freshest
//! observation of each key goes up the tree with its requests, and the
//! server that owns the resource turns it into the capacity it shares
//! (`server::quota`).

use usher_core::clock::Time;
pub use usher_limit::quota::Observation;
use usher_proto as proto;

fn ms(t: Time) -> i64 {
    (t.as_nanos() / 1_000_000).min(i64::MAX as u64) as i64
}

/// An observation as the wire carries it (protocol field 110).
pub fn to_proto(o: &Observation) -> proto::UpstreamQuota {
    proto::UpstreamQuota {
        limit: o.limit,
        remaining: o.remaining,
        reset_unix_ms: ms(o.reset),
        observed_unix_ms: ms(o.observed),
        continuous: Some(o.continuous),
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
        assert_eq!(from_proto(&to_proto(&o)), Some(o));
        let bad = proto::UpstreamQuota { limit: f64::NAN, ..to_proto(&o) };
        assert_eq!(from_proto(&bad), None);
        let bad = proto::UpstreamQuota { remaining: -1.0, ..to_proto(&o) };
        assert_eq!(from_proto(&bad), None);
        let newer = Observation { observed: Time::from_secs(1_800_000_001), ..o };
        assert_eq!(Observation::fresher(Some(newer), Some(o)), Some(newer));
        assert_eq!(Observation::fresher(None, Some(o)), Some(o));
    }
}
