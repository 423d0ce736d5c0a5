//! Doorman's Go server and clients reject proto2 messages whose `required`
//! fields are missing. These tests read the raw bytes usher puts on the wire
//! and check that every required field is present even when it is zero.

use usher_test_support as support;

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prost::Message;
use support::{Usher, write_file};
use usher_proto as proto;

/// The field numbers present at the top level of one protobuf message, with
/// the payload of each length-delimited field.
fn fields(mut buf: &[u8]) -> Vec<(u32, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    while buf.has_remaining() {
        let key = prost::encoding::decode_varint(&mut buf).expect("key");
        let (num, wire) = ((key >> 3) as u32, key & 7);
        let payload = match wire {
            0 => {
                prost::encoding::decode_varint(&mut buf).expect("varint");
                None
            }
            1 => {
                buf.advance(8);
                None
            }
            2 => {
                let len = prost::encoding::decode_varint(&mut buf).expect("len") as usize;
                let p = buf[..len].to_vec();
                buf.advance(len);
                Some(p)
            }
            5 => {
                buf.advance(4);
                None
            }
            w => panic!("unexpected wire type {w}"),
        };
        out.push((num, payload));
    }
    out
}

fn numbers(f: &[(u32, Option<Vec<u8>>)]) -> Vec<u32> {
    f.iter().map(|(n, _)| *n).collect()
}

fn payload(f: &[(u32, Option<Vec<u8>>)], num: u32) -> Vec<u8> {
    f.iter().find(|(n, _)| *n == num).and_then(|(_, p)| p.clone()).expect("length-delimited field")
}

/// Sends one unary gRPC call with raw bytes and returns the raw response message.
async fn raw_call(addr: std::net::SocketAddr, method: &str, msg: Vec<u8>) -> Vec<u8> {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    framed.extend_from_slice(&msg);
    let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://{addr}/doorman.Capacity/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(framed)))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await.unwrap();
    let grpc_status = collected.trailers().and_then(|t| t.get("grpc-status")).map(|v| v.to_str().unwrap().to_string());
    assert_eq!(grpc_status.as_deref(), Some("0"));
    let body = collected.to_bytes();
    assert_eq!(body[0], 0, "uncompressed");
    let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
    body[5..5 + len].to_vec()
}

/// The field numbers Doorman defines (below 100).
fn doorman(fields: &[(u32, Option<Vec<u8>>)]) -> Vec<u32> {
    numbers(fields).into_iter().filter(|n| *n < USHER_FIELDS).collect()
}

/// usher's own optional fields, numbered from 100 so they never meet one of Doorman's.
fn usher(fields: &[(u32, Option<Vec<u8>>)]) -> Vec<u32> {
    numbers(fields).into_iter().filter(|n| *n >= USHER_FIELDS).collect()
}

const USHER_FIELDS: u32 = 100;

#[tokio::test]
async fn responses_encode_required_fields_even_when_zero() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(
        dir.path(),
        "r.yaml",
        "resources:\n  - identifier_glob: '*'\n    capacity: 0\n    safe_capacity: 0\n    algorithm: { kind: FAIR_SHARE, lease_length: 5, refresh_interval: 5, learning_mode_duration: 0 }\n",
    );
    let u = Usher::server(&["--config", cfg.to_str().unwrap()]);
    let addr = u.addr("grpc");

    // wants 0 on a resource of capacity 0: the grant is 0.
    let req = proto::GetCapacityRequest {
        client_id: "c".into(),
        resource: vec![proto::ResourceRequest {
            returned: None,
            reserve: None,
            backlog: None,
            unit_account: None,
            window: None,
            upstream_quota: None,
            resource_id: "r".into(),
            priority: 0,
            has: None,
            wants: 0.0,
        }],
    };
    let resp = fields(&raw_call(addr, "GetCapacity", req.encode_to_vec()).await);
    assert_eq!(numbers(&resp), vec![1], "one ResourceResponse, no mastership");
    let rr = fields(&payload(&resp, 1));
    assert_eq!(doorman(&rr), vec![1, 2, 3], "resource_id, gets, safe_capacity");
    assert_eq!(
        usher(&rr),
        vec![100, 111],
        "usher's template and resource capacity (a Doorman client skips unknown fields)"
    );
    let lease = fields(&payload(&rr, 2));
    assert_eq!(numbers(&lease), vec![1, 2, 3], "expiry_time, refresh_interval and capacity, capacity being 0");
    let decoded = proto::Lease::decode(payload(&rr, 2).as_slice()).unwrap();
    assert_eq!(decoded.capacity, 0.0);

    let disc = fields(&raw_call(addr, "Discovery", Vec::new()).await);
    assert_eq!(numbers(&disc), vec![1, 2], "mastership and is_master");

    let sreq = proto::GetServerCapacityRequest {
        server_id: "s".into(),
        resource: vec![proto::ServerCapacityResourceRequest {
            upstream_quota: None,
            resource_id: "r".into(),
            has: None,
            wants: vec![proto::PriorityBandAggregate { priority: 0, num_clients: 1, wants: 0.0 }],
        }],
    };
    let sresp = fields(&raw_call(addr, "GetServerCapacity", sreq.encode_to_vec()).await);
    let srr = fields(&payload(&sresp, 1));
    assert_eq!(doorman(&srr), vec![1, 2, 3, 4], "resource_id, gets, algorithm, safe_capacity");
    assert_eq!(usher(&srr), vec![100, 111], "usher's template and resource capacity");
    let alg = fields(&payload(&srr, 3));
    assert_eq!(&numbers(&alg)[..3], &[1, 2, 3], "kind, lease_length, refresh_interval");
}

#[test]
fn requests_encode_required_zero_fields() {
    // What usher's lease client sends must satisfy a Go server too.
    let req = proto::GetCapacityRequest {
        client_id: "c".into(),
        resource: vec![proto::ResourceRequest {
            returned: None,
            reserve: None,
            backlog: None,
            unit_account: None,
            window: None,
            upstream_quota: None,
            resource_id: "r".into(),
            priority: 0,
            has: None,
            wants: 0.0,
        }],
    };
    let top = fields(&req.encode_to_vec());
    let rr = fields(&payload(&top, 2));
    assert_eq!(numbers(&rr), vec![1, 2, 4], "resource_id, priority and wants even when 0");
    let band = proto::PriorityBandAggregate { priority: 0, num_clients: 0, wants: 0.0 };
    assert_eq!(numbers(&fields(&band.encode_to_vec())), vec![1, 2, 3]);
    let rel = proto::ReleaseCapacityRequest { client_id: String::new(), resource_id: vec![] };
    assert_eq!(numbers(&fields(&rel.encode_to_vec())), vec![1], "an empty required string is still encoded");
}
