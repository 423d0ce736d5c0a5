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

/// Pending connections the kernel queues for a listener (capped by
/// `net.core.somaxconn`). Larger than the usual 1024 so that a burst of
/// connections, or connections waiting for `limits.max_connections`, are
/// queued rather than dropped (a dropped handshake can leave a client
/// believing it is connected).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a TCP listener, naming what it is for in the error.
pub async fn bind(what: &'static str, addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener, RunError> {
    let listen = || {
        let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        // As std's bind does on Unix: a restarted process can bind at once.
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)
    };
    listen().map_err(|source| RunError::Bind { what, addr, source })
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
