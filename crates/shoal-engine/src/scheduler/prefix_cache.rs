//! The prefix cache: the caches of ended sequences kept for later requests ([`Parked`]), and
//! how a new sequence starts from the kept or running cache that shares the longest start
//! with its prompt (copied, or taken over in place when every slot is in use) instead of
//! running those positions again, or waits for a running prompt it shares much more with.

use std::sync::atomic::Ordering;

use super::mtp::{self, MtpState};
use super::worker::{Store, Worker};

/// Prompt positions a queued request must gain by waiting for a running prompt to finish
/// before it waits rather than starts ([`Worker::worth_waiting`]).
const WAIT_FOR_SHARE: usize = 64;

/// The cache of a sequence that ended, kept so that a later request sharing a start with
/// it runs only the rest (a conversation's next turn re-sends the whole conversation).
pub(super) struct Parked {
    pub(super) cache: Store,
    pub(super) tokens: Vec<u32>,
    /// The state of the model's prediction layer, when it drafted for the sequence.
    pub(super) mtp: Option<MtpState>,
}

/// Where a new sequence's first positions come from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// The kept cache at this index of `Worker::parked`.
    Kept(usize),
    /// The running sequence at this index of `Worker::active`.
    Running(usize),
}

/// Length of the common prefix of two token sequences.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Worker<'_> {
    /// The cache that shares the longest start with `prompt` (all but its last token at
    /// most, which must run to give logits): a kept cache or a running sequence's, and how
    /// many positions. Ties go to a kept cache, then to the newest.
    fn best_prefix(&self, prompt: &[u32]) -> Option<(Source, usize)> {
        if !self.config.prefix_cache {
            return None;
        }
        let most = prompt.len().saturating_sub(1);
        let kept = self.parked.iter().enumerate().map(|(i, p)| {
            let n = common_prefix(&p.tokens, prompt).min(most);
            (n, 1, i, Source::Kept(i))
        });
        let running = self.active.iter().enumerate().map(|(i, s)| {
            let n = s.shared_start(prompt).min(most);
            (n, 0, i, Source::Running(i))
        });
        kept.chain(running)
            .filter(|&(n, ..)| n > 0)
            .max_by_key(|&(n, kept, i, _)| (n, kept, i))
            .map(|(n, _, _, src)| (src, n))
    }

    /// Whether a queued `prompt` should wait for a sequence still running its own prompt
    /// that shares at least [`WAIT_FOR_SHARE`] more of its start than any cache holds now:
    /// copying those positions once they have run beats running them again (many requests
    /// with one system prompt arriving at once). The wait ends when that prompt has run.
    pub(super) fn worth_waiting(&self, prompt: &[u32]) -> bool {
        if !self.config.prefix_cache {
            return false;
        }
        let most = prompt.len().saturating_sub(1);
        let now = self.best_prefix(prompt).map_or(0, |(_, n)| n);
        self.active.iter().any(|s| {
            let p = &s.job.request.prompt;
            s.prefilled < p.len() && common_prefix(p, prompt).min(most) >= now + WAIT_FOR_SHARE
        })
    }

    /// A cache for a sequence of `prompt` that needs room for `capacity` positions, and how
    /// many of the prompt's tokens it already holds ([`Worker::best_prefix`]). A kept cache
    /// is taken over when every slot is in use, else copied (and kept for the next request
    /// that starts the same way, e.g. with the same system prompt); a running sequence's
    /// positions are copied. Kept caches go oldest first when a slot is needed. When the
    /// model's prediction layer drafts, the source's state of it comes along (see
    /// [`mtp::share`]).
    pub(super) fn cache_for(
        &mut self,
        prompt: &[u32],
        capacity: usize,
    ) -> Result<(Store, usize, Option<MtpState>), String> {
        // a copy between slots waits for the groups in flight (which may end sequences)
        self.settle();
        let mut best = self.best_prefix(prompt);
        if let Some((Source::Kept(i), n)) = best {
            if self.slots_full() {
                let p = self.parked.remove(i);
                let mut state = p.mtp;
                let n = match &mut state {
                    Some(m) => {
                        let layer = self
                            .mtp
                            .as_ref()
                            .ok_or("a prediction layer's state without the layer")?;
                        mtp::take_over(&layer.transformer, m, n, capacity)
                            .map_err(|e| e.to_string())?
                    }
                    None => n,
                };
                let (store, n) = self.take_over(p.cache, n, capacity)?;
                return Ok((store, n, state));
            }
        }
        // a slot for the new cache: the oldest kept caches go (a kept source is not among
        // them: with every slot full it was taken over above)
        while self.slots_full() {
            if self.parked.is_empty() {
                return Err("no free slot".into());
            }
            self.parked.remove(0);
            if let Some((Source::Kept(i), n)) = best {
                best = i.checked_sub(1).map(|i| (Source::Kept(i), n));
            }
        }
        let source = best.map(|(src, n)| {
            let (store, state) = match src {
                Source::Kept(i) => (&self.parked[i].cache, &self.parked[i].mtp),
                Source::Running(i) => (&self.active[i].cache, &self.active[i].mtp),
            };
            (store, state.as_ref(), n)
        });
        let mut state = None;
        let (store, n) = match self.lead.as_mut() {
            Some(lead) => {
                let held: Vec<usize> = self
                    .active
                    .iter()
                    .map(|s| &s.cache)
                    .chain(self.parked.iter().map(|p| &p.cache))
                    .filter_map(Store::slot)
                    .collect();
                let slot = (0..self.config.max_batch)
                    .find(|s| !held.contains(s))
                    .ok_or_else(|| "no free slot in the split model".to_string())?;
                let from = source.and_then(|(store, st, n)| store.slot().map(|s| (s, st, n)));
                let n = match from {
                    Some((from, from_state, n)) => {
                        let n = match (from_state, &self.mtp) {
                            (Some(s), Some(layer)) => {
                                let (n, mine) = mtp::share(&layer.transformer, s, n, capacity)
                                    .map_err(|e| e.to_string())?;
                                state = Some(mine);
                                n
                            }
                            _ => n,
                        };
                        lead.copy_prefix(from, slot, n).map_err(|e| e.to_string())?;
                        n
                    }
                    None => 0,
                };
                lead.select(slot).map_err(|e| e.to_string())?;
                lead.truncate(n);
                (
                    Store::Slot {
                        slot,
                        len: n,
                        capacity,
                    },
                    n,
                )
            }
            None => {
                let mut cache = self.model.new_cache(capacity);
                let src = source.and_then(|(store, from_state, n)| match store {
                    Store::Local(c) => Some((c, from_state, n)),
                    Store::Slot { .. } => None,
                });
                let n = match src {
                    Some((from, from_state, n)) => {
                        let n = match from_state {
                            Some(s) if self.mtp.is_some() => {
                                let layer = self.mtp.as_ref().map(|m| &m.transformer);
                                let layer =
                                    layer.ok_or("a prediction layer's state without the layer")?;
                                let (n, mine) =
                                    mtp::share(layer, s, n, capacity).map_err(|e| e.to_string())?;
                                state = Some(mine);
                                n
                            }
                            _ => n,
                        };
                        self.model
                            .transformer
                            .copy_prefix(from, &mut cache, n)
                            .map_err(|e| e.to_string())?;
                        n
                    }
                    None => 0,
                };
                (Store::Local(cache), n)
            }
        };
        self.count_kept();
        Ok((store, n, state))
    }

    /// Continues from a kept cache's first `n` positions in place.
    fn take_over(
        &mut self,
        cache: Store,
        n: usize,
        capacity: usize,
    ) -> Result<(Store, usize), String> {
        self.count_kept();
        match cache {
            Store::Slot { slot, .. } => {
                let lead = self.lead.as_mut().ok_or("a split slot without a split")?;
                lead.select(slot).map_err(|e| e.to_string())?;
                lead.truncate(n);
                Ok((
                    Store::Slot {
                        slot,
                        len: n,
                        capacity,
                    },
                    n,
                ))
            }
            Store::Local(mut c) => {
                c.truncate(n);
                if c.capacity() >= capacity {
                    return Ok((Store::Local(c), n));
                }
                let mut bigger = self.model.new_cache(capacity);
                self.model
                    .transformer
                    .copy_prefix(&c, &mut bigger, n)
                    .map_err(|e| e.to_string())?;
                Ok((Store::Local(bigger), n))
            }
        }
    }

    /// Publishes what the kept caches hold.
    pub(super) fn count_kept(&self) {
        let tokens: usize = self.parked.iter().map(|p| p.tokens.len()).sum();
        let cfg = self.model.transformer.config();
        let per_token = cfg.kv_bytes_per_token_per_layer() * cfg.n_layer as u64;
        let stats = &self.shared.stats;
        stats.kept_tokens.store(tokens as u64, Ordering::Relaxed);
        stats
            .kept_bytes
            .store(tokens as u64 * per_token, Ordering::Relaxed);
    }
}
