//! How the lease client reaches capacity servers: the [`Transport`] trait and
//! real gRPC connections ([`GrpcTransport`]). The in-process table of servers
//! (embedded mode, tests and `usher sim`) lives with the server, as
//! `usher_server::LocalTransport`, so this module needs nothing of the server.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use super::core::CallError;
use usher_core::tls::{ClientTls, Connector};
use usher_proto as proto;
use usher_proto::capacity_client::CapacityClient;

/// The future a [`Transport`] call returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The three calls a lease client makes.
pub trait Transport: Send + Sync + 'static {
    /// Asks `addr` who the master is.
    fn discovery(&self, addr: &str) -> BoxFuture<'_, Result<proto::DiscoveryResponse, CallError>>;
    /// Asks `addr` for leases (and renews them).
    fn get_capacity(
        &self,
        addr: &str,
        req: proto::GetCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetCapacityResponse, CallError>>;
    /// Gives leases back to `addr`.
    fn release_capacity(
        &self,
        addr: &str,
        req: proto::ReleaseCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::ReleaseCapacityResponse, CallError>>;
    /// What an intermediate server asks its parent.
    fn get_server_capacity(
        &self,
        addr: &str,
        req: proto::GetServerCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetServerCapacityResponse, CallError>>;
}

/// Default time limit of one capacity RPC.
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time limit to open a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One server's channel, and its TLS connector (which remembers why a connection ended).
type Conn = (CapacityClient<Channel>, Option<Connector>);

/// gRPC over HTTP/2 with one lazily connected channel per address, in
/// cleartext or over TLS. With TLS every address is dialled the same way,
/// including masters named by redirects and Discovery.
pub struct GrpcTransport {
    channels: Mutex<HashMap<String, Conn>>,
    rpc_timeout: Duration,
    connect_timeout: Duration,
    tls: Option<Result<ClientTls, String>>,
}

pub use usher_core::config::doorman::{check_server_address, parse_server_address};

impl GrpcTransport {
    /// A transport in cleartext, with these limits on each call and on each connection attempt.
    pub fn new(rpc_timeout: Duration, connect_timeout: Duration) -> Self {
        GrpcTransport { channels: Mutex::new(HashMap::new()), rpc_timeout, connect_timeout, tls: None }
    }

    /// Every connection speaks TLS with `tls`; a TLS setup that failed fails every call.
    pub fn with_tls(mut self, tls: Option<Result<ClientTls, String>>) -> Self {
        self.tls = tls;
        self
    }

    fn client(&self, addr: &str) -> Result<Conn, CallError> {
        let mut map = self.channels.lock().expect("channel map poisoned");
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let uri = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
        let ep = Endpoint::from_shared(uri)
            .map_err(|e| CallError::Permanent(format!("bad server address `{addr}`: {e}")))?
            .connect_timeout(self.connect_timeout)
            .timeout(self.rpc_timeout)
            .tcp_nodelay(true);
        let (channel, connector) = match &self.tls {
            None => (ep.connect_lazy(), None),
            Some(Ok(tls)) => {
                let connector = tls.connector();
                (ep.connect_with_connector_lazy(connector.clone()), Some(connector))
            }
            Some(Err(e)) => return Err(CallError::Permanent(e.clone())),
        };
        let c = (CapacityClient::new(channel), connector);
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// A failed connection is dropped so the next call reconnects from scratch.
    fn forget(&self, addr: &str) {
        self.channels.lock().expect("channel map poisoned").remove(addr);
    }

    async fn call<T, F, Fut>(&self, addr: &str, f: F) -> Result<T, CallError>
    where
        F: FnOnce(CapacityClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let (c, connector) = self.client(addr)?;
        match f(c).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => {
                let code = s.code();
                if matches!(code, tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled) {
                    self.forget(addr);
                    // "transport error" alone hides the cause (refused, TLS, ...): add the chain,
                    // and what ended the connection (a TLS alert after the handshake).
                    let mut why = String::new();
                    let mut src = std::error::Error::source(&s);
                    while let Some(e) = src {
                        let m = e.to_string();
                        if m != "transport error" && !why.contains(&m) && !s.message().contains(&m) {
                            why.push_str(": ");
                            why.push_str(&m);
                        }
                        src = e.source();
                    }
                    if let Some(e) = connector.and_then(|c| c.take_error())
                        && !why.contains(&e)
                    {
                        why.push_str(&format!(" (connection closed: {e})"));
                    }
                    if !why.is_empty() {
                        return Err(CallError::from_status(&tonic::Status::new(
                            s.code(),
                            format!("{}{why}", s.message()),
                        )));
                    }
                }
                Err(CallError::from_status(&s))
            }
        }
    }
}

impl Transport for GrpcTransport {
    fn discovery(&self, addr: &str) -> BoxFuture<'_, Result<proto::DiscoveryResponse, CallError>> {
        let addr = addr.to_string();
        Box::pin(
            async move { self.call(&addr, |mut c| async move { c.discovery(proto::DiscoveryRequest {}).await }).await },
        )
    }

    fn get_capacity(
        &self,
        addr: &str,
        req: proto::GetCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetCapacityResponse, CallError>> {
        let addr = addr.to_string();
        Box::pin(async move { self.call(&addr, |mut c| async move { c.get_capacity(req).await }).await })
    }

    fn release_capacity(
        &self,
        addr: &str,
        req: proto::ReleaseCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::ReleaseCapacityResponse, CallError>> {
        let addr = addr.to_string();
        Box::pin(async move { self.call(&addr, |mut c| async move { c.release_capacity(req).await }).await })
    }

    fn get_server_capacity(
        &self,
        addr: &str,
        req: proto::GetServerCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetServerCapacityResponse, CallError>> {
        let addr = addr.to_string();
        Box::pin(async move { self.call(&addr, |mut c| async move { c.get_server_capacity(req).await }).await })
    }
}

#[cfg(test)]
mod address_tests {
    use super::check_server_address;

    #[test]
    fn server_addresses_are_host_and_port() {
        for ok in [
            "doorman-0:15100",
            "127.0.0.1:1",
            "[::1]:15100",
            "http://a.test:80",
            "https://a.test:443/",
            "https://a.test",
            "HTTP://a.test:1",
            "localhost.:15100",
            "http://[::1]:15100",
            "https://[::1]",
        ] {
            assert_eq!(check_server_address(ok), Ok(()), "{ok}");
        }
        for (bad, says) in [
            ("", "is empty"),
            ("nohostport", "needs a port"),
            ("::1:15100", "more than one `:`"),
            ("a b:1", "not a host name"),
            (":15100", "needs a host"),
            ("127.0.0.1:99999", "not a number from 1 to 65535"),
            ("127.0.0.1:0", "not a number from 1 to 65535"),
            ("ftp://127.0.0.1:1", "`ftp://` is not a scheme"),
            ("127.0.0.1:1/path", "no path"),
            ("[::1]", "needs a port"),
        ] {
            let e = check_server_address(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
