use super::*;

fn path(text: &str) -> JsonPath {
    JsonPath::parse(text).unwrap()
}

#[test]
fn a_number_is_found_at_its_path_and_nothing_else_counts() {
    let body = br#"{"id":"x","choices":[{"message":{"content":"hi \"usage\""}},{"n":7}],
        "usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42},"tail":[1,{"a":null}]}"#;
    for (p, want) in [
        ("usage.total_tokens", Some(42.0)),
        ("usage.prompt_tokens", Some(12.0)),
        ("choices.1.n", Some(7.0)),
        ("tail.0", Some(1.0)),
        // Absent, out of range, not a number, or a container where a number is wanted.
        ("usage.missing", None),
        ("choices.2.n", None),
        ("choices.x.n", None),
        ("id", None),
        ("id.more", None),
        ("usage", None),
        ("choices", None),
        ("tail.1.a", None),
        ("usage.total_tokens.deeper", None),
    ] {
        assert_eq!(find(body, &path(p)).unwrap(), want, "{p}");
    }
}

#[test]
fn a_step_of_digits_is_a_key_in_an_object_and_an_index_in_an_array() {
    assert_eq!(find(br#"{"0":{"t":3}}"#, &path("0.t")).unwrap(), Some(3.0));
    assert_eq!(find(br#"[[5,6],[7,8]]"#, &path("1.0")).unwrap(), Some(7.0));
}

#[test]
fn numbers_of_every_json_form_are_read_and_negative_ones_are_not() {
    for (body, want) in [
        (&br#"{"n":1500}"#[..], Some(1500.0)),
        (br#"{"n":12.5}"#, Some(12.5)),
        (br#"{"n":1e3}"#, Some(1000.0)),
        (br#"{"n":0}"#, Some(0.0)),
        (br#"{"n":-3}"#, None),
        (br#"{"n":"42"}"#, None),
        (br#"{"n":true}"#, None),
        (br#"{"n":null}"#, None),
        (br#"{"n":1,"n":2}"#, Some(2.0)),
        (br#"{"\u006e":9}"#, Some(9.0)),
        (b" {\"n\" : 4 }\n", Some(4.0)),
    ] {
        assert_eq!(find(body, &path("n")).unwrap(), want, "{}", String::from_utf8_lossy(body));
    }
}

#[test]
fn a_body_that_is_not_one_json_document_is_an_error() {
    for body in [&b"not json"[..], b"{\"n\":1", b"{\"n\":1} trailing", b"{\"n\":1}{\"n\":2}", b"<html>", b"\xff\xfe"] {
        assert!(find(body, &path("n")).is_err(), "{}", String::from_utf8_lossy(body));
    }
    // Malformed after the path's value is still malformed.
    assert!(find(br#"{"n":1,"x":[1,}"#, &path("n")).is_err());
}

#[test]
fn a_body_copy_stops_at_the_limit() {
    let mut c = Copied { bytes: Vec::new(), over: false };
    c.push(&vec![b' '; MAX_JSON_BODY - 1]);
    c.push(b"1");
    assert!(!c.over && c.bytes.len() == MAX_JSON_BODY, "exactly the limit is kept");
    c.push(b"");
    assert!(!c.over, "nothing more is not more");
    c.push(b" ");
    assert!(c.over && c.bytes.capacity() == 0, "over it, the copy is dropped");
    c.push(b"more");
    assert!(c.over && c.bytes.is_empty());
}

#[test]
fn the_head_says_which_bodies_cannot_be_read() {
    let check = |fields: &[(&str, &'static [u8])], length: Option<u64>| {
        let header = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        unreadable(&header, length, is_event_stream(&header)).map(|(o, _)| o)
    };
    assert_eq!(check(&[("content-type", b"application/json")], Some(100)), None);
    assert_eq!(check(&[("content-encoding", b" identity ")], None), None);
    assert_eq!(check(&[("content-encoding", b"")], None), None);
    assert_eq!(check(&[("content-encoding", b"gzip")], None), Some(SettleOutcome::Encoded));
    assert_eq!(check(&[("content-encoding", b"br")], Some(10)), Some(SettleOutcome::Encoded));
    assert_eq!(check(&[("content-type", b"Text/Event-Stream; charset=utf-8")], None), None, "a stream is read");
    assert_eq!(
        check(&[("content-type", b"text/event-stream"), ("content-encoding", b"gzip")], None),
        Some(SettleOutcome::Encoded)
    );
    assert_eq!(check(&[], Some(MAX_JSON_BODY as u64)), None, "the limit itself is read");
    assert_eq!(check(&[], Some(MAX_JSON_BODY as u64 + 1)), Some(SettleOutcome::TooLarge));
    assert_eq!(
        check(&[("content-type", b"text/event-stream")], Some(MAX_JSON_BODY as u64 + 1)),
        None,
        "a stream of any length is read, an event at a time"
    );
    let header = |name: &str| (name == "content-type").then_some(&b"text/event"[..]);
    assert!(!is_event_stream(&header));
}

// === token counts ===

use usher_core::config::usage::UsageApi;

fn counts(input: f64, output: f64, total: Option<f64>) -> usage::Counts {
    usage::Counts { input: Some(input), output: Some(output), total }
}

#[test]
fn each_api_s_bodies_give_their_counts() {
    let chat = br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",
        "content":"\"usage\": {\"prompt_tokens\": 1}"},"finish_reason":"stop"}],
        "usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,
        "prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}"#;
    assert_eq!(usage::read(chat, UsageApi::OpenAi).unwrap(), counts(19.0, 10.0, Some(29.0)));
    let responses = br#"{"id":"resp_1","object":"response","status":"completed","output":[{"type":"message",
        "content":[{"type":"output_text","text":"Hi"}]}],
        "usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},"output_tokens":87,
        "output_tokens_details":{"reasoning_tokens":0},"total_tokens":123}}"#;
    assert_eq!(usage::read(responses, UsageApi::OpenAi).unwrap(), counts(36.0, 87.0, Some(123.0)));
    let anthropic = br#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"Hi"}],
        "model":"claude-sonnet-4-5","stop_reason":"end_turn","usage":{"input_tokens":2095,"output_tokens":503,
        "cache_creation_input_tokens":0,"cache_read_input_tokens":0}}"#;
    assert_eq!(usage::read(anthropic, UsageApi::Anthropic).unwrap(), counts(2095.0, 503.0, None));
    // Each preset reads its own API's names only.
    assert_eq!(usage::read(chat, UsageApi::Anthropic).unwrap(), usage::Counts::default());
    assert!(usage::read(b"{\"usage\":", UsageApi::OpenAi).is_err());
    assert_eq!(
        usage::read(br#"{"usage":{"prompt_tokens":-1,"completion_tokens":"2","total_tokens":null}}"#, UsageApi::OpenAi)
            .unwrap(),
        usage::Counts::default(),
        "only numbers of at least 0 count"
    );
}

#[test]
fn only_documents_with_a_usage_object_are_read() {
    for (doc, may) in [
        (&br#"{"usage":{"total_tokens":1}}"#[..], true),
        (br#"{"a":1, "usage" : { }}"#, true),
        (br#"{"message":{"usage":{"input_tokens":1}}}"#, true),
        (br#"{"choices":[],"usage":null}"#, false),
        (br#"{"content":"\"usage\": {}"}"#, false),
        (br#"{"usage"}"#, false),
        (b"[DONE]", false),
    ] {
        assert_eq!(usage::may_have(doc), may, "{}", String::from_utf8_lossy(doc));
    }
}

/// Counts merged over a stream's events, read by a scanner, however the
/// stream is cut.
fn streamed(stream: &[u8], api: UsageApi) -> usage::Counts {
    let whole = merged(&[stream], api);
    for cut in 0..=stream.len() {
        let (a, b) = stream.split_at(cut);
        assert_eq!(merged(&[a, b], api), whole, "cut at {cut}");
    }
    whole
}

fn merged(pieces: &[&[u8]], api: UsageApi) -> usage::Counts {
    let mut scan = Scanner::new(false);
    let mut total = usage::Counts::default();
    let mut on = |data: &[u8]| {
        if usage::may_have(data)
            && let Ok(c) = usage::read(data, api)
        {
            total.merge(c);
        }
        Verdict::Keep
    };
    for p in pieces {
        scan.scan(p, &mut on);
    }
    scan.end(&mut Vec::new(), &mut on);
    total
}

#[test]
fn each_api_s_streams_give_their_counts() {
    let chat = b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
        data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n\
        data: [DONE]\n\n";
    assert_eq!(streamed(chat, UsageApi::OpenAi), counts(9.0, 12.0, Some(21.0)));
    let responses = b"event: response.created\r\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\r\n\r\n\
        event: response.output_text.delta\r\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\r\n\r\n\
        event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"status\":\"completed\",\
        \"usage\":{\"input_tokens\":5,\"output_tokens\":7,\"total_tokens\":12}}}\r\n\r\n";
    assert_eq!(streamed(responses, UsageApi::OpenAi), counts(5.0, 7.0, Some(12.0)));
    let anthropic = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\
        \"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
        event: ping\ndata: {\"type\": \"ping\"}\n\n\
        event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n\
        event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":10}}\n\n\
        event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n\
        event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    assert_eq!(streamed(anthropic, UsageApi::Anthropic), counts(25.0, 15.0, None), "the last delta's output");
}

#[test]
fn a_later_count_replaces_an_earlier_and_drops_a_stale_total() {
    let mut c = usage::Counts::default();
    c.merge(counts(10.0, 1.0, Some(11.0)));
    c.merge(usage::Counts { output: Some(30.0), ..Default::default() });
    assert_eq!(c, counts(10.0, 30.0, None));
    c.merge(usage::Counts::default());
    assert_eq!(c, counts(10.0, 30.0, None), "nothing new changes nothing");
}
