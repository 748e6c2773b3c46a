//! What a request asked for that this server leaves out instead of failing the request.
//!
//! Coding agents send more than a local model can use: hosted tools the provider would run
//! itself (web search, code execution), reasoning controls, context-management edits, cache
//! hints, images for a text-only model. Rejecting the request for any of these would make the
//! agent unusable, so the adapters decline them one by one into a [`Declined`] note. The note
//! becomes one log line per request and two response headers (`x-shoal-declined-tools`,
//! `x-shoal-ignored`), so a client, or the person reading its log, can see exactly what was
//! left out.

use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;

/// The header naming the hosted tools a request offered that this server cannot run.
pub const DECLINED_TOOLS_HEADER: &str = "x-shoal-declined-tools";
/// The header naming the request fields and content this server ignored.
pub const IGNORED_HEADER: &str = "x-shoal-ignored";

/// What stands in for an image, audio, a document or a file a text-only model cannot read.
pub const OMITTED: &str = "[an attachment was left out here: this model reads text only]";

/// Longest name kept for a header (client-chosen names are cut, never echoed whole).
const NAME_CHARS: usize = 64;
/// Most names listed in one header.
const NAMES: usize = 16;

/// The tools declined and the fields ignored while reading one request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Declined {
    /// Hosted tools (by name or type) left out of the tools the model sees.
    pub tools: Vec<String>,
    /// Request fields or content kinds ignored (`thinking`, `image blocks`, ...).
    pub ignored: Vec<String>,
}

/// `s` as a short, printable ASCII name for a header or a log line.
fn clean(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(NAME_CHARS)
        .collect()
}

fn push_once(list: &mut Vec<String>, what: &str) {
    let what = clean(what);
    if list.len() < NAMES && !list.contains(&what) {
        list.push(what);
    }
}

impl Declined {
    /// Notes a hosted tool (its name, or its type when it has none) left out.
    pub fn tool(&mut self, name: &str) {
        push_once(&mut self.tools, name);
    }

    /// Notes a field or content kind ignored.
    pub fn ignore(&mut self, what: &str) {
        push_once(&mut self.ignored, what);
    }

    /// Whether nothing was declined.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty() && self.ignored.is_empty()
    }

    /// Logs what was declined for `route` (once per request) and adds the headers to `resp`.
    pub fn apply(&self, route: &str, resp: &mut Response) {
        if self.is_empty() {
            return;
        }
        tracing::info!(
            route,
            declined_tools = ?self.tools,
            ignored = ?self.ignored,
            "served the request without what this server cannot do here"
        );
        for (name, list) in [
            (DECLINED_TOOLS_HEADER, &self.tools),
            (IGNORED_HEADER, &self.ignored),
        ] {
            if list.is_empty() {
                continue;
            }
            if let Ok(v) = HeaderValue::from_str(&list.join(", ")) {
                resp.headers_mut().insert(HeaderName::from_static(name), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[test]
    fn names_are_cut_listed_once_and_become_headers() {
        let mut d = Declined::default();
        d.tool("web_search");
        d.tool("web_search");
        d.tool(&"x".repeat(500));
        d.ignore("thinking\r\nInjected: 1");
        let mut resp = ().into_response();
        d.apply("/v1/messages", &mut resp);
        let tools = resp.headers()[DECLINED_TOOLS_HEADER].to_str().unwrap();
        assert_eq!(tools, format!("web_search, {}", "x".repeat(NAME_CHARS)));
        assert_eq!(
            resp.headers()[IGNORED_HEADER].to_str().unwrap(),
            "thinkingInjected: 1"
        );
        for i in 0..100 {
            d.ignore(&format!("f{i}"));
        }
        assert_eq!(d.ignored.len(), NAMES);
    }

    #[test]
    fn nothing_declined_adds_no_header() {
        let mut resp = ().into_response();
        Declined::default().apply("/v1/responses", &mut resp);
        assert!(resp.headers().get(DECLINED_TOOLS_HEADER).is_none());
        assert!(resp.headers().get(IGNORED_HEADER).is_none());
    }
}
