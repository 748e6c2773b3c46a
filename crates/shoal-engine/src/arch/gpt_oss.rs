//! gpt-oss (`gpt-oss` in GGUF: gpt-oss-20b and 120b): grouped-query attention with biases on
//! every projection (the output's too) and a learned sink logit per query head that joins
//! each softmax without a value; sliding-window layers (`attention.sliding_window`, the even
//! ones) alternating with full ones, both rotating NeoX-style with the same YaRN scaling;
//! the feed-forward's norm under `post_attention_norm`; every layer a mixture of experts
//! whose router has a bias, whose experts are chosen by their raw logits and weighted by a
//! softmax over the chosen ones, and whose experts carry biases on their gate, up and down
//! projections around a clamped SwiGLU ([`Activation::SwigluOai`]). The experts are MXFP4 in
//! the published files.

use shoal_model::gguf::Metadata;

use super::{
    common_gguf, moe_gguf, optional, required, ArchSpec, Role, DECODER_TENSORS, DIM_MAX,
    EXPERT_TENSORS,
};
use crate::config::{Activation, Arch, Gating, ModelConfig, RopeStyle};
use crate::EngineError;

/// The gpt-oss architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::GptOss,
    gguf_name: "gpt-oss",
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
        required(
            Role::AttnOut,
            "attn_output.weight",
            "self_attn.o_proj.weight",
        ),
        required(
            Role::AttnOutBias,
            "attn_output.bias",
            "self_attn.o_proj.bias",
        ),
        required(Role::AttnSinks, "attn_sinks.weight", "self_attn.sinks"),
        required(
            Role::FfnNorm,
            "post_attention_norm.weight",
            "post_attention_layernorm.weight",
        ),
        EXPERT_TENSORS[0],
        EXPERT_TENSORS[1],
        EXPERT_TENSORS[2],
        EXPERT_TENSORS[3],
        EXPERT_TENSORS[4],
        required(Role::FfnGateInpBias, "ffn_gate_inp.bias", ""),
        required(Role::FfnGateExpsBias, "ffn_gate_exps.bias", ""),
        required(Role::FfnUpExpsBias, "ffn_up_exps.bias", ""),
        required(Role::FfnDownExpsBias, "ffn_down_exps.bias", ""),
    ],
    from_gguf,
    from_hf: None,
    permutes_qk: false,
};

/// The sliding-window pattern llama.cpp applies to gpt-oss: every second layer is full.
const SLIDING_PATTERN: usize = 2;

/// Config from GGUF metadata (`gpt-oss.*` keys).
///
/// # Errors
/// When a required key is missing or malformed, or the file has no experts.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::GptOss, vocab)?;
    let bad = |problem: String| EngineError::Config {
        file: "gpt-oss".into(),
        problem,
    };
    c.rope_style = RopeStyle::Halves;
    c.activation = Activation::SwigluOai;
    let window = md
        .opt_usize_max("gpt-oss.attention.sliding_window", DIM_MAX)?
        .ok_or_else(|| bad("gpt-oss.attention.sliding_window is missing".into()))?;
    if window == 0 {
        return Err(bad("gpt-oss.attention.sliding_window is 0".into()));
    }
    c.sliding_window = Some(window);
    c.sliding_pattern = md
        .opt_usize_max("gpt-oss.attention.sliding_window_pattern", DIM_MAX)?
        .unwrap_or(SLIDING_PATTERN);
    c.sliding_rope_scaled = true;
    if let Some(base) = md.opt_f64("gpt-oss.rope.freq_base_swa")? {
        c.rope_theta_local = base;
    }
    let mut moe = moe_gguf(md, Arch::GptOss, c.ffn)?
        .ok_or_else(|| bad("gpt-oss.expert_count is missing or 0".into()))?;
    // llama.cpp's graph fixes the gating whatever the file says
    moe.gating = Gating::SoftmaxWeight;
    moe.norm_weights = false;
    moe.weights_scale = 1.0;
    c.moe = Some(moe);
    Ok(c)
}
