//! The in-process transport: capacity servers living in this process,
//! addressed by name, reached through the lease client's [`Transport`] trait
//! without a network hop (the sidecar's embedded server, `usher sim`, tests).
//! It lives with the server so that the lease client depends on nothing of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{CapacityService, Node};
use usher_lease::core::CallError;
use usher_lease::transport::{BoxFuture, Transport};
use usher_proto as proto;
use usher_proto::capacity_server::Capacity;

/// Servers living in this process, addressed by name. An address with no
/// server, or one marked down, behaves like an unreachable host.
#[derive(Default)]
pub struct LocalTransport {
    servers: Mutex<HashMap<String, (CapacityService, bool)>>,
}

impl LocalTransport {
    /// A transport with no server yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves `node` at `addr`, in place of any server there, and makes it
    /// reachable; its answers are never held (see
    /// [`CapacityService::without_newcomer_wait`]).
    pub fn add(&self, addr: impl Into<String>, node: Arc<Node>) {
        self.servers
            .lock()
            .expect("server map poisoned")
            .insert(addr.into(), (CapacityService::new(node).without_newcomer_wait(), true));
    }

    /// Makes `addr` unreachable (`false`) or reachable again.
    pub fn set_up(&self, addr: &str, up: bool) {
        if let Some(s) = self.servers.lock().expect("server map poisoned").get_mut(addr) {
            s.1 = up;
        }
    }

    fn service(&self, addr: &str) -> Result<CapacityService, CallError> {
        match self.servers.lock().expect("server map poisoned").get(addr) {
            Some((svc, true)) => Ok(svc.clone()),
            _ => Err(CallError::Transient(format!("Unavailable: {addr} is unreachable"))),
        }
    }
}

/// A service's answer as a transport call's result.
fn local<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Result<T, CallError> {
    r.map(tonic::Response::into_inner).map_err(|s| CallError::from_status(&s))
}

impl Transport for LocalTransport {
    fn discovery(&self, addr: &str) -> BoxFuture<'_, Result<proto::DiscoveryResponse, CallError>> {
        let svc = self.service(addr);
        Box::pin(async move { local(svc?.discovery(tonic::Request::new(proto::DiscoveryRequest {})).await) })
    }

    fn get_capacity(
        &self,
        addr: &str,
        req: proto::GetCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetCapacityResponse, CallError>> {
        let svc = self.service(addr);
        Box::pin(async move { local(svc?.get_capacity(tonic::Request::new(req)).await) })
    }

    fn release_capacity(
        &self,
        addr: &str,
        req: proto::ReleaseCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::ReleaseCapacityResponse, CallError>> {
        let svc = self.service(addr);
        Box::pin(async move { local(svc?.release_capacity(tonic::Request::new(req)).await) })
    }

    fn get_server_capacity(
        &self,
        addr: &str,
        req: proto::GetServerCapacityRequest,
    ) -> BoxFuture<'_, Result<proto::GetServerCapacityResponse, CallError>> {
        let svc = self.service(addr);
        Box::pin(async move { local(svc?.get_server_capacity(tonic::Request::new(req)).await) })
    }
}
