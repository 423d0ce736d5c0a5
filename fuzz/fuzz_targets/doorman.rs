//! Decoding every Doorman protobuf message on any bytes, re-encoding what
//! decodes, and validating the requests a peer can send.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use usher_proto as proto;

macro_rules! each {
    ($data:expr, $($m:ident),+ $(,)?) => {$(
        if let Ok(m) = proto::$m::decode($data) {
            let again = m.encode_to_vec();
            assert!(proto::$m::decode(again.as_slice()).is_ok(), "{} does not decode its own encoding", stringify!($m));
        }
    )+};
}

fuzz_target!(|data: &[u8]| {
    each!(
        data,
        Lease,
        ResourceRequest,
        GetCapacityRequest,
        ResourceResponse,
        Mastership,
        GetCapacityResponse,
        PriorityBandAggregate,
        ServerCapacityResourceRequest,
        GetServerCapacityRequest,
        ServerCapacityResourceResponse,
        GetServerCapacityResponse,
        ReleaseCapacityRequest,
        ReleaseCapacityResponse,
        NamedParameter,
        Algorithm,
        ResourceTemplate,
        ResourceRepository,
        DiscoveryRequest,
        DiscoveryResponse,
    );
    if let Ok(req) = proto::GetCapacityRequest::decode(data) {
        let _ = usher_server::service::client_requests(&req);
    }
    if let Ok(req) = proto::GetServerCapacityRequest::decode(data) {
        let _ = usher_server::service::server_requests(&req);
    }
});
