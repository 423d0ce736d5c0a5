//! What the scenarios share: the routes and resources files of `tests/llm/`
//! filled in, a capacity server and its sidecars, their metrics, and the
//! check that every app received what the stand-in sent.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;

use usher_test_support::llm::{Call, digest};
use usher_test_support::{Usher, free_port, http_get, write_file};

use crate::app::AppCall;

/// Runs blocking `f` (process starts, admin requests) off the runtime's
/// threads, which serve the stand-ins meanwhile.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// `tests/llm/NAME` with each `@KEY@` replaced by its value; panics if a
/// placeholder is left.
pub(crate) fn template(name: &str, vars: &[(&str, String)]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llm").join(name);
    let mut text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for (k, v) in vars {
        text = text.replace(&format!("@{k}@"), v);
    }
    let left: Vec<&str> = text.lines().filter(|l| l.split('#').next().unwrap().contains('@')).collect();
    assert!(left.is_empty(), "{name}: placeholders left: {left:?}");
    text
}

/// The same file for an API that sends no quota headers: its `upstream_quota` lines dropped.
pub(crate) fn without_quota(text: &str) -> String {
    text.lines().filter(|l| !l.contains("upstream_quota")).map(|l| format!("{l}\n")).collect()
}

/// A capacity server and its sidecars, each with its routes file; all
/// killed when dropped.
pub(crate) struct Fleet {
    pub(crate) server: Usher,
    pub(crate) sidecars: Vec<Usher>,
    /// Where the files and the apps' records are.
    pub(crate) dir: tempfile::TempDir,
}

impl Fleet {
    /// Starts `usher server` with `resources` (a file's text) and `n`
    /// sidecars, the `i`th with `routes(server address, i)`.
    pub(crate) async fn start(resources: String, n: usize, routes: impl Fn(String, usize) -> String) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let server_addr = format!("127.0.0.1:{port}");
        let files: Vec<_> = (0..n)
            .map(|i| write_file(dir.path(), &format!("routes-{i}.yaml"), &routes(server_addr.clone(), i)))
            .collect();
        let res = write_file(dir.path(), "resources.yaml", &resources);
        let (server, sidecars) = blocking(move || {
            let server = Usher::server_at(&res, port, &[]);
            let sidecars = files.iter().map(|f| Usher::proxy(f)).collect::<Vec<_>>();
            (server, sidecars)
        })
        .await;
        Fleet { server, sidecars, dir }
    }

    /// Sidecar `i`'s listener for upstream `llm`: the app's base address.
    pub(crate) fn listener(&self, i: usize) -> SocketAddr {
        self.sidecars[i].upstream_listener("llm")
    }

    /// `usher_proxy_settles_total` of `resource`, by outcome, summed over the sidecars.
    pub(crate) async fn settles(&self, resource: &str) -> BTreeMap<String, f64> {
        let admins: Vec<_> = self.sidecars.iter().map(|s| s.addr("admin")).collect();
        settles(admins, resource).await
    }

    /// `usher_proxy_resource_requests_total` of `resource` by outcome
    /// (admitted, paced, refused), summed over the sidecars.
    pub(crate) async fn admissions(&self, resource: &str) -> BTreeMap<String, f64> {
        let admins: Vec<_> = self.sidecars.iter().map(|s| s.addr("admin")).collect();
        counter_by_outcome(admins, "usher_proxy_resource_requests_total", resource).await
    }

    /// Each sidecar's log, for a failure's report.
    pub(crate) fn logs(&self) -> String {
        let mut out = format!("--- server\n{}\n", tail(&self.server.log(), 30));
        for (i, s) in self.sidecars.iter().enumerate() {
            out.push_str(&format!("--- sidecar {i}\n{}\n", tail(&s.log(), 30)));
        }
        out
    }
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `usher_proxy_settles_total` of `resource` by outcome, summed over the sidecars at `admins`.
pub(crate) async fn settles(admins: Vec<SocketAddr>, resource: &str) -> BTreeMap<String, f64> {
    counter_by_outcome(admins, "usher_proxy_settles_total", resource).await
}

/// Counter `metric` of `resource` by its `outcome` label, summed over the sidecars at `admins`.
pub(crate) async fn counter_by_outcome(admins: Vec<SocketAddr>, metric: &str, resource: &str) -> BTreeMap<String, f64> {
    let (prefix, resource) = (format!("{metric}{{"), format!("resource=\"{resource}\""));
    blocking(move || {
        let mut out = BTreeMap::new();
        for a in admins {
            let (code, text) = http_get(a, "/metrics");
            assert_eq!(code, 200, "{text}");
            for line in text.lines().filter(|l| l.starts_with(&prefix)) {
                let (series, value) = line.rsplit_once(' ').unwrap();
                if !series.contains(&resource) {
                    continue;
                }
                let outcome = series.split("outcome=\"").nth(1).and_then(|s| s.split('"').next()).unwrap_or("?");
                *out.entry(outcome.to_string()).or_insert(0.0) += value.parse::<f64>().unwrap();
            }
        }
        out
    })
    .await
}

/// The share of answers settled: `settled` over every outcome but
/// `status` (an error answer carries no usage to settle).
pub(crate) fn settled_share(outcomes: &BTreeMap<String, f64>) -> f64 {
    let answers: f64 = outcomes.iter().filter(|(k, _)| *k != "status").map(|(_, v)| v).sum();
    outcomes.get("settled").copied().unwrap_or(0.0) / answers.max(1.0)
}

/// What went wrong between what the stand-in sent and what the apps
/// received: for every call an app got a 200 for, the stand-in's 200 of the
/// same id must exist, and the app's bytes must be what it asked for (the
/// body as sent if it asked for usage, else as it would have been without),
/// and a chat stream must end with `[DONE]`; a call that did not ask for
/// usage must see no usage chunk and no chunk with empty `choices`.
pub(crate) fn unaltered(apps: &[AppCall], upstream: &[Call]) -> Vec<String> {
    let answered: HashMap<&str, &Call> =
        upstream.iter().filter(|c| c.status == 200).filter_map(|c| Some((c.id.as_deref()?, c))).collect();
    let mut problems = Vec::new();
    for a in apps {
        if !a.asked_usage && (a.usage_chunk || a.empty_choices) {
            problems.push(format!(
                "{}: a chunk it did not ask for (usage {}, empty choices {})",
                a.id, a.usage_chunk, a.empty_choices
            ));
        }
        if a.outcome != "ok" || a.status != Some(200) {
            continue;
        }
        let Some(up) = answered.get(a.id.as_str()) else {
            problems.push(format!("{}: answered 200 but the upstream has no 200 of it", a.id));
            continue;
        };
        let expected = if a.asked_usage { &up.sent } else { &up.plain };
        if a.digest != digest(expected) {
            problems.push(format!(
                "{}: {} bytes received, {} expected ({}streamed, asked for usage: {})",
                a.id,
                a.bytes,
                expected.len(),
                if a.streamed { "" } else { "not " },
                a.asked_usage
            ));
        }
        if a.streamed && up.endpoint == usher_test_support::llm::Endpoint::Chat && !a.done {
            problems.push(format!("{}: the stream did not end with [DONE]", a.id));
        }
    }
    problems
}

/// The bars every fleet scenario holds, missed or not: no 429 from the API
/// after the warm-up, and every app received what it asked for.
pub(crate) fn common_bars(late_429: usize, problems: &[String]) -> Vec<String> {
    let mut missed = Vec::new();
    if late_429 > 0 {
        missed.push(format!("{late_429} 429s from the API after the first minute"));
    }
    if !problems.is_empty() {
        missed.push(format!("{} calls received other than what they asked for", problems.len()));
    }
    missed
}

/// The report's line on what the apps received: the number of problems and the first ten.
pub(crate) fn problems_line(problems: &[String]) -> String {
    format!("what the apps received: {} problems\n{}", problems.len(), first(problems, 10))
}

/// The first `n` of `items`, and how many more, for reports.
pub(crate) fn first<T: std::fmt::Display>(items: &[T], n: usize) -> String {
    let mut s: Vec<String> = items.iter().take(n).map(|i| i.to_string()).collect();
    if items.len() > n {
        s.push(format!("... and {} more", items.len() - n));
    }
    s.join("\n")
}
