//! `usher proxy`: the sidecar's data path.
//!
//! One listener speaks HTTP/1.1 and h2c ([`listener`]), and so does each
//! upstream's own listener (`upstreams.NAME.listen`), whose requests go to
//! that upstream's routes only ([`ListenerId`]). Every request, on both
//! HTTP/1.1 engines (`engine::native`, usher's own, and `engine::hyper`),
//! on HTTP/2 and CONNECT, passes through one tower stack ([`pipeline`]):
//! respond, guard, account, route ([`route`]), limit
//! ([`usher_limit::admit`]), then the engine's own forward (through
//! [`upstream`]). Errors become answers in one place
//! (`usher_enforce::respond`). The stack is built from a [`Pipeline`]
//! snapshot (routing, upstreams, config) that a reload swaps as one.
//! [`Proxy`] (`sidecar`) wires the pieces: the lease table, the lease
//! client, pushback, metrics and reloads; [`ops`] writes the access log and
//! serves the status pages. This module holds the tree, [`serve`] and
//! [`run`]. On shutdown the listener stops accepting and in-flight requests
//! drain until a deadline.
//!
//! Inside the crate, no module imports this one, and the modules form no
//! cycle: `listener` and `ops::status` → `sidecar` (`Proxy`) → `pipeline`,
//! `engine`, `route` → `upstream`. `engine::native` imports no `listener`
//! and no `Proxy`; `upstream` imports no `engine`, and `upstream::h2conn`
//! and `upstream::pool` import no `upstream`.

#![warn(missing_docs, unreachable_pub)]

mod engine;
pub mod listener;
pub mod ops;
pub mod pipeline;
pub mod route;
mod sidecar;
pub mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use listener::{ConnServer, Http1};
pub use pipeline::Pipeline;
use usher_core::clock::Clock;
use usher_core::config::routes::RoutesConfig;
use usher_core::config::watch;
use usher_core::error::RunError;
use usher_core::net::bind;
pub use usher_enforce::metrics::Metrics;

pub use route::ListenerId;
pub use sidecar::{Proxy, UpstreamListener, readiness};
pub use usher_enforce::respond::ProxyBody;

/// How `usher proxy` runs: its flags, as the `usher` binary parsed them.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Routes file (YAML). Reloaded on SIGHUP and whenever it changes.
    pub routes: PathBuf,
    /// Proxy listener (HTTP/1.1 and h2c) [default: the file's `listen`, else 127.0.0.1:15001].
    pub listen: Option<SocketAddr>,
    /// Address for /metrics, /healthz, /readyz and /debug/status [default: the file's `admin`, else 127.0.0.1:15000].
    pub admin_listen: Option<SocketAddr>,
    /// What serves HTTP/1.1: `native` (usher's own request loop for everyday requests to
    /// HTTP/1.1 upstreams, plain or TLS, hyper for the rest) or `hyper` (hyper for everything).
    pub http1: Http1,
}

pub use usher_core::config::ConfigState;

/// Serves the proxy on `listener` until `shutdown`, then drains in-flight
/// requests for at most `drain`. At most `limits.max_connections` connections
/// are served at once; further ones wait in the kernel's accept backlog.
pub async fn serve(proxy: Arc<Proxy>, listener: TcpListener, shutdown: CancellationToken, drain: Duration) {
    serve_with(proxy, listener, shutdown, drain, Http1::default()).await
}

/// [`serve`] with a choice of what serves HTTP/1.1.
pub async fn serve_with(
    proxy: Arc<Proxy>,
    listener: TcpListener,
    shutdown: CancellationToken,
    drain: Duration,
    http1: Http1,
) {
    serve_all(proxy, vec![(listener, ListenerId::MAIN)], shutdown, drain, http1).await
}

/// [`serve_with`] on several listeners, each connection routed by the one
/// it arrived on. `limits.max_connections` bounds them all together.
pub async fn serve_all(
    proxy: Arc<Proxy>,
    listeners: Vec<(TcpListener, ListenerId)>,
    shutdown: CancellationToken,
    drain: Duration,
    http1: Http1,
) {
    let closing = CancellationToken::new();
    let server =
        ConnServer::new(proxy.config().limits).draining_on(shutdown.clone()).closing_on(closing.clone()).http1(http1);
    let slots = Arc::new(tokio::sync::Semaphore::new(server.limits().max_connections));
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut next = 0;
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
        };
        let (stream, listener) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = std::future::poll_fn(|cx| accept_any(&listeners, &mut next, cx)) => match accepted {
                (Ok((stream, _)), listener) => (stream, listener),
                (Err(e), _) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (server, proxy) = (server.clone().on_listener(listener), proxy.clone());
        let open = OpenConnection::new(&open);
        tokio::spawn(async move {
            let (_slot, _open) = (slot, open);
            if let Err(e) = server.serve(proxy, stream).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listeners);
    // Closing an idle keep-alive connection races with a request the client
    // is writing into it at that moment, which would then go unanswered. So
    // for a short grace, open connections stay open and each answer carries
    // `connection: close`: a busy client learns of the shutdown from an answer.
    #[allow(
        clippy::disallowed_methods,
        reason = "the drain grace and deadline are I/O deadlines on tokio's timer, which keeps tokio's time"
    )]
    let started = tokio::time::Instant::now();
    let grace = DRAIN_GRACE.min(drain);
    while open.load(std::sync::atomic::Ordering::SeqCst) > 0 && started.elapsed() < grace {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Then idle connections close, and busy ones after their answer.
    closing.cancel();
    let left = drain.saturating_sub(started.elapsed());
    let drained = async {
        while open.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    match tokio::time::timeout(left, drained).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!(?drain, "drain deadline passed; closing remaining connections"),
    }
}

/// The first of `listeners` with a connection (or an accept error) ready,
/// starting at `next` and moving it on, so a busy listener cannot starve the others.
fn accept_any(
    listeners: &[(TcpListener, ListenerId)],
    next: &mut usize,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<(std::io::Result<(tokio::net::TcpStream, SocketAddr)>, ListenerId)> {
    for i in 0..listeners.len() {
        let (l, id) = &listeners[(*next + i) % listeners.len()];
        if let std::task::Poll::Ready(r) = l.poll_accept(cx) {
            *next = (*next + i + 1) % listeners.len();
            return std::task::Poll::Ready((r, *id));
        }
    }
    std::task::Poll::Pending
}

/// On shutdown, how long open connections may still bring requests (each
/// answered with `connection: close`) before idle ones are closed.
pub const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Counts an accepted connection as open until dropped.
struct OpenConnection(Arc<std::sync::atomic::AtomicUsize>);

impl OpenConnection {
    fn new(open: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        OpenConnection(open.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Runs `usher proxy` until `shutdown` is cancelled.
pub async fn run(args: ProxyOptions, shutdown: CancellationToken) -> Result<(), RunError> {
    let source = args.routes.display().to_string();
    let cfg = RoutesConfig::load(&args.routes)?;
    sidecar::log_warnings(&cfg);
    let listen_addr = args.listen.unwrap_or(cfg.listen);
    let admin_addr = args.admin_listen.unwrap_or(cfg.admin);
    let drain = cfg.drain_timeout;
    let (routes, resources) = (cfg.routes.len(), cfg.resources.len());
    let proxy = Proxy::new(cfg, source.clone(), Clock::system(), prometheus::Registry::new())?;
    let listener = bind("proxy", listen_addr).await?;
    let admin = bind("admin", admin_addr).await?;
    let listen_addr = listener.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let mut listeners = vec![(listener, ListenerId::MAIN)];
    for (i, l) in proxy.listeners().iter().enumerate() {
        let bound = bind("upstream listener", l.addr).await?;
        let addr = bound.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
        tracing::info!(upstream = %l.upstream, listen = %addr, "upstream listener: every request on it goes to this upstream");
        listeners.push((bound, ListenerId::upstream(i)));
    }
    let admin_addr = admin.local_addr().map_err(|e| RunError::Other(e.to_string()))?;

    let reloader = {
        let proxy = proxy.clone();
        let path = args.routes.clone();
        watch::spawn_reloader(args.routes.clone(), shutdown.clone(), move |cause| {
            tracing::info!(?cause, "reloading routes");
            proxy.apply_config(RoutesConfig::load(&path));
        })
    };
    // The lease client outlives the listener: it releases the leases only
    // after in-flight requests have drained.
    let lease_shutdown = CancellationToken::new();
    let (client, lease_task) = {
        let pipelines = proxy.pipelines();
        let config: usher_enforce::enforcer::ConfigSource = Arc::new(move || pipelines.load().config.clone());
        usher_enforce::enforcer::start_with(
            config,
            proxy.table.clone(),
            proxy.pushback.clone(),
            &proxy.metrics.registry,
            lease_shutdown.clone(),
        )?
    };
    // Requests are accepted once every key has a lease (at once with cached
    // ones) or after a short wait for the first: the first requests of a
    // fresh sidecar are admitted, not refused. It logs what each key enforces.
    client.ready(FIRST_LEASE_WAIT).await;
    proxy.set_lease(client);
    tracing::info!(listen = %listen_addr, admin = %admin_addr, routes_file = %source, routes, resources, "usher proxy listening");
    let admin_task =
        tokio::spawn(usher_core::admin::serve(admin, ops::status::handler(proxy.clone()), shutdown.clone()));
    serve_all(proxy, listeners, shutdown.clone(), drain, args.http1).await;
    shutdown.cancel();
    lease_shutdown.cancel();
    let _ = tokio::join!(reloader, admin_task, lease_task);
    tracing::info!("usher proxy stopped");
    Ok(())
}

pub use usher_enforce::FIRST_LEASE_WAIT;
