//! Relaying the upstream's answer to the client: a gauge slot is free once
//! an answer's last bytes went out (both engines, every response framing),
//! a broken chunked body still shows its head, a close-delimited body is
//! relayed as it trickles, and a client that leaves while its answer's body
//! is idle (a stream of events) frees its slot at once and ends the
//! upstream's connection or h2 stream: the real binary, on both engines,
//! for HTTP/1.1, h2c and h2 over TLS upstreams.

use usher_test_support as support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Instant;
use usher_proxy::Http1;

use crate::client::Client;
use crate::scripted::{Scripted, answer};
use crate::wire::{find, read_head, shown};
use crate::{API, PATIENCE, metrics_text, routes, sidecar};

// === the slot, once the answer is out ===

/// A gauge of one slot, and clients that send the next request as soon as
/// the whole answer before has arrived: none is refused, on either engine and
/// whatever the answer's framing. The slot is given back when the last of the
/// body is handed out, not after it was written (the native path released it
/// after its last write and flush, and a quick client found it still taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gauge_slot_is_free_once_the_whole_answer_was_sent() {
    const ROUNDS: usize = 150;
    let bodies: [(&str, &[u8], bool); 4] = [
        ("length", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", false),
        ("chunked", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", false),
        ("close", b"HTTP/1.1 200 OK\r\n\r\nhello", true),
        ("empty", b"HTTP/1.1 204 No Content\r\n\r\n", false),
    ];
    for (framing, bytes, close) in bodies {
        let up = Scripted::start(move |_| answer(bytes, close)).await;
        let yaml = format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  one: {{ kind: gauge, capacity: 1 }}\n\
             routes:\n  - {{ name: api, match: {{ host: {API} }}, upstream: up, resources: [one] }}\n",
            up.addr
        );
        for engine in [Http1::Native, Http1::Hyper] {
            let side = sidecar(&yaml, engine).await;
            // Two connections taking turns: a connection's own next request is
            // read only after its previous exchange has ended anyway.
            let mut clients = [Client::connect(side.addr).await, Client::connect(side.addr).await];
            for round in 0..ROUNDS {
                let c = &mut clients[round % 2];
                c.send(format!("GET /x HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
                let r = c.response(false).await;
                assert!(r.status < 300, "{engine:?}, {framing} body, round {round}: {} {}", r.status, r.text());
            }
        }
    }
}

// === broken and trickling answers ===

/// Reads from `c` until EOF or [`PATIENCE`]; everything read, and whether
/// the sidecar closed the connection.
async fn read_until_closed(c: &mut Client) -> (Vec<u8>, bool) {
    let mut out = std::mem::take(&mut c.buf);
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + PATIENCE;
    loop {
        match tokio::time::timeout_at(deadline, c.stream.read(&mut chunk)).await {
            Err(_) => return (out, false),
            Ok(Ok(0) | Err(_)) => return (out, true),
            Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
        }
    }
}

/// An upstream whose chunked body is garbage right after the head, in the
/// same write: the client gets the head and then a closed connection, and
/// the route counts a body error. The head used to go out only when the
/// garbage came in a later read, so a client saw either the head or
/// nothing; found by the `hostile_upstream_answers` property test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_broken_right_after_the_head_still_shows_the_head() {
    let up = Scripted::start(|_| {
        answer(&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n\0\0\0"[..], true)
    })
    .await;
    let side = sidecar(&routes(up.addr, ""), Http1::Native).await;
    for round in 0..3 {
        let mut c = Client::connect(side.addr).await;
        c.send(format!("GET /x HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        let (out, closed) = read_until_closed(&mut c).await;
        let text = String::from_utf8_lossy(&out);
        assert!(closed, "round {round}: the sidecar closed the connection: {text:?}");
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "round {round}: {text:?}");
        assert!(text.to_ascii_lowercase().contains("x-up: 1\r\n"), "round {round}: {text:?}");
        assert!(text.ends_with("\r\n\r\n"), "round {round}: nothing after the head: {text:?}");
    }
    let metrics = metrics_text(&side.proxy);
    assert!(metrics.contains("usher_proxy_response_body_errors_total{route=\"api\"} 3"), "{metrics}");
}

/// An upstream that sends a close-delimited body in two parts with a pause
/// between: the first part reaches the client during the pause, on both
/// engines. The native path used to hold each part until the next read
/// came back, so a stream of events arrived one event late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_delimited_body_is_relayed_as_it_trickles() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (go_tx, go_rx) = tokio::sync::mpsc::channel::<()>(1);
    let go_rx = Arc::new(tokio::sync::Mutex::new(go_rx));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let go = go_rx.clone();
            tokio::spawn(async move {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: one\n\n").await;
                // Bounded: the test releases it, or it gives up after PATIENCE.
                let _ = tokio::time::timeout(PATIENCE, go.lock().await.recv()).await;
                let _ = s.write_all(b"data: two\n\n").await;
            });
        }
    });
    for engine in [Http1::Native, Http1::Hyper] {
        let side = sidecar(&routes(addr, ""), engine).await;
        let mut c = Client::connect(side.addr).await;
        c.send(format!("GET /events HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(5);
        while find(&got, b"data: one").is_none() {
            match tokio::time::timeout_at(deadline, c.stream.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
                other => panic!(
                    "{engine:?}: the first event did not come while the upstream paused ({other:?}): {:?}",
                    String::from_utf8_lossy(&got)
                ),
            }
        }
        assert!(find(&got, b"data: two").is_none(), "{engine:?}: the pause was real");
        go_tx.send(()).await.unwrap();
        c.buf = got;
        let r = c.response(false).await;
        assert_eq!((r.status, r.text().as_str()), (200, "data: one\n\ndata: two\n\n"), "{engine:?}");
    }
}

// === a client leaving while the answer's body is idle ===

/// What an upstream whose answers never end saw: one entry per answer the
/// sidecar gave up on, as the upstream learned it (`closed` for an
/// HTTP/1.1 connection, the `RST_STREAM` reason for an h2 stream).
type Ended = Arc<Mutex<Vec<String>>>;

/// The first event of every never-ending answer.
const FIRST_EVENT: &str = "data: first";

/// An HTTP/1.1 upstream on 127.0.0.1:0 that answers every request with a
/// chunked stream of events that sends its first and then nothing more,
/// noting when the sidecar closes the connection.
async fn idle_body_http1() -> (SocketAddr, Ended) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ended = Ended::default();
    let noted = ended.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let noted = noted.clone();
            tokio::spawn(async move {
                if read_head(&mut stream).await.is_none() {
                    return;
                }
                let mut chunk = [0u8; 4096];
                let event = format!("{FIRST_EVENT}\n\n");
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                    event.len()
                );
                stream.write_all(head.as_bytes()).await.unwrap();
                // Until the sidecar closes the connection (no request comes while the answer lasts).
                while let Ok(n) = stream.read(&mut chunk).await {
                    if n == 0 {
                        break;
                    }
                }
                noted.lock().unwrap().push("closed".to_string());
            });
        }
    });
    (addr, ended)
}

/// An h2 upstream on 127.0.0.1:0 (h2c, or TLS with `tls`) that answers every
/// request with a stream of events that sends its first and then nothing
/// more, noting how the sidecar ends each stream.
async fn idle_body_h2(tls: Option<tokio_rustls::TlsAcceptor>) -> (SocketAddr, Ended) {
    async fn serve<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(io: T, noted: Ended) {
        let Ok(mut conn) = h2::server::handshake(io).await else { return };
        while let Some(Ok((_req, mut respond))) = conn.accept().await {
            let noted = noted.clone();
            tokio::spawn(async move {
                let head = http::Response::builder().header("content-type", "text/event-stream").body(()).unwrap();
                let mut body = respond.send_response(head, false).unwrap();
                body.send_data(bytes::Bytes::from(format!("{FIRST_EVENT}\n\n")), false).unwrap();
                let how = match std::future::poll_fn(|cx| body.poll_reset(cx)).await {
                    Ok(reason) => format!("{reason:?}"),
                    Err(e) => format!("error: {e}"),
                };
                noted.lock().unwrap().push(how);
            });
        }
        // The connection closed: streams still open end with it.
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ended = Ended::default();
    let noted = ended.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (noted, tls) = (noted.clone(), tls.clone());
            tokio::spawn(async move {
                match tls {
                    None => serve(stream, noted).await,
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(stream).await {
                            serve(stream, noted).await;
                        }
                    }
                }
            });
        }
    });
    (addr, ended)
}

/// The sidecar's `usher_proxy_in_flight` for `route` (0 when absent), from its admin listener.
async fn in_flight(admin: SocketAddr, route: &'static str) -> f64 {
    let (code, text) = tokio::task::spawn_blocking(move || support::http_get(admin, "/metrics")).await.unwrap();
    assert_eq!(code, 200);
    support::metric(&text, "usher_proxy_in_flight", &[("route", route)]).unwrap_or(0.0)
}

/// An app asks for a stream of events (server-sent events, a long poll)
/// and closes its connection while the answer's body is idle: the real
/// `usher proxy` notices within a couple of seconds, not at the next
/// event, whatever the upstream speaks (HTTP/1.1, h2c, h2 over TLS): the
/// route's in-flight count and its gauge slot (capacity 1, no waiting) are
/// free again, and the upstream saw its connection closed (HTTP/1.1) or
/// its stream reset with `CANCEL` (h2, whose connection stays and serves
/// the next request). The same on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_an_idle_body_frees_its_slot_and_the_upstream() {
    let pki = support::upstream::TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = support::write_file(dir.path(), "ca.pem", &pki.ca_pem);
    let (h1, h1_ended) = idle_body_http1().await;
    let (h2c, h2c_ended) = idle_body_h2(None).await;
    let (tls, tls_ended) = idle_body_h2(Some(pki.acceptor(&[b"h2"]))).await;
    let yaml = format!(
        "upstreams:\n  a: {{ url: \"http://{h1}\" }}\n  c: {{ url: \"http://{h2c}\", h2c: true }}\n  \
           t: {{ url: \"https://localhost:{}\", ca_file: \"{}\" }}\n\
         resources:\n  ga: {{ kind: gauge, capacity: 1, max_wait: 0s }}\n  \
           gc: {{ kind: gauge, capacity: 1, max_wait: 0s }}\n  gt: {{ kind: gauge, capacity: 1, max_wait: 0s }}\n\
         routes:\n  - {{ name: a, match: {{ host: a.test }}, upstream: a, resources: [ga] }}\n  \
           - {{ name: c, match: {{ host: c.test }}, upstream: c, resources: [gc] }}\n  \
           - {{ name: t, match: {{ host: t.test }}, upstream: t, resources: [gt] }}\n",
        tls.port(),
        ca.display()
    );
    let routes = support::write_file(dir.path(), "routes.yaml", &yaml);
    let routes = routes.to_str().unwrap();
    let base = ["proxy", "--routes", routes, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
    let mut missed = Vec::new();
    for (engine, flags) in [("native", &[][..]), ("hyper", &["--http1", "hyper"][..])] {
        let args: Vec<&str> = base.iter().chain(flags).copied().collect();
        let u = support::Usher::start(&args, &[], "usher proxy listening");
        let (listen, admin) = (u.addr("listen"), u.addr("admin"));
        for (route, ended, gone) in
            [("a", &h1_ended, "closed"), ("c", &h2c_ended, "CANCEL"), ("t", &tls_ended, "CANCEL")]
        {
            ended.lock().unwrap().clear();
            let what = format!("{engine}, route {route}");
            // Twice: the slot the first left must take the second at once (an h2 upstream's on the same connection).
            for round in 1..=2 {
                let mut app = Client::connect(listen).await;
                app.send(format!("GET /events HTTP/1.1\r\nHost: {route}.test\r\n\r\n")).await;
                let mut got = Vec::new();
                let mut chunk = [0u8; 4096];
                while find(&got, FIRST_EVENT.as_bytes()).is_none() {
                    match tokio::time::timeout(PATIENCE, app.stream.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
                        r => panic!("{what}: no first event ({r:?}); got {:?}", shown(&got)),
                    }
                }
                assert!(got.starts_with(b"HTTP/1.1 200 "), "{what}: {:?}", shown(&got));
                assert_eq!(in_flight(admin, route).await, 1.0, "{what}");

                drop(app);
                let left = std::time::Instant::now();
                // Bounded: a couple of seconds, then it counts as missed.
                let noticed = loop {
                    let seen = ended.lock().unwrap().clone();
                    let count = in_flight(admin, route).await;
                    if count == 0.0 && seen.len() == round {
                        assert_eq!(seen, vec![gone; round], "{what}");
                        break true;
                    }
                    if left.elapsed() > Duration::from_secs(2) {
                        missed.push(format!(
                            "{what}: 2 s after the app left, in flight {count}, the upstream saw {seen:?}"
                        ));
                        break false;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                };
                if !noticed {
                    break;
                }
            }
        }
    }
    assert!(missed.is_empty(), "the app's leaving went unnoticed:\n{}", missed.join("\n"));
}
