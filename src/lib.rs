//! The `usher` binary's own commands, as a library for its tests: `usher
//! check`, `usher demo`, `usher audit`, `usher sim` and the plots they draw.
//!
//! The sidecar, the capacity server and the limiters live in the workspace's
//! crates (`crates/`); docs/architecture.md draws how they depend on each
//! other.

#![forbid(unsafe_code)]

pub mod audit;
pub mod check;
pub mod demo;
pub mod plot;
pub mod sim;
