//! Where the engines differ: each known difference, pinned so a change on
//! either side is seen.

use super::Diff;
use super::cases::{Framing, ReqCase, RespCase};

/// An empty reason phrase: hyper relays it empty, the native path writes
/// the canonical one. Both are valid (RFC 9112 §4: the reason may be empty
/// and a client ignores it); pinned so a change on either side is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_reason_phrase_is_canonical_on_the_native_path_and_empty_on_hyper() {
    let diff = Diff::start().await;
    let ((_, native), (_, hyper)) = diff.both(&ReqCase::get("/x"), &RespCase::ok("hi").status(200, "")).await.unwrap();
    assert_eq!((native.status, native.reason.as_str(), native.text().as_str()), (200, "OK", "hi"));
    assert_eq!((hyper.status, hyper.reason.as_str(), hyper.text().as_str()), (200, "", "hi"));
}

/// A `304` with `Content-Length` (the length a 200 would have had): the
/// native path keeps the field as sent, as it does for HEAD; hyper's server
/// drops it. RFC 9110 §8.6 allows either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_keeps_its_content_length_on_the_native_path_only() {
    let diff = Diff::start().await;
    let resp = RespCase::ok("twelve bytes").status(304, "Not Modified").with("ETag", "\"v1\"");
    let ((_, native), (_, hyper)) = diff.both(&ReqCase::get("/x"), &resp).await.unwrap();
    assert_eq!((native.status, hyper.status), (304, 304));
    assert_eq!(native.header("content-length"), Some("12"), "{native:?}");
    assert_eq!(hyper.header("content-length"), None, "{hyper:?}");
}

/// An upstream answering in HTTP/1.0: both engines answer the client in
/// their own version (RFC 9110 §2.5), chunking a close-delimited body and
/// keeping the client's connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_answer_goes_on_as_http_1_1_on_both_engines() {
    let diff = Diff::start().await;
    for framing in [Framing::Length, Framing::Close] {
        let resp = RespCase { version: "HTTP/1.0", ..RespCase::ok("hello").framed(framing) };
        let ((_, native), (_, hyper)) = diff.both(&ReqCase::get("/x"), &resp).await.unwrap();
        for (engine, got) in [("native", &native), ("hyper", &hyper)] {
            assert_eq!((got.version, got.status, got.text().as_str()), (1, 200, "hello"), "{engine} {framing:?}");
            let chunked = got.header("transfer-encoding") == Some("chunked");
            assert_eq!(chunked, framing == Framing::Close, "{engine}: {got:?}");
        }
    }
}

/// An upstream answer with both `Transfer-Encoding: chunked` and
/// `Content-Length`: the native path drops the length and chunks (RFC 9112
/// §6.3: an intermediary removes it); hyper relays the length. The body is
/// the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_both_framings_loses_its_length_on_the_native_path_only() {
    let diff = Diff::start().await;
    let chunks = Framing::Chunked { pieces: 2, upper: false, ext: false, trailers: false };
    let resp = RespCase::ok("hello").framed(chunks).with("Content-Length", "5");
    let ((_, native), (_, hyper)) = diff.both(&ReqCase::get("/x"), &resp).await.unwrap();
    assert_eq!((native.text().as_str(), hyper.text().as_str()), ("hello", "hello"));
    assert_eq!((native.header("transfer-encoding"), native.header("content-length")), (Some("chunked"), None));
    assert_eq!((hyper.header("transfer-encoding"), hyper.header("content-length")), (None, Some("5")));
}
