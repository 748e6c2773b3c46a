//! gpt-oss's harmony output: a run of messages, each a header up to `<|message|>` naming its
//! channel (and, for a tool call, its recipient) and a body up to `<|end|>`, `<|call|>` or
//! `<|return|>`, the next one starting with `<|start|>assistant`:
//!
//! ```text
//! <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
//! <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
//! ```
//!
//! [`HarmonySplitter`] maps the channels to the APIs' parts as the text streams: `analysis`
//! is reasoning, `final` (and `commentary` without a recipient, a preamble the user sees) is
//! the answer, and a message to `functions.NAME` is a call of NAME with its JSON body as the
//! arguments (a call of a tool that was not offered, or whose body is not a JSON object, is
//! released as answer text, never lost).

use serde_json::Value;

use crate::reasoning::Segment;
use crate::tools::longest_prefix_suffix;

const MESSAGE: &str = "<|message|>";
const CHANNEL: &str = "<|channel|>";
const START: &str = "<|start|>";
/// The tags that end a message body.
const ENDS: [&str; 3] = ["<|end|>", "<|call|>", "<|return|>"];

/// Where a message goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Body {
    Reasoning,
    Answer,
    /// A call of this function: the body is held until it ends.
    Call(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Reading a header up to `<|message|>`.
    Header,
    /// Inside a body.
    Body(Body),
}

/// Cuts harmony output into reasoning, answer and calls as it streams.
#[derive(Debug, Clone)]
pub struct HarmonySplitter {
    state: State,
    buf: String,
    known: Vec<String>,
}

/// Where a message with `header` goes.
fn body_of(header: &str) -> Body {
    let channel = header
        .split(CHANNEL)
        .nth(1)
        .and_then(|c| c.split_whitespace().next())
        .unwrap_or("");
    let recipient = header
        .split_whitespace()
        .find_map(|w| w.strip_prefix("to="))
        .map(|r| r.split(CHANNEL).next().unwrap_or(r));
    match (channel, recipient) {
        (_, Some(r)) if r.starts_with("functions.") => {
            Body::Call(r["functions.".len()..].to_string())
        }
        ("analysis", _) => Body::Reasoning,
        _ => Body::Answer,
    }
}

impl HarmonySplitter {
    /// A splitter for output that follows `<|start|>assistant`, accepting calls of
    /// `known_tools`.
    pub fn new(known_tools: &[&str]) -> Self {
        HarmonySplitter {
            state: State::Header,
            buf: String::new(),
            known: known_tools.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Whether the output is inside reasoning (or a header that may begin it).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Body(Body::Reasoning))
    }

    /// Feeds the next piece of output; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state.clone() {
                State::Header => {
                    let Some(at) = self.buf.find(MESSAGE) else {
                        return out;
                    };
                    let header = self.buf[..at].to_string();
                    self.buf.drain(..at + MESSAGE.len());
                    self.state = State::Body(body_of(&header));
                }
                State::Body(body) => {
                    let end = ENDS
                        .iter()
                        .filter_map(|t| self.buf.find(t).map(|at| (at, t.len())))
                        .min();
                    match end {
                        Some((at, len)) => {
                            let text = self.buf[..at].to_string();
                            self.buf.drain(..at + len);
                            self.release(&body, text, &mut out);
                            // the next message's role, if written, is part of its header
                            self.state = State::Header;
                            if let Some(rest) = self.buf.strip_prefix(START) {
                                self.buf = rest.to_string();
                            }
                        }
                        None if matches!(body, Body::Call(_)) => return out,
                        None => {
                            let keep = ENDS
                                .iter()
                                .map(|t| longest_prefix_suffix(&self.buf, t))
                                .max()
                                .unwrap_or(0);
                            let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                            self.release(&body, text, &mut out);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Ends the output (the last message's end tag is often the end-of-generation token,
    /// which is not text): its body is released as it is.
    pub fn finish(mut self) -> Vec<Segment> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.state.clone() {
            State::Body(body) => self.release(&body, rest, &mut out),
            State::Header if !rest.trim().is_empty() && !rest.contains(CHANNEL) => {
                // not harmony at all: the model wrote plain text
                out.push(Segment::Answer(rest));
            }
            State::Header => {}
        }
        out
    }

    fn release(&self, body: &Body, text: String, out: &mut Vec<Segment>) {
        let segment = match body {
            Body::Reasoning if !text.is_empty() => Segment::Reasoning(text),
            Body::Answer if !text.is_empty() => Segment::Answer(text),
            Body::Call(name) => {
                let args = serde_json::from_str::<Value>(text.trim()).ok();
                match args {
                    Some(arguments)
                        if arguments.is_object() && self.known.iter().any(|k| k == name) =>
                    {
                        Segment::Call {
                            name: name.clone(),
                            arguments,
                        }
                    }
                    _ => Segment::Answer(format!("to=functions.{name} {text}")),
                }
            }
            _ => return,
        };
        match (out.last_mut(), &segment) {
            (Some(Segment::Reasoning(a)), Segment::Reasoning(b))
            | (Some(Segment::Answer(a)), Segment::Answer(b)) => a.push_str(b),
            _ => out.push(segment),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(text: &str, n: usize) -> Vec<Segment> {
        let mut s = HarmonySplitter::new(&["get_weather"]);
        let mut out: Vec<Segment> = Vec::new();
        let mut rest = text;
        let add = |segs: Vec<Segment>, out: &mut Vec<Segment>| {
            for seg in segs {
                match (out.last_mut(), &seg) {
                    (Some(Segment::Reasoning(a)), Segment::Reasoning(b))
                    | (Some(Segment::Answer(a)), Segment::Answer(b)) => a.push_str(b),
                    _ => out.push(seg),
                }
            }
        };
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            add(s.push(&rest[..k]), &mut out);
            rest = &rest[k..];
        }
        add(s.finish(), &mut out);
        out
    }

    #[test]
    fn channels_become_reasoning_answer_and_calls_however_the_text_is_cut() {
        let answer = "<|channel|>analysis<|message|>User asks 2+2. That is 4.<|end|><|start|>assistant<|channel|>final<|message|>It is **4** <|é|>.";
        let call = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
        let recipient_first = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}";
        for n in 1..=call.len() {
            assert_eq!(
                run(answer, n),
                [
                    Segment::Reasoning("User asks 2+2. That is 4.".into()),
                    Segment::Answer("It is **4** <|é|>.".into())
                ],
                "{n}"
            );
            for text in [call, recipient_first] {
                assert_eq!(
                    run(text, n),
                    [
                        Segment::Reasoning("Need weather.".into()),
                        Segment::Call {
                            name: "get_weather".into(),
                            arguments: json!({"city": "Paris"})
                        }
                    ],
                    "{n}: {text}"
                );
            }
        }
    }

    #[test]
    fn preambles_are_answer_and_bad_calls_are_text() {
        let preamble = "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{\"city\": \"Oslo\"}";
        assert_eq!(
            run(preamble, 5),
            [
                Segment::Answer("Let me check.".into()),
                Segment::Call {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Oslo"})
                }
            ]
        );
        let unknown = "<|channel|>commentary to=functions.nope json<|message|>{}<|call|>";
        assert_eq!(
            run(unknown, 3),
            [Segment::Answer("to=functions.nope {}".into())]
        );
        let broken = "<|channel|>commentary to=functions.get_weather json<|message|>{\"city\"";
        assert_eq!(
            run(broken, 3),
            [Segment::Answer("to=functions.get_weather {\"city\"".into())]
        );
        assert_eq!(
            run("plain words", 4),
            [Segment::Answer("plain words".into())]
        );
    }
}
