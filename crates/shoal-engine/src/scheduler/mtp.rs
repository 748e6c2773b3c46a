//! Drafting with the model's own multi-token-prediction layer ([`Scheduler::start_with_mtp`],
//! GLM-4.5+'s `nextn` layer; on a split, [`Scheduler::start_split_with_mtp`] with the
//! layer held on the lead): each step of the model also gives its output hidden states,
//! which a sequence keeps ([`MtpState::pending`]) until the layer has read each one with the
//! token that followed it; to draft, the layer reads the last ones (the newest paired with
//! the sequence's next token) and predicts the token after it, then feeds its own output
//! and that prediction back for each further draft token. The layer's cache holds only the
//! positions whose hidden state came from the model: the drafted positions are cut off as
//! soon as the draft is made.
//!
//! [`Scheduler::start_with_mtp`]: super::Scheduler::start_with_mtp
//! [`Scheduler::start_split_with_mtp`]: super::Scheduler::start_split_with_mtp

use std::time::{Duration, Instant};

use super::worker::Sequence;
use super::PROMPT_CHUNK;
use crate::transformer::Transformer;
use crate::{EngineError, KvCache};

/// A sequence's state of the prediction layer.
pub(super) struct MtpState {
    /// The layer's cache: one position for each of the sequence's first positions, each
    /// read with the token after it.
    cache: KvCache,
    /// The model's output hidden states (after its final norm) at the sequence's positions
    /// from `cache.len()` on, a row each, that the layer has not read yet.
    pending: Vec<f32>,
    /// Tokens it drafted that were checked, and of those the ones taken.
    drafted: usize,
    taken: usize,
    /// Seconds the layer took to read one position without drafting (the positions before
    /// the newest, read in a batch), averaged; 0 until measured.
    read_seconds: f64,
}

impl MtpState {
    fn pending_rows(&self, hidden: usize) -> usize {
        self.pending.len() / hidden
    }

    /// Records that reading `rows` positions took `seconds`.
    fn read(&mut self, rows: usize, seconds: f64) {
        if rows == 0 {
            return;
        }
        let per_row = seconds / rows as f64;
        self.read_seconds = if self.read_seconds > 0.0 {
            0.7 * self.read_seconds + 0.3 * per_row
        } else {
            per_row
        };
    }
}

/// Whether `seq`'s layer has had drafts checked and costs more than `budget` seconds to read
/// each position: while its drafts do not pay, keeping it for a later try would cost that
/// reading at every position in between, more than tries may take, so it stops at once.
pub(super) fn reading_exceeds(seq: &Sequence, budget: f64) -> bool {
    seq.mtp
        .as_ref()
        .is_some_and(|m| m.drafted > 0 && m.read_seconds > budget)
}

/// Keeps `rows` (the model's output hidden states at `seq`'s positions `start..`, a row of
/// `hidden` values each) for its prediction layer, which reads them once more than a prompt
/// chunk waits ([`catch_up`]). A sequence whose state does not reach `start` (it started
/// from a cache whose sequence had none, or it stopped drafting) keeps none and drafts
/// nothing.
pub(super) fn record_hidden(layer: &Transformer, seq: &mut Sequence, start: usize, rows: &[f32]) {
    if seq.draft_failed {
        return;
    }
    let hidden = layer.config().hidden;
    if seq.mtp.is_none() && start == 0 {
        seq.mtp = layer
            .new_mtp_cache(seq.cache.capacity())
            .map(|cache| MtpState {
                cache,
                pending: Vec::new(),
                drafted: 0,
                taken: 0,
                read_seconds: 0.0,
            });
    }
    match &mut seq.mtp {
        Some(m) if m.cache.len() + m.pending_rows(hidden) == start => {
            m.pending.extend_from_slice(rows);
        }
        _ => {
            seq.mtp = None;
            seq.draft_failed = true;
            return;
        }
    }
    catch_up(layer, seq);
}

/// Lets the layer read the hidden states `seq` holds whose following token is known, all
/// but the newest (which the next draft reads), once more than a prompt chunk waits: a long
/// prompt, or a long stretch without drafts, is read a chunk at a time instead of held.
fn catch_up(layer: &Transformer, seq: &mut Sequence) {
    let hidden = layer.config().hidden;
    let Some(m) = &seq.mtp else { return };
    if m.pending_rows(hidden) <= PROMPT_CHUNK {
        return;
    }
    let known = context_len(seq);
    let at = m.cache.len();
    // positions whose next token is known, but not the newest
    let rows = m
        .pending_rows(hidden)
        .saturating_sub(1)
        .min(known.saturating_sub(at + 1));
    if rows == 0 {
        return;
    }
    let tokens = context_range(seq, at + 1, rows);
    let Some(m) = &mut seq.mtp else { return };
    let head: Vec<f32> = m.pending.drain(..rows * hidden).collect();
    let started = Instant::now();
    // read into the layer's cache only: no logits
    match layer.mtp_step(head, &tokens, &[rows], &mut [&mut m.cache], 0) {
        Ok(_) => m.read(rows, started.elapsed().as_secs_f64()),
        Err(e) => give_up(seq, &e),
    }
}

/// Up to `max` tokens `seq`'s prediction layer drafts after its next token, and the time
/// that took; `None` when it has nothing to draft from. The layer first reads the hidden
/// states it has not (the newest one with the next token), then each drafted token with
/// its own output before it.
pub(super) fn draft(
    layer: &Transformer,
    seq: &mut Sequence,
    max: usize,
) -> Option<(Vec<u32>, Duration)> {
    let hidden = layer.config().hidden;
    let m = seq.mtp.as_ref()?;
    let at = m.cache.len();
    let rows = m.pending_rows(hidden);
    // in step with the sequence: the newest pending position is the one before its next
    if rows == 0 || at + rows + 1 != context_len(seq) || max == 0 {
        return None;
    }
    // the token after each pending position, the last one the sequence's next
    let context = context_range(seq, at + 1, rows);
    let m = seq.mtp.as_mut()?;
    let mut started = Instant::now();
    let mut run = |m: &mut MtpState| -> Result<Vec<u32>, EngineError> {
        let t = &layer;
        let mut pending = std::mem::take(&mut m.pending);
        // the rows before the newest: the layer reads every position, drafting or not, so
        // this is not the draft's cost
        if rows > 1 {
            let newest = pending.split_off((rows - 1) * hidden);
            t.mtp_step(
                pending,
                &context[..rows - 1],
                &[rows - 1],
                &mut [&mut m.cache],
                0,
            )?;
            m.read(rows - 1, started.elapsed().as_secs_f64());
            pending = newest;
            started = Instant::now();
        }
        let (logits, out) =
            t.mtp_step(pending, &context[rows - 1..], &[1], &mut [&mut m.cache], 1)?;
        let mut token = crate::transformer::argmax(&logits) as u32;
        let mut state = out;
        let mut drafted = vec![token];
        while drafted.len() < max && m.cache.len() < m.cache.capacity() {
            let (logits, out) = t.mtp_step(state, &[token], &[1], &mut [&mut m.cache], 1)?;
            token = crate::transformer::argmax(&logits) as u32;
            state = out;
            drafted.push(token);
        }
        // only positions whose hidden state came from the model stay
        m.cache.truncate(at + rows);
        Ok(drafted)
    };
    match run(m) {
        Ok(d) => Some((d, started.elapsed())),
        Err(e) => {
            give_up(seq, &e);
            None
        }
    }
}

/// What a sequence that starts from the first `n` positions of another's cache takes of
/// the other's layer state `src`: how many of the positions it takes, and its own state.
/// The layer's position `i` paired the hidden state at `i` with the token at `i + 1`, which
/// the two share below `n - 1`; where the layer already read position `n - 1` with the
/// other's next token, the new sequence takes one position less and runs that one again
/// (its hidden state is gone).
///
/// # Errors
/// When the layer's cache cannot be copied.
pub(super) fn share(
    layer: &Transformer,
    src: &MtpState,
    n: usize,
    capacity: usize,
) -> Result<(usize, MtpState), EngineError> {
    let t = &layer;
    let (n, read, pending) = split_at(src, n, t.config().hidden);
    let mut cache = t
        .new_mtp_cache(capacity)
        .ok_or_else(|| EngineError::Internal {
            what: "a prediction layer's state without the layer".into(),
        })?;
    t.copy_prefix(&src.cache, &mut cache, read)?;
    let pending = src.pending[..pending].to_vec();
    Ok((
        n,
        MtpState {
            cache,
            pending,
            drafted: 0,
            taken: 0,
            read_seconds: src.read_seconds,
        },
    ))
}

/// [`share`] taking `state` over in place (into a cache of room for `capacity` positions
/// where it has less).
///
/// # Errors
/// When the layer's cache cannot be copied.
pub(super) fn take_over(
    layer: &Transformer,
    state: &mut MtpState,
    n: usize,
    capacity: usize,
) -> Result<usize, EngineError> {
    let t = &layer;
    let (n, read, pending) = split_at(state, n, t.config().hidden);
    state.cache.truncate(read);
    state.pending.truncate(pending);
    if state.cache.capacity() < capacity {
        if let Some(mut bigger) = t.new_mtp_cache(capacity) {
            t.copy_prefix(&state.cache, &mut bigger, read)?;
            state.cache = bigger;
        }
    }
    Ok(n)
}

/// For a sequence taking the first `n` positions of one whose layer state is `src`: the
/// positions it takes, the layer positions it keeps, and the pending values it keeps.
fn split_at(src: &MtpState, n: usize, hidden: usize) -> (usize, usize, usize) {
    let read = src.cache.len();
    if read + 1 >= n {
        let n = n.saturating_sub(1);
        (n, n, 0)
    } else {
        (n, read, (n - read) * hidden)
    }
}

/// Tries of the layer's draft not taken in a row (after its drafts stopped paying) before a
/// sequence stops drafting with it: the layer must read every position the sequence runs,
/// a layer's work per token even while nothing is drafted, so a layer whose drafts do not
/// pay for that stops.
pub(super) const GIVE_UP: usize = 2;

/// Drafted tokens checked, none of them taken, after which a sequence stops drafting with
/// the layer at once (for the same reason).
const NONE_TAKEN: usize = 8;

/// Counts `seq`'s checked draft (`drafted` tokens, `taken` of them), and stops drafting with
/// the layer when none of at least [`NONE_TAKEN`] was taken (with draft lengths chosen by
/// what pays; fixed drafts go on).
pub(super) fn checked(seq: &mut Sequence, drafted: usize, taken: usize) {
    if let Some(m) = &mut seq.mtp {
        m.drafted += drafted;
        m.taken += taken;
        if m.taken == 0 && m.drafted >= NONE_TAKEN {
            stop(seq);
        }
    }
}

/// `seq` stops drafting with the layer (its drafts stopped paying): its state goes.
pub(super) fn stop(seq: &mut Sequence) {
    if seq.mtp.take().is_some() {
        tracing::debug!("the prediction layer's drafts do not pay here: decoding on without them");
    }
    seq.draft_failed = true;
}

/// After a failure of its prediction layer, `seq` decodes on without drafts.
fn give_up(seq: &mut Sequence, e: &EngineError) {
    tracing::warn!("the prediction layer failed, decoding on without drafts: {e}");
    seq.mtp = None;
    seq.draft_failed = true;
}

/// The length of a sequence's context: its prompt and every generated token (the last one
/// its next).
fn context_len(s: &Sequence) -> usize {
    s.job.request.prompt.len() + s.generated_ids.len()
}

/// `n` tokens of a sequence's context from position `from`, without copying the rest.
fn context_range(s: &Sequence, from: usize, n: usize) -> Vec<u32> {
    let prompt = &s.job.request.prompt;
    prompt
        .iter()
        .chain(&s.generated_ids)
        .skip(from)
        .take(n)
        .copied()
        .collect()
}
