//! What the real binaries do with a config path that is not a sane file: a
//! symlink to an endless device, a FIFO, a file over the 16 MiB cap, a value
//! of 20 MB. `usher check` and start-up refuse them at once; a running
//! `usher proxy` or `usher server` refuses them on reload, logs and counts
//! the error, keeps serving its last good configuration in bounded memory,
//! and still applies the next good file.
//!
//! Every usher process these tests start is held to an address-space limit,
//! so that a regression (an unbounded read of `/dev/zero`) fails the test
//! instead of taking the machine's memory.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::upstream::{Upstream, get, h1, send1};
use support::{Usher, http_get, metric, peak_rss_kib, run_for, run_usher_for, usher_bin, write_file};
use usher_proto::capacity_client::CapacityClient;
use usher_proto::{GetCapacityRequest, ResourceRequest};

/// The most address space a tested process may take on top of what it had.
const HEADROOM_KIB: u64 = 1536 * 1024;

/// Holds process `pid` to its current address space plus [`HEADROOM_KIB`].
fn cap_memory(pid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let limit = (vm_kib + HEADROOM_KIB) * 1024;
    let ok = Command::new("prlimit")
        .args([format!("--pid={pid}"), format!("--as={limit}:{limit}")])
        .status()
        .expect("prlimit (util-linux)");
    assert!(ok.success());
}

/// Runs `usher ARGS...` under a 2 GiB address-space limit, killed after 30 s:
/// (exit code, stderr); the code is `None` if it had to be killed.
fn run_bounded(args: &[&str]) -> (Option<i32>, String) {
    let bin = usher_bin();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "ulimit -v 2097152 && exec \"$@\"", "sh", bin.to_str().unwrap()]).args(args);
    run_for(cmd, Duration::from_secs(30))
}

/// How many log lines contain `needle` (a device after another device is
/// the same error again, logged again).
fn logged(u: &Usher, needle: &str) -> usize {
    u.log().lines().filter(|l| l.contains(needle)).count()
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

/// What is put at the watched path, how, and the error it must get.
type Case = (&'static str, Box<dyn FnOnce(&Path)>, String);

/// Puts `make`'s file at `path` in one rename, as a ConfigMap swap does.
fn swap_in(path: &Path, make: impl FnOnce(&Path)) {
    let tmp = path.with_extension("next");
    let _ = std::fs::remove_file(&tmp);
    make(&tmp);
    std::fs::rename(&tmp, path).unwrap();
}

fn symlink_to(target: &'static str) -> impl FnOnce(&Path) {
    move |p| std::os::unix::fs::symlink(target, p).unwrap()
}

fn text(t: String) -> impl FnOnce(&Path) {
    move |p| std::fs::write(p, t).unwrap()
}

/// A symlink to /dev/zero, a FIFO, a file of 17 MiB (`big`) and a symlink to
/// /dev/urandom at `file`, a `role` ("routes file"), with the error each must get.
fn refusals(file: &str, role: &str, big: String) -> Vec<Case> {
    let device = format!("{file}:1:1: cannot read {role}: not a regular file (a character device)");
    vec![
        ("a symlink to /dev/zero", Box::new(symlink_to("/dev/zero")), device.clone()),
        ("a FIFO", Box::new(mkfifo), format!("{file}:1:1: cannot read {role}: not a regular file (a FIFO)")),
        (
            "a 17 MiB file",
            Box::new(text(big)),
            format!("{file}:1:1: cannot read {role}: larger than the 16 MiB limit for configuration files"),
        ),
        // Not after /dev/zero: the same error again is not a change.
        ("a symlink to /dev/urandom", Box::new(symlink_to("/dev/urandom")), device),
    ]
}

/// Puts `make`'s file at `path` and waits until `u` logs `want` once more;
/// `u` must still be running.
fn refused(u: &mut Usher, path: &Path, what: &str, make: Box<dyn FnOnce(&Path)>, want: &str) {
    let started = Instant::now();
    let seen = logged(u, want);
    swap_in(path, make);
    assert_eventually!(logged(u, want) > seen, Duration::from_secs(30), "{what}: no {want:?} in\n{}", u.log());
    eprintln!("figures: {what} refused {:?} after it was put in place", started.elapsed());
    assert_eq!(u.child.try_wait().unwrap(), None, "{what}: usher is still running");
}

/// A routes file of 17 MiB (the cap is 16): valid YAML, padded with comments.
fn oversized(base: &str) -> String {
    let mut t = base.to_string();
    let line = format!("# {}\n", "x".repeat(1021));
    while t.len() <= 17 << 20 {
        t.push_str(&line);
    }
    t
}

/// A routes file whose upstream URL is 2,000,007 bytes long, on line 2 (the
/// audit's 20 MB would now be refused by the size cap before it is parsed).
fn huge_url(up: &str) -> String {
    format!(
        "upstreams:\n  raw: {{ url: \"http://{}\" }}\n  up: {{ url: \"http://{up}\" }}\n\
         routes:\n  - {{ name: api, upstream: up }}\n",
        "a".repeat(2_000_000)
    )
}

#[test]
fn check_and_start_up_refuse_devices_fifos_and_oversized_files_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let zero = d.join("zero.yaml");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let fifo = d.join("fifo.yaml");
    mkfifo(&fifo);
    let big = write_file(d, "big.yaml", &oversized("routes: []\n"));
    let url = write_file(d, "url.yaml", &huge_url("127.0.0.1:1"));
    let p = |p: &PathBuf| p.to_str().unwrap().to_string();

    let started = Instant::now();
    let (code, err) = run_bounded(&["check", &p(&zero), &p(&fifo), &p(&big), &p(&url)]);
    eprintln!("figures: usher check took {:?}", started.elapsed());
    assert_eq!(code, Some(64), "{err}");
    for want in [
        format!("{}:1:1: cannot read it: not a regular file (a character device)", zero.display()),
        format!("{}:1:1: cannot read it: not a regular file (a FIFO)", fifo.display()),
        format!("{}:1:1: cannot read it: larger than the 16 MiB limit for configuration files", big.display()),
        format!(
            "{}:2:15: upstreams.raw.url: `http://{}… (2000007 bytes)` is not an http:// or https:// URL",
            url.display(),
            "a".repeat(93)
        ),
    ] {
        assert!(err.contains(&want), "no {want:?} in {:.2000}", err);
    }
    let longest = err.lines().map(str::len).max().unwrap();
    assert!(longest < 1000, "a line of {longest} bytes");

    // Start-up: the same errors, exit 64.
    let (code, err) = run_bounded(&["proxy", "--routes", &p(&zero), "--listen", "127.0.0.1:0"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("zero.yaml:1:1: cannot read routes file: not a regular file (a character device)"), "{err}");
    let (code, err) = run_bounded(&["server", "--config", &p(&fifo), "--listen", "127.0.0.1:0"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("fifo.yaml:1:1: cannot read resources file: not a regular file (a FIFO)"), "{err}");
    // `run_usher_for` is bounded by time only: used where memory is not at stake.
    let (code, err) = run_usher_for(&["proxy", "--routes", &p(&big)], &[], Duration::from_secs(10));
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("larger than the 16 MiB limit"), "{err}");
}

/// The sidecar's configuration error on its status page, and its counts of
/// rejected and of applied reloads.
fn reload_state(admin: std::net::SocketAddr) -> (String, Option<f64>, Option<f64>) {
    let status: serde_json::Value = serde_json::from_str(&http_get(admin, "/debug/status?format=json").1).unwrap();
    let metrics = http_get(admin, "/metrics").1;
    (
        status["config_error"].as_str().unwrap_or("").to_string(),
        metric(&metrics, "usher_proxy_config_reload_errors_total", &[]),
        metric(&metrics, "usher_proxy_config_reloads_total", &[]),
    )
}

async fn status_of(addr: std::net::SocketAddr, path: &str) -> StatusCode {
    let req = async {
        let mut c = h1(addr).await;
        send1(&mut c, get("x", path)).await.status
    };
    tokio::time::timeout(Duration::from_secs(10), req).await.expect("answered within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_reloaded_into_a_device_a_fifo_a_huge_file_or_value_keeps_serving_and_applies_the_next_good_file() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let base = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         routes:\n  - {{ name: api, match: {{ path_prefix: /api }}, upstream: up }}\n",
        up.addr
    );
    let with_other = format!("{base}  - {{ name: other, match: {{ path_prefix: /other }}, upstream: up }}\n");
    let routes = write_file(dir.path(), "routes.yaml", &base);
    let f = routes.display().to_string();
    let mut u = Usher::proxy(&routes);
    let (listen, admin) = (u.addr("listen"), u.addr("admin"));
    let pid = u.child.id();
    cap_memory(pid);
    assert_eq!(status_of(listen, "/api").await, StatusCode::OK);
    let peak = peak_rss_kib(pid);

    let mut cases = refusals(&f, "routes file", oversized(&with_other));
    cases.push((
        "a 2 MB URL",
        Box::new(text(huge_url(&up.addr.to_string()))),
        format!("{f}:2:15: upstreams.raw.url: `http://{}… (2000007 bytes)` is not an http://", "a".repeat(93)),
    ));
    for (i, (what, make, want)) in cases.into_iter().enumerate() {
        refused(&mut u, &routes, what, make, &want);
        assert_eq!(status_of(listen, "/api").await, StatusCode::OK, "{what}: the last good routes serve");
        assert_eq!(status_of(listen, "/other").await, StatusCode::FORBIDDEN, "{what}: nothing new applied");
        let (error, errors, reloads) = tokio::task::spawn_blocking(move || reload_state(admin)).await.unwrap();
        assert!(error.contains(&want), "{what}: status shows {:.500}", error);
        assert!(error.len() < 1000, "{what}: a status entry of {} bytes", error.len());
        assert_eq!((errors, reloads), (Some(i as f64 + 1.0), Some(0.0)), "{what}: counted as a rejected reload");
    }
    let longest = u.log().lines().map(str::len).max().unwrap();
    assert!(longest < 1000, "a log line of {longest} bytes");
    let grown = peak_rss_kib(pid).saturating_sub(peak);
    eprintln!("figures: peak resident memory +{grown} KiB");
    // The 17 MiB file is never read whole; the 2 MB value is read and parsed (the
    // file is under the cap) and must not be held more than a few times.
    assert!(grown < 64 * 1024, "the peak resident memory grew by {grown} KiB");

    // The reload loop is not wedged: after the FIFO came the others, and the next good file applies.
    swap_in(&routes, text(with_other));
    u.wait_for_log("routes reloaded", Duration::from_secs(10));
    assert_eq!(status_of(listen, "/other").await, StatusCode::OK);
}

const RESOURCES: &str = "resources:\n  - identifier_glob: \"*\"\n    capacity: 1000\n    \
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 5, learning_mode_duration: 0 }\n";

async fn grant(c: &mut CapacityClient<tonic::transport::Channel>) -> f64 {
    let ask = ResourceRequest {
        returned: None,
        reserve: None,
        backlog: None,
        unit_account: None,
        window: None,
        upstream_quota: None,
        resource_id: "r".into(),
        priority: 0,
        has: None,
        wants: 5000.0,
    };
    let req = GetCapacityRequest { client_id: "a".into(), resource: vec![ask] };
    let resp = tokio::time::timeout(Duration::from_secs(10), c.get_capacity(req)).await.expect("answered in 10 s");
    resp.unwrap().into_inner().response[0].gets.capacity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_reloaded_into_a_device_or_a_fifo_keeps_its_config_and_applies_the_next_good_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_file(dir.path(), "resources.yaml", RESOURCES);
    let f = cfg.display().to_string();
    let mut s = Usher::server(&["--config", &f, "--min-request-interval", "0s"]);
    let pid = s.child.id();
    cap_memory(pid);
    let mut c = CapacityClient::connect(format!("http://{}", s.addr("grpc"))).await.unwrap();
    assert_eq!(grant(&mut c).await, 1000.0);
    let peak = peak_rss_kib(pid);

    let cases = refusals(&f, "resources file", oversized(RESOURCES));
    let admin = s.addr("admin");
    for (i, (what, make, want)) in cases.into_iter().enumerate() {
        refused(&mut s, &cfg, what, make, &want);
        assert_eq!(grant(&mut c).await, 1000.0, "{what}: the last good configuration stays");
        let metrics = tokio::task::spawn_blocking(move || http_get(admin, "/metrics").1).await.unwrap();
        let errors = metric(&metrics, "usher_config_reload_errors_total", &[]);
        assert_eq!(errors, Some(i as f64 + 1.0), "{what}: counted as a rejected reload");
    }
    assert!(s.log().contains("configuration rejected, keeping the previous one"), "{}", s.log());
    let grown = peak_rss_kib(pid).saturating_sub(peak);
    eprintln!("figures: peak resident memory +{grown} KiB");
    assert!(grown < 64 * 1024, "the peak resident memory grew by {grown} KiB");

    swap_in(&cfg, text(RESOURCES.replace("capacity: 1000", "capacity: 300")));
    s.wait_for_log("configuration reloaded", Duration::from_secs(10));
    assert_eq!(grant(&mut c).await, 300.0);
}
