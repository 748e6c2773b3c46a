//! The resolved hyperparameters of a decoder-only transformer, whatever file they came from.
//! Each architecture module reads its own field names (GGUF metadata keys or Hugging Face
//! `config.json` fields) into this one struct; the forward pass reads only this and the
//! tensors its architecture's table says a file holds.

use std::sync::Arc;

/// The architectures the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, Mistral: RMSNorm, SwiGLU, interleaved RoPE in GGUF files.
    Llama,
    /// Qwen2 / Qwen2.5: Llama plus q/k/v biases, NeoX-style RoPE.
    Qwen2,
    /// Qwen3 (dense): Qwen2 without biases, with per-head q/k norms.
    Qwen3,
    /// Gemma 3: q/k norms, post-attention and post-FFN norms, GELU gate, scaled embeddings,
    /// sliding-window attention on five of every six layers.
    Gemma3,
    /// Qwen3 MoE: the Qwen3 block with a routed mixture of experts for its feed-forward.
    Qwen3Moe,
    /// GLM-4.5 / 4.6 / 4.7 (`glm4moe`): q/k/v biases, optional q/k norms, RoPE on half of
    /// each head, leading dense layers, then routed experts (sigmoid with a selection bias)
    /// and a shared expert; its multi-token-prediction layers are not run.
    Glm4Moe,
    /// DeepSeek V2/V3 (and Kimi K2): multi-head latent attention, routed and shared
    /// experts, leading dense layers.
    Deepseek2,
    /// gpt-oss (`gpt-oss`): biased attention with a learned sink per head, sliding-window
    /// and full layers alternating, YaRN on both, routed experts with biases chosen by their
    /// raw logits and weighted by a softmax over the chosen, a clamped SwiGLU.
    GptOss,
}

/// How a router turns its logits into expert probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// A softmax over every expert (Qwen3 MoE, Mixtral, DeepSeek V2).
    Softmax,
    /// A sigmoid of each logit (DeepSeek V3, Kimi K2).
    Sigmoid,
    /// The raw logits choose; the chosen experts' weights are a softmax over their logits
    /// (gpt-oss).
    SoftmaxWeight,
}

/// The routed experts of a mixture-of-experts feed-forward.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub n_expert: usize,
    /// Experts each token is routed to.
    pub n_expert_used: usize,
    /// Inner width of one expert.
    pub expert_ffn: usize,
    /// Shared experts every token goes through (their feed-forward is `expert_ffn *
    /// n_shared` wide); 0 when there are none.
    pub n_shared: usize,
    /// Layers before the first MoE layer, which have a dense feed-forward.
    pub leading_dense: usize,
    /// How router logits become probabilities.
    pub gating: Gating,
    /// Whether the chosen experts' weights are divided by their sum.
    pub norm_weights: bool,
    /// A factor on the chosen experts' weights (1 = none).
    pub weights_scale: f32,
    /// Expert groups (group-limited routing: only the best `groups_used` groups, by the
    /// sum of their two best experts, are eligible); 1 = no groups.
    pub groups: usize,
    /// Groups a token's experts may come from.
    pub groups_used: usize,
}

/// Multi-head latent attention's shapes (DeepSeek V2/V3): keys and values are made from a
/// compressed latent per token, which is all the KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Rank of the query's compression (`attn_q_a`); 0 when queries are projected directly.
    pub q_lora_rank: usize,
    /// Rank of the key/value latent.
    pub kv_lora_rank: usize,
    /// Dimensions of a head that carry RoPE (shared by all heads on the key side).
    pub rope_dims: usize,
    /// Dimensions of a head's key without RoPE.
    pub nope_dims: usize,
    /// Dimensions of a head's value.
    pub v_dims: usize,
}

/// YaRN RoPE scaling (ggml's `rope_yarn`): pairs are interpolated or extrapolated by their
/// wavelength against the original context, and the angles' cosines and sines scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnConfig {
    /// The context the model was first trained for.
    pub original_context: usize,
    /// Extrapolation mix factor (1 where YaRN is on).
    pub ext_factor: f32,
    /// Magnitude scaling of cosines and sines before YaRN's own correction.
    pub attn_factor: f32,
    /// Wavelength bound (in rotations over the original context) of full extrapolation.
    pub beta_fast: f32,
    /// Wavelength bound of full interpolation.
    pub beta_slow: f32,
    /// DeepSeek's `mscale_all_dim`: the attention scale grows with the scaling by
    /// `1 + 0.1 * log_mul * ln(factor)` (0 = none).
    pub log_mul: f32,
}

impl Arch {
    /// The name used in GGUF `general.architecture`.
    pub fn name(self) -> &'static str {
        crate::arch::spec(self).gguf_name
    }
}

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1), (x2,x3)… — ggml's "normal" mode, used by GGUF llama files
    /// (their q/k rows were permuted by the converter to make this equivalent to NeoX).
    Interleaved,
    /// First half with second half — ggml's "neox" mode and Hugging Face's `rotate_half`.
    Halves,
}

/// The activation of the gated feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU with the tanh approximation (GeGLU).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: `g = min(gate, 7)`, `u = clamp(up, -7, 7)`, `g
    /// sigmoid(1.702 g) (u + 1)`.
    SwigluOai,
}

/// Hyperparameters of one model, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Multi-token-prediction layers the file holds after the `n_layer` blocks (GLM-4.5+'s
    /// `nextn` layers), which draft tokens for speculative decoding and are not part of the
    /// model's own forward pass.
    pub mtp_layers: usize,
    /// Whether a rank holding the whole model loads the first prediction layer, to draft
    /// with it ([`crate::model::LoadedModel::load_with_mtp`]); off by default, so a model
    /// that never drafts with it does not hold it.
    pub load_mtp: bool,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_kv_head: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Inner width of the feed-forward block.
    pub ffn: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Epsilon of every RMSNorm.
    pub rms_eps: f64,
    /// RoPE base frequency of the global-attention layers.
    pub rope_theta: f64,
    /// RoPE base frequency of the sliding-window layers (Gemma 3), when different.
    pub rope_theta_local: f64,
    /// Linear RoPE scaling factor of the global layers (1.0 = none).
    pub rope_scale: f64,
    /// How RoPE pairs dimensions.
    pub rope_style: RopeStyle,
    /// Dimensions of each head RoPE rotates, the first ones, where a model rotates only part
    /// of its heads (GLM-4.5: half); `None` = the whole head.
    pub rope_dims: Option<usize>,
    /// Per-pair divisors of the global layers' RoPE frequencies (Llama 3.1 scaling) from
    /// a `config.json`; GGUF files hold them as a tensor instead.
    pub rope_freq_factors: Option<Arc<[f32]>>,
    /// Context length the model was trained for.
    pub context_len: usize,
    /// Scale applied to queries before the dot product.
    pub attn_scale: f64,
    /// Multiplier applied to token embeddings (Gemma: sqrt(hidden)).
    pub embed_scale: f64,
    /// Feed-forward activation.
    pub activation: Activation,
    /// Sliding-window size for local layers (Gemma 3), if any.
    pub sliding_window: Option<usize>,
    /// Every `n`-th layer (1-based) is global; others use the sliding window.
    pub sliding_pattern: usize,
    /// Whether the sliding-window layers' RoPE is scaled as the global layers' is (gpt-oss);
    /// otherwise they rotate unscaled (Gemma 3).
    pub sliding_rope_scaled: bool,
    /// The routed experts, for a mixture-of-experts model.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention, for DeepSeek V2/V3.
    pub mla: Option<MlaConfig>,
    /// YaRN RoPE scaling of the global layers (with `rope_scale` as its factor).
    pub yarn: Option<YarnConfig>,
}

impl ModelConfig {
    /// Whether layer `layer`'s feed-forward is a mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer >= m.leading_dense)
    }

    /// Values of one head's attention output (what the output projection reads per head):
    /// the value width of latent attention, else the head size.
    pub fn head_out_dim(&self) -> usize {
        self.mla.map_or(self.head_dim, |m| m.v_dims)
    }

    /// Values one position of one layer keeps in the KV cache: keys and values of every KV
    /// head, or MLA's latent and rope key.
    pub fn kv_values_per_token_per_layer(&self) -> usize {
        match &self.mla {
            Some(m) => m.kv_lora_rank + m.rope_dims,
            None => 2 * self.n_kv_head * self.head_dim,
        }
    }

    /// Bytes one position of one layer takes in the (f16) KV cache.
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        (self.kv_values_per_token_per_layer() * std::mem::size_of::<half::f16>()) as u64
    }

    /// Whether layer `layer` attends only within the sliding window.
    pub fn is_local_layer(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && self.sliding_pattern > 0
            && !(layer + 1).is_multiple_of(self.sliding_pattern)
    }

    /// Checks the relations the forward pass relies on.
    ///
    /// # Errors
    /// A message naming the inconsistent fields.
    pub fn validate(&self) -> Result<(), String> {
        let nonzero = [
            ("block_count", self.n_layer),
            ("embedding_length", self.hidden),
            ("head_count", self.n_head),
            ("head_count_kv", self.n_kv_head),
            ("head_dim", self.head_dim),
            ("feed_forward_length", self.ffn),
            ("vocab_size", self.vocab),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return Err(format!("{name} is 0"));
            }
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_head, self.n_kv_head
            ));
        }
        if let Some(d) = self.rope_dims {
            if d == 0 || !d.is_multiple_of(2) || d > self.head_dim {
                return Err(format!(
                    "rope dimension count {d} must be even, above 0 and at most the head size {}",
                    self.head_dim
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        const LIMIT: usize = 1 << 24;
        if [
            self.n_layer,
            self.hidden,
            self.n_head,
            self.head_dim,
            self.ffn,
            self.vocab,
        ]
        .iter()
        .any(|&v| v > LIMIT)
        {
            return Err("a dimension is larger than 16M; the file is corrupt".into());
        }
        if let Some(m) = &self.moe {
            if m.n_expert == 0 || m.expert_ffn == 0 {
                return Err(format!(
                    "expert_count {} or expert_feed_forward_length {} is 0",
                    m.n_expert, m.expert_ffn
                ));
            }
            if m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
                return Err(format!(
                    "expert_used_count {} must be between 1 and expert_count {}",
                    m.n_expert_used, m.n_expert
                ));
            }
            if m.n_expert > LIMIT || m.expert_ffn > LIMIT || m.n_shared > 64 {
                return Err(
                    "an expert count or width is implausibly large; the file is corrupt".into(),
                );
            }
            if m.groups == 0
                || !m.n_expert.is_multiple_of(m.groups)
                || m.groups_used == 0
                || m.groups_used > m.groups
                || (m.groups > 1 && m.n_expert_used > m.groups_used * (m.n_expert / m.groups))
            {
                return Err(format!(
                    "expert_group_count {} and expert_group_used_count {} do not fit {} experts \
                     with {} used",
                    m.groups, m.groups_used, m.n_expert, m.n_expert_used
                ));
            }
            if m.leading_dense > self.n_layer {
                return Err(format!(
                    "leading_dense_block_count {} is above block_count {}",
                    m.leading_dense, self.n_layer
                ));
            }
            if !(m.weights_scale.is_finite() && m.weights_scale > 0.0) {
                return Err(format!(
                    "expert_weights_scale {} is out of range",
                    m.weights_scale
                ));
            }
        }
        if let Some(m) = &self.mla {
            if m.kv_lora_rank == 0 || m.rope_dims == 0 || m.v_dims == 0 || m.nope_dims == 0 {
                return Err(format!("the latent attention's shapes {m:?} have a zero"));
            }
            if !m.rope_dims.is_multiple_of(2) {
                return Err(format!("rope dimension count {} is odd", m.rope_dims));
            }
            if [
                m.q_lora_rank,
                m.kv_lora_rank,
                m.rope_dims,
                m.nope_dims,
                m.v_dims,
            ]
            .iter()
            .any(|&v| v > LIMIT)
            {
                return Err(
                    "a latent attention dimension is larger than 16M; the file is corrupt".into(),
                );
            }
        }
        let eps_ok = self.rms_eps > 0.0 && self.rms_eps < 1.0;
        let theta_ok = self.rope_theta.is_finite() && self.rope_theta > 0.0;
        if !eps_ok || !theta_ok {
            return Err(format!(
                "rms_eps {} or rope_theta {} is out of range",
                self.rms_eps, self.rope_theta
            ));
        }
        Ok(())
    }
}
