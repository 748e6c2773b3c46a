//! OpenAI's Responses API, `POST /v1/responses` (what the Codex CLI and the Agents SDK use):
//! `input` as text or as items (messages, `function_call`, `function_call_output`),
//! `instructions`, `tools` (functions, namespaced functions and custom tools, see
//! [`crate::responses_tools`]; hosted tools declined) and `tool_choice`, `text.format` (text, json_object,
//! json_schema, enforced), `max_output_tokens`, sampling, streaming as the API's typed
//! events; a thinking model's reasoning as a `reasoning` item with `reasoning_text`
//! content (streamed as `response.reasoning_text.delta`), switched by `reasoning.effort`,
//! and reasoning items sent back given to the template as the next turn's reasoning; and
//! `previous_response_id`: a stored response's conversation (its input and
//! output) continues where it ended. Stored responses live in a store on the node that
//! answered ([`ResponseStore`], bounded in count and bytes, oldest out first); `store:
//! false` keeps nothing. The
//! request runs through the same generation path as chat completions.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::Stream;
use serde_json::{json, Value};

use crate::declined::{Declined, OMITTED};
use crate::error::{parse_body, ApiError, ErrorKind, Flavor};
use crate::generation::{
    self, Finish, GenRequest, Input, Message, Out, OutputFormat, ToolChoice, Usage,
};
use crate::openai::{apply_sampling, Sampling};
use crate::reasoning::ReasoningFormat;
use crate::responses_tools::{custom_input, folded_name, ResponseTools};
use crate::state::AppState;
use crate::tools::ToolCall;

/// Responses kept for `previous_response_id` at most; the oldest go first.
pub const STORED_RESPONSES: usize = 1024;
/// Memory the kept conversations hold at most, in bytes (messages, calls and their JSON
/// counted as held, not only their text); the oldest go first.
pub const STORED_BYTES: usize = 64 << 20;

/// The conversations of stored responses: input and output, as chat messages.
#[derive(Debug, Default)]
pub struct ResponseStore {
    inner: Mutex<Stored>,
}

/// The stored conversations by response id (with their size and owner), the ids oldest
/// first, and their total size.
#[derive(Debug, Default)]
struct Stored {
    by_id: HashMap<String, StoredResponse>,
    order: VecDeque<String>,
    bytes: usize,
}

#[derive(Debug)]
struct StoredResponse {
    conversation: Arc<Vec<Message>>,
    bytes: usize,
    owner: String,
}

/// The bytes a JSON value holds in memory: each node, each string's bytes, each object
/// entry's key.
fn value_bytes(v: &Value) -> usize {
    std::mem::size_of::<Value>()
        + match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(value_bytes).sum(),
            Value::Object(o) => o
                .iter()
                .map(|(k, v)| k.len() + std::mem::size_of::<String>() + 16 + value_bytes(v))
                .sum(),
            _ => 0,
        }
}

/// The bytes a conversation holds in memory: each message and call as a struct, with its
/// strings and its arguments' JSON.
fn size_of(conversation: &[Message]) -> usize {
    conversation
        .iter()
        .map(|m| {
            std::mem::size_of::<Message>()
                + m.content.len()
                + m.tool_call_id.as_ref().map_or(0, String::len)
                + m.name.as_ref().map_or(0, String::len)
                + m.reasoning.as_ref().map_or(0, String::len)
                + m.tool_calls
                    .iter()
                    .map(|c| {
                        std::mem::size_of::<ToolCall>()
                            + c.id.len()
                            + c.name.len()
                            + value_bytes(&c.arguments)
                    })
                    .sum::<usize>()
        })
        .sum()
}

impl ResponseStore {
    /// The conversation stored under `id` by `owner`; another owner's is not found.
    fn get(&self, id: &str, owner: &str) -> Option<Arc<Vec<Message>>> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.by_id
            .get(id)
            .filter(|r| r.owner == owner)
            .map(|r| r.conversation.clone())
    }

    fn put(&self, id: String, conversation: Vec<Message>, owner: String) {
        let bytes = size_of(&conversation);
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.bytes += bytes;
        g.by_id.insert(
            id.clone(),
            StoredResponse {
                conversation: Arc::new(conversation),
                bytes,
                owner,
            },
        );
        g.order.push_back(id);
        while g.order.len() > STORED_RESPONSES || g.bytes > STORED_BYTES {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some(r) = g.by_id.remove(&old) {
                g.bytes -= r.bytes;
            }
        }
    }
}

/// A request's fields beyond the conversation, echoed in the response object.
struct Echo {
    model: String,
    instructions: Value,
    previous: Value,
    tools: Value,
    tool_choice: Value,
    temperature: Value,
    top_p: Value,
    max_output_tokens: Value,
    text: Value,
    metadata: Value,
}

/// Axum handler for `POST /v1/responses`.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(b) => b,
        Err(e) => return e.flavor(Flavor::OpenAi).into_response(),
    };
    let peer = extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    match inner(state, headers, peer, body).await {
        Ok(r) => r,
        Err(e) => e.flavor(Flavor::OpenAi).into_response(),
    }
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

/// The text of a message's `content`: a string, or parts of type `input_text`,
/// `output_text` or `text`; images and files become a note that they were left out, and
/// other parts (refusals, ...) are skipped, both noted in `declined`.
fn content_text(v: &Value, param: &str, declined: &mut Declined) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        out.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""));
                    }
                    Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                        declined.ignore(&format!("{kind} parts"));
                        out.push_str(OMITTED);
                    }
                    Some(kind) => declined.ignore(&format!("{kind} parts")),
                    None => {
                        return Err(bad(
                            &format!("{param}[{i}].type"),
                            "a content part needs a type; send input_text",
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(param, "content must be a string or a list of parts")),
    }
}

/// Appends `call` to the assistant turn that `out` ends with, or starts one: a message and
/// the calls after it, or calls one after another, are one assistant turn. A new turn takes
/// the `reasoning` that came before it.
fn push_call(out: &mut Vec<Message>, call: ToolCall, reasoning: &mut Option<String>) {
    match out.last_mut() {
        Some(m) if m.role == "assistant" => m.tool_calls.push(call),
        _ => {
            let mut m = Message::text("assistant", "");
            m.reasoning = reasoning.take();
            m.tool_calls.push(call);
            out.push(m);
        }
    }
}

/// The text of a `reasoning` item: its `reasoning_text` content, else its summary.
fn reasoning_text(item: &Value) -> Option<String> {
    let texts = |key: &str, kind: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .map(|parts| {
                parts
                    .iter()
                    .filter(|p| p.get("type").and_then(Value::as_str) == Some(kind))
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n\n")
            })
            .unwrap_or_default()
    };
    Some(texts("content", "reasoning_text"))
        .filter(|t| !t.is_empty())
        .or_else(|| Some(texts("summary", "summary_text")).filter(|t| !t.is_empty()))
}

/// The conversation `input` adds (text, or items). A `reasoning` item's text becomes the
/// reasoning of the assistant turn after it (one with only encrypted content has none);
/// items with nothing for this model (hosted tool calls, compactions, ...) are skipped and
/// noted in `declined`.
fn input_messages(input: &Value, declined: &mut Declined) -> Result<Vec<Message>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![Message::text("user", s.clone())]),
        Value::Array(items) => items,
        Value::Null => return Err(bad("input", "input is required")),
        _ => return Err(bad("input", "input must be a string or a list of items")),
    };
    let mut out: Vec<Message> = Vec::new();
    let mut reasoning = None;
    for (i, item) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        let field = |k: &str| {
            item.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&format!("{p}.{k}"), format!("a {kind} item needs {k}")))
        };
        match kind {
            "message" => {
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(&format!("{p}.role"), "a message needs a role"))?;
                if !["user", "assistant", "system", "developer"].contains(&role) {
                    return Err(bad(
                        &format!("{p}.role"),
                        format!("role {role} is not one of user, assistant, system, developer"),
                    ));
                }
                let text = content_text(
                    item.get("content").unwrap_or(&Value::Null),
                    &format!("{p}.content"),
                    declined,
                )?;
                let mut m = Message::text(role, text);
                if role == "assistant" {
                    m.reasoning = reasoning.take();
                }
                out.push(m);
            }
            "reasoning" => {
                if let Some(t) = reasoning_text(item) {
                    reasoning = Some(t);
                }
            }
            "function_call" => {
                let arguments = field("arguments")?;
                let name = match item.get("namespace").and_then(Value::as_str) {
                    Some(ns) => folded_name(ns, field("name")?),
                    None => field("name")?.to_string(),
                };
                let call = ToolCall {
                    id: field("call_id")?.to_string(),
                    name,
                    arguments: crate::openai::arguments_value(
                        Value::String(arguments.to_string()),
                        &format!("{p}.arguments"),
                    )?,
                };
                push_call(&mut out, call, &mut reasoning);
            }
            "custom_tool_call" => {
                let call = ToolCall {
                    id: field("call_id")?.to_string(),
                    name: field("name")?.to_string(),
                    arguments: json!({"input": field("input")?}),
                };
                push_call(&mut out, call, &mut reasoning);
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = field("call_id")?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(v, &format!("{p}.output"), declined)?,
                    Some(v) => v.to_string(),
                    None => {
                        return Err(bad(
                            &format!("{p}.output"),
                            format!("a {kind} needs output"),
                        ))
                    }
                };
                let mut m = Message::text("tool", output);
                m.tool_call_id = Some(call_id.to_string());
                out.push(m);
            }
            other => declined.ignore(&format!("{other} items")),
        }
    }
    Ok(out)
}

fn tool_choice_of(v: Option<&Value>, declined: &mut Declined) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(bad(
                "tool_choice",
                format!("tool_choice '{other}' is not one of auto, none, required"),
            )),
        },
        Some(v) => match (
            v.get("type").and_then(Value::as_str),
            v.get("name").and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => Ok(ToolChoice::Named(
                match v.get("namespace").and_then(Value::as_str) {
                    Some(ns) => folded_name(ns, name),
                    None => name.to_string(),
                },
            )),
            (Some("custom"), Some(name)) => Ok(ToolChoice::Named(name.to_string())),
            (Some("function" | "custom"), None) | (None, _) => Err(bad(
                "tool_choice",
                "tool_choice must be a string or {\"type\": \"function\", \"name\": ...}",
            )),
            // a hosted tool (declined): the model chooses among the rest
            (Some(_), _) => {
                declined.ignore("tool_choice");
                Ok(ToolChoice::Auto)
            }
        },
    }
}

fn format_of(text: Option<&Value>) -> Result<OutputFormat, ApiError> {
    let Some(f) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(OutputFormat::Text);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(OutputFormat::Text),
        Some("json_object") => Ok(OutputFormat::JsonObject),
        Some("json_schema") => f
            .get("schema")
            .cloned()
            .map(OutputFormat::JsonSchema)
            .ok_or_else(|| bad("text.format.schema", "a json_schema format needs a schema")),
        _ => Err(bad(
            "text.format.type",
            "text.format.type must be text, json_object or json_schema",
        )),
    }
}

fn number(v: Option<&Value>, param: &str) -> Result<Option<f64>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(n) => n
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(param, format!("{param} must be a number"))),
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// Who a stored response belongs to: the key that created it, or on a node without keys the
/// client's address.
fn owner_of(key: Option<&crate::keys::KeyRecord>, peer: Option<std::net::IpAddr>) -> String {
    match (key, peer) {
        (Some(k), _) => format!("key:{}", k.id),
        (None, Some(ip)) => format!("client:{ip}"),
        (None, None) => "client:unknown".to_string(),
    }
}

async fn inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    peer: Option<std::net::IpAddr>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = state.keys.authorize(&headers)?;
    let owner = owner_of(key.as_ref(), peer);
    let r: Value = parse_body(&body)?;
    if !r.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    let model = r
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("model", "model is required"))?
        .to_string();
    let mut conversation = Vec::new();
    let previous = r.get("previous_response_id").and_then(Value::as_str);
    if let Some(id) = previous {
        let earlier = state.responses.get(id, &owner).ok_or_else(|| {
            ApiError::new(
                ErrorKind::NotFound,
                format!(
                    "previous_response_id: response {id} is not stored here for this client (only the last {STORED_RESPONSES} with store not false are kept, on the node that answered them, for the key or client that created them)"
                ),
            )
        })?;
        // the stored conversation is its input and output; its `instructions` were never
        // part of it, so they do not carry over (as OpenAI's)
        conversation.extend(earlier.iter().cloned());
    }
    let mut declined = Declined::default();
    conversation.extend(input_messages(
        r.get("input").unwrap_or(&Value::Null),
        &mut declined,
    )?);
    let tools = ResponseTools::read(r.get("tools"), &mut declined)?;
    for field in IGNORED_FIELDS {
        if r.get(field).is_some_and(|v| !v.is_null()) {
            declined.ignore(field);
        }
    }
    let reasoning_asked = r.get("reasoning").filter(|v| !v.is_null());
    let reasoning_sent = conversation.iter().any(|m| m.reasoning.is_some())
        || input_has_reasoning_items(r.get("input"));
    let mut messages = Vec::new();
    if let Some(i) = r.get("instructions").and_then(Value::as_str) {
        messages.push(Message::text("system", i));
    }
    messages.extend(conversation.iter().cloned());
    let mut req = GenRequest::new(
        model,
        Input::Chat {
            messages,
            tools: tools.functions.clone(),
        },
    );
    req.max_tokens = match r.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    bad(
                        "max_output_tokens",
                        "max_output_tokens must be a positive integer",
                    )
                })?
                .min(u32::MAX as u64) as usize,
        ),
    };
    apply_sampling(
        &mut req,
        Sampling {
            temperature: number(r.get("temperature"), "temperature")?.map(|t| t as f32),
            top_p: number(r.get("top_p"), "top_p")?.map(|t| t as f32),
            top_k: None,
            min_p: None,
            repetition_penalty: None,
            seed: None,
            presence_penalty: None,
            frequency_penalty: None,
        },
    )?;
    req.tool_choice = tool_choice_of(r.get("tool_choice"), &mut declined)?;
    req.format = format_of(r.get("text"))?;
    req.thinking =
        crate::openai::thinking_of(reasoning_asked.and_then(|v| v.get("effort")), None, None)?;
    let store = r.get("store").and_then(Value::as_bool).unwrap_or(true);
    let stream = r.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let running = generation::start(&state, req).await?;
    if running.model.reasoning == ReasoningFormat::None {
        for (field, given) in [
            ("reasoning", reasoning_asked.is_some()),
            ("reasoning items", reasoning_sent),
        ] {
            if given {
                declined.ignore(field);
            }
        }
    }
    let echo = Echo {
        model: running.model.id.clone(),
        instructions: r.get("instructions").cloned().unwrap_or(Value::Null),
        previous: previous.map_or(Value::Null, |p| json!(p)),
        tools: r.get("tools").cloned().unwrap_or(json!([])),
        tool_choice: r.get("tool_choice").cloned().unwrap_or(json!("auto")),
        temperature: r.get("temperature").cloned().unwrap_or(json!(1.0)),
        top_p: r.get("top_p").cloned().unwrap_or(json!(1.0)),
        max_output_tokens: r.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        text: r
            .get("text")
            .cloned()
            .unwrap_or(json!({"format": {"type": "text"}})),
        metadata: r.get("metadata").cloned().unwrap_or(json!({})),
    };
    let id = new_id("resp");
    let created = running.created;
    let store = store.then(|| (state.clone(), conversation, owner));
    if stream {
        let mut resp = stream_response(running, id, created, echo, tools, store).into_response();
        declined.apply("/v1/responses", &mut resp);
        return Ok(resp);
    }
    let done = running.collect().await?;
    let mut output = Output {
        tools,
        items: Vec::new(),
    };
    if !done.reasoning.is_empty() {
        output
            .items
            .push(Item::Reasoning(new_id("rs"), done.reasoning.clone()));
    }
    if !done.text.is_empty() {
        output
            .items
            .push(Item::Message(new_id("msg"), done.text.clone()));
    }
    for c in &done.calls {
        output.items.push(Item::Call(new_id("fc"), c.clone()));
    }
    let object = response_object(
        &id,
        created,
        &echo,
        "completed",
        &output,
        Some((done.reason, done.usage)),
    );
    keep(store, &id, &output);
    let mut resp = Json(object).into_response();
    declined.apply("/v1/responses", &mut resp);
    Ok(resp)
}

/// Whether `input` holds `reasoning` items.
fn input_has_reasoning_items(input: Option<&Value>) -> bool {
    input.and_then(Value::as_array).is_some_and(|items| {
        items
            .iter()
            .any(|i| i.get("type").and_then(Value::as_str) == Some("reasoning"))
    })
}

/// Request fields with no meaning on this server, noted when present: extra output to
/// include (no encrypted reasoning is given), service tiers and background runs.
const IGNORED_FIELDS: [&str; 4] = ["include", "service_tier", "background", "conversation"];

/// One item a response produced, with its id.
enum Item {
    Reasoning(String, String),
    Message(String, String),
    Call(String, ToolCall),
}

/// What a response produced, its items in order, and the tools the calls map back to.
#[derive(Default)]
struct Output {
    tools: ResponseTools,
    items: Vec<Item>,
}

impl Output {
    fn items(&self) -> Vec<Value> {
        self.items
            .iter()
            .map(|i| match i {
                Item::Reasoning(id, text) => reasoning_item(id, text, "completed"),
                Item::Message(id, text) => message_item(id, text, "completed"),
                Item::Call(id, c) => self.tools.call_item(id, c, "completed"),
            })
            .collect()
    }

    /// The response as one assistant turn of the conversation.
    fn turn(&self) -> Message {
        let mut reply = Message::text("assistant", "");
        for i in &self.items {
            match i {
                Item::Reasoning(_, text) => reply
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(text),
                Item::Message(_, text) => reply.content.push_str(text),
                Item::Call(_, c) => reply.tool_calls.push(c.clone()),
            }
        }
        reply
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": if status == "in_progress" { json!([]) } else { json!([text_part(text)]) }})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [reasoning_part(text)]})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn response_object(
    id: &str,
    created: u64,
    e: &Echo,
    status: &str,
    output: &Output,
    end: Option<(Finish, Usage)>,
) -> Value {
    let (status, incomplete) = match end {
        Some((Finish::Length, _)) => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => (status, Value::Null),
    };
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": Value::Null,
        "incomplete_details": incomplete,
        "instructions": e.instructions,
        "max_output_tokens": e.max_output_tokens,
        "model": e.model,
        "output": output.items(),
        "parallel_tool_calls": true,
        "previous_response_id": e.previous,
        "temperature": e.temperature,
        "text": e.text,
        "tool_choice": e.tool_choice,
        "tools": e.tools,
        "top_p": e.top_p,
        "truncation": "disabled",
        "usage": end.map_or(Value::Null, |(_, u)| usage_json(u)),
        "metadata": e.metadata,
    })
}

/// Stores the conversation with the response's output appended, when asked to.
fn keep(store: Option<(Arc<AppState>, Vec<Message>, String)>, id: &str, output: &Output) {
    let Some((state, mut conversation, owner)) = store else {
        return;
    };
    conversation.push(output.turn());
    state.responses.put(id.to_string(), conversation, owner);
}

type SseItem = Result<SseEvent, std::convert::Infallible>;

/// The streamed events of one response, numbered in order.
struct Events {
    id: String,
    created: u64,
    echo: Echo,
    seq: u64,
    output: Output,
    /// Output index of the open message or reasoning item, if one is open.
    open: Option<usize>,
    store: Option<(Arc<AppState>, Vec<Message>, String)>,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> SseItem {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Ok(SseEvent::default().event(kind).data(data.to_string()))
    }

    fn object(&self, status: &str, end: Option<(Finish, Usage)>) -> Value {
        response_object(
            &self.id,
            self.created,
            &self.echo,
            status,
            &self.output,
            end,
        )
    }

    /// Appends `delta` to the open item when it is a reasoning item (`reasoning`) or a
    /// message (else), or closes the open one and opens a new one.
    fn append(&mut self, reasoning: bool, delta: String) -> Vec<SseItem> {
        if delta.is_empty() {
            return Vec::new();
        }
        let same = self.open.is_some_and(|i| {
            matches!(
                (&self.output.items[i], reasoning),
                (Item::Reasoning(..), true) | (Item::Message(..), false)
            )
        });
        let mut items = Vec::new();
        if !same {
            items.extend(self.close());
            let i = self.output.items.len();
            self.open = Some(i);
            if reasoning {
                let rid = new_id("rs");
                self.output
                    .items
                    .push(Item::Reasoning(rid.clone(), String::new()));
                items.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": i, "item": reasoning_item(&rid, "", "in_progress")}),
                ));
            } else {
                let mid = new_id("msg");
                self.output
                    .items
                    .push(Item::Message(mid.clone(), String::new()));
                items.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": i, "item": message_item(&mid, "", "in_progress")}),
                ));
                items.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": mid, "output_index": i, "content_index": 0, "part": text_part("")}),
                ));
            }
        }
        let Some(i) = self.open else {
            return items;
        };
        let (kind, id) = match &mut self.output.items[i] {
            Item::Reasoning(id, text) => {
                text.push_str(&delta);
                ("response.reasoning_text.delta", id.clone())
            }
            Item::Message(id, text) => {
                text.push_str(&delta);
                ("response.output_text.delta", id.clone())
            }
            Item::Call(..) => return items,
        };
        items.push(self.event(
            kind,
            json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta}),
        ));
        items
    }

    /// Closes the open message or reasoning item, if one is open.
    fn close(&mut self) -> Vec<SseItem> {
        let Some(i) = self.open.take() else {
            return Vec::new();
        };
        match &self.output.items[i] {
            Item::Reasoning(rid, text) => {
                let (rid, text) = (rid.clone(), text.clone());
                vec![
                    self.event(
                        "response.reasoning_text.done",
                        json!({"item_id": rid, "output_index": i, "content_index": 0, "text": text}),
                    ),
                    self.event(
                        "response.output_item.done",
                        json!({"output_index": i, "item": reasoning_item(&rid, &text, "completed")}),
                    ),
                ]
            }
            Item::Message(mid, text) => {
                let (mid, text) = (mid.clone(), text.clone());
                vec![
                    self.event(
                        "response.output_text.done",
                        json!({"item_id": mid, "output_index": i, "content_index": 0, "text": text}),
                    ),
                    self.event(
                        "response.content_part.done",
                        json!({"item_id": mid, "output_index": i, "content_index": 0, "part": text_part(&text)}),
                    ),
                    self.event(
                        "response.output_item.done",
                        json!({"output_index": i, "item": message_item(&mid, &text, "completed")}),
                    ),
                ]
            }
            Item::Call(..) => Vec::new(),
        }
    }

    fn call(&mut self, call: ToolCall) -> Vec<SseItem> {
        let mut items = self.close();
        let i = self.output.items.len();
        let custom = self.output.tools.is_custom(&call.name);
        let fid = new_id(if custom { "ctc" } else { "fc" });
        let (delta_kind, done_kind, done_field, args) = if custom {
            (
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.done",
                "input",
                custom_input(&call.arguments),
            )
        } else {
            (
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "arguments",
                call.arguments.to_string(),
            )
        };
        let added = self.output.tools.call_item(&fid, &call, "in_progress");
        items.push(self.event(
            "response.output_item.added",
            json!({"output_index": i, "item": added}),
        ));
        items.push(self.event(
            delta_kind,
            json!({"item_id": fid, "output_index": i, "delta": args}),
        ));
        items.push(self.event(
            done_kind,
            json!({"item_id": fid, "output_index": i, done_field: args}),
        ));
        let done = self.output.tools.call_item(&fid, &call, "completed");
        items.push(self.event(
            "response.output_item.done",
            json!({"output_index": i, "item": done}),
        ));
        self.output.items.push(Item::Call(fid, call));
        items
    }

    fn finish(&mut self, reason: Finish, usage: Usage) -> Vec<SseItem> {
        let mut items = self.close();
        let object = self.object("completed", Some((reason, usage)));
        let kind = if reason == Finish::Length {
            "response.incomplete"
        } else {
            "response.completed"
        };
        items.push(self.event(kind, json!({"response": object})));
        keep(self.store.take(), &self.id, &self.output);
        items
    }

    fn failed(&mut self, msg: String) -> Vec<SseItem> {
        let mut object = self.object("failed", None);
        object["error"] = json!({"code": "server_error", "message": msg});
        vec![self.event("response.failed", json!({"response": object}))]
    }
}

fn stream_response(
    running: generation::Running,
    id: String,
    created: u64,
    echo: Echo,
    tools: ResponseTools,
    store: Option<(Arc<AppState>, Vec<Message>, String)>,
) -> Sse<impl Stream<Item = SseItem>> {
    let mut ev = Events {
        id,
        created,
        echo,
        seq: 0,
        output: Output {
            tools,
            ..Output::default()
        },
        open: None,
        store,
    };
    let first = vec![
        {
            let o = ev.object("in_progress", None);
            ev.event("response.created", json!({"response": o}))
        },
        {
            let o = ev.object("in_progress", None);
            ev.event("response.in_progress", json!({"response": o}))
        },
    ];
    let s = running.stream_with(first, move |out| match out {
        Out::Text { text, .. } => ev.append(false, text),
        Out::Reasoning(text) => ev.append(true, text),
        Out::Call { call, .. } => ev.call(call),
        Out::Finished { reason, usage, .. } => ev.finish(reason, usage),
        Out::Failed(msg) => ev.failed(msg),
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_the_newest_responses() {
        let s = ResponseStore::default();
        let me = || "key:a".to_string();
        for i in 0..=STORED_RESPONSES {
            s.put(
                format!("r{i}"),
                vec![Message::text("user", format!("{i}"))],
                me(),
            );
        }
        assert!(s.get("r0", "key:a").is_none());
        assert_eq!(s.get("r1", "key:a").unwrap()[0].content, "1");
        assert!(s.get(&format!("r{STORED_RESPONSES}"), "key:a").is_some());
        // and no more than STORED_BYTES: a large conversation pushes the oldest out
        let big = "x".repeat(STORED_BYTES / 2 + 1);
        s.put(
            "big1".into(),
            vec![Message::text("user", big.clone())],
            me(),
        );
        s.put("big2".into(), vec![Message::text("user", big)], me());
        assert!(s.get("big1", "key:a").is_none() && s.get("big2", "key:a").is_some());
        assert!(s.get("r1", "key:a").is_none(), "the small ones went first");
    }

    #[test]
    fn a_stored_response_is_its_owners_only() {
        let s = ResponseStore::default();
        s.put(
            "r".into(),
            vec![Message::text("user", "secret")],
            "key:a".into(),
        );
        assert!(s.get("r", "key:b").is_none());
        assert!(s.get("r", "client:127.0.0.1").is_none());
        assert!(s.get("r", "key:a").is_some());
    }

    #[test]
    fn the_store_counts_what_empty_calls_hold() {
        // 65k empty calls hold megabytes in memory though their text is a few bytes each
        let mut m = Message::text("assistant", "");
        m.tool_calls = (0..65_000)
            .map(|i| ToolCall {
                id: format!("{i}"),
                name: String::new(),
                arguments: json!({}),
            })
            .collect();
        let counted = size_of(std::slice::from_ref(&m));
        let held = 65_000 * (std::mem::size_of::<ToolCall>() + std::mem::size_of::<Value>());
        assert!(counted >= held, "{counted} < {held}");
    }

    #[test]
    fn input_items_become_one_conversation() {
        let items = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]);
        let m = input_messages(&items, &mut Declined::default()).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].content, "weather?");
        assert_eq!(m[1].role, "assistant");
        assert_eq!(m[1].tool_calls.len(), 2, "calls in a row are one turn");
        assert_eq!(m[1].tool_calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(
            (m[2].role.as_str(), m[2].tool_call_id.as_deref()),
            ("tool", Some("c1"))
        );
        let e = input_messages(
            &json!([{"type": "function_call", "call_id": "c", "name": "w", "arguments": "{"}]),
            &mut Declined::default(),
        )
        .unwrap_err();
        assert!(format!("{e:?}").contains("input[0].arguments"), "{e:?}");
    }
}
