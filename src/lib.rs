//! usher: lease-based sharing of one service's capacity among many clients.
//!
//! `usher server` is a Doorman-compatible capacity server; `usher proxy` is the
//! sidecar that leases capacity from it and enforces it on outbound HTTP.
//! [`embed`] is the same enforcement inside a Rust service: a tower layer
//! over leases from a real `usher server` (or an embedded one).
//! See ARCHITECTURE.md for the data flow; each module's doc says what it owns.

#![forbid(unsafe_code)]

pub mod admin;
pub mod algorithm;
pub mod check;
pub mod clock;
pub mod config;
pub mod embed;
pub mod error;
pub mod lease;
pub mod limit;
pub mod proto;
pub mod proxy;
pub mod server;
pub mod tls;

// The binary's own pieces: `usher demo`, `usher audit`, `usher sim` and the
// plots they draw. Public for the binary and its tests, not part of the
// library's surface.
#[doc(hidden)]
pub mod audit;
#[doc(hidden)]
pub mod demo;
#[doc(hidden)]
pub mod plot;
#[doc(hidden)]
pub mod sim;
