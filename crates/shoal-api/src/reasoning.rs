//! A thinking model's reasoning, apart from its answer. Qwen3, DeepSeek R1 and V3.1, GLM 4.5+
//! and Kimi K2 Thinking write their reasoning between `<think>` and `</think>` before the
//! answer, or their chat template's generation prompt opens the block and the model only
//! closes it; gpt-oss writes harmony channels instead ([`crate::harmony`]).
//! [`ReasoningFormat::detect`] tells such a model by its template;
//! [`Thinking`] is what a request asks (on, off, an effort) and becomes the template's
//! switches (`enable_thinking`, `thinking`, `reasoning_effort`); [`settle_prompt`] makes a
//! rendered prompt agree with that for templates without a switch, and says whether the
//! output starts inside the reasoning; [`ReasoningSplitter`] cuts `<think>` output, as it
//! streams, into reasoning and answer text, holding back only what could still be a tag, and
//! [`OutputSplitter`] is whichever splitter the model's format needs. [`ReasoningBudget`]
//! holds `<think>` reasoning to a number of tokens (Anthropic's `budget_tokens`), closing the
//! block for the model when they are spent.

use std::collections::VecDeque;

use serde_json::{Map, Value};
use shoal_engine::scheduler::TokenConstraint;
use shoal_engine::EngineError;

use crate::harmony::HarmonySplitter;
use crate::tools::longest_prefix_suffix;

/// The tag that opens a reasoning block.
pub const OPEN: &str = "<think>";
/// The tag that closes it.
pub const CLOSE: &str = "</think>";

/// How a model family marks its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// No reasoning markup: all output is the answer.
    None,
    /// `<think>...</think>` before the answer.
    ThinkTags,
    /// gpt-oss's harmony channels (`analysis` before `final`).
    Harmony,
}

impl ReasoningFormat {
    /// The format a chat template's model reasons in: a template that handles `</think>` in
    /// the turns it renders belongs to a model that writes it.
    pub fn detect(chat_template: &str) -> ReasoningFormat {
        if chat_template.contains("<|channel|>analysis") {
            ReasoningFormat::Harmony
        } else if chat_template.contains(CLOSE) {
            ReasoningFormat::ThinkTags
        } else {
            ReasoningFormat::None
        }
    }
}

/// What a request asks about thinking.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Thinking {
    /// On or off; `None`: on, for a model that reasons.
    pub enabled: Option<bool>,
    /// An effort level for templates that read one (`reasoning_effort`: low, medium, high).
    pub effort: Option<String>,
    /// Keyword arguments the client gave the template itself (`chat_template_kwargs`); they
    /// win over the switches derived from `enabled`.
    pub template_args: Map<String, Value>,
    /// Most tokens of reasoning (see [`ReasoningBudget`]).
    pub budget: Option<usize>,
}

impl Thinking {
    /// Whether the model should reason: the client's template argument `enable_thinking` (or
    /// `thinking`) when it gave one, else `enabled`, else yes.
    pub fn wanted(&self) -> bool {
        ["enable_thinking", "thinking"]
            .iter()
            .find_map(|k| self.template_args.get(*k).and_then(Value::as_bool))
            .or(self.enabled)
            .unwrap_or(true)
    }

    /// The template's keyword arguments for a model of `format`: the client's own, and for a
    /// model that reasons the switches its family's templates read (`enable_thinking` for
    /// Qwen3 and GLM, `thinking` for DeepSeek V3.1, `reasoning_effort` for gpt-oss).
    pub fn template_args(&self, format: ReasoningFormat) -> Option<Value> {
        let mut args = Map::new();
        if format != ReasoningFormat::None {
            let on = Value::Bool(self.wanted());
            args.insert("enable_thinking".into(), on.clone());
            args.insert("thinking".into(), on);
            match (&self.effort, format) {
                (Some(e), _) => {
                    args.insert("reasoning_effort".into(), Value::String(e.clone()));
                }
                // gpt-oss always reasons: off is its least effort, and an empty analysis
                (None, ReasoningFormat::Harmony) if !self.wanted() => {
                    args.insert("reasoning_effort".into(), Value::String("low".into()));
                }
                _ => {}
            }
        }
        args.extend(self.template_args.clone());
        (!args.is_empty()).then_some(Value::Object(args))
    }
}

/// Makes the rendered prompt `text` of a model of `format` agree with whether it should
/// reason (`wanted`), for templates without a switch: when reasoning is off, an open block
/// is closed, or an empty one written, so the model answers at once. Returns whether the
/// output starts inside a reasoning block the prompt opened.
pub fn settle_prompt(text: &mut String, format: ReasoningFormat, wanted: bool) -> bool {
    match format {
        ReasoningFormat::None => return false,
        ReasoningFormat::Harmony => {
            // an empty analysis message: the model goes on in another channel
            if !wanted && text.trim_end().ends_with("<|start|>assistant") {
                text.push_str("<|channel|>analysis<|message|><|end|><|start|>assistant");
            }
            return false;
        }
        ReasoningFormat::ThinkTags => {}
    }
    let tail = text.trim_end();
    if tail.ends_with(OPEN) {
        if wanted {
            return true;
        }
        text.push_str(CLOSE);
    } else if !wanted && !tail.ends_with(CLOSE) {
        text.push_str(OPEN);
        text.push_str(CLOSE);
    }
    false
}

/// Where a [`ReasoningBudget`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Budget {
    /// Waiting for the model to open a block (within its first tokens).
    Before,
    /// Inside the block, counting.
    Counting,
    /// Spent: writing the closing tokens, this many done.
    Closing(usize),
    /// The block is over (or never opened): nothing more to do.
    Over,
}

/// Tokens a model has to open a reasoning block before a budget stops watching for one.
const OPEN_WITHIN: usize = 8;

/// Holds `<think>` reasoning to `budget` tokens: it counts the tokens inside the block (from
/// the start when the prompt opened it, else from the model's own opening tag) and, when they
/// are spent before the model closed the block, allows only the tokens that close it, then
/// everything again. Closing and opening tags are recognised as their tokens (`</think>` is
/// one special token in the families that use it).
#[derive(Debug)]
pub struct ReasoningBudget {
    state: Budget,
    left: usize,
    open: Vec<u32>,
    close: Vec<u32>,
    /// What is written for the model when the budget is spent (`\n</think>\n\n`).
    closing: Vec<u32>,
    recent: VecDeque<u32>,
    seen: usize,
}

impl ReasoningBudget {
    /// A budget of `budget` tokens for output that starts inside a block (`inside`) or may
    /// open one; `open`, `close` and `closing` are the tokens of `<think>`, `</think>` and
    /// what closes the block when the budget is spent.
    pub fn new(
        budget: usize,
        inside: bool,
        open: Vec<u32>,
        close: Vec<u32>,
        closing: Vec<u32>,
    ) -> Self {
        ReasoningBudget {
            state: if inside {
                Budget::Counting
            } else {
                Budget::Before
            },
            left: budget,
            open,
            close,
            closing,
            recent: VecDeque::new(),
            seen: 0,
        }
    }

    fn ends_with(&self, tag: &[u32]) -> bool {
        !tag.is_empty()
            && self.recent.len() >= tag.len()
            && self
                .recent
                .iter()
                .skip(self.recent.len() - tag.len())
                .eq(tag.iter())
    }
}

impl TokenConstraint for ReasoningBudget {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError> {
        if self.state == Budget::Counting && self.left == 0 {
            self.state = Budget::Closing(0);
        }
        if let Budget::Closing(i) = self.state {
            let want = self.closing[i] as usize;
            if want >= logits.len() {
                self.state = Budget::Over;
                return Ok(());
            }
            for (t, l) in logits.iter_mut().enumerate() {
                if t != want {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), EngineError> {
        self.seen += 1;
        self.recent.push_back(token);
        let keep = self.open.len().max(self.close.len());
        while self.recent.len() > keep {
            self.recent.pop_front();
        }
        self.state = match self.state {
            Budget::Before if self.ends_with(&self.open) => Budget::Counting,
            Budget::Before if self.seen >= OPEN_WITHIN => Budget::Over,
            Budget::Counting if self.ends_with(&self.close) => Budget::Over,
            Budget::Counting => {
                self.left = self.left.saturating_sub(1);
                Budget::Counting
            }
            Budget::Closing(i) if i + 1 >= self.closing.len() => Budget::Over,
            Budget::Closing(i) => Budget::Closing(i + 1),
            s => s,
        };
        Ok(())
    }

    fn is_finished(&self) -> bool {
        false
    }
}

/// A piece of output, sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Answer(String),
    /// A tool call written in the reasoning format's own markup (harmony's).
    Call {
        /// The function's name.
        name: String,
        /// Its arguments (a JSON object).
        arguments: Value,
    },
}

/// The splitter of a model's reasoning format.
#[derive(Debug, Clone)]
pub enum OutputSplitter {
    /// `<think>` blocks.
    Think(ReasoningSplitter),
    /// harmony channels.
    Harmony(HarmonySplitter),
}

impl OutputSplitter {
    /// The splitter for `format` (none for a model that does not reason): `inside` when the
    /// prompt opened a block, `known_tools` the calls harmony may make.
    pub fn for_format(format: ReasoningFormat, inside: bool, known_tools: &[&str]) -> Option<Self> {
        match format {
            ReasoningFormat::None => None,
            ReasoningFormat::ThinkTags => {
                Some(OutputSplitter::Think(ReasoningSplitter::new(inside)))
            }
            ReasoningFormat::Harmony => {
                Some(OutputSplitter::Harmony(HarmonySplitter::new(known_tools)))
            }
        }
    }

    /// Whether the output is inside the reasoning.
    pub fn in_reasoning(&self) -> bool {
        match self {
            OutputSplitter::Think(s) => s.in_reasoning(),
            OutputSplitter::Harmony(s) => s.in_reasoning(),
        }
    }

    /// Feeds the next piece of output; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        match self {
            OutputSplitter::Think(s) => s.push(text),
            OutputSplitter::Harmony(s) => s.push(text),
        }
    }

    /// Ends the output, releasing what was held back.
    pub fn finish(self) -> Vec<Segment> {
        match self {
            OutputSplitter::Think(s) => s.finish(),
            OutputSplitter::Harmony(s) => s.finish(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the output may still open a block.
    Opening,
    /// Inside the block; `started` once its first non-blank text came.
    Inside { started: bool },
    /// After the closing tag, before the answer's first non-blank text.
    Closing,
    /// The answer.
    Answer,
}

/// Cuts streamed output into reasoning and answer text. The blank lines around the tags are
/// dropped (templates write them again when they render a turn); text that could still be
/// part of a tag, and blanks that may come before the closing tag, are held back until they
/// cannot.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    buf: String,
}

impl ReasoningSplitter {
    /// A splitter for output that starts inside a block the prompt opened (`inside`), or
    /// that may open one itself.
    pub fn new(inside: bool) -> Self {
        ReasoningSplitter {
            state: if inside {
                State::Inside { started: false }
            } else {
                State::Opening
            },
            buf: String::new(),
        }
    }

    /// Whether the output is (still) inside the reasoning.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Inside { .. })
    }

    /// Feeds the next piece of output; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Opening => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Inside { started: false };
                    } else if OPEN.starts_with(t) {
                        return out;
                    } else {
                        self.buf = t.to_string();
                        self.state = State::Answer;
                    }
                }
                State::Inside { started } => {
                    if !started {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            return out;
                        }
                        self.buf = t.to_string();
                        self.state = State::Inside { started: true };
                    }
                    if let Some(at) = self.buf.find(CLOSE) {
                        let reasoning = self.buf[..at].trim_end();
                        if !reasoning.is_empty() {
                            out.push(Segment::Reasoning(reasoning.to_string()));
                        }
                        self.buf = self.buf[at + CLOSE.len()..].to_string();
                        self.state = State::Closing;
                        continue;
                    }
                    let held = self.buf.len() - longest_prefix_suffix(&self.buf, CLOSE);
                    let release = self.buf[..held].trim_end().len();
                    if release > 0 {
                        out.push(Segment::Reasoning(self.buf[..release].to_string()));
                        self.buf.drain(..release);
                    }
                    return out;
                }
                State::Closing => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        self.buf.clear();
                        return out;
                    }
                    self.buf = t.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    if !self.buf.is_empty() {
                        out.push(Segment::Answer(std::mem::take(&mut self.buf)));
                    }
                    return out;
                }
            }
        }
    }

    /// Ends the output: what was held back is released (a block never closed is all
    /// reasoning; a start that never became a tag is answer).
    pub fn finish(mut self) -> Vec<Segment> {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Inside { .. } if !rest.trim().is_empty() => {
                vec![Segment::Reasoning(rest.trim_end().to_string())]
            }
            State::Opening | State::Answer if !rest.trim().is_empty() => {
                vec![Segment::Answer(rest.trim_start().to_string())]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `pieces` and returns all reasoning and all answer text, checking that no
    /// reasoning comes after answer text.
    fn split(inside: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(inside);
        let mut segs = Vec::new();
        for p in pieces {
            segs.extend(s.push(p));
        }
        segs.extend(s.finish());
        let (mut r, mut a) = (String::new(), String::new());
        for seg in segs {
            match seg {
                Segment::Reasoning(t) => {
                    assert!(a.is_empty(), "reasoning after the answer: {t:?}");
                    r.push_str(&t)
                }
                Segment::Answer(t) => a.push_str(&t),
                Segment::Call { .. } => panic!("no calls in <think> output"),
            }
        }
        (r, a)
    }

    /// Every way of cutting `text` into pieces of `n` bytes (on character boundaries).
    fn pieces(text: &str, n: usize) -> Vec<&str> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            out.push(&rest[..k]);
            rest = &rest[k..];
        }
        out
    }

    #[test]
    fn reasoning_and_answer_come_apart_however_the_text_is_cut() {
        let text = "<think>\nThe user wants 2+2.\n\nThat is 4 (not </thin or <think>).\n</think>\n\nIt is **4**.";
        for n in 1..=text.len() {
            let (r, a) = split(false, &pieces(text, n));
            assert_eq!(
                r, "The user wants 2+2.\n\nThat is 4 (not </thin or <think>).",
                "{n}"
            );
            assert_eq!(a, "It is **4**.", "{n}");
        }
        // a block the prompt opened
        let text = "\nOkay, 4.\n</think>\n\nFour.";
        for n in 1..=text.len() {
            assert_eq!(
                split(true, &pieces(text, n)),
                ("Okay, 4.".into(), "Four.".into())
            );
        }
    }

    #[test]
    fn output_without_a_block_is_all_answer_and_a_block_never_closed_all_reasoning() {
        assert_eq!(
            split(false, &["  Hello", " <think>x"]),
            ("".into(), "Hello <think>x".into())
        );
        assert_eq!(split(false, &["<th"]), ("".into(), "<th".into()));
        assert_eq!(
            split(false, &["<", "b>bold"]),
            ("".into(), "<b>bold".into())
        );
        assert_eq!(
            split(true, &["cut off mid-thou", "ght </thi"]),
            ("cut off mid-thought </thi".into(), "".into())
        );
        assert_eq!(
            split(false, &["<think>\n\n</think>\n\nHi"]),
            ("".into(), "Hi".into())
        );
        assert_eq!(split(false, &[]), ("".into(), "".into()));
    }

    #[test]
    fn text_is_released_as_soon_as_it_cannot_be_a_tag() {
        let mut s = ReasoningSplitter::new(true);
        assert_eq!(s.push("Step one"), [Segment::Reasoning("Step one".into())]);
        assert!(s.in_reasoning());
        assert_eq!(s.push(".\n</"), [Segment::Reasoning(".".into())]);
        assert_eq!(s.push("think>"), []);
        assert!(!s.in_reasoning());
        assert_eq!(s.push("\n\nDone"), [Segment::Answer("Done".into())]);
        assert_eq!(s.push(" é"), [Segment::Answer(" é".into())]);
    }

    #[test]
    fn switches_follow_the_request_and_the_clients_own_arguments_win() {
        let t = Thinking::default();
        assert!(t.wanted());
        assert_eq!(t.template_args(ReasoningFormat::None), None);
        assert_eq!(
            t.template_args(ReasoningFormat::ThinkTags),
            Some(json!({"enable_thinking": true, "thinking": true}))
        );
        let off = Thinking {
            enabled: Some(false),
            effort: Some("low".into()),
            ..Thinking::default()
        };
        assert!(!off.wanted());
        assert_eq!(
            off.template_args(ReasoningFormat::ThinkTags),
            Some(json!({"enable_thinking": false, "thinking": false, "reasoning_effort": "low"}))
        );
        let mut client = Thinking::default();
        client
            .template_args
            .insert("enable_thinking".into(), json!(false));
        assert!(!client.wanted());
        assert_eq!(
            client.template_args(ReasoningFormat::None),
            Some(json!({"enable_thinking": false}))
        );
    }

    #[test]
    fn a_spent_budget_closes_the_block_and_then_lets_everything_through() {
        // tokens: 1 = <think>, 2 = </think>, 3 = "\n", 4.. = words
        let allowed = |b: &mut ReasoningBudget| {
            let mut l = [0.0f32; 10];
            b.mask(&mut l).unwrap();
            l.iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, _)| i as u32)
                .collect::<Vec<_>>()
        };
        let mut b = ReasoningBudget::new(3, false, vec![1], vec![2], vec![3, 2, 3]);
        for t in [1, 5, 6] {
            assert_eq!(allowed(&mut b).len(), 10);
            b.commit(t).unwrap();
        }
        assert_eq!(allowed(&mut b).len(), 10, "one token left");
        b.commit(7).unwrap();
        for want in [3, 2, 3] {
            assert_eq!(allowed(&mut b), [want]);
            b.commit(want).unwrap();
        }
        assert_eq!(allowed(&mut b).len(), 10, "the answer is free");
        // a model that closes the block itself in time is never held
        let mut b = ReasoningBudget::new(2, true, vec![1], vec![2], vec![3, 2, 3]);
        b.commit(5).unwrap();
        b.commit(2).unwrap();
        for t in [5, 6, 7, 8] {
            assert_eq!(allowed(&mut b).len(), 10);
            b.commit(t).unwrap();
        }
        // a model that answers without a block is never held
        let mut b = ReasoningBudget::new(1, false, vec![1], vec![2], vec![3, 2, 3]);
        for t in 0..20 {
            assert_eq!(allowed(&mut b).len(), 10);
            b.commit(4 + t % 5).unwrap();
        }
        assert!(!b.is_finished());
    }

    #[test]
    fn prompts_without_a_switch_are_settled() {
        let settle = |p: &str, wanted| {
            let mut s = p.to_string();
            let inside = settle_prompt(&mut s, ReasoningFormat::ThinkTags, wanted);
            (s, inside)
        };
        // DeepSeek V3.1 and R1 open the block in the generation prompt
        assert_eq!(
            settle("<｜Assistant｜><think>\n", true),
            ("<｜Assistant｜><think>\n".into(), true)
        );
        assert_eq!(
            settle("<｜Assistant｜><think>\n", false),
            ("<｜Assistant｜><think>\n</think>".into(), false)
        );
        // Qwen3 and GLM with the switch off already wrote an empty block
        let closed = "assistant\n<think>\n\n</think>\n\n";
        assert_eq!(settle(closed, false), (closed.to_string(), false));
        // Kimi K2 Thinking has no switch: an empty block is written
        assert_eq!(
            settle("<|im_middle|>", false),
            ("<|im_middle|><think></think>".into(), false)
        );
        assert_eq!(
            settle("<|im_middle|>", true),
            ("<|im_middle|>".into(), false)
        );
        let mut plain = "assistant\n".to_string();
        assert!(!settle_prompt(&mut plain, ReasoningFormat::None, false));
        assert_eq!(plain, "assistant\n");
    }
}
