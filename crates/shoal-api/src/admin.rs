//! shoal's own management routes for API keys (`shoal keys` talks to these): list, create
//! (the secret is in the answer, once) and revoke. Only an administrator key may use them;
//! while no key exists, only clients on the server's own machine may.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use crate::error::{parse_body, ApiError};
use crate::state::AppState;

fn keys_error(e: crate::keys::KeyError) -> Response {
    match e {
        crate::keys::KeyError::TooMany { .. } => ApiError::invalid(e.to_string()).into_response(),
        e => ApiError::internal(e.to_string()).into_response(),
    }
}

/// `GET /admin/keys`.
pub async fn list_keys(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state
        .keys
        .authorize_admin(req.headers(), state.is_local_request(&req))
    {
        return e.into_response();
    }
    Json(json!({"keys": state.keys.list()})).into_response()
}

#[derive(Debug, Deserialize)]
struct CreateKey {
    name: String,
    #[serde(default)]
    admin: bool,
    #[serde(default)]
    rpm: Option<u32>,
}

/// `POST /admin/keys` with `{"name", "admin", "rpm"}`.
pub async fn create_key(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state
        .keys
        .authorize_admin(req.headers(), state.is_local_request(&req))
    {
        return e.into_response();
    }
    let body = match axum::body::to_bytes(req.into_body(), 64 << 10).await {
        Ok(b) => b,
        Err(e) => return ApiError::invalid(format!("cannot read the body: {e}")).into_response(),
    };
    let c: CreateKey = match parse_body(&body) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if c.name.trim().is_empty() || c.name.len() > 128 {
        return ApiError::invalid_param("name", "a key needs a name of 1 to 128 characters")
            .into_response();
    }
    match state.keys.create(c.name.trim(), c.admin, c.rpm) {
        Ok((record, secret)) => (
            StatusCode::CREATED,
            Json(json!({"key": record, "secret": secret})),
        )
            .into_response(),
        Err(e) => keys_error(e),
    }
}

/// `DELETE /admin/keys/{id}`.
pub async fn revoke_key(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    if let Err(e) = state
        .keys
        .authorize_admin(req.headers(), state.is_local_request(&req))
    {
        return e.into_response();
    }
    match state.keys.revoke(&id) {
        Ok(true) => Json(json!({"revoked": id})).into_response(),
        Ok(false) => ApiError::new(
            crate::error::ErrorKind::NotFound,
            format!("no key {id}; `shoal keys list` shows the keys"),
        )
        .into_response(),
        Err(e) => keys_error(e),
    }
}
