//! How a generation ends: the reasons ([`FinishReason`]) and the stop-string matcher the
//! scheduler runs streamed text through ([`StopMatcher`]), which holds back text that might
//! still turn into a stop string until it cannot.

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-generation token, or a stop string matched.
    Stop,
    /// The token limit was reached.
    Length,
    /// The caller's callback asked to stop (e.g. the client went away).
    Cancelled,
}

/// Holds back the tail of the text that could be the start of a stop string.
#[derive(Debug, Default)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub(crate) fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// The stop string that matched, if one did.
    pub(crate) fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Adds `text`; returns (text safe to emit, whether a stop string matched).
    pub(crate) fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), false);
        }
        if let Some((at, i)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min()
        {
            self.matched = Some(i);
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // keep the longest suffix that is a prefix of some stop string
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_matcher_holds_back_partial_matches() {
        let mut m = StopMatcher::new(&["</end>".into()]);
        assert_eq!(m.push("hello <"), ("hello ".into(), false));
        assert_eq!(m.push("/en"), (String::new(), false));
        assert_eq!(m.push("d> tail"), (String::new(), true));
        assert_eq!(m.matched(), Some("</end>"));
        let mut m = StopMatcher::new(&["</end>".into()]);
        assert_eq!(m.push("a <b"), ("a <b".into(), false));
        assert_eq!(m.push(" <"), (" ".into(), false));
        assert_eq!(m.finish(), "<");
    }

    #[test]
    fn stop_matcher_handles_multibyte() {
        let mut m = StopMatcher::new(&["é!".into()]);
        assert_eq!(m.push("caf"), ("caf".into(), false));
        assert_eq!(m.push("é"), (String::new(), false));
        assert_eq!(m.push("!x"), (String::new(), true));
    }
}
