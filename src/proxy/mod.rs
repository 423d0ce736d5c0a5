//! `usher proxy`: the sidecar's data path.
//!
//! One listener speaks HTTP/1.1 and h2c ([`listener`]). Everyday HTTP/1.1
//! requests to plain-HTTP upstreams run on the native path (`h1`): routed
//! ([`route`]), admitted ([`crate::limit::admit`]) and forwarded on one
//! task per connection. Everything else runs on hyper ([`Proxy::handle`]):
//! routed, admitted by the [`crate::limit`] tower layer and forwarded
//! ([`upstream`]). Both turn every error into a response in [`respond`].
//! CONNECT tunnels are admitted once and hold their gauge permits for
//! their lifetime. On shutdown the listener stops accepting and in-flight
//! requests drain until a deadline.

pub mod access_log;
mod h1;
mod h1pool;
mod idle;
pub mod lease;
pub mod listener;
pub mod metrics;
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
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::{Layer, ServiceExt};

use crate::clock::{Clock, Time};
use crate::config::ConfigError;
use crate::config::routes::{RoutesConfig, UpstreamConfig};
use crate::config::watch;
use crate::error::{RunError, bind};
use crate::limit::layer::{Admission, BoxError};
use crate::limit::{LeaseTable, Limit, LimitLayer};
pub use listener::{ConnServer, Http1};
pub use metrics::Metrics;
use respond::{ProxyError, error_response, is_grpc};
use route::{Route, Routing};
use upstream::{Forward, Upstream};

/// The body of every response the proxy sends.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

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

/// Everything one sidecar shares between connections and tasks.
pub struct Proxy {
    pub table: LeaseTable,
    /// The lease client, once started.
    pub lease: std::sync::OnceLock<crate::lease::LeaseClient>,
    /// Backing off from upstreams that answer 429 or 503.
    pub pushback: pushback::Pushback,
    /// One JSON line per request, when the routes file names a file.
    access_log: Option<access_log::AccessLog>,
    /// This sidecar's client id, for the access log.
    client_id: String,
    pub metrics: Arc<Metrics>,
    pub config_source: String,
    routing: ArcSwap<Routing>,
    stack: Limit<Forward>,
    roots: rustls::RootCertStore,
    /// Built upstreams, reused across reloads while their configuration is unchanged.
    upstreams: Mutex<HashMap<String, Arc<Upstream>>>,
    direct: Arc<Upstream>,
    config_state: Mutex<ConfigState>,
    config: ArcSwap<RoutesConfig>,
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
        let direct = Arc::new(Upstream::direct(&roots).map_err(|e| ConfigError::whole_file(&source, e))?);
        let upstreams = build_upstreams(&cfg, &HashMap::new(), &roots, &source)?;
        let table = LeaseTable::new(clock.clone());
        table.configure(route::specs(&cfg));
        let pushback = pushback::Pushback::new(&registry);
        let access_log = match &cfg.access_log {
            None => None,
            Some(p) => Some(access_log::AccessLog::open(p, &registry).map_err(|e| {
                ConfigError::whole_file(&source, format!("access_log: cannot open {}: {e}", p.display()))
            })?),
        };
        let client_id =
            cfg.doorman.as_ref().map_or_else(crate::config::doorman::default_client_id, |d| d.client_id.clone());
        let metrics = Arc::new(Metrics::new(registry));
        let routing = Routing::new(&cfg, &upstreams, direct.clone(), &table, &metrics);
        let stack = LimitLayer::new(clock.clone()).layer(Forward::new(metrics.clone()));
        Ok(Arc::new(Proxy {
            table,
            lease: std::sync::OnceLock::new(),
            pushback,
            access_log,
            client_id,
            metrics,
            config_source: source,
            routing: ArcSwap::from_pointee(routing),
            stack,
            roots,
            upstreams: Mutex::new(upstreams),
            direct,
            config_state: Mutex::new(ConfigState { loaded_at: Some(clock.now()), last_error: None }),
            config: ArcSwap::from_pointee(cfg),
        }))
    }

    pub fn config(&self) -> Arc<RoutesConfig> {
        self.config.load_full()
    }

    pub fn config_state(&self) -> ConfigState {
        self.config_state.lock().expect("config state lock").clone()
    }

    /// Applies a freshly read routes file, or keeps the old one and says why.
    /// Open connections are untouched; unchanged resources keep their limiter state.
    pub fn apply_config(&self, result: Result<RoutesConfig, ConfigError>) {
        let applied = result.and_then(|cfg| {
            let mut ups = self.upstreams.lock().expect("upstreams lock");
            let built = build_upstreams(&cfg, &ups, &self.roots, &self.config_source)?;
            *ups = built.clone();
            Ok((cfg, built))
        });
        let mut state = self.config_state.lock().expect("config state lock");
        match applied {
            Ok((cfg, ups)) => {
                let old = self.config.load();
                if old.listen != cfg.listen || old.admin != cfg.admin {
                    tracing::warn!("listen and admin addresses change only on restart");
                }
                let same_body =
                    crate::config::limits::ListenerLimits { max_body_bytes: cfg.limits.max_body_bytes, ..old.limits };
                if same_body != cfg.limits {
                    tracing::warn!("listener limits other than max_body_bytes change only on restart");
                }
                self.table.configure(route::specs(&cfg));
                self.routing.store(Arc::new(Routing::new(&cfg, &ups, self.direct.clone(), &self.table, &self.metrics)));
                tracing::info!(source = %self.config_source, routes = cfg.routes.len(), resources = cfg.resources.len(), "routes reloaded");
                self.config.store(Arc::new(cfg));
                self.metrics.config_reloads.inc();
                state.loaded_at = Some(self.table.clock().now());
                state.last_error = None;
            }
            Err(e) => {
                self.metrics.config_reload_errors.inc();
                tracing::error!(source = %self.config_source, "routes file rejected, keeping the previous one:\n{e}");
                state.last_error = Some(e.to_string());
            }
        }
    }

    /// Handles one request from the app.
    pub async fn handle(self: Arc<Self>, mut req: Request<Incoming>) -> Response<ProxyBody> {
        let grpc = is_grpc(req.headers());
        let arrived = self.table.clock().now();
        if req.headers().get_all(header::VIA).iter().any(|v| v.to_str().is_ok_and(|v| v.contains(upstream::VIA))) {
            return respond::proxy_error(&ProxyError::Loop, grpc);
        }
        // RFC 9110 §7.2: more than one Host is a 400, whatever routing would make of it.
        if req.headers().get_all(header::HOST).iter().nth(1).is_some() {
            return respond::proxy_error(&ProxyError::BadRequest("more than one Host header".into()), grpc);
        }
        if let Some(limit) = self.config.load().limits.max_body_bytes {
            // A declared length over the limit is refused before anything is
            // forwarded; a body without one is cut off where it passes the limit.
            if req.body().size_hint().lower() > limit {
                return respond::proxy_error(&ProxyError::BodyTooLarge { limit }, grpc);
            }
            req.extensions_mut().insert(upstream::BodyLimit(limit));
        }
        let resolved = match self.routing.load().resolve(&req) {
            Ok(r) => r,
            Err(e) => return self.route_error(&e, grpc, arrived),
        };
        let route = resolved.route.clone();
        let in_flight = InFlight::new(&route.metrics.in_flight);
        if req.method() == Method::CONNECT {
            return self.connect(req, resolved, in_flight).await;
        }
        let keys = resolved.plan.clone();
        req.extensions_mut().insert(resolved.plan);
        req.extensions_mut().insert(resolved.target);
        match self.stack.clone().oneshot(req).await {
            Ok(resp) => {
                let admission = resp.extensions().get::<Admission>().copied();
                let retry_after = || pushback::retry_after(resp.headers());
                self.record_answer(&route, &keys, admission, resp.status(), retry_after, arrived);
                let body_errors = route.metrics.body_errors.clone();
                resp.map(|b| {
                    Tracked { inner: b, _guard: in_flight, body_errors }
                        .map_err(|e| Box::new(e) as BoxError)
                        .boxed_unsync()
                })
            }
            Err(err) => match err.downcast::<crate::limit::Refused>() {
                Ok(refused) => self.refuse(&route, &keys, &refused, grpc, arrived),
                Err(err) => self.upstream_failed(&route, &keys, err, grpc, arrived),
            },
        }
    }

    /// Accounts for an upstream's answer (the one outcome of a request that
    /// reached it): admission metrics, pushback, the access log.
    fn record_answer(
        &self,
        route: &Route,
        plan: &crate::limit::Plan,
        admission: Option<Admission>,
        status: StatusCode,
        retry_after: impl FnOnce() -> Option<Duration>,
        arrived: Time,
    ) {
        self.record_admission(route, admission);
        self.observe_pushback(&route.name, plan, status, retry_after);
        let (outcome, waited) = match admission {
            Some(a) if a.paced => ("paced", a.waited),
            Some(a) => ("admitted", a.waited),
            None => ("admitted", Duration::ZERO),
        };
        self.log(&route.name, plan, outcome, waited, status, arrived);
    }

    /// Accounts for a refusal and makes its answer (`429`, or a gRPC status).
    fn refuse(
        &self,
        route: &Route,
        plan: &crate::limit::Plan,
        refused: &crate::limit::Refused,
        grpc: bool,
        arrived: Time,
    ) -> Response<ProxyBody> {
        self.record_refusal(route, refused);
        // While an upstream's Retry-After holds a key of the request, the 429 says when that ends.
        let now = self.table.clock().now();
        let hold = plan.items.iter().filter_map(|(l, _)| self.pushback.hold_left(l.id(), now)).max();
        let resp = match hold {
            Some(hold) => respond::refused_held(refused, hold, grpc),
            None => respond::refused(refused, grpc),
        };
        self.log(&route.name, plan, "refused", refused.waited, resp.status(), arrived);
        resp
    }

    /// Accounts for an upstream that failed before its answer's head and
    /// makes the `502`/`504` (or gRPC status).
    fn upstream_failed(
        &self,
        route: &Route,
        plan: &crate::limit::Plan,
        err: BoxError,
        grpc: bool,
        arrived: Time,
    ) -> Response<ProxyBody> {
        route.metrics.upstream_error.inc();
        tracing::debug!(route = %route.name, error = %err, "upstream error");
        let resp = error_response(err, grpc);
        self.log(&route.name, plan, "upstream_error", Duration::ZERO, resp.status(), arrived);
        resp
    }

    /// The answer to a request routing could not place (no route, too many keys).
    fn route_error(&self, e: &ProxyError, grpc: bool, arrived: Time) -> Response<ProxyBody> {
        self.metrics.requests.with_label_values(&["_none", "no_route"]).inc();
        let resp = respond::proxy_error(e, grpc);
        self.log("_none", &crate::limit::Plan::default(), "no_route", Duration::ZERO, resp.status(), arrived);
        resp
    }

    /// Appends one line to the access log, if there is one.
    fn log(
        &self,
        route: &str,
        keys: &crate::limit::Plan,
        outcome: &str,
        waited: Duration,
        status: StatusCode,
        arrived: Time,
    ) {
        let Some(log) = &self.access_log else { return };
        let now = self.table.clock().now();
        let total = now.since(arrived);
        let upstream = matches!(outcome, "admitted" | "paced" | "upstream_error").then(|| total.saturating_sub(waited));
        log.record(&access_log::Entry {
            time: now.as_secs_f64(),
            client: self.client_id.clone(),
            route: route.to_string(),
            resources: keys
                .items
                .iter()
                .map(|(l, _)| access_log::KeyEntry {
                    resource: l.spec().name.clone(),
                    id: l.id().to_string(),
                    kind: match l.kind() {
                        crate::limit::Kind::Rate => "rate".into(),
                        crate::limit::Kind::Gauge => "gauge".into(),
                    },
                    capacity: l.capacity(),
                })
                .collect(),
            outcome: outcome.to_string(),
            wait_ms: waited.as_secs_f64() * 1e3,
            status: status.as_u16(),
            upstream_ms: upstream.map(|d| d.as_secs_f64() * 1e3),
            total_ms: total.as_secs_f64() * 1e3,
        });
    }

    /// Feeds an upstream answer (its status and `Retry-After`) to the route's pushback state.
    fn observe_pushback(
        &self,
        route: &str,
        keys: &crate::limit::Plan,
        status: StatusCode,
        retry_after: impl FnOnce() -> Option<Duration>,
    ) {
        // The common case (a success while nothing is backed off) costs one atomic load.
        if keys.is_empty() || self.pushback.is_quiet(status) {
            return;
        }
        let cfg = self.config();
        let Some(rc) = cfg.routes.iter().find(|r| r.name == route) else { return };
        let ids: Vec<(String, f64)> = keys.items.iter().map(|(l, _)| (l.id().to_string(), l.capacity())).collect();
        let now = self.table.clock().now();
        for (id, capacity) in self.pushback.on_response(&ids, status, retry_after(), now, &rc.pushback) {
            tracing::debug!(route, resource_id = %id, capacity, %status, "upstream pushback");
            self.table.set_capacity(&id, capacity);
        }
    }

    fn record_admission(&self, route: &Route, admission: Option<Admission>) {
        let paced = admission.is_some_and(|a| a.paced);
        if paced { &route.metrics.paced } else { &route.metrics.admitted }.inc();
        let waited = admission.map_or(0.0, |a| a.waited.as_secs_f64());
        for r in &route.resources {
            if paced { &r.metrics.paced } else { &r.metrics.admitted }.inc();
            r.metrics.wait.observe(waited);
        }
    }

    fn record_refusal(&self, route: &Route, refused: &crate::limit::Refused) {
        route.metrics.refused.inc();
        match route.resources.iter().find(|r| r.metrics.name == refused.resource) {
            Some(r) => r.metrics.refused.inc(),
            None => self.metrics.resource_requests.with_label_values(&[&refused.resource, "refused"]).inc(),
        }
    }

    /// A CONNECT tunnel: admitted once, holding its gauge permits until it closes.
    async fn connect(
        &self,
        req: Request<Incoming>,
        resolved: route::Resolved,
        in_flight: InFlight,
    ) -> Response<ProxyBody> {
        let route = &resolved.route;
        let Some(authority) = req.uri().authority().map(|a| a.to_string()) else {
            return respond::proxy_error(&ProxyError::BadRequest("CONNECT needs host:port".into()), false);
        };
        let admitted = match crate::limit::admit::admit(&resolved.plan, self.table.clock()).await {
            Ok(a) => a,
            Err(r) => {
                self.record_refusal(route, &r);
                return respond::refused(&r, false);
            }
        };
        let admission = Admission { waited: admitted.waited, paced: admitted.paced };
        self.record_admission(route, Some(admission));
        let stream =
            match tokio::time::timeout(upstream::DIRECT_CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&authority))
                .await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return respond::proxy_error(
                        &ProxyError::UpstreamConnect { upstream: authority, reason: e.to_string() },
                        false,
                    );
                }
                Err(_) => {
                    return respond::proxy_error(
                        &ProxyError::UpstreamTimeout { upstream: authority, after: upstream::DIRECT_CONNECT_TIMEOUT },
                        false,
                    );
                }
            };
        tokio::spawn(async move {
            let _held = (admitted, in_flight);
            match hyper::upgrade::on(req).await {
                Ok(upgraded) => {
                    let mut stream = stream;
                    let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(upgraded), &mut stream).await;
                }
                Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
            }
        });
        Response::new(respond::full(Vec::new()))
    }
}

fn build_upstreams(
    cfg: &RoutesConfig,
    existing: &HashMap<String, Arc<Upstream>>,
    roots: &rustls::RootCertStore,
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
            _ => match Upstream::new(uc.clone(), roots) {
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

/// Counts a request in flight for its route until its response body ends.
struct InFlight(prometheus::IntGauge);

impl InFlight {
    fn new(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        InFlight(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

pin_project! {
    struct Tracked<B> {
        #[pin]
        inner: B,
        _guard: InFlight,
        body_errors: prometheus::IntCounter,
    }
}

impl<B: Body> Body for Tracked<B>
where
    B::Error: std::fmt::Display,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        if let Some(Err(e)) = &frame {
            // The status is already sent: the client sees its body cut; count it.
            this.body_errors.inc();
            tracing::debug!(error = %e, "response body failed after the headers");
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
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
    let (client, lease_task) = lease::start(proxy.clone(), lease_shutdown.clone());
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
