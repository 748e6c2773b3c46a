//! The cluster's read-only views over HTTP (`shoal nodes`, `shoal links`, `shoal status`
//! talk to these): every node this one knows of with its facts, every measured link, and a
//! summary. They need an API key once keys exist, like the model routes. A server started
//! without a cluster secret is a single node outside any cluster; these routes then say so.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{ApiError, ErrorKind};
use crate::state::AppState;

fn node(state: &AppState, req: &Request) -> Result<Arc<shoal_cluster::node::Node>, ApiError> {
    state.keys.authorize(req.headers())?;
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
/// refused strangers.
pub async fn status(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match node(&state, &req) {
        Ok(n) => {
            let nodes = n.nodes().await;
            Json(json!({
                "node": n.id(),
                "listen": n.listen_addr().to_string(),
                "coordinator": n.coordinator(),
                "alive": nodes.iter().filter(|x| x.alive).count(),
                "dead": nodes.iter().filter(|x| !x.alive).count(),
                "links": n.links().len(),
                "refused_sessions": n.refused_sessions(),
                "refused_datagrams": n.refused_datagrams(),
                "models": state.models.iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
                "uptime_s": state.started.elapsed().as_secs(),
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}
