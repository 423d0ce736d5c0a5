//! What a stand-in reads from a request's JSON body: the prompt's length,
//! the output limit, and whether to stream and report usage.

use serde_json::Value;

use super::Endpoint;

/// The parts of a request body that decide its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) model: String,
    /// Characters of the prompt's text.
    pub(crate) prompt_chars: u64,
    /// The output limit the request sets.
    pub(crate) limit: Option<u64>,
    pub(crate) stream: bool,
    /// `stream_options.include_usage: true` (Chat Completions only).
    pub(crate) include_usage: bool,
}

impl Ask {
    /// Input tokens: the prompt's characters ÷ 4, rounded up, at least 1.
    pub(crate) fn input_tokens(&self) -> u64 {
        self.prompt_chars.div_ceil(4).max(1)
    }
}

/// Reads `body` as a request to `endpoint`; `Err` says what the API would
/// say in its 400.
pub(crate) fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Ask, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("We could not parse the JSON body: {e}"))?;
    let model = v["model"].as_str().unwrap_or("").to_string();
    let stream = v["stream"].as_bool().unwrap_or(false);
    let number = |k: &str| v[k].as_u64();
    let (prompt_chars, limit) = match endpoint {
        Endpoint::Chat => {
            let messages = v["messages"].as_array().ok_or("'messages' is a required property")?;
            let chars = messages.iter().map(|m| text_chars(&m["content"])).sum();
            (chars, number("max_completion_tokens").or(number("max_tokens")))
        }
        Endpoint::Responses => {
            let input = match &v["input"] {
                Value::Array(items) => items.iter().map(|i| text_chars(&i["content"])).sum(),
                other => text_chars(other),
            };
            (input + text_chars(&v["instructions"]), number("max_output_tokens"))
        }
        Endpoint::Messages => {
            let messages = v["messages"].as_array().ok_or("messages: Field required")?;
            let limit = number("max_tokens").ok_or("max_tokens: Field required")?;
            let chars = messages.iter().map(|m| text_chars(&m["content"])).sum::<u64>() + text_chars(&v["system"]);
            (chars, Some(limit))
        }
    };
    let include_usage = endpoint == Endpoint::Chat && v["stream_options"]["include_usage"].as_bool() == Some(true);
    Ok(Ask { model, prompt_chars, limit, stream, include_usage })
}

/// Characters of text in a message's content: a string, or a list of parts
/// whose `text` counts (`{"type": "text", "text": ...}`, `input_text`).
fn text_chars(content: &Value) -> u64 {
    match content {
        Value::String(s) => s.chars().count() as u64,
        Value::Array(parts) => parts.iter().map(|p| p["text"].as_str().map_or(0, |t| t.chars().count() as u64)).sum(),
        _ => 0,
    }
}
