//! Incremental detokenization for streaming: tokens arrive one at a time, and a character
//! split across tokens (an emoji spelled as four byte tokens) must not be sent half-done.
//!
//! [`StreamDecoder`] keeps the bytes of an unfinished UTF-8 sequence until the next token
//! completes it and hands out only whole characters. Bytes that can never form a character
//! become U+FFFD, exactly as [`String::from_utf8_lossy`] would on the whole stream, so the
//! pieces joined equal [`Tokenizer::decode`] of the same ids (where decode removes no
//! leading space: the stream keeps every token's text as it is).

use super::Tokenizer;

/// Turns a stream of token ids into text, whole characters at a time.
///
/// It holds no reference to the tokenizer, so it can live in a request's state; pass the
/// tokenizer to each call.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder; with `skip_special`, control and unknown tokens give no text.
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder {
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending
            .extend_from_slice(tokenizer.piece(id, self.skip_special));
        self.take_complete()
    }

    /// Adds several tokens and returns the text they complete.
    pub fn push_all(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> String {
        for &id in ids {
            self.pending
                .extend_from_slice(tokenizer.piece(id, self.skip_special));
        }
        self.take_complete()
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: an unfinished character left over becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is UTF-8 up to `valid_up_to`, so this never falls back.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // Invalid bytes: one replacement character, then go on.
                        Some(len) => {
                            out.push('\u{FFFD}');
                            rest = &after[len.min(after.len())..];
                        }
                        // An unfinished character at the end: keep it for the next token.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
