//! Every listed everyday exchange, through both engines.

use super::Diff;
use super::cases::{Framing, ReqCase, RespCase};
use crate::BASED;

/// Each everyday exchange, named.
fn table() -> Vec<(&'static str, ReqCase, RespCase)> {
    let hello = RespCase::ok("hello, world");
    let chunked = |ext, trailers| Framing::Chunked { pieces: 3, upper: true, ext, trailers };
    vec![
        ("GET, Content-Length answer", ReqCase::get("/x"), hello.clone()),
        ("HEAD, answer with Content-Length", ReqCase { method: "HEAD", ..ReqCase::get("/x") }, hello.clone()),
        (
            "HEAD, chunked answer",
            ReqCase { method: "HEAD", ..ReqCase::get("/x") },
            hello.clone().framed(chunked(false, false)),
        ),
        (
            "POST with a Content-Length body",
            ReqCase { method: "POST", body: Some(b"a=1&b=\r\n\x00\xff".to_vec()), ..ReqCase::get("/submit") }
                .with("Content-Type", "application/x-www-form-urlencoded"),
            hello.clone().status(201, "Created").with("Location", "/submit/1"),
        ),
        (
            "POST with an empty body",
            ReqCase { method: "POST", body: Some(Vec::new()), ..ReqCase::get("/empty") },
            hello.clone(),
        ),
        (
            "DELETE",
            ReqCase { method: "DELETE", ..ReqCase::get("/items/7") },
            RespCase::ok("").status(204, "No Content"),
        ),
        ("base-path upstream", ReqCase { host: BASED, ..ReqCase::get("/x") }, hello.clone()),
        ("base-path upstream, root", ReqCase { host: BASED, ..ReqCase::get("/") }, hello.clone()),
        ("query string", ReqCase::get("/search?q=a%20b&empty=&flag"), hello.clone()),
        ("query string, base path", ReqCase { host: BASED, ..ReqCase::get("/x?q=1&r=two") }, hello.clone()),
        ("host in other case, with a port", ReqCase { host: "API.Test:8080", ..ReqCase::get("/x") }, hello.clone()),
        ("Connection: keep-alive", ReqCase::get("/x").with("Connection", "keep-alive"), hello.clone()),
        ("Connection: close", ReqCase::get("/x").with("Connection", "close"), hello.clone()),
        (
            "Connection naming another field",
            ReqCase::get("/x")
                .with("Connection", "keep-alive, X-Drop-Me")
                .with("X-Drop-Me", "secret")
                .with("X-Kept", "1"),
            hello.clone(),
        ),
        (
            "Keep-Alive and Proxy-Authorization",
            ReqCase::get("/x")
                .with("Keep-Alive", "timeout=5")
                .with("Proxy-Authorization", "Basic Zm9vOmJhcg==")
                .with("Proxy-Connection", "keep-alive")
                .with("Authorization", "Bearer t0k3n"),
            hello.clone(),
        ),
        (
            "repeated, mixed-case, empty and non-ASCII fields",
            ReqCase::get("/x")
                .with("X-Dup", "one")
                .with("x-dup", "two")
                .with("X-Mixed-CASE", "Value With Spaces")
                .with("X-Empty", "")
                .with("X-Latin", "caf\u{e9}")
                .with("Via", "1.0 other-proxy"),
            hello.clone().with("X-Dup", "a").with("x-dup", "b").with("X-Latin", "caf\u{e9}").with("X-Empty", ""),
        ),
        ("chunked answer", ReqCase::get("/x"), hello.clone().framed(chunked(false, false))),
        ("chunked answer with extensions and trailers", ReqCase::get("/x"), hello.clone().framed(chunked(true, true))),
        ("chunked answer, empty", ReqCase::get("/x"), RespCase::ok("").framed(chunked(true, false))),
        ("close-delimited answer", ReqCase::get("/x"), hello.clone().framed(Framing::Close)),
        ("close-delimited answer, empty", ReqCase::get("/x"), RespCase::ok("").framed(Framing::Close)),
        (
            "close-delimited answer to a client that closes",
            ReqCase::get("/x").with("Connection", "close"),
            hello.clone().framed(Framing::Close),
        ),
        ("204", ReqCase::get("/x"), RespCase::ok("").status(204, "No Content").framed(Framing::Close)),
        ("204 with Content-Length: 0", ReqCase::get("/x"), RespCase::ok("").status(204, "No Content")),
        (
            "304",
            ReqCase::get("/x").with("If-None-Match", "\"v1\""),
            hello.clone().status(304, "Not Modified").with("ETag", "\"v1\"").framed(Framing::Close),
        ),
        ("103 Early Hints, then 200", ReqCase::get("/x"), RespCase { early_hints: true, ..hello.clone() }),
        (
            "hop-by-hop fields in the answer",
            ReqCase::get("/x"),
            hello
                .clone()
                .with("Connection", "keep-alive, X-Hop")
                .with("X-Hop", "secret")
                .with("Keep-Alive", "timeout=5, max=100")
                .with("Proxy-Authenticate", "Basic realm=\"x\"")
                .with("Proxy-Connection", "keep-alive")
                .with("Trailer", "X-Checksum")
                .with("Upgrade", "h2c"),
        ),
        ("the upstream's own Date", ReqCase::get("/x"), hello.clone().with("Date", "Tue, 15 Nov 1994 08:12:31 GMT")),
        ("the upstream closes after its answer", ReqCase::get("/x"), hello.clone().with("Connection", "close")),
        ("non-canonical reason phrase", ReqCase::get("/x"), hello.clone().status(200, "Fine Thanks")),
        (
            "429 with Retry-After",
            ReqCase::get("/x"),
            RespCase::ok("slow down").status(429, "Too Many Requests").with("Retry-After", "7"),
        ),
        ("no route", ReqCase { host: "nowhere.test", ..ReqCase::get("/x") }, hello.clone()),
    ]
}

/// Every listed everyday exchange comes out the same through both engines,
/// and as it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_everyday_exchange_is_the_same_through_both_engines() {
    let diff = Diff::start().await;
    let mut failures = Vec::new();
    for (name, req, resp) in table() {
        if let Err(e) = diff.check(&req, &resp).await {
            failures.push(format!("{name}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), table().len(), failures.join("\n\n"));
    diff.assert_no_handoff();
}
