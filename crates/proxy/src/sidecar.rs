//! [`Proxy`]: one sidecar's wiring. The lease table, the lease client's
//! handle, pushback and metrics, which live as long as the process, and the
//! current [`Pipeline`] snapshot (routing, upstreams, config), which a reload
//! replaces as one. It serves hyper's requests through the pipeline; the
//! native engine reaches the pipeline through `native::Services` instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tower::Service;

use super::engine::hyper as hyper_engine;
use super::engine::native;
use super::ops::access_log;
use super::pipeline::{Accounts, Exchange, Pipeline, Reply};
use super::route::{ListenerId, Routing};
use super::upstream::{self, Upstream};
use usher_core::clock::Clock;
use usher_core::config::routes::{RoutesConfig, UpstreamConfig};
use usher_core::config::{ConfigError, ConfigState};
use usher_enforce::metrics::Metrics;
use usher_enforce::pushback;
use usher_enforce::respond::ProxyBody;
use usher_limit::LeaseTable;

/// One sidecar's wiring: the lease table and lease client, pushback,
/// metrics, and the current [`Pipeline`] that requests are served by.
pub struct Proxy {
    /// The limiters' keys and the capacities leased for them.
    pub table: Arc<LeaseTable>,
    /// The lease client, once started.
    pub lease: std::sync::OnceLock<usher_lease::LeaseClient>,
    /// Backing off from upstreams that answer 429 or 503.
    pub pushback: Arc<pushback::Pushback>,
    /// The proxy's metrics, in its registry.
    pub metrics: Arc<Metrics>,
    /// Where the routes file was read from, for logs and status pages.
    pub config_source: String,
    /// The snapshot requests are served by; a reload swaps it whole.
    pub(super) pipeline: Arc<ArcSwap<Pipeline>>,
    accounts: Arc<Accounts>,
    clock: Clock,
    roots: rustls::RootCertStore,
    /// Where requests no upstream serves go (passthrough, CONNECT).
    direct: Arc<Upstream>,
    /// Serialises reloads; the request path never takes it.
    config_state: Mutex<ConfigState>,
    /// The upstream listeners, fixed at start ([`ListenerId`] order).
    listeners: Vec<UpstreamListener>,
}

/// Logs the settings of a routes file that are taken but ignored, each
/// with its position (at start and on every reload that applies the file).
pub(crate) fn log_warnings(cfg: &RoutesConfig) {
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
}

/// An upstream's own listener (`upstreams.NAME.listen`): every request on it goes to that upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamListener {
    /// The upstream's name.
    pub upstream: String,
    /// The address it listens on.
    pub addr: std::net::SocketAddr,
}

impl UpstreamListener {
    /// The upstream listeners a routes file asks for, by upstream name.
    pub fn of(cfg: &RoutesConfig) -> Vec<UpstreamListener> {
        cfg.upstreams
            .values()
            .filter_map(|u| Some(UpstreamListener { upstream: u.name.clone(), addr: u.listen? }))
            .collect()
    }
}

impl Proxy {
    /// Hands the proxy its lease client, once: status pages show its leases
    /// and a 429 says why a key enforces 0.
    pub fn set_lease(&self, client: usher_lease::LeaseClient) {
        let _ = self.accounts.zero_reasons.set(client.zero_reasons());
        let _ = self.lease.set(client);
    }

    /// Builds a proxy for `cfg`. `clock` drives every limiter (tests pass a manual one).
    pub fn new(
        cfg: RoutesConfig,
        source: String,
        clock: Clock,
        registry: prometheus::Registry,
    ) -> Result<Arc<Self>, ConfigError> {
        let roots = upstream::system_roots();
        let metrics = Arc::new(Metrics::new(registry));
        // Every hand-off reason is exported from the start, at 0.
        for reason in native::why::ALL {
            metrics.http1_handoffs.with_label_values(&[reason]);
        }
        let direct = Arc::new(Upstream::direct(&roots, &metrics).map_err(|e| ConfigError::whole_file(&source, e))?);
        let upstreams = build_upstreams(&cfg, &HashMap::new(), &roots, &metrics, &source)?;
        let table = Arc::new(LeaseTable::new(clock.clone()));
        table.configure(usher_enforce::resource::specs(&cfg));
        let pushback = Arc::new(pushback::Pushback::new(&metrics.registry));
        let access_log = match &cfg.access_log {
            None => None,
            Some(p) => Some(access_log::AccessLog::open(p, &metrics.registry).map_err(|e| {
                ConfigError::whole_file(&source, format!("access_log: cannot open {}: {e}", p.display()))
            })?),
        };
        let client_id =
            cfg.doorman.as_ref().map_or_else(usher_core::config::doorman::default_client_id, |d| d.client_id.clone());
        let accounts = Arc::new(Accounts {
            metrics: metrics.clone(),
            access_log,
            client_id,
            pushback: pushback.clone(),
            table: table.clone(),
            zero_reasons: std::sync::OnceLock::new(),
        });
        let listeners = UpstreamListener::of(&cfg);
        let routing = Routing::new(&cfg, &upstreams, direct.clone(), &table, &metrics);
        let views = listener_routings(&cfg, &listeners, &upstreams, &direct, &table, &metrics);
        let pipeline = Pipeline::new(Arc::new(cfg), routing, views, upstreams, accounts.clone(), clock.clone());
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
            listeners,
        }))
    }

    /// The upstream listeners, fixed at start: the `i`th is [`ListenerId::upstream`]`(i)`.
    pub fn listeners(&self) -> &[UpstreamListener] {
        &self.listeners
    }

    /// The routes file in force.
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

    /// When the routes file in force was loaded, and the last reload's error.
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
                if UpstreamListener::of(&cfg) != self.listeners {
                    let kept: Vec<String> =
                        self.listeners.iter().map(|l| format!("{}={}", l.upstream, l.addr)).collect();
                    tracing::warn!(
                        kept = %kept.join(","),
                        "upstream listeners change only on restart: those opened at start stay open, each serving its upstream's routes"
                    );
                }
                log_warnings(&cfg);
                self.table.configure(usher_enforce::resource::specs(&cfg));
                let routing = Routing::new(&cfg, &ups, self.direct.clone(), &self.table, &self.metrics);
                let views = listener_routings(&cfg, &self.listeners, &ups, &self.direct, &self.table, &self.metrics);
                let (routes, resources) = (cfg.routes.len(), cfg.resources.len());
                self.pipeline.store(Arc::new(Pipeline::new(
                    Arc::new(cfg),
                    routing,
                    views,
                    ups,
                    self.accounts.clone(),
                    self.clock.clone(),
                )));
                // The lease client reads the routes file in force with the
                // demand: woken again now that it is stored (the table's own
                // nudge above came before, and a read in between saw the old
                // file and may have gone quiet for minutes).
                self.table.activity().nudge();
                self.metrics.config_reloads.inc();
                state.loaded_at = Some(self.clock.now());
                state.last_error = None;
                // Once in force: a request after this line is served by the new routes.
                tracing::info!(source = %self.config_source, routes, resources, "routes reloaded");
            }
            Err(e) => {
                self.metrics.config_reload_errors.inc();
                tracing::error!(source = %self.config_source, "routes file rejected, keeping the previous one:\n{e}");
                state.last_error = Some(e.to_string());
            }
        }
    }

    /// Serves one request that hyper read (HTTP/1.1, HTTP/2, CONNECT) on
    /// the main listener through the pipeline.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        self.handle_on(ListenerId::MAIN, req).await
    }

    /// Serves one request that hyper read on `listener` through the pipeline.
    pub async fn handle_on(&self, listener: ListenerId, req: Request<Incoming>) -> Response<ProxyBody> {
        let pipeline = self.pipeline.load_full();
        let Ok(reply) = pipeline.stack_on(listener, hyper_engine::Forward).call(Exchange::new(req)).await;
        match reply {
            Reply::Upstream { answer, held } => hyper_engine::respond(answer, held),
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

/// Whether an upstream's client can be kept: its listener is not the client's.
fn same_upstream(a: &UpstreamConfig, b: &UpstreamConfig) -> bool {
    UpstreamConfig { listen: b.listen, ..a.clone() } == *b
}

/// Each upstream listener's routing, in [`ListenerId`] order.
fn listener_routings(
    cfg: &RoutesConfig,
    listeners: &[UpstreamListener],
    upstreams: &HashMap<String, Arc<Upstream>>,
    direct: &Arc<Upstream>,
    table: &LeaseTable,
    metrics: &Metrics,
) -> Vec<Routing> {
    let routing = |l: &UpstreamListener| {
        Routing::for_upstream_listener(cfg, &l.upstream, upstreams, direct.clone(), table, metrics)
    };
    listeners.iter().map(routing).collect()
}

/// A status code for readiness: the proxy is ready once its routes are loaded.
pub fn readiness(proxy: &Proxy) -> StatusCode {
    if proxy.config_state().loaded_at.is_some() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}
