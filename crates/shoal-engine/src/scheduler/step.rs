//! One scheduler iteration's model work: a chunk of the oldest unfinished prompt, then one
//! batched decode step over every sequence with a token to run (on one rank, or as one
//! step of every rank of a split), and the sampling of each sequence's next token from its
//! logits ([`accept`]) with its penalties, constraint, log-probabilities and stop strings.
//! A failed step fails its sequences, or interrupts every sequence of a split.

use std::sync::atomic::Ordering;
use std::time::Instant;

use rayon::prelude::*;

use super::mtp;
use super::worker::{Sequence, Store, Worker};
use super::{Event, Finished, SequenceRequest, TokenLogprob, PROMPT_CHUNK};
use crate::model::LoadedModel;
use crate::parallel::{Lead, Want};
use crate::stop::FinishReason;
use crate::transformer::Transformer;
use crate::{EngineError, KvCache};

impl<'m> Worker<'m> {
    /// Runs the next chunk of the oldest sequence still reading its prompt; when its prompt is
    /// done, samples its first token.
    pub(super) fn prefill_one_chunk(&mut self) {
        let prefilling = |s: &Sequence| s.prefilled < s.job.request.prompt.len();
        if !self.in_flight.is_empty() && self.active.iter().any(prefilling) {
            self.settle();
        }
        let Some(i) = self
            .active
            .iter()
            .position(|s| s.prefilled < s.job.request.prompt.len())
        else {
            return;
        };
        let model = self.model.clone();
        let mtp_layer = self.mtp.clone();
        let seq = &mut self.active[i];
        let prompt_len = seq.job.request.prompt.len();
        let end = (seq.prefilled + PROMPT_CHUNK).min(prompt_len);
        let chunk = &seq.job.request.prompt[seq.prefilled..end];
        let start = seq.prefilled;
        let mut hidden = None;
        let result = match (&mut seq.cache, self.lead.as_mut()) {
            (Store::Local(cache), _) if mtp_layer.is_some() => model
                .transformer
                .step_hidden(chunk, &[chunk.len()], &mut [cache], 1)
                .map(|(logits, rows)| {
                    hidden = Some(rows);
                    logits
                }),
            (Store::Local(cache), _) => model.transformer.forward_last(chunk, cache),
            (Store::Slot { slot, len, .. }, Some(lead)) => {
                let want = if end == prompt_len {
                    want_for(&seq.job.request)
                } else {
                    Want::Nothing
                };
                let r = lead
                    .select(*slot)
                    .and_then(|()| lead.step_with(chunk, want));
                if r.is_ok() && mtp_layer.is_some() {
                    hidden = Some(lead.take_hidden());
                }
                *len += chunk.len();
                r
            }
            (Store::Slot { .. }, None) => Err(EngineError::Internal {
                what: "a split sequence without a lead".into(),
            }),
        };
        let split_error = match (&result, &seq.cache) {
            (Err(e), Store::Slot { .. }) => Some(format!("prompt processing failed: {e}")),
            _ => None,
        };
        self.shared
            .stats
            .prompt_tokens
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        seq.prefilled = end;
        // the draft model reads the prompt beside the model (its part of prompt processing)
        if let (Some(d), Ok(_), false) = (&self.draft, &result, seq.draft_failed) {
            let capacity = seq.cache.capacity();
            let dc = seq
                .draft_cache
                .get_or_insert_with(|| d.transformer.new_cache(capacity));
            let start = end - chunk.len();
            if dc.len() == start {
                if let Err(e) = d.transformer.forward_last(chunk, dc) {
                    tracing::warn!(
                        "the draft model failed on the prompt, decoding on without it: {e}"
                    );
                    seq.draft_cache = None;
                    seq.draft_failed = true;
                }
            }
        }
        if let (Some(rows), Some(layer)) = (hidden, &mtp_layer) {
            mtp::record_hidden(&layer.transformer, seq, start, &rows);
        }
        let seq_ok = result.is_ok();
        let keep = match result {
            // a split that failed interrupts the sequence like the others (below)
            Err(_) if split_error.is_some() => {
                (seq.job.sink)(Event::Interrupted(split_error.clone().unwrap_or_default()));
                false
            }
            Err(e) => {
                (seq.job.sink)(Event::Failed(format!("prompt processing failed: {e}")));
                false
            }
            Ok(mut logits) if end == prompt_len => accept(&model, seq, &mut logits),
            Ok(_) => true,
        };
        if !keep {
            let seq = self.active.remove(i);
            self.retire(seq, split_error.is_none() && seq_ok);
        }
        if let Some(why) = split_error {
            self.fail_all(&why);
        }
    }

    /// One token for every sequence that has a sampled token to run.
    pub(super) fn decode_step(&mut self) {
        if self.config.draft_max > 0 {
            // drafts are checked in one step of every ready sequence
            self.settle();
        }
        let ready: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].next.is_some())
            .collect();
        if self.pipelined() && self.config.draft_max == 0 {
            return self.pipelined_decode(&ready);
        }
        if ready.is_empty() {
            return;
        }
        if self.config.draft_max > 0 {
            let drafts = self.drafts(&ready);
            // on a pipeline, a step without drafts may still go in ahead of the one before
            if drafts.iter().any(|d| !d.is_empty()) || self.checks_in_chain() {
                return self.speculative_step(&ready, &drafts);
            }
        }
        let tokens: Vec<u32> = ready.iter().filter_map(|&i| self.active[i].next).collect();
        self.count_step(ready.len(), ready.len());
        let started = Instant::now();
        let model = self.model.clone();
        let mtp_layer = self.mtp.clone();
        // where each sequence's step starts (for the prediction layer's rows)
        let starts: Vec<usize> = ready.iter().map(|&i| self.active[i].cache.len()).collect();
        let result = if self.lead.is_some() {
            let rows = self.split_decode(&ready, &tokens);
            if let (Ok(_), Some(layer), Some(lead)) = (&rows, &mtp_layer, self.lead.as_mut()) {
                let hidden = lead.take_hidden();
                record_rows(
                    &layer.transformer,
                    &mut self.active,
                    &ready,
                    &starts,
                    &hidden,
                );
            }
            rows.map(StepLogits::Rows)
        } else {
            let mut caches = ready_local_caches(&mut self.active);
            if let Some(layer) = &mtp_layer {
                let counts = vec![1; tokens.len()];
                let stepped = model
                    .transformer
                    .step_hidden(&tokens, &counts, &mut caches, 1);
                drop(caches);
                stepped.and_then(|(logits, hidden)| {
                    record_rows(
                        &layer.transformer,
                        &mut self.active,
                        &ready,
                        &starts,
                        &hidden,
                    );
                    StepLogits::flat(logits, tokens.len())
                })
            } else {
                model
                    .transformer
                    .forward_batch(&tokens, &mut caches)
                    .and_then(|l| StepLogits::flat(l, tokens.len()))
            }
        };
        let rows = match result {
            Ok(rows) => rows,
            Err(e) if self.lead.is_some() => {
                self.fail_all(&format!("decoding failed: {e}"));
                return;
            }
            Err(e) => {
                self.fail_batch(&ready, &format!("decoding failed: {e}"));
                return;
            }
        };
        self.take_rows(&ready, rows);
        if self.config.adaptive_drafts {
            self.step_costs
                .record(tokens.len(), started.elapsed().as_secs_f64());
        }
    }

    /// Samples the next token of each of the `ready` sequences (indices into `active`, in
    /// order) from its row of a decode step's `rows`, and retires those that ended.
    pub(super) fn take_rows(&mut self, ready: &[usize], mut rows: StepLogits) {
        let model = self.model.clone();
        // Sampling (a pass over the vocabulary, a mask for constrained sequences) runs for
        // every sequence at once.
        let mut by_seq: Vec<Option<&mut [f32]>> = Vec::new();
        by_seq.resize_with(self.active.len(), || None);
        for (&i, row) in ready.iter().zip(rows.rows()) {
            by_seq[i] = Some(row);
        }
        let keep: Vec<bool> = self
            .active
            .par_iter_mut()
            .zip(by_seq.par_iter_mut())
            .map(|(seq, row)| match row.take() {
                Some(row) => {
                    seq.next = None;
                    accept(&model, seq, row)
                }
                None => true,
            })
            .collect();
        for i in (0..keep.len()).rev() {
            if !keep[i] {
                let seq = self.active.remove(i);
                self.retire(seq, true);
            }
        }
    }

    /// One batched split step for the ready sequences: every rank reads its weights once
    /// for all of them. The step asks the last stage for what the most demanding sequence
    /// needs (each sequence's own choice is a subset of it).
    fn split_decode(
        &mut self,
        ready: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        self.split_rows(ready, tokens, &vec![1; ready.len()])
    }

    /// One split step of several tokens per ready sequence (its next token and its draft,
    /// `counts` each): the logits of every row, sequence by sequence.
    pub(super) fn split_rows(
        &mut self,
        ready: &[usize],
        tokens: &[u32],
        counts: &[usize],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let (slots, want) = self.split_slots(ready, counts)?;
        self.lead_mut()?.step_rows(&slots, tokens, counts, want)
    }

    /// The lead of the split this scheduler runs.
    pub(super) fn lead_mut(&mut self) -> Result<&mut Lead<'m>, EngineError> {
        self.lead.as_mut().ok_or_else(|| EngineError::Internal {
            what: "a split sequence without a lead".into(),
        })
    }

    /// The slots of the ready sequences in a split step of `counts[i]` tokens each (their
    /// lengths counted on), and what the step must return for the most demanding of them.
    pub(super) fn split_slots(
        &mut self,
        ready: &[usize],
        counts: &[usize],
    ) -> Result<(Vec<usize>, Want), EngineError> {
        let mut slots = Vec::with_capacity(ready.len());
        let mut want = Want::Best;
        for (&i, &n) in ready.iter().zip(counts) {
            let seq = &mut self.active[i];
            let Store::Slot { slot, len, .. } = &mut seq.cache else {
                return Err(EngineError::Internal {
                    what: "a local sequence in a split scheduler".into(),
                });
            };
            slots.push(*slot);
            *len += n;
            want = widest(want, want_for(&seq.job.request));
        }
        Ok((slots, want))
    }

    /// Interrupts every sequence and breaks the split (a failed split step leaves every
    /// rank's state unknown; the sequences may go on where the model is placed next).
    pub(super) fn fail_all(&mut self, why: &str) {
        self.break_split(why);
        self.in_flight.clear();
        self.parked.clear();
        for seq in self.active.drain(..) {
            let mut sink = seq.job.sink;
            sink(Event::Interrupted(why.to_string()));
        }
    }

    /// Counts a decode step of `batch` sequences that decoded `tokens` tokens.
    pub(super) fn count_step(&self, batch: usize, tokens: usize) {
        let stats = &self.shared.stats;
        stats.last_batch.store(batch, Ordering::Relaxed);
        stats.decode_steps.fetch_add(1, Ordering::Release);
        stats
            .decoded_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Fails the sequences of a step that failed on one rank (`ready`, indices into
    /// `active`): a failed step leaves the caches of every sequence in it unusable.
    pub(super) fn fail_batch(&mut self, ready: &[usize], msg: &str) {
        let mut i = 0;
        self.active.retain_mut(|s| {
            let in_batch = ready.contains(&i);
            i += 1;
            if in_batch {
                (s.job.sink)(Event::Failed(msg.to_string()));
            }
            !in_batch
        });
    }
}

/// A decode step's logits, one row per sequence in the step.
pub(super) enum StepLogits {
    /// A row each.
    Rows(Vec<Vec<f32>>),
    /// The rows one after another (the output head's own values), and how many.
    Flat(Vec<f32>, usize),
}

impl StepLogits {
    /// `n` rows laid one after another in `values`.
    pub(super) fn flat(values: Vec<f32>, n: usize) -> Result<Self, EngineError> {
        if n == 0 || values.is_empty() || !values.len().is_multiple_of(n) {
            return Err(EngineError::Internal {
                what: format!("{} logits for a step of {n} sequences", values.len()),
            });
        }
        Ok(StepLogits::Flat(values, n))
    }

    /// Each row, in order.
    pub(super) fn rows(&mut self) -> Vec<&mut [f32]> {
        match self {
            StepLogits::Rows(rows) => rows.iter_mut().map(|r| &mut r[..]).collect(),
            StepLogits::Flat(values, n) => {
                let width = values.len() / *n;
                values.chunks_mut(width).collect()
            }
        }
    }
}

/// The reply that serves both `a` and `b` (every logit, else the larger top-k, else the
/// best token).
pub(super) fn widest(a: Want, b: Want) -> Want {
    match (a, b) {
        (Want::All, _) | (_, Want::All) => Want::All,
        (Want::TopK(x), Want::TopK(y)) => Want::TopK(x.max(y)),
        (Want::TopK(k), _) | (_, Want::TopK(k)) => Want::TopK(k),
        (Want::Best, _) | (_, Want::Best) => Want::Best,
        (Want::Nothing, Want::Nothing) => Want::Nothing,
    }
}

/// What a split step must return for `r` to be sampled exactly as from the full logits.
pub(super) fn want_for(r: &SequenceRequest) -> Want {
    if r.constraint.is_some()
        || r.logprobs.is_some()
        || r.presence_penalty != 0.0
        || r.frequency_penalty != 0.0
    {
        Want::All
    } else {
        Want::for_sampler(&r.sampler)
    }
}

/// Samples the next token of `seq` from `logits` and reports it. Returns whether the
/// sequence goes on.
pub(super) fn accept(model: &LoadedModel, seq: &mut Sequence, logits: &mut [f32]) -> bool {
    if seq.first_token.is_none() {
        seq.first_token = Some(seq.job.submitted.elapsed());
    }
    let (presence, frequency) = (
        seq.job.request.presence_penalty,
        seq.job.request.frequency_penalty,
    );
    if presence != 0.0 || frequency != 0.0 {
        for (&t, &n) in &seq.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= presence + frequency * n as f32;
            }
        }
    }
    if let Some(c) = seq.job.request.constraint.as_mut() {
        if let Err(e) = c.mask(logits) {
            (seq.job.sink)(Event::Failed(format!("constrained decoding: {e}")));
            return false;
        }
    }
    // The distribution the token is drawn from, before the sampler's own penalty edits it.
    let scored = seq
        .job
        .request
        .logprobs
        .map(|k| (log_softmax_top(logits, k), logits.to_vec()));
    let id = seq.sampler.sample(logits);
    if let Some(c) = seq.job.request.constraint.as_mut() {
        if let Err(e) = c.commit(id) {
            (seq.job.sink)(Event::Failed(format!("constrained decoding: {e}")));
            return false;
        }
    }
    let tok = &model.tokenizer;
    if tok.is_eog(id) && !seq.job.request.ignore_eos {
        return finish(seq, FinishReason::Stop);
    }
    seq.generated += 1;
    seq.generated_ids.push(id);
    *seq.counts.entry(id).or_insert(0) += 1;
    let piece = seq.decoder.push(tok, id);
    let (text, matched) = seq.stops.push(&piece);
    let logprob = scored.map(|((log_z, top), raw)| TokenLogprob {
        logprob: raw
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| l - log_z),
        top,
    });
    if !(seq.job.sink)(Event::Token { id, text, logprob }) {
        return false;
    }
    let constrained_done = seq
        .job
        .request
        .constraint
        .as_ref()
        .is_some_and(|c| c.is_finished());
    if matched || constrained_done {
        return finish(seq, FinishReason::Stop);
    }
    if seq.generated >= seq.job.request.max_tokens || seq.cache.len() >= seq.cache.capacity() {
        return finish(seq, FinishReason::Length);
    }
    seq.next = Some(id);
    true
}

/// Keeps each of the `ready` sequences' row of a one-token step's output hidden states
/// (`hidden`, a row each in order; the step started at `starts`) for the prediction layer
/// `layer`.
fn record_rows(
    layer: &Transformer,
    active: &mut [Sequence],
    ready: &[usize],
    starts: &[usize],
    hidden: &[f32],
) {
    let width = hidden.len() / ready.len().max(1);
    if width == 0 {
        return;
    }
    for ((&i, &start), row) in ready.iter().zip(starts).zip(hidden.chunks_exact(width)) {
        mtp::record_hidden(layer, &mut active[i], start, row);
    }
}

/// The local caches of the sequences with a sampled token to run, in order (the rows of a
/// one-rank decode step).
pub(super) fn ready_local_caches(active: &mut [Sequence]) -> Vec<&mut KvCache> {
    active
        .iter_mut()
        .filter(|s| s.next.is_some())
        .filter_map(|s| match &mut s.cache {
            Store::Local(c) => Some(c),
            Store::Slot { .. } => None,
        })
        .collect()
}

/// Reports the end of `seq` (with any text still held back, unless a stop string matched:
/// at an end-of-generation token, what the stop matcher held is text after all).
/// Returns `false`: the sequence leaves the batch.
pub(super) fn finish(seq: &mut Sequence, reason: FinishReason) -> bool {
    let stopped_by_string = seq.stops.matched().is_some();
    let rest = seq.stops.finish() + &seq.decoder.finish();
    if !rest.is_empty() && !stopped_by_string && !(seq.job.sink)(Event::Text(rest)) {
        return false;
    }
    (seq.job.sink)(Event::Done(Finished {
        reason,
        stop: seq.stops.matched().map(str::to_string),
        prompt_tokens: seq.job.request.prompt.len() - seq.job.request.resume.len(),
        cached_tokens: seq.cached,
        completion_tokens: seq.generated,
        time_to_first_token: seq.first_token.unwrap_or_default(),
        total: seq.job.submitted.elapsed(),
    }));
    false
}

/// The log of the softmax's normalizer over the finite `logits`, and the `k` largest
/// log-probabilities (best first). The normalizer's sum takes the sampler's vectorized
/// weights (`kernels::softmax_weights`, within an ulp of `exp` each, summed in eight f32
/// lanes), not an f64 `exp` per logit, which over a vocabulary would cost a large part of
/// a token's time for every request that asks for log-probabilities.
fn log_softmax_top(logits: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    thread_local! {
        static WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let max = crate::sampler::max_finite(logits);
    let sum = WEIGHTS.with(|w| {
        let mut w = w.borrow_mut();
        w.resize(logits.len(), 0.0);
        crate::backend::cpu::softmax_weights(logits, max, 1.0, &mut w)
    });
    let log_z = max + sum.ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if !l.is_finite() {
                continue;
            }
            if top.len() < k || top.last().is_some_and(|&(_, x)| l > x) {
                let at = top.partition_point(|&(_, x)| x >= l);
                top.insert(at, (i as u32, l));
                top.truncate(k);
            }
        }
    }
    for e in &mut top {
        e.1 -= log_z;
    }
    (log_z, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_top_is_normalized_and_sorted() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 2.0];
        let (log_z, top) = log_softmax_top(&logits, 2);
        let total: f32 = logits
            .iter()
            .filter(|l| l.is_finite())
            .map(|l| (l - log_z).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!(top[0].1 > top[1].1);
    }

    #[test]
    fn log_softmax_top_matches_an_f64_normalizer() {
        // a vocabulary-sized row with the values that are left out
        let logits: Vec<f32> = (0..151_936)
            .map(|i| match i % 997 {
                0 => f32::NEG_INFINITY,
                1 => f32::NAN,
                _ => ((i * 7919 % 2003) as f32) / 100.0 - 10.0,
            })
            .collect();
        let max = logits
            .iter()
            .filter(|l| l.is_finite())
            .fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let sum: f64 = logits
            .iter()
            .filter(|l| l.is_finite())
            .map(|&l| (l as f64 - max).exp())
            .sum();
        let want = max + sum.ln();
        let (log_z, top) = log_softmax_top(&logits, 3);
        assert!(
            (log_z as f64 - want).abs() < 1e-4,
            "log_z {log_z} against {want}"
        );
        assert_eq!(top.len(), 3);
        assert!(top.iter().all(|t| t.1 <= 0.0 && t.1.is_finite()));
    }
}
