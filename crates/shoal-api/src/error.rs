//! One error type for every route, rendered in the shape of the API the client speaks: OpenAI
//! (`{"error": {"message", "type", "param", "code"}}`), Anthropic (`{"type": "error", "error":
//! {"type", "message"}}`) or Ollama (`{"error": "message"}`), with the HTTP status each API
//! uses and `Retry-After` on rate limits. Messages say what was wrong and what to do.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// The longest error message sent, in bytes; longer ones are cut.
pub const MESSAGE_BYTES: usize = 1024;

/// Which API's error shape to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// OpenAI (also used for shoal's own admin routes).
    OpenAi,
    /// Anthropic.
    Anthropic,
    /// Ollama.
    Ollama,
}

/// What kind of failure, which decides the status and the error type name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or asks for something impossible (400).
    InvalidRequest,
    /// No or an unknown API key (401).
    Authentication,
    /// The key may not do this (403).
    Permission,
    /// No such model or route (404).
    NotFound,
    /// The body is larger than the server accepts (413).
    TooLarge,
    /// The prompt does not fit the model's context (400; OpenAI's code
    /// `context_length_exceeded`, which agents such as Codex compact on, as Claude Code does
    /// on Anthropic's "prompt is too long: N tokens > M maximum").
    ContextLength,
    /// Too many requests for this key; retry after the given seconds (429).
    RateLimited {
        /// Seconds until a request will be accepted.
        retry_after: u64,
    },
    /// The queue is full (503).
    Overloaded,
    /// Something failed inside the server (500).
    Internal,
}

/// An error answered to an API client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What was wrong and what to do.
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// The shape to render in.
    pub flavor: Flavor,
}

impl ApiError {
    /// An error of `kind` with `message`, in OpenAI's shape until [`ApiError::flavor`] says
    /// otherwise.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            flavor: Flavor::OpenAi,
        }
    }

    /// A 400 for a bad request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    /// A 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(message);
        e.param = Some(param.to_string());
        e
    }

    /// A 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// The same error rendered as `flavor`.
    pub fn flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = flavor;
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::Permission => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::ContextLength => StatusCode::BAD_REQUEST,
            ErrorKind::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The message as sent: cut to [`MESSAGE_BYTES`], so that an error never echoes a
    /// client's input whole (a 1 MB model name, a tool list, a grammar).
    fn shown_message(&self) -> std::borrow::Cow<'_, str> {
        if self.message.len() <= MESSAGE_BYTES {
            return self.message.as_str().into();
        }
        let mut end = MESSAGE_BYTES;
        while !self.message.is_char_boundary(end) {
            end -= 1;
        }
        format!(
            "{}… ({} more bytes cut)",
            &self.message[..end],
            self.message.len() - end
        )
        .into()
    }

    /// The error's JSON body in its flavor.
    pub fn body(&self) -> serde_json::Value {
        let message = self.shown_message();
        match self.flavor {
            Flavor::OpenAi => {
                let (ty, code) = match self.kind {
                    ErrorKind::InvalidRequest => ("invalid_request_error", None),
                    ErrorKind::Authentication => ("invalid_request_error", Some("invalid_api_key")),
                    ErrorKind::Permission => ("permission_error", None),
                    ErrorKind::NotFound => ("invalid_request_error", Some("model_not_found")),
                    ErrorKind::TooLarge => ("invalid_request_error", Some("request_too_large")),
                    ErrorKind::ContextLength => {
                        ("invalid_request_error", Some("context_length_exceeded"))
                    }
                    ErrorKind::RateLimited { .. } => {
                        ("rate_limit_error", Some("rate_limit_exceeded"))
                    }
                    ErrorKind::Overloaded => ("server_error", Some("overloaded")),
                    ErrorKind::Internal => ("server_error", None),
                };
                json!({"error": {
                    "message": message,
                    "type": ty,
                    "param": self.param,
                    "code": code,
                }})
            }
            Flavor::Anthropic => {
                let ty = match self.kind {
                    ErrorKind::InvalidRequest | ErrorKind::ContextLength => "invalid_request_error",
                    ErrorKind::Authentication => "authentication_error",
                    ErrorKind::Permission => "permission_error",
                    ErrorKind::NotFound => "not_found_error",
                    ErrorKind::TooLarge => "request_too_large",
                    ErrorKind::RateLimited { .. } => "rate_limit_error",
                    ErrorKind::Overloaded => "overloaded_error",
                    ErrorKind::Internal => "api_error",
                };
                json!({"type": "error", "error": {"type": ty, "message": message}})
            }
            Flavor::Ollama => json!({"error": message}),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status())
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let ErrorKind::RateLimited { retry_after } = self.kind {
            if let Ok(v) = HeaderValue::from_str(&retry_after.max(1).to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

/// Parses a JSON request body into `T`, with a message that names the position and the field
/// when the body is not what the route takes.
///
/// # Errors
/// A 400 saying what was wrong with the body.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            "the request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "the request body is not valid JSON"
            }
            _ => "the request body does not match this route's format",
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_per_flavor() {
        let e = ApiError::new(ErrorKind::NotFound, "no model x");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        let a = e.clone().flavor(Flavor::Anthropic);
        assert_eq!(a.body()["type"], "error");
        assert_eq!(a.body()["error"]["type"], "not_found_error");
        let o = e.flavor(Flavor::Ollama);
        assert_eq!(o.body(), json!({"error": "no model x"}));
    }

    #[test]
    fn long_messages_are_cut() {
        let e = ApiError::invalid(format!("no model {}", "é".repeat(600_000)));
        let body = e.clone().flavor(Flavor::Ollama).body();
        let shown = body["error"].as_str().unwrap();
        assert!(shown.len() < MESSAGE_BYTES + 64, "{}", shown.len());
        assert!(shown.ends_with("more bytes cut)"), "{shown}");
        for f in [Flavor::OpenAi, Flavor::Anthropic] {
            assert!(e.clone().flavor(f).body().to_string().len() < MESSAGE_BYTES + 256);
        }
        let short = ApiError::invalid("short");
        assert_eq!(short.body()["error"]["message"], "short");
    }

    #[test]
    fn rate_limit_sets_retry_after() {
        let r =
            ApiError::new(ErrorKind::RateLimited { retry_after: 7 }, "slow down").into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "7");
    }

    #[test]
    fn bad_json_names_the_problem() {
        #[derive(serde::Deserialize, Debug)]
        struct T {
            #[allow(dead_code)]
            model: String,
        }
        let e = parse_body::<T>(b"{\"model\": 3}").unwrap_err();
        assert!(
            e.message.contains("model") || e.message.contains("string"),
            "{e}"
        );
        let e = parse_body::<T>(b"{nope").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{e}");
        assert!(parse_body::<T>(b"  ").is_err());
    }
}
