//! Allocation under traffic as it really comes. A real `usher server` shares
//! a resource among real sidecars; real upstreams count what reaches them;
//! the apps' load takes the shapes real apps give it.
//!
//! - [`calendar`]: a calendar quota is spendable from the start of each UTC
//!   minute by apps that fire all at once when it begins.
//! - [`idle_fallback`]: idle sidecars cut off from every server for good run
//!   on their share, at lease lengths of 2, 20 and 60 s.
//! - [`cold_start`]: three sidecars starting together each have their share
//!   from the second second, under closed-loop and open-loop load.
//! - [`overload`]: apps that wait out each `Retry-After` and retry keep the
//!   fleet's capacity in use and each sidecar's share its own.
//!
//! Every 429 the apps get must carry a sane `Retry-After`: whole seconds, at
//! least 1, no later than the next renewal the sidecar can know of
//! ([`support::retry_after`]). Each test prints what it measured, and a
//! failure names the numbers.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

mod calendar;
mod cold_start;
mod idle_fallback;
mod overload;

use usher_test_support as support;

use std::path::Path;

use support::upstream::{Upstream, doorman, routes};
use support::{Usher, free_port, write_file};

/// A capacity server with the resources file `config`, on a port of its own.
fn server(dir: &Path, config: &str) -> (Usher, u16) {
    let port = free_port();
    (Usher::server_at(&write_file(dir, "resources.yaml", config), port, &[]), port)
}

/// One sidecar per upstream in `ups`, started together, leasing from the server on
/// `port` as `NAME-0`, `NAME-1`, ...; each routes every request to its
/// upstream through the resource `api`, described by `res` (indented YAML).
fn fleet(dir: &Path, port: u16, ups: &[&Upstream], name: &str, res: &str) -> Vec<Usher> {
    let files: Vec<_> = ups
        .iter()
        .enumerate()
        .map(|(i, up)| {
            let routes = routes(up, &doorman(port, &format!("{name}-{i}")), res);
            write_file(dir, &format!("{name}-{i}.yaml"), &routes)
        })
        .collect();
    Usher::proxies(&files)
}

/// What a sidecar's one key looks like on its status page, on one line.
fn key(sidecar: &Usher) -> String {
    let k = &sidecar.status()["lease"]["keys"][0];
    format!(
        "{{mode {} capacity {} has {} wants {:.1} safe {} refresh {}}}",
        k["mode"], k["capacity"], k["has"], k["wants"], k["safe_capacity"], k["refresh_interval_s"]
    )
}

/// Awaits every task. A task that panicked (a load that got a bad
/// `Retry-After`) gives its message instead of its value, so that the test
/// can report its numbers with it.
async fn join<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> (Vec<Option<T>>, Vec<String>) {
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    for t in tasks {
        match t.await {
            Ok(v) => done.push(Some(v)),
            Err(e) if e.is_panic() => {
                let p = e.into_panic();
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                failed.push(msg.unwrap_or_else(|| "a task panicked".into()));
                done.push(None);
            }
            Err(e) => panic!("{e}"),
        }
    }
    (done, failed)
}
