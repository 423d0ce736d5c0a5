//! Listening sockets: [`bind`] with the backlog every usher listener uses.

use crate::error::RunError;

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
