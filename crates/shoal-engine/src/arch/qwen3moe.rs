//! Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 block (per-head q/k norms, no
//! biases) with a routed mixture of experts for its feed-forward: a softmax router over
//! every expert, the top `expert_used_count` chosen and their weights renormalised to sum
//! to one, no shared expert.

use shoal_model::gguf::Metadata;

use super::{common_gguf, moe_gguf, required, ArchSpec, Role, DECODER_TENSORS, EXPERT_TENSORS};
use crate::config::{Arch, Gating, ModelConfig, RopeStyle};
use crate::EngineError;

/// The qwen3moe architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen3Moe,
    gguf_name: "qwen3moe",
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
            Role::FfnNorm,
            "ffn_norm.weight",
            "post_attention_layernorm.weight",
        ),
        EXPERT_TENSORS[0],
        EXPERT_TENSORS[1],
        EXPERT_TENSORS[2],
        EXPERT_TENSORS[3],
        EXPERT_TENSORS[4],
    ],
    from_gguf,
    from_hf: None,
    permutes_qk: false,
};

/// Config from GGUF metadata (`qwen3moe.*` keys).
///
/// # Errors
/// When a required key is missing or malformed, or the file has no experts.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Qwen3Moe, vocab)?;
    c.rope_style = RopeStyle::Halves;
    let mut moe = moe_gguf(md, Arch::Qwen3Moe, c.ffn)?.ok_or_else(|| EngineError::Config {
        file: "qwen3moe".into(),
        problem: "qwen3moe.expert_count is missing or 0".into(),
    })?;
    moe.gating = Gating::Softmax;
    moe.norm_weights = true;
    c.moe = Some(moe);
    Ok(c)
}
