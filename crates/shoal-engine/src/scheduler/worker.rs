//! The scheduler thread's state: the [`Worker`] that owns the model (and the split it
//! leads, if any), the [`Sequence`]s holding slots and where each one's KV cache lives
//! ([`Store`]), and the thread's loop, which waits for work and then steps (drop the
//! cancelled, one prompt chunk, one decode step, admit the queued) until no sequence is
//! left. The worker's other methods are in the files of their concerns.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shoal_model::tokenizer::StreamDecoder;

use super::draft_policy::{Acceptance, Probe, Shadows, StepCosts};
use super::mtp::MtpState;
use super::pipeline::InFlight;
use super::prefix_cache::Parked;
use super::queue::{Admit, Job, Shared};
use super::{Event, SchedulerConfig};
use crate::model::LoadedModel;
use crate::parallel::Lead;
use crate::sampler::Sampler;
use crate::stop::StopMatcher;
use crate::KvCache;

/// Where a sequence's KV cache lives.
pub(super) enum Store {
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
    pub(super) fn len(&self) -> usize {
        match self {
            Store::Local(c) => c.len(),
            Store::Slot { len, .. } => *len,
        }
    }

    pub(super) fn capacity(&self) -> usize {
        match self {
            Store::Local(c) => c.capacity(),
            Store::Slot { capacity, .. } => *capacity,
        }
    }

    pub(super) fn slot(&self) -> Option<usize> {
        match self {
            Store::Local(_) => None,
            Store::Slot { slot, .. } => Some(*slot),
        }
    }
}

/// One sequence holding a slot.
pub(super) struct Sequence {
    pub(super) job: Job,
    pub(super) cache: Store,
    pub(super) sampler: Sampler,
    /// Prompt tokens run so far.
    pub(super) prefilled: usize,
    pub(super) decoder: StreamDecoder,
    pub(super) stops: StopMatcher,
    pub(super) generated: usize,
    /// The generated tokens, in order.
    pub(super) generated_ids: Vec<u32>,
    /// Prompt tokens its cache held from a finished sequence.
    pub(super) cached: usize,
    pub(super) counts: HashMap<u32, u32>,
    /// The last sampled token, to run in the next decode step.
    pub(super) next: Option<u32>,
    pub(super) first_token: Option<Duration>,
    /// The draft model's cache of this sequence (with a draft model, on one rank).
    pub(super) draft_cache: Option<KvCache>,
    /// What the draft model drafted past its last draft while a pipeline's later stages
    /// checked that draft: its guess of the token the check samples after the draft, then
    /// more. The next draft where the check took the whole draft and sampled that guess
    /// (then the draft cache holds their positions); else empty.
    pub(super) ahead: Vec<u32>,
    /// The state of the model's prediction layer for this sequence (drafting with it).
    pub(super) mtp: Option<MtpState>,
    /// The draft model (or prediction layer) failed on this sequence, or cannot draft for
    /// it, and it decodes on without drafts.
    pub(super) draft_failed: bool,
    /// How often its drafted tokens were taken, by position in the draft.
    pub(super) acceptance: Acceptance,
    /// Its prompt-lookup drafts not yet scored against the tokens that followed.
    pub(super) shadows: Shadows,
    /// When it tries its draft model's draft again after steps that checked none.
    pub(super) probe: Probe,
}

impl Sequence {
    /// The tokens its cache holds, in order: the prompt and the generated tokens run so far.
    pub(super) fn history(&self) -> Vec<u32> {
        let mut h = self.job.request.prompt.clone();
        h.extend_from_slice(&self.generated_ids);
        h.truncate(self.cache.len());
        h
    }

    /// How many of the positions its cache holds `prompt` starts with (its history's
    /// common prefix with `prompt`, without building the history).
    pub(super) fn shared_start(&self, prompt: &[u32]) -> usize {
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

pub(super) struct Worker<'m> {
    pub(super) model: Arc<LoadedModel>,
    pub(super) config: SchedulerConfig,
    pub(super) shared: Arc<Shared>,
    pub(super) active: Vec<Sequence>,
    /// Caches of ended sequences, oldest first; with the active sequences' caches, at most
    /// one per slot.
    pub(super) parked: Vec<Parked>,
    /// The split this scheduler leads, if the model is split.
    pub(super) lead: Option<Lead<'m>>,
    /// The decode steps submitted to the lead's pipeline and not yet collected.
    pub(super) in_flight: InFlight,
    /// The split is unusable (its failure is in `shared.failure`).
    pub(super) broken: bool,
    /// The model that drafts tokens for speculative decoding, if any.
    pub(super) draft: Option<Arc<LoadedModel>>,
    /// The model's own prediction layer, when it drafts them: the model itself on one
    /// rank, a share holding only the layer (and the embedding and head it reads) on the
    /// lead of a split.
    pub(super) mtp: Option<Arc<LoadedModel>>,
    /// Measured cost of a decode step by its rows (for the draft lengths).
    pub(super) step_costs: StepCosts,
    /// Measured cost of a step that went in ahead in a chain of checks by its rows: the time
    /// between its collection and the one before, in which the later stages overlap the
    /// lead's ([`Worker::check_in_chain`]'s draft lengths).
    pub(super) chain_costs: StepCosts,
    /// Seconds the draft model takes per drafted token, averaged (0 until measured).
    pub(super) draft_token_seconds: f64,
}

impl<'m> Worker<'m> {
    pub(super) fn new(
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
            in_flight: InFlight::default(),
            broken,
            draft: None,
            mtp: None,
            step_costs: StepCosts::default(),
            chain_costs: StepCosts::default(),
            draft_token_seconds: 0.0,
        }
    }

    /// Records that the split failed; every later sequence is refused with `why`.
    pub(super) fn break_split(&mut self, why: &str) {
        self.broken = true;
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(|| why.to_string());
    }

    pub(super) fn failure(&self) -> String {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    pub(super) fn run(mut self) {
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
}

pub(super) fn split_failed(shared: &Shared) -> bool {
    shared
        .failure
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some()
}
