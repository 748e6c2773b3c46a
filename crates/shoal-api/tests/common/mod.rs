//! Helpers shared by the HTTP test binaries: the test kit's tiny model written as a real
//! GGUF, an app state serving it, a one-shot request through the router, and a runtime.

#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::Value;
use shoal_api::keys::KeyStore;
use shoal_api::{AppState, ServedModel};
use shoal_engine::model::LoadedModel;
use shoal_engine::scheduler::SchedulerConfig;
use shoal_model::source::ModelSource;
use shoal_testkit::{GgmlType, TinyModelSpec};
use tower::ServiceExt;

pub fn tiny_model(dir: &std::path::Path) -> LoadedModel {
    tiny_model_with_context(dir, TinyModelSpec::qwen2(11).context_length)
}

/// The tiny model, written with room for `context` tokens.
pub fn tiny_model_with_context(dir: &std::path::Path, context: usize) -> LoadedModel {
    let path = dir.join("tiny.gguf");
    let mut spec = TinyModelSpec::qwen2(11);
    spec.context_length = context;
    spec.build()
        .unwrap()
        .write_gguf(&path, GgmlType::F32)
        .unwrap();
    LoadedModel::load(&ModelSource::Gguf(path)).unwrap()
}

/// Status, headers and body of one JSON request through the router, with an API key when
/// given (a null body sends none).
pub async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &Value,
) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(body.to_string())
    };
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let b = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .unwrap();
    (status, headers, String::from_utf8_lossy(&b).into_owned())
}

pub fn state_with(model: LoadedModel, id: &str, cfg: SchedulerConfig) -> Arc<AppState> {
    let served = ServedModel::start(id, model, cfg).unwrap();
    Arc::new(AppState::new(
        vec![served],
        KeyStore::open(None, None).unwrap(),
    ))
}

pub fn tiny_state(max_batch: usize, max_queue: usize) -> (tempfile::TempDir, Arc<AppState>) {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let state = state_with(
        model,
        "tiny",
        SchedulerConfig {
            max_batch,
            max_queue,
            ctx: 128,
            prefix_cache: true,
            draft_max: 0,
            adaptive_drafts: false,
        },
    );
    (dir, state)
}

pub async fn call(
    app: &axum::Router,
    method: &str,
    path: &str,
    body: &[u8],
) -> (StatusCode, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(60), app.clone().oneshot(req))
        .await
        .expect("the server answered within 60 s")
        .unwrap();
    let status = resp.status();
    let bytes = tokio::time::timeout(
        Duration::from_secs(60),
        axum::body::to_bytes(resp.into_body(), 64 << 20),
    )
    .await
    .expect("the body ended within 60 s")
    .unwrap();
    (status, bytes.to_vec())
}

pub fn json_of(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
