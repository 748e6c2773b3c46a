//! The generation loop: prefill the prompt in large batches, then decode one token at a time
//! until an end-of-generation token, a stop string, or the token limit. Text is streamed to a
//! callback as it becomes final: text that might still turn into a stop string is held back
//! until it cannot.

use std::time::{Duration, Instant};

use crate::kv_cache::KvCache;
use crate::sampler::Sampler;
use crate::transformer::Transformer;
use crate::EngineError;

/// Prompt tokens run in one forward pass at most (bounds the attention scratch memory).
pub const PREFILL_CHUNK: usize = 512;

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

/// What a generation produced and how long it took.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (without the end-of-generation token).
    pub tokens: Vec<u32>,
    /// Generated text, cut before a matched stop string.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens processed.
    pub prompt_tokens: usize,
    /// Time spent on the prompt (up to and including the first sampled token).
    pub prefill_time: Duration,
    /// Time spent generating the remaining tokens.
    pub decode_time: Duration,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tok_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        n as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// How to turn tokens into text during generation, supplied by the caller's tokenizer.
pub trait Detokenizer {
    /// Whether `id` ends generation.
    fn is_eog(&self, id: u32) -> bool;
    /// Feeds one generated token; returns the text that became complete (may be empty while
    /// a multi-byte character is still being assembled).
    fn push(&mut self, id: u32) -> String;
    /// Ends the text: bytes still waiting for the rest of a character become U+FFFD.
    fn finish(&mut self) -> String;
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

/// Settings of one generation.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Strings that end generation (not included in the output).
    pub stop: Vec<String>,
    /// Keep generating through end-of-generation tokens (for benchmarks and tests that need
    /// a fixed length).
    pub ignore_eos: bool,
}

/// What the generation loop runs tokens on: one rank's whole model and its cache
/// ([`Local`]), or a model split over ranks (`parallel::Lead`).
pub trait Stepper {
    /// Positions the sequence's cache holds.
    fn len(&self) -> usize;
    /// Whether the cache is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Most positions the cache can hold.
    fn capacity(&self) -> usize;
    /// Runs `tokens` after what the cache holds and returns the logits of the last one over
    /// the whole vocabulary (a split model may leave tokens the sampler cannot pick at
    /// `-inf`).
    ///
    /// # Errors
    /// When the tokens do not fit or a forward pass fails.
    fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError>;
}

/// A whole model on this rank with the cache of one sequence.
pub struct Local<'a> {
    /// The model.
    pub model: &'a Transformer,
    /// The sequence's cache.
    pub cache: &'a mut KvCache,
}

impl Stepper for Local<'_> {
    fn len(&self) -> usize {
        self.cache.len()
    }

    fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.model.forward_last(tokens, self.cache)
    }
}

/// Runs the prompt (after whatever `cache` already holds) in chunks of [`PREFILL_CHUNK`]
/// tokens and returns the logits of its last position.
///
/// # Errors
/// When the prompt does not fit the cache or a forward pass fails.
pub fn prefill(
    model: &Transformer,
    prompt: &[u32],
    cache: &mut KvCache,
) -> Result<Vec<f32>, EngineError> {
    prefill_on(&mut Local { model, cache }, prompt)
}

/// [`prefill`] on any [`Stepper`].
///
/// # Errors
/// When the prompt does not fit the cache or a forward pass fails.
pub fn prefill_on(stepper: &mut dyn Stepper, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Unsupported {
            what: "an empty prompt (no tokens to condition on)".into(),
        });
    }
    if stepper.len() + prompt.len() > stepper.capacity() {
        return Err(EngineError::ContextFull {
            prompt: stepper.len() + prompt.len(),
            ctx: stepper.capacity(),
        });
    }
    let mut logits = Vec::new();
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        logits = stepper.step(chunk)?;
    }
    Ok(logits)
}

/// Generates from `prompt`, calling `on_text` with each piece of final text; `on_text`
/// returns `false` to cancel.
///
/// # Errors
/// When the prompt does not fit or a forward pass fails.
pub fn generate(
    model: &Transformer,
    prompt: &[u32],
    cache: &mut KvCache,
    sampler: &mut Sampler,
    detok: &mut dyn Detokenizer,
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation, EngineError> {
    generate_on(
        &mut Local { model, cache },
        prompt,
        sampler,
        detok,
        params,
        on_text,
    )
}

/// [`generate`] on any [`Stepper`].
///
/// # Errors
/// When the prompt does not fit or a forward pass fails.
pub fn generate_on(
    stepper: &mut dyn Stepper,
    prompt: &[u32],
    sampler: &mut Sampler,
    detok: &mut dyn Detokenizer,
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation, EngineError> {
    let start = Instant::now();
    sampler.observe(prompt);
    let mut logits = prefill_on(stepper, prompt)?;
    let mut stops = StopMatcher::new(&params.stop);
    let mut out = Generation {
        tokens: Vec::new(),
        text: String::new(),
        finish: FinishReason::Length,
        prompt_tokens: prompt.len(),
        prefill_time: Duration::ZERO,
        decode_time: Duration::ZERO,
    };
    let mut decode_start = None;
    while out.tokens.len() < params.max_tokens {
        let id = sampler.sample(&mut logits);
        if decode_start.is_none() {
            out.prefill_time = start.elapsed();
            decode_start = Some(Instant::now());
        }
        if detok.is_eog(id) && !params.ignore_eos {
            out.finish = FinishReason::Stop;
            break;
        }
        out.tokens.push(id);
        let (text, matched) = stops.push(&detok.push(id));
        out.text.push_str(&text);
        if !text.is_empty() && !on_text(&text) {
            out.finish = FinishReason::Cancelled;
            break;
        }
        if matched {
            out.finish = FinishReason::Stop;
            break;
        }
        if out.tokens.len() == params.max_tokens || stepper.len() >= stepper.capacity() {
            break;
        }
        logits = stepper.step(&[id])?;
    }
    if stops.matched().is_none() {
        // What the stop matcher held back (it did not become a stop string), then an
        // unfinished character; as the server's scheduler ends a sequence. After a stop
        // string nothing more is text.
        let rest = stops.finish() + &detok.finish();
        if !rest.is_empty() {
            out.text.push_str(&rest);
            on_text(&rest);
        }
    }
    if let Some(d) = decode_start {
        out.decode_time = d.elapsed();
    } else {
        out.prefill_time = start.elapsed();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerConfig;

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

    /// Logits that make greedy sampling pick the scripted tokens in turn.
    struct Script {
        tokens: Vec<u32>,
        len: usize,
    }

    impl Stepper for Script {
        fn len(&self) -> usize {
            self.len
        }
        fn capacity(&self) -> usize {
            64
        }
        fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
            self.len += tokens.len();
            let mut logits = vec![0.0; 4];
            let next = self.tokens.get(self.len - 1).copied().unwrap_or(3);
            logits[next as usize] = 1.0;
            Ok(logits)
        }
    }

    /// Token 0 is "a #", 1 is the first byte of "é", 2 is "###", 3 ends generation.
    struct Bytes(Vec<u8>);

    impl Detokenizer for Bytes {
        fn is_eog(&self, id: u32) -> bool {
            id == 3
        }
        fn push(&mut self, id: u32) -> String {
            match id {
                0 => "a #".into(),
                1 => {
                    self.0.push("é".as_bytes()[0]);
                    String::new()
                }
                _ => "###".into(),
            }
        }
        fn finish(&mut self) -> String {
            let s = String::from_utf8_lossy(&self.0).into_owned();
            self.0.clear();
            s
        }
    }

    fn run(script: &[u32], max_tokens: usize) -> Generation {
        let mut stepper = Script {
            tokens: script.to_vec(),
            len: 0,
        };
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        });
        let params = GenerateParams {
            max_tokens,
            stop: vec!["###".into()],
            ignore_eos: false,
        };
        let mut streamed = String::new();
        let out = generate_on(
            &mut stepper,
            &[0],
            &mut sampler,
            &mut Bytes(Vec::new()),
            &params,
            &mut |t| {
                streamed.push_str(t);
                true
            },
        )
        .unwrap();
        assert_eq!(streamed, out.text, "what was streamed is the text");
        out
    }

    #[test]
    fn text_held_back_is_not_lost_at_the_end() {
        // the end of generation after "a #": the "#" held back as a possible "###" is text
        let out = run(&[0, 3], 8);
        assert_eq!((out.text.as_str(), out.finish), ("a #", FinishReason::Stop));
        // an unfinished character at the length limit, or before the end token, is U+FFFD
        let out = run(&[0, 1], 2);
        assert_eq!(
            (out.text.as_str(), out.finish),
            ("a #\u{FFFD}", FinishReason::Length)
        );
        let out = run(&[0, 1, 3], 8);
        assert_eq!(out.text, "a #\u{FFFD}");
        // after a stop string nothing more is text
        let out = run(&[0, 1, 2], 8);
        assert_eq!((out.text.as_str(), out.finish), ("a ", FinishReason::Stop));
    }

    #[test]
    fn stop_matcher_handles_multibyte() {
        let mut m = StopMatcher::new(&["é!".into()]);
        assert_eq!(m.push("caf"), ("caf".into(), false));
        assert_eq!(m.push("é"), (String::new(), false));
        assert_eq!(m.push("!x"), (String::new(), true));
    }
}
