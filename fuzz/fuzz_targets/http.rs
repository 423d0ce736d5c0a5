//! The sidecar's HTTP request path through in-memory I/O: each input is one
//! client connection's bytes, written to a `tokio::io::duplex` pair served by
//! the real `ConnServer` and `Proxy` (routes with rate and gauge resources and
//! a body limit; the upstream is a closed local port, so forwarding fails
//! fast with a 502). A panic or a connection that does not finish within
//! 10 s of the client's EOF is a failure.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usher::clock::{Clock, Time};
use usher::config::routes::RoutesConfig;
use usher::proxy::{ConnServer, Proxy};

const ROUTES: &str = "limits: { header_timeout: 2s, max_body_bytes: 1KiB }
upstreams:
  up: { url: \"http://127.0.0.1:9\", timeout: 2s, connect_timeout: 1s }
resources:
  api: { kind: rate, capacity: 1000000/s, burst: 1000 }
  tenant: { kind: gauge, id: \"t/{header.x-tenant}\", capacity: 5, max_keys: 50 }
routes:
  - { name: api, match: { host: api.test }, upstream: up, resources: [api, tenant] }
";

struct World {
    rt: tokio::runtime::Runtime,
    server: ConnServer,
    proxy: Arc<Proxy>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let cfg = RoutesConfig::parse("fuzz.yaml", ROUTES).unwrap_or_else(|e| panic!("{e}"));
        let server = ConnServer::new(cfg.limits);
        let proxy = rt.block_on(async {
            let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
            Proxy::new(cfg, "fuzz.yaml".into(), clock, prometheus::Registry::new()).unwrap()
        });
        World { rt, server, proxy }
    })
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    w.rt.block_on(async {
        let (mut client, io) = tokio::io::duplex(64 * 1024);
        let conn = tokio::spawn({
            let (server, proxy) = (w.server.clone(), w.proxy.clone());
            async move {
                let _ = server.serve(proxy, io).await;
            }
        });
        let exchange = async {
            let _ = client.write_all(data).await;
            let _ = client.shutdown().await;
            let mut out = Vec::new();
            let _ = client.read_to_end(&mut out).await;
        };
        tokio::time::timeout(Duration::from_secs(10), exchange).await.expect("no EOF from the sidecar within 10 s");
        match tokio::time::timeout(Duration::from_secs(10), conn).await {
            Err(_) => panic!("connection still served 10 s after the client's EOF"),
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(_) => {}
        }
    });
});
