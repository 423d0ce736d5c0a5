//! The flags of `usher server` and `usher proxy`: clap's types, here in the
//! binary, turned into the libraries' plain options (`usher_server::ServerOptions`,
//! `usher_proxy::ProxyOptions`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `usher server` flags; each can also be set as `USHER_<FLAG>`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Doorman resources file (YAML). Reloaded on SIGHUP and whenever it changes.
    /// Without it, the built-in default applies: every resource id gets 100/s, FAIR_SHARE.
    #[arg(long, env = "USHER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where a server without etcd records until when its leases may be outstanding, so that
    /// a restart learns while they may be and a fresh start (no file) serves at once; written
    /// every 2 s, atomically. An empty value keeps no record: every start learns. With
    /// --etcd-endpoints the record is kept in etcd instead
    /// [default: $XDG_STATE_HOME/usher/server-PORT.state, or ~/.local/state/usher/server-PORT.state,
    /// PORT being --listen's; none with port 0]
    #[arg(long, env = "USHER_STATE_FILE", value_name = "FILE", value_parser = empty_or_path())]
    pub state_file: Option<PathBuf>,
    /// Address for the gRPC `doorman.Capacity` service.
    #[arg(long, env = "USHER_LISTEN", value_name = "ADDR", default_value = usher_server::DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Address for /metrics, /healthz, /readyz and /debug pages.
    #[arg(long, env = "USHER_ADMIN_LISTEN", value_name = "ADDR", default_value = usher_server::DEFAULT_ADMIN_LISTEN)]
    pub admin_listen: SocketAddr,
    /// This server's id and the master address it announces [default: HOSTNAME:PORT of --listen].
    #[arg(long, env = "USHER_ADVERTISE_ADDR", value_name = "HOST:PORT")]
    pub advertise_addr: Option<String>,
    /// A client asking again for a resource sooner than this gets its current lease back unchanged.
    #[arg(long, env = "USHER_MIN_REQUEST_INTERVAL", value_name = "DURATION", default_value = usher_server::DEFAULT_MIN_REQUEST_INTERVAL, value_parser = usher::parse_duration)]
    pub min_request_interval: Duration,
    /// Run as an intermediate server leasing from these parent servers (any servers of the
    /// parent node; Discovery finds its master). Without it, this is a root server.
    #[arg(
        long,
        env = "USHER_PARENT",
        value_name = "ADDR[,ADDR...]",
        value_delimiter = ',',
        value_parser = usher_core::config::doorman::parse_server_address
    )]
    pub parent: Vec<String>,
    /// The identity every replica of this node shares towards its parent, so that a new master
    /// takes over its predecessor's lease there [default: with --etcd-endpoints, the election key
    /// and the endpoints; else the server id].
    #[arg(long, env = "USHER_NODE_ID", value_name = "ID")]
    pub node_id: Option<String>,
    /// Leases handed down refresh this many times the parent's refresh interval (never below 1 s).
    #[arg(long, env = "USHER_DECAY_FACTOR", value_name = "FACTOR", default_value_t = usher_server::DEFAULT_DECAY_FACTOR)]
    pub decay_factor: f64,
    /// New clients of a resource beyond this many get ResourceExhausted.
    #[arg(long, env = "USHER_MAX_CLIENTS_PER_RESOURCE", value_name = "N", default_value_t = usher_server::store::DEFAULT_MAX_CLIENTS_PER_RESOURCE)]
    pub max_clients_per_resource: usize,
    /// New resource ids beyond this many get ResourceExhausted.
    #[arg(long, env = "USHER_MAX_RESOURCES", value_name = "N", default_value_t = usher_server::store::DEFAULT_MAX_RESOURCES)]
    pub max_resources: usize,
    /// At most this many resources get their own usher_server_resource_* series on /metrics
    /// (those the configuration names first, then the busiest); the rest count in the
    /// per-template sums and usher_server_resources_unlisted.
    #[arg(long, env = "USHER_METRICS_MAX_RESOURCES", value_name = "N", default_value_t = usher_server::metrics::DEFAULT_METRICS_MAX_RESOURCES)]
    pub metrics_max_resources: usize,
    /// gRPC connections open at once (TLS handshakes included); more are closed as soon as they are accepted.
    #[arg(long, env = "USHER_MAX_CONNECTIONS", value_name = "N", default_value_t = usher_server::conns::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// A gRPC connection that has not sent its complete HTTP/2 preface this long after it was
    /// accepted (after the TLS handshake, with TLS) is closed.
    #[arg(long, env = "USHER_PREFACE_TIMEOUT", value_name = "DURATION", default_value = usher_server::conns::DEFAULT_PREFACE_TIMEOUT, value_parser = usher::parse_duration)]
    pub preface_timeout: Duration,
    /// Send an HTTP/2 PING on a gRPC connection that has been silent this long...
    #[arg(long, env = "USHER_HTTP2_KEEPALIVE_INTERVAL", value_name = "DURATION", default_value = usher_server::conns::DEFAULT_KEEPALIVE_INTERVAL, value_parser = usher::parse_duration)]
    pub http2_keepalive_interval: Duration,
    /// ...and close it when the PING is not answered within this long.
    #[arg(long, env = "USHER_HTTP2_KEEPALIVE_TIMEOUT", value_name = "DURATION", default_value = usher_server::conns::DEFAULT_KEEPALIVE_TIMEOUT, value_parser = usher::parse_duration)]
    pub http2_keepalive_timeout: Duration,
    /// etcd v3 endpoints (e.g. http://etcd:2379, or https:// with --etcd-ca) for master election
    /// and `--config etcd:KEY`; tried in turn. Without them this server is always the master of its node.
    #[arg(long, env = "USHER_ETCD_ENDPOINTS", value_name = "URL[,URL...]", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Trust these CAs (PEM) for etcd's certificate: TLS to `https://` endpoints.
    #[arg(long, env = "USHER_ETCD_CA", value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that requires client certificates; needs --etcd-key.
    #[arg(long, env = "USHER_ETCD_CERT", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The private key (PEM) of --etcd-cert.
    #[arg(long, env = "USHER_ETCD_KEY", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// Name to verify in etcd's certificate [default: the host of each endpoint].
    #[arg(long, env = "USHER_ETCD_SERVER_NAME", value_name = "NAME")]
    pub etcd_server_name: Option<String>,
    /// etcd user (auth enabled in etcd); the password comes from USHER_ETCD_PASSWORD or
    /// --etcd-password-file.
    #[arg(long, env = "USHER_ETCD_USER", value_name = "USER")]
    pub etcd_user: Option<String>,
    /// The etcd user's password. Prefer the environment (from a Secret) or --etcd-password-file:
    /// a flag shows in the process list.
    #[arg(long, env = "USHER_ETCD_PASSWORD", value_name = "PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// A file holding the etcd user's password (a trailing newline is ignored).
    #[arg(long, env = "USHER_ETCD_PASSWORD_FILE", value_name = "FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// Fetch a new etcd auth token this often; keep it below etcd's --auth-token-ttl (300 s by default).
    #[arg(long, env = "USHER_ETCD_TOKEN_REFRESH", value_name = "DURATION", default_value = "60s", value_parser = usher::parse_duration)]
    pub etcd_token_refresh: Duration,
    /// The etcd key the servers of one node campaign for; it holds the master's address.
    #[arg(long, env = "USHER_ELECTION_KEY", value_name = "KEY", default_value = usher_server::election::DEFAULT_KEY)]
    pub election_key: String,
    /// Lease TTL of the election key: a dead master is replaced within about this long.
    #[arg(long, env = "USHER_ELECTION_TTL", value_name = "DURATION", default_value = "10s", value_parser = usher::parse_duration)]
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

/// A path that may be empty (clap's `PathBuf` parser refuses an empty value):
/// `--state-file ""` keeps no record.
fn empty_or_path() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    use clap::builder::TypedValueParser;
    clap::builder::OsStringValueParser::new().map(PathBuf::from)
}

impl From<ServerArgs> for usher_server::ServerOptions {
    fn from(a: ServerArgs) -> Self {
        usher_server::ServerOptions {
            config: a.config,
            state_file: a.state_file,
            listen: a.listen,
            admin_listen: a.admin_listen,
            advertise_addr: a.advertise_addr,
            min_request_interval: a.min_request_interval,
            parent: a.parent,
            node_id: a.node_id,
            decay_factor: a.decay_factor,
            max_clients_per_resource: a.max_clients_per_resource,
            max_resources: a.max_resources,
            metrics_max_resources: a.metrics_max_resources,
            max_connections: a.max_connections,
            preface_timeout: a.preface_timeout,
            http2_keepalive_interval: a.http2_keepalive_interval,
            http2_keepalive_timeout: a.http2_keepalive_timeout,
            etcd_endpoints: a.etcd_endpoints,
            etcd_ca: a.etcd_ca,
            etcd_cert: a.etcd_cert,
            etcd_key: a.etcd_key,
            etcd_server_name: a.etcd_server_name,
            etcd_user: a.etcd_user,
            etcd_password: a.etcd_password,
            etcd_password_file: a.etcd_password_file,
            etcd_token_refresh: a.etcd_token_refresh,
            election_key: a.election_key,
            election_ttl: a.election_ttl,
            tls_cert: a.tls_cert,
            tls_key: a.tls_key,
            tls_client_ca: a.tls_client_ca,
            parent_tls_ca: a.parent_tls_ca,
            parent_tls_cert: a.parent_tls_cert,
            parent_tls_key: a.parent_tls_key,
            parent_tls_server_name: a.parent_tls_server_name,
        }
    }
}

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
    /// HTTP/1.1 upstreams, plain or TLS, hyper for the rest) or `hyper` (hyper for everything).
    #[arg(long, env = "USHER_HTTP1", value_enum, default_value_t = Http1::Native)]
    pub http1: Http1,
}

impl From<ProxyArgs> for usher_proxy::ProxyOptions {
    fn from(a: ProxyArgs) -> Self {
        usher_proxy::ProxyOptions {
            routes: a.routes,
            listen: a.listen,
            admin_listen: a.admin_listen,
            http1: a.http1.into(),
        }
    }
}

/// What serves the app's HTTP/1.1 (`--http1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Http1 {
    /// usher's own request loop for everyday requests to HTTP/1.1
    /// upstreams (plain or TLS); a connection moves to hyper at its first other request.
    Native,
    /// hyper for every request.
    Hyper,
}

impl From<Http1> for usher_proxy::Http1 {
    fn from(h: Http1) -> Self {
        match h {
            Http1::Native => usher_proxy::Http1::Native,
            Http1::Hyper => usher_proxy::Http1::Hyper,
        }
    }
}
