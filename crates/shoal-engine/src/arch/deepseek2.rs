//! DeepSeek V2/V3 (and Kimi K2, which shares its GGUF architecture): multi-head latent
//! attention and a mixture of routed and shared experts after a few dense layers.
//!
//! Attention compresses each token's keys and values into a latent (`attn_kv_a_mqa`:
//! `kv_lora_rank` values, RMS-normed, plus a `rope_dims` key part shared by every head that
//! carries RoPE); that is all the KV cache holds. Queries come from `attn_q` (V2-Lite) or
//! through a compression (`attn_q_a`, its norm, `attn_q_b`: V2, V3), in heads of `nope_dims +
//! rope_dims`. In the absorbed form each head's non-rope query is multiplied into the latent
//! space by its slice of `attn_k_b`, attention runs over the latents as one shared KV head,
//! and each head's result goes back out through `attn_v_b` before `attn_output`. RoPE pairs
//! adjacent dimensions (ggml's normal mode), with YaRN scaling where the file says so; the
//! attention scale then grows by YaRN's magnitude scale squared.
//!
//! Routing: a softmax over the router's logits (V2), or a sigmoid with a per-expert bias
//! (`exp_probs_b`) added for selection only and group-limited top-k (V3, K2); the chosen
//! weights are renormalised where `expert_weights_norm` says, and scaled by
//! `expert_weights_scale`. Shared experts (`ffn_*_shexp`) run for every token, and the
//! first `leading_dense_block_count` layers have a dense feed-forward instead.

use shoal_model::gguf::Metadata;

use super::{
    common_gguf, moe_gguf, optional, required, ArchSpec, Role, DECODER_TENSORS, DIM_MAX,
    EXPERT_TENSORS,
};
use crate::config::{Arch, MlaConfig, ModelConfig, RopeStyle};
use crate::EngineError;

/// The deepseek2 architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Deepseek2,
    gguf_name: "deepseek2",
    hf_model_types: &[],
    model_tensors: &DECODER_TENSORS,
    layer_tensors: &[
        required(Role::AttnNorm, "attn_norm.weight", ""),
        optional(Role::AttnQ, "attn_q.weight", ""),
        optional(Role::AttnQA, "attn_q_a.weight", ""),
        optional(Role::AttnQANorm, "attn_q_a_norm.weight", ""),
        optional(Role::AttnQB, "attn_q_b.weight", ""),
        required(Role::AttnKvAMqa, "attn_kv_a_mqa.weight", ""),
        required(Role::AttnKvANorm, "attn_kv_a_norm.weight", ""),
        optional(Role::AttnKB, "attn_k_b.weight", ""),
        optional(Role::AttnVB, "attn_v_b.weight", ""),
        optional(Role::AttnKvB, "attn_kv_b.weight", ""),
        required(Role::AttnOut, "attn_output.weight", ""),
        required(Role::FfnNorm, "ffn_norm.weight", ""),
        optional(Role::FfnGate, "ffn_gate.weight", ""),
        optional(Role::FfnUp, "ffn_up.weight", ""),
        optional(Role::FfnDown, "ffn_down.weight", ""),
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

/// Config from GGUF metadata (`deepseek2.*` keys).
///
/// # Errors
/// When a required key is missing or malformed, or the shapes do not fit each other.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Deepseek2, vocab)?;
    let k = |s: &str| format!("deepseek2.{s}");
    let bad = |problem: String| EngineError::Config {
        file: "deepseek2".into(),
        problem,
    };
    c.rope_style = RopeStyle::Interleaved;
    let rope_dims = md
        .opt_usize_max(&k("rope.dimension_count"), DIM_MAX)?
        .ok_or_else(|| bad("deepseek2.rope.dimension_count is missing".into()))?;
    // files from current converters give the absorbed form's per-head sizes under
    // `*_length_mla`; older ones give them as the attention's key and value lengths
    let key = match md.opt_usize_max(&k("attention.key_length_mla"), DIM_MAX)? {
        Some(n) => n,
        None => md.usize_max(&k("attention.key_length"), DIM_MAX)?,
    };
    let value = match md.opt_usize_max(&k("attention.value_length_mla"), DIM_MAX)? {
        Some(n) => n,
        None => md.usize_max(&k("attention.value_length"), DIM_MAX)?,
    };
    if key <= rope_dims {
        return Err(bad(format!(
            "a head's key length {key} leaves no room beside {rope_dims} rope dimensions"
        )));
    }
    let mla = MlaConfig {
        q_lora_rank: md
            .opt_usize_max(&k("attention.q_lora_rank"), DIM_MAX)?
            .unwrap_or(0),
        kv_lora_rank: md.usize_max(&k("attention.kv_lora_rank"), DIM_MAX)?,
        rope_dims,
        nope_dims: key - rope_dims,
        v_dims: value,
    };
    let mut mscale = 1.0f32;
    if let Some(y) = c.yarn.as_mut() {
        // the converter stores 0.1 x mscale_all_dim
        let log_mul = md
            .opt_f64(&k("rope.scaling.yarn_log_multiplier"))?
            .map_or(0.0, |v| v as f32 / 0.1);
        let factor = c.rope_scale as f32;
        if log_mul != 0.0 {
            // DeepSeek's mscale equals its mscale_all_dim, so the rotation itself is not
            // scaled (YaRN's own 1 + 0.1 ln(factor) is cancelled); the attention scale
            // takes the magnitude scale instead
            y.attn_factor = 1.0 / (1.0 + 0.1 * factor.ln())
                * md.opt_f64(&k("rope.scaling.attn_factor"))?
                    .map_or(1.0, |v| v as f32);
        }
        y.log_mul = log_mul;
        let attn_factor_org = y.attn_factor * (1.0 + 0.1 * factor.ln());
        mscale = attn_factor_org * (1.0 + 0.1 * log_mul * factor.ln());
    }
    c.attn_scale = f64::from(mscale * mscale) / (key as f64).sqrt();
    // a query head is `key` wide; every head reads the one latent
    c.head_dim = key;
    c.n_kv_head = 1;
    c.mla = Some(mla);
    c.moe = moe_gguf(md, Arch::Deepseek2, c.ffn)?;
    if let Some(m) = &c.moe {
        if m.expert_ffn == 0 {
            return Err(bad("deepseek2.expert_feed_forward_length is 0".into()));
        }
    }
    Ok(c)
}
