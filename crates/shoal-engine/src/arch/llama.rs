//! Llama family (Llama 2/3, SmolLM, Mistral): RMSNorm, SwiGLU, grouped-query attention, no
//! biases. GGUF llama files store q/k rows permuted for interleaved RoPE; Hugging Face
//! checkpoints use `rotate_half`, so the safetensors loader permutes them the same way and
//! both run the identical interleaved path.

use shoal_model::gguf::Metadata;

use super::{common_gguf, common_hf};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::EngineError;

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
    Ok(c)
}

/// Config from a Hugging Face `config.json` (`model_type` llama or mistral).
///
/// # Errors
/// When a required field is missing.
pub fn from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let mut c = common_hf(json, Arch::Llama, source)?;
    c.rope_style = RopeStyle::Interleaved;
    Ok(c)
}
