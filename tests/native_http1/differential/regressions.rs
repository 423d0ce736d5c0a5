//! Differential regressions: cases where the native path once answered
//! otherwise than hyper, and than it should.

use super::Diff;
use super::cases::{ReqCase, RespCase};
use crate::wire::{Seen, field};

/// A request whose `Connection` field names `Content-Length`: the body must
/// still reach the upstream framed. The native path used to drop the field
/// and send the body bare, so the upstream read it as a second request
/// (smuggling past routing and admission); fixed in 0368dd8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_field_naming_content_length_does_not_unframe_the_body() {
    let diff = Diff::start().await;
    let smuggled: &[u8] = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let req = ReqCase { method: "POST", body: Some(smuggled.to_vec()), ..ReqCase::get("/x") }
        .with("Connection", "Content-Length");
    diff.check(&req, &RespCase::ok("fine")).await.unwrap_or_else(|e| panic!("{e}"));
    let seen: Vec<_> = diff.up.seen().iter().map(|s| (s.request_line.clone(), s.body.clone())).collect();
    let post = ("POST /x HTTP/1.1".to_string(), smuggled.to_vec());
    assert_eq!(seen, [post.clone(), post], "each engine forwarded one POST, with its body");
    diff.assert_no_handoff();

    // With an empty body, the native path keeps `content-length: 0` and
    // hyper sends no length: both mean no body. A difference, pinned.
    let empty = ReqCase { body: Some(Vec::new()), ..req };
    let ((native, _), (hyper, _)) = diff.both(&empty, &RespCase::ok("fine")).await.unwrap();
    let length = |s: Option<Seen>| field(&s.unwrap().headers, "content-length").map(str::to_string);
    assert_eq!((length(native), length(hyper)), (Some("0".to_string()), None));
}

/// An answer whose `Connection` field names `Date`: the field goes, and the
/// forwarded answer gets a Date of the sidecar's (RFC 9110 §6.6.1). The
/// native path used to send none; fixed in 0368dd8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_field_naming_date_still_leaves_one_date() {
    let diff = Diff::start().await;
    let resp = RespCase::ok("hi").with("Connection", "Date").with("Date", "Tue, 15 Nov 1994 08:12:31 GMT");
    diff.check(&ReqCase::get("/x"), &resp).await.unwrap_or_else(|e| panic!("{e}"));
    let ((_, native), (_, hyper)) = diff.both(&ReqCase::get("/x"), &resp).await.unwrap();
    for got in [native, hyper] {
        let dates: Vec<_> = got.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case("date")).collect();
        assert_eq!(dates.len(), 1, "{got:?}");
        assert_ne!(dates[0].1, "Tue, 15 Nov 1994 08:12:31 GMT", "the sidecar's own date");
    }
}

/// Usher's own answer (no route) to HEAD has no body: the next answer on
/// the connection is not mistaken for it. Fixed in fe7e2be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usher_s_own_answer_to_head_has_no_body() {
    let diff = Diff::start().await;
    let req = ReqCase { method: "HEAD", host: "nowhere.test", ..ReqCase::get("/x") };
    diff.check(&req, &RespCase::ok("unused")).await.unwrap_or_else(|e| panic!("{e}"));
}
