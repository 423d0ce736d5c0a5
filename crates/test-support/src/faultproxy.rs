//! A TCP fault proxy for tests: listens on 127.0.0.1:0 and forwards every
//! connection to a target, with a mode that can be switched at any time and
//! applies to open connections as well as new ones:
//!
//! - `Pass`: bytes flow unchanged.
//! - `Delay(d)`: every chunk is delivered `d` after it arrived (latency, not
//!   a bandwidth limit: chunks in flight overlap).
//! - `Blackhole`: connections are accepted and kept, but nothing is
//!   delivered in either direction; what was held is delivered once the mode
//!   changes back, as TCP does when a partition heals.
//! - `Reset`: every connection, open or new, is aborted with an RST
//!   (`SO_LINGER` 0, then dropped).
//! - `Close`: every connection, open or new, is closed with a FIN.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What a [`FaultProxy`] does to the connections it forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bytes flow unchanged.
    Pass,
    /// Every chunk is delivered this long after it arrived.
    Delay(Duration),
    /// Nothing is delivered; what is held goes through once the mode changes back.
    Blackhole,
    /// Every connection is aborted with an RST.
    Reset,
    /// Every connection is closed with a FIN.
    Close,
}

/// A running fault proxy; stops accepting when dropped.
pub struct FaultProxy {
    /// The address it listens on, for clients to connect to instead of the target.
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Starts forwarding to `target` in `Pass` mode.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, rx) = watch::channel(Mode::Pass);
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                count.fetch_add(1, Ordering::SeqCst);
                let _ = client.set_nodelay(true);
                let rx = rx.clone();
                match *rx.borrow() {
                    Mode::Reset => {
                        abort(&client);
                        continue;
                    }
                    Mode::Close => continue, // dropped: FIN
                    _ => {}
                }
                tokio::spawn(connection(client, target, rx));
            }
        });
        FaultProxy { addr, mode, accepted, task }
    }

    /// Switches to `mode`, for open connections as well as new ones.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }
}

fn abort(s: &TcpStream) {
    let _ = s.set_zero_linger();
}

async fn connection(client: TcpStream, target: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let Ok(upstream) = TcpStream::connect(target).await else {
        abort(&client);
        return;
    };
    let _ = upstream.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let (m1, m2) = (mode.clone(), mode.clone());
    let killed = {
        let pumps = async {
            tokio::join!(pump(&mut cr, &mut uw, m1), pump(&mut ur, &mut cw, m2));
        };
        let kill = async {
            loop {
                if matches!(*mode.borrow_and_update(), Mode::Reset | Mode::Close) {
                    return *mode.borrow();
                }
                if mode.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = pumps => None,
            m = kill => Some(m),
        }
    };
    match killed {
        Some(Mode::Reset) => {
            abort(cr.as_ref());
            abort(ur.as_ref());
        }
        Some(_) => {
            let _ = cw.shutdown().await;
            let _ = uw.shutdown().await;
        }
        None => {}
    }
}

/// Copies `from` to `to`, chunk by chunk, applying the current mode to each chunk.
async fn pump(from: &mut OwnedReadHalf, to: &mut OwnedWriteHalf, mode: watch::Receiver<Mode>) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(64);
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        let mut mode = mode;
        while let Some((arrived, chunk)) = rx.recv().await {
            loop {
                let m = *mode.borrow_and_update();
                match m {
                    Mode::Pass => break,
                    Mode::Delay(d) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(arrived + d) => break,
                            changed = mode.changed() => if changed.is_err() {
                                // The FaultProxy is gone: the mode can no longer change.
                                tokio::time::sleep_until(arrived + d).await;
                                break;
                            },
                        }
                    }
                    // Held until the mode changes; Reset and Close end the connection elsewhere.
                    Mode::Blackhole | Mode::Reset | Mode::Close => {
                        if mode.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
