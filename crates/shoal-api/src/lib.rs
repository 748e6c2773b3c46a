//! shoal's HTTP APIs. Every model route of OpenAI (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/responses`, `/v1/models`), Anthropic (`/v1/messages`) and Ollama (`/api/chat`,
//! `/api/generate`, `/api/tags`, `/api/show`) is a thin adapter from its wire format to one
//! internal request ([`generation::GenRequest`]) served by a continuous-batching scheduler,
//! and back, errors included, in that API's own shape. Around them: API keys with per-key
//! rate limits, a request body limit, optional CORS, `/health` and Prometheus `/metrics`.

pub mod admin;
pub mod admin_guard;
pub mod anthropic;
pub mod cluster;
pub mod connections;
pub mod constrain;
pub mod declined;
pub mod doctor;
pub mod error;
pub mod forward;
pub mod generation;
pub mod harmony;
pub mod keys;
pub mod metrics;
pub mod ollama;
pub mod openai;
pub mod reasoning;
pub mod relay;
pub mod replay;
pub mod responses;
pub mod responses_tools;
pub mod state;
pub mod tools;
pub mod turns;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::timeout::RequestBodyTimeoutLayer;

/// How long a request's body may take to arrive; a client that sends it slower is cut off.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub use error::{ApiError, ErrorKind, Flavor};
pub use state::{
    AppState, Control, ControlError, ControlFuture, InstanceControl, InstanceView, ServedModel,
};

/// Options of the HTTP layer.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Largest request body accepted, in bytes.
    pub body_limit: usize,
    /// Origins allowed by CORS (`*` for any); empty turns CORS off.
    pub cors_origins: Vec<String>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            body_limit: 4 << 20,
            cors_origins: Vec::new(),
        }
    }
}

/// The request body, or a 413/400 saying why it could not be read.
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorKind::TooLarge,
                "the request body is larger than this server accepts (see `shoal serve --body-limit`)",
            )
        } else {
            ApiError::invalid(format!("cannot read the request body: {e}"))
        }
    })
}

/// Counts every answered request by route pattern, method and status.
async fn track(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let method = req.method().to_string();
    let resp = next.run(req).await;
    state
        .metrics
        .request(&route, &method, resp.status().as_u16());
    resp
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({
        "status": "ok",
        "uptime_s": state.started.elapsed().as_secs(),
        "models": state.served().iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
    }))
    .into_response()
}

/// `/metrics`: OpenMetrics when the scraper asks for it, else Prometheus' text format.
async fn metrics_text(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
) -> Response {
    state.refresh_gauges();
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    if wants_openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            state.metrics.render_openmetrics(),
        )
            .into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            state.metrics.render(),
        )
            .into_response()
    }
}

/// The dashboard: one page with its styles and script inline, built into the binary (no
/// request leaves the node). It reads the same `/cluster/*`, `/v1/*` and `/metrics` routes
/// the CLI uses, with the API key the person enters when the node has keys.
const DASHBOARD: &str = include_str!("../assets/dashboard.html");

/// What the dashboard may load and who may frame it: only this node, never inside another
/// site's page (it keeps an API key in the browser's storage).
const DASHBOARD_CSP: &str = "default-src 'none'; script-src 'self' 'unsafe-inline'; \
    style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
    base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

async fn root() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, DASHBOARD_CSP),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        DASHBOARD,
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    let flavor = if req.uri().path().starts_with("/api/") {
        Flavor::Ollama
    } else {
        Flavor::OpenAi
    };
    ApiError::new(
        ErrorKind::NotFound,
        format!(
            "no route {} {}; see the README for the routes shoal serves",
            req.method(),
            req.uri().path()
        ),
    )
    .flavor(flavor)
    .into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    let mut e = ApiError::invalid(format!(
        "{} does not take {} requests",
        req.uri().path(),
        req.method()
    ));
    if req.uri().path().starts_with("/api/") {
        e = e.flavor(Flavor::Ollama);
    }
    (axum::http::StatusCode::METHOD_NOT_ALLOWED, Json(e.body())).into_response()
}

fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect::<Vec<_>>(),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::DELETE, Method::OPTIONS])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::HeaderName::from_static("x-api-key"),
                header::HeaderName::from_static("anthropic-version"),
            ]),
    )
}

/// Every route, with metrics, the body limit and CORS (never on the routes that change the
/// node or the cluster, which [`admin_guard`] checks instead).
pub fn router(state: Arc<AppState>, opts: &HttpOptions) -> Router {
    let open = Router::new()
        .route("/", get(root))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .route("/cluster/nodes", get(cluster::nodes))
        .route("/cluster/links", get(cluster::links))
        .route("/cluster/status", get(cluster::status))
        .route("/cluster/planner", get(cluster::planner))
        .route("/cluster/doctor", get(doctor::doctor))
        .route("/cluster/models", get(cluster::models))
        .route("/cluster/figures", get(cluster::figures))
        .route("/cluster/plan", post(cluster::plan));
    let managing = Router::new()
        .route("/admin/keys", get(admin::list_keys).post(admin::create_key))
        .route("/admin/keys/{id}", delete(admin::revoke_key))
        .route(
            "/cluster/instances",
            get(cluster::instances).post(cluster::load),
        )
        .route("/cluster/instances/{id}", delete(cluster::unload))
        .route("/cluster/drain", post(cluster::drain))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            admin_guard::guard,
        ));
    let mut r = open
        .merge(managing)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            forward::Forwarder::new(state.clone(), opts.body_limit),
            forward::forward,
        ))
        .layer(DefaultBodyLimit::max(opts.body_limit))
        .layer(RequestBodyTimeoutLayer::new(BODY_TIMEOUT))
        .layer(middleware::from_fn_with_state(state.clone(), track));
    if let Some(c) = cors(&opts.cors_origins) {
        r = r.layer(c).layer(middleware::from_fn(admin_guard::no_cors));
    }
    r.with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets running requests end,
/// within the default [`connections::ConnectionLimits`].
///
/// # Errors
/// When accepting connections fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    connections::serve(listener, router, shutdown, Default::default()).await
}
