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
}

/// Hyperparameters of one model, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layer: usize,
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
}

impl ModelConfig {
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
