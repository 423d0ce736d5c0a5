//! Asking OpenAI for a streamed call's usage on the app's behalf: a
//! streamed Chat Completions request (`"stream": true`, with `messages`)
//! that does not set `stream_options.include_usage: true` gets it, so that
//! the stream's last chunk says what the call cost.
//!
//! The body is edited in place, byte for byte: the member is added after
//! the last member of the object it goes in (`stream_options`, made when
//! absent), or the value of an `include_usage` other than `true` becomes
//! `true`, or a `"stream_options": null` becomes the object. Nothing else in
//! the body changes: not its spacing, key order, escapes or numbers.

use serde_json::Value;

/// Whether the request `doc` is a streamed Chat Completions call that has
/// not asked for its usage. (The Responses API, with `input` instead of
/// `messages`, reports usage in its last event without being asked.)
pub fn wanted(doc: &Value) -> bool {
    doc.get("stream") == Some(&Value::Bool(true))
        && doc.get("messages").is_some()
        && doc.pointer("/stream_options/include_usage") != Some(&Value::Bool(true))
}

/// `body` (one JSON object) with `stream_options.include_usage: true` set;
/// None when it cannot be set: the body is not an object, or its
/// `stream_options` is neither an object nor null.
pub fn add(body: &[u8]) -> Option<Vec<u8>> {
    let root = skip_ws(body, 0);
    let (open, members) = object(body, root)?;
    let edit = match members.iter().rev().find(|m| m.key_is(body, "stream_options")) {
        None => insert(open, &members, br#""stream_options":{"include_usage":true}"#),
        Some(m) if &body[m.value.clone()] == b"null" => Edit::Replace(m.value.clone(), br#"{"include_usage":true}"#),
        Some(m) => {
            let (open, inner) = object(body, m.value.start)?;
            match inner.iter().rev().find(|m| m.key_is(body, "include_usage")) {
                None => insert(open, &inner, br#""include_usage":true"#),
                Some(m) => Edit::Replace(m.value.clone(), b"true"),
            }
        }
    };
    let (at, comma, text) = match edit {
        Edit::Insert(at, comma, text) => (at..at, comma, text),
        Edit::Replace(span, text) => (span, false, text),
    };
    let mut out = Vec::with_capacity(body.len() + text.len() + 1);
    out.extend_from_slice(&body[..at.start]);
    if comma {
        out.push(b',');
    }
    out.extend_from_slice(text);
    out.extend_from_slice(&body[at.end..]);
    Some(out)
}

/// One change to the body.
enum Edit {
    /// At this offset, after a comma when the object has members already, this member.
    Insert(usize, bool, &'static [u8]),
    /// This value's bytes become these.
    Replace(std::ops::Range<usize>, &'static [u8]),
}

/// Adds `member` to the object that opens at `open`: after its last member, or first.
fn insert(open: usize, members: &[Member], member: &'static [u8]) -> Edit {
    match members.last() {
        Some(last) => Edit::Insert(last.value.end, true, member),
        None => Edit::Insert(open + 1, false, member),
    }
}

/// An object member's key (with its quotes) and value, as byte ranges.
struct Member {
    key: std::ops::Range<usize>,
    value: std::ops::Range<usize>,
}

impl Member {
    /// Whether the member's key is `name` (escapes decoded).
    fn key_is(&self, body: &[u8], name: &str) -> bool {
        let raw = &body[self.key.clone()];
        match raw.contains(&b'\\') {
            false => raw.len() >= 2 && &raw[1..raw.len() - 1] == name.as_bytes(),
            true => serde_json::from_slice::<String>(raw).is_ok_and(|k| k == name),
        }
    }
}

// The scanner below reads bodies serde_json has already found to be one
// JSON document: it finds where things are, and checks nothing more. It
// still never reads past the body's end, whatever the bytes.

/// The members of the object whose `{` is at `at`; None when no object is there.
fn object(b: &[u8], at: usize) -> Option<(usize, Vec<Member>)> {
    if b.get(at) != Some(&b'{') {
        return None;
    }
    let mut members = Vec::new();
    let mut i = skip_ws(b, at + 1);
    if b.get(i) == Some(&b'}') {
        return Some((at, members));
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key = i..skip_string(b, i);
        i = skip_ws(b, key.end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let value = start..skip_value(b, start);
        i = skip_ws(b, value.end);
        members.push(Member { key, value });
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return Some((at, members)),
            _ => return None,
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The end of the string whose opening quote is at `i`.
fn skip_string(b: &[u8], mut i: usize) -> usize {
    i += 1;
    while let Some(&c) = b.get(i) {
        match c {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// The end of the value that starts at `i`.
fn skip_value(b: &[u8], i: usize) -> usize {
    match b.get(i) {
        Some(b'"') => skip_string(b, i),
        Some(b'{' | b'[') => {
            let (mut depth, mut j) = (0usize, i);
            while let Some(&c) = b.get(j) {
                match c {
                    b'"' => {
                        j = skip_string(b, j);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return j + 1;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            b.len()
        }
        _ => {
            let len =
                b[i.min(b.len())..].iter().position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'));
            len.map_or(b.len(), |n| i + n)
        }
    }
}
