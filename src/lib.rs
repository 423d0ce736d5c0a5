//! usher: lease-based sharing of one service's capacity among many clients.
//!
//! `usher server` is a Doorman-compatible capacity server; `usher proxy` is the
//! sidecar that leases capacity from it and enforces it on outbound HTTP.
//! See ARCHITECTURE.md for the data flow; each module's doc says what it owns.

#![forbid(unsafe_code)]

pub mod admin;
pub mod algorithm;
pub mod audit;
pub mod check;
pub mod clock;
pub mod config;
pub mod demo;
pub mod error;
pub mod lease;
pub mod limit;
pub mod plot;
pub mod proto;
pub mod proxy;
pub mod server;
pub mod sim;
pub mod tls;
