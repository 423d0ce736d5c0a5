//! Differential: the same client bytes through both HTTP/1.1 engines (the
//! native path, which hands to hyper what it does not serve, and hyper
//! alone), in front of one recording loopback upstream. What the upstream
//! received (each request's method, target, header fields and body) and
//! what the client got back (each response's status and body) must be the
//! same, up to the engines' documented differences (README, "How HTTP/1.1
//! is served"), which are normalised away here:
//! - header name case and order: fields are compared as a sorted,
//!   lower-cased list;
//! - a request with an empty body whose `Connection` names `Content-Length`:
//!   the native path keeps `content-length: 0`, hyper sends no length;
//! - the timing of a client that stops sending: each engine gets the whole
//!   input at once and is read until it has been quiet for a while.
//!
//! Every request is routed (there is no `default: deny` answer, whose timing
//! against a body still arriving is another documented difference), to an
//! upstream that answers every request at once.
#![no_main]

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usher_proxy::Http1;

use common::Sidecar;

/// One request as the upstream saw it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: String,
    target: String,
    fields: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

struct World {
    sidecar: Sidecar,
    seen: Arc<Mutex<Vec<Seen>>>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = common::runtime();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let addr = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(upstream(listener, seen.clone()));
            addr
        });
        let routes = format!(
            "limits: {{ header_timeout: 1s, max_body_bytes: 4KiB }}\n\
             upstreams:\n  up: {{ url: \"http://{addr}\", timeout: 2s }}\n\
             resources:\n  api: {{ kind: rate, capacity: 1000000/s, burst: 1000 }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [api] }}\n"
        );
        World { sidecar: Sidecar::new(rt, &routes), seen }
    })
}

/// Records each request (Content-Length or chunked framing) and answers it at once.
async fn upstream(listener: tokio::net::TcpListener, seen: Arc<Mutex<Vec<Seen>>>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else { return };
        let seen = seen.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            // Bounded: a connection carries at most this many reads.
            for _ in 0..1024 {
                while let Some((req, used)) = parse(&buf) {
                    buf.drain(..used);
                    seen.lock().unwrap().push(req);
                    if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.is_err() {
                        return;
                    }
                }
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        });
    }
}

/// A whole request at the front of `buf`, and its length.
fn parse(buf: &[u8]) -> Option<(Seen, usize)> {
    let mut headers = [httparse::EMPTY_HEADER; 256];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return None,
    };
    let mut fields: Vec<(String, Vec<u8>)> =
        req.headers.iter().map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec())).collect();
    let get = |n: &str| fields.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let (body, used) = if get("transfer-encoding").is_some() {
        dechunk(&buf[head..]).map(|(b, n)| (b, head + n))?
    } else {
        let len = get("content-length").and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<usize>().ok());
        let len = len.unwrap_or(0);
        if buf.len() < head + len {
            return None;
        }
        (buf[head..head + len].to_vec(), head + len)
    };
    // Documented: an empty body may come with `content-length: 0` or none.
    if body.is_empty() {
        fields.retain(|(k, v)| !(k == "content-length" && v == b"0"));
    }
    fields.sort();
    let seen = Seen {
        method: req.method.unwrap_or_default().to_string(),
        target: req.path.unwrap_or_default().to_string(),
        fields,
        body,
    };
    Some((seen, used))
}

fn dechunk(mut b: &[u8]) -> Option<(Vec<u8>, usize)> {
    let total = b.len();
    let mut body = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..eol]).ok()?.split(';').next()?.trim().to_string();
        let n = usize::from_str_radix(&size, 16).ok()?;
        b = &b[eol + 2..];
        if n == 0 {
            // Trailers, then an empty line.
            loop {
                let eol = b.windows(2).position(|w| w == b"\r\n")?;
                b = &b[eol + 2..];
                if eol == 0 {
                    return Some((body, total - b.len()));
                }
            }
        }
        if b.len() < n + 2 {
            return None;
        }
        body.extend_from_slice(&b[..n]);
        b = &b[n + 2..];
    }
}

/// The responses in `out`: each status and body (Content-Length, chunked,
/// or to the end), and whether the bytes ended inside one.
fn responses(mut out: &[u8]) -> (Vec<(u16, Vec<u8>)>, bool) {
    let mut got = Vec::new();
    while !out.is_empty() {
        let mut headers = [httparse::EMPTY_HEADER; 128];
        let mut resp = httparse::Response::new(&mut headers);
        let head = match resp.parse(out) {
            Ok(httparse::Status::Complete(n)) => n,
            _ => return (got, true),
        };
        let code = resp.code.unwrap_or(0);
        let field = |n: &str| resp.headers.iter().find(|h| h.name.eq_ignore_ascii_case(n)).map(|h| h.value);
        let chunked = field("transfer-encoding").is_some();
        let len = field("content-length").and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok());
        let (body, used) = if code < 200 || code == 204 || code == 304 {
            (Vec::new(), head)
        } else if chunked {
            match dechunk(&out[head..]) {
                Some((b, n)) => (b, head + n),
                None => return (got, true),
            }
        } else if let Some(len) = len {
            if out.len() < head + len {
                return (got, true);
            }
            (out[head..head + len].to_vec(), head + len)
        } else {
            (out[head..].to_vec(), out.len())
        };
        got.push((code, body));
        out = &out[used..];
    }
    (got, false)
}

/// Sends `data` on one connection served by `http1`, and reads until the
/// connection closes or has been quiet for a while.
fn run(w: &World, http1: Http1, data: &[u8]) -> (Vec<u8>, Vec<Seen>) {
    w.seen.lock().unwrap().clear();
    let out = w.sidecar.connection_on(http1, |mut client| async move {
        let _ = client.write_all(data).await;
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match tokio::time::timeout(Duration::from_millis(150), client.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        out
    });
    (out, std::mem::take(&mut *w.seen.lock().unwrap()))
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    let (native_out, native_seen) = run(w, Http1::Native, data);
    let (hyper_out, hyper_seen) = run(w, Http1::Hyper, data);
    assert_eq!(native_seen, hyper_seen, "the upstream received different requests");
    let (native, native_cut) = responses(&native_out);
    let (hyper, hyper_cut) = responses(&hyper_out);
    assert_eq!(
        (native, native_cut),
        (hyper, hyper_cut),
        "the client got different answers:\nnative: {:?}\nhyper:  {:?}",
        String::from_utf8_lossy(&native_out),
        String::from_utf8_lossy(&hyper_out)
    );
});
