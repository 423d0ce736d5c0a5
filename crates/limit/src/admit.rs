//! All-or-nothing admission of one request across the resources it names.
//!
//! Rate keys are reserved first (a refusal gives every reservation back),
//! then the request sleeps until its latest slot, then gauge permits are
//! taken FIFO in a fixed order. A gauge that cannot be had in time refuses
//! the request and gives the rate reservations back. Dropping the future
//! (the client went away) gives everything back too.
//!
//! [`start`] decides at once, with no allocation, whenever nothing has to
//! wait (the common case); only a request that must wait is boxed.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use super::demand::Outcome;
use super::gauge::GaugePermit;
use super::rate::{Reservation, Ticket};
use super::table::{Kind, Limiter};
use usher_core::clock::{Clock, Time};

/// What one request must be admitted by: limiter keys and costs. Cloning
/// it is one reference count: the admission keeps it to leave its keys.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The keys that admit or refuse the request.
    pub items: Arc<[(Arc<Limiter>, f64)]>,
    /// Keys of resources in shadow mode: decided as if enforced, never
    /// holding the request back ([`shadow`]).
    pub shadow: Arc<[(Arc<Limiter>, f64)]>,
}

impl Plan {
    /// A plan of these keys and costs: sorted by key id, with the keys of
    /// shadow resources set apart.
    pub fn new(mut items: Vec<(Arc<Limiter>, f64)>) -> Self {
        // One global order, so two requests never wait on each other's gauges crosswise.
        if items.len() > 1 {
            items.sort_by(|a, b| a.0.id().cmp(b.0.id()));
        }
        if items.iter().any(|(l, _)| l.is_shadow()) {
            let (shadow, items): (Vec<_>, Vec<_>) = items.into_iter().partition(|(l, _)| l.is_shadow());
            return Plan { items: items.into(), shadow: shadow.into() };
        }
        Plan { items: items.into(), shadow: Arc::default() }
    }

    /// Whether the plan names no key, enforced or shadow.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty() && self.shadow.is_empty()
    }
}

/// What the shadow resources of a plan would have done to a request that
/// goes through anyway: held until the response ends (its gauge permits and
/// in-flight counts, as an enforced admission's).
#[derive(Debug)]
pub struct Shadow {
    /// The shadow resource that would have refused the request.
    pub refused: Option<String>,
    /// How long it would have waited for its slots.
    pub would_wait: Duration,
    _permits: Vec<GaugePermit>,
    keys: Arc<[(Arc<Limiter>, f64)]>,
}

impl Drop for Shadow {
    fn drop(&mut self) {
        for (l, _) in self.keys.iter() {
            l.demand().leave();
        }
    }
}

/// Decides a plan's shadow keys as an enforced admission would (all or
/// nothing; a slot that would be waited for is kept at its time, so the key's
/// state evolves as an enforcing twin's), without waiting: None when the plan
/// has none.
pub fn shadow(plan: &Plan, clock: &Clock) -> Option<Shadow> {
    if plan.shadow.is_empty() {
        return None;
    }
    let now = clock.now();
    let mut reserved: Vec<(&Arc<Limiter>, f64)> = Vec::new();
    let mut permits = Vec::new();
    let mut would_wait = Duration::ZERO;
    let mut refused_by: Option<&Arc<Limiter>> = None;
    for (l, cost) in plan.shadow.iter() {
        l.demand().arrive(*cost);
        l.arrived();
    }
    for (l, cost) in plan.shadow.iter() {
        if let Some(rate) = l.rate() {
            match rate.reserve(now, *cost, l.spec().max_wait) {
                Reservation::Slot { wait, cost } => {
                    reserved.push((l, cost));
                    would_wait = would_wait.max(wait);
                }
                Reservation::TooLate { .. } => {
                    refused_by = Some(l);
                    break;
                }
            }
        } else if let Some(g) = l.gauge() {
            match g.try_acquire(gauge_units(*cost)) {
                Some(p) => permits.push(p),
                None => {
                    refused_by = Some(l);
                    break;
                }
            }
        }
    }
    let refused = refused_by.map(|l| {
        for (r, cost) in reserved.drain(..) {
            r.rate().expect("a rate key").release(cost);
        }
        permits.clear();
        l.demand().record(Outcome::Refused);
        l.nudge();
        l.spec().name.clone()
    });
    for (l, _) in plan.shadow.iter() {
        if refused.is_none() {
            l.demand().record(if would_wait.is_zero() { Outcome::Admitted } else { Outcome::Paced });
        }
        l.demand().enter();
    }
    Some(Shadow { refused, would_wait, _permits: permits, keys: plan.shadow.clone() })
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
    /// The upstream's `Retry-After` holds the key past `max_wait`.
    Held,
}

/// A refusal: enough to write the 429 and its headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    /// The configured resource name.
    pub resource: String,
    /// The resource id (key) that refused.
    pub id: String,
    /// Whether the key is a rate or a gauge.
    pub kind: Kind,
    /// Why it refused.
    pub reason: Reason,
    /// When to come back: rounded up to whole seconds by the responder.
    pub retry_after: Duration,
    /// How long the request waited before it was refused.
    pub waited: Duration,
    /// The resource's `max_wait`.
    pub max_wait: Duration,
    /// Capacity per `window` (rate) or in flight (gauge), for `RateLimit-Policy`.
    pub quota: f64,
    /// The window a rate's `quota` is counted over, as its capacity was written (`/min`: 60 s).
    pub window: Duration,
    /// Units available now, for `RateLimit`.
    pub remaining: u64,
    /// For [`Reason::ZeroCapacity`]: why the capacity is 0, when whoever
    /// set it said (the sidecar's lease client does).
    pub why: Option<&'static str>,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.reason {
            Reason::Exhausted => "no capacity within max_wait",
            Reason::QueueFull => "too many requests waiting",
            Reason::ZeroCapacity => "capacity is 0",
            Reason::Held => "its upstream's Retry-After holds it past max_wait",
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
    /// How long the request waited for capacity (zero unless `paced`).
    pub waited: Duration,
    /// The request had to wait for a slot, a raised capacity or a gauge permit.
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

/// Rate reservations given back unless disarmed, each with its place in
/// its key's queue (`tickets`, in the same order).
struct Reserved(Vec<(Arc<Limiter>, f64)>, Vec<Ticket>);

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
            l.nudge();
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

/// The longest `Retry-After` usher says, whatever the wait: an hour.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// A refusal's `Retry-After` for a wait of `wait` at `now`: at least a
/// second, at most [`MAX_RETRY_AFTER`], and for a key paced or leased 0, no
/// later than the next moment its capacity can change that the sidecar knows
/// of (the lease client's next call, a lease's expiry): a queue that is full
/// now may have room after a new lease, and the app should ask then rather
/// than after the whole queue (tens of seconds under a fair share). A spent
/// quota's renewal or an upstream's hold says when by itself.
fn retry_after(l: &Limiter, reason: Reason, wait: Duration, now: Time) -> Duration {
    let hold = l.hold_until().filter(|u| *u > now);
    let wait = match (reason, l.renewal()) {
        // Held by its upstream (pushback leaves it 0 until then): the hold says when.
        (Reason::ZeroCapacity | Reason::Held, _) if hold.is_some() => hold.map_or(wait, |u| u.since(now)),
        // An allotment spent while the whole unit's quota is: nothing before the reset.
        (Reason::Exhausted, _) if l.renews().is_some() && l.rate().is_some_and(|r| r.allotment_reset().is_some()) => {
            wait
        }
        (Reason::Exhausted | Reason::QueueFull, Some(t)) => wait.min(t.since(now)),
        // Leased 0 by shared servers, no quota spent: nothing passes before
        // the lease changes. (An embedded server's lease changes when the
        // routes file does, which no call foretells.)
        (Reason::ZeroCapacity, Some(t)) if l.renews().is_none() && l.spec().shared => t.since(now),
        _ => wait,
    };
    wait.clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
}

fn refused(l: &Limiter, reason: Reason, retry_after: Duration, waited: Duration) -> Refused {
    l.demand().record(Outcome::Refused);
    l.nudge();
    let now = l.clock().now();
    let retry_after = self::retry_after(l, reason, retry_after, now);
    l.demand().retry_at(now.saturating_add(retry_after));
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
        why: None,
    }
}

/// The refusal of a key that admits nothing until it changes: a spent
/// allotment (nothing refills before its reset; the lease client's next
/// call may bring more), or capacity 0.
fn nothing_left(l: &Limiter, now: Time, waited: Duration) -> Refused {
    match l.rate().and_then(|r| r.allotment_reset()) {
        Some(reset) => refused(l, Reason::Exhausted, reset.since(now), waited),
        None => refused(l, Reason::ZeroCapacity, l.zero_retry(now), waited),
    }
}

enum Blocked {
    Refuse(Box<Refused>),
    /// A rate key at capacity 0 that may still be raised before `max_wait`.
    Zero(Arc<Limiter>),
}

/// Reserves every rate key, or none. Returns the reservations and the longest wait.
fn reserve_rates(plan: &Plan, arrival: Time, now: Time) -> Result<(Reserved, Duration), Blocked> {
    let mut held = Reserved(Vec::new(), Vec::new());
    let mut longest = Duration::ZERO;
    let waited = now.since(arrival);
    for (l, cost) in plan.items.iter() {
        let Some(rate) = l.rate() else { continue };
        let spec = l.spec();
        let budget = spec.max_wait.saturating_sub(waited);
        let (mut reservation, mut ticket) = rate.reserve_ticket(now, *cost, budget, 0.0);
        // Too late at the lease: a credit of the servers' pool may still bring it in time.
        if let Reservation::TooLate { wait: Some(_) } = reservation
            && l.pooled() > 0.0
        {
            (reservation, ticket) = rate.reserve_ticket(now, *cost, budget, l.pooled());
        }
        match reservation {
            Reservation::Slot { wait, cost } => {
                if !wait.is_zero() && l.demand().waiters() >= spec.max_queue as i64 {
                    rate.release(cost);
                    return Err(Blocked::Refuse(Box::new(refused(l, Reason::QueueFull, wait, waited))));
                }
                held.0.push((l.clone(), cost));
                held.1.push(ticket);
                longest = longest.max(wait);
            }
            Reservation::TooLate { wait: Some(wait) } => {
                return Err(Blocked::Refuse(Box::new(refused(l, Reason::Exhausted, wait, waited))));
            }
            Reservation::TooLate { wait: None } if budget.is_zero() => {
                return Err(Blocked::Refuse(Box::new(nothing_left(l, now, waited))));
            }
            Reservation::TooLate { wait: None } => return Err(Blocked::Zero(l.clone())),
        }
    }
    Ok((held, longest))
}

/// Admits a request by `plan`, waiting at most each resource's `max_wait`.
pub async fn admit(plan: &Plan, clock: &Clock) -> Result<Admitted, Refused> {
    start(plan, clock).await
}

/// An admission under way: decided at once when nothing had to wait, else
/// the wait (rates paced, a capacity of 0 that may be raised, gauges full).
pub enum Admission {
    /// Decided at once; `None` once the outcome was taken.
    Done(Option<Result<Admitted, Refused>>),
    /// The wait, boxed: only a request that must wait pays for it.
    Waiting(Pin<Box<dyn Future<Output = Result<Admitted, Refused>> + Send>>),
}

impl Future for Admission {
    type Output = Result<Admitted, Refused>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Admission::Done(out) => Poll::Ready(out.take().expect("Admission polled after completion")),
            Admission::Waiting(fut) => fut.as_mut().poll(cx),
        }
    }
}

/// Starts admitting a request by `plan`: see [`Admission`].
pub fn start(plan: &Plan, clock: &Clock) -> Admission {
    let arrival = clock.now();
    for (l, cost) in plan.items.iter() {
        l.demand().arrive(*cost);
        l.arrived();
    }
    let waiting = |f: Pin<Box<dyn Future<Output = Result<Admitted, Refused>> + Send>>| Admission::Waiting(f);
    match reserve_rates(plan, arrival, arrival) {
        Err(Blocked::Refuse(r)) => Admission::Done(Some(Err(*r))),
        Err(Blocked::Zero(_)) => {
            if let Some(r) = held(plan, arrival) {
                return Admission::Done(Some(Err(r)));
            }
            let (plan, clock) = (plan.clone(), clock.clone());
            waiting(Box::pin(async move {
                let (reserved, longest) = rates_after_zero(&plan, &clock, arrival).await?;
                finish(&plan, &clock, arrival, reserved, longest, true).await
            }))
        }
        Ok((reserved, longest)) if longest.is_zero() => match gauges_now(plan, clock, arrival) {
            Ok(Some(permits)) => Admission::Done(Some(Ok(admitted(plan, reserved, permits, false, arrival, clock)))),
            Err(r) => Admission::Done(Some(Err(*r))),
            // A gauge is full: wait for it.
            Ok(None) => {
                if let Some(r) = held(plan, arrival) {
                    return Admission::Done(Some(Err(r)));
                }
                let (plan, clock) = (plan.clone(), clock.clone());
                waiting(Box::pin(async move { finish(&plan, &clock, arrival, reserved, longest, false).await }))
            }
        },
        Ok((reserved, longest)) => {
            let (plan, clock) = (plan.clone(), clock.clone());
            waiting(Box::pin(async move { finish(&plan, &clock, arrival, reserved, longest, false).await }))
        }
    }
}

/// A refusal when a key of the plan is held by its upstream's `Retry-After`
/// (upstream pushback) until after its `max_wait`: nothing is admitted before
/// the hold ends, so waiting for it would only end in a later refusal. Only
/// an admission that has to wait asks: its key is at capacity 0 or full.
fn held(plan: &Plan, arrival: Time) -> Option<Refused> {
    plan.items.iter().find_map(|(l, _)| {
        let until = l.hold_until()?;
        (until > arrival.saturating_add(l.spec().max_wait))
            .then(|| refused(l, Reason::Held, until.since(arrival), Duration::ZERO))
    })
}

/// Every gauge's permits at once (`Ok(None)`: one is full, nothing kept),
/// or a refusal (a full gauge's queue is full too).
fn gauges_now(plan: &Plan, clock: &Clock, arrival: Time) -> Result<Option<Vec<GaugePermit>>, Box<Refused>> {
    let mut permits = Vec::new();
    for (l, cost) in plan.items.iter() {
        let Some(g) = l.gauge() else { continue };
        match g.try_acquire(gauge_units(*cost)) {
            Some(p) => permits.push(p),
            None if l.demand().waiters() >= l.spec().max_queue as i64 => {
                return Err(Box::new(refused(
                    l,
                    Reason::QueueFull,
                    Duration::from_secs(1),
                    clock.now().since(arrival),
                )));
            }
            None => return Ok(None),
        }
    }
    Ok(Some(permits))
}

fn gauge_units(cost: f64) -> u32 {
    cost.round().max(1.0) as u32
}

/// Rates, after a key at capacity 0 blocked them: waited on until it is
/// raised or its `max_wait` runs out, then all reserved or none.
async fn rates_after_zero(plan: &Plan, clock: &Clock, arrival: Time) -> Result<(Reserved, Duration), Refused> {
    loop {
        match reserve_rates(plan, arrival, clock.now()) {
            Ok(r) => return Ok(r),
            Err(Blocked::Refuse(r)) => return Err(*r),
            Err(Blocked::Zero(l)) => {
                let rate = l.rate().expect("a rate key");
                let cost = plan.items.iter().find(|(k, _)| Arc::ptr_eq(k, &l)).map_or(1.0, |(_, c)| *c);
                let deadline = arrival.saturating_add(l.spec().max_wait);
                let changed = rate.changed().notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if rate.open(clock.now(), cost) {
                    continue;
                }
                let _w = Waiting::begin(std::slice::from_ref(
                    plan.items.iter().find(|(k, _)| Arc::ptr_eq(k, &l)).expect("in plan"),
                ));
                tokio::select! {
                    _ = changed => continue,
                    _ = super::sleep_until(clock, deadline) => {
                        let now = clock.now();
                        if rate.open(now, cost) {
                            continue;
                        }
                        return Err(nothing_left(&l, now, now.since(arrival)));
                    }
                }
            }
        }
    }
}

/// Sleeps until every reserved slot has come, following capacity increases
/// and refunds that bring them forward: only the key whose slot is the
/// latest can end the wait sooner, so its changes are the ones listened to.
/// A debt settled meanwhile puts a slot back without a wake-up: each slot
/// is looked at again when it comes.
async fn wait_for_slots(clock: &Clock, rates: &[(Arc<Limiter>, f64)], tickets: &mut [Ticket]) {
    loop {
        let now = clock.now();
        let mut latest: Option<(usize, Duration)> = None;
        for (i, ((l, _), t)) in rates.iter().zip(tickets.iter_mut()).enumerate() {
            let wait = l.rate().expect("a rate key").retime(t, now);
            if latest.is_none_or(|(_, w)| wait > w) {
                latest = Some((i, wait));
            }
        }
        let Some((i, wait)) = latest.filter(|(_, w)| !w.is_zero()) else { return };
        let rate = rates[i].0.rate().expect("a rate key");
        let changed = rate.changed().notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        // A change just before `enable` was not heard: look once more.
        if rate.retime(&mut tickets[i], now) < wait {
            continue;
        }
        tokio::select! {
            _ = changed => {}
            _ = super::sleep_until(clock, now.saturating_add(wait)) => {}
        }
    }
}

/// With every rate reserved: waits for the latest slot, then takes the
/// gauges' permits FIFO, in plan order.
async fn finish(
    plan: &Plan,
    clock: &Clock,
    arrival: Time,
    mut reserved: Reserved,
    longest: Duration,
    zero_waited: bool,
) -> Result<Admitted, Refused> {
    if !longest.is_zero() {
        let rates: Vec<_> = reserved.0.clone();
        let _w = Waiting::begin(&rates);
        wait_for_slots(clock, &rates, &mut reserved.1).await;
    }

    let mut permits = Vec::new();
    let mut gauge_waited = false;
    for (l, cost) in plan.items.iter() {
        let Some(g) = l.gauge() else { continue };
        let units = gauge_units(*cost);
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
    // Paced means the request had to wait for capacity, not that time passed while deciding.
    let paced = !longest.is_zero() || gauge_waited || zero_waited;
    Ok(admitted(plan, reserved, permits, paced, arrival, clock))
}

/// Admitted: keeps the reservations, counts the request in flight.
fn admitted(
    plan: &Plan,
    mut reserved: Reserved,
    permits: Vec<GaugePermit>,
    paced: bool,
    arrival: Time,
    clock: &Clock,
) -> Admitted {
    reserved.0.clear();
    let waited = if paced { clock.now().since(arrival) } else { Duration::ZERO };
    for (l, _) in plan.items.iter() {
        l.demand().record(if paced { Outcome::Paced } else { Outcome::Admitted });
        l.demand().enter();
    }
    Admitted { waited, paced, _permits: permits, in_flight: plan.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LeaseTable, ResourceSpec};

    /// A rate resource of `capacity` a second, a burst of 1, no waiting.
    fn spec(name: &str, capacity: f64) -> ResourceSpec {
        ResourceSpec {
            name: name.into(),
            kind: Kind::Rate,
            capacity,
            burst: 1.0,
            max_wait: Duration::ZERO,
            max_queue: 10,
            max_keys: 1,
            window: Duration::from_secs(1),
            shared: false,
            burst_span: None,
            shadow: false,
            upstream_quota: false,
            templated: false,
        }
    }

    /// A request waiting for its slot follows the costs settled meanwhile:
    /// a debt holds it longer, a refund lets it go sooner.
    #[tokio::test]
    async fn a_waiting_request_follows_the_costs_settled_meanwhile() {
        let (clock, time) = Clock::manual(Time::from_secs(10));
        let table = LeaseTable::new(clock.clone());
        table.configure(vec![ResourceSpec { max_wait: Duration::from_secs(10), ..spec("tokens", 1.0) }]);
        let key = table.resource("tokens").unwrap().limiter("tokens");
        let plan = Plan::new(vec![(key.clone(), 1.0)]);
        let done = |a: &mut Admission| {
            let waker = std::task::Waker::noop();
            Pin::new(a).poll(&mut Context::from_waker(waker)).is_ready()
        };
        assert!(done(&mut start(&plan, &clock)), "the first passes at once");
        let mut second = start(&plan, &clock);
        assert!(!done(&mut second), "the second waits 1 s");
        // The first really cost 2: the second now waits until 2 s.
        key.rate().unwrap().charge(clock.now(), 1.0);
        time.advance(Duration::from_millis(1500));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!done(&mut second), "held for the debt");
        time.advance(Duration::from_millis(500));
        let second = tokio::time::timeout(Duration::from_secs(5), second).await;
        assert!(matches!(second, Ok(Ok(_))), "admitted once the debt is paid");
        // A third waits 1 s behind it; a refund of its predecessor's cost lets it go now.
        let third = tokio::spawn(start(&plan, &clock));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!third.is_finished());
        key.rate().unwrap().charge(clock.now(), -1.0);
        let third = tokio::time::timeout(Duration::from_secs(5), third).await;
        assert!(matches!(third, Ok(Ok(Ok(_)))), "admitted on the refund");
    }

    /// A refusal's Retry-After is a whole second at least, never past the
    /// lease client's next call for a paced key or one leased 0, and for a
    /// spent quota the moment it renews; never the 584-year wait of a
    /// near-zero capacity.
    #[tokio::test]
    #[allow(clippy::result_large_err, reason = "a test's closure hands the refusal back as admit does")]
    async fn retry_after_is_at_least_a_second_and_never_past_the_next_renewal() {
        let (clock, time) = Clock::manual(Time::from_secs(10));
        let table = LeaseTable::new(clock.clone());
        table.configure(vec![
            spec("slow", 0.01),
            spec("tiny", 1e-12),
            ResourceSpec { shared: true, ..spec("zero", 0.0) },
        ]);
        let attempt = |name: &str| {
            let key = table.resource(name).unwrap().limiter(name);
            let plan = Plan::new(vec![(key, 1.0)]);
            let mut a = start(&plan, &clock);
            let waker = std::task::Waker::noop();
            match Pin::new(&mut a).poll(&mut Context::from_waker(waker)) {
                Poll::Ready(r) => r,
                Poll::Pending => panic!("{name}: waits"),
            }
        };
        let refusal = |name: &str| attempt(name).expect_err("refused");
        // The burst passes; the next would wait 100 s.
        assert!(attempt("slow").is_ok() && attempt("tiny").is_ok());
        let slow = refusal("slow");
        assert_eq!(slow.retry_after, Duration::from_secs(100), "nothing renews sooner: the slot's wait");
        let tiny = refusal("tiny");
        assert_eq!(tiny.retry_after, MAX_RETRY_AFTER, "never more than an hour");
        table.set_renewal(Some(clock.now().saturating_add(Duration::from_millis(3500))));
        assert_eq!(refusal("slow").retry_after, Duration::from_millis(3500), "the lease client calls in 3.5 s");
        assert_eq!(refusal("zero").retry_after, Duration::from_millis(3500), "a lease of 0 may change then too");
        table.set_hold("zero", Some(clock.now().saturating_add(Duration::from_millis(400))));
        assert_eq!(
            refusal("zero").retry_after,
            Duration::from_secs(1),
            "held by its upstream 0.4 s more: the hold says when"
        );
        table.set_hold("zero", None);
        table.set_renewal(Some(clock.now().saturating_add(Duration::from_millis(200))));
        assert_eq!(refusal("slow").retry_after, Duration::from_secs(1), "at least a second");
        let zero = table.resource("zero").unwrap().limiter("zero");
        zero.set_renews(Some(clock.now().saturating_add(Duration::from_secs(42))));
        assert_eq!(refusal("zero").retry_after, Duration::from_secs(42), "a spent quota: when it renews");
        time.advance(Duration::from_secs(1));
        let due = zero.demand().retries_due().expect("the refusals said when to come back");
        assert_eq!(due, Time::from_secs(10).saturating_add(Duration::from_secs(42)));
    }

    /// A calendar key whose allotment is spent holds a request up to its
    /// `max_wait` for the next allotment, and a new one wakes it at once;
    /// a request refused meanwhile says to retry at the lease client's next
    /// call, or at the reset when the whole unit's quota is spent.
    #[tokio::test]
    async fn a_spent_allotment_waits_for_the_next_one() {
        use crate::allot::Allotment;
        let (clock, time) = Clock::manual(Time::from_secs(1_800_000_000));
        let table = LeaseTable::new(clock.clone());
        table.configure(vec![ResourceSpec {
            max_wait: Duration::from_millis(500),
            max_queue: 100,
            window: Duration::from_secs(60),
            shared: true,
            burst_span: Some(Duration::from_secs(1)),
            ..spec("cal", 2.0)
        }]);
        let key = table.resource("cal").unwrap().limiter("cal");
        let reset = Time::from_secs(1_800_000_060);
        table.allot("cal", Some(Allotment { units: 3.0, reset, mark: None }));
        let plan = Plan::new(vec![(key.clone(), 1.0)]);
        let done = |a: &mut Admission| {
            let waker = std::task::Waker::noop();
            match Pin::new(a).poll(&mut Context::from_waker(waker)) {
                Poll::Ready(r) => Some(r.is_ok()),
                Poll::Pending => None,
            }
        };
        // A burst of five: three pass at once, two wait.
        let mut burst: Vec<Admission> = (0..5).map(|_| start(&plan, &clock)).collect();
        let passed = burst.iter_mut().filter_map(&done).filter(|ok| *ok).count();
        assert_eq!(passed, 3, "the allotment, at once");
        let mut waiting: Vec<_> = burst.into_iter().skip(3).collect();
        assert!(waiting.iter_mut().all(|a| done(a).is_none()), "the rest wait for the next allotment");
        // The lease client's next call brings one more: one waiter passes at once.
        time.advance(Duration::from_millis(200));
        let mark = key.account().unwrap().mark;
        table.allot("cal", Some(Allotment { units: 1.0, reset, mark: Some(mark) }));
        let first = tokio::time::timeout(Duration::from_secs(5), waiting.remove(0)).await;
        assert!(matches!(first, Ok(Ok(_))), "woken by the new allotment");
        // The last is refused at its max_wait, told to come back at the lease client's next call.
        table.set_renewal(Some(clock.now().saturating_add(Duration::from_millis(2500))));
        time.advance(Duration::from_millis(300));
        let last = tokio::time::timeout(Duration::from_secs(5), waiting.remove(0)).await.unwrap().unwrap_err();
        assert_eq!((last.reason, last.retry_after), (Reason::Exhausted, Duration::from_millis(2200)), "{last}");
        // With the unit's whole quota spent, at the reset.
        key.set_renews(Some(reset));
        let refused = start(&Plan::new(vec![(key.clone(), 1.0)]), &clock);
        tokio::pin!(refused);
        time.advance(Duration::from_millis(500));
        let refused = tokio::time::timeout(Duration::from_secs(5), refused).await.unwrap().unwrap_err();
        assert_eq!(refused.retry_after, reset.since(clock.now()), "{refused}");
        // Its account: four admitted in the unit, nothing left.
        let a = key.account().unwrap();
        assert_eq!((a.spent, a.left, a.reset), (4.0, 0.0, reset));
    }
}
