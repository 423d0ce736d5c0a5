//! A test harness that runs every selected test of a binary at once.
//!
//! Some test binaries hold scenarios that each take a minute or more of
//! wall-clock time and little CPU: real processes waiting for leases,
//! calendar boundaries or an upstream's window. libtest runs as many tests
//! at a time as the machine has cores (two on the CI machine), so such a
//! binary takes three or four times its longest test. A binary built with
//! `harness = false` and this `main` runs them all together, each on a
//! runtime of its own, on a thread of its own, as `#[tokio::test]` would:
//! it takes about as long as its longest test.
//!
//! Arguments are libtest's: words filter by name (`--exact` for whole
//! names), `--skip` leaves out, `--list` lists, `--ignored` runs only the
//! ignored tests and `--include-ignored` all. The output is libtest's:
//! `test NAME ... ok` per test and a `test result:` line.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Instant;

/// One test: its body, as an async function's future.
pub type Run = fn() -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where the tests' futures run.
#[derive(Clone, Copy, Debug)]
pub enum Runtime {
    /// Each test on a multi-thread runtime of its own with this many
    /// workers, on a thread of its own (as `#[tokio::test(flavor =
    /// "multi_thread", worker_threads = N)]`).
    PerTest(usize),
    /// Each test on a current-thread runtime of its own whose clock starts
    /// paused, on a thread of its own (as `#[tokio::test(start_paused =
    /// true)]`): tests in virtual time, whose outcome no load changes.
    PerTestPaused,
    /// All tests on one multi-thread runtime with this many workers, for
    /// tests that share what it serves.
    Shared(usize),
}

/// libtest's flags that take a value, whose value is not a filter.
const VALUED: &[&str] = &["--test-threads", "--skip", "--format", "--color", "--logfile", "-Z"];

/// The tests the arguments select, of `tests`; `ignored` names the tests
/// that run only with `--ignored` or `--include-ignored`, and why.
fn selected(args: &[String], tests: &[(&'static str, Run)], ignored: &[(&str, &str)]) -> Vec<(&'static str, Run)> {
    let exact = args.iter().any(|a| a == "--exact");
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--skip" {
            skips.extend(it.next().cloned());
        } else if VALUED.contains(&a.as_str()) {
            it.next();
        } else if !a.starts_with('-') {
            filters.push(a.clone());
        }
    }
    let hit = |name: &str, f: &String| if exact { name == f } else { name.contains(f.as_str()) };
    let is_ignored = |name: &str| ignored.iter().any(|(n, _)| *n == name);
    let (only_ignored, include) =
        (args.iter().any(|a| a == "--ignored"), args.iter().any(|a| a == "--include-ignored"));
    tests
        .iter()
        .filter(|(name, _)| include || is_ignored(name) == only_ignored)
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| hit(name, f)))
        .filter(|(name, _)| !skips.iter().any(|s| name.contains(s.as_str())))
        .copied()
        .collect()
}

/// What a panicking test said.
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().expect("a runtime")
}

fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().expect("a runtime")
}

/// Runs the selected tests of `tests` at once, on `rt`, and reports as
/// libtest does: the binary's `main`.
pub fn main(tests: &[(&'static str, Run)], ignored: &[(&str, &str)], rt: Runtime) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let chosen = selected(&args, tests, ignored);
    if args.iter().any(|a| a == "--list") {
        for (name, _) in &chosen {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    println!("\nrunning {} tests (at once)", chosen.len());
    if !args.iter().any(|a| a == "--ignored" || a == "--include-ignored") {
        for (name, why) in ignored {
            println!("test {name} ... ignored (run it with --ignored): {why}");
        }
    }
    let started = Instant::now();
    let report = |name: &str, r: &Result<(), String>| {
        println!("test {name} ... {}", if r.is_ok() { "ok" } else { "FAILED" });
    };
    let results: Vec<(&str, Result<(), String>)> = match rt {
        Runtime::PerTest(_) | Runtime::PerTestPaused => {
            let threads: Vec<_> = chosen
                .iter()
                .map(|&(name, run)| {
                    let make = move || match rt {
                        Runtime::PerTest(workers) => runtime(workers),
                        _ => paused(),
                    };
                    let thread = std::thread::Builder::new()
                        .name(name.to_string())
                        .spawn(move || make().block_on(run()))
                        .expect("a test thread");
                    (name, thread)
                })
                .collect();
            threads
                .into_iter()
                .map(|(name, thread)| {
                    let r = thread.join().map_err(panic_message);
                    report(name, &r);
                    (name, r)
                })
                .collect()
        }
        Runtime::Shared(workers) => runtime(workers).block_on(async {
            let tasks: Vec<_> = chosen.iter().map(|(name, run)| (*name, tokio::spawn(run()))).collect();
            let mut results = Vec::new();
            for (name, task) in tasks {
                let r =
                    task.await.map_err(|e| if e.is_panic() { panic_message(e.into_panic()) } else { e.to_string() });
                report(name, &r);
                results.push((name, r));
            }
            results
        }),
    };
    let failed: Vec<_> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| (n, e))).collect();
    if !failed.is_empty() {
        println!("\nfailures:\n");
        for (name, e) in &failed {
            println!("---- {name} ----\n{e}\n");
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed; finished in {:.1}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        results.len() - failed.len(),
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(101) }
}
