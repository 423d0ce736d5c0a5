//! A real etcd (Debian's `etcd-server`) on loopback ports, for one test.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

pub struct EtcdServer {
    child: Child,
    _dir: tempfile::TempDir,
    pub endpoint: String,
}

/// An `usher server` electing its master under `key` on `etcd` (TTL 3 s),
/// listening on and advertising a fixed loopback address, which it returns.
pub fn elected_member(etcd: &str, config: &std::path::Path, key: &str) -> (super::Usher, String) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let extra = ["--advertise-addr", &addr, "--etcd-endpoints", etcd, "--election-key", key, "--election-ttl", "3s"];
    (super::Usher::server_at(config, port, &extra), addr)
}

impl EtcdServer {
    pub fn start() -> EtcdServer {
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("test=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd is installed (Debian package etcd-server; .ci/run installs it)");
        let server = EtcdServer { child, _dir: dir, endpoint };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{client}").parse().unwrap();
        loop {
            if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && super::http_get(addr, "/health").1.contains("true")
            {
                return server;
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
