//! Capacity calls split into requests a server accepts: at most
//! [`MAX_RESOURCES_PER_CALL`] resources each, sent one after the other, their
//! answers merged. A sidecar with many tenant keys and an intermediate
//! speaking for as many resources both go through here.

use std::future::Future;

use super::core::CallError;
use super::transport::Transport;
use usher_proto as proto;

/// Most resources in one GetCapacity, GetServerCapacity or ReleaseCapacity:
/// what usher's server accepts in one request
/// (`server::service::MAX_RESOURCES_PER_REQUEST`), and at most a few MB,
/// within real Doorman servers' 4 MiB message limit.
pub const MAX_RESOURCES_PER_CALL: usize = 10_000;

/// One call per [`MAX_RESOURCES_PER_CALL`] items of `items`, in order. The
/// first failure ends it, and so does an answer that only names the master
/// (`redirect`), which is returned as it is: the caller follows it and asks
/// again for everything.
async fn in_batches<Item: Clone, Resp: Default, Fut: Future<Output = Result<Resp, CallError>>>(
    items: Vec<Item>,
    mut call: impl FnMut(Vec<Item>) -> Fut,
    redirect: impl Fn(&Resp) -> bool,
    merge: impl Fn(&mut Resp, Resp),
) -> Result<Resp, CallError> {
    if items.len() <= MAX_RESOURCES_PER_CALL {
        return call(items).await;
    }
    let mut merged = Resp::default();
    for part in items.chunks(MAX_RESOURCES_PER_CALL) {
        let r = call(part.to_vec()).await?;
        if redirect(&r) {
            return Ok(r);
        }
        merge(&mut merged, r);
    }
    Ok(merged)
}

/// A client's refresh of every key.
pub async fn get_capacity(
    transport: &dyn Transport,
    target: &str,
    request: proto::GetCapacityRequest,
) -> Result<proto::GetCapacityResponse, CallError> {
    let id = request.client_id;
    in_batches(
        request.resource,
        |resource| transport.get_capacity(target, proto::GetCapacityRequest { client_id: id.clone(), resource }),
        |r| r.response.is_empty() && r.mastership.is_some(),
        |all, r| {
            all.response.extend(r.response);
            all.mastership = all.mastership.take().or(r.mastership);
        },
    )
    .await
}

/// An intermediate's refresh of every resource it leases from its parent.
pub async fn get_server_capacity(
    transport: &dyn Transport,
    target: &str,
    request: proto::GetServerCapacityRequest,
) -> Result<proto::GetServerCapacityResponse, CallError> {
    let id = request.server_id;
    in_batches(
        request.resource,
        |resource| {
            transport.get_server_capacity(target, proto::GetServerCapacityRequest { server_id: id.clone(), resource })
        },
        |r| r.response.is_empty() && r.mastership.is_some(),
        |all, r| {
            all.response.extend(r.response);
            all.mastership = all.mastership.take().or(r.mastership);
        },
    )
    .await
}

/// A release of many resources.
pub async fn release_capacity(
    transport: &dyn Transport,
    target: &str,
    request: proto::ReleaseCapacityRequest,
) -> Result<proto::ReleaseCapacityResponse, CallError> {
    let id = request.client_id;
    in_batches(
        request.resource_id,
        |resource_id| {
            transport.release_capacity(target, proto::ReleaseCapacityRequest { client_id: id.clone(), resource_id })
        },
        |r| r.mastership.is_some(),
        |all, r| all.mastership = all.mastership.take().or(r.mastership),
    )
    .await
}
