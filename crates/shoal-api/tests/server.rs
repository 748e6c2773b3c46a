//! The HTTP layer end to end on the test kit's tiny model (written as a real GGUF with a
//! ChatML template) and, where cached, on SmolLM2: every route answers in its API's shape,
//! errors included; the queue refuses with 503 when full; a client that disconnects frees
//! its slot at once. (Hostile bodies have their own binary, `hostile.rs`, so that its memory
//! check measures nothing but itself.)

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{call, json_of, runtime, state_with, tiny_model, tiny_state};
use serde_json::{json, Value};
use shoal_api::HttpOptions;
use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::SchedulerConfig;
use shoal_model::source::ModelSource;
use tower::ServiceExt;

#[test]
fn every_api_answers_in_its_own_shape() {
    let (_dir, state) = tiny_state(4, 8);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 5, "temperature": 0});
        let (s, b) = call(&app, "POST", "/v1/chat/completions", chat.to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::OK);
        let v = json_of(&b);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() + v["usage"]["prompt_tokens"].as_u64().unwrap(),
                   v["usage"]["total_tokens"].as_u64().unwrap());

        let (s, b) = call(&app, "POST", "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true})
                .to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::OK);
        let text = String::from_utf8(b).unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(text.contains("chat.completion.chunk"));

        // sampled with a random seed, so the tiny model may stop at EOS before 3 tokens, the
        // first one included (seen once in CI-like runs: 0 completion tokens, "stop")
        let (s, b) = call(&app, "POST", "/v1/completions",
            json!({"model": "tiny", "prompt": "abc", "max_tokens": 3}).to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        let v = json_of(&b);
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        match v["choices"][0]["finish_reason"].as_str() {
            Some("length") => assert_eq!(n, 3, "{v}"),
            Some("stop") => assert!(n <= 3, "{v}"),
            other => panic!("finish reason {other:?}: {v}"),
        }

        let (s, b) = call(&app, "POST", "/v1/messages",
            json!({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
                .to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(json_of(&b)["type"], "message");

        let (s, b) = call(&app, "POST", "/api/chat",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}})
                .to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::OK);
        let lines: Vec<Value> = String::from_utf8(b).unwrap().lines().map(|l| json_of(l.as_bytes())).collect();
        assert_eq!(lines.last().unwrap()["done"], true, "{lines:?}");
        assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false));

        let (s, b) = call(&app, "GET", "/api/tags", b"").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(json_of(&b)["models"][0]["name"], "tiny:latest");
        let (s, _) = call(&app, "GET", "/v1/models", b"").await;
        assert_eq!(s, StatusCode::OK);
        let (s, b) = call(&app, "GET", "/health", b"").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(json_of(&b)["status"], "ok");

        // errors: bad JSON, unknown model, over-long prompt, n > 1, unknown route
        let (s, b) = call(&app, "POST", "/v1/chat/completions", b"{nope").await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_eq!(json_of(&b)["error"]["type"], "invalid_request_error");
        let (s, b) = call(&app, "POST", "/v1/messages", b"{nope").await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_eq!(json_of(&b)["type"], "error");
        let (s, b) = call(&app, "POST", "/api/chat", b"{nope").await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(json_of(&b)["error"].is_string());
        for (path, body) in [
            ("/v1/chat/completions", json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]})),
            ("/v1/messages", json!({"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})),
            ("/api/chat", json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]})),
        ] {
            let (s, b) = call(&app, "POST", path, body.to_string().as_bytes()).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{path}");
            assert!(String::from_utf8_lossy(&b).contains("'x'"), "{path}");
        }
        let long = "word ".repeat(400);
        let (s, b) = call(&app, "POST", "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": long}]}).to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let msg = json_of(&b)["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("context of 128 tokens"), "{msg}");
        // the shapes agents act on: OpenAI's code, Anthropic's "prompt is too long: N tokens
        // > M maximum" (Claude Code compacts the conversation on it)
        assert_eq!(json_of(&b)["error"]["code"], "context_length_exceeded", "{msg}");
        let long = "word ".repeat(300); // within the bytes 128 tokens can hold, not the tokens
        let (s, b) = call(&app, "POST", "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": long}]}).to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let msg = json_of(&b)["error"]["message"].as_str().unwrap().to_string();
        assert_eq!(json_of(&b)["error"]["code"], "context_length_exceeded", "{msg}");
        assert!(msg.starts_with("prompt is too long: ") && msg.contains(" tokens > 127 maximum"), "{msg}");
        let (s, b) = call(&app, "POST", "/v1/messages",
            json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": long}]}).to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let v = json_of(&b);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().starts_with("prompt is too long: "), "{v}");
        let (s, _) = call(&app, "POST", "/v1/chat/completions",
            json!({"model": "tiny", "n": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string().as_bytes()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let (s, b) = call(&app, "GET", "/v2/nothing", b"").await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(json_of(&b)["error"]["message"].as_str().unwrap().contains("/v2/nothing"));

        // the metrics saw all of it
        let (s, b) = call(&app, "GET", "/metrics", b"").await;
        assert_eq!(s, StatusCode::OK);
        let m = String::from_utf8(b).unwrap();
        assert!(m.contains("shoal_http_requests_total{route=\"/v1/chat/completions\",method=\"POST\",status=\"400\"}"), "{m}");
        assert!(m.contains("shoal_generated_tokens_total{model=\"tiny\"}"), "{m}");
    });
}

#[test]
fn body_limit_answers_413() {
    let (_dir, state) = tiny_state(1, 1);
    let app = shoal_api::router(
        state,
        &HttpOptions {
            body_limit: 1024,
            cors_origins: Vec::new(),
        },
    );
    runtime().block_on(async {
        let big =
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x".repeat(4096)}]});
        let (s, b) = call(
            &app,
            "POST",
            "/v1/chat/completions",
            big.to_string().as_bytes(),
        )
        .await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(json_of(&b)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("larger"));
    });
}

#[test]
fn cors_is_off_by_default_and_answers_preflights_when_set() {
    let (_dir, state) = tiny_state(1, 1);
    let preflight = || {
        Request::builder()
            .method("OPTIONS")
            .uri("/v1/chat/completions")
            .header("origin", "http://app.example")
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .body(Body::empty())
            .unwrap()
    };
    runtime().block_on(async {
        let closed = shoal_api::router(state.clone(), &HttpOptions::default());
        let r = closed.oneshot(preflight()).await.unwrap();
        assert!(r.headers().get("access-control-allow-origin").is_none());
        let open = shoal_api::router(
            state,
            &HttpOptions {
                cors_origins: vec!["http://app.example".into()],
                ..HttpOptions::default()
            },
        );
        let r = open.oneshot(preflight()).await.unwrap();
        assert_eq!(
            r.headers()["access-control-allow-origin"],
            "http://app.example"
        );
        let allowed = r.headers()["access-control-allow-headers"]
            .to_str()
            .unwrap()
            .to_lowercase();
        assert!(allowed.contains("authorization"), "{allowed}");
    });
}

#[test]
fn full_queue_answers_503_in_each_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let state = state_with(
        model,
        "tiny",
        SchedulerConfig {
            max_batch: 1,
            max_queue: 0,
            ctx: 256,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    );
    let app = shoal_api::router(state.clone(), &HttpOptions::default());
    runtime().block_on(async {
        // Occupy the only slot with a long generation, then every other request is refused.
        // The tiny model can write all 200 tokens (or stop at EOS) before the requests below
        // arrive, since an unread stream does not hold the generation back, so that is
        // tried again, a bounded number of times, until a refusal is seen.
        let long = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 200, "stream": true});
        let mut saw = 0;
        for _attempt in 0..20 {
            let req = Request::builder().method("POST").uri("/v1/chat/completions")
                .body(Body::from(long.to_string())).unwrap();
            let resp = app.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            let mut body = resp.into_body().into_data_stream();
            use futures_util::StreamExt;
            let _ = body.next().await; // the slot is taken once the first chunk exists
            for (path, body) in [
                ("/v1/chat/completions", json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})),
                ("/v1/messages", json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})),
                ("/api/generate", json!({"model": "tiny", "prompt": "hi", "stream": false})),
            ] {
                let (s, b) = call(&app, "POST", path, body.to_string().as_bytes()).await;
                if s == StatusCode::OK {
                    continue; // the long request had finished; nothing to check
                }
                saw += 1;
                assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{path}: {}", String::from_utf8_lossy(&b));
                assert!(String::from_utf8_lossy(&b).contains("capacity"), "{path}");
            }
            drop(body);
            if saw > 0 {
                break;
            }
            // let the long request's slot go before the next attempt
            let deadline = Instant::now() + Duration::from_secs(10);
            while state.served()[0].scheduler.stats().active.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                assert!(Instant::now() < deadline, "a dropped stream kept its slot");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert!(saw > 0, "the slot was never full in 20 attempts");
    });
}

/// A client that goes away mid-stream frees its slot at once (SmolLM2, so generation is long
/// enough to notice; skips when it is not cached).
#[test]
fn disconnecting_client_frees_its_slot() {
    let Some(path) = shoal_model::catalog::Catalog::open_default()
        .ok()
        .and_then(|c| c.cached_path("smollm2").ok().flatten())
    else {
        assert!(
            std::env::var("SHOAL_REQUIRE_MODELS").as_deref() != Ok("1"),
            "smollm2 is not cached"
        );
        eprintln!("skipping: smollm2 is not cached");
        return;
    };
    let model = LoadedModel::load(&ModelSource::Gguf(path)).unwrap();
    let state = state_with(
        model,
        "smollm2",
        SchedulerConfig {
            max_batch: 1,
            max_queue: 4,
            ctx: 4096,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    );
    let app = shoal_api::router(state.clone(), &HttpOptions::default());
    runtime().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(shoal_api::serve(listener, app, async { let _ = stop_rx.await; }));
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": "Write a very long story."}],
                          "max_tokens": 3000, "stream": true, "temperature": 0.8}).to_string();
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut seen = String::new();
        while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 4 {
            let n = tokio::time::timeout(Duration::from_secs(30), sock.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "the stream ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        let served = state.served()[0].clone();
        let stats = served.scheduler.stats();
        let before = stats.decoded_tokens.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(stats.active.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop(sock);
        let t0 = Instant::now();
        while stats.active.load(std::sync::atomic::Ordering::Relaxed) != 0 {
            assert!(t0.elapsed() < Duration::from_secs(2), "the slot was not freed within 2 s");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let freed = t0.elapsed();
        let decoded = stats.decoded_tokens.load(std::sync::atomic::Ordering::Relaxed) - before;
        eprintln!("slot freed {freed:?} after the disconnect; {decoded} more tokens decoded");
        assert!(decoded < 100, "generation went on for {decoded} tokens after the disconnect");
        let _ = stop_tx.send(());
        let _ = server.await;
    });
}

/// The cluster routes of a node outside any cluster say how to join one; once keys exist
/// they need one, like the model routes.
#[test]
fn cluster_routes_outside_a_cluster_say_how_to_join_and_need_a_key() {
    let (_dir, state) = tiny_state(1, 1);
    let app = shoal_api::router(state.clone(), &HttpOptions::default());
    runtime().block_on(async {
        for route in [
            "/cluster/nodes",
            "/cluster/links",
            "/cluster/status",
            "/cluster/planner",
        ] {
            let (s, b) = call(&app, "GET", route, b"").await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{route}");
            let msg = json_of(&b)["error"]["message"]
                .as_str()
                .unwrap()
                .to_string();
            assert!(msg.contains("--secret-file"), "{route}: {msg}");
        }
        state.keys.create("ops", true, None).unwrap();
        let (s, _) = call(&app, "GET", "/cluster/nodes", b"").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    });
}

/// A repeated prompt start is reported as cached where each API has a field for it (OpenAI's
/// `prompt_tokens_details.cached_tokens`, Anthropic's `cache_read_input_tokens`, with
/// `input_tokens` the rest) and counted in the metrics; with the prefix cache off, nothing is.
#[test]
fn usage_reports_the_prompt_tokens_taken_from_the_cache() {
    for on in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let state = state_with(
            tiny_model(dir.path()),
            "tiny",
            SchedulerConfig {
                max_batch: 2,
                max_queue: 4,
                ctx: 128,
                prefix_cache: on,
                draft_max: 0,
                adaptive_drafts: false,
            },
        );
        let app = shoal_api::router(state.clone(), &HttpOptions::default());
        runtime().block_on(async {
            let system = "you are a careful assistant who answers briefly";
            let chat = |q: &str| {
                json!({"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": q}]})
            };
            let (s, b) = call(
                &app,
                "POST",
                "/v1/chat/completions",
                chat("hi").to_string().as_bytes(),
            )
            .await;
            assert_eq!(s, StatusCode::OK);
            assert_eq!(
                json_of(&b)["usage"]["prompt_tokens_details"]["cached_tokens"],
                0
            );
            let (s, b) = call(
                &app,
                "POST",
                "/v1/chat/completions",
                chat("yo").to_string().as_bytes(),
            )
            .await;
            assert_eq!(s, StatusCode::OK);
            let u = &json_of(&b)["usage"];
            let cached = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            let prompt = u["prompt_tokens"].as_u64().unwrap();
            if on {
                assert!(cached > 5 && cached < prompt, "{u}");
            } else {
                assert_eq!(cached, 0, "{u}");
            }
            let msg = json!({"model": "tiny", "max_tokens": 3, "system": system,
                             "messages": [{"role": "user", "content": "hey"}]});
            let (s, b) = call(&app, "POST", "/v1/messages", msg.to_string().as_bytes()).await;
            assert_eq!(s, StatusCode::OK);
            let u = &json_of(&b)["usage"];
            let read = u["cache_read_input_tokens"].as_u64().unwrap();
            assert_eq!(read > 0, on, "{u}");
            assert!(u["input_tokens"].as_u64().unwrap() > 0, "{u}");
            let (_, m) = call(&app, "GET", "/metrics", b"").await;
            let m = String::from_utf8(m).unwrap();
            let hits = m
                .lines()
                .find(|l| l.starts_with("shoal_prefix_cache_hits{"))
                .unwrap_or_else(|| panic!("{m}"));
            assert_eq!(hits.ends_with(" 0"), !on, "{hits}");
            assert!(m.contains("shoal_prefix_cache_bytes{"), "{m}");
        });
    }
}

/// `POST /v1/responses`: the response object's shape, its streamed events in order, a
/// stored response's conversation continued by `previous_response_id` (and forgotten with
/// `store: false`), and bad input refused naming the field.
#[test]
fn responses_api_answers_streams_and_continues_stored_conversations() {
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let post = |body: Value| {
            let app = app.clone();
            async move {
                let (s, b) = call(&app, "POST", "/v1/responses", body.to_string().as_bytes()).await;
                (s, String::from_utf8(b).unwrap())
            }
        };
        let (s, b) = post(json!({"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let first: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(first["object"], "response");
        assert!(first["id"].as_str().unwrap().starts_with("resp_"), "{first}");
        let out = &first["output"][0];
        assert_eq!(out["type"], "message", "{first}");
        assert_eq!(out["content"][0]["type"], "output_text", "{first}");
        let text = out["content"][0]["text"].as_str().unwrap().to_string();
        let u = &first["usage"];
        assert_eq!(u["total_tokens"], u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap());

        // streamed: created, in_progress, the item and its text, completed; numbered
        let (s, b) = post(json!({"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0, "stream": true})).await;
        assert_eq!(s, StatusCode::OK);
        let events: Vec<Value> = b
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{kinds:?}");
        assert!(matches!(kinds.last(), Some(&"response.completed" | &"response.incomplete")), "{kinds:?}");
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64, "{e}");
        }
        let streamed: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(streamed, text);

        // continued: the stored conversation runs before the new input
        let (s, b) = post(json!({"model": "tiny", "input": "and?", "previous_response_id": first["id"],
                                 "max_output_tokens": 2, "temperature": 0})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let second: Value = serde_json::from_str(&b).unwrap();
        let (i1, o1) = (u["input_tokens"].as_u64().unwrap(), u["output_tokens"].as_u64().unwrap());
        assert!(second["usage"]["input_tokens"].as_u64().unwrap() > i1 + o1, "{second}");
        assert_eq!(second["previous_response_id"], first["id"]);

        // store: false keeps nothing
        let (_, b) = post(json!({"model": "tiny", "input": "hi", "max_output_tokens": 1, "store": false})).await;
        let unstored: Value = serde_json::from_str(&b).unwrap();
        let (s, b) = post(json!({"model": "tiny", "input": "x", "previous_response_id": unstored["id"]})).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
        assert!(b.contains("previous_response_id"), "{b}");

        let (s, b) = post(json!({"model": "tiny", "input": [{"role": "user", "content": 3}]})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(b.contains("input[0].content"), "{b}");
        let (s, b) = post(json!({"model": "tiny", "input": "hi", "tools": [{"name": "f"}]})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(b.contains("tools[0].type"), "{b}");
    });
}

#[test]
fn removing_a_served_model_leaves_a_newer_one_under_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = SchedulerConfig {
        max_batch: 1,
        max_queue: 1,
        ctx: 64,
        prefix_cache: false,
        draft_max: 0,
        adaptive_drafts: false,
    };
    let state = state_with(tiny_model(dir.path()), "other", cfg);
    let old = std::sync::Arc::new(
        shoal_api::ServedModel::start("tiny", tiny_model(dir.path()), cfg).unwrap(),
    );
    let new = std::sync::Arc::new(
        shoal_api::ServedModel::start("tiny", tiny_model(dir.path()), cfg).unwrap(),
    );
    let ids = |s: &shoal_api::AppState| s.served().iter().map(|m| m.id.clone()).collect::<Vec<_>>();
    state.add_model(old.clone());
    // the newer one replaces the older under the same id
    state.add_model(new.clone());
    assert_eq!(ids(&state), ["other", "tiny"]);
    // the older one going away leaves the newer one served
    assert!(!state.remove_served(&old));
    assert!(std::sync::Arc::ptr_eq(&state.model("tiny").unwrap(), &new));
    assert!(state.remove_served(&new));
    assert_eq!(ids(&state), ["other"]);
    assert!(!state.remove_served(&new));
}
