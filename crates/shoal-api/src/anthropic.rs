//! Anthropic-compatible `POST /v1/messages` and `POST /v1/messages/count_tokens`: system
//! prompt (top-level, and `system` messages inside the conversation as Claude Code sends
//! them), text / `tool_use` / `tool_result` content blocks, `tool_choice` (auto, any, tool,
//! none), `stop_sequences`, `stop_reason`, and the streaming event sequence
//! (`message_start`, `content_block_*`, `message_delta`, `message_stop`), with Anthropic's
//! error shape. Keys may come as `x-api-key`. A thinking model's reasoning comes as `thinking`
//! blocks (streamed as `thinking_delta`s), `thinking` (enabled with its budget held,
//! adaptive or disabled) and `output_config.effort` switch it, and the thinking blocks of
//! earlier turns go back to the template as their reasoning. What a text-only local model
//! cannot use is declined, not refused ([`crate::declined`]): hosted tools, thinking for a
//! model that does not reason (and a budget for one that reasons by effort, gpt-oss),
//! `context_management`, images and documents (each replaced by a note saying it was left
//! out).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::declined::{Declined, OMITTED};
use crate::error::{parse_body, ApiError, Flavor};
use crate::generation::{
    self, Finish, GenRequest, Input, Message, Out, OutputFormat, Tool, ToolChoice,
};
use crate::openai::OneOrMany;
use crate::reasoning::{ReasoningFormat, Thinking};
use crate::state::AppState;
use crate::tools::ToolCall;

#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    content: Value,
}

#[derive(Debug, Deserialize)]
struct WireTool {
    /// Absent or `custom` for a client's own tool; anything else (`web_search_20250305`,
    /// `bash_20250124`, ...) is a tool Anthropic's servers run.
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: u64,
    messages: Vec<WireMessage>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    stop_sequences: Option<OneOrMany>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    output_config: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
    #[serde(default)]
    context_management: Option<Value>,
    #[serde(default)]
    service_tier: Option<Value>,
    #[serde(default)]
    mcp_servers: Option<Value>,
    #[serde(default)]
    container: Option<Value>,
}

/// Text of a string or of a list of text blocks; images and documents become a note that
/// they were left out, and blocks with nothing for the model are skipped (both noted in
/// `declined`).
fn block_text(v: &Value, field: &str, declined: &mut Declined) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        out.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some(t @ ("image" | "document")) => {
                        declined.ignore(&format!("{t} blocks"));
                        out.push_str(OMITTED);
                    }
                    Some(t) => declined.ignore(&format!("{t} blocks")),
                    None => return Err(ApiError::invalid_param(field, "a block needs a 'type'")),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid_param(
            field,
            "must be a string or a list of blocks",
        )),
    }
}

/// How the system block carrying Claude Code's billing metadata starts.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Canonical messages from Anthropic's: `tool_use` blocks become the assistant's tool
/// calls, `tool_result` blocks become tool messages.
fn canonical_messages(
    system: Option<Value>,
    wire: Vec<WireMessage>,
    declined: &mut Declined,
) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::new();
    if let Some(mut s) = system {
        // Claude Code puts request metadata for Anthropic's billing in the first system
        // block; it tells a model nothing and changes between sessions, which would make
        // every session's prompt differ from its first tokens on
        if let Value::Array(blocks) = &mut s {
            let before = blocks.len();
            blocks.retain(|b| {
                !b.get("text")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t.starts_with(BILLING_HEADER))
            });
            if blocks.len() < before {
                declined.ignore("billing header in system");
            }
        }
        let text = block_text(&s, "system", declined)?;
        if !text.is_empty() {
            out.push(Message::text("system", text));
        }
    }
    if wire.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty; send at least one message",
        ));
    }
    for (i, m) in wire.into_iter().enumerate() {
        let field = format!("messages.{i}.content");
        if m.role == "system" {
            // Claude Code sends instructions that arrive mid-conversation this way; they stay
            // where they were sent, so the conversation before them is an unchanged prefix
            out.push(Message::text(
                "system",
                block_text(&m.content, &field, declined)?,
            ));
            continue;
        }
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid_param(
                &format!("messages.{i}.role"),
                format!("role '{}' must be user, assistant or system", m.role),
            ));
        }
        let blocks = match m.content {
            Value::String(s) => {
                out.push(Message::text(&m.role, s));
                continue;
            }
            Value::Array(b) => b,
            _ => {
                return Err(ApiError::invalid_param(
                    &field,
                    "content must be a string or a list of blocks",
                ))
            }
        };
        let mut msg = Message::text(&m.role, String::new());
        let mut results = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bf = format!("{field}.{j}");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => {
                    msg.content
                        .push_str(b.get("text").and_then(Value::as_str).unwrap_or(""));
                }
                Some("tool_use") if m.role == "assistant" => {
                    let (Some(id), Some(name)) = (
                        b.get("id").and_then(Value::as_str),
                        b.get("name").and_then(Value::as_str),
                    ) else {
                        return Err(ApiError::invalid_param(
                            &bf,
                            "tool_use needs 'id' and 'name'",
                        ));
                    };
                    msg.tool_calls.push(ToolCall {
                        id: id.to_string(),
                        name: name.to_string(),
                        arguments: b.get("input").cloned().unwrap_or_else(|| json!({})),
                    });
                }
                Some("tool_result") if m.role == "user" => {
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            ApiError::invalid_param(&bf, "tool_result needs 'tool_use_id'")
                        })?;
                    let content =
                        block_text(b.get("content").unwrap_or(&Value::Null), &bf, declined)?;
                    let mut r = Message::text("tool", content);
                    r.tool_call_id = Some(id.to_string());
                    results.push(r);
                }
                Some(t @ ("image" | "document")) => {
                    declined.ignore(&format!("{t} blocks"));
                    msg.content.push_str(OMITTED);
                }
                Some("thinking") if m.role == "assistant" => {
                    let r = msg.reasoning.get_or_insert_with(String::new);
                    r.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""));
                }
                // redacted_thinking, server tool blocks, ...: nothing this model produced or
                // can read
                Some(t) => declined.ignore(&format!("{t} blocks")),
                None => return Err(ApiError::invalid_param(&bf, "a block needs a 'type'")),
            }
        }
        // Tool results answer the previous assistant turn; any text after them is the user's.
        out.extend(results);
        if !msg.content.is_empty() || !msg.tool_calls.is_empty() {
            out.push(msg);
        }
    }
    Ok(out)
}

/// The chat a request's system prompt, messages and tools make.
fn conversation(
    system: Option<Value>,
    messages: Vec<WireMessage>,
    tools: Option<Vec<WireTool>>,
    declined: &mut Declined,
) -> Result<Input, ApiError> {
    Ok(Input::Chat {
        messages: canonical_messages(system, messages, declined)?,
        tools: tools_of(tools.unwrap_or_default(), declined)?,
    })
}

/// The client's own tools as functions; tools Anthropic's servers would run (a `type` other
/// than `custom`) are declined.
fn tools_of(wire: Vec<WireTool>, declined: &mut Declined) -> Result<Vec<Tool>, ApiError> {
    let mut out = Vec::with_capacity(wire.len());
    for (i, t) in wire.into_iter().enumerate() {
        match (t.kind.as_deref(), t.name) {
            (None | Some("custom"), Some(name)) if !name.is_empty() => {
                out.push(Tool::new(name, t.description, t.input_schema))
            }
            (None | Some("custom"), _) => {
                return Err(ApiError::invalid_param(
                    &format!("tools.{i}.name"),
                    "a tool needs a name",
                ))
            }
            (Some(kind), name) => declined.tool(name.as_deref().unwrap_or(kind)),
        }
    }
    Ok(out)
}

fn tool_choice(v: Option<Value>) -> Result<ToolChoice, ApiError> {
    let Some(v) = v else {
        return Ok(ToolChoice::Auto);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(ToolChoice::Auto),
        Some("none") => Ok(ToolChoice::None),
        Some("any") => Ok(ToolChoice::Required),
        Some("tool") => v
            .get("name")
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_string()))
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "tool_choice.name",
                    "tool_choice of type 'tool' needs a 'name'",
                )
            }),
        _ => Err(ApiError::invalid_param(
            "tool_choice.type",
            "tool_choice.type must be auto, any, tool or none",
        )),
    }
}

/// Anthropic's `thinking` setting (`enabled` with a budget, `adaptive`, `disabled`) and
/// `output_config.effort` as thinking settings; a type this server does not know is
/// declined and thinking left as it is.
fn thinking_of(
    thinking: Option<&Value>,
    effort: Option<&Value>,
    declined: &mut Declined,
) -> Result<Thinking, ApiError> {
    let mut t = Thinking::default();
    if let Some(v) = thinking.filter(|v| !v.is_null()) {
        match v.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                t.enabled = Some(true);
                t.budget = match v.get("budget_tokens") {
                    None | Some(Value::Null) => None,
                    Some(b) => Some(b.as_u64().filter(|&b| b > 0).ok_or_else(|| {
                        ApiError::invalid_param(
                            "thinking.budget_tokens",
                            "budget_tokens must be a positive integer",
                        )
                    })? as usize),
                };
            }
            Some("adaptive") => t.enabled = Some(true),
            Some("disabled") => t.enabled = Some(false),
            Some(other) => declined.ignore(&format!("thinking type {other}")),
            None => {
                return Err(ApiError::invalid_param(
                    "thinking.type",
                    "thinking needs a type: enabled, adaptive or disabled",
                ))
            }
        }
    }
    match effort {
        None => {}
        Some(Value::String(e)) => t.effort = Some(e.clone()),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "output_config.effort",
                "output_config.effort must be a string: low, medium or high",
            ))
        }
    }
    Ok(t)
}

fn stop_reason(f: Finish, stop: &Option<String>) -> &'static str {
    match f {
        Finish::Stop if stop.is_some() => "stop_sequence",
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

fn msg_id() -> String {
    format!("msg_{:024x}", rand::random::<u128>() >> 32)
}

/// `POST /v1/messages`, errors returned for the caller to render.
async fn messages_route(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let body = crate::body_bytes(body)?;
    let r: MessagesRequest = parse_body(&body)?;
    let mut declined = Declined::default();
    let mut req = GenRequest::new(
        r.model,
        conversation(r.system, r.messages, r.tools, &mut declined)?,
    );
    let effort = r
        .output_config
        .as_ref()
        .and_then(|c| c.get("effort"))
        .filter(|e| !e.is_null());
    req.thinking = thinking_of(r.thinking.as_ref(), effort, &mut declined)?;
    for (field, present) in [
        ("context_management", r.context_management.is_some()),
        ("service_tier", r.service_tier.is_some()),
        ("mcp_servers", r.mcp_servers.is_some()),
        ("container", r.container.is_some()),
    ] {
        if present {
            declined.ignore(field);
        }
    }
    if r.max_tokens == 0 {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    req.max_tokens = Some(r.max_tokens.min(u32::MAX as u64) as usize);
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("temperature {temperature} must be between 0 and 1"),
        ));
    }
    req.sampling.temperature = temperature;
    req.sampling.top_p = r.top_p.unwrap_or(1.0);
    req.sampling.top_k = r.top_k.unwrap_or(0) as usize;
    req.stop = r
        .stop_sequences
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    req.tool_choice = tool_choice(r.tool_choice)?;
    if let Some(format) = r.output_config.as_ref().and_then(|c| c.get("format")) {
        if !format.is_null() {
            match (
                format.get("type").and_then(Value::as_str),
                format.get("schema"),
            ) {
                (Some("json_schema"), Some(schema)) => {
                    req.format = OutputFormat::JsonSchema(schema.clone())
                }
                _ => return Err(ApiError::invalid_param(
                    "output_config.format",
                    "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                )),
            }
        }
    }
    let budget = req.thinking.budget.is_some();
    let reasoning_sent = match &req.input {
        Input::Chat { messages, .. } => messages.iter().any(|m| m.reasoning.is_some()),
        Input::Text(_) => false,
    };
    let running = generation::start(&state, req).await?;
    if running.model.reasoning == ReasoningFormat::None {
        for (field, given) in [
            ("thinking", r.thinking.is_some()),
            ("output_config.effort", effort.is_some()),
            ("thinking blocks", reasoning_sent),
        ] {
            if given {
                declined.ignore(field);
            }
        }
    } else if running.model.reasoning != ReasoningFormat::ThinkTags && budget {
        // harmony's reasoning is held by its effort, not a count
        declined.ignore("thinking.budget_tokens");
    }
    let id = msg_id();
    let model = running.model.id.clone();
    if r.stream.unwrap_or(false) {
        let mut resp = stream_messages(running, id, model).into_response();
        declined.apply("/v1/messages", &mut resp);
        return Ok(resp);
    }
    let done = running.collect().await?;
    let mut content = Vec::new();
    if !done.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": done.reasoning, "signature": ""}));
    }
    if !done.text.is_empty() {
        content.push(json!({"type": "text", "text": done.text}));
    }
    for c in &done.calls {
        content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}));
    }
    let mut resp = Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(done.reason, &done.stop),
        "stop_sequence": done.stop,
        "usage": usage_json(done.usage),
    }))
    .into_response();
    declined.apply("/v1/messages", &mut resp);
    Ok(resp)
}

/// Axum handler for `POST /v1/messages`.
pub async fn messages(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match messages_route(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.flavor(Flavor::Anthropic).into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct CountRequest {
    model: String,
    messages: Vec<WireMessage>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
}

/// `POST /v1/messages/count_tokens`, errors returned for the caller to render.
async fn count_route(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let body = crate::body_bytes(body)?;
    let r: CountRequest = parse_body(&body)?;
    let mut declined = Declined::default();
    let req = GenRequest::new(
        r.model,
        conversation(r.system, r.messages, r.tools, &mut declined)?,
    );
    let n = generation::count_prompt(&state, req).await?;
    let mut resp = Json(json!({"input_tokens": n})).into_response();
    declined.apply("/v1/messages/count_tokens", &mut resp);
    Ok(resp)
}

/// Axum handler for `POST /v1/messages/count_tokens`: the prompt tokens the request would
/// run, as the model's chat template and tokenizer make them.
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match count_route(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.flavor(Flavor::Anthropic).into_response(),
    }
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens that ran, and
/// `cache_read_input_tokens` those taken from the KV cache of an earlier or running request.
fn usage_json(u: generation::Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

type Item = Result<SseEvent, Infallible>;

fn event(name: &str, data: Value) -> Item {
    Ok(SseEvent::default().event(name).data(data.to_string()))
}

/// Closes the open content block, if any, and moves on to the next index.
fn close_block(items: &mut Vec<Item>, open: &mut Option<&'static str>, block: &mut usize) {
    if open.take().is_some() {
        items.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": *block}),
        ));
        *block += 1;
    }
}

/// Opens a content block of `kind` (`text` or `thinking`) unless one is open; a block of
/// another kind is closed first.
fn open_block(
    items: &mut Vec<Item>,
    kind: &'static str,
    open: &mut Option<&'static str>,
    block: &mut usize,
) {
    if *open == Some(kind) {
        return;
    }
    close_block(items, open, block);
    *open = Some(kind);
    let content_block = match kind {
        "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
        _ => json!({"type": "text", "text": ""}),
    };
    items.push(event(
        "content_block_start",
        json!({"type": "content_block_start", "index": *block, "content_block": content_block}),
    ));
}

fn stream_messages(
    running: generation::Running,
    id: String,
    model: String,
) -> Sse<impl futures_util::Stream<Item = Item>> {
    let first = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": running.prompt_tokens, "output_tokens": 0},
            }}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    // the index of the current content block, and the kind of block open, if one is
    let mut block = 0usize;
    let mut open: Option<&'static str> = None;
    let s = running.stream_with(first, move |out| {
        let mut items = Vec::new();
        match out {
            Out::Text { text, .. } | Out::Reasoning(text) if text.is_empty() => {}
            Out::Reasoning(text) => {
                open_block(&mut items, "thinking", &mut open, &mut block);
                items.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": block,
                           "delta": {"type": "thinking_delta", "thinking": text}}),
                ));
            }
            Out::Text { text, .. } => {
                open_block(&mut items, "text", &mut open, &mut block);
                items.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": block,
                           "delta": {"type": "text_delta", "text": text}}),
                ));
            }
            Out::Call { call, .. } => {
                close_block(&mut items, &mut open, &mut block);
                items.push(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": block,
                           "content_block": {"type": "tool_use", "id": call.id,
                                             "name": call.name, "input": {}}}),
                ));
                items.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": block,
                           "delta": {"type": "input_json_delta",
                                     "partial_json": call.arguments.to_string()}}),
                ));
                items.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": block}),
                ));
                block += 1;
            }
            Out::Finished {
                reason,
                stop: stop_seq,
                usage,
            } => {
                close_block(&mut items, &mut open, &mut block);
                items.push(event(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason(reason, &stop_seq), "stop_sequence": stop_seq},
                           "usage": usage_json(usage)}),
                ));
                items.push(event("message_stop", json!({"type": "message_stop"})));
            }
            Out::Failed(msg) => items.push(event(
                "error",
                ApiError::internal(msg).flavor(Flavor::Anthropic).body(),
            )),
        }
        items
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}
