//! HTTP/1.1 messages, parsed strictly: requests as the scripted upstream
//! reads them ([`Seen`]), responses as the client reads them ([`Resp`]),
//! chunked bodies, and header sections compared as multisets.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Reads from `s` until a request head is in (`None`: it closed or failed first): the bytes read.
pub(crate) async fn read_head(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while find(&got, b"\r\n\r\n").is_none() {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    Some(got)
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Header fields as sent: names as they were written, values with bytes
/// outside printable ASCII escaped (so equal bytes compare equal).
pub(crate) type Fields = Vec<(String, String)>;

fn fields_of(headers: &[httparse::Header<'_>]) -> Fields {
    headers.iter().map(|h| (h.name.to_string(), h.value.escape_ascii().to_string())).collect()
}

pub(crate) fn field<'a>(fields: &'a Fields, name: &str) -> Option<&'a str> {
    fields.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

fn is_chunked(fields: &Fields) -> bool {
    fields
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked"))
}

fn content_length(fields: &Fields) -> Result<Option<usize>, String> {
    let mut found = None;
    for (n, v) in fields.iter().filter(|(n, _)| n.eq_ignore_ascii_case("content-length")) {
        let len = v.trim().parse::<usize>().map_err(|e| format!("bad {n}: {v:?}: {e}"))?;
        if found.is_some_and(|f| f != len) {
            return Err(format!("conflicting content-length values in {fields:?}"));
        }
        found = Some(len);
    }
    Ok(found)
}

/// A header section as a sorted multiset of (lower-case name, value), with
/// `date` values (whichever clock wrote them) as a placeholder.
pub(crate) fn multiset(fields: &Fields) -> Fields {
    let mut out: Fields = fields
        .iter()
        .map(|(n, v)| {
            let n = n.to_ascii_lowercase();
            let v = if n == "date" { "<date>".to_string() } else { v.clone() };
            (n, v)
        })
        .collect();
    out.sort();
    out
}

/// A de-chunked body: its data, its trailer lines, and the bytes it took.
type Dechunked = (Vec<u8>, Vec<String>, usize);

/// A chunked body at the front of `buf`, or `None` while incomplete.
/// Chunk extensions are read and dropped.
fn dechunk(buf: &[u8]) -> Result<Option<Dechunked>, String> {
    let mut at = 0;
    let mut data = Vec::new();
    // Every round consumes at least a line: bounded by the buffer's length.
    loop {
        let Some(eol) = find(&buf[at..], b"\r\n") else { return Ok(None) };
        let line = &buf[at..at + eol];
        let digits = line.split(|&b| b == b';').next().unwrap_or_default();
        let size = std::str::from_utf8(digits)
            .ok()
            .and_then(|d| usize::from_str_radix(d.trim(), 16).ok())
            .ok_or_else(|| format!("bad chunk size line {:?}", line.escape_ascii().to_string()))?;
        at += eol + 2;
        if size == 0 {
            let mut trailers = Vec::new();
            loop {
                let Some(eol) = find(&buf[at..], b"\r\n") else { return Ok(None) };
                let line = &buf[at..at + eol];
                at += eol + 2;
                if line.is_empty() {
                    return Ok(Some((data, trailers, at)));
                }
                trailers.push(line.escape_ascii().to_string());
            }
        }
        if buf.len() < at + size + 2 {
            return Ok(None);
        }
        data.extend_from_slice(&buf[at..at + size]);
        if &buf[at + size..at + size + 2] != b"\r\n" {
            return Err(format!("chunk data not followed by CRLF: {:?}", buf.escape_ascii().to_string()));
        }
        at += size + 2;
    }
}

/// One request as the scripted upstream read it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// Which accepted connection (0, 1, ...) and which request on it (0, 1, ...).
    pub(crate) conn: usize,
    pub(crate) nth: usize,
    pub(crate) request_line: String,
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: Fields,
    /// De-chunked when it came chunked.
    pub(crate) body: Vec<u8>,
}

impl Seen {
    pub(crate) fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    /// Whether the header `name` came with exactly this spelling.
    pub(crate) fn has_name(&self, name: &str) -> bool {
        self.headers.iter().any(|(n, _)| n == name)
    }
}

/// The request at the front of `buf` and its length, or `None` while incomplete.
pub(crate) fn parse_request(buf: &[u8]) -> Result<Option<(Seen, usize)>, String> {
    let mut storage = [httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut storage);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("bad request head ({e}): {:?}", buf.escape_ascii().to_string())),
    };
    let headers = fields_of(req.headers);
    let line_end = find(buf, b"\r\n").expect("a complete head has a first line");
    let request_line = String::from_utf8_lossy(&buf[..line_end]).into_owned();
    let rest = &buf[head_len..];
    let (body, used) = if is_chunked(&headers) {
        match dechunk(rest)? {
            Some((data, _, used)) => (data, used),
            None => return Ok(None),
        }
    } else {
        let n = content_length(&headers)?.unwrap_or(0);
        if rest.len() < n {
            return Ok(None);
        }
        (rest[..n].to_vec(), n)
    };
    let seen = Seen {
        conn: 0,
        nth: 0,
        request_line,
        method: req.method.unwrap_or_default().to_string(),
        target: req.path.unwrap_or_default().to_string(),
        headers,
        body,
    };
    Ok(Some((seen, head_len + used)))
}

/// A response as the client read it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Resp {
    /// 1 for HTTP/1.1, 0 for HTTP/1.0.
    pub(crate) version: u8,
    pub(crate) status: u16,
    pub(crate) reason: String,
    pub(crate) headers: Fields,
    /// De-chunked when it came chunked.
    pub(crate) body: Vec<u8>,
    pub(crate) trailers: Vec<String>,
    /// Interim (1xx) statuses before it.
    pub(crate) interim: Vec<u16>,
}

impl Resp {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        field(&self.headers, name)
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

pub(crate) enum ParsedResp {
    Partial,
    Interim(u16, usize),
    Final(Resp, usize),
}

/// The response at the front of `buf` (to a HEAD request when `head_request`);
/// `eof` when no more bytes will come, which ends a close-delimited body.
pub(crate) fn parse_response(buf: &[u8], head_request: bool, eof: bool) -> Result<ParsedResp, String> {
    let mut storage = [httparse::EMPTY_HEADER; 100];
    let mut resp = httparse::Response::new(&mut storage);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(ParsedResp::Partial),
        Err(e) => return Err(format!("bad response head ({e}): {:?}", buf.escape_ascii().to_string())),
    };
    let status = resp.code.unwrap_or_default();
    if (100..200).contains(&status) && status != 101 {
        return Ok(ParsedResp::Interim(status, head_len));
    }
    let headers = fields_of(resp.headers);
    let rest = &buf[head_len..];
    let (body, trailers, used) = if head_request || status == 204 || status == 304 {
        (Vec::new(), Vec::new(), 0)
    } else if is_chunked(&headers) {
        match dechunk(rest)? {
            Some(d) => d,
            None => return Ok(ParsedResp::Partial),
        }
    } else if let Some(n) = content_length(&headers)? {
        if rest.len() < n {
            return Ok(ParsedResp::Partial);
        }
        (rest[..n].to_vec(), Vec::new(), n)
    } else if eof {
        (rest.to_vec(), Vec::new(), rest.len())
    } else {
        return Ok(ParsedResp::Partial);
    };
    let resp = Resp {
        version: resp.version.unwrap_or_default(),
        status,
        reason: resp.reason.unwrap_or_default().to_string(),
        headers,
        body,
        trailers,
        interim: Vec::new(),
    };
    Ok(ParsedResp::Final(resp, head_len + used))
}

/// Bytes shown as escaped text, so a failing case reads as the bytes on the
/// wire; a long run by its start and length.
pub(crate) fn shown(body: &[u8]) -> String {
    if body.len() <= 160 {
        return body.escape_ascii().to_string();
    }
    format!("{}... ({} bytes)", body[..80].escape_ascii(), body.len())
}
