//! Upstream pushback: when an upstream answers 429 or 503, the route's
//! resource keys back off on their own, below the lease, as the responsive
//! exponential backoff seed describes: the upstream's `Retry-After` is
//! honoured (nothing is admitted until then), each pushback multiplies the
//! admission rate down, and every `recover_after` successes in a row
//! multiply it back up one jittered step, until the full lease applies again.
//! The lease client lowers `wants` by the same factor, so the shared lease
//! flows to sidecars whose upstream is not pushing back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::StatusCode;
use prometheus::{GaugeVec, IntCounterVec, Opts};
use rand::Rng;
use serde::Serialize;

use crate::clock::Time;
use crate::config::doorman::PushbackConfig;

/// The smallest factor a key backs off to.
pub const MIN_FACTOR: f64 = 0.01;
/// A key with no pushback for this long (and no hold) is fully recovered,
/// even if too little traffic passed to count `recover_after` successes.
pub const QUIET_RECOVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Default)]
struct KeyState {
    factor: f64,
    successes: u32,
    hold_until: Option<Time>,
    /// The capacity the lease (or the routes file) grants this key.
    base: Option<f64>,
    last_pushback: Time,
}

impl KeyState {
    fn recovered(&self, now: Time) -> bool {
        self.hold_until.is_none_or(|t| t <= now) && now.since(self.last_pushback) >= QUIET_RECOVERY
    }

    fn share(&self, now: Time) -> f64 {
        if self.hold_until.is_some_and(|t| t > now) {
            0.0
        } else if self.recovered(now) {
            1.0
        } else {
            self.factor
        }
    }
}

/// One key's pushback, for status pages.
#[derive(Debug, Clone, Serialize)]
pub struct KeyPushback {
    pub id: String,
    pub factor: f64,
    pub hold_s: f64,
}

/// Pushback state of every key; shared by the request path and the lease client.
pub struct Pushback {
    keys: Mutex<HashMap<String, KeyState>>,
    /// Keys currently backed off: lets the request path skip the lock when none is.
    active: std::sync::atomic::AtomicUsize,
    events: IntCounterVec,
    factor_gauge: GaugeVec,
}

impl Pushback {
    pub fn new(registry: &prometheus::Registry) -> Self {
        let events = IntCounterVec::new(
            Opts::new("usher_proxy_pushback_total", "Upstream 429/503 answers that made a resource key back off."),
            &["resource_id"],
        )
        .expect("valid metric");
        let factor_gauge = GaugeVec::new(
            Opts::new(
                "usher_proxy_pushback_factor",
                "Share of its lease a resource key admits while its upstream pushes back (1 = none).",
            ),
            &["resource_id"],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(events.clone()));
        let _ = registry.register(Box::new(factor_gauge.clone()));
        Pushback { keys: Mutex::new(HashMap::new()), active: Default::default(), events, factor_gauge }
    }

    /// True when `status` changes nothing: not a pushback, and no key is backed off.
    pub fn is_quiet(&self, status: StatusCode) -> bool {
        status != StatusCode::TOO_MANY_REQUESTS
            && status != StatusCode::SERVICE_UNAVAILABLE
            && self.active.load(std::sync::atomic::Ordering::Relaxed) == 0
    }

    /// What share of its capacity `id` may use at `now` (1 when not pushed back).
    pub fn factor(&self, id: &str, now: Time) -> f64 {
        self.keys.lock().expect("pushback lock").get(id).map_or(1.0, |k| k.share(now))
    }

    /// The capacity last granted to `id` while it is pushed back.
    pub fn base(&self, id: &str) -> Option<f64> {
        self.keys.lock().expect("pushback lock").get(id).and_then(|k| k.base)
    }

    /// Records the capacity granted to `id` and returns what it may use now.
    pub fn effective(&self, id: &str, base: f64, now: Time) -> f64 {
        use std::sync::atomic::Ordering;
        let mut keys = self.keys.lock().expect("pushback lock");
        match keys.get_mut(id) {
            None => base,
            Some(k) if k.recovered(now) => {
                keys.remove(id);
                self.active.store(keys.len(), Ordering::Relaxed);
                self.factor_gauge.with_label_values(&[id]).set(1.0);
                base
            }
            Some(k) => {
                k.base = Some(base);
                base * k.share(now)
            }
        }
    }

    /// Takes one upstream answer for the keys of a route. Returns the keys
    /// whose effective capacity changed, with the new value.
    pub fn on_response(
        &self,
        ids: &[(String, f64)],
        status: StatusCode,
        retry_after: Option<Duration>,
        now: Time,
        cfg: &PushbackConfig,
    ) -> Vec<(String, f64)> {
        use std::sync::atomic::Ordering;
        if !cfg.enabled {
            return Vec::new();
        }
        let pushed = status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE;
        if !pushed && self.active.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let mut keys = self.keys.lock().expect("pushback lock");
        let mut changed = Vec::new();
        for (id, current) in ids {
            if pushed {
                let k = keys.entry(id.clone()).or_insert_with(|| KeyState { factor: 1.0, ..Default::default() });
                k.base.get_or_insert(*current);
                k.last_pushback = now;
                k.factor = (k.factor * cfg.multiplier).max(MIN_FACTOR);
                k.successes = 0;
                if let Some(d) = retry_after {
                    let until = now.saturating_add(d);
                    k.hold_until = Some(k.hold_until.map_or(until, |t| t.max(until)));
                }
                self.events.with_label_values(&[id]).inc();
                self.factor_gauge.with_label_values(&[id]).set(k.factor);
                let eff =
                    if k.hold_until.is_some_and(|t| t > now) { 0.0 } else { k.base.unwrap_or(*current) * k.factor };
                changed.push((id.clone(), eff));
            } else if status.is_success() {
                let Some(k) = keys.get_mut(id) else { continue };
                k.successes += 1;
                if k.successes < cfg.recover_after {
                    continue;
                }
                k.successes = 0;
                let step = cfg.recover_step * rand::rng().random_range(0.9..=1.1);
                k.factor = (k.factor * step).min(1.0);
                self.factor_gauge.with_label_values(&[id]).set(k.factor);
                let base = k.base.unwrap_or(*current);
                if k.factor >= 1.0 {
                    keys.remove(id);
                    changed.push((id.clone(), base));
                } else {
                    changed.push((id.clone(), base * k.factor));
                }
            }
        }
        self.active.store(keys.len(), Ordering::Relaxed);
        changed
    }

    pub fn status(&self, now: Time) -> Vec<KeyPushback> {
        let mut v: Vec<KeyPushback> = self
            .keys
            .lock()
            .expect("pushback lock")
            .iter()
            .map(|(id, k)| KeyPushback {
                id: id.clone(),
                factor: k.factor,
                hold_s: k.hold_until.map_or(0.0, |t| t.since(now).as_secs_f64()),
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }
}

/// Parses `Retry-After` as seconds (HTTP dates are ignored: no clock agreement is assumed).
pub fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    retry_after_value(headers.get(http::header::RETRY_AFTER)?.as_bytes())
}

/// A `Retry-After` value in whole seconds (an HTTP date is not used), at most an hour.
pub fn retry_after_value(v: &[u8]) -> Option<Duration> {
    let v = std::str::from_utf8(v).ok()?.trim();
    v.parse::<u64>().ok().map(|s| Duration::from_secs(s.min(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_holds_and_recovers() {
        let p = Pushback::new(&prometheus::Registry::new());
        let cfg = PushbackConfig { enabled: true, multiplier: 0.5, recover_after: 2, recover_step: 2.0 };
        let t0 = Time::from_secs(100);
        let ids = vec![("k".to_string(), 40.0)];
        assert_eq!(p.effective("k", 40.0, t0), 40.0, "no pushback: the full lease");
        let ch = p.on_response(&ids, StatusCode::TOO_MANY_REQUESTS, Some(Duration::from_secs(2)), t0, &cfg);
        assert_eq!(ch, vec![("k".to_string(), 0.0)], "held until Retry-After");
        assert_eq!(p.factor("k", t0.saturating_add(Duration::from_secs(1))), 0.0);
        assert_eq!(p.factor("k", t0.saturating_add(Duration::from_secs(2))), 0.5);
        let t3 = t0.saturating_add(Duration::from_secs(3));
        assert_eq!(p.effective("k", 40.0, t3), 20.0);
        p.on_response(&ids, StatusCode::SERVICE_UNAVAILABLE, None, t3, &cfg);
        assert_eq!(p.effective("k", 40.0, t3), 10.0);
        assert!(p.on_response(&ids, StatusCode::OK, None, t3, &cfg).is_empty(), "one success is not enough");
        let ch = p.on_response(&ids, StatusCode::OK, None, t3, &cfg);
        assert!(ch[0].1 > 10.0 && ch[0].1 < 40.0, "{ch:?}");
        for _ in 0..20 {
            p.on_response(&ids, StatusCode::OK, None, t3, &cfg);
        }
        assert_eq!(p.effective("k", 40.0, t3), 40.0, "fully recovered");
        assert!(p.status(t3).is_empty());
        let off = PushbackConfig { enabled: false, ..cfg };
        assert!(p.on_response(&ids, StatusCode::TOO_MANY_REQUESTS, None, t3, &off).is_empty());
    }

    #[test]
    fn a_quiet_key_recovers_without_traffic() {
        let p = Pushback::new(&prometheus::Registry::new());
        let cfg = PushbackConfig::default();
        let t0 = Time::from_secs(100);
        p.on_response(&[("k".to_string(), 40.0)], StatusCode::SERVICE_UNAVAILABLE, None, t0, &cfg);
        assert_eq!(p.effective("k", 40.0, t0.saturating_add(Duration::from_secs(1))), 20.0);
        let later = t0.saturating_add(QUIET_RECOVERY);
        assert_eq!(p.factor("k", later), 1.0);
        assert_eq!(p.effective("k", 40.0, later), 40.0);
        assert!(p.status(later).is_empty(), "the key is forgotten once recovered");
    }

    #[test]
    fn retry_after_seconds() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(http::header::RETRY_AFTER, "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap());
        assert_eq!(retry_after(&h), None);
    }
}
