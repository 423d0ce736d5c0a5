//! The log through the real binary: text without colour unless stderr is a
//! terminal (a sidecar's log in a file or a pipe has no escape codes), and
//! `--log-format json`, one JSON object per line.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::usher_bin;

/// Runs a sidecar on the quickstart file with `extra` arguments and stderr to
/// a pipe, without `NO_COLOR`, until a line holds `marker`; then stops it (by
/// its PID) and returns every line of its log, as raw bytes.
fn sidecar_log(extra: &[&str], marker: &str) -> Vec<Vec<u8>> {
    // The quickstart file, its upstream's listener on a free port (tests run side by side).
    let dir = tempfile::tempdir().unwrap();
    let text = include_str!("../deploy/examples/quickstart.yaml").replace("127.0.0.1:15002", "127.0.0.1:0");
    let quick = dir.path().join("quickstart.yaml");
    std::fs::write(&quick, text).unwrap();
    let quick = quick.to_str().unwrap().to_string();
    let mut child = Command::new(usher_bin())
        .args(extra)
        .args(["proxy", "--routes", &quick, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("NO_COLOR")
        .env_remove("USHER_LOG_FORMAT")
        .env("USHER_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn usher");
    let stderr = child.stderr.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stderr);
        loop {
            let mut line = Vec::new();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &Vec<u8>| String::from_utf8_lossy(l).contains(marker)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!("no {marker:?} in:\n{}", String::from_utf8_lossy(&lines.concat()));
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    lines.extend(rx.iter());
    lines
}

#[test]
fn a_log_written_to_a_pipe_has_no_escape_codes() {
    let lines = sidecar_log(&[], "usher proxy listening");
    let all = lines.concat();
    assert!(lines.len() >= 2, "{}", String::from_utf8_lossy(&all));
    assert!(!all.contains(&0x1b), "an ESC byte in:\n{}", String::from_utf8_lossy(&all));
    assert!(String::from_utf8_lossy(&all).contains(" INFO "), "plain text levels:\n{}", String::from_utf8_lossy(&all));
}

#[test]
fn log_format_json_writes_one_object_per_line_with_a_level_and_a_message() {
    let lines = sidecar_log(&["--log-format", "json"], "usher proxy listening");
    assert!(lines.len() >= 2, "{}", String::from_utf8_lossy(&lines.concat()));
    let mut listening = None;
    for l in &lines {
        assert!(!l.contains(&0x1b), "an ESC byte in {}", String::from_utf8_lossy(l));
        let v: serde_json::Value =
            serde_json::from_slice(l).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(l)));
        assert!(v["level"].is_string(), "{v}");
        assert!(v["message"].is_string(), "{v}");
        if v["message"] == "usher proxy listening" {
            listening = Some(v);
        }
    }
    let v = listening.expect("the ready line");
    assert_eq!(v["level"], "INFO", "{v}");
    assert!(v["listen"].as_str().is_some_and(|a| a.starts_with("127.0.0.1:")), "fields beside the message: {v}");
}

#[test]
fn an_unknown_log_format_is_a_usage_error() {
    let (code, out, err) = support::run_usher(&["--log-format", "xml", "check", "x.yaml"]);
    assert_eq!(code, 64, "{out}{err}");
    assert!(err.contains("--log-format") && err.contains("json"), "{err}");
}

/// Starts `usher ARGS` with stderr to a pipe, reads until the line holding
/// `marker`, and closes the pipe's read end, as a log shipper that went away
/// would. Returns the process and the address in the marker line's `field`.
fn start_then_close_the_log(args: &[&str], marker: &str, field: &str) -> (std::process::Child, std::net::SocketAddr) {
    let mut child = Command::new(usher_bin())
        .args(args)
        .env("USHER_LOG", "debug")
        .env("NO_COLOR", "1")
        .env("XDG_STATE_HOME", support::state_home())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn usher");
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let line = lines.by_ref().map_while(Result::ok).find(|l| l.contains(marker)).expect("the ready line");
    drop(lines);
    let addr = support::log_fields(&line)[field].parse().expect("an address");
    (child, addr)
}

#[test]
fn a_server_and_a_sidecar_keep_serving_when_their_log_pipe_closes() {
    let dir = tempfile::tempdir().unwrap();
    let config = support::write_file(
        dir.path(),
        "resources.yaml",
        "resources:\n  - identifier_glob: '*'\n    capacity: 10\n    algorithm: { kind: FAIR_SHARE, lease_length: 4, refresh_interval: 1 }\n",
    );
    let (mut server, server_admin) = start_then_close_the_log(
        &["server", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        "usher server listening",
        "admin",
    );
    let routes = support::write_file(
        dir.path(),
        "routes.yaml",
        &include_str!("../deploy/examples/quickstart.yaml").replace("127.0.0.1:15002", "127.0.0.1:0"),
    );
    let (mut proxy, proxy_admin) = start_then_close_the_log(
        &["proxy", "--routes", routes.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        "usher proxy listening",
        "admin",
    );
    // Both log at debug after their ready line (the server's state-file line,
    // the sidecar's lease refreshes): every one of those writes fails.
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(700));
        assert_eq!(support::http_get(server_admin, "/healthz").0, 200, "the server answers");
        assert_eq!(support::http_get(proxy_admin, "/healthz").0, 200, "the sidecar answers");
    }
    for (name, child) in [("server", &mut server), ("sidecar", &mut proxy)] {
        let status = child.try_wait().expect("try_wait");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(status, None, "the {name} exited when its log pipe closed");
    }
}
