//! A resource id that only the server's catch-all `*` template matches,
//! while others are configured, is a likely typo (`github_core` for
//! `github-core` silently got the catch-all's capacity): the server warns
//! once per id and counts it in `usher_server_catch_all_resources_total`,
//! and tells the client which template each id fell to (an optional
//! protocol field a Doorman peer ignores), shown on the sidecar's
//! `/debug/status`.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::Duration;

use support::upstream::Upstream;
use support::{Usher, free_port, http_get, metric, write_file};

const CONFIG: &str = "resources:\n  - identifier_glob: github-core\n    capacity: 50\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1, learning_mode_duration: 0 }\n  - identifier_glob: '*'\n    capacity: 1000\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1, learning_mode_duration: 0 }\n";

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The server template the sidecar shows for lease id `id`.
fn template_of(sidecar: &Usher, id: &str) -> Option<String> {
    let st = status(sidecar);
    let keys = st["lease"]["keys"].as_array()?.clone();
    let k = keys.iter().find(|k| k["resource_id"] == id)?;
    k["template"].as_str().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_only_the_catch_all_matches_is_warned_about_counted_and_shown() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = Usher::server_at(&write_file(dir.path(), "r.yaml", CONFIG), port, &[]);
    let up = Upstream::start().await;
    let routes = format!(
        "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: typo\n\
         upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  core: {{ id: github-core, kind: rate, capacity: 5, wants: 5 }}\n  typo: {{ id: github_core, kind: rate, capacity: 5, wants: 5 }}\n\
         routes:\n  - {{ name: all, upstream: up, resources: [core, typo] }}\n",
        up.addr
    );
    let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
    assert_eventually!(
        template_of(&sidecar, "github_core").is_some() && template_of(&sidecar, "github-core").is_some(),
        Duration::from_secs(15),
        "the sidecar shows the server's templates: {}",
        status(&sidecar)
    );
    assert_eq!(template_of(&sidecar, "github_core").as_deref(), Some("*"));
    assert_eq!(template_of(&sidecar, "github-core").as_deref(), Some("github-core"));
    let (_, html) = http_get(sidecar.addr("admin"), "/debug/status");
    assert!(html.contains("server template"), "{html}");
    // Refreshed every second: a few more refreshes, still one warning.
    let refreshes = || status(&sidecar)["lease"]["refreshes"].as_u64().unwrap();
    let seen = refreshes();
    assert_eventually!(refreshes() >= seen + 2, Duration::from_secs(10), "the sidecar refreshes");
    let log = server.log();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("matched no template but the catch-all")).collect();
    assert_eq!(warned.len(), 1, "one warning, for github_core:\n{log}");
    assert!(warned[0].contains("WARN") && warned[0].contains("github_core") && warned[0].contains("github-core"));
    let (_, metrics) = http_get(server.addr("admin"), "/metrics");
    assert_eq!(metric(&metrics, "usher_server_catch_all_resources_total", &[]), Some(1.0), "{metrics}");
}
