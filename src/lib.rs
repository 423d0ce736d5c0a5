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

/// A flag's duration (`500ms`, `1s`, `2m`...), as clap's value parser.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    usher_core::config::yaml::parse_duration(s)
        .ok_or_else(|| format!("`{s}` is not a duration (write e.g. 500ms, 1s, 2m)"))
}
