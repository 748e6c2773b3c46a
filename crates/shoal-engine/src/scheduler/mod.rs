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
//! reads its weights once for the batch). On a split of several pipeline stages the ready
//! sequences may go out instead in one group per stage, each submitted while the others are
//! in the pipeline, so that every stage computes at once, where that measured more tokens
//! per second (not with speculation, whose drafts are checked in one step of every ready
//! sequence). A failed step breaks the split: every
//! sequence in it fails, later ones are refused at once, and [`Scheduler::failure`] says
//! why (the cluster then re-places it).
//!
//! The module is laid out by concern: this file holds the public types and [`Scheduler`],
//! the handle that starts the scheduler thread and queues sequences; `worker.rs` the
//! thread's state (its sequences and where their caches live) and its loop; `queue.rs` the
//! queue shared with the handle, and how queued sequences take slots and leave them;
//! `prefix_cache.rs` the caches kept and shared between sequences whose prompts start
//! alike; `resume.rs` the replay of a resumed request's tokens; `step.rs` an iteration's
//! prompt chunk and batched decode step, and the sampling of each sequence's next token;
//! `pipeline.rs` the decode steps that overlap on a pipeline's stages;
//! `speculation.rs` speculative decoding (tokens drafted by prompt lookup, a draft model or
//! the model's own prediction layer, checked in one step); `draft_policy.rs` how many
//! drafted tokens a step checks, from the measured cost of a step's rows and the acceptance
//! each sequence has seen; `mtp.rs` drafting with the prediction layer.

mod draft_policy;
mod mtp;
mod pipeline;
mod prefix_cache;
mod queue;
mod resume;
mod speculation;
mod step;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::model::LoadedModel;
use crate::parallel::{Lead, RankContext};
use crate::sampler::SamplerConfig;
use crate::stop::FinishReason;
use crate::EngineError;

use queue::{Job, Shared};
use worker::{split_failed, Worker};

/// Prompt tokens run per scheduler iteration at most: a long prompt delays the decode
/// steps of running sequences by one chunk at a time, and bounds attention's scratch.
pub const PROMPT_CHUNK: usize = 512;

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
    /// prompt lookup from the sequence's own context (on a split model too, whose ranks
    /// then run steps of several tokens per sequence, [`Lead::step_rows`]).
    pub draft_max: usize,
    /// Whether each step checks only the drafted tokens that promise more tokens per second
    /// than a plain step, by the measured cost of a step's rows and the share of drafts each
    /// sequence has seen taken (so speculation that keeps missing stops costing time); else
    /// every step checks all `draft_max`.
    pub adaptive_drafts: bool,
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
    /// Of those, the ones submitted to a pipeline while another was still in it.
    pub overlapped_steps: AtomicU64,
    /// Steps submitted to a pipeline on a guess of what the step before them would sample
    /// (checking prompt lookup's drafts) where the guess missed: their rows were thrown
    /// away, and they are counted in neither `decode_steps` nor `overlapped_steps`.
    pub discarded_steps: AtomicU64,
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
    /// Tokens drafted (by prompt lookup, the draft model or the prediction layer) and checked.
    pub drafted: AtomicU64,
    /// Of those, the ones the model agreed with (emitted without a step of their own).
    pub accepted_drafts: AtomicU64,
    /// Drafted tokens the draft model made while a pipeline's later stages checked the
    /// draft before them (past it, guessing the token the check samples), and that were
    /// drafted by then: a step's draft that cost the lead no time of its own.
    pub drafted_ahead: AtomicU64,
}

/// Refuses a split context that cannot lead, or more slots than a lead holds.
fn check_split(ctx: &RankContext, config: &SchedulerConfig) -> Result<(), EngineError> {
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
    Ok(())
}

/// What drafts tokens when speculation is on.
enum Drafter {
    /// Prompt lookup in the sequence's own context.
    Lookup,
    /// A smaller model with the same vocabulary.
    Model(Arc<LoadedModel>),
    /// The model's own multi-token-prediction layer, held by this model (the model itself,
    /// or on a split's lead a share of only the layer).
    Mtp(Arc<LoadedModel>),
}

/// Refuses drafting with `model`'s prediction layer where it has none here, or where
/// `config` turns speculation off.
///
/// # Errors
/// Saying which, and what to use instead.
pub fn check_mtp(model: &LoadedModel, config: &SchedulerConfig) -> Result<(), EngineError> {
    if !model.transformer.has_mtp() {
        let layers = model.transformer.config().mtp_layers;
        return Err(EngineError::InvalidInput {
            what: if layers == 0 {
                format!(
                    "{} has no multi-token-prediction layer to draft with (GLM-4.5 and later ship one as `nextn` tensors; DeepSeek GGUF files leave theirs out); draft by prompt lookup or with a draft model instead",
                    model.name
                )
            } else if !model.transformer.config().load_mtp {
                format!(
                    "{} was loaded without its multi-token-prediction layer (LoadedModel::load_with_mtp loads it)",
                    model.name
                )
            } else {
                format!(
                    "{}'s multi-token-prediction layer drafts only where a share holds the embedding, the whole output head and whole layers on one device (the whole model, or on a split's lead the layer alone: LoadedModel::load_prediction_layer); draft by prompt lookup or with a draft model instead",
                    model.name
                )
            },
        });
    }
    if config.draft_max == 0 {
        return Err(EngineError::InvalidInput {
            what:
                "drafting with the prediction layer needs speculation on (at least one draft token)"
                    .into(),
        });
    }
    Ok(())
}

/// Refuses a draft model whose vocabulary is not `model`'s (token by token).
///
/// # Errors
/// When the vocabularies differ, naming both models.
pub fn check_draft(model: &LoadedModel, draft: &LoadedModel) -> Result<(), EngineError> {
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
    Ok(())
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
        check_split(&ctx, &config)?;
        Self::spawn(model, config, Some(ctx))
    }

    /// Starts the scheduler thread for a split model ([`Scheduler::start_split`]) with
    /// `draft`, a smaller model with the same vocabulary that runs here, on the lead alone,
    /// and drafts tokens that one split step checks (as [`Scheduler::start_with_draft`]
    /// does on one rank).
    ///
    /// # Errors
    /// As [`Scheduler::start_split`], and when the vocabularies differ.
    pub fn start_split_with_draft(
        model: Arc<LoadedModel>,
        ctx: RankContext,
        draft: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        check_split(&ctx, &config)?;
        check_draft(&model, &draft)?;
        Self::spawn_with(model, config, Some(ctx), Some(draft))
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
        check_draft(&model, &draft)?;
        Self::spawn_with(model, config, None, Some(draft))
    }

    /// Starts the scheduler thread for `model` drafting `config.draft_max` tokens per step
    /// with its own multi-token-prediction layer (GLM-4.5+'s `nextn` layer).
    ///
    /// # Errors
    /// As [`Scheduler::start`], and when the model has no such layer here or speculation
    /// is off (`draft_max` 0).
    pub fn start_with_mtp(
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        check_mtp(&model, &config)?;
        let layer = model.clone();
        Self::spawn_drafting(model, config, None, Drafter::Mtp(layer))
    }

    /// Starts the scheduler thread for a split model ([`Scheduler::start_split`]) drafting
    /// `config.draft_max` tokens per step with the model's multi-token-prediction layer,
    /// which `layer` holds here on the lead ([`LoadedModel::load_prediction_layer`]): every
    /// split step also returns its rows' output hidden states, which the layer reads.
    ///
    /// # Errors
    /// As [`Scheduler::start_split`], and when `layer` has no such layer, is not the
    /// model's, or speculation is off.
    pub fn start_split_with_mtp(
        model: Arc<LoadedModel>,
        ctx: RankContext,
        layer: Arc<LoadedModel>,
        config: SchedulerConfig,
    ) -> Result<Self, EngineError> {
        check_split(&ctx, &config)?;
        check_mtp(&layer, &config)?;
        let (a, b) = (model.transformer.config(), layer.transformer.config());
        if (a.arch, a.hidden, a.vocab, a.n_layer) != (b.arch, b.hidden, b.vocab, b.n_layer) {
            return Err(EngineError::InvalidInput {
                what: format!(
                    "the prediction layer of {} does not belong to {}",
                    layer.name, model.name
                ),
            });
        }
        Self::spawn_drafting(model, config, Some(ctx), Drafter::Mtp(layer))
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
        let drafter = match draft {
            Some(d) => Drafter::Model(d),
            None => Drafter::Lookup,
        };
        Self::spawn_drafting(model, config, split, drafter)
    }

    fn spawn_drafting(
        model: Arc<LoadedModel>,
        config: SchedulerConfig,
        split: Option<RankContext>,
        drafter: Drafter,
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
                    let _exit = ExitMark(shared.clone());
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
                    let mut lead = lead;
                    if let (Some(lead), Drafter::Mtp(_)) = (lead.as_mut(), &drafter) {
                        lead.keep_hidden(true);
                    }
                    let mut w = Worker::new(model, config, shared, lead, broken);
                    match drafter {
                        Drafter::Lookup => {}
                        Drafter::Model(d) => w.draft = Some(d),
                        Drafter::Mtp(layer) => w.mtp = Some(layer),
                    }
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

    /// Interrupts every sequence, queued or running, with `why` (they may go on where the
    /// model is served next, see [`Event::Interrupted`]), refuses later ones the same way,
    /// and ends the thread; waits at most `wait` for it to end. Returns whether it has: only
    /// then is nothing stepping the model any more, and its weights may serve another
    /// scheduler (a split model's next placement, with its communicator bound anew).
    pub fn retire(&self, why: &str, wait: Duration) -> bool {
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if !q.shutdown {
                q.retire.get_or_insert_with(|| why.to_string());
            }
        }
        self.shared.wake.notify_all();
        let exited = self.shared.exited.lock().unwrap_or_else(|e| e.into_inner());
        let (exited, _) = self
            .shared
            .exited_wake
            .wait_timeout_while(exited, wait, |done| !*done)
            .unwrap_or_else(|e| e.into_inner());
        *exited
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

    /// Queues a sequence; its events go to `sink` from the scheduler thread (or at once, from
    /// this one, when the scheduler was retired).
    ///
    /// # Errors
    /// [`Busy`] when the queue is full.
    pub fn submit(&self, mut request: SequenceRequest, sink: Sink) -> Result<Ticket, Busy> {
        // from here on the resumed tokens are part of what the cache must hold
        request.prompt.extend_from_slice(&request.resume);
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = q.retire.clone() {
            drop(q);
            let mut sink = sink;
            sink(Event::Interrupted(why));
            return Ok(Ticket {
                cancelled,
                shared: self.shared.clone(),
            });
        }
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

/// Marks the scheduler thread ended when dropped: at the end of the thread, or while a
/// panic unwinds it.
struct ExitMark(Arc<Shared>);

impl Drop for ExitMark {
    fn drop(&mut self) {
        *self.0.exited.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.exited_wake.notify_all();
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
