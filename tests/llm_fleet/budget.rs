//! A daily budget in dollars. Three apps call an OpenAI-like API (whose own
//! limits are out of the way) through sidecars with
//! `tests/llm/budget-routes.yaml`: `llm-usd`, $1 a UTC day (`window:
//! calendar` in the server's `tests/llm/budget-resources.yaml`), each
//! call charged $0.05 on arrival and settled at its price from its usage
//! ($30 per million input tokens, $60 per million output). A call costs
//! about a cent and at most $0.018 (100 input tokens, 250 output); the apps
//! offer 1.5 calls a second together, about $1 a minute, for two minutes.
//!
//! The bars, with each call priced from the API's count of its tokens: the
//! fleet's spend in a UTC day never exceeds the budget plus one call's
//! largest price per sidecar (what docs/guides/llm.md promises: each
//! sidecar may start one call its allotment does not cover), and the fleet spends at least 80% of the budget (the
//! quota is spendable from the start of the day, so two minutes of this
//! load spend it). A run that would straddle a UTC midnight starts just
//! after it.

use std::collections::BTreeMap;

use usher_test_support::llm::{Call, LlmApi, LlmConfig};

use crate::app::{AppSpec, check_python, outcomes, run_together};
use crate::fleet::{Fleet, settled_share, template};

const SIDECARS: usize = 3;
const RUN: f64 = 120.0;
/// The budget: dollars a UTC day.
const DOLLARS: f64 = 1.0;
const INPUT_PER_TOKEN: f64 = 30.0 / 1e6;
const OUTPUT_PER_TOKEN: f64 = 60.0 / 1e6;
/// The largest price of a call: 400 characters of prompt and `max_tokens: 250`.
const WORST_CALL: f64 = 100.0 * INPUT_PER_TOKEN + 250.0 * OUTPUT_PER_TOKEN;

fn price(c: &Call) -> f64 {
    c.input_tokens as f64 * INPUT_PER_TOKEN + c.output_tokens as f64 * OUTPUT_PER_TOKEN
}

pub(crate) async fn daily_dollars() {
    check_python().await;
    let roomy = LlmConfig { seed: 41, tokens_per_min: 1e6, requests_per_min: 1e4, ..LlmConfig::default() };
    let api = LlmApi::openai(roomy).await;
    let upstream = api.addr.to_string();
    let dollars = ("DOLLARS", DOLLARS.to_string());
    let fleet =
        Fleet::start(template("budget-resources.yaml", std::slice::from_ref(&dollars)), SIDECARS, |server, i| {
            let vars =
                [("SERVER", server), ("CLIENT", format!("app-{i}")), ("UPSTREAM", upstream.clone()), dollars.clone()];
            template("budget-routes.yaml", &vars)
        })
        .await;
    let specs: Vec<_> = (0..SIDECARS)
        .map(|i| {
            let base = format!("http://{}/v1", fleet.listener(i));
            AppSpec { stream_share: 0.75, seed: i as u64 + 1, ..AppSpec::chat(base, &format!("b{i}"), RUN) }
        })
        .collect();
    // A run that a UTC midnight cuts in two would spend two budgets, each in
    // part: near midnight, the apps start just after it.
    let day = |t: f64| (t / 86_400.0) as u64;
    let when = |now: f64| {
        let origin = now + 2.0;
        if day(origin) == day(origin + RUN + 10.0) { origin } else { (day(origin) + 1) as f64 * 86_400.0 + 1.0 }
    };
    let (_, per_app) = run_together(specs.into_iter().map(|s| (s, fleet.dir.path())).collect(), when).await;
    // Dollars spent by UTC day, by when each answer ended.
    let mut days: BTreeMap<u64, f64> = BTreeMap::new();
    for c in api.calls().iter().filter(|c| c.status == 200) {
        *days.entry((c.finished.unwrap_or(c.arrived) / 86_400.0) as u64).or_default() += price(c);
    }
    let settles = fleet.settles("llm-usd").await;
    let most = days.values().copied().fold(0.0, f64::max);
    let report = format!(
        "dollars spent by UTC day: {days:?} (budget {DOLLARS}, a call at most {WORST_CALL:.4})\nsettles of llm-usd: \
         {settles:?} ({:.1}% settled)\napps: {}",
        100.0 * settled_share(&settles),
        outcomes(&per_app)
    );
    eprintln!("{report}");
    let mut missed = Vec::new();
    for (day, spent) in &days {
        if *spent > DOLLARS + SIDECARS as f64 * WORST_CALL {
            missed.push(format!("day {day} spent ${spent:.4}, over the budget and one call per sidecar"));
        }
    }
    if most < 0.8 * DOLLARS {
        missed.push(format!("the fleet spent ${most:.4}, under 80% of the budget"));
    }
    assert!(missed.is_empty(), "missed: {missed:?}\n{report}\n{}", fleet.logs());
}
