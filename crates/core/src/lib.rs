//! The ground every usher crate stands on: the [`clock`] (the one reader of
//! the wall clock), the [`config`] files with their `file:line:column`
//! errors, [`tls`], the [`admin`] HTTP server, listening sockets ([`net`])
//! and the errors a run ends with ([`error`]).
//!
//! Nothing here knows of leases, limiters, routes at run time or the
//! proxy: those crates build on this one.

#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod clock;
pub mod config;
pub mod error;
pub mod net;
pub mod tls;
