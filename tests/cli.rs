//! The command line through the real binary: `usher check` tells files apart by content,
//! validates every shipped example and reports every error with a position; help and completions.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::process::Command;
use std::time::Duration;

use support::{run_usher, usher_bin, write_file};

#[test]
fn shipped_examples_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut files =
        vec![format!("{root}/deploy/examples/routes.yaml"), format!("{root}/deploy/examples/resources.yaml")];
    for s in ["one", "two", "three", "four", "five", "six", "seven"] {
        files.push(format!("{root}/deploy/examples/sim/{s}.yaml"));
    }
    let out = Command::new(usher_bin()).arg("check").args(&files).env("POD_NAME", "app-0").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("routes.yaml: ok (routes file)"), "{stdout}");
    assert!(stdout.contains("resources.yaml: ok (resources file)"), "{stdout}");
    assert!(stdout.contains("seven.yaml: ok (sim scenario)"), "{stdout}");
}

#[test]
fn every_error_of_every_file_is_reported_and_the_exit_code_is_64() {
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        "resources:\n  api: { kind: rate, capacity: 5, on_expiry: sometimes }\nroutes:\n  - { name: a, resources: [apx] }\n",
    );
    let resources = write_file(
        dir.path(),
        "resources.yaml",
        "resources:\n  - identifier_glob: x\n    capacity: 1\n    algorithm: { kind: FAIR, lease_length: 5, refresh_interval: 5 }\n",
    );
    let unknown = write_file(dir.path(), "other.yaml", "hello: world\n");
    let (code, out, err) =
        run_usher(&["check", routes.to_str().unwrap(), resources.to_str().unwrap(), unknown.to_str().unwrap()]);
    assert_eq!(code, 64, "{out}{err}");
    let (r, s, u) = (routes.display(), resources.display(), unknown.display());
    for want in [
        format!(
            "{r}:2:46: resources.api.on_expiry: unknown behaviour `sometimes` (hint: optimistic, pessimistic or safe)"
        ),
        format!("{r}:4:28: routes[0].resources[0]: unknown resource `apx` (hint: did you mean `api`?)"),
        format!("{s}:4:24: resources[0].algorithm.kind: unknown algorithm `FAIR`"),
        format!("{s}:2:3: resources: no catch-all entry"),
        format!("{u}:1:1: cannot tell what kind of file this is"),
        "usher: 3 of 3 file(s) invalid".to_string(),
    ] {
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }
}

/// A routes file of a kilobyte whose nested aliases would expand to 43
/// million nodes (an "alias bomb") is refused with its position, not
/// expanded until memory runs out.
#[test]
fn an_alias_bomb_is_refused_with_its_position() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("resources:\n  api: {{ kind: rate, capacity: 5 }}\n{}", support::alias_bomb());
    let routes = write_file(dir.path(), "routes.yaml", &text);
    let started = std::time::Instant::now();
    let (code, out, err) = run_usher(&["check", routes.to_str().unwrap()]);
    assert_eq!(code, 64, "{out}{err}");
    assert!(
        err.contains(&format!("{}:9:17: this alias would make the document more than 200000 nodes", routes.display())),
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
}

/// A capacity server address usher could never dial is an error where it
/// is written (routes file: file:line:column and the field; `--parent`: a
/// usage error), not a process that starts and then fails for ever.
#[test]
fn capacity_server_addresses_are_checked_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let text = "doorman:\n  servers: [\"ok-0:15100\", \"\", \"::1:15100\", \"127.0.0.1:99999\", \"ftp://a:1\"]\n\
                resources:\n  api: { kind: rate, capacity: 5 }\n";
    let routes = write_file(dir.path(), "routes.yaml", text);
    let (code, out, err) = run_usher(&["check", routes.to_str().unwrap()]);
    assert_eq!(code, 64, "{out}{err}");
    let at = |col: usize, field: &str, says: &str| {
        let line = format!("{}:2:{col}: doorman.servers[{field}]", routes.display());
        assert!(err.lines().any(|l| l.contains(&line) && l.contains(says)), "{line} ... {says}:\n{err}");
    };
    at(27, "1", "is empty");
    at(31, "2", "more than one `:`");
    at(44, "3", "not a number from 1 to 65535");
    at(63, "4", "`ftp://` is not a scheme");
    assert!(!err.contains("servers[0]"), "{err}");
    for parent in ["", "::1:5", "127.0.0.1:99999"] {
        let (code, out, err) = run_usher(&["server", "--parent", parent]);
        assert_eq!(code, 64, "--parent {parent:?}: {out}{err}");
        assert!(err.contains("--parent"), "{err}");
    }
}

/// A usage error (an unknown flag, a value that does not parse) exits 64
/// like an invalid configuration, with clap's message; `--help` exits 0.
#[test]
fn usage_errors_exit_64_and_help_exits_0() {
    for args in [&["server", "--bogus"][..], &["server", "--min-request-interval", "-1s"], &["nonsense"]] {
        let (code, out, err) = run_usher(args);
        assert_eq!(code, 64, "{args:?}: {out}{err}");
        assert!(err.contains("error:"), "{args:?}: {err}");
    }
    let (code, out, _) = run_usher(&["server", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Usage:"), "{out}");
    let (code, out, _) = run_usher(&["--version"]);
    assert_eq!((code, out.starts_with("usher ")), (0, true), "{out}");
}

#[test]
fn completions_and_man_page_come_from_the_cli_definitions() {
    for shell in ["bash", "zsh", "fish"] {
        let (code, out, err) = run_usher(&["completions", shell]);
        assert_eq!(code, 0, "{err}");
        for sub in ["server", "proxy", "sim", "check", "demo"] {
            assert!(out.contains(sub), "{shell} completion lacks `{sub}`");
        }
    }
    let (code, man, _) = run_usher(&["completions", "man"]);
    assert_eq!(code, 0);
    assert!(man.starts_with(".ie") && man.contains(".TH usher 1"), "{man}");
    let (code, _, err) = run_usher(&["completions", "tcsh"]);
    assert_eq!(code, 64);
    assert!(err.contains("unknown shell `tcsh`"), "{err}");
}

#[test]
fn help_lists_only_working_subcommands() {
    let (code, out, _) = run_usher(&["--help"]);
    assert_eq!(code, 0);
    for sub in ["demo", "server", "proxy", "sim", "check", "completions"] {
        assert!(out.contains(&format!("  {sub}")), "--help lacks {sub}:\n{out}");
    }
}

#[test]
fn the_readme_sim_commands_work() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("series.csv");
    let five = format!("{root}/deploy/examples/sim/five.yaml");
    let (code, out, err) =
        run_usher(&["sim", &five, "--seed", "7", "--json", "--csv", csv.to_str().unwrap(), "--duration", "120s"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "clients",
            "convergence_mean_s",
            "convergence_worst_s",
            "fairness",
            "max_overshoot",
            "mean_overshoot_when_over",
            "mishaps",
            "rpcs_per_s",
            "rpcs_per_s_by_level",
            "shortfall_events",
            "startup_s",
            "startup_utilisation",
            "utilisation"
        ],
        "exactly the report's keys"
    );
    assert!(std::fs::read_to_string(&csv).unwrap().starts_with("t_s,capacity,total_wants,total_has"));
    let (code, out, _) = run_usher(&["sim", "--scenario", "seven", "--duration", "300s"]);
    assert_eq!(code, 0);
    assert!(out.contains("scenario seven") && out.contains("utilisation"), "{out}");
    let (code, _, err) = run_usher(&["sim", "--scenario", "eight"]);
    assert_eq!(code, 64);
    assert!(err.contains("no built-in scenario `eight`"), "{err}");
}

#[test]
fn the_readme_quickstart_routes_file_runs() {
    // The file as written, but its upstream listener on a free port (no fixed ports in tests).
    let quick = include_str!("../deploy/examples/quickstart.yaml");
    assert!(quick.contains("listen: 127.0.0.1:15002"), "{quick}");
    let dir = tempfile::tempdir().unwrap();
    let quick = write_file(dir.path(), "quickstart.yaml", &quick.replace("127.0.0.1:15002", "127.0.0.1:0"));
    let p = support::Usher::start(
        &["proxy", "--routes", quick.to_str().unwrap(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[],
        "usher proxy listening",
    );
    let _ = p.upstream_listener("github");
    let (code, body) = support::http_get(p.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["lease"]["master"], "embedded", "{body}");
    assert_eq!(support::http_get(p.addr("admin"), "/readyz").0, 200);
}

/// A resources file takes the routes file's rate units (a bare number stays
/// per second, as in Doorman's format), and `usher check` prints every
/// template as the server will serve it.
#[test]
fn a_resources_file_with_rate_units_checks_and_prints_each_template_per_second() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"resources:
  - identifier_glob: github
    capacity: 5000/h
    safe_capacity: 600/min
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 10 }
  - identifier_glob: "*"
    capacity: 12.5
    algorithm: { kind: STATIC, lease_length: 30, refresh_interval: 5 }
"#;
    let file = write_file(dir.path(), "resources.yaml", text);
    let (code, out, err) = run_usher(&["check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let f = file.display();
    for want in [
        format!("{f}: ok (resources file)"),
        "  resource `github`: 1.39/s, FAIR_SHARE, lease_length 60s, refresh_interval 10s, safe_capacity 10/s".into(),
        "  resource `*`: 12.5/s, STATIC, lease_length 30s, refresh_interval 5s, safe_capacity dynamic".into(),
    ] {
        assert!(out.lines().any(|l| l == want), "missing {want:?} in:\n{out}");
    }
    let bad = write_file(dir.path(), "bad.yaml", &text.replace("5000/h", "5000/week"));
    let (code, out, err) = run_usher(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "{out}{err}");
    let want = format!("{}:3:15: resources[0].capacity: unknown unit `/week`; use /s, /min, /h or /day", bad.display());
    assert!(err.contains(&want), "missing {want:?} in:\n{err}");
}

/// `usher check` says which resources renew on the calendar, follow the
/// upstream's quota headers or only watch (shadow), in both files.
#[test]
fn check_names_calendar_windows_quota_headers_and_shadow_resources() {
    let dir = tempfile::tempdir().unwrap();
    let routes = "resources:\n  reports: { kind: rate, capacity: 120/min, window: calendar }\n  \
                  gh: { kind: rate, capacity: 5000/h, upstream_quota: { headers: github }, shadow: true }\n";
    let file = write_file(dir.path(), "routes.yaml", routes);
    let (code, out, err) = run_usher(&["check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("resource reports: rate 120/min = 2/s") && out.contains("120 per UTC minute (window: calendar)"),
        "{out}"
    );
    assert!(
        out.contains("follows the upstream's quota headers (github: x-ratelimit-limit, x-ratelimit-remaining, x-ratelimit-reset), shadow"),
        "{out}"
    );
    let resources = "resources:\n  - identifier_glob: reports\n    capacity: 1000/day\n    window: calendar\n    \
                     algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n  - identifier_glob: \"*\"\n    \
                     capacity: 0\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n";
    let file = write_file(dir.path(), "resources.yaml", resources);
    let (code, out, err) = run_usher(&["check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("resource `reports`: 0.0116/s (1000 per UTC day, window: calendar), FAIR_SHARE"), "{out}");
    let bad = write_file(dir.path(), "bad.yaml", &resources.replace("1000/day", "5"));
    let (code, _, err) = run_usher(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("bad.yaml:4:13: resources[0].window: a calendar window needs a capacity with a unit"),
        "{err}"
    );
}

/// `usher check` prints how each route's resource is charged: a cost read
/// from the request, and the rule that settles it from the answer.
#[test]
fn check_prints_each_settle_rule() {
    let dir = tempfile::tempdir().unwrap();
    let routes = "upstreams:\n  llm: { url: \"http://127.0.0.1:9\" }\n\
                  resources:\n  llm-usd: { kind: rate, capacity: 200/day, window: calendar }\n  \
                  tokens: { kind: rate, capacity: 1000/min, burst: 2000 }\n\
                  routes:\n  - name: chat\n    upstream: llm\n    resources:\n      \
                  - { resource: llm-usd, cost: 0.05, settle: { usage: openai, price: { input_per_million: 0.15, output_per_million: 0.60 } } }\n      \
                  - { resource: tokens, cost: \"{header.x-max-tokens}\", default_cost: 500, settle: { usage: anthropic, tokens: output } }\n  \
                  - name: plain\n    upstream: llm\n    resources:\n      \
                  - { resource: tokens, settle: { response_json: usage.total_tokens } }\n  \
                  - name: estimated\n    upstream: llm\n    resources:\n      \
                  - { resource: tokens, cost: { estimate: openai }, settle: { usage: openai } }\n      \
                  - { resource: llm-usd, cost: \"{json.budget.max}\", default_cost: 0.5 }\n";
    let file = write_file(dir.path(), "routes.yaml", routes);
    let (code, out, err) = run_usher(&["check", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    for line in [
        "route chat: resource llm-usd costs 0.05 at admission, settled from the answer's usage (openai, total tokens, \
         at 0.15 per million input tokens and 0.6 per million output tokens)",
        "route chat: resource tokens costs the request's `x-max-tokens` header (500 without it) at admission, \
         settled from the answer's usage (anthropic, output tokens)",
        "route plain: resource tokens costs 1 at admission, settled from `usage.total_tokens` in the answer's JSON",
        "route estimated: resource tokens costs an estimate of the openai call's tokens (1024 output tokens when it \
         sets no limit), or 1024 when the body cannot be read, at admission, settled from the answer's usage (openai, \
         total tokens)",
        "route estimated: resource llm-usd costs the number at `budget.max` in the request's JSON, or 0.5 when the \
         body cannot be read, at admission\n",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    let bad = write_file(dir.path(), "bad.yaml", &routes.replace("usage: anthropic", "usage: antropic"));
    let (code, _, err) = run_usher(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("bad.yaml:11:96: routes[0].resources[1].settle.usage: unknown usage preset `antropic` (hint: did you mean `anthropic`?)"),
        "{err}"
    );
}

/// `usher check` prints each resource of a routes file as it resolves: the
/// per-second rate, burst, max_wait and where the capacity comes from.
#[test]
fn a_routes_file_prints_every_resource_as_it_resolves() {
    let dir = tempfile::tempdir().unwrap();
    let embedded = write_file(
        dir.path(),
        "embedded.yaml",
        "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
         resources:\n  gh: { kind: rate, capacity: 5000/h, burst: 20, max_wait: 1500ms }\n\
         \x20 quick: { kind: rate, capacity: 8 }\n  inflight: { kind: gauge, capacity: 4, max_wait: 2s }\n\
         routes:\n  - { name: all, upstream: up, resources: [gh, quick, inflight] }\n",
    );
    let (code, out, err) = run_usher(&["check", embedded.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "  capacity from: the embedded capacity server (this file's capacities)",
        "  resource gh: rate 5000/h = 1.39/s, burst 20, max_wait 1s 500ms, id `gh`",
        "  resource quick: rate 8/s, burst 8, max_wait 0s, id `quick`",
        "  resource inflight: gauge 4 in flight, max_wait 2s, id `inflight`",
    ] {
        assert!(out.lines().any(|l| l == want), "missing {want:?} in:\n{out}");
    }
    let leased = write_file(
        dir.path(),
        "leased.yaml",
        "doorman:\n  servers: [\"doorman-0:15100\", \"doorman-1:15100\"]\n  client_id: pod-a\n\
         resources:\n  gh: { kind: rate, capacity: 100/min, id: \"gh/{header.x-tenant}\" }\n",
    );
    let (code, out, err) = run_usher(&["check", leased.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "  capacity from: the Doorman servers doorman-0:15100, doorman-1:15100 as client `pod-a` (a resource's capacity applies until its first lease)",
        "  resource gh: rate 100/min = 1.67/s, burst 100, max_wait 0s, id `gh/{header.x-tenant}`",
    ] {
        assert!(out.lines().any(|l| l == want), "missing {want:?} in:\n{out}");
    }
}

/// A ConfigMap's routes file names `${POD_NAME}`, set only in the pod: CI
/// checks it with `--allow-unset-env`, which says which variables were unset.
#[test]
fn allow_unset_env_checks_a_file_whose_variables_are_not_set() {
    let dir = tempfile::tempdir().unwrap();
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        "doorman:\n  servers: [\"doorman-0:15100\"]\n  client_id: \"${USHER_TEST_UNSET_POD}-${USHER_TEST_UNSET_NS}\"\n\
         resources:\n  api: { kind: rate, capacity: 5 }\n",
    );
    let run = |args: &[&str]| {
        let out = Command::new(usher_bin())
            .args(args)
            .env_remove("USHER_TEST_UNSET_POD")
            .env_remove("USHER_TEST_UNSET_NS")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let path = routes.to_str().unwrap();
    let (code, out, err) = run(&["check", path]);
    assert_eq!(code, Some(64), "{out}{err}");
    let want = format!("{path}:3:14: doorman.client_id: environment variable `USHER_TEST_UNSET_POD` is not set");
    assert!(err.contains(&want) && err.contains("--allow-unset-env"), "{err}");
    let (code, out, err) = run(&["check", "--allow-unset-env", path]);
    assert_eq!(code, Some(0), "{out}{err}");
    for want in [
        "  unset environment variables, checked as written: USHER_TEST_UNSET_POD, USHER_TEST_UNSET_NS",
        "  capacity from: the Doorman servers doorman-0:15100 as client `${USHER_TEST_UNSET_POD}-${USHER_TEST_UNSET_NS}` (a resource's capacity applies until its first lease)",
    ] {
        assert!(out.lines().any(|l| l == want), "missing {want:?} in:\n{out}");
    }
}

/// The shipped routes file leases ids that the shipped resources file
/// configures: each id, whatever its placeholders expand to, falls under a
/// template of its own, not the catch-all `*`; and a sidecar never first
/// asks more than the whole capacity its template holds.
#[test]
fn the_shipped_routes_ids_match_templates_of_the_shipped_resources_file() {
    use usher_core::config::resources::{CATCH_ALL, ResourcesConfig};
    use usher_core::config::routes::{RoutesConfig, Segment};
    let root = env!("CARGO_MANIFEST_DIR");
    let read = |f: &str| std::fs::read_to_string(format!("{root}/deploy/examples/{f}")).unwrap();
    let (routes, _) = RoutesConfig::parse_env("routes.yaml", &read("routes.yaml"), true).unwrap();
    let resources = ResourcesConfig::parse("resources.yaml", &read("resources.yaml")).unwrap();
    assert!(!routes.resources.is_empty());
    for r in routes.resources.values() {
        for sample in ["acme", "x", "tenant-42", "a.b"] {
            let id: String =
                r.id.segments
                    .iter()
                    .map(|s| match s {
                        Segment::Literal(l) => l.clone(),
                        _ => sample.to_string(),
                    })
                    .collect();
            let t = resources.find(&id).unwrap();
            assert_ne!(t.identifier_glob, CATCH_ALL, "{} (id {id}) falls to the catch-all", r.name);
            let first_wants = r.capacity.per_second();
            assert!(first_wants <= t.capacity, "{}: first wants {first_wants} over the whole {}", r.name, t.capacity);
        }
    }
    // GitHub's primary quota: 5,000 requests per hour per token.
    let gh = resources.find("github/acme").unwrap();
    assert!((gh.capacity - 5000.0 / 3600.0).abs() < 1e-9, "{}", gh.capacity);
    assert!((routes.resources["github-core"].capacity.per_second() - gh.capacity).abs() < 1e-9);
}

/// The LLM guide's resources and routes files, as a reader copies them,
/// pass `usher check`, and the routes charge an estimate settled from the
/// answer's usage.
#[test]
fn the_llm_guides_files_pass_check() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/guides/llm.md")).unwrap();
    let blocks: Vec<&str> =
        guide.split("```yaml\n").skip(1).map(|b| b.split("```").next().unwrap_or_default()).take(2).collect();
    assert_eq!(blocks.len(), 2, "the guide's first two YAML blocks: its resources and routes files");
    let dir = tempfile::tempdir().unwrap();
    let resources = write_file(dir.path(), "resources.yaml", blocks[0]);
    let routes = write_file(dir.path(), "routes.yaml", blocks[1]);
    let (code, out, err) =
        run_usher(&["check", "--allow-unset-env", routes.to_str().unwrap(), resources.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("routes.yaml: ok (routes file)") && out.contains("resources.yaml: ok (resources file)"),
        "{out}"
    );
    assert!(
        out.contains("route chat: resource llm-tokens costs an estimate of the openai call's tokens")
            && out.contains("settled from the answer's usage (openai, total tokens)"),
        "{out}"
    );
}

/// Runs `usher ARGS` with stdout on a pipe whose reader is already gone (as
/// behind `| head` once head has its lines): (how it ended, stderr).
fn with_stdout_gone(args: &[&str], patience: Duration) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let mut child = std::process::Command::new(support::usher_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn usher");
    let mut stderr = child.stderr.take().expect("piped");
    let deadline = std::time::Instant::now() + patience;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("usher {args:?} still ran {patience:?} after its stdout's reader went away");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = stderr.read_to_string(&mut err);
    (status, err)
}

#[test]
fn a_reader_that_stops_early_ends_check_and_sim_as_it_ends_cat() {
    use std::os::unix::process::ExitStatusExt;
    for args in [&["check", "deploy/examples/quickstart.yaml"][..], &["sim", "--scenario", "one", "--duration", "60s"]]
    {
        let (status, err) = with_stdout_gone(args, Duration::from_secs(60));
        assert_eq!(status.signal(), Some(libc::SIGPIPE), "usher {args:?}: {status:?}\n{err}");
        assert!(!err.contains("panicked"), "usher {args:?}:\n{err}");
    }
}

#[test]
fn a_reader_that_stops_early_ends_the_demo_at_once_and_cleanly() {
    let (status, err) = with_stdout_gone(&["demo", "--duration", "30s"], Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
