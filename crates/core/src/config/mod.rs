//! Configuration files: the sidecar's routes file, the server's resources
//! file (Doorman's YAML) and, shared by both, a position-keeping YAML reader
//! that reports every error with its `file:line:column`.

pub mod doorman;
pub mod file;
pub mod listener;
pub mod quota;
pub mod resources;
pub mod routes;
pub mod usage;
pub mod watch;
pub mod yaml;

pub use yaml::{ConfigError, Diagnostic};

/// The most bytes a lease id may have: what capacity servers accept (usher's
/// refuses a longer one, and with it the whole call that carries it: every
/// key of the sidecar).
pub const MAX_ID_BYTES: usize = 1024;

/// The outcome of the latest load of a configuration that is reloaded live:
/// when the one in force was applied, and why the last attempt was rejected.
#[derive(Debug, Clone, Default)]
pub struct ConfigState {
    /// When the configuration in force was applied; `None` before the first.
    pub loaded_at: Option<crate::clock::Time>,
    /// Why the latest load was rejected; `None` once a load succeeds.
    pub last_error: Option<String>,
}
