//! The cluster's read-only views over HTTP (`shoal nodes`, `shoal links`, `shoal status`
//! talk to these): every node this one knows of with its facts, every measured link, and a
//! summary. They need an API key once keys exist, like the model routes. A server started
//! without a cluster secret is a single node outside any cluster; these routes then say so.
//!
//! The instance routes (`shoal load`, `unload`, `ps`, `drain`) change what the cluster runs:
//! `GET /cluster/instances` lists the instance table, `POST /cluster/instances` loads one,
//! `DELETE /cluster/instances/{id}` unloads it and `POST /cluster/drain` moves instances off
//! a node. Changing routes need an administrator key (or, while no key exists, a client on
//! this machine), like the key routes.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{ApiError, ErrorKind};
use crate::state::AppState;

fn node(state: &AppState, req: &Request) -> Result<Arc<shoal_cluster::node::Node>, ApiError> {
    state.keys.authorize_view(req.headers())?;
    state.cluster.clone().ok_or_else(|| {
        ApiError::new(
            ErrorKind::NotFound,
            "this node is not in a cluster: start `shoal serve` with --secret-file FILE or SHOAL_SECRET (make one with `shoal secret`)",
        )
    })
}

/// `GET /cluster/nodes`: every known node, live ones first, by id.
pub async fn nodes(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match node(&state, &req) {
        Ok(n) => Json(json!({"nodes": n.nodes().await})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /cluster/links`: every link a live node measured.
pub async fn links(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match node(&state, &req) {
        Ok(n) => Json(json!({"links": n.links()})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Gossip key of a node's figures (its [`crate::metrics::ModelFigures`] by model).
pub const FIGURES_KEY: &str = "figures";

/// Publishes this node's figures through its cluster node every 2 s until the state is
/// gone, so any node can show every node's (`GET /cluster/figures`).
pub async fn publish_figures(
    state: std::sync::Weak<AppState>,
    node: Arc<shoal_cluster::node::Node>,
) {
    let mut last = String::new();
    loop {
        let Some(s) = state.upgrade() else { return };
        s.refresh_gauges();
        let now = serde_json::to_string(&s.metrics.figures()).unwrap_or_default();
        drop(s);
        if now != last {
            match node.publish(FIGURES_KEY, &now).await {
                Ok(()) => last = now,
                Err(e) => tracing::debug!("publishing figures failed: {e}"),
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

/// Marks this node's GPUs that failed (a lost device) in its published facts, checking
/// every 2 s, so `shoal nodes`, the dashboard and the planner see them; until the node
/// is dropped.
pub async fn publish_gpu_failures(node: std::sync::Weak<shoal_cluster::node::Node>) {
    loop {
        let failed = shoal_engine::device::failed_gpus();
        let Some(node) = node.upgrade() else { return };
        if !failed.is_empty() {
            node.update_facts(|f| {
                for g in &mut f.gpus {
                    if let Some((_, why)) = failed.iter().find(|(i, _)| *i == g.index) {
                        g.failed = Some(why.clone());
                    }
                }
            })
            .await;
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

/// `GET /cluster/figures`: every live node's figures by model, with the time they were
/// read here: `{"at_ms", "nodes": {NAME: {MODEL: {...}}}}`.
pub async fn figures(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let n = match node(&state, &req) {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    state.refresh_gauges();
    let names: std::collections::HashMap<String, String> = n
        .nodes()
        .await
        .into_iter()
        .map(|x| (x.id.clone(), x.name))
        .collect();
    let mut out = serde_json::Map::new();
    for (id, v) in n.published(FIGURES_KEY) {
        let figures = if id == n.id() {
            serde_json::to_value(state.metrics.figures()).unwrap_or_default()
        } else {
            serde_json::from_str(&v).unwrap_or_default()
        };
        out.insert(names.get(&id).cloned().unwrap_or(id), figures);
    }
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    Json(json!({"at_ms": at_ms, "nodes": out})).into_response()
}

/// `GET /cluster/planner`: the live cluster as the planner takes it (`shoal plan` without
/// `--cluster`): live nodes with their measured facts, and each measured pair's link.
pub async fn planner(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match node(&state, &req) {
        Ok(n) => {
            let (nodes, links) = n.planner_view().await;
            Json(json!({"nodes": nodes, "links": links})).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `GET /cluster/status`: this node, the coordinator, counts of live and dead nodes and of
/// refused strangers, this node's protocol versions and the nodes refused for theirs.
pub async fn status(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match node(&state, &req) {
        Ok(n) => {
            let nodes = n.nodes().await;
            // instances by state (empty without a driver)
            let mut instances = serde_json::Map::new();
            if let Some(c) = state.instances.get() {
                if let Ok(t) = c.0.list().await {
                    for i in t["instances"].as_array().into_iter().flatten() {
                        let st = i["state"].as_str().unwrap_or("unknown").to_string();
                        let e = instances.entry(st).or_insert(json!(0));
                        *e = json!(e.as_u64().unwrap_or(0) + 1);
                    }
                }
            }
            Json(json!({
                "instances": instances,
                "node": n.id(),
                "listen": n.listen_addr().to_string(),
                "coordinator": n.coordinator(),
                "alive": nodes.iter().filter(|x| x.alive).count(),
                "dead": nodes.iter().filter(|x| !x.alive).count(),
                "links": n.links().len(),
                "refused_sessions": n.refused_sessions(),
                "refused_datagrams": n.refused_datagrams(),
                "protocol": shoal_cluster::protocol::ours().ok(),
                "incompatible_nodes": n.incompatible_peers(),
                "models": state.served().iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
                "uptime_s": state.started.elapsed().as_secs(),
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}

fn control(state: &AppState) -> Result<crate::state::Control, ApiError> {
    state.instances.get().cloned().ok_or_else(|| {
        ApiError::new(
            ErrorKind::NotFound,
            "this node runs no instance driver: start `shoal serve` with --secret-file FILE or SHOAL_SECRET to join a cluster",
        )
    })
}

fn admin(state: &AppState, req: &Request) -> Result<crate::state::Control, ApiError> {
    state
        .keys
        .authorize_admin(req.headers(), state.is_local_request(req))?;
    control(state)
}

fn answer(r: Result<serde_json::Value, crate::state::ControlError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            // the status the driver chose, in the OpenAI error shape the other routes use
            let status =
                StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let (ty, code) = match e.status {
                404 => ("invalid_request_error", Some("not_found")),
                409 => ("invalid_request_error", Some("conflict")),
                400..=499 => ("invalid_request_error", None),
                _ => ("server_error", None),
            };
            let body =
                json!({"error": {"message": e.message, "type": ty, "param": null, "code": code}});
            (status, Json(body)).into_response()
        }
    }
}

/// `GET /cluster/instances`: the instance table.
pub async fn instances(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state.keys.authorize_view(req.headers()) {
        return e.into_response();
    }
    match control(&state) {
        Ok(c) => answer(c.0.list().await),
        Err(e) => e.into_response(),
    }
}

async fn json_body(req: Request) -> Result<serde_json::Value, ApiError> {
    let body = axum::body::to_bytes(req.into_body(), 64 << 10)
        .await
        .map_err(|e| ApiError::invalid(format!("cannot read the body: {e}")))?;
    let v: serde_json::Value = crate::error::parse_body(&body)?;
    if !v.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    Ok(v)
}

/// `POST /cluster/instances` with `{"model", "id"?, "strategy"?, "nodes"?, "ctx"?}`.
pub async fn load(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let c = match admin(&state, &req) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match json_body(req).await {
        Ok(v) => answer(c.0.load(v).await),
        Err(e) => e.into_response(),
    }
}

/// `POST /cluster/plan` with a load's fields: the planner's ranked placements, placing
/// nothing (needs an API key once keys exist, like the other views).
pub async fn plan(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state.keys.authorize_view(req.headers()) {
        return e.into_response();
    }
    let c = match control(&state) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match json_body(req).await {
        Ok(v) => answer(c.0.plan(v).await),
        Err(e) => e.into_response(),
    }
}

/// `GET /cluster/models`: the model files the cluster's nodes offer.
pub async fn models(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = state.keys.authorize_view(req.headers()) {
        return e.into_response();
    }
    match control(&state) {
        Ok(c) => answer(c.0.models().await),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /cluster/instances/{id}`.
pub async fn unload(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    match admin(&state, &req) {
        Ok(c) => answer(c.0.unload(id).await),
        Err(e) => e.into_response(),
    }
}

/// `POST /cluster/drain` with `{"node"}`.
pub async fn drain(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let c = match admin(&state, &req) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match json_body(req).await {
        Ok(v) => match v["node"].as_str() {
            Some(n) if !n.is_empty() => answer(c.0.drain(n.to_string()).await),
            _ => ApiError::invalid_param("node", "give the node to drain: {\"node\": ID or NAME}")
                .into_response(),
        },
        Err(e) => e.into_response(),
    }
}
