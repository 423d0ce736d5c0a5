//! Upstream responses on the native HTTP/1.1 path: the head parsed with
//! httparse and re-encoded for the client (hop-by-hop fields removed, the
//! framing chosen by usher, `date` added when missing, as hyper's server
//! does), and a chunked-body transcoder as strict as hyper's decoder.
//!
//! For a route that reads the answer's fields (an upstream quota, a settled
//! cost), the head is written with [`FieldStarts`] recording where each
//! field begins, so the pipeline's lookups compare names at those offsets:
//! scanning the head for line ends once per lookup cost a few hundred
//! instructions a request (benches/RESULTS.md, run W).

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;

use super::fields::{eq_name, list_has, parse_length, push_field, tokens};

/// Most header fields in an upstream response (hyper's client allows 100).
pub(super) const MAX_HEADERS: usize = 128;
/// Largest upstream response head.
pub(super) const MAX_HEAD_BYTES: usize = 256 * 1024;
/// Chunk extensions and trailers are read and dropped, up to these limits (hyper's).
const EXTENSIONS_LIMIT: u64 = 16 * 1024;
const TRAILER_LIMIT: usize = 16 * 1024;
const TRAILER_COUNT: usize = 100;

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// No body: a response to HEAD, a 204 or a 304.
    Empty,
    /// `content-length`.
    Length(u64),
    /// `transfer-encoding: chunked`.
    Chunked,
    /// Until the upstream closes the connection.
    Close,
}

/// What the native path needs of an upstream's final response head.
#[derive(Debug)]
pub(super) struct ResponseHead {
    /// The final status.
    pub(super) status: StatusCode,
    /// How the body is delimited for the client: by usher, not as the upstream sent it.
    pub(super) framing: Framing,
    /// The upstream connection may carry another request after this body.
    pub(super) reusable: bool,
    /// `Retry-After` in whole seconds, for pushback.
    pub(super) retry_after: Option<Duration>,
}

/// The outcome of parsing the bytes an upstream has sent so far.
#[derive(Debug)]
pub(super) enum Parsed {
    /// Not all of the head yet.
    Partial,
    /// An interim (1xx) response of this many bytes: skipped, as hyper's client does.
    Interim(usize),
    /// The final response head, this many bytes long; the client's head is in `out`.
    Final(usize, ResponseHead),
}

/// Parses the response head at the front of `buf` (the answer to a HEAD
/// request when `head_request`). For a final response, appends the head
/// to send the client to `out`, without its closing blank line, so the
/// caller can add `connection: close`, and marks its fields in `fields`
/// (if it records).
#[inline]
pub(super) fn parse(
    buf: &[u8],
    head_request: bool,
    out: &mut Vec<u8>,
    fields: &mut FieldStarts,
) -> Result<Parsed, String> {
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut resp, buf, &mut storage) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
            return Err(format!("response head larger than {MAX_HEAD_BYTES} bytes"));
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => return Err(format!("more than {MAX_HEADERS} response header fields")),
        Err(e) => return Err(format!("invalid HTTP response: {e}")),
    };
    let code = resp.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|_| format!("invalid HTTP response: status {code}"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err("101 Switching Protocols to a request that asked for no upgrade".into());
    }
    if status.is_informational() {
        return Ok(Parsed::Interim(len));
    }
    let headers = resp.headers;
    let http11 = resp.version == Some(1);

    // Framing, RFC 9112 §6.3: Transfer-Encoding wins over Content-Length.
    let no_body = head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let mut chunked = None::<bool>;
    let mut length = None::<u64>;
    let mut close = !http11;
    let mut retry_after = None;
    // The Connection fields' values (nearly always at most one) name more hop-by-hop fields.
    let mut connection = [&b""[..]; 4];
    let mut connections = 0;
    let mut more_connection = Vec::new();
    for h in headers.iter() {
        let v = h.value;
        if eq_name(h.name, "transfer-encoding") {
            if !http11 {
                // As hyper's client: HTTP/1.0 has no transfer codings.
                return Err("invalid HTTP response: transfer-encoding in an HTTP/1.0 response".into());
            }
            // Only `chunked` is understood; a coding before it (gzip, chunked)
            // would reach the client undeclared once the field is dropped.
            let all_chunked = tokens(v).all(|t| t.eq_ignore_ascii_case(b"chunked"));
            chunked = Some(chunked.unwrap_or(true) && all_chunked && tokens(v).next().is_some());
        } else if eq_name(h.name, "content-length") {
            for t in v.split(|&b| b == b',') {
                let n = parse_length(t.trim_ascii())
                    .ok_or_else(|| format!("invalid HTTP response: content-length {:?}", String::from_utf8_lossy(v)))?;
                if length.is_some_and(|l| l != n) {
                    return Err("invalid HTTP response: conflicting content-length values".into());
                }
                length = Some(n);
            }
        } else if eq_name(h.name, "connection") {
            close |= list_has(v, b"close");
            match connection.get_mut(connections) {
                Some(slot) => {
                    *slot = v;
                    connections += 1;
                }
                None => more_connection.push(v),
            }
        } else if eq_name(h.name, "retry-after") {
            retry_after = usher_enforce::pushback::retry_after_value(v);
        }
    }
    let framing = choose_framing(no_body, chunked, length)?;
    // A message with both framings is suspect: its connection is not reused.
    let reusable = !close && framing != Framing::Close && !(chunked.is_some() && length.is_some());

    // The client's head.
    status_line(out, status, resp.reason);
    let mut has_date = false;
    let named =
        |name: &str| connection[..connections].iter().chain(&more_connection).any(|c| list_has(c, name.as_bytes()));
    for h in headers.iter() {
        let keep = if eq_name(h.name, "content-length") {
            // Kept as sent where there is no body to measure (HEAD, 304).
            framing == Framing::Empty && status != StatusCode::NO_CONTENT
        } else {
            !crate::upstream::hop_by_hop(h.name) && !named(h.name)
        };
        if keep {
            has_date |= eq_name(h.name, "date");
            field(out, fields, h.name.as_bytes(), h.value);
        }
    }
    end_head(out, framing, has_date, fields);
    Ok(Parsed::Final(len, ResponseHead { status, framing, reusable, retry_after }))
}

/// How the body of an answer is delimited for the client, from its
/// `transfer-encoding` (`chunked`: whether it is `chunked` alone) and
/// `content-length`, unless it has none (`no_body`).
#[inline]
fn choose_framing(no_body: bool, chunked: Option<bool>, length: Option<u64>) -> Result<Framing, String> {
    Ok(match (no_body, chunked, length) {
        (true, _, _) => Framing::Empty,
        (false, Some(true), _) => Framing::Chunked,
        (false, Some(false), _) => return Err("unsupported transfer-encoding from the upstream (only chunked)".into()),
        (false, None, Some(n)) => Framing::Length(n),
        (false, None, None) => Framing::Close,
    })
}

/// Appends the client's status line: the upstream's reason, else the canonical one.
#[inline]
fn status_line(out: &mut Vec<u8>, status: StatusCode, reason: Option<&str>) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    match reason {
        Some(r) if !r.is_empty() => out.extend_from_slice(r.as_bytes()),
        _ => out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes()),
    }
    out.extend_from_slice(b"\r\n");
}

/// The client's head for an answer from an h2 upstream (`crate::upstream::h2conn`),
/// appended to `out` without its closing
/// blank line, as [`parse`] does for an HTTP/1.1 one. The body is framed by
/// its length when it is known (`exact`: a `content-length`, or an answer
/// whose stream ended with its head), else chunked, as hyper's server
/// frames it on the general path.
pub(super) fn from_parts(
    parts: &http::response::Parts,
    head_request: bool,
    exact: Option<u64>,
    out: &mut Vec<u8>,
    fields: &mut FieldStarts,
) -> ResponseHead {
    let status = parts.status;
    let no_body = head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let framing = match (no_body, exact) {
        (true, _) => Framing::Empty,
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::Chunked,
    };
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut has_date = false;
    for (name, value) in &parts.headers {
        let keep = if name == http::header::CONTENT_LENGTH {
            framing == Framing::Empty && status != StatusCode::NO_CONTENT
        } else {
            !crate::upstream::hop_by_hop(name.as_str())
        };
        if keep {
            has_date |= name == http::header::DATE;
            field(out, fields, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    end_head(out, framing, has_date, fields);
    let retry_after = usher_enforce::pushback::retry_after(&parts.headers);
    ResponseHead { status, framing, reusable: false, retry_after }
}

/// Rewrites a client's head in `out` (as [`parse`] or [`from_parts`] wrote
/// it, without its blank line) that gives its body's length to send the
/// body in chunks instead: for a body usher edits on its way.
pub(super) fn rechunk(out: &mut Vec<u8>) {
    let field = b"\r\ncontent-length: ";
    let Some(at) = out.windows(field.len()).position(|w| w == field) else { return };
    let start = at + 2;
    let end = out[start..].windows(2).position(|w| w == b"\r\n").map_or(out.len(), |n| start + n + 2);
    out.splice(start..end, b"transfer-encoding: chunked\r\n".iter().copied());
}

/// Appends the fields usher adds to a client's head: its framing, and
/// `date` when the upstream sent none.
fn end_head(out: &mut Vec<u8>, framing: Framing, has_date: bool, fields: &mut FieldStarts) {
    match framing {
        Framing::Length(n) => {
            fields.mark(out, "content-length".len());
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked | Framing::Close => {
            fields.mark(out, "transfer-encoding".len());
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        Framing::Empty => {}
    }
    if !has_date {
        fields.mark(out, "date".len());
        push_date(out);
    }
}

/// Appends a field to a client's head, marked in `fields`.
fn field(out: &mut Vec<u8>, fields: &mut FieldStarts, name: &[u8], value: &[u8]) {
    fields.mark(out, name.len());
    push_field(out, name, value);
}

/// Appends `date: <now>`, formatted once a second per thread (as hyper does).
pub(super) fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    #[allow(clippy::disallowed_methods, reason = "a response's Date field is the wall-clock time (RFC 9110 §6.6.1)")]
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            *d = (secs, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(d.1.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}

// === impl FieldStarts ===

/// Where each field of a client's head starts (byte offsets into it) and
/// how long its name is, as [`parse`] and [`from_parts`] write it; recorded
/// only when switched on, for a route that reads the answer's fields.
#[derive(Debug, Default)]
pub(super) struct FieldStarts {
    marks: Vec<Mark>,
    on: bool,
}

/// A field of a client's head: `name: value\r\n` from `start`, its name
/// `name` bytes long. (A head is at most a few hundred KiB: MAX_HEAD_BYTES.)
#[derive(Debug, Clone, Copy)]
struct Mark {
    start: u32,
    name: u32,
}

impl FieldStarts {
    /// Forgets the fields of the head written last; the next head's are
    /// recorded if `on`.
    pub(super) fn reset(&mut self, on: bool) {
        self.marks.clear();
        self.on = on;
    }

    /// Forgets the fields of the head written last (a head is written anew).
    pub(super) fn clear(&mut self) {
        self.marks.clear();
    }

    /// A field whose name is `name` bytes long starts at the end of `out`.
    #[inline]
    fn mark(&mut self, out: &[u8], name: usize) {
        if self.on {
            self.marks.push(Mark { start: out.len() as u32, name: name as u32 });
        }
    }

    /// The value of the first field of `head` (the client's head these
    /// starts were recorded for) named `name` (lower-case), trimmed.
    pub(super) fn find<'h>(&self, head: &'h [u8], name: &str) -> Option<&'h [u8]> {
        let name = name.as_bytes();
        // Names are compared only where their lengths match: exactly first
        // (most upstreams send lower-case names), then without case.
        let i = self.marks.iter().position(|m| {
            m.name as usize == name.len()
                && head
                    .get(m.start as usize..)
                    .and_then(|f| f.get(..name.len()))
                    .is_some_and(|field| field == name || field.eq_ignore_ascii_case(name))
        })?;
        // The value lies between `: ` and the line's end (`\r\n`), as
        // `push_field` and `push_date` write it.
        let start = self.marks[i].start as usize + name.len() + 2;
        let end = self.marks.get(i + 1).map_or(head.len(), |m| m.start as usize).checked_sub(2)?;
        head.get(start..end).map(<[u8]>::trim_ascii)
    }
}

// === chunked bodies ===

/// Where a [`Dechunker`] is in a chunked body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    Size,
    SizeLws,
    Extension,
    SizeLf,
    Body,
    BodyCr,
    BodyLf,
    EndCr,
    Trailer,
    TrailerLf,
    EndLf,
    Done,
}

/// Decodes a chunked body as it arrives and re-encodes its data as chunks
/// of usher's own: extensions and trailers are dropped, as hyper drops them
/// for a client that did not ask for trailers. Accepts exactly what hyper's
/// decoder accepts: CRLF line ends, hexadecimal sizes without overflow,
/// bounded extensions, and a trailer section that is a valid field section
/// of at most 100 lines and 16 KiB (counted as hyper counts it).
#[derive(Debug)]
pub(super) struct Dechunker {
    state: State,
    size: u64,
    extensions: u64,
    /// The trailer section as received, line ends included, for the final check.
    trailer: Vec<u8>,
    trailers: usize,
}

impl Default for Dechunker {
    fn default() -> Self {
        Dechunker { state: State::Start, size: 0, extensions: 0, trailer: Vec::new(), trailers: 0 }
    }
}

impl Dechunker {
    /// Whether the body has ended (its last chunk and trailer section are in).
    pub(super) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes from `input`, appending re-encoded data (and, at the end, the
    /// last chunk) to `out`, and handing each piece of decoded data to
    /// `data` (a copy for a settled cost; a no-op otherwise). Returns how
    /// many bytes were consumed: all of `input`, or fewer once the body has
    /// ended.
    pub(super) fn feed(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
        mut data: impl FnMut(&[u8]),
    ) -> Result<usize, &'static str> {
        let mut i = 0;
        while i < input.len() && self.state != State::Done {
            if self.state == State::Body {
                let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                data(&input[i..i + n]);
                push_chunk(out, &input[i..i + n]);
                i += n;
                self.size -= n as u64;
                if self.size == 0 {
                    self.state = State::BodyCr;
                }
                continue;
            }
            let b = input[i];
            i += 1;
            self.state = match (self.state, b) {
                (State::Start | State::Size, b) if b.is_ascii_hexdigit() => {
                    let digit = u64::from((b as char).to_digit(16).expect("a hex digit"));
                    self.size =
                        self.size.checked_mul(16).and_then(|s| s.checked_add(digit)).ok_or("chunk size overflows")?;
                    State::Size
                }
                (State::Start, _) => return Err("invalid chunk size line: missing size digit"),
                (State::Size | State::SizeLws, b'\t' | b' ') => State::SizeLws,
                (State::Size | State::SizeLws, b';') => State::Extension,
                (State::Size | State::SizeLws | State::Extension, b'\r') => State::SizeLf,
                (State::Size, _) => return Err("invalid chunk size line"),
                (State::SizeLws, _) => return Err("invalid chunk size line: whitespace"),
                (State::Extension, b'\n') => return Err("chunk extension contains a newline"),
                (State::Extension, _) => {
                    self.extensions += 1;
                    if self.extensions >= EXTENSIONS_LIMIT {
                        return Err("chunk extensions over the limit");
                    }
                    State::Extension
                }
                (State::SizeLf, b'\n') if self.size == 0 => State::EndCr,
                (State::SizeLf, b'\n') => State::Body,
                (State::SizeLf, _) => return Err("invalid chunk size line: CR without LF"),
                (State::BodyCr, b'\r') => State::BodyLf,
                (State::BodyCr, _) => return Err("chunk data longer than its size, or its CRLF missing"),
                (State::BodyLf, b'\n') => {
                    self.size = 0;
                    State::Start
                }
                (State::BodyLf, _) => return Err("invalid chunk data end: CR without LF"),
                (State::EndCr, b'\r') => {
                    self.keep_trailer(b, false)?;
                    State::EndLf
                }
                (State::EndCr | State::Trailer, b) => {
                    self.keep_trailer(b, true)?;
                    if b == b'\r' { State::TrailerLf } else { State::Trailer }
                }
                (State::TrailerLf, b'\n') => {
                    if self.trailers >= TRAILER_COUNT {
                        return Err("too many chunk trailers");
                    }
                    self.trailers += 1;
                    self.keep_trailer(b, false)?;
                    State::EndCr
                }
                (State::TrailerLf, _) => return Err("invalid trailer line end"),
                (State::EndLf, b'\n') => {
                    self.keep_trailer(b, false)?;
                    self.check_trailers()?;
                    out.extend_from_slice(b"0\r\n\r\n");
                    State::Done
                }
                (State::EndLf, _) => return Err("invalid chunked body end"),
                (State::Body | State::Done, _) => unreachable!("handled above"),
            };
        }
        Ok(i)
    }
}

impl Dechunker {
    /// Keeps a byte of the trailer section (`starts`: it may be the first).
    fn keep_trailer(&mut self, b: u8, starts: bool) -> Result<(), &'static str> {
        if self.trailer.is_empty() && !starts {
            return Ok(());
        }
        self.trailer.push(b);
        if self.trailer.len() >= TRAILER_LIMIT {
            return Err("chunk trailers over the limit");
        }
        Ok(())
    }

    /// The trailer section, if any, must be a valid field section.
    fn check_trailers(&self) -> Result<(), &'static str> {
        if self.trailer.is_empty() {
            return Ok(());
        }
        let mut fields = vec![httparse::EMPTY_HEADER; self.trailers];
        match httparse::parse_headers(&self.trailer, &mut fields) {
            Ok(httparse::Status::Complete(_)) => Ok(()),
            _ => Err("invalid chunk trailers"),
        }
    }
}

/// Appends `data` as one chunk (nothing for empty data, which would end the body).
pub(super) fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let mut hex = [0u8; 16];
    let mut n = data.len();
    let mut at = hex.len();
    while n > 0 || at == hex.len() {
        at -= 1;
        hex[at] = b"0123456789abcdef"[n % 16];
        n /= 16;
    }
    out.extend_from_slice(&hex[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests;
