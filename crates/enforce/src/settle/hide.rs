//! The usage an app did not ask for, taken out of an OpenAI stream.
//!
//! For a streamed Chat Completions request without
//! `stream_options.include_usage`, usher asks for it on the app's behalf
//! (the request side marks the request so). OpenAI then sends two things
//! the app would not have seen: a last chunk that carries only the usage,
//! with `"choices": []` (clients that read `choices[0]` of every chunk fail
//! on it), and a `"usage": null` member in every other chunk. [`judge`]
//! drops the first and cuts the second out, so that the app receives the
//! bytes it would have received without usher.

use std::ops::Range;

use super::events::Verdict;

/// What becomes of an event whose data is `data`: a chunk whose top-level
/// `usage` is an object and whose `choices` is empty or absent is dropped;
/// any other top-level `usage` member is cut out, with its comma; anything
/// else (another event, data that is not a JSON object) is kept.
pub(crate) fn judge(data: &[u8]) -> Verdict {
    let (mut usage, mut choices) = (None, None);
    let whole = members(data, |m| match m.key(data) {
        b"usage" => usage = Some(m),
        b"choices" => choices = Some(m.value),
        _ => {}
    });
    let (true, Some(usage)) = (whole, usage) else { return Verdict::Keep };
    if data[usage.value.start] == b'{' && choices.is_none_or(|c| is_empty_array(&data[c])) {
        return Verdict::Drop;
    }
    Verdict::Cut(usage.with_comma)
}

/// A member of a JSON object: where its key (within quotes) and value are,
/// and the bytes to cut to remove it (with the comma before it, or for the
/// first member the one after it).
#[derive(Debug)]
struct Member {
    key: Range<usize>,
    value: Range<usize>,
    with_comma: Range<usize>,
}

impl Member {
    fn key<'d>(&self, data: &'d [u8]) -> &'d [u8] {
        &data[self.key.clone()]
    }
}

/// Hands each member of the JSON object `data` (with blanks around it) to
/// `each`, not looking inside their values; false when `data` is not one
/// object (what came before was handed all the same).
fn members(data: &[u8], mut each: impl FnMut(Member)) -> bool {
    let mut at = skip_blanks(data, 0);
    if data.get(at) != Some(&b'{') {
        return false;
    }
    at = skip_blanks(data, at + 1);
    if data.get(at) == Some(&b'}') {
        return true;
    }
    // The end of the value before: a member after the first goes with what follows it (its comma).
    let mut before: Option<usize> = None;
    loop {
        let Some(m) = member(data, at) else { return false };
        let end = m.value.end;
        at = skip_blanks(data, end);
        let next = match data.get(at) {
            Some(b',') => Some(skip_blanks(data, at + 1)),
            Some(b'}') => None,
            _ => return false,
        };
        let with_comma = match before {
            Some(b) => b..end,
            // The first member goes with its comma, up to the next key.
            None => m.with_comma.start..next.unwrap_or(end),
        };
        each(Member { with_comma, ..m });
        before = Some(end);
        match next {
            Some(n) => at = n,
            None => return true,
        }
    }
}

/// The member whose key starts (with its quote) at `at`.
fn member(data: &[u8], at: usize) -> Option<Member> {
    let key_end = string_end(data, at)?;
    let colon = skip_blanks(data, key_end);
    if data.get(colon) != Some(&b':') {
        return None;
    }
    let value_start = skip_blanks(data, colon + 1);
    let value_end = value_end(data, value_start)?;
    Some(Member { key: at + 1..key_end - 1, value: value_start..value_end, with_comma: at..value_end })
}

fn skip_blanks(data: &[u8], mut at: usize) -> usize {
    while data.get(at).is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Where the string that starts (with its quote) at `at` ends: after its closing quote.
fn string_end(data: &[u8], at: usize) -> Option<usize> {
    if data.get(at) != Some(&b'"') {
        return None;
    }
    let mut i = at + 1;
    loop {
        i += memchr::memchr2(b'"', b'\\', data.get(i..)?)?;
        match data[i] {
            b'\\' => i += 2,
            _ => return Some(i + 1),
        }
    }
}

/// Where the value that starts at `at` ends: at the `,` or `}` that
/// follows it at its object's level, less the blanks before them.
fn value_end(data: &[u8], at: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = at;
    let mut end = at;
    loop {
        match *data.get(i)? {
            b'"' => {
                i = string_end(data, i)?;
                end = i;
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' if depth > 0 => depth -= 1,
            b',' | b'}' if depth == 0 => return (end > at).then_some(end),
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        i += 1;
        end = i;
    }
}

fn is_empty_array(value: &[u8]) -> bool {
    value.first() == Some(&b'[') && skip_blanks(value, 1) == value.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(data: &str) -> Option<String> {
        match judge(data.as_bytes()) {
            Verdict::Keep => Some(data.to_string()),
            Verdict::Drop => None,
            Verdict::Cut(r) => Some(format!("{}{}", &data[..r.start], &data[r.end..])),
        }
    }

    #[test]
    fn the_usage_chunk_goes_and_null_usage_is_cut_out() {
        let chunk = r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#;
        let plain = r#"{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        assert_eq!(apply(chunk).as_deref(), Some(plain));
        let usage = r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}"#;
        assert_eq!(apply(usage), None);
        assert_eq!(apply(r#"{"usage":{"total_tokens":1}}"#), None, "no choices at all: a usage chunk");
        for (data, want) in [
            (r#"{"usage":null,"id":"x"}"#, r#"{"id":"x"}"#),
            (r#"{"usage":null}"#, "{}"),
            (r#"{ "id" : "x" , "usage" : null }"#, r#"{ "id" : "x" }"#),
            (r#"{ "usage" : null , "id" : 1 }"#, r#"{ "id" : 1 }"#),
            (r#"{"a":"}\",","usage":null,"b":[1,{"usage":null}]}"#, r#"{"a":"}\",","b":[1,{"usage":null}]}"#),
            // Usage beside content (servers that report it on every chunk): the member goes, the chunk stays.
            (r#"{"choices":[{"delta":{}}],"usage":{"total_tokens":3}}"#, r#"{"choices":[{"delta":{}}]}"#),
        ] {
            assert_eq!(apply(data).as_deref(), Some(want), "{data}");
        }
    }

    #[test]
    fn anything_else_is_kept_as_it_is() {
        for data in [
            "[DONE]",
            r#"{"id":"x","choices":[]}"#,
            r#"{"content":"\"usage\":null"}"#,
            r#"{"nested":{"usage":null}}"#,
            r#"{"type":"response.completed","response":{"usage":{"total_tokens":5}}}"#,
            r#"{"usage":null"#,
            r#"{"usage"}"#,
            "",
            "{}",
            r#"["usage",null]"#,
        ] {
            assert_eq!(apply(data).as_deref(), Some(data), "{data}");
        }
    }
}
