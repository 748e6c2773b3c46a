//! One share cut across a node's two devices (`--gpu-layers`): its first layers on the GPU,
//! the rest on the CPU, each layer's KV cache beside it. The GPU part embeds the tokens
//! (on the first pipeline stage) and runs its layers; the hidden states cross to the host
//! once a step, a row per token; the CPU part runs the remaining layers and the output head
//! (on the last stage). Either part keeps the share's tensor-parallel communicator, so a
//! rank cut this way works in any split. How many layers the GPU takes is the user's count
//! or, by default, what its memory holds ([`fit_layers`], by the rule the planner predicts
//! with).

use std::sync::Arc;

use shoal_comm::Communicator;

use crate::arch;
use crate::backend::cpu::Cpu;
use crate::backend::gpu::Gpu;
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::network::{Network, PartInput};
use crate::shard::ShardPlan;
use crate::transformer::Forward;
use crate::weights::WeightSource;
use crate::EngineError;

/// The name a cut share's caches and backend go by.
const NAME: &str = "gpu+cpu";

/// A share whose first layers run on the GPU and the rest on the CPU.
pub(crate) struct Offloaded {
    gpu: Network<Gpu>,
    cpu: Network<Cpu>,
    plan: ShardPlan,
}

/// A cut share's cache of one sequence: the GPU layers' part and the CPU layers' part.
struct Parts {
    gpu: KvCache,
    cpu: KvCache,
}

/// `plan` cut after its first `n` layers (`0 < n < plan.layers.len()`): the GPU's part
/// (with the embedding, on the first stage) and the CPU's (with the head, on the last).
pub(crate) fn cut(plan: &ShardPlan, n: usize) -> (ShardPlan, ShardPlan) {
    let at = plan.layers.start + n;
    let first = ShardPlan {
        layers: plan.layers.start..at,
        last_stage: false,
        ..plan.clone()
    };
    let rest = ShardPlan {
        layers: at..plan.layers.end,
        first_stage: false,
        ..plan.clone()
    };
    (first, rest)
}

/// How many of `plan`'s first layers fit in `memory` bytes of GPU memory, by the rule the
/// planner predicts with (`shoal_planner::gpu::layers_that_fit`): this rank's share of each
/// layer's weights and its KV cache for `FIT_KV_POSITIONS` positions, after the embedding
/// (first stage) and the set-asides.
///
/// # Errors
/// When a tensor's size cannot be read.
pub(crate) fn fit_layers(
    memory: u64,
    src: &dyn WeightSource,
    cfg: &ModelConfig,
    plan: &ShardPlan,
) -> Result<usize, EngineError> {
    let spec = arch::spec(cfg.arch);
    let share = plan.shard.heads.len().max(1) as f64 / cfg.n_head.max(1) as f64;
    let mut embedding = 0;
    if plan.first_stage {
        if let Some(t) = spec.model_tensor(arch::Role::TokenEmbd) {
            let vocab_share = plan.vocab.len() as f64 / cfg.vocab.max(1) as f64;
            embedding = (src.stored_bytes(t.gguf)? as f64 * vocab_share) as u64;
        }
    }
    let kv_per_position = match &cfg.mla {
        Some(m) => ((m.kv_lora_rank + m.rope_dims) * std::mem::size_of::<half::f16>()) as u64,
        None => KvCache::bytes_per_token_per_layer(plan.shard.kv_heads.len(), cfg.head_dim),
    };
    let mut layers = Vec::with_capacity(plan.layers.len());
    for layer in plan.layers.clone() {
        let mut weights = 0u64;
        for (_, name) in spec.layer_names(layer) {
            if src.contains(&name) {
                weights += src.stored_bytes(&name)?;
            }
        }
        layers.push((weights as f64 * share) as u64);
    }
    Ok(shoal_planner::gpu::layers_that_fit(
        memory,
        embedding,
        layers,
        kv_per_position,
    ))
}

impl Offloaded {
    /// Loads `plan` with its first `n` layers on `gpu` and the rest on the CPU
    /// (`0 < n < plan.layers.len()`).
    ///
    /// # Errors
    /// When a tensor is missing or misshapen, or the GPU cannot hold its part.
    pub fn load(
        gpu: Gpu,
        src: &dyn WeightSource,
        cfg: ModelConfig,
        plan: ShardPlan,
        tp: Arc<dyn Communicator>,
        n: usize,
    ) -> Result<Self, EngineError> {
        if n == 0 || n >= plan.layers.len() {
            return Err(EngineError::Internal {
                what: format!("cutting a share of {} layers after {n}", plan.layers.len()),
            });
        }
        let (first, rest) = cut(&plan, n);
        Ok(Offloaded {
            gpu: Network::load(gpu, src, cfg.clone(), first, tp.clone())?,
            cpu: Network::load(Cpu, src, cfg, rest, tp)?,
            plan,
        })
    }

    /// Runs `input` through both parts: the hidden states after the last layer, or the
    /// logits of the last `last` rows of each sequence where `last` is given.
    fn run(
        &self,
        input: PartInput<'_>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: Option<usize>,
    ) -> Result<Vec<f32>, EngineError> {
        let mut gpu = Vec::with_capacity(caches.len());
        let mut cpu = Vec::with_capacity(caches.len());
        for c in caches.iter_mut() {
            let made_by = c.backend();
            let parts = c.store_mut::<Parts>().ok_or_else(|| foreign(made_by))?;
            gpu.push(&mut parts.gpu);
            cpu.push(&mut parts.cpu);
        }
        let result = self
            .gpu
            .part_step(input, counts, &mut gpu, None)
            .and_then(|x| {
                self.cpu
                    .part_step(PartInput::Hidden(x), counts, &mut cpu, last)
            });
        drop((gpu, cpu));
        for (c, &n) in caches.iter_mut().zip(counts) {
            let len = c.len();
            let parts = c.store_mut::<Parts>().expect("checked above");
            if result.is_ok() {
                debug_assert!(parts.gpu.len() == len + n && parts.cpu.len() == len + n);
                c.advance(n);
            } else {
                // a part that ran keeps its rows out of the cache, so both parts agree
                parts.gpu.truncate(len);
                parts.cpu.truncate(len);
            }
        }
        result
    }
}

/// The error for a cache a plain model made, given to a cut one.
fn foreign(made_by: &str) -> EngineError {
    EngineError::InvalidInput {
        what: format!(
            "a KV cache made by the {made_by} backend, for a model on the {NAME} backend"
        ),
    }
}

impl Forward for Offloaded {
    fn config(&self) -> &ModelConfig {
        self.gpu.config()
    }

    fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    fn backend(&self) -> &'static str {
        NAME
    }

    fn new_cache(&self, capacity: usize) -> KvCache {
        let parts = Parts {
            gpu: self.gpu.new_cache(capacity),
            cpu: self.cpu.new_cache(capacity),
        };
        KvCache::new(Box::new(parts), capacity, NAME)
    }

    fn copy_prefix(&self, from: &KvCache, to: &mut KvCache, len: usize) -> Result<(), EngineError> {
        let src = from
            .store::<Parts>()
            .ok_or_else(|| foreign(from.backend()))?;
        let made_by = to.backend();
        let dst = to.store_mut::<Parts>().ok_or_else(|| foreign(made_by))?;
        self.gpu.copy_prefix(&src.gpu, &mut dst.gpu, len)?;
        self.cpu.copy_prefix(&src.cpu, &mut dst.cpu, len)?;
        to.truncate(0);
        to.advance(len);
        Ok(())
    }

    fn step(
        &self,
        tokens: &[u32],
        counts: &[usize],
        caches: &mut [&mut KvCache],
        last: usize,
    ) -> Result<Vec<f32>, EngineError> {
        if !self.plan.is_full(self.config()) {
            return Err(EngineError::Internal {
                what: format!(
                    "a whole forward pass on a rank holding only part of the model ({:?})",
                    self.plan
                ),
            });
        }
        self.run(PartInput::Tokens(tokens), counts, caches, Some(last))
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.gpu.embed(tokens)
    }

    fn forward_layers(
        &self,
        x: Vec<f32>,
        counts: &[usize],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, EngineError> {
        self.run(PartInput::Hidden(x), counts, caches, None)
    }

    fn logits(&self, x: &[f32], counts: &[usize], last: usize) -> Result<Vec<f32>, EngineError> {
        self.cpu.logits(x, counts, last)
    }

    fn device_counters(&self) -> Option<crate::device::GpuCounters> {
        self.gpu.backend_counters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::GgufWeights;
    use shoal_model::gguf::GgufFile;
    use shoal_planner::gpu::{FIT_KV_POSITIONS, FIT_SPARE_BYTES};
    use shoal_testkit::{GgmlType, TinyModelSpec};

    /// The GPU memory in which exactly `need` bytes fit after what [`fit_layers`] sets
    /// aside.
    fn memory_for(need: u64) -> u64 {
        ((need + FIT_SPARE_BYTES) * 10).div_ceil(9) + 10
    }

    #[test]
    fn fit_counts_the_layers_whose_weights_and_cache_fit() {
        let mut spec = TinyModelSpec::qwen2(1);
        spec.n_layers = 3;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        spec.build()
            .unwrap()
            .write_gguf(&path, GgmlType::F32)
            .unwrap();
        let file = GgufFile::open(&path).unwrap();
        let vocab = file.tensor("token_embd.weight").unwrap().shape()[0];
        let cfg = crate::arch::config_from_gguf(file.metadata(), vocab, "fit test").unwrap();
        // sizes as the file's tensor table states them
        let layer: u64 = file
            .tensors()
            .iter()
            .filter(|t| t.name.starts_with("blk.0."))
            .map(|t| t.size)
            .sum();
        let embed = file.tensor("token_embd.weight").unwrap().size;
        let kv = KvCache::bytes_per_token_per_layer(cfg.n_kv_head, cfg.head_dim) * FIT_KV_POSITIONS;
        let src = GgufWeights::new(file);
        let full = ShardPlan::full(&cfg);
        for k in 0..=3u64 {
            let fit = fit_layers(memory_for(embed + k * (layer + kv)), &src, &cfg, &full).unwrap();
            assert_eq!(fit, k as usize, "memory for {k} layers");
        }
        assert_eq!(fit_layers(1 << 20, &src, &cfg, &full).unwrap(), 0);
        // a later stage holds no embedding
        let later = ShardPlan {
            first_stage: false,
            ..full.clone()
        };
        let fit = fit_layers(memory_for(2 * (layer + kv)), &src, &cfg, &later).unwrap();
        assert_eq!(fit, 2);
    }

    #[test]
    fn a_cut_gives_the_embedding_to_the_gpu_and_the_head_to_the_cpu() {
        let plan = ShardPlan {
            layers: 4..10,
            shard: crate::shard::LayerShard {
                heads: 0..4,
                kv_heads: 0..2,
                ffn: 0..64,
                experts: 0..0,
                expert_ffn: 0..0,
                shared_ffn: 0..0,
            },
            vocab: 0..8,
            first_stage: true,
            last_stage: true,
        };
        let (a, b) = cut(&plan, 2);
        assert_eq!((a.layers, a.first_stage, a.last_stage), (4..6, true, false));
        assert_eq!(
            (b.layers, b.first_stage, b.last_stage),
            (6..10, false, true)
        );
    }
}
