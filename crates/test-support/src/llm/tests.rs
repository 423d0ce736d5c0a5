//! The stand-ins through a plain HTTP client: answers, streams, headers,
//! buckets and records.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};

use super::*;
use crate::upstream::{Got, full, h1, h2, read};

/// A POST of `body` to `path`, with `x-call-id: ID` when given.
fn post(path: &str, body: &Value, id: Option<&str>) -> Request<crate::upstream::TestBody> {
    let mut b = Request::post(path).header("host", "api.local").header("content-type", "application/json");
    if let Some(id) = id {
        b = b.header("x-call-id", id);
    }
    b.body(full(body.to_string())).unwrap()
}

/// Sends `req` on a new HTTP/1.1 connection; the response, body unread.
async fn send(api: &LlmApi, req: Request<crate::upstream::TestBody>) -> http::Response<Incoming> {
    let mut c = h1(api.addr).await;
    c.ready().await.unwrap();
    c.send_request(req).await.unwrap()
}

async fn call(api: &LlmApi, req: Request<crate::upstream::TestBody>) -> Got {
    read(send(api, req).await).await
}

/// Reads a body frame by frame: each frame's bytes.
async fn frames(resp: http::Response<Incoming>) -> Vec<Bytes> {
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            out.push(d);
        }
    }
    out
}

fn chat(prompt: &str, extra: Value) -> Value {
    let mut v = json!({"model": "gpt-test", "messages": [{"role": "user", "content": prompt}]});
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    v
}

/// The only call the stand-in has finished.
fn only_call(api: &LlmApi) -> Call {
    let calls = api.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    calls[0].clone()
}

/// Waits (up to 5 s) until every call the stand-in has seen has finished.
async fn settled(api: &LlmApi) -> Vec<Call> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let calls = api.calls();
        if calls.iter().all(|c| c.finished.is_some()) {
            return calls;
        }
        assert!(Instant::now() < deadline, "calls never finished: {calls:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_whole_chat_completion_reports_usage_in_the_body_and_the_account_in_headers() {
    let api = LlmApi::openai(LlmConfig::default()).await;
    // 40 characters: 10 prompt tokens.
    let got = call(&api, post("/v1/chat/completions", &chat(&"abcd".repeat(10), json!({})), None)).await;
    assert_eq!(got.status, 200, "{}", got.text());
    let v = got.json();
    let (p, c, t) = (&v["usage"]["prompt_tokens"], &v["usage"]["completion_tokens"], &v["usage"]["total_tokens"]);
    assert_eq!(p, 10);
    assert!((50..=250).contains(&c.as_u64().unwrap()), "{v}");
    assert_eq!(t.as_u64(), Some(10 + c.as_u64().unwrap()));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let total = t.as_u64().unwrap();
    assert_eq!(got.header("x-ratelimit-limit-tokens"), "6000");
    assert_eq!(got.header("x-ratelimit-remaining-tokens"), (6000 - total).to_string());
    assert_eq!(got.header("x-ratelimit-reset-tokens"), go_duration(total as f64 / 100.0));
    assert_eq!(got.header("x-ratelimit-limit-requests"), "120");
    assert_eq!(got.header("x-ratelimit-remaining-requests"), "119");
    assert_eq!(got.header("x-ratelimit-reset-requests"), "500ms");
    assert!(got.headers.keys().all(|k| !k.as_str().contains("usage")), "{:?}", got.headers);
    let rec = only_call(&api);
    assert_eq!((rec.input_tokens, rec.output_tokens, rec.status), (10, c.as_u64().unwrap(), 200));
    assert!(!rec.streamed && !rec.asked_usage && rec.complete);
    assert_eq!(rec.sent, got.body);
}

#[tokio::test]
async fn a_chat_stream_carries_usage_only_when_asked() {
    let api = LlmApi::openai(LlmConfig::default()).await;
    let plain =
        frames(send(&api, post("/v1/chat/completions", &chat("hi", json!({"stream": true})), Some("a"))).await).await;
    assert!(plain.len() >= 7, "events arrive one by one: {} frames", plain.len());
    let body = plain.concat();
    let events = sse_events(&body);
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert!(v.get("usage").is_none(), "usage unasked: {}", e.data);
        assert_eq!(v["choices"].as_array().unwrap().len(), 1, "{}", e.data);
    }
    let asked = json!({"stream": true, "stream_options": {"include_usage": true}});
    let got = call(&api, post("/v1/chat/completions", &chat("hi", asked), Some("a"))).await;
    let events = sse_events(&got.body);
    let (usage, rest) = events[..events.len() - 1].split_last().unwrap();
    for e in rest {
        assert!(e.data.ends_with(r#","usage":null}"#), "{}", e.data);
    }
    let u: Value = serde_json::from_str(&usage.data).unwrap();
    assert_eq!(u["choices"], json!([]));
    let calls = settled(&api).await;
    let (first, second) = (&calls[0], &calls[1]);
    assert_eq!(u["usage"]["completion_tokens"].as_u64(), Some(second.output_tokens));
    assert_eq!(u["usage"]["prompt_tokens"], 1);
    // The same call id draws the same answer. What an app that did not ask
    // would have received is the stream without the usage chunk and without
    // each chunk's `"usage":null`.
    assert_eq!(first.output_tokens, second.output_tokens);
    assert_eq!(second.sent, got.body);
    let sent = String::from_utf8(second.sent.to_vec()).unwrap();
    let usage_chunk = format!("data: {}\n\n", usage.data);
    let stripped = sent.replace(&usage_chunk, "").replace(r#","usage":null"#, "");
    assert_eq!(String::from_utf8(second.plain.to_vec()).unwrap(), stripped);
    assert_eq!(first.sent, body);
    assert_eq!(first.sent, first.plain);
    assert!(second.asked_usage && second.streamed && !first.asked_usage);
}

#[tokio::test]
async fn the_responses_api_streams_events_and_ends_with_the_usage() {
    let api = LlmApi::openai(LlmConfig::default()).await;
    // A limit under the least output draws: the answer stops at it.
    let req = json!({"model": "gpt-test", "input": "abcdefgh", "instructions": "abcd", "max_output_tokens": 40});
    let whole = call(&api, post("/v1/responses", &req, Some("r"))).await.json();
    assert_eq!(whole["usage"]["input_tokens"], 3);
    assert_eq!(whole["usage"]["output_tokens"], 40);
    assert_eq!(whole["usage"]["total_tokens"], 43);
    assert_eq!(whole["status"], "incomplete");
    assert_eq!(whole["output"][0]["content"][0]["type"], "output_text");
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    streamed["max_output_tokens"] = json!(1000);
    streamed["input"] = json!([{"role": "user", "content": [{"type": "input_text", "text": "abcdefgh"}]}]);
    let got = call(&api, post("/v1/responses", &streamed, None)).await;
    assert!(got.header("content-type").starts_with("text/event-stream"));
    let events = sse_events(&got.body);
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(
        &names[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert_eq!(names[4], "response.output_text.delta");
    assert_eq!(names.last(), Some(&"response.completed"));
    for (i, e) in events.iter().enumerate() {
        let v: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(v["type"].as_str(), e.event.as_deref());
        assert_eq!(v["sequence_number"], i);
    }
    let done: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    let u = &done["response"]["usage"];
    let rec = settled(&api).await[1].clone();
    assert_eq!((u["input_tokens"].as_u64(), u["output_tokens"].as_u64()), (Some(3), Some(rec.output_tokens)));
    assert_eq!(u["total_tokens"].as_u64(), Some(rec.total_tokens()));
    assert!(!body_has(&got.body, "[DONE]"));
}

fn body_has(body: &[u8], needle: &str) -> bool {
    String::from_utf8_lossy(body).contains(needle)
}

#[tokio::test]
async fn an_anthropic_message_reports_input_at_the_start_and_output_at_the_end() {
    let api = LlmApi::anthropic(LlmConfig::default()).await;
    let req = json!({"model": "claude-test", "max_tokens": 40, "system": "abcd",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]});
    let got = call(&api, post("/v1/messages", &req, None)).await;
    let v = got.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["usage"]["input_tokens"], 3);
    let out = 40;
    assert_eq!(v["usage"]["output_tokens"], out);
    assert_eq!(v["stop_reason"], "max_tokens");
    for side in ["requests", "tokens", "input-tokens", "output-tokens"] {
        let reset = got.header(&format!("anthropic-ratelimit-{side}-reset"));
        humantime::parse_rfc3339(reset).unwrap_or_else(|e| panic!("{side}: {reset}: {e}"));
        assert_eq!(
            got.header(&format!("anthropic-ratelimit-{side}-limit")),
            if side == "requests" { "120" } else { "6000" }
        );
    }
    assert_eq!(got.header("anthropic-ratelimit-input-tokens-remaining"), "5997");
    assert_eq!(got.header("anthropic-ratelimit-output-tokens-remaining"), (6000 - out).to_string());
    // The tighter of the two (output spent more of its limit) speaks for "tokens".
    assert_eq!(got.header("anthropic-ratelimit-tokens-remaining"), (6000 - out).to_string());
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let got = call(&api, post("/v1/messages", &streamed, None)).await;
    let events = sse_events(&got.body);
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(&names[..4], ["message_start", "content_block_start", "ping", "content_block_delta"]);
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let start: Value = serde_json::from_str(&events[0].data).unwrap();
    assert_eq!(start["message"]["usage"]["input_tokens"], 3);
    assert_eq!(start["message"]["usage"]["output_tokens"], 1);
    let delta: Value = serde_json::from_str(&events[names.len() - 2].data).unwrap();
    let rec = settled(&api).await[1].clone();
    assert_eq!(delta["usage"]["output_tokens"].as_u64(), Some(rec.output_tokens));
    // Anthropic requires max_tokens.
    let bad = call(&api, post("/v1/messages", &json!({"model": "m", "messages": []}), None)).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn a_call_that_would_overdraw_a_bucket_gets_the_apis_429() {
    // 300 tokens a minute (5 a second); each call 1 + 100 tokens.
    let cfg = LlmConfig { tokens_per_min: 300.0, completion: 100..=100, ..LlmConfig::default() };
    let api = LlmApi::openai(cfg).await;
    for _ in 0..2 {
        assert_eq!(call(&api, post("/v1/chat/completions", &chat("hi", json!({})), None)).await.status, 200);
    }
    let got = call(&api, post("/v1/chat/completions", &chat("hi", json!({})), None)).await;
    assert_eq!(got.status, 429);
    let e = &got.json()["error"];
    assert_eq!((&e["type"], &e["code"], &e["param"]), (&json!("tokens"), &json!("rate_limit_exceeded"), &Value::Null));
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("on tokens per min (TPM): Limit 300, Used "), "{e}");
    assert!(message.contains(", Requested 101. Please try again in 1s."), "{e}");
    // About 99 left of the 101 it needs: under a second, rounded up.
    assert_eq!(got.header("retry-after"), "1");
    let left: u64 = got.header("x-ratelimit-remaining-tokens").parse().unwrap();
    assert!((98..101).contains(&left), "{left}");
    let calls = api.calls();
    assert_eq!(calls[2].refused_by, Some("tokens"));
    assert_eq!(api.refusals_since(api.started), 1);
    assert_eq!(api.spend_by_minute(api.started), vec![Spend { calls: 2, input: 2, output: 200 }]);

    let cfg = LlmConfig { requests_per_min: 1.0, ..LlmConfig::default() };
    let api = LlmApi::anthropic(cfg).await;
    let req = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(call(&api, post("/v1/messages", &req, None)).await.status, 200);
    let got = call(&api, post("/v1/messages", &req, None)).await;
    assert_eq!(got.status, 429);
    assert_eq!(got.json()["type"], "error");
    assert_eq!(got.json()["error"]["type"], "rate_limit_error");
    assert!(got.json()["error"]["message"].as_str().unwrap().contains("of 1 requests per minute"));
    assert_eq!(got.header("retry-after"), "60");

    let cfg = LlmConfig { output_tokens_per_min: 150.0, completion: 100..=100, ..LlmConfig::default() };
    let api = LlmApi::anthropic(cfg).await;
    let req = json!({"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(call(&api, post("/v1/messages", &req, None)).await.status, 200);
    let got = call(&api, post("/v1/messages", &req, None)).await;
    assert_eq!(got.status, 429);
    assert!(got.json()["error"]["message"].as_str().unwrap().contains("of 150 output tokens per minute"));
    assert_eq!(api.calls()[1].refused_by, Some("output-tokens"));
}

#[tokio::test]
async fn admission_metering_charges_the_estimate_on_arrival() {
    // A stream's headers go out at its start, so they show what arrival charged.
    let cfg = LlmConfig { metering: Metering::Admission, completion: 100..=100, ..LlmConfig::default() };
    let api = LlmApi::openai(cfg.clone()).await;
    // 1 prompt token plus a limit of 500: 501, kept.
    let ask = json!({"stream": true, "max_tokens": 500});
    let got = call(&api, post("/v1/chat/completions", &chat("hi", ask), None)).await;
    assert_eq!(got.header("x-ratelimit-remaining-tokens"), "5499");
    let got = call(&api, post("/v1/chat/completions", &chat("hi", json!({"stream": true})), None)).await;
    // No limit: the default of 4,096 counts (plus what a second refills, at most).
    let left: u64 = got.header("x-ratelimit-remaining-tokens").parse().unwrap();
    assert!((1402..1502).contains(&left), "{left}");
    let api = LlmApi::anthropic(cfg).await;
    let req = json!({"model": "m", "max_tokens": 500, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let got = call(&api, post("/v1/messages", &req, None)).await;
    // Anthropic charges the limit on arrival, and gives back what the answer did not use.
    assert_eq!(got.header("anthropic-ratelimit-output-tokens-remaining"), "5500");
    settled(&api).await;
    let got = call(&api, post("/v1/messages", &req, None)).await;
    let left: u64 = got.header("anthropic-ratelimit-output-tokens-remaining").parse().unwrap();
    assert!((5400..5500).contains(&left), "400 given back, 500 taken: {left}");
}

#[tokio::test]
async fn quota_headers_can_be_switched_off() {
    let api = LlmApi::openai(LlmConfig { quota_headers: false, ..LlmConfig::default() }).await;
    let got = call(&api, post("/v1/chat/completions", &chat("hi", json!({})), None)).await;
    assert_eq!(got.status, 200);
    assert!(got.headers.keys().all(|k| !k.as_str().starts_with("x-ratelimit")), "{:?}", got.headers);
    assert!(got.headers.contains_key("x-request-id"));
}

#[tokio::test]
async fn h2c_clients_are_served() {
    let api = LlmApi::openai(LlmConfig::default()).await;
    let mut c = h2(api.addr).await;
    let req = Request::post(format!("http://{}/v1/chat/completions", api.addr))
        .body(full(chat("hi", json!({"stream": true})).to_string()))
        .unwrap();
    c.ready().await.unwrap();
    let got = read(c.send_request(req).await.unwrap()).await;
    assert_eq!(got.status, 200);
    assert_eq!(sse_events(&got.body).last().unwrap().data, "[DONE]");
}

#[tokio::test]
async fn a_seed_and_a_call_id_make_the_answer() {
    let (a, b) = (LlmApi::openai(LlmConfig::default()).await, LlmApi::openai(LlmConfig::default()).await);
    let other = LlmApi::openai(LlmConfig { seed: 2, ..LlmConfig::default() }).await;
    let mut outs = Vec::new();
    for api in [&a, &b, &other] {
        let mut row = Vec::new();
        for id in ["x", "y", "z"] {
            let v = call(api, post("/v1/chat/completions", &chat("hi", json!({})), Some(id))).await.json();
            row.push(v["usage"]["completion_tokens"].as_u64().unwrap());
        }
        outs.push(row);
    }
    assert_eq!(outs[0], outs[1]);
    assert_ne!(outs[0], outs[2]);
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_recorded_as_incomplete() {
    let cfg = LlmConfig { chunk_every: Duration::from_millis(50), ..LlmConfig::default() };
    let api = LlmApi::openai(cfg).await;
    let resp = send(&api, post("/v1/chat/completions", &chat("hi", json!({"stream": true})), None)).await;
    let mut body = resp.into_body();
    for _ in 0..2 {
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    let rec = settled(&api).await[0].clone();
    assert!(!rec.complete, "{rec:?}");
    assert!(rec.sent.len() < rec.plain.len());
    // Its tokens count all the same, as the model wrote them.
    assert!(rec.output_tokens >= 50);
}

#[test]
fn durations_spend_and_events_read_as_the_apis_write_them() {
    assert_eq!(go_duration(360.0), "6m0s");
    assert_eq!(go_duration(1.5), "1.5s");
    assert_eq!(go_duration(0.12), "120ms");
    assert_eq!(go_duration(0.0), "0s");
    let events = sse_events(b"event: a\r\ndata: 1\r\ndata: 2\r\n\r\n: comment\n\ndata: [DONE]\n\n");
    assert_eq!(events.len(), 2);
    assert_eq!(events[0], SseEvent { event: Some("a".into()), data: "1\n2".into() });
    assert_eq!(events[1].data, "[DONE]");
    let call = |finished: f64, status: u16| Call {
        id: None,
        endpoint: Endpoint::Chat,
        arrived: finished,
        finished: Some(finished),
        status,
        refused_by: None,
        input_tokens: 1,
        output_tokens: 10,
        streamed: false,
        asked_usage: false,
        complete: true,
        sent: Bytes::new(),
        plain: Bytes::new(),
    };
    let calls = [call(100.0, 200), call(159.9, 200), call(160.0, 200), call(170.0, 429), call(99.0, 200)];
    assert_eq!(
        spend_by_minute(&calls, 100.0),
        vec![Spend { calls: 2, input: 2, output: 20 }, Spend { calls: 1, input: 1, output: 10 }]
    );
}
