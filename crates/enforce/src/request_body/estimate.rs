//! An LLM call's tokens, estimated at admission from its request: the
//! prompt's characters ÷ 4, rounded up, plus the output limit the request
//! sets (or the entry's `default_output_tokens`).
//!
//! The prompt is the text a user would call it:
//!
//! - OpenAI Chat Completions: each of `messages`' `content`;
//! - OpenAI Responses: `instructions`, and `input` (a string, or items whose
//!   `content` counts);
//! - Anthropic Messages: `system`, and each of `messages`' `content`.
//!
//! A `content` (or `system`) is a string, or a list of parts whose `text`
//! counts; a part that holds a `content` of its own (a tool's result) counts
//! it too. Images, audio, files, tool definitions and tool calls do not
//! count: the settle charges them once the answer says what they cost.

use serde_json::Value;

use usher_core::config::routes::{Estimate, LlmApi};

/// Characters per token, the usual rule of thumb for English text.
const CHARS_PER_TOKEN: usize = 4;

/// How deep parts holding a `content` of their own are followed.
const MAX_NESTING: usize = 2;

/// The (input, output) tokens of the call `doc` asks for; None when `doc`
/// is not a JSON object.
pub fn tokens(estimate: &Estimate, doc: &Value) -> Option<(u64, u64)> {
    let doc = doc.as_object()?;
    let field = |name: &str| doc.get(name);
    let (chars, limits): (usize, &[&str]) = match estimate.api {
        LlmApi::OpenAi => (
            messages(field("messages"))
                + field("instructions").map_or(0, |v| content(v, 0))
                + field("input").map_or(0, input),
            &["max_completion_tokens", "max_output_tokens", "max_tokens"],
        ),
        LlmApi::Anthropic => {
            (messages(field("messages")) + field("system").map_or(0, |v| content(v, 0)), &["max_tokens"])
        }
    };
    let output = limits.iter().find_map(|name| field(name).and_then(Value::as_u64));
    Some((chars.div_ceil(CHARS_PER_TOKEN) as u64, output.unwrap_or(estimate.default_output_tokens)))
}

/// The characters of a list of messages' `content`.
fn messages(list: Option<&Value>) -> usize {
    let Some(Value::Array(list)) = list else { return 0 };
    list.iter().map(|m| m.get("content").map_or(0, |c| content(c, 0))).sum()
}

/// The characters of a Responses API `input`: a string, or items whose `content` counts.
fn input(v: &Value) -> usize {
    match v {
        Value::Array(items) => items.iter().map(|i| i.get("content").map_or(0, |c| content(c, 0))).sum(),
        _ => content(v, 0),
    }
}

/// The characters of a `content`: a string, or parts whose `text` counts
/// (and the `content` of a part that holds one, `depth` levels down).
fn content(v: &Value, depth: usize) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => s.chars().count(),
                _ => {
                    let text = p.get("text").and_then(Value::as_str).map_or(0, |t| t.chars().count());
                    let inner = match p.get("content") {
                        Some(c) if depth < MAX_NESTING => content(c, depth + 1),
                        _ => 0,
                    };
                    text + inner
                }
            })
            .sum(),
        _ => 0,
    }
}
