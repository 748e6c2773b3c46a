//! A loaded model (one rank's share of it) as the rest of the engine drives it, whatever
//! backend computes it. A step runs tokens of one or more sequences through the model at
//! once, each sequence's tokens after what its [`KvCache`] holds: a prefill chunk is one
//! sequence of many tokens, a batched decode step one token of each of several sequences.
//! A rank that holds the whole model runs whole steps ([`Transformer::step`] and its
//! shorthands); the ranks of a split model run their part ([`Transformer::embed`],
//! [`Transformer::forward_layers`], [`Transformer::logits`]) and pass hidden states between
//! pipeline stages as host values (`crate::parallel`).

use std::sync::Arc;

use shoal_comm::Communicator;

use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::network::Network;
pub use crate::network::Reuse;
pub use crate::shard::{LayerShard, ShardPlan};
use crate::weights::WeightSource;
use crate::EngineError;

/// Index of the largest value (the first one on ties), for greedy decoding and tests.
pub use crate::backend::cpu::argmax;

/// What the engine asks of a network on some backend.
pub(crate) trait Forward: Send + Sync {
    fn config(&self) -> &ModelConfig;
    fn plan(&self) -> &ShardPlan;
    fn backend(&self) -> &'static str;
    fn new_cache(&self, capacity: usize) -> KvCache;
    fn copy_prefix(&self, from: &KvCache, to: &mut KvCache, len: usize) -> Result<(), EngineError>;
    fn step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<Vec<f32>, EngineError>;
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError>;
    fn forward_layers(
        &self,
        x: Vec<f32>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError>;
    fn logits(&self, x: &[f32], counts: &[usize], last: usize) -> Result<Vec<f32>, EngineError>;
    /// [`Network::final_norm`]; `Unsupported` where the share cannot give them.
    fn final_norm(&self, _x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Err(no_mtp(self.backend()))
    }
    /// [`Network::step_hidden`]; `Unsupported` where the share cannot give them.
    fn step_hidden(
        &self,
        _tokens: &[u32],
        _counts: &[usize],
        _caches: &mut [&mut KvCache],
        _last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        Err(no_mtp(self.backend()))
    }
    /// [`Network::new_mtp_cache`].
    fn new_mtp_cache(&self, _capacity: usize) -> Option<KvCache> {
        None
    }
    /// [`Network::mtp_step`].
    fn mtp_step(
        &self,
        _hidden: Vec<f32>,
        _tokens: &[u32],
        _counts: &[usize],
        _caches: &mut [&mut KvCache],
        _last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        Err(no_mtp(self.backend()))
    }
    fn device_counters(&self) -> Option<crate::device::GpuCounters>;
    /// This share made into the share `plan` of the same file, sharing what both hold
    /// ([`Network::regrow`]); `Unsupported` where the share cannot be remade in part.
    fn regrow(
        &self,
        _src: &dyn WeightSource,
        _plan: ShardPlan,
        _tp: Arc<dyn Communicator>,
    ) -> Result<(Box<dyn Forward>, Reuse), EngineError> {
        Err(EngineError::Unsupported {
            what: format!("keeping part of a share on the {} backend", self.backend()),
        })
    }
}

impl<B: Backend> Forward for Network<B> {
    fn config(&self) -> &ModelConfig {
        Network::config(self)
    }

    fn plan(&self) -> &ShardPlan {
        Network::plan(self)
    }

    fn backend(&self) -> &'static str {
        self.backend_name()
    }

    fn new_cache(&self, capacity: usize) -> KvCache {
        Network::new_cache(self, capacity)
    }

    fn copy_prefix(&self, from: &KvCache, to: &mut KvCache, len: usize) -> Result<(), EngineError> {
        Network::copy_prefix(self, from, to, len)
    }

    fn step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        Network::step(self, tokens, counts, caches, last)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        Network::embed(self, tokens)
    }

    fn forward_layers(
        &self,
        x: Vec<f32>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        Network::forward_layers(self, x, counts, caches)
    }

    fn logits(&self, x: &[f32], counts: &[usize], last: usize) -> Result<Vec<f32>, EngineError> {
        Network::logits(self, x, counts, last)
    }

    fn device_counters(&self) -> Option<crate::device::GpuCounters> {
        self.backend_counters()
    }

    fn step_hidden(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        Network::step_hidden(self, tokens, counts, caches, last)
    }

    fn final_norm(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Network::final_norm(self, x)
    }

    fn new_mtp_cache(&self, capacity: usize) -> Option<KvCache> {
        Network::new_mtp_cache(self, capacity)
    }

    fn mtp_step(
        &self,
        hidden: Vec<f32>,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        Network::mtp_step(self, hidden, tokens, counts, caches, last)
    }

    fn regrow(
        &self,
        src: &dyn WeightSource,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Box<dyn Forward>, Reuse), EngineError> {
        let (net, reuse) = Network::regrow(self, src, plan, tp)?;
        Ok((Box::new(net), reuse))
    }
}

/// Why a share cannot draft with multi-token prediction.
fn no_mtp(backend: &str) -> EngineError {
    EngineError::Unsupported {
        what: format!(
            "drafting with multi-token prediction on a model split between a GPU and the CPU (the {backend} backend's part)"
        ),
    }
}

/// A loaded model (one rank's share of it).
pub struct Transformer {
    net: Box<dyn Forward>,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("backend", &self.net.backend())
            .field("cfg", self.net.config())
            .field("plan", self.net.plan())
            .finish()
    }
}

impl Transformer {
    /// Loads the whole model on one rank, or, when `comm` has several ranks, this rank's
    /// tensor-parallel share of it (every rank one stage), where this process places
    /// shares ([`crate::device::placement_for_this_process`]: the CPU unless told
    /// otherwise).
    ///
    /// # Errors
    /// When a tensor is missing or misshapen, or the model cannot be cut that many ways.
    pub fn load(
        src: &dyn WeightSource,
        cfg: ModelConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        Self::load_on_device(crate::device::placement_for_this_process(), src, cfg, comm)
    }

    /// Loads what `plan` says this rank holds, where this process places shares; `tp` is
    /// the communicator of the ranks of its pipeline stage.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub fn load_shard(
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        Self::load_shard_on(
            crate::device::placement_for_this_process(),
            src,
            cfg,
            plan,
            tp,
        )
    }

    /// Loads what `plan` says this rank holds as `place` says (a device, or a GPU's share
    /// of the layers and the CPU's of the rest); `tp` is the communicator of the ranks of
    /// its pipeline stage.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen, or the device cannot be opened or cannot run
    /// the model (say why).
    pub fn load_shard_on(
        place: impl Into<crate::device::Placement>,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let place = place.into();
        let n = match place.device.resolve() {
            crate::device::Resolved::Cpu => return Self::load_on(Cpu, src, cfg, plan, tp),
            crate::device::Resolved::Gpu(n) => n,
        };
        if place.device != crate::device::Device::Auto {
            return Self::load_on_gpu(n, &place, src, cfg, plan, tp);
        }
        // `auto` asked for whatever runs the model best: a model the GPU backend cannot run
        // (an architecture or weight type without GPU kernels) runs on the CPU instead
        match Self::load_on_gpu(n, &place, src, cfg.clone(), plan.clone(), tp.clone()) {
            Err(EngineError::Unsupported { what }) => {
                tracing::warn!("GPU {n} cannot run this model ({what}): computing on the CPU");
                Self::load_on(Cpu, src, cfg, plan, tp)
            }
            other => other,
        }
    }

    /// [`Transformer::load_shard_on`] on GPU `n` (and the CPU, for the layers `place` leaves
    /// there).
    fn load_on_gpu(
        n: usize,
        place: &crate::device::Placement,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        use crate::device::GpuLayers;
        let gpu = crate::backend::gpu::Gpu::open(n)?;
        let layers = plan.layers.len();
        let on_gpu = match place.gpu_layers {
            GpuLayers::All => layers,
            GpuLayers::First(k) => k.min(layers),
            GpuLayers::Fit => match crate::device::gpus().get(n).and_then(|a| a.memory_bytes) {
                Some(memory) => crate::offload::fit_layers(memory, src, &cfg, &plan)?,
                None => layers,
            },
        };
        if on_gpu == layers {
            tracing::info!("computing on GPU {n}: {}", gpu.describe());
            Self::load_on(gpu, src, cfg, plan, tp)
        } else if on_gpu == 0 {
            tracing::warn!(
                "no layer on GPU {n} ({}, --gpu-layers {}): computing on the CPU",
                gpu.describe(),
                place.gpu_layers
            );
            Self::load_on(Cpu, src, cfg, plan, tp)
        } else {
            tracing::info!(
                "computing {on_gpu} of {layers} layers on GPU {n} ({}), the rest on the CPU",
                gpu.describe()
            );
            Ok(Transformer {
                net: Box::new(crate::offload::Offloaded::load(
                    gpu, src, cfg, plan, tp, on_gpu,
                )?),
            })
        }
    }

    /// Loads the whole model on one rank (or this rank's tensor-parallel share when `comm`
    /// has several) as `place` says.
    ///
    /// # Errors
    /// As [`Transformer::load_shard_on`], or when the model cannot be cut that many ways.
    pub fn load_on_device(
        place: impl Into<crate::device::Placement>,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        let plan = if comm.world_size() == 1 {
            ShardPlan::full(&cfg)
        } else {
            let layout = crate::shard::Layout {
                tp: comm.world_size(),
                pp: 1,
            };
            crate::shard::plan(&cfg, src, layout, None, crate::shard::ExpertSplit::Auto)?
                .swap_remove(comm.rank())
        };
        Self::load_shard_on(place, src, cfg, plan, comm)
    }

    /// Loads what `plan` says this rank holds on backend `be`.
    ///
    /// # Errors
    /// When a tensor is missing or misshapen.
    pub(crate) fn load_on<B: Backend>(
        be: B,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<Self, EngineError> {
        Ok(Transformer {
            net: Box::new(Network::load(be, src, cfg, plan, tp)?),
        })
    }

    /// The share `plan` of the same model (`src`, `cfg`), sharing with this one the layers
    /// both hold, cut the same way, and the embedding, head and norm of the same rows, and
    /// reading what `plan` adds; what only this share holds goes when it is dropped. A share
    /// on a GPU is loaded whole again, where this process places shares (how many of its
    /// layers the GPU's memory holds is decided anew).
    ///
    /// # Errors
    /// As [`Transformer::load_shard`].
    pub fn regrow(
        &self,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
    ) -> Result<(Self, Reuse), EngineError> {
        if self.net.backend() == Cpu.name() {
            let (net, reuse) = self.net.regrow(src, plan, tp)?;
            return Ok((Transformer { net }, reuse));
        }
        let layers_loaded = plan.layers.len();
        let t = Self::load_shard(src, cfg, plan, tp)?;
        let reuse = Reuse {
            layers_kept: 0,
            layers_loaded,
        };
        Ok((t, reuse))
    }

    /// What the device has done so far (queue submissions, dispatches, bytes read back),
    /// where the model runs on a GPU; `None` on the CPU.
    pub fn device_counters(&self) -> Option<crate::device::GpuCounters> {
        self.net.device_counters()
    }

    /// The model's hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        self.net.config()
    }

    /// What this rank holds.
    pub fn plan(&self) -> &ShardPlan {
        self.net.plan()
    }

    /// The name of the backend that computes it.
    pub fn backend(&self) -> &'static str {
        self.net.backend()
    }

    /// An empty KV cache for one sequence of up to `capacity` positions (this rank's
    /// layers and KV heads).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        self.net.new_cache(capacity)
    }

    /// Makes `to` hold the first `len` positions of `from` (both this model's caches), so a
    /// sequence that starts as another did runs only the rest.
    ///
    /// # Errors
    /// When a cache is another model's, `from` holds fewer positions, or `to` has no room.
    pub fn copy_prefix(
        &self,
        from: &KvCache,
        to: &mut KvCache,
        len: usize,
    ) -> Result<(), EngineError> {
        self.net.copy_prefix(from, to, len)
    }

    /// Runs `prompt` after what `cache` holds in chunks of at most
    /// [`crate::scheduler::PROMPT_CHUNK`] tokens and returns the logits of its last
    /// position.
    ///
    /// # Errors
    /// As [`Transformer::step`].
    pub fn prefill(&self, prompt: &[u32], cache: &mut KvCache) -> Result<Vec<f32>, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidInput {
                what: "an empty prompt (no tokens to condition on)".into(),
            });
        }
        if cache.len() + prompt.len() > cache.capacity() {
            return Err(EngineError::ContextFull {
                prompt: cache.len() + prompt.len(),
                ctx: cache.capacity(),
            });
        }
        let mut logits = Vec::new();
        for chunk in prompt.chunks(crate::scheduler::PROMPT_CHUNK) {
            logits = self.forward_last(chunk, cache)?;
        }
        Ok(logits)
    }

    /// One step of a rank that holds the whole model: sequence `i` adds `counts[i]` of
    /// `tokens` (in turn) after what `caches[i]` holds. Returns the logits of the last
    /// `last` positions of each sequence (at least one), a vocabulary-long row each, in
    /// order. The weights are read once for all rows; each sequence attends over its own
    /// cache.
    ///
    /// # Errors
    /// When the lengths do not agree, a cache is full, an id is out of range, or this rank
    /// holds only part of the model (the caches of a step that failed midway are unusable).
    pub fn step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.net.step(tokens, counts, caches, last)
    }

    /// Runs `tokens` (appended after what `cache` holds) and returns the logits of the last
    /// `n_logits` positions, a row each.
    ///
    /// # Errors
    /// As [`Transformer::step`].
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        n_logits: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.step(tokens, &[tokens.len()], &mut [cache], n_logits)
    }

    /// The logits of the last position of `tokens` after what `cache` holds.
    ///
    /// # Errors
    /// As [`Transformer::step`].
    pub fn forward_last(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, EngineError> {
        self.forward(tokens, cache, 1)
    }

    /// [`Transformer::step`] that also returns every row's output hidden state after the
    /// final norm, `hidden` values a row (what [`Transformer::mtp_step`] reads).
    ///
    /// # Errors
    /// As [`Transformer::step`]; `Unsupported` on a share split between devices.
    pub fn step_hidden(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        self.net.step_hidden(tokens, counts, caches, last)
    }

    /// Whether the model drafts its own tokens with a multi-token-prediction layer
    /// (GLM-4.5+'s `nextn` layer, loaded where this share holds the embedding, the whole
    /// output head and whole layers: the whole model, or [`ShardPlan::prediction_only`]).
    pub fn has_mtp(&self) -> bool {
        self.net.new_mtp_cache(1).is_some()
    }

    /// An empty cache of the multi-token-prediction layer for one sequence of up to
    /// `capacity` positions; `None` without the layer.
    pub fn new_mtp_cache(&self, capacity: usize) -> Option<KvCache> {
        self.net.new_mtp_cache(capacity)
    }

    /// The multi-token-prediction layer over `counts[i]` rows of each sequence after what
    /// its layer cache `caches[i]` holds: row `r` joins `hidden[r]` (the model's output
    /// hidden state at a position, from [`Transformer::step_hidden`], or this layer's output
    /// for a further draft) with `tokens[r]`, the token after that position. Returns the
    /// logits of the last `last` rows of each sequence (for the token two after each
    /// position; none when `last` is 0, for rows only read into the layer's cache) and
    /// every row's output hidden state.
    ///
    /// # Errors
    /// Without the layer, when the lengths disagree, an id is out of range, or a cache is
    /// full.
    pub fn mtp_step(
        &self,
        hidden: Vec<f32>,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        self.net.mtp_step(hidden, tokens, counts, caches, last)
    }

    /// One decode step of several sequences: `tokens[i]` after what `caches[i]` holds.
    /// Returns each sequence's logits, a row each, in order.
    ///
    /// # Errors
    /// As [`Transformer::step`].
    pub fn forward_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        let counts = vec![1; tokens.len()];
        self.step(tokens, &counts, caches, 1)
    }

    /// The hidden states of `tokens`, a row each (first pipeline stage only), summed over
    /// the stage's ranks when the vocabulary is cut.
    ///
    /// # Errors
    /// When this rank is not in the first stage, an id is out of range, or a peer fails.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.net.embed(tokens)
    }

    /// Runs this rank's layers over hidden states `x` (sequence `i`'s `counts[i]` rows in
    /// turn, after what `caches[i]` holds) and returns the hidden states after them.
    ///
    /// # Errors
    /// When the rows and caches do not agree, a cache is full, or a peer fails (the caches
    /// of a failed step are unusable).
    pub fn forward_layers(
        &self,
        x: Vec<f32>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        self.net.forward_layers(x, counts, caches)
    }

    /// This rank's vocabulary slice of the logits of the last `last` rows of each sequence
    /// of hidden states `x` (last pipeline stage only), a row each.
    ///
    /// # Errors
    /// When this rank is not in the last stage, or the rows do not agree.
    pub fn logits(
        &self,
        x: &[f32],
        counts: &[usize],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.net.logits(x, counts, last)
    }

    /// The output hidden states `x` (a row each) after the final norm (last pipeline stage
    /// only): what a multi-token-prediction layer reads.
    ///
    /// # Errors
    /// When this rank is not in the last stage, `x` is not whole rows, or the backend
    /// cannot give them.
    pub fn final_norm(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        self.net.final_norm(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
