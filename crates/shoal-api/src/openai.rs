//! OpenAI-compatible routes: `POST /v1/chat/completions` (streaming server-sent events and
//! not; tools, `tool_choice`, streamed tool-call deltas, `response_format`, logprobs, usage;
//! a thinking model's reasoning as `reasoning_content`, switched by `reasoning_effort`,
//! `enable_thinking` or `chat_template_kwargs` and held to `thinking_budget` tokens),
//! `POST /v1/completions` and `GET /v1/models`, with OpenAI's field names, defaults and error
//! shape.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::declined::{Declined, OMITTED};
use crate::error::{parse_body, ApiError, Flavor};
use crate::generation::{
    self, Finish, GenRequest, Input, Message, Out, OutputFormat, TokenLogprob, Tool, ToolChoice,
    Usage,
};
use crate::reasoning::{ReasoningFormat, Thinking};
use crate::state::AppState;
use crate::tools::ToolCall;

/// A string or a list of strings (`stop`, `prompt`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(crate) fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
struct WireFunctionCall {
    name: String,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct WireToolCall {
    #[serde(default)]
    id: Option<String>,
    function: WireFunctionCall,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// The reasoning before an assistant message (`reasoning` is another server's name).
    #[serde(default, alias = "reasoning")]
    reasoning_content: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireTool {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Debug, Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<WireMessage>,
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<OneOrMany>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<u32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    reasoning_effort: Option<Value>,
    #[serde(default)]
    enable_thinking: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    /// Most reasoning tokens (the name Qwen's own API gives it).
    #[serde(default)]
    thinking_budget: Option<u64>,
}

/// What a request asks about thinking: OpenAI's `reasoning_effort` (`none` turns it off, a
/// level is passed to templates that read one), and the switches of other servers
/// (`enable_thinking`; `chat_template_kwargs`, given to the template as they are).
pub(crate) fn thinking_of(
    effort: Option<&Value>,
    enable: Option<bool>,
    template_args: Option<Value>,
) -> Result<Thinking, ApiError> {
    let mut t = Thinking {
        enabled: enable,
        ..Thinking::default()
    };
    match effort {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if e == "none" => t.enabled = Some(false),
        Some(Value::String(e)) => t.effort = Some(e.clone()),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "reasoning_effort",
                "reasoning_effort must be a string: none, minimal, low, medium or high",
            ))
        }
    }
    match template_args {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => t.template_args = m,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "chat_template_kwargs",
                "chat_template_kwargs must be a JSON object of the template's arguments",
            ))
        }
    }
    Ok(t)
}

/// Text of a message's `content`: a string, or the text parts of a list of parts; images,
/// audio and files become a note that they were left out (noted in `declined`).
pub(crate) fn content_text(
    content: Option<Value>,
    field: &str,
    declined: &mut Declined,
) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some(kind @ ("image_url" | "input_audio" | "file")), _) => {
                        declined.ignore(&format!("{kind} parts"));
                        out.push_str(OMITTED);
                    }
                    (Some(kind), _) if kind != "text" => {
                        return Err(ApiError::invalid_param(
                            field,
                            format!("content parts of type '{kind}' are not supported; send text"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::invalid_param(
                            field,
                            "every content part needs a 'type' (and 'text' for text parts)",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::invalid_param(
            field,
            "content must be a string or a list of content parts",
        )),
    }
}

/// Tool call arguments as a JSON value: clients send them as a JSON-encoded string.
pub(crate) fn arguments_value(args: Value, field: &str) -> Result<Value, ApiError> {
    match args {
        Value::String(s) if s.trim().is_empty() => Ok(json!({})),
        Value::String(s) => serde_json::from_str(&s).map_err(|e| {
            ApiError::invalid_param(
                field,
                format!("tool call arguments are not valid JSON: {e}"),
            )
        }),
        Value::Null => Ok(json!({})),
        v => Ok(v),
    }
}

fn messages(wire: Vec<WireMessage>, declined: &mut Declined) -> Result<Vec<Message>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty; send at least one message",
        ));
    }
    let mut out = Vec::with_capacity(wire.len());
    for (i, m) in wire.into_iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role.clone(),
            "developer" => "system".to_string(),
            "function" => "tool".to_string(),
            other => {
                return Err(ApiError::invalid_param(
                    &format!("{field}.role"),
                    format!(
                        "unknown role '{other}'; use system, developer, user, assistant or tool"
                    ),
                ))
            }
        };
        let mut msg = Message::text(
            &role,
            content_text(m.content, &format!("{field}.content"), declined)?,
        );
        for (j, c) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
            msg.tool_calls.push(ToolCall {
                id: c.id.unwrap_or_else(|| format!("call_{i}_{j}")),
                name: c.function.name,
                arguments: arguments_value(
                    c.function.arguments,
                    &format!("{field}.tool_calls[{j}].function.arguments"),
                )?,
            });
        }
        msg.tool_call_id = m.tool_call_id;
        msg.name = m.name;
        msg.reasoning = match m.reasoning_content {
            None | Some(Value::Null) => None,
            Some(Value::String(r)) => Some(r),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    &format!("{field}.reasoning_content"),
                    "reasoning_content must be a string",
                ))
            }
        };
        out.push(msg);
    }
    Ok(out)
}

/// The function tools; tools of other types (a provider's hosted tools) are declined.
fn tools(wire: Option<Vec<WireTool>>, declined: &mut Declined) -> Result<Vec<Tool>, ApiError> {
    let mut out = Vec::new();
    for (i, t) in wire.unwrap_or_default().into_iter().enumerate() {
        let function = match (t.kind.as_deref(), t.function) {
            (None | Some("function"), Some(f)) => f,
            (None | Some("function"), None) => {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function"),
                    "a function tool needs a 'function' with a name",
                ))
            }
            (Some(kind), _) => {
                declined.tool(kind);
                continue;
            }
        };
        if function.name.is_empty() {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}].function.name"),
                "a function needs a name",
            ));
        }
        out.push(Tool::new(
            function.name,
            function.description,
            function.parameters,
        ));
    }
    Ok(out)
}

fn tool_choice(v: Option<Value>) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" | "any" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice '{other}' is not one of auto, none, required"),
            )),
        },
        Some(v) => match v
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(name) => Ok(ToolChoice::Named(name.to_string())),
            None => Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            )),
        },
    }
}

fn response_format(v: Option<Value>) -> Result<OutputFormat, ApiError> {
    let Some(v) = v else {
        return Ok(OutputFormat::Text);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(OutputFormat::Text),
        Some("json_object") => Ok(OutputFormat::JsonObject),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .cloned()
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "response_format.json_schema.schema",
                        "json_schema needs a 'schema'",
                    )
                })?;
            Ok(OutputFormat::JsonSchema(schema))
        }
        _ => Err(ApiError::invalid_param(
            "response_format.type",
            "response_format.type must be text, json_object or json_schema",
        )),
    }
}

/// Sampling fields shared by chat and completions.
pub(crate) struct Sampling {
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) top_k: Option<u32>,
    pub(crate) min_p: Option<f32>,
    pub(crate) repetition_penalty: Option<f32>,
    pub(crate) seed: Option<i64>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) frequency_penalty: Option<f32>,
}

pub(crate) fn apply_sampling(req: &mut GenRequest, s: Sampling) -> Result<(), ApiError> {
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("temperature {temperature} must be between 0 and 2"),
        ));
    }
    req.sampling.temperature = temperature;
    req.sampling.top_p = s.top_p.unwrap_or(1.0);
    // vLLM's extensions, so one client can ask for exactly what `shoal run` samples with
    req.sampling.top_k = s.top_k.unwrap_or(0) as usize;
    req.sampling.min_p = s.min_p.unwrap_or(0.0);
    req.sampling.repeat_penalty = s.repetition_penalty.unwrap_or(1.0);
    req.seed = s.seed.map(|v| v as u64);
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        if let Some(v) = v {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid_param(
                    name,
                    format!("{name} {v} must be between -2 and 2"),
                ));
            }
        }
    }
    req.presence_penalty = s.presence_penalty.unwrap_or(0.0);
    req.frequency_penalty = s.frequency_penalty.unwrap_or(0.0);
    Ok(())
}

fn check_n(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::invalid_param(
            "n",
            format!("n = {n} is not supported; shoal returns one choice (n = 1)"),
        )),
    }
}

fn stops(stop: Option<OneOrMany>) -> Result<Vec<String>, ApiError> {
    let v = stop.map(OneOrMany::into_vec).unwrap_or_default();
    if v.len() > 16 {
        return Err(ApiError::invalid_param("stop", "at most 16 stop strings"));
    }
    Ok(v)
}

fn finish_str(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

fn logprob_content(lps: &[TokenLogprob]) -> Value {
    lps.iter()
        .map(|l| {
            // `id` beside OpenAI's fields, as llama.cpp's server gives it: text alone cannot
            // tell apart tokens that print as nothing
            json!({
                "id": l.id,
                "token": l.token,
                "logprob": l.logprob,
                "bytes": l.bytes,
                "top_logprobs": l.top.iter().map(|(id, t, b, p)| json!({
                    "id": id, "token": t, "logprob": p, "bytes": b,
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

fn call_json(index: usize, c: &ToolCall, with_index: bool) -> Value {
    let mut v = json!({
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments.to_string()},
    });
    if with_index {
        v["index"] = json!(index);
    }
    v
}

fn request_id(prefix: &str) -> String {
    let n: u64 = rand::random();
    format!("{prefix}-{n:016x}")
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(b) => b,
        Err(e) => return e.flavor(Flavor::OpenAi).into_response(),
    };
    match chat_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.flavor(Flavor::OpenAi).into_response(),
    }
}

async fn chat_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let r: ChatRequest = parse_body(&body)?;
    check_n(r.n)?;
    let mut declined = Declined::default();
    let mut req = GenRequest::new(
        r.model,
        Input::Chat {
            messages: messages(r.messages, &mut declined)?,
            tools: tools(r.tools, &mut declined)?,
        },
    );
    req.thinking = thinking_of(
        r.reasoning_effort.as_ref(),
        r.enable_thinking,
        r.chat_template_kwargs,
    )?;
    req.thinking.budget = r.thinking_budget.map(|b| b as usize);
    req.max_tokens = r
        .max_completion_tokens
        .or(r.max_tokens)
        .map(|n| n.min(u32::MAX as u64) as usize);
    apply_sampling(
        &mut req,
        Sampling {
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            min_p: r.min_p,
            repetition_penalty: r.repetition_penalty,
            seed: r.seed,
            presence_penalty: r.presence_penalty,
            frequency_penalty: r.frequency_penalty,
        },
    )?;
    req.stop = stops(r.stop)?;
    if r.logprobs.unwrap_or(false) {
        let k = r.top_logprobs.unwrap_or(0);
        if k > 20 {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs must be between 0 and 20",
            ));
        }
        req.logprobs = Some(k as usize);
    }
    req.tool_choice = tool_choice(r.tool_choice)?;
    req.format = response_format(r.response_format)?;
    req.ignore_eos = r.ignore_eos.unwrap_or(false);
    let running = generation::start(&state, req).await?;
    if running.model.reasoning == ReasoningFormat::None {
        for (field, given) in [
            ("reasoning_effort", r.reasoning_effort.is_some()),
            ("enable_thinking", r.enable_thinking.is_some()),
            ("thinking_budget", r.thinking_budget.is_some()),
        ] {
            if given {
                declined.ignore(field);
            }
        }
    }
    let id = request_id("chatcmpl");
    let model = running.model.id.clone();
    let created = running.created;
    if r.stream.unwrap_or(false) {
        let include_usage = r.stream_options.unwrap_or_default().include_usage;
        let mut resp = chat_stream(running, id, model, created, include_usage).into_response();
        declined.apply("/v1/chat/completions", &mut resp);
        return Ok(resp);
    }
    let done = running.collect().await?;
    let mut message = json!({
        "role": "assistant",
        "content": if done.text.is_empty() && !done.calls.is_empty() { Value::Null } else { json!(done.text) },
        "refusal": Value::Null,
    });
    if !done.reasoning.is_empty() {
        message["reasoning_content"] = json!(done.reasoning);
    }
    if !done.calls.is_empty() {
        message["tool_calls"] = done
            .calls
            .iter()
            .enumerate()
            .map(|(i, c)| call_json(i, c, false))
            .collect();
    }
    let logprobs = if r.logprobs.unwrap_or(false) {
        json!({"content": logprob_content(&done.logprobs), "refusal": Value::Null})
    } else {
        Value::Null
    };
    let mut resp = Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": concat!("shoal-", env!("CARGO_PKG_VERSION")),
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_str(done.reason),
        }],
        "usage": usage_json(done.usage),
    }))
    .into_response();
    declined.apply("/v1/chat/completions", &mut resp);
    Ok(resp)
}

type SseItem = Result<SseEvent, std::convert::Infallible>;

fn data(v: &Value) -> SseItem {
    Ok(SseEvent::default().data(v.to_string()))
}

/// Server-sent events of a chat completion, ending with `[DONE]`.
fn chat_stream(
    running: generation::Running,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
) -> Sse<impl Stream<Item = SseItem>> {
    let chunk = move |delta: Value, finish: Option<&str>, logprobs: Value| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": concat!("shoal-", env!("CARGO_PKG_VERSION")),
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let first = vec![data(&chunk(
        json!({"role": "assistant", "content": ""}),
        None,
        Value::Null,
    ))];
    let s = running.stream_with(first, move |out| match out {
        Out::Text { text, logprobs } => {
            let lp = if logprobs.is_empty() {
                Value::Null
            } else {
                json!({"content": logprob_content(&logprobs)})
            };
            vec![data(&chunk(json!({"content": text}), None, lp))]
        }
        Out::Reasoning(text) => vec![data(&chunk(
            json!({"reasoning_content": text}),
            None,
            Value::Null,
        ))],
        Out::Call { index, call } => vec![data(&chunk(
            json!({"tool_calls": [call_json(index, &call, true)]}),
            None,
            Value::Null,
        ))],
        Out::Finished { reason, usage, .. } => {
            let mut items = vec![data(&chunk(
                json!({}),
                Some(finish_str(reason)),
                Value::Null,
            ))];
            if include_usage {
                let mut u = chunk(json!({}), None, Value::Null);
                u["choices"] = json!([]);
                u["usage"] = usage_json(usage);
                items.push(data(&u));
            }
            items.push(done());
            items
        }
        Out::Failed(msg) => vec![data(&ApiError::internal(msg).body()), done()],
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

fn done() -> SseItem {
    Ok(SseEvent::default().data("[DONE]"))
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: OneOrMany,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<OneOrMany>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default)]
    logprobs: Option<u32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    ignore_eos: Option<bool>,
}

fn legacy_logprobs(lps: &[TokenLogprob]) -> Value {
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for l in lps {
        offsets.push(offset);
        offset += l.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            l.top.iter().map(|(_, t, _, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(b) => b,
        Err(e) => return e.flavor(Flavor::OpenAi).into_response(),
    };
    match completions_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.flavor(Flavor::OpenAi).into_response(),
    }
}

async fn completions_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let r: CompletionRequest = parse_body(&body)?;
    check_n(r.n)?;
    if r.echo.unwrap_or(false) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    let mut prompts = r.prompt.into_vec();
    if prompts.len() != 1 {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "send one prompt per request (got {}); batch by sending requests concurrently",
                prompts.len()
            ),
        ));
    }
    let prompt = prompts.pop().unwrap_or_default();
    let mut req = GenRequest::new(r.model, Input::Text(prompt));
    req.max_tokens = Some(r.max_tokens.unwrap_or(16).min(u32::MAX as u64) as usize);
    apply_sampling(
        &mut req,
        Sampling {
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            min_p: r.min_p,
            repetition_penalty: r.repetition_penalty,
            seed: r.seed,
            presence_penalty: r.presence_penalty,
            frequency_penalty: r.frequency_penalty,
        },
    )?;
    req.stop = stops(r.stop)?;
    if let Some(k) = r.logprobs {
        if k > 5 {
            return Err(ApiError::invalid_param(
                "logprobs",
                "logprobs must be between 0 and 5",
            ));
        }
        req.logprobs = Some(k as usize);
    }
    req.ignore_eos = r.ignore_eos.unwrap_or(false);
    let want_lp = r.logprobs.is_some();
    let running = generation::start(&state, req).await?;
    let id = request_id("cmpl");
    let model = running.model.id.clone();
    let created = running.created;
    if r.stream.unwrap_or(false) {
        let include_usage = r.stream_options.unwrap_or_default().include_usage;
        let chunk = move |text: &str, finish: Option<&str>, lp: Value| {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})
        };
        let s = running.stream_with(Vec::new(), move |out| match out {
            Out::Text { text, logprobs } => {
                let lp = if logprobs.is_empty() {
                    Value::Null
                } else {
                    legacy_logprobs(&logprobs)
                };
                vec![data(&chunk(&text, None, lp))]
            }
            Out::Reasoning(_) | Out::Call { .. } => Vec::new(),
            Out::Finished { reason, usage, .. } => {
                let mut items = vec![data(&chunk("", Some(finish_str(reason)), Value::Null))];
                if include_usage {
                    let mut u = chunk("", None, Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = usage_json(usage);
                    items.push(data(&u));
                }
                items.push(done());
                items
            }
            Out::Failed(msg) => vec![data(&ApiError::internal(msg).body()), done()],
        });
        return Ok(Sse::new(s).keep_alive(KeepAlive::default()).into_response());
    }
    let done = running.collect().await?;
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": concat!("shoal-", env!("CARGO_PKG_VERSION")),
        "choices": [{
            "index": 0,
            "text": done.text,
            "logprobs": if want_lp { legacy_logprobs(&done.logprobs) } else { Value::Null },
            "finish_reason": finish_str(done.reason),
        }],
        "usage": usage_json(done.usage),
    }))
    .into_response())
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = state.keys.authorize(&headers) {
        return e.flavor(Flavor::OpenAi).into_response();
    }
    let mut data: Vec<Value> = state
        .served()
        .iter()
        .map(|m| json!({"id": m.id, "object": "model", "created": m.created, "owned_by": "shoal"}))
        .collect();
    // instances other nodes lead, answered here by forwarding
    data.extend(
        state
            .remote_instances()
            .into_iter()
            .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "shoal"})),
    );
    Json(json!({"object": "list", "data": data})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_carry_token_ids_beside_openai_fields() {
        let lps = [TokenLogprob {
            id: 7,
            token: String::new(),
            bytes: Vec::new(),
            logprob: -0.5,
            top: vec![
                (7, String::new(), Vec::new(), -0.5),
                (9, "a".into(), b"a".to_vec(), -1.0),
            ],
        }];
        let v = logprob_content(&lps);
        assert_eq!(v[0]["id"], 7);
        assert_eq!(v[0]["token"], "");
        assert_eq!(v[0]["logprob"], -0.5);
        assert_eq!(v[0]["top_logprobs"][1]["id"], 9);
        assert_eq!(v[0]["top_logprobs"][1]["bytes"], json!([97]));
        let legacy = legacy_logprobs(&lps);
        assert_eq!(legacy["top_logprobs"][0]["a"], -1.0);
    }
}
