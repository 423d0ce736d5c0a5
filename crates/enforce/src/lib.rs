//! Enforcing leased capacity in-process: the part of usher that the sidecar
//! and a Rust service share.
//!
//! - [`embed`]: the library surface for Rust services: [`Limits`] (the
//!   lease-client handle) and [`LimitLayer`] (a tower layer admitting each
//!   request by one resource, answering a refusal itself).
//! - [`enforcer`]: the [`TableEnforcer`] between the lease client and the
//!   limiters: demand becomes `wants`, leases become capacities; and the
//!   embedded capacity server for a routes file without `doorman:`.
//! - [`resource`]: a route's resource: the key a request is admitted by, its cost.
//! - [`request_body`]: what a route reads of a request's body: costs, and
//!   the usage it asks an LLM API for.
//! - [`pushback`]: backing off when the upstream answers 429 or 503.
//! - [`feedback`] and [`settle`]: what an answer tells the keys that admitted
//!   it (the upstream's quota headers, the cost it reports).
//! - [`respond`]: the one place a refusal or an error becomes an answer.
//! - [`metrics`]: the counters of routes, resources and settled costs.
//!
//! # In a Rust service
//!
//! A service depends on this crate alone; neither the sidecar nor the
//! capacity server's binary is needed:
//!
//! ```toml
//! [dependencies]
//! # Leases from the servers `doorman:` names, or without it from an
//! # embedded capacity server (the `embedded-server` feature, on by default).
//! usher-enforce = { path = "../usher/crates/enforce" }
//! ```
//!
//! A service that always leases from servers leaves the embedded one, and
//! the usher-server crate, out. A routes file without `doorman:` is then an
//! error ([`EmbeddedServerOff`]):
//!
//! ```toml
//! [dependencies]
//! usher-enforce = { path = "../usher/crates/enforce", default-features = false }
//! ```
//!
//! [`embed`] shows the API. `examples/axum_limited.rs` is an axum service
//! that leases from a real `usher server`:
//! `cargo run -p usher-enforce --example axum_limited -- --server HOST:PORT`.

#![warn(missing_docs, unreachable_pub)]

pub mod embed;
pub mod enforcer;
pub mod feedback;
pub mod keylog;
pub mod metrics;
pub mod pushback;
pub mod request_body;
pub mod resource;
pub mod respond;
pub mod settle;

pub use embed::{LimitLayer, Limits, Refusal};
pub use enforcer::{EmbeddedServerOff, TableEnforcer};

/// How long start-up waits for the first leases before accepting requests
/// (no wait when every key has a cached lease); then keys follow `on_expiry`.
pub const FIRST_LEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
