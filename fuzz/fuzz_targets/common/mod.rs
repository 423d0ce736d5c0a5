//! What the HTTP fuzz targets share: a sidecar (the real `ConnServer` and
//! `Proxy`) on a single-threaded runtime, and one client connection to it
//! through in-memory I/O, checked for hangs and panics.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::DuplexStream;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_proxy::{ConnServer, Http1, Proxy};

pub struct Sidecar {
    rt: tokio::runtime::Runtime,
    server: ConnServer,
    proxy: Arc<Proxy>,
}

/// The runtime a [`Sidecar`] runs on; start what its routes need on it first.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

impl Sidecar {
    /// A sidecar with the routes file `routes`, on `rt`.
    pub fn new(rt: tokio::runtime::Runtime, routes: &str) -> Sidecar {
        let cfg = RoutesConfig::parse("fuzz.yaml", routes).unwrap_or_else(|e| panic!("{e}"));
        let server = ConnServer::new(cfg.limits);
        let proxy = rt.block_on(async {
            let (clock, _h) = Clock::manual(Time::from_secs(1_000_000));
            Proxy::new(cfg, "fuzz.yaml".into(), clock, prometheus::Registry::new()).unwrap()
        });
        Sidecar { rt, server, proxy }
    }

    /// Serves one connection whose client side `client` drives; returns what
    /// `client` returns. Panics (a fuzz failure) if `client` is not done
    /// within 10 s, if the connection is still served 10 s after that, or if
    /// serving it panicked.
    #[allow(dead_code)] // each target compiles this module; not every one uses this
    pub fn connection<F, Fut, T>(&self, client: F) -> T
    where
        F: FnOnce(DuplexStream) -> Fut,
        Fut: Future<Output = T>,
    {
        self.connection_on(Http1::Native, client)
    }

    /// [`Sidecar::connection`] with a choice of what serves HTTP/1.1.
    pub fn connection_on<F, Fut, T>(&self, http1: Http1, client: F) -> T
    where
        F: FnOnce(DuplexStream) -> Fut,
        Fut: Future<Output = T>,
    {
        self.rt.block_on(async {
            let (client_io, io) = tokio::io::duplex(64 * 1024);
            let conn = tokio::spawn({
                let (server, proxy) = (self.server.clone().http1(http1), self.proxy.clone());
                async move {
                    let _ = server.serve(proxy, io).await;
                }
            });
            let out = tokio::time::timeout(Duration::from_secs(10), client(client_io))
                .await
                .expect("no EOF from the sidecar within 10 s");
            match tokio::time::timeout(Duration::from_secs(10), conn).await {
                Err(_) => panic!("connection still served 10 s after the client was done"),
                Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Ok(_) => {}
            }
            out
        })
    }
}
