//! The pooled burst of a rate resource at a root: the burst of the capacity
//! no client holds, kept at the server and moved into a client's bucket when
//! its lease grows.
//!
//! Each usher sidecar's bucket holds its lease's share of the fleet's burst:
//! `lease × W`, where `W` (the window) is the burst over the capacity. Below
//! the quota, part of the capacity is held by nobody; its share of the burst
//! is the pool, of size `free × W` (`free`: the capacity minus every lease
//! and reservation). Its level refills at `free`, up to its size. When a
//! lease grows by δ, the client is credited up to `δ × W` of the level, and
//! the level falls by as much: tokens move from the pool to a bucket and are
//! never created, so the buckets and the pool together never hold more than
//! the fleet's burst, and the fleet passes at most `capacity × T + burst`
//! over any window `T`. A lease that shrinks gives nothing back: the tokens
//! above its client's new bucket vanish, and the pool refills at its new,
//! larger rate from then on.
//!
//! The window is the smallest any client reported (usher's `window`
//! extension); a resource no client reported one for has no pool.
//!
//! A client that reports a **reserve** (units it keeps at hand) while
//! another client shares the resource is given a **bucket** smaller than its
//! share of the burst: its reserve, plus what its lease refills until its
//! next request, plus any credit it just got. What it holds above its
//! reserve when it next asks it gives back, and that goes into the pool. The
//! difference between its share of the burst and its bucket (its
//! **saving**) is pooled too: the pool's size is `free × W` plus every
//! client's saving. The buckets are enforced by their clients, so the
//! buckets and the pool still never hold more than the fleet's burst. With
//! most of the burst pooled, a client whose bucket runs dry asks, reports
//! its **backlog** (units waiting), and is credited up to that much at once,
//! its lease grown or not: the burst is usable where the next call lands.

use usher_core::clock::Time;

/// A resource's pooled burst (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pool {
    /// Tokens held as of `at`.
    level: f64,
    /// When `level` was last brought up to date.
    at: Time,
    /// The capacity nobody holds, in units per second, since `at`.
    free: f64,
    /// Seconds of burst per unit of rate: the smallest window reported.
    window: f64,
    /// The capacity shared when the pool last heard it.
    capacity: f64,
    /// The burst the clients given a bucket do not hold: each one's share
    /// (`lease × W`) minus its bucket, summed.
    saving: f64,
}

impl Pool {
    /// A pool for `capacity` of which `free` is held by nobody, at `now`:
    /// full when `full` (nobody holds any of the burst yet), else empty.
    pub(crate) fn new(now: Time, window: f64, capacity: f64, free: f64, full: bool) -> Self {
        let free = free.max(0.0);
        Pool { level: if full { free * window } else { 0.0 }, at: now, free, window, capacity, saving: 0.0 }
    }

    /// The most the pool holds: the burst of its free rate and the clients' savings.
    pub(crate) fn size(&self) -> f64 {
        self.free * self.window + self.saving
    }

    /// Seconds of burst per unit of rate.
    pub(crate) fn window(&self) -> f64 {
        self.window
    }

    /// A client's saving (see the module docs) changed from `old` to `new`.
    /// The level is capped at the size by the next [`Pool::settle`].
    pub(crate) fn save(&mut self, old: f64, new: f64) {
        self.saving = (self.saving - old + new).max(0.0);
    }

    /// Takes `units` a client gave back out of its bucket. Capped at the
    /// size by the next [`Pool::settle`], once the leases are settled.
    pub(crate) fn give(&mut self, units: f64) {
        if units.is_finite() && units > 0.0 {
            self.level += units;
        }
    }

    /// Tokens held now (as of the last [`Pool::advance`]).
    pub(crate) fn level(&self) -> f64 {
        self.level
    }

    /// The capacity the pool last heard of.
    pub(crate) fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Refills the pool up to `now` at the free rate held since the last
    /// change. Called before every change of the leases.
    pub(crate) fn advance(&mut self, now: Time) {
        if now > self.at {
            let refill = self.free * now.since(self.at).as_secs_f64();
            self.level = (self.level + refill).min(self.size());
            self.at = now;
        }
    }

    /// Takes a client's reported window: the pool keeps the smallest.
    pub(crate) fn report(&mut self, window: f64) {
        if window < self.window {
            self.window = window;
            self.level = self.level.min(self.size());
        }
    }

    /// Moves the burst of `grown` units of rate out of the pool: at most
    /// `grown × window`, at most what it holds. Returns what moved.
    #[cfg(test)]
    pub(crate) fn credit(&mut self, grown: f64) -> f64 {
        self.credit_for(grown, 0.0)
    }

    /// Moves out of the pool the burst of `grown` units of rate or a
    /// `backlog` of units waiting, whichever is more, at most what it holds.
    /// Returns what moved.
    pub(crate) fn credit_for(&mut self, grown: f64, backlog: f64) -> f64 {
        let grown = if grown.is_nan() { 0.0 } else { grown.max(0.0) * self.window };
        let backlog = if backlog.is_finite() { backlog.max(0.0) } else { 0.0 };
        let c = grown.max(backlog).min(self.level).max(0.0);
        self.level -= c;
        c
    }

    /// The leases changed: `free` of `capacity` is held by nobody now. The
    /// level stays, capped at the new size.
    pub(crate) fn settle(&mut self, capacity: f64, free: f64) {
        self.capacity = capacity;
        self.free = free.max(0.0);
        self.level = self.level.min(self.size());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(s: f64) -> Time {
        Time::from_nanos((s * 1e9) as u64)
    }

    #[test]
    fn refills_at_the_free_rate_up_to_its_size() {
        // 100/s shared, 40/s free, a 60 s window: 2,400 tokens at most.
        let mut p = Pool::new(at(0.0), 60.0, 100.0, 40.0, false);
        assert_eq!(p.level(), 0.0);
        p.advance(at(10.0));
        assert!((p.level() - 400.0).abs() < 1e-6, "{}", p.level());
        p.advance(at(1_000.0));
        assert!((p.level() - 2_400.0).abs() < 1e-6, "{}", p.level());
    }

    #[test]
    fn a_credit_moves_what_the_pool_holds_and_no_more() {
        let mut p = Pool::new(at(0.0), 60.0, 100.0, 40.0, true);
        // A growth of 10/s carries 600 tokens of burst.
        assert!((p.credit(10.0) - 600.0).abs() < 1e-6);
        p.settle(100.0, 30.0);
        assert!((p.level() - 1_800.0).abs() < 1e-6);
        // A growth of 40/s would carry 2,400: the pool holds 1,800.
        assert!((p.credit(40.0) - 1_800.0).abs() < 1e-6);
        assert_eq!(p.level(), 0.0);
        assert_eq!(p.credit(5.0), 0.0, "an empty pool credits nothing");
    }

    #[test]
    fn a_shrink_caps_the_level_and_a_smaller_window_shrinks_the_size() {
        let mut p = Pool::new(at(0.0), 60.0, 100.0, 40.0, true);
        p.settle(100.0, 10.0);
        assert!((p.level() - 600.0).abs() < 1e-6, "capped at 10/s × 60 s");
        // The free capacity grows back: the level does not jump.
        p.settle(100.0, 40.0);
        assert!((p.level() - 600.0).abs() < 1e-6);
        p.report(5.0);
        assert!((p.level() - 200.0).abs() < 1e-6, "40/s × 5 s");
        p.report(30.0);
        assert!((p.size() - 200.0).abs() < 1e-6, "the smallest window stays");
    }

    /// One step of the fleet: `dt` s on, a client's lease moves to `to`,
    /// then it spends that fraction of its bucket.
    #[derive(Debug, Clone)]
    struct Step {
        dt: f64,
        client: usize,
        to: f64,
        spend: f64,
    }

    fn step() -> impl Strategy<Value = Step> {
        (0.0f64..2.0, 0usize..3, 0.0f64..100.0, 0.0f64..1.0).prop_map(|(dt, client, to, spend)| Step {
            dt,
            client,
            to,
            spend,
        })
    }

    proptest! {
        /// Three clients' buckets (each refilling at its lease, capped at
        /// lease × W, topped up by credits) spend no more than
        /// `capacity × T + burst` over the run, whatever they spend when,
        /// across grows and shrinks; the buckets and the pool never hold
        /// more than the burst; the level never exceeds the size; a credit
        /// never exceeds what the pool held.
        #[test]
        fn buckets_and_pool_never_hold_more_than_the_burst(steps in proptest::collection::vec(step(), 1..200)) {
            let (cap, w) = (100.0, 60.0);
            let burst = cap * w;
            let mut leases = [0.0f64; 3];
            let mut buckets = [0.0f64; 3];
            let mut pool = Pool::new(at(0.0), w, cap, cap, true);
            let (mut now, mut spent) = (0.0, 0.0);
            for s in steps {
                now += s.dt;
                // The buckets refill at their leases, the pool at the free rate.
                for i in 0..3 {
                    buckets[i] = (buckets[i] + leases[i] * s.dt).min(leases[i] * w);
                }
                pool.advance(at(now));
                // Leases never add up to more than the capacity.
                let others: f64 = leases.iter().enumerate().filter(|(i, _)| *i != s.client).map(|(_, l)| l).sum();
                let to = s.to.min(cap - others).max(0.0);
                let held = pool.level();
                let c = pool.credit(to - leases[s.client]);
                prop_assert!(c <= held + 1e-9, "credited {c} of {held}");
                leases[s.client] = to;
                buckets[s.client] = (buckets[s.client] + c).min(to * w);
                pool.settle(cap, cap - leases.iter().sum::<f64>());
                prop_assert!(pool.level() <= pool.size() + 1e-9);
                let total = buckets.iter().sum::<f64>() + pool.level();
                prop_assert!(total <= burst + 1e-6, "{total} > {burst}");
                spent += buckets[s.client] * s.spend;
                buckets[s.client] *= 1.0 - s.spend;
                prop_assert!(spent <= cap * now + burst + 1e-6, "spent {spent} in {now} s");
            }
        }
    }
}
