//! The first stop of a model request: its key is checked before its body is read, on
//! every node. Then, in a cluster, every node answers for every instance: a model request (OpenAI, Anthropic or
//! Ollama) naming an instance that another node leads is forwarded to that node's API and its
//! answer, streamed or not, is passed back as it arrives. The request is checked against this
//! node's keys first (a bad key is refused here, in the API's own shape), then sent on with
//! the client's headers and an `x-shoal-forwarded` header, which stops it from being forwarded
//! again. Keys are replicated cluster state ([`crate::keys::replicate`]), so the lead knows
//! the client's key too and checks it again.
//!
//! The answer is relayed by [`crate::relay`]: when the lead stops sending it (its node
//! died, the connection was cut), the request goes on at the instance's next lead, and when
//! it cannot, it ends with an error in its API's shape, never silently. A request that
//! arrives with the `x-shoal-forwarded` header is answered here, in the relay's context
//! ([`crate::relay::Relayed`]).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::state::AppState;

/// The header a forwarded request carries (its value: how many hops, always 1).
pub const FORWARDED: &str = "x-shoal-forwarded";

/// The routes whose JSON body names a model.
const MODEL_ROUTES: [&str; 8] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/chat",
    "/api/generate",
    "/api/show",
];

/// What the forwarding middleware holds.
#[derive(Clone)]
pub struct Forwarder {
    state: Arc<AppState>,
    body_limit: usize,
    client: Client<HttpConnector, Body>,
}

impl Forwarder {
    /// A forwarder for `state`'s instances, reading request bodies up to `body_limit`.
    pub fn new(state: Arc<AppState>, body_limit: usize) -> Self {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        http.set_nodelay(true);
        Forwarder {
            state,
            body_limit,
            client: Client::builder(TokioExecutor::new()).build(http),
        }
    }
}

pub(crate) fn flavor(path: &str) -> Flavor {
    if path.starts_with("/api/") {
        Flavor::Ollama
    } else if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// Where a model request goes.
enum Route {
    /// This node answers it (it serves the model, or no instance by that name exists).
    Here,
    /// The node at this API address (`api`) leads the instance `model`.
    Lead { api: String, model: String },
    /// The instance exists in the cluster but no node can answer for it now.
    NotReady(String, crate::state::InstanceView),
}

/// Where the request with `body` goes, when this node does not serve the model itself.
fn route_of(state: &AppState, body: &[u8]) -> Route {
    let Some(control) = state.instances.get() else {
        return Route::Here;
    };
    let Some(name) = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| Some(v.get("model")?.as_str()?.to_string()))
    else {
        return Route::Here;
    };
    let base = name.strip_suffix(":latest").unwrap_or(&name);
    if state.served().iter().any(|m| m.id == name || m.id == base) {
        return Route::Here;
    }
    if let Some(api) = control.0.lead_api(base) {
        return Route::Lead {
            api,
            model: base.to_string(),
        };
    }
    match control.0.instance(base) {
        Some(view) => Route::NotReady(base.to_string(), view),
        None if !control.0.table_merged() => Route::NotReady(
            base.to_string(),
            crate::state::InstanceView {
                state: "unknown here".into(),
                generation: 0,
                lead_here: false,
                lead_api: None,
                placed_lead_api: None,
                reason: None,
            },
        ),
        None => Route::Here,
    }
}

/// The answer for a model whose instance no node can answer for now: 503 with a retry
/// time while it is being placed or loaded (or its lead is not yet known here).
fn not_ready(name: &str, view: &crate::state::InstanceView, path: &str) -> Response {
    let message = match (&view.state[..], &view.reason) {
        ("failed", Some(reason)) => format!(
            "the instance `{name}` failed to load on the cluster ({reason}); `shoal ps` shows \
             it, `shoal load` places it again"
        ),
        ("ready", _) => format!(
            "the instance `{name}` is ready but its lead node is not yet known to this node; \
             retry shortly"
        ),
        ("unknown here", _) => format!(
            "this node joined the cluster moments ago and does not know the instances yet \
             (`{name}` may be one); retry shortly"
        ),
        (state, _) => format!("the instance `{name}` is {state} on the cluster; retry shortly"),
    };
    let mut resp = ApiError::new(ErrorKind::Overloaded, message)
        .flavor(flavor(path))
        .into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
    resp
}

/// The middleware: forwards model requests for instances led elsewhere.
pub async fn forward(State(f): State<Forwarder>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let model_route = req.method() == Method::POST && MODEL_ROUTES.contains(&path.as_str());
    // the key is checked before anything reads the body: a client without one cannot make
    // the node read megabytes
    if model_route {
        if !f.state.keys.merged() {
            let e = crate::keys::KeyStore::not_merged_error().flavor(flavor(&path));
            let mut resp = e.into_response();
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
            return resp;
        }
        if let Err(e) = f.state.keys.authenticate(req.headers()) {
            return e.flavor(flavor(&path)).into_response();
        }
    }
    if model_route && req.headers().contains_key(FORWARDED) {
        // relayed by an entry node: its answer carries token marks, and it may go on after
        // tokens another lead sent
        return match crate::relay::Relayed::of(req.headers()) {
            Ok(relayed) => relayed.serve(next.run(req)).await,
            Err(e) => ApiError::invalid(e).flavor(flavor(&path)).into_response(),
        };
    }
    if !model_route || f.state.instances.get().is_none() {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, f.body_limit).await {
        Ok(b) => b,
        Err(_) => {
            let e = ApiError::new(
                ErrorKind::TooLarge,
                format!(
                    "the request body is larger than this server accepts ({} bytes)",
                    f.body_limit
                ),
            )
            .flavor(flavor(&path));
            return e.into_response();
        }
    };
    let route = route_of(&f.state, &bytes);
    let (api, model) = match route {
        Route::Here => {
            return next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Route::Lead { api, model } => (api, model),
        Route::NotReady(name, view) => return not_ready(&name, &view, &path),
    };
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| path.clone());
    crate::relay::Relay {
        state: f.state.clone(),
        client: f.client.clone(),
        model,
        method: parts.method,
        path_and_query,
        path,
        headers: parts.headers,
        body: bytes,
    }
    .answer(api)
    .await
}
