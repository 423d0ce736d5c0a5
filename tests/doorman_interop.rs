//! usher against an independent implementation of Doorman's ORIGINAL schema,
//! in both directions. `tests/interop/` holds Doorman's proto, vendored
//! unmodified, and Python scripts that compile it at run time with
//! grpcio-tools: a client that sends what Doorman's Go client sends (run
//! against `usher server`), and a Doorman root server ported from the Go one
//! (leased from by `usher proxy` and by an usher intermediate). No Go binary
//! runs here; see `tests/interop/README.md` for what that leaves out.
//!
//! Needs python3 with grpcio and grpcio-tools; `.ci/test` installs them.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::etcd::{EtcdServer, elected_member};
use support::upstream::{Upstream, get, h1, routes, send1};
use support::{Usher, free_port, http_get, write_file};

/// The command that installs what the scripts need (as `.ci/test` does).
const PIP: &str = "python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2";

/// Each script's run, at most.
const PATIENCE: Duration = Duration::from_secs(90);

/// The tests run one at a time: two of them measure admitted rates, and every
/// Python process compiles the proto, which loads the machine's two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `python3 tests/interop/NAME`, with its output piped and no bytecode left in the tree.
fn python(name: &str) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop").join(name))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Fails (never skips) when python3 cannot import the gRPC tools.
fn require_grpc() {
    let out = Command::new("python3").args(["-c", "import grpc, grpc_tools, google.protobuf"]).output();
    match out {
        Err(e) => panic!("python3 is needed for the Doorman interop tests ({e}); then run `{PIP}`"),
        Ok(o) if !o.status.success() => panic!(
            "python3 lacks the gRPC tools for the Doorman interop tests: run `{PIP}` (.ci/test does)\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Ok(_) => {}
    }
}

/// Collects a child's output lines as they come.
fn collect(stream: impl Read + Send + 'static) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    lines
}

fn joined(lines: &Mutex<Vec<String>>) -> String {
    lines.lock().unwrap().join("\n")
}

/// Runs `python3 tests/interop/NAME ARGS...`, killing it after `patience`,
/// and returns its summary (its last stdout line) once it exits 0.
fn run_script(name: &str, args: &[&str], patience: Duration) -> serde_json::Value {
    let mut child = python(name).args(args).spawn().expect("spawn python3");
    let read_all = |mut stream: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stream.read_to_string(&mut text);
            text
        })
    };
    let out = read_all(Box::new(child.stdout.take().unwrap()));
    let err = read_all(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + patience;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Both pipes close when the script exits.
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    match status {
        None => panic!("{name} {args:?} ran past {patience:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        Some(st) if !st.success() => panic!("{name} {args:?} failed ({st})\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        Some(_) => {}
    }
    let last = stdout.lines().last().unwrap_or_default();
    let summary: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{name}: no JSON summary ({e}):\n{stdout}\n{stderr}"));
    eprintln!("{name} {}: {summary}", args.first().unwrap_or(&""));
    summary
}

/// `tests/interop/original_server.py`, a Doorman root on the original schema;
/// killed (by its PID) when dropped.
struct OriginalServer {
    child: Child,
    addr: String,
    events: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl OriginalServer {
    /// Starts it with `resources` (a ResourceRepository in JSON) and waits (20 s at most) until it listens.
    fn start(resources: &serde_json::Value) -> OriginalServer {
        let mut child = python("original_server.py")
            .args(["--config", &resources.to_string(), "--listen", "127.0.0.1:0", "--max-seconds", "240"])
            .spawn()
            .expect("spawn python3");
        let events = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = loop {
            let first = events.lock().unwrap().first().cloned();
            if let Some(line) = first {
                let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON event");
                break v["addr"].as_str().expect("the listening address").to_string();
            }
            if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                let _ = child.kill();
                let _ = child.wait();
                panic!("original_server.py did not start:\n{}", joined(&stderr));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        OriginalServer { child, addr, events, stderr }
    }

    /// The RPCs it has served (or refused), as it parsed them.
    fn rpcs(&self, method: &str) -> Vec<serde_json::Value> {
        let events = self.events.lock().unwrap();
        events
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON event"))
            .filter(|e| e["rpc"] == method)
            .collect()
    }

    /// Every RPC it refused, of any method.
    fn refused(&self) -> Vec<String> {
        let events = self.events.lock().unwrap();
        events.iter().filter(|l| l.contains("\"error\"")).cloned().collect()
    }

    fn log(&self) -> String {
        format!("events:\n{}\nstderr:\n{}", joined(&self.events), joined(&self.stderr))
    }
}

impl Drop for OriginalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resource `shared` (FAIR_SHARE, 100) and `static` (STATIC, 5) for the client checks.
const SHARE_YAML: &str = "resources:
  - identifier_glob: shared
    capacity: 100
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 2, learning_mode_duration: 0 }
  - identifier_glob: static
    capacity: 5
    algorithm: { kind: STATIC, lease_length: 60, refresh_interval: 2, learning_mode_duration: 0 }
  - identifier_glob: '*'
    capacity: 1000
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 2, learning_mode_duration: 0 }
";

/// The same resources for the original-schema server.
fn share_json() -> serde_json::Value {
    let alg = |kind: &str| serde_json::json!({"kind": kind, "lease_length": 60, "refresh_interval": 2, "learning_mode_duration": 0});
    serde_json::json!({"resources": [
        {"identifier_glob": "shared", "capacity": 100, "algorithm": alg("FAIR_SHARE")},
        {"identifier_glob": "static", "capacity": 5, "algorithm": alg("STATIC")},
        {"identifier_glob": "*", "capacity": 1000, "algorithm": alg("FAIR_SHARE")},
    ]})
}

/// Resource `api` of 4 a second (FAIR_SHARE), for usher to lease from.
fn api_json() -> serde_json::Value {
    serde_json::json!({"resources": [
        {"identifier_glob": "api", "capacity": 4,
         "algorithm": {"kind": "FAIR_SHARE", "lease_length": 10, "refresh_interval": 2, "learning_mode_duration": 0}},
        {"identifier_glob": "*", "capacity": 1000,
         "algorithm": {"kind": "FAIR_SHARE", "lease_length": 10, "refresh_interval": 2}},
    ]})
}

#[test]
fn a_doorman_client_shares_refreshes_and_releases_on_an_usher_server() {
    require_grpc();
    let _serial = SERIAL.blocking_lock();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(dir.path(), "r.yaml", SHARE_YAML);
    let addr = format!("127.0.0.1:{}", free_port());
    let _server = Usher::start(
        &[
            "server",
            "--config",
            cfg.to_str().unwrap(),
            "--listen",
            &addr,
            "--advertise-addr",
            &addr,
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[],
        "usher server listening",
    );
    // Three clients reach max-min fair shares, refresh, release one resource,
    // and close as the Go client does (with its leading empty resource ids).
    let summary =
        run_script("original_client.py", &["share", "--server", &addr, "--advertise", &addr, "--usher"], PATIENCE);
    // The script checked that usher's extensions (today `template` and
    // `resource_capacity`) arrived, were skipped, and are all numbered >= 100.
    assert_eq!(summary["ok"], true);
}

#[test]
fn the_client_checks_pass_on_the_original_schema_server_too() {
    // The control: the client's expectations are Doorman's, not usher's.
    require_grpc();
    let _serial = SERIAL.blocking_lock();
    let server = OriginalServer::start(&share_json());
    let summary =
        run_script("original_client.py", &["share", "--server", &server.addr, "--advertise", &server.addr], PATIENCE);
    assert_eq!(summary["ok"], true);
    assert!(server.refused().is_empty(), "{}", server.log());
}

#[test]
fn a_doorman_client_given_a_follower_is_redirected_to_the_master() {
    require_grpc();
    let _serial = SERIAL.blocking_lock();
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(dir.path(), "r.yaml", SHARE_YAML);
    let members: Vec<(Usher, String)> =
        (0..2).map(|_| elected_member(&etcd.endpoint, &cfg, "/interop/master")).collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    while members.iter().filter(|(u, _)| u.is_master()).count() != 1 {
        assert!(Instant::now() < deadline, "no single master was elected");
        std::thread::sleep(Duration::from_millis(50));
    }
    let master = members.iter().position(|(u, _)| u.is_master()).unwrap();
    let (leader, follower) = (&members[master].1, &members[1 - master].1);
    let summary = run_script("original_client.py", &["redirect", "--follower", follower, "--master", leader], PATIENCE);
    assert_eq!(summary["ok"], true);
    assert!(summary["redirects"].as_u64().unwrap() >= 2, "GetCapacity and ReleaseCapacity were redirected");
}

/// A sidecar's routes: resource `api` leased from `servers`, asking a fixed
/// 10/s. Its `capacity` (100) is only the fleet's total for sizing bursts,
/// since a Doorman server never says its own (`resource_capacity`). It reads
/// the upstream's quota headers, so its requests carry `upstream_quota` (110).
fn sidecar_routes(up: &Upstream, servers: &str) -> String {
    let doorman =
        format!("doorman:\n  servers: [\"{servers}\"]\n  client_id: sidecar-interop\n  min_interval: 500ms\n");
    let api = "    kind: rate\n    capacity: 100\n    burst: 10\n    max_wait: 0s\n    wants: 10\n    upstream_quota: { headers: github }\n";
    routes(up, &doorman, api)
}

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits (20 s at most) until the sidecar holds a lease of `has` for `api`.
async fn wait_for_lease(proxy: &Usher, has: f64, server: &OriginalServer) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = status(proxy);
        let key = &st["lease"]["keys"][0];
        if key["mode"] == "leased" && key["has"].as_f64() == Some(has) {
            return;
        }
        assert!(Instant::now() < deadline, "no lease of {has}: {st}\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counts (admitted, refused) of `n` requests through `proxy`, one every `gap`.
async fn send_paced(proxy: &Usher, n: u32, gap: Duration) -> (u32, u32) {
    let mut c = h1(proxy.addr("listen")).await;
    let start = tokio::time::Instant::now();
    let (mut ok, mut refused) = (0, 0);
    for i in 0..n {
        tokio::time::sleep_until(start + gap * i).await;
        // `/quota` answers with GitHub's quota headers.
        let got = send1(&mut c, get("app.local", "/quota")).await;
        match got.status.as_u16() {
            200 => ok += 1,
            429 => refused += 1,
            s => panic!("status {s}: {}", got.text()),
        }
    }
    (ok, refused)
}

/// The sidecar admits what its lease of `lease`/s allows and refuses the rest.
async fn check_enforced(proxy: &Usher, up: &Upstream, lease: f64) {
    let before = up.stats.requests();
    // At once: its bucket is its share of the fleet's burst, lease / 100 of
    // 10, so one request passes (two if a token comes meanwhile). Were the
    // lease taken for the whole capacity, all 10 of the burst would.
    let (burst_ok, burst_refused) = send_paced(proxy, 30, Duration::ZERO).await;
    assert!((1..=3).contains(&burst_ok), "a burst of 30 admitted {burst_ok}\n{}", status(proxy));
    // 20 a second for 3 s: the lease's rate passes, the rest is refused.
    let t0 = Instant::now();
    let (ok, refused) = send_paced(proxy, 60, Duration::from_millis(50)).await;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("figures: burst {burst_ok}/{}; paced {ok} of 60 in {secs:.2} s", burst_ok + burst_refused);
    assert!(f64::from(ok) <= lease * secs + 2.0, "{ok} admitted in {secs:.2} s under a lease of {lease}/s");
    assert!(f64::from(ok) >= lease * secs * 0.6, "only {ok} admitted in {secs:.2} s under a lease of {lease}/s");
    assert!(refused >= 60 - ok && refused > 0);
    assert_eq!(up.stats.requests() - before, u64::from(burst_ok + ok), "the upstream saw exactly the admitted");
}

/// Every field the original-schema server skipped in `requests` is one of usher's (>= 100).
fn only_usher_fields_skipped(requests: &[serde_json::Value]) {
    for r in requests {
        for (message, numbers) in r["unknown"].as_object().unwrap() {
            for n in numbers.as_array().unwrap() {
                assert!(n.as_u64().unwrap() >= 100, "{message} field {n} is unknown to Doorman: {r}");
            }
        }
    }
}

/// Waits (10 s at most) until `server` has parsed a `method` request whose
/// `message` carried usher's `upstream_quota` (field 110), which it skipped.
async fn wait_for_skipped_quota(server: &OriginalServer, method: &str, message: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let carries_110 =
        |r: &serde_json::Value| r["unknown"][message].as_array().is_some_and(|n| n.contains(&serde_json::json!(110)));
    while !server.rpcs(method).iter().any(carries_110) {
        assert!(Instant::now() < deadline, "no {method} carried {message}.upstream_quota:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usher_proxy_leases_from_a_doorman_server_and_enforces_the_lease() {
    require_grpc();
    let _serial = SERIAL.lock().await;
    let server = OriginalServer::start(&api_json());
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = Usher::proxy(&write_file(dir.path(), "routes.yaml", &sidecar_routes(&up, &server.addr)));
    wait_for_lease(&proxy, 4.0, &server).await;

    let asked = server.rpcs("GetCapacity");
    assert!(server.refused().is_empty(), "the Doorman server refused usher's requests:\n{}", server.log());
    let first = &asked.first().expect("usher asked the Doorman server")["request"];
    assert_eq!(first["client_id"], "sidecar-interop");
    assert_eq!(first["resource"][0]["resource_id"], "api");
    assert_eq!(first["resource"][0]["wants"], 10.0);
    only_usher_fields_skipped(&asked);
    check_enforced(&proxy, &up, 4.0).await;
    // The upstream's quota, read from those answers, goes up with the next
    // refresh; the Doorman server skips it and grants the same.
    wait_for_skipped_quota(&server, "GetCapacity", "ResourceRequest").await;
    only_usher_fields_skipped(&server.rpcs("GetCapacity"));
    assert!(server.refused().is_empty(), "{}", server.log());
    wait_for_lease(&proxy, 4.0, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_usher_intermediate_leases_from_a_doorman_server() {
    require_grpc();
    let _serial = SERIAL.lock().await;
    let root = OriginalServer::start(&api_json());
    let mid = Usher::server(&["--parent", &root.addr]);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let routes = sidecar_routes(&up, &mid.addr("grpc").to_string());
    let proxy = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    wait_for_lease(&proxy, 4.0, &root).await;

    let asked = root.rpcs("GetServerCapacity");
    assert!(root.refused().is_empty(), "the Doorman root refused the intermediate's requests:\n{}", root.log());
    let last = &asked.last().expect("the intermediate asked the Doorman root")["request"];
    let api = last["resource"].as_array().unwrap().iter().find(|r| r["resource_id"] == "api").expect("api asked");
    let bands = api["wants"].as_array().unwrap();
    let wants: f64 = bands.iter().map(|b| b["wants"].as_f64().unwrap_or(0.0)).sum();
    assert_eq!(wants, 10.0, "the sidecar's demand, in priority bands: {api}");
    let clients = |b: &serde_json::Value| b["num_clients"].as_str().and_then(|n| n.parse::<i64>().ok());
    assert!(bands.iter().all(|b| clients(b).is_some_and(|n| n >= 1)), "num_clients >= 1 in every band: {api}");
    only_usher_fields_skipped(&asked);
    check_enforced(&proxy, &up, 4.0).await;
    wait_for_skipped_quota(&root, "GetServerCapacity", "ServerCapacityResourceRequest").await;
    let asked = root.rpcs("GetServerCapacity");
    only_usher_fields_skipped(&asked);
    // Unlike Doorman's intermediates, usher's report what they hold as `has`.
    let last = &asked.last().unwrap()["request"]["resource"][0];
    assert_eq!(last["has"]["capacity"], 4.0, "{last}");
    assert!(root.refused().is_empty(), "{}", root.log());
    wait_for_lease(&proxy, 4.0, &root).await;
}
