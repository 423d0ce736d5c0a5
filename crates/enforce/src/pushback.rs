//! Upstream pushback: when an upstream answers 429 or 503, the route's
//! resource keys back off on their own, below the lease, as the responsive
//! exponential backoff seed describes: the upstream's `Retry-After` is
//! honoured (nothing is admitted until then, and usher's own 429s say how
//! long the hold still lasts), each pushback multiplies the admission rate
//! down, and every `recover_after` successes in a row multiply it back up
//! one jittered step, until the full lease applies again.
//!
//! The rate a key recovers to is the capacity it had when the pushback
//! began, never more than its lease grants now. The lease follows: a key
//! asks for nothing while a hold has longer to run than getting the lease
//! back takes (`relet_lead`), so the capacity flows to sidecars whose
//! upstream is not pushing back, and then asks for its earlier capacity back
//! so that it is in hand when the hold ends. After a pushback without
//! `Retry-After` it asks only for its share of it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::StatusCode;
use prometheus::{GaugeVec, IntCounterVec, Opts};
use rand::Rng;
use serde::Serialize;

use usher_core::clock::Time;
use usher_core::config::doorman::PushbackConfig;
use usher_limit::Limiter;

/// The smallest factor a key backs off to.
const MIN_FACTOR: f64 = 0.01;
/// A key with no pushback for this long, counted from the end of its hold,
/// is fully recovered, even if too little traffic passed to count
/// `recover_after` successes.
const QUIET_RECOVERY: Duration = Duration::from_secs(5);

/// How long before a hold ends a key asks for its lease back: its own early
/// refresh (`min_interval`), a sibling's next refresh, which is what gives
/// the capacity back (up to the lease's `refresh_interval` with `jitter`,
/// sooner if the sibling refreshes early), and its own again. A hold shorter
/// than this keeps the lease: giving it away would leave the key without it
/// when the hold ends.
pub(crate) fn relet_lead(refresh_interval: Duration, min_interval: Duration, jitter: f64) -> Duration {
    refresh_interval.mul_f64(1.0 + jitter.max(0.0)) + min_interval * 2
}

#[derive(Debug, Clone)]
struct KeyState {
    factor: f64,
    successes: u32,
    hold_until: Option<Time>,
    /// The capacity the key had when this pushback began: what it recovers to.
    before: f64,
    /// What its lease (or the routes file) grants now.
    granted: f64,
    /// The latest pushback came with a `Retry-After`.
    held: bool,
    /// A gauge: it admits whole requests.
    whole: bool,
    last_pushback: Time,
}

impl KeyState {
    fn hold_left(&self, now: Time) -> Option<Duration> {
        self.hold_until.filter(|t| *t > now).map(|t| t.since(now))
    }

    /// Quiet for [`QUIET_RECOVERY`] since the last pushback and since its hold ended.
    fn recovered(&self, now: Time) -> bool {
        let quiet_since = self.hold_until.map_or(self.last_pushback, |h| h.max(self.last_pushback));
        now.since(quiet_since) >= QUIET_RECOVERY
    }

    fn share(&self, now: Time) -> f64 {
        if self.hold_left(now).is_some() {
            0.0
        } else if self.recovered(now) {
            1.0
        } else {
            self.factor
        }
    }

    /// What the key may admit now: its share of what it had before the
    /// pushback, never more than its lease grants. A gauge backed off below
    /// 1 would admit nothing until fully recovered (a gauge admits whole
    /// requests): once its hold is over it keeps 1, so one probe at a time
    /// goes out and its successes can recover it.
    fn capacity(&self, now: Time) -> f64 {
        let share = self.share(now);
        let backed = self.before * share;
        let backed = if self.whole && share > 0.0 && self.before >= 1.0 { backed.max(1.0) } else { backed };
        self.granted.min(backed)
    }

    /// What the key should lease now, when it would otherwise want `wants`.
    fn wants(&self, wants: f64, now: Time, lead: Duration) -> f64 {
        let full = wants.min(self.before);
        match self.hold_left(now) {
            Some(left) if left > lead => 0.0,
            Some(_) => full,
            // The upstream said when to come back: the factor recovers within
            // a few successes, faster than a lease comes back.
            None if self.held => full,
            None => full * self.factor,
        }
    }
}

/// One key's pushback, for status pages.
#[derive(Debug, Clone, Serialize)]
pub struct KeyPushback {
    /// The key's lease id.
    pub id: String,
    /// The share of its capacity it admits now (1 = none backed off).
    pub factor: f64,
    /// Seconds left of the upstream's `Retry-After`.
    pub hold_s: f64,
    /// The capacity the key had when the pushback began, which it recovers to.
    pub before: f64,
}

/// A key an upstream answer is for, as [`Pushback::on_response`] reads it.
pub trait Key {
    /// Its lease id.
    fn id(&self) -> &str;
    /// The capacity it enforces now; read under the pushback lock.
    fn capacity(&self) -> f64;
    /// Whether it admits whole requests (a gauge).
    fn whole(&self) -> bool {
        false
    }
    /// Told when the upstream's `Retry-After` ends, so that its admission
    /// can refuse at once a request that could not wait that long.
    fn set_hold(&self, _until: Option<Time>) {}
}

impl Key for Limiter {
    fn id(&self) -> &str {
        Limiter::id(self)
    }

    fn capacity(&self) -> f64 {
        Limiter::capacity(self)
    }

    fn whole(&self) -> bool {
        self.kind() == usher_limit::Kind::Gauge
    }

    fn set_hold(&self, until: Option<Time>) {
        Limiter::set_hold(self, until)
    }
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
    /// No key backed off yet; its series are registered in `registry`
    /// (unless it already holds series of their names).
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

    /// Whether any key is backed off now.
    pub fn any(&self) -> bool {
        self.active.load(std::sync::atomic::Ordering::Relaxed) > 0
    }

    /// The keys backed off now: their capacity changes with time (a hold
    /// ends, the backoff recovers), so the lease client applies it at every
    /// turn through [`Pushback::apply`].
    pub fn ids(&self) -> Vec<String> {
        if !self.any() {
            return Vec::new();
        }
        self.keys.lock().expect("pushback lock").keys().cloned().collect()
    }

    /// True when `status` changes nothing: not a pushback, and no key is backed off.
    pub fn is_quiet(&self, status: StatusCode) -> bool {
        status != StatusCode::TOO_MANY_REQUESTS
            && status != StatusCode::SERVICE_UNAVAILABLE
            && self.active.load(std::sync::atomic::Ordering::Relaxed) == 0
    }

    /// Whether the key `id` is backed off now (its capacity is not its own).
    pub fn tracks(&self, id: &str) -> bool {
        self.any() && self.keys.lock().expect("pushback lock").contains_key(id)
    }

    /// How long the upstream of `id` still holds it (its `Retry-After`), if it does.
    pub fn hold_left(&self, id: &str, now: Time) -> Option<Duration> {
        if self.active.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return None;
        }
        self.keys.lock().expect("pushback lock").get(id).and_then(|k| k.hold_left(now))
    }

    /// What `id` should lease while pushed back, when it would otherwise want
    /// `wants`, and whether that differs enough from its lease to refresh
    /// early. None when `id` is not pushed back. `lead`: see [`relet_lead`].
    pub(crate) fn lease_wants(
        &self,
        id: &str,
        wants: f64,
        now: Time,
        lead: impl FnOnce() -> Duration,
    ) -> Option<(f64, bool)> {
        if self.active.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return None;
        }
        let keys = self.keys.lock().expect("pushback lock");
        let k = keys.get(id).filter(|k| !k.recovered(now))?;
        let w = k.wants(wants, now, lead());
        Some((w, w < k.granted * 0.5 || w > k.granted + 1e-9))
    }

    /// Records the capacity granted to `id` and returns what it may use now.
    #[cfg(test)]
    pub fn effective(&self, id: &str, granted: f64, now: Time) -> f64 {
        let mut keys = self.keys.lock().expect("pushback lock");
        self.effective_in(&mut keys, id, granted, now)
    }

    /// Records the capacity granted to `id` and writes what it may use now
    /// with `write`, under the lock [`Pushback::on_response`] writes under:
    /// the lease client's write and the request path's cannot cross and
    /// leave the older value last (each capacity is applied once).
    /// `write` is also given the end of the key's hold, while one runs: a
    /// key made anew (a reload) learns it too.
    pub fn apply(&self, id: &str, granted: f64, now: Time, write: impl FnOnce(f64, Option<Time>)) {
        let mut keys = self.keys.lock().expect("pushback lock");
        let c = self.effective_in(&mut keys, id, granted, now);
        write(c, keys.get(id).and_then(|k| k.hold_until.filter(|t| *t > now)));
    }

    fn effective_in(&self, keys: &mut HashMap<String, KeyState>, id: &str, granted: f64, now: Time) -> f64 {
        use std::sync::atomic::Ordering;
        match keys.get_mut(id) {
            None => granted,
            Some(k) if k.recovered(now) => {
                keys.remove(id);
                self.active.store(keys.len(), Ordering::Relaxed);
                self.factor_gauge.with_label_values(&[id]).set(1.0);
                granted
            }
            Some(k) => {
                k.granted = granted;
                k.capacity(now)
            }
        }
    }

    /// Takes one upstream answer for the keys of a route. Each key whose
    /// capacity changed is written with `write` under the pushback lock (see
    /// [`Pushback::apply`]) and returned with its new value.
    ///
    /// A key's first pushback reads the capacity it enforces, what it
    /// recovers to, under that lock too: read before it, a lease applied in
    /// between would be backed off from the older capacity (and recovered
    /// to) until the lease changes again.
    pub fn on_response<'k, K: Key + ?Sized + 'k>(
        &self,
        keys: impl IntoIterator<Item = &'k K>,
        status: StatusCode,
        retry_after: Option<Duration>,
        now: Time,
        cfg: &PushbackConfig,
        mut write: impl FnMut(&str, f64),
    ) -> Vec<(String, f64)> {
        use std::sync::atomic::Ordering;
        if !cfg.enabled {
            return Vec::new();
        }
        let pushed = status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE;
        if !pushed && self.active.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let mut state = self.keys.lock().expect("pushback lock");
        let mut changed = Vec::new();
        for key in keys {
            let id = key.id();
            if pushed {
                let k = state.entry(id.to_string()).or_insert_with(|| {
                    let current = key.capacity();
                    KeyState {
                        factor: 1.0,
                        successes: 0,
                        hold_until: None,
                        before: current,
                        granted: current,
                        held: false,
                        whole: key.whole(),
                        last_pushback: now,
                    }
                });
                k.last_pushback = now;
                k.factor = (k.factor * cfg.multiplier).max(MIN_FACTOR);
                k.successes = 0;
                k.held = retry_after.is_some();
                if let Some(d) = retry_after {
                    let until = now.saturating_add(d);
                    k.hold_until = Some(k.hold_until.map_or(until, |t| t.max(until)));
                    key.set_hold(k.hold_until);
                }
                self.events.with_label_values(&[id]).inc();
                self.factor_gauge.with_label_values(&[id]).set(k.factor);
                let c = k.capacity(now);
                write(id, c);
                changed.push((id.to_string(), c));
            } else if status.is_success() {
                let Some(k) = state.get_mut(id) else { continue };
                k.successes += 1;
                if k.successes < cfg.recover_after {
                    continue;
                }
                k.successes = 0;
                let step = cfg.recover_step * rand::rng().random_range(0.9..=1.1);
                k.factor = (k.factor * step).min(1.0);
                self.factor_gauge.with_label_values(&[id]).set(k.factor);
                let c = if k.factor >= 1.0 {
                    let granted = k.granted;
                    state.remove(id);
                    granted
                } else {
                    k.capacity(now)
                };
                write(id, c);
                changed.push((id.to_string(), c));
            }
        }
        self.active.store(state.len(), Ordering::Relaxed);
        changed
    }

    /// Every key backed off at `now`, by id.
    pub fn status(&self, now: Time) -> Vec<KeyPushback> {
        let mut v: Vec<KeyPushback> = self
            .keys
            .lock()
            .expect("pushback lock")
            .iter()
            .map(|(id, k)| KeyPushback {
                id: id.clone(),
                factor: k.factor,
                hold_s: k.hold_left(now).map_or(0.0, |d| d.as_secs_f64()),
                before: k.before,
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
mod tests;
