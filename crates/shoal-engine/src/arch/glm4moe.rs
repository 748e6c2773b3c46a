//! GLM-4.5, 4.6 and 4.7 (`glm4moe`): grouped-query attention with biases on the q, k and v
//! projections, per-head q/k norms where the file has them (GLM-4.5 and 4.6, not 4.5-Air),
//! NeoX-style RoPE on only the first `rope.dimension_count` dimensions of each head (half of
//! it), the feed-forward's norm under the name `post_attention_norm`; the first
//! `leading_dense_block_count` layers have a dense feed-forward, the rest route through
//! experts by a sigmoid with a per-expert selection bias (`exp_probs_b`), the chosen weights
//! renormalised and scaled by `expert_weights_scale`, beside a shared expert.
//!
//! `block_count` counts the multi-token-prediction layers (`nextn_predict_layers`, the last
//! ones, with `nextn.*` tensors of their own): they are not part of the model that decodes
//! one token at a time, so `n_layer` leaves them out and `mtp_layers` counts them; a rank
//! that holds the whole model loads the first of them to draft tokens (`crate::network::mtp`),
//! and a slice fetch skips them with every other layer a rank does not hold.

use shoal_model::gguf::Metadata;

use super::{
    common_gguf, moe_gguf, optional, required, ArchSpec, Role, DECODER_TENSORS, DIM_MAX,
    EXPERT_TENSORS,
};
use crate::config::{Arch, Gating, ModelConfig, RopeStyle};
use crate::EngineError;

/// The glm4moe architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Glm4Moe,
    gguf_name: "glm4moe",
    hf_model_types: &[],
    model_tensors: &DECODER_TENSORS,
    layer_tensors: &[
        required(Role::AttnNorm, "attn_norm.weight", "input_layernorm.weight"),
        required(Role::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"),
        required(Role::AttnK, "attn_k.weight", "self_attn.k_proj.weight"),
        required(Role::AttnV, "attn_v.weight", "self_attn.v_proj.weight"),
        optional(Role::AttnQBias, "attn_q.bias", "self_attn.q_proj.bias"),
        optional(Role::AttnKBias, "attn_k.bias", "self_attn.k_proj.bias"),
        optional(Role::AttnVBias, "attn_v.bias", "self_attn.v_proj.bias"),
        optional(
            Role::AttnQNorm,
            "attn_q_norm.weight",
            "self_attn.q_norm.weight",
        ),
        optional(
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
            "post_attention_norm.weight",
            "post_attention_layernorm.weight",
        ),
        optional(Role::FfnGate, "ffn_gate.weight", "mlp.gate_proj.weight"),
        optional(Role::FfnUp, "ffn_up.weight", "mlp.up_proj.weight"),
        optional(Role::FfnDown, "ffn_down.weight", "mlp.down_proj.weight"),
        EXPERT_TENSORS[0],
        EXPERT_TENSORS[1],
        EXPERT_TENSORS[2],
        EXPERT_TENSORS[3],
        EXPERT_TENSORS[4],
        optional(Role::FfnExpProbsBias, "exp_probs_b.bias", ""),
        optional(Role::FfnGateShexp, "ffn_gate_shexp.weight", ""),
        optional(Role::FfnUpShexp, "ffn_up_shexp.weight", ""),
        optional(Role::FfnDownShexp, "ffn_down_shexp.weight", ""),
    ],
    from_gguf,
    from_hf: None,
    permutes_qk: false,
};

/// Config from GGUF metadata (`glm4moe.*` keys).
///
/// # Errors
/// When a required key is missing or malformed, the file has no experts, or its
/// multi-token-prediction layers leave no layer to run.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Glm4Moe, vocab)?;
    let bad = |problem: String| EngineError::Config {
        file: "glm4moe".into(),
        problem,
    };
    c.rope_style = RopeStyle::Halves;
    c.rope_dims = md.opt_usize_max("glm4moe.rope.dimension_count", DIM_MAX)?;
    let nextn = md
        .opt_usize_max("glm4moe.nextn_predict_layers", DIM_MAX)?
        .unwrap_or(0);
    if nextn >= c.n_layer {
        return Err(bad(format!(
            "glm4moe.nextn_predict_layers {nextn} leaves none of block_count {} to run",
            c.n_layer
        )));
    }
    c.n_layer -= nextn;
    c.mtp_layers = nextn;
    let mut moe = moe_gguf(md, Arch::Glm4Moe, c.ffn)?
        .ok_or_else(|| bad("glm4moe.expert_count is missing or 0".into()))?;
    if matches!(
        md.opt_usize_max("glm4moe.expert_gating_func", DIM_MAX)?,
        None | Some(0)
    ) {
        // unstated (or "none"): the architecture's sigmoid, as llama.cpp reads it
        moe.gating = Gating::Sigmoid;
    }
    c.moe = Some(moe);
    Ok(c)
}
