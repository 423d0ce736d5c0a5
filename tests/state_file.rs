//! A standalone `usher server` (no etcd) tells a fresh start from a restart
//! by its `--state-file` (src/server/state_file.rs): a fresh start serves at
//! once, a restart while its leases may be outstanding learns, and an
//! unreadable record is warned about and learnt from. tests/fresh_tree.rs is
//! the etcd analogue.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::Path;
use std::time::{Duration, Instant};

use support::upstream::{Upstream, get, h1, routes, send1};
use support::{Usher, free_port, http_get, write_file};

/// Learning mode as long as the algorithm allows (no `learning_mode_duration`:
/// the lease length, bounded by refresh × 7/6 + 3 s = 8.8 s). Doorman's
/// grants, without spare capacity: a sidecar wanting 10 holds exactly 10.
const CONFIG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 20\n    algorithm: { kind: FAIR_SHARE, lease_length: 20, refresh_interval: 5, parameters: [{ name: spare, value: keep }] }\n";

fn server(dir: &Path, port: u16, state: &Path) -> Usher {
    let config = write_file(dir, "resources.yaml", CONFIG);
    Usher::server_at(&config, port, &["--state-file", state.to_str().unwrap()])
}

fn sidecar(dir: &Path, up: &Upstream, port: u16, name: &str) -> Usher {
    let doorman = format!("doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: {name}\n");
    // Wants 10 whatever its demand: the lease the restarted server must learn.
    let res = "    kind: rate\n    capacity: 10\n    burst: 1\n    wants: 10\n";
    Usher::proxy(&write_file(dir, &format!("{name}.yaml"), &routes(up, &doorman, res)))
}

/// How long after `started` the sidecar admitted its first request (polled every 100 ms).
async fn first_admitted(proxy: &Usher, started: Instant, server: &Usher) -> Duration {
    let mut c = h1(proxy.addr("listen")).await;
    loop {
        let got = send1(&mut c, get("api.test", "/")).await;
        if got.status == 200 {
            return started.elapsed();
        }
        assert_eq!(got.status, 429, "only refusals before the first lease: {}", got.text());
        assert!(started.elapsed() < Duration::from_secs(30), "nothing admitted in 30 s\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The server's resources on its JSON status page.
fn resources(server: &Usher) -> Vec<serde_json::Value> {
    let (code, body) = http_get(server.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["resources"].as_array().unwrap().clone()
}

fn learning(server: &Usher) -> Option<bool> {
    resources(server).first().map(|r| r["learning_mode"].as_bool().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_start_serves_two_sidecars_within_3s() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state/server.state");
    let port = free_port();
    let server = server(dir.path(), port, &state);
    server.wait_for_log("no predecessor on record", Duration::from_secs(5));
    assert!(state.is_file(), "the record is written before the server serves");
    let ups = [Upstream::start().await, Upstream::start().await];
    let started = Instant::now();
    let a = sidecar(dir.path(), &ups[0], port, "a");
    let b = sidecar(dir.path(), &ups[1], port, "b");
    let (ta, tb) = tokio::join!(first_admitted(&a, started, &server), first_admitted(&b, started, &server));
    for (name, t) in [("a", ta), ("b", tb)] {
        assert!(t <= Duration::from_secs(3), "sidecar {name}'s first request admitted {t:?} after it started");
    }
    assert_eq!(learning(&server), Some(false), "no learning mode on a fresh start");
    eprintln!("first requests admitted after {ta:?} and {tb:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_leases_outstanding_learns() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("server.state");
    let port = free_port();
    let up = Upstream::start().await;
    let first = server(dir.path(), port, &state);
    let proxy = sidecar(dir.path(), &up, port, "a");
    first_admitted(&proxy, Instant::now(), &first).await;
    drop(first); // SIGKILL: the sidecar's lease stays outstanding
    let second = server(dir.path(), port, &state);
    second.wait_for_log("a predecessor's leases may be outstanding", Duration::from_secs(5));
    // The sidecar comes back with the lease it holds; the new server learns.
    assert_eventually!(
        learning(&second).is_some(),
        Duration::from_secs(15),
        "the sidecar never came back:\n{}",
        second.log()
    );
    let r = resources(&second).remove(0);
    assert_eq!(r["learning_mode"], true, "{r}");
    assert_eq!(r["sum_has"], 10.0, "learning mode hands the sidecar's lease back: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_state_file_is_warned_about_and_learnt_from() {
    let dir = tempfile::tempdir().unwrap();
    let state = write_file(dir.path(), "server.state", "garbage\n");
    let port = free_port();
    let server = server(dir.path(), port, &state);
    server.wait_for_log("the state file does not hold a time", Duration::from_secs(5));
    assert!(server.log().lines().any(|l| l.contains("WARN") && l.contains("state file")), "{}", server.log());
    let up = Upstream::start().await;
    let _proxy = sidecar(dir.path(), &up, port, "a");
    assert_eventually!(learning(&server).is_some(), Duration::from_secs(15), "no request reached the server");
    assert_eq!(learning(&server), Some(true), "nothing known: learning mode");
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(text.trim().parse::<u64>().is_ok(), "the record is written anew: {text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_state_file_keeps_no_record() {
    let dir = tempfile::tempdir().unwrap();
    // The server's own state home: the default record would go in it.
    let home = dir.path().join("state-home");
    std::fs::create_dir(&home).unwrap();
    let config = write_file(dir.path(), "resources.yaml", CONFIG);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let args = [
        "server",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        &listen,
        "--admin-listen",
        "127.0.0.1:0",
        "--state-file",
        "",
    ];
    let mut server = Usher::start(&args, &[("XDG_STATE_HOME", home.to_str().unwrap())], "usher server listening");
    server.wait_for_log("no state file", Duration::from_secs(5));
    let up = Upstream::start().await;
    let proxy = sidecar(dir.path(), &up, port, "a");
    assert_eventually!(learning(&server).is_some(), Duration::from_secs(15), "no request reached the server");
    assert_eq!(learning(&server), Some(true), "nothing recorded: every start learns");
    drop(proxy);
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(10)), Some(0), "{}", server.log());
    let written: Vec<_> = walk(&home);
    assert!(written.is_empty(), "--state-file \"\" writes nothing, found {written:?}");
    // The environment variable takes the empty value too.
    let env_args = &args[..args.len() - 2];
    let mut server = Usher::start(
        env_args,
        &[("XDG_STATE_HOME", home.to_str().unwrap()), ("USHER_STATE_FILE", "")],
        "usher server listening",
    );
    server.wait_for_log("no state file", Duration::from_secs(5));
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(10)), Some(0), "{}", server.log());
    assert!(walk(&home).is_empty(), "USHER_STATE_FILE=\"\" writes nothing");
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
        match e.file_type().unwrap().is_dir() {
            true => out.extend(walk(&e.path())),
            false => out.push(e.path()),
        }
    }
    out
}
