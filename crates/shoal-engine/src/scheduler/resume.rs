//! Resumption: a request that comes back with the tokens it generated on an instance that
//! was lost ([`SequenceRequest::resume`](super::SequenceRequest::resume)) has its output
//! state (counts, text decoder, stop matcher, constraint) brought to where it stopped
//! before it generates on.

use super::worker::{Sequence, Worker};
use super::Event;
use crate::stop::FinishReason;

impl Worker<'_> {
    /// Brings a resumed sequence's output state to where it stopped: its resumed tokens
    /// (already in its prompt, see [`Scheduler::submit`](super::Scheduler::submit)) are
    /// counted as generated and pass through the text decoder, the stop matcher and the
    /// constraint, reported again only when the request asks
    /// ([`SequenceRequest::report_resumed`](super::SequenceRequest::report_resumed)). Text
    /// the stop matcher held back stays held, as it was. Returns how it ends when the last
    /// resumed token already ended it (a stop string, or its last allowed token).
    pub(super) fn replay_resumed(
        &self,
        seq: &mut Sequence,
    ) -> Result<Option<FinishReason>, String> {
        let tok = &self.model.tokenizer;
        let request = &mut seq.job.request;
        let vocab = tok.vocab_size();
        let last = request.resume.len().saturating_sub(1);
        for (i, &id) in request.resume.iter().enumerate() {
            if id as usize >= vocab {
                return Err(format!(
                    "a resumed token id, {id}, is outside the vocabulary ({vocab} tokens)"
                ));
            }
            if let Some(c) = request.constraint.as_mut() {
                c.commit(id)
                    .map_err(|e| format!("constrained decoding: {e}"))?;
            }
            seq.generated += 1;
            *seq.counts.entry(id).or_insert(0) += 1;
            let piece = seq.decoder.push(tok, id);
            let (released, matched) = seq.stops.push(&piece);
            if matched && i < last {
                return Err(format!(
                    "the resumed tokens match a stop string at token {} of {}",
                    i + 1,
                    last + 1
                ));
            }
            if request.report_resumed {
                let token = Event::Token {
                    id,
                    text: released,
                    logprob: None,
                };
                if !(seq.job.sink)(token) {
                    return Err("nobody listens to the resumed sequence".into());
                }
            }
            if matched {
                return Ok(Some(FinishReason::Stop));
            }
        }
        if seq.generated > request.max_tokens {
            return Err(format!(
                "the request resumes after {} tokens, more than its {}",
                seq.generated, request.max_tokens
            ));
        }
        Ok((seq.generated == request.max_tokens).then_some(FinishReason::Length))
    }
}
