//! A raw client: one connection to a sidecar, written and read as bytes,
//! and which engine wrote a response ([`served_by`]).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::PATIENCE;
use crate::scripted::write_in;
use crate::wire::{ParsedResp, Resp, parse_response, shown};

/// One client connection, written and read as raw bytes.
pub(crate) struct Client {
    pub(crate) stream: TcpStream,
    /// Bytes read and not yet parsed (the start of a pipelined response).
    pub(crate) buf: Vec<u8>,
}

impl Client {
    pub(crate) async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Client { stream, buf: Vec::new() }
    }

    pub(crate) async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        self.stream.write_all(bytes.as_ref()).await.unwrap();
    }

    pub(crate) async fn send_in(&mut self, bytes: &[u8], writes: usize) -> std::io::Result<()> {
        write_in(&mut self.stream, bytes, writes).await
    }

    pub(crate) async fn response(&mut self, head_request: bool) -> Resp {
        self.try_response(head_request).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// Reads the next whole response within [`PATIENCE`]; 1xx responses
    /// before it are noted in its `interim`.
    pub(crate) async fn try_response(&mut self, head_request: bool) -> Result<Resp, String> {
        let deadline = Instant::now() + PATIENCE;
        let mut eof = false;
        let mut interim = Vec::new();
        let mut chunk = vec![0u8; 16 * 1024];
        // Bounded by the deadline: every round parses or reads.
        loop {
            match parse_response(&self.buf, head_request, eof)? {
                ParsedResp::Interim(code, used) => {
                    interim.push(code);
                    self.buf.drain(..used);
                    continue;
                }
                ParsedResp::Final(mut resp, used) => {
                    self.buf.drain(..used);
                    resp.interim = interim;
                    return Ok(resp);
                }
                ParsedResp::Partial if eof => {
                    return Err(format!("EOF before a whole response; got {:?}", self.buf.escape_ascii().to_string()));
                }
                ParsedResp::Partial => {}
            }
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => {
                    return Err(format!(
                        "no whole response within {PATIENCE:?}; got {:?}",
                        self.buf.escape_ascii().to_string()
                    ));
                }
                Ok(Err(e)) => return Err(format!("read error {e}; got {:?}", self.buf.escape_ascii().to_string())),
                Ok(Ok(0)) => eof = true,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Waits (at most `patience`) for the sidecar to close the connection:
    /// how long it took, and the bytes that came meanwhile.
    pub(crate) async fn closed_within(&mut self, patience: Duration) -> (Duration, Vec<u8>) {
        self.try_closed_within(patience).await.unwrap_or_else(|e| panic!("{e}"))
    }

    async fn try_closed_within(&mut self, patience: Duration) -> Result<(Duration, Vec<u8>), String> {
        let started = Instant::now();
        let mut got = std::mem::take(&mut self.buf);
        let mut chunk = [0u8; 4096];
        // Bounded by the deadline.
        loop {
            match tokio::time::timeout_at(started + patience, self.stream.read(&mut chunk)).await {
                Err(_) => {
                    return Err(format!("the connection was still open after {patience:?}; got {:?}", shown(&got)));
                }
                Ok(Err(e)) => return Err(format!("read error {e} instead of EOF; got {:?}", shown(&got))),
                Ok(Ok(0)) => return Ok((started.elapsed(), got)),
                Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// The connection after an answer: closed, with nothing more, if the
    /// answer said `connection: close`; else ready for another request
    /// (one the sidecar answers itself), with nothing stray before its answer.
    pub(crate) async fn after(&mut self, answer: &Resp) -> Result<(), String> {
        if answer.header("connection") == Some("close") {
            let (_, extra) = self.try_closed_within(PATIENCE).await?;
            return match extra.is_empty() {
                true => Ok(()),
                false => Err(format!("bytes after a closing answer: {:?}", shown(&extra))),
            };
        }
        self.stream
            .write_all(b"GET /next HTTP/1.1\r\nHost: nowhere.test\r\n\r\n")
            .await
            .map_err(|e| format!("the next request: {e}"))?;
        let next = self.try_response(false).await.map_err(|e| format!("the next request's answer: {e}"))?;
        match next.status {
            403 => Ok(()),
            _ => Err(format!("the next request on the connection got {next:?}")),
        }
    }
}

/// Which engine wrote a response: the native path keeps the upstream's
/// spelling of `X-Served-By-Case`, hyper writes it in lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum By {
    Native,
    Hyper,
}

pub(crate) fn served_by(r: &Resp) -> By {
    if r.headers.iter().any(|(n, _)| n == "X-Served-By-Case") {
        By::Native
    } else if r.headers.iter().any(|(n, _)| n == "x-served-by-case") {
        By::Hyper
    } else {
        panic!("no x-served-by-case field in {r:?}")
    }
}
