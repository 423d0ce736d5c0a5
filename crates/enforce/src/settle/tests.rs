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
        unreadable(&header, length).map(|(o, _)| o)
    };
    assert_eq!(check(&[("content-type", b"application/json")], Some(100)), None);
    assert_eq!(check(&[("content-encoding", b" identity ")], None), None);
    assert_eq!(check(&[("content-encoding", b"")], None), None);
    assert_eq!(check(&[("content-encoding", b"gzip")], None), Some(SettleOutcome::Encoded));
    assert_eq!(check(&[("content-encoding", b"br")], Some(10)), Some(SettleOutcome::Encoded));
    assert_eq!(check(&[("content-type", b"Text/Event-Stream; charset=utf-8")], None), Some(SettleOutcome::Streaming));
    assert_eq!(check(&[("content-type", b"text/event")], None), None);
    assert_eq!(check(&[], Some(MAX_JSON_BODY as u64)), None, "the limit itself is read");
    assert_eq!(check(&[], Some(MAX_JSON_BODY as u64 + 1)), Some(SettleOutcome::TooLarge));
}
