//! Apps: `tests/llm/app.py` processes, one per app, killed if dropped (a
//! scenario that panics takes its apps with it), and the calls they record.
//! Apps that run together start their arrivals together, once every one of
//! them says it has loaded: python and the SDKs take seconds to load, and
//! tens of them at once on a busy machine can take most of a minute.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The Python packages the apps need, as `.ci/test` installs them.
const PIP: &str = "python3 -m pip install openai==3.57.0 anthropic==2.14.0";

/// What an app does; `args` turns it into `app.py`'s command line.
#[derive(Clone, Debug)]
pub(crate) struct AppSpec {
    /// `chat`, `responses` or `messages`.
    pub(crate) api: &'static str,
    pub(crate) base_url: String,
    /// Prefixes its calls' `x-call-id`.
    pub(crate) name: String,
    pub(crate) model: &'static str,
    /// Calls a second, Poisson arrivals.
    pub(crate) rate: f64,
    /// Seconds of arrivals.
    pub(crate) duration: f64,
    /// At most this many calls.
    pub(crate) calls: u32,
    /// Unix time when its arrivals start: set by [`App::start`] (at once)
    /// or by [`run_together`] (once every app has loaded).
    pub(crate) start_at: f64,
    pub(crate) seed: u64,
    pub(crate) stream_share: f64,
    pub(crate) usage_share: f64,
    pub(crate) disconnect_share: f64,
    /// The output limit sent (0: none).
    pub(crate) max_tokens: u64,
    /// The prompt's length, in characters: least and most.
    pub(crate) prompt_chars: (u64, u64),
    /// `None`: the SDK's default (2).
    pub(crate) max_retries: Option<u32>,
    /// Seconds to wait for calls in flight after the last arrival.
    pub(crate) grace: f64,
    pub(crate) keep_bodies: bool,
}

impl AppSpec {
    /// An OpenAI chat app at 0.5 calls a second for `duration` seconds.
    pub(crate) fn chat(base_url: String, name: &str, duration: f64) -> Self {
        AppSpec {
            api: "chat",
            base_url,
            name: name.to_string(),
            model: "gpt-4o-mini",
            rate: 0.5,
            duration,
            calls: 10_000,
            start_at: 0.0,
            seed: 1,
            stream_share: 0.0,
            usage_share: 0.0,
            disconnect_share: 0.0,
            max_tokens: 250,
            prompt_chars: (40, 400),
            max_retries: None,
            grace: 30.0,
            keep_bodies: false,
        }
    }

    /// `start`: `--start-at`'s value, a Unix time or `stdin`.
    fn args(&self, out: &Path, start: String) -> Vec<String> {
        let mut a: Vec<String> = [
            ("--api", self.api.to_string()),
            ("--base-url", self.base_url.clone()),
            ("--out", out.display().to_string()),
            ("--name", self.name.clone()),
            ("--model", self.model.to_string()),
            ("--rate", self.rate.to_string()),
            ("--duration", self.duration.to_string()),
            ("--calls", self.calls.to_string()),
            ("--start-at", start),
            ("--seed", self.seed.to_string()),
            ("--stream-share", self.stream_share.to_string()),
            ("--usage-share", self.usage_share.to_string()),
            ("--disconnect-share", self.disconnect_share.to_string()),
            ("--max-tokens", self.max_tokens.to_string()),
            ("--prompt-chars", format!("{}:{}", self.prompt_chars.0, self.prompt_chars.1)),
            ("--grace", self.grace.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(n) = self.max_retries {
            a.extend(["--max-retries".to_string(), n.to_string()]);
        }
        if self.keep_bodies {
            a.push("--keep-bodies".into());
        }
        a
    }
}

/// One call as the app recorded it (see `tests/llm/app.py`).
#[derive(Clone, Debug, Deserialize)]
#[allow(dead_code, reason = "every field is printed in reports")]
pub(crate) struct AppCall {
    pub(crate) id: String,
    pub(crate) streamed: bool,
    pub(crate) asked_usage: bool,
    pub(crate) prompt_chars: u64,
    /// Events (chunks) the SDK handed the app.
    pub(crate) events: u64,
    /// A chunk carried a non-null `usage`.
    pub(crate) usage_chunk: bool,
    /// A chunk had empty `choices`.
    pub(crate) empty_choices: bool,
    /// The usage the app saw, if any.
    pub(crate) usage: Option<serde_json::Value>,
    pub(crate) start: f64,
    pub(crate) first_chunk: Option<f64>,
    pub(crate) end: f64,
    /// `ok`, `disconnected`, `http_error`, `timeout`, `connection_error`, `error`, `abandoned`.
    pub(crate) outcome: String,
    pub(crate) error: Option<String>,
    pub(crate) attempts: u32,
    pub(crate) statuses: Vec<u16>,
    /// The last attempt's status.
    pub(crate) status: Option<u16>,
    /// Each attempt answered 429, in order.
    #[serde(default)]
    pub(crate) refusals: Vec<Refusal>,
    /// The last attempt's body, as received: length, digest, and whether it ended with `data: [DONE]`.
    pub(crate) bytes: u64,
    pub(crate) digest: String,
    pub(crate) done: bool,
    pub(crate) body: Option<String>,
}

/// An attempt answered 429, as the app saw it.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Refusal {
    /// Its `retry-after` header, as sent.
    pub(crate) retry_after: Option<String>,
    /// usher sent it (it carries `ratelimit-policy`), not the API.
    pub(crate) usher: bool,
    /// Its body's first 400 bytes: who refused, and why.
    pub(crate) body: String,
}

/// A running app; killed when dropped.
pub(crate) struct App {
    child: tokio::process::Child,
    out: PathBuf,
    spec: AppSpec,
}

/// `tests/llm/app.py`, from the package root.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/llm/app.py")
}

/// Fails (never skips) when python3 cannot import the SDKs.
pub(crate) async fn check_python() {
    let out = tokio::process::Command::new("python3").args(["-c", "import openai, anthropic"]).output().await;
    match out {
        Err(e) => panic!("python3 is needed for the LLM fleet tests ({e}); then run `{PIP}`"),
        Ok(o) if !o.status.success() => {
            panic!("python3 lacks the LLM SDKs: run `{PIP}` (.ci/test does)\n{}", String::from_utf8_lossy(&o.stderr))
        }
        Ok(_) => {}
    }
}

impl App {
    /// Starts `spec`'s app at once, writing its calls under `dir`.
    pub(crate) fn start(mut spec: AppSpec, dir: &Path) -> App {
        spec.start_at = support_now();
        let start = format!("{:.3}", spec.start_at);
        Self::spawn(spec, dir, start, Stdio::null)
    }

    /// Starts `spec`'s app, writing its calls under `dir`; once loaded, it
    /// waits for [`App::go`].
    fn start_waiting(spec: AppSpec, dir: &Path) -> App {
        Self::spawn(spec, dir, "stdin".into(), Stdio::piped)
    }

    fn spawn(spec: AppSpec, dir: &Path, start: String, io: fn() -> Stdio) -> App {
        let out = dir.join(format!("{}.jsonl", spec.name));
        let child = tokio::process::Command::new("python3")
            .arg(script())
            .args(spec.args(&out, start))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(io())
            .stdout(io())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3");
        App { child, out, spec }
    }

    /// Waits (up to `patience`) until a waiting app has loaded python and its SDK.
    async fn ready(&mut self, patience: Duration) {
        let stdout = self.child.stdout.as_mut().expect("started waiting");
        let mut line = String::new();
        let read = tokio::time::timeout(patience, BufReader::new(stdout).read_line(&mut line)).await;
        match read {
            Ok(Ok(_)) if line.trim() == "ready" => {}
            Ok(r) => panic!("app {}: expected `ready`, got {line:?} ({r:?})", self.spec.name),
            Err(_) => panic!("app {} not ready after {patience:?}", self.spec.name),
        }
    }

    /// Starts a waiting app's arrivals at `at` (Unix seconds).
    async fn go(&mut self, at: f64) {
        self.spec.start_at = at;
        let stdin = self.child.stdin.as_mut().expect("started waiting");
        stdin.write_all(format!("{at:.3}\n").as_bytes()).await.expect("tell the app when to start");
        stdin.flush().await.expect("tell the app when to start");
    }

    /// Waits for the app to finish its run (its arrivals, its grace and a
    /// minute to spare), and reads its calls.
    pub(crate) async fn finish(mut self) -> Vec<AppCall> {
        let wait_for = self.spec.start_at - support_now() + self.spec.duration + self.spec.grace + 60.0;
        let status = tokio::time::timeout(Duration::from_secs_f64(wait_for.max(1.0)), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("app {} ran past its end", self.spec.name))
            .expect("wait for python3");
        assert!(status.success(), "app {} failed: {status}", self.spec.name);
        let text = std::fs::read_to_string(&self.out).unwrap_or_else(|e| panic!("{}: {e}", self.out.display()));
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", self.out.display())))
            .collect()
    }
}

fn support_now() -> f64 {
    usher_test_support::llm::unix_now()
}

/// Runs an app for each of `specs`, each writing under its directory: waits
/// until every one has loaded python and its SDK, then starts their
/// arrivals together at `when(now)`. That moment (Unix seconds), and each
/// one's calls.
pub(crate) async fn run_together(
    specs: Vec<(AppSpec, &Path)>,
    when: impl FnOnce(f64) -> f64,
) -> (f64, Vec<Vec<AppCall>>) {
    let mut apps: Vec<App> = specs.into_iter().map(|(s, dir)| App::start_waiting(s, dir)).collect();
    for a in &mut apps {
        a.ready(Duration::from_secs(120)).await;
    }
    let origin = when(support_now());
    for a in &mut apps {
        a.go(origin).await;
    }
    let mut calls = Vec::new();
    for a in apps {
        calls.push(a.finish().await);
    }
    (origin, calls)
}

/// Runs an app for each of `specs`, writing under `dir`, their arrivals
/// starting together two seconds after every one has loaded. That moment
/// (Unix seconds), and each one's calls.
pub(crate) async fn run_all(specs: Vec<AppSpec>, dir: &Path) -> (f64, Vec<Vec<AppCall>>) {
    run_together(specs.into_iter().map(|s| (s, dir)).collect(), |now| now + 2.0).await
}

/// Counts of each outcome and status, app by app, for reports:
/// `[ok/200: 40, http_error/429: 3] [ok/200: 38]`.
pub(crate) fn outcomes(per_app: &[Vec<AppCall>]) -> String {
    let one = |calls: &[AppCall]| {
        let mut counts = std::collections::BTreeMap::new();
        for c in calls {
            let status = c.status.map_or("-".into(), |s| s.to_string());
            *counts.entry(format!("{}/{status}", c.outcome)).or_insert(0) += 1;
        }
        counts.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
    };
    per_app.iter().map(|c| format!("[{}]", one(c))).collect::<Vec<_>>().join(" ")
}
