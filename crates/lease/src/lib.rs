//! The lease client, the sidecar's "bottom half": it turns local demand into
//! `wants`, leases capacity from a Doorman tree, and tells the enforcement
//! side what each resource key may use.
//!
//! [`core`] is the sans-I/O state machine (refresh schedule with jitter,
//! discovery and failover, backoff, expiry modes); [`driver`] runs it against
//! a [`transport`] in real time, in calls [`batch`] keeps within what a
//! server accepts; [`cache`] keeps leases across restarts; [`failing`] logs
//! a run of failed calls without repeating itself every second;
//! [`headroom`] sizes the margin over a measured rate.

#![warn(missing_docs, unreachable_pub)]

pub mod backoff;
pub mod batch;
pub mod cache;
pub mod core;
pub mod driver;
pub mod failing;
pub mod headroom;
pub mod quota;
pub mod transport;

pub use self::core::{Capacity, CoreConfig, DemandUpdate, KeyDemand, Mode, OnExpiry};
pub use driver::{Enforcer, LeaseClient};
