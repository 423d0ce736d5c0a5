//! Configuration files: the server's resources file (Doorman's YAML) and,
//! shared by both, a position-keeping YAML reader that reports every error
//! with its `file:line:column`.

pub mod doorman;
pub mod resources;
pub mod routes;
pub mod watch;
pub mod yaml;

pub use yaml::{ConfigError, Diagnostic};
