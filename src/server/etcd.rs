//! A small etcd v3 client over etcd's JSON gateway (`/v3/...`), enough for
//! master election and for reading a config key: leases, a create-if-absent
//! transaction, range and put.
//!
//! The JSON gateway ships with every etcd v3 server, needs no generated code
//! (so no `protoc`), and speaks plain HTTP/1.1; endpoints are tried in turn.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd unreachable at {endpoints}: {reason}")]
    Unreachable { endpoints: String, reason: String },
    #[error("etcd answered {status} to {path}: {body}")]
    Status { path: String, status: u16, body: String },
    #[error("unexpected answer from etcd to {path}: {body}")]
    Decode { path: String, body: String },
}

/// A client for one etcd cluster.
#[derive(Clone)]
pub struct Etcd {
    endpoints: Vec<String>,
    http: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl Etcd {
    /// `endpoints` like `http://127.0.0.1:2379` (a bare `host:port` gets `http://`).
    pub fn new(endpoints: &[String], timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        Etcd {
            endpoints: endpoints
                .iter()
                .map(|e| if e.contains("://") { e.trim_end_matches('/').to_string() } else { format!("http://{e}") })
                .collect(),
            http: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let mut last = String::from("no endpoint configured");
        for ep in &self.endpoints {
            let req = http::Request::post(format!("{ep}{path}"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .expect("valid request");
            let resp = match tokio::time::timeout(self.timeout, self.http.request(req)).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    last = format!("{ep}: {e}");
                    continue;
                }
                Err(_) => {
                    last = format!("{ep}: timed out after {:?}", self.timeout);
                    continue;
                }
            };
            let status = resp.status().as_u16();
            let bytes = match tokio::time::timeout(self.timeout, resp.into_body().collect()).await {
                Ok(Ok(b)) => b.to_bytes(),
                _ => {
                    last = format!("{ep}: reading the answer failed");
                    continue;
                }
            };
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if status != 200 {
                return Err(EtcdError::Status { path: path.into(), status, body: text });
            }
            // Streaming endpoints (keepalive) wrap each message in {"result": ...}.
            let first = text.lines().next().unwrap_or("");
            let v: Value =
                serde_json::from_str(first).map_err(|_| EtcdError::Decode { path: path.into(), body: text.clone() })?;
            return Ok(v.get("result").cloned().unwrap_or(v));
        }
        Err(EtcdError::Unreachable { endpoints: self.endpoints.join(","), reason: last })
    }

    /// Grants a lease of `ttl`; returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let v = self.post("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1) })).await?;
        num(&v["ID"]).ok_or_else(|| EtcdError::Decode { path: "/v3/lease/grant".into(), body: v.to_string() })
    }

    /// Renews a lease; returns its remaining TTL in seconds (0 or less: it is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let v = self.post("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(num(&v["TTL"]).unwrap_or(0))
    }

    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.post("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(|_| ())
    }

    /// Puts `value` under `key` only if the key does not exist, attached to
    /// `lease`. Returns `Ok(None)` if this call created it, else the current value.
    pub async fn create_if_absent(&self, key: &str, value: &str, lease: i64) -> Result<Option<String>, EtcdError> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "createRevision": "0" }],
            "success": [{ "requestPut": { "key": k, "value": b64(value.as_bytes()), "lease": lease.to_string() } }],
            "failure": [{ "requestRange": { "key": k } }],
        });
        let v = self.post("/v3/kv/txn", body).await?;
        if v["succeeded"].as_bool().unwrap_or(false) {
            return Ok(None);
        }
        let kv = &v["responses"][0]["response_range"]["kvs"][0];
        let kv = if kv.is_null() { &v["responses"][0]["responseRange"]["kvs"][0] } else { kv };
        Ok(Some(decode_value(kv).unwrap_or_default()))
    }

    /// The value under `key`, if any.
    pub async fn get(&self, key: &str) -> Result<Option<String>, EtcdError> {
        let v = self.post("/v3/kv/range", json!({ "key": b64(key.as_bytes()) })).await?;
        Ok(decode_value(&v["kvs"][0]))
    }

    pub async fn put(&self, key: &str, value: &str) -> Result<(), EtcdError> {
        self.post("/v3/kv/put", json!({ "key": b64(key.as_bytes()), "value": b64(value.as_bytes()) })).await.map(|_| ())
    }

    /// Deletes `key` if its value is still `value` (so a master only ever removes its own claim).
    pub async fn delete_if(&self, key: &str, value: &str) -> Result<(), EtcdError> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{ "key": k, "target": "VALUE", "result": "EQUAL", "value": b64(value.as_bytes()) }],
            "success": [{ "requestDeleteRange": { "key": k } }],
        });
        self.post("/v3/kv/txn", body).await.map(|_| ())
    }
}

fn decode_value(kv: &Value) -> Option<String> {
    if kv.is_null() {
        return None;
    }
    let v = kv["value"].as_str().unwrap_or("");
    B64.decode(v).ok().map(|b| String::from_utf8_lossy(&b).into_owned())
}
