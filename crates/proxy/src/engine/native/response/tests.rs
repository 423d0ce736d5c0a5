use super::*;

/// Parses `input`, which must hold a final response head: its length, what
/// the native path keeps of it, and the head written for the client.
#[track_caller]
fn final_head(input: &str, head_request: bool) -> (usize, ResponseHead, String) {
    let mut out = Vec::new();
    match parse(input.as_bytes(), head_request, &mut out, &mut FieldStarts::default()) {
        Ok(Parsed::Final(len, head)) => (len, head, String::from_utf8(out).expect("UTF-8")),
        other => panic!("expected a final head for {input:?}, got {other:?}"),
    }
}

/// The error `parse` gives for `input`; nothing is written for the client.
#[track_caller]
fn parse_error(input: &str) -> String {
    let mut out = Vec::new();
    match parse(input.as_bytes(), false, &mut out, &mut FieldStarts::default()) {
        Err(e) => {
            assert_eq!(out, b"", "no client head for a rejected response");
            e
        }
        other => panic!("expected an error for {input:?}, got {other:?}"),
    }
}

/// The client's head less its `date` field(s), and those fields' values.
fn split_date(head: &str) -> (String, Vec<String>) {
    let mut rest = String::new();
    let mut dates = Vec::new();
    for line in head.split_inclusive("\r\n") {
        match line.split_once(": ") {
            Some((name, value)) if name.eq_ignore_ascii_case("date") => dates.push(value.trim_end().to_string()),
            _ => rest.push_str(line),
        }
    }
    (rest, dates)
}

/// The client's head without the `date` usher added (asserting it added exactly one).
#[track_caller]
fn without_added_date(head: &str) -> String {
    let (rest, dates) = split_date(head);
    assert_eq!(dates.len(), 1, "one date in {head:?}");
    assert!(head.ends_with(&format!("date: {}\r\n", dates[0])), "added last, lower-case: {head:?}");
    rest
}

// === framing ===

#[test]
fn content_length_is_length_framing() {
    let input = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello";
    let (len, head, out) = final_head(input, false);
    assert_eq!(len, input.len() - 5);
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.framing, Framing::Length(5));
    assert!(head.reusable);
    assert_eq!(head.retry_after, None);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\ncontent-length: 5\r\n");
}

#[test]
fn equal_content_lengths_are_one_length() {
    for fields in ["Content-Length: 5, 5\r\n", "Content-Length: 5\r\ncontent-length: 5\r\n", "Content-Length: 5,5\r\n"]
    {
        let input = format!("HTTP/1.1 200 OK\r\n{fields}\r\n");
        let (len, head, out) = final_head(&input, false);
        assert_eq!(len, input.len());
        assert_eq!(head.framing, Framing::Length(5), "{fields:?}");
        assert!(head.reusable, "{fields:?}");
        assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n", "{fields:?}");
    }
}

#[test]
fn conflicting_or_invalid_content_lengths_are_errors() {
    for fields in ["Content-Length: 5, 6\r\n", "Content-Length: 5\r\nContent-Length: 6\r\n"] {
        let e = parse_error(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n"));
        assert_eq!(e, "invalid HTTP response: conflicting content-length values", "{fields:?}");
    }
    for value in ["+5", "0x5", "-1", "", "5,", "five", "12345678901234567890"] {
        let e = parse_error(&format!("HTTP/1.1 200 OK\r\nContent-Length: {value}\r\n\r\n"));
        assert_eq!(e, format!("invalid HTTP response: content-length {value:?}"));
    }
}

#[test]
fn chunked_is_chunked_framing() {
    let input = "HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\nX-A: 1\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
    let (len, head, out) = final_head(input, false);
    assert_eq!(len, input.find("5\r\n").unwrap());
    assert_eq!(head.framing, Framing::Chunked);
    assert!(head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\nX-A: 1\r\ntransfer-encoding: chunked\r\n");
}

#[test]
fn chunked_with_content_length_is_chunked_and_not_reusable() {
    for fields in
        ["Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"]
    {
        let (_, head, out) = final_head(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n"), false);
        assert_eq!(head.framing, Framing::Chunked, "{fields:?}");
        assert!(!head.reusable, "{fields:?}");
        assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n", "{fields:?}");
    }
}

#[test]
fn codings_other_than_chunked_are_errors() {
    for fields in [
        "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n",
        "Transfer-Encoding: identity\r\n",
        "Transfer-Encoding: \r\n",
    ] {
        let e = parse_error(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n"));
        assert_eq!(e, "unsupported transfer-encoding from the upstream (only chunked)", "{fields:?}");
    }
    // Repeated `chunked` is still chunked.
    let (_, head, _) = final_head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, Chunked\r\n\r\n", false);
    assert_eq!(head.framing, Framing::Chunked);
}

#[test]
fn no_framing_is_close_and_chunked_for_the_client() {
    let input = "HTTP/1.1 200 OK\r\nServer: up\r\n\r\nbody until EOF";
    let (len, head, out) = final_head(input, false);
    assert_eq!(len, input.len() - "body until EOF".len());
    assert_eq!(head.framing, Framing::Close);
    assert!(!head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\nServer: up\r\ntransfer-encoding: chunked\r\n");
}

#[test]
fn responses_without_a_body_are_empty() {
    // HEAD: Content-Length kept as sent, Transfer-Encoding dropped, nothing added.
    let (_, head, out) = final_head("HTTP/1.1 200 OK\r\nContent-Length: 42\r\nX-A: 1\r\n\r\n", true);
    assert_eq!(head.framing, Framing::Empty);
    assert!(head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\nContent-Length: 42\r\nX-A: 1\r\n");
    let (_, head, out) = final_head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", true);
    assert_eq!(head.framing, Framing::Empty);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\n");

    // 304: Content-Length kept.
    let (_, head, out) = final_head("HTTP/1.1 304 Not Modified\r\nContent-Length: 42\r\nETag: \"x\"\r\n\r\n", false);
    assert_eq!(head.status, StatusCode::NOT_MODIFIED);
    assert_eq!(head.framing, Framing::Empty);
    assert!(head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 304 Not Modified\r\nContent-Length: 42\r\nETag: \"x\"\r\n");

    // 204: Content-Length dropped.
    let (_, head, out) = final_head("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-A: 1\r\n\r\n", false);
    assert_eq!(head.status, StatusCode::NO_CONTENT);
    assert_eq!(head.framing, Framing::Empty);
    assert!(head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 204 No Content\r\nX-A: 1\r\n");

    // And a 204 without any framing is still reusable (not Close).
    let (_, head, _) = final_head("HTTP/1.1 204 No Content\r\n\r\n", false);
    assert_eq!((head.framing, head.reusable), (Framing::Empty, true));
}

// === interim and odd statuses ===

#[test]
fn interim_responses_are_skipped_by_length() {
    let continue_head = "HTTP/1.1 100 Continue\r\n\r\n";
    let hints = "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n";
    let fin = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
    for (interim, status) in [(continue_head, 100), (hints, 103)] {
        let mut out = b"untouched".to_vec();
        match parse(format!("{interim}{fin}").as_bytes(), false, &mut out, &mut FieldStarts::default()) {
            Ok(Parsed::Interim(len)) => assert_eq!(len, interim.len(), "{status}"),
            other => panic!("{status}: {other:?}"),
        }
        assert_eq!(out, b"untouched");
    }
}

#[test]
fn switching_protocols_is_an_error() {
    let e = parse_error("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n");
    assert_eq!(e, "101 Switching Protocols to a request that asked for no upgrade");
}

#[test]
fn malformed_and_oversized_heads_are_errors() {
    assert!(parse_error("HTTP/1.1 2000 OK\r\n\r\n").starts_with("invalid HTTP response: "));
    assert!(parse_error("HTTX/1.1 200 OK\r\n\r\n").starts_with("invalid HTTP response: "));
    assert_eq!(parse_error("HTTP/1.1 000 Zero\r\n\r\n"), "invalid HTTP response: status 0");
    // Incomplete and larger than the limit.
    let big = format!("HTTP/1.1 200 OK\r\nX-Big: {}", "b".repeat(MAX_HEAD_BYTES));
    assert_eq!(parse_error(&big), format!("response head larger than {MAX_HEAD_BYTES} bytes"));
}

#[test]
fn incomplete_head_is_partial() {
    for input in ["", "HTTP/1.1 200 OK\r\nContent-Len", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r"] {
        let mut out = Vec::new();
        assert!(
            matches!(parse(input.as_bytes(), false, &mut out, &mut FieldStarts::default()), Ok(Parsed::Partial)),
            "{input:?}"
        );
        assert_eq!(out, b"", "{input:?}");
    }
}

#[test]
fn too_many_fields_is_an_error() {
    let fields = |n: usize| (0..n).map(|i| format!("X-{i}: {i}\r\n")).collect::<String>();
    let (_, head, _) = final_head(&format!("HTTP/1.1 200 OK\r\n{}\r\n", fields(MAX_HEADERS)), false);
    assert_eq!(head.framing, Framing::Close);
    let e = parse_error(&format!("HTTP/1.1 200 OK\r\n{}\r\n", fields(MAX_HEADERS + 1)));
    assert_eq!(e, "more than 128 response header fields");
}

// === connection reuse ===

#[test]
fn http_1_0_responses_are_not_reusable() {
    let (_, head, out) = final_head("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", false);
    assert_eq!(head.framing, Framing::Length(2));
    assert!(!head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n");
    let (_, head, _) = final_head("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n", false);
    assert!(!head.reusable);
}

#[test]
fn connection_close_is_not_reusable() {
    for value in ["close", "Keep-Alive, CLOSE"] {
        let (_, head, out) =
            final_head(&format!("HTTP/1.1 200 OK\r\nConnection: {value}\r\nContent-Length: 0\r\n\r\n"), false);
        assert_eq!(head.framing, Framing::Length(0));
        assert!(!head.reusable, "{value}");
        assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n");
    }
    let (_, head, _) = final_head("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", false);
    assert!(head.reusable);
}

// === the client's head ===

#[test]
fn hop_by_hop_and_connection_named_fields_are_removed() {
    let input = "HTTP/1.1 200 OK\r\n\
        Connection: keep-alive, X-Internal\r\n\
        Keep-Alive: timeout=5\r\n\
        X-Kept: yes\r\n\
        Proxy-Authenticate: Basic\r\n\
        Trailer: X-Sum\r\n\
        x-internal: secret\r\n\
        Upgrade: h2c\r\n\
        TE: trailers\r\n\
        Proxy-Connection: keep-alive\r\n\
        connection: X-Other\r\n\
        X-Other: gone\r\n\
        Cache-Control: no-store\r\n\
        Content-Length: 0\r\n\
        \r\n";
    let (_, head, out) = final_head(input, false);
    assert!(head.reusable);
    assert_eq!(
        without_added_date(&out),
        "HTTP/1.1 200 OK\r\nX-Kept: yes\r\nCache-Control: no-store\r\ncontent-length: 0\r\n"
    );
}

#[test]
fn every_connection_field_names_fields_to_remove() {
    // More Connection fields than the parser keeps inline.
    let named: String = (0..6).map(|i| format!("Connection: X-Named-{i}\r\nx-named-{i}: {i}\r\n")).collect();
    let input = format!("HTTP/1.1 200 OK\r\n{named}X-Kept: yes\r\nContent-Length: 0\r\n\r\n");
    let (_, head, out) = final_head(&input, false);
    assert!(head.reusable);
    assert_eq!(without_added_date(&out), "HTTP/1.1 200 OK\r\nX-Kept: yes\r\ncontent-length: 0\r\n");
}

#[test]
fn date_is_added_when_absent() {
    let (_, _, out) = final_head("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false);
    let (_, dates) = split_date(&out);
    assert_eq!(dates.len(), 1, "{out:?}");
    assert!(out.ends_with(&format!("\r\ndate: {}\r\n", dates[0])), "{out:?}");
    let date = httpdate::parse_http_date(&dates[0]).expect("an HTTP date");
    #[allow(clippy::disallowed_methods, reason = "checks the Date field against the wall clock")]
    let now = SystemTime::now();
    let off = now.duration_since(date).or_else(|_| date.duration_since(now)).unwrap();
    assert!(off < Duration::from_secs(5), "{:?} is not now", dates[0]);
}

#[test]
fn date_is_kept_when_present() {
    let input = "HTTP/1.1 200 OK\r\nDATE: Tue, 15 Nov 1994 08:12:31 GMT\r\nContent-Length: 0\r\n\r\n";
    let (_, _, out) = final_head(input, false);
    assert_eq!(out, "HTTP/1.1 200 OK\r\nDATE: Tue, 15 Nov 1994 08:12:31 GMT\r\ncontent-length: 0\r\n");
}

#[test]
fn date_is_added_when_the_upstreams_is_removed() {
    // The general path strips the named field, then hyper's server adds its own date.
    let input =
        "HTTP/1.1 200 OK\r\nConnection: date\r\nDate: Tue, 15 Nov 1994 08:12:31 GMT\r\nContent-Length: 0\r\n\r\n";
    let (_, _, out) = final_head(input, false);
    assert_eq!(split_date(&out).1.len(), 1, "{out:?}");
}

#[test]
fn reason_phrase() {
    let cases = [
        ("HTTP/1.1 404 Nothing Here, Sorry\r\n\r\n", "HTTP/1.1 404 Nothing Here, Sorry\r\n"),
        ("HTTP/1.1 200 Fine\tthanks \r\n\r\n", "HTTP/1.1 200 Fine\tthanks \r\n"),
        ("HTTP/1.1 404 \r\n\r\n", "HTTP/1.1 404 Not Found\r\n"),
        ("HTTP/1.1 200\r\n\r\n", "HTTP/1.1 200 OK\r\n"),
        ("HTTP/1.1 503 \r\n\r\n", "HTTP/1.1 503 Service Unavailable\r\n"),
        // Non-ASCII (obs-text): httparse gives no reason, so the canonical one.
        ("HTTP/1.1 200 Gr\u{fc}\u{df}e\r\n\r\n", "HTTP/1.1 200 OK\r\n"),
        // No canonical reason: none.
        ("HTTP/1.1 599 \r\n\r\n", "HTTP/1.1 599 \r\n"),
    ];
    for (input, status_line) in cases {
        let (_, _, out) = final_head(input, true);
        assert_eq!(without_added_date(&out), status_line, "{input:?}");
    }
}

#[test]
fn retry_after_is_parsed() {
    let (_, head, out) =
        final_head("HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: 0\r\n\r\n", false);
    assert_eq!(head.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(head.retry_after, Some(Duration::from_secs(7)));
    assert_eq!(without_added_date(&out), "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\ncontent-length: 0\r\n");
    let (_, head, _) =
        final_head("HTTP/1.1 429 Too Many Requests\r\nRetry-After: soon\r\nContent-Length: 0\r\n\r\n", false);
    assert_eq!(head.retry_after, None);
}

// === fields for a route that reads them ===

/// A field's value as the native path looked it up before `FieldStarts`:
/// every line after a line end, scanned for each lookup.
fn scanned<'h>(head: &'h [u8], name: &str) -> Option<&'h [u8]> {
    let n = name.len();
    head.iter().enumerate().filter(|(_, b)| **b == b'\n').find_map(|(nl, _)| {
        let line = &head[nl + 1..];
        if line.len() <= n || line[n] != b':' || !line[..n].eq_ignore_ascii_case(name.as_bytes()) {
            return None;
        }
        let rest = &line[n + 1..];
        let value = &rest[..rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len())];
        Some(value.strip_suffix(b"\r").unwrap_or(value).trim_ascii())
    })
}

const LOOKED_UP: &[&str] = &[
    "x-usage",
    "x-usage-total",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "content-length",
    "content-type",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "date",
    "x-empty",
    "x-missing",
    "ok",
    "http/1.1 200",
];

#[test]
fn recorded_field_starts_find_what_scanning_the_head_found() {
    let heads = [
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        "HTTP/1.1 200 x-usage: 3\r\nX-Usage: 7 \r\nx-usage-total:9\r\nx-usage: 8\r\nx-empty:\r\n\
         Content-Type: application/json\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
        "HTTP/1.1 429 Too Many Requests\r\nx-ratelimit-limit: 5000\r\nX-RateLimit-Remaining:  0\r\n\
         x-ratelimit-reset: 1800000000\r\nConnection: keep-alive, x-usage\r\nKeep-Alive: 5\r\n\
         x-usage: 1\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.0 204 No Content\r\nx-usage: 4\r\nContent-Length: 0\r\n\r\n",
    ];
    for input in heads {
        for head_request in [false, true] {
            let (mut plain, mut out) = (Vec::new(), Vec::new());
            let mut fields = FieldStarts::default();
            fields.reset(true);
            let kept = parse(input.as_bytes(), head_request, &mut plain, &mut FieldStarts::default());
            let marked = parse(input.as_bytes(), head_request, &mut out, &mut fields);
            assert!(matches!((kept, marked), (Ok(Parsed::Final(..)), Ok(Parsed::Final(..)))), "{input:?}");
            assert_eq!(out, plain, "recording changes nothing written: {input:?}");
            for name in LOOKED_UP {
                assert_eq!(
                    fields.find(&out, name),
                    scanned(&out, name),
                    "{name} in {:?}",
                    String::from_utf8_lossy(&out)
                );
            }
        }
    }
}

#[test]
fn recorded_field_starts_of_an_h2_answer_find_what_scanning_found() {
    let resp = http::Response::builder()
        .status(200)
        .header("x-usage", " 12")
        .header("x-usage", "13")
        .header("content-type", "application/json")
        .header("content-length", "20")
        .body(())
        .unwrap();
    let (parts, ()) = resp.into_parts();
    for exact in [Some(20), None] {
        let mut out = Vec::new();
        let mut fields = FieldStarts::default();
        fields.reset(true);
        from_parts(&parts, false, exact, &mut out, &mut fields);
        for name in LOOKED_UP {
            assert_eq!(fields.find(&out, name), scanned(&out, name), "{name} in {:?}", String::from_utf8_lossy(&out));
        }
        assert_eq!(fields.find(&out, "x-usage"), Some(&b"12"[..]));
    }
}

#[test]
fn field_starts_off_record_nothing() {
    let mut out = Vec::new();
    let mut fields = FieldStarts::default();
    fields.reset(false);
    parse(b"HTTP/1.1 200 OK\r\nx-usage: 1\r\n\r\n", false, &mut out, &mut fields).unwrap();
    assert_eq!(fields.find(&out, "x-usage"), None);
    fields.reset(true);
    fields.clear();
    assert_eq!(fields.find(&out, "x-usage"), None, "cleared: the next head's fields only");
}

// === chunked bodies ===

/// Decodes usher's own chunked encoding strictly: lower-case hex sizes, no
/// extensions, no trailers, the last chunk at the very end.
#[track_caller]
fn decode(mut chunks: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    loop {
        let line_end = chunks.windows(2).position(|w| w == b"\r\n").expect("a size line");
        let size = std::str::from_utf8(&chunks[..line_end]).expect("ASCII size");
        assert!(
            !size.is_empty() && size.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "size {size:?}"
        );
        assert!(size == "0" || !size.starts_with('0'), "size {size:?}");
        let size = usize::from_str_radix(size, 16).unwrap();
        chunks = &chunks[line_end + 2..];
        if size == 0 {
            assert_eq!(chunks, b"\r\n", "the last chunk ends the output");
            return data;
        }
        data.extend_from_slice(&chunks[..size]);
        assert_eq!(&chunks[size..size + 2], b"\r\n");
        chunks = &chunks[size + 2..];
    }
}

/// One feed of all of `input` into a new decoder.
fn dechunk(input: &[u8]) -> Result<(usize, Vec<u8>), &'static str> {
    let mut d = Dechunker::default();
    let mut out = Vec::new();
    let n = d.feed(input, &mut out, |_| {})?;
    Ok((n, out))
}

const ALPHABET: &str = "abcdefghijklmnopqrstuvwxyz";

/// A chunked body with extensions, whitespace, upper-case hex and trailers,
/// followed by the next response's bytes; and where the body ends.
fn sample_body() -> (Vec<u8>, usize) {
    let body = format!(
        "5;name=value\r\nhello\r\n1A \t; x=\"y z\";q\r\n{ALPHABET}\r\n001\r\n!\r\n0;end\r\nExpires: never\r\nX-Checksum: abc\r\n\r\n"
    );
    let end = body.len();
    (format!("{body}HTTP/1.1 200 OK\r\n").into_bytes(), end)
}

fn sample_data() -> Vec<u8> {
    format!("hello{ALPHABET}!").into_bytes()
}

#[test]
fn dechunker_decodes_and_re_encodes() {
    let (input, end) = sample_body();
    let mut d = Dechunker::default();
    let mut out = b"before|".to_vec();
    assert!(!d.is_done());
    assert_eq!(d.feed(&input, &mut out, |_| {}), Ok(end));
    assert!(d.is_done());
    assert_eq!(
        String::from_utf8(out.clone()).unwrap(),
        format!("before|5\r\nhello\r\n1a\r\n{ALPHABET}\r\n1\r\n!\r\n0\r\n\r\n")
    );
    assert_eq!(decode(&out[b"before|".len()..]), sample_data());
    // Once done, nothing more is read or written.
    assert_eq!(d.feed(b"0\r\n\r\n", &mut out, |_| {}), Ok(0));
    assert!(out.ends_with(b"!\r\n0\r\n\r\n"));
}

#[test]
fn dechunker_empty_and_large_sizes() {
    assert_eq!(dechunk(b"0\r\n\r\n"), Ok((5, b"0\r\n\r\n".to_vec())));
    let mut input = b"000000000000000000000000000100\r\n".to_vec();
    input.extend_from_slice(&[b'x'; 256]);
    input.extend_from_slice(b"\r\n0\r\n\r\n");
    let (n, out) = dechunk(&input).unwrap();
    assert_eq!(n, input.len());
    let mut expected = b"100\r\n".to_vec();
    expected.extend_from_slice(&[b'x'; 256]);
    expected.extend_from_slice(b"\r\n0\r\n\r\n");
    assert_eq!(out, expected);
    // The largest size is no overflow: all of it is read, waiting for data.
    let mut d = Dechunker::default();
    let mut out = Vec::new();
    assert_eq!(d.feed(b"ffffffffffffffff\r\nabc", &mut out, |_| {}), Ok(21));
    assert_eq!(out, b"3\r\nabc\r\n");
    assert!(!d.is_done());
}

#[test]
fn dechunker_is_the_same_split_anywhere() {
    let (input, end) = sample_body();
    for split in 0..=input.len() {
        let mut d = Dechunker::default();
        let mut out = Vec::new();
        // The data handed out as it is decoded (a settled cost's copy) is the body's, whatever the split.
        let mut data = Vec::new();
        let first = d
            .feed(&input[..split], &mut out, |b| data.extend_from_slice(b))
            .unwrap_or_else(|e| panic!("split {split}: {e}"));
        assert_eq!(first, split.min(end), "split {split}");
        if first == split {
            let second = d
                .feed(&input[split..], &mut out, |b| data.extend_from_slice(b))
                .unwrap_or_else(|e| panic!("split {split}: {e}"));
            assert_eq!(first + second, end, "split {split}");
        }
        assert!(d.is_done(), "split {split}");
        assert_eq!(decode(&out), sample_data(), "split {split}");
        assert_eq!(data, sample_data(), "split {split}");
    }
}

#[test]
fn dechunker_is_the_same_one_byte_at_a_time() {
    let (input, end) = sample_body();
    let mut d = Dechunker::default();
    let mut out = Vec::new();
    let (mut consumed, mut data) = (0, Vec::new());
    for (i, b) in input.iter().enumerate() {
        let n = d
            .feed(std::slice::from_ref(b), &mut out, |b| data.extend_from_slice(b))
            .unwrap_or_else(|e| panic!("byte {i}: {e}"));
        assert_eq!(n, usize::from(i < end), "byte {i}");
        consumed += n;
    }
    assert_eq!(consumed, end);
    assert!(d.is_done());
    assert_eq!(decode(&out), sample_data());
    assert_eq!(data, sample_data());
}

#[test]
fn dechunker_errors() {
    let cases: &[(&[u8], &str)] = &[
        (b"ffffffffffffffff1\r\n", "chunk size overflows"),
        (b"10000000000000000\r\n", "chunk size overflows"),
        (b"0x5\r\nhello\r\n", "invalid chunk size line"),
        (b"-5\r\nhello\r\n", "invalid chunk size line: missing size digit"),
        (b"\r\nhello\r\n", "invalid chunk size line: missing size digit"),
        (b";ext\r\nhello\r\n", "invalid chunk size line: missing size digit"),
        (b" 5\r\nhello\r\n", "invalid chunk size line: missing size digit"),
        (b"5\nhello\r\n", "invalid chunk size line"),
        (b"5 5\r\nhello\r\n", "invalid chunk size line: whitespace"),
        (b"5 \nhello\r\n", "invalid chunk size line: whitespace"),
        (b"5\r\rhello\r\n", "invalid chunk size line: CR without LF"),
        (b"5\rhello\r\n", "invalid chunk size line: CR without LF"),
        (b"3\r\nabcd\r\n0\r\n\r\n", "chunk data longer than its size, or its CRLF missing"),
        (b"3\r\nabc\n0\r\n\r\n", "chunk data longer than its size, or its CRLF missing"),
        (b"3\r\nabc\r0\r\n\r\n", "invalid chunk data end: CR without LF"),
        (b"5;a\nb\r\nhello\r\n", "chunk extension contains a newline"),
        (b"0\r\nX-A: 1\rX-B: 2\r\n\r\n", "invalid trailer line end"),
        (b"0\r\n\rX", "invalid chunked body end"),
        (b"0\r\n\r\r\n", "invalid chunked body end"),
        (b"0\r\nX-A: 1\r\n\r\r", "invalid chunked body end"),
    ];
    for (input, error) in cases {
        assert_eq!(dechunk(input), Err(*error), "{:?}", String::from_utf8_lossy(input));
    }
}

#[test]
fn dechunker_keeps_data_decoded_before_an_error() {
    let mut d = Dechunker::default();
    let mut out = Vec::new();
    assert_eq!(d.feed(b"3\r\nabc\r\nz", &mut out, |_| {}), Err("invalid chunk size line: missing size digit"));
    assert_eq!(out, b"3\r\nabc\r\n");
}

#[test]
fn dechunker_limits_extensions() {
    // Extension bytes (after the `;`, up to the CR) count over the whole body.
    let limit = EXTENSIONS_LIMIT as usize;
    let body = |ext: &[usize]| {
        let mut s: String = ext.iter().map(|&n| format!("1;{}\r\nx\r\n", "e".repeat(n))).collect();
        s.push_str("0\r\n\r\n");
        s.into_bytes()
    };
    let ok = body(&[limit - 1]);
    assert_eq!(dechunk(&ok), Ok((ok.len(), b"1\r\nx\r\n0\r\n\r\n".to_vec())));
    assert_eq!(dechunk(&body(&[limit])), Err("chunk extensions over the limit"));
    let ok = body(&[limit / 2, limit / 2 - 1]);
    assert_eq!(dechunk(&ok).map(|(n, _)| n), Ok(ok.len()));
    assert_eq!(dechunk(&body(&[limit / 2, limit / 2])), Err("chunk extensions over the limit"));
}

#[test]
fn dechunker_limits_trailers() {
    // Bytes: as hyper counts them, the whole section (line ends and the
    // closing CRLF included) must stay under 16 KiB.
    let trailer = |len: usize| format!("0\r\nx:{}\r\n\r\n", "t".repeat(len - 2)).into_bytes();
    let ok = trailer(TRAILER_LIMIT - 5);
    assert_eq!(dechunk(&ok), Ok((ok.len(), b"0\r\n\r\n".to_vec())));
    assert_eq!(dechunk(&trailer(TRAILER_LIMIT - 4)), Err("chunk trailers over the limit"));
    assert_eq!(dechunk(&trailer(20_000)), Err("chunk trailers over the limit"));

    // Lines: at most 100.
    let lines = |n: usize| format!("0\r\n{}\r\n", "a: b\r\n".repeat(n)).into_bytes();
    let ok = lines(TRAILER_COUNT);
    assert_eq!(dechunk(&ok), Ok((ok.len(), b"0\r\n\r\n".to_vec())));
    assert_eq!(dechunk(&lines(TRAILER_COUNT + 1)), Err("too many chunk trailers"));
}

#[test]
fn dechunker_trailer_limit_matches_hypers() {
    // hyper 1.12 buffers every trailer byte, CRLFs and the closing CRLF
    // included, and fails once it holds 16 KiB: one 16,380-byte line is
    // 16,384 bytes with its CRLF and the closing CRLF.
    let input = format!("0\r\nx:{}\r\n\r\n", "t".repeat(16_380 - 2));
    assert_eq!(dechunk(input.as_bytes()), Err("chunk trailers over the limit"));
}

#[test]
fn dechunker_rejects_malformed_trailers_like_hyper() {
    // hyper 1.12 parses the trailer section with httparse at the end of the
    // body and fails the body when it is not a valid field section.
    for input in [&b"0\r\nno colon here\r\n\r\n"[..], b"0\r\nbad name: x\r\n\r\n", b"0\r\n: x\r\n\r\n"] {
        assert!(dechunk(input).is_err(), "{:?}", String::from_utf8_lossy(input));
    }
}

#[test]
fn push_chunk_formats() {
    let mut out = b"x".to_vec();
    push_chunk(&mut out, b"");
    assert_eq!(out, b"x");

    let data = vec![b'd'; 255];
    let mut out = Vec::new();
    push_chunk(&mut out, &data);
    assert_eq!(&out[..4], b"ff\r\n");
    assert_eq!(&out[4..259], &data[..]);
    assert_eq!(&out[259..], b"\r\n");

    for (len, size) in [(1, "1"), (10, "a"), (16, "10"), (4096, "1000"), (65_535, "ffff")] {
        let mut out = Vec::new();
        push_chunk(&mut out, &vec![b'z'; len]);
        assert_eq!(&out[..size.len() + 2], format!("{size}\r\n").as_bytes(), "{len}");
        assert_eq!(out.len(), size.len() + 2 + len + 2, "{len}");
        assert!(out.ends_with(b"z\r\n"));
    }
}
