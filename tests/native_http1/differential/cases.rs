//! The differential cases: a request the app sends ([`ReqCase`]) and what
//! the scripted upstream answers ([`RespCase`]), with what each calls for.

use std::net::SocketAddr;

use crate::scripted::Reply;
use crate::wire::{Fields, multiset, shown};
use crate::{API, BASED};

/// A request the app sends.
#[derive(Clone)]
pub(super) struct ReqCase {
    pub(super) method: &'static str,
    pub(super) host: &'static str,
    pub(super) target: &'static str,
    pub(super) fields: Vec<(&'static str, &'static str)>,
    /// Sent with `Content-Length` when present.
    pub(super) body: Option<Vec<u8>>,
    /// Written in this many parts.
    pub(super) writes: usize,
}

impl std::fmt::Debug for ReqCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReqCase")
            .field("method", &self.method)
            .field("host", &self.host)
            .field("target", &self.target)
            .field("fields", &self.fields)
            .field("body", &self.body.as_deref().map(shown))
            .field("writes", &self.writes)
            .finish()
    }
}

impl std::fmt::Debug for RespCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RespCase")
            .field("version", &self.version)
            .field("status", &self.status)
            .field("reason", &self.reason)
            .field("fields", &self.fields)
            .field("framing", &self.framing)
            .field("body", &shown(&self.body))
            .field("early_hints", &self.early_hints)
            .field("writes", &self.writes)
            .finish()
    }
}

/// Where a request's host routes it.
pub(super) enum Routed {
    /// To the upstream, under this base path.
    Up(&'static str),
    /// Nowhere: a 403 from the sidecar.
    Nowhere,
}

impl ReqCase {
    pub(super) fn get(target: &'static str) -> ReqCase {
        ReqCase { method: "GET", host: API, target, fields: Vec::new(), body: None, writes: 1 }
    }

    pub(super) fn with(mut self, name: &'static str, value: &'static str) -> ReqCase {
        self.fields.push((name, value));
        self
    }

    pub(super) fn bytes(&self) -> Vec<u8> {
        let mut out = format!("{} {} HTTP/1.1\r\nHost: {}\r\n", self.method, self.target, self.host).into_bytes();
        for (n, v) in &self.fields {
            out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
        }
        if let Some(body) = &self.body {
            out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(self.body.as_deref().unwrap_or_default());
        out
    }

    pub(super) fn is_head(&self) -> bool {
        self.method == "HEAD"
    }

    pub(super) fn routed(&self) -> Routed {
        // Routing compares the host in lower case and without its port.
        let host = self.host.split(':').next().unwrap_or_default().to_ascii_lowercase();
        match host.as_str() {
            API => Routed::Up(""),
            BASED => Routed::Up("/base"),
            _ => Routed::Nowhere,
        }
    }

    pub(super) fn asks_close(&self) -> bool {
        self.fields.iter().any(|(n, v)| n.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close"))
    }

    /// The fields the upstream must receive: the client's less the
    /// hop-by-hop ones and those its `Connection` names, the upstream's
    /// `host`, the body's length, and usher's `via`.
    pub(super) fn forwarded_fields(&self, up: SocketAddr) -> Fields {
        let named = connection_tokens(&self.fields);
        let mut out: Fields = vec![("host".into(), up.to_string()), ("via".into(), "1.1 usher".into())];
        for (n, v) in &self.fields {
            let n = n.to_ascii_lowercase();
            if HOP_BY_HOP.contains(&n.as_str()) || named.contains(&n) {
                continue;
            }
            out.push((n, v.as_bytes().escape_ascii().to_string()));
        }
        if let Some(body) = &self.body {
            out.push(("content-length".into(), body.len().to_string()));
        }
        multiset(&out)
    }
}

/// The field names a message's `Connection` fields list, in lower case.
pub(super) fn connection_tokens(fields: &[(&str, &str)]) -> Vec<String> {
    fields
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, v)| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect()
}

/// Fields that never cross a proxy (RFC 9110 §7.6.1).
pub(super) const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// How the scripted upstream delimits its response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Length,
    /// In `pieces` chunks, sizes in upper-case hex if `upper`, with chunk
    /// extensions and trailer fields if asked.
    Chunked {
        pieces: usize,
        upper: bool,
        ext: bool,
        trailers: bool,
    },
    /// No length: the upstream closes the connection after the body (HTTP/1.1).
    Close,
}

/// What the scripted upstream answers.
#[derive(Clone)]
pub(super) struct RespCase {
    pub(super) version: &'static str,
    pub(super) status: u16,
    pub(super) reason: &'static str,
    pub(super) fields: Vec<(&'static str, &'static str)>,
    pub(super) framing: Framing,
    pub(super) body: Vec<u8>,
    /// A `103 Early Hints` first.
    pub(super) early_hints: bool,
    /// Written in this many parts.
    pub(super) writes: usize,
}

impl RespCase {
    pub(super) fn ok(body: &str) -> RespCase {
        RespCase {
            version: "HTTP/1.1",
            status: 200,
            reason: "OK",
            fields: vec![("Content-Type", "text/plain")],
            framing: Framing::Length,
            body: body.as_bytes().to_vec(),
            early_hints: false,
            writes: 1,
        }
    }

    pub(super) fn status(mut self, status: u16, reason: &'static str) -> RespCase {
        (self.status, self.reason) = (status, reason);
        self
    }

    pub(super) fn with(mut self, name: &'static str, value: &'static str) -> RespCase {
        self.fields.push((name, value));
        self
    }

    pub(super) fn framed(mut self, framing: Framing) -> RespCase {
        self.framing = framing;
        self
    }

    /// Whether a body follows the head (RFC 9112 §6.3).
    pub(super) fn has_body(&self, head_request: bool) -> bool {
        !head_request && self.status != 204 && self.status != 304
    }

    pub(super) fn render(&self, head_request: bool) -> Reply {
        let mut out = Vec::new();
        if self.early_hints {
            out.extend_from_slice(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n");
        }
        out.extend_from_slice(format!("{} {} {}\r\n", self.version, self.status, self.reason).as_bytes());
        for (n, v) in &self.fields {
            out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
        }
        match self.framing {
            Framing::Length => out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes()),
            Framing::Chunked { .. } => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
            Framing::Close => {}
        }
        out.extend_from_slice(b"\r\n");
        let body = self.has_body(head_request);
        if body {
            match self.framing {
                Framing::Length | Framing::Close => out.extend_from_slice(&self.body),
                Framing::Chunked { pieces, upper, ext, trailers } => {
                    let size = self.body.len().div_ceil(pieces.max(1)).max(1);
                    for piece in self.body.chunks(size) {
                        let hex = if upper { format!("{:X}", piece.len()) } else { format!("{:x}", piece.len()) };
                        out.extend_from_slice(hex.as_bytes());
                        if ext {
                            out.extend_from_slice(b";name=value;flag");
                        }
                        out.extend_from_slice(b"\r\n");
                        out.extend_from_slice(piece);
                        out.extend_from_slice(b"\r\n");
                    }
                    out.extend_from_slice(if ext { &b"0;last\r\n"[..] } else { &b"0\r\n"[..] });
                    if trailers {
                        out.extend_from_slice(b"X-Checksum: abc\r\nX-Other: 1\r\n");
                    }
                    out.extend_from_slice(b"\r\n");
                }
            }
        }
        let close = (self.framing == Framing::Close && body)
            || self.version == "HTTP/1.0"
            || self.fields.iter().any(|(n, v)| n.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close"));
        Reply::Send { bytes: out, writes: self.writes, close }
    }
}
