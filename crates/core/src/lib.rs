//! The ground every usher crate stands on: the [`clock`] (the one reader of
//! the wall clock), the [`config`] files (parsed with `file:line:column`
//! errors, and watched for live reloads), [`tls`] for the Doorman gRPC, the
//! [`admin`] HTTP server, listening sockets ([`net`]) and the errors a
//! command ends with, with their exit codes ([`error`]).
//!
//! The config types describe resources, leases and routes as a file writes
//! them; nothing here acts on them. The lease client, the limiters, the
//! capacity server and the proxy build on this crate, and it knows none of
//! them.

#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod clock;
pub mod config;
pub mod error;
pub mod net;
pub mod tls;
