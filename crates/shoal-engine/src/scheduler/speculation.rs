//! Speculative decoding: each ready sequence drafts a few tokens (by prompt lookup in its
//! own context, with a draft model on this rank, the lead's on a split, or with the model's
//! own prediction layer, `mtp.rs`), and one step
//! runs its next token and its draft together (on one rank, or as one split step of every
//! rank); the sequence keeps the drafted tokens the model samples itself. On a pipeline
//! drafting by lookup, the next check goes in on a guess while the later stages run the last
//! ([`Worker::check_in_chain`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::draft_policy::{choose, Candidate, Probe};
use super::mtp;
use super::step::{accept, ready_local_caches, StepLogits};
use super::worker::{Sequence, Store, Worker};
use crate::model::LoadedModel;
use crate::{EngineError, KvCache};

impl Worker<'_> {
    /// The draft of each ready sequence (empty where the output is constrained or nothing
    /// was drafted): at most `config.draft_max` tokens, within the
    /// cache's room and the tokens still to generate; from the draft model when there is
    /// one, else by prompt lookup. With `config.adaptive_drafts`, only as many as
    /// [`choose`] finds worth a step's rows (a sequence's lookup drafts are all scored
    /// against what follows, checked or not).
    pub(super) fn drafts(&mut self, ready: &[usize]) -> Vec<Vec<u32>> {
        let draft_model = self.draft.clone();
        let mtp_layer = self.mtp.clone();
        // a draft model or the prediction layer: drafts cost a step each
        let by_model = draft_model.is_some() || mtp_layer.is_some();
        let adaptive = self.config.adaptive_drafts;
        // a split step carries at most so many tokens of a sequence
        let step_max = if self.lead.is_some() {
            crate::parallel::MAX_ROWS_PER_SEQUENCE - 1
        } else {
            usize::MAX
        };
        // what each may check at most, and its lookup draft
        let mut available = Vec::with_capacity(ready.len());
        let mut lookups = Vec::with_capacity(ready.len());
        for &i in ready {
            let s = &mut self.active[i];
            if adaptive {
                s.shadows.score(&s.generated_ids, &mut s.acceptance);
            }
            let room = s.cache.capacity().saturating_sub(s.cache.len() + 1);
            let left = s.job.request.max_tokens.saturating_sub(s.generated + 1);
            let max = if s.job.request.constraint.is_some() {
                0
            } else {
                self.config.draft_max.min(room).min(left).min(step_max)
            };
            if by_model {
                available.push(if s.draft_failed { 0 } else { max });
                lookups.push(Vec::new());
            } else {
                let d = crate::lookup::draft(&context_of(s), max);
                if adaptive {
                    s.shadows.push(s.generated_ids.len(), d.clone());
                }
                available.push(d.len());
                lookups.push(d);
            }
        }
        let lengths = if adaptive {
            let candidates: Vec<Candidate> = ready
                .iter()
                .zip(&available)
                .map(|(&i, &available)| Candidate {
                    available,
                    acceptance: &self.active[i].acceptance,
                })
                .collect();
            let mut k = choose(&self.step_costs, &candidates, self.draft_token_seconds);
            if by_model && self.draft_token_seconds == 0.0 {
                // until a drafted token's cost is measured, one drafted token finds it out
                for k in &mut k {
                    *k = (*k).min(1);
                }
            }
            if by_model {
                // a try costs a drafted token and the row it adds to the step
                let step = self.step_costs.cost(ready.len());
                let row = (self.step_costs.cost(ready.len() + 1) - step).max(0.0);
                let try_seconds = if self.draft_token_seconds > 0.0 {
                    self.draft_token_seconds + row
                } else {
                    0.0
                };
                for ((&i, k), &a) in ready.iter().zip(&mut k).zip(&available) {
                    let s = &mut self.active[i];
                    let chosen = *k;
                    *k = s.probe.length(*k, a, try_seconds, step);
                    if mtp_layer.is_some()
                        && *k == 0
                        && (s.probe.missed() >= mtp::GIVE_UP
                            || (chosen == 0 && mtp::reading_exceeds(s, Probe::SHARE * step)))
                    {
                        mtp::stop(s);
                    }
                }
            }
            k
        } else {
            available
        };
        let mut drafts = Vec::with_capacity(ready.len());
        for ((&i, k), mut lookup) in ready.iter().zip(lengths).zip(lookups) {
            let s = &mut self.active[i];
            // what the draft model drafted while the last check ran: its first token is
            // the sequence's next now
            let ahead = match std::mem::take(&mut s.ahead) {
                a if a.len() > 1 && k > 0 => a[1..a.len().min(k + 1)].to_vec(),
                _ => Vec::new(),
            };
            match &draft_model {
                _ if k == 0 => drafts.push(Vec::new()),
                Some(_) if !ahead.is_empty() => {
                    self.shared
                        .stats
                        .drafted_ahead
                        .fetch_add(ahead.len() as u64, Ordering::Relaxed);
                    drafts.push(ahead);
                }
                Some(_) | None if by_model => {
                    let drafted = match (&draft_model, &mtp_layer) {
                        (Some(d), _) => draft_from_model(d, s, &context_of(s), k),
                        (None, Some(layer)) => mtp::draft(&layer.transformer, s, k),
                        (None, None) => None,
                    };
                    let (draft, spent) = drafted.unwrap_or_default();
                    if !draft.is_empty() {
                        let per_token = spent.as_secs_f64() / draft.len() as f64;
                        self.draft_token_seconds = if self.draft_token_seconds > 0.0 {
                            0.7 * self.draft_token_seconds + 0.3 * per_token
                        } else {
                            per_token
                        };
                    }
                    drafts.push(draft);
                }
                _ => {
                    lookup.truncate(k);
                    drafts.push(lookup);
                }
            }
        }
        drafts
    }

    /// One decode step of the ready sequences (on one rank, or one split step of every
    /// rank) in which each runs its next token
    /// and its draft: every row's logits come back, each sequence samples row by row as
    /// plain decoding would and goes on while the sampled token is the drafted one, and its
    /// cache keeps the positions of the tokens it accepted. With a draft token taken only
    /// when the model samples it, the output is what decoding one token at a time gives
    /// (up to the last bits in which a step of several rows rounds differently).
    pub(super) fn speculative_step(&mut self, ready: &[usize], drafts: &[Vec<u32>]) {
        if self.checks_in_chain() {
            return self.check_in_chain(ready, drafts);
        }
        let mut tokens = Vec::new();
        let mut counts = Vec::new();
        for (&i, d) in ready.iter().zip(drafts) {
            tokens.extend(self.active[i].next);
            tokens.extend_from_slice(d);
            counts.push(1 + d.len());
        }
        let last = counts.iter().copied().max().unwrap_or(1);
        let started = Instant::now();
        let mtp_layer = self.mtp.clone();
        let model = self.model.clone();
        let vocab = model.transformer.config().vocab;
        let before: Vec<usize> = ready.iter().map(|&i| self.active[i].cache.len()).collect();
        // the model's output hidden states of every row, for the prediction layer
        let mut hidden = Vec::new();
        let result = if self.lead.is_some() {
            let rows = self.check_on_split(ready, &tokens, &counts, drafts);
            if let (Ok(_), Some(_), Some(lead)) = (&rows, &mtp_layer, self.lead.as_mut()) {
                hidden = lead.take_hidden();
            }
            rows.map(StepLogits::Rows)
        } else {
            let mut caches = ready_local_caches(&mut self.active);
            if mtp_layer.is_some() {
                model
                    .transformer
                    .step_hidden(&tokens, &counts, &mut caches, last)
                    .and_then(|(l, h)| {
                        hidden = h;
                        StepLogits::flat(l, tokens.len())
                    })
            } else {
                model
                    .transformer
                    .step(&tokens, &counts, &mut caches, last)
                    .and_then(|l| StepLogits::flat(l, tokens.len()))
            }
        };
        let mut logits = match result {
            Ok(l) => l,
            Err(e) if self.lead.is_some() => {
                self.fail_all(&format!("decoding failed: {e}"));
                return;
            }
            Err(e) => {
                self.fail_batch(ready, &format!("decoding failed: {e}"));
                return;
            }
        };
        let rows = logits.rows();
        if rows.len() != tokens.len() || rows.iter().any(|r| r.len() != vocab) {
            let msg = format!(
                "decoding failed: {} rows of logits for {} tokens",
                rows.len(),
                tokens.len()
            );
            drop(rows);
            if self.lead.is_some() {
                self.fail_all(&msg);
            } else {
                self.fail_batch(ready, &msg);
            }
            return;
        }
        let results = self.take_checked(ready, drafts, &before, rows, &hidden);
        let taken: usize = results.iter().map(|r| r.1).sum();
        self.cut_slots(ready);
        if self.config.adaptive_drafts {
            self.step_costs
                .record(tokens.len(), started.elapsed().as_secs_f64());
        }
        self.count_checked(ready.len(), drafts, taken);
        self.retire_ended(&results);
    }

    /// Cuts each ready sequence's slot on the lead to the length its cache keeps (on the
    /// other ranks at their next step).
    fn cut_slots(&mut self, ready: &[usize]) {
        if let Some(lead) = self.lead.as_mut() {
            for &i in ready {
                if let Store::Slot { slot, len, .. } = &self.active[i].cache {
                    if lead.select(*slot).is_ok() {
                        lead.truncate(*len);
                    }
                }
            }
        }
    }

    /// Retires the sequences that ended (`results[i].0` false, for every active sequence).
    fn retire_ended(&mut self, results: &[(bool, usize)]) {
        for i in (0..results.len()).rev() {
            if !results[i].0 {
                let seq = self.active.remove(i);
                self.retire(seq, true);
            }
        }
    }

    /// Counts a step of `sequences` sequences that checked `drafts` and took `taken` of them.
    fn count_checked(&self, sequences: usize, drafts: &[Vec<u32>], taken: usize) {
        let stats = &self.shared.stats;
        stats.drafted.fetch_add(
            drafts.iter().map(Vec::len).sum::<usize>() as u64,
            Ordering::Relaxed,
        );
        stats
            .accepted_drafts
            .fetch_add(taken as u64, Ordering::Relaxed);
        // the step's count goes last: who sees it sees the step's drafts counted
        self.count_step(sequences, sequences + taken);
    }

    /// Takes each ready sequence's rows of a step that checked its draft (`rows`, sequence
    /// by sequence: its next token's, then one per drafted token) as plain decoding would:
    /// it samples row by row and goes on while the sampled token is the drafted one, and
    /// its cache keeps the positions of the tokens it took (`before[k]`: its length before
    /// the step). `hidden`: the rows' output hidden states (drafting with the prediction
    /// layer; else empty). Returns, for every active sequence, whether it goes on and how
    /// many drafted tokens it took.
    fn take_checked(
        &mut self,
        ready: &[usize],
        drafts: &[Vec<u32>],
        before: &[usize],
        mut rows: Vec<&mut [f32]>,
        hidden: &[f32],
    ) -> Vec<(bool, usize)> {
        let model = self.model.clone();
        let mtp_layer = self.mtp.clone();
        let by_model = (self.draft.is_some() || mtp_layer.is_some()) && self.config.adaptive_drafts;
        let counts: Vec<usize> = drafts.iter().map(|d| 1 + d.len()).collect();
        let tokens: usize = counts.iter().sum();
        let width = hidden.len() / tokens.max(1);
        let mut work: Vec<Option<Checked>> = Vec::new();
        work.resize_with(self.active.len(), || None);
        let mut row = tokens;
        for (k, &i) in ready.iter().enumerate().rev() {
            row -= counts[k];
            work[i] = Some(Checked {
                rows: rows.split_off(rows.len() - counts[k]),
                hidden: &hidden[row * width..(row + counts[k]) * width],
                draft: &drafts[k],
                before: before[k],
            });
        }
        self.active
            .par_iter_mut()
            .zip(work.par_iter_mut())
            .map(|(seq, w)| match w.take() {
                Some(Checked {
                    rows,
                    hidden,
                    draft,
                    before,
                }) => {
                    seq.next = None;
                    let mut taken = 0;
                    let mut goes_on = true;
                    for (j, row) in rows.into_iter().enumerate() {
                        goes_on = accept(&model, seq, row);
                        if !goes_on || j >= draft.len() || seq.next != Some(draft[j]) {
                            break;
                        }
                        taken += 1;
                    }
                    // the cache keeps the token that ran first and the drafts taken (a split
                    // sequence's slot on the lead is cut below, on the other ranks at their
                    // next step)
                    match &mut seq.cache {
                        Store::Local(c) => c.truncate(before + 1 + taken),
                        Store::Slot { len, .. } => *len = before + 1 + taken,
                    }
                    // what the draft model drafted past the draft holds where the whole draft
                    // was taken and the token sampled after it is its guess
                    let ahead_holds = taken == draft.len()
                        && seq.next.is_some()
                        && seq.ahead.first() == seq.next.as_ref();
                    if !ahead_holds {
                        seq.ahead.clear();
                        if let Some(dc) = &mut seq.draft_cache {
                            dc.truncate(dc.len().min(before + 1 + taken));
                        }
                    }
                    if let (false, Some(layer)) = (hidden.is_empty(), &mtp_layer) {
                        let width = hidden.len() / (1 + draft.len());
                        let kept = &hidden[..(1 + taken) * width];
                        mtp::record_hidden(&layer.transformer, seq, before, kept);
                        // fixed drafts are checked whatever is taken
                        if by_model {
                            mtp::checked(seq, draft.len(), taken);
                        }
                    }
                    if by_model && !draft.is_empty() {
                        seq.acceptance.record((taken + 1).min(draft.len()), taken);
                        seq.probe.checked(taken);
                    }
                    (goes_on, taken)
                }
                None => (true, 0),
            })
            .collect()
    }
}

impl Worker<'_> {
    /// The split step that checks the ready sequences' drafts. On a pipeline with a draft
    /// model, the lead's draft model drafts past each draft while the later stages check
    /// it ([`Worker::draft_ahead`]), a time in which the lead would wait.
    fn check_on_split(
        &mut self,
        ready: &[usize],
        tokens: &[u32],
        counts: &[usize],
        drafts: &[Vec<u32>],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if !self.pipelined() || self.draft.is_none() {
            return self.split_rows(ready, tokens, counts);
        }
        let (slots, want) = self.split_slots(ready, counts)?;
        // nothing is in flight: a step that checks drafts first collects every group
        self.lead_mut()?.submit_rows(&slots, tokens, counts, want)?;
        self.draft_ahead(ready, drafts);
        self.lead_mut()?.collect_rows()
    }

    /// Drafts past each ready sequence's draft (`drafts`, being checked) with the draft
    /// model, one token more than the draft: its guess of the token the check samples after
    /// the draft, then as many again (`Sequence::ahead`). The next draft where the check
    /// takes the whole draft and samples the guess.
    fn draft_ahead(&mut self, ready: &[usize], drafts: &[Vec<u32>]) {
        let Some(d) = self.draft.clone() else {
            return;
        };
        for (&i, draft) in ready.iter().zip(drafts) {
            let s = &mut self.active[i];
            s.ahead.clear();
            if draft.is_empty() {
                continue;
            }
            let mut context = context_of(s);
            context.extend_from_slice(draft);
            if let Some((ahead, _)) = draft_from_model(&d, s, &context, draft.len() + 1) {
                s.ahead = ahead;
            }
        }
    }
}

/// Steps one chain of checks runs at most before the scheduler admits, cancels and
/// prefills again.
const CHAIN_MAX: usize = 32;
/// The least chance that a step's whole draft and the guess after it are taken for the next
/// step to go in before it is collected: a guess that misses costs the later stages a step
/// of rows thrown away, about what one that holds saves.
const CHAIN_CHANCE: f64 = 0.5;

/// A step that checks drafts, submitted to a split: what each ready sequence runs (its next
/// token, `heads[k]`, then `drafts[k]`) and its cache length before.
struct Check {
    heads: Vec<u32>,
    drafts: Vec<Vec<u32>>,
    before: Vec<usize>,
}

impl Check {
    fn rows(&self) -> usize {
        self.drafts.iter().map(|d| 1 + d.len()).sum()
    }
}

impl Worker<'_> {
    /// Whether decode steps check prompt lookup's drafts in chains ([`Worker::check_in_chain`]):
    /// on a pipeline, drafting by lookup.
    pub(super) fn checks_in_chain(&self) -> bool {
        self.config.draft_max > 0 && self.pipelined() && self.draft.is_none() && self.mtp.is_none()
    }

    /// Speculation by prompt lookup on a pipeline, whose stages would wait on each other:
    /// while the later stages check a step's drafts, the lead already submits the next step,
    /// as if the check took every draft and sampled the token lookup guesses after them
    /// (that guess, then the lookup draft after it). Where the check does so for every ready
    /// sequence, the next step's rows are what plain decoding gives and the chain goes on;
    /// else they are collected and thrown away (the next step writes over their positions).
    /// A step goes in ahead only where every sequence's draft and guess are likely enough
    /// taken ([`CHAIN_CHANCE`]; always with fixed drafts), for at most [`CHAIN_MAX`] steps.
    /// Its draft lengths are chosen by what steps that went in ahead cost
    /// ([`Worker::chain_costs`]): with the stages overlapped, a row costs another share of
    /// the time than in a step that waits for its collection.
    fn check_in_chain(&mut self, ready: &[usize], drafts: &[Vec<u32>]) {
        let heads: Vec<u32> = ready.iter().filter_map(|&i| self.active[i].next).collect();
        if heads.len() != ready.len() {
            return self.fail_all("a ready sequence without its next token");
        }
        let vocab = self.model.transformer.config().vocab;
        let mut collected = Instant::now();
        let mut current = match self.submit_check(ready, heads, drafts.to_vec()) {
            Ok(c) => c,
            Err(e) => return self.fail_all(&format!("decoding failed: {e}")),
        };
        let mut results = Vec::new();
        for round in 1..=CHAIN_MAX {
            let ahead =
                if round < CHAIN_MAX && self.shared.stats.queued.load(Ordering::Relaxed) == 0 {
                    self.guess_past(ready, &current)
                } else {
                    None
                };
            let next = match ahead.map(|(heads, drafts)| self.submit_check(ready, heads, drafts)) {
                Some(Ok(c)) => Some(c),
                Some(Err(e)) => return self.fail_all(&format!("decoding failed: {e}")),
                None => None,
            };
            let mut logits = match self.lead_mut().and_then(|l| l.collect_rows()) {
                Ok(rows) => rows,
                Err(e) => return self.fail_all(&format!("decoding failed: {e}")),
            };
            let rows: Vec<&mut [f32]> = logits.iter_mut().map(Vec::as_mut_slice).collect();
            if rows.len() != current.rows() || rows.iter().any(|r| r.len() != vocab) {
                let msg = format!(
                    "decoding failed: {} rows of logits for {} tokens",
                    rows.len(),
                    current.rows()
                );
                return self.fail_all(&msg);
            }
            results = self.take_checked(ready, &current.drafts, &current.before, rows, &[]);
            // A step that went in ahead costs the time between two collections. The first
            // of a chain is timed only when none went in after it: it then stood alone.
            if self.config.adaptive_drafts {
                let seconds = collected.elapsed().as_secs_f64();
                if round > 1 {
                    self.chain_costs.record(current.rows(), seconds);
                } else if next.is_none() {
                    self.step_costs.record(current.rows(), seconds);
                }
            }
            collected = Instant::now();
            let taken: usize = results.iter().map(|r| r.1).sum();
            self.count_checked(ready.len(), &current.drafts, taken);
            let Some(next) = next else {
                break;
            };
            let holds = ready.iter().enumerate().all(|(k, &i)| {
                let (goes_on, taken) = results[i];
                goes_on
                    && taken == current.drafts[k].len()
                    && self.active[i].next == Some(next.heads[k])
            });
            if holds {
                self.shared
                    .stats
                    .overlapped_steps
                    .fetch_add(1, Ordering::Relaxed);
                // taking the step's rows cut each cache to them: the next step's rows are
                // in it too
                for (k, &i) in ready.iter().enumerate() {
                    if let Store::Slot { len, .. } = &mut self.active[i].cache {
                        *len = next.before[k] + 1 + next.drafts[k].len();
                    }
                }
                current = next;
                continue;
            }
            // the guess missed: the step after it ran on tokens that are not the sequence's
            self.shared
                .stats
                .discarded_steps
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.lead_mut().and_then(|l| l.collect_rows()) {
                return self.fail_all(&format!("decoding failed: {e}"));
            }
            break;
        }
        self.cut_slots(ready);
        self.retire_ended(&results);
    }

    /// Submits the split step that runs each ready sequence's `heads[k]` and `drafts[k]`
    /// after what its cache holds (or will hold once the steps in flight are done).
    fn submit_check(
        &mut self,
        ready: &[usize],
        heads: Vec<u32>,
        drafts: Vec<Vec<u32>>,
    ) -> Result<Check, EngineError> {
        let before: Vec<usize> = ready.iter().map(|&i| self.active[i].cache.len()).collect();
        let counts: Vec<usize> = drafts.iter().map(|d| 1 + d.len()).collect();
        let mut tokens = Vec::with_capacity(counts.iter().sum());
        for (h, d) in heads.iter().zip(&drafts) {
            tokens.push(*h);
            tokens.extend_from_slice(d);
        }
        let (slots, want) = self.split_slots(ready, &counts)?;
        self.lead_mut()?
            .submit_rows(&slots, &tokens, &counts, want)?;
        Ok(Check {
            heads,
            drafts,
            before,
        })
    }

    /// The step after `check` (in flight) as if it took every draft: for each ready
    /// sequence, the token prompt lookup guesses after its draft and the lookup draft after
    /// that guess, as long as [`Worker::drafts`] would make it. None where a sequence has no
    /// guess, is constrained, would end by then, or (adaptive) where the chance that
    /// every draft and guess are taken is below [`CHAIN_CHANCE`].
    fn guess_past(&mut self, ready: &[usize], check: &Check) -> Option<(Vec<u32>, Vec<Vec<u32>>)> {
        let adaptive = self.config.adaptive_drafts;
        let step_max = crate::parallel::MAX_ROWS_PER_SEQUENCE - 1;
        let mut chance = 1.0;
        let mut heads = Vec::with_capacity(ready.len());
        let mut lookups = Vec::with_capacity(ready.len());
        let mut shadows = Vec::with_capacity(ready.len());
        for (k, &i) in ready.iter().enumerate() {
            let s = &self.active[i];
            let drafted = check.drafts[k].len();
            // tokens the sequence has once the check took its whole draft and sampled
            let generated = s.generated + 1 + drafted;
            if s.job.request.constraint.is_some() || generated >= s.job.request.max_tokens {
                return None;
            }
            let room = s.cache.capacity().saturating_sub(s.cache.len() + 1);
            let left = s.job.request.max_tokens.saturating_sub(generated + 1);
            let max = self.config.draft_max.min(room).min(left).min(step_max);
            let mut context = context_of(s);
            context.extend_from_slice(&check.drafts[k]);
            let mut lookup = crate::lookup::draft(&context, 1 + max);
            if lookup.is_empty() {
                return None;
            }
            chance *= s.acceptance.all_taken(drafted + 1);
            shadows.push((s.generated_ids.len() + drafted, lookup.clone()));
            heads.push(lookup.remove(0));
            lookups.push(lookup);
        }
        if adaptive && chance < CHAIN_CHANCE {
            return None;
        }
        if adaptive {
            // the guesses and lookup drafts are scored against what follows, as lookup's
            // drafts before a step are
            for (&i, (at, lookup)) in ready.iter().zip(shadows) {
                self.active[i].shadows.push(at, lookup);
            }
            let candidates: Vec<Candidate> = ready
                .iter()
                .zip(&lookups)
                .map(|(&i, l)| Candidate {
                    available: l.len(),
                    acceptance: &self.active[i].acceptance,
                })
                .collect();
            let lengths = choose(&self.chain_costs, &candidates, 0.0);
            for (l, k) in lookups.iter_mut().zip(lengths) {
                l.truncate(k);
            }
        }
        Some((heads, lookups))
    }
}

/// A sequence's context: its prompt and every generated token (the last one, its `next`,
/// not yet run).
fn context_of(s: &Sequence) -> Vec<u32> {
    let mut context = s.job.request.prompt.clone();
    context.extend_from_slice(&s.generated_ids);
    context
}

/// A sequence's part of a speculative step: the logits of its rows (its next token's, then
/// one per drafted token), its draft, and its cache length before the step.
struct Checked<'a> {
    rows: Vec<&'a mut [f32]>,
    /// The model's output hidden states of its rows (drafting with the prediction layer;
    /// else empty).
    hidden: &'a [f32],
    draft: &'a [u32],
    before: usize,
}

/// Up to `max` tokens the draft model `d` picks greedily after `context` (whose last token
/// is `seq`'s next), and the time their steps took: its cache first catches up with the
/// context before that token (not counted), then each drafted token is fed back. After a
/// failure the sequence decodes without drafts.
fn draft_from_model(
    d: &LoadedModel,
    seq: &mut Sequence,
    context: &[u32],
    max: usize,
) -> Option<(Vec<u32>, Duration)> {
    if seq.draft_failed {
        return None;
    }
    let capacity = seq.cache.capacity();
    let dc = seq
        .draft_cache
        .get_or_insert_with(|| d.transformer.new_cache(capacity));
    let known = context.len() - 1;
    if dc.len() > known {
        dc.truncate(known);
    }
    let run = |dc: &mut KvCache| -> Result<(Vec<u32>, Duration), EngineError> {
        if dc.len() < known {
            d.transformer.prefill(&context[dc.len()..known], dc)?;
        }
        let started = Instant::now();
        let mut out = Vec::with_capacity(max);
        let mut t = context[known];
        for _ in 0..max {
            if dc.len() + 1 > dc.capacity() {
                break;
            }
            let logits = d.transformer.forward_last(&[t], dc)?;
            t = crate::transformer::argmax(&logits) as u32;
            out.push(t);
        }
        Ok((out, started.elapsed()))
    };
    match run(dc) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!("the draft model failed, decoding on without it: {e}");
            seq.draft_cache = None;
            seq.draft_failed = true;
            None
        }
    }
}
