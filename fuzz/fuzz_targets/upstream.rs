//! The sidecar's handling of what an upstream answers: each input is the
//! bytes a real loopback upstream writes back (then it closes the
//! connection) to one request an app sends through the real `ConnServer` and
//! `Proxy` over in-memory I/O. That exercises the native path's response
//! parser, chunked transcoder and relay, and the upstream pool's reuse
//! checks. A panic, an answer that is not HTTP/1.1, or a connection not
//! finished within 10 s of the upstream's close, is a failure.
#![no_main]

mod common;

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::Sidecar;

struct World {
    sidecar: Sidecar,
    /// What the upstream answers to the next request.
    answer: Arc<Mutex<Vec<u8>>>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = common::runtime();
        let answer = Arc::new(Mutex::new(Vec::new()));
        let addr = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(upstream(listener, answer.clone()));
            addr
        });
        let routes = format!(
            "upstreams:\n  up: {{ url: \"http://{addr}\", timeout: 2s }}\n\
             resources:\n  api: {{ kind: gauge, capacity: 100 }}\n\
             routes:\n  - {{ name: api, match: {{ host: api.test }}, upstream: up, resources: [api] }}\n"
        );
        World { sidecar: Sidecar::new(rt, &routes), answer }
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
    let out = w.sidecar.connection(|mut client| async move {
        let _ = client.write_all(b"GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n").await;
        let mut out = Vec::new();
        let _ = client.read_to_end(&mut out).await;
        out
    });
    // Whatever the upstream sent, the app gets an HTTP/1.1 answer: the
    // upstream's (perhaps cut short) or usher's 502.
    assert!(out.starts_with(b"HTTP/1.1 "), "{:?}", String::from_utf8_lossy(&out));
});
