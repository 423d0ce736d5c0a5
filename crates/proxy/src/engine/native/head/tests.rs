use super::*;
use crate::engine::native::fields::tokens;

/// What [`parse`] made of an input, owned so it outlives the parser's storage.
#[derive(Debug, PartialEq)]
enum Out {
    Partial { head_complete: bool },
    Ready { method: Method, head_len: usize, body_len: usize, close: bool },
    HandOff(&'static str),
}

fn run_with(input: &[u8], limits: &ListenerLimits) -> Out {
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    match parse(input, &mut storage, limits) {
        Parsed::Partial { head_complete } => Out::Partial { head_complete },
        Parsed::Ready(h) => {
            Out::Ready { method: h.method.clone(), head_len: h.head_len, body_len: h.body_len, close: h.close }
        }
        Parsed::HandOff(reason) => Out::HandOff(reason),
    }
}

fn run(input: &[u8]) -> Out {
    run_with(input, &ListenerLimits::default())
}

/// A GET for `/` with one Host field, then `fields` (each ending in CRLF).
fn get_with(fields: &str) -> Vec<u8> {
    format!("GET / HTTP/1.1\r\nHost: a.test\r\n{fields}\r\n").into_bytes()
}

fn ready_get(input: &[u8]) -> Out {
    Out::Ready { method: Method::GET, head_len: input.len(), body_len: 0, close: false }
}

#[track_caller]
fn assert_hand_off(input: &[u8], limits: &ListenerLimits, reason: &'static str) {
    assert_eq!(run_with(input, limits), Out::HandOff(reason), "input {:?}", String::from_utf8_lossy(input));
}

#[track_caller]
fn assert_default_hand_off(input: &[u8], reason: &'static str) {
    assert_hand_off(input, &ListenerLimits::default(), reason);
}

/// Encodes the request in `input` (which must be Ready) for an upstream at `prefix` and `host`.
fn encoded(input: &[u8], prefix: &str, host: &str) -> String {
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let Parsed::Ready(h) = parse(input, &mut storage, &ListenerLimits::default()) else {
        panic!("not Ready: {:?}", String::from_utf8_lossy(input));
    };
    let mut out = b"left alone|".to_vec();
    h.encode(prefix, host.as_bytes(), &input[h.head_len..h.head_len + h.body_len], &mut out);
    let out = String::from_utf8(out).expect("UTF-8");
    out.strip_prefix("left alone|").expect("encode appends to `out`").to_string()
}

// === Ready and Partial ===

#[test]
fn get_is_ready() {
    let input = b"GET /a/b?c=d HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n\r\n";
    assert_eq!(run(input), Out::Ready { method: Method::GET, head_len: 52, body_len: 0, close: false });
    assert_eq!(input.len(), 52);
}

#[test]
fn post_with_content_length_is_ready_and_stops_at_its_body() {
    let head = "POST /items HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n";
    // A pipelined request follows the body: it is not part of this one.
    let input = format!("{head}helloGET / HTTP/1.1\r\nHost: a.test\r\n\r\n");
    assert_eq!(
        run(input.as_bytes()),
        Out::Ready { method: Method::POST, head_len: head.len(), body_len: 5, close: false }
    );
}

#[test]
fn content_length_zero_and_leading_zeros() {
    let input = b"PUT /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(run(input), Out::Ready { method: Method::PUT, head_len: input.len(), body_len: 0, close: false });
    let head = "PUT /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 003\r\n\r\n";
    let input = format!("{head}abc");
    assert_eq!(
        run(input.as_bytes()),
        Out::Ready { method: Method::PUT, head_len: head.len(), body_len: 3, close: false }
    );
}

#[test]
fn incomplete_head_is_partial() {
    assert_eq!(run(b""), Out::Partial { head_complete: false });
    assert_eq!(run(b"GET / HT"), Out::Partial { head_complete: false });
    assert_eq!(run(b"GET / HTTP/1.1\r\nHost: a.test\r\n"), Out::Partial { head_complete: false });
    assert_eq!(run(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r"), Out::Partial { head_complete: false });
}

#[test]
fn complete_head_with_part_of_its_body_is_partial() {
    let head = "POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n";
    assert_eq!(run(head.as_bytes()), Out::Partial { head_complete: true });
    assert_eq!(run(format!("{head}hell").as_bytes()), Out::Partial { head_complete: true });
    assert_eq!(
        run(format!("{head}hello").as_bytes()),
        Out::Ready { method: Method::POST, head_len: head.len(), body_len: 5, close: false }
    );
}

#[test]
fn connection_close_sets_close() {
    for value in ["close", "keep-alive, close", "CLOSE", " close ,", "upgrade-not, close"] {
        let input = get_with(&format!("Connection: {value}\r\n"));
        assert_eq!(
            run(&input),
            Out::Ready { method: Method::GET, head_len: input.len(), body_len: 0, close: true },
            "Connection: {value}"
        );
    }
    // Close in a second Connection field counts too.
    let input = get_with("Connection: keep-alive\r\nConnection: close\r\n");
    assert_eq!(run(&input), Out::Ready { method: Method::GET, head_len: input.len(), body_len: 0, close: true });
}

#[test]
fn other_connection_values_do_not_close() {
    for value in ["keep-alive", "closed", "x-close", "clo se"] {
        let input = get_with(&format!("Connection: {value}\r\n"));
        assert_eq!(run(&input), ready_get(&input), "Connection: {value}");
    }
}

#[test]
fn every_allowed_target_byte_is_ready() {
    let input = b"GET /aZ09-._~!$&'()*+,;=:@%20/?q=1&r=/? HTTP/1.1\r\nHost: a.test\r\n\r\n";
    assert_eq!(run(input), ready_get(input));
}

#[test]
fn ordinary_content_type_and_via_are_ready() {
    for fields in ["Content-Type: application/json\r\n", "Via: 1.1 proxy\r\n", "Content-Type: text/grpc\r\n"] {
        let input = get_with(fields);
        assert_eq!(run(&input), ready_get(&input), "{fields:?}");
    }
}

// === hand-offs ===

#[test]
fn http_1_0_is_handed_off() {
    assert_default_hand_off(b"GET / HTTP/1.0\r\nHost: a.test\r\n\r\n", why::VERSION);
}

#[test]
fn connect_is_handed_off() {
    assert_default_hand_off(b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n", why::CONNECT);
}

#[test]
fn targets_other_than_plain_origin_form_are_handed_off() {
    for target in [
        "http://a.test/",
        "a.test:80",
        "*",
        "/a\"b",
        "/{x}",
        "/a#frag",
        "/a\\b",
        "/a|b",
        "/a^b",
        "/a`b",
        "/a[0]",
        "/caf\u{e9}",
    ] {
        let input = format!("GET {target} HTTP/1.1\r\nHost: a.test\r\n\r\n");
        assert_default_hand_off(input.as_bytes(), why::TARGET);
    }
}

#[test]
fn zero_or_two_hosts_are_handed_off() {
    assert_default_hand_off(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", why::HOST);
    assert_default_hand_off(b"GET / HTTP/1.1\r\nHost: a.test\r\nhost: b.test\r\n\r\n", why::HOST);
    assert_default_hand_off(b"GET / HTTP/1.1\r\nHost: a.test\r\nHOST: a.test\r\n\r\n", why::HOST);
}

#[test]
fn hosts_other_than_a_plain_name_and_port_are_handed_off() {
    for host in ["a.test", "A-b_c.test", "127.0.0.1", "a.test:8", "127.0.0.1:65535", "a:00080"] {
        let input = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
        assert_eq!(run(input.as_bytes()), ready_get(input.as_bytes()), "{host}");
    }
    for host in ["", "x:abc", "x:", "x:65536", "x:123456", ":80", "[::1]:80", "u@x", "a b", "x:8:9", "x;y"] {
        let input = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
        assert_default_hand_off(input.as_bytes(), why::HOST);
    }
}

#[test]
fn doubtful_content_lengths_are_handed_off() {
    // Two fields, even when they agree.
    assert_default_hand_off(&get_with("Content-Length: 5\r\nContent-Length: 5\r\n"), why::CONTENT_LENGTH);
    for value in ["+5", "-5", "5,5", "5, 5", "", "0x5", "5 5", "five", "12345678901234567890"] {
        assert_default_hand_off(&get_with(&format!("Content-Length: {value}\r\n")), why::CONTENT_LENGTH);
    }
    // 19 digits is a length (then too long a body); 20 is not.
    assert_default_hand_off(&get_with("Content-Length: 9999999999999999999\r\n"), why::BODY);
}

#[test]
fn transfer_encoding_expect_upgrade_and_te_are_handed_off() {
    assert_default_hand_off(&get_with("Transfer-Encoding: chunked\r\n"), why::TRANSFER_ENCODING);
    assert_default_hand_off(&get_with("transfer-encoding: identity\r\n"), why::TRANSFER_ENCODING);
    assert_default_hand_off(&get_with("Expect: 100-continue\r\n"), why::EXPECT);
    assert_default_hand_off(&get_with("Upgrade: websocket\r\n"), why::UPGRADE);
    assert_default_hand_off(&get_with("TE: trailers\r\n"), why::TE);
}

#[test]
fn more_than_four_connection_fields_are_handed_off() {
    let four = "Connection: keep-alive\r\n".repeat(4);
    let input = get_with(&four);
    assert_eq!(run(&input), ready_get(&input));
    assert_default_hand_off(&get_with(&format!("{four}Connection: keep-alive\r\n")), why::CONNECTION);
}

#[test]
fn grpc_is_handed_off() {
    for value in ["application/grpc", "application/grpc+proto", "Application/GRPC+json"] {
        assert_default_hand_off(&get_with(&format!("Content-Type: {value}\r\n")), why::GRPC);
    }
}

#[test]
fn a_request_usher_already_forwarded_is_handed_off() {
    assert_default_hand_off(&get_with("Via: 1.1 usher\r\n"), why::LOOP);
    assert_default_hand_off(&get_with("Via: 1.0 fred, 1.1 usher\r\n"), why::LOOP);
}

#[test]
fn large_bodies_are_handed_off() {
    let at_max = format!("POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: {MAX_BODY}\r\n\r\n");
    assert_eq!(run(at_max.as_bytes()), Out::Partial { head_complete: true });
    let over = format!("POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: {}\r\n\r\n", MAX_BODY + 1);
    assert_default_hand_off(over.as_bytes(), why::BODY);

    let limits = ListenerLimits { max_body_bytes: Some(4), ..ListenerLimits::default() };
    let four = b"POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 4\r\n\r\nabcd";
    assert_eq!(
        run_with(four, &limits),
        Out::Ready { method: Method::POST, head_len: four.len() - 4, body_len: 4, close: false }
    );
    assert_hand_off(b"POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nabcde", &limits, why::BODY);
}

#[test]
fn a_head_over_max_header_bytes_is_handed_off() {
    let limits = ListenerLimits { max_header_bytes: 8192, ..ListenerLimits::default() };
    // Complete, and one byte too long.
    let fill = "x".repeat(8192 - get_with("X-Fill: \r\n").len() + 1);
    let input = get_with(&format!("X-Fill: {fill}\r\n"));
    assert_eq!(input.len(), 8193);
    assert_hand_off(&input, &limits, why::HEAD_LIMITS);
    // Exactly at the limit.
    let input = get_with(&format!("X-Fill: {}\r\n", &fill[1..]));
    assert_eq!(input.len(), 8192);
    assert_eq!(run_with(&input, &limits), ready_get(&input));
    // Incomplete: waits up to the limit, then hands off.
    let partial = format!("GET / HTTP/1.1\r\nX-Fill: {}", "x".repeat(9000));
    assert_eq!(run_with(&partial.as_bytes()[..8192], &limits), Out::Partial { head_complete: false });
    assert_hand_off(&partial.as_bytes()[..8193], &limits, why::HEAD_LIMITS);
}

#[test]
fn more_headers_than_max_headers_are_handed_off() {
    let limits = ListenerLimits { max_headers: 3, ..ListenerLimits::default() };
    let three = get_with("A: 1\r\nB: 2\r\n");
    assert_eq!(run_with(&three, &limits), ready_get(&three));
    assert_hand_off(&get_with("A: 1\r\nB: 2\r\nC: 3\r\n"), &limits, why::HEAD_LIMITS);

    // More than the parser has room for, whatever the limit.
    let limits = ListenerLimits { max_headers: 10_000, ..ListenerLimits::default() };
    let many: String = (0..MAX_HEADERS).map(|i| format!("X-{i}: {i}\r\n")).collect();
    assert_hand_off(&get_with(&many), &limits, why::HEAD_LIMITS);
    let fits: String = (0..MAX_HEADERS - 1).map(|i| format!("X-{i}: {i}\r\n")).collect();
    let input = get_with(&fits);
    assert_eq!(run_with(&input, &limits), ready_get(&input));
}

#[test]
fn malformed_heads_are_handed_off() {
    for input in [
        &b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\n: empty name\r\n\r\n",
        b"GET  / HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"GET / HTTP/2.0\r\nHost: a.test\r\n\r\n",
        b"GET / HTTP/1.1 \r\nHost: a.test\r\n\r\n",
        b"G(T / HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"\x01GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"GET /\xff HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\x00.test\r\n\r\n",
    ] {
        assert_default_hand_off(input, why::MALFORMED);
    }
}

// === encode ===

#[test]
fn encode_rewrites_target_and_host_and_drops_hop_by_hop_fields() {
    let input = b"POST /items?id=7 HTTP/1.1\r\n\
        Accept: */*\r\n\
        Host: client.local\r\n\
        Connection: keep-alive\r\n\
        x-secret: s3cr3t\r\n\
        Keep-Alive: timeout=5\r\n\
        Content-Type: text/plain\r\n\
        Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
        Proxy-Connection: keep-alive\r\n\
        Connection: X-Secret\r\n\
        X-Request-ID: AbC\r\n\
        Content-Length: 5\r\n\
        \r\n\
        hello";
    assert_eq!(
        encoded(input, "/v2", "api.example.com:8080"),
        "POST /v2/items?id=7 HTTP/1.1\r\n\
         host: api.example.com:8080\r\n\
         Accept: */*\r\n\
         Content-Type: text/plain\r\n\
         X-Request-ID: AbC\r\n\
         Content-Length: 5\r\n\
         via: 1.1 usher\r\n\
         \r\n\
         hello"
    );
}

#[test]
fn encode_without_prefix_or_body() {
    let input = b"DELETE /a?b HTTP/1.1\r\nHost: h\r\nX-One: 1\r\nx-two: 2\r\n\r\n";
    assert_eq!(
        encoded(input, "", "up:1"),
        "DELETE /a?b HTTP/1.1\r\nhost: up:1\r\nX-One: 1\r\nx-two: 2\r\nvia: 1.1 usher\r\n\r\n"
    );
}

#[test]
fn encode_keeps_the_body_length_when_connection_names_content_length() {
    // The general path drops the named field too, but hyper's client then
    // declares the body's length again. Here the body goes out undeclared,
    // so the upstream reads it as the start of the next request.
    let smuggled = "GET /admin HTTP/1.1\r\nHost: a.test\r\n\r\n";
    let input = format!(
        "POST /x HTTP/1.1\r\nHost: a.test\r\nConnection: content-length\r\nContent-Length: {}\r\n\r\n{smuggled}",
        smuggled.len()
    );
    match run(input.as_bytes()) {
        Out::HandOff(_) => {}
        Out::Ready { body_len, .. } => {
            assert_eq!(body_len, smuggled.len());
            let out = encoded(input.as_bytes(), "", "up");
            let head = out.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
            let declared = format!("\r\ncontent-length: {}\r\n", smuggled.len());
            assert!(head.contains(&declared), "the body goes upstream undeclared: {out:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// The request made for an h2 upstream ([`Head::request`]) carries the
/// target under the base path and the forwarded fields as received, and,
/// encoded for HTTP/1.1 after all ([`Head::encode_made`]), is the request
/// [`Head::encode`] writes (field names lower-cased, as h2 has them).
#[test]
fn a_request_made_for_h2_is_the_encoded_one() {
    let input = b"POST /items?id=7 HTTP/1.1\r\n\
        Accept: */*\r\n\
        Host: client.local\r\n\
        Connection: X-Secret\r\n\
        x-secret: s3cr3t\r\n\
        Keep-Alive: timeout=5\r\n\
        X-Request-ID: AbC\r\n\
        Content-Length: 5\r\n\
        \r\n\
        hello";
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let Parsed::Ready(h) = parse(input, &mut storage, &ListenerLimits::default()) else { panic!("not Ready") };
    let req = h.request(&Uri::from_static("https://api.example.com:8080/v2/")).expect("a request http accepts");
    assert_eq!(
        (req.method(), req.uri().to_string()),
        (&Method::POST, "https://api.example.com:8080/v2/items?id=7".into())
    );
    let fields: Vec<(&str, &[u8])> = req.headers().iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
    assert_eq!(
        fields,
        [("accept", &b"*/*"[..]), ("x-request-id", b"AbC"), ("content-length", b"5"), ("via", VIA.as_bytes())]
    );
    let mut made = Vec::new();
    Head::encode_made(&req, b"api.example.com:8080", b"hello", &mut made);
    let made = String::from_utf8(made).unwrap();
    assert_eq!(
        made,
        "POST /v2/items?id=7 HTTP/1.1\r\nhost: api.example.com:8080\r\naccept: */*\r\nx-request-id: AbC\r\n\
         content-length: 5\r\nvia: 1.1 usher\r\n\r\nhello"
    );
    // Field names aside, what `encode` writes.
    let names_lowered = |s: String| -> String {
        let (head, body) = s.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        let first = lines.next().unwrap().to_string();
        let fields = lines.map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            format!("{}:{v}", n.to_ascii_lowercase())
        });
        let mut out = std::iter::once(first).chain(fields).collect::<Vec<_>>().join("\r\n");
        out.push_str("\r\n\r\n");
        out + body
    };
    assert_eq!(made, names_lowered(encoded(input, "/v2", "api.example.com:8080")));
}

// === RequestView and idempotence ===

#[test]
fn request_view() {
    let input = b"GET /api/items?x=1&y=2 HTTP/1.1\r\nHost: a.test\r\nX-Trace: one\r\nx-trace: two\r\nEmpty:\r\n\r\n";
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let Parsed::Ready(h) = parse(input, &mut storage, &ListenerLimits::default()) else { panic!("not Ready") };
    assert_eq!(h.method(), &Method::GET);
    assert_eq!(h.path(), "/api/items");
    assert_eq!(h.uri_host(), None);
    assert_eq!(h.header("x-trace"), Some(&b"one"[..]));
    assert_eq!(h.header("host"), Some(&b"a.test"[..]));
    assert_eq!(h.header("empty"), Some(&b""[..]));
    assert_eq!(h.header("x-missing"), None);
    assert_eq!(h.header("x-trac"), None);

    let input = b"GET /plain HTTP/1.1\r\nHost: a.test\r\n\r\n";
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let Parsed::Ready(h) = parse(input, &mut storage, &ListenerLimits::default()) else { panic!("not Ready") };
    assert_eq!(h.path(), "/plain");

    let input = b"GET /?only=query HTTP/1.1\r\nHost: a.test\r\n\r\n";
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let Parsed::Ready(h) = parse(input, &mut storage, &ListenerLimits::default()) else { panic!("not Ready") };
    assert_eq!(h.path(), "/");
}

#[test]
fn idempotent_methods() {
    for (method, idempotent) in [
        ("GET", true),
        ("PUT", true),
        ("DELETE", true),
        ("HEAD", true),
        ("OPTIONS", true),
        ("POST", false),
        ("PATCH", false),
    ] {
        let input = format!("{method} / HTTP/1.1\r\nHost: a.test\r\n\r\n");
        let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let Parsed::Ready(h) = parse(input.as_bytes(), &mut storage, &ListenerLimits::default()) else {
            panic!("{method} not Ready")
        };
        assert_eq!(h.method.as_str(), method);
        assert_eq!(h.idempotent(), idempotent, "{method}");
    }
}

// === helpers ===

#[test]
fn field_helpers() {
    assert!(list_has(b"keep-alive, Close", b"close"));
    assert!(!list_has(b"keep-alive,closed", b"close"));
    assert_eq!(tokens(b" a ,, b,\t c ,").collect::<Vec<_>>(), [&b"a"[..], b"b", b"c"]);
    assert!(eq_name("Content-Length", "content-length"));
    assert!(!eq_name("Content-Lengt", "content-length"));
}
