//! The scripted upstream: a raw-TCP HTTP/1.1 server on 127.0.0.1:0 that
//! parses every request strictly, records it ([`Seen`]), and answers what
//! the test's script says, byte for byte ([`Reply`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::wire::{Seen, parse_request};

/// What the upstream does with a request it has read whole.
pub(crate) enum Reply {
    /// Writes these bytes in `writes` writes (see [`write_in`]), then
    /// closes the connection if `close`.
    Send { bytes: Vec<u8>, writes: usize, close: bool },
    /// Closes the connection without answering.
    Hangup,
}

/// Writes `bytes` in one write.
pub(crate) fn answer(bytes: impl Into<Vec<u8>>, close: bool) -> Reply {
    Reply::Send { bytes: bytes.into(), writes: 1, close }
}

/// Writes `bytes` in `writes` parts 2 ms apart (traffic shaping, not
/// synchronisation), so the reader gets a head or body in pieces.
pub(crate) async fn write_in<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    writes: usize,
) -> std::io::Result<()> {
    let size = bytes.len().div_ceil(writes.max(1)).max(1);
    for (i, part) in bytes.chunks(size).enumerate() {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        w.write_all(part).await?;
    }
    Ok(())
}

type Script = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

#[derive(Default)]
struct UpLog {
    connections: usize,
    seen: Vec<Seen>,
    /// Connections the upstream has closed, in order.
    closed: Vec<usize>,
    /// Requests it could not parse.
    problems: Vec<String>,
}

/// A raw-TCP HTTP/1.1 upstream on 127.0.0.1:0 that parses every request
/// strictly, records it, and answers what its script says.
pub(crate) struct Scripted {
    pub(crate) addr: SocketAddr,
    log: Arc<Mutex<UpLog>>,
    stop: CancellationToken,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Requests one upstream connection serves at most.
const MAX_REQUESTS_PER_CONNECTION: usize = 1000;

impl Scripted {
    pub(crate) async fn start(script: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(UpLog::default()));
        let stop = CancellationToken::new();
        let script: Script = Arc::new(script);
        let (l, s) = (log.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((stream, _)) = accepted else { return };
                let conn = {
                    let mut log = l.lock().unwrap();
                    log.connections += 1;
                    log.connections - 1
                };
                tokio::spawn(upstream_conn(stream, conn, l.clone(), script.clone(), s.clone()));
            }
        });
        Scripted { addr, log, stop }
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.log.lock().unwrap().seen.clone()
    }

    pub(crate) fn connections(&self) -> usize {
        self.log.lock().unwrap().connections
    }

    pub(crate) fn closed(&self) -> Vec<usize> {
        self.log.lock().unwrap().closed.clone()
    }

    pub(crate) fn problems(&self) -> Vec<String> {
        self.log.lock().unwrap().problems.clone()
    }
}

async fn upstream_conn(
    mut stream: TcpStream,
    conn: usize,
    log: Arc<Mutex<UpLog>>,
    script: Script,
    stop: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    for nth in 0..MAX_REQUESTS_PER_CONNECTION {
        let seen = loop {
            match parse_request(&buf) {
                Err(e) => {
                    log.lock().unwrap().problems.push(format!("connection {conn}: {e}"));
                    return;
                }
                Ok(Some((mut seen, used))) => {
                    buf.drain(..used);
                    (seen.conn, seen.nth) = (conn, nth);
                    break seen;
                }
                Ok(None) => {}
            }
            let read = tokio::select! {
                _ = stop.cancelled() => return,
                r = stream.read(&mut chunk) => r,
            };
            match read {
                Ok(0) | Err(_) => {
                    let mut log = log.lock().unwrap();
                    if !buf.is_empty() {
                        log.problems.push(format!(
                            "connection {conn} closed inside a request: {:?}",
                            buf.escape_ascii().to_string()
                        ));
                    }
                    log.closed.push(conn);
                    return;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let reply = script(&seen);
        log.lock().unwrap().seen.push(seen);
        match reply {
            Reply::Hangup => {
                drop(stream);
                log.lock().unwrap().closed.push(conn);
                return;
            }
            Reply::Send { bytes, writes, close } => {
                if write_in(&mut stream, &bytes, writes).await.is_err() {
                    log.lock().unwrap().closed.push(conn);
                    return;
                }
                if close {
                    let _ = stream.shutdown().await;
                    drop(stream);
                    log.lock().unwrap().closed.push(conn);
                    return;
                }
            }
        }
    }
}

/// `200` whose body is the request's method, target and body; with a
/// mixed-case field that tells which engine relayed it.
pub(crate) fn echo(seen: &Seen) -> Reply {
    let body = format!("{} {} {}", seen.method, seen.target, String::from_utf8_lossy(&seen.body));
    let head = format!("HTTP/1.1 200 OK\r\nX-Served-By-Case: Mixed\r\nContent-Length: {}\r\n\r\n", body.len());
    answer([head.as_bytes(), body.as_bytes()].concat(), false)
}
