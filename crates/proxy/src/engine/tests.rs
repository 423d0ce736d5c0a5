//! Both engines relay an edited stream of events: an OpenAI stream whose
//! usage usher asked for on the app's behalf (a streamed Chat Completions
//! request without `stream_options.include_usage`) reaches the app as
//! OpenAI would have sent it without, and its cost is settled. A sidecar
//! runs in this process, between a stand-in upstream and a client, all on
//! 127.0.0.1:0.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_util::sync::CancellationToken;

use crate::listener::Http1;
use crate::sidecar::Proxy;
use usher_core::clock::Clock;
use usher_core::config::routes::RoutesConfig;

/// The chunks OpenAI streams for a request with `include_usage`: each
/// chunk with `"usage":null`, then the usage alone with `"choices":[]`.
const INJECTED: [&str; 5] = [
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n",
    "data: [DONE]\n\n",
];

/// What OpenAI sends for the same request without it.
const PLAIN: [&str; 4] = [
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
];

/// A body sent in pieces a few milliseconds apart, with its length when `sized`.
struct Pieces {
    pieces: std::vec::IntoIter<Bytes>,
    len: u64,
    sized: bool,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Body for Pieces {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let pause = self.pause.get_or_insert_with(|| Box::pin(tokio::time::sleep(Duration::from_millis(5))));
        std::task::ready!(pause.as_mut().poll(cx));
        self.pause = None;
        Poll::Ready(self.pieces.next().map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        match self.sized {
            true => SizeHint::with_exact(self.len),
            false => SizeHint::default(),
        }
    }
}

/// The stand-in OpenAI, speaking HTTP/1.1 and h2c: the injected stream, cut
/// into pieces through events (and through a `\n\n`), with a length when
/// the request's path ends in `/sized`.
async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let whole = INJECTED.concat().into_bytes();
                    let cuts = [0, 30, 200, 201, 330, 500, whole.len() - 3, whole.len()];
                    let pieces: Vec<Bytes> =
                        cuts.windows(2).map(|w| Bytes::copy_from_slice(&whole[w[0]..w[1]])).collect();
                    let sized = req.uri().path().ends_with("/sized");
                    let body = Pieces { pieces: pieces.into_iter(), len: whole.len() as u64, sized, pause: None };
                    Ok::<_, Infallible>(
                        Response::builder().header("content-type", "text/event-stream").body(body).unwrap(),
                    )
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// An in-process sidecar whose routes `injected` and `injected-h2c` (to
/// the upstream over h2c) settle `tokens` from OpenAI's usage.
async fn sidecar(up: SocketAddr, http1: Http1) -> (Arc<Proxy>, SocketAddr, CancellationToken) {
    let yaml = format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\" }}\n  llm-h2c: {{ url: \"http://{up}\", h2c: true }}\n\
         resources:\n  tokens: {{ kind: rate, capacity: 1/s, burst: 1000 }}\n\
         routes:\n\
         \x20 - {{ name: injected-h2c, upstream: llm-h2c, match: {{ path_prefix: /h2c }}, \
         resources: [{{ resource: tokens, cost: 100, settle: {{ usage: openai }} }}] }}\n\
         \x20 - {{ name: injected, upstream: llm, resources: [{{ resource: tokens, cost: 100, settle: {{ usage: openai }} }}] }}\n"
    );
    let cfg = RoutesConfig::parse("routes.yaml", &yaml).unwrap();
    let proxy = Proxy::new(cfg, "routes.yaml".into(), Clock::system(), prometheus::Registry::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::serve_with(proxy.clone(), listener, shutdown.clone(), Duration::from_secs(1), http1));
    (proxy, addr, shutdown)
}

/// Asks the sidecar at `addr` for `path` over HTTP/1.1 (or h2c), and returns the body it relays.
async fn ask(addr: SocketAddr, path: &str, h2c: bool) -> Bytes {
    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
    let req = Request::post(path).header("host", "llm.local").header("content-type", "application/json");
    // A streamed call that does not ask for its usage: usher asks for it.
    let body =
        Full::new(Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#));
    let resp = match h2c {
        true => {
            let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.unwrap();
            tokio::spawn(conn);
            send.send_request(req.body(body).unwrap()).await.unwrap()
        }
        false => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            // A small body with a length: the native engine serves it.
            send.send_request(req.body(body).unwrap()).await.unwrap()
        }
    };
    assert_eq!(resp.status(), 200);
    assert!(!resp.headers().contains_key("content-length"), "an edited body has no length: {:?}", resp.headers());
    resp.into_body().collect().await.unwrap().to_bytes()
}

fn settled(proxy: &Proxy, route: &str) -> u64 {
    let families = proxy.metrics.registry.gather();
    let Some(f) = families.iter().find(|f| f.name() == "usher_proxy_settles_total") else { return 0 };
    f.get_metric()
        .iter()
        .filter(|m| {
            let label = |n: &str| m.get_label().iter().find(|l| l.name() == n).map(|l| l.value().to_string());
            label("route").as_deref() == Some(route) && label("outcome").as_deref() == Some("settled")
        })
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

async fn injected_usage_is_hidden_on(http1: Http1) {
    let up = upstream().await;
    let (proxy, addr, shutdown) = sidecar(up, http1).await;
    let cases = [("/v1/chat/completions", false, "injected"), ("/v1/sized", false, "injected")];
    let h2c = [("/h2c/v1/chat", false, "injected-h2c"), ("/h2c/sized", true, "injected-h2c")];
    let mut count = std::collections::HashMap::<&str, u64>::new();
    for (path, h2c_client, route) in cases.into_iter().chain(h2c) {
        let got = ask(addr, path, h2c_client).await;
        assert_eq!(String::from_utf8_lossy(&got), PLAIN.concat(), "{http1:?}, {path}: the app sees no usage");
        *count.entry(route).or_default() += 1;
        assert_eq!(settled(&proxy, route), count[route], "{http1:?}, {path}: settled from the hidden usage");
    }
    // Four answers of 21 tokens, each charged 100 at first: 916 or more left (with refill), not 600.
    let left = proxy.table.resource("tokens").unwrap().limiter("tokens").available();
    assert!((916.0..950.0).contains(&left), "{http1:?}: {left} left");
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_engine_hides_injected_usage() {
    injected_usage_is_hidden_on(Http1::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hyper_engine_hides_injected_usage() {
    injected_usage_is_hidden_on(Http1::Hyper).await;
}
