//! Tiny random Llama / Qwen2 / Qwen3 / Gemma 3 models written as a GGUF file and as a Hugging
//! Face folder, and tiny mixture-of-experts models (Qwen3 MoE, DeepSeek V2/V3 with multi-head
//! latent attention, Mixtral) written as a GGUF file.
//!
//! A [`TinyModelSpec`] (architecture, seed, hyperparameters) builds a [`TinyModel`] whose
//! weights come from the kit's fixed SplitMix64 generator, one stream per tensor, so a spec
//! always yields the same numbers. Every 2-D weight is first made exactly representable in the
//! spec's `snap_to` type (it is quantized and dequantized once), so a GGUF file written in that
//! type (or in F32) and an F32 safetensors file hold the very same values; 1-D tensors (norms,
//! biases) are always written as F32 to GGUF.
//!
//! Names follow llama.cpp's converter on the GGUF side (`token_embd.weight`,
//! `blk.N.attn_q.weight`, ..., `output.weight` unless tied) and transformers on the HF side
//! (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ...,
//! `lm_head.weight` unless tied). For `llama`, the GGUF q and k weights have their rows
//! permuted as the converter does (HF's rotate-half RoPE layout → GGUF's interleaved pairs):
//! within each head of `head_dim` rows, GGUF row `2i + j` is HF row `j * head_dim/2 + i`.
//! `qwen2`, `qwen3` and `gemma3` keep HF's order; `gemma3` norm weights are stored in GGUF as
//! `w + 1`
//! (HF's Gemma RMSNorm scales by `1 + w`), exact because the kit draws `1 + w` first.
//! GGUF `ne` lists dimensions innermost first, so an HF weight of
//! shape `[out, in]` has `ne = [in, out]`. A spec with [`Llama3Rope`] scaling writes its
//! per-pair frequency divisors as `rope_freqs.weight` into the GGUF (as llama.cpp's converter
//! does) and as `rope_scaling` into `config.json`.
//!
//! Mixture-of-experts models ([`crate::MoeSpec`]) hold each layer's routed experts stacked, as
//! llama.cpp's converters stack them before naming them: `mlp.experts.gate_proj.weight` of
//! shape `[n_expert, expert_ffn, hidden]` (Mixtral: `block_sparse_moe.experts.w1.weight`,
//! `w3` for up and `w2` for down), which GGUF writes as `blk.N.ffn_gate_exps.weight` with `ne =
//! [hidden, expert_ffn, n_expert]`; the router `mlp.gate.weight` becomes `ffn_gate_inp.weight`
//! and DeepSeek's `mlp.gate.e_score_correction_bias` `exp_probs_b.bias`, its shared experts
//! `mlp.shared_experts.*` `ffn_*_shexp`. DeepSeek's attention ([`crate::MlaSpec`]) holds
//! `kv_b_proj` already split the way the converter splits it: `self_attn.k_b_proj.weight` of
//! shape `[n_head, kv_lora_rank, nope_dim]` (`attn_k_b`, `ne = [nope_dim, kv_lora_rank,
//! n_head]`) and `self_attn.v_b_proj.weight` of shape `[n_head, v_dim, kv_lora_rank]`
//! (`attn_v_b`); its rotated dimensions are paired as llama.cpp's `deepseek2` pairs them
//! (adjacent), so nothing is permuted. Every weight of two or more dimensions is snapped along
//! its last (innermost) dimension, except two that GGUF keeps in F32 in every file: the router
//! (llama.cpp's converter and quantizer never quantize it) and `attn_k_b` when `nope_dim` is
//! not a whole number of the type's blocks (llama.cpp's quantizer falls back to another type
//! there). Mixtral's q and k rows are permuted as Llama's. With [`MoeSpec::router_dims`] set,
//! the router's columns past it and the rows below it of every attention output and FFN down
//! projection are zero before snapping. These models have no Hugging Face folder
//! ([`TinyModel::hf_files`] refuses them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::gguf_writer::{GgufValue, GgufWriter};
use crate::moe::{ExpertGating, MlaSpec, MoeNames, MoeSpec, YarnRope};
use crate::quants::{dequantize, quantize, GgmlType};
use crate::rng::SplitMix64;
use crate::tokenizer::{PreTokenizer, TinyTokenizer, CHATML_TEMPLATE};
use crate::TestkitError;

/// Model architecture of a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama (SmolLM-like tokenizer pre type `smollm`), no attention biases.
    Llama,
    /// Qwen2: q/k/v biases, tokenizer pre type `qwen2`.
    Qwen2,
    /// Qwen3 (dense): no biases, an RMSNorm over each query and key head before RoPE, a head
    /// size of its own (`key_length`), NeoX RoPE; tokenizer pre type `qwen2`.
    Qwen3,
    /// Gemma 3 (text): q/k norms, post-attention and post-FFN norms, `(1 + w)` RMSNorm
    /// weights in HF (GGUF stores `w + 1`), embeddings scaled by `sqrt(hidden)`, GELU (tanh)
    /// FFN, sliding-window layers with their own RoPE base. Tokenizer pre type `smollm`.
    Gemma3,
    /// Qwen3 MoE: the Qwen3 block with a routed mixture of experts in place of the FFN
    /// (softmax router, weights renormalised); tokenizer pre type `qwen2`.
    Qwen3Moe,
    /// DeepSeek V2 / V3 (`deepseek2` in llama.cpp): multi-head latent attention with YaRN
    /// where set, leading dense layers, then routed and shared experts. Tokenizer pre type
    /// `smollm`.
    Deepseek2,
    /// Mixtral: GGUF architecture `llama` with `llama.expert_count`: the Llama block with a
    /// routed mixture of experts (softmax router, weights renormalised). Tokenizer pre type
    /// `smollm`.
    Mixtral,
    /// GLM-4.5 / 4.6 / 4.7 (`glm4moe`): q/k/v biases, an RMSNorm over each query and key head,
    /// NeoX RoPE on the first [`TinyModelSpec::rope_dims`] dimensions of each head, the FFN
    /// norm named `post_attention_norm`, leading dense layers, then routed experts (sigmoid
    /// with a selection bias) beside a shared expert, and the multi-token-prediction layers of
    /// [`TinyModelSpec::nextn_layers`] after the others. Tokenizer pre type `qwen2`.
    Glm4Moe,
    /// gpt-oss (`gpt-oss`): biases on q, k, v and the attention output, a sink logit per
    /// query head (`self_attn.sinks`, GGUF `attn_sinks.weight`), sliding-window layers (the
    /// even ones) alternating with full ones, NeoX RoPE with YaRN on both, the FFN norm named
    /// `post_attention_norm`; every layer routes through experts with biases (router
    /// `mlp.gate.bias`, `mlp.experts.{gate,up,down}_proj.bias`), chosen by their raw logits
    /// and weighted by a softmax over the chosen, around the clamped SwiGLU. Tokenizer pre
    /// type `qwen2`.
    GptOss,
}

impl Arch {
    /// `general.architecture` and the prefix of the hyperparameter keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Deepseek2 => "deepseek2",
            Arch::Mixtral => "llama",
            Arch::Glm4Moe => "glm4moe",
            Arch::GptOss => "gpt-oss",
        }
    }

    /// `architectures[0]` in `config.json`.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Deepseek2 => "DeepseekV2ForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Glm4Moe => "Glm4MoeForCausalLM",
            Arch::GptOss => "GptOssForCausalLM",
        }
    }

    /// `model_type` in `config.json`.
    pub fn hf_model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3_text",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Deepseek2 => "deepseek_v2",
            Arch::Mixtral => "mixtral",
            Arch::Glm4Moe => "glm4_moe",
            Arch::GptOss => "gpt_oss",
        }
    }

    /// Whether q, k and v projections carry biases.
    pub fn has_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::Glm4Moe | Arch::GptOss)
    }

    /// Whether each query and key head is RMS-normed before RoPE.
    pub fn has_qk_norm(self) -> bool {
        matches!(
            self,
            Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe | Arch::Glm4Moe
        )
    }

    /// Whether GGUF stores q/k rows permuted relative to HF.
    pub fn permutes_qk(self) -> bool {
        matches!(self, Arch::Llama | Arch::Mixtral)
    }

    /// The tokenizer's pre-tokenizer for this architecture.
    pub fn pre_tokenizer(self) -> PreTokenizer {
        match self {
            Arch::Llama | Arch::Gemma3 | Arch::Deepseek2 | Arch::Mixtral => PreTokenizer::Smollm,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm4Moe | Arch::GptOss => {
                PreTokenizer::Qwen2
            }
        }
    }

    /// Whether the architecture routes its feed-forward through experts (its spec needs
    /// [`TinyModelSpec::moe`]).
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Mixtral | Arch::Glm4Moe | Arch::GptOss
        )
    }

    /// Whether the routing may use DeepSeek's settings (shared experts, leading dense layers,
    /// sigmoid gating, a weight scale, groups, a selection bias), as llama.cpp's graphs of
    /// these architectures do.
    pub fn has_deepseek_routing(self) -> bool {
        matches!(self, Arch::Deepseek2 | Arch::Glm4Moe)
    }
}

/// Element type of the tensors in `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SafetensorsDtype {
    /// `F32` (`torch_dtype` `float32`): exactly the model's values.
    F32,
    /// `F16` (`float16`): values rounded to nearest half.
    F16,
    /// `BF16` (`bfloat16`): values rounded to nearest bfloat16.
    BF16,
}

impl SafetensorsDtype {
    /// The `torch_dtype` string.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            SafetensorsDtype::F32 => "float32",
            SafetensorsDtype::F16 => "float16",
            SafetensorsDtype::BF16 => "bfloat16",
        }
    }

    fn st(self) -> safetensors::Dtype {
        match self {
            SafetensorsDtype::F32 => safetensors::Dtype::F32,
            SafetensorsDtype::F16 => safetensors::Dtype::F16,
            SafetensorsDtype::BF16 => safetensors::Dtype::BF16,
        }
    }

    /// Encodes values little-endian in this type.
    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            SafetensorsDtype::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            SafetensorsDtype::F16 => data
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            SafetensorsDtype::BF16 => data
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

/// Llama 3.1's RoPE scaling (Hugging Face `rope_scaling` with `rope_type: llama3`): pairs
/// whose wavelength is below `original_context / high_freq_factor` keep their frequency,
/// those above `original_context / low_freq_factor` have it divided by `factor`, and those
/// between are blended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    /// Divisor of the slowest pairs' frequencies.
    pub factor: f64,
    /// Wavelength bound (as a divisor of the original context) above which pairs are scaled.
    pub low_freq_factor: f64,
    /// Wavelength bound below which pairs are kept.
    pub high_freq_factor: f64,
    /// The context the model was first trained for.
    pub original_context: usize,
}

impl Llama3Rope {
    /// The per-pair divisors of the frequencies (`head_dim / 2` values): 1 where a pair
    /// keeps its frequency. Computed in f64 from the transformers formula and rounded to
    /// f32, the type GGUF stores them in.
    pub fn freq_factors(&self, theta: f64, head_dim: usize) -> Vec<f32> {
        let orig = self.original_context as f64;
        let (low_wavelen, high_wavelen) =
            (orig / self.low_freq_factor, orig / self.high_freq_factor);
        (0..head_dim / 2)
            .map(|i| {
                let inv = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                let scaled = if wavelen < high_wavelen {
                    inv
                } else if wavelen > low_wavelen {
                    inv / self.factor
                } else {
                    let smooth = (orig / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * inv / self.factor + smooth * inv
                };
                (inv / scaled) as f32
            })
            .collect()
    }
}

/// Hyperparameters and seed of a tiny model. Start from [`TinyModelSpec::llama`] or
/// [`TinyModelSpec::qwen2`] and change fields as needed; [`TinyModelSpec::build`] checks them.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Architecture.
    pub arch: Arch,
    /// Seed of the weights.
    pub seed: u64,
    /// `general.name` and the HF folder's name.
    pub name: String,
    /// Vocabulary size (rows of the embedding); at least the tokenizer's 297 tokens.
    pub vocab_size: usize,
    /// Hidden size; a multiple of 32 (of 256 when `snap_to` is a K-quant).
    pub hidden_size: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Key/value heads; divides `n_head`.
    pub n_kv_head: usize,
    /// Per-head dimension; even, and `n_head * head_dim` a multiple of 32.
    pub head_dim: usize,
    /// FFN inner size; a multiple of 32 (of 256 when `snap_to` is a K-quant).
    pub ffn_size: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Context length (`context_length` / `max_position_embeddings`).
    pub context_length: usize,
    /// Output head shares the token embedding (no `output.weight` / `lm_head.weight`).
    pub tied_embeddings: bool,
    /// Every weight of two or more dimensions (but those [`kept_f32`] names) is made exactly
    /// representable in this type.
    pub snap_to: GgmlType,
    /// Gemma 3 only: sliding-window size of the local layers (a query at position `t` sees
    /// keys at `u` with `t - u < sliding_window`).
    pub sliding_window: usize,
    /// Gemma 3 only: every `sliding_window_pattern`-th layer (1-based) is global, the others
    /// local (`sliding_window_pattern` in GGUF and `config.json`).
    pub sliding_window_pattern: usize,
    /// Gemma 3 only: RoPE base of the local layers (`rope.freq_base_swa`,
    /// `rope_local_base_freq`).
    pub rope_local_theta: f32,
    /// Llama only: Llama 3.1's RoPE scaling.
    pub llama3_rope: Option<Llama3Rope>,
    /// The mixture of experts: set exactly for the architectures that route
    /// ([`Arch::is_moe`]).
    pub moe: Option<MoeSpec>,
    /// DeepSeek only (and required there): multi-head latent attention. `head_dim` must then
    /// be its `nope_dim + rope_dim` and `n_kv_head` 1 (the latent is one shared KV head).
    pub mla: Option<MlaSpec>,
    /// DeepSeek only: YaRN RoPE scaling (`beta_fast` 32 and `beta_slow` 1, the values
    /// llama.cpp's `deepseek2` uses whatever the file says).
    pub yarn: Option<YarnRope>,
    /// GLM only: RoPE turns the first `rope_dims` dimensions of each head (with frequencies
    /// over `rope_dims`) and leaves the rest (`rope.dimension_count`); 0 turns all of them.
    pub rope_dims: usize,
    /// GLM only: multi-token-prediction layers written after the `n_layers` others (a whole
    /// block each plus its `nextn.*` tensors; `block_count` counts them and
    /// `nextn_predict_layers` says how many). The reference never runs them.
    pub nextn_layers: usize,
}

impl TinyModelSpec {
    /// A 2-layer Llama: vocab 320, hidden 64, 4 heads, 2 KV heads, head_dim 16, FFN 128,
    /// eps 1e-5, rope theta 10000, context 256, untied output, weights snapped to F32.
    pub fn llama(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Llama,
            seed,
            name: "tiny-llama".to_string(),
            vocab_size: 320,
            hidden_size: 64,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 16,
            ffn_size: 128,
            n_layers: 2,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            context_length: 256,
            tied_embeddings: false,
            snap_to: GgmlType::F32,
            sliding_window: 256,
            sliding_window_pattern: 1,
            rope_local_theta: 10000.0,
            llama3_rope: None,
            moe: None,
            mla: None,
            yarn: None,
            rope_dims: 0,
            nextn_layers: 0,
        }
    }

    /// A Llama with Llama 3.1's RoPE scaling at a scale where it shows in a short context:
    /// factor 8, low and high frequency factors 1 and 4, an original context of 32 (with
    /// head_dim 16 and base 10000 the first pair keeps its frequency, the second is blended
    /// and the rest are divided by 8).
    pub fn llama31(seed: u64) -> Self {
        TinyModelSpec {
            name: "tiny-llama31".to_string(),
            llama3_rope: Some(Llama3Rope {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 32,
            }),
            ..Self::llama(seed)
        }
    }

    /// The same shapes as [`TinyModelSpec::llama`] for Qwen2: eps 1e-6, rope theta 1e6,
    /// q/k/v biases, tied output.
    pub fn qwen2(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Qwen2,
            name: "tiny-qwen2".to_string(),
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_embeddings: true,
            ..Self::llama(seed)
        }
    }

    /// [`TinyModelSpec::llama`]'s hidden size, heads and FFN for Qwen3, with heads of 32 (so
    /// the query width, 128, is not the hidden size and the file must say `key_length`):
    /// eps 1e-6, rope theta 1e6, no biases, q/k norms, tied output.
    pub fn qwen3(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Qwen3,
            name: "tiny-qwen3".to_string(),
            head_dim: 32,
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_embeddings: true,
            ..Self::llama(seed)
        }
    }

    /// The same shapes as [`TinyModelSpec::llama`] for Gemma 3: eps 1e-6, rope theta 1e6
    /// (global layers) and 1e4 (local layers), sliding window 4, pattern 2 (layer 0 local,
    /// layer 1 global), tied output.
    pub fn gemma3(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Gemma3,
            name: "tiny-gemma3".to_string(),
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_embeddings: true,
            sliding_window: 4,
            sliding_window_pattern: 2,
            rope_local_theta: 10000.0,
            ..Self::llama(seed)
        }
    }

    /// A 2-layer Qwen3 MoE: [`TinyModelSpec::qwen3`]'s attention (hidden 64, 4 heads of 32, 2
    /// KV heads, q/k norms, NeoX RoPE, base 1e6, eps 1e-6) and an untied output; every layer
    /// routes through 8 experts of FFN 32, 4 per token, softmax router, weights renormalised.
    /// `ffn_size` (128) is written as `feed_forward_length` and used by no layer. As in every
    /// MoE spec, the router reads the first quarter of the hidden dimensions, which no layer
    /// writes ([`MoeSpec::router_dims`] 16).
    pub fn qwen3moe(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Qwen3Moe,
            name: "tiny-qwen3moe".to_string(),
            tied_embeddings: false,
            moe: Some(MoeSpec {
                n_expert: 8,
                n_expert_used: 4,
                expert_ffn: 32,
                n_shared_expert: 0,
                leading_dense: 0,
                gating: ExpertGating::Softmax,
                norm_weights: true,
                weights_scale: None,
                n_group: 0,
                n_group_used: 0,
                probs_bias: false,
                router_dims: 16,
            }),
            ..Self::qwen3(seed)
        }
    }

    /// A 2-layer Mixtral (GGUF architecture `llama`): [`TinyModelSpec::llama`]'s attention
    /// (hidden 64, 4 heads of 16, 2 KV heads, q/k rows permuted in GGUF), rope base 1e6, an
    /// untied output; every layer routes through 8 experts of FFN 64 (`ffn_size` too, the
    /// `feed_forward_length` llama.cpp sizes Mixtral's experts by), 2 per token, softmax
    /// router, weights renormalised; [`MoeSpec::router_dims`] 16.
    pub fn mixtral(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Mixtral,
            name: "tiny-mixtral".to_string(),
            ffn_size: 64,
            rope_theta: 1_000_000.0,
            moe: Some(MoeSpec {
                n_expert: 8,
                n_expert_used: 2,
                expert_ffn: 64,
                n_shared_expert: 0,
                leading_dense: 0,
                gating: ExpertGating::Softmax,
                norm_weights: true,
                weights_scale: None,
                n_group: 0,
                n_group_used: 0,
                probs_bias: false,
                router_dims: 16,
            }),
            ..Self::llama(seed)
        }
    }

    /// A 3-layer DeepSeek V2 (`deepseek2`, shaped like DeepSeek-V2-Lite): hidden 64, 4 heads,
    /// multi-head latent attention with a plain `attn_q` (no query rank), latent rank 32,
    /// 32 position-free and 16 rotated dimensions per query/key head, values of 16, rope base
    /// 1e4, no RoPE scaling, eps 1e-6, untied output; layer 0 has a dense FFN of 128, layers
    /// 1-2 route through 8 experts of FFN 32, 2 per token, by softmax, with the weights
    /// neither normalised nor scaled (`expert_weights_scale` 1), 1 group, plus 2 shared
    /// experts (one FFN of 64); [`MoeSpec::router_dims`] 16.
    pub fn deepseek2(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Deepseek2,
            name: "tiny-deepseek2".to_string(),
            n_head: 4,
            n_kv_head: 1,
            head_dim: 48,
            ffn_size: 128,
            n_layers: 3,
            rms_eps: 1e-6,
            rope_theta: 10000.0,
            moe: Some(MoeSpec {
                n_expert: 8,
                n_expert_used: 2,
                expert_ffn: 32,
                n_shared_expert: 2,
                leading_dense: 1,
                gating: ExpertGating::Softmax,
                norm_weights: false,
                weights_scale: Some(1.0),
                n_group: 1,
                n_group_used: 1,
                probs_bias: false,
                router_dims: 16,
            }),
            mla: Some(MlaSpec {
                kv_lora_rank: 32,
                q_lora_rank: 0,
                rope_dim: 16,
                nope_dim: 32,
                v_dim: 16,
            }),
            ..Self::llama(seed)
        }
    }

    /// A 3-layer DeepSeek V3 (`deepseek2` in llama.cpp): [`TinyModelSpec::deepseek2`]'s
    /// shapes with a query rank of 32 (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`) and YaRN
    /// (factor 4 over an original context of 32, beta 32 and 1, `mscale_all_dim` 0.707: with
    /// 16 rotated dimensions pair 0 keeps its frequency, pair 1 is blended and pairs 2-7 are
    /// divided by 4, and the attention scale grows by `(1 + 0.0707 ln 4)²`); layers 1-2 route
    /// through 16 experts of FFN 32 in 4 groups, keeping the 2 best groups and then the 4 best
    /// experts by sigmoid plus a per-expert selection bias, weights normalised and scaled by
    /// 2.5, plus 1 shared expert; [`MoeSpec::router_dims`] 16.
    pub fn deepseek3(seed: u64) -> Self {
        let base = Self::deepseek2(seed);
        TinyModelSpec {
            name: "tiny-deepseek3".to_string(),
            moe: Some(MoeSpec {
                n_expert: 16,
                n_expert_used: 4,
                expert_ffn: 32,
                n_shared_expert: 1,
                leading_dense: 1,
                gating: ExpertGating::Sigmoid,
                norm_weights: true,
                weights_scale: Some(2.5),
                n_group: 4,
                n_group_used: 2,
                probs_bias: true,
                router_dims: 16,
            }),
            mla: base.mla.map(|m| MlaSpec {
                q_lora_rank: 32,
                ..m
            }),
            yarn: Some(YarnRope {
                factor: 4.0,
                original_context: 32,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.707,
            }),
            ..base
        }
    }

    /// A 3-layer GLM-4.5 (`glm4moe`): hidden 64, 4 query heads of 32 (wider than the hidden
    /// size, so `key_length` is written) over 2 KV heads, q/k/v biases and per-head q/k norms,
    /// NeoX RoPE on the first 16 of each head's 32 dimensions, eps 1e-5, untied output; layer 0
    /// has a dense FFN of 128, layers 1-2 route through 8 experts of FFN 32, 2 per token, by
    /// sigmoid plus a per-expert selection bias, weights normalised and scaled by 2.5, beside
    /// 1 shared expert; [`MoeSpec::router_dims`] 16; one multi-token-prediction layer after
    /// them (`block_count` 4).
    pub fn glm4moe(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::Glm4Moe,
            name: "tiny-glm4moe".to_string(),
            n_head: 4,
            n_kv_head: 2,
            head_dim: 32,
            ffn_size: 128,
            n_layers: 3,
            moe: Some(MoeSpec {
                n_expert: 8,
                n_expert_used: 2,
                expert_ffn: 32,
                n_shared_expert: 1,
                leading_dense: 1,
                gating: ExpertGating::Sigmoid,
                norm_weights: true,
                weights_scale: Some(2.5),
                n_group: 0,
                n_group_used: 0,
                probs_bias: true,
                router_dims: 16,
            }),
            rope_dims: 16,
            nextn_layers: 1,
            ..Self::llama(seed)
        }
    }

    /// A 3-layer gpt-oss: hidden 64, 4 query heads of 32 (wider than the hidden size) over
    /// 2 KV heads, q/k/v and output biases, a sink logit per head, layers 0 and 2 attending
    /// within a window of 4 positions, NeoX RoPE (base 150000) with YaRN (factor 4 over an
    /// original context of 32) on every layer, eps 1e-5, untied output; every layer routes
    /// through 8 experts of FFN 32 with biases, 2 per token, by their raw logits, weighted by
    /// a softmax over the two; the router reads the whole hidden state.
    pub fn gpt_oss(seed: u64) -> Self {
        TinyModelSpec {
            arch: Arch::GptOss,
            name: "tiny-gpt-oss".to_string(),
            n_head: 4,
            n_kv_head: 2,
            head_dim: 32,
            n_layers: 3,
            rope_theta: 150_000.0,
            rope_local_theta: 150_000.0,
            sliding_window: 4,
            sliding_window_pattern: 2,
            moe: Some(MoeSpec {
                n_expert: 8,
                n_expert_used: 2,
                expert_ffn: 32,
                n_shared_expert: 0,
                leading_dense: 0,
                gating: ExpertGating::SoftmaxWeight,
                norm_weights: false,
                weights_scale: None,
                n_group: 0,
                n_group_used: 0,
                probs_bias: false,
                router_dims: 0,
            }),
            yarn: Some(YarnRope {
                factor: 4.0,
                original_context: 32,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.0,
            }),
            ..Self::llama(seed)
        }
    }

    /// Whether layer `il` routes its FFN through experts (a MoE model past its leading dense
    /// layers).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| il >= m.leading_dense)
    }

    /// Whether layer `il` is a local (sliding-window) layer: Gemma 3 and gpt-oss only,
    /// `il % pattern < pattern - 1`.
    pub fn is_local_layer(&self, il: usize) -> bool {
        matches!(self.arch, Arch::Gemma3 | Arch::GptOss)
            && self.sliding_window_pattern > 0
            && il % self.sliding_window_pattern < self.sliding_window_pattern - 1
    }

    /// This spec with `snap_to` set.
    pub fn snapped_to(mut self, ty: GgmlType) -> Self {
        self.snap_to = ty;
        self
    }

    /// This spec widened so every row is a whole number of 256-element K-quant blocks:
    /// hidden 256, FFN 512, head_dim 64 (4 heads, 2 KV heads kept). Experts get an FFN of 256
    /// (Mixtral's `ffn_size` too), GLM's rotated dimensions 32; DeepSeek's latent attention a
    /// latent and query rank of 256,
    /// 64 position-free, 32 rotated and 64 value dimensions per head (`attn_k_b`, whose rows
    /// are the 64 position-free dimensions, stays F32).
    pub fn k_quant_shapes(mut self) -> Self {
        self.hidden_size = 256;
        self.ffn_size = 512;
        self.head_dim = 64;
        self.n_head = 4;
        if self.rope_dims > 0 {
            self.rope_dims = 32;
        }
        if let Some(moe) = &mut self.moe {
            moe.expert_ffn = 256;
            if moe.router_dims > 0 {
                moe.router_dims = 64;
            }
            if self.arch == Arch::Mixtral {
                self.ffn_size = 256;
            }
        }
        if let Some(mla) = &mut self.mla {
            mla.kv_lora_rank = 256;
            if mla.q_lora_rank > 0 {
                mla.q_lora_rank = 256;
            }
            mla.nope_dim = 64;
            mla.rope_dim = 32;
            mla.v_dim = 64;
            self.head_dim = mla.qk_dim();
        }
        self
    }

    /// This spec with a router that reads the whole hidden state ([`MoeSpec::router_dims`]
    /// 0), so a token's experts depend on its context, as in a trained model.
    pub fn routed_on_the_whole_state(mut self) -> Self {
        if let Some(moe) = &mut self.moe {
            moe.router_dims = 0;
        }
        self
    }

    /// This spec with `tied_embeddings` set.
    pub fn tied(mut self, tied: bool) -> Self {
        self.tied_embeddings = tied;
        self
    }

    /// Checks the constraints listed on each field.
    pub fn validate(&self) -> Result<(), TestkitError> {
        let bad = |m: String| Err(TestkitError::InvalidSpec(m));
        let tok = TinyTokenizer::new();
        if self.vocab_size < tok.len() {
            return bad(format!(
                "vocab_size {} is below the tokenizer's {} tokens",
                self.vocab_size,
                tok.len()
            ));
        }
        let block = self.snap_to.block_size().max(32);
        let mut rows = vec![
            ("hidden_size", self.hidden_size),
            ("ffn_size", self.ffn_size),
        ];
        match &self.mla {
            None => rows.push(("n_head * head_dim", self.n_head * self.head_dim)),
            Some(mla) => {
                rows.push(("mla.kv_lora_rank", mla.kv_lora_rank));
                rows.push(("n_head * mla.v_dim", self.n_head * mla.v_dim));
                if mla.q_lora_rank > 0 {
                    rows.push(("mla.q_lora_rank", mla.q_lora_rank));
                }
            }
        }
        if let Some(moe) = &self.moe {
            rows.push(("moe.expert_ffn", moe.expert_ffn));
        }
        for (what, v) in rows {
            if v == 0 || !v.is_multiple_of(block) {
                return bad(format!(
                    "{what} = {v} must be a positive multiple of {block} (quant blocks of {:?} run along rows)",
                    self.snap_to
                ));
            }
        }
        if self.n_kv_head == 0 || !self.n_head.is_multiple_of(self.n_kv_head) {
            return bad(format!(
                "n_kv_head {} must divide n_head {}",
                self.n_kv_head, self.n_head
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even", self.head_dim));
        }
        if matches!(self.arch, Arch::Gemma3 | Arch::GptOss)
            && (self.sliding_window == 0 || self.sliding_window_pattern == 0)
        {
            return bad(format!(
                "{:?} needs sliding_window and sliding_window_pattern > 0",
                self.arch
            ));
        }
        if self.arch == Arch::GptOss
            && (self.sliding_window_pattern != 2 || self.rope_local_theta != self.rope_theta)
        {
            return bad(
                "gpt-oss: llama.cpp alternates windowed and full layers (pattern 2) and rotates \
                 both with one base"
                    .to_string(),
            );
        }
        if self.llama3_rope.is_some() && self.arch != Arch::Llama {
            return bad("llama3_rope is a Llama setting".to_string());
        }
        if (self.rope_dims > 0 || self.nextn_layers > 0) && self.arch != Arch::Glm4Moe {
            return bad("rope_dims and nextn_layers are Glm4Moe settings".to_string());
        }
        if self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad(format!(
                "rope_dims {} must be even and at most head_dim {}",
                self.rope_dims, self.head_dim
            ));
        }
        self.validate_moe()?;
        if self.n_layers == 0 || self.context_length == 0 {
            return bad("n_layers and context_length must be positive".to_string());
        }
        Ok(())
    }

    /// The checks of [`TinyModelSpec::validate`] on `moe`, `mla` and `yarn`.
    fn validate_moe(&self) -> Result<(), TestkitError> {
        let bad = |m: String| Err(TestkitError::InvalidSpec(m));
        let arch = self.arch;
        if arch.is_moe() != self.moe.is_some() {
            return bad(format!(
                "{arch:?} {} (`moe`)",
                if arch.is_moe() {
                    "needs a mixture of experts"
                } else {
                    "takes no mixture of experts"
                }
            ));
        }
        if (arch == Arch::Deepseek2) != self.mla.is_some() {
            return bad(format!(
                "`mla` is set exactly for Deepseek2 (the spec is {arch:?})"
            ));
        }
        if self.yarn.is_some() && !matches!(arch, Arch::Deepseek2 | Arch::GptOss) {
            return bad("yarn is a Deepseek2 and GptOss setting".to_string());
        }
        if let (Arch::GptOss, Some(moe)) = (arch, &self.moe) {
            if moe.gating != ExpertGating::SoftmaxWeight || moe.router_dims != 0 {
                return bad(
                    "gpt-oss: llama.cpp's graph weighs by a softmax over the chosen logits \
                     (SoftmaxWeight); and its biases reach every dimension, so router_dims \
                     must be 0"
                        .to_string(),
                );
            }
        } else if self
            .moe
            .as_ref()
            .is_some_and(|m| m.gating == ExpertGating::SoftmaxWeight)
        {
            return bad("SoftmaxWeight gating is a GptOss setting".to_string());
        }
        if let Some(moe) = &self.moe {
            if moe.n_expert < 2 || moe.n_expert_used == 0 || moe.n_expert_used > moe.n_expert {
                return bad(format!(
                    "moe: {} experts, {} used: need 2 or more experts and 1 to all of them used",
                    moe.n_expert, moe.n_expert_used
                ));
            }
            let deepseek_only = moe.n_shared_expert > 0
                || moe.leading_dense > 0
                || moe.gating == ExpertGating::Sigmoid
                || (!moe.norm_weights && arch != Arch::GptOss)
                || moe.weights_scale.is_some()
                || moe.n_group > 0
                || moe.probs_bias;
            if !arch.has_deepseek_routing() && deepseek_only {
                return bad(format!(
                    "moe: llama.cpp's {arch:?} routes by softmax with renormalised weights; shared \
                     experts, leading dense layers, sigmoid gating, a weight scale, groups and \
                     a selection bias are Deepseek2 and Glm4Moe settings"
                ));
            }
            if arch == Arch::Glm4Moe && !moe.probs_bias {
                return bad(
                    "moe: llama.cpp's glm4moe requires the selection bias (exp_probs_b)"
                        .to_string(),
                );
            }
            if moe.router_dims > self.hidden_size {
                return bad(format!(
                    "moe.router_dims {} exceeds hidden_size {}",
                    moe.router_dims, self.hidden_size
                ));
            }
            if moe.leading_dense >= self.n_layers {
                return bad(format!(
                    "moe.leading_dense {} leaves none of the {} layers to the experts",
                    moe.leading_dense, self.n_layers
                ));
            }
            if moe.n_group > 1 {
                let size = moe.n_expert / moe.n_group;
                if !moe.n_expert.is_multiple_of(moe.n_group)
                    || size < 2
                    || moe.n_group_used == 0
                    || moe.n_group_used >= moe.n_group
                    || moe.n_expert_used > moe.n_group_used * size
                {
                    return bad(format!(
                        "moe: {} experts in {} groups, {} kept, cannot choose {}: groups must \
                         divide the experts, hold 2 or more each, and keep 1 to n_group - 1 \
                         groups holding at least n_expert_used experts",
                        moe.n_expert, moe.n_group, moe.n_group_used, moe.n_expert_used
                    ));
                }
            }
            if arch == Arch::Mixtral && self.ffn_size != moe.expert_ffn {
                return bad(format!(
                    "Mixtral: ffn_size {} must equal moe.expert_ffn {} (llama.cpp sizes \
                     Mixtral's experts by feed_forward_length)",
                    self.ffn_size, moe.expert_ffn
                ));
            }
        }
        if let Some(mla) = &self.mla {
            if mla.rope_dim == 0 || !mla.rope_dim.is_multiple_of(2) || mla.nope_dim == 0 {
                return bad(format!(
                    "mla: rope_dim {} must be even and positive, nope_dim {} positive",
                    mla.rope_dim, mla.nope_dim
                ));
            }
            if self.n_kv_head != 1 || self.head_dim != mla.qk_dim() {
                return bad(format!(
                    "mla: n_kv_head must be 1 and head_dim nope_dim + rope_dim = {} (they are {} \
                     and {})",
                    mla.qk_dim(),
                    self.n_kv_head,
                    self.head_dim
                ));
            }
        }
        if let Some(y) = &self.yarn {
            if y.factor <= 1.0 || y.original_context == 0 {
                return bad(format!(
                    "yarn: factor {} must exceed 1 and original_context {} be positive",
                    y.factor, y.original_context
                ));
            }
            if y.beta_fast != 32.0
                || y.beta_slow != 1.0
                || (arch == Arch::GptOss && y.log_multiplier != 0.0)
            {
                return bad(format!(
                    "yarn: llama.cpp's deepseek2 uses beta_fast 32 and beta_slow 1 whatever the \
                     file says (the spec has {} and {})",
                    y.beta_fast, y.beta_slow
                ));
            }
        }
        Ok(())
    }

    /// Generates the weights.
    pub fn build(&self) -> Result<TinyModel, TestkitError> {
        TinyModel::new(self.clone())
    }
}

/// One weight: row-major `f32` values and their HF shape (outermost first).
#[derive(Debug, Clone, PartialEq)]
pub struct Weight {
    /// Shape, outermost first (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

impl Weight {
    /// GGUF `ne` (innermost first).
    pub fn ne(&self) -> Vec<u64> {
        self.shape.iter().rev().map(|d| *d as u64).collect()
    }
}

/// A generated tiny model; see the module docs.
#[derive(Debug, Clone)]
pub struct TinyModel {
    spec: TinyModelSpec,
    tokenizer: TinyTokenizer,
    weights: BTreeMap<String, Weight>,
    /// For a quantized `snap_to`: the encoded blocks of each snapped weight (HF row order), so the
    /// GGUF gets exactly the blocks the values came from (re-quantizing is not always exact).
    encoded: BTreeMap<String, Vec<u8>>,
}

/// Stable per-tensor seed (FNV-1a of the name mixed with the model seed).
fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl TinyModel {
    /// Generates the model described by `spec`.
    pub fn new(spec: TinyModelSpec) -> Result<Self, TestkitError> {
        spec.validate()?;
        let s = &spec;
        let h = s.hidden_size;
        let q_out = s.n_head * s.head_dim;
        let kv_out = s.n_kv_head * s.head_dim;
        let mut weights = BTreeMap::new();
        let mut encoded = BTreeMap::new();
        let mut add = |name: String, shape: Vec<usize>, mean: f32, std: f32| {
            let n: usize = shape.iter().product();
            let mut rng = SplitMix64::new(tensor_seed(s.seed, &name));
            let mut data: Vec<f32> = (0..n).map(|_| mean + std * rng.normal()).collect();
            let gguf = gguf_name_for(s.arch, &name);
            if let Some(moe) = s.moe.as_ref().filter(|m| m.router_dims > 0) {
                reserve_router_dims(gguf.as_deref().unwrap_or(""), &shape, &mut data, moe);
            }
            let f32_in_gguf = gguf.is_some_and(|g| kept_f32(&g, &shape, s.snap_to));
            if shape.len() >= 2 && s.snap_to != GgmlType::F32 && !f32_in_gguf {
                let bytes = quantize(s.snap_to, &data).expect("rows are whole blocks");
                data = dequantize(s.snap_to, &bytes, n).expect("whole blocks");
                if s.snap_to.is_quantized() {
                    encoded.insert(name.clone(), bytes);
                }
            }
            if s.arch == Arch::Gemma3 && name.ends_with("norm.weight") {
                // HF holds w with the norm scaling by (1 + w); draw 1 + w and subtract 1
                // (exact for values in [0.5, 2]) so GGUF's w + 1 is exact too.
                for v in &mut data {
                    let w = *v - 1.0;
                    assert_eq!(w + 1.0, *v, "norm weight out of the exact range");
                    *v = w;
                }
            }
            weights.insert(name, Weight { shape, data });
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![s.vocab_size, h],
            0.0,
            0.2,
        );
        for l in 0..s.n_layers + s.nextn_layers {
            let p = format!("model.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), vec![h], 1.0, 0.05);
            if let Some(mla) = &s.mla {
                Self::add_mla(&mut add, &p, s, mla);
            } else {
                add(
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![q_out, h],
                    0.0,
                    0.08,
                );
                add(
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![kv_out, h],
                    0.0,
                    0.08,
                );
                add(
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![kv_out, h],
                    0.0,
                    0.08,
                );
                if s.arch.has_qk_norm() {
                    add(
                        format!("{p}.self_attn.q_norm.weight"),
                        vec![s.head_dim],
                        1.0,
                        0.05,
                    );
                    add(
                        format!("{p}.self_attn.k_norm.weight"),
                        vec![s.head_dim],
                        1.0,
                        0.05,
                    );
                }
                if s.arch.has_qkv_bias() {
                    add(format!("{p}.self_attn.q_proj.bias"), vec![q_out], 0.0, 0.1);
                    add(format!("{p}.self_attn.k_proj.bias"), vec![kv_out], 0.0, 0.1);
                    add(format!("{p}.self_attn.v_proj.bias"), vec![kv_out], 0.0, 0.1);
                }
                add(
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, q_out],
                    0.0,
                    0.08,
                );
                if s.arch == Arch::GptOss {
                    add(format!("{p}.self_attn.o_proj.bias"), vec![h], 0.0, 0.1);
                    add(format!("{p}.self_attn.sinks"), vec![s.n_head], 0.0, 1.0);
                }
            }
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                1.0,
                0.05,
            );
            if s.arch == Arch::Gemma3 {
                add(
                    format!("{p}.pre_feedforward_layernorm.weight"),
                    vec![h],
                    1.0,
                    0.05,
                );
                add(
                    format!("{p}.post_feedforward_layernorm.weight"),
                    vec![h],
                    1.0,
                    0.05,
                );
            }
            match &s.moe {
                Some(moe) if s.is_moe_layer(l) => Self::add_moe(&mut add, &p, s, moe),
                _ => {
                    add(
                        format!("{p}.mlp.gate_proj.weight"),
                        vec![s.ffn_size, h],
                        0.0,
                        0.08,
                    );
                    add(
                        format!("{p}.mlp.up_proj.weight"),
                        vec![s.ffn_size, h],
                        0.0,
                        0.08,
                    );
                    add(
                        format!("{p}.mlp.down_proj.weight"),
                        vec![h, s.ffn_size],
                        0.0,
                        0.06,
                    );
                }
            }
            if l >= s.n_layers {
                // the prediction layer's own tensors: its input is the projection of the
                // normed embedding of the next token beside the normed hidden state
                add(format!("{p}.eh_proj.weight"), vec![h, 2 * h], 0.0, 0.08);
                add(format!("{p}.enorm.weight"), vec![h], 1.0, 0.05);
                add(format!("{p}.hnorm.weight"), vec![h], 1.0, 0.05);
                add(format!("{p}.shared_head.norm.weight"), vec![h], 1.0, 0.05);
            }
        }
        add("model.norm.weight".into(), vec![h], 1.0, 0.05);
        if !s.tied_embeddings {
            add("lm_head.weight".into(), vec![s.vocab_size, h], 0.0, 0.15);
        }
        Ok(TinyModel {
            spec,
            tokenizer: TinyTokenizer::new(),
            weights,
            encoded,
        })
    }

    /// Adds layer `p`'s multi-head latent attention weights through `add` (name, shape, mean,
    /// standard deviation).
    fn add_mla(
        add: &mut impl FnMut(String, Vec<usize>, f32, f32),
        p: &str,
        s: &TinyModelSpec,
        mla: &MlaSpec,
    ) {
        let h = s.hidden_size;
        let (rank, q_rank) = (mla.kv_lora_rank, mla.q_lora_rank);
        let q_out = s.n_head * mla.qk_dim();
        if q_rank == 0 {
            add(
                format!("{p}.self_attn.q_proj.weight"),
                vec![q_out, h],
                0.0,
                0.08,
            );
        } else {
            add(
                format!("{p}.self_attn.q_a_proj.weight"),
                vec![q_rank, h],
                0.0,
                0.08,
            );
            add(
                format!("{p}.self_attn.q_a_layernorm.weight"),
                vec![q_rank],
                1.0,
                0.05,
            );
            add(
                format!("{p}.self_attn.q_b_proj.weight"),
                vec![q_out, q_rank],
                0.0,
                0.08,
            );
        }
        add(
            format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            vec![rank + mla.rope_dim, h],
            0.0,
            0.08,
        );
        add(
            format!("{p}.self_attn.kv_a_layernorm.weight"),
            vec![rank],
            1.0,
            0.05,
        );
        add(
            format!("{p}.self_attn.k_b_proj.weight"),
            vec![s.n_head, rank, mla.nope_dim],
            0.0,
            0.08,
        );
        add(
            format!("{p}.self_attn.v_b_proj.weight"),
            vec![s.n_head, mla.v_dim, rank],
            0.0,
            0.08,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, s.n_head * mla.v_dim],
            0.0,
            0.08,
        );
    }

    /// Adds layer `p`'s router, selection bias, stacked experts and shared experts through
    /// `add` (name, shape, mean, standard deviation).
    fn add_moe(
        add: &mut impl FnMut(String, Vec<usize>, f32, f32),
        p: &str,
        s: &TinyModelSpec,
        moe: &MoeSpec,
    ) {
        let (h, n, f) = (s.hidden_size, moe.n_expert, moe.expert_ffn);
        let names = MoeNames::of(s.arch, p);
        add(names.router, vec![n, h], 0.0, 1.0);
        if moe.probs_bias {
            add(
                format!("{p}.mlp.gate.e_score_correction_bias"),
                vec![n],
                0.0,
                0.05,
            );
        }
        add(names.gate, vec![n, f, h], 0.0, 0.08);
        add(names.up, vec![n, f, h], 0.0, 0.08);
        add(names.down, vec![n, h, f], 0.0, 0.08);
        if s.arch == Arch::GptOss {
            // std 1 on the gate and up biases, so some products pass the SwiGLU's clamps
            add(format!("{p}.mlp.gate.bias"), vec![n], 0.0, 0.5);
            add(
                format!("{p}.mlp.experts.gate_proj.bias"),
                vec![n, f],
                0.0,
                1.0,
            );
            add(
                format!("{p}.mlp.experts.up_proj.bias"),
                vec![n, f],
                0.0,
                1.0,
            );
            add(
                format!("{p}.mlp.experts.down_proj.bias"),
                vec![n, h],
                0.0,
                0.1,
            );
        }
        if moe.n_shared_expert > 0 {
            let fs = moe.n_shared_expert * f;
            let sp = format!("{p}.mlp.shared_experts");
            add(format!("{sp}.gate_proj.weight"), vec![fs, h], 0.0, 0.08);
            add(format!("{sp}.up_proj.weight"), vec![fs, h], 0.0, 0.08);
            add(format!("{sp}.down_proj.weight"), vec![h, fs], 0.0, 0.06);
        }
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &TinyModelSpec {
        &self.spec
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TinyTokenizer {
        &self.tokenizer
    }

    /// Every weight by HF name, in HF layout (q/k not permuted).
    pub fn weights(&self) -> &BTreeMap<String, Weight> {
        &self.weights
    }

    /// One weight by HF name.
    pub fn weight(&self, hf_name: &str) -> Option<&Weight> {
        self.weights.get(hf_name)
    }

    /// Mutable weights, for tests that plant known values (keep shapes, and keep 2-D values
    /// representable in `snap_to` if the GGUF must match the safetensors).
    pub fn weights_mut(&mut self) -> &mut BTreeMap<String, Weight> {
        &mut self.weights
    }

    /// A model with a multi-token-prediction layer (`spec.nextn_layers` > 0, as
    /// [`TinyModelSpec::glm4moe`]) made to foresee it: every block's output projections
    /// zeroed make each block pass its input on, so the model maps a token to the next by its
    /// embedding alone; the prediction layer's block passes its input on too and its
    /// projection keeps only the token's normed embedding (`enorm` of weight 1, its head
    /// norm the model's), so it predicts exactly what the model will say and every draft it
    /// makes is taken.
    ///
    /// # Errors
    /// As [`TinyModel::new`], and when the spec has no prediction layer.
    pub fn foreseeing(spec: TinyModelSpec) -> Result<Self, TestkitError> {
        if spec.nextn_layers == 0 {
            return Err(TestkitError::InvalidSpec(format!(
                "{} has no prediction layer to foresee the model with",
                spec.name
            )));
        }
        let mut tm = TinyModel::new(spec)?;
        let h = tm.spec().hidden_size;
        let l = tm.spec().n_layers;
        let norm = tm
            .weight("model.norm.weight")
            .ok_or_else(|| TestkitError::InvalidSpec("no final norm".into()))?
            .clone();
        for (name, w) in tm.weights_mut().iter_mut() {
            if name.ends_with("o_proj.weight") || name.contains("down_proj") {
                w.data.fill(0.0);
            }
            if name == &format!("model.layers.{l}.eh_proj.weight") {
                for r in 0..h {
                    for c in 0..2 * h {
                        w.data[r * 2 * h + c] = if c == r { 1.0 } else { 0.0 };
                    }
                }
            }
            if name == &format!("model.layers.{l}.enorm.weight") {
                w.data.fill(1.0);
            }
            if name == &format!("model.layers.{l}.shared_head.norm.weight") {
                w.data.clone_from(&norm.data);
            }
        }
        Ok(tm)
    }

    /// The GGUF name of an HF tensor name of this model's architecture, if it is one.
    pub fn gguf_name(&self, hf_name: &str) -> Option<String> {
        gguf_name_for(self.spec.arch, hf_name)
    }

    /// The weights as GGUF holds them before encoding: GGUF names, in file order, q/k rows
    /// permuted for `llama`, Gemma 3 norm weights stored as `w + 1`. Shapes stay outermost-first
    /// (`Weight::ne` gives GGUF's order).
    pub fn gguf_weights(&self) -> Vec<(String, Weight)> {
        let mut order: Vec<&String> = self.weights.keys().collect();
        order.sort_by_key(|n| gguf_order_key(n));
        order
            .into_iter()
            .map(|hf| {
                let w = &self.weights[hf];
                let name = self.gguf_name(hf).expect("every weight has a GGUF name");
                let mut w = match self.qk_heads(hf) {
                    Some(n_head) => permute_rows(w, n_head),
                    None => w.clone(),
                };
                if self.spec.arch == Arch::Gemma3 && hf.ends_with("norm.weight") {
                    // the converter stores Gemma's (1 + w) norm weights as w + 1
                    w.data.iter_mut().for_each(|v| *v += 1.0);
                }
                (name, w)
            })
            .collect()
    }

    /// The head count whose permutation GGUF applies to this HF tensor's rows, if any.
    fn qk_heads(&self, hf: &str) -> Option<usize> {
        if !self.spec.arch.permutes_qk() {
            None
        } else if hf.ends_with("q_proj.weight") {
            Some(self.spec.n_head)
        } else if hf.ends_with("k_proj.weight") {
            Some(self.spec.n_kv_head)
        } else {
            None
        }
    }

    /// The blocks the snapped values of GGUF tensor `gguf` came from, in GGUF row order, if
    /// the model still holds exactly those values.
    fn snapped_blocks(&self, gguf: &str, weight: &Weight, ty: GgmlType) -> Option<Vec<u8>> {
        if ty != self.spec.snap_to {
            return None;
        }
        let hf = self
            .weights
            .keys()
            .find(|hf| self.gguf_name(hf).as_deref() == Some(gguf))?;
        let bytes = self.encoded.get(hf)?;
        let rows = weight.data.len() / weight.shape.last()?;
        let row_bytes = bytes.len() / rows;
        let bytes = match self.qk_heads(hf) {
            Some(n_head) => permute_row_chunks(bytes, row_bytes, n_head),
            None => bytes.clone(),
        };
        let values = dequantize(ty, &bytes, weight.data.len()).ok()?;
        let same = values
            .iter()
            .zip(&weight.data)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        same.then_some(bytes)
    }

    /// `general.file_type` (llama_ftype) for a GGUF whose 2-D weights are `ty`.
    fn file_type(ty: GgmlType) -> u32 {
        match ty {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 7,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 12, // MOSTLY_Q3_K_M
            GgmlType::Q4_K => 15, // MOSTLY_Q4_K_M
            GgmlType::Q6_K => 18,
            GgmlType::BF16 => 32,
            GgmlType::IQ4_NL => 25,
            GgmlType::IQ4_XS => 30,
            GgmlType::MXFP4 => 38, // MOSTLY_MXFP4_MOE
        }
    }

    /// A [`GgufWriter`] loaded with this model (metadata, tokenizer, tensors) with its weights
    /// of two or more dimensions in `ty` (see [`TinyModel::write_gguf`]), for tests that want
    /// to alter it before writing.
    pub fn gguf_writer(&self, ty: GgmlType) -> Result<GgufWriter, TestkitError> {
        self.gguf_writer_mixed(ty, |_, _| ty)
    }

    /// Like [`TinyModel::gguf_writer`] but `choose(gguf_name, weight)` picks the type of each
    /// weight of two or more dimensions (a mix like llama.cpp's `Q4_K_M`, which keeps some
    /// tensors in `Q6_K`); `file_type` sets `general.file_type`. 1-D tensors, and those
    /// [`kept_f32`] names for the chosen type, stay F32.
    pub fn gguf_writer_mixed(
        &self,
        file_type: GgmlType,
        choose: impl Fn(&str, &Weight) -> GgmlType,
    ) -> Result<GgufWriter, TestkitError> {
        let ty = file_type;
        let s = &self.spec;
        let a = s.arch.gguf_name();
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", a)
            .add_kv("general.name", s.name.as_str())
            .add_kv("general.file_type", Self::file_type(ty));
        if ty.is_quantized() {
            w.add_kv("general.quantization_version", 2u32);
        }
        let rope_dims = if s.rope_dims > 0 {
            s.rope_dims
        } else {
            s.head_dim
        };
        w.add_kv(
            format!("{a}.block_count"),
            (s.n_layers + s.nextn_layers) as u32,
        )
        .add_kv(format!("{a}.context_length"), s.context_length as u32)
        .add_kv(format!("{a}.embedding_length"), s.hidden_size as u32)
        .add_kv(format!("{a}.feed_forward_length"), s.ffn_size as u32)
        .add_kv(format!("{a}.attention.head_count"), s.n_head as u32)
        .add_kv(format!("{a}.attention.head_count_kv"), s.n_kv_head as u32)
        .add_kv(format!("{a}.attention.layer_norm_rms_epsilon"), s.rms_eps)
        .add_kv(format!("{a}.rope.freq_base"), s.rope_theta)
        .add_kv(format!("{a}.rope.dimension_count"), rope_dims as u32)
        .add_kv(format!("{a}.vocab_size"), s.vocab_size as u32);
        if s.mla.is_none()
            && (s.head_dim * s.n_head != s.hidden_size
                || matches!(
                    s.arch,
                    Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm4Moe | Arch::GptOss
                ))
        {
            w.add_kv(format!("{a}.attention.key_length"), s.head_dim as u32)
                .add_kv(format!("{a}.attention.value_length"), s.head_dim as u32);
        }
        self.add_moe_kvs(&mut w);
        if s.arch == Arch::GptOss {
            w.add_kv(
                format!("{a}.attention.sliding_window"),
                s.sliding_window as u32,
            );
        }
        if s.arch == Arch::Gemma3 {
            w.add_kv(
                format!("{a}.attention.sliding_window"),
                s.sliding_window as u32,
            )
            .add_kv(
                format!("{a}.attention.sliding_window_pattern"),
                s.sliding_window_pattern as u32,
            )
            .add_kv(format!("{a}.rope.freq_base_swa"), s.rope_local_theta);
        }
        let tok = &self.tokenizer;
        let (tokens, types) = tok.gguf_tokens(s.vocab_size);
        w.add_kv("tokenizer.ggml.model", "gpt2")
            .add_kv("tokenizer.ggml.pre", s.arch.pre_tokenizer().gguf_name())
            .add_kv("tokenizer.ggml.tokens", GgufValue::strings(tokens))
            .add_kv("tokenizer.ggml.token_type", GgufValue::i32s(types))
            .add_kv(
                "tokenizer.ggml.merges",
                GgufValue::strings(tok.gguf_merges()),
            )
            .add_kv("tokenizer.ggml.bos_token_id", tok.bos_id())
            .add_kv("tokenizer.ggml.eos_token_id", tok.eos_id())
            .add_kv("tokenizer.ggml.padding_token_id", tok.bos_id())
            .add_kv("tokenizer.ggml.add_bos_token", false)
            .add_kv("tokenizer.chat_template", CHATML_TEMPLATE);
        if let Some(r) = &s.llama3_rope {
            let factors = r.freq_factors(s.rope_theta as f64, s.head_dim);
            w.add_tensor(
                "rope_freqs.weight",
                &[factors.len() as u64],
                GgmlType::F32,
                &factors,
            )?;
        }
        for (name, weight) in self.gguf_weights() {
            let t = if weight.shape.len() == 1 {
                GgmlType::F32
            } else {
                let t = choose(&name, &weight);
                if kept_f32(&name, &weight.shape, t) {
                    GgmlType::F32
                } else {
                    t
                }
            };
            match self.snapped_blocks(&name, &weight, t) {
                Some(bytes) => w.add_tensor_bytes(name, &weight.ne(), t, bytes)?,
                None => w.add_tensor(name, &weight.ne(), t, &weight.data)?,
            };
        }
        Ok(w)
    }

    /// The metadata of the experts, the latent attention, YaRN and GLM's prediction layers,
    /// under the keys llama.cpp's converters write (DeepSeek's `rope.dimension_count` is then
    /// the rotated dimensions, `head_count_kv` 1 and `key_length` / `value_length` the
    /// latent's, replacing the plain values written before).
    fn add_moe_kvs(&self, w: &mut GgufWriter) {
        let s = &self.spec;
        let a = s.arch.gguf_name();
        let Some(moe) = &s.moe else {
            return;
        };
        let k = |key: &str| format!("{a}.{key}");
        w.add_kv(k("expert_count"), moe.n_expert as u32)
            .add_kv(k("expert_used_count"), moe.n_expert_used as u32);
        if s.arch != Arch::Mixtral {
            w.add_kv(k("expert_feed_forward_length"), moe.expert_ffn as u32);
        }
        if let Some(y) = &s.yarn {
            w.add_kv(k("rope.scaling.type"), "yarn")
                .add_kv(k("rope.scaling.factor"), y.factor)
                .add_kv(
                    k("rope.scaling.original_context_length"),
                    y.original_context as u32,
                )
                .add_kv(k("rope.scaling.yarn_beta_fast"), y.beta_fast)
                .add_kv(k("rope.scaling.yarn_beta_slow"), y.beta_slow);
            if y.log_multiplier != 0.0 {
                w.add_kv(
                    k("rope.scaling.yarn_log_multiplier"),
                    y.gguf_log_multiplier(),
                );
            }
        }
        if !s.arch.has_deepseek_routing() {
            return;
        }
        if let Some(mla) = &s.mla {
            w.set_kv(&k("attention.head_count_kv"), 1u32)
                .set_kv(&k("rope.dimension_count"), mla.rope_dim as u32);
            w.add_kv(k("attention.q_lora_rank"), mla.q_lora_rank as u32)
                .add_kv(k("attention.kv_lora_rank"), mla.kv_lora_rank as u32)
                .add_kv(
                    k("attention.key_length"),
                    (mla.kv_lora_rank + mla.rope_dim) as u32,
                )
                .add_kv(k("attention.value_length"), mla.kv_lora_rank as u32)
                .add_kv(k("attention.key_length_mla"), mla.qk_dim() as u32)
                .add_kv(k("attention.value_length_mla"), mla.v_dim as u32);
        }
        if s.arch == Arch::Glm4Moe {
            w.add_kv(k("nextn_predict_layers"), s.nextn_layers as u32);
        }
        w.add_kv(k("leading_dense_block_count"), moe.leading_dense as u32)
            .add_kv(k("expert_shared_count"), moe.n_shared_expert as u32);
        if let Some(scale) = moe.weights_scale {
            w.add_kv(k("expert_weights_scale"), scale);
        }
        if moe.norm_weights {
            w.add_kv(k("expert_weights_norm"), true);
        }
        w.add_kv(k("expert_gating_func"), moe.gating.gguf_id());
        if moe.n_group > 0 {
            w.add_kv(k("expert_group_count"), moe.n_group as u32)
                .add_kv(k("expert_group_used_count"), moe.n_group_used as u32);
        }
    }

    /// Writes the GGUF file (weights of two or more dimensions as `ty`, 1-D ones and those
    /// [`kept_f32`] names as F32). Its values equal the
    /// safetensors' F32 values when `ty` is F32 or the spec's `snap_to`.
    pub fn write_gguf(&self, path: impl AsRef<Path>, ty: GgmlType) -> Result<(), TestkitError> {
        self.gguf_writer(ty)?.write_to(path)
    }

    /// `config.json`.
    pub fn config_json(&self, dtype: SafetensorsDtype) -> Value {
        let s = &self.spec;
        let tok = &self.tokenizer;
        let mut c = json!({
            "architectures": [s.arch.hf_architecture()],
            "model_type": s.arch.hf_model_type(),
            "hidden_size": s.hidden_size,
            "intermediate_size": s.ffn_size,
            "num_hidden_layers": s.n_layers,
            "num_attention_heads": s.n_head,
            "num_key_value_heads": s.n_kv_head,
            "head_dim": s.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": s.rms_eps,
            "rope_theta": s.rope_theta,
            "rope_scaling": null,
            "vocab_size": s.vocab_size,
            "max_position_embeddings": s.context_length,
            "tie_word_embeddings": s.tied_embeddings,
            "bos_token_id": tok.bos_id(),
            "eos_token_id": tok.eos_id(),
            "torch_dtype": dtype.torch_dtype(),
            "use_cache": true,
            "initializer_range": 0.02,
            "transformers_version": "4.45.0"
        });
        let obj = c.as_object_mut().expect("object");
        match s.arch {
            Arch::Llama => {
                if let Some(r) = &s.llama3_rope {
                    obj.insert(
                        "rope_scaling".into(),
                        json!({
                            "rope_type": "llama3",
                            "factor": r.factor,
                            "low_freq_factor": r.low_freq_factor,
                            "high_freq_factor": r.high_freq_factor,
                            "original_max_position_embeddings": r.original_context,
                        }),
                    );
                }
                obj.insert("attention_bias".into(), json!(false));
                obj.insert("mlp_bias".into(), json!(false));
                obj.insert("attention_dropout".into(), json!(0.0));
                obj.insert("pretraining_tp".into(), json!(1));
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), json!(s.context_length));
                obj.insert("max_window_layers".into(), json!(s.n_layers));
                obj.insert("attention_dropout".into(), json!(0.0));
            }
            Arch::Gemma3 => {
                let layer_types: Vec<&str> = (0..s.n_layers)
                    .map(|il| {
                        if s.is_local_layer(il) {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                obj.remove("hidden_act");
                obj.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
                obj.insert("query_pre_attn_scalar".into(), json!(s.head_dim));
                obj.insert("sliding_window".into(), json!(s.sliding_window));
                obj.insert(
                    "sliding_window_pattern".into(),
                    json!(s.sliding_window_pattern),
                );
                obj.insert("layer_types".into(), json!(layer_types));
                obj.insert("rope_local_base_freq".into(), json!(s.rope_local_theta));
                obj.insert("final_logit_softcapping".into(), Value::Null);
                obj.insert("attn_logit_softcapping".into(), Value::Null);
                obj.insert("attention_bias".into(), json!(false));
                obj.insert("attention_dropout".into(), json!(0.0));
            }
            Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Mixtral | Arch::Glm4Moe | Arch::GptOss => {
                if let Some(moe) = &s.moe {
                    Self::moe_config(obj, s, moe);
                }
            }
        }
        c
    }

    /// The mixture-of-experts, latent attention and YaRN fields of `config.json` (the file
    /// describes the model; no HF folder is written for these architectures).
    fn moe_config(obj: &mut serde_json::Map<String, Value>, s: &TinyModelSpec, moe: &MoeSpec) {
        obj.insert("num_experts_per_tok".into(), json!(moe.n_expert_used));
        match s.arch {
            Arch::Mixtral => {
                obj.insert("num_local_experts".into(), json!(moe.n_expert));
            }
            Arch::Qwen3Moe => {
                obj.insert("num_experts".into(), json!(moe.n_expert));
                obj.insert("moe_intermediate_size".into(), json!(moe.expert_ffn));
                obj.insert("norm_topk_prob".into(), json!(moe.norm_weights));
            }
            _ => {
                let scoring = match moe.gating {
                    ExpertGating::Softmax | ExpertGating::SoftmaxWeight => "softmax",
                    ExpertGating::Sigmoid => "sigmoid",
                };
                let topk_method = if moe.probs_bias {
                    "noaux_tc"
                } else if moe.n_group > 1 {
                    "group_limited_greedy"
                } else {
                    "greedy"
                };
                if s.arch == Arch::Glm4Moe {
                    obj.insert(
                        "partial_rotary_factor".into(),
                        json!(s.rope_dims as f64 / s.head_dim as f64),
                    );
                    obj.insert("num_nextn_predict_layers".into(), json!(s.nextn_layers));
                    obj.insert("attention_bias".into(), json!(true));
                    obj.insert("use_qk_norm".into(), json!(true));
                } else if moe.gating == ExpertGating::Sigmoid {
                    obj.insert("architectures".into(), json!(["DeepseekV3ForCausalLM"]));
                    obj.insert("model_type".into(), json!("deepseek_v3"));
                }
                obj.insert("topk_method".into(), json!(topk_method));
                obj.insert("n_routed_experts".into(), json!(moe.n_expert));
                obj.insert("moe_intermediate_size".into(), json!(moe.expert_ffn));
                obj.insert("n_shared_experts".into(), json!(moe.n_shared_expert));
                obj.insert("first_k_dense_replace".into(), json!(moe.leading_dense));
                obj.insert("scoring_func".into(), json!(scoring));
                obj.insert("norm_topk_prob".into(), json!(moe.norm_weights));
                obj.insert("routed_scaling_factor".into(), json!(moe.weights_scale));
                obj.insert("n_group".into(), json!(moe.n_group));
                obj.insert("topk_group".into(), json!(moe.n_group_used));
                if let Some(mla) = &s.mla {
                    let q_rank = (mla.q_lora_rank > 0).then_some(mla.q_lora_rank);
                    obj.insert("kv_lora_rank".into(), json!(mla.kv_lora_rank));
                    obj.insert("q_lora_rank".into(), json!(q_rank));
                    obj.insert("qk_rope_head_dim".into(), json!(mla.rope_dim));
                    obj.insert("qk_nope_head_dim".into(), json!(mla.nope_dim));
                    obj.insert("v_head_dim".into(), json!(mla.v_dim));
                    obj.remove("head_dim");
                }
                if let Some(y) = &s.yarn {
                    obj.insert(
                        "rope_scaling".into(),
                        json!({
                            "type": "yarn",
                            "factor": y.factor,
                            "original_max_position_embeddings": y.original_context,
                            "beta_fast": y.beta_fast,
                            "beta_slow": y.beta_slow,
                            "mscale": y.log_multiplier,
                            "mscale_all_dim": y.log_multiplier,
                        }),
                    );
                }
            }
        }
    }

    /// `model.safetensors` bytes (HF names and layout, every tensor in `dtype`). Refused for
    /// mixture-of-experts models, whose experts are held stacked rather than one tensor each.
    pub fn safetensors_bytes(&self, dtype: SafetensorsDtype) -> Result<Vec<u8>, TestkitError> {
        if self.spec.arch.is_moe() {
            return Err(TestkitError::InvalidSpec(format!(
                "{:?}: no Hugging Face safetensors are written for mixture-of-experts models",
                self.spec.arch
            )));
        }
        let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .weights
            .iter()
            .map(|(n, w)| (n.clone(), w.shape.clone(), dtype.encode(&w.data)))
            .collect();
        let mut views = Vec::with_capacity(encoded.len());
        for (n, shape, bytes) in &encoded {
            let v = safetensors::tensor::TensorView::new(dtype.st(), shape.clone(), bytes)
                .map_err(|e| TestkitError::Safetensors(format!("{n}: {e}")))?;
            views.push((n.clone(), v));
        }
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize(views, Some(meta))
            .map_err(|e| TestkitError::Safetensors(e.to_string()))
    }

    /// Every file of the HF folder, by file name, as bytes (refused for mixture-of-experts
    /// models, as [`TinyModel::safetensors_bytes`] is).
    pub fn hf_files(
        &self,
        dtype: SafetensorsDtype,
    ) -> Result<Vec<(&'static str, Vec<u8>)>, TestkitError> {
        let tok = &self.tokenizer;
        let pretty = |v: &Value| serde_json::to_vec_pretty(v).expect("json");
        let generation = json!({
            "bos_token_id": tok.bos_id(),
            "eos_token_id": tok.eos_id(),
            "transformers_version": "4.45.0"
        });
        Ok(vec![
            ("config.json", pretty(&self.config_json(dtype))),
            ("generation_config.json", pretty(&generation)),
            ("model.safetensors", self.safetensors_bytes(dtype)?),
            (
                "tokenizer.json",
                pretty(&tok.tokenizer_json(self.spec.arch.pre_tokenizer())),
            ),
            (
                "tokenizer_config.json",
                pretty(&tok.tokenizer_config_json(self.spec.context_length)),
            ),
            (
                "special_tokens_map.json",
                pretty(&tok.special_tokens_map_json()),
            ),
        ])
    }

    /// Writes the HF folder into `dir` (created if missing): `config.json`,
    /// `generation_config.json`, `model.safetensors`, `tokenizer.json`,
    /// `tokenizer_config.json`, `special_tokens_map.json`.
    pub fn write_safetensors_dir(
        &self,
        dir: impl AsRef<Path>,
        dtype: SafetensorsDtype,
    ) -> Result<(), TestkitError> {
        let dir = dir.as_ref();
        create_dir(dir)?;
        for (name, bytes) in self.hf_files(dtype)? {
            write_file(&dir.join(name), &bytes)?;
        }
        Ok(())
    }

    /// Lays the HF folder out as the Hugging Face Hub cache does and returns the snapshot
    /// folder: `<root>/models--ORG--NAME/blobs/<sha256>` holds each file,
    /// `snapshots/<commit>/<file>` is a relative symlink to `../../blobs/<sha256>` (a copy on
    /// systems without symlinks), and `refs/main` holds the 40-hex `<commit>`, which is
    /// derived from the contents. `repo_id` is `"ORG/NAME"`.
    pub fn write_hf_cache(
        &self,
        root: impl AsRef<Path>,
        repo_id: &str,
        dtype: SafetensorsDtype,
    ) -> Result<PathBuf, TestkitError> {
        let repo = root
            .as_ref()
            .join(format!("models--{}", repo_id.replace('/', "--")));
        let files = self.hf_files(dtype)?;
        let mut commit = Sha256::new();
        let mut blobs = Vec::new();
        for (name, bytes) in &files {
            let h = hex(&Sha256::digest(bytes));
            commit.update(name.as_bytes());
            commit.update(h.as_bytes());
            blobs.push((*name, h));
        }
        let commit = hex(&commit.finalize())[..40].to_string();
        create_dir(&repo.join("blobs"))?;
        create_dir(&repo.join("refs"))?;
        let snap = repo.join("snapshots").join(&commit);
        create_dir(&snap)?;
        for ((name, bytes), (_, h)) in files.iter().zip(&blobs) {
            write_file(&repo.join("blobs").join(h), bytes)?;
            let link = snap.join(name);
            if link.symlink_metadata().is_ok() {
                std::fs::remove_file(&link).map_err(|source| TestkitError::Io {
                    path: link.clone(),
                    source,
                })?;
            }
            link_or_copy(&Path::new("../../blobs").join(h), &link, bytes)?;
        }
        write_file(&repo.join("refs").join("main"), commit.as_bytes())?;
        Ok(snap)
    }
}

/// The GGUF name of HF tensor `hf_name` in architecture `arch` (llama.cpp converter names).
pub fn gguf_name_for(arch: Arch, hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let gemma = arch == Arch::Gemma3;
    let glm = arch == Arch::Glm4Moe;
    let oss = arch == Arch::GptOss;
    let qk_norm = arch.has_qk_norm();
    let part = match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" if qk_norm => "attn_q_norm.weight",
        "self_attn.k_norm.weight" if qk_norm => "attn_k_norm.weight",
        "post_attention_layernorm.weight" if gemma || glm || oss => "post_attention_norm.weight",
        "self_attn.o_proj.bias" if oss => "attn_output.bias",
        "self_attn.sinks" if oss => "attn_sinks.weight",
        "mlp.gate.bias" if oss => "ffn_gate_inp.bias",
        "mlp.experts.gate_proj.bias" if oss => "ffn_gate_exps.bias",
        "mlp.experts.up_proj.bias" if oss => "ffn_up_exps.bias",
        "mlp.experts.down_proj.bias" if oss => "ffn_down_exps.bias",
        "eh_proj.weight" if glm => "nextn.eh_proj.weight",
        "enorm.weight" if glm => "nextn.enorm.weight",
        "hnorm.weight" if glm => "nextn.hnorm.weight",
        "shared_head.norm.weight" if glm => "nextn.shared_head_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "pre_feedforward_layernorm.weight" if gemma => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" if gemma => "post_ffw_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return moe_gguf_part(arch, rest).map(|part| format!("blk.{layer}.{part}")),
    };
    Some(format!("blk.{layer}.{part}"))
}

/// The GGUF name (after `blk.N.`) of a mixture-of-experts or latent-attention tensor of
/// `arch`, from its name after `model.layers.N.`.
fn moe_gguf_part(arch: Arch, rest: &str) -> Option<&'static str> {
    let part = match (arch, rest) {
        (Arch::Mixtral, "block_sparse_moe.gate.weight") => "ffn_gate_inp.weight",
        (Arch::Mixtral, "block_sparse_moe.experts.w1.weight") => "ffn_gate_exps.weight",
        (Arch::Mixtral, "block_sparse_moe.experts.w3.weight") => "ffn_up_exps.weight",
        (Arch::Mixtral, "block_sparse_moe.experts.w2.weight") => "ffn_down_exps.weight",
        (Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Glm4Moe | Arch::GptOss, "mlp.gate.weight") => {
            "ffn_gate_inp.weight"
        }
        (
            Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Glm4Moe | Arch::GptOss,
            "mlp.experts.gate_proj.weight",
        ) => "ffn_gate_exps.weight",
        (
            Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Glm4Moe | Arch::GptOss,
            "mlp.experts.up_proj.weight",
        ) => "ffn_up_exps.weight",
        (
            Arch::Qwen3Moe | Arch::Deepseek2 | Arch::Glm4Moe | Arch::GptOss,
            "mlp.experts.down_proj.weight",
        ) => "ffn_down_exps.weight",
        (Arch::Deepseek2 | Arch::Glm4Moe, "mlp.gate.e_score_correction_bias") => "exp_probs_b.bias",
        (Arch::Deepseek2 | Arch::Glm4Moe, "mlp.shared_experts.gate_proj.weight") => {
            "ffn_gate_shexp.weight"
        }
        (Arch::Deepseek2 | Arch::Glm4Moe, "mlp.shared_experts.up_proj.weight") => {
            "ffn_up_shexp.weight"
        }
        (Arch::Deepseek2 | Arch::Glm4Moe, "mlp.shared_experts.down_proj.weight") => {
            "ffn_down_shexp.weight"
        }
        (Arch::Deepseek2, rest) => match rest {
            "self_attn.q_a_proj.weight" => "attn_q_a.weight",
            "self_attn.q_a_layernorm.weight" => "attn_q_a_norm.weight",
            "self_attn.q_b_proj.weight" => "attn_q_b.weight",
            "self_attn.kv_a_proj_with_mqa.weight" => "attn_kv_a_mqa.weight",
            "self_attn.kv_a_layernorm.weight" => "attn_kv_a_norm.weight",
            "self_attn.k_b_proj.weight" => "attn_k_b.weight",
            "self_attn.v_b_proj.weight" => "attn_v_b.weight",
            _ => return None,
        },
        _ => return None,
    };
    Some(part)
}

/// Zeroes what [`MoeSpec::router_dims`] reserves in weight `gguf` (of HF shape `shape`): the
/// router's columns from `router_dims` on, and the rows below `router_dims` of every matrix
/// that writes the hidden state (attention output, FFN and expert down projections).
fn reserve_router_dims(gguf: &str, shape: &[usize], data: &mut [f32], moe: &MoeSpec) {
    let cols = shape.last().copied().unwrap_or(0);
    let writes_hidden = [
        ".attn_output.weight",
        ".ffn_down.weight",
        ".ffn_down_exps.weight",
        ".ffn_down_shexp.weight",
    ]
    .iter()
    .any(|suffix| gguf.ends_with(suffix));
    if gguf.ends_with(".ffn_gate_inp.weight") {
        for row in data.chunks_mut(cols) {
            row[moe.router_dims..].iter_mut().for_each(|v| *v = 0.0);
        }
    } else if writes_hidden {
        let rows = shape[shape.len() - 2];
        for matrix in data.chunks_mut(rows * cols) {
            matrix[..moe.router_dims * cols]
                .iter_mut()
                .for_each(|v| *v = 0.0);
        }
    }
}

/// Whether GGUF holds weight `gguf` (of HF shape `shape`) in F32 whatever type `ty` the file
/// asks for: the expert router and every bias always (llama.cpp's converter and quantizer
/// never quantize them; gpt-oss's expert biases are 2-D), and `attn_k_b` when its rows (the last dimension) are not whole blocks of `ty`.
pub fn kept_f32(gguf: &str, shape: &[usize], ty: GgmlType) -> bool {
    gguf.ends_with(".ffn_gate_inp.weight")
        || gguf.ends_with(".bias")
        || (gguf.ends_with(".attn_k_b.weight")
            && !shape
                .last()
                .is_some_and(|c| c.is_multiple_of(ty.block_size())))
}

/// Sort key placing tensors as llama.cpp files usually have them: embedding, blocks in
/// order, then output norm and head.
fn gguf_order_key(hf: &str) -> (usize, usize, usize) {
    const PARTS: &[&str] = &[
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.q_norm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.k_norm.weight",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.k_b_proj.weight",
        "self_attn.v_b_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.o_proj.bias",
        "self_attn.sinks",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.bias",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.gate_proj.weight",
        "mlp.experts.gate_proj.bias",
        "mlp.experts.up_proj.weight",
        "mlp.experts.up_proj.bias",
        "mlp.experts.down_proj.weight",
        "mlp.experts.down_proj.bias",
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.w1.weight",
        "block_sparse_moe.experts.w3.weight",
        "block_sparse_moe.experts.w2.weight",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
        "post_feedforward_layernorm.weight",
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "",
    ];
    match hf {
        "model.embed_tokens.weight" => (0, 0, 0),
        "model.norm.weight" => (2, 0, 0),
        "lm_head.weight" => (3, 0, 0),
        _ => {
            let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
            let (l, part) = rest.split_once('.').unwrap_or((rest, ""));
            let l = l.parse().unwrap_or(usize::MAX);
            let p = PARTS.iter().position(|x| *x == part).unwrap_or(PARTS.len());
            (1, l, p)
        }
    }
}

/// llama.cpp's converter permutation of q/k rows: rows seen as `(n_head, 2, head_dim/2)` with
/// the last two axes swapped, i.e. new row `h*hd + 2i + j` = old row `h*hd + j*hd/2 + i`.
pub fn permute_rows(w: &Weight, n_head: usize) -> Weight {
    let cols: usize = w.shape[1..].iter().product();
    Weight {
        shape: w.shape.clone(),
        data: permute_row_chunks(&w.data, cols, n_head),
    }
}

/// The inverse of [`permute_rows`] (GGUF layout back to HF layout).
pub fn unpermute_rows(w: &Weight, n_head: usize) -> Weight {
    let cols: usize = w.shape[1..].iter().product();
    Weight {
        shape: w.shape.clone(),
        data: move_row_chunks(&w.data, cols, n_head, false),
    }
}

/// [`permute_rows`] on any row-major data with rows of `row_len` items (e.g. the encoded
/// blocks of a quantized weight, one run of blocks per row).
pub fn permute_row_chunks<T: Copy>(data: &[T], row_len: usize, n_head: usize) -> Vec<T> {
    move_row_chunks(data, row_len, n_head, true)
}

fn move_row_chunks<T: Copy>(data: &[T], row_len: usize, n_head: usize, forward: bool) -> Vec<T> {
    let rows = data.len() / row_len;
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = data.to_vec();
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf = h * hd + 2 * i + j;
                let hf = h * hd + j * half + i;
                let (dst, src) = if forward { (gguf, hf) } else { (hf, gguf) };
                out[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&data[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn create_dir(dir: &Path) -> Result<(), TestkitError> {
    std::fs::create_dir_all(dir).map_err(|source| TestkitError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TestkitError> {
    std::fs::write(path, bytes).map_err(|source| TestkitError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(unix)]
fn link_or_copy(target: &Path, link: &Path, _bytes: &[u8]) -> Result<(), TestkitError> {
    std::os::unix::fs::symlink(target, link).map_err(|source| TestkitError::Io {
        path: link.to_path_buf(),
        source,
    })
}

#[cfg(not(unix))]
fn link_or_copy(_target: &Path, link: &Path, bytes: &[u8]) -> Result<(), TestkitError> {
    write_file(link, bytes)
}
