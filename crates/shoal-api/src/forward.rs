//! The first stop of a model request: its key is checked before its body is read, on
//! every node. Then, in a cluster, every node answers for every instance: a model request (OpenAI, Anthropic or
//! Ollama) naming an instance that another node leads is forwarded to that node's API and its
//! answer, streamed or not, is passed back as it arrives. The request is checked against this
//! node's keys first (a bad key is refused here, in the API's own shape), then sent on with
//! the client's headers and an `x-shoal-forwarded` header, which stops it from being forwarded
//! again. Keys are replicated cluster state ([`crate::keys::replicate`]), so the lead knows
//! the client's key too and checks it again.
//!
//! An answer the lead stops sending (its node died, the connection was cut) never ends
//! silently: a streamed one that breaks off before its API's last event ends with an error
//! event in that API's shape ([`StreamEnd`]), and a whole answer is read in full before it
//! is passed on, so one cut short becomes a 502 error in the API's shape.

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

/// Where a model request goes.
enum Route {
    /// This node answers it (it serves the model, or no instance by that name exists).
    Here,
    /// The node at this API address leads the instance.
    Lead(String),
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
        return Route::Lead(api);
    }
    match control.0.instance(base) {
        Some(view) => Route::NotReady(base.to_string(), view),
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
    let route = route_of(&f.state, &bytes);
    let req = Request::from_parts(parts, Body::from(bytes));
    let api = match route {
        Route::Here => return next.run(req).await,
        Route::Lead(api) => api,
        Route::NotReady(name, view) => return not_ready(&name, &view, &path),
    };
    // a bad key is answered here, by the route itself, in its API's shape; a good one is
    // counted against its limit by the lead, which runs the request (and checks it again)
    if f.state.keys.authenticate(req.headers()).is_err() {
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
            pass_back(resp.map(Body::new), api, path).await
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

/// Most bytes of a whole (not streamed) answer read before it is passed on.
const WHOLE_ANSWER_LIMIT: usize = 256 << 20;

/// The lead's answer, passed on so that a cut never looks like an end (see the module).
async fn pass_back(resp: Response, api: &str, path: &str) -> Response {
    let cut = |e: &dyn std::fmt::Display| {
        format!(
            "the node leading this model ({api}) stopped answering before the answer was \
             complete ({e}); what arrived is incomplete, retry the request"
        )
    };
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let end = StreamEnd::of(path, &content_type);
    let (parts, body) = resp.into_parts();
    let Some(end) = end else {
        return match axum::body::to_bytes(body, WHOLE_ANSWER_LIMIT).await {
            Ok(bytes) => Response::from_parts(parts, Body::from(bytes)),
            Err(e) => {
                tracing::warn!(lead = %api, path, "a forwarded answer was cut: {e}");
                let e = ApiError::new(ErrorKind::Overloaded, cut(&e)).flavor(flavor(path));
                (axum::http::StatusCode::BAD_GATEWAY, Json(e.body())).into_response()
            }
        };
    };
    let api = api.to_string();
    let path = path.to_string();
    let guarded = futures_util::stream::unfold(
        (body.into_data_stream(), Watch::new(end), false),
        move |(mut upstream, mut watch, done)| {
            let (api, path) = (api.clone(), path.clone());
            async move {
                use futures_util::StreamExt;
                if done {
                    return None;
                }
                let failure = match upstream.next().await {
                    Some(Ok(bytes)) => {
                        watch.saw(&bytes);
                        return Some((Ok::<_, std::io::Error>(bytes), (upstream, watch, false)));
                    }
                    Some(Err(e)) => e.to_string(),
                    None if watch.ended => return None,
                    None => "the connection closed".to_string(),
                };
                tracing::warn!(lead = %api, path, "a forwarded stream was cut: {failure}");
                let message = format!(
                    "the node leading this model ({api}) stopped answering before the answer \
                     was complete ({failure}); what arrived is incomplete, retry the request"
                );
                let tail = watch.end.error_event(&message);
                Some((Ok(axum::body::Bytes::from(tail)), (upstream, watch, true)))
            }
        },
    );
    Response::from_parts(parts, Body::from_stream(guarded))
}

/// How a streamed answer of one API ends, and the event that ends one that was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnd {
    /// OpenAI chat and completions: `data: [DONE]`.
    OpenAi,
    /// OpenAI Responses: `response.completed`, `.failed` or `.incomplete`.
    Responses,
    /// Anthropic messages: `message_stop`, or an `error` event.
    Anthropic,
    /// Ollama's lines: one with `"done":true`, or an `error`.
    Ollama,
}

impl StreamEnd {
    /// The kind of a streamed answer to `path` of `content_type`; `None` for a whole one.
    fn of(path: &str, content_type: &str) -> Option<Self> {
        if content_type.starts_with("text/event-stream") {
            Some(if path.starts_with("/v1/messages") {
                StreamEnd::Anthropic
            } else if path.starts_with("/v1/responses") {
                StreamEnd::Responses
            } else {
                StreamEnd::OpenAi
            })
        } else if content_type.starts_with("application/x-ndjson") {
            Some(StreamEnd::Ollama)
        } else {
            None
        }
    }

    /// Texts whose arrival means the stream ended as its API ends one.
    fn markers(self) -> &'static [&'static str] {
        match self {
            StreamEnd::OpenAi => &["data: [DONE]"],
            StreamEnd::Responses => &[
                "event: response.completed",
                "event: response.failed",
                "event: response.incomplete",
                "event: error",
            ],
            StreamEnd::Anthropic => &["event: message_stop", "event: error"],
            StreamEnd::Ollama => &["\"done\":true", "\"error\":"],
        }
    }

    /// The event that ends a cut stream with `message`, in the API's own shape.
    fn error_event(self, message: &str) -> String {
        match self {
            StreamEnd::OpenAi => {
                let body = ApiError::new(ErrorKind::Overloaded, message).body();
                format!("\n\ndata: {body}\n\ndata: [DONE]\n\n")
            }
            StreamEnd::Responses => {
                let body = serde_json::json!({
                    "type": "error",
                    "code": "upstream_cut",
                    "message": message,
                    "param": null,
                    "error": {"type": "server_error", "code": "upstream_cut", "message": message},
                });
                format!("\n\nevent: error\ndata: {body}\n\n")
            }
            StreamEnd::Anthropic => {
                let body = ApiError::new(ErrorKind::Overloaded, message)
                    .flavor(Flavor::Anthropic)
                    .body();
                format!("\n\nevent: error\ndata: {body}\n\n")
            }
            StreamEnd::Ollama => {
                format!("\n{}\n", serde_json::json!({ "error": message }))
            }
        }
    }
}

/// Watches a passing stream for its API's end.
struct Watch {
    end: StreamEnd,
    /// The last bytes seen, so a marker split across two pieces is still found.
    tail: Vec<u8>,
    ended: bool,
}

impl Watch {
    fn new(end: StreamEnd) -> Self {
        Watch {
            end,
            tail: Vec::new(),
            ended: false,
        }
    }

    fn saw(&mut self, bytes: &[u8]) {
        const KEEP: usize = 64;
        self.tail.extend_from_slice(bytes);
        let text = String::from_utf8_lossy(&self.tail);
        // an end marker, then more events: the stream did not end there (only the last
        // kept bytes matter for the marker's position)
        self.ended = self.end.markers().iter().any(|m| text.contains(m));
        if self.tail.len() > KEEP {
            let cut = self.tail.len() - KEEP;
            self.tail.drain(..cut);
        }
        if self.ended {
            // keep knowing it ended even once the marker scrolls out
            self.tail.clear();
            self.tail
                .extend_from_slice(self.end.markers()[0].as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_api_has_its_end_and_its_error_event() {
        assert_eq!(
            StreamEnd::of("/v1/chat/completions", "text/event-stream"),
            Some(StreamEnd::OpenAi)
        );
        assert_eq!(
            StreamEnd::of("/v1/responses", "text/event-stream; charset=utf-8"),
            Some(StreamEnd::Responses)
        );
        assert_eq!(
            StreamEnd::of("/v1/messages", "text/event-stream"),
            Some(StreamEnd::Anthropic)
        );
        assert_eq!(
            StreamEnd::of("/api/chat", "application/x-ndjson"),
            Some(StreamEnd::Ollama)
        );
        assert_eq!(
            StreamEnd::of("/v1/chat/completions", "application/json"),
            None
        );
        let e = StreamEnd::OpenAi.error_event("cut");
        assert!(
            e.contains("data: {\"error\"") && e.trim_end().ends_with("data: [DONE]"),
            "{e}"
        );
        assert!(StreamEnd::Anthropic
            .error_event("cut")
            .contains("event: error\ndata: {\"type\":\"error\""));
        assert!(StreamEnd::Ollama
            .error_event("cut")
            .contains("{\"error\":\"cut\"}"));
        assert!(StreamEnd::Responses
            .error_event("cut")
            .contains("event: error"));
    }

    #[test]
    fn a_marker_split_across_pieces_is_seen_and_text_after_it_does_not_hide_it() {
        let mut w = Watch::new(StreamEnd::OpenAi);
        w.saw(b"data: {\"x\": 1}\n\ndata: [DO");
        assert!(!w.ended);
        w.saw(b"NE]\n\n");
        assert!(w.ended);
        let mut w = Watch::new(StreamEnd::Anthropic);
        w.saw(b"event: content_block_delta\ndata: {}\n\n");
        assert!(!w.ended);
        w.saw(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        assert!(w.ended);
        w.saw(&[b'x'; 200]);
        assert!(w.ended, "still ended after more bytes");
    }
}
