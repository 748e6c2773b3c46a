//! What stands before the routes that change the node or the cluster (`/admin/*`, loading,
//! unloading and draining): a web page must not be able to use them through the browser of
//! someone on the node's machine.
//!
//! Requests that change something (not `GET` or `HEAD`):
//! - A request whose `Origin` is not the node's own (the `Host` it was sent to) is refused:
//!   a page on another site cannot post to the node.
//! - On a node without keys, where a client on the machine is trusted without a key, the
//!   `Host` must be an IP address or `localhost`: a page whose own name was made to resolve
//!   to 127.0.0.1 (DNS rebinding) sends its name, and is refused.
//! - A body must be JSON (`content-type: application/json`), which a page can only send
//!   cross-site after a CORS preflight; CORS is never granted on these routes
//!   ([`crate::router`] leaves them out of `--cors-origin`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, ErrorKind};
use crate::state::AppState;

/// Whether `host` (a `Host` header: name or address, with an optional port) is an IP
/// address or `localhost`.
fn is_address_or_localhost(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // [v6]:port
        Some(rest) => {
            return rest
                .split(']')
                .next()
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok())
        }
        None => host.rsplit_once(':').map_or(host, |(n, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                n
            } else {
                host
            }
        }),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

/// The `host[:port]` of an `Origin` header (`scheme://host[:port]`), when it has one.
fn origin_authority(origin: &str) -> Option<&str> {
    origin
        .split_once("://")
        .map(|(_, rest)| rest.trim_end_matches('/'))
}

/// Why a request may not reach an administrative route, if it may not. Reads (`GET`,
/// `HEAD`) change nothing and pass: a page on another site cannot read the answers without
/// CORS.
pub fn refusal(state: &AppState, req: &Request) -> Option<ApiError> {
    if matches!(*req.method(), Method::GET | Method::HEAD) {
        return None;
    }
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    if let Some(origin) = headers.get(header::ORIGIN) {
        let same = origin
            .to_str()
            .ok()
            .and_then(origin_authority)
            .is_some_and(|o| host.is_some_and(|h| o.eq_ignore_ascii_case(h)));
        if !same {
            return Some(ApiError::new(
                ErrorKind::Permission,
                "a request from another site's page may not manage this node; use the shoal CLI or the node's own dashboard",
            ));
        }
    }
    if state.keys.is_empty() && !host.is_some_and(is_address_or_localhost) {
        return Some(ApiError::new(
            ErrorKind::Permission,
            "a node without API keys is managed only at an IP address or localhost (the Host header named another name); create an administrator key to manage it by name",
        ));
    }
    let has_body = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH);
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/json")
        });
    if has_body && !json {
        return Some(ApiError::new(
            ErrorKind::InvalidRequest,
            "send the body as JSON, with content-type: application/json",
        ));
    }
    None
}

/// Whether `path` is one of the routes that change the node or the cluster.
pub fn is_managing(path: &str) -> bool {
    path.starts_with("/admin/")
        || path.starts_with("/cluster/instances")
        || path == "/cluster/drain"
}

/// Outside `--cors-origin`'s layer: the managing routes never answer a preflight and never
/// carry CORS headers, whatever origins the model routes allow.
pub async fn no_cors(req: Request, next: Next) -> Response {
    if !is_managing(req.uri().path()) {
        return next.run(req).await;
    }
    if req.method() == Method::OPTIONS {
        return ApiError::new(
            ErrorKind::Permission,
            "cross-origin requests may not manage this node",
        )
        .into_response();
    }
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    for name in [
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
        header::ACCESS_CONTROL_ALLOW_METHODS,
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
    ] {
        h.remove(name);
    }
    resp
}

/// The middleware on the administrative routes.
pub async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match refusal(&state, &req) {
        None => next.run(req).await,
        Some(e) if e.kind == ErrorKind::InvalidRequest => {
            (StatusCode::UNSUPPORTED_MEDIA_TYPE, axum::Json(e.body())).into_response()
        }
        Some(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_localhost_are_told_from_names() {
        for ok in [
            "127.0.0.1:7337",
            "127.0.0.1",
            "localhost:7337",
            "LOCALHOST",
            "[::1]:7337",
            "10.0.0.2:80",
        ] {
            assert!(is_address_or_localhost(ok), "{ok}");
        }
        for bad in [
            "evil.example:7337",
            "evil.example",
            "127.0.0.1.nip.io:7337",
            "[evil]:1",
            "localhost.evil:80",
        ] {
            assert!(!is_address_or_localhost(bad), "{bad}");
        }
        assert_eq!(
            origin_authority("http://127.0.0.1:7337"),
            Some("127.0.0.1:7337")
        );
        assert_eq!(origin_authority("null"), None);
    }
}
