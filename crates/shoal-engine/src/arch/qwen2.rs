//! Qwen2 / Qwen2.5: the Llama block plus biases on the q, k and v projections, NeoX-style
//! (first half / second half) RoPE with a large base frequency.

use shoal_model::gguf::Metadata;

use super::{common_gguf, common_hf, required, ArchSpec, Role, DECODER_TENSORS};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::EngineError;

/// The qwen2 architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen2,
    gguf_name: "qwen2",
    hf_model_types: &["qwen2"],
    model_tensors: &DECODER_TENSORS,
    layer_tensors: &[
        required(Role::AttnNorm, "attn_norm.weight", "input_layernorm.weight"),
        required(Role::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"),
        required(Role::AttnK, "attn_k.weight", "self_attn.k_proj.weight"),
        required(Role::AttnV, "attn_v.weight", "self_attn.v_proj.weight"),
        required(Role::AttnQBias, "attn_q.bias", "self_attn.q_proj.bias"),
        required(Role::AttnKBias, "attn_k.bias", "self_attn.k_proj.bias"),
        required(Role::AttnVBias, "attn_v.bias", "self_attn.v_proj.bias"),
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

/// Config from GGUF metadata (`qwen2.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Qwen2, vocab)?;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}

/// Config from a Hugging Face `config.json` (`model_type` qwen2).
///
/// # Errors
/// When a required field is missing.
pub fn from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let mut c = common_hf(json, Arch::Qwen2, source)?;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}
