//! Gemma 3: per-head RMSNorm on queries and keys, RMSNorms after attention and after the
//! feed-forward block (before each residual add), a GELU-gated feed-forward, embeddings
//! scaled by sqrt(hidden), and sliding-window attention (local RoPE base 10,000) on five of
//! every six layers, global attention on the sixth (unless the file's
//! `gemma3.attention.sliding_window_pattern` / `gemma3.rope.freq_base_swa` say otherwise).
//! GGUF files from llama.cpp's converter already hold the `1 + weight` Gemma norm scale, so
//! the norms are plain RMSNorms here.

use shoal_model::gguf::Metadata;

use super::{common_gguf, required, ArchSpec, Role, DECODER_TENSORS, DIM_MAX};
use crate::config::{Activation, Arch, ModelConfig, RopeStyle};
use crate::EngineError;

/// The gemma3 architecture. Hugging Face checkpoints store the norms as `w` where GGUF
/// holds `1 + w`, so they are not loaded from safetensors.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Gemma3,
    gguf_name: "gemma3",
    hf_model_types: &[],
    model_tensors: &DECODER_TENSORS,
    layer_tensors: &[
        required(Role::AttnNorm, "attn_norm.weight", "input_layernorm.weight"),
        required(Role::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"),
        required(Role::AttnK, "attn_k.weight", "self_attn.k_proj.weight"),
        required(Role::AttnV, "attn_v.weight", "self_attn.v_proj.weight"),
        required(
            Role::AttnQNorm,
            "attn_q_norm.weight",
            "self_attn.q_norm.weight",
        ),
        required(
            Role::AttnKNorm,
            "attn_k_norm.weight",
            "self_attn.k_norm.weight",
        ),
        required(
            Role::AttnOut,
            "attn_output.weight",
            "self_attn.o_proj.weight",
        ),
        required(
            Role::PostAttnNorm,
            "post_attention_norm.weight",
            "post_attention_layernorm.weight",
        ),
        required(
            Role::FfnNorm,
            "ffn_norm.weight",
            "pre_feedforward_layernorm.weight",
        ),
        required(Role::FfnGate, "ffn_gate.weight", "mlp.gate_proj.weight"),
        required(Role::FfnUp, "ffn_up.weight", "mlp.up_proj.weight"),
        required(Role::FfnDown, "ffn_down.weight", "mlp.down_proj.weight"),
        required(
            Role::PostFfnNorm,
            "post_ffw_norm.weight",
            "post_feedforward_layernorm.weight",
        ),
    ],
    from_gguf,
    from_hf: None,
    permutes_qk: false,
};

/// RoPE base of the sliding-window layers when the file does not say (llama.cpp's value).
const LOCAL_ROPE_THETA: f64 = 10_000.0;
/// Every sixth layer attends globally, when the file does not say (llama.cpp's value).
const SLIDING_PATTERN: usize = 6;

/// Config from GGUF metadata (`gemma3.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Gemma3, vocab)?;
    c.rope_style = RopeStyle::Halves;
    c.rope_theta_local = md
        .opt_f64("gemma3.rope.freq_base_swa")?
        .filter(|&t| t > 0.0)
        .unwrap_or(LOCAL_ROPE_THETA);
    c.activation = Activation::GeluTanh;
    c.embed_scale = (c.hidden as f64).sqrt();
    // Queries are scaled by 1/sqrt(query_pre_attn_scalar), which GGUF does not store: it is
    // head_dim except for Gemma 3 27B, where it is hidden / n_head (168, head_dim 128).
    // llama.cpp recognises 27B by its 62 layers; do the same.
    let pre_attn_scalar = if c.n_layer == 62 && c.n_head > 0 {
        c.hidden / c.n_head
    } else {
        c.head_dim
    };
    c.attn_scale = 1.0 / (pre_attn_scalar as f64).sqrt();
    c.sliding_window = md.opt_usize_max("gemma3.attention.sliding_window", DIM_MAX)?;
    // An integer period when present (a per-layer array is not supported: keep the default).
    c.sliding_pattern = match md
        .get("gemma3.attention.sliding_window_pattern")
        .and_then(|v| v.as_i64())
    {
        Some(p) if p > 0 => usize::try_from(p).unwrap_or(SLIDING_PATTERN),
        _ => SLIDING_PATTERN,
    };
    Ok(c)
}
