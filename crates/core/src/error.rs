//! Errors that end a command, and the one place they become exit codes.

use crate::config::ConfigError;

/// `EX_USAGE` from sysexits.h: bad configuration or arguments.
pub const EXIT_USAGE: u8 = 64;
/// `EX_UNAVAILABLE`: a listener could not be bound, or a service needed refused.
pub const EXIT_UNAVAILABLE: u8 = 69;

/// Why a command stopped; [`RunError::exit_code`] is its process exit code.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A configuration file is invalid: exits with [`EXIT_USAGE`].
    #[error("invalid configuration:\n{0}")]
    Config(#[from] ConfigError),
    /// A listener could not be bound: exits with [`EXIT_UNAVAILABLE`].
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// What the listener is for, e.g. "admin".
        what: &'static str,
        /// The address it was to listen on.
        addr: std::net::SocketAddr,
        /// Why the bind failed.
        source: std::io::Error,
    },
    /// Arguments or input files that cannot be used: exits with [`EXIT_USAGE`].
    #[error("{0}")]
    Usage(String),
    /// A service the command needs refuses it: exits with [`EXIT_UNAVAILABLE`].
    #[error("{0}")]
    Unavailable(String),
    /// Anything else: exits with 1.
    #[error("{0}")]
    Other(String),
}

impl RunError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) | RunError::Usage(_) => EXIT_USAGE,
            RunError::Bind { .. } | RunError::Unavailable(_) => EXIT_UNAVAILABLE,
            RunError::Other(_) => 1,
        }
    }
}

/// An error and its causes, joined by `: `.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}
