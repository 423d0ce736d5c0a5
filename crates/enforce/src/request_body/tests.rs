use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::metrics::Metrics;
use usher_core::clock::Clock;
use usher_core::config::routes::{Estimate, LlmApi, RoutesConfig};
use usher_limit::LeaseTable;

fn tokens(api: LlmApi, doc: Value) -> Option<(u64, u64)> {
    estimate::tokens(&Estimate { api, default_output_tokens: 700 }, &doc)
}

#[test]
fn chat_completions_count_each_messages_text_and_the_output_limit() {
    // 8 + 12 characters: 5 tokens; the text parts count, the image does not.
    let doc = json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "Be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "Hello, world"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAAAAAAAAAAAAAAAAAA"}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [{"function": {"arguments": "{\"long\":1}"}}]}
        ],
        "max_tokens": 100
    });
    assert_eq!(tokens(LlmApi::OpenAi, doc.clone()), Some((5, 100)));
    // max_completion_tokens is the newer name, and wins; without any, the default.
    let mut newer = doc.clone();
    newer["max_completion_tokens"] = json!(250);
    assert_eq!(tokens(LlmApi::OpenAi, newer), Some((5, 250)));
    let mut none = doc;
    none.as_object_mut().unwrap().remove("max_tokens");
    assert_eq!(tokens(LlmApi::OpenAi, none), Some((5, 700)));
}

#[test]
fn characters_are_counted_not_bytes_and_rounded_up_to_whole_tokens() {
    let doc = |s: &str| json!({"messages": [{"role": "user", "content": s}], "max_tokens": 0});
    assert_eq!(tokens(LlmApi::OpenAi, doc("héllo")), Some((2, 0)), "5 characters, 6 bytes");
    assert_eq!(tokens(LlmApi::OpenAi, doc("abcd")), Some((1, 0)));
    assert_eq!(tokens(LlmApi::OpenAi, doc("")), Some((0, 0)));
    assert_eq!(tokens(LlmApi::OpenAi, json!({})), Some((0, 700)), "an empty call costs its output");
    for not_an_object in [json!([1, 2]), json!("text"), json!(3)] {
        assert_eq!(tokens(LlmApi::OpenAi, not_an_object), None);
    }
}

#[test]
fn the_responses_api_counts_its_input_and_instructions() {
    // A string input (12 characters) and instructions (4): 4 tokens.
    let doc = json!({"model": "o4", "instructions": "Rhyme", "input": "Write a poem", "max_output_tokens": 64});
    assert_eq!(tokens(LlmApi::OpenAi, doc), Some((5, 64)), "17 characters");
    // Items: a message's string content, a message's input_text parts.
    let doc = json!({
        "input": [
            {"role": "user", "content": "abcdefgh"},
            {"role": "user", "content": [{"type": "input_text", "text": "ijkl"}, {"type": "input_image", "image_url": "x"}]},
            {"type": "function_call", "arguments": "{\"not\": \"prompt\"}"}
        ]
    });
    assert_eq!(tokens(LlmApi::OpenAi, doc), Some((3, 700)), "12 characters");
}

#[test]
fn anthropic_messages_count_the_system_prompt_and_each_messages_text() {
    let doc = json!({
        "model": "claude",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [{"type": "tool_use", "input": {"expr": "2+2"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "4"}]},
                {"type": "text", "text": "Thanks"}
            ]}
        ]
    });
    // 14 + 12 + 1 + 6 = 33 characters: 9 tokens.
    assert_eq!(tokens(LlmApi::Anthropic, doc.clone()), Some((9, 1024)));
    let plain = json!({"system": "abcd", "messages": [{"role": "user", "content": "efgh"}]});
    assert_eq!(tokens(LlmApi::Anthropic, plain), Some((2, 700)));
    // OpenAI's limits and fields are not Anthropic's.
    let other = json!({"instructions": "abcd", "input": "efgh", "max_output_tokens": 5});
    assert_eq!(tokens(LlmApi::Anthropic, other), Some((0, 700)));
}

#[test]
fn include_usage_is_added_where_it_belongs_and_nothing_else_changes() {
    let cases: &[(&str, &str)] = &[
        // (body, as sent upstream)
        (
            r#"{"model":"m","stream":true,"messages":[]}"#,
            r#"{"model":"m","stream":true,"messages":[],"stream_options":{"include_usage":true}}"#,
        ),
        (
            "{\n  \"stream\": true,\n  \"messages\": [ {\"content\": \"} { \\\" ,\"} ]\n}\n",
            "{\n  \"stream\": true,\n  \"messages\": [ {\"content\": \"} { \\\" ,\"} ],\"stream_options\":{\"include_usage\":true}\n}\n",
        ),
        (
            r#"{"stream":true,"stream_options":{"include_obfuscation":false},"messages":[]}"#,
            r#"{"stream":true,"stream_options":{"include_obfuscation":false,"include_usage":true},"messages":[]}"#,
        ),
        (
            r#"{"stream":true,"messages":[],"stream_options":{ }}"#,
            r#"{"stream":true,"messages":[],"stream_options":{"include_usage":true }}"#,
        ),
        (
            r#"{"stream":true,"messages":[],"stream_options":{"include_usage":false}}"#,
            r#"{"stream":true,"messages":[],"stream_options":{"include_usage":true}}"#,
        ),
        (
            r#"{"stream":true,"messages":[],"stream_options":null}"#,
            r#"{"stream":true,"messages":[],"stream_options":{"include_usage":true}}"#,
        ),
        (
            r#"{"stream":true,"messages":[],"stream\u005foptions":{"a":1}}"#,
            r#"{"stream":true,"messages":[],"stream\u005foptions":{"a":1,"include_usage":true}}"#,
        ),
        (
            "\t{ \"stream\" : true , \"messages\" : [ ] , \"n\" : 1.50e2 }  ",
            "\t{ \"stream\" : true , \"messages\" : [ ] , \"n\" : 1.50e2,\"stream_options\":{\"include_usage\":true} }  ",
        ),
    ];
    for (body, sent) in cases {
        let doc: Value = serde_json::from_str(body).unwrap();
        assert!(include_usage::wanted(&doc), "{body}");
        let out = include_usage::add(body.as_bytes()).unwrap_or_else(|| panic!("{body}"));
        assert_eq!(String::from_utf8(out.clone()).unwrap(), *sent);
        let after: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(after.pointer("/stream_options/include_usage"), Some(&json!(true)), "{body}");
        assert!(!include_usage::wanted(&after));
    }
}

/// Any JSON value, with strings that hold JSON's own punctuation.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "[a-z{}\\[\\],:\"\\\\ é\u{1F600}]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_\"{}]{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Whatever else the body holds and however it is spaced, the edit
    /// sets include_usage, keeps every other member, and is one run of bytes.
    #[test]
    fn include_usage_is_one_edit_that_keeps_everything_else(
        mut doc in prop::collection::btree_map("stream|messages|model|stream_options|[a-z\"{}]{1,5}", any_json(), 0..6),
        options in prop::option::of(prop_oneof![
            Just(Value::Null),
            prop::collection::btree_map("include_usage|include_obfuscation|[a-z]{1,4}", any_json(), 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]),
        pretty in any::<bool>(),
    ) {
        match options {
            Some(o) => doc.insert("stream_options".into(), o),
            None => doc.remove("stream_options"),
        };
        let doc = Value::Object(doc.into_iter().collect());
        let body = if pretty { serde_json::to_vec_pretty(&doc) } else { serde_json::to_vec(&doc) }.unwrap();
        let out = include_usage::add(&body).unwrap();
        let after: Value = serde_json::from_slice(&out).unwrap();
        prop_assert_eq!(after.pointer("/stream_options/include_usage"), Some(&json!(true)));
        // Compared as read back, with the same rounding.
        let (mut before, mut after) = (serde_json::from_slice::<Value>(&body).unwrap(), after);
        for v in [&mut before, &mut after] {
            let o = v.as_object_mut().unwrap();
            if let Some(Value::Object(options)) = o.get_mut("stream_options") {
                options.remove("include_usage");
            }
            if o.get("stream_options").is_none_or(|s| s.is_null() || s.as_object().is_some_and(|m| m.is_empty())) {
                o.remove("stream_options");
            }
        }
        prop_assert_eq!(before, after);
        // One run: what `body` has around it is the same.
        let front = body.iter().zip(&out).take_while(|(a, b)| a == b).count();
        let back = body[front..].iter().rev().zip(out[front..].iter().rev()).take_while(|(a, b)| a == b).count();
        let inserted = &out[front..out.len() - back];
        prop_assert!(inserted.len() <= r#","stream_options":{"include_usage":true}"#.len(), "{}", String::from_utf8_lossy(inserted));
    }
}

#[test]
fn only_streamed_chat_completions_that_did_not_ask_want_usage() {
    for (doc, want) in [
        (json!({"stream": true, "messages": []}), true),
        (json!({"stream": true, "messages": [], "stream_options": {"include_usage": false}}), true),
        (json!({"stream": true, "messages": [], "stream_options": {"include_usage": true}}), false),
        (json!({"stream": false, "messages": []}), false),
        (json!({"messages": []}), false),
        (json!({"stream": "true", "messages": []}), false),
        // The Responses API reports usage unasked, and takes no include_usage.
        (json!({"stream": true, "input": "hi"}), false),
    ] {
        assert_eq!(include_usage::wanted(&doc), want, "{doc}");
    }
    // A stream_options that is no object is left alone.
    assert_eq!(include_usage::add(br#"{"stream":true,"messages":[],"stream_options":"x"}"#), None);
    assert_eq!(include_usage::add(b"[1]"), None);
}

/// A route's resources, from a routes file's one route.
fn route(entries: &str) -> (Vec<RouteResource>, LeaseTable) {
    let text = format!(
        "upstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\nresources:\n  \
         a: {{ kind: rate, capacity: 10/s, burst: 2000 }}\n  b: {{ kind: rate, capacity: 10/s, burst: 2000 }}\n\
         routes:\n  - name: r\n    upstream: up\n    resources: {entries}\n"
    );
    let cfg = RoutesConfig::parse("r.yaml", &text).unwrap();
    let table = LeaseTable::new(Clock::system());
    table.configure(crate::resource::specs(&cfg));
    let metrics = Metrics::new(prometheus::Registry::new());
    let r = &cfg.routes[0];
    let resources = r
        .resources
        .iter()
        .map(|(name, cost)| RouteResource::new(&cfg, "r", name, *cost, r.cost_rules.get(name), &table, &metrics))
        .collect::<Option<Vec<_>>>()
        .unwrap();
    (resources, table)
}

fn costs(resources: &[RouteResource], plan: &Plan) -> Vec<(String, f64)> {
    plan.items.iter().map(|(l, c)| (resources.iter().find(|r| r.owns(l)).unwrap().metrics.name.clone(), *c)).collect()
}

#[test]
fn a_plan_is_charged_what_the_body_says_and_falls_back_when_it_cannot_be_read() {
    let (resources, _table) = route(
        "[{ resource: a, cost: { estimate: openai, default_output_tokens: 50 } }, { resource: b, cost: \"{json.n}\", default_cost: 7 }]",
    );
    let plan = Plan::new(resources.iter().map(|r| (r.fixed_limiter(), r.cost)).collect());
    assert_eq!(costs(&resources, &plan), [("a".into(), 50.0), ("b".into(), 7.0)]);
    let body = br#"{"messages":[{"content":"abcdefgh"}],"max_tokens":30,"n":12.5}"#;
    let read = read(&resources, &plan, Body::Whole(body), false);
    assert_eq!(read.outcome, BodyOutcome::Read);
    assert_eq!(read.body, None);
    assert_eq!(costs(&resources, &read.plan.unwrap()), [("a".into(), 32.0), ("b".into(), 12.5)]);
    // Above the burst: the burst. Not above 0, or absent: the fallback.
    let huge = super::read(&resources, &plan, Body::Whole(br#"{"max_tokens":99999,"n":-1}"#), false);
    assert_eq!(costs(&resources, &huge.plan.unwrap()), [("a".into(), 2000.0), ("b".into(), 7.0)]);
    for (body, outcome) in [
        (Body::Whole(b"not json"), BodyOutcome::NotJson),
        (Body::Whole(b""), BodyOutcome::Empty),
        (Body::TooLarge, BodyOutcome::TooLarge),
    ] {
        let read = super::read(&resources, &plan, body, true);
        assert_eq!((read.outcome, read.plan.is_none(), read.body), (outcome, true, None), "{body:?}");
    }
}

#[test]
fn usage_is_asked_for_only_when_the_route_says_so() {
    let (resources, _table) = route("[{ resource: a, settle: { usage: openai } }]");
    let plan = Plan::new(vec![(resources[0].fixed_limiter(), 1.0)]);
    let body = br#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let asked = read(&resources, &plan, Body::Whole(body), true);
    assert_eq!(asked.outcome, BodyOutcome::UsageAdded);
    assert!(asked.plan.is_none(), "no cost is read from the body");
    let sent: Value = serde_json::from_slice(&asked.body.unwrap()).unwrap();
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
    let not_asked = read(&resources, &plan, Body::Whole(body), false);
    assert_eq!((not_asked.outcome, not_asked.body), (BodyOutcome::Read, None));
}
