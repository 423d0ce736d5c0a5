//! A resizable FIFO semaphore for one gauge key.
//!
//! tokio's semaphore is fair (FIFO) and can grow, but can only forget permits
//! that are free. A shrink below the number in flight is recorded as a debt:
//! permits coming back pay it off instead of returning to the pool, so
//! nothing in flight is cancelled and nothing new is admitted until in-flight
//! falls below the new capacity.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use usher_core::clock::{Clock, Time};

/// Units in flight for one key, at most its capacity; waiters are served FIFO.
pub struct Gauge {
    sem: Arc<Semaphore>,
    state: Mutex<State>,
    in_flight: AtomicU64,
}

#[derive(Debug)]
struct State {
    capacity: u64,
    debt: u64,
}

/// Units held until dropped: the end of the response body, or the connection.
pub struct GaugePermit {
    permit: Option<OwnedSemaphorePermit>,
    gauge: Arc<Gauge>,
}

impl std::fmt::Debug for GaugePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GaugePermit").field("units", &self.permit.as_ref().map(|p| p.num_permits())).finish()
    }
}

impl Gauge {
    /// A gauge of `capacity` units, none in flight.
    pub fn new(capacity: u64) -> Arc<Self> {
        Arc::new(Gauge {
            sem: Arc::new(Semaphore::new(capacity as usize)),
            state: Mutex::new(State { capacity, debt: 0 }),
            in_flight: AtomicU64::new(0),
        })
    }

    /// Units allowed in flight.
    pub fn capacity(&self) -> u64 {
        self.state.lock().expect("gauge lock").capacity
    }

    /// Units held by permits now (above the capacity after a shrink, until they come back).
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Units free right now.
    pub fn remaining(&self) -> u64 {
        self.sem.available_permits() as u64
    }

    /// Takes `cost` units, waiting FIFO until `deadline` on `clock`.
    pub async fn acquire(self: &Arc<Self>, cost: u32, clock: &Clock, deadline: Time) -> Option<GaugePermit> {
        let permit = match self.sem.clone().try_acquire_many_owned(cost) {
            Ok(p) => p,
            Err(_) if clock.now() >= deadline => return None,
            Err(_) => tokio::select! {
                p = self.sem.clone().acquire_many_owned(cost) => p.ok()?,
                _ = super::sleep_until(clock, deadline) => return None,
            },
        };
        self.in_flight.fetch_add(u64::from(cost), Ordering::Relaxed);
        Some(GaugePermit { permit: Some(permit), gauge: self.clone() })
    }

    /// Takes `cost` units only if they are free now.
    pub fn try_acquire(self: &Arc<Self>, cost: u32) -> Option<GaugePermit> {
        let permit = self.sem.clone().try_acquire_many_owned(cost).ok()?;
        self.in_flight.fetch_add(u64::from(cost), Ordering::Relaxed);
        Some(GaugePermit { permit: Some(permit), gauge: self.clone() })
    }

    /// Resizes live: growth pays off any debt first; a shrink forgets free
    /// permits and records the rest as debt.
    pub fn set_capacity(&self, capacity: u64) {
        let mut s = self.state.lock().expect("gauge lock");
        if capacity > s.capacity {
            let grow = capacity - s.capacity;
            let paid = grow.min(s.debt);
            s.debt -= paid;
            self.sem.add_permits((grow - paid) as usize);
        } else if capacity < s.capacity {
            let shrink = s.capacity - capacity;
            let forgotten = self.sem.forget_permits(shrink as usize) as u64;
            s.debt += shrink - forgotten;
        }
        s.capacity = capacity;
    }

    fn give_back(&self, permit: OwnedSemaphorePermit) {
        let n = permit.num_permits() as u64;
        self.in_flight.fetch_sub(n, Ordering::Relaxed);
        let mut s = self.state.lock().expect("gauge lock");
        if s.debt == 0 {
            drop(s);
            drop(permit);
            return;
        }
        let paid = n.min(s.debt);
        s.debt -= paid;
        permit.forget();
        self.sem.add_permits((n - paid) as usize);
    }
}

impl Drop for GaugePermit {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            self.gauge.give_back(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shrink_below_in_flight_admits_nothing_until_it_drains() {
        let g = Gauge::new(3);
        let held: Vec<_> = (0..3).map(|_| g.try_acquire(1).unwrap()).collect();
        g.set_capacity(1);
        assert_eq!(g.in_flight(), 3, "nothing in flight is cancelled");
        let mut held = held.into_iter();
        drop(held.next());
        assert!(g.try_acquire(1).is_none(), "2 in flight > capacity 1");
        drop(held.next());
        assert!(g.try_acquire(1).is_none(), "1 in flight = capacity 1");
        drop(held.next());
        let p = g.try_acquire(1).expect("0 in flight < capacity 1");
        assert!(g.try_acquire(1).is_none());
        g.set_capacity(2);
        assert!(g.try_acquire(1).is_some());
        drop(p);
    }

    #[tokio::test]
    async fn grow_pays_debt_first() {
        let g = Gauge::new(2);
        let a = g.try_acquire(1).unwrap();
        let b = g.try_acquire(1).unwrap();
        g.set_capacity(0);
        g.set_capacity(1);
        assert!(g.try_acquire(1).is_none(), "2 in flight, capacity 1");
        drop(a);
        assert!(g.try_acquire(1).is_none(), "1 in flight, capacity 1");
        drop(b);
        assert!(g.try_acquire(1).is_some());
    }

    #[tokio::test]
    async fn waiters_are_served_fifo() {
        let (clock, _h) = Clock::manual(Time::from_secs(1));
        let g = Gauge::new(1);
        let first = g.try_acquire(1).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (g, clock, order) = (g.clone(), clock.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = g.acquire(1, &clock, Time::from_secs(100)).await.unwrap();
                order.lock().unwrap().push(i);
                drop(p);
            }));
            // Single-threaded runtime: yielding lets the waiter queue up before the next arrives.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }
}
