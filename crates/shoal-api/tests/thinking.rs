//! A thinking model's reasoning apart from its answer, in every API, streamed and not.
//!
//! No model that thinks is on the package registries, so these tests drive the server with
//! recorded output (`--replay`, [`shoal_api::replay`]): the test kit's tiny model is given a
//! real thinking model's chat template (Qwen3, DeepSeek V3.1 and R1, GLM 4.6, Kimi K2
//! Thinking, kept as test data) and its output is forced, token by token through the real
//! tokenizer, scheduler and parsers, to text written in that model's output format (see
//! `tests/data/thinking-qwen3.json`; written from the format, not recorded from a run).

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::{runtime, send, tiny_model_with_context};
use serde_json::{json, Value};
use shoal_api::keys::KeyStore;
use shoal_api::reasoning::{settle_prompt, ReasoningFormat, Thinking};
use shoal_api::replay::Replay;
use shoal_api::{AppState, HttpOptions, ServedModel};
use shoal_engine::scheduler::SchedulerConfig;

fn template(name: &str) -> String {
    let path = format!(
        "{}/../shoal-model/tests/data/templates/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn qwen3_replay() -> Replay {
    let path = format!(
        "{}/tests/data/thinking-qwen3.json",
        env!("CARGO_MANIFEST_DIR")
    );
    Replay::load(std::path::Path::new(&path)).unwrap()
}

/// The tiny model with `template`, replaying `replay`, served as `thinker`.
fn app(template_name: &str, replay: Replay) -> (tempfile::TempDir, axum::Router) {
    app_with(template_name, Some(replay))
}

/// The tiny model with `template`, served as `thinker`, replaying `replay` when given (else
/// generating).
fn app_with(template_name: &str, replay: Option<Replay>) -> (tempfile::TempDir, axum::Router) {
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny_model_with_context(dir.path(), 4096);
    model.set_chat_template(&template(template_name)).unwrap();
    let mut served = ServedModel::start(
        "thinker",
        model,
        SchedulerConfig {
            max_batch: 2,
            max_queue: 8,
            ctx: 4096,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    )
    .unwrap();
    if let Some(r) = replay {
        served = served.with_replay(r);
    }
    let state = Arc::new(AppState::new(
        vec![served],
        KeyStore::open(None, None).unwrap(),
    ));
    (dir, shoal_api::router(state, &HttpOptions::default()))
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

const MATH_REASONING: &str =
    "Okay, 17 times 23. 17 times 20 is 340, and 17 times 3 is 51.\n\n340 plus 51 is 391.";
const MATH_ANSWER: &str = "17 × 23 = **391**.";
const WEATHER_REASONING: &str = "The user wants the weather in Paris. I have a get_weather tool that takes a city, so I should call it with \"Paris\" instead of guessing.";

/// The `data:` payloads of a server-sent event stream, `[DONE]` left out.
fn sse_data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

fn ndjson(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn json_of(b: &str) -> Value {
    serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}: {b}"))
}

#[test]
fn openai_chat_gives_reasoning_content_streamed_and_not_and_none_when_off() {
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", qwen3_replay());
    runtime().block_on(async {
        let ask = |extra: Value| {
            let mut r = json!({"model": "thinker", "messages": [{"role": "user", "content": "What is 17 times 23?"}]});
            r.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            r
        };
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &ask(json!({}))).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let v = json_of(&b);
        let m = &v["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], MATH_REASONING, "{b}");
        assert_eq!(m["content"], MATH_ANSWER, "{b}");
        let reasoning_tokens = v["usage"]["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap();
        let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(
            reasoning_tokens > 50 && reasoning_tokens < completion,
            "{b}"
        );

        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &ask(json!({"stream": true}))).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let (mut reasoning, mut content, mut deltas) = (String::new(), String::new(), 0);
        for c in sse_data(&b) {
            let d = &c["choices"][0]["delta"];
            if let Some(r) = d["reasoning_content"].as_str() {
                assert!(content.is_empty(), "reasoning after the answer began: {b}");
                reasoning.push_str(r);
                deltas += 1;
            }
            content.push_str(d["content"].as_str().unwrap_or(""));
        }
        assert_eq!(reasoning, MATH_REASONING);
        assert_eq!(content, MATH_ANSWER);
        assert!(deltas > 10, "the reasoning streams as it comes: {deltas} deltas");

        // thinking off, each way a client says it
        for off in [
            json!({"reasoning_effort": "none"}),
            json!({"enable_thinking": false}),
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
        ] {
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &ask(off.clone())).await;
            assert_eq!(s, StatusCode::OK, "{off}: {b}");
            let v = json_of(&b);
            assert!(v["choices"][0]["message"].get("reasoning_content").is_none(), "{off}: {b}");
            assert_eq!(v["choices"][0]["message"]["content"], "17 × 23 = 391.", "{off}: {b}");
            assert_eq!(v["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
        }
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &ask(json!({"reasoning_effort": 3}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    });
}

#[test]
fn a_tool_call_after_the_reasoning_is_a_tool_call_in_every_api() {
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", qwen3_replay());
    let question = "What is the weather in Paris?";
    runtime().block_on(async {
        for stream in [false, true] {
            // OpenAI chat
            let r = json!({"model": "thinker", "stream": stream, "tools": [weather_tool()],
                           "messages": [{"role": "user", "content": question}]});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let (reasoning, content, calls, finish) = if stream {
                let (mut r, mut c, mut calls, mut finish) = (String::new(), String::new(), Vec::new(), Value::Null);
                for chunk in sse_data(&b) {
                    let ch = &chunk["choices"][0];
                    r.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
                    c.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
                    calls.extend(ch["delta"]["tool_calls"].as_array().cloned().unwrap_or_default());
                    if !ch["finish_reason"].is_null() {
                        finish = ch["finish_reason"].clone();
                    }
                }
                (r, c, calls, finish)
            } else {
                let v = json_of(&b);
                let m = &v["choices"][0]["message"];
                (
                    m["reasoning_content"].as_str().unwrap_or("").to_string(),
                    m["content"].as_str().unwrap_or("").to_string(),
                    m["tool_calls"].as_array().cloned().unwrap_or_default(),
                    v["choices"][0]["finish_reason"].clone(),
                )
            };
            assert_eq!(reasoning, WEATHER_REASONING, "chat, stream {stream}");
            assert_eq!(content, "", "chat, stream {stream}: {b}");
            assert_eq!(calls.len(), 1, "{b}");
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            assert_eq!(json_of(calls[0]["function"]["arguments"].as_str().unwrap()), json!({"city": "Paris"}));
            assert_eq!(finish, "tool_calls");

            // Anthropic: a thinking block, then the tool_use block
            let r = json!({"model": "thinker", "max_tokens": 1000, "stream": stream,
                           "thinking": {"type": "enabled", "budget_tokens": 2000},
                           "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                           "messages": [{"role": "user", "content": question}]});
            let (s, h, b) = send(&app, "POST", "/v1/messages", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let ignored = h.get(shoal_api::declined::IGNORED_HEADER).map_or("", |v| v.to_str().unwrap());
            assert!(ignored.is_empty(), "{ignored}");
            let blocks: Vec<Value> = if stream {
                let mut blocks: Vec<Value> = Vec::new();
                for e in sse_data(&b) {
                    match e["type"].as_str().unwrap() {
                        "content_block_start" => {
                            assert_eq!(e["index"].as_u64().unwrap() as usize, blocks.len(), "{b}");
                            blocks.push(e["content_block"].clone());
                        }
                        "content_block_delta" => {
                            let last = blocks.last_mut().unwrap();
                            let d = &e["delta"];
                            match d["type"].as_str().unwrap() {
                                "thinking_delta" => {
                                    let t = last["thinking"].as_str().unwrap().to_string() + d["thinking"].as_str().unwrap();
                                    last["thinking"] = json!(t);
                                }
                                "input_json_delta" => last["input"] = json_of(d["partial_json"].as_str().unwrap()),
                                "text_delta" => {
                                    let t = last["text"].as_str().unwrap().to_string() + d["text"].as_str().unwrap();
                                    last["text"] = json!(t);
                                }
                                other => panic!("unexpected delta {other}: {b}"),
                            }
                        }
                        _ => {}
                    }
                }
                blocks
            } else {
                let v = json_of(&b);
                assert_eq!(v["stop_reason"], "tool_use", "{b}");
                v["content"].as_array().unwrap().clone()
            };
            assert_eq!(blocks.len(), 2, "{b}");
            assert_eq!(blocks[0]["type"], "thinking");
            assert_eq!(blocks[0]["thinking"], WEATHER_REASONING);
            assert_eq!(blocks[1]["type"], "tool_use");
            assert_eq!(blocks[1]["name"], "get_weather");
            assert_eq!(blocks[1]["input"], json!({"city": "Paris"}));

            // Responses: a reasoning item, then the function call
            let r = json!({"model": "thinker", "stream": stream, "input": question, "reasoning": {"effort": "high"},
                           "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
            let (s, h, b) = send(&app, "POST", "/v1/responses", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            assert!(h.get(shoal_api::declined::IGNORED_HEADER).is_none(), "{h:?}");
            let response = if stream {
                let events = sse_data(&b);
                let deltas: String = events
                    .iter()
                    .filter(|e| e["type"] == "response.reasoning_text.delta")
                    .map(|e| e["delta"].as_str().unwrap())
                    .collect();
                assert_eq!(deltas, WEATHER_REASONING);
                let added: Vec<&str> = events
                    .iter()
                    .filter(|e| e["type"] == "response.output_item.added")
                    .map(|e| e["item"]["type"].as_str().unwrap())
                    .collect();
                assert_eq!(added, ["reasoning", "function_call"], "{b}");
                let done = events.iter().find(|e| e["type"] == "response.completed").expect("completed");
                done["response"].clone()
            } else {
                json_of(&b)
            };
            let output = response["output"].as_array().unwrap();
            assert_eq!(output.len(), 2, "{response}");
            assert_eq!(output[0]["type"], "reasoning");
            assert_eq!(output[0]["content"][0]["type"], "reasoning_text");
            assert_eq!(output[0]["content"][0]["text"], WEATHER_REASONING);
            assert_eq!(output[1]["type"], "function_call");
            assert_eq!(output[1]["name"], "get_weather");
            assert!(response["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap() > 20);

            // Ollama
            let r = json!({"model": "thinker", "stream": stream, "think": true, "tools": [weather_tool()],
                           "messages": [{"role": "user", "content": question}]});
            let (s, _, b) = send(&app, "POST", "/api/chat", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let (mut thinking, mut content, mut calls) = (String::new(), String::new(), Vec::new());
            for v in if stream { ndjson(&b) } else { vec![json_of(&b)] } {
                thinking.push_str(v["message"]["thinking"].as_str().unwrap_or(""));
                content.push_str(v["message"]["content"].as_str().unwrap_or(""));
                calls.extend(v["message"]["tool_calls"].as_array().cloned().unwrap_or_default());
            }
            assert_eq!(thinking, WEATHER_REASONING, "{b}");
            assert_eq!(content, "");
            assert_eq!(calls, [json!({"function": {"name": "get_weather", "arguments": {"city": "Paris"}}})]);
        }
    });
}

#[test]
fn anthropic_responses_and_ollama_switch_thinking_off() {
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", qwen3_replay());
    runtime().block_on(async {
        let q = "What is 17 times 23?";
        let (s, _, b) = send(
            &app,
            "POST",
            "/v1/messages",
            None,
            &json!({
            "model": "thinker", "max_tokens": 500, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": q}]}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(
            json_of(&b)["content"],
            json!([{"type": "text", "text": "17 × 23 = 391."}])
        );
        let (s, _, b) = send(
            &app,
            "POST",
            "/v1/responses",
            None,
            &json!({
            "model": "thinker", "input": q, "reasoning": {"effort": "none"}}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let v = json_of(&b);
        assert_eq!(v["output"].as_array().unwrap().len(), 1, "{b}");
        assert_eq!(v["output"][0]["type"], "message");
        let (s, _, b) = send(
            &app,
            "POST",
            "/api/chat",
            None,
            &json!({
            "model": "thinker", "stream": false, "think": false,
            "messages": [{"role": "user", "content": q}]}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let v = json_of(&b);
        assert!(v["message"].get("thinking").is_none(), "{b}");
        assert_eq!(v["message"]["content"], "17 × 23 = 391.");
        // /api/generate gives the reasoning beside the response; /api/show says it thinks
        let (s, _, b) = send(
            &app,
            "POST",
            "/api/generate",
            None,
            &json!({
            "model": "thinker", "stream": false, "prompt": q}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let v = json_of(&b);
        assert_eq!(v["thinking"], MATH_REASONING);
        assert_eq!(v["response"], MATH_ANSWER);
        let (_, _, b) = send(
            &app,
            "POST",
            "/api/show",
            None,
            &json!({"model": "thinker"}),
        )
        .await;
        assert!(
            json_of(&b)["capabilities"]
                .as_array()
                .unwrap()
                .contains(&json!("thinking")),
            "{b}"
        );
        let (s, _, b) = send(
            &app,
            "POST",
            "/api/chat",
            None,
            &json!({
            "model": "thinker", "think": "very", "messages": [{"role": "user", "content": q}]}),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    });
}

/// The prompt tokens of a chat request (answered by the replay, so it costs little).
async fn prompt_tokens(app: &axum::Router, messages: Value) -> u64 {
    let (s, _, b) = send(
        app,
        "POST",
        "/v1/chat/completions",
        None,
        &json!({
        "model": "thinker", "messages": messages, "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    json_of(&b)["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn earlier_reasoning_goes_back_to_the_template_from_every_api() {
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", qwen3_replay());
    let reasoning = "I should look the weather up with the tool.";
    runtime().block_on(async {
        // Qwen3's template writes the reasoning of the turns after the last user message
        let turn = |with: bool| {
            let mut a = json!({"role": "assistant", "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]});
            if with {
                a["reasoning_content"] = json!(reasoning);
            }
            json!([{"role": "user", "content": "Weather in Paris?"}, a,
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
        };
        let without = prompt_tokens(&app, turn(false)).await;
        let with = prompt_tokens(&app, turn(true)).await;
        assert!(with > without + 20, "chat: {with} vs {without}");

        // Anthropic's thinking blocks, counted by count_tokens
        let count = |with: bool| {
            let mut content = vec![json!({"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}})];
            if with {
                content.insert(0, json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
            }
            json!({"model": "thinker", "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                   "messages": [{"role": "user", "content": "Weather in Paris?"},
                                {"role": "assistant", "content": content},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]})
        };
        let mut n = Vec::new();
        for with in [false, true] {
            let (s, _, b) = send(&app, "POST", "/v1/messages/count_tokens", None, &count(with)).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            n.push(json_of(&b)["input_tokens"].as_u64().unwrap());
        }
        assert!(n[1] > n[0] + 20, "anthropic: {n:?}");

        // a Responses reasoning item before the call it led to
        let input = |with: bool| {
            let mut items = vec![json!({"type": "message", "role": "user", "content": "Weather in Paris?"})];
            if with {
                items.push(json!({"type": "reasoning", "id": "rs_1", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": reasoning}]}));
            }
            items.push(json!({"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}));
            items.push(json!({"type": "function_call_output", "call_id": "c1", "output": "sunny"}));
            json!({"model": "thinker", "input": items,
                   "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]})
        };
        let mut n = Vec::new();
        for with in [false, true] {
            let (s, _, b) = send(&app, "POST", "/v1/responses", None, &input(with)).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            n.push(json_of(&b)["usage"]["input_tokens"].as_u64().unwrap());
        }
        assert!(n[1] > n[0] + 20, "responses: {n:?}");

        // Ollama's thinking field
        let chat = |with: bool| {
            let mut a = json!({"role": "assistant", "content": "",
                               "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]});
            if with {
                a["thinking"] = json!(reasoning);
            }
            json!({"model": "thinker", "stream": false, "tools": [weather_tool()],
                   "messages": [{"role": "user", "content": "Weather in Paris?"}, a,
                                {"role": "tool", "content": "sunny"}]})
        };
        let mut n = Vec::new();
        for with in [false, true] {
            let (s, _, b) = send(&app, "POST", "/api/chat", None, &chat(with)).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            n.push(json_of(&b)["prompt_eval_count"].as_u64().unwrap());
        }
        assert!(n[1] > n[0] + 20, "ollama: {n:?}");
    });
}

#[test]
fn a_tool_call_written_inside_the_reasoning_is_still_a_call() {
    let replay: Replay = serde_json::from_value(json!({"outputs": [{"text":
        "<think>\nI need the weather, so I call the tool.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"}]}))
    .unwrap();
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", replay);
    runtime().block_on(async {
        for stream in [false, true] {
            let r = json!({"model": "thinker", "stream": stream, "tools": [weather_tool()],
                           "messages": [{"role": "user", "content": "Weather in Oslo?"}]});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let (mut reasoning, mut calls) = (String::new(), Vec::new());
            if stream {
                for c in sse_data(&b) {
                    let d = &c["choices"][0]["delta"];
                    reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
                    calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
                }
            } else {
                let m = &json_of(&b)["choices"][0]["message"];
                reasoning = m["reasoning_content"].as_str().unwrap_or("").to_string();
                calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
            }
            assert_eq!(
                reasoning.trim(),
                "I need the weather, so I call the tool.",
                "{b}"
            );
            assert_eq!(calls.len(), 1, "{b}");
            assert_eq!(
                json_of(calls[0]["function"]["arguments"].as_str().unwrap()),
                json!({"city": "Oslo"})
            );
        }
    });
}

/// Each real thinking template: with thinking on, the generation prompt leaves the model to
/// reason (opening the block itself or not); with it off, the prompt ends with a closed,
/// empty block, whether the template has a switch or not; and the reasoning comes apart from
/// the answer through chat completions.
#[test]
fn the_real_templates_switch_thinking_and_their_output_comes_apart() {
    // (template, whether its generation prompt opens the block)
    let cases = [
        ("Qwen-Qwen3-0.6B.jinja", false),
        ("deepseek-ai-DeepSeek-V3.1.jinja", true),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", true),
        ("GLM-4.6.jinja", false),
        ("Kimi-K2-Thinking.jinja", false),
    ];
    for (name, opens) in cases {
        let src = template(name);
        assert_eq!(
            ReasoningFormat::detect(&src),
            ReasoningFormat::ThinkTags,
            "{name}"
        );
        let dir = tempfile::tempdir().unwrap();
        let mut model = tiny_model_with_context(dir.path(), 4096);
        model.set_chat_template(&src).unwrap();
        let messages = [json!({"role": "user", "content": "What is 17 times 23?"})];
        for wanted in [true, false] {
            let t = Thinking {
                enabled: Some(wanted),
                ..Thinking::default()
            };
            let args = t.template_args(ReasoningFormat::ThinkTags);
            let mut text = model
                .render_chat(&messages, None, args.as_ref())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let inside = settle_prompt(&mut text, ReasoningFormat::ThinkTags, wanted);
            let tail = text.trim_end();
            if wanted {
                assert_eq!(inside, opens, "{name}: {text:?}");
                assert!(!tail.ends_with("</think>"), "{name}: {text:?}");
            } else {
                assert!(!inside, "{name}");
                assert!(
                    tail.ends_with("</think>"),
                    "{name} with thinking off: {text:?}"
                );
            }
        }
        // the output, as the model writes it after this template's generation prompt
        let output = if opens {
            format!("\n{MATH_REASONING}\n</think>\n\n{MATH_ANSWER}")
        } else {
            format!("<think>\n{MATH_REASONING}\n</think>\n\n{MATH_ANSWER}")
        };
        let replay: Replay = serde_json::from_value(json!({"outputs": [
            {"thinking": true, "text": output}, {"thinking": false, "text": "391."}]}))
        .unwrap();
        drop(model);
        let (_d, app) = app(name, replay);
        runtime().block_on(async {
            let (s, _, b) = send(
                &app,
                "POST",
                "/v1/chat/completions",
                None,
                &json!({
                "model": "thinker", "messages": messages}),
            )
            .await;
            assert_eq!(s, StatusCode::OK, "{name}: {b}");
            let m = &json_of(&b)["choices"][0]["message"];
            assert_eq!(m["reasoning_content"], MATH_REASONING, "{name}: {b}");
            assert_eq!(m["content"], MATH_ANSWER, "{name}: {b}");
        });
    }
}

/// GLM 4.6 and Kimi K2 Thinking reason, then call a tool in their own markup: the call
/// comes out as a call after the reasoning, and the call and its result sent back render
/// through the template.
#[test]
fn glm_and_kimi_calls_after_their_reasoning_are_calls() {
    let cases = [
        (
            "GLM-4.6.jinja",
            "<think>I need the weather, so I call the tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        ),
        (
            "Kimi-K2-Thinking.jinja",
            "<think>I need the weather, so I call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>",
        ),
    ];
    for (name, output) in cases {
        let replay: Replay =
            serde_json::from_value(json!({"outputs": [{"text": output}]})).unwrap();
        let (_dir, app) = app(name, replay);
        runtime().block_on(async {
            for stream in [false, true] {
                let r = json!({"model": "thinker", "stream": stream, "tools": [weather_tool()],
                               "messages": [{"role": "user", "content": "Weather in Paris?"}]});
                let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
                assert_eq!(s, StatusCode::OK, "{name}: {b}");
                let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
                if stream {
                    for c in sse_data(&b) {
                        let d = &c["choices"][0]["delta"];
                        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
                        content.push_str(d["content"].as_str().unwrap_or(""));
                        calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
                    }
                } else {
                    let m = &json_of(&b)["choices"][0]["message"];
                    reasoning = m["reasoning_content"].as_str().unwrap_or("").to_string();
                    content = m["content"].as_str().unwrap_or("").to_string();
                    calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
                }
                assert_eq!(reasoning, "I need the weather, so I call the tool.", "{name}: {b}");
                assert_eq!(content, "", "{name}: {b}");
                assert_eq!(calls.len(), 1, "{name}: {b}");
                assert_eq!(calls[0]["function"]["name"], "get_weather");
                assert_eq!(
                    json_of(calls[0]["function"]["arguments"].as_str().unwrap()),
                    json!({"city": "Paris"}),
                    "{name}"
                );
            }
            let r = json!({"model": "thinker", "tools": [weather_tool()], "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "I need the weather.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{name}: {b}");
        });
    }
}

/// gpt-oss's harmony output through its real template: the analysis channel is the
/// reasoning and a commentary message to `functions.NAME` a call, in every API, streamed and
/// not; with thinking off the prompt ends with an empty analysis message and the effort is
/// low; the reasoning of a turn sent back is rendered as the template's `thinking`.
#[test]
fn gpt_oss_harmony_channels_map_to_each_api() {
    let name = "openai-gpt-oss-120b.jinja";
    assert_eq!(
        ReasoningFormat::detect(&template(name)),
        ReasoningFormat::Harmony
    );
    let replay: Replay = serde_json::from_value(json!({"outputs": [
        {"thinking": true, "tools": true, "text": "<|channel|>analysis<|message|>Need the weather; call the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"},
        {"thinking": true, "tools": false, "text": format!("<|channel|>analysis<|message|>{MATH_REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{MATH_ANSWER}")},
        {"thinking": false, "text": "<|channel|>final<|message|>391."}
    ]}))
    .unwrap();
    let (_dir, app) = app(name, replay);
    runtime().block_on(async {
        let q = json!([{"role": "user", "content": "What is 17 times 23?"}]);
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &json!({"model": "thinker", "messages": q})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let m = &json_of(&b)["choices"][0]["message"];
        assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some(MATH_REASONING), Some(MATH_ANSWER)), "{b}");
        let (s, _, b) = send(&app, "POST", "/api/chat", None, &json!({"model": "thinker", "stream": false, "think": "high", "messages": q})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(json_of(&b)["message"]["thinking"], MATH_REASONING, "{b}");
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &json!({"model": "thinker", "messages": q, "reasoning_effort": "none"})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let m = &json_of(&b)["choices"][0]["message"];
        assert!(m.get("reasoning_content").is_none() && m["content"] == "391.", "{b}");

        for stream in [false, true] {
            let r = json!({"model": "thinker", "stream": stream, "tools": [weather_tool()],
                           "messages": [{"role": "user", "content": "Weather in Paris?"}]});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let (mut reasoning, mut calls, mut finish) = (String::new(), Vec::new(), Value::Null);
            if stream {
                for c in sse_data(&b) {
                    let ch = &c["choices"][0];
                    reasoning.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
                    calls.extend(ch["delta"]["tool_calls"].as_array().cloned().unwrap_or_default());
                    if !ch["finish_reason"].is_null() {
                        finish = ch["finish_reason"].clone();
                    }
                }
            } else {
                let v = json_of(&b);
                reasoning = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or("").to_string();
                calls = v["choices"][0]["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
                finish = v["choices"][0]["finish_reason"].clone();
            }
            assert_eq!(reasoning, "Need the weather; call the tool.", "{b}");
            assert_eq!(calls.len(), 1, "{b}");
            assert_eq!(json_of(calls[0]["function"]["arguments"].as_str().unwrap()), json!({"city": "Paris"}));
            assert_eq!(finish, "tool_calls");

            let r = json!({"model": "thinker", "max_tokens": 500, "stream": stream,
                           "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                           "messages": [{"role": "user", "content": "Weather in Paris?"}]});
            let (s, _, b) = send(&app, "POST", "/v1/messages", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            if !stream {
                let v = json_of(&b);
                let kinds: Vec<&str> = v["content"].as_array().unwrap().iter().map(|c| c["type"].as_str().unwrap()).collect();
                assert_eq!(kinds, ["thinking", "tool_use"], "{b}");
                assert_eq!(v["content"][1]["input"], json!({"city": "Paris"}));
            } else {
                assert!(b.contains("thinking_delta") && b.contains("\"tool_use\""), "{b}");
            }
            let r = json!({"model": "thinker", "stream": stream, "input": "Weather in Paris?",
                           "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
            let (s, _, b) = send(&app, "POST", "/v1/responses", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            assert!(b.contains("\"reasoning\"") && b.contains("\"function_call\""), "{b}");
        }

        // the call and its reasoning sent back: the template renders the reasoning as the
        // analysis before the call (the prompt grows by it)
        let turn = |with: bool| {
            let mut a = json!({"role": "assistant", "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]});
            if with {
                a["reasoning_content"] = json!("I should look the weather up with the tool.");
            }
            json!([{"role": "user", "content": "Weather in Paris?"}, a,
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
        };
        let without = prompt_tokens(&app, turn(false)).await;
        let with = prompt_tokens(&app, turn(true)).await;
        assert!(with > without + 20, "{with} vs {without}");
    });
    // thinking off: the prompt ends with an empty analysis message, at low effort
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny_model_with_context(dir.path(), 4096);
    model.set_chat_template(&template(name)).unwrap();
    let off = Thinking {
        enabled: Some(false),
        ..Thinking::default()
    };
    let args = off.template_args(ReasoningFormat::Harmony);
    let mut text = model
        .render_chat(
            &[json!({"role": "user", "content": "Hi"})],
            None,
            args.as_ref(),
        )
        .unwrap();
    assert!(!settle_prompt(&mut text, ReasoningFormat::Harmony, false));
    assert!(text.contains("Reasoning: low"), "{text}");
    assert!(
        text.ends_with("<|start|>assistant<|channel|>analysis<|message|><|end|><|start|>assistant"),
        "{text}"
    );
}

/// Reasoning that goes on after a call, then an answer: the Responses API streams each as
/// its own item, numbered in order, and the completed response lists the same items in the
/// same order (nothing overwritten).
#[test]
fn responses_items_keep_their_order_when_reasoning_resumes_after_a_call() {
    let replay: Replay = serde_json::from_value(json!({"outputs": [{"text":
        "<think>\nFirst the weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\nThen I answer.\n</think>\n\nChecking Oslo."}]}))
    .unwrap();
    let (_dir, app) = app("Qwen-Qwen3-0.6B.jinja", replay);
    runtime().block_on(async {
        let r = json!({"model": "thinker", "stream": true, "input": "Weather in Oslo?",
                       "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
        let (s, _, b) = send(&app, "POST", "/v1/responses", None, &r).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let events = sse_data(&b);
        let added: Vec<(u64, String)> = events
            .iter()
            .filter(|e| e["type"] == "response.output_item.added")
            .map(|e| (e["output_index"].as_u64().unwrap(), e["item"]["type"].as_str().unwrap().to_string()))
            .collect();
        assert_eq!(
            added,
            [(0, "reasoning".into()), (1, "function_call".into()), (2, "reasoning".into()), (3, "message".into())],
            "{b}"
        );
        let done = events.iter().find(|e| e["type"] == "response.completed").expect("completed");
        let output = done["response"]["output"].as_array().unwrap();
        let kinds: Vec<&str> = output.iter().map(|o| o["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["reasoning", "function_call", "reasoning", "message"]);
        assert_eq!(output[0]["content"][0]["text"].as_str().unwrap().trim(), "First the weather.");
        assert_eq!(output[2]["content"][0]["text"].as_str().unwrap().trim(), "Then I answer.");
        assert_eq!(output[3]["content"][0]["text"], "Checking Oslo.");
    });
}

/// A reasoning budget closes the block for the model when its tokens are spent, and the
/// answer follows: the test kit's tiny model given DeepSeek V3.1's template (whose prompt
/// opens the block) does not close it by itself, so without the budget it reasons to the
/// token limit, and with one its reasoning stops at the budget (plus the closing tokens)
/// while generation goes on.
#[test]
fn a_reasoning_budget_closes_the_block_and_the_answer_follows() {
    let dir = tempfile::tempdir().unwrap();
    let closing = tiny_model_with_context(dir.path(), 4096)
        .tokenizer
        .encode("\n</think>\n\n", false, true)
        .unwrap()
        .len() as u64;
    let (_served, app) = app_with("deepseek-ai-DeepSeek-V3.1.jinja", None);
    runtime().block_on(async {
        let ask = |budget: Option<u64>| {
            let mut r = json!({"model": "thinker", "max_tokens": 60, "temperature": 0,
                               "messages": [{"role": "user", "content": "the cat sat on the mat"}]});
            if let Some(b) = budget {
                r["thinking_budget"] = json!(b);
            }
            r
        };
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &ask(None)).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let free = json_of(&b);
        let free_reasoning = free["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
        assert!(free_reasoning > 30, "without a budget the tiny model reasons on: {b}");
        for stream in [false, true] {
            let mut r = ask(Some(6));
            r["stream"] = json!(stream);
            r["stream_options"] = json!({"include_usage": true});
            let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &r).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            let (reasoning, content, usage) = if stream {
                let (mut r, mut c, mut u) = (String::new(), String::new(), Value::Null);
                for chunk in sse_data(&b) {
                    if let Some(d) = chunk["choices"].get(0).map(|c| &c["delta"]) {
                        r.push_str(d["reasoning_content"].as_str().unwrap_or(""));
                        c.push_str(d["content"].as_str().unwrap_or(""));
                    }
                    if !chunk["usage"].is_null() {
                        u = chunk["usage"].clone();
                    }
                }
                (r, c, u)
            } else {
                let v = json_of(&b);
                let m = &v["choices"][0]["message"];
                (
                    m["reasoning_content"].as_str().unwrap_or("").to_string(),
                    m["content"].as_str().unwrap_or("").to_string(),
                    v["usage"].clone(),
                )
            };
            let spent = usage["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
            assert!(spent >= 6 && spent <= 6 + closing, "{spent} reasoning tokens: {b}");
            assert!(!reasoning.is_empty(), "{b}");
            // the tiny model answers with blank lines only (dropped after the tag), so the
            // answer shows in the count: generation went on past the closed block
            assert_eq!(usage["completion_tokens"], 60, "{b}");
            let _ = &content;
            assert!(!reasoning.contains("</think>") && !content.contains("</think>"), "{b}");
        }
    });
}
