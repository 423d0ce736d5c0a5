//! `usher server`: the Doorman-compatible capacity server.
//!
//! [`Node`] holds the state shared by the gRPC service, the admin pages and
//! the background tasks (lease sweep, config reload). This module wires them
//! together and runs them until shutdown.

#![warn(missing_docs, unreachable_pub)]

pub mod algorithm;
pub mod calendar;
pub mod conns;
pub mod election;
pub mod etcd;
pub mod horizon;
mod local;
pub mod metrics;
pub mod parent;
pub mod quota;
pub mod service;
pub mod state_file;
mod status;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

pub use local::LocalTransport;
pub use metrics::Metrics;
pub use service::CapacityService;
pub use status::percent_encode;
pub use store::Store;
use usher_core::clock::Clock;
use usher_core::config::resources::ResourcesConfig;
use usher_core::config::watch;
use usher_core::error::RunError;
use usher_core::net::bind;

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

/// How `usher server` runs: its flags, as the `usher` binary parsed them.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Doorman resources file (YAML). Reloaded on SIGHUP and whenever it changes.
    /// Without it, the built-in default applies: every resource id gets 100/s, FAIR_SHARE.
    pub config: Option<PathBuf>,
    /// Where a server without etcd records until when its leases may be outstanding, so that
    /// a restart learns while they may be and a fresh start (no file) serves at once; written
    /// every 2 s, atomically. An empty value keeps no record: every start learns. With
    /// --etcd-endpoints the record is kept in etcd instead
    /// [default: $XDG_STATE_HOME/usher/server-PORT.state, or ~/.local/state/usher/server-PORT.state,
    /// PORT being --listen's; none with port 0]
    pub state_file: Option<PathBuf>,
    /// Address for the gRPC `doorman.Capacity` service.
    pub listen: SocketAddr,
    /// Address for /metrics, /healthz, /readyz and /debug pages.
    pub admin_listen: SocketAddr,
    /// This server's id and the master address it announces [default: HOSTNAME:PORT of --listen].
    pub advertise_addr: Option<String>,
    /// A client asking again for a resource sooner than this gets its current lease back unchanged.
    pub min_request_interval: Duration,
    /// Run as an intermediate server leasing from these parent servers (any servers of the
    /// parent node; Discovery finds its master). Without it, this is a root server.
    pub parent: Vec<String>,
    /// The identity every replica of this node shares towards its parent, so that a new master
    /// takes over its predecessor's lease there [default: with --etcd-endpoints, the election key
    /// and the endpoints; else the server id].
    pub node_id: Option<String>,
    /// Leases handed down refresh this many times the parent's refresh interval (never below 1 s).
    pub decay_factor: f64,
    /// New clients of a resource beyond this many get ResourceExhausted.
    pub max_clients_per_resource: usize,
    /// New resource ids beyond this many get ResourceExhausted.
    pub max_resources: usize,
    /// At most this many resources get their own usher_server_resource_* series on /metrics
    /// (those the configuration names first, then the busiest); the rest count in the
    /// per-template sums and usher_server_resources_unlisted.
    pub metrics_max_resources: usize,
    /// gRPC connections open at once (TLS handshakes included); more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// A gRPC connection that has not sent its complete HTTP/2 preface this long after it was
    /// accepted (after the TLS handshake, with TLS) is closed.
    pub preface_timeout: Duration,
    /// Send an HTTP/2 PING on a gRPC connection that has been silent this long...
    pub http2_keepalive_interval: Duration,
    /// ...and close it when the PING is not answered within this long.
    pub http2_keepalive_timeout: Duration,
    /// etcd v3 endpoints (e.g. http://etcd:2379, or https:// with --etcd-ca) for master election
    /// and `--config etcd:KEY`; tried in turn. Without them this server is always the master of its node.
    pub etcd_endpoints: Vec<String>,
    /// Trust these CAs (PEM) for etcd's certificate: TLS to `https://` endpoints.
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that requires client certificates; needs --etcd-key.
    pub etcd_cert: Option<PathBuf>,
    /// The private key (PEM) of --etcd-cert.
    pub etcd_key: Option<PathBuf>,
    /// Name to verify in etcd's certificate [default: the host of each endpoint].
    pub etcd_server_name: Option<String>,
    /// etcd user (auth enabled in etcd); the password comes from USHER_ETCD_PASSWORD or
    /// --etcd-password-file.
    pub etcd_user: Option<String>,
    /// The etcd user's password. Prefer the environment (from a Secret) or --etcd-password-file:
    /// a flag shows in the process list.
    pub etcd_password: Option<String>,
    /// A file holding the etcd user's password (a trailing newline is ignored).
    pub etcd_password_file: Option<PathBuf>,
    /// Fetch a new etcd auth token this often; keep it below etcd's --auth-token-ttl (300 s by default).
    pub etcd_token_refresh: Duration,
    /// The etcd key the servers of one node campaign for; it holds the master's address.
    pub election_key: String,
    /// Lease TTL of the election key: a dead master is replaced within about this long.
    pub election_ttl: Duration,
    /// Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key.
    /// Reloaded on SIGHUP and whenever it changes.
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by these CAs (PEM): mutual TLS. Needs --tls-cert.
    pub tls_client_ca: Option<PathBuf>,
    /// Lease from the parent over TLS, trusting these CAs (PEM) for its certificate.
    pub parent_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) to present to a parent that requires mTLS; needs --parent-tls-key.
    pub parent_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --parent-tls-cert.
    pub parent_tls_key: Option<PathBuf>,
    /// Name to verify in the parent's certificate [default: the host of each parent address].
    pub parent_tls_server_name: Option<String>,
}

/// The server's own TLS from its flags: `None` without `--tls-cert`.
fn server_tls(args: &ServerOptions, now: i64) -> Result<Option<usher_core::tls::ServerTls>, RunError> {
    use usher_core::tls::{ServerFiles, ServerTls, Which};
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

/// The etcd client's settings from the `--etcd-*` flags: `None` without `--etcd-endpoints`.
fn etcd_options(args: &ServerOptions) -> Result<Option<etcd::EtcdOptions>, RunError> {
    if args.etcd_endpoints.is_empty() {
        let set = [
            ("--etcd-ca", args.etcd_ca.is_some()),
            ("--etcd-cert", args.etcd_cert.is_some()),
            ("--etcd-key", args.etcd_key.is_some()),
            ("--etcd-server-name", args.etcd_server_name.is_some()),
            ("--etcd-user", args.etcd_user.is_some()),
        ];
        if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
            return Err(RunError::Usage(format!("{flag} needs --etcd-endpoints")));
        }
        return Ok(None);
    }
    let tls = etcd_tls(args)?;
    let credentials = etcd_credentials(args)?;
    if args.etcd_token_refresh < Duration::from_secs(1) {
        return Err(RunError::Usage("--etcd-token-refresh must be at least 1s".into()));
    }
    Ok(Some(etcd::EtcdOptions {
        endpoints: args.etcd_endpoints.clone(),
        tls,
        tls_hint: etcd::TlsHint {
            ca: args.etcd_ca.as_ref().map(|p| p.display().to_string()),
            cert: args.etcd_cert.as_ref().map(|p| p.display().to_string()),
        },
        credentials,
        token_refresh: args.etcd_token_refresh,
        // A master renewing at a quarter of the TTL has another quarter to try the
        // next endpoint before it must step down: one endpoint may take a sixth of
        // the TTL. Never below 1 s, which a loaded etcd can take; with a TTL under
        // 6 s a hung endpoint then makes the master step down instead of failing over.
        timeout: (args.election_ttl / 6).clamp(Duration::from_secs(1), etcd::DEFAULT_TIMEOUT),
    }))
}

/// TLS to etcd from `--etcd-ca`, `--etcd-cert`, `--etcd-key` and
/// `--etcd-server-name`: `None` without `--etcd-ca`, which needs `https://`
/// endpoints, all of them.
fn etcd_tls(args: &ServerOptions) -> Result<Option<usher_core::tls::ClientTls>, RunError> {
    use usher_core::tls::{ClientFiles, ClientTls, Which};
    let https = args.etcd_endpoints.iter().filter(|e| e.starts_with("https://")).count();
    match (&args.etcd_ca, https) {
        (None, n) if n > 0 => {
            return Err(RunError::Usage(
                "--etcd-endpoints: https:// endpoints need --etcd-ca, the CA that signs etcd's certificate".into(),
            ));
        }
        (Some(_), n) if n < args.etcd_endpoints.len() => {
            return Err(RunError::Usage(
                "--etcd-ca: every etcd endpoint must then be https:// (TLS is for all of them or none)".into(),
            ));
        }
        (None, _) if args.etcd_cert.is_some() || args.etcd_key.is_some() || args.etcd_server_name.is_some() => {
            return Err(RunError::Usage(
                "--etcd-cert, --etcd-key and --etcd-server-name need --etcd-ca (TLS to etcd)".into(),
            ));
        }
        _ => {}
    }
    let tls = match &args.etcd_ca {
        None => None,
        Some(ca) => {
            let files = ClientFiles {
                ca: ca.clone(),
                cert: args.etcd_cert.clone(),
                key: args.etcd_key.clone(),
                server_name: args.etcd_server_name.clone(),
            };
            Some(ClientTls::load(&files).map_err(|e| {
                let flag = match e.which {
                    Which::Ca => "--etcd-ca",
                    Which::Cert => "--etcd-cert",
                    Which::Key => "--etcd-key",
                    Which::ServerName => "--etcd-server-name",
                };
                RunError::Usage(format!("{flag} {}: {}", e.path, e.reason))
            })?)
        }
    };
    Ok(tls)
}

/// The etcd user and password from `--etcd-user` and `USHER_ETCD_PASSWORD`
/// (`--etcd-password`) or `--etcd-password-file`: `None` without a user.
fn etcd_credentials(args: &ServerOptions) -> Result<Option<(String, String)>, RunError> {
    let password = match (&args.etcd_password, &args.etcd_password_file) {
        (Some(_), Some(_)) => {
            return Err(RunError::Usage(
                "USHER_ETCD_PASSWORD (--etcd-password) and --etcd-password-file: give one of them".into(),
            ));
        }
        (Some(p), None) => Some(p.clone()),
        (None, Some(f)) => Some(
            usher_core::config::file::read_text(f)
                .map_err(|e| RunError::Usage(format!("--etcd-password-file {}: cannot read it: {e}", f.display())))?
                .trim_end_matches(['\n', '\r'])
                .to_string(),
        ),
        (None, None) => None,
    };
    let credentials = match (&args.etcd_user, password) {
        (Some(u), Some(p)) => Some((u.clone(), p)),
        (None, None) => None,
        (Some(u), None) => {
            return Err(RunError::Usage(format!(
                "--etcd-user {u} needs a password: USHER_ETCD_PASSWORD or --etcd-password-file"
            )));
        }
        (None, Some(_)) => {
            return Err(RunError::Usage("an etcd password needs --etcd-user, the user it belongs to".into()));
        }
    };
    Ok(credentials)
}

/// TLS to the parent from the `--parent-tls-*` flags: `None` without `--parent-tls-ca`.
fn parent_tls(args: &ServerOptions) -> Result<Option<usher_core::tls::ClientTls>, RunError> {
    use usher_core::tls::{ClientFiles, ClientTls, Which};
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

/// Who the master is, as this server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mastership {
    /// This server is the master of its node: it answers capacity requests.
    pub is_master: bool,
    /// The master's server id, which is its gRPC address; `None` while no master is known.
    pub master_address: Option<String>,
}

pub use usher_core::config::ConfigState;

/// Everything one capacity server shares between its tasks.
pub struct Node {
    /// This server's id, the address it announces as master (`--advertise-addr`).
    pub server_id: String,
    /// The identity every master of this node shares towards its parent
    /// (`--node-id`); the server id when not set.
    pub node_id: String,
    /// Set on an intermediate server.
    pub parent: Option<Arc<parent::ParentLink>>,
    /// Set when masters are elected on etcd.
    pub election: Option<Arc<election::Election>>,
    /// The etcd client, when this server uses etcd (election, config).
    pub etcd: Option<etcd::Etcd>,
    /// Set when gRPC is served over TLS.
    pub tls: Option<Arc<usher_core::tls::ServerTls>>,
    /// Every resource's leases, and the decisions on them.
    pub store: Store,
    /// The server's Prometheus metrics.
    pub metrics: Metrics,
    /// Resources with their own series on `/metrics` (`--metrics-max-resources`).
    pub metrics_max_resources: usize,
    /// Where the resources configuration comes from, as logs and status pages name it.
    pub config_source: String,
    mastership: ArcSwap<Mastership>,
    config_state: Mutex<ConfigState>,
}

impl Node {
    /// A node that is master of itself, with `config` in force and its
    /// metrics registered in `registry`. `run` then sets its role, election
    /// and limits from the flags.
    pub fn new(
        server_id: String,
        config_source: String,
        config: ResourcesConfig,
        clock: Clock,
        min_request_interval: Duration,
        registry: prometheus::Registry,
    ) -> Self {
        let now = clock.now();
        let metrics = Metrics::new(registry);
        Node {
            mastership: ArcSwap::from_pointee(Mastership { is_master: true, master_address: Some(server_id.clone()) }),
            node_id: server_id.clone(),
            server_id,
            parent: None,
            election: None,
            etcd: None,
            tls: None,
            store: {
                let mut s = Store::new(clock, config, min_request_interval);
                s.set_catch_all_counter(metrics.catch_all_resources.clone());
                s
            },
            metrics,
            metrics_max_resources: metrics::DEFAULT_METRICS_MAX_RESOURCES,
            config_source,
            config_state: Mutex::new(ConfigState { loaded_at: Some(now), last_error: None }),
        }
    }

    /// Who the master is, as this server knows it now.
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
        if m.is_master != was {
            self.metrics.mastership_changes.inc();
        }
        let known = m.master_address.is_some() && self.mastership.load().master_address.is_none();
        self.mastership.store(Arc::new(m));
        if known {
            // Answers held while no master was known go out now.
            self.store.wake();
        }
    }

    /// When the configuration in force was loaded, and why the last reload failed, if it did.
    pub fn config_state(&self) -> ConfigState {
        self.config_state.lock().expect("config state lock poisoned").clone()
    }

    /// Applies a freshly read configuration, or keeps the old one and says why.
    pub fn apply_config(&self, result: Result<ResourcesConfig, usher_core::config::ConfigError>) {
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

    /// The configuration to start with and, for etcd, the revision it was read at.
    async fn load_initial(&self, intermediate: bool) -> Result<(ResourcesConfig, i64), RunError> {
        match self {
            ConfigSource::Builtin if intermediate => {
                tracing::info!(
                    "no --config given: this intermediate shares what its parent grants, with the algorithm and lease lengths the parent sends"
                );
                Ok((ResourcesConfig::builtin_default(), 0))
            }
            ConfigSource::Builtin => {
                tracing::warn!(
                    "no --config given: using the built-in default resources (every id gets 100/s, FAIR_SHARE)"
                );
                Ok((ResourcesConfig::builtin_default(), 0))
            }
            ConfigSource::File(p) => Ok((ResourcesConfig::load(p)?, 0)),
            ConfigSource::Etcd(etcd, key) => {
                let mut tries = 0;
                let (text, revision) = loop {
                    match etcd.get_at(key).await {
                        Ok((Some(t), rev)) => break (t, rev),
                        Ok((None, _)) => {
                            return Err(RunError::Usage(format!(
                                "etcd key `{key}` does not exist; store the resources YAML there first"
                            )));
                        }
                        Err(e) if e.is_refused() => return Err(RunError::Unavailable(e.to_string())),
                        Err(e) if tries < 5 => {
                            tries += 1;
                            tracing::warn!(error = %e, "cannot read the configuration from etcd yet; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => return Err(RunError::Unavailable(format!("cannot read the configuration: {e}"))),
                    }
                };
                Ok((ResourcesConfig::parse(&self.name(), &text)?, revision))
            }
        }
    }

    /// Applies every later change to `node`, keeping the last good config on errors.
    fn watch(self, revision: i64, node: Arc<Node>, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        match self {
            ConfigSource::Builtin => None,
            ConfigSource::File(path) => Some(watch::spawn_reloader(path.clone(), shutdown, move |cause| {
                tracing::info!(?cause, "reloading configuration");
                node.apply_config(ResourcesConfig::load(&path));
            })),
            ConfigSource::Etcd(etcd, key) => Some(tokio::spawn(follow_etcd_key(*etcd, key, revision, node, shutdown))),
        }
    }
}

/// A watch that has delivered nothing for this long is opened again from the
/// last revision: a connection that died silently (a partition) cannot hold
/// changes back for longer.
pub const ETCD_WATCH_IDLE: Duration = Duration::from_secs(30);

/// Follows `key` with an etcd watch from the revision after `revision`,
/// applying each change at once; a lost watch resumes from the last revision
/// seen, so no change is missed, and a compacted history is read afresh.
async fn follow_etcd_key(
    etcd: etcd::Etcd,
    key: String,
    mut revision: i64,
    node: Arc<Node>,
    shutdown: CancellationToken,
) {
    let name = format!("etcd:{key}");
    let mut backoff = Duration::from_millis(200);
    let apply = |text: &str| {
        let parsed = ResourcesConfig::parse(&name, text);
        if node.config_state().last_error.is_none() && parsed.as_ref().ok() == Some(&*node.store.config()) {
            return; // the configuration in force already
        }
        tracing::info!(source = %name, "configuration changed in etcd; reloading");
        node.apply_config(parsed);
    };
    loop {
        let opened = tokio::select! {
            _ = shutdown.cancelled() => return,
            w = etcd.watch(&key, revision + 1) => w,
        };
        let mut watch = match opened {
            Ok(w) => {
                tracing::debug!(source = %name, endpoint = %w.endpoint, from = revision + 1, "watching the configuration key");
                w
            }
            Err(e) => {
                tracing::warn!(source = %name, error = %e, "cannot watch the configuration in etcd; keeping the current one");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = tokio::time::timeout(ETCD_WATCH_IDLE, watch.next()) => n,
            };
            let events = match next {
                Err(_) => break, // idle: open it again from the same revision
                Ok(Ok(Some(events))) => events,
                Ok(Ok(None)) | Ok(Err(_)) => {
                    tracing::warn!(source = %name, revision, "the etcd watch was lost; resuming from the last revision");
                    break;
                }
            };
            backoff = Duration::from_millis(200);
            if let Some(text) = latest_value(&etcd, &key, &name, events, &mut revision).await {
                apply(&text);
            }
        }
    }
}

/// The value a batch of watch events leaves `key` with, when the last of
/// them wrote it (a delete keeps the configuration in force); `revision`
/// moves on to the last one seen. After a compaction the key is read afresh.
async fn latest_value(
    etcd: &etcd::Etcd,
    key: &str,
    name: &str,
    events: Vec<etcd::WatchEvent>,
    revision: &mut i64,
) -> Option<String> {
    use etcd::WatchEvent;
    let mut latest = None;
    for ev in events {
        match ev {
            WatchEvent::Put { value, revision: r } => {
                *revision = (*revision).max(r);
                latest = Some(value);
            }
            WatchEvent::Delete { revision: r } => {
                *revision = (*revision).max(r);
                latest = None;
                tracing::warn!(source = %name, "the configuration key was deleted; keeping the current configuration");
            }
            WatchEvent::Compacted { revision: r } => {
                tracing::warn!(source = %name, compacted = r, "etcd compacted past the last revision seen; reading the key again");
                match etcd.get_at(key).await {
                    Ok((value, r)) => {
                        *revision = r;
                        latest = value;
                    }
                    Err(e) => {
                        tracing::warn!(source = %name, error = %e, "cannot read the configuration from etcd")
                    }
                }
            }
        }
    }
    latest
}

/// `--state-file`, or its default for the gRPC port; `None` when empty.
fn state_file_path(args: &ServerOptions, port: u16) -> Option<PathBuf> {
    match &args.state_file {
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p.clone()),
        None => state_file::default_path(port),
    }
}

/// `--node-id`, or its default: every replica of an elected node campaigns
/// for the same key on the same etcd, so those name the node.
fn node_id(args: &ServerOptions, server_id: &str) -> String {
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

/// This machine's host name, for the default server id; `localhost` when unknown.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Runs the server until `shutdown` is cancelled.
pub async fn run(args: ServerOptions, shutdown: CancellationToken) -> Result<(), RunError> {
    let Checked { etcd, source, tls, parent_tls } = Checked::from_options(&args)?;
    // Bound before etcd and the configuration are waited for: a client that
    // connects meanwhile (a fresh tree starts sidecars, servers and etcd
    // together) waits in the listen queue and is answered as soon as the
    // server serves, instead of being refused and backing off.
    let grpc = bind("gRPC", args.listen).await?;
    if let Some(e) = &etcd {
        check_etcd(e, &args.election_key).await?;
    }
    let (config, revision) = source.load_initial(!args.parent.is_empty()).await?;
    let source_name = source.name();
    let admin = bind("admin", args.admin_listen).await?;
    let grpc_addr = grpc.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let admin_addr = admin.local_addr().map_err(|e| RunError::Other(e.to_string()))?;
    let server_id = args.advertise_addr.clone().unwrap_or_else(|| format!("{}:{}", hostname(), grpc_addr.port()));
    let node = Node::from_options(&args, server_id.clone(), source_name.clone(), config, etcd.as_ref(), tls.clone())?;
    let node = Arc::new(node);
    let role = if args.parent.is_empty() { "root" } else { "intermediate" };
    let tls_mode = match &tls {
        None => "off",
        Some(t) if t.files().client_ca.is_some() => "mtls",
        Some(_) => "tls",
    };
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, server_id = %server_id, config = %source_name, role, parent = %args.parent.join(","), tls = tls_mode, parent_tls = parent_tls.is_some(), "usher server listening");

    let parent_task = spawn_parent_link(&node, &args, parent_tls, &shutdown);
    let sweeper = spawn_sweeper(node.clone(), shutdown.clone());
    let reloader = source.clone().watch(revision, node.clone(), shutdown.clone());
    let election_task = spawn_election(&node, etcd.as_ref(), &args, &shutdown);
    let state_task = spawn_state_file(&node, etcd.is_some(), &args, &shutdown);
    let admin_task = tokio::spawn(usher_core::admin::serve(admin, status::handler(node.clone()), shutdown.clone()));
    let cert_reloader = tls.clone().map(|t| spawn_cert_reloader(t, node.store.clock().clone(), shutdown.clone()));
    let served = serve_grpc(grpc, &args, &node, tls, &shutdown).await;
    shutdown.cancel();
    let _ = tokio::join!(sweeper, admin_task);
    if let Some(p) = parent_task {
        let _ = p.await;
    }
    for t in [reloader, election_task, cert_reloader, state_task].into_iter().flatten() {
        let _ = t.await;
    }
    served.map_err(|e| RunError::Other(format!("gRPC server failed: {e}")))?;
    tracing::info!("usher server stopped");
    Ok(())
}

/// What the flags set up beyond plain values, checked before anything is bound.
struct Checked {
    etcd: Option<etcd::Etcd>,
    source: ConfigSource,
    tls: Option<Arc<usher_core::tls::ServerTls>>,
    parent_tls: Option<usher_core::tls::ClientTls>,
}

impl Checked {
    /// Checks the flags and loads the TLS files they name; the first mistake is the error.
    fn from_options(args: &ServerOptions) -> Result<Self, RunError> {
        let etcd = etcd_options(args)?.map(|o| etcd::Etcd::with_options(o, Clock::system()));
        let source = ConfigSource::from_arg(args.config.as_deref(), etcd.as_ref())?;
        let tls = server_tls(args, Clock::system().now().as_secs())?.map(Arc::new);
        let parent_tls = parent_tls(args)?;
        if args.max_connections == 0 {
            return Err(RunError::Usage("--max-connections must be at least 1".into()));
        }
        if etcd.is_some() && args.state_file.as_ref().is_some_and(|p| !p.as_os_str().is_empty()) {
            return Err(RunError::Usage(
                "--state-file: with --etcd-endpoints the record of outstanding leases is kept in etcd".into(),
            ));
        }
        for (flag, d) in [
            ("--preface-timeout", args.preface_timeout),
            ("--http2-keepalive-interval", args.http2_keepalive_interval),
            ("--http2-keepalive-timeout", args.http2_keepalive_timeout),
        ] {
            if d.is_zero() {
                return Err(RunError::Usage(format!("{flag} must be more than 0")));
            }
        }
        Ok(Checked { etcd, source, tls, parent_tls })
    }
}

/// Checks that etcd answers with the TLS, client certificate and credentials
/// configured, so a mistake in them is one error line and exit 69, not a
/// server that never elects. An etcd that is merely down is waited for.
async fn check_etcd(etcd: &etcd::Etcd, election_key: &str) -> Result<(), RunError> {
    match etcd.check(election_key).await {
        Ok(()) => {
            tracing::info!(endpoints = %etcd.endpoints().join(","), tls = etcd.status().tls, user = ?etcd.status().user, "etcd answers")
        }
        Err(err) if err.is_refused() => return Err(RunError::Unavailable(err.to_string())),
        Err(err) => tracing::warn!(error = %err, "etcd does not answer yet; the election keeps trying"),
    }
    Ok(())
}

impl Node {
    /// The node the flags describe, with `config` in force: its limits, its
    /// role in the tree, and whether its master is elected on `etcd`.
    fn from_options(
        args: &ServerOptions,
        server_id: String,
        config_source: String,
        config: ResourcesConfig,
        etcd: Option<&etcd::Etcd>,
        tls: Option<Arc<usher_core::tls::ServerTls>>,
    ) -> Result<Self, RunError> {
        let mut node = Node::new(
            server_id.clone(),
            config_source,
            config,
            Clock::system(),
            args.min_request_interval,
            prometheus::Registry::new(),
        );
        node.store.set_limits(store::Limits {
            max_clients_per_resource: args.max_clients_per_resource.max(1),
            max_resources: args.max_resources.max(1),
        });
        node.metrics_max_resources = args.metrics_max_resources;
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
            node.etcd = etcd.cloned();
        }
        node.tls = tls;
        node.node_id = node_id(args, &server_id);
        Ok(node)
    }
}

/// Starts an intermediate server's link to its parent; `None` at a root.
fn spawn_parent_link(
    node: &Arc<Node>,
    args: &ServerOptions,
    parent_tls: Option<usher_core::tls::ClientTls>,
    shutdown: &CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    let link = node.parent.clone()?;
    let transport: Arc<dyn usher_lease::transport::Transport> = Arc::new(
        usher_lease::transport::GrpcTransport::new(
            usher_lease::transport::DEFAULT_RPC_TIMEOUT,
            usher_lease::transport::DEFAULT_CONNECT_TIMEOUT,
        )
        .with_tls(parent_tls.map(Ok)),
    );
    Some(tokio::spawn(parent::run(
        node.clone(),
        link,
        args.parent.clone(),
        transport,
        node.store.clock().clone(),
        shutdown.clone(),
    )))
}

/// Drops expired leases every [`SWEEP_INTERVAL`], even when no request
/// touches their resource.
fn spawn_sweeper(node: Arc<Node>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_INTERVAL);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => node.store.sweep(),
            }
        }
    })
}

/// Starts campaigning for mastership on `etcd`; `None` without etcd.
fn spawn_election(
    node: &Arc<Node>,
    etcd: Option<&etcd::Etcd>,
    args: &ServerOptions,
    shutdown: &CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    match (etcd, &node.election) {
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
    }
}

/// Without etcd: reads what the last run recorded in the state file, then
/// keeps this run's record; `None` with etcd or without a state file.
fn spawn_state_file(
    node: &Arc<Node>,
    elected: bool,
    args: &ServerOptions,
    shutdown: &CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    match (elected, state_file_path(args, args.listen.port())) {
        (false, Some(path)) => {
            let clock = node.store.clock().clone();
            let recorded = state_file::take_over(&path, node, &clock);
            Some(tokio::spawn(state_file::run(path, node.clone(), clock, recorded, shutdown.clone())))
        }
        (false, None) => {
            tracing::info!("no state file (--state-file is empty, or --listen's port is 0): every start learns");
            None
        }
        (true, _) => None,
    }
}

/// Reloads the server's certificate and key whenever the certificate file
/// changes or on SIGHUP.
fn spawn_cert_reloader(
    tls: Arc<usher_core::tls::ServerTls>,
    clock: Clock,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    // Every trigger re-reads both files (the pair is compared, not one file's
    // bytes), so a rotation that writes the certificate before the key
    // still lands once the key follows. A lasting error is logged once.
    let mut causes = watch::watch(&tls.files().cert, shutdown);
    tokio::spawn(async move {
        let mut last_error = None;
        while let Some(cause) = causes.recv().await {
            match tls.reload(clock.now().as_secs()) {
                Ok(true) => tracing::info!(?cause, cert = %tls.files().cert.display(), "TLS certificate reloaded"),
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
}

/// Serves the capacity service on `grpc` until `shutdown`, and closes the
/// connections still open [`SHUTDOWN_GRACE`] after it.
async fn serve_grpc(
    grpc: tokio::net::TcpListener,
    args: &ServerOptions,
    node: &Arc<Node>,
    tls: Option<Arc<usher_core::tls::ServerTls>>,
    shutdown: &CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let svc = CapacityService::new(node.clone()).into_server();
    let builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(args.http2_keepalive_interval))
        .http2_keepalive_timeout(Some(args.http2_keepalive_timeout))
        .add_service(svc);
    let incoming = conns::incoming(
        grpc,
        conns::Limits {
            max_connections: args.max_connections.min(tokio::sync::Semaphore::MAX_PERMITS),
            preface_timeout: args.preface_timeout,
        },
        tls,
        conns::Counters {
            open: node.metrics.connections.clone(),
            refused: node.metrics.connections_refused.clone(),
            timed_out: node.metrics.connections_timed_out.clone(),
            tls_failures: node.metrics.tls_handshake_failures.clone(),
        },
        shutdown.clone(),
    );
    let serve = builder.serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    // Capacity RPCs are short; idle client connections must not hold shutdown up.
    let grace = async {
        shutdown.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::info!("closing connections still open after the shutdown grace period");
        Ok(())
    };
    tokio::select! {
        r = serve => r,
        r = grace => r,
    }
}
