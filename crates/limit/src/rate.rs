//! A GCRA pacer for one rate key.
//!
//! State is one theoretical arrival time (TAT) behind a mutex held for a few
//! arithmetic operations. A request *reserves* its slot on arrival (TAT moves
//! on by `cost × interval`) and then sleeps until the slot: reservations are
//! handed out in arrival order, so pacing is FIFO without a queue structure.
//! A reservation can be given back (a client that disconnects while waiting,
//! or a multi-resource admission refused elsewhere).
//!
//! Time is exact: positions are integer nanoseconds since the limiter was
//! made, in fixed point with 32 bits below the nanosecond, so an interval of
//! 1/7,000,000 s drifts by less than a nanosecond over a billion units. (An
//! `f64` of nanoseconds since the Unix epoch has a smallest step of 256 ns
//! today: at 10M/s its state never advanced and at 1M/s it admitted about
//! 2.4% too little.)
//!
//! A capacity increase brings waiting requests forward: each keeps its place
//! in the queue, and the time it still had to wait shrinks by the ratio of
//! the intervals ([`Rate::retime`]), as the backlog does. (Kept at their
//! old slots, requests queued under a small capacity, such as a sidecar's
//! on-expiry capacity before its first lease, held a connection for up to
//! `max_wait` after the lease arrived, and the key stayed far below it.)
//! A decrease moves nobody: a slot once given is kept. A cost settled
//! from the answer ([`Rate::charge`]) moves the queue too, as a request's
//! real cost would have: a debt puts every waiting request back by the
//! debt, a refund brings them forward (never before now). A debt may hold a
//! request past its `max_wait`, up to twice it ([`DEBT_WAIT`]): a queue
//! kept full by more demand than capacity waits close to `max_wait`, and
//! capped there it could not follow a debt at all. (Kept at slots reckoned
//! with the charged cost, an LLM sidecar's queue of two or three calls let
//! one go 4.5 s after a call of 59 tokens, or right after one of 250, and
//! its minute's spend strayed from its lease by up to twice one call's cost.)
//!
//! A key of a calendar quota holds an allotment instead (`allot`): while
//! it does, [`Rate::reserve`] takes from it and the GCRA state waits unused
//! ([`Rate::allot`]).
//!
//! Why not governor: a live capacity change must carry the GCRA state across
//! (no fresh burst) and an all-or-nothing admission must undo a reservation;
//! governor exposes neither its TAT nor an undo, and a replaced limiter starts
//! with a full burst.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use once_cell::race::OnceBox;
use tokio::sync::Notify;

use super::allot::{Account, Allot, Allotment};
use usher_core::clock::{Clock, Time};

/// Bits of a position below the nanosecond.
const FRAC: u32 = 32;
const ONE_NS: u128 = 1 << FRAC;
/// How many times its `max_wait` a request may wait when debts settled
/// while it waits put it back.
pub const DEBT_WAIT: u32 = 2;
/// Changes remembered for [`Rate::retime`]; a waiter that missed more (it
/// would have to sleep through that many changes) keeps its slot.
const CHANGES_KEPT: usize = 8;

/// A rate: `capacity` units per second, `burst` units at once from idle.
pub struct Rate {
    state: Mutex<State>,
    /// Woken on capacity changes, for requests waiting on capacity 0 or
    /// for their slots: made by the first such request ([`Rate::changed`]),
    /// so a key nobody waits at pays a pointer for it (a `OnceBox` is one
    /// pointer, a `OnceLock` two words). A waiter enables its `notified()`
    /// and then looks at the state again, so a change made before the
    /// first waiter made it is not missed.
    changed: OnceBox<Notify>,
}

/// Packed to 8-byte alignment: its `u128`s would align it, and with it the
/// whole limiter, to 16 bytes, which costs a key 16 bytes of padding. (An
/// unaligned `u128` reads as two 8-byte words; no reference to a field is
/// taken.)
#[repr(C, packed(8))]
struct State {
    /// Positions count from here.
    origin: Time,
    /// Theoretical arrival time: a position (nanoseconds since `origin`, fixed point).
    tat: u128,
    /// Fixed-point nanoseconds per unit: [`CLOSED`] at capacity 0 (nothing
    /// passes), 0 when the capacity is infinite (everything passes). Read
    /// through [`State::interval`]; a bare `u128` takes 16 bytes where an
    /// `Option` takes 32.
    interval: u128,
    burst: f64,
    /// `burst` intervals, kept with them (every reservation needs it).
    burst_span: u128,
    capacity: f64,
    /// At capacity 0: how full the bucket was (units) when the capacity went
    /// to 0. Nothing refills at rate 0, so the bucket stays as it was (a
    /// burst that shrank with the capacity clipped it first): a key comes
    /// back with what it had, never with a fresh burst.
    frozen: f64,
    /// The changes that move waiting requests and a calendar quota's
    /// allotment, boxed together, made at the first of either: a key whose
    /// capacity never rises under waiters, that settles no cost and holds
    /// no allotment pays one pointer for both.
    seldom: Option<Box<Seldom>>,
}

/// A change that moves the slots of the requests waiting ([`Rate::retime`]).
#[derive(Debug, Clone, Copy)]
enum Change {
    /// The capacity rose at position `at`, from interval `old` to `new`:
    /// the time a slot after it still had to wait shrinks by their ratio.
    Faster { at: u128, old: u128, new: u128 },
    /// A cost settled at `at` above (`later`) or below its charge, by `by`:
    /// a slot after it moves by as much, never past its request's deadline
    /// nor before `at`.
    Settled { at: u128, by: u128, later: bool },
}

/// The interval of capacity 0: no finite capacity's interval reaches it
/// ([`interval_of`] keeps them below `u128::MAX as f64`, itself below this).
const CLOSED: u128 = u128::MAX;

/// What few rate keys need ([`State::seldom`]).
#[derive(Debug, Default)]
struct Seldom {
    /// How many changes moved waiting requests so far ([`Rate::retime`]; 0
    /// while the box is not made).
    generation: u64,
    /// The last of them, with their generations.
    kept: VecDeque<(u64, Change)>,
    /// A calendar quota's allotment, which admits instead of the GCRA while
    /// there is one (boxed: a key with changes alone pays a pointer).
    allot: Option<Box<Allot>>,
}

impl State {
    /// Records a change for the waiters to follow.
    fn changed(&mut self, change: Change) {
        let changes = self.seldom.get_or_insert_default();
        changes.generation += 1;
        changes.kept.push_back((changes.generation, change));
        if changes.kept.len() > CHANGES_KEPT {
            changes.kept.pop_front();
        }
    }

    /// Counts the changes that move waiting requests so far.
    fn generation(&self) -> u64 {
        self.seldom.as_ref().map_or(0, |c| c.generation)
    }

    /// The allotment, while there is one.
    #[inline]
    fn allot(&mut self) -> Option<&mut Allot> {
        self.seldom.as_mut().and_then(|x| x.allot.as_deref_mut())
    }

    /// Whether there is an allotment.
    fn allotted(&self) -> bool {
        self.seldom.as_ref().is_some_and(|x| x.allot.is_some())
    }

    /// Fixed-point nanoseconds per unit: `None` at capacity 0 (nothing
    /// passes), 0 when the capacity is infinite (everything passes).
    #[inline]
    fn interval(&self) -> Option<u128> {
        (self.interval != CLOSED).then_some(self.interval)
    }

    /// Sets the interval ([`interval_of`]'s `None`: capacity 0).
    fn set_interval(&mut self, interval: Option<u128>) {
        self.interval = interval.unwrap_or(CLOSED);
    }
}

impl State {
    /// `now` as a position; a time before the origin counts as the origin.
    fn pos(&self, now: Time) -> u128 {
        u128::from(now.as_nanos().saturating_sub(self.origin.as_nanos())) << FRAC
    }
}

/// The outcome of [`Rate::reserve`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reservation {
    /// Reserved: the request may pass once `wait` is over.
    Slot {
        /// How long the request waits for its slot.
        wait: Duration,
        /// The units reserved, to give back with [`Rate::release`] (0 when the rate is unlimited).
        cost: f64,
    },
    /// Not reserved: the earliest the request would pass (never, at capacity 0).
    TooLate {
        /// How long the request would have waited: `None` at capacity 0.
        wait: Option<Duration>,
    },
}

/// Where a reservation's request passes, for [`Rate::retime`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The position the request may pass at.
    slot: u128,
    /// The latest debts may put it back to: its reservation's time plus
    /// [`DEBT_WAIT`] × `max_wait`.
    deadline: u128,
    /// The rate's generation when `slot` was last brought up to date.
    generation: u64,
}

/// Fixed-point nanoseconds per unit (see [`State::interval`]). A capacity so
/// small that its interval does not fit passes nothing, like capacity 0.
fn interval_of(capacity: f64) -> Option<u128> {
    if capacity.is_infinite() && capacity > 0.0 {
        return Some(0);
    }
    if capacity.is_nan() || capacity <= 0.0 {
        return None;
    }
    let fx = 1e9 / capacity * ONE_NS as f64;
    // A finite interval is never 0 (that means unlimited), however large the capacity.
    (fx < u128::MAX as f64).then(|| (fx.round() as u128).max(1))
}

/// `units` intervals: exact for whole numbers of units, rounded to the
/// fixed point's resolution for fractional ones. Saturates.
fn times(interval: u128, units: f64) -> u128 {
    // (Comparisons and u64 casts only: the float-to-u128 conversion and
    // `fract` are library calls, and this runs on every admission.)
    if units == 1.0 {
        interval
    } else if units.is_nan() || units <= 0.0 {
        0
    } else if units < (1u64 << 53) as f64 && (units as u64) as f64 == units {
        interval.saturating_mul(u128::from(units as u64))
    } else {
        // `as` saturates a float too large for u128.
        (interval as f64 * units).round() as u128
    }
}

/// Whether a slot `wait` away passes within `max_wait` once a credit of
/// `credit` (a span) came, and within [`DEBT_WAIT`] × `max_wait` without it.
fn within_credit(wait: u128, credit: u128, max_wait: Duration) -> bool {
    ceil_duration(wait.saturating_sub(credit)) <= max_wait && ceil_duration(wait) <= max_wait.saturating_mul(DEBT_WAIT)
}

/// A fixed-point span as a Duration, rounded up to the nanosecond.
fn ceil_duration(fx: u128) -> Duration {
    Duration::from_nanos(u64::try_from(fx.div_ceil(ONE_NS)).unwrap_or(u64::MAX))
}

impl Rate {
    /// A rate at an idle start: the whole burst is available.
    pub fn new(capacity: f64, burst: f64, now: Time) -> Self {
        Self::starting(capacity, burst, f64::INFINITY, now)
    }

    /// A rate that starts with `available` units of its burst (at least one
    /// unit, at most the burst): a sidecar that shares its resource with
    /// others starts with one request's worth, since the rest of the fleet's
    /// burst may be spent already (see [`Rate::set`]).
    pub fn starting(capacity: f64, burst: f64, available: f64, now: Time) -> Self {
        Rate {
            state: Mutex::new({
                let (interval, burst) = (interval_of(capacity), burst.max(1.0));
                let burst_span = interval.map_or(0, |i| times(i, burst));
                let backlog = burst - available.clamp(1.0, burst);
                State {
                    origin: now,
                    // The position `backlog` intervals past the origin.
                    tat: interval.map_or(0, |i| times(i, backlog)),
                    interval: interval.unwrap_or(CLOSED),
                    burst,
                    burst_span,
                    capacity,
                    frozen: if interval.is_none() { backlog } else { 0.0 },
                    seldom: None,
                }
            }),
            changed: OnceBox::new(),
        }
    }

    /// What a request waiting at this rate listens to for changes.
    pub(crate) fn changed(&self) -> &Notify {
        self.changed.get_or_init(Box::default)
    }

    /// Wakes the requests waiting at this rate, if any ever waited.
    fn wake(&self) {
        if let Some(n) = self.changed.get() {
            n.notify_waiters();
        }
    }

    /// Units per second (`f64::INFINITY`: unlimited; 0: nothing passes).
    pub fn capacity(&self) -> f64 {
        self.state.lock().expect("rate lock").capacity
    }

    /// When this rate holds nothing that `Rate::new(capacity, burst, _)`
    /// would not: its capacity and burst are those, it has no allotment,
    /// and its bucket is full (the moment returned, past or not). `None`
    /// if its capacity or burst differ, it holds an allotment, or its
    /// capacity is 0 (a closed bucket never refills). What waiters follow
    /// ([`Rate::retime`]) does not count: a caller asks this of a key
    /// nobody waits at.
    pub fn fresh_at(&self, capacity: f64, burst: f64) -> Option<Time> {
        let s = self.state.lock().expect("rate lock");
        if s.capacity != capacity || s.burst != burst.max(1.0) || s.allotted() {
            return None;
        }
        s.interval()?;
        let full = u64::try_from(s.tat >> FRAC).unwrap_or(u64::MAX);
        Some(Time::from_nanos(s.origin.as_nanos().saturating_add(full)))
    }

    /// Units that may pass at once from idle (at least 1).
    pub fn burst(&self) -> f64 {
        self.state.lock().expect("rate lock").burst
    }

    /// Reserves `cost` units if they can pass within `max_wait` of `now`.
    pub fn reserve(&self, now: Time, cost: f64, max_wait: Duration) -> Reservation {
        self.reserve_ticket(now, cost, max_wait, 0.0).0
    }

    /// [`reserve`](Self::reserve), with the ticket that keeps a reserved
    /// request's place up to date through capacity increases ([`Rate::retime`]).
    ///
    /// `ahead`: units a credit may soon add to the bucket (the servers'
    /// pooled burst, which a waiting request asks for). A request that
    /// would pass within `max_wait` once they came is reserved too, if its
    /// slot is within [`DEBT_WAIT`] × `max_wait`: its wait is that long at
    /// most should the credit not come, as a debt's is.
    pub fn reserve_ticket(&self, now: Time, cost: f64, max_wait: Duration, ahead: f64) -> (Reservation, Ticket) {
        let mut s = self.state.lock().expect("rate lock");
        let at = now;
        let now = s.pos(now);
        let ticket = Ticket { slot: now, deadline: now, generation: s.generation() };
        if let Some(a) = s.allot() {
            return (take_allotted(a, at, cost), ticket);
        }
        let interval = match s.interval() {
            None => return (Reservation::TooLate { wait: None }, ticket),
            Some(0) => return (Reservation::Slot { wait: Duration::ZERO, cost: 0.0 }, ticket),
            Some(i) => i,
        };
        let cost_span = times(interval, cost);
        let new_tat = s.tat.max(now).saturating_add(cost_span);
        // One request always fits an idle bucket, even one that costs more
        // than the burst: it passes alone, and later ones wait for its cost.
        let slot = new_tat.saturating_sub(s.burst_span.max(cost_span)).max(now);
        let wait = ceil_duration(slot - now);
        if wait > max_wait && !(ahead > 0.0 && within_credit(slot - now, times(interval, ahead), max_wait)) {
            return (Reservation::TooLate { wait: Some(wait) }, ticket);
        }
        s.tat = new_tat;
        // (Reckoned only for a request that waits: the common case does not.)
        let deadline = match wait.is_zero() {
            true => slot,
            false => {
                let debt_wait = max_wait.saturating_mul(DEBT_WAIT).as_nanos();
                now.saturating_add(u128::from(u64::try_from(debt_wait).unwrap_or(u64::MAX)) << FRAC)
            }
        };
        (Reservation::Slot { wait, cost }, Ticket { slot, deadline, ..ticket })
    }

    /// Moves a reservation's slot by the changes since its ticket was last
    /// brought up to date (capacity increases, settled costs), and returns
    /// how long its request still waits from `now`.
    pub fn retime(&self, ticket: &mut Ticket, now: Time) -> Duration {
        let s = self.state.lock().expect("rate lock");
        let missed = s.seldom.as_ref().and_then(|c| c.kept.front()).is_some_and(|(g, _)| *g > ticket.generation + 1);
        if !missed {
            for &(_, change) in s.seldom.iter().flat_map(|c| c.kept.iter()).filter(|(g, _)| *g > ticket.generation) {
                match change {
                    Change::Faster { at, old, new } if ticket.slot > at => {
                        let left = (ticket.slot - at) as f64 * (new as f64 / old as f64);
                        ticket.slot = at + (left.ceil() as u128).min(ticket.slot - at);
                    }
                    Change::Settled { at, by, later: true } if ticket.slot > at => {
                        ticket.slot = ticket.slot.saturating_add(by).min(ticket.deadline.max(ticket.slot));
                    }
                    Change::Settled { at, by, later: false } if ticket.slot > at => {
                        ticket.slot = ticket.slot.saturating_sub(by).max(at);
                    }
                    _ => {}
                }
            }
        }
        ticket.generation = s.generation();
        ceil_duration(ticket.slot.saturating_sub(s.pos(now)))
    }

    /// Gives a reservation of `cost` units back.
    pub fn release(&self, cost: f64) {
        let mut s = self.state.lock().expect("rate lock");
        if let Some(a) = s.allot() {
            return a.give_back(cost);
        }
        match s.interval() {
            Some(i) => s.tat = s.tat.saturating_sub(times(i, cost)),
            None => s.frozen = (s.frozen - cost).max(0.0),
        }
    }

    /// Units reserved beyond what the bucket holds at `now`: the requests
    /// waiting for their slots, in units (0 when none waits, and for an
    /// allotment, which nothing refills).
    pub fn backlog(&self, now: Time) -> f64 {
        let s = self.state.lock().expect("rate lock");
        if s.allotted() {
            return 0.0;
        }
        match s.interval() {
            Some(i) if i > 0 => (s.tat.saturating_sub(s.pos(now)) as f64 / i as f64 - s.burst).max(0.0),
            _ => 0.0,
        }
    }

    /// Units that could pass right now without waiting, rounded down.
    pub fn remaining(&self, now: Time) -> u64 {
        let units = self.available(now);
        if units.is_infinite() { u64::MAX } else { units.floor() as u64 }
    }

    /// Units that could pass right now without waiting, fractions
    /// included (a budget in dollars has few whole units); infinite when
    /// unlimited.
    pub fn available(&self, now: Time) -> f64 {
        let mut s = self.state.lock().expect("rate lock");
        if let Some(a) = s.allot() {
            return a.left(now);
        }
        match s.interval() {
            None => 0.0,
            Some(0) => f64::INFINITY,
            Some(i) => {
                let used = s.tat.saturating_sub(s.pos(now)) as f64 / i as f64;
                (s.burst - used).max(0.0)
            }
        }
    }

    /// Charges `units` more to the bucket now (a cost settled above what was
    /// charged at admission: the requests waiting, and later ones, wait for
    /// the debt), or gives them back when negative (settled below: waiting
    /// requests come sooner; never beyond a full bucket). Returns the units
    /// a give-back found no room for (those beyond a full bucket).
    pub fn charge(&self, now: Time, units: f64) -> f64 {
        if units == 0.0 || units.is_nan() {
            return 0.0;
        }
        let mut s = self.state.lock().expect("rate lock");
        if let Some(a) = s.allot() {
            a.charge(units);
            drop(s);
            if units < 0.0 {
                self.wake();
            }
            return 0.0;
        }
        let now = s.pos(now);
        let Some(i) = s.interval().filter(|i| *i > 0) else {
            if s.interval().is_none() {
                s.frozen = (s.frozen + units).max(0.0);
            }
            return 0.0;
        };
        let (by, later) = (times(i, units.abs()), units > 0.0);
        let room = s.tat.saturating_sub(now) as f64 / i as f64;
        let clipped = if later { 0.0 } else { (units.abs() - room).max(0.0) };
        // Only a bucket owing beyond now can have requests waiting.
        let waiting = s.tat > now;
        s.tat = if later { s.tat.max(now).saturating_add(by) } else { s.tat.saturating_sub(by).max(now) };
        if waiting {
            s.changed(Change::Settled { at: now, by, later });
            drop(s);
            // A debt needs no wake-up: a waiter looks again when its old slot comes.
            if !later {
                self.wake();
            }
        }
        clipped
    }

    /// Changes capacity and burst live. The units available at once are
    /// carried over, capped at the new burst: a change never hands out
    /// tokens (a burst that grows with a lease fills at the leased rate, so
    /// a fleet's buckets together never hold more than one fleet burst), and
    /// a smaller burst clips a full bucket. Requests already holding a slot
    /// keep it; a queue (a negative number available) is carried as it is.
    /// Through capacity 0 the bucket stays as it was: a key comes back with
    /// what it had, never with a fresh burst.
    ///
    /// Returns the units a smaller burst clipped off a fuller bucket (0 from
    /// unlimited, which tracks none).
    pub fn set(&self, now: Time, capacity: f64, burst: f64) -> f64 {
        let mut s = self.state.lock().expect("rate lock");
        if s.capacity == capacity && s.burst == burst {
            return 0.0;
        }
        let now = s.pos(now);
        let backlog_units = match s.interval() {
            // From unlimited: nothing was tracked, so nothing is owed.
            Some(0) => 0.0,
            Some(i) => s.tat.saturating_sub(now) as f64 / i as f64,
            None => s.frozen,
        };
        let burst = burst.max(1.0);
        let clipped = match s.interval() {
            Some(0) => 0.0,
            _ => (s.burst - backlog_units - burst).max(0.0),
        };
        // Units available at once, carried over and capped at the new burst.
        let available = (s.burst - backlog_units).min(burst);
        let backlog_units = burst - available;
        s.frozen = backlog_units;
        let old_interval = s.interval();
        s.set_interval(interval_of(capacity));
        if let (Some(old), Some(new)) = (old_interval, s.interval())
            && new < old
        {
            s.changed(Change::Faster { at: now, old, new });
        }
        s.capacity = capacity;
        s.burst = burst;
        s.burst_span = s.interval().map_or(0, |i| times(i, s.burst));
        s.tat = now.saturating_add(s.interval().map_or(0, |i| times(i, backlog_units)));
        drop(s);
        self.wake();
        clipped
    }
}

// === allotments ===

impl Rate {
    /// Takes a calendar quota's allotment at `now`: from now on requests take
    /// from it, not from the GCRA (see `allot`). Waiters look again.
    pub fn allot(&self, now: Time, a: Allotment) {
        let mut s = self.state.lock().expect("rate lock");
        match s.allot() {
            Some(cur) => cur.replace(a, now),
            None => s.seldom.get_or_insert_default().allot = Some(Box::new(Allot::new(a, now))),
        }
        drop(s);
        self.wake();
    }

    /// Ends the allotment (its lease lapsed, or the servers no longer send
    /// one): the GCRA admits again, from an empty bucket (an allotment's end
    /// hands out no burst).
    pub fn end_allotment(&self, now: Time) {
        let mut s = self.state.lock().expect("rate lock");
        if s.seldom.as_mut().and_then(|x| x.allot.take()).is_none() {
            return;
        }
        let now = s.pos(now);
        s.tat = now.saturating_add(s.burst_span);
        s.frozen = s.burst;
        drop(s);
        self.wake();
    }

    /// The allotment's account at `now`, while there is one. (It takes the
    /// lock: [`Limiter::account`](super::Limiter::account) asks only a key
    /// that ever held an allotment.)
    pub fn account(&self, now: Time) -> Option<Account> {
        self.state.lock().expect("rate lock").allot().map(|a| a.account(now))
    }

    /// The reset of the unit an allotment counts in, while there is one.
    pub fn allotment_reset(&self) -> Option<Time> {
        self.state.lock().expect("rate lock").allot().map(|a| a.reset())
    }

    /// Whether a request of `cost` could pass at `now` without a change:
    /// capacity above 0, or an allotment with enough left.
    pub fn open(&self, now: Time, cost: f64) -> bool {
        let mut s = self.state.lock().expect("rate lock");
        match s.allot() {
            Some(a) => a.open(now, cost),
            None => s.interval().is_some(),
        }
    }
}

/// A reservation from a key's allotment: out of line, so that the request
/// path of a key without one stays as short as it was.
#[cold]
#[inline(never)]
fn take_allotted(a: &mut Allot, now: Time, cost: f64) -> Reservation {
    match a.take(now, cost) {
        true => Reservation::Slot { wait: Duration::ZERO, cost },
        false => Reservation::TooLate { wait: None },
    }
}

/// Convenience for tests and benches: one admit decision with no waiting.
pub fn try_admit(rate: &Rate, clock: &Clock, cost: f64) -> bool {
    matches!(rate.reserve(clock.now(), cost, Duration::ZERO), Reservation::Slot { .. })
}

#[cfg(test)]
mod tests;
