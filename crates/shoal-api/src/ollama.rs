//! Ollama-compatible routes: `POST /api/chat` and `POST /api/generate` (streaming
//! newline-delimited JSON by default, as Ollama does; `options` for sampling, `format` for
//! JSON output, tools with argument objects; a thinking model's reasoning in `thinking`,
//! switched by `think`), `GET /api/tags`, `POST /api/show` and `GET /api/version`, with
//! Ollama's `{"error": "..."}` shape.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{parse_body, ApiError, ErrorKind, Flavor};
use crate::generation::{self, Finish, GenRequest, Input, Message, Out, OutputFormat, Tool, Usage};
use crate::openai::{arguments_value, OneOrMany};
use crate::reasoning::{ReasoningFormat, Thinking};
use crate::state::AppState;
use crate::tools::ToolCall;

#[derive(Debug, Deserialize, Default)]
struct Options {
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    num_predict: Option<i64>,
    #[serde(default)]
    stop: Option<OneOrMany>,
    #[serde(default)]
    repeat_penalty: Option<f32>,
    #[serde(default)]
    repeat_last_n: Option<i64>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
}

#[derive(Debug, Deserialize)]
struct WireCall {
    function: WireFunction,
}

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: String,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    tool_calls: Option<Vec<WireCall>>,
    #[serde(default)]
    tool_name: Option<String>,
    #[serde(default)]
    thinking: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireTool {
    function: WireToolFunction,
}

#[derive(Debug, Deserialize)]
struct WireToolFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    #[serde(default)]
    messages: Vec<WireMessage>,
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    think: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    model: String,
    #[serde(default)]
    prompt: String,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    raw: Option<bool>,
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    options: Option<Options>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    think: Option<Value>,
}

/// Ollama's `think`: `true` or `false`, or an effort level (`low`, `medium`, `high`) that
/// also turns thinking on.
fn thinking_of(think: Option<Value>) -> Result<Thinking, ApiError> {
    let mut t = Thinking::default();
    match think {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => t.enabled = Some(b),
        Some(Value::String(e)) if ["low", "medium", "high"].contains(&e.as_str()) => {
            t.enabled = Some(true);
            t.effort = Some(e);
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "think",
                "think must be true, false, \"low\", \"medium\" or \"high\"",
            ))
        }
    }
    Ok(t)
}

fn apply_options(req: &mut GenRequest, o: Options) -> Result<(), ApiError> {
    let s = &mut req.sampling;
    s.temperature = o.temperature.unwrap_or(0.8);
    s.top_p = o.top_p.unwrap_or(0.9);
    s.top_k = o.top_k.unwrap_or(40) as usize;
    s.min_p = o.min_p.unwrap_or(0.0);
    s.repeat_penalty = o.repeat_penalty.unwrap_or(1.1);
    if let Some(n) = o.repeat_last_n {
        s.repeat_last_n = n.clamp(0, 4096) as usize;
    }
    req.seed = o.seed.map(|v| v as u64);
    req.max_tokens = match o.num_predict {
        None | Some(-1) | Some(-2) => None,
        Some(n) if n > 0 => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid_param(
                "options.num_predict",
                format!("num_predict {n} must be positive, or -1 for no limit"),
            ))
        }
    };
    req.stop = o.stop.map(OneOrMany::into_vec).unwrap_or_default();
    req.presence_penalty = o.presence_penalty.unwrap_or(0.0);
    req.frequency_penalty = o.frequency_penalty.unwrap_or(0.0);
    Ok(())
}

fn format(v: Option<Value>) -> Result<OutputFormat, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(OutputFormat::Text),
        Some(Value::String(s)) if s.is_empty() => Ok(OutputFormat::Text),
        Some(Value::String(s)) if s == "json" => Ok(OutputFormat::JsonObject),
        Some(Value::Object(o)) => Ok(OutputFormat::JsonSchema(Value::Object(o))),
        Some(_) => Err(ApiError::invalid_param(
            "format",
            "format must be \"json\" or a JSON schema object",
        )),
    }
}

/// RFC 3339 UTC time of Unix seconds (civil-from-days, Howard Hinnant's algorithm).
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn now() -> String {
    rfc3339(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    )
}

fn done_reason(f: Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        Finish::Stop | Finish::ToolCalls => "stop",
    }
}

fn finals(model: &str, reason: Finish, u: Usage) -> Value {
    let ns = |d: std::time::Duration| d.as_nanos() as u64;
    json!({
        "model": model,
        "created_at": now(),
        "done": true,
        "done_reason": done_reason(reason),
        "total_duration": ns(u.total),
        "load_duration": 0,
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": ns(u.time_to_first_token),
        "eval_count": u.completion_tokens,
        "eval_duration": ns(u.total.saturating_sub(u.time_to_first_token)),
    })
}

fn call_json(c: &ToolCall) -> Value {
    json!({"function": {"name": c.name, "arguments": c.arguments}})
}

fn ollama_err(e: ApiError) -> Response {
    e.flavor(Flavor::Ollama).into_response()
}

/// Newline-delimited JSON of a running request: a piece object per text or call, then the
/// final object (with the counts and timings Ollama reports).
fn ndjson(running: generation::Running, model: String, chat: bool) -> Response {
    let line = |v: Value| -> Result<Bytes, std::convert::Infallible> {
        let mut s = v.to_string();
        s.push('\n');
        Ok(Bytes::from(s))
    };
    let piece = move |model: &str, content: &str, thinking: Option<&str>, calls: Option<Value>| {
        let mut v = json!({"model": model, "created_at": now(), "done": false});
        if chat {
            v["message"] = json!({"role": "assistant", "content": content});
            if let Some(t) = thinking {
                v["message"]["thinking"] = json!(t);
            }
            if let Some(c) = calls {
                v["message"]["tool_calls"] = c;
            }
        } else {
            v["response"] = json!(content);
            if let Some(t) = thinking {
                v["thinking"] = json!(t);
            }
        }
        v
    };
    let s = running.stream_with(Vec::new(), move |out| match out {
        Out::Text { text, .. } | Out::Reasoning(text) if text.is_empty() => Vec::new(),
        Out::Text { text, .. } => vec![line(piece(&model, &text, None, None))],
        Out::Reasoning(text) => vec![line(piece(&model, "", Some(&text), None))],
        Out::Call { call, .. } => vec![line(piece(
            &model,
            "",
            None,
            Some(json!([call_json(&call)])),
        ))],
        Out::Finished { reason, usage, .. } => {
            let mut f = finals(&model, reason, usage);
            if chat {
                f["message"] = json!({"role": "assistant", "content": ""});
            } else {
                f["response"] = json!("");
            }
            vec![line(f)]
        }
        Out::Failed(msg) => vec![line(json!({"error": msg}))],
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(s),
    )
        .into_response()
}

/// `POST /api/chat`.
pub async fn chat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => ollama_err(e),
    }
}

async fn chat_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let body = crate::body_bytes(body)?;
    let r: ChatRequest = parse_body(&body)?;
    if r.messages.is_empty() {
        // Ollama loads the model and answers an empty chat with an empty message.
        state.model(&r.model)?;
        let mut v = finals(&r.model, Finish::Stop, Usage::default());
        v["message"] = json!({"role": "assistant", "content": ""});
        return Ok(Json(v).into_response());
    }
    let mut msgs = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.into_iter().enumerate() {
        if m.images.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].images"),
                "images are not supported by the models shoal serves",
            ));
        }
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role.clone(),
            other => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("unknown role '{other}'; use system, user, assistant or tool"),
                ))
            }
        };
        let mut msg = Message::text(&role, m.content);
        for (j, c) in m.tool_calls.unwrap_or_default().into_iter().enumerate() {
            msg.tool_calls.push(ToolCall {
                id: format!("call_{i}_{j}"),
                name: c.function.name,
                arguments: arguments_value(
                    c.function.arguments,
                    &format!("messages[{i}].tool_calls[{j}]"),
                )?,
            });
        }
        msg.name = m.tool_name;
        msg.reasoning = m.thinking.filter(|t| !t.is_empty());
        msgs.push(msg);
    }
    let tools: Vec<Tool> = r
        .tools
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            Tool::new(
                t.function.name,
                t.function.description,
                t.function.parameters,
            )
        })
        .collect();
    let mut req = GenRequest::new(
        r.model,
        Input::Chat {
            messages: msgs,
            tools,
        },
    );
    apply_options(&mut req, r.options.unwrap_or_default())?;
    req.format = format(r.format)?;
    req.thinking = thinking_of(r.think)?;
    let running = generation::start(&state, req).await?;
    let model = running.model.id.clone();
    if r.stream.unwrap_or(true) {
        return Ok(ndjson(running, model, true));
    }
    let done = running.collect().await?;
    let mut v = finals(&model, done.reason, done.usage);
    v["message"] = json!({"role": "assistant", "content": done.text});
    if !done.reasoning.is_empty() {
        v["message"]["thinking"] = json!(done.reasoning);
    }
    if !done.calls.is_empty() {
        v["message"]["tool_calls"] = done.calls.iter().map(call_json).collect();
    }
    Ok(Json(v).into_response())
}

/// `POST /api/generate`.
pub async fn generate(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match generate_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => ollama_err(e),
    }
}

async fn generate_inner(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    state.keys.authorize(&headers)?;
    let body = crate::body_bytes(body)?;
    let r: GenerateRequest = parse_body(&body)?;
    if r.images.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::invalid_param(
            "images",
            "images are not supported by the models shoal serves",
        ));
    }
    if r.prompt.is_empty() {
        // Ollama answers an empty prompt by loading the model and returning nothing.
        state.model(&r.model)?;
        let mut v = finals(&r.model, Finish::Stop, Usage::default());
        v["response"] = json!("");
        return Ok(Json(v).into_response());
    }
    let served = state.model(&r.model)?;
    let input = if r.raw.unwrap_or(false) || served.model().chat_template.is_none() {
        Input::Text(r.prompt)
    } else {
        let mut messages = Vec::new();
        if let Some(s) = r.system {
            messages.push(Message::text("system", s));
        }
        messages.push(Message::text("user", r.prompt));
        Input::Chat {
            messages,
            tools: Vec::new(),
        }
    };
    let mut req = GenRequest::new(r.model, input);
    apply_options(&mut req, r.options.unwrap_or_default())?;
    req.format = format(r.format)?;
    req.thinking = thinking_of(r.think)?;
    let running = generation::start(&state, req).await?;
    let model = running.model.id.clone();
    if r.stream.unwrap_or(true) {
        return Ok(ndjson(running, model, false));
    }
    let done = running.collect().await?;
    let mut v = finals(&model, done.reason, done.usage);
    v["response"] = json!(done.text);
    if !done.reasoning.is_empty() {
        v["thinking"] = json!(done.reasoning);
    }
    Ok(Json(v).into_response())
}

fn details(m: &crate::state::ServedModel) -> Value {
    let cfg = m.model().transformer.config();
    json!({
        "format": "gguf",
        "family": format!("{:?}", cfg.arch).to_lowercase(),
        "families": [format!("{:?}", cfg.arch).to_lowercase()],
        "parameter_size": "",
        "quantization_level": "",
    })
}

/// `GET /api/tags`.
pub async fn tags(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = state.keys.authorize(&headers) {
        return ollama_err(e);
    }
    let mut models: Vec<Value> = state
        .served()
        .iter()
        .map(|m| {
            let name = format!("{}:latest", m.id);
            json!({
                "name": name,
                "model": name,
                "modified_at": rfc3339(m.created),
                "size": m.size,
                "digest": "",
                "details": details(m),
            })
        })
        .collect();
    // instances other nodes lead, answered here by forwarding
    models.extend(state.remote_instances().into_iter().map(|id| {
        let name = format!("{id}:latest");
        json!({"name": name, "model": name, "modified_at": rfc3339(0), "size": 0, "digest": ""})
    }));
    Json(json!({"models": models})).into_response()
}

#[derive(Debug, Deserialize)]
struct ShowRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// `POST /api/show`.
pub async fn show(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<Response, ApiError> {
        state.keys.authorize(&headers)?;
        let body = crate::body_bytes(body)?;
        let r: ShowRequest = parse_body(&body)?;
        let name = r
            .model
            .or(r.name)
            .ok_or_else(|| ApiError::invalid_param("model", "name the model to show in 'model'"))?;
        let m = state.model(&name).map_err(|e| ApiError {
            kind: ErrorKind::NotFound,
            message: format!("model '{name}' not found"),
            ..e
        })?;
        let cfg = m.model().transformer.config();
        let arch = format!("{:?}", cfg.arch).to_lowercase();
        let mut capabilities = vec!["completion"];
        if m.model()
            .chat_template
            .as_ref()
            .is_some_and(|t| t.source().contains("tools"))
        {
            capabilities.push("tools");
        }
        if m.reasoning != ReasoningFormat::None {
            capabilities.push("thinking");
        }
        Ok(Json(json!({
            "modelfile": "",
            "parameters": "",
            "template": m.model().chat_template.as_ref().map(|t| t.source().to_string()).unwrap_or_default(),
            "details": details(&m),
            "model_info": {
                "general.architecture": arch,
                format!("{arch}.context_length"): cfg.context_len,
                format!("{arch}.embedding_length"): cfg.hidden,
                format!("{arch}.block_count"): cfg.n_layer,
            },
            "capabilities": capabilities,
            "modified_at": rfc3339(m.created),
        }))
        .into_response())
    };
    match run() {
        Ok(r) => r,
        Err(e) => ollama_err(e),
    }
}

/// `GET /api/version`.
pub async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_305_600), "2026-11-22T00:00:00Z");
    }
}
