//! The queue between the [`Scheduler`](super::Scheduler) handle and its thread ([`Shared`]:
//! the waiting [`Job`]s, the wake-up, the counters and a split's failure), and a slot's
//! life on the thread: admitting queued sequences into free slots (refusing the ones that
//! cannot run), and retiring a sequence when it leaves, its cache kept for a later request.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use shoal_model::tokenizer::StreamDecoder;

use super::prefix_cache::Parked;
use super::step::finish;
use super::worker::{Sequence, Worker};
use super::{Event, SchedulerStats, SequenceRequest, Sink};
use crate::sampler::Sampler;
use crate::stop::StopMatcher;

pub(super) struct Job {
    pub(super) request: SequenceRequest,
    pub(super) sink: Sink,
    pub(super) cancelled: Arc<AtomicBool>,
    pub(super) submitted: Instant,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) waiting: VecDeque<Job>,
    pub(super) shutdown: bool,
    /// Set by [`Scheduler::retire`](super::Scheduler::retire): interrupt every sequence with
    /// this reason and end the thread; later ones are interrupted as they are submitted.
    pub(super) retire: Option<String>,
}

#[derive(Default)]
pub(super) struct Shared {
    pub(super) queue: Mutex<Queue>,
    pub(super) wake: Condvar,
    pub(super) stats: SchedulerStats,
    /// Why a split model stopped working, once it has.
    pub(super) failure: Mutex<Option<String>>,
    /// Whether the thread has ended (set as its last act, also when it panicked).
    pub(super) exited: Mutex<bool>,
    pub(super) exited_wake: Condvar,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("stats", &self.stats)
            .finish()
    }
}

/// What [`Worker::admit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// Sequences hold slots.
    Busy,
    /// Nothing to do.
    Idle,
    /// The scheduler is being dropped.
    Shutdown,
}

impl Worker<'_> {
    /// Moves queued sequences into free slots; with `wait`, waits while there is nothing to
    /// do.
    pub(super) fn admit(&mut self, wait: bool) -> Admit {
        let shared = self.shared.clone();
        let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(why) = q.retire.clone() {
                for job in q.waiting.drain(..) {
                    let mut sink = job.sink;
                    sink(Event::Interrupted(why.clone()));
                }
                drop(q);
                self.fail_all(&why);
                return Admit::Shutdown;
            }
            if q.shutdown {
                for job in q.waiting.drain(..) {
                    let mut sink = job.sink;
                    sink(Event::Failed("the server is shutting down".into()));
                }
                return Admit::Shutdown;
            }
            while self.active.len() < self.config.max_batch {
                let Some(front) = q.waiting.front() else {
                    break;
                };
                if !front.cancelled.load(Ordering::Acquire)
                    && self.worth_waiting(&front.request.prompt)
                {
                    break;
                }
                let Some(job) = q.waiting.pop_front() else {
                    break;
                };
                if job.cancelled.load(Ordering::Acquire) {
                    continue;
                }
                if let Some(seq) = self.start_sequence(job) {
                    self.active.push(seq);
                }
            }
            self.shared
                .stats
                .queued
                .store(q.waiting.len(), Ordering::Relaxed);
            self.shared
                .stats
                .active
                .store(self.active.len(), Ordering::Relaxed);
            if !self.active.is_empty() {
                return Admit::Busy;
            }
            if !wait {
                return Admit::Idle;
            }
            q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn start_sequence(&mut self, job: Job) -> Option<Sequence> {
        let mut job = job;
        let r = &job.request;
        let ctx = self.config.ctx;
        let fail = |job: &mut Job, msg: String| {
            (job.sink)(Event::Failed(msg));
        };
        if r.prompt.is_empty() {
            fail(&mut job, "the prompt is empty".into());
            return None;
        }
        if r.prompt.len() >= ctx {
            let msg = format!(
                "the prompt is {} tokens; this model is served with a context of {ctx} tokens",
                r.prompt.len()
            );
            fail(&mut job, msg);
            return None;
        }
        if let Err(e) = r.sampler.validate() {
            fail(&mut job, e);
            return None;
        }
        if self.broken {
            let msg = format!(
                "this split model is out of service ({}); the cluster re-places it, retry shortly",
                self.failure()
            );
            (job.sink)(Event::Interrupted(msg));
            return None;
        }
        // the resumed tokens are in the prompt and count towards max_tokens
        let capacity = (r.prompt.len() + r.max_tokens.max(1))
            .saturating_sub(r.resume.len())
            .min(ctx);
        let (cache, cached, mtp) = match self.cache_for(&r.prompt, capacity) {
            Ok(c) => c,
            Err(msg) => {
                fail(&mut job, msg);
                return None;
            }
        };
        let stats = &self.shared.stats;
        stats.sequences.fetch_add(1, Ordering::Relaxed);
        if cached > 0 {
            stats.prefix_hits.fetch_add(1, Ordering::Relaxed);
            stats
                .cached_prompt_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
        }
        let mut sampler = Sampler::new(r.sampler.clone());
        sampler.observe(&r.prompt);
        let stops = StopMatcher::new(&r.stop);
        let decoder = StreamDecoder::new(!r.special_text);
        let mut seq = Sequence {
            job,
            cache,
            sampler,
            prefilled: cached,
            decoder,
            stops,
            generated: 0,
            generated_ids: Vec::new(),
            cached,
            counts: HashMap::new(),
            next: None,
            first_token: None,
            draft_cache: None,
            ahead: Vec::new(),
            mtp,
            draft_failed: false,
            acceptance: Default::default(),
            shadows: Default::default(),
            probe: Default::default(),
        };
        match self.replay_resumed(&mut seq) {
            Ok(None) => Some(seq),
            // it had reached its end when it stopped: it ends as it would have
            Ok(Some(reason)) => {
                finish(&mut seq, reason);
                None
            }
            Err(e) => {
                (seq.job.sink)(Event::Failed(e));
                None
            }
        }
    }

    /// Whether every slot is taken by a sequence or a kept cache.
    pub(super) fn slots_full(&self) -> bool {
        self.parked.len() + self.active.len() >= self.config.max_batch
    }

    /// Ends `seq`'s hold on its slot. A sequence that ended well (finished or cancelled,
    /// not failed) leaves its cache kept for a later request that starts the same way
    /// (unless the prefix cache is off); the oldest kept caches go when the caches held,
    /// running and kept, would outnumber the slots.
    pub(super) fn retire(&mut self, seq: Sequence, healthy: bool) {
        if !healthy || self.broken || !self.config.prefix_cache {
            return;
        }
        let tokens = seq.history();
        if tokens.is_empty() {
            return;
        }
        self.parked.push(Parked {
            cache: seq.cache,
            tokens,
            mtp: seq.mtp,
        });
        while self.parked.len() + self.active.len() > self.config.max_batch {
            self.parked.remove(0);
        }
        self.count_kept();
    }

    pub(super) fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            let seq = &self.active[i];
            // a sequence in flight leaves when its group is back (its slot is busy till then)
            let in_flight = seq.cache.slot().is_some_and(|s| self.in_flight.holds(s));
            if seq.job.cancelled.load(Ordering::Acquire) && !in_flight {
                let seq = self.active.remove(i);
                self.retire(seq, true);
            } else {
                i += 1;
            }
        }
    }
}
