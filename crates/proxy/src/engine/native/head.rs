//! Request heads on the native HTTP/1.1 path: parsed in place with httparse
//! (no header map, no allocation), checked against the subset of HTTP/1.1
//! the native path serves, and re-encoded for the upstream.
//!
//! The subset is the everyday request: HTTP/1.1, origin-form target, one
//! Host, no body or a Content-Length body of at most [`MAX_BODY`] bytes, no
//! Transfer-Encoding, Expect, Upgrade or TE. Everything else, including
//! every malformed or ambiguous head, is handed to hyper with the bytes
//! untouched, so the general path's rules (and its answers: 400, 413, 431,
//! 508 ...) apply to it unchanged.

use std::mem::MaybeUninit;

use http::header::{HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Uri, Version};

use super::fields::{eq_name, list_has, parse_length, push_field};
use crate::pipeline::guard::VIA;
use crate::upstream::hop_by_hop;
use usher_core::config::listener::ListenerLimits;
use usher_enforce::resource::RequestView;

/// Header fields the parser has room for; a request with more is handed off.
pub(super) const MAX_HEADERS: usize = 128;
/// Largest request body the native path buffers before forwarding; a longer
/// one is handed to the general path, which streams it.
pub(super) const MAX_BODY: u64 = 64 * 1024;
/// `Connection` fields one request may carry on the native path.
const MAX_CONNECTION_FIELDS: usize = 4;

/// Why a request left the native path: the `reason` label of
/// `usher_proxy_http1_handoffs_total`.
pub(crate) mod why {
    /// A head httparse cannot parse, or a method `http` does not accept.
    pub(crate) const MALFORMED: &str = "malformed";
    /// A head over the listener's limits: too large, or too many fields.
    pub(crate) const HEAD_LIMITS: &str = "head_limits";
    /// Not HTTP/1.1.
    pub(crate) const VERSION: &str = "http_1_0";
    /// A CONNECT request.
    pub(crate) const CONNECT: &str = "connect";
    /// A target not in origin form, or with bytes the native path does not forward as they are.
    pub(crate) const TARGET: &str = "target";
    /// No Host, several, or one that is not a plain `host[:port]`.
    pub(crate) const HOST: &str = "host";
    /// Several Content-Length fields, or one that is not a number.
    pub(crate) const CONTENT_LENGTH: &str = "content_length";
    /// A Transfer-Encoding (a chunked body).
    pub(crate) const TRANSFER_ENCODING: &str = "transfer_encoding";
    /// An `Expect` (`100-continue`).
    pub(crate) const EXPECT: &str = "expect";
    /// An `Upgrade`.
    pub(crate) const UPGRADE: &str = "upgrade";
    /// A `TE`.
    pub(crate) const TE: &str = "te";
    /// More `Connection` fields than the native path keeps.
    pub(crate) const CONNECTION: &str = "connection";
    /// A gRPC request (`content-type: application/grpc`).
    pub(crate) const GRPC: &str = "grpc";
    /// A `Via` of usher's own: a request that came back around.
    pub(crate) const LOOP: &str = "loop";
    /// A body over the native path's buffer or the body limit in force.
    pub(crate) const BODY: &str = "body";
    /// A target the native path does not forward to (an origin the request
    /// names, an upstream it has no connection for), or a request an h2
    /// upstream's head cannot carry.
    pub(crate) const UPSTREAM: &str = "upstream";
    /// Every label, for registering the counter's series up front.
    pub(crate) const ALL: &[&str] = &[
        MALFORMED,
        HEAD_LIMITS,
        VERSION,
        CONNECT,
        TARGET,
        HOST,
        CONTENT_LENGTH,
        TRANSFER_ENCODING,
        EXPECT,
        UPGRADE,
        TE,
        CONNECTION,
        GRPC,
        LOOP,
        BODY,
        UPSTREAM,
    ];
}

/// What the front of a connection's buffer holds.
pub(super) enum Parsed<'b> {
    /// Not all of it yet: the head (`head_complete` false), or the body.
    Partial {
        /// The head is in: only the body is still to come.
        head_complete: bool,
    },
    /// A whole request the native path serves.
    Ready(Head<'b>),
    /// A request for the general path, for this reason.
    HandOff(&'static str),
}

/// A parsed request head, borrowing the connection's buffer.
pub(super) struct Head<'b> {
    /// The request's method.
    pub(super) method: Method,
    /// The whole head as received: [`Head::request`] copies it once and
    /// shares the copy among the target and the field values.
    raw: &'b [u8],
    /// Origin-form: path and query.
    target: &'b str,
    path_len: usize,
    headers: &'b [httparse::Header<'b>],
    /// Bytes of the head.
    pub(super) head_len: usize,
    /// Bytes of the body that follows the head.
    pub(super) body_len: usize,
    /// The client asked to close the connection after this exchange.
    pub(super) close: bool,
    /// The Connection fields' values: they name more hop-by-hop fields.
    connection: [&'b [u8]; MAX_CONNECTION_FIELDS],
    /// How many of `connection` the request has.
    connections: usize,
}

/// Parses the request at the front of `buf` under `limits`. `storage` is
/// the parser's room for header fields.
#[inline]
pub(super) fn parse<'b>(
    buf: &'b [u8],
    storage: &'b mut [MaybeUninit<httparse::Header<'b>>],
    limits: &ListenerLimits,
) -> Parsed<'b> {
    let mut req = httparse::Request::new(&mut []);
    let head_len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, buf, storage) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > limits.max_header_bytes => {
            return Parsed::HandOff(why::HEAD_LIMITS);
        }
        Ok(httparse::Status::Partial) => return Parsed::Partial { head_complete: false },
        Err(httparse::Error::TooManyHeaders) => return Parsed::HandOff(why::HEAD_LIMITS),
        Err(_) => return Parsed::HandOff(why::MALFORMED),
    };
    let headers: &'b mut [httparse::Header<'b>] = std::mem::take(&mut req.headers);
    let headers: &'b [httparse::Header<'b>] = headers;
    if head_len > limits.max_header_bytes || headers.len() > limits.max_headers {
        return Parsed::HandOff(why::HEAD_LIMITS);
    }
    let (method, target) = match request_line(&req) {
        Ok(line) => line,
        Err(why) => return Parsed::HandOff(why),
    };

    let mut hosts = 0;
    let mut length = None;
    let mut close = false;
    let mut connection = [&b""[..]; MAX_CONNECTION_FIELDS];
    let mut connections = 0;
    for h in headers {
        let (name, v) = (h.name, h.value);
        match name.len() {
            4 if eq_name(name, "host") => {
                // Anything but a plain name or address with a port is left
                // to the general path, which refuses what is not host[:port].
                if !plain_host(v) {
                    return Parsed::HandOff(why::HOST);
                }
                hosts += 1;
            }
            14 if eq_name(name, "content-length") => {
                if length.is_some() {
                    return Parsed::HandOff(why::CONTENT_LENGTH);
                }
                match parse_length(v) {
                    Some(n) => length = Some(n),
                    None => return Parsed::HandOff(why::CONTENT_LENGTH),
                }
            }
            17 if eq_name(name, "transfer-encoding") => return Parsed::HandOff(why::TRANSFER_ENCODING),
            6 if eq_name(name, "expect") => return Parsed::HandOff(why::EXPECT),
            7 if eq_name(name, "upgrade") => return Parsed::HandOff(why::UPGRADE),
            2 if eq_name(name, "te") => return Parsed::HandOff(why::TE),
            10 if eq_name(name, "connection") => {
                if connections == MAX_CONNECTION_FIELDS {
                    return Parsed::HandOff(why::CONNECTION);
                }
                close |= list_has(v, b"close");
                connection[connections] = v;
                connections += 1;
            }
            12 if eq_name(name, "content-type")
                && v.len() >= 16
                && v[..16].eq_ignore_ascii_case(b"application/grpc") =>
            {
                return Parsed::HandOff(why::GRPC);
            }
            3 if eq_name(name, "via") && contains(v, VIA.as_bytes()) => return Parsed::HandOff(why::LOOP),
            _ => {}
        }
    }
    if hosts != 1 {
        return Parsed::HandOff(why::HOST);
    }
    let body_len = length.unwrap_or(0);
    if body_len > MAX_BODY || limits.max_body_bytes.is_some_and(|max| body_len > max) {
        return Parsed::HandOff(why::BODY);
    }
    let body_len = body_len as usize;
    if buf.len() < head_len + body_len {
        return Parsed::Partial { head_complete: true };
    }
    Parsed::Ready(Head {
        method,
        raw: &buf[..head_len],
        target,
        path_len: target.find('?').unwrap_or(target.len()),
        headers,
        head_len,
        body_len,
        close,
        connection,
        connections,
    })
}

/// The method and origin-form target of a request line the native path
/// serves, or why the request goes to the general path: not HTTP/1.1, a
/// CONNECT, a target in another form or with bytes it does not forward as
/// they are, a method `http` does not accept.
#[inline]
fn request_line<'b>(req: &httparse::Request<'_, 'b>) -> Result<(Method, &'b str), &'static str> {
    if req.version != Some(1) {
        return Err(why::VERSION);
    }
    let (Some(method), Some(target)) = (req.method, req.path) else { return Err(why::MALFORMED) };
    if method == "CONNECT" {
        return Err(why::CONNECT);
    }
    if !target.starts_with('/') || !target.bytes().all(target_byte) {
        return Err(why::TARGET);
    }
    let Ok(method) = Method::from_bytes(method.as_bytes()) else { return Err(why::MALFORMED) };
    Ok((method, target))
}

impl Head<'_> {
    /// Appends the request as sent upstream to `out`: the target under the
    /// upstream's base path (`prefix`), the upstream's `host`, the client's
    /// fields less the hop-by-hop ones, `via`, then `body`.
    pub(super) fn encode(&self, prefix: &str, host: &[u8], body: &[u8], out: &mut Vec<u8>) {
        self.encode_line(prefix, host, out);
        for h in self.forwarded() {
            push_field(out, h.name.as_bytes(), h.value);
        }
        end(body, out);
    }

    /// [`Head::encode`] with a body usher rewrote (a route asked for
    /// usage): its `content-length` is that body's.
    pub(super) fn encode_rewritten(&self, prefix: &str, host: &[u8], body: &[u8], out: &mut Vec<u8>) {
        self.encode_line(prefix, host, out);
        let mut length = itoa::Buffer::new();
        let length = length.format(body.len()).as_bytes();
        for h in self.forwarded() {
            let value = if eq_name(h.name, "content-length") { length } else { h.value };
            push_field(out, h.name.as_bytes(), value);
        }
        end(body, out);
    }

    /// The request line as sent upstream, and the upstream's `host`.
    #[inline(always)]
    fn encode_line(&self, prefix: &str, host: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(self.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        push_field(out, b"host", host);
    }

    /// The client's fields that go upstream: all but Host (the upstream's
    /// replaces it) and the hop-by-hop ones, standard or named by Connection.
    fn forwarded(&self) -> impl Iterator<Item = &httparse::Header<'_>> {
        let named = &self.connection[..self.connections];
        self.headers.iter().filter(move |h| {
            // Content-Length frames the body sent with it: it stays, whatever Connection names.
            !((h.name.len() == 4 && eq_name(h.name, "host"))
                || hop_by_hop(h.name)
                || (!eq_name(h.name, "content-length") && named.iter().any(|c| list_has(c, h.name.as_bytes()))))
        })
    }

    /// The request's head as it goes to a multiplexed (h2) upstream at
    /// `base`: the same target under the base path, the same fields as
    /// [`Head::encode`] writes (the authority comes from `base`), and `via`.
    /// `None` if a field is not one `http` accepts; the general path then
    /// serves the request and answers for it.
    pub(super) fn request(&self, base: &Uri) -> Option<http::Request<()>> {
        // One copy of the head; the target and every value are views of it
        // (a copy of each made an allocation per field).
        let raw = bytes::Bytes::copy_from_slice(self.raw);
        let view = |s: &[u8]| {
            let at = s.as_ptr() as usize - self.raw.as_ptr() as usize;
            raw.slice(at..at + s.len())
        };
        let prefix = base.path().trim_end_matches('/');
        let mut parts = http::uri::Parts::default();
        parts.scheme = base.scheme().cloned();
        parts.authority = base.authority().cloned();
        parts.path_and_query = Some(if prefix.is_empty() {
            PathAndQuery::from_maybe_shared(view(self.target.as_bytes())).ok()?
        } else {
            PathAndQuery::try_from(format!("{prefix}{}", self.target)).ok()?
        });
        let mut req = http::Request::new(());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = Uri::from_parts(parts).ok()?;
        *req.version_mut() = Version::HTTP_2;
        let headers = req.headers_mut();
        headers.reserve(self.headers.len() + 1);
        for h in self.forwarded() {
            let name = HeaderName::from_bytes(h.name.as_bytes()).ok()?;
            headers.append(name, HeaderValue::from_maybe_shared(view(h.value)).ok()?);
        }
        headers.append(http::header::VIA, HeaderValue::from_static(VIA));
        Some(req)
    }

    /// [`Head::encode`] for a request already made for an h2 upstream
    /// ([`Head::request`]: its target under the base path, its fields with
    /// `via`), for the upstream's HTTP/1.1 pool once the upstream turned out
    /// to pick `http/1.1` in ALPN after all.
    pub(super) fn encode_made(req: &http::Request<()>, host: &[u8], body: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(req.method().as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(req.uri().path_and_query().map_or("/", |p| p.as_str()).as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        push_field(out, b"host", host);
        for (name, value) in req.headers() {
            push_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(body);
    }

    /// Safe to send twice (RFC 9110 §9.2.2): a reused connection that
    /// closed before answering may be retried on a new one.
    pub(super) fn idempotent(&self) -> bool {
        self.method.is_idempotent()
    }
}

impl RequestView for Head<'_> {
    fn method(&self) -> &Method {
        &self.method
    }

    fn uri_host(&self) -> Option<&str> {
        None
    }

    fn path(&self) -> &str {
        &self.target[..self.path_len]
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|h| eq_name(h.name, name)).map(|h| h.value)
    }
}

/// The end of a request head as sent upstream (`via`), and its body.
#[inline(always)]
fn end(body: &[u8], out: &mut Vec<u8>) {
    push_field(out, b"via", VIA.as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
}

/// A Host value the native path takes as it is: a name or IPv4 address of
/// letters, digits, `-`, `.` and `_`, and at most a port of up to five digits
/// (the general path checks the rest: IPv6 literals, other characters, a
/// port over 65535).
fn plain_host(v: &[u8]) -> bool {
    // One pass with a table: this runs for every request.
    let name = v.iter().position(|&b| !HOST_NAME[usize::from(b)]).unwrap_or(v.len());
    match &v[name..] {
        _ if name == 0 => false,
        [] => true,
        [b':', port @ ..] => match port.len() {
            1..=4 => port.iter().all(u8::is_ascii_digit),
            5 => port.iter().all(u8::is_ascii_digit) && port <= &b"65535"[..],
            _ => false,
        },
        _ => false,
    }
}

/// The bytes of a plain host name or IPv4 address: letters, digits, `-`, `.`, `_`.
static HOST_NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric() || c == b'-' || c == b'.' || c == b'_';
        b += 1;
    }
    t
};

/// A byte the native path forwards in a request target as it is: RFC 3986's
/// `pchar`, `/` and `?`. Any other (`#`, `"`, `{`, `\`, non-ASCII ...) sends
/// the request to the general path, whose URI parser decides.
fn target_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@%/?".contains(&b)
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests;
