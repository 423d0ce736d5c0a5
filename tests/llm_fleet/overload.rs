//! Setup A's fleet ([`crate::underload::SETUP_A`]: six replicas, 20,000
//! tokens and 60 requests a minute, calls of 50 to 500 tokens, 75% streamed)
//! offered 1.7 times its TPM, split 1:1:2:2:3:5, by apps on the OpenAI SDK
//! with its default retries (2, honouring Retry-After). Their twins make the
//! same seeded calls straight at a twin account at the same time
//! ([`crate::twins`]): what the API's own limits give that load.
//!
//! 1.7 times the TPM is about 124 calls a minute, twice the RPM: the
//! account's requests run out before its tokens (60 calls of 275 tokens on
//! average are 82.5% of the TPM). So the spend bar takes whichever limit
//! binds: in every minute after the first, the API serves at least 95% of
//! its TPM or at least 95% of its RPM.
//!
//! The other bars: the API refuses no call; no more calls fail through usher
//! than direct; every 429 usher sends has a Retry-After of a whole number of
//! seconds, at least 1 and at most the lease's refresh interval (the
//! largest is reported); every app receives what the API sent.

use std::collections::BTreeMap;

use usher_test_support::llm::Spend;

use crate::app::{AppCall, check_python};
use crate::fleet::{first, unaltered};
use crate::twins::{Account, Twins, failed, refusals, usher_refusal_causes};
use crate::underload::{SETUP_A, SETUP_A_WEIGHTS};

/// Seconds of arrivals: a minute's warm-up and two measured.
const RUN: f64 = 180.0;
/// The resources' refresh interval, in seconds (`tests/llm/fleet-resources.yaml`).
const REFRESH_INTERVAL: u64 = 10;

pub(crate) async fn setup_a() {
    check_python().await;
    let account = &SETUP_A;
    let rates = account.rates(1.7, &SETUP_A_WEIGHTS);
    let twins = Twins::start(account, 81, rates.len()).await;
    let runs = twins.run("oa-", &rates, RUN).await;
    let origin = runs.origin;
    let (via, direct): (Vec<AppCall>, Vec<AppCall>) = (runs.via.concat(), runs.direct.concat());
    let (minutes, direct_minutes) = (twins.api.spend_by_minute(origin), twins.direct.spend_by_minute(origin));
    let api_429 = twins.api.refusals_since(0.0);
    let (api_seen, usher_seen) = refusals(&via);
    let (retry_afters, mut bad_retry_afters) = usher_retry_afters(&via);
    let out_of_range = retry_afters.iter().filter(|(s, _)| !(1..=REFRESH_INTERVAL).contains(*s));
    bad_retry_afters.extend(out_of_range.map(|(s, n)| format!("{s} s: {n} times")));
    let problems = unaltered(&via, &twins.api.calls());
    let report = [
        format!(
            "oa-: {} sidecars, {:.3} calls/s in all (1.7x the TPM, {:.0}% of the RPM); routes: {}",
            rates.len(),
            rates.iter().sum::<f64>(),
            100.0 * rates.iter().sum::<f64>() * 60.0 / account.rpm,
            twins.variant()
        ),
        format!("at the API by minute, through usher: {}", spent(&minutes)),
        format!("at the API by minute, direct: {}", spent(&direct_minutes)),
        format!(
            "429s at the API: {api_429} through usher (apps saw {api_seen}), {} direct",
            twins.direct.refusals_since(0.0)
        ),
        format!(
            "usher's 429s: {usher_seen}, Retry-After (s: count) {retry_afters:?}, largest {}",
            retry_afters.keys().next_back().map_or("none".to_string(), |s| format!("{s} s"))
        ),
        usher_refusal_causes(&via).iter().map(|(m, n)| format!("  {n}x {m}")).collect::<Vec<_>>().join("\n"),
        twins.report_tail(&runs, &problems).await,
    ]
    .join("\n");
    eprintln!("{report}");
    let mut missed = spend_bar(&minutes, account);
    if api_429 > 0 {
        missed.push(format!("the API refused {api_429} calls through usher"));
    }
    if failed(&via) > failed(&direct) {
        missed.push(format!("{} calls failed through usher, {} direct", failed(&via), failed(&direct)));
    }
    if !bad_retry_afters.is_empty() {
        missed.push(format!(
            "{} of usher's 429s had a Retry-After not a whole number of seconds in 1..={REFRESH_INTERVAL}: {}",
            bad_retry_afters.len(),
            first(&bad_retry_afters, 5)
        ));
    }
    if !problems.is_empty() {
        missed.push(format!("{} calls received other than what they asked for", problems.len()));
    }
    assert!(missed.is_empty(), "missed: {missed:?}\n{report}\n{}", twins.fleet.logs());
}

/// The spend bar: in every minute after the first, the API served at
/// least 95% of its TPM or of its RPM (whichever binds).
fn spend_bar(minutes: &[Spend], account: &Account) -> Vec<String> {
    let mut missed = Vec::new();
    for m in 1..(RUN / 60.0) as usize {
        let s = minutes.get(m).copied().unwrap_or_default();
        let (tokens, calls) = (s.total() as f64 / account.tpm, s.calls as f64 / account.rpm);
        if tokens.max(calls) < 0.95 {
            missed.push(format!(
                "minute {m} spent {:.1}% of the TPM and {:.1}% of the RPM, under 95% of either",
                100.0 * tokens,
                100.0 * calls
            ));
        }
    }
    missed
}

/// The spend of each minute, for reports.
fn spent(minutes: &[Spend]) -> String {
    minutes.iter().map(|s| format!("{} tokens in {} calls", s.total(), s.calls)).collect::<Vec<_>>().join(", ")
}

/// The Retry-After of usher's 429s: how many of each whole number of
/// seconds, and the values that are not one (with their call).
fn usher_retry_afters(calls: &[AppCall]) -> (BTreeMap<u64, usize>, Vec<String>) {
    let mut whole = BTreeMap::new();
    let mut other = Vec::new();
    for c in calls {
        for r in c.refusals.iter().filter(|r| r.usher) {
            let value = r.retry_after.as_deref().unwrap_or("");
            match value.bytes().all(|b| b.is_ascii_digit()).then(|| value.parse::<u64>().ok()).flatten() {
                Some(s) => *whole.entry(s).or_insert(0) += 1,
                None => other.push(format!("{}: {value:?}", c.id)),
            }
        }
    }
    (whole, other)
}
