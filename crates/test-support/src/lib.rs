//! Test harness shared by the integration tests: real `usher` processes on
//! `127.0.0.1:0`, log scraping for their bound addresses, eventual assertions
//! and a tiny HTTP client for admin endpoints.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]
#![warn(missing_docs, unreachable_pub)]
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// A port that was free a moment ago, for a process that must listen on a
/// fixed address (an election member advertising it, a restarted server).
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`, 32768 and
/// up by default), where every `127.0.0.1:0` bind of this run's upstreams,
/// sidecars and connections gets its port: a port from the ephemeral range,
/// free when asked, could be handed to one of those before the test bound it
/// (a server once failed so with "Address already in use"). Picked at
/// random from 10000 up, never twice in one process, and tried.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static GIVEN: Mutex<Option<std::collections::HashSet<u16>>> = Mutex::new(None);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    if low > 11_000 {
        for _ in 0..100 {
            // A random pick: std's hasher is seeded at random per process.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let port = 10_000 + (h.finish() % u64::from(low - 10_000)) as u16;
            let mut given = GIVEN.lock().unwrap();
            if given.get_or_insert_default().contains(&port) {
                continue;
            }
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.get_or_insert_default().insert(port);
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Where the servers this test binary starts keep their default `--state-file`s
/// (`$XDG_STATE_HOME`): one directory per test process, so a server restarted
/// on its port finds its predecessor's record, and no run sees another's.
pub fn state_home() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory")).path()
}

/// Path to the built `usher` binary: beside the test binary's `deps/`
/// folder (Cargo builds it for the root package's integration tests), or
/// `$USHER_BIN`.
pub fn usher_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("USHER_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(Path::parent).expect("the test binary sits in target/<profile>/deps");
    dir.join(format!("usher{}", std::env::consts::EXE_SUFFIX))
}

/// A running `usher` process; killed when dropped.
pub struct Usher {
    /// The process, to read its id or kill it before the drop does.
    pub child: Child,
    /// `key=value` fields of the first log line containing the ready marker.
    pub fields: HashMap<String, String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Usher {
    /// Starts `usher ARGS...` and waits (up to 20 s) for a stderr line containing `ready_marker`.
    pub fn start(args: &[&str], env: &[(&str, &str)], ready_marker: &str) -> Usher {
        Usher::start_wrapped(&[], args, env, ready_marker)
    }

    /// [`Usher::start`], run by `wrapper` (a command and its arguments, then
    /// usher's path and `args`), e.g. `unshare` to make usher a PID 1.
    pub fn start_wrapped(wrapper: &[&str], args: &[&str], env: &[(&str, &str)], ready_marker: &str) -> Usher {
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(usher_bin());
                c
            }
            None => Command::new(usher_bin()),
        };
        cmd.args(args)
            .env("USHER_LOG", std::env::var("TEST_USHER_LOG").unwrap_or("info".into()))
            .env("NO_COLOR", "1")
            .env("XDG_STATE_HOME", state_home())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn usher");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        {
            let log = log.clone();
            let marker = ready_marker.to_string();
            std::thread::spawn(move || {
                let mut sent = false;
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let line = strip_ansi(&line);
                    if !sent && line.contains(&marker) {
                        let _ = tx.send(line.clone());
                        sent = true;
                    }
                    log.lock().unwrap().push(line);
                }
            });
        }
        let line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("usher {args:?} did not log {ready_marker:?}; log:\n{}", log.lock().unwrap().join("\n"));
            }
        };
        Usher { child, fields: log_fields(&line), log }
    }

    /// `usher server ARGS...` with gRPC and admin on 127.0.0.1:0, once it listens.
    pub fn server(args: &[&str]) -> Usher {
        let mut all = vec!["server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Usher::start(&all, &[], "usher server listening")
    }

    /// `usher server --config CONFIG` with gRPC on the fixed `127.0.0.1:PORT` (so
    /// a test can stop it and start another on the same address), admin on
    /// 127.0.0.1:0 and no minimum request interval, plus `extra` flags.
    pub fn server_at(config: &Path, port: u16, extra: &[&str]) -> Usher {
        let listen = format!("127.0.0.1:{port}");
        let config = config.to_str().expect("a UTF-8 path");
        let mut all = vec![
            "server",
            "--config",
            config,
            "--listen",
            &listen,
            "--admin-listen",
            "127.0.0.1:0",
            "--min-request-interval",
            "0s",
        ];
        all.extend_from_slice(extra);
        Usher::start(&all, &[], "usher server listening")
    }

    /// Whether this `usher server` reports itself master on its status page.
    pub fn is_master(&self) -> bool {
        let (code, body) = http_get(self.addr("admin"), "/debug/status?format=json");
        code == 200 && serde_json::from_str::<serde_json::Value>(&body).unwrap()["is_master"] == true
    }

    /// `usher proxy --routes ROUTES` with proxy and admin on 127.0.0.1:0, once it listens.
    pub fn proxy(routes: &Path) -> Usher {
        let routes = routes.to_str().expect("a UTF-8 path");
        Usher::start(
            &["proxy", "--routes", routes, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
            &[],
            "usher proxy listening",
        )
    }

    /// [`Usher::proxy`] of every routes file at once, as a fleet starts
    /// together; in the order of `routes`.
    pub fn proxies(routes: &[PathBuf]) -> Vec<Usher> {
        let starting: Vec<_> = routes.iter().cloned().map(|r| std::thread::spawn(move || Usher::proxy(&r))).collect();
        starting.into_iter().map(|t| t.join().unwrap()).collect()
    }

    /// The process's status page as JSON (`/debug/status?format=json` on its
    /// admin address); panics unless it answers 200 with JSON.
    pub fn status(&self) -> serde_json::Value {
        let (code, body) = http_get(self.addr("admin"), "/debug/status?format=json");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
    }

    /// `usher proxy --routes ROUTES` listening on the fixed `127.0.0.1:PORT` (so a
    /// restarted sidecar takes over its predecessor's address), admin on 127.0.0.1:0.
    pub fn proxy_at(routes: &Path, port: u16) -> Usher {
        let routes = routes.to_str().expect("a UTF-8 path");
        let listen = format!("127.0.0.1:{port}");
        Usher::start(
            &["proxy", "--routes", routes, "--listen", &listen, "--admin-listen", "127.0.0.1:0"],
            &[],
            "usher proxy listening",
        )
    }

    /// The socket address in field `field` (`listen`, `admin`, `grpc`) of
    /// the ready line; panics if the line has no such field.
    pub fn addr(&self, field: &str) -> SocketAddr {
        self.fields
            .get(field)
            .unwrap_or_else(|| panic!("no {field} in {:?}", self.fields))
            .parse()
            .expect("socket address")
    }

    /// The address upstream `name`'s own listener bound, from its log line
    /// (logged before the ready marker).
    pub fn upstream_listener(&self, name: &str) -> SocketAddr {
        let log = self.log.lock().unwrap();
        let fields = log
            .iter()
            .filter(|l| l.contains("upstream listener"))
            .map(|l| log_fields(l))
            .find(|f| f.get("upstream").is_some_and(|u| u == name))
            .unwrap_or_else(|| panic!("no listener of upstream {name} in the log:\n{}", log.join("\n")));
        fields["listen"].parse().expect("socket address")
    }

    /// The text of the process's `/metrics` on its admin listener.
    pub fn metrics(&self) -> String {
        let (code, text) = http_get(self.addr("admin"), "/metrics");
        assert_eq!(code, 200, "{text}");
        text
    }

    /// Everything the process has written to stderr so far, colours
    /// stripped, for assertions and failure messages.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits until the log contains `needle`.
    pub fn wait_for_log(&self, needle: &str, patience: Duration) {
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if self.log.lock().unwrap().iter().any(|l| l.contains(needle)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("log never contained {needle:?}:\n{}", self.log());
    }

    /// Sends signal `sig` (a name such as `TERM` or `HUP`) to the process
    /// with `kill`; panics if `kill` fails.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([&format!("-{sig}"), &self.child.id().to_string()]).status().unwrap();
        assert!(ok.success());
    }

    /// Waits for the process to exit and returns its code.
    pub fn wait_exit(&mut self, patience: Duration) -> Option<i32> {
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("usher did not exit within {patience:?}:\n{}", self.log());
    }
}

impl Drop for Usher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for n in chars.by_ref() {
                if n.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Parses `key=value` pairs from a tracing log line.
pub fn log_fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
        .collect()
}

/// Runs `usher ARGS...` to completion: (exit code, stdout, stderr).
pub fn run_usher(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(usher_bin()).args(args).env("NO_COLOR", "1").output().expect("run usher");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `usher ARGS...` with extra `env` until it exits, killing it after
/// `patience`: (exit code, stderr); the code is `None` if it had to be killed.
pub fn run_usher_for(args: &[&str], env: &[(&str, &str)], patience: Duration) -> (Option<i32>, String) {
    let mut cmd = Command::new(usher_bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_for(cmd, patience)
}

/// Runs `cmd` (usher, or a wrapper that execs it) until it exits, killing it
/// after `patience`: (exit code, stderr); the code is `None` if it had to be killed.
pub fn run_for(mut cmd: Command, patience: Duration) -> (Option<i32>, String) {
    cmd.env("NO_COLOR", "1").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn usher");
    let mut stderr = child.stderr.take().expect("stderr piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + patience;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (code, strip_ansi(&reader.join().unwrap()))
}

/// Polls `cond` every 20 ms until it holds or `patience` runs out.
#[macro_export]
macro_rules! assert_eventually {
    ($cond:expr, $patience:expr, $($msg:tt)+) => {{
        let deadline = std::time::Instant::now() + $patience;
        loop {
            if $cond {
                break;
            }
            if std::time::Instant::now() > deadline {
                panic!($($msg)+);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }};
}

/// A blocking HTTP/1.1 GET: (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// Reads one sample from a Prometheus text exposition, e.g.
/// `metric(&text, "usher_server_resource_has", &[("resource", "r")])`.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        let all = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        if all { value.parse().ok() } else { None }
    })
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A YAML block of nine lines (`bomb:` and eight anchored lists) whose
/// nested aliases would expand to 43 million nodes: nine aliases of nine
/// aliases, eight deep. usher's parser refuses it before expanding it, at
/// the second alias of the block's seventh line (column 17), when the text
/// before the block holds only a few nodes.
pub fn alias_bomb() -> String {
    let mut text = String::from("bomb:\n  a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
    for i in 1..=8 {
        text.push_str(&format!("  a{i}: &a{i} [{}]\n", vec![format!("*a{}", i - 1); 9].join(", ")));
    }
    text
}

/// The most memory process `pid` has held resident so far, in KiB (Linux's
/// `VmHWM` in `/proc/PID/status`).
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status (Linux)");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in:\n{status}"))
}

pub mod at_once;
pub mod deploy;
pub mod edits;
pub mod etcd;
pub mod faultproxy;
pub mod llm;
pub mod load;
pub mod pki;
pub mod retry_after;
pub mod upstream;
