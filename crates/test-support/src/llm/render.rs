//! The stand-ins' answers, byte for byte: whole JSON bodies, server-sent
//! event streams (one string per event, framed) and error bodies, in the
//! shapes and member order OpenAI's and Anthropic's APIs use.

/// One generated answer.
#[derive(Debug, Clone)]
pub(crate) struct Draft {
    /// Hex digits that make the answer's ids.
    pub(crate) id: String,
    pub(crate) model: String,
    /// Unix seconds at arrival.
    pub(crate) created: u64,
    pub(crate) input: u64,
    pub(crate) output: u64,
    /// The output stopped at the request's limit.
    pub(crate) capped: bool,
    /// The request's output limit, if it set one.
    pub(crate) limit: Option<u64>,
    /// The text, one piece per streamed event.
    pub(crate) pieces: Vec<String>,
}

impl Draft {
    fn text(&self) -> String {
        self.pieces.concat()
    }
}

/// `s` as a JSON string.
fn q(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// `data: JSON`, framed.
fn data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// `event: NAME` and `data: JSON`, framed.
fn event(name: &str, json: &str) -> String {
    format!("event: {name}\ndata: {json}\n\n")
}

// === OpenAI: Chat Completions ===

fn chat_usage(g: &Draft) -> String {
    format!(
        r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}"#,
        g.input,
        g.output,
        g.input + g.output
    )
}

fn finish_reason(g: &Draft) -> &'static str {
    if g.capped { "length" } else { "stop" }
}

/// A whole chat completion.
pub(crate) fn chat_json(g: &Draft) -> String {
    format!(
        r#"{{"id":"chatcmpl-{}","object":"chat.completion","created":{},"model":{},"choices":[{{"index":0,"message":{{"role":"assistant","content":{},"refusal":null,"annotations":[]}},"logprobs":null,"finish_reason":"{}"}}],"usage":{},"service_tier":"default","system_fingerprint":"fp_usher"}}"#,
        g.id,
        g.created,
        q(&g.model),
        q(&g.text()),
        finish_reason(g),
        chat_usage(g)
    )
}

/// A streamed chat completion's events. With `include_usage`, every chunk
/// ends in `"usage":null` and a chunk with empty `choices` carries the usage
/// just before `[DONE]`; without it, neither is there.
pub(crate) fn chat_stream(g: &Draft, include_usage: bool) -> Vec<String> {
    let head = format!(
        r#""id":"chatcmpl-{}","object":"chat.completion.chunk","created":{},"model":{},"service_tier":"default","system_fingerprint":"fp_usher""#,
        g.id,
        g.created,
        q(&g.model)
    );
    let tail = if include_usage { r#","usage":null"# } else { "" };
    let chunk = |choice: String| data(&format!(r#"{{{head},"choices":[{choice}]{tail}}}"#));
    let mut out = vec![chunk(
        r#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#
            .to_string(),
    )];
    for p in &g.pieces {
        out.push(chunk(format!(
            r#"{{"index":0,"delta":{{"content":{}}},"logprobs":null,"finish_reason":null}}"#,
            q(p)
        )));
    }
    out.push(chunk(format!(r#"{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{}"}}"#, finish_reason(g))));
    if include_usage {
        out.push(data(&format!(r#"{{{head},"choices":[],"usage":{}}}"#, chat_usage(g))));
    }
    out.push(data("[DONE]"));
    out
}

// === OpenAI: Responses ===

fn responses_usage(g: &Draft) -> String {
    format!(
        r#"{{"input_tokens":{},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{}}}"#,
        g.input,
        g.output,
        g.input + g.output
    )
}

/// The output message item; `text: None` while it is being written.
fn responses_item(g: &Draft, text: Option<&str>) -> String {
    let (status, content) = match text {
        None => ("in_progress", String::new()),
        Some(t) => (
            if g.capped { "incomplete" } else { "completed" },
            format!(r#"{{"type":"output_text","annotations":[],"logprobs":[],"text":{}}}"#, q(t)),
        ),
    };
    format!(r#"{{"id":"msg_{}","type":"message","status":"{status}","content":[{content}],"role":"assistant"}}"#, g.id)
}

/// The response object; `done: false` while in progress (no output, no usage).
fn responses_object(g: &Draft, done: bool) -> String {
    let status = match (done, g.capped) {
        (false, _) => "in_progress",
        (true, false) => "completed",
        (true, true) => "incomplete",
    };
    let incomplete =
        if done && g.capped { r#"{"reason":"max_output_tokens"}"#.to_string() } else { "null".to_string() };
    let (output, usage) =
        if done { (responses_item(g, Some(&g.text())), responses_usage(g)) } else { (String::new(), "null".into()) };
    let limit = g.limit.map_or("null".to_string(), |l| l.to_string());
    format!(
        r#"{{"id":"resp_{}","object":"response","created_at":{},"status":"{status}","error":null,"incomplete_details":{incomplete},"instructions":null,"max_output_tokens":{limit},"model":{},"output":[{output}],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{{"effort":null,"summary":null}},"store":true,"temperature":1.0,"text":{{"format":{{"type":"text"}}}},"tool_choice":"auto","tools":[],"top_p":1.0,"truncation":"disabled","usage":{usage},"user":null,"metadata":{{}}}}"#,
        g.id,
        g.created,
        q(&g.model)
    )
}

/// A whole response of the Responses API.
pub(crate) fn responses_json(g: &Draft) -> String {
    responses_object(g, true)
}

/// A streamed response's events, numbered by `sequence_number`.
pub(crate) fn responses_stream(g: &Draft) -> Vec<String> {
    let mut seq = 0;
    let mut out = Vec::new();
    let mut push = |name: &str, body: String| {
        out.push(event(name, &format!(r#"{{"type":"{name}","sequence_number":{seq},{body}}}"#)));
        seq += 1;
    };
    let at = format!(r#""item_id":"msg_{}","output_index":0,"content_index":0"#, g.id);
    let part = |t: &str| format!(r#"{{"type":"output_text","annotations":[],"logprobs":[],"text":{}}}"#, q(t));
    push("response.created", format!(r#""response":{}"#, responses_object(g, false)));
    push("response.in_progress", format!(r#""response":{}"#, responses_object(g, false)));
    push("response.output_item.added", format!(r#""output_index":0,"item":{}"#, responses_item(g, None)));
    push("response.content_part.added", format!(r#"{at},"part":{}"#, part("")));
    for p in &g.pieces {
        push("response.output_text.delta", format!(r#"{at},"delta":{},"logprobs":[]"#, q(p)));
    }
    let text = g.text();
    push("response.output_text.done", format!(r#"{at},"text":{},"logprobs":[]"#, q(&text)));
    push("response.content_part.done", format!(r#"{at},"part":{}"#, part(&text)));
    push("response.output_item.done", format!(r#""output_index":0,"item":{}"#, responses_item(g, Some(&text))));
    let last = if g.capped { "response.incomplete" } else { "response.completed" };
    push(last, format!(r#""response":{}"#, responses_object(g, true)));
    out
}

// === Anthropic: Messages ===

fn stop_reason(g: &Draft) -> &'static str {
    if g.capped { "max_tokens" } else { "end_turn" }
}

fn messages_usage(input: u64, output: u64) -> String {
    format!(
        r#"{{"input_tokens":{input},"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":{output},"service_tier":"standard"}}"#
    )
}

/// A whole message.
pub(crate) fn messages_json(g: &Draft) -> String {
    format!(
        r#"{{"id":"msg_{}","type":"message","role":"assistant","model":{},"content":[{{"type":"text","text":{}}}],"stop_reason":"{}","stop_sequence":null,"usage":{}}}"#,
        g.id,
        q(&g.model),
        q(&g.text()),
        stop_reason(g),
        messages_usage(g.input, g.output)
    )
}

/// A streamed message's events: `message_start` with the input tokens (and
/// 1 output token), the text block with a `ping` after its start,
/// `message_delta` with the output tokens, `message_stop`.
pub(crate) fn messages_stream(g: &Draft) -> Vec<String> {
    let mut out = vec![
        event(
            "message_start",
            &format!(
                r#"{{"type":"message_start","message":{{"id":"msg_{}","type":"message","role":"assistant","model":{},"content":[],"stop_reason":null,"stop_sequence":null,"usage":{}}}}}"#,
                g.id,
                q(&g.model),
                messages_usage(g.input, 1)
            ),
        ),
        event(
            "content_block_start",
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        ),
        event("ping", r#"{"type": "ping"}"#),
    ];
    for p in &g.pieces {
        out.push(event(
            "content_block_delta",
            &format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{}}}}}"#, q(p)),
        ));
    }
    out.push(event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#));
    out.push(event(
        "message_delta",
        &format!(
            r#"{{"type":"message_delta","delta":{{"stop_reason":"{}","stop_sequence":null}},"usage":{{"output_tokens":{}}}}}"#,
            stop_reason(g),
            g.output
        ),
    ));
    out.push(event("message_stop", r#"{"type":"message_stop"}"#));
    out
}

// === errors ===

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
pub(crate) fn openai_error(message: &str, kind: &str, code: Option<&str>) -> String {
    let code = code.map_or("null".to_string(), q);
    format!(r#"{{"error":{{"message":{},"type":{},"param":null,"code":{code}}}}}"#, q(message), q(kind))
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}, "request_id"}`.
pub(crate) fn anthropic_error(kind: &str, message: &str, request_id: &str) -> String {
    format!(
        r#"{{"type":"error","error":{{"type":{},"message":{}}},"request_id":{}}}"#,
        q(kind),
        q(message),
        q(request_id)
    )
}
