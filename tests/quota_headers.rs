//! `upstream_quota` presets against stand-in upstreams that send real APIs'
//! headers: Anthropic's separate input and output token limits each steer
//! their own resource; and a preset whose headers never come (`github` on an
//! OpenAI-like API) is warned of once and shown on the status page until
//! its headers appear; a server sharing an OpenAI-like API's whole request
//! rate adds a tenth while the API's bucket is over a third full; and a
//! server cuts its fleet only while the API's bucket falls fast enough to
//! be empty within 30 s.

#![allow(clippy::disallowed_methods, reason = "tests wait for real processes on the wall clock")]

use usher_test_support as support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hyper::Response;
use support::upstream::{full, get, h1, send1, serve};
use support::{Usher, free_port, http_get, metric, write_file};

/// The header fields the stand-in answers with; the test changes them.
type Fields = Arc<Mutex<Vec<(String, String)>>>;

/// An API stand-in: answers every request `200` with a small JSON body and
/// the header fields in `fields` at the time.
async fn stand_in(fields: Fields) -> SocketAddr {
    serve(move |_req| {
        let mut b = Response::builder().header("content-type", "application/json");
        for (k, v) in fields.lock().unwrap().iter() {
            b = b.header(k.as_str(), v.as_str());
        }
        let resp = b.body(full("{}")).unwrap();
        async move { resp }
    })
    .await
}

fn fields(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// A sidecar whose one route (`chat`) sends every request on upstream `llm`'s
/// own listener to `up`, admitted by `resources` (YAML entries, indented).
fn sidecar(dir: &std::path::Path, up: SocketAddr, resources: &str, names: &str) -> Usher {
    let text = format!(
        "upstreams:\n  llm: {{ url: \"http://{up}\", listen: \"127.0.0.1:0\" }}\n\
         resources:\n{resources}\
         routes:\n  - {{ name: chat, upstream: llm, resources: [{names}] }}\n"
    );
    Usher::proxy(&write_file(dir, "routes.yaml", &text))
}

fn status(u: &Usher) -> serde_json::Value {
    let (code, body) = http_get(u.addr("admin"), "/debug/status?format=json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Sends `n` requests on one connection to the route; each must be answered 200.
async fn send(u: &Usher, n: usize) {
    let at = u.upstream_listener("llm");
    let mut c = h1(at).await;
    for _ in 0..n {
        let got = send1(&mut c, get(&at.to_string(), "/v1/messages")).await;
        assert_eq!(got.status, 200, "{}", got.text());
    }
}

/// Anthropic sends its input and output token limits apart
/// (`anthropic-ratelimit-input-tokens-*`, `-output-tokens-*`, resets in RFC
/// 3339): each preset reads its own into its resource's key, the status
/// page and `usher_proxy_upstream_quota`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_input_and_output_token_presets_each_read_their_own_headers() {
    let reset = humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(30)).to_string();
    let answer = fields(&[
        ("anthropic-ratelimit-input-tokens-limit", "40000".into()),
        ("anthropic-ratelimit-input-tokens-remaining", "39000".into()),
        ("anthropic-ratelimit-input-tokens-reset", reset.clone()),
        ("anthropic-ratelimit-output-tokens-limit", "8000".into()),
        ("anthropic-ratelimit-output-tokens-remaining", "7990".into()),
        ("anthropic-ratelimit-output-tokens-reset", reset),
    ]);
    let up = stand_in(Arc::new(Mutex::new(answer))).await;
    let dir = tempfile::tempdir().unwrap();
    let resources = "  input: { kind: rate, capacity: 40000/min, upstream_quota: { headers: anthropic-input-tokens } }\n\
                     \x20 output: { kind: rate, capacity: 8000/min, upstream_quota: { headers: anthropic-output-tokens } }\n";
    let u = sidecar(dir.path(), up, resources, "input, output");
    send(&u, 1).await;

    let st = status(&u);
    let key = |name: &str| {
        st["keys"].as_array().unwrap().iter().find(|k| k["resource"] == name).cloned().unwrap_or_else(|| panic!("{st}"))
    };
    for (name, limit, remaining) in [("input", 40000.0, 39000.0), ("output", 8000.0, 7990.0)] {
        let q = &key(name)["upstream_quota"];
        assert_eq!((q["limit"].as_f64(), q["remaining"].as_f64()), (Some(limit), Some(remaining)), "{name}: {q}");
        let until = q["reset"].as_f64().unwrap() - q["observed"].as_f64().unwrap();
        assert!((20.0..=31.0).contains(&until), "{name}: resets {until} s after it was read: {q}");
        assert_eq!(q["continuous"], true, "{name}: {q}");
    }
    let (_, text) = http_get(u.addr("admin"), "/metrics");
    let m = |r: &str| metric(&text, "usher_proxy_upstream_quota", &[("resource", r), ("field", "remaining")]);
    assert_eq!((m("input"), m("output")), (Some(39000.0), Some(7990.0)), "{text}");
    assert_eq!(st["upstream_quota_unseen"], serde_json::json!([]), "both presets saw their headers");
}

/// `upstream_quota: { headers: github }` on an OpenAI-like API never sees its
/// headers, so the quota is not followed. After 10 successful answers in a
/// row without them the sidecar warns once (route, resource, preset) and the
/// status page (JSON and HTML) lists the resource; the resource whose preset
/// fits is never listed. Once answers carry the headers, the listing goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preset_whose_headers_never_come_is_warned_of_and_shown_until_they_do() {
    let openai = fields(&[
        ("x-ratelimit-limit-tokens", "30000".into()),
        ("x-ratelimit-remaining-tokens", "29000".into()),
        ("x-ratelimit-reset-tokens", "2s".into()),
    ]);
    let answer: Fields = Arc::new(Mutex::new(openai.clone()));
    let up = stand_in(answer.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let resources = "  wrong: { kind: rate, capacity: 1000/s, upstream_quota: { headers: github } }\n\
                     \x20 tokens: { kind: rate, capacity: 1000/s, upstream_quota: { headers: openai-tokens } }\n";
    let u = sidecar(dir.path(), up, resources, "wrong, tokens");
    const WARNING: &str = "successful answers in a row carried no quota these headers give";

    send(&u, 9).await;
    assert_eq!(status(&u)["upstream_quota_unseen"], serde_json::json!([]), "9 answers are not yet enough");
    send(&u, 1).await;
    u.wait_for_log(WARNING, Duration::from_secs(5));
    let unseen = status(&u)["upstream_quota_unseen"].clone();
    assert_eq!(
        unseen,
        serde_json::json!([{
            "route": "chat",
            "resource": "wrong",
            "preset": "github",
            "headers": "x-ratelimit-limit, x-ratelimit-remaining, x-ratelimit-reset",
            "answers": 10,
        }])
    );
    let (code, html) = http_get(u.addr("admin"), "/debug/status");
    assert_eq!(code, 200);
    assert!(html.contains("Upstream quota headers not seen") && html.contains("<td>wrong</td>"), "{html}");
    send(&u, 5).await;
    assert_eq!(status(&u)["upstream_quota_unseen"][0]["answers"], 15);

    // The upstream starts sending GitHub's headers: the next answer clears it.
    let reset = (SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() + 60).to_string();
    let mut github = openai;
    github.extend(fields(&[
        ("x-ratelimit-limit", "100000".into()),
        ("x-ratelimit-remaining", "99000".into()),
        ("x-ratelimit-reset", reset),
    ]));
    *answer.lock().unwrap() = github;
    send(&u, 1).await;
    u.wait_for_log("quota headers are back", Duration::from_secs(5));
    assert_eq!(status(&u)["upstream_quota_unseen"], serde_json::json!([]));
    let log = u.log();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warned.len(), 1, "warned once:\n{log}");
    for field in ["WARN", "route=chat", "resource=wrong", "preset=github"] {
        assert!(warned[0].contains(field), "{field} in {}", warned[0]);
    }
}

/// One sidecar and its capacity server sharing an OpenAI-like API's 60
/// requests a minute, whose headers the test sets (`fields`).
struct OneSidecar {
    server: Usher,
    sidecar: Usher,
    fields: Fields,
    _dir: tempfile::TempDir,
}

impl OneSidecar {
    /// The server shares `capacity` a minute (FAIR_SHARE, 1 s refreshes);
    /// the API's first answers say `remaining` of 60, full in `reset`.
    async fn start(capacity: f64, remaining: u32, reset: &str) -> OneSidecar {
        let dir = tempfile::tempdir().unwrap();
        let fields: Fields = Arc::default();
        OneSidecar::say(&fields, remaining, reset);
        let up = stand_in(fields.clone()).await;
        let port = free_port();
        let config = format!(
            "resources:\n  - identifier_glob: llm-requests\n    capacity: {capacity}/min\n    \
             algorithm: {{ kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1, learning_mode_duration: 0 }}\n  \
             - identifier_glob: '*'\n    capacity: 0\n    algorithm: {{ kind: FAIR_SHARE, lease_length: 10, refresh_interval: 1 }}\n"
        );
        let server = Usher::server_at(&write_file(dir.path(), "resources.yaml", &config), port, &[]);
        let routes = format!(
            "doorman:\n  servers: [\"127.0.0.1:{port}\"]\n  client_id: app\n\
             upstreams:\n  llm: {{ url: \"http://{up}\", listen: \"127.0.0.1:0\" }}\n\
             resources:\n  llm-requests: {{ kind: rate, capacity: {capacity}/min, upstream_quota: {{ headers: openai-requests }} }}\n\
             routes:\n  - {{ name: chat, upstream: llm, resources: [llm-requests] }}\n"
        );
        let sidecar = Usher::proxy(&write_file(dir.path(), "routes.yaml", &routes));
        OneSidecar { server, sidecar, fields, _dir: dir }
    }

    /// Sets what the API says of its bucket from now on.
    fn say(fields: &Fields, remaining: u32, reset: &str) {
        *fields.lock().unwrap() = self::fields(&[
            ("x-ratelimit-limit-requests", "60".into()),
            ("x-ratelimit-remaining-requests", remaining.to_string()),
            ("x-ratelimit-reset-requests", reset.into()),
        ]);
    }

    /// The server's status of the resource once the API's account that says
    /// `remaining` has reached it (the sidecar carries it up with its next
    /// request for its lease).
    async fn resource_once_it_knows(&self, remaining: u32) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let (code, body) = http_get(self.server.addr("admin"), "/debug/status?format=json");
            assert_eq!(code, 200, "{body}");
            let st: serde_json::Value = serde_json::from_str(&body).unwrap();
            let r = st["resources"].as_array().and_then(|a| a.iter().find(|r| r["id"] == "llm-requests")).cloned();
            if let Some(r) = r.filter(|r| {
                r["quota"]["source"] == "upstream" && r["quota"]["remaining"].as_f64() == Some(f64::from(remaining))
            }) {
                return r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the account never reached the server: {st}\n{}",
                self.sidecar.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The capacity the server shares now, per minute.
    fn per_min(resource: &serde_json::Value) -> f64 {
        resource["capacity"].as_f64().unwrap() * 60.0
    }
}

/// An OpenAI-like API refills 60 requests a minute and says its bucket holds
/// 50 (full in 10 s: one a second). A server sharing that whole rate adds a
/// tenth while the bucket is over a third full, so that what the sidecars
/// leave unspent is spent; one whose capacity is set a little under the rate
/// keeps to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_adds_a_tenth_while_the_apis_bucket_is_over_a_third_full_only_at_its_whole_rate() {
    for (capacity, shared) in [(60.0, 66.0), (58.0, 58.0)] {
        let one = OneSidecar::start(capacity, 50, "10s").await;
        send(&one.sidecar, 2).await;
        let resource = one.resource_once_it_knows(50).await;
        let per_min = OneSidecar::per_min(&resource);
        assert!(
            (per_min - shared).abs() < 0.01,
            "capacity {capacity}/min: shared {per_min}/min, not {shared}\n{resource}"
        );
    }
}

/// The API's bucket read twice, some 6 s apart (a fall is measured over 5 s
/// at least), both times under half full. Falling from 28 to 10, at the
/// pace it falls it would be empty within 30 s: the server cuts the fleet
/// to the bucket's floor (the capacity scaled by how full it is against
/// half full: 58 x 10/30). Falling from 28 to 27, it would last minutes:
/// the fleet keeps its 58 a minute, so that the last of a burst, or
/// readings a call apart, cut nothing (with the rule that cut any fall
/// under half full, this one read 54 a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_cuts_a_fleet_only_while_the_apis_bucket_would_be_empty_within_thirty_seconds() {
    // Each case on its own sidecar and server, side by side: its two
    // readings 6 s apart, whatever the other case waits for. (The floor is
    // the cut while the fall it measures is over 0.64 a second: readings
    // under 14 s apart.)
    let case = async |then: u32, reset: &'static str, shared: f64| {
        let one = OneSidecar::start(58.0, 28, "32s").await;
        let first_sent = tokio::time::Instant::now();
        send(&one.sidecar, 1).await;
        let first = one.resource_once_it_knows(28).await;
        assert!((OneSidecar::per_min(&first) - 58.0).abs() < 0.01, "one reading, no fall yet: {first}");
        tokio::time::sleep_until(first_sent + Duration::from_secs(6)).await;
        OneSidecar::say(&one.fields, then, reset);
        send(&one.sidecar, 1).await;
        let resource = one.resource_once_it_knows(then).await;
        let per_min = OneSidecar::per_min(&resource);
        assert!(
            (per_min - shared).abs() < 0.01,
            "28 then {then} of 60: shared {per_min}/min, not {shared}\n{resource}"
        );
    };
    tokio::join!(case(10, "50s", 58.0 * 10.0 / 30.0), case(27, "33s", 58.0));
}
