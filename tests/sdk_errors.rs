//! usher's own answers on a route to an LLM API take that API's error shape,
//! so the API's SDK in the app reads them as it reads the API's own. The
//! real `openai` and `anthropic` Python SDKs (`max_retries=0`), pointed at
//! a sidecar's upstream listeners, raise `RateLimitError` for usher's 429
//! with usher's message (naming the resource and the wait) and the code
//! the API would send, and `Retry-After` as usual; an unreachable upstream's
//! 502 is the SDK's `InternalServerError` with usher's reason. A route with
//! no API preset keeps problem+json. `.ci/test` installs the SDKs.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use hyper::Response;
use support::upstream::{full, get, h1, send1, serve};
use support::{Usher, free_port, run_for, write_file};

/// One request an hour, spent by the first: the next is refused for about an hour.
const HOURLY: &str = "{ kind: rate, capacity: 1/h, burst: 1";

/// A sidecar with one upstream listener per route: `openai` and `anthropic`
/// (resources with those APIs' quota presets), `plain` (no preset), and
/// `down` (an OpenAI route whose upstream does not listen).
fn sidecar(dir: &std::path::Path, up: SocketAddr) -> Usher {
    let text = format!(
        "upstreams:\n\
         \x20 openai: {{ url: \"http://{up}/v1\", listen: \"127.0.0.1:0\" }}\n\
         \x20 anthropic: {{ url: \"http://{up}\", listen: \"127.0.0.1:0\" }}\n\
         \x20 plain: {{ url: \"http://{up}\", listen: \"127.0.0.1:0\" }}\n\
         \x20 down: {{ url: \"http://127.0.0.1:{closed}\", listen: \"127.0.0.1:0\" }}\n\
         resources:\n\
         \x20 oa-requests: {HOURLY}, upstream_quota: {{ headers: openai-requests }} }}\n\
         \x20 an-tokens: {HOURLY}, upstream_quota: {{ headers: anthropic-input-tokens }} }}\n\
         \x20 plain-requests: {HOURLY} }}\n\
         \x20 down-requests: {{ kind: rate, capacity: 100/s, upstream_quota: {{ headers: openai-tokens }} }}\n\
         routes:\n\
         \x20 - {{ name: openai, upstream: openai, resources: [oa-requests] }}\n\
         \x20 - {{ name: anthropic, upstream: anthropic, resources: [an-tokens] }}\n\
         \x20 - {{ name: plain, upstream: plain, resources: [plain-requests] }}\n\
         \x20 - {{ name: down, upstream: down, resources: [down-requests] }}\n",
        closed = free_port()
    );
    Usher::proxy(&write_file(dir, "routes.yaml", &text))
}

/// Spends the one request of the route behind `listener`.
async fn spend(listener: SocketAddr) {
    let mut c = h1(listener).await;
    let got = send1(&mut c, get(&listener.to_string(), "/")).await;
    assert_eq!(got.status, 200, "{}", got.text());
}

/// Runs `script` with python3, the sidecar's listener as `sys.argv[1]`, and
/// no proxy from the environment; the script writes one JSON line to stderr.
async fn python(script: &'static str, listener: SocketAddr) -> serde_json::Value {
    let (code, err) = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("python3");
        cmd.args(["-c", script, &listener.to_string()]);
        for var in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
            cmd.env_remove(var);
        }
        cmd.env("NO_PROXY", "*");
        run_for(cmd, Duration::from_secs(60))
    })
    .await
    .unwrap();
    assert_eq!(
        code,
        Some(0),
        "python3 failed (are the openai and anthropic packages installed? .ci/test installs them):\n{err}"
    );
    let line = err.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}):\n{err}"))
}

const OPENAI_CALL: &str = r#"
import json, sys, openai
c = openai.OpenAI(api_key="sk-test", base_url="http://" + sys.argv[1] + "/v1", max_retries=0)
try:
    c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    out = {"raised": None}
except openai.APIStatusError as e:
    out = {"raised": type(e).__name__, "status": e.status_code, "code": e.code, "type": e.type,
           "param": e.param, "message": e.message, "retry_after": e.response.headers.get("retry-after")}
sys.stderr.write(json.dumps(out) + "\n")
"#;

const ANTHROPIC_CALL: &str = r#"
import json, sys, anthropic
c = anthropic.Anthropic(api_key="sk-test", base_url="http://" + sys.argv[1], max_retries=0)
try:
    c.messages.create(model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    out = {"raised": None}
except anthropic.APIStatusError as e:
    out = {"raised": type(e).__name__, "status": e.status_code, "body": e.body, "message": e.message,
           "retry_after": e.response.headers.get("retry-after")}
sys.stderr.write(json.dumps(out) + "\n")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_sdks_read_ushers_refusals_as_their_apis_errors() {
    let up = serve(|_req| async {
        Response::builder().header("content-type", "application/json").body(full("{}")).unwrap()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let u = sidecar(dir.path(), up);

    // OpenAI: the 429 is a RateLimitError carrying usher's message and OpenAI's code.
    let at = u.upstream_listener("openai");
    spend(at).await;
    let e = python(OPENAI_CALL, at).await;
    assert_eq!(e["raised"], "RateLimitError", "{e}");
    assert_eq!(
        (&e["status"], &e["code"], &e["type"], &e["param"]),
        (&429.into(), &"rate_limit_exceeded".into(), &"requests".into(), &serde_json::Value::Null),
        "{e}"
    );
    let message = e["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "Error code: 429 - usher: rate limit of resource `oa-requests` reached on this replica; retry in "
        ),
        "{message}"
    );
    let retry: u64 = e["retry_after"].as_str().unwrap().parse().unwrap();
    assert!((3000..=3600).contains(&retry), "Retry-After as usual: {e}");
    assert!(message.contains(&format!("retry in {retry} s")), "the message says the wait: {message}");

    // Anthropic: the same, in Anthropic's shape.
    let at = u.upstream_listener("anthropic");
    spend(at).await;
    let e = python(ANTHROPIC_CALL, at).await;
    assert_eq!((&e["raised"], &e["status"]), (&"RateLimitError".into(), &429.into()), "{e}");
    assert_eq!((&e["body"]["type"], &e["body"]["error"]["type"]), (&"error".into(), &"rate_limit_error".into()), "{e}");
    let m = e["body"]["error"]["message"].as_str().unwrap();
    assert!(m.starts_with("usher: rate limit of resource `an-tokens` reached on this replica; retry in "), "{m}");
    assert!(e["message"].as_str().unwrap().contains(m), "the exception's text carries it: {e}");
    assert!(e["retry_after"].as_str().is_some(), "{e}");

    // An SDK retries a 502: it reads usher's reason too.
    let e = python(OPENAI_CALL, u.upstream_listener("down")).await;
    assert_eq!(
        (&e["raised"], &e["status"], &e["type"]),
        (&"InternalServerError".into(), &502.into(), &"server_error".into()),
        "{e}"
    );
    assert_eq!(e["code"], "upstream_connect", "{e}");
    assert!(
        e["message"].as_str().unwrap().starts_with("Error code: 502 - usher: cannot connect to upstream `down`"),
        "{e}"
    );

    // No preset, no API: problem+json as everywhere else.
    let at = u.upstream_listener("plain");
    spend(at).await;
    let mut c = h1(at).await;
    let got = send1(&mut c, get(&at.to_string(), "/")).await;
    assert_eq!(got.status, 429);
    assert_eq!(got.header("content-type"), "application/problem+json");
    assert_eq!(got.json()["type"], "urn:usher:problem:rate-limited");
}
