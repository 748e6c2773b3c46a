//! Qwen3 (dense): the Qwen2 block without q/k/v biases and with an RMSNorm over each head
//! of the queries and keys before RoPE. The head dimension is its own hyperparameter
//! (`key_length`, `head_dim`), not `hidden / heads` (Qwen3-0.6B: 16 heads of 128 on a
//! hidden size of 1024).

use shoal_model::gguf::Metadata;

use super::{common_gguf, common_hf, required, ArchSpec, Role, DECODER_TENSORS};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::EngineError;

/// The qwen3 architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen3,
    gguf_name: "qwen3",
    hf_model_types: &["qwen3"],
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
            Role::FfnNorm,
            "ffn_norm.weight",
            "post_attention_layernorm.weight",
        ),
        required(Role::FfnGate, "ffn_gate.weight", "mlp.gate_proj.weight"),
        required(Role::FfnUp, "ffn_up.weight", "mlp.up_proj.weight"),
        required(Role::FfnDown, "ffn_down.weight", "mlp.down_proj.weight"),
    ],
    from_gguf,
    from_hf: Some(from_hf),
    permutes_qk: false,
};

/// Config from GGUF metadata (`qwen3.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Qwen3, vocab)?;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}

/// Config from a Hugging Face `config.json` (`model_type` qwen3).
///
/// # Errors
/// When a required field is missing.
pub fn from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let mut c = common_hf(json, Arch::Qwen3, source)?;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}
