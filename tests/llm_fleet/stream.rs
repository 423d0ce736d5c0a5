//! Single calls through one sidecar (`tests/llm/solo-routes.yaml`, embedded
//! mode) whose token bucket refills next to nothing, so its `remaining` on
//! the status page shows what each call was charged in the end.
//!
//! - An app that leaves a stream after two events: the sidecar reads the
//!   answer on to its end, and the key is charged the call's real usage,
//!   counted `outcome="client_gone"`.
//! - An app that asks for usage itself (`stream_options.include_usage`)
//!   gets the usage chunk, and every byte the API sent.
//! - Every API shape (chat completions, the Responses API, Anthropic's
//!   messages; whole and streamed) settles at its real usage, and the app
//!   gets what it would have got without usher.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use usher_test_support::llm::{Call, LlmApi, LlmConfig, digest};
use usher_test_support::{Usher, http_get, write_file};

use crate::app::{App, AppCall, AppSpec, check_python};
use crate::fleet::{blocking, settles, template, unaltered};

/// The sidecar, the two APIs behind it, and where the apps write.
struct Solo {
    sidecar: Usher,
    openai: LlmApi,
    anthropic: LlmApi,
    dir: tempfile::TempDir,
}

impl Solo {
    /// Streams one event every `every`, 100 to 120 output tokens a call.
    async fn start(every: Duration) -> Solo {
        check_python().await;
        let cfg = LlmConfig { chunk_every: every, completion: 100..=120, seed: 51, ..LlmConfig::default() };
        let (openai, anthropic) = (LlmApi::openai(cfg.clone()).await, LlmApi::anthropic(cfg).await);
        let vars = [("OPENAI", openai.addr.to_string()), ("ANTHROPIC", anthropic.addr.to_string())];
        let dir = tempfile::tempdir().unwrap();
        let routes = write_file(dir.path(), "routes.yaml", &template("solo-routes.yaml", &vars));
        let sidecar = blocking(move || Usher::proxy(&routes)).await;
        Solo { sidecar, openai, anthropic, dir }
    }

    /// The llm-tokens key's `remaining` on the status page.
    async fn remaining(&self) -> i64 {
        let admin = self.sidecar.addr("admin");
        let (code, body) = blocking(move || http_get(admin, "/debug/status?format=json")).await;
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys = v["keys"].as_array().cloned().unwrap_or_default();
        let key =
            keys.iter().find(|k| k["resource"] == "llm-tokens").unwrap_or_else(|| panic!("no llm-tokens key: {v}"));
        // Whole units, as an app could spend them (the page shows fractions too).
        key["remaining"].as_f64().map(|r| r.floor() as i64).unwrap_or_else(|| panic!("{key}"))
    }

    async fn settles(&self) -> BTreeMap<String, f64> {
        settles(vec![self.sidecar.addr("admin")], "llm-tokens").await
    }

    /// One call of `api` made by an app set up by `tweak`; what the app recorded.
    async fn one_call(&self, api: &'static str, name: &str, tweak: impl FnOnce(&mut AppSpec)) -> AppCall {
        let base = match api {
            "messages" => format!("http://{}", self.sidecar.upstream_listener("anthropic")),
            _ => format!("http://{}/v1", self.sidecar.upstream_listener("openai")),
        };
        let mut spec = AppSpec {
            api,
            model: if api == "messages" { "claude-haiku-4-5" } else { "gpt-4o-mini" },
            rate: 10.0,
            calls: 1,
            max_tokens: 400,
            max_retries: Some(0),
            keep_bodies: true,
            ..AppSpec::chat(base, name, 5.0)
        };
        tweak(&mut spec);
        let mut calls = App::start(spec, self.dir.path()).finish().await;
        assert_eq!(calls.len(), 1, "{calls:?}");
        calls.remove(0)
    }

    /// The API's record of call `id`, once its answer has ended.
    async fn upstream(&self, id: &str) -> Call {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let all = [self.openai.calls(), self.anthropic.calls()].concat();
            if let Some(c) = all.into_iter().find(|c| c.id.as_deref() == Some(id) && c.finished.is_some()) {
                return c;
            }
            assert!(Instant::now() < deadline, "the API never finished call {id}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (up to 20 s) until the settles of llm-tokens add up to `n`.
    async fn settles_reach(&self, n: f64) -> BTreeMap<String, f64> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.settles().await;
            if s.values().sum::<f64>() >= n || Instant::now() > deadline {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What the key was charged, from its `remaining` before and after, against
/// the call's real tokens; `None` if they agree (to a token: the bucket
/// refills a sixtieth of a token a second).
fn charge_problem(before: i64, after: i64, real: &Call) -> Option<String> {
    let charged = before - after;
    let want = real.total_tokens() as i64;
    ((charged - want).abs() > 1).then(|| format!("charged {charged}, the call used {want}"))
}

pub(crate) async fn client_gone() {
    // Slow events: the app has left long before the answer ends.
    let solo = Solo::start(Duration::from_millis(100)).await;
    let before = solo.remaining().await;
    let app = solo
        .one_call("chat", "gone", |s| {
            s.stream_share = 1.0;
            s.disconnect_share = 1.0;
        })
        .await;
    let up = solo.upstream(&app.id).await;
    let settles = solo.settles_reach(1.0).await;
    let after = solo.remaining().await;
    let report = format!(
        "app: {} after {} events; API: {} in + {} out, streamed whole: {}, usage asked for: {}\nsettles: {settles:?}; \
         remaining {before} -> {after}",
        app.outcome, app.events, up.input_tokens, up.output_tokens, up.complete, up.asked_usage
    );
    eprintln!("{report}");
    assert_eq!((app.outcome.as_str(), app.events), ("disconnected", 2), "{report}");
    assert!(up.complete, "the sidecar stopped reading when the app left\n{report}");
    assert_eq!(settles.get("client_gone"), Some(&1.0), "{report}\n{}", solo.sidecar.log());
    if let Some(p) = charge_problem(before, after, &up) {
        panic!("{p}\n{report}");
    }
}

pub(crate) async fn asked_usage() {
    let solo = Solo::start(Duration::from_millis(5)).await;
    let before = solo.remaining().await;
    let app = solo
        .one_call("chat", "asks", |s| {
            s.stream_share = 1.0;
            s.usage_share = 1.0;
        })
        .await;
    let up = solo.upstream(&app.id).await;
    let settles = solo.settles_reach(1.0).await;
    let after = solo.remaining().await;
    let report = format!(
        "app: {} {:?}, {} events, usage chunk {}, usage {:?}; API: {} in + {} out\nsettles: {settles:?}; remaining \
         {before} -> {after}\nreceived:\n{}",
        app.outcome,
        app.status,
        app.events,
        app.usage_chunk,
        app.usage,
        up.input_tokens,
        up.output_tokens,
        app.body.as_deref().unwrap_or("")
    );
    eprintln!("{report}");
    assert!(app.asked_usage && app.usage_chunk && app.done, "{report}");
    assert_eq!(app.usage.as_ref().and_then(|u| u["total_tokens"].as_u64()), Some(up.total_tokens()), "{report}");
    assert_eq!(app.digest, digest(&up.sent), "the app got other bytes than the API sent\n{report}");
    assert_eq!(settles.get("settled"), Some(&1.0), "{report}");
    if let Some(p) = charge_problem(before, after, &up) {
        panic!("{p}\n{report}");
    }
}

pub(crate) async fn every_shape() {
    let solo = Solo::start(Duration::from_millis(5)).await;
    let mut problems = Vec::new();
    let mut rows = Vec::new();
    for (i, (api, streamed)) in
        ["chat", "responses", "messages"].into_iter().flat_map(|a| [(a, false), (a, true)]).enumerate()
    {
        let before = solo.remaining().await;
        let settled_before = solo.settles().await.get("settled").copied().unwrap_or(0.0);
        let app = solo.one_call(api, &format!("shape{i}"), |s| s.stream_share = f64::from(u8::from(streamed))).await;
        let up = solo.upstream(&app.id).await;
        let settles = solo.settles_reach(i as f64 + 1.0).await;
        let after = solo.remaining().await;
        let what = format!("{api}{}", if streamed { " streamed" } else { "" });
        rows.push(format!(
            "{what}: app {} {:?}; settles {settles:?}; remaining {before} -> {after}",
            app.outcome, app.status
        ));
        problems.extend(
            unaltered(std::slice::from_ref(&app), std::slice::from_ref(&up))
                .into_iter()
                .map(|p| format!("{what}: {p}")),
        );
        if settles.get("settled").copied().unwrap_or(0.0) != settled_before + 1.0 {
            problems.push(format!("{what}: not settled ({settles:?})"));
        }
        if let Some(p) = charge_problem(before, after, &up) {
            problems.push(format!("{what}: {p}"));
        }
    }
    let report = rows.join("\n");
    eprintln!("{report}");
    assert!(problems.is_empty(), "{problems:#?}\n{report}");
}
