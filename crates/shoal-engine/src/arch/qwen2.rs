//! Qwen2 / Qwen2.5: the Llama block plus biases on the q, k and v projections, NeoX-style
//! (first half / second half) RoPE with a large base frequency.

use shoal_model::gguf::Metadata;

use super::{common_gguf, common_hf};
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::EngineError;

/// Config from GGUF metadata (`qwen2.*` keys).
///
/// # Errors
/// When a required key is missing or malformed.
pub fn from_gguf(md: &Metadata, vocab: usize) -> Result<ModelConfig, EngineError> {
    let mut c = common_gguf(md, Arch::Qwen2, vocab)?;
    c.qkv_bias = true;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}

/// Config from a Hugging Face `config.json` (`model_type` qwen2).
///
/// # Errors
/// When a required field is missing.
pub fn from_hf(json: &serde_json::Value, source: &str) -> Result<ModelConfig, EngineError> {
    let mut c = common_hf(json, Arch::Qwen2, source)?;
    c.qkv_bias = true;
    c.rope_style = RopeStyle::Halves;
    Ok(c)
}
