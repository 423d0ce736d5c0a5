//! The one place errors become responses: a refusal becomes a 429 with
//! `Retry-After` (while the upstream's own `Retry-After` holds the key, the
//! rest of that hold) and `RateLimit-Policy`/`RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers-10), no route a 403, an upstream
//! failure a 502 or 504; all as `application/problem+json`, or as a
//! `grpc-status` for gRPC requests; an upstream body that fails after its
//! head was sent ends a gRPC response with trailers carrying `UNAVAILABLE`.
//!
//! On a route that leads to an API usher knows ([`ApiDialect`], decided by
//! `RoutesConfig::api_dialect`), the same answers take that API's error
//! shape instead of problem+json, with a message that starts `usher:`: the
//! API's SDK in the app raises its usual exception (a `RateLimitError` for
//! a 429) carrying usher's message, so the app's logs say what happened.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use serde_json::json;

pub use usher_core::config::routes::ApiDialect;
use usher_limit::admit::{Reason, Refused};
use usher_limit::{Kind, ceil_secs};

/// The error type the request path's services and bodies share.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the proxy sends.
pub type ProxyBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Errors of the request path, other than a refusal.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// No route matches the request (403).
    #[error("no route for {method} {host}{path}")]
    NoRoute {
        /// The request's method.
        method: String,
        /// The request's host.
        host: String,
        /// The request's path.
        path: String,
    },
    /// A CONNECT to a host no route names (403).
    #[error("CONNECT to {authority} is not allowed: no route names host `{host}`")]
    ConnectDenied {
        /// The CONNECT target, `host:port`.
        authority: String,
        /// Its host.
        host: String,
    },
    /// The upstream sent no response head in time (504).
    #[error("upstream `{upstream}` did not send response headers within {after:?}")]
    UpstreamTimeout {
        /// The upstream's name.
        upstream: String,
        /// How long it was given.
        after: Duration,
    },
    /// The client stopped sending its request body (408).
    #[error(
        "route `{route}`: the client stopped sending its request body (nothing for {after:?}, the upstream's timeout)"
    )]
    ClientStalled {
        /// The route's name.
        route: String,
        /// How long nothing came.
        after: Duration,
    },
    /// The native HTTP/1.1 path waits for a small body before it routes the
    /// request; this one did not come within `limits.header_timeout` (408).
    #[error("the client did not send its whole request body within {after:?} (limits.header_timeout)")]
    BodyTimeout {
        /// How long it was given.
        after: Duration,
    },
    /// No connection to the upstream could be made (502).
    #[error("cannot connect to upstream `{upstream}`: {reason}")]
    UpstreamConnect {
        /// The upstream's name.
        upstream: String,
        /// Why the connection failed.
        reason: String,
    },
    /// The upstream failed before its response head (502).
    #[error("upstream `{upstream}` failed before sending response headers: {reason}")]
    Upstream {
        /// The upstream's name.
        upstream: String,
        /// How it failed.
        reason: String,
    },
    /// The request already passed through usher (508).
    #[error("request loop: this request already passed through usher")]
    Loop,
    /// The request is malformed, or no lease id can be made of it (400).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The request body has a transfer coding other than chunked (501).
    #[error(
        "transfer coding `{0}` is not supported: usher forwards request bodies chunked or with a length, never otherwise coded (RFC 9112 §6.1)"
    )]
    UnsupportedCoding(String),
    /// The request body is over `limits.max_body_bytes` (413).
    #[error("request body larger than {limit} bytes (limits.max_body_bytes)")]
    BodyTooLarge {
        /// The most bytes a body may have.
        limit: u64,
    },
    /// A templated resource already tracks its `max_keys` ids (429).
    #[error(
        "resource `{resource}` already tracks {max_keys} distinct ids (its max_keys); this request would add another"
    )]
    TooManyKeys {
        /// The resource's name.
        resource: String,
        /// Its `max_keys`.
        max_keys: usize,
    },
}

impl From<usher_limit::table::KeyRefused> for ProxyError {
    fn from(e: usher_limit::table::KeyRefused) -> Self {
        use usher_limit::table::KeyRefused;
        match e {
            KeyRefused::Full { resource, max_keys } => ProxyError::TooManyKeys { resource, max_keys },
            e @ KeyRefused::TooLong { .. } => ProxyError::BadRequest(e.to_string()),
        }
    }
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute { .. } | ProxyError::ConnectDenied { .. } => StatusCode::FORBIDDEN,
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::ClientStalled { .. } | ProxyError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::UpstreamConnect { .. } | ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::Loop => StatusCode::LOOP_DETECTED,
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::UnsupportedCoding(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::TooManyKeys { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::NoRoute { .. } => "no-route",
            ProxyError::ConnectDenied { .. } => "connect-denied",
            ProxyError::UpstreamTimeout { .. } => "upstream-timeout",
            ProxyError::ClientStalled { .. } | ProxyError::BodyTimeout { .. } => "client-timeout",
            ProxyError::UpstreamConnect { .. } => "upstream-connect",
            ProxyError::Upstream { .. } => "upstream-error",
            ProxyError::Loop => "loop",
            ProxyError::BadRequest(_) => "bad-request",
            ProxyError::UnsupportedCoding(_) => "unsupported-transfer-coding",
            ProxyError::BodyTooLarge { .. } => "body-too-large",
            ProxyError::TooManyKeys { .. } => "too-many-keys",
        }
    }

    fn grpc_code(&self) -> u8 {
        match self {
            ProxyError::NoRoute { .. } | ProxyError::ConnectDenied { .. } => 7, // PERMISSION_DENIED
            ProxyError::UpstreamTimeout { .. } | ProxyError::ClientStalled { .. } | ProxyError::BodyTimeout { .. } => 4, // DEADLINE_EXCEEDED
            ProxyError::BadRequest(_) => 3, // INVALID_ARGUMENT
            ProxyError::TooManyKeys { .. } | ProxyError::BodyTooLarge { .. } => 8, // RESOURCE_EXHAUSTED
            _ => 14,                        // UNAVAILABLE
        }
    }

    fn upstream(&self) -> Option<&str> {
        match self {
            ProxyError::UpstreamTimeout { upstream, .. }
            | ProxyError::UpstreamConnect { upstream, .. }
            | ProxyError::Upstream { upstream, .. } => Some(upstream),
            _ => None,
        }
    }
}

/// The status of the answer to `e` (gRPC answers carry theirs in `grpc-status`).
pub fn status(e: &ProxyError, grpc: bool) -> StatusCode {
    if grpc { StatusCode::OK } else { e.status() }
}

/// The status of the answer to a refusal.
pub fn refused_status(grpc: bool) -> StatusCode {
    if grpc { StatusCode::OK } else { StatusCode::TOO_MANY_REQUESTS }
}

/// Whether a request is gRPC (`content-type: application/grpc*`).
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/grpc"))
}

/// The response for any error of the request path.
pub fn error_response(err: BoxError, grpc: bool) -> Response<ProxyBody> {
    let err = match err.downcast::<Refused>() {
        Ok(r) => return refused(&r, grpc),
        Err(e) => e,
    };
    match err.downcast::<ProxyError>() {
        Ok(e) => proxy_error(&e, grpc),
        Err(e) => proxy_error(&ProxyError::Upstream { upstream: "unknown".into(), reason: e.to_string() }, grpc),
    }
}

/// The answer to `e`: a problem+json body with its status, or for gRPC a
/// trailers-only response with its `grpc-status`.
pub fn proxy_error(e: &ProxyError, grpc: bool) -> Response<ProxyBody> {
    proxy_error_in(e, grpc, None)
}

/// The answer to `e` on a route whose API is `dialect`: as
/// [`proxy_error`], in that API's error shape when there is one.
pub fn proxy_error_in(e: &ProxyError, grpc: bool, dialect: Option<ApiDialect>) -> Response<ProxyBody> {
    if grpc {
        return grpc_status(e.grpc_code(), &e.to_string());
    }
    if let Some(d) = dialect {
        return api_error(d, e.status(), &format!("usher: {e}"), e.kind());
    }
    let status = e.status();
    let mut body = json!({
        "type": format!("urn:usher:problem:{}", e.kind()),
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": e.to_string(),
    });
    if let Some(u) = e.upstream() {
        body["upstream"] = json!(u);
    }
    problem(status, &body)
}

/// A structured-field string: quoted, with `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `RateLimit-Policy` and `RateLimit` field values for a refusal.
fn ratelimit_fields(r: &Refused) -> (String, String) {
    let name = sf_string(&r.resource);
    let policy = match r.kind {
        Kind::Gauge => format!("{name};q={};qu=\"concurrent-requests\"", r.quota.max(0.0).floor() as u64),
        Kind::Rate => {
            // q and w are Integers: a quota below one per window is written as one per longer window.
            let window = r.window.as_secs().max(1);
            if r.quota >= 1.0 {
                format!("{name};q={};w={window}", r.quota.floor() as u64)
            } else if r.quota > 0.0 {
                let per_sec = r.quota / r.window.as_secs_f64();
                format!("{name};q=1;w={}", (1.0 / per_sec).ceil() as u64)
            } else {
                format!("{name};q=0;w={window}")
            }
        }
    };
    let state = format!("{name};r={};t={}", r.remaining, ceil_secs(r.retry_after));
    (policy, state)
}

/// The answer to a refusal: `429` with `Retry-After`, `RateLimit-Policy`,
/// `RateLimit` and a problem+json body, or for gRPC `RESOURCE_EXHAUSTED`.
pub fn refused(r: &Refused, grpc: bool) -> Response<ProxyBody> {
    refused_in(r, None, grpc, None)
}

/// A refusal while the upstream's `Retry-After` holds a key of the request
/// for `hold` more: it says to come back when the hold ends, not sooner.
pub fn refused_held(r: &Refused, hold: Duration, grpc: bool) -> Response<ProxyBody> {
    refused_in(r, Some(hold), grpc, None)
}

/// The answer to a refusal ([`refused`], or [`refused_held`] with `hold`)
/// on a route whose API is `dialect`: in that API's error shape when there
/// is one, with the same status and headers.
pub fn refused_in(r: &Refused, hold: Option<Duration>, grpc: bool, dialect: Option<ApiDialect>) -> Response<ProxyBody> {
    match hold {
        Some(h) => refusal(&Refused { retry_after: r.retry_after.max(h), ..r.clone() }, hold, grpc, dialect),
        None => refusal(r, None, grpc, dialect),
    }
}

/// Why `r` was refused, as a predicate of its key: `has no capacity within ...`.
fn refusal_reason(r: &Refused, hold: Option<Duration>) -> String {
    match r.reason {
        Reason::Held => format!(
            "is held: its upstream asked to wait (Retry-After) {}, longer than max_wait {}",
            fmt_ms(hold.unwrap_or(r.retry_after)),
            fmt_ms(r.max_wait)
        ),
        _ if hold.is_some() => "is held: its upstream asked to wait (Retry-After)".to_string(),
        Reason::Exhausted => {
            format!("has no capacity within max_wait {}; waited {}", fmt_ms(r.max_wait), fmt_ms(r.waited))
        }
        Reason::QueueFull => "has too many requests waiting".to_string(),
        Reason::ZeroCapacity => format!(
            "has capacity 0{}; waited {}",
            r.why.map(|w| format!(" ({w})")).unwrap_or_default(),
            fmt_ms(r.waited)
        ),
    }
}

fn refusal(r: &Refused, hold: Option<Duration>, grpc: bool, dialect: Option<ApiDialect>) -> Response<ProxyBody> {
    let retry = ceil_secs(r.retry_after);
    let (policy, state) = ratelimit_fields(r);
    let reason = refusal_reason(r, hold);
    let detail = format!("resource `{}` (id `{}`) {reason}; retry in {retry} s", r.resource, r.id);
    let mut resp = if grpc {
        grpc_status(8, &detail)
    } else if let Some(d) = dialect {
        let message = format!(
            "usher: rate limit of resource `{}` reached on this replica; retry in {retry} s (id `{}` {reason})",
            r.resource, r.id
        );
        api_error(d, StatusCode::TOO_MANY_REQUESTS, &message, "rate-limited")
    } else {
        let mut body = json!({
            "type": "urn:usher:problem:rate-limited",
            "title": "Too Many Requests",
            "status": 429,
            "detail": detail,
            "resource": r.resource,
            "resource_id": r.id,
            "kind": r.kind,
            "waited_ms": r.waited.as_millis() as u64,
            "max_wait_ms": r.max_wait.as_millis() as u64,
            "retry_after_s": retry,
        });
        if let Some(h) = hold {
            body["upstream_hold_ms"] = json!(h.as_millis() as u64);
        }
        if let Some(why) = r.why {
            body["zero_capacity_reason"] = json!(why);
        }
        problem(StatusCode::TOO_MANY_REQUESTS, &body)
    };
    let h = resp.headers_mut();
    h.insert(header::RETRY_AFTER, HeaderValue::from(retry));
    if let Ok(v) = HeaderValue::from_str(&policy) {
        h.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&state) {
        h.insert("ratelimit", v);
    }
    resp
}

/// An error in `dialect`'s shape: its status, `message`, and the type and
/// code its SDK reads for that status (`kind`, usher's problem type, is
/// OpenAI's `code` where OpenAI has none of its own).
fn api_error(dialect: ApiDialect, status: StatusCode, message: &str, kind: &str) -> Response<ProxyBody> {
    let body = match dialect {
        // As OpenAI answers: `type` names the limit (`requests`, `tokens`), `code` is `rate_limit_exceeded`.
        ApiDialect::OpenAi => {
            let (kind, code) = match status {
                StatusCode::TOO_MANY_REQUESTS => ("requests", "rate_limit_exceeded".to_string()),
                s if s.is_server_error() => ("server_error", kind.replace('-', "_")),
                _ => ("invalid_request_error", kind.replace('-', "_")),
            };
            json!({ "error": { "message": message, "type": kind, "param": null, "code": code } })
        }
        ApiDialect::Anthropic => {
            let kind = match status {
                StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
                StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                s if s.is_server_error() => "api_error",
                _ => "invalid_request_error",
            };
            json!({ "type": "error", "error": { "type": kind, "message": message } })
        }
    };
    json_body(status, &body, "application/json")
}

fn fmt_ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

fn problem(status: StatusCode, body: &serde_json::Value) -> Response<ProxyBody> {
    json_body(status, body, "application/problem+json")
}

fn json_body(status: StatusCode, body: &serde_json::Value, content_type: &'static str) -> Response<ProxyBody> {
    let bytes = serde_json::to_vec(body).expect("JSON values serialise");
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// A trailers-only gRPC response carrying `code` and `message`.
pub fn grpc_status(code: u8, message: &str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(Vec::new()));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    grpc_fields(h, code, message);
    resp
}

/// The trailers a gRPC response body ends with when the upstream's body
/// failed after its head was sent (cut mid-stream): `UNAVAILABLE`, as a gRPC
/// client reports a connection lost mid-call, with the reason. A reset
/// stream would leave the client with only a transport error.
pub fn body_failed_trailers(route: &str, error: &dyn std::fmt::Display) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    grpc_fields(&mut h, 14, &format!("route `{route}`: the upstream's response body failed: {error}"));
    h
}

fn grpc_fields(h: &mut http::HeaderMap, code: u8, message: &str) {
    h.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(v) = HeaderValue::from_str(&grpc_percent_encode(message)) {
        h.insert("grpc-message", v);
    }
}

/// gRPC's percent-encoding of `grpc-message`: everything outside printable ASCII, and `%`.
fn grpc_percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A whole body of `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(kind: Kind, quota: f64, window: u64, retry_ms: u64) -> Refused {
        Refused {
            resource: "api-core".into(),
            id: "api/acme".into(),
            kind,
            reason: Reason::Exhausted,
            retry_after: Duration::from_millis(retry_ms),
            waited: Duration::from_millis(500),
            max_wait: Duration::from_millis(500),
            quota,
            window: Duration::from_secs(window),
            remaining: 0,
            why: None,
        }
    }

    #[test]
    fn ratelimit_fields_follow_the_draft() {
        assert_eq!(
            ratelimit_fields(&refusal(Kind::Rate, 3000.0, 60, 400)),
            ("\"api-core\";q=3000;w=60".to_string(), "\"api-core\";r=0;t=1".to_string())
        );
        assert_eq!(
            ratelimit_fields(&refusal(Kind::Gauge, 10.0, 1, 1000)).0,
            "\"api-core\";q=10;qu=\"concurrent-requests\""
        );
        assert_eq!(
            ratelimit_fields(&refusal(Kind::Rate, 0.25, 1, 2500)),
            ("\"api-core\";q=1;w=4".to_string(), "\"api-core\";r=0;t=3".to_string())
        );
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        for (ms, want) in [(0, "1"), (1, "1"), (400, "1"), (1000, "1"), (1001, "2"), (2500, "3")] {
            let resp = refused(&refusal(Kind::Rate, 5.0, 1, ms), false);
            assert_eq!(resp.headers()[header::RETRY_AFTER], want, "{ms} ms");
        }
    }

    #[test]
    fn a_refusal_during_an_upstream_hold_says_when_the_hold_ends() {
        let resp = refused_held(&refusal(Kind::Rate, 0.0, 1, 1000), Duration::from_millis(4200), false);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "5");
        assert_eq!(resp.headers()["ratelimit"], "\"api-core\";r=0;t=5");
        let resp = refused_held(&refusal(Kind::Rate, 0.0, 1, 1000), Duration::from_millis(300), false);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1", "never 0");
    }

    /// The JSON body of an answer made here (one frame, ready at once).
    fn body(resp: Response<ProxyBody>) -> serde_json::Value {
        use hyper::body::Body as _;
        let mut body = resp.into_body();
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let bytes = match std::pin::Pin::new(&mut body).poll_frame(&mut cx) {
            std::task::Poll::Ready(Some(Ok(f))) => f.into_data().unwrap(),
            _ => Bytes::new(),
        };
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn on_an_api_route_a_refusal_takes_the_apis_error_shape() {
        let r = refusal(Kind::Rate, 5.0, 1, 2500);
        let resp = refused_in(&r, None, false, Some(ApiDialect::OpenAi));
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
        assert_eq!(resp.headers()["ratelimit"], "\"api-core\";r=0;t=3");
        let message = "usher: rate limit of resource `api-core` reached on this replica; retry in 3 s \
                       (id `api/acme` has no capacity within max_wait 500ms; waited 500ms)";
        assert_eq!(
            body(resp),
            json!({"error": {"message": message, "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
        );
        let resp = refused_in(&r, Some(Duration::from_millis(4200)), false, Some(ApiDialect::Anthropic));
        assert_eq!(resp.headers()[header::RETRY_AFTER], "5");
        let b = body(resp);
        assert_eq!((&b["type"], &b["error"]["type"]), (&json!("error"), &json!("rate_limit_error")), "{b}");
        let m = b["error"]["message"].as_str().unwrap();
        assert!(m.starts_with("usher: rate limit of resource `api-core` reached on this replica; retry in 5 s"), "{m}");
        // gRPC stays gRPC, and without a dialect the body stays problem+json.
        assert_eq!(refused_in(&r, None, true, Some(ApiDialect::OpenAi)).headers()["grpc-status"], "8");
        let resp = refused_in(&r, None, false, None);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(
            body(resp)["detail"],
            "resource `api-core` (id `api/acme`) has no capacity within max_wait 500ms; waited 500ms; retry in 3 s"
        );
    }

    #[test]
    fn on_an_api_route_other_answers_take_its_error_shape_too() {
        let e = ProxyError::UpstreamTimeout { upstream: "llm".into(), after: Duration::from_secs(30) };
        let resp = proxy_error_in(&e, false, Some(ApiDialect::OpenAi));
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        let b = body(resp);
        assert_eq!(b["error"]["type"], "server_error");
        assert_eq!(b["error"]["code"], "upstream_timeout");
        assert_eq!(b["error"]["message"], "usher: upstream `llm` did not send response headers within 30s");
        let b = body(proxy_error_in(&ProxyError::BodyTooLarge { limit: 10 }, false, Some(ApiDialect::Anthropic)));
        assert_eq!(b["error"]["type"], "request_too_large");
        let b = body(proxy_error_in(&ProxyError::BadRequest("x".into()), false, Some(ApiDialect::Anthropic)));
        assert_eq!(b["error"]["type"], "invalid_request_error");
        let tk = ProxyError::TooManyKeys { resource: "r".into(), max_keys: 3 };
        assert_eq!(body(proxy_error_in(&tk, false, Some(ApiDialect::OpenAi)))["error"]["code"], "rate_limit_exceeded");
    }

    #[test]
    fn grpc_refusal_is_resource_exhausted() {
        let resp = refused(&refusal(Kind::Rate, 5.0, 1, 100), true);
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["grpc-status"], "8");
        assert!(resp.headers()["grpc-message"].to_str().unwrap().contains("api-core"));
        assert_eq!(grpc_percent_encode("a%b\n"), "a%25b%0A");
    }
}
