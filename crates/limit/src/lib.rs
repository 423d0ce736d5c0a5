//! The "top half" of enforcement: admit or refuse a request now, from local
//! state only.
//!
//! - [`rate`]: a GCRA pacer (FIFO by reservation, waits up to `max_wait`, bounded queue);
//! - [`gauge`]: a resizable FIFO semaphore whose permit lives as long as the response body;
//! - [`demand`]: the per-key demand meter the lease client reads to compute `wants`;
//! - [`table`]: the [`LeaseTable`], the one place capacities are written;
//! - [`admit`]: all-or-nothing admission across several resources;
//!
//! This crate knows nothing of gRPC, routes files or HTTP status codes: a
//! refusal is a typed [`Refused`] that the proxy turns into a response.

#![warn(missing_docs, unreachable_pub)]

pub mod admit;
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
