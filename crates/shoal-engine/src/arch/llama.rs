//! Llama family (Llama 2/3/3.1, SmolLM, Mistral, Mixtral): RMSNorm, SwiGLU, grouped-query
//! attention, biases on q/k/v only where a file has them, Llama 3.1's RoPE scaling where a
//! file has `rope_freqs.weight` (or a `config.json` asks for `llama3` scaling), and a routed
//! mixture of experts in place of the feed-forward where the file has `llama.expert_count`
//! (Mixtral: a softmax router, the chosen experts' weights renormalised, experts
//! `feed_forward_length` wide). GGUF llama files
//! store q/k rows permuted for interleaved RoPE; Hugging Face checkpoints use
//! `rotate_half`, so the safetensors loader permutes them the same way and both run the
//! identical interleaved path.

use std::sync::Arc;

use shoal_model::gguf::Metadata;

use super::{
    common_gguf, common_hf, moe_gguf, optional, required, ArchSpec, Role, DECODER_TENSORS,
    EXPERT_TENSORS,
};
use crate::config::{Arch, Gating, ModelConfig, RopeStyle};
use crate::EngineError;

/// The llama architecture.
pub static SPEC: ArchSpec = ArchSpec {
    arch: Arch::Llama,
    gguf_name: "llama",
    hf_model_types: &["llama", "mistral"],
    model_tensors: &[
        DECODER_TENSORS[0],
        DECODER_TENSORS[1],
        DECODER_TENSORS[2],
        optional(Role::RopeFreqs, "rope_freqs.weight", ""),
    ],
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
            Role::FfnNorm,
            "ffn_norm.weight",
            "post_attention_layernorm.weight",
        ),
        // a dense feed-forward, or a mixture of experts (Mixtral)
        optional(Role::FfnGate, "ffn_gate.weight", "mlp.gate_proj.weight"),
        optional(Role::FfnUp, "ffn_up.weight", "mlp.up_proj.weight"),
        optional(Role::FfnDown, "ffn_down.weight", "mlp.down_proj.weight"),
        EXPERT_TENSORS[0],
        EXPERT_TENSORS[1],
        EXPERT_TENSORS[2],
        EXPERT_TENSORS[3],
        EXPERT_TENSORS[4],
    ],
    from_gguf,
    from_hf: Some(from_hf),
    permutes_qk: true,
};

/// Config from GGUF metadata (`llama.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Llama, vocab)?;
    c.rms_eps = md
        .opt_f64("llama.attention.layer_norm_rms_epsilon")?
        .unwrap_or(1e-5);
    c.rope_style = RopeStyle::Interleaved;
    c.moe = moe_gguf(md, Arch::Llama, c.ffn)?.map(|mut m| {
        m.gating = Gating::Softmax;
        m.norm_weights = true;
        m
    });
    Ok(c)
}

/// Config from a Hugging Face `config.json` (`model_type` llama or mistral).
///
/// # Errors
/// When a required field is missing, or the RoPE scaling is of an unsupported kind.
pub fn from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let mut c = common_hf(json, Arch::Llama, source)?;
    c.rope_style = RopeStyle::Interleaved;
    if let Some(scaling) = json.get("rope_scaling").filter(|v| !v.is_null()) {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let num =
            |key: &str, default: f64| scaling.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
        match kind {
            "llama3" => {
                c.rope_freq_factors = Some(llama3_freq_factors(
                    c.rope_theta,
                    c.head_dim,
                    num("factor", 8.0),
                    num("low_freq_factor", 1.0),
                    num("high_freq_factor", 4.0),
                    num("original_max_position_embeddings", 8192.0),
                ));
            }
            "linear" => c.rope_scale = num("factor", 1.0),
            "default" | "" => {}
            other => {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "{source}: rope_scaling type `{other}` (supported: llama3, linear)"
                    ),
                })
            }
        }
    }
    Ok(c)
}

/// The per-pair frequency divisors of Llama 3.1's RoPE scaling, as the GGUF converter
/// writes them into `rope_freqs.weight`: pairs whose wavelength is shorter than
/// `original / high` keep their frequency, those longer than `original / low` are divided
/// by `factor`, and those between are blended smoothly.
pub fn llama3_freq_factors(
    base: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    original: f64,
) -> Arc<[f32]> {
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_blend_between_the_two_wavelengths() {
        // Llama 3.1 8B's settings: base 500000, head_dim 128
        let f = llama3_freq_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "the fastest pairs keep their frequency");
        assert_eq!(f[63], 8.0, "the slowest are divided by the factor");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "some blended: {f:?}");
    }
}
