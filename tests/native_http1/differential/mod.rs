//! Differential: the same requests through a native and a hyper sidecar
//! (same routes, same upstream script) must reach the upstream alike
//! (request line, header fields as a multiset, body) and come back alike
//! (status line, header fields as a multiset, de-chunked body), and both
//! must match what the request and the script call for. A table of the
//! everyday cases ([`table`]), then a property test over generated
//! combinations ([`generated`]); the known differences, pinned
//! ([`differences`]), and regressions ([`regressions`]). The cases are in
//! [`cases`]; the harness that runs one through both engines is here.
//!
//! Known differences between the engines, normalised away or kept out of
//! the generated cases (all but the last pinned by a test in this binary):
//! - header name case and order: compared as lower-case multisets;
//! - `date` values (each engine's clock): compared as a placeholder;
//! - an empty reason phrase from the upstream: hyper relays it empty, the
//!   native path writes the canonical one (both valid HTTP/1.1);
//! - a `304` with `Content-Length`: the native path keeps the field, hyper
//!   drops it (RFC 9110 §8.6 allows either);
//! - an upstream answer with both `Transfer-Encoding: chunked` and
//!   `Content-Length`: the native path drops the length and chunks (RFC
//!   9112 §6.3), hyper relays the length; the body is the same;
//! - a request with an empty body whose `Connection` names `Content-Length`:
//!   the native path keeps `content-length: 0`, hyper sends no length (both
//!   mean no body);
//! - a reused upstream connection that takes a GET and closes unanswered:
//!   the native path resends it on a new connection, hyper answers 502
//!   ([`crate::upstream`]);
//! - the header timeout: on the native path it also bounds a small body the
//!   path buffers, hyper gives a body no deadline ([`crate::connection`]);
//! - a request refused without the upstream (no route): hyper answers once
//!   it has the head and may close under a body still arriving, the native
//!   path reads the body (at most 64 KiB) first and keeps the connection.

mod cases;
mod differences;
mod generated;
mod regressions;
mod table;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use usher_proxy::Http1;

use crate::client::Client;
use crate::scripted::Scripted;
use crate::wire::{Resp, Seen, multiset, shown};
use crate::{Sidecar, handoffs, routes, sidecar};
use cases::{HOP_BY_HOP, ReqCase, RespCase, Routed, connection_tokens};

/// One scripted upstream behind a native and a hyper sidecar with the same routes.
struct Diff {
    up: Scripted,
    /// What the upstream answers next.
    reply: Arc<Mutex<Option<RespCase>>>,
    native: Sidecar,
    hyper: Sidecar,
}

/// What one engine made of one case: what reached the upstream (if anything) and what came back.
type Outcome = (Option<Seen>, Resp);

impl Diff {
    async fn start() -> Diff {
        let reply = Arc::new(Mutex::new(None::<RespCase>));
        let next = reply.clone();
        let up = Scripted::start(move |seen| {
            let case = next.lock().unwrap().clone().expect("a scripted reply");
            case.render(seen.method == "HEAD")
        })
        .await;
        let yaml = routes(up.addr, "");
        let native = sidecar(&yaml, Http1::Native).await;
        let hyper = sidecar(&yaml, Http1::Hyper).await;
        Diff { up, reply, native, hyper }
    }

    /// Sends `req` on a new connection to `side`, the upstream answering `resp`.
    async fn through(&self, side: &Sidecar, req: &ReqCase, resp: &RespCase) -> Result<Outcome, String> {
        self.through_on(side, req, resp).await.map(|(outcome, _)| outcome)
    }

    /// [`Diff::through`], and the client connection, to go on with.
    async fn through_on(&self, side: &Sidecar, req: &ReqCase, resp: &RespCase) -> Result<(Outcome, Client), String> {
        *self.reply.lock().unwrap() = Some(resp.clone());
        let before = self.up.seen().len();
        let mut c = Client::connect(side.addr).await;
        c.send_in(&req.bytes(), req.writes).await.map_err(|e| format!("writing the request: {e}"))?;
        let got = c.try_response(req.is_head()).await?;
        let seen = self.up.seen();
        let seen = match &seen[before..] {
            [] => None,
            [one] => Some(one.clone()),
            more => return Err(format!("{} requests reached the upstream: {more:?}", more.len())),
        };
        let problems = self.up.problems();
        if !problems.is_empty() {
            return Err(format!("the upstream could not parse what it got: {problems:?}"));
        }
        Ok(((seen, got), c))
    }

    /// Both engines' outcomes for one case, in that order.
    async fn both(&self, req: &ReqCase, resp: &RespCase) -> Result<(Outcome, Outcome), String> {
        let native = self.through(&self.native, req, resp).await.map_err(|e| format!("native: {e}"))?;
        let hyper = self.through(&self.hyper, req, resp).await.map_err(|e| format!("hyper: {e}"))?;
        Ok((native, hyper))
    }

    /// Runs one case through both engines; they must agree with each other
    /// and with what the case calls for.
    async fn check(&self, req: &ReqCase, resp: &RespCase) -> Result<(), String> {
        let context = |e: String| format!("{e}\n  request: {req:?}\n  upstream answer: {resp:?}");
        let ((n_seen, n_got), mut n_client) =
            self.through_on(&self.native, req, resp).await.map_err(|e| context(format!("native: {e}")))?;
        let ((h_seen, h_got), mut h_client) =
            self.through_on(&self.hyper, req, resp).await.map_err(|e| context(format!("hyper: {e}")))?;
        let upstream_view =
            |s: &Option<Seen>| s.as_ref().map(|s| (s.request_line.clone(), multiset(&s.headers), shown(&s.body)));
        if upstream_view(&n_seen) != upstream_view(&h_seen)
            || n_seen.as_ref().map(|s| &s.body) != h_seen.as_ref().map(|s| &s.body)
        {
            return Err(context(format!(
                "the upstream got different requests\n  native: {:?}\n  hyper:  {:?}",
                upstream_view(&n_seen),
                upstream_view(&h_seen)
            )));
        }
        let client_view = |r: &Resp| {
            let head = (r.version, r.status, r.reason.clone(), multiset(&r.headers));
            (head, shown(&r.body), r.trailers.clone(), r.interim.clone())
        };
        if client_view(&n_got) != client_view(&h_got) || n_got.body != h_got.body {
            return Err(context(format!(
                "the client got different responses\n  native: {:?}\n  hyper:  {:?}",
                client_view(&n_got),
                client_view(&h_got)
            )));
        }
        expected(req, resp, self.up.addr, &n_seen, &n_got).map_err(context)?;
        n_client.after(&n_got).await.map_err(|e| context(format!("native: {e}")))?;
        h_client.after(&h_got).await.map_err(|e| context(format!("hyper: {e}")))
    }

    fn assert_no_handoff(&self) {
        assert_eq!(handoffs(&self.native.proxy), BTreeMap::new(), "the native sidecar served every case itself");
        assert_eq!(handoffs(&self.hyper.proxy), BTreeMap::new(), "Http1::Hyper never hands off");
    }
}

/// What a case calls for, whichever engine served it.
fn expected(req: &ReqCase, resp: &RespCase, up: SocketAddr, seen: &Option<Seen>, got: &Resp) -> Result<(), String> {
    let prefix = match req.routed() {
        Routed::Nowhere => {
            if seen.is_some() || got.status != 403 {
                return Err(format!("an unrouted host must get 403 and reach nothing: {seen:?} {got:?}"));
            }
            return Ok(());
        }
        Routed::Up(prefix) => prefix,
    };
    let seen = seen.as_ref().ok_or("nothing reached the upstream")?;
    let line = format!("{} {prefix}{} HTTP/1.1", req.method, req.target);
    if seen.request_line != line {
        return Err(format!("request line {:?}, expected {line:?}", seen.request_line));
    }
    let want = req.forwarded_fields(up);
    if multiset(&seen.headers) != want {
        return Err(format!("upstream fields {:?}, expected {want:?}", multiset(&seen.headers)));
    }
    if seen.body != req.body.clone().unwrap_or_default() {
        return Err(format!("upstream body {:?}", shown(&seen.body)));
    }
    if (got.version, got.status) != (1, resp.status) {
        return Err(format!("HTTP/1.{} {} for the client, expected HTTP/1.1 {}", got.version, got.status, resp.status));
    }
    if !resp.reason.is_empty() && got.reason != resp.reason {
        return Err(format!("reason {:?}, expected {:?}", got.reason, resp.reason));
    }
    let body = if resp.has_body(req.is_head()) { resp.body.clone() } else { Vec::new() };
    if got.body != body {
        return Err(format!("client body {:?}", shown(&got.body)));
    }
    let named = connection_tokens(&resp.fields);
    for (n, v) in &got.headers {
        let n = n.to_ascii_lowercase();
        let framing = n == "transfer-encoding" && v == "chunked";
        let closing = n == "connection" && v == "close" && req.asks_close();
        // A Date named hop-by-hop goes, and the sidecar's own takes its place.
        let own_date = n == "date" && resp.fields.iter().all(|(_, upstream)| upstream != v);
        if (HOP_BY_HOP.contains(&n.as_str()) && !framing && !closing) || (named.contains(&n) && !own_date) {
            return Err(format!("hop-by-hop field {n}: {v} reached the client"));
        }
    }
    if req.asks_close() != (got.header("connection") == Some("close")) {
        return Err(format!("connection: close in the answer exactly when the client asked: {:?}", got.headers));
    }
    if !got.trailers.is_empty() || !got.interim.is_empty() {
        return Err(format!("trailers {:?} or interim responses {:?} reached the client", got.trailers, got.interim));
    }
    if got.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case("date")).count() != 1 {
        return Err(format!("exactly one date field: {:?}", got.headers));
    }
    Ok(())
}
