//! Decode steps that overlap on a pipeline. On a split of several stages, a batched step
//! keeps one stage busy at a time: stage 1 waits while stage 0 computes, then the other way
//! round. Here the ready sequences go out instead in groups, one per stage, each a batched
//! step submitted without waiting for the one before ([`Lead::submit_rows`]): while the last
//! stage computes one group's tokens, the first computes another's, and the link's latency
//! is hidden behind the other groups' work. A group is collected ([`Lead::collect_rows`])
//! when every stage has one in flight or nothing else is ready; its sequences sample as a
//! batched step's would and go out again in a later group.
//!
//! Groups are not always faster: each reads the stage's weights again, so where a step's
//! cost hardly grows with its rows (few sequences, weights read from memory) and the stages
//! are uneven, one batched step of every sequence can give more tokens per second. Which
//! way goes out is measured ([`GroupChoice`]): rounds of a few steps alternate between one
//! group and one per stage for each number of sequences decoding, and the faster one is
//! kept, with the other tried again now and then.
//!
//! A sequence in flight keeps its slot until its group comes back: its cancellation waits
//! for that, and everything else that uses the lead (a prompt chunk, a speculative step, a
//! new sequence taking a slot) first collects every group in flight ([`Worker::settle`]).
//!
//! [`Lead::submit_rows`]: crate::parallel::Lead::submit_rows
//! [`Lead::collect_rows`]: crate::parallel::Lead::collect_rows

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::step::{want_for, widest, StepLogits};
use super::worker::{Store, Worker};
use crate::parallel::Want;

/// Groups collected per measured round.
const ROUND_GROUPS: usize = 8;
/// Every this many rounds for a number of sequences, the way measured slower is tried again.
const RETRY_EVERY: u32 = 16;
/// A rate's weight against a new round's.
const RATE_KEEP: f64 = 0.5;

/// The groups submitted and not yet collected, oldest first: each group's slots in the
/// order its rows come back; and how many groups the ready sequences go out in.
#[derive(Default)]
pub(super) struct InFlight {
    groups: VecDeque<Vec<usize>>,
    choice: GroupChoice,
}

/// Whether decode steps on a pipeline go out as one batched step or as one group per stage,
/// by the tokens per second each gave with as many sequences decoding.
#[derive(Debug, Default)]
pub(super) struct GroupChoice {
    /// Per number of sequences decoding: tokens/s with one group and with one per stage
    /// (averaged over rounds), and rounds run.
    rates: HashMap<usize, ([Option<f64>; 2], u32)>,
    round: Option<Round>,
}

#[derive(Debug)]
struct Round {
    decoding: usize,
    /// 0: one group; 1: one per stage.
    way: usize,
    started: Instant,
    tokens: usize,
    groups: usize,
}

impl GroupChoice {
    /// How many groups `decoding` sequences go out in now, on `stages` stages (starting a
    /// measured round when none runs).
    pub(super) fn groups(&mut self, decoding: usize, stages: usize) -> usize {
        if decoding < 2 || stages < 2 {
            self.round = None;
            return 1;
        }
        if let Some(r) = self.round.as_ref().filter(|r| r.decoding == decoding) {
            return if r.way == 0 { 1 } else { stages };
        }
        let way = self.pick(decoding);
        self.round = Some(Round {
            decoding,
            way,
            started: Instant::now(),
            tokens: 0,
            groups: 0,
        });
        if way == 0 {
            1
        } else {
            stages
        }
    }

    /// The way a new round for `decoding` sequences takes: one not measured yet (one per
    /// stage first), now and then the slower one, else the faster.
    fn pick(&self, decoding: usize) -> usize {
        match self.rates.get(&decoding) {
            None | Some(([_, None], _)) => 1,
            Some(([None, _], _)) => 0,
            Some(([Some(one), Some(per_stage)], rounds)) => {
                let faster = usize::from(per_stage >= one);
                if rounds % RETRY_EVERY == RETRY_EVERY - 1 {
                    1 - faster
                } else {
                    faster
                }
            }
        }
    }

    /// Counts a collected group of `tokens` sequences while `decoding` sequences decode;
    /// ends the round after [`ROUND_GROUPS`] groups (a round whose number of sequences
    /// changed is not counted).
    pub(super) fn collected(&mut self, tokens: usize, decoding: usize) {
        let Some(r) = self.round.as_mut() else {
            return;
        };
        if r.decoding != decoding {
            self.round = None;
            return;
        }
        r.tokens += tokens;
        r.groups += 1;
        if r.groups < ROUND_GROUPS {
            return;
        }
        let rate = r.tokens as f64 / r.started.elapsed().as_secs_f64().max(1e-9);
        let (decoding, way) = (r.decoding, r.way);
        tracing::debug!(
            "pipelined decode of {decoding} sequences in {} group(s): {rate:.1} tokens/s",
            if way == 0 { "one" } else { "one per stage" }
        );
        self.round = None;
        self.record(decoding, way, rate);
    }

    fn record(&mut self, decoding: usize, way: usize, rate: f64) {
        let (rates, rounds) = self.rates.entry(decoding).or_default();
        rates[way] = Some(match rates[way] {
            Some(old) => RATE_KEEP * old + (1.0 - RATE_KEEP) * rate,
            None => rate,
        });
        *rounds += 1;
    }
}

impl InFlight {
    /// Whether `slot`'s sequence is in a group in flight.
    pub(super) fn holds(&self, slot: usize) -> bool {
        self.groups.iter().any(|g| g.contains(&slot))
    }

    /// Sequences in flight.
    fn sequences(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.groups.clear();
    }
}

impl Worker<'_> {
    /// Whether decode steps overlap: the model is split into several pipeline stages.
    pub(super) fn pipelined(&self) -> bool {
        self.lead.as_ref().is_some_and(|l| l.stages() > 1)
    }

    /// One move of the overlapped decode: submits a group of the `ready` sequences (indices
    /// into `active`) while fewer groups than stages are in flight, else collects the
    /// oldest group and samples its sequences' next tokens.
    pub(super) fn pipelined_decode(&mut self, ready: &[usize]) {
        let stages = self.lead.as_ref().map_or(1, |l| l.stages());
        let decoding = ready.len() + self.in_flight.sequences();
        let groups = self.in_flight.choice.groups(decoding, stages);
        if !ready.is_empty() && self.in_flight.groups.len() < groups {
            // groups of even size
            let size = decoding.div_ceil(groups).max(1);
            self.submit_group(&ready[..ready.len().min(size)]);
        } else if !self.in_flight.is_empty() {
            self.collect_group();
        }
    }

    /// Collects every group in flight (before anything else uses the lead).
    pub(super) fn settle(&mut self) {
        while !self.in_flight.is_empty() {
            self.collect_group();
        }
    }

    fn submit_group(&mut self, group: &[usize]) {
        let mut slots = Vec::with_capacity(group.len());
        let mut tokens = Vec::with_capacity(group.len());
        let mut want = Want::Best;
        for &i in group {
            let seq = &mut self.active[i];
            let (Store::Slot { slot, len, .. }, Some(tok)) = (&mut seq.cache, seq.next.take())
            else {
                self.fail_all("a local sequence in a pipelined step");
                return;
            };
            slots.push(*slot);
            tokens.push(tok);
            *len += 1;
            want = widest(want, want_for(&seq.job.request));
        }
        let overlapped = !self.in_flight.is_empty();
        let Some(lead) = self.lead.as_mut() else {
            self.fail_all("a split sequence without a lead");
            return;
        };
        if let Err(e) = lead.submit_rows(&slots, &tokens, &vec![1; slots.len()], want) {
            self.fail_all(&format!("decoding failed: {e}"));
            return;
        }
        self.count_step(group.len(), group.len());
        if overlapped {
            self.shared
                .stats
                .overlapped_steps
                .fetch_add(1, Ordering::Relaxed);
        }
        self.in_flight.groups.push_back(slots);
    }

    fn collect_group(&mut self) {
        let decoding =
            self.in_flight.sequences() + self.active.iter().filter(|s| s.next.is_some()).count();
        let Some(slots) = self.in_flight.groups.pop_front() else {
            return;
        };
        let rows = match self.lead.as_mut().map(|l| l.collect_rows()) {
            Some(Ok(rows)) if rows.len() == slots.len() => rows,
            Some(Ok(rows)) => {
                let why = format!(
                    "decoding failed: {} rows of logits for {} sequences",
                    rows.len(),
                    slots.len()
                );
                return self.fail_all(&why);
            }
            Some(Err(e)) => return self.fail_all(&format!("decoding failed: {e}")),
            None => return self.fail_all("a split sequence without a lead"),
        };
        self.in_flight.choice.collected(slots.len(), decoding);
        // The sequences of a group in flight stay in `active` until it is collected (their
        // cancellation waits), so each slot is found.
        let mut members = Vec::with_capacity(slots.len());
        for slot in &slots {
            match self
                .active
                .iter()
                .position(|s| s.cache.slot() == Some(*slot))
            {
                Some(i) => members.push(i),
                None => return self.fail_all("a sequence in flight left its slot"),
            }
        }
        // rows in the order of `active`, as a batched step's are
        let mut paired: Vec<(usize, Vec<f32>)> = members.into_iter().zip(rows).collect();
        paired.sort_by_key(|p| p.0);
        let (ready, rows): (Vec<usize>, Vec<Vec<f32>>) = paired.into_iter().unzip();
        self.take_rows(&ready, StepLogits::Rows(rows));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one round of `decoding` sequences on 2 stages and returns its groups.
    fn round(c: &mut GroupChoice, decoding: usize) -> usize {
        let groups = c.groups(decoding, 2);
        for _ in 0..ROUND_GROUPS {
            assert_eq!(c.groups(decoding, 2), groups, "a round keeps its way");
            c.collected(decoding / groups, decoding);
        }
        groups
    }

    #[test]
    fn one_sequence_or_one_stage_goes_out_whole() {
        let mut c = GroupChoice::default();
        assert_eq!(c.groups(1, 4), 1);
        assert_eq!(c.groups(8, 1), 1);
    }

    #[test]
    fn both_ways_are_measured_then_the_faster_kept_and_the_other_retried() {
        let mut c = GroupChoice::default();
        // not measured: one group per stage, then one group
        assert_eq!(round(&mut c, 4), 2);
        assert_eq!(round(&mut c, 4), 1);
        // another number of sequences is measured apart
        assert_eq!(c.groups(6, 2), 2);
        // one group measured faster for 4 sequences: kept, but tried the other way at
        // every RETRY_EVERY-th round
        c.rates.insert(4, ([Some(50.0), Some(40.0)], 2));
        let ways: Vec<usize> = (0..RETRY_EVERY).map(|_| round(&mut c, 4)).collect();
        assert_eq!(ways.iter().filter(|&&g| g == 2).count(), 1, "{ways:?}");
        assert!(ways.iter().take(5).all(|&g| g == 1), "{ways:?}");
        // and the other way round
        c.rates.insert(4, ([Some(40.0), Some(50.0)], 2));
        assert_eq!(round(&mut c, 4), 2);
    }

    #[test]
    fn a_round_whose_sequences_changed_is_not_counted() {
        let mut c = GroupChoice::default();
        assert_eq!(c.groups(4, 2), 2);
        c.collected(2, 4);
        c.collected(2, 3);
        assert!(c.round.is_none());
        assert!(c.rates.is_empty());
        // a finished round is
        round(&mut c, 4);
        let (rates, rounds) = c.rates[&4];
        assert!(rates[1].is_some_and(|r| r > 0.0) && rates[0].is_none());
        assert_eq!(rounds, 1);
    }
}
