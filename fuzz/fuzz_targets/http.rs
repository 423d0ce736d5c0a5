//! The sidecar's HTTP request path through in-memory I/O: each input is one
//! client connection's bytes, written to a `tokio::io::duplex` pair served by
//! the real `ConnServer` and `Proxy` (routes with rate and gauge resources and
//! a body limit; the upstream is a closed local port, so forwarding fails
//! fast with a 502). A panic or a connection that does not finish within
//! 10 s of the client's EOF is a failure.
#![no_main]

mod common;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::Sidecar;

const ROUTES: &str = "limits: { header_timeout: 2s, max_body_bytes: 1KiB }
upstreams:
  up: { url: \"http://127.0.0.1:9\", timeout: 2s, connect_timeout: 1s }
resources:
  api: { kind: rate, capacity: 1000000/s, burst: 1000 }
  tenant: { kind: gauge, id: \"t/{header.x-tenant}\", capacity: 5, max_keys: 50 }
routes:
  - { name: api, match: { host: api.test }, upstream: up, resources: [api, tenant] }
";

fn sidecar() -> &'static Sidecar {
    static SIDECAR: OnceLock<Sidecar> = OnceLock::new();
    SIDECAR.get_or_init(|| Sidecar::new(common::runtime(), ROUTES))
}

fuzz_target!(|data: &[u8]| {
    sidecar().connection(|mut client| async move {
        // The sidecar may stop reading early (it answered, or gave up).
        let _ = client.write_all(data).await;
        let _ = client.shutdown().await;
        let mut out = Vec::new();
        let _ = client.read_to_end(&mut out).await;
    });
});
