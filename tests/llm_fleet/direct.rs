//! The harness itself, without usher: the apps call the stand-ins directly,
//! so every attempt an app makes reaches the stand-in, and what each side
//! records must pair up exactly: the statuses of each call's attempts, the
//! bytes of each answer, and the usage the app saw. Three chat apps offer
//! three times the account (as in [`crate::openai`]), so the API itself
//! refuses calls after the first minute and holds each minute near its TPM:
//! the numbers the fleet tests' bars are set against. A Responses API app
//! and an Anthropic app check the SDKs read those stand-ins' answers.

use std::collections::HashMap;

use usher_test_support::llm::{Call, Endpoint, LlmApi, LlmConfig, base_url};

use crate::app::{AppCall, AppSpec, check_python, outcomes, run_all};
use crate::fleet::{first, unaltered};

const TPM: f64 = 6000.0;
const RUN: f64 = 120.0;

pub(crate) async fn apps_and_stand_in_agree() {
    check_python().await;
    let chat = LlmApi::openai(LlmConfig { seed: 21, ..LlmConfig::default() }).await;
    let roomy = LlmConfig {
        tokens_per_min: 1e6,
        input_tokens_per_min: 1e6,
        output_tokens_per_min: 1e6,
        ..LlmConfig::default()
    };
    let responses = LlmApi::openai(roomy.clone()).await;
    let messages = LlmApi::anthropic(roomy).await;
    let dir = tempfile::tempdir().unwrap();
    let mut specs: Vec<AppSpec> = (0..3)
        .map(|i| AppSpec {
            stream_share: 0.75,
            usage_share: 0.2,
            seed: i + 1,
            grace: 60.0,
            ..AppSpec::chat(base_url(chat.addr, Endpoint::Chat), &format!("d{i}"), RUN)
        })
        .collect();
    let short = |api, base, name: &str| AppSpec {
        api,
        stream_share: 0.5,
        model: if api == "messages" { "claude-haiku-4-5" } else { "gpt-4o-mini" },
        ..AppSpec::chat(base, name, 30.0)
    };
    specs.push(short("responses", base_url(responses.addr, Endpoint::Responses), "r"));
    specs.push(short("messages", base_url(messages.addr, Endpoint::Messages), "m"));
    let (origin, per_app) = run_all(specs, dir.path()).await;
    let chat_calls: Vec<AppCall> = per_app[..3].concat();
    let mut problems = Vec::new();
    for (calls, api) in [(&chat_calls, &chat), (&per_app[3], &responses), (&per_app[4], &messages)] {
        let up = api.calls();
        problems.extend(unaltered(calls, &up));
        problems.extend(paired(calls, &up));
    }
    let minutes = chat.spend_by_minute(origin);
    let late_429 = chat.refusals_since(origin + 60.0);
    let retried = chat_calls.iter().filter(|c| c.attempts > 1).count();
    let report = format!(
        "tokens at the API by minute: {:?}\nAPI 429s after the first minute: {late_429}; calls the SDK retried: \
         {retried}\napps: {}\nproblems: {}\n{}",
        minutes.iter().map(|m| m.total()).collect::<Vec<_>>(),
        outcomes(&per_app),
        problems.len(),
        first(&problems, 10)
    );
    eprintln!("{report}");
    assert!(problems.is_empty(), "the apps and the stand-ins disagree\n{report}");
    assert!(late_429 > 0 && retried > 0, "three times the account offered, yet the API refused nothing\n{report}");
    let minute = minutes.get(1).map_or(0, |m| m.total()) as f64;
    assert!(
        (0.8 * TPM..=1.2 * TPM).contains(&minute),
        "the API's own bucket let {minute} through in a minute\n{report}"
    );
    // Those two APIs have room for every call.
    for (calls, n) in [(&per_app[3], "responses"), (&per_app[4], "messages")] {
        assert!(!calls.is_empty() && calls.iter().all(|c| c.outcome == "ok"), "{n}: calls failed\n{report}");
    }
}

/// Each call's attempts as the app saw them are the stand-in's answers to
/// that call, in order; and the usage the app saw is the stand-in's count.
fn paired(apps: &[AppCall], upstream: &[Call]) -> Vec<String> {
    let mut by_id: HashMap<&str, Vec<&Call>> = HashMap::new();
    for c in upstream {
        by_id.entry(c.id.as_deref().unwrap_or("")).or_default().push(c);
    }
    let mut problems = Vec::new();
    for a in apps {
        let seen: Vec<u16> = by_id.get(a.id.as_str()).map_or(Vec::new(), |v| v.iter().map(|c| c.status).collect());
        if seen != a.statuses {
            problems.push(format!("{}: the app saw {:?}, the stand-in answered {seen:?}", a.id, a.statuses));
            continue;
        }
        let (Some(usage), Some(up)) = (&a.usage, by_id.get(a.id.as_str()).and_then(|v| v.last())) else { continue };
        let n = |k: &str| usage[k].as_u64();
        let (input, output) = match (n("prompt_tokens"), n("input_tokens")) {
            (Some(p), _) => (Some(p), n("completion_tokens")),
            (None, i) => (i, n("output_tokens")),
        };
        if (input, output) != (Some(up.input_tokens), Some(up.output_tokens)) {
            problems.push(format!(
                "{}: the app saw usage {usage}, the stand-in counted {} in, {} out",
                a.id, up.input_tokens, up.output_tokens
            ));
        }
    }
    problems
}
