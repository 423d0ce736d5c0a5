//! The admin HTTP listener shared by `usher server` and `usher proxy`:
//! `/metrics`, `/healthz`, `/readyz` and the `/debug/*` pages. Each role
//! supplies a handler; this module owns the listener, the response helpers
//! and graceful shutdown.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The body of every admin response: one buffer, written at once.
pub type Body = Full<Bytes>;

/// Answers one admin request. Handlers are synchronous: they read state, never wait.
pub type Handler = Arc<dyn Fn(&http::request::Parts) -> Response<Body> + Send + Sync>;

/// Serves admin requests until `shutdown` is cancelled.
pub async fn serve(listener: TcpListener, handler: Handler, shutdown: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let handler = handler.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (parts, _body) = req.into_parts();
                let resp = handler(&parts);
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(std::time::Duration::from_secs(10));
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
}

/// A plain-text response with `status`.
pub fn text(status: StatusCode, body: impl Into<String>) -> Response<Body> {
    respond(status, "text/plain; charset=utf-8", body.into().into_bytes())
}

/// `value` as pretty-printed JSON, or a 500 if it cannot be encoded.
pub fn json(value: &impl serde::Serialize) -> Response<Body> {
    match serde_json::to_vec_pretty(value) {
        Ok(b) => respond(StatusCode::OK, "application/json", b),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode status: {e}")),
    }
}

/// An HTML page, status 200.
pub fn html(body: String) -> Response<Body> {
    respond(StatusCode::OK, "text/html; charset=utf-8", body.into_bytes())
}

/// The 404 for an admin path nothing serves.
pub fn not_found(path: &str) -> Response<Body> {
    text(StatusCode::NOT_FOUND, format!("no admin endpoint at {path}\n"))
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, header::HeaderValue::from_str(content_type).expect("static content type"));
    r.headers_mut().insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-store"));
    r
}

/// The Prometheus text exposition of `registry`.
pub fn metrics(registry: &prometheus::Registry) -> Response<Body> {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let enc = prometheus::TextEncoder::new();
    match enc.encode(&registry.gather(), &mut buf) {
        Ok(()) => respond(StatusCode::OK, prometheus::TEXT_FORMAT, buf),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode metrics: {e}")),
    }
}

/// The first value of query parameter `name`, percent-decoded.
pub fn query_param(uri: &http::Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k) == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Escapes text for HTML.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Wraps a status page body in a small self-refreshing HTML document.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>{t}</title><style>body{{font-family:system-ui,sans-serif;margin:1.5em}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:right}}\
         th{{background:#f3f3f3}}td:first-child{{text-align:left}}.err{{color:#b00}}</style></head>\
         <body><h1>{t}</h1>{body}</body></html>",
        t = escape(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_decode() {
        let uri: http::Uri = "/debug/resources?x=1&resource=api%2Fa+b&format=json".parse().unwrap();
        assert_eq!(query_param(&uri, "resource").as_deref(), Some("api/a b"));
        assert_eq!(query_param(&uri, "format").as_deref(), Some("json"));
        assert_eq!(query_param(&uri, "nope"), None);
        let bad: http::Uri = "/x?resource=%zz%4".parse().unwrap();
        assert_eq!(query_param(&bad, "resource").as_deref(), Some("%zz%4"));
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(escape("<a href='x'>&</a>"), "&lt;a href=&#39;x&#39;&gt;&amp;&lt;/a&gt;");
    }
}
