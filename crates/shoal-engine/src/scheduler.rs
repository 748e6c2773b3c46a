//! Continuous batching: many requests share one model, and every decode step runs one token of
//! every active sequence through the weights together ([`Transformer::forward_batch`]), so the
//! weights are read once per step instead of once per sequence.
//!
//! A [`Scheduler`] owns a loaded model on its own thread. [`Scheduler::submit`] queues a
//! sequence (refusing with [`Busy`] when the bounded queue is full) and hands back a
//! [`Ticket`]; the thread admits queued sequences while there are free slots, runs at most one
//! prompt chunk per iteration (so a long prompt delays running streams by one chunk, not by
//! the whole prompt), then one batched decode step over every sequence that is generating.
//! Each sequence samples with its own sampler, penalties, optional [`TokenConstraint`] and stop
//! strings, and reports through its [`Sink`]. A sequence leaves the batch the step after its
//! sink refuses an event or its ticket is dropped (the client went away), so its slot is free
//! at once.
//!
//! The same scheduler serves a model split over ranks ([`Scheduler::start_split`]): the
//! scheduler thread then leads the split ([`Lead`]), each slot is one of the lead's
//! sequences (its KV cache lives on every rank), a prefill chunk is one step on every rank
//! and a decode step is one batched step of every ready sequence on every rank (each rank
//! reads its weights once for the batch). A failed step breaks the split: every sequence in it fails, later ones are
//! refused at once, and [`Scheduler::failure`] says why (the cluster then re-places it).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use shoal_model::tokenizer::StreamDecoder;

use crate::model::LoadedModel;
use crate::parallel::{Lead, RankContext, Want};
use crate::sampler::{Sampler, SamplerConfig};
use crate::stop::{FinishReason, StopMatcher};
use crate::{EngineError, KvCache};

/// Prompt tokens run per scheduler iteration at most: a long prompt delays the decode
/// steps of running sequences by one chunk at a time, and bounds attention's scratch.
pub const PROMPT_CHUNK: usize = 512;

/// Prompt positions a queued request must gain by waiting for a running prompt to finish
/// before it waits rather than starts ([`Worker::worth_waiting`]).
const WAIT_FOR_SHARE: usize = 64;

/// Restricts which tokens may come next (constrained decoding: JSON schemas, forced tool
/// calls). Implemented by the constraint engine; the scheduler only calls it.
pub trait TokenConstraint: Send {
    /// Sets the logit of every token that may not come next to `-inf`.
    ///
    /// # Errors
    /// When the constraint cannot continue (nothing is allowed).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), EngineError>;
    /// Records the chosen token.
    ///
    /// # Errors
    /// When `token` was not allowed.
    fn commit(&mut self, token: u32) -> Result<(), EngineError>;
    /// Whether the output is complete and nothing more may follow.
    fn is_finished(&self) -> bool;
}

/// What one sequence asks for.
pub struct SequenceRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Temperature, top-k/p, min-p, repetition penalty and seed.
    pub sampler: SamplerConfig,
    /// Subtracted from the logit of every token generated at least once (OpenAI's
    /// `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the generated text (OpenAI's
    /// `frequency_penalty`).
    pub frequency_penalty: f32,
    /// Strings that end generation (not included in the text).
    pub stop: Vec<String>,
    /// Report each token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// What the output must follow, if anything.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Keep going through end-of-generation tokens.
    pub ignore_eos: bool,
    /// Write control tokens' text into the output (they give none otherwise): for output
    /// parsers that read markup made of them, such as gpt-oss's harmony channels or a
    /// family whose `<think>` or tool-call markers are control tokens. End-of-generation
    /// tokens end the output either way.
    pub special_text: bool,
    /// Tokens this request already generated on an instance that was lost (empty for a new
    /// request): they run after the prompt, count towards `max_tokens`, penalties, stop
    /// strings and the constraint, and their text is not sent again, so the sequence goes
    /// on from the next token as if it had never stopped.
    pub resume: Vec<u32>,
    /// Report each resumed token as an [`Event::Token`] (with the text it released then, and
    /// no log-probabilities) before the first new one, for a caller that must rebuild its own
    /// output state from them (a node taking over a stream another node was serving).
    pub report_resumed: bool,
}

impl std::fmt::Debug for SequenceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceRequest")
            .field("prompt_tokens", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .field("sampler", &self.sampler)
            .field("constrained", &self.constraint.is_some())
            .field("resumed_tokens", &self.resume.len())
            .field("report_resumed", &self.report_resumed)
            .finish()
    }
}

/// A token's log-probability and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// How a sequence ended, with its counts and timings.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Why it ended.
    pub reason: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop: Option<String>,
    /// Prompt tokens processed.
    pub prompt_tokens: usize,
    /// Of the prompt tokens, those a finished sequence's cache already held (not run again).
    pub cached_tokens: usize,
    /// Tokens generated (an end-of-generation token is not counted).
    pub completion_tokens: usize,
    /// From submission to the first sampled token.
    pub time_to_first_token: Duration,
    /// From submission to the end.
    pub total: Duration,
}

/// What a sequence reports, in order: tokens, then exactly one `Done`, `Failed` or
/// `Interrupted`.
#[derive(Debug, Clone)]
pub enum Event {
    /// A generated token (`id`), the text that became final with it (possibly empty while a
    /// character or a possible stop string is incomplete), and its log-probabilities when
    /// asked for.
    Token {
        /// The token id.
        id: u32,
        /// Text that became final.
        text: String,
        /// Log-probabilities, when the request asked for them.
        logprob: Option<TokenLogprob>,
    },
    /// Text released at the end without a token of its own (held back for a stop string that
    /// did not match).
    Text(String),
    /// The sequence ended normally.
    Done(Finished),
    /// The sequence failed; the message says why.
    Failed(String),
    /// A split model lost a rank (or was already out of service): nothing is wrong with
    /// the request, which may go on where the model is placed next, with
    /// [`SequenceRequest::resume`] holding the tokens it generated. The message says what
    /// broke.
    Interrupted(String),
}

/// Receives a sequence's events; returns `false` when nobody is listening any more, which
/// cancels the sequence.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

/// The queue is full: the caller should answer "overloaded" and let the client retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    /// Sequences waiting.
    pub queued: usize,
}

/// Held by whoever waits for a sequence; dropping it cancels the sequence.
#[derive(Debug)]
pub struct Ticket {
    cancelled: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl Ticket {
    /// Cancels the sequence now.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.shared.wake.notify_all();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Limits of a scheduler.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Sequences generating at once at most (the batch size).
    pub max_batch: usize,
    /// Sequences waiting for a slot at most (beyond the free slots); more are refused with
    /// [`Busy`].
    pub max_queue: usize,
    /// Context length of each sequence (prompt plus generated tokens).
    pub ctx: usize,
    /// Whether a sequence starts from the KV cache of an ended or running one that shares
    /// the start of its prompt (else every prompt runs whole and no cache is kept).
    pub prefix_cache: bool,
    /// Speculative decoding: at most this many tokens drafted per step (0: off), by the
    /// draft model when the scheduler has one ([`Scheduler::start_with_draft`]), else by
    /// prompt lookup from the sequence's own context. One rank only; a split model ignores
    /// it.
    pub draft_max: usize,
}

/// Counters the scheduler keeps for metrics.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Sequences waiting for a slot.
    pub queued: AtomicUsize,
    /// Sequences holding a slot.
    pub active: AtomicUsize,
    /// Sequences in the last decode step.
    pub last_batch: AtomicUsize,
    /// Decode steps run.
    pub decode_steps: AtomicU64,
    /// Tokens decoded in those steps (their sum of batch sizes).
    pub decoded_tokens: AtomicU64,
    /// Prompt tokens run.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from a kept or running sequence's cache instead of run.
    pub cached_prompt_tokens: AtomicU64,
    /// Sequences that started from another's cache.
    pub prefix_hits: AtomicU64,
    /// Sequences started.
    pub sequences: AtomicU64,
    /// Positions held by the caches kept for later requests.
    pub kept_tokens: AtomicU64,
    /// The model's KV bytes for those positions (over every rank of a split model).
    pub kept_bytes: AtomicU64,
    /// Tokens drafted (by prompt lookup or the draft model) and checked.
    pub drafted: AtomicU64,
    /// Of those, the ones the model agreed with (emitted without a step of their own).
    pub accepted_drafts: AtomicU64,
}

struct Job {
    request: SequenceRequest,
    sink: Sink,
    cancelled: Arc<AtomicBool>,
    submitted: Instant,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Job>,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    stats: SchedulerStats,
    /// Why a split model stopped working, once it has.
    failure: Mutex<Option<String>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("stats", &self.stats)
            .finish()
    }
}

/// A model served to many sequences at once from one thread.
#[derive(Debug)]
pub struct Scheduler {
    model: Arc<LoadedModel>,
    config: SchedulerConfig,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the scheduler thread for `model`.
    ///
    /// # Errors
    /// When the thread cannot be started or the limits are zero.
    pub fn start(model: Arc<LoadedModel>, config: SchedulerConfig) -> Result<Self, EngineError> {
        Self::spawn(model, config, None)
    }

    /// Starts the scheduler thread for a split model: `model` is rank 0's shard and `ctx`
    /// rank 0's place in the split. Each of the `max_batch` slots is a sequence of `ctx`
    /// tokens on every rank. Dropping the scheduler tells the other ranks to stop.
    ///
    /// # Errors
    /// When `ctx` is not rank 0's, the limits are zero or above what a lead holds, or the
    /// thread cannot be started.
    pub fn start_split(
        model: Arc<LoadedModel>,
        ctx: RankContext,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        if ctx.rank != 0 {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "rank {} cannot schedule a split model; rank 0 does",
                    ctx.rank
                ),
            });
        }
        if config.max_batch > crate::parallel::MAX_SEQUENCES {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "{} slots for a split model (at most {})",
                    config.max_batch,
                    crate::parallel::MAX_SEQUENCES
                ),
            });
        }
        Self::spawn(model, config, Some(ctx))
    }

    /// Starts the scheduler thread for `model` with `draft`, a smaller model with the same
    /// vocabulary, drafting `config.draft_max` tokens per step for `model` to check.
    ///
    /// # Errors
    /// As [`Scheduler::start`], and when the vocabularies differ.
    pub fn start_with_draft(
        model: Arc<LoadedModel>,
        draft: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        let (a, b) = (&model.tokenizer, &draft.tokenizer);
        let same = a.vocab_size() == b.vocab_size()
            && (0..a.vocab_size() as u32).all(|t| a.token_bytes(t) == b.token_bytes(t));
        if !same || model.transformer.config().vocab != draft.transformer.config().vocab {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "draft model {} does not share {}'s vocabulary; a draft model must use the same tokenizer",
                    draft.name, model.name
                ),
            });
        }
        Self::spawn_with(model, config, None, Some(draft))
    }

    fn spawn(
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
        split: Option<RankContext>,
    ) -> Result<Self, EngineError> {
        Self::spawn_with(model, config, split, None)
    }

    fn spawn_with(
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
        split: Option<RankContext>,
        draft: Option<Arc<LoadedModel>>,
    ) -> Result<Self, EngineError> {
        if config.max_batch == 0 || config.ctx < 2 {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "a scheduler with {} slots and a context of {} tokens (need at least 1 slot and 2 tokens)",
                    config.max_batch, config.ctx
                ),
            });
        }
        let shared = Arc::new(Shared::default());
        let thread = {
            let (model, shared) = (model.clone(), shared.clone());
            std::thread::Builder::new()
                .name(format!("shoal-sched-{}", model.name))
                .spawn(move || {
                    let held = model.clone();
                    let lead = match split {
                        None => None,
                        Some(ctx) => match Lead::with_sequences(
                            ctx,
                            &held.transformer,
                            config.ctx,
                            config.max_batch,
                        ) {
                            Ok(l) => Some(l),
                            Err(e) => {
                                *shared.failure.lock().unwrap_or_else(|e| e.into_inner()) =
                                    Some(format!("cannot lead the split: {e}"));
                                None
                            }
                        },
                    };
                    let broken = split_failed(&shared);
                    let mut w = Worker::new(model, config, shared, lead, broken);
                    w.draft = draft;
                    w.run()
                })
                .map_err(|e| {
                    EngineError::Generation(format!("cannot start the scheduler thread: {e}"))
                })?
        };
        Ok(Scheduler {
            model,
            config,
            shared,
            thread: Some(thread),
        })
    }

    /// The model served.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    /// The limits.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Live counters.
    pub fn stats(&self) -> &SchedulerStats {
        &self.shared.stats
    }

    /// Why the split model this scheduler leads stopped working (a rank failed or could not
    /// be reached), once it has; always `None` for a model on one rank.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Queues a sequence; its events go to `sink` from the scheduler thread.
    ///
    /// # Errors
    /// [`Busy`] when the queue is full.
    pub fn submit(&self, mut request: SequenceRequest, sink: Sink) -> Result<Ticket, Busy> {
        // from here on the resumed tokens are part of what the cache must hold
        request.prompt.extend_from_slice(&request.resume);
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        let active = self.shared.stats.active.load(Ordering::Relaxed);
        let free_slots = self.config.max_batch.saturating_sub(active);
        if q.waiting.len() >= self.config.max_queue + free_slots {
            return Err(Busy {
                queued: q.waiting.len(),
            });
        }
        q.waiting.push_back(Job {
            request,
            sink,
            cancelled: cancelled.clone(),
            submitted: Instant::now(),
        });
        self.shared
            .stats
            .queued
            .store(q.waiting.len(), Ordering::Relaxed);
        drop(q);
        self.shared.wake.notify_all();
        Ok(Ticket {
            cancelled,
            shared: self.shared.clone(),
        })
    }
}

/// A sequence that ran to its end through [`Scheduler::generate`].
#[derive(Debug, Clone)]
pub struct Completion {
    /// The generated tokens (an end-of-generation token is not among them).
    pub tokens: Vec<u32>,
    /// The text, cut before a matched stop string.
    pub text: String,
    /// How it ended, with its counts and timings.
    pub finished: Finished,
}

impl Scheduler {
    /// Runs one sequence to its end, streaming each piece of text to `on_text` as it
    /// becomes final; `on_text` returns `false` to cancel it (the completion then ends
    /// with [`FinishReason::Cancelled`] and the text so far). `shoal run` and `shoal chat`
    /// generate through this, so their chunking, penalties, stop strings, constraints and
    /// streamed text are those of every served request.
    ///
    /// # Errors
    /// [`EngineError::Generation`] when the queue is full or the sequence fails.
    pub fn generate(
        &self,
        request: SequenceRequest,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Completion, EngineError> {
        let prompt_tokens = request.prompt.len();
        let started = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        let ticket = self
            .submit(request, Box::new(move |e| tx.send(e).is_ok()))
            .map_err(|b| {
                EngineError::Generation(format!(
                    "the model is busy ({} sequences queued)",
                    b.queued
                ))
            })?;
        let (mut tokens, mut text) = (Vec::new(), String::new());
        let mut first_token = None;
        for event in rx {
            let piece = match event {
                Event::Token { id, text, .. } => {
                    first_token.get_or_insert_with(|| started.elapsed());
                    tokens.push(id);
                    text
                }
                Event::Text(t) => t,
                Event::Done(finished) => {
                    return Ok(Completion {
                        tokens,
                        text,
                        finished,
                    })
                }
                Event::Failed(why) | Event::Interrupted(why) => {
                    return Err(EngineError::Generation(why))
                }
            };
            text.push_str(&piece);
            if !piece.is_empty() && !on_text(&piece) {
                ticket.cancel();
                let completion_tokens = tokens.len();
                return Ok(Completion {
                    tokens,
                    text,
                    finished: Finished {
                        reason: FinishReason::Cancelled,
                        stop: None,
                        prompt_tokens,
                        cached_tokens: 0,
                        completion_tokens,
                        time_to_first_token: first_token.unwrap_or_default(),
                        total: started.elapsed(),
                    },
                });
            }
        }
        Err(EngineError::Generation(
            "the scheduler stopped before the sequence ended".into(),
        ))
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn split_failed(shared: &Shared) -> bool {
    shared
        .failure
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some()
}

/// Where a sequence's KV cache lives.
enum Store {
    /// Here (one rank).
    Local(KvCache),
    /// On every rank of a split, as the lead's sequence `slot`.
    Slot {
        slot: usize,
        len: usize,
        capacity: usize,
    },
}

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::Local(c) => c.len(),
            Store::Slot { len, .. } => *len,
        }
    }

    fn capacity(&self) -> usize {
        match self {
            Store::Local(c) => c.capacity(),
            Store::Slot { capacity, .. } => *capacity,
        }
    }

    fn slot(&self) -> Option<usize> {
        match self {
            Store::Local(_) => None,
            Store::Slot { slot, .. } => Some(*slot),
        }
    }
}

/// One sequence holding a slot.
struct Sequence {
    job: Job,
    cache: Store,
    sampler: Sampler,
    /// Prompt tokens run so far.
    prefilled: usize,
    decoder: StreamDecoder,
    stops: StopMatcher,
    generated: usize,
    /// The generated tokens, in order.
    generated_ids: Vec<u32>,
    /// Prompt tokens its cache held from a finished sequence.
    cached: usize,
    counts: HashMap<u32, u32>,
    /// The last sampled token, to run in the next decode step.
    next: Option<u32>,
    first_token: Option<Duration>,
    /// The draft model's cache of this sequence (with a draft model, on one rank).
    draft_cache: Option<KvCache>,
    /// The draft model failed on this sequence, which decodes on without it.
    draft_failed: bool,
}

impl Sequence {
    /// The tokens its cache holds, in order: the prompt and the generated tokens run so far.
    fn history(&self) -> Vec<u32> {
        let mut h = self.job.request.prompt.clone();
        h.extend_from_slice(&self.generated_ids);
        h.truncate(self.cache.len());
        h
    }

    /// How many of the positions its cache holds `prompt` starts with (its history's
    /// common prefix with `prompt`, without building the history).
    fn shared_start(&self, prompt: &[u32]) -> usize {
        let held = self
            .job
            .request
            .prompt
            .iter()
            .chain(&self.generated_ids)
            .take(self.cache.len());
        held.zip(prompt).take_while(|(a, b)| a == b).count()
    }
}

/// The cache of a sequence that ended, kept so that a later request sharing a start with
/// it runs only the rest (a conversation's next turn re-sends the whole conversation).
struct Parked {
    cache: Store,
    tokens: Vec<u32>,
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

/// What [`Worker::admit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// Sequences hold slots.
    Busy,
    /// Nothing to do.
    Idle,
    /// The scheduler is being dropped.
    Shutdown,
}

struct Worker<'m> {
    model: Arc<LoadedModel>,
    config: SchedulerConfig,
    shared: Arc<Shared>,
    active: Vec<Sequence>,
    /// Caches of ended sequences, oldest first; with the active sequences' caches, at most
    /// one per slot.
    parked: Vec<Parked>,
    /// The split this scheduler leads, if the model is split.
    lead: Option<Lead<'m>>,
    /// The split is unusable (its failure is in `shared.failure`).
    broken: bool,
    /// The model that drafts tokens for speculative decoding, if any.
    draft: Option<Arc<LoadedModel>>,
}

impl<'m> Worker<'m> {
    fn new(
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
        shared: Arc<Shared>,
        lead: Option<Lead<'m>>,
        broken: bool,
    ) -> Self {
        Worker {
            model,
            config,
            shared,
            active: Vec::new(),
            parked: Vec::new(),
            lead,
            broken,
            draft: None,
        }
    }

    /// Records that the split failed; every later sequence is refused with `why`.
    fn break_split(&mut self, why: &str) {
        self.broken = true;
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(|| why.to_string());
    }

    fn failure(&self) -> String {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    fn run(mut self) {
        // Wait for work here; run each busy period of a local model on a compute-pool
        // thread, so the many parallel loops of a step start without a cross-thread
        // hand-off each. A split's lead stays on its own thread, as the other ranks' loops
        // do: its steps wait on the other ranks, and a pool thread held through those waits
        // is one a rank in this process may need to finish the step (two leads here on a
        // pool of two would wait on each other's ranks for ever).
        while self.admit(true) != Admit::Shutdown {
            let me = &mut self;
            let shutdown = if me.lead.is_some() {
                me.run_busy()
            } else {
                rayon::scope(move |_| me.run_busy())
            };
            if shutdown {
                break;
            }
        }
        for seq in self.active.drain(..) {
            let mut sink = seq.job.sink;
            sink(Event::Failed("the server is shutting down".into()));
        }
    }

    /// Steps until no sequence is left; returns whether the scheduler is shutting down.
    fn run_busy(&mut self) -> bool {
        loop {
            self.drop_cancelled();
            self.prefill_one_chunk();
            self.decode_step();
            self.shared
                .stats
                .active
                .store(self.active.len(), Ordering::Relaxed);
            match self.admit(false) {
                Admit::Shutdown => return true,
                Admit::Idle => return false,
                Admit::Busy => {}
            }
        }
    }

    /// Moves queued sequences into free slots; with `wait`, waits while there is nothing to
    /// do.
    fn admit(&mut self, wait: bool) -> Admit {
        let shared = self.shared.clone();
        let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
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
        let (cache, cached) = match self.cache_for(&r.prompt, capacity) {
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
            draft_failed: false,
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

    /// Brings a resumed sequence's output state to where it stopped: its resumed tokens
    /// (already in its prompt, see [`Scheduler::submit`]) are counted as generated and
    /// pass through the text decoder, the stop matcher and the constraint, reported again
    /// only when the request asks ([`SequenceRequest::report_resumed`]). Text the stop
    /// matcher held back stays held, as it was. Returns how it ends when the last resumed
    /// token already ended it (a stop string, or its last allowed token).
    fn replay_resumed(&self, seq: &mut Sequence) -> Result<Option<FinishReason>, String> {
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
    fn worth_waiting(&self, prompt: &[u32]) -> bool {
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

    /// Whether every slot is taken by a sequence or a kept cache.
    fn slots_full(&self) -> bool {
        self.parked.len() + self.active.len() >= self.config.max_batch
    }

    /// A cache for a sequence of `prompt` that needs room for `capacity` positions, and how
    /// many of the prompt's tokens it already holds ([`Worker::best_prefix`]). A kept cache
    /// is taken over when every slot is in use, else copied (and kept for the next request
    /// that starts the same way, e.g. with the same system prompt); a running sequence's
    /// positions are copied. Kept caches go oldest first when a slot is needed.
    fn cache_for(&mut self, prompt: &[u32], capacity: usize) -> Result<(Store, usize), String> {
        let mut best = self.best_prefix(prompt);
        if let Some((Source::Kept(i), n)) = best {
            if self.slots_full() {
                let p = self.parked.remove(i);
                return self.take_over(p.cache, n, capacity);
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
            let store = match src {
                Source::Kept(i) => &self.parked[i].cache,
                Source::Running(i) => &self.active[i].cache,
            };
            (store, n)
        });
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
                let from = source.and_then(|(store, n)| store.slot().map(|s| (s, n)));
                let n = match from {
                    Some((from, n)) => {
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
                let src = source.and_then(|(store, n)| match store {
                    Store::Local(c) => Some((c, n)),
                    Store::Slot { .. } => None,
                });
                let n = match src {
                    Some((from, n)) => {
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
        Ok((store, n))
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
    fn count_kept(&self) {
        let tokens: usize = self.parked.iter().map(|p| p.tokens.len()).sum();
        let cfg = self.model.transformer.config();
        let per_token = cfg.kv_bytes_per_token_per_layer() * cfg.n_layer as u64;
        let stats = &self.shared.stats;
        stats.kept_tokens.store(tokens as u64, Ordering::Relaxed);
        stats
            .kept_bytes
            .store(tokens as u64 * per_token, Ordering::Relaxed);
    }

    /// Ends `seq`'s hold on its slot. A sequence that ended well (finished or cancelled,
    /// not failed) leaves its cache kept for a later request that starts the same way
    /// (unless the prefix cache is off); the oldest kept caches go when the caches held,
    /// running and kept, would outnumber the slots.
    fn retire(&mut self, seq: Sequence, healthy: bool) {
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
        });
        while self.parked.len() + self.active.len() > self.config.max_batch {
            self.parked.remove(0);
        }
        self.count_kept();
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.cancelled.load(Ordering::Acquire) {
                let seq = self.active.remove(i);
                self.retire(seq, true);
            } else {
                i += 1;
            }
        }
    }

    /// Runs the next chunk of the oldest sequence still reading its prompt; when its prompt is
    /// done, samples its first token.
    fn prefill_one_chunk(&mut self) {
        let Some(i) = self
            .active
            .iter()
            .position(|s| s.prefilled < s.job.request.prompt.len())
        else {
            return;
        };
        let model = self.model.clone();
        let seq = &mut self.active[i];
        let prompt_len = seq.job.request.prompt.len();
        let end = (seq.prefilled + PROMPT_CHUNK).min(prompt_len);
        let chunk = &seq.job.request.prompt[seq.prefilled..end];
        let result = match (&mut seq.cache, self.lead.as_mut()) {
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
        if let (Some(d), Ok(_), Store::Local(c), false) =
            (&self.draft, &result, &seq.cache, seq.draft_failed)
        {
            let capacity = c.capacity();
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

    /// Interrupts every sequence and breaks the split (a failed split step leaves every
    /// rank's state unknown; the sequences may go on where the model is placed next).
    fn fail_all(&mut self, why: &str) {
        self.break_split(why);
        self.parked.clear();
        for seq in self.active.drain(..) {
            let mut sink = seq.job.sink;
            sink(Event::Interrupted(why.to_string()));
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
        let lead = self.lead.as_mut().ok_or_else(|| EngineError::Internal {
            what: "a split sequence without a lead".into(),
        })?;
        let mut slots = Vec::with_capacity(ready.len());
        let mut want = Want::Best;
        for &i in ready {
            let seq = &mut self.active[i];
            let Store::Slot { slot, len, .. } = &mut seq.cache else {
                return Err(EngineError::Internal {
                    what: "a local sequence in a split scheduler".into(),
                });
            };
            slots.push(*slot);
            *len += 1;
            want = widest(want, want_for(&seq.job.request));
        }
        lead.step_batch(&slots, tokens, want)
    }

    /// One token for every sequence that has a sampled token to run.
    /// Counts a decode step of `batch` sequences that decoded `tokens` tokens.
    fn count_step(&self, batch: usize, tokens: usize) {
        let stats = &self.shared.stats;
        stats.last_batch.store(batch, Ordering::Relaxed);
        stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        stats
            .decoded_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Fails the sequences of a step that failed on one rank (`ready`, indices into
    /// `active`): a failed step leaves the caches of every sequence in it unusable.
    fn fail_batch(&mut self, ready: &[usize], msg: &str) {
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

    /// The draft of each ready sequence on one rank (empty where the output is
    /// constrained or nothing was drafted): at most
    /// `config.draft_max` tokens, within the cache's room and the tokens still to
    /// generate; from the draft model when there is one, else by prompt lookup.
    fn drafts(&mut self, ready: &[usize]) -> Vec<Vec<u32>> {
        let draft_model = self.draft.clone();
        ready
            .iter()
            .map(|&i| {
                let s = &mut self.active[i];
                if s.job.request.constraint.is_some() {
                    return Vec::new();
                }
                let room = s.cache.capacity().saturating_sub(s.cache.len() + 1);
                let left = s.job.request.max_tokens.saturating_sub(s.generated + 1);
                let max = self.config.draft_max.min(room).min(left);
                if max == 0 {
                    return Vec::new();
                }
                // the context: the prompt and every generated token (the last one, `next`,
                // not yet run)
                let mut context = s.job.request.prompt.clone();
                context.extend_from_slice(&s.generated_ids);
                match &draft_model {
                    Some(d) => draft_from_model(d, s, &context, max).unwrap_or_default(),
                    None => crate::lookup::draft(&context, max),
                }
            })
            .collect()
    }

    /// One decode step of the ready sequences (one rank) in which each runs its next token
    /// and its draft: every row's logits come back, each sequence samples row by row as
    /// plain decoding would and goes on while the sampled token is the drafted one, and its
    /// cache keeps the positions of the tokens it accepted. With a draft token taken only
    /// when the model samples it, the output is what decoding one token at a time gives
    /// (up to the last bits in which a step of several rows rounds differently).
    fn speculative_step(&mut self, ready: &[usize], drafts: &[Vec<u32>]) {
        let mut tokens = Vec::new();
        let mut counts = Vec::new();
        for (&i, d) in ready.iter().zip(drafts) {
            tokens.extend(self.active[i].next);
            tokens.extend_from_slice(d);
            counts.push(1 + d.len());
        }
        let last = counts.iter().copied().max().unwrap_or(1);
        let model = self.model.clone();
        let vocab = model.transformer.config().vocab;
        let before: Vec<usize> = ready.iter().map(|&i| self.active[i].cache.len()).collect();
        let result = {
            let mut caches = ready_local_caches(&mut self.active);
            model.transformer.step(&tokens, &counts, &mut caches, last)
        };
        let mut logits = match result {
            Ok(l) if l.len() == tokens.len() * vocab => l,
            other => {
                let msg = match other {
                    Err(e) => format!("decoding failed: {e}"),
                    Ok(l) => format!(
                        "decoding failed: {} logits for {} rows of {vocab}",
                        l.len(),
                        tokens.len()
                    ),
                };
                self.fail_batch(ready, &msg);
                return;
            }
        };
        let mut work: Vec<Option<Checked>> = Vec::new();
        work.resize_with(self.active.len(), || None);
        let mut rest: &mut [f32] = &mut logits;
        for (k, &i) in ready.iter().enumerate() {
            let (rows, tail) = rest.split_at_mut(counts[k] * vocab);
            rest = tail;
            work[i] = Some(Checked {
                rows,
                draft: &drafts[k],
                before: before[k],
            });
        }
        let results: Vec<(bool, usize)> = self
            .active
            .par_iter_mut()
            .zip(work.par_iter_mut())
            .map(|(seq, w)| match w.take() {
                Some(Checked {
                    rows,
                    draft,
                    before,
                }) => {
                    seq.next = None;
                    let mut taken = 0;
                    let mut goes_on = true;
                    for (j, row) in rows.chunks_mut(vocab).enumerate() {
                        goes_on = accept(&model, seq, row);
                        if !goes_on || j >= draft.len() || seq.next != Some(draft[j]) {
                            break;
                        }
                        taken += 1;
                    }
                    // the cache keeps the token that ran first and the drafts taken
                    if let Store::Local(c) = &mut seq.cache {
                        c.truncate(before + 1 + taken);
                    }
                    if let Some(dc) = &mut seq.draft_cache {
                        dc.truncate(dc.len().min(before + 1 + taken));
                    }
                    (goes_on, taken)
                }
                None => (true, 0),
            })
            .collect();
        let taken: usize = results.iter().map(|r| r.1).sum();
        self.count_step(ready.len(), ready.len() + taken);
        let stats = &self.shared.stats;
        stats.drafted.fetch_add(
            drafts.iter().map(Vec::len).sum::<usize>() as u64,
            Ordering::Relaxed,
        );
        stats
            .accepted_drafts
            .fetch_add(taken as u64, Ordering::Relaxed);
        for i in (0..results.len()).rev() {
            if !results[i].0 {
                let seq = self.active.remove(i);
                self.retire(seq, true);
            }
        }
    }

    fn decode_step(&mut self) {
        let ready: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].next.is_some())
            .collect();
        if ready.is_empty() {
            return;
        }
        if self.config.draft_max > 0 && self.lead.is_none() {
            let drafts = self.drafts(&ready);
            if drafts.iter().any(|d| !d.is_empty()) {
                return self.speculative_step(&ready, &drafts);
            }
        }
        let tokens: Vec<u32> = ready.iter().filter_map(|&i| self.active[i].next).collect();
        self.count_step(ready.len(), ready.len());
        let model = self.model.clone();
        let result = if self.lead.is_some() {
            self.split_decode(&ready, &tokens).map(StepLogits::Rows)
        } else {
            let mut caches = ready_local_caches(&mut self.active);
            model
                .transformer
                .forward_batch(&tokens, &mut caches)
                .and_then(|l| StepLogits::flat(l, tokens.len()))
        };
        let mut rows = match result {
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
}

/// A sequence's part of a speculative step: the logits of its rows (its next token's, then
/// one per drafted token), its draft, and its cache length before the step.
struct Checked<'a> {
    rows: &'a mut [f32],
    draft: &'a [u32],
    before: usize,
}

/// A decode step's logits, one row per sequence in the step.
enum StepLogits {
    /// A row each.
    Rows(Vec<Vec<f32>>),
    /// The rows one after another (the output head's own values), and how many.
    Flat(Vec<f32>, usize),
}

impl StepLogits {
    /// `n` rows laid one after another in `values`.
    fn flat(values: Vec<f32>, n: usize) -> Result<Self, EngineError> {
        if n == 0 || values.is_empty() || !values.len().is_multiple_of(n) {
            return Err(EngineError::Internal {
                what: format!("{} logits for a step of {n} sequences", values.len()),
            });
        }
        Ok(StepLogits::Flat(values, n))
    }

    /// Each row, in order.
    fn rows(&mut self) -> Vec<&mut [f32]> {
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
fn widest(a: Want, b: Want) -> Want {
    match (a, b) {
        (Want::All, _) | (_, Want::All) => Want::All,
        (Want::TopK(x), Want::TopK(y)) => Want::TopK(x.max(y)),
        (Want::TopK(k), _) | (_, Want::TopK(k)) => Want::TopK(k),
        (Want::Best, _) | (_, Want::Best) => Want::Best,
        (Want::Nothing, Want::Nothing) => Want::Nothing,
    }
}

/// What a split step must return for `r` to be sampled exactly as from the full logits.
fn want_for(r: &SequenceRequest) -> Want {
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

/// Up to `max` tokens the draft model `d` picks greedily after `context` (whose last token
/// is `seq`'s next): its cache first catches up with the context before that token, then
/// each drafted token is fed back. After a failure the sequence decodes without drafts.
fn draft_from_model(
    d: &LoadedModel,
    seq: &mut Sequence,
    context: &[u32],
    max: usize,
) -> Option<Vec<u32>> {
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
    let run = |dc: &mut KvCache| -> Result<Vec<u32>, EngineError> {
        if dc.len() < known {
            d.transformer.prefill(&context[dc.len()..known], dc)?;
        }
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
        Ok(out)
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

/// Samples the next token of `seq` from `logits` and reports it. Returns whether the
/// sequence goes on.
fn accept(model: &LoadedModel, seq: &mut Sequence, logits: &mut [f32]) -> bool {
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

/// The local caches of the sequences with a sampled token to run, in order (the rows of a
/// one-rank decode step).
fn ready_local_caches(active: &mut [Sequence]) -> Vec<&mut KvCache> {
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
fn finish(seq: &mut Sequence, reason: FinishReason) -> bool {
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
