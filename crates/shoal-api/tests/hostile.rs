//! Hostile request bodies thrown at every POST route: random bytes, random JSON and valid
//! requests with one field replaced. No panic, no 5xx, every error JSON in its API's shape,
//! nothing left running, and memory steady. It is a binary of its own because resident
//! memory is per process: a test loading a model beside it would read as a leak.

mod common;

use std::time::{Duration, Instant};

use common::{call, runtime, tiny_state};
use proptest::prelude::*;
use serde_json::{json, Value};
use shoal_api::HttpOptions;

/// RSS of this process in kB.
fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Random JSON values, nested a little.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
        Just(json!(u64::MAX)),
        Just(json!(-1)),
        Just(json!("tiny")),
        Just(json!("user")),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("model".to_string()),
                    Just("messages".to_string()),
                    Just("role".to_string()),
                    Just("content".to_string()),
                    Just("max_tokens".to_string()),
                    Just("stream".to_string()),
                    Just("tools".to_string()),
                    Just("tool_choice".to_string()),
                    Just("stop".to_string()),
                    Just("temperature".to_string()),
                    Just("options".to_string()),
                    Just("prompt".to_string()),
                    Just("response_format".to_string()),
                    Just("format".to_string()),
                    ".{0,8}".prop_map(|s| s),
                ],
                inner,
                0..6,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A valid request for `route` with one field replaced by `value`.
fn mutated(route: &str, field: usize, value: Value) -> Value {
    let mut base = match route {
        "/v1/chat/completions" => {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        }
        "/v1/completions" => json!({"model": "tiny", "prompt": "hi", "max_tokens": 3}),
        "/v1/messages" => {
            json!({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        }
        "/api/chat" => {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}})
        }
        "/api/generate" => json!({"model": "tiny", "prompt": "hi", "options": {"num_predict": 3}}),
        _ => json!({"model": "tiny"}),
    };
    let fields = [
        "model",
        "messages",
        "max_tokens",
        "stream",
        "tools",
        "tool_choice",
        "stop",
        "temperature",
        "response_format",
        "prompt",
        "options",
        "seed",
        "logprobs",
        "top_logprobs",
        "format",
        "system",
        "n",
        "top_p",
    ];
    let f = fields[field % fields.len()];
    // generation length stays bounded whatever the mutation
    if f == "max_tokens" {
        base[f] = json!(value.as_u64().map(|n| n % 8));
    } else {
        base[f] = value;
    }
    base
}

const POST_ROUTES: [&str; 8] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
    "/api/show",
    "/admin/keys",
    "/v1/models",
];

#[test]
fn hostile_bodies_never_panic_hang_or_leak() {
    let (_dir, state) = tiny_state(4, 64);
    let app = shoal_api::router(
        state.clone(),
        &HttpOptions {
            body_limit: 256 << 10,
            cors_origins: vec![],
        },
    );
    let rt = runtime();
    let cases = std::cell::Cell::new(0u32);
    let baseline = std::cell::Cell::new(0u64);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 600,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = (
        0usize..POST_ROUTES.len(),
        0usize..32,
        any_json(),
        prop::collection::vec(any::<u8>(), 0..200),
        0u8..4,
    );
    runner
        .run(&strategy, |(route_i, field, value, bytes, mode)| {
            let route = POST_ROUTES[route_i];
            let body: Vec<u8> = match mode {
                0 => bytes,                                                 // random bytes
                1 => value.to_string().into_bytes(),                        // random JSON
                _ => mutated(route, field, value).to_string().into_bytes(), // a valid request, one field wrong
            };
            let (status, resp) = rt.block_on(call(&app, "POST", route, &body));
            prop_assert!(
                status.is_success() || status.is_client_error(),
                "{route} answered {status} to {}: {}",
                String::from_utf8_lossy(&body),
                String::from_utf8_lossy(&resp)
            );
            if !status.is_success() {
                // every error is JSON in some API's shape
                let v: Value = serde_json::from_slice(&resp)
                    .map_err(|e| TestCaseError::fail(format!("{e}")))?;
                prop_assert!(v.get("error").is_some(), "{v}");
            }
            cases.set(cases.get() + 1);
            if cases.get() == 100 {
                baseline.set(rss_kb());
            }
            Ok(())
        })
        .unwrap();
    let (cases, baseline) = (cases.get(), baseline.get());
    let grown = rss_kb().saturating_sub(baseline);
    eprintln!("{cases} hostile requests; RSS grew {grown} kB after the first 100");
    assert!(grown < 16 * 1024, "RSS grew {grown} kB over 500 requests");
    // nothing is left running
    let served = state.served()[0].clone();
    let s = served.scheduler.stats();
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.active.load(std::sync::atomic::Ordering::Relaxed) != 0 {
        assert!(Instant::now() < deadline, "sequences left running");
        std::thread::sleep(Duration::from_millis(10));
    }
}
