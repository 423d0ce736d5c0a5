//! Which engine serves a request: the native path hands what it does not
//! serve to hyper, counted by reason (`usher_proxy_http1_handoffs_total{reason}`);
//! `Http1::Hyper` serves everything without a hand-off; the binary's
//! `--http1` flag and `USHER_HTTP1` choose.

use usher_test_support as support;

use std::collections::BTreeMap;

use usher_proxy::Http1;

use support::upstream::Upstream;

use crate::client::{By, Client, served_by};
use crate::scripted::{Scripted, echo};
use crate::{API, PATIENCE, handoffs, reasons, routes, sidecar};

// === hand-off to the general path ===

/// A route whose target the native path cannot forward to (here, no
/// upstream: the origin the request names) is found by the pipeline's route
/// stage, which gives the request back untouched: hyper serves it from its
/// first byte, with nothing counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_to_another_engines_target_is_handed_off_before_anything_happens() {
    let up = Scripted::start(echo).await;
    let yaml = "resources:\n  r: { kind: rate, capacity: 1/min }\n\
                routes:\n  - { name: origin, match: { host: 127.0.0.1 }, resources: [r] }\n";
    let side = sidecar(yaml, Http1::Native).await;
    let mut c = Client::connect(side.addr).await;
    c.send(format!("GET /d HTTP/1.1\r\nHost: {}\r\nX-Client-Case: 1\r\n\r\n", up.addr)).await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str(), served_by(&r)), (200, "GET /d ", By::Hyper));
    assert_eq!(handoffs(&side.proxy), reasons(&[("upstream", 1)]));
    // One admission (by hyper), not two: the next request is refused by the 1/min rate.
    c.send(format!("GET /e HTTP/1.1\r\nHost: {}\r\n\r\n", up.addr)).await;
    assert_eq!(c.response(false).await.status, 429);
    assert_eq!(up.seen().len(), 1);
}

/// On one connection: a native GET, a chunked POST (handed to hyper and
/// answered by it), then a GET hyper answers too, as it serves the
/// connection from then on. `Expect` and HTTP/1.0 are handed off as well;
/// each reason is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_native_path_does_not_serve_go_to_hyper_with_their_reason() {
    let up = Scripted::start(echo).await;
    let side = sidecar(&routes(up.addr, ""), Http1::Native).await;
    let mut c = Client::connect(side.addr).await;

    c.send(format!("GET /first HTTP/1.1\r\nHost: {API}\r\nX-Client-Case: 1\r\n\r\n")).await;
    let first = c.response(false).await;
    assert_eq!((first.status, first.text().as_str(), served_by(&first)), (200, "GET /first ", By::Native));
    assert_eq!(handoffs(&side.proxy), BTreeMap::new());

    c.send(format!(
        "POST /chunked HTTP/1.1\r\nHost: {API}\r\nX-Client-Case: 1\r\nTransfer-Encoding: chunked\r\n\r\n\
         6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"
    ))
    .await;
    let post = c.response(false).await;
    assert_eq!((post.status, post.text().as_str(), served_by(&post)), (200, "POST /chunked hello world", By::Hyper));
    assert_eq!(handoffs(&side.proxy), reasons(&[("transfer_encoding", 1)]));

    c.send(format!("GET /third HTTP/1.1\r\nHost: {API}\r\nX-Client-Case: 1\r\n\r\n")).await;
    let third = c.response(false).await;
    assert_eq!((third.status, third.text().as_str(), served_by(&third)), (200, "GET /third ", By::Hyper));
    assert_eq!(handoffs(&side.proxy), reasons(&[("transfer_encoding", 1)]), "hyper kept the connection");

    // The upstream side: one connection, as both engines draw on the
    // upstream's one pool (hyper writes lower-case field names).
    let seen: Vec<_> = up.seen().iter().map(|s| (s.conn, s.path().to_string(), s.has_name("X-Client-Case"))).collect();
    assert_eq!(seen, [(0, "/first".into(), true), (0, "/chunked".into(), false), (0, "/third".into(), false)]);

    // Expect: 100-continue, on a new connection.
    let mut c = Client::connect(side.addr).await;
    c.send(format!("POST /expect HTTP/1.1\r\nHost: {API}\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello"))
        .await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str(), served_by(&r)), (200, "POST /expect hello", By::Hyper));
    assert_eq!(handoffs(&side.proxy), reasons(&[("transfer_encoding", 1), ("expect", 1)]));

    // HTTP/1.0: answered in HTTP/1.0, then closed; forwarded as HTTP/1.1.
    let mut c = Client::connect(side.addr).await;
    c.send(format!("GET /old HTTP/1.0\r\nHost: {API}\r\n\r\n")).await;
    let r = c.response(false).await;
    assert_eq!((r.version, r.status, r.text().as_str(), served_by(&r)), (0, 200, "GET /old ", By::Hyper));
    c.closed_within(PATIENCE).await;
    assert_eq!(handoffs(&side.proxy), reasons(&[("transfer_encoding", 1), ("expect", 1), ("http_1_0", 1)]));
    assert_eq!(up.seen().last().unwrap().request_line, "GET /old HTTP/1.1");
    assert_eq!(up.seen().len(), 5);
}

// === Http1::Hyper ===

/// With `Http1::Hyper`, hyper serves every request, the everyday ones and
/// those the native path would hand off, and nothing is counted as a hand-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_hyper_serves_everything_without_a_handoff() {
    let up = Scripted::start(echo).await;
    let side = sidecar(&routes(up.addr, ""), Http1::Hyper).await;
    let mut c = Client::connect(side.addr).await;
    c.send(format!("GET /first HTTP/1.1\r\nHost: {API}\r\nX-Client-Case: 1\r\n\r\n")).await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str(), served_by(&r)), (200, "GET /first ", By::Hyper));
    c.send(format!(
        "POST /chunked HTTP/1.1\r\nHost: {API}\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"
    ))
    .await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str(), served_by(&r)), (200, "POST /chunked hello world", By::Hyper));
    c.send(format!("POST /expect HTTP/1.1\r\nHost: {API}\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi"))
        .await;
    let r = c.response(false).await;
    assert_eq!((r.status, r.text().as_str()), (200, "POST /expect hi"));

    let mut old = Client::connect(side.addr).await;
    old.send(format!("GET /old HTTP/1.0\r\nHost: {API}\r\n\r\n")).await;
    let r = old.response(false).await;
    assert_eq!((r.version, r.status, r.text().as_str()), (0, 200, "GET /old "));

    assert_eq!(up.seen().len(), 4);
    assert!(
        !up.seen()[0].has_name("X-Client-Case") && up.seen()[0].has_name("x-client-case"),
        "hyper's client wrote it"
    );
    assert_eq!(handoffs(&side.proxy), BTreeMap::new());
}

// === the real binary ===

/// `usher proxy` as shipped: by default a chunked request is handed to
/// hyper and counted by reason on `/metrics`; with `--http1 hyper`, or
/// `USHER_HTTP1=hyper`, hyper serves everything and nothing is handed off.
/// All answer. A value the flag does not know is refused, naming the choices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_s_http1_flag_and_env_choose_the_engine() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = support::write_file(dir.path(), "routes.yaml", &routes(up.addr, ""));
    let routes = routes.to_str().unwrap();
    let base = ["proxy", "--routes", routes, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
    type Run<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], f64);
    let runs: [Run; 3] = [(&[], &[], 1.0), (&["--http1", "hyper"], &[], 0.0), (&[], &[("USHER_HTTP1", "hyper")], 0.0)];
    for (flags, env, handed_off) in runs {
        let args: Vec<&str> = base.iter().chain(flags).copied().collect();
        let u = support::Usher::start(&args, env, "usher proxy listening");
        let mut c = Client::connect(u.addr("listen")).await;
        c.send(format!("GET /x HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        assert_eq!(c.response(false).await.status, 200, "{flags:?} {env:?}");
        c.send(format!("POST /x HTTP/1.1\r\nHost: {API}\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndata\r\n0\r\n\r\n"))
            .await;
        assert_eq!(c.response(false).await.status, 200, "{flags:?} {env:?}");
        let admin = u.addr("admin");
        let (code, text) = tokio::task::spawn_blocking(move || support::http_get(admin, "/metrics")).await.unwrap();
        assert_eq!(code, 200);
        let series = [("reason", "transfer_encoding")];
        let count = support::metric(&text, "usher_proxy_http1_handoffs_total", &series);
        assert_eq!(count, Some(handed_off), "{flags:?} {env:?}");
    }

    let (code, _, err) = support::run_usher(&["proxy", "--routes", routes, "--http1", "fast"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("invalid value 'fast' for '--http1 <HTTP1>'"), "{err}");
    assert!(err.contains("[possible values: native, hyper]"), "{err}");
}
