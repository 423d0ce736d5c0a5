//! The JSON status pages of a real sidecar and real servers (a root and an
//! intermediate) hold plain fields only (no enum-shaped objects such as
//! `{"Limited": 3.0}`) and exactly the fields docs/status.md documents.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;
use support::{Usher, http_get, write_file};

/// docs/status.md's tables: section heading → (field path → optional).
fn documented() -> BTreeMap<String, BTreeMap<String, bool>> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/status.md")).unwrap();
    let mut out: BTreeMap<String, BTreeMap<String, bool>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.to_string();
        } else if let Some(rest) = line.strip_prefix("| `") {
            let (path, rest) = rest.split_once('`').unwrap();
            let optional = rest.contains("(only when set)");
            out.entry(section.clone()).or_default().insert(path.to_string(), optional);
        }
    }
    out
}

/// Every field path of `v` (`keys[].demand.rate`), and the paths of the
/// objects among them (whose fields can be checked), failing on an object
/// key shaped like an enum variant.
fn walk(v: &Value, path: &str, fields: &mut BTreeSet<String>, objects: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            objects.insert(path.to_string());
            for (k, child) in m {
                assert!(!k.starts_with(|c: char| c.is_ascii_uppercase()), "an enum-shaped object at {path}: {v}");
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                fields.insert(p.clone());
                walk(child, &p, fields, objects);
            }
        }
        Value::Array(items) => {
            for item in items {
                walk(item, &format!("{path}[]"), fields, objects);
            }
        }
        _ => {}
    }
}

/// The parent path of a field path: `keys[].demand` for `keys[].demand.rate`, `` for `keys`.
fn parent(path: &str) -> &str {
    path.rfind('.').map_or("", |i| &path[..i])
}

fn check(section: &str, pages: &[Value]) {
    let docs = documented();
    let doc = docs.get(section).unwrap_or_else(|| panic!("docs/status.md has no section `{section}`"));
    let (mut fields, mut objects) = (BTreeSet::new(), BTreeSet::new());
    for page in pages {
        walk(page, "", &mut fields, &mut objects);
    }
    for f in &fields {
        assert!(doc.contains_key(f), "`{f}` is not documented in docs/status.md, section `{section}`");
    }
    for (f, optional) in doc {
        if !optional && objects.contains(parent(f)) {
            assert!(fields.contains(f), "docs/status.md documents `{f}` ({section}), the page has no such field");
        }
    }
}

/// The capacity cell of the first `kind` row (`Rate`, `Gauge`) of a sidecar's
/// HTML keys table: `11.111/s`, `3 in flight`.
fn capacity_cell<'a>(html: &'a str, kind: &str) -> &'a str {
    let row = format!("<td>{kind}</td><td>");
    let from = html.find(&row).unwrap_or_else(|| panic!("no {kind} key on the page:\n{html}")) + row.len();
    &html[from..from + html[from..].find("</td>").unwrap()]
}

fn json(addr: std::net::SocketAddr, path: &str) -> Value {
    let (code, body) = http_get(addr, path);
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn status_pages_have_plain_fields_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let root = Usher::server(&["--min-request-interval", "0s"]);
    let root_grpc = root.addr("grpc").to_string();
    let middle = Usher::server(&["--min-request-interval", "0s", "--parent", &root_grpc]);
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "doorman:\n  servers: [\"{}\"]\n  client_id: status-json\n\
             upstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: 600/min, wants: 7.5 }}\n\
             \x20 conc: {{ kind: gauge, capacity: 3 }}\n\
             routes:\n  - {{ name: all, upstream: up, resources: [api, conc] }}\n",
            middle.addr("grpc")
        ),
    );
    let p = Usher::proxy(&routes);
    let leased = |v: &Value| {
        v["lease"]["keys"].as_array().is_some_and(|ks| ks.len() == 2 && ks.iter().all(|k| k["mode"] == "leased"))
    };
    assert_eventually!(
        leased(&json(p.addr("admin"), "/debug/status?format=json")),
        Duration::from_secs(20),
        "the sidecar holds both leases"
    );
    let sidecar = json(p.addr("admin"), "/debug/status?format=json");
    let api = sidecar["keys"].as_array().unwrap().iter().find(|k| k["id"] == "api").unwrap().clone();
    let lease = sidecar["lease"]["keys"].as_array().unwrap().iter().find(|k| k["resource_id"] == "api").unwrap();
    assert_eq!(lease["wants"].as_f64(), Some(7.5), "a plain number: {sidecar}");
    // Below the capacity the lease carries spare capacity beside the 7.5 it
    // wants: at least that, never more than the built-in default's 100.
    let leased = lease["capacity"].as_f64().unwrap_or_else(|| panic!("a plain number: {sidecar}"));
    assert!((7.5..=100.0).contains(&leased), "the sidecar's lease of the root's 100: {sidecar}");
    assert_eq!(
        (api["capacity"].as_f64(), &api["unit"]),
        (Some(leased), &Value::from("per_second")),
        "the limiter enforces the lease: {sidecar}"
    );
    check("Sidecar: `usher proxy`, `/debug/status?format=json`", &[sidecar]);
    let (_, html) = http_get(p.addr("admin"), "/debug/status");
    assert!(html.contains("<td>7.500/s</td>"), "the wants with its unit:\n{html}");
    // The leases may have grown since the JSON page: the capacities' units, not their values.
    let number = |cell: &str, unit: &str| cell.strip_suffix(unit).is_some_and(|n| n.parse::<f64>().is_ok());
    assert!(number(capacity_cell(&html, "Rate"), "/s"), "units on the page:\n{html}");
    assert!(number(capacity_cell(&html, "Gauge"), " in flight"), "units on the page:\n{html}");

    assert_eventually!(
        json(root.addr("admin"), "/debug/resources?resource=api&format=json")["leases"][0]["kind"] == "server",
        Duration::from_secs(20),
        "the intermediate leases from the root"
    );
    let servers = [
        json(root.addr("admin"), "/debug/status?format=json"),
        json(middle.addr("admin"), "/debug/status?format=json"),
    ];
    assert_eq!(servers[1]["role"], "intermediate", "{}", servers[1]);
    assert_eq!(servers[0]["capacity_unit"], "per_second");
    check("Server: `usher server`, `/debug/status?format=json`", &servers);
    let (_, html) = http_get(middle.addr("admin"), "/debug/status");
    assert!(html.contains("<td>7.500/s</td>"), "units on the page:\n{html}");
    let leases = [
        json(root.addr("admin"), "/debug/resources?resource=api&format=json"),
        json(middle.addr("admin"), "/debug/resources?resource=api&format=json"),
    ];
    check("Server: one resource's leases, `/debug/resources?resource=ID&format=json`", &leases);
}
