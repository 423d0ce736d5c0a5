//! A bad routes file at start: every error reported with its position, and
//! exit 64.

use usher_test_support as support;

use std::time::Duration;

use support::{run_usher, run_usher_for, write_file};

#[test]
fn a_bad_routes_file_reports_every_error_with_its_position_and_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_file(
        dir.path(),
        "routes.yaml",
        "\
upstreams:
  api: { url: \"ftp://nowhere\" }
resources:
  core:
    kind: rate
    capacity: 50/fortnight
    max_wiat: 1s
routes:
  - name: a
    upstream: apj
    resources: [core, missing]
",
    );
    let (code, _out, err) = run_usher(&["proxy", "--routes", bad.to_str().unwrap()]);
    assert_eq!(code, 64, "stderr:\n{err}");
    let f = bad.display().to_string();
    for want in [
        format!("{f}:2:15: upstreams.api.url:"),
        format!("{f}:6:15: resources.core.capacity: unknown unit `/fortnight`"),
        format!("{f}:7:5: resources.core.max_wiat: unknown field (hint: did you mean `max_wait`?)"),
        format!("{f}:10:15: routes[0].upstream: unknown upstream `apj` (hint: did you mean `api`?)"),
        format!("{f}:11:23: routes[0].resources[1]: unknown resource `missing`"),
    ] {
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }

    let (code, _out, err) = run_usher(&["proxy", "--routes", dir.path().join("absent.yaml").to_str().unwrap()]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("absent.yaml:1:1: cannot read routes file"), "{err}");
}

/// Two resources on one lease id would each enforce the whole lease: a
/// routes file with a fixed id twice, or with two templates that could make
/// the same id, is refused at start with its position and the field.
#[test]
fn two_resources_on_one_lease_id_exit_64_naming_the_second_id() {
    let dir = tempfile::tempdir().unwrap();
    let resources = |a: &str, b: &str| {
        format!(
            "upstreams:\n  api: {{ url: \"http://127.0.0.1:9\" }}\n\
             resources:\n  a:\n    kind: rate\n    capacity: 5/s\n    id: {a}\n  \
             b:\n    kind: gauge\n    capacity: 3\n    id: {b}\n\
             routes:\n  - {{ name: r, upstream: api, resources: [a, b] }}\n"
        )
    };
    for (file, text, want) in [
        (
            "fixed.yaml",
            resources("shared", "shared"),
            ":11:9: resources.b.id: id `shared` is already resource `a`'s \
             (hint: each resource leases its own id; routes can share one resource)",
        ),
        (
            "templated.yaml",
            resources("\"t/{header.x-tenant}\"", "\"t/{path.1}\""),
            ":11:9: resources.b.id: id `t/{path.1}` could make the same lease id as resource `a`'s id \
             `t/{header.x-tenant}` (hint: each resource leases its own ids: give the two literal prefixes \
             neither of which begins the other (e.g. `a/{header.x}` and `b/{header.x}`), or let the routes \
             share one resource)",
        ),
    ] {
        let path = write_file(dir.path(), file, &text);
        // Bounded: a file taken would have the proxy serve until killed.
        let (code, err) = run_usher_for(&["proxy", "--routes", path.to_str().unwrap()], &[], Duration::from_secs(20));
        assert_eq!(code, Some(64), "{file}: stderr:\n{err}");
        let want = format!("{}{want}", path.display());
        assert!(err.contains(&want), "{file}: missing {want:?} in:\n{err}");
    }
}
