//! Errors that end a command, and the one place they become exit codes.

use crate::config::ConfigError;

/// `EX_USAGE` from sysexits.h: bad configuration or arguments.
pub const EXIT_USAGE: u8 = 64;
/// `EX_UNAVAILABLE`: a listener could not be bound.
pub const EXIT_UNAVAILABLE: u8 = 69;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("invalid configuration:\n{0}")]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind { what: &'static str, addr: std::net::SocketAddr, source: std::io::Error },
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Other(String),
}

impl RunError {
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
