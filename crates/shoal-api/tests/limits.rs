//! What one API client must not be able to do to the server or to other clients: give
//! unbounded stop strings, get the grammar engine's internals back from a schema no output
//! can match, have its input echoed whole in an error, continue another key's stored
//! response, or read the cluster's views with a key that is not an administrator's; and the
//! dashboard may not be framed by another site.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{runtime, send, tiny_state};
use futures_util::StreamExt;
use serde_json::{json, Value};
use shoal_api::HttpOptions;
use tower::ServiceExt;

/// The same small request on each generating route, with `extra` merged in (`None` for a
/// route that does not take the field).
fn on_every_route(extra: impl Fn(&str) -> Option<Value>) -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    for (path, base) in [
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/api/chat",
            json!({"model": "tiny", "stream": false, "options": {"num_predict": 2}, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/responses",
            json!({"model": "tiny", "max_output_tokens": 2, "input": "hi"}),
        ),
    ] {
        if let Some(Value::Object(fields)) = extra(path) {
            let mut body = base;
            for (k, v) in fields {
                body[k] = v;
            }
            out.push((path, body));
        }
    }
    out
}

#[test]
fn stop_strings_are_bounded_on_every_route() {
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
        let long = vec!["x".repeat(300)];
        for stops in [json!(many), json!(long)] {
            let cases = on_every_route(|path| match path {
                "/v1/chat/completions" => Some(json!({"stop": stops})),
                "/v1/messages" => Some(json!({"stop_sequences": stops})),
                "/api/chat" => Some(json!({"options": {"num_predict": 2, "stop": stops}})),
                _ => None,
            });
            assert_eq!(cases.len(), 3);
            for (path, body) in cases {
                let (s, _, b) = send(&app, "POST", path, None, &body).await;
                assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {b}");
                assert!(b.contains("at most 16 stop strings"), "{path}: {b}");
            }
        }
        // sixteen short ones are fine
        let fine: Vec<String> = (0..16).map(|i| format!("s{i}")).collect();
        let body = json!({"model": "tiny", "max_tokens": 2, "stop": fine, "messages": [{"role": "user", "content": "hi"}]});
        let (s, _, b) = send(&app, "POST", "/v1/chat/completions", None, &body).await;
        assert_eq!(s, StatusCode::OK, "{b}");
    });
}

#[test]
fn a_schema_no_output_can_match_is_a_short_400_on_every_route() {
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let schema = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}});
        let cases = on_every_route(|path| {
            Some(match path {
                "/v1/chat/completions" => json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                "/v1/messages" => json!({"output_config": {"format": {"type": "json_schema", "schema": schema}}}),
                "/api/chat" => json!({"format": schema}),
                _ => json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
            })
        });
        assert_eq!(cases.len(), 4);
        for (path, body) in cases {
            let (s, _, b) = send(&app, "POST", path, None, &body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {b}");
            assert!(b.len() < 600, "{path}: {} bytes: {b}", b.len());
            assert!(!b.contains("<state>"), "{path}: {b}");
        }
    });
}

#[test]
fn errors_do_not_echo_input_whole() {
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let name = "m".repeat(1 << 20);
        let cases = on_every_route(|_| Some(json!({"model": name})));
        for (path, body) in cases {
            let (s, _, b) = send(&app, "POST", path, None, &body).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{path}");
            assert!(b.len() < 2048, "{path}: {} bytes", b.len());
        }
    });
}

#[test]
fn a_stored_response_continues_for_its_own_key_only() {
    let (_dir, state) = tiny_state(2, 4);
    let (_, admin) = state.keys.create("ops", true, None).unwrap();
    let (_, alice) = state.keys.create("alice", false, None).unwrap();
    let (_, bob) = state.keys.create("bob", false, None).unwrap();
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let body = json!({"model": "tiny", "input": "my secret is 42", "max_output_tokens": 2});
        let (s, _, b) = send(&app, "POST", "/v1/responses", Some(&alice), &body).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let id = serde_json::from_str::<Value>(&b).unwrap()["id"].clone();
        let next = json!({"model": "tiny", "input": "what is it?", "previous_response_id": id, "max_output_tokens": 2});
        let (s, _, b) = send(&app, "POST", "/v1/responses", Some(&bob), &next).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "bob continued alice's response: {b}");
        let (s, _, b) = send(&app, "POST", "/v1/responses", Some(&admin), &next).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "even an administrator: {b}");
        let (s, _, b) = send(&app, "POST", "/v1/responses", Some(&alice), &next).await;
        assert_eq!(s, StatusCode::OK, "{b}");
    });
}

#[test]
fn cluster_views_need_an_administrator_key_and_the_dashboard_cannot_be_framed() {
    let (_dir, state) = tiny_state(2, 4);
    let (_, admin) = state.keys.create("ops", true, None).unwrap();
    let (_, user) = state.keys.create("user", false, None).unwrap();
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        for path in [
            "/cluster/nodes",
            "/cluster/links",
            "/cluster/status",
            "/cluster/doctor",
            "/cluster/instances",
            "/cluster/models",
            "/cluster/figures",
        ] {
            let (s, _, b) = send(&app, "GET", path, Some(&user), &Value::Null).await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{path}: {b}");
            assert!(b.contains("administrator"), "{path}: {b}");
            let (s, _, b) = send(&app, "GET", path, Some(&admin), &Value::Null).await;
            assert_ne!(s, StatusCode::FORBIDDEN, "{path}: {b}");
        }
        // the model routes stay open to the key
        let (s, _, b) = send(&app, "GET", "/v1/models", Some(&user), &Value::Null).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let (s, h, _) = send(&app, "GET", "/", None, &Value::Null).await;
        assert_eq!(s, StatusCode::OK);
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h["x-content-type-options"], "nosniff");
    });
}

/// A request to `path` as a browser on the node's machine would send it, from a page at
/// `origin` (if any) and for the address `host`.
fn from_browser(
    method: &str,
    path: &str,
    origin: Option<&str>,
    host: &str,
    content_type: &str,
    body: &str,
) -> Request<Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", host)
        .header("content-type", content_type);
    if let Some(o) = origin {
        b = b.header("origin", o);
    }
    let mut req = b.body(Body::from(body.to_string())).unwrap();
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            40000,
        ))));
    req
}

#[test]
fn a_web_page_cannot_manage_a_node_without_keys() {
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(
        state.clone(),
        &HttpOptions {
            cors_origins: vec!["http://app.example".into()],
            ..HttpOptions::default()
        },
    );
    runtime().block_on(async {
        let key = r#"{"name": "ops", "admin": true}"#;
        let status = |req: Request<Body>| {
            let app = app.clone();
            async move {
                let r = app.oneshot(req).await.unwrap();
                let s = r.status();
                let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
                (s, String::from_utf8_lossy(&b).into_owned())
            }
        };
        // another site's page, even one allowed by --cors-origin
        for origin in ["http://evil.example", "http://app.example"] {
            let (s, b) = status(from_browser(
                "POST",
                "/admin/keys",
                Some(origin),
                "127.0.0.1:7337",
                "application/json",
                key,
            ))
            .await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{origin}: {b}");
            assert!(b.contains("another site"), "{b}");
            let (s, _) = status(from_browser(
                "POST",
                "/cluster/drain",
                Some(origin),
                "127.0.0.1:7337",
                "application/json",
                r#"{"node": "a"}"#,
            ))
            .await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{origin}");
        }
        // DNS rebinding: the page's own name, resolved to 127.0.0.1
        let (s, b) = status(from_browser(
            "POST",
            "/admin/keys",
            None,
            "evil.example:7337",
            "application/json",
            key,
        ))
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
        assert!(b.contains("IP address or localhost"), "{b}");
        // a form post (text/plain) needs no preflight: refused
        let (s, b) = status(from_browser(
            "POST",
            "/admin/keys",
            None,
            "127.0.0.1:7337",
            "text/plain",
            key,
        ))
        .await;
        assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{b}");
        // no CORS on the managing routes, though the model routes have it
        let preflight = |path: &str| {
            Request::builder()
                .method("OPTIONS")
                .uri(path)
                .header("origin", "http://app.example")
                .header("access-control-request-method", "POST")
                .body(Body::empty())
                .unwrap()
        };
        let r = app.clone().oneshot(preflight("/admin/keys")).await.unwrap();
        assert!(r.headers().get("access-control-allow-origin").is_none());
        let r = app
            .clone()
            .oneshot(preflight("/v1/chat/completions"))
            .await
            .unwrap();
        assert!(r.headers().get("access-control-allow-origin").is_some());
        assert!(state.keys.is_empty(), "no key was made by any of the above");
        // the node's own page (same origin) and the CLI (no origin) at its address still may
        let (s, b) = status(from_browser(
            "POST",
            "/admin/keys",
            Some("http://127.0.0.1:7337"),
            "127.0.0.1:7337",
            "application/json",
            key,
        ))
        .await;
        assert_eq!(s, StatusCode::CREATED, "{b}");
    });
}

#[test]
fn a_request_without_a_key_is_refused_before_its_body_is_read() {
    let (_dir, state) = tiny_state(2, 4);
    state.keys.create("ops", true, None).unwrap();
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        for path in [
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/responses",
            "/api/chat",
        ] {
            // a body that starts and never ends: reading it would wait for ever
            let endless = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"{\"model\": \"tiny\""))
            })
            .chain(futures_util::stream::pending());
            let req = Request::builder()
                .method("POST")
                .uri(path)
                .header("content-type", "application/json")
                .body(Body::from_stream(endless))
                .unwrap();
            let resp =
                tokio::time::timeout(std::time::Duration::from_secs(5), app.clone().oneshot(req))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{path}: the body was read before the key was checked")
                    })
                    .unwrap();
            assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{path}");
        }
    });
}

#[test]
fn connections_are_capped_per_client_and_slow_headers_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_dir, state) = tiny_state(2, 4);
    let app = shoal_api::router(state, &HttpOptions::default());
    runtime().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = shoal_api::connections::ConnectionLimits {
            total: 16,
            per_client: 2,
            header_timeout: std::time::Duration::from_secs(1),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(shoal_api::connections::serve(
            listener,
            app,
            async {
                let _ = stopped.await;
            },
            limits,
        ));
        let first_line = |mut c: tokio::net::TcpStream| async move {
            let mut buf = vec![0u8; 256];
            let n = tokio::time::timeout(std::time::Duration::from_secs(5), c.read(&mut buf))
                .await
                .expect("an answer or a close within 5 s")
                .unwrap_or(0);
            String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or("").to_string()
        };
        // a request works, and carries the client's address (a key is made from this machine)
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let body = r#"{"name": "ops", "admin": true}"#;
        c.write_all(format!("POST /admin/keys HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len()).as_bytes()).await.unwrap();
        assert_eq!(first_line(c).await, "HTTP/1.1 201 Created");
        // two held connections from another address (so the first request's connection,
        // whose place is given back when the server is done with it, cannot count); the
        // third is refused
        let from_other = || async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            s.connect(addr).await.unwrap()
        };
        let a = from_other().await;
        let b = from_other().await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let third = from_other().await;
        assert_eq!(first_line(third).await, "HTTP/1.1 429 Too Many Requests");
        // headers that never finish: the connection is closed after the timeout
        let mut slow = a;
        slow.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n").await.unwrap();
        let t = std::time::Instant::now();
        let _ = first_line(slow).await;
        assert!(t.elapsed() < std::time::Duration::from_secs(4), "{:?}", t.elapsed());
        drop(b);
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    });
}
