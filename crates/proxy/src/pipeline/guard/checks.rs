//! The guard's checks on a request's head, as hyper read it: not a loop (a
//! `Via` of ours), one `Host` at most, a valid one, and on HTTP/1.1 one at
//! least unless the target names the host (RFC 9112 §3.2: a 400), no coding
//! but `chunked`; and no HTTP/2 upgrade (`Upgrade: h2c`), which is stripped.
//! The declared body's length is the engine's to check
//! ([`Inbound::guard`](crate::pipeline::Inbound::guard)).
//!
//! Why strip h2c rather than refuse it: the requests that would follow an
//! upgrade are HTTP/2 on the upstream connection, where usher no longer sees
//! them (no routing, no admission, no `Via`), so the upgrade must never reach
//! the upstream. RFC 9110 §7.8 lets a server ignore `Upgrade`, and clients
//! that offer h2c (`curl --http2` on an `http://` URL) carry on in HTTP/1.1
//! when it is ignored; refusing would break them for nothing. `HTTP2-Settings`
//! goes with it (RFC 9113 §3.2.1: it belongs to that connection).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Version};

use usher_enforce::respond::ProxyError;

/// Marks requests usher forwarded, so a route pointing back at usher is caught.
pub(crate) const VIA: &str = "1.1 usher";

/// The field that carries an h2c upgrade's HTTP/2 settings (RFC 9113 §3.2.1).
const HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// Checks a request's head; the error is what the client gets.
pub(crate) fn check<B>(req: &Request<B>) -> Result<(), ProxyError> {
    let headers = req.headers();
    if headers.get_all(header::VIA).iter().any(|v| v.to_str().is_ok_and(|v| v.contains(VIA))) {
        return Err(ProxyError::Loop);
    }
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        // RFC 9110 §7.2: more than one Host is a 400, whatever routing would make of it.
        (Some(_), Some(_)) => return Err(ProxyError::BadRequest("more than one Host header".into())),
        // RFC 9112 §3.2: a Host that is not `host[:port]` is a 400 too (an
        // empty one is allowed: a target with no authority).
        (Some(v), None) if !v.is_empty() && !valid_host(v.as_bytes()) => {
            return Err(ProxyError::BadRequest(format!(
                "the Host header {:?} is not host[:port] (RFC 9112 §3.2)",
                String::from_utf8_lossy(v.as_bytes())
            )));
        }
        // An absolute-form target (or CONNECT's authority) names the host
        // itself, and a proxy goes by it (RFC 9112 §3.2.2): only a request
        // that names no host at all is refused.
        (None, _) if req.version() == Version::HTTP_11 && req.uri().authority().is_none() => {
            return Err(ProxyError::BadRequest("an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)".into()));
        }
        _ => {}
    }
    // Framing (the last coding, `chunked`) is hyper's; a coding before it
    // would be dropped unseen when usher frames the body for the upstream.
    for v in headers.get_all(header::TRANSFER_ENCODING) {
        let codings = String::from_utf8_lossy(v.as_bytes());
        if let Some(other) =
            codings.split(',').map(str::trim).find(|c| !c.is_empty() && !c.eq_ignore_ascii_case("chunked"))
        {
            return Err(ProxyError::UnsupportedCoding(other.chars().take(64).collect()));
        }
    }
    Ok(())
}

/// Whether a Host value is `uri-host [":" port]` (RFC 9110 §7.2): an
/// authority without user info, whose port, if any, is a number up to 65535.
fn valid_host(v: &[u8]) -> bool {
    let port = match v.strip_prefix(b"[") {
        // An IP literal: whatever follows its `]`.
        Some(rest) => rest.iter().position(|&b| b == b']').map(|end| &rest[end + 1..]),
        None => Some(v.iter().position(|&b| b == b':').map_or(&b""[..], |i| &v[i..])),
    };
    let port_ok = |p: &[u8]| match p.strip_prefix(b":") {
        // An empty port is allowed (RFC 3986 §3.2.3), a number only up to 65535.
        Some(digits) => {
            digits.iter().all(u8::is_ascii_digit)
                && (digits.len() < 5 || (digits.len() == 5 && digits <= &b"65535"[..]))
        }
        None => p.is_empty(),
    };
    !v.contains(&b'@') && port.is_some_and(port_ok) && http::uri::Authority::try_from(v).is_ok()
}

/// Removes an offer to switch to HTTP/2 (`h2c`) from `Upgrade` (and the
/// field itself, and its `Connection` token, when nothing else is offered),
/// and `HTTP2-Settings`. Returns whether anything was removed.
pub(crate) fn strip_h2c(headers: &mut HeaderMap) -> bool {
    let settings = headers.remove(HTTP2_SETTINGS).is_some();
    if !headers.contains_key(header::UPGRADE) {
        return settings;
    }
    let mut offered = Vec::new();
    let mut h2c = false;
    for v in headers.get_all(header::UPGRADE) {
        for token in v.to_str().unwrap_or_default().split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let name = token.split('/').next().unwrap_or_default();
            if name.eq_ignore_ascii_case("h2c") {
                h2c = true;
            } else {
                offered.push(token.to_string());
            }
        }
    }
    if !h2c {
        return settings;
    }
    headers.remove(header::UPGRADE);
    if offered.is_empty() {
        let kept: Vec<String> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| {
                !t.is_empty() && !t.eq_ignore_ascii_case("upgrade") && !t.eq_ignore_ascii_case("http2-settings")
            })
            .map(str::to_string)
            .collect();
        headers.remove(header::CONNECTION);
        if let Ok(v) = HeaderValue::from_str(&kept.join(", "))
            && !kept.is_empty()
        {
            headers.insert(header::CONNECTION, v);
        }
    } else if let Ok(v) = HeaderValue::from_str(&offered.join(", ")) {
        headers.insert(header::UPGRADE, v);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        fields
            .iter()
            .map(|(n, v)| (HeaderName::from_bytes(n.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap()))
            .collect()
    }

    #[test]
    fn an_h2c_offer_is_stripped_and_other_upgrades_kept() {
        let mut h = headers(&[
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c"),
            ("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA"),
            ("x-kept", "1"),
        ]);
        assert!(strip_h2c(&mut h));
        assert_eq!(h.len(), 1, "{h:?}");
        let mut h = headers(&[("connection", "keep-alive, upgrade"), ("upgrade", "H2C, websocket")]);
        assert!(strip_h2c(&mut h));
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "keep-alive, upgrade");
        let mut h = headers(&[("connection", "upgrade"), ("upgrade", "websocket")]);
        assert!(!strip_h2c(&mut h));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn host_must_be_there_once_on_http_1_1() {
        let req = |version, hosts: &[&str]| {
            let mut b = Request::builder().uri("/x").version(version);
            for h in hosts {
                b = b.header("host", *h);
            }
            b.body(()).unwrap()
        };
        assert!(check(&req(Version::HTTP_11, &["a"])).is_ok());
        assert!(matches!(check(&req(Version::HTTP_11, &[])), Err(ProxyError::BadRequest(_))));
        assert!(matches!(check(&req(Version::HTTP_11, &["a", "b"])), Err(ProxyError::BadRequest(_))));
        assert!(check(&req(Version::HTTP_10, &[])).is_ok(), "HTTP/1.0 has no Host requirement");
        let absolute = Request::get("http://api.test/x").body(()).unwrap();
        assert!(check(&absolute).is_ok(), "the target names the host");
        assert!(check(&req(Version::HTTP_2, &[])).is_ok(), "HTTP/2 has :authority");
    }

    #[test]
    fn hosts_are_host_and_port() {
        for ok in ["a.test", "a.test:80", "a.test:", "a.test:65535", "127.0.0.1:8080", "[::1]", "[::1]:443", "a~b.test"]
        {
            assert!(valid_host(ok.as_bytes()), "{ok}");
        }
        for bad in ["a.test:abc", "a.test:65536", "a.test:123456", "a:1:2", "u@a.test", "::1", "[::1", "[::1]x", "a b"]
        {
            assert!(!valid_host(bad.as_bytes()), "{bad}");
        }
    }
}
