//! All-or-nothing admission of one request across the resources it names.
//!
//! Rate keys are reserved first (a refusal gives every reservation back),
//! then the request sleeps until its latest slot, then gauge permits are
//! taken FIFO in a fixed order. A gauge that cannot be had in time refuses
//! the request and gives the rate reservations back. Dropping the future
//! (the client went away) gives everything back too.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::demand::Outcome;
use super::gauge::GaugePermit;
use super::rate::Reservation;
use super::table::{Kind, Limiter};
use crate::clock::{Clock, Time};

/// What one request must be admitted by: limiter keys and costs. Cloning
/// it is one reference count: the admission keeps it to leave its keys.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub items: Arc<[(Arc<Limiter>, f64)]>,
}

impl Plan {
    pub fn new(mut items: Vec<(Arc<Limiter>, f64)>) -> Self {
        // One global order, so two requests never wait on each other's gauges crosswise.
        if items.len() > 1 {
            items.sort_by(|a, b| a.0.id().cmp(b.0.id()));
        }
        Plan { items: items.into() }
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The slot is further away than `max_wait`, or no gauge permit freed up in time.
    Exhausted,
    /// Too many requests are already waiting for this key.
    QueueFull,
    /// The capacity is 0.
    ZeroCapacity,
}

/// A refusal: enough to write the 429 and its headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    /// The configured resource name.
    pub resource: String,
    /// The resource id (key) that refused.
    pub id: String,
    pub kind: Kind,
    pub reason: Reason,
    /// When to come back: rounded up to whole seconds by the responder.
    pub retry_after: Duration,
    /// How long the request waited before it was refused.
    pub waited: Duration,
    pub max_wait: Duration,
    /// Capacity per `window` (rate) or in flight (gauge), for `RateLimit-Policy`.
    pub quota: f64,
    pub window: Duration,
    /// Units available now, for `RateLimit`.
    pub remaining: u64,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.reason {
            Reason::Exhausted => "no capacity within max_wait",
            Reason::QueueFull => "too many requests waiting",
            Reason::ZeroCapacity => "capacity is 0",
        };
        write!(
            f,
            "resource `{}` (id `{}`): {why}; waited {:?}, retry after {:?}",
            self.resource, self.id, self.waited, self.retry_after
        )
    }
}

impl std::error::Error for Refused {}

/// An admitted request's hold on its resources; released when dropped.
pub struct Admitted {
    pub waited: Duration,
    pub paced: bool,
    _permits: Vec<GaugePermit>,
    in_flight: Plan,
}

impl fmt::Debug for Admitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admitted").field("waited", &self.waited).field("paced", &self.paced).finish()
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        for (l, _) in self.in_flight.items.iter() {
            l.demand().leave();
        }
    }
}

/// Rate reservations given back unless disarmed.
struct Reserved(Vec<(Arc<Limiter>, f64)>);

impl Drop for Reserved {
    fn drop(&mut self) {
        for (l, cost) in self.0.drain(..) {
            if let Some(r) = l.rate() {
                r.release(cost);
            }
        }
    }
}

/// Decrements a key's waiter count when the wait ends, however it ends.
struct Waiting<'a>(&'a [(Arc<Limiter>, f64)]);

impl<'a> Waiting<'a> {
    fn begin(items: &'a [(Arc<Limiter>, f64)]) -> Self {
        for (l, _) in items {
            l.demand().wait_begin();
        }
        Waiting(items)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        for (l, _) in self.0 {
            l.demand().wait_end();
        }
    }
}

fn refused(l: &Limiter, reason: Reason, retry_after: Duration, waited: Duration) -> Refused {
    l.demand().record(Outcome::Refused);
    let spec = l.spec();
    let quota = match l.kind() {
        Kind::Rate => l.capacity() * spec.window.as_secs_f64(),
        Kind::Gauge => l.capacity(),
    };
    Refused {
        resource: spec.name.clone(),
        id: l.id().to_string(),
        kind: l.kind(),
        reason,
        retry_after,
        waited,
        max_wait: spec.max_wait,
        quota,
        window: spec.window,
        remaining: l.remaining(),
    }
}

enum Blocked {
    Refuse(Box<Refused>),
    /// A rate key at capacity 0 that may still be raised before `max_wait`.
    Zero(Arc<Limiter>),
}

/// Reserves every rate key, or none. Returns the reservations and the longest wait.
fn reserve_rates(plan: &Plan, arrival: Time, now: Time) -> Result<(Reserved, Duration), Blocked> {
    let mut held = Reserved(Vec::new());
    let mut longest = Duration::ZERO;
    let waited = now.since(arrival);
    for (l, cost) in plan.items.iter() {
        let Some(rate) = l.rate() else { continue };
        let spec = l.spec();
        let budget = spec.max_wait.saturating_sub(waited);
        match rate.reserve(now, *cost, budget) {
            Reservation::Slot { wait, cost } => {
                if !wait.is_zero() && l.demand().waiters() >= spec.max_queue as i64 {
                    rate.release(cost);
                    return Err(Blocked::Refuse(Box::new(refused(l, Reason::QueueFull, wait, waited))));
                }
                held.0.push((l.clone(), cost));
                longest = longest.max(wait);
            }
            Reservation::TooLate { wait: Some(wait) } => {
                return Err(Blocked::Refuse(Box::new(refused(l, Reason::Exhausted, wait, waited))));
            }
            Reservation::TooLate { wait: None } if budget.is_zero() => {
                return Err(Blocked::Refuse(Box::new(refused(
                    l,
                    Reason::ZeroCapacity,
                    Duration::from_secs(1),
                    waited,
                ))));
            }
            Reservation::TooLate { wait: None } => return Err(Blocked::Zero(l.clone())),
        }
    }
    Ok((held, longest))
}

/// Admits a request by `plan`, waiting at most each resource's `max_wait`.
pub async fn admit(plan: &Plan, clock: &Clock) -> Result<Admitted, Refused> {
    let arrival = clock.now();
    for (l, cost) in plan.items.iter() {
        l.demand().arrive(*cost);
    }

    // Rates: reserve all or none. A key at capacity 0 is waited on until it
    // is raised or its max_wait runs out.
    let mut zero_waited = false;
    let (reserved, longest) = loop {
        match reserve_rates(plan, arrival, clock.now()) {
            Ok(r) => break r,
            Err(Blocked::Refuse(r)) => return Err(*r),
            Err(Blocked::Zero(l)) => {
                zero_waited = true;
                let rate = l.rate().expect("a rate key");
                let deadline = arrival.saturating_add(l.spec().max_wait);
                let changed = rate.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if rate.capacity() > 0.0 {
                    continue;
                }
                let _w = Waiting::begin(std::slice::from_ref(
                    plan.items.iter().find(|(k, _)| Arc::ptr_eq(k, &l)).expect("in plan"),
                ));
                tokio::select! {
                    _ = changed => continue,
                    _ = super::sleep_until(clock, deadline) => {
                        if rate.capacity() > 0.0 {
                            continue;
                        }
                        return Err(refused(&l, Reason::ZeroCapacity, Duration::from_secs(1), clock.now().since(arrival)));
                    }
                }
            }
        }
    };

    if !longest.is_zero() {
        let rates: Vec<_> = reserved.0.clone();
        let _w = Waiting::begin(&rates);
        super::sleep_until(clock, clock.now().saturating_add(longest)).await;
    }

    // Gauges, FIFO, in plan order.
    let mut permits = Vec::new();
    let mut gauge_waited = false;
    for (l, cost) in plan.items.iter() {
        let Some(g) = l.gauge() else { continue };
        let units = cost.round().max(1.0) as u32;
        let permit = match g.try_acquire(units) {
            Some(p) => Some(p),
            None if l.demand().waiters() >= l.spec().max_queue as i64 => {
                return Err(refused(l, Reason::QueueFull, Duration::from_secs(1), clock.now().since(arrival)));
            }
            None => {
                gauge_waited = true;
                let deadline = arrival.saturating_add(l.spec().max_wait);
                let _w = Waiting::begin(std::slice::from_ref(
                    plan.items.iter().find(|(k, _)| Arc::ptr_eq(k, l)).expect("in plan"),
                ));
                g.acquire(units, clock, deadline).await
            }
        };
        match permit {
            Some(p) => permits.push(p),
            None => {
                let waited = clock.now().since(arrival);
                // No completion estimate for a gauge: a second is the shortest Retry-After.
                return Err(refused(l, Reason::Exhausted, Duration::from_secs(1), waited));
            }
        }
    }

    // Admitted: keep the reservations, count the request in flight.
    let mut reserved = reserved;
    reserved.0.clear();
    // Paced means the request had to wait for capacity, not that time passed while deciding.
    let paced = !longest.is_zero() || gauge_waited || zero_waited;
    let waited = if paced { clock.now().since(arrival) } else { Duration::ZERO };
    for (l, _) in plan.items.iter() {
        l.demand().record(if paced { Outcome::Paced } else { Outcome::Admitted });
        l.demand().enter();
    }
    Ok(Admitted { waited, paced, _permits: permits, in_flight: plan.clone() })
}
