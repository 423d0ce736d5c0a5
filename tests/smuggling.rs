//! No request smuggling: a regression corpus of ambiguous HTTP/1.x framing
//! (the inputs behind RUSTSEC-2020-0008, 2021-0020, 2021-0078, 2021-0079 and
//! the classic CL.TE / TE.CL attacks), each sent raw over TCP to a real
//! sidecar listener in front of a recording upstream that keeps the exact
//! bytes it receives and parses them strictly.
//!
//! For every input the sidecar must either refuse it (a 4xx, nothing
//! forwarded) or forward exactly the requests RFC 9112 says the client sent,
//! each with unambiguous framing (one Content-Length or chunked, never both)
//! and the body the client meant. Nothing else may reach the upstream.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{Http1, Proxy, serve_with};

// === the recording upstream ===

/// One request as the upstream parsed it, strictly.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

#[derive(Default)]
struct Record {
    /// Every byte received, per connection.
    raw: Vec<Vec<u8>>,
    requests: Vec<Seen>,
    /// Framing the strict parser refused, or a request cut off by EOF.
    problems: Vec<String>,
}

struct Recorder {
    addr: SocketAddr,
    record: Arc<Mutex<Record>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let record = Arc::new(Mutex::new(Record::default()));
        let rec = record.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let rec = rec.clone();
                tokio::spawn(recorder_conn(stream, rec));
            }
        });
        Recorder { addr, record, task }
    }

    fn bytes(&self) -> usize {
        self.record.lock().unwrap().raw.iter().map(Vec::len).sum()
    }
}

async fn recorder_conn(mut stream: TcpStream, rec: Arc<Mutex<Record>>) {
    let conn = {
        let mut r = rec.lock().unwrap();
        r.raw.push(Vec::new());
        r.raw.len() - 1
    };
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    // Bounded: a connection carries at most this many requests in a test.
    for _ in 0..64 {
        loop {
            match parse_strict(&buf) {
                Parsed::Complete(seen, used) => {
                    buf.drain(..used);
                    rec.lock().unwrap().requests.push(seen);
                    if stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.is_err() {
                        return;
                    }
                }
                Parsed::Bad(why) => {
                    rec.lock().unwrap().problems.push(why);
                    return;
                }
                Parsed::Partial => break,
            }
        }
        let n = match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => {
                if !buf.is_empty() {
                    rec.lock().unwrap().problems.push(format!("connection closed inside a request: {:?}", show(&buf)));
                }
                return;
            }
            Ok(n) => n,
        };
        rec.lock().unwrap().raw[conn].extend_from_slice(&chunk[..n]);
        buf.extend_from_slice(&chunk[..n]);
    }
}

enum Parsed {
    Complete(Seen, usize),
    Partial,
    Bad(String),
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// RFC 9112 with no leniency: CRLF only, no obs-fold, no control bytes,
/// one framing header at most, `chunked` alone.
fn parse_strict(buf: &[u8]) -> Parsed {
    let Some(end) = find(buf, b"\r\n\r\n") else { return Parsed::Partial };
    let head = &buf[..end];
    let text = match std::str::from_utf8(head) {
        Ok(t) => t,
        Err(_) => return Parsed::Bad("head is not UTF-8".into()),
    };
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let parts: Vec<&str> = request_line.split(' ').collect();
    if parts.len() != 3 || parts[2] != "HTTP/1.1" {
        return Parsed::Bad(format!("request line {request_line:?}"));
    }
    let mut headers = Vec::new();
    for line in lines {
        if line.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0 || (b < 0x20 && b != b'\t') || b == 0x7f) {
            return Parsed::Bad(format!("control byte in header line {line:?}"));
        }
        if line.starts_with([' ', '\t']) {
            return Parsed::Bad(format!("obs-fold line {line:?}"));
        }
        let Some((name, value)) = line.split_once(':') else { return Parsed::Bad(format!("no colon in {line:?}")) };
        if name.is_empty() || name.bytes().any(|b| !(b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))) {
            return Parsed::Bad(format!("bad field name {name:?}"));
        }
        headers.push((name.to_ascii_lowercase(), value.trim_matches([' ', '\t']).to_string()));
    }
    let get = |n: &str| headers.iter().filter(|(k, _)| k == n).map(|(_, v)| v.clone()).collect::<Vec<_>>();
    let (cl, te) = (get("content-length"), get("transfer-encoding"));
    let body_start = end + 4;
    let (body, used) = match (cl.as_slice(), te.as_slice()) {
        ([], []) => (Vec::new(), body_start),
        ([len], []) => {
            if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
                return Parsed::Bad(format!("content-length {len:?}"));
            }
            let Ok(n) = len.parse::<usize>() else { return Parsed::Bad(format!("content-length {len:?}")) };
            if buf.len() < body_start + n {
                return Parsed::Partial;
            }
            (buf[body_start..body_start + n].to_vec(), body_start + n)
        }
        ([], [te]) if te == "chunked" => match dechunk_strict(&buf[body_start..]) {
            Ok(Some((body, n))) => (body, body_start + n),
            Ok(None) => return Parsed::Partial,
            Err(e) => return Parsed::Bad(e),
        },
        _ => return Parsed::Bad(format!("ambiguous framing: content-length {cl:?}, transfer-encoding {te:?}")),
    };
    Parsed::Complete(Seen { method: parts[0].to_string(), target: parts[1].to_string(), headers, body }, used)
}

/// A chunked body: `Ok(None)` while incomplete; (body, bytes used).
fn dechunk_strict(mut b: &[u8]) -> Result<Option<(Vec<u8>, usize)>, String> {
    let total = b.len();
    let mut body = Vec::new();
    loop {
        let Some(eol) = find(b, b"\r\n") else { return Ok(None) };
        let line = std::str::from_utf8(&b[..eol]).map_err(|_| "chunk size is not UTF-8".to_string())?;
        let size = line.split(';').next().unwrap_or_default();
        if size.is_empty() || size.len() > 15 || !size.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!("chunk size line {line:?}"));
        }
        let n = usize::from_str_radix(size, 16).unwrap();
        b = &b[eol + 2..];
        if n == 0 {
            // Trailers, then an empty line.
            loop {
                let Some(eol) = find(b, b"\r\n") else { return Ok(None) };
                let done = eol == 0;
                b = &b[eol + 2..];
                if done {
                    return Ok(Some((body, total - b.len())));
                }
            }
        }
        if b.len() < n + 2 {
            return Ok(None);
        }
        if &b[n..n + 2] != b"\r\n" {
            return Err("chunk data not followed by CRLF".into());
        }
        body.extend_from_slice(&b[..n]);
        b = &b[n + 2..];
    }
}

fn show(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

// === the corpus ===

/// What RFC 9112 makes of an input.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Must be refused with a 4xx (or a 501: a coding usher does not
    /// forward); nothing may reach the upstream.
    Reject,
    /// Bad framing inside the body, found only while the body streams: a 400,
    /// and the upstream gets no complete request (at most one cut off by EOF).
    RejectBody,
    /// Must be forwarded as these (method, path, body) requests, in order.
    Forward(&'static [(&'static str, &'static str, &'static str)]),
    /// Either refused, or forwarded as these requests.
    Either(&'static [(&'static str, &'static str, &'static str)]),
    /// Refused with this status; nothing may reach the upstream.
    Status(u16),
    /// These requests forwarded and answered, then the next refused with
    /// this status (and nothing more forwarded).
    ForwardThenStatus(&'static [(&'static str, &'static str, &'static str)], u16),
}

const HELLO: &[(&str, &str, &str)] = &[("POST", "/x", "hello")];
const EMPTY_POST: &[(&str, &str, &str)] = &[("POST", "/x", "")];
const GET: &[(&str, &str, &str)] = &[("GET", "/x", "")];

/// (name, raw bytes sent by the client, what must happen).
fn corpus() -> Vec<(&'static str, Vec<u8>, Expect)> {
    let h = "POST /x HTTP/1.1\r\nHost: api.test\r\n";
    let c = |s: &str| s.as_bytes().to_vec();
    let long_ext = format!("{h}Transfer-Encoding: chunked\r\n\r\n5;{}\r\nhello\r\n0\r\n\r\n", "a=b;".repeat(20_000));
    vec![
        // Content-Length
        ("valid content-length", c(&format!("{h}Content-Length: 5\r\n\r\nhello")), Expect::Forward(HELLO)),
        (
            "duplicate equal content-length",
            c(&format!("{h}Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello")),
            Expect::Either(HELLO),
        ),
        (
            "conflicting content-length",
            c(&format!("{h}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")),
            Expect::Reject,
        ),
        (
            "content-length list of equal values",
            c(&format!("{h}Content-Length: 5, 5\r\n\r\nhello")),
            Expect::Either(HELLO),
        ),
        (
            "content-length list of different values",
            c(&format!("{h}Content-Length: 5, 6\r\n\r\nhello!")),
            Expect::Reject,
        ),
        ("content-length +5", c(&format!("{h}Content-Length: +5\r\n\r\nhello")), Expect::Reject),
        ("content-length -5", c(&format!("{h}Content-Length: -5\r\n\r\nhello")), Expect::Reject),
        ("content-length 0x5", c(&format!("{h}Content-Length: 0x5\r\n\r\nhello")), Expect::Reject),
        ("content-length 5 5", c(&format!("{h}Content-Length: 5 5\r\n\r\nhello")), Expect::Reject),
        ("content-length empty", c(&format!("{h}Content-Length: \r\n\r\nhello")), Expect::Reject),
        ("content-length 5.0", c(&format!("{h}Content-Length: 5.0\r\n\r\nhello")), Expect::Reject),
        (
            "content-length overflow",
            c(&format!("{h}Content-Length: 99999999999999999999999\r\n\r\nhello")),
            Expect::Reject,
        ),
        ("content-length with space before colon", c(&format!("{h}Content-Length : 5\r\n\r\nhello")), Expect::Reject),
        ("content-length with a vertical tab", c(&format!("{h}Content-Length:\x0b5\r\n\r\nhello")), Expect::Reject),
        // Content-Length named hop-by-hop by Connection: the body must stay framed.
        (
            "connection names content-length",
            c(&format!("{h}Connection: content-length\r\nContent-Length: 5\r\n\r\nhello")),
            Expect::Forward(HELLO),
        ),
        (
            "connection names content-length, request hidden in the body",
            c(&format!(
                "{h}Connection: keep-alive, Content-Length\r\nContent-Length: 42\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n"
            )),
            Expect::Forward(&[("POST", "/x", "GET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n")]),
        ),
        // Transfer-Encoding
        (
            "valid chunked",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Forward(HELLO),
        ),
        (
            "chunked, identity",
            c(&format!("{h}Transfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Reject,
        ),
        ("xchunked", c(&format!("{h}Transfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")), Expect::Reject),
        ("chunkedx", c(&format!("{h}Transfer-Encoding: chunkedx\r\n\r\n5\r\nhello\r\n0\r\n\r\n")), Expect::Reject),
        ("gzip alone", c(&format!("{h}Transfer-Encoding: gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n")), Expect::Reject),
        // A coding before `chunked` would be dropped unseen (the upstream got
        // gzip bytes as a plain body): 501 (RFC 9112 §6.1).
        (
            "gzip, chunked",
            c(&format!("{h}Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Status(501),
        ),
        (
            "gzip then chunked on two lines",
            c(&format!("{h}Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Status(501),
        ),
        (
            "chunked twice on two lines",
            c(&format!("{h}Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Either(HELLO),
        ),
        (
            "chunked then identity on two lines",
            c(&format!("{h}Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Reject,
        ),
        (
            "te with odd leading whitespace",
            c(&format!("{h}Transfer-Encoding:   \tchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Either(HELLO),
        ),
        (
            "te with a vertical tab",
            c(&format!("{h}Transfer-Encoding:\x0bchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Reject,
        ),
        (
            "te with space before colon",
            c(&format!("{h}Transfer-Encoding : chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Reject,
        ),
        (
            "te upper case CHUNKED",
            c(&format!("{h}Transfer-Encoding: CHUNKED\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Either(HELLO),
        ),
        // CL.TE and TE.CL: Transfer-Encoding wins; then the connection must close,
        // so a second request hidden after the chunked body is never served.
        (
            "te and cl, smuggled GET after the chunks",
            c(&format!(
                "{h}Content-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n"
            )),
            Expect::Either(EMPTY_POST),
        ),
        (
            "cl and te, smuggled GET after the chunks",
            c(&format!(
                "{h}Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n"
            )),
            Expect::Either(EMPTY_POST),
        ),
        (
            "te.cl: cl shorter than the chunks",
            c(&format!("{h}Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::Either(HELLO),
        ),
        (
            "te in HTTP/1.0",
            c("POST /x HTTP/1.0\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
            Expect::Reject,
        ),
        (
            "te and cl in HTTP/1.0",
            c("POST /x HTTP/1.0\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello"),
            Expect::Reject,
        ),
        // Chunk sizes and extensions
        (
            "chunk size overflow",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\nffffffffffffffff1\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "chunk size 2^64",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n10000000000000000\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "chunk size with 0x",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "negative chunk size",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "chunk data longer than its size",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "small chunk extension",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n5;name=value\r\nhello\r\n0\r\n\r\n")),
            Expect::Forward(HELLO),
        ),
        ("huge chunk extension", c(&long_ext), Expect::Reject),
        (
            "chunk extension with a bare LF",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n5;a=\"x\ny\"\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "chunk with a bare LF after the size",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n")),
            Expect::Either(HELLO),
        ),
        (
            "last chunk with trailers",
            c(&format!("{h}Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n")),
            Expect::Forward(HELLO),
        ),
        // obs-fold, bare LF and CR, injected control bytes
        ("obs-fold", c(&format!("{h}X-Folded: a\r\n b\r\nContent-Length: 5\r\n\r\nhello")), Expect::Either(HELLO)),
        ("obs-fold continuing content-length", c(&format!("{h}Content-Length: 0\r\n 5\r\n\r\nhello")), Expect::Reject),
        (
            "obs-fold continuing transfer-encoding",
            c(&format!("{h}Transfer-Encoding: identity\r\n chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
            Expect::RejectBody,
        ),
        (
            "bare LF line endings",
            c("POST /x HTTP/1.1\nHost: api.test\nContent-Length: 5\n\nhello"),
            Expect::Either(HELLO),
        ),
        ("bare CR line endings", c("POST /x HTTP/1.1\rHost: api.test\rContent-Length: 5\r\rhello"), Expect::Reject),
        ("bare CR inside a header value", c(&format!("{h}X-A: a\rContent-Length: 5\r\n\r\nhello")), Expect::Reject),
        ("NUL inside a header value", c(&format!("{h}X-A: a\0b\r\nContent-Length: 5\r\n\r\nhello")), Expect::Reject),
        (
            "LF inside a header value starts a new field",
            c(&format!("{h}X-A: a\nContent-Length: 5\r\n\r\nhello")),
            Expect::Either(HELLO),
        ),
        ("header name with a space", c(&format!("{h}X A: b\r\nContent-Length: 5\r\n\r\nhello")), Expect::Reject),
        // Request line oddities
        (
            "absolute-form names another host than Host",
            c("GET http://evil.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n"),
            Expect::Reject,
        ),
        (
            "absolute-form wins over Host",
            c("GET http://api.test/x HTTP/1.1\r\nHost: evil.test\r\n\r\n"),
            Expect::Either(GET),
        ),
        ("two Host headers", c("GET /x HTTP/1.1\r\nHost: api.test\r\nHost: evil.test\r\n\r\n"), Expect::Reject),
        ("no Host in HTTP/1.1", c("GET /x HTTP/1.1\r\n\r\n"), Expect::Status(400)),
        // RFC 9112 §3.2: a Host that is not host[:port] is a 400.
        ("Host with a port that is no number", c("GET /x HTTP/1.1\r\nHost: api.test:abc\r\n\r\n"), Expect::Status(400)),
        ("Host with a port over 65535", c("GET /x HTTP/1.1\r\nHost: api.test:65536\r\n\r\n"), Expect::Status(400)),
        ("Host with user info", c("GET /x HTTP/1.1\r\nHost: evil@api.test\r\n\r\n"), Expect::Status(400)),
        ("Host with two ports", c("GET /x HTTP/1.1\r\nHost: api.test:1:2\r\n\r\n"), Expect::Status(400)),
        ("Host with a port", c("GET /x HTTP/1.1\r\nHost: api.test:65535\r\n\r\n"), Expect::Forward(GET)),
        // An HTTP/2 upgrade would take the requests after it past usher: it is stripped.
        (
            "h2c upgrade with HTTP2-Settings",
            c(
                "GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
            ),
            Expect::Forward(GET),
        ),
        (
            "h2c upgrade without HTTP2-Settings",
            c("GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"),
            Expect::Forward(GET),
        ),
        (
            "h2c upgrade then HTTP/2 bytes",
            c(
                "GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: H2C\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            ),
            Expect::Either(GET),
        ),
        ("tab in the request line", c("GET\t/x HTTP/1.1\r\nHost: api.test\r\n\r\n"), Expect::Reject),
        ("HTTP/1.2", c("GET /x HTTP/1.2\r\nHost: api.test\r\n\r\n"), Expect::Reject),
        ("space in the target", c("GET /x y HTTP/1.1\r\nHost: api.test\r\n\r\n"), Expect::Reject),
        // A head already malformed is answered at once, not when (if ever) it
        // ends: hyper parses a partial head again only once it ends in an
        // empty line, so these went unanswered until the header timeout.
        (
            "malformed head that never ends",
            c("GET /x HTTP/1.1\r\nHost: api.test\r\nX-Case: A\r\0\0\0"),
            Expect::Status(400),
        ),
        (
            "malformed head that never ends, after an answered request",
            c("GET /x HTTP/1.1\r\nHost: api.test\r\n\r\nGET /y HTTP/1.1\r\nHost: api.test\r\nX-Case: A\r\0\0\0"),
            Expect::ForwardThenStatus(GET, 400),
        ),
        // A second request hidden in a body is body, not a request.
        (
            "request hidden in a content-length body",
            c(&format!("{h}Content-Length: 42\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n")),
            Expect::Forward(&[("POST", "/x", "GET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n")]),
        ),
        (
            "request hidden in a chunked body",
            c(&format!(
                "{h}Transfer-Encoding: chunked\r\n\r\n2a\r\nGET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n\r\n0\r\n\r\n"
            )),
            Expect::Forward(&[("POST", "/x", "GET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n")]),
        ),
        (
            "honest pipelining",
            c(&format!("{h}Content-Length: 5\r\n\r\nhelloGET /x HTTP/1.1\r\nHost: api.test\r\n\r\n")),
            Expect::Forward(&[("POST", "/x", "hello"), ("GET", "/x", "")]),
        ),
    ]
}

// === the test ===

async fn sidecar(upstream: SocketAddr, http1: Http1) -> (SocketAddr, CancellationToken) {
    let yaml = format!(
        "limits: {{ header_timeout: 1s }}\n\
         upstreams:\n  up: {{ url: \"http://{upstream}\" }}\n\
         routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up }}\n"
    );
    let cfg = RoutesConfig::parse("smuggling.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    let (clock, _handle) = Clock::manual(Time::from_secs(1_000_000));
    let proxy = Proxy::new(cfg, "smuggling.yaml".into(), clock, prometheus::Registry::new()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve_with(proxy, listener, stop.clone(), Duration::from_secs(1), http1));
    (addr, stop)
}

/// Sends `raw`, reads until the sidecar closes (at most 10 s), and returns
/// the status codes of the responses in order.
async fn exchange(addr: SocketAddr, raw: &[u8]) -> (Vec<u16>, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = show(&got);
    (response_statuses(&got), text)
}

/// The status of each response in `b`, framed by Content-Length or chunked.
fn response_statuses(mut b: &[u8]) -> Vec<u16> {
    let mut out = Vec::new();
    while let Some(end) = find(b, b"\r\n\r\n") {
        let head = show(&b[..end]).to_ascii_lowercase();
        let Some(status) = head.get(9..12).and_then(|s| s.parse().ok()) else { break };
        out.push(status);
        b = &b[end + 4..];
        let len =
            head.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok()));
        if let Some(n) = len {
            b = &b[n.min(b.len())..];
        } else if head.contains("transfer-encoding: chunked") {
            match dechunk_strict(b) {
                Ok(Some((_, n))) => b = &b[n..],
                _ => break,
            }
        }
    }
    out
}

/// Waits until the recorder has received nothing new for 300 ms (at most 5 s).
async fn settle(rec: &Recorder) {
    let start = Instant::now();
    let mut last = (rec.bytes(), Instant::now());
    while start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = rec.bytes();
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() >= Duration::from_millis(300) {
            return;
        }
    }
}

/// Checks one case; `Err` describes what went wrong.
async fn run_case(name: &'static str, raw: Vec<u8>, expect: Expect, http1: Http1) -> Result<(), String> {
    let rec = Recorder::start().await;
    let (addr, stop) = sidecar(rec.addr, http1).await;
    let (statuses, text) = exchange(addr, &raw).await;
    settle(&rec).await;
    stop.cancel();
    let r = rec.record.lock().unwrap();
    let upstream_raw: Vec<String> = r.raw.iter().map(|b| show(b)).collect();
    let ctx = || {
        format!(
            "{name} ({http1:?}): client got {statuses:?} ({text:?}); upstream got {upstream_raw:?}; problems {:?}",
            r.problems
        )
    };
    let cut_off = |p: &String| p.starts_with("connection closed inside a request");
    if !r.problems.iter().all(|p| matches!(expect, Expect::RejectBody) && cut_off(p)) {
        return Err(format!("ambiguous or partial request reached the upstream; {}", ctx()));
    }
    let forwarded: Vec<(String, String, Vec<u8>)> =
        r.requests.iter().map(|s| (s.method.clone(), s.target.clone(), s.body.clone())).collect();
    let matches = |want: &[(&str, &str, &str)], statuses: &[u16]| {
        forwarded.len() == want.len()
            && forwarded.iter().zip(want).all(|((m, t, b), (wm, wt, wb))| m == wm && t == wt && b == wb.as_bytes())
            && statuses.len() == want.len()
            && statuses.iter().all(|s| *s == 200)
    };
    let rejected = forwarded.is_empty()
        && upstream_raw.iter().all(String::is_empty)
        && !statuses.is_empty()
        && ((400..500).contains(&statuses[0]) || statuses[0] == 501);
    // Nothing may ask the upstream to switch to HTTP/2: what follows would bypass usher.
    if let Some(s) = r.requests.iter().find(|s| {
        s.headers
            .iter()
            .any(|(k, v)| k == "http2-settings" || (k == "upgrade" && v.to_ascii_lowercase().contains("h2c")))
    }) {
        return Err(format!("an HTTP/2 upgrade reached the upstream: {s:?}; {}", ctx()));
    }
    let ok = match expect {
        Expect::Reject => rejected,
        Expect::Status(want) => rejected && statuses[0] == want,
        Expect::RejectBody => forwarded.is_empty() && statuses == [400],
        Expect::Forward(want) => matches(want, &statuses),
        Expect::Either(want) => rejected || matches(want, &statuses),
        Expect::ForwardThenStatus(want, status) => {
            statuses.split_last().is_some_and(|(last, answered)| *last == status && matches(want, answered))
        }
    };
    if ok { Ok(()) } else { Err(format!("expected {expect:?}; {}", ctx())) }
}

/// Every input through both HTTP/1.1 engines: the native path (and hyper,
/// where it hands a request over) and hyper alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_framing_is_refused_or_forwarded_exactly() {
    let mut tasks = Vec::new();
    for http1 in [Http1::Native, Http1::Hyper] {
        for (name, raw, expect) in corpus() {
            tasks.push(tokio::spawn(run_case(name, raw, expect, http1)));
        }
    }
    let total = tasks.len();
    let mut failures = Vec::new();
    for t in tasks {
        if let Err(e) = tokio::time::timeout(Duration::from_secs(60), t).await.expect("case finished").unwrap() {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} inputs got through ambiguously:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// The strict parser itself catches what it must, so a lenient upstream view
/// cannot hide a smuggled request.
#[test]
fn the_recorder_is_strict() {
    assert!(matches!(parse_strict(b"GET / HTTP/1.1\r\nA: b\r\n\r\n"), Parsed::Complete(..)));
    assert!(matches!(
        parse_strict(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"),
        Parsed::Bad(_)
    ));
    assert!(matches!(parse_strict(b"GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n"), Parsed::Bad(_)));
    assert!(matches!(parse_strict(b"GET / HTTP/1.1\r\nContent-Length: +1\r\n\r\nx"), Parsed::Bad(_)));
    assert!(matches!(parse_strict(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nx"), Parsed::Partial));
    match parse_strict(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\nGET") {
        Parsed::Complete(s, used) => {
            assert_eq!(s.body, b"ab");
            assert_eq!(used, 59);
        }
        _ => panic!("chunked body not parsed"),
    }
}
