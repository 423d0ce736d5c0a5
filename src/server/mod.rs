//! `usher server`: the Doorman-compatible capacity server.
//!
//! [`Node`] holds the state shared by the gRPC service, the admin pages and
//! the background tasks (lease sweep, config reload). This module wires them
//! together and runs them until shutdown.

pub mod election;
pub mod etcd;
pub mod metrics;
pub mod parent;
pub mod service;
mod status;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::resources::ResourcesConfig;
use crate::config::watch;
use crate::error::{RunError, bind};
pub use metrics::Metrics;
pub use service::CapacityService;
pub use store::Store;

/// Default gRPC listen address.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:15100";
/// Default admin listen address (loopback: the admin pages are not for the network).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:15180";
/// Default minimum interval between two requests of one client for one resource.
pub const DEFAULT_MIN_REQUEST_INTERVAL: &str = "1s";
/// How often expired leases are swept when nobody asks.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// How long in-flight RPCs may take to finish once shutdown starts.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// `usher server` flags; each can also be set as `USHER_<FLAG>`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Doorman resources file (YAML). Reloaded on SIGHUP and whenever it changes.
    /// Without it, the built-in default applies: every resource id gets 100/s, FAIR_SHARE.
    #[arg(long, env = "USHER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address for the gRPC `doorman.Capacity` service.
    #[arg(long, env = "USHER_LISTEN", value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Address for /metrics, /healthz, /readyz and /debug pages.
    #[arg(long, env = "USHER_ADMIN_LISTEN", value_name = "ADDR", default_value = DEFAULT_ADMIN_LISTEN)]
    pub admin_listen: SocketAddr,
    /// This server's id and the master address it announces [default: HOSTNAME:PORT of --listen].
    #[arg(long, env = "USHER_ADVERTISE_ADDR", value_name = "HOST:PORT")]
    pub advertise_addr: Option<String>,
    /// A client asking again for a resource sooner than this gets its current lease back unchanged.
    #[arg(long, env = "USHER_MIN_REQUEST_INTERVAL", value_name = "DURATION", default_value = DEFAULT_MIN_REQUEST_INTERVAL, value_parser = parse_duration)]
    pub min_request_interval: Duration,
    /// Run as an intermediate server leasing from these parent servers (any servers of the
    /// parent node; Discovery finds its master). Without it, this is a root server.
    #[arg(long, env = "USHER_PARENT", value_name = "ADDR[,ADDR...]", value_delimiter = ',')]
    pub parent: Vec<String>,
    /// The identity every replica of this node shares towards its parent, so that a new master
    /// takes over its predecessor's lease there [default: with --etcd-endpoints, the election key
    /// and the endpoints; else the server id].
    #[arg(long, env = "USHER_NODE_ID", value_name = "ID")]
    pub node_id: Option<String>,
    /// Leases handed down refresh this many times the parent's refresh interval (never below 1 s).
    #[arg(long, env = "USHER_DECAY_FACTOR", value_name = "FACTOR", default_value_t = DEFAULT_DECAY_FACTOR)]
    pub decay_factor: f64,
    /// New clients of a resource beyond this many get ResourceExhausted.
    #[arg(long, env = "USHER_MAX_CLIENTS_PER_RESOURCE", value_name = "N", default_value_t = store::DEFAULT_MAX_CLIENTS_PER_RESOURCE)]
    pub max_clients_per_resource: usize,
    /// New resource ids beyond this many get ResourceExhausted.
    #[arg(long, env = "USHER_MAX_RESOURCES", value_name = "N", default_value_t = store::DEFAULT_MAX_RESOURCES)]
    pub max_resources: usize,
    /// etcd v3 endpoints (e.g. http://etcd:2379) for master election and `--config etcd:KEY`.
    /// Without them this server is always the master of its node.
    #[arg(long, env = "USHER_ETCD_ENDPOINTS", value_name = "URL[,URL...]", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The etcd key the servers of one node campaign for; it holds the master's address.
    #[arg(long, env = "USHER_ELECTION_KEY", value_name = "KEY", default_value = election::DEFAULT_KEY)]
    pub election_key: String,
    /// Lease TTL of the election key: a dead master is replaced within about this long.
    #[arg(long, env = "USHER_ELECTION_TTL", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub election_ttl: Duration,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    /// Reloaded on SIGHUP and whenever it changes.
    #[arg(long, env = "USHER_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "USHER_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by these CAs (PEM): mutual TLS. Needs --tls-cert.
    #[arg(long, env = "USHER_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Lease from the parent over TLS, trusting these CAs (PEM) for its certificate.
    #[arg(long, env = "USHER_PARENT_TLS_CA", value_name = "FILE")]
    pub parent_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) to present to a parent that requires mTLS; needs --parent-tls-key.
    #[arg(long, env = "USHER_PARENT_TLS_CERT", value_name = "FILE")]
    pub parent_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --parent-tls-cert.
    #[arg(long, env = "USHER_PARENT_TLS_KEY", value_name = "FILE")]
    pub parent_tls_key: Option<PathBuf>,
    /// Name to verify in the parent's certificate [default: the host of each parent address].
    #[arg(long, env = "USHER_PARENT_TLS_SERVER_NAME", value_name = "NAME")]
    pub parent_tls_server_name: Option<String>,
}

/// The server's own TLS from its flags: `None` without `--tls-cert`.
fn server_tls(args: &ServerArgs, now: i64) -> Result<Option<crate::tls::ServerTls>, RunError> {
    use crate::tls::{ServerFiles, ServerTls, Which};
    let (cert, key) = match (&args.tls_cert, &args.tls_key) {
        (None, None) if args.tls_client_ca.is_some() => {
            return Err(RunError::Usage(
                "--tls-client-ca needs --tls-cert and --tls-key: client certificates are only checked over TLS".into(),
            ));
        }
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (c.clone(), k.clone()),
        (Some(c), None) => {
            return Err(RunError::Usage(format!(
                "--tls-cert {} needs --tls-key: the certificate's private key",
                c.display()
            )));
        }
        (None, Some(k)) => {
            return Err(RunError::Usage(format!(
                "--tls-key {} needs --tls-cert: the certificate it belongs to",
                k.display()
            )));
        }
    };
    ServerTls::load(ServerFiles { cert, key, client_ca: args.tls_client_ca.clone() }, now).map(Some).map_err(|e| {
        let flag = match e.which {
            Which::Cert => "--tls-cert",
            Which::Key => "--tls-key",
            Which::Ca | Which::ServerName => "--tls-client-ca",
        };
        RunError::Usage(format!("{flag} {}: {}", e.path, e.reason))
    })
}

/// TLS to the parent from the `--parent-tls-*` flags: `None` without `--parent-tls-ca`.
fn parent_tls(args: &ServerArgs) -> Result<Option<crate::tls::ClientTls>, RunError> {
    use crate::tls::{ClientFiles, ClientTls, Which};
    if args.parent_tls_ca.is_none()
        && let Some(a) = args.parent.iter().find(|a| a.starts_with("https://"))
    {
        return Err(RunError::Usage(format!(
            "--parent {a}: an https:// parent needs --parent-tls-ca (TLS is switched on by the flags, not the address)"
        )));
    }
    let Some(ca) = &args.parent_tls_ca else {
        let set = [
            ("--parent-tls-cert", args.parent_tls_cert.is_some()),
            ("--parent-tls-key", args.parent_tls_key.is_some()),
            ("--parent-tls-server-name", args.parent_tls_server_name.is_some()),
        ];
        if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
            return Err(RunError::Usage(format!(
                "{flag} needs --parent-tls-ca: the CA that signs the parent's certificate"
            )));
        }
        return Ok(None);
    };
    if args.parent.is_empty() {
        return Err(RunError::Usage("--parent-tls-ca needs --parent: a root server has no parent".into()));
    }
    let files = ClientFiles {
        ca: ca.clone(),
        cert: args.parent_tls_cert.clone(),
        key: args.parent_tls_key.clone(),
        server_name: args.parent_tls_server_name.clone(),
    };
    ClientTls::load(&files).map(Some).map_err(|e| {
        let (flag, path) = match e.which {
            Which::Ca => ("--parent-tls-ca", e.path),
            // A missing half of the pair names the half that is there.
            Which::Cert if args.parent_tls_cert.is_none() => ("--parent-tls-key", e.path),
            Which::Key if args.parent_tls_key.is_none() => ("--parent-tls-cert", e.path),
            Which::Cert => ("--parent-tls-cert", e.path),
            Which::Key => ("--parent-tls-key", e.path),
            Which::ServerName => ("--parent-tls-server-name", e.path),
        };
        RunError::Usage(format!("{flag} {path}: {}", e.reason))
    })
}

/// Default `--decay-factor`: each level down the tree refreshes twice as often as its parent.
pub const DEFAULT_DECAY_FACTOR: f64 = 0.5;

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::config::yaml::parse_duration(s).ok_or_else(|| format!("`{s}` is not a duration (write e.g. 500ms, 1s, 2m)"))
}

/// Who the master is, as this server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mastership {
    pub is_master: bool,
    pub master_address: Option<String>,
}

pub use crate::config::ConfigState;

/// Everything one capacity server shares between its tasks.
pub struct Node {
    pub server_id: String,
    /// The identity every master of this node shares towards its parent
    /// (`--node-id`); the server id when not set.
    pub node_id: String,
    /// Set on an intermediate server.
    pub parent: Option<Arc<parent::ParentLink>>,
    /// Set when masters are elected on etcd.
    pub election: Option<Arc<election::Election>>,
    /// Set when gRPC is served over TLS.
    pub tls: Option<Arc<crate::tls::ServerTls>>,
    pub store: Store,
    pub metrics: Metrics,
    pub config_source: String,
    mastership: ArcSwap<Mastership>,
    config_state: Mutex<ConfigState>,
}

impl Node {
    pub fn new(
        server_id: String,
        config_source: String,
        config: ResourcesConfig,
        clock: Clock,
        min_request_interval: Duration,
        registry: prometheus::Registry,
    ) -> Self {
        let now = clock.now();
        Node {
            mastership: ArcSwap::from_pointee(Mastership { is_master: true, master_address: Some(server_id.clone()) }),
            node_id: server_id.clone(),
            server_id,
            parent: None,
            election: None,
            tls: None,
            store: Store::new(clock, config, min_request_interval),
            metrics: Metrics::new(registry),
            config_source,
            config_state: Mutex::new(ConfigState { loaded_at: Some(now), last_error: None }),
        }
    }

    pub fn mastership(&self) -> Arc<Mastership> {
        self.mastership.load_full()
    }

    /// Changes who this server believes the master is. Becoming master starts
    /// learning mode with empty state.
    pub fn set_mastership(&self, m: Mastership) {
        let was = self.mastership.load().is_master;
        if m.is_master && !was {
            self.store.become_master();
        }
        self.mastership.store(Arc::new(m));
    }

    pub fn config_state(&self) -> ConfigState {
        self.config_state.lock().expect("config state lock poisoned").clone()
    }

    /// Applies a freshly read configuration, or keeps the old one and says why.
    pub fn apply_config(&self, result: Result<ResourcesConfig, crate::config::ConfigError>) {
        let mut state = self.config_state.lock().expect("config state lock poisoned");
        match result {
            Ok(cfg) => {
                let n = cfg.templates.len();
                self.store.reload(cfg);
                self.metrics.config_reloads.inc();
                state.loaded_at = Some(self.store.clock().now());
                state.last_error = None;
                tracing::info!(source = %self.config_source, templates = n, "configuration reloaded");
            }
            Err(e) => {
                self.metrics.config_reload_errors.inc();
                tracing::error!(source = %self.config_source, "configuration rejected, keeping the previous one:\n{e}");
                state.last_error = Some(e.to_string());
            }
        }
    }

    /// Ready: configuration loaded, and this server is master or knows the master.
    pub fn is_ready(&self) -> bool {
        let m = self.mastership();
        self.config_state().loaded_at.is_some() && (m.is_master || m.master_address.is_some())
    }
}

/// Where the resources configuration comes from.
#[derive(Clone)]
enum ConfigSource {
    Builtin,
    File(PathBuf),
    Etcd(Box<etcd::Etcd>, String),
}

/// How often an etcd config key is re-read.
pub const ETCD_CONFIG_POLL: Duration = Duration::from_secs(2);

impl ConfigSource {
    fn from_arg(arg: Option<&std::path::Path>, etcd: Option<&etcd::Etcd>) -> Result<Self, RunError> {
        let Some(arg) = arg else { return Ok(ConfigSource::Builtin) };
        match arg.to_str().and_then(|s| s.strip_prefix("etcd:")) {
            None => Ok(ConfigSource::File(arg.to_path_buf())),
            Some(key) => match etcd {
                Some(e) => Ok(ConfigSource::Etcd(Box::new(e.clone()), key.to_string())),
                None => Err(RunError::Usage(format!("--config etcd:{key} needs --etcd-endpoints"))),
            },
        }
    }

    fn name(&self) -> String {
        match self {
            ConfigSource::Builtin => "<built-in default>".into(),
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Etcd(_, key) => format!("etcd:{key}"),
        }
    }

    async fn load_initial(&self) -> Result<ResourcesConfig, RunError> {
        match self {
            ConfigSource::Builtin => {
                tracing::warn!(
                    "no --config given: using the built-in default resources (every id gets 100/s, FAIR_SHARE)"
                );
                Ok(ResourcesConfig::builtin_default())
            }
            ConfigSource::File(p) => Ok(ResourcesConfig::load(p)?),
            ConfigSource::Etcd(etcd, key) => {
                let mut tries = 0;
                let text = loop {
                    match etcd.get(key).await {
                        Ok(Some(t)) => break t,
                        Ok(None) => {
                            return Err(RunError::Usage(format!(
                                "etcd key `{key}` does not exist; store the resources YAML there first"
                            )));
                        }
                        Err(e) if tries < 5 => {
                            tries += 1;
                            tracing::warn!(error = %e, "cannot read the configuration from etcd yet; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => return Err(RunError::Unavailable(format!("cannot read the configuration: {e}"))),
                    }
                };
                Ok(ResourcesConfig::parse(&self.name(), &text)?)
            }
        }
    }

    /// Applies every later change to `node`, keeping the last good config on errors.
    fn watch(self, node: Arc<Node>, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        match self {
            ConfigSource::Builtin => None,
            ConfigSource::File(path) => Some(watch::spawn_reloader(path.clone(), shutdown, move |cause| {
                tracing::info!(?cause, "reloading configuration");
                node.apply_config(ResourcesConfig::load(&path));
            })),
            ConfigSource::Etcd(etcd, key) => Some(tokio::spawn(async move {
                let name = format!("etcd:{key}");
                let mut last: Option<String> = None;
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(ETCD_CONFIG_POLL) => {}
                    }
                    match etcd.get(&key).await {
                        Ok(Some(text)) if last.as_ref() != Some(&text) => {
                            let first = last.is_none();
                            last = Some(text.clone());
                            if first && node.config_state().last_error.is_none() {
                                // The text loaded at start-up; nothing changed yet.
                                if ResourcesConfig::parse(&name, &text).ok().as_ref() == Some(&*node.store.config()) {
                                    continue;
                                }
                            }
                            tracing::info!(source = %name, "configuration changed in etcd; reloading");
                            node.apply_config(ResourcesConfig::parse(&name, &text));
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => {
                            tracing::warn!(source = %name, "the configuration key is gone; keeping the current configuration")
                        }
                        Err(e) => {
                            tracing::warn!(source = %name, error = %e, "cannot read the configuration from etcd; keeping the current one")
                        }
                    }
                }
            })),
        }
    }
}

/// `--node-id`, or its default: every replica of an elected node campaigns
/// for the same key on the same etcd, so those name the node.
fn node_id(args: &ServerArgs, server_id: &str) -> String {
    if let Some(id) = args.node_id.as_ref().filter(|s| !s.is_empty()) {
        return id.clone();
    }
    if args.etcd_endpoints.is_empty() {
        return server_id.to_string();
    }
    let mut endpoints = args.etcd_endpoints.clone();
    endpoints.sort();
    format!("{}@{}", args.election_key, endpoints.join(","))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Runs the server until `shutdown` is cancelled.
pub async fn run(args: ServerArgs, shutdown: CancellationToken) -> Result<(), RunError> {
    let etcd = (!args.etcd_endpoints.is_empty()).then(|| etcd::Etcd::new(&args.etcd_endpoints, Duration::from_secs(3)));
    let source = ConfigSource::from_arg(args.config.as_deref(), etcd.as_ref())?;
    let tls = server_tls(&args, Clock::system().now().as_secs())?.map(Arc::new);
    let parent_tls = parent_tls(&args)?;
    let config = source.load_initial().await?;
    let source_name = source.name();
    let grpc = bind("gRPC", args.listen).await?;
    let admin = bind("admin", args.admin_listen).await?;
    let grpc_addr = grpc.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let admin_addr = admin.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let server_id = args.advertise_addr.clone().unwrap_or_else(|| format!("{}:{}", hostname(), grpc_addr.port()));

    let mut node = Node::new(
        server_id.clone(),
        source_name.clone(),
        config,
        Clock::system(),
        args.min_request_interval,
        prometheus::Registry::new(),
    );
    node.store.set_limits(store::Limits {
        max_clients_per_resource: args.max_clients_per_resource.max(1),
        max_resources: args.max_resources.max(1),
    });
    if !args.parent.is_empty() {
        if !(args.decay_factor > 0.0 && args.decay_factor <= 1.0) {
            return Err(RunError::Usage(format!("--decay-factor must be in (0, 1], not {}", args.decay_factor)));
        }
        node.store.set_role(store::Role::Intermediate { decay_factor: args.decay_factor });
        node.parent = Some(Arc::new(parent::ParentLink::default()));
    }
    if etcd.is_some() {
        // Elected: nobody is master until the election says so.
        node.mastership.store(Arc::new(Mastership { is_master: false, master_address: None }));
        node.election = Some(Arc::new(election::Election::default()));
    }
    node.tls = tls.clone();
    node.node_id = node_id(&args, &server_id);
    let node = Arc::new(node);
    let role = if args.parent.is_empty() { "root" } else { "intermediate" };
    let tls_mode = match &tls {
        None => "off",
        Some(t) if t.files().client_ca.is_some() => "mtls",
        Some(_) => "tls",
    };
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, server_id = %server_id, config = %source_name, role, parent = %args.parent.join(","), tls = tls_mode, parent_tls = parent_tls.is_some(), "usher server listening");

    let parent_task = node.parent.clone().map(|link| {
        let transport: Arc<dyn crate::lease::transport::Transport> = Arc::new(
            crate::lease::transport::GrpcTransport::new(
                crate::lease::transport::DEFAULT_RPC_TIMEOUT,
                crate::lease::transport::DEFAULT_CONNECT_TIMEOUT,
            )
            .with_tls(parent_tls.clone().map(Ok)),
        );
        tokio::spawn(parent::run(
            node.clone(),
            link,
            args.parent.clone(),
            transport,
            node.store.clock().clone(),
            shutdown.clone(),
        ))
    });

    // Expired leases are dropped even when no request touches their resource.
    let sweeper = {
        let node = node.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => node.store.sweep(),
                }
            }
        })
    };

    let reloader = source.clone().watch(node.clone(), shutdown.clone());
    let election_task = match (&etcd, &node.election) {
        (Some(etcd), Some(e)) => Some(tokio::spawn(election::run(
            node.clone(),
            e.clone(),
            etcd.clone(),
            args.election_key.clone(),
            args.election_ttl,
            node.store.clock().clone(),
            shutdown.clone(),
        ))),
        _ => None,
    };

    let admin_task = tokio::spawn(crate::admin::serve(admin, status::handler(node.clone()), shutdown.clone()));

    let svc = CapacityService::new(node.clone()).into_server();
    let builder = tonic::transport::Server::builder().add_service(svc);
    let cert_reloader = tls.clone().map(|t| {
        // Every trigger re-reads both files (the pair is compared, not one file's
        // bytes), so a rotation that writes the certificate before the key
        // still lands once the key follows. A lasting error is logged once.
        let mut causes = watch::watch(&t.files().cert, shutdown.clone());
        let clock = node.store.clock().clone();
        tokio::spawn(async move {
            let mut last_error = None;
            while let Some(cause) = causes.recv().await {
                match t.reload(clock.now().as_secs()) {
                    Ok(true) => tracing::info!(?cause, cert = %t.files().cert.display(), "TLS certificate reloaded"),
                    Ok(false) => tracing::debug!(?cause, "TLS certificate unchanged"),
                    Err(e) if cause == watch::Cause::Signal || last_error.as_ref() != Some(&e) => {
                        tracing::error!(file = %e.path, "TLS certificate rejected, keeping the previous one: {}", e.reason);
                        last_error = Some(e);
                        continue;
                    }
                    Err(_) => continue,
                }
                last_error = None;
            }
        })
    });
    let serve: std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        match &tls {
            None => Box::pin(builder.serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(grpc),
                shutdown.clone().cancelled_owned(),
            )),
            Some(t) => {
                let failures = node.metrics.tls_handshake_failures.clone();
                Box::pin(builder.serve_with_incoming_shutdown(
                    t.clone().incoming(grpc, move || failures.inc(), shutdown.clone()),
                    shutdown.clone().cancelled_owned(),
                ))
            }
        };
    // Capacity RPCs are short; idle client connections must not hold shutdown up.
    let grace = async {
        shutdown.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::info!("closing connections still open after the shutdown grace period");
        Ok(())
    };
    let served = tokio::select! {
        r = serve => r,
        r = grace => r,
    };
    shutdown.cancel();
    let _ = tokio::join!(sweeper, admin_task);
    if let Some(p) = parent_task {
        let _ = p.await;
    }
    for t in [reloader, election_task, cert_reloader].into_iter().flatten() {
        let _ = t.await;
    }
    served.map_err(|e| RunError::Other(format!("gRPC server failed: {e}")))?;
    tracing::info!("usher server stopped");
    Ok(())
}
