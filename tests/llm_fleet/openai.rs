//! Three apps share an OpenAI-like account of 6,000 tokens and 120 requests
//! a minute, refilled continuously. Each app offers 0.5 calls a second, 75%
//! of them streamed as the SDK streams by default (no `stream_options`),
//! prompts of 40 to 400 characters and `max_tokens: 250`: about 18,000
//! tokens a minute in all, three times the account. Each goes through its own
//! sidecar with `tests/llm/openai-routes.yaml` (tokens estimated on arrival,
//! settled from the answer's usage), leasing from one `usher server` with
//! `tests/llm/openai-resources.yaml`. Run with the API's quota headers (and
//! `upstream_quota` reading them) and without either.
//!
//! The bars, after the first minute (a warm-up): no 429 from the API; the
//! tokens at the API at least 90% of the TPM a minute together, and each
//! minute's between 85% and 105% (a call is up to 6% of the TPM). Over the whole
//! run: at least 99% of the answers settled; every app received exactly what
//! the API sent for its request as the app made it (a stream reaches
//! `[DONE]`; no usage chunk, no chunk with empty `choices`, no `"usage":null`
//! the app did not ask for).

use usher_test_support::llm::{LlmApi, LlmConfig};

use crate::app::{AppCall, AppSpec, check_python, outcomes, run_all};
use crate::fleet::{Fleet, common_bars, problems_line, settled_share, template, unaltered, without_quota};

const SIDECARS: usize = 3;
const TPM: f64 = 6000.0;
/// Seconds of arrivals: a minute's warm-up and two measured.
const RUN: f64 = 180.0;
const WARM_UP: f64 = 60.0;

pub(crate) async fn with_quota_headers() {
    three_apps(true).await
}

pub(crate) async fn without_quota_headers() {
    three_apps(false).await
}

async fn three_apps(headers: bool) {
    check_python().await;
    let api = LlmApi::openai(LlmConfig { quota_headers: headers, seed: 11, ..LlmConfig::default() }).await;
    let upstream = api.addr.to_string();
    let fleet = Fleet::start(template("openai-resources.yaml", &[]), SIDECARS, |server, i| {
        let vars = [("SERVER", server), ("CLIENT", format!("app-{i}")), ("UPSTREAM", upstream.clone())];
        let routes = template("openai-routes.yaml", &vars);
        if headers { routes } else { without_quota(&routes) }
    })
    .await;
    let specs = (0..SIDECARS)
        .map(|i| {
            let base = format!("http://{}/v1", fleet.listener(i));
            let name = format!("{}{i}", if headers { "h" } else { "n" });
            AppSpec { stream_share: 0.75, seed: i as u64 + 1, grace: 60.0, ..AppSpec::chat(base, &name, RUN) }
        })
        .collect();
    let (origin, per_app) = run_all(specs, fleet.dir.path()).await;
    let calls: Vec<AppCall> = per_app.concat();
    let minutes = api.spend_by_minute(origin);
    let late_429 = api.refusals_since(origin + WARM_UP);
    let all_429 = api.refusals_since(0.0);
    let settles = fleet.settles("llm-tokens").await;
    let problems = unaltered(&calls, &api.calls());
    let report = format!(
        "quota headers: {headers}\ntokens at the API by minute: {:?}\nAPI 429s: {late_429} after the first minute, \
         {all_429} in all\nsettles of llm-tokens: {settles:?} ({:.1}% settled)\napps: {}\n{}",
        minutes.iter().map(|m| m.total()).collect::<Vec<_>>(),
        100.0 * settled_share(&settles),
        outcomes(&per_app),
        problems_line(&problems)
    );
    eprintln!("{report}");
    let mut missed = common_bars(late_429, &problems);
    // The minutes after the first spend 90% of the TPM together, and each
    // 85% to 105%: a call is up to 6% of the TPM, and where a minute's
    // boundary falls moves the calls in flight between minutes.
    let after: Vec<f64> = (1..(RUN / 60.0) as usize).map(|m| minutes.get(m).map_or(0, |s| s.total()) as f64).collect();
    let total = after.iter().sum::<f64>();
    if total < 0.9 * TPM * after.len() as f64 {
        missed.push(format!("the minutes after the first spent {total} tokens, under 90% of {TPM} each"));
    }
    for (m, t) in after.iter().enumerate() {
        if !(0.85 * TPM..=1.05 * TPM).contains(t) {
            missed.push(format!("minute {} spent {t} tokens, outside 85%..105% of {TPM}", m + 1));
        }
    }
    if settled_share(&settles) < 0.99 {
        missed.push("under 99% of the answers settled".into());
    }
    assert!(missed.is_empty(), "missed: {missed:?}\n{report}\n{}", fleet.logs());
}
