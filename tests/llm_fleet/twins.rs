//! The guide's fleet and its twin: an OpenAI-like account behind a capacity
//! server and one sidecar per app, with the files of `tests/llm/` as
//! docs/guides/llm.md has a user write them (`fleet-resources.yaml`,
//! `fleet-routes.yaml`), and a second account with the same limits and seed
//! that the same seeded apps call directly, at the same time. What the
//! direct apps meet is what the API alone gives that load: the figures the
//! fleet is measured against, taken on the same machine in the same minutes.
//!
//! Set `USHER_LLM_FLEET_FIXED_COST=1` to run the routes with what a sidecar
//! without the OpenAI dialect accepts: each call charged the account's mean
//! cost and settled from `usage.total_tokens` of whole answers (a stream
//! keeps its charge).

use std::ops::RangeInclusive;
use std::time::Duration;

use usher_test_support::llm::{Endpoint, LlmApi, LlmConfig, base_url};

use crate::app::{AppCall, AppSpec, outcomes, run_together};
use crate::fleet::{Fleet, problems_line, template};
use crate::leases::Sampler;

/// The routes' OpenAI-dialect token rule, and what the fixed-cost variant puts in its place.
const DIALECT_RULE: &str = "cost: { estimate: openai }, settle: { usage: openai }";
const FIXED_COST_VAR: &str = "USHER_LLM_FLEET_FIXED_COST";

/// An account's limits and the calls its apps make.
pub(crate) struct Account {
    pub(crate) tpm: f64,
    pub(crate) rpm: f64,
    /// Output tokens a call draws from.
    pub(crate) completion: RangeInclusive<u64>,
    /// The `max_tokens` each call sends: at least the completion's largest, so none is cut.
    pub(crate) max_tokens: u64,
    /// The prompt's length in characters (a token is 4): least and most.
    pub(crate) prompt_chars: (u64, u64),
}

impl Account {
    /// A call's mean real cost: its prompt's tokens (characters ÷ 4,
    /// rounded up) and its completion's, each uniform over its range.
    pub(crate) fn mean_cost(&self) -> f64 {
        let (lo, hi) = self.prompt_chars;
        let prompt = (lo..=hi).map(|c| c.div_ceil(4) as f64).sum::<f64>() / (hi - lo + 1) as f64;
        prompt + (*self.completion.start() + *self.completion.end()) as f64 / 2.0
    }

    /// Calls a second per app, offering `share` of the TPM in all, split by `weights`.
    pub(crate) fn rates(&self, share: f64, weights: &[f64]) -> Vec<f64> {
        let calls_per_s = share * self.tpm / self.mean_cost() / 60.0;
        let sum: f64 = weights.iter().sum();
        weights.iter().map(|w| calls_per_s * w / sum).collect()
    }

    fn config(&self, seed: u64) -> LlmConfig {
        LlmConfig {
            seed,
            completion: self.completion.clone(),
            requests_per_min: self.rpm,
            tokens_per_min: self.tpm,
            ..LlmConfig::default()
        }
    }
}

/// The fleet, the account behind it, and the twin account the same apps call directly.
pub(crate) struct Twins {
    pub(crate) fleet: Fleet,
    /// The account behind the fleet.
    pub(crate) api: LlmApi,
    /// The twin: same limits, same seed, no usher.
    pub(crate) direct: LlmApi,
    direct_dir: tempfile::TempDir,
    mean_cost: f64,
    prompt_chars: (u64, u64),
    max_tokens: u64,
}

/// What the apps recorded: through the fleet and direct, app by app.
pub(crate) struct Runs {
    /// When the arrivals started, Unix seconds.
    pub(crate) origin: f64,
    pub(crate) via: Vec<Vec<AppCall>>,
    pub(crate) direct: Vec<Vec<AppCall>>,
    /// The sidecars' keys over the run ([`crate::leases`]), for reports.
    pub(crate) keys: String,
}

impl Twins {
    /// Starts both accounts, the capacity server and `sidecars` sidecars.
    pub(crate) async fn start(account: &Account, seed: u64, sidecars: usize) -> Twins {
        let api = LlmApi::openai(account.config(seed)).await;
        let direct = LlmApi::openai(account.config(seed)).await;
        let limits = [("RPM", account.rpm.to_string()), ("TPM", account.tpm.to_string())];
        let upstream = api.addr.to_string();
        let mean_cost = account.mean_cost();
        let fleet = Fleet::start(template("fleet-resources.yaml", &limits), sidecars, |server, i| {
            let mut vars = vec![("SERVER", server), ("CLIENT", format!("app-{i}")), ("UPSTREAM", upstream.clone())];
            vars.extend(limits.iter().cloned());
            routes_variant(&template("fleet-routes.yaml", &vars), mean_cost)
        })
        .await;
        Twins {
            fleet,
            api,
            direct,
            direct_dir: tempfile::tempdir().unwrap(),
            mean_cost,
            prompt_chars: account.prompt_chars,
            max_tokens: account.max_tokens,
        }
    }

    /// Runs an app at each of `rates` (calls a second, 75% of them
    /// streamed, the SDK's default retries) through sidecar `i`, and its
    /// twin (same name, same seed) directly, for `run` seconds of arrivals
    /// that start together once every app has loaded; reads the sidecars'
    /// keys meanwhile.
    pub(crate) async fn run(&self, name: &str, rates: &[f64], run: f64) -> Runs {
        let spec = |i: usize, base: String| AppSpec {
            stream_share: 0.75,
            rate: rates[i],
            seed: i as u64 + 1,
            max_tokens: self.max_tokens,
            prompt_chars: self.prompt_chars,
            grace: 60.0,
            ..AppSpec::chat(base, &format!("{name}{i}"), run)
        };
        let n = rates.len();
        let via = (0..n).map(|i| (spec(i, format!("http://{}/v1", self.fleet.listener(i))), self.fleet.dir.path()));
        let direct = (0..n).map(|i| (spec(i, base_url(self.direct.addr, Endpoint::Chat)), self.direct_dir.path()));
        let admins = self.fleet.sidecars.iter().map(|s| s.addr("admin")).collect();
        let sampler = Sampler::start(admins, Duration::from_secs(10));
        let (origin, mut via) = run_together(via.chain(direct).collect(), |now| now + 2.0).await;
        let direct = via.split_off(n);
        Runs { origin, via, direct, keys: sampler.finish(origin).await }
    }

    /// The sidecars' admissions of each resource by outcome, for reports.
    async fn admissions(&self) -> String {
        let mut parts = Vec::new();
        for r in ["llm-requests", "llm-tokens"] {
            parts.push(format!("{r} {:?}", self.fleet.admissions(r).await));
        }
        format!("sidecars' admissions: {}", parts.join("; "))
    }

    /// The lines a report ends with: failed calls, the sidecars'
    /// admissions and keys, each app's outcomes, and what the apps received
    /// (`problems`, from [`crate::fleet::unaltered`]).
    pub(crate) async fn report_tail(&self, runs: &Runs, problems: &[String]) -> String {
        let (via, direct) = (runs.via.concat(), runs.direct.concat());
        [
            format!("failed calls: {} through usher, {} direct", failed(&via), failed(&direct)),
            self.admissions().await,
            runs.keys.clone(),
            format!("apps through usher: {}\napps direct: {}", outcomes(&runs.via), outcomes(&runs.direct)),
            problems_line(problems),
        ]
        .join("\n")
    }

    /// Which token rule the sidecars run, for reports.
    pub(crate) fn variant(&self) -> String {
        if fixed_cost() {
            format!("fixed cost {:.0}, settled from usage.total_tokens", self.mean_cost.round())
        } else {
            DIALECT_RULE.to_string()
        }
    }
}

fn fixed_cost() -> bool {
    std::env::var_os(FIXED_COST_VAR).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The routes as written, or with the fixed-cost variant's token rule.
fn routes_variant(routes: &str, mean_cost: f64) -> String {
    if !fixed_cost() {
        return routes.to_string();
    }
    assert!(routes.contains(DIALECT_RULE), "fleet-routes.yaml no longer has `{DIALECT_RULE}`");
    let rule = format!("cost: {:.0}, settle: {{ response_json: usage.total_tokens }}", mean_cost.round());
    routes.replace(DIALECT_RULE, &rule)
}

/// Attempts answered 429 by the API and by usher, over `calls`.
pub(crate) fn refusals(calls: &[AppCall]) -> (usize, usize) {
    let all = calls.iter().flat_map(|c| &c.refusals);
    all.fold((0, 0), |(api, usher), r| if r.usher { (api, usher + 1) } else { (api + 1, usher) })
}

/// Calls that did not end in an answer.
pub(crate) fn failed(calls: &[AppCall]) -> usize {
    calls.iter().filter(|c| c.outcome != "ok").count()
}

/// usher's 429s, one line each: the call, when it started (seconds from
/// `origin`), and usher's message (which resource, and why).
pub(crate) fn usher_refusals(calls: &[AppCall], origin: f64) -> Vec<String> {
    let mut lines = Vec::new();
    for c in calls {
        for r in c.refusals.iter().filter(|r| r.usher) {
            let body: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
            let message = body["error"]["message"].as_str().unwrap_or(&r.body);
            lines.push(format!("{} at +{:.1} s: {message}", c.id, c.start - origin));
        }
    }
    lines
}

/// usher's 429s by cause: their messages with every number written `N`, and how many of each.
pub(crate) fn usher_refusal_causes(calls: &[AppCall]) -> std::collections::BTreeMap<String, usize> {
    let mut causes = std::collections::BTreeMap::new();
    for line in usher_refusals(calls, 0.0) {
        let message = line.split_once(": ").map_or(line.as_str(), |(_, m)| m);
        let mut key = String::new();
        for ch in message.chars() {
            if !ch.is_ascii_digit() {
                key.push(ch);
            } else if !key.ends_with('N') {
                key.push('N');
            }
        }
        *causes.entry(key).or_insert(0) += 1;
    }
    causes
}
