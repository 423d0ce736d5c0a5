//! The sidecar's handling of what an upstream answers: each input is the
//! bytes a real loopback upstream writes back (then it closes the
//! connection) to one request an app sends through the real `ConnServer` and
//! `Proxy` over in-memory I/O. That exercises the native path's response
//! parser, chunked transcoder and relay, and the upstream pool's reuse
//! checks. A panic, an answer that is not HTTP/1.1, or a connection not
//! finished within 10 s of the upstream's close, is a failure.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usher::clock::{Clock, Time};
use usher::config::routes::RoutesConfig;
use usher::proxy::{ConnServer, Proxy};

struct World {
    rt: tokio::runtime::Runtime,
    server: ConnServer,
    proxy: Arc<Proxy>,
    /// What the upstream answers to the next request.
    answer: Arc<Mutex<Vec<u8>>>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let answer = Arc::new(Mutex::new(Vec::new()));
        let (server, proxy) = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(upstream(listener, answer.clone()));
            let routes = format!(
                "upstreams:\n  up: {{ url: \"http://{addr}\", timeout: 2s }}\n\
                 resources:\n  api: {{ kind: gauge, capacity: 100 }}\n\
                 routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up, resources: [api] }}\n"
            );
            let cfg = RoutesConfig::parse("fuzz.yaml", &routes).unwrap_or_else(|e| panic!("{e}"));
            let server = ConnServer::new(cfg.limits);
            let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
            (server, Proxy::new(cfg, "fuzz.yaml".into(), clock, prometheus::Registry::new()).unwrap())
        });
        World { rt, server, proxy, answer }
    })
}

/// Answers each connection's first request head with the current input, then closes.
async fn upstream(listener: tokio::net::TcpListener, answer: Arc<Mutex<Vec<u8>>>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else { return };
        let answer = answer.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let bytes = answer.lock().unwrap().clone();
            let _ = s.write_all(&bytes).await;
            let _ = s.shutdown().await;
        });
    }
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    *w.answer.lock().unwrap() = data.to_vec();
    w.rt.block_on(async {
        let (mut client, io) = tokio::io::duplex(64 * 1024);
        let conn = tokio::spawn({
            let (server, proxy) = (w.server.clone(), w.proxy.clone());
            async move {
                let _ = server.serve(proxy, io).await;
            }
        });
        let exchange = async {
            let _ = client.write_all(b"GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n").await;
            let mut out = Vec::new();
            let _ = client.read_to_end(&mut out).await;
            out
        };
        let out = tokio::time::timeout(Duration::from_secs(10), exchange).await.expect("no EOF from the sidecar within 10 s");
        // Whatever the upstream sent, the app gets an HTTP/1.1 answer: the
        // upstream's (perhaps cut short) or usher's 502.
        assert!(out.starts_with(b"HTTP/1.1 "), "{:?}", String::from_utf8_lossy(&out));
        match tokio::time::timeout(Duration::from_secs(10), conn).await {
            Err(_) => panic!("connection still served 10 s after its answer"),
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(_) => {}
        }
    });
});
