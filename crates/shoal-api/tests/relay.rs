//! The lead's side of a relayed answer (`shoal_api::relay`), on the test kit's tiny model:
//! a forwarded stream carries one mark after each token's output, and a request taken over
//! after any of those marks (`x-shoal-resume` with the tokens marked so far) continues the
//! stream exactly: what came before the mark followed by the new lead's stream is the whole
//! answer, event for event, in every streaming API (ids, times and durations aside), also
//! for a thinking model's reasoning and tool call (replayed output through Qwen3's template,
//! see `thinking.rs`). A bad resume header is refused in the API's shape.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use std::sync::Arc;

use common::{runtime, state_with, tiny_model, tiny_model_with_context};
use serde_json::{json, Value};
use shoal_api::keys::KeyStore;
use shoal_api::replay::Replay;
use shoal_api::{AppState, HttpOptions, ServedModel};
use shoal_engine::scheduler::SchedulerConfig;
use tower::ServiceExt;

/// One event of a stream (an SSE block or an Ollama line), or a token's mark.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Event(String),
    Mark(u32),
}

/// The pieces of a streamed body: SSE blocks, or lines for Ollama.
fn pieces(body: &str, lines: bool) -> Vec<Piece> {
    let parts: Vec<&str> = if lines {
        body.lines().collect()
    } else {
        body.split("\n\n").collect()
    };
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let mark = if lines {
                p.strip_prefix("{\"shoal_token\":")
                    .and_then(|t| t.strip_suffix('}'))
            } else {
                p.strip_prefix(": shoal-token ")
            };
            match mark.and_then(|n| n.trim().parse().ok()) {
                Some(id) => Piece::Mark(id),
                None => Piece::Event(p.to_string()),
            }
        })
        .collect()
}

/// An event with what differs between two leads taken out: ids, times and durations.
fn normalized(event: &str) -> Value {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.retain(|k, _| {
                    !(k == "id"
                        || k.ends_with("_id")
                        || k.starts_with("created")
                        || k.ends_with("duration")
                        || k.ends_with("_at"))
                });
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let lines: Vec<Value> = event
        .lines()
        .map(|l| {
            let data = l.strip_prefix("data: ").unwrap_or(l);
            let mut v = serde_json::from_str(data).unwrap_or_else(|_| json!(data));
            strip(&mut v);
            v
        })
        .collect();
    json!(lines)
}

async fn post(
    app: &axum::Router,
    path: &str,
    body: &Value,
    resume: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/json")
        .header("x-shoal-forwarded", "1");
    if let Some(r) = resume {
        req = req.header("x-shoal-resume", r);
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let b = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&b).into_owned())
}

/// Takes each stream of `apis` (route, body, whether Ollama's lines) over after each of
/// its tokens and checks that the client would see the whole stream; returns the whole
/// streams.
async fn check_takeovers(app: &axum::Router, apis: &[(&str, Value, bool)]) -> Vec<String> {
    let mut streams = Vec::new();
    for (path, body, lines) in apis {
        let (path, lines) = (*path, *lines);
        let (s, whole) = post(app, path, body, None).await;
        assert_eq!(s, StatusCode::OK, "{path}: {whole}");
        let all = pieces(&whole, lines);
        let marks: Vec<usize> = (0..all.len())
            .filter(|&i| matches!(all[i], Piece::Mark(_)))
            .collect();
        assert!(marks.len() >= 2, "{path}: marks after the tokens: {whole}");
        let events = |p: &[Piece]| -> Vec<Value> {
            p.iter()
                .filter_map(|x| match x {
                    Piece::Event(e) => Some(normalized(e)),
                    Piece::Mark(_) => None,
                })
                .collect()
        };
        let want = events(&all);
        for (k, &at) in marks.iter().enumerate() {
            let tokens: Vec<String> = all[..=at]
                .iter()
                .filter_map(|x| match x {
                    Piece::Mark(id) => Some(id.to_string()),
                    Piece::Event(_) => None,
                })
                .collect();
            assert_eq!(tokens.len(), k + 1);
            let (s, rest) = post(app, path, body, Some(&tokens.join(","))).await;
            assert_eq!(s, StatusCode::OK, "{path}: {rest}");
            let mut got = events(&all[..at]);
            got.extend(events(&pieces(&rest, lines)));
            let differ = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i));
            if let Some(i) = differ {
                panic!(
                    "{path}: taken over after token {}, the stream differs at event {i} of {} \
                     (got {}): {:?} where the whole stream has {:?}",
                    k + 1,
                    want.len(),
                    got.len(),
                    got.get(i),
                    want.get(i)
                );
            }
        }
        eprintln!(
            "{path}: taken over after each of {} tokens, the same stream",
            marks.len()
        );
        streams.push(whole);
    }
    streams
}

#[test]
fn a_stream_taken_over_after_any_token_continues_exactly() {
    // no prefix cache: a request sent again would count cached prompt tokens the first
    // did not
    let dir = tempfile::tempdir().unwrap();
    let config = SchedulerConfig {
        max_batch: 4,
        max_queue: 8,
        ctx: 128,
        prefix_cache: false,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let state = state_with(tiny_model(dir.path()), "tiny", config);
    let app = shoal_api::router(state, &HttpOptions::default());
    let messages = json!([{"role": "user", "content": "Tell me about the sea."}]);
    let apis: [(&str, Value, bool); 5] = [
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0,
                   "ignore_eos": true, "stream": true,
                   "stream_options": {"include_usage": true}}),
            false,
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "The sea", "max_tokens": 12, "temperature": 0,
                   "ignore_eos": true, "stream": true}),
            false,
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0,
                   "stream": true}),
            false,
        ),
        (
            "/v1/responses",
            json!({"model": "tiny", "input": "Tell me about the sea.", "max_output_tokens": 12,
                   "temperature": 0, "stream": true, "store": false}),
            false,
        ),
        (
            "/api/chat",
            json!({"model": "tiny", "messages": messages, "stream": true,
                   "options": {"temperature": 0, "num_predict": 12}}),
            true,
        ),
    ];
    runtime().block_on(async {
        check_takeovers(&app, &apis).await;
        // a resume header that is not a list of token ids, or names a token outside the
        // vocabulary: refused in the API's shape
        let body = json!({"model": "tiny", "messages": messages, "max_tokens": 4, "stream": true});
        let (s, b) = post(&app, "/v1/messages", &body, Some("1,two")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert!(
            b.contains("\"type\":\"error\"") && b.contains("token ids"),
            "{b}"
        );
        let (s, b) = post(&app, "/v1/messages", &body, Some("4000000000")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert!(b.contains("vocabulary"), "{b}");
    });
}

#[test]
fn reasoning_and_a_tool_call_taken_over_after_any_token_continue_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny_model_with_context(dir.path(), 4096);
    let template = format!(
        "{}/../shoal-model/tests/data/templates/Qwen-Qwen3-0.6B.jinja",
        env!("CARGO_MANIFEST_DIR")
    );
    model
        .set_chat_template(&std::fs::read_to_string(template).unwrap())
        .unwrap();
    let config = SchedulerConfig {
        max_batch: 2,
        max_queue: 8,
        ctx: 4096,
        prefix_cache: false,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let replay = format!(
        "{}/tests/data/thinking-qwen3.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let served = ServedModel::start("thinker", model, config)
        .unwrap()
        .with_replay(Replay::load(std::path::Path::new(&replay)).unwrap());
    let state = Arc::new(AppState::new(
        vec![served],
        KeyStore::open(None, None).unwrap(),
    ));
    let app = shoal_api::router(state, &HttpOptions::default());
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    let messages = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let anthropic_tool = json!({"name": "get_weather", "description": "Weather of a city",
        "input_schema": tool["function"]["parameters"]});
    let apis: [(&str, Value, bool); 4] = [
        (
            "/v1/chat/completions",
            json!({"model": "thinker", "messages": messages, "tools": [tool], "stream": true}),
            false,
        ),
        (
            "/v1/messages",
            json!({"model": "thinker", "messages": messages, "tools": [anthropic_tool],
                   "max_tokens": 1000, "stream": true,
                   "thinking": {"type": "enabled", "budget_tokens": 1000}}),
            false,
        ),
        (
            "/v1/responses",
            json!({"model": "thinker", "input": "What is the weather in Paris?",
                   "tools": [{"type": "function", "name": "get_weather",
                              "parameters": tool["function"]["parameters"]}],
                   "stream": true, "store": false}),
            false,
        ),
        (
            "/api/chat",
            json!({"model": "thinker", "messages": messages, "tools": [tool], "stream": true,
                   "think": true}),
            true,
        ),
    ];
    let streams = runtime().block_on(check_takeovers(&app, &apis));
    // each holds the reasoning and the call, in its API's shape
    for (whole, (reasoning, call)) in streams.iter().zip([
        ("\"reasoning_content\"", "\"tool_calls\""),
        ("\"thinking_delta\"", "\"tool_use\""),
        ("\"reasoning\"", "\"function_call\""),
        ("\"thinking\"", "\"tool_calls\""),
    ]) {
        assert!(
            whole.contains(reasoning) && whole.contains(call) && whole.contains("get_weather"),
            "{whole}"
        );
    }
}
