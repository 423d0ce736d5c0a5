//! A real etcd (Debian's `etcd-server`) on loopback ports, for one test.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// A running etcd with its data in a temporary directory; killed when dropped.
pub struct EtcdServer {
    child: Child,
    _dir: tempfile::TempDir,
    /// The client URL, e.g. `http://127.0.0.1:PORT` (`https` with TLS).
    pub endpoint: String,
}

/// An `usher server` electing its master under `key` on `etcd` (TTL 3 s),
/// listening on and advertising a fixed loopback address, which it returns.
pub fn elected_member(etcd: &str, config: &std::path::Path, key: &str) -> (super::Usher, String) {
    elected_member_with(etcd, config, key, &[])
}

/// [`elected_member`] with more flags (`--parent`, a TTL of its own, ...).
pub fn elected_member_with(etcd: &str, config: &std::path::Path, key: &str, more: &[&str]) -> (super::Usher, String) {
    elected_member_at(etcd, config, key, free_port(), more)
}

/// [`elected_member_with`] on a port the caller picked (to reach the member
/// while it is still starting).
pub fn elected_member_at(
    etcd: &str,
    config: &std::path::Path,
    key: &str,
    port: u16,
    more: &[&str],
) -> (super::Usher, String) {
    let addr = format!("127.0.0.1:{port}");
    let mut extra =
        vec!["--advertise-addr", &addr, "--etcd-endpoints", etcd, "--election-key", key, "--election-ttl", "3s"];
    extra.extend_from_slice(more);
    (super::Usher::server_at(config, port, &extra), addr)
}

impl EtcdServer {
    /// Starts etcd serving clients over plain HTTP, once it is healthy;
    /// panics if it is not healthy within 20 s.
    pub fn start() -> EtcdServer {
        EtcdServer::launch(None)
    }

    /// etcd serving clients over TLS with a certificate for 127.0.0.1 signed
    /// by `ca`, and requiring client certificates signed by `ca`.
    pub fn start_tls(ca: &super::pki::Ca) -> EtcdServer {
        EtcdServer::launch(Some(ca))
    }

    /// Starts etcd on free ports; a port taken between `free_port` and
    /// etcd's bind (tests run in parallel) is retried on new ones.
    fn launch(ca: Option<&super::pki::Ca>) -> EtcdServer {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match EtcdServer::try_launch(ca) {
                Ok(server) => return server,
                Err(log) if attempt < 5 && log.contains("address already in use") => continue,
                Err(log) => panic!("etcd did not become healthy:\n{log}"),
            }
        }
    }

    fn try_launch(ca: Option<&super::pki::Ca>) -> Result<EtcdServer, String> {
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let scheme = if ca.is_some() { "https" } else { "http" };
        let endpoint = format!("{scheme}://127.0.0.1:{client}");
        let log = dir.path().join("etcd.log");
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("test=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(ca) = ca {
            let (cert, key) = ca.leaf("etcd-server", &["127.0.0.1", "localhost"]);
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
            cmd.arg("--trusted-ca-file").arg(&ca.pem).arg("--client-cert-auth");
        }
        let child = cmd.spawn().expect("etcd is installed (Debian package etcd-server; .ci/test installs it)");
        let mut server = EtcdServer { child, _dir: dir, endpoint };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{client}").parse().unwrap();
        loop {
            let up = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok();
            let healthy = if ca.is_some() {
                up && std::fs::read_to_string(&log).unwrap_or_default().contains("ready to serve client requests")
            } else {
                up && health_says_true(addr)
            };
            if healthy {
                return Ok(server);
            }
            // Exited (a port taken, say), or not healthy in time: the log says why.
            if server.child.try_wait().ok().flatten().is_some() || Instant::now() >= deadline {
                return Err(std::fs::read_to_string(&log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Turns etcd's auth on, as `etcdctl` would: a `root` user (password
    /// `root-pw`) with the root role, and `user` with read/write on the keys
    /// under `prefix`. `admin` must reach etcd (with a client certificate when
    /// etcd wants one).
    pub async fn enable_auth(&self, admin: &usher_server::etcd::Etcd, user: &str, password: &str, prefix: &str) {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let mut end = prefix.as_bytes().to_vec();
        *end.last_mut().unwrap() += 1;
        let end = String::from_utf8(end).unwrap();
        let calls = [
            ("/v3/auth/user/add", serde_json::json!({ "name": "root", "password": "root-pw" })),
            ("/v3/auth/role/add", serde_json::json!({ "name": "root" })),
            ("/v3/auth/user/grant", serde_json::json!({ "user": "root", "role": "root" })),
            ("/v3/auth/role/add", serde_json::json!({ "name": "usher" })),
            (
                "/v3/auth/role/grant",
                serde_json::json!({ "name": "usher", "perm": { "permType": "READWRITE", "key": b64(prefix), "range_end": b64(&end) } }),
            ),
            ("/v3/auth/user/add", serde_json::json!({ "name": user, "password": password })),
            ("/v3/auth/user/grant", serde_json::json!({ "user": user, "role": "usher" })),
            ("/v3/auth/enable", serde_json::json!({})),
        ];
        for (path, body) in calls {
            admin.request(path, body).await.unwrap_or_else(|e| panic!("{path}: {e}"));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether etcd's `/health` answers `true`; false on any connection error
/// (etcd still starting can reset a connection it accepted).
fn health_says_true(addr: std::net::SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut raw = Vec::new();
    write!(s, "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").is_ok()
        && s.read_to_end(&mut raw).is_ok()
        && String::from_utf8_lossy(&raw).contains("true")
}
