//! Answers relayed through an entry node, and taken over by the next lead when theirs dies.
//!
//! A model request that enters at a node which does not lead its instance is forwarded to
//! the lead ([`crate::forward`]). For a streamed answer the lead writes, after the output of
//! each generated token, a mark naming the token ([`TokenMark`]): an SSE comment
//! `: shoal-token ID`, or in Ollama's lines `{"shoal_token":ID}`. The entry node ([`Relay`])
//! passes the answer on up to each mark and holds back what follows until the next mark
//! comes (as a rule in the same write), stripping the marks; so it knows exactly which
//! tokens' output the client has. When the lead's answer breaks off, the entry node waits
//! for the instance's next lead (placed again by the cluster once the dead node is declared
//! dead) and sends the request there again with those tokens in [`RESUME`]. The new lead
//! queues it going on after them: their text passes through its parsers and through the
//! API's stream state without being sent again (see [`crate::generation::Running`]), so its
//! answer continues exactly where the client's stopped and the client sees one stream. A
//! whole (not streamed) answer cut short is asked for again.
//!
//! The request cannot go on when the instance is unloaded, fails to be placed again, or is
//! not placed again within [`RESUME_WAIT`]; the client's stream then ends with an error
//! event in its API's shape ([`StreamEnd`]), and a whole answer with a 502, never silently.
//! A client connected to the dying node itself loses its connection.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::state::{AppState, InstanceView};

/// The header a request taken over by a new lead carries: the tokens the client was already
/// sent, as decimal ids separated by commas.
pub const RESUME: &str = "x-shoal-resume";

/// How long an entry node waits for an instance whose lead died to be placed again.
pub const RESUME_WAIT: Duration = Duration::from_secs(120);

/// How long it waits while the placement that broke is marked failed by its own ranks (the
/// dead node is declared dead, and the instance placed again, within seconds).
const FAILED_GRACE: Duration = Duration::from_secs(15);

/// Most bytes of a whole (not streamed) answer read before it is passed on.
const WHOLE_ANSWER_LIMIT: usize = 256 << 20;

/// Most tokens a [`RESUME`] header may name.
const MOST_RESUMED: usize = 1 << 20;

tokio::task_local! {
    static RELAYED: Relayed;
}

/// What the lead knows of a request an entry node relays to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Relayed {
    /// Tokens the client was already sent by a lead that died (empty for a new request).
    pub resume: Vec<u32>,
}

impl Relayed {
    /// The relay context of a forwarded request's headers.
    ///
    /// # Errors
    /// A [`RESUME`] header that is not a list of token ids (the message says what is wrong).
    pub fn of(headers: &HeaderMap) -> Result<Self, String> {
        let Some(v) = headers.get(RESUME) else {
            return Ok(Relayed::default());
        };
        Ok(Relayed {
            resume: parse_resume(v.as_bytes())?,
        })
    }

    /// Runs `f` (the route answering a relayed request) with `self` as [`Relayed::current`].
    pub async fn serve<F: Future>(self, f: F) -> F::Output {
        RELAYED.scope(self, f).await
    }

    /// The relay context of the request being answered, when an entry node relays it.
    pub fn current() -> Option<Relayed> {
        RELAYED.try_with(Clone::clone).ok()
    }
}

/// The token ids of a [`RESUME`] header.
fn parse_resume(value: &[u8]) -> Result<Vec<u32>, String> {
    let text =
        std::str::from_utf8(value).map_err(|_| format!("the {RESUME} header is not text"))?;
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<u32> = text
        .split(',')
        .map(|t| t.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|e| {
            format!("the {RESUME} header must list token ids separated by commas ({e})")
        })?;
    if ids.len() > MOST_RESUMED {
        return Err(format!(
            "the {RESUME} header names {} tokens, more than the {MOST_RESUMED} accepted",
            ids.len()
        ));
    }
    Ok(ids)
}

/// A stream item that can carry the mark written after a token's output for an entry node.
pub trait TokenMark: Sized {
    /// The mark naming token `id`.
    fn token_mark(id: u32) -> Self;
}

impl TokenMark for Result<SseEvent, Infallible> {
    fn token_mark(id: u32) -> Self {
        Ok(SseEvent::default().comment(format!("shoal-token {id}")))
    }
}

impl TokenMark for Result<Bytes, Infallible> {
    fn token_mark(id: u32) -> Self {
        Ok(Bytes::from(format!("{{\"shoal_token\":{id}}}\n")))
    }
}

/// How an answer's stream is cut into events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Server-sent events, each ended by an empty line.
    Events,
    /// One JSON object a line (Ollama).
    Lines,
}

/// Reads the marks of a relayed stream: passes on whole events up to each mark, holds back
/// those after the last one, and keeps the tokens marked.
#[derive(Debug)]
struct Marks {
    framing: Framing,
    /// Bytes of an event not yet whole.
    partial: Vec<u8>,
    /// Whole events after the last mark.
    held: Vec<u8>,
    /// The tokens whose output went to the client, in order.
    tokens: Vec<u32>,
}

impl Marks {
    fn new(framing: Framing) -> Self {
        Marks {
            framing,
            partial: Vec::new(),
            held: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// Takes bytes from the lead; returns those that may go to the client now.
    fn push(&mut self, bytes: &[u8]) -> Vec<u8> {
        let end: &[u8] = match self.framing {
            Framing::Events => b"\n\n",
            Framing::Lines => b"\n",
        };
        self.partial.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(at) = find(&self.partial[start..], end) {
            let stop = start + at + end.len();
            let event = &self.partial[start..stop];
            match self.mark_of(event) {
                Some(Some(id)) => {
                    out.append(&mut self.held);
                    self.tokens.push(id);
                }
                // a keep-alive comment goes on at once when nothing is held before it
                Some(None) if self.held.is_empty() => out.extend_from_slice(event),
                _ => self.held.extend_from_slice(event),
            }
            start = stop;
        }
        self.partial.drain(..start);
        out
    }

    /// Everything held, at the end of an answer the lead ended as its API ends one.
    fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.held);
        out.append(&mut self.partial);
        out
    }

    /// Drops what the lead sent after its last mark (a new lead sends it again).
    fn drop_held(&mut self) {
        self.held.clear();
        self.partial.clear();
    }

    /// `Some(Some(id))` for a token's mark, `Some(None)` for another comment (SSE's
    /// keep-alive), `None` for an event of the answer.
    fn mark_of(&self, event: &[u8]) -> Option<Option<u32>> {
        let text = std::str::from_utf8(event).ok()?.trim();
        match self.framing {
            Framing::Events => {
                if !text.lines().all(|l| l.starts_with(':')) {
                    return None;
                }
                let id = text
                    .strip_prefix(':')
                    .map(str::trim)
                    .and_then(|t| t.strip_prefix("shoal-token "))
                    .and_then(|n| n.trim().parse().ok());
                Some(id)
            }
            Framing::Lines => text
                .strip_prefix("{\"shoal_token\":")
                .and_then(|t| t.strip_suffix('}'))
                .and_then(|n| n.parse().ok())
                .map(Some),
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// How a streamed answer of one API ends, and the event that ends one that was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
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
    pub(crate) fn of(path: &str, content_type: &str) -> Option<Self> {
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

    fn framing(self) -> Framing {
        match self {
            StreamEnd::Ollama => Framing::Lines,
            _ => Framing::Events,
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

    /// Whether `bytes` hold this API's end.
    fn ends(self, bytes: &[u8]) -> bool {
        let text = String::from_utf8_lossy(bytes);
        self.markers().iter().any(|m| text.contains(m))
    }

    /// The event that ends a cut stream with `message`, in the API's own shape.
    pub(crate) fn error_event(self, message: &str) -> String {
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

/// Where a request whose lead died goes next.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NextLead {
    /// Send it to the node at this API address.
    Go(String),
    /// Send it to the node at this API address, the lead of a placement still loading: until
    /// it serves the model it answers 503 (or 404, or 502 while it has not yet heard that it
    /// leads), and the request is sent again shortly.
    Early(String),
    /// Not placed again yet (or placing, or loading): look again shortly.
    Wait,
    /// It cannot go on; the message says why.
    Fail(String),
}

/// The decision for a request on instance `id` whose lead's answer broke: `view` is the
/// instance table's entry, `broke` the generation it was sent to, `waited` the time since.
/// A ready instance is tried even at the generation that broke: its lead may be alive (the
/// connection alone was cut); a dead one refuses, and the caller looks again.
fn next_lead(id: &str, view: Option<&InstanceView>, broke: u64, waited: Duration) -> NextLead {
    let Some(v) = view else {
        return NextLead::Fail(format!("instance {id} was unloaded"));
    };
    if waited >= RESUME_WAIT {
        return NextLead::Fail(format!(
            "instance {id} was not placed again within {} s",
            RESUME_WAIT.as_secs()
        ));
    }
    match (v.state.as_str(), &v.lead_api) {
        ("ready", Some(api)) => NextLead::Go(api.clone()),
        ("failed", _) if v.generation == broke && waited < FAILED_GRACE => NextLead::Wait,
        ("failed", _) => NextLead::Fail(format!(
            "instance {id} could not be placed again: {}",
            v.reason.as_deref().unwrap_or("no reason given")
        )),
        ("unloading", _) => NextLead::Fail(format!("instance {id} is being unloaded")),
        // placed again: its new lead serves the request as soon as it has loaded (503 until
        // then), before the table's `ready` reaches this node
        ("placing" | "loading", _) if v.generation > broke => match &v.placed_lead_api {
            Some(api) => NextLead::Early(api.clone()),
            None => NextLead::Wait,
        },
        _ => NextLead::Wait,
    }
}

/// A model request an entry node relays to its instance's lead, kept whole so that it can be
/// sent again to the next lead.
pub(crate) struct Relay {
    pub(crate) state: Arc<AppState>,
    pub(crate) client: Client<HttpConnector, Body>,
    /// The instance (model id) it runs on.
    pub(crate) model: String,
    pub(crate) method: Method,
    /// The route's path and query.
    pub(crate) path_and_query: String,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Relay {
    fn flavor(&self) -> Flavor {
        crate::forward::flavor(&self.path)
    }

    /// The instance's generation now (0 when unknown).
    fn generation(&self) -> u64 {
        self.state
            .instances
            .get()
            .and_then(|c| c.0.instance(&self.model))
            .map_or(0, |v| v.generation)
    }

    /// Sends the request to the lead at `api`, going on after `resume` when given.
    async fn send(&self, api: &str, resume: &[u32]) -> Result<Response, String> {
        let uri: Uri = format!("http://{api}{}", self.path_and_query)
            .parse()
            .map_err(|e| format!("the lead node's address {api} is not usable: {e}"))?;
        let mut req = axum::http::Request::new(Body::from(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = self.headers.clone();
        let h = req.headers_mut();
        h.remove(header::HOST);
        h.remove(header::CONTENT_LENGTH);
        h.remove(RESUME);
        h.insert(crate::forward::FORWARDED, HeaderValue::from_static("1"));
        if !resume.is_empty() {
            let ids: Vec<String> = resume.iter().map(u32::to_string).collect();
            let v = HeaderValue::from_str(&ids.join(","))
                .map_err(|e| format!("cannot write the resumed tokens: {e}"))?;
            h.insert(RESUME, v);
        }
        let resp = self.client.request(req).await.map_err(|e| {
            format!("the node leading this model ({api}) could not be reached: {e}")
        })?;
        tracing::debug!(lead = %api, path = %self.path, status = resp.status().as_u16(), resumed = resume.len(), "forwarded");
        Ok(resp.map(Body::new))
    }

    /// The answer for the client: the lead's at `api`, passed on so that a cut never looks
    /// like an end, and taken over by the next lead when it can be (see the module).
    pub(crate) async fn answer(self, api: String) -> Response {
        let generation = self.generation();
        let resp = match self.send(&api, &[]).await {
            Ok(r) => r,
            Err(message) => {
                let e = ApiError::new(ErrorKind::Overloaded, format!("{message}; retry shortly"))
                    .flavor(self.flavor());
                return (StatusCode::BAD_GATEWAY, Json(e.body())).into_response();
            }
        };
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        match StreamEnd::of(&self.path, &content_type) {
            Some(end) if resp.status().is_success() => self.stream(resp, api, generation, end),
            _ => self.whole(resp, api, generation).await,
        }
    }

    /// A whole answer, read in full before it is passed on; asked of the next lead when the
    /// lead stops answering midway.
    async fn whole(self, mut resp: Response, mut api: String, generation: u64) -> Response {
        let since = Instant::now();
        loop {
            let (parts, body) = resp.into_parts();
            let why = match axum::body::to_bytes(body, WHOLE_ANSWER_LIMIT).await {
                Ok(bytes) => return Response::from_parts(parts, Body::from(bytes)),
                Err(e) => cut_message(&api, &e.to_string()),
            };
            tracing::warn!(lead = %api, path = %self.path, "a forwarded answer was cut: {why}");
            match self.next(generation, since, &[], || false).await {
                Ok((r, next)) => (resp, api) = (r, next),
                Err(reason) => {
                    let message = format!("{why}; the request cannot go on: {reason}");
                    let e = ApiError::new(ErrorKind::Overloaded, message).flavor(self.flavor());
                    return (StatusCode::BAD_GATEWAY, Json(e.body())).into_response();
                }
            }
        }
    }

    /// A streamed answer, relayed by a task of its own through a channel: the client's
    /// response starts with the first lead's status and headers.
    fn stream(self, resp: Response, api: String, generation: u64, end: StreamEnd) -> Response {
        let (parts, body) = resp.into_parts();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
        tokio::spawn(async move {
            let mut marks = Marks::new(end.framing());
            let mut upstream = body.into_data_stream();
            let mut api = api;
            let since = Instant::now();
            loop {
                let failure = loop {
                    match upstream.next().await {
                        Some(Ok(bytes)) => {
                            let out = marks.push(&bytes);
                            if !out.is_empty() && tx.send(Ok(Bytes::from(out))).await.is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) => break e.to_string(),
                        None => {
                            let rest = marks.finish();
                            if end.ends(&rest) {
                                let _ = tx.send(Ok(Bytes::from(rest))).await;
                                return;
                            }
                            break "the connection closed".to_string();
                        }
                    }
                };
                let why = cut_message(&api, &failure);
                tracing::warn!(lead = %api, path = %self.path, tokens = marks.tokens.len(), "a forwarded stream was cut: {failure}");
                marks.drop_held();
                match self
                    .next(generation, since, &marks.tokens, || tx.is_closed())
                    .await
                {
                    Ok((resp, next)) => {
                        tracing::info!(lead = %next, model = %self.model, resumed = marks.tokens.len(), "a forwarded stream goes on at the instance's new lead");
                        self.state.metrics.resumed(&self.model);
                        upstream = resp.into_body().into_data_stream();
                        api = next;
                    }
                    Err(reason) => {
                        let message = format!("{why}; the request cannot go on: {reason}");
                        let _ = tx.send(Ok(Bytes::from(end.error_event(&message)))).await;
                        return;
                    }
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        Response::from_parts(parts, Body::from_stream(stream))
    }

    /// The next lead's answer to the request going on after `resume`, once the instance is
    /// placed again; with the lead's address. Gives up when [`next_lead`] says so, or when
    /// `gone()` (the client left).
    async fn next(
        &self,
        generation: u64,
        since: Instant,
        resume: &[u32],
        gone: impl Fn() -> bool,
    ) -> Result<(Response, String), String> {
        let mut last = String::new();
        loop {
            if gone() {
                return Err("the client went away".into());
            }
            let view = self
                .state
                .instances
                .get()
                .and_then(|c| c.0.instance(&self.model));
            let decision = next_lead(&self.model, view.as_ref(), generation, since.elapsed());
            match decision.clone() {
                NextLead::Go(api) | NextLead::Early(api) => {
                    let early = matches!(decision, NextLead::Early(_));
                    match self.send(&api, resume).await {
                        Ok(r) if r.status().is_success() => return Ok((r, api)),
                        // not serving it yet (still loading, or not yet told its keys)
                        Ok(r) if r.status() == StatusCode::SERVICE_UNAVAILABLE => {
                            last = format!("{api} answered 503");
                        }
                        // a placement's lead that has not yet loaded, or heard that it leads
                        Ok(r)
                            if early
                                && matches!(
                                    r.status(),
                                    StatusCode::NOT_FOUND | StatusCode::BAD_GATEWAY
                                ) =>
                        {
                            last = format!("{api} answered {}", r.status().as_u16());
                        }
                        Ok(r) => {
                            let status = r.status();
                            let body = axum::body::to_bytes(r.into_body(), 64 << 10)
                                .await
                                .unwrap_or_default();
                            return Err(format!(
                                "the instance's lead ({api}) refused to go on ({status}): {}",
                                String::from_utf8_lossy(&body)
                            ));
                        }
                        Err(e) => last = e,
                    }
                }
                NextLead::Wait => {}
                NextLead::Fail(reason) if last.is_empty() => return Err(reason),
                NextLead::Fail(reason) => return Err(format!("{reason} (last try: {last})")),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn cut_message(api: &str, failure: &str) -> String {
    format!(
        "the node leading this model ({api}) stopped answering before the answer was complete \
         ({failure})"
    )
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
        assert!(StreamEnd::OpenAi.ends(b"data: {}\n\ndata: [DONE]\n\n"));
        assert!(!StreamEnd::OpenAi.ends(b"data: {}\n\n"));
    }

    fn sse_mark(id: u32) -> Vec<u8> {
        use axum::response::IntoResponse;
        // the mark as axum writes it
        let item: Result<SseEvent, Infallible> = TokenMark::token_mark(id);
        let stream = futures_util::stream::iter([item]);
        let resp = axum::response::Sse::new(stream).into_response();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(axum::body::to_bytes(resp.into_body(), 1 << 10))
            .unwrap()
            .to_vec()
    }

    #[test]
    fn events_pass_at_marks_and_what_follows_the_last_is_held() {
        let mut m = Marks::new(Framing::Events);
        let mark = sse_mark(7);
        assert_eq!(String::from_utf8_lossy(&mark), ": shoal-token 7\n\n");
        // a keep-alive with nothing held goes on at once
        assert_eq!(m.push(b":\n\n"), b":\n\n");
        let mut input = b"data: {\"a\":1}\n\ndata: {\"b\"".to_vec();
        assert!(m.push(&input).is_empty(), "nothing passes before a mark");
        input = b":2}\n\n".to_vec();
        input.extend_from_slice(&mark);
        input.extend_from_slice(b"data: {\"c\":3}\n\n: shoal-tok");
        assert_eq!(m.push(&input), b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n");
        assert_eq!(m.tokens, [7]);
        assert_eq!(m.push(b"en 8\n\n"), b"data: {\"c\":3}\n\n");
        assert_eq!(m.tokens, [7, 8]);
        m.push(b"data: {\"d\":4}\n\ndata: [DONE]\n\n");
        // a cut: what came after the last mark is dropped, a new lead sends it again
        let mut cut = Marks::new(Framing::Events);
        cut.push(b"data: x\n\n");
        cut.drop_held();
        assert!(cut.finish().is_empty());
        assert_eq!(m.finish(), b"data: {\"d\":4}\n\ndata: [DONE]\n\n");
    }

    #[test]
    fn ollama_lines_pass_at_marks() {
        let mut m = Marks::new(Framing::Lines);
        let Ok(mark) = <Result<Bytes, Infallible> as TokenMark>::token_mark(42);
        let mut input = b"{\"message\":{\"content\":\"Hi\"},\"done\":false}\n".to_vec();
        input.extend_from_slice(&mark);
        input.extend_from_slice(b"{\"done\":true}\n");
        assert_eq!(
            m.push(&input),
            b"{\"message\":{\"content\":\"Hi\"},\"done\":false}\n"
        );
        assert_eq!(m.tokens, [42]);
        // a content line that merely mentions the key is not a mark
        let text = b"{\"message\":{\"content\":\"{\\\"shoal_token\\\":1}\"}}\n";
        assert!(m.push(text).is_empty());
        assert_eq!(m.tokens, [42]);
    }

    #[test]
    fn the_resume_header_is_checked() {
        assert_eq!(parse_resume(b"1, 2,30").unwrap(), [1, 2, 30]);
        assert_eq!(parse_resume(b"").unwrap(), Vec::<u32>::new());
        let e = parse_resume(b"1,x").unwrap_err();
        assert!(e.contains("token ids"), "{e}");
        assert!(parse_resume(b"-1").is_err());
        assert!(parse_resume(&[0xff]).is_err());
    }

    fn view(state: &str, generation: u64, lead: Option<&str>) -> InstanceView {
        InstanceView {
            state: state.into(),
            generation,
            lead_here: false,
            lead_api: lead.map(str::to_string),
            placed_lead_api: None,
            reason: (state == "failed").then(|| "no node has room".into()),
        }
    }

    #[test]
    fn a_broken_answer_waits_for_the_next_lead_or_fails_with_the_reason() {
        let soon = Duration::from_secs(1);
        let ready = view("ready", 3, Some("10.0.0.2:8080"));
        assert_eq!(
            next_lead("m", Some(&ready), 3, soon),
            NextLead::Go("10.0.0.2:8080".into())
        );
        for v in [
            view("placing", 4, None),
            view("loading", 4, Some("x:1")),
            view("ready", 4, None),
            view("failed", 3, None),
        ] {
            assert_eq!(next_lead("m", Some(&v), 3, soon), NextLead::Wait, "{v:?}");
        }
        // placed again with its new lead known: sent there at once (it answers 503 until it
        // serves); not to the placement that broke
        for state in ["placing", "loading"] {
            let placed = InstanceView {
                placed_lead_api: Some("10.0.0.4:8080".into()),
                ..view(state, 4, None)
            };
            assert_eq!(
                next_lead("m", Some(&placed), 3, soon),
                NextLead::Early("10.0.0.4:8080".into())
            );
            let same = InstanceView {
                generation: 3,
                ..placed
            };
            assert_eq!(next_lead("m", Some(&same), 3, soon), NextLead::Wait);
        }
        let fail = |v: Option<&InstanceView>, waited| match next_lead("m", v, 3, waited) {
            NextLead::Fail(why) => why,
            other => panic!("{v:?}: {other:?}"),
        };
        assert!(fail(None, soon).contains("unloaded"));
        assert!(fail(Some(&view("failed", 4, None)), soon).contains("no node has room"));
        assert!(fail(Some(&view("failed", 3, None)), FAILED_GRACE).contains("no node has room"));
        assert!(fail(Some(&view("unloading", 3, None)), soon).contains("unloaded"));
        assert!(fail(Some(&view("loading", 4, None)), RESUME_WAIT).contains("120 s"));
    }
}
