//! Fleets under their account's limits: usher must be invisible. Each app
//! calls through its own sidecar ([`crate::twins`]: the guide's files, the
//! account's full RPM and TPM, no burst given, `wants: auto`), and its twin
//! makes the same seeded calls straight at a twin account, at the same time.
//!
//! - Three replicas: 6,000 tokens and 120 requests a minute; a call costs
//!   about 210 tokens (15 to 105 of prompt, 50 to 250 of completion); apps
//!   at Poisson arrivals of 0.05, 0.10 and 0.20 calls a second, 73% of the
//!   TPM.
//! - Setup A: six replicas share 20,000 tokens and 60 requests a minute; a
//!   call costs 50 to 500 tokens (10 to 100 of prompt, 40 to 400 of
//!   completion, 275 on average); apps at Poisson arrivals totalling 75% of
//!   the TPM (91% of the RPM), split 1:1:2:2:3:5.
//!
//! 75% of the calls are streamed, as the SDK sends them. The bars: no
//! attempt through usher meets a 429 (usher's or the API's) and every call
//! is answered; latency ([`crate::latency`]: time to the first chunk of a
//! stream, to the whole answer otherwise) has a p50 within 0.1 s of the
//! direct run's and a p95 within 1 s; every app receives what the API sent.
//! The direct run meeting a 429 says the load is not under the account.

use crate::app::{AppCall, check_python};
use crate::fleet::{first, unaltered};
use crate::latency;
use crate::twins::{Account, Twins, failed, refusals, usher_refusals};

/// Seconds of arrivals.
const RUN: f64 = 180.0;

/// The three-replica account.
pub(crate) const SMALL: Account =
    Account { tpm: 6000.0, rpm: 120.0, completion: 50..=250, max_tokens: 250, prompt_chars: (60, 420) };

/// Setup A's account: 20,000 TPM and 60 RPM, calls of 50 to 500 tokens.
pub(crate) const SETUP_A: Account =
    Account { tpm: 20000.0, rpm: 60.0, completion: 40..=400, max_tokens: 400, prompt_chars: (40, 400) };

/// How Setup A's apps split the load.
pub(crate) const SETUP_A_WEIGHTS: [f64; 6] = [1.0, 1.0, 2.0, 2.0, 3.0, 5.0];

pub(crate) async fn three_replicas() {
    underload("u3-", &SMALL, &[0.05, 0.10, 0.20], 61).await
}

pub(crate) async fn setup_a() {
    underload("ua-", &SETUP_A, &SETUP_A.rates(0.75, &SETUP_A_WEIGHTS), 71).await
}

async fn underload(name: &str, account: &Account, rates: &[f64], seed: u64) {
    check_python().await;
    let twins = Twins::start(account, seed, rates.len()).await;
    let runs = twins.run(name, rates, RUN).await;
    let origin = runs.origin;
    let (via, direct): (Vec<AppCall>, Vec<AppCall>) = (runs.via.concat(), runs.direct.concat());
    let (api_seen, usher_seen) = refusals(&via);
    let api_429 = twins.api.refusals_since(0.0);
    let direct_429 = twins.direct.refusals_since(0.0);
    let (latency, mut missed) = latency::compare(&via, &direct, origin, (0.1, 1.0));
    let problems = unaltered(&via, &twins.api.calls());
    let offered = rates.iter().sum::<f64>() * 60.0;
    let minutes = twins.api.spend_by_minute(origin);
    let report = [
        format!(
            "{name}: {} sidecars, {} calls/s ({:.0}% of the TPM, {:.0}% of the RPM); routes: {}",
            rates.len(),
            rates.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(" "),
            100.0 * offered * account.mean_cost() / account.tpm,
            100.0 * offered / account.rpm,
            twins.variant()
        ),
        format!("429s through usher: {usher_seen} usher's, {api_seen} the API's ({api_429} at the API)"),
        format!("429s direct: {direct_429}"),
        first(&usher_refusals(&via, origin), 10),
        latency,
        format!("tokens at the API by minute: {:?}", minutes.iter().map(|m| m.total()).collect::<Vec<_>>()),
        twins.report_tail(&runs, &problems).await,
    ]
    .join("\n");
    eprintln!("{report}");
    if usher_seen + api_seen + api_429 > 0 {
        missed.push(format!("429s through usher: {usher_seen} usher's, {api_seen} the API's"));
    }
    if failed(&via) > 0 {
        missed.push(format!("{} calls through usher not answered", failed(&via)));
    }
    if !problems.is_empty() {
        missed.push(format!("{} calls received other than what they asked for", problems.len()));
    }
    if direct_429 > 0 {
        missed.push(format!("the direct run met {direct_429} 429s: the load is not under the account"));
    }
    assert!(missed.is_empty(), "missed: {missed:?}\n{report}\n{}", twins.fleet.logs());
}
