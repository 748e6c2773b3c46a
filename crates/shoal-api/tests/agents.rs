//! Requests shaped as the coding agents send them (Claude Code on the Messages API, the
//! Codex CLI on the Responses API, Qwen Code on chat completions), answered instead of
//! refused: system messages inside the conversation, hosted tools declined with a header,
//! thinking, context-management and effort fields ignored, namespaced and custom tools
//! folded into functions, reasoning items skipped, `HEAD /` and `count_tokens` answered;
//! and an agent's conversation sent back turn after turn hits the prefix cache through the
//! turns the model generated.

mod common;

use axum::http::StatusCode;
use common::{runtime, send, state_with, tiny_model_with_context};
use serde_json::{json, Value};
use shoal_api::declined::{DECLINED_TOOLS_HEADER, IGNORED_HEADER};
use shoal_api::HttpOptions;
use shoal_engine::scheduler::SchedulerConfig;

/// The tiny model with room for an agent's system prompt and tools.
fn app() -> (tempfile::TempDir, axum::Router) {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model_with_context(dir.path(), 8192);
    let state = state_with(
        model,
        "tiny",
        SchedulerConfig {
            max_batch: 2,
            max_queue: 4,
            ctx: 8192,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    );
    (dir, shoal_api::router(state, &HttpOptions::default()))
}

fn header<'a>(h: &'a axum::http::HeaderMap, name: &str) -> &'a str {
    h.get(name).map_or("", |v| v.to_str().unwrap())
}

/// Claude Code's first request, in miniature: system blocks with cache hints, a `system`
/// message after the first user message, thinking, context management and effort, its own
/// tools beside a hosted one, and a second turn carrying a thinking block, an image in a
/// tool result and the tool's result.
fn claude_code_request(stream: bool) -> Value {
    json!({
        "model": "tiny",
        "max_tokens": 4,
        "stream": stream,
        "temperature": 0,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>date</system-reminder>"},
                {"type": "text", "text": "read README", "cache_control": {"type": "ephemeral"}},
            ]},
            {"role": "system", "content": "Available agent types: general"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "abc"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/r/README"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "hello"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                ]},
            ]},
        ],
        "tools": [
            {"name": "Read", "description": "Reads a file.", "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
                "additionalProperties": false}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": "{\"device_id\":\"d\"}"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    })
}

#[test]
fn claude_code_requests_are_answered_with_what_was_left_out_named() {
    let (_dir, app) = app();
    runtime().block_on(async {
        let (s, _, b) = send(&app, "HEAD", "/", None, &Value::Null).await;
        assert_eq!(s, StatusCode::OK, "Claude Code probes HEAD / first: {b}");
        for stream in [false, true] {
            let (s, h, b) = send(
                &app,
                "POST",
                "/v1/messages?beta=true",
                None,
                &claude_code_request(stream),
            )
            .await;
            assert_eq!(s, StatusCode::OK, "{b}");
            assert_eq!(header(&h, DECLINED_TOOLS_HEADER), "web_search");
            let ignored = header(&h, IGNORED_HEADER);
            for what in [
                "billing header in system",
                "thinking blocks",
                "image blocks",
                "thinking",
                "context_management",
                "output_config.effort",
            ] {
                assert!(ignored.contains(what), "{what} in {ignored}");
            }
            if stream {
                assert!(b.contains("event: message_stop"), "{b}");
            } else {
                assert_eq!(
                    serde_json::from_str::<Value>(&b).unwrap()["type"],
                    "message"
                );
            }
        }
        let mut count = claude_code_request(false);
        count.as_object_mut().unwrap().remove("max_tokens");
        let (s, _, b) = send(&app, "POST", "/v1/messages/count_tokens", None, &count).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let n = serde_json::from_str::<Value>(&b).unwrap()["input_tokens"]
            .as_u64()
            .unwrap();
        assert!(n > 50, "{b}");
        // still refused: a role that is none of the three, a block without a type
        let mut bad = claude_code_request(false);
        bad["messages"][0]["role"] = json!("robot");
        let (s, _, b) = send(&app, "POST", "/v1/messages", None, &bad).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert!(b.contains("role 'robot'"), "{b}");
        let mut bad = claude_code_request(false);
        bad["messages"][2]["content"][0] = json!({"text": "no type"});
        let (s, _, b) = send(&app, "POST", "/v1/messages", None, &bad).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    });
}

/// The Codex CLI's request, in miniature: developer messages, function tools, a namespace of
/// sub-agent functions, a custom tool, a hosted web search, reasoning settings, and a
/// history with a reasoning item, a namespaced call, a custom tool call and their outputs.
fn codex_request() -> Value {
    json!({
        "model": "tiny",
        "stream": true,
        "temperature": 0,
        "max_output_tokens": 4,
        "tool_choice": "auto",
        "parallel_tool_calls": true,
        "reasoning": {"summary": "auto"},
        "store": false,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2",
        "client_metadata": {"turn_id": "t"},
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": false,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
                {"type": "function", "name": "spawn_agent", "strict": false,
                 "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
            {"type": "custom", "name": "apply_patch", "description": "Edits files.",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
            {"type": "web_search", "external_web_access": false},
        ],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read README"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
            {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\":\"cat README\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "hello"},
            {"type": "function_call", "call_id": "call_2", "namespace": "multi_agent_v1", "name": "spawn_agent", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "spawned"}]},
            {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done"},
        ],
    })
}

#[test]
fn codex_requests_are_answered_with_what_was_left_out_named() {
    let (_dir, app) = app();
    runtime().block_on(async {
        let (s, h, b) = send(&app, "POST", "/v1/responses", None, &codex_request()).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert!(
            b.contains("response.completed") || b.contains("response.incomplete"),
            "{b}"
        );
        assert_eq!(header(&h, DECLINED_TOOLS_HEADER), "web_search");
        let ignored = header(&h, IGNORED_HEADER);
        for what in ["reasoning items", "reasoning", "include"] {
            assert!(ignored.contains(what), "{what} in {ignored}");
        }
        // a hosted tool as the tool choice: the model chooses among the rest
        let mut r = codex_request();
        r["tool_choice"] = json!({"type": "web_search"});
        let (s, _, b) = send(&app, "POST", "/v1/responses", None, &r).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        // still refused: arguments that are not JSON, a tool without a type
        let mut bad = codex_request();
        bad["input"][3]["arguments"] = json!("{");
        let (s, _, b) = send(&app, "POST", "/v1/responses", None, &bad).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert!(b.contains("input[3].arguments"), "{b}");
        let mut bad = codex_request();
        bad["tools"][0] = json!({"name": "f"});
        let (s, _, b) = send(&app, "POST", "/v1/responses", None, &bad).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    });
}

#[test]
fn chat_completions_decline_hosted_tools_and_images() {
    let (_dir, app) = app();
    runtime().block_on(async {
        let body = json!({
            "model": "tiny", "max_tokens": 3, "temperature": 0,
            "stream": true, "stream_options": {"include_usage": true},
            "reasoning_effort": "low",
            "messages": [
                {"role": "system", "content": "You are Qwen Code."},
                {"role": "user", "content": [
                    {"type": "text", "text": "what is in it?", "cache_control": {"type": "ephemeral"}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                ]},
            ],
            "tools": [
                {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
                {"type": "web_search_preview"},
            ],
        });
        let (s, h, b) = send(&app, "POST", "/v1/chat/completions", None, &body).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(header(&h, DECLINED_TOOLS_HEADER), "web_search_preview");
        let ignored = header(&h, IGNORED_HEADER);
        assert!(ignored.contains("image_url parts") && ignored.contains("reasoning_effort"), "{ignored}");
    });
}

/// An agent's loop: each turn sends the whole conversation again with the model's earlier
/// answer as the client rebuilt it (trimmed text). The earlier turns are rendered as the
/// model generated them, so each turn's prompt is served from the cache up to the new
/// message.
#[test]
fn a_conversation_sent_again_is_served_from_the_cache() {
    let (_dir, app) = app();
    runtime().block_on(async {
        let mut messages = vec![
            json!({"role": "system", "content": "You are a careful coding agent. Answer briefly."}),
            json!({"role": "user", "content": "first question"}),
        ];
        let mut earlier = 0u64;
        for turn in 0..4 {
            let body =
                json!({"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": messages});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &body).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let r: Value = serde_json::from_str(&b).unwrap();
            let u = &r["usage"];
            let (prompt, cached, out) = (
                u["prompt_tokens"].as_u64().unwrap(),
                u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
                u["completion_tokens"].as_u64().unwrap(),
            );
            if turn > 0 {
                // everything up to the end of the last answer came from the cache
                assert!(
                    cached + 1 >= earlier,
                    "turn {turn}: {u}, earlier prompt and answer {earlier}"
                );
            }
            earlier = prompt + out;
            let text = r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .trim()
                .to_string();
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(json!({"role": "user", "content": format!("question {turn}")}));
        }
    });
}
