//! A small etcd v3 client over etcd's JSON gateway (`/v3/...`), enough for
//! master election and for following a config key: leases, a create-if-absent
//! transaction, range, put and watch, over plain HTTP or TLS (a CA bundle,
//! optionally a client certificate), with username/password authentication.
//!
//! Why the gateway and not a gRPC client crate: the gateway ships with every
//! etcd v3 server and needs no generated code. The gRPC clients (etcd-client)
//! generate theirs with prost-build, which needs a system `protoc`, and the
//! project already has everything the gateway needs: hyper-util for HTTP/1.1,
//! rustls for TLS ([`usher_core::tls`], the same files and errors as the Doorman
//! TLS).
//!
//! Endpoints are tried in turn, starting with the last one that answered, so
//! a dead endpoint costs one timeout, not one per call. An auth token is
//! fetched before the first call and again every `token_refresh` (well within
//! etcd's `--auth-token-ttl`, 300 s by default), and once more whenever etcd
//! says a token is invalid. Errors that no retry can mend (a certificate the
//! CA does not sign, a client certificate etcd refuses, a bad password) are
//! [`EtcdError::Refused`], naming the endpoint and the reason in one line.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{Value, json};

use usher_core::clock::{Clock, Time};

/// Default `--etcd-token-refresh`: a fresh auth token this often (etcd's
/// simple tokens live 300 s unless `--auth-token-ttl` says otherwise).
pub const DEFAULT_TOKEN_REFRESH: Duration = Duration::from_secs(60);
/// Default timeout of one call to one endpoint.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why an etcd call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered; a retry may.
    #[error("etcd unreachable at {endpoints}: {reason}")]
    Unreachable {
        /// Every endpoint tried, comma-separated.
        endpoints: String,
        /// Why each failed.
        reason: String,
    },
    /// An endpoint refused us for a reason no retry mends: TLS trust, the
    /// client certificate, the credentials, a permission.
    #[error("etcd {endpoint}: {reason}")]
    Refused {
        /// The endpoint that refused.
        endpoint: String,
        /// Why, and what to change.
        reason: String,
    },
    /// etcd answered with an error status.
    #[error("etcd answered {status} to {path}: {body}")]
    Status {
        /// The gateway path called (`/v3/kv/range`).
        path: String,
        /// The HTTP status.
        status: u16,
        /// etcd's error message.
        body: String,
    },
    /// etcd's answer is not what the call expects.
    #[error("unexpected answer from etcd to {path}: {body}")]
    Decode {
        /// The gateway path called.
        path: String,
        /// The answer, or what is missing from it.
        body: String,
    },
}

impl EtcdError {
    /// True for errors that no retry mends ([`EtcdError::Refused`]).
    pub fn is_refused(&self) -> bool {
        matches!(self, EtcdError::Refused { .. })
    }
}

/// How to reach and authenticate to one etcd cluster.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// `http://host:port` or `https://host:port` (a bare `host:port` gets `http://`).
    pub endpoints: Vec<String>,
    /// TLS for `https://` endpoints: the CA bundle and, for mTLS, a client certificate.
    pub tls: Option<usher_core::tls::ClientTls>,
    /// The flags the TLS files came from, named in errors (`--etcd-ca ca.pem`).
    pub tls_hint: TlsHint,
    /// Username and password for etcd's auth.
    pub credentials: Option<(String, String)>,
    /// How often a fresh auth token is fetched (`--etcd-token-refresh`).
    pub token_refresh: Duration,
    /// The longest one call to one endpoint may take.
    pub timeout: Duration,
}

/// The TLS files, for error messages.
#[derive(Clone, Debug, Default)]
pub struct TlsHint {
    /// The CA bundle's path (`--etcd-ca`).
    pub ca: Option<String>,
    /// The client certificate's path (`--etcd-cert`).
    pub cert: Option<String>,
}

impl EtcdOptions {
    /// Plain HTTP to `endpoints`, no auth, the default token refresh and timeout.
    pub fn plain(endpoints: &[String]) -> Self {
        EtcdOptions {
            endpoints: endpoints.to_vec(),
            tls: None,
            tls_hint: TlsHint::default(),
            credentials: None,
            token_refresh: DEFAULT_TOKEN_REFRESH,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// What the status page shows of the etcd connection.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EtcdStatus {
    /// Every endpoint, in the order configured.
    pub endpoints: Vec<String>,
    /// The endpoint that answered last.
    pub current: String,
    /// Calls go over TLS.
    pub tls: bool,
    /// A client certificate is presented.
    pub client_cert: bool,
    /// The etcd user, with auth.
    pub user: Option<String>,
    /// Auth tokens fetched so far.
    pub tokens: u64,
    /// Times a call moved on to another endpoint.
    pub failovers: u64,
}

/// The HTTP client, with the TLS connector whose errors it reads.
#[derive(Clone)]
enum Http {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<usher_core::tls::Connector, Full<Bytes>>, usher_core::tls::Connector),
}

/// etcd's username/password auth, and the token it last gave.
struct Auth {
    user: String,
    password: String,
    refresh: Duration,
    token: tokio::sync::Mutex<Option<(String, Time)>>,
}

/// What the clones of one [`Etcd`] share.
struct Inner {
    endpoints: Vec<String>,
    http: Http,
    hint: TlsHint,
    auth: Option<Auth>,
    timeout: Duration,
    clock: Clock,
    preferred: AtomicUsize,
    tokens: AtomicU64,
    failovers: AtomicU64,
}

/// A client for one etcd cluster; clones share connections, the token and
/// the preferred endpoint.
#[derive(Clone)]
pub struct Etcd {
    inner: Arc<Inner>,
}

/// `s` in base64, as the gateway takes keys and values.
fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

/// A number the gateway sends as a string (int64 fields) or as a number.
fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// A field the gateway spells either in snake case or in camel case.
fn field<'a>(v: &'a Value, snake: &str) -> &'a Value {
    let f = &v[snake];
    if !f.is_null() {
        return f;
    }
    let camel: String = snake
        .split('_')
        .enumerate()
        .map(|(i, w)| if i == 0 { w.to_string() } else { w[..1].to_uppercase() + &w[1..] })
        .collect();
    &v[camel.as_str()]
}

/// The outcome of [`Etcd::create_if_absent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This call created the key.
    Won {
        /// The revision it was created at: a fencing token, it only grows.
        revision: i64,
    },
    /// The key exists and holds this value.
    Held(String),
}

/// One change to a watched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was written.
    Put {
        /// Its new value.
        value: String,
        /// The revision of the write.
        revision: i64,
    },
    /// The key was deleted.
    Delete {
        /// The revision of the delete.
        revision: i64,
    },
    /// etcd compacted the history past the revision asked for: read the key
    /// again and watch from there.
    Compacted {
        /// The revision etcd compacted up to.
        revision: i64,
    },
}

/// One failed attempt at one endpoint.
enum Attempt {
    /// Try the next endpoint.
    Transient(String),
    /// No retry mends it, but another endpoint may still answer.
    Refused(String),
    /// etcd answered: no other endpoint would answer differently.
    Answer(EtcdError),
}

/// Why each endpoint tried failed; a refusal outweighs an endpoint that is merely down.
#[derive(Default)]
struct Failures {
    refused: Option<(String, String)>,
    transient: Vec<String>,
}

impl Failures {
    fn add(&mut self, ep: &str, a: Attempt) {
        match a {
            Attempt::Refused(r) if self.refused.is_none() => self.refused = Some((ep.to_string(), r)),
            Attempt::Refused(_) | Attempt::Answer(_) => {}
            Attempt::Transient(r) => self.transient.push(format!("{ep}: {r}")),
        }
    }

    fn into_error(self, endpoints: &[String]) -> EtcdError {
        match self.refused {
            Some((endpoint, reason)) => EtcdError::Refused { endpoint, reason },
            None => EtcdError::Unreachable {
                endpoints: endpoints.join(","),
                reason: if self.transient.is_empty() {
                    "no endpoint configured".into()
                } else {
                    self.transient.join("; ")
                },
            },
        }
    }
}

impl Etcd {
    /// A plain-HTTP client with no auth; `endpoints` like `http://127.0.0.1:2379`.
    pub fn new(endpoints: &[String], timeout: Duration) -> Self {
        let mut o = EtcdOptions::plain(endpoints);
        o.timeout = timeout;
        Etcd::with_options(o, Clock::system())
    }

    /// A client configured by `o`, reading token ages from `clock`.
    pub fn with_options(o: EtcdOptions, clock: Clock) -> Self {
        let http = match &o.tls {
            None => {
                let mut connector = HttpConnector::new();
                connector.set_connect_timeout(Some(o.timeout));
                connector.set_nodelay(true);
                Http::Plain(Client::builder(TokioExecutor::new()).build(connector))
            }
            Some(tls) => {
                let connector = tls.with_alpn(&[b"http/1.1"]).connector();
                Http::Tls(Client::builder(TokioExecutor::new()).build(connector.clone()), connector)
            }
        };
        let scheme = if o.tls.is_some() { "https" } else { "http" };
        Etcd {
            inner: Arc::new(Inner {
                endpoints: o
                    .endpoints
                    .iter()
                    .map(|e| {
                        if e.contains("://") { e.trim_end_matches('/').to_string() } else { format!("{scheme}://{e}") }
                    })
                    .collect(),
                http,
                hint: o.tls_hint,
                auth: o.credentials.map(|(user, password)| Auth {
                    user,
                    password,
                    refresh: o.token_refresh,
                    token: tokio::sync::Mutex::new(None),
                }),
                timeout: o.timeout,
                clock,
                preferred: AtomicUsize::new(0),
                tokens: AtomicU64::new(0),
                failovers: AtomicU64::new(0),
            }),
        }
    }

    /// The endpoints, each with its scheme.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// What status pages show of the connection now.
    pub fn status(&self) -> EtcdStatus {
        let i = &self.inner;
        EtcdStatus {
            endpoints: i.endpoints.clone(),
            current: i.endpoints.get(i.preferred.load(Ordering::Relaxed)).cloned().unwrap_or_default(),
            tls: matches!(i.http, Http::Tls(..)),
            client_cert: i.hint.cert.is_some(),
            user: i.auth.as_ref().map(|a| a.user.clone()),
            tokens: i.tokens.load(Ordering::Relaxed),
            failovers: i.failovers.load(Ordering::Relaxed),
        }
    }

    /// Endpoints in the order to try them: the one that answered last first.
    fn order(&self) -> impl Iterator<Item = (usize, &str)> {
        let n = self.inner.endpoints.len();
        let start = self.inner.preferred.load(Ordering::Relaxed) % n.max(1);
        (0..n).map(move |k| {
            let i = (start + k) % n;
            (i, self.inner.endpoints[i].as_str())
        })
    }

    /// Makes endpoint `i` the first to try, counting a failover when it changes.
    fn prefer(&self, i: usize) {
        if self.inner.preferred.swap(i, Ordering::Relaxed) != i {
            self.inner.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::info!(endpoint = %self.inner.endpoints[i], "etcd: now using this endpoint");
        }
    }

    /// Sends one request to one endpoint; `Ok` is the response head and body stream.
    async fn send(
        &self,
        ep: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<http::Response<hyper::body::Incoming>, Attempt> {
        if ep.starts_with("https://") && matches!(self.inner.http, Http::Plain(_)) {
            return Err(Attempt::Refused(
                "an https:// endpoint needs --etcd-ca (the CA that signs etcd's certificate)".into(),
            ));
        }
        if ep.starts_with("http://") && matches!(self.inner.http, Http::Tls(..)) {
            return Err(Attempt::Refused("TLS is configured (--etcd-ca) but this endpoint is http://".into()));
        }
        let mut req = http::Request::post(format!("{ep}{path}")).header("content-type", "application/json");
        if let Some(t) = token {
            req = req.header("authorization", t);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).map_err(|e| Attempt::Refused(e.to_string()))?;
        let fut = match &self.inner.http {
            Http::Plain(c) => c.request(req),
            Http::Tls(c, _) => c.request(req),
        };
        match tokio::time::timeout(self.inner.timeout, fut).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(self.classify(&e)),
            Err(_) => Err(Attempt::Transient(format!("timed out after {:?}", self.inner.timeout))),
        }
    }

    /// Turns a connection error into one line saying why, and whether a retry may help.
    fn classify(&self, e: &(dyn std::error::Error + 'static)) -> Attempt {
        let mut chain = Vec::new();
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(s) = src {
            let m = s.to_string();
            if !chain.iter().any(|c: &String| c.contains(&m)) {
                chain.push(m);
            }
            src = s.source();
        }
        if let Http::Tls(_, c) = &self.inner.http
            && let Some(alert) = c.take_error()
        {
            chain.push(alert);
        }
        let text = chain.join(": ");
        let hint = &self.inner.hint;
        let ca = hint.ca.as_deref().unwrap_or("--etcd-ca");
        if text.contains("invalid peer certificate") {
            let why = text.split("invalid peer certificate").nth(1).unwrap_or("").trim_start_matches(':').trim();
            let what = if why.contains("NotValidForName") {
                "its name does not match the endpoint's host".to_string()
            } else if why.contains("UnknownIssuer") {
                format!("it is not signed by a CA in {ca}")
            } else {
                why.to_string()
            };
            return Attempt::Refused(format!("TLS: etcd's certificate is not trusted: {what} ({why})"));
        }
        if let Some(alert) = text.split("received fatal alert: ").nth(1) {
            let alert = alert.split([':', ' ', ')']).next().unwrap_or(alert);
            let why = match (alert, &hint.cert) {
                (_, None) => "etcd requires a client certificate: set --etcd-cert and --etcd-key".to_string(),
                (_, Some(cert)) => {
                    format!("etcd refused the client certificate {cert} (is it signed by a CA etcd trusts?)")
                }
            };
            return Attempt::Refused(format!("TLS: {why} (alert {alert})"));
        }
        if text.contains("does not answer in TLS") || text.contains("InvalidContentType") {
            return Attempt::Refused("TLS: this endpoint does not speak TLS; use http:// or enable TLS in etcd".into());
        }
        Attempt::Transient(text)
    }

    /// One POST to the endpoints in turn; etcd's answer, or why none answered.
    async fn post_raw(&self, path: &str, body: &Value, token: Option<&str>) -> Result<Value, EtcdError> {
        let mut failures = Failures::default();
        for (i, ep) in self.order() {
            match self.exchange(ep, path, body, token).await {
                Ok(v) => {
                    self.prefer(i);
                    return Ok(v);
                }
                Err(Attempt::Answer(e)) => {
                    self.prefer(i);
                    return Err(e);
                }
                Err(a) => failures.add(ep, a),
            }
        }
        Err(failures.into_error(&self.inner.endpoints))
    }

    /// One POST to one endpoint; the answer's `result`, or what failed.
    async fn exchange(&self, ep: &str, path: &str, body: &Value, token: Option<&str>) -> Result<Value, Attempt> {
        let resp = self.send(ep, path, body, token).await?;
        let status = resp.status().as_u16();
        let bytes = match tokio::time::timeout(self.inner.timeout, resp.into_body().collect()).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(e)) => return Err(self.classify(&e)),
            Err(_) => return Err(Attempt::Transient("reading the answer timed out".into())),
        };
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if status != 200 {
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let msg = v["error"].as_str().or(v["message"].as_str()).unwrap_or(text.trim()).to_string();
            return Err(self.answer_error(ep, path, status, msg));
        }
        let first = text.lines().next().unwrap_or("");
        let v: Value = serde_json::from_str(first)
            .map_err(|_| Attempt::Answer(EtcdError::Decode { path: path.into(), body: text.clone() }))?;
        Ok(v.get("result").cloned().unwrap_or(v))
    }

    /// An error answer: etcd is there, but says no.
    fn answer_error(&self, ep: &str, path: &str, status: u16, msg: String) -> Attempt {
        let user = self.inner.auth.as_ref().map(|a| a.user.as_str());
        let refused = |reason: String| Attempt::Answer(EtcdError::Refused { endpoint: ep.into(), reason });
        if msg.contains("authentication failed") {
            return refused(format!(
                "authentication as `{}` failed: {} (check --etcd-user and the password)",
                user.unwrap_or(""),
                msg.trim_start_matches("etcdserver: ")
            ));
        }
        if msg.contains("user name is empty") || msg.contains("user name not found") && user.is_none() {
            return refused(
                "etcd has auth enabled: set --etcd-user and USHER_ETCD_PASSWORD (or --etcd-password-file)".into(),
            );
        }
        if msg.contains("CommonName of client") {
            return refused(format!(
                "etcd's JSON gateway refuses a client certificate with a CommonName while auth is enabled: \
                 issue {} without a CN (SANs only); the user comes from --etcd-user",
                self.inner.hint.cert.as_deref().unwrap_or("--etcd-cert")
            ));
        }
        if msg.contains("permission denied") {
            return refused(format!(
                "user `{}` may not {path}: permission denied (grant its role readwrite on the keys)",
                user.unwrap_or("")
            ));
        }
        if status >= 500 && !msg.contains("invalid auth token") {
            // No leader, too many requests, shutting down: another member may do better.
            return Attempt::Transient(format!("{status}: {msg}"));
        }
        Attempt::Answer(EtcdError::Status { path: path.into(), status, body: msg })
    }

    /// The auth token to send, fetched again when older than the refresh interval or when `force`d.
    async fn token(&self, force: bool) -> Result<Option<String>, EtcdError> {
        let Some(auth) = &self.inner.auth else { return Ok(None) };
        let mut slot = auth.token.lock().await;
        let now = self.inner.clock.now();
        if !force
            && let Some((t, at)) = &*slot
            && now.since(*at) < auth.refresh
        {
            return Ok(Some(t.clone()));
        }
        let v = self
            .post_raw("/v3/auth/authenticate", &json!({ "name": auth.user, "password": auth.password }), None)
            .await?;
        let token = v["token"].as_str().filter(|t| !t.is_empty()).ok_or_else(|| EtcdError::Decode {
            path: "/v3/auth/authenticate".into(),
            body: "no token in the answer (is auth enabled in etcd?)".into(),
        })?;
        self.inner.tokens.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(user = %auth.user, "etcd auth token refreshed");
        *slot = Some((token.to_string(), now));
        Ok(Some(token.to_string()))
    }

    /// One call with the current token; a token etcd no longer knows is fetched again once.
    pub async fn request(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let token = self.token(false).await?;
        match self.post_raw(path, &body, token.as_deref()).await {
            Err(EtcdError::Status { body: msg, .. })
                if self.inner.auth.is_some() && msg.contains("invalid auth token") =>
            {
                tracing::info!("etcd: the auth token expired early; fetching a new one");
                let token = self.token(true).await?;
                self.post_raw(path, &body, token.as_deref()).await
            }
            r => r,
        }
    }

    /// Checks that etcd answers, with TLS and credentials as configured: one
    /// read of `key`, or the reason no endpoint answers.
    pub async fn check(&self, key: &str) -> Result<(), EtcdError> {
        self.get(key).await.map(|_| ())
    }

    /// Grants a lease of `ttl`; returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let v = self.request("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1) })).await?;
        num(&v["ID"]).ok_or_else(|| EtcdError::Decode { path: "/v3/lease/grant".into(), body: v.to_string() })
    }

    /// Renews a lease; returns its remaining TTL in seconds (0 or less: it is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let v = self.request("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(num(&v["TTL"]).unwrap_or(0))
    }

    /// Revokes a lease, deleting the keys attached to it.
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.request("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(|_| ())
    }

    /// Puts `value` under `key` only if the key does not exist, attached to `lease`.
    pub async fn create_if_absent(&self, key: &str, value: &str, lease: i64) -> Result<Claim, EtcdError> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
            "success": [{ "request_put": { "key": k, "value": b64(value.as_bytes()), "lease": lease.to_string() } }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let v = self.request("/v3/kv/txn", body).await?;
        if v["succeeded"].as_bool().unwrap_or(false) {
            return Ok(Claim::Won { revision: num(&v["header"]["revision"]).unwrap_or(0) });
        }
        let kv = &field(&v["responses"][0], "response_range")["kvs"][0];
        Ok(Claim::Held(decode_value(kv).unwrap_or_default()))
    }

    /// The value under `key`, if any.
    pub async fn get(&self, key: &str) -> Result<Option<String>, EtcdError> {
        self.get_at(key).await.map(|(v, _)| v)
    }

    /// The value under `key`, if any, and the store's revision it was read at.
    pub async fn get_at(&self, key: &str) -> Result<(Option<String>, i64), EtcdError> {
        let v = self.request("/v3/kv/range", json!({ "key": b64(key.as_bytes()) })).await?;
        Ok((decode_value(&v["kvs"][0]), num(&v["header"]["revision"]).unwrap_or(0)))
    }

    /// Puts `value` under `key`.
    pub async fn put(&self, key: &str, value: &str) -> Result<(), EtcdError> {
        self.request("/v3/kv/put", json!({ "key": b64(key.as_bytes()), "value": b64(value.as_bytes()) }))
            .await
            .map(|_| ())
    }

    /// Deletes `key` if its value is still `value` (so a master only ever removes its own claim).
    pub async fn delete_if(&self, key: &str, value: &str) -> Result<(), EtcdError> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{ "key": k, "target": "VALUE", "result": "EQUAL", "value": b64(value.as_bytes()) }],
            "success": [{ "request_delete_range": { "key": k } }],
        });
        self.request("/v3/kv/txn", body).await.map(|_| ())
    }

    /// Opens a watch on `key` for changes from `start_revision` on.
    pub async fn watch(&self, key: &str, start_revision: i64) -> Result<Watch, EtcdError> {
        let token = self.token(false).await?;
        match self.open_watch(key, start_revision, token).await {
            Err(EtcdError::Status { body, .. }) if self.inner.auth.is_some() && body.contains("invalid auth token") => {
                let token = self.token(true).await?;
                self.open_watch(key, start_revision, token).await
            }
            r => r,
        }
    }

    /// Opens a watch with `token` on the first endpoint that takes it.
    async fn open_watch(&self, key: &str, start_revision: i64, token: Option<String>) -> Result<Watch, EtcdError> {
        let body =
            json!({ "create_request": { "key": b64(key.as_bytes()), "start_revision": start_revision.to_string() } });
        let mut failures = Failures::default();
        for (i, ep) in self.order() {
            match self.send(ep, "/v3/watch", &body, token.as_deref()).await {
                Ok(resp) if resp.status() == 200 => {
                    self.prefer(i);
                    return Ok(Watch { endpoint: ep.to_string(), body: resp.into_body(), buf: Vec::new() });
                }
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                    let msg = String::from_utf8_lossy(&text).into_owned();
                    match self.answer_error(ep, "/v3/watch", status, msg) {
                        Attempt::Answer(e) => return Err(e),
                        a => failures.add(ep, a),
                    }
                }
                Err(Attempt::Answer(e)) => return Err(e),
                Err(a) => failures.add(ep, a),
            }
        }
        Err(failures.into_error(&self.inner.endpoints))
    }
}

/// An open watch: the gateway streams one JSON message per line.
pub struct Watch {
    /// The endpoint the watch is open on.
    pub endpoint: String,
    body: hyper::body::Incoming,
    buf: Vec<u8>,
}

impl Watch {
    /// The next batch of events; `Ok(None)` when etcd ended the stream.
    pub async fn next(&mut self) -> Result<Option<Vec<WatchEvent>>, EtcdError> {
        loop {
            if let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                let Ok(v) = serde_json::from_slice::<Value>(&line) else { continue };
                if let Some(events) = parse_watch_message(&v) {
                    return Ok(Some(events));
                }
                continue;
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(EtcdError::Unreachable { endpoints: self.endpoint.clone(), reason: e.to_string() });
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// The events of one watch message; `None` for messages without any (created, progress).
fn parse_watch_message(v: &Value) -> Option<Vec<WatchEvent>> {
    let r = v.get("result").unwrap_or(v);
    let compact = num(field(r, "compact_revision")).unwrap_or(0);
    if compact > 0 {
        return Some(vec![WatchEvent::Compacted { revision: compact }]);
    }
    let events: Vec<WatchEvent> = r["events"]
        .as_array()?
        .iter()
        .map(|e| {
            let kv = &e["kv"];
            let revision = num(field(kv, "mod_revision")).unwrap_or(0);
            if e["type"].as_str() == Some("DELETE") {
                WatchEvent::Delete { revision }
            } else {
                WatchEvent::Put { value: decode_value(kv).unwrap_or_default(), revision }
            }
        })
        .collect();
    (!events.is_empty()).then_some(events)
}

/// The value of a key-value pair from the gateway; `None` without a pair.
fn decode_value(kv: &Value) -> Option<String> {
    if kv.is_null() {
        return None;
    }
    let v = kv["value"].as_str().unwrap_or("");
    B64.decode(v).ok().map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_messages_parse_in_both_spellings() {
        let put = json!({"result": {"header": {"revision": "7"}, "events": [
            {"kv": {"key": "eA==", "value": b64(b"hello"), "mod_revision": "7"}},
            {"type": "DELETE", "kv": {"key": "eA==", "modRevision": "8"}}]}});
        assert_eq!(
            parse_watch_message(&put),
            Some(vec![WatchEvent::Put { value: "hello".into(), revision: 7 }, WatchEvent::Delete { revision: 8 }])
        );
        assert_eq!(parse_watch_message(&json!({"result": {"created": true, "header": {}}})), None);
        assert_eq!(
            parse_watch_message(&json!({"result": {"canceled": true, "compactRevision": "12"}})),
            Some(vec![WatchEvent::Compacted { revision: 12 }])
        );
    }
}
