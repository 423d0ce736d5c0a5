//! `usher proxy`: the sidecar's data path.
//!
//! One listener speaks HTTP/1.1 and h2c ([`listener`]). Every request, on
//! both HTTP/1.1 engines (the native path, `h1`, and hyper), on HTTP/2 and
//! CONNECT, passes through one tower stack ([`pipeline`]): guard, account,
//! route ([`route`]), limit ([`crate::limit::admit`]), then the engine's own
//! forward ([`upstream`] for hyper, `h1` for the native path). Errors become
//! answers in one place ([`respond`]). The stack is built from a [`Pipeline`]
//! snapshot (routing, upstreams, config) that a reload swaps as one.
//! [`Proxy`] wires the pieces: the lease table, the lease client, pushback,
//! metrics and reloads. On shutdown the listener stops accepting and
//! in-flight requests drain until a deadline.

pub mod access_log;
mod body;
mod general;
mod guard;
mod h1;
mod h1pool;
mod idle;
pub mod lease;
pub mod listener;
pub mod metrics;
pub mod pipeline;
mod pool;
pub mod pushback;
pub mod respond;
pub mod route;
mod status;
pub mod upstream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use pin_project_lite::pin_project;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::clock::Clock;
use crate::config::ConfigError;
use crate::config::routes::{RoutesConfig, UpstreamConfig};
use crate::config::watch;
use crate::error::{RunError, bind};
use crate::limit::LeaseTable;
use crate::limit::layer::BoxError;
pub use listener::{ConnServer, Http1};
pub use metrics::Metrics;
pub use pipeline::Pipeline;
use pipeline::{Accounts, Exchange, Held, Reply};
use route::Routing;
use upstream::{Upstream, UpstreamBody};

pub use respond::ProxyBody;

/// `usher proxy` flags; each can also be set as `USHER_<FLAG>`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// Routes file (YAML). Reloaded on SIGHUP and whenever it changes.
    #[arg(long, env = "USHER_ROUTES", value_name = "FILE")]
    pub routes: PathBuf,
    /// Proxy listener (HTTP/1.1 and h2c) [default: the file's `listen`, else 127.0.0.1:15001].
    #[arg(long, env = "USHER_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Address for /metrics, /healthz, /readyz and /debug/status [default: the file's `admin`, else 127.0.0.1:15000].
    #[arg(long, env = "USHER_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// What serves HTTP/1.1: `native` (usher's own request loop for everyday requests to
    /// plain-HTTP/1.1 upstreams, hyper for the rest) or `hyper` (hyper for everything).
    #[arg(long, env = "USHER_HTTP1", value_enum, default_value_t = Http1::Native)]
    pub http1: Http1,
}

pub use crate::config::ConfigState;

/// One sidecar's wiring: the lease table and lease client, pushback,
/// metrics, and the current [`Pipeline`] that requests are served by.
pub struct Proxy {
    pub table: Arc<LeaseTable>,
    /// The lease client, once started.
    pub lease: std::sync::OnceLock<crate::lease::LeaseClient>,
    /// Backing off from upstreams that answer 429 or 503.
    pub pushback: Arc<pushback::Pushback>,
    pub metrics: Arc<Metrics>,
    pub config_source: String,
    /// The snapshot requests are served by; a reload swaps it whole.
    pipeline: Arc<ArcSwap<Pipeline>>,
    accounts: Arc<Accounts>,
    clock: Clock,
    roots: rustls::RootCertStore,
    /// Where requests no upstream serves go (passthrough, CONNECT).
    direct: Arc<Upstream>,
    /// Serialises reloads; the request path never takes it.
    config_state: Mutex<ConfigState>,
}

impl Proxy {
    /// Builds a proxy for `cfg`. `clock` drives every limiter (tests pass a manual one).
    pub fn new(
        cfg: RoutesConfig,
        source: String,
        clock: Clock,
        registry: prometheus::Registry,
    ) -> Result<Arc<Self>, ConfigError> {
        let roots = upstream::system_roots();
        let metrics = Arc::new(Metrics::new(registry));
        let direct = Arc::new(Upstream::direct(&roots, &metrics).map_err(|e| ConfigError::whole_file(&source, e))?);
        let upstreams = build_upstreams(&cfg, &HashMap::new(), &roots, &metrics, &source)?;
        let table = Arc::new(LeaseTable::new(clock.clone()));
        table.configure(route::specs(&cfg));
        let pushback = Arc::new(pushback::Pushback::new(&metrics.registry));
        let access_log = match &cfg.access_log {
            None => None,
            Some(p) => Some(access_log::AccessLog::open(p, &metrics.registry).map_err(|e| {
                ConfigError::whole_file(&source, format!("access_log: cannot open {}: {e}", p.display()))
            })?),
        };
        let client_id =
            cfg.doorman.as_ref().map_or_else(crate::config::doorman::default_client_id, |d| d.client_id.clone());
        let accounts = Arc::new(Accounts {
            metrics: metrics.clone(),
            access_log,
            client_id,
            pushback: pushback.clone(),
            table: table.clone(),
        });
        let routing = Routing::new(&cfg, &upstreams, direct.clone(), &table, &metrics);
        let pipeline = Pipeline::new(Arc::new(cfg), routing, upstreams, accounts.clone(), clock.clone());
        Ok(Arc::new(Proxy {
            table,
            lease: std::sync::OnceLock::new(),
            pushback,
            metrics,
            config_source: source,
            pipeline: Arc::new(ArcSwap::from_pointee(pipeline)),
            accounts,
            config_state: Mutex::new(ConfigState { loaded_at: Some(clock.now()), last_error: None }),
            clock,
            roots,
            direct,
        }))
    }

    pub fn config(&self) -> Arc<RoutesConfig> {
        self.pipeline.load().config.clone()
    }

    /// The snapshot requests are served by now.
    pub fn pipeline(&self) -> Arc<Pipeline> {
        self.pipeline.load_full()
    }

    /// Where the current snapshot is kept, for those that follow reloads.
    pub fn pipelines(&self) -> Arc<ArcSwap<Pipeline>> {
        self.pipeline.clone()
    }

    pub fn config_state(&self) -> ConfigState {
        self.config_state.lock().expect("config state lock").clone()
    }

    /// Applies a freshly read routes file, or keeps the old one and says why.
    /// Open connections are untouched; unchanged resources keep their limiter
    /// state, unchanged upstreams their connections. The new routing,
    /// upstreams and limits take effect together, as one snapshot.
    pub fn apply_config(&self, result: Result<RoutesConfig, ConfigError>) {
        // Held throughout, so two reloads never interleave.
        let mut state = self.config_state.lock().expect("config state lock");
        let old = self.pipeline.load_full();
        let applied = result.and_then(|cfg| {
            let ups = build_upstreams(&cfg, &old.upstreams, &self.roots, &self.metrics, &self.config_source)?;
            Ok((cfg, ups))
        });
        match applied {
            Ok((cfg, ups)) => {
                if old.config.listen != cfg.listen || old.config.admin != cfg.admin {
                    tracing::warn!("listen and admin addresses change only on restart");
                }
                let same_body = crate::config::limits::ListenerLimits {
                    max_body_bytes: cfg.limits.max_body_bytes,
                    ..old.config.limits
                };
                if same_body != cfg.limits {
                    tracing::warn!("listener limits other than max_body_bytes change only on restart");
                }
                self.table.configure(route::specs(&cfg));
                let routing = Routing::new(&cfg, &ups, self.direct.clone(), &self.table, &self.metrics);
                tracing::info!(source = %self.config_source, routes = cfg.routes.len(), resources = cfg.resources.len(), "routes reloaded");
                self.pipeline.store(Arc::new(Pipeline::new(
                    Arc::new(cfg),
                    routing,
                    ups,
                    self.accounts.clone(),
                    self.clock.clone(),
                )));
                self.metrics.config_reloads.inc();
                state.loaded_at = Some(self.clock.now());
                state.last_error = None;
            }
            Err(e) => {
                self.metrics.config_reload_errors.inc();
                tracing::error!(source = %self.config_source, "routes file rejected, keeping the previous one:\n{e}");
                state.last_error = Some(e.to_string());
            }
        }
    }

    /// Serves one request that hyper read (HTTP/1.1, HTTP/2, CONNECT) through the pipeline.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let pipeline = self.pipeline.load_full();
        let Ok(reply) = pipeline.stack(general::Forward).call(Exchange::new(req)).await;
        match reply {
            Reply::Upstream { answer, held } => answer.map(|b| Tracked { inner: b, held, ended: false }.boxed_unsync()),
            Reply::Made(resp) => resp,
            // hyper's forward serves every target.
            Reply::Unserved(why) => unreachable!("the general path refused a target ({why})"),
        }
    }
}

fn build_upstreams(
    cfg: &RoutesConfig,
    existing: &HashMap<String, Arc<Upstream>>,
    roots: &rustls::RootCertStore,
    metrics: &Metrics,
    source: &str,
) -> Result<HashMap<String, Arc<Upstream>>, ConfigError> {
    let mut out = HashMap::new();
    let mut errors = Vec::new();
    for (name, uc) in &cfg.upstreams {
        match existing.get(name) {
            // Same configuration (and CA file unchanged on disk is assumed): keep the pool.
            Some(u) if same_upstream(&u.config, uc) => {
                out.insert(name.clone(), u.clone());
            }
            _ => match Upstream::new(uc.clone(), roots, metrics) {
                Ok(u) => {
                    out.insert(name.clone(), Arc::new(u));
                }
                Err(e) => errors.push(format!("upstreams.{name}: {e}")),
            },
        }
    }
    if errors.is_empty() { Ok(out) } else { Err(ConfigError::whole_file(source, errors.join("; "))) }
}

fn same_upstream(a: &UpstreamConfig, b: &UpstreamConfig) -> bool {
    a == b
}

pin_project! {
    /// An upstream's response body on the general path: holds what its
    /// request holds (gauge permits, in flight) until it ends, and counts a
    /// failure after the head was sent.
    struct Tracked {
        #[pin]
        inner: UpstreamBody,
        held: Held,
        // The body ended early (gRPC trailers made of an error): the inner body is done with.
        ended: bool,
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        match &frame {
            // The status is already sent: a gRPC client gets trailers with a
            // status, any other sees its body cut; counted either way.
            Some(Err(e)) => {
                tracing::debug!(error = %e, "response body failed after the headers");
                if let Some(trailers) = this.held.body_error(e) {
                    *this.ended = true;
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
            }
            None => *this.held = Held::default(),
            // The last data: what the request holds is free before hyper
            // writes it, so a client that has the whole answer finds it free.
            Some(Ok(_)) => {
                if this.inner.is_end_stream() {
                    *this.held = Held::default();
                }
            }
        }
        Poll::Ready(frame.map(|f| f.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

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
    let closing = CancellationToken::new();
    let server =
        ConnServer::new(proxy.config().limits).draining_on(shutdown.clone()).closing_on(closing.clone()).http1(http1);
    let slots = Arc::new(tokio::sync::Semaphore::new(server.limits().max_connections));
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
        };
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (server, proxy) = (server.clone(), proxy.clone());
        let open = OpenConnection::new(&open);
        tokio::spawn(async move {
            let (_slot, _open) = (slot, open);
            if let Err(e) = server.serve(proxy, stream).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Closing an idle keep-alive connection races with a request the client
    // is writing into it at that moment, which would then go unanswered. So
    // for a short grace, open connections stay open and each answer carries
    // `connection: close`: a busy client learns of the shutdown from an answer.
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
pub async fn run(args: ProxyArgs, shutdown: CancellationToken) -> Result<(), RunError> {
    let source = args.routes.display().to_string();
    let cfg = RoutesConfig::load(&args.routes)?;
    let listen_addr = args.listen.unwrap_or(cfg.listen);
    let admin_addr = args.admin_listen.unwrap_or(cfg.admin);
    let drain = cfg.drain_timeout;
    let (routes, resources) = (cfg.routes.len(), cfg.resources.len());
    let proxy = Proxy::new(cfg, source.clone(), Clock::system(), prometheus::Registry::new())?;
    let listener = bind("proxy", listen_addr).await?;
    let admin = bind("admin", admin_addr).await?;
    let listen_addr = listener.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
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
    let (client, lease_task) = lease::start(&proxy, lease_shutdown.clone());
    // Requests are accepted once every key has a lease (at once with cached
    // ones) or after a short wait for the first: the first requests of a
    // fresh sidecar are admitted, not refused. It logs what each key enforces.
    client.ready(FIRST_LEASE_WAIT).await;
    let _ = proxy.lease.set(client);
    tracing::info!(listen = %listen_addr, admin = %admin_addr, routes_file = %source, routes, resources, "usher proxy listening");
    let admin_task = tokio::spawn(crate::admin::serve(admin, status::handler(proxy.clone()), shutdown.clone()));
    serve_with(proxy, listener, shutdown.clone(), drain, args.http1).await;
    shutdown.cancel();
    lease_shutdown.cancel();
    let _ = tokio::join!(reloader, admin_task, lease_task);
    tracing::info!("usher proxy stopped");
    Ok(())
}

/// How long start-up waits for the first leases before accepting requests
/// (no wait when every key has a cached lease); then keys follow `on_expiry`.
pub const FIRST_LEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A status code for readiness: the proxy is ready once its routes are loaded.
pub fn readiness(proxy: &Proxy) -> StatusCode {
    if proxy.config_state().loaded_at.is_some() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}
