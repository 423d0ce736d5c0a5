//! The chart's monitoring against a real Prometheus (Debian's `prometheus`):
//! it scrapes a real `usher server` and two sidecars under load, loads
//! charts/usher/files/prometheus-rules.yaml, and answers every expression of
//! the rules and of the Grafana dashboard with data. A panel or alert that
//! names a metric or a label that does not exist fails here.
//!
//! It also draws the dashboard's panels from that data into a PNG (the
//! README's picture): target/dashboard.png, or `$USHER_DASHBOARD_PNG`.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::load::{Tally, drive};
use support::upstream::Upstream;
use support::{Usher, free_port, http_get, write_file};
use usher_server::percent_encode;

const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/usher/files/prometheus-rules.yaml");
const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/usher/files/grafana-dashboard.json");
/// How long the sidecars run under load while Prometheus scrapes them;
/// `USHER_PROMETHEUS_LOAD_S` sets it (longer for the README's picture: the
/// dashboard's 1-minute rates need a minute of data to settle).
fn load_time() -> Duration {
    let s = std::env::var("USHER_PROMETHEUS_LOAD_S").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    Duration::from_secs(s)
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
}

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes `targets` (job, address, pod) every second and evaluates the rules every second.
    fn start(targets: &[(&str, SocketAddr, &str)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = format!(
            "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nrule_files: [\"{RULES}\"]\nscrape_configs:\n"
        );
        for (job, addr, pod) in targets {
            // The labels a PodMonitor gives: namespace and pod.
            cfg.push_str(&format!(
                "  - job_name: {job}-{pod}\n    static_configs: [{{ targets: [\"{addr}\"], labels: {{ namespace: test, pod: {pod} }} }}]\n"
            ));
        }
        let config = write_file(dir.path(), "prometheus.yml", &cfg);
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus is installed (Debian package prometheus; .ci/test installs it)");
        let p = Prometheus { child, addr, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(addr).is_err() || http_get(addr, "/-/ready").0 != 200 {
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    /// `/api/v1/query`: the result vector (an error answer fails the test).
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let (code, body) = http_get(self.addr, &format!("/api/v1/query?query={}", percent_encode(expr)));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        assert!(code == 200 && v["status"] == "success", "prometheus refused `{expr}`: {code} {body}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// `/api/v1/query_range` from `start` (Unix seconds) to now, one point a second:
    /// (legend, points with x in seconds since `start`).
    fn range(&self, expr: &str, start: f64, legend: &str) -> Vec<(String, Vec<(f64, f64)>)> {
        let end = unix_now();
        let path = format!("/api/v1/query_range?query={}&start={start}&end={end}&step=1", percent_encode(expr));
        let (_, body) = http_get(self.addr, &path);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let mut out = Vec::new();
        for s in v["data"]["result"].as_array().cloned().unwrap_or_default() {
            let mut name = legend.to_string();
            for (k, val) in s["metric"].as_object().cloned().unwrap_or_default() {
                name = name.replace(&format!("{{{{{k}}}}}"), val.as_str().unwrap_or(""));
            }
            let points = s["values"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|p| Some((p[0].as_f64()? - start, p[1].as_str()?.parse::<f64>().ok()?)))
                .filter(|(_, y)| y.is_finite())
                .collect();
            out.push((name, points));
        }
        out
    }
}

/// Every metric selector in a PromQL expression (`usher_…` or `usher:…`, with its matchers).
fn selectors(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("usher").map(|k| k + i) {
        let prev = if at == 0 { b' ' } else { b[at - 1] };
        let mut end = at;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_' || b[end] == b':') {
            end += 1;
        }
        if prev.is_ascii_alphanumeric() || prev == b'_' || prev == b'"' {
            i = end;
            continue;
        }
        if end < b.len() && b[end] == b'{' {
            end += expr[end..].find('}').unwrap() + 1;
        }
        out.push(expr[at..end].to_string());
        i = end;
    }
    out
}

/// A dashboard query as Grafana sends it with namespace `test` and every resource selected.
fn grafana(expr: &str) -> String {
    expr.replace("$namespace", "test").replace("$resource", ".*").replace("$__rate_interval", "1m")
}

#[test]
fn the_selector_parser_finds_every_metric() {
    assert_eq!(
        selectors("sum by (r) (rate(usher_proxy_x{a=~\"b|c\"}[1m])) / usher:y:rate1m unless usher_z == 1"),
        ["usher_proxy_x{a=~\"b|c\"}", "usher:y:rate1m", "usher_z"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_and_dashboard_expression_returns_data_from_a_real_prometheus() {
    let dir = tempfile::tempdir().unwrap();
    let resources = "resources:\n  - identifier_glob: '*'\n    capacity: 30\n    algorithm: { kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1, learning_mode_duration: 0 }\n";
    let server = Usher::server(&["--config", write_file(dir.path(), "r.yaml", resources).to_str().unwrap()]);
    let up = Upstream::start().await;
    let sidecar = |name: &str| {
        let routes = write_file(
            dir.path(),
            &format!("{name}.yaml"),
            &format!(
                "doorman:\n  servers: [\"{}\"]\n  client_id: {name}\n  min_interval: 200ms\n\
                 upstreams:\n  up: {{ url: \"http://{}\" }}\n\
                 resources:\n  api: {{ kind: rate, capacity: 40, burst: 4, wants: 40, max_wait: 200ms, on_expiry: safe, safe_capacity: 5 }}\n\
                 routes:\n  - {{ name: all, upstream: up, resources: [api] }}\n",
                server.addr("grpc"),
                up.addr
            ),
        );
        Usher::proxy(&routes)
    };
    let sidecars = [sidecar("app-0"), sidecar("app-1")];
    let prom = Prometheus::start(&[
        ("usher-server", server.addr("admin"), "root-0"),
        ("usher-sidecar", sidecars[0].addr("admin"), "app-0"),
        ("usher-sidecar", sidecars[1].addr("admin"), "app-1"),
    ]);

    // Each sidecar is offered 30/s against a tree capacity of 30/s for both:
    // some requests are paced, some refused.
    let tally = Arc::new(Tally::default());
    let started = unix_now();
    let load: Vec<_> =
        sidecars.iter().map(|s| tokio::spawn(drive(s.addr("listen"), 30.0, load_time(), tally.clone()))).collect();
    for l in load {
        l.await.unwrap();
    }
    eprintln!("load: {}", tally.summary());

    let rules: serde_json::Value = {
        let text = std::fs::read_to_string(RULES).unwrap();
        serde_yaml_like(&text)
    };
    let mut checked = 0;
    let mut missing = Vec::new();
    let mut check = |what: String, expr: &str, whole: bool| {
        let mut exprs = selectors(expr);
        if whole {
            exprs.push(expr.to_string());
        } else {
            // An alert's whole expression must at least evaluate.
            prom.query(expr);
        }
        for e in exprs {
            checked += 1;
            if prom.query(&e).is_empty() {
                missing.push(format!("{what}: `{e}` returns no data"));
            }
        }
    };
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            match rule["record"].as_str() {
                Some(name) => {
                    check(format!("recording rule {name}"), expr, true);
                    check(format!("recorded series {name}"), name, true);
                }
                None => check(format!("alert {}", rule["alert"].as_str().unwrap()), expr, false),
            }
        }
    }
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut panels = Vec::new();
    for p in dashboard["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = grafana(t["expr"].as_str().unwrap());
            check(format!("panel `{}`", p["title"].as_str().unwrap()), &expr, true);
        }
        if p["type"] != "row" {
            panels.push(p.clone());
        }
    }
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        let Some(q) = v["query"]["query"].as_str() else { continue };
        // label_values(SELECTOR, LABEL): the selector's series must carry the label.
        let inner = q.trim_start_matches("label_values(").trim_end_matches(')');
        let (sel, label) = inner.rsplit_once(',').unwrap();
        let series = prom.query(&grafana(sel.trim()));
        checked += 1;
        if !series.iter().any(|s| s["metric"].get(label.trim()).is_some()) {
            missing.push(format!("variable {}: no `{}` label on {sel}", v["name"], label.trim()));
        }
    }
    assert!(missing.is_empty(), "{} of {checked} queries found nothing:\n{}", missing.len(), missing.join("\n"));
    eprintln!("{checked} queries of the rules and the dashboard all returned data");

    // The dashboard's panels, drawn from what Prometheus holds.
    let colours = [[31, 119, 180], [214, 39, 40], [44, 160, 44], [255, 127, 14], [148, 103, 189], [140, 86, 75]];
    let drawn: Vec<usher::plot::Panel> = panels
        .iter()
        .map(|p| {
            let mut series = Vec::new();
            for t in p["targets"].as_array().unwrap() {
                let legend = t["legendFormat"].as_str().unwrap_or("");
                for (name, points) in prom.range(&grafana(t["expr"].as_str().unwrap()), started, legend) {
                    let rgb = colours[series.len() % colours.len()];
                    series.push(usher::plot::Series { name: name.trim().to_string(), rgb, points });
                }
            }
            usher::plot::Panel { title: p["title"].as_str().unwrap().to_string(), x_label: "t (s)".into(), series }
        })
        .collect();
    let out = std::env::var("USHER_DASHBOARD_PNG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/dashboard.png"));
    usher::plot::grid(&out, &drawn, 2).unwrap();
    eprintln!("dashboard drawn to {}", out.display());
}

/// The rules file as JSON (strings only: enough to read names and expressions).
fn serde_yaml_like(text: &str) -> serde_json::Value {
    use usher_core::config::yaml::{Node, Value, parse};
    fn conv(n: &Node) -> serde_json::Value {
        match &n.value {
            Value::Scalar(s, _) => serde_json::Value::String(s.clone()),
            Value::Seq(items) => items.iter().map(conv).collect(),
            Value::Map(entries) => {
                entries.iter().map(|(k, v)| (k.as_str().unwrap_or_default().to_string(), conv(v))).collect()
            }
        }
    }
    conv(&parse("prometheus-rules.yaml", text).expect("the rules file is valid YAML"))
}
