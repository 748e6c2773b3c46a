//! The first stop of a model request: its key is checked before its body is read, on
//! every node. Then, in a cluster, every node answers for every instance: a model request (OpenAI, Anthropic or
//! Ollama) naming an instance that another node leads is forwarded to that node's API and its
//! answer, streamed or not, is passed back as it arrives. The request is checked against this
//! node's keys first (a bad key is refused here, in the API's own shape), then sent on with
//! the client's headers and an `x-shoal-forwarded` header, which stops it from being forwarded
//! again. Keys are replicated cluster state ([`crate::keys::replicate`]), so the lead knows
//! the client's key too and checks it again.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
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

fn flavor(path: &str) -> Flavor {
    if path.starts_with("/api/") {
        Flavor::Ollama
    } else if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// The API address of the node leading the instance `body` names, when this node does not
/// serve it itself.
fn lead_of(state: &AppState, body: &[u8]) -> Option<String> {
    let control = state.instances.get()?;
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let name = v.get("model")?.as_str()?;
    let base = name.strip_suffix(":latest").unwrap_or(name);
    if state.served().iter().any(|m| m.id == name || m.id == base) {
        return None;
    }
    control.0.lead_api(base)
}

/// The middleware: forwards model requests for instances led elsewhere.
pub async fn forward(State(f): State<Forwarder>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let model_route = req.method() == Method::POST && MODEL_ROUTES.contains(&path.as_str());
    // the key is checked before anything reads the body: a client without one cannot make
    // the node read megabytes
    if model_route {
        if let Err(e) = f.state.keys.authenticate(req.headers()) {
            return e.flavor(flavor(&path)).into_response();
        }
    }
    if !model_route || req.headers().contains_key(FORWARDED) || f.state.instances.get().is_none() {
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
    let lead = lead_of(&f.state, &bytes);
    let req = Request::from_parts(parts, Body::from(bytes));
    let Some(api) = lead else {
        return next.run(req).await;
    };
    // a bad key is answered here, by the route itself, in its API's shape
    if f.state.keys.authorize(req.headers()).is_err() {
        return next.run(req).await;
    }
    proxy(&f.client, &api, req, &path).await
}

async fn proxy(
    client: &Client<HttpConnector, Body>,
    api: &str,
    req: Request,
    path: &str,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| path.to_string());
    let uri: Uri = match format!("http://{api}{pq}").parse() {
        Ok(u) => u,
        Err(e) => {
            return ApiError::new(
                ErrorKind::Internal,
                format!("the lead node's address {api} is not usable: {e}"),
            )
            .flavor(flavor(path))
            .into_response()
        }
    };
    parts.uri = uri;
    parts.headers.remove(header::HOST);
    parts
        .headers
        .insert(FORWARDED, HeaderValue::from_static("1"));
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => {
            tracing::debug!(lead = %api, path, status = resp.status().as_u16(), "forwarded");
            resp.map(Body::new)
        }
        Err(e) => {
            let e = ApiError::new(
                ErrorKind::Overloaded,
                format!(
                    "the node leading this model ({api}) could not be reached: {e}; retry shortly"
                ),
            )
            .flavor(flavor(path));
            let status = axum::http::StatusCode::BAD_GATEWAY;
            (status, Json(e.body())).into_response()
        }
    }
}
