//! The status pages as a person sees them: rendered by headless Chromium
//! (Debian's `chromium`, which `.ci/test` installs), checked for live values,
//! and screenshotted.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::{Usher, http_get, write_file};

fn chromium(args: &[&str], profile: &Path) -> std::process::Output {
    Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("chromium is installed (Debian package chromium; .ci/test installs it)")
}

#[test]
fn the_sidecar_and_server_pages_render_live_values() {
    let dir = tempfile::tempdir().unwrap();
    let server = Usher::server(&["--min-request-interval", "0s"]);
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "doorman:\n  servers: [\"{}\"]\n  client_id: page-test\n\
             upstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 40, wants: 37.5 }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
            server.addr("grpc")
        ),
    );
    let proxy = Usher::proxy(&routes);
    assert_eventually!(
        http_get(proxy.addr("admin"), "/debug/status?format=json").1.contains("\"has\": 37.5"),
        Duration::from_secs(10),
        "the sidecar holds its lease"
    );

    let profile = dir.path().join("profile");
    let url = format!("http://{}/debug/status", proxy.addr("admin"));
    let dom = chromium(&["--dump-dom", &url], &profile);
    let html = String::from_utf8_lossy(&dom.stdout);
    assert!(html.contains("<table id=\"leases\">"), "the leases table renders:\n{html}");
    assert!(html.contains("<td>api</td><td>Leased</td><td>37.500/s</td>"), "with the live lease:\n{html}");
    assert!(html.contains(&format!("master {}", server.addr("grpc"))), "and the master:\n{html}");
    assert!(html.contains("http-equiv=\"refresh\""), "the page refreshes itself");

    let shot =
        std::env::var_os("USHER_SCREENSHOT").map_or_else(|| dir.path().join("sidecar.png"), std::path::PathBuf::from);
    chromium(&[&format!("--screenshot={}", shot.display()), "--window-size=1200,700", &url], &profile);
    let png = std::fs::read(&shot).expect("a screenshot was written");
    assert_eq!(&png[..4], b"\x89PNG");
    assert!(png.len() > 15_000, "the screenshot shows a rendered page, not a blank one ({} bytes)", png.len());

    let url = format!("http://{}/debug/status", server.addr("admin"));
    let dom = chromium(&["--dump-dom", &url], &profile);
    let html = String::from_utf8_lossy(&dom.stdout);
    assert!(html.contains("<table id=\"resources\">"), "{html}");
    assert!(html.contains(">api</a></td><td>*</td><td>FAIR_SHARE</td><td>100.000/s</td><td>37.500/s</td>"), "{html}");
}
