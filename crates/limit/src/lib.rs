//! Admits or refuses a request now, from local state only: the enforcing
//! "top half" of a sidecar whose capacities a lease client sets.
//!
//! A [`LeaseTable`] holds, per configured resource and per key, a
//! [`Limiter`]: an exact GCRA pacer ([`Rate`]) or a resizable FIFO semaphore
//! ([`Gauge`]), and the [`DemandMeter`] a lease client reads to compute what
//! the key wants. A [`Plan`] names the keys one request needs and what it
//! costs at each; [`admit`](admit::admit) takes all of them or none, waiting up to each
//! resource's `max_wait`. Capacities change live ([`Limiter::set_capacity`]):
//! no fresh burst, nobody in flight cancelled.
//!
//! - [`rate`]: the GCRA pacer (FIFO by reservation, waits up to `max_wait`, bounded queue);
//! - [`gauge`]: the semaphore, whose permit lives as long as the response body;
//! - [`demand`]: the per-key demand meter;
//! - [`table`]: the [`LeaseTable`], the one place capacities are written;
//! - [`admit`]: all-or-nothing admission across several resources;
//! - [`quota`]: an upstream's own account of its quota, as a key keeps it;
//! - [`allot`]: a calendar quota's allotment, which a rate key holds instead of a rate.
//!
//! This crate knows nothing of gRPC, routes files or HTTP status codes: a
//! refusal is a typed [`Refused`] that the proxy turns into a response.
//!
//! # Example
//!
//! One rate resource of 1 request a second with a burst of 2, on a manual
//! clock: two requests pass at once, the third is refused, and a second
//! later there is room for one more.
//!
//! ```
//! use std::time::Duration;
//!
//! use usher_core::clock::{Clock, Time};
//! use usher_limit::admit::{Reason, admit};
//! use usher_limit::{Kind, LeaseTable, Plan, ResourceSpec};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let (clock, time) = Clock::manual(Time::from_secs(1_000));
//! let table = LeaseTable::new(clock.clone());
//! table.configure(vec![ResourceSpec {
//!     name: "api".into(),
//!     kind: Kind::Rate,
//!     capacity: 1.0,
//!     burst: 2.0,
//!     max_wait: Duration::ZERO,
//!     max_queue: 0,
//!     max_keys: 1,
//!     window: Duration::from_secs(1),
//!     shared: false,
//!     burst_span: None,
//!     shadow: false,
//!     upstream_quota: false,
//!     templated: false,
//! }]);
//! let key = table.resource("api").unwrap().limiter("api");
//! let plan = Plan::new(vec![(key, 1.0)]);
//!
//! let first = admit(&plan, &clock).await.expect("the burst");
//! let second = admit(&plan, &clock).await.expect("the burst");
//! let refused = admit(&plan, &clock).await.unwrap_err();
//! assert_eq!(refused.reason, Reason::Exhausted);
//! assert_eq!(refused.retry_after, Duration::from_secs(1));
//!
//! time.advance(Duration::from_secs(1));
//! let third = admit(&plan, &clock).await.expect("one more a second later");
//! drop((first, second, third));
//! # }
//! ```

#![warn(missing_docs, unreachable_pub)]

pub mod admit;
pub mod allot;
pub mod demand;
pub mod gauge;
pub mod quota;
pub mod rate;
pub mod table;

use std::time::Duration;

use usher_core::clock::{Clock, Time};

pub use admit::{Admitted, Plan, Refused};
pub use demand::{DemandMeter, DemandSample};
pub use gauge::{Gauge, GaugePermit};
pub use rate::Rate;
pub use table::{Kind, LeaseTable, Limiter, ResourceLimits, ResourceSpec};

/// Sleeps until `deadline` on `clock`. The system clock sleeps on tokio's
/// timer; a manual clock is polled, so tests drive waits by advancing it.
pub async fn sleep_until(clock: &Clock, deadline: Time) {
    match clock {
        Clock::System(_) => {
            let d = deadline.since(clock.now());
            if !d.is_zero() {
                tokio::time::sleep(d).await;
            }
        }
        Clock::Manual(_) => {
            while clock.now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

/// Whole seconds, rounded up, at least 1: how `Retry-After` is written.
pub fn ceil_secs(d: Duration) -> u64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    s.max(1)
}
